"""``python -m aioswap``: the same as the ``aioswap`` command."""
import sys

from aioswap.cli import main

if __name__ == "__main__":  # importing this module (stubtest, pydoc) runs nothing
    sys.exit(main())
