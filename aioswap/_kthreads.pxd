# cython: language_level=3
# Declarations of _kthreads.h (positional I/O on worker threads, io_submit's shape); no logic.
from aioswap cimport _aio_abi as abi
from aioswap._pthread cimport timespec


cdef extern from "_kthreads.h" nogil:
    ctypedef struct kthreads:
        pass
    int kthreads_setup(kthreads** out, int cap, int nthreads)
    long kthreads_submit(kthreads* k, long n, abi.iocb** cbs)
    long kthreads_getevents(kthreads* k, long min_nr, long max_nr, abi.io_event* out,
                            const timespec* timeout)
    void kthreads_destroy(kthreads* k)
