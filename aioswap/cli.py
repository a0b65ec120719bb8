"""The ``aioswap`` command: ``info``, ``bench`` and ``tune``.

Exit status: 0 on success, 2 for bad input (missing or unwritable directory, a size of 0, a
file system without ``O_DIRECT``), 1 for failures while measuring.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import re
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from aioswap import _aio
from aioswap.errors import DirectIOUnsupportedError

__all__ = ["drop_cache", "format_size", "main", "parse_size"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


class UsageError(Exception):
    """Bad input: reported with exit status 2."""


def parse_size(text: str) -> int:
    """Parse ``"1G"``, ``"400M"``, ``"64K"``, ``"4096"`` (powers of 1024) into bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(?:i?B)?\s*", str(text), re.IGNORECASE)
    if m is None:
        raise argparse.ArgumentTypeError(
            f"invalid size {text!r}: use a number with an optional K, M, G or T suffix "
            f"(powers of 1024), e.g. 64M or 1G")
    value = int(float(m.group(1)) * _UNITS[m.group(2).upper()])
    if value <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive, got {text!r}")
    return value


def format_size(n: int) -> str:
    """``1073741824`` → ``"1 GiB"``; binary units, as the sizes are parsed."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            v = n / scale
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.2f} {unit}"
    return f"{n} B"


# ------------------------------------------------------------------------------- info


def _cap_ipc_lock() -> bool:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> 14 & 1)
    except OSError:
        pass
    return False


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            return int(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None


def _fs_type(path: str) -> str | None:
    best, fstype = "", None
    real = os.path.realpath(path)
    try:
        with open("/proc/self/mounts") as f:
            for line in f:
                parts = line.split()
                mnt = parts[1].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, parts[2]
    except OSError:
        pass
    return fstype


def _check_dir(path: str) -> str:
    if not os.path.exists(path):
        raise UsageError(f"directory {path!r} does not exist")
    if not os.path.isdir(path):
        raise UsageError(f"{path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"directory {path!r} is not writable")
    return os.path.abspath(path)


def _probe_direct(directory: str) -> dict[str, Any]:
    """Create a scratch file in ``directory``: O_DIRECT support and DIO alignment."""
    fd, probe = tempfile.mkstemp(prefix=".aioswap-probe-", dir=directory)
    os.close(fd)
    try:
        try:
            dfd = _aio.open_direct(probe, write=True)
        except DirectIOUnsupportedError as exc:
            return {"o_direct": False, "reason": str(exc)}
        try:
            mem, off = _aio.dio_alignment(dfd)
        finally:
            os.close(dfd)
        return {"o_direct": True, "dio_mem_align": mem, "dio_offset_align": off}
    finally:
        os.unlink(probe)


def gather_info(directory: str) -> dict[str, Any]:
    """What this machine supports, as a JSON-able dict."""
    ok, reason = _aio.aio_available()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    usage = shutil.disk_usage(directory)
    info: dict[str, Any] = {
        "aioswap": __import__("aioswap").__version__,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "aio": {"available": ok, "reason": reason or None,
                "aio_nr": _read_int("/proc/sys/fs/aio-nr"),
                "aio_max_nr": _read_int("/proc/sys/fs/aio-max-nr")},
        "directory": {"path": directory, "fs_type": _fs_type(directory),
                      "free_bytes": usage.free, "total_bytes": usage.total,
                      **_probe_direct(directory)},
        "memlock": {"rlimit_soft": None if soft == resource.RLIM_INFINITY else soft,
                    "rlimit_hard": None if hard == resource.RLIM_INFINITY else hard,
                    "unlimited": soft == resource.RLIM_INFINITY,
                    "cap_ipc_lock": _cap_ipc_lock()},
        "cufile": _cufile_info(),
        "gpu": _gpu_info(),
    }
    return info


def _cufile_info() -> dict[str, Any]:
    try:
        from aioswap import _cufile
        ok, reason = _cufile.available()
        out: dict[str, Any] = {"available": ok, "reason": reason or None}
        if ok:
            out["library"] = _cufile.library_path()
            out["version"] = _cufile.version()
            mode = getattr(_cufile, "mode", None)
            if callable(mode):
                out["mode"] = mode()
        return out
    except Exception as exc:   # info must report, not crash
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}


def _gpu_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": None, "cuda": False}
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if out["cuda"]:
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def _print_info(info: dict[str, Any]) -> None:
    d, m, a = info["directory"], info["memlock"], info["aio"]
    lines = [
        f"aioswap {info['aioswap']}  (Linux {info['kernel']}, Python {info['python']})",
        f"kernel AIO       : {'yes' if a['available'] else 'NO: ' + str(a['reason'])}"
        f"  (fs.aio-nr {a['aio_nr']} of {a['aio_max_nr']})",
        f"directory        : {d['path']} ({d['fs_type']}), "
        f"{format_size(d['free_bytes'])} free of {format_size(d['total_bytes'])}",
    ]
    if d["o_direct"]:
        lines.append(f"O_DIRECT         : yes, memory alignment {d['dio_mem_align']} B, "
                     f"offset alignment {d['dio_offset_align']} B")
    else:
        lines.append(f"O_DIRECT         : NO ({d['reason']}); aioswap uses buffered I/O here")
    lim = "unlimited" if m["unlimited"] else format_size(m["rlimit_soft"] or 0)
    lines.append(f"RLIMIT_MEMLOCK   : {lim}; CAP_IPC_LOCK: {'yes' if m['cap_ipc_lock'] else 'no'}")
    c = info["cufile"]
    lines.append("cuFile           : " + (f"yes, {c.get('library')} version {c.get('version')}"
                                          if c["available"] else f"no ({c['reason']})"))
    g = info["gpu"]
    lines.append("GPU              : " + (", ".join(g["devices"]) if g.get("cuda")
                                          else f"none (torch {g['torch']})"))
    print("\n".join(lines))


def cmd_info(args: argparse.Namespace) -> int:
    directory = _check_dir(args.dir)
    info = gather_info(directory)
    if args.json:
        print(json.dumps(info, indent=2))
    else:
        _print_info(info)
    return 0


# ------------------------------------------------------------------------------ bench


@contextlib.contextmanager
def _scratch(directory: str, stem: str) -> Iterator[str]:
    path = os.path.join(directory, f".aioswap-{stem}-{os.getpid()}.bin")
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


_CACHE_NOTE = "page cache dropped with fsync + posix_fadvise(DONTNEED) before each read"


def drop_cache(path: str) -> None:
    """fsync ``path`` and evict its pages, so the next read comes from the disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_bench(directory: str, size: int, *, block_size: int, queue_depth: int,
              progress: bool) -> dict[str, Any]:
    """Measure aioswap direct and bounce against buffered Python I/O on ``size`` bytes."""
    import torch
    from tqdm import tqdm  # type: ignore[import-untyped]

    from aioswap import pinned
    from aioswap.handle import AioHandle

    probe = _probe_direct(directory)
    if not probe["o_direct"]:
        raise UsageError(f"the file system of {directory!r} refuses O_DIRECT ({probe['reason']});"
                         f" aioswap would use buffered I/O there, so there is nothing to compare")
    usage = shutil.disk_usage(directory)
    if usage.free < size + (64 << 20):
        raise UsageError(f"{directory!r} has {format_size(usage.free)} free; the benchmark "
                         f"needs {format_size(size)} plus 64 MiB")

    steps = ["fill", "direct write", "direct read", "bounce write", "bounce read",
             "buffered write", "buffered read"]
    bar = tqdm(total=len(steps), desc="aioswap bench", unit="step", disable=not progress,
               file=sys.stderr)
    results: dict[str, dict[str, float]] = {}

    def step(name: str) -> None:
        bar.set_postfix_str(name)

    try:
        step("fill")
        src = pinned.empty(size, torch.uint8, strict=False)
        gen = torch.Generator().manual_seed(1234)
        src.copy_(torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen))
        plain = src.clone()                         # unpinned: the bounce path
        bar.update()
        with AioHandle(block_size=block_size, queue_depth=queue_depth) as h, \
                _scratch(directory, "bench") as path:
            for label, buf in (("direct", src), ("bounce", plain)):
                step(f"{label} write")
                w = _timed(lambda: h.pwrite(buf, path, fsync=True))
                bar.update()
                step(f"{label} read")
                drop_cache(path)
                dst = torch.empty_like(buf) if label == "bounce" else pinned.empty(
                    size, torch.uint8, strict=False)
                r = _timed(lambda: h.pread(dst, path))
                if not torch.equal(dst, src):
                    raise RuntimeError(f"{label} read returned different bytes")
                del dst
                bar.update()
                os.unlink(path)
                results[label] = {"write_s": w, "read_s": r}
            stats = h.stats
            aligned = size - size % probe["dio_offset_align"]   # the rest is head/tail
            if stats.direct_bytes < 2 * aligned or stats.bounce_bytes < 2 * aligned:
                raise RuntimeError(f"paths not taken as planned: {stats}")
            step("buffered write")
            mv = memoryview(plain.numpy())  # type: ignore[arg-type]

            def buffered_write() -> None:
                with open(path, "wb") as f:
                    f.write(mv)
                    f.flush()
                    os.fsync(f.fileno())
            w = _timed(buffered_write)
            bar.update()
            step("buffered read")
            drop_cache(path)
            out = bytearray(size)

            def buffered_read() -> None:
                with open(path, "rb", buffering=0) as f:
                    f.readinto(out)
            r = _timed(buffered_read)
            if bytes(out[:4096]) != bytes(mv[:4096]) or out != mv:
                raise RuntimeError("buffered read returned different bytes")
            results["buffered"] = {"write_s": w, "read_s": r}
            bar.update()
    finally:
        bar.close()

    gib = size / (1 << 30)
    rows = []
    base = results["buffered"]
    for label in ("direct", "bounce", "buffered"):
        res = results[label]
        rows.append({
            "method": {"direct": "aioswap direct (pinned)", "bounce": "aioswap bounce (unpinned)",
                       "buffered": "python buffered"}[label],
            "write_GiBps": gib / res["write_s"], "read_GiBps": gib / res["read_s"],
            "write_vs_buffered": base["write_s"] / res["write_s"],
            "read_vs_buffered": base["read_s"] / res["read_s"],
        })
    return {"directory": directory, "size_bytes": size, "size": format_size(size),
            "block_size": block_size, "queue_depth": queue_depth, "cache": _CACHE_NOTE,
            "writes": "each write ends with fsync", "rows": rows}


def _print_bench(res: dict[str, Any]) -> None:
    print(f"aioswap bench: {res['size']} in {res['directory']}, block size "
          f"{format_size(res['block_size'])}, queue depth {res['queue_depth']}")
    print(f"({res['writes']}; {res['cache']}; GiB/s = 2^30 bytes per second)\n")
    print(f"{'method':<28}{'write GiB/s':>12}{'read GiB/s':>12}{'write ×':>10}{'read ×':>10}")
    for row in res["rows"]:
        print(f"{row['method']:<28}{row['write_GiBps']:>12.2f}{row['read_GiBps']:>12.2f}"
              f"{row['write_vs_buffered']:>10.2f}{row['read_vs_buffered']:>10.2f}")
    print("\n× = speed relative to python buffered I/O in this run")


def cmd_bench(args: argparse.Namespace) -> int:
    directory = _check_dir(args.dir)
    res = run_bench(directory, args.size, block_size=args.block_size,
                    queue_depth=args.queue_depth, progress=not args.no_progress)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        _print_bench(res)
    return 0


# ------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="aioswap", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="command", required=True)

    pi = sub.add_parser("info", help="what this machine supports")
    pi.add_argument("dir", nargs="?", default=".", help="directory to probe (default .)")
    pi.add_argument("--json", action="store_true", help="print JSON")
    pi.set_defaults(func=cmd_info)

    pb = sub.add_parser("bench", help="aioswap direct/bounce against buffered I/O")
    pb.add_argument("--dir", default=".", help="directory for the scratch file (default .)")
    pb.add_argument("--size", type=parse_size, default=1 << 30,
                    help="bytes to move, K/M/G suffixes are powers of 1024 (default 1G)")
    pb.add_argument("--block-size", type=parse_size, default=1 << 20)
    pb.add_argument("--queue-depth", type=int, default=32)
    pb.add_argument("--json", action="store_true", help="print JSON")
    pb.add_argument("--no-progress", action="store_true", help="no progress bar")
    pb.set_defaults(func=cmd_bench)

    _add_tune(sub)
    return p


def _add_tune(sub: Any) -> None:
    pt = sub.add_parser("tune", help="sweep the knobs and print the best 'aio' section")
    pt.add_argument("--dir", action="append", required=True,
                    help="directory to measure in (repeat for several drives)")
    pt.add_argument("--io-size", type=parse_size, default=400 << 20,
                    help="bytes per measurement (default 400M)")
    direction = pt.add_mutually_exclusive_group()
    direction.add_argument("--no-read", action="store_true", help="measure writes only")
    direction.add_argument("--no-write", action="store_true", help="measure reads only")
    pt.add_argument("--gds", action="store_true", help="tune the cuFile (GDS) path")
    pt.add_argument("--search", choices=("fast", "grid"), default="fast",
                    help="fast: coordinate search from the defaults; grid: every point")
    pt.add_argument("--log-dir", default=None, help="keep one log per sweep point here")
    pt.add_argument("--output", default=None, help="write the best 'aio' section (JSON) here")
    pt.add_argument("--plot", default=None, help="draw throughput over the sweep (PNG)")
    pt.add_argument("--json", action="store_true", help="print results as JSON")
    pt.add_argument("--no-progress", action="store_true", help="no progress bar")
    pt.set_defaults(func=cmd_tune)


def cmd_tune(args: argparse.Namespace) -> int:
    from aioswap import tune
    dirs = [_check_dir(d) for d in args.dir]
    for d in dirs:
        probe = _probe_direct(d)
        if not probe["o_direct"]:
            raise UsageError(f"the file system of {d!r} refuses O_DIRECT ({probe['reason']})")
    for what, target in (("--output", args.output), ("--plot", args.plot)):
        if target is not None and not os.path.isdir(os.path.dirname(os.path.abspath(target))):
            raise UsageError(f"{what} {target!r}: its directory does not exist")
    if args.log_dir is not None and os.path.exists(args.log_dir) \
            and not os.path.isdir(args.log_dir):
        raise UsageError(f"--log-dir {args.log_dir!r} exists and is not a directory")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            raise UsageError("--plot needs matplotlib: pip install 'aioswap[plot]'") from None
    direction: tune.Direction = ("write" if args.no_read else
                                 "read" if args.no_write else "both")
    return tune.main_from_cli(dirs=dirs, io_size=args.io_size, direction=direction,
                              use_gds=args.gds, search=args.search, log_dir=args.log_dir,
                              output=args.output, plot=args.plot, as_json=args.json,
                              progress=not args.no_progress)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.func(args))
    except UsageError as exc:
        print(f"aioswap {args.command}: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"aioswap {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
