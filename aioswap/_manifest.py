"""The swap directory and its manifest: lock, created-marker, orphans, entries, group commit.

``SwapDirectory`` owns the directory: it creates it (mode 0700 by default) or finds it, locks
it (``flock`` on ``aioswap.lock``), marks a directory it created (``aioswap-created``), creates
data files (``O_EXCL|O_NOFOLLOW``, mode 0600 by default) and opens them for reading without
ever following a symlink or blocking on a FIFO, and deals with files no manifest accounts for.

``Manifest`` owns ``aioswap-manifest.json``: it parses versions 1 and 2 (every field checked:
a bad one raises ``SwapError``), keeps the published entries, and publishes changes with a
group commit (one atomic manifest write for every change staged while the previous write
ran). A data file is deleted once no published entry names it any more (per-file reference
counting) and only after the manifest that dropped it is durable.
"""
from __future__ import annotations

import concurrent.futures
import errno
import json
import logging
import os
import re
import stat
import threading
import warnings
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aioswap import _owner
from aioswap._units import shape_fits
from aioswap._util import fsync_dir, is_atomic_tmp, write_atomic
from aioswap.errors import SwapError
from aioswap.stripe import LAYOUT_SUFFIX as STRIPE_SUFFIX

__all__ = ["LOCK_NAME", "MANIFEST_NAME", "ORPHANS_DIR", "Entry", "Manifest", "SwapDirectory",
           "Tree", "is_data_file"]

_log = logging.getLogger("aioswap")

#: File name of the manifest inside a swap directory.
MANIFEST_NAME = "aioswap-manifest.json"
MANIFEST_TMP = MANIFEST_NAME + ".tmp"
LOCK_NAME = "aioswap.lock"
CREATED_NAME = "aioswap-created"
#: Subdirectory that receives data files found in a directory without a manifest.
ORPHANS_DIR = "orphans"
FORMAT = "aioswap-swap"
VERSION = 2
READABLE_VERSIONS = (1, 2)
# t-<sha256 of the name, 32 hex>-<random>.bin: one tensor (swap_out, and every version-1 file)
# p-<random, 32 hex>.bin: a pack of several tensors (swap_out_state_dict, version 2)
_DATA_RE = re.compile(r"t-[0-9a-f]{32}-[0-9a-f]{16}\.bin|p-[0-9a-f]{32}\.bin")
_PACK_RE = re.compile(r"p-[0-9a-f]{32}\.bin")


def is_data_file(fname: str) -> bool:
    """Whether ``fname`` has the name of an aioswap data file (single tensor or pack)."""
    return _DATA_RE.fullmatch(fname) is not None


def is_pack_file(fname: str) -> bool:
    """Whether ``fname`` has the name of a pack file."""
    return _PACK_RE.fullmatch(fname) is not None


def _dir_mode(mode: int) -> int:
    """The mode of a created directory for file mode ``mode``: x wherever r or w is set."""
    d = mode & 0o777
    for shift in (6, 3, 0):
        if (d >> shift) & 0o6:
            d |= 1 << shift
    return d


def _exists_at(dir_fd: int, name: str) -> bool:
    """Whether ``name`` exists in the directory open as ``dir_fd`` (a link counts)."""
    try:
        os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return True


def _prefer_direct(fd: int) -> None:
    """Add O_DIRECT to ``fd`` where the file system allows it, and drop O_NONBLOCK.

    The handle then only dup's the fd per request (a descriptor without O_DIRECT is reopened
    through /proc for each); O_NONBLOCK was only there to open a FIFO without blocking.
    """
    import fcntl
    fl = fcntl.fcntl(fd, fcntl.F_GETFL)
    try:
        fcntl.fcntl(fd, fcntl.F_SETFL, (fl & ~os.O_NONBLOCK) | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:       # EINVAL: no O_DIRECT here (tmpfs...)
            raise
        fcntl.fcntl(fd, fcntl.F_SETFL, fl & ~os.O_NONBLOCK)


# ----------------------------------------------------------------------------------------
# Entries


def _nonneg_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclass(frozen=True)
class Entry:
    """One published swap, as the manifest stores it."""

    name: str
    file: str
    offset: int
    nbytes: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    checksum: str | None
    checksum_algo: str | None
    seq: int

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.file, "offset": self.offset,
                "nbytes": self.nbytes, "dtype": self.dtype, "shape": list(self.shape),
                "stride": list(self.stride), "storage_offset": self.storage_offset,
                "checksum": self.checksum, "checksum_algo": self.checksum_algo,
                "seq": self.seq}

    @classmethod
    def from_json(cls, d: Any, where: str) -> Entry:
        """Parse one entry; any malformed field raises :class:`SwapError`."""
        def bad(what: str) -> SwapError:
            return SwapError(f"{where}: malformed manifest entry ({what}): {d!r:.200}")

        if not isinstance(d, dict):
            raise bad("not an object")
        try:
            name, file, dtype = d["name"], d["file"], d["dtype"]
            ints = [d["offset"], d["nbytes"], d["storage_offset"], d["seq"]]
            shape, stride = d["shape"], d["stride"]
            checksum, algo = d["checksum"], d["checksum_algo"]
        except KeyError as exc:
            raise bad(f"missing {exc.args[0]!r}") from None
        if not isinstance(name, str) or not isinstance(dtype, str):
            raise bad("name and dtype must be strings")
        if not isinstance(file, str) or not is_data_file(file):
            raise bad("file is not a swap data file name")   # never follow other paths
        if not isinstance(shape, list) or not isinstance(stride, list):
            raise bad("shape and stride must be lists")
        if len(shape) != len(stride):
            raise bad("shape and stride must have the same length")
        if not all(_nonneg_int(v) for v in ints + shape + stride):
            raise bad("offsets, sizes, shape and stride must be integers >= 0")
        if not shape_fits(shape) or not all(v < 1 << 63 for v in ints + stride):
            raise bad("shape, stride or sizes too large for any tensor (2**63 elements)")
        if (checksum is None) != (algo is None) or not (
                checksum is None or (isinstance(checksum, str) and isinstance(algo, str))):
            raise bad("checksum and checksum_algo must be strings or both null")
        return cls(name, file, ints[0], ints[1], dtype, tuple(shape), tuple(stride), ints[2],
                   checksum, algo, ints[3])


# ----------------------------------------------------------------------------------------
# The directory


class SwapDirectory:
    """The locked directories of one swapper: creation, markers, owners, data files, orphans.

    ``paths``: the directories as given, one per drive. The one that holds the manifest (the
    *primary*, :attr:`path`) is found by the owner records (:mod:`aioswap._owner`), whatever
    the order; the others (:attr:`extra`) hold the other parts of striped data files (the
    manifest, the marker and unstriped files are in the primary). Every directory is checked
    to be a distinct directory (device and inode: two paths to one directory, as a bind
    mount makes, are refused), locked, and owned by this swapper's set, before anything in
    any of them is written or removed.
    """

    def __init__(self, paths: list[str], mode: int) -> None:
        self.mode = mode
        self.dir_fd = -1
        self._lock_fd = -1
        self._extra_locks: list[int] = []
        self._reap_lock = threading.Lock()
        self._reaper: concurrent.futures.ThreadPoolExecutor | None = None
        self._reaping: list[concurrent.futures.Future[Any]] = []
        self.path = paths[0]
        self.extra: list[str] = []
        self.extra_created: list[str] = []
        self.created = False
        self.set_id = ""
        self._claimed: set[str] = set()     # directories without an owner record before
        fds: list[int] = []
        locks: list[int] = []
        made: list[bool] = []
        try:
            ids: dict[tuple[int, int], str] = {}
            for d in paths:
                made.append(self._make(d))
                fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                fds.append(fd)
                st = os.fstat(fd)
                key = (st.st_dev, st.st_ino)
                if key in ids:
                    raise ValueError(f"the swap directories must be distinct: {ids[key]!r} "
                                     f"and {d!r} are the same directory (device "
                                     f"{st.st_dev}, inode {st.st_ino})")
                ids[key] = d
            for d in paths:
                locks.append(self._lock_at(d))
            for d, m in zip(paths, made):
                if m:
                    self._mark_created(d)
            found = []
            for d, fd in zip(paths, fds):
                st = os.fstat(fd)
                found.append(_owner.Found(d, st.st_dev, st.st_ino, _owner.read_owner(fd, d),
                                          _exists_at(fd, MANIFEST_NAME)))
            plan = _owner.arrange(found)
            for i, rec in plan.writes:
                _owner.write_owner(paths[i], rec, mode)
        except BaseException:
            for fd in fds + locks:
                os.close(fd)
            for d, m in zip(paths, made):
                if m:                   # refused: no trace of a directory this call made
                    for n in (CREATED_NAME, LOCK_NAME):
                        try:
                            os.unlink(os.path.join(d, n))
                        except FileNotFoundError:
                            pass
                    try:
                        os.rmdir(d)
                    except OSError:
                        pass
            raise
        p = plan.order[0]
        self.set_id = plan.set
        self.path = paths[p]
        self.dir_fd = fds[p]
        self._lock_fd = locks[p]
        self.created = made[p] or os.path.exists(os.path.join(self.path, CREATED_NAME))
        self._claimed = {paths[i] for i in plan.claimed if i != p}
        for i in plan.order[1:]:
            self.extra.append(paths[i])
            self._extra_locks.append(locks[i])
            os.close(fds[i])
            if made[i] or os.path.exists(os.path.join(paths[i], CREATED_NAME)):
                self.extra_created.append(paths[i])

    def _make(self, d: str) -> bool:
        """Create directory ``d`` (with parents, mode from :attr:`mode` exactly) when it is
        missing; whether this call created it."""
        if os.path.isdir(d):
            return False
        try:
            os.makedirs(d, mode=_dir_mode(self.mode))
        except FileExistsError:
            if not os.path.isdir(d):
                raise NotADirectoryError(f"swap directory {d!r} exists and is not a "
                                         f"directory") from None
            return False
        os.chmod(d, _dir_mode(self.mode))       # exact, whatever the umask
        return True

    def _mark_created(self, d: str) -> None:
        """Leave the marker that says aioswap created directory ``d``, durably."""
        fd = os.open(os.path.join(d, CREATED_NAME),
                     os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     self.mode)
        try:
            os.fchmod(fd, self.mode)
            os.write(fd, b"created by aioswap.TensorSwapper; destroy() removes this "
                         b"directory\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        fsync_dir(d)
        fsync_dir(os.path.dirname(d))

    @property
    def striped(self) -> bool:
        """Whether new data files are striped over several directories."""
        return bool(self.extra)

    def _lock_at(self, path: str) -> int:
        import fcntl
        fd = os.open(os.path.join(path, LOCK_NAME),
                     os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, self.mode)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            finally:
                os.close(fd)
            who = (f"another TensorSwapper of this process (pid {holder})"
                   if holder == str(os.getpid()) else f"another TensorSwapper (pid {holder})")
            raise SwapError(f"swap directory {path!r} is in use by {who}; close it "
                            f"first") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd

    def parts(self, fname: str) -> list[str]:
        """The part files of a new striped data file ``fname``: one per directory, ``path``'s
        first."""
        return [os.path.join(d, fname) for d in [self.path, *self.extra]]

    def parts_of(self, fname: str) -> list[str]:
        """The part files of the existing striped data file ``fname``: those of the
        directories that hold a layout of it (its layout says which part each is, so the
        order of the directories, and directories added since, do not matter)."""
        return [os.path.join(d, fname) for d in [self.path, *self.extra]
                if os.path.lexists(os.path.join(d, fname + STRIPE_SUFFIX))]

    def is_striped(self, fname: str) -> bool:
        """Whether ``fname`` was written striped (its layout lies beside it)."""
        return os.path.exists(self.join(fname) + STRIPE_SUFFIX)

    def unlink_later(self, fnames: list[str]) -> None:
        """Unlink files no manifest needs any more, on a background thread.

        Freeing a large file's blocks takes the file system a while (tens of ms per GB); the
        swap that made it obsolete is durable already, so it need not wait. A crash before
        the unlink leaves an orphan that the next open removes. :meth:`drain` waits.
        """
        if not fnames:
            return
        with self._reap_lock:
            if self._reaper is None:
                self._reaper = concurrent.futures.ThreadPoolExecutor(
                    1, thread_name_prefix="aioswap-swap-unlink")
            self._reaping.append(self._reaper.submit(self._unlink_all, list(fnames)))
            self._reaping = [f for f in self._reaping if not f.done()]

    def _unlink_all(self, fnames: list[str]) -> None:
        for f in fnames:
            self.unlink(f)

    def drain(self) -> None:
        """Wait for the background unlinks."""
        with self._reap_lock:
            pending, self._reaping = self._reaping, []
        concurrent.futures.wait(pending)

    def close(self) -> None:
        """Finish background unlinks, unlock (closing the lock fd releases the flock) and close
        the directory."""
        with self._reap_lock:
            reaper, self._reaper = self._reaper, None
        if reaper is not None:
            reaper.shutdown(wait=True)
        self._reaping = []
        for attr in ("_lock_fd", "dir_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                setattr(self, attr, -1)
                os.close(fd)
        locks, self._extra_locks = self._extra_locks, []
        for fd in locks:
            os.close(fd)

    def join(self, fname: str) -> str:
        return os.path.join(self.path, fname)

    def create(self, fname: str) -> int:
        """Create ``fname`` exclusively (never through a symlink), with exactly ``mode``."""
        fd = os.open(self.join(fname),
                     os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                     self.mode)
        try:
            os.fchmod(fd, self.mode)
        except BaseException:
            os.close(fd)
            raise
        return fd

    def create_data(self, stem: str) -> tuple[str, int]:
        """A new data file ``<stem><random>.bin``; returns its name and an O_RDWR fd.

        The fd has ``O_DIRECT`` where the file system allows it, so the handle's requests on
        it only ``dup`` it instead of reopening the file each.
        """
        while True:
            fname = f"{stem}{os.urandom(16 if stem == 'p-' else 8).hex()}.bin"
            try:
                fd = self.create(fname)
            except FileExistsError:     # pragma: no cover - 64+ random bits
                continue
            _prefer_direct(fd)
            return fname, fd

    def open_data(self, fname: str, who: str) -> tuple[int, int]:
        """Open a data file for reading; returns (fd, size).

        ``O_NOFOLLOW``: a symlink planted in place of a data file is refused, never followed;
        ``O_NONBLOCK``: a FIFO there cannot block the open, and is refused as not a regular
        file (O_NONBLOCK has no effect on regular files).
        """
        path = self.join(fname)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            raise SwapError(f"{who}: its data file {path!r} is missing") from None
        except OSError:
            if os.path.islink(path):
                raise SwapError(f"{who}: its data file {path!r} was replaced by a symbolic "
                                f"link; aioswap never follows links for data files") from None
            raise
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise SwapError(f"{who}: its data file {path!r} is not a regular file "
                                f"(mode {stat.filemode(st.st_mode)}); refusing to read it")
            _prefer_direct(fd)
        except BaseException:
            os.close(fd)
            raise
        return fd, st.st_size

    def unlink(self, fname: str) -> None:
        """Remove ``fname`` (every part and layout of it, when striped)."""
        names = [fname]
        if is_data_file(fname):
            names.append(fname + STRIPE_SUFFIX)
        for d in [self.path, *self.extra]:
            for n in names:
                try:
                    os.unlink(os.path.join(d, n))
                except FileNotFoundError:
                    pass
                except OSError as exc:      # an orphan is removed at the next open anyway
                    _log.warning("could not remove %s from %s: %s", n, d, exc)

    def _scan(self) -> list[tuple[str, str, str | None]]:
        """aioswap's files in every directory: ``(directory, name, data file)``, where the data
        file is the one a part, layout or layout temporary belongs to, and None for
        temporaries of the manifest or owner record (never valid: their rename did not
        happen)."""
        out: list[tuple[str, str, str | None]] = []
        for d in [self.path, *self.extra]:
            for name in sorted(os.listdir(d)):
                if is_data_file(name):
                    out.append((d, name, name))
                    continue
                base, sep, rest = name.partition(STRIPE_SUFFIX)
                if sep and is_data_file(base) and (not rest or is_atomic_tmp(name, base + sep)):
                    out.append((d, name, base))
                elif (is_atomic_tmp(name, MANIFEST_NAME)
                      or is_atomic_tmp(name, _owner.OWNER_NAME)):
                    out.append((d, name, None))
        return out

    def remove_unreferenced(self, referenced: set[str]) -> None:
        """Remove aioswap files the (known, valid) manifest does not need, in every directory.

        Those are left by an interrupted swap, are old versions whose removal was interrupted,
        or are the temporaries of a layout or record that was being replaced: the published
        manifest never needs them. In a directory that had no owner record before this open
        (written by an aioswap without them, or a new one), data files the manifest does not
        name are moved to ``orphans/`` instead: nothing proves they were this swapper's.
        """
        moves: dict[str, list[str]] = {}
        for d, name, data in self._scan():
            if data is not None and data in referenced and name == data + STRIPE_SUFFIX:
                continue
            if data is not None and data in referenced and name == data:
                continue
            if data is not None and d in self._claimed:
                moves.setdefault(d, []).append(name)
                continue
            _log.info("removing %s from %s: left by an interrupted swap", name, d)
            try:
                os.unlink(os.path.join(d, name))
            except FileNotFoundError:
                pass
        for d, names in moves.items():
            self._to_orphans(d, names)

    def keep_orphans(self) -> None:
        """Move the data files of a set without a manifest to ``orphans/``, loudly.

        Without a manifest nothing says which of them hold complete data, nor what they are;
        they are not deleted (a user may have lost the manifest, not the data).
        """
        moves: dict[str, list[str]] = {}
        for d, name, data in self._scan():
            if data is not None:
                moves.setdefault(d, []).append(name)
            else:
                os.unlink(os.path.join(d, name))
        for d, names in moves.items():
            self._to_orphans(d, names)

    def _to_orphans(self, d: str, names: list[str]) -> None:
        dest = os.path.join(d, ORPHANS_DIR)
        try:
            os.mkdir(dest, _dir_mode(self.mode))
        except FileExistsError:
            pass
        sfd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            dfd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
            try:
                for name in names:
                    os.rename(name, name, src_dir_fd=sfd, dst_dir_fd=dfd)
                os.fsync(dfd)
            finally:
                os.close(dfd)
            os.fsync(sfd)
        finally:
            os.close(sfd)
        warnings.warn(f"swap directory {d!r} held {len(names)} aioswap file(s) that no manifest "
                      f"of this swapper names; they were moved, not deleted, to {dest!r} "
                      f"(remove them when they are not needed)", RuntimeWarning, stacklevel=5)

    def remove_own_files(self) -> None:
        """Remove data files, layouts, temporaries, manifest, owner records and marker in every
        directory (never other files, never a tree)."""
        for d, name, _ in self._scan():
            try:
                os.unlink(os.path.join(d, name))
            except FileNotFoundError:
                pass
        # in an order that a crash can stop anywhere: the members' records go before the
        # primary's, so no member is left naming a primary without a record
        for d, fname in ([(self.path, n) for n in (MANIFEST_NAME, MANIFEST_TMP)]
                         + [(d, n) for d in self.extra for n in (_owner.OWNER_NAME,
                                                                 CREATED_NAME)]
                         + [(self.path, n) for n in (CREATED_NAME, _owner.OWNER_NAME)]):
            try:
                os.unlink(os.path.join(d, fname))
            except FileNotFoundError:
                pass


# ----------------------------------------------------------------------------------------
# The manifest


@dataclass(frozen=True)
class Tree:
    """The skeleton of a nested state swapped out under a prefix, and its tensors' names."""

    names: tuple[str, ...]
    skeleton: Any

    def to_json(self) -> dict[str, Any]:
        return {"names": list(self.names), "tree": self.skeleton}


@dataclass
class Change:
    """Manifest changes waiting for a group commit.

    ``files``: data files written for ``puts`` (removed if the change is not published);
    ``packs``: sizes of new pack files; ``trees``: state skeletons to set (prefix -> the
    names of its tensors and the skeleton) or, with None, to drop.
    """

    puts: list[Entry]
    deletes: list[str]
    files: list[str] = field(default_factory=list)
    packs: dict[str, int] = field(default_factory=dict)
    trees: dict[str, Tree | None] = field(default_factory=dict)
    done: bool = False
    error: BaseException | None = None


class Manifest:
    """The published entries of a swap directory and their atomic, group-committed updates.

    ``lock`` guards ``entries``/``packs`` (shared with the swapper's own state).
    """

    def __init__(self, directory: SwapDirectory, lock: threading.RLock) -> None:
        self._dir = directory
        self._lock = lock
        self._commit_lock = threading.Lock()
        self._staged: list[Change] = []
        self.entries: dict[str, Entry] = {}
        self.packs: dict[str, int] = {}
        self.trees: dict[str, Tree] = {}
        self.seq = 0
        self.version = VERSION
        self._published: object = None
        self._load()

    @property
    def path(self) -> str:
        return self._dir.join(MANIFEST_NAME)

    def _load(self) -> None:
        path = self.path
        self._dir.unlink(MANIFEST_TMP)     # never valid: its rename did not happen
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
        except FileNotFoundError:
            fd = -1
        except OSError:
            if os.path.islink(path):
                raise SwapError(f"manifest {path!r} is a symbolic link; aioswap never follows "
                                f"links in a swap directory") from None
            raise
        if fd < 0:
            self._dir.keep_orphans()
            self._publish(self.entries, self.packs, self.trees, object())
            return
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SwapError(f"manifest {path!r} is not a regular file")
            with os.fdopen(fd, "rb", closefd=False) as f:
                raw = f.read()
        finally:
            os.close(fd)
        try:
            doc = json.loads(raw)
        except ValueError as exc:
            raise SwapError(f"manifest {path!r} is not valid JSON: {exc}") from None
        if not isinstance(doc, dict) or doc.get("format") != FORMAT:
            raise SwapError(f"{path!r} is not an aioswap swap manifest")
        version = doc.get("version")
        if version not in READABLE_VERSIONS or isinstance(version, bool):
            raise SwapError(f"manifest {path!r} has format version {version!r}; this aioswap "
                            f"reads versions {', '.join(map(str, READABLE_VERSIONS))} "
                            f"(upgrade aioswap)")
        self.version = int(version)
        items = doc.get("entries")
        if not isinstance(items, list):
            raise SwapError(f"manifest {path!r} has no entry list")
        for item in items:
            e = Entry.from_json(item, path)
            if e.name in self.entries:
                raise SwapError(f"manifest {path!r} names {e.name!r} twice")
            if version == 1 and (e.offset != 0 or is_pack_file(e.file)):
                raise SwapError(f"{path!r}: malformed version-1 entry of {e.name!r} "
                                f"(file {e.file!r} at offset {e.offset})")
            self.entries[e.name] = e
        packs = doc.get("packs", {})
        if not isinstance(packs, dict) or not all(
                isinstance(k, str) and is_pack_file(k) and _nonneg_int(v)
                for k, v in packs.items()):
            raise SwapError(f"manifest {path!r}: malformed pack list: {packs!r:.200}")
        self.packs = dict(packs)
        for e in self.entries.values():
            if is_pack_file(e.file) and e.file not in self.packs:
                raise SwapError(f"manifest {path!r}: entry {e.name!r} names pack {e.file!r}, "
                                f"which the pack list does not record")
        trees = doc.get("trees", {})
        if not isinstance(trees, dict):
            raise SwapError(f"manifest {path!r}: malformed state skeletons: {trees!r:.200}")
        for prefix, t in trees.items():
            names = t.get("names") if isinstance(t, dict) else None
            if (not isinstance(names, list) or "tree" not in t
                    or not all(isinstance(n, str) and n in self.entries for n in names)):
                raise SwapError(f"manifest {path!r}: malformed state skeleton of {prefix!r} "
                                f"(it must name published tensors): {t!r:.200}")
            self.trees[prefix] = Tree(tuple(names), t["tree"])
        seq = doc.get("seq", 0)
        self.seq = max([seq if _nonneg_int(seq) else 0]
                       + [e.seq + 1 for e in self.entries.values()])
        self._dir.remove_unreferenced(self.referenced(self.entries))

    @staticmethod
    def referenced(entries: Mapping[str, Entry]) -> set[str]:
        return {e.file for e in entries.values()}

    def next_seq(self, n: int) -> int:
        """Reserve ``n`` submission numbers; called with ``lock`` held."""
        s = self.seq
        self.seq += n
        return s

    def expected_size(self, e: Entry) -> int:
        """Size the data file of ``e`` must have (packs: recorded; single files: exact)."""
        if is_pack_file(e.file):
            return self.packs.get(e.file, -1)
        return e.offset + e.nbytes

    def live_bytes(self) -> dict[str, tuple[int, int]]:
        """Per pack: (bytes of live entries, file size); called with ``lock`` held."""
        live: dict[str, int] = {}
        for e in self.entries.values():
            if e.file in self.packs:
                live[e.file] = live.get(e.file, 0) + e.nbytes
        return {f: (live.get(f, 0), size) for f, size in self.packs.items()}

    def commit(self, change: Change) -> None:
        """Publish ``change`` durably (group commit with concurrent changes).

        Raises the error of the manifest write. If the new manifest was already renamed
        into place when the error came (e.g. EIO from the last directory fsync, or a signal),
        the change counts as published: its data files are kept, and so are the files it
        made obsolete (whichever manifest the disk holds decides at the next open).
        """
        with self._lock:
            self._staged.append(change)
        with self._commit_lock:
            if not change.done:
                with self._lock:
                    batch, self._staged = self._staged, []
                    new = dict(self.entries)
                    packs = dict(self.packs)
                    trees = dict(self.trees)
                    for c in batch:
                        for e in c.puts:
                            new[e.name] = e
                        for n in c.deletes:
                            new.pop(n, None)
                        packs.update(c.packs)
                        for prefix, t in c.trees.items():
                            if t is None:
                                trees.pop(prefix, None)
                            else:
                                trees[prefix] = t
                    # a skeleton lives only as long as every tensor it names
                    trees = {p: t for p, t in trees.items() if all(n in new for n in t.names)}
                    old_files = self.referenced(self.entries)
                    new_files = self.referenced(new)
                    packs = {f: s for f, s in packs.items() if f in new_files}
                marker = object()
                error: BaseException | None = None
                try:
                    self._publish(new, packs, trees, marker)
                except BaseException as exc:
                    error = exc
                # set by _publish once the rename happened, even if an error came after it
                published = self._published is marker
                if published:
                    with self._lock:
                        self.entries, self.packs, self.trees = new, packs, trees
                for c in batch:
                    c.error, c.done = error, True
                    for f in c.files:
                        # never published, or overwritten within the same batch
                        if not published or f not in new_files:
                            self._dir.unlink(f)
                if published and error is None:
                    # after an error the disk may hold either manifest: keep both versions'
                    # files; the next open removes whichever the manifest there does not name
                    self._dir.unlink_later(sorted(old_files - new_files))
        if change.error is not None:
            raise change.error

    def _publish(self, entries: Mapping[str, Entry], packs: Mapping[str, int],
                 trees: Mapping[str, Tree], marker: object) -> None:
        """Write the manifest atomically; ``self._published = marker`` once renamed into place.

        The marker is set even when an error (or a signal) comes after the rename: the new
        manifest is then what the directory holds, and its data must not be removed.
        """
        items = sorted(entries.values(), key=lambda e: e.seq)
        doc = {"format": FORMAT, "version": VERSION, "seq": self.seq,
               "packs": dict(sorted(packs.items())),
               "entries": [e.to_json() for e in items]}
        if trees:
            doc["trees"] = {p: t.to_json() for p, t in trees.items()}
        data = json.dumps(doc, ensure_ascii=True, separators=(",", ":")).encode("ascii")

        def renamed() -> None:
            self._published = marker
            self.version = VERSION

        self._dir.unlink(MANIFEST_TMP)
        # the directory is fsynced before the rename: the data files the manifest names are
        # durable entries first
        write_atomic(self.path, data, self._dir.mode, tmp=self._dir.join(MANIFEST_TMP),
                     sync_dir_first=True, renamed=renamed)

    def exclusive(self) -> threading.Lock:
        """The lock held while the manifest is written (hold it to keep writers out)."""
        return self._commit_lock

    def snapshot(self) -> list[Entry]:
        with self._lock:
            return sorted(self.entries.values(), key=lambda e: e.seq)

    def names_in(self, files: Iterable[str]) -> list[str]:
        fs = set(files)
        with self._lock:
            return [e.name for e in self.entries.values() if e.file in fs]
