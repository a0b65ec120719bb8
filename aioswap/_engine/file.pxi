# AioFile: a file opened once for many requests.
# Part of aioswap/_aio.pyx (included there, one module).

# ------------------------------------------------------------------------------- files


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
    cdef object _handle, _core, _inode, _device
    cdef int _fd
    cdef bint _owned, _closed
    cdef object __weakref__

    def __cinit__(self):
        self._fd = -1
        self._closed = True             # until __init__ has run: nothing to close

    def __init__(self, handle, int fd, str name, *, bint direct, bint readable,
                 bint writable, st, inode, bint owned=True, Core core=None):
        if (handle is None) != (core is None):
            raise ValueError("an AioFile has a handle and its Core, or neither")
        self._handle = handle                   # what the general path is handed
        self._core = core
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
        self.piece = (core._piece(direct, self.off_align, self.mem_align) if core is not None
                      else 0)
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
        return (<Core>self._core)._request(self._handle, False, buffer, self, offset, nbytes,
                                             async_op, False)

    def pwrite(self, buffer, offset=0, *, nbytes=None, async_op=False, fsync=False):
        """Write ``buffer`` at ``offset`` (see :meth:`aioswap.AioHandle.pwrite`)."""
        if self._handle is None:
            raise ValueError(f"{self.name} has no handle to run requests on")
        return (<Core>self._core)._request(self._handle, True, buffer, self, offset, nbytes,
                                             async_op, fsync)

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
