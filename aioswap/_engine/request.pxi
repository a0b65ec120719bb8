# The file's shared state, the request object and the one errno -> exception
# checker.
# Part of aioswap/_aio.pyx (included there, one module).

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
