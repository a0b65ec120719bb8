"""The documentation site (docs/): every public name is in the API reference, every ```python
block of the pages runs as pasted, the performance table is what the stored runs give, and
the site builds with warnings as errors.

Blocks run like README.md's (tests/test_readme.py): each in its own interpreter, from an empty
temporary directory, and must exit 0; a block is skipped only when a module it imports is not
installed (the reason names it). Blocks that import transformers or accelerate are marked slow
(the import alone takes 20 s on 2 cores), and so is the build."""
from __future__ import annotations

import importlib
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API = DOCS / "api.md"

# Every public module: the package and each module whose name has no leading underscore and
# that declares __all__. A new public module must be added here and to docs/api.md.
PUBLIC_MODULES = [
    "aioswap", "aioswap.errors", "aioswap.handle", "aioswap.pinned", "aioswap.config",
    "aioswap.swap", "aioswap.stream", "aioswap.gds", "aioswap.safetensors", "aioswap.dcp",
    "aioswap.compat.deepnvme", "aioswap.compat.deepspeed", "aioswap.integrations.accelerate",
    "aioswap.integrations.diffusers", "aioswap.integrations.transformers",
    "aioswap.stripe", "aioswap.cli", "aioswap.tune",
    "aioswap.tune.points", "aioswap.tune.search", "aioswap.tune.measure",
    "aioswap.tune.results", "aioswap.tune.report",
]

pytestmark = pytest.mark.skipif(not API.is_file(), reason="no docs/ beside the tests")


def _pages() -> list[Path]:
    return sorted(DOCS.glob("*.md")) if DOCS.is_dir() else []


def _blocks() -> list[tuple[str, int, str]]:
    """(page, first line number, source) of each ```python block of docs/*.md."""
    out = []
    for page in _pages():
        text = page.read_text(encoding="utf-8")
        out += [(page.name, text.count("\n", 0, m.start(1)) + 1, m.group(1))
                for m in re.finditer(r"^```python\n(.*?)^```", text, re.S | re.M)]
    return out


BLOCKS = _blocks()
_SLOW_IMPORTS = ("transformers", "accelerate")


def _params() -> list[object]:
    return [pytest.param(page, n, src, id=f"{page}:{n}",
                         marks=[pytest.mark.slow] if re.search(
                             r"^\s*(?:import|from)\s+(?:%s)\b" % "|".join(_SLOW_IMPORTS),
                             src, re.M) else [])
            for page, n, src in BLOCKS]


def _directive(qualname: str) -> re.Pattern[str]:
    return re.compile(r"^\.\. auto\w+:: %s\s*$" % re.escape(qualname), re.M)


def _documented(text: str, qualname: str) -> bool:
    """Whether docs/api.md documents ``qualname``: an autodoc directive for it, or, for a name
    documented under another module, a line `` - `qualname` is {py:role}`target` `` whose
    target has a directive."""
    if _directive(qualname).search(text):
        return True
    m = re.search(r"^- `%s` is \{py:\w+\}`([\w.]+)`\s*$" % re.escape(qualname), text, re.M)
    return m is not None and _directive(m.group(1)).search(text) is not None


# -- (a) the API reference names every public name ----------------------------------------

@pytest.mark.parametrize("module", PUBLIC_MODULES)
def test_every_public_name_is_in_the_api_reference(module: str) -> None:
    try:
        mod = importlib.import_module(module)
    except ImportError as exc:       # an optional dependency of the module is missing
        pytest.skip(f"{module}: {exc}")
    text = API.read_text(encoding="utf-8")
    missing = [n for n in mod.__all__ if not _documented(text, f"{module}.{n}")]
    assert not missing, f"docs/api.md does not document {module}: {missing}"
    assert re.search(r"^\.\. automodule:: %s\s*$" % re.escape(module), text, re.M), \
        f"docs/api.md has no automodule for {module}"


def test_every_public_module_is_listed() -> None:
    """A module with __all__ and no leading underscore anywhere in its name is public."""
    import pkgutil

    import aioswap

    found = {"aioswap"}
    for info in pkgutil.walk_packages(aioswap.__path__, "aioswap."):
        if any(part.startswith("_") for part in info.name.split(".")):
            continue
        try:
            mod = importlib.import_module(info.name)
        except ImportError:
            continue
        if hasattr(mod, "__all__"):
            found.add(info.name)
    assert sorted(found - set(PUBLIC_MODULES)) == []


def test_the_check_sees_a_missing_name() -> None:
    text = API.read_text(encoding="utf-8")
    assert _documented(text, "aioswap.AioHandle")
    assert not _documented(text.replace(".. autoclass:: aioswap.AioHandle\n", ""),
                           "aioswap.AioHandle")
    assert not _documented(text, "aioswap.NoSuchName")


# -- (b) every python block runs ------------------------------------------------------------

def test_docs_have_python_blocks() -> None:
    assert len(BLOCKS) >= 10


@pytest.mark.slow      # CI's -m slow run keeps it (moved for a faster default run)
@pytest.mark.parametrize("page,line,source", _params())
def test_docs_block_runs(page: str, line: int, source: str, tmp_path: Path) -> None:
    from test_readme import run_block
    run_block(f"docs/{page}:{line}", source, tmp_path)


# -- the generated performance table --------------------------------------------------------

def test_performance_table_is_generated_from_the_stored_runs() -> None:
    r = subprocess.run([sys.executable, str(DOCS / "gen_performance.py"), "--check"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert list((DOCS / "perf").glob("*.json")), "no stored benchmark run in docs/perf"


def test_pages_are_in_the_toctree() -> None:
    index = (DOCS / "index.md").read_text(encoding="utf-8")
    listed = set(re.findall(r"^([a-z_]+)\s*$", index, re.M))
    pages = {p.stem for p in _pages()} - {"index"}
    assert sorted(pages - listed) == []


# -- (c) the build --------------------------------------------------------------------------

@pytest.mark.slow
def test_docs_build_with_warnings_as_errors(tmp_path: Path) -> None:
    if any(importlib.util.find_spec(m) is None for m in ("sphinx", "myst_parser")):
        pytest.skip('sphinx or myst-parser is not installed (pip install -e ".[docs]")')
    r = subprocess.run([sys.executable, "-m", "sphinx", "-W", "--keep-going", "-E", "-q",
                        "-b", "html", str(DOCS), str(tmp_path / "html")],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, f"--- stdout\n{r.stdout}\n--- stderr\n{r.stderr}"
