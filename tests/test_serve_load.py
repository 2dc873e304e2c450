"""Serving under load, the short version of `python -m tools.serve_load` (`make serve-load`: 8 waves): `activekv serve`
(exact mode, a pool of 8 blocks of 16 tokens per layer) and stock `vllm serve` on the real model, each driven by the
OpenAI client with the same 16 concurrent streaming requests of mixed lengths (up to 4x the pool), every 8th cancelled
mid-stream: 3 waves on ActiveKV (the first the warm-up) and 1 on stock vLLM (`--stock-waves 1`: the reference every
ActiveKV wave is compared with; stock vLLM's repeatability across waves is left to `make serve-load`). The two servers
start at once (tools/serve_load.py): measured 230 s for the test, the compiled graphs already in inductor's cache
(tools/vllm_run.py COMPILE_CACHE_ENV), on a machine shared with another job; 459 s there with the servers started one
after the other. No error response; every finished request's tokens equal stock vLLM's, a difference allowed only after
a near tie; the server's resident memory grows by at most 2% over the last half of the run."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools.serve_load import GROWTH_BOUND, LAUNCHER

pytestmark = [pytest.mark.vllm, pytest.mark.skipif(not LAUNCHER.is_file(), reason=f"no {LAUNCHER}: run `make build`")]

REPO = Path(__file__).resolve().parents[1]
REQUESTS, WAVES, POOL_BLOCKS = 16, 3, 8


def test_serving_under_load_matches_stock_vllm(tmp_path: Path) -> None:
    out = tmp_path / "load.json"
    cmd = [sys.executable, "-m", "tools.serve_load", "--requests", str(REQUESTS), "--waves", str(WAVES),
           "--stock-waves", "1", "--pool-blocks", str(POOL_BLOCKS), "--log-dir", str(tmp_path), "--json", str(out)]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert out.is_file(), done.stdout[-3000:] + done.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert summary["requests_per_wave"] == REQUESTS and summary["waves"] == WAVES
    assert len(summary["wave_s"]["stock"]) == 1 and len(summary["wave_s"]["activekv"]) == WAVES
    assert summary["longer_than_pool"] > 0 and summary["cancelled_per_wave"] == REQUESTS // 8
    assert summary["errors"] == 0, summary["error_samples"]
    assert summary["different"] == 0, summary["difference_samples"]
    finished = REQUESTS - summary["cancelled_per_wave"]
    assert summary["finished_compared"] == WAVES * finished
    assert summary["rss_growth_last_half"]["activekv"] <= GROWTH_BOUND, summary["rss_mib"]
    assert done.returncode == 0 and summary["ok"], done.stdout[-3000:]
