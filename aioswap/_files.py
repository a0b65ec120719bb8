"""Open files: one ``O_DIRECT`` descriptor per file, its alignment, the per-inode state.

An :class:`AioFile` pays ``open``/``fstat``/``statx`` once and is what every request runs on;
path and fd arguments of the handles are a convenience that makes a short-lived one per
request. Files are refused early when they cannot work: directories, FIFOs and sockets
(opened with ``O_NONBLOCK``, so a FIFO never blocks the caller), fds opened ``O_APPEND`` for
writing (a positional write would land at the end), fds without the needed access mode.
A file system that refuses ``O_DIRECT`` is served with buffered I/O.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import stat
import threading
import time
import weakref
from typing import Any, Callable, Union

from aioswap import _aio

_log = logging.getLogger("aioswap")

__all__ = ["IDLE_CLOSE_S", "AioFile", "FileArg", "PathLike", "Sweeper", "check_fd",
           "check_kind", "deleted", "describe", "sweeper"]

PathLike = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]"]
FileArg = Union[PathLike, int, "AioFile"]

#: Mode bits of files aioswap creates: user data is private unless asked otherwise.
DEFAULT_FILE_MODE = 0o600

_MODES = {
    "r": (os.O_RDONLY, True, False),
    "r+": (os.O_RDWR, True, True),
    "w": (os.O_RDWR | os.O_CREAT | os.O_TRUNC, True, True),
    "w+": (os.O_RDWR | os.O_CREAT | os.O_TRUNC, True, True),
    "x": (os.O_RDWR | os.O_CREAT | os.O_EXCL, True, True),
    "a+": (os.O_RDWR | os.O_CREAT, True, True),       # created if missing, never truncated
}


class _Inode:
    """What the process shares per (device, inode): the engine's FileState and alignment."""

    __slots__ = ("__weakref__", "mem_align", "off_align", "state")

    def __init__(self, mem_align: int, off_align: int) -> None:
        self.state = _aio.FileState()
        self.mem_align = mem_align
        self.off_align = off_align


_inodes: weakref.WeakValueDictionary[tuple[int, int], _Inode] = weakref.WeakValueDictionary()
_inodes_lock = threading.Lock()


def _inode(fd: int, st: os.stat_result, direct: bool) -> _Inode:
    key = (st.st_dev, st.st_ino)
    with _inodes_lock:
        rec = _inodes.get(key)
        if rec is None:
            mem, off = _aio.dio_alignment(fd) if direct else (1, 1)
            rec = _Inode(mem, off)
            rec.state.probe(fd)
            _inodes[key] = rec
        elif direct and rec.off_align == 1:
            # first seen on a buffered fd; this one is direct
            rec.mem_align, rec.off_align = _aio.dio_alignment(fd)
        return rec


def describe(file: Any) -> str:
    """How messages name a file argument."""
    if isinstance(file, AioFile):
        return file.name
    if isinstance(file, int):
        return f"fd {file}"
    return repr(os.fsdecode(file))


def check_kind(st: os.stat_result, name: str) -> None:
    if stat.S_ISDIR(st.st_mode):
        raise IsADirectoryError(errno.EISDIR, "is a directory", name)
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISBLK(st.st_mode)):
        raise OSError(errno.EINVAL, "not a regular file or block device (FIFOs, sockets and "
                                    "character devices cannot do positional I/O)", name)


#: A file opened once for many requests (see :class:`aioswap._aio.AioFile`): its state (closed,
#: requests in flight) is its own, in C.
AioFile = _aio.AioFile


def open_path(handle: object | None, path: PathLike, mode: str, *,
              perm: int = DEFAULT_FILE_MODE,
              on_buffered: Any = None, direct: bool = True,
              follow_symlinks: bool = True, core: _aio.Core | None = None) -> AioFile:
    """Open ``path`` (``mode`` as in :data:`_MODES`) with ``O_DIRECT`` when it works
    (and ``direct`` asks for it); ``follow_symlinks=False``: ``O_NOFOLLOW``, a symbolic link
    at ``path`` is refused."""
    try:
        flags, readable, writable = _MODES[mode]
    except KeyError:
        raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}") from None
    name = repr(os.fsdecode(path))
    # O_NONBLOCK: a FIFO in place of a data file must not block the open (it is refused
    # below); it changes nothing for regular files and block devices.
    base = flags | os.O_NONBLOCK | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        # a file system that refuses O_DIRECT: buffered I/O (O_TRUNC stays: the refused
        # open never got to truncating)
        fd, got = _aio.open_file(path, base, perm, direct=direct, fallback=True)
        refused, direct = direct and not got, got
    except IsADirectoryError:
        raise IsADirectoryError(errno.EISDIR, "is a directory", name) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise OSError(errno.ELOOP, "is a symbolic link; refusing to follow it",
                          name) from None
        raise
    try:
        st = os.fstat(fd)
        check_kind(st, name)
        fcntl.fcntl(fd, fcntl.F_SETFL, os.O_DIRECT if direct else 0)     # O_NONBLOCK off
        if refused and on_buffered is not None:
            on_buffered(name)
        inode = _inode(fd, st, direct)
        if flags & os.O_TRUNC:
            inode.state.forget_size()       # cut to 0: its next writes extend it again
        return AioFile(handle, fd, name, direct=direct, readable=readable,
                       writable=writable, st=st, inode=inode, core=core)
    except BaseException:
        os.close(fd)
        raise


def check_fd(fd: int, write: bool) -> tuple[int, os.stat_result]:
    """Whether a caller's ``fd`` allows the request (access mode, no ``O_APPEND`` for
    writes, a regular file or block device): its flags and ``fstat``."""
    name = f"fd {fd}"
    try:
        fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    except OSError as exc:
        raise OSError(exc.errno, f"{name} is not an open file descriptor") from None
    acc = fl & os.O_ACCMODE
    if write and acc == os.O_RDONLY:
        raise PermissionError(errno.EBADF, f"{name} is not open for writing")
    if not write and acc == os.O_WRONLY:
        raise PermissionError(errno.EBADF, f"{name} is not open for reading")
    if write and fl & os.O_APPEND:
        raise ValueError(f"{name} is open with O_APPEND: the kernel would put every write at "
                         f"the end of the file, not at its offset; open it without O_APPEND")
    st = os.fstat(fd)
    check_kind(st, name)
    return fl, st


def open_fd(handle: object | None, fd: int, write: bool, *,
            on_buffered: Any = None, direct: bool = True,
            checked: tuple[int, os.stat_result] | None = None,
            core: _aio.Core | None = None) -> AioFile:
    """An AioFile over a caller's fd with a descriptor of its own, so the caller may close
    ``fd`` while a request on it is queued (``checked``: :func:`check_fd`'s answer)."""
    name = f"fd {fd}"
    fl, st = check_fd(fd, write) if checked is None else checked
    acc = fl & os.O_ACCMODE
    has_direct = bool(fl & os.O_DIRECT)
    if direct and acc == os.O_WRONLY:
        # edge blocks of unaligned writes are read-modify-written: a write-only fd needs a
        # descriptor of our own that can read (when permissions allow; else buffered I/O)
        try:
            own = _aio.open_file(f"/proc/self/fd/{fd}", os.O_RDWR, 0)[0]
            acc = os.O_RDWR
        except OSError as exc:
            if exc.errno not in (errno.EACCES, errno.EPERM, errno.EINVAL):
                raise
            own = os.dup(fd)
            direct = False
            if exc.errno == errno.EINVAL and on_buffered is not None:
                on_buffered(name)
    elif has_direct == direct:
        own = os.dup(fd)
    else:
        # a descriptor of our own with the O_DIRECT we want (the caller's fd, its offset and
        # flags are untouched: F_SETFL on a dup would change them too)
        try:
            own = _aio.open_file(f"/proc/self/fd/{fd}", acc, 0, direct=direct)[0]
        except OSError as exc:       # DirectIOUnsupportedError is one, with EINVAL
            if exc.errno != errno.EINVAL or not direct:
                raise
            own = os.dup(fd)
            direct = False
            if on_buffered is not None:
                on_buffered(name)
    try:
        try:                        # a handle keeps it for other fds of the file: its path
            name = repr(os.readlink(f"/proc/self/fd/{own}"))
        except OSError:
            pass
        return AioFile(handle, own, name, direct=direct, readable=acc != os.O_WRONLY,
                       writable=acc != os.O_RDONLY, st=st, inode=_inode(own, st, direct),
                       core=core)
    except BaseException:
        os.close(own)
        raise


#: A descriptor that a handle keeps for path and fd arguments is closed once no request has
#: used it for this many seconds, or as soon as its file is deleted (so the space is freed
#: and the file system can be unmounted without waiting for the handle's next request).
IDLE_CLOSE_S = 5.0
_SWEEP_S = 1.0


class Sweeper:
    """One thread, alive while some handle keeps descriptors, that calls each such handle's
    sweep about once a second. A sweep gets the time (``time.monotonic()``) and returns
    whether the handle still keeps descriptors; a handle that returns False, or is garbage
    collected, is no longer called, until it is watched again. The thread ends when no
    handle is left (at once when the last one is forgotten)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._calls: dict[int, weakref.WeakMethod[Callable[[float], bool]]] = {}
        self._wake = threading.Event()
        self._thread: threading.Thread | None = None
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self._lock = threading.Lock()       # the thread stayed in the parent
        self._calls = {}
        self._thread = None

    def watch(self, sweep: Callable[[float], bool]) -> None:
        """Call ``sweep`` (a bound method: its object is held weakly) until it says False.

        No lock is held while objects are made or dropped here: the garbage collector may
        run a dropped handle's finalizer in this thread at any allocation, and that calls
        :meth:`forget` (a lock held here deadlocked it)."""
        key = id(sweep.__self__)    # type: ignore[attr-defined]
        old = self._calls.get(key)
        if old is not None and old() is not None:
            return
        ref = weakref.WeakMethod(sweep)
        self._calls[key] = ref          # one dict operation: atomic under the GIL
        with self._lock:
            if self._thread is not None:
                return
            self._wake.clear()
            t = threading.Thread(target=self._run, daemon=True, name="aioswap-files")
            self._thread = t
        t.start()

    def forget(self, owner: object) -> None:
        """Stop calling ``owner``'s sweep (it closed); the thread ends if it was the last.
        Takes no lock: it runs from finalizers (see :meth:`watch`)."""
        self._calls.pop(id(owner), None)
        if not self._calls:
            self._wake.set()

    def _run(self) -> None:
        while True:
            self._wake.wait(_SWEEP_S)
            with self._lock:
                self._wake.clear()
                if not self._calls:
                    self._thread = None
                    return
            now = time.monotonic()
            for key, ref in list(self._calls.items()):
                sweep = ref()
                try:
                    keep = sweep is not None and sweep(now)
                except Exception:           # never let one handle stop the others
                    _log.exception("aioswap: closing idle files failed")
                    keep = True
                del sweep
                if not keep and self._calls.get(key) is ref:
                    self._calls.pop(key, None)


#: The process's sweeper of idle descriptors.
sweeper = Sweeper()


def deleted(f: AioFile) -> bool:
    """Whether the file behind ``f`` is gone: deleted (no link left) or its fd unusable."""
    try:
        return os.fstat(f.fileno()).st_nlink == 0
    except (OSError, ValueError):           # ValueError: closed meanwhile
        return True
