"""Parity matrix runner: every cell of tools/parity_cells.py, native engine (ATen path) against the Python reference.

Usage::

    python -m tools.parity [--mode exact|compressed|all] [--filter SUBSTR] [--jobs N] [--out DIR]

Runs `tools.parity_cells.run_cell` (the same runner `tests/test_parity.py` uses) on every selected cell: outputs and
selected blocks per KV head at every step and layer, then telemetry counters, both KV tiers, key metadata and page
tables, all bit for bit. A cell that differs does not stop the run: its verdict is `differs` with the first differing
item (`error` when the engine or the reference raised something else). Writes `report.md` (a table: every cell, its
parameters, verdict and counters) and `report.json` (every cell: id, parameters, verdict, message, counters) under
`--out` (default `build/parity`), and prints one summary line, e.g.
`parity: 918 cells, 918 match (486 exact, 432 compressed)`.

Every cell runs with one intra-op thread (`torch.set_num_threads(1)`), in this process or in each `--jobs` worker: with
several threads the BLAS under torch's matmul may split a product differently from one call to the next, so the
engine and the reference could differ in the last bit for a reason that is not the engine's. One thread fixes each
matmul's summation order, so a difference is the engine's. `--jobs N` runs cells in N worker processes instead.

Exit status: 0 when every cell matches; 1 when any differs or errors; 2 when no cell is selected or the native module
is missing.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import multiprocessing
import platform
import shlex
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "build" / "parity"
MODES = ("exact", "compressed", "all")
VERDICTS = ("match", "differs", "error")

try:  # tools.parity_cells imports the native module; without it there is nothing to compare
    from tools.parity_cells import (Cell, Mismatch, compressed_cells, dense_cells, exact_cells, in_place_cells,
                                    run_cell)
    from tests.reference.engine import COUNTERS
except ImportError as exc:
    _IMPORT_ERROR: ImportError | None = exc
else:
    _IMPORT_ERROR = None

# Counters shown in the markdown table (report.json holds all of COUNTERS), with their column headers.
TABLE_COUNTERS = (
    ("request_rows", "rows"),
    ("tiles_computed", "tiles"),
    ("blocks_admitted", "admitted"),
    ("blocks_evicted", "evicted"),
    ("blocks_hit", "hit"),
    ("compressed_rows", "compressed rows"),
    ("compressed_context_blocks", "context blocks"),
    ("selected_blocks", "selected"),
    ("union_blocks", "union"),
)


@dataclass
class Result:
    """One cell's verdict: `match`, `differs` (message: the first differing item) or `error` (message: the
    exception). `counters` are the engine's telemetry counters at the end, or when the difference was found."""

    id: str
    params: dict[str, Any]
    verdict: str
    message: str = ""
    counters: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0


def cell_params(cell: Cell) -> dict[str, Any]:
    """The cell's parameters as plain JSON values."""
    params: dict[str, Any] = {
        "mode": cell.mode,
        "dtype": str(cell.dtype).removeprefix("torch."),
        "head_size": cell.head_size,
        "gqa": cell.gqa,
        "block_size": cell.block_size,
        "context": cell.context,
        "prompt_lens": cell.prompt_lens(),
        "decode_steps": cell.decode_steps,
        "pool": cell.pool,
        "pool_blocks": cell.pool_blocks,
        "batch": cell.batch,
        "padded": cell.padded,
    }
    if cell.mode == "compressed":
        params["budget_tokens"] = cell.budget_tokens
        params["dense_layers"] = cell.dense_layers
    return params


def _counters(snapshot: dict[str, Any]) -> dict[str, int]:
    return {k: int(snapshot[k]) for k in COUNTERS if k in snapshot}


def judge(cell: Cell) -> Result:
    """Run one cell with one intra-op thread and turn its outcome into a verdict; never raises for a cell's failure."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    start = time.perf_counter()
    try:
        snapshot = run_cell(cell)
    except Mismatch as exc:
        return Result(cell.id, cell_params(cell), "differs", str(exc), _counters(exc.snapshot),
                      time.perf_counter() - start)
    except Exception as exc:  # noqa: BLE001 - any other failure of one cell is that cell's verdict, not the run's end
        return Result(cell.id, cell_params(cell), "error", f"{type(exc).__name__}: {exc}", {},
                      time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return Result(cell.id, cell_params(cell), "match", "", _counters(snapshot), time.perf_counter() - start)


def select_cells(mode: str, substring: str | None) -> list[Cell]:
    cells = (exact_cells() if mode in ("exact", "all") else []) + (
        compressed_cells() if mode in ("compressed", "all") else [])
    cells += [c for c in in_place_cells() if mode in (c.mode, "all")]
    cells += dense_cells() if mode in ("compressed", "all") else []
    return [c for c in cells if substring is None or substring in c.id]


def _worker_init() -> None:
    torch.set_num_threads(1)


def run_all(cells: Sequence[Cell], jobs: int) -> list[Result]:
    """Judge every cell (in order), with a progress bar on stderr."""
    bar = tqdm(total=len(cells), unit="cell", desc="parity", file=sys.stderr, dynamic_ncols=True)

    def progress(results: Iterator[Result]) -> list[Result]:
        done: list[Result] = []
        for result in results:
            done.append(result)
            bad = sum(r.verdict != "match" for r in done)
            bar.set_postfix_str(f"{bad} differ" if bad else "all match", refresh=False)
            bar.update()
        return done

    try:
        if jobs <= 1:
            return progress(judge(c) for c in cells)
        # spawn, not fork: a forked child of a process that has run torch's thread pools can hang in it.
        ctx = multiprocessing.get_context("spawn")
        with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx, initializer=_worker_init) as pool:
            return progress(pool.map(judge, cells, chunksize=4))
    finally:
        bar.close()


def summary_line(results: Sequence[Result]) -> str:
    """`parity: N cells, M match[, D differ[s]][, E error[s]] (X exact, Y compressed)`."""
    verdicts = Counter(r.verdict for r in results)
    modes = Counter(r.params["mode"] for r in results)
    parts = [f"{verdicts['match']} match"]
    if verdicts["differs"]:
        parts.append(f"{verdicts['differs']} differ{'s' if verdicts['differs'] == 1 else ''}")
    if verdicts["error"]:
        parts.append(f"{verdicts['error']} error{'s' if verdicts['error'] > 1 else ''}")
    per_mode = ", ".join(f"{modes[m]} {m}" for m in ("exact", "compressed") if modes[m])
    return f"parity: {len(results)} cells, {', '.join(parts)} ({per_mode})"


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def write_reports(out: Path, results: Sequence[Result], header: dict[str, Any]) -> tuple[Path, Path]:
    """Write report.json and report.md under `out`; returns their paths."""
    out.mkdir(parents=True, exist_ok=True)
    json_path, md_path = out / "report.json", out / "report.md"
    doc = {**header, "cells": [r.__dict__ for r in results]}
    json_path.write_text(json.dumps(doc, indent=1) + "\n")

    lines = [
        "# ActiveKV parity report",
        "",
        f"{header['summary']}",
        "",
        f"- command: `{header['command']}`",
        f"- versions: {header['versions']}",
        f"- intra-op threads per cell: 1; jobs: {header['jobs']}; wall time: {header['wall_s']:.0f} s",
        "- compared bit for bit per cell: outputs and selected blocks per KV head at every step and layer; telemetry "
        "counters, host tier, pool, key min/max and page tables at the end (tools/parity_cells.py, run_cell)",
        "",
    ]
    bad = [r for r in results if r.verdict != "match"]
    if bad:
        lines += ["## Cells that do not match", ""]
        lines += [f"- `{r.id}`: **{r.verdict}**: {_md_escape(r.message)}" for r in bad]
        lines.append("")
    lines += ["## Every cell", ""]
    cols = ["#", "mode", "dtype", "head", "gqa", "block", "context", "prompt lens", "pool", "batch", "padded",
            "verdict", *(name for _, name in TABLE_COUNTERS), "ms"]
    lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for i, r in enumerate(results, 1):
        p = r.params
        pool = f"{p['pool']} ({p['pool_blocks']})"
        context = p["context"] + (f" (budget {p['budget_tokens']})" if "budget_tokens" in p else "")
        counts = [str(r.counters.get(k, "")) for k, _ in TABLE_COUNTERS]
        verdict = r.verdict if r.verdict == "match" else f"**{r.verdict}**"
        row = [str(i), p["mode"], p["dtype"], str(p["head_size"]), str(p["gqa"]), str(p["block_size"]), context,
               " ".join(map(str, p["prompt_lens"])), pool, str(p["batch"]), "yes" if p["padded"] else "no", verdict,
               *counts, f"{r.seconds * 1e3:.0f}"]
        lines.append("| " + " | ".join(row) + " |")
    md_path.write_text("\n".join(lines) + "\n")
    return md_path, json_path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.parity", description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=MODES, default="all", help="which matrix (default: all)")
    parser.add_argument("--filter", metavar="SUBSTR", help="only cells whose id contains SUBSTR, e.g. 'bfloat16-d80'")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes (default 1; each runs 1 thread)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help="report folder (default build/parity)")
    args = parser.parse_args(argv)
    if args.jobs < 1:
        parser.error(f"--jobs must be >= 1, got {args.jobs}")
    if _IMPORT_ERROR is not None:
        print(f"parity: the native module is missing ({_IMPORT_ERROR}); run `make build`", file=sys.stderr)
        return 2
    cells = select_cells(args.mode, args.filter)
    if not cells:
        print(f"parity: no cell of mode {args.mode!r} matches --filter {args.filter!r}", file=sys.stderr)
        return 2

    import activekv._backend as backend

    start = time.perf_counter()
    results = run_all(cells, args.jobs)
    wall = time.perf_counter() - start
    summary = summary_line(results)
    header = {
        "summary": summary,
        "command": shlex.join(["python", "-m", "tools.parity", *(argv if argv is not None else sys.argv[1:])]),
        "versions": f"torch {torch.__version__}, activekv {backend.__version__}, python {platform.python_version()}",
        "jobs": args.jobs,
        "wall_s": round(wall, 1),
        "verdicts": dict(Counter(r.verdict for r in results)),
    }
    md_path, json_path = write_reports(args.out, results, header)
    for r in results:
        if r.verdict != "match":
            print(f"{r.verdict}: {r.message}")
    print(summary)
    print(f"report: {md_path}, {json_path} ({wall:.0f} s)")
    return 0 if all(r.verdict == "match" for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
