"""compat.deepspeed: DeepSpeed's op builders load aioswap; ZeRO-3 trains with NVMe offload.

Everything that imports DeepSpeed runs in a fresh interpreter (``DS_ACCELERATOR=cpu``): the
point is what happens from interpreter start, and DeepSpeed's global state (accelerator,
process group, op table) must not leak into the other tests. Skipped where DeepSpeed is not
installed (CI installs it with ``pip install --no-deps deepspeed`` and its pure-Python
dependencies: nothing is compiled).
"""
from __future__ import annotations

import importlib.util
import json
import os
import site
import socket
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import aioswap
from aioswap.compat import deepspeed as ads

HAVE_DEEPSPEED = importlib.util.find_spec("deepspeed") is not None
needs_deepspeed = pytest.mark.skipif(not HAVE_DEEPSPEED,
                                     reason="deepspeed is not installed (pip install "
                                            "--no-deps deepspeed and its pure-Python deps)")

PTH = "aioswap-deepspeed.pth"


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ads.ENV_VAR}
    # The child imports the aioswap under test, wherever this process found it.
    root = str(Path(aioswap.__file__).resolve().parent.parent)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    env.update(DS_ACCELERATOR="cpu", PYTHONWARNINGS="ignore", **extra)
    return env


def _run(script: Path, timeout: float = 240, **env: str) -> dict:
    """Run ``script``; return the JSON it prints on its last ``RESULT`` line."""
    r = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                       timeout=timeout, env=_env(**env), cwd=script.parent)
    assert r.returncode == 0, f"exit {r.returncode}\n{r.stdout[-4000:]}\n{r.stderr[-6000:]}"
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith("RESULT ")]
    assert lines, r.stdout[-4000:] + r.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _script(tmp_path: Path, body: str, name: str = "probe.py") -> Path:
    p = tmp_path / name
    p.write_text(textwrap.dedent(body))
    return p


def test_install_is_a_noop_without_deepspeed(monkeypatch):
    if ads.installed():
        pytest.skip("the integration is active in this process (AIOSWAP_DEEPSPEED=1)")
    before = list(sys.meta_path)
    # absent: find_spec() says so, and no module of it is loaded (accelerate's disk offload,
    # tested in this process too, imports deepspeed's op builders where it is installed)
    for name in [m for m in sys.modules if m.startswith(("deepspeed.", "op_builder"))]:
        monkeypatch.delitem(sys.modules, name)
    monkeypatch.setitem(sys.modules, "deepspeed", None)
    assert ads.install() is False
    assert not ads.installed() and sys.meta_path == before
    ads.uninstall()                                       # idempotent, nothing to undo
    assert sys.meta_path == before


@needs_deepspeed
def test_install_before_import_patches_every_builder(tmp_path):
    res = _run(_script(tmp_path, """
        import json, sys
        from aioswap.compat import deepspeed as ads
        first, again = ads.install(), ads.install()
        imported_early = "deepspeed" in sys.modules
        finders = sum(type(f).__name__ == "_BuilderFinder" for f in sys.meta_path)
        import deepspeed, deepspeed.ops
        from deepspeed.ops.op_builder import AsyncIOBuilder, GDSBuilder, PinMemoryBuilder
        from deepspeed.ops.op_builder import async_io as cuda_aio, gds as cuda_gds
        from aioswap.compat import deepnvme
        table = deepspeed.ops.__compatible_ops__
        mod = AsyncIOBuilder().load()
        out = dict(
            first=first, again=again, imported_early=imported_early, finders=finders,
            cpu_class=AsyncIOBuilder.__module__,
            cpu_loads=mod is deepnvme, cpu_ok=AsyncIOBuilder().is_compatible(),
            cpu_jit=AsyncIOBuilder().jit_load() is deepnvme,
            cuda_loads=cuda_aio.AsyncIOBuilder().load() is deepnvme,
            cuda_ok=cuda_aio.AsyncIOBuilder().is_compatible(),
            gds_ok=cuda_gds.GDSBuilder().is_compatible(),
            gds_name=GDSBuilder.NAME,
            pin_loads=PinMemoryBuilder().load() is deepnvme,
            table={k: table.get(k) for k in ("async_io", "pin_memory", "gds",
                                            GDSBuilder.NAME)},
            funcs=[callable(getattr(mod, n)) for n in ("aio_read", "aio_write",
                                                         "deepspeed_memcpy")],
        )
        # DeepSpeed's own pinned-memory manager (DS_PIN_MEMORY_BACKEND=native) on aioswap's
        import gc, torch
        from aioswap import pinned
        from deepspeed.utils.pin_memory import get_active_native_pinned_memory
        native = get_active_native_pinned_memory()
        x = torch.randn(1000)
        p = native.pin(x)
        with mod.aio_handle() as h:
            out["native"] = [bool(torch.equal(p, x)), native.is_pinned(p), pinned.is_pinned(p),
                             h.is_pinned(p), native.unpin(p)]
        q = native.pin_empty(x, (10, 100))
        out["native_empty"] = [list(q.shape), pinned.is_pinned(q)]
        del p, q
        gc.collect()
        out["native_left"] = pinned.stats().bytes_locked
        try:
            cuda_gds.GDSBuilder().load()
            out["gds_load"] = "loaded"
        except RuntimeError as exc:
            out["gds_load"] = str(exc)
        print("RESULT " + json.dumps(out))
    """), DS_PIN_MEMORY_BACKEND="native")
    assert res["first"] is True and res["again"] is True
    assert res["imported_early"] is False, "install() imported deepspeed"
    assert res["finders"] == 1
    assert res["cpu_class"] == "deepspeed.ops.op_builder.cpu.async_io"
    assert res["cpu_loads"] and res["cpu_ok"] and res["cpu_jit"]
    assert res["cuda_loads"] and res["cuda_ok"] and res["pin_loads"]
    assert res["funcs"] == [True, True, True]
    # No CUDA device here: GDS is not compatible, and the table says so (on the CPU
    # accelerator GDSBuilder is DeepSpeed's not-implemented builder).
    assert res["gds_ok"] is False
    assert "cannot provide the gds op" in res["gds_load"] and "cufile" in res["gds_load"]
    assert res["table"]["async_io"] is True and res["table"]["pin_memory"] is True
    assert res["table"][res["gds_name"]] is False
    assert res["native"] == [True, True, True, True, True]
    assert res["native_empty"] == [[10, 100], True]
    assert res["native_left"] == 0          # freed by address once the tensors were collected


@needs_deepspeed
def test_install_after_import_updates_the_op_table(tmp_path):
    res = _run(_script(tmp_path, """
        import json
        import deepspeed, deepspeed.ops
        from deepspeed.ops.op_builder import AsyncIOBuilder, PinMemoryBuilder
        table = deepspeed.ops.__compatible_ops__
        table["async_io"] = table["pin_memory"] = False     # as without libaio-dev
        original = AsyncIOBuilder.__dict__["load"]
        from aioswap.compat import deepspeed as ads
        from aioswap.compat import deepnvme
        ads.install()
        after = dict(table)
        loads = AsyncIOBuilder().load() is deepnvme and PinMemoryBuilder().load() is deepnvme
        ads.uninstall()
        print("RESULT " + json.dumps(dict(
            after={k: after[k] for k in ("async_io", "pin_memory")},
            loads=loads,
            restored={k: table[k] for k in ("async_io", "pin_memory")},
            original_back=AsyncIOBuilder.__dict__["load"] is original,
            installed=ads.installed())))
    """))
    assert res["after"] == {"async_io": True, "pin_memory": True}
    assert res["loads"] is True
    assert res["restored"] == {"async_io": False, "pin_memory": False}
    assert res["original_back"] is True and res["installed"] is False


def _pth_installed() -> bool:
    dirs = list(site.getsitepackages()) + [site.getusersitepackages()]
    return any(os.path.exists(os.path.join(d, PTH)) for d in dirs)


@needs_deepspeed
@pytest.mark.skipif(not _pth_installed(), reason=f"{PTH} is not in site-packages (aioswap "
                    f"was installed before the hook existed: reinstall it)")
def test_env_var_hook_in_spawn_and_forkserver_workers(tmp_path):
    script = _script(tmp_path, """
        import json, multiprocessing as mp, sys

        def worker(_):
            from aioswap.compat import deepspeed as ads
            from deepspeed.ops.op_builder import AsyncIOBuilder
            return ads.installed(), AsyncIOBuilder().load().__name__

        if __name__ == "__main__":
            from aioswap.compat import deepspeed as ads
            out = dict(installed=ads.installed(), deepspeed_early="deepspeed" in sys.modules)
            for method in ("spawn", "forkserver"):
                with mp.get_context(method).Pool(1) as pool:
                    out[method] = pool.map(worker, [0])[0]
            print("RESULT " + json.dumps(out))
    """)
    res = _run(script, **{ads.ENV_VAR: "1"})
    assert res["installed"] is True and res["deepspeed_early"] is False
    assert res["spawn"] == [True, "aioswap.compat.deepnvme"]
    assert res["forkserver"] == [True, "aioswap.compat.deepnvme"]
    # Without the variable the hook does nothing, not even import aioswap.
    off = subprocess.run([sys.executable, "-c", "import sys; print('aioswap' in sys.modules)"],
                         capture_output=True, text=True, env=_env(), timeout=60)
    assert off.stdout.strip() == "False", off.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.slow      # CI's -m slow run keeps it (moved for a faster default run)
@needs_deepspeed
@pytest.mark.parametrize("drives", [1, 3])
def test_zero3_nvme_offload_trains_like_cpu_offload(tmp_path, drives):
    """ZeRO-3, one gloo rank, params and optimizer state on NVMe through aioswap: the same
    losses as with CPU offload, and nothing built. With 3 drives (``AIOSWAP_NVME_PATHS``:
    the config's nvme_path and two more) every swap file is striped over the three."""
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    extra = [tmp_path / f"nvme{i}" for i in range(1, drives)]
    stripe_env = {"AIOSWAP_NVME_PATHS": os.pathsep.join(map(str, [nvme, *extra]))} \
        if extra else {}
    res = _run(_script(tmp_path, f"""
        import collections, json, os
        from aioswap.compat import deepspeed as ads
        from aioswap.compat import deepnvme
        assert ads.install()
        import torch, deepspeed, deepspeed.ops
        from deepspeed.ops.op_builder.builder import OpBuilder

        def no_build(self, verbose=True):
            raise AssertionError(f"DeepSpeed tried to build the {{self.name}} op")
        OpBuilder.jit_load = no_build
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False   # else a JIT build

        moved = collections.Counter()
        submit = deepnvme.aio_handle._submit
        def counting(self, fn, buffer, file, *args, **kw):
            moved[os.path.basename(os.path.dirname(os.path.dirname(str(file))))
                  + ":" + fn.__name__] += 1
            return submit(self, fn, buffer, file, *args, **kw)
        deepnvme.aio_handle._submit = counting

        deepspeed.init_distributed(dist_backend="gloo")

        def config(device):
            off = {{"device": device}}
            if device == "nvme":
                off["nvme_path"] = {str(nvme)!r}
            param = dict(off, **({{"buffer_count": 2, "buffer_size": 1 << 19}}
                                 if device == "nvme" else {{}}))
            return {{
                "train_batch_size": 4,
                "zero_optimization": {{"stage": 3, "offload_param": param,
                                       "offload_optimizer": dict(off),
                                       "stage3_param_persistence_threshold": 0}},
                "zero_force_ds_cpu_optimizer": False,
                "aio": {{"block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
                         "single_submit": False, "overlap_events": True}},
                "steps_per_print": 1000,
            }}

        def train(device):
            cfg = config(device)
            torch.manual_seed(0)
            # 512x512 fp32 layers: 1 MiB each, DeepSpeed's smallest swappable tensor
            with deepspeed.zero.Init(config_dict_or_path=cfg, remote_device=device):
                model = torch.nn.Sequential(
                    torch.nn.Linear(64, 512), torch.nn.ReLU(),
                    torch.nn.Linear(512, 512), torch.nn.ReLU(),
                    torch.nn.Linear(512, 512), torch.nn.ReLU(),
                    torch.nn.Linear(512, 8))
            opt = torch.optim.Adam(model.parameters(), lr=1e-3)
            engine, *_ = deepspeed.initialize(model=model, optimizer=opt, config=cfg)
            g = torch.Generator().manual_seed(1)
            losses = []
            for _ in range(8):
                x, y = torch.randn(4, 64, generator=g), torch.randn(4, 8, generator=g)
                loss = torch.nn.functional.mse_loss(engine(x), y)
                engine.backward(loss)
                engine.step()
                losses.append(loss.item())
            engine.destroy()
            return losses

        nvme_losses = train("nvme")
        files = sorted(os.path.relpath(os.path.join(r, f), {str(nvme)!r})
                       for r, _, fs in os.walk({str(nvme)!r}) for f in fs)
        print("RESULT " + json.dumps(dict(nvme=nvme_losses, cpu=train("cpu"), files=files,
                                          moved=dict(moved))))
    """, "train.py"), timeout=300, MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()),
        RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", **stripe_env)
    assert len(res["nvme"]) == 8
    assert res["nvme"] == res["cpu"], (res["nvme"], res["cpu"])
    moved = res["moved"]
    # Both kinds of state went through aioswap, both ways.
    for what in ("float32params", "optimizer"):
        assert moved.get(f"{what}:pwrite", 0) > 0 and moved.get(f"{what}:pread", 0) > 0, moved
    assert any(f.endswith(".tensor.swp") and "optimizer" in f for f in res["files"])
    for d in extra:     # each other drive holds a part of the swap files, and their layout
        parts = [os.path.join(r, f) for r, _, fs in os.walk(d) for f in fs]
        swp = [p for p in parts if p.endswith(".tensor.swp")]
        assert swp and any(os.path.getsize(p) > 0 for p in swp), parts
        assert any("optimizer" in p for p in swp) and any("param" in p for p in swp), swp
        assert all(os.path.exists(p + ".stripe.json") for p in swp)
