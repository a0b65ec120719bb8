"""The swapper's data files: made new (striped over the swap directories when there are
several) and opened for reading through the handle, and those of a failed swap-out removed."""
from __future__ import annotations

import errno
import os
from typing import Union

from aioswap._files import AioFile
from aioswap._manifest import SwapDirectory
from aioswap._util import add_note
from aioswap.errors import SwapError
from aioswap.handle import AioHandle
from aioswap.stripe import StripedFile, open_striped

#: A data file as the swapper reads and writes it: one file, or striped over drives.
DataFile = Union[AioFile, StripedFile]


class DataFiles:
    """The data files of one swap directory (set), made and opened through ``handle``;
    ``mode``: the permission bits of new ones."""

    def __init__(self, directory: SwapDirectory, handle: AioHandle, mode: int) -> None:
        self._dir = directory
        self._handle = handle
        self._mode = mode

    def create(self, stem: str) -> tuple[str, DataFile]:
        """A new data file (see :meth:`SwapDirectory.create_data`), opened through the
        handle; striped over the swap directories when there are several."""
        if self._dir.striped:
            while True:
                fname = f"{stem}{os.urandom(16 if stem == 'p-' else 8).hex()}.bin"
                try:
                    return fname, open_striped(self._handle, self._dir.parts(fname), "x",
                                               perm=self._mode, follow_symlinks=False)
                except FileExistsError:     # pragma: no cover - 64+ random bits
                    continue
                except BaseException:
                    self._dir.unlink(fname)
                    raise
        fname, fd = self._dir.create_data(stem)
        try:
            return fname, self._handle.adopt(fd)
        except BaseException:
            os.close(fd)
            self._dir.unlink(fname)
            raise

    def _missing_part(self, who: str, fname: str, parts: list[str],
                      exc: BaseException) -> SwapError:
        return SwapError(f"{who}: its data file {fname!r} is striped over several directories "
                         f"(drives); open the swapper with all of them, in any order (found "
                         f"parts: {parts}): {exc}")

    def close_new(self, files: list[tuple[str, DataFile]], ok: bool) -> None:
        """Close the data files a swap-out wrote; unless all went well (``ok``) and every
        close did too, remove them all, so a failed swap-out leaves nothing behind (closing a
        striped file writes its layout, which can fail: ENOSPC). Raises the first close
        error when there was no other."""
        first: BaseException | None = None
        for _, fd in files:
            try:
                fd.close()
            except BaseException as exc:
                first = first or exc
        if ok and first is None:
            return
        for fname, _ in files:
            self._dir.unlink(fname)
        if ok and first is not None:
            add_note(first, "aioswap: closing a new data file failed; nothing was published "
                            "and the swap directory is unchanged")
            raise first

    def open(self, fname: str, who: str) -> tuple[DataFile, int]:
        """A data file opened for reading through the handle, and its size."""
        if self._dir.is_striped(fname):
            parts = self._dir.parts_of(fname)
            try:
                f = open_striped(self._handle, parts, "r", follow_symlinks=False)
            except OSError as exc:
                if exc.errno in (errno.ELOOP, errno.EINVAL):    # a link, a FIFO...
                    raise SwapError(f"{who}: a part of its data file {fname!r} cannot be "
                                    f"used: {exc}") from exc
                raise self._missing_part(who, fname, parts, exc) from exc
            except ValueError as exc:
                raise self._missing_part(who, fname, parts, exc) from exc
            return f, f.size()
        fd, size = self._dir.open_data(fname, who)
        try:
            return self._handle.adopt(fd), size
        except BaseException:
            os.close(fd)
            raise
