"""Findings, the rule registry and the three output formats (text, JSON, SARIF 2.1.0)."""

from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from dataclasses import dataclass, field

TOOL_NAME = "activekv-intake"
TOOL_VERSION = "1"


@dataclass(frozen=True)
class Rule:
    id: str
    summary: str  # one line: what the rule rejects
    help: str  # what to do instead


RULES: dict[str, Rule] = {
    r.id: r
    for r in (
        Rule(
            "new-python-module",
            "A Python file (.py, .pyi, .pyx or a Python shebang) outside the dev-side folders tests/, tools/, "
            "release/, intake/.",
            "Write the code in C++ (engine/) and expose it through a pybind11 module (bindings/modules/); "
            "dev-side scripts belong in tools/ or tests/.",
        ),
        Rule(
            "python-import-from-cpp",
            "C/C++ code that imports or runs Python: PyImport_*, PyRun_*, Py_RunMain/Py_Main/Py_BytesMain, "
            "PyEval_EvalCode*, pybind11::module_::import/reload, pybind11::eval/exec/eval_file.",
            "The C++ side never imports a module: take the object as a binding argument (the Python caller, "
            "vLLM's patched code, imports it), or list the site in intake/baseline.toml with a reviewed reason.",
        ),
        Rule(
            "per-step-python-callback",
            "A Python call reachable from a per-step binding (build, forward, do_kv_cache_update, ...: a pybind11 "
            ".def or a CPython PyMethodDef entry), or a binding that stores a Python object it was handed (py::object, "
            "std::function, PyObject*) into state the per-step path reads.",
            "Keep the per-step path native: pass plain values and tensors, read Python objects before the step, "
            "and put the logic the callable held into C++.",
        ),
        Rule(
            "request-path-python-call",
            "A Python call in a module that binds vLLM's endpoint-plugin contract (attach_router, init_state): "
            "every such call runs on an HTTP request path or at start-up, and each is reviewed.",
            "List the call in intake/baseline.toml with why it is not on the per-step path and what it costs per "
            "request, or do the work in C++.",
        ),
        Rule(
            "python-in-engine",
            "An engine/ file that includes Python.h, a pybind11/ header, torch/python.h or torch/extension.h.",
            "engine/ is C++ on ATen only: move the Python-facing code into bindings/ and include the engine "
            "header from there.",
        ),
        Rule(
            "uncited-python-line",
            "A Python line the vLLM patch series adds with no contracts.toml entry, or whose entry no longer holds "
            "(stale citation, kind, symbol, delegation, routing, imports: tools/contracts.py).",
            "Add or fix the [[contract]] entry (python -m tools.contracts check --vllm-src DIR), or port the line "
            "to the native side.",
        ),
        Rule(
            "parse-error",
            "A C/C++ file that libclang cannot parse with its compile flags (or a patch series that cannot be "
            "read): an unparsed file is never passed.",
            "Fix the error, or the flags: run `make build` so compile_commands.json lists the file.",
        ),
        Rule(
            "unreadable-file",
            "A payload file the screen will not read: a FIFO, device, socket or folder link, a link that dangles or "
            "leads out of the screened tree, a file over intake.files.MAX_FILE_BYTES (8 MiB), or a C/C++ file whose "
            "#include opens one (libclang would block or read without end): an unread file is never passed.",
            "Replace it with the regular file it stands for, inside the tree, or keep it out of the payload.",
        ),
        Rule(
            "baseline-change",
            "A new or changed intake/baseline.toml entry in a change that touches other files too.",
            "Widen the baseline in a change of its own, so the decision is reviewed on its own.",
        ),
        Rule(
            "baseline-stale",
            "An intake/baseline.toml entry that matches no site in the screened files.",
            "Delete the entry: the baseline lists only sites that exist.",
        ),
    )
}


@dataclass(frozen=True)
class Finding:
    rule: str
    path: str  # relative to the screened root, '/'-separated
    line: int  # 1-based
    column: int  # 1-based
    message: str
    call: str = ""  # the exact call/symbol a baseline entry names (empty when the rule has none)
    related: tuple[str, ...] = field(default=(), compare=False)  # other files the finding depends on

    def key(self) -> tuple[str, str, int, int, str]:
        return (self.path, self.rule, self.line, self.column, self.message)


def summary(findings: list[Finding], files: int, baselined: int, command: str) -> dict[str, object]:
    return {
        "command": command,
        "findings": len(findings),
        "files_screened": files,
        "baselined": baselined,
        "by_rule": dict(sorted(Counter(f.rule for f in findings).items())),
    }


def render_text(findings: list[Finding], info: dict[str, object]) -> str:
    lines = [f"{f.path}:{f.line}:{f.column}: {f.rule}: {f.message}" for f in findings]
    tail = f"{info['files_screened']} file(s) screened, {info['baselined']} baselined"
    if findings:
        rules = ", ".join(f"{k} {v}" for k, v in info["by_rule"].items())  # type: ignore[attr-defined]
        lines.append(f"intake: {len(findings)} finding(s) ({rules}); {tail}")
    else:
        lines.append(f"intake: clean; {tail}")
    return "\n".join(lines) + "\n"


def render_json(findings: list[Finding], info: dict[str, object]) -> str:
    doc = {
        "findings": [
            {"rule": f.rule, "path": f.path, "line": f.line, "column": f.column, "message": f.message}
            for f in findings
        ],
        "summary": info,
    }
    return json.dumps(doc, indent=1) + "\n"


def _identity(f: Finding) -> tuple[str, str, str]:
    """What stays when unrelated lines move: rule, file, and the call (or the message without its numbers)."""
    return (f.rule, f.path, f.call or re.sub(r"\d+", "", f.message))


def _fingerprint(f: Finding, occurrence: int) -> str:
    # The occurrence index tells identical findings in one file apart.
    text = "\0".join(_identity(f))
    return f"{hashlib.sha256(text.encode()).hexdigest()[:32]}:{occurrence}"


def render_sarif(findings: list[Finding], info: dict[str, object], root_uri: str) -> str:
    rule_ids = list(RULES)
    seen: Counter[tuple[str, str, str]] = Counter()
    results = []
    for f in findings:
        ident = _identity(f)
        seen[ident] += 1
        results.append(
            {
                "ruleId": f.rule,
                "ruleIndex": rule_ids.index(f.rule),
                "level": "error",
                "message": {"text": f.message},
                "locations": [
                    {
                        "physicalLocation": {
                            "artifactLocation": {"uri": f.path, "uriBaseId": "SRCROOT"},
                            "region": {"startLine": f.line, "startColumn": f.column},
                        }
                    }
                ],
                "partialFingerprints": {"activekvIntake/v1": _fingerprint(f, seen[ident])},
            }
        )
    doc = {
        "$schema": "https://json.schemastore.org/sarif-2.1.0.json",
        "version": "2.1.0",
        "runs": [
            {
                "tool": {
                    "driver": {
                        "name": TOOL_NAME,
                        "version": TOOL_VERSION,
                        "rules": [
                            {
                                "id": r.id,
                                "name": r.id,
                                "shortDescription": {"text": r.summary},
                                "help": {"text": r.help},
                                "defaultConfiguration": {"level": "error"},
                            }
                            for r in RULES.values()
                        ],
                    }
                },
                "originalUriBaseIds": {"SRCROOT": {"uri": root_uri}},
                "results": results,
                "properties": {"summary": info},
            }
        ],
    }
    return json.dumps(doc, indent=1) + "\n"
