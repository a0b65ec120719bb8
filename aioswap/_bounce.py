"""The bounce ring of a handle lane: block-sized, aligned, page-locked buffers.

The engine (:class:`aioswap._aio.AioQueue`) stages every piece that cannot go straight to
the kernel through these buffers (unpinned or misaligned memory, the unaligned edge blocks
of any request) and does the copies itself, without the GIL, overlapped with the I/O of the
other buffers. This module only decides their size and allocates them once per lane.
"""
from __future__ import annotations

import logging
import sys
import threading
from typing import Any

from aioswap import _aio, pinned

__all__ = ["DEFAULT_RING_CAP", "Ring", "ring_shape"]

_log = logging.getLogger("aioswap")

#: Most bytes one lane's ring may hold, whatever ``2 * queue_depth * block_size`` says.
DEFAULT_RING_CAP = 64 << 20
_UNIT = _aio.DEFAULT_ALIGNMENT     # a buffer holds any edge block and keeps the next aligned


def ring_shape(block_size: int, queue_depth: int, cap: int | None = None) -> tuple[int, int]:
    """``(buffer_bytes, buffers)`` of one lane's ring.

    Buffers are ``block_size`` rounded up to whole O_DIRECT units of 4096 bytes (at least
    one, so any edge block fits), ``2 * queue_depth`` of them (``queue_depth`` in the kernel
    while as many wait for their copy), capped at ``cap`` bytes in all (at least one).
    """
    cap = DEFAULT_RING_CAP if cap is None else max(_UNIT, int(cap))
    buf = max(_UNIT, -(-block_size // _UNIT) * _UNIT)
    buf = min(buf, max(_UNIT, cap // _UNIT * _UNIT))
    return buf, max(1, min(2 * queue_depth, cap // buf))


class Ring:
    """One lane's ring: allocated on first use, freed by :meth:`close` after the lane."""

    def __init__(self, queue: _aio.AioQueue, buffer_bytes: int, buffers: int) -> None:
        self._queue = queue
        self.buffer_bytes = buffer_bytes
        self.buffers = buffers
        self._mem: Any = None
        self._lock = threading.Lock()
        self._cuda = False

    @property
    def nbytes(self) -> int:
        return self.buffer_bytes * self.buffers

    @property
    def attached(self) -> bool:
        return self._mem is not None

    def ensure(self) -> None:
        """Allocate and attach the ring (once)."""
        if self._mem is not None:
            return
        with self._lock:
            if self._mem is None:
                # strict=False: without CAP_IPC_LOCK and a large RLIMIT_MEMLOCK the ring is
                # aligned but unlocked (one warning); O_DIRECT needs alignment, not locking.
                mem = pinned.allocate(self.nbytes, strict=False)
                try:
                    self._queue.attach_ring(mem, mem.address, self.buffer_bytes, self.buffers)
                finally:
                    # attached, even when a signal handler raised on the call's return (io_uring
                    # registers the ring in the call: a SIGINT lands there)
                    if self._queue.ring_buffers:
                        self._mem = mem

    def host_tensor(self, nbytes: int) -> Any:
        """A uint8 tensor over the start of the ring (CUDA staging; the ring is idle)."""
        import torch

        self.ensure()
        return torch.frombuffer(self._mem, dtype=torch.uint8, count=nbytes)

    def register_cuda(self) -> None:
        """Page-lock the ring for CUDA too, so device copies run at full speed."""
        self.ensure()
        with self._lock:
            if self._cuda:
                return
            torch: Any = sys.modules.get("torch")
            try:
                rc = torch.cuda.cudart().cudaHostRegister(self._mem.address, self.nbytes, 0)
                self._cuda = int(rc) == 0
            except Exception as exc:    # a slower pageable copy still works
                _log.debug("cudaHostRegister of the bounce ring failed: %s", exc)

    def close(self) -> None:
        """Free the memory; the caller closed the queue first (nothing in flight)."""
        with self._lock:
            mem, self._mem = self._mem, None
            if mem is not None and self._cuda:
                try:
                    sys.modules["torch"].cuda.cudart().cudaHostUnregister(mem.address)
                except Exception as exc:
                    _log.debug("cudaHostUnregister of the bounce ring failed: %s", exc)
                self._cuda = False
        if mem is not None:
            try:
                pinned.free(mem)
            except BufferError:
                pass        # a view of the ring is still alive: it goes with the last view
