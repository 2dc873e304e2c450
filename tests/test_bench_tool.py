"""The decode attention benchmark's CLI (`python -m tools.bench`, what `make bench` runs) at its smallest size: every
column is timed (no `n/a`), the exact columns agree with SDPA, and the ratio tables carry both compressed block sizes.
A check of the tool's tables, not of any speed: the timings of so short a run mean nothing and are not compared."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import bench

REPO_ROOT = Path(__file__).resolve().parents[1]


def tables(text: str) -> list[list[dict[str, str]]]:
    """The markdown tables of the bench's output, each a list of rows keyed by the header's cells."""
    found: list[list[dict[str, str]]] = []
    header: list[str] | None = None
    for line in text.splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
            found.append([])
        elif not set(line) <= set("|-"):
            found[-1].append(dict(zip(header, cells, strict=True)))
    return found


def test_worst_case_union_scales_with_the_block_size() -> None:
    # 2048 tokens: 128 blocks of 16 (125 top-k + 1 sink + 2 recent) or 16 blocks of 128 (13 top-k), per KV head
    assert bench.worst_case_union_blocks() == bench.NUM_KV_HEADS * 125 + 3
    assert bench.worst_case_union_blocks(bench.VLLM_CPU_BLOCK_SIZE) == bench.NUM_KV_HEADS * 13 + 3


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_cli_times_every_column(dtype: str) -> None:
    pytest.importorskip("activekv._backend")
    pytest.importorskip("vllm")  # the CPU_ATTN columns call vLLM's CPU ops
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--dtypes", dtype, "--contexts", "2048", "--batches", "1", "2",
         "--rounds", "1", "--warmup", "1", "--min-reps", "3", "--max-reps", "3", "--budget-s", "0"],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    main, vs_cpu_attn, ratios = tables(proc.stdout)
    assert [(r["context"], r["batch"]) for r in main] == [("2k", "1"), ("2k", "2")]
    for row in main:
        for column in bench.COLUMNS:
            if column == bench.COMPRESSED_ONE_UNION and row["batch"] == "1":
                assert row[column] == bench.SAME_AS_DEFAULT
            else:
                assert float(row[column]) > 0, (column, row[column])
        # every exact column (ActiveKV's four, CPU_ATTN's two) within float32 or bfloat16 rounding of SDPA
        tolerance = 1e-5 if dtype == "float32" else 1e-2
        assert float(row["max diff (exact)"]) < tolerance
        # 2k is within the budget: compressed mode runs exactly, at both block sizes
        approximate = row["compressed diff (approximate)"].split(" / ")
        assert len(approximate) == 2
        assert all(float(a.split(",")[0].removeprefix("max ")) < tolerance for a in approximate), approximate
    compressed_vs = [f"{bench.CPU_ATTN_128} / {c}" for c in bench.COMPRESSED_VS_CPU_ATTN]
    assert all(float(r[c].removesuffix("x")) > 0 for r in vs_cpu_attn for c in compressed_vs)
    assert [r["compressed pool"] for r in ratios] == ["default", "default, block 128", "default", "one union",
                                                      "default, block 128"]
