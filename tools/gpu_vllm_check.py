"""Run the vLLM-on-GPU end-to-end suite on the device's H200 from a pack (`make gpu-vllm-check`, after the build).

    python -m tools.gpu_vllm_check [--pack build/gpu-vllm] [--out build/gpu] [--bench | --bench-only]
                                   [--bench-args ARGS] [--bench-timeout-s S] [-- PYTEST_ARGS...]

Installs the pack that `make gpu-vllm-pack` wrote (tools/gpu_vllm_pack.py) under a temporary prefix: the patched vLLM
tree and its `vllm-0.32.0+cu130` record into PREFIX/tree, the test-harness stand-ins into that tree's vllm/, the wheels
with `pip install --no-index --no-deps --target PREFIX/site`. Then runs tests/test_gpu_vllm.py with
PYTHONPATH=PREFIX/tree:PREFIX/site and the settings ../shared/design/GPU_VLLM.md lists (in-process engine core, no
FlashInfer sampler, model runner V1, offline). Where `git` is missing, ACTIVEKV_SKIP_PATCH_CHECK=1: the tree was
patched before packing. Writes OUT/gpu_vllm_junit.xml, OUT/gpu_vllm_log.txt and OUT/gpu_vllm_check.json (the facts
of the run: git present, seconds per phase, pytest's exit status). Exits with pytest's status.

`--bench` then runs the vLLM decode benchmark (tools/bench_gpu_vllm.py, with `--out OUT` and ARGS) with the same
prefix and environment, whatever the tests gave; `--bench-only` runs it instead of the tests (`make gpu-vllm-bench`).
It writes OUT/bench_gpu_vllm.json and OUT/bench_gpu_vllm_log.txt; past --bench-timeout-s it is killed (its JSON,
written after every case, keeps what it measured); by default that is its --budget-s (ARGS, else its default) plus
BENCH_KILL_AFTER_BUDGET_S. The exit status is then pytest's when that is not 0, else the benchmark's.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = "tests/test_gpu_vllm.py"
BENCH = "tools.bench_gpu_vllm"
# The benchmark keeps to its --budget-s itself (a running case aborts GRACE_S after it); the harness kills it this long
# after the budget, as a backstop.
BENCH_KILL_AFTER_BUDGET_S = 80.0


def install(pack: Path, prefix: Path) -> dict[str, float]:
    times: dict[str, float] = {}
    t0 = time.monotonic()
    tree, site = prefix / "tree", prefix / "site"
    with tarfile.open(pack / "vllm-tree.tar.gz") as tar:
        tar.extractall(tree, filter="data")
    shutil.copytree(pack / "standins" / "vllm", tree / "vllm", dirs_exist_ok=True)
    times["unpack_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    wheels = sorted(str(p) for p in (pack / "wheels").glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--target", str(site), *wheels], check=True)
    times["wheels_s"] = time.monotonic() - t0
    return times


def bench_timeout_s(bench_args: list[str]) -> float:
    """The benchmark's --budget-s (as given in bench_args, else its default) plus BENCH_KILL_AFTER_BUDGET_S."""
    from tools.bench_gpu_vllm import DEFAULT_BUDGET_S

    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S)
    return ap.parse_known_args(bench_args)[0].budget_s + BENCH_KILL_AFTER_BUDGET_S


def stream(cmd: list[str], env: dict[str, str], log_path: Path, timeout_s: float | None = None) -> int:
    """Run cmd in ROOT, its output line by line to stdout and log_path; its exit status, or 124 when it ran past
    timeout_s and was killed (with every process of its session)."""
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=timeout_s is not None)
        killed = threading.Event()

        def kill() -> None:
            killed.set()
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:  # it ended meanwhile
                pass

        timer = threading.Timer(timeout_s, kill) if timeout_s is not None else None
        if timer is not None:
            timer.start()
        assert proc.stdout is not None
        for line in proc.stdout:
            sys.stdout.write(line)
            log.write(line)
        rc = proc.wait()
        if timer is not None:
            timer.cancel()
        if killed.is_set():
            line = f"gpu-vllm-check: {' '.join(cmd[1:3])} killed after {timeout_s:.0f} s\n"
            sys.stdout.write(line)
            log.write(line)
            return 124
    return rc


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_vllm_check", description=__doc__.splitlines()[0])
    ap.add_argument("--pack", type=Path, default=ROOT / "build" / "gpu-vllm")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "gpu")
    runs = ap.add_mutually_exclusive_group()
    runs.add_argument("--bench", action="store_true", help=f"after the tests, run {BENCH}")
    runs.add_argument("--bench-only", action="store_true", help=f"run {BENCH} instead of the tests")
    ap.add_argument("--bench-args", default="", help=f"arguments for {BENCH}, one string (e.g. '--budget-s 300')")
    ap.add_argument("--bench-timeout-s", type=float, default=None,
                    help=f"kill the benchmark after this many seconds (default: its budget + "
                         f"{BENCH_KILL_AFTER_BUDGET_S:.0f})")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    bench_args = shlex.split(args.bench_args)
    if args.bench_timeout_s is None:
        args.bench_timeout_s = bench_timeout_s(bench_args)
    if not (args.pack / "vllm-tree.tar.gz").is_file():
        print(f"gpu-vllm-check: no pack at {args.pack}: run `make gpu-vllm-pack` here and carry it", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    facts: dict[str, object] = {"git": shutil.which("git") is not None}
    with tempfile.TemporaryDirectory(prefix="activekv-gpu-vllm-") as tmp:
        prefix = Path(tmp)
        facts.update(install(args.pack, prefix))
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join([str(prefix / "tree"), str(prefix / "site"), str(ROOT)]),
            "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CACHE_ROOT": str(prefix / "vllm-cache"),
            "ACTIVEKV_GPU_VLLM": "1", "ACTIVEKV_GPU_VLLM_MODELS": str(prefix / "models"), "PYTHONUNBUFFERED": "1",
        })
        if not facts["git"]:
            env["ACTIVEKV_SKIP_PATCH_CHECK"] = "1"  # no git there: the tree was patched before packing
        rc = 0
        if not args.bench_only:
            t0 = time.monotonic()
            cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", SUITE,
                   f"--junitxml={args.out / 'gpu_vllm_junit.xml'}", *args.pytest_args]
            rc = stream(cmd, env, args.out / "gpu_vllm_log.txt")
            facts["pytest_s"] = time.monotonic() - t0
            facts["pytest_rc"] = rc
        if args.bench or args.bench_only:
            t0 = time.monotonic()
            cmd = [sys.executable, "-m", BENCH, "--out", str(args.out), *bench_args]
            bench_rc = stream(cmd, env, args.out / "bench_gpu_vllm_log.txt", args.bench_timeout_s)
            facts["bench_s"] = time.monotonic() - t0
            facts["bench_rc"] = bench_rc
            rc = rc or bench_rc
    (args.out / "gpu_vllm_check.json").write_text(json.dumps(facts, indent=1) + "\n")
    print(f"gpu-vllm-check: {json.dumps(facts)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
