"""torch.distributed.checkpoint (DCP) storage whose tensor bytes move through an AioHandle.

:class:`AioWriter` and :class:`AioReader` are a ``StorageWriter``/``StorageReader`` pair for
``torch.distributed.checkpoint``. They keep the file format and metadata of the stock
``FileSystemWriter``/``FileSystemReader`` (``.metadata`` plus ``__<rank>_*.distcp`` files
holding one ``torch.save`` blob per tensor), so the stock reader reads aioswap checkpoints and
:class:`AioReader` reads stock ones. Only the byte movement differs:

* Each tensor's ``torch.save`` blob is laid out so that its storage bytes start at a
  4096-aligned file offset. The zip headers come from ``torch.save`` under
  ``torch.serialization.skip_data`` (no data is copied or checksummed for them); the tensor
  bytes go from the tensor's own memory to the file as one request. Headers, trailers, the
  last partial block of each tensor and small tensors are packed into block-aligned
  segments of one page-locked buffer, so every request is block-aligned and no two requests
  share a block: direct I/O throughout when the tensors are page-locked (as after
  :meth:`AioWriter.stage`), the handle's bounce pool otherwise.
* All requests of a rank (every file, every tensor) are submitted with ``async_op=True`` and
  finished with one ``wait()``, then each file is fsynced.
* The data offset of each tensor is recorded in the metadata (an extra attribute of the
  pickled ``Metadata``, plain Python values only; the stock reader ignores it), so
  :class:`AioReader` reads tensor bytes straight into the destination tensors (row ranges for
  resharded loads) with one batched submission, without parsing zip headers.
"""
from __future__ import annotations

import atexit
import concurrent.futures
import dataclasses
import io
import math
import os
import pickle
import re
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, cast

import torch
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    FileSystemReader,
    FileSystemWriter,
    _split_by_size_and_type,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
    WriteItemType,
)
from torch.distributed.checkpoint.storage import WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from aioswap import _adaptive, pinned
from aioswap._aio import DEFAULT_ALIGNMENT as _ALIGN
from aioswap._files import AioFile
from aioswap._util import flat_bytes, fsync_dir, wait_all
from aioswap.errors import ShortReadError
from aioswap.handle import AioHandle

__all__ = ["AioReader", "AioWriter", "LAYOUT_ATTRIBUTE"]

#: Name of the attribute of the pickled ``Metadata`` that holds aioswap's data offsets:
#: ``{"version": 1, "align": 4096, "tensors": {MetadataIndex: (data_offset_in_blob,
#: sizes, dtype)}}``. Plain values only, so the stock reader unpickles it without aioswap.
LAYOUT_ATTRIBUTE = "aioswap_layout"

_METADATA = ".metadata"
_CURRENT_DCP_VERSION = "1.0.0"      # filesystem.CURRENT_DCP_VERSION, the format we write
_DEFAULT_STAGING = 256 << 20        # bytes of read-side staging per batch
_OWN_FILE = re.compile(r"^__(\d+)_[0-9a-f]{8}_\d+" + re.escape(DEFAULT_SUFFIX) + r"$")


def _align_up(n: int, a: int = _ALIGN) -> int:
    return (n + a - 1) // a * a


# -- torch.save blob layout ----------------------------------------------------------------

class _Recorder(io.RawIOBase):
    """A seekable sink that keeps what ``torch.save`` writes and where it skips data."""

    def __init__(self) -> None:
        super().__init__()
        self.pieces: list[tuple[int, bytes]] = []
        self.holes: list[tuple[int, int]] = []
        self.pos = 0
        self.end = 0

    def writable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        mv = memoryview(b).cast("B")
        self.pieces.append((self.pos, bytes(mv)))
        self.pos += mv.nbytes
        self.end = max(self.end, self.pos)
        return mv.nbytes

    def tell(self) -> int:
        return self.pos

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        if whence == io.SEEK_SET:
            new = offset
        elif whence == io.SEEK_CUR:
            new = self.pos + offset
        else:
            new = self.end + offset
        if new > self.end:
            self.holes.append((self.end, new))
        self.pos = new
        self.end = max(self.end, new)
        return new


@dataclass(frozen=True)
class _BlobFormat:
    """The bytes of a ``torch.save`` blob of one contiguous tensor, around its data."""

    prefix: bytes           # blob bytes before the tensor data
    suffix: bytes           # blob bytes after it

    @property
    def data_offset(self) -> int:
        return len(self.prefix)


_formats: dict[tuple[tuple[int, ...], torch.dtype], _BlobFormat] = {}


def _blob_format(sizes: tuple[int, ...], dtype: torch.dtype) -> _BlobFormat:
    """The zip bytes ``torch.save`` writes for a contiguous tensor of this shape and dtype."""
    key = (sizes, dtype)
    fmt = _formats.get(key)
    if fmt is not None:
        return fmt
    nbytes = math.prod(sizes) * dtype.itemsize
    rec = _Recorder()
    # skip_data is thread-local and writes the storage record as a hole of nbytes, so no
    # tensor memory is touched or checksummed; the tensor itself is never filled in
    with torch.serialization.skip_data():
        torch.save(torch.empty(sizes, dtype=dtype), cast(IO[bytes], rec))
    buf = bytearray(rec.end)
    for off, piece in rec.pieces:
        buf[off:off + len(piece)] = piece
    if nbytes == 0:
        hole = (rec.end, rec.end)
    elif len(rec.holes) == 1 and rec.holes[0][1] - rec.holes[0][0] == nbytes:
        hole = rec.holes[0]
    else:                           # pragma: no cover - a torch.save we do not understand
        raise RuntimeError(f"unexpected torch.save layout for a {dtype} tensor of shape "
                           f"{list(sizes)}: holes {rec.holes}, {nbytes} data bytes")
    fmt = _BlobFormat(prefix=bytes(buf[:hole[0]]), suffix=bytes(buf[hole[1]:]))
    if len(_formats) < 4096:
        _formats[key] = fmt
    return fmt


class _FilePlan:
    """The requests that write one ``.distcp`` file: block-aligned and disjoint."""

    def __init__(self, path: Path, name: str) -> None:
        self.path = path
        self.name = name
        self.segments: list[tuple[int, bytearray]] = []     # (file offset, glue bytes)
        self.data: list[tuple[int, torch.Tensor, int]] = []  # (file offset, bytes, nbytes)
        self._off = 0
        self._cur = bytearray()

    @property
    def pos(self) -> int:
        return self._off + len(self._cur)

    def put(self, offset: int, b: bytes | memoryview) -> None:
        gap = offset - self.pos
        if gap < 0:                 # pragma: no cover - layout bug
            raise AssertionError(f"{self.name}: overlapping write at {offset}")
        self._cur += bytes(gap)
        self._cur += b

    def put_data(self, offset: int, flat: torch.Tensor, nbytes: int) -> None:
        """Write ``flat[:nbytes]`` (``nbytes`` a multiple of the block) at aligned ``offset``."""
        self.put(offset, b"")
        if self._cur:
            self.segments.append((self._off, self._cur))
        self.data.append((offset, flat, nbytes))
        self._off = offset + nbytes
        self._cur = bytearray()

    def close(self) -> int:
        """Pad the last segment to a whole block; return the file size."""
        size = _align_up(self.pos)
        self._cur += bytes(size - self.pos)
        if self._cur:
            self.segments.append((self._off, self._cur))
        self._off, self._cur = size, bytearray()
        return size

    def add_bytes(self, data: io.BytesIO) -> tuple[int, int]:
        offset = self.pos
        view = data.getbuffer()
        try:
            self.put(offset, view)
            return offset, view.nbytes
        finally:
            view.release()

    def add_tensor(self, t: torch.Tensor) -> tuple[int, int, int]:
        """Lay out the blob of contiguous CPU tensor ``t``; return (offset, length, data_offset)."""
        sizes = tuple(t.shape)
        fmt = _blob_format(sizes, t.dtype)
        nbytes = t.numel() * t.element_size()
        flat = flat_bytes(t)
        full = nbytes // _ALIGN * _ALIGN
        if full:
            # place the blob so that its data starts on a block boundary
            start = _align_up(self.pos + fmt.data_offset) - fmt.data_offset
            self.put(start, fmt.prefix)
            self.put_data(start + fmt.data_offset, flat, full)
        else:
            start = self.pos
            self.put(start, fmt.prefix)
        if full < nbytes:
            self.put(start + fmt.data_offset + full, flat[full:].numpy().tobytes())
        self.put(start + fmt.data_offset + nbytes, fmt.suffix)
        return start, fmt.data_offset + nbytes + len(fmt.suffix), fmt.data_offset


@dataclass
class _AioStorageInfo(_StorageInfo):
    """Storage info plus the data layout, on its way from a rank to the coordinator."""

    aioswap: tuple[int, tuple[int, ...], torch.dtype] | None = None


def _cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    if t.device.type != "cpu":
        staged = pinned.empty(tuple(t.shape), t.dtype, strict=False) if t.numel() else \
            torch.empty(tuple(t.shape), dtype=t.dtype)
        staged.copy_(t)
        return staged
    return t.contiguous()


class _HandlePool:
    """Idle default handles, reused across saves and loads of this process.

    Setting up and tearing down kernel AIO contexts costs tens of milliseconds (io_destroy
    waits for in-flight work and an RCU grace period), more than a small checkpoint takes,
    so a handle is borrowed for one ``write_data``/``read_data`` and returned. A borrower has
    its handle to itself, so ``wait()`` sees only its own requests. Closed at exit; a forked
    child starts with an empty pool.
    """

    def __init__(self, keep: int = 2) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._free: list[AioHandle] = []
        self._pid = os.getpid()
        atexit.register(self.close)

    @contextmanager
    def borrow(self, handle: AioHandle | None) -> Iterator[AioHandle]:
        if handle is not None:
            yield handle
            return
        with self._lock:
            if self._pid != os.getpid():        # handles' threads do not survive fork
                self._free, self._pid = [], os.getpid()
            h = self._free.pop() if self._free else None
        if h is None or h.closed:
            h = AioHandle()
        try:
            yield h
        finally:
            with self._lock:
                keep = len(self._free) < self._keep and not h.closed and \
                    self._pid == os.getpid()
                if keep:
                    self._free.append(h)
            if not keep:
                h.close()

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
        for h in free:
            h.close()


_handles = _HandlePool()


def _drain(h: AioHandle) -> None:
    """Finish every request of ``h`` (errors stay with the first exception being raised)."""
    try:
        h.wait()
    except Exception:
        pass


class AioWriter(FileSystemWriter):
    """DCP ``StorageWriter`` that writes the stock file format through an :class:`AioHandle`.

    Use it wherever ``FileSystemWriter`` goes::

        dcp.save(state_dict, storage_writer=AioWriter(path))
        dcp.async_save(state_dict, storage_writer=AioWriter(path))

    Parameters
    ----------
    path : str or os.PathLike
        Checkpoint directory (created if missing).
    single_file_per_rank : bool
        One file per rank (default) instead of one file per tensor or blob.
    files_per_rank : int
        With ``single_file_per_rank``: split a rank's items over this many files (the stock
        writer's ``thread_count`` does the same). All files go out in one batch regardless.
    sync_files : bool
        fsync every data file, the metadata file and the directory (default True).
    overwrite : bool
        Allow saving where a checkpoint exists. Each save writes files with a fresh name and
        commits by atomically renaming ``.metadata``, so a crash during an overwrite leaves
        the previous checkpoint loadable. After the commit, aioswap data files the new
        metadata does not use are removed (files of other writers are left alone).
    cache_staged_state_dict : bool
        Keep the page-locked copy made by :meth:`stage` for the next ``async_save``.
    handle : AioHandle, optional
        Handle to move the bytes (not closed here); by default one ``AioHandle()`` per save.
    roots : sequence of paths, optional
        More directories, one per other drive: a rank's files are spread over ``path`` and
        these (file ``k`` on directory ``k mod (1 + len(roots))``; ``files_per_rank``
        defaults to that count). A file on another drive is linked from ``path`` by an
        absolute symbolic link made before it is written, so every reader (the stock
        ``FileSystemReader`` too) finds it through ``path``, and replacing the checkpoint
        removes the link and its file.

    Notes
    -----
    Files are created with mode 0600. Tensors are written from their own memory: page-locked
    tensors (``aioswap.pinned``, or the copy :meth:`stage` makes for ``async_save``) go
    straight to the file with ``O_DIRECT``; other tensors are staged by the handle's bounce
    pool. Non-contiguous tensors are made contiguous first (one copy), as DCP saves them.
    ``serialization_format`` and ``_extensions`` of the stock writer are not supported.
    """

    def __init__(self, path: str | os.PathLike[str], *, single_file_per_rank: bool = True,
                 files_per_rank: int | None = None, sync_files: bool = True,
                 overwrite: bool = True, cache_staged_state_dict: bool = False,
                 handle: AioHandle | None = None,
                 roots: Sequence[str | os.PathLike[str]] | None = None) -> None:
        extra = [os.path.abspath(os.fspath(r)) for r in roots or ()]
        if len({os.path.realpath(d) for d in [os.fspath(path), *extra]}) != 1 + len(extra):
            raise ValueError(f"the checkpoint directory and the roots must be distinct: "
                             f"{[os.fspath(path), *extra]}")
        if files_per_rank is None:
            files_per_rank = 1 + len(extra)
        if int(files_per_rank) < 1:
            raise ValueError(f"files_per_rank must be >= 1, got {files_per_rank}")
        super().__init__(path, single_file_per_rank=single_file_per_rank,
                         sync_files=sync_files, thread_count=int(files_per_rank),
                         overwrite=overwrite, cache_staged_state_dict=cache_staged_state_dict)
        self._handle = handle
        self._staged: Any = None
        self._roots = extra

    def __getstate__(self) -> dict[str, Any]:
        # for async_save in a checkpoint process: handles and staged memory stay here
        state = self.__dict__.copy()
        state.update(_handle=None, _staged=None)
        return state

    # -- planning ---------------------------------------------------------------------------
    def _token(self) -> str:
        return self.save_id.replace("-", "")[:8]

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        path = Path(self.path)
        path.mkdir(parents=True, exist_ok=True)
        if self._metadata_exists() and not self.overwrite:
            raise RuntimeError(f"a checkpoint exists in {path} and overwrite=False")
        if self.rank is not None and not self.use_collectives:
            plan = dataclasses.replace(
                plan, storage_data=_StoragePrefix(f"__{self.rank}_{self._token()}_"))
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        token = self._token()
        return [dataclasses.replace(plan, storage_data=_StoragePrefix(f"__{i}_{token}_"))
                if plan.storage_data is None else plan for i, plan in enumerate(plans)]

    # -- data -------------------------------------------------------------------------------
    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        """Write every item of ``plan`` with one batch of requests; fsync each file."""
        prefix = cast(_StoragePrefix, plan.storage_data).prefix
        root = Path(self.path)
        if self.single_file_per_rank:
            buckets = _split_by_size_and_type(self.thread_count, list(plan.items))
        else:
            buckets = [[item] for item in plan.items]
        results: list[WriteResult] = []
        files: list[_FilePlan] = []
        homes = [root] + [Path(r) for r in self._roots]
        for k, bucket in enumerate(buckets):
            name = f"{prefix}{k}{DEFAULT_SUFFIX}"
            fp = _FilePlan(homes[k % len(homes)] / name, name)
            results += self._lay_out(fp, bucket, planner)
            files.append(fp)
        self._write_files(files)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def _lay_out(self, fp: _FilePlan, items: Sequence[WriteItem],
                 planner: SavePlanner) -> list[WriteResult]:
        results = []
        for item in items:
            if item.type == WriteItemType.BYTE_IO:
                data = planner.resolve_data(item)
                if not isinstance(data, io.BytesIO):
                    raise TypeError(f"{item.index.fqn}: planner gave {type(data).__name__} "
                                    f"for a BYTE_IO item, expected io.BytesIO")
                offset, length = fp.add_bytes(data)
                info: _StorageInfo = _StorageInfo(fp.name, offset, length)
            else:
                data = planner.resolve_data(item)
                if not isinstance(data, torch.Tensor):
                    raise TypeError(f"{item.index.fqn}: planner gave {type(data).__name__} "
                                    f"for a tensor item")
                t = _cpu_contiguous(data)
                offset, length, data_offset = fp.add_tensor(t)
                info = _AioStorageInfo(fp.name, offset, length,
                                       aioswap=(data_offset, tuple(t.shape), t.dtype))
            results.append(WriteResult(index=item.index, size_in_bytes=length,
                                       storage_data=info))
        return results

    def _write_files(self, files: list[_FilePlan]) -> None:
        sizes = [fp.close() for fp in files]
        glue_bytes = sum(len(seg) for fp in files for _, seg in fp.segments)
        glue = pinned.empty(max(glue_bytes, 1), torch.uint8, strict=False)
        fds: list[AioFile] = []
        with _handles.borrow(self._handle) as h:
            try:
                at = 0
                root = Path(self.path)
                for fp, size in zip(files, sizes):
                    link = root / fp.name
                    if fp.path != link:             # on another drive: linked first, so a
                        fp.path.parent.mkdir(parents=True, exist_ok=True)  # failed save's
                        os.symlink(fp.path, link)   # file is found and removed as stale
                    f = h.open(fp.path, "w")        # 0600, O_DIRECT where allowed
                    fds.append(f)
                    os.ftruncate(f.fileno(), size)
                    for off, seg in fp.segments:
                        view = glue[at:at + len(seg)]
                        view.copy_(torch.frombuffer(seg, dtype=torch.uint8))
                        f.pwrite(view, off, async_op=True)
                        at += len(seg)
                    for off, flat, n in fp.data:
                        f.pwrite(flat, off, nbytes=n, async_op=True)
                h.wait()
            except BaseException:
                _drain(h)           # no buffer is released while the kernel may read it
                raise
            finally:
                try:
                    if self.sync_files:
                        for f in fds:
                            f.fsync()
                        for d in {fp.path.parent for fp in files} - {Path(self.path)}:
                            fsync_dir(d)            # the files on the other drives
                finally:
                    for f in fds:
                        f.close()

    # -- commit -----------------------------------------------------------------------------
    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        """Write ``.metadata`` atomically (temp file, fsync, rename, fsync directory)."""
        metadata.version = _CURRENT_DCP_VERSION
        storage_md: dict[MetadataIndex, _StorageInfo] = {}
        tensors: dict[MetadataIndex, tuple[int, tuple[int, ...], torch.dtype]] = {}
        for wr_list in results:
            for wr in wr_list:
                info = wr.storage_data
                if isinstance(info, _AioStorageInfo):
                    if info.aioswap is not None:
                        tensors[wr.index] = info.aioswap
                    info = _StorageInfo(info.relative_path, info.offset, info.length)
                storage_md[wr.index] = info
        metadata.storage_data = storage_md
        setattr(metadata, LAYOUT_ATTRIBUTE, {"version": 1, "align": _ALIGN, "tensors": tensors})
        metadata.storage_meta = self.storage_meta()
        local = not self.use_collectives and self.rank is not None
        root = Path(self.path)
        final = Path(self._get_metadata_path(self.rank if local else None))
        tmp = root / f"{final.name}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "wb") as f:
            pickle.dump(metadata, f)
            f.flush()
            if self.sync_files:
                os.fsync(f.fileno())
        os.replace(tmp, final)
        if self.sync_files:
            fsync_dir(root)
        self._remove_stale(root, {i.relative_path for i in storage_md.values()},
                           self.rank if local else None)

    @staticmethod
    def _remove_stale(root: Path, current: set[str], rank: int | None) -> None:
        """Remove aioswap data files the new metadata does not use: those of the replaced
        checkpoint and of saves that never committed (by name; other files are left)."""
        stale = set()
        for entry in os.listdir(root):
            m = _OWN_FILE.match(entry)
            if m and (rank is None or int(m.group(1)) == rank):
                stale.add(entry)
        for name in stale - current:
            link = root / name
            try:
                if link.is_symlink():               # a file on another drive (roots=)
                    target = Path(os.readlink(link))
                    if target.is_absolute() and target.name == name:
                        target.unlink(missing_ok=True)
                os.unlink(link)
            except FileNotFoundError:
                pass

    # -- async staging ----------------------------------------------------------------------
    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """Copy ``state_dict``'s tensors to page-locked CPU memory (``aioswap.pinned``).

        Used by ``dcp.async_save``: the copy is then written in the background with direct
        I/O. Non-tensor values are kept by reference, as the stock stager does. With
        ``cache_staged_state_dict=True`` the page-locked copy is reused by the next call
        when shapes and dtypes match.
        """
        cache = self._staged if self.cache_staged_state_dict else None
        try:
            staged = _stage(state_dict, cache)
        except _Unstageable:
            return super().stage(state_dict)
        if self.cache_staged_state_dict:
            self._staged = staged
        return cast(dict[str, Any], staged)


class _Unstageable(Exception):
    """A value :func:`_stage` leaves to the stock stager (ShardedTensor)."""


def _stage(obj: Any, cache: Any) -> Any:
    if isinstance(obj, DTensor):
        local = _stage(obj.to_local(), cache.to_local() if isinstance(cache, DTensor) else None)
        return DTensor.from_local(local, obj.device_mesh, obj.placements, run_check=False,
                                  shape=obj.shape, stride=obj.stride())
    if isinstance(obj, torch.Tensor):
        if type(obj) is not torch.Tensor and not isinstance(obj, torch.nn.Parameter):
            raise _Unstageable(type(obj).__name__)
        src = obj.detach()
        if (isinstance(cache, torch.Tensor) and cache.shape == src.shape
                and cache.dtype == src.dtype and cache.device.type == "cpu"):
            dst = cache
        elif src.numel() == 0:
            dst = torch.empty(tuple(src.shape), dtype=src.dtype)
        else:
            # unlocked memory still takes direct I/O on the CPU: say so only where a device
            # copy would be slower from it
            dst = pinned.empty(tuple(src.shape), src.dtype, strict=False,
                               warn=src.device.type != "cpu")
        dst.copy_(src)
        return dst
    if isinstance(obj, dict):
        c = cache if isinstance(cache, dict) else {}
        return {k: _stage(v, c.get(k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        seq: Sequence[Any] = cache if isinstance(cache, (list, tuple)) and \
            len(cache) == len(obj) else [None] * len(obj)
        staged = [_stage(v, cv) for v, cv in zip(obj, seq)]
        if isinstance(obj, list):
            return staged
        return type(obj)(*staged) if hasattr(obj, "_fields") else tuple(staged)
    if type(obj).__name__ == "ShardedTensor":
        raise _Unstageable("ShardedTensor")
    return obj


# -- reading --------------------------------------------------------------------------------

@dataclass
class _Pending:
    req: ReadItem
    target: torch.Tensor
    staged: torch.Tensor | None     # read here, then copied (narrowed) into target
    narrow: list[tuple[int, int, int]]  # (dim, start, length) applied to staged


class AioReader(FileSystemReader):
    """DCP ``StorageReader`` that reads through an :class:`AioHandle`.

    Reads checkpoints of :class:`AioWriter` and of the stock ``FileSystemWriter``::

        dcp.load(state_dict, storage_reader=AioReader(path))

    Parameters
    ----------
    path : str or os.PathLike
        Checkpoint directory.
    handle : AioHandle, optional
        Handle to move the bytes (not closed here); by default one ``AioHandle()`` per load.
    staging_bytes : int
        Most bytes held in temporary buffers at once (resharded rows, dtype conversions,
        blobs of stock checkpoints); the requests are batched up to this size.
    read : {"auto", "direct", "buffered"}, optional
        How tensors of :class:`AioWriter` checkpoints are read: ``"auto"`` copies the ranges
        the page cache holds and reads the rest direct (:mod:`aioswap._adaptive`);
        default ``AIOSWAP_READ``, else auto.

    Notes
    -----
    For :class:`AioWriter` checkpoints each tensor is read straight into its destination
    (direct I/O when the destination is page-locked and aligned, the handle's bounce pool
    otherwise); a load that reshards reads the stored rows it needs into a page-locked buffer
    and copies the requested slice. For stock checkpoints each blob is read whole and
    deserialized with ``torch.load``, as the stock reader does. Items written with stream
    transforms (``_extensions``) are passed to the stock reader.
    """

    def __init__(self, path: str | os.PathLike[str], *, handle: AioHandle | None = None,
                 staging_bytes: int = _DEFAULT_STAGING, read: str | None = None) -> None:
        super().__init__(path)
        if int(staging_bytes) < 1:
            raise ValueError(f"staging_bytes must be >= 1, got {staging_bytes}")
        if read is not None:
            _adaptive.read_mode(read)           # a bad value: ValueError now
        self._read = read
        self._handle = handle
        self._staging_bytes = int(staging_bytes)
        self._layout: dict[MetadataIndex, tuple[int, tuple[int, ...], torch.dtype]] = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_handle"] = None
        return state

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        layout = getattr(metadata, LAYOUT_ATTRIBUTE, None)
        self._layout = {}
        if isinstance(layout, dict) and layout.get("version") == 1:
            self._layout = dict(layout.get("tensors") or {})

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Read every item of ``plan`` in batches of requests; commit each to the planner."""
        direct: list[ReadItem] = []
        blobs: list[ReadItem] = []
        stock: list[ReadItem] = []
        for req in plan.items:
            info: _StorageInfo = self.storage_data[req.storage_index]
            if info.transform_descriptors:
                stock.append(req)
            elif req.type == LoadItemType.BYTE_IO or req.storage_index not in self._layout:
                blobs.append(req)
            else:
                direct.append(req)
        if stock:
            super().read_data(dataclasses.replace(plan, items=stock), planner).wait()
        fds: dict[str, tuple[AioFile, int]] = {}
        reader = _adaptive.Reader(self._read, f"DCP load of {len(direct)} tensors")
        try:
            with _handles.borrow(self._handle) as h:
                self._read_tensors(h, direct, planner, fds, reader)
                self._read_blobs(h, blobs, planner, fds)
        finally:
            for f, _ in fds.values():
                f.close()
            reader.close()
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _fd(self, h: AioHandle, fds: dict[str, tuple[AioFile, int]], relative_path: str,
            offset: int, nbytes: int, what: str) -> AioFile:
        """A data file, opened once through ``h``; refuses a request past its end."""
        entry = fds.get(relative_path)
        if entry is None:
            f = h.open(Path(self.path) / relative_path, "r")
            entry = fds[relative_path] = (f, f.size())
        fd, size = entry
        if offset + nbytes > size:
            path = str(Path(self.path) / relative_path)
            raise ShortReadError(f"{what}: checkpoint file {path} is {size} bytes, but "
                                 f"{nbytes} bytes at offset {offset} are needed (truncated "
                                 f"file?)", path=path, offset=offset, nbytes=nbytes,
                                 file_size=size)
        return fd

    def _read_tensors(self, h: AioHandle, reqs: list[ReadItem], planner: LoadPlanner,
                      fds: dict[str, tuple[AioFile, int]], reader: _adaptive.Reader) -> None:
        batch: list[_Pending] = []
        futs: list[concurrent.futures.Future[int]] = []
        held = 0
        for req in reqs:
            info: _StorageInfo = self.storage_data[req.storage_index]
            data_offset, sizes, dtype = self._layout[req.storage_index]
            target = planner.resolve_tensor(req).detach()
            lengths = tuple(req.lengths)
            if tuple(target.shape) != lengths:
                raise RuntimeError(f"{req.storage_index.fqn}: destination shape "
                                   f"{list(target.shape)} differs from the requested "
                                   f"{list(lengths)}")
            offsets = tuple(req.storage_offsets)
            if len(sizes) != len(offsets) or any(
                    o + n > s for o, n, s in zip(offsets, lengths, sizes)):
                raise RuntimeError(f"{req.storage_index.fqn}: request {list(offsets)}+"
                                   f"{list(lengths)} lies outside the stored chunk "
                                   f"{list(sizes)} in {info.relative_path}")
            esize = dtype.itemsize
            if sizes:
                row = math.prod(sizes[1:]) * esize
                r0, nrows = offsets[0], lengths[0]
                rest_full = all(o == 0 and n == s for o, n, s in
                                zip(offsets[1:], lengths[1:], sizes[1:]))
            else:
                row, r0, nrows, rest_full = esize, 0, 1, True
            nbytes = row * nrows
            start = info.offset + data_offset + r0 * row
            if nbytes == 0:
                batch.append(_Pending(req, target, None, []))
                continue
            fd = self._fd(h, fds, info.relative_path, start, nbytes, req.storage_index.fqn)
            if (rest_full and target.dtype == dtype and target.device.type == "cpu"
                    and target.is_contiguous()):
                futs.append(reader.pread(fd, target, start, nbytes))
                batch.append(_Pending(req, target, None, []))
            else:
                shape = (nrows, *sizes[1:]) if sizes else ()
                staged = pinned.empty(shape, dtype, strict=False,
                                      warn=target.device.type != "cpu")
                futs.append(reader.pread(fd, staged, start, nbytes))
                narrow = [(d, o, n) for d, (o, n) in enumerate(zip(offsets, lengths)) if d]
                batch.append(_Pending(req, target, staged, narrow))
                held += nbytes
                if held >= self._staging_bytes:
                    self._commit(h, batch, planner, futs)
                    batch, futs, held = [], [], 0
        self._commit(h, batch, planner, futs)

    @staticmethod
    def _commit(h: AioHandle, batch: list[_Pending], planner: LoadPlanner,
                copies: list[concurrent.futures.Future[int]] | None = None) -> None:
        try:
            h.wait()
        except BaseException:
            _drain(h)
            if copies:
                concurrent.futures.wait(copies)     # the copy threads too
            raise
        if copies:
            wait_all(copies)
        for p in batch:
            if p.staged is not None:
                src = p.staged
                for dim, start, length in p.narrow:
                    src = src.narrow(dim, start, length)
                p.target.copy_(src)
            planner.commit_tensor(p.req, p.target)

    def _read_blobs(self, h: AioHandle, reqs: list[ReadItem], planner: LoadPlanner,
                    fds: dict[str, tuple[AioFile, int]]) -> None:
        """Bytes items and tensors of stock checkpoints: read each blob whole, then decode."""
        i = 0
        while i < len(reqs):
            blobs: dict[tuple[str, int], bytearray] = {}
            group: list[ReadItem] = []
            held = 0
            while i < len(reqs) and (not group or held < self._staging_bytes):
                req = reqs[i]
                info: _StorageInfo = self.storage_data[req.storage_index]
                key = (info.relative_path, info.offset)
                if key not in blobs:
                    buf = bytearray(info.length)
                    if info.length:
                        fd = self._fd(h, fds, info.relative_path, info.offset, info.length,
                                      req.storage_index.fqn)
                        fd.pread(buf, info.offset, async_op=True)
                    blobs[key] = buf
                    held += info.length
                group.append(req)
                i += 1
            try:
                h.wait()
            except BaseException:
                _drain(h)
                raise
            for req in group:
                info = self.storage_data[req.storage_index]
                buf = blobs[(info.relative_path, info.offset)]
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(buf))
                    continue
                tensor = cast(torch.Tensor, torch.load(io.BytesIO(buf), map_location="cpu",
                                                       weights_only=True))
                for dim, (start, length) in enumerate(zip(req.storage_offsets, req.lengths)):
                    tensor = tensor.narrow(dim, start, length)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise RuntimeError(f"{req.storage_index.fqn}: destination shape "
                                       f"{list(target.shape)} differs from the stored "
                                       f"{list(tensor.shape)}")
                target.copy_(tensor)
                planner.commit_tensor(req, target)
