"""intake/baseline.toml: the reviewed sites the rules allow on purpose.

Schema::

    schema = 1
    [[allow]]
    rule = "python-import-from-cpp"      # a rule id
    path = "bindings/launcher/main.cpp"  # relative to the repository root
    call = "Py_BytesMain"                # the exact call the finding names (the first `...` in its message)
    why = "..."                          # the reviewed justification

An entry suppresses every finding of its rule in its file that names its call (line numbers are not part of the
match, so unrelated edits do not invalidate it). ``baseline-stale`` reports an entry that matches nothing in the
files screened; ``check`` reports a new or changed entry as ``baseline-change`` unless the change touches the
baseline alone.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass

from intake.findings import RULES, Finding

BASELINE = "intake/baseline.toml"
SCHEMA = 1
_KEYS = ("rule", "path", "call", "why")


class BaselineError(Exception):
    """The baseline cannot be read or breaks the schema (the tool cannot run: exit 2)."""


@dataclass(frozen=True)
class Entry:
    rule: str
    path: str
    call: str
    why: str
    line: int  # of its [[allow]] header in the file

    def key(self) -> tuple[str, str, str]:
        return (self.rule, self.path, self.call)

    def matches(self, f: Finding) -> bool:
        return f.rule == self.rule and f.path == self.path and f.call == self.call


def parse(text: str, where: str) -> list[Entry]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise BaselineError(f"{where}: {e}") from e
    problems = []
    if data.get("schema") != SCHEMA:
        problems.append(f"schema must be {SCHEMA}, got {data.get('schema')!r}")
    unknown = set(data) - {"schema", "allow"}
    if unknown:
        problems.append(f"unknown top-level keys: {sorted(unknown)}")
    raw = data.get("allow", [])
    if not isinstance(raw, list):
        problems.append("allow must be an array of tables ([[allow]])")
        raw = []
    lines = [i for i, t in enumerate(text.splitlines(), 1) if re.match(r"^\s*\[\[allow\]\]", t)]
    entries = []
    for n, item in enumerate(raw, 1):
        label = f"[[allow]] #{n}"
        if not isinstance(item, dict):
            problems.append(f"{label}: must be a table")
            continue
        missing = [k for k in _KEYS if not isinstance(item.get(k), str) or not item[k].strip()]
        extra = sorted(set(item) - set(_KEYS))
        if missing:
            problems.append(f"{label}: needs non-empty string keys {', '.join(missing)}")
        if extra:
            problems.append(f"{label}: unknown keys {extra}")
        if isinstance(item.get("rule"), str) and item["rule"] not in RULES:
            problems.append(f"{label}: unknown rule {item['rule']!r}")
        if not missing and not extra:
            line = lines[n - 1] if n <= len(lines) else 1
            entries.append(Entry(item["rule"], item["path"], item["call"], item["why"], line))
    if problems:
        raise BaselineError(f"{where}: " + "; ".join(problems))
    return entries


def apply(entries: list[Entry], findings: list[Finding]) -> tuple[list[Finding], int, set[tuple[str, str, str]]]:
    """(findings no entry allows, how many were allowed, keys of the entries that allowed something)."""
    kept, used, allowed = [], set(), 0
    for f in findings:
        entry = next((e for e in entries if e.matches(f)), None)
        if entry is None:
            kept.append(f)
        else:
            allowed += 1
            used.add(entry.key())
    return kept, allowed, used


def stale(entries: list[Entry], used: set[tuple[str, str, str]], screened: set[str], rel: str) -> list[Finding]:
    return [
        Finding(
            "baseline-stale",
            rel,
            e.line,
            1,
            f"baseline entry ({e.rule}, {e.path}, `{e.call}`) matches no site in the screened files; delete it: the "
            "baseline lists only sites that exist",
            call=e.call,
        )
        for e in entries
        if e.key() not in used and e.path in screened
    ]


def changes(base: list[Entry], head: list[Entry], rel: str) -> list[Finding]:
    """``baseline-change`` findings: entries of ``head`` that ``base`` lacks or words differently."""
    before = {e.key(): e for e in base}
    out = []
    for e in head:
        old = before.get(e.key())
        if old is not None and old.why == e.why:
            continue
        what = "a new" if old is None else "a changed"
        out.append(
            Finding(
                "baseline-change",
                rel,
                e.line,
                1,
                f"{what} baseline entry ({e.rule}, {e.path}, `{e.call}`) in a change that touches other files too; "
                "widen the baseline in a change of its own, so the decision is reviewed on its own",
                call=e.call,
            )
        )
    return out
