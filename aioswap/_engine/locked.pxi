# Locked memory: page-locked mappings, their cache and reserve, LockedMemory.
# Part of aioswap/_aio.pyx (included there, one module).

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
