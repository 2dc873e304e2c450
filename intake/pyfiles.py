"""The ``new-python-module`` rule: no Python file of ours outside the dev-side folders.

A file counts as Python by its extension (``.py``, ``.pyi``, ``.pyx``) or by its content (a first line that is a
Python shebang: ``#!/usr/bin/env python3``, ``#!/usr/bin/python3.11 -u``). The dev-side folders are the top-level
``tests/``, ``tools/``, ``release/`` and ``intake/``; everything else can reach the payload. The vLLM patch series
is text (``.patch``), screened by ``uncited-python-line`` instead.
"""

from __future__ import annotations

import re
from pathlib import Path

from intake import files
from intake.findings import Finding

DEV_SIDE = ("tests", "tools", "release", "intake")
PYTHON_SUFFIXES = (".py", ".pyi", ".pyx")
_SHEBANG_RE = re.compile(rb"^#![^\n]*\bpython[0-9.]*\b")


def is_dev_side(rel: str) -> bool:
    return rel.split("/", 1)[0] in DEV_SIDE


def is_python(rel: str, head: bytes | None) -> bool:
    """``head``: the file's first bytes (None when unknown: the extension alone decides)."""
    if rel.endswith(PYTHON_SUFFIXES):
        return True
    return head is not None and bool(_SHEBANG_RE.match(head))


def read_head(path: Path, root: Path) -> bytes | None:
    """The first 256 bytes, or None when intake.files refuses the file (the screen reports that on its own)."""
    try:
        return files.read_head(path, 256, root)
    except files.Refused:
        return None


def finding(rel: str, head: bytes | None, moved_from: str | None = None, copied: bool = False) -> Finding:
    how = "by its extension" if rel.endswith(PYTHON_SUFFIXES) else "by its Python shebang"
    what = f"{'copied' if copied else 'moved'} here from {moved_from}" if moved_from else "added"
    return Finding(
        "new-python-module",
        rel,
        1,
        1,
        f"a Python file ({how}) {what} outside the dev-side folders ({', '.join(f + '/' for f in DEV_SIDE)}); "
        "write it in C++ (engine/) behind a pybind11 binding (bindings/modules/), or keep dev-side scripts in "
        "tools/ or tests/",
    )
