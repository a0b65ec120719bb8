"""TensorSwapper: named tensors and state dicts to swap files on NVMe and back, crash-safe.

Storage format (version 2; version-1 directories are read, and rewritten as version 2 at
their first change)
------------------------------------------------------------------------------------------
A swap directory holds, besides whatever else was already in it:

``aioswap-manifest.json``
    The only thing that makes a swap visible. JSON: ``{"format": "aioswap-swap",
    "version": 2, "seq": N, "packs": {file: size}, "entries": [...]}``; each entry has
    ``name`` (any ``str``), ``file``, ``offset``, ``nbytes``, ``dtype`` (``"float32"``...),
    ``shape``, ``stride``, ``storage_offset`` (of the tensor that was swapped out),
    ``checksum`` (hex or null), ``checksum_algo`` (``"xxh3_64"``, ``"crc32"`` or null) and
    ``seq`` (submission order). ``packs`` records the size of every pack file; ``trees``
    (only when there are any) maps the prefix of each nested state to the names of its
    tensors and its skeleton, plain JSON (see ``aioswap._tree``), dropped with any of those
    tensors. Replaced
    atomically: written to ``aioswap-manifest.json.tmp``, fsynced, the directory fsynced (so
    the data files it names are durable entries), ``os.replace``'d, the directory fsynced
    again. Version 1 is the same without ``packs`` (every file is a single-tensor file).
``p-<32 hex>.bin`` (packs, version 2)
    The tensors of one :meth:`TensorSwapper.swap_out_state_dict` call, each at a 4096-byte
    aligned offset, in dict order; a new pack is started when the next tensor would take it
    past ``pack_bytes`` (default 1 GiB; a larger tensor gets a pack of its own). The gaps are
    holes; the file is extended to a multiple of 4096, so every tensor can be read with
    aligned direct I/O. Written once, never modified.
``t-<32 hex>-<16 hex>.bin`` (single tensors)
    One tensor of :meth:`TensorSwapper.swap_out`: exactly ``nbytes`` bytes, no header, no
    padding. The first part is the SHA-256 of the UTF-8 name (``surrogatepass``), the second
    is random, so every write goes to a new file.
``aioswap.lock``
    ``flock``-ed for as long as a swapper has the directory open; a second swapper, in this
    process or another, gets a :class:`~aioswap.errors.SwapError` naming the holder's pid.
``aioswap-owner.json``
    Which swapper set the directory belongs to (:mod:`aioswap._owner`): a random set id,
    ``"primary"`` (holds the manifest) or ``"member"`` (holds parts of striped files), and
    the device and inode of the directory and of the set's primary. A swapper uses only
    directories of its own set (or without a record, which it then claims), so it never
    removes another's files; with several directories the primary is found by its record,
    whatever their order. Two paths to one directory (bind mounts) are refused.
``aioswap-created``
    Present only when the swapper created the directory; :meth:`TensorSwapper.destroy`
    removes the directory only then (with ``os.rmdir``: never a tree).
``orphans/``
    Only when a directory without a manifest held aioswap data files, or a directory first
    claimed by this swapper (no owner record yet) held data files its manifest does not
    name: they are moved there (with a ``RuntimeWarning``), never deleted, since nothing says
    what they hold.

In tensor data, elements are in row-major (C-contiguous) order. Data files, manifest, lock
and marker are created with mode ``mode`` (default 0600: swapped tensors are often weights or
optimizer state), a directory the swapper creates with the matching directory mode (0700);
existing directories keep their mode. Data files are never opened through a symbolic link and
must be regular files (``O_NOFOLLOW|O_NONBLOCK``, then ``fstat``), so a planted link or FIFO is
refused, never followed or waited on.

Crash safety: data is written and fsynced to new files before the manifest that names it is
published, so a crash at any point leaves either the old or the new manifest, each naming
only complete, durable files. An error that arrives after the new manifest was renamed into
place (a failed final directory fsync, a signal) is raised, but the change stays published
and nothing either manifest names is deleted. Files no manifest names (an interrupted swap,
an old version whose unlink was interrupted, the parts of a failed striped swap-out) are
removed at the next open in every directory of the set, and so are stale temporaries of the
manifest, the owner record and stripe layouts. Nothing else in the directories is ever
touched.

Space: a data file is deleted as soon as no published entry names it (per-file reference
counting, after the manifest that dropped the last entry is durable; files an overwrite made
obsolete are unlinked on a background thread, done when :meth:`TensorSwapper.wait`
returns, while :meth:`TensorSwapper.remove` waits for them). Overwriting or removing
one tensor of a pack leaves a dead range in it and never rewrites the live neighbours;
:meth:`TensorSwapper.compact` rewrites the packs whose live bytes fell below a fraction of
their size (default one half) into new packs, and :meth:`TensorSwapper.pack_usage` shows it.

Checksums: ``xxh3_64`` (the ``xxhash`` package) when installed, else ``zlib.crc32``; the
algorithm is recorded per entry. They are computed on swap-out while the writes are in
flight, and checked on swap-in when ``verify`` is on, each tensor (or 64 MiB chunk of a large
one) as soon as it has landed, while the later reads are still in flight. The file size is
checked against the manifest before any I/O, so a truncated or extended file is reported,
never read.

Batched I/O: a state dict goes out as one request per tensor, all submitted before any is
waited for (async ``pwrite``), then one fsync per pack file and one manifest commit; it comes
back the same way (async ``pread`` per tensor, then one wait). Every request is block-aligned:
tensors up to 64 KiB, and the partial last block of larger ones, are written from one
zero-padded page-locked slab. Fresh CPU destinations of ``swap_in_state_dict`` are
page-locked (``aioswap.pinned.empty(strict=False)``, read with direct I/O, no bounce copy;
where ``RLIMIT_MEMLOCK`` refuses the lock, aioswap's own unlocked memory, read direct all
the same) up to ``pin_budget`` bytes per call, and plain memory beyond it; fresh tensors up
to 64 KiB are read through one locked slab and copied into plain memory. Fresh memory is
faulted in on a few threads that submit each tensor's read as soon as its memory is there,
so the faults overlap each other and the reads in flight.

Release: ``release=True`` frees a tensor's storage (``untyped_storage().resize_(0)``) once its
write is durable and published; ``swap_in`` without ``out`` resizes the same storage back and
reads into it, so every existing reference (views included) sees the data again, with its
own layout. Only tensors that span their whole, resizable storage can be released (tensors
returned in page-locked memory cannot: pass ``pin_memory=False`` to get plain ones).

Concurrency: asynchronous swaps run on the swapper's worker threads (``max_inflight``); their
I/O goes through the handle. Non-contiguous tensors are made contiguous first; those copies
are bounded by ``staging_bytes`` (one tensor larger than that still goes, alone). Manifest
updates of concurrent completions are batched (group commit). Operations on one name are
ordered (a swap-in waits for that name's swap-out in flight).

Several ranks: :meth:`TensorSwapper.for_rank` gives each rank its own directory under one of
several roots (one per drive), ranks spread over the roots round-robin.

Layout: this module is the swapper's face (names, claims, state dicts, removal, futures);
its data files are :mod:`aioswap._swap_files`, its writes :mod:`aioswap._swap_write`, its
reads once planned :mod:`aioswap._swap_read`, what they share :mod:`aioswap._swap_common`,
and the directory and manifest :mod:`aioswap._manifest`.
"""
from __future__ import annotations

import concurrent.futures
import functools
import logging
import os
import resource
import threading
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, TypeVar

from aioswap import _adaptive, _checksum, _tree
from aioswap._claims import NameClaims, Releases, storage_key
from aioswap._manifest import (LOCK_NAME, MANIFEST_NAME, Change, Entry, Manifest,
                               SwapDirectory, Tree)
from aioswap._swap_common import PACK_ALIGN, dtype_from_name, dtype_name, round_pack
from aioswap._swap_files import DataFile, DataFiles
from aioswap._swap_read import Device, ReadJob, ReadPlan, check_out, execute
from aioswap._swap_write import ByteBudget, WriteJob, check_tensor, write_packs, write_single
from aioswap._util import wait_all
from aioswap.config import AioConfig
from aioswap.errors import ChecksumError, HandleClosedError, SwapError
from aioswap.handle import AioHandle

if TYPE_CHECKING:
    import torch

__all__ = ["DEFAULT_PACK_BYTES", "DEFAULT_PIN_BUDGET", "MANIFEST_NAME", "PACK_ALIGN",
           "SwapInfo", "TensorSwapper", "checksum_algorithms", "current_rank"]

_log = logging.getLogger("aioswap")

#: Default cap on the size of one pack file.
DEFAULT_PACK_BYTES = 1 << 30
#: Default bytes of page-locked destinations that one ``swap_in_state_dict`` may allocate.
DEFAULT_PIN_BUDGET = 4 << 30
_DEFAULT_STAGING = 64 << 20

_T = TypeVar("_T")


def checksum_algorithms() -> list[str]:
    """Checksum algorithms usable here, fastest first (``"crc32"`` is always available)."""
    return _checksum.algorithms()


# ----------------------------------------------------------------------------------------
# Small helpers


def _torch() -> Any:
    """torch, imported on first use so that ``import aioswap`` does not need it."""
    try:
        import torch
    except ImportError as exc:      # pragma: no cover - torch is a test dependency
        raise ImportError("TensorSwapper needs PyTorch (pip install torch)") from exc
    return torch


def current_rank() -> tuple[int, int]:
    """``(rank, local_rank)`` of this process.

    ``rank``: ``torch.distributed.get_rank()`` when a process group is initialized, else the
    ``RANK`` environment variable, else ``LOCAL_RANK``, else 0. ``local_rank``: ``LOCAL_RANK``
    when set (torchrun sets it), else ``rank``.
    """
    def env(name: str) -> int | None:
        v = os.environ.get(name)
        if v is None or not v.strip():
            return None
        try:
            return int(v)
        except ValueError:
            raise ValueError(f"environment variable {name}={v!r} is not an integer") from None

    rank: int | None = None
    try:
        import torch.distributed as dist
        if dist.is_available() and dist.is_initialized():
            rank = int(dist.get_rank())
    except ImportError:             # pragma: no cover - torch is a dependency here
        pass
    local = env("LOCAL_RANK")
    if rank is None:
        rank = env("RANK")
    if rank is None:
        rank = local if local is not None else 0
    return rank, (local if local is not None else rank)


# ----------------------------------------------------------------------------------------
# Records


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


# ----------------------------------------------------------------------------------------
# The swapper


class TensorSwapper:
    """Swaps named tensors and state dicts out to files in ``directory`` and back.

    Parameters
    ----------
    directory : str or os.PathLike, or a list or tuple of them
        The swap directory. Created (with parents; the directory itself with mode 0700, see
        ``mode``) when missing, and then marked as created by aioswap; an existing directory
        is used as it is, and only aioswap's own files in it are ever written or removed.
        Completed swaps found in it are restored.

        Several directories (one per drive, e.g. ``["/nvme0/swap", "/nvme1/swap"]``): every
        data file written is striped over all of them (:mod:`aioswap.stripe`: each drive its
        own queue, stripe units dealt to the drives in turn, weighted by their measured speed,
        so a slower drive takes less). Each directory records that it belongs to this swapper
        (``aioswap-owner.json``: the swapper set's id, the device and inode of the
        directory and of the one holding the manifest), so a directory of another swapper
        is refused (nothing of it is ever deleted), two paths to one directory (a bind
        mount) are refused, and the directories can be given in any order when reopening.
        Each directory is locked while the swapper is open. Files written with fewer
        directories stay readable after one is added; a striped file read without one of
        its directories is refused, naming the parts found.
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
        Worker threads running asynchronous swaps (operations in flight at once).
    staging_bytes : int, optional
        Bound on the contiguous copies made of non-contiguous tensors in flight; default the
        handle's bounce pool size (64 MiB if it does not say). A single tensor larger than
        this is still staged, alone.
    pin_memory : bool or None
        Where fresh CPU tensors that swap-ins create live. None (default): those of
        :meth:`swap_in_state_dict` in page-locked memory (``aioswap.pinned.empty(strict=
        False)``: direct I/O straight into them) up to ``pin_budget`` bytes per call, plain
        memory beyond; those of :meth:`swap_in`, plain memory. True: every fresh CPU tensor
        page-locked. False: never. Page-locked tensors cannot be released by
        ``release=True`` later (their storage is not resizable).
    pin_budget : int, optional
        Bytes of page-locked memory one :meth:`swap_in_state_dict` call may allocate with
        ``pin_memory=None``; default :data:`DEFAULT_PIN_BUDGET` (4 GiB), at most half of
        ``RLIMIT_MEMLOCK`` when that is finite and the process is not root.
    pack_bytes : int
        Cap on the size of one pack file written by :meth:`swap_out_state_dict` (default
        :data:`DEFAULT_PACK_BYTES`, 1 GiB); a tensor larger than the cap gets its own pack.
    mode : int
        Permission bits of the files the swapper creates (data, manifest, lock, marker),
        default 0o600; a directory it creates gets the same bits plus x where r or w is set
        (0o700 for 0o600). Set exactly (``fchmod``), whatever the umask.
    read : {"auto", "direct", "buffered"}, optional
        How swap-ins read a tensor of a one-directory swap (:mod:`aioswap._adaptive`):
        ``"auto"`` copies what the page cache holds (a few threads, ``pread``) and reads the
        rest direct; ``"direct"`` reads every byte from the drive; ``"buffered"`` through
        the page cache. Default: ``AIOSWAP_READ``, else ``"auto"``. Striped files are read
        direct.

    Raises
    ------
    SwapError
        Another swapper holds the directory, or its manifest is unreadable, malformed or
        from a newer version of aioswap.
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
                 staging_bytes: int | None = None, pin_memory: bool | None = None,
                 pin_budget: int | None = None, pack_bytes: int = DEFAULT_PACK_BYTES,
                 mode: int = 0o600, read: str | None = None) -> None:
        self._closed = True          # until the directory is locked (for __del__)
        if handle is not None and config is not None:
            raise ValueError("pass either handle or config, not both")
        if max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {max_inflight}")
        if not isinstance(pack_bytes, int) or pack_bytes < PACK_ALIGN:
            raise ValueError(f"pack_bytes must be an int >= {PACK_ALIGN}, got {pack_bytes!r}")
        if pin_budget is not None and (not isinstance(pin_budget, int) or pin_budget < 0):
            raise ValueError(f"pin_budget must be an int >= 0, got {pin_budget!r}")
        if not isinstance(mode, int) or isinstance(mode, bool) or not 0 <= mode <= 0o777:
            raise ValueError(f"mode must be permission bits in 0..0o777, got {mode!r}")
        if mode & 0o600 != 0o600:
            raise ValueError(f"mode {mode:#o} must let the owner read and write (0o600)")
        if read is not None:
            _adaptive.read_mode(read)           # a bad value: ValueError now
        if checksum == "auto":
            checksum = checksum_algorithms()[0]
        if checksum is not None:
            _checksum.new_hasher(checksum)    # unknown or missing algorithm: fail now
        if handle is not None and handle.closed:
            raise HandleClosedError("TensorSwapper given a closed AioHandle")
        _torch()
        if isinstance(directory, (list, tuple)):
            if not directory:
                raise ValueError("TensorSwapper needs at least one directory")
            dirs = [os.path.abspath(os.fspath(d)) for d in directory]
        else:
            dirs = [os.path.abspath(os.fspath(directory))]
        self._verify = bool(verify)
        self._algo = checksum
        self._pin = pin_memory if pin_memory is None else bool(pin_memory)
        self._pin_budget = DEFAULT_PIN_BUDGET if pin_budget is None else pin_budget
        self._pack_bytes = pack_bytes
        self._read = read
        self._lock = threading.RLock()            # entries, busy, released, futures
        self._claims = NameClaims(self._lock)
        self._released = Releases()                # guarded by self._lock
        # async futures not yet reported by wait(): pending ones and failed ones (a success
        # drops out when it completes, so a long run that never waits does not grow this)
        self._outstanding: dict[concurrent.futures.Future[Any], None] = {}
        self._async_count = 0
        self._dir = SwapDirectory(dirs, mode)
        self._path = self._dir.path
        try:
            self._m = Manifest(self._dir, self._lock)
            self._own_handle = handle is None
            self._handle = (AioHandle.from_config(config or AioConfig()) if handle is None
                            else handle)
        except BaseException:
            self._dir.close()
            raise
        if staging_bytes is None:
            pool = getattr(self._handle, "bounce_pool_bytes", None)
            cap = pool if isinstance(pool, int) and pool > 0 else _DEFAULT_STAGING
        else:
            cap = int(staging_bytes)
        self._staging = ByteBudget(max(1, cap))
        self._files = DataFiles(self._dir, self._handle, mode)
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_inflight, thread_name_prefix="aioswap-swap")
        self._alloc_lanes = max(1, min(4, (os.cpu_count() or 1)))
        self._allocators: concurrent.futures.ThreadPoolExecutor | None = None
        self._closed = False

    @classmethod
    def for_rank(cls, roots: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                 rank: int | None = None, local_rank: int | None = None,
                 name: str = "rank{rank}", **kwargs: Any) -> TensorSwapper:
        """A swapper on this rank's own directory, under one of several roots (drives).

        Parameters
        ----------
        roots : path or sequence of paths
            One root per drive (e.g. ``["/nvme0/swap", "/nvme1/swap"]``).
        rank, local_rank : int, optional
            Default :func:`current_rank`: ``torch.distributed.get_rank()`` when initialized,
            else ``RANK``/``LOCAL_RANK`` from the environment, else 0.
        name : str
            Directory name under the root, formatted with ``rank`` and ``local_rank``.
        **kwargs
            Passed to :class:`TensorSwapper`.

        Returns
        -------
        TensorSwapper
            On ``roots[local_rank % len(roots)] / name.format(rank=rank, ...)``: the ranks of
            one node are spread round-robin over its drives (node-local ranks, since drives
            are node-local), and the directory name is unique per global rank, so ranks never
            share a directory even on a shared file system.

        Raises
        ------
        ValueError
            No roots, or a negative rank.
        """
        if isinstance(roots, (str, os.PathLike)):
            roots = [roots]
        roots = list(roots)
        if not roots:
            raise ValueError("for_rank needs at least one root directory")
        if rank is None or local_rank is None:
            r, lr = current_rank()
            rank = r if rank is None else rank
            local_rank = lr if local_rank is None else local_rank
        if rank < 0 or local_rank < 0:
            raise ValueError(f"rank and local_rank must be >= 0, got {rank}, {local_rank}")
        root = os.fspath(roots[local_rank % len(roots)])
        return cls(os.path.join(root, name.format(rank=rank, local_rank=local_rank)), **kwargs)

    # -- properties ------------------------------------------------------------------------
    @property
    def directory(self) -> str:
        """Absolute path of the swap directory that holds the manifest (with several, the
        one whose owner record says so, whatever the order they were given in)."""
        return self._path

    @property
    def directories(self) -> tuple[str, ...]:
        """Absolute paths of every swap directory, :attr:`directory` first; data files are
        striped over them when there are several."""
        return (self._path, *self._dir.extra)

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
        return self._dir.created

    @property
    def checksum_algo(self) -> str | None:
        """Algorithm used for new swaps (None: no checksums)."""
        return self._algo

    def __repr__(self) -> str:
        state = " closed" if self._closed else f" {len(self._m.entries)} tensors"
        return f"<TensorSwapper {self._path!r}{state}>"

    def __len__(self) -> int:
        return len(self._m.entries)

    def __contains__(self, name: object) -> bool:
        return name in self._m.entries

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
        return [e.name for e in self._m.snapshot()
                if prefix is None or e.name.startswith(prefix)]

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
        return SwapInfo(e.name, self._dir.join(e.file), e.offset, e.nbytes,
                        dtype_from_name(e.dtype), e.shape, e.stride, e.storage_offset,
                        e.checksum, e.checksum_algo, released)

    def pack_usage(self) -> dict[str, tuple[int, int]]:
        """Per pack file (absolute path): (bytes of live tensors, file size)."""
        with self._lock:
            usage = self._m.live_bytes()
        return {self._dir.join(f): v for f, v in sorted(usage.items())}

    def _lookup(self, name: str) -> Entry:
        if not isinstance(name, str):
            raise TypeError(f"swap names are str, got {type(name).__name__}")
        e = self._m.entries.get(name)
        if e is None:
            raise SwapError(f"no tensor named {name!r} is swapped out in {self._path!r}")
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
            and the partial file is removed. An error raised after the new manifest was in
            place (its final directory fsync) leaves the swap published.
        HandleClosedError
            The swapper (or its handle) is closed.
        """
        t = self._check_tensor(name, tensor, release)
        ev = self._claim([name], overwrite)
        try:
            with self._lock:
                seq = self._m.next_seq(1)

            def job() -> SwapInfo:
                try:
                    entry = write_single(name, t, seq, files=self._files,
                                         staging=self._staging, algo=self._algo)
                    self._m.commit(Change([entry], [], files=[entry.file]))
                    with self._lock:
                        self._released.overwritten(name, tensor, release)
                    return self.info(name)
                finally:
                    self._unclaim([name], ev)

            return self._run(job, async_op)
        except BaseException:
            self._unclaim([name], ev)
            raise

    def _check_tensor(self, name: str, tensor: Any, release: bool) -> torch.Tensor:
        """Validate a tensor to swap out before any I/O; return the bytes to write."""
        self._check_open()
        return check_tensor(name, tensor, release)

    def _write_packs(self, jobs: list[WriteJob], what: str) -> Change:
        """Write ``jobs`` into new packs (:func:`aioswap._swap_write.write_packs`)."""
        return write_packs(jobs, what, files=self._files, staging=self._staging,
                           algo=self._algo, pack_bytes=self._pack_bytes)

    # -- swap in ---------------------------------------------------------------------------
    def swap_in(self, name: str, *, out: torch.Tensor | None = None, device: Device = None,
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
            swapped out with ``release=True`` in this swapper; else a new contiguous tensor
            (page-locked with ``pin_memory=True``).

        Raises
        ------
        SwapError
            Unknown name; ``out`` of the wrong shape, dtype or without storage; the data file
            is missing, not a regular file (a symlink, a FIFO) or its size differs from the
            manifest (truncated or extended: checked before any I/O).
        ChecksumError
            The bytes read do not match the checksum (``verify``). A tensor being restored in
            place is released again; ``out`` holds the unverified bytes.
        OSError
            The read failed.
        """
        if not isinstance(name, str):
            raise TypeError(f"swap names are str, got {type(name).__name__}")
        futs, job = self._start_reads([(name, out)], device, verify, self._pin is True, 0)
        fut = futs[0]
        if job is None:
            pass
        elif async_op:
            with self._lock:
                try:
                    self._check_open()
                    self._pool.submit(job)
                except BaseException as exc:
                    job.cancel(exc)
                    raise
                self._track(fut)
        else:
            job()
        return fut if async_op else fut.result()

    def _start_reads(self, items: list[tuple[str, torch.Tensor | None]], device: Device,
                     verify: bool | None, pin: bool, budget: int
                     ) -> tuple[list[concurrent.futures.Future[torch.Tensor]], ReadJob | None]:
        """Plan and open one batch of reads (all checks before any I/O).

        Returns one future per item and the job that runs the batch (None: nothing to read
        here, every item is restored by a swap-in already in flight).
        """
        self._check_open()
        verify = self._verify if verify is None else bool(verify)

        def plan() -> list[ReadPlan]:
            self._check_open()
            return self._plan_reads(items, device, verify)

        plans = self._claims.when_free([n for n, _ in items], plan)
        fds: dict[str, DataFile] = {}
        try:
            self._open_files(plans, fds)
        except BaseException as exc:
            for f in fds.values():
                f.close()
            self._abandon(plans, exc)
            raise
        futs = [p.shared if p.shared is not None else p.fut for p in plans]
        if all(p.shared is not None for p in plans):
            return futs, None
        return futs, ReadJob(functools.partial(self._execute, plans, fds, verify, pin, budget),
                             fds, functools.partial(self._abandon, plans))

    def _plan_reads(self, items: list[tuple[str, torch.Tensor | None]], device: Device,
                    verify: bool) -> list[ReadPlan]:
        """Validate reads before any I/O; called with ``self._lock`` held."""
        import torch
        plans: list[ReadPlan] = []
        seen: set[str] = set()
        for name, out in items:
            e = self._lookup(name)
            if name in seen:
                raise SwapError(f"{name!r} appears twice in one request")
            seen.add(name)
            rel = self._released.get(name)
            if out is not None and rel is not None and out is rel.tensor:
                out = None
            restore = rel if out is None else None
            fut: concurrent.futures.Future[torch.Tensor] = concurrent.futures.Future()
            plan = ReadPlan(name, e, out, restore, fut, device)
            if restore is not None:
                pending = self._released.restoring(name)
                if pending is not None:
                    plan.shared = pending
                    plans.append(plan)
                    continue
                if device is not None and torch.device(device) != restore.tensor.device:
                    raise SwapError(f"swap_in of {name!r}: the tensor was released on "
                                    f"{restore.tensor.device} and is restored there, not on "
                                    f"{torch.device(device)}; pass out= to read elsewhere")
            dtype = dtype_from_name(e.dtype)
            numel = 1
            for s in e.shape:
                numel *= s
            if numel * dtype.itemsize != e.nbytes:
                raise SwapError(f"manifest entry of {name!r} is inconsistent: shape {e.shape} "
                                f"of {e.dtype} is not {e.nbytes} bytes")
            if out is not None:
                check_out(name, e, out, dtype)
            if verify and e.checksum_algo is not None:
                _checksum.new_hasher(e.checksum_algo)        # algorithm available?
            plans.append(plan)
        for p in plans:
            if p.shared is None and p.restore is not None:
                self._released.begin_restore(p.name, p.fut)
        return plans

    def _open_files(self, plans: list[ReadPlan], fds: dict[str, DataFile]) -> None:
        """Open every data file of ``plans`` once and check its size (before any I/O)."""
        sizes: dict[str, int] = {}
        for p in plans:
            if p.shared is not None:
                continue
            e = p.entry
            who = f"swap_in of {p.name!r}"
            if e.file not in fds:
                fds[e.file], size = self._files.open(e.file, who)
                sizes[e.file] = size
                with self._lock:
                    expected = self._m.expected_size(e)
                path = self._dir.join(e.file)
                if size != expected:
                    fds.pop(e.file).close()
                    what = "truncated" if size < expected else "longer than recorded"
                    raise SwapError(f"{who}: data file {path!r} is {what}: it has {size} "
                                    f"bytes, the manifest records {expected} bytes ({e.nbytes} "
                                    f"bytes at offset {e.offset} for this tensor; the file "
                                    f"was changed after swap_out)")
            p.file_size = sizes[e.file]
            if e.offset + e.nbytes > p.file_size:
                raise SwapError(f"{who}: the manifest places it past the end of "
                                f"{self._dir.join(e.file)!r}")

    def _abandon(self, plans: list[ReadPlan], exc: BaseException) -> None:
        """Fail the futures of plans that will not run."""
        with self._lock:
            for p in plans:
                self._released.end_restore(p.name, p.fut)
        for p in plans:
            if p.shared is None and not p.fut.done():
                p.fut.set_exception(exc)

    def _alloc_pool(self) -> concurrent.futures.ThreadPoolExecutor:
        with self._lock:
            if self._allocators is None:
                self._allocators = concurrent.futures.ThreadPoolExecutor(
                    self._alloc_lanes, thread_name_prefix="aioswap-swap-alloc")
            return self._allocators

    def _check_piece_sums(self, p: ReadPlan, verify: bool) -> None:
        """Wait for the reads of ``p``; with ``verify``, check what landed against its checksum."""
        e = p.entry
        algo = e.checksum_algo if verify else None
        h = _checksum.new_hasher(algo) if algo is not None else None
        for f, s, n in p.pieces:
            f.result()
            if h is not None and p.flat is not None and n > 0:
                h.update(_checksum.host_bytes(p.flat[s:], n))
        if algo is None:
            return
        assert p.dest is not None
        if p.flat is None:
            got = _checksum.digest(p.dest, algo)
        else:
            assert h is not None
            got = str(h.hexdigest())
        if got != e.checksum:
            raise ChecksumError(f"swap_in of {p.name!r}: checksum mismatch in "
                                f"{self._dir.join(e.file)!r} ({algo} of the {e.nbytes} bytes "
                                f"read at offset {e.offset} is {got}, swap_out recorded "
                                f"{e.checksum}): the file is corrupted")

    def _execute(self, plans: list[ReadPlan], fds: dict[str, DataFile], verify: bool, pin: bool,
                 budget: int) -> None:
        """Run a batch of reads (:func:`aioswap._swap_read.execute`) on this swapper's lanes."""
        execute(plans, fds, verify, pin, budget, alloc_lanes=self._alloc_lanes,
                alloc_pool=self._alloc_pool, read=self._read, check_sums=self._check_piece_sums,
                lock=self._lock, releases=self._released)

    # -- state dicts -----------------------------------------------------------------------
    def swap_out_state_dict(self, prefix: str, state_dict: Mapping[Any, Any], *,
                            release: bool = False, overwrite: bool = False,
                            async_op: bool = False
                            ) -> list[str] | concurrent.futures.Future[list[str]]:
        """Swap out a state: every tensor in ``state_dict``, however nested, all or nothing.

        The tensors are packed into one file (or several, each at most ``pack_bytes``), each
        at a 4096-byte aligned offset, written with one batch of asynchronous requests,
        fsynced once per file and published by one manifest update, so after a crash or a
        failed write either all of it is visible or none. ``release`` frees each tensor's
        storage after that update.

        A flat ``{str: tensor}`` dict stores each tensor as ``prefix + key``. Anything else
        (``optimizer.state_dict()``, ``model.state_dict()``, an LR scheduler's or RNG state:
        dicts, lists and tuples of tensors and plain values, to any depth) also stores its
        shape in the manifest as JSON (no pickle), and each tensor as ``prefix`` plus its path
        of keys and indices joined by ``"."`` (``"opt/state.0.exp_avg"``);
        :meth:`swap_in_state_dict` gives back an equal structure.

        Parameters
        ----------
        prefix : str
            Prepended to every name as it is (end it with a separator, e.g. ``"opt/"``, so
            that one prefix is not the start of another).
        state_dict : Mapping
            Values: tensors (see :meth:`swap_out`), dicts, lists, tuples, and None, bool, int,
            float (NaN and infinities too) and str. Keys: those plain values or tuples of
            them (int keys stay int). Lists and tuples stay apart; an ``OrderedDict`` comes
            back as one with its ``_metadata``; other subclasses come back as dict, list or
            tuple (an IntEnum as int).
        release, overwrite, async_op : bool
            As in :meth:`swap_out`, for every tensor. ``overwrite`` also replaces a state
            stored under the same prefix.

        Returns
        -------
        list of str or Future of it
            The names the tensors were stored under, in the order they were found (dict
            order, depth first).

        Raises
        ------
        SwapError, TypeError, OSError
            As :meth:`swap_out`, checked for every entry before any I/O where possible; a
            failed write publishes nothing. TypeError also for a value of another type
            (naming where it is), SwapError when two tensors would get the same name.
        """
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        if not isinstance(state_dict, Mapping):
            raise TypeError(f"swap_out_state_dict takes a mapping (a state dict), got "
                            f"{type(state_dict).__name__}")
        tree: Tree | None = None
        if _tree.is_flat(state_dict):
            flat = [(prefix + k, v) for k, v in state_dict.items()]
        else:
            skeleton, found = _tree.flatten(prefix, state_dict)
            flat = [(n, v) for n, _, v in found]
            tree = Tree(tuple(n for n, _ in flat), skeleton)
        items = [(n, v, self._check_tensor(n, v, release)) for n, v in flat]
        names = [n for n, _, _ in items]
        with self._lock:
            if not overwrite and tree is not None and prefix in self._m.trees:
                raise SwapError(f"a state is already swapped out as {prefix!r} in "
                                f"{self._path!r}; pass overwrite=True to replace it")
        if release:
            shared: dict[int, str] = {}
            for n, v, _ in items:
                if v.numel():
                    first = shared.setdefault(storage_key(v), n)
                    if first != n:
                        raise SwapError(f"swap_out_state_dict with release=True: {n!r} shares "
                                        f"its storage with {first!r} (tied tensors); swap "
                                        f"them out without release, or drop one of them")
        ev = self._claim(names, overwrite)
        try:
            with self._lock:
                seq0 = self._m.next_seq(len(items))
            jobs = [WriteJob(n, t, dtype_name(t.dtype), tuple(int(x) for x in t.shape),
                              tuple(int(x) for x in t.stride()), int(t.storage_offset()),
                              seq0 + i) for i, (n, _, t) in enumerate(items)]

            def finish() -> list[str]:
                try:
                    change = (self._write_packs(jobs, f"swap_out_state_dict({prefix!r})")
                              if jobs else Change([], []))
                    change.trees[prefix] = tree       # a flat dict drops an older skeleton
                    if jobs or tree is not None or prefix in self._m.trees:
                        self._m.commit(change)
                    with self._lock:
                        for n, tensor, _ in items:
                            self._released.overwritten(n, tensor, release)
                    return names
                finally:
                    self._unclaim(names, ev)

            return self._run(finish, async_op)
        except BaseException:
            self._unclaim(names, ev)
            raise

    def swap_in_state_dict(self, prefix: str, *, state_dict: dict[Any, Any] | None = None,
                           device: Device = None, verify: bool | None = None,
                           async_op: bool = False
                           ) -> dict[Any, Any] | concurrent.futures.Future[dict[Any, Any]]:
        """Swap in the state swapped out as ``prefix``.

        A state stored with its structure (anything but a flat ``{str: tensor}`` dict, see
        :meth:`swap_out_state_dict`) comes back as an equal structure: same keys (int keys as
        int), lists as lists, tuples as tuples, plain values as they were, every tensor read
        back, ready for ``optimizer.load_state_dict()``. Otherwise every tensor whose name
        starts with ``prefix`` comes back in a flat dict, keyed by the name without it.

        All reads are submitted before any is waited for (one batch); each tensor's checksum
        is checked as soon as it has landed. Fresh CPU tensors are page-locked up to
        ``pin_budget`` bytes (see ``pin_memory``); tensors released by ``release=True`` are
        restored in place, wherever they sit in the structure.

        Parameters
        ----------
        prefix : str
            As given to :meth:`swap_out_state_dict`.
        state_dict : dict, optional
            Fill this dict: a tensor it holds at a tensor's place (same keys and indices) is
            that tensor's ``out``; the state's top-level keys are then set in it (nested
            containers are new ones), other keys are kept.
        device, verify : optional
            As in :meth:`swap_in`.
        async_op : bool
            Return a :class:`concurrent.futures.Future` of the dict at once.

        Returns
        -------
        dict or Future of dict
            The state (an ``OrderedDict`` when one was swapped out), or ``state_dict`` itself
            filled with it. Flat: keys in the order the tensors were swapped out.

        Raises
        ------
        SwapError
            Nothing is stored under ``prefix``; or as :meth:`swap_in` (the first error, after
            every read has finished).
        """
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        import torch
        self._check_open()
        with self._lock:
            tree = self._m.trees.get(prefix)
        where = f"state {prefix!r} in {self._m.path!r}"
        paths = [] if tree is None else _tree.leaves(tree.skeleton, where)
        names = self.names(prefix) if tree is None else [n for n, _ in paths]
        if not names and tree is None:
            raise SwapError(f"no tensor whose name starts with {prefix!r} is swapped out in "
                            f"{self._path!r}")
        result: dict[Any, Any] = {} if state_dict is None else state_dict
        items: list[tuple[str, torch.Tensor | None]] = []
        for i, n in enumerate(names):
            cur = result.get(n[len(prefix):]) if tree is None else _tree.find(result, paths[i][1])
            items.append((n, cur if isinstance(cur, torch.Tensor) else None))
        budget = self._pin_budget_now() if self._pin is None else 0
        futs: list[concurrent.futures.Future[torch.Tensor]] = []
        job: ReadJob | None = None
        if items:
            futs, job = self._start_reads(items, device, verify, self._pin is True, budget)

        def finish() -> dict[Any, Any]:
            if job is not None:
                job()
            wait_all(futs)
            if tree is not None:
                state = _tree.build(tree.skeleton, {n: f.result() for n, f in zip(names, futs)},
                                    where)
                if not isinstance(state, dict):
                    raise SwapError(f"{where}: the stored state is not a dict")
                if state_dict is None:
                    return state
                result.update(state)
                return result
            for n, f in zip(names, futs):
                result[n[len(prefix):]] = f.result()
            return result

        if not async_op:
            return finish()
        with self._lock:
            try:
                self._check_open()
                fut = self._pool.submit(finish)
            except BaseException as exc:
                if job is not None:
                    job.cancel(exc)
                raise
            self._track(fut)
        return fut

    def _pin_budget_now(self) -> int:
        """The page-locked bytes one call may allocate (half of a finite RLIMIT_MEMLOCK)."""
        budget = self._pin_budget
        soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
        if os.geteuid() != 0 and soft != resource.RLIM_INFINITY:
            budget = min(budget, soft // 2)
        return budget

    # -- removal, compaction ---------------------------------------------------------------
    def remove(self, name: str, *, force: bool = False) -> None:
        """Delete the swap of ``name`` (manifest first, then its file when no longer used).

        A tensor in a pack leaves a dead range there; the pack file is deleted with its last
        live tensor (see :meth:`compact`).

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
            self._m.commit(Change([], list(names)))
            with self._lock:
                for n in names:
                    self._released.forget(n)
        finally:
            self._unclaim(names, ev)
        self._dir.drain()           # removing is for the space: give it back before returning

    def clear(self, *, force: bool = False) -> None:
        """Delete every swap in the directory, states included (see :meth:`remove`)."""
        self.remove_many(self.names(), force=force)
        with self._lock:
            drops: dict[str, Tree | None] = {p: None for p in self._m.trees}
        if drops:
            self._m.commit(Change([], [], trees=drops))

    def compact(self, threshold: float = 0.5) -> int:
        """Rewrite the packs whose live bytes are below ``threshold`` of their size.

        The live tensors of those packs are read (checksums verified), written into new
        packs and published by one manifest update; the old packs are then deleted. Live
        data is never modified in place, so a crash at any point leaves a valid directory.

        Parameters
        ----------
        threshold : float
            In [0, 1]; 1 rewrites every pack with any dead range.

        Returns
        -------
        int
            Bytes of disk space given back.
        """
        import torch
        if not 0 <= threshold <= 1:
            raise ValueError(f"threshold must be within [0, 1], got {threshold}")
        self._check_open()

        def victims_now() -> dict[str, int]:
            """Packs to rewrite, with their sizes; called with ``self._lock`` held."""
            spans: dict[str, int] = {}
            for e in self._m.entries.values():
                if e.file in self._m.packs:
                    spans[e.file] = spans.get(e.file, 0) + round_pack(e.nbytes)
            return {f: size for f, size in self._m.packs.items()
                    if spans.get(f, 0) < size and spans.get(f, 0) < threshold * size}

        with self._lock:
            names = self._m.names_in(victims_now())
        if not names:
            return 0
        ev = self._claim(names, True)
        try:
            with self._lock:        # again, now that nobody else can change these names
                victims = victims_now()
                entries = sorted((self._m.entries[n] for n in names
                                  if n in self._m.entries
                                  and self._m.entries[n].file in victims),
                                 key=lambda e: e.seq)
            if not entries:
                return 0
            fds: dict[str, DataFile] = {}
            reads: list[tuple[Entry, torch.Tensor, concurrent.futures.Future[int] | None]] = []
            try:
                for e in entries:
                    if e.file not in fds:
                        fds[e.file] = self._files.open(e.file, f"compact of {e.name!r}")[0]
                    raw = torch.empty(e.nbytes, dtype=torch.uint8)
                    f = (fds[e.file].pread(raw, e.offset, async_op=True)
                         if e.nbytes else None)
                    assert f is None or isinstance(f, concurrent.futures.Future)
                    reads.append((e, raw, f))
            finally:
                concurrent.futures.wait([f for _, _, f in reads if f is not None])
                for fd in fds.values():
                    fd.close()
            jobs: list[WriteJob] = []
            for e, raw, done in reads:
                if done is not None:
                    done.result()
                if e.checksum_algo is not None and self._verify:
                    if _checksum.digest(raw, e.checksum_algo) != e.checksum:
                        raise ChecksumError(f"compact: checksum mismatch of {e.name!r} in "
                                            f"{self._dir.join(e.file)!r}; nothing was changed")
                jobs.append(WriteJob(e.name, raw, e.dtype, e.shape, e.stride,
                                      e.storage_offset, e.seq, e.checksum, e.checksum_algo))
            change = self._write_packs(jobs, "compact")
            self._m.commit(change)
            self._dir.drain()
            return sum(victims[f] for f in {e.file for e in entries}) - sum(
                change.packs.values())
        finally:
            self._unclaim(names, ev)

    # -- name claims ----------------------------------------------------------------------
    def _claim(self, names: list[str], overwrite: bool) -> threading.Event:
        """Wait until no operation is in flight on ``names``, then mark them busy."""
        def check(ns: list[str]) -> None:
            self._check_open()
            if not overwrite:
                taken = [n for n in ns if n in self._m.entries]
                if taken:
                    raise SwapError(f"{taken[0]!r} is already swapped out in {self._path!r}; "
                                    f"pass overwrite=True to replace it"
                                    + (f" ({len(taken)} names taken)" if len(taken) > 1
                                       else ""))

        return self._claims.claim(names, check)

    def _unclaim(self, names: list[str], ev: threading.Event) -> None:
        self._claims.unclaim(names, ev)

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
            raise HandleClosedError(f"TensorSwapper of {self._path!r} is closed")
        if self._handle.closed:
            raise HandleClosedError(f"the AioHandle of TensorSwapper {self._path!r} is closed")

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
        the first error (in submission order) is raised. Old versions that overwrites made
        obsolete are deleted in the background; their space is back when this returns.
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
        self._dir.drain()
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
        self._pool.shutdown(wait=True)
        if self._allocators is not None:
            self._allocators.shutdown(wait=True)
        try:
            if self._own_handle:
                self._handle.close()
        finally:
            self._dir.close()

    def destroy(self, *, force: bool = False) -> None:
        """Delete every swap, aioswap's own files, and the directory if aioswap created it.

        Only the manifest, the lock and marker files and files of the data-file patterns are
        removed (an ``orphans/`` folder is kept); the directory is removed (``os.rmdir``,
        never a tree) only when a swapper created it and it is empty then. Closes the
        swapper.

        Raises
        ------
        SwapError
            Released tensors are waiting to be swapped in (pass ``force=True``).
        """
        self.clear(force=force)
        self.wait()
        self._dir.drain()
        with self._m.exclusive():      # still locked: nobody else can be using the directory
            self._dir.remove_own_files()
        created = self._dir.created
        extra_created = list(self._dir.extra_created)
        self.close()
        self._dir.unlink(LOCK_NAME)
        for d in ([self._path] if created else []) + extra_created:
            try:
                os.rmdir(d)
            except OSError as exc:
                _log.warning("kept swap directory %s: %s", d, exc)

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
