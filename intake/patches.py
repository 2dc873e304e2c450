"""The ``uncited-python-line`` rule: the vLLM patch series' contracts check, located for a screen.

The check itself is ``tools.contracts.check`` (schema, coverage, kind, citation, symbol, delegation, routing,
imports; documented there), the same code ``python -m tools.contracts check`` runs: it is not written twice. This
module only finds the series (a folder holding ``series`` and ``contracts.toml``), runs the check against the vLLM
reference tree, and turns each problem into a finding at the ``+`` line of the patch it concerns, or at the
``[[contract]]`` entry (stale entries) or the top of ``contracts.toml`` (schema, reference version).
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

from intake import files
from intake.findings import Finding

HOME = Path(__file__).resolve().parents[1]  # the ActiveKV checkout this intake belongs to (its tools/)


class PatchesError(Exception):
    """The check cannot run (no reference tree): the tool cannot run, exit 2."""


def _home_on_path() -> None:
    """Put this checkout first on sys.path: its ``tools`` package, not the screened tree's."""
    if not sys.path or sys.path[0] != str(HOME):
        sys.path.insert(0, str(HOME))


def is_series_dir(path: Path) -> bool:
    return (path / "series").is_file() and (path / "contracts.toml").is_file()


def reference_tree(vllm_src: Path | None) -> Path:
    """``--vllm-src``, or the reference tree ``tools/vllm_tree.py`` keeps under this checkout's build/."""
    if vllm_src is not None:
        if not (vllm_src / "vllm").is_dir():
            raise PatchesError(f"--vllm-src {vllm_src} holds no vllm/ folder")
        return vllm_src
    _home_on_path()
    try:
        from tools import vllm_tree

        return vllm_tree.reference_tree()
    except Exception as e:  # noqa: BLE001 - any failure to build it means the rule cannot run
        raise PatchesError(
            f"no vLLM reference tree for the uncited-python-line rule ({e}); pass --vllm-src DIR "
            "(`python -m tools.vllm_tree` builds and prints it)"
        ) from e


def screen_series(root: Path, series_dir: Path, vllm_src: Path) -> list[Finding]:
    _home_on_path()
    from tools import contracts
    from tools.vllm_patch import PatchError, Series

    rel_dir = series_dir.relative_to(root).as_posix()
    contracts_rel = f"{rel_dir}/contracts.toml"

    def unread(why: str) -> list[Finding]:
        return [Finding("parse-error", f"{rel_dir}/series", 1, 1,
                        f"the patch series cannot be read: {why}; an unread series is never passed")]

    # tools.vllm_patch and tools.contracts read the folder's files with plain open(): hand them only files
    # intake.files would read (each refused one is also an unreadable-file finding of its own when screened).
    entries = [p for p in sorted(series_dir.iterdir()) if p.is_symlink() or not p.is_dir()]
    refused = [f"{p.name}: {why}" for p in entries if (why := files.refusal(p, root))]
    if refused:
        return unread("; ".join(refused))
    try:
        series = Series.load(series_dir)
        contracts_text = files.read_text(series_dir / "contracts.toml", root)
    except (PatchError, files.Refused) as e:
        return unread(str(e))
    try:
        report = contracts.check(vllm_src, series, series_dir / "contracts.toml")
    except PatchError as e:  # the launcher that makes the patched side is missing or failed: the rule cannot run
        raise PatchesError(f"the uncited-python-line rule cannot run: {e}") from e
    entry_lines = [
        i for i, text in enumerate(contracts_text.splitlines(), 1) if re.match(r"^\s*\[\[contract\]\]", text)
    ]
    by_contract = {c.label(): a for c, a in report.pairs}
    by_added = {a.label(): a for a in report.added}
    stale = {c.label(): c for c in report.contracts}
    findings = []
    for problem in report.problems:
        path, line = contracts_rel, 1
        added = next((a for label, a in by_contract.items() if label in problem), None)
        added = added or next((a for label, a in by_added.items() if label in problem), None)
        if added is not None:
            path, line = f"{rel_dir}/{added.patch}", added.patch_line or 1
        else:
            entry = next((c for label, c in stale.items() if label in problem), None)
            if entry is not None and entry.index <= len(entry_lines):
                line = entry_lines[entry.index - 1]
        findings.append(
            Finding(
                "uncited-python-line",
                path,
                line,
                1,
                f"{problem}; every Python line the series adds needs a sound [[contract]] entry in {contracts_rel} "
                "(`python -m tools.contracts check --vllm-src DIR`), or belongs on the native side",
            )
        )
    return findings
