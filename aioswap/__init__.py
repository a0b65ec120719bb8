"""aioswap: move PyTorch tensors between memory and NVMe files at the speed of the drive."""
from aioswap._aio import aio_available, dio_alignment, open_direct
from aioswap.config import AioConfig
from aioswap.errors import (AioswapError, AioswapWarning, ChecksumError, ConfigError,
                            CuFileError, CuFileUnavailable, DirectIOFallbackWarning,
                            DirectIOUnsupportedError, HandleClosedError, PinnedMemoryError,
                            PinnedMemoryWarning, ShortReadError, SwapError, TuneError)
from aioswap.gds import GdsHandle
from aioswap.handle import AioFile, AioHandle, HandleStats, IOFuture
from aioswap.pinned import PinnedRegistry, is_pinned
from aioswap.stream import Bucket, Stream, offload, onload, stream
from aioswap.stripe import StripedFile
from aioswap.swap import SwapInfo, TensorSwapper

__version__ = "0.1.0"

__all__ = [
    "AioConfig",
    "AioFile",
    "AioHandle",
    "AioswapError",
    "AioswapWarning",
    "Bucket",
    "ChecksumError",
    "ConfigError",
    "CuFileError",
    "CuFileUnavailable",
    "DirectIOFallbackWarning",
    "DirectIOUnsupportedError",
    "GdsHandle",
    "HandleClosedError",
    "HandleStats",
    "IOFuture",
    "PinnedMemoryError",
    "PinnedMemoryWarning",
    "PinnedRegistry",
    "ShortReadError",
    "Stream",
    "StripedFile",
    "SwapError",
    "SwapInfo",
    "TensorSwapper",
    "TuneError",
    "__version__",
    "aio_available",
    "dio_alignment",
    "is_pinned",
    "offload",
    "onload",
    "open_direct",
    "stream",
]
