"""Scratch and temporary files that do not outlive their process.

Names carry the creating process's id (``<prefix><pid>-<random><suffix>``), so a file left by a
process that was killed (SIGKILL, a power cut) is recognised as stale by the next run in the
same directory and removed: only regular files of ours (this user, our naming) whose process
is gone. The tools also turn SIGTERM/SIGHUP into an exception (:func:`terminate_on_signals`),
so their ``finally`` blocks remove what they made; what :func:`create` made and :func:`remove`
could not remove stays on this process's record, for the tool to name
(:func:`remove_leftovers`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import re
import signal
import stat
import tempfile
from collections.abc import Iterator
from types import FrameType
from typing import Any, NamedTuple

__all__ = ["Stale", "Terminated", "create", "remove", "remove_leftovers", "remove_stale",
           "terminate_on_signals"]

logger = logging.getLogger("aioswap")

# The files create() made in this process and remove() has not removed yet: the record that
# cleanup trusts (never a pattern), so a tool can retry and name what stayed.
_made: set[str] = set()


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP arrived; raised like Ctrl-C so in-flight I/O drains and files go."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def create(directory: str, prefix: str, suffix: str) -> tuple[int, str]:
    """A new file (``O_EXCL``, 0600) named ``<prefix><pid>-<random><suffix>``: (fd, path)."""
    fd, path = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", suffix=suffix, dir=directory)
    _made.add(path)
    return fd, path


def remove(path: str) -> bool:
    """Remove a file :func:`create` made; True once it is gone (a missing file is gone).

    Never raises: it runs in ``finally`` blocks, where an error would replace the one in
    flight. A file that cannot be removed stays on the record for :func:`remove_leftovers`.
    """
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except OSError as exc:
        logger.warning("cannot remove the scratch file %s: %s", path, exc.strerror or exc)
        return False
    _made.discard(path)
    return True


def remove_leftovers() -> list[tuple[str, str]]:
    """Try again to remove what :func:`create` made in this process and is still there;
    ``(path, reason)`` for each that stays."""
    left: list[tuple[str, str]] = []
    for path in sorted(_made):
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            left.append((path, exc.strerror or str(exc)))
            continue
        _made.discard(path)
    return left


class Stale(NamedTuple):
    """A file :func:`remove_stale` removed, and the process that had made it."""

    path: str
    pid: int


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True             # someone else's process: alive
    return True


def remove_stale(directory: str, prefix: str, suffix: str) -> list[Stale]:
    """Remove ``<prefix><pid>-*<suffix>`` files in ``directory`` whose process is gone.

    Only regular files owned by this user, never followed through a link; errors (a file
    another process removed first, a directory that cannot be listed) are ignored.
    Returns what was removed (each logged at INFO level), for a tool to say so.
    """
    pattern = re.compile(re.escape(prefix) + r"(\d+)-[A-Za-z0-9_]+" + re.escape(suffix) + "$")
    removed: list[Stale] = []
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
                removed.append(Stale(path, int(m.group(1))))
                logger.info("removed %s, left by process %s, which is gone", path, m.group(1))
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
