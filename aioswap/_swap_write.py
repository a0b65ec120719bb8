"""The swapper's writes: tensors checked before any I/O, then written to new data files (one
tensor per file, or packs of many with one batch of requests), checksummed while the writes
are in flight, fsynced; what to publish is returned, never committed here."""
from __future__ import annotations

import concurrent.futures
import hashlib
import os
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

from aioswap import _checksum
from aioswap._files import AioFile
from aioswap._manifest import Change, Entry
from aioswap._swap_common import PACK_ALIGN, SLAB_MAX, dtype_name, extent, round_pack
from aioswap._swap_files import DataFile, DataFiles
from aioswap._util import add_note
from aioswap.errors import SwapError

if TYPE_CHECKING:
    import torch

_SMALL_WRITE = 64 << 10       # tensors up to this size are written from a locked slab (SLAB_MAX)


def _file_hash(name: str) -> str:
    """The first part of a single tensor's file name (the SHA-256 of its name)."""
    return hashlib.sha256(name.encode("utf-8", "surrogatepass")).hexdigest()[:32]


@dataclass
class WriteJob:
    """One tensor to write into a pack; ``checksum`` given: already known (compaction)."""

    name: str
    src: torch.Tensor
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    storage_offset: int
    seq: int
    checksum: str | None = None
    checksum_algo: str | None = None


class ByteBudget:
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


def check_tensor(name: str, tensor: Any, release: bool) -> torch.Tensor:
    """Validate a tensor to swap out before any I/O; return the bytes to write."""
    import torch
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
    need = extent(t)
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
                            f"shared with numpy by .numpy(), or is locked memory, e.g. "
                            f"from swap_in_state_dict with pin_memory=None), so it "
                            f"cannot be freed")
    # conj/neg bits are lazy: the memory holds the un-negated values
    if t.is_conj():
        t = t.resolve_conj()
    if t.is_neg():
        t = t.resolve_neg()
    return t


def write_single(name: str, t: torch.Tensor, seq: int, *, files: DataFiles,
                 staging: ByteBudget, algo: str | None) -> Entry:
    """Write ``t`` to a new, fsynced file; the checksum runs while the write is in flight."""
    shape = tuple(int(x) for x in t.shape)
    stride = tuple(int(x) for x in t.stride())
    soff = int(t.storage_offset())
    nbytes = t.numel() * t.element_size()
    staged = 0
    if not t.is_contiguous():
        staged = nbytes
        staging.acquire(staged)
    try:
        src = t.contiguous() if staged else t
        fname, fd = files.create(f"t-{_file_hash(name)}-")
        ok = False
        try:
            fut = fd.pwrite(src, 0, async_op=True, fsync=True)
            assert isinstance(fut, concurrent.futures.Future)
            try:
                digest = _checksum.digest(src, algo) if algo else None
            finally:
                concurrent.futures.wait([fut])
            fut.result()
            ok = True
        except BaseException as exc:
            add_note(exc, f"aioswap: swap_out of {name!r} failed; nothing was published "
                          f"and the swap directory is unchanged")
            raise
        finally:
            files.close_new([(fname, fd)], ok)
    finally:
        if staged:
            staging.release(staged)
    return Entry(name, fname, 0, nbytes, dtype_name(t.dtype), shape, stride, soff,
                 digest, algo if digest is not None else None, seq)


def write_packs(jobs: list[WriteJob], what: str, *, files: DataFiles, staging: ByteBudget,
                algo: str | None, pack_bytes: int) -> Change:
    """Write ``jobs`` into new pack files with one batch of requests; fsync each file.

    Returns the change that publishes them (not yet committed). On any error every pack
    file written is removed and the error raised, after every request has finished.
    """
    import torch
    # lay out: tensors in order, each at an aligned offset, a new pack past the cap
    layout: list[list[tuple[WriteJob, int]]] = []
    pos = 0
    for j in jobs:
        n = j.src.numel() * j.src.element_size()
        if not layout or (pos and pos + n > pack_bytes):
            layout.append([])
            pos = 0
        layout[-1].append((j, pos))
        pos = round_pack(pos + n)
    # Small tensors, and the last partial block of larger ones, are copied into one
    # page-locked slab in whole blocks (zero-padded), so every request is block-aligned
    # and direct: no read-modify-write of an edge block, no page cache.
    need = 0
    for j in jobs:
        n = j.src.numel() * j.src.element_size()
        add = round_pack(n) if n <= _SMALL_WRITE else (PACK_ALIGN if n % PACK_ALIGN else 0)
        if need + add <= SLAB_MAX:
            need += add
    slab = None
    if need:
        from aioswap import pinned
        # unlocked where mlock is refused: written from direct all the same, so it warns
        # only where device tensors are copied into it
        slab = pinned.empty(need, torch.uint8, strict=False,
                            warn=not all(j.src.is_cpu for j in jobs))
    slab_pos = 0
    written: list[tuple[str, DataFile, int]] = []   # (name, file, size)
    futs: list[concurrent.futures.Future[int]] = []
    entries: list[Entry] = []
    ok = False

    def write(buf: torch.Tensor, fd: DataFile, off: int) -> concurrent.futures.Future[int]:
        fut = fd.pwrite(buf, off, async_op=True)
        assert isinstance(fut, concurrent.futures.Future)
        futs.append(fut)
        return fut

    try:
        for pack in layout:
            last, off = pack[-1]
            size = round_pack(off + last.src.numel() * last.src.element_size())
            fname, fd = files.create("p-")
            written.append((fname, fd, size))
            if isinstance(fd, AioFile):
                os.ftruncate(fd.fileno(), size)
            else:
                fd.truncate(size)
            for j, off in pack:
                src = j.src
                n = src.numel() * src.element_size()
                digest, digest_algo = j.checksum, j.checksum_algo
                hashed: torch.Tensor = src
                padded = round_pack(n)
                if n and n <= _SMALL_WRITE and slab is not None \
                        and slab_pos + padded <= need:
                    slot = slab[slab_pos:slab_pos + padded]
                    slab_pos += padded
                    slot[:n].view(src.dtype).view(src.shape).copy_(src)   # any layout
                    slot[n:].zero_()
                    write(slot, fd, off)
                    hashed = slot[:n]
                elif n:
                    staged = 0
                    if not src.is_contiguous():
                        staged = n
                        staging.acquire(staged)
                        try:
                            src = src.contiguous()
                        except BaseException:
                            staging.release(staged)
                            raise
                    tail = n % PACK_ALIGN
                    try:
                        if tail and slab is not None and slab_pos + PACK_ALIGN <= need:
                            flat = src.reshape(-1).view(torch.uint8)
                            slot = slab[slab_pos:slab_pos + PACK_ALIGN]
                            slab_pos += PACK_ALIGN
                            slot[:tail].copy_(flat[n - tail:])
                            slot[tail:].zero_()
                            write(slot, fd, off + n - tail)
                            fut = write(flat[:n - tail], fd, off)
                        else:
                            fut = write(src, fd, off)
                    except BaseException:
                        if staged:
                            staging.release(staged)
                        raise
                    if staged:
                        fut.add_done_callback(_release(staging, staged))
                    hashed = src
                if digest is None and algo is not None:
                    # hashed while this and the earlier writes are in flight
                    digest, digest_algo = _checksum.digest(hashed, algo), algo
                entries.append(Entry(j.name, fname, off, n, j.dtype, j.shape, j.stride,
                                     j.storage_offset, digest, digest_algo, j.seq))
                del src, hashed
        concurrent.futures.wait(futs)
        for f in futs:
            f.result()
        for _, fd, _ in written:
            fd.fsync()
        ok = True
    except BaseException as exc:
        add_note(exc, f"aioswap: {what} failed; nothing was published and the swap "
                      f"directory is unchanged")
        raise
    finally:
        concurrent.futures.wait(futs)       # never unlink under requests in flight
        files.close_new([(fname, fd) for fname, fd, _ in written], ok)
    return Change(entries, [], files=[f for f, _, _ in written],
                  packs={f: s for f, _, s in written})


def _release(staging: ByteBudget, n: int) -> Callable[[Any], None]:
    """A done-callback that gives ``n`` staging bytes back."""
    def done(_: Any) -> None:
        staging.release(n)
    return done
