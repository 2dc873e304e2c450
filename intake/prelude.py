"""The shared prelude: torch's, pybind11's and Python's headers parsed once per run, not once per translation unit.

A unit of the project spends nearly all of its parse in third-party headers (``torch/extension.h`` alone is about
11 s of CPU here), and the screen reads only declarations from them. So the units that are parsed in one run are
grouped by their compile flags (less ``-D``/``-U``: the prelude takes the macros they all define) and top-level
folder (``engine/``, ``bindings/``), and each group gets a prelude: a
header of the third-party ``#include`` lines its units' project files hold, precompiled once with function bodies
skipped (``cxx.build_prelude``); each unit is then parsed with ``-include-pch``, its own code and project headers in
full (``cxx.parse``).

What goes in, from each unit's project files (the main file, then the project headers it includes, depth first,
read lexically as ``native._refused_includes`` reads them):

- an ``#include`` outside any ``#if`` block (an include guard does not count) that names a file found in one of the
  flags' include folders outside the project (``-I``, ``-isystem``, ``-idirafter``, the resource folder); headers
  found nowhere there (the standard library, a missing header) stay where they are, as do conditional includes;
- every ``#define``/``#undef`` that comes before an ``#include`` of the same file, in order, first in the prelude
  (units are grouped by them too, so a unit's headers see its macros). A macro a header defines after its own
  includes is taken to be the project's own (``AKV_CHECK`` in ``activekv/check.h``), never read by a third-party
  header a later file includes.

A unit is parsed without a prelude when a lexical read cannot tell what it includes: an ``#include`` spelled
through a macro, a project header included inside an ``#if`` block, or a ``#define``/``#undef`` inside an ``#if``
block before an include of its file. A prelude that does not parse cleanly, or that reaches a project file, is not used: its
units are parsed on their own, as a unit is whose parse cannot load the precompiled header.

A unit sees the union of its group's prelude, not only the headers it includes itself: declarations of another
unit's third-party headers are visible to it. Its facts do not change (calls resolve to the declarations the unit
names), and its include graph, ``functional`` and ``deps`` follow its own directives (``cxx``).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from intake import files
from intake.cxx import EXCLUDED_TOP

_LINE_RE = re.compile(r"^[ \t]*#[ \t]*(\w+)[ \t]*(.*)$")
_SPELLED_RE = re.compile(r'^([<"])([^>"]+)[>"]')
_CONDITIONALS = ("if", "ifdef", "ifndef")
_MACRO_OPTIONS = ("-D", "-U")


@dataclass
class Group:
    args: tuple[str, ...]
    defines: tuple[str, ...]
    includes: list[str] = field(default_factory=list)  # as spelled: <torch/extension.h>, "x.h"
    units: list[int] = field(default_factory=list)  # indexes of the jobs that use it

    def text(self) -> str:
        lines = ["// intake's shared prelude (intake/prelude.py): generated, precompiled, never compiled into code"]
        lines += list(self.defines) + [f"#include {spelled}" for spelled in self.includes]
        return "\n".join(lines) + "\n"


def _directives(path: Path, root: Path) -> list[tuple[str, str]]:
    """(word, rest) of each preprocessor directive of ``path``, continuation lines joined; [] when unreadable."""
    try:
        text = files.read_bytes(path, root if path.is_relative_to(root) else None).decode(errors="replace")
    except files.Refused:
        return []
    out = []
    for line in text.replace("\\\r\n", "").replace("\\\n", "").splitlines():
        m = _LINE_RE.match(line)
        if m:
            out.append((m.group(1), m.group(2).strip()))
    return out


def _search(args: tuple[str, ...]) -> tuple[list[str], list[str]]:
    """(quote-only folders, folders for both) the flags name, in search order."""
    quote, both = [], []
    for i, a in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else ""
        if a == "-iquote":
            quote.append(value)
        elif a.startswith("-iquote") and len(a) > len("-iquote"):
            quote.append(a[len("-iquote") :])
        elif a in ("-I", "-isystem", "-idirafter"):
            both.append(value)
        elif a == "-resource-dir":
            both.append(os.path.join(value, "include"))
        else:
            for opt in ("-I", "-isystem", "-idirafter"):
                if a.startswith(opt) and len(a) > len(opt):
                    both.append(a[len(opt) :])
                    break
    return [d for d in quote if d], [d for d in both if d]


def _project(root: Path, path: Path) -> bool:
    try:
        parts = path.relative_to(root).parts
    except ValueError:
        return False
    return bool(parts) and parts[0] not in EXCLUDED_TOP and "site-packages" not in parts


class Planner:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.memo: dict[Path, list[tuple[str, str]]] = {}

    def directives(self, path: Path) -> list[tuple[str, str]]:
        if path not in self.memo:
            self.memo[path] = _directives(path, self.root)
        return self.memo[path]

    def unit(self, main: Path, args: tuple[str, ...]) -> tuple[tuple[str, ...], list[str]] | None:
        """(defines, third-party includes) of a unit's prelude, or None when it is parsed on its own."""
        quote_dirs, dirs = _search(args)
        events: list[tuple[str, str]] = []  # ("define", line) | ("unsure", "") | ("include", spelled)
        seen: set[Path] = set()

        def visit(path: Path) -> bool:
            if path in seen:  # included before: its guard makes it a no-op
                return True
            seen.add(path)
            ds = self.directives(path)
            guarded = (
                len(ds) >= 2 and ds[0][0] == "ifndef" and ds[1][0] == "define"
                and ds[1][1].split()[:1] == ds[0][1].split()[:1]
            )  # fmt: skip
            depth = 0
            mine: list[tuple[str, str]] = []  # this file's own macro events, kept if an include follows them
            for i, (word, rest) in enumerate(ds):
                if guarded and i < 2:
                    depth = 1
                    continue
                top = depth == (1 if guarded else 0)
                if word in _CONDITIONALS:
                    depth += 1
                elif word == "endif":
                    depth -= 1
                elif word in ("define", "undef"):
                    mine.append(("define", f"#{word} {rest}") if top else ("unsure", ""))
                elif word in ("include", "import"):
                    m = _SPELLED_RE.match(rest)
                    if m is None:
                        return False  # spelled through a macro
                    quoted, name = m.group(1) == '"', m.group(2).strip()
                    bases = ([str(path.parent)] + quote_dirs if quoted else []) + dirs
                    names = [name] if os.path.isabs(name) else [os.path.join(d, name) for d in bases]
                    found = next((Path(os.path.normpath(n)) for n in names if os.path.isfile(n)), None)
                    if found is None:
                        continue
                    events.extend(mine)  # macros this file defines before an include: its headers see them
                    mine = []
                    if _project(self.root, found):
                        if not top or not visit(found):
                            return False
                    elif top:
                        events.append(("include", m.group(0)))
            return True

        if not visit(main):
            return None
        if any(kind == "unsure" for kind, _ in events):
            return None
        defines = tuple(text for kind, text in events if kind == "define")
        includes = list(dict.fromkeys(text for kind, text in events if kind == "include"))
        return defines, includes


def plan(root: Path, jobs: list[tuple[str, list[str], str, str]]) -> list[Group]:
    """The preludes for ``jobs`` (main, args, root, flags source): one group per flags, top-level folder and
    defines; a job in no group is parsed on its own."""
    planner = Planner(root)
    groups: dict[tuple[tuple[str, ...], str, tuple[str, ...]], Group] = {}
    for index, (main, args, _root, _source) in sorted(enumerate(jobs), key=lambda j: j[1][0]):
        path = Path(main)
        try:
            top = path.relative_to(root).parts[0]
        except (ValueError, IndexError):
            top = ""
        got = planner.unit(path, tuple(args))
        if got is None or not got[1]:
            continue
        defines, includes = got
        # Units that differ only in -D/-U options share a prelude built with the ones they all have: clang accepts
        # a precompiled header under a command line with more macros as long as its headers never name them
        # (ACTIVEKV_MODULE_NAME, -D_x_EXPORTS); a unit it refuses is parsed on its own (cxx.parse).
        plain = tuple(a for a in args if not a.startswith(_MACRO_OPTIONS))
        group = groups.setdefault((plain, top, defines), Group(tuple(args), defines))
        group.args = tuple(a for a in group.args if not a.startswith(_MACRO_OPTIONS) or a in args)
        group.includes += [s for s in includes if s not in group.includes]
        group.units.append(index)
    return list(groups.values())
