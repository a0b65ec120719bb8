"""The swapper's reads, once planned: where each tensor lands (fresh page-locked or plain
memory, a shared slab for small ones, a released tensor restored in place), the batch
submitted on a few threads, each tensor checked as it lands, every future finished."""
from __future__ import annotations

import concurrent.futures
import threading
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Union

from aioswap import _adaptive, _checksum
from aioswap._claims import Released, Releases, guard, released_as, unguard
from aioswap._files import AioFile
from aioswap._manifest import Entry
from aioswap._swap_common import PACK_ALIGN, SLAB_MAX, dtype_from_name, extent, round_pack
from aioswap._swap_files import DataFile
from aioswap.errors import SwapError

if TYPE_CHECKING:
    import torch

Device = Union[str, "torch.device", int, None]

_SPLIT_READ = 128 << 20       # verified reads larger than this are hashed as chunks land
_PREFAULT_MIN = 1 << 20       # fresh host memory at least this large is touched before a read
_SMALL_READ = 64 << 10        # fresh tensors up to this size are read through a locked slab


@dataclass
class ReadPlan:
    """One tensor to read: what the manifest says, where it goes, how it went."""

    name: str
    entry: Entry
    out: torch.Tensor | None
    restore: Released | None
    fut: concurrent.futures.Future[torch.Tensor]
    device: Device = None
    shared: concurrent.futures.Future[torch.Tensor] | None = None  # restore in flight
    file_size: int = 0
    target: torch.Tensor | None = None     # what the caller gets
    dest: torch.Tensor | None = None       # what is read into (a copy for conj/neg views)
    flat: torch.Tensor | None = None       # contiguous host bytes of dest (hashed as landed)
    nread: int = 0
    resized: torch.UntypedStorage | None = None
    pin: bool = False                      # fresh page-locked memory
    slot: torch.Tensor | None = None       # small: read into a shared locked slab, copied
    pieces: list[tuple[concurrent.futures.Future[int], int, int]] = field(
        default_factory=list)
    ready: threading.Event = field(default_factory=threading.Event)   # reads submitted
    error: BaseException | None = None


class ReadJob:
    """A planned batch of reads: call it once to run it, or ``cancel`` it (its files are
    closed, ``abandon`` fails its plans)."""

    def __init__(self, run: Callable[[], None], fds: dict[str, DataFile],
                 abandon: Callable[[BaseException], None]) -> None:
        self._run = run
        self._fds = fds
        self._abandon = abandon
        self._once = threading.Lock()
        self._ran = False

    def _take(self) -> bool:
        with self._once:
            ran, self._ran = self._ran, True
        return not ran

    def __call__(self) -> None:
        if self._take():
            self._run()

    def cancel(self, exc: BaseException) -> None:
        if self._take():
            for f in self._fds.values():
                f.close()
            self._abandon(exc)


def _prefault(st: torch.UntypedStorage) -> None:
    """Touch fresh host memory before a read lands in it.

    The first write to each new page faults; done before the read is submitted, those faults
    overlap the reads already in flight instead of slowing the handle's copy into it.
    """
    import torch
    if st.nbytes() >= _PREFAULT_MIN:
        torch.empty(0, dtype=torch.uint8).set_(st).zero_()


def check_out(name: str, e: Entry, out: Any, dtype: torch.dtype) -> None:
    """Refuse an ``out`` that cannot take the tensor ``e`` records, before any I/O."""
    import torch
    if not isinstance(out, torch.Tensor):
        raise TypeError(f"swap_in of {name!r}: out must be a torch.Tensor, got "
                        f"{type(out).__name__}")
    was = released_as(out)
    if was is not None:
        raise SwapError(f"swap_in of {name!r}: out is the tensor released as {was!r}, "
                        f"which can no longer be restored: {was!r} was removed, or "
                        f"overwritten with a tensor of another shape or dtype, since")
    if tuple(out.shape) != e.shape:
        raise SwapError(f"swap_in of {name!r}: out has shape {tuple(out.shape)}, the "
                        f"tensor was swapped out with shape {e.shape}")
    if out.dtype != dtype:
        raise SwapError(f"swap_in of {name!r}: out has dtype {out.dtype}, the tensor was "
                        f"swapped out as {dtype}")
    if out.layout != torch.strided or out.device.type not in ("cpu", "cuda"):
        raise TypeError(f"swap_in of {name!r}: out must be a strided CPU or CUDA tensor")
    st = out.untyped_storage()
    if st.nbytes() < extent(out):
        raise SwapError(f"swap_in of {name!r}: out has no data (its storage holds "
                        f"{st.nbytes()} of the {extent(out)} bytes it spans; released?)")


def allocate(p: ReadPlan) -> None:
    """Choose and make the destination of ``p`` (just before its read is submitted)."""
    import torch
    e = p.entry
    dtype = dtype_from_name(e.dtype)
    p.nread = e.nbytes
    if p.restore is not None:
        target = p.restore.tensor
        unguard(target)
        st = target.untyped_storage()
        if st.nbytes() < p.restore.storage_nbytes:
            st.resize_(p.restore.storage_nbytes)
            p.resized = st
            if not target.is_cuda:
                _prefault(st)
    elif p.out is not None:
        target = p.out
    elif p.slot is not None:
        padded = round_pack(e.nbytes)
        if e.offset + padded <= p.file_size and e.offset % PACK_ALIGN == 0:
            p.nread = padded
        p.flat = p.dest = p.slot        # the tensor is made after the read (_execute)
        return
    else:
        padded = round_pack(e.nbytes)
        device = p.device
        if p.pin:
            from aioswap import pinned
            # a CPU destination: read direct even where it cannot be locked, no warning
            buf = pinned.empty(padded, torch.uint8, strict=False, warn=False)
            target = buf[:e.nbytes].view(dtype).view(e.shape)
            if e.offset + padded <= p.file_size and e.offset % PACK_ALIGN == 0:
                p.nread = padded        # whole aligned blocks: direct I/O, no tail
            p.flat = buf
        else:
            target = torch.empty(e.shape, dtype=dtype, device=device)
            if not target.is_cuda:
                _prefault(target.untyped_storage())
    p.target = target
    dest = target.detach()
    if dest.is_conj() or dest.is_neg():     # their memory is not their values: a copy
        dest = torch.empty(e.shape, dtype=dtype, device=dest.device)
    p.dest = dest
    if p.flat is None and dest.is_contiguous() and not dest.is_cuda:
        p.flat = dest.reshape(-1).view(torch.uint8)


def submit(p: ReadPlan, fd: DataFile, verify: bool,
           reader: _adaptive.Reader | None = None) -> None:
    """Queue the read(s) of ``p``; large verified reads in chunks hashed as they land.

    ``reader``: reads adapt to the page cache (:mod:`aioswap._adaptive`): a tensor whose
    range the cache holds is copied from it on the copy threads, the rest read direct
    (striped files: always direct)."""
    e = p.entry
    if e.nbytes == 0:
        return
    assert p.dest is not None
    hashed = verify and e.checksum_algo is not None
    if p.flat is not None:
        copy = (reader is not None and isinstance(fd, AioFile) and p.flat.is_cpu
                and reader.copies(fd, e.offset, e.nbytes))
        step = _checksum.HASH_CHUNK if hashed and p.nread > _SPLIT_READ else p.nread
        for s in range(0, p.nread, step):
            k = min(step, p.nread - s)
            f: Any
            if reader is not None and isinstance(fd, AioFile):
                # a copy stops at the end of the file (the last block may be padding)
                n = min(k, p.file_size - e.offset - s) if copy else k
                f = reader.pread(fd, p.flat[s:s + n], e.offset + s, copy=copy)
            else:
                f = fd.pread(p.flat[s:s + k], e.offset + s, async_op=True)
            assert isinstance(f, concurrent.futures.Future)
            p.pieces.append((f, s, min(k, e.nbytes - s)))
    else:
        f = fd.pread(p.dest, e.offset, nbytes=e.nbytes, async_op=True)
        assert isinstance(f, concurrent.futures.Future)
        p.pieces.append((f, 0, e.nbytes))


def execute(plans: list[ReadPlan], fds: dict[str, DataFile], verify: bool, pin: bool,
            budget: int, *, alloc_lanes: int,
            alloc_pool: Callable[[], concurrent.futures.ThreadPoolExecutor], read: str | None,
            check_sums: Callable[[ReadPlan, bool], None], lock: threading.RLock,
            releases: Releases) -> None:
    """Run a batch of reads: allocate and submit all, verify each as it lands, finish.

    What the swapper lends: ``alloc_lanes`` threads at most from ``alloc_pool()`` allocate,
    submit and check (``check_sums``); ``read`` is the read mode; each plan's restore ends in
    ``releases`` under ``lock``; a plan's future gets its tensor or its error."""
    import torch
    active = [p for p in plans if p.shared is None]
    left = budget
    fresh = [p for p in active if p.restore is None and p.out is None and p.entry.nbytes
             and (p.device is None or torch.device(p.device).type == "cpu")]
    # Small fresh tensors (unless page-locked results are asked for) are read into one
    # locked slab and copied into plain memory: one allocation for all of them instead
    # of one locked allocation (a syscall, a registry entry) each.
    small = [p for p in fresh if p.entry.nbytes <= _SMALL_READ] if not pin else []
    slab: torch.Tensor | None = None
    if len(small) > 1:
        need = 0
        take = []
        for p in small:
            if need + round_pack(p.entry.nbytes) <= SLAB_MAX:
                take.append(p)
                need += round_pack(p.entry.nbytes)
        from aioswap import pinned
        slab = pinned.empty(need, torch.uint8, strict=False, warn=False)   # CPU, read direct
        pos = 0
        for p in take:
            p.slot = slab[pos:pos + round_pack(p.entry.nbytes)]
            pos += round_pack(p.entry.nbytes)
    for p in fresh:         # who gets page-locked memory: decided in order, up front
        if p.slot is None:
            padded = round_pack(p.entry.nbytes)
            if pin or padded <= left:
                p.pin = True
                left -= 0 if pin else padded

    # Lanes take the next plan as they free up (in file order), so big and small tensors
    # spread over them whatever their order: a fixed split (every other tensor) handed
    # one lane every weight and the other every bias.
    def pull(order: list[ReadPlan]) -> Callable[[], ReadPlan | None]:
        it = iter(order)
        mu = threading.Lock()

        def take() -> ReadPlan | None:
            with mu:
                return next(it, None)
        return take

    reader = _adaptive.Reader(read, f"swap-in of {len(active)} tensors")

    def prepare(take: Callable[[], ReadPlan | None]) -> None:
        while (p := take()) is not None:
            try:
                allocate(p)
                submit(p, fds[p.entry.file], verify, reader)
            except Exception as exc:        # this tensor fails; the others go on
                p.error = exc
            finally:
                p.ready.set()

    # Fresh memory is faulted in (zeroed, or locked) as it is allocated; several threads
    # do that, each submitting its tensors' reads as soon as their memory is there, so
    # the faults run in parallel with each other and with the reads in flight.
    def check(take: Callable[[], ReadPlan | None]) -> None:
        while (p := take()) is not None:
            p.ready.wait()
            if p.error is None:
                try:
                    check_sums(p, verify)
                except Exception as exc:
                    p.error = exc

    lanes = min(alloc_lanes, len(active))
    groups: list[concurrent.futures.Future[None]] = []
    checks: list[concurrent.futures.Future[None]] = []
    first: BaseException | None = None
    try:
        try:
            if lanes > 1:
                nxt = pull(active)
                groups = [alloc_pool().submit(prepare, nxt) for _ in range(lanes)]
            else:
                prepare(pull(active))
            # hash once every read is queued: on a busy machine the hashing would
            # otherwise take CPU from the lanes, and the reads would be queued later
            concurrent.futures.wait(groups)
            if verify and lanes > 1:
                # then on every lane: tensors are hashed as they land, on all cores
                # (xxh3 releases the GIL), while the later reads are still in flight
                nxt = pull(active)
                checks = [alloc_pool().submit(check, nxt) for _ in range(lanes)]
                for c in checks:
                    c.result()
            else:
                check(pull(active))
        finally:
            concurrent.futures.wait(checks)     # no thread touches a plan after this
            concurrent.futures.wait(groups)
            # never leave the kernel writing into memory handed back
            concurrent.futures.wait([f for p in active for f, _, _ in p.pieces])
            for fd in fds.values():
                fd.close()
            reader.close()
    except BaseException as exc:            # a signal: every request has finished
        first = exc
    for p in plans:
        if p.shared is not None:
            continue
        err = p.error or first
        if err is None and p.slot is not None:
            try:
                t = torch.empty(p.entry.shape, dtype=dtype_from_name(p.entry.dtype))
                t.reshape(-1).view(torch.uint8).copy_(p.slot[:p.entry.nbytes])
                p.target = p.dest = t
            except Exception as exc:
                err = exc
        if err is None and p.dest is not None and p.target is not None \
                and p.dest is not p.target and p.dest.data_ptr() != p.target.data_ptr():
            try:
                p.target.detach().copy_(p.dest)     # conj/neg view: through a copy
            except Exception as exc:
                err = exc
        with lock:
            releases.end_restore(p.name, p.fut)
            if err is None and p.restore is not None \
                    and releases.get(p.name) is p.restore:
                releases.forget(p.name)
        if err is not None:
            if p.resized is not None:
                p.resized.resize_(0)    # still released: never hand out unverified data
            if p.restore is not None and p.restore.tensor.untyped_storage().nbytes() == 0:
                guard(p.restore.tensor, p.name)
            p.fut.set_exception(err)
        else:
            assert p.target is not None
            p.fut.set_result(p.target)
    if first is not None:
        raise first
