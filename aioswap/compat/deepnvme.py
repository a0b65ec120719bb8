"""DeepSpeed DeepNVMe's ``aio_handle`` API on top of :class:`aioswap.AioHandle`.

Same constructor (defaults 1 MiB, 128, False, False, 1), method names, argument order and
return values as ``deepspeed.ops.op_builder.AsyncIOBuilder().load().aio_handle``, so code
written for DeepNVMe runs unchanged. Differences, on purpose:

* errors raise exceptions (``OSError``, ``ShortReadError``, ``ValueError``...) instead of
  aborting the process or returning -1;
* ``wait()`` with nothing queued returns 0 instead of aborting;
* reads past the end of the file, tails that are not 512-aligned and non-contiguous tensors
  work (or raise) instead of losing data silently;
* ``validate=True`` compares the tensor with a plain read of the file and raises
  ``ValueError`` on a mismatch instead of printing.
"""
from __future__ import annotations

import os
from typing import Any

from aioswap.handle import AioHandle, FileArg, IOFuture

__all__ = ["aio_handle", "gds_handle"]


class aio_handle:  # noqa: N801  (DeepNVMe's spelling)
    """DeepNVMe-compatible handle. See the module docstring for the differences."""

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128,
                 single_submit: bool = False, overlap_events: bool = False,
                 intra_op_parallelism: int = 1) -> None:
        self._h = self._new_handle(block_size, queue_depth, single_submit, overlap_events,
                                   intra_op_parallelism)
        self._to_validate: list[tuple[IOFuture, Any, FileArg, int]] = []

    def _new_handle(self, *knobs: Any) -> AioHandle:
        return AioHandle(*knobs)

    # -- knobs ---------------------------------------------------------------------------
    def get_block_size(self) -> int:
        return self._h.block_size

    def get_queue_depth(self) -> int:
        return self._h.queue_depth

    def get_single_submit(self) -> bool:
        return self._h.single_submit

    def get_overlap_events(self) -> bool:
        return self._h.overlap_events

    def get_intra_op_parallelism(self) -> int:
        return self._h.intra_op_parallelism

    def get_alignment(self) -> int:
        """Alignment of locked tensors from :meth:`new_cpu_locked_tensor` (a page)."""
        from aioswap._aio import PAGE_SIZE
        return int(PAGE_SIZE)

    # -- I/O -------------------------------------------------------------------------------
    def read(self, buffer: Any, filename: FileArg, validate: bool,
             file_offset: int = 0) -> int:
        """Blocking read of the whole buffer; returns 0 (DeepNVMe's success value)."""
        self._h.pread(buffer, filename, file_offset)
        if validate:
            _validate(buffer, filename, file_offset)
        return 0

    def write(self, buffer: Any, filename: FileArg, validate: bool,
              file_offset: int = 0) -> int:
        """Blocking write of the whole buffer; returns 0."""
        self._h.pwrite(buffer, filename, file_offset)
        if validate:
            _validate(buffer, filename, file_offset)
        return 0

    def pread(self, buffer: Any, filename: FileArg, validate: bool, async_op: bool,
              file_offset: int = 0) -> int:
        """Read; returns 0 when ``async_op`` (finish with :meth:`wait`), else 1."""
        return self._submit(self._h.pread, buffer, filename, validate, async_op, file_offset)

    def pwrite(self, buffer: Any, filename: FileArg, validate: bool, async_op: bool,
               file_offset: int = 0) -> int:
        """Write; returns 0 when ``async_op`` (finish with :meth:`wait`), else 1."""
        return self._submit(self._h.pwrite, buffer, filename, validate, async_op, file_offset)

    def sync_pread(self, buffer: Any, filename: FileArg, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, False, file_offset)

    def sync_pwrite(self, buffer: Any, filename: FileArg, file_offset: int = 0) -> int:
        return self.pwrite(buffer, filename, False, False, file_offset)

    def async_pread(self, buffer: Any, filename: FileArg, file_offset: int = 0) -> int:
        return self.pread(buffer, filename, False, True, file_offset)

    def async_pwrite(self, buffer: Any, filename: FileArg, file_offset: int = 0) -> int:
        """Asynchronous write to a path or an open fd; returns 0."""
        return self.pwrite(buffer, filename, False, True, file_offset)

    def wait(self) -> int:
        """Finish the queued asynchronous operations; return how many (0 when none).

        Operations submitted with ``validate=True`` are compared with the file afterwards.
        """
        try:
            return self._h.wait()
        finally:
            checks, self._to_validate = self._to_validate, []
            for fut, buffer, filename, offset in checks:
                if fut.exception() is None:
                    _validate(buffer, filename, offset)

    # -- locked memory ---------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any) -> Any:
        """A 1-D page-locked tensor of ``num_elem`` elements of ``example_tensor.dtype``."""
        return self._h.new_cpu_locked_tensor(num_elem, example_tensor.dtype)

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        self._h.free_cpu_locked_tensor(tensor)
        return True

    def is_pinned(self, tensor: Any) -> bool:
        return self._h.is_pinned(tensor)

    # -- beyond DeepNVMe -------------------------------------------------------------------
    @property
    def handle(self) -> AioHandle:
        """The underlying :class:`aioswap.AioHandle`."""
        return self._h

    def close(self) -> None:
        self._h.close()

    def __enter__(self) -> aio_handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, fn: Any, buffer: Any, filename: FileArg, validate: bool,
                async_op: bool, file_offset: int) -> int:
        if async_op:
            fut: IOFuture = fn(buffer, filename, file_offset, async_op=True)
            if validate:
                self._to_validate.append((fut, buffer, filename, file_offset))
            return 0
        fn(buffer, filename, file_offset)
        if validate:
            _validate(buffer, filename, file_offset)
        return 1


def _validate(buffer: Any, filename: FileArg, file_offset: int) -> None:
    """Compare ``buffer`` with a plain read of the file; raise ValueError on a mismatch."""
    import numpy as np

    from aioswap.handle import _resolve
    mem = _resolve(buffer)
    if mem.tensor is not None:
        import torch
        c = mem.tensor.detach().cpu().contiguous()
        data = c.as_strided((c.numel(),), (1,)).view(torch.uint8).numpy().tobytes()
    else:
        data = np.ascontiguousarray(mem.array).tobytes()
    if isinstance(filename, int):
        disk = os.pread(filename, len(data), file_offset)
    else:
        with open(filename, "rb") as f:
            f.seek(file_offset)
            disk = f.read(len(data))
    if disk != data:
        raise ValueError(f"validation failed: {len(data)} bytes at offset {file_offset} of "
                         f"{filename!r} differ from the buffer")


class gds_handle(aio_handle):  # noqa: N801  (DeepNVMe's spelling)
    """DeepNVMe-compatible GDS handle: CUDA tensors through cuFile, CPU tensors through AIO.

    Raises :class:`aioswap.errors.CuFileUnavailable` when cuFile or a GPU is missing.
    """

    def _new_handle(self, *knobs: Any) -> AioHandle:
        from aioswap.gds import GdsHandle
        return GdsHandle(*knobs)

    def new_pinned_device_tensor(self, num_elem: int, example_tensor: Any) -> Any:
        return self._h.new_pinned_device_tensor(num_elem, example_tensor.dtype)  # type: ignore[attr-defined]

    def free_pinned_device_tensor(self, tensor: Any) -> bool:
        self._h.unpin_device_tensor(tensor)  # type: ignore[attr-defined]
        return True

    def pin_device_tensor(self, tensor: Any) -> bool:
        self._h.pin_device_tensor(tensor)  # type: ignore[attr-defined]
        return True

    def unpin_device_tensor(self, tensor: Any) -> bool:
        self._h.unpin_device_tensor(tensor)  # type: ignore[attr-defined]
        return True
