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
submission to its result. Also here: ``open_direct``, ``dio_alignment``, ``aio_available``
and :class:`LockedMemory`. Nothing here knows about torch: requests carry raw addresses
whose owners the queue keeps alive (``owner``) until the request is finished and seen.
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
from libc.string cimport memset

import logging
import os

from aioswap.errors import DirectIOUnsupportedError, HandleClosedError, ShortReadError

from aioswap._mman cimport MADV_POPULATE_READ, MADV_POPULATE_WRITE, madvise, mincore
from posix.mman cimport (MAP_ANONYMOUS, MAP_FAILED, MAP_PRIVATE, MAP_SHARED, PROT_READ,
                         PROT_WRITE, mlock, mmap, munlock, munmap)


cdef int _check(long ret, int err, str what, object path=None, str hint="") except -1:
    """The one checker of the engine's system calls, called right after each one.

    ``ret < 0`` (the raw syscall's -1) raises ``OSError(err, ...)`` naming the call; Python
    picks the subclass (FileNotFoundError, PermissionError...) from ``err``.
    """
    if ret >= 0:
        return 0
    raise OSError(err, f"{what} failed: {os.strerror(err)}{hint}", path)

#: The direct-I/O alignment every Linux file system that supports O_DIRECT accepts: what
#: dio_alignment() answers when statx cannot say, and what aioswap's own file layouts use.
DEFAULT_ALIGNMENT = 4096
#: Most pieces one AioQueue keeps in flight (io_setup takes an unsigned int, but the
#: kernel's aio-max-nr default is 65536).
MAX_DEPTH = 65535


cdef bint _noted = False


cdef void _note_once(str text):
    """Say once per process (the ``aioswap`` logger, INFO) that the engine runs slower than it
    could; the library never prints."""
    global _noted
    if not _noted:
        _noted = True
        logging.getLogger("aioswap").info("aioswap engine: %s", text)


cdef str _uring_hint(int e, int depth):
    if e == EINVAL and depth > 32768:
        return " (an io_uring holds at most 32768 entries: a smaller queue_depth, or kernel AIO)"
    if e == EPERM:
        try:
            with open("/proc/sys/kernel/io_uring_disabled") as f:
                v = f.read().strip()
        except OSError:
            v = "?"
        if v != "0":
            return f" (kernel.io_uring_disabled={v})"
        return " (a seccomp profile, e.g. a container's, refuses io_uring)"
    if e == ENOSYS:
        return " (the kernel has no io_uring)"
    return ""


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
        e = errno
    if ret < 0 and e == ENOSYS:
        return (DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT)
    _check(ret, e, "statx", None if isinstance(file, int) else os.fsdecode(file))
    if (st.stx_mask & abi.STATX_DIOALIGN) and st.stx_dio_mem_align and st.stx_dio_offset_align:
        return (int(st.stx_dio_mem_align), int(st.stx_dio_offset_align))
    return (DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT)


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


cdef size_t _HUGE = 2 << 20

# Locked mappings of 4 MiB and more that were freed, kept (still locked and faulted in) for
# the next allocation of the same size: a swap-in or a checkpoint load allocates what the
# last one freed, and fresh memory costs a page fault per page (on VMs whose host backs
# guest RAM lazily, ~0.5 GB/s: slower than the drive). Bounded; set_locked_cache(0) turns
# it off. The GIL guards it (LockedMemory is made and freed with the GIL held).
cdef struct _Cached:
    void* addr
    size_t mapped

DEF _NCACHE = 256
cdef _Cached _cache[_NCACHE]
cdef int _ncache = 0
cdef size_t _cache_bytes = 0
cdef size_t _cache_cap = 2 << 30


def set_locked_cache(size_t nbytes):
    """Most bytes of freed locked memory kept for reuse (default 2 GiB; 0: none). Returns
    the previous cap; shrinking unmaps what no longer fits."""
    global _cache_cap
    old = _cache_cap
    _cache_cap = nbytes
    _trim_cache(nbytes)
    return old


def locked_cache_bytes():
    """Bytes of freed locked memory kept for reuse now."""
    return _cache_bytes


cdef void _trim_cache(size_t cap) noexcept:
    global _ncache, _cache_bytes
    cdef void* addr
    cdef size_t mapped
    while _ncache and _cache_bytes > cap:
        _ncache -= 1
        addr = _cache[_ncache].addr
        mapped = _cache[_ncache].mapped
        _cache_bytes -= mapped
        with nogil:
            munlock(addr, mapped)
            munmap(addr, mapped)


cdef void* _cache_take(size_t mapped) noexcept:
    """A kept locked mapping of exactly ``mapped`` bytes, or NULL."""
    global _ncache, _cache_bytes
    cdef int i
    cdef void* addr
    for i in range(_ncache - 1, -1, -1):
        if _cache[i].mapped == mapped:
            addr = _cache[i].addr
            _ncache -= 1
            _cache[i] = _cache[_ncache]
            _cache_bytes -= mapped
            return addr
    return NULL


cdef bint _cache_put(void* addr, size_t mapped) noexcept:
    """Keep a freed locked mapping; False when it does not fit (the caller unmaps it)."""
    global _ncache, _cache_bytes
    if mapped < 2 * _HUGE or _cache_cap == 0:
        return False
    while _ncache and (_ncache == _NCACHE or _cache_bytes + mapped > _cache_cap):
        _ncache -= 1                            # the oldest goes first
        _cache_bytes -= _cache[0].mapped
        with nogil:
            munlock(_cache[0].addr, _cache[0].mapped)
            munmap(_cache[0].addr, _cache[0].mapped)
        _cache[0] = _cache[_ncache]
    if _cache_bytes + mapped > _cache_cap:
        return False
    _cache[_ncache].addr = addr
    _cache[_ncache].mapped = mapped
    _ncache += 1
    _cache_bytes += mapped
    return True


def _forget_cache_after_fork():
    """A child inherits the parent's kept and reserved mappings unlocked (mlock is not
    inherited)."""
    global _ncache, _cache_bytes, _nreserve, _reserve_bytes
    while _ncache:
        _ncache -= 1
        munmap(_cache[_ncache].addr, _cache[_ncache].mapped)
    _cache_bytes = 0
    while _nreserve:
        _nreserve -= 1
        munmap(_reserve[_nreserve].addr, _reserve[_nreserve].mapped)
    _reserve_bytes = 0


# Locked memory faulted in ahead of need (reserve_locked): page-locked allocations are
# carved from the front of a reservation, so they cost no page fault and no mlock when they
# are made. A carved piece is a mapping of its own from then on (freed like any other).
# The GIL guards the table, as for the cache.
DEF _NRESERVE = 16
cdef _Cached _reserve[_NRESERVE]
cdef int _nreserve = 0
cdef size_t _reserve_bytes = 0


def reserve_locked(Py_ssize_t nbytes):
    """Map, lock and fault in ``nbytes`` (rounded up to pages) now, for page-locked
    allocations to take later. Returns the bytes reserved in all.

    Raises ``ValueError`` for a size <= 0 or past 16 reservations, ``MemoryError`` when the
    mapping fails and ``OSError`` as ``mlock`` does (EPERM/ENOMEM/EAGAIN: RLIMIT_MEMLOCK).
    """
    global _nreserve, _reserve_bytes
    cdef size_t page = PAGE_SIZE
    cdef size_t mapped
    cdef void* addr
    if nbytes <= 0:
        raise ValueError(f"reserve_locked needs a positive size, got {nbytes}")
    if _nreserve == _NRESERVE:
        raise ValueError(f"at most {_NRESERVE} reservations at once; release_locked_reserve() "
                         f"first")
    mapped = ((<size_t>nbytes + page - 1) // page) * page
    addr = _fresh(mapped, True)
    if _nreserve == _NRESERVE:          # another thread filled the table meanwhile
        munlock(addr, mapped)
        munmap(addr, mapped)
        raise ValueError(f"at most {_NRESERVE} reservations at once")
    _reserve[_nreserve].addr = addr
    _reserve[_nreserve].mapped = mapped
    _nreserve += 1
    _reserve_bytes += mapped
    return _reserve_bytes


def locked_reserve_bytes():
    """Bytes reserved by ``reserve_locked`` and not taken yet."""
    return _reserve_bytes


def release_locked_reserve():
    """Unlock and unmap what is reserved and not taken; returns the bytes released."""
    global _nreserve, _reserve_bytes
    cdef size_t n = _reserve_bytes
    while _nreserve:
        _nreserve -= 1
        with nogil:
            munlock(_reserve[_nreserve].addr, _reserve[_nreserve].mapped)
            munmap(_reserve[_nreserve].addr, _reserve[_nreserve].mapped)
    _reserve_bytes = 0
    return n


cdef void* _reserve_take(size_t mapped) noexcept:
    """``mapped`` bytes from the front of a reservation that has them, or NULL."""
    global _nreserve, _reserve_bytes
    cdef int i
    cdef void* addr
    for i in range(_nreserve):
        if _reserve[i].mapped >= mapped:
            addr = _reserve[i].addr
            _reserve[i].addr = <void*>(<char*>addr + mapped)
            _reserve[i].mapped -= mapped
            _reserve_bytes -= mapped
            if _reserve[i].mapped == 0:
                _nreserve -= 1
                _reserve[i] = _reserve[_nreserve]
            return addr
    return NULL


cdef void* _map(size_t mapped) noexcept nogil:
    """Anonymous memory; from 4 MiB on, 2 MiB aligned (where the system's transparent huge
    page policy is "always", such a mapping can get huge pages).

    Not advised MADV_HUGEPAGE: with the common defrag setting ("madvise") that makes every
    fault of fresh memory compact or reclaim for a huge page first, and on VMs that hand
    freed memory back to the host fresh huge pages come slowly. Measured here (2-core VM,
    1.8 GB in 576 tensors, fresh process): locking ran at 0.5-0.8 GB/s advised against
    1.4-1.6 GB/s not advised, and a cold swap_in_state_dict at 0.29-0.76 against 0.67-0.86.
    """
    cdef void* raw
    cdef size_t a, head, tail
    if mapped < 2 * _HUGE:
        return mmap(NULL, mapped, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    raw = mmap(NULL, mapped + _HUGE, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    if raw == MAP_FAILED:
        return raw
    a = (<size_t>raw + _HUGE - 1) & ~(_HUGE - 1)
    head = a - <size_t>raw
    tail = _HUGE - head
    if head:
        munmap(raw, head)
    if tail:
        munmap(<void*>(a + mapped), tail)
    return <void*>a


cdef void* _fresh(size_t mapped, bint lock) except NULL:
    """A fresh mapping of ``mapped`` bytes (see :func:`_map`), locked and faulted in when
    ``lock`` (GIL released meanwhile). Raises MemoryError, or OSError as mlock failed (the
    mapping removed again)."""
    cdef void* addr
    cdef int rc = 0, e = 0, attempt
    for attempt in range(2):
        with nogil:
            addr = _map(mapped)
            if addr == MAP_FAILED:
                e = errno
            elif lock:
                rc = mlock(addr, mapped)
                if rc != 0:
                    e = errno
                    munmap(addr, mapped)
        if rc == 0 or _cache_bytes == 0 or e not in (ENOMEM, EAGAIN, EPERM):
            break
        # over RLIMIT_MEMLOCK: what the cache keeps counts against it too, and it is only
        # kept to be reused, never to make an allocation fail. Let it go and try once more.
        _trim_cache(0)
        rc = 0
    if addr == MAP_FAILED:
        raise MemoryError(f"mmap of {mapped} bytes failed: {os.strerror(e)}")
    _check(rc, e, f"mlock of {mapped} bytes")
    return addr


# Page-locked allocations an io_uring registers (AioQueue._fix_at): from 64 KiB (a table of 64
# buffers is not spent on small ones) to 8 GiB (8 of its 64 entries).
cdef size_t _FIX_MIN = 64 << 10
cdef size_t _FIX_MAX = 8ULL << 30


cdef class AioQueue


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
    cdef object _rings          # weak references to the AioQueues whose io_uring registered
                                # (or refused) these pages: see AioQueue._fix_at
    cdef object __weakref__

    def __cinit__(self):
        self._addr = NULL
        self._nbytes = 0
        self._mapped = 0
        self._locked = False
        self._exports = 0
        self._rings = None

    def __init__(self, Py_ssize_t nbytes, bint lock=True):
        cdef size_t page = PAGE_SIZE
        cdef size_t mapped
        cdef void* addr
        if self._addr != NULL:
            raise RuntimeError("LockedMemory is already initialised")
        if nbytes <= 0:
            raise ValueError(f"LockedMemory needs a positive size, got {nbytes}")
        mapped = ((<size_t>nbytes + page - 1) // page) * page
        if lock:
            addr = _cache_take(mapped) if mapped >= 2 * _HUGE else NULL
            if addr == NULL:
                addr = _reserve_take(mapped)
            if addr != NULL:
                self._addr = addr
                self._nbytes = <size_t>nbytes
                self._mapped = mapped
                self._locked = True
                return
        addr = _fresh(mapped, lock)
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

    def close(self):
        """Unlock and unmap now. Idempotent; refuses while a buffer export is open."""
        if self._exports > 0:
            raise BufferError(f"LockedMemory of {self._nbytes} bytes has {self._exports} "
                              f"open buffer exports")
        self._unmap()

    release = close         # the name of version 0

    cdef void _unmap(self) noexcept:
        cdef void* addr = self._addr
        cdef size_t mapped = self._mapped
        cdef bint locked = self._locked
        if addr == NULL:
            return
        if self._rings is not None:
            _forget_fixed(self)             # no ring keeps these pages once they are let go
        self._addr = NULL
        if locked and _cache_put(addr, mapped):
            return
        with nogil:
            if locked:
                munlock(addr, mapped)
            munmap(addr, mapped)

    def __dealloc__(self):
        self._unmap()


# ========================================================================================
# The shared queue: many requests, one kernel context
#
# An AioQueue owns one kernel AIO context and ``depth`` iocb slots. Requests from any
# thread are linked into one pending list; whoever holds the queue's mutex cuts the next
# pieces of pending requests into free slots, and the pieces go to the kernel in one
# io_submit. One thread at a time holds the reaping role: a sync caller waiting for its own
# request, or the handle's completion thread (serve()) while asynchronous work is in flight.
# Reaping accounts each completion to its request; a request finishes when its last piece is
# reaped. No Python runs per piece.
#
# Pieces come in kinds:
#   K_DIRECT     the caller's memory (or any memory on a buffered fd) straight to the kernel
#   K_BREAD      read into a ring buffer, copied out when it lands (bounce and edge reads)
#   K_BWRITE     copied into a ring buffer, then written
#   K_RMW_READ   an edge block of a write (bytes of the block outside the request): read the
#                block, patch the request's bytes in, then write it whole (K_RMW_WRITE);
#                serialised per (file, block) across the process, so O_DIRECT writes to one
#                file never go through the page cache and neighbours never lose bytes
#   K_FSYNC      IOCB_CMD_FSYNC after a write's last piece (fsync=True)

from libc.string cimport memcpy
from posix.fcntl cimport F_GETFL
from posix.fcntl cimport fcntl as c_fcntl
from posix.unistd cimport ftruncate, getpid, pread, pwrite, usleep
from cpython.ref cimport Py_DECREF, Py_INCREF, PyObject
from posix.uio cimport iovec


cdef extern from "_statlite.h" nogil:
    ctypedef struct stat_lite:
        unsigned mode
        uint64_t dev
        uint64_t ino
        int64_t size
        uint64_t nlink
    int stat_lite_at(int dirfd, const char* path, int flags, stat_lite* out)
    int stat_lite_fd(int fd, stat_lite* out)
    int AT_FDCWD
    int statlite_nostatx_


cdef extern from "<sys/stat.h>" nogil:
    bint S_ISREG(int mode)
    bint S_ISBLK(int mode)


def _statlite_fallback(bint on):
    """Tests only: ask ``fstatat`` instead of ``statx`` (as where statx is refused); returns
    the previous setting."""
    global statlite_nostatx_
    old = bool(statlite_nostatx_)
    statlite_nostatx_ = 1 if on else 0
    return old


def fsize(int fd):
    """The size of the file behind ``fd`` (``statx`` without the times: see _statlite.h),
    without building a ``stat_result`` (a read asks it each time)."""
    cdef stat_lite st
    cdef int ret = stat_lite_fd(fd, &st)   # the GIL stays: no I/O
    if ret < 0:
        raise OSError(errno, os.strerror(errno))
    return st.size


def stat_lite_of(file):
    """``(st_mode, st_dev, st_ino, st_size, st_nlink)`` of an fd or a path (followed), as
    ``os.stat`` gives them, but asked without the timestamps, so that the query does not make
    the next write to the file stamp (and dirty) its inode (see _statlite.h). Raises
    ``OSError`` as ``os.stat`` does."""
    cdef stat_lite st
    cdef int ret
    cdef bytes path
    if type(file) is int:
        ret = stat_lite_fd(<int>file, &st)
    else:
        path = os.fsencode(file)
        if b"\0" in path:
            raise ValueError("embedded null byte")
        ret = stat_lite_at(AT_FDCWD, path, 0, &st)
    if ret < 0:
        raise OSError(errno, os.strerror(errno), file if not isinstance(file, int) else None)
    return (st.mode, st.dev, st.ino, st.size, st.nlink)


cdef enum:
    K_DIRECT = 0
    K_BREAD = 1
    K_BWRITE = 2
    K_RMW_READ = 3
    K_RMW_WRITE = 4
    K_FSYNC = 5

cdef enum:
    ST_HEAD = 0
    ST_MIDDLE = 1
    ST_TAIL = 2
    ST_FSYNC = 3
    ST_DONE = 4

cdef enum:
    M_DIRECT = 0        # pieces on the caller's memory, O_DIRECT alignment applies
    M_BOUNCE = 1        # every piece through the ring
    M_PLAIN = 2         # a buffered fd: no alignment, no ring

MODE_DIRECT = M_DIRECT
MODE_BOUNCE = M_BOUNCE
MODE_PLAIN = M_PLAIN

# Most pieces one call cuts and submits; bounds stack arrays of submitters.
DEF _BATCH = 64
# Longest a waiter sleeps before it looks at Python signal handlers again.
cdef long _TICK_NS = 10000000
# While a piece waits for an edge block another queue holds, poll this often.
cdef long _EDGE_POLL_NS = 200000


cdef extern from "<sys/vfs.h>" nogil:
    ctypedef struct _statfs_t "struct statfs":
        long f_type
    int _fstatfs "fstatfs"(int fd, _statfs_t* buf)

cdef long _TMPFS_MAGIC = 0x01021994


cdef struct _FileCore:
    int64_t logical_end         # largest end of the writes in flight on the file
    int active_writes
    int64_t known_size          # the file is at least this long (see _grow; 0: not known)
    bint no_grow                # fallocate is refused here: writes extend the file themselves
    bint inline                 # on tmpfs: io_uring runs its pieces in the submitting thread


cdef struct _Req:
    int fd
    uint16_t opcode
    int mode
    uint64_t addr
    uint64_t nbytes
    int64_t offset
    uint64_t align
    uint64_t block              # piece size on the caller's memory
    uint64_t bblock             # piece size through the ring
    _FileCore* file
    bint fsync
    bint sync
    uint64_t head_end
    uint64_t tail_start
    int stage
    uint64_t pos
    int inflight
    uint64_t done
    int err
    int64_t err_offset
    uint64_t err_nbytes
    bint eof
    bint stop                   # cut nothing new: failed or cancelled
    bint finished
    bint queued
    bint counted_write
    PyObject* obj               # its Request, referenced while the queue may touch it
    _Req* prev
    _Req* next
    _Req* done_next


cdef struct _Slot:
    abi.iocb cb
    _Req* req
    int kind
    int buf
    int lock
    bint fresh
    bint pads                   # an edge block past the end of the file is written whole
    uint64_t rgot               # bytes of the edge block that existed (its read)
    int64_t parked              # a reaped result waiting for its copy-out
    int err
    bint eof
    uint64_t uaddr
    uint64_t ulen
    uint64_t skip
    uint64_t span
    uint64_t got
    int64_t foff


cdef struct _Q:
    abi.aio_context_t ctx
    int depth                   # most pieces in the kernel at once
    int nslots                  # slots: 2 x depth, so that reaped pieces waiting for their
                                # copy-out do not keep new pieces from the drive
    int kin                     # pieces in the kernel (cut, not yet reaped)
    _Slot* slots
    int* free_slots
    int nfree
    int inflight                # slots taken (cut and not yet accounted)
    char* ring
    uint64_t bufsize
    int nbuf
    int* free_bufs
    int nfreebuf
    _Req* pend_head
    _Req* pend_tail
    _Req* done_head
    _Req* done_tail
    int ndone
    int nasync                  # asynchronous requests not finished: the completion thread
                                # reaps only for them, sync callers reap for themselves
    double done_since           # when the oldest undelivered request finished
    int* retry                  # cut, not yet accepted by io_submit (EAGAIN)
    int nretry
    int* rscratch               # the reaper's: slots to launch
    abi.io_event* events
    bint reaping
    bint closing
    bint edge_blocked
    bint single_submit
    bint overlap
    int broken                  # errno of a failed io_getevents: nothing more can be reaped
    kt.kthreads* threads        # the worker-thread backend (NULL: not in use)
    ur.uring* uring             # the io_uring backend (NULL: not in use)
    int waiters
    int eager                   # threads blocked in the handle's wait(): deliver at once
    int helpers                 # threads in _help: they reap and deliver, the completion
                                # thread stands by
    double last_async           # when the last asynchronous request was queued
    bint helped                 # its callers wait for their bursts and reap them (help()):
                                # a new asynchronous request does not wake the completion
                                # thread, which looks every _HELPED_TICK_S instead
    pt.pthread_mutex_t mu
    pt.pthread_cond_t cv        # waiters for pieces, the reaping role or finished requests
    pt.pthread_cond_t scv       # the completion thread's own (see _wake)
    bint swaiting               # the completion thread waits on scv
    bint napping                # ... until a burst its caller is queueing is over
    bint ticking                # ... for at most _HELPED_TICK_S


# ---- the process-wide table of edge blocks being read-modified-written

cdef struct _Edge:
    void* file
    int64_t block

DEF _NEDGES = 1024
cdef _Edge _edges[_NEDGES]
cdef pt.pthread_mutex_t _edge_mu
cdef long _self_pid = getpid()
cdef bint _vm_copy = True           # process_vm_* usable (not refused by seccomp)
cdef bint _populate = True          # madvise(MADV_POPULATE_WRITE) known (Linux >= 5.14)
# Copies out of the ring from this size on check the destination's pages with
# MADV_POPULATE_WRITE (which fails on a page that cannot be written, and faults the pages in
# for writing) and then memcpy: 1.3x the speed of process_vm_writev; smaller ones are not
# worth the extra syscall.
cdef size_t _POPULATE_MIN = 64 << 10
cdef size_t _page = PAGE_SIZE


cdef bint _populate_known() noexcept:
    """Whether this kernel knows MADV_POPULATE_WRITE (asked once, on one fresh page)."""
    cdef void* p = mmap(NULL, _page, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1,
                        0)
    cdef int rc
    if p == MAP_FAILED:
        return False
    rc = madvise(p, _page, MADV_POPULATE_WRITE)
    munmap(p, _page)
    return rc == 0


_populate = _populate_known()


cdef extern from "Python.h":
    object PyMemoryView_FromMemory(char* mem, Py_ssize_t size, int flags)


def address_view(size_t address, Py_ssize_t nbytes):
    """A read-only ``memoryview`` of ``nbytes`` bytes at ``address``, without a copy.

    The caller keeps the memory alive and unchanged in size while the view is used (the
    view holds no reference to it). Unlike a ``ctypes`` array of that size, it makes no new
    type (each of those is a reference cycle for the garbage collector).
    """
    if nbytes < 0:
        raise ValueError(f"address_view needs a size >= 0, got {nbytes}")
    if nbytes == 0:
        return memoryview(b"")
    if address == 0:
        raise ValueError(f"address_view of {nbytes} bytes at address 0")
    return PyMemoryView_FromMemory(<char*>address, nbytes, 0x100)     # PyBUF_READ


def populate_read(object buf):
    """Fault in every page of ``buf`` (a mapping's buffer) for reading, in one call with the
    GIL released: for a file mapping, wait until its bytes are in the page cache (reading
    them if need be) and map them. Returns False where the kernel lacks
    ``MADV_POPULATE_READ`` (before Linux 5.14: the pages fault in as they are touched).

    Raises OSError (EFAULT) where a page cannot be mapped: a file mapping past the file's
    end (the file shrank), or an I/O error.
    """
    cdef Py_buffer view
    cdef uintptr_t lo, hi
    cdef int rc = 0, e = 0
    PyObject_GetBuffer(buf, &view, PyBUF_SIMPLE)
    try:
        if view.len == 0:
            return True
        lo = <uintptr_t>view.buf & ~(<uintptr_t>_page - 1)
        hi = (<uintptr_t>view.buf + <size_t>view.len + _page - 1) & ~(<uintptr_t>_page - 1)
        with nogil:
            rc = madvise(<void*>lo, hi - lo, MADV_POPULATE_READ)
            if rc != 0:
                e = errno
    finally:
        PyBuffer_Release(&view)
    if rc != 0:
        if e == EINVAL:
            return False
        raise OSError(e, f"madvise(MADV_POPULATE_READ) of {hi - lo} bytes: {os.strerror(e)}")
    return True


def resident_prefix(int fd, int64_t offset, int64_t nbytes):
    """How many bytes from ``offset`` (at most ``nbytes``) lie in pages of ``fd``'s file
    that are in the page cache now: ``mincore`` over a mapping that is never touched, so it
    reads nothing and starts no read-ahead. (A ``RWF_NOWAIT`` read that misses does start
    one: the kernel reads the range into the cache without waiting.) 0 where it cannot be
    told (a file that cannot be mapped)."""
    cdef int64_t lo, hi, k, npages, got = 0
    cdef unsigned char* vec
    cdef void* addr
    if offset < 0 or nbytes <= 0:
        return 0
    lo = offset & ~(<int64_t>_page - 1)
    hi = offset + nbytes
    npages = (hi - lo + _page - 1) // _page
    vec = <unsigned char*>PyMem_RawMalloc(<size_t>npages)
    if vec == NULL:
        raise MemoryError()
    try:
        with nogil:
            addr = mmap(NULL, <size_t>(hi - lo), PROT_READ, MAP_SHARED, fd, lo)
            if addr != MAP_FAILED:
                if mincore(addr, <size_t>(hi - lo), vec) == 0:
                    k = 0
                    while k < npages and vec[k] & 1:
                        k += 1
                    got = min(lo + k * <int64_t>_page, hi) - offset
                munmap(addr, <size_t>(hi - lo))
    finally:
        PyMem_RawFree(vec)
    return got if got > 0 else 0


cdef int _copy_out(void* dst, const void* src, size_t n) noexcept nogil:
    """Copy a bounced read from the ring into the caller's memory; 0, or EFAULT where its
    pages cannot be written. The kernel copies (process_vm_writev on this process), so
    memory that is read-only anywhere (a read-only mmap, an mprotect-ed page) fails this
    piece with EFAULT instead of crashing the process; where the call is refused, memcpy."""
    cdef iovec local, remote
    cdef long ret
    cdef uintptr_t lo, hi
    global _vm_copy
    if n == 0:
        return 0
    if _populate and n >= _POPULATE_MIN:
        lo = <uintptr_t>dst & ~(<uintptr_t>_page - 1)
        hi = (<uintptr_t>dst + n + _page - 1) & ~(<uintptr_t>_page - 1)
        if madvise(<void*>lo, hi - lo, MADV_POPULATE_WRITE) == 0:
            # every page is there and writable (a page made read-only between this and the
            # copy would take a concurrent mprotect of memory the request owns)
            memcpy(dst, src, n)
            return 0
        # EINVAL (a read-only page, or an old kernel), EFAULT, ENOMEM: the kernel's copy
        # below tells the errors apart
    if _vm_copy:
        local.iov_base = <void*>src
        remote.iov_base = dst
        local.iov_len = n
        remote.iov_len = n
        ret = abi.syscall(abi.SYS_process_vm_writev, _self_pid, &local, <long>1, &remote,
                          <long>1, <long>0)
        if ret == <long>n:
            return 0
        if ret >= 0 or errno == EFAULT:
            return EFAULT
        if errno != ENOSYS and errno != EPERM:
            return errno
        _vm_copy = False
    memcpy(dst, src, n)
    return 0
pt.pthread_mutex_init(&_edge_mu, NULL)
memset(_edges, 0, sizeof(_edges))


def _after_fork_in_child():
    """A child starts with no requests: the edge table is empty and its mutex fresh (another
    thread of the parent may have held it at fork())."""
    global _self_pid
    pt.pthread_mutex_init(&_edge_mu, NULL)
    memset(_edges, 0, sizeof(_edges))
    ur.uring_after_fork_child()
    _self_pid = getpid()
    _forget_cache_after_fork()


os.register_at_fork(after_in_child=_after_fork_in_child)


cdef int _edge_take(void* file, int64_t block) noexcept nogil:
    """Lock (file, block) for a read-modify-write; -1 when another holds it (or full)."""
    cdef int i, free_i = -1
    pt.pthread_mutex_lock(&_edge_mu)
    for i in range(_NEDGES):
        if _edges[i].file == NULL:
            if free_i < 0:
                free_i = i
        elif _edges[i].file == file and _edges[i].block == block:
            pt.pthread_mutex_unlock(&_edge_mu)
            return -1
    if free_i >= 0:
        _edges[free_i].file = file
        _edges[free_i].block = block
    pt.pthread_mutex_unlock(&_edge_mu)
    return free_i


cdef void _edge_give(int i) noexcept nogil:
    pt.pthread_mutex_lock(&_edge_mu)
    _edges[i].file = NULL
    pt.pthread_mutex_unlock(&_edge_mu)


cdef inline double _mono() noexcept nogil:
    cdef timespec ts
    clock_gettime(CLOCK_MONOTONIC, &ts)
    return ts.tv_sec + ts.tv_nsec * 1e-9


cdef inline void _after(timespec* ts, long ns) noexcept nogil:
    """``ts``: CLOCK_MONOTONIC ``ns`` nanoseconds from now (a condition's deadline)."""
    clock_gettime(CLOCK_MONOTONIC, ts)
    ts.tv_nsec += ns
    while ts.tv_nsec >= 1000000000:
        ts.tv_nsec -= 1000000000
        ts.tv_sec += 1


cdef void _timedwait(_Q* q, long ns) noexcept nogil:
    """Wait on q.cv (q.mu held) for at most ``ns`` nanoseconds."""
    cdef timespec ts
    _after(&ts, ns)
    q.waiters += 1
    pt.pthread_cond_timedwait(&q.cv, &q.mu, &ts)
    q.waiters -= 1


# While a queue's callers reap their own bursts (q.helped), the completion thread is not woken
# for each new asynchronous request; it looks this often instead, so a request nobody waits
# for is still reaped and delivered (its result at most this much later). Helped mode ends
# when the completion thread has to deliver by itself, or after _HELPED_IDLE_S without any
# asynchronous request.
cdef double _HELPED_TICK_S = 0.001
cdef double _HELPED_IDLE_S = 0.05


cdef inline void _wake(_Q* q) noexcept nogil:
    # (q.mu held) Something changed. The completion thread is woken only when it has
    # something to do: asynchronous requests to reap or deliver, or the queue closing. Not
    # for sync requests (their callers reap them: a wake per sync batch cost ~0.5 us per
    # 4 KiB request once the thread existed), nor while a waiting thread reaps and delivers
    # for it (a helper), nor while it stands by for a burst its caller is still queueing
    # (it looks again soon).
    if q.waiters:
        pt.pthread_cond_broadcast(&q.cv)
    if (q.swaiting and not q.napping and (q.helpers == 0 or q.closing)
            and (q.nasync or q.done_head != NULL or q.closing or q.broken)):
        pt.pthread_cond_signal(&q.scv)


cdef inline void _wake_queued(_Q* q) noexcept nogil:
    # (q.mu held) An asynchronous request was queued. While the queue's callers reap their
    # own bursts (q.helped), the completion thread is left asleep: it looks every
    # _HELPED_TICK_S anyway, and waking it for every burst (a futex wake, a context switch
    # and its nap timers) cost more CPU than the I/O itself (4 KiB bursts of 32 on the disk:
    # 8 -> 5.5 us per request).
    if not q.helped or q.eager or (q.swaiting and not q.ticking):
        _wake(q)
    elif q.waiters:
        pt.pthread_cond_broadcast(&q.cv)


cdef void _swait(_Q* q, long ns, bint nap) noexcept nogil:
    """The completion thread waits on q.scv (q.mu held) for at most ``ns`` nanoseconds."""
    cdef timespec ts
    _after(&ts, ns)
    q.swaiting = True
    q.napping = nap
    q.ticking = ns <= <long>(_HELPED_TICK_S * 1e9)
    pt.pthread_cond_timedwait(&q.scv, &q.mu, &ts)
    q.swaiting = False
    q.napping = False


cdef inline void _set_err(_Req* r, int err, int64_t off, uint64_t n) noexcept nogil:
    if r.err == 0 and not r.eof:
        r.err = err
        r.err_offset = off
        r.err_nbytes = n
    r.stop = True


cdef inline void _link(_Q* q, _Req* r) noexcept nogil:
    """Append ``r`` to the pending list (q.mu held)."""
    r.prev = q.pend_tail
    if q.pend_tail != NULL:
        q.pend_tail.next = r
    else:
        q.pend_head = r
    q.pend_tail = r


cdef void _unlink(_Q* q, _Req* r) noexcept nogil:
    if not r.queued:
        return
    if r.prev != NULL:
        r.prev.next = r.next
    else:
        q.pend_head = r.next
    if r.next != NULL:
        r.next.prev = r.prev
    else:
        q.pend_tail = r.prev
    r.prev = NULL
    r.next = NULL
    r.queued = False


cdef void _fixup(_Slot* sl) noexcept nogil:
    """An edge block past the end of the file was written whole: cut the padding off.

    Runs while the block is still locked. The file keeps every byte that existed (what the
    block's read returned), the request's bytes, and room for every write in flight on the
    file (their ends are in ``logical_end``), so no concurrent writer loses data.
    """
    cdef stat_lite st
    cdef _Req* r = sl.req
    cdef int64_t end = sl.foff + <int64_t>(sl.skip + sl.ulen)
    cdef int e = 0
    if sl.foff + <int64_t>sl.rgot > end:
        end = sl.foff + <int64_t>sl.rgot
    pt.pthread_mutex_lock(&_edge_mu)
    if r.file.logical_end > end:
        end = r.file.logical_end
    if stat_lite_fd(r.fd, &st) != 0:
        e = errno
    elif st.size > end:
        if ftruncate(r.fd, end) != 0:
            e = errno
    pt.pthread_mutex_unlock(&_edge_mu)
    if e:
        sl.err = e


cdef extern from "<fcntl.h>" nogil:
    int _fallocate "fallocate"(int fd, int mode, int64_t offset, int64_t length)


cdef void _grow(int fd, _FileCore* c, int64_t offset, int64_t end, bint trust) noexcept nogil:
    """Before the pieces of a write of ``[offset, end)`` that ends past the end of the file go
    out: extend the file to ``end`` (``fallocate`` of the write's own range: it only grows the
    file, never cuts a concurrent writer's longer extension as ``ftruncate`` could, and
    allocates only the blocks the write fills, so a hole before ``offset`` stays a hole).

    ext4 and xfs run a direct write past the end of the file synchronously, one at a time,
    so the pieces of such a write did not overlap: one write of 1.69 GiB into a new file ran
    at 0.78-1.01 GB/s, and at 1.28-1.83 GB/s extended first (README, round 19). A file that
    refuses (not a regular file, no ``fallocate``) is left alone, and its writes extend it
    themselves; so does any error here (the write then reports its own).

    ``trust`` (a one-piece write of a burst): no size query when the file is known to reach
    ``end`` already. Another program may have cut the file short since; such writes then
    extend it themselves, as before. A write of several pieces always asks.
    """
    cdef stat_lite st
    cdef bint skip
    pt.pthread_mutex_lock(&_edge_mu)
    skip = c.no_grow or (trust and end <= c.known_size)
    pt.pthread_mutex_unlock(&_edge_mu)
    if skip:
        return
    if stat_lite_fd(fd, &st) != 0:
        return
    if not S_ISREG(st.mode):
        c.no_grow = True                # a block device: its size is not a file's to grow
        return
    if st.size < end:
        if _fallocate(fd, 0, offset, end - offset) != 0:
            if errno == EOPNOTSUPP or errno == ENOSYS:
                c.no_grow = True
            return
    else:
        end = st.size
    # what the file was just seen to be (a concurrent grow may have made it longer: a
    # length known too short costs one more query, never a missed grow)
    pt.pthread_mutex_lock(&_edge_mu)
    c.known_size = end
    pt.pthread_mutex_unlock(&_edge_mu)


cdef void _maybe_finish(_Q* q, _Req* r) noexcept nogil:
    """q.mu held: finish ``r`` when nothing of it is in flight and nothing is left to cut."""
    if r.inflight > 0 or r.finished:
        return
    if not r.stop and r.stage < ST_FSYNC:
        return
    if not r.stop and r.stage == ST_FSYNC and r.fsync:
        return                              # its fsync piece is cut next
    _unlink(q, r)
    r.finished = True
    if r.counted_write:
        pt.pthread_mutex_lock(&_edge_mu)
        r.file.active_writes -= 1
        pt.pthread_mutex_unlock(&_edge_mu)
        r.counted_write = False
    if not r.sync:
        q.nasync -= 1
        r.done_next = NULL
        if q.done_tail != NULL:
            q.done_tail.done_next = r
        else:
            q.done_head = r
            q.done_since = _mono()
        q.done_tail = r
        q.ndone += 1
    _wake(q)


cdef int _cut_one(_Q* q, _Req* r) noexcept nogil:
    """q.mu held: cut the next piece of ``r`` into a free slot; its index, or -1."""
    cdef bint write = r.opcode == abi.IOCB_CMD_PWRITE
    cdef int kind, s, b = -1, lk = -1, nstage
    cdef uint64_t uaddr = 0, ulen = 0, skip = 0, span = 0, n
    cdef int64_t foff = 0
    cdef _Slot* sl
    if q.nfree == 0 or q.kin >= q.depth or r.stop:
        return -1
    while True:
        if r.stage == ST_HEAD:
            if r.head_end == 0:
                r.stage = ST_MIDDLE
                continue
            skip = <uint64_t>r.offset % r.align
            foff = r.offset - <int64_t>skip
            span = r.align
            uaddr = r.addr
            ulen = r.head_end
            kind = K_RMW_READ if write else K_BREAD
            nstage = ST_MIDDLE
            break
        elif r.stage == ST_MIDDLE:
            if r.pos < r.head_end:
                r.pos = r.head_end
            if r.pos >= r.tail_start:
                r.stage = ST_TAIL
                continue
            n = r.tail_start - r.pos
            if r.mode == M_BOUNCE:
                if n > r.bblock:
                    n = r.bblock
                kind = K_BWRITE if write else K_BREAD
            else:
                if n > r.block:
                    n = r.block
                kind = K_DIRECT
            foff = r.offset + <int64_t>r.pos
            uaddr = r.addr + r.pos
            ulen = n
            span = n
            skip = 0
            nstage = ST_MIDDLE
            break
        elif r.stage == ST_TAIL:
            if r.tail_start >= r.nbytes:
                r.stage = ST_FSYNC
                continue
            foff = r.offset + <int64_t>r.tail_start
            span = r.align
            uaddr = r.addr + r.tail_start
            ulen = r.nbytes - r.tail_start
            skip = 0
            kind = K_RMW_READ if write else K_BREAD
            nstage = ST_FSYNC
            break
        elif r.stage == ST_FSYNC:
            if not r.fsync:
                r.stage = ST_DONE
                continue
            if r.inflight > 0:
                return -1
            kind = K_FSYNC
            nstage = ST_DONE
            break
        else:
            return -1
    if kind == K_BREAD or kind == K_BWRITE or kind == K_RMW_READ:
        if q.nfreebuf == 0:
            return -1
        if kind == K_RMW_READ:
            lk = _edge_take(<void*>r.file, foff)
            if lk < 0:
                q.edge_blocked = True
                return -1
        q.nfreebuf -= 1
        b = q.free_bufs[q.nfreebuf]
    q.nfree -= 1
    q.kin += 1
    s = q.free_slots[q.nfree]
    sl = &q.slots[s]
    memset(sl, 0, sizeof(_Slot))
    sl.req = r
    sl.kind = kind
    sl.buf = b
    sl.lock = lk
    sl.fresh = True
    sl.uaddr = uaddr
    sl.ulen = ulen
    sl.skip = skip
    sl.span = span
    sl.foff = foff
    sl.cb.aio_data = <uint64_t>s
    sl.cb.aio_fildes = <uint32_t>r.fd
    if kind == K_FSYNC:
        sl.cb.aio_lio_opcode = abi.IOCB_CMD_FSYNC
    else:
        if q.uring != NULL and r.file != NULL and r.file.inline:
            sl.cb.aio_flags = ur.URING_IOCB_INLINE
        sl.cb.aio_lio_opcode = abi.IOCB_CMD_PREAD if kind == K_RMW_READ else r.opcode
        sl.cb.aio_buf = uaddr if b < 0 else <uint64_t>(q.ring + <uint64_t>b * q.bufsize)
        sl.cb.aio_nbytes = span
        sl.cb.aio_offset = foff
    r.inflight += 1
    q.inflight += 1
    if kind == K_DIRECT or kind == K_BWRITE or (kind == K_BREAD and r.stage == ST_MIDDLE):
        r.pos += ulen
    else:
        r.stage = nstage
    return s


cdef int _cut(_Q* q, int* out, int maxn) noexcept nogil:
    """q.mu held: cut pieces of pending requests into free slots; how many."""
    cdef int n = 0, k, scanned = 0
    cdef _Req* r = q.pend_head
    cdef _Req* nxt
    if not q.overlap and q.kin > 0:
        return 0
    q.edge_blocked = False
    while (r != NULL and n < maxn and q.nfree > 0 and q.kin < q.depth
           and scanned < _BATCH):
        k = _cut_one(q, r)
        if k >= 0:
            out[n] = k
            n += 1
            continue
        nxt = r.next
        if r.stop or r.stage == ST_DONE:
            _unlink(q, r)
            _maybe_finish(q, r)
        else:
            scanned += 1
        r = nxt
    return n


cdef void _account(_Q* q, int s) noexcept nogil:
    """q.mu held: a piece is over; give back its slot, buffer and edge lock."""
    cdef _Slot* sl = &q.slots[s]
    cdef _Req* r = sl.req
    if sl.pads and not sl.err and r.file != NULL:
        _fixup(sl)
    if sl.err:
        _set_err(r, sl.err, <int64_t>sl.cb.aio_offset, sl.cb.aio_nbytes)
    elif sl.eof:
        if r.err == 0 and not r.eof:
            r.eof = True
            r.err_offset = sl.foff
            r.err_nbytes = sl.span
        r.stop = True
    elif sl.kind != K_FSYNC:
        r.done += sl.ulen
    if sl.buf >= 0:
        q.free_bufs[q.nfreebuf] = sl.buf
        q.nfreebuf += 1
    if sl.lock >= 0:
        _edge_give(sl.lock)
    sl.req = NULL
    q.free_slots[q.nfree] = s
    q.nfree += 1
    q.inflight -= 1
    r.inflight -= 1
    if r.inflight == 0:
        _maybe_finish(q, r)


cdef bint _complete(_Q* q, int s, int64_t res) noexcept nogil:
    """Reaper, without q.mu: look at one completion. True when the piece goes again."""
    cdef _Slot* sl = &q.slots[s]
    cdef _Req* r = sl.req
    cdef uint64_t got, need
    cdef char* buf = NULL
    if sl.buf >= 0:
        buf = q.ring + <uint64_t>sl.buf * q.bufsize
    if res < 0:
        sl.err = <int>-res
        return False
    if sl.kind == K_FSYNC:
        return False
    got = sl.got + <uint64_t>res
    if sl.kind == K_RMW_READ:
        if got < sl.span and res > 0 and got % r.align == 0:
            _again(sl, res)
            return True
        sl.rgot = got
        if got < sl.span:                   # the block runs past the end of the file
            memset(buf + got, 0, sl.span - got)
            sl.pads = True
        memcpy(buf + sl.skip, <void*>sl.uaddr, sl.ulen)
        sl.kind = K_RMW_WRITE
        sl.got = 0
        sl.cb.aio_lio_opcode = abi.IOCB_CMD_PWRITE
        sl.cb.aio_buf = <uint64_t>buf
        sl.cb.aio_nbytes = sl.span
        sl.cb.aio_offset = sl.foff
        return True
    if sl.kind == K_BREAD:
        need = sl.skip + sl.ulen
        if got < need:
            if res == 0 or got % r.align != 0:
                sl.eof = True
                return False
            _again(sl, res)
            return True
        sl.err = _copy_out(<void*>sl.uaddr, buf + sl.skip, sl.ulen)
        return False
    # K_DIRECT, K_BWRITE, K_RMW_WRITE: all of span must move
    if got < sl.span:
        if res == 0:
            if r.opcode == abi.IOCB_CMD_PWRITE:
                sl.err = EIO                # a write that moves nothing would loop forever
            else:
                sl.eof = True
            return False
        if r.opcode == abi.IOCB_CMD_PREAD and r.align > 1 and got % r.align != 0:
            sl.eof = True                   # O_DIRECT reads come back unaligned only at EOF
            return False
        _again(sl, res)
        return True
    return False


cdef inline void _again(_Slot* sl, int64_t res) noexcept nogil:
    """Resubmit the rest of a short transfer."""
    sl.got += <uint64_t>res
    sl.cb.aio_buf += <uint64_t>res
    sl.cb.aio_nbytes -= <uint64_t>res
    sl.cb.aio_offset += res


# ---- the backend seam: the queue reaches the kernel only through these four

cdef inline long _k_submit(_Q* q, long n, abi.iocb** cbs) noexcept nogil:
    """io_submit: how many pieces were taken, or -1 with errno."""
    if q.uring != NULL:
        return ur.uring_submit(q.uring, n, cbs)
    if q.threads != NULL:
        return kt.kthreads_submit(q.threads, n, cbs)
    return abi.syscall(abi.SYS_io_submit, q.ctx, n, cbs)


cdef inline long _k_getevents(_Q* q, long min_nr, long nr, abi.io_event* events,
                              timespec* ts) noexcept nogil:
    """io_getevents with a relative timeout: how many events, or -1 with errno."""
    if q.uring != NULL:
        return ur.uring_getevents(q.uring, min_nr, nr, events, ts)
    if q.threads != NULL:
        return kt.kthreads_getevents(q.threads, min_nr, nr, events, ts)
    return abi.syscall(abi.SYS_io_getevents, q.ctx, min_nr, nr, events, ts)


cdef inline void _k_destroy(_Q* q) noexcept nogil:
    """io_destroy: returns once nothing of the queue's is in flight. Idempotent."""
    cdef kt.kthreads* k = q.threads
    cdef ur.uring* u = q.uring
    if u != NULL:
        q.uring = NULL
        ur.uring_destroy(u)
    if k != NULL:
        q.threads = NULL
        kt.kthreads_destroy(k)
    if q.ctx:
        abi.syscall(abi.SYS_io_destroy, q.ctx)
        q.ctx = 0


cdef void _k_forget(_Q* q) noexcept:
    """In a forked child: let go of the parent's ring without touching it (no submission,
    no reaping: the I/O in flight is the parent's)."""
    cdef ur.uring* u = q.uring
    if u != NULL:
        q.uring = NULL
        ur.uring_forget(u)


# The IORING_SETUP_* flags the io_uring backend tries (AioQueue.uring_flags holds those taken).
URING_SETUP_FLAGS = {"CQSIZE": ur.IORING_SETUP_CQSIZE, "SUBMIT_ALL": ur.IORING_SETUP_SUBMIT_ALL}


# Backends a queue can run on. "auto" is io_uring, else kernel AIO where io_uring_setup is
# refused (kernel.io_uring_disabled, a container's seccomp profile), else worker threads where
# io_setup is refused too (aio-max-nr exhausted, seccomp).
BACKENDS = ("auto", "io_uring", "aio", "threads")
cdef int _THREADS_MAX = 16          # worker threads of one queue (at most its depth)


cdef void _launch(_Q* q, int* slots, int n) noexcept nogil:
    """Without q.mu: fill fresh bounce writes, then io_submit the pieces."""
    cdef abi.iocb* ptrs[_BATCH]
    cdef int i = 0, j, k, cnt, e, base = 0
    cdef long ret
    cdef _Slot* sl
    while base < n:
        cnt = n - base
        if cnt > _BATCH:
            cnt = _BATCH
        for j in range(cnt):
            sl = &q.slots[slots[base + j]]
            if sl.fresh and sl.kind == K_BWRITE:
                if j > 0:               # what is ready goes first: the copy takes a while
                    cnt = j
                    break
                memcpy(q.ring + <uint64_t>sl.buf * q.bufsize, <void*>sl.uaddr, sl.ulen)
                sl.fresh = False
                ptrs[j] = &sl.cb
                cnt = 1
                break
            sl.fresh = False
            ptrs[j] = &sl.cb
        i = 0
        while i < cnt:
            k = 1 if q.single_submit else cnt - i
            ret = _k_submit(q, <long>k, &ptrs[i])
            if ret > 0:
                i += <int>ret
                continue
            e = errno if ret < 0 else EAGAIN
            if e == EAGAIN or e == EINTR:
                # the kernel queue (or the system's aio-nr) is full: the reaper resubmits
                pt.pthread_mutex_lock(&q.mu)
                for j in range(i, cnt):
                    q.retry[q.nretry] = <int>ptrs[j].aio_data
                    q.nretry += 1
                for j in range(base + cnt, n):
                    q.retry[q.nretry] = slots[j]
                    q.nretry += 1
                _wake(q)
                pt.pthread_mutex_unlock(&q.mu)
                return
            pt.pthread_mutex_lock(&q.mu)
            q.slots[<int>ptrs[i].aio_data].err = e
            q.kin -= 1
            _account(q, <int>ptrs[i].aio_data)
            pt.pthread_mutex_unlock(&q.mu)
            i += 1
        base += cnt


cdef void _feed(_Q* q) noexcept nogil:
    """Without q.mu: cut and submit everything that can go now."""
    cdef int prep[_BATCH]
    cdef int n
    while True:
        pt.pthread_mutex_lock(&q.mu)
        n = _cut(q, prep, _BATCH)
        pt.pthread_mutex_unlock(&q.mu)
        if n == 0:
            return
        _launch(q, prep, n)
        if n < _BATCH:
            return


cdef int _q_reap(_Q* q, long timeout_ns) noexcept nogil:
    """Holder of the reaping role, without q.mu: one round of resubmit, wait, account, cut.

    Returns 0, or an errno when io_getevents itself failed (the queue is broken then).
    """
    cdef timespec ts
    cdef long ret, k, min_nr
    cdef int n = 0, s, nretry, i, submitted, nfin, nacc
    cdef int* launch = q.rscratch
    pt.pthread_mutex_lock(&q.mu)
    nretry = q.nretry
    for i in range(nretry):
        launch[i] = q.retry[i]
    q.nretry = 0
    n = nretry + _cut(q, launch + nretry, q.nslots - nretry)
    pt.pthread_mutex_unlock(&q.mu)
    if n:
        _launch(q, launch, n)
    pt.pthread_mutex_lock(&q.mu)
    submitted = q.kin - q.nretry
    if submitted <= 0:
        if q.edge_blocked or q.nretry:
            _timedwait(q, _EDGE_POLL_NS)
        pt.pthread_mutex_unlock(&q.mu)
        return 0
    min_nr = 1 if q.overlap else submitted
    pt.pthread_mutex_unlock(&q.mu)
    ts.tv_sec = timeout_ns // 1000000000
    ts.tv_nsec = timeout_ns % 1000000000
    ret = _k_getevents(q, min_nr, <long>q.depth, q.events, &ts)
    if ret < 0:
        if errno == EINTR:
            return 0
        return errno
    # First what needs no copy: account it and refill at once, so the drive gets new work
    # before this thread spends time copying; then each bounced read is copied out and its
    # buffer refilled right away, one at a time.
    n = 0
    nfin = 0
    nacc = 0
    for k in range(ret):
        s = <int>q.events[k].data
        if _copies_out(q, s, <int64_t>q.events[k].res):
            launch[q.nslots - 1 - nfin] = s         # later, from the back
            nfin += 1
        elif _complete(q, s, <int64_t>q.events[k].res):
            launch[n] = s                           # goes again (short or read-modify-write)
            n += 1
        else:
            launch[ret + nacc] = s                  # finished (n + nacc + nfin == ret, and
            nacc += 1                               # nslots >= 2 * ret: no overlap)
    pt.pthread_mutex_lock(&q.mu)
    for k in range(nacc):                           # one lock for the finished: their
        _account(q, launch[ret + k])                # slots are free from here
    q.kin -= <int>ret - n                           # those going again stay in the kernel
    n += _cut(q, launch + n, q.nslots - n - nfin)
    pt.pthread_mutex_unlock(&q.mu)
    if n:
        _launch(q, launch, n)
    for k in range(nfin):
        s = launch[q.nslots - 1 - k]
        n = 0
        if _complete(q, s, q.slots[s].parked):
            pt.pthread_mutex_lock(&q.mu)
            q.kin += 1
            pt.pthread_mutex_unlock(&q.mu)
            launch[0] = s
            n = 1
        else:
            pt.pthread_mutex_lock(&q.mu)
            _account(q, s)
            n = _cut(q, launch, q.nslots - nfin)
            pt.pthread_mutex_unlock(&q.mu)
        if n:
            _launch(q, launch, n)
    return 0


cdef inline bint _copies_out(_Q* q, int s, int64_t res) noexcept nogil:
    """Whether this completion copies into the caller's memory (a bounced or edge read);
    its result is parked in the slot until then."""
    cdef _Slot* sl = &q.slots[s]
    if sl.kind == K_BREAD and res > 0:
        sl.parked = res
        return True
    return False


cdef bint _has_work(_Q* q) noexcept nogil:
    return q.inflight > 0 or q.pend_head != NULL or q.nretry > 0


cdef void _break(_Q* q, int e) noexcept nogil:
    """q.mu held: io_getevents failed, so completions can no longer be told apart.

    io_destroy waits for every iocb the kernel holds, so after it no memory of any request
    is written; then every request fails with ``e``.
    """
    cdef int s
    cdef _Req* r
    cdef _Req* nxt
    if q.broken:
        return
    q.broken = e
    _k_destroy(q)
    q.nretry = 0
    q.kin = 0
    for s in range(q.nslots):
        if q.slots[s].req != NULL:
            q.slots[s].err = e
            _account(q, s)
    r = q.pend_head
    while r != NULL:
        nxt = r.next
        _set_err(r, e, r.offset, r.nbytes)
        _maybe_finish(q, r)
        r = nxt


cdef void _reap_round(_Q* q, long ns) noexcept nogil:
    """q.mu held (and held again on return), the reaping role free: take it for one round
    of _q_reap (waiting at most ``ns`` in the kernel), give it back and wake the others."""
    cdef int e
    q.reaping = True
    pt.pthread_mutex_unlock(&q.mu)
    e = _q_reap(q, ns)
    pt.pthread_mutex_lock(&q.mu)
    q.reaping = False
    if e:
        _break(q, e)
    _wake(q)


cdef inline bint _starved(_Q* q) noexcept nogil:
    # requests wait for room in a full kernel queue, or pieces for the kernel to take them
    # again (EAGAIN): only a reap round sends them (read without q.mu: a hint)
    return q.nretry > 0 or (q.pend_head != NULL and q.inflight >= q.depth)


cdef int _wait_req(_Q* q, _Req* r, double budget) noexcept nogil:
    """Drive or wait until ``r`` is finished: 0, or 1 when ``budget`` seconds passed."""
    cdef double deadline = _mono() + budget
    pt.pthread_mutex_lock(&q.mu)
    while not r.finished:
        if q.broken:
            r.finished = True               # nothing will ever complete it
            _set_err(r, q.broken, r.offset, r.nbytes)
            _unlink(q, r)
            break
        if not q.reaping and _has_work(q):
            _reap_round(q, _TICK_NS)
        else:
            _timedwait(q, _TICK_NS)
        if not r.finished and _mono() > deadline:
            pt.pthread_mutex_unlock(&q.mu)
            return 1
    pt.pthread_mutex_unlock(&q.mu)
    return 0


# Finished asynchronous requests are handed to Python (which needs the GIL) in batches:
# when the queue goes idle, when half a queue's worth is waiting, or after this long. The
# submitting thread then keeps the GIL while it queues a burst, instead of trading it with
# the completion thread after every request.
cdef double _COALESCE_S = 0.001
# An idle queue hands its finished requests over at once, unless an asynchronous request was
# queued less than this long ago: a thread queueing a burst comes back within microseconds,
# and taking the GIL between its requests would slow it down (a lone request waits at most
# this long past its completion).
cdef double _BURST_GAP_S = 0.00003


cdef int _serve(_Q* q, _Req** out) noexcept nogil:
    """The completion thread: reap while asynchronous work is in flight; return finished
    asynchronous requests (linked through done_next), or -1 once closing and idle."""
    cdef double wait_s
    cdef long ns
    cdef double now, quiet
    pt.pthread_mutex_lock(&q.mu)
    while True:
        wait_s = 0.1
        if q.done_head != NULL:
            now = _mono()
            wait_s = q.done_since + _COALESCE_S - now
            quiet = q.last_async + _BURST_GAP_S - now     # > 0: a burst may go on
            if q.helpers and not q.closing and not q.broken:
                wait_s = 0.1                # a waiting thread delivers them (and wakes this
                                            # one when it leaves)
            elif (wait_s <= 0 or q.eager or (quiet <= 0 and not _has_work(q)) or q.closing
                    or q.broken or q.ndone >= q.depth):
                q.helped = False            # nobody waited for these: wake for the next
                out[0] = q.done_head
                q.done_head = NULL
                q.done_tail = NULL
                q.ndone = 0
                pt.pthread_mutex_unlock(&q.mu)
                return 1
            elif quiet < wait_s and not _has_work(q):
                wait_s = quiet
        elif q.closing and not _has_work(q):
            pt.pthread_mutex_unlock(&q.mu)
            return -1
        ns = <long>(wait_s * 1e9)
        if ns < 20000:
            ns = 20000
        if not q.reaping and q.nasync > 0 and not q.broken and not q.helpers:
            if not q.eager and not q.closing:
                quiet = q.last_async + _BURST_GAP_S - _mono()
                if quiet > 0:
                    # its caller is still queueing a burst (and submitting it): it may wait
                    # for it next and reap it itself, so stand by until the burst is over
                    # (a tick, when its callers are known to do that). While the kernel
                    # queue is full and requests wait for room, the caller reaps as it
                    # queues (AioQueue._submit): two reapers only fought over the role
                    ns = <long>((_HELPED_TICK_S if q.helped else quiet) * 1e9)
                    if ns < 5000:
                        ns = 5000
                    _swait(q, ns, True)
                    continue
            _reap_round(q, ns)
            continue
        if q.helped:
            if (not q.helpers and q.nasync == 0 and q.done_head == NULL
                    and _mono() - q.last_async > _HELPED_IDLE_S):
                q.helped = False            # idle: the next request wakes this thread
            elif ns > <long>(_HELPED_TICK_S * 1e9):
                ns = <long>(_HELPED_TICK_S * 1e9)
        _swait(q, ns, False)


cdef int _help(_Q* q, _Req** out, double budget) noexcept nogil:
    """A thread blocked on asynchronous results of this queue does the completion thread's
    work for at most ``budget`` seconds: reap when nobody else is, and take the finished
    asynchronous requests (linked through done_next) for its caller to deliver. 1 with a
    list, 0 when the budget ran out first, -1 when the queue has no asynchronous request
    left to wait for (the completion thread may still be delivering some)."""
    cdef double deadline = _mono() + budget
    cdef double left
    cdef long ns
    cdef int rc
    pt.pthread_mutex_lock(&q.mu)
    q.helpers += 1
    q.helped = True
    while True:
        if q.done_head != NULL:
            out[0] = q.done_head
            q.done_head = NULL
            q.done_tail = NULL
            q.ndone = 0
            rc = 1
            break
        if q.nasync == 0:
            rc = -1
            break
        left = deadline - _mono()
        if left <= 0:
            rc = 0
            break
        ns = <long>(left * 1e9)
        if ns > _TICK_NS:
            ns = _TICK_NS
        if ns < 20000:
            ns = 20000
        if not q.reaping and not q.broken:
            _reap_round(q, ns)
        else:
            _timedwait(q, ns)
    q.helpers -= 1
    _wake(q)                                # the completion thread takes over again, if it
    pt.pthread_mutex_unlock(&q.mu)          # has anything to do
    return rc


cdef list _done_list(_Req* head):
    # the finished requests linked from ``head``, seen (their results are final)
    cdef _Req* r = head
    cdef _Req* nxt
    cdef Request req
    out = []
    while r != NULL:
        nxt = r.done_next
        req = <Request>r.obj
        out.append(req)
        req._seen()
        r = nxt
    return out


cdef class FileState:
    """What every request on one file (inode) of this process shares.

    Edge blocks of writes are locked per ``FileState``, and the largest end of the writes in
    flight lives here, so that cutting a padded edge block back never cuts a concurrent
    write. Make one per inode (the handle keeps a process-wide map).
    """
    cdef _FileCore core
    cdef object __weakref__

    def __cinit__(self):
        self.core.logical_end = 0
        self.core.active_writes = 0
        self.core.known_size = 0
        self.core.no_grow = False
        self.core.inline = False

    @property
    def known_size(self):
        """A length the file is known to have (0: none): one-piece writes that end below it
        do not ask the file its size first (see :meth:`forget_size`)."""
        return self.core.known_size

    def forget_size(self):
        """The file may have been cut short (opened with ``O_TRUNC``, truncated): the next
        write past what was :attr:`known_size` extends it first again."""
        pt.pthread_mutex_lock(&_edge_mu)
        self.core.known_size = 0
        pt.pthread_mutex_unlock(&_edge_mu)

    @property
    def active_writes(self):
        return self.core.active_writes

    @property
    def inline(self):
        """Whether the file is on tmpfs (set by :meth:`probe`): the io_uring backend then
        runs its reads and writes in the submitting thread, as kernel AIO does, instead of
        letting io_uring hand each one to a kernel worker thread (it cannot start I/O on
        tmpfs without blocking): 4 KiB bursts of 32 on /dev/shm cost 21 us of CPU per
        request that way."""
        return self.core.inline

    def probe(self, int fd):
        """Look at the file system of ``fd`` (``fstatfs``); errors leave it as it was."""
        cdef _statfs_t sf
        if _fstatfs(fd, &sf) == 0:
            self.core.inline = sf.f_type == _TMPFS_MAGIC


# Not tracked by the cyclic garbage collector: nothing a request holds (its queue, token,
# name, buffer owner, file state) refers back to it (requests are never handed to users), so
# it can be in no cycle; a burst of a thousand requests in flight then no longer pushes the
# collector towards full collections (~55 ms each with torch loaded).
@cython.no_gc
cdef class Request:
    """One request from :meth:`AioQueue.submit` to its result: the engine's only handle on it.

    It owns the request's C state, and the queue holds it (with its ``owner``, ``file`` and
    ``token``) alive until the request is finished and seen (by :meth:`wait`, :meth:`drain`
    or :meth:`AioQueue.serve`), so no memory it names is freed while the kernel may touch
    it. :meth:`wait`, :meth:`drain` and :meth:`cancel` may be called any number of times,
    from any thread, before or after the request finished.
    """
    cdef _Req* r
    cdef readonly AioQueue queue
    cdef readonly object token
    cdef readonly object name
    cdef object owner
    cdef FileState file
    cdef bint held              # the queue's reference, dropped once seen finished
    cdef bint seen

    def __dealloc__(self):
        # only reachable once the queue let go: finished (or never queued)
        if self.r != NULL:
            PyMem_RawFree(self.r)
            self.r = NULL

    cdef inline void _seen(self) noexcept:
        """With the GIL, once ``r.finished`` was observed: drop the queue's reference."""
        self.seen = True
        if self.held:
            self.held = False
            self.owner = None
            Py_DECREF(self)

    @property
    def finished(self):
        return self.seen

    @property
    def done(self):
        """Bytes moved (of a finished request)."""
        return self.r.done

    @property
    def nbytes(self):
        return self.r.nbytes

    @property
    def offset(self):
        return self.r.offset

    @property
    def write(self):
        return self.r.opcode == abi.IOCB_CMD_PWRITE

    @property
    def errno(self):
        """The first errno of a finished request (0: none)."""
        return self.r.err

    @property
    def eof(self):
        """Whether a read reached the end of the file."""
        return bool(self.r.eof and not self.r.err)

    @property
    def failed_at(self):
        """``(file offset, bytes)`` of the piece that failed or met the end of the file."""
        return (self.r.err_offset, self.r.err_nbytes)

    def error(self):
        """The exception of a finished request that failed (see :func:`failure`), or None."""
        r = self.r
        if not self.seen or not (r.err or r.eof):
            return None
        return failure(self.name, r.opcode == abi.IOCB_CMD_PWRITE, r.offset, r.nbytes,
                       r.done, r.err, r.err_offset, r.err_nbytes)

    def cancel(self):
        """Cut nothing more of the request; what is in flight still completes."""
        if self.seen:
            return
        q = &self.queue.q
        r = self.r
        with nogil:
            pt.pthread_mutex_lock(&q.mu)
            if not r.finished:
                r.stop = True
                if r.inflight == 0:
                    _unlink(q, r)
                    _maybe_finish(q, r)
            pt.pthread_mutex_unlock(&q.mu)

    def wait(self, bint check=True):
        """Finish the request (driving the queue): its bytes, or (``check``) its error raised.

        Python signal handlers run every 10 ms; when one raises, the request is cancelled,
        its pieces in flight are drained (nothing writes its memory afterwards), and the
        exception propagates.
        """
        cdef int rc
        if not self.r.sync and not self.seen:
            raise RuntimeError("an asynchronous request finishes in AioQueue.serve()")
        while not self.seen:
            with nogil:
                rc = _wait_req(&self.queue.q, self.r, 0.01)
            if rc == 0:
                self._seen()
                break
            try:
                PyErr_CheckSignals()
            except BaseException:
                self.cancel()
                self.drain(False)
                raise
        if check:
            exc = self.error()
            if exc is not None:
                raise exc
        return self.r.done

    def drain(self, bint check=True):
        """Wait for the request without looking at signals: its bytes, or (``check``) its
        error raised."""
        if not self.r.sync and not self.seen:
            raise RuntimeError("an asynchronous request finishes in AioQueue.serve()")
        if not self.seen:
            with nogil:
                while _wait_req(&self.queue.q, self.r, 1.0) != 0:
                    pass
            self._seen()
        if check:
            exc = self.error()
            if exc is not None:
                raise exc
        return self.r.done

    def __repr__(self):
        op = "write" if self.r.opcode == abi.IOCB_CMD_PWRITE else "read"
        state = "finished" if self.seen else "pending"
        return (f"<aioswap._aio.Request {op} of {self.r.nbytes} bytes at {self.r.offset} "
                f"of {self.name!r} {state}>")


def failure(name, bint write, int64_t offset, uint64_t nbytes, uint64_t done, int err,
            int64_t err_offset, uint64_t err_nbytes):
    """The engine's one errno -> exception checker for a request's result.

    ``err`` (an errno) gives ``OSError(err, ...)`` (Python picks the subclass) naming the
    file, the failed piece's offset and size and how much of the request was done, with
    those as attributes (``offset``, ``nbytes``: the piece; ``done``); ``err == 0`` means a
    read met the end of the file: :class:`~aioswap.errors.ShortReadError` (``offset``,
    ``nbytes``: the request; ``done``; ``eof_offset``: where the end was met).
    """
    op = "write" if write else "read"
    if err:
        exc = OSError(err, f"{os.strerror(err)} ({op} of {err_nbytes} bytes at file offset "
                           f"{err_offset}; {done} of {nbytes} bytes done)", name)
        exc.offset = err_offset
        exc.nbytes = err_nbytes
    else:
        exc = ShortReadError(
            f"read of {nbytes} bytes at offset {offset} from {name} reached end of file at "
            f"offset {err_offset} ({done} bytes read)", path=name, offset=offset,
            nbytes=nbytes)
        exc.eof_offset = err_offset
        exc.eof_nbytes = err_nbytes
    exc.done = done
    return exc


cdef class AioQueue:
    """One kernel queue (an io_uring, an AIO context, or worker threads) shared by every
    request of a handle lane.

    Parameters
    ----------
    depth : int
        Most pieces in flight at once, across all requests (1..65535; io_uring: ..32768).
    single_submit : bool
        One piece per submission call.
    overlap_events : bool
        Sliding window (True) or submit a batch and reap it whole (False).
    backend : {"auto", "io_uring", "aio", "threads"}
        "auto": io_uring, else kernel AIO, else worker threads (``why`` says why); a named
        backend that the kernel refuses raises ``OSError``.

    Notes
    -----
    ``submit`` links a request into the queue and submits what can go at once;
    :meth:`Request.wait` (sync callers) drives the queue until that request is finished; ``serve`` (one
    completion thread) reaps while asynchronous requests are in flight and returns the
    finished ones. The memory of a request must stay valid until it is finished: ``wait``
    returns or raises only after the kernel is done with every piece of it, also when a
    signal handler raises.
    """
    cdef _Q q
    cdef bint _ready
    cdef int _busy                  # calls inside the queue with the GIL released (see _in)
    cdef str _backend
    cdef object _ring_owner
    cdef long _pid
    cdef object __weakref__
    cdef readonly str why
    cdef readonly unsigned uring_flags
    cdef readonly str ring_note

    def __cinit__(self):
        memset(&self.q, 0, sizeof(_Q))
        self._ready = False
        self._ring_owner = None
        self._backend = "aio"

    def __init__(self, int depth, *, bint single_submit=False, bint overlap_events=True,
                 str backend="auto"):
        cdef long ret
        cdef int e = 0
        cdef abi.aio_context_t ctx = 0
        cdef kt.kthreads* threads = NULL
        cdef ur.uring* uring = NULL
        cdef unsigned flags = 0
        cdef int nthreads
        cdef pt.pthread_condattr_t attr
        cdef int i, nslots
        if self._ready:
            raise RuntimeError("AioQueue is already initialised")
        if depth < 1 or depth > MAX_DEPTH:
            raise ValueError(f"queue depth must be in 1..{MAX_DEPTH}, got {depth}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {', '.join(BACKENDS)}, got {backend!r}")
        q = &self.q
        nslots = 2 * depth
        q.slots = <_Slot*>PyMem_RawMalloc(nslots * sizeof(_Slot))
        q.free_slots = <int*>PyMem_RawMalloc(nslots * sizeof(int))
        q.retry = <int*>PyMem_RawMalloc(nslots * sizeof(int))
        q.rscratch = <int*>PyMem_RawMalloc(nslots * sizeof(int))
        q.events = <abi.io_event*>PyMem_RawMalloc(depth * sizeof(abi.io_event))
        if not (q.slots and q.free_slots and q.retry and q.rscratch and q.events):
            self._free_arrays()
            raise MemoryError(f"cannot allocate an AIO queue of depth {depth}")
        memset(q.slots, 0, nslots * sizeof(_Slot))
        ret = -1
        why = []
        if backend == "io_uring" or backend == "auto":
            with nogil:
                ret = ur.uring_setup(&uring, depth, &flags)
                e = errno
            if ret < 0 and backend == "io_uring":
                self._free_arrays()
                _check(ret, e, f"io_uring_setup({depth})", None, _uring_hint(e, depth))
            if ret < 0:
                why.append(f"io_uring_setup failed: {os.strerror(e)}{_uring_hint(e, depth)}")
            else:
                self.uring_flags = flags
        if ret < 0 and (backend == "auto" or backend == "aio"):
            with nogil:
                ret = abi.syscall(abi.SYS_io_setup, <unsigned int>depth, &ctx)
                e = errno
            if ret < 0 and (backend == "aio" or e not in (EAGAIN, EPERM, ENOSYS)):
                self._free_arrays()
                _check(ret, e, f"io_setup({depth})", None, _aio_limits_hint(e))
            if ret < 0:
                why.append(f"io_setup failed: {os.strerror(e)}{_aio_limits_hint(e)}")
        if ret < 0:
            nthreads = depth if depth < _THREADS_MAX else _THREADS_MAX
            with nogil:
                ret = kt.kthreads_setup(&threads, depth, nthreads)
                e = errno
            if ret < 0:
                self._free_arrays()
                _check(ret, e, f"starting {nthreads} I/O threads", None, "")
        if backend != "auto":
            self.why = "asked for"
        elif why:
            self.why = "; ".join(why) + "; using " + (
                "kernel AIO" if ctx else "worker threads")
        else:
            self.why = ""
        self.ring_note = ""
        q.uring = uring
        q.threads = threads
        q.ctx = ctx
        q.depth = depth
        q.nslots = nslots
        for i in range(nslots):
            q.free_slots[i] = nslots - 1 - i
        q.nfree = nslots
        q.single_submit = single_submit
        q.overlap = overlap_events
        pt.pthread_mutex_init(&q.mu, NULL)
        pt.pthread_condattr_init(&attr)
        pt.pthread_condattr_setclock(&attr, CLOCK_MONOTONIC)
        pt.pthread_cond_init(&q.cv, &attr)
        pt.pthread_cond_init(&q.scv, &attr)
        pt.pthread_condattr_destroy(&attr)
        self._pid = getpid()
        self._backend = ("io_uring" if self.q.uring != NULL
                         else "threads" if self.q.threads != NULL else "aio")
        self._ready = True

    cdef void _free_arrays(self) noexcept:
        q = &self.q
        PyMem_RawFree(q.slots)
        PyMem_RawFree(q.free_slots)
        PyMem_RawFree(q.retry)
        PyMem_RawFree(q.rscratch)
        PyMem_RawFree(q.events)
        PyMem_RawFree(q.free_bufs)
        q.slots = NULL
        q.free_slots = NULL
        q.retry = NULL
        q.rscratch = NULL
        q.events = NULL
        q.free_bufs = NULL

    @property
    def backend(self):
        """``"io_uring"``, ``"aio"`` (kernel AIO) or ``"threads"`` (positional I/O on worker
        threads); ``why`` says why when "auto" did not get io_uring. Still answered after
        :meth:`close`."""
        return self._backend

    @property
    def fixed_ring(self):
        """Whether the bounce ring is registered with io_uring (``READ_FIXED``/``WRITE_FIXED``
        pieces); ``ring_note`` says why not when registration was refused."""
        return self.q.uring != NULL and self.q.nbuf > 0 and not self.ring_note

    cdef tuple _uring_counts(self):
        # (READ_FIXED/WRITE_FIXED pieces, registered buffers, SQEs that named a registered
        # file, registered files or -1 without a table); zeros and -1 off io_uring
        cdef long pieces = 0, sqes = 0
        cdef int buffers = 0, files = -1
        if self._ready and self.q.uring != NULL:
            ur.uring_counts(self.q.uring, &pieces, &buffers)
            ur.uring_file_counts(self.q.uring, &sqes, &files)
        return (pieces, buffers, sqes, files)

    @property
    def fixed_pieces(self):
        """Pieces that went to io_uring as ``READ_FIXED``/``WRITE_FIXED`` so far (0 on the
        other backends)."""
        return self._uring_counts()[0]

    @property
    def fixed_buffers(self):
        """Buffers registered with this queue's io_uring: the bounce ring and page-locked
        allocations (a piece of at most 1 GiB each)."""
        return self._uring_counts()[1]

    @property
    def fixed_file_sqes(self):
        """Reads and writes (and fsyncs) that named a registered file so far: files that
        aioswap opened, on io_uring (0 on the other backends)."""
        return self._uring_counts()[2]

    @property
    def fixed_files(self):
        """Files registered with this queue's io_uring now; -1 where the ring has no table of
        registered files (the kernel refused it, or another backend)."""
        return self._uring_counts()[3]

    cdef int _fix_at(self, uint64_t addr, uint64_t n) except -1:
        """io_uring: register the allocation of the page-locked registry that holds
        ``[addr, addr + n)`` with this queue's ring once it is reused: when the direct
        requests on it through this queue have moved more than its size. Its pieces then go
        READ_FIXED/WRITE_FIXED (the kernel pins its pages once, not per piece); memory read or
        written once (a state dict loaded into fresh tensors) is not registered, as that
        would pin the same pages once more, in one system call under the queue's mutex.
        Allocations of _FIX_MIN to _FIX_MAX bytes while the table has room; a refusal
        (ENOMEM under RLIMIT_MEMLOCK) is said once, and that memory keeps plain READ/WRITE.
        The memory (LockedMemory._unmap) unregisters itself from every ring before its pages
        go."""
        cdef LockedMemory m
        cdef int rc = -1, e = 0
        if ur.uring_covers(self.q.uring, addr, n) or _f_pinned is None:
            return 0
        rec = _rec_at(_f_pinned.registry, addr, n)
        if rec is None or rec.ref is None:
            return 0
        mem = rec.ref()
        if type(mem) is not LockedMemory:
            return 0
        m = <LockedMemory>mem
        if m._addr == NULL or not m._locked or m._mapped < _FIX_MIN or m._mapped > _FIX_MAX:
            return 0
        if m._rings is None:
            m._rings = []
        for use in m._rings:                # [weak reference to the queue, bytes moved]
            if (<list>use)[0]() is self:
                break
        else:
            m._rings.append([PyWeakref_NewRef(self, None), n])
            return 0
        moved = (<list>use)[1]
        if moved < 0:
            return 0                        # registered before, or refused
        moved += n
        (<list>use)[1] = moved if moved <= m._mapped else -1
        if moved <= m._mapped:
            return 0
        if not self._in():
            return 0
        try:
            with nogil:
                pt.pthread_mutex_lock(&self.q.mu)
                if self.q.uring != NULL:
                    rc = ur.uring_register_buffer(self.q.uring, m._addr, m._mapped)
                    e = errno
                pt.pthread_mutex_unlock(&self.q.mu)
        finally:
            self._out()
        if rc < 0 and e != ENOSPC and e != EBUSY and e != 0:
            _note_once(f"registering page-locked memory with io_uring failed: "
                       f"{os.strerror(e)}; plain READ/WRITE on it")
        return 0

    @property
    def depth(self):
        return self.q.depth

    @property
    def ring_buffers(self):
        """Ring buffers attached (0 until :meth:`attach_ring`)."""
        return self.q.nbuf

    @property
    def ring_buffer_bytes(self):
        return self.q.bufsize

    @property
    def inflight(self):
        """Pieces cut and not yet reaped."""
        return self.q.inflight

    @property
    def closed(self):
        return not self._ready

    def __repr__(self):
        if not self._ready:
            return "<aioswap._aio.AioQueue closed>"
        return (f"<aioswap._aio.AioQueue depth={self.q.depth} inflight={self.q.inflight} "
                f"ring={self.q.nbuf}x{self.q.bufsize}>")

    cdef _check(self):
        if not self._ready:
            raise HandleClosedError("I/O on a closed AioQueue")
        if self._pid != _self_pid:
            raise RuntimeError("this AioQueue was created in another process (before a "
                               "fork); create a new handle in the child")
        if self.q.broken:
            raise OSError(self.q.broken, f"the AIO queue is broken (io_getevents failed: "
                                         f"{os.strerror(self.q.broken)}); make a new handle")

    cdef inline bint _in(self):
        # Enter a call that releases the GIL while it uses the queue's C state: False when the
        # queue is closed. close() waits until every such call has left (_out), so it never
        # destroys the ring or the mutex under one. Both run with the GIL held, and nothing
        # between close()'s check of _ready and its wait can let another thread in.
        if not self._ready:
            return False
        self._busy += 1
        return True

    cdef inline void _out(self):
        self._busy -= 1

    def attach_ring(self, owner, size_t address, Py_ssize_t bufsize, int nbuf):
        """Give the queue ``nbuf`` bounce buffers of ``bufsize`` bytes at ``address``.

        ``owner`` (the memory) is kept alive as long as the queue. Once only. Safe against a
        concurrent :meth:`close`: that waits for this call, which then raises
        :class:`~aioswap.errors.HandleClosedError` (nothing attached).
        """
        cdef int i, rc = 0, e = 0
        cdef int* fb
        self._check()
        if self.q.nbuf:
            raise RuntimeError("the ring is already attached")
        if bufsize <= 0 or nbuf <= 0 or bufsize % 512 or address % 512:
            raise ValueError(f"bad ring: {nbuf} buffers of {bufsize} bytes at {address:#x}")
        if not self._in():
            raise HandleClosedError("I/O on a closed AioQueue")
        try:
            if self.q.uring != NULL:
                # pieces through the ring then skip the kernel's per-request page pinning
                with nogil:
                    rc = ur.uring_register_buffer(self.q.uring, <void*>address,
                                                  <size_t>bufsize * <size_t>nbuf)
                    e = errno
        finally:
            self._out()
        if rc < 0:
            self.ring_note = (f"registering the bounce ring with io_uring failed: "
                              f"{os.strerror(e)}; plain READ/WRITE")
            _note_once(self.ring_note)
        fb = <int*>PyMem_RawMalloc(nbuf * sizeof(int))
        if fb == NULL:
            raise MemoryError()
        for i in range(nbuf):
            fb[i] = nbuf - 1 - i
        # no Python code from this check to the unlock: close() cannot run in between
        if not self._ready:
            PyMem_RawFree(fb)
            raise HandleClosedError("I/O on a closed AioQueue (closed while its bounce ring "
                                    "was being attached)")
        self._ring_owner = owner
        pt.pthread_mutex_lock(&self.q.mu)
        self.q.free_bufs = fb
        self.q.ring = <char*>address
        self.q.bufsize = <uint64_t>bufsize
        self.q.nfreebuf = nbuf
        self.q.nbuf = nbuf
        pt.pthread_mutex_unlock(&self.q.mu)

    def submit(self, int fd, bint write, size_t addr, uint64_t nbytes, int64_t offset,
               int mode, uint64_t align, uint64_t block, FileState file=None,
               bint fsync=False, bint sync=False, object token=None, object name=None,
               object owner=None, list sink=None):
        """Queue one request and submit what can go now; returns its :class:`Request`.

        ``sink``: a list the request is appended to before this returns. A caller that must
        drain what it queued when a signal handler raises needs it: the handler can run as
        soon as this call returns, before the caller has stored the result anywhere.

        ``mode`` is MODE_DIRECT, MODE_BOUNCE or MODE_PLAIN; ``align`` the file's O_DIRECT
        offset alignment (1 for MODE_PLAIN); ``block`` the piece size (a multiple of
        ``align``; ring pieces are capped at the ring's buffer size). Writes that are not
        aligned at both ends need ``file`` (edge blocks are locked per file). A sync request
        is finished with :meth:`Request.wait`; an asynchronous one comes back from
        :meth:`serve`. ``name`` (the file's, for error messages), ``token`` (the caller's)
        and ``owner`` (what keeps ``addr`` valid) ride on the request; the queue keeps the
        request, and so ``owner``, alive until it is finished and seen.
        """
        return self._submit(fd, write, addr, nbytes, offset, mode, align, block, file, fsync,
                            sync, token, name, owner, sink)

    cdef Request _submit(self, int fd, bint write, size_t addr, uint64_t nbytes,
                         int64_t offset, int mode, uint64_t align, uint64_t block,
                         FileState file, bint fsync, bint sync, object token, object name,
                         object owner, list sink):
        cdef _Req* r
        cdef Request req
        cdef uint64_t te, hs
        cdef bint edges, grow
        self._check()
        if mode != M_DIRECT and mode != M_BOUNCE and mode != M_PLAIN:
            raise ValueError(f"bad mode {mode}")
        if offset < 0:
            raise ValueError(f"negative file offset {offset}")
        if mode == M_PLAIN:
            align = 1
        if align < 1 or block < align or block % align:
            raise ValueError(f"block {block} must be a positive multiple of the alignment "
                             f"{align}")
        hs = <uint64_t>offset % align
        te = (<uint64_t>offset + nbytes) % align
        edges = mode != M_PLAIN and nbytes > 0 and (hs != 0 or te != 0)
        if (edges or (mode == M_BOUNCE and nbytes > 0)) and self.q.nbuf == 0:
            raise RuntimeError("this request needs bounce buffers: attach_ring() first")
        if edges and <uint64_t>self.q.bufsize < align:
            raise ValueError(f"ring buffers of {self.q.bufsize} bytes are smaller than the "
                             f"alignment {align}")
        if mode == M_DIRECT and nbytes > 0 and self.q.uring != NULL:
            self._fix_at(addr, nbytes)
        if edges and write and file is None:
            raise ValueError("an unaligned write needs its FileState")
        req = Request.__new__(Request)
        r = <_Req*>PyMem_RawMalloc(sizeof(_Req))
        if r == NULL:
            raise MemoryError()
        memset(r, 0, sizeof(_Req))
        req.r = r
        req.queue = self
        req.token = token
        req.name = name
        req.owner = owner
        r.fd = fd
        r.opcode = abi.IOCB_CMD_PWRITE if write else abi.IOCB_CMD_PREAD
        r.mode = mode
        r.addr = addr
        r.nbytes = nbytes
        r.offset = offset
        r.align = align
        r.block = block
        r.bblock = block
        if mode != M_PLAIN and self.q.nbuf and r.bblock > self.q.bufsize:
            r.bblock = self.q.bufsize // align * align
            if r.bblock == 0:
                raise ValueError(f"ring buffers of {self.q.bufsize} bytes are smaller than "
                                 f"the alignment {align}")
        r.fsync = fsync and write
        r.sync = sync
        if mode == M_PLAIN:
            r.head_end = 0
            r.tail_start = nbytes
        else:
            r.head_end = 0 if hs == 0 else min(nbytes, align - hs)
            # te > nbytes: the request starts and ends inside one block (the head covers it)
            r.tail_start = nbytes - te if te <= nbytes else 0
            if r.tail_start < r.head_end:
                r.tail_start = r.head_end
        if file is not None:
            req.file = file                 # its core must outlive the request
            r.file = &file.core
            if write:
                pt.pthread_mutex_lock(&_edge_mu)
                if r.file.active_writes == 0:
                    r.file.logical_end = 0
                if offset + <int64_t>nbytes > r.file.logical_end:
                    r.file.logical_end = offset + <int64_t>nbytes
                grow = mode != M_PLAIN and nbytes > 0 and (nbytes > block
                                                           or r.file.active_writes > 0)
                r.file.active_writes += 1
                pt.pthread_mutex_unlock(&_edge_mu)
                r.counted_write = True
                if grow:
                    # pieces in flight together (several of this request's, or other
                    # writes'): past the end of the file they would run one at a time
                    # (see _grow). After logical_end: no edge block is cut back below it.
                    with nogil:
                        _grow(fd, r.file, offset, offset + <int64_t>nbytes, nbytes <= block)
        # from here nothing fails: the queue holds the request until it is seen finished
        Py_INCREF(req)
        r.obj = <PyObject*>req
        req.held = True
        r.stage = ST_HEAD
        r.queued = True
        q = &self.q
        with nogil:
            pt.pthread_mutex_lock(&q.mu)
            if not sync:
                q.nasync += 1
                q.last_async = _mono()
            _link(q, r)
            if not sync:
                _wake_queued(q)             # the completion thread reaps for it
            pt.pthread_mutex_unlock(&q.mu)
            # Every request goes out at once, from the caller's thread: a sync one is reaped
            # by its caller, and the slices of one request on several lanes must all be
            # moving while it waits for the first; an asynchronous one is reaped by the
            # completion thread, or by the caller itself once it waits for it (help()). A
            # burst handed to the completion thread to submit waited for that thread to
            # wake, and its first request ran alone until the thread came back from the
            # kernel: 4 KiB bursts of 32 ran at 0.6x the batch call, against 0.7-0.9x now.
            _feed(q)
            if not sync and _starved(q):
                # The kernel queue is full and requests wait for room: only a reap lets them
                # go. A caller queueing back to back keeps the completion thread standing
                # by, or waiting for the GIL (this thread's) to deliver; so this thread
                # reaps what has finished, without waiting, and sends the next ones.
                pt.pthread_mutex_lock(&q.mu)
                if _starved(q) and not q.reaping and not q.broken:
                    _reap_round(q, 0)
                pt.pthread_mutex_unlock(&q.mu)
        if sink is not None:
            sink.append(req)
        return req

    def run(self, int fd, bint write, size_t addr, uint64_t nbytes, int64_t offset, int mode,
            uint64_t align, uint64_t block, FileState file=None, bint fsync=False,
            object name=None):
        """:meth:`submit` a sync request and wait for it, in one call: the bytes moved, or
        the request's error (see :func:`failure`) raised.

        A request that is one piece on the caller's memory, aligned at both ends, is one
        ``pread``/``pwrite`` in this thread instead (GIL released): with nothing to overlap,
        the AIO round trip only adds a completion hop (for ``O_DIRECT`` writes on ext4 it
        halves small-write IOPS).
        """
        return self._run(fd, write, addr, nbytes, offset, mode, align, block, file, fsync,
                         name)

    cdef object _run(self, int fd, bint write, size_t addr, uint64_t nbytes, int64_t offset,
                     int mode, uint64_t align, uint64_t block, FileState file, bint fsync,
                     object name):
        cdef long ret
        cdef uint64_t done = 0
        cdef int e = 0
        cdef _FileCore* core = NULL
        if (mode != M_BOUNCE and not fsync and 0 < nbytes <= block and self._ready
                and self._pid == _self_pid and <uint64_t>offset % align == 0
                and nbytes % align == 0):
            if write and file is not None:
                # a write in flight, like the queued ones: a padded edge block of another
                # request is never cut back below its end
                core = &file.core
                pt.pthread_mutex_lock(&_edge_mu)
                if core.active_writes == 0:
                    core.logical_end = 0
                if offset + <int64_t>nbytes > core.logical_end:
                    core.logical_end = offset + <int64_t>nbytes
                core.active_writes += 1
                pt.pthread_mutex_unlock(&_edge_mu)
            with nogil:
                while done < nbytes:
                    if write:
                        ret = pwrite(fd, <void*>(addr + done), nbytes - done,
                                     offset + <int64_t>done)
                    else:
                        ret = pread(fd, <void*>(addr + done), nbytes - done,
                                    offset + <int64_t>done)
                    if ret < 0:
                        if errno == EINTR:
                            continue
                        e = errno
                        break
                    if ret == 0:
                        if write:
                            e = EIO
                        break
                    done += <uint64_t>ret
                if core != NULL:
                    pt.pthread_mutex_lock(&_edge_mu)
                    core.active_writes -= 1
                    pt.pthread_mutex_unlock(&_edge_mu)
            if e or done < nbytes:
                raise failure(name, write, offset, nbytes, done, e, offset + <int64_t>done,
                              nbytes - done)
            return done
        return self._submit(fd, write, addr, nbytes, offset, mode, align, block, file,
                            fsync, True, None, name, None, None).wait()

    def serve(self):
        """Completion thread: block until asynchronous requests finish.

        Returns a list of finished :class:`Request` objects, or None once :meth:`shutdown`
        was called and nothing is left in flight.
        """
        cdef _Req* head = NULL
        cdef int rc
        if not self._ready:
            return None
        with nogil:
            rc = _serve(&self.q, &head)
        if rc < 0:
            return None
        return _done_list(head)

    def help(self, double budget):
        """A thread that waits for asynchronous results does the completion thread's work
        for up to ``budget`` seconds: it reaps when nobody else does (so no other thread has
        to wake it) and delivers what finished (:func:`deliver`: futures finished, callbacks
        run here). True while asynchronous requests are in flight here; False when none is
        left (the completion thread may still be delivering some: wait on its notification
        then)."""
        cdef _Req* head = NULL
        cdef int rc
        if self._pid != _self_pid or not self._in():
            return False
        try:
            with nogil:
                rc = _help(&self.q, &head, budget)
        finally:
            self._out()
        if rc < 0:
            return False
        if head != NULL:
            deliver(_done_list(head))
        return True

    def hurry(self, int delta):
        """Count a thread that starts (+1) or stops (-1) waiting for asynchronous results.

        While one waits, :meth:`serve` hands each finished request over at once instead of
        gathering a batch (batches spare a thread that is still queueing the GIL hops).
        """
        if not self._in():
            return
        try:
            with nogil:
                pt.pthread_mutex_lock(&self.q.mu)
                self.q.eager += delta
                if self.q.eager < 0:
                    self.q.eager = 0
                _wake(&self.q)
                pt.pthread_mutex_unlock(&self.q.mu)
        finally:
            self._out()

    def shutdown(self):
        """Let :meth:`serve` return None once the queue is idle."""
        if not self._ready:
            return
        pt.pthread_mutex_lock(&self.q.mu)
        self.q.closing = True
        pt.pthread_cond_broadcast(&self.q.cv)
        pt.pthread_cond_signal(&self.q.scv)
        pt.pthread_mutex_unlock(&self.q.mu)

    def close(self):
        """Destroy the context (after what is in flight). Idempotent.

        The caller makes sure no request is pending and the completion thread has returned.
        In a forked child the parent's context is left alone.
        """
        if not self._ready:
            return
        self._ready = False
        while self._busy > 0:
            # a call that entered before (_in) is still inside with the GIL released
            with nogil:
                usleep(200)
        if self._pid == getpid():
            with nogil:
                _k_destroy(&self.q)
        else:
            _k_forget(&self.q)
        self.q.ctx = 0
        self.q.threads = NULL
        if self._pid == getpid():
            pt.pthread_mutex_destroy(&self.q.mu)
            pt.pthread_cond_destroy(&self.q.cv)
            pt.pthread_cond_destroy(&self.q.scv)
        self._free_arrays()
        self._ring_owner = None

    def __dealloc__(self):
        if self._ready and self._pid == getpid():
            with nogil:
                _k_destroy(&self.q)
        elif self._ready:
            _k_forget(&self.q)
        if self._ready:
            self._free_arrays()


def aio_available(str backend="aio"):
    """Return ``(True, "")`` if an :class:`AioQueue` on ``backend`` can be set up here, else
    ``(False, reason)``.

    Sets up and destroys a queue of depth 1: the same ``io_setup`` (or ``io_uring_setup``)
    the handles make, so a refusal (``aio-max-nr`` exhausted, ``kernel.io_uring_disabled``,
    a seccomp profile, a kernel without AIO) shows here.
    """
    try:
        AioQueue(1, backend=backend).close()
    except OSError as exc:
        return (False, str(exc))
    return (True, "")


def backends_available():
    """``{backend: (works, reason)}`` for every backend a queue can run on here."""
    return {b: aio_available(b) for b in BACKENDS if b != "auto"}


def _uring_inject(int setup_errno=0, int einval_flags=0, int register_errno=0,
                  int cqe_eagain=0, int cqe_short=0, int files_errno=0):
    """Tests only: make the io_uring backend fail on purpose (see ``_uring.h``); all zero
    (the default) turns every fault off."""
    ur.uring_inject.setup_errno = setup_errno
    ur.uring_inject.einval_flags = einval_flags
    ur.uring_inject.register_errno = register_errno
    ur.uring_inject.files_errno = files_errno
    ur.uring_inject.cqe_eagain = cqe_eagain
    ur.uring_inject.cqe_short = cqe_short


def _uring_faults_left():
    """Tests only: the injected CQE faults not yet used ``(eagain, short)``."""
    return (ur.uring_inject.cqe_eagain, ur.uring_inject.cqe_short)


# ------------------------------------------------------------------------------- files
from posix.unistd cimport close as c_close


cdef extern from "<sys/ioctl.h>" nogil:
    int ioctl(int fd, unsigned long request, ...)

cdef extern from "<linux/fs.h>" nogil:
    unsigned long BLKGETSIZE64


cdef void _close_owned(int fd) noexcept nogil:
    ur.uring_file_close(fd)                 # out of every ring's table, then closed
    c_close(fd)


@cython.auto_pickle(False)
cdef class AioFile:
    """A file opened once for many requests (see :meth:`aioswap.AioHandle.open`).

    ``pread``/``pwrite`` take the arguments of the handle's methods without ``file``.
    ``close()`` is idempotent; the descriptor is closed once the requests in flight on it
    are finished.

    The file owns its state: whether it is closed and how many requests are in flight on it
    are C fields, changed only while the GIL is held and without running Python code in
    between, so every change is atomic with respect to other threads (no lock to share).

    Attributes
    ----------
    name : str
        The path (quoted) or ``"fd N"``, as error messages name it.
    direct : bool
        False when the file system refused ``O_DIRECT`` (buffered I/O then).
    mem_align, off_align : int
        ``O_DIRECT`` alignment of memory and of file offsets/lengths (``statx``).
    readable, writable : bool
        The access the file was opened with.
    block_device : bool
        A block device (its size is the device's, not ``st_size``).
    key : tuple
        ``(st_dev, st_ino)``: which file this is.
    piece : int
        The size of the pieces its requests are cut into (the handle's block size, rounded
        to the alignment).
    """
    cdef public str name
    cdef readonly bint direct, readable, writable, block_device
    cdef readonly object key
    cdef readonly uint64_t mem_align, off_align, piece
    cdef readonly Py_ssize_t _users         # requests in flight (tests read it)
    cdef readonly uint64_t uses             # requests ever counted on it (use/pin)
    cdef object _handle, _inode, _device
    cdef int _fd
    cdef bint _owned, _closed
    cdef object __weakref__

    def __cinit__(self):
        self._fd = -1
        self._closed = True             # until __init__ has run: nothing to close

    def __init__(self, handle, int fd, str name, *, bint direct, bint readable,
                 bint writable, st, inode, bint owned=True):
        self._handle = handle
        self.name = name
        self.direct = direct
        self.readable = readable
        self.writable = writable
        self._inode = inode                     # what the process shares per inode
        self.key = (st.st_dev, st.st_ino)
        self.mem_align = inode.mem_align if direct else 1
        self.off_align = inode.off_align if direct else 1
        self.block_device = S_ISBLK(st.st_mode)
        self._owned = owned
        self._device = None
        self.piece = handle._block(self) if handle is not None else 0
        self._fd = fd
        self._closed = False
        if owned:
            with nogil:
                ur.uring_file_open(fd)          # io_uring may register it (see _uring.h)

    # -- the handle's side ---------------------------------------------------------------
    @property
    def state(self):
        """The engine's per-inode state (:class:`FileState`)."""
        return self._inode.state

    def size(self):
        """The file's size now (``statx`` without the times, see :func:`fsize`; block
        devices: the device size)."""
        cdef uint64_t n = 0
        if not self.block_device:
            return fsize(self._fd)
        if ioctl(self._fd, BLKGETSIZE64, &n) < 0:
            raise OSError(errno, os.strerror(errno))
        return n

    def use(self):
        """Count a request on the file; its fd."""
        if self._closed:
            raise ValueError(f"I/O on closed file {self.name}")
        self._users += 1
        self.uses += 1
        return self._fd

    cdef bint pin(self) noexcept:
        # count a request on an open file (False: it is closed); the GIL makes it atomic
        if self._closed:
            return False
        self._users += 1
        self.uses += 1
        return True

    @property
    def busy(self):
        """Whether a request is counted on the file now."""
        return self._users > 0

    def unuse(self):
        """A request counted by :meth:`use` is over."""
        self.release()

    cdef bint unpin(self) noexcept:
        # uncount a request; True: it was the last one out of a closed file, and the caller
        # closes the descriptor (_close_fd), when it holds no lock
        self._users -= 1
        return self._users == 0 and self._closed

    cdef int release(self) except -1:
        if self.unpin():
            self._close_fd()
        return 0

    cdef int _close_fd(self) except -1:
        cdef int fd = self._fd
        dev = self._device
        self._fd = -1
        self._device = None
        if dev is not None:
            try:
                dev.close()
            except Exception:
                _log.exception("aioswap: closing the device handle of %s failed", self.name)
        if fd >= 0 and self._owned:
            _close_owned(fd)
        return 0

    def device_handle(self, factory):
        """The device transport's handle for this file (a cuFile registration): made by
        ``factory(fd)`` on first use, kept while the file is open, closed with it."""
        if self._closed or self._fd < 0:
            raise ValueError(f"I/O on closed file {self.name}")
        dev = self._device
        if dev is None:
            dev = factory(self._fd)
            if self._device is None and not self._closed:
                self._device = dev
            elif self._device is not None:
                dev.close()                     # another thread made one meanwhile
                dev = self._device
        return dev

    # -- public --------------------------------------------------------------------------
    def pread(self, buffer, offset=0, *, nbytes=None, async_op=False):
        """Read into ``buffer`` at ``offset`` (see :meth:`aioswap.AioHandle.pread`)."""
        if self._handle is None:
            raise ValueError(f"{self.name} has no handle to run requests on")
        return _request(self._handle, False, buffer, self, offset, nbytes, async_op, False)

    def pwrite(self, buffer, offset=0, *, nbytes=None, async_op=False, fsync=False):
        """Write ``buffer`` at ``offset`` (see :meth:`aioswap.AioHandle.pwrite`)."""
        if self._handle is None:
            raise ValueError(f"{self.name} has no handle to run requests on")
        return _request(self._handle, True, buffer, self, offset, nbytes, async_op, fsync)

    def fsync(self):
        """Make the data and size written so far durable."""
        os.fsync(self.fileno())

    def fileno(self):
        if self._closed or self._fd < 0:
            raise ValueError(f"I/O on closed file {self.name}")
        return self._fd

    @property
    def closed(self):
        return self._closed

    def close(self):
        """Close the file; requests in flight on it finish first (then the fd is closed)."""
        if self._closed:
            return
        self._closed = True
        if self._users == 0:
            self._close_fd()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def __repr__(self):
        state = "closed" if self._closed else ("direct" if self.direct else "buffered")
        return f"<AioFile {self.name} {state}>"

    def __dealloc__(self):
        # nothing in flight can hold a file that is being freed (requests reference it)
        if self._device is not None:
            try:
                self._device.close()
            except BaseException:
                pass
            self._device = None
        if self._fd >= 0 and self._owned:
            _close_owned(self._fd)
            self._fd = -1


# ---------------------------------------------------------------------------- front door
# The short path of :class:`aioswap.handle.AioHandle`: a plain contiguous CPU tensor, whole,
# on a file the handle opened, in one lane's queue, sync, async or in a batch. Compiled here
# so that Python costs such a request its checks and nothing else; anything else (and
# every error) takes handle.py's general path, which this returns ``SLOW`` for. The handle
# module hands its names over once (front_setup).

@cython.auto_pickle(False)
cdef class HandleCore:
    """What every request of one :class:`~aioswap.AioHandle` counts: whether it is closed,
    how many requests are active, and its statistics.

    C fields, changed only while the GIL is held and with no Python code run in between, so
    every change is atomic with respect to other threads: a synchronous request counts
    itself in and out without taking the handle's lock. ``close()`` sets ``closed`` under
    the lock and then waits on ``idle`` until ``active`` is 0; the request that brings it
    to 0 on a closed handle notifies ``idle`` (taking the lock for that alone).
    """
    cdef public bint closed
    cdef readonly Py_ssize_t active
    cdef public uint64_t direct_bytes, bounce_bytes, head_tail_bytes, buffered_bytes
    cdef public uint64_t read_bytes, write_bytes, reads, writes, async_ops, failed
    cdef object _lock, _idle

    def __init__(self, lock, idle):
        self._lock = lock                   # the handle's lock, and its condition
        self._idle = idle

    cdef inline bint enter_(self) noexcept:
        if self.closed:
            return False
        self.active += 1
        return True

    cdef int leave_(self, Py_ssize_t n, bint locked) except -1:
        # count ``n`` requests out (``locked``: the caller holds the handle's lock)
        self.active -= n
        if self.active == 0 and self.closed:
            if locked:
                self._idle.notify_all()
            else:
                self._lock.acquire()
                try:
                    self._idle.notify_all()
                finally:
                    self._lock.release()
        return 0

    def enter(self):
        """Count a request in; False (nothing counted) when the handle is closed."""
        return self.enter_()

    def leave(self, bint locked=False):
        """Count a request out (``locked``: the caller holds the handle's lock)."""
        self.leave_(1, locked)

    def count_paths(self, int mode, uint64_t edges, uint64_t middle):
        """Bytes per path of one request."""
        _count_paths(self, mode, edges, middle)

    def count_outcome(self, bint write, uint64_t done, bint failed):
        """One finished request."""
        _count_outcome(self, write, done, failed)

    def count_path(self, str path, uint64_t n):
        """``n`` bytes moved by a device path (``"direct"``, ``"bounce"``, ...)."""
        setattr(self, path + "_bytes", getattr(self, path + "_bytes") + n)

    def counters(self):
        """The statistics, in :class:`~aioswap.handle.HandleStats` field order."""
        return (self.direct_bytes, self.bounce_bytes, self.head_tail_bytes,
                self.buffered_bytes, self.read_bytes, self.write_bytes, self.reads,
                self.writes, self.async_ops, self.failed)


cdef object _f_slow = None          # handle._SLOW: take the general path
cdef object _f_handle = None        # aioswap.handle
cdef object _f_pinned = None        # aioswap.pinned
cdef object _f_future = None        # handle.IOFuture
cdef object _f_layout = None        # torch.strided, once a tensor request was seen
cdef object _f_cond_lock = None     # handle._cond_lock
cdef object _f_finished = None      # concurrent.futures' FINISHED
cdef object _f_allocated = None     # pinned._ALLOCATED: a record whose memory a request holds
cdef list _f_gen = None             # handle._fork_generation
cdef set _f_types = None            # handle._short_types (filled once torch is in use)
cdef object _OFF_MAX = 1 << 62      # larger offsets take the general path (which checks them)
_log = logging.getLogger("aioswap")


def front_setup(handle_module, pinned_module):
    """Called once by :mod:`aioswap.handle` at import: the names the front door uses."""
    global _f_slow, _f_handle, _f_pinned, _f_future, _f_cond_lock, _f_finished, _f_gen
    global _f_types, _f_allocated
    _f_handle = handle_module
    _f_pinned = pinned_module
    _f_allocated = pinned_module._ALLOCATED
    _f_slow = handle_module._SLOW
    _f_future = handle_module.IOFuture
    _f_cond_lock = handle_module._cond_lock
    _f_finished = handle_module._FINISHED
    _f_gen = handle_module._fork_generation
    _f_types = handle_module._short_types


cdef object _snap_find(tuple snap, uint64_t addr, uint64_t n):
    # the record of the range in a RangeIndex snapshot ((starts), (ends), (records)) that
    # holds [addr, addr + n) (n > 0, no overflow), or None
    cdef Py_ssize_t lo = 0, hi, mid
    cdef tuple starts = <tuple>snap[0]
    hi = len(starts)
    while lo < hi:                          # bisect_right(starts, addr)
        mid = (lo + hi) >> 1
        if addr < <uint64_t>starts[mid]:
            hi = mid
        else:
            lo = mid + 1
    if lo == 0 or addr + n > <uint64_t>(<tuple>snap[1])[lo - 1]:
        return None
    return (<tuple>snap[2])[lo - 1]


cdef object _io_hold(object registry, uint64_t addr, uint64_t n, bint* locked):
    """``registry.io_hold(addr, n)`` without running Python: the same answer, by bisecting
    the registry's immutable snapshot of locked host ranges (its RangeIndex's ``_snap``)
    here. The snapshot is rebuilt by Python on the first look-up after a change (then this
    asks ``io_hold`` itself). Returns the hold token or None; ``locked[0]``: whether all of
    ``[addr, addr + n)`` is page-locked."""
    locked[0] = False
    if n == 0 or addr + n < addr:           # empty, or past the top of the address space
        return None
    snap = registry._host._snap
    if type(snap) is not tuple:
        hold, lk = registry.io_hold(addr, n)
        locked[0] = bool(lk)
        return hold
    rec = _snap_find(<tuple>snap, addr, n)
    if rec is None:
        return None
    kind = rec.kind
    if kind is not _f_allocated and kind != _f_allocated:
        locked[0] = True                    # registered elsewhere: nothing to hold
        return None
    lock = registry._io_lock
    lock.acquire()
    try:
        if not rec.live:                    # being freed: not locked memory any more
            return None
        rec.io += 1
    finally:
        lock.release()
    locked[0] = True
    return rec


cdef object _rec_at(object registry, uint64_t addr, uint64_t n):
    # the registry's record of the locked host range holding [addr, addr + n), or None (none,
    # or no snapshot now: this is only a hint)
    if n == 0 or addr + n < addr:
        return None
    snap = registry._host._snap
    if type(snap) is not tuple:
        return None
    return _snap_find(<tuple>snap, addr, n)


cdef void _forget_fixed(LockedMemory m) noexcept:
    # m's pages are about to be unlocked and unmapped (or cached for reuse): unregister them
    # from every ring that registered them. A ring would keep the old pages pinned, and I/O
    # through it would reach them, not what a later mapping puts at the same address. The
    # GIL is held throughout, so a queue seen open is not closed meanwhile; its mutex orders
    # this against a reaper that finds the queue broken and destroys the ring.
    cdef AioQueue q
    rings = m._rings
    m._rings = None
    for use in rings:
        obj = (<list>use)[0]()
        if obj is None:
            continue
        q = <AioQueue>obj
        if not q._ready or q._pid != getpid():
            continue
        pt.pthread_mutex_lock(&q.q.mu)
        if q.q.uring != NULL:
            ur.uring_unregister_buffer(q.q.uring, m._addr, m._mapped)
        pt.pthread_mutex_unlock(&q.q.mu)


def io_hold(registry, uint64_t address, uint64_t nbytes):
    """The front door's ``registry.io_hold(address, nbytes)``: ``(token or None, locked)``,
    found without running Python (tests compare the two)."""
    cdef bint locked
    hold = _io_hold(registry, address, nbytes, &locked)
    return hold, locked


cdef int _unhold(object registry, object hold) except -1:
    """``registry.unhold(hold)`` without running Python."""
    lock = registry._io_lock
    lock.acquire()
    try:
        hold.io -= 1
    finally:
        lock.release()
    return 0


cdef int _unhold_all(object registry, list holds) except -1:
    """:func:`_unhold` for each hold in ``holds`` (None: none), under one lock."""
    lock = registry._io_lock
    lock.acquire()
    try:
        for hold in holds:
            if hold is not None:
                hold.io -= 1
    finally:
        lock.release()
    return 0


def request(h, bint write, buffer, file, offset, nbytes, bint async_op, bint fsync):
    """``AioHandle.pread``/``pwrite``: the short path where it applies (see ``_short``),
    else the handle's general path (``AioHandle._request``)."""
    return _request(h, write, buffer, file, offset, nbytes, async_op, fsync)


cdef object _request(h, bint write, buffer, file, offset, nbytes, bint async_op, bint fsync):
    # request(); AioFile.pread/pwrite call it directly (no Python call in between)
    if (nbytes is None and not fsync and type(buffer) in _f_types and type(offset) is int
            and offset >= 0):
        out = _short_on(h, write, buffer, file, offset, 1 if async_op else 0, None)
        if out is not _f_slow:
            return out
    return h._request(write, buffer, file, offset, nbytes, async_op, fsync)


cdef object _short_on(h, bint write, buffer, file, offset, int how, list sink):
    # _short on the file behind ``file``: an AioFile as it is, else the handle's own file in
    # one C call (its stat gives the size a read checks); on a miss (its first use: an open
    # follows) _short_file asks once more, then opens it or refuses the argument. _f_slow
    # where the general path decides.
    cdef int64_t size = -1
    if type(file) is AioFile:
        f = file
    else:
        f = None
        if not (<HandleCore>h._core).closed and h._generation == _f_gen[0]:
            f = _cached_hit(h, file, write, &size)
        if f is None:
            f = h._short_file(file, write)
            size = -1
    if f is None:
        return _f_slow
    try:
        return _short(h, write, buffer, <AioFile>f, offset, how, file, sink, size)
    finally:
        if f is not file:
            (<AioFile>f).release()          # the request counted itself on the file


def init_future(fut, op, file, nbytes, offset):
    """The fields of a new :class:`~aioswap.handle.IOFuture`: the request's. The class holds
    the defaults of ``Future.__init__``'s (RUNNING, no result, no Condition, no waiter or
    callback lists until one is added, fork generation 0), so a future of a burst that
    nobody looks at costs four fields and no list (lists are objects the cyclic garbage
    collector tracks: a burst of a thousand futures set off full collections)."""
    gen = _f_gen[0]
    if gen:
        fut._generation = gen
    fut.op = op
    fut.file = file
    fut.nbytes = nbytes
    fut.offset = offset


@cython.auto_pickle(False)
cdef class Ticket:
    """An asynchronous short-path request from submission to its future's result; also its
    outcome for ``AioHandle.wait`` (``seq``, ``error``)."""
    cdef public object handle, file, fut, hold, error
    cdef public bint write
    cdef public long long seq


@cython.auto_pickle(False)
cdef class ShortQueued:
    """A sync short-path request in a lane's queue (a batch call reaps it later)."""
    cdef public Request rq          # holds the caller's buffer until the request is reaped
    cdef public object file, hold


cdef inline void _count_paths(HandleCore st, int mode, uint64_t edges, uint64_t middle):
    if mode == M_DIRECT:
        st.direct_bytes += middle
    elif mode == M_BOUNCE:
        st.bounce_bytes += middle
    else:
        st.buffered_bytes += middle
    st.head_tail_bytes += edges


cdef inline void _count_outcome(HandleCore st, bint write, uint64_t done, bint failed):
    if failed:
        st.failed += 1
    elif write:
        st.write_bytes += done
        st.writes += 1
    else:
        st.read_bytes += done
        st.reads += 1


cdef extern from "<fcntl.h>":
    enum:
        O_ACCMODE
        O_RDONLY
        O_WRONLY
        O_APPEND


def cached_hit(h, file, bint write):
    """The handle's own open file behind a path or fd argument, when it has one that takes
    the request (see ``AioHandle._cached``), pinned (counted as in use); None for anything
    else, which ``AioHandle._cached`` then opens or refuses with its error.

    One ``statx`` (path; fd: ``fcntl(F_GETFL)`` + ``statx``), without the timestamps (see
    _statlite.h), says which file the argument is now (device, inode) and, for an fd,
    whether its access mode allows the request.
    """
    cdef int64_t size
    return _cached_hit(h, file, write, &size)


cdef object _cached_hit(h, file, bint write, int64_t* size):
    # cached_hit; *size: the file's size by that same stat (block devices: -1, unknown)
    cdef stat_lite st
    cdef int fl, fd
    if type(file) is int:
        if not 0 <= file < 0x7fffffff:
            return None
        fd = file
        fl = c_fcntl(fd, F_GETFL)
        if fl < 0 or stat_lite_fd(fd, &st) < 0:
            return None
        if write:
            if fl & O_ACCMODE == O_RDONLY or fl & O_APPEND:
                return None
        elif fl & O_ACCMODE == O_WRONLY:
            return None
    else:
        if type(file) is str:
            path = (<str>file).encode("utf-8", "surrogateescape")
        elif type(file) is bytes or isinstance(file, os.PathLike):
            path = os.fsencode(file)
        else:
            return None                     # a bool, a float, ...: the slow path refuses it
        if b"\0" in path or stat_lite_at(AT_FDCWD, path, 0, &st) < 0:
            return None
    if not (S_ISREG(st.mode) or S_ISBLK(st.mode)):
        return None
    key = (st.dev, st.ino)
    lock = h._lock
    lock.acquire()
    try:
        files = h._files
        f = files.get(key)
        if (f is not None and (f.writable or not write)
                and (<AioFile>f).pin()):   # pinned: unpinned by the request's end
            files.move_to_end(key)
            size[0] = -1 if S_ISBLK(st.mode) else st.size
            return f
    finally:
        lock.release()
    return None


cdef int _plan(bint direct, uint64_t align, uint64_t mem_align, uint64_t addr, uint64_t n,
              int64_t off, object locked, uint64_t* edges, uint64_t* middle) except -1:
    cdef uint64_t head, tail
    if not direct:
        edges[0] = 0
        middle[0] = n
        return M_PLAIN
    head = (align - <uint64_t>off % align) % align
    if head > n:
        head = n
    tail = (<uint64_t>off + n) % align
    edges[0] = head + (tail if n - head >= tail else 0)
    middle[0] = n - edges[0]
    if (middle[0] > 0 and (addr + head) % mem_align == 0
            and (locked or ((locked is None or edges[0] > 0)
                            and _f_pinned.is_pinned((addr + head, middle[0]))))):
        return M_DIRECT
    return M_BOUNCE


def plan(f, uint64_t address, uint64_t n, int64_t offset, locked):
    """How the pieces of a contiguous host request run: ``(mode, edge bytes, middle bytes)``.

    Direct when the middle (between the unaligned edge blocks) is page-locked and its memory
    lines up with the file's alignment; bounced otherwise; plain on a buffered file.
    ``locked``: whether all of ``[address, address + n)`` is page-locked, or None (unknown:
    the registry is asked); with edges, a False still asks about the middle alone.
    """
    cdef uint64_t edges, middle
    mode = _plan(f.direct, f.off_align, f.mem_align, address, n, offset, locked, &edges,
                 &middle)
    return mode, edges, middle


cdef object _short(h, bint write, t, AioFile f, offset, int how, arg, list sink,
                   int64_t known):
    # The short path of the common request: a plain contiguous CPU tensor, whole, on a file
    # this handle opened, in one lane's queue; the same checks and accounting as the general
    # path, with the handle and the file counted under one lock. ``how`` 0 runs it and
    # returns the bytes moved, 1 returns its future, 2 queues it and returns a ShortQueued
    # (for short_finish); _f_slow for anything else (the general path then also raises every
    # error). known: the file's size by a stat of this request (cached_hit), else -1.
    global _f_layout
    cdef int64_t off
    cdef uint64_t n, addr, align, edges, middle
    cdef int64_t size
    cdef int mode
    cdef bint locked, counted = False
    cdef AioQueue q
    cdef Ticket ticket = None
    cdef Request rq
    cdef ShortQueued sq
    cdef stat_lite lst
    if _f_layout is None:
        _f_layout = _f_handle._short_layout
    if (type(offset) is not int or offset < 0 or offset > _OFF_MAX or f._handle is not h
            or f._closed or h._generation != _f_gen[0] or not t.is_cpu
            or t.layout is not _f_layout or not t.is_contiguous() or t.is_conj()
            or t.is_neg()):
        return _f_slow
    n = t.nbytes
    if n == 0 or not (f.writable if write else f.readable):
        return _f_slow
    lanes = h._lanes
    nl = len(lanes)
    if nl > 1:
        if n >= 2 * f.piece:
            return _f_slow                  # cut across the lanes
        rr = (h._rr + 1) % nl               # a hint: races are fine
        h._rr = rr
        lane = lanes[rr]
    else:
        lane = lanes[0]
    off = offset
    fd = f._fd
    if not write:
        # the size now, not a remembered one: an O_DIRECT read past the end of a file that
        # another process truncated would zero-fill the destination past the data
        if known >= 0:
            size = known                    # stat-ed by this request a moment ago
        elif f.block_device or stat_lite_fd(fd, &lst) < 0:
            size = f.size()                 # (raises what the stat met)
        else:
            size = lst.size
        if off + <int64_t>n > size:
            return _f_slow                  # raises ShortReadError before any I/O
    addr = t.data_ptr()
    registry = _f_pinned.registry
    hold = _io_hold(registry, addr, n, &locked)
    try:
        align = f.off_align
        mode = _plan(f.direct, align, f.mem_align, addr, n, off, locked, &edges, &middle)
        if mode == M_BOUNCE or edges:       # direct and aligned: no ring to lock for it
            ring = lane.ring
            if not ring.attached:
                ring.ensure()
        q = lane.queue
        if how == 1:
            fut = _f_future.__new__(_f_future)
            init_future(fut, "write" if write else "read", arg, n, offset)
            fut._queue = q                  # its hurry() and help() (see IOFuture)
            ticket = Ticket.__new__(Ticket)
            ticket.handle = h
            ticket.write = write
            ticket.file = f
            ticket.fut = fut
            ticket.hold = hold
            if lane.thread is None:
                lane.start()
        core = <HandleCore>h._core
        if ticket is None:
            # counted in without the handle's lock: no Python code runs between the checks
            # and the counts (see HandleCore)
            if not core.closed and f.pin():
                core.active += 1
                counted = True
        else:
            lock = h._lock
            lock.acquire()
            try:
                if not core.closed and f.pin():
                    core.active += 1
                    counted = True
                    seq = h._seq
                    ticket.seq = seq
                    h._seq = seq + 1
                    h._open.append(seq)
                    core.async_ops += 1
            finally:
                lock.release()
        if counted:
            _count_paths(core, mode, edges, middle)
    except BaseException:
        if hold is not None:
            _unhold(registry, hold)
        raise
    if not counted:
        if hold is not None:
            _unhold(registry, hold)
        return _f_slow                      # raises the closed error
    if ticket is not None:
        try:
            q._submit(fd, write, addr, n, off, mode, align, f.piece, f.state, False, False,
                      ticket, f.name, t, None)
        except BaseException:
            lock.acquire()
            try:
                _finished_locked(h, ticket, None, False)
            finally:
                lock.release()
            _short_done(h, f, hold, write, 0, True)
            raise
        return ticket.fut
    if how == 2:
        try:
            rq = q._submit(fd, write, addr, n, off, mode, align, f.piece, f.state, False,
                           True, None, f.name, t, sink)
        except BaseException:
            _short_done(h, f, hold, write, 0, True)
            raise
        sq = ShortQueued.__new__(ShortQueued)
        sq.rq = rq
        sq.file = f
        sq.hold = hold
        return sq
    done = -1
    try:
        done = q._run(fd, write, addr, n, off, mode, align, f.piece, f.state, False, f.name)
    finally:
        # an error or an interruption (the queue drained the request first) is raised
        _short_done(h, f, hold, write, max(done, 0), done < 0)
    return done


cdef _short_done(h, AioFile f, hold, bint write, uint64_t done, bint failed):
    # a sync short-path request is over (failed: with an error the caller raises): uncount
    # it on the handle and the file
    core = <HandleCore>h._core
    last = f.unpin()
    _count_outcome(core, write, done, failed)
    core.leave_(1, False)
    if hold is not None:
        _unhold(_f_pinned.registry, hold)
    if last:
        f._close_fd()


def short_finish(h, ShortQueued sq, bint drain=False):
    """Reap a queued short-path request (``drain``: without looking at signals)."""
    cdef Request rq = sq.rq
    done = -1
    try:
        done = rq.drain() if drain else rq.wait()
    finally:
        _short_done(h, <AioFile>sq.file, sq.hold, rq.r.opcode == abi.IOCB_CMD_PWRITE,
                    rq.r.done if rq.seen else 0, done < 0)
    return done


cdef inline tuple _batch_item(h, item):
    # (buffer, file, offset) of one batch item: a tuple of two or three here, anything else
    # by Python's unpacking (its errors)
    if type(item) is tuple and 2 <= len(<tuple>item) <= 3:
        if len(<tuple>item) == 2:
            return ((<tuple>item)[0], (<tuple>item)[1], 0)
        return <tuple>item
    return h._many_unpack(item)


def many_async(h, bint write, requests, list futs):
    """``pread_many``/``pwrite_many`` with ``async_op=True``: each item's request submitted,
    its future appended to ``futs`` (the caller waits for those if this raises)."""
    for item in requests:
        buf, file, off = _batch_item(h, item)
        futs.append(_request(h, write, buf, file, off, None, True, False))


def many_queue(h, bint write, requests, list queued, list subs):
    """The queueing half of a sync ``pread_many``/``pwrite_many`` (``AioHandle._many``):
    every ``(buffer, file[, offset])`` of ``requests`` queued in turn, each appended to
    ``queued`` as soon as it is queued (a :class:`ShortQueued` on the short path, else what
    ``h._many_slow`` made of it), so the caller can finish or abandon them if this raises."""
    slow = h._many_slow
    for item in requests:
        buf, file, off = _batch_item(h, item)
        if type(buf) in _f_types and type(off) is int and off >= 0:
            sq = _short_on(h, write, buf, file, off, 2, subs)
            if sq is not _f_slow:
                queued.append(sq)
                continue
        queued.append(slow(write, buf, file, off, subs))


def many_finish(h, list queued):
    """The reaping half of a sync batch: the bytes moved per request, in order, and the
    first error met (``OSError``, ``ValueError``, ``EOFError``: the others still ran), or
    None. Anything else (a signal) abandons the rest (``h._abandon``) and is raised."""
    cdef Py_ssize_t i, n = len(queued)
    out = [0] * n
    first = None
    for i in range(n):
        q = queued[i]
        try:
            if type(q) is ShortQueued:
                out[i] = short_finish(h, <ShortQueued>q)
            else:
                out[i] = h._many_finish_slow(q)
        except (OSError, ValueError, EOFError) as exc:
            if first is None:
                first = exc
        except BaseException:
            h._abandon(queued[i + 1:])
            raise
    return out, first


cdef inline void _close_seq(object opened, set closed, object seq):
    """Submission number ``seq`` is over: off the front of ``opened`` (and whatever had
    finished behind it), or into ``closed`` until the ones before it are over."""
    if opened and opened[0] == seq:
        opened.popleft()
        while opened and opened[0] in closed:
            closed.remove(opened.popleft())
    else:
        closed.add(seq)


cdef inline void _wake_waiters(h, object opened):
    # wake a waiter only when what it waits for is over (one wake per wait, not one per
    # finished request: each is a context switch)
    targets = h._wait_targets
    if targets and (not opened or opened[0] >= min(targets)):
        h._finished.notify_all()


cdef _finished_locked(h, outcome, error, bint counted):
    outcome.error = error
    if counted:
        h._unwaited += 1
        outcome.fut._wgen = h._wait_gen
        if error is not None:
            outcome.fut._ledger = h
            h._errors.append(outcome)
    opened = h._open
    _close_seq(opened, h._closed_seqs, outcome.seq)
    _wake_waiters(h, opened)


def finished_locked(h, outcome, error, bint counted=True):
    """An async request is over (the handle's lock held): record it, wake ``wait()``.
    ``counted``: False for a request that failed to be submitted (its caller got the error;
    ``wait()`` neither counts nor raises it)."""
    _finished_locked(h, outcome, error, counted)


cdef _finish_future(fut, result, error):
    if fut._cond is None:
        _f_cond_lock.acquire()
        try:
            if fut._cond is None:
                if error is None:
                    fut._result = result
                else:
                    fut._exception = error
                fut._state = _f_finished
                return
        finally:
            _f_cond_lock.release()
    if error is None:
        fut.set_result(result)
    else:
        fut.set_exception(error)


def finish_future(fut, result, error):
    """Complete an :class:`~aioswap.handle.IOFuture` (``set_result``/``set_exception``, or
    just the fields when nobody has used it yet)."""
    _finish_future(fut, result, error)


def complete(h, list items):
    """A lane's completion thread: a batch of finished short-path requests of ``h`` (the
    handle's counters updated once per batch, under one hold of its lock)."""
    cdef Request rq
    cdef Ticket t
    cdef AioFile f
    cdef Py_ssize_t n = len(items)
    cdef uint64_t rbytes = 0, wbytes = 0
    cdef Py_ssize_t nreads = 0, nwrites = 0, nfailed = 0
    closing = []
    lock = h._lock
    lock.acquire()
    try:
        wait_gen = h._wait_gen
        opened = h._open
        closed = h._closed_seqs
        for item in items:
            rq = <Request>item
            t = <Ticket>rq.token
            f = <AioFile>t.file
            if f.unpin():
                closing.append(f)
            err = rq.error() if rq.r.err or rq.r.eof else None
            t.error = err
            fut = t.fut
            fut._wgen = wait_gen
            if err is not None:
                nfailed += 1
                fut._ledger = h
                h._errors.append(t)
            elif t.write:
                nwrites += 1
                wbytes += rq.r.done
            else:
                nreads += 1
                rbytes += rq.r.done
            _close_seq(opened, closed, t.seq)
        h._unwaited += n
        stats = <HandleCore>h._core
        if nreads:
            stats.reads += nreads
            stats.read_bytes += rbytes
        if nwrites:
            stats.writes += nwrites
            stats.write_bytes += wbytes
        if nfailed:
            stats.failed += nfailed
        _wake_waiters(h, opened)
        stats.leave_(n, True)
    finally:
        lock.release()
    holds = [(<Ticket>(<Request>item).token).hold for item in items]
    _unhold_all(_f_pinned.registry, holds)
    for item in items:
        rq = <Request>item
        t = <Ticket>rq.token
        try:
            _finish_future(t.fut, rq.r.done, t.error)
        except BaseException:               # a callback's error stays with it
            _log.exception("aioswap: completing a request failed")
    for item in closing:
        (<AioFile>item)._close_fd()


def deliver(list batch):
    """A lane's completion thread: finish a batch of requests (their futures' callbacks run
    here): the short path's in one :func:`complete` per handle, the others through their
    token's ``part_done``."""
    cdef Request rq
    tickets = []
    for item in batch:
        rq = <Request>item
        token = rq.token
        if type(token) is Ticket:
            tickets.append(rq)
            continue
        try:
            token.part_done(rq)
        except BaseException:               # never let one callback stop the lane
            _log.exception("aioswap: completing a request failed")
    if tickets:
        try:
            complete((<Ticket>(<Request>tickets[0]).token).handle, tickets)
        except BaseException:
            _log.exception("aioswap: completing requests failed")
