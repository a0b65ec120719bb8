"""``python -m aioswap``: the same as the ``aioswap`` command."""
import sys

import aioswap


def _shadowed_by() -> "str | None":
    """The folder that hides the installed package, or None.

    Python run from the directory that holds a clone named ``aioswap`` (``~/aioswap``) imports
    that folder, which has no ``__init__.py``, as a namespace package: with an editable install
    the submodules still load (so this runs), but ``aioswap.AioHandle`` and the rest are missing.
    """
    if getattr(aioswap, "__file__", None) is not None:
        return None
    return ", ".join(str(p) for p in getattr(aioswap, "__path__", [])) or "?"


if __name__ == "__main__":  # importing this module (stubtest, pydoc) runs nothing
    folder = _shadowed_by()
    if folder is not None:
        sys.stderr.write(
            f"aioswap: error: 'import aioswap' finds the folder {folder} (a source tree in the "
            f"current directory), not the installed package: run Python from another "
            f"directory (inside the clone works), or use the 'aioswap' command\n")
        sys.exit(2)
    from aioswap.cli import main
    sys.exit(main())
