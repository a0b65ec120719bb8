# Reaping: who waits, serves and helps, and how a waiter sleeps.
# Part of aioswap/_aio.pyx (included there, one module).

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
