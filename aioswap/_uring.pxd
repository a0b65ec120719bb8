# cython: language_level=3
# Declarations of _uring.h (io_uring in the shape of io_submit/io_getevents); no logic.
from aioswap cimport _aio_abi as abi
from aioswap._pthread cimport timespec
from libc.stdint cimport uint64_t


cdef extern from "_uring.h" nogil:
    ctypedef struct uring:
        pass
    # Fault injection for tests (all zero in use); see _uring.h.
    ctypedef struct uring_faults:
        int setup_errno
        int einval_flags
        int register_errno
        int files_errno
        int cqe_eagain
        int cqe_short
    uring_faults uring_inject
    int uring_setup(uring** out, int cap, unsigned* flags_used)
    long uring_submit(uring* u, long n, abi.iocb** cbs)
    long uring_getevents(uring* u, long min_nr, long max_nr, abi.io_event* out,
                         const timespec* timeout)
    int uring_register_buffer(uring* u, void* addr, size_t len)
    int uring_unregister_buffer(uring* u, void* addr, size_t len)
    int uring_covers(uring* u, uint64_t addr, uint64_t len)
    void uring_counts(uring* u, long* fixed_pieces, int* registered)
    void uring_file_counts(uring* u, long* fixed_sqes, int* files)
    void uring_file_open(int fd)
    void uring_file_close(int fd)
    void uring_after_fork_child()
    void uring_destroy(uring* u)
    void uring_forget(uring* u)
    # IORING_SETUP_* flags reported by uring_setup; iocb flag: run in the submitting thread
    enum:
        URING_IOCB_INLINE
        IORING_SETUP_CQSIZE
        IORING_SETUP_SUBMIT_ALL
