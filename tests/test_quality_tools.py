"""The quality tools (tools/train_tiny.py, tools/quality.py) through their helpers and CLI, without training a model
or starting vLLM: the corpus split, the byte tokens, the agreement definitions, and `python -m tools.quality --parts d`
(the synthetic spread-attention measurement, native engines only)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.quality import Agreement
from tools.train_tiny import BOS, EOS, HELDOUT_EVERY, corpus_files, decode, encode, is_current, split_files

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_corpus_is_sorted_and_the_split_is_fixed_and_disjoint() -> None:
    files = corpus_files()
    assert files == sorted(files) and all(f.suffix == ".py" for f in files)
    train, held = split_files(files)
    assert not set(train) & set(held) and len(train) + len(held) == len(files)
    assert held == files[HELDOUT_EVERY - 1::HELDOUT_EVERY]


def test_bytes_round_trip_and_specials_are_dropped() -> None:
    data = "def f():\n    return 'é'\n".encode()
    assert encode(data) == list(data) and max(encode(bytes(range(256)))) == 255
    assert decode([BOS, *encode(data), EOS]) == data


def test_an_empty_directory_is_not_a_current_model(tmp_path: Path) -> None:
    assert not is_current(tmp_path)


@pytest.mark.parametrize(("got", "want", "prefix", "positionwise"), [
    ([1, 2, 3, 4], [1, 2, 3, 4], 1.0, 1.0),
    ([1, 2, 9, 4], [1, 2, 3, 4], 0.5, 0.75),  # one token differs, the rest falls back into step
    ([9, 2, 3, 4], [1, 2, 3, 4], 0.0, 0.75),
])
def test_agreement_definitions(got: list[int], want: list[int], prefix: float, positionwise: float) -> None:
    top = [{t: -0.1, t + 100: -0.6} for t in want]
    a = Agreement.of([got], [want], [top])
    assert a.prefix == [prefix] and a.positionwise == [positionwise]
    assert a.margins == ([None] if prefix == 1.0 else [pytest.approx(0.5)])


def test_quality_cli_spread_part(tmp_path: Path) -> None:
    out, js = tmp_path / "quality.md", tmp_path / "quality.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.quality", "--parts", "d", "--model", str(tmp_path / "none"), "--out", str(out),
         "--json", str(js)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    spread = json.loads(js.read_text())["spread"]
    by_markers = {row["markers"]: row for row in spread["counting"]}
    # a marker in every block keeps the markers' share; sparse markers are overcounted (docs/quality.md (d))
    assert by_markers[128]["budgets"]["4"]["rel_error"] < 0.05
    assert by_markers[16]["budgets"]["4"]["rel_error"] > 1.0
    assert spread["uniform"]["4"]["rel_error_mean"] > 1.0
    assert "## (d) Attention spread evenly" in out.read_text()
