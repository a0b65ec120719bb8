"""Every ```python block of README.md runs as pasted: each in its own interpreter, from an
empty temporary directory, and exits 0. A block is skipped only when a module it imports is
not installed (transformers for the Hugging Face one); the reason names the module. The
Hugging Face block is marked slow (importing transformers alone takes 20 s here). Every public
name is documented, in the README or in the pages under docs/."""
from __future__ import annotations

import ast
import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
TIMEOUT_S = 300


def _blocks() -> list[tuple[int, str]]:
    """(first line number, source) of each ```python block."""
    if not README.is_file():
        return []
    text = README.read_text(encoding="utf-8")
    return [(text.count("\n", 0, m.start(1)) + 1, m.group(1))
            for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]


BLOCKS = _blocks()
# Blocks that import these take 20 s or more on 2 cores (the import alone): run with -m slow.
_SLOW_IMPORTS = ("transformers", "accelerate")


def _params() -> list[object]:
    return [pytest.param(n, src, id=f"README.md:{n}",
                         marks=[pytest.mark.slow] if re.search(
                             r"^\s*(?:import|from)\s+(?:%s)\b" % "|".join(_SLOW_IMPORTS),
                             src, re.M) else [])
            for n, src in BLOCKS]


def _missing_import(source: str) -> str | None:
    """The first module ``source`` imports that is not installed, or None."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names = [node.module]
        else:
            continue
        for name in names:
            top = name.split(".")[0]
            if importlib.util.find_spec(top) is None:
                return top
    return None


def test_readme_has_python_blocks() -> None:
    if not README.is_file():
        pytest.skip("no README.md beside the tests")
    assert len(BLOCKS) >= 5


def run_block(where: str, source: str, tmp_path: Path) -> None:
    """Run one ```python block (``where``: "page:line") as a user pastes it: its own
    interpreter, an empty working directory, its temporary files under ``tmp_path``;
    skipped only when a module it imports is not installed."""
    missing = _missing_import(source)
    if missing is not None:
        pytest.skip(f"{where} needs {missing}, which is not installed")
    script = tmp_path / f"block_{re.sub(r'[^A-Za-z0-9]', '_', where)}.py"
    script.write_text(source, encoding="utf-8")
    work = tmp_path / "cwd"
    work.mkdir()
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    env["TMPDIR"] = str(tmp_path)           # the blocks' tempfile.mkdtemp() land here
    env.setdefault("HF_HUB_OFFLINE", "1")   # the Hugging Face blocks build their models locally
    try:
        r = subprocess.run([sys.executable, str(script)], cwd=work, env=env,
                           capture_output=True, text=True, timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{where} ran longer than {TIMEOUT_S} s")
    assert r.returncode == 0, (f"{where} exited {r.returncode}\n"
                               f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}")


@pytest.mark.parametrize("line,source", _params())
def test_readme_block_runs(line: int, source: str, tmp_path: Path) -> None:
    run_block(f"README.md:{line}", source, tmp_path)


PUBLIC_MODULES = [
    "aioswap", "aioswap.errors", "aioswap.handle", "aioswap.pinned", "aioswap.config",
    "aioswap.swap", "aioswap.stream", "aioswap.gds", "aioswap.safetensors", "aioswap.dcp",
    "aioswap.compat.deepnvme", "aioswap.compat.deepspeed", "aioswap.integrations.accelerate",
    "aioswap.integrations.diffusers", "aioswap.integrations.transformers",
    "aioswap.stripe", "aioswap.cli",
]


DOCS = README.parent / "docs"


@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_public_names_are_documented(module: str) -> None:
    """Every name in a public module's ``__all__`` appears in the README's code spans or in
    the documentation pages (docs/*.md: the README is a front page, the API reference lists
    every name; tests/test_docs.py checks that reference strictly)."""
    if not README.is_file():
        pytest.skip("no README.md beside the tests")
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:       # an optional dependency of the module is missing
        pytest.skip(f"{module}: {exc}")
    spans = " ".join(re.findall(r"`([^`\n]+)`", README.read_text(encoding="utf-8")))
    pages = " ".join(p.read_text(encoding="utf-8") for p in sorted(DOCS.glob("*.md")))
    missing = [n for n in mod.__all__
               if not re.search(r"\b%s\b" % re.escape(n), spans)
               and not re.search(r"\b%s\.%s\b" % (re.escape(module), re.escape(n)), pages)]
    assert not missing, f"{module}: neither in README.md nor in docs/*.md: {missing}"
