"""TensorSwapper with nested state: optimizer, scheduler, model and RNG states round-trip."""
from __future__ import annotations

import json
import math
import random
from collections import OrderedDict
from pathlib import Path
from typing import Any

import pytest
import torch

from aioswap.errors import SwapError
from aioswap.swap import MANIFEST_NAME, TensorSwapper


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().clone().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: Any, b: Any) -> None:
    """Equal structure, types (list vs tuple, int vs float), keys and tensor bytes."""
    assert type(a) is type(b), (a, b)
    if isinstance(a, torch.Tensor):
        assert (a.dtype, a.shape) == (b.dtype, b.shape)
        assert _bytes(a) == _bytes(b)
    elif isinstance(a, dict):
        assert list(a) == list(b)
        assert [type(k) for k in a] == [type(k) for k in b]
        for k in a:
            _same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b):
            _same(x, y)
    elif isinstance(a, float) and math.isnan(a):
        assert math.isnan(b)
    else:
        assert a == b


def _model_and_opt(seed: int) -> tuple[torch.nn.Module, torch.optim.Optimizer, Any]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, betas=(0.8, 0.95), weight_decay=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, i: int) -> None:
    gen = torch.Generator().manual_seed(100 + i)
    x = torch.randn(8, 16, generator=gen)
    opt.zero_grad()
    model(x).pow(2).mean().backward()
    opt.step()
    sched.step()


@pytest.mark.parametrize("release", [False, True])
def test_adamw_and_scheduler_round_trip_then_one_more_step(tmp_dir: Path, release: bool) -> None:
    model, opt, sched = _model_and_opt(0)
    for i in range(3):
        _step(model, opt, sched, i)
    # reference: the same run continued in memory
    ref_model, ref_opt, ref_sched = _model_and_opt(0)
    for i in range(3):
        _step(ref_model, ref_opt, ref_sched, i)
    _step(ref_model, ref_opt, ref_sched, 3)

    opt_sd, sched_sd = opt.state_dict(), sched.state_dict()
    expect_opt = {"state": {k: {n: v.clone() for n, v in s.items()}
                            for k, s in opt_sd["state"].items()},
                  "param_groups": [dict(g) for g in opt_sd["param_groups"]]}
    expect_sched = dict(sched_sd)
    d = tmp_dir / "swap"
    with TensorSwapper(d, pin_memory=False) as sw:
        names = sw.swap_out_state_dict("opt/", opt_sd, release=release)
        assert names == [f"opt/state.{k}.{n}" for k in opt_sd["state"]
                         for n in ("step", "exp_avg", "exp_avg_sq")]
        sw.swap_out_state_dict("sched/", sched_sd)
        if release:
            assert all(t.untyped_storage().nbytes() == 0
                       for s in opt_sd["state"].values() for t in s.values())
            got = sw.swap_in_state_dict("opt/")
            for k, s in opt_sd["state"].items():       # restored in place, same objects
                for n, t in s.items():
                    assert got["state"][k][n] is t
    # a new swapper (a new process would see the same): everything from the manifest
    with TensorSwapper(d, pin_memory=False) as sw:
        got_opt = sw.swap_in_state_dict("opt/")
        got_sched = sw.swap_in_state_dict("sched/")
    _same(expect_opt, got_opt)
    _same(expect_sched, got_sched)
    assert isinstance(got_opt["param_groups"][0]["betas"], tuple)
    assert list(got_opt["state"]) == [0, 1, 2, 3]                  # int keys stay int

    model2, opt2, sched2 = _model_and_opt(1)          # other weights, fresh optimizer
    model2.load_state_dict({k: v.clone() for k, v in model.state_dict().items()})
    opt2.load_state_dict(got_opt)
    sched2.load_state_dict(got_sched)
    _step(model2, opt2, sched2, 3)
    for p, q in zip(model2.parameters(), ref_model.parameters()):
        assert _bytes(p) == _bytes(q)
    _same(ref_opt.state_dict()["state"], opt2.state_dict()["state"])
    assert sched2.state_dict() == ref_sched.state_dict()


def test_plain_values_keys_and_containers_keep_their_types(tmp_dir: Path) -> None:
    gen = torch.Generator().manual_seed(7)
    meta = OrderedDict([("", {"version": 1}), ("0", {"version": 2})])
    od: OrderedDict[str, Any] = OrderedDict([("w", torch.randn(3, 4, generator=gen))])
    od._metadata = meta                                       # type: ignore[attr-defined]
    state = {
        "ints": {0: torch.arange(5), 1: "one", -7: None, 2**70: True},
        "list": [1, 2.5, "x", None, False, [], (), {}],
        "tuple": (torch.ones(2, dtype=torch.bfloat16), (1, (2, [3]))),
        "floats": [float("nan"), float("inf"), -float("inf"), -0.0, 1e-310, 0.1],
        "keys": {(1, "a"): 1, 2.5: 2, None: 3, True: 4, "s": 5},
        "model": od,
        "rng": {"torch": torch.get_rng_state(), "python": random.getstate()},
        "empty": torch.empty(0, 3),
    }
    d = tmp_dir / "s"
    with TensorSwapper(d) as sw:
        sw.swap_out_state_dict("x/", state)
    raw = (d / MANIFEST_NAME).read_text()
    json.loads(raw)                                           # plain JSON, nothing pickled
    with TensorSwapper(d) as sw:
        got = sw.swap_in_state_dict("x/")
    _same(state, got)
    assert got["model"]._metadata == meta
    assert str(-0.0) == str(got["floats"][3])
    assert got["rng"]["python"] == state["rng"]["python"]


def test_unsupported_values_and_name_clashes_are_refused_before_any_io(tmp_dir: Path) -> None:
    with TensorSwapper(tmp_dir / "s") as sw:
        with pytest.raises(TypeError, match=r"object at \['a'\]\[1\]"):
            sw.swap_out_state_dict("p/", {"a": [1, object()]})
        with pytest.raises(TypeError, match="key"):
            sw.swap_out_state_dict("p/", {"a": {frozenset(): 1}})
        loop: list[Any] = []
        loop.append(loop)
        with pytest.raises(TypeError, match="contains itself"):
            sw.swap_out_state_dict("p/", {"a": loop})
        with pytest.raises(SwapError, match="both be named 'p/a.b'"):
            sw.swap_out_state_dict("p/", {"a.b": torch.ones(1), "a": {"b": torch.ones(1)}})
        with pytest.raises(TypeError, match="mapping"):
            sw.swap_out_state_dict("p/", [torch.ones(1)])     # type: ignore[arg-type]
        assert sw.names() == []
        assert not (Path(sw.directory) / MANIFEST_NAME).read_text().count('"trees"')
        sw.swap_out_state_dict("p/", {"lr": 0.5, "t": [torch.ones(2)]})
        with pytest.raises(SwapError, match="already swapped out"):
            sw.swap_out_state_dict("p/", {"lr": 0.1})
        sw.swap_out_state_dict("p/", {"lr": 0.1, "t": [torch.zeros(2)]}, overwrite=True)
        _same({"lr": 0.1, "t": [torch.zeros(2)]}, sw.swap_in_state_dict("p/"))


def test_state_without_tensors_and_its_removal(tmp_dir: Path) -> None:
    d = tmp_dir / "s"
    fresh = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1).state_dict()
    with TensorSwapper(d) as sw:
        assert sw.swap_out_state_dict("sgd/", fresh) == []
        sw.swap_out_state_dict("n/", {"a": {"x": torch.ones(3)}, "b": [torch.zeros(2)]})
    with TensorSwapper(d) as sw:
        _same(fresh, sw.swap_in_state_dict("sgd/"))
        sw.remove("n/b.0")                      # the structure is gone with one of its tensors
        flat = sw.swap_in_state_dict("n/")
        assert list(flat) == ["a.x"] and torch.equal(flat["a.x"], torch.ones(3))
        sw.clear()
        with pytest.raises(SwapError, match="starts with 'sgd/'"):
            sw.swap_in_state_dict("sgd/")
    assert "trees" not in json.loads((d / MANIFEST_NAME).read_text())


def test_fill_nested_outs_and_async(tmp_dir: Path) -> None:
    state = {"state": {0: {"m": torch.arange(6.0)}}, "groups": [{"params": [0], "lr": 1.0}]}
    with TensorSwapper(tmp_dir / "s") as sw:
        sw.swap_out_state_dict("o/", state)
        out = torch.full((6,), -1.0)
        target: dict[Any, Any] = {"state": {0: {"m": out}}, "other": 5}
        got = sw.swap_in_state_dict("o/", state_dict=target)
        assert got is target and got["other"] == 5
        assert got["state"][0]["m"] is out and torch.equal(out, torch.arange(6.0))
        fut = sw.swap_in_state_dict("o/", async_op=True)
        _same(state, fut.result(timeout=60))


def test_malformed_skeleton_is_a_swap_error(tmp_dir: Path) -> None:
    d = tmp_dir / "s"
    with TensorSwapper(d) as sw:
        sw.swap_out_state_dict("o/", {"a": [torch.ones(1)]})
    doc = json.loads((d / MANIFEST_NAME).read_text())
    doc["trees"]["o/"]["tree"] = {"D": [["a", {"X": 1}]]}
    (d / MANIFEST_NAME).write_text(json.dumps(doc))
    with TensorSwapper(d) as sw:
        with pytest.raises(SwapError, match="malformed state skeleton"):
            sw.swap_in_state_dict("o/")
    doc["trees"]["o/"]["names"] = ["nope"]
    (d / MANIFEST_NAME).write_text(json.dumps(doc))
    with pytest.raises(SwapError, match="must name published tensors"):
        TensorSwapper(d)
