#!/usr/bin/env python3
"""Loading weights: aioswap against the loaders users pick instead, cold and warm, same run.

One transformer-like state dict of ``--size`` bytes (``--layers`` blocks; per block q/k/v/o,
two MLP matrices, biases and norms: bf16 weights, fp32 norms and biases, plus an fp32
embedding) is written once in each loader's format. Then, per round and per loader, one load
in a fresh process (``--worker``: imports off the clock; on it: making the loader, allocating
the result, reading every byte, touching one byte of every page of the result):

* **cold**: the files' pages dropped from the cache first (``posix_fadvise(DONTNEED)``, and
  ``/proc/sys/vm/drop_caches`` as root);
* **warm**: the file read once just before (it is in the page cache);
* **half**: dropped, then every other 16 MiB of each file read (half of it is in the page
  cache, in stretches): the case for reads that choose per range.

Loaders (each only when installed; ``--loaders`` picks):

==================  =================================================================
aioswap             ``aioswap.safetensors.load_file`` (reads adapt to the page cache)
aioswap-direct      the same with ``read="direct"`` (every byte from the drive)
aioswap-buffered    the same with ``read="buffered"``
aioswap-sharded     ``aioswap.safetensors.load_checkpoint`` of the same bytes in 4 shards
aioswap-swap        ``TensorSwapper.swap_in_state_dict`` (aioswap's own layout)
safetensors         ``safetensors.torch.load_file`` (a mapping: every page faulted in)
torch               ``torch.load(weights_only=True)``
tensorizer          ``TensorDeserializer(num_readers=8)`` on its own format
fastsafetensors     ``fastsafe_open(nogds=True)``, its default (O_DIRECT) reads
fastsafetensors-b   the same with ``FASTSAFETENSORS_ODIRECT=0`` (buffered reads)
runai               ``SafetensorsStreamer`` (runai-model-streamer), tensors kept
pread4              reference: 4 threads ``pread`` 8 MiB pieces into prefaulted memory
fio                 reference, cold only: fio 8 MiB O_DIRECT reads, iodepth 64, one job
hf-stock            transformers ``AutoModelForCausalLM.from_pretrained`` of a local
                    Llama checkpoint in 4 shards (bf16, ``--hf-size``), stock
hf-aioswap          the same after ``aioswap.integrations.transformers.install()`` (its
                    default ``read="auto"``: a checkpoint in the page cache stays mapped)
==================  =================================================================

The two ``hf-`` loaders time what a user waits for: ``from_pretrained`` (config, model
built, every shard read, parameters set) and one touch of every page of the parameters;
importing transformers and ``install()`` are off the clock. The checkpoint is written once by
``save_pretrained`` (random weights); once, before the rounds, a worker loads it both ways
and compares every parameter and the logits on a fixed input with ``torch.equal``
(``from_pretrained.logits_equal`` in the JSON; the bench fails if they differ).

Rounds interleave the loaders (the order rotated each round). Per loader: GB/s (10^9 B/s),
median and range; CPU seconds per GB (user + system, every thread); peak RSS over the
process's RSS before the load (the largest of the rounds). Ratios of
aioswap to the best peer that returns memory the caller owns (all but ``safetensors``, whose
tensors map the file) and to fio (cold) or pread4 (warm) are the medians of the per-round
ratios (``hf-aioswap`` to ``hf-stock`` only); in ``half``, also aioswap to the better of
``aioswap-direct`` and ``aioswap-buffered`` in the same round. ``--json`` prints one object.

    python benchmarks/bench_loaders.py --dir /nvme --size 2G --repeat 5
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from typing import Any

from _common import dir_arg, drop_cache, format_size, orders, print_table, run_fio, size_arg

HERE = os.path.dirname(os.path.abspath(__file__))
PEERS = ("tensorizer", "fastsafetensors", "fastsafetensors-b", "runai", "torch")
HF = ("hf-stock", "hf-aioswap")  # from_pretrained of a sharded checkpoint (its own bytes)
ALL = ("aioswap", "aioswap-direct", "aioswap-buffered", "aioswap-sharded", "aioswap-swap",
       "safetensors", *PEERS, "pread4", "fio", *HF)
MAPPED = ("safetensors",)       # returns a mapping of the file, not memory the caller owns
OURS = ("aioswap", "aioswap-direct", "aioswap-buffered", "aioswap-sharded", "aioswap-swap")
REFERENCE = ("pread4", "fio")
HF_SHARDS = 4
HF_IDS = [[1, 7, 42, 3, 99, 12, 5, 8]]


def shapes(size: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """A transformer-like state dict of about ``size`` bytes: name -> (shape, dtype)."""
    hidden = 1024
    per_layer = 2 * (4 * hidden * hidden + 2 * 4 * hidden * hidden)     # bf16 matrices
    layers = max(1, size // per_layer)
    out: dict[str, tuple[tuple[int, ...], str]] = {
        "embed.weight": ((4096, hidden), "float32")}
    for i in range(layers):
        p = f"layers.{i}."
        for m in ("q", "k", "v", "o"):
            out[p + f"attn.{m}.weight"] = ((hidden, hidden), "bfloat16")
        out[p + "attn.o.bias"] = ((hidden,), "float32")
        out[p + "mlp.up.weight"] = ((4 * hidden, hidden), "bfloat16")
        out[p + "mlp.down.weight"] = ((hidden, 4 * hidden), "bfloat16")
        out[p + "mlp.down.bias"] = ((hidden,), "float32")
        for n in ("ln1", "ln2"):
            out[p + f"{n}.weight"] = ((hidden,), "float32")
            out[p + f"{n}.bias"] = ((hidden,), "float32")
    return out


def make_state(size: int) -> dict[str, Any]:
    import torch
    g = torch.Generator().manual_seed(0)
    sd = {}
    for name, (shape, dt) in shapes(size).items():
        sd[name] = torch.randn(shape, generator=g).to(getattr(torch, dt))
    return sd


def hf_config(size: int) -> Any:
    """A Llama config whose bf16 weights take about ``size`` bytes (untied embeddings)."""
    from transformers import LlamaConfig
    hidden = 1024 if size >= 256 << 20 else 512 if size >= 32 << 20 else 256
    vocab, inter = 16 * hidden, 11 * hidden // 4
    per_layer = 2 * (4 * hidden * hidden + 3 * hidden * inter + 2 * hidden)
    layers = max(2, round((size - 2 * 2 * vocab * hidden) / per_layer))
    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=inter,
                       num_hidden_layers=layers, num_attention_heads=hidden // 64,
                       num_key_value_heads=hidden // 64, max_position_embeddings=256,
                       tie_word_embeddings=False, dtype="bfloat16")


def _shard_bytes(sizes: list[int], shards: int) -> int:
    """The smallest ``max_shard_size`` (within 1%) that makes ``save_pretrained`` (huggingface_hub's
    next-fit split over tensors of ``sizes`` bytes, in order) write at most ``shards`` files."""
    def count(most: int) -> int:
        n = cur = 0
        for t in sizes:
            if t > most:                # a tensor over the limit: a shard of its own
                n += 1
                continue
            if cur + t > most:
                n, cur = n + 1, 0
            cur += t
        return n + (cur > 0)
    most = -(-sum(sizes) // shards)
    while count(most) > shards:
        most += most // 100 + 1
    return most


def make_hf(d: str, size: int) -> dict[str, Any]:
    """A random bf16 Llama of about ``size`` bytes saved by ``save_pretrained`` in about
    four shards at ``d``; what was written."""
    import torch
    from transformers import AutoModelForCausalLM
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(size), dtype=torch.bfloat16)
    model.to_empty(device="cpu")
    g = torch.Generator().manual_seed(0)
    total = 0
    with torch.no_grad():
        for prm in model.parameters():
            prm.copy_(torch.randn(prm.shape, generator=g) * 0.02)
            total += prm.numel() * prm.element_size()
    sizes = [t.numel() * t.element_size() for t in model.state_dict().values()]
    model.save_pretrained(d, max_shard_size=_shard_bytes(sizes, HF_SHARDS))
    shards = [f for f in os.listdir(d) if f.endswith(".safetensors")]
    return {"bytes": total, "shards": len(shards),
            "layers": model.config.num_hidden_layers, "hidden": model.config.hidden_size}


def available(name: str) -> bool:
    import importlib.util
    if name in HF:
        return importlib.util.find_spec("transformers") is not None
    mod = {"tensorizer": "tensorizer", "fastsafetensors": "fastsafetensors",
           "fastsafetensors-b": "fastsafetensors", "runai": "runai_model_streamer",
           "safetensors": "safetensors"}.get(name)
    if name == "aioswap-sharded":
        import aioswap.safetensors as ast
        return hasattr(ast, "load_checkpoint")
    if name == "fio":
        return shutil.which("fio") is not None
    return mod is None or importlib.util.find_spec(mod) is not None


def prepare(d: str, size: int, names: list[str], hf_size: int,
            hf_info: dict[str, Any]) -> dict[str, str]:
    """Write the state dict in every format needed (and the Hugging Face checkpoint, its
    facts into ``hf_info``); the paths by loader."""
    import torch
    from safetensors.torch import save_file
    paths: dict[str, str] = {}
    if any(n in HF for n in names):
        hf_dir = os.path.join(d, "hf")
        # importing transformers may print (DeepSpeed's accelerator note): not into --json
        with contextlib.redirect_stdout(sys.stderr):
            hf_info.update(make_hf(hf_dir, hf_size))
        for n in HF:
            paths[n] = hf_dir
        if all(n in HF for n in names):
            os.sync()
            return paths
    sd = make_state(size)
    st = os.path.join(d, "model.safetensors")
    save_file(sd, st)
    for n in ("aioswap", "aioswap-direct", "aioswap-buffered", "safetensors",
              "fastsafetensors", "fastsafetensors-b", "runai", "pread4", "fio"):
        paths[n] = st
    if "aioswap-sharded" in names:
        import aioswap.safetensors as ast
        shard_dir = os.path.join(d, "sharded")
        total = sum(t.numel() * t.element_size() for t in sd.values())
        ast.save_sharded(sd, shard_dir, max_shard_bytes=-(-total // 4) + (1 << 20))
        paths["aioswap-sharded"] = shard_dir
    if "aioswap-swap" in names:
        from aioswap.swap import TensorSwapper
        swap_dir = os.path.join(d, "swap")
        with TensorSwapper(swap_dir, checksum=None) as sw:
            sw.swap_out_state_dict("", sd)
        paths["aioswap-swap"] = swap_dir
    if "torch" in names:
        p = os.path.join(d, "model.pt")
        torch.save(sd, p)
        paths["torch"] = p
    if "tensorizer" in names:
        from tensorizer import TensorSerializer
        p = os.path.join(d, "model.tensors")
        ser = TensorSerializer(p)
        ser.write_state_dict(sd)
        ser.close()
        paths["tensorizer"] = p
    os.sync()
    return paths


def files_of(path: str) -> list[str]:
    if os.path.isdir(path):
        return [os.path.join(r, f) for r, _, fs in os.walk(path) for f in fs]
    return [path]


def drop(path: str) -> None:
    for f in files_of(path):
        drop_cache(f)
    if os.geteuid() == 0:
        try:
            with open("/proc/sys/vm/drop_caches", "w") as f:
                f.write("1\n")
        except OSError:
            pass


HALF_STRETCH = 16 << 20      # "half": cached and uncached stretches of this size


def half(path: str) -> None:
    drop(path)
    for f in files_of(path):
        with open(f, "rb", buffering=0) as fh:
            off, size = 0, os.fstat(fh.fileno()).st_size
            while off < size:
                os.pread(fh.fileno(), HALF_STRETCH, off)
                off += 2 * HALF_STRETCH


def warm(path: str) -> None:
    for f in files_of(path):
        with open(f, "rb", buffering=0) as fh:
            while fh.read(16 << 20):
                pass


# -- one load, in a fresh process ----------------------------------------------------------
def _touch(tensors: Any) -> int:
    import torch
    n = 0
    for t in tensors:
        if t.numel():
            t.reshape(-1).view(torch.uint8)[::4096].sum()
            n += t.numel() * t.element_size()
    return n


def _load(name: str, path: str) -> int:
    """Load ``path`` with loader ``name`` and touch every page; bytes loaded."""
    if name in HF:
        from transformers import AutoModelForCausalLM
        model = AutoModelForCausalLM.from_pretrained(path)
        return _touch(model.state_dict().values())
    if name.startswith("aioswap") and name != "aioswap-swap":
        import aioswap.safetensors as ast
        if name == "aioswap-sharded":
            return _touch(ast.load_checkpoint(path).values())
        read = {"aioswap-direct": "direct", "aioswap-buffered": "buffered"}.get(name)
        kw = {"read": read} if read else {}
        return _touch(ast.load_file(path, **kw).values())
    if name == "aioswap-swap":
        from aioswap.swap import TensorSwapper
        with TensorSwapper(path, checksum=None) as sw:
            return _touch(sw.swap_in_state_dict("").values())
    if name == "safetensors":
        from safetensors.torch import load_file
        return _touch(load_file(path).values())
    if name == "torch":
        import torch
        return _touch(torch.load(path, weights_only=True).values())
    if name == "tensorizer":
        from tensorizer import TensorDeserializer
        with TensorDeserializer(path, device="cpu", num_readers=8) as de:
            return _touch(dict(de).values())
    if name.startswith("fastsafetensors"):
        from fastsafetensors import fastsafe_open
        with fastsafe_open(path, nogds=True, device="cpu") as f:
            return _touch([f.get_tensor(k) for k in f.keys()])
    if name == "runai":
        from runai_model_streamer import SafetensorsStreamer
        kept = []
        with SafetensorsStreamer() as s:
            s.stream_file(path)
            for _, t in s.get_tensors():
                kept.append(t)
        return _touch(kept)
    if name == "pread4":
        import concurrent.futures
        import torch
        size = os.path.getsize(path)
        buf = torch.empty(size, dtype=torch.uint8)
        buf[::4096] = 0                                 # prefaulted
        mv = memoryview(buf.numpy())
        fd = os.open(path, os.O_RDONLY)
        try:
            def one(o: int) -> None:
                os.preadv(fd, [mv[o:o + (8 << 20)]], o)
            with concurrent.futures.ThreadPoolExecutor(4) as ex:
                list(ex.map(one, range(0, size, 8 << 20)))
        finally:
            os.close(fd)
        return _touch([buf])
    raise ValueError(name)


def hf_check(path: str) -> None:
    """Load the checkpoint stock, then through aioswap; print whether every parameter and
    the logits on a fixed input are ``torch.equal``."""
    import torch
    from transformers import AutoModelForCausalLM

    import aioswap.integrations.transformers as aioswap_hf
    ids = torch.tensor(HF_IDS)
    out = {}
    for how in ("stock", "aioswap"):
        if how == "aioswap":
            aioswap_hf.install(read="direct")       # read by aioswap even when cached
        model = AutoModelForCausalLM.from_pretrained(path)
        with torch.no_grad():
            out[how] = (model.state_dict(), model(ids).logits)
    assert aioswap_hf.stats().loads == 1, aioswap_hf.stats()
    (sa, la), (sb, lb) = out["stock"], out["aioswap"]
    print(json.dumps({"logits_equal": bool(torch.equal(la, lb)),
                      "params_equal": list(sa) == list(sb) and all(
                          torch.equal(sa[k], sb[k]) for k in sa)}))


def worker(name: str, path: str) -> None:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")        # a local checkpoint: never the hub
    if name == "hf-check":
        hf_check(path)
        return
    if name == "fastsafetensors-b":
        os.environ["FASTSAFETENSORS_ODIRECT"] = "0"
    import torch  # noqa: F401  (imports off the clock)
    import aioswap.safetensors  # noqa: F401
    if name in HF:       # both: transformers' lazy modules for a Llama imported off the clock
        import transformers.modeling_utils  # noqa: F401
        import transformers.models.llama.modeling_llama  # noqa: F401
        from transformers import AutoModelForCausalLM, LlamaConfig  # noqa: F401
        if name == "hf-aioswap":
            import aioswap.integrations.transformers as aioswap_hf
            aioswap_hf.install()
    for mod in {"tensorizer": "tensorizer", "runai": "runai_model_streamer",
                "safetensors": "safetensors.torch"}.items():
        if name == mod[0]:
            __import__(mod[1])
    if name.startswith("fastsafetensors"):
        import fastsafetensors  # noqa: F401
    base = _status("VmRSS")
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    n = _load(name, path)
    dt = time.perf_counter() - t0
    if name == "hf-aioswap":            # measured what it says: one load, aioswap's choice
        st = aioswap_hf.stats()         # (read="auto": a cached checkpoint is left mapped)
        assert st.loads + st.stock_loads == 1, st
    r1 = resource.getrusage(resource.RUSAGE_SELF)
    cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)
    # VmHWM: this process's peak (ru_maxrss would carry the parent's over fork + exec)
    print(json.dumps({"seconds": dt, "bytes": n, "cpu_s": cpu,
                      "rss": _status("VmHWM") - base}))


def _status(field: str) -> int:
    """A ``/proc/self/status`` size in bytes."""
    with open("/proc/self/status") as f:
        return next(int(x.split()[1]) * 1024 for x in f if x.startswith(field + ":"))


def run_one(name: str, path: str, nbytes: int) -> dict[str, float]:
    if name == "fio":
        bs = 8 << 20 if nbytes >= 8 << 20 else 1 << 20
        n = nbytes // bs * bs
        seconds = run_fio(path, "read", n, block_size=bs, queue_depth=64, end_fsync=False)
        return {"gbps": n / seconds / 1e9, "cpu_s_per_gb": float("nan"), "rss": float("nan")}
    r = subprocess.run([sys.executable, __file__, "--worker", name, path],
                       capture_output=True, text=True, timeout=1800)
    if r.returncode:
        raise RuntimeError(f"{name}: {r.stderr.strip()[-2000:]}")
    out = json.loads(r.stdout.strip().splitlines()[-1])
    return {"gbps": out["bytes"] / out["seconds"] / 1e9,
            "cpu_s_per_gb": out["cpu_s"] / (out["bytes"] / 1e9), "rss": out["rss"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--worker", nargs=2, metavar=("LOADER", "PATH"), help=argparse.SUPPRESS)
    p.add_argument("--dir", type=dir_arg, default=None, help="directory on the drive "
                   "(default: a temporary one in the current directory)")
    p.add_argument("--size", type=size_arg(1 << 20), default=256 << 20,
                   help="bytes of the state dict (default 256M; the issue's is 2G)")
    p.add_argument("--repeat", type=int, default=3, help="rounds (default 3)")
    p.add_argument("--modes", default="cold,warm",
                   help="cold, warm and/or half (default cold,warm)")
    p.add_argument("--loaders", default=",".join(ALL), help="comma-separated, of: "
                   + ", ".join(ALL))
    p.add_argument("--hf-size", type=size_arg(1 << 20), default=None,
                   help="bytes of the from_pretrained checkpoint (default: --size; the "
                   "issue's is >= 1G)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    if args.worker:
        worker(*args.worker)
        return 0
    if args.repeat < 1:
        p.error("--repeat must be >= 1")
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not modes or any(m not in ("cold", "warm", "half") for m in modes):
        p.error(f"--modes: expected cold, warm and/or half, got {args.modes!r}")
    wanted = [n.strip() for n in args.loaders.split(",") if n.strip()]
    bad = [n for n in wanted if n not in ALL]
    if bad:
        p.error(f"--loaders: unknown {bad[0]!r} (known: {', '.join(ALL)})")
    names = [n for n in wanted if available(n)]
    skipped = [n for n in wanted if n not in names]
    work = tempfile.mkdtemp(prefix=".aioswap-bench-loaders-", dir=args.dir or ".")
    progress = sys.stderr.isatty() and not args.json
    hf_info: dict[str, Any] = {}
    try:
        paths = prepare(work, args.size, names, args.hf_size or args.size, hf_info)
        nbytes = os.path.getsize(paths["aioswap"]) if "aioswap" in paths else args.size
        if "hf-aioswap" in names:           # logits compared once, before the rounds
            r = subprocess.run([sys.executable, __file__, "--worker", "hf-check",
                                paths["hf-aioswap"]], capture_output=True, text=True,
                               timeout=1800)
            if r.returncode:
                raise RuntimeError(f"hf-check: {r.stderr.strip()[-2000:]}")
            hf_info.update(json.loads(r.stdout.strip().splitlines()[-1]))
            if not (hf_info["logits_equal"] and hf_info["params_equal"]):
                raise RuntimeError(f"from_pretrained through aioswap differs from stock: "
                                   f"{hf_info}")
        res: dict[str, dict[str, list[dict[str, float]]]] = {m: {} for m in modes}
        for rnd, order in enumerate(orders(names, args.repeat)):
            for mode in modes:
                for n in order:
                    if mode != "cold" and n == "fio":
                        continue
                    if progress:
                        print(f"\rround {rnd + 1}/{args.repeat} {mode} {n:20s}", end="",
                              file=sys.stderr, flush=True)
                    {"cold": drop, "warm": warm, "half": half}[mode](paths[n])
                    res[mode].setdefault(n, []).append(run_one(n, paths[n], nbytes))
        if progress:
            print(file=sys.stderr)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    doc: dict[str, Any] = {"size": nbytes, "repeat": args.repeat, "skipped": skipped,
                           "modes": {}}
    if hf_info:
        doc["from_pretrained"] = hf_info
    for mode in modes:
        figs = res[mode]
        table = {n: {"gbps": statistics.median(r["gbps"] for r in runs),
                     "gbps_min": min(r["gbps"] for r in runs),
                     "gbps_max": max(r["gbps"] for r in runs),
                     "cpu_s_per_gb": statistics.median(r["cpu_s_per_gb"] for r in runs),
                     "peak_rss": max(r["rss"] for r in runs),
                     "rounds": [r["gbps"] for r in runs]} for n, runs in figs.items()}
        peers = [n for n in figs if n not in OURS and n not in REFERENCE and n not in MAPPED
                 and n not in HF]
        ratios: dict[str, Any] = {}
        for ours in [n for n in OURS if n in figs]:
            per = {}
            for ref in peers + [r for r in REFERENCE if r in figs] + (
                    ["aioswap"] if ours != "aioswap" and "aioswap" in figs else []):
                per[ref] = statistics.median(
                    a["gbps"] / b["gbps"] for a, b in zip(figs[ours], figs[ref]))
            if peers:
                per["best_peer"] = statistics.median(
                    figs[ours][i]["gbps"] / max(figs[q][i]["gbps"] for q in peers)
                    for i in range(args.repeat))
            ratios[ours] = per
        if mode == "half" and all(n in figs for n in
                                  ("aioswap", "aioswap-direct", "aioswap-buffered")):
            ratios.setdefault("aioswap", {})["better_of_direct_buffered"] = statistics.median(
                figs["aioswap"][i]["gbps"] / max(figs["aioswap-direct"][i]["gbps"],
                                                 figs["aioswap-buffered"][i]["gbps"])
                for i in range(args.repeat))
        if all(n in figs for n in HF):
            ratios["hf-aioswap"] = {"hf-stock": statistics.median(
                a["gbps"] / b["gbps"] for a, b in zip(figs["hf-aioswap"], figs["hf-stock"]))}
        doc["modes"][mode] = {"loaders": table, "ratios": ratios}
    if args.json:
        print(json.dumps(doc, indent=1, sort_keys=True))
        return 0
    print(f"state dict of {format_size(nbytes)}, {args.repeat} rounds, loaders interleaved; "
          f"each load a fresh process, every page touched")
    if hf_info:
        print(f"from_pretrained (hf-*): Llama of {format_size(hf_info['bytes'])} bf16, "
              f"{hf_info['layers']} layers, {hf_info['shards']} shards; logits equal to "
              f"stock: {hf_info.get('logits_equal', '-')}")
    for mode in modes:
        t = doc["modes"][mode]["loaders"]
        rows = [[n, f"{v['gbps']:.2f} [{v['gbps_min']:.2f}-{v['gbps_max']:.2f}]",
                 f"{v['cpu_s_per_gb']:.2f}", f"{v['peak_rss'] / 1e9:.2f}"]
                for n, v in sorted(t.items(), key=lambda kv: -kv[1]["gbps"])]
        print(f"\n{mode}:")
        print_table(["loader", "GB/s", "CPU s/GB", "peak RSS GB (+load)"], rows)
        for ours, per in doc["modes"][mode]["ratios"].items():
            print(f"{ours}: " + ", ".join(f"{k} {v:.2f}x" for k, v in per.items()))
    if skipped:
        print(f"not installed, left out: {', '.join(skipped)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
