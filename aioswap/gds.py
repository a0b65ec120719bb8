"""GdsHandle: CUDA tensors through NVIDIA cuFile (GPUDirect Storage), CPU tensors through AIO.

cuFile is loaded with ``dlopen`` on first use (see :mod:`aioswap._cufile`); building and
importing aioswap never needs CUDA. Constructing a :class:`GdsHandle` where the library or a
GPU is missing raises :class:`~aioswap.errors.CuFileUnavailable` naming what is missing.
"""
from __future__ import annotations

import threading
from typing import TYPE_CHECKING, Any

from aioswap import _cufile, pinned
from aioswap.errors import CuFileUnavailable
from aioswap.handle import AioFile, AioHandle, DeviceTransport

if TYPE_CHECKING:
    import torch

__all__ = ["GdsHandle"]


class GdsHandle(AioHandle):
    """The :class:`~aioswap.AioHandle` surface with CUDA tensors moved by cuFile.

    CUDA tensors whose memory was registered with :meth:`pin_device_tensor` (or allocated
    with :meth:`new_pinned_device_tensor`) are read and written directly by cuFile; other
    CUDA tensors go through cuFile's own staging buffers. CPU tensors, numpy arrays and
    buffers take the kernel AIO paths of :class:`~aioswap.AioHandle`.

    Parameters are those of :class:`~aioswap.AioHandle`; ``config`` is an optional cuFile
    JSON configuration (a dict or a path), written to a private temporary file.

    Raises
    ------
    CuFileUnavailable
        libcufile cannot be loaded, or torch sees no CUDA device.
    """

    def __init__(self, *args: Any, config: Any = None, **kwargs: Any) -> None:
        self._driver: Any = None
        self._pins: dict[int, tuple[Any, Any]] = {}
        self._pin_lock = threading.Lock()
        _cufile.load()
        try:
            import torch
        except ImportError:
            raise CuFileUnavailable("GdsHandle needs torch with CUDA; torch is not "
                                    "installed") from None
        if not torch.cuda.is_available():
            raise CuFileUnavailable("GdsHandle needs a CUDA device: torch.cuda.is_available() "
                                    "is False")
        self._driver = _cufile.Driver(config)
        try:
            super().__init__(*args, device_transport=_CuFileTransport(), **kwargs)
        except BaseException:
            self._driver.close()
            raise

    # -- device memory -----------------------------------------------------------------
    def pin_device_tensor(self, tensor: torch.Tensor) -> None:
        """Register a contiguous CUDA tensor's memory with cuFile (and the registry)."""
        if tensor.device.type != "cuda" or not tensor.is_contiguous():
            layout = "contiguous" if tensor.is_contiguous() else "strided"
            raise ValueError(f"pin_device_tensor needs a contiguous CUDA tensor, got "
                             f"{tensor.device} {layout}")
        ptr, n = tensor.data_ptr(), tensor.numel() * tensor.element_size()
        with self._pin_lock:
            if ptr in self._pins:
                raise ValueError(f"device memory at {ptr:#x} is already pinned by this handle")
            # The registry's device index is the one record of cuFile-registered ranges: it
            # refuses overlaps and keeps the tensor alive; cuFile only gets the C call.
            reg = pinned.register(ptr, n, device=True, owner=tensor)
            try:
                _cufile.buf_register(ptr, n)
            except BaseException:
                reg.close()
                raise
            self._pins[ptr] = (tensor, reg)

    def unpin_device_tensor(self, tensor: torch.Tensor) -> None:
        """Undo :meth:`pin_device_tensor`."""
        ptr = tensor.data_ptr()
        with self._pin_lock:
            entry = self._pins.get(ptr)
            if entry is None:
                raise ValueError(f"device memory at {ptr:#x} was not pinned by this handle")
            _cufile.buf_deregister(ptr)         # when cuFile refuses, it stays pinned
            del self._pins[ptr]
        entry[1].close()

    def new_pinned_device_tensor(self, numel: int, dtype: torch.dtype,
                                 device: Any = "cuda") -> torch.Tensor:
        """A new CUDA tensor registered with cuFile; release with :meth:`unpin_device_tensor`."""
        import torch

        t: torch.Tensor = torch.empty(numel, dtype=dtype, device=device)
        self.pin_device_tensor(t)
        return t

    def close(self) -> None:
        """Finish in-flight requests, deregister pinned device memory, close the driver."""
        try:
            super().close()
        finally:
            with self._pin_lock:
                pins, self._pins = list(self._pins.items()), {}
            for ptr, (_t, reg) in pins:
                try:
                    _cufile.buf_deregister(ptr)
                finally:
                    reg.close()
            driver, self._driver = self._driver, None
            if driver is not None:
                driver.close()


class _CuFileTransport(DeviceTransport):
    """CUDA memory through cuFile: registered ranges direct, others via cuFile's staging."""

    def transfer(self, write: bool, address: int, nbytes: int, file: AioFile,
                 offset: int) -> tuple[int, str]:
        # cuFile wants I/O inside a registered buffer issued against the buffer's base.
        rng = pinned.registry.find(address, nbytes, device=True)
        base, buf_off = (rng[0], address - rng[0]) if rng is not None else (address, 0)
        # the file's cuFile registration: made on its first device request, kept while the
        # file is open, deregistered when it closes (not once per request)
        cf = file.device_handle(_cufile.CuFileHandle)
        if write:
            done = cf.write(base, nbytes, offset, buf_off)
        else:
            done = cf.read(base, nbytes, offset, buf_off)
        return int(done), "direct" if rng is not None else "bounce"
