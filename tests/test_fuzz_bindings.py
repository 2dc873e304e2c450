"""The binding-boundary fuzz suite (tests/fuzz_bindings.py), one subprocess per case: a segfault, an abort or a
sanitizer report in a case is this test's failure, with the case's output, never a lost pytest run.

Default: 40 derandomized examples per case (about a minute in all here). More: ACTIVEKV_FUZZ_EXAMPLES=2000 (random
exploration; ACTIVEKV_FUZZ_SEED=N to repeat one)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

CASES = ("fuzz_as_block_layout", "fuzz_builder", "fuzz_collector_labels", "fuzz_copy_blocks", "fuzz_endpoint",
         "fuzz_engine_config", "fuzz_engine_step", "fuzz_exact_tiles_and_names", "fuzz_geometry", "fuzz_group_query",
         "fuzz_impl", "fuzz_impl_forward", "fuzz_kv_state_accessors", "fuzz_kv_state_write", "fuzz_page_pool",
         "fuzz_select_blocks", "fuzz_telemetry", "fuzz_telemetry_folder", "fuzz_tile_mask", "fuzz_tiled_attention")


def run_isolated(args: list[str], timeout: int = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO_ROOT, capture_output=True, text=True, timeout=timeout,
                          env=os.environ.copy())


def describe(proc: subprocess.CompletedProcess) -> str:
    how = f"killed by {signal.Signals(-proc.returncode).name}" if proc.returncode < 0 else f"exit {proc.returncode}"
    return f"{how}\n--- stdout\n{proc.stdout[-6000:]}\n--- stderr\n{proc.stderr[-12000:]}"


def test_case_list_is_every_fuzz_case() -> None:
    text = (REPO_ROOT / "tests" / "fuzz_bindings.py").read_text()
    assert set(re.findall(r"^def (fuzz_\w+)\(", text, re.M)) == set(CASES)


@pytest.mark.parametrize("case", CASES)
def test_fuzz_case(case: str) -> None:
    proc = run_isolated(["-m", "tests.fuzz_bindings", case])
    assert proc.returncode == 0, describe(proc)
    m = re.search(rf"^{case}: ok, (\d+) examples, (\d+) accepted calls, (\d+) rejected calls$", proc.stdout, re.M)
    assert m, describe(proc)
    examples, accepted, rejected = map(int, m.groups())
    assert examples >= 10, describe(proc)  # hypothesis really ran the property
    assert accepted > 0, describe(proc)  # valid inputs were exercised (and compared with the reference)
    if case not in ("fuzz_telemetry", "fuzz_telemetry_folder"):  # nothing of theirs is a call to reject
        assert rejected > 0, describe(proc)  # invalid inputs were exercised


def test_a_crashing_case_fails_the_run() -> None:
    """The harness itself: a case that dies by a signal is reported as a failure with the signal's name (under
    `make sanitize`, AddressSanitizer's SEGV handler turns the signal into its report and an abort)."""
    proc = run_isolated(["-c", "import os, signal; print('before'); os.kill(os.getpid(), signal.SIGSEGV)"])
    assert proc.returncode in (-signal.SIGSEGV, -signal.SIGABRT)
    assert describe(proc).startswith("killed by SIG")
