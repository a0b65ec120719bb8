"""Sphinx configuration of aioswap's documentation.

Why Sphinx: it is the ecosystem's default for Python libraries, and its autodoc imports the
package, so the API reference is read from the docstrings themselves, the compiled engine's
included (`aioswap._aio` is built with ``embedsignature=True``). napoleon reads the
numpy-style sections (Parameters, Returns, Raises, Notes) the house style asks for, and MyST
keeps every page in Markdown, like the README, so the guides' code blocks are plain
```python blocks that tests/test_docs.py runs as pasted.

Build: ``python -m sphinx -W --keep-going -b html docs docs/_build/html`` (the ``docs``
extra installs what it needs).
"""
from __future__ import annotations

import importlib.metadata
import os
import re
import sys

# The package is imported from the install (editable or not); the checkout's root comes
# first so that a source tree beside docs/ is the one documented.
sys.path.insert(0, os.path.abspath(os.path.join(os.path.dirname(__file__), "..")))

project = "aioswap"
author = "aioswap contributors"
copyright = "aioswap contributors, Apache-2.0"
try:
    release = importlib.metadata.version("aioswap")
except importlib.metadata.PackageNotFoundError:      # built from a bare source tree
    release = "0.1.0"
version = release

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.napoleon",
    "myst_parser",
]

source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "perf", "Thumbs.db", ".DS_Store"]

# MyST: ```{directive} blocks, $ substitutions off (shell prompts and prices stay literal),
# heading anchors for [text](page.md#anchor) links between pages.
myst_enable_extensions = ["colon_fence"]
myst_heading_anchors = 3

# autodoc: members in source order, signatures as the code writes them.
autodoc_member_order = "bysource"
autodoc_typehints = "signature"
autodoc_preserve_defaults = True
# The optional integrations import their libraries only when installed; nothing to mock.

# napoleon: numpy style only (the house style); "Attributes" as a plain section so a class's
# listed attributes do not clash with the properties autodoc documents.
napoleon_google_docstring = False
napoleon_numpy_docstring = True
napoleon_use_ivar = True
napoleon_use_rtype = False

html_theme = "alabaster"
html_title = f"aioswap {release}"


# -- module constants ---------------------------------------------------------------------
# A constant's documentation is its ``#:`` comment in the module that assigns it. autodoc
# looks only in the module named in the directive, so a constant a public module re-exports
# from a private one (``aioswap.swap.MANIFEST_NAME`` from ``aioswap._manifest``) would get the
# docstring of its type (``str``, ``int``) instead. This hook drops such type docstrings and
# takes the ``#:`` comment of the same name from the aioswap module that assigns that value.
def _attr_comments() -> dict[str, list[tuple[str, list[str]]]]:
    import pkgutil

    from sphinx.pycode import ModuleAnalyzer

    import aioswap

    found: dict[str, list[tuple[str, list[str]]]] = {}
    names = ["aioswap"] + [m.name for m in pkgutil.walk_packages(aioswap.__path__, "aioswap.")]
    for modname in names:
        try:
            docs = ModuleAnalyzer.for_module(modname).find_attr_docs()
        except Exception:          # a compiled module has no source to analyse
            continue
        for (scope, attr), lines in docs.items():
            if scope == "":
                found.setdefault(attr, []).append((modname, list(lines)))
    return found


_COMMENTS: dict[str, list[tuple[str, list[str]]]] | None = None


def _constant_doc(app, what, name, obj, options, lines):  # type: ignore[no-untyped-def]
    global _COMMENTS
    if what != "data":
        return
    import importlib
    import inspect

    own = [ln for ln in (inspect.getdoc(type(obj)) or "").splitlines() if ln.strip()]
    if lines and [ln for ln in lines if ln.strip()] != own:
        return                      # a doc comment of its own
    lines.clear()
    if _COMMENTS is None:
        _COMMENTS = _attr_comments()
    attr = name.rsplit(".", 1)[1]
    for modname, doc in _COMMENTS.get(attr, []):
        if getattr(importlib.import_module(modname), attr, None) is obj:
            lines.extend(doc)
            return


# -- docstrings napoleon's numpy pass cannot read ------------------------------------------
# Two shapes occur, and each is put right before napoleon sees it (priority 400 < 500):
# * methods that keep the docstring of what they override from the standard library or
#   torch (``IOFuture.result``, ``AioReader.set_up_storage_reader``) are Google style
#   (``Args:``); they are converted with napoleon's Google parser.
# * a numpy ``Parameters`` section with a plain paragraph between two parameters (it reads
#   as a parameter named by its first line); the paragraph is moved to the top of the
#   ``Notes`` section (made when there is none). The docstring itself should move it.
_GOOGLE_HEADER = re.compile(r"^(Args|Arguments|Returns|Raises|Yields):\s*$")
_PARAM_LINE = re.compile(r"^\*{0,2}\w+(\s*,\s*\*{0,2}\w+)*(\s*:.*)?$")
_SECTION = re.compile(r"^-{3,}\s*$")


def _move_stray_paragraphs(lines: list[str]) -> None:
    try:
        start = next(i for i in range(len(lines) - 1)
                     if lines[i].strip() == "Parameters" and _SECTION.match(lines[i + 1]))
    except StopIteration:
        return
    end = next((i - 1 for i in range(start + 2, len(lines)) if _SECTION.match(lines[i])),
               len(lines))
    stray: list[str] = []
    i = start + 2
    while i < end:
        blank_before = lines[i - 1].strip() == ""
        if (blank_before and lines[i] and not lines[i][0].isspace()
                and not _PARAM_LINE.match(lines[i].rstrip())):
            j = i + 1
            while (j < end and lines[j].strip() and not lines[j][0].isspace()
                   and not _PARAM_LINE.match(lines[j].rstrip())):
                j += 1
            while j < end and not lines[j].strip():
                j += 1
            stray += [ln for ln in lines[i:j] if ln.strip()] + [""]
            del lines[i:j]
            end -= j - i
            continue
        i += 1
    if not stray:
        return
    notes = next((i for i in range(len(lines) - 1)
                  if lines[i].strip() == "Notes" and _SECTION.match(lines[i + 1])), None)
    if notes is None:
        lines += ["", "Notes", "-----"] + stray
    else:
        lines[notes + 2:notes + 2] = stray


def _readable_docstring(app, what, name, obj, options, lines):  # type: ignore[no-untyped-def]
    if any(_GOOGLE_HEADER.match(ln) for ln in lines):
        from sphinx.ext.napoleon.docstring import GoogleDocstring

        lines[:] = GoogleDocstring(lines, app.config, app, what, name, obj, options).lines()
        return
    _move_stray_paragraphs(lines)


# Type fields are linked by the Python domain word by word, so ``(address, nbytes)`` in a
# parameter's type finds two attributes named ``nbytes``; an ambiguous link is harmless.
suppress_warnings = ["ref.python"]


def setup(app):  # type: ignore[no-untyped-def]
    app.connect("autodoc-process-docstring", _readable_docstring, priority=400)
    app.connect("autodoc-process-docstring", _constant_doc)
