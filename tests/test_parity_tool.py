"""tools.parity, through its CLI: a small --filter of real cells matches and is reported; a planted mismatch and a
failing cell become verdicts in the report (the run goes on) and the exit status is 1."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

from tools.parity_cells import Cell, Mismatch, compressed_cells, dense_cells, exact_cells, in_place_cells, run_cell
from tests.reference.engine import RefEngine
from tools import parity

REPO = Path(__file__).resolve().parents[1]
# 6 compressed cells (3 contexts x 2 of pool stream/fit x batch 1/3) at head size 80.
FILTER = "compressed-float32-d80-gqa4-bs16-"
FILTERED = [c.id for c in compressed_cells() if FILTER in c.id]


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.parity", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def load_report(out: Path) -> dict[str, Any]:
    return json.loads((out / "report.json").read_text())


def test_filter_selects_the_expected_cells() -> None:
    assert len(FILTERED) == 6
    assert parity.select_cells("exact", FILTER) == []
    assert [c.id for c in parity.select_cells("all", FILTER)] == FILTERED


def test_full_matrix_sizes() -> None:
    """The issue's floor: at least 96 cells per mode, a head size that is not a power of two in compressed mode."""
    exact, compressed = parity.select_cells("exact", None), parity.select_cells("compressed", None)
    sizes = (len(exact_cells()), len(compressed_cells()), len(in_place_cells()), len(dense_cells()))
    assert sizes == (432, 324, 108, 54)
    assert (len(exact), len(compressed)) == (486, 432)  # each mode's pooled cells, its 54 in place; 54 dense layers
    assert len(parity.select_cells("all", None)) == 918
    assert {c.mode for c in in_place_cells()} == {"exact", "compressed"}
    assert {c.head_size for c in compressed} == {64, 80, 128}


@pytest.mark.parametrize("jobs", [1, 2])
def test_cli_reports_matching_cells(tmp_path: Path, jobs: int) -> None:
    done = cli("--filter", FILTER, "--jobs", str(jobs), "--out", str(tmp_path))
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^parity: 6 cells, 6 match \(6 compressed\)$", done.stdout, re.M), done.stdout
    report = load_report(tmp_path)
    assert [c["id"] for c in report["cells"]] == FILTERED
    assert {c["verdict"] for c in report["cells"]} == {"match"}
    for cell in report["cells"]:
        assert cell["params"]["head_size"] == 80 and cell["params"]["mode"] == "compressed"
        if cell["params"]["context"] == "short":
            continue  # within the budget (a batch-3 row may cross it while decoding)
        assert cell["counters"]["compressed_rows"] > 0  # contexts beyond the budget select blocks
        assert cell["counters"]["selected_blocks"] < 2 * cell["counters"]["compressed_context_blocks"]
    md = (tmp_path / "report.md").read_text()
    assert "parity: 6 cells, 6 match (6 compressed)" in md
    assert len(re.findall(r"^\| \d+ \| compressed \| float32 \| 80 \| 4 \| 16 \| \w+ .*\| match \|", md,
                          re.M)) == 6


def test_planted_reference_mismatch_is_reported_with_first_difference(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """The reference's layer-1 output of the second step is nudged in one element: every cell differs there, the
    report names where, and the run still judges every cell."""
    forward = RefEngine.forward
    calls: weakref.WeakKeyDictionary[RefEngine, int] = weakref.WeakKeyDictionary()  # per engine, i.e. per cell

    def nudged(self: RefEngine, layer: int, plan: Any, q: torch.Tensor, cache: torch.Tensor, out: torch.Tensor,
               scale: float) -> None:
        forward(self, layer, plan, q, cache, out, scale)
        calls[self] = calls.get(self, 0) + 1
        if calls[self] == 4:  # step 1, layer 1
            out[0, 1, 2] += 1.0

    monkeypatch.setattr(RefEngine, "forward", nudged)
    assert parity.main(["--filter", FILTER, "--out", str(tmp_path)]) == 1
    stdout = capsys.readouterr().out
    assert "parity: 6 cells, 0 match, 6 differ (6 compressed)" in stdout
    report = load_report(tmp_path)
    assert [c["verdict"] for c in report["cells"]] == ["differs"] * 6
    for cell in report["cells"]:
        assert re.fullmatch(re.escape(cell["id"]) + r": step 1, layer 1: output differs, first at \[0, 1, 2\]: "
                            r"engine .* vs reference .* \(1 of \d+ elements differ\)", cell["message"]), cell["message"]
        assert cell["counters"]["build_calls"] == 2  # the engine's counters when the difference was found
    md = (tmp_path / "report.md").read_text()
    assert md.count("| **differs** |") == 6
    assert "## Cells that do not match" in md


def test_a_failing_cell_is_a_verdict_and_the_run_goes_on(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    differs, errors = FILTERED[1], FILTERED[2]
    threads_seen: list[int] = []

    def runner(cell: Cell) -> dict[str, Any]:
        threads_seen.append(torch.get_num_threads())
        if cell.id == differs:
            raise Mismatch(f"{cell.id}: end: telemetry differs, counter key 'blocks_hit': engine 3 vs reference 4",
                           {"blocks_hit": 3})
        if cell.id == errors:
            raise RuntimeError("planted engine failure")
        return run_cell(cell)

    monkeypatch.setattr(parity, "run_cell", runner)
    threads = torch.get_num_threads()
    assert parity.main(["--filter", FILTER, "--out", str(tmp_path)]) == 1
    stdout = capsys.readouterr().out
    assert "parity: 6 cells, 4 match, 1 differs, 1 error (6 compressed)" in stdout
    verdicts = {c["id"]: (c["verdict"], c["message"]) for c in load_report(tmp_path)["cells"]}
    assert verdicts[differs] == ("differs", f"{differs}: end: telemetry differs, counter key 'blocks_hit': "
                                            "engine 3 vs reference 4")
    assert verdicts[errors] == ("error", "RuntimeError: planted engine failure")
    assert [v for v, _ in verdicts.values()].count("match") == 4
    assert threads_seen == [1] * 6  # every cell runs with one intra-op thread
    assert torch.get_num_threads() == threads  # and the caller's count is back, failures included


def test_no_matching_cell_is_a_usage_error(tmp_path: Path) -> None:
    done = cli("--mode", "exact", "--filter", "short", "--out", str(tmp_path))  # a compressed-only context
    assert done.returncode == 2
    assert "no cell of mode 'exact' matches --filter 'short'" in done.stderr
    assert not (tmp_path / "report.json").exists()
