"""Nested state as JSON plus tensor leaves: what ``TensorSwapper`` keeps of a state dict's shape.

A state (``optimizer.state_dict()``, ``model.state_dict()``, an LR scheduler's or RNG state)
is split into its tensors, each stored under a name, and a skeleton: the structure with every
tensor replaced by its name, as JSON the manifest holds. No pickle: the skeleton holds only
JSON values and tagged objects, and reading it back builds nothing but dicts, lists, tuples
and plain values.

Skeleton format: ``null``, ``true``/``false``, integers, finite floats and strings stand for
themselves; every JSON object is a tag with exactly one of these forms:

``{"T": name}``             a tensor, stored under ``name``
``{"F": "nan"|"inf"|"-inf"}`` a float JSON has no number for
``{"L": [...]}``            a list;  ``{"U": [...]}`` a tuple
``{"D": [[k, v], ...]}``    a dict (keys encoded like values: int keys stay ints)
``{"O": [[k, v], ...]}``    an ``OrderedDict``; with ``"M": ...`` its ``_metadata`` (what
                            ``model.state_dict()`` carries for ``load_state_dict``)

A tensor's name is the prefix followed by its path of keys and list indices joined by ``.``
(``"opt/state.0.exp_avg"``), so a flat ``{str: tensor}`` dict is stored under ``prefix + key``.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from aioswap.errors import SwapError

if TYPE_CHECKING:
    import torch

__all__ = ["build", "find", "flatten", "is_flat", "leaves"]

_SCALARS = "None, bool, int, float, str"


def is_flat(state: Mapping[Any, Any]) -> bool:
    """True for a plain ``{str: tensor}`` dict (stored as before: no skeleton)."""
    import torch
    return type(state) is dict and all(
        isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in state.items())


def _component(key: Any) -> str:
    return key if isinstance(key, str) else str(key) if isinstance(key, int) else repr(key)


def _where(path: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in path) or "the top level"


def flatten(prefix: str, state: Any
            ) -> tuple[Any, list[tuple[str, tuple[Any, ...], torch.Tensor]]]:
    """Split ``state`` into a skeleton and its tensors as ``(name, path, tensor)``, in order.

    Raises TypeError for a value that is not a tensor, container or plain value (naming where
    it is), and SwapError when two tensors would get the same name.
    """
    import torch
    leaves: list[tuple[str, tuple[Any, ...], torch.Tensor]] = []
    seen: dict[str, tuple[Any, ...]] = {}
    active: set[int] = set()

    def key(k: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(k, tuple):
            return {"U": [key(x, path) for x in k]}
        if k is None or isinstance(k, (str, int, float)):
            return enc(k, path)
        raise TypeError(f"state dict key {k!r} at {_where(path)} is a {type(k).__name__}; "
                        f"keys may be {_SCALARS} or tuples of them")

    def enc(obj: Any, path: tuple[Any, ...]) -> Any:
        if isinstance(obj, torch.Tensor):
            name = prefix + ".".join(_component(k) for k in path)
            if name in seen:
                raise SwapError(f"two tensors of the state would both be named {name!r} (at "
                                f"{_where(seen[name])} and {_where(path)}); rename a key")
            seen[name] = path
            leaves.append((name, path, obj))
            return {"T": name}
        if obj is None:
            return None
        if isinstance(obj, bool):
            return bool(obj)
        if isinstance(obj, str):
            return str(obj)
        if isinstance(obj, int):
            return int(obj)                   # IntEnum and friends: their value
        if isinstance(obj, float):
            x = float(obj)
            return x if math.isfinite(x) else {"F": repr(x)}
        if id(obj) in active:
            raise TypeError(f"the state contains itself at {_where(path)}")
        if isinstance(obj, Mapping):
            active.add(id(obj))
            items = [[key(k, path), enc(v, path + (k,))] for k, v in obj.items()]
            active.discard(id(obj))
            if isinstance(obj, OrderedDict):
                out: dict[str, Any] = {"O": items}
                meta = getattr(obj, "_metadata", None)
                if meta is not None:
                    out["M"] = enc(meta, path + ("_metadata",))
                return out
            return {"D": items}
        if isinstance(obj, (list, tuple)):
            active.add(id(obj))
            vals = [enc(v, path + (i,)) for i, v in enumerate(obj)]
            active.discard(id(obj))
            return {"U" if isinstance(obj, tuple) else "L": vals}
        raise TypeError(f"cannot swap out the {type(obj).__name__} at {_where(path)}: a state "
                        f"may hold tensors, dicts, lists, tuples and {_SCALARS}")

    return enc(state, ()), leaves


def _bad(where: str, what: str, node: Any) -> SwapError:
    return SwapError(f"{where}: malformed state skeleton ({what}): {node!r:.200}")


def _walk(node: Any, path: tuple[Any, ...], where: str, tensors: Mapping[str, Any] | None,
          out: list[tuple[str, tuple[Any, ...]]]) -> Any:
    """Validate ``node``; collect its tensor leaves; rebuild it when ``tensors`` is given."""
    if node is None or isinstance(node, (bool, int, str)):
        return node
    if isinstance(node, float):
        if not math.isfinite(node):
            raise _bad(where, "a non-finite float outside an F tag", node)
        return node
    if not isinstance(node, dict) or len(node) not in (1, 2):
        raise _bad(where, "not a JSON value or tag", node)
    if len(node) == 2 and set(node) != {"O", "M"}:
        raise _bad(where, "unknown tag", node)
    tag = "O" if "O" in node else next(iter(node))
    body = node[tag]
    if tag == "T":
        if not isinstance(body, str):
            raise _bad(where, "a tensor name must be a string", node)
        out.append((body, path))
        return None if tensors is None else tensors[body]
    if tag == "F":
        if body not in ("nan", "inf", "-inf"):
            raise _bad(where, "F holds nan, inf or -inf", node)
        return float(body)
    if tag in ("L", "U"):
        if not isinstance(body, list):
            raise _bad(where, f"{tag} holds a list", node)
        vals = [_walk(v, path + (i,), where, tensors, out) for i, v in enumerate(body)]
        return tuple(vals) if tag == "U" else vals
    if tag in ("D", "O"):
        if not isinstance(body, list) or not all(
                isinstance(kv, list) and len(kv) == 2 for kv in body):
            raise _bad(where, f"{tag} holds [key, value] pairs", node)
        result: dict[Any, Any] = OrderedDict() if tag == "O" else {}
        for k, v in body:
            kk = _key(k, where)
            result[kk] = _walk(v, path + (kk,), where, tensors, out)
        if "M" in node:
            meta = _walk(node["M"], path + ("_metadata",), where, None, [])
            if tensors is not None:
                result._metadata = meta      # type: ignore[attr-defined]
        return result
    raise _bad(where, "unknown tag", node)


def _key(node: Any, where: str) -> Any:
    """A dict key of a skeleton: a plain value, or a tuple of keys."""
    if isinstance(node, dict) and set(node) == {"U"} and isinstance(node["U"], list):
        return tuple(_key(x, where) for x in node["U"])
    if isinstance(node, dict) and set(node) != {"F"}:
        raise _bad(where, "a key is a plain value or a tuple", node)
    return _walk(node, (), where, None, [])


def leaves(skeleton: Any, where: str) -> list[tuple[str, tuple[Any, ...]]]:
    """The tensor names of a stored skeleton with their paths, in order; checks it all."""
    out: list[tuple[str, tuple[Any, ...]]] = []
    _walk(skeleton, (), where, None, out)
    return out


def build(skeleton: Any, tensors: Mapping[str, Any], where: str) -> Any:
    """The state a (checked) skeleton describes, each tensor taken from ``tensors``."""
    return _walk(skeleton, (), where, tensors, [])


def find(state: Any, path: tuple[Any, ...]) -> Any:
    """What ``state`` holds at ``path`` (dict keys, list indices), or None."""
    node = state
    for k in path:
        try:
            if isinstance(node, Mapping):
                node = node[k]
            elif isinstance(node, (list, tuple)) and isinstance(k, int):
                node = node[k]
            else:
                return None
        except (KeyError, IndexError, TypeError):
            return None
    return node
