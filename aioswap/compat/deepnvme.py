"""DeepSpeed DeepNVMe's ``async_io``, ``gds`` and ``pin_memory`` op modules on aioswap.

This module is what ``AsyncIOBuilder().load()``, ``GDSBuilder().load()`` and
``PinMemoryBuilder().load()`` return once :func:`aioswap.compat.deepspeed.install` ran:

* :class:`aio_handle` and :class:`gds_handle`: DeepNVMe's constructor (defaults 1 MiB, 128,
  False, False, 1), method names, argument names (``async``, ``fd``, ``example_tenosr``...)
  and return values (``async_* -> 0``, synchronous calls and ``wait()`` -> the number of
  operations completed, ``read``/``write`` -> 0, ``free_*`` -> bool);
* :func:`aio_read`, :func:`aio_write`, :func:`deepspeed_memcpy`: DeepNVMe's module functions
  (``ds_io --engine aio_basic`` calls them);
* :class:`pin_handle`: the ``pin_memory`` op's handle.

Every handle shares one process-wide manager of the locked tensors it allocated, and
``is_pinned`` asks aioswap's registry, so memory locked through any of them (or through
``aioswap.pinned``) is recognised by all of them.

Differences from DeepNVMe, on purpose:

* errors raise exceptions (``OSError``, ``ShortReadError``, ``ValueError``...) instead of
  aborting the process or printing and returning -1;
* ``wait()`` with nothing queued returns 0 instead of aborting;
* any block size, buffer size, file offset and parallelism works; reads past the end of the
  file raise; non-contiguous tensors are read and written correctly;
* ``free_cpu_locked_tensor`` never frees memory that a view still uses: it drops the
  manager's reference and the memory goes with the last view (DeepNVMe frees at once);
* ``validate=True`` compares the tensor with a plain read of the file and raises
  ``ValueError`` on a mismatch instead of printing.

Several drives: DeepSpeed takes one ``nvme_path``. With ``AIOSWAP_NVME_PATHS`` set to that
path followed by more directories, one per drive (``os.pathsep``-separated, e.g.
``/nvme0/ds:/nvme1/ds:/nvme2/ds``), every file an :class:`aio_handle` reads or writes under
the first directory is striped (:mod:`aioswap.stripe`) over the same relative path under
each of them: each drive its own queue, units handed to the drive that frees up first.
"""
from __future__ import annotations

import atexit
import collections
import concurrent.futures
import errno
import logging
import os
import threading
from typing import TYPE_CHECKING, Any, Callable, Union

from aioswap import _aio, pinned
from aioswap.handle import AioHandle, IOFuture
from aioswap.stripe import LAYOUT_SUFFIX, StripedFile, open_striped

if TYPE_CHECKING:
    import torch

__all__ = ["aio_handle", "aio_read", "aio_write", "deepspeed_memcpy", "gds_handle",
           "pin_handle"]

FileArg = Union[str, bytes, "os.PathLike[str]", "os.PathLike[bytes]", int]

_log = logging.getLogger("aioswap")

O_DIRECT_ALIGNMENT = 512
"""DeepNVMe's ``get_alignment()`` unit: 512 bytes per intra-op worker."""

NVME_PATHS_ENV = "AIOSWAP_NVME_PATHS"
"""Environment variable: DeepSpeed's ``nvme_path`` and more directories to stripe its files
over (``os.pathsep``-separated); see the module docstring."""

_MAX_STRIPED_OPEN = 64      # striped files kept open (the least recent closes)


def _stripe_roots() -> list[str] | None:
    """The directories of ``AIOSWAP_NVME_PATHS`` (absolute), or None for fewer than two."""
    raw = os.environ.get(NVME_PATHS_ENV, "")
    roots = [os.path.abspath(r) for r in raw.split(os.pathsep) if r.strip()]
    if len(roots) < 2:
        return None
    if len({os.path.realpath(r) for r in roots}) != len(roots):
        raise ValueError(f"{NVME_PATHS_ENV} names a directory twice: {raw!r}")
    return roots


# ---------------------------------------------------------------------------------------
# The locked-tensor manager shared by every handle (DeepNVMe's deepspeed_pin_tensor_t)


class _LockedTensors:
    """Process-wide record of the locked tensors the compat handles allocated.

    Keyed by allocation address, as DeepNVMe's manager is. The record holds the tensor's
    *storage*, not the tensor: the memory stays alive until it is freed (DeepNVMe's
    lifetime), while the tensor object itself may be collected (DeepSpeed's native pinned
    memory manager frees by address from a finalizer on it). Freeing drops the record, so
    the memory goes when the last tensor viewing it is collected, never earlier.
    """

    def __init__(self) -> None:
        # Reentrant: a garbage collection inside a critical section may run a finalizer
        # that frees by address (DeepSpeed's native pinned memory does).
        self._lock = threading.RLock()
        self._held: dict[int, Any] = {}

    def new(self, num_elem: int, example_tensor: Any) -> torch.Tensor:
        dtype = getattr(example_tensor, "dtype", None)
        if dtype is None:
            raise TypeError(f"example_tensor must be a torch tensor (its dtype is used), got "
                            f"{type(example_tensor).__name__}")
        t: torch.Tensor = pinned.empty(int(num_elem), dtype)
        address, storage = t.data_ptr(), t.untyped_storage()
        with self._lock:
            self._held[address] = storage
        return t

    def free(self, tensor: Any) -> bool:
        torch = _torch()
        if torch is None or not isinstance(tensor, torch.Tensor) or not tensor.is_cpu:
            return False
        try:
            address = tensor.data_ptr()
        except RuntimeError:            # tensors without storage (meta, fake, sparse...)
            return False
        return self.free_by_ptr(address)

    def free_by_ptr(self, address: int) -> bool:
        with self._lock:
            storage = self._held.pop(int(address), None)
        # `storage` is released here, outside the lock: if it was the last user, the
        # registry's finalizer unlocks and unmaps the memory now.
        return storage is not None

    def __len__(self) -> int:
        with self._lock:
            return len(self._held)


_locked = _LockedTensors()


def _torch() -> Any:
    import sys
    return sys.modules.get("torch")


# ---------------------------------------------------------------------------------------
# Striped files (AIOSWAP_NVME_PATHS)


class _Stripes:
    """The striped files of the process, shared by every handle.

    DeepSpeed writes a swap file through one handle and reads it through another, so one
    file must be one :class:`~aioswap.stripe.StripedFile` (its layout lives in memory until
    saved). Each is opened once, on a handle of this module's own (the drives' handles come
    from its knobs, those of the first handle that striped), and reopened when its path
    names another file now (DeepSpeed clears its swap folder at start). The least recently
    used beyond :data:`_MAX_STRIPED_OPEN` are closed.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._handle: AioHandle | None = None
        self._files: collections.OrderedDict[str, tuple[tuple[int, int], StripedFile]] = \
            collections.OrderedDict()
        os.register_at_fork(after_in_child=self._forget)

    def _forget(self) -> None:
        self._lock = threading.Lock()
        self._handle = None
        self._files = collections.OrderedDict()

    def get(self, p: str, roots: list[str], write: bool, like: AioHandle) -> StripedFile:
        with self._lock:
            try:
                # no timestamps asked: a query of them makes the next write stamp the inode
                # (see aioswap/_statlite.h), and DeepSpeed writes these files again and again
                _, dev, ino, _, _ = _aio.stat_lite_of(p)
                key: tuple[int, int] | None = (dev, ino)
            except FileNotFoundError:
                key = None
            got = self._files.get(p)
            if got is not None:
                if got[0] == key and not got[1].closed:
                    self._files.move_to_end(p)
                    return got[1]
                del self._files[p]
                try:
                    got[1].close()      # replaced or removed: its parts are stale
                except OSError:         # its layout's directory went with it
                    pass
            if key is None and not write:
                raise FileNotFoundError(errno.ENOENT, "No such file or directory", p)
            rel = os.path.relpath(p, roots[0])
            parts = [p] + [os.path.join(r, rel) for r in roots[1:]]
            for q in parts[1:]:
                os.makedirs(os.path.dirname(q), mode=0o700, exist_ok=True)
            if self._handle is None or self._handle.closed:
                self._handle = AioHandle.from_config(like.config)
            mode = "r+" if key is not None and os.path.exists(p + LAYOUT_SUFFIX) else "w"
            f = open_striped(self._handle, parts, mode)
            _, dev, ino, _, _ = _aio.stat_lite_of(p)
            self._files[p] = ((dev, ino), f)
            while len(self._files) > _MAX_STRIPED_OPEN:
                self._files.popitem(last=False)[1][1].close()    # waits for its requests
            return f

    def close(self) -> None:
        with self._lock:
            files = [f for _, f in self._files.values()]
            self._files.clear()
            h, self._handle = self._handle, None
        for f in files:
            try:
                f.close()       # saves its layout: the directory may be gone (at exit)
            except OSError as exc:
                _log.warning("could not save the layout of %s on closing it: %s", f.name, exc)
        if h is not None:
            h.close()


_stripes = _Stripes()
atexit.register(_stripes.close)


# ---------------------------------------------------------------------------------------
# aio_handle


def _pick_file(op: str, filename: FileArg | None, fd: int | None) -> FileArg:
    if fd is not None:
        if filename is not None:
            raise TypeError(f"{op}() takes either filename or fd, not both")
        if isinstance(fd, bool) or not isinstance(fd, int):
            raise TypeError(f"{op}(): fd must be an int, got {type(fd).__name__}")
        return fd
    if filename is None:
        raise TypeError(f"{op}() missing required argument: 'filename' (or 'fd')")
    return filename


def _pick_async(op: str, async_op: bool | None, extra: dict[str, Any]) -> bool:
    """DeepNVMe names the flag ``async`` (a Python keyword: passed as ``**{"async": x}``)."""
    if "async" in extra:
        if async_op is not None:
            raise TypeError(f"{op}() got both 'async' and 'async_op'")
        async_op = extra.pop("async")
    if extra:
        raise TypeError(f"{op}() got unexpected keyword argument(s): {', '.join(sorted(extra))}")
    if async_op is None:
        raise TypeError(f"{op}() missing required argument: 'async'")
    return bool(async_op)


class aio_handle:  # noqa: N801  (DeepNVMe's spelling)
    """DeepNVMe-compatible handle; see the module docstring for the differences.

    Parameters
    ----------
    block_size, queue_depth, single_submit, overlap_events, intra_op_parallelism
        As for :class:`aioswap.AioHandle` (DeepNVMe's defaults: 1 MiB, 128, False, False,
        1). Any positive block size works; the engine rounds the pieces it submits to the
        file's direct-I/O alignment.

    Notes
    -----
    Synchronous calls queue the request and then wait for *every* queued request, so they
    return the number of operations completed, as DeepNVMe's do (1 when nothing else was
    queued).
    """

    #: whether files under ``AIOSWAP_NVME_PATHS``' first directory are striped
    _stripes = True

    def __init__(self, block_size: int = 1048576, queue_depth: int = 128,
                 single_submit: bool = False, overlap_events: bool = False,
                 intra_op_parallelism: int = 1) -> None:
        self._roots = _stripe_roots() if self._stripes else None
        self._h = self._new_handle(block_size, queue_depth, single_submit, overlap_events,
                                   intra_op_parallelism)
        self._lock = threading.Lock()
        self._to_validate: list[tuple[IOFuture, Any, FileArg | StripedFile, int]] = []
        self._striped_futs: list[IOFuture] = []

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
        """``512 * intra_op_parallelism``, as DeepNVMe (DeepSpeed sizes swap buffers by it)."""
        return O_DIRECT_ALIGNMENT * self._h.intra_op_parallelism

    # -- I/O -------------------------------------------------------------------------------
    def read(self, buffer: Any, filename: FileArg | None = None, validate: bool = False,
             file_offset: int = 0, *, fd: int | None = None) -> int:
        """Blocking read of the whole buffer; returns 0 (DeepNVMe's success value)."""
        file = _pick_file("read", filename, fd)
        try:
            self._h.pread(buffer, file, file_offset)
        finally:
            self._h.close_files()
        if validate:
            _validate(buffer, file, file_offset)
        return 0

    def write(self, buffer: Any, filename: FileArg | None = None, validate: bool = False,
              file_offset: int = 0, *, fd: int | None = None) -> int:
        """Blocking write of the whole buffer; returns 0."""
        file = _pick_file("write", filename, fd)
        try:
            self._h.pwrite(buffer, file, file_offset)
        finally:
            self._h.close_files()
        if validate:
            _validate(buffer, file, file_offset)
        return 0

    def pread(self, buffer: Any, filename: FileArg | None = None, validate: bool = False,
              async_op: bool | None = None, file_offset: int = 0, *, fd: int | None = None,
              **kwargs: Any) -> int:
        """Read; returns 0 when asynchronous (finish with :meth:`wait`), else the count of
        completed operations. The flag is the 4th argument, or ``async`` by keyword."""
        asyn = _pick_async("pread", async_op, kwargs)
        return self._submit(self._h.pread, buffer, _pick_file("pread", filename, fd),
                            validate, asyn, file_offset)

    def pwrite(self, buffer: Any, filename: FileArg | None = None, validate: bool = False,
               async_op: bool | None = None, file_offset: int = 0, *, fd: int | None = None,
               **kwargs: Any) -> int:
        """Write; returns 0 when asynchronous (finish with :meth:`wait`), else the count of
        completed operations."""
        asyn = _pick_async("pwrite", async_op, kwargs)
        return self._submit(self._h.pwrite, buffer, _pick_file("pwrite", filename, fd),
                            validate, asyn, file_offset)

    def sync_pread(self, buffer: Any, filename: FileArg | None = None, file_offset: int = 0,
                   *, fd: int | None = None) -> int:
        return self._submit(self._h.pread, buffer, _pick_file("sync_pread", filename, fd),
                            False, False, file_offset)

    def sync_pwrite(self, buffer: Any, filename: FileArg | None = None, file_offset: int = 0,
                    *, fd: int | None = None) -> int:
        return self._submit(self._h.pwrite, buffer, _pick_file("sync_pwrite", filename, fd),
                            False, False, file_offset)

    def async_pread(self, buffer: Any, filename: FileArg | None = None, file_offset: int = 0,
                    *, fd: int | None = None) -> int:
        return self._submit(self._h.pread, buffer, _pick_file("async_pread", filename, fd),
                            False, True, file_offset)

    def async_pwrite(self, buffer: Any, filename: FileArg | None = None, file_offset: int = 0,
                     *, fd: int | None = None) -> int:
        """Asynchronous write to a path, or to an open descriptor (``fd=``); returns 0."""
        return self._submit(self._h.pwrite, buffer, _pick_file("async_pwrite", filename, fd),
                            False, True, file_offset)

    def wait(self) -> int:
        """Finish the queued asynchronous operations; return how many (0 when none).

        Operations submitted with ``validate=True`` are compared with the file afterwards.
        """
        with self._lock:
            return self._wait_locked()

    def _wait_locked(self) -> int:
        futs, self._striped_futs = self._striped_futs, []
        try:
            n = self._h.wait()
        finally:
            # as DeepNVMe, no descriptor outlives the calls that used it: a caller that
            # closes or deletes its file next (DeepSpeed's FastFileWriter) frees it at once
            self._h.close_files()
            if futs:
                concurrent.futures.wait(futs)       # the drives' own handles
            checks, self._to_validate = self._to_validate, []
            for fut, buffer, file, offset in checks:
                if fut.done() and fut.exception() is None:
                    _validate(buffer, file, offset)
        for fut in futs:
            exc = fut.exception()
            if exc is not None:
                raise exc
        return n + len(futs)

    def _striped_file(self, file: FileArg, write: bool) -> StripedFile | None:
        """The striped file behind a path under the first ``AIOSWAP_NVME_PATHS`` directory,
        else None (see :class:`_Stripes`)."""
        roots = self._roots
        if roots is None or isinstance(file, int):
            return None
        p = os.path.abspath(os.fsdecode(file))
        if os.path.commonpath([p, roots[0]]) != roots[0] or p == roots[0]:
            return None
        return _stripes.get(p, roots, write, self._h)

    # -- locked memory ---------------------------------------------------------------------
    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any = None,
                              **kwargs: Any) -> torch.Tensor:
        """A 1-D page-locked tensor of ``num_elem`` elements of ``example_tensor.dtype``.

        DeepNVMe's keyword for the example is ``example_tenosr`` (sic); both spellings work.
        Release it with :meth:`free_cpu_locked_tensor` (or any handle's).
        """
        return _locked.new(num_elem, _example(example_tensor, kwargs))

    def free_cpu_locked_tensor(self, tensor: Any) -> bool:
        """Release a tensor from :meth:`new_cpu_locked_tensor`; False for any other tensor.

        The memory is released when the last tensor viewing it is gone, so views that are
        still alive stay valid.
        """
        return _locked.free(tensor)

    def is_pinned(self, buffer: Any) -> bool:
        """Whether ``buffer`` lies in locked memory (any aioswap allocation or registration,
        or torch-pinned memory)."""
        return pinned.is_pinned(buffer)

    # -- beyond DeepNVMe -------------------------------------------------------------------
    @property
    def handle(self) -> AioHandle:
        """The underlying :class:`aioswap.AioHandle`."""
        return self._h

    def close(self) -> None:
        with self._lock:
            self._wait_striped()
        self._h.close()

    def _wait_striped(self) -> None:
        futs, self._striped_futs = self._striped_futs, []
        concurrent.futures.wait(futs)

    def __enter__(self) -> aio_handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # DeepNVMe handles have no close(): DeepSpeed drops them and the destructor stops
        # their threads. Do the same, without the unclosed-handle warning.
        h = getattr(self, "_h", None)
        if h is not None and not h.closed:
            try:
                if getattr(self, "_striped_futs", None):
                    self._wait_striped()
                h.close()
            except Exception:
                pass

    def _submit(self, fn: Callable[..., Any], buffer: Any, file: FileArg, validate: bool,
                async_op: bool, file_offset: int) -> int:
        # One lock over submit-and-wait, as DeepNVMe's handle mutex: a synchronous call
        # from one thread is not counted in another thread's synchronous call.
        with self._lock:
            striped = self._striped_file(file, fn.__name__ == "pwrite") if self._roots \
                else None
            fut: IOFuture
            if striped is not None:
                op = striped.pwrite if fn.__name__ == "pwrite" else striped.pread
                fut = op(buffer, file_offset, async_op=True)     # type: ignore[assignment]
                self._striped_futs.append(fut)
            else:
                fut = fn(buffer, file, file_offset, async_op=True)
            if validate:
                self._to_validate.append((fut, buffer, striped or file, file_offset))
            if async_op:
                return 0
            # DeepNVMe's synchronous calls wait for everything queued and return that count.
            return self._wait_locked()


def _example(example_tensor: Any, kwargs: dict[str, Any]) -> Any:
    for name in ("example_tenosr", "example_tensor"):      # DeepNVMe's typo, pin_memory's
        if name in kwargs:
            if example_tensor is not None:
                raise TypeError(f"new_cpu_locked_tensor() got the example twice ({name})")
            example_tensor = kwargs.pop(name)
    if kwargs:
        raise TypeError(f"new_cpu_locked_tensor() got unexpected keyword argument(s): "
                        f"{', '.join(sorted(kwargs))}")
    if example_tensor is None:
        raise TypeError("new_cpu_locked_tensor() missing required argument: 'example_tensor'")
    return example_tensor


def _bytes_of(buffer: Any) -> bytes:
    torch = _torch()
    if torch is not None and isinstance(buffer, torch.Tensor):
        c = buffer.detach().cpu().contiguous()
        data: bytes = c.reshape(-1).view(torch.uint8).numpy().tobytes()
        return data
    import numpy as np
    return np.ascontiguousarray(buffer).tobytes()


def _validate(buffer: Any, file: FileArg | StripedFile, file_offset: int) -> None:
    """Compare ``buffer`` with a plain read of the file; raise ValueError on a mismatch."""
    data = _bytes_of(buffer)
    disk: bytes | bytearray
    if isinstance(file, StripedFile):
        disk = bytearray(len(data))
        if data:
            file.pread(disk, file_offset)
        file = file.name
    elif isinstance(file, int):
        disk = os.pread(file, len(data), file_offset)
    else:
        with open(file, "rb") as f:
            f.seek(file_offset)
            disk = f.read(len(data))
    if disk != data:
        raise ValueError(f"validation failed: {len(data)} bytes at offset {file_offset} of "
                         f"{file!r} differ from the buffer")


# ---------------------------------------------------------------------------------------
# Module functions of DeepNVMe's async_io op


def aio_read(buffer: Any, filename: FileArg, block_size: int, queue_depth: int,
             single_submit: bool, overlap_events: bool, validate: bool) -> int:
    """Read the whole file into ``buffer`` with a handle of these knobs; returns 0.

    Raises
    ------
    ValueError
        When the file's size is not the buffer's size (DeepNVMe asserts they are equal).
    """
    nbytes = _nbytes(buffer)
    size = _aio.stat_lite_of(filename)[3]
    if size != nbytes:
        raise ValueError(f"aio_read: {filename!r} has {size} bytes but the buffer has "
                         f"{nbytes}; they must be equal")
    with AioHandle(block_size, queue_depth, single_submit, overlap_events) as h:
        h.pread(buffer, filename, 0)
    if validate:
        _validate(buffer, filename, 0)
    return 0


def aio_write(buffer: Any, filename: FileArg, block_size: int, queue_depth: int,
              single_submit: bool, overlap_events: bool, validate: bool) -> int:
    """Write the whole buffer at offset 0 of the file with a handle of these knobs; returns 0."""
    with AioHandle(block_size, queue_depth, single_submit, overlap_events) as h:
        h.pwrite(buffer, filename, 0)
    if validate:
        _validate(buffer, filename, 0)
    return 0


def deepspeed_memcpy(dest: Any, src: Any) -> int:
    """Copy ``src`` into ``dest`` (same number of elements); returns 0."""
    torch = _torch()
    if torch is None or not isinstance(dest, torch.Tensor) or not isinstance(src, torch.Tensor):
        raise TypeError("deepspeed_memcpy() takes two torch tensors")
    if dest.numel() != src.numel():
        raise ValueError(f"deepspeed_memcpy: dest has {dest.numel()} elements, src "
                         f"{src.numel()}; they must be equal")
    with torch.no_grad():
        dest.copy_(src.reshape(dest.shape))
    return 0


def _nbytes(buffer: Any) -> int:
    torch = _torch()
    if torch is not None and isinstance(buffer, torch.Tensor):
        return int(buffer.numel() * buffer.element_size())
    return memoryview(buffer).nbytes


# ---------------------------------------------------------------------------------------
# gds_handle and pin_handle


class gds_handle(aio_handle):  # noqa: N801  (DeepNVMe's spelling)
    """DeepNVMe-compatible GDS handle: CUDA tensors through cuFile, CPU tensors through AIO.

    Raises :class:`aioswap.errors.CuFileUnavailable` when cuFile or a GPU is missing.
    Files are never striped (``AIOSWAP_NVME_PATHS``): cuFile reads and writes one file.
    """

    _stripes = False

    def _new_handle(self, *knobs: Any) -> AioHandle:
        from aioswap.gds import GdsHandle
        return GdsHandle(*knobs)

    def new_pinned_device_tensor(self, num_elem: int, example_tensor: Any = None,
                                 **kwargs: Any) -> torch.Tensor:
        """A CUDA tensor registered with cuFile; release with :meth:`free_pinned_device_tensor`."""
        example = _example(example_tensor, kwargs)
        device = example.device if example.device.type == "cuda" else "cuda"
        t: torch.Tensor = _torch().empty(int(num_elem), dtype=example.dtype, device=device)
        self._h.pin_device_tensor(t)  # type: ignore[attr-defined]
        return t

    def free_pinned_device_tensor(self, tensor: Any) -> bool:
        return self.unpin_device_tensor(tensor)

    def pin_device_tensor(self, tensor: Any) -> bool:
        self._h.pin_device_tensor(tensor)  # type: ignore[attr-defined]
        return True

    def unpin_device_tensor(self, tensor: Any) -> bool:
        """Deregister ``tensor``; False when this handle had not registered it."""
        try:
            self._h.unpin_device_tensor(tensor)  # type: ignore[attr-defined]
        except ValueError:
            return False
        return True


class pin_handle:  # noqa: N801  (DeepSpeed's spelling)
    """The ``pin_memory`` op's handle, sharing the compat handles' locked-tensor manager."""

    def new_cpu_locked_tensor(self, num_elem: int, example_tensor: Any = None,
                              **kwargs: Any) -> torch.Tensor:
        """A 1-D page-locked tensor of ``num_elem`` elements of ``example_tensor.dtype``."""
        return _locked.new(num_elem, _example(example_tensor, kwargs))

    def free_cpu_locked_tensor(self, locked_tensor: Any) -> bool:
        """As :meth:`aio_handle.free_cpu_locked_tensor`."""
        return _locked.free(locked_tensor)

    def free_cpu_locked_tensor_by_ptr(self, address: int) -> bool:
        """Release the allocation that starts at ``address``; False when there is none."""
        return _locked.free_by_ptr(address)

    def is_pinned(self, buffer: Any) -> bool:
        return pinned.is_pinned(buffer)
