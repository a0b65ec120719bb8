"""Stream training state through memory: read ahead, compute, write back, bucket by bucket.

The loop that ZeRO-Infinity's optimizer swapper and the RL frameworks' disk offload run (load
a bucket of state, compute on it, write it back, next bucket) as one primitive over a
:class:`~aioswap.swap.TensorSwapper`::

    for bucket in aioswap.stream(swapper, ["b0", "b1", "b2"], prefetch=1):
        step(bucket)                 # bucket["param"], bucket["exp_avg"], ... in place

While the caller computes on bucket *i*, buckets *i+1* .. *i+prefetch* are being read and
bucket *i-1* is being written back, so a step costs the largest of compute, read and write
instead of their sum.

A bucket is a *tag*: a flat ``{str: tensor}`` state stored under ``tag + "/"`` in the
swapper, as :func:`offload` writes it (``offload(swapper, "b0", {"param": p, "exp_avg": m})``).

Memory: ``slots = prefetch + 1 (+1 with write_back)`` page-locked arenas, each as large as
the largest bucket (every tensor at a 4096-byte aligned offset), allocated once when the
stream starts and reused for every bucket: :attr:`Stream.memory_bytes` is the bound. Reads
and writes of the arenas are direct I/O. (Write-back stages tensors up to 64 KiB and the
partial last block of larger ones through the swapper's small locked slab, taken from the
locked-memory cache.)

Crash safety: a write-back is :meth:`TensorSwapper.swap_out_state_dict` with
``overwrite=True``: the bucket goes to a fresh pack file, is fsynced, and is published by one
atomic manifest replacement, so a crash (SIGKILL included) leaves each bucket whole, either
as it was before the step or as it was after it, never a mix. A step is not atomic across
buckets; :attr:`Stream.written` says which buckets this stream has committed.
A bucket's arena is reused only after its write-back is durable and published.

Errors: an error reading bucket *i* is raised by the ``next()`` that would hand out bucket
*i*; an error writing back bucket *i* is raised by the first ``next()`` that finds it (at the
latest the one that needs its arena, or the last one). Either way the exception carries a
note naming the bucket, its committed state is whole, and the stream is closed.

Ending early: ``break``, an exception or Ctrl-C in the loop body, or :meth:`Stream.close`,
stops reading ahead (reads not yet started are cancelled), waits for every request in flight
(write-backs of the buckets already handed back finish and are committed; the bucket in hand
is not written back), then frees the arenas. ``with aioswap.stream(...) as s:`` closes at
the end of the block; a plain ``for`` loop closes the stream when the loop lets go of it.
"""
from __future__ import annotations

import collections
import concurrent.futures
import logging
import threading
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Union

from aioswap import pinned
from aioswap._util import add_note, round_up
from aioswap.errors import SwapError
from aioswap.swap import PACK_ALIGN, TensorSwapper

if TYPE_CHECKING:
    import torch

__all__ = ["Bucket", "Stream", "offload", "onload", "stream"]

_log = logging.getLogger("aioswap")

#: What separates a tag from the keys of its tensors in the swapper's names.
SEP = "/"

_Device = Union[str, "torch.device", int, None]


def _prefix(tag: str) -> str:
    if not isinstance(tag, str):
        raise TypeError(f"tags are str, got {type(tag).__name__}")
    if not tag or SEP in tag:
        raise ValueError(f"a tag is a non-empty str without {SEP!r}, got {tag!r}")
    return tag + SEP


def _tensors(tree: Any) -> list[torch.Tensor]:
    """The tensors in a nested dict/list/tuple, depth first."""
    import torch
    if isinstance(tree, torch.Tensor):
        return [tree]
    if isinstance(tree, Mapping):
        return [t for v in tree.values() for t in _tensors(v)]
    if isinstance(tree, (list, tuple)):
        return [t for v in tree for t in _tensors(v)]
    return []


# ----------------------------------------------------------------------------------------
# Offload / onload of a whole state


def offload(swapper: TensorSwapper, tag: str, state: Mapping[Any, Any], *,
            release: bool = False) -> list[str]:
    """Write a whole state (every tensor in it) to the swapper under ``tag``, all or nothing.

    Parameters
    ----------
    swapper : TensorSwapper
        Where the state goes.
    tag : str
        Name of the state (no ``/``); it is stored as the swapper's state ``tag + "/"``.
    state : mapping
        A flat ``{str: tensor}`` dict (e.g. ``dict(model.named_parameters())``; the form
        :func:`stream` buckets take) or any nested state that
        :meth:`TensorSwapper.swap_out_state_dict` takes (``optimizer.state_dict()``: dicts,
        lists, tuples of tensors and plain values), CPU or CUDA tensors.
    release : bool
        Once the state is durable and published, free each tensor's storage; :func:`onload`
        restores it in place. Needs tensors that span their whole, resizable storage
        (parameters, optimizer state; not views, not page-locked tensors).

    Returns
    -------
    list of str
        The names of the tensors under the tag (the swapper's names without ``tag + "/"``),
        in order.

    Raises
    ------
    SwapError, TypeError, ValueError, OSError
        As :meth:`TensorSwapper.swap_out_state_dict`; nothing is published on failure, and
        the last completed offload of ``tag`` stays whole.

    Notes
    -----
    One packed :meth:`TensorSwapper.swap_out_state_dict` with ``overwrite=True``: new pack
    files, fsynced, then one atomic manifest replacement, so after a crash the last
    completed offload of ``tag`` is whole. Tensors that an earlier offload of ``tag`` had and
    this one has not are removed afterwards (a second manifest update).
    """
    prefix = _prefix(tag)
    before = swapper.names(prefix)
    names = swapper.swap_out_state_dict(prefix, state, release=release, overwrite=True)
    assert isinstance(names, list)
    kept = set(names)
    stale = [n for n in before if n not in kept and n in swapper]
    if stale:
        swapper.remove_many(stale, force=True)
    return [n[len(prefix):] for n in names]


def onload(swapper: TensorSwapper, tag: str, *, into: Mapping[Any, Any] | None = None,
           device: _Device = None, verify: bool | None = None) -> Any:
    """Read the state written by :func:`offload` under ``tag``.

    Parameters
    ----------
    swapper : TensorSwapper
        Where the state is.
    tag : str
        As given to :func:`offload`.
    into : mapping, optional
        Restore into the tensors of this state in place: the same structure as given to
        :func:`offload` (e.g. ``dict(model.named_parameters())`` or
        ``optimizer.state_dict()``, whose tensors are the optimizer's own), each tensor of the
        recorded shape and dtype, CPU or CUDA. Tensors released by ``offload(...,
        release=True)`` are restored into their own storage, so every reference to them
        (views included) sees the data again. ``into`` itself is not modified otherwise.
    device : str, torch.device or int, optional
        Without ``into``: where to allocate the tensors (default CPU).
    verify : bool, optional
        Check checksums (default: the swapper's setting).

    Returns
    -------
    Any
        ``into`` itself, restored; without it, the state as
        :meth:`TensorSwapper.swap_in_state_dict` returns it.

    Raises
    ------
    SwapError
        Nothing stored under ``tag``; a tensor of ``into`` has no place in the stored state
        (for a nested state: raised after the reads); a wrong shape or dtype; a checksum mismatch
        (:class:`~aioswap.errors.ChecksumError`).
    """
    prefix = _prefix(tag)
    if into is None:
        return swapper.swap_in_state_dict(prefix, device=device, verify=verify)
    if not isinstance(into, Mapping):
        raise TypeError(f"onload into= takes a mapping (a state), got {type(into).__name__}")
    import torch
    flat = all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in into.items())
    if flat:
        stored = {n[len(prefix):] for n in swapper.names(prefix)}
        extra = [k for k in into if k not in stored]
        if extra:
            raise SwapError(f"onload of {tag!r}: {extra[0]!r} is not in the offloaded state "
                            f"({len(stored)} tensors)")
    # a shallow copy: the swapper sets the state's top-level keys in the dict it fills;
    # the tensors found in it are read into in place
    got = swapper.swap_in_state_dict(prefix, state_dict=dict(into), device=device,
                                     verify=verify)
    if not flat:
        read = {id(t) for t in _tensors(got)}
        missing = [t for t in _tensors(into) if id(t) not in read]
        if missing:
            raise SwapError(f"onload of {tag!r}: {len(missing)} tensor(s) of into= (the first "
                            f"of shape {tuple(missing[0].shape)}) have no place in the "
                            f"offloaded state and were not restored")
    return into


# ----------------------------------------------------------------------------------------
# The stream


class Bucket(Mapping[str, "torch.Tensor"]):
    """One bucket as the stream hands it out: its tensors by key, in page-locked memory.

    Modify the tensors in place; with ``write_back`` they are written back when the loop
    moves on. They are valid until then: afterwards their memory holds another bucket, and
    the bucket itself raises :class:`~aioswap.errors.SwapError` when used.
    """

    __slots__ = ("_tensors", "index", "nbytes", "step", "tag")

    def __init__(self, index: int, tag: str, tensors: dict[str, torch.Tensor],
                 nbytes: int, step: int = 0) -> None:
        self.index = index          #: position of the bucket in the stream's tags
        self.step = step            #: the pass over the tags it belongs to (0-based)
        self.tag = tag              #: the bucket's tag
        self.nbytes = nbytes        #: bytes of its tensors
        self._tensors: dict[str, torch.Tensor] | None = tensors

    def _live(self) -> dict[str, torch.Tensor]:
        if self._tensors is None:
            raise SwapError(f"bucket {self.index} ({self.tag!r}) was handed back to the "
                            f"stream: its memory now holds another bucket")
        return self._tensors

    def _retire(self) -> None:
        self._tensors = None

    @property
    def tensors(self) -> dict[str, torch.Tensor]:
        """The tensors by key (the dict the stream reads into and writes from)."""
        return self._live()

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._live()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._live())

    def __len__(self) -> int:
        return len(self._live())

    def __repr__(self) -> str:
        state = "" if self._tensors is not None else " handed back"
        return (f"<Bucket {self.index} {self.tag!r} step {self.step} {self.nbytes} "
                f"bytes{state}>")


@dataclass(frozen=True)
class _Layout:
    """Where the tensors of one bucket sit in an arena."""

    tag: str
    keys: tuple[str, ...]
    dtypes: tuple[torch.dtype, ...]
    shapes: tuple[tuple[int, ...], ...]
    offsets: tuple[int, ...]
    nbytes: tuple[int, ...]
    span: int                       # arena bytes the bucket needs


@dataclass
class _Op:
    """A read or write-back of one bucket in one slot."""

    index: int                      # the bucket
    slot: int
    bucket: Bucket
    fut: concurrent.futures.Future[Any]


def _read(swapper: TensorSwapper, prefix: str, views: dict[str, torch.Tensor],
          verify: bool | None, after: concurrent.futures.Future[Any] | None) -> None:
    """Read a bucket into its views (on the stream's reader thread), once ``after`` (the
    bucket's write-back of the previous step) is durable."""
    if after is not None:
        after.result()
    want = list(views)
    got = swapper.swap_in_state_dict(prefix, state_dict=views, verify=verify)
    assert isinstance(got, dict)
    if list(got) != want:
        raise SwapError(f"stream: bucket {prefix[:-1]!r} is not the flat {{str: tensor}} state "
                        f"the stream started with (changed meanwhile, or a nested state)")


def _write(swapper: TensorSwapper, prefix: str, views: dict[str, torch.Tensor]) -> None:
    """Write a bucket back from its views (on the stream's writer thread)."""
    swapper.swap_out_state_dict(prefix, views, overwrite=True)


class Stream:
    """Iterator over the buckets of a stream (see :func:`stream`); a context manager.

    Attributes
    ----------
    slots : int
        Arenas held (buckets in memory at once, at most).
    memory_bytes : int
        Page-locked bytes the stream holds: ``slots`` x the largest bucket (each tensor
        rounded up to 4096 bytes). Allocated once, at the start.
    written : list of int
        Buckets (indices) whose write-back this stream has made durable and published.
    """

    def __init__(self, swapper: TensorSwapper, tags: Sequence[str], *,
                 write_back: bool = True, prefetch: int = 1, steps: int = 1,
                 verify: bool | None = None) -> None:
        import torch
        self._closed = True            # until everything below exists (for __del__)
        if isinstance(tags, str):
            raise TypeError("tags is a sequence of tags, not one str")
        if not isinstance(prefetch, int) or isinstance(prefetch, bool) or prefetch < 1:
            raise ValueError(f"prefetch must be an int >= 1, got {prefetch!r}")
        if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
            raise ValueError(f"steps must be an int >= 1, got {steps!r}")
        if swapper.closed:
            raise SwapError("stream over a closed TensorSwapper")
        self._swapper = swapper
        self._write_back = bool(write_back)
        self._verify = verify
        self._prefetch = prefetch
        self._steps = steps
        owner: dict[str, str] = {}
        layouts: list[_Layout] = []
        for tag in tags:
            prefix = _prefix(tag)
            names = swapper.names(prefix)
            if not names:
                raise SwapError(f"stream: nothing is stored under tag {tag!r} in "
                                f"{swapper.directory!r} (write it with aioswap.offload)")
            keys, dtypes, shapes, offsets, sizes = [], [], [], [], []
            pos = 0
            for n in names:
                if n in owner:
                    raise ValueError(f"stream: {n!r} is in buckets {owner[n]!r} and {tag!r}")
                owner[n] = tag
                info = swapper.info(n)
                keys.append(n[len(prefix):])
                dtypes.append(info.dtype)
                shapes.append(info.shape)
                offsets.append(pos)
                sizes.append(info.nbytes)
                pos += round_up(info.nbytes, PACK_ALIGN)
            layouts.append(_Layout(tag, tuple(keys), tuple(dtypes), tuple(shapes),
                                   tuple(offsets), tuple(sizes), pos))
        self._layouts = layouts
        span = max((lay.span for lay in layouts), default=0)
        want = prefetch + 1 + (1 if self._write_back else 0)
        self.slots = min(want, len(layouts) * steps)
        self.memory_bytes = self.slots * span
        self.written: list[int] = []
        self._arenas: list[torch.Tensor] = [
            pinned.empty(max(span, 1), torch.uint8, strict=False) for _ in range(self.slots)]
        self._free: collections.deque[int] = collections.deque(range(self.slots))
        self._reads: collections.deque[_Op] = collections.deque()
        self._writes: collections.deque[_Op] = collections.deque()
        self._current: _Op | None = None
        self._next_read = 0             # next position (step x buckets + bucket) to read
        self._handed = 0                # positions handed out so far
        self._last_write: dict[int, concurrent.futures.Future[Any]] = {}   # per bucket
        self._lock = threading.Lock()   # next() against close() from another thread
        self._reader = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="aioswap-stream-read")
        self._writer = concurrent.futures.ThreadPoolExecutor(
            1, thread_name_prefix="aioswap-stream-write")
        self._closed = False

    # -- state ------------------------------------------------------------------------------
    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def tags(self) -> list[str]:
        return [lay.tag for lay in self._layouts]

    @property
    def in_flight(self) -> int:
        """Reads and write-backs submitted and not finished."""
        return sum(1 for op in (*self._reads, *self._writes) if not op.fut.done())

    def __repr__(self) -> str:
        total = len(self._layouts) * self._steps
        state = "closed" if self._closed else f"at {self._handed}/{total}"
        return (f"<Stream {len(self._layouts)} buckets, {self.slots} slots, "
                f"{self.memory_bytes} bytes, {state}>")

    # -- iteration --------------------------------------------------------------------------
    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> Bucket:
        with self._lock:
            if self._closed:
                raise StopIteration
            try:
                bucket = self._advance()
            except BaseException as exc:
                if not isinstance(exc, StopIteration):
                    self._shutdown(exc)
                    raise
                failed = self._shutdown(None)
                if failed is not None:
                    raise failed from None
                raise
            return bucket

    def _advance(self) -> Bucket:
        cur, self._current = self._current, None
        if cur is not None:             # the caller is done with it
            cur.bucket._retire()
            if self._write_back:
                self._start_write(cur)
            else:
                self._free.append(cur.slot)
        self._reap_writes(block=False)
        n = len(self._layouts)
        # read ahead within the window, and a bucket of the next step only once the loop has
        # handed it back in this one (its write-back is queued; the read waits for it)
        while self._next_read < min(n * self._steps, self._handed + 1 + self._prefetch) \
                and self._next_read - n < self._handed:
            if not self._free:          # the oldest write-back gives its arena
                self._reap_writes(block=True)
            self._start_read(self._next_read)
            self._next_read += 1
        if not self._reads:
            while self._writes:         # the end: every write-back durable
                self._reap_writes(block=True)
            raise StopIteration
        op = self._reads[0]
        try:
            op.fut.result()
        except BaseException as exc:
            if op.fut.done():           # the read failed (not an interrupted wait)
                add_note(exc, f"aioswap.stream: reading bucket {op.index} "
                              f"({op.bucket.tag!r}) failed; its stored state is unchanged")
            raise
        self._reads.popleft()
        self._current = op
        self._handed += 1
        return op.bucket

    def _views(self, index: int, slot: int, step: int = 0) -> Bucket:
        lay = self._layouts[index]
        arena = self._arenas[slot]
        views = {k: arena[off:off + nb].view(dt).view(shape)
                 for k, dt, shape, off, nb in zip(lay.keys, lay.dtypes, lay.shapes,
                                                  lay.offsets, lay.nbytes)}
        return Bucket(index, lay.tag, views, sum(lay.nbytes), step)

    def _start_read(self, pos: int) -> None:
        n = len(self._layouts)
        index = pos % n
        slot = self._free.popleft()
        bucket = self._views(index, slot, pos // n)
        after = self._last_write.get(index)
        fut = self._reader.submit(_read, self._swapper, _prefix(bucket.tag),
                                  bucket.tensors, self._verify, after)
        self._reads.append(_Op(index, slot, bucket, fut))

    def _start_write(self, op: _Op) -> None:
        lay = self._layouts[op.index]
        views = self._views(op.index, op.slot).tensors       # the caller's dict may differ
        fut = self._writer.submit(_write, self._swapper, _prefix(lay.tag), views)
        self._last_write[op.index] = fut
        self._writes.append(_Op(op.index, op.slot, op.bucket, fut))

    def _reap_writes(self, *, block: bool) -> None:
        """Finish write-backs in order (the oldest first; ``block``: at least one)."""
        while self._writes and (block or self._writes[0].fut.done()):
            op = self._writes[0]
            try:
                op.fut.result()
            except BaseException as exc:
                if op.fut.done():
                    self._writes.popleft()
                    add_note(exc, f"aioswap.stream: writing back bucket {op.index} "
                                  f"({op.bucket.tag!r}) failed; its committed state is "
                                  f"whole, as before this step")
                raise
            self._writes.popleft()
            self.written.append(op.index)
            self._free.append(op.slot)
            block = False

    # -- closing ----------------------------------------------------------------------------
    def _shutdown(self, cause: BaseException | None) -> BaseException | None:
        """Stop reading ahead, wait for every request, free the arenas.

        Returns the first write-back error not yet raised (None: none); an error that
        arrives while ``cause`` propagates is noted on it instead.
        """
        if self._closed:
            return None
        self._closed = True
        if self._current is not None:
            self._current.bucket._retire()
            self._current = None
        for op in self._reads:
            op.fut.cancel()             # not started: never runs
        interrupted: BaseException | None = None
        pending = [op.fut for op in (*self._reads, *self._writes)]
        while True:                     # no memory goes back under a request in flight
            try:
                concurrent.futures.wait(pending)
                break
            except BaseException as exc:       # Ctrl-C while draining: drain, then raise
                interrupted = interrupted or exc
        failed: BaseException | None = None
        for op in self._writes:
            err = op.fut.exception()
            if err is None:
                self.written.append(op.index)
            elif failed is None:
                add_note(err, f"aioswap.stream: writing back bucket {op.index} "
                              f"({op.bucket.tag!r}) failed; its committed state is whole, "
                              f"as before this step")
                failed = err
        for op in (*self._reads, *self._writes):
            op.bucket._retire()
        self._reads.clear()
        self._writes.clear()
        self._free.clear()
        self._last_write.clear()
        self._arenas = []
        for pool in (self._reader, self._writer):
            while True:                 # its thread joined, also when Ctrl-C lands here
                try:
                    pool.shutdown(wait=True)
                    break
                except BaseException as exc:
                    interrupted = interrupted or exc
        if interrupted is not None:
            raise interrupted
        if failed is not None and cause is not None and failed is not cause:
            add_note(cause, f"aioswap.stream: while stopping, a write-back failed too: "
                            f"{failed!r}")
            return None
        return failed

    def close(self) -> None:
        """Stop the stream: cancel reads ahead, wait for every request, free the arenas.

        Idempotent. Write-backs of buckets already handed back finish and are committed;
        the bucket in hand is not written back.

        Raises
        ------
        OSError, SwapError
            A write-back that failed and was not raised by ``next()`` yet.
        """
        with self._lock:
            failed = self._shutdown(None)
        if failed is not None:
            raise failed

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: object) -> None:
        with self._lock:
            failed = self._shutdown(exc)
        if failed is not None:
            raise failed

    def __del__(self) -> None:
        if getattr(self, "_closed", True):
            return
        try:
            failed = self._shutdown(None)
        except BaseException as exc:           # pragma: no cover - Ctrl-C in a finalizer
            _log.error("aioswap.stream: closing a stream that was let go: %r", exc)
            return
        if failed is not None:
            _log.error("aioswap.stream: a write-back failed after the loop let go of the "
                       "stream: %r", failed)


def stream(swapper: TensorSwapper, tags: Sequence[str], *, write_back: bool = True,
           prefetch: int = 1, steps: int = 1, verify: bool | None = None) -> Stream:
    """Stream buckets of stored state through bounded, reused page-locked memory.

    Parameters
    ----------
    swapper : TensorSwapper
        Holds the buckets, each written by :func:`offload` (or
        ``swap_out_state_dict(tag + "/", ...)``).
    tags : sequence of str
        The buckets, in the order to visit them. Their tensors must be disjoint.
    write_back : bool
        Write each bucket back (crash-safe, see the module notes) when the loop moves on;
        False for read-only passes.
    prefetch : int
        Buckets read ahead of the one in hand (>= 1).
    steps : int
        Passes over ``tags`` (training steps): the stream hands out ``steps x len(tags)``
        buckets (:attr:`Bucket.step` says which pass), reading ahead across the step
        boundary, so the first buckets of a step are read while the last ones of the step
        before are updated. A bucket is read again only after its previous write-back is
        durable.
    verify : bool, optional
        Check checksums on reads (default: the swapper's setting).

    Returns
    -------
    Stream
        An iterator of :class:`Bucket`; use it as a context manager to close it at the end
        of a block.

    Raises
    ------
    SwapError
        A tag with nothing stored under it, or a closed swapper.
    ValueError, TypeError
        A bad tag or ``prefetch``, or a tensor in two buckets.
    PinnedMemoryError
        Never: without enough lockable memory the arenas are unlocked memory (one warning)
        and I/O goes through the handle's bounce buffers.

    Notes
    -----
    Memory: :attr:`Stream.memory_bytes` = ``(prefetch + 1 + write_back)`` x the largest
    bucket, allocated when the stream is made and reused for every bucket. The stream's
    reads and write-backs run on two threads of its own (one each, in bucket order), whose
    I/O goes through the swapper's handle. Bucket tensors are valid until the loop moves on.
    """
    return Stream(swapper, tags, write_back=write_back, prefetch=prefetch, steps=steps,
                  verify=verify)
