"""The contracts file of a vLLM patch series: its schema, parser and checks (shared by tests, intake and release).

Usage::

    python -m tools.contracts check [--vllm-src DIR] [--patches DIR] [--contracts FILE]
    python -m tools.contracts list  [--vllm-src DIR] [--patches DIR] [--contracts FILE]

``DIR`` holds the reference ``vllm/`` (the unpatched vLLM 0.32.0 tree; a tree with the series applied is accepted and
read through a reverted copy of the touched files); by default the reference tree of ``tools/vllm_tree.py``
(``build/vllm-ref``, made when missing), as ``tools.census`` takes it. The other side is made on a copy by the native
launcher (``activekv patch``, tools.vllm_patch.materialize), so ``make build`` comes first. ``--patches`` defaults to
``patches/vllm/v0.32.0`` and ``--contracts`` to ``contracts.toml`` in it. ``check`` prints one line per problem and
exits 1 when there is one, else prints a summary and exits 0. ``list`` prints each added Python line with its kind
(tab-separated).

Schema (TOML)::

    schema = 1                      # this format
    vllm = "0.32.0"                 # the vLLM version the citations quote
    [[contract]]                    # one per added Python line, in the order the series adds them
    patch = "0002-....patch"        # the series file that adds the line
    file = "vllm/v1/....py"         # the file it lands in, relative to the tree root
    line = "return _backend.name()" # its exact text, stripped
    kind = "framework-contract"     # framework-contract | delegation | convenience | async-protocol
    why = "..."                     # why vLLM needs this line
    dispatch = "..."                # optional: why a call on this line is not a direct native call (tools.census)
    [contract.cites]                # the framework source line that requires it
    file = "vllm/model_executor/layers/attention/attention.py"
    line = 433                      # 1-based line number in the reference tree
    text = "self.backend = AttentionBackendEnum[self.attn_backend.get_name()]"   # that line, stripped

Rules checked (each names itself in its messages):
- coverage: every added Python line (a ``+`` line of a ``.py`` file that is neither blank nor a comment; imports
  included) has exactly one entry, and every entry matches an added line; entries follow the series' order within a
  (patch, file) pair, so duplicate lines (``@classmethod``) pair up by position.
- kind: only ``framework-contract`` may remain; the other kinds are code to port to the native side.
- citation: ``cites.file`` exists in the reference tree and its line ``cites.line``, stripped, equals ``cites.text``.
- symbol: the cited text names, as a whole identifier, one of the line's key symbols: a ``def`` its name; a ``class``
  its base; a decorator the decorator (and the cited decorator decorates a method of the same name within 3 lines);
  an import the imported name (an import of the native package ``activekv``: in a file the series creates,
  ``import_module`` or ``load``, the call through which vLLM imports the module, from its registry path or its plugin
  entry point, and with it the native one; in an existing vLLM module, vLLM's own import of that module, e.g.
  ``from vllm.v1.worker.utils import (``, through which vLLM loads it); an assignment its target (or, for
  ``self._native = ...``, the enclosing method; at class level also the enclosing class, e.g. the enum being
  extended); a ``return``/expression the enclosing function or the framework attribute it returns or calls; an
  ``if`` a name in its condition; a ``raise`` the exception. ``self``, ``cls``, the native modules (``_backend``, ``_telemetry``) and
  ``_native`` and the names of native calls never count.
- one statement per line: each added line begins a whole statement (or is a decorator).
- delegation (files the series creates): every line that is not a ``def``, ``class``, decorator or import is a
  one-line delegation: ``return``/assignment/expression of a call into a native module (``_backend``,
  ``_telemetry``) or ``self._native`` whose
  arguments are plain names or constants, a read of a ``self._native`` attribute, or a constant (literal, name,
  dotted name, tuple of these); no ``if``, loop, ``try``, ``with`` or computation.
- routing (lines added to existing vLLM files): each line is a constant assignment, or has the statement type of the
  vLLM line it cites (``if``, ``raise``, ``return``, assignment): it mirrors vLLM's own selection code.
- imports: every ``vllm.*`` name the added lines import is defined at the top level of that module in the reference
  tree; the only other import allowed is the native package ``activekv``.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import io
import keyword
import re
import sys
import tempfile
import tokenize
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

from tools.vllm_patch import DEFAULT_PATCHES, VLLM_VERSION, PatchError, Series, materialize, vllm_version

SCHEMA = 1
KINDS = ("framework-contract", "delegation", "convenience", "async-protocol")
KEPT_KIND = "framework-contract"
NATIVE_PACKAGE = "activekv"
# The native modules the added Python may call (each imported as ``from activekv import <name>``).
NATIVE_MODULES = frozenset({"_backend", "_telemetry"})
_IGNORED_SYMBOLS = frozenset({"self", "cls", "_native"}) | NATIVE_MODULES
_CONTRACT_KEYS = {"patch": str, "file": str, "line": str, "kind": str, "why": str, "cites": dict}
_OPTIONAL_KEYS = {"dispatch": str}
_CITE_KEYS = {"file": str, "line": int, "text": str}
_HUNK_RE = re.compile(r"^@@ -\d+(?:,\d+)? \+(\d+)(?:,(\d+))? @@")
_ASSIGN_TEXT_RE = re.compile(r"^[A-Za-z_][\w.]*(?:\[[^\]]*\])?\s*(?::[^=]*)?=(?!=)")


class ContractsError(Exception):
    """The contracts file cannot be read or does not follow the schema (the message lists every problem)."""


@dataclass(frozen=True)
class Cite:
    file: str
    line: int
    text: str


@dataclass(frozen=True)
class Contract:
    index: int  # 1-based position in the file
    patch: str
    file: str
    line: str
    kind: str
    cites: Cite
    why: str
    dispatch: str = ""  # why a call on the line is not a direct native call (empty: every call is native)

    def label(self) -> str:
        return f"contract #{self.index} ({self.file}: {self.line!r})"


@dataclass(frozen=True)
class AddedLine:
    patch: str
    file: str
    text: str  # stripped
    lineno: int  # 1-based, in the patched file
    new_file: bool  # the series creates the file
    patch_line: int = 0  # 1-based line of the ``+`` line in the patch file (where a screen reports it)

    def label(self) -> str:
        return f"{self.patch} {self.file}:{self.lineno} ({self.text!r})"


@dataclass
class LineInfo:
    """What the AST says about the statement (or decorator) that begins on a line of a patched file."""

    kind: str  # import, class, def, decorator, assign, return, if, raise, expr, other
    node: ast.AST
    function: str | None  # innermost enclosing function
    klass: str | None  # innermost enclosing class
    class_level: bool  # directly in a class body
    decorated: str | None = None  # decorator lines: the decorated function's name
    symbols: set[str] = field(default_factory=set)


# ---------------------------------------------------------------------------------------------------------- parsing


def load_contracts(path: Path) -> list[Contract]:
    """Parse and schema-check ``path``; raises ContractsError listing every schema problem."""
    try:
        data = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise ContractsError(f"{path}: {e}") from e
    problems = []
    if data.get("schema") != SCHEMA:
        problems.append(f"schema must be {SCHEMA}, got {data.get('schema')!r}")
    if data.get("vllm") != VLLM_VERSION:
        problems.append(f"vllm must be {VLLM_VERSION!r}, got {data.get('vllm')!r}")
    unknown = set(data) - {"schema", "vllm", "contract"}
    if unknown:
        problems.append(f"unknown top-level keys: {sorted(unknown)}")
    raw = data.get("contract", [])
    if not isinstance(raw, list):
        problems.append("contract must be an array of tables ([[contract]])")
        raw = []
    contracts = []
    for index, entry in enumerate(raw, 1):
        where = f"contract #{index}"
        entry_problems = _check_keys(entry, _CONTRACT_KEYS, where, _OPTIONAL_KEYS)
        if not entry_problems:
            entry_problems += _check_keys(entry["cites"], _CITE_KEYS, f"{where} cites")
        if not entry_problems:
            if entry["kind"] not in KINDS:
                entry_problems.append(f"{where}: kind {entry['kind']!r} is not one of {', '.join(KINDS)}")
            if entry["cites"]["line"] < 1:
                entry_problems.append(f"{where}: cites.line must be >= 1")
            if not entry["why"].strip():
                entry_problems.append(f"{where}: why is empty")
            if entry["line"] != entry["line"].strip():
                entry_problems.append(f"{where}: line must be stripped")
        problems += entry_problems
        if not entry_problems:
            cite = entry["cites"]
            contracts.append(
                Contract(
                    index,
                    entry["patch"],
                    entry["file"],
                    entry["line"],
                    entry["kind"],
                    Cite(cite["file"], cite["line"], cite["text"]),
                    entry["why"],
                    entry.get("dispatch", ""),
                )
            )
    if problems:
        raise ContractsError(f"{path}:\n" + "\n".join(problems))
    return contracts


def _check_keys(
    table: object, spec: dict[str, type], where: str, optional: dict[str, type] | None = None
) -> list[str]:
    if not isinstance(table, dict):
        return [f"{where}: must be a table"]
    optional = optional or {}
    problems = [f"{where}: missing key {key!r}" for key in spec if key not in table]
    problems += [f"{where}: unknown key {key!r}" for key in table if key not in spec and key not in optional]
    problems += [
        f"{where}: {key} must be {typ.__name__}, got {type(table[key]).__name__}"
        for key, typ in {**spec, **optional}.items()
        if key in table and (not isinstance(table[key], typ) or (typ is int and isinstance(table[key], bool)))
    ]
    return problems


def added_python_lines(series: Series) -> list[AddedLine]:
    """Every added Python line of the series, in order: ``+`` lines of ``.py`` files, not blank, not comments."""
    lines = []
    for patch in series.patches:
        current: str | None = None
        new_file = False
        new_ln = 0
        remaining = 0
        for patch_line, raw in enumerate(patch.read_text().splitlines(), 1):
            if raw.startswith("diff --git "):
                current, new_file, remaining = raw.split(" b/", 1)[1], False, 0
                continue
            if current is None:
                continue
            if remaining == 0:
                if raw.startswith("new file mode"):
                    new_file = True
                hunk = _HUNK_RE.match(raw)
                if hunk:
                    new_ln = int(hunk.group(1))
                    remaining = int(hunk.group(2) if hunk.group(2) is not None else 1)
                continue
            if raw.startswith("\\"):
                continue
            if raw.startswith("+"):
                text = raw[1:].strip()
                if current.endswith(".py") and text and not text.startswith("#"):
                    lines.append(AddedLine(patch.name, current, text, new_ln, new_file, patch_line))
                new_ln += 1
                remaining -= 1
            elif raw.startswith(" ") or raw == "":
                new_ln += 1
                remaining -= 1
            # "-" lines do not advance the new side
    return lines


# ------------------------------------------------------------------------------------------------------ AST context


def _final_name(node: ast.AST | None) -> str | None:
    while isinstance(node, (ast.Call, ast.Subscript, ast.Starred)):
        node = node.func if isinstance(node, ast.Call) else node.value
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def _chain(node: ast.AST) -> list[str] | None:
    """``a.b.c`` -> ["a", "b", "c"]; None when the expression is not a dotted name."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return [node.id, *reversed(parts)]


def _native_rooted(node: ast.AST) -> bool:
    """A dotted name starting at ``_backend`` or ``self._native``."""
    parts = _chain(node)
    return parts is not None and (parts[0] in NATIVE_MODULES or parts[:2] == ["self", "_native"])


def _framework_names(value: ast.AST | None) -> set[str]:
    """Names a returned/assigned value takes from the framework (native calls and attributes excluded)."""
    if value is None:
        return set()
    if isinstance(value, (ast.Tuple, ast.List)):
        return set().union(*(_framework_names(v) for v in value.elts)) if value.elts else set()
    target = value.func if isinstance(value, ast.Call) else value
    if _native_rooted(target):
        return set()
    name = _final_name(value)
    return {name} if name else set()


def _import_symbols(node: ast.Import | ast.ImportFrom) -> set[str]:
    if isinstance(node, ast.ImportFrom):
        roots = {(node.module or "").split(".")[0]}
        names = {a.asname or a.name for a in node.names}
    else:
        roots = {a.name.split(".")[0] for a in node.names}
        names = {a.asname or a.name.split(".")[-1] for a in node.names}
    return _import_symbols_native() if NATIVE_PACKAGE in roots else names


def _import_symbols_native() -> set[str]:
    return {"import_module", "load"}


def _symbols(info: LineInfo) -> set[str]:
    node = info.node
    if info.kind == "import":
        found = _import_symbols(node)  # type: ignore[arg-type]
    elif info.kind == "class":
        found = {_final_name(b) for b in node.bases} - {None}  # type: ignore[attr-defined]
    elif info.kind == "def":
        found = {node.name}  # type: ignore[attr-defined]
    elif info.kind == "decorator":
        found = {_final_name(node)} - {None}
    elif info.kind == "assign":
        targets = node.targets if isinstance(node, ast.Assign) else [node.target]  # type: ignore[attr-defined]
        found = {_final_name(t) for t in targets} - {None}
        if "_native" in found and info.function:
            found.add(info.function)
        found |= _framework_names(node.value)  # type: ignore[attr-defined]
        if info.class_level and info.klass:
            found.add(info.klass)
    elif info.kind in ("return", "expr"):
        found = _framework_names(node.value) | ({info.function} if info.function else set())  # type: ignore
    elif info.kind == "if":
        found = {n.id for n in ast.walk(node.test) if isinstance(n, ast.Name)}  # type: ignore[attr-defined]
        found |= {n.attr for n in ast.walk(node.test) if isinstance(n, ast.Attribute)}  # type: ignore[attr-defined]
    elif info.kind == "raise":
        found = {_final_name(node.exc)} - {None}  # type: ignore[attr-defined]
    else:
        found = set()
    return set(found) - _IGNORED_SYMBOLS  # type: ignore[arg-type]


_KIND_OF = {
    ast.Import: "import",
    ast.ImportFrom: "import",
    ast.ClassDef: "class",
    ast.FunctionDef: "def",
    ast.AsyncFunctionDef: "def",
    ast.Assign: "assign",
    ast.AnnAssign: "assign",
    ast.Return: "return",
    ast.If: "if",
    ast.Raise: "raise",
    ast.Expr: "expr",
}


def line_infos(source: str) -> dict[int, LineInfo]:
    """Map each line where a statement or a decorator begins to its LineInfo."""
    infos: dict[int, LineInfo] = {}

    def visit(body: list[ast.stmt], function: str | None, klass: str | None, class_level: bool) -> None:
        for stmt in body:
            # The first statement on a line describes it (`if x: return y` is an if line).
            kind = _KIND_OF.get(type(stmt), "other")
            infos.setdefault(stmt.lineno, LineInfo(kind, stmt, function, klass, class_level))
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for dec in stmt.decorator_list:
                    infos.setdefault(dec.lineno, LineInfo("decorator", dec, function, klass, class_level, stmt.name))
            if isinstance(stmt, ast.ClassDef):
                visit(stmt.body, None, stmt.name, True)
            elif isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                visit(stmt.body, stmt.name, klass, False)
            else:
                for name in ("body", "orelse", "finalbody"):
                    visit(getattr(stmt, name, []) or [], function, klass, class_level)
                for handler in getattr(stmt, "handlers", []) or []:
                    visit(handler.body, function, klass, class_level)

    visit(ast.parse(source).body, None, None, False)
    for info in infos.values():
        info.symbols = _symbols(info)
    return infos


# ------------------------------------------------------------------------------------------------------------ rules


def _words(text: str) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z0-9_]*", text))


def _is_simple_arg(node: ast.AST) -> bool:
    if isinstance(node, ast.Starred):
        node = node.value
    return isinstance(node, (ast.Name, ast.Constant))


def _is_native_call(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and _native_rooted(node.func)
        and all(_is_simple_arg(a) for a in node.args)
        and all(_is_simple_arg(k.value) for k in node.keywords)
    )


def _is_constant(node: ast.AST) -> bool:
    if isinstance(node, ast.Constant):
        return True
    if isinstance(node, (ast.Tuple, ast.List)):
        return all(_is_constant(e) for e in node.elts)
    parts = _chain(node)
    return parts is not None and parts[0] not in ("self", "cls")


def delegation_problem(info: LineInfo) -> str | None:
    """None when the line is a one-line delegation to ``_backend``/``self._native`` or a constant; else why not."""
    if info.kind in ("import", "class", "def", "decorator"):
        return None
    node = info.node
    if isinstance(node, ast.Assign):
        target = node.targets[0]
        is_self_attr = isinstance(target, ast.Attribute) and _chain(target) == ["self", target.attr]
        if len(node.targets) != 1 or not (isinstance(target, ast.Name) or is_self_attr):
            return "assigns to something other than one name or one self attribute"
        value = node.value
    elif isinstance(node, (ast.AnnAssign, ast.Return, ast.Expr)):
        value = node.value
    else:
        return f"{type(node).__name__.lower()!r} statement: logic in Python; move it to the native side"
    if value is None or _is_native_call(value) or _native_rooted(value) or _is_constant(value):
        return None
    return "not a one-line call into _backend/self._native with plain arguments, a native attribute or a constant"


def _text_kind(text: str) -> str:
    """The statement type of a (possibly incomplete) source line: a keyword, 'assign' or 'expr'."""
    try:
        first = next(t for t in tokenize.generate_tokens(io.StringIO(text).readline) if t.type == tokenize.NAME)
    except (StopIteration, tokenize.TokenError, SyntaxError):
        return "expr"
    if keyword.iskeyword(first.string) and first.start[1] == 0:
        return first.string
    return "assign" if _ASSIGN_TEXT_RE.match(text) else "expr"


def routing_problem(info: LineInfo, cited_text: str) -> str | None:
    """None when a line added to an existing vLLM file mirrors the cited vLLM line (or is a constant assignment)."""
    if info.kind in ("import", "class", "def", "decorator"):
        return None
    if isinstance(info.node, ast.Assign) and isinstance(info.node.value, ast.Constant):
        return None
    cited = _text_kind(cited_text)
    if info.kind != cited:
        return f"statement type {info.kind!r} differs from the cited vLLM line's ({cited!r}); it must mirror it"
    return None


def _module_names(path: Path) -> set[str]:
    """Names bound at the top level of a module (definitions, assignments, imports; try/if bodies included)."""
    names: set[str] = set()

    def visit(body: list[ast.stmt]) -> None:
        for stmt in body:
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(stmt.name)
            elif isinstance(stmt, ast.Assign):
                names.update(n.id for t in stmt.targets for n in ast.walk(t) if isinstance(n, ast.Name))
            elif isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name):
                names.add(stmt.target.id)
            elif isinstance(stmt, (ast.Import, ast.ImportFrom)):
                names.update((a.asname or a.name).split(".")[0] for a in stmt.names)
            elif isinstance(stmt, ast.Try):
                visit(stmt.body)
            elif isinstance(stmt, ast.If):  # a TYPE_CHECKING body binds nothing at run time; its else branch does
                if "TYPE_CHECKING" not in ast.unparse(stmt.test):
                    visit(stmt.body)
                visit(stmt.orelse)

    visit(ast.parse(path.read_text()).body)
    return names


def _module_file(roots: tuple[Path, ...], module: str) -> Path | None:
    for root in roots:
        base = root.joinpath(*module.split("."))
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def import_problem(info: LineInfo, roots: tuple[Path, ...]) -> str | None:
    """None when every name the import line brings in exists in the reference tree (or is the native package)."""
    node = info.node
    if isinstance(node, ast.ImportFrom):
        module = node.module or ""
        if module.split(".")[0] == NATIVE_PACKAGE:
            return None
        if module.split(".")[0] != "vllm":
            return f"{module} is neither vllm nor the native package {NATIVE_PACKAGE}"
        path = _module_file(roots, module)
        if path is None:
            return f"no module {module} in the reference tree"
        missing = [a.name for a in node.names if a.name not in _module_names(path)]
        if missing:
            return f"{module} defines no {', '.join(missing)} in the reference tree"
        return None
    for alias in node.names:  # type: ignore[attr-defined]
        top = alias.name.split(".")[0]
        if top == NATIVE_PACKAGE:
            continue
        if top != "vllm":
            return f"{alias.name} is neither vllm nor the native package {NATIVE_PACKAGE}"
        if _module_file(roots, alias.name) is None:
            return f"no module {alias.name} in the reference tree"
    return None


# ------------------------------------------------------------------------------------------------------------ check


@dataclass
class Report:
    contracts: list[Contract]
    added: list[AddedLine]
    pairs: list[tuple[Contract, AddedLine]]
    problems: list[str]


def _align(contracts: list[Contract], added: list[AddedLine], problems: list[str]) -> list[tuple[Contract, AddedLine]]:
    groups: dict[tuple[str, str], tuple[list[Contract], list[AddedLine]]] = {}
    for a in added:
        groups.setdefault((a.patch, a.file), ([], []))[1].append(a)
    for c in contracts:
        groups.setdefault((c.patch, c.file), ([], []))[0].append(c)
    pairs = []
    for cs, adds in groups.values():
        matcher = difflib.SequenceMatcher(None, [c.line for c in cs], [a.text for a in adds], autojunk=False)
        for op, i1, i2, j1, j2 in matcher.get_opcodes():
            if op == "equal":
                pairs += zip(cs[i1:i2], adds[j1:j2], strict=True)
                continue
            problems += [f"coverage: {c.label()} matches no added line of {c.patch} (stale entry)" for c in cs[i1:i2]]
            problems += [f"coverage: {a.label()} has no [[contract]] entry" for a in adds[j1:j2]]
    return pairs


def check(vllm_src: Path, series: Series, contracts_path: Path) -> Report:
    """Run every rule; returns the report (``problems`` empty when the contracts file is sound)."""
    problems: list[str] = []
    try:
        contracts = load_contracts(contracts_path)
    except ContractsError as e:
        return Report([], [], [], [f"schema: {line}" for line in str(e).splitlines()[1:]] or [f"schema: {e}"])
    version = vllm_version(vllm_src)
    if version != VLLM_VERSION:
        problem = f"reference: vLLM {version} at {vllm_src}, the contracts quote {VLLM_VERSION}"
        return Report(contracts, [], [], [problem])
    added = added_python_lines(series)
    pairs = _align(contracts, added, problems)
    with tempfile.TemporaryDirectory() as tmp:
        original, patched = materialize(vllm_src, series, Path(tmp))
        infos = {f: line_infos((patched / f).read_text()) for f in {a.file for a in added}}
        for c, a in pairs:
            _check_pair(c, a, infos[a.file].get(a.lineno), original, vllm_src, problems)
    return Report(contracts, added, pairs, problems)


def _reference_lines(rel: str, original: Path, vllm_src: Path) -> list[str] | None:
    for root in (original, vllm_src):
        path = root / rel
        if path.is_file():
            return path.read_text().splitlines()
    return None


def _check_pair(
    c: Contract, a: AddedLine, info: LineInfo | None, original: Path, vllm_src: Path, problems: list[str]
) -> None:
    where = c.label()
    if c.kind != KEPT_KIND:
        problems.append(f"kind: {where} is {c.kind!r}: only {KEPT_KIND} may remain; port it to the native side")
    ref_lines = _reference_lines(c.cites.file, original, vllm_src)
    cited_ok = False
    if ref_lines is None:
        problems.append(f"citation: {where} cites {c.cites.file}, which the reference tree does not have")
    elif c.cites.line > len(ref_lines):
        problems.append(f"citation: {where} cites {c.cites.file}:{c.cites.line}, past its end ({len(ref_lines)})")
    elif ref_lines[c.cites.line - 1].strip() != c.cites.text:
        actual = ref_lines[c.cites.line - 1].strip()
        found = [i + 1 for i, text in enumerate(ref_lines) if text.strip() == c.cites.text]
        hint = f"; the quoted text is at line {', '.join(map(str, found))}" if found else ""
        problems.append(
            f"citation: {where}: stale citation {c.cites.file}:{c.cites.line} reads {actual!r}, "
            f"contracts.toml quotes {c.cites.text!r}{hint}"
        )
    else:
        cited_ok = True
    if info is None:
        problems.append(f"statement: {where}: the line does not begin a statement; write one statement per line")
        return
    if cited_ok:
        if info.kind == "import" and not a.new_file and info.symbols == _import_symbols_native():
            # The native package imported by an existing vLLM module is loaded when vLLM imports that module.
            module = c.file.removesuffix(".py").replace("/", ".")
            if not re.search(rf"^(from {re.escape(module)} import\b|import {re.escape(module)}\b)", c.cites.text):
                problems.append(
                    f"symbol: {where}: a native import added to an existing vLLM module must cite vLLM's import of "
                    f"that module ('from {module} import ...'), got {c.cites.text!r}"
                )
        elif not info.symbols & _words(c.cites.text):
            problems.append(
                f"symbol: {where}: the cited text names none of the line's key symbols {sorted(info.symbols)}"
            )
        if info.kind == "decorator" and info.decorated:
            following = ref_lines[c.cites.line : c.cites.line + 3]  # type: ignore[index]
            if not any(re.search(rf"\bdef {re.escape(info.decorated)}\b", t) for t in following):
                problems.append(f"symbol: {where}: the cited decorator does not decorate a {info.decorated} method")
        if not a.new_file:
            problem = routing_problem(info, c.cites.text)
            if problem:
                problems.append(f"routing: {where}: {problem}")
    if a.new_file:
        problem = delegation_problem(info)
        if problem:
            problems.append(f"delegation: {where}: {problem}")
    if info.kind == "import":
        problem = import_problem(info, (original, vllm_src))
        if problem:
            problems.append(f"imports: {where}: {problem}")


# -------------------------------------------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.contracts", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["check", "list"])
    parser.add_argument("--vllm-src", type=Path, metavar="DIR",
                        help="reference tree holding vllm/ (default: build/vllm-ref, made when missing)")
    parser.add_argument("--patches", type=Path, default=DEFAULT_PATCHES, metavar="DIR", help="patch series directory")
    parser.add_argument("--contracts", type=Path, metavar="FILE", help="default: contracts.toml in --patches")
    args = parser.parse_args(argv)
    contracts_path = args.contracts or args.patches / "contracts.toml"
    try:
        if args.vllm_src is None:
            from tools.vllm_tree import reference_tree

            args.vllm_src = reference_tree()
        series = Series.load(args.patches)
        report = check(args.vllm_src.resolve(), series, contracts_path)
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    if args.command == "list":
        kinds = {id(a): c.kind for c, a in report.pairs}
        for a in report.added:
            print(f"{a.patch}\t{a.file}:{a.lineno}\t{kinds.get(id(a), '(no entry)')}\t{a.text}")
    for problem in report.problems:
        print(problem)
    if report.problems:
        print(f"FAIL: {len(report.problems)} problem(s) in {contracts_path}")
        return 1
    print(
        f"OK: {len(report.contracts)} contracts cover the {len(report.added)} added Python lines of "
        f"{len(series.patches)} patches; every one is {KEPT_KIND}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
