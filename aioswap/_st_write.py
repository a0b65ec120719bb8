"""Writing safetensors files: :func:`save`, :func:`save_file` (direct I/O through a ring of
page-locked slots, fsynced, renamed into place) and :func:`save_sharded` (shards over several
drives and a Hugging Face index); exported by :mod:`aioswap.safetensors`."""
from __future__ import annotations

import concurrent.futures
import errno
import json
import os
import secrets
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from aioswap import _scratch as _tmpfiles
from aioswap import pinned
from aioswap._aio import DEFAULT_ALIGNMENT as _ALIGN
from aioswap._files import AioFile
from aioswap._st_format import (FROM_TORCH, MAX_HEADER_BYTES, METADATA_KEY, RANK, PathLike,
                                SafetensorsError)
from aioswap._util import flat_bytes, fsync_dir, wait_all, write_atomic
from aioswap.handle import AioHandle, shared_handle

_SLOT_BYTES = 16 << 20        # bytes per staging slot (one request)
_SLOTS = 4                    # staging slots in the ring


@dataclass
class _Piece:
    """Bytes of the file at ``[start, start + nbytes)``, from a flat uint8 tensor."""

    start: int
    nbytes: int
    source: Any               # torch.Tensor (uint8) or a callable giving one


def _check_inputs(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
                  ) -> None:
    if not isinstance(tensors, Mapping):
        raise TypeError(f"tensors must be a dict of str to torch.Tensor, got "
                        f"{type(tensors).__name__}")
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise TypeError(f"tensor names must be str, got {name!r}")
        if name == METADATA_KEY:
            raise SafetensorsError(f"{METADATA_KEY!r} is reserved for the metadata and cannot "
                                   f"name a tensor")
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"tensor {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.layout != torch.strided:
            raise SafetensorsError(f"tensor {name!r} has layout {t.layout}; only dense "
                                   f"tensors can be saved")
        if t.device.type == "meta":
            raise SafetensorsError(f"tensor {name!r} is on the meta device and has no data")
        if t.dtype not in FROM_TORCH:
            raise SafetensorsError(f"tensor {name!r} has dtype {t.dtype}, which the "
                                   f"safetensors format cannot hold")
        if FROM_TORCH[t.dtype].packed > 1 and t.dim() == 0:
            raise SafetensorsError(f"tensor {name!r}: a 0-dim {t.dtype} cannot be stored "
                                   f"(its shape in the file needs a last dimension)")
    if metadata is not None:
        if not isinstance(metadata, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()):
            raise TypeError("metadata must be a dict of str to str")


def _layout(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None
            ) -> tuple[bytes, list[tuple[str, int, int]]]:
    """The header bytes (length prefix and padding included) and (name, begin, end)."""
    _check_inputs(tensors, metadata)
    # safetensors' order (its dtype enum, descending, then the name): larger alignments
    # first keeps every tensor aligned, and the file is byte for byte what safetensors writes
    order = sorted(tensors, key=lambda k: (-RANK[FROM_TORCH[tensors[k].dtype].name], k))
    obj: dict[str, Any] = {}
    if metadata is not None:
        obj[METADATA_KEY] = dict(sorted(metadata.items()))     # deterministic bytes
    spans = []
    pos = 0
    for name in order:
        t = tensors[name]
        d = FROM_TORCH[t.dtype]
        shape = list(t.shape)
        if d.packed > 1:
            shape[-1] *= d.packed
        n = t.numel() * t.element_size()
        obj[name] = {"dtype": d.name, "shape": shape, "data_offsets": [pos, pos + n]}
        spans.append((name, pos, pos + n))
        pos += n
    text = json.dumps(obj, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    text += b" " * (-(8 + len(text)) % 8)
    if len(text) > MAX_HEADER_BYTES:
        raise SafetensorsError(f"the header would be {len(text)} bytes, over the limit of "
                               f"{MAX_HEADER_BYTES} bytes readers accept")
    return struct.pack("<Q", len(text)) + text, spans


def save(tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, str] | None = None
         ) -> bytes:
    """The bytes of a safetensors file holding ``tensors`` (and ``metadata``)."""
    head, spans = _layout(tensors, metadata)
    out = bytearray(len(head) + (spans[-1][2] if spans else 0))
    out[:len(head)] = head
    dst = torch.frombuffer(out, dtype=torch.uint8) if out else None
    for name, begin, end in spans:
        if end > begin:
            assert dst is not None
            dst[len(head) + begin:len(head) + end].copy_(flat_bytes(tensors[name]))
    return bytes(out)


def save_file(tensors: Mapping[str, torch.Tensor], filename: PathLike,
              metadata: Mapping[str, str] | None = None, *, handle: AioHandle | None = None,
              mode: int = 0o600) -> None:
    """Save tensors to a safetensors file with direct I/O, durably and atomically.

    Parameters
    ----------
    tensors : dict of str to torch.Tensor
        CPU or CUDA tensors of any dtype the format holds. Unlike ``safetensors``,
        non-contiguous tensors and tensors sharing memory are accepted (each is stored with
        its own elements).
    filename : str or os.PathLike
        The file; replaced atomically once the new one is durable.
    metadata : dict of str to str, optional
        Stored as ``"__metadata__"``.
    handle : AioHandle, optional
        The handle to write through; default :func:`aioswap.handle.shared_handle`.
    mode : int
        Permission bits of the new file, before the umask. Default ``0o600`` (the file holds
        user data); ``safetensors`` and ``torch.save`` create ``0o644`` files.

    Raises
    ------
    SafetensorsError
        A tensor the format cannot hold (dtype, layout, meta device), a reserved name, a
        header over :data:`MAX_HEADER_BYTES`.
    TypeError
        Names or metadata that are not strings, values that are not tensors.
    OSError
        The file cannot be written; ``filename`` is left as it was.

    Notes
    -----
    The bytes go through a ring of four page-locked 16 MiB slots (less for a small
    file) written at 4096-aligned offsets, so the data is written with ``O_DIRECT``, into a
    new file beside ``filename`` that is fsynced, renamed over it and the directory fsynced.
    That file is an unnamed ``O_TMPFILE`` where the file system allows (linked as
    ``.<name>.<pid>-<random>.tmp`` just before the rename), so a crash mid-save leaves
    nothing; elsewhere it has that name from the start, and a later save beside it removes
    it once its process is gone. The tensors must not change until this returns.
    """
    path = os.fspath(filename)
    head, spans = _layout(tensors, metadata)
    total = len(head) + (spans[-1][2] if spans else 0)
    pieces = [_Piece(0, len(head), torch.frombuffer(bytearray(head), dtype=torch.uint8))]
    for name, begin, end in spans:
        if end > begin:
            pieces.append(_Piece(len(head) + begin, end - begin, tensors[name]))
    directory = os.path.dirname(os.path.abspath(path))
    stem = f".{os.path.basename(path)}."
    _tmpfiles.remove_stale(directory, stem, ".tmp")       # left by a killed save
    tmp = os.path.join(directory, f"{stem}{os.getpid()}-{secrets.token_hex(6)}.tmp")
    fd, named = _open_tmp(directory, tmp, mode)
    file: AioFile | None = None
    done = False
    try:
        h = shared_handle() if handle is None else handle
        file = h.adopt(fd)                  # the handle's own file from here on
        fd = -1
        _write_pieces(file, pieces, total)
        file.fsync()
        if not named:   # an O_TMPFILE file gets a name only now, for the rename
            os.link(f"/proc/self/fd/{file.fileno()}", tmp, follow_symlinks=True)
        file.close()
        os.replace(tmp, path)
        done = True
        fsync_dir(directory)
    finally:
        if fd >= 0:
            os.close(fd)
        if file is not None:
            file.close()
        if not done:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def save_sharded(tensors: Mapping[str, torch.Tensor], directory: PathLike, *,
                 roots: Sequence[PathLike] | None = None, max_shard_bytes: int | None = None,
                 prefix: str = "model", metadata: Mapping[str, str] | None = None,
                 handle: AioHandle | None = None, mode: int = 0o600) -> str:
    """Save ``tensors`` as shards with a Hugging Face index, spread over several drives.

    The layout is what ``save_pretrained`` writes and ``from_pretrained`` reads:
    ``<prefix>-00001-of-0000N.safetensors``... and ``<prefix>.safetensors.index.json``
    (``{"metadata": {"total_size": ...}, "weight_map": {name: shard}}``) in ``directory``.
    Shard ``i`` is written (with :func:`save_file`: direct I/O, durable, atomic) on
    ``[directory, *roots][i mod (1 + len(roots))]``, all shards at once; a shard on another
    drive is linked from ``directory`` by an absolute symbolic link, so every reader finds
    it there. The index is written last (atomically): a crash before it leaves the old
    index. Shards of an earlier save with another shard count are left alone.

    Parameters
    ----------
    tensors : dict of str to torch.Tensor
        As for :func:`save_file`; split in their order.
    directory : str or os.PathLike
        Where the index and (links to) every shard go; created if missing.
    roots : sequence of paths, optional
        Directories on the other drives (created if missing).
    max_shard_bytes : int, optional
        Cap on the tensor bytes of one shard (a larger tensor gets a shard of its own);
        default: the total divided evenly over the drives, so each holds one shard.
    prefix : str
        File name prefix (``"model"``, as transformers names them).
    metadata : dict of str to str, optional
        Stored in every shard (default ``{"format": "pt"}``, what transformers writes).
    handle : AioHandle, optional
        As for :func:`save_file`.
    mode : int
        Permission bits of the shards and the index (``0o600``).

    Returns
    -------
    str
        The path of the index file.
    """
    directory = os.path.abspath(os.fspath(directory))
    homes = [directory] + [os.path.abspath(os.fspath(r)) for r in roots or ()]
    if len({os.path.realpath(h) for h in homes}) != len(homes):
        raise ValueError(f"the directory and the roots must be distinct: {homes}")
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise ValueError(f"max_shard_bytes must be >= 1, got {max_shard_bytes}")
    _check_inputs(tensors, metadata)
    if not prefix or os.sep in prefix:
        raise ValueError(f"prefix must be a file name prefix, got {prefix!r}")
    sizes = {k: t.numel() * t.element_size() for k, t in tensors.items()}
    total = sum(sizes.values())
    cap = max_shard_bytes if max_shard_bytes is not None else max(1, -(-total // len(homes)))
    groups: list[list[str]] = []
    held = 0
    for k in tensors:
        # by default at most one shard per drive: the last takes what the others left
        if not groups or (groups[-1] and held + sizes[k] > cap and (
                max_shard_bytes is not None or len(groups) < len(homes))):
            groups.append([])
            held = 0
        groups[-1].append(k)
        held += sizes[k]
    if not groups:
        groups.append([])           # no tensors: one empty shard, as a model without any
    n = len(groups)
    names = [f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    for h in homes:
        os.makedirs(h, mode=0o700, exist_ok=True)
    md = dict(metadata) if metadata is not None else {"format": "pt"}

    def write(i: int) -> None:
        home = homes[i % len(homes)]
        target = os.path.join(home, names[i])
        save_file({k: tensors[k] for k in groups[i]}, target, md, handle=handle, mode=mode)
        if home != directory:       # linked from the directory (replacing what was there)
            link = os.path.join(directory, names[i])
            tmp = f"{link}.{os.getpid()}-{secrets.token_hex(6)}.link"
            os.symlink(target, tmp)
            try:
                os.replace(tmp, link)
            except BaseException:
                os.unlink(tmp)
                raise

    with concurrent.futures.ThreadPoolExecutor(
            min(n, len(homes)), thread_name_prefix="aioswap-shard") as pool:
        futures = [pool.submit(write, i) for i in range(n)]
        wait_all(futures)
    for h in set(homes):
        fsync_dir(h)
    index = os.path.join(directory, f"{prefix}.safetensors.index.json")
    doc = {"metadata": {"total_size": total},
           "weight_map": {k: names[i] for i, g in enumerate(groups) for k in g}}
    write_atomic(index, (json.dumps(doc, indent=2, sort_keys=True) + "\n").encode(), mode)
    return index


def _open_tmp(directory: str, tmp: str, mode: int) -> tuple[int, bool]:
    """The file a save writes: (fd, whether it has a name yet).

    ``O_TMPFILE`` where the file system has it (ext4, xfs, btrfs, tmpfs): a crash while
    writing leaves nothing behind, as the file has no name until it is complete. Elsewhere
    the named ``tmp`` (``O_EXCL``); its name carries our pid, so a later save removes it if
    this process dies. O_RDWR: an engine may read back a partial last block around an
    O_DIRECT write.
    """
    flags = os.O_RDWR | os.O_CLOEXEC
    tmpfile = getattr(os, "O_TMPFILE", 0)
    dev = os.stat(directory).st_dev
    if tmpfile and _TMPFILE_WORKS.get(dev, True):
        try:
            fd = os.open(directory, flags | tmpfile, mode)
        except OSError as exc:
            if exc.errno not in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT):
                raise
            _TMPFILE_WORKS[dev] = False
        else:
            if dev not in _TMPFILE_WORKS:       # linking it later must work too: try once
                probe = f"{tmp}.probe"
                try:
                    os.link(f"/proc/self/fd/{fd}", probe, follow_symlinks=True)
                    os.unlink(probe)
                    _TMPFILE_WORKS[dev] = True
                except OSError:     # EXDEV (some kernels, sandboxes), no /proc
                    _TMPFILE_WORKS[dev] = False
                    os.close(fd)
            if _TMPFILE_WORKS[dev]:
                return fd, False
    return os.open(tmp, flags | os.O_CREAT | os.O_EXCL, mode), True


#: st_dev -> whether O_TMPFILE plus linkat through /proc works on that file system
_TMPFILE_WORKS: dict[int, bool] = {}


def _write_pieces(file: AioFile, pieces: list[_Piece], total: int) -> None:
    """Stage ``pieces`` through a ring of aligned slots; every slot is one pwrite."""
    slot = min(_SLOT_BYTES, -(-total // _ALIGN) * _ALIGN)
    nslots = min(_SLOTS, -(-total // slot))
    # unlocked where mlock is refused: written from direct all the same, so it warns only
    # where a device tensor (or a lazy source, maybe one) is copied into it
    cpu_only = all(isinstance(p.source, torch.Tensor) and p.source.is_cpu for p in pieces)
    ring_mem = pinned.allocate(slot * nslots, strict=False, warn=not cpu_only)
    ring = torch.frombuffer(memoryview(ring_mem), dtype=torch.uint8)
    busy: list[Any] = [None] * nslots
    futures: list[Any] = []
    flat: dict[int, torch.Tensor] = {}
    try:
        k = 0                                       # next piece that has bytes left
        for idx, lo in enumerate(range(0, total, slot)):
            hi = min(total, lo + slot)
            s = idx % nslots
            if busy[s] is not None:
                busy[s].result()                    # its previous write is done
            dst = ring[s * slot:s * slot + (hi - lo)]
            while k < len(pieces) and pieces[k].start + pieces[k].nbytes <= lo:
                flat.pop(k, None)
                k += 1
            j = k
            while j < len(pieces) and pieces[j].start < hi:
                p = pieces[j]
                a, b = max(lo, p.start), min(hi, p.start + p.nbytes)
                src = flat.get(j)
                if src is None:
                    src = flat[j] = flat_bytes(p.source)
                dst[a - lo:b - lo].copy_(src[a - p.start:b - p.start])
                j += 1
            busy[s] = file.pwrite(dst, lo, async_op=True)
            futures.append(busy[s])
    finally:
        concurrent.futures.wait([f for f in futures])
    wait_all(futures)
