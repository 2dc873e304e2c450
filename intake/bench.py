"""Benchmark: the whole-tree scan's wall time, cold (an empty parse cache) and warm (the cache it filled).

Usage: ``python -m intake.bench [PATH ...] [--root DIR] [--warm-runs N] [--jobs N]`` (default paths: engine bindings
patches). Each run is the public CLI in a fresh process, as ``make intake`` runs it; the cache lives in a temporary
folder, so the project's own cache is neither used nor touched. Prints one line per run and the units parsed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HOME = Path(__file__).resolve().parents[1]


def run(paths: list[str], root: Path, cache: Path, jobs: int) -> tuple[float, dict]:
    env = {**os.environ, "PYTHONPATH": str(HOME)}
    cmd = [sys.executable, "-m", "intake", "scan", *paths, "--format", "json", "--cache", str(cache)]
    cmd += ["--jobs", str(jobs)]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    elapsed = time.perf_counter() - start
    if done.returncode == 2:
        raise SystemExit(f"the scan could not run: {done.stderr.strip()}")
    return elapsed, json.loads(done.stdout)["summary"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m intake.bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="*", default=["engine", "bindings", "patches"])
    parser.add_argument("--root", type=Path, default=Path("."))
    parser.add_argument("--warm-runs", type=int, default=3)
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    args = parser.parse_args(argv)
    root = args.root.absolute()
    print(f"intake scan {' '.join(args.paths)} in {root} ({args.jobs} parallel parses, {os.cpu_count()} CPUs)")
    with tempfile.TemporaryDirectory(prefix="intake-bench-") as tmp:
        cache = Path(tmp)
        cold, info = run(args.paths, root, cache, args.jobs)
        print(
            f"cold: {cold:7.2f} s  ({info['parsed']} units parsed, {info['files_screened']} files screened, "
            f"{info['findings']} findings)"
        )
        for i in range(args.warm_runs):
            warm, info = run(args.paths, root, cache, args.jobs)
            print(f"warm: {warm:7.2f} s  ({info['parsed']} parsed, {info['from_cache']} from the cache)  run {i + 1}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
