"""Striping over several drives: aioswap against fio on every drive at once and btrfs raid0.

Root only. N drives are simulated with loop devices over image files in ``--dir``
(``losetup --direct-io=on``), each with its own ext4, each capped with cgroup v1
``blkio.throttle.{read,write}_bps_device`` (and ``_iops_device`` for the 4 KiB case) on its
MAJ:MIN, in a cgroup of its own that this process (and fio, its child) joins. Everything is
torn down at the end, also on Ctrl-C or SIGTERM: the process leaves the cgroup, the cgroup
is removed, file systems unmounted, loops detached, images deleted.

For each N in ``--drives`` and each request size (1 MiB sequential, 4 KiB random):

* ``fio sum``: one fio job per drive, all at once (libaio, O_DIRECT, iodepth 32), on a file
  on each drive's ext4; the figure is the sum of the jobs' bandwidths;
* ``btrfs raid0``: ``mkfs.btrfs -d raid0 -m raid0`` over the same throttled loops, fio on
  one file there (``numjobs`` = N, iodepth 32);
* ``aioswap``: ``h.open([part on each drive], "w+")``, the whole transfer as async requests
  of that size, 32 x N in flight as fio keeps its iodepth (a sliding window: the oldest
  waited for before the next is sent), then read back the same way.

Then, for N = 4: a state dict of ``--size`` bytes (16 tensors) through
``TensorSwapper([a directory on each drive])`` (``swap_out_state_dict``, packs fsynced, then
``swap_in_state_dict`` into fresh memory, and into the tensors of an existing dict), against
the 1 MiB ``fio sum``; and the uneven
case (one drive capped at half speed): aioswap striped write and read against the sum of the
caps (a static round-robin split would get about 4 x 0.5 / 3.5 = 0.57).

``--ram-cpu OPS`` adds the CPU per 4 KiB read (``resource.getrusage``, all threads) of a file
striped over 4 RAM drives (tmpfs mounts) against one plain file: what the striping layer
costs per request, with no drive in the way.

Units: GB/s (10^9 B/s); ratios are aioswap / other (bigger is better). Tiny defaults make a
smoke test; ``--size 2G --cap 300M`` (choose N x cap <= 0.7 x the disk's own bandwidth) are
real sizes. Figures taken while other work runs on the machine are rough.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from typing import Any

import torch

import aioswap
from _common import GB, UNITS_NOTE, cpu_s, dir_arg, size_arg
from aioswap.stripe import read_layout
from aioswap.swap import TensorSwapper

CGROUP = "/sys/fs/cgroup/blkio"
QD = 32


def _run(*cmd: str) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if done.returncode:
        raise RuntimeError(f"{' '.join(cmd)}: {done.stderr.strip() or done.stdout.strip()}")
    return done.stdout


def why_not() -> str | None:
    """Why this benchmark cannot run here (None: it can)."""
    if os.geteuid() != 0:
        return "needs root (loop devices, mounts, cgroup throttles)"
    for tool in ("losetup", "mkfs.ext4", "mount", "fio"):
        if shutil.which(tool) is None:
            return f"{tool} is not installed"
    if not os.path.isfile(f"{CGROUP}/blkio.throttle.read_bps_device"):
        return "cgroup v1 blkio throttling is not mounted at " + CGROUP
    return None


class Rig:
    """Loop devices, their file systems and throttles; ``close()`` undoes all of it."""

    def __init__(self, base: str, n: int, image: int) -> None:
        self.base = base
        self.loops: list[str] = []
        self.devs: list[str] = []          # MAJ:MIN
        self.mounts: list[str] = []
        self.cg = f"{CGROUP}/aioswap-bench-{os.getpid()}"
        self.joined = False
        try:
            for i in range(n):
                img = os.path.join(base, f"drive{i}.img")
                with open(img, "wb") as f:
                    f.truncate(image)
                loop = _run("losetup", "-f", "--show", "--direct-io=on", img).strip()
                self.loops.append(loop)
                st = os.stat(loop)
                self.devs.append(f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
            os.mkdir(self.cg)
            with open(f"{self.cg}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
            self.joined = True
        except BaseException:
            self.close()
            raise

    def throttle(self, caps: Sequence[tuple[int, int, int, int]]) -> None:
        """Per drive (read B/s, write B/s, read IOPS, write IOPS); 0 lifts a limit."""
        for dev, cap in zip(self.devs, caps):
            for key, v in zip(("read_bps", "write_bps", "read_iops", "write_iops"), cap):
                with open(f"{self.cg}/blkio.throttle.{key}_device", "w") as f:
                    f.write(f"{dev} {v}")

    def ext4(self) -> list[str]:
        self.unmount()
        for i, loop in enumerate(self.loops):
            _run("mkfs.ext4", "-q", "-F", "-E", "nodiscard", loop)
            mnt = os.path.join(self.base, f"mnt{i}")
            os.makedirs(mnt, exist_ok=True)
            _run("mount", loop, mnt)
            self.mounts.append(mnt)
        return list(self.mounts)

    def btrfs(self) -> str:
        self.unmount()
        _run("mkfs.btrfs", "-q", "-f", "-d", "raid0", "-m", "raid0", *self.loops)
        mnt = os.path.join(self.base, "btrfs")
        os.makedirs(mnt, exist_ok=True)
        _run("mount", self.loops[0], mnt)
        self.mounts.append(mnt)
        return mnt

    def unmount(self) -> None:
        while self.mounts:
            m = self.mounts.pop()
            subprocess.run(["umount", m], capture_output=True, check=False)

    def close(self) -> None:
        self.unmount()
        if self.joined:
            with open(f"{CGROUP}/cgroup.procs", "w") as f:
                f.write(str(os.getpid()))
            self.joined = False
        if os.path.isdir(self.cg):
            try:
                os.rmdir(self.cg)
            except OSError:
                time.sleep(0.2)         # threads of a closing handle still leaving
                os.rmdir(self.cg)
        for loop in self.loops:
            subprocess.run(["losetup", "-d", loop], capture_output=True, check=False)
        self.loops.clear()
        for i in range(len(self.devs)):
            img = os.path.join(self.base, f"drive{i}.img")
            if os.path.exists(img):
                os.unlink(img)


@contextmanager
def rig(base: str, n: int, image: int) -> Iterator[Rig]:
    def term(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt
    old = signal.signal(signal.SIGTERM, term)
    r = Rig(base, n, image)
    try:
        yield r
    finally:
        r.close()
        signal.signal(signal.SIGTERM, old)


def fio(files: Sequence[str], rw: str, bs: int, size: int, numjobs: int = 1) -> float:
    """fio on each file at once (one job per file, or ``numjobs`` on one file): total B/s."""
    cmd = ["fio", "--ioengine=libaio", "--direct=1", f"--bs={bs}", f"--iodepth={QD}",
           f"--rw={rw}", f"--size={size}", "--output-format=json", "--group_reporting=0",
           "--randrepeat=0"]
    if numjobs > 1:
        cmd += ["--name=j", f"--filename={files[0]}", f"--numjobs={numjobs}",
                f"--offset_increment={size}"]
    else:
        for i, f in enumerate(files):
            cmd += [f"--name=j{i}", f"--filename={f}"]
    out = json.loads(_fio_json(cmd))
    key = "read" if "read" in rw else "write"
    return float(sum(j[key]["bw_bytes"] for j in out["jobs"]))


def drop_caches() -> None:
    """Write back and drop the page cache (root), so no read below is served from memory."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("3")


def _fio_json(cmd: Sequence[str]) -> str:
    text = _run(*cmd)
    return text[text.index("{"):]


def aioswap_run(h: aioswap.AioHandle, parts: Sequence[str], bs: int, size: int,
                rand: bool) -> tuple[float, float, float]:
    """aioswap striped write then read of ``size`` bytes in requests of ``bs``: B/s each,
    and the largest share of the stripe units one drive got."""
    n = size // bs
    offs = [i * bs for i in range(n)]
    if rand:
        random.Random(1).shuffle(offs)
    window = QD * len(parts)
    buf = h.new_cpu_locked_tensor(min(size, window * bs), torch.uint8)
    buf.random_(0, 256)
    slots = buf.numel() // bs
    window = min(window, slots)
    rates = []
    with h.open(list(parts), "w+") as f:
        if rand:                    # random writes land in allocated units, as fio's do
            f.pwrite(h.new_cpu_locked_tensor(size, torch.uint8), 0)
        for write in (True, False):
            # a sliding window, as fio keeps its iodepth: `window` requests in flight, the
            # oldest waited for before the next goes (slot i % slots is then free again)
            inflight: deque[aioswap.IOFuture] = deque()
            if not write:
                drop_caches()               # as before fio's reads
            t0 = time.perf_counter()
            for i, off in enumerate(offs):
                if len(inflight) >= window:
                    inflight.popleft().result()
                view = buf[(i % slots) * bs:(i % slots + 1) * bs]
                fut = f.pwrite(view, off, async_op=True) if write else \
                    f.pread(view, off, async_op=True)
                inflight.append(fut)
            f.wait()
            rates.append(size / (time.perf_counter() - t0))
    drives = read_layout(parts[0])["drives"]
    share = max(drives.count(d) for d in range(len(parts))) / max(1, len(drives))
    return rates[0], rates[1], share


def ram_cpu(base: str, n: int, ops: int) -> dict[str, float]:
    """CPU microseconds per 4 KiB read (all threads, best of 3) on ``n`` RAM drives (tmpfs
    mounts under ``base``, removed after): a file striped over them against one plain file,
    each sync, in bursts of ``32 x n`` then a wait, and in a sliding window of ``32 x n``."""
    mnts: list[str] = []
    size, bs, window = 64 << 20, 4096, QD * n
    rng = random.Random(2)
    offs = [rng.randrange(size // bs) * bs for _ in range(ops)]
    out: dict[str, float] = {}
    try:
        for i in range(n):
            m = os.path.join(base, f"ram{i}")
            os.makedirs(m, exist_ok=True)
            _run("mount", "-t", "tmpfs", "-o", f"size={2 * size + (64 << 20)}", "tmpfs", m)
            mnts.append(m)
        with aioswap.AioHandle() as h:
            buf = h.new_cpu_locked_tensor(window * bs, torch.uint8)
            views = [buf[i * bs:(i + 1) * bs] for i in range(window)]
            data = h.new_cpu_locked_tensor(size, torch.uint8)
            data.random_(0, 256)
            with h.open(os.path.join(mnts[0], "plain.bin"), "w+") as pf, \
                    h.open([os.path.join(m, "stripe.bin") for m in mnts], "w+") as sf:
                pf.pwrite(data, 0)
                sf.pwrite(data, 0)
                del data
                for name, f, wait in (("plain", pf, h.wait), ("striped", sf, sf.wait)):
                    def sync() -> None:
                        for off in offs:
                            f.pread(views[0], off)

                    def burst() -> None:
                        for start in range(0, ops, window):
                            for i, off in enumerate(offs[start:start + window]):
                                f.pread(views[i], off, async_op=True)
                            wait()

                    def slide() -> None:
                        inflight: deque[Any] = deque()
                        for i, off in enumerate(offs):
                            if len(inflight) >= window:
                                inflight.popleft().result()
                            inflight.append(f.pread(views[i % window], off, async_op=True))
                        wait()

                    for label, fn in (("sync", sync), (f"burst x{window}", burst),
                                      (f"window x{window}", slide)):
                        best = float("inf")
                        for _ in range(3):
                            c0 = cpu_s()
                            fn()
                            best = min(best, (cpu_s() - c0) / ops * 1e6)
                        out[f"{name} {label}"] = best
    finally:
        for m in reversed(mnts):
            subprocess.run(["umount", m], capture_output=True, check=False)
    return out


def swapper_run(h: aioswap.AioHandle, roots: Sequence[str],
                size: int) -> tuple[float, float, float]:
    """A state dict of ``size`` bytes in 16 tensors through a TensorSwapper over ``roots``:
    swap_out_state_dict, swap_in_state_dict into fresh memory, and swap_in_state_dict into
    the tensors of an existing dict (``state_dict=``, as a training loop restores its state),
    B/s each (byte-exact checked)."""
    per = max(1, size // 16 // 4)
    gen = torch.Generator().manual_seed(5)
    sd = {f"layer{i}.weight": torch.randint(-2**31, 2**31 - 1, (per,), dtype=torch.int32,
                                            generator=gen) for i in range(16)}
    nbytes = sum(t.nbytes for t in sd.values())
    with TensorSwapper(list(roots), handle=h) as sw:
        t0 = time.perf_counter()
        sw.swap_out_state_dict("", sd)
        w = nbytes / (time.perf_counter() - t0)
        t0 = time.perf_counter()
        got = sw.swap_in_state_dict("", verify=False)
        r = nbytes / (time.perf_counter() - t0)
        if any(not torch.equal(got[k], v) for k, v in sd.items()):
            raise SystemExit("TensorSwapper over the drives read back different bytes")
        for t in got.values():
            t.zero_()
        t0 = time.perf_counter()
        sw.swap_in_state_dict("", state_dict=got, verify=False)
        into = nbytes / (time.perf_counter() - t0)
        if any(not torch.equal(got[k], v) for k, v in sd.items()):
            raise SystemExit("TensorSwapper over the drives read back different bytes")
        del got
        sw.destroy()
    return w, r, into


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dir", type=dir_arg, default=None,
                   help="where the drive images go (default: a new "
                   "directory under $TMPDIR)")
    p.add_argument("--drives", default="2,4", help="numbers of drives (default: 2,4)")
    p.add_argument("--size", type=size_arg(1 << 20), default="64M",
                   help="bytes per 1 MiB transfer (default: 64M)")
    p.add_argument("--small", type=size_arg(4096), default="8M",
                   help="bytes per 4 KiB random transfer (default: 8M)")
    p.add_argument("--cap", type=size_arg(4096), default="100M",
                   help="bytes/s per drive (default: 100M)")
    p.add_argument("--iops", type=int, default=2000, help="4 KiB IOPS per drive "
                   "(default: 2000)")
    p.add_argument("--no-btrfs", action="store_true", help="leave btrfs raid0 out")
    p.add_argument("--ram-cpu", type=int, default=0, metavar="OPS",
                   help="also CPU per 4 KiB read on 4 RAM drives (tmpfs): a striped file "
                   "against one plain file, OPS reads each (default 0: skipped)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    args = p.parse_args(argv)
    reason = why_not()
    if reason is not None:
        print(f"bench_stripe: skipped: {reason}", file=sys.stderr)
        return 0
    size, small, cap = args.size, args.small, args.cap
    btrfs = not args.no_btrfs and shutil.which("mkfs.btrfs") is not None
    counts = [int(x) for x in args.drives.split(",")]
    cases: list[dict[str, Any]] = []
    with ExitStack() as stack:
        base = args.dir or stack.enter_context(tempfile.TemporaryDirectory(prefix="stripe-"))
        for n in sorted(set(counts) | {4}):
            # a fio file and a striped part (each total / n) side by side, plus ext4 journal
            # and the parts' allocation ahead of their writes
            image = max(256 << 20, 9 * size // (4 * n) + (128 << 20), 2 * small + (64 << 20))
            with rig(base, n, image) as r, aioswap.AioHandle() as h:
                for bs, total, rand in ((1 << 20, size, False), (4096, small, True)):
                    if n not in counts:
                        break
                    caps = [(cap, cap, args.iops if rand else 0, args.iops if rand else 0)] * n
                    r.throttle(caps)
                    mnts = r.ext4()
                    files = [os.path.join(m, "fio.bin") for m in mnts]
                    per = total // n
                    rw = "rand" if rand else ""
                    fw = fio(files, rw + "write", bs, per)
                    drop_caches()
                    fr = fio(files, rw + "read", bs, per)
                    parts = [os.path.join(m, "stripe.bin") for m in mnts]
                    aw, ar, share = aioswap_run(h, parts, bs, total, rand)
                    bw_ = br = float("nan")
                    if btrfs:
                        m = r.btrfs()
                        bf = os.path.join(m, "fio.bin")
                        bw_ = fio([bf], rw + "write", bs, per, numjobs=n)
                        drop_caches()
                        br = fio([bf], rw + "read", bs, per, numjobs=n)
                    for op, a, fs, bt in (("write", aw, fw, bw_), ("read", ar, fr, br)):
                        cases.append({"drives": n, "request": bs, "op": op,
                                      "fio_sum": fs / GB, "btrfs_raid0": bt / GB,
                                      "aioswap": a / GB, "vs_fio_sum": a / fs,
                                      "vs_btrfs": a / bt if bt == bt else None,
                                      "largest_share": share})
                    if n == 4 and not rand:     # a state dict through TensorSwapper
                        r.unmount()
                        r.throttle(caps)
                        mnts = r.ext4()
                        sw_w, sw_r, sw_i = swapper_run(
                            h, [os.path.join(m, "swap") for m in mnts], size)
                        for op, a, fs in (("swap_out_state_dict", sw_w, fw),
                                          ("swap_in_state_dict", sw_r, fr),
                                          ("swap_in, into a dict", sw_i, fr)):
                            cases.append({"drives": n, "request": bs, "op": op,
                                          "fio_sum": fs / GB, "aioswap": a / GB,
                                          "vs_fio_sum": a / fs, "vs_btrfs": None})
                if n == 4:          # one drive at half speed
                    r.throttle([(cap, cap, 0, 0)] * 3 + [(cap // 2, cap // 2, 0, 0)])
                    mnts = r.ext4()
                    parts = [os.path.join(m, "stripe.bin") for m in mnts]
                    aw, ar, share = aioswap_run(h, parts, 1 << 20, size, False)
                    caps_sum = 3.5 * cap
                    cases.append({"drives": 4, "request": 1 << 20, "op": "write, one at half",
                                  "caps_sum": caps_sum / GB, "aioswap": aw / GB,
                                  "vs_caps_sum": aw / caps_sum, "largest_share": share})
                    cases.append({"drives": 4, "request": 1 << 20, "op": "read, one at half",
                                  "caps_sum": caps_sum / GB, "aioswap": ar / GB,
                                  "vs_caps_sum": ar / caps_sum, "largest_share": share})
                r.unmount()
        cpu = ram_cpu(base, 4, args.ram_cpu) if args.ram_cpu else None
    report = {"cap_bytes_per_s": cap, "iops_cap": args.iops, "size": size, "small": small,
              "cases": cases, "units": UNITS_NOTE}
    if cpu is not None:
        report["ram_cpu_us_per_read"] = cpu
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"striping over throttled loop devices: {cap / GB:.3f} GB/s per drive, "
          f"{args.iops} IOPS for 4 KiB")
    print(f"{'drives':>6} {'req':>5} {'op':<20} {'fio sum':>8} {'btrfs':>8} {'aioswap':>8} "
          f"{'/fio':>6} {'/btrfs':>6} {'share':>6}")
    over = False
    for c in cases:
        other = c.get("fio_sum", c.get("caps_sum"))
        ratio = c.get("vs_fio_sum", c.get("vs_caps_sum"))
        vb = c.get("vs_btrfs")
        share = c.get("largest_share")
        capped = c["drives"] * (cap if c["request"] == 1 << 20 else args.iops * 4096) / GB
        bt = c.get("btrfs_raid0", float("nan"))
        flag = "*" if bt > 1.02 * capped else " "
        over = over or flag == "*"
        print(f"{c['drives']:>6} {'1M' if c['request'] == 1 << 20 else '4K':>5} "
              f"{c['op']:<20} {other:>8.3f} {bt:>7.3f}{flag} "
              f"{c['aioswap']:>8.3f} {ratio:>6.2f} "
              f"{'-' if vb is None else f'{vb:.2f}':>6} "
              f"{'-' if share is None else f'{share:.2f}':>6}")
    print(f"({UNITS_NOTE}; 'one at half' rows compare with the sum of the caps; share: the "
          f"largest fraction of the stripe units one drive holds, 1/N when even)")
    if over:
        print("* above the sum of the caps: the throttle did not hold btrfs (its I/O is not "
              "all issued by the throttled process), so that ratio is not a fair one")
    if cpu is not None:
        print("\nCPU per 4 KiB read on 4 RAM drives (us, all threads, best of 3)")
        for k, v in cpu.items():
            print(f"  {k:<26}{v:8.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
