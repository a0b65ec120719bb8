"""Striped files: one logical file over part files on several drives, each drive its own queue.

:func:`open_striped` (also ``AioHandle.open([p0, p1, ...], mode, stripe=...)``) returns a
:class:`StripedFile`: the face of an :class:`~aioswap.AioFile` (``pread``/``pwrite`` of any
buffer, size and offset, sync or ``async_op=True``; ``fsync``; ``close``) over one part file
per path. Each part's drive (its ``st_dev``) gets an :class:`~aioswap.AioHandle` of its own,
built from the opening handle's configuration (its own lanes, queue depth and completion
thread) and shared by the striped files of that handle open on the drive, so one drive's
backlog never holds back another's.

Layout (version 1)
------------------
The logical file is cut into stripe units of ``stripe_unit`` bytes. Unit ``k`` lives on part
``drive[k]`` at part offset ``slot[k] * stripe_unit``; a part's slots are handed out in the
order its units are allocated. A unit is allocated by the first write that touches it:

* units already allocated are rewritten where they are;
* new units wait in the file's queue (request order) and are dealt to the drives by smooth
  weighted round-robin, each drive weighted by its measured speed relative to the median
  drive's (in eighths; from 0.8 to 1.5 times that counts as equal, measurements jitter; a
  drive not measured yet counts as typical; parts on one device share it): equal drives
  take units strictly in turn (unit ``k`` to part ``k mod N`` for appends), a drive at half
  the speed of the others every other turn. So any run of
  consecutive units, not just the whole file, is spread in proportion to the drives' speeds,
  and a read of that run waits on no drive longer than on the others. Each drive holds at
  most ``window`` new pieces (``queue_depth * block_size / stripe_unit``, between 2 and 8);
  when the drive whose turn it is is full, the unit waits for it, unless another drive is
  idle (then that one takes it). Since the assignment is recorded, reads follow it. Parts
  are extended ahead of their writes (ext4 runs an extending O_DIRECT write synchronously)
  and trimmed on close;
* units inside the file that no write touched (holes) are unallocated and read as zeros.

Beside every part ``P`` lies ``P.stripe.json`` (mode 0600, plain JSON, no pickle)::

    {"format": "aioswap.stripe", "version": 1, "id": "<32 hex>", "part": i, "parts": N,
     "stripe_unit": S, "generation": g, "size": L, "stripes": A,
     "drives": "<base64 of zlib of A bytes: the part of each unit, 255 = unallocated>",
     "slots": null | "<base64 of zlib of A little-endian int64: the slot of each unit>"}

``slots`` is null when every unit's slot is its rank among the earlier units of its part
(what one sequential writer produces). Every part carries the whole layout; the copy with
the highest ``generation`` wins, so the parts may be given in any order on reopening (``part``
says which is which) and a crash between the sidecar updates loses nothing. The layout is
kept in memory and saved only by ``fsync=True`` writes, :meth:`fsync` and :meth:`close` (a
plain write costs no sidecar I/O); a saved layout holds only units whose writes finished.
A durable save fsyncs the parts written since their last fsync first, then replaces the
sidecars atomically (written, fsynced, renamed, the directory fsynced), so a durable layout
never points at data that is not; after a crash the file is the last saved state. The
logical size ``L`` is in the layout; a part whose last unit is only partly written is
extended (``fallocate``) so every byte below ``L`` reads.

Errors: a failing drive fails only the requests with a piece on it; the error is the one the
drive's handle raised, naming the part file (so the drive) with its offset and size.

Threads: a sync request on units already placed runs its pieces from the calling thread, and
an asynchronous one that falls inside one placed unit is the part's own request (its future
is the part's, naming the striped file and the logical offset). Only requests that place new
units, stage a strided buffer, grow the file or fsync go through the file's queue, with a
callback per piece run by the drive's completion thread.
"""
from __future__ import annotations

import base64
import errno
import json
import os
import stat
import threading
import time
import uuid
import zlib
from collections import deque
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from aioswap import _aio
from aioswap._buffers import resolve
from aioswap._files import DEFAULT_FILE_MODE, PathLike
from aioswap._staging import stage
from aioswap._util import first_error, flat_bytes, round_up, write_atomic
from aioswap.errors import HandleClosedError, ShortReadError
from aioswap.handle import AioFile, AioHandle, IOFuture, set_striped_opener

if TYPE_CHECKING:
    from typing_extensions import Self

__all__ = ["LAYOUT_FORMAT", "LAYOUT_SUFFIX", "LAYOUT_VERSION", "StripedFile", "default_stripe",
           "open_striped", "read_layout"]

#: ``format`` of the sidecar JSON; its ``version``; the suffix added to each part's path.
LAYOUT_FORMAT = "aioswap.stripe"
LAYOUT_VERSION = 1
LAYOUT_SUFFIX = ".stripe.json"

_NONE = 255                 # drive[k] of an unallocated unit
_MAX_PARTS = 254
_MIN_DEFAULT = 1 << 20      # default stripe unit: the block size, at least 1 MiB
_ALIGN = 4096
_AHEAD = 32 << 20           # parts are extended at least this far ahead of their writes
_DECAY = 63 / 64            # a drive's speed: its last ~64 pieces (see _settle)
_MODES = ("r", "r+", "w", "w+", "x", "a+")


def default_stripe(handle: AioHandle) -> int:
    """The stripe unit used when none is given: the handle's ``block_size`` (as tuned,
    ``AIOSWAP_BLOCK_SIZE`` or the ``"aio"`` section) rounded up to 4096, at least 1 MiB."""
    return max(round_up(handle.block_size, _ALIGN), _MIN_DEFAULT)


# -- per-drive handles ------------------------------------------------------------------------
_drive_lock = threading.Lock()
_drive_handles: dict[tuple[int, int], list[Any]] = {}     # (id(parent), st_dev) -> [h, users]


def _acquire_drive(parent: AioHandle, dev: int) -> AioHandle:
    key = (id(parent), dev)
    with _drive_lock:
        ent = _drive_handles.get(key)
        if ent is None or ent[0].closed:
            ent = [AioHandle.from_config(parent.config, backend=parent.backend), 0]
            _drive_handles[key] = ent
        ent[1] += 1
        h: AioHandle = ent[0]
        return h


def _release_drive(parent: AioHandle, dev: int) -> None:
    key = (id(parent), dev)
    with _drive_lock:
        ent = _drive_handles[key]
        ent[1] -= 1
        last = ent[1] == 0
        if last:
            del _drive_handles[key]
    if last:
        ent[0].close()


# -- the layout -------------------------------------------------------------------------------
def _sidecar(path: str) -> str:
    return path + LAYOUT_SUFFIX


def read_layout(path: PathLike, *, follow_symlinks: bool = True) -> dict[str, Any]:
    """The layout sidecar of part file ``path``, validated, with ``drives`` and ``slots``
    decoded to lists (``slots`` None when implied). ``follow_symlinks=False``: a sidecar that
    is a symbolic link is refused. A sidecar that is not a regular file (a FIFO...) is
    refused, never waited on."""
    name = os.fsdecode(path)
    side = _sidecar(name)
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | (0 if follow_symlinks
                                                         else os.O_NOFOLLOW)
    try:
        fd = os.open(side, flags)
    except FileNotFoundError:
        raise FileNotFoundError(errno.ENOENT, "no stripe layout beside the part file "
                                "(not a striped file, or not created yet)", side) from None
    except OSError as exc:
        if exc.errno == errno.ELOOP and not follow_symlinks:
            raise OSError(errno.ELOOP, "stripe layout is a symbolic link; refusing to follow "
                          "it", side) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, "stripe layout is not a regular file", side)
        with os.fdopen(fd, "rb", closefd=False) as f:
            doc = json.load(f)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{side!r}: not a stripe layout ({exc})") from None
    finally:
        os.close(fd)
    ok = (isinstance(doc, dict) and doc.get("format") == LAYOUT_FORMAT
          and all(type(doc.get(k)) is int and doc[k] >= 0
                  for k in ("part", "parts", "stripe_unit", "generation", "size", "stripes"))
          and isinstance(doc.get("id"), str) and isinstance(doc.get("drives"), str)
          and (doc.get("slots") is None or isinstance(doc.get("slots"), str)))
    if not ok:
        raise ValueError(f"{side!r}: not a stripe layout of format {LAYOUT_FORMAT!r}")
    if doc.get("version") != LAYOUT_VERSION:
        raise ValueError(f"{side!r}: stripe layout version {doc.get('version')!r}; this "
                         f"aioswap reads version {LAYOUT_VERSION}")
    try:
        drives = list(zlib.decompress(base64.b64decode(doc["drives"])))
        slots = None if doc["slots"] is None else np.frombuffer(
            zlib.decompress(base64.b64decode(doc["slots"])), "<i8").tolist()
    except (ValueError, zlib.error) as exc:
        raise ValueError(f"{side!r}: corrupt stripe map ({exc})") from None
    n = doc["stripes"]
    if (len(drives) != n or (slots is not None and len(slots) != n)
            or doc["part"] >= doc["parts"] or doc["stripe_unit"] == 0
            or any(d != _NONE and d >= doc["parts"] for d in drives)):
        raise ValueError(f"{side!r}: inconsistent stripe layout")
    doc["drives"], doc["slots"] = drives, slots
    out: dict[str, Any] = doc
    return out


def _distinct(names: list[str]) -> None:
    """Refuse two paths to one part: compared by the identity (device, inode) of their
    directories and their names, so a bind mount or a symbolic link to a directory (as
    containers make them) cannot give two parts one file."""
    seen: dict[object, str] = {}
    for p in names:
        d, base = os.path.split(p)
        try:
            st = os.stat(d or ".")
        except FileNotFoundError:
            key: object = os.path.realpath(p)       # the open then names the missing one
            where = ""
        else:
            key = (st.st_dev, st.st_ino, base)
            where = f" (one directory: device {st.st_dev}, inode {st.st_ino})"
        if key in seen:
            raise ValueError(f"the part paths must be distinct files: {seen[key]!r} and "
                             f"{p!r} are the same file{where}")
        seen[key] = p


def _ranks(drives: Sequence[int]) -> list[int]:
    """Each unit's rank among the earlier units of its part (-1 for unallocated)."""
    seen: dict[int, int] = {}
    out = []
    for d in drives:
        if d == _NONE:
            out.append(-1)
        else:
            r = seen.get(d, 0)
            out.append(r)
            seen[d] = r + 1
    return out


class _Piece:
    """One stripe unit's share of a request: unit, offset inside it, bytes, buffer offset
    (and, once sent, its offset in the part file)."""

    __slots__ = ("k", "inner", "length", "at", "off")

    def __init__(self, k: int, inner: int, length: int, at: int) -> None:
        self.k = k
        self.inner = inner
        self.length = length
        self.at = at
        self.off = -1


class _Op:
    """One striped request in flight: complete when every piece is over (sent and reaped, or
    dropped from the file's queue after an error)."""

    __slots__ = ("write", "flat", "offset", "n", "fsync", "after", "fut", "lock",
                 "outstanding", "errors", "failed", "new", "done", "error")

    def __init__(self, write: bool, flat: Any, offset: int, n: int, fsync: bool,
                 after: Callable[[], None] | None, fut: IOFuture | None, pieces: int) -> None:
        self.write = write
        self.flat = flat
        self.offset = offset
        self.n = n
        self.fsync = fsync
        self.after = after
        self.fut = fut
        self.lock = threading.Lock()
        self.outstanding = pieces + 1       # + a guard held until every piece is handed on
        self.errors: list[tuple[int, BaseException]] = []
        self.failed = False                 # no more of its queued pieces go out
        self.new: list[int] = []            # units it allocated: not in a saved layout yet
        self.done = threading.Event()
        self.error: BaseException | None = None

    def release(self) -> bool:
        """One piece (or the guard) is over; True for the last."""
        with self.lock:
            self.outstanding -= 1
            return self.outstanding == 0


class StripedFile:
    """One logical file over part files on several drives (see :func:`open_striped`).

    The face of an :class:`~aioswap.AioFile`: ``pread``/``pwrite`` take the handle's
    arguments without ``file`` (any buffer, size and offset; ``async_op=True`` returns an
    :class:`~aioswap.IOFuture`), plus ``fsync``, ``size``, ``truncate`` (growing only),
    ``wait`` and ``close``.

    Attributes
    ----------
    name : str
        ``"stripe[<part 0>, <part 1>, ...]"``, parts in layout order.
    paths : tuple of str
        The part files in layout order (part ``i`` is ``paths[i]``).
    stripe_unit : int
        Bytes per stripe unit.
    handles : tuple of AioHandle
        The drive handle of each part (parts on one device share one).
    id : str
        The layout's identity (32 hex digits), the same in every part's sidecar.
    """

    def __init__(self, handle: AioHandle, paths: Sequence[PathLike], mode: str = "r", *,
                 stripe: int | None = None, perm: int = DEFAULT_FILE_MODE,
                 follow_symlinks: bool = True) -> None:
        self._closed = True
        if mode not in _MODES:
            raise ValueError(f"mode must be one of {sorted(_MODES)}, got {mode!r}")
        if isinstance(paths, (str, bytes)) or not isinstance(paths, Sequence):
            raise TypeError("paths must be a list or tuple of paths, one per drive")
        names = [os.path.abspath(os.fsdecode(p)) for p in paths]
        if not 1 <= len(names) <= _MAX_PARTS:
            raise ValueError(f"a striped file has 1 to {_MAX_PARTS} parts, got {len(names)}")
        _distinct(names)
        if stripe is not None:
            stripe = int(stripe)
            if stripe <= 0 or stripe % _ALIGN:
                raise ValueError(f"stripe must be a positive multiple of {_ALIGN}, got {stripe}")
        if handle.closed:
            raise HandleClosedError("open of a striped file on a closed AioHandle")
        self._handle = handle
        self.readable = True
        self.writable = mode != "r"
        existing = [os.path.exists(_sidecar(p)) for p in names]
        if mode in ("r", "r+") or (mode == "a+" and all(existing)):
            names, doc = self._load(names, stripe, follow_symlinks)
        elif mode == "a+" and any(existing):
            missing = [p for p, e in zip(names, existing) if not e]
            raise FileExistsError(errno.EEXIST, "some parts have a stripe layout and some do "
                                  "not; give the full set of parts", missing[0])
        else:
            doc = None
        unit = doc["stripe_unit"] if doc is not None else \
            (stripe if stripe is not None else default_stripe(handle))
        self._unit: int = unit
        self.stripe_unit = unit
        self.paths = tuple(names)
        self.name = "stripe[" + ", ".join(repr(p) for p in names) + "]"
        self._perm = perm
        self._lock = threading.Lock()           # layout, counters, open ops
        self._idle = threading.Condition(self._lock)
        self._save_lock = threading.Lock()
        nparts = len(names)
        # the dispatcher (see _pump): pieces, bytes and seconds per byte of each drive
        self._busy = [0] * nparts
        self._inbytes = [0] * nparts
        self._acc_t = [0.0] * nparts            # decayed busy seconds and bytes (_settle):
        self._acc_b = [0.0] * nparts
        self._acc_n = [0.0] * nparts            # their ratio is the speed; and pieces
        self._since = [0.0] * nparts            # last completion (or start of a busy spell)
        self._credit = [0] * nparts             # smooth weighted round-robin (see _choose)
        self._queue: deque[tuple[_Op, _Piece]] = deque()     # new units waiting for a drive
        self._loose: deque[tuple[IOFuture, int, int, bool]] = deque()      # see _one
        self._pumping = threading.local()
        self._pending: set[int] = set()         # allocated by a write still in flight
        self._dirty = [False] * nparts          # written since the last fsync
        self._extent = [0] * nparts             # each part is at least this long
        self._reserved = [0] * nparts           # ... and is being extended to this
        self._ops = 0
        self._unwaited = 0
        self._errors: list[BaseException] = []
        self._saved_gen = 0
        self._saved_durable = True
        win = handle.queue_depth * handle.block_size // unit
        self._window = max(2, min(8, win))
        if doc is None:
            self.id = uuid.uuid4().hex
            self._gen = 0
            self._size = 0
            self._drive: list[int] = []
            self._slot: list[int] = []
        else:
            self.id = doc["id"]
            self._gen = doc["generation"]
            self._saved_gen = self._gen
            self._size = doc["size"]
            self._drive = doc["drives"]
            self._slot = doc["slots"] if doc["slots"] is not None else _ranks(self._drive)
        self._next = [0] * len(names)           # next free slot per part
        self._last = [-1] * len(names)          # the unit in each part's highest slot
        for k, (d, s) in enumerate(zip(self._drive, self._slot)):
            if d != _NONE and s >= self._next[d]:
                self._next[d], self._last[d] = s + 1, k
        self._files: list[AioFile] = []
        self._devs: list[int] = []
        hs: list[AioHandle] = []
        self.handles: tuple[AioHandle, ...] = ()
        try:
            fmode = {"w+": "w"}.get(mode, mode)
            for p in names:
                dev = os.stat(os.path.dirname(p) or ".").st_dev
                dh = _acquire_drive(handle, dev)
                self._devs.append(dev)
                hs.append(dh)
                self._files.append(dh.open(p, fmode, perm=perm,
                                           follow_symlinks=follow_symlinks))
            keys = {f.key: f.name for f in self._files}
            if len(keys) != len(self._files):
                raise ValueError(f"the part paths must be distinct files: two of {names} "
                                 f"are one file (a hard link)")
            for f in self._files:
                if unit % max(f.off_align, 1) or unit % max(f.mem_align, 1):
                    raise ValueError(f"stripe unit {unit} is not a multiple of the direct-I/O "
                                     f"alignment of {f.name} ({f.off_align})")
            self.handles = tuple(hs)
            # parts on one device share its speed (their own timings only split it)
            self._peers = [[j for j, e in enumerate(self._devs) if e == dev]
                           for dev in self._devs]
            self._extent = [_aio.fsize(f.fileno()) for f in self._files]
            self._reserved = list(self._extent)
            if doc is None:
                self._closed = False
                self._save(durable=True, force=True)
        except BaseException:
            self._closed = False
            self._close_parts()
            raise
        self._closed = False

    # -- opening --------------------------------------------------------------------------
    @staticmethod
    def _load(names: list[str], stripe: int | None,
              follow_symlinks: bool) -> tuple[list[str], dict[str, Any]]:
        docs = [read_layout(p, follow_symlinks=follow_symlinks) for p in names]
        first = docs[0]
        for p, doc in zip(names, docs):
            if doc["id"] != first["id"] or doc["parts"] != first["parts"]:
                raise ValueError(f"{_sidecar(p)!r} belongs to another striped file (layout "
                                 f"{doc['id']} of {doc['parts']} parts, not {first['id']} of "
                                 f"{first['parts']})")
            if doc["stripe_unit"] != first["stripe_unit"]:
                raise ValueError(f"{_sidecar(p)!r}: stripe unit differs from the other parts")
        if first["parts"] != len(names) or sorted(d["part"] for d in docs) != \
                list(range(len(names))):
            raise ValueError(f"the striped file {first['id']} has {first['parts']} parts; "
                             f"give each of them once (got {len(names)}: {names})")
        if stripe is not None and stripe != first["stripe_unit"]:
            raise ValueError(f"stripe={stripe} given, but the file was written with a stripe "
                             f"unit of {first['stripe_unit']}")
        order = sorted(range(len(names)), key=lambda i: docs[i]["part"])
        newest = max(docs, key=lambda d: d["generation"])
        return [names[i] for i in order], newest

    # -- layout ---------------------------------------------------------------------------
    def _allocate(self, k: int, d: int) -> tuple[int, int, bool]:
        """The part and slot of unit ``k``, giving it to part ``d`` if it has none yet (and
        then True); the caller holds ``_lock``."""
        drive = self._drive
        if k >= len(drive):
            grow = k + 1 - len(drive)
            drive.extend([_NONE] * grow)
            self._slot.extend([-1] * grow)
        if drive[k] != _NONE:
            return drive[k], self._slot[k], False
        drive[k] = d
        self._slot[k] = self._next[d]
        self._next[d] += 1
        self._last[d] = k
        self._pending.add(k)
        self._gen += 1
        return d, self._slot[k], True

    def _save(self, durable: bool, force: bool = False) -> None:
        """Write the layout beside every part when it changed (or ``force``).

        Only units whose writes have finished are in it (a unit still being written reads as
        a hole, as before that write). ``durable``: first the parts written since their last
        fsync are fsynced, so a durable layout never points at data that is not; then each
        sidecar is written, fsynced and renamed into place, and its directory fsynced.
        """
        with self._save_lock:
            with self._lock:
                gen = self._gen
                drive = list(self._drive)
                slot = list(self._slot)
                for k in self._pending:
                    drive[k], slot[k] = _NONE, -1
                size = self._size
                dirty = [i for i, x in enumerate(self._dirty) if x] if durable else []
                for i in dirty:
                    self._dirty[i] = False
            try:
                for i in dirty:
                    self._files[i].fsync()
            except BaseException:
                with self._lock:
                    for i in dirty:
                        self._dirty[i] = True
                raise
            if gen == self._saved_gen and (self._saved_durable or not durable) and not force:
                return
            implied = slot == _ranks(drive)
            body = {"format": LAYOUT_FORMAT, "version": LAYOUT_VERSION, "id": self.id,
                    "parts": len(self.paths), "stripe_unit": self._unit,
                    "generation": gen, "size": size, "stripes": len(drive),
                    "drives": base64.b64encode(zlib.compress(bytes(drive))).decode(),
                    "slots": None if implied else base64.b64encode(zlib.compress(
                        np.asarray(slot, "<i8").tobytes())).decode()}
            for i, p in enumerate(self.paths):
                # a temporary created exclusively (never through a planted link), removed on
                # an error (ENOSPC...); after a crash the swapper's next open removes it
                write_atomic(_sidecar(p), json.dumps(dict(body, part=i), sort_keys=True)
                             .encode(), self._perm, durable=durable)
            self._saved_gen = gen
            self._saved_durable = durable

    def _cover(self) -> None:
        """Extend each part so every finished unit's bytes below the logical size can be
        read; no system call while the parts are known to be long enough."""
        with self._lock:
            size, unit = self._size, self._unit
            needs = []
            for i, k in enumerate(self._last):
                if k < 0:
                    continue
                start = self._slot[k] * unit
                # a unit still being written extends its part itself; cover the ones below
                need = start if k in self._pending else \
                    start + min(unit, max(0, size - k * unit))
                if need > self._extent[i]:
                    needs.append((i, need))
        for i, need in needs:
            fd = self._files[i].fileno()
            have = _aio.fsize(fd)       # no times asked (see aioswap/_statlite.h)
            if have < need:
                os.posix_fallocate(fd, need - 1, 1)     # extends, never shrinks
            with self._lock:
                self._extent[i] = max(self._extent[i], have, need)

    # -- requests -------------------------------------------------------------------------
    def _check(self, what: str) -> None:
        if self._closed:
            raise ValueError(f"I/O on closed file {self.name}")
        if self._handle.closed:
            raise HandleClosedError(f"{what} of {self.name} on a closed AioHandle")

    def size(self) -> int:
        """The logical size in bytes."""
        return self._size

    def truncate(self, size: int) -> None:
        """Make the logical size ``size`` when that is larger: the bytes past the old end
        are a hole and read as zeros, and the size is saved with the layout as a write's
        end is. Shrinking is refused."""
        self._check("truncate")
        if not self.writable:
            raise PermissionError(f"{self.name} is not open for writing")
        if isinstance(size, bool) or not isinstance(size, int):
            raise TypeError(f"size must be an int, got {type(size).__name__}")
        with self._lock:
            if size < self._size:
                raise ValueError(f"truncate of {self.name} to {size} bytes: a striped file "
                                 f"does not shrink (it has {self._size})")
            if size == self._size:
                return
            self._size = size
            self._gen += 1
        self._cover()

    def pread(self, buffer: Any, offset: int = 0, *, nbytes: int | None = None,
              async_op: bool = False) -> int | IOFuture:
        """Read into ``buffer`` at logical ``offset`` (see :meth:`aioswap.AioHandle.pread`).

        Raises ShortReadError past the end (before any I/O); an error on one drive fails the
        request with that drive's error (naming its part file) once every piece finished.
        """
        return self._request(False, buffer, offset, nbytes, async_op, False)

    def pwrite(self, buffer: Any, offset: int = 0, *, nbytes: int | None = None,
               async_op: bool = False, fsync: bool = False) -> int | IOFuture:
        """Write ``buffer`` at logical ``offset`` (see :meth:`aioswap.AioHandle.pwrite`);
        ``fsync=True``: the parts and then the layout are durable when it completes."""
        if not self.writable:
            raise PermissionError(f"{self.name} is not open for writing")
        return self._request(True, buffer, offset, nbytes, async_op, fsync)

    def _flat(self, buffer: Any, write: bool, n: int | None,
              offset: int) -> tuple[Any, int, Callable[[], None] | None]:
        """A flat byte view of the buffer (or of a staged copy, copied back after a read)."""
        mem = resolve(buffer)
        count = mem.nbytes if n is None else int(n)
        op = "write" if write else "read"
        if count < 0 or count > mem.nbytes:
            raise ValueError(f"{op} of {count} bytes at offset {offset} of {self.name}: the "
                             f"buffer holds {mem.nbytes} bytes")
        if not write and not mem.writable:
            raise ValueError(f"read of {count} bytes from {self.name} into a read-only buffer "
                             f"({type(buffer).__name__})")
        after: Callable[[], None] | None = None
        data = mem.tensor if mem.tensor is not None else mem.array
        if not mem.contiguous:
            data, after = stage(mem, write, count)
        flat = flat_bytes(data) if mem.tensor is not None else data.reshape(-1).view(np.uint8)
        return flat, count, after

    def _request(self, write: bool, buffer: Any, offset: Any, nbytes: Any, async_op: bool,
                 fsync: bool) -> int | IOFuture:
        op = "write" if write else "read"
        self._check(op)
        if type(offset) is not int:
            if isinstance(offset, bool) or not hasattr(offset, "__index__"):
                raise TypeError(f"offset must be an integer, got {type(offset).__name__}")
            offset = offset.__index__()
        if offset < 0:
            raise ValueError(f"negative file offset {offset} for {self.name}")
        if nbytes is None and not fsync:
            out = self._one(write, buffer, offset, async_op)
            if out is not None:
                return out
        flat, n, after = self._flat(buffer, write, nbytes, offset)
        if not write and n and offset + n > self._size:
            raise ShortReadError(f"read of {n} bytes at offset {offset} from {self.name} goes "
                                 f"past the end of the file ({self._size} bytes)",
                                 path=self.name, offset=offset, nbytes=n,
                                 file_size=self._size)
        fixed: list[tuple[_Piece, int]] = []
        dyn: list[_Piece] = []
        unit = self._unit
        pos, at, end = offset, 0, offset + n
        with self._lock:
            drive, slots = self._drive, self._slot
            while pos < end:
                k, inner = divmod(pos, unit)
                length = min(unit - inner, end - pos)
                p = _Piece(k, inner, length, at)
                d = drive[k] if k < len(drive) else _NONE
                if d != _NONE:
                    p.off = slots[k] * unit + inner
                    fixed.append((p, d))
                elif write:
                    dyn.append(p)
                else:
                    flat[at:at + length] = 0        # a hole reads as zeros
                pos += length
                at += length
            # placed units only, nothing to do after the I/O: no _Op, no callback
            plain = not dyn and after is None and not fsync and \
                (not write or offset + n <= self._size)
            self._ops += 1
            if plain and async_op and len(fixed) == 1 and fixed[0][0].length == n:
                if self._loose:
                    self._sweep_locked()
            else:
                now = time.monotonic()
                for p, d in fixed:
                    self._take(d, p.length, write, now)
                if not plain or async_op:
                    plain = False
                    fut = IOFuture(op, self.name, n, offset) if async_op else None
                    o = _Op(write, flat, offset, n, fsync, after, fut, len(fixed) + len(dyn))
                    self._queue.extend((o, p) for p in dyn)
        if plain:
            if async_op:
                p, d = fixed[0]
                return self._send_one(write, flat[p.at:p.at + p.length], offset, p.length, d,
                                      p.off, True)
            return self._inline(write, flat, n, fixed)
        try:
            sent = 0
            try:
                for p, d in fixed:
                    sent += 1                       # _send accounts for it, even raising
                    self._send(o, p, d)
            except BaseException as exc:
                with o.lock:
                    o.failed = True
                for p, d in fixed[sent:]:
                    self._piece_done(o, d, p, exc)
                raise
            finally:
                self._pump()
                self._release(o)
        except BaseException:
            o.done.wait()           # the kernel may still write the buffer: drain first
            raise
        if fut is not None:
            return fut
        try:
            o.done.wait()
        except BaseException:
            o.done.wait()
            raise
        if o.error is not None:
            raise o.error
        return n

    # -- the dispatcher -------------------------------------------------------------------
    # Pieces of units already placed go to their drive at once. New units wait in the file's
    # queue (in request order) and are dealt to the drives by smooth weighted round-robin:
    # each drive's weight is its measured speed relative to the median drive's (see
    # _weights), so equal drives take units strictly in turn and a drive at half speed every
    # other turn. Any run of consecutive units is then spread over the drives in proportion
    # to their speeds, which is what a later read of that run needs (reads follow the
    # layout); an earlier rule, "the drive expected to be free first", balanced the whole
    # file but left runs of units uneven (one drive held 5 of 16 units, and reads of them
    # waited on it). A drive holds at most `_window` pieces; when the one whose turn it is is
    # full, the unit waits for it, unless another drive is idle.
    def _take(self, d: int, length: int, write: bool, now: float) -> None:
        """Count a piece in flight on drive ``d`` (the caller holds ``_lock``)."""
        if self._busy[d] == 0:
            self._since[d] = now
        self._busy[d] += 1
        self._inbytes[d] += length
        if write:
            self._dirty[d] = True

    def _weights(self) -> list[int]:
        """Each part's share of new units, in eighths of a typical drive's (1..16).

        A drive's speed is its measured bytes per second; parts on one device are one drive
        (their timings averaged, their share split evenly: timed apart, the part that
        happened to hold fewer units looked slower, got fewer still, and one part of four on
        a disk ended up with 40% of them). Speeds are taken relative to the median drive's,
        and a drive from 0.8 to 1.5 times as fast as that counts as equal: four equal drives
        capped at 315 MB/s each measured 2.2 to 3.4 ns per byte in one run (a throttled
        drive that was idle a moment serves a burst fast), and weights that follow such
        noise leave some drives more units than others. A drive at half speed gets 4, one at
        twice the speed 16. A drive counts as measured once about six of its pieces have
        ended (the first pieces of a throttled drive may ride a burst allowance; a 16-unit
        file had one drive take 5 of its units) and as typical until then.
        """
        t, b = self._acc_t, self._acc_b
        n = len(t)
        dev: list[float] = []               # seconds per byte of each part's device
        for d in range(n):
            seen = [t[j] / b[j] or 1e-12 for j in self._peers[d] if self._acc_n[j] >= 6.0]
            dev.append(sum(seen) / len(seen) if seen else 0.0)
        known = sorted(s for s in dev if s > 0.0)
        if not known:
            return [8] * n
        ref = known[len(known) // 2]
        out = []
        for s in dev:
            r = 1.0 if s == 0.0 else ref / s
            out.append(8 if 0.8 <= r <= 1.5 else max(1, min(16, round(8 * r))))
        return out

    def _choose(self, k: int) -> int:
        """The drive for new unit ``k``, or -1 to wait (the caller holds ``_lock``).

        Smooth weighted round-robin over :meth:`_weights`: every turn each part earns its
        weight in credit, the part with the most credit takes the unit and pays the total
        back (ties: unit ``k`` to part ``k mod N``, so equal drives take appends in turn).
        When that part is full, an idle part takes it, else the unit waits (-1). The credits
        change only when the unit is taken.
        """
        n = len(self._busy)
        w = self._weights()
        credit = self._credit
        busy = self._busy
        best = max(range(n), key=lambda d: (credit[d] + w[d], -((d - k) % n)))
        if busy[best] >= self._window:
            # its turn, but full: an idle drive takes the unit instead (its weight is wrong,
            # e.g. measured while its file was being extended; only work corrects that)
            idle = [d for d in range(n) if busy[d] == 0]
            if not idle:
                return -1
            best = max(idle, key=lambda d: (credit[d] + w[d], -((d - k) % n)))
        for d in range(n):
            credit[d] += w[d]
        credit[best] -= sum(w)
        return best

    def _pump(self) -> None:
        """Hand queued new units to drives while the best drive has room (any thread)."""
        tls = self._pumping
        if getattr(tls, "on", False):
            return                  # a send failed at once inside this thread's own loop
        tls.on = True
        try:
            while True:
                drop: list[_Op] = []
                item: tuple[_Op, _Piece, int] | None = None
                grow: tuple[int, int] | None = None
                with self._lock:
                    q = self._queue
                    while q and q[0][0].failed:
                        drop.append(q.popleft()[0])
                    if q:
                        o, p = q[0]
                        d = self._choose(p.k)
                        if d >= 0:
                            q.popleft()
                            d, slot, new = self._allocate(p.k, d)
                            p.off = slot * self._unit + p.inner
                            self._take(d, p.length, True, time.monotonic())
                            if new:
                                o.new.append(p.k)
                            item = (o, p, d)
                            grow = self._grow(d, slot)
                for o in drop:
                    self._release(o)
                if item is not None:
                    if grow:
                        self._extend(item[2], grow)
                    self._send(*item)
                elif not drop:
                    return
        finally:
            tls.on = False

    def _grow(self, d: int, slot: int) -> tuple[int, int] | None:
        """The range to add to part ``d`` before slot ``slot`` is written, if any (the caller
        holds ``_lock``). ext4 runs an O_DIRECT write that extends its file synchronously
        inside io_submit, so appending parts would take one write per drive at a time;
        allocated ahead (and trimmed on close), the writes stay asynchronous."""
        end = (slot + 1) * self._unit
        have = self._reserved[d]
        if end <= have:
            return None
        ahead = max(self._unit * self._window * 4, _AHEAD)
        self._reserved[d] = end + ahead - self._unit
        return have, self._reserved[d] - have

    def _extend(self, d: int, grow: tuple[int, int]) -> None:
        try:
            os.posix_fallocate(self._files[d].fileno(), grow[0], grow[1])
            done = True
        except OSError:
            done = False            # only a speed-up: the writes extend the part themselves
        with self._lock:
            if done:
                self._extent[d] = max(self._extent[d], grow[0] + grow[1])
            if self._busy[d] == 1:
                # only the piece waiting for this: its drive time starts now (the first
                # extension of a part took 28 ms here, and counted as the piece's, made
                # the drive look 100 times slower than it is)
                self._since[d] = time.monotonic()

    def _trim(self) -> None:
        """Cut what was allocated ahead past each part's last unit (on close)."""
        with self._lock:
            size, unit = self._size, self._unit
            cuts = []
            for i, k in enumerate(self._last):
                need = 0 if k < 0 else self._slot[k] * unit + min(unit, max(0, size - k * unit))
                if self._reserved[i] > need:
                    cuts.append((i, need))
        for i, need in cuts:
            fd = self._files[i].fileno()
            try:
                if _aio.fsize(fd) > need:
                    os.ftruncate(fd, need)
            except OSError:
                pass                # a failing drive: its part keeps the slack

    def _send(self, o: _Op, p: _Piece, d: int) -> None:
        view = o.flat[p.at:p.at + p.length]
        f = self._files[d]
        try:
            fut = f.pwrite(view, p.off, async_op=True) if o.write else \
                f.pread(view, p.off, async_op=True)
            assert isinstance(fut, IOFuture)
        except BaseException as exc:
            self._piece_done(o, d, p, exc)
            if not isinstance(exc, Exception):
                raise
            return
        fut.add_done_callback(lambda fu: self._piece_done(o, d, p, fu.exception()))

    def _inline(self, write: bool, flat: Any, n: int, pieces: list[tuple[_Piece, int]]) -> int:
        """A sync request on placed units only, run by the calling thread (counted in by the
        caller): one piece as one sync request on its part, several sent at once and
        waited for here. No future callback, so no other thread runs for it: handing each
        piece to the drives' completion threads and back cost two thread wake-ups per
        request (150-200 us of CPU per 4 KiB request here, against ~5 through one file)."""
        ok: list[bool] = [False] * len(pieces)
        over = [False] * len(pieces)
        errors: list[tuple[int, BaseException]] = []
        sent: list[tuple[int, IOFuture]] = []
        try:
            for i, (p, d) in enumerate(pieces):
                f = self._files[d]
                view = flat[p.at:p.at + p.length]
                try:
                    if len(pieces) == 1:
                        f.pwrite(view, p.off) if write else f.pread(view, p.off)
                        ok[i] = over[i] = True
                    else:
                        fu = f.pwrite(view, p.off, async_op=True) if write else \
                            f.pread(view, p.off, async_op=True)
                        assert isinstance(fu, IOFuture)
                        sent.append((i, fu))
                except Exception as exc:
                    errors.append((p.at, exc))
                    over[i] = True
            for i, fu in sent:
                err = fu.exception()            # waits
                if err is not None:
                    errors.append((pieces[i][0].at, err))
                ok[i] = err is None
                over[i] = True
        except BaseException:
            first_error(fu for i, fu in sent if not over[i])    # the kernel may still
            raise                                               # write the buffer
        finally:
            now = time.monotonic()
            with self._lock:
                for (p, d), good in zip(pieces, ok):
                    self._settle(d, p, write, good, now)
                self._op_over()
            if self._queue:
                self._pump()                    # a drive has room again for queued units
        if errors:
            raise min(errors, key=lambda e: e[0])[1]
        return n

    def _one(self, write: bool, buffer: Any, offset: int, async_op: bool
             ) -> int | IOFuture | None:
        """The common small request: a whole buffer inside one placed unit, below the end
        of the file. It is the part's own request on the caller's buffer (the part file
        checks the buffer, stages a strided or CUDA one, and names itself in errors), run
        from the calling thread, or, asynchronous, with the part's future as the request's
        (it names the striped file and the logical offset) and no callback: a callback is
        run by the drive's completion thread, which then has to be woken for each request.
        The file settles such futures later, in request order: each new one looks at the
        oldest, ``fsync`` at the finished ones, ``wait``/``close`` wait for all. The
        dispatcher does not count these requests (it could not learn when they end); they
        are reads and rewrites of units already placed. None: the general path decides."""
        n = getattr(buffer, "nbytes", None)
        if type(n) is not int:
            if type(buffer) is bytearray or (write and type(buffer) is bytes):
                n = len(buffer)
            else:
                return None
        unit = self._unit
        k, inner = divmod(offset, unit)
        if not 0 < n <= unit - inner or offset + n > self._size:
            return None         # (a read past the end raises, a write that grows the file
        with self._lock:        # changes the layout: both in the general path)
            drive = self._drive
            d = drive[k] if k < len(drive) else _NONE
            if d == _NONE:
                return None
            off = self._slot[k] * unit + inner
            self._ops += 1
            if self._loose:
                self._sweep_locked()
        return self._send_one(write, buffer, offset, n, d, off, async_op)

    def _send_one(self, write: bool, buffer: Any, offset: int, n: int, d: int, off: int,
                  async_op: bool) -> int | IOFuture:
        """Run (or, async, submit) a one-piece request on part ``d`` at part offset ``off``
        (counted in ``_ops`` by the caller; see :meth:`_one`)."""
        f = self._files[d]
        try:
            if async_op:
                fu = f.pwrite(buffer, off, async_op=True) if write else \
                    f.pread(buffer, off, async_op=True)
                assert isinstance(fu, IOFuture)
            elif write:
                f.pwrite(buffer, off)
            else:
                f.pread(buffer, off)
        except BaseException:
            with self._lock:
                if write:
                    self._dirty[d] = True
                self._op_over()
            raise
        if not async_op:
            with self._lock:
                if write:
                    self._dirty[d] = True
                    self._extent[d] = max(self._extent[d], off + n)
                self._op_over()
            return n
        assert isinstance(fu, IOFuture)
        fu.file = self.name                     # the request as the caller made it
        fu.offset = offset
        with self._lock:
            if write:
                self._dirty[d] = True
            self._loose.append((fu, d, off + n, write))
            self._idle.notify_all()             # a wait() that found none: settle this one
        return fu

    def _op_over(self) -> None:
        """A request of this file is over (the caller holds ``_lock``): wake ``wait``/``close``
        when it was the last."""
        self._ops -= 1
        if not self._ops:
            self._idle.notify_all()

    def _sweep_locked(self) -> None:
        """Settle the loose requests at the front that are over (the caller holds _lock)."""
        loose = self._loose
        while loose and loose[0][0].done():
            fu, d, end, write = loose.popleft()
            exc = fu.exception()
            if write:
                self._dirty[d] = True           # (again: an fsync may have run meanwhile)
                if exc is None:
                    self._extent[d] = max(self._extent[d], end)
            self._unwaited += 1
            if exc is not None:
                self._errors.append(exc)
            self._op_over()

    def _sweep(self) -> None:
        """Wait for every loose request and settle it."""
        while True:
            with self._lock:
                self._sweep_locked()
                if not self._loose:
                    return
                fu = self._loose[0][0]
            first_error([fu])

    def _quiesce(self) -> None:
        """Wait until no request of this file is in flight. Loose requests (see :meth:`_one`)
        end only when someone settles them, so this settles them as they come: one sent by
        another thread after this looked wakes it (``_send_one``)."""
        while True:
            self._sweep()
            with self._lock:
                if not self._ops:
                    return
                if not self._loose:
                    self._idle.wait()

    def _settle(self, d: int, p: _Piece, write: bool, ok: bool, now: float) -> None:
        """Piece ``p`` on drive ``d`` is over (the caller holds ``_lock``)."""
        self._busy[d] -= 1
        self._inbytes[d] -= p.length
        if ok:
            # the drive was busy since _since[d]: this piece took that long of its time. Its
            # speed is the busy time over the bytes of its last ~64 pieces (a ratio of sums:
            # pieces that end together take 0 s each after the first, which an average of
            # per-piece ratios turned into a speed that swung with every batch)
            self._acc_t[d] = self._acc_t[d] * _DECAY + (now - self._since[d])
            self._acc_b[d] = self._acc_b[d] * _DECAY + max(p.length, _ALIGN)
            self._acc_n[d] = self._acc_n[d] * _DECAY + 1
            if write:
                self._extent[d] = max(self._extent[d], p.off + p.length)
        if write:
            self._dirty[d] = True   # again: an fsync that ran while it was in flight missed it
        self._since[d] = now

    def _piece_done(self, o: _Op, d: int, p: _Piece, exc: BaseException | None) -> None:
        now = time.monotonic()
        with self._lock:
            self._settle(d, p, o.write, exc is None, now)
        if exc is not None:
            with o.lock:
                o.errors.append((p.at, exc))
                o.failed = True             # the request fails: hand out no more units
        self._pump()
        self._release(o)

    def _release(self, o: _Op) -> None:
        if o.release():
            self._finish(o)

    def _finish(self, o: _Op) -> None:
        """Every piece of ``o`` is over: layout, copy-back, result (any thread)."""
        error: BaseException | None = None
        if o.errors:
            error = min(o.errors, key=lambda e: e[0])[1]
        try:
            if o.write:
                with self._lock:
                    changed = bool(o.new)
                    self._pending.difference_update(o.new)
                    if error is None and o.offset + o.n > self._size:
                        self._size = o.offset + o.n
                        changed = True
                    if changed:
                        self._gen += 1
                if changed:
                    self._cover()
                if o.fsync and error is None:
                    self._save(durable=True)
            elif o.after is not None and error is None:
                o.after()
        except Exception as exc:
            if error is None:
                error = exc
        o.error = error
        fut = o.fut
        with self._lock:
            if fut is not None:
                self._unwaited += 1
                if error is not None:
                    self._errors.append(error)
            self._op_over()
        o.done.set()
        if fut is not None:
            if error is None:
                fut.set_result(o.n)
            else:
                fut.set_exception(error)

    # -- the rest of a file's face --------------------------------------------------------
    def wait(self) -> int:
        """Finish every asynchronous request of this file; how many finished since the last
        ``wait()``; then raise the first error among them."""
        self._quiesce()
        with self._lock:
            n, errors = self._unwaited, self._errors
            self._unwaited, self._errors = 0, []
        if errors:
            raise errors[0]
        return n

    def fsync(self) -> None:
        """Make the data written so far and the layout durable."""
        self._check("fsync")
        with self._lock:
            self._sweep_locked()                # loose writes that finished: dirty parts
        self._save(durable=True)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Wait for the requests in flight, save the layout, close the parts. Idempotent."""
        if self._closed:
            return
        self._quiesce()
        try:
            if self.writable:
                self._trim()
                self._save(durable=False)
        finally:
            self._close_parts()

    def _close_parts(self) -> None:
        self._closed = True
        files, self._files = self._files, []
        devs, self._devs = self._devs, []
        for f in files:
            f.close()
        for dev in devs:
            _release_drive(self._handle, dev)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{self._size} bytes"
        return f"<StripedFile {self.name} unit {self._unit} {state}>"


def open_striped(handle: AioHandle, paths: Sequence[PathLike], mode: str = "r", *,
                 stripe: int | None = None, perm: int = DEFAULT_FILE_MODE,
                 follow_symlinks: bool = True) -> StripedFile:
    """Open one logical file striped over ``paths`` (one part file per drive).

    Parameters
    ----------
    handle : AioHandle
        Its configuration (block size, queue depth, lanes, backend) is what each drive's own
        handle gets; it must stay open while the file is.
    paths : list or tuple of path
        One part file per drive. Reopening takes the parts in any order.
    mode : {"r", "r+", "w", "w+", "x", "a+"}
        As :meth:`aioswap.AioHandle.open`; ``"w"``/``"x"`` start a new layout, ``"a+"`` reopens
        an existing one or starts a new one.
    stripe : int, optional
        Bytes per stripe unit for a new file, a multiple of 4096 and of the drives' direct-I/O
        alignment; default :func:`default_stripe`. Reopening uses the recorded one.
    perm : int
        Mode bits of created parts and sidecars (0o600).
    follow_symlinks : bool
        False: a part or layout sidecar that is a symbolic link is refused (``O_NOFOLLOW``),
        never followed. Two paths to one part (the same directory through a bind mount or a
        link, or a hard link) are always refused.

    Returns
    -------
    StripedFile
    """
    return StripedFile(handle, paths, mode, stripe=stripe, perm=perm,
                       follow_symlinks=follow_symlinks)


set_striped_opener(open_striped)
