"""The prefill attention benchmark's CLI (`python -m tools.bench_prefill`) at its smallest size: every column runs, all
of them agree with SDPA (or with CPU_ATTN past the first chunk), and the JSON it writes holds each chunk's columns and
the run's provenance. A check of the tool's output, not of any speed: timings this short mean nothing."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import bench_prefill

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_parse_chunk_reads_tokens_at_context_and_rejects_the_rest() -> None:
    assert bench_prefill.parse_chunk("2048") == (2048, 2048)
    assert bench_prefill.parse_chunk("3072@7168") == (3072, 7168)
    for bad in ("x", "4096@2048", "0", "1@2@3"):
        with pytest.raises(argparse.ArgumentTypeError):
            bench_prefill.parse_chunk(bad)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_bench_prefill_cli_runs_every_column_and_they_agree(dtype: str, tmp_path: Path) -> None:
    pytest.importorskip("activekv._backend")
    pytest.importorskip("vllm")  # the CPU_ATTN column calls vLLM's CPU ops
    out = tmp_path / "prefill.json"
    proc = subprocess.run(
        [sys.executable, "-m", "tools.bench_prefill", "--geometry", "tiny", "--dtypes", dtype, "--chunks", "300",
         "40@300", "--block-sizes", "128", "16", "--threads", "1", "--budget-s", "0.01", "--rounds", "1",
         "--json", str(out)],
        cwd=REPO_ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["tool"] == "tools.bench_prefill" and result["machine"] and result["commit"]
    rows = result["rows"]
    assert [(r["tokens"], r["context"]) for r in rows] == [(300, 300), (40, 300)]
    assert set(rows[0]["ms"]) == {"ActiveKV default, block 128", "ActiveKV default, block 16", "CPU_ATTN, block 128",
                                  "SDPA"}
    assert set(rows[1]["ms"]) == set(rows[0]["ms"]) - {"SDPA"}  # SDPA runs a first chunk only
    tolerance = 1e-5 if dtype == "float32" else 2e-2
    for r in rows:
        assert all(t > 0 for t in r["ms"].values())
        assert r["max_diff"] < tolerance, r
    assert "| tiny | " + dtype + " | 40@300 |" in proc.stdout
