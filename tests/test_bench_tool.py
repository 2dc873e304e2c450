"""The decode attention benchmark's CLI (`python -m tools.bench`, what `make bench` runs) at its smallest size: every
column is timed (no `n/a`), the exact columns agree with SDPA, the JSON it writes (`--json`) holds every cell and the
run's provenance, and the printed tables are the JSON's. A check of the tool's output, not of any speed: the timings of
so short a run mean nothing and are not compared."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import bench

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_worst_case_union_scales_with_the_block_size() -> None:
    # 2048 tokens: 128 blocks of 16 (125 top-k + 1 sink + 2 recent) or 16 blocks of 128 (13 top-k), per KV head
    assert bench.worst_case_union_blocks() == bench.NUM_KV_HEADS * 125 + 3
    assert bench.worst_case_union_blocks(bench.VLLM_CPU_BLOCK_SIZE) == bench.NUM_KV_HEADS * 13 + 3


def test_timed_round_returns_milliseconds_per_step() -> None:
    calls = []
    times = bench.timed_round(lambda: calls.append(1), 0.01, 1)
    assert times and all(0 < t < 1000 for t in times)
    assert len(calls) >= len(times)  # the Timer ran the step at least once per block it reports


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_cli_times_every_column(dtype: str, tmp_path: Path) -> None:
    pytest.importorskip("activekv._backend")
    pytest.importorskip("vllm")  # the CPU_ATTN columns call vLLM's CPU ops
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench", "--dtypes", dtype, "--contexts", "2048", "--batches", "1", "2",
         "--rounds", "1", "--warmup", "1", "--budget-s", "0", "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert proc.stdout == bench.markdown(result)  # the printed tables are the JSON's
    assert result["command"].startswith("python -m tools.bench --dtypes")
    assert result["machine"]["nproc"] >= 1 and result["versions"]["activekv"] != "unknown"
    assert result["columns"] == list(bench.COLUMNS)
    rows = result["rows"]
    assert [(r["dtype"], r["context"], r["batch"]) for r in rows] == [(dtype, 2048, 1), (dtype, 2048, 2)]
    for row in rows:
        cells = row["cells"]
        assert set(cells) == set(bench.COLUMNS)
        for name, cell in cells.items():
            assert cell["ms"] > 0 and cell["blocks"] >= 1 and cell["iqr_ms"] >= 0, (name, cell)
            if name != bench.CPU_ATTN_128:
                assert cell["anchor_ms"] > 0, name  # the anchor's median over the rounds it alternated with it
        # every exact column (ActiveKV's four, CPU_ATTN's two) within float32 or bfloat16 rounding of SDPA
        tolerance = 1e-5 if dtype == "float32" else 1e-2
        assert row["max_diff_exact"] < tolerance
        # 2k is within the budget: compressed mode runs exactly, at both block sizes
        assert set(row["compressed_diff"]) == set(bench.COMPRESSED_VS_CPU_ATTN)
        assert all(d["max"] < tolerance for d in row["compressed_diff"].values()), row["compressed_diff"]
    ratios = bench.compressed_ratio_table(result)[2:]
    assert [line.split(" | ")[3] for line in ratios] == ["in place", "one union", "in place, block 128"] * 2


@pytest.mark.parametrize("mode,fraction", [("exact", 0), ("exact", 4), ("compressed", 0)])
def test_profile_child_runs_the_benchmark_step(mode: str, fraction: int, tmp_path: Path) -> None:
    """`make profile`'s child (tools.profile_native.CHILD) sets up and runs the benchmark's step with tools.bench's
    helpers, here without perf: in place (its default), through a pool of a quarter of the blocks, compressed. A
    helper renamed in tools.bench fails here, not only under perf."""
    pytest.importorskip("activekv._backend")
    pytest.importorskip("vllm")
    from tools import profile_native

    ctl = tmp_path / "ctl"
    proc = subprocess.run([sys.executable, "-c", profile_native.CHILD, "1", "2048", "2", mode, str(fraction),
                           "float32", "16", "2", str(ctl)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert ctl.read_text() == "enable\ndisable\n"


@pytest.mark.parametrize("args,why", [
    (["--budget-s", "nan"], "--budget-s finite"), (["--budget-s", "inf"], "--budget-s finite"),
    (["--budget-s", "-1"], "must be at least 0"), (["--contexts", "0"], "positive multiple of 128"),
    (["--contexts", "-128"], "positive multiple of 128"), (["--contexts", "2050"], "positive multiple of 128"),
    (["--batches", "0"], "batch 0 must be at least 1"), (["--batches", "2", "-1"], "batch -1 must be at least 1")])
def test_bench_refuses_arguments_it_cannot_time(args: list[str], why: str, capsys: pytest.CaptureFixture) -> None:
    """A budget that is not a finite number of seconds (nan never ends a Timer's run), a context that is not a
    positive number of whole blocks, or an empty batch: a usage error (exit 2) before anything is built."""
    with pytest.raises(SystemExit) as exit_info:
        bench.main(args)
    assert exit_info.value.code == 2
    assert why in capsys.readouterr().err


@pytest.mark.parametrize("args,why", [
    (["--context", "0"], "--context must be at least 1"), (["--batch", "0"], "--batch must be at least 1"),
    (["--threads", "0"], "--threads must be at least 1"), (["--reps", "0"], "--reps must be at least 1"),
    (["--pool-fraction", "-1"], "0 (in place) or at least 1"),
    (["--mode", "compressed", "--pool-fraction", "4"], "compressed mode runs in place")])
def test_profile_refuses_arguments_it_cannot_profile(args: list[str], why: str,
                                                     capsys: pytest.CaptureFixture) -> None:
    from tools import profile_native

    with pytest.raises(SystemExit) as exit_info:
        profile_native.main(args)
    assert exit_info.value.code == 2
    assert why in capsys.readouterr().err
