"""``python -m aioswap``: the same as the ``aioswap`` command."""
import sys

from aioswap.cli import main

sys.exit(main())
