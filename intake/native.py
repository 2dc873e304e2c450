"""The C/C++ rules: parse the program (cached, in parallel), merge the facts, and judge them.

Rules: ``python-import-from-cpp``, ``per-step-python-callback``, ``request-path-python-call``, ``python-in-engine``,
``parse-error``.

The program is every translation unit the caller names (compile_commands.json's entries under the root plus the
native sources in scope); a project header is analysed inside the units that include it, and on its own (with the
flags of a file of its target) only when no unit includes it. Functions are linked across units by USR, so the
per-step path is followed from a binding in bindings/ into the engine's .cpp files, and through virtual calls into
every override (a ``PYBIND11_OVERRIDE*`` trampoline included).

Per-step entry points are the bindings, in any module, whose Python name is one of ``PER_STEP_METHODS``: the
methods of vLLM's attention-backend contract that vLLM calls on every step (the model runner builds the attention
metadata each step: ``build``, ``build_for_drafting`` for speculative decoding, ``update_block_table`` for groups
that share a layout; the attention layer calls ``forward`` and ``do_kv_cache_update`` per layer per step). A binding
is a pybind11 ``.def``/``.def_static`` or an entry of a CPython method table (``PyMethodDef``): a module written
against the C API without pybind11 is held to the same rules. Its property setters (``PyGetSetDef``) and writable
members (``PyMemberDef``) are bindings that store, as ``def_property``/``def_readwrite`` are.

Request-path modules are the binding files that bind a method of vLLM's endpoint-plugin contract
(``REQUEST_METHODS``): they serve HTTP requests (their ASGI awaitables run from type slots, which no binding reaches
statically), so every Python call in them is reported and must be a reviewed baseline entry.

libclang opens a unit's includes itself: a FIFO would block it, ``/dev/zero`` would be read until memory runs out.
Before a unit is parsed, its ``#include`` lines and those of the project headers they reach are followed lexically
(``_refused_includes``); a unit with one that names a file ``intake.files`` refuses is an ``unreadable-file`` finding
and is never handed to libclang. Includes spelled through a macro (``#include HEADER``) are not followed.
"""

from __future__ import annotations

import os
import re
import tempfile
from collections import deque
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass, field
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from intake import files, prelude
from intake.cache import Cache
from intake.cxx import EXCLUDED_TOP, build_prelude, forbidden_header, lex_screen, parse
from intake.findings import Finding
from intake.flags import CompileDatabase, Flags

_INCLUDE_RE = re.compile(rb'^[ \t]*#[ \t]*(?:include|include_next|import)[ \t]*([<"])([^>"\r\n]+)[>"]', re.MULTILINE)
_SEARCH_OPTIONS = ("-iquote", "-isystem", "-idirafter", "-I")

PER_STEP_METHODS = ("build", "build_for_drafting", "update_block_table", "forward", "do_kv_cache_update")
REQUEST_METHODS = ("attach_router", "init_state")
_STEP_BIND_METHODS = ("def", "def_static", "PyMethodDef")
_STD_FUNCTION_RE = re.compile(r"\bstd::(\w+::)?function<")


@dataclass
class Program:
    units: list[dict[str, Any]] = field(default_factory=list)
    parsed: int = 0  # units parsed in this run (the rest came from the cache)
    preludes: int = 0  # shared preludes built for them (intake/prelude.py)
    refused: list[Finding] = field(default_factory=list)  # units never parsed: an include names a refused file


def _parse_job(job: tuple[str, list[str], str, str, dict[str, Any] | None]) -> dict[str, Any]:
    return parse(*job)


def _prelude_job(job: tuple[str, str, list[str], str]) -> dict[str, Any]:
    return build_prelude(*job)


def _pool_map(fn: Any, jobs: list[Any], workers: int, size: Any) -> list[Any]:
    if not jobs:
        return []
    if workers <= 1 or len(jobs) == 1:
        return [fn(j) for j in jobs]
    # Longest first: a heavy job started last would leave the other workers idle.
    order = sorted(range(len(jobs)), key=lambda i: -size(jobs[i]))
    with ProcessPoolExecutor(max_workers=min(workers, len(jobs)), mp_context=get_context("fork")) as pool:
        results = list(pool.map(fn, [jobs[i] for i in order]))
    out: list[Any] = [{}] * len(jobs)
    for i, r in zip(order, results):
        out[i] = r
    return out


def _run_jobs(root: Path, jobs: list[tuple[str, list[str], str, str]], workers: int) -> tuple[list[dict[str, Any]], int]:
    """Facts of each job (main, args, root, flags source), parsed against the shared preludes (``prelude``) where
    they apply; and the number of preludes built."""
    if not jobs:
        return [], 0
    groups = prelude.plan(root, jobs)
    with tempfile.TemporaryDirectory(prefix="intake-prelude-") as tmp:
        builds = []
        for n, group in enumerate(groups):
            header = os.path.join(tmp, f"prelude{n}.h")
            Path(header).write_text(group.text())
            builds.append((header, os.path.join(tmp, f"prelude{n}.pch"), list(group.args), str(root)))
        built = _pool_map(_prelude_job, builds, workers, lambda b: os.path.getsize(b[0]))
        use: dict[int, dict[str, Any]] = {}
        for group, build, result in zip(groups, builds, built):
            if result["ok"]:
                for i in group.units:
                    use[i] = {"pch": build[1], "graph": result["graph"]}
        full = [(*job, use.get(i)) for i, job in enumerate(jobs)]

        def size(job: tuple[str, list[str], str, str, dict[str, Any] | None]) -> int:
            # A unit without a prelude parses every header itself: start those first.
            own = os.path.getsize(job[0]) if os.path.exists(job[0]) else 0
            return own + (0 if job[4] else 1 << 40)

        return _pool_map(_parse_job, full, workers, size), sum(1 for r in built if r["ok"])


def _module_of(args: list[str]) -> str | None:
    """The Python extension module a unit is compiled into: CMakeLists.txt's -DACTIVEKV_MODULE_NAME=_<part>."""
    for i, a in enumerate(args):
        value = a[2:] if a.startswith("-D") else (args[i + 1] if a == "-D" and i + 1 < len(args) else "")
        if value.startswith("ACTIVEKV_MODULE_NAME="):
            return value.split("=", 1)[1]
    return None


def load_program(
    root: Path, sources: list[Path], headers: list[Path], db: CompileDatabase, cache: Cache, workers: int
) -> Program:
    """Facts of every unit in ``sources``, then of each header in ``headers`` that no unit includes."""
    program = Program()
    includes: dict[Path, list[tuple[int, str, bool, str]]] = {}

    def wave(batch: list[Path]) -> None:
        jobs, keys = [], []
        for f in batch:
            flags: Flags = db.flags_for(f)
            refused = _refused_includes(root, f, flags, includes)
            if refused:
                program.refused += refused
                continue
            if _cuda_without_toolkit(_rel(root, str(f)), {"flags_source": flags.source}):
                program.units.append(_unparsed(f, flags))  # screened lexically; a parse would go unread
                continue
            key = cache.key(str(f), flags)
            facts = cache.get(key)
            if facts is not None:
                program.units.append({**facts, "module": _module_of(list(flags.args))})
            else:
                jobs.append((str(f), list(flags.args), str(root), flags.source))
                keys.append(key)
        results, preludes = _run_jobs(root, jobs, workers)
        for job, key, facts in zip(jobs, keys, results):
            cache.put(key, facts)
            program.units.append({**facts, "module": _module_of(job[1])})
        program.parsed += len(jobs)
        program.preludes += preludes

    wave(sorted(set(sources)))
    covered = {d for u in program.units for d in u.get("deps", [])}
    wave(sorted({h for h in headers if os.path.normpath(str(h)) not in covered}))
    return program


def _unparsed(main: Path, flags: Flags) -> dict[str, Any]:
    """The facts of a unit that is not parsed (``_cuda_without_toolkit``): ``judge`` reads its main file only."""
    return {"main": str(main), "flags_source": flags.source, "errors": [], "files": {}, "functions": {},
            "overrides": [], "state": {}, "functional": False, "deps": [str(main)]}  # fmt: skip


def _search_dirs(args: tuple[str, ...]) -> list[str]:
    """Every include folder the flags name (-iquote, -I, -isystem, -idirafter, joined or not; -resource-dir's)."""
    dirs = []
    for i, a in enumerate(args):
        value = args[i + 1] if i + 1 < len(args) else ""
        if a == "-resource-dir":
            dirs.append(os.path.join(value, "include"))
        for opt in _SEARCH_OPTIONS:
            if a == opt:
                dirs.append(value)
            elif a.startswith(opt) and len(a) > len(opt):
                dirs.append(a[len(opt) :])
            else:
                continue
            break
    return [d for d in dirs if d]


def _includes_of(path: Path, root: Path) -> list[tuple[int, str, bool, str]]:
    """(line, the directive as written, quoted, the name) of each literal #include/#include_next/#import line."""
    try:
        text = files.read_bytes(path, root if path.is_relative_to(root) else None)
    except files.Refused:
        return []  # a refused header never gets here: it is reported where it is included
    return [
        (text.count(b"\n", 0, m.start()) + 1, m.group(0).decode(errors="replace").strip(), m.group(1) == b'"',
         os.fsdecode(m.group(2)).strip())
        for m in _INCLUDE_RE.finditer(text)
    ]  # fmt: skip


def _refused_includes(
    root: Path, main: Path, flags: Flags, memo: dict[Path, list[tuple[int, str, bool, str]]]
) -> list[Finding]:
    """``unreadable-file`` findings, at ``main``, for each include line of ``main`` or of a project header it reaches
    that could open a file ``intake.files`` refuses. Every existing candidate in the search path is checked (the
    includer's folder for quoted names, then the flags' folders), not only the one clang would pick: a refused file
    anywhere on the path is reported. Project headers (under the root, outside build/, .venv/, site-packages) are
    followed; others are only checked."""
    dirs = _search_dirs(flags.args)
    main_rel = _rel(root, str(main))
    out: list[Finding] = []
    seen, todo = {main}, [main]
    while todo:
        f = todo.pop()
        if f not in memo:
            memo[f] = _includes_of(f, root)
        for line, spelled, quoted, name in memo[f]:
            bases = ([str(f.parent)] if quoted else []) + dirs
            names = [name] if os.path.isabs(name) else [os.path.join(d, name) for d in bases]
            for candidate in (Path(os.path.normpath(n)) for n in names):
                if not os.path.lexists(candidate):
                    continue
                inside = candidate.is_relative_to(root)
                why = files.refusal(candidate, root if inside else None)
                if why:
                    at = (line, "") if f == main else (1, f" ({_rel(root, str(f))}:{line})")
                    related = tuple(_rel(root, str(p)) for p in (f, candidate) if p.is_relative_to(root))
                    out.append(
                        Finding(
                            "unreadable-file",
                            main_rel,
                            at[0],
                            1,
                            f"`{spelled}`{at[1]} opens {candidate}: {why}, so libclang did not parse this file",
                            related=related,
                        )
                    )
                elif inside and _is_project(root, candidate) and candidate not in seen:
                    seen.add(candidate)
                    todo.append(candidate)
    return out


def _is_project(root: Path, path: Path) -> bool:
    parts = path.relative_to(root).parts
    return bool(parts) and parts[0] not in EXCLUDED_TOP and "site-packages" not in parts


# ------------------------------------------------------------------------------------------------------- judging


def _rel(root: Path, path: str) -> str:
    try:
        return Path(path).relative_to(root).as_posix()
    except ValueError:
        return path


def judge(root: Path, program: Program) -> tuple[list[Finding], set[str]]:
    """Every C/C++ finding of the program, and the set of files analysed (relative paths)."""
    findings: list[Finding] = list(program.refused)
    analysed: set[str] = {f.path for f in program.refused}
    by_file: dict[str, dict[str, Any]] = {}
    functions: dict[str, dict[str, Any]] = {}
    overriders: dict[str, set[str]] = {}
    state: dict[str, dict[str, Any]] = {}
    names: dict[str, str] = {}
    bindings: list[tuple[str, dict[str, Any], bool]] = []
    seen_bindings: set[tuple[str, int, int, str]] = set()
    unit_module: dict[str, str | None] = {}  # main file -> the extension module it is compiled into

    for unit in program.units:
        main_rel = _rel(root, unit["main"])
        analysed.add(main_rel)
        unit_module[main_rel] = unit.get("module")
        if _cuda_without_toolkit(main_rel, unit):
            findings += _lexical_findings(root, main_rel)
            continue
        findings += _parse_errors(main_rel, unit)
        for rel, facts in unit["files"].items():
            analysed.add(rel)
            merged = by_file.setdefault(rel, {"includes": {}, "imports": {}})
            for inc in facts["includes"]:
                merged["includes"].setdefault((inc["line"], inc["spelled"]), inc)
            for imp in facts["imports"]:
                k = (imp["line"], imp["target"])
                if k not in merged["imports"] or imp["col"] < merged["imports"][k]["col"]:
                    merged["imports"][k] = imp
            for b in facts["bindings"]:
                k = (rel, b["line"], b["col"], b["name"])
                if k not in seen_bindings:
                    seen_bindings.add(k)
                    bindings.append((rel, b, bool(unit.get("functional"))))
        for ident, node in unit["functions"].items():
            have = functions.get(ident)
            if have is None:
                functions[ident] = {k: (list(v) if isinstance(v, list) else v) for k, v in node.items()}
            else:  # the same inline function seen from two units: union what each saw
                for key in ("calls", "sinks", "reads", "writes"):
                    have[key] += [x for x in node[key] if x not in have[key]]
        for base, derived in unit["overrides"]:
            overriders.setdefault(base, set()).add(derived)
        state.update(unit["state"])
        names.update(unit.get("names", {}))

    for rel, merged in sorted(by_file.items()):
        if rel.startswith("engine/"):
            findings += _engine_includes(rel, merged["includes"].values())
        for imp in sorted(merged["imports"].values(), key=lambda i: (i["line"], i["col"])):
            findings.append(
                Finding(
                    "python-import-from-cpp",
                    rel,
                    imp["line"],
                    imp["col"],
                    f"`{imp['call']}` {_how(imp)}: C++ that imports or runs Python; the C++ side never imports a "
                    "module: take the object as a binding argument (the Python caller imports it), or list a "
                    "reviewed site in intake/baseline.toml",
                    call=imp["call"],
                )
            )
    for usr, name in names.items():  # declared-only functions (pure virtuals): a name for the messages
        functions.setdefault(
            usr, {"name": name, "path": "", "line": 0, "calls": [], "sinks": [], "reads": [], "writes": []}
        )
    findings += _per_step(functions, overriders, state, bindings)
    findings += _request_path(functions, bindings, unit_module)
    return findings, analysed


def _request_path(
    functions: dict[str, dict[str, Any]],
    bindings: list[tuple[str, dict[str, Any], bool]],
    unit_module: dict[str, str | None],
) -> list[Finding]:
    served = {rel for rel, b, _ in bindings if b["name"] in REQUEST_METHODS}
    # A module is one unit of review: every file compiled into a module that serves routes (its awaitable's file too).
    modules = {unit_module.get(rel) for rel in served} - {None}
    served |= {rel for rel, module in unit_module.items() if module in modules}
    findings: list[Finding] = []
    seen: set[tuple[str, int, int]] = set()
    for node in functions.values():
        for sink in node["sinks"]:
            key = (sink["path"], sink["line"], sink["col"])
            if sink["path"] not in served or key in seen:
                continue
            seen.add(key)
            findings.append(
                Finding(
                    "request-path-python-call",
                    sink["path"],
                    sink["line"],
                    sink["col"],
                    f"`{sink['call']}` {_how(sink)}: a Python call in a module that serves vLLM endpoint-plugin "
                    "routes; list it in intake/baseline.toml with why it is off the per-step path and its cost per "
                    "request, or do the work in C++",
                    call=sink["call"],
                )
            )
    return findings


def _how(site: dict[str, Any]) -> str:
    """How a site reaches Python, e.g. "calls PyImport_ImportModule (through macro LOAD)"."""
    how = site["how"]
    macro = site.get("macro")
    if macro:
        how += f" (through the macro {re.split(r'[^A-Za-z0-9_]', macro, maxsplit=1)[0]})"
    return how


def _cuda_without_toolkit(main_rel: str, unit: dict[str, Any]) -> bool:
    """An engine CUDA source with no compile_commands.json entry of its own: the build had no CUDA compiler (CMake
    builds engine/src/cuda/ only when torch has CUDA and nvcc is found), so nothing here can parse it as CUDA. It
    gets the lexical screen instead of a parse-error. That screen is enough for the engine's rules: code that neither
    includes a Python or pybind11 header nor names Python's C API cannot import or call Python. On a CUDA machine the
    build writes the entry and the file is parsed like any other."""
    return (main_rel.startswith("engine/") and main_rel.endswith(".cu")
            and not unit["flags_source"].startswith(f"entry of {main_rel}"))


def _lexical_findings(root: Path, main_rel: str) -> list[Finding]:
    out = []
    for site in lex_screen(str(root / main_rel)):
        what = (f"`#include <{site['what']}>`" if site["kind"] == "include"
                else f"`{site['what']}` (Python's C API or pybind11)")
        out.append(
            Finding(
                "python-in-engine",
                main_rel,
                site["line"],
                site["col"],
                f"{what} in engine/ (CUDA source, screened lexically: no CUDA toolkit here): the engine is C++ and "
                "CUDA on ATen only; move the Python-facing code into bindings/",
            )
        )
    return out


def _parse_errors(main_rel: str, unit: dict[str, Any]) -> list[Finding]:
    errors = unit["errors"]
    if not errors:
        return []
    # An engine file that includes a Python header it cannot even find is python-in-engine, not a flags problem.
    if main_rel.startswith("engine/") and all(e.get("missing") and forbidden_header(e["missing"]) for e in errors):
        return []
    first = errors[0]
    where = ""
    line, col = 1, 1
    if first.get("path") == main_rel:
        line, col = first["line"], first["col"]
    elif first.get("path"):
        where = f" in {first['path']}:{first['line']}"
    more = f" (and {len(errors) - 1} more error(s))" if len(errors) > 1 else ""
    return [
        Finding(
            "parse-error",
            main_rel,
            line,
            col,
            f"libclang cannot parse this file with the {unit['flags_source']}: {first['message']}{where}{more}; "
            "an unparsed file is never passed: fix the error or the flags (`make build` refreshes "
            "compile_commands.json)",
        )
    ]


def _engine_includes(rel: str, includes: Any) -> list[Finding]:
    out = []
    for inc in sorted(includes, key=lambda i: i["line"]):
        if inc["forbidden"]:
            out.append(
                Finding(
                    "python-in-engine",
                    rel,
                    inc["line"],
                    inc["col"],
                    f"`{inc['forbidden']}` in engine/: the engine is C++ on ATen only, no Python headers; move the "
                    "Python-facing code into bindings/ and include the engine header from there",
                    call=inc["spelled"],
                )
            )
    return out


def _reach(
    starts: list[str], functions: dict[str, dict[str, Any]], overriders: dict[str, set[str]]
) -> dict[str, str | None]:
    """Breadth-first reachability over calls and virtual overrides: {node: the node it was reached from}."""
    parent: dict[str, str | None] = {}
    queue: deque[str] = deque()
    for s in starts:
        if s not in parent:
            parent[s] = None
            queue.append(s)
    while queue:
        cur = queue.popleft()
        node = functions.get(cur)
        callees = list(node["calls"]) if node else []
        callees += sorted(overriders.get(cur, ()))
        for nxt in callees:
            if nxt not in parent:
                parent[nxt] = cur
                queue.append(nxt)
    return parent


def _chain(node: str, parent: dict[str, str | None], functions: dict[str, dict[str, Any]]) -> list[str]:
    out = []
    cur: str | None = node
    while cur is not None:
        out.append(cur)
        cur = parent.get(cur)
    return list(reversed(out))


def _label(ident: str, functions: dict[str, dict[str, Any]]) -> str:
    node = functions.get(ident)
    return node["name"] if node else ident


_PY_OBJECT_RE = re.compile(r"\bpybind11::(function|object|handle)\b|\b_object \*|PyObject \*")


def _shown_type(spelling: str) -> str:
    """A canonical type as the code spells it: CPython's ``_object *`` is ``PyObject *``."""
    return re.sub(r"\b_object \*", "PyObject *", spelling)


def _python_callable_param(params: list[str], functional: bool) -> str | None:
    """The first parameter type that carries a Python callable into native code, else None.

    A ``std::function`` parameter does only where pybind11/functional.h's caster is in the unit (it wraps the
    Python callable); without it pybind11 cannot convert a Python object to one.
    """
    for p in params:
        if _PY_OBJECT_RE.search(p) or (functional and _STD_FUNCTION_RE.search(p)):
            return p
    return None


def _per_step(
    functions: dict[str, dict[str, Any]],
    overriders: dict[str, set[str]],
    state: dict[str, dict[str, Any]],
    bindings: list[tuple[str, dict[str, Any], bool]],
) -> list[Finding]:
    findings: list[Finding] = []
    entries = [
        (rel, b) for rel, b, _ in bindings if b["name"] in PER_STEP_METHODS and b["method"] in _STEP_BIND_METHODS
    ]
    # Reach from each entry separately so every message names the entry it starts from.
    reached: dict[str, tuple[str, dict[str, str | None], str, dict[str, Any]]] = {}
    for rel, b in entries:
        parent = _reach(b["callables"], functions, overriders)
        for ident in parent:
            reached.setdefault(ident, (ident, parent, rel, b))

    seen: set[tuple[str, int, str]] = set()
    for ident, (_, parent, rel, b) in sorted(reached.items()):
        node = functions.get(ident)
        if node is None:
            continue
        for sink in sorted(node["sinks"], key=lambda s: (s["path"], s["line"], s["col"])):
            key = (sink["path"], sink["line"], sink["call"])
            if key in seen:
                continue
            seen.add(key)
            chain = _chain(ident, parent, functions)
            path = " -> ".join(_label(c, functions) for c in chain)
            related = tuple(sorted({rel} | {functions[c]["path"] for c in chain if c in functions}))
            findings.append(
                Finding(
                    "per-step-python-callback",
                    sink["path"],
                    sink["line"],
                    sink["col"],
                    f"`{sink['call']}` {_how(sink)}: a Python call on the per-step path: binding '{b['name']}' "
                    f"({rel}:{b['line']}) -> {path}; keep the step native: read what you need from Python before "
                    "the step, or move the logic into C++",
                    call=sink["call"],
                    related=related,
                )
            )

    # State a per-step function reads, and where.
    readers: dict[str, tuple[str, str, dict[str, Any]]] = {}
    for ident, (_, _parent, rel, b) in sorted(reached.items()):
        node = functions.get(ident)
        for usr in node["reads"] if node else []:
            readers.setdefault(usr, (ident, rel, b))
    if not readers:
        return findings
    for rel, b, functional in bindings:
        writer_of_field = "def_readwrite" if b["method"].startswith("def_readwrite") else b["method"]
        stored = [(usr, writer_of_field) for usr in b["field_writes"] if usr in readers]
        param = _python_callable_param(b["params"], functional)
        if param:
            closure = _reach(b["callables"], functions, overriders)
            for ident in sorted(closure):
                node = functions.get(ident)
                for usr in node["writes"] if node else []:
                    if usr in readers:
                        stored.append((usr, _label(ident, functions)))
        done: set[str] = set()
        for usr, writer in stored:
            if usr in done:
                continue
            done.add(usr)
            info = state.get(usr, {"name": usr, "path": "?", "line": 0})
            reader, entry_rel, entry = readers[usr]
            rnode = functions.get(reader, {"name": reader, "path": "?", "line": 0})
            how = f"takes `{_shown_type(param)}` and " if param else ""
            findings.append(
                Finding(
                    "per-step-python-callback",
                    rel,
                    b["line"],
                    b["col"],
                    f"binding '{b['name']}' {how}stores a Python callable into `{info['name']}` "
                    f"({info['path']}:{info['line']}, written by {writer}), which the per-step path reads "
                    f"({rnode['name']} at {rnode['path']}:{rnode['line']}, reached from binding '{entry['name']}' at "
                    f"{entry_rel}:{entry['line']}); pass plain values and tensors instead and keep the logic in C++",
                    call=f"{b['name']} -> {info['name']}",
                    related=tuple(sorted({rel, str(info["path"]), str(rnode["path"]), entry_rel})),
                )
            )
    return findings
