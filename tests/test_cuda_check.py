"""tools/cuda_check.py can fail: a .cu with an error, and one whose kernel spills registers, are reported; a clean one
passes. Needs the toolkit `make cuda-check` installs (CI runs that target before the tests); skipped without it."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TOOLKIT = ROOT / "build" / "cuda-toolkit"

pytestmark = pytest.mark.skipif(not (TOOLKIT / "nvidia" / "cu13" / "bin" / "nvcc").is_file(),
                                reason="run `make cuda-check` first (installs nvcc 13.0 from PyPI)")


def check(folder: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.cuda_check", "--toolkit", str(TOOLKIT), "--sources",
                           str(folder)], cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_clean_kernel_passes(tmp_path: Path) -> None:
    (tmp_path / "ok.cu").write_text("__global__ void twice(float* x) { x[threadIdx.x] *= 2.0f; }\n")
    done = check(tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "ok   " in done.stdout and "no spills" in done.stdout


def test_error_fails(tmp_path: Path) -> None:
    (tmp_path / "bad.cu").write_text("__global__ void twice(float* x) { x[threadIdx.x] *= undeclared; }\n")
    done = check(tmp_path)
    assert done.returncode == 1 and "FAIL" in done.stdout and "undeclared" in done.stdout


def test_register_spill_fails(tmp_path: Path) -> None:
    # A large per-thread array indexed at run time under a 32-register cap: ptxas spills it.
    (tmp_path / "spill.cu").write_text(
        "__global__ void __launch_bounds__(1024, 2) spill(float* x, int k) {\n"
        "  float a[256];\n"
        "  for (int i = 0; i < 256; ++i) a[i] = x[i * k + threadIdx.x];\n"
        "  float s = 0; for (int i = 0; i < 256; ++i) s += a[(i * k) & 255] * a[i];\n"
        "  x[threadIdx.x] = s;\n}\n")
    done = check(tmp_path)
    assert done.returncode == 1 and re.search(r"[1-9][0-9]* bytes spill (stores|loads)", done.stdout), done.stdout
