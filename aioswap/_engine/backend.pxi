# The backend seam (io_uring, kernel AIO, worker threads) and the submit/reap loop
# behind it.
# Part of aioswap/_aio.pyx (included there, one module).

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
