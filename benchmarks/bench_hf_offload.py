"""Hugging Face disk offload: stock accelerate loader against aioswap's.

A random Llama is built here (``LlamaConfig`` -> ``from_config`` -> ``save_pretrained`` in
``--shards`` shards under ``--dir``), then loaded with ``device_map={"": "disk"}`` so that
every weight is read from its checkpoint shard on every forward. Per round, in alternating
order, each method loads the model and times:

* a cold one-token forward and a cold 8-token ``generate`` (page cache dropped first: every
  model file with ``posix_fadvise(DONTNEED)``, and all of it with ``/proc/sys/vm/drop_caches``
  when run as root);
* a warm one-token forward (the same again, nothing dropped);
* the bytes read from storage per cold forward (``/proc/self/io`` ``read_bytes``).

Then the construction of the loader for ``--keys`` keys (half in a CPU state dict, half
offloaded, as ``device_map="auto"`` makes it). Default sizes are tiny (a smoke test); the
issue's sizes: ``--hidden 2048 --layers 16 --shards 4`` (about 1.5 GB in bf16) with
``--repeat 5``. Times are seconds (medians of the rounds); a ratio is stock time / aioswap
time, so above 1 means aioswap is faster.

Needs transformers and accelerate; uses aioswap's public API only.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from typing import Any

import torch
from _common import orders, print_table, ratio, summarize
from _common import drop_cache as drop_file_cache

import aioswap.integrations.accelerate as ia

METHODS = ["stock", "aioswap"]


def _read_bytes() -> int:
    """Bytes this process has caused to be read from storage (all threads)."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _drop_all(files: list[str]) -> str:
    """Evict the model's files from the page cache; say how."""
    for path in files:
        drop_file_cache(path)
    if os.geteuid() == 0:
        try:
            os.sync()
            with open("/proc/sys/vm/drop_caches", "w", encoding="ascii") as f:
                f.write("3\n")
            return "global"
        except OSError:
            pass
    return "per-file"


def build_model(directory: str, args: argparse.Namespace) -> tuple[str, int]:
    from transformers import AutoModelForCausalLM, LlamaConfig
    h = args.hidden
    heads = max(1, h // 64)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=h,
                      intermediate_size=(8 * h // 3 + 63) // 64 * 64,
                      num_hidden_layers=args.layers, num_attention_heads=heads,
                      num_key_value_heads=heads, max_position_embeddings=128,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, dtype=getattr(torch, args.dtype))
    nbytes = sum(p.numel() * p.element_size() for p in model.parameters())
    path = os.path.join(directory, "model")
    model.save_pretrained(path, max_shard_size=max(1, nbytes // args.shards + 1))
    return path, nbytes


def run_method(method: str, path: str, files: list[str], work: str,
               args: argparse.Namespace) -> dict[str, float]:
    from transformers import AutoModelForCausalLM
    if method == "aioswap":
        ia.install()
    else:
        ia.uninstall()
    off = tempfile.mkdtemp(prefix="offload-", dir=work)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, device_map={"": "disk"},
                                                     offload_folder=off)
        ids = torch.tensor([[1]])
        out: dict[str, float] = {}
        with torch.no_grad():
            _drop_all(files)
            r0 = _read_bytes()
            t0 = time.perf_counter()
            model(ids)
            out["cold_forward_s"] = time.perf_counter() - t0
            out["cold_forward_read_bytes"] = float(_read_bytes() - r0)
            t0 = time.perf_counter()
            model(ids)
            out["warm_forward_s"] = time.perf_counter() - t0
            _drop_all(files)
            t0 = time.perf_counter()
            model.generate(ids, max_new_tokens=args.new_tokens, do_sample=False,
                           min_new_tokens=args.new_tokens)
            out["cold_generate_s"] = time.perf_counter() - t0
        del model
        return out
    finally:
        ia.uninstall()             # closes aioswap's loaders (their handles and files)
        shutil.rmtree(off, ignore_errors=True)


def construction(keys: int) -> dict[str, float]:
    from accelerate.utils import OffloadedWeightsLoader
    half = keys // 2
    index = {f"model.layers.{i // 16}.w{i % 16}.weight":
             {"safetensors_file": "x.safetensors", "weight_name": "w", "dtype": "bfloat16"}
             for i in range(keys - half)}
    state = {f"model.cpu.{i // 16}.w{i % 16}.weight": torch.empty(0) for i in range(half)}
    out = {}
    for name, cls in (("stock", OffloadedWeightsLoader), ("aioswap", ia.AioswapWeightsLoader)):
        t0 = time.perf_counter()
        loader = cls(state_dict=state, index=index)
        out[name] = time.perf_counter() - t0
        close = getattr(loader, "close", None)
        if close is not None:
            close()
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", default=".", help="directory for the model (default: .)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default: 128)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary (default: 1024)")
    p.add_argument("--shards", type=int, default=4, help="checkpoint shards (default: 4)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--new-tokens", type=int, default=8, help="generate length (default: 8)")
    p.add_argument("--keys", type=int, default=20000,
                   help="keys for the loader construction figure (default: 20000)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default: 3)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    if not os.path.isdir(args.dir):
        p.error(f"--dir {args.dir!r} is not a directory")
    # what libraries print to stdout (DeepSpeed's accelerator probe, which transformers
    # reaches where DeepSpeed is installed, logs there) goes to stderr; the figures to stdout
    out = sys.stdout
    with contextlib.redirect_stdout(sys.stderr):
        report = measure(p, args)
    if args.json:
        print(json.dumps(report, allow_nan=True), file=out)
    else:
        print_report(report, args, out)
    return 0


def measure(p: argparse.ArgumentParser, args: argparse.Namespace) -> dict[str, Any]:
    try:
        import transformers
        from transformers.utils import logging as hf_logging
    except ImportError:
        p.error("needs transformers and accelerate: pip install transformers accelerate")
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)

    work = tempfile.mkdtemp(prefix=".aioswap-hf-", dir=os.path.abspath(args.dir))
    try:
        path, nbytes = build_model(work, args)
        files = sorted(os.path.join(path, f) for f in os.listdir(path))
        rounds: dict[str, dict[str, list[float]]] = {m: {} for m in METHODS}
        for order in orders(METHODS, args.repeat):      # who goes first alternates
            for method in order:
                for k, v in run_method(method, path, files, work, args).items():
                    rounds[method].setdefault(k, []).append(v)
        how = _drop_all(files)
        build = construction(args.keys)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    figures = {m: {k: summarize(v) for k, v in rounds[m].items()} for m in METHODS}
    ratios = {k: ratio(figures["stock"][k].median, figures["aioswap"][k].median)
              for k in ("cold_forward_s", "cold_generate_s", "warm_forward_s")}
    cold_gbs = {m: (nbytes / figures[m]["cold_forward_s"].median / 1e9) for m in METHODS}
    report: dict[str, Any] = {
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                  "dtype": args.dtype, "shards": args.shards, "bytes": nbytes},
        "versions": {"transformers": transformers.__version__,
                     "accelerate": _version("accelerate"), "torch": torch.__version__},
        "rounds": args.repeat, "page_cache_drop": how,
        "shard_files": sum(f.endswith(".safetensors") for f in files),
        "figures": {m: {k: s.to_json_dict() for k, s in f.items()} for m, f in figures.items()},
        "ratios_stock_over_aioswap_time": ratios,
        "cold_forward_model_gbs": cold_gbs,
        "loader_construction_s": {"keys": args.keys, **build,
                                  "ratio": ratio(build["stock"], build["aioswap"])},
    }
    return report


def print_report(report: dict[str, Any], args: argparse.Namespace, out: Any) -> None:
    figures = {m: {k: summarize(v["all"]) for k, v in f.items()}
               for m, f in report["figures"].items()}
    ratios = report["ratios_stock_over_aioswap_time"]
    build = report["loader_construction_s"]
    nbytes = report["model"]["bytes"]
    how = report["page_cache_drop"]
    rows = []
    for k, label in (("cold_forward_s", "cold 1-token forward s"),
                     ("cold_generate_s", f"cold {args.new_tokens}-token generate s"),
                     ("warm_forward_s", "warm 1-token forward s")):
        rows.append([label, figures["stock"][k].median, figures["aioswap"][k].median,
                     ratios[k]])
    rows.append(["MB read per cold forward",
                 figures["stock"]["cold_forward_read_bytes"].median / 1e6,
                 figures["aioswap"]["cold_forward_read_bytes"].median / 1e6, math.nan])
    rows.append([f"loader for {args.keys} keys s", build["stock"], build["aioswap"],
                 ratio(build["stock"], build["aioswap"])])
    print_table(["figure", "stock", "aioswap", "stock/aioswap"], rows,
                title=[f"random Llama {args.layers} layers x hidden {args.hidden}, "
                       f"{args.dtype}, {nbytes / 1e6:.1f} MB in "
                       f"{report['shard_files']} shards, "
                       f"all on disk; median of {args.repeat} rounds"],
                notes=[f"page cache dropped before cold runs: {how}"
                       + ("" if how == "global" else " (drop_caches skipped: not root)"),
                       "times in seconds; the ratio is stock time / aioswap time"],
                file=out)


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
