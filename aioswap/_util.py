"""Helpers more than one module needs, each kept once: tensor bytes, directory fsync, small
files written atomically, futures, exception notes.

The alignment and depth constants live with the engine (``aioswap._aio.DEFAULT_ALIGNMENT``,
``aioswap._aio.MAX_DEPTH``). torch is imported only by :func:`flat_bytes`, when it is called.
"""
from __future__ import annotations

import concurrent.futures
import os
from collections.abc import Iterable
from typing import Any, Callable

__all__ = ["add_note", "first_error", "flat_bytes", "fsync_dir", "is_atomic_tmp", "round_up",
           "unique_keys", "wait_all", "write_atomic"]


def round_up(n: int, align: int) -> int:
    """``n`` rounded up to a multiple of ``align``."""
    return -(-n // align) * align


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` where Python has it (3.11 and later); nothing before."""
    add = getattr(exc, "add_note", None)
    if add is not None:
        add(note)


def flat_bytes(t: Any) -> Any:
    """The elements of tensor ``t`` in row-major order as a flat uint8 tensor on its device.

    A view of ``t``'s memory when ``t`` is contiguous with no conjugate or negative bit (so
    reads may land in it); otherwise a copy, which only a writer may use.
    """
    import torch

    d = t.detach().resolve_conj().resolve_neg()     # the values it shows, as stored
    if not d.is_contiguous():
        d = d.contiguous()
    # as_strided, not reshape: a 1-element tensor may be "contiguous" with any stride
    return d.as_strided((d.numel(),), (1,)).view(torch.uint8)


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync directory ``path``: a file created or renamed in it survives a crash."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_atomic(path: str | os.PathLike[str], data: bytes, mode: int = 0o600, *,
                 durable: bool = True, tmp: str | None = None, sync_dir_first: bool = False,
                 renamed: Callable[[], None] | None = None) -> None:
    """Write ``data`` as file ``path`` atomically: a temporary file beside it (created
    exclusively, so never through a planted link, with exactly the permission bits
    ``mode``), renamed over ``path``. ``durable``: the temporary is fsynced before the
    rename and the directory after it. A crash leaves the old file (and perhaps a
    temporary, which :func:`is_atomic_tmp` recognises); an error before the rename leaves
    the old file and no temporary.

    ``tmp``: the temporary's path (default ``<path>.<pid>-<random>.tmp``, unique).
    ``sync_dir_first``: fsync the directory before the rename too, so that files the new
    contents name, made in that directory, are durable before it. ``renamed`` is called
    once the new file is in place, also when an error or a signal comes after the rename
    (the error is raised after it).
    """
    path = os.fspath(path)
    if tmp is None:
        tmp = f"{path}.{os.getpid()}-{os.urandom(6).hex()}.tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | os.O_NOFOLLOW,
                 mode)
    directory = os.path.dirname(path) or "."
    renaming = told = False
    try:
        try:
            os.fchmod(fd, mode)
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        if sync_dir_first:
            fsync_dir(directory)
        renaming = True
        os.replace(tmp, path)
        if renamed is not None:
            renamed()
        told = True
        if durable:
            fsync_dir(directory)
    except BaseException:
        # the rename happened iff the temporary name is gone (checked, not tracked: a
        # signal may land between os.replace returning and renamed being called)
        if renaming and not os.path.lexists(tmp):
            if renamed is not None and not told:
                renamed()
        else:
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass
        raise


def is_atomic_tmp(name: str, of: str) -> bool:
    """Whether file name ``name`` is a temporary that :func:`write_atomic` of a file named
    ``of`` leaves after a crash (or the ``<of>.tmp`` of earlier versions)."""
    if not name.startswith(of + ".") or not name.endswith(".tmp"):
        return False
    mid = name[len(of) + 1:-4]
    if not mid:
        return True
    pid, _, rand = mid.partition("-")
    return pid.isdigit() and len(rand) == 12 and all(c in "0123456789abcdef" for c in rand)


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """``json.loads`` ``object_pairs_hook`` refusing an object that names a key twice (JSON
    parsers keep the last one silently; a reader must not guess which the writer meant)."""
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def first_error(futures: Iterable[concurrent.futures.Future[Any]]) -> BaseException | None:
    """Wait for every future; return the first error in their order, or None.

    Waits with ``exception()``, one future after the other, so an :class:`~aioswap.IOFuture`
    hurries its queue meanwhile. A cancelled future's error is ``CancelledError``.
    """
    first: BaseException | None = None
    for f in futures:
        try:
            exc = f.exception()
        except concurrent.futures.CancelledError as cancelled:
            exc = cancelled
        if exc is not None and first is None:
            first = exc
    return first


def wait_all(futures: Iterable[concurrent.futures.Future[Any]]) -> None:
    """Wait for every future, then raise the first error in their order (drain before release)."""
    exc = first_error(futures)
    if exc is not None:
        raise exc


def dist_version(dist: str) -> str:
    """The installed version of distribution ``dist`` ("?" when unknown): what the
    integrations name when a library is not the one they were written for."""
    try:
        from importlib.metadata import version
        return version(dist)
    except Exception:
        return "?"


def import_for(integration: str, module: str, dist: str) -> Any:
    """``importlib.import_module(module)`` for ``integration``'s ``install()``; an
    ImportError that names the integration and the ``pip install`` that fixes it."""
    import importlib
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"aioswap.integrations.{integration}.install(): {dist} is not "
                          f"importable ({exc}); pip install {dist}") from exc
