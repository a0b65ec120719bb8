# Cutting requests into pieces and accounting their completions (no Python runs per
# piece).
# Part of aioswap/_aio.pyx (included there, one module).

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
