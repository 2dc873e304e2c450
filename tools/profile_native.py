"""Where a decode step's CPU time goes, native frames included: `perf record` over repeated ActiveKV forwards, self
time grouped into admission, transfer, KV update, kernel, ATen, OpenMP runtime, Python/pybind11 boundary, OS.

`python -m tools.profile_native [--context N] [--batch B] [--mode exact|compressed] [--pool-fraction F]
[--dtype float32|bfloat16] [--block-size 16|128|...] [--threads T] [--reps R]` (what `make profile` runs). The step
is the benchmark's (`tools/bench.py` activekv_column: 32 query heads, 8 KV heads, head size 128, block 16 unless
`--block-size` says otherwise (128: vLLM's CPU default), ActiveKV's default options (in place) unless
`--pool-fraction` asks for a pool (tiles of 16 blocks), the Builder/Impl calls vLLM's patched backend makes: build,
KV update of the new token, forward). A child process sets the step up, runs `--reps` steps,
and `perf record -e cpu-clock` samples it (a software clock: it works in virtual machines without hardware counters),
enabled through `perf record --control` only for the steps (after set-up and one warm-up step, before teardown).
Self time per symbol, grouped by the first matching pattern of GROUPS. Needs `perf` (Debian: linux-perf) and
`kernel.perf_event_paranoid` <= 2. A profile, not a timing: on a loaded machine memory-bound code takes a larger share.
"""

from __future__ import annotations

import argparse
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# (group, pattern on "dso symbol"): first match wins; order matters (engine symbols before the dso fallbacks).
GROUPS: tuple[tuple[str, str], ...] = (
    ("kernel", r"cpu_kernel::|attend_blocks|CpuPath|attend_tile"),
    ("admission", r"admit_tile|release_tile|lru_|exact_tiles|select_blocks|quest_scores|reset_page_table|"
                  r"attend_selected"),
    ("transfer", r"copy_blocks"),
    ("KV update", r"KvState::write|update_kv|update_key_metadata"),
    ("engine, other", r"libactivekv_engine"),
    ("OpenMP runtime", r"libgomp"),
    ("Python GC", r"gc_collect|visit_decref|visit_reachable"),
    ("Python / pybind11 boundary", r"libpython|_backend\.cpython|pybind11"),
    ("ATen / torch", r"libtorch|libc10|libsleef"),
    ("libc / libm", r"libc\.so|libm\.so|libstdc\+\+"),
    ("OS kernel", r"\[kernel"),
)

CHILD = r'''
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
import activekv._backend as backend
from tools.bench import COMPRESSED, activekv_column, make_case, pool_options
context, batch, mode, fraction = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
block_size = int(sys.argv[7])
case = make_case(context, batch, 0, getattr(torch, sys.argv[6]))
if mode == "compressed":
    options = dict(COMPRESSED)
else:
    options = {"mode": "exact"} if fraction == 0 else pool_options(case, fraction, block_size)
step, _ = activekv_column(case, backend, options, block_size)
step()  # warm-up (fills a pool)
import gc
gc.freeze()  # as vLLM does after start-up: the cyclic GC would otherwise rescan torch's objects during the steps
with open(sys.argv[9], "w") as ctl:  # perf record --control: sample the steps only, not set-up or teardown
    ctl.write("enable\n")
    ctl.flush()
    for _ in range(int(sys.argv[8])):
        step()
    ctl.write("disable\n")
    ctl.flush()
'''


def perf_groups(argv: list[str], out: Path) -> tuple[dict[str, float], int]:
    """({group: samples}, total samples) of the child's steps under perf record (set-up not sampled)."""
    data, ctl = out / "perf.data", out / "ctl.fifo"
    os.mkfifo(ctl)
    subprocess.run(["perf", "record", "-q", "-e", "cpu-clock", "-D", "-1", "--control", f"fifo:{ctl}", "-o",
                    str(data), sys.executable, "-c", CHILD, *argv, str(ctl)],
                   check=True, cwd=Path(__file__).resolve().parents[1], stdout=subprocess.DEVNULL)
    report = subprocess.run(["perf", "report", "-i", str(data), "--no-children", "--sort", "dso,sym", "-g", "none",
                             "--percent-limit", "0", "--stdio", "-F", "sample,dso,sym"],
                            check=True, capture_output=True, text=True).stdout
    groups: dict[str, float] = {}
    total = 0
    for line in report.splitlines():
        if not line.strip() or line.startswith("#"):
            continue
        parts = line.split(None, 1)
        if len(parts) < 2 or not parts[0].isdigit():
            continue
        n, rest = int(parts[0]), parts[1]
        total += n
        group = next((g for g, pat in GROUPS if re.search(pat, rest)), "other")
        groups[group] = groups.get(group, 0) + n
    return groups, total


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profile_native", description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--mode", choices=("exact", "compressed"), default="exact")
    parser.add_argument("--pool-fraction", type=int, default=0,
                        help="exact mode: 0 (default) in place, ActiveKV's CPU default; F >= 1 a pool of the blocks "
                             "read per step / F")
    parser.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per block (vLLM's CPU default: 128)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--reps", type=int, default=30)
    args = parser.parse_args(argv)
    if args.pool_fraction < 0:
        parser.error(f"--pool-fraction must be 0 (in place) or at least 1, got {args.pool_fraction}")
    if args.mode == "compressed" and args.pool_fraction:
        parser.error("--pool-fraction sizes exact mode's pool; compressed mode runs in place here")
    for name in ("context", "batch", "threads", "reps"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.block_size < 1 or args.context % args.block_size:
        parser.error(f"--context {args.context} must be a positive multiple of --block-size {args.block_size}")
    if shutil.which("perf") is None:
        parser.error("perf not found (Debian package linux-perf)")
    common = [str(args.threads), str(args.context), str(args.batch), args.mode, str(args.pool_fraction), args.dtype,
              str(args.block_size)]
    with tempfile.TemporaryDirectory() as tmp:
        rows, total = perf_groups([*common, str(args.reps)], Path(tmp))
    step_total = sum(rows.values())
    given = argv if argv is not None else sys.argv[1:]
    print(f"command: `{shlex.join(['python', '-m', 'tools.profile_native', *given])}`")
    print(f"{args.mode} mode, {args.dtype}, context {args.context}, batch {args.batch}, block {args.block_size}, "
          f"{'pool 1/' + str(args.pool_fraction) if args.mode == 'exact' and args.pool_fraction else 'in place'}, "
          f"{args.threads} threads, "
          f"{args.reps} steps after one warm-up; {total} cpu-clock samples over all threads, steps only")
    print()
    print("| where | share of the steps' CPU time |")
    print("|---|---|")
    for group, n in sorted(rows.items(), key=lambda kv: -kv[1]):
        if n > 0:
            print(f"| {group} | {100 * n / step_total:.1f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
