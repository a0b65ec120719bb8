"""AioConfig: strict parsing of the "aio" section, exact emission, round trips."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from aioswap.config import (DEEPSPEED_DEFAULTS, DEFAULT_CONFIG, ENVIRONMENT, AioConfig,
                            RuntimeSettings, default_config, runtime_settings)
from aioswap.errors import ConfigError

KEYS = {"block_size", "queue_depth", "intra_op_parallelism",
        "single_submit", "overlap_events", "use_gds"}


def test_defaults() -> None:
    c = AioConfig()
    assert c == DEFAULT_CONFIG
    assert (c.block_size, c.queue_depth, c.intra_op_parallelism) == (1 << 20, 32, 1)
    assert (c.single_submit, c.overlap_events, c.use_gds) == (False, True, False)


def test_to_dict_exact_keys_and_json_booleans() -> None:
    d = AioConfig(single_submit=True, overlap_events=False, use_gds=True).to_dict()
    assert set(d) == KEYS
    for key in ("single_submit", "overlap_events", "use_gds"):
        assert type(d[key]) is bool
    for key in ("block_size", "queue_depth", "intra_op_parallelism"):
        assert type(d[key]) is int
    text = AioConfig(single_submit=True, overlap_events=False).to_json(indent=None)
    assert '"single_submit": true' in text and '"overlap_events": false' in text
    assert '"true"' not in text and '"false"' not in text


configs = st.builds(
    AioConfig,
    block_size=st.integers(1, 1 << 15).map(lambda n: n * 4096),
    queue_depth=st.integers(1, 65535),
    intra_op_parallelism=st.integers(1, 256),
    single_submit=st.booleans(),
    overlap_events=st.booleans(),
    use_gds=st.booleans(),
)


@given(configs)
def test_round_trip(c: AioConfig) -> None:
    assert AioConfig.from_dict(c.to_dict()) == c
    assert AioConfig.from_dict({"aio": c.to_dict()}) == c
    assert AioConfig.from_json(c.to_json()) == c
    assert AioConfig.from_json(c.to_json(wrap=False, indent=None)) == c
    wrapped = json.loads(c.to_json())
    assert list(wrapped) == ["aio"] and wrapped["aio"] == c.to_dict()


def test_from_json_file(tmp_path: Path) -> None:
    c = AioConfig(block_size=8 << 20, queue_depth=128, intra_op_parallelism=8)
    p = tmp_path / "ds_config.json"
    p.write_text(c.to_json())
    assert AioConfig.from_json(p) == c
    assert AioConfig.from_json(str(p)) == c


def test_from_json_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot parse JSON text"):
        AioConfig.from_json('{"aio": {')
    with pytest.raises(ConfigError, match="duplicate key 'queue_depth'"):
        AioConfig.from_json('{"queue_depth": 8, "queue_depth": 16}')
    p = tmp_path / "list.json"
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="must hold a JSON object, got list"):
        AioConfig.from_json(p)
    with pytest.raises(FileNotFoundError):
        AioConfig.from_json(tmp_path / "missing.json")


def test_missing_keys_take_deepspeeds_defaults() -> None:
    """A partial DeepSpeed section means what it means to DeepSpeed (queue depth 8)."""
    assert DEEPSPEED_DEFAULTS.to_dict() == {
        "block_size": 1048576, "queue_depth": 8, "intra_op_parallelism": 1,
        "single_submit": False, "overlap_events": True, "use_gds": False}
    assert AioConfig.from_dict({}) == DEEPSPEED_DEFAULTS
    assert AioConfig.from_dict({"aio": {}}) == DEEPSPEED_DEFAULTS
    assert AioConfig.from_dict({"aio": {"block_size": 4096}}).queue_depth == 8
    assert AioConfig.from_dict({"queue_depth": 16}) == AioConfig(queue_depth=16)
    # aioswap's own defaults on request, and for a handle built without a config
    assert AioConfig.from_dict({}, defaults=DEFAULT_CONFIG) == DEFAULT_CONFIG
    assert DEFAULT_CONFIG.queue_depth == 32
    assert AioConfig(queue_depth=4).replace(block_size=8192).queue_depth == 4


def test_environment_overrides_the_defaults() -> None:
    env = {"AIOSWAP_BLOCK_SIZE": "256K", "AIOSWAP_QUEUE_DEPTH": "64",
           "AIOSWAP_INTRA_OP_PARALLELISM": "2", "AIOSWAP_SINGLE_SUBMIT": "true",
           "AIOSWAP_OVERLAP_EVENTS": "0", "AIOSWAP_USE_GDS": "no", "AIOSWAP_BUFFERED": "1",
           "AIOSWAP_POOL_SIZE": "64M", "AIOSWAP_LOG_LEVEL": "debug", "UNRELATED": "x"}
    s = runtime_settings(env)
    assert s.aio == AioConfig(block_size=256 << 10, queue_depth=64, intra_op_parallelism=2,
                              single_submit=True, overlap_events=False)
    assert (s.buffered, s.pool_size, s.log_level) == (True, 64 << 20, "DEBUG")
    assert default_config({}) == DEFAULT_CONFIG
    assert runtime_settings({}) == RuntimeSettings(DEFAULT_CONFIG)
    names = {row[0] for row in ENVIRONMENT}
    assert {k for k in env if k.startswith("AIOSWAP_")} <= names


def test_environment_bad_values_name_the_variable() -> None:
    with pytest.raises(ConfigError) as info:
        runtime_settings({"AIOSWAP_QUEUE_DEPTH": "deep", "AIOSWAP_BUFFERED": "maybe",
                          "AIOSWAP_BLOCK_SIZE": "1.3K", "AIOSWAP_LOG_LEVEL": "loud"})
    msg = str(info.value)
    for needle in ("AIOSWAP_QUEUE_DEPTH='deep'", "AIOSWAP_BUFFERED='maybe'",
                   "AIOSWAP_BLOCK_SIZE='1.3K'", "AIOSWAP_LOG_LEVEL='loud'"):
        assert needle in msg, (needle, msg)
    with pytest.raises(ConfigError, match="queue_depth must be between 1 and 65535"):
        default_config({"AIOSWAP_QUEUE_DEPTH": "0"})


def test_whole_deepspeed_config_reads_only_aio_section() -> None:
    ds = {
        "train_batch_size": 16,
        "zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}},
        "aio": {"block_size": 262144, "queue_depth": 16, "intra_op_parallelism": 4,
                "single_submit": True, "overlap_events": False, "use_gds": False},
    }
    c = AioConfig.from_dict(ds)
    assert c == AioConfig(block_size=262144, queue_depth=16, intra_op_parallelism=4,
                          single_submit=True, overlap_events=False)


def err(d: Any) -> str:
    with pytest.raises(ConfigError) as info:
        AioConfig.from_dict(d)
    return str(info.value)


@pytest.mark.parametrize("alias", ["num_threads", "thread_count"])
def test_deepspeed_aliases_name_the_right_key(alias: str) -> None:
    msg = err({"aio": {alias: 8}})
    assert f"unknown key '{alias}'" in msg
    assert "did you mean 'intra_op_parallelism'?" in msg


@pytest.mark.parametrize("typo, right", [
    ("queue_dept", "queue_depth"),
    ("blocksize", "block_size"),
    ("block_sz", "block_size"),
    ("overlap_event", "overlap_events"),
    ("singel_submit", "single_submit"),
    ("usegds", "use_gds"),
    ("Queue_Depth", "queue_depth"),
    ("iodepth", "queue_depth"),
])
def test_typos_suggest_close_match(typo: str, right: str) -> None:
    msg = err({typo: 1})
    assert f"unknown key '{typo}'" in msg
    assert f"did you mean '{right}'?" in msg


def test_unknown_key_without_close_match() -> None:
    msg = err({"aio": {"compression": "zstd"}})
    assert msg == "invalid aio config: unknown key 'compression' in the 'aio' section"


@pytest.mark.parametrize("key", ["single_submit", "overlap_events", "use_gds"])
@pytest.mark.parametrize("value", ["true", "false", "True", ""])
def test_string_where_boolean_belongs(key: str, value: str) -> None:
    msg = err({key: value})
    assert msg == (f"invalid aio config: {key} must be a JSON boolean (true or false), "
                   f"got the string {value!r}")


@pytest.mark.parametrize("value", [0, 1, None, 1.0])
def test_non_boolean_where_boolean_belongs(value: Any) -> None:
    msg = err({"overlap_events": value})
    assert re.search(r"overlap_events must be a JSON boolean \(true or false\), got "
                     + type(value).__name__, msg)


@pytest.mark.parametrize("key", ["block_size", "queue_depth", "intra_op_parallelism"])
def test_bool_where_int_belongs(key: str) -> None:
    assert err({key: True}) == f"invalid aio config: {key} must be an integer, got the " \
                               f"boolean true"
    with pytest.raises(ConfigError, match=f"{key} must be an integer, got the boolean false"):
        AioConfig(**{key: False})


@pytest.mark.parametrize("value, shown", [(1.5, "1.5"), ("8", "str '8'"), ("1M", "str '1M'"),
                                          (None, "NoneType None"), (float("nan"), "nan")])
def test_non_integer_where_int_belongs(value: Any, shown: str) -> None:
    assert err({"queue_depth": value}).endswith(f"queue_depth must be an integer, got {shown}")


def test_integral_float_accepted_as_int() -> None:
    c = AioConfig.from_dict({"block_size": 8192.0, "queue_depth": 16.0})
    assert c.block_size == 8192 and type(c.block_size) is int
    assert c.queue_depth == 16 and type(c.queue_depth) is int
    c2 = AioConfig(intra_op_parallelism=2.0)  # type: ignore[arg-type]
    assert type(c2.intra_op_parallelism) is int


@pytest.mark.parametrize("value", [0, -4096, -1])
def test_block_size_range(value: int) -> None:
    assert err({"block_size": value}) == (
        f"invalid aio config: block_size must be positive, got {value}")


@pytest.mark.parametrize("value", [1, 512, 1000, 1024, 4097, 1000000])
def test_block_size_any_positive(value: int) -> None:
    # DeepNVMe accepts any positive block size (its tests use 1024); handles round pieces
    # to the file's O_DIRECT alignment.
    assert AioConfig(block_size=value).block_size == value


@pytest.mark.parametrize("value", [0, -2, 257, 2**40])
def test_parallelism_range(value: int) -> None:
    assert err({"intra_op_parallelism": value}) == (
        f"invalid aio config: intra_op_parallelism must be between 1 and 256, got {value}")


def test_block_size_upper_bound() -> None:
    assert "block_size must be at most" in err({"block_size": 1 << 31})
    assert AioConfig(block_size=0x7FFFF000).block_size == 0x7FFFF000


@pytest.mark.parametrize("value", [0, -1, 65536])
def test_queue_depth_range(value: int) -> None:
    assert err({"queue_depth": value}) == (
        f"invalid aio config: queue_depth must be between 1 and 65535, got {value}")
    assert AioConfig(queue_depth=1).queue_depth == 1
    assert AioConfig(queue_depth=65535).queue_depth == 65535




def test_every_problem_in_one_message() -> None:
    msg = err({"num_threads": 4, "single_submit": "false", "queue_depth": 0})
    assert "num_threads" in msg and "single_submit" in msg and "queue_depth" in msg


def test_not_a_mapping() -> None:
    assert err([("block_size", 4096)]) == "an aio config must be a mapping, got list"
    assert err({"aio": "fast"}) == "the 'aio' section must be a mapping, got str"


def test_constructor_validates() -> None:
    with pytest.raises(ConfigError, match="single_submit must be a JSON boolean"):
        AioConfig(single_submit="false")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="queue_depth must be between 1 and 65535"):
        AioConfig(queue_depth=0)


def test_replace() -> None:
    c = DEFAULT_CONFIG.replace(queue_depth=64, use_gds=True)
    assert c.queue_depth == 64 and c.use_gds and c.block_size == DEFAULT_CONFIG.block_size
    assert DEFAULT_CONFIG.queue_depth == 32  # frozen original unchanged
    with pytest.raises(ConfigError, match="did you mean 'intra_op_parallelism'"):
        DEFAULT_CONFIG.replace(num_threads=4)
    with pytest.raises(ConfigError, match="block_size must be positive"):
        DEFAULT_CONFIG.replace(block_size=0)

def test_frozen_and_hashable() -> None:
    with pytest.raises(AttributeError):
        DEFAULT_CONFIG.queue_depth = 1  # type: ignore[misc]
    assert len({AioConfig(), AioConfig(), AioConfig(queue_depth=8)}) == 2


def test_config_error_is_value_error() -> None:
    with pytest.raises(ValueError):
        AioConfig.from_dict({"bogus": 1})


def test_ds_nvme_tune_output_is_refused_with_every_gap_named() -> None:
    # What DeepSpeed's ds_nvme_tune prints: num_threads and string booleans.
    printed = {"aio": {"single_submit": "false", "overlap_events": "true", "num_threads": 8,
                       "block_size": 1048576, "queue_depth": 32}}
    msg = err(printed)
    assert "single_submit must be a JSON boolean" in msg
    assert "overlap_events must be a JSON boolean" in msg
    assert "unknown key 'num_threads'" in msg and "'intra_op_parallelism'" in msg


def test_log_level_variable_sets_the_aioswap_logger() -> None:
    import subprocess
    import sys
    code = "import logging, aioswap.config; print(logging.getLogger('aioswap').level)"
    env = {**__import__("os").environ, "AIOSWAP_LOG_LEVEL": "debug"}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "10"
    # a bad value does not break the import (nor print a warning with a source line there);
    # a handle and the tools raise ConfigError naming it
    env["AIOSWAP_LOG_LEVEL"] = "loud"
    code += "; aioswap.AioHandle()"
    done = subprocess.run([sys.executable, "-W", "always", "-c", code], env=env,
                          capture_output=True, text=True, check=False)
    assert done.stdout.strip() == "0" and done.returncode == 1
    assert done.stderr.splitlines()[-1].startswith("aioswap.errors.ConfigError: "
                                                   "AIOSWAP_LOG_LEVEL='loud'"), done.stderr
    assert "Warning" not in done.stderr


def test_deepspeed_variable_is_checked() -> None:
    from aioswap.config import runtime_settings
    with pytest.raises(ConfigError, match="AIOSWAP_DEEPSPEED='maybe'"):
        runtime_settings({"AIOSWAP_DEEPSPEED": "maybe"})
    runtime_settings({"AIOSWAP_DEEPSPEED": "1"})
