# The handle's core: its request path, ledger and statistics.
# Part of aioswap/_aio.pyx (included there, one module).

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
