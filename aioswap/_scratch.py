"""Scratch and temporary files that do not outlive their process.

Names carry the creating process's id (``<prefix><pid>-<random><suffix>``), so a file left by a
process that was killed (SIGKILL, a power cut) is recognised as stale by the next run in the
same directory and removed: only regular files of ours (this user, our naming) whose process
is gone. The tools also turn SIGTERM/SIGHUP into an exception (:func:`terminate_on_signals`),
so their ``finally`` blocks remove what they made.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import stat
import tempfile
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["Terminated", "create", "remove_stale", "terminate_on_signals"]


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived; raised like Ctrl-C so in-flight I/O drains and files go."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def create(directory: str, prefix: str, suffix: str) -> tuple[int, str]:
    """A new file (``O_EXCL``, 0600) named ``<prefix><pid>-<random><suffix>``: (fd, path)."""
    return tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", suffix=suffix, dir=directory)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True             # someone else's process: alive
    return True


def remove_stale(directory: str, prefix: str, suffix: str) -> list[str]:
    """Remove ``<prefix><pid>-*<suffix>`` files in ``directory`` whose process is gone.

    Only regular files owned by this user, never followed through a link; errors (a file
    another process removed first, a directory that cannot be listed) are ignored.
    Returns the paths removed.
    """
    pattern = re.compile(re.escape(prefix) + r"(\d+)-[A-Za-z0-9_]+" + re.escape(suffix) + "$")
    removed: list[str] = []
    try:
        names = os.listdir(directory)
    except OSError:
        return removed
    for name in names:
        m = pattern.match(name)
        if m is None or int(m.group(1)) == os.getpid() or _alive(int(m.group(1))):
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid():
                os.unlink(path)
                removed.append(path)
    return removed


@contextlib.contextmanager
def terminate_on_signals() -> Iterator[None]:
    """Within the block (main thread only), SIGTERM and SIGHUP raise :class:`Terminated`."""
    def handler(signum: int, frame: FrameType | None) -> None:
        raise Terminated(signum)

    old: dict[signal.Signals, Any] = {}
    try:
        for sig in (signal.SIGTERM, signal.SIGHUP):
            old[sig] = signal.signal(sig, handler)
    except ValueError:          # not the main thread: leave the process's handlers alone
        pass
    try:
        yield
    finally:
        for sig, prev in old.items():
            signal.signal(sig, prev)
