#!/usr/bin/env python3
"""One cold load in this fresh process, as a user who loads a state dict once pays for it.

    python benchmarks/_cold.py METHOD PATH

The clock starts after the imports and stops after the result was freed: it covers making
the loader (a swapper, a handle), allocating the destination, reading every byte (the caller
dropped the page cache), touching one byte of every page, and freeing. The digest of the
bytes is taken between the touch and the free, off the clock. Prints one JSON object:
``{"method", "load_s", "free_s", "total_s", "bytes", "digest", "maxrss_kib"}``.

Methods: ``aioswap-swap`` (``TensorSwapper(PATH).swap_in_state_dict("")``),
``aioswap-safetensors`` (``aioswap.safetensors.load_file``), ``safetensors``
(``safetensors.torch.load_file``), ``torch`` (``torch.load(weights_only=True)``), ``direct``
(``pinned.empty`` of the file's size plus one ``AioHandle.pread``: the drive's speed with
allocation charged).

The parent side is :func:`run_cold` (used by ``bench_swap.py`` and ``bench_safetensors.py``).
"""
from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
import zlib
from typing import Any, Callable

from _common import freed

METHODS = ("aioswap-swap", "aioswap-safetensors", "safetensors", "torch", "direct")


def digest(tensors: dict[str, Any]) -> str:
    """xxh3 (crc32 where xxhash is missing) over every tensor's bytes, in key order; the same
    in parent and child."""
    import torch
    try:
        import xxhash
        h: Any = xxhash.xxh3_64()
    except ImportError:
        h = None
    crc = 0
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        parts = [k.encode()] + ([t.reshape(-1).view(torch.uint8).numpy().data] if t.numel()
                                else [])
        for part in parts:
            if h is not None:
                h.update(part)
            else:
                crc = zlib.crc32(part, crc)
    return str(h.hexdigest()) if h is not None else f"{crc:08x}"


def _touch(tensors: dict[str, Any]) -> None:
    import torch
    for t in tensors.values():
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()


def _loader(method: str, path: str) -> Callable[[], dict[str, Any]]:
    import torch
    if method == "aioswap-swap":
        from aioswap import TensorSwapper

        def load() -> dict[str, Any]:
            with TensorSwapper(path) as sw:
                got = sw.swap_in_state_dict("")
            return dict(got)
        return load
    if method == "aioswap-safetensors":
        import aioswap.safetensors as ast
        return lambda: ast.load_file(path)
    if method == "safetensors":
        import safetensors.torch as st
        return lambda: st.load_file(path)
    if method == "torch":
        return lambda: torch.load(path, weights_only=True)
    if method == "direct":
        import aioswap
        from aioswap import pinned

        def load() -> dict[str, Any]:
            buf = pinned.empty(os.path.getsize(path), torch.uint8, strict=False)
            aioswap.handle.shared_handle().pread(buf, path)
            return {"x": buf}
        return load
    raise SystemExit(f"unknown method {method!r}; known: {', '.join(METHODS)}")


def child(method: str, path: str) -> dict[str, Any]:
    load = _loader(method, path)      # imports torch and the method's module: off the clock
    t0 = time.perf_counter()
    got = load()
    _touch(got)
    t1 = time.perf_counter()
    nbytes = sum(t.numel() * t.element_size() for t in got.values())
    d = digest(got)
    free_s = freed(got)
    return {"method": method, "load_s": t1 - t0, "free_s": free_s, "total_s": t1 - t0 + free_s,
            "bytes": nbytes, "digest": d,
            "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss}


def run_cold(method: str, path: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    """One cold load of ``path`` by ``method`` in a fresh interpreter (the caller dropped the
    page cache first); the child's JSON."""
    out = subprocess.run([sys.executable, os.path.abspath(__file__), method, path],
                         capture_output=True, text=True, env=env)
    if out.returncode != 0:
        raise SystemExit(f"cold {method} load of {path} failed (rc {out.returncode}):\n"
                         f"{out.stderr.strip()}")
    res: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return res


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    print(json.dumps(child(sys.argv[1], sys.argv[2])))
