"""Dispatch census of the vLLM patch series: every call site in the Python the series adds, and what it calls.

Usage::

    python -m tools.census [--vllm-src DIR] [--patches DIR] [--contracts FILE] [--format text|json] [--no-import]

For each added Python line (as ``tools.contracts`` finds them) the census lists every call that starts on the line:
the patch and file, the line, the callee as written, whether it is a **direct native call**, and the contract the
line serves (its ``contracts.toml`` entry and the vLLM line it cites). A call is a direct native call when its callee
is rooted at a native module of ActiveKV (``_backend``, ``_telemetry``, imported ``from activekv``) or at
``self._native`` (an object the same class built from a native class) and, unless ``--no-import``, the callee
resolves, after ``import torch`` and the native modules, to a compiled function or class (no ``__code__``: not
Python). Any other call is an exception and must be justified by the ``dispatch`` key of its line's contract.

It prints ``N of M dispatch sites are direct native calls`` and then each exception with its justification.

Then the **endpoint-plugin contract**: for each ``vllm.endpoint_plugins`` entry point ActiveKV's ``pyproject.toml``
declares (metadata only, no Python line), every member of vLLM's ``EndpointPlugin`` protocol (read from
``vllm/plugins/endpoint_plugins/interface.py`` of ``--vllm-src``, its line cited) and how the plugin meets it:
``native`` (a compiled property or method), or ``async protocol ported to native`` for an ``async def`` member whose
compiled method returns an object of a compiled type implementing ``__await__``; then each route ``attach_router``
registers and whether its endpoint is a compiled ASGI callable returning such an awaitable. Unless ``--no-import``,
nothing else counts as met. Exit status: 0 when every exception is justified, every native callee resolved and every
endpoint member is met natively, 1 otherwise, 2 when it cannot run.
``--vllm-src`` defaults to the reference tree of ``tools/vllm_tree.py`` (``build/vllm-ref``, made when missing).
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
import sys
import tempfile
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from tools.contracts import NATIVE_MODULES, NATIVE_PACKAGE, Contract, _chain, _native_rooted, check
from tools.vllm_patch import DEFAULT_PATCHES, PatchError, Series, materialize


@dataclass
class Site:
    patch: str
    file: str
    line: int  # 1-based, in the patched file
    text: str  # the added line, stripped
    callee: str  # the called expression as written
    native: bool  # a direct native call
    resolved: str  # what the callee resolved to ("" when not resolved)
    contract: int  # index of the contracts.toml entry (0: none)
    cites: str  # "file:line" the contract cites
    why: str  # for an exception: the contract's dispatch text


def _native_classes(tree: ast.Module) -> dict[str, list[str]]:
    """{class name: dotted native class its ``self._native`` is built from}, from ``self._native = X.Y(...)``."""
    out: dict[str, list[str]] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for node in ast.walk(cls):
            if (
                isinstance(node, ast.Assign)
                and len(node.targets) == 1
                and _chain(node.targets[0]) == ["self", "_native"]
                and isinstance(node.value, ast.Call)
            ):
                chain = _chain(node.value.func)
                if chain:
                    out[cls.name] = chain
    return out


def _enclosing_classes(tree: ast.Module) -> dict[int, str]:
    """{line: enclosing class name} for every line inside a top-level class."""
    out: dict[int, str] = {}
    for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
        for line in range(cls.lineno, (cls.end_lineno or cls.lineno) + 1):
            out[line] = cls.name
    return out


def _resolve(chain: list[str], klass: str | None, natives: dict[str, list[str]]) -> tuple[object | None, str]:
    """Import the native module and follow the chain; returns (object, dotted name) or (None, why not)."""
    if chain[:2] == ["self", "_native"]:
        if klass is None or klass not in natives:
            return None, "self._native is not built from a native class in this class"
        chain = natives[klass] + chain[2:]
    if chain[0] not in NATIVE_MODULES:
        return None, f"{chain[0]} is not a native module"
    try:
        obj: object = importlib.import_module(f"{NATIVE_PACKAGE}.{chain[0]}")
    except ImportError as e:
        return None, f"cannot import {NATIVE_PACKAGE}.{chain[0]}: {e}"
    for part in chain[1:]:
        if not hasattr(obj, part):
            return None, f"{'.'.join(chain)}: no attribute {part}"
        obj = getattr(obj, part)
    return obj, f"{NATIVE_PACKAGE}.{'.'.join(chain)}"


def _is_compiled(obj: object) -> bool:
    """A compiled callable: a builtin/pybind11 function or method, or a class defined by an extension module."""
    if isinstance(obj, type):
        module = sys.modules.get(obj.__module__)
        return module is not None and not str(getattr(module, "__file__", "") or "").endswith(".py")
    return callable(obj) and not hasattr(obj, "__code__") and not hasattr(getattr(obj, "__func__", None), "__code__")


def census(vllm_src: Path, series: Series, contracts_path: Path, resolve: bool = True) -> tuple[list[Site], list[str]]:
    """Every call site of the added Python, and the problems (unjustified exceptions, unresolved native callees)."""
    report = check(vllm_src, series, contracts_path)
    problems = list(report.problems)
    contract_of: dict[int, Contract] = {id(a): c for c, a in report.pairs}
    if resolve:
        importlib.import_module("torch")  # the native modules refuse to load before torch
    sites: list[Site] = []
    with tempfile.TemporaryDirectory() as tmp:
        _, patched = materialize(vllm_src, series, Path(tmp))
        trees = {f: ast.parse((patched / f).read_text()) for f in {a.file for a in report.added}}
    calls_by_line: dict[tuple[str, int], list[ast.Call]] = {}
    for f, tree in trees.items():
        for node in ast.walk(tree):
            if isinstance(node, ast.Call):
                calls_by_line.setdefault((f, node.lineno), []).append(node)
    for a in report.added:
        tree = trees[a.file]
        natives, classes = _native_classes(tree), _enclosing_classes(tree)
        c = contract_of.get(id(a))
        for call in sorted(calls_by_line.get((a.file, a.lineno), []), key=lambda n: n.col_offset):
            callee = ast.unparse(call.func)
            native = _native_rooted(call.func)
            resolved = ""
            if native and resolve:
                obj, resolved = _resolve(_chain(call.func) or [], classes.get(a.lineno), natives)
                if obj is None or not _is_compiled(obj):
                    problems.append(f"{a.file}:{a.lineno}: {callee} does not resolve to a compiled callable ({resolved})")
                    native = False
            why = "" if native or c is None else c.dispatch
            if not native and not why:
                problems.append(
                    f"{a.file}:{a.lineno}: {callee} is not a direct native call and contract "
                    f"{'#' + str(c.index) if c else '(none)'} gives no dispatch justification"
                )
            sites.append(
                Site(a.patch, a.file, a.lineno, a.text, callee, native, resolved, c.index if c else 0,
                     f"{c.cites.file}:{c.cites.line}" if c else "", why)
            )
    return sites, problems


ENDPOINT_GROUP = "vllm.endpoint_plugins"
ENDPOINT_INTERFACE = "vllm/plugins/endpoint_plugins/interface.py"
PYPROJECT = Path(__file__).resolve().parents[1] / "pyproject.toml"


@dataclass
class Member:
    plugin: str  # entry point name
    member: str  # protocol member (or "route PATH")
    kind: str  # "attribute", "method", "async method", "route"
    cites: str  # interface.py:line of the member's declaration ("" for routes)
    how: str  # "native", "async protocol ported to native", or "NOT native: why"
    detail: str  # what it resolved to


def _protocol_members(vllm_src: Path) -> list[tuple[str, str, int]]:
    """(name, kind, line) of every member of vLLM's EndpointPlugin protocol class."""
    tree = ast.parse((vllm_src / ENDPOINT_INTERFACE).read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "EndpointPlugin")
    out = []
    for n in cls.body:
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
            out.append((n.target.id, "attribute", n.lineno))
        elif isinstance(n, ast.AsyncFunctionDef):
            out.append((n.name, "async method", n.lineno))
        elif isinstance(n, ast.FunctionDef):
            out.append((n.name, "method", n.lineno))
    return out


def _native_awaitable(obj: object) -> str:
    """Why ``obj`` is not an awaitable of a compiled type ("" when it is)."""
    t = type(obj)
    if any(hasattr(obj, code) for code in ("cr_code", "gi_code", "ag_code")):
        return f"returns a Python coroutine or generator ({t.__qualname__})"
    if not _is_compiled(t):
        return f"returns {t.__module__}.{t.__qualname__}, not a compiled type"
    if not hasattr(t, "__await__") or not _is_compiled(t.__await__):
        return f"{t.__qualname__} has no compiled __await__"
    return ""


def endpoint_census(vllm_src: Path, resolve: bool = True) -> tuple[list[Member], list[str]]:
    """Every EndpointPlugin member of every endpoint entry point pyproject.toml declares, and how it is met."""
    entries = tomllib.loads(PYPROJECT.read_text()).get("project", {}).get("entry-points", {}).get(ENDPOINT_GROUP, {})
    members, problems = [], []
    protocol = _protocol_members(vllm_src)
    for name, target in sorted(entries.items()):
        module_name, _, attr = target.partition(":")
        factory = plugin = None
        if resolve:
            factory = getattr(importlib.import_module(module_name), attr, None)
            if factory is None or not _is_compiled(factory):
                problems.append(f"endpoint plugin {name}: {target} is not a compiled callable")
            if callable(factory):
                plugin = factory()  # classified member by member below, compiled or not
        for member, kind, line in protocol:
            cites = f"{ENDPOINT_INTERFACE}:{line}"
            if plugin is None:
                members.append(Member(name, member, kind, cites, "not resolved (--no-import)", target))
                continue
            descriptor = getattr(type(plugin), member, None)
            how, detail = "native", ""
            if kind == "attribute":
                fget = getattr(descriptor, "fget", None)
                if not isinstance(descriptor, property) or not _is_compiled(fget):
                    how = "NOT native: not a compiled property"
                detail = f"{type(plugin).__qualname__}.{member} = {getattr(plugin, member)!r}"
            elif not _is_compiled(getattr(plugin, member, None)):
                how = "NOT native: not a compiled method"
            elif kind == "async method":
                aw = getattr(plugin, member)(None, None, None)
                why = _native_awaitable(aw)
                how = f"NOT native: {why}" if why else "async protocol ported to native"
                detail = f"returns {type(aw).__module__}.{type(aw).__qualname__} (__await__ from the am_await slot)"
            else:
                detail = f"{type(plugin).__module__}.{type(plugin).__qualname__}.{member}"
            members.append(Member(name, member, kind, cites, how, detail))
        if plugin is not None:
            routes: list[tuple[str, object]] = []

            class _App:  # records what attach_router registers (FastAPI/Starlette's add_route signature)
                def add_route(self, path, route, methods=None, name=None, include_in_schema=True):  # noqa: ANN
                    routes.append((path, route))

            plugin.attach_router(_App())
            for path, route in routes:
                compiled = _is_compiled(route) and _is_compiled(type(route))  # no Python function or class
                how = "native" if compiled else "NOT native: not a compiled ASGI callable"
                if how == "native":
                    aw = route({"type": "http", "method": "OPTIONS"}, None, lambda m: None)
                    why = _native_awaitable(aw)
                    how = f"NOT native: {why}" if why else "native ASGI app"
                    aw.close()
                members.append(Member(name, f"route {path}", "route", "", how,
                                      f"{type(route).__module__}.{type(route).__qualname__}.__call__"))
    for m in members:
        if m.how.startswith("NOT"):
            problems.append(f"endpoint plugin {m.plugin}: {m.member} is {m.how}")
    return members, problems


def endpoint_summary(members: list[Member]) -> str:
    met = sum(not m.how.startswith(("NOT", "not")) for m in members if m.kind != "route")
    total = sum(m.kind != "route" for m in members)
    return f"{met} of {total} endpoint-plugin contract members met natively (0 Python lines, no contracts.toml entry)"


def summary(sites: list[Site]) -> str:
    native = sum(s.native for s in sites)
    return f"{native} of {len(sites)} dispatch sites are direct native calls"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.census", description=__doc__.split("\n\n")[0])
    parser.add_argument("--vllm-src", type=Path, metavar="DIR", help="reference tree holding vllm/")
    parser.add_argument("--patches", type=Path, default=DEFAULT_PATCHES, metavar="DIR")
    parser.add_argument("--contracts", type=Path, metavar="FILE", help="default: contracts.toml in --patches")
    parser.add_argument("--format", choices=["text", "json"], default="text")
    parser.add_argument("--no-import", action="store_true", help="classify by name only; import nothing native")
    args = parser.parse_args(argv)
    try:
        if args.vllm_src is None:
            from tools.vllm_tree import reference_tree

            args.vllm_src = reference_tree()
        series = Series.load(args.patches)
        sites, problems = census(
            args.vllm_src.resolve(), series, args.contracts or args.patches / "contracts.toml", not args.no_import
        )
        members, endpoint_problems = endpoint_census(args.vllm_src.resolve(), not args.no_import)
        problems += endpoint_problems
    except (PatchError, OSError, RuntimeError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.format == "json":
        print(json.dumps({"summary": summary(sites), "sites": [asdict(s) for s in sites],
                          "endpoint_summary": endpoint_summary(members),
                          "endpoint": [asdict(m) for m in members], "problems": problems}, indent=1))
        return 1 if problems else 0
    for s in sites:
        kind = "native" if s.native else "NOT native"
        target = s.resolved or s.callee
        print(f"{s.patch[:4]} {s.file}:{s.line}\t{kind}\t{target}\tcontract #{s.contract} (cites {s.cites})")
    print(summary(sites))
    exceptions = [s for s in sites if not s.native]
    if exceptions:
        print("not direct native calls:")
        for s in exceptions:
            print(f"  {s.file}:{s.line} {s.callee}: {s.why or '(no justification)'}")
    for m in members:
        where = f" (cites {m.cites})" if m.cites else ""
        print(f"endpoint {m.plugin} {m.member}\t{m.kind}\t{m.how}\t{m.detail}{where}")
    print(endpoint_summary(members))
    for p in problems:
        print(f"problem: {p}")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
