# Memory helpers: the process-wide edge-block table, address views, populate and
# residency probes, copying a bounced read out.
# Part of aioswap/_aio.pyx (included there, one module).

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
    object PyMemoryView_FromObject(object obj)
    Py_buffer* PyMemoryView_GET_BUFFER(object mv)
    bint PyObject_CheckBuffer(object obj)
    int PyBuffer_IsContiguous(const Py_buffer* view, char order)


# ------------------------------------------------------------------------ buffers
# The compiled half of ``aioswap._buffers.resolve``: the buffers requests carry every day
# (plain CPU tensors, numpy arrays, bytes-like objects), resolved without running Python.
# What it does not take (strided views, CUDA tensors, object arrays, exotic exporters) is
# left to ``resolve``, which also explains refusals.
cdef object _SLOW = object()        # "not here: the general path decides"
cdef object _strided = None         # torch.strided, once torch is in use
cdef set _tensor_types = set()      # torch.Tensor and nn.Parameter, once torch is in use
# The C-level descriptors of the tensor fields the compiled path reads, found in the tensor
# classes' hierarchy once (each read then skips the attribute look-up through the class hierarchy:
# about 0.2 us of the 0.45 us the seven reads cost per request); None where a tensor class
# of ``_tensor_types`` defines its own (then the attribute is read as usual).
cdef object _is_cpu = None, _layout = None, _nbytes = None          # getset descriptors
cdef object _is_contiguous = None, _is_conj = None, _is_neg = None  # method descriptors
cdef object _data_ptr = None

cdef extern from *:
    """
    /* a getset descriptor's value for obj: what obj.<name> reads, without the look-up */
    static inline PyObject* aioswap_descr_get(PyObject* d, PyObject* obj) {
        return Py_TYPE(d)->tp_descr_get(d, obj, (PyObject*)Py_TYPE(obj));
    }
    """
    object _descr_get "aioswap_descr_get"(object d, object obj)


cdef object _found(object cls, str name):
    # the object ``name`` resolves to in cls's class hierarchy (None: nowhere)
    for c in cls.__mro__:
        d = c.__dict__.get(name)
        if d is not None:
            return d
    return None


cdef object _base_descr(tuple types, str name, str kind):
    # the C descriptor (of ``kind``) that ``name`` resolves to in every class of ``types``,
    # else None
    d = _found(types[0], name)
    if type(d).__name__ != kind or any(_found(t, name) is not d for t in types):
        return None
    return d


def learn_torch():
    """Let the compiled path take tensors: called by a request that met one (aioswap never
    imports torch itself; this finds it in ``sys.modules``)."""
    global _strided, _is_cpu, _layout, _nbytes, _is_contiguous, _is_conj, _is_neg, _data_ptr
    torch = sys.modules.get("torch")
    if torch is not None and not _tensor_types:
        _strided = torch.strided
        types = (torch.Tensor, torch.nn.Parameter)
        _is_cpu = _base_descr(types, "is_cpu", "getset_descriptor")
        _layout = _base_descr(types, "layout", "getset_descriptor")
        _nbytes = _base_descr(types, "nbytes", "getset_descriptor")
        _is_contiguous = _base_descr(types, "is_contiguous", "method_descriptor")
        _is_conj = _base_descr(types, "is_conj", "method_descriptor")
        _is_neg = _base_descr(types, "is_neg", "method_descriptor")
        _data_ptr = _base_descr(types, "data_ptr", "method_descriptor")
        _tensor_types.update(types)


cdef object _tensor_host(object t, uint64_t* addr, uint64_t* n):
    # _host_buffer of a tensor of _tensor_types: t, or _SLOW (not a plain CPU tensor)
    if (_is_cpu is not None and _layout is not None and _nbytes is not None
            and _is_contiguous is not None and _is_conj is not None and _is_neg is not None
            and _data_ptr is not None):
        if (not _descr_get(_is_cpu, t) or _descr_get(_layout, t) is not _strided
                or not _is_contiguous(t) or _is_conj(t) or _is_neg(t)):
            return _SLOW
        addr[0] = _data_ptr(t)
        n[0] = _descr_get(_nbytes, t)
        return t
    if (not t.is_cpu or t.layout is not _strided or not t.is_contiguous() or t.is_conj()
            or t.is_neg()):
        return _SLOW
    addr[0] = t.data_ptr()
    n[0] = t.nbytes
    return t


cdef object _host_buffer(object buffer, bint write, uint64_t* addr, uint64_t* n):
    # The object that keeps a contiguous CPU buffer's memory valid while a request uses it
    # (the tensor itself; for any other exporter a memoryview, which holds its export, so a
    # bytearray cannot be resized under the request), with its address and size in bytes;
    # _SLOW for anything else. A read needs a writable buffer.
    cdef Py_buffer* view
    cdef const char* fmt
    tb = type(buffer)
    if tb in _tensor_types:
        return _tensor_host(buffer, addr, n)
    if tb is int or tb is str or tb is float or not PyObject_CheckBuffer(buffer):
        return _SLOW
    try:
        mv = PyMemoryView_FromObject(buffer)
    except Exception:
        return _SLOW                        # (resolve names what is wrong)
    view = PyMemoryView_GET_BUFFER(mv)
    if not PyBuffer_IsContiguous(view, b'C') or (view.readonly and not write):
        return _SLOW
    fmt = view.format
    if fmt != NULL and strchr(fmt, 79) != NULL:     # 'O': Python object pointers, not data
        return _SLOW
    addr[0] = <uint64_t><uintptr_t>view.buf
    n[0] = <uint64_t>view.len
    return mv


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


# Bumped in a child after fork(): a handle (Core) or future made before it refuses to work
# there (its lanes' threads and kernel contexts stayed in the parent). Cheaper than getpid().
cdef long _fork_gen = 0


def fork_generation():
    """How many fork()s this process is away from the one that imported the engine (0 in
    that one): what handles and futures compare against the generation they were made in."""
    return _fork_gen


def _after_fork_in_child():
    """A child starts with no requests: the edge table is empty and its mutex fresh (another
    thread of the parent may have held it at fork()); the fork generation moves on."""
    global _self_pid, _fork_gen
    _fork_gen += 1
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
