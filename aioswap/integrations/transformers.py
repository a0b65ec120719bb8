"""transformers' ``from_pretrained`` of a local safetensors checkpoint, read through aioswap.

After :func:`install`, ``PreTrainedModel.from_pretrained`` (and every ``Auto*`` class built on
it) reads the shards of a safetensors checkpoint through :mod:`aioswap.safetensors` instead of
memory-mapping them::

    import aioswap.integrations.transformers as aioswap_hf
    aioswap_hf.install()          # once per process; uninstall() puts stock back

Nothing else changes: the same model, the same parameters bit for bit (so the same logits),
the same errors for missing or unexpected keys, the same dtype casts and device placement.

Reading the shards
------------------
transformers 5 opens every shard with ``safetensors.safe_open`` (a memory mapping), hands
its loading code one lazy slice per tensor, and copies each one out of the mapping when the
parameter is built (page faults, 4 KiB at a time, on a few threads). Here the hook is
``PreTrainedModel._load_pretrained_model`` (one static method: it receives every shard file
of the checkpoint at once). When it is given shard files and no state dict, every shard's
header is read and checked first (:class:`~aioswap.safetensors.SafetensorsError` naming the
file for a malformed or truncated one, :class:`FileNotFoundError` naming a missing one),
then all shards are read as one stream (:func:`aioswap.safetensors.iter_checkpoint`'s reads:
one queue, every shard in flight together, ranges the page cache holds copied from it, the
rest read direct; ``read=`` forces either) on a background thread. transformers gets, in
place of the mapped slices, objects with the same interface (``get_shape()``,
``get_dtype()``, ``[...]``); taking one waits for that tensor's bytes only, so building the
model overlaps the reads. A tensor is handed over once: the loader keeps no reference to
it (a tensor asked for twice is read again, from its file).

On the CPU the tensors become the parameters as they are (no copy when the dtype is the
checkpoint's). For other devices (``device_map`` with GPUs) the tensors are staging: at most
1 GiB of them is read ahead of what transformers has taken.

Calls left to stock
-------------------
The hook hands the call on unchanged (logged at DEBUG with the reason; counted in
:func:`stats`) when transformers would not memory-map the shards or the load needs more than
plain tensors: a ``state_dict`` given, ``.bin`` checkpoints, ``disable_mmap`` or an hf-mount
file system, an ``mps`` device, a ``"disk"`` entry in ``device_map``, a quantizer, a tensor
parallel ``device_mesh`` or DeepSpeed ZeRO-3. With ``read="auto"`` (the default) it also
does when the page cache already holds 90% of the checkpoint (``cachestat``): transformers'
memory map then reads it without a copy, faster than any read into new memory.

Without transformers installed, importing this module works (it imports transformers only in
:func:`install`) and :func:`install` raises :class:`ImportError`.
"""
from __future__ import annotations

import importlib
import inspect
import logging
import os
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any, Optional

import torch

from aioswap import _adaptive
from aioswap import safetensors as _st
from aioswap._util import dist_version, import_for

__all__ = [
    "LoadStats",
    "install",
    "installed",
    "stats",
    "uninstall",
]

_log = logging.getLogger("aioswap")

_MODULE = "transformers.modeling_utils"
_CLASS = "PreTrainedModel"
_METHOD = "_load_pretrained_model"
# parameters of the stock method this hook reads (transformers 5.x)
_PARAMETERS = ("state_dict", "checkpoint_files", "load_config")
_AHEAD_BYTES = 1 << 30    # tensors read and not yet taken, at most (soft), for a device
# With read="auto", a checkpoint of which the page cache holds at least this share is left
# to transformers: its memory map reads cached pages without a copy, several times faster
# than copying them (bench_loaders: 5.96 GB/s stock against 1.90 through aioswap, warm).
# The loaders' own rule for a range copied from the page cache; None: never left.
_CACHED_SHARE: Optional[float] = _adaptive.CACHED_ENOUGH


@dataclass
class LoadStats:
    """What the hook has done since :func:`install`."""

    loads: int = 0            # _load_pretrained_model calls read through aioswap
    stock_loads: int = 0      # calls handed on to stock transformers unchanged
    files: int = 0            # shard files read
    tensors: int = 0          # tensors handed to transformers
    bytes_read: int = 0       # bytes of those tensors
    rereads: int = 0          # tensors asked for a second time (read again from the file)


class _Stream:
    """Every tensor of the shard ``files`` read on a background thread
    (:func:`aioswap.safetensors.iter_checkpoint` of the list), each handed over once, to
    whichever thread asks for it by name."""

    def __init__(self, files: Sequence[str], headers: Sequence[_st.Header],
                 window: Optional[int], read: Optional[str], ahead: Optional[int]) -> None:
        self._where = {name: (path, info) for path, header in zip(files, headers)
                       for name, info in header.tensors.items()}
        self._cv = threading.Condition()
        self._ready: dict[str, torch.Tensor] = {}
        self._seen: set[str] = set()          # handed over by the stream (taken or not)
        self._waiting: dict[str, int] = {}    # names asked for, not yet read: threads
        self._held = 0                        # bytes read, not yet taken
        self._ahead = ahead
        self._error: Optional[BaseException] = None
        self._finished = False
        self._closing = False
        # every shard opened and its header checked here (errors name the file)
        self._gen = _st.iter_checkpoint(list(files), "cpu", max_inflight_bytes=window,
                                        read=read)
        self._thread = threading.Thread(target=self._run, name="aioswap-transformers",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for name, t in self._gen:
                with self._cv:
                    # a soft bound: the stream goes on whenever a taker waits for a tensor it
                    # has not read yet (the takers' order is not the files' order)
                    while (self._ahead is not None and self._held > self._ahead
                           and not self._waiting and not self._closing):
                        self._cv.wait()
                    if self._closing:
                        break
                    self._ready[name] = t
                    self._seen.add(name)
                    self._held += t.nbytes
                    self._cv.notify_all()
                del t
        except BaseException as exc:      # handed to the takers
            with self._cv:
                self._error = exc
        finally:
            self._gen.close()             # waits for every read in flight, closes the files
            with self._cv:
                self._finished = True
                self._cv.notify_all()

    def take(self, name: str) -> torch.Tensor:
        """The tensor ``name``, as soon as it is read; read again if it was taken before."""
        with self._cv:
            while name not in self._ready:
                if self._error is not None:
                    raise self._error
                if self._closing:       # a late job of a load that has ended (raised)
                    raise RuntimeError(f"aioswap: the load that read {name!r} has ended")
                if name in self._seen or self._finished:
                    break
                self._waiting[name] = self._waiting.get(name, 0) + 1
                self._cv.notify_all()
                try:
                    self._cv.wait()
                finally:
                    left = self._waiting.pop(name) - 1
                    if left:
                        self._waiting[name] = left
            t = self._ready.pop(name, None)
            if t is not None:
                self._held -= t.nbytes
                self._cv.notify_all()
        if t is None:
            t = self._reread(name)
        else:
            with _state_lock:
                _stats.tensors += 1
                _stats.bytes_read += t.nbytes
        return t

    def _reread(self, name: str) -> torch.Tensor:
        path, _ = self._where[name]
        with _st.safe_open(path) as f:
            t = f.get_tensor(name)
        with _state_lock:
            _stats.rereads += 1
        return t

    def close(self) -> None:
        """Stop reading, wait for the reads in flight, close the files, drop what was not
        taken."""
        with self._cv:
            self._closing = True
            self._cv.notify_all()
        self._thread.join()
        with self._cv:
            self._ready.clear()
            self._held = 0


class _Slice:
    """What transformers gets for one tensor: the interface of a ``safetensors`` slice
    (``get_shape``, ``get_dtype``, indexing reads it)."""

    __slots__ = ("_stream", "_name", "_info")

    def __init__(self, stream: _Stream, name: str, info: _st.TensorInfo) -> None:
        self._stream = stream
        self._name = name
        self._info = info

    def get_shape(self) -> list[int]:
        return list(self._info.shape)

    def get_dtype(self) -> str:
        return self._info.dtype

    @property
    def shape(self) -> torch.Size:
        return torch.Size(self._info.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        t = self._stream.take(self._name)
        return t if index is Ellipsis else t[index]

    def __repr__(self) -> str:
        return f"<aioswap slice {self._name!r} {self._info.dtype} {list(self._info.shape)}>"


def _why_stock(module: Any, state_dict: Any, files: Any, config: Any) -> Optional[str]:
    """Why this call must go to stock transformers unchanged, or None."""
    if state_dict is not None:
        return "a state_dict was given"
    if not files:
        return "no checkpoint files"
    if not all(isinstance(f, (str, os.PathLike)) and os.fspath(f).endswith(".safetensors")
               for f in files):
        return "not a safetensors checkpoint"
    if config is None:
        return "no load config"
    if getattr(config, "disable_mmap", None):
        return "disable_mmap"
    on_mount = getattr(module, "_is_on_hf_mount", None)
    if callable(on_mount) and any(on_mount(os.fspath(f)) for f in files):
        return "an hf-mount file system"
    if getattr(config, "hf_quantizer", None) is not None:
        return "a quantizer"
    if getattr(config, "device_mesh", None) is not None:
        return "a tensor parallel device_mesh"
    zero3 = getattr(module, "is_deepspeed_zero3_enabled", None)
    if callable(zero3) and zero3():
        return "DeepSpeed ZeRO-3"
    device_map = getattr(config, "device_map", None) or {}
    for d in device_map.values():
        if isinstance(d, str) and d in ("disk", "meta"):
            return f"a {d!r} entry in device_map"
        if (d.type if isinstance(d, torch.device) else d) == "mps":
            return "an mps device"
    if sys.platform == "win32":
        return "Windows"
    return None


def _window(config: Any) -> Optional[int]:
    """Bytes read ahead of what transformers takes: no bound when every tensor stays on the
    CPU (the tensors are the parameters), 1 GiB of staging for a device."""
    device_map = getattr(config, "device_map", None) or {}
    for d in device_map.values():
        try:
            if torch.device(d).type != "cpu":
                return _AHEAD_BYTES
        except (RuntimeError, TypeError, ValueError):
            return _AHEAD_BYTES
    return None


def _cached_share(files: Sequence[Any]) -> float:
    """The share of the shard files' bytes the page cache holds now (``cachestat``; reads
    nothing)."""
    total = cached = 0
    for f in files:
        fd = os.open(os.fspath(f), os.O_RDONLY | os.O_CLOEXEC)
        try:
            n = os.fstat(fd).st_size
            total += n
            cached += _adaptive.cached_bytes(fd, 0, n)
        finally:
            os.close(fd)
    return cached / total if total else 1.0


def _headers(files: Sequence[Any]) -> tuple[list[str], list[_st.Header]]:
    """Every shard's path and checked header (errors name the file)."""
    paths = [os.fspath(f) for f in files]
    return paths, [_st.read_header(p) for p in paths]


def _load_pretrained_model(*args: Any, **kwargs: Any) -> Any:
    """transformers' ``PreTrainedModel._load_pretrained_model``, its shards read through
    aioswap (see the module notes)."""
    stock = _stock
    if stock is None:             # uninstalled while a caller held the method
        stock = _original()
    fn = stock.__func__
    try:
        bound = inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return fn(*args, **kwargs)
    state_dict = bound.arguments.get("state_dict")
    files = bound.arguments.get("checkpoint_files")
    config = bound.arguments.get("load_config")
    module = sys.modules.get(_MODULE)
    why = _why_stock(module, state_dict, files, config)
    if (why is None and files and _CACHED_SHARE is not None
            and _adaptive.read_mode(_read) == "auto" and _cached_share(files) >= _CACHED_SHARE):
        why = "the checkpoint is in the page cache (mapped by transformers, no copy)"
    if why is not None:
        with _state_lock:
            _stats.stock_loads += 1
        _log.debug("aioswap: from_pretrained left to transformers: %s", why)
        return fn(*args, **kwargs)
    assert files is not None
    paths, headers = _headers(files)
    window = _window(config)
    stream = _Stream(paths, headers, window, _read, window)
    try:
        lazy: dict[str, Any] = {}
        for header in headers:
            for name, info in header.tensors.items():
                lazy[name] = _Slice(stream, name, info)
        with _state_lock:
            _stats.loads += 1
            _stats.files += len(paths)
        _log.debug("aioswap: from_pretrained reads %d file(s), %d tensors, through aioswap "
                   "(read=%s)", len(paths), len(lazy), _read or "default")
        bound.arguments["state_dict"] = lazy
        return fn(*bound.args, **bound.kwargs)
    finally:
        stream.close()


# ---------------------------------------------------------------------------------- install

_state_lock = threading.RLock()
_cls: Optional[type] = None
_stock: Any = None            # the class's own attribute (a staticmethod) before install
_read: Optional[str] = None
_stats = LoadStats()


def _original() -> Any:
    module = importlib.import_module(_MODULE)
    return getattr(module, _CLASS).__dict__[_METHOD]


def install(*, read: Optional[str] = None) -> None:
    """Make ``from_pretrained`` read local safetensors checkpoints through aioswap.
    Idempotent (a second call only sets ``read``).

    Parameters
    ----------
    read : {"auto", "direct", "buffered"}, optional
        How the shards are read, as for :func:`aioswap.safetensors.load_file` (default:
        ``AIOSWAP_READ``, else auto: what the page cache holds is copied from it, the rest
        read direct).

    Raises
    ------
    ImportError
        transformers is not installed (nothing is changed).
    RuntimeError
        transformers' ``PreTrainedModel._load_pretrained_model`` is not the static method
        with the parameters this was written for (transformers 5): the message says what is
        missing (nothing is changed).
    ValueError
        ``read`` is not one of the modes.
    """
    global _cls, _stock, _read, _stats
    if read is not None:
        _adaptive.read_mode(read)             # a bad value: ValueError, nothing changed
    with _state_lock:
        _read = read
        if _cls is not None:
            return
        module = import_for("transformers", _MODULE, "transformers")
        version = dist_version("transformers")
        cls = getattr(module, _CLASS, None)
        if not isinstance(cls, type):
            raise RuntimeError(f"aioswap.integrations.transformers.install(): could not patch: "
                               f"{_MODULE} has no class {_CLASS} (transformers {version})")
        stock = cls.__dict__.get(_METHOD)
        if not isinstance(stock, staticmethod):
            raise RuntimeError(f"aioswap.integrations.transformers.install(): could not patch: "
                               f"{_MODULE}.{_CLASS}.{_METHOD} is not a static method "
                               f"(transformers {version}; written for 5.x)")
        params = inspect.signature(stock.__func__).parameters
        missing = [p for p in _PARAMETERS if p not in params]
        if missing:
            raise RuntimeError(f"aioswap.integrations.transformers.install(): could not patch: "
                               f"{_MODULE}.{_CLASS}.{_METHOD} has no parameter "
                               f"{', '.join(map(repr, missing))} (transformers {version}; "
                               f"written for 5.x): loading is left stock")
        _stock = stock
        setattr(cls, _METHOD, staticmethod(_load_pretrained_model))
        _cls = cls
        _stats = LoadStats()
        _log.info("aioswap: %s.%s.%s replaced", _MODULE, _CLASS, _METHOD)


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _cls is not None


def uninstall() -> None:
    """Undo :func:`install`: transformers' own method again (the very object it had).
    Idempotent. A load running meanwhile finishes as it began."""
    global _cls, _stock, _read
    with _state_lock:
        if _cls is not None:
            setattr(_cls, _METHOD, _stock)
            _cls = None
            _stock = None
        _read = None


def stats() -> LoadStats:
    """A copy of the counters since :func:`install` (see :class:`LoadStats`)."""
    with _state_lock:
        return replace(_stats)
