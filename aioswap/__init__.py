"""aioswap: move PyTorch tensors between memory and NVMe files at the speed of the drive."""
from aioswap._aio import AioContext, aio_available, dio_alignment, open_direct
from aioswap.errors import (AioswapError, ChecksumError, ConfigError, CuFileError,
                            CuFileUnavailable, DirectIOUnsupportedError, HandleClosedError,
                            PinnedMemoryError, ShortReadError, SwapError)

__version__ = "0.1.0"

__all__ = [
    "AioContext",
    "AioswapError",
    "ChecksumError",
    "ConfigError",
    "CuFileError",
    "CuFileUnavailable",
    "DirectIOUnsupportedError",
    "HandleClosedError",
    "PinnedMemoryError",
    "ShortReadError",
    "SwapError",
    "__version__",
    "aio_available",
    "dio_alignment",
    "open_direct",
]
