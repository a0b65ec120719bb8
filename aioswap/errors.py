"""Exception classes of aioswap.

Every class derives from :class:`AioswapError` and from the builtin exception a caller
would already catch for the same condition (``OSError``, ``ValueError``, ``MemoryError``...),
so ``except OSError`` keeps working around aioswap calls.
"""
from __future__ import annotations

__all__ = [
    "AioswapError",
    "AioswapWarning",
    "ChecksumError",
    "ConfigError",
    "CuFileError",
    "CuFileUnavailable",
    "DirectIOFallbackWarning",
    "DirectIOUnsupportedError",
    "HandleClosedError",
    "PinnedMemoryError",
    "PinnedMemoryWarning",
    "ShortReadError",
    "SwapError",
    "TuneError",
]


class AioswapError(Exception):
    """Base class of every exception raised by aioswap."""


class HandleClosedError(AioswapError, ValueError):
    """An operation was attempted on a closed context, handle or swapper."""


class ShortReadError(AioswapError, EOFError):
    """A read reached the end of the file before the requested bytes were read.

    Attributes: ``path`` (or None), ``offset`` (file offset of the request),
    ``nbytes`` (bytes requested), ``file_size`` (or None when unknown).
    """

    def __init__(self, message: str, *, path: str | None = None, offset: int = 0,
                 nbytes: int = 0, file_size: int | None = None) -> None:
        super().__init__(message)
        self.path = path
        self.offset = offset
        self.nbytes = nbytes
        self.file_size = file_size


class DirectIOUnsupportedError(AioswapError, OSError):
    """The file system refused ``O_DIRECT`` for this file (EINVAL at open)."""


class PinnedMemoryError(AioswapError, MemoryError):
    """Page-locked memory could not be allocated or locked (RLIMIT_MEMLOCK, budget...)."""


class ConfigError(AioswapError, ValueError):
    """An ``"aio"`` configuration section has an unknown key, a wrong type or a bad value."""


class CuFileUnavailable(AioswapError, RuntimeError):
    """cuFile (GPUDirect Storage) cannot be used here: the library or a GPU is missing."""


class CuFileError(AioswapError, OSError):
    """A cuFile call failed. ``errno`` holds the errno or the cuFile error code (>= 5000)."""


class TuneError(AioswapError, RuntimeError):
    """The sweep gave nothing to recommend (every point failed, or none in that direction)."""


class SwapError(AioswapError, RuntimeError):
    """A tensor swap failed: unknown or duplicate name, wrong ``out``, broken manifest."""


class ChecksumError(SwapError):
    """A swapped tensor's bytes do not match the checksum recorded when it was written."""


class AioswapWarning(UserWarning):
    """Base class of aioswap's warnings."""


class DirectIOFallbackWarning(AioswapWarning):
    """A file system refused ``O_DIRECT``; the handle serves that file with buffered I/O."""


class PinnedMemoryWarning(AioswapWarning):
    """Memory could not be locked and unlocked memory was handed out instead (``strict=False``).

    A ``UserWarning`` rather than a ``ResourceWarning`` so that it is shown by default: the
    fallback works, but direct I/O on that memory is off and transfers go through bounce
    buffers. It is issued once per process, as one line naming the limit and how to raise it
    (``aioswap: 64 MiB not page-locked (mlock EAGAIN, RLIMIT_MEMLOCK 8 MiB); I/O works,
    slower; raise it with `ulimit -l unlimited```). Every fallback is also logged at DEBUG
    level on the ``"aioswap"`` logger with the full explanation (the hard limit, what is
    locked already, limits.conf, systemd, docker, CAP_IPC_LOCK). Exported as
    ``aioswap.PinnedMemoryWarning``; also importable as ``aioswap.pinned.PinnedMemoryWarning``.
    """
