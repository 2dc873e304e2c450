"""The binding-boundary fuzz suite (tests/fuzz_bindings.py), one subprocess per case: a segfault, an abort or a
sanitizer report in a case is this test's failure, with the case's output, never a lost pytest run.

Default: 300 derandomized examples per case (a case with fewer distinct inputs stops when it has drawn them all),
over 10,000 boundary calls in all, about a minute and a half here. More: ACTIVEKV_FUZZ_EXAMPLES=2000 (random
exploration; ACTIVEKV_FUZZ_SEED=N to repeat one)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys

import pytest

from tests.conftest import REPO_ROOT

# Boundary calls (accepted + rejected) each case must make at the default example count: about 80% of what the
# derandomized run makes here, so a case that stops exercising its entry points fails; together at least 10,000.
MIN_CALLS = {
    "fuzz_as_block_layout": 240,
    "fuzz_builder": 240,
    "fuzz_collector_labels": 240,
    "fuzz_concurrent_entry_points": 3640,
    "fuzz_copy_blocks": 230,
    "fuzz_endpoint": 310,
    "fuzz_engine_config": 350,
    "fuzz_engine_step": 900,
    "fuzz_exact_tiles_and_names": 480,
    "fuzz_geometry": 480,
    "fuzz_group_query": 270,
    "fuzz_impl": 240,
    "fuzz_impl_forward": 240,
    "fuzz_kv_state_accessors": 240,
    "fuzz_kv_state_write": 240,
    "fuzz_page_pool": 1400,
    "fuzz_select_blocks": 240,
    "fuzz_series_folder": 50,
    "fuzz_telemetry": 240,
    "fuzz_telemetry_folder": 240,
    "fuzz_tile_mask": 240,
    "fuzz_tiled_attention": 480,
}
CASES = tuple(MIN_CALLS)


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
    if not os.environ.get("ACTIVEKV_FUZZ_EXAMPLES"):  # the default count: the calls it must make
        assert accepted + rejected >= MIN_CALLS[case], describe(proc)
    assert accepted > 0, describe(proc)  # valid inputs were exercised (and compared with the reference)
    if case not in ("fuzz_telemetry", "fuzz_telemetry_folder", "fuzz_concurrent_entry_points"):  # valid calls only
        assert rejected > 0, describe(proc)  # invalid inputs were exercised


def test_the_suite_makes_at_least_10000_boundary_calls() -> None:
    assert sum(MIN_CALLS.values()) >= 10_000


def test_a_crashing_case_fails_the_run() -> None:
    """The harness itself: a case that dies by a signal is reported as a failure with the signal's name (under
    `make sanitize`, AddressSanitizer's SEGV handler turns the signal into its report and an abort)."""
    proc = run_isolated(["-c", "import os, signal; print('before'); os.kill(os.getpid(), signal.SIGSEGV)"])
    assert proc.returncode in (-signal.SIGSEGV, -signal.SIGABRT)
    assert describe(proc).startswith("killed by SIG")
