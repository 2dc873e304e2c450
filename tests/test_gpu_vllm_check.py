"""The vLLM-on-GPU harness's CPU-side parts (`tools/gpu_vllm_check.py`): how it runs a suite or the benchmark (output
to the terminal and a log, a timeout that kills), its options, and its refusal without a pack. Installing the pack
and running vLLM need the device (`make gpu-vllm-check`, `make gpu-vllm-bench`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tools import gpu_vllm_check

REPO_ROOT = Path(__file__).resolve().parents[1]


def test_stream_copies_the_output_to_the_log_and_returns_the_status(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    log = tmp_path / "log.txt"
    cmd = [sys.executable, "-c", "import sys; print('one', flush=True); print('two', file=sys.stderr); sys.exit(3)"]
    assert gpu_vllm_check.stream(cmd, {}, log) == 3
    assert log.read_text() == "one\ntwo\n" and capsys.readouterr().out == "one\ntwo\n"


def test_stream_kills_what_runs_past_its_timeout(tmp_path: Path) -> None:
    log = tmp_path / "log.txt"
    # the child starts a grandchild that would outlive it: the whole session is killed
    code = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print('started', flush=True); time.sleep(60)")
    rc = gpu_vllm_check.stream([sys.executable, "-c", code], {}, log, timeout_s=3)
    assert rc == 124
    text = log.read_text()
    assert text.startswith("started\n") and "killed after 3 s" in text


def test_stream_within_its_timeout_returns_the_status(tmp_path: Path) -> None:
    assert gpu_vllm_check.stream([sys.executable, "-c", "print('done')"], {}, tmp_path / "log.txt", 60) == 0
    assert (tmp_path / "log.txt").read_text() == "done\n"


def test_cli_refuses_without_a_pack_and_bench_with_bench_only(tmp_path: Path) -> None:
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_vllm_check", "--pack", str(tmp_path / "none"), "--out",
                           str(tmp_path / "out"), "--bench"], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2 and "no pack at" in proc.stderr and not (tmp_path / "out").exists()
    proc = subprocess.run([sys.executable, "-m", "tools.gpu_vllm_check", "--bench", "--bench-only"], cwd=REPO_ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "not allowed with argument" in proc.stderr


def test_the_benchmark_is_killed_a_while_after_its_own_budget() -> None:
    from tools import bench_gpu_vllm

    extra = gpu_vllm_check.BENCH_KILL_AFTER_BUDGET_S
    assert gpu_vllm_check.bench_timeout_s([]) == bench_gpu_vllm.DEFAULT_BUDGET_S + extra
    assert gpu_vllm_check.bench_timeout_s(["--contexts", "131072", "--budget-s", "300"]) == 300 + extra
    assert extra > bench_gpu_vllm.GRACE_S  # a case aborting at its hard deadline is not killed first
