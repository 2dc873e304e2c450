"""Decode attention benchmark: median milliseconds per step, printed as the markdown table of docs/benchmarks.md.

`python -m tools.bench` (what `make bench` runs). One decode step of one attention layer, for a batch of requests
that each bring one new token to a context of the row's length: 32 query heads, 8 KV heads, head size 128, float32
and bfloat16 (`--dtypes`), block size 16 (and vLLM's CPU default, 128, where a column says so), 2 threads, synthetic
seeded tensors, block tables a seeded permutation of the block ids. A step is timed through the path vLLM drives, per
column:

- ActiveKV exact (`activekv._backend.Builder`/`Impl`, called as vLLM's patched backend calls them): `build` the step
  plan, `do_kv_cache_update` the new token of every row (into the row's last slot, so the context length stays fixed),
  `forward` (admission, tiled attention). With ActiveKV's default options ("in place": no pool, the kernel reads
  vLLM's KV cache where it is, tiles of its own default size) at block 16 and, in the "block 128" column, at vLLM's
  CPU default block size (what a vLLM user gets without `block_size`); with an explicit pool of a quarter of the
  blocks a step reads ("pool=1/4", tiles of 16 blocks: every block streams through the pool every step). Attention by
  the fast CPU kernel (`kernel` "native", the default), and in the "ATen path" column by the ATen tile path (`kernel`
  "aten", the path the Python reference mirrors bit for bit), in place.
- ActiveKV compressed: the same calls with `mode=compressed`, `budget_tokens` 2048, `sink_blocks` 1, `recent_blocks`
  2, in place (the default: each decode row attends, per KV head, to its 128 selected blocks where they are in the
  KV cache; a context within the budget (2k) runs as exact mode). Also with an explicit pool of one row's worst-case
  union of selections (8 KV heads x 125 + 3 = 1003 blocks, "pool=one union", tiles of 16 blocks): the selections are
  copied into it, and at batch > 1 rows whose unions do not fit together evict each other's blocks every step. And at
  vLLM's CPU default block size in place ("block 128": budget 16 blocks, the top 13 by Quest's bound), the block size
  a vLLM user of compressed mode gets without `block_size`; Quest's bound is then kept per 128 tokens (a coarser
  choice: docs/quality.md measures quality at block 16 and 128).
- vLLM CPU_ATTN (`torch.ops._C`, as vllm/v1/attention/backends/cpu_attn.py calls it): `get_scheduler_metadata`
  (its builder's per-step work), `cpu_attn_reshape_and_cache` of the new tokens, `cpu_attention_with_kv_cache`.
  At block 16 (ISA vec16, the same geometry as ActiveKV) and at block 128, vLLM's CPU default: vLLM's CPU_ATTN
  declares kernel block sizes MultipleOf(32), so `LLM(block_size=16)` with CPU_ATTN is refused at start-up.
- SDPA: `torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)` on contiguous K/V, attention only.

Cells are median milliseconds per step. Every exact column's output is compared with SDPA's ("max diff (exact)": the
largest absolute difference over those columns), so a fast but wrong path shows. Compressed mode is approximate by
design, so its difference from SDPA is its own column ("compressed diff (approximate)": the largest absolute
difference and the relative L2 error of the batch's output, block 16 / block 128), not a correctness check: on these
random keys attention is spread evenly, the case where top-k selection is known to lose most (docs/quality.md
measures quality on a trained model). A second table gives each exact column's time over CPU_ATTN block 128's (vLLM's
CPU default; the target is at most 1.0x) and CPU_ATTN block 128's over compressed mode's at block 16 and 128; a third
the speed ratios of compressed mode (each pool and block size) against the other columns.

Timings come from `torch.utils.benchmark` (`Timer.blocked_autorange`, at `--threads` intra-op threads): per
(dtype, context, batch), CPU_ATTN block 128 (the anchor of the ratios against vLLM) is built first and kept; every
other column is built, warmed up (`--warmup` steps, which also fill a pool), timed in `--rounds` rounds (default 3)
taking turns with the anchor (so a slow spell of a noisy machine falls on both, and one column's memory at a time sits
beside the anchor's), and freed. Each round is one `blocked_autorange` of `--budget-s` / rounds seconds: the Timer
picks how many steps make a block (fast steps are timed in blocks, slow ones one by one) and repeats blocks until the
time is spent. A cell is the median over all its rounds' blocks (milliseconds per step); a ratio to the anchor divides
by the anchor's median over the rounds it took turns with that column. `--json PATH` writes every cell, its spread and
the run's provenance (command, machine, versions, commit), the data `python -m tools.docs` renders into
docs/benchmarks.md. The default run takes several minutes.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils import benchmark

NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_SIZE = 128
BLOCK_SIZE = 16
VLLM_CPU_BLOCK_SIZE = 128  # the block size vLLM gives an attention backend on CPU unless the user sets block_size
DTYPES = ("float32", "bfloat16")  # model dtypes benchmarked (--dtypes)
TILE_BLOCKS = 16  # the tile of the columns with a pool (256 tokens); in place the engine picks its own
CONTEXTS = (2048, 8192, 16384, 32768)
BATCHES = (1, 8)
MISSING = "n/a (module missing)"
# Compressed mode's options (no pool: in place, ActiveKV's default on the CPU).
COMPRESSED = {"mode": "compressed", "budget_tokens": 2048, "sink_blocks": 1, "recent_blocks": 2}

# Column headers (milliseconds per step); docs/benchmarks.md explains each. "in place": ActiveKV's default options on
# the CPU (no pool: vLLM's KV cache read where it is); "pool=": an explicit pool (placement "pool").
EXACT_DEFAULT = "ActiveKV exact in place"
EXACT_BLOCK_128 = f"ActiveKV exact block {VLLM_CPU_BLOCK_SIZE} in place"
EXACT_POOL_QUARTER = "ActiveKV exact pool=1/4"
EXACT_ATEN = "ActiveKV exact ATen path in place"
COMPRESSED_COLUMN = "ActiveKV compressed 2048 in place"
COMPRESSED_ONE_UNION = "ActiveKV compressed 2048 pool=one union"
COMPRESSED_BLOCK_128 = f"ActiveKV compressed 2048 block {VLLM_CPU_BLOCK_SIZE} in place"
CPU_ATTN_16 = "CPU_ATTN block 16"
CPU_ATTN_128 = f"CPU_ATTN block {VLLM_CPU_BLOCK_SIZE}"
SDPA = "SDPA"
COLUMNS = (EXACT_DEFAULT, EXACT_BLOCK_128, EXACT_POOL_QUARTER, EXACT_ATEN, COMPRESSED_COLUMN, COMPRESSED_ONE_UNION,
           COMPRESSED_BLOCK_128, CPU_ATTN_16, CPU_ATTN_128, SDPA)
# Columns whose output must equal attention over the whole context (within float32 rounding).
EXACT_COLUMNS = (EXACT_DEFAULT, EXACT_BLOCK_128, EXACT_POOL_QUARTER, EXACT_ATEN, CPU_ATTN_16, CPU_ATTN_128)
# Speed ratios reported per row and compressed column: (column / compressed). Above 1: compressed is that many times
# faster.
RATIO_COLUMNS = (CPU_ATTN_16, CPU_ATTN_128, EXACT_DEFAULT, SDPA)
# Ratios against vLLM: ActiveKV exact columns against vLLM's CPU default (at most 1.0x is the target), and CPU_ATTN
# against compressed mode at block 16 and 128 (above 1: compressed is faster).
VS_CPU_ATTN = (EXACT_DEFAULT, EXACT_BLOCK_128, EXACT_POOL_QUARTER, EXACT_ATEN)
COMPRESSED_VS_CPU_ATTN = (COMPRESSED_COLUMN, COMPRESSED_BLOCK_128)
# Compressed columns of the speed ratio table, with the label of their pool.
COMPRESSED_VARIANTS = ((COMPRESSED_COLUMN, "in place"), (COMPRESSED_ONE_UNION, "one union"),
                       (COMPRESSED_BLOCK_128, f"in place, block {VLLM_CPU_BLOCK_SIZE}"))


@dataclass
class Case:
    """One row's synthetic data: contexts of `context` tokens for `batch` rows, and one query token per row."""

    context: int
    batch: int
    key: torch.Tensor  # [batch * context, NUM_KV_HEADS, HEAD_SIZE], row-major by (row, position)
    value: torch.Tensor  # same as key
    query: torch.Tensor  # [batch, NUM_HEADS, HEAD_SIZE]
    seed: int

    @property
    def dtype(self) -> torch.dtype:
        return self.key.dtype

    @property
    def scale(self) -> float:
        return HEAD_SIZE**-0.5

    def block_table(self, block_size: int) -> torch.Tensor:
        """int32 [batch, context / block_size]: a seeded permutation of the block ids."""
        per_row = self.context // block_size
        gen = torch.Generator().manual_seed(self.seed + block_size)
        return torch.randperm(self.batch * per_row, generator=gen).view(self.batch, per_row).to(torch.int32)

    def slot_mapping(self, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
        """int64 [batch * context]: slot of every (row, position), in key/value row order."""
        offsets = torch.arange(block_size, dtype=torch.int64)
        return (block_table.to(torch.int64)[:, :, None] * block_size + offsets).reshape(-1)

    def last_rows(self) -> torch.Tensor:
        """Indices into key/value of each row's last position: the token a decode step writes."""
        return torch.arange(1, self.batch + 1, dtype=torch.int64) * self.context - 1

    def decode_metadata(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(query_start_loc int32 [batch + 1], seq_lens int32 [batch]) of a decode step."""
        return (torch.arange(self.batch + 1, dtype=torch.int32),
                torch.full((self.batch,), self.context, dtype=torch.int32))


def make_case(context: int, batch: int, seed: int, dtype: torch.dtype = torch.float32) -> Case:
    """Seeded float32 draws, rounded to `dtype` (so the dtypes share their values up to rounding)."""
    gen = torch.Generator().manual_seed(seed)
    shape = (batch * context, NUM_KV_HEADS, HEAD_SIZE)
    key = torch.randn(shape, generator=gen).to(dtype)
    value = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn((batch, NUM_HEADS, HEAD_SIZE), generator=gen).to(dtype)
    return Case(context, batch, key, value, query, seed)


def timed_round(step: Callable[[], None], seconds: float, threads: int) -> list[float]:
    """One round of `step`: `Timer.blocked_autorange` for at least `seconds` at `threads` intra-op threads.

    Returns milliseconds per step, one value per timed block (the Timer sizes a block so that its own overhead is
    negligible: a fast step is timed in blocks of many calls, a slow one call by call)."""
    timer = benchmark.Timer(stmt="step()", globals={"step": step}, num_threads=threads)
    measurement = timer.blocked_autorange(min_run_time=seconds)
    return [t * 1e3 for t in measurement.times]


def sdpa_column(case: Case) -> tuple[Callable[[], None], torch.Tensor]:
    """SDPA on contiguous [batch, NUM_KV_HEADS, context, HEAD_SIZE] K/V; returns (step, output [batch, H, D])."""
    kv_shape = (case.batch, case.context, NUM_KV_HEADS, HEAD_SIZE)
    k = case.key.view(kv_shape).transpose(1, 2).contiguous()
    v = case.value.view(kv_shape).transpose(1, 2).contiguous()
    q = case.query.view(case.batch, NUM_HEADS, 1, HEAD_SIZE)
    out = torch.empty_like(case.query)

    def step() -> None:
        out.copy_(torch.nn.functional.scaled_dot_product_attention(q, k, v, scale=case.scale, enable_gqa=True)
                  .view_as(out))

    return step, out


def cpu_attn_column(case: Case, block_size: int) -> tuple[Callable[[], None], torch.Tensor]:
    """vLLM's CPU_ATTN ops with their own cache layout and scheduler metadata, called as cpu_attn.py calls them."""
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(case.dtype, block_size, HEAD_SIZE, "auto")
    block_table = case.block_table(block_size)
    slots = case.slot_mapping(block_table, block_size)
    num_blocks = block_table.numel()
    # [num_blocks, num_kv_heads, block_size, 2 * head_size], split as cpu_attn.py does into K and V halves
    kv_cache = torch.zeros((num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE), dtype=case.dtype)
    key_cache, value_cache = kv_cache.view(num_blocks, NUM_KV_HEADS, 2 * block_size, HEAD_SIZE).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(case.key, case.value, key_cache, value_cache, slots, isa)
    last = case.last_rows()
    new_key, new_value, new_slots = case.key[last], case.value[last], slots[last]
    query_start_loc, seq_lens = case.decode_metadata()
    out = torch.empty_like(case.query)

    def step() -> None:
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=case.batch, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_SIZE,
            seq_lens=seq_lens, dtype=case.dtype, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1,
            isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        )
        ops.cpu_attn_reshape_and_cache(new_key, new_value, key_cache, value_cache, new_slots, isa)
        ops.cpu_attention_with_kv_cache(
            query=case.query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=case.scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=block_table, softcap=0.0, scheduler_metadata=metadata, s_aux=None,
        )

    return step, out


def activekv_layer(backend: Any, heads: int, kv_heads: int, head_size: int, dtype: torch.dtype, block_size: int,
                   num_blocks: int, max_seqs: int, options: dict[str, Any]) -> tuple[Any, Any, Any, torch.Tensor]:
    """One attention layer of ActiveKV as vLLM's patched backend makes it: (builder, impl, layer, kv_cache). The
    layer is a stand-in holding the native Impl (the patch's ActiveKVImpl); the config, what vLLM sets before it makes
    the builders (the scheduler's rows, the cache's blocks, `additional_config["activekv"]` = `options`); kv_cache,
    vLLM's per-layer view [num_blocks, kv_heads, block_size, 2 * head_size] (ActiveKV reads it as
    [num_blocks, kv_heads, 2, block_size, head_size]), zeros."""
    from types import SimpleNamespace

    spec = SimpleNamespace(block_size=block_size, num_kv_heads=kv_heads, head_size=head_size, dtype=dtype,
                           sliding_window=None)
    impl = backend.Impl(heads, head_size, head_size**-0.5, kv_heads)
    layer = SimpleNamespace(layer_name="bench.layers.0.attn", impl=SimpleNamespace(_native=impl))
    config = SimpleNamespace(model_config=SimpleNamespace(get_num_attention_heads=lambda parallel_config: heads),
                             parallel_config=None, scheduler_config=SimpleNamespace(max_num_seqs=max_seqs),
                             cache_config=SimpleNamespace(num_gpu_blocks=num_blocks),
                             compilation_config=SimpleNamespace(static_forward_context={layer.layer_name: layer}),
                             additional_config={"activekv": options})
    builder = backend.Builder(spec, [layer.layer_name], config, torch.device("cpu"))
    kv_cache = torch.zeros((num_blocks, kv_heads, block_size, 2 * head_size), dtype=dtype)
    return builder, impl, layer, kv_cache


def activekv_step(builder: Any, impl: Any, layer: Any, kv_cache: torch.Tensor, query: torch.Tensor,
                  key: torch.Tensor, value: torch.Tensor, slots: torch.Tensor, query_start_loc: torch.Tensor,
                  seq_lens: torch.Tensor, block_table: torch.Tensor) -> tuple[Callable[[], None], torch.Tensor]:
    """One step of the layer as vLLM calls it: `Builder.build` on a CommonAttentionMetadata stand-in,
    `Impl.do_kv_cache_update` of the step's new `key`/`value` into `slots`, `Impl.forward`; returns (step, out)."""
    from types import SimpleNamespace

    metadata = SimpleNamespace(query_start_loc_cpu=query_start_loc, query_start_loc=query_start_loc,
                               seq_lens=seq_lens, block_table_tensor=block_table, num_reqs=seq_lens.numel(),
                               num_actual_tokens=query.shape[0], causal=True)
    out = torch.empty_like(query)

    def step() -> None:
        plan = builder.build(0, metadata)
        impl.do_kv_cache_update(layer, key, value, kv_cache, slots)
        impl.forward(layer, query, key, value, kv_cache, plan, out)

    return step, out


def activekv_column(case: Case, backend: Any, options: dict[str, Any],
                    block_size: int = BLOCK_SIZE) -> tuple[Callable[[], None], torch.Tensor]:
    """ActiveKV through its vLLM-facing objects (activekv_layer, activekv_step) for one decode step, with the KV
    cache in blocks of `block_size` tokens. `options` go to `additional_config["activekv"]` as they are."""
    block_table = case.block_table(block_size)
    slots = case.slot_mapping(block_table, block_size)
    builder, impl, layer, kv_cache = activekv_layer(
        backend, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, case.dtype, block_size, block_table.numel(), case.batch,
        options)
    impl.do_kv_cache_update(layer, case.key, case.value, kv_cache, slots)
    last = case.last_rows()
    query_start_loc, seq_lens = case.decode_metadata()
    return activekv_step(builder, impl, layer, kv_cache, case.query, case.key[last], case.value[last], slots[last],
                         query_start_loc, seq_lens, block_table)


def pool_options(case: Case, pool_fraction: int, block_size: int = BLOCK_SIZE) -> dict[str, Any]:
    """Exact mode with a pool of the blocks (of `block_size` tokens) one step reads, divided by `pool_fraction` (at
    least one tile), tiles of TILE_BLOCKS."""
    num_blocks = case.batch * case.context // block_size
    return {"mode": "exact", "pool_blocks": max(TILE_BLOCKS, num_blocks // pool_fraction), "tile_blocks": TILE_BLOCKS}


def worst_case_union_blocks(block_size: int = BLOCK_SIZE) -> int:
    """One row's worst-case union of selections at `block_size`: num_kv_heads * k + sink + recent blocks, k = budget
    blocks - sink - recent (compressed mode's pool with placement "pool" and no pool_blocks is this per scheduler
    row, capped at the KV cache's blocks)."""
    k = COMPRESSED["budget_tokens"] // block_size - COMPRESSED["sink_blocks"] - COMPRESSED["recent_blocks"]
    return NUM_KV_HEADS * k + COMPRESSED["sink_blocks"] + COMPRESSED["recent_blocks"]


def machine_info() -> dict[str, Any]:
    """The processor (lscpu's model name), the cores and the load average at start, and the line the bench prints."""
    model = platform.processor() or "unknown CPU"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), model)
    except (OSError, subprocess.CalledProcessError):
        pass
    load = [round(x, 2) for x in os.getloadavg()]
    line = (f"{model}, nproc {os.cpu_count()}, load average {', '.join(f'{x:.2f}' for x in load)} at start (other "
            "work on the machine skews the timings)")
    return {"cpu": model, "nproc": os.cpu_count(), "load_average": load, "line": line}


def cpu_attn_isas(dtypes: Sequence[torch.dtype]) -> str:
    """The ISA vLLM's CPU_ATTN picks per dtype at block 16 / 128 (as cpu_attn.py's _get_attn_isa decides)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return ", ".join(f"{str(t).removeprefix('torch.')} {_get_attn_isa(t, 16, HEAD_SIZE, 'auto')} / "
                     f"{_get_attn_isa(t, VLLM_CPU_BLOCK_SIZE, HEAD_SIZE, 'auto')}" for t in dtypes)


def load_backend() -> tuple[Any | None, str]:
    """(activekv._backend, version) or (None, why)."""
    try:
        import activekv._backend as backend
    except ImportError as exc:
        return None, f"missing ({exc})"
    return backend, str(getattr(backend, "__version__", "unknown"))


def column_makers(case: Case, backend: Any | None) -> dict[str, Callable[[], tuple[Callable[[], None], torch.Tensor]]
                                                          | None]:
    """Per column: a function that builds (step, output), or None when the column does not run (module missing)."""
    akv = backend is not None
    return {
        EXACT_DEFAULT: (lambda: activekv_column(case, backend, {"mode": "exact"})) if akv else None,
        EXACT_BLOCK_128: (lambda: activekv_column(case, backend, {"mode": "exact"}, VLLM_CPU_BLOCK_SIZE))
        if akv else None,
        EXACT_POOL_QUARTER: (lambda: activekv_column(case, backend, pool_options(case, 4))) if akv else None,
        EXACT_ATEN: (lambda: activekv_column(case, backend, {"mode": "exact", "kernel": "aten"})) if akv else None,
        COMPRESSED_COLUMN: (lambda: activekv_column(case, backend, COMPRESSED)) if akv else None,
        COMPRESSED_ONE_UNION: (lambda: activekv_column(
            case, backend, {**COMPRESSED, "pool_blocks": worst_case_union_blocks(), "tile_blocks": TILE_BLOCKS}))
        if akv else None,
        COMPRESSED_BLOCK_128: (lambda: activekv_column(case, backend, COMPRESSED, VLLM_CPU_BLOCK_SIZE))
        if akv else None,
        CPU_ATTN_16: lambda: cpu_attn_column(case, 16),
        CPU_ATTN_128: lambda: cpu_attn_column(case, VLLM_CPU_BLOCK_SIZE),
        SDPA: lambda: sdpa_column(case),
    }


def run(dtypes: Sequence[torch.dtype], contexts: Sequence[int], batches: Sequence[int], warmup: int, budget_s: float,
        rounds: int, threads: int, seed: int) -> list[dict[str, Any]]:
    """Benchmark every (dtype, context, batch); returns one row per case: each column's median ms per step, its spread
    and number of timed blocks, the anchor's median over the rounds it took turns with each column, and the outputs'
    differences from SDPA.

    Per (dtype, context, batch), CPU_ATTN block 128 (the anchor every ratio against vLLM is taken to) is built first
    and kept; every other column is then built, warmed up, timed in `rounds` rounds taking turns with the anchor (so a
    slow spell of a noisy machine falls on both), and freed before the next (one column's cache and pool at a time
    beside the anchor's: all of them together outgrow 24 GiB at 32k, batch 8)."""
    backend, _ = load_backend()
    rows: list[dict[str, Any]] = []
    for dtype, context, batch in ((t, c, b) for t in dtypes for c in contexts for b in batches):
        case = make_case(context, batch, seed, dtype)
        makers = column_makers(case, backend)
        outputs: dict[str, torch.Tensor] = {}
        cells: dict[str, dict[str, float]] = {}
        anchor, outputs[CPU_ATTN_128] = makers.pop(CPU_ATTN_128)()
        for _ in range(warmup):
            anchor()
        anchor_times: list[float] = []
        for name, make in makers.items():
            if make is None:
                continue
            step, outputs[name] = make()
            for _ in range(warmup):
                step()
            times: list[float] = []
            with_column: list[float] = []
            for _ in range(rounds):
                times += timed_round(step, budget_s / rounds, threads)
                with_column += timed_round(anchor, budget_s / rounds, threads)
            del step  # frees this column's cache and pool before the next one is built
            cells[name] = summary(times) | {"anchor_ms": statistics.median(with_column)}
            anchor_times += with_column
        cells[CPU_ATTN_128] = summary(anchor_times)
        del anchor
        reference = outputs[SDPA]

        def diff(name: str) -> float:
            return (outputs[name] - reference).abs().max().item()

        row: dict[str, Any] = {
            "dtype": str(dtype).removeprefix("torch."), "context": context, "batch": batch, "cells": cells,
            "max_diff_exact": max(diff(name) for name in EXACT_COLUMNS if name in outputs),
            # per compressed block size: the largest difference from SDPA and the relative L2 error
            "compressed_diff": {name: {"max": diff(name),
                                       "rel": ((outputs[name] - reference).norm() / reference.norm()).item()}
                                for name in COMPRESSED_VS_CPU_ATTN if name in outputs}}
        rows.append(row)
        del case, outputs, reference
    return rows


def summary(times: list[float]) -> dict[str, float]:
    """A cell: the median ms per step over its timed blocks, their interquartile range, how many blocks."""
    q1, _, q3 = statistics.quantiles(times, n=4) if len(times) > 1 else (times[0], None, times[0])
    return {"ms": statistics.median(times), "iqr_ms": q3 - q1, "blocks": len(times)}


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(header) + " |", "|" + "---|" * len(header), *("| " + " | ".join(r) + " |" for r in rows)]


def _label(row: dict[str, Any]) -> list[str]:
    return [row["dtype"], f"{row['context'] / 1024:g}k", str(row["batch"])]


def main_table(result: dict[str, Any]) -> list[str]:
    """Median ms per step of every column, and the outputs' differences from SDPA, one line per case."""
    lines = []
    for row in result["rows"]:
        cells = row["cells"]
        shown = [f"{cells[c]['ms']:.2f}" if c in cells else MISSING for c in COLUMNS]
        approximate = " / ".join(f"max {d['max']:.1e}, rel {d['rel']:.1e}" for d in row["compressed_diff"].values())
        lines.append([*_label(row), *shown, f"{row['max_diff_exact']:.1e}", approximate or MISSING])
    return _table(["dtype", "context", "batch", *COLUMNS, "max diff (exact)", "compressed diff (approximate)"], lines)


def vs_cpu_attn_table(result: dict[str, Any]) -> list[str]:
    """Each ActiveKV exact column's ms over CPU_ATTN block 128's, and CPU_ATTN block 128's over compressed mode's,
    CPU_ATTN's each time its median over the rounds it took turns with that column."""
    lines = []
    for row in result["rows"]:
        cells = row["cells"]
        vs = [f"{cells[c]['ms'] / cells[c]['anchor_ms']:.2f}x" if c in cells else MISSING for c in VS_CPU_ATTN]
        vs += [f"{cells[c]['anchor_ms'] / cells[c]['ms']:.2f}x" if c in cells else MISSING
               for c in COMPRESSED_VS_CPU_ATTN]
        lines.append([*_label(row), *vs])
    return _table(["dtype", "context", "batch", *(f"{c} / {CPU_ATTN_128}" for c in VS_CPU_ATTN),
                   *(f"{CPU_ATTN_128} / {c}" for c in COMPRESSED_VS_CPU_ATTN)], lines)


def compressed_ratio_table(result: dict[str, Any]) -> list[str]:
    """Per compressed column (pool and block size): each of RATIO_COLUMNS' ms over compressed mode's."""
    lines = []
    for row in result["rows"]:
        cells = row["cells"]
        for variant, pool in COMPRESSED_VARIANTS:
            if variant in cells:
                lines.append([*_label(row), pool, *(f"{cells[c]['ms'] / cells[variant]['ms']:.2f}x"
                                                    for c in RATIO_COLUMNS)])
    return _table(["dtype", "context", "batch", "compressed", *(f"{c} / compressed" for c in RATIO_COLUMNS)],
                  lines)


def setup_line(result: dict[str, Any]) -> str:
    setup = result["setup"]
    return (f"decode (1 query token per row), {NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head size "
            f"{HEAD_SIZE}, {' and '.join(setup['dtypes'])} (CPU_ATTN ISA {setup['cpu_attn_isa']}; ActiveKV CPU kernel "
            f"{setup['activekv_kernel']}), ActiveKV block {BLOCK_SIZE} (and {VLLM_CPU_BLOCK_SIZE} where named), in "
            f"place with its default tiles, with a pool tiles of {TILE_BLOCKS} blocks, compressed budget "
            f"{COMPRESSED['budget_tokens']} tokens / sink {COMPRESSED['sink_blocks']} / recent "
            f"{COMPRESSED['recent_blocks']} / pool=one union {worst_case_union_blocks()} blocks, "
            f"{setup['threads']} threads; median ms per step of one "
            f"layer, torch.utils.benchmark blocked_autorange, {setup['budget_s']:g} s per cell in {setup['rounds']} "
            f"rounds (each column taking turns with {CPU_ATTN_128}); seed {setup['seed']}")


def markdown(result: dict[str, Any]) -> str:
    """The run as the bench prints it: provenance lines, then the three tables."""
    out = [f"command: `{result['command']}`", f"machine: {result['machine']['line']}",
           "versions: " + ", ".join(f"{k} {v}" for k, v in result["versions"].items()),
           f"setup: {setup_line(result)}; run took {result['elapsed_s']:.0f} s", "", *main_table(result)]
    out += ["", f"ActiveKV exact against vLLM's CPU default (column's ms / {CPU_ATTN_128} ms; at most 1.00x: as fast "
            f"or faster), and {CPU_ATTN_128} / compressed at block 16 and {VLLM_CPU_BLOCK_SIZE} (above 1: compressed "
            "is faster):", "", *vs_cpu_attn_table(result)]
    ratios = compressed_ratio_table(result)
    if len(ratios) > 2:
        out += ["", "Speed ratios (column's ms / compressed ms; above 1: compressed is faster):", "", *ratios]
    return "\n".join(out) + "\n"


def write_json(path: Path, result: dict[str, Any]) -> None:
    """A bench's rows and provenance as JSON (docs/data/ holds the committed ones), its folder made if missing."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")


def git_commit() -> str:
    """The checkout's commit, with `-dirty` when tracked files differ from it ("unknown" outside git)."""
    try:
        return subprocess.run(["git", "describe", "--always", "--dirty", "--abbrev=12"], capture_output=True,
                              text=True, check=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, default=list(DTYPES), help="model dtypes")
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="tokens per row")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="rows (requests) per step")
    parser.add_argument("--threads", type=int, default=2, help="intra-op threads (torch and the Timer)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps before a column's first round")
    parser.add_argument("--budget-s", type=float, default=1.0,
                        help="seconds of timed steps per cell, split over the rounds (the Timer's min_run_time)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rounds", type=int, default=3,
                        help=f"rounds per (dtype, context, batch), each column taking turns with {CPU_ATTN_128}")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the run (cells and provenance) as JSON")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.warmup < 0 or not 0 <= args.budget_s < math.inf or args.threads < 1:
        parser.error(f"--warmup and --budget-s must be at least 0 (--budget-s finite), --threads at least 1, got "
                     f"{args.warmup}, {args.budget_s} and {args.threads}")
    for n in args.contexts:
        if n < 128 or n % 128:
            parser.error(f"context {n} must be a positive multiple of 128 (whole blocks at block sizes 16 and 128)")
    for n in args.batches:
        if n < 1:
            parser.error(f"batch {n} must be at least 1")

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep vLLM's import-time logging out of the table
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import vllm

    akv_backend, akv_version = load_backend()
    akv_capability = akv_backend.cpu_kernel_capability() if akv_backend is not None else MISSING
    if akv_backend is not None and akv_backend.cpu_kernel_amx():
        akv_capability += ", bfloat16 on AMX"
    machine = machine_info()
    started = time.perf_counter()
    dtypes = [getattr(torch, name) for name in args.dtypes]
    rows = run(dtypes, args.contexts, args.batches, args.warmup, args.budget_s, args.rounds, args.threads, args.seed)
    result = {
        "tool": "tools.bench",
        "command": shlex.join(["python", "-m", "tools.bench", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "machine": machine,
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "activekv": akv_version,
                     "python": platform.python_version()},
        "setup": {"dtypes": args.dtypes, "threads": args.threads, "warmup": args.warmup, "budget_s": args.budget_s,
                  "rounds": args.rounds, "seed": args.seed, "cpu_attn_isa": cpu_attn_isas(dtypes),
                  "activekv_kernel": akv_capability},
        "columns": list(COLUMNS), "elapsed_s": time.perf_counter() - started, "rows": rows}
    print(markdown(result), end="")
    if args.json is not None:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
