"""Make DeepSpeed's DeepNVMe op builders load aioswap instead of building C++ ops.

After :func:`install`, DeepSpeed's ``AsyncIOBuilder`` (the CUDA and the CPU-accelerator
classes), ``GDSBuilder`` and ``PinMemoryBuilder`` return :mod:`aioswap.compat.deepnvme` from
``load()`` without compiling anything, and report themselves compatible where aioswap works
(``GDSBuilder`` only where cuFile loads and a CUDA device is present); the op table
``deepspeed.ops.__compatible_ops__`` agrees. ZeRO-Infinity (``"offload_param"`` /
``"offload_optimizer"`` with ``"device": "nvme"``), ``ds_io``, ``ds_nvme_tune`` and DeepSpeed's
checkpoint writers then run on aioswap.

:func:`install` never imports DeepSpeed: it patches the builder modules already imported
and hooks the import of the others, so it can run first thing, before ``import deepspeed``.
Setting ``AIOSWAP_DEEPSPEED=1`` in the environment runs it at interpreter start (through the
``aioswap-deepspeed.pth`` file installed with aioswap), in every process, including the
spawn/forkserver workers of DeepSpeed's launcher and tests.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import logging
import os
import sys
import threading
import types
from collections.abc import Sequence
from typing import Any, Callable

__all__ = ["ENV_VAR", "install", "installed", "uninstall"]

ENV_VAR = "AIOSWAP_DEEPSPEED"
"""Environment variable that, set to ``1``, runs :func:`install` at interpreter start."""

_log = logging.getLogger("aioswap")

# Where DeepSpeed keeps its op builders: the installed package, and a source checkout
# (DeepSpeed's accelerators use a top-level ``op_builder`` package when it is importable).
_PREFIXES = ("deepspeed.ops.op_builder", "op_builder")
# builder module (relative to a prefix) -> (class name, op kind)
_BUILDERS = {
    "async_io": ("AsyncIOBuilder", "async_io"),
    "cpu.async_io": ("AsyncIOBuilder", "async_io"),
    "gds": ("GDSBuilder", "gds"),
    "pin_memory": ("PinMemoryBuilder", "pin_memory"),
}
_TARGETS = {f"{prefix}.{rel}": spec for prefix in _PREFIXES for rel, spec in _BUILDERS.items()}
_PATCHED_NAMES = ("load", "jit_load", "is_compatible")
_MISSING = object()

_lock = threading.RLock()
_finder: _BuilderFinder | None = None
_patched: dict[type, dict[str, Any]] = {}          # class -> its original attributes
_compat_before: dict[str, Any] = {}               # __compatible_ops__ entries we changed


# ---------------------------------------------------------------------------- compatibility


def _aio_compatible() -> bool:
    if not sys.platform.startswith("linux"):
        return False
    from aioswap import aio_available
    ok, reason = aio_available()
    if not ok:
        _log.info("aioswap: kernel AIO is unavailable here: %s", reason)
    return bool(ok)


def _gds_compatible() -> bool:
    """cuFile loadable and a CUDA device present (torch sees one)."""
    if not _aio_compatible():
        return False
    from aioswap import _cufile
    ok, reason = _cufile.available()
    if not ok:
        _log.info("aioswap: cuFile is unavailable: %s", reason)
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def _pin_compatible() -> bool:
    return sys.platform.startswith("linux")


_COMPATIBLE: dict[str, Callable[[], bool]] = {
    "async_io": _aio_compatible,
    "gds": _gds_compatible,
    "pin_memory": _pin_compatible,
}


def _op_module() -> types.ModuleType:
    from aioswap.compat import deepnvme
    return deepnvme


# ---------------------------------------------------------------------------- patching


def _patch_class(cls: type, kind: str) -> None:
    """Give ``cls`` aioswap's ``load``/``jit_load``/``is_compatible`` (kept for subclasses of
    other kinds, which get their own methods back through the saved originals)."""
    if cls in _patched:
        return
    saved = {name: cls.__dict__.get(name, _MISSING) for name in _PATCHED_NAMES}

    def original(self: Any, name: str) -> Callable[..., Any]:
        fn = saved[name]
        if fn is _MISSING:
            return getattr(super(cls, self), name)  # type: ignore[no-any-return]
        return fn.__get__(self, type(self))  # type: ignore[no-any-return]

    def ours(self: Any) -> bool:
        # A subclass with another NAME (e.g. a vendor's builder derived from ours) keeps
        # its own behaviour.
        return getattr(self, "NAME", kind) == kind

    def load(self: Any, verbose: bool = False) -> Any:
        if not ours(self):
            return original(self, "load")(verbose)
        if not _COMPATIBLE[kind]():
            raise RuntimeError(f"aioswap cannot provide the {kind} op here: "
                               + _why_not(kind))
        return _op_module()

    def jit_load(self: Any, verbose: bool = True) -> Any:
        if not ours(self):
            return original(self, "jit_load")(verbose)
        return load(self, verbose)

    def is_compatible(self: Any, verbose: bool = False) -> bool:
        if not ours(self):
            return bool(original(self, "is_compatible")(verbose))
        return _COMPATIBLE[kind]()

    for fn in (load, jit_load, is_compatible):
        fn.__qualname__ = f"{cls.__qualname__}.{fn.__name__}"
        fn.__doc__ = f"aioswap: {fn.__name__} of the {kind} op (nothing is built)."
        setattr(cls, fn.__name__, fn)
    _patched[cls] = saved


def _why_not(kind: str) -> str:
    if kind == "gds":
        return "it needs libcufile and a CUDA device (see `aioswap info`)"
    if kind == "async_io":
        from aioswap import aio_available
        return f"kernel AIO is unavailable ({aio_available()[1]})"
    return "it needs Linux"


def _patch_module(module: types.ModuleType) -> None:
    spec = _TARGETS.get(module.__name__)
    if spec is None:
        return
    cls = getattr(module, spec[0], None)
    if isinstance(cls, type):
        with _lock:
            _patch_class(cls, spec[1])
    _refresh_compatible_ops()


def _refresh_compatible_ops() -> None:
    """Update ``deepspeed.ops.__compatible_ops__`` if DeepSpeed has computed it already."""
    ops = sys.modules.get("deepspeed.ops")
    table = getattr(ops, "__dict__", {}).get("__compatible_ops__")
    if not isinstance(table, dict):
        return                     # computed lazily later, from the patched builders
    with _lock:
        for kind, check in _COMPATIBLE.items():
            if kind in table:
                _compat_before.setdefault(kind, table[kind])
                table[kind] = check()


class _PatchingLoader(importlib.abc.Loader):
    """Runs the real loader, then patches the builder class the module defines."""

    def __init__(self, loader: Any) -> None:
        self._loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        create = getattr(self._loader, "create_module", None)
        return create(spec) if create is not None else None

    def exec_module(self, module: types.ModuleType) -> None:
        self._loader.exec_module(module)
        if _finder is not None:
            _patch_module(module)

    def __getattr__(self, name: str) -> Any:      # get_source, get_filename, is_package...
        return getattr(self._loader, name)


_finding = threading.local()      # names a _BuilderFinder is looking up in this thread


class _BuilderFinder(importlib.abc.MetaPathFinder):
    """Finds DeepSpeed's builder modules with the other finders and wraps their loaders."""

    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: types.ModuleType | None = None
                  ) -> importlib.machinery.ModuleSpec | None:
        if fullname not in _TARGETS:
            return None
        # another delegating finder may ask every finder again (us included): a per-thread
        # guard answers None to that nested question instead of recursing forever
        busy: set[str] | None = getattr(_finding, "names", None)
        if busy is None:
            busy = _finding.names = set()
        if fullname in busy:
            return None
        busy.add(fullname)
        try:
            for finder in list(sys.meta_path):
                if finder is self or isinstance(finder, _BuilderFinder):
                    continue
                find = getattr(finder, "find_spec", None)
                if find is None:
                    continue
                spec: importlib.machinery.ModuleSpec | None = find(fullname, path, target)
                if spec is not None:
                    break
            else:
                return None
        finally:
            busy.discard(fullname)
        if spec.loader is not None and hasattr(spec.loader, "exec_module"):
            spec.loader = _PatchingLoader(spec.loader)
        return spec


# ---------------------------------------------------------------------------- public API


def install() -> bool:
    """Route DeepSpeed's DeepNVMe ops (async_io, gds, pin_memory) to aioswap.

    Patches the builder classes of modules already imported and hooks the import of the
    others; never imports DeepSpeed itself. Idempotent.

    Returns
    -------
    bool
        True when the integration is active; False (and nothing is changed) when DeepSpeed
        is not installed.
    """
    global _finder
    with _lock:
        if _finder is not None:
            return True
        if not any(p in sys.modules for p in _PREFIXES) and not _importable("deepspeed"):
            return False
        _finder = _BuilderFinder()
        sys.meta_path.insert(0, _finder)
        for name in _TARGETS:
            module = sys.modules.get(name)
            if module is not None:
                _patch_module(module)
        _refresh_compatible_ops()
    return True


def installed() -> bool:
    """Whether :func:`install` is in effect."""
    return _finder is not None


def uninstall() -> None:
    """Undo :func:`install`: the builders get their own methods back. Idempotent."""
    global _finder
    with _lock:
        if _finder is not None:
            try:
                sys.meta_path.remove(_finder)
            except ValueError:
                pass
            _finder = None
        for cls, saved in _patched.items():
            for name, fn in saved.items():
                if fn is _MISSING:
                    if name in cls.__dict__:
                        delattr(cls, name)
                else:
                    setattr(cls, name, fn)
        _patched.clear()
        ops = sys.modules.get("deepspeed.ops")
        table = getattr(ops, "__dict__", {}).get("__compatible_ops__")
        if isinstance(table, dict):
            table.update(_compat_before)
        _compat_before.clear()


def _importable(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _install_from_env() -> None:
    """Called by the ``.pth`` hook at interpreter start: install() when ENV_VAR is 1."""
    if os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on"):
        install()
