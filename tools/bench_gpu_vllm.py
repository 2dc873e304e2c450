"""vLLM decode on a CUDA device: stock TRITON_ATTN against ActiveKV, per-step attention time beside tokens/s.

    python -m tools.bench_gpu_vllm [--out DIR] [--budget-s S] [--contexts N ...] [--batches N ...] [--steps N]
                                   [--configs NAME ...] [--max-case-tokens N] [--streamed-tile {half,pool}]
                                   [--models DIR]

Run it inside the vLLM-on-GPU harness, which installs the pack and sets vLLM's environment: `make gpu-vllm-bench
GPU_OUT=DIR` on the device, or `make gpu-vllm-check GPU_OUT=DIR GPU_VLLM_ARGS=--bench` after the end-to-end tests
(tools/gpu_vllm_check.py). vLLM runs in this process and eagerly, with tests/test_gpu_vllm.py's settings
(tools.vllm_run.GPU_EAGER_SETTINGS), in bfloat16 with KV blocks of 16 tokens, prefix caching off.

Configurations (CONFIGS), each a fresh engine: stock TRITON_ATTN with the KV cache on the device; ActiveKV exact with
the KV cache in pinned host memory and a device pool per layer that holds every block of the batch; ActiveKV exact
streaming through a pool of 1/8 of one row's context (one engine per context; 1/8 of the contexts at batch 1, 1/64 at
batch 8: the pool is smaller than the blocks a step reads, so in LRU order every block crosses the bus at every step
either way); ActiveKV compressed (budget 2048 tokens per KV head, its default pool).

Per context, one prefill serves both batches: `batch` requests of `context` prompt tokens are submitted together and
prefilled in one step (max_num_batched_tokens holds them); all but one stop after steps + 1 decode steps, the last one
decodes steps + 1 more alone. The first decode step at each batch size is a warm-up; each figure is the median of the
other `steps`. A step is one LLMEngine.step() (schedule, one forward, sampling; synchronous), timed by the wall clock:
tokens/s = batch / step time. Attention per step: CUDA events around every attention layer's forward (vLLM's KV-cache
update and the backend's forward: ActiveKV's admission, transfers and host work included; the metadata builder runs
before the model and is not), summed over the layers: the time attention holds the stream. Model forward: events
around the model's forward; the rest of a step (scheduling, inputs, metadata, logits, sampling) is outside it.
Streaming: ActiveKV's telemetry counts the host-to-device bytes of each step; over that step's attention time, against
one pinned host-to-device copy of 256 MiB timed with CUDA events at the start of the run (and again at the end).

The model: a random Llama made here with transformers (vocab 512, hidden 256), by default 4 layers of 8 query heads
and 8 KV heads of size 128 (16 KiB of K and V per token). One query head per KV head because ActiveKV prefills on CUDA
with its ATen tile path, whose cost grows with query heads x context^2 (its float32 score traffic puts it near 1 s per
32k prompt for this model: an estimate, the run measures it), while decode reads grow with KV heads: this geometry
gives the most decode KV per second of prefill. Stock
TRITON_ATTN's step-time breakdown at 32k, batch 8 is measured on this model and on a second one with Llama-3-8B's KV
bytes per token (16 layers of 16 query and 16 KV heads of 128: 128 KiB), stock only (its Triton prefill is cheap).

Budget: every engine and context is projected before it starts (engine start-up, prefill at the rate measured so far
for its backend, decode steps) and skipped, with the reason, when it would end past --budget-s from this process's
start; a running case aborts its requests once --budget-s + GRACE_S has passed. Cases whose batch x context exceeds
--max-case-tokens are not run (their prefill alone would not fit): 128k at batch 8 by default. A failing case records
its error and the run goes on. Order: TRITON_ATTN at every context, ActiveKV at 8k and 32k (exact resident, streamed,
compressed), the breakdown model, then ActiveKV at 128k, one engine each, while the budget holds.

Writes OUT/bench_gpu_vllm.json after every case (rows, settings, device, versions, the bus) and prints the tables at
the end. Committed as docs/data/bench_gpu_vllm.json it is what `python -m tools.docs` renders into docs/benchmarks.md
("vLLM end to end, GPU"). Exit 0 when at least one case was measured, 1 when none was, 2 without a CUDA device.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
JSON_NAME = "bench_gpu_vllm.json"
BLOCK = 16
VOCAB = 512
KV_DTYPE_BYTES = 2  # bfloat16
DEFAULT_CONTEXTS = (8192, 32768, 131072)
DEFAULT_BATCHES = (1, 8)
DEFAULT_STEPS = 8
DEFAULT_BUDGET_S = 160.0
GRACE_S = 15.0  # a running case aborts its requests this long after the budget
DEFAULT_MAX_CASE_TOKENS = 262144  # batch x context: 32k at batch 8; 128k at batch 1 only
SHARED_MAX_CONTEXT = 32768  # ActiveKV engines serve contexts up to this together; a longer one gets its own, run last
BREAKDOWN = (32768, 8)  # (context, batch) of the step-time breakdown
BUS_BYTES = 256 << 20
TRITON = "TRITON_ATTN"
ACTIVEKV = "ACTIVEKV"
COMPRESSED_BUDGET = 2048


@dataclass(frozen=True)
class ModelSpec:
    """A random Llama: `layers` decoder layers of `heads` query and `kv_heads` KV heads of `head_size`."""

    layers: int
    heads: int
    kv_heads: int
    head_size: int
    hidden: int = 256
    intermediate: int = 512

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one token over every layer, bfloat16."""
        return self.layers * 2 * self.kv_heads * self.head_size * KV_DTYPE_BYTES

    def short(self) -> str:
        return f"{self.layers} layers, {self.heads} query / {self.kv_heads} KV heads of {self.head_size}"

    def describe(self) -> str:
        return f"{self.short()}, hidden {self.hidden}, bfloat16: {self.kv_bytes_per_token // 1024} KiB of KV per token"


MAIN_MODEL = ModelSpec(layers=4, heads=8, kv_heads=8, head_size=128)
HEAVY_MODEL = ModelSpec(layers=16, heads=16, kv_heads=16, head_size=128)  # Llama-3-8B's 128 KiB of KV per token


@dataclass(frozen=True)
class Config:
    key: str
    label: str
    backend: str
    what: str
    model: str = "main"


CONFIGS: dict[str, Config] = {c.key: c for c in (
    Config("triton", "TRITON_ATTN", TRITON, "stock vLLM: its Triton attention, the KV cache on the device"),
    Config("exact-resident", "ActiveKV exact, pool holds the batch", ACTIVEKV,
           "the KV cache in pinned host memory; a device pool per layer holding every block of the batch, so each "
           "step's decode rows are attended in one launch"),
    Config("exact-streamed", "ActiveKV exact, pool 1/8 of a row", ACTIVEKV,
           "the KV cache in pinned host memory; a device pool per layer of 1/8 of one row's context (tiles of half "
           "the pool): every block crosses the pinned bus at every step"),
    Config("compressed", f"ActiveKV compressed {COMPRESSED_BUDGET}", ACTIVEKV,
           f"the KV cache in pinned host memory; each decode row attends {COMPRESSED_BUDGET} tokens per KV head (1 "
           "sink, 2 recent blocks, the top blocks by Quest's bound) through the default pool"),
    Config("triton-heavy", "TRITON_ATTN, 128 KiB KV/token", TRITON,
           "the breakdown only (32k, batch 8): stock vLLM on a model with Llama-3-8B's KV bytes per token",
           model="heavy"),
)}
DEFAULT_CONFIGS = tuple(CONFIGS)

# Projection defaults until the run has measured its own: seconds per prefill score element (query heads x context^2
# x layers per prompt: ActiveKV's ATen tile path computes every query row against every key tile in float32; the
# Triton kernel is bound by its FLOPs) and engine start-up (the first one also imports and JIT-compiles).
DEFAULT_PREFILL_S_PER_ELEMENT = {TRITON: 3e-12, ACTIVEKV: 40e-12}
DEFAULT_FIRST_START_S = 30.0
DECODE_STEP_S = 0.05  # projection of a non-streaming decode step


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else str(tokens)


# --- the plan -----------------------------------------------------------------------------------------------------

def case_grid(contexts: Iterable[int], batches: Iterable[int], max_case_tokens: int
              ) -> tuple[list[tuple[int, tuple[int, ...]]], list[tuple[int, int]]]:
    """([(context, batches it runs, largest first)], [(context, batch) not run: batch x context > max_case_tokens]),
    contexts in increasing order; a context with no batch left is absent from the first list."""
    runs, capped = [], []
    for ctx in sorted(set(contexts)):
        kept = tuple(sorted((b for b in set(batches) if b * ctx <= max_case_tokens), reverse=True))
        capped += [(ctx, b) for b in sorted(set(batches)) if b * ctx > max_case_tokens]
        if kept:
            runs.append((ctx, kept))
    return runs, capped


def request_tokens(batches: Sequence[int], steps: int) -> list[int]:
    """max_tokens of each of a context's requests (request i of max(batches)): the token its prefill samples, then
    steps + 1 decode steps for each batch size larger than i (the batches run largest first)."""
    order = sorted(batches, reverse=True)
    return [1 + sum(steps + 1 for b in order if b > i) for i in range(order[0])]


def kv_blocks(context: int, batches: Sequence[int], steps: int) -> int:
    """KV blocks a context's requests hold at their longest."""
    return sum(-(-(context + n) // BLOCK) for n in request_tokens(batches, steps))


@dataclass
class EnginePlan:
    """One vLLM engine: a configuration, the model it runs, and the contexts it decodes in order."""

    config: str
    contexts: list[tuple[int, tuple[int, ...]]]
    spec: ModelSpec
    steps: int
    streamed_tile: str = "half"  # exact-streamed's tiles: half its pool, or the whole pool (STREAMED_TILES)

    @property
    def backend(self) -> str:
        return CONFIGS[self.config].backend

    @property
    def blocks(self) -> int:
        """Blocks of the KV cache: the largest context's requests, and 16 to spare (vLLM keeps block 0)."""
        return max(kv_blocks(c, b, self.steps) for c, b in self.contexts) + 16

    @property
    def kv_cache_bytes(self) -> int:
        return self.blocks * BLOCK * self.spec.kv_bytes_per_token

    @property
    def max_model_len(self) -> int:
        longest = max(c + max(request_tokens(b, self.steps)) for c, b in self.contexts)
        return -(-longest // BLOCK) * BLOCK + BLOCK

    @property
    def max_num_seqs(self) -> int:
        return max(max(b) for _, b in self.contexts)

    @property
    def max_num_batched_tokens(self) -> int:
        """Every request of a context prefilled in one step."""
        return max(self.max_model_len, max(max(b) * c for c, b in self.contexts))

    def activekv_options(self) -> dict[str, Any] | None:
        if self.config == "exact-resident":
            return {"mode": "exact", "pool_blocks": self.blocks}
        if self.config == "exact-streamed":
            [(ctx, _)] = self.contexts
            pool = streamed_pool_blocks(ctx)
            return {"mode": "exact", "pool_blocks": pool,
                    "tile_blocks": streamed_tile_blocks(pool, whole=self.streamed_tile == "pool")}
        if self.config == "compressed":
            return {"mode": "compressed", "budget_tokens": COMPRESSED_BUDGET, "sink_blocks": 1, "recent_blocks": 2}
        return None

    def describe(self) -> str:
        contexts = ", ".join(f"{_k(c)} (batch {'/'.join(map(str, b))})" for c, b in self.contexts)
        return f"{self.config}: {contexts}"


def streamed_pool_blocks(context: int) -> int:
    """1/8 of one row's context, in blocks."""
    return max(2, -(-context // BLOCK) // 8)


STREAMED_TILES = ("half", "pool")  # --streamed-tile


def streamed_tile_blocks(pool_blocks: int, whole: bool = False) -> int:
    """Half the pool (or with `whole` the whole pool), at most 256 blocks (tools/bench_gpu.py's streamed tile)."""
    return max(1, min(256, pool_blocks if whole else pool_blocks // 2))


def plan_engines(contexts: Sequence[int], batches: Sequence[int], configs: Sequence[str], steps: int,
                 max_case_tokens: int, main: ModelSpec = MAIN_MODEL, heavy: ModelSpec = HEAVY_MODEL,
                 shared_max_context: int = SHARED_MAX_CONTEXT,
                 streamed_tile: str = "half") -> tuple[list[EnginePlan], list[tuple[int, int]]]:
    """The engines in the order they run, and the (context, batch) pairs not run (over max_case_tokens).

    TRITON_ATTN first with every context; the ActiveKV configurations at contexts up to shared_max_context (exact
    resident and compressed one engine each, streamed one per context); the breakdown model; then each longer context
    of each ActiveKV configuration on an engine of its own (streamed first), so that what the budget cuts is last."""
    runs, capped = case_grid(contexts, batches, max_case_tokens)
    first: list[EnginePlan] = []
    last: list[EnginePlan] = []
    heavy_plan = None
    for key in (k for k in CONFIGS if k in configs):
        if key == "triton-heavy":
            heavy_plan = EnginePlan(key, [(BREAKDOWN[0], (BREAKDOWN[1],))], heavy, steps)
            continue
        if not runs:
            continue
        if key == "triton":
            first.append(EnginePlan(key, list(runs), main, steps))
            continue
        short = [r for r in runs if r[0] <= shared_max_context]
        long = [r for r in runs if r[0] > shared_max_context]
        if key == "exact-streamed":
            first += [EnginePlan(key, [r], main, steps, streamed_tile) for r in short]
        elif short:
            first.append(EnginePlan(key, short, main, steps))
        last += [EnginePlan(key, [r], main, steps, streamed_tile) for r in long]
    rank = {"exact-streamed": 0, "exact-resident": 1, "compressed": 2}
    last.sort(key=lambda p: (p.contexts[0][0], rank[p.config]))
    return first + ([heavy_plan] if heavy_plan else []) + last, capped


# --- the budget ---------------------------------------------------------------------------------------------------

@dataclass
class Rates:
    """What the run has measured so far, for projecting the rest."""

    starts: list[float] = field(default_factory=list)
    prefill_s_per_element: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_PREFILL_S_PER_ELEMENT))
    measured_context: dict[str, int] = field(default_factory=dict)

    def start_s(self) -> float:
        """The slowest engine start-up after the first (which also set up CUDA and vLLM's first-time state), or the
        first while it is the only one."""
        if not self.starts:
            return DEFAULT_FIRST_START_S
        later = self.starts[1:] or self.starts
        return max(later)

    def record_prefill(self, backend: str, context: int, prompts: int, spec: ModelSpec, seconds: float) -> None:
        """Keep ActiveKV's rate from the longest context prefilled so far (a shorter one's fixed costs make it an
        overestimate: the projection errs towards skipping). TRITON_ATTN keeps its default: its first prefill includes
        the Triton kernels' compilation, and it is cheap anyway."""
        if backend == ACTIVEKV and context >= self.measured_context.get(backend, 0):
            self.measured_context[backend] = context
            self.prefill_s_per_element[backend] = seconds / score_elements(context, prompts, spec)


def score_elements(context: int, prompts: int, spec: ModelSpec) -> float:
    """Prefill attention scores of `prompts` prompts of `context` tokens: query heads x context^2 x layers each."""
    return float(prompts) * spec.heads * context * context * spec.layers


def project_context_s(plan: EnginePlan, context: int, batches: Sequence[int], rates: Rates, bus_GBps: float) -> float:
    """Seconds one context of `plan` is expected to take: prefill, decode steps, a second of slack."""
    prompts = max(batches)
    prefill = rates.prefill_s_per_element[plan.backend] * score_elements(context, prompts, plan.spec)
    per_step = DECODE_STEP_S
    if plan.config == "exact-streamed":  # every block crosses the bus each step; assume half its rate
        per_step += prompts * context * plan.spec.kv_bytes_per_token / (0.5 * bus_GBps * 1e9)
    return prefill + (plan.steps + 1) * len(batches) * per_step + 1.0


class Clock:
    """Seconds since `start`; the budget's deadline, and the hard one a running case aborts at."""

    def __init__(self, budget_s: float, start: float | None = None) -> None:
        self.start = time.monotonic() if start is None else start
        self.budget_s = budget_s

    def elapsed(self) -> float:
        return time.monotonic() - self.start

    def left(self) -> float:
        return self.budget_s - self.elapsed()

    def past_hard_deadline(self) -> bool:
        return self.elapsed() > self.budget_s + GRACE_S


# --- one context's steps, summarised ------------------------------------------------------------------------------

@dataclass
class StepRecord:
    """One LLMEngine.step(): wall time, requests unfinished before it, request outputs it returned, whether some
    request had not yet sampled its first token (a prefill step), the attention and model-forward event times (ms)
    and the change of ActiveKV's telemetry counters (None for stock vLLM)."""

    wall_s: float
    running: int
    outputs: int
    prefill: bool
    attention_ms: float
    forward_ms: float | None
    attention_calls: int
    telemetry: dict[str, int] | None = None


TELEMETRY_PER_STEP = ("bytes_h2d", "blocks_admitted", "blocks_hit", "forward_calls", "decode_batch_rows",
                      "selected_blocks", "compressed_context_blocks", "compressed_rows", "bytes_d2h")


def _median(values: Iterable[float]) -> float:
    return float(statistics.median(list(values)))


def summarise(records: Sequence[StepRecord], batches: Sequence[int], bus_GBps: float | None,
              kv_heads: int = 1) -> list[dict[str, Any]]:
    """One row per batch size from a context's step records: the prefill (the steps before every request sampled its
    first token, shared by the rows), then the decode steps whose outputs were every unfinished request at that batch
    size, the first of them dropped as the warm-up, medians of the rest. A batch size without such steps gets
    status "error". Attention is None when no attention layer was timed; the streamed rate (h2d_GBps, bus_fraction)
    is each step's host-to-device bytes over its attention time, median; compressed rows also give the blocks a
    decode row attends per KV head against its context's blocks."""
    pre = [r for r in records if r.prefill]
    shared = {"prefill_s": sum(r.wall_s for r in pre), "prefill_steps": len(pre),
              "prefill_attention_s": sum(r.attention_ms for r in pre) / 1e3, "prefill_prompts": max(batches)}
    rows = []
    for batch in sorted(batches, reverse=True):
        steps = [r for r in records if not r.prefill and r.outputs == r.running == batch][1:]
        row: dict[str, Any] = {"batch": batch, **shared}
        if not steps:
            rows.append({**row, "status": "error", "error": f"no decode step at batch {batch} after the warm-up"})
            continue
        step_ms = [r.wall_s * 1e3 for r in steps]
        attention = [r.attention_ms for r in steps]
        row.update({
            "status": "ok", "steps_timed": len(steps), "step_ms": _median(step_ms), "step_ms_min": min(step_ms),
            "step_ms_max": max(step_ms), "tokens_per_s": batch / (_median(step_ms) / 1e3),
            "attention_ms": _median(attention), "attention_calls_per_step": _median(r.attention_calls for r in steps),
        })
        if row["attention_calls_per_step"] == 0:
            row["attention_ms"] = None
        row["attention_share"] = None if row["attention_ms"] is None else row["attention_ms"] / row["step_ms"]
        forward = [r.forward_ms for r in steps if r.forward_ms is not None]
        row["forward_ms"] = _median(forward) if forward else None
        tel = [r.telemetry for r in steps if r.telemetry is not None]
        if tel:
            row["telemetry_per_step"] = {k: _median(t.get(k, 0) for t in tel) for k in TELEMETRY_PER_STEP}
            rates = [t.get("bytes_h2d", 0) / (r.attention_ms / 1e3) / 1e9 for t, r in zip(tel, steps, strict=True)
                     if r.attention_ms > 0]
            row["h2d_GBps"] = _median(rates) if rates else None
            row["bus_fraction"] = row["h2d_GBps"] / bus_GBps if row["h2d_GBps"] is not None and bus_GBps else None
            per = row["telemetry_per_step"]
            if per["compressed_rows"] > 0:
                row["selected_blocks_per_head"] = per["selected_blocks"] / per["compressed_rows"] / kv_heads
                row["context_blocks_per_row"] = per["compressed_context_blocks"] / per["compressed_rows"]
        rows.append(row)
    return rows


# --- tables -------------------------------------------------------------------------------------------------------

def _f(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def _note(row: dict[str, Any], limit: int = 110) -> str:
    text = row.get("error") or row.get("reason") or ""
    text = " ".join(str(text).split()).replace("|", "/")
    return text if len(text) <= limit else text[:limit - 3] + "..."


def sorted_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    order = {k: i for i, k in enumerate(CONFIGS)}
    return sorted(result["cases"], key=lambda r: (r["context"], r["batch"], order.get(r["config"], 99)))


def results_table(result: dict[str, Any]) -> list[str]:
    """Every case: tokens/s, step and attention time, attention over TRITON_ATTN's at the same context and batch,
    the streamed bytes' rate over the pinned bus, the prefill, and why a case has no figures."""
    triton = {(r["context"], r["batch"]): r for r in result["cases"]
              if r["config"] == "triton" and r["status"] == "ok"}
    lines = ["| configuration | context | batch | decode tokens/s | step ms | attention ms/step | attention / step | "
             "attention / TRITON_ATTN's | H2D GB/s (of the bus) | prefill s | note |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted_rows(result):
        if r["config"] == "triton-heavy":
            continue
        label = CONFIGS[r["config"]].label if r["config"] in CONFIGS else r["config"]
        head = f"| {label} | {_k(r['context'])} | {r['batch']} |"
        if r["status"] != "ok":
            lines.append(f"{head} - | - | - | - | - | - | - | {r['status']}: {_note(r)} |")
            continue
        base = triton.get((r["context"], r["batch"]))
        vs = "-"
        if base and r["config"] != "triton" and r["attention_ms"] is not None and base["attention_ms"]:
            vs = f"{r['attention_ms'] / base['attention_ms']:.2f}x"
        h2d = "-"
        if r.get("h2d_GBps") is not None and r.get("telemetry_per_step", {}).get("bytes_h2d", 0) > 0:
            h2d = f"{r['h2d_GBps']:.1f} ({_f(r.get('bus_fraction'), '.2f')})"
        note = ""
        if r.get("selected_blocks_per_head") is not None:
            note = (f"attends {r['selected_blocks_per_head']:.0f} of {r['context_blocks_per_row']:.0f} blocks per KV "
                    "head")
        lines.append(f"{head} {r['tokens_per_s']:.1f} | {r['step_ms']:.2f} | {_f(r['attention_ms'], '.2f')} | "
                     f"{_f(r['attention_share'], '.2f')} | {vs} | {h2d} | {r['prefill_s']:.1f} | {note} |")
    return lines


def breakdown_rows(result: dict[str, Any]) -> list[dict[str, Any]]:
    """Stock TRITON_ATTN's measured rows at the breakdown's context and batch, main model first."""
    return [r for r in sorted_rows(result) if r["config"] in ("triton", "triton-heavy") and r["status"] == "ok"
            and (r["context"], r["batch"]) == BREAKDOWN and r.get("forward_ms") is not None
            and r.get("attention_ms") is not None]


def breakdown_table(result: dict[str, Any]) -> list[str]:
    """Where stock TRITON_ATTN's decode step goes at 32k, batch 8: attention, the rest of the model's forward, and
    everything outside the forward."""
    lines = ["| model | KV per token | step ms | model forward ms | attention ms | rest of the forward ms | "
             "outside the forward ms | attention / step |", "|---|---|---|---|---|---|---|---|"]
    for r in breakdown_rows(result):
        model = result["models"][CONFIGS[r["config"]].model]
        lines.append(f"| {model['short']} | {model['kv_bytes_per_token'] // 1024} KiB | {r['step_ms']:.2f} | "
                     f"{r['forward_ms']:.2f} | {r['attention_ms']:.2f} | {r['forward_ms'] - r['attention_ms']:.2f} | "
                     f"{r['step_ms'] - r['forward_ms']:.2f} | {r['attention_share']:.2f} |")
    return lines


def headlines(result: dict[str, Any]) -> dict[str, Any]:
    """The figures a summary quotes, each None where the run has no such measured case: at the breakdown's context
    and batch, ActiveKV exact resident's and TRITON_ATTN's attention per step (ms); the streamed rows' fractions of
    the pinned bus ([min, max]); stock's attention share of the step per model ({"main": x, "heavy": y})."""
    ok = {(r["config"], r["context"], r["batch"]): r for r in result["cases"] if r["status"] == "ok"}
    resident, triton = ok.get(("exact-resident", *BREAKDOWN)), ok.get(("triton", *BREAKDOWN))
    fractions = [r["bus_fraction"] for r in ok.values() if r["config"] == "exact-streamed"
                 and r.get("bus_fraction") is not None]
    return {
        "resident_ms": resident["attention_ms"] if resident else None,
        "triton_ms": triton["attention_ms"] if triton else None,
        "streamed_bus": [min(fractions), max(fractions)] if fractions else None,
        "shares": {CONFIGS[r["config"]].model: r["attention_share"] for r in breakdown_rows(result)},
    }


def configs_table() -> list[str]:
    return ["| configuration | what runs |", "|---|---|",
            *(f"| {c.label} | {c.what} |" for c in CONFIGS.values())]


def markdown(result: dict[str, Any]) -> str:
    """The run as the tool prints it: command, device, the bus, then the tables."""
    bus = result.get("bus", {})
    lines = [f"command: `{result['command']}`",
             f"device: {result.get('device', {}).get('name', '?')}; {result.get('elapsed_s', 0):.0f} s of "
             f"{result['setup']['budget_s']:.0f} s budget; pinned H2D {_f(bus.get('h2d_GBps'), '.1f')} GB/s "
             f"(end of run {_f(bus.get('h2d_GBps_end'), '.1f')})",
             f"model: {result['models']['main']['describe']}", "",
             "## vLLM decode per case", "", *results_table(result), "",
             "## TRITON_ATTN step-time breakdown, 32k context, batch 8", "", *breakdown_table(result)]
    return "\n".join(lines) + "\n"


# --- the run (CUDA, vLLM) -----------------------------------------------------------------------------------------

def make_model(spec: ModelSpec, root: Path, max_positions: int) -> Path:
    """A random Llama of `spec` in bfloat16 (seeded; written once per geometry under root)."""
    out = root / (f"llama-l{spec.layers}-h{spec.heads}-kv{spec.kv_heads}-d{spec.head_size}-w{spec.hidden}"
                  f"-p{max_positions}")
    if (out / "model.safetensors").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=spec.hidden, intermediate_size=spec.intermediate,
                         num_hidden_layers=spec.layers, num_attention_heads=spec.heads,
                         num_key_value_heads=spec.kv_heads, head_dim=spec.head_size,
                         max_position_embeddings=max_positions, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(out, safe_serialization=True)
    return out


def pinned_h2d_GBps(nbytes: int = BUS_BYTES, reps: int = 10) -> float:
    """One pinned host -> device copy of nbytes, median over reps, timed with CUDA events."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    for _ in range(2):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        dev.copy_(host, non_blocking=True)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    del host, dev
    return nbytes / statistics.median(times) / 1e9


class StepTimer:
    """CUDA events around each wrapped call while active: the attention layers' forwards and the model's forward."""

    def __init__(self) -> None:
        self.active = False
        self.attention: list[Any] = []
        self.forward: list[Any] = []

    def wrap(self, fn: Callable[..., Any], sink: list[Any]) -> Callable[..., Any]:
        import torch

        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.active:
                return fn(*args, **kwargs)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            out = fn(*args, **kwargs)
            end.record()
            sink.append((start, end))
            return out

        return timed

    def begin(self) -> None:
        self.attention.clear()
        self.forward.clear()
        self.active = True

    def end(self) -> tuple[float, float | None, int]:
        """(attention ms summed over the calls, model forward ms or None, attention calls) since begin()."""
        self.active = False

        def total(pairs: list[Any]) -> float:
            for _, end in pairs:
                end.synchronize()
            return sum(start.elapsed_time(end) for start, end in pairs)

        return total(self.attention), (total(self.forward) if self.forward else None), len(self.attention)


def _install_timer(worker: Any, timer: StepTimer) -> int:
    """In the (in-process) worker: wrap every attention layer's forward and the model's forward with the timer.
    Returns the attention layers wrapped."""
    import torch

    runner = worker.model_runner
    layers = 0
    for module in runner.get_model().modules():
        if type(module).__name__ == "Attention" and hasattr(module, "impl"):
            module.forward = timer.wrap(module.forward, timer.attention)
            layers += 1
    if isinstance(runner.model, torch.nn.Module):
        runner.model.forward = timer.wrap(runner.model.forward, timer.forward)
    return layers


def _short_error(exc: BaseException) -> str:
    lines = [ln for ln in traceback.format_exception_only(type(exc), exc) if ln.strip()]
    return " ".join(" ".join(lines).split())[:600]


def run_context(engine: Any, plan: EnginePlan, context: int, batches: Sequence[int], timer: StepTimer,
                clock: Clock) -> tuple[list[StepRecord], str | None]:
    """Submit the context's requests and step until they finish: (the step records, None), or (the records so far,
    why the requests were aborted) past the budget's hard deadline or after more steps than they can take."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tools.vllm_run import make_prompts, read_telemetry, telemetry_delta

    llm_engine = engine.llm.llm_engine
    tokens = request_tokens(batches, plan.steps)
    prompts = make_prompts([context] * len(tokens), VOCAB, seed=context)
    ids = [f"{plan.config}-{context}-{i}" for i in range(len(tokens))]
    for rid, prompt, n in zip(ids, prompts, tokens, strict=True):
        params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt), params)
    activekv = plan.backend == ACTIVEKV
    started: set[str] = set()
    records: list[StepRecord] = []
    limit = sum(tokens) + 8  # a step samples at least one token, or something is wrong
    try:
        while llm_engine.has_unfinished_requests():
            if clock.past_hard_deadline() or len(records) >= limit:
                llm_engine.abort_request(ids)
                why = (f"the budget's hard deadline ({clock.budget_s + GRACE_S:.0f} s) passed" if len(records) < limit
                       else f"{limit} steps did not finish the requests")
                return records, why + "; the case's requests were aborted"
            running = llm_engine.get_num_unfinished_requests()
            tel0 = read_telemetry() if activekv else None
            timer.begin()
            t0 = time.perf_counter()
            outputs = llm_engine.step()
            wall = time.perf_counter() - t0
            attention_ms, forward_ms, calls = timer.end()
            tel1 = read_telemetry() if activekv else None
            prefill = len(started) < len(ids)
            started.update(o.request_id for o in outputs)
            delta = telemetry_delta(tel0[0], tel1[0], tel1[1]) if tel0 is not None and tel1 is not None else None
            records.append(StepRecord(wall, running, len(outputs), prefill, attention_ms, forward_ms, calls, delta))
    except BaseException:
        timer.active = False
        try:
            llm_engine.abort_request(ids)
        except Exception:  # noqa: BLE001 - the engine may be unusable; the original error is what to report
            pass
        raise
    return records, None


class Run:
    """The run's state: the result being written, the clock, the rates for projections, the bus."""

    def __init__(self, args: argparse.Namespace, argv: Sequence[str], clock: Clock) -> None:
        self.args = args
        self.clock = clock
        self.rates = Rates()
        self.out = args.out / JSON_NAME
        self.bus: float | None = None
        self.models: dict[str, Path] = {}
        from tools.bench import git_commit

        self.result: dict[str, Any] = {
            "tool": "tools.bench_gpu_vllm",
            "command": shlex.join(["python", "-m", "tools.bench_gpu_vllm", *argv]),
            "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
            "setup": {"contexts": sorted(set(args.contexts)), "batches": sorted(set(args.batches)),
                      "steps": args.steps, "budget_s": args.budget_s, "grace_s": GRACE_S,
                      "max_case_tokens": args.max_case_tokens, "configs": list(args.configs), "block_size": BLOCK,
                      "dtype": "bfloat16", "mode": "eager, in process", "breakdown": list(BREAKDOWN),
                      "streamed_tile": args.streamed_tile},
            "models": {"main": _model_entry(args.main_model), "heavy": _model_entry(HEAVY_MODEL)},
            "configs": {k: {"label": c.label, "what": c.what} for k, c in CONFIGS.items() if k in args.configs},
            "engines": [], "cases": [], "bus": {}, "elapsed_s": 0.0,
        }

    def write(self) -> None:
        self.result["elapsed_s"] = round(self.clock.elapsed(), 1)
        tmp = self.out.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.result, indent=1) + "\n")
        tmp.replace(self.out)

    def log(self, text: str) -> None:
        print(f"[{self.clock.elapsed():6.1f} s] {text}", flush=True)

    def add_rows(self, plan: EnginePlan, rows: list[dict[str, Any]]) -> None:
        for row in rows:
            self.result["cases"].append({"config": plan.config, "model": CONFIGS[plan.config].model, **row})
        self.write()

    def not_run(self, plan: EnginePlan, contexts: Sequence[tuple[int, tuple[int, ...]]], status: str,
                why: str) -> None:
        key = "error" if status == "error" else "reason"
        self.add_rows(plan, [{"context": c, "batch": b, "status": status, key: why}
                             for c, bs in contexts for b in sorted(bs, reverse=True)])

    def model_dir(self, plan: EnginePlan) -> Path:
        key = CONFIGS[plan.config].model
        if key not in self.models:
            self.models[key] = make_model(plan.spec, self.args.models, self.args.max_positions)
        return self.models[key]

    def engine(self, plan: EnginePlan) -> None:
        """Start the plan's engine if its start-up and first context are projected to fit, run its contexts (each
        projected first), close it."""
        import torch

        from tools.vllm_run import GPU_EAGER_SETTINGS, EngineConfig, VllmEngine

        bus = self.bus or 50.0
        entry: dict[str, Any] = {"config": plan.config, "contexts": [c for c, _ in plan.contexts],
                                 "kv_cache_bytes": plan.kv_cache_bytes, "activekv": plan.activekv_options()}
        self.result["engines"].append(entry)
        first = plan.contexts[0]
        projected = self.rates.start_s() + project_context_s(plan, first[0], first[1], self.rates, bus)
        entry["projected_s"] = round(projected, 1)
        if projected > self.clock.left():
            why = f"budget: engine start and {_k(first[0])} projected {projected:.0f} s, {self.clock.left():.0f} s left"
            entry["status"] = "skipped"
            self.log(f"{plan.describe()}: skipped ({why})")
            self.not_run(plan, plan.contexts, "skipped", why)
            return
        self.log(f"{plan.describe()}: starting (KV cache {plan.kv_cache_bytes / 2**30:.2f} GiB, options "
                 f"{plan.activekv_options()})")
        try:
            model = self.model_dir(plan)
            t0 = time.monotonic()
            config = EngineConfig(
                model=str(model), backend=plan.backend, activekv=plan.activekv_options(), block_size=BLOCK,
                max_model_len=plan.max_model_len, max_num_seqs=plan.max_num_seqs,
                max_num_batched_tokens=plan.max_num_batched_tokens, enforce_eager=True, dtype="bfloat16",
                extra={**GPU_EAGER_SETTINGS, "kv_cache_memory_bytes": plan.kv_cache_bytes})
            eng = VllmEngine(config)
        except Exception as exc:  # noqa: BLE001 - recorded; the run goes on
            entry["status"], entry["error"] = "error", _short_error(exc)
            self.log(f"{plan.describe()}: engine failed: {entry['error']}")
            self.not_run(plan, plan.contexts, "error", f"engine start: {entry['error']}")
            return
        entry["start_s"] = round(time.monotonic() - t0, 2)
        self.rates.starts.append(entry["start_s"])
        first_row = len(self.result["cases"])
        try:
            timer = StepTimer()
            try:
                [layers] = eng.llm.collective_rpc(_install_timer, args=(timer,))
            except Exception as exc:  # noqa: BLE001 - steps are still timed; attention columns stay empty
                timer = StepTimer()  # never installed: layers wrapped before the failure stay inactive
                layers, entry["timer_error"] = 0, _short_error(exc)
                self.log(f"{plan.describe()}: attention not timed: {entry['timer_error']}")
            entry["attention_layers_timed"] = layers
            for context, batches in plan.contexts:
                self.context(eng, plan, context, batches, timer, bus)
            entry["status"] = "done"
        except Exception as exc:  # noqa: BLE001
            entry["status"], entry["error"] = "error", _short_error(exc)
            self.log(f"{plan.describe()}: error: {entry['error']}")
            done = {r["context"] for r in self.result["cases"][first_row:]}
            self.not_run(plan, [cb for cb in plan.contexts if cb[0] not in done], "error", entry["error"])
        finally:
            try:
                eng.close()
                torch.cuda.empty_cache()
            except Exception as exc:  # noqa: BLE001 - the next engine will say whether the device is still usable
                entry["close_error"] = _short_error(exc)
            self.write()

    def context(self, eng: Any, plan: EnginePlan, context: int, batches: tuple[int, ...], timer: StepTimer,
                bus: float) -> None:
        projected = project_context_s(plan, context, batches, self.rates, bus)
        if projected > self.clock.left():
            why = f"budget: {_k(context)} projected {projected:.0f} s, {self.clock.left():.0f} s left"
            self.log(f"{plan.config} {_k(context)}: skipped ({why})")
            self.not_run(plan, [(context, batches)], "skipped", why)
            return
        try:
            records, aborted = run_context(eng, plan, context, batches, timer, self.clock)
        except Exception as exc:  # noqa: BLE001 - recorded; the engine's next context is tried
            why = _short_error(exc)
            self.log(f"{plan.config} {_k(context)}: error: {why}")
            self.not_run(plan, [(context, batches)], "error", why)
            return
        rows = summarise(records, batches, self.bus, plan.spec.kv_heads)
        for row in rows:
            row["context"] = context
            row["projected_s"] = round(projected, 1)
            if aborted is not None and row["status"] != "ok":
                row.pop("error", None)
                row.update({"status": "aborted", "reason": aborted})
        if rows and rows[0]["prefill_steps"] == 1 and rows[0]["prefill_s"] > 0:
            self.rates.record_prefill(plan.backend, context, max(batches), plan.spec, rows[0]["prefill_s"])
        self.add_rows(plan, rows)
        for row in rows:
            if row["status"] == "ok":
                extra = f", H2D {row['h2d_GBps']:.1f} GB/s" if row.get("h2d_GBps") else ""
                self.log(f"{plan.config} {_k(context)} batch {row['batch']}: {row['tokens_per_s']:.1f} tokens/s, step "
                         f"{row['step_ms']:.2f} ms, attention {_f(row['attention_ms'], '.2f')} ms{extra} (prefill "
                         f"{row['prefill_s']:.1f} s)")
            else:
                self.log(f"{plan.config} {_k(context)} batch {row['batch']}: {row['status']}: {_note(row)}")


def _model_entry(spec: ModelSpec) -> dict[str, Any]:
    return {**asdict(spec), "kv_bytes_per_token": spec.kv_bytes_per_token, "short": spec.short(),
            "describe": spec.describe()}


def device_facts() -> dict[str, Any]:
    import torch

    props = torch.cuda.get_device_properties(0)
    facts: dict[str, Any] = {"name": props.name, "memory_GiB": round(props.total_memory / 2**30, 1),
                             "multiprocessors": props.multi_processor_count, "cuda": torch.version.cuda}
    try:
        smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=20)
        if smi.returncode == 0 and smi.stdout.strip():
            facts["driver"] = smi.stdout.strip().splitlines()[0]
    except (OSError, subprocess.TimeoutExpired):
        pass
    return facts


def versions() -> dict[str, str]:
    import torch

    out = {"torch": torch.__version__, "python": platform.python_version()}
    for name in ("vllm", "triton", "transformers"):
        try:
            out[name] = __import__(name).__version__
        except Exception:  # noqa: BLE001 - a version we cannot read is left out
            pass
    try:
        import activekv._backend as backend

        out["activekv"] = backend.__version__
    except ImportError:
        pass
    return out


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_gpu_vllm", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "gpu", help=f"folder for {JSON_NAME}")
    ap.add_argument("--budget-s", type=float, default=DEFAULT_BUDGET_S,
                    help="wall seconds from start: nothing is started that is projected to end later")
    ap.add_argument("--contexts", type=int, nargs="+", default=list(DEFAULT_CONTEXTS), help="prompt tokens per row")
    ap.add_argument("--batches", type=int, nargs="+", default=list(DEFAULT_BATCHES), help="rows decoded together")
    ap.add_argument("--steps", type=int, default=DEFAULT_STEPS, help="timed decode steps per batch (after 1 warm-up)")
    ap.add_argument("--configs", nargs="+", choices=list(CONFIGS), default=list(DEFAULT_CONFIGS))
    ap.add_argument("--max-case-tokens", type=int, default=DEFAULT_MAX_CASE_TOKENS,
                    help="batch x context above this is not run")
    ap.add_argument("--streamed-tile", choices=STREAMED_TILES, default="half",
                    help="exact-streamed's tiles: half its pool (default) or the whole pool, at most 256 blocks")
    ap.add_argument("--layers", type=int, default=MAIN_MODEL.layers, help="main model: decoder layers")
    ap.add_argument("--kv-heads", type=int, default=MAIN_MODEL.kv_heads, help="main model: KV heads")
    ap.add_argument("--group", type=int, default=MAIN_MODEL.heads // MAIN_MODEL.kv_heads,
                    help="main model: query heads per KV head")
    ap.add_argument("--head-size", type=int, default=MAIN_MODEL.head_size, choices=(64, 128, 256))
    ap.add_argument("--models", type=Path,
                    default=Path(os.environ.get("ACTIVEKV_GPU_VLLM_MODELS", str(ROOT / "build" / "gpu-vllm-models"))),
                    help="where the random models are written")
    args = ap.parse_args(argv)
    if args.budget_s <= 0:
        ap.error(f"--budget-s must be positive, got {args.budget_s}")
    if args.steps < 1:
        ap.error(f"--steps must be at least 1, got {args.steps}")
    if min(args.contexts) < 2 * BLOCK or max(args.contexts) > 1 << 20:
        ap.error(f"--contexts must be in [{2 * BLOCK}, {1 << 20}], got {args.contexts}")
    if min(args.batches) < 1 or max(args.batches) > 64:
        ap.error(f"--batches must be in [1, 64], got {args.batches}")
    if args.max_case_tokens < 1:
        ap.error(f"--max-case-tokens must be positive, got {args.max_case_tokens}")
    for name in ("layers", "kv_heads", "group"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    args.main_model = ModelSpec(layers=args.layers, heads=args.kv_heads * args.group, kv_heads=args.kv_heads,
                                head_size=args.head_size)
    # the model's positions: the longest context, its decode tokens (request_tokens) and a block to spare
    longest = max([*args.contexts, BREAKDOWN[0]]) + 1 + (args.steps + 1) * len(set(args.batches)) + 2 * BLOCK
    args.max_positions = -(-longest // 1024) * 1024
    return args


def main(argv: Sequence[str] | None = None) -> int:
    clock = Clock(0.0)  # the budget counts from here, imports included
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    clock.budget_s = args.budget_s
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    import torch

    if not torch.cuda.is_available():
        print("bench_gpu_vllm: no CUDA device (run it on the device, inside the harness: make gpu-vllm-bench)",
              file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    args.models.mkdir(parents=True, exist_ok=True)
    run = Run(args, argv, clock)
    run.result["device"], run.result["versions"] = device_facts(), versions()
    run.bus = pinned_h2d_GBps()
    run.result["bus"] = {"h2d_GBps": run.bus, "bytes": BUS_BYTES, "what": "one pinned host -> device copy, median "
                         "of 10, CUDA events, at the start of the run"}
    run.log(f"pinned host -> device: {run.bus:.1f} GB/s")
    plans, capped = plan_engines(args.contexts, args.batches, args.configs, args.steps, args.max_case_tokens,
                                 main=args.main_model, streamed_tile=args.streamed_tile)
    for key in (k for k in CONFIGS if k in args.configs and k != "triton-heavy"):
        for ctx, batch in capped:
            run.result["cases"].append({
                "config": key, "model": "main", "context": ctx, "batch": batch, "status": "capped",
                "reason": f"batch x context = {batch * ctx} prompt tokens > --max-case-tokens {args.max_case_tokens}"
                          ": its prefill alone would not fit the budget"})
    run.write()
    import vllm  # noqa: F401  (imported here so that its start-up counts before the first projection)

    run.log(f"vLLM imported; {len(plans)} engines planned")
    for plan in plans:
        try:
            run.engine(plan)
        except Exception as exc:  # noqa: BLE001 - Run.engine records its own failures; this is the last resort
            run.log(f"{plan.describe()}: {_short_error(exc)}")
            run.result.setdefault("errors", []).append(f"{plan.describe()}: {_short_error(exc)}")
            run.write()
    try:
        run.result["bus"]["h2d_GBps_end"] = pinned_h2d_GBps()
    except Exception as exc:  # noqa: BLE001
        run.result["bus"]["error_end"] = _short_error(exc)
    run.write()
    print()
    print(markdown(run.result), end="")
    print(f"\nwrote {run.out}")
    return 0 if any(r["status"] == "ok" for r in run.result["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())
