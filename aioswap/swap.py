"""TensorSwapper: named tensors and state dicts to swap files on NVMe and back, crash-safe.

Storage format (version 1)
--------------------------
A swap directory holds, besides whatever else was already in it:

``aioswap-manifest.json``
    The only thing that makes a swap visible. JSON: ``{"format": "aioswap-swap",
    "version": 1, "seq": N, "entries": [...]}``; each entry has ``name`` (any ``str``),
    ``file``, ``offset``, ``nbytes``, ``dtype`` (``"float32"``...), ``shape``, ``stride``,
    ``storage_offset`` (of the tensor that was swapped out), ``checksum`` (hex or null),
    ``checksum_algo`` (``"xxh3_64"``, ``"crc32"`` or null) and ``seq`` (submission order).
    Replaced atomically: written to ``aioswap-manifest.json.tmp``, fsynced, the directory
    fsynced (so the data files it names are durable entries), ``os.replace``'d, the directory
    fsynced again.
``t-<32 hex>-<16 hex>.bin``
    One file per tensor: exactly ``nbytes`` bytes, the tensor's elements in row-major
    (C-contiguous) order, no header and no padding (the file ends where the data ends). The
    first part is the SHA-256 of the UTF-8 name (``surrogatepass``), so any string is a safe
    name (no path traversal, no length limit), the second part is random, so every write goes
    to a new file and an overwrite leaves the old version valid until the manifest names the
    new one. The name itself lives only in the manifest.
``aioswap.lock``
    ``flock``-ed for as long as a swapper has the directory open; a second swapper, in this
    process or another, gets a :class:`~aioswap.errors.SwapError` naming the holder's pid.
``aioswap-created``
    Present only when the swapper created the directory; :meth:`TensorSwapper.destroy`
    removes the directory only then (with ``os.rmdir``: never a tree).

Crash safety: a tensor's data is written and fsynced to its own new file before the manifest
that names it is published, so a crash at any point leaves either the old or the new manifest,
each naming only complete, durable files. Files of an interrupted swap (and old versions whose
unlink was interrupted) are orphans: at open, files matching the data-file pattern that the
manifest does not name are removed, and so is a stale ``.tmp`` manifest. Nothing else in the
directory is ever touched.

Checksums: ``xxh3_64`` from the ``xxhash`` package (about 12 GB/s, releases the GIL) when it is
installed, else ``zlib.crc32`` (about 4 GB/s); the algorithm is recorded per entry. It is
computed on swap-out while the write is in flight, and checked on swap-in when ``verify`` is
on (large reads are verified chunk by chunk as they land). The file size is always checked
against the manifest before any I/O, so a truncated or extended file is reported, never read.

Names and state dicts: a name is any ``str``. ``swap_out_state_dict(prefix, sd)`` stores each
entry as ``prefix + key`` (no separator is added: end the prefix with one, e.g. ``"opt/"``),
writes them concurrently and publishes all of them with one manifest update (all or nothing);
``swap_in_state_dict(prefix)`` returns the keys in the order they were swapped out.

Release: ``release=True`` frees a tensor's storage (``untyped_storage().resize_(0)``) once its
write is durable and published; ``swap_in`` without ``out`` resizes the same storage back and
reads into it, so every existing reference (views included) sees the data again, with its
own layout. Only tensors that span their whole, resizable storage can be released.

Concurrency: asynchronous swaps run on the swapper's worker threads (``max_inflight``); their
I/O goes through the handle, whose bounce pool bounds the staging memory of unpinned, CUDA and
unaligned buffers. Non-contiguous tensors are made contiguous first; those copies are bounded
by ``staging_bytes`` (one tensor larger than that still goes, alone). Fresh host memory that
``swap_in`` allocates (or restores with ``release``) is touched on the swap's worker thread
before the read, so its page faults overlap other tensors' I/O instead of the handle's copy
out of its bounce pool. Manifest updates of concurrent completions are serialized and
batched (group commit): one manifest write publishes every swap that completed while the
previous write was running. Operations on one name are ordered (a swap-in waits for that
name's swap-out in flight).
"""
from __future__ import annotations

import concurrent.futures
import ctypes
import hashlib
import importlib
import json
import logging
import os
import re
import threading
import warnings
import zlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, TypeVar, Union

from aioswap.config import AioConfig
from aioswap.errors import ChecksumError, HandleClosedError, SwapError
from aioswap.handle import AioHandle

if TYPE_CHECKING:
    import torch

__all__ = ["MANIFEST_NAME", "SwapInfo", "TensorSwapper", "checksum_algorithms"]

_log = logging.getLogger("aioswap")

#: File name of the manifest inside a swap directory.
MANIFEST_NAME = "aioswap-manifest.json"
_MANIFEST_TMP = MANIFEST_NAME + ".tmp"
_LOCK_NAME = "aioswap.lock"
_CREATED_NAME = "aioswap-created"
_FORMAT = "aioswap-swap"
_VERSION = 1
_DATA_RE = re.compile(r"t-[0-9a-f]{32}-[0-9a-f]{16}\.bin")
_HASH_CHUNK = 64 << 20        # bytes hashed per step for CUDA tensors and chunked reads
_SPLIT_READ = 128 << 20       # verified reads larger than this are hashed as they land
_PREFAULT_MIN = 1 << 20       # fresh host memory at least this large is touched before a read

_T = TypeVar("_T")
_Device = Union[str, "torch.device", int, None]


# ----------------------------------------------------------------------------------------
# Checksums


class _Crc32:
    """zlib.crc32 with the incremental interface of an xxhash object."""

    def __init__(self) -> None:
        self._value = 0

    def update(self, data: Any) -> None:
        self._value = zlib.crc32(data, self._value)

    def hexdigest(self) -> str:
        return f"{self._value:08x}"


def _xxhash() -> Any:
    """The xxhash module, or None when it is not installed."""
    try:
        return importlib.import_module("xxhash")
    except ImportError:
        return None


def checksum_algorithms() -> list[str]:
    """Checksum algorithms usable here, fastest first (``"crc32"`` is always available)."""
    return (["xxh3_64"] if _xxhash() is not None else []) + ["crc32"]


def _new_hasher(algo: str) -> Any:
    if algo == "crc32":
        return _Crc32()
    if algo == "xxh3_64":
        mod = _xxhash()
        if mod is None:
            raise SwapError("checksum algorithm 'xxh3_64' needs the xxhash package "
                            "(pip install xxhash)")
        return mod.xxh3_64()
    raise SwapError(f"unknown checksum algorithm {algo!r}; known: 'xxh3_64', 'crc32'")


def _host_bytes(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (the caller keeps ``t`` alive)."""
    n = t.numel() * t.element_size()
    if n == 0:
        return memoryview(b"")
    return memoryview((ctypes.c_char * n).from_address(t.data_ptr())).cast("B")


def _digest(t: torch.Tensor, algo: str) -> str:
    """Checksum of the row-major bytes of ``t`` (CPU or CUDA, any layout)."""
    h = _new_hasher(algo)
    src = t.detach()
    if not src.is_contiguous():
        src = src.contiguous()
    if src.is_cuda and src.numel():
        import torch
        flat = src.reshape(-1).view(torch.uint8)
        for s in range(0, flat.numel(), _HASH_CHUNK):
            host = flat[s:s + _HASH_CHUNK].cpu()    # kept alive while it is hashed
            h.update(_host_bytes(host))
    else:
        h.update(_host_bytes(src))
    return str(h.hexdigest())


# ----------------------------------------------------------------------------------------
# Small helpers


def _torch() -> Any:
    """torch, imported on first use so that ``import aioswap`` does not need it."""
    try:
        import torch
    except ImportError as exc:      # pragma: no cover - torch is a test dependency
        raise ImportError("TensorSwapper needs PyTorch (pip install torch)") from exc
    return torch


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).rpartition(".")[2]


def _dtype_from_name(name: str) -> torch.dtype:
    import torch
    dt = getattr(torch, name, None)
    if not isinstance(dt, torch.dtype):
        raise SwapError(f"dtype {name!r} in the manifest is not a dtype of this PyTorch "
                        f"({torch.__version__})")
    return dt


def _extent(t: torch.Tensor) -> int:
    """Bytes of storage that ``t`` spans from the start of its storage."""
    if t.numel() == 0:
        return 0
    last = t.storage_offset() + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    return int((last + 1) * t.element_size())


def _prefault(st: torch.UntypedStorage) -> None:
    """Touch fresh host memory before a bounced read lands in it.

    The first write to each new page faults; done here, on the swap's own worker thread, those
    faults overlap other tensors' I/O instead of slowing the handle's copy out of its bounce
    pool, which every bounced request waits for in turn.
    """
    import torch
    if st.nbytes() >= _PREFAULT_MIN:
        torch.empty(0, dtype=torch.uint8).set_(st).zero_()


def _file_hash(name: str) -> str:
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


def _add_note(exc: BaseException, note: str) -> None:
    add = getattr(exc, "add_note", None)     # Python >= 3.11
    if add is not None:
        add(note)


def _fsync_dir(fd: int) -> None:
    os.fsync(fd)


def _storage_key(t: torch.Tensor) -> int:
    """Identity of the storage behind ``t`` (stable across ``resize_``)."""
    st = t.untyped_storage()
    key = getattr(st, "_cdata", None)
    return int(key) if isinstance(key, int) else id(st)


# ----------------------------------------------------------------------------------------
# Manifest entries


@dataclass(frozen=True)
class _Entry:
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
    def from_json(cls, d: Any, where: str) -> _Entry:
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
        if not isinstance(file, str) or not _DATA_RE.fullmatch(file):
            raise bad("file is not a swap data file name")   # never follow other paths
        for v in ints + list(shape) + list(stride):
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise bad("offsets, sizes, shape and stride must be integers >= 0")
        if not isinstance(shape, list) or not isinstance(stride, list):
            raise bad("shape and stride must be lists")
        if (checksum is None) != (algo is None) or not (
                checksum is None or (isinstance(checksum, str) and isinstance(algo, str))):
            raise bad("checksum and checksum_algo must be strings or both null")
        return cls(name, file, ints[0], ints[1], dtype, tuple(shape), tuple(stride), ints[2],
                   checksum, algo, ints[3])


@dataclass(frozen=True)
class SwapInfo:
    """What the manifest records about one swapped-out tensor (see :meth:`TensorSwapper.info`).

    ``file`` is the absolute path of the data file; ``offset`` and ``nbytes`` the byte range
    of the tensor in it (row-major element order); ``shape``/``dtype`` those of the tensor;
    ``stride``/``storage_offset`` the layout the tensor had when it was swapped out;
    ``checksum`` the hex digest by ``checksum_algo`` (both None when not computed);
    ``released`` whether a tensor released by ``release=True`` is waiting to be restored.
    """

    name: str
    file: str
    offset: int
    nbytes: int
    dtype: torch.dtype
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    checksum: str | None
    checksum_algo: str | None
    released: bool


@dataclass
class _Pending:
    """Manifest changes waiting for a group commit."""

    puts: list[_Entry]
    deletes: list[str]
    done: bool = False
    error: BaseException | None = None
    # old data files replaced or deleted by this change, unlinked once it is durable
    obsolete: list[str] = field(default_factory=list)


@dataclass
class _Released:
    """A tensor whose storage was freed by ``release=True``, waiting for ``swap_in``."""

    tensor: torch.Tensor
    storage_nbytes: int


class _ByteBudget:
    """Blocks while more than ``cap`` bytes of staging copies are alive (one may exceed)."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._used = 0
        self._cond = threading.Condition()

    def acquire(self, n: int) -> None:
        with self._cond:
            while self._used and self._used + n > self._cap:
                self._cond.wait()
            self._used += n

    def release(self, n: int) -> None:
        with self._cond:
            self._used -= n
            self._cond.notify_all()


# ----------------------------------------------------------------------------------------
# The swapper


class TensorSwapper:
    """Swaps named tensors and state dicts out to files in ``directory`` and back.

    Parameters
    ----------
    directory : str or os.PathLike
        The swap directory. Created (with parents) when missing, and then marked as created
        by aioswap; an existing directory is used as it is, and only aioswap's own files in
        it are ever written or removed. Completed swaps found in it are restored.
    handle : AioHandle, optional
        The handle that moves the bytes; it stays open when the swapper closes. Default: a
        handle built from ``config`` and owned (closed) by the swapper.
    config : AioConfig, optional
        Configuration of the swapper's own handle; not allowed together with ``handle``.
    verify : bool
        Default of ``swap_in(verify=...)``: check each tensor's checksum as it is read.
    checksum : str or None
        ``"auto"`` (``"xxh3_64"`` when the xxhash package is installed, else ``"crc32"``),
        ``"xxh3_64"``, ``"crc32"`` or None (no checksum is computed or checked).
    max_inflight : int
        Worker threads running asynchronous swaps (tensors in flight at once).
    staging_bytes : int, optional
        Bound on the contiguous copies made of non-contiguous tensors in flight; default the
        handle's bounce pool size. A single tensor larger than this is still staged, alone.
    pin_memory : bool
        Allocate the tensors that ``swap_in`` creates on the CPU with ``aioswap.pinned.empty``
        (page-locked: read with ``O_DIRECT`` straight into them, no bounce copy). Such tensors
        cannot be released with ``release=True`` later (their storage is not resizable).

    Raises
    ------
    SwapError
        Another swapper holds the directory, or its manifest is unreadable or from a newer
        version of aioswap.
    NotADirectoryError, PermissionError, OSError
        The directory cannot be created or used.

    Notes
    -----
    Names are any ``str``; state dicts are stored as ``prefix + key`` per tensor. Tensors are
    stored in row-major order and come back contiguous, except that a tensor released with
    ``release=True`` is restored in place with its own layout.

    Lifetime: do not modify a tensor while its swap-out is in flight, nor read ``out`` before
    its swap-in has finished. :meth:`close` waits for every in-flight swap and keeps the data;
    :meth:`destroy` deletes it.

    Thread safety: any number of threads may use one swapper. Operations on one name are
    ordered: a swap-in, overwrite or removal waits for the name's in-flight swap-out.
    """

    def __init__(self, directory: str | os.PathLike[str], *, handle: AioHandle | None = None,
                 config: AioConfig | None = None, verify: bool = True,
                 checksum: str | None = "auto", max_inflight: int = 8,
                 staging_bytes: int | None = None, pin_memory: bool = False) -> None:
        self._closed = True          # until the directory is locked (for __del__)
        if handle is not None and config is not None:
            raise ValueError("pass either handle or config, not both")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if checksum == "auto":
            checksum = checksum_algorithms()[0]
        if checksum is not None:
            _new_hasher(checksum)    # unknown or missing algorithm: fail now
        if handle is not None and handle.closed:
            raise HandleClosedError("TensorSwapper given a closed AioHandle")
        _torch()
        self._dir = os.path.abspath(os.fspath(directory))
        self._verify = bool(verify)
        self._algo = checksum
        self._pin = bool(pin_memory)
        self._lock = threading.RLock()            # entries, busy, released, futures
        self._commit_lock = threading.Lock()      # one manifest write at a time
        self._entries: dict[str, _Entry] = {}
        self._staged: list[_Pending] = []
        self._busy: dict[str, threading.Event] = {}
        self._released: dict[str, _Released] = {}
        self._released_storages: dict[int, str] = {}      # storage key -> name
        self._restoring: dict[str, concurrent.futures.Future[Any]] = {}
        # async futures not yet reported by wait(): pending ones and failed ones (a success
        # drops out when it completes, so a long run that never waits does not grow this)
        self._outstanding: dict[concurrent.futures.Future[Any], None] = {}
        self._async_count = 0
        self._seq = 0
        self._dir_fd = -1
        self._lock_fd = -1
        self._created = self._open_directory()
        try:
            self._load()
            self._own_handle = handle is None
            self._handle = (AioHandle.from_config(config or AioConfig()) if handle is None
                            else handle)
        except BaseException:
            self._unlock()
            raise
        cap = self._handle.bounce_pool_bytes if staging_bytes is None else int(staging_bytes)
        self._staging = _ByteBudget(max(1, cap))
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_inflight, thread_name_prefix="aioswap-swap")
        self._coord = concurrent.futures.ThreadPoolExecutor(
            2, thread_name_prefix="aioswap-swap-sd")
        self._closed = False

    # -- opening ---------------------------------------------------------------------------
    def _open_directory(self) -> bool:
        """Create (and mark) or find the directory, then lock it; True if created here."""
        created = False
        if not os.path.isdir(self._dir):
            try:
                os.makedirs(self._dir)
                created = True
            except FileExistsError:
                if not os.path.isdir(self._dir):
                    raise NotADirectoryError(f"swap directory {self._dir!r} exists and is "
                                             f"not a directory") from None
        self._dir_fd = os.open(self._dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            self._lock_directory()
            if created:
                fd = os.open(os.path.join(self._dir, _CREATED_NAME),
                             os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
                try:
                    os.write(fd, b"created by aioswap.TensorSwapper; destroy() removes this "
                                 b"directory\n")
                    os.fsync(fd)
                finally:
                    os.close(fd)
                _fsync_dir(self._dir_fd)
                parent = os.open(os.path.dirname(self._dir), os.O_RDONLY | os.O_DIRECTORY)
                try:
                    _fsync_dir(parent)
                finally:
                    os.close(parent)
            return created or os.path.exists(os.path.join(self._dir, _CREATED_NAME))
        except BaseException:
            self._unlock()
            raise

    def _lock_directory(self) -> None:
        import fcntl
        path = os.path.join(self._dir, _LOCK_NAME)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            try:
                holder = os.pread(fd, 64, 0).decode("ascii", "replace").strip() or "unknown"
            finally:
                os.close(fd)
            raise SwapError(f"swap directory {self._dir!r} is in use by another "
                            f"TensorSwapper (pid {holder}); close it first") from None
        except BaseException:
            os.close(fd)
            raise
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        self._lock_fd = fd

    def _unlock(self) -> None:
        for attr in ("_lock_fd", "_dir_fd"):
            fd = getattr(self, attr)
            if fd >= 0:
                setattr(self, attr, -1)
                os.close(fd)        # closing the lock fd releases the flock

    def _load(self) -> None:
        """Read the manifest, then remove orphans of interrupted swaps."""
        path = os.path.join(self._dir, MANIFEST_NAME)
        try:
            os.unlink(os.path.join(self._dir, _MANIFEST_TMP))
        except FileNotFoundError:
            pass
        try:
            with open(path, "rb") as f:
                raw = f.read()
        except FileNotFoundError:
            raw = None
        if raw is not None:
            try:
                doc = json.loads(raw)
            except ValueError as exc:
                raise SwapError(f"manifest {path!r} is not valid JSON: {exc}") from None
            if not isinstance(doc, dict) or doc.get("format") != _FORMAT:
                raise SwapError(f"{path!r} is not an aioswap swap manifest")
            version = doc.get("version")
            if not isinstance(version, int) or version > _VERSION:
                raise SwapError(f"manifest {path!r} has format version {version!r}; this "
                                f"aioswap reads version {_VERSION} (upgrade aioswap)")
            items = doc.get("entries")
            if not isinstance(items, list):
                raise SwapError(f"manifest {path!r} has no entry list")
            for item in items:
                e = _Entry.from_json(item, path)
                if e.name in self._entries:
                    raise SwapError(f"manifest {path!r} names {e.name!r} twice")
                self._entries[e.name] = e
            seq = doc.get("seq", 0)
            self._seq = max([seq if isinstance(seq, int) else 0]
                            + [e.seq + 1 for e in self._entries.values()])
        else:
            self._write_manifest(self._entries)
        referenced = {e.file for e in self._entries.values()}
        for fname in os.listdir(self._dir):
            if _DATA_RE.fullmatch(fname) and fname not in referenced:
                _log.info("removing %s from %s: left by an interrupted swap", fname, self._dir)
                try:
                    os.unlink(os.path.join(self._dir, fname))
                except FileNotFoundError:
                    pass

    # -- properties ------------------------------------------------------------------------
    @property
    def directory(self) -> str:
        """Absolute path of the swap directory."""
        return self._dir

    @property
    def handle(self) -> AioHandle:
        """The handle that moves the bytes."""
        return self._handle

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def created_directory(self) -> bool:
        """Whether aioswap created the directory (so :meth:`destroy` may remove it)."""
        return self._created

    @property
    def checksum_algo(self) -> str | None:
        """Algorithm used for new swaps (None: no checksums)."""
        return self._algo

    def __repr__(self) -> str:
        state = " closed" if self._closed else f" {len(self._entries)} tensors"
        return f"<TensorSwapper {self._dir!r}{state}>"

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self.names())

    # -- queries ---------------------------------------------------------------------------
    def names(self, prefix: str | None = None) -> list[str]:
        """Names of the published swaps, in the order they were swapped out.

        Parameters
        ----------
        prefix : str, optional
            Only names that start with it.
        """
        with self._lock:
            entries = sorted(self._entries.values(), key=lambda e: e.seq)
        return [e.name for e in entries if prefix is None or e.name.startswith(prefix)]

    def info(self, name: str) -> SwapInfo:
        """What the manifest records about ``name``.

        Raises
        ------
        SwapError
            No tensor of that name is swapped out.
        """
        with self._lock:
            e = self._lookup(name)
            released = name in self._released
        return SwapInfo(e.name, os.path.join(self._dir, e.file), e.offset, e.nbytes,
                        _dtype_from_name(e.dtype), e.shape, e.stride, e.storage_offset,
                        e.checksum, e.checksum_algo, released)

    def _lookup(self, name: str) -> _Entry:
        if not isinstance(name, str):
            raise TypeError(f"swap names are str, got {type(name).__name__}")
        e = self._entries.get(name)
        if e is None:
            raise SwapError(f"no tensor named {name!r} is swapped out in {self._dir!r}")
        return e

    # -- swap out --------------------------------------------------------------------------
    def swap_out(self, name: str, tensor: torch.Tensor, *, release: bool = False,
                 overwrite: bool = False, async_op: bool = False
                 ) -> SwapInfo | concurrent.futures.Future[SwapInfo]:
        """Write ``tensor`` to its own swap file and publish it under ``name``.

        Parameters
        ----------
        name : str
            Any string.
        tensor : torch.Tensor
            A strided CPU or CUDA tensor of any dtype and shape, contiguous or not.
        release : bool
            Once the write is durable and published, free the tensor's storage (``storage
            .resize_(0)``: the memory goes back to the allocator). :meth:`swap_in` without
            ``out`` then restores it in place, so every reference sees the data again. Needs a
            tensor that spans its whole, resizable storage.
        overwrite : bool
            Replace a tensor already swapped out under ``name``. The old version stays valid
            until the new one is published. A tensor released under that name is forgotten
            (it stays empty).
        async_op : bool
            Return a :class:`concurrent.futures.Future` at once.

        Returns
        -------
        SwapInfo or Future of SwapInfo
            The published entry; the future completes after the write, the fsync and the
            manifest update (and the release).

        Raises
        ------
        SwapError
            ``name`` is taken and ``overwrite`` is False; the tensor has no data (its storage
            was released); ``release`` on a view of a larger or non-resizable storage.
        TypeError
            Not a strided CPU/CUDA tensor, or a non-``str`` name.
        OSError
            The write failed (``EFBIG``/``ENOSPC`` for a full disk...): nothing is published
            and the partial file is removed.
        HandleClosedError
            The swapper (or its handle) is closed.
        """
        t = self._check_tensor(name, tensor, release)
        ev = self._claim([name], overwrite)
        try:
            with self._lock:
                seq = self._seq
                self._seq += 1

            def job() -> SwapInfo:
                try:
                    entry = self._write(name, t, seq)
                    self._commit(_Pending([entry], []))
                    with self._lock:
                        self._forget_release(name)
                        if release:
                            self._release(name, tensor)
                    return self.info(name)
                finally:
                    self._unclaim([name], ev)

            return self._run(job, async_op)
        except BaseException:
            self._unclaim([name], ev)
            raise

    def _check_tensor(self, name: str, tensor: Any, release: bool) -> torch.Tensor:
        """Validate a tensor to swap out before any I/O; return the bytes to write."""
        import torch
        self._check_open()
        if not isinstance(name, str):
            raise TypeError(f"swap names are str, got {type(name).__name__}")
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"swap_out of {name!r} takes a torch.Tensor, got "
                            f"{type(tensor).__name__}")
        if tensor.layout != torch.strided or tensor.is_quantized:
            raise TypeError(f"swap_out of {name!r}: only strided (dense) tensors can be "
                            f"swapped, not {tensor.layout} / quantized ones")
        if tensor.device.type not in ("cpu", "cuda"):
            raise TypeError(f"swap_out of {name!r}: tensor is on {tensor.device}; only CPU "
                            f"and CUDA tensors can be swapped")
        t: torch.Tensor = tensor.detach()
        st = t.untyped_storage()
        need = _extent(t)
        if st.nbytes() < need:
            raise SwapError(f"swap_out of {name!r}: the tensor has no data (its storage holds "
                            f"{st.nbytes()} of the {need} bytes it spans; was it released by "
                            f"release=True? swap it in first)")
        if release:
            whole = (t.storage_offset() == 0 and need == st.nbytes()
                     and t.numel() * t.element_size() == st.nbytes())
            if not whole:
                raise SwapError(f"swap_out of {name!r} with release=True: the tensor is a view "
                                f"of part of a larger storage ({st.nbytes()} bytes), which "
                                f"cannot be freed; swap out the base tensor or a copy")
            if not st.resizable():
                raise SwapError(f"swap_out of {name!r} with release=True: the tensor's storage "
                                f"is not resizable (it came from numpy or a buffer, was "
                                f"shared with numpy by .numpy(), or is locked memory), so it "
                                f"cannot be freed")
        # conj/neg bits are lazy: the memory holds the un-negated values
        if t.is_conj():
            t = t.resolve_conj()
        if t.is_neg():
            t = t.resolve_neg()
        return t

    def _release(self, name: str, tensor: torch.Tensor) -> None:
        """Free the storage of a published tensor; called with ``self._lock`` held."""
        st = tensor.untyped_storage()
        if tensor.numel() == 0:     # nothing to free, but swap_in restores the same object
            self._released[name] = _Released(tensor, st.nbytes())
            return
        key = _storage_key(tensor)
        other = self._released_storages.get(key)
        if (other is not None and other != name) or st.nbytes() == 0:
            # the storage is already released under another name, which restores it
            _log.debug("%r not released: its storage is already released as %r", name, other)
            return
        self._released[name] = _Released(tensor, st.nbytes())
        self._released_storages[key] = name
        st.resize_(0)

    def _forget_release(self, name: str) -> None:
        """Drop the released tensor of ``name``; called with ``self._lock`` held."""
        rel = self._released.pop(name, None)
        if rel is not None:
            key = _storage_key(rel.tensor)
            if self._released_storages.get(key) == name:
                del self._released_storages[key]

    def _create_file(self, name: str) -> tuple[str, int]:
        h = _file_hash(name)
        while True:
            fname = f"t-{h}-{os.urandom(8).hex()}.bin"
            try:
                fd = os.open(os.path.join(self._dir, fname),
                             os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            except FileExistsError:     # pragma: no cover - 64 random bits
                continue
            return fname, fd

    def _write(self, name: str, t: torch.Tensor, seq: int) -> _Entry:
        """Write ``t`` to a new, fsynced file; the checksum runs while the write is in flight."""
        shape = tuple(int(x) for x in t.shape)
        stride = tuple(int(x) for x in t.stride())
        soff = int(t.storage_offset())
        nbytes = t.numel() * t.element_size()
        staged = 0
        if not t.is_contiguous():
            staged = nbytes
            self._staging.acquire(staged)
        try:
            src = t.contiguous() if staged else t
            fname, fd = self._create_file(name)
            ok = False
            try:
                fut = self._handle.pwrite(src, fd, 0, async_op=True, fsync=True)
                assert isinstance(fut, concurrent.futures.Future)
                try:
                    digest = _digest(src, self._algo) if self._algo else None
                finally:
                    concurrent.futures.wait([fut])
                fut.result()
                ok = True
            except BaseException as exc:
                _add_note(exc, f"aioswap: swap_out of {name!r} failed; nothing was published "
                               f"and the swap directory is unchanged")
                raise
            finally:
                os.close(fd)
                if not ok:
                    self._unlink(fname)
        finally:
            if staged:
                self._staging.release(staged)
        return _Entry(name, fname, 0, nbytes, _dtype_name(t.dtype), shape, stride, soff,
                      digest, self._algo if digest is not None else None, seq)

    # -- swap in ---------------------------------------------------------------------------
    def swap_in(self, name: str, *, out: torch.Tensor | None = None, device: _Device = None,
                verify: bool | None = None, async_op: bool = False
                ) -> torch.Tensor | concurrent.futures.Future[torch.Tensor]:
        """Read the tensor swapped out as ``name``.

        The entry stays in the store (call :meth:`remove` to drop it).

        Parameters
        ----------
        name : str
            A name given to :meth:`swap_out`.
        out : torch.Tensor, optional
            Read into this tensor (CPU or CUDA, any layout); it must have the recorded shape
            and dtype exactly.
        device : str, torch.device or int, optional
            Where to allocate the result when there is no ``out`` (default CPU).
        verify : bool, optional
            Check the checksum (default: the swapper's ``verify``).
        async_op : bool
            Return a :class:`concurrent.futures.Future` of the tensor at once.

        Returns
        -------
        torch.Tensor or Future of torch.Tensor
            ``out``; else the released tensor itself, restored in place, when ``name`` was
            swapped out with ``release=True`` in this swapper; else a new contiguous tensor.

        Raises
        ------
        SwapError
            Unknown name; ``out`` of the wrong shape, dtype or without storage; the data file
            is missing or its size differs from the manifest (truncated or extended:
            checked before any I/O).
        ChecksumError
            The bytes read do not match the checksum (``verify``). A tensor being restored in
            place is released again; ``out`` holds the unverified bytes.
        OSError
            The read failed.
        """
        self._check_open()
        verify = self._verify if verify is None else bool(verify)
        while True:
            with self._lock:
                ev = self._busy.get(name) if isinstance(name, str) else None
                if ev is None:
                    fut, job = self._start_read(name, out, device, verify)
                    if job is not None and async_op:
                        try:
                            self._pool.submit(job)
                        except BaseException:
                            job(cancel=True)
                            raise
                        self._track(fut)
                    break
            ev.wait()
        if job is not None and not async_op:
            job()
        return fut if async_op else fut.result()

    def _start_read(self, name: str, out: torch.Tensor | None, device: _Device, verify: bool
                    ) -> tuple[concurrent.futures.Future[torch.Tensor],
                               Callable[..., None] | None]:
        """Validate a swap-in before any I/O; called with ``self._lock`` held.

        Returns the future and the job that fulfils it (None: a swap-in already in flight
        restores the same released tensor; its future is returned).
        """
        import torch
        self._check_open()
        e = self._lookup(name)
        rel = self._released.get(name)
        if out is not None and rel is not None and out is rel.tensor:
            out = None
        restore = rel if out is None else None
        if restore is not None:
            pending = self._restoring.get(name)
            if pending is not None:
                return pending, None
            if device is not None and torch.device(device) != restore.tensor.device:
                raise SwapError(f"swap_in of {name!r}: the tensor was released on "
                                f"{restore.tensor.device} and is restored there, not on "
                                f"{torch.device(device)}; pass out= to read elsewhere")
        dtype = _dtype_from_name(e.dtype)
        numel = 1
        for s in e.shape:
            numel *= s
        if numel * torch.empty((), dtype=dtype).element_size() != e.nbytes:
            raise SwapError(f"manifest entry of {name!r} is inconsistent: shape {e.shape} of "
                            f"{e.dtype} is not {e.nbytes} bytes")
        if out is not None:
            self._check_out(name, e, out, dtype)
        if verify and e.checksum_algo is not None:
            _new_hasher(e.checksum_algo)        # algorithm available?
        path = os.path.join(self._dir, e.file)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            raise SwapError(f"swap_in of {name!r}: its data file {path!r} is missing") from None
        try:
            size = os.fstat(fd).st_size
            if size != e.offset + e.nbytes:
                what = "truncated" if size < e.offset + e.nbytes else "longer than recorded"
                raise SwapError(f"swap_in of {name!r}: data file {path!r} is {what}: it has "
                                f"{size} bytes, the manifest records {e.nbytes} bytes at "
                                f"offset {e.offset} (the file was changed after swap_out)")
        except BaseException:
            os.close(fd)
            raise
        fut: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
        if restore is not None:
            self._restoring[name] = fut

        def job(cancel: bool = False) -> None:
            try:
                if cancel or not fut.set_running_or_notify_cancel():
                    os.close(fd)
                    if cancel:
                        fut.cancel()
                    return
                try:
                    fut.set_result(self._read(name, e, fd, path, out, restore, device, verify))
                except BaseException as exc:
                    fut.set_exception(exc)
            finally:
                with self._lock:
                    if self._restoring.get(name) is fut:
                        del self._restoring[name]

        return fut, job

    def _check_out(self, name: str, e: _Entry, out: Any, dtype: torch.dtype) -> None:
        import torch
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"swap_in of {name!r}: out must be a torch.Tensor, got "
                            f"{type(out).__name__}")
        if tuple(out.shape) != e.shape:
            raise SwapError(f"swap_in of {name!r}: out has shape {tuple(out.shape)}, the "
                            f"tensor was swapped out with shape {e.shape}")
        if out.dtype != dtype:
            raise SwapError(f"swap_in of {name!r}: out has dtype {out.dtype}, the tensor was "
                            f"swapped out as {dtype}")
        if out.layout != torch.strided or out.device.type not in ("cpu", "cuda"):
            raise TypeError(f"swap_in of {name!r}: out must be a strided CPU or CUDA tensor")
        st = out.untyped_storage()
        if st.nbytes() < _extent(out):
            raise SwapError(f"swap_in of {name!r}: out has no data (its storage holds "
                            f"{st.nbytes()} of the {_extent(out)} bytes it spans; released?)")

    def _read(self, name: str, e: _Entry, fd: int, path: str, out: torch.Tensor | None,
              restore: _Released | None, device: _Device, verify: bool) -> torch.Tensor:
        import torch
        dtype = _dtype_from_name(e.dtype)
        resized = None
        try:
            if restore is not None:
                target = restore.tensor
                st = target.untyped_storage()
                if st.nbytes() < restore.storage_nbytes:
                    st.resize_(restore.storage_nbytes)
                    resized = st
                    if not target.is_cuda:
                        _prefault(st)
            elif out is not None:
                target = out
            elif (self._pin and e.nbytes
                  and (device is None or torch.device(device).type == "cpu")):
                from aioswap import pinned
                target = pinned.empty(e.shape, dtype)
            else:
                target = torch.empty(e.shape, dtype=dtype, device=device)
                if not target.is_cuda:
                    _prefault(target.untyped_storage())
            dest = target.detach()
            lazy = dest.is_conj() or dest.is_neg()
            if lazy:        # the memory of a conj/neg view is not its values: go through a copy
                dest = torch.empty(e.shape, dtype=dtype, device=dest.device)
            self._read_into(name, e, fd, path, dest, verify)
            if lazy:
                target.detach().copy_(dest)
        except BaseException:
            if resized is not None:
                resized.resize_(0)      # still released: never hand out unverified data
            raise
        finally:
            os.close(fd)
        if restore is not None:
            with self._lock:
                if self._released.get(name) is restore:
                    self._forget_release(name)
        return target

    def _read_into(self, name: str, e: _Entry, fd: int, path: str, dest: torch.Tensor,
                   verify: bool) -> None:
        algo = e.checksum_algo if verify else None
        n = e.nbytes
        if algo is not None and n > _SPLIT_READ and dest.is_contiguous() and not dest.is_cuda:
            # hash each chunk as soon as it has landed, while the next ones are read
            import torch
            flat = dest.reshape(-1).view(torch.uint8)
            futs: list[concurrent.futures.Future[int]] = []
            try:
                for s in range(0, n, _HASH_CHUNK):
                    k = min(_HASH_CHUNK, n - s)
                    part = self._handle.pread(flat[s:s + k], fd, e.offset + s, async_op=True)
                    assert isinstance(part, concurrent.futures.Future)
                    futs.append(part)
                h = _new_hasher(algo)
                for s, done in zip(range(0, n, _HASH_CHUNK), futs):
                    done.result()
                    h.update(_host_bytes(flat[s:s + _HASH_CHUNK]))
                got = str(h.hexdigest())
            finally:
                concurrent.futures.wait(futs)    # never leave the kernel writing into dest
        else:
            self._handle.pread(dest, fd, e.offset, nbytes=n)
            got = _digest(dest, algo) if algo is not None else ""
        if algo is not None and got != e.checksum:
            raise ChecksumError(f"swap_in of {name!r}: checksum mismatch in {path!r} "
                                f"({algo} of the {n} bytes read is {got}, swap_out recorded "
                                f"{e.checksum}): the file is corrupted")

    # -- state dicts -----------------------------------------------------------------------
    def swap_out_state_dict(self, prefix: str, state_dict: Mapping[str, torch.Tensor], *,
                            release: bool = False, overwrite: bool = False,
                            async_op: bool = False
                            ) -> list[str] | concurrent.futures.Future[list[str]]:
        """Swap out every tensor of ``state_dict`` as ``prefix + key``, all or nothing.

        The tensors are written concurrently; the whole dict is published by one manifest
        update, so after a crash or a failed write either all of it is visible or none.
        ``release`` frees each tensor's storage after that update.

        Parameters
        ----------
        prefix : str
            Prepended to every key as it is (end it with a separator, e.g. ``"opt/"``, so
            that one prefix is not the start of another).
        state_dict : Mapping[str, torch.Tensor]
            String keys, tensor values (see :meth:`swap_out`).
        release, overwrite, async_op : bool
            As in :meth:`swap_out`, for every tensor.

        Returns
        -------
        list of str or Future of it
            The names, in the dict's order.

        Raises
        ------
        SwapError, TypeError, OSError
            As :meth:`swap_out`, checked for every entry before any I/O where possible; a
            failed write publishes nothing.
        """
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        items: list[tuple[str, torch.Tensor, torch.Tensor]] = []
        for key, value in state_dict.items():
            if not isinstance(key, str):
                raise TypeError(f"state dict keys must be str, got {key!r}")
            name = prefix + key
            items.append((name, value, self._check_tensor(name, value, release)))
        names = [n for n, _, _ in items]
        if release:
            shared: dict[int, str] = {}
            for n, v, _ in items:
                if v.numel():
                    first = shared.setdefault(_storage_key(v), n)
                    if first != n:
                        raise SwapError(f"swap_out_state_dict with release=True: {n!r} shares "
                                        f"its storage with {first!r} (tied tensors); swap "
                                        f"them out without release, or drop one of them")
        ev = self._claim(names, overwrite)
        try:
            with self._lock:
                seq0 = self._seq
                self._seq += len(items)
                jobs = [self._pool.submit(self._write, n, t, seq0 + i)
                        for i, (n, _, t) in enumerate(items)]

            def finish() -> list[str]:
                try:
                    concurrent.futures.wait(jobs)
                    failed = [j for j in jobs if j.exception() is not None]
                    if failed:      # all or nothing: drop the files that were written
                        for j in jobs:
                            if j.exception() is None:
                                self._unlink(j.result().file)
                        failed[0].result()
                    if jobs:
                        self._commit(_Pending([j.result() for j in jobs], []))
                    with self._lock:
                        for n, tensor, _ in items:
                            self._forget_release(n)
                            if release:
                                self._release(n, tensor)
                    return names
                finally:
                    self._unclaim(names, ev)

            if not async_op:
                return finish()
            with self._lock:
                fut = self._coord.submit(finish)
                self._track(fut)
            return fut
        except BaseException:
            self._unclaim(names, ev)
            raise

    def swap_in_state_dict(self, prefix: str, *, state_dict: dict[str, Any] | None = None,
                           device: _Device = None, verify: bool | None = None,
                           async_op: bool = False
                           ) -> dict[str, torch.Tensor] | concurrent.futures.Future[
                               dict[str, torch.Tensor]]:
        """Swap in every tensor whose name starts with ``prefix``, keyed without it.

        Parameters
        ----------
        prefix : str
            As given to :meth:`swap_out_state_dict`.
        state_dict : dict, optional
            Fill this dict: a tensor it holds under a key is the ``out`` of that key (released
            tensors are restored in place either way); other keys are added.
        device, verify : optional
            As in :meth:`swap_in`.
        async_op : bool
            Return a :class:`concurrent.futures.Future` of the dict at once.

        Returns
        -------
        dict or Future of dict
            Keys in the order the tensors were swapped out (``state_dict`` itself if given).

        Raises
        ------
        SwapError
            No name starts with ``prefix``; or as :meth:`swap_in`.
        """
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        import torch
        self._check_open()
        names = self.names(prefix)
        if not names:
            raise SwapError(f"no tensor whose name starts with {prefix!r} is swapped out in "
                            f"{self._dir!r}")
        result: dict[str, Any] = {} if state_dict is None else state_dict
        futs: list[concurrent.futures.Future[torch.Tensor]] = []
        try:
            for n in names:
                key = n[len(prefix):]
                cur = result.get(key)
                out = cur if isinstance(cur, torch.Tensor) else None
                f = self.swap_in(n, out=out, device=device, verify=verify, async_op=True)
                assert isinstance(f, concurrent.futures.Future)
                futs.append(f)
        except BaseException:
            concurrent.futures.wait(futs)
            raise

        def finish() -> dict[str, torch.Tensor]:
            concurrent.futures.wait(futs)
            for f in futs:
                exc = f.exception()
                if exc is not None:
                    raise exc
            for n, f in zip(names, futs):
                result[n[len(prefix):]] = f.result()
            return result

        if not async_op:
            return finish()
        with self._lock:
            fut = self._coord.submit(finish)
            self._track(fut)
        return fut

    # -- removal ---------------------------------------------------------------------------
    def remove(self, name: str, *, force: bool = False) -> None:
        """Delete the swap of ``name`` (manifest first, then its file).

        Raises
        ------
        SwapError
            Unknown name; or the tensor was released and is still waiting to be swapped in
            (its data would be lost): swap it in first or pass ``force=True``.
        """
        self.remove_many([name], force=force)

    def remove_many(self, names: list[str], *, force: bool = False) -> None:
        """Delete several swaps with one manifest update (see :meth:`remove`)."""
        self._check_open()
        for n in names:
            if not isinstance(n, str):
                raise TypeError(f"swap names are str, got {type(n).__name__}")
        ev = self._claim(names, True)
        try:
            with self._lock:
                for n in names:
                    self._lookup(n)
                    if n in self._released and not force:
                        raise SwapError(f"{n!r} was swapped out with release=True and not "
                                        f"swapped in yet; removing it loses its data (swap it "
                                        f"in first, or pass force=True)")
            self._commit(_Pending([], list(names)))
            with self._lock:
                for n in names:
                    self._forget_release(n)
        finally:
            self._unclaim(names, ev)

    def clear(self, *, force: bool = False) -> None:
        """Delete every swap in the directory (see :meth:`remove`)."""
        self.remove_many(self.names(), force=force)

    # -- manifest --------------------------------------------------------------------------
    def _claim(self, names: list[str], overwrite: bool) -> threading.Event:
        """Wait until no operation is in flight on ``names``, then mark them busy."""
        if len(set(names)) != len(names):
            raise SwapError("the same name appears twice in one request")
        while True:
            with self._lock:
                self._check_open()
                waits = [self._busy[n] for n in names if n in self._busy]
                if not waits:
                    if not overwrite:
                        taken = [n for n in names if n in self._entries]
                        if taken:
                            raise SwapError(f"{taken[0]!r} is already swapped out in "
                                            f"{self._dir!r}; pass overwrite=True to replace it"
                                            + (f" ({len(taken)} names taken)"
                                               if len(taken) > 1 else ""))
                    ev = threading.Event()
                    for n in names:
                        self._busy[n] = ev
                    return ev
            for w in waits:
                w.wait()

    def _unclaim(self, names: list[str], ev: threading.Event) -> None:
        with self._lock:
            for n in names:
                if self._busy.get(n) is ev:
                    del self._busy[n]
        ev.set()

    def _commit(self, change: _Pending) -> None:
        """Publish ``change`` durably (group commit with concurrent changes)."""
        with self._lock:
            self._staged.append(change)
        with self._commit_lock:
            if not change.done:
                with self._lock:
                    batch, self._staged = self._staged, []
                    new = dict(self._entries)
                    for p in batch:
                        for e in p.puts:
                            old = new.get(e.name)
                            if old is not None:
                                p.obsolete.append(old.file)
                            new[e.name] = e
                        for n in p.deletes:
                            old = new.pop(n, None)
                            if old is not None:
                                p.obsolete.append(old.file)
                try:
                    self._write_manifest(new)
                except BaseException as exc:
                    for p in batch:
                        p.error, p.done = exc, True
                        for e in p.puts:
                            self._unlink(e.file)
                else:
                    with self._lock:
                        self._entries = new
                    for p in batch:
                        p.done = True
                        for f in p.obsolete:
                            self._unlink(f)
        if change.error is not None:
            raise change.error

    def _write_manifest(self, entries: Mapping[str, _Entry]) -> None:
        items = sorted(entries.values(), key=lambda e: e.seq)
        doc = {"format": _FORMAT, "version": _VERSION, "seq": self._seq,
               "entries": [e.to_json() for e in items]}
        data = json.dumps(doc, ensure_ascii=True, separators=(",", ":")).encode("ascii")
        tmp = os.path.join(self._dir, _MANIFEST_TMP)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | os.O_NOFOLLOW,
                     0o644)
        try:
            try:
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view):]
                os.fsync(fd)
            finally:
                os.close(fd)
            _fsync_dir(self._dir_fd)     # the data files it names are durable entries first
            os.replace(tmp, os.path.join(self._dir, MANIFEST_NAME))
        except BaseException:
            self._unlink(_MANIFEST_TMP)
            raise
        _fsync_dir(self._dir_fd)

    def _unlink(self, fname: str) -> None:
        try:
            os.unlink(os.path.join(self._dir, fname))
        except FileNotFoundError:
            pass
        except OSError as exc:      # an orphan is removed at the next open anyway
            _log.warning("could not remove %s from %s: %s", fname, self._dir, exc)

    # -- futures, closing ------------------------------------------------------------------
    def _run(self, job: Callable[[], _T], async_op: bool) -> _T | concurrent.futures.Future[_T]:
        if not async_op:
            return job()
        with self._lock:
            self._check_open()
            fut = self._pool.submit(job)
            self._track(fut)
        return fut

    def _check_open(self) -> None:
        if self._closed:
            raise HandleClosedError(f"TensorSwapper of {self._dir!r} is closed")
        if self._handle.closed:
            raise HandleClosedError(f"the AioHandle of TensorSwapper {self._dir!r} is closed")

    def _track(self, fut: concurrent.futures.Future[Any]) -> None:
        """Remember an async future for wait(); called with ``self._lock`` held."""
        self._outstanding[fut] = None
        self._async_count += 1
        fut.add_done_callback(self._settled)

    def _settled(self, fut: concurrent.futures.Future[Any]) -> None:
        if fut.cancelled() or fut.exception() is None:
            with self._lock:
                self._outstanding.pop(fut, None)

    def wait(self) -> int:
        """Finish every asynchronous swap started so far; return how many were started.

        Returns 0 when none were started since the last ``wait()``. All run to the end, then
        the first error (in submission order) is raised.
        """
        count = 0
        first: BaseException | None = None
        while True:
            with self._lock:
                batch = list(self._outstanding)
                count += self._async_count
                self._async_count = 0
            if not batch:
                break
            concurrent.futures.wait(batch)
            with self._lock:
                for f in batch:
                    self._outstanding.pop(f, None)
            for f in batch:
                exc = None if f.cancelled() else f.exception()
                if exc is not None and first is None:
                    first = exc
        if first is not None:
            raise first
        return count

    def close(self) -> None:
        """Wait for in-flight swaps, then release the directory (the data stays).

        Idempotent. The handle is closed only when the swapper created it. Errors of
        unfinished asynchronous swaps stay in their futures. Released tensors not swapped
        in stay empty; their data stays in the directory for a later swapper.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        while True:
            with self._lock:
                batch = [f for f in self._outstanding if not f.done()]
            if not batch:
                break
            concurrent.futures.wait(batch)
        self._coord.shutdown(wait=True)
        self._pool.shutdown(wait=True)
        try:
            if self._own_handle:
                self._handle.close()
        finally:
            self._unlock()

    def destroy(self, *, force: bool = False) -> None:
        """Delete every swap, aioswap's own files, and the directory if aioswap created it.

        Only the manifest, the lock and marker files and files of the data-file pattern are
        removed; the directory is removed (``os.rmdir``, never a tree) only when a swapper
        created it and it is empty then. Closes the swapper.

        Raises
        ------
        SwapError
            Released tensors are waiting to be swapped in (pass ``force=True``).
        """
        self.clear(force=force)
        self.wait()
        with self._commit_lock:      # still locked: nobody else can be using the directory
            for fname in os.listdir(self._dir):
                if _DATA_RE.fullmatch(fname) or fname in (MANIFEST_NAME, _MANIFEST_TMP):
                    self._unlink(fname)
        created = self._created
        self._unlink(_CREATED_NAME)
        self.close()
        self._unlink(_LOCK_NAME)
        if created:
            try:
                os.rmdir(self._dir)
            except OSError as exc:
                _log.warning("kept swap directory %s: %s", self._dir, exc)

    def __enter__(self) -> TensorSwapper:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        if not getattr(self, "_closed", True):
            warnings.warn(f"unclosed {self!r}", ResourceWarning, stacklevel=2)
            try:
                self.close()
            except Exception:
                pass
