# cython: language_level=3
# Declarations of the subset of <cufile.h> that aioswap uses, in header order; no logic here.
# At the end, the two <dlfcn.h> GNU extensions and the one cuda.h function the loader uses.
#
# Declared here rather than taken from the header: cufile.h (and the cuda.h it includes) are
# not needed to build aioswap. libcufile is dlopen'ed at run time and every entry point is
# resolved with dlsym, so the functions are declared as pointer types (suffix _t) instead of
# prototypes. Layouts and values follow cufile.h; enums are C ints there, so they are ints here.
from posix.types cimport off_t


# CUfileOpError (cufile.h: CUFILEOP_BASE_ERR + n). 5021 and 5032 are unused in the header.
cdef enum:
    CUFILEOP_BASE_ERR = 5000
    CU_FILE_SUCCESS = 0
    CU_FILE_DRIVER_NOT_INITIALIZED = 5001
    CU_FILE_DRIVER_INVALID_PROPS = 5002
    CU_FILE_DRIVER_UNSUPPORTED_LIMIT = 5003
    CU_FILE_DRIVER_VERSION_MISMATCH = 5004
    CU_FILE_DRIVER_VERSION_READ_ERROR = 5005
    CU_FILE_DRIVER_CLOSING = 5006
    CU_FILE_PLATFORM_NOT_SUPPORTED = 5007
    CU_FILE_IO_NOT_SUPPORTED = 5008
    CU_FILE_DEVICE_NOT_SUPPORTED = 5009
    CU_FILE_NVFS_DRIVER_ERROR = 5010
    CU_FILE_CUDA_DRIVER_ERROR = 5011
    CU_FILE_CUDA_POINTER_INVALID = 5012
    CU_FILE_CUDA_MEMORY_TYPE_INVALID = 5013
    CU_FILE_CUDA_POINTER_RANGE_ERROR = 5014
    CU_FILE_CUDA_CONTEXT_MISMATCH = 5015
    CU_FILE_INVALID_MAPPING_SIZE = 5016
    CU_FILE_INVALID_MAPPING_RANGE = 5017
    CU_FILE_INVALID_FILE_TYPE = 5018
    CU_FILE_INVALID_FILE_OPEN_FLAG = 5019
    CU_FILE_DIO_NOT_SET = 5020
    CU_FILE_INVALID_VALUE = 5022
    CU_FILE_MEMORY_ALREADY_REGISTERED = 5023
    CU_FILE_MEMORY_NOT_REGISTERED = 5024
    CU_FILE_PERMISSION_DENIED = 5025
    CU_FILE_DRIVER_ALREADY_OPEN = 5026
    CU_FILE_HANDLE_NOT_REGISTERED = 5027
    CU_FILE_HANDLE_ALREADY_REGISTERED = 5028
    CU_FILE_DEVICE_NOT_FOUND = 5029
    CU_FILE_INTERNAL_ERROR = 5030
    CU_FILE_GETNEWFD_FAILED = 5031
    CU_FILE_NVFS_SETUP_ERROR = 5033
    CU_FILE_IO_DISABLED = 5034
    CU_FILE_BATCH_SUBMIT_FAILED = 5035
    CU_FILE_GPU_MEMORY_PINNING_FAILED = 5036
    CU_FILE_BATCH_FULL = 5037
    CU_FILE_ASYNC_NOT_SUPPORTED = 5038
    CU_FILE_INTERNAL_BATCH_SETUP_ERROR = 5039
    CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR = 5040
    CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR = 5041
    CU_FILE_INTERNAL_BATCH_CANCEL_ERROR = 5042
    CU_FILE_NOMEM_ERROR = 5043
    CU_FILE_IO_ERROR = 5044
    CU_FILE_INTERNAL_BUF_REGISTER_ERROR = 5045
    CU_FILE_HASH_OPR_ERROR = 5046
    CU_FILE_INVALID_CONTEXT_ERROR = 5047
    CU_FILE_NVFS_INTERNAL_DRIVER_ERROR = 5048
    CU_FILE_BATCH_NOCOMPAT_ERROR = 5049
    CU_FILE_IO_MAX_ERROR = 5050

ctypedef int CUfileOpError
ctypedef int CUresult           # enum cudaError_enum of cuda.h

cdef struct CUfileError_t:
    CUfileOpError err
    CUresult cu_err             # meaningful when err == CU_FILE_CUDA_DRIVER_ERROR

# CUfileDrvProps_t, CUfileDriverStatusFlags_t, ... left out

# enum CUfileFileHandleType
cdef enum:
    CU_FILE_HANDLE_TYPE_OPAQUE_FD = 1
    CU_FILE_HANDLE_TYPE_OPAQUE_WIN32 = 2
    CU_FILE_HANDLE_TYPE_USERSPACE_FS = 3

# The header's anonymous union inside CUfileDescr_t, named so Cython can declare it;
# same layout.
cdef union CUfileDescrHandle:
    int fd
    void* handle

cdef struct CUfileDescr_t:
    int type                    # enum CUfileFileHandleType
    CUfileDescrHandle handle
    const void* fs_ops          # const CUfileFSOps_t*; aioswap only passes NULL

ctypedef void* CUfileHandle_t

# ---- driver ----
ctypedef CUfileError_t (*cuFileDriverOpen_t)() noexcept nogil
# cufile.h maps cuFileDriverClose to cuFileDriverClose_v2 where the library has it
ctypedef CUfileError_t (*cuFileDriverClose_t)() noexcept nogil
# cuFileDriverGetProperties, cuFileDriverSetPollMode, ... left out
ctypedef CUfileError_t (*cuFileGetVersion_t)(int* version) noexcept nogil

# ---- files and buffers ----
ctypedef CUfileError_t (*cuFileHandleRegister_t)(CUfileHandle_t* fh,
                                                 CUfileDescr_t* descr) noexcept nogil
ctypedef void (*cuFileHandleDeregister_t)(CUfileHandle_t fh) noexcept nogil
ctypedef CUfileError_t (*cuFileBufRegister_t)(const void* bufPtr_base, size_t length,
                                              int flags) noexcept nogil
ctypedef CUfileError_t (*cuFileBufDeregister_t)(const void* bufPtr_base) noexcept nogil

# ---- synchronous I/O ----
ctypedef ssize_t (*cuFileRead_t)(CUfileHandle_t fh, void* bufPtr_base, size_t size,
                                 off_t file_offset, off_t bufPtr_offset) noexcept nogil
ctypedef ssize_t (*cuFileWrite_t)(CUfileHandle_t fh, const void* bufPtr_base, size_t size,
                                  off_t file_offset, off_t bufPtr_offset) noexcept nogil

# batch I/O, stream-ordered I/O, parameters and statistics left out


# ---- <dlfcn.h>: GNU extensions (Python.h defines _GNU_SOURCE before this header) ----
cdef extern from "<dlfcn.h>" nogil:
    ctypedef struct Dl_info:
        const char* dli_fname
        void* dli_fbase
        const char* dli_sname
        void* dli_saddr
    int dladdr(const void* addr, Dl_info* info)
    int RTLD_NOLOAD

# ---- cuda.h: cuGetErrorName, looked up in an already loaded libcuda for messages only ----
ctypedef int (*cuGetErrorName_t)(int error, const char** name) noexcept nogil
