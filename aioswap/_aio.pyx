# cython: language_level=3, embedsignature=True
"""The engine: the only caller of the kernel's asynchronous I/O interfaces.

An :class:`AioQueue` is shared by every request of a handle lane: it cuts requests into
pieces, keeps at most ``depth`` of them in flight, and submits and reaps with the GIL
released. It reaches the kernel only through a small backend seam (``_k_submit``,
``_k_getevents``, ``_k_destroy``, ``_k_forget``) over iocb-shaped pieces, behind which sit
three backends: io_uring (``_uring.h``: raw ``io_uring_setup``/``io_uring_enter``/
``io_uring_register`` and mmap'd rings), kernel AIO (``io_setup``/``io_submit``/
``io_getevents`` with the structs of ``<linux/aio_abi.h>``) and positional I/O on worker
threads (``_kthreads.h``). All system calls go through ``syscall(2)``: neither liburing nor
libaio(-dev) is needed to build or run. A request is one :class:`Request` object from
submission to its result. Also here: ``open_file`` (the one ``O_DIRECT`` opener),
``open_direct``, ``dio_alignment``, ``aio_available`` and :class:`LockedMemory`. Nothing
here knows about torch: requests carry raw addresses whose owners the queue keeps alive
(``owner``) until the request is finished and seen.
"""
cimport cython
cimport aioswap._aio_abi as abi
cimport aioswap._kthreads as kt
cimport aioswap._uring as ur
cimport aioswap._pthread as pt
from aioswap._pthread cimport CLOCK_MONOTONIC, clock_gettime, timespec
from cpython.buffer cimport (PyBUF_FORMAT, PyBUF_ND, PyBUF_SIMPLE, PyBUF_STRIDES, PyBuffer_Release,
                            PyObject_GetBuffer)
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from cpython.weakref cimport PyWeakref_NewRef
from libc.errno cimport (EAGAIN, EBUSY, EFAULT, EINTR, EINVAL, EIO, EISDIR, ENOMEM, ENOSPC, ENOSYS,
                         EOPNOTSUPP, EPERM, errno)
from libc.stdint cimport int64_t, uint16_t, uint32_t, uint64_t, uintptr_t
from libc.string cimport memset, strchr

import collections
import logging
import os
import sys
import threading

from aioswap.errors import DirectIOUnsupportedError, HandleClosedError, ShortReadError

from aioswap._mman cimport MADV_POPULATE_READ, MADV_POPULATE_WRITE, madvise, mincore
from posix.mman cimport (MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, MAP_SHARED, PROT_READ,
                         PROT_WRITE, mlock, mmap, munlock, munmap)
from libc.string cimport memcpy
from posix.fcntl cimport F_GETFL
from posix.fcntl cimport fcntl as c_fcntl
from posix.unistd cimport ftruncate, getpid, pread, pwrite, usleep
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from posix.uio cimport iovec
from posix.unistd cimport close as c_close

cdef class Core                     # the handle's core (_engine/core.pxi)

include "_engine/sys.pxi"
include "_engine/locked.pxi"
include "_engine/structs.pxi"
include "_engine/memory.pxi"
include "_engine/pieces.pxi"
include "_engine/backend.pxi"
include "_engine/reap.pxi"
include "_engine/request.pxi"
include "_engine/queue.pxi"
include "_engine/file.pxi"
include "_engine/core.pxi"
