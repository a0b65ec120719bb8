"""Typing and layering: the stubs match the extensions, no module uses another's private names."""
from __future__ import annotations

import ast
import importlib.util
import re
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
    return any((ROOT / rel).with_suffix(ext).exists() for ext in (".py", ".pyx", ".pxd")) or \
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



# ---- no circles: the import picture of the package's modules is a DAG -------------------
def _module_of(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the package's modules it imports when it runs: every ``import``, at module
    level and inside functions alike (``from pkg import mod`` is an import of ``pkg.mod``;
    of a name, an import of ``pkg``), but not those under ``if TYPE_CHECKING:``, which name
    types for checkers and never run. Extensions (``.pyx``) are modules too."""
    paths = {_module_of(p, root): p for p in sorted((root / package).rglob("*.py"))}
    known = set(paths) | {_module_of(p, root) for p in (root / package).rglob("*.pyx")}
    graph: dict[str, set[str]] = {}
    for me, path in paths.items():
        here = me if path.name == "__init__.py" else me.rpartition(".")[0]
        out: set[str] = set()
        tree = ast.parse(path.read_text(), str(path))
        typing_only = {id(n) for block in ast.walk(tree) if isinstance(block, ast.If)
                       and ast.unparse(block.test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
                       for stmt in block.body for n in ast.walk(stmt)}
        for node in ast.walk(tree):
            if id(node) in typing_only:
                continue
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = here.split(".")[:len(here.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                         for a in node.names]
            else:
                continue
            out.update(n for n in names if n in known and n != me)
        graph[me] = out
    return graph


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One circle of imports (``[a, b, a]``), or ``[]`` when the graph is a DAG."""
    state: dict[str, int] = {}          # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for n in sorted(graph.get(m, ())):
            if state.get(n) == 1:
                return path[path.index(n):] + [n]
            if n not in state and (found := visit(n)):
                return found
        path.pop()
        state[m] = 2
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_no_import_circles() -> None:
    """Each module sits below the ones that import it (the engine below the handle, the
    handle below striping); a module that needs one above it is handed what it uses."""
    cycle = _cycle(_import_graph(ROOT, "aioswap"))
    assert not cycle, "import circle: " + " -> ".join(cycle)


def test_import_circle_check_catches_one(tmp_path: Path) -> None:
    """The check above can fail: a circle through function-local imports is found and
    named; an import under ``TYPE_CHECKING`` (types only) makes none."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "low.py").write_text("def g():\n    from pkg.top import Top\n")
    (pkg / "mid.py").write_text("from pkg import low\n")
    (pkg / "top.py").write_text("def f():\n    from . import mid\n")
    assert _cycle(_import_graph(tmp_path, "pkg")) == ["pkg.low", "pkg.top", "pkg.mid",
                                                      "pkg.low"]
    (pkg / "low.py").write_text("from typing import TYPE_CHECKING\n"
                                "if TYPE_CHECKING:\n    from pkg.top import Top\n")
    assert _cycle(_import_graph(tmp_path, "pkg")) == []


# ---- attribute reaches into another module's private names, in .py, .pyx and .pxi alike
_IDENT = r"[A-Za-z_][A-Za-z0-9_]*"
# Third-party internals the package uses on purpose, each in one module, with the reason.
_THIRD_PARTY = {
    ("aioswap/_claims.py", "torch._C"),         # DisableTorchFunctionSubclass: torch's own API
    ("aioswap/_future.py", "futures._base"),    # IOFuture: the one place for Future's states
    ("aioswap/_tree.py", "result._metadata"),   # a state dict's metadata, as torch names it
}


def _units() -> list[tuple[str, list[Path]]]:
    """Modules as the interpreter sees them: each .py, and each extension with its includes
    (``_aio.pyx`` and ``_engine/*.pxi`` are one module)."""
    out = [(p.relative_to(ROOT).as_posix(), [p]) for p in sorted(PACKAGE.rglob("*.py"))]
    out.append(("aioswap/_aio.pyx", [PACKAGE / "_aio.pyx",
                                     *sorted((PACKAGE / "_engine").glob("*.pxi"))]))
    out.append(("aioswap/_cufile.pyx", [PACKAGE / "_cufile.pyx"]))
    return out


def _code_only(src: str) -> str:
    """``src`` without comments and string literals (docstrings name private things)."""
    out = re.sub(r'("""|\'\'\')(?:.|\n)*?\1', '""', src)
    out = re.sub(r"#.*", "", out)
    return re.sub(r'"(?:[^"\\\n]|\\.)*"|\'(?:[^\'\\\n]|\\.)*\'', '""', out)


def _own_private_names(src: str) -> set[str]:
    """Private names a module defines: its functions, methods, C fields, class attributes,
    slots, and whatever it sets or reads on ``self``."""
    names = set(re.findall(r"\bself\.(_" + _IDENT + ")", src))
    names |= set(re.findall(r"\b(?:def|cpdef|class)\s+(_" + _IDENT + r")\b", src))
    names |= set(re.findall(r"^[ \t]*cdef\b[^\n(=]*?\b(_" + _IDENT + r")\s*\(", src, re.M))
    names |= set(re.findall(r"^\s+(_" + _IDENT + r")\s*[:=]", src, re.M))
    names |= set(re.findall(r"^\s+cdef\s+(?:public\s+|readonly\s+)?[\w .*]+?\b(_" + _IDENT
                            + r")\b", src, re.M))
    for slots in re.findall(r"__slots__\s*=\s*\(([^)]*)\)", src):
        names |= set(re.findall(r'"(_' + _IDENT + ')"', slots))
    return names


def _private_reaches(unit: str, files: list[Path]) -> list[str]:
    """``obj._name`` where ``_name`` is not one of this module's own private names (and
    ``obj`` is not ``self``/``cls``): a reach into another module's or object's internals.
    ``aioswap._layer`` (a private module of the package) is a layer, not a reach."""
    src = _code_only("\n".join(f.read_text() for f in files))
    mine = _own_private_names(src)
    bad = []
    for m in re.finditer(r"(\b" + _IDENT + r"|\))\.(_" + _IDENT + ")", src):
        obj, name = m.group(1), m.group(2)
        if obj in ("self", "cls") or name in mine or (name.startswith("__")
                                                      and name.endswith("__")):
            continue
        if obj == "aioswap" and _is_module(f"aioswap.{name}"):
            continue
        if (unit, f"{obj}.{name}") in _THIRD_PARTY:
            continue
        bad.append(f"{unit}: {obj}.{name}")
    return bad


@pytest.mark.parametrize("unit", _units(), ids=lambda u: u[0])
def test_no_private_reach_into_another_module(unit: tuple[str, list[Path]]) -> None:
    """Also the engine: the compiled Core reads no handle, future or registry internals
    (it is handed what it uses when it is made)."""
    assert _private_reaches(*unit) == []


def test_private_reach_check_catches_one(tmp_path: Path) -> None:
    """The check above can fail: the reaches the compiled front door used to make."""
    fake = tmp_path / "fake.pxi"
    fake.write_text("cdef object _f(h, registry):\n"
                    "    # h._not_this (a comment)\n"
                    "    lanes = h._lanes\n"
                    "    snap = registry._host.snap\n"
                    "    return self._mine, (<Core>h)._seq, 'x._quoted'\n")
    assert _private_reaches("fake.pxi", [fake]) == [
        "fake.pxi: h._lanes", "fake.pxi: registry._host", "fake.pxi: )._seq"]


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
