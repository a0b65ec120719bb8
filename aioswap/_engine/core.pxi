# The handle's core: the state every request of one handle shares, its compiled request
# path, its ledger of asynchronous requests and its statistics.
# Part of aioswap/_aio.pyx (included there, one module).
#
# Every request of contiguous host memory (a tensor, a numpy array, any buffer; whole or
# ``nbytes``; in one lane or cut across lanes; sync, async or in a batch) is built in one
# place, ``Core._submit``: one Ticket for the request, one queue Request per part. Python
# keeps the cold jobs, in the handle's general path (an object the handle passes in,
# ``general``, called with the handle as its first argument): explaining a refusal, and
# staging strided, conjugate/negative and CUDA buffers, which then come back through
# ``Core.submit``. Nothing here reads another object's private names: the
# handle, the registry (``engine_view``) and the futures (``aioswap._future.ENGINE``) hand
# over what this uses when the Core is made.

cdef object _OFF_MAX = 1 << 62      # larger offsets are refused (general path: why)
#: The largest file offset a request may start at (4 EiB; no file system reaches it).
MAX_OFFSET = _OFF_MAX
_log = logging.getLogger("aioswap")
# A thread that waits for asynchronous results reaps and delivers them itself, looking at
# Python signals (KeyboardInterrupt) and at the state it waits for at least this often.
cdef double _HELP_S = 0.01


# ------------------------------------------------------------------ the registry's view
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


cdef object _io_hold(object registry, object host, object io_lock, object allocated,
                     uint64_t addr, uint64_t n, bint* locked):
    """``registry.io_hold(addr, n)`` without running Python: the same answer, by bisecting
    the snapshot the registry publishes (``host.snap``, see ``PinnedRegistry.engine_view``).
    The snapshot is rebuilt by Python on the first look-up after a change (then this asks
    ``io_hold`` itself). Returns the hold token or None; ``locked[0]``: whether direct I/O
    may use all of ``[addr, addr + n)`` (page-locked, or the registry's own unlocked memory).
    ``allocated``: the kinds of records a hold counts on (``engine_view``)."""
    locked[0] = False
    if n == 0 or addr + n < addr:           # empty, or past the top of the address space
        return None
    snap = host.snap
    if type(snap) is not tuple:
        hold, lk = registry.io_hold(addr, n)
        locked[0] = bool(lk)
        return hold
    rec = _snap_find(<tuple>snap, addr, n)
    if rec is None:
        return None
    if rec.kind not in allocated:
        locked[0] = True                    # registered elsewhere: nothing to hold
        return None
    io_lock.acquire()
    try:
        if not rec.live:                    # being freed: not locked memory any more
            return None
        rec.io += 1
    finally:
        io_lock.release()
    locked[0] = True
    return rec


cdef object _rec_at(object host, uint64_t addr, uint64_t n):
    # the registry's record of the locked host range holding [addr, addr + n), or None (none,
    # or no snapshot now: this is only a hint)
    if n == 0 or addr + n < addr:
        return None
    snap = host.snap
    if type(snap) is not tuple:
        return None
    return _snap_find(<tuple>snap, addr, n)


def io_hold(registry, uint64_t address, uint64_t nbytes):
    """The engine's ``registry.io_hold(address, nbytes)``: ``(token or None, locked)``,
    found without running Python (tests compare the two)."""
    cdef bint locked
    host, io_lock, allocated = registry.engine_view()
    hold = _io_hold(registry, host, io_lock, allocated, address, nbytes, &locked)
    return hold, locked


cdef int _unhold(object io_lock, object hold) except -1:
    """``registry.unhold(hold)`` without running Python (or a list)."""
    io_lock.acquire()
    try:
        hold.io -= 1
    finally:
        io_lock.release()
    return 0


cdef int _unhold_all(object io_lock, list holds) except -1:
    """``registry.unhold`` for each hold in ``holds`` (None: none), under one lock."""
    io_lock.acquire()
    try:
        for hold in holds:
            if hold is not None:
                hold.io -= 1
    finally:
        io_lock.release()
    return 0


# ------------------------------------------------------------------------- records
@cython.auto_pickle(False)
cdef class Ticket:
    """One request of a handle from submission to its result, as the Core sees it: what
    finishing it needs (its file, the registry hold on its memory, its parts), and for an
    asynchronous request its place in the ledger: its submission number (``seq``), its
    future (``fut``) and, once it failed, its ``error``. A request cut across lanes is one
    ticket over several queue :class:`Request` objects (its parts); a sync one in a batch
    keeps them in :attr:`parts` until it is reaped."""
    cdef readonly object fut
    cdef readonly long long seq
    cdef public object error
    cdef readonly list parts        # a queued sync request: its queue requests, in order
    cdef object file, hold, name
    cdef Core core
    cdef bint write, kept           # kept: the ledger keeps its error for wait()
    cdef bint fsync                 # several parts: fsync once they are all done
    cdef bint count                 # counted in the statistics as a request of its own
    cdef long long wgen             # the wait() generation that counted it (-1: none)
    cdef int nparts, left           # its parts; those not finished yet
    cdef object cut_short           # what stopped its submission, or a failed fsync
    cdef int64_t offset
    cdef uint64_t nbytes, done
    # the failed part with the lowest offset (e_at -1: none): its errno (0: end of file),
    # and the piece that failed
    cdef int64_t e_at, e_off
    cdef int e_err
    cdef uint64_t e_n

    cdef int note(self, Request rq) except -1:
        # a finished part: its bytes, and its error when it is the first by offset
        r = rq.r
        self.done += r.done
        if (r.err or r.eof) and (self.e_at < 0 or r.offset < self.e_at):
            self.e_at = r.offset
            self.e_err = r.err
            self.e_off = r.err_offset
            self.e_n = r.err_nbytes
        return 0

    cdef object exception(self):
        # the request's exception (naming all of it) from its noted parts, or None
        if self.e_at < 0:
            return None
        return failure(self.name, self.write, self.offset, self.nbytes, self.done, self.e_err,
                       self.e_off, self.e_n)


cdef extern from "<fcntl.h>":
    enum:
        O_ACCMODE
        O_RDONLY
        O_WRONLY
        O_APPEND


cdef int _plan(bint direct, uint64_t align, uint64_t mem_align, uint64_t addr, uint64_t n,
              int64_t off, object locked, object registry, uint64_t* edges,
              uint64_t* middle) except -1:
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
                            and registry.is_direct((addr + head, middle[0]))))):
        return M_DIRECT
    return M_BOUNCE


def plan(f, uint64_t address, uint64_t n, int64_t offset, locked, registry):
    """How the pieces of a contiguous host request run: ``(mode, edge bytes, middle bytes)``.

    Direct when the middle (between the unaligned edge blocks) may take direct I/O
    (``registry.is_direct``) and its memory lines up with the file's alignment; bounced
    otherwise; plain on a buffered file.
    ``locked``: whether direct I/O may use all of ``[address, address + n)``, or None (unknown:
    ``registry`` is asked); with edges, a False still asks about the middle alone.
    """
    cdef uint64_t edges, middle
    mode = _plan(f.direct, f.off_align, f.mem_align, address, n, offset, locked, registry,
                 &edges, &middle)
    return mode, edges, middle


cdef inline void _close_seq(object opened, set closed, object seq):
    """Submission number ``seq`` is over: off the front of ``opened`` (and whatever had
    finished behind it), or into ``closed`` until the ones before it are over."""
    if opened and opened[0] == seq:
        opened.popleft()
        while opened and opened[0] in closed:
            closed.remove(opened.popleft())
    else:
        closed.add(seq)


cdef inline tuple _batch_item(object general, item):
    # (buffer, file, offset) of one batch item: a tuple of two or three here, anything else
    # by Python's unpacking (its errors)
    if type(item) is tuple and 2 <= len(<tuple>item) <= 3:
        if len(<tuple>item) == 2:
            return ((<tuple>item)[0], (<tuple>item)[1], 0)
        return <tuple>item
    return general.unpack(item)


cdef int _drain_all(list subs) except -1:
    # cancel queue requests and wait for what of them is in flight (nothing writes their
    # memory afterwards)
    for rq in subs:
        (<Request>rq).cancel()
    for rq in subs:
        (<Request>rq).drain(False)
    return 0


# ---------------------------------------------------------------------------- the Core
@cython.auto_pickle(False)
cdef class Core:
    """The state every request of one :class:`~aioswap.AioHandle` shares, as C fields, and
    the methods that use it: its lanes, its open files, its ledger of asynchronous requests
    (submission numbers, waits, errors), its statistics, whether it is closed and how many
    requests are active.

    Fields change only while the GIL is held with no Python code run in between, or under
    ``lock``: a synchronous request counts itself in and out without the lock. ``close()``
    sets ``closed`` under the lock and then waits on ``idle`` until ``active`` is 0; the
    request that brings it to 0 on a closed Core notifies ``idle``.

    Parameters
    ----------
    lanes : list
        The handle's lanes (``queue``, ``ring``, ``thread``, ``start()``).
    block_size : int
        Bytes per piece, before each file's alignment.
    registry : PinnedRegistry
        Asked through ``engine_view()``, ``io_hold``, ``is_direct``.
    futures : tuple
        ``(class, new, finish, detach)`` of the future type (``aioswap._future.ENGINE``).
    general : object
        The handle's general path: ``request(h, ...)``, ``short_file(h, file, write)``,
        ``many_slow(h, ...)``, ``many_finish_slow(h, q)``,
        ``unpack(item)``.
    """
    cdef public bint closed
    cdef readonly Py_ssize_t active
    cdef public uint64_t direct_bytes, bounce_bytes, head_tail_bytes, buffered_bytes
    cdef public uint64_t read_bytes, write_bytes, reads, writes, async_ops, failed
    cdef readonly object lock, idle, files
    cdef readonly list lanes
    cdef readonly long generation
    cdef readonly uint64_t block_size
    cdef readonly long long seq, wait_gen
    cdef readonly Py_ssize_t unwaited
    cdef Py_ssize_t rr, sleepers    # sleepers: threads blocked in finished.wait()
    cdef object finished, opened
    cdef set closed_seqs
    cdef list errors, wait_targets
    cdef object registry, host, io_lock, allocated
    cdef object new_future, finish_future, detach_future, general

    def __init__(self, list lanes, uint64_t block_size, registry, tuple futures, general):
        self.lock = threading.Lock()
        self.idle = threading.Condition(self.lock)          # active reached 0 when closed
        self.finished = threading.Condition(self.lock)      # what a wait() waits for is over
        self.lanes = lanes
        # the handle's own files behind path and fd arguments, by (device, inode), least
        # recently used first (AioHandle._cached)
        self.files = collections.OrderedDict()
        self.generation = _fork_gen
        self.block_size = block_size
        # submission numbers of unfinished async requests, oldest first (finished ones are
        # popped from the left lazily): wait() covers everything below a number
        self.opened = collections.deque()
        self.closed_seqs = set()
        self.errors = []                    # tickets of failed requests wait() has not seen
        self.wait_targets = []              # the submission number each wait() waits below
        self.registry = registry
        self.host, self.io_lock, self.allocated = registry.engine_view()
        _, self.new_future, self.finish_future, self.detach_future = futures
        self.general = general

    # -- counts --------------------------------------------------------------------------
    cdef inline bint enter_(self) noexcept:
        if self.closed:
            return False
        self.active += 1
        return True

    cdef int leave_(self, Py_ssize_t n, bint locked) except -1:
        # count ``n`` requests out (``locked``: the caller holds the lock)
        self.active -= n
        if self.active == 0 and self.closed:
            # (close() sleeps at most _HELP_S at a time: a wake cut short by a signal
            # handler is not waited for)
            if locked:
                self.idle.notify_all()
            else:
                self.lock.acquire()
                try:
                    self.idle.notify_all()
                finally:
                    self.lock.release()
        return 0

    def enter(self):
        """Count a request in; False (nothing counted) when the handle is closed."""
        return self.enter_()

    def leave(self, bint locked=False):
        """Count a request out (``locked``: the caller holds :attr:`lock`)."""
        self.leave_(1, locked)

    cdef inline void _count_paths(self, int mode, uint64_t edges, uint64_t middle):
        if mode == M_DIRECT:
            self.direct_bytes += middle
        elif mode == M_BOUNCE:
            self.bounce_bytes += middle
        else:
            self.buffered_bytes += middle
        self.head_tail_bytes += edges

    cdef inline void _count_outcome(self, bint write, uint64_t done, bint failed):
        if failed:
            self.failed += 1
        elif write:
            self.write_bytes += done
            self.writes += 1
        else:
            self.read_bytes += done
            self.reads += 1

    def count_outcome(self, bint write, uint64_t done, bint failed):
        """One finished request."""
        self._count_outcome(write, done, failed)

    def count_path(self, str path, uint64_t n):
        """``n`` bytes moved by a device path (``"direct"``, ``"bounce"``, ...)."""
        setattr(self, path + "_bytes", getattr(self, path + "_bytes") + n)

    def counters(self):
        """The statistics, in :class:`~aioswap.handle.HandleStats` field order."""
        return (self.direct_bytes, self.bounce_bytes, self.head_tail_bytes,
                self.buffered_bytes, self.read_bytes, self.write_bytes, self.reads,
                self.writes, self.async_ops, self.failed)

    # -- planning ------------------------------------------------------------------------
    cdef uint64_t _piece(self, bint direct, uint64_t off_align, uint64_t mem_align):
        cdef uint64_t unit
        if not direct:
            return self.block_size
        unit = off_align if off_align >= mem_align else mem_align
        return unit if self.block_size < unit else self.block_size // unit * unit

    # -- requests ------------------------------------------------------------------------
    # Every request of a contiguous host buffer goes one way: its buffer resolved
    # (``_host_buffer`` here, ``aioswap._buffers.resolve`` on the general path), its file
    # found, then :meth:`_submit` builds its queue requests. The general path (the handle's
    # Python) explains refusals and stages what is not contiguous host memory, then comes
    # back through :meth:`submit`.
    def request(self, h, bint write, buffer, file, offset, nbytes, bint async_op, bint fsync):
        """``AioHandle.pread``/``pwrite`` (``h``): here when the buffer is contiguous host
        memory and nothing is wrong, else the handle's general path."""
        return self._request(h, write, buffer, file, offset, nbytes, async_op, fsync)

    cdef object _request(self, h, bint write, buffer, file, offset, nbytes, bint async_op,
                         bint fsync):
        cdef uint64_t addr, n
        if not _tensor_types:
            learn_torch()                   # torch imported since: its tensors come here
        if (type(offset) is int and 0 <= offset <= _OFF_MAX
                and (nbytes is None or type(nbytes) is int)):
            owner = _host_buffer(buffer, write, &addr, &n)
            if owner is not _SLOW and (nbytes is None or 0 <= nbytes <= n):
                if nbytes is not None:
                    n = nbytes
                if n:                       # (an empty request with fsync: an fsync alone)
                    out = self._on_file(h, write, addr, n, owner, file, offset, fsync,
                                        1 if async_op else 0, None)
                    if out is not _SLOW:
                        return out
        return self.general.request(h, write, buffer, file, offset, nbytes, async_op, fsync)

    cdef object _on_file(self, h, bint write, uint64_t addr, uint64_t n, owner, file,
                         int64_t offset, bint fsync, int how, list sink):
        # _submit on the file behind ``file``: an AioFile as it is, else the handle's own file
        # in one C call (its stat gives the size a read checks); on a miss (its first use:
        # an open follows) the general path's short_file asks once more, then opens it or
        # refuses the argument. _SLOW where the general path decides.
        cdef int64_t size = -1
        if type(file) is AioFile:
            f = file
        else:
            f = None
            if not self.closed and self.generation == _fork_gen:
                f = self._cached_hit(file, write, &size)
            if f is None:
                f = self.general.short_file(h, file, write)
                size = -1
        if f is None:
            return _SLOW
        try:
            return self._submit(write, addr, n, owner, <AioFile>f, offset, fsync, how, file,
                                sink, size, False, True, False)
        finally:
            if f is not file:
                (<AioFile>f).release()      # the request counted itself on the file

    def submit(self, bint write, uint64_t address, uint64_t nbytes, owner, AioFile f, offset,
               *, bint fsync=False, bint async_op=False, bint queue=False, arg=None,
               list sink=None, bint count=True, bint entered=False):
        """The request of ``nbytes`` bytes of contiguous host memory at ``address`` (kept
        valid by ``owner`` until the request is over) at ``offset`` of ``f``, for the
        general path once it has checked and staged what it was given: the bytes moved
        (sync), an :class:`IOFuture` (``async_op``) or, with ``queue``, a :class:`Ticket`
        of a queued sync request for :meth:`short_finish`. ``arg``: what the caller passed
        as the file (the future's name for it); ``sink``: a list each queue request is
        appended to as it is queued; ``count``: False leaves it out of the request counts
        (a part of a larger request); ``entered``: the caller counted a request in
        (:meth:`enter`) that this is part of, so it runs even once the handle is closing.
        Raises what makes it impossible (the handle or file closed, the access, the end of
        the file)."""
        if offset > _OFF_MAX:
            raise ValueError(f"file offset {offset} of {f.name} is beyond the largest one "
                             f"aioswap takes ({_OFF_MAX})")
        if nbytes == 0:
            raise ValueError(f"an empty request on {f.name} has nothing to submit")
        return self._submit(write, address, nbytes, owner, f, offset, fsync,
                            2 if queue else 1 if async_op else 0, f if arg is None else arg,
                            sink, -1, True, count, entered)

    def cached_hit(self, file, bint write):
        """The handle's own open file behind a path or fd argument, when it has one that
        takes the request (see ``AioHandle._cached``), pinned (counted as in use); None for
        anything else, which ``AioHandle._cached`` then opens or refuses with its error.

        One ``statx`` (path; fd: ``fcntl(F_GETFL)`` + ``statx``), without the timestamps
        (see _statlite.h), says which file the argument is now (device, inode) and, for an
        fd, whether its access mode allows the request.
        """
        cdef int64_t size
        return self._cached_hit(file, write, &size)

    cdef object _cached_hit(self, file, bint write, int64_t* size):
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
                return None                 # a bool, a float, ...: the general path refuses
            if b"\0" in path or stat_lite_at(AT_FDCWD, path, 0, &st) < 0:
                return None
        if not (S_ISREG(st.mode) or S_ISBLK(st.mode)):
            return None
        key = (st.dev, st.ino)
        self.lock.acquire()
        try:
            f = self.files.get(key)
            if (f is not None and (f.writable or not write)
                    and (<AioFile>f).pin()):   # pinned: unpinned by the request's end
                self.files.move_to_end(key)
                size[0] = -1 if S_ISBLK(st.mode) else st.size
                return f
        finally:
            self.lock.release()
        return None

    cdef object _refuse(self, bint explain, int why, AioFile f, bint write, int64_t off,
                        uint64_t n, int64_t size):
        # _SLOW (the general path then explains), or with ``explain`` the error itself
        if not explain:
            return _SLOW
        op = "write" if write else "read"
        if why == 1:
            if self.generation != _fork_gen:
                raise RuntimeError(f"{op} of {f.name}: this AioHandle cannot be used after "
                                   f"fork(); create a new AioHandle in the child")
            raise HandleClosedError(f"{op} of {f.name} on a closed AioHandle")
        if why == 2:
            raise ValueError(f"I/O on closed file {f.name}")
        if why == 3:
            raise PermissionError(f"{f.name} is not open for "
                                  f"{'writing' if write else 'reading'}")
        raise ShortReadError(
            f"read of {n} bytes at offset {off} from {f.name} goes past the end of the file "
            f"({size} bytes)", path=f.name, offset=off, nbytes=n, file_size=size)

    cdef object _submit(self, bint write, uint64_t addr, uint64_t n, owner, AioFile f,
                        int64_t off, bint fsync, int how, arg, list sink, int64_t known,
                        bint explain, bint count, bint entered):
        # The one place requests are built: ``n`` (> 0) bytes of contiguous host memory at
        # ``addr`` (``owner`` keeps it valid) at ``off`` of ``f``, in one lane's queue, or
        # cut across the lanes at piece boundaries when it is at least two pieces. ``how``
        # 0 runs it and returns the bytes moved, 1 returns its future, 2 queues it (sync)
        # and returns its Ticket (for short_finish). _SLOW where something is wrong and not
        # ``explain`` (else that error is raised). known: the file's size by a stat of this
        # request (cached_hit), else -1. fsync: the data and size durable before the
        # request completes. entered: part of a request counted in already (a closing
        # handle lets it run).
        cdef uint64_t piece, align, edges, middle, per, c, prev
        cdef int64_t size = -1
        cdef int mode, nparts = 1, i
        cdef bint locked, counted = False
        cdef AioQueue q
        cdef Ticket t = None
        cdef Request rq
        cdef stat_lite lst
        cdef Py_ssize_t nl, k
        cdef list cuts = None, use, subs
        if (self.closed and not entered) or self.generation != _fork_gen:
            return self._refuse(explain, 1, f, write, off, n, size)
        if f._closed:
            return self._refuse(explain, 2, f, write, off, n, size)
        if not (f.writable if write else f.readable):
            return self._refuse(explain, 3, f, write, off, n, size)
        piece = (f.piece if f._core is self
                 else self._piece(f.direct, f.off_align, f.mem_align))
        lanes = self.lanes
        nl = len(lanes)
        if nl > 1 and n >= 2 * piece:
            # cut across the lanes at file offsets that are multiples of the piece: no cut
            # is an unaligned edge
            per = (n + nl - 1) // nl
            cuts = [0]
            prev = 0
            for k in range(1, nl):
                c = (<uint64_t>off + k * per + piece - 1) // piece * piece - <uint64_t>off
                if prev < c < n:
                    cuts.append(c)
                    prev = c
            cuts.append(n)
            nparts = len(cuts) - 1
            use = lanes[:nparts]
        else:
            if nl > 1:
                self.rr = (self.rr + 1) % nl    # a hint: races are fine
                use = [lanes[self.rr]]
            else:
                use = lanes
        if not write:
            # the size now, not a remembered one: an O_DIRECT read past the end of a file
            # that another process truncated would zero-fill the destination past the data
            if known >= 0:
                size = known                # stat-ed by this request a moment ago
            elif f.block_device or stat_lite_fd(f._fd, &lst) < 0:
                size = f.size()             # (raises what the stat met)
            else:
                size = lst.size
            if off + <int64_t>n > size:
                return self._refuse(explain, 4, f, write, off, n, size)
        hold = _io_hold(self.registry, self.host, self.io_lock, self.allocated, addr, n,
                        &locked)
        try:
            align = f.off_align
            mode = _plan(f.direct, align, f.mem_align, addr, n, off, locked, self.registry,
                         &edges, &middle)
            for lane in use:
                if mode == M_BOUNCE or edges:   # direct and aligned: no ring to lock for it
                    ring = lane.ring
                    if not ring.attached:
                        ring.ensure()
                if how == 1 and lane.thread is None:
                    lane.start()
            if how or nparts > 1:
                t = Ticket.__new__(Ticket)
                t.core = self
                t.write = write
                t.file = f
                t.hold = hold
                t.name = f.name
                t.wgen = -1
                t.nparts = t.left = nparts
                t.offset = off
                t.nbytes = n
                t.e_at = -1
                t.fsync = fsync and write and nparts > 1
                t.count = count
                if how == 1:
                    t.fut = self.new_future("write" if write else "read", arg, n, off,
                                            (<object>use[0]).queue if nparts == 1 else None)
            if how != 1:
                # counted in without the lock: no Python code runs between the checks and
                # the counts (see Core)
                if (not self.closed or entered) and f.pin():
                    self.active += 1
                    counted = True
            else:
                self.lock.acquire()
                try:
                    if (not self.closed or entered) and f.pin():
                        self.active += 1
                        counted = True
                        t.seq = self.seq
                        self.opened.append(self.seq)
                        self.seq += 1
                        self.async_ops += 1
                finally:
                    self.lock.release()
            if counted:
                self._count_paths(mode, edges, middle)
        except BaseException:
            if hold is not None:
                _unhold(self.io_lock, hold)
            raise
        if not counted:
            if hold is not None:
                _unhold(self.io_lock, hold)
            return self._refuse(explain, 1 if self.closed else 2, f, write, off, n, size)
        if nparts == 1:
            q = (<object>use[0]).queue
            if how == 0:
                done = -1
                try:
                    done = q._run(f._fd, write, addr, n, off, mode, align, piece, f.state,
                                  fsync, f.name)
                finally:
                    # an error or an interruption (the queue drained the request first)
                    self._short_done(f, hold, write, max(done, 0), done < 0, count)
                return done
            try:
                rq = q._submit(f._fd, write, addr, n, off, mode, align, piece, f.state, fsync,
                               how == 2, t if how == 1 else None, f.name, owner, sink)
            except BaseException:
                self._not_submitted(t, how)
                raise
            if how == 1:
                return t.fut
            t.parts = [rq]
            return t
        # several parts, one per lane: each is fsync-ed with the others at the end
        subs = []
        try:
            for i in range(nparts):
                c = <uint64_t>cuts[i]
                (<AioQueue>(<object>use[i]).queue)._submit(
                    f._fd, write, addr + c, <uint64_t>cuts[i + 1] - c, off + <int64_t>c, mode,
                    align, piece, f.state, False, how != 1, t if how == 1 else None, f.name,
                    owner, subs)
                if sink is not None:
                    sink.append(subs[len(subs) - 1])
        except BaseException as exc:
            if how != 1 or not subs:
                _drain_all(subs)
                self._not_submitted(t, how)
                raise
            # some parts run: the request fails with this error once they are done
            self.lock.acquire()
            try:
                t.cut_short = exc
                t.left -= nparts - len(subs)
                last = t.left == 0
            finally:
                self.lock.release()
            if last:
                self._end_tickets([t])
            return t.fut
        if how == 1:
            return t.fut
        t.parts = subs
        if how == 2:
            return t
        return self._reap(t, False)

    cdef int _not_submitted(self, Ticket t, int how) except -1:
        # a request that never reached a queue is over: uncounted (its caller gets the error;
        # wait() neither counts nor raises it)
        if how == 1:
            self.lock.acquire()
            try:
                self._finished_locked(t, None, False)
            finally:
                self.lock.release()
        self._short_done(t.file, t.hold, t.write, 0, True, t.count)
        return 0

    cdef _short_done(self, AioFile f, hold, bint write, uint64_t done, bint failed,
                     bint count):
        # a sync request is over (failed: with an error the caller raises): uncount it on
        # the handle and the file
        last = f.unpin()
        if count:
            self._count_outcome(write, done, failed)
        self.leave_(1, False)
        if hold is not None:
            _unhold(self.io_lock, hold)
        if last:
            f._close_fd()

    cdef object _reap(self, Ticket t, bint drain):
        # wait for (``drain``: without looking at signals) the parts of a sync request, in
        # order; its bytes, or its error raised. A signal handler's exception stops the
        # wait: what is left is cancelled and drained first (nothing writes the caller's
        # memory afterwards).
        cdef Request rq
        cdef Py_ssize_t waited = 0
        cdef list parts = t.parts
        try:
            for item in parts:
                rq = <Request>item
                if drain:
                    rq.drain(False)
                else:
                    rq.wait(False)          # (the request's own error is raised below)
                waited += 1
        except BaseException:
            _drain_all(parts[waited + 1:])
            self._short_done(t.file, t.hold, t.write, 0, True, t.count)
            raise
        for item in parts:
            t.note(<Request>item)
        err = t.exception()
        if err is None and t.fsync:
            try:
                os.fsync((<AioFile>t.file)._fd)
            except OSError as e:
                err = e
        self._short_done(t.file, t.hold, t.write, t.done, err is not None, t.count)
        if err is not None:
            raise err
        return t.done

    def short_finish(self, Ticket t, bint drain=False):
        """Reap a queued sync request (``submit(queue=True)``, a batch item): its bytes, or
        its error raised (``drain``: without looking at signals)."""
        return self._reap(t, drain)

    def abandon(self, list queued, bint cancel=True):
        """Stop queued sync requests (an error or a signal ends a batch): cancelled (unless
        not ``cancel``), then each drained and finished; their errors are dropped. Items
        that are not tickets (the general path's, not started) are left alone."""
        if cancel:
            for q in queued:
                if type(q) is Ticket:
                    for rq in (<Ticket>q).parts:
                        (<Request>rq).cancel()
        for q in queued:
            if type(q) is Ticket:
                try:
                    self._reap(<Ticket>q, True)
                except Exception:
                    pass

    # -- batches -------------------------------------------------------------------------
    def many_async(self, h, bint write, requests, list futs):
        """``pread_many``/``pwrite_many`` with ``async_op=True``: each item's request
        submitted, its future appended to ``futs`` (the caller waits for those if this
        raises)."""
        for item in requests:
            buf, file, off = _batch_item(self.general, item)
            futs.append(self._request(h, write, buf, file, off, None, True, False))

    def many_queue(self, h, bint write, requests, list queued, list subs):
        """The queueing half of a sync ``pread_many``/``pwrite_many``: every ``(buffer,
        file[, offset])`` of ``requests`` queued in turn, each appended to ``queued`` as soon
        as it is queued (a :class:`Ticket`, else what the general path's ``many_slow`` made
        of it), so the caller can finish or abandon them if this raises. ``subs``: every
        queue request, as it is queued."""
        cdef uint64_t addr, n
        general = self.general
        if not _tensor_types:
            learn_torch()
        for item in requests:
            buf, file, off = _batch_item(general, item)
            if type(off) is int and 0 <= off <= _OFF_MAX:
                owner = _host_buffer(buf, write, &addr, &n)
                if owner is not _SLOW and n:
                    t = self._on_file(h, write, addr, n, owner, file, off, False, 2, subs)
                    if t is not _SLOW:
                        queued.append(t)
                        continue
            queued.append(general.many_slow(h, write, buf, file, off, subs))

    def many_finish(self, h, list queued):
        """The reaping half of a sync batch: the bytes moved per request, in order, and the
        first error met (``OSError``, ``ValueError``, ``EOFError``: the others still ran),
        or None. Anything else (a signal) abandons the rest and is raised."""
        cdef Py_ssize_t i, n = len(queued)
        out = [0] * n
        first = None
        for i in range(n):
            q = queued[i]
            try:
                if type(q) is Ticket:
                    out[i] = self._reap(<Ticket>q, False)
                else:
                    out[i] = self.general.many_finish_slow(h, q)
            except (OSError, ValueError, EOFError) as exc:
                if first is None:
                    first = exc
            except BaseException:
                self.abandon(queued[i + 1:])
                raise
        return out, first

    # -- the ledger of asynchronous requests -----------------------------------------------
    def open_async(self, fut):
        """An asynchronous request of the general path starts: its :class:`Ticket` (next
        submission number, counted in ``async_ops``)."""
        cdef Ticket t = Ticket.__new__(Ticket)
        t.fut = fut
        t.core = self
        t.wgen = -1
        self.lock.acquire()
        try:
            t.seq = self.seq
            self.opened.append(self.seq)
            self.seq += 1
            self.async_ops += 1
        finally:
            self.lock.release()
        return t

    cdef object _wake_waiters(self):
        # wake a sleeping waiter only when what it waits for is over (one wake per wait, not
        # one per finished request: each is a context switch). notify_all is Python code: a
        # signal handler that raises there (KeyboardInterrupt, when the main thread delivers
        # while it waits) is returned, for the caller to raise once its bookkeeping is done;
        # a wake it cut short costs a sleeper at most _HELP_S (waiters sleep that long).
        targets = self.wait_targets
        if self.sleepers and targets and (not self.opened or self.opened[0] >= min(targets)):
            try:
                self.finished.notify_all()
            except BaseException as exc:
                return exc
        return None

    cdef object _finished_locked(self, Ticket t, error, bint counted):
        # the ledger's part of a finished request; returns what _wake_waiters returns
        t.error = error
        if counted:
            self.unwaited += 1
            t.wgen = self.wait_gen
            if error is not None:
                t.kept = True
                self.errors.append(t)
        _close_seq(self.opened, self.closed_seqs, t.seq)
        return self._wake_waiters()

    def end(self, Ticket t, result, error, bint counted=True):
        """An asynchronous request of the general path is over (:attr:`lock` not held): into
        the ledger (``counted``: False for one that failed to be submitted, whose caller got
        the error: wait() neither counts nor raises it), then its future finished."""
        self.lock.acquire()
        try:
            late = self._finished_locked(t, error, counted)
        finally:
            self.lock.release()
        self.finish_future(t.fut, result, error, t.wgen, self if t.kept else None)
        if late is not None:
            raise late

    def complete(self, list items):
        """A lane's completion thread: a batch of finished queue requests of asynchronous
        requests. A request in one part is over with it; one cut across lanes with its last
        part (then fsync-ed once, when asked)."""
        cdef Request rq
        cdef Ticket t
        cdef list ended = [], parts = None
        for item in items:
            rq = <Request>item
            t = <Ticket>rq.token
            if t.nparts == 1:
                t.note(rq)
                ended.append(t)
            else:
                if parts is None:
                    parts = []
                parts.append(rq)
        if parts is not None:
            self.lock.acquire()
            try:
                whole = []
                for item in parts:
                    rq = <Request>item
                    t = <Ticket>rq.token
                    t.note(rq)
                    t.left -= 1
                    if t.left == 0:
                        whole.append(t)
            finally:
                self.lock.release()
            for item in whole:
                t = <Ticket>item
                if t.fsync and t.cut_short is None and t.e_at < 0:
                    try:
                        os.fsync((<AioFile>t.file)._fd)
                    except OSError as e:
                        t.cut_short = e
                ended.append(t)
        if ended:
            self._end_tickets(ended)

    cdef int _end_tickets(self, list ended) except -1:
        # asynchronous requests are over: into the ledger and the statistics (counters
        # updated once per batch, under one hold of the lock), their holds and files let
        # go, then their futures finished
        cdef Ticket t
        cdef AioFile f
        cdef Py_ssize_t n = len(ended)
        cdef uint64_t rbytes = 0, wbytes = 0
        cdef Py_ssize_t nreads = 0, nwrites = 0, nfailed = 0
        closing = []
        late = None
        self.lock.acquire()
        try:
            wait_gen = self.wait_gen
            opened = self.opened
            closed = self.closed_seqs
            for item in ended:
                t = <Ticket>item
                f = <AioFile>t.file
                if f.unpin():
                    closing.append(f)
                err = t.cut_short if t.cut_short is not None else t.exception()
                t.error = err
                t.wgen = wait_gen
                if err is not None:
                    nfailed += 1
                    t.kept = True
                    self.errors.append(t)
                elif t.write:
                    nwrites += 1
                    wbytes += t.done
                else:
                    nreads += 1
                    rbytes += t.done
                _close_seq(opened, closed, t.seq)
            self.unwaited += n
            if nreads:
                self.reads += nreads
                self.read_bytes += rbytes
            if nwrites:
                self.writes += nwrites
                self.write_bytes += wbytes
            if nfailed:
                self.failed += nfailed
            self.leave_(n, True)
            late = self._wake_waiters()
        finally:
            self.lock.release()
        _unhold_all(self.io_lock, [(<Ticket>item).hold for item in ended])
        finish = self.finish_future
        for item in ended:
            t = <Ticket>item
            try:
                finish(t.fut, t.done, t.error, t.wgen, self if t.kept else None)
            except Exception:               # a callback's error stays with it
                _log.exception("aioswap: completing a request failed")
            except BaseException as exc:    # a signal: raised once the batch is delivered
                late = exc
        for item in closing:
            (<AioFile>item)._close_fd()
        if late is not None:
            raise late
        return 0

    def wait(self, bint own_thread=False):
        """Finish every outstanding asynchronous request; how many there were (see
        ``AioHandle.wait``). ``own_thread``: the caller is one of the handle's completion
        threads (then waiting for anything is refused: it would wait for itself)."""
        cdef bint hurried = False, stand_by = False, helping
        cdef long long upto
        cdef Ticket first, o
        self.lock.acquire()
        try:
            if not self.opened and not self.unwaited:
                return 0
            if self.opened and own_thread:
                raise RuntimeError("wait() from a completion callback of the same handle "
                                   "would wait for itself; wait in another thread")
            upto = self.seq
            self.wait_targets.append(upto)
            # with one lane, this thread reaps and delivers while it waits (no thread to wake
            # per completion, no GIL to hand over); else the lanes' threads do, and notify
            helper = self.lanes[0].queue.help if len(self.lanes) == 1 else None
            try:
                while self.opened and self.opened[0] < upto:
                    if helper is not None and not stand_by:
                        self.lock.release()
                        try:
                            helping = helper(_HELP_S)
                        finally:
                            self.lock.acquire()
                        # nothing left in flight: the lane's thread delivers the rest; look
                        # again under the lock before waiting for its notification
                        stand_by = not helping
                        continue
                    if not hurried:         # nothing to gather batches for now
                        hurried = True
                        for lane in self.lanes:
                            lane.queue.hurry(1)
                    self.sleepers += 1
                    try:
                        self.finished.wait(_HELP_S)
                    finally:
                        self.sleepers -= 1
                    stand_by = False
            finally:
                self.wait_targets.remove(upto)
                if hurried:
                    for lane in self.lanes:
                        lane.queue.hurry(-1)
            n, errors = self.unwaited, self.errors
            self.unwaited, self.errors = 0, []
            self.wait_gen += 1
        finally:
            self.lock.release()
        if errors:
            first = <Ticket>errors[0]
            for item in errors:
                o = <Ticket>item
                o.kept = False
                self.detach_future(o.fut, -1)
                if o.seq < first.seq:
                    first = o
            raise first.error
        return n

    def forget(self, futs):
        """Uncount finished futures that wait() has not counted yet (a batch that raised);
        how many."""
        cdef Py_ssize_t n = 0
        self.lock.acquire()
        try:
            for fut in futs:
                if self.detach_future(fut, self.wait_gen):
                    self.unwaited -= 1
                    n += 1
                    self._drop_error(fut)
        finally:
            self.lock.release()
        return n

    def delivered(self, fut):
        """A failed future handed its error to the caller: wait() no longer raises it."""
        self.lock.acquire()
        try:
            self._drop_error(fut)
        finally:
            self.lock.release()

    cdef _drop_error(self, fut):
        cdef Ticket t
        cdef Py_ssize_t i
        for i in range(len(self.errors)):
            t = <Ticket>self.errors[i]
            if t.fut is fut:
                del self.errors[i]
                t.kept = False
                self.detach_future(fut, -1)
                return


def deliver(list batch):
    """A lane's completion thread: finish a batch of requests (their futures' callbacks run
    here): a handle's requests in one :meth:`Core.complete` per Core, the others through
    their token's ``part_done``."""
    cdef Request rq
    tickets = []
    late = None
    for item in batch:
        rq = <Request>item
        token = rq.token
        if type(token) is Ticket:
            tickets.append(rq)
            continue
        try:
            token.part_done(rq)
        except Exception:                   # never let one callback stop the lane
            _log.exception("aioswap: completing a request failed")
        except BaseException as exc:        # a signal: raised once the batch is delivered
            late = exc
    if tickets:
        try:
            (<Ticket>(<Request>tickets[0]).token).core.complete(tickets)
        except Exception:
            _log.exception("aioswap: completing requests failed")
        except BaseException as exc:
            late = exc
    if late is not None:
        raise late
