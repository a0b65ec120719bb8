# System calls and probes: errno checks and hints, the one O_DIRECT opener (open_file), the
# file's DIO alignment, the statx-lite stat of a path or fd.
# Part of aioswap/_aio.pyx (included there, one module).

cdef int _check(long ret, int err, str what, object path=None, str hint="") except -1:
    """The one checker of the engine's system calls, called right after each one.

    ``ret < 0`` (the raw syscall's -1) raises ``OSError(err, ...)`` naming the call; Python
    picks the subclass (FileNotFoundError, PermissionError...) from ``err``.
    """
    if ret >= 0:
        return 0
    raise OSError(err, f"{what} failed: {os.strerror(err)}{hint}", path)

#: The direct-I/O alignment every Linux file system that supports O_DIRECT accepts: what
#: dio_alignment() answers when statx cannot say, and what aioswap's own file layouts use.
DEFAULT_ALIGNMENT = 4096
#: Most pieces one AioQueue keeps in flight (io_setup takes an unsigned int, but the
#: kernel's aio-max-nr default is 65536).
MAX_DEPTH = 65535


cdef bint _noted = False


cdef void _note_once(str text):
    """Say once per process (the ``aioswap`` logger, INFO) that the engine runs slower than it
    could; the library never prints."""
    global _noted
    if not _noted:
        _noted = True
        logging.getLogger("aioswap").info("aioswap engine: %s", text)


cdef str _uring_hint(int e, int depth):
    if e == EINVAL and depth > 32768:
        return " (an io_uring holds at most 32768 entries: a smaller queue_depth, or kernel AIO)"
    if e == EPERM:
        try:
            with open("/proc/sys/kernel/io_uring_disabled") as f:
                v = f.read().strip()
        except OSError:
            v = "?"
        if v != "0":
            return f" (kernel.io_uring_disabled={v})"
        return " (a seccomp profile, e.g. a container's, refuses io_uring)"
    if e == ENOSYS:
        return " (the kernel has no io_uring)"
    return ""


cdef str _aio_limits_hint(int e):
    if e != EAGAIN:
        return ""
    try:
        with open("/proc/sys/fs/aio-nr") as f:
            nr = f.read().strip()
        with open("/proc/sys/fs/aio-max-nr") as f:
            mx = f.read().strip()
    except OSError:
        return ""
    return f" (fs.aio-nr={nr} of fs.aio-max-nr={mx}; raise it with sysctl fs.aio-max-nr)"


def open_file(path, int flags, int mode, *, bint direct=True, bint fallback=False):
    """Open ``path`` with ``flags`` (``O_CLOEXEC`` added) and, where ``direct`` asks for it,
    ``O_DIRECT``: the one opener of files for direct I/O. Returns ``(fd, direct)``, whether
    the fd has ``O_DIRECT``.

    A file system that refuses ``O_DIRECT`` (EINVAL at open): with ``fallback`` the file is
    opened without it (and without ``O_EXCL``: the kernel checks ``O_DIRECT`` after creating
    the file, so the refused open may have created it, and nobody else could have);
    otherwise a file this call created is removed again and DirectIOUnsupportedError is
    raised (IsADirectoryError for a directory, where ``O_DIRECT`` is EINVAL on any file
    system).
    """
    flags |= os.O_CLOEXEC
    if not direct:
        return os.open(path, flags, mode), False
    existed = os.path.lexists(path) if flags & os.O_CREAT else True
    try:
        return os.open(path, flags | os.O_DIRECT, mode), True
    except OSError as exc:
        if exc.errno != EINVAL:
            raise
    if fallback:
        return os.open(path, flags & ~os.O_EXCL, mode), False
    if os.path.isdir(path):
        raise IsADirectoryError(EISDIR, "is a directory", os.fsdecode(path))
    if not existed:
        try:
            os.unlink(path)
        except OSError:
            pass
    raise DirectIOUnsupportedError(
        EINVAL, f"the file system refuses O_DIRECT for {os.fsdecode(path)!r}",
        os.fsdecode(path))


def open_direct(path, *, bint write=False, bint create=False, bint truncate=False,
                int mode=0o644):
    """Open ``path`` with ``O_DIRECT``; return the fd.

    Raises
    ------
    DirectIOUnsupportedError
        The file system refuses ``O_DIRECT`` (EINVAL at open). A file this call created is
        removed again.
    FileNotFoundError, IsADirectoryError, PermissionError
        As ``os.open`` raises them.
    """
    flags = ((os.O_RDWR if write else os.O_RDONLY) | (os.O_CREAT if create else 0)
             | (os.O_TRUNC if truncate else 0))
    return open_file(path, flags, mode)[0]


def dio_alignment(file):
    """Return ``(memory_alignment, offset_alignment)`` for direct I/O on ``file``.

    ``file`` is a path or an open fd. The values come from ``statx(STATX_DIOALIGN)``
    (Linux 6.1+); where the kernel or file system does not report them, 4096 is returned
    for both, which every Linux file system that supports ``O_DIRECT`` accepts.
    """
    cdef abi.statx_buf st
    cdef long ret
    cdef int dirfd, flags, e
    cdef bytes bpath
    memset(&st, 0, sizeof(st))
    if isinstance(file, int):
        dirfd = file
        bpath = b""
        flags = abi.AT_EMPTY_PATH
    else:
        dirfd = abi.AT_FDCWD
        bpath = os.fsencode(file)
        flags = 0
    cdef const char* cpath = bpath
    with nogil:
        ret = abi.syscall(abi.SYS_statx, dirfd, cpath, flags,
                          <unsigned int>abi.STATX_DIOALIGN, &st)
        e = errno
    if ret < 0 and e == ENOSYS:
        return (DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT)
    _check(ret, e, "statx", None if isinstance(file, int) else os.fsdecode(file))
    if (st.stx_mask & abi.STATX_DIOALIGN) and st.stx_dio_mem_align and st.stx_dio_offset_align:
        return (int(st.stx_dio_mem_align), int(st.stx_dio_offset_align))
    return (DEFAULT_ALIGNMENT, DEFAULT_ALIGNMENT)


PAGE_SIZE = os.sysconf("SC_PAGE_SIZE")


cdef extern from "_statlite.h" nogil:
    ctypedef struct stat_lite:
        unsigned mode
        uint64_t dev
        uint64_t ino
        int64_t size
        uint64_t nlink
    int stat_lite_at(int dirfd, const char* path, int flags, stat_lite* out)
    int stat_lite_fd(int fd, stat_lite* out)
    int AT_FDCWD
    int statlite_nostatx_


cdef extern from "<sys/stat.h>" nogil:
    bint S_ISREG(int mode)
    bint S_ISBLK(int mode)


def _statlite_fallback(bint on):
    """Tests only: ask ``fstatat`` instead of ``statx`` (as where statx is refused); returns
    the previous setting."""
    global statlite_nostatx_
    old = bool(statlite_nostatx_)
    statlite_nostatx_ = 1 if on else 0
    return old


def fsize(int fd):
    """The size of the file behind ``fd`` (``statx`` without the times: see _statlite.h),
    without building a ``stat_result`` (a read asks it each time)."""
    cdef stat_lite st
    cdef int ret = stat_lite_fd(fd, &st)   # the GIL stays: no I/O
    if ret < 0:
        raise OSError(errno, os.strerror(errno))
    return st.size


def stat_lite_of(file):
    """``(st_mode, st_dev, st_ino, st_size, st_nlink)`` of an fd or a path (followed), as
    ``os.stat`` gives them, but asked without the timestamps, so that the query does not make
    the next write to the file stamp (and dirty) its inode (see _statlite.h). Raises
    ``OSError`` as ``os.stat`` does."""
    cdef stat_lite st
    cdef int ret
    cdef bytes path
    if type(file) is int:
        ret = stat_lite_fd(<int>file, &st)
    else:
        path = os.fsencode(file)
        if b"\0" in path:
            raise ValueError("embedded null byte")
        ret = stat_lite_at(AT_FDCWD, path, 0, &st)
    if ret < 0:
        raise OSError(errno, os.strerror(errno), file if not isinstance(file, int) else None)
    return (st.mode, st.dev, st.ino, st.size, st.nlink)
