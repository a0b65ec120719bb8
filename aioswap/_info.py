"""What ``aioswap info`` reports about the machine: the drive under a directory, the
kernel interfaces, cuFile, the GPU, and how it is printed (:mod:`aioswap.cli` runs it)."""
from __future__ import annotations

import os
from typing import Any

from aioswap._units import format_size
from aioswap.config import runtime_settings
from aioswap.tune.measure import read_text

__all__ = ["backend_info", "block_device", "cufile_info", "format_info", "fs_type", "gpu_info",
           "read_int", "shared_devices", "short_reason"]


def read_int(path: str) -> int | None:
    text = read_text(path)
    try:
        return int(text.split()[0]) if text else None
    except ValueError:
        return None


def fs_type(path: str) -> str | None:
    best, fstype = "", None
    real = os.path.realpath(path)
    for line in (read_text("/proc/self/mounts") or "").splitlines():
        parts = line.split()
        if len(parts) < 3:
            continue
        mnt = parts[1].replace("\\040", " ")
        if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
            best, fstype = mnt, parts[2]
    return fstype


def block_device(directory: str) -> dict[str, Any]:
    """The drive under ``directory`` as /sys describes it (model, scheduler, rotational, block
    sizes, nr_requests, NUMA node); ``{"name": None, "reason": ...}`` when there is none."""
    dev = os.stat(directory).st_dev
    major, minor = os.major(dev), os.minor(dev)
    sys_dev = f"/sys/dev/block/{major}:{minor}"
    if not os.path.exists(sys_dev):
        return {"name": None, "reason": f"no block device (device {major}:{minor}: a virtual, "
                                        f"network or overlay file system)"}
    node = os.path.realpath(sys_dev)
    partition = None
    if os.path.exists(os.path.join(node, "partition")):
        partition, node = os.path.basename(node), os.path.dirname(node)
    q = os.path.join(node, "queue")
    sched = read_text(os.path.join(q, "scheduler"))
    if sched and "[" in sched:
        sched = sched[sched.index("[") + 1:sched.index("]")]
    model = read_text(os.path.join(node, "device", "model"))
    if not model:
        vendor = read_text(os.path.join(node, "device", "vendor"))
        model = f"vendor {vendor}" if vendor else None
    numa = None
    for rel in ("device/numa_node", "device/device/numa_node"):
        numa = read_int(os.path.join(node, rel))
        if numa is not None:
            break
    rot = read_int(os.path.join(q, "rotational"))
    return {"name": os.path.basename(node), "partition": partition, "model": model,
            "scheduler": sched, "rotational": None if rot is None else bool(rot),
            "logical_block_size": read_int(os.path.join(q, "logical_block_size")),
            "physical_block_size": read_int(os.path.join(q, "physical_block_size")),
            "nr_requests": read_int(os.path.join(q, "nr_requests")),
            "numa_node": numa}


def cufile_info() -> dict[str, Any]:
    try:
        from aioswap import _cufile
        ok, reason = _cufile.available()
        out: dict[str, Any] = {"available": ok, "reason": reason or None}
        if ok:
            out["library"] = _cufile.library_path()
            out["version"] = _cufile.version()
        return out
    except Exception as exc:   # info must report, not crash
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}


def gpu_info() -> dict[str, Any]:
    try:
        import torch
    except ImportError:
        return {"torch": None, "cuda": False}
    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.cuda.is_available()}
    if out["cuda"]:
        out["devices"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    return out


def backend_info() -> dict[str, Any]:
    """The engine backend a handle gets here (AIOSWAP_BACKEND, else "auto"), and why."""
    from aioswap import _aio
    works = {name: {"works": ok, "reason": why or None}
             for name, (ok, why) in _aio.backends_available().items()}
    try:
        q = _aio.AioQueue(1, backend=runtime_settings().backend)
    except OSError as exc:
        return {"name": None, "reason": str(exc), "backends": works}
    try:
        out: dict[str, Any] = {"name": q.backend, "reason": q.why or None, "backends": works}
        if q.backend == "io_uring":
            out["io_uring"] = {
                "setup_flags": [n for n, bit in _aio.URING_SETUP_FLAGS.items()
                                if q.uring_flags & bit],
                "registered_files": q.fixed_files >= 0,
            }
        return out
    finally:
        q.close()


def short_reason(reason: str | None) -> str:
    """The first sentence of a long reason, without the 'X is unavailable:' preamble."""
    text = (reason or "unknown").split(". ")[0].rstrip(".")
    if ": " in text and "unavailable" in text.split(": ", 1)[0]:
        text = text.split(": ", 1)[1]
    return text


def format_info(info: dict[str, Any]) -> str:
    d, m, a, dev = info["directory"], info["memlock"], info["aio"], info["device"]
    lines = [
        f"aioswap {info['aioswap']}  (Linux {info['kernel']}, Python {info['python']})",
        f"kernel AIO       : {'yes' if a['available'] else 'NO: ' + str(a['reason'])}"
        f"  (fs.aio-nr {a['aio_nr']} of {a['aio_max_nr']})",
        f"engine backend   : {info['backend']['name'] or 'none'}"
        + (f" ({info['backend']['reason']})" if info["backend"]["reason"] else ""),
        "backends         : " + ", ".join(
            f"{name} {'yes' if b['works'] else 'NO (' + str(b['reason']) + ')'}"
            for name, b in info["backend"]["backends"].items()),
    ]
    ur = info["backend"].get("io_uring")
    if ur is not None:
        lines.append(f"io_uring         : setup flags {'|'.join(ur['setup_flags']) or 'none'}, "
                     f"registered files {'yes' if ur['registered_files'] else 'no'}")
    lines += [
        f"directory        : {d['path']} ({d['fs_type']}), "
        f"{format_size(d['free_bytes'])} free of {format_size(d['total_bytes'])}",
    ]
    if dev.get("name"):
        rot = {True: "rotational", False: "non-rotational", None: "rotational ?"}
        part = f" (partition {dev['partition']})" if dev.get("partition") else ""
        lines.append(f"device           : {dev['name']}{part}, {dev['model'] or 'model ?'}, "
                     f"{rot[dev['rotational']]}, scheduler {dev['scheduler'] or '?'}")
        lines.append(f"                   block size {dev['logical_block_size']} B logical / "
                     f"{dev['physical_block_size']} B physical, nr_requests "
                     f"{dev['nr_requests']}, NUMA node "
                     f"{'none' if dev['numa_node'] in (None, -1) else dev['numa_node']}")
    else:
        lines.append(f"device           : {dev['reason']}")
    if d["o_direct"]:
        lines.append(f"O_DIRECT         : yes, memory alignment {d['dio_mem_align']} B, "
                     f"offset alignment {d['dio_offset_align']} B")
    else:
        lines.append(f"O_DIRECT         : NO ({d['reason']}); aioswap uses buffered I/O here")
    lim = "unlimited" if m["unlimited"] else format_size(m["rlimit_soft"] or 0)
    lines.append(f"RLIMIT_MEMLOCK   : {lim}; CAP_IPC_LOCK: {'yes' if m['cap_ipc_lock'] else 'no'}")
    c = info["cufile"]
    lines.append("cuFile           : " + (f"yes, {c.get('library')} version {c.get('version')}"
                                          if c["available"] else
                                          f"no ({short_reason(c['reason'])}; --json for more)"))
    g = info["gpu"]
    if g.get("cuda"):
        gpu = ", ".join(g["devices"])
    elif g["torch"] is None:
        gpu = "unknown (torch is not installed)"
    else:
        gpu = f"none (torch {g['torch']} sees no CUDA device)"
    lines.append("GPU              : " + gpu)
    if d.get("warning"):
        lines.append(f"warning          : {d['warning']}")
    for i, r in enumerate(info.get("roots", [])):
        dev = r["device"]
        where = (f"{dev['name']}" + (f" (partition {dev['partition']})"
                                     if dev.get("partition") else "")
                 if dev.get("name") else f"no block device ({r['st_dev']})")
        lines.append(f"{'roots' if i == 0 else '':17s}: {r['path']} on {where}, "
                     f"{r['fs_type']}, {format_size(r['free_bytes'])} free, O_DIRECT "
                     f"{'yes' if r['o_direct'] else 'no'}")
    for paths in info.get("roots_sharing_a_device", []):
        lines.append(f"warning          : {', '.join(paths)} are on one device: spreading data "
                     f"over them does not add bandwidth")
    return "\n".join(lines)


def shared_devices(roots: list[dict[str, Any]]) -> list[list[str]]:
    """Groups of roots on one block device (or one file system without one)."""
    by: dict[str, list[str]] = {}
    for r in roots:
        d = r["device"]
        key = (d["name"] if d.get("name") else "fs " + r["st_dev"])
        by.setdefault(key, []).append(r["path"])
    return [paths for paths in by.values() if len(paths) > 1]
