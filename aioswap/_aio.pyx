# cython: language_level=3, embedsignature=True
"""Kernel AIO engine: the only caller of io_setup/io_submit/io_getevents/io_destroy/io_cancel.

The system calls are made through ``syscall(2)`` with the structs of ``<linux/aio_abi.h>``, so
neither libaio nor libaio-dev is needed to build or run. An :class:`AioContext` owns one kernel
AIO context; its ``pread``/``pwrite`` (and vectored ``preadv``/``pwritev``) cut a request into
``block_size`` pieces with at most ``queue_depth`` in flight and run the submit/reap loop with
the GIL released. Nothing here knows about torch: buffers are the buffer protocol or raw
addresses whose owners the caller keeps alive.
"""
cimport aioswap._aio_abi as abi
from cpython.buffer cimport (PyBUF_ANY_CONTIGUOUS, PyBUF_C_CONTIGUOUS, PyBUF_FORMAT, PyBUF_ND,
                             PyBUF_STRIDES,
                             PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer)
from cpython.exc cimport PyErr_CheckSignals
from cpython.mem cimport PyMem_RawFree, PyMem_RawMalloc
from libc.errno cimport EAGAIN, EINTR, EINVAL, EIO, EISDIR, ENOSYS, errno
from libc.stdint cimport int64_t, uint16_t, uint64_t
from libc.string cimport memset

import os

from aioswap.errors import DirectIOUnsupportedError, HandleClosedError, ShortReadError

cdef extern from "<sched.h>" nogil:
    int sched_yield()

DEFAULT_ALIGNMENT = 4096
MAX_DEPTH = 65535

# io_submit() may answer EAGAIN with nothing of ours in flight when the system-wide
# aio-max-nr is exhausted by others; yield and retry this many times before failing.
cdef int _EAGAIN_RETRIES = 10000
# How often a running transfer comes back to check for Python signal handlers.
cdef double _SIGNAL_CHECK_S = 0.01

cdef extern from "<time.h>" nogil:
    ctypedef long time_t
    struct timespec:
        time_t tv_sec
        long tv_nsec
    int CLOCK_MONOTONIC
    int clock_gettime(int clk, timespec* ts)


cdef struct _Seg:
    uint64_t addr
    uint64_t nbytes
    int64_t offset


cdef struct _Run:
    abi.aio_context_t ctx
    int fd
    uint16_t opcode
    _Seg* segs
    Py_ssize_t nsegs
    Py_ssize_t seg_i        # next segment to cut pieces from
    uint64_t seg_pos        # bytes of segs[seg_i] already cut
    uint64_t block_size
    int qd
    bint single_submit
    bint overlap
    abi.iocb* cbs           # qd iocbs; aio_data holds the slot index
    abi.iocb** ready        # prepared, not yet submitted
    int nready
    int* free_slots
    int nfree
    int inflight
    abi.io_event* events
    uint64_t done
    int err                 # errno of the first failure, 0 when none
    int64_t err_offset
    uint64_t err_nbytes
    bint eof                # a read returned 0 bytes: end of file
    bint stop               # submit nothing new; drain what is in flight
    bint broken             # io_getevents itself failed: in-flight state unknown


cdef inline void _fail(_Run* r, int err, abi.iocb* cb) noexcept nogil:
    if r.err == 0 and not r.eof:
        r.err = err
        r.err_offset = cb.aio_offset
        r.err_nbytes = cb.aio_nbytes
    r.stop = True


cdef inline void _release_slot(_Run* r, abi.iocb* cb) noexcept nogil:
    r.free_slots[r.nfree] = <int>cb.aio_data
    r.nfree += 1


cdef void _prepare(_Run* r) noexcept nogil:
    """Cut the next pieces into free slots."""
    cdef _Seg* seg
    cdef abi.iocb* cb
    cdef uint64_t n
    cdef int slot
    while r.nfree > 0 and r.seg_i < r.nsegs:
        seg = &r.segs[r.seg_i]
        n = seg.nbytes - r.seg_pos
        if n == 0:
            r.seg_i += 1
            r.seg_pos = 0
            continue
        if n > r.block_size:
            n = r.block_size
        r.nfree -= 1
        slot = r.free_slots[r.nfree]
        cb = &r.cbs[slot]
        memset(cb, 0, sizeof(abi.iocb))
        cb.aio_data = <uint64_t>slot
        cb.aio_lio_opcode = r.opcode
        cb.aio_fildes = <unsigned int>r.fd
        cb.aio_buf = seg.addr + r.seg_pos
        cb.aio_nbytes = n
        cb.aio_offset = seg.offset + <int64_t>r.seg_pos
        r.ready[r.nready] = cb
        r.nready += 1
        r.seg_pos += n
        if r.seg_pos >= seg.nbytes:
            r.seg_i += 1
            r.seg_pos = 0


cdef int _submit(_Run* r) noexcept nogil:
    """Submit the ready iocbs. Returns 0, or -EINTR with the unsubmitted ones kept ready."""
    cdef int i = 0, j, n, e, retries = 0
    cdef long ret
    while i < r.nready:
        n = 1 if r.single_submit else r.nready - i
        ret = abi.syscall(abi.SYS_io_submit, r.ctx, <long>n, &r.ready[i])
        if ret > 0:
            i += <int>ret
            r.inflight += <int>ret
            retries = 0
            continue
        e = errno if ret < 0 else EAGAIN
        if e == EINTR or (e == EAGAIN and (r.inflight > 0 or retries < _EAGAIN_RETRIES)):
            if e == EAGAIN and r.inflight == 0:
                retries += 1
                sched_yield()
                continue
            # keep the unsubmitted tail ready; reap (EAGAIN) or check signals (EINTR) first
            for j in range(i, r.nready):
                r.ready[j - i] = r.ready[j]
            r.nready -= i
            return -EINTR if e == EINTR else 0
        # a real error for r.ready[i]: it and the rest are never submitted
        _fail(r, e, r.ready[i])
        for j in range(i, r.nready):
            _release_slot(r, r.ready[j])
        break
    r.nready = 0
    return 0


cdef int _reap(_Run* r) noexcept nogil:
    """Wait for completions and account for them. Returns 0, or -EINTR."""
    cdef long ret, k
    cdef int64_t res
    cdef abi.iocb* cb
    cdef long min_nr = 1 if r.overlap else r.inflight
    ret = abi.syscall(abi.SYS_io_getevents, r.ctx, min_nr, <long>r.qd, r.events, NULL)
    if ret < 0:
        if errno == EINTR:
            return -EINTR
        r.err = errno
        r.broken = True
        r.stop = True
        return 0
    for k in range(ret):
        cb = &r.cbs[r.events[k].data]
        r.inflight -= 1
        res = <int64_t>r.events[k].res       # signed result in an unsigned-looking ABI slot
        if res < 0:
            _fail(r, <int>-res, cb)
            _release_slot(r, cb)
        elif res == 0:
            if r.opcode == abi.IOCB_CMD_PREAD:
                if r.err == 0 and not r.eof:
                    r.eof = True
                    r.err_offset = cb.aio_offset
                    r.err_nbytes = cb.aio_nbytes
                r.stop = True
            else:
                _fail(r, EIO, cb)              # a write that moves nothing would loop forever
            _release_slot(r, cb)
        elif <uint64_t>res < cb.aio_nbytes:
            # short transfer: resubmit the remainder of this piece
            r.done += <uint64_t>res
            cb.aio_buf += <uint64_t>res
            cb.aio_nbytes -= <uint64_t>res
            cb.aio_offset += res
            if r.stop:
                _release_slot(r, cb)
            else:
                r.ready[r.nready] = cb
                r.nready += 1
        else:
            r.done += <uint64_t>res
            _release_slot(r, cb)
    return 0


cdef inline double _now() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef int _drive(_Run* r) noexcept nogil:
    """Run the submit/reap loop to the end. Returns 0 when finished, -EINTR to check signals.

    Also returns -EINTR every ``_SIGNAL_CHECK_S`` seconds: a signal that lands while this
    thread is in io_submit (not in io_getevents) produces no EINTR, and its Python handler
    would otherwise wait for the whole transfer.
    """
    cdef int j
    cdef double deadline = _now() + _SIGNAL_CHECK_S
    while True:
        if not r.stop and _now() > deadline:
            return -EINTR
        if not r.stop and (r.overlap or r.inflight == 0):
            _prepare(r)
        if r.nready > 0:
            if r.stop:
                for j in range(r.nready):
                    _release_slot(r, r.ready[j])
                r.nready = 0
            elif _submit(r) == -EINTR:
                return -EINTR
        if r.inflight == 0:
            if r.stop or (r.seg_i >= r.nsegs and r.nready == 0):
                return 0
            continue
        if _reap(r) == -EINTR:
            return -EINTR
        if r.broken:
            return 0


cdef class AioContext:
    """One kernel AIO context (``io_setup``) that runs transfers of up to ``depth`` iocbs.

    Parameters
    ----------
    depth : int
        Most requests in flight at once (1..65535); a transfer's ``queue_depth`` may not
        exceed it.

    Notes
    -----
    A context serves one transfer at a time; use one per thread. Memory passed by address
    must stay alive and unchanged (for writes) until the call returns: every call waits for
    all of its iocbs, also when it raises.
    """
    cdef abi.aio_context_t _ctx
    cdef int _depth
    cdef bint _busy
    cdef bint _open
    cdef abi.iocb* _cbs
    cdef abi.iocb** _ready
    cdef abi.io_event* _events
    cdef int* _free

    def __cinit__(self):
        self._ctx = 0
        self._open = False
        self._busy = False
        self._cbs = NULL
        self._ready = NULL
        self._events = NULL
        self._free = NULL

    def __init__(self, int depth=128):
        cdef long ret
        cdef abi.aio_context_t ctx = 0
        if self._open:
            raise RuntimeError("AioContext is already initialised")
        if depth < 1 or depth > MAX_DEPTH:
            raise ValueError(f"AIO context depth must be in 1..{MAX_DEPTH}, got {depth}")
        self._cbs = <abi.iocb*>PyMem_RawMalloc(depth * sizeof(abi.iocb))
        self._ready = <abi.iocb**>PyMem_RawMalloc(depth * sizeof(abi.iocb*))
        self._events = <abi.io_event*>PyMem_RawMalloc(depth * sizeof(abi.io_event))
        self._free = <int*>PyMem_RawMalloc(depth * sizeof(int))
        if not (self._cbs and self._ready and self._events and self._free):
            self._free_arrays()
            raise MemoryError(f"cannot allocate AIO arrays for depth {depth}")
        with nogil:
            ret = abi.syscall(abi.SYS_io_setup, <unsigned int>depth, &ctx)
        if ret < 0:
            e = errno
            self._free_arrays()
            raise OSError(e, f"io_setup({depth}) failed: {os.strerror(e)}"
                             f"{_aio_limits_hint(e)}")
        self._ctx = ctx
        self._depth = depth
        self._open = True

    cdef void _free_arrays(self) noexcept:
        PyMem_RawFree(self._cbs)
        PyMem_RawFree(self._ready)
        PyMem_RawFree(self._events)
        PyMem_RawFree(self._free)
        self._cbs = NULL
        self._ready = NULL
        self._events = NULL
        self._free = NULL

    cdef void _destroy(self) noexcept:
        cdef abi.aio_context_t ctx = self._ctx
        if self._open:
            self._open = False
            self._ctx = 0
            # io_destroy cancels what it can and waits for the rest, so no completion can
            # land in memory after this returns.
            with nogil:
                abi.syscall(abi.SYS_io_destroy, ctx)
        self._free_arrays()

    def __dealloc__(self):
        self._destroy()

    def close(self):
        """Destroy the kernel context. Idempotent; refuses while a transfer runs on it."""
        if self._busy:
            raise RuntimeError("AioContext.close() while a transfer is running on it")
        self._destroy()

    @property
    def closed(self):
        return not self._open

    @property
    def depth(self):
        return self._depth

    def __enter__(self):
        self._ensure_open()
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if not self._open else f"depth={self._depth}"
        return f"<aioswap._aio.AioContext {state}>"

    cdef _ensure_open(self):
        if not self._open:
            raise HandleClosedError("I/O on a closed AioContext")

    def pread(self, int fd, buf, long long offset=0, nbytes=None, *,
              block_size=1 << 20, queue_depth=None, bint single_submit=False,
              bint overlap_events=True, path=None):
        """Read ``nbytes`` from ``fd`` at ``offset`` into ``buf``; return the bytes read.

        Parameters
        ----------
        fd : int
            Open file descriptor (``O_DIRECT`` or not).
        buf : buffer or int
            A writable C-contiguous buffer, or a raw address (then ``nbytes`` is required and
            the caller keeps the memory alive until this returns).
        offset : int
            File offset, >= 0.
        nbytes : int, optional
            Bytes to move; defaults to the whole buffer, may not exceed it.
        block_size, queue_depth, single_submit, overlap_events
            How the request is cut and driven; ``queue_depth`` defaults to the context depth.
        path : str, optional
            Named in error messages.

        Raises
        ------
        OSError
            A kernel error (errno set), with the file offset of the failed piece.
        ShortReadError
            The file ended before ``nbytes`` were read.
        """
        return self._single(abi.IOCB_CMD_PREAD, fd, buf, offset, nbytes, block_size,
                            queue_depth, single_submit, overlap_events, path)

    def pwrite(self, int fd, buf, long long offset=0, nbytes=None, *,
               block_size=1 << 20, queue_depth=None, bint single_submit=False,
               bint overlap_events=True, path=None):
        """Write ``nbytes`` of ``buf`` to ``fd`` at ``offset``; return the bytes written.

        Same parameters as :meth:`pread`; ``buf`` may be read-only.
        """
        return self._single(abi.IOCB_CMD_PWRITE, fd, buf, offset, nbytes, block_size,
                            queue_depth, single_submit, overlap_events, path)

    def preadv(self, int fd, segments, *, block_size=1 << 20, queue_depth=None,
               bint single_submit=False, bint overlap_events=True, path=None):
        """Read many ``(address, nbytes, file_offset)`` segments in one call; return bytes read.

        The caller keeps every segment's memory alive until this returns.
        """
        return self._vector(abi.IOCB_CMD_PREAD, fd, segments, block_size, queue_depth,
                            single_submit, overlap_events, path)

    def pwritev(self, int fd, segments, *, block_size=1 << 20, queue_depth=None,
                bint single_submit=False, bint overlap_events=True, path=None):
        """Write many ``(address, nbytes, file_offset)`` segments in one call."""
        return self._vector(abi.IOCB_CMD_PWRITE, fd, segments, block_size, queue_depth,
                            single_submit, overlap_events, path)

    cdef object _single(self, uint16_t opcode, int fd, object buf, long long offset,
                        object nbytes, object block_size, object queue_depth,
                        bint single_submit, bint overlap_events, object path):
        cdef Py_buffer view
        cdef bint have_view = False
        cdef _Seg seg
        cdef bint is_read = opcode == abi.IOCB_CMD_PREAD
        self._ensure_open()
        if offset < 0:
            raise ValueError(f"negative file offset {offset}{_in(path)}")
        if isinstance(buf, int):
            if nbytes is None:
                raise TypeError("nbytes is required when buf is a raw address")
            if buf <= 0 and nbytes:
                raise ValueError(f"invalid buffer address {buf:#x}")
            seg.addr = <uint64_t>buf
            seg.nbytes = _nonneg(nbytes, "nbytes", path)
        else:
            flags = (PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) if is_read else PyBUF_ANY_CONTIGUOUS
            try:
                PyObject_GetBuffer(buf, &view, flags)
            except (BufferError, ValueError) as exc:    # numpy refuses with ValueError
                need = "a writable C-contiguous" if is_read else "a contiguous"
                raise BufferError(f"{'read' if is_read else 'write'}{_in(path)} needs {need} "
                                  f"buffer, got {type(buf).__name__}: {exc}") from None
            have_view = True
        try:
            if have_view:
                seg.addr = <uint64_t>view.buf
                if nbytes is None:
                    seg.nbytes = <uint64_t>view.len
                else:
                    seg.nbytes = _nonneg(nbytes, "nbytes", path)
                    if seg.nbytes > <uint64_t>view.len:
                        raise ValueError(f"nbytes={nbytes} exceeds the buffer's "
                                         f"{view.len} bytes{_in(path)}")
            seg.offset = offset
            return self._execute(opcode, fd, &seg, 1, block_size, queue_depth,
                                 single_submit, overlap_events, path)
        finally:
            if have_view:
                PyBuffer_Release(&view)

    cdef object _vector(self, uint16_t opcode, int fd, object segments, object block_size,
                        object queue_depth, bint single_submit, bint overlap_events,
                        object path):
        cdef Py_ssize_t i, n
        cdef _Seg* segs
        self._ensure_open()
        items = list(segments)
        n = len(items)
        if n == 0:
            return 0
        segs = <_Seg*>PyMem_RawMalloc(n * sizeof(_Seg))
        if segs == NULL:
            raise MemoryError()
        try:
            for i in range(n):
                addr, nb, off = items[i]
                if off < 0:
                    raise ValueError(f"segment {i}: negative file offset {off}{_in(path)}")
                segs[i].nbytes = _nonneg(nb, f"segment {i} nbytes", path)
                if addr <= 0 and nb:
                    raise ValueError(f"segment {i}: invalid buffer address {addr:#x}")
                segs[i].addr = <uint64_t>addr
                segs[i].offset = <int64_t>off
            return self._execute(opcode, fd, segs, n, block_size, queue_depth,
                                 single_submit, overlap_events, path)
        finally:
            PyMem_RawFree(segs)

    cdef object _execute(self, uint16_t opcode, int fd, _Seg* segs, Py_ssize_t nsegs,
                         object block_size, object queue_depth, bint single_submit,
                         bint overlap_events, object path):
        cdef _Run r
        cdef int rc, i
        cdef uint64_t total = 0
        if fd < 0:
            raise ValueError(f"invalid file descriptor {fd}{_in(path)}")
        bs = int(block_size)
        if bs <= 0:
            raise ValueError(f"block_size must be positive, got {bs}")
        qd = self._depth if queue_depth is None else int(queue_depth)
        if qd < 1 or qd > self._depth:
            raise ValueError(f"queue_depth {qd} outside 1..{self._depth} (the context depth)")
        for i in range(nsegs):
            total += segs[i].nbytes
        if total == 0:
            return 0
        if self._busy:
            raise RuntimeError("AioContext is running another transfer; use one per thread")
        memset(&r, 0, sizeof(_Run))
        r.ctx = self._ctx
        r.fd = fd
        r.opcode = opcode
        r.segs = segs
        r.nsegs = nsegs
        r.block_size = <uint64_t>bs
        r.qd = qd
        r.single_submit = single_submit
        r.overlap = overlap_events
        r.cbs = self._cbs
        r.ready = self._ready
        r.events = self._events
        r.free_slots = self._free
        r.nfree = qd
        for i in range(qd):
            self._free[i] = i
        self._busy = True
        try:
            while True:
                with nogil:
                    rc = _drive(&r)
                if rc == 0:
                    break
                try:
                    PyErr_CheckSignals()
                except BaseException:
                    # a signal handler raised: finish what the kernel holds, then re-raise
                    r.stop = True
                    while True:
                        with nogil:
                            rc = _drive(&r)
                        if rc == 0:
                            break
                    raise
        finally:
            self._busy = False
            if r.broken:
                self._destroy()
        op = "read" if opcode == abi.IOCB_CMD_PREAD else "write"
        if r.broken:
            raise OSError(r.err, f"io_getevents failed during a {op}: {os.strerror(r.err)}; "
                                 f"the context was destroyed", path)
        if r.err:
            exc = OSError(r.err, f"{os.strerror(r.err)} ({op} of {r.err_nbytes} bytes at file "
                                 f"offset {r.err_offset}; {r.done} of {total} bytes done)",
                          path)
            exc.offset = r.err_offset
            raise exc
        if r.eof:
            raise ShortReadError(
                f"read of {total} bytes{_in(path)} reached end of file at offset "
                f"{r.err_offset} ({r.done} bytes read)",
                path=None if path is None else os.fsdecode(path),
                offset=segs[0].offset, nbytes=total, file_size=_fd_size(fd))
        return r.done


cdef uint64_t _nonneg(object value, str what, object path) except? 0:
    v = int(value)
    if v < 0:
        raise ValueError(f"negative {what} {v}{_in(path)}")
    return <uint64_t>v


cdef str _in(object path):
    return "" if path is None else f" ({os.fsdecode(path)!r})"


cdef object _fd_size(int fd):
    try:
        return os.fstat(fd).st_size
    except OSError:
        return None


cdef str _aio_limits_hint(int e):
    if e != EAGAIN:
        return ""
    try:
        with open("/proc/sys/fs/aio-nr") as f:
            nr = f.read().strip()
        with open("/proc/sys/fs/aio-max-nr") as f:
            mx = f.read().strip()
    except OSError:
        return ""
    return f" (fs.aio-nr={nr} of fs.aio-max-nr={mx}; raise it with sysctl fs.aio-max-nr)"


def open_direct(path, *, bint write=False, bint create=False, bint truncate=False,
                int mode=0o644):
    """Open ``path`` with ``O_DIRECT``; return the fd.

    Raises
    ------
    DirectIOUnsupportedError
        The file system refuses ``O_DIRECT`` (EINVAL at open). A file this call created is
        removed again.
    FileNotFoundError, IsADirectoryError, PermissionError
        As ``os.open`` raises them.
    """
    flags = os.O_DIRECT | os.O_CLOEXEC | (os.O_RDWR if write else os.O_RDONLY)
    if create:
        flags |= os.O_CREAT
    if truncate:
        flags |= os.O_TRUNC
    existed = os.path.lexists(path) if create else True
    try:
        return os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno != EINVAL:
            raise
        if os.path.isdir(path):     # O_DIRECT on a directory is EINVAL on any file system
            raise IsADirectoryError(EISDIR, "is a directory", os.fsdecode(path)) from None
        if not existed:
            try:
                os.unlink(path)
            except OSError:
                pass
        raise DirectIOUnsupportedError(
            EINVAL, f"the file system refuses O_DIRECT for {os.fsdecode(path)!r}",
            os.fsdecode(path)) from None


def dio_alignment(file):
    """Return ``(memory_alignment, offset_alignment)`` for direct I/O on ``file``.

    ``file`` is a path or an open fd. The values come from ``statx(STATX_DIOALIGN)``
    (Linux 6.1+); where the kernel or file system does not report them, 4096 is returned
    for both, which every Linux file system that supports ``O_DIRECT`` accepts.
    """
    cdef abi.statx_buf st
    cdef long ret
    cdef int dirfd, flags, e
    cdef bytes bpath
    memset(&st, 0, sizeof(st))
    if isinstance(file, int):
        dirfd = file
        bpath = b""
        flags = abi.AT_EMPTY_PATH
    else:
        dirfd = abi.AT_FDCWD
        bpath = os.fsencode(file)
        flags = 0
    cdef const char* cpath = bpath
    with nogil:
        ret = abi.syscall(abi.SYS_statx, dirfd, cpath, flags,
                          <unsigned int>abi.STATX_DIOALIGN, &st)
    if ret < 0:
        e = errno
        if e == ENOSYS:
            return (DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT)
        raise OSError(e, os.strerror(e), None if isinstance(file, int) else os.fsdecode(file))
    if (st.stx_mask & abi.STATX_DIOALIGN) and st.stx_dio_mem_align and st.stx_dio_offset_align:
        return (int(st.stx_dio_mem_align), int(st.stx_dio_offset_align))
    return (DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT)


def aio_available():
    """Return ``(True, "")`` if a kernel AIO context can be created, else ``(False, reason)``."""
    try:
        AioContext(1).close()
    except OSError as exc:
        return (False, str(exc))
    return (True, "")


cdef extern from "<sys/mman.h>" nogil:
    void* mmap(void* addr, size_t length, int prot, int flags, int fd, long offset)
    int munmap(void* addr, size_t length)
    int mlock(const void* addr, size_t length)
    int munlock(const void* addr, size_t length)
    int PROT_READ
    int PROT_WRITE
    int MAP_PRIVATE
    int MAP_ANONYMOUS
    void* MAP_FAILED

PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


cdef class LockedMemory:
    """Page-aligned anonymous memory (``mmap``), ``mlock``-ed when asked; a writable buffer.

    Parameters
    ----------
    nbytes : int
        Size in bytes (> 0); the mapping is rounded up to whole pages.
    lock : bool
        ``mlock`` the pages. When locking fails the mapping is removed again and
        ``OSError`` (EPERM/ENOMEM/EAGAIN, as the kernel said) is raised.

    Notes
    -----
    Objects that view this memory (``torch.frombuffer``, ``numpy.frombuffer``, memoryviews)
    keep it referenced, so it is unmapped only after the last of them is collected.
    Weak references are supported and are cleared *before* the pages are unlocked and
    unmapped, so a ``weakref.finalize`` callback can unregister the range while it is still
    mapped (no other mapping can take the address before the callback has run).
    """
    cdef void* _addr
    cdef size_t _nbytes
    cdef size_t _mapped
    cdef bint _locked
    cdef Py_ssize_t _exports
    cdef object __weakref__

    def __cinit__(self):
        self._addr = NULL
        self._nbytes = 0
        self._mapped = 0
        self._locked = False
        self._exports = 0

    def __init__(self, Py_ssize_t nbytes, bint lock=True):
        cdef size_t page = PAGE_SIZE
        cdef size_t mapped
        cdef void* addr
        cdef int rc = 0, e = 0
        if self._addr != NULL:
            raise RuntimeError("LockedMemory is already initialised")
        if nbytes <= 0:
            raise ValueError(f"LockedMemory needs a positive size, got {nbytes}")
        mapped = ((<size_t>nbytes + page - 1) // page) * page
        with nogil:
            addr = mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
            if addr == MAP_FAILED:
                e = errno
            elif lock:
                rc = mlock(addr, mapped)
                if rc != 0:
                    e = errno
                    munmap(addr, mapped)
        if addr == MAP_FAILED:
            raise MemoryError(f"mmap of {mapped} bytes failed: {os.strerror(e)}")
        if rc != 0:
            raise OSError(e, f"mlock of {mapped} bytes failed: {os.strerror(e)}")
        self._addr = addr
        self._nbytes = <size_t>nbytes
        self._mapped = mapped
        self._locked = lock

    @property
    def address(self):
        return <size_t>self._addr

    @property
    def nbytes(self):
        return self._nbytes

    @property
    def mapped_bytes(self):
        """Bytes mapped (and locked when ``locked``): ``nbytes`` rounded up to pages."""
        return self._mapped

    @property
    def locked(self):
        return self._locked

    @property
    def closed(self):
        return self._addr == NULL

    def __len__(self):
        return self._nbytes

    def __repr__(self):
        if self._addr == NULL:
            return "<aioswap._aio.LockedMemory released>"
        return (f"<aioswap._aio.LockedMemory {self._nbytes} bytes at {<size_t>self._addr:#x}"
                f"{' locked' if self._locked else ''}>")

    def __getbuffer__(self, Py_buffer* view, int flags):
        if self._addr == NULL:
            raise BufferError("LockedMemory was released")
        view.buf = self._addr
        view.obj = self
        view.len = <Py_ssize_t>self._nbytes
        view.readonly = 0
        view.itemsize = 1
        view.format = NULL
        if flags & PyBUF_FORMAT:
            view.format = b"B"
        view.ndim = 1
        view.shape = &view.len if (flags & PyBUF_ND) else NULL
        view.strides = &view.itemsize if (flags & PyBUF_STRIDES) else NULL
        view.suboffsets = NULL
        view.internal = NULL
        self._exports += 1

    def __releasebuffer__(self, Py_buffer* view):
        self._exports -= 1

    def release(self):
        """Unlock and unmap now. Idempotent; refuses while a buffer export is open."""
        if self._exports > 0:
            raise BufferError(f"LockedMemory of {self._nbytes} bytes has {self._exports} "
                              f"open buffer exports")
        self._unmap()

    cdef void _unmap(self) noexcept:
        cdef void* addr = self._addr
        cdef size_t mapped = self._mapped
        cdef bint locked = self._locked
        if addr == NULL:
            return
        self._addr = NULL
        with nogil:
            if locked:
                munlock(addr, mapped)
            munmap(addr, mapped)

    def __dealloc__(self):
        self._unmap()
