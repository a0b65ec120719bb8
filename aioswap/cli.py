"""The aioswap command: info, bench and tune.

  aioswap info  [--dir DIR] [--json]      what this machine and DIR's drive support
  aioswap bench [--dir DIR] [--size 1G]   aioswap against buffered I/O, median of rounds
  aioswap tune  --dir DIR [--plot F.png]  sweep the "aio" knobs, print the best section

Exit status: 0 on success (bench also when some methods were skipped, as it says), 2 for
input or an environment that cannot work (bad sizes or knobs, a missing, unwritable or
non-file-creating directory, no O_DIRECT, no torch, not enough memory or disk, a full disk,
an output that cannot be written: a full device or a closed pipe), 1 when a sweep measured
nothing, 130 when interrupted, 128 + N for signal N (SIGTERM, SIGHUP). Scratch files are
removed on every exit but SIGKILL; the next run in that directory removes what a killed one
left, and says so.
Units: GB/s = 10^9 bytes per second; sizes take K/M/G/T as powers of 1024; a ratio is
aioswap / other, so bigger is better.
"""
from __future__ import annotations

import argparse
import contextlib
import errno
import json
import math
import os
import platform
import re
import resource
import shutil
import signal
import statistics
import sys
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, NoReturn

from aioswap import _info
from aioswap import _scratch as _tmpfiles
from aioswap._units import GB, UNITS_NOTE, format_size, parse_size, short_size
from aioswap.config import DEFAULT_CONFIG, AioConfig, default_config, runtime_settings
from aioswap.errors import ConfigError, DirectIOUnsupportedError, TuneError
from aioswap.tune.measure import cap_ipc_lock, memory_available
from aioswap.tune.measure import drop_cache

if TYPE_CHECKING:
    from aioswap import tune as tune_mod

# The tools' units, public for the benchmark scripts (benchmarks/_common.py): one parser and
# formatter of sizes, one GB/s.
__all__ = ["GB", "UNITS_NOTE", "format_size", "main", "parse_size", "short_size"]

#: bench refuses smaller sizes: the timings would be noise (and 0.00 GB/s at two decimals).
MIN_BENCH_SIZE = 1 << 20
_SLACK = 64 << 20   # memory and disk kept free beyond what the buffers and files need
_TORCH_HINT = ("pip install torch (the CPU build is enough: pip install torch --index-url "
               "https://download.pytorch.org/whl/cpu)")


class UsageError(Exception):
    """Bad input or an environment that cannot work: one line on stderr, exit status 2."""


class OutputError(Exception):
    """The command's own output (stdout) could not be written: a full device, a closed pipe.
    Not the disk being measured, so not its hints: one line on stderr, exit status 2."""

    def __init__(self, exc: OSError) -> None:
        what = os.strerror(exc.errno) if exc.errno else str(exc)
        if exc.errno == errno.EPIPE:
            what = "the reader closed the pipe before it was all written (broken pipe)"
        super().__init__(what)


def _emit(out: IO[str], text: str) -> None:
    """Write ``text`` to the command's output and flush it, or raise :class:`OutputError`."""
    try:
        out.write(text)
        out.flush()
    except OSError as exc:
        raise OutputError(exc) from exc


def _quiet_stdout() -> None:
    """Point stdout at /dev/null, so that the interpreter's flush at exit does not fail again
    on what is still buffered for the output that failed."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: ``aioswap bench: error: ... (see aioswap bench -h)``."""

    def error(self, message: str) -> NoReturn:
        # "argument --size: --size must be positive": a message that names its flag itself
        # stands alone
        m = re.fullmatch(r"argument (\S+): (\1 .*)", message, re.DOTALL)
        if m is not None:
            message = m.group(2)
        self.exit(2, f"{self.prog}: error: {message} (see '{self.prog} --help')\n")


#: The options that take a size; ``--size -5M`` is joined to ``--size=-5M`` before parsing
#: (argparse takes "-5M" for an option and says "expected one argument").
_SIZE_OPTIONS = ("--size", "--io-size", "--block-size")


def _join_negative_sizes(argv: Sequence[str]) -> list[str]:
    """``--size -5M`` as ``--size=-5M``, so that the size's own check answers it."""
    out: list[str] = []
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return out + list(argv[i:])
        if (arg in _SIZE_OPTIONS and i + 1 < len(argv)
                and re.match(r"-[\d.]", argv[i + 1]) is not None):
            out.append(f"{arg}={argv[i + 1]}")
            i += 2
            continue
        out.append(arg)
        i += 1
    return out


def _size_type(minimum: int = 1, flag: str = "size") -> Callable[[str], int]:
    def size(text: str) -> int:
        if text.strip().startswith("-"):
            try:
                parse_size(text.strip()[1:], minimum=0)
            except ValueError:
                pass            # not a size at all: parse_size below says so
            else:
                raise argparse.ArgumentTypeError(f"{flag} must be positive, got {text.strip()}")
        if text.strip()[-2:].upper() in ("KB", "MB", "GB", "TB"):
            # the tables' GB is 10^9 while sizes count in 1024s: refuse the ambiguous spelling
            unit = text.strip()[-2].upper()
            raise argparse.ArgumentTypeError(
                f"{text!r} is ambiguous: sizes count in powers of 1024, so write "
                f"{text.strip()[:-1]} or {text.strip()[:-1]}iB ({unit} = 1024^"
                f"{'KMGT'.index(unit) + 1} bytes), or the number of bytes")
        try:
            return parse_size(text, minimum=minimum)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return size


def _int_type(minimum: int) -> Callable[[str], int]:
    def integer(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value
    return integer


# ------------------------------------------------------------------------------ probes


_RAM_FS = ("tmpfs", "ramfs")


def _ram_warning(path: str, fs_type: str | None) -> str | None:
    real = os.path.realpath(path)
    if fs_type in _RAM_FS or real == "/dev/shm" or real.startswith("/dev/shm/"):
        return (f"{path} is on {fs_type or 'a RAM file system'}: the figures measure memory, "
                f"not a drive (use --dir on the drive to measure)")
    return None


def _check_dir(path: str, flag: str = "--dir") -> str:
    if not os.path.exists(path):
        raise UsageError(f"directory {path!r} does not exist")
    if not os.path.isdir(path):
        raise UsageError(f"{flag} {path!r} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise UsageError(f"directory {path!r} is not writable")
    return os.path.abspath(path)


#: What the tools name their scratch files: ``.aioswap-<stem>-<pid>-<random>.bin``.
_STEMS = ("bench", "stripe", "probe", "tune")


def _remove_stale(directory: str, name: str, err: IO[str]) -> None:
    """Remove the scratch files a killed run (its process is gone) left in ``directory``, and
    say so: a SIGKILLed bench leaves its whole --size behind."""
    from aioswap.stripe import LAYOUT_SUFFIX
    for stem in _STEMS:
        for suffix in (".bin", ".bin" + LAYOUT_SUFFIX) if stem == "stripe" else (".bin",):
            for stale in _tmpfiles.remove_stale(directory, f".aioswap-{stem}-", suffix):
                err.write(f"{name}: removed a stale scratch file {stale.path} left by an "
                          f"interrupted run (pid {stale.pid})\n")


@contextlib.contextmanager
def _scratch(directory: str, stem: str) -> Iterator[str]:
    """A fresh file in ``directory``: unique name with our pid, O_EXCL (never a planted file or
    symlink), mode 0600, removed afterwards (SIGTERM/SIGHUP included, see main, which names
    one that could not be removed; :func:`_remove_stale` removes those a killed run left)."""
    try:
        fd, path = _tmpfiles.create(directory, f".aioswap-{stem}-", ".bin")
    except OSError as e:
        raise UsageError(f"cannot create a file in {directory} "
                         f"({os.strerror(e.errno or errno.EIO)}): it must be a writable "
                         f"directory on a file system that holds files (e.g. on the drive to "
                         f"measure)") from None
    os.close(fd)
    try:
        yield path
    finally:
        _tmpfiles.remove(path)


def _probe_direct(directory: str) -> dict[str, Any]:
    """O_DIRECT support and DIO alignment of ``directory``, from a scratch file."""
    from aioswap import _aio
    with _scratch(directory, "probe") as probe:
        try:
            dfd = _aio.open_direct(probe, write=True)
        except DirectIOUnsupportedError:
            fs = _info.fs_type(directory) or "file"
            return {"o_direct": False, "reason": f"the {fs} file system refuses O_DIRECT"}
        try:
            mem, off = _aio.dio_alignment(dfd)
        finally:
            os.close(dfd)
        return {"o_direct": True, "dio_mem_align": mem, "dio_offset_align": off}


def gather_info(directory: str) -> dict[str, Any]:
    """What this machine supports, as a JSON-able dict."""
    from aioswap import __version__, _aio
    ok, reason = _aio.aio_available()
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    usage = shutil.disk_usage(directory)
    fs = _info.fs_type(directory)
    return {
        "aioswap": __version__,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "aio": {"available": ok, "reason": reason or None,
                "aio_nr": _info.read_int("/proc/sys/fs/aio-nr"),
                "aio_max_nr": _info.read_int("/proc/sys/fs/aio-max-nr")},
        "backend": _info.backend_info(),
        "directory": {"path": directory, "fs_type": fs,
                      "free_bytes": usage.free, "total_bytes": usage.total,
                      "warning": _ram_warning(directory, fs), **_probe_direct(directory)},
        "device": _info.block_device(directory),
        "memlock": {"rlimit_soft": None if soft == resource.RLIM_INFINITY else soft,
                    "rlimit_hard": None if hard == resource.RLIM_INFINITY else hard,
                    "unlimited": soft == resource.RLIM_INFINITY,
                    "cap_ipc_lock": cap_ipc_lock()},
        "cufile": _info.cufile_info(),
        "gpu": _info.gpu_info(),
    }


def _root_info(directory: str) -> dict[str, Any]:
    """One root of several: its file system, free space, O_DIRECT and block device."""
    usage = shutil.disk_usage(directory)
    dev = os.stat(directory).st_dev
    return {"path": directory, "fs_type": _info.fs_type(directory), "free_bytes": usage.free,
            "st_dev": f"{os.major(dev)}:{os.minor(dev)}",
            "o_direct": bool(_probe_direct(directory).get("o_direct")),
            "device": _info.block_device(directory)}


def cmd_info(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    if args.dir_pos is not None and args.dir is not None and args.dir_pos not in args.dir:
        raise UsageError(f"two directories given ({args.dir_pos!r} and --dir "
                         f"{args.dir[0]!r}); give them all with --dir")
    dirs = list(dict.fromkeys(args.dir or [args.dir_pos or "."]))
    dirs = [_check_dir(d) for d in dirs]
    for d in dirs:
        _remove_stale(d, "aioswap info", err)
    info = gather_info(dirs[0])
    if len(dirs) > 1:
        info["roots"] = [_root_info(d) for d in dirs]
        info["roots_sharing_a_device"] = _info.shared_devices(info["roots"])
    _emit(out, (json.dumps(info, indent=2) if args.json else _info.format_info(info)) + "\n")
    return 0


# ------------------------------------------------------------------------------ bench


def _need_torch(command: str) -> Any:
    try:
        import torch
    except ImportError:
        raise UsageError(f"{command} needs torch: {_TORCH_HINT}") from None
    return torch


def _check_memory(need: int, what: str) -> None:
    avail, why = memory_available()
    if avail is not None and need > avail:
        raise UsageError(f"{what} needs about {format_size(need)} of memory; "
                         f"{format_size(max(avail, 0))} is available ({why}): use a smaller "
                         f"--size")


def _memlock_reason() -> str:
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    lim = "unlimited" if soft == resource.RLIM_INFINITY else format_size(soft)
    return (f"page-locked memory refused (RLIMIT_MEMLOCK {lim}, "
            f"CAP_IPC_LOCK {'yes' if cap_ipc_lock() else 'no'}; raise it with ulimit -l "
            f"unlimited or docker --ulimit memlock=-1)")


def _bar_width(stream: IO[str]) -> dict[str, Any]:
    """tqdm's width: follow the terminal, or 80 columns where it reports none (a bare pty)."""
    try:
        cols = os.get_terminal_size(stream.fileno()).columns
    except (OSError, ValueError):
        cols = 0
    return {"dynamic_ncols": True} if cols > 0 else {"ncols": 80}


class _Progress:
    """A tqdm bar over bytes on stderr, drawn only on a terminal."""

    def __init__(self, total: int, desc: str, enabled: bool, stream: IO[str]) -> None:
        self.bar: Any = None
        if enabled and stream.isatty():
            from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
            self.bar = tqdm(total=total, desc=desc, unit="B", unit_scale=True,
                            unit_divisor=1000, file=stream, leave=False, **_bar_width(stream))

    def step(self, nbytes: int, label: str) -> None:
        if self.bar is not None:
            self.bar.set_postfix_str(label, refresh=False)
            self.bar.update(nbytes)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()


@dataclass
class _Method:
    key: str
    label: str
    write: Callable[[str], None]
    read: Callable[[str], None]
    check: Callable[[], bool]
    times: dict[str, list[float]] = field(default_factory=lambda: {"write": [], "read": []})


def _summary(size: int, seconds: list[float]) -> dict[str, Any] | None:
    if not seconds:
        return None
    rates = [size / s / GB for s in seconds if s > 0] or [math.inf]
    med = statistics.median(rates)
    return {"GBps": med, "min": min(rates), "max": max(rates),
            "spread": (max(rates) - min(rates)) / med if med else math.nan, "all": rates}


def run_bench(directory: str, size: int, *, config: AioConfig, repeat: int, warmup: int,
              ops: Sequence[str], gds: bool, progress: bool,
              err: IO[str], backends: Sequence[str | None] = (None,)) -> dict[str, Any]:
    """Measure aioswap direct / bounce (and GDS) against buffered Python I/O on ``size`` bytes.

    Each round runs every method once, in an order rotated by one per round; a method writes
    (fsync'd), drops the file from the page cache, reads, and checks the bytes. Figures are the
    median of the rounds with their range. Several ``backends`` give the aioswap rows once
    per engine backend (named in the row), side by side in the same rounds.
    """
    torch = _need_torch("bench")
    from aioswap import pinned
    from aioswap.errors import AioswapWarning, PinnedMemoryError, PinnedMemoryWarning
    from aioswap.handle import AioHandle

    probe = _probe_direct(directory)
    if not probe["o_direct"]:
        raise UsageError(f"{probe['reason']} in {directory}; aioswap would use buffered I/O "
                         f"there, so there is nothing to compare")
    usage = shutil.disk_usage(directory)
    if usage.free < size + _SLACK:
        raise UsageError(f"{directory} has {format_size(usage.free)} free; the benchmark "
                         f"needs {format_size(size)} plus 64 MiB")
    # source (reference) + one unpinned read buffer + one pinned buffer (+ a GPU buffer)
    _check_memory(3 * size + _SLACK, f"aioswap bench --size {short_size(size)}")
    notes: list[str] = []
    skipped: list[dict[str, str]] = []
    ram = _ram_warning(directory, _info.fs_type(directory))
    if ram:
        notes.append(ram)
        err.write(f"aioswap bench: warning: {ram}\n")

    gen = torch.Generator().manual_seed(1234)
    ref = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen)
    plain = torch.empty_like(ref)     # unpinned: the bounce path, and buffered reads
    try:
        locked = pinned.empty(size, torch.uint8, strict=True)
    except (PinnedMemoryError, OSError, MemoryError):
        locked = None
        skipped.append({"method": "aioswap direct (pinned)", "reason": _memlock_reason()})
    gpu = None
    if gds:
        if not torch.cuda.is_available():
            raise UsageError(f"--gds needs a CUDA device; torch {torch.__version__} sees none")
        gpu = ref.to("cuda")

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", AioswapWarning)
        handles: list[tuple[str, Any]] = []
        try:
            for name in backends:
                h = AioHandle.from_config(config, backend=name)
                handles.append((f" [{h.backend}]" if len(backends) > 1 else "", h))
        except BaseException:
            for _, h in handles:
                h.close()
            raise
        handle = handles[0][1]
        gds_handle: Any = None
        if gds:
            from aioswap.gds import GdsHandle
            try:
                gds_handle = GdsHandle.from_config(config)
            except Exception as exc:
                for _, h in handles:
                    h.close()
                raise UsageError(f"--gds needs cuFile: {_info.short_reason(str(exc))}") from None
        try:
            with _scratch(directory, "bench") as path:
                methods = _bench_methods(torch, handles, gds_handle, ref, plain, locked, gpu,
                                         size)
                result = _bench_rounds(methods, path, size, repeat, warmup, ops, progress, err)
                stats = handle.stats
        finally:
            for _, h in handles:
                h.close()
            if gds_handle is not None:
                gds_handle.close()
    for w in caught:
        if issubclass(w.category, AioswapWarning):
            first = str(w.message).split(". ")[0].rstrip(".")
            if issubclass(w.category, PinnedMemoryWarning):
                # one line already ("aioswap: 64 MiB not page-locked (...); I/O works, ...")
                first = f"the handle's bounce buffers: {str(w.message).removeprefix('aioswap: ')}"
            if first not in notes:
                notes.append(first)
    aligned = size - size % probe["dio_offset_align"]
    direct = getattr(stats, "direct_bytes", None)
    if locked is not None and direct is not None:
        n_ops = len(ops) * (repeat + warmup) + (1 if ops == ["read"] else 0)
        if direct < n_ops * aligned:
            notes.append(f"aioswap direct moved {direct} of {n_ops * aligned} aligned bytes on "
                         f"the direct path ({stats})")
    base = {op: _summary(size, result["buffered"]["times"][op]) for op in ("write", "read")}
    rows = []
    for m in methods:
        row: dict[str, Any] = {"method": m.label}
        for op in ("write", "read"):
            s, b = _summary(size, m.times[op]), base[op]
            row[op] = s
            row[f"{op}_ratio"] = (None if m.key == "buffered" or s is None or b is None
                                  else s["GBps"] / b["GBps"])
        rows.append(row)
    return {"directory": directory, "fs_type": _info.fs_type(directory), "size_bytes": size,
            "size": format_size(size), "config": config.to_dict(),
            "backends": [h.backend for _, h in handles], "repeat": repeat,
            "warmup": warmup, "ops": list(ops),
            "units": "GB/s = 10^9 bytes/s, median of the rounds (min-max); "
                     "ratio = aioswap / python buffered (bigger is better)",
            "writes": "each write ends with fsync",
            "cache": "page cache dropped (fsync + posix_fadvise DONTNEED) before each read",
            "rows": rows, "skipped": skipped, "notes": notes}


def run_bench_drives(dirs: Sequence[str], size: int, *, config: AioConfig, repeat: int,
                     warmup: int, ops: Sequence[str], progress: bool,
                     err: IO[str]) -> dict[str, Any]:
    """The drives together: ``size`` bytes from page-locked memory, (a) one file per drive,
    ``size / N`` each, all at once (each drive on its own handle: the sum of the drives), and
    (b) one file striped over the drives (``h.open([...])``, :mod:`aioswap.stripe`). Every
    write makes its files anew (truncated, then written and fsynced). Median of the rounds,
    methods alternating; ratio = striped / all at once."""
    torch = _need_torch("bench")
    from aioswap import pinned
    from aioswap.handle import AioHandle
    from aioswap.stripe import LAYOUT_SUFFIX, default_stripe

    n = len(dirs)
    _check_memory(2 * size + _SLACK, f"aioswap bench --size {short_size(size)}")
    per = -(-size // n // 4096) * 4096
    total = per * n
    gen = torch.Generator().manual_seed(4321)
    ref = torch.randint(0, 256, (total,), dtype=torch.uint8, generator=gen)
    buf = pinned.empty(total, torch.uint8, strict=False)
    handles = [AioHandle.from_config(config) for _ in dirs]
    striped = handles[0]
    try:
        with contextlib.ExitStack() as stack:
            paths = [stack.enter_context(_scratch(d, "bench")) for d in dirs]
            parts = [stack.enter_context(_scratch(d, "stripe")) for d in dirs]
            for p in parts:         # open_striped makes them (and their layouts) itself
                os.unlink(p)
            for p in parts:
                stack.callback(_unlink_quiet, p + LAYOUT_SUFFIX)

            def each(write: bool) -> None:
                if write:           # new files, as the striped one is (w+)
                    for p in paths:
                        os.truncate(p, 0)
                futs = [(h.pwrite(buf[i * per:(i + 1) * per], p, fsync=True, async_op=True)
                         if write else h.pread(buf[i * per:(i + 1) * per], p, async_op=True))
                        for i, (h, p) in enumerate(zip(handles, paths))]
                for f in futs:
                    f.result()

            def stripe(write: bool) -> None:
                with striped.open(list(parts), "w+" if write else "r") as f:
                    if write:
                        f.pwrite(buf, 0, fsync=True)
                    else:
                        f.pread(buf, 0)

            def check() -> bool:
                ok = bool(torch.equal(buf, ref))
                buf.copy_(ref)
                return ok

            def drop() -> None:
                for p in paths + parts:
                    if os.path.exists(p):
                        drop_cache(p)
                buf.zero_()

            methods = [
                _Method("each", f"aioswap, {n} drives at once (one file each)",
                        lambda _: each(True), lambda _: each(False), check),
                _Method("striped", f"aioswap, one file striped over the {n} drives",
                        lambda _: stripe(True), lambda _: stripe(False), check),
            ]
            buf.copy_(ref)
            if ops == ["read"]:
                stripe(True)            # _bench_rounds writes the first method's files
            _bench_rounds(methods, paths[0], total, repeat, warmup, ops, progress, err,
                          drop=drop, desc="aioswap bench (drives together)")
    finally:
        for h in handles:
            h.close()
    rows = []
    for m in methods:
        row: dict[str, Any] = {"method": m.label}
        for op in ops:
            row[op] = _summary(total, m.times[op])
        rows.append(row)
    ratio = {op: (rows[1][op]["GBps"] / rows[0][op]["GBps"]) for op in ops}
    return {"directories": list(dirs), "size_bytes": total, "size": format_size(total),
            "stripe_unit": default_stripe(striped), "rows": rows,
            "ratio_striped_vs_at_once": ratio, "repeat": repeat, "warmup": warmup,
            "ops": list(ops)}


def _unlink_quiet(path: str) -> None:
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _format_drives(res: dict[str, Any]) -> str:
    ops = res["ops"]
    lines = [f"drives together: {res['size']} over {len(res['directories'])} directories "
             f"({', '.join(res['directories'])}); stripe unit "
             f"{format_size(res['stripe_unit'])}; ratio = striped / all at once", ""]
    width = max(len(r["method"]) for r in res["rows"]) + 2
    head = f"{'method':<{width}}" + "".join(
        f"{op + ' GB/s':>12}{'(min-max)':>15}" for op in ops)
    lines.append(head)
    for row in res["rows"]:
        lines.append(f"{row['method']:<{width}}" + "".join(_rate_cells(row[op]) for op in ops))
    lines.append("striped / at once: " + ", ".join(
        f"{op} {res['ratio_striped_vs_at_once'][op]:.2f}" for op in ops))
    return "\n".join(lines)


def _bench_methods(torch: Any, handles: list[tuple[str, Any]], gds_handle: Any, ref: Any,
                   plain: Any, locked: Any, gpu: Any, size: int) -> list[_Method]:
    methods: list[_Method] = []
    for tag, handle in handles:
        methods.extend(_aioswap_methods(torch, tag, handle, ref, plain, locked))
    if gds_handle is not None:
        methods.append(_Method("gds", "aioswap gds (cuFile)",
                               lambda p: gds_handle.pwrite(gpu, p, fsync=True),
                               lambda p: gds_handle.pread(gpu, p),
                               lambda: bool(torch.equal(gpu.cpu(), ref))))
    src = memoryview(ref.numpy()).cast("B")
    dst = memoryview(plain.numpy()).cast("B")

    def b_write(path: str) -> None:
        with open(path, "wb") as f:
            f.write(src)
            f.flush()
            os.fsync(f.fileno())

    def b_read(path: str) -> None:
        with open(path, "rb", buffering=0) as f:
            done = 0
            while done < size:   # read(2) may return less than asked
                n = f.readinto(dst[done:])
                if not n:
                    raise OSError(errno.EIO, f"{path}: unexpected end of file")
                done += n
    methods.append(_Method("buffered", "python buffered", b_write, b_read,
                           lambda: bool(torch.equal(plain, ref))))
    return methods


def _aioswap_methods(torch: Any, tag: str, handle: Any, ref: Any, plain: Any,
                     locked: Any) -> list[_Method]:
    """The direct (pinned) and bounce (unpinned) rows of one handle; ``tag`` names its
    backend when several are compared."""
    methods: list[_Method] = []
    if locked is not None:
        def d_write(path: str) -> None:
            locked.copy_(ref)
            handle.pwrite(locked, path, fsync=True)

        def d_read(path: str) -> None:
            locked.zero_()
            handle.pread(locked, path)
        methods.append(_Method("direct" + tag, "aioswap direct (pinned)" + tag, d_write,
                               d_read, lambda: bool(torch.equal(locked, ref))))
    methods.append(_Method("bounce" + tag, "aioswap bounce (unpinned)" + tag,
                           lambda p: handle.pwrite(ref, p, fsync=True),
                           lambda p: handle.pread(plain, p),
                           lambda: bool(torch.equal(plain, ref))))
    return methods


def _bench_rounds(methods: list[_Method], path: str, size: int, repeat: int, warmup: int,
                  ops: Sequence[str], progress: bool, err: IO[str],
                  drop: Callable[[], None] | None = None,
                  desc: str = "aioswap bench") -> dict[str, Any]:
    """Every method once per round, in an order rotated by one per round; before each read
    ``drop()`` (default: ``path`` out of the page cache), off the clock."""
    per_round = len(methods) * len(ops) * size
    bar = _Progress(per_round * (repeat + warmup), desc, progress, err)
    try:
        if ops == ["read"]:
            methods[0].write(path)      # read-only: the file is written once, untimed
        for rnd in range(warmup + repeat):
            k = rnd % len(methods)
            for m in methods[k:] + methods[:k]:
                for op in ops:
                    if op == "read":
                        if drop is None:
                            drop_cache(path)
                        else:
                            drop()
                    t0 = time.perf_counter()
                    (m.write if op == "write" else m.read)(path)
                    dt = time.perf_counter() - t0
                    if rnd >= warmup:
                        m.times[op].append(dt)
                    bar.step(size, f"{m.key} {op}")
                if "read" in ops and not m.check():
                    raise RuntimeError(f"{m.label} read back different bytes")
    finally:
        bar.close()
    return {m.key: {"times": m.times} for m in methods}


def _rate_cells(s: dict[str, Any]) -> str:
    """A figure's median GB/s and its (min-max) range, as bench's tables show them."""
    return f"{s['GBps']:>12.2f}{'(%.2f-%.2f)' % (s['min'], s['max']):>15}"


def _format_bench(res: dict[str, Any]) -> str:
    c = res["config"]
    lines = [
        f"aioswap bench: {res['size']} in {res['directory']} ({res['fs_type']}), "
        f"block size {format_size(c['block_size'])}, queue depth {c['queue_depth']}, "
        f"parallelism {c['intra_op_parallelism']}"
        + (", single submit" if c["single_submit"] else "")
        + ("" if c["overlap_events"] else ", no overlap"),
        f"{res['repeat']} round(s) after {res['warmup']} warm-up, methods alternating; "
        f"{res['writes']}; {res['cache']}",
        "GB/s = 10^9 bytes/s, median of the rounds (min-max in brackets); "
        "ratio = aioswap / python buffered (bigger is better)",
        "",
    ]
    ops = res["ops"]
    width = max([28] + [len(row["method"]) + 2 for row in res["rows"]])
    head = f"{'method':<{width}}"
    for op in ops:
        head += f"{op + ' GB/s':>12}{'(min-max)':>15}"
    for op in ops:
        head += f"{op + ' ratio':>12}"
    lines.append(head)
    for row in res["rows"]:
        line = f"{row['method']:<{width}}" + "".join(_rate_cells(row[op]) for op in ops)
        for op in ops:
            r = row[f"{op}_ratio"]
            line += f"{'-' if r is None else f'{r:.2f}':>12}"
        lines.append(line)
    for s in res["skipped"]:
        lines.append(f"skipped {s['method']}: {s['reason']}")
    for n in res["notes"]:
        lines.append(f"note: {n}")
    return "\n".join(lines)


def cmd_bench(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    dirs = [_check_dir(d) for d in (args.dir or ["."])]
    if len({os.path.realpath(d) for d in dirs}) != len(dirs):
        raise UsageError(f"--dir names a directory twice: {', '.join(dirs)}")
    for d in dirs:
        _remove_stale(d, "aioswap bench", err)
    config = _config_from_args(args)
    ops = ["write", "read"]
    if args.read_only:
        ops = ["read"]
    elif args.write_only:
        ops = ["write"]
    results = [run_bench(d, args.size, config=config, repeat=args.repeat, warmup=args.warmup,
                         ops=ops, gds=args.gds, progress=not args.no_progress, err=err,
                         backends=_backends_from_args(args, True)) for d in dirs]
    if len(dirs) == 1:
        _emit(out, (json.dumps(results[0], indent=2) if args.json
                    else _format_bench(results[0])) + "\n")
        return 0
    together = run_bench_drives(dirs, args.size, config=config, repeat=args.repeat,
                                warmup=args.warmup, ops=ops, progress=not args.no_progress,
                                err=err)
    if args.json:
        _emit(out, json.dumps({"drives": results, "together": together}, indent=2) + "\n")
    else:
        blocks = [_format_bench(r) for r in results] + [_format_drives(together)]
        _emit(out, "\n\n".join(blocks) + "\n")
    return 0


def _config_from_args(args: argparse.Namespace) -> AioConfig:
    """The knobs: the flags given, else the AIOSWAP_* variables, else the defaults."""
    changes: dict[str, Any] = {}
    for key, value in (("block_size", args.block_size), ("queue_depth", args.queue_depth),
                       ("intra_op_parallelism", args.parallelism)):
        if value is not None:
            changes[key] = value
    if args.single_submit:
        changes["single_submit"] = True
    if args.no_overlap:
        changes["overlap_events"] = False
    try:
        return default_config().replace(**changes)
    except ConfigError as e:
        msg = str(e).replace("invalid aio config: ", "")
        for key, flag in (("block_size", "--block-size"), ("queue_depth", "--queue-depth"),
                          ("intra_op_parallelism", "--parallelism")):
            if key in changes:
                msg = msg.replace(key, flag)
        raise UsageError(msg) from None


# ------------------------------------------------------------------------------- tune

_DISK_FULL = re.compile(rf"\[Errno ({errno.ENOSPC}|{errno.EFBIG}|{errno.EDQUOT})\]")


def run_tune(*, dirs: Sequence[str], io_size: int, direction: tune_mod.Direction,
             use_gds: bool = False, search: tune_mod.SearchKind = "fast", repeat: int = 3,
             quick: bool = False, log_dir: str | os.PathLike[str] | None = None,
             output: str | os.PathLike[str] | None = None,
             plot: str | os.PathLike[str] | None = None, as_json: bool = False,
             progress: bool = True, grid: tune_mod.Grid | None = None,
             measure: tune_mod.Measure | None = None, stdout: IO[str] | None = None,
             stderr: IO[str] | None = None) -> int:
    """Run ``aioswap tune`` and write what the command shows; return its exit status.

    The results table then the best ``{"aio": {...}}`` section on ``stdout`` (or one JSON
    document with ``as_json``), notes on ``stderr``. With ``log_dir``, one JSON log per point
    and direction is kept there (and its path shown); without it none is written (the results
    are all in the output). Returns 0, or 1 when no point succeeded.

    Raises
    ------
    UsageError
        Bad arguments, or measuring cannot work here (the reason, in one line).
    """
    from aioswap import tune as t
    out = sys.stdout if stdout is None else stdout
    err = sys.stderr if stderr is None else stderr
    grid = grid or t.default_grid(quick=quick)
    bar: Any = None
    if progress and err.isatty():
        from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]
        bar = tqdm(total=len(grid) if search == "grid" else None, desc=f"aioswap tune ({search})",
                   unit="pt", file=err, leave=False, **_bar_width(err))

    def on_point(point: t.SweepPoint, results: Sequence[t.Result], best: float | None) -> None:
        if bar is not None:
            bar.update(1)
            if best is not None:
                bar.set_postfix_str(f"best {best:.2f} GB/s", refresh=False)

    try:
        report = t.tune(dirs, io_size, direction=direction, use_gds=use_gds, search=search,
                        grid=grid, log_dir=log_dir, repeat=repeat, on_point=on_point,
                        measure=measure)
    except (ValueError, TuneError) as e:
        raise UsageError(str(e)) from None
    finally:
        if bar is not None:
            bar.close()
    best_json = None if report.best is None else report.best.to_json(wrap=True)
    full = _DISK_FULL.search(report.error or "") if best_json is None else None
    if full is not None:
        code = int(full.group(1))
        logs = "" if report.log_dir is None else f"; logs in {report.log_dir}"
        raise UsageError(f"{', '.join(str(d) for d in dirs)}: {os.strerror(code)} (the disk, a "
                         f"quota or ulimit -f ran out: free space or use a smaller --io-size)"
                         f"{logs}")
    drives = (_per_drive(report, dirs, io_size, direction, use_gds, repeat)
              if measure is None and len(dirs) > 1 and report.best is not None else None)
    if as_json:
        doc = report.to_json_dict()
        if drives is not None:
            doc["drives"] = drives
        _emit(out, json.dumps(doc, indent=2) + "\n")
    else:
        where = ", ".join(str(d) for d in dirs)
        text = [f"aioswap tune: {format_size(io_size)} per point and direction in {where}, "
                f"{repeat} round(s) per point (fsync'd writes, page cache dropped before "
                f"reads)", t.format_table(report.results, direction=direction)]
        if best_json is not None:
            text += [f"\nbest \"aio\" section ({report.evaluations} of {report.grid_size} "
                     f"grid points measured, picked by {t.report.picked_by(direction)}):",
                     best_json]
        if drives is not None:
            text.append("\n" + _format_per_drive(drives))
        _emit(out, "\n".join(text) + "\n")
    if report.log_dir is not None:
        err.write(f"aioswap tune: logs in {report.log_dir}\n")
    if best_json is None:
        err.write(f"aioswap tune: error: {report.error}\n")
        return 1
    if output is not None:
        Path(output).write_text(best_json + "\n", encoding="utf-8")
    if plot is not None:
        title = (f"aioswap tune: {format_size(io_size)} per point, {repeat} round(s), "
                 f"{', '.join(str(d) for d in dirs)}")
        t.plot(report.results, plot, title=title, direction=direction)
        err.write(f"aioswap tune: heat map in {plot}\n")
    return 0


def _per_drive(report: Any, dirs: Sequence[str], io_size: int,
               direction: tune_mod.Direction, use_gds: bool, repeat: int) -> dict[str, Any]:
    """The best section on each drive alone (its share of ``io_size``, as in the sweep),
    their sum, and the sweep's figure for all of them together."""
    from aioswap import tune as t
    best = report.best
    point = t.SweepPoint(block_size=best.block_size, queue_depth=best.queue_depth,
                         single_submit=best.single_submit, overlap_events=best.overlap_events,
                         intra_op_parallelism=best.intra_op_parallelism)
    ops = [op for op in ("write", "read") if direction in (op, "both")]
    from aioswap.tune.measure import split
    shares = split(io_size, len(dirs))
    rows = []
    for d, share in zip(dirs, shares):
        row: dict[str, Any] = {"directory": str(d)}
        for r in t.run_point(point, [d], share, direction, use_gds=use_gds, repeat=repeat):
            row[r.direction] = r.gbps
            if r.error is not None:
                row[f"{r.direction}_error"] = r.error
        rows.append(row)
    together: dict[str, Any] = {}
    for r in report.results:
        if r.ok and r.point == point:
            together[r.direction] = r.gbps
    total = {op: (sum(row[op] for row in rows) if all(row.get(op) for row in rows) else None)
             for op in ops}
    return {"point": best.to_dict(), "ops": ops, "each": rows, "sum": total,
            "together": together,
            "together_vs_sum": {op: (together[op] / total[op]
                                     if together.get(op) and total[op] else None)
                                for op in ops}}


def _format_per_drive(d: dict[str, Any]) -> str:
    ops = d["ops"]
    width = max([16] + [len(r["directory"]) + 2 for r in d["each"]])

    def cell(v: float | None) -> str:
        return f"{'-' if v is None else f'{v:.2f}':>12}"
    lines = ["the best section on each drive alone (its share of --io-size), their sum, and "
             "all together (the sweep):",
             f"{'':<{width}}" + "".join(f"{op + ' GB/s':>12}" for op in ops)]
    for r in d["each"]:
        lines.append(f"{r['directory']:<{width}}" + "".join(cell(r.get(op)) for op in ops))
    lines.append(f"{'sum':<{width}}" + "".join(cell(d["sum"][op]) for op in ops))
    lines.append(f"{'together':<{width}}"
                 + "".join(cell(d["together"].get(op)) for op in ops))
    lines.append(f"{'together / sum':<{width}}"
                 + "".join(cell(d["together_vs_sum"][op]) for op in ops))
    for r in d["each"]:
        for op in ops:
            if r.get(f"{op}_error"):
                lines.append(f"note: {r['directory']} {op}: {r[f'{op}_error']}")
    return "\n".join(lines)


def _check_plot_format(target: str) -> None:
    """``--plot`` needs matplotlib, and a file extension it can draw."""
    try:
        from matplotlib import backend_bases
    except ImportError:
        raise UsageError("--plot needs matplotlib: pip install 'aioswap[plot]'") from None
    kinds = sorted(backend_bases.FigureCanvasBase.get_supported_filetypes())
    ext = os.path.splitext(target)[1][1:].lower()
    if ext not in kinds:
        raise UsageError(f"--plot {target}: matplotlib cannot draw a .{ext} file; use one of "
                         f"{', '.join('.' + k for k in kinds)}")


def _check_output(flag: str, target: str, *, directory: bool = False) -> None:
    """Refuse an output path that the end of a run could not write (checked up front)."""
    path = os.path.abspath(target)
    parent = os.path.dirname(path)
    if directory:
        if os.path.exists(path) and not os.path.isdir(path):
            raise UsageError(f"{flag} {target}: exists and is not a directory")
        if os.path.isdir(path) and not os.access(path, os.W_OK | os.X_OK):
            raise UsageError(f"{flag} {target}: the directory is not writable")
    elif os.path.isdir(path):
        raise UsageError(f"{flag} {target}: is a directory; give a file name")
    if not os.path.isdir(parent):
        raise UsageError(f"{flag} {target}: its directory does not exist ({parent}); "
                         f"create it first")
    if not os.path.exists(path) and not os.access(parent, os.W_OK | os.X_OK):
        raise UsageError(f"{flag} {target}: its directory is not writable")
    if os.path.exists(path) and not directory and not os.access(path, os.W_OK):
        raise UsageError(f"{flag} {target}: the file is not writable")


def cmd_tune(args: argparse.Namespace, out: IO[str], err: IO[str]) -> int:
    dirs = [_check_dir(d) for d in args.dir]
    for d in dirs:
        _remove_stale(d, "aioswap tune", err)
        probe = _probe_direct(d)
        if not probe["o_direct"]:
            raise UsageError(f"{probe['reason']} in {d}")
        ram = _ram_warning(d, _info.fs_type(d))
        if ram:
            err.write(f"aioswap tune: warning: {ram}\n")
    # every output is checked before the sweep: a sweep takes minutes, a typo must not cost them
    if args.plot is not None and not os.path.splitext(args.plot)[1]:
        args.plot += ".png"         # what matplotlib would write; the message names it
    for what, target in (("--output", args.output), ("--plot", args.plot),
                         ("--log-dir", args.log_dir)):
        if target is not None:
            _check_output(what, target, directory=what == "--log-dir")
    if args.plot is not None:
        _check_plot_format(args.plot)
    share = -(-args.io_size // len(dirs))
    for d in dirs:
        free = shutil.disk_usage(d).free
        if free < share + _SLACK:
            raise UsageError(f"{d} has {format_size(free)} free; tune needs "
                             f"{format_size(share)} there plus 64 MiB: free space or use a "
                             f"smaller --io-size")
    direction: tune_mod.Direction = ("write" if args.no_read else
                                     "read" if args.no_write else "both")
    backend = _backends_from_args(args, False)[0]
    if backend is not None:
        # every handle of the sweep (and of its child processes) runs on it
        os.environ["AIOSWAP_BACKEND"] = backend
    return run_tune(dirs=dirs, io_size=args.io_size, direction=direction, use_gds=args.gds,
                    search=args.search, repeat=args.repeat, quick=args.quick,
                    log_dir=args.log_dir, output=args.output, plot=args.plot,
                    as_json=args.json, progress=not args.no_progress, stdout=out, stderr=err)


# ------------------------------------------------------------------------------- main


def _add_knobs(p: argparse.ArgumentParser) -> None:
    d = DEFAULT_CONFIG
    env = " or AIOSWAP_{}"
    p.add_argument("--block-size", type=_size_type(flag="--block-size"), default=None,
                   metavar="SIZE",
                   help=f"bytes per kernel request, any positive size (default "
                        f"{short_size(d.block_size)}{env.format('BLOCK_SIZE')})")
    p.add_argument("--queue-depth", type=_int_type(1), default=None, metavar="N",
                   help=f"requests in flight per AIO context (default "
                        f"{d.queue_depth}{env.format('QUEUE_DEPTH')})")
    p.add_argument("--parallelism", type=_int_type(1), default=None, metavar="N",
                   help=f"intra_op_parallelism: slices of one request moved concurrently, each "
                        f"on its own context (default 1{env.format('INTRA_OP_PARALLELISM')})")
    p.add_argument("--single-submit", action="store_true", default=None,
                   help="one request per io_submit call (single_submit=true)")
    p.add_argument("--no-overlap", action="store_true", default=None,
                   help="submit a batch and reap it whole (overlap_events=false)")
    p.add_argument("--backend", default=None, metavar="NAME",
                   help="engine backend: auto, io_uring, aio or threads (default "
                        "AIOSWAP_BACKEND, else auto); bench takes several, comma-separated, "
                        "to compare them side by side")


def _backends_from_args(args: argparse.Namespace, several: bool) -> list[str | None]:
    """The --backend names (checked), or [None]: what AIOSWAP_BACKEND or "auto" gives."""
    from aioswap import _aio
    if args.backend is None:
        return [None]
    names = [b.strip().lower() for b in args.backend.split(",") if b.strip()]
    bad = [b for b in names if b not in _aio.BACKENDS]
    if bad or not names or (len(names) > 1 and not several):
        want = "one or more of" if several else "one of"
        raise UsageError(f"--backend {args.backend!r}: expected {want} "
                         f"{', '.join(_aio.BACKENDS)}")
    for b in names:
        if b != "auto":
            ok, why = _aio.aio_available(b)
            if not ok:
                raise UsageError(f"--backend {b}: it does not work here: {why}")
    return list(dict.fromkeys(names))


def build_parser() -> argparse.ArgumentParser:
    from aioswap import __version__
    doc = __doc__ or ""
    p = _Parser(prog="aioswap", description=doc.split("\n\n")[0],
                epilog="\n\n".join(doc.split("\n\n")[1:]),
                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--version", action="version", version=f"aioswap {__version__}")
    sub = p.add_subparsers(dest="command", required=True, metavar="{info,bench,tune}",
                           parser_class=_Parser)

    pi = sub.add_parser("info", help="what this machine and a directory's drive support",
                        description="What this machine supports: kernel AIO, O_DIRECT and its "
                                    "alignment in DIR, the drive under DIR (/sys), memlock, "
                                    "cuFile and GPUs.")
    pi.add_argument("--dir", action="append", default=None,
                    help="directory to probe (default: .); give it again for every root of a "
                         "striped or multi-root setup: each root's file system and block "
                         "device are listed, and roots sharing a device are pointed out")
    pi.add_argument("dir_pos", nargs="?", default=None, metavar="DIR",
                    help="same as --dir (kept for older scripts)")
    pi.add_argument("--json", action="store_true", help="print JSON")
    pi.set_defaults(func=cmd_info, parser=pi)

    pb = sub.add_parser("bench", help="aioswap direct/bounce against buffered I/O",
                        description="Write and read one file with aioswap (direct from pinned "
                                    "memory, bounced from ordinary memory, cuFile with --gds) "
                                    "and with buffered Python I/O; median of --repeat rounds, "
                                    "methods alternating. " + UNITS_NOTE + ".")
    pb.add_argument("--dir", action="append", default=None,
                    help="directory for the scratch file (default: .); repeat it for several "
                         "drives: each is measured alone, then all together (one file per "
                         "drive at once, and one file striped over them)")
    pb.add_argument("--size", type=_size_type(MIN_BENCH_SIZE, "--size"), default=1 << 30,
                    help="bytes per transfer, K/M/G are powers of 1024, at least 1M "
                         "(default: 1G)")
    _add_knobs(pb)
    pb.add_argument("--repeat", type=_int_type(1), default=3, metavar="N",
                    help="timed rounds; figures are their median (default: 3)")
    pb.add_argument("--warmup", type=_int_type(0), default=0, metavar="N",
                    help="untimed rounds before the timed ones (default: 0)")
    only = pb.add_mutually_exclusive_group()
    only.add_argument("--read-only", action="store_true",
                      help="time reads only (the file is written once, untimed)")
    only.add_argument("--write-only", action="store_true", help="time writes only")
    pb.add_argument("--gds", action="store_true",
                    help="also time GdsHandle (cuFile) on a CUDA tensor")
    pb.add_argument("--json", action="store_true", help="print JSON")
    pb.add_argument("--no-progress", action="store_true",
                    help="no progress bar (it is drawn only when stderr is a terminal)")
    pb.set_defaults(func=cmd_bench, parser=pb)

    pt = sub.add_parser("tune", help="sweep the knobs and print the best 'aio' section",
                        description="Sweep block size x queue depth x parallelism x submit/"
                                    "overlap on real files (fsync'd writes, page cache dropped, "
                                    "--repeat rounds per point) and print the best \"aio\" "
                                    "section, which AioConfig and DeepSpeed read unchanged. "
                                    "GB/s = 10^9 bytes/s.")
    pt.add_argument("--dir", action="append", required=True,
                    help="directory to measure in (repeat for several drives)")
    pt.add_argument("--io-size", type=_size_type(flag="--io-size"), default=400 << 20,
                    metavar="SIZE",
                    help="bytes per point and direction, at least the largest block size "
                         "swept (default: 400M)")
    pt.add_argument("--repeat", type=_int_type(1), default=3, metavar="N",
                    help="rounds per point; the median counts, the spread is shown "
                         "(default: 3)")
    direction = pt.add_mutually_exclusive_group()
    direction.add_argument("--no-read", action="store_true", help="measure writes only")
    direction.add_argument("--no-write", action="store_true", help="measure reads only")
    pt.add_argument("--gds", action="store_true", help="tune the cuFile (GDS) path")
    pt.add_argument("--backend", default=None, metavar="NAME",
                    help="engine backend of the sweep: auto, io_uring, aio or threads (default "
                         "AIOSWAP_BACKEND, else auto); run tune once per backend to compare")
    pt.add_argument("--search", choices=("fast", "grid"), default="fast",
                    help="fast: coordinate search from the defaults (default); grid: every "
                         "point")
    pt.add_argument("--quick", action="store_true",
                    help="the 72-point grid (256K/1M/4M x 8/32/128 x 1/2) instead of 672")
    pt.add_argument("--log-dir", default=None,
                    help="keep one JSON log per point here (default: a new temporary "
                         "directory)")
    pt.add_argument("--output", default=None, help="also write the best 'aio' section here")
    pt.add_argument("--plot", default=None, metavar="PNG",
                    help="draw a heat map (block size x queue depth per parallelism) here; "
                         "needs matplotlib")
    pt.add_argument("--json", action="store_true", help="print results as JSON")
    pt.add_argument("--no-progress", action="store_true",
                    help="no progress bar (it is drawn only when stderr is a terminal)")
    pt.set_defaults(func=cmd_tune, parser=pt)
    return p


_SIZE_FLAG = {"bench": "--size", "tune": "--io-size"}


def _os_error_line(exc: OSError, command: str = "bench") -> str:
    what = os.strerror(exc.errno) if exc.errno else str(exc)
    name = os.fsdecode(exc.filename) if exc.filename else ""
    if len(name) > 1 and name[0] == name[-1] and name[0] in "'\"":
        name = name[1:-1]   # some layers pass repr(path) as the file name
    where = f"{name}: " if name else ""
    hint = ""
    if exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
        flag = _SIZE_FLAG.get(command)
        hint = (f" (the disk, a quota or ulimit -f ran out: free space or use a smaller {flag})"
                if flag else " (the disk or a quota ran out)")
    elif exc.errno == errno.EIO:
        hint = " (the drive reported an I/O error)"
    return f"{where}{what}{hint}"


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command; return its exit status (see the module docstring)."""
    parser = build_parser()
    args, extra = parser.parse_known_args(
        _join_negative_sizes(sys.argv[1:] if argv is None else argv))
    if extra:       # named by the subcommand's parser, so the hint points to its --help
        args.parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        return _run(args, f"aioswap {args.command}", sys.stdout, sys.stderr)
    except BrokenPipeError:
        # stderr itself is gone (aioswap bench 2>&1 | head -c1): nowhere to say it; no
        # traceback, and no second failure while flushing stdout at exit
        _quiet_stdout()
        return 2


def _run(args: argparse.Namespace, name: str, out: IO[str], err: IO[str]) -> int:
    """The command, its exceptions as one line on stderr and an exit status, and what it
    made and could not remove named."""
    left: list[tuple[str, str]] = []
    try:
        try:
            runtime_settings()          # a bad AIOSWAP_* variable: one line, status 2
            with _tmpfiles.terminate_on_signals():   # kill/timeout/Slurm: clean up, then exit
                return int(args.func(args, out, err))
        finally:
            # every exit but SIGKILL (which the next run's _remove_stale answers)
            left = _tmpfiles.remove_leftovers()
            for path, why in left:
                err.write(f"{name}: could not remove its scratch file {path} ({why}); "
                          f"remove it by hand\n")
    except OutputError as exc:
        _quiet_stdout()
        err.write(f"{name}: error: cannot write the output: {exc}\n")
        return 2
    except UsageError as exc:
        err.write(f"{name}: error: {exc}\n")
        return 2
    except ConfigError as exc:
        err.write(f"{name}: error: {exc}\n")
        return 2
    except MemoryError as exc:
        flag = _SIZE_FLAG.get(args.command)
        err.write(f"{name}: error: out of memory ({exc or 'allocation refused'})"
                  + (f": use a smaller {flag}\n" if flag else "\n"))
        return 2
    except OSError as exc:
        err.write(f"{name}: error: {_os_error_line(exc, args.command)}\n")
        return 2
    except _tmpfiles.Terminated as exc:
        err.write(f"{name}: terminated by {signal.Signals(exc.signum).name}"
                  + ("\n" if left else "; its files were removed\n"))
        return 128 + exc.signum
    except KeyboardInterrupt:
        err.write(f"{name}: interrupted\n")
        return 130


if __name__ == "__main__":
    sys.exit(main())
