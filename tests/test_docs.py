"""The results pages cannot drift from their data: docs/benchmarks.md and README.md's results table are exactly what
`python -m tools.docs` renders from the committed docs/data/*.json, every image they embed exists, and the page stays
within its size. The renderer is checked on the committed data, not on any speed."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tools import docs

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_benchmarks_page_is_what_the_committed_data_renders() -> None:
    assert docs.BENCHMARKS.read_text() == docs.benchmarks_page(), "docs/benchmarks.md is stale: run `make docs`"


def test_readme_results_table_is_what_the_committed_data_renders() -> None:
    text = docs.README.read_text()
    assert docs.readme_with_results(text) == text, "README.md's results table is stale: run `make docs`"
    assert text.count(docs.README_BEGIN) == 1 and text.count(docs.README_END) == 1


def test_check_passes_on_the_tree_and_fails_on_a_stale_page(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.docs", "--check"], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    stale = tmp_path / "benchmarks.md"
    stale.write_text(docs.BENCHMARKS.read_text().replace("| float32 | 2k | 1 |", "| float32 | 2k | 1 | 9.99 |", 1))
    monkeypatch.setattr(docs, "BENCHMARKS", stale)
    assert docs.main(["--check"]) == 1


def test_every_embedded_image_exists_and_every_plot_is_embedded() -> None:
    pages = {p: p.read_text() for p in (docs.BENCHMARKS, docs.README, REPO_ROOT / "docs" / "design.md")}
    embedded = {name for text in pages.values()
                for name in re.findall(r"!\[[^\]]+\]\((?:docs/)?img/([\w.-]+\.png)\)", text)}
    assert embedded == {"cpu_decode.png", "e2e_decode.png", "gpu_decode.png", "decode_step.png"}
    for name in embedded:
        data = (docs.IMG / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 10_000, name


def test_benchmarks_page_is_at_most_300_lines_and_each_table_opens_its_section() -> None:
    text = docs.BENCHMARKS.read_text()
    assert len(text.splitlines()) <= 300
    for section in re.split(r"\n## ", text)[1:]:
        if section.startswith("Tried and not kept"):
            continue
        first_table = next(i for i, line in enumerate(section.splitlines()) if line.startswith("| "))
        assert first_table <= 20, section.splitlines()[0]  # the current table is on the section's first screen


def test_data_files_carry_their_provenance() -> None:
    optional = [n for n in (docs.GPU_STREAMED_DATA, docs.GPU_VLLM_DATA) if (docs.DATA / n).is_file()]
    for name in ("bench_cpu.json", "bench_e2e.json", "bench_gpu.json", *optional):
        data = json.loads((docs.DATA / name).read_text())
        assert data["command"] and re.fullmatch(r"\d{4}-\d{2}-\d{2}", data["date"]), name
    cpu = docs.load("bench_cpu.json")
    assert cpu["machine"]["cpu"] and cpu["commit"] and cpu["versions"]["activekv"]
    assert "no GPU" in docs.load("bench_gpu.json")["provenance"]["machine"]


def test_a_later_streamed_run_replaces_the_streamed_table_and_says_where_it_comes_from() -> None:
    gpu = docs.load("bench_gpu.json")
    later = {"device": "NVIDIA H100 80GB HBM3", "date": "2026-12-05", "command": "python -m tools.bench_gpu X",
             "provenance": {"run": "the tree of abc"}, "ceilings": {"h2d_GBps": 50.0},
             "streamed": [{**r, "ms": 123.45} for r in gpu["streamed"]]}
    page = "\n".join(docs.gpu_section(gpu, later))
    assert "come from a later run on NVIDIA H100 80GB HBM3 (2026-12-05): `python -m tools.bench_gpu X` (the tree of " \
           "abc); data `docs/data/bench_gpu_streamed.json`; its pinned bus: 50.0 GB/s" in page
    assert "| 123.45 |" in page and f"| {gpu['streamed'][0]['ms']:.2f} |" not in page
    assert "Where a streamed step goes" not in page  # the later run has no breakdown: none is shown
    alone = "\n".join(docs.gpu_section(gpu))
    assert "later run" not in alone and f"| {gpu['streamed'][0]['ms']:.2f} |" in alone
    assert docs.short_device("NVIDIA H100 80GB HBM3") == "H100" and docs.short_device("NVIDIA H200") == "H200"


def test_no_page_narrates_past_work() -> None:
    """Docs describe the product as it is; the history is `git log`."""
    narration = re.compile(r"\b(issue \d+|issue item|(first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|"
                           r"tenth|eleventh) session|this session|round \d+ of)\b", re.I)
    files = [REPO_ROOT / "README.md", REPO_ROOT / "CONTRIBUTING.md", *sorted((REPO_ROOT / "docs").glob("*.md")),
             *sorted((REPO_ROOT / "tools").glob("*.py"))]
    found = [f"{f.relative_to(REPO_ROOT)}:{n}: {line.strip()[:80]}" for f in files
             for n, line in enumerate(f.read_text().splitlines(), 1) if narration.search(line)]
    assert not found, found
