"""Hugging Face disk offload: stock accelerate loader against aioswap's.

A random Llama is built here (``LlamaConfig`` -> ``from_config`` -> ``save_pretrained`` in
``--shards`` shards under ``--dir``), then loaded with ``device_map={"": "disk"}`` so that
every weight is read from its checkpoint shard on every forward. Each measurement runs in a
child process of its own (a fresh interpreter: its ``/proc/<pid>/io`` and peak RSS are the
method's alone); the rounds alternate which method goes first. Per round and method:

* **cold**: a one-token forward, then an 8-token ``generate``, each after the model's files
  were dropped from the page cache (``aioswap.tune.drop_cache`` on each);
* **second**: the forward right after the cold one, nothing dropped or added (stock finds
  its files in the page cache its cold forward filled; aioswap's direct reads fill none);
* **warm**: a forward with every model file in the page cache (read once before it);
* **memory limit**: the child runs in a cgroup v1 memory group (``memory.limit_in_bytes``
  = what the child holds before its first forward + ``--mem-headroom`` x the model; below
  the model size at real sizes) and times ``--limited-forwards`` forwards after a drop; the
  figure is the median of those after the first (stock's page cache thrashes), then an
  8-token ``generate`` after another drop. Needs root
  and ``/sys/fs/cgroup/memory``; skipped with the reason printed otherwise;
* bytes read from storage per forward (the child's ``/proc/self/io`` ``read_bytes``) and the
  child's peak RSS from its first forward on (``VmHWM`` reset through ``/proc/self/clear_refs``
  after ``from_pretrained``; ``ru_maxrss`` where that fails).

Each round also measures the drive (the model's shard files, page cache dropped, read whole
with ``O_DIRECT`` through an ``AioHandle``, queued deep) and the compute alone (a child that
holds every weight in memory). The **overlap bound** of a forward that reads its weights is
max(compute, bytes it reads / drive speed); the report gives time against it beside time
against stock. Then, in this process: the time of
``accelerate.utils.offload_state_dict`` for the model's state dict (stock ``np.memmap`` files
against aioswap's writes after ``install()``; both followed by ``os.sync()``), and the
construction of the loader for ``--keys`` keys (half in a CPU state dict, half offloaded, as
``device_map="auto"`` makes it).

Default sizes are tiny (a smoke test, one round); the issue's sizes:
``--hidden 2048 --layers 12 --shards 4 --vocab 32000`` (about 1.3 GB in bf16; 5 rounds by
default at that size). Times are seconds (medians of the rounds); a ratio is stock time /
aioswap time, so above 1 means aioswap is faster. The targets table compares with the
issue's goals.

Needs transformers and accelerate; uses aioswap's public API only.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import logging
import math
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

import torch
from _common import dir_arg, orders, print_table, ratio, summarize
from _common import drop_cache as drop_file_cache

import aioswap
import aioswap.integrations.accelerate as ia

METHODS = ["stock", "aioswap"]
CGROUP_V1 = "/sys/fs/cgroup/memory"
CHILD_TIMEOUT = 3600
SMALL_MODEL = 64 * 10**6       # below this, one round by default (a smoke test)


# -- the child: one method, one process -------------------------------------------------------
def _proc_io(field: str = "read_bytes") -> int:
    """Bytes this process has caused to be read from (``read_bytes``) or written to
    (``write_bytes``) storage, all threads; -1: unknown."""
    try:
        with open("/proc/self/io", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return -1


def _status(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes; -1: unknown."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return -1


def _drop_all(files: list[str]) -> float:
    """Evict the model's files from the page cache (``aioswap.tune.drop_cache``: fsync, then
    ``posix_fadvise(DONTNEED)``); return the largest fraction of a file still resident.

    Only the model's files: a global ``drop_caches`` would also evict Python's and torch's
    own code, whose reloading would then be timed as part of the forward."""
    return max((drop_file_cache(path) for path in files), default=0.0)


def _cache_all(files: list[str]) -> None:
    """Read every model file once (buffered), so that it is in the page cache."""
    for path in files:
        with open(path, "rb", buffering=0) as f:
            while f.read(16 << 20):
                pass


def _reset_peak_rss() -> bool:
    """Start ``VmHWM`` again from the current RSS (``clear_refs`` 5, Linux 4.0+)."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5\n")
        return True
    except OSError:
        return False


def _timed_forward(model: Any, ids: torch.Tensor) -> tuple[float, float]:
    r0 = _proc_io()
    t0 = time.perf_counter()
    model(ids)
    return time.perf_counter() - t0, float(_proc_io() - r0)


def _timed_generate(model: Any, ids: torch.Tensor, tokens: int) -> float:
    t0 = time.perf_counter()
    model.generate(ids, max_new_tokens=tokens, do_sample=False, min_new_tokens=tokens)
    return time.perf_counter() - t0


def _loaders_of(model: Any) -> list[Any]:
    """The weights maps (loaders) of the model's accelerate hooks, each once."""
    found: dict[int, Any] = {}
    for m in model.modules():
        hook = getattr(m, "_hf_hook", None)
        for h in getattr(hook, "hooks", [hook]):
            wm = getattr(h, "weights_map", None)
            wm = getattr(wm, "dataset", wm)             # a PrefixedDataset's mapping
            if isinstance(wm, ia.AioswapWeightsLoader):
                found[id(wm)] = wm
    return list(found.values())


def compute_child(spec: dict[str, Any]) -> dict[str, float]:
    """The model's compute alone: a 1-token forward and a ``generate`` with every weight in
    memory (``from_pretrained`` without a device map), after one untimed forward; medians of
    three."""
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(spec["path"])
    ids = torch.tensor([[1]])
    with torch.no_grad():
        model(ids)
        forwards = sorted(_timed_forward(model, ids)[0] for _ in range(3))
        gens = sorted(_timed_generate(model, ids, spec["new_tokens"]) for _ in range(3))
    return {"compute_forward_s": forwards[1], "compute_generate_s": gens[1]}


def child(spec: dict[str, Any]) -> dict[str, float]:
    """One method's measurements (in a process of their own)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    logging.getLogger("accelerate").setLevel(logging.ERROR)
    if spec["method"] == "compute":
        return compute_child(spec)
    if spec["method"] == "aioswap":
        ia.install()
    files: list[str] = spec["files"]
    model = AutoModelForCausalLM.from_pretrained(spec["path"], device_map={"": "disk"},
                                                 offload_folder=spec["offload"])
    ids = torch.tensor([[1]])
    out: dict[str, float] = {}
    with torch.no_grad():
        _drop_all(files)
        out["rss_before_forward"] = float(_status("VmRSS"))
        reset = _reset_peak_rss()
        if spec["limited"]:
            times, reads = [], []
            for _ in range(spec["forwards"]):
                t, r = _timed_forward(model, ids)
                times.append(t)
                reads.append(r)
            steady = times[1:] or times
            out["limited_forward_s"] = sorted(steady)[len(steady) // 2]
            out["limited_forward_read_bytes"] = sorted(reads[1:] or reads)[len(steady) // 2]
            out["limited_first_forward_s"] = times[0]
            _drop_all(files)
            out["limited_generate_s"] = _timed_generate(model, ids, spec["new_tokens"])
        else:
            out["cold_forward_s"], out["cold_forward_read_bytes"] = _timed_forward(model, ids)
            out["second_forward_s"], out["second_forward_read_bytes"] = \
                _timed_forward(model, ids)
            _cache_all(files)
            out["warm_forward_s"], out["warm_forward_read_bytes"] = _timed_forward(model, ids)
            _drop_all(files)
            out["cold_generate_s"] = _timed_generate(model, ids, spec["new_tokens"])
        if spec["method"] == "aioswap":         # which way its loaders read (1: page cache)
            ways = {loader.through_page_cache for loader in _loaders_of(model)}
            out["through_page_cache"] = float(ways == {True})
    # the peak of the forwards, not of from_pretrained (the same for both methods)
    ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024     # kB on Linux
    out["peak_rss_bytes"] = float(_status("VmHWM") if reset else ru)
    del model
    ia.uninstall()
    return out


# -- the parent --------------------------------------------------------------------------------
class MemoryGroup:
    """A cgroup v1 memory group for one child: made under this process's own memory group
    (so the limits above it still hold), removed afterwards."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.path = os.path.join(_own_memory_group(), f"aioswap-bench-{os.getpid()}")
        os.mkdir(self.path)
        try:
            with open(os.path.join(self.path, "memory.limit_in_bytes"), "w",
                      encoding="ascii") as f:
                f.write(f"{limit}\n")
        except OSError:
            os.rmdir(self.path)
            raise

    def enter(self) -> None:
        """Put the calling process in the group (runs in the child, before exec)."""
        with open(os.path.join(self.path, "cgroup.procs"), "w", encoding="ascii") as f:
            f.write(f"{os.getpid()}\n")

    def failcnt(self) -> int:
        with open(os.path.join(self.path, "memory.failcnt"), encoding="ascii") as f:
            return int(f.read())

    def remove(self) -> None:
        for _ in range(50):          # the exited child's charges go with it; rmdir may race
            try:
                os.rmdir(self.path)
                return
            except FileNotFoundError:
                return
            except OSError:
                time.sleep(0.1)
        os.rmdir(self.path)


def _own_memory_group() -> str:
    rel = "/"
    with open("/proc/self/cgroup", encoding="ascii") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                rel = path
    return os.path.join(CGROUP_V1, rel.lstrip("/"))


def cgroup_unavailable() -> str | None:
    """Why the memory-limit case cannot run here, or None."""
    if os.geteuid() != 0:
        return "not root (a cgroup v1 memory group needs root)"
    if not os.path.isfile(os.path.join(CGROUP_V1, "memory.limit_in_bytes")):
        return f"no cgroup v1 memory controller at {CGROUP_V1}"
    if not os.access(_own_memory_group(), os.W_OK):
        return f"{_own_memory_group()} is not writable"
    return None


def run_child(spec: dict[str, Any], group: MemoryGroup | None = None) -> dict[str, float]:
    """Run :func:`child` in a fresh interpreter (in ``group`` when given); its figures, or
    NaN for each when it died (the cgroup's OOM killer, say)."""
    cmd = [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, timeout=CHILD_TIMEOUT,
                          check=False, preexec_fn=None if group is None else group.enter)
    if done.returncode != 0:
        print(f"bench_hf_offload: {spec['method']} child exited with {done.returncode}"
              + (" (killed: over its memory limit?)" if done.returncode < 0 else ""),
              file=sys.stderr)
        return {"failed": 1.0}
    return {k: float(v) for k, v in json.loads(done.stdout.strip().splitlines()[-1]).items()}


def build_model(directory: str, args: argparse.Namespace) -> tuple[str, int, int, int]:
    """Save a random Llama; return its folder, its bytes, the bytes of one layer and the
    bytes a forward reads (all but the embedding table, of which it reads a row)."""
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
    layer = sum(p.numel() * p.element_size() for p in model.model.layers[0].parameters())
    embed = model.model.embed_tokens.weight
    path = os.path.join(directory, "model")
    model.save_pretrained(path, max_shard_size=max(1, nbytes // args.shards + 1))
    return path, nbytes, layer, nbytes - embed.numel() * embed.element_size()


def drive_read_gbs(files: list[str]) -> float:
    """GB/s of the drive on the model's own bytes: every shard file dropped from the page
    cache, then read whole with ``O_DIRECT`` through one :class:`aioswap.AioHandle` (the
    engine cuts each read into pieces queued deep), one file after the other."""
    shards = [f for f in files if f.endswith(".safetensors")]
    for path in shards:
        drop_file_cache(path)
    size = max(os.path.getsize(f) for f in shards)
    total = 0
    with aioswap.AioHandle() as h:
        try:
            buf = h.new_cpu_locked_tensor(size, torch.uint8)
            locked = True
        except (OSError, aioswap.AioswapError):      # a normal user's memlock limit
            buf, locked = torch.empty(size, dtype=torch.uint8), False
        buf.fill_(0)                                  # every page faulted in before timing
        try:
            t0 = time.perf_counter()
            for path in shards:
                with h.open(path, "r") as f:
                    n = f.size()
                    total += h.pread(buf[:n], f, 0)
            dt = time.perf_counter() - t0
        finally:
            if locked:
                h.free_cpu_locked_tensor(buf)
            del buf
    return total / dt / 1e9


def write_round(method: str, path: str, work: str) -> tuple[float, int]:
    """Seconds of ``offload_state_dict`` of the model, data synced (``os.sync``), and the
    bytes this process caused to be written to storage meanwhile."""
    import accelerate.utils
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path)
    sd = model.state_dict()
    out = tempfile.mkdtemp(prefix="write-", dir=work)
    if method == "aioswap":
        ia.install()
    try:
        os.sync()
        w0 = _proc_io("write_bytes")
        t0 = time.perf_counter()
        accelerate.utils.offload_state_dict(out, sd)
        os.sync()
        return time.perf_counter() - t0, _proc_io("write_bytes") - w0
    finally:
        ia.uninstall()
        shutil.rmtree(out, ignore_errors=True)


_SYNCS = ("fsync", "fdatasync", "msync", "sync_file_range")


def sync_calls(method: str, path: str, work: str) -> dict[str, int] | None:
    """The system calls that make data durable, counted with ``strace -f -c`` over one
    untimed ``offload_state_dict`` of the model in a child; None without strace."""
    strace = shutil.which("strace")
    if strace is None:
        return None
    with tempfile.NamedTemporaryFile(dir=work, prefix="strace-") as log:
        cmd = [strace, "-f", "-c", "-o", log.name, "-e", "trace=" + ",".join(_SYNCS),
               sys.executable, os.path.abspath(__file__), "--write-child",
               json.dumps({"method": method, "path": path, "work": work})]
        done = subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                              text=True, timeout=CHILD_TIMEOUT, check=False)
        if done.returncode != 0:
            return None
        counts = {name: 0 for name in _SYNCS}
        for line in open(log.name, encoding="utf-8", errors="replace"):
            cols = line.split()
            if cols and cols[-1] in counts and len(cols) >= 5:
                counts[cols[-1]] = int(cols[3])
        return counts


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
    p.add_argument("--dir", type=dir_arg, default=".",
                   help="directory for the model (default: .)")
    p.add_argument("--hidden", type=int, default=128, help="hidden size (default: 128)")
    p.add_argument("--layers", type=int, default=2, help="decoder layers (default: 2)")
    p.add_argument("--vocab", type=int, default=1024, help="vocabulary (default: 1024)")
    p.add_argument("--shards", type=int, default=4, help="checkpoint shards (default: 4)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    p.add_argument("--new-tokens", type=int, default=8, help="generate length (default: 8)")
    p.add_argument("--keys", type=int, default=20000,
                   help="keys for the loader construction figure (default: 20000)")
    p.add_argument("--repeat", type=int, default=None,
                   help="rounds (default: 5, or 1 for a model under 64 MB)")
    p.add_argument("--mem-headroom", type=float, default=0.5,
                   help="memory limit above what a child holds before its first forward, "
                        "as a fraction of the model (default: 0.5)")
    p.add_argument("--limited-forwards", type=int, default=3,
                   help="forwards per child under the memory limit (default: 3)")
    p.add_argument("--no-limit", action="store_true", help="skip the memory-limit case")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--child", help=argparse.SUPPRESS)
    p.add_argument("--write-child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    out = sys.stdout
    if args.write_child is not None:
        spec = json.loads(args.write_child)
        with contextlib.redirect_stdout(sys.stderr):
            write_round(spec["method"], spec["path"], spec["work"])
        return 0
    if args.child is not None:
        with contextlib.redirect_stdout(sys.stderr):
            figures = child(json.loads(args.child))
        print(json.dumps(figures), file=out)
        return 0
    if args.repeat is not None and args.repeat < 1:
        p.error(f"--repeat must be at least 1, got {args.repeat}")
    if args.limited_forwards < 1:
        p.error(f"--limited-forwards must be at least 1, got {args.limited_forwards}")
    # what libraries print to stdout (DeepSpeed's accelerator probe, which transformers
    # reaches where DeepSpeed is installed, logs there) goes to stderr; the figures to stdout
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

    no_limit = "--no-limit given" if args.no_limit else cgroup_unavailable()
    work = tempfile.mkdtemp(prefix=".aioswap-hf-", dir=os.path.abspath(args.dir))
    rounds: dict[str, dict[str, list[float]]] = {m: {} for m in [*METHODS, "compute"]}
    limits: list[int] = []
    failcnt = {m: 0 for m in METHODS}
    try:
        path, nbytes, layer_bytes, forward_bytes = build_model(work, args)
        repeat = args.repeat or (1 if nbytes < SMALL_MODEL else 5)
        files = sorted(os.path.join(path, f) for f in os.listdir(path))

        def spec(method: str, limited: bool) -> dict[str, Any]:
            return {"method": method, "path": path, "files": files, "limited": limited,
                    "offload": tempfile.mkdtemp(prefix="offload-", dir=work),
                    "new_tokens": args.new_tokens, "forwards": args.limited_forwards}

        drives: list[float] = []
        for order in orders(METHODS, repeat):           # who goes first alternates
            drives.append(drive_read_gbs(files))
            for k, v in run_child(spec("compute", False)).items():
                rounds["compute"].setdefault(k, []).append(v)
            for method in order:
                for k, v in run_child(spec(method, False)).items():
                    rounds[method].setdefault(k, []).append(v)
            if no_limit is not None:
                continue
            base = max(max(rounds[m].get("rss_before_forward", [0.0])) for m in METHODS)
            limit = int(base + args.mem_headroom * nbytes)
            limits.append(limit)
            for method in order:
                group = MemoryGroup(limit)
                try:
                    got = run_child(spec(method, True), group)
                    failcnt[method] += group.failcnt()
                finally:
                    group.remove()
                for k, v in got.items():
                    rounds[method].setdefault("limited_" + k if k in (
                        "peak_rss_bytes", "failed", "rss_before_forward",
                        "through_page_cache") else k, []).append(v)
        left = _drop_all(files)
        writes: dict[str, list[float]] = {m: [] for m in METHODS}
        written: dict[str, list[float]] = {m: [] for m in METHODS}
        for order in orders(METHODS, repeat):
            for method in order:
                seconds, nwritten = write_round(method, path, work)
                writes[method].append(seconds)
                written[method].append(nwritten)
        syncs = {m: sync_calls(m, path, work) for m in METHODS}
        build = construction(args.keys)
    finally:
        shutil.rmtree(work, ignore_errors=True)

    figures = {m: {k: summarize(v) for k, v in rounds[m].items()} for m in rounds}
    for m in METHODS:
        figures[m]["offload_state_dict_s"] = summarize(writes[m])
        figures[m]["offload_state_dict_written_bytes"] = summarize(written[m])

    def med(m: str, k: str) -> float:
        s = figures[m].get(k)
        return math.nan if s is None else s.median

    ratios = {k: ratio(med("stock", k), med("aioswap", k))
              for k in ("cold_forward_s", "cold_generate_s", "warm_forward_s")}
    extra = {k: ratio(med("stock", k), med("aioswap", k))
             for k in ("second_forward_s", "limited_forward_s", "limited_generate_s",
                       "offload_state_dict_s")}
    cold_read_gbs = {m: med(m, "cold_forward_read_bytes") / med(m, "cold_forward_s") / 1e9
                     for m in METHODS}
    drive = summarize(drives).median
    # The overlap bound: a forward that reads its weights from the drive cannot take less
    # than the longer of its compute (weights in memory) and its bytes / the drive's speed.
    read_s = forward_bytes / (drive * 1e9)
    bound = {"forward_s": max(med("compute", "compute_forward_s"), read_s),
             # the first token's forward reads everything, the others compute
             "generate_s": max(med("compute", "compute_forward_s"), read_s)
             + med("compute", "compute_generate_s") - med("compute", "compute_forward_s")}
    vs_bound = {m: {"cold_forward": bound["forward_s"] / med(m, "cold_forward_s"),
                    "limited_forward": bound["forward_s"] / med(m, "limited_forward_s"),
                    "cold_generate": bound["generate_s"] / med(m, "cold_generate_s")}
                for m in METHODS}

    def over(k: str) -> float:
        return (med("aioswap", k) - med("stock", k)) / layer_bytes

    targets = {
        "cold_forward_vs_bound": {"value": vs_bound["aioswap"]["cold_forward"],
                                  "target": 0.95},
        "limited_forward_vs_bound": {"value": vs_bound["aioswap"]["limited_forward"],
                                     "target": 0.9},
        "limited_peak_rss_over_stock_layers": {"value": over("limited_peak_rss_bytes"),
                                               "target": 2.0, "at_most": True},
        "peak_rss_over_stock_layers": {"value": over("peak_rss_bytes"), "target": 2.0,
                                       "at_most": True},
        "cold_generate_vs_stock": {"value": ratios["cold_generate_s"], "target": 1.2},
        "second_forward_vs_stock": {"value": extra["second_forward_s"], "target": 1.0},
        "warm_forward_vs_stock": {"value": ratios["warm_forward_s"], "target": 1.0},
    }
    for t in targets.values():
        v, goal = float(t["value"]), float(t["target"])
        t["met"] = bool(math.isfinite(v) and (v <= goal if t.get("at_most") else v >= goal))
    report: dict[str, Any] = {
        "model": {"hidden": args.hidden, "layers": args.layers, "vocab": args.vocab,
                  "dtype": args.dtype, "shards": args.shards, "bytes": nbytes,
                  "layer_bytes": layer_bytes},
        "versions": {"transformers": transformers.__version__,
                     "accelerate": _version("accelerate"), "torch": torch.__version__},
        "rounds": repeat, "resident_after_drop": left,
        "shard_files": sum(f.endswith(".safetensors") for f in files),
        "memory_limit": {"skipped": no_limit, "limit_bytes": max(limits, default=0),
                         "headroom": args.mem_headroom, "forwards": args.limited_forwards,
                         "failcnt": failcnt},
        "drive_read_gbs": drive, "drive_read_gbs_rounds": drives,
        "forward_read_bytes": forward_bytes,
        "overlap_bound_s": bound,
        "ratios_bound_over_time": vs_bound,
        "figures": {m: {k: s.to_json_dict() for k, s in f.items()} for m, f in figures.items()},
        "ratios_stock_over_aioswap_time": ratios,
        "more_ratios_stock_over_aioswap_time": extra,
        "cold_forward_read_gbs": cold_read_gbs,
        "targets": targets,
        # 1: every aioswap child read through the page cache, 0: direct (median over rounds)
        "aioswap_through_page_cache": {
            case: (figures["aioswap"][k].median if k in figures["aioswap"] else math.nan)
            for case, k in (("unlimited", "through_page_cache"),
                            ("under the memory limit", "limited_through_page_cache"))},
        "offload_state_dict_sync_calls": syncs,
        "loader_construction_s": {"keys": args.keys, **build,
                                  "ratio": ratio(build["stock"], build["aioswap"])},
    }
    return report


def print_report(report: dict[str, Any], args: argparse.Namespace, out: Any) -> None:
    figures = {m: {k: summarize(v["all"]) for k, v in f.items()}
               for m, f in report["figures"].items()}
    build = report["loader_construction_s"]
    nbytes = report["model"]["bytes"]
    lim = report["memory_limit"]

    def row(label: str, k: str, scale: float = 1.0, with_ratio: bool = True) -> list[Any]:
        s, a = (figures[m].get(k) for m in METHODS)
        sv = math.nan if s is None else s.median / scale
        av = math.nan if a is None else a.median / scale
        return [label, sv, av, ratio(sv, av) if with_ratio else math.nan]

    bound = report["overlap_bound_s"]
    vs = report["ratios_bound_over_time"]
    compute = figures["compute"]
    rows = [row("cold 1-token forward s", "cold_forward_s"),
            ["  bound / time", vs["stock"]["cold_forward"], vs["aioswap"]["cold_forward"],
             math.nan],
            row("  MB read", "cold_forward_read_bytes", 1e6, False),
            row("second forward (after cold) s", "second_forward_s"),
            row("  MB read", "second_forward_read_bytes", 1e6, False),
            row("warm forward (files cached) s", "warm_forward_s"),
            row("  MB read", "warm_forward_read_bytes", 1e6, False),
            row(f"cold {args.new_tokens}-token generate s", "cold_generate_s"),
            row("peak RSS MB", "peak_rss_bytes", 1e6, False)]
    if lim["skipped"] is None:
        rows += [row("forward under memory limit s", "limited_forward_s"),
                 ["  bound / time", vs["stock"]["limited_forward"],
                  vs["aioswap"]["limited_forward"], math.nan],
                 row("  MB read", "limited_forward_read_bytes", 1e6, False),
                 row("  peak RSS MB", "limited_peak_rss_bytes", 1e6, False),
                 row(f"{args.new_tokens}-token generate under the limit s",
                     "limited_generate_s")]
    rows += [row("offload_state_dict (write) s", "offload_state_dict_s"),
             row("  MB written", "offload_state_dict_written_bytes", 1e6, False),
             [f"loader for {args.keys} keys s", build["stock"], build["aioswap"],
              build["ratio"]]]
    notes = ["page cache dropped before cold runs: each model file with "
             "aioswap.tune.drop_cache (posix_fadvise DONTNEED); at most "
             f"{report['resident_after_drop']:.0%} of a file left resident",
             "times in seconds; the ratio is stock time / aioswap time",
             f"drive: the model's shard files read O_DIRECT (page cache dropped) at "
             f"{report['drive_read_gbs']:.2f} GB/s (median of the rounds)",
             f"compute with the weights in memory: forward "
             f"{compute['compute_forward_s'].median:.3f} s, {args.new_tokens}-token generate "
             f"{compute['compute_generate_s'].median:.3f} s",
             f"overlap bound (max of compute and {report['forward_read_bytes'] / 1e6:.0f} MB "
             f"a forward reads / the drive): forward {bound['forward_s']:.3f} s, generate "
             f"{bound['generate_s']:.3f} s; 'bound / time' rows: 1.0 is the bound"]
    syncs = report["offload_state_dict_sync_calls"]
    if all(syncs.values()):
        notes.append("offload_state_dict syncs (strace -c): " + "; ".join(
            f"{m} " + ", ".join(f"{n} {k}" for k, n in c.items() if n)
            for m, c in syncs.items()))
    ways = report.get("aioswap_through_page_cache", {})
    notes.append("aioswap read " + "; ".join(
        f"{case}: {'through the page cache' if v == 1 else 'direct' if v == 0 else 'both ways'}"
        for case, v in ways.items() if math.isfinite(v)))
    if lim["skipped"] is None:
        notes.append(f"memory limit {lim['limit_bytes'] / 1e6:.0f} MB (model "
                     f"{nbytes / 1e6:.0f} MB); limit hits stock {lim['failcnt']['stock']}, "
                     f"aioswap {lim['failcnt']['aioswap']}")
    else:
        notes.append(f"memory-limit case skipped: {lim['skipped']}")
    print_table(["figure", "stock", "aioswap", "stock/aioswap"], rows,
                title=[f"random Llama {args.layers} layers x hidden {args.hidden}, "
                       f"{args.dtype}, {nbytes / 1e6:.1f} MB in "
                       f"{report['shard_files']} shards, "
                       f"all on disk; median of {report['rounds']} rounds, one child "
                       f"process per method and round"],
                notes=notes, file=out)
    print(file=out)
    print_table(["target", "value", "goal", "met"],
                [[k, t["value"], ("<= " if t.get("at_most") else ">= ") + str(t["target"]),
                  "yes" if t["met"] else "NO"] for k, t in report["targets"].items()],
                title=["the issue's targets (ratios; peak RSS in layers above stock)"],
                file=out)


def _version(dist: str) -> str:
    from importlib.metadata import version
    return version(dist)


if __name__ == "__main__":
    sys.exit(main())
