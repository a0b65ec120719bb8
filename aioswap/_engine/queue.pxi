# AioQueue: one kernel queue per handle lane; which backends work here.
# Part of aioswap/_aio.pyx (included there, one module).

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
    cdef object _host               # the registry's index of locked host ranges, or None
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
                 str backend="auto", registry=None):
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
        # io_uring registers the registry's allocations that are reused (_fix_at)
        self._host = None if registry is None else registry.engine_view()[0]
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
        if ur.uring_covers(self.q.uring, addr, n) or self._host is None:
            return 0
        rec = _rec_at(self._host, addr, n)
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
        if head != NULL:
            deliver(_done_list(head))
        # the callers are waits (wait(), result()): a signal handler (KeyboardInterrupt)
        # runs here, between batches, as it would in a wait written in Python
        PyErr_CheckSignals()
        return rc >= 0

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
