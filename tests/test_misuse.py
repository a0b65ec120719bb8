"""The library under misuse (issue "Trustworthy under misuse"): one test per finding.

Whatever may crash or hang runs in a subprocess with a timeout, and the test asserts on its
exit status and on the bytes.
"""
from __future__ import annotations

import concurrent.futures
import gc
import os
import stat
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import torch

import aioswap
from aioswap import safetensors as ast
from aioswap.errors import ShortReadError, SwapError

MiB = 1 << 20


def _run(code: str, timeout: float = 120, **kw: object) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; a crash or a hang fails the caller's asserts."""
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, **kw)  # type: ignore[call-overload]


# ----------------------------------------------------------- 1, 2: what a request holds


def test_async_request_on_open_file_keeps_its_tensor(tmp_path: Path) -> None:
    """An async f.pread/f.pwrite holds its tensor: dropping it while queued is safe."""
    p = tmp_path / "src.bin"
    data = os.urandom(16 * 65536)
    p.write_bytes(data)
    r = _run(f"""
        import gc, torch, aioswap
        with aioswap.AioHandle() as h, h.open({str(p)!r}, "r+") as f:
            for rnd in range(20):
                futs = [f.pread(torch.empty(65536, dtype=torch.uint8), i * 65536, async_op=True)
                        for i in range(16)]
                gc.collect()
                # heap churn: freed buffers get reused at once
                junk = [torch.full((65536,), 7, dtype=torch.uint8) for _ in range(32)]
                assert all(fu.result() == 65536 for fu in futs)
            out = {str(tmp_path / 'out.bin')!r}
        with aioswap.AioHandle() as h, h.open(out, "w") as f:
            futs = [f.pwrite(torch.full((65536,), i + 1, dtype=torch.uint8), i * 65536,
                             async_op=True) for i in range(16)]
            junk = [torch.zeros(65536, dtype=torch.uint8) for _ in range(64)]
            assert all(fu.result() == 65536 for fu in futs)
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    got = (tmp_path / "out.bin").read_bytes()
    assert got == b"".join(bytes([i + 1]) * 65536 for i in range(16))


def test_batch_calls_from_a_generator_hold_their_tensors(tmp_path: Path) -> None:
    """Sync pread_many/pwrite_many over a generator: every yielded tensor lives until reaped."""
    out = tmp_path / "gen.bin"
    r = _run(f"""
        import torch, aioswap
        with aioswap.AioHandle() as h, h.open({str(out)!r}, "w+") as f:
            n = h.pwrite_many((torch.full((4096,), i + 1, dtype=torch.uint8), f, i * 4096)
                              for i in range(16))
            assert n == [4096] * 16, n
            sums = []
            def reads():
                for i in range(16):
                    t = torch.empty(4096, dtype=torch.uint8)
                    sums.append(t)          # keep only to check, after the call
                    yield t, f, i * 4096
            h.pread_many(reads())
            assert [int(t[0]) for t in sums] == list(range(1, 17))
            # and the read side with nothing kept by the caller
            for _ in range(50):
                h.pread_many((torch.empty(4096, dtype=torch.uint8), f, i * 4096)
                             for i in range(16))
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    assert out.read_bytes() == b"".join(bytes([i + 1]) * 4096 for i in range(16))


# ----------------------------------------------------------- 3: released tensors


def test_touching_a_released_tensor_raises_naming_it(tmp_path: Path) -> None:
    r = _run(f"""
        import torch, aioswap
        from aioswap.errors import SwapError
        with aioswap.TensorSwapper({str(tmp_path / 'sw')!r}) as sw:
            sd = {{"w": torch.randn(1 << 16), "p": torch.nn.Parameter(torch.randn(64, 64))}}
            ref = {{k: v.detach().clone() for k, v in sd.items()}}
            sw.swap_out_state_dict("opt.", sd, release=True)
            for k, t in sd.items():
                assert t.untyped_storage().nbytes() == 0          # memory is freed
                assert t.shape == ref[k].shape and t.dtype == ref[k].dtype
                for use in (lambda: t.sum(), lambda: t + 1, lambda: t[0],
                            lambda: t.detach(), lambda: torch.stack([t, t]),
                            lambda: t.data_ptr()):
                    try:
                        use()
                    except SwapError as e:
                        assert repr("opt." + k) in str(e), str(e)
                    else:
                        raise AssertionError("a released tensor was usable")
                assert "released" in repr(t)
            sw.swap_in_state_dict("opt.")
            for k, t in sd.items():
                assert type(t) is type(ref[k]) or isinstance(t, torch.nn.Parameter)
                assert torch.equal(t.detach(), ref[k]), k
                t.sum()
        print("OK")
    """)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------- 4, 5: resources


def _resources() -> dict[str, int]:
    with open("/proc/self/status") as f:
        st = dict(line.split(":", 1) for line in f)
    maps = Path("/proc/self/maps").read_text()
    return {"fds": len(os.listdir("/proc/self/fd")), "aio": maps.count("[aio]"),
            "lck_kb": int(st["VmLck"].split()[0]), "threads": threading.active_count(),
            "rss_kb": int(st["VmRSS"].split()[0])}


def _flat(before: dict[str, int], after: dict[str, int], rss_slack_kb: int) -> None:
    for k in ("fds", "aio", "lck_kb", "threads"):
        assert after[k] <= before[k], (k, before, after)
    assert after["rss_kb"] - before["rss_kb"] <= rss_slack_kb, (before, after)


@pytest.mark.slow          # each handle's kernel context costs ~35 ms to destroy
def test_dropped_handles_are_freed(tmp_path: Path) -> None:
    """2,000 handles used asynchronously, half closed, half just dropped: nothing stays."""
    p = tmp_path / "d.bin"
    p.write_bytes(os.urandom(8192))

    def cycle(i: int) -> None:
        h = aioswap.AioHandle(queue_depth=4, bounce_bytes=64 << 10)
        f = h.open(p, "r")
        fut = f.pread(torch.empty(4096, dtype=torch.uint8), 0, async_op=True)
        assert fut.result() == 4096
        h.pread(bytearray(100), p, 7, async_op=True).result()
        f.close()
        if i % 2:
            h.close()

    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResourceWarning)       # the dropped ones say so
        for i in range(50):
            cycle(i)
        gc.collect()
        before = _resources()
        for i in range(2000):
            cycle(i)
        gc.collect()
    for _ in range(100):            # a dropped handle's close finishes on another thread
        if _resources()["threads"] <= before["threads"]:
            break
        threading.Event().wait(0.02)
    _flat(before, _resources(), rss_slack_kb=16 << 10)


def test_finished_requests_are_not_retained(tmp_path: Path) -> None:
    """A future whose result was taken, or that nobody holds, is not kept by its handle."""
    import weakref
    p = tmp_path / "r.bin"
    p.write_bytes(os.urandom(MiB))
    with aioswap.AioHandle() as h, h.open(p, "r") as f:
        refs = []
        for i in range(200):
            t = torch.empty(4096, dtype=torch.uint8)
            fut = f.pread(t, i * 4096, async_op=True)
            fut.result()
            refs.append(weakref.ref(fut))
            fut2 = h.pread(bytearray(512), p, 512, async_op=True)
            refs.append(weakref.ref(fut2))
            del fut, fut2, t
        assert h.wait() == 400          # counted, though no future was kept
        gc.collect()
        assert all(r() is None for r in refs)
        assert h.wait() == 0


def test_an_error_delivered_by_its_future_is_not_raised_again(tmp_path: Path) -> None:
    r = _run(f"""
        import resource, signal, torch, aioswap
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
        with aioswap.AioHandle(block_size=1 << 18) as h:
            bad = h.pwrite(torch.ones(2 << 20, dtype=torch.uint8), {str(tmp_path / 'b')!r},
                           async_op=True)
            good = h.pwrite(b"g" * 10, {str(tmp_path / 'g')!r}, async_op=True)
            print("ERR", bad.exception().errno, good.result())
            print("WAIT", h.wait(), h.wait())
    """)
    assert "ERR 27 10" in r.stdout and "WAIT 2 0" in r.stdout, r.stdout + r.stderr


# 200 rounds catch any fd, AIO context, locked page, thread or kept future (exact counts) and
# an RSS leak of 120 KiB a round; -m slow (CI) keeps the 1,000 rounds (24 KiB a round): on a
# busy disk they took up to 45 s of the default run.
@pytest.mark.parametrize("rounds", [pytest.param(200, id="200"),
                                    pytest.param(1000, id="1000", marks=pytest.mark.slow)])
def test_swapper_and_safetensors_leave_nothing_behind(tmp_path: Path, rounds: int) -> None:
    """Rounds of 2 swap cycles and 2 safetensors calls: fds, [aio], VmLck, threads, RSS
    flat."""
    sd = {"a": torch.randn(1000), "b": torch.arange(77, dtype=torch.int16)}
    st_path = tmp_path / "m.safetensors"
    with aioswap.TensorSwapper(tmp_path / "sw") as sw:
        def cycle(i: int) -> None:
            sw.swap_out_state_dict("s.", sd, overwrite=True)
            back = sw.swap_in_state_dict("s.")
            assert torch.equal(back["b"], sd["b"])
            sw.swap_out("one", sd["a"], overwrite=True)
            assert torch.equal(sw.swap_in("one"), sd["a"])
            ast.save_file(sd, st_path)
            assert torch.equal(ast.load_file(st_path)["a"], sd["a"])
        def futures() -> int:
            return sum(type(o) is aioswap.IOFuture for o in gc.get_objects())

        for i in range(30):
            cycle(i)
        gc.collect()
        before, nfut = _resources(), futures()
        for i in range(rounds):
            cycle(i)
        gc.collect()
        after = _resources()
        assert futures() <= nfut            # no finished request is kept by a handle
    _flat(before, after, rss_slack_kb=24 << 10)


# ----------------------------------------------------------- 6, 7: hangs


def test_close_from_a_done_callback(tmp_path: Path) -> None:
    p = tmp_path / "c.bin"
    p.write_bytes(os.urandom(32 * 4096))
    r = _run(f"""
        import threading, torch, aioswap
        h = aioswap.AioHandle()
        f = h.open({str(p)!r}, "r")
        futs = [f.pread(torch.empty(4096, dtype=torch.uint8), i * 4096, async_op=True)
                for i in range(32)]
        futs[0].add_done_callback(lambda _: h.close())
        h2 = aioswap.AioHandle()
        gen = [h2.pread(bytearray(4096), {str(p)!r}, i * 4096, async_op=True)
               for i in range(32)]
        gen[0].add_done_callback(lambda _: h2.close())
        assert all(fu.result(timeout=30) == 4096 for fu in futs + gen)
        for _ in range(500):
            if threading.active_count() == 1:
                break
            threading.Event().wait(0.01)
        assert h.closed and h2.closed and threading.active_count() == 1, threading.enumerate()
        assert open("/proc/self/maps").read().count("[aio]") == 0
        print("OK")
    """, timeout=60)
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr
    assert "cannot join" not in r.stderr


def test_wait_in_a_done_callback_is_refused(tmp_path: Path) -> None:
    p = tmp_path / "w.bin"
    p.write_bytes(os.urandom(32 * MiB))
    seen: list[BaseException] = []
    with aioswap.AioHandle(queue_depth=1, block_size=MiB) as h:
        def cb(_: object) -> None:
            if not threading.current_thread().name.startswith("aioswap-lane"):
                return                  # finished before the callback was added: ran here
            try:
                h.pread(bytearray(10), p, 0, async_op=True)
                h.wait()
            except RuntimeError as e:
                seen.append(e)
        for _ in range(20):             # until one callback ran on the completion thread
            fut = h.pread(torch.empty(32 * MiB, dtype=torch.uint8), p, 0, async_op=True)
            fut.add_done_callback(cb)
            # not fut.result(): a thread blocked there reaps and delivers itself, so the
            # callback would run here; concurrent.futures.wait leaves it to the lane
            concurrent.futures.wait([fut], timeout=30)
            h.wait()
            if seen:
                break
    assert seen and "callback" in str(seen[0])


def test_result_in_a_forked_child_raises(tmp_path: Path) -> None:
    p = tmp_path / "fk.bin"
    p.write_bytes(os.urandom(64 * MiB))
    r = _run(f"""
        import os, torch, aioswap
        h = aioswap.AioHandle(queue_depth=1, block_size=1 << 20)
        futs = [h.pread(torch.empty(64 << 20, dtype=torch.uint8), {str(p)!r}, async_op=True)
                for _ in range(4)]
        pid = os.fork()
        if pid == 0:
            code = 3
            try:
                for fu in futs:
                    if not fu.done():
                        fu.result()
                        code = 4
                        break
                else:
                    code = 5            # everything had finished before the fork
            except RuntimeError as e:
                code = 0 if "fork" in str(e) else 6
            os._exit(code)
        _, status = os.waitpid(pid, 0)
        print("CHILD", os.waitstatus_to_exitcode(status))
        h.wait(); h.close()
    """, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "CHILD 0" in r.stdout or "CHILD 5" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------- 8: FIFOs


@pytest.mark.parametrize("call", ["read_header", "load_file", "safe_open"])
def test_safetensors_refuses_a_fifo(tmp_path: Path, call: str) -> None:
    fifo = tmp_path / "pipe.safetensors"
    os.mkfifo(fifo)
    r = _run(f"""
        from aioswap import safetensors as st
        try:
            x = st.{call}({str(fifo)!r})
        except st.SafetensorsError as e:
            print("REFUSED", "not a regular file" in str(e))
    """, timeout=20)
    assert r.returncode == 0 and "REFUSED True" in r.stdout, r.stdout + r.stderr


# ----------------------------------------------------------- 9, 10: files


def _ramfs(tmp_path: Path) -> Path:
    mnt = tmp_path / "ramfs"
    mnt.mkdir()
    if os.geteuid() != 0 or subprocess.run(["mount", "-t", "ramfs", "ramfs", str(mnt)],
                                           capture_output=True).returncode != 0:
        pytest.skip("mounting a ramfs (a file system that refuses O_DIRECT) needs root")
    return mnt


@pytest.mark.parametrize("mode", ["w", "w+"])
def test_buffered_fallback_truncates(tmp_path: Path, mode: str) -> None:
    mnt = _ramfs(tmp_path)
    try:
        p = mnt / "f.bin"
        p.write_bytes(b"x" * 10000)
        with pytest.warns(aioswap.errors.DirectIOFallbackWarning), \
                aioswap.AioHandle() as h, h.open(p, mode) as f:
            assert not f.direct
            f.pwrite(b"new", 0)
        assert p.read_bytes() == b"new"
        assert stat.S_IMODE(p.stat().st_mode) == 0o644 or p.exists()
    finally:
        subprocess.run(["umount", str(mnt)], check=True)


@pytest.mark.parametrize("locked", [False, True])
def test_read_after_truncation_writes_nothing_past_the_data(tmp_path: Path,
                                                            locked: bool) -> None:
    p = tmp_path / "t.bin"
    p.write_bytes(os.urandom(4 * MiB))
    with aioswap.AioHandle() as h, h.open(p, "r") as f:
        dst = (aioswap.pinned.empty(4 * MiB, torch.uint8) if locked
               else torch.empty(4 * MiB, dtype=torch.uint8))
        assert f.pread(dst[:MiB], 0) == MiB        # the file's size is known to the handle
        os.truncate(p, 100 * 1024 + 3)           # as another process would
        dst.fill_(0xAA)
        with pytest.raises(ShortReadError):
            f.pread(dst, 0)
        assert bool((dst[100 * 1024 + 3:] == 0xAA).all())
        with pytest.raises(ShortReadError):
            f.pread(dst, 0, async_op=True).result()
        assert bool((dst[100 * 1024 + 3:] == 0xAA).all())


# ----------------------------------------------------------- 11: error quality


def test_huge_zero_element_shapes_are_refused_with_the_file(tmp_path: Path) -> None:
    import json
    import struct
    p = tmp_path / "huge.safetensors"
    head = json.dumps({"x": {"dtype": "F32", "shape": [0, 2**62, 2**62],
                             "data_offsets": [0, 0]}}).encode()
    head += b" " * (-len(head) % 8)
    p.write_bytes(struct.pack("<Q", len(head)) + head)
    with pytest.raises(ast.SafetensorsError, match="huge.safetensors"):
        ast.read_header(p)
    with pytest.raises(ast.SafetensorsError, match="huge.safetensors"):
        ast.load_file(p)


def test_huge_shapes_in_a_swap_manifest_are_refused(tmp_path: Path) -> None:
    import json
    d = tmp_path / "sw"
    with aioswap.TensorSwapper(d) as sw:
        sw.swap_out("x", torch.empty(0, 4))
    man = next(q for q in d.iterdir() if q.name.endswith(".json"))
    doc = json.loads(man.read_text())
    entries = doc["entries"] if isinstance(doc, dict) and "entries" in doc else doc
    entry = entries[0] if isinstance(entries, list) else next(iter(entries.values()))
    entry["shape"] = [0, 2**62, 2**62]
    entry["stride"] = [2**62, 2**62, 1]
    man.write_text(json.dumps(doc))
    with pytest.raises(SwapError, match="too large"):
        with aioswap.TensorSwapper(d) as sw:
            sw.swap_in("x")


def test_save_file_of_conjugate_and_negative_views(tmp_path: Path) -> None:
    x = torch.randn(5, 3, dtype=torch.complex64)
    tensors = {"c": x.conj(), "n": x.conj().imag, "t": x.conj().t()}
    ast.save_file(tensors, tmp_path / "c.safetensors")
    back = ast.load_file(tmp_path / "c.safetensors")
    for k, v in tensors.items():
        assert torch.equal(back[k], v.resolve_conj().resolve_neg()), k


# ----------------------------------------------------------- 12: import hooks


def test_deepspeed_finder_beside_another_delegating_finder() -> None:
    """With a finder that asks every other finder (a common import-hook pattern), in both
    install orders, importing a hooked name neither recurses nor fails."""
    r = _run("""
        import importlib.abc, sys
        import aioswap.compat.deepspeed as ads

        class Delegating(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                for f in sys.meta_path:
                    if f is self:
                        continue
                    spec = f.find_spec(name, path, target) if hasattr(f, "find_spec") else None
                    if spec is not None:
                        return spec
                return None

        for order in ("ours-first", "theirs-first"):
            for m in [m for m in sys.modules if m.startswith("deepspeed")]:
                del sys.modules[m]
            d = Delegating()
            if order == "theirs-first":
                ads.install(); sys.meta_path.insert(0, d)
            else:
                sys.meta_path.insert(0, d); ads.install()
            import deepspeed.ops.op_builder.async_io as m
            assert m is not None
            sys.meta_path.remove(d); ads.uninstall()
        print("OK")
    """, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    if "No module named 'deepspeed'" in r.stderr:
        pytest.skip("deepspeed is not installed")
    assert r.returncode == 0 and "OK" in r.stdout, r.stdout + r.stderr[-3000:]


# ----------------------------------------------------------- 14: cost per call


def test_module_functions_share_one_handle(tmp_path: Path) -> None:
    """load_file/save_file/safe_open without handle= reuse one process-wide handle (no
    kernel context made and destroyed per call), and it works again after fork."""
    from aioswap.handle import shared_handle
    sd = {"a": torch.arange(10)}
    p = tmp_path / "s.safetensors"
    ast.save_file(sd, p)
    h = shared_handle()
    for _ in range(5):
        ast.save_file(sd, p)
        assert torch.equal(ast.load_file(p)["a"], sd["a"])
        with ast.safe_open(p) as f:
            assert torch.equal(f.get_tensor("a"), sd["a"])
    assert shared_handle() is h and not h.closed
    r = _run(f"""
        import os, torch
        from aioswap import safetensors as st
        from aioswap.handle import shared_handle
        a = shared_handle()
        assert torch.equal(st.load_file({str(p)!r})["a"], torch.arange(10))
        pid = os.fork()
        if pid == 0:
            ok = shared_handle() is not a and torch.equal(st.load_file({str(p)!r})["a"],
                                                          torch.arange(10))
            os._exit(0 if ok else 1)
        print("CHILD", os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
    """, timeout=60)
    assert "CHILD 0" in r.stdout, r.stdout + r.stderr
