"""Decode attention benchmark: median milliseconds per step, printed as the markdown table of docs/benchmarks.md.

`python -m tools.bench` (what `make bench` runs). One decode step of one attention layer, for a batch of requests
that each bring one new token to a context of the row's length: 32 query heads, 8 KV heads, head size 128, float32,
block size 16, 2 threads, synthetic seeded tensors, block tables a seeded permutation of the block ids. A step is
timed through the path vLLM drives, per column:

- ActiveKV exact (`activekv._backend.Builder`/`Impl`, called as vLLM's patched backend calls them): `build` the step
  plan, `do_kv_cache_update` the new token of every row (into the row's last slot, so the context length stays fixed and the last
  block's pool copy is written through), `forward` (admission, host -> pool transfer, tiled attention). Pool columns:
  the pool holds every block the step reads, or a quarter of them (exact mode then streams every block each step).
- vLLM CPU_ATTN (`torch.ops._C`, as vllm/v1/attention/backends/cpu_attn.py calls it): `get_scheduler_metadata`
  (its builder's per-step work), `cpu_attn_reshape_and_cache` of the new tokens, `cpu_attention_with_kv_cache`.
  At block 16 (ISA vec16, the same geometry as ActiveKV) and at block 128, vLLM's CPU default: vLLM's CPU_ATTN
  declares kernel block sizes MultipleOf(32), so `LLM(block_size=16)` with CPU_ATTN is refused at start-up.
- SDPA: `torch.nn.functional.scaled_dot_product_attention(enable_gqa=True)` on contiguous K/V, attention only.

Cells are median milliseconds per step. Every column's output is compared with SDPA's ("max diff": the largest
absolute difference over the row's columns), so a fast but wrong path shows. Timings: warm-up steps first (they also
fill the pool), then repetitions until `--min-reps` and `--budget-s` are both met (at most `--max-reps`; a slow cell
stops after `--cap-s` once it has 3), so the default run takes a few minutes at most.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_SIZE = 128
BLOCK_SIZE = 16
DTYPE = torch.float32
TILE_BLOCKS = 16  # ActiveKV's default tile (256 tokens)
CONTEXTS = (2048, 8192, 16384)
BATCHES = (1, 8)
MISSING = "n/a (module missing)"

# Column headers (milliseconds per step); docs/benchmarks.md explains each.
COLUMNS = (
    "ActiveKV pool=all",
    "ActiveKV pool=1/4",
    "CPU_ATTN block 16",
    "CPU_ATTN block 128",
    "SDPA",
)


@dataclass(frozen=True)
class Timing:
    warmup: int
    min_reps: int
    max_reps: int
    budget_s: float
    cap_s: float


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


def make_case(context: int, batch: int, seed: int) -> Case:
    gen = torch.Generator().manual_seed(seed)
    shape = (batch * context, NUM_KV_HEADS, HEAD_SIZE)
    key = torch.randn(shape, generator=gen, dtype=DTYPE)
    value = torch.randn(shape, generator=gen, dtype=DTYPE)
    query = torch.randn((batch, NUM_HEADS, HEAD_SIZE), generator=gen, dtype=DTYPE)
    return Case(context, batch, key, value, query, seed)


def time_step(step: Callable[[], None], timing: Timing) -> tuple[float, int]:
    """(median wall time of `step` in milliseconds, repetitions timed).

    Repeats until both `min_reps` and `budget_s` are met (at most `max_reps`). A slow path warms up for at most
    `cap_s` / 2 seconds (at least one step) and stops repeating after `cap_s` seconds once it has 3 repetitions, so
    one slow column cannot stretch the run far past its budget.
    """
    start = time.perf_counter()
    for i in range(timing.warmup):
        if i > 0 and time.perf_counter() - start >= timing.cap_s / 2:
            break
        step()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < timing.max_reps:
        elapsed = time.perf_counter() - start
        if len(times) >= timing.min_reps and elapsed >= timing.budget_s:
            break
        if len(times) >= 3 and elapsed >= timing.cap_s:
            break
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3, len(times)


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

    isa = _get_attn_isa(DTYPE, block_size, HEAD_SIZE, "auto")
    block_table = case.block_table(block_size)
    slots = case.slot_mapping(block_table, block_size)
    num_blocks = block_table.numel()
    # [num_blocks, num_kv_heads, block_size, 2 * head_size], split as cpu_attn.py does into K and V halves
    kv_cache = torch.zeros((num_blocks, NUM_KV_HEADS, block_size, 2 * HEAD_SIZE), dtype=DTYPE)
    key_cache, value_cache = kv_cache.view(num_blocks, NUM_KV_HEADS, 2 * block_size, HEAD_SIZE).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(case.key, case.value, key_cache, value_cache, slots, isa)
    last = case.last_rows()
    new_key, new_value, new_slots = case.key[last], case.value[last], slots[last]
    query_start_loc, seq_lens = case.decode_metadata()
    out = torch.empty_like(case.query)

    def step() -> None:
        metadata = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=case.batch, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_SIZE,
            seq_lens=seq_lens, dtype=DTYPE, query_start_loc=query_start_loc, causal=True, sliding_window_size=-1,
            isa=isa, enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        )
        ops.cpu_attn_reshape_and_cache(new_key, new_value, key_cache, value_cache, new_slots, isa)
        ops.cpu_attention_with_kv_cache(
            query=case.query, key_cache=key_cache, value_cache=value_cache, output=out,
            query_start_loc=query_start_loc, seq_lens=seq_lens, scale=case.scale, causal=True, alibi_slopes=None,
            sliding_window=-1, block_table=block_table, softcap=0.0, scheduler_metadata=metadata, s_aux=None,
        )

    return step, out


def activekv_column(case: Case, backend: Any, pool_fraction: int) -> tuple[Callable[[], None], torch.Tensor]:
    """ActiveKV through its vLLM-facing objects, called as vLLM's patched backend calls them for one layer:
    `Builder.build` on a CommonAttentionMetadata stand-in, `Impl.do_kv_cache_update`, `Impl.forward`."""
    from types import SimpleNamespace

    block_table = case.block_table(BLOCK_SIZE)
    slots = case.slot_mapping(block_table, BLOCK_SIZE)
    num_blocks = block_table.numel()
    pool_blocks = max(TILE_BLOCKS, num_blocks // pool_fraction)
    spec = SimpleNamespace(block_size=BLOCK_SIZE, num_kv_heads=NUM_KV_HEADS, head_size=HEAD_SIZE, dtype=DTYPE,
                           sliding_window=None)
    config = SimpleNamespace(model_config=SimpleNamespace(get_num_attention_heads=lambda parallel_config: NUM_HEADS),
                             parallel_config=None,
                             additional_config={"activekv": {"pool_blocks": pool_blocks, "tile_blocks": TILE_BLOCKS}})
    layer = SimpleNamespace(layer_name="bench.layers.0.attn")
    builder = backend.Builder(spec, [layer.layer_name], config, torch.device("cpu"))
    impl = backend.Impl(NUM_HEADS, HEAD_SIZE, case.scale, NUM_KV_HEADS)
    # vLLM's LBHNC per-layer view [num_blocks, num_kv_heads, block_size, 2 * head_size]; ActiveKV reads it as
    # [num_blocks, num_kv_heads, 2, block_size, head_size].
    kv_cache = torch.zeros((num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE), dtype=DTYPE)
    impl.do_kv_cache_update(layer, case.key, case.value, kv_cache, slots)
    last = case.last_rows()
    new_key, new_value, new_slots = case.key[last], case.value[last], slots[last]
    query_start_loc, seq_lens = case.decode_metadata()
    metadata = SimpleNamespace(query_start_loc_cpu=query_start_loc, query_start_loc=query_start_loc,
                               seq_lens=seq_lens, block_table_tensor=block_table, num_reqs=case.batch,
                               num_actual_tokens=case.batch, causal=True)
    out = torch.empty_like(case.query)

    def step() -> None:
        plan = builder.build(0, metadata)
        impl.do_kv_cache_update(layer, new_key, new_value, kv_cache, new_slots)
        impl.forward(layer, case.query, new_key, new_value, kv_cache, plan, out)

    return step, out


def machine_line() -> str:
    model = platform.processor() or "unknown CPU"
    try:
        lscpu = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
        model = next((ln.split(":", 1)[1].strip() for ln in lscpu.splitlines() if ln.startswith("Model name")), model)
    except (OSError, subprocess.CalledProcessError):
        pass
    load = ", ".join(f"{x:.2f}" for x in os.getloadavg())
    return f"{model}, nproc {os.cpu_count()}, load average {load} at start (other work skews 2-thread timings)"


def load_backend() -> tuple[Any | None, str]:
    """(activekv._backend, version) or (None, why)."""
    try:
        import activekv._backend as backend
    except ImportError as exc:
        return None, f"missing ({exc})"
    return backend, str(getattr(backend, "__version__", "unknown"))


def run(contexts: Sequence[int], batches: Sequence[int], timing: Timing, seed: int) -> tuple[list[str], list[int]]:
    """Benchmark every (context, batch); returns (markdown table lines, repetitions of every timed cell)."""
    backend, _ = load_backend()
    header = ["context", "batch", *COLUMNS, "max diff"]
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    reps: list[int] = []
    for context in contexts:
        for batch in batches:
            case = make_case(context, batch, seed)
            columns: list[Callable[[], tuple[Callable[[], None], torch.Tensor]] | None] = [
                (lambda: activekv_column(case, backend, 1)) if backend is not None else None,
                (lambda: activekv_column(case, backend, 4)) if backend is not None else None,
                lambda: cpu_attn_column(case, 16),
                lambda: cpu_attn_column(case, 128),
                lambda: sdpa_column(case),
            ]
            cells: list[str] = []
            outputs: list[torch.Tensor] = []
            for make in columns:
                if make is None:
                    cells.append(MISSING)
                    continue
                step, out = make()
                ms, n = time_step(step, timing)
                cells.append(f"{ms:.2f}")
                reps.append(n)
                outputs.append(out)
                del step  # frees this column's cache and pool before the next one is built
            reference = outputs[-1]  # SDPA
            worst = max((o - reference).abs().max().item() for o in outputs)
            lines.append(f"| {context // 1024}k | {batch} | " + " | ".join(cells) + f" | {worst:.1e} |")
            del case, columns, outputs, reference
    return lines, reps


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench", description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=list(CONTEXTS), help="tokens per row")
    parser.add_argument("--batches", type=int, nargs="+", default=list(BATCHES), help="rows (requests) per step")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--min-reps", type=int, default=7)
    parser.add_argument("--max-reps", type=int, default=50)
    parser.add_argument("--budget-s", type=float, default=1.0, help="seconds of repetitions per cell, at least")
    parser.add_argument("--cap-s", type=float, default=8.0, help="stop a slow cell after this, once it has 3 reps")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    for n in args.contexts:
        if n % 128:
            parser.error(f"context {n} must be a multiple of 128 (whole blocks at block sizes 16 and 128)")

    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")  # keep vLLM's import-time logging out of the table
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    import vllm

    _, akv_version = load_backend()
    machine = machine_line()
    started = time.perf_counter()
    timing = Timing(args.warmup, args.min_reps, args.max_reps, args.budget_s, args.cap_s)
    table, reps = run(args.contexts, args.batches, timing, args.seed)
    elapsed = time.perf_counter() - started
    command = shlex.join(["python", "-m", "tools.bench", *(argv if argv is not None else sys.argv[1:])])
    print(f"command: `{command}`")
    print(f"machine: {machine}")
    print(f"versions: torch {torch.__version__}, vllm {vllm.__version__}, activekv {akv_version}, "
          f"python {platform.python_version()}")
    print(f"setup: decode (1 query token per row), {NUM_HEADS} query heads, {NUM_KV_HEADS} KV heads, head size "
          f"{HEAD_SIZE}, {str(DTYPE).removeprefix('torch.')}, ActiveKV block {BLOCK_SIZE} / tile {TILE_BLOCKS} "
          f"blocks, {torch.get_num_threads()} threads; median ms per step of one layer after up to {args.warmup} "
          f"warm-up steps, {min(reps)}-{max(reps)} reps per cell; seed {args.seed}; run took {elapsed:.0f} s")
    print()
    print("\n".join(table))
    return 0


if __name__ == "__main__":
    sys.exit(main())
