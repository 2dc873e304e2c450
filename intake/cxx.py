"""Parse one C/C++ translation unit with libclang and reduce it to facts (plain JSON data) for the rules.

The facts cover the main file and every project header it includes (project: under the root, outside ``.venv``,
``build``, ``dist`` and ``.git``); code in third-party headers (pybind11, torch, the standard library) is never
walked. Callees are resolved through each cursor's referenced declaration and its USR, never through spelling, so
namespace aliases, ``using`` declarations and macros resolve as the compiler sees them.

Facts of one translation unit::

    main, flags_source, errors: [{path, line, col, message, missing}]   (severity >= error)
    files: {rel: {includes: [{line, col, spelled, forbidden}], imports: [{line, col, call, macro}],
                  bindings: [{line, col, name, method, callables, params, field_writes}]}}
        (a binding: a pybind11 ``.def*`` call, method its name; or an entry of a CPython binding table, method the
        table's type: ``PyMethodDef`` (callables: the C function), ``PyGetSetDef`` (its setter), ``PyMemberDef``
        (field_writes: the member's field, unless flagged READONLY))
    functions: {id: {name, path, line, calls: [id], sinks: [{path, line, col, call}], reads: [usr], writes: [usr]}}
    overrides: [[base usr, overrider usr]]      state: {usr: {name, path, line}}     functional: bool
    names: {usr: qualified name} of the project functions called (declared-only ones included)
    deps: [absolute paths of every file the unit included]

The include graph is that of the ``#include`` directives the preprocessor processed (an edge for every directive,
also one that include guards made a no-op); a file reaches what its directives reach. ``deps``, ``functional``
(pybind11/functional.h is reached from the main file) and a project include's ``forbidden`` (the first Python
header it reaches) come from it.

A unit may be parsed against a shared prelude (``intake/prelude.py``): a precompiled header of the third-party
headers its project files include, built once for every unit with the same flags with function bodies skipped
(``build_prelude``). Only declarations are read from third-party headers, so the facts are the same; the prelude's
own include graph stands in for the part of the unit's graph that the precompiled header holds.

A function id is its USR; a lambda's is ``lambda@PATH:LINE:COL``.
"""

from __future__ import annotations

import ctypes
import os
import re
import sys
import time
from pathlib import Path
from typing import Any

import clang.cindex as ci

K = ci.CursorKind
FUNC_KINDS = frozenset(
    {K.FUNCTION_DECL, K.CXX_METHOD, K.CONSTRUCTOR, K.DESTRUCTOR, K.CONVERSION_FUNCTION, K.FUNCTION_TEMPLATE}
)
_SCOPE_KINDS = frozenset(
    {
        K.NAMESPACE,
        K.CLASS_DECL,
        K.STRUCT_DECL,
        K.UNION_DECL,
        K.CLASS_TEMPLATE,
        K.CLASS_TEMPLATE_PARTIAL_SPECIALIZATION,
        K.ENUM_DECL,
    }
)
_WRAPPERS = frozenset({K.UNEXPOSED_EXPR, K.PAREN_EXPR, K.CXX_FUNCTIONAL_CAST_EXPR, K.CSTYLE_CAST_EXPR})

# C API entry points that import or run Python code.
IMPORT_C_RE = re.compile(r"^(PyImport_\w+|PyRun_\w+|Py_RunMain|Py_Main|Py_BytesMain|PyEval_EvalCode\w*)$")
# C API entry points that call a Python callable.
PYCALL_C_RE = re.compile(
    r"^(_?PyObject_(Call|Vectorcall)\w*|PyEval_Call(Object|Function|Method)\w*|PyCFunction_Call|PyVectorcall_Call"
    r"|PyIter_Send)$"
)
# Types that hold a Python object (callable) or a std::function (a Python callable through pybind11/functional.h).
CALLABLE_TYPE_RE = re.compile(
    r"\bpybind11::(function|object|handle)\b|\bstd::(\w+::)?function<|^_object \*$|[<,] ?_object \*"
)
BIND_METHODS = frozenset(
    {
        "def",
        "def_static",
        "def_property",
        "def_property_readonly",
        "def_property_static",
        "def_property_readonly_static",
        "def_readwrite",
        "def_readonly",
        "def_readwrite_static",
        "def_readonly_static",
    }
)
# CPython's binding tables: each entry is a binding, as a pybind11 ``.def`` call is (its first field the Python name).
C_API_TABLES = frozenset({"PyMethodDef", "PyGetSetDef", "PyMemberDef"})
_PY_READONLY = 1  # PyMemberDef.flags: READONLY / Py_READONLY (structmember.h, descrobject.h)
_MUTATORS = frozenset(
    {
        "operator=",
        "operator[]",
        "push_back",
        "emplace_back",
        "push_front",
        "emplace_front",
        "emplace",
        "insert",
        "insert_or_assign",
        "try_emplace",
        "assign",
        "swap",
    }
)
_BUILTIN_PREFIXES = ("__builtin_", "__atomic_", "__sync_", "__c11_atomic_")
EXCLUDED_TOP = (".venv", "build", "dist", ".git", "node_modules")


def forbidden_header(name: str) -> bool:
    """Python.h, a pybind11/ header, torch/python.h or torch/extension.h (a spelled or a resolved name)."""
    name = name.replace(os.sep, "/")
    base = name.rsplit("/", 1)[-1]
    return (
        base == "Python.h"
        or name.startswith("pybind11/")
        or "/pybind11/" in name
        or name == "torch/python.h"
        or name.endswith("/torch/python.h")
        or name == "torch/extension.h"
        or name.endswith("/torch/extension.h")
    )


_lib_ready = False


def _lib() -> Any:
    """libclang with the few C entry points cindex 18 does not wrap."""
    global _lib_ready
    lib = ci.conf.lib
    if not _lib_ready:
        lib.clang_getOverriddenCursors.argtypes = [
            ci.Cursor,
            ctypes.POINTER(ctypes.POINTER(ci.Cursor)),
            ctypes.POINTER(ctypes.c_uint),
        ]
        lib.clang_getOverriddenCursors.restype = None
        lib.clang_disposeOverriddenCursors.argtypes = [ctypes.POINTER(ci.Cursor)]
        lib.clang_disposeOverriddenCursors.restype = None
        lib.clang_getCursorBinaryOperatorKind.argtypes = [ci.Cursor]
        lib.clang_getCursorBinaryOperatorKind.restype = ctypes.c_int
        lib.clang_getSpecializedCursorTemplate.argtypes = [ci.Cursor]
        lib.clang_getSpecializedCursorTemplate.restype = ci.Cursor
        lib.clang_Cursor_Evaluate.argtypes = [ci.Cursor]
        lib.clang_Cursor_Evaluate.restype = ctypes.c_void_p
        lib.clang_EvalResult_getKind.argtypes = [ctypes.c_void_p]
        lib.clang_EvalResult_getKind.restype = ctypes.c_int
        lib.clang_EvalResult_getAsLongLong.argtypes = [ctypes.c_void_p]
        lib.clang_EvalResult_getAsLongLong.restype = ctypes.c_longlong
        lib.clang_EvalResult_dispose.argtypes = [ctypes.c_void_p]
        lib.clang_EvalResult_dispose.restype = None
        _lib_ready = True
    return lib


_ASSIGN_KIND = None


def _is_assignment(c: ci.Cursor) -> bool:
    global _ASSIGN_KIND
    lib = _lib()
    if _ASSIGN_KIND is None:
        lib.clang_getBinaryOperatorKindSpelling.argtypes = [ctypes.c_int]
        lib.clang_getBinaryOperatorKindSpelling.restype = ci._CXString
        lib.clang_getBinaryOperatorKindSpelling.errcheck = ci._CXString.from_result
        _ASSIGN_KIND = next(k for k in range(1, 40) if lib.clang_getBinaryOperatorKindSpelling(k) == "=")
    return lib.clang_getCursorBinaryOperatorKind(c) == _ASSIGN_KIND


def int_value(c: ci.Cursor) -> int | None:
    """The value of an integer constant expression (a macro such as READONLY included), else None."""
    lib = _lib()
    res = lib.clang_Cursor_Evaluate(c)
    if not res:
        return None
    try:
        return lib.clang_EvalResult_getAsLongLong(res) if lib.clang_EvalResult_getKind(res) == 1 else None  # CXEval_Int
    finally:
        lib.clang_EvalResult_dispose(res)


def overridden_usrs(c: ci.Cursor) -> list[str]:
    lib = _lib()
    out = ctypes.POINTER(ci.Cursor)()
    n = ctypes.c_uint(0)
    lib.clang_getOverriddenCursors(c, ctypes.byref(out), ctypes.byref(n))
    usrs = [out[i].get_usr() for i in range(n.value)]
    if n.value:
        lib.clang_disposeOverriddenCursors(out)
    return usrs


def template_usr(c: ci.Cursor) -> str | None:
    t = _lib().clang_getSpecializedCursorTemplate(c)
    if t is None or t.kind.is_invalid():
        return None
    usr = t.get_usr()
    return usr or None


def qualified_name(c: ci.Cursor | None) -> str:
    parts: list[str] = []
    while c is not None and c.kind != K.TRANSLATION_UNIT:
        if c.kind in _SCOPE_KINDS or c.kind in FUNC_KINDS or c.kind in (K.FIELD_DECL, K.VAR_DECL):
            parts.append(c.spelling or "(anonymous)")
        c = c.semantic_parent
    return "::".join(reversed(parts))


def _in_pybind11(c: ci.Cursor | None) -> bool:
    return qualified_name(c).split("::", 1)[0] == "pybind11"


def _is_c_function(r: ci.Cursor) -> bool:
    parent = r.semantic_parent
    return r.kind == K.FUNCTION_DECL and (
        parent is None or parent.kind in (K.TRANSLATION_UNIT, K.UNEXPOSED_DECL, K.LINKAGE_SPEC)
    )


def import_call(r: ci.Cursor) -> str | None:
    """The call's name when the referenced declaration imports or runs Python, else None."""
    if _is_c_function(r) and IMPORT_C_RE.match(r.spelling):
        return r.spelling
    if r.kind in (K.CXX_METHOD, K.FUNCTION_TEMPLATE) and r.spelling in ("import", "reload"):
        parent = r.semantic_parent
        if parent is not None and parent.spelling in ("module_", "module") and _in_pybind11(parent):
            return f"pybind11::module_::{r.spelling}"
    if r.kind in (K.FUNCTION_DECL, K.FUNCTION_TEMPLATE) and r.spelling in ("eval", "exec", "eval_file"):
        parent = r.semantic_parent
        if parent is not None and parent.kind == K.NAMESPACE and qualified_name(parent) == "pybind11":
            return f"pybind11::{r.spelling}"
    return None


def python_call(r: ci.Cursor) -> str | None:
    """The call's name when the referenced declaration calls a Python callable, else None."""
    if r.spelling == "operator()" and r.kind in (K.CXX_METHOD, K.FUNCTION_TEMPLATE):
        parent = r.semantic_parent
        if parent is not None and parent.spelling == "object_api" and _in_pybind11(parent):
            return "pybind11::object::operator()"
    if _is_c_function(r) and PYCALL_C_RE.match(r.spelling):
        return r.spelling
    return None


def _strip(c: ci.Cursor) -> ci.Cursor:
    while c.kind in _WRAPPERS:
        kids = list(c.get_children())
        if len(kids) != 1:
            break
        c = kids[0]
    return c


_DECLTYPE_RE = re.compile(r"decltype\(\s*&?\s*(?:::)?(\w+)\s*\)")


def call_text(c: ci.Cursor) -> str | None:
    """The expression's source text from its tokens (no layout: a reflowed call keeps its text), or None when the
    tokens do not lie where the expression is written (macro expansions)."""
    ext = c.extent
    tokens = list(c.get_tokens())
    if not tokens or len(tokens) > 60 or c.location.file is None:
        return None
    name = c.location.file.name
    first = tokens[0].location
    if (first.line, first.column) != (ext.start.line, ext.start.column):
        return None
    for t in tokens:
        loc = t.location
        if loc.file is None or loc.file.name != name or not ext.start.line <= loc.line <= ext.end.line:
            return None
    out = ""
    for tok in (t.spelling for t in tokens):
        if out and (out[-1].isalnum() or out[-1] == "_") and (tok[0].isalnum() or tok[0] == "_"):
            out += " "
        out += tok
    return out


def _string_value(literal: str) -> str:
    m = re.match(r'^(?:u8|u|U|L)?"(.*)"$', literal, re.S)
    return m.group(1) if m else literal


def _directive_edges(tops: list[ci.Cursor], graph: dict[str, list[str]]) -> None:
    """Add to ``graph`` an edge (includer -> included, normalised absolute paths) for every inclusion directive among
    ``tops`` (a translation unit's top-level cursors, which hold its preprocessing record)."""
    for c in tops:
        if c.kind != K.INCLUSION_DIRECTIVE or c.location.file is None:
            continue
        try:
            included = c.get_included_file()
        except AssertionError:  # cindex asserts on a file that was not found
            continue
        if included is not None:
            src = os.path.normpath(c.location.file.name)
            graph.setdefault(src, []).append(os.path.normpath(included.name))


def _reached(graph: dict[str, list[str]], start: str) -> set[str]:
    seen = {start}
    stack = [start]
    while stack:
        for nxt in graph.get(stack.pop(), ()):
            if nxt not in seen:
                seen.add(nxt)
                stack.append(nxt)
    return seen


class _Walker:
    def __init__(
        self, tu: ci.TranslationUnit, main: Path, root: Path, prelude_graph: dict[str, list[str]] | None = None
    ) -> None:
        self.tu = tu
        self.prelude_graph = prelude_graph or {}
        self.main = main
        self.root = root
        self.rel_cache: dict[str, str | None] = {}
        self.files: dict[str, dict[str, Any]] = {}
        self.functions: dict[str, dict[str, Any]] = {}
        self.overrides: set[tuple[str, str]] = set()
        self.state: dict[str, dict[str, Any]] = {}
        self.macros: dict[tuple[str, int], list[tuple[int, int, str]]] = {}
        self.write_targets: set[int] = set()
        self.functional = False
        self.include_graph: dict[str, list[str]] = {}
        self.deps: set[str] = set()
        self.state_cache: dict[str, bool] = {}
        self.project_decl_cache: dict[str, bool] = {}
        self.callee_refs: set[int] = set()
        self.names: dict[str, str] = {}  # USR -> qualified name of the project functions called
        self.aliases: dict[str, str] = {}  # pointer variable/field USR -> the Python entry point it was set from
        self.pointer_calls: list[tuple[ci.Cursor, str, str | None, str, str, str]] = []

    # ------------------------------------------------------------------------------------------------ locations

    def rel(self, name: str | None) -> str | None:
        """Project-relative path of a file name, or None for files outside the project."""
        if not name:
            return None
        if name in self.rel_cache:
            return self.rel_cache[name]
        path = os.path.normpath(name if os.path.isabs(name) else os.path.join(str(self.root), name))
        rel: str | None
        try:
            parts = Path(path).relative_to(self.root).parts
            rel = "/".join(parts) if parts and parts[0] not in EXCLUDED_TOP and "site-packages" not in parts else None
        except ValueError:
            rel = None
        self.rel_cache[name] = rel
        return rel

    def file_facts(self, rel: str) -> dict[str, Any]:
        return self.files.setdefault(rel, {"includes": [], "imports": [], "bindings": []})

    def is_project_decl(self, r: ci.Cursor) -> bool:
        usr = r.get_usr()
        if usr in self.project_decl_cache:
            return self.project_decl_cache[usr]
        f = r.location.file
        # A compiler builtin is declared where it is first used, which may be project code: never the project's.
        builtin = r.kind == K.FUNCTION_DECL and r.spelling.startswith(_BUILTIN_PREFIXES)
        ok = not builtin and self.rel(f.name if f else None) is not None
        if usr:
            self.project_decl_cache[usr] = ok
        return ok

    def macro_at(self, rel: str, line: int, col: int) -> str | None:
        """The invocation text of the macro expanded at (line, col), e.g. ``LOAD("os")``, or None."""
        for start, end, text in self.macros.get((rel, line), []):
            if start <= col <= end:
                return text
        return None

    # ------------------------------------------------------------------------------------------------- includes

    def collect_includes(self, tops: list[ci.Cursor]) -> None:
        graph: dict[str, list[str]] = {src: list(dsts) for src, dsts in self.prelude_graph.items()}
        _directive_edges(tops, graph)
        self.include_graph = graph
        main = os.path.normpath(str(self.main))
        self.deps = _reached(graph, main) - {main}
        self.functional = any(d.replace(os.sep, "/").endswith("pybind11/functional.h") for d in self.deps)

    def forbidden_via(self, resolved: str) -> str | None:
        """The first forbidden header ``resolved`` is or pulls in (depth first), else None."""
        seen: set[str] = set()
        stack = [resolved]
        while stack:
            f = stack.pop()
            if f in seen:
                continue
            seen.add(f)
            if forbidden_header(f):
                return f
            stack.extend(reversed(self.include_graph.get(f, [])))
        return None

    # ------------------------------------------------------------------------------------------------- the walk

    def run(self) -> None:
        tops = [c for c in self.tu.cursor.get_children()]
        if self.prelude_graph:
            # Parsed with only its own declarations (Index excludeDecls): libclang then lists the unit's template
            # instantiations among the top-level cursors too; the walk reads code as written, as without a prelude.
            tu_kind = K.TRANSLATION_UNIT
            tops = [c for c in tops if not c.kind.is_declaration() or c.lexical_parent.kind == tu_kind]
        self.collect_includes(tops)
        for c in tops:
            if c.kind == K.MACRO_INSTANTIATION:
                rel = self.rel(c.location.file.name if c.location.file else None)
                if rel is not None:
                    ext = c.extent
                    end = ext.end.column if ext.start.line == ext.end.line else 10**6
                    text = call_text(c) or c.spelling
                    self.macros.setdefault((rel, ext.start.line), []).append((ext.start.column, end, text))
        for c in tops:
            if c.kind in (K.MACRO_INSTANTIATION, K.MACRO_DEFINITION):
                continue
            rel = self.rel(c.location.file.name if c.location.file else None)
            if rel is None:
                continue
            self.file_facts(rel)
            if c.kind == K.INCLUSION_DIRECTIVE:
                self.include(c, rel)
                continue
            self.visit(c, rel, None)
        self.resolve_pointer_calls()

    def include(self, c: ci.Cursor, rel: str) -> None:
        spelled = c.spelling
        try:
            included = c.get_included_file()
        except AssertionError:  # cindex asserts on a file that was not found
            included = None
        forbidden: str | None = None
        if forbidden_header(spelled):
            forbidden = spelled
        elif included is not None:
            hit = self.forbidden_via(os.path.normpath(included.name))
            if hit:
                forbidden = f"{_short_header(hit)} (through {spelled})"
        self.file_facts(rel)["includes"].append(
            {"line": c.location.line, "col": c.location.column, "spelled": spelled, "forbidden": forbidden}
        )

    def new_node(self, ident: str, name: str, rel: str, line: int) -> dict[str, Any]:
        node = self.functions.get(ident)
        if node is None:
            node = {"name": name, "path": rel, "line": line, "calls": [], "sinks": [], "reads": [], "writes": []}
            self.functions[ident] = node
        return node

    def is_state(self, r: ci.Cursor) -> bool:
        """A project field or a global/static variable whose type holds a Python object or a std::function."""
        usr = r.get_usr()
        if usr in self.state_cache:
            return self.state_cache[usr]
        ok = False
        if r.kind in (K.FIELD_DECL, K.VAR_DECL) and self.is_project_decl(r):
            parent = r.semantic_parent
            persistent = r.kind == K.FIELD_DECL or parent is None or parent.kind not in FUNC_KINDS
            if r.kind == K.VAR_DECL and not persistent:
                persistent = r.storage_class == ci.StorageClass.STATIC
            canonical = r.type.get_canonical().spelling
            # A function pointer is native code, even one whose signature mentions Python objects.
            if persistent and "(*" not in canonical and CALLABLE_TYPE_RE.search(canonical):
                ok = True
                f = r.location.file
                self.state[usr] = {
                    "name": qualified_name(r),
                    "path": self.rel(f.name if f else None),
                    "line": r.location.line,
                }
        self.state_cache[usr] = ok
        return ok

    def mark_write(self, target: ci.Cursor, node: dict[str, Any] | None) -> None:
        t = _strip(target)
        if t.kind in (K.MEMBER_REF_EXPR, K.DECL_REF_EXPR):
            r = t.referenced
            if r is not None and self.is_state(r):
                self.write_targets.add(t.hash)
                if node is not None:
                    node["writes"].append(r.get_usr())

    def visit(self, c: ci.Cursor, rel: str, node_id: str | None, decl: str | None = None) -> None:
        """Walk ``c``; ``node_id``: the function (or lambda) whose body this is; ``decl``: the variable or field
        whose type or initializer this is (a function named there makes it a pointer to that function)."""
        kind = c.kind
        node = self.functions.get(node_id) if node_id else None

        if kind in FUNC_KINDS and c.is_definition():
            ident = c.get_usr() or f"fn@{rel}:{c.location.line}:{c.location.column}"
            self.new_node(ident, qualified_name(c), rel, c.location.line)
            if kind == K.CXX_METHOD:
                for base in overridden_usrs(c):
                    self.overrides.add((base, ident))
            for child in c.get_children():
                self.visit(child, rel, ident)
            return
        if kind == K.LAMBDA_EXPR:
            loc = c.location
            ident = f"lambda@{rel}:{loc.line}:{loc.column}"
            self.new_node(ident, f"lambda at {rel}:{loc.line}", rel, loc.line)
            if node is not None:
                node["calls"].append(ident)
            for child in c.get_children():
                self.visit(child, rel, ident)
            return
        if kind in (K.VAR_DECL, K.FIELD_DECL):
            for child in c.get_children():
                self.visit(child, rel, node_id, c.get_usr() or decl)
            return
        if kind == K.BINARY_OPERATOR and _is_assignment(c):
            kids = list(c.get_children())
            if len(kids) == 2:
                self.mark_write(kids[0], node)
                lhs = _strip(kids[0])
                target = lhs.referenced if lhs.kind in (K.DECL_REF_EXPR, K.MEMBER_REF_EXPR) else None
                self.visit(kids[0], rel, node_id, decl)
                self.visit(kids[1], rel, node_id, target.get_usr() if target is not None else decl)
                return

        if kind == K.CALL_EXPR:
            self.call(c, rel, node, node_id)
        elif kind in (K.DECL_REF_EXPR, K.MEMBER_REF_EXPR, K.MEMBER_REF):
            r = c.referenced
            if r is not None:
                self.reference(c, r, rel, node, decl)
        elif kind == K.INIT_LIST_EXPR and self.c_api_entry(c, rel):
            pass
        elif kind == K.INIT_LIST_EXPR and node is not None:
            record = c.type.get_canonical().get_declaration()
            if record is not None and record.kind in (K.STRUCT_DECL, K.CLASS_DECL):
                for f in record.get_children():
                    if f.kind == K.FIELD_DECL and self.is_state(f):
                        node["writes"].append(f.get_usr())

        for child in c.get_children():
            self.visit(child, rel, node_id, decl)

    def reference(
        self, c: ci.Cursor, r: ci.Cursor, rel: str, node: dict[str, Any] | None, decl: str | None
    ) -> None:
        if r.kind in FUNC_KINDS:
            if c.hash not in self.callee_refs:  # named, not called: its address is taken
                name = import_call(r) or (r.spelling if _is_c_function(r) and PYCALL_C_RE.match(r.spelling) else None)
                if name and decl:
                    self.aliases[decl] = name
                elif name and import_call(r):
                    self.site(c, rel, "imports", name, f"takes the address of {name}", None)
            if node is not None and self.is_project_decl(r):
                usr = r.get_usr()
                node["calls"].append(usr)
                if usr not in self.names:
                    self.names[usr] = qualified_name(r)
                tmpl = template_usr(r)
                if tmpl:
                    node["calls"].append(tmpl)
            return
        if r.kind in (K.FIELD_DECL, K.VAR_DECL) and self.is_state(r):
            if c.kind == K.MEMBER_REF:  # a constructor's member initializer
                if node is not None:
                    node["writes"].append(r.get_usr())
            elif c.hash not in self.write_targets and node is not None:
                node["reads"].append(r.get_usr())

    def site(
        self, c: ci.Cursor, rel: str, what: str, target: str, how: str, node: dict[str, Any] | None
    ) -> None:
        """Record an import (``what`` = "imports") or a Python call ("sinks", into ``node``) at ``c``."""
        loc = c.location
        site_rel = self.rel(loc.file.name if loc.file else None) or rel
        macro = self.macro_at(site_rel, loc.line, loc.column)
        text = macro or call_text(c)
        record = {
            "path": site_rel,
            "line": loc.line,
            "col": loc.column,
            "call": text or target,
            "target": target,
            "how": how,
            "macro": macro,
        }
        if what == "imports":
            self.file_facts(site_rel)["imports"].append(record)
        elif node is not None:
            node["sinks"].append(record)

    def call(self, c: ci.Cursor, rel: str, node: dict[str, Any] | None, node_id: str | None) -> None:
        r = c.referenced
        if r is None:
            return
        usr = r.get_usr()
        for child in c.get_children():
            callee = _strip(child)
            if callee.kind in (K.DECL_REF_EXPR, K.MEMBER_REF_EXPR):
                ref = callee.referenced
                if ref is not None and ref.get_usr() == usr:
                    self.callee_refs.add(callee.hash)
        spelling = r.spelling
        if spelling in _MUTATORS:
            kids = list(c.get_children())
            if kids:
                target = _strip(kids[0])
                if target.kind == K.MEMBER_REF_EXPR and target.referenced is not None:
                    if target.referenced.kind in FUNC_KINDS:  # obj.push_back(...): the object is the member's child
                        inner = list(target.get_children())
                        target = inner[0] if inner else target
                self.mark_write(target, node)
        if r.kind == K.CONSTRUCTOR and node is not None and self.is_project_decl(r):
            node["calls"].append(usr)  # a construction has no callee reference below it
        if r.kind in (K.FIELD_DECL, K.VAR_DECL, K.PARM_DECL):  # a call through a function pointer
            self.pointer_calls.append((c, rel, node_id, usr, r.type.spelling, qualified_name(r) or r.spelling))
            return
        name = import_call(r)
        if name:
            self.site(c, rel, "imports", name, f"calls {name}", None)
        pycall = python_call(r)
        if pycall:
            self.site(c, rel, "sinks", pycall, f"calls {pycall}", node)
        if spelling in BIND_METHODS and r.kind in (K.CXX_METHOD, K.FUNCTION_TEMPLATE):
            parent = r.semantic_parent
            if parent is not None and parent.spelling in ("class_", "module_", "module") and _in_pybind11(parent):
                self.binding(c, r, rel)

    def resolve_pointer_calls(self) -> None:
        """Calls through pointers declared from (or set to) a Python entry point: ``decltype(&PyImport_X) f``."""
        for c, rel, node_id, usr, type_spelling, name in self.pointer_calls:
            target = self.aliases.get(usr)
            if target is None:
                m = _DECLTYPE_RE.search(type_spelling)
                target = m.group(1) if m else None
            if target is None:
                continue
            how = f"calls {target} through the pointer `{name}`"
            if IMPORT_C_RE.match(target) or target.startswith("pybind11::"):
                self.site(c, rel, "imports", target, how, None)
            elif PYCALL_C_RE.match(target):
                self.site(c, rel, "sinks", target, how, self.functions.get(node_id) if node_id else None)

    def binding(self, c: ci.Cursor, r: ci.Cursor, rel: str) -> None:
        args = list(c.get_arguments())
        if not args:
            return
        first = _strip(args[0])
        if first.kind == K.STRING_LITERAL:
            tokens = [t.spelling for t in first.get_tokens()]
            name, loc, rest = _string_value(tokens[0] if tokens else first.spelling), first.location, args[1:]
        else:  # .def(py::init(...)): the constructor, Python's __init__
            name, loc, rest = "__init__", first.location, args
        callables: list[str] = []
        params: list[str] = []
        field_writes: list[str] = []
        for arg in rest:
            self.binding_arg(arg, r, callables, params, field_writes)
        site_rel = self.rel(loc.file.name if loc.file else None) or rel
        self.file_facts(site_rel)["bindings"].append(
            {
                "line": loc.line,
                "col": loc.column,
                "name": name,
                "method": r.spelling,
                "callables": sorted(set(callables)),
                "params": params,
                "field_writes": field_writes if r.spelling.startswith("def_readwrite") else [],
            }
        )

    def c_api_entry(self, c: ci.Cursor, rel: str) -> bool:
        """Record ``c`` as a binding when it is an entry of a CPython binding table (C_API_TABLES); True if it is
        one (the sentinel entry included). The table types are Python's own (declared outside the project)."""
        record = c.type.get_canonical().get_declaration()
        if record is None or record.kind != K.STRUCT_DECL or record.spelling not in C_API_TABLES:
            return False
        if self.is_project_decl(record):
            return False
        fields = list(c.get_children())
        first = _strip(fields[0]) if fields else None
        if first is None or first.kind != K.STRING_LITERAL:
            return True  # the {nullptr} sentinel, or a name that is no literal: no Python name to judge
        table = record.spelling
        tokens = [t.spelling for t in first.get_tokens()]
        callables: list[str] = []
        params: list[str] = []
        field_writes: list[str] = []
        if table == "PyMethodDef" and len(fields) > 1:
            self.binding_arg(fields[1], None, callables, params, field_writes)
            field_writes = []
        elif table == "PyGetSetDef" and len(fields) > 2:  # {name, get, set, doc, closure}: the setter stores
            self.binding_arg(fields[2], None, callables, params, field_writes)
            field_writes = []
        elif table == "PyMemberDef" and len(fields) > 2:  # {name, type, offset, flags, doc}
            flags = int_value(fields[3]) if len(fields) > 3 else 0
            if flags is not None and not flags & _PY_READONLY:
                for sub in fields[2].walk_preorder():
                    r = sub.referenced if sub.kind == K.MEMBER_REF else None
                    if r is not None and r.kind == K.FIELD_DECL and self.is_state(r):
                        field_writes.append(r.get_usr())
        loc = first.location
        site_rel = self.rel(loc.file.name if loc.file else None) or rel
        self.file_facts(site_rel)["bindings"].append(
            {
                "line": loc.line,
                "col": loc.column,
                "name": _string_value(tokens[0] if tokens else first.spelling),
                "method": table,
                "callables": sorted(set(callables)),
                "params": params,
                "field_writes": field_writes,
            }
        )
        return True

    def binding_arg(
        self,
        arg: ci.Cursor,
        method: ci.Cursor | None,
        callables: list[str],
        params: list[str],
        field_writes: list[str],
    ) -> None:
        stack = [arg]
        while stack:
            c = stack.pop()
            if c.kind == K.LAMBDA_EXPR:
                loc = c.location
                rel = self.rel(loc.file.name if loc.file else None)
                callables.append(f"lambda@{rel}:{loc.line}:{loc.column}")
                params += [p.type.get_canonical().spelling for p in c.get_children() if p.kind == K.PARM_DECL]
                continue
            if c.kind in (K.DECL_REF_EXPR, K.MEMBER_REF_EXPR) and c.referenced is not None:
                r = c.referenced
                if r.kind in FUNC_KINDS and self.is_project_decl(r):
                    callables.append(r.get_usr())
                    params += [p.type.get_canonical().spelling for p in r.get_arguments()]
                elif r.kind == K.FIELD_DECL and self.is_state(r):
                    field_writes.append(r.get_usr())
            if c.kind == K.CALL_EXPR and c.referenced is not None:
                r = c.referenced
                if method is not None and r.spelling == "init" and _in_pybind11(r) and not list(c.get_arguments()):
                    # py::init<Args...>(): the bound class's constructors, with Args as the parameter types.
                    params.append(c.type.get_canonical().spelling)
                    bound = method.semantic_parent.type.get_template_argument_type(0)
                    decl = bound.get_declaration() if bound.kind != ci.TypeKind.INVALID else None
                    if decl is not None:
                        for ctor in decl.get_children():
                            if ctor.kind == K.CONSTRUCTOR and self.is_project_decl(ctor):
                                callables.append(ctor.get_usr())
            stack.extend(reversed(list(c.get_children())))

    def facts(self) -> dict[str, Any]:
        for node in self.functions.values():
            for key in ("calls", "reads", "writes"):
                node[key] = sorted(set(node[key]))
        return {
            "files": self.files,
            "functions": self.functions,
            "overrides": sorted(self.overrides),
            "state": self.state,
            "functional": self.functional,
            "names": self.names,
        }


def _short_header(path: str) -> str:
    """A header's name as an include would spell it: the part after the last ``include/`` folder."""
    p = path.replace(os.sep, "/")
    return p.rsplit("/include/", 1)[-1] if "/include/" in p else p.rsplit("/", 1)[-1]


# libclang's CXTranslationUnit_SkipFunctionBodies (cindex: TranslationUnit.PARSE_SKIP_FUNCTION_BODIES).
_SKIP_FUNCTION_BODIES = 0x40
# Messages of a precompiled header that cannot be used (moved, rebuilt, built by another libclang).
_PCH_TROUBLE = re.compile(r"precompiled header|PCH file|AST file|module file", re.IGNORECASE)


def build_prelude(header: str, pch: str, args: list[str], root: str) -> dict[str, Any]:
    """Parse ``header`` (the prelude: third-party ``#include`` lines) with ``args`` as a C++ header, function bodies
    skipped, and save it as the precompiled header ``pch``. Returns {ok, reason, graph (its include directives),
    seconds}; not ok (with the reason) when it has errors or reaches a project file: its units are then parsed
    without it."""
    start = time.monotonic()
    header_args = list(args)
    if "-x" in header_args[:-1]:
        i = header_args.index("-x")
        if not header_args[i + 1].endswith("-header"):
            header_args[i + 1] += "-header"
    else:
        header_args = ["-x", "c++-header", *header_args]
    options = (
        ci.TranslationUnit.PARSE_DETAILED_PROCESSING_RECORD | ci.TranslationUnit.PARSE_INCOMPLETE | _SKIP_FUNCTION_BODIES
    )
    try:
        tu = ci.Index.create().parse(header, args=header_args, options=options)
    except ci.TranslationUnitLoadError as e:
        return {"ok": False, "reason": f"libclang could not load it: {e}", "graph": {}}
    errors = [d for d in tu.diagnostics if d.severity >= ci.Diagnostic.Error]
    if errors:
        d = errors[0]
        where = f"{d.location.file.name}:{d.location.line}: " if d.location.file else ""
        return {"ok": False, "reason": f"{where}{d.spelling}", "graph": {}}
    graph: dict[str, list[str]] = {}
    _directive_edges(list(tu.cursor.get_children()), graph)
    root_path = Path(root)
    for f in {d for dsts in graph.values() for d in dsts}:
        if _project_path(root_path, f):
            return {"ok": False, "reason": f"it reaches the project file {f}", "graph": {}}
    try:
        tu.save(pch)
    except ci.TranslationUnitSaveError as e:
        return {"ok": False, "reason": f"cannot save {pch}: {e}", "graph": {}}
    return {"ok": True, "reason": "", "graph": graph, "seconds": time.monotonic() - start}


def _project_path(root: Path, path: str) -> bool:
    try:
        parts = Path(path).relative_to(root).parts
    except ValueError:
        return False
    return bool(parts) and parts[0] not in EXCLUDED_TOP and "site-packages" not in parts


def parse(
    main: str, args: list[str], root: str, flags_source: str, prelude: dict[str, Any] | None = None
) -> dict[str, Any]:
    """Parse ``main`` (absolute path) with ``args``; return its facts (see the module docstring). ``prelude``:
    {pch, graph} of a shared prelude ``build_prelude`` made with the same ``args``; a unit that cannot use it is
    parsed without it."""
    sys.setrecursionlimit(max(sys.getrecursionlimit(), 20000))
    root_path = Path(root)
    if prelude is not None:
        # Only this unit's own declarations and preprocessing record are walked: the prelude's stay in the PCH.
        index = ci.Index.create(excludeDecls=True)
        try:
            tu = index.parse(
                main, args=[*args, "-include-pch", prelude["pch"]],
                options=ci.TranslationUnit.PARSE_DETAILED_PROCESSING_RECORD,
            )  # fmt: skip
        except ci.TranslationUnitLoadError:
            tu = None
        if tu is None or any(
            d.severity >= ci.Diagnostic.Error and _PCH_TROUBLE.search(d.spelling) for d in tu.diagnostics
        ):
            return parse(main, args, root, flags_source)
        return _facts(tu, main, root_path, flags_source, prelude["graph"])
    index = ci.Index.create()
    try:
        tu = index.parse(main, args=args, options=ci.TranslationUnit.PARSE_DETAILED_PROCESSING_RECORD)
    except ci.TranslationUnitLoadError as e:
        return {
            "main": main,
            "flags_source": flags_source,
            "errors": [{"path": None, "line": 1, "col": 1, "message": f"libclang could not load it: {e}"}],
            "files": {},
            "functions": {},
            "overrides": [],
            "state": {},
            "functional": False,
            "deps": [],
        }
    return _facts(tu, main, root_path, flags_source, None)


def _facts(
    tu: ci.TranslationUnit, main: str, root_path: Path, flags_source: str, prelude_graph: dict[str, list[str]] | None
) -> dict[str, Any]:
    walker = _Walker(tu, Path(main), root_path, prelude_graph)
    errors = []
    for d in tu.diagnostics:
        if d.severity < ci.Diagnostic.Error:
            continue
        f = d.location.file
        missing = None
        m = re.match(r"^'(.+)' file not found", d.spelling)
        if m:
            missing = m.group(1)
        errors.append(
            {
                "path": walker.rel(f.name) if f else None,
                "line": d.location.line or 1,
                "col": d.location.column or 1,
                "message": d.spelling,
                "missing": missing,
            }
        )
    walker.run()
    facts = walker.facts()
    facts.update(
        {"main": main, "flags_source": flags_source, "errors": errors, "deps": sorted(walker.deps | {main})}
    )
    return facts


# Identifiers of Python's C API and of pybind11: what engine code would have to name to touch Python.
_PYTHON_NAME = re.compile(r"^(Py[A-Z_]\w*|_Py\w+|pybind11|PYBIND11_\w+)$")


def lex_screen(main: str) -> list[dict[str, Any]]:
    """Sites in ``main`` that would bring Python in, from libclang's lexer alone (no semantic parse): ``#include`` of
    a forbidden header (forbidden_header) and identifiers of Python's C API or pybind11. Comments and string
    literals are tokens of their own kinds and never count. For CUDA sources on a machine without a CUDA toolkit,
    where nothing can parse them (intake/native.py says when it is used). Each site: line, col, what, kind."""
    size = Path(main).stat().st_size
    tu = ci.Index.create().parse(main, args=["-x", "c++", "-std=c++17", "-nostdinc", "-nostdinc++"],
                                 options=ci.TranslationUnit.PARSE_DETAILED_PROCESSING_RECORD)
    f = tu.get_file(main)
    extent = ci.SourceRange.from_locations(ci.SourceLocation.from_offset(tu, f, 0),
                                           ci.SourceLocation.from_offset(tu, f, size))
    tokens = list(tu.get_tokens(extent=extent))
    sites: list[dict[str, Any]] = []
    i = 0
    while i < len(tokens):
        t = tokens[i]
        if t.spelling == "#" and i + 1 < len(tokens) and tokens[i + 1].spelling == "include":
            line = t.location.line
            j = i + 2
            name = ""
            while j < len(tokens) and tokens[j].location.line == line:
                name += tokens[j].spelling
                j += 1
            name = name.strip('<>"')
            if forbidden_header(name):
                sites.append({"line": line, "col": t.location.column, "what": name, "kind": "include"})
            i = j
            continue
        if t.kind == ci.TokenKind.IDENTIFIER and _PYTHON_NAME.match(t.spelling):
            sites.append({"line": t.location.line, "col": t.location.column, "what": t.spelling,
                          "kind": "identifier"})
        i += 1
    return sites
