"""A Hugging Face checkpoint's index: which files a checkpoint path names, its weight map
checked, and the shards' headers checked against it (before anything is read)."""
from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Mapping, Sequence

from aioswap._st_format import (MAX_HEADER_BYTES, Header, PathLike, SafetensorsError,
                                open_data, pread_all, reject_constant)
from aioswap._util import unique_keys

_INDEX_NAME = "model.safetensors.index.json"   # transformers' SAFE_WEIGHTS_INDEX_NAME
_SINGLE_NAME = "model.safetensors"             # transformers' SAFE_WEIGHTS_NAME


def _read_index(path: str) -> dict[str, str]:
    """The weight map of a Hugging Face index, checked: tensor name -> shard file name."""
    def fail(msg: str) -> SafetensorsError:
        return SafetensorsError(f"{path!r}: {msg}", path=path)

    fd = open_data(path)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise SafetensorsError(f"{path!r} is not a regular file", path=path)
        if st.st_size > MAX_HEADER_BYTES:
            raise fail(f"an index of {st.st_size} bytes is over the limit of "
                       f"{MAX_HEADER_BYTES} bytes (MAX_HEADER_BYTES)")
        raw = pread_all(fd, st.st_size, 0, path)
    finally:
        os.close(fd)
    try:        # UnicodeDecodeError is a ValueError
        doc = json.loads(raw.decode("utf-8"), object_pairs_hook=unique_keys,
                         parse_constant=reject_constant)
    except (ValueError, RecursionError) as exc:
        raise fail(f"the index is not valid JSON: {exc}") from None
    if not isinstance(doc, dict) or "weight_map" not in doc:
        raise fail('the index has no "weight_map" (a JSON object {"weight_map": '
                   '{tensor name: shard file name}} is expected)')
    weight_map = doc["weight_map"]
    if not isinstance(weight_map, dict) or not all(isinstance(v, str)
                                                   for v in weight_map.values()):
        raise fail('"weight_map" must be an object of tensor name to shard file name')
    for shard in sorted(set(weight_map.values())):
        if (not shard or os.sep in shard or (os.altsep and os.altsep in shard)
                or ".." in shard or "\0" in shard):
            raise fail(f"shard file name {shard!r} is refused: a shard is a file of the "
                       f"index's directory, named without a path separator or '..'")
    return weight_map


def checkpoint_files(path: str) -> tuple[str | None, dict[str, str] | None, list[str]]:
    """(index, weight map, shard paths in file name order); (None, None, [file]) for a
    checkpoint of one file without an index."""
    if os.path.isdir(path):
        index = os.path.join(path, _INDEX_NAME)
        single = os.path.join(path, _SINGLE_NAME)
        if not os.path.lexists(index):
            if os.path.lexists(single):
                return None, None, [single]
            raise FileNotFoundError(errno.ENOENT, f"{path!r} holds neither {_INDEX_NAME} "
                                    f"nor {_SINGLE_NAME}", path)
    elif path.endswith(".json"):
        index = path
    else:
        return None, None, [path]
    weight_map = _read_index(index)
    directory = os.path.dirname(index)
    return index, weight_map, [os.path.join(directory, s)
                               for s in sorted(set(weight_map.values()))]


def check_index(index: str, weight_map: Mapping[str, str], headers: Sequence[Header]
                ) -> None:
    """Every tensor in exactly one shard, the one the index names for it."""
    def fail(msg: str) -> SafetensorsError:
        return SafetensorsError(f"{index!r}: {msg}", path=index)

    held: dict[str, list[str]] = {}
    for header in headers:
        assert header.path is not None
        for name in header.tensors:
            held.setdefault(name, []).append(os.path.basename(header.path))
    for name, shards in held.items():
        if len(shards) > 1:
            raise fail(f"tensor {name!r} is in more than one shard: {', '.join(shards)}")
        listed = weight_map.get(name)
        if listed is None:
            raise fail(f"tensor {name!r} of shard {shards[0]!r} is not in the weight_map")
        if listed != shards[0]:
            raise fail(f"the weight_map puts tensor {name!r} in {listed!r}, but it is in "
                       f"{shards[0]!r}")
    for name, shard in weight_map.items():
        if name not in held:
            raise fail(f"the weight_map puts tensor {name!r} in {shard!r}, but no shard "
                       f"holds it")


def given_files(path: PathLike | Sequence[PathLike]) -> str | list[str]:
    """A checkpoint's path, or the list of shard files given in its place."""
    if isinstance(path, (str, bytes, os.PathLike)):
        return os.fspath(path)
    files = [os.fspath(f) for f in path]
    if not files:
        raise ValueError("no safetensors files given")
    return files
