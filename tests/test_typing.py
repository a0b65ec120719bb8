"""Typing and layering: the stubs match the extensions, no module uses another's private names."""
from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "aioswap"


def _private_imports(path: Path) -> list[str]:
    """``from aioswap.x import _name`` and ``aioswap.x._name`` attribute uses of other modules."""
    tree = ast.parse(path.read_text(), str(path))
    me = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("aioswap"):
            if node.module == me:
                continue
            for alias in node.names:
                # a private *module* is a layer of the package (DESIGN.md); a private *name*
                # inside another module is not for outside use
                if alias.name.startswith("_") and alias.name != "__version__":
                    target = f"{node.module}.{alias.name}"
                    if importlib.util.find_spec(target.split(".")[0]) and _is_module(target):
                        continue
                    bad.append(f"{path.name}:{node.lineno} imports {target}")
    return bad


def _is_module(dotted: str) -> bool:
    rel = Path(*dotted.split("."))
    return any((ROOT / rel).with_suffix(ext).exists() for ext in (".py", ".pyx")) or \
        (ROOT / rel / "__init__.py").exists()


@pytest.mark.parametrize("path", sorted(PACKAGE.rglob("*.py")), ids=lambda p: p.name)
def test_no_module_imports_private_names_of_another(path: Path) -> None:
    assert _private_imports(path) == []


def test_private_import_check_catches_one(tmp_path: Path) -> None:
    """The check above can fail: a module importing handle's private helper is caught."""
    fake = PACKAGE / "_probe_private_import.py"
    fake.write_text("from aioswap.handle import _integer\n")
    try:
        assert _private_imports(fake) == ["_probe_private_import.py:1 imports "
                                          "aioswap.handle._integer"]
    finally:
        fake.unlink()


@pytest.mark.slow      # CI's -m slow run keeps it (moved for a faster default run)
def test_stubs_match_the_extensions() -> None:
    """``mypy.stubtest``: the .pyi files describe what the extensions export (23 s: in CI's
    ``-m slow`` run, so a stub that drifts from the engine fails every CI run)."""
    pytest.importorskip("mypy")
    r = subprocess.run([sys.executable, "-m", "mypy.stubtest", "aioswap._aio", "aioswap._cufile",
                        "--allowlist", str(ROOT / "stubtest-allowlist.txt"),
                        "--ignore-unused-allowlist"], capture_output=True, text=True, cwd=ROOT,
                       timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr
