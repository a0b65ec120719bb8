"""Who owns a swap directory: the owner record ``aioswap-owner.json``.

A swapper *set* is the directories of one :class:`~aioswap.swap.TensorSwapper`: one, or
several when its data files are striped over drives. Each of them records the set it belongs
to, as plain JSON::

    {"format": "aioswap-owner", "version": 1, "set": "<32 hex>", "role": "primary",
     "dev": D, "ino": I, "primary": {"path": "/nvme0/swap", "dev": D0, "ino": I0}}

``role`` is ``"primary"`` for the directory that holds the manifest and ``"member"`` for one
that holds only parts of striped files; ``dev``/``ino`` identify the directory itself and
``primary`` the set's primary (its path is for messages only: identity is what counts, so a
bind mount or a renamed parent changes nothing). A swapper uses a directory only when its
record names the swapper's own set, or when it has none yet (it is claimed then), so no
swapper's cleanup ever deletes another's files; and the primary is found by its record,
whatever the order in which the directories are given.

:func:`arrange` is the decision, on what was read; :func:`read_owner` and
:func:`write_owner` are the I/O.
"""
from __future__ import annotations

import errno
import json
import os
import stat
import uuid
from collections.abc import Sequence
from dataclasses import dataclass

from aioswap._util import write_atomic
from aioswap.errors import SwapError

__all__ = ["OWNER_NAME", "Found", "Owner", "Plan", "arrange", "read_owner", "write_owner"]

#: File name of the owner record inside every swap directory.
OWNER_NAME = "aioswap-owner.json"
_FORMAT = "aioswap-owner"
_VERSION = 1
PRIMARY, MEMBER = "primary", "member"


@dataclass(frozen=True)
class Owner:
    """One directory's owner record."""

    set: str
    role: str
    dev: int
    ino: int
    primary_path: str
    primary_dev: int
    primary_ino: int

    def to_json(self) -> bytes:
        doc = {"format": _FORMAT, "version": _VERSION, "set": self.set, "role": self.role,
               "dev": self.dev, "ino": self.ino,
               "primary": {"path": self.primary_path, "dev": self.primary_dev,
                           "ino": self.primary_ino}}
        return json.dumps(doc, sort_keys=True).encode() + b"\n"


@dataclass(frozen=True)
class Found:
    """What :func:`arrange` needs to know of one given directory."""

    path: str
    dev: int
    ino: int
    owner: Owner | None
    has_manifest: bool


@dataclass(frozen=True)
class Plan:
    """The outcome of :func:`arrange`: the directories in the set's order (primary first, as
    indices into what was given), the set's id, and the records to write (index, record):
    directories claimed now, or whose record no longer matches the directory's identity."""

    order: list[int]
    set: str
    writes: list[tuple[int, Owner]]
    claimed: list[int]


def _int(v: object) -> bool:
    return type(v) is int and v >= 0


def read_owner(dir_fd: int, path: str) -> Owner | None:
    """The owner record of the directory open as ``dir_fd`` (at ``path``, for messages), or
    None when it has none. Never follows a symbolic link; a malformed record raises
    :class:`SwapError` naming the file."""
    where = os.path.join(path, OWNER_NAME)
    try:
        fd = os.open(OWNER_NAME, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK,
                     dir_fd=dir_fd)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise SwapError(f"owner record {where!r} is a symbolic link; aioswap never "
                            f"follows links in a swap directory") from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise SwapError(f"owner record {where!r} is not a regular file")
        raw = os.read(fd, 1 << 16)
    finally:
        os.close(fd)
    try:
        doc = json.loads(raw)
        prim = doc["primary"]
        ok = (doc["format"] == _FORMAT and doc["version"] == _VERSION
              and isinstance(doc["set"], str) and len(doc["set"]) == 32
              and doc["role"] in (PRIMARY, MEMBER) and _int(doc["dev"]) and _int(doc["ino"])
              and isinstance(prim["path"], str) and _int(prim["dev"]) and _int(prim["ino"]))
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise SwapError(f"owner record {where!r} is malformed or from a newer aioswap; it says "
                        f"which swapper the directory belongs to (remove it only if no "
                        f"swapper uses this directory)")
    return Owner(doc["set"], doc["role"], doc["dev"], doc["ino"], prim["path"], prim["dev"],
                 prim["ino"])


def write_owner(path: str, owner: Owner, mode: int) -> None:
    """Replace the owner record of directory ``path`` atomically and durably."""
    write_atomic(os.path.join(path, OWNER_NAME), owner.to_json(), mode)


def _foreign(f: Found, why: str) -> SwapError:
    o = f.owner
    assert o is not None
    if o.role == PRIMARY:
        what = "the directory of another swapper (its manifest is there)"
    else:
        what = (f"part of the swapper whose first directory is {o.primary_path!r} (device "
                f"{o.primary_dev}, inode {o.primary_ino})")
    return SwapError(f"swap directory {f.path!r} is {what}; {why}. A directory belongs to "
                     f"one swapper (its {OWNER_NAME} says which): give that swapper's "
                     f"directories, destroy() it, or use another directory")


def arrange(found: Sequence[Found]) -> Plan:
    """Decide the primary, the set and the records to write; raise :class:`SwapError` (before
    anything is written or removed) when a directory belongs to another swapper.

    The primary is the directory whose record says so; among directories without records
    (aioswap before owner records, or new ones) the one with a manifest (the first given
    when several could be, which then is refused), else the first given.
    """
    prim = [i for i, f in enumerate(found) if f.owner is not None and f.owner.role == PRIMARY]
    if len(prim) > 1:
        a, b = (found[i] for i in prim[:2])
        raise SwapError(f"swap directories {a.path!r} and {b.path!r} each hold a swapper's "
                        f"manifest: they belong to two swappers, not one; a directory belongs "
                        f"to one swapper ({OWNER_NAME} says which)")
    if prim:
        p = prim[0]
    else:
        members = [f for f in found if f.owner is not None]
        if members:
            m = members[0]
            raise _foreign(m, "its first directory was not given")
        manifests = [i for i, f in enumerate(found) if f.has_manifest]
        if len(manifests) > 1:
            a, b = (found[i] for i in manifests[:2])
            raise SwapError(f"swap directories {a.path!r} and {b.path!r} each hold a "
                            f"swapper's manifest: they belong to two swappers, not one")
        p = manifests[0] if manifests else 0
    primary = found[p]
    set_id = primary.owner.set if primary.owner is not None else uuid.uuid4().hex
    for i, f in enumerate(found):
        if i == p:
            continue
        if f.owner is not None and f.owner.set != set_id:
            raise _foreign(f, "it cannot also hold this swapper's files")
        if f.owner is None and f.has_manifest:
            raise SwapError(f"swap directory {f.path!r} holds another swapper's manifest; it "
                            f"cannot also hold the parts of this swapper's files (whose "
                            f"manifest is in {primary.path!r})")
    writes: list[tuple[int, Owner]] = []
    claimed: list[int] = []
    for i, f in enumerate(found):
        want = Owner(set_id, PRIMARY if i == p else MEMBER, f.dev, f.ino, primary.path,
                     primary.dev, primary.ino)
        if f.owner is None:
            claimed.append(i)
        if f.owner != want:
            writes.append((i, want))
    # the primary's record first: a crash between two writes must never leave members
    # naming a primary that has no record (they would be refused until repaired)
    writes.sort(key=lambda w: w[0] != p)
    order = [p] + [i for i in range(len(found)) if i != p]
    return Plan(order, set_id, writes, claimed)
