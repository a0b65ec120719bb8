#!/usr/bin/env python3
"""Adam over optimizer state that does not fit in memory, streamed from NVMe bucket by bucket.

The fp32 parameters and Adam's two moments live in a swap directory, in ``--buckets``
buckets. Each step streams them through a few page-locked arenas: while bucket *i* is
updated, bucket *i+1* is read and bucket *i-1* written back (crash-safe: a SIGKILL leaves
every bucket as it was before or after its update). Memory held: ``(prefetch + 2)`` buckets,
whatever the size of the whole state.

    python examples/stream_adam.py --dir /nvme/swap --numel 256M --buckets 8 --steps 3

The update is ``torch.optim.Adam``'s (``foreach=False``), bit for bit; the gradient is a
stand-in (a real trainer would take it from ``backward()``). With ``--device cuda`` each
bucket is copied to the GPU, updated there and copied back.
"""
from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import time

import torch

import aioswap
from aioswap import TensorSwapper, offload, onload


def adam_(param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor,
          exp_avg_sq: torch.Tensor, step: torch.Tensor, scratch: torch.Tensor, *,
          lr: float = 1e-3, beta1: float = 0.9, beta2: float = 0.999,
          eps: float = 1e-8) -> None:
    """``torch.optim.Adam(foreach=False)``'s update, in place, with one scratch tensor."""
    step += 1
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    t = step.item()
    bias_correction1 = 1 - beta1 ** t
    bias_correction2_sqrt = (1 - beta2 ** t) ** 0.5
    torch.sqrt(exp_avg_sq, out=scratch)
    scratch.div_(bias_correction2_sqrt).add_(eps)
    param.addcdiv_(exp_avg, scratch, value=-lr / bias_correction1)


def fake_grad(param: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """A deterministic stand-in for the gradient of ``param``."""
    return torch.sin(param, out=out).mul_(1e-2)


def update(bucket: dict[str, torch.Tensor], grad: torch.Tensor, scratch: torch.Tensor) -> None:
    """One Adam step on one bucket (``grad``/``scratch``: reused buffers, at least as large)."""
    p = bucket["param"]
    n = p.numel()
    g = fake_grad(p, grad[:n])
    adam_(p, g, bucket["exp_avg"], bucket["exp_avg_sq"], bucket["step"], scratch[:n])


def parse_count(text: str) -> int:
    """``1M`` = 2**20 elements."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(float(text.rstrip("KMG") or 0) * units[text[-1] if text[-1] in "KMG" else ""])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--dir", help="swap directory (default: a new temporary directory)")
    p.add_argument("--numel", type=parse_count, default=1 << 20,
                   help="parameters in all, K/M/G = 2**10/20/30 (default 1M)")
    p.add_argument("--buckets", type=int, default=8)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--prefetch", type=int, default=1)
    p.add_argument("--device", default="cpu", help="where to compute: cpu or cuda")
    a = p.parse_args(argv)
    device = torch.device(a.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        p.error("--device cuda: no CUDA device here")
    directory = a.dir or tempfile.mkdtemp(prefix="stream-adam-")
    per = math.ceil(a.numel / a.buckets)
    tags = [f"adam{b}" for b in range(a.buckets)]

    with TensorSwapper(directory) as sw:
        # The initial state, written one bucket at a time: never all in memory at once.
        gen = torch.Generator().manual_seed(0)
        for b, tag in enumerate(tags):
            n = min(per, a.numel - b * per)
            offload(sw, tag, {"param": torch.randn(n, generator=gen),
                              "exp_avg": torch.zeros(n), "exp_avg_sq": torch.zeros(n),
                              "step": torch.tensor(0.0)})

        grad = torch.empty(per, device=device)         # reused for every bucket
        scratch = torch.empty(per, device=device)
        for step in range(a.steps):
            t0 = time.perf_counter()
            with aioswap.stream(sw, tags, prefetch=a.prefetch) as s:
                for bucket in s:
                    if device.type == "cpu":
                        update(bucket.tensors, grad, scratch)
                    else:       # pinned -> GPU, update there, GPU -> pinned (written back)
                        gpu = {k: v.to(device, non_blocking=True) for k, v in bucket.items()}
                        update(gpu, grad, scratch)
                        for k, v in bucket.items():
                            v.copy_(gpu[k])
            state = 12 * a.numel
            print(f"step {step + 1}: {time.perf_counter() - t0:.2f} s for "
                  f"{state / 1e9:.3f} GB of state; memory held: {s.memory_bytes / 1e9:.3f} GB "
                  f"({s.slots} buckets of {a.buckets})")

        first = onload(sw, tags[0])
        print(f"bucket 0 after {a.steps} steps: step={first['step'].item():.0f}, "
              f"param[:3]={first['param'][:3].tolist()}")
        if a.dir is None:
            sw.destroy()
    if a.dir is None and os.path.isdir(directory):
        os.rmdir(directory)
    return 0


if __name__ == "__main__":
    sys.exit(main())
