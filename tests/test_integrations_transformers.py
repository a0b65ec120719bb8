"""aioswap.integrations.transformers: ``from_pretrained`` of a local safetensors checkpoint
read through aioswap gives the stock model bit for bit (every parameter, the logits), really
reads through aioswap, names the file that is wrong, and uninstall() gives the stock method
back (the very object)."""
from __future__ import annotations

import copy
import gc
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import aioswap.integrations.transformers as it
from aioswap.tune import drop_cache
from aioswap import safetensors as ast
from aioswap.errors import ShortReadError

transformers = pytest.importorskip("transformers")
from transformers import modeling_utils  # noqa: E402

# without CAP_IPC_LOCK and with a small RLIMIT_MEMLOCK reads go to unlocked memory with one
# warning (as in test_safetensors)
pytestmark = pytest.mark.filterwarnings("ignore::aioswap.pinned.PinnedMemoryWarning")

STOCK = modeling_utils.PreTrainedModel.__dict__["_load_pretrained_model"]
IDS = torch.tensor([[1, 7, 42, 3, 99, 12]])
LAYOUTS = ["sharded", "single"]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _config() -> Any:
    return transformers.LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[tuple[str, str], Path]:
    """A tiny random Llama (0.7 MB in fp32) saved in >= 3 shards and in one file, fp32/bf16."""
    out = {}
    for dname, dtype in DTYPES.items():
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(_config(), dtype=dtype)
        for layout in LAYOUTS:
            path = tmp_path_factory.mktemp(f"llama-{layout}-{dname}")
            size = f"{50 * dtype.itemsize}KB" if layout == "sharded" else "1GB"
            model.save_pretrained(path, max_shard_size=size)
            n = len(list(path.glob("*.safetensors")))
            assert n >= 3 if layout == "sharded" else n == 1
            out[layout, dname] = path
    return out


@pytest.fixture(autouse=True)
def _uninstalled(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    # these tiny checkpoints are always in the page cache, which read="auto" leaves to
    # transformers' mapping: off here, tested by test_cached_checkpoint_left_to_stock
    monkeypatch.setattr(it, "_CACHED_SHARE", None)
    it.uninstall()
    yield
    it.uninstall()
    gc.collect()
    assert not [t for t in threading.enumerate() if t.name == "aioswap-transformers"]


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> list[list[str]]:
    """The files of every stream aioswap.safetensors was asked to read."""
    calls: list[list[str]] = []
    real = ast._stream

    def stream(sources: Any, *args: Any, **kwargs: Any) -> Any:
        calls.append([os.path.basename(s.path) for s in sources])
        return real(sources, *args, **kwargs)

    monkeypatch.setattr(ast, "_stream", stream)
    return calls


def _load(path: Path, **kwargs: Any) -> Any:
    return transformers.AutoModelForCausalLM.from_pretrained(path, **kwargs)


def _assert_same(got: Any, ref: Any) -> None:
    a, b = got.state_dict(), ref.state_dict()
    assert list(a) == list(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k
    with torch.no_grad():
        x, y = got(IDS).logits, ref(IDS).logits
    assert x.dtype == y.dtype and torch.equal(x, y)


def _tensor_bytes(path: Path) -> tuple[int, int]:
    """(tensors, bytes) of every shard of the checkpoint at ``path``."""
    headers = [ast.read_header(f) for f in path.glob("*.safetensors")]
    return (sum(len(h.tensors) for h in headers),
            sum(i.nbytes for h in headers for i in h.tensors.values()))


@pytest.mark.parametrize("dname", list(DTYPES))
@pytest.mark.parametrize("layout", LAYOUTS)
def test_same_as_stock(checkpoints: dict[tuple[str, str], Path], layout: str, dname: str,
                       spy: list[list[str]]) -> None:
    path = checkpoints[layout, dname]
    stock = _load(path)
    assert spy == []
    it.install()
    got = _load(path)
    _assert_same(got, stock)
    # read through aioswap: one stream over every shard, every tensor handed over from it
    shards = sorted(p.name for p in path.glob("*.safetensors"))
    assert spy == [shards]
    n, nbytes = _tensor_bytes(path)
    st = it.stats()
    assert (st.loads, st.stock_loads, st.files, st.tensors, st.bytes_read, st.rereads) == \
        (1, 0, len(shards), n, nbytes, 0)


@pytest.mark.parametrize("read", ["direct", "buffered", "auto"])
def test_read_modes(checkpoints: dict[tuple[str, str], Path], read: str) -> None:
    path = checkpoints["sharded", "bf16"]
    stock = _load(path)
    it.install(read=read)
    _assert_same(_load(path), stock)
    assert it.stats().loads == 1


def test_dtype_cast_as_stock(checkpoints: dict[tuple[str, str], Path]) -> None:
    """A checkpoint loaded in another dtype is cast as stock casts it."""
    path = checkpoints["sharded", "fp32"]
    stock = _load(path, dtype=torch.bfloat16)
    it.install()
    got = _load(path, dtype=torch.bfloat16)
    assert next(got.parameters()).dtype == torch.bfloat16
    _assert_same(got, stock)


def test_install_uninstall_round_trip(checkpoints: dict[tuple[str, str], Path],
                                      spy: list[list[str]]) -> None:
    cls = modeling_utils.PreTrainedModel
    path = checkpoints["sharded", "fp32"]
    stock = _load(path)
    it.install()
    patched = cls.__dict__["_load_pretrained_model"]
    assert patched is not STOCK
    it.install()                                   # idempotent: not wrapped twice
    assert cls.__dict__["_load_pretrained_model"] is patched
    assert it.installed()
    _assert_same(_load(path), stock)
    assert it.stats().loads == 1 and len(spy) == 1
    it.uninstall()
    it.uninstall()
    assert not it.installed()
    assert cls.__dict__["_load_pretrained_model"] is STOCK
    assert "_load_pretrained_model" not in transformers.LlamaForCausalLM.__dict__
    _assert_same(_load(path), stock)
    assert it.stats().loads == 1 and len(spy) == 1          # stock read it: not aioswap
    it.install()                                   # and again
    _assert_same(_load(path), stock)
    assert it.stats().loads == 1 and len(spy) == 2           # counters start again


def test_install_rejects_a_bad_read_mode() -> None:
    with pytest.raises(ValueError):
        it.install(read="sometimes")
    assert not it.installed()
    assert modeling_utils.PreTrainedModel.__dict__["_load_pretrained_model"] is STOCK


def test_install_refuses_another_method(monkeypatch: pytest.MonkeyPatch) -> None:
    """A transformers whose method is not what this was written for is left alone."""
    def other(model: Any, checkpoint_files: Any) -> None:
        raise AssertionError
    monkeypatch.setattr(modeling_utils.PreTrainedModel, "_load_pretrained_model",
                        staticmethod(other))
    with pytest.raises(RuntimeError, match="state_dict"):
        it.install()
    assert not it.installed()


def test_stock_kept_where_stock_does_not_map(checkpoints: dict[tuple[str, str], Path],
                                             spy: list[list[str]]) -> None:
    path = checkpoints["sharded", "fp32"]
    stock = _load(path)
    it.install()
    _assert_same(_load(path, disable_mmap=True), stock)
    st = it.stats()
    assert (st.loads, st.stock_loads) == (0, 1) and spy == []


def _broken(src: Path, dst: Path, how: str) -> Path:
    shutil.copytree(src, dst)
    shard = sorted(dst.glob("*.safetensors"))[1]
    if how == "missing":
        shard.unlink()
    elif how == "header":
        with open(shard, "r+b") as f:
            f.seek(8)
            f.write(b"#garbage")
    else:
        os.truncate(shard, shard.stat().st_size - 100)
    return shard


@pytest.mark.parametrize("how", ["missing", "header", "truncated"])
def test_bad_shard_named(checkpoints: dict[tuple[str, str], Path], tmp_path: Path,
                         how: str) -> None:
    shard = _broken(checkpoints["sharded", "fp32"], tmp_path / "m", how)
    it.install()
    error = FileNotFoundError if how == "missing" else ast.SafetensorsError
    with pytest.raises(error, match=shard.name):
        _load(shard.parent)
    assert it.stats().tensors == 0


def test_mismatched_sizes_as_stock(checkpoints: dict[tuple[str, str], Path]) -> None:
    """Tensors transformers does not take (mismatched, reinitialized) are dropped, and the
    errors are stock's."""
    path = checkpoints["sharded", "fp32"]
    with pytest.raises(Exception) as stock_err:
        _load(path, vocab_size=300)
    it.install()
    with pytest.raises(type(stock_err.value)):
        _load(path, vocab_size=300)
    model = _load(path, vocab_size=300, ignore_mismatched_sizes=True)
    ref = _load(path)
    for k, v in ref.state_dict().items():
        if "embed_tokens" not in k and "lm_head" not in k:
            assert torch.equal(model.state_dict()[k], v), k
    assert it.stats().loads == 3


def _stream(path: Path, window: Any = None, read: Any = None, ahead: Any = None) -> Any:
    files = sorted(str(f) for f in path.glob("*.safetensors"))
    return it._Stream(*it._headers(files), window, read, ahead)


def test_stream_error_reaches_the_taker(checkpoints: dict[tuple[str, str], Path],
                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A read that fails half way (here: after 3 tensors): the error is raised where a
    tensor not read yet is taken (transformers' thread, then from_pretrained), not a hang;
    what was read is still handed over."""
    real = ast._stream

    def failing(*args: Any, **kwargs: Any) -> Any:
        gen = real(*args, **kwargs)
        try:
            for i, item in enumerate(gen):
                if i == 3:
                    raise ShortReadError("shrank", path="x", nbytes=1)
                yield item
        finally:
            gen.close()

    path = checkpoints["sharded", "fp32"]
    names = [n for n, _ in ast.iter_checkpoint(sorted(path.glob("*.safetensors")))]
    monkeypatch.setattr(ast, "_stream", failing)
    stream = _stream(path)
    try:
        assert stream.take(names[0]).numel()
        with pytest.raises(ShortReadError):
            stream.take(names[-1])
    finally:
        stream.close()
    it.install()
    with pytest.raises(ShortReadError):
        _load(path)


def test_taken_twice_is_read_again(checkpoints: dict[tuple[str, str], Path]) -> None:
    path = checkpoints["sharded", "bf16"]
    ref = ast.load_checkpoint(path)
    stream = _stream(path, ahead=1)                 # a tiny bound: it must not hang
    try:
        names = list(ref)
        for name in reversed(names):                # against the files' order
            assert torch.equal(stream.take(name), ref[name])
        again = stream.take(names[0])
        assert torch.equal(again, ref[names[0]])
    finally:
        stream.close()
    assert it.stats().rereads >= 1


def test_closed_early_leaves_nothing(checkpoints: dict[tuple[str, str], Path]) -> None:
    """Closed before anything is taken (transformers raised): the reads end, the thread
    goes, the files are closed."""
    _stream(checkpoints["sharded", "fp32"]).close()      # the shared handle made
    fds = len(os.listdir("/proc/self/fd"))
    for ahead in (None, 1):
        stream = _stream(checkpoints["sharded", "fp32"], ahead=ahead)
        stream.close()
    assert len(os.listdir("/proc/self/fd")) == fds


# -- aioswap.safetensors.load_checkpoint / iter_checkpoint of a list of files ----------------

def test_checkpoint_of_a_list_of_files(checkpoints: dict[tuple[str, str], Path],
                                       tmp_path: Path) -> None:
    path = checkpoints["sharded", "bf16"]
    files = sorted(path.glob("*.safetensors"))
    ref = ast.load_checkpoint(path)
    got = ast.load_checkpoint(files)
    assert sorted(got) == sorted(ref) and all(torch.equal(got[k], ref[k]) for k in ref)
    order = [n for f in files for n in ast.read_header(f).tensors]
    assert list(got) == order
    streamed = dict(ast.iter_checkpoint([str(f) for f in files], read="buffered"))
    assert sorted(streamed) == sorted(ref)
    with pytest.raises(ast.SafetensorsError, match="more than one"):
        ast.load_checkpoint([files[0], files[1], files[0]])
    with pytest.raises(FileNotFoundError, match="nothere"):
        ast.iter_checkpoint([files[0], tmp_path / "nothere.safetensors"])
    with pytest.raises(ValueError):
        ast.load_checkpoint([])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")
def test_cuda_device_map(checkpoints: dict[tuple[str, str], Path]) -> None:
    path = checkpoints["sharded", "bf16"]
    stock = _load(path, device_map="cuda")
    it.install()
    got = _load(path, device_map="cuda")
    assert it.stats().loads == 1
    assert next(got.parameters()).device.type == "cuda"
    a, b = got.state_dict(), stock.state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with torch.no_grad():
        assert torch.equal(got(IDS.cuda()).logits, stock(IDS.cuda()).logits)


def test_import_and_install_without_transformers(tmp_path: Path) -> None:
    """``import aioswap`` and this module work without transformers (nothing changes);
    install() says what is missing."""
    blocker = tmp_path / "sitecustomize.py"
    blocker.write_text(
        "import sys\n"
        "class _Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] == 'transformers':\n"
        "            raise ImportError('blocked: ' + name)\n"
        "sys.meta_path.insert(0, _Block())\n")
    code = ("import sys, aioswap, aioswap.safetensors\n"
            "import aioswap.integrations.transformers as it\n"
            "assert 'transformers' not in sys.modules and not it.installed()\n"
            "try:\n    it.install()\nexcept ImportError as e:\n    print('ERR', e)\n"
            "assert not it.installed()\n")
    env = dict(os.environ, PYTHONPATH=f"{tmp_path}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, timeout=120, check=False)
    assert done.returncode == 0, done.stderr
    assert "ERR" in done.stdout and "pip install transformers" in done.stdout


def test_cached_checkpoint_left_to_stock(checkpoints: dict[tuple[str, str], Path],
                                         monkeypatch: pytest.MonkeyPatch,
                                         spy: list[list[str]]) -> None:
    """read="auto": a checkpoint the page cache holds goes to transformers' mapping (no
    copy); once its pages are dropped, aioswap reads it; a forced mode always reads."""
    path = checkpoints["sharded", "bf16"]
    files = sorted(path.glob("*.safetensors"))
    stock = copy.deepcopy(_load(path))             # its own memory: the files unmapped
    gc.collect()
    monkeypatch.setattr(it, "_CACHED_SHARE", 0.9)
    for f in files:                                 # cached: just read
        f.read_bytes()
    it.install()
    _assert_same(_load(path), stock)
    assert it.stats().loads == 0 and it.stats().stock_loads == 1 and spy == []
    gc.collect()                                    # (the model above mapped them)
    for f in files:                                 # not cached
        drop_cache(str(f))
    if it._cached_share(files) > 0.5:
        pytest.skip("the page cache kept the files (cannot drop them here)")
    _assert_same(_load(path), stock)
    assert it.stats().loads == 1 and len(spy) == 1
    it.install(read="buffered")                     # forced: read even though cached
    _assert_same(_load(path), stock)
    assert it.stats().loads == 2 and len(spy) == 2
