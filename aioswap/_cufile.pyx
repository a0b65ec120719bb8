# cython: language_level=3, embedsignature=True
"""cuFile (GPUDirect Storage), loaded with ``dlopen`` at run time: the C calls only.

Nothing here needs CUDA to build or to import: the subset of ``cufile.h`` in use is declared
in ``_cufile_api.pxd`` and every entry point is resolved with ``dlsym`` the first time cuFile
is used (:func:`load`). Where the library is missing, every call that needs it raises
:class:`~aioswap.errors.CuFileUnavailable` naming each place that was tried.

- :func:`driver_open` / :func:`driver_close` (or :class:`Driver`) are reference counted: the
  first user opens the cuFile driver, the last one closes it. File and buffer registrations
  hold a reference of their own.
- :class:`CuFileHandle` registers a file with ``cuFileHandleRegister``; handles on the same
  open file share one registration. ``read``/``write`` continue short counts to completion.
- :func:`buf_register` / :func:`buf_deregister` register device memory with cuFile and
  nothing else: the record of registered ranges (overlap checks, the registered base of an
  interior address, the owner kept alive) is the device index of :mod:`aioswap.pinned`.

Policy lives in the typed :mod:`aioswap._cufile_load`: which libraries are tried, and the
environment cuFile reads (its log file, pointed at a private temporary directory unless
``CUFILE_LOGFILE_PATH`` is set, and a driver config). Nothing here knows about torch: device
memory is a raw address whose owner the caller keeps alive.
"""
cimport aioswap._cufile_api as cf
from cpython.exc cimport PyErr_CheckSignals
cimport libc.errno as cerrno
from libc.errno cimport EINTR, EIO
from libc.stdint cimport uintptr_t
from libc.string cimport memset
from posix.dlfcn cimport RTLD_LOCAL, RTLD_NOW, dlclose, dlerror, dlopen, dlsym
from posix.types cimport off_t

import fcntl
import io
import logging
import operator
import os
import sys
import threading
import warnings

from aioswap import _cufile_load as _policy
from aioswap._aio import open_file
from aioswap.errors import CuFileError, CuFileUnavailable, HandleClosedError, ShortReadError

__all__ = [
    "CuFileHandle",
    "Driver",
    "available",
    "buf_deregister",
    "buf_register",
    "driver_close",
    "driver_open",
    "driver_users",
    "error_message",
    "error_name",
    "library_path",
    "load",
    "version",
]

_log = logging.getLogger("aioswap")

LIB_ENV = _policy.LIB_ENV
SONAMES = _policy.SONAMES
_env = _policy.environment

# (name, message) of each CUfileOpError, as cufile.h's cufileop_status_error() words them.
_ERRORS = {
    cf.CU_FILE_SUCCESS: ("CU_FILE_SUCCESS", "cufile success"),
    cf.CU_FILE_DRIVER_NOT_INITIALIZED: ("CU_FILE_DRIVER_NOT_INITIALIZED",
                                        "nvidia-fs driver is not loaded"),
    cf.CU_FILE_DRIVER_INVALID_PROPS: ("CU_FILE_DRIVER_INVALID_PROPS", "invalid property"),
    cf.CU_FILE_DRIVER_UNSUPPORTED_LIMIT: ("CU_FILE_DRIVER_UNSUPPORTED_LIMIT",
                                          "property range error"),
    cf.CU_FILE_DRIVER_VERSION_MISMATCH: ("CU_FILE_DRIVER_VERSION_MISMATCH",
                                         "nvidia-fs driver version mismatch"),
    cf.CU_FILE_DRIVER_VERSION_READ_ERROR: ("CU_FILE_DRIVER_VERSION_READ_ERROR",
                                           "nvidia-fs driver version read error"),
    cf.CU_FILE_DRIVER_CLOSING: ("CU_FILE_DRIVER_CLOSING", "driver shutdown in progress"),
    cf.CU_FILE_PLATFORM_NOT_SUPPORTED: ("CU_FILE_PLATFORM_NOT_SUPPORTED",
                                        "GPUDirect Storage not supported on current platform"),
    cf.CU_FILE_IO_NOT_SUPPORTED: ("CU_FILE_IO_NOT_SUPPORTED",
                                  "GPUDirect Storage not supported on current file"),
    cf.CU_FILE_DEVICE_NOT_SUPPORTED: ("CU_FILE_DEVICE_NOT_SUPPORTED",
                                      "GPUDirect Storage not supported on current GPU"),
    cf.CU_FILE_NVFS_DRIVER_ERROR: ("CU_FILE_NVFS_DRIVER_ERROR", "nvidia-fs driver ioctl error"),
    cf.CU_FILE_CUDA_DRIVER_ERROR: ("CU_FILE_CUDA_DRIVER_ERROR", "CUDA Driver API error"),
    cf.CU_FILE_CUDA_POINTER_INVALID: ("CU_FILE_CUDA_POINTER_INVALID", "invalid device pointer"),
    cf.CU_FILE_CUDA_MEMORY_TYPE_INVALID: ("CU_FILE_CUDA_MEMORY_TYPE_INVALID",
                                          "invalid pointer memory type"),
    cf.CU_FILE_CUDA_POINTER_RANGE_ERROR: ("CU_FILE_CUDA_POINTER_RANGE_ERROR",
                                          "pointer range exceeds allocated address range"),
    cf.CU_FILE_CUDA_CONTEXT_MISMATCH: ("CU_FILE_CUDA_CONTEXT_MISMATCH", "cuda context mismatch"),
    cf.CU_FILE_INVALID_MAPPING_SIZE: ("CU_FILE_INVALID_MAPPING_SIZE",
                                      "access beyond maximum pinned size"),
    cf.CU_FILE_INVALID_MAPPING_RANGE: ("CU_FILE_INVALID_MAPPING_RANGE",
                                       "access beyond mapped size"),
    cf.CU_FILE_INVALID_FILE_TYPE: ("CU_FILE_INVALID_FILE_TYPE", "unsupported file type"),
    cf.CU_FILE_INVALID_FILE_OPEN_FLAG: ("CU_FILE_INVALID_FILE_OPEN_FLAG",
                                        "unsupported file open flags"),
    cf.CU_FILE_DIO_NOT_SET: ("CU_FILE_DIO_NOT_SET", "fd direct IO not set"),
    cf.CU_FILE_INVALID_VALUE: ("CU_FILE_INVALID_VALUE", "invalid arguments"),
    cf.CU_FILE_MEMORY_ALREADY_REGISTERED: ("CU_FILE_MEMORY_ALREADY_REGISTERED",
                                           "device pointer already registered"),
    cf.CU_FILE_MEMORY_NOT_REGISTERED: ("CU_FILE_MEMORY_NOT_REGISTERED",
                                       "device pointer lookup failure"),
    cf.CU_FILE_PERMISSION_DENIED: ("CU_FILE_PERMISSION_DENIED", "driver or file access error"),
    cf.CU_FILE_DRIVER_ALREADY_OPEN: ("CU_FILE_DRIVER_ALREADY_OPEN", "driver is already open"),
    cf.CU_FILE_HANDLE_NOT_REGISTERED: ("CU_FILE_HANDLE_NOT_REGISTERED",
                                       "file descriptor is not registered"),
    cf.CU_FILE_HANDLE_ALREADY_REGISTERED: ("CU_FILE_HANDLE_ALREADY_REGISTERED",
                                           "file descriptor is already registered"),
    cf.CU_FILE_DEVICE_NOT_FOUND: ("CU_FILE_DEVICE_NOT_FOUND", "GPU device not found"),
    cf.CU_FILE_INTERNAL_ERROR: ("CU_FILE_INTERNAL_ERROR", "internal error"),
    cf.CU_FILE_GETNEWFD_FAILED: ("CU_FILE_GETNEWFD_FAILED",
                                 "failed to obtain new file descriptor"),
    cf.CU_FILE_NVFS_SETUP_ERROR: ("CU_FILE_NVFS_SETUP_ERROR", "NVFS driver initialization error"),
    cf.CU_FILE_IO_DISABLED: ("CU_FILE_IO_DISABLED",
                             "GPUDirect Storage disabled by config on current file"),
    cf.CU_FILE_BATCH_SUBMIT_FAILED: ("CU_FILE_BATCH_SUBMIT_FAILED",
                                     "failed to submit batch operation"),
    cf.CU_FILE_GPU_MEMORY_PINNING_FAILED: ("CU_FILE_GPU_MEMORY_PINNING_FAILED",
                                           "failed to allocate pinned GPU memory"),
    cf.CU_FILE_BATCH_FULL: ("CU_FILE_BATCH_FULL", "queue full for batch operation"),
    cf.CU_FILE_ASYNC_NOT_SUPPORTED: ("CU_FILE_ASYNC_NOT_SUPPORTED",
                                     "cuFile stream operation not supported"),
    cf.CU_FILE_INTERNAL_BATCH_SETUP_ERROR: ("CU_FILE_INTERNAL_BATCH_SETUP_ERROR",
                                            "batch setup internal error"),
    cf.CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR: ("CU_FILE_INTERNAL_BATCH_SUBMIT_ERROR",
                                             "batch submit internal error"),
    cf.CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR: ("CU_FILE_INTERNAL_BATCH_GETSTATUS_ERROR",
                                                "batch get status internal error"),
    cf.CU_FILE_INTERNAL_BATCH_CANCEL_ERROR: ("CU_FILE_INTERNAL_BATCH_CANCEL_ERROR",
                                             "batch cancel internal error"),
    cf.CU_FILE_NOMEM_ERROR: ("CU_FILE_NOMEM_ERROR", "cuFile out of memory"),
    cf.CU_FILE_IO_ERROR: ("CU_FILE_IO_ERROR", "cuFile I/O error"),
    cf.CU_FILE_INTERNAL_BUF_REGISTER_ERROR: ("CU_FILE_INTERNAL_BUF_REGISTER_ERROR",
                                             "cuFile buffer registration error"),
    cf.CU_FILE_HASH_OPR_ERROR: ("CU_FILE_HASH_OPR_ERROR", "cuFile hash operation error"),
    cf.CU_FILE_INVALID_CONTEXT_ERROR: ("CU_FILE_INVALID_CONTEXT_ERROR",
                                       "cuFile invalid context"),
    cf.CU_FILE_NVFS_INTERNAL_DRIVER_ERROR: ("CU_FILE_NVFS_INTERNAL_DRIVER_ERROR",
                                            "nvidia-fs internal driver error"),
    cf.CU_FILE_BATCH_NOCOMPAT_ERROR: ("CU_FILE_BATCH_NOCOMPAT_ERROR",
                                      "batch I/O needs compatibility mode, which is off"),
    cf.CU_FILE_IO_MAX_ERROR: ("CU_FILE_IO_MAX_ERROR", "GPUDirect Storage max error"),
}

# A few CUresult names for messages when libcuda cannot name them itself (cuda.h values).
_CUDA_ERRORS = {
    1: "CUDA_ERROR_INVALID_VALUE",
    2: "CUDA_ERROR_OUT_OF_MEMORY",
    3: "CUDA_ERROR_NOT_INITIALIZED",
    4: "CUDA_ERROR_DEINITIALIZED",
    34: "CUDA_ERROR_STUB_LIBRARY",
    100: "CUDA_ERROR_NO_DEVICE",
    101: "CUDA_ERROR_INVALID_DEVICE",
    201: "CUDA_ERROR_INVALID_CONTEXT",
    999: "CUDA_ERROR_UNKNOWN",
}


def error_name(int code):
    """Return the ``CU_FILE_*`` name of a cuFile status code (sign ignored).

    Unknown codes get ``"CU_FILE_UNKNOWN_ERROR"``.
    """
    entry = _ERRORS.get(abs(code))
    return "CU_FILE_UNKNOWN_ERROR" if entry is None else entry[0]


def error_message(int code):
    """Return cufile.h's description of a cuFile status code (sign ignored).

    Unknown codes get ``"unknown cuFile error <code>"``.
    """
    entry = _ERRORS.get(abs(code))
    return f"unknown cuFile error {abs(code)}" if entry is None else entry[1]


cdef str _cuda_error_name(int code):
    """Name a CUresult, asking a libcuda that is already loaded (never loading one)."""
    cdef void* lib
    cdef cf.cuGetErrorName_t fn
    cdef const char* name = NULL
    cdef int rc = -1
    lib = dlopen(b"libcuda.so.1", RTLD_NOW | RTLD_LOCAL | cf.RTLD_NOLOAD)
    if lib != NULL:
        fn = <cf.cuGetErrorName_t>dlsym(lib, b"cuGetErrorName")
        if fn != NULL:
            rc = fn(code, &name)
        dlclose(lib)
    if rc == 0 and name != NULL:
        return name.decode("ascii", "replace")
    return _CUDA_ERRORS.get(code, "")


def _status_error(int err, int cu_err, str what):
    """The :class:`CuFileError` for a failed status call (``CUfileError_t`` = err, cu_err)."""
    msg = f"{what} failed: {error_name(err)}: {error_message(err)}"
    if err == cf.CU_FILE_CUDA_DRIVER_ERROR:
        name = _cuda_error_name(cu_err)
        msg += f" (CUresult {cu_err}{' ' + name if name else ''})"
    exc = CuFileError(err, msg)
    exc.cu_err = cu_err
    return exc


cdef int _check_status(cf.CUfileError_t st, str what) except -1:
    """Checker of every call that returns ``CUfileError_t``."""
    if st.err != cf.CU_FILE_SUCCESS:
        raise _status_error(st.err, st.cu_err, what)
    return 0


def _map_io_result(ssize_t ret, int err, str op="cuFileRead", nbytes=0, file_offset=0,
                   done=0, path=None):
    """Map a ``cuFileRead``/``cuFileWrite`` result to a :class:`CuFileError`, or None if >= 0.

    ``-1`` means ``err`` holds the errno; any other negative value is a negated
    ``CUfileOpError`` (a small negative that is not one is taken as a negated errno).
    """
    if ret >= 0:
        return None
    if ret == -1:
        code = err if err else EIO
        detail = os.strerror(err) if err else "failed without setting errno"
    else:
        code = <long long>-ret
        if code > cf.CUFILEOP_BASE_ERR:
            detail = f"{error_name(code)}: {error_message(code)}"
        else:
            detail = os.strerror(code)
    msg = (f"{op} of {nbytes} bytes at file offset {file_offset}: {detail} "
           f"({done} bytes done)")
    exc = CuFileError(code, msg) if path is None else CuFileError(code, msg, path)
    exc.offset = file_offset + done
    return exc


cdef ssize_t _check_io(ssize_t ret, int err, str op, size_t nbytes, off_t file_offset,
                       size_t done, object path) except -1:
    """Checker of every ``cuFileRead``/``cuFileWrite`` result."""
    if ret < 0:
        raise _map_io_result(ret, err, op, nbytes, file_offset, done, path)
    return ret


# ---------------------------------------------------------------------------------------------
# Loading

cdef struct _Api:
    void* lib
    cf.cuFileDriverOpen_t driver_open
    cf.cuFileDriverClose_t driver_close
    cf.cuFileGetVersion_t get_version
    cf.cuFileHandleRegister_t handle_register
    cf.cuFileHandleDeregister_t handle_deregister
    cf.cuFileBufRegister_t buf_register
    cf.cuFileBufDeregister_t buf_deregister
    cf.cuFileRead_t read
    cf.cuFileWrite_t write

cdef _Api _api          # all NULL until load() succeeds; only written with _lock held

# One lock for the library, the driver count, the registrations and cuFile's environment.
# Reentrant: driver_open() loads, a file registration opens the driver.
_lock = threading.RLock()
_lib_path = None
_driver_count = 0
_buffers = 0            # successful buf_register() calls not yet deregistered
_registrations = {}     # registration key -> _Registration


cdef void* _sym(void* lib, const char* name) noexcept:
    dlerror()
    return dlsym(lib, name)


cdef str _dlerror(str fallback):
    cdef const char* msg = dlerror()
    return fallback if msg == NULL else msg.decode("utf-8", "replace")


cdef object _open_library(str candidate):
    """dlopen ``candidate`` and resolve the entry points into ``_api``; None or why not."""
    cdef bytes bname = os.fsencode(candidate)
    cdef const char* cname = bname
    cdef void* lib
    cdef _Api a
    cdef cf.Dl_info info
    global _api, _lib_path
    memset(&a, 0, sizeof(_Api))
    dlerror()
    with nogil:
        lib = dlopen(cname, RTLD_NOW | RTLD_LOCAL)
    if lib == NULL:
        msg = _dlerror("dlopen failed")
        return msg if candidate in msg else f"{candidate}: {msg}"
    a.lib = lib
    a.driver_open = <cf.cuFileDriverOpen_t>_sym(lib, b"cuFileDriverOpen")
    a.driver_close = <cf.cuFileDriverClose_t>_sym(lib, b"cuFileDriverClose_v2")
    close_name = "cuFileDriverClose_v2"
    if a.driver_close == NULL:
        a.driver_close = <cf.cuFileDriverClose_t>_sym(lib, b"cuFileDriverClose")
        close_name = "cuFileDriverClose"
    a.get_version = <cf.cuFileGetVersion_t>_sym(lib, b"cuFileGetVersion")    # optional
    a.handle_register = <cf.cuFileHandleRegister_t>_sym(lib, b"cuFileHandleRegister")
    a.handle_deregister = <cf.cuFileHandleDeregister_t>_sym(lib, b"cuFileHandleDeregister")
    a.buf_register = <cf.cuFileBufRegister_t>_sym(lib, b"cuFileBufRegister")
    a.buf_deregister = <cf.cuFileBufDeregister_t>_sym(lib, b"cuFileBufDeregister")
    a.read = <cf.cuFileRead_t>_sym(lib, b"cuFileRead")
    a.write = <cf.cuFileWrite_t>_sym(lib, b"cuFileWrite")
    missing = [name for name, ok in (
        ("cuFileDriverOpen", a.driver_open != NULL),
        ("cuFileDriverClose_v2 or cuFileDriverClose", a.driver_close != NULL),
        ("cuFileHandleRegister", a.handle_register != NULL),
        ("cuFileHandleDeregister", a.handle_deregister != NULL),
        ("cuFileBufRegister", a.buf_register != NULL),
        ("cuFileBufDeregister", a.buf_deregister != NULL),
        ("cuFileRead", a.read != NULL),
        ("cuFileWrite", a.write != NULL)) if not ok]
    if missing:
        dlclose(lib)
        return f"{candidate}: loaded but lacks {', '.join(missing)} (not a cuFile library?)"
    where = candidate
    if cf.dladdr(<void*>a.driver_open, &info) != 0 and info.dli_fname != NULL:
        where = os.path.abspath(os.fsdecode(<bytes>info.dli_fname))
    _api = a
    _lib_path = where
    _log.debug("cuFile loaded from %s (driver close: %s)", where, close_name)
    return None



def load(path=None):
    """Load libcufile (once, thread-safe) and return the path it was loaded from.

    Parameters
    ----------
    path : str or os.PathLike, optional
        The library to load. By default ``$AIOSWAP_CUFILE_LIB`` when set (and then only that),
        else ``libcufile.so.0`` and ``libcufile.so`` through the dynamic loader's search, then
        ``nvidia/*/lib/libcufile.so*`` of the NVIDIA wheels (``nvidia-cufile-cu12``, or
        ``nvidia/cu13``) in every ``sys.path`` entry, then ``$CUDA_HOME/lib64``,
        ``$CUDA_PATH/lib64``, ``$CONDA_PREFIX/lib`` and ``/usr/local/cuda/lib64``
        (:func:`aioswap._cufile_load.search`).

    Returns
    -------
    str
        Absolute path of the loaded library.

    Raises
    ------
    CuFileUnavailable
        No candidate could be loaded, or none exports the cuFile entry points; the message
        names every place tried with the loader's reason.
    RuntimeError
        ``path`` names another library than the one already loaded.

    Notes
    -----
    Importing this module never loads anything; only the first call that needs cuFile does.
    A library is never unloaded. Unless ``CUFILE_LOGFILE_PATH`` is set, it is pointed at a
    private temporary directory before loading, so cuFile writes no ``cufile.log`` into the
    current directory.
    """
    with _lock:
        if _api.lib != NULL:
            why = _policy.conflicts(path, _lib_path)
            if why is not None:
                raise RuntimeError(why)
            return _lib_path
        found = _policy.search(path)
        set_log = _env.point_log()
        failures = []
        for cand in found.candidates:
            why = _open_library(cand)
            if why is None:
                return _lib_path
            failures.append(why)
        if set_log:
            _env.unpoint_log()
        raise CuFileUnavailable(_policy.unavailable_message(failures, found.origin))



def available(bint check_driver=False):
    """Return ``(True, library_path)`` when cuFile can be used, else ``(False, reason)``.

    Parameters
    ----------
    check_driver : bool
        Also open (and close again) the cuFile driver, which needs a GPU and its driver;
        by default only the library is loaded.

    Never raises.
    """
    try:
        where = load()
        if check_driver:
            driver_open()
            driver_close()
    except Exception as exc:
        return (False, str(exc))
    return (True, where)


def library_path():
    """Return the path libcufile was loaded from, or None when it is not loaded (yet)."""
    return _lib_path


def version():
    """Return ``cuFileGetVersion()`` (e.g. 1140 for cuFile 1.14), or None where the library
    does not export it.

    Raises
    ------
    CuFileUnavailable
        libcufile cannot be loaded.
    CuFileError
        The call failed.
    """
    cdef int v = 0
    cdef cf.CUfileError_t st
    load()
    if _api.get_version == NULL:
        return None
    with nogil:
        st = _api.get_version(&v)
    _check_status(st, "cuFileGetVersion")
    return v



# ---------------------------------------------------------------------------------------------
# Driver

def driver_open(config=None):
    """Open the cuFile driver for one more user (``cuFileDriverOpen`` for the first).

    Parameters
    ----------
    config : Mapping or str or os.PathLike, optional
        cuFile configuration for the first open: a mapping in ``cufile.json``'s schema, which
        is written to a file in a private temporary directory, or the path of a JSON file.
        Either way ``CUFILE_ENV_PATH_JSON`` is set to its fully expanded absolute path while
        the driver is open. Without a config, a relative or ``~`` value of
        ``CUFILE_ENV_PATH_JSON`` is expanded; else cuFile uses its own defaults.

    Raises
    ------
    CuFileUnavailable
        libcufile cannot be loaded, or the driver does not open (no GPU, no CUDA driver,
        platform not supported...); the cause is the :class:`CuFileError` with cuFile's code.
    ValueError
        The driver is already open with another config.
    FileNotFoundError
        ``config`` names a file that does not exist.
    """
    cdef cf.CUfileError_t st
    global _driver_count
    with _lock:
        if _driver_count > 0:
            _env.check_config(config)
            _driver_count += 1
            return
        load()
        _env.apply_config(config)
        with nogil:
            st = _api.driver_open()
        try:
            _check_status(st, "cuFileDriverOpen")
        except CuFileError as exc:
            _env.forget_config()
            raise CuFileUnavailable(_policy.driver_unavailable_message(exc.strerror)) from exc
        _driver_count = 1



def driver_close():
    """Release one :func:`driver_open`; the last release calls ``cuFileDriverClose``.

    Raises
    ------
    RuntimeError
        No matching :func:`driver_open`.
    CuFileError
        ``cuFileDriverClose`` failed (the driver counts as closed all the same).
    """
    cdef cf.CUfileError_t st
    global _driver_count
    with _lock:
        if _driver_count == 0:
            raise RuntimeError("driver_close() without a matching driver_open()")
        _driver_count -= 1
        if _driver_count > 0:
            return
        with nogil:
            st = _api.driver_close()
        _env.forget_config()
        _check_status(st, "cuFileDriverClose")


def driver_users():
    """Return how many users hold the cuFile driver open (0: closed)."""
    return _driver_count


cdef class Driver:
    """Holds the cuFile driver open from construction to :meth:`close`; a context manager.

    Parameters
    ----------
    config : Mapping or str or os.PathLike, optional
        Passed to :func:`driver_open`.
    """
    cdef bint _open

    def __cinit__(self):
        self._open = False

    def __init__(self, config=None):
        if self._open:
            raise RuntimeError("Driver is already initialised")
        driver_open(config)
        self._open = True

    def close(self):
        """Release this reference to the driver. Idempotent."""
        if self._open:
            self._open = False
            driver_close()

    @property
    def closed(self):
        return not self._open

    def __enter__(self):
        if not self._open:
            raise HandleClosedError("cuFile Driver is closed")
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        return f"<aioswap._cufile.Driver {'closed' if not self._open else 'open'}>"

    def __dealloc__(self):
        if self._open:
            self._open = False
            try:
                driver_close()
            except BaseException:
                pass
            _warn_unclosed("aioswap._cufile.Driver")


cdef void _warn_unclosed(str what):
    # Reported as unraisable when warnings are errors, so an unclosed owner fails its test.
    if sys is not None and not sys.is_finalizing():
        warnings.warn(f"unclosed {what}", ResourceWarning, stacklevel=2)



# ---------------------------------------------------------------------------------------------
# Device memory

def buf_register(ptr, nbytes, int flags=0):
    """Register device memory ``[ptr, ptr + nbytes)`` with cuFile (``cuFileBufRegister``).

    Parameters
    ----------
    ptr : int
        Device address, the base that I/O on this memory must be issued against.
    nbytes : int
        Size in bytes (> 0).
    flags : int
        ``cuFileBufRegister`` flags (0).

    Raises
    ------
    ValueError
        Bad address or size.
    CuFileUnavailable
        libcufile or the driver is unavailable.
    CuFileError
        cuFile refused the registration (``CU_FILE_MEMORY_ALREADY_REGISTERED`` for a base
        registered already).

    Notes
    -----
    A registration holds a driver reference. Nothing is recorded here: the caller keeps
    the memory alive until :func:`buf_deregister`, refuses overlapping ranges and issues
    I/O inside the range as ``(ptr, offset)``; :mod:`aioswap.gds` does all three with the
    device index of :mod:`aioswap.pinned`.
    """
    cdef cf.CUfileError_t st
    cdef const void* p
    cdef size_t n
    global _buffers
    start = operator.index(ptr)
    size = operator.index(nbytes)
    if start <= 0:
        raise ValueError(f"invalid device address {start:#x}")
    if size <= 0:
        raise ValueError(f"buf_register needs a positive size, got {size}")
    with _lock:
        driver_open()
        p = <const void*><uintptr_t>start
        n = <size_t>size
        try:
            with nogil:
                st = _api.buf_register(p, n, flags)
            _check_status(st, f"cuFileBufRegister({start:#x}, {size})")
        except BaseException:
            driver_close()
            raise
        _buffers += 1


def buf_deregister(ptr):
    """Deregister the device memory that :func:`buf_register` registered at ``ptr``.

    Raises
    ------
    ValueError
        Nothing is registered (no cuFile call is made).
    CuFileError
        cuFile refused (``CU_FILE_MEMORY_NOT_REGISTERED`` for an address it does not know);
        a registration stays registered.
    """
    cdef cf.CUfileError_t st
    cdef const void* p
    global _buffers
    start = operator.index(ptr)
    with _lock:
        if _buffers == 0:
            raise ValueError(f"cannot deregister {start:#x}: no device memory is registered "
                             f"with cuFile")
        p = <const void*><uintptr_t>start
        with nogil:
            st = _api.buf_deregister(p)
        _check_status(st, f"cuFileBufDeregister({start:#x})")
        _buffers -= 1
        driver_close()



# ---------------------------------------------------------------------------------------------
# Files

cdef class _Registration:
    """One ``cuFileHandleRegister`` of one open file, shared by the handles on it."""
    cdef cf.CUfileHandle_t fh
    cdef object key
    cdef int fd
    cdef bint owns_fd
    cdef int users

    def __cinit__(self):
        self.fh = NULL
        self.fd = -1
        self.owns_fd = False
        self.users = 0


cdef _Registration _acquire(object key, int fd, bint owns_fd, object path):
    """Share the registration of ``key``, or register ``fd`` (taking a driver reference)."""
    cdef _Registration reg
    cdef cf.CUfileDescr_t descr
    cdef cf.CUfileHandle_t fh = NULL
    cdef cf.CUfileError_t st
    with _lock:
        reg = _registrations.get(key)
        if reg is not None:
            reg.users += 1
            return reg
        driver_open()
        memset(&descr, 0, sizeof(descr))
        descr.type = cf.CU_FILE_HANDLE_TYPE_OPAQUE_FD
        descr.handle.fd = fd
        descr.fs_ops = NULL
        try:
            with nogil:
                st = _api.handle_register(&fh, &descr)
            _check_status(st, f"cuFileHandleRegister({fd if path is None else path!r})")
        except BaseException:
            driver_close()
            raise
        reg = _Registration()
        reg.fh = fh
        reg.key = key
        reg.fd = fd
        reg.owns_fd = owns_fd
        reg.users = 1
        _registrations[key] = reg
        return reg


cdef void _release(_Registration reg) except *:
    """Drop one user; the last deregisters, closes an owned fd and releases the driver."""
    cdef cf.CUfileHandle_t fh
    with _lock:
        reg.users -= 1
        if reg.users > 0:
            return
        _registrations.pop(reg.key, None)
        fh = reg.fh
        reg.fh = NULL
        with nogil:
            _api.handle_deregister(fh)
        try:
            if reg.owns_fd:
                os.close(reg.fd)
        finally:
            driver_close()


cdef struct _Io:
    cf.cuFileRead_t read_fn
    cf.cuFileWrite_t write_fn
    cf.CUfileHandle_t fh
    void* base
    size_t size
    off_t file_offset
    off_t buf_offset
    size_t done
    ssize_t ret
    int err
    bint is_write
    bint overrun


cdef void _io_run(_Io* r) noexcept nogil:
    """Call cuFileRead/cuFileWrite until done, an error, no progress, or a bad count."""
    cdef ssize_t ret
    cdef size_t left
    while r.done < r.size:
        left = r.size - r.done
        cerrno.errno = 0        # so that -1 without errno is told apart from a stale one
        if r.is_write:
            ret = r.write_fn(r.fh, r.base, left, r.file_offset + <off_t>r.done,
                             r.buf_offset + <off_t>r.done)
        else:
            ret = r.read_fn(r.fh, r.base, left, r.file_offset + <off_t>r.done,
                            r.buf_offset + <off_t>r.done)
        r.ret = ret
        if ret < 0:
            r.err = cerrno.errno if ret == -1 else 0
            return
        if ret == 0:
            return
        if <size_t>ret > left:
            r.overrun = True
            return
        r.done += <size_t>ret


cdef class CuFileHandle:
    """A file registered with cuFile (``cuFileHandleRegister``) for device-memory I/O.

    Parameters
    ----------
    file : str, bytes, os.PathLike or int
        A path, opened here (and closed by :meth:`close`), or an open fd that stays the
        caller's to close, after this handle.
    write : bool
        Open the path for reading and writing (``O_RDWR``); else read-only.
    create, truncate : bool
        ``O_CREAT`` / ``O_TRUNC`` when opening a path.
    direct : bool
        Open the path with ``O_DIRECT``, which GPUDirect Storage needs for the direct path
        (cuFile's compatibility mode works without it).
    mode : int
        Permissions of a created file.

    Raises
    ------
    CuFileUnavailable
        libcufile or the driver is unavailable.
    CuFileError
        ``cuFileHandleRegister`` failed.
    DirectIOUnsupportedError
        ``direct=True`` and the file system refuses ``O_DIRECT``.

    Notes
    -----
    Handles on the same open file (the same path opened with the same access, or the same
    fd) share one registration, counted; the last :meth:`close` deregisters it. A handle
    holds a driver reference through its registration. Device memory passed by address must
    stay alive until the call returns; calls are synchronous.
    """
    cdef _Registration _reg
    cdef cf.CUfileHandle_t _fh
    cdef int _fd
    cdef bint _open
    cdef bint _readable
    cdef bint _writable
    cdef int _busy
    cdef object _path

    def __cinit__(self):
        self._reg = None
        self._fh = NULL
        self._fd = -1
        self._open = False
        self._readable = False
        self._writable = False
        self._busy = 0
        self._path = None

    def __init__(self, file, *, bint write=False, bint create=False, bint truncate=False,
                 bint direct=True, int mode=0o644):
        cdef int fd
        cdef bint owns
        if self._open:
            raise RuntimeError("CuFileHandle is already initialised")
        load()
        if isinstance(file, int):
            if create or truncate:
                raise ValueError("create/truncate apply to a path, not to an open fd")
            fd = file
            owns = False
            st = os.fstat(fd)
            acc = fcntl.fcntl(fd, fcntl.F_GETFL) & getattr(os, "O_ACCMODE", 3)
            self._readable = acc in (os.O_RDONLY, os.O_RDWR)
            self._writable = acc in (os.O_WRONLY, os.O_RDWR)
            key = ("fd", fd, st.st_dev, st.st_ino)
        else:
            self._path = os.fsdecode(file)
            fd = open_file(self._path, (os.O_RDWR if write else os.O_RDONLY)
                           | (os.O_CREAT if create else 0) | (os.O_TRUNC if truncate else 0),
                           mode, direct=direct)[0]
            owns = True
            try:
                st = os.fstat(fd)
            except BaseException:
                os.close(fd)
                raise
            self._readable = True
            self._writable = write
            key = ("path", st.st_dev, st.st_ino, write, direct)
        try:
            reg = _acquire(key, fd, owns, self._path)
        except BaseException:
            if owns:
                os.close(fd)
            raise
        if owns and reg.fd != fd:
            os.close(fd)        # shared: the registration's own fd serves this handle
        self._reg = reg
        self._fh = reg.fh
        self._fd = reg.fd
        self._open = True

    def close(self):
        """Release this handle's share of the registration. Idempotent.

        Raises
        ------
        RuntimeError
            A read or write is running on this handle in another thread.
        """
        if self._busy:
            raise RuntimeError("CuFileHandle.close() while I/O is running on it")
        if self._open:
            self._open = False
            reg = self._reg
            self._reg = None
            self._fh = NULL
            _release(reg)

    def __dealloc__(self):
        if self._open:
            self._open = False
            try:
                _release(self._reg)
            except BaseException:
                pass
            self._reg = None
            _warn_unclosed(f"aioswap._cufile.CuFileHandle ({self._path or self._fd})")

    @property
    def closed(self):
        return not self._open

    @property
    def path(self):
        """The path this handle opened, or None for a caller's fd."""
        return self._path

    @property
    def readable(self):
        return self._readable

    @property
    def writable(self):
        return self._writable

    def fileno(self):
        """The registered fd (shared with other handles on the same file)."""
        self._ensure_open()
        return self._fd

    def __enter__(self):
        self._ensure_open()
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        if not self._open:
            return "<aioswap._cufile.CuFileHandle closed>"
        what = repr(self._path) if self._path is not None else f"fd={self._fd}"
        return f"<aioswap._cufile.CuFileHandle {what}{' rw' if self._writable else ''}>"

    cdef _ensure_open(self):
        if not self._open:
            raise HandleClosedError("I/O on a closed CuFileHandle")

    def read(self, dev_ptr, nbytes, file_offset=0, buf_offset=0):
        """Read ``nbytes`` at ``file_offset`` into ``dev_ptr + buf_offset``; return ``nbytes``.

        Parameters
        ----------
        dev_ptr : int
            Device address (or, with cuFile's compatibility, any address cuFile accepts).
        nbytes : int
            Bytes to read (>= 0).
        file_offset, buf_offset : int
            Offsets (>= 0) into the file and into the memory at ``dev_ptr``.

        Raises
        ------
        ShortReadError
            The file ended first.
        CuFileError
            cuFile failed: ``errno`` is the errno or the ``CU_FILE_*`` code.

        Notes
        -----
        Short counts are continued until all bytes moved. ``dev_ptr`` and ``buf_offset`` go
        to cuFile as given: for memory inside a :func:`buf_register`-ed range, pass the
        range's start and the offset into it, as cuFile requires.
        """
        return self._io(False, dev_ptr, nbytes, file_offset, buf_offset)

    def write(self, dev_ptr, nbytes, file_offset=0, buf_offset=0):
        """Write ``nbytes`` from ``dev_ptr + buf_offset`` at ``file_offset``; return ``nbytes``.

        Same parameters and notes as :meth:`read`.

        Raises
        ------
        CuFileError
            cuFile failed, or a call made no progress (``EIO``).
        io.UnsupportedOperation
            The file is not open for writing.
        """
        return self._io(True, dev_ptr, nbytes, file_offset, buf_offset)

    cdef object _io(self, bint is_write, object dev_ptr, object nbytes, object file_offset,
                    object buf_offset):
        cdef _Io r
        self._ensure_open()
        op = "cuFileWrite" if is_write else "cuFileRead"
        ptr = operator.index(dev_ptr)
        n = operator.index(nbytes)
        foff = operator.index(file_offset)
        boff = operator.index(buf_offset)
        if n < 0 or foff < 0 or boff < 0:
            raise ValueError(f"{op}: negative size or offset (nbytes={n}, file_offset={foff}, "
                             f"buf_offset={boff})")
        if is_write and not self._writable:
            raise io.UnsupportedOperation(f"{op}: the file is not open for writing"
                                          f"{_in(self._path)}")
        if not is_write and not self._readable:
            raise io.UnsupportedOperation(f"{op}: the file is not open for reading"
                                          f"{_in(self._path)}")
        if n == 0:
            return 0
        if ptr <= 0:
            raise ValueError(f"{op}: invalid buffer address {ptr:#x}")
        memset(&r, 0, sizeof(_Io))
        r.read_fn = _api.read
        r.write_fn = _api.write
        r.fh = self._fh
        r.base = <void*><uintptr_t>ptr
        r.size = <size_t>n
        r.file_offset = <off_t>foff
        r.buf_offset = <off_t>boff
        r.is_write = is_write
        self._busy += 1
        try:
            while True:
                with nogil:
                    _io_run(&r)
                if r.done == r.size:
                    return n
                if r.ret == -1 and r.err == EINTR:
                    PyErr_CheckSignals()
                    continue
                break
        finally:
            self._busy -= 1
        _check_io(r.ret, r.err, op, r.size, r.file_offset, r.done, self._path)
        if r.overrun:
            raise CuFileError(EIO, f"{op} of {n} bytes at file offset {foff}: cuFile reported "
                                   f"{r.ret} bytes for a call of {n - r.done} "
                                   f"({r.done} bytes done)")
        if is_write:
            raise CuFileError(EIO, f"{op} of {n} bytes at file offset {foff}: no progress at "
                                   f"offset {foff + r.done} ({r.done} bytes done)")
        raise ShortReadError(
            f"{op} of {n} bytes at file offset {foff}{_in(self._path)} reached end of file at "
            f"offset {foff + r.done} ({r.done} bytes read)",
            path=self._path, offset=foff, nbytes=n, file_size=_fd_size(self._fd))


cdef str _in(object path):
    return "" if path is None else f" ({path!r})"


cdef object _fd_size(int fd):
    try:
        return os.fstat(fd).st_size
    except OSError:
        return None



# ---------------------------------------------------------------------------------------------
# Test support

def _state():
    """Counts of what is loaded and held, for tests and diagnostics."""
    return {"loaded": _api.lib != NULL, "driver_users": _driver_count,
            "registrations": sum((<_Registration>r).users for r in _registrations.values()),
            "files": len(_registrations), "buffers": _buffers}


def _unload():
    """Forget the loaded library (tests only), so the next use loads again; refuses while
    anything is open or registered."""
    global _lib_path
    with _lock:
        if _driver_count or _registrations or _buffers:
            raise RuntimeError(f"cuFile is in use: {_state()}")
        # Forget the entry points but leave the library mapped: libraries like cuFile may
        # keep threads or atexit handlers that would run in unmapped code.
        memset(&_api, 0, sizeof(_Api))
        _lib_path = None
        _env.unpoint_log()
