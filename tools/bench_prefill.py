"""One layer's prefill attention on CPU: ActiveKV's default (in place) against vLLM's CPU_ATTN and SDPA.

`python -m tools.bench_prefill [--geometry real tiny] [--dtypes float32 bfloat16] [--chunks 2048 4096 4096@7168]
[--block-sizes 128 16] [--threads 2] [--budget-s 1] [--rounds 3] [--json PATH]`

A prefill chunk of L query tokens at the end of a context of C tokens (`L@C`; `L` alone: C = L, the prompt's first
chunk), one request, causal: what one attention layer does for the step that holds that chunk (vLLM on CPU prefills
a long prompt in chunks of `max_num_batched_tokens`, 4096). Columns, each timed with `torch.utils.benchmark`
(`blocked_autorange`, `--budget-s` per round) in turns over `--rounds`, median ms:
- ActiveKV default options at each block size: `Builder.build`, `Impl.do_kv_cache_update` (the chunk's K/V into their
  slots) and `Impl.forward`, as vLLM's patched backend calls them (tools/bench.py's column, for a prefill chunk);
- CPU_ATTN at vLLM's CPU block size 128: its scheduler metadata, `cpu_attn_reshape_and_cache` and
  `cpu_attention_with_kv_cache`, as cpu_attn.py calls them;
- SDPA: `scaled_dot_product_attention(is_causal)` on the chunk's contiguous K/V (C = L only), attention alone.
Geometries: `real`, SmolLM2-135M's attention (9 query heads, 3 KV heads, head size 64); `tiny`, the e2e bench's tiny
Llama (4 query heads, 2 KV heads, head size 32). Synthetic seeded data; the largest difference from SDPA (or from
CPU_ATTN where SDPA does not run) is printed so that a fast but wrong column shows. A benchmark, not a test.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

import torch

GEOMETRIES = {"real": (9, 3, 64), "tiny": (4, 2, 32)}  # (query heads, KV heads, head size)
CPU_ATTN_BLOCK = 128


def parse_chunk(text: str) -> tuple[int, int]:
    """`L` or `L@C` -> (query tokens, context tokens)."""
    try:
        parts = [int(x) for x in text.split("@")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"a chunk is TOKENS or TOKENS@CONTEXT, e.g. 4096@7168; got {text!r}") from None
    if len(parts) not in (1, 2) or parts[0] < 1 or parts[-1] < parts[0]:
        raise argparse.ArgumentTypeError(f"a chunk needs 1 <= TOKENS <= CONTEXT, got {text!r}")
    return parts[0], parts[-1]


class Chunk:
    """Seeded K/V of a whole context and the query of its last `tokens` positions; blocks in a seeded order."""

    def __init__(self, heads: int, kv_heads: int, head_size: int, tokens: int, context: int, dtype: torch.dtype,
                 seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.heads, self.kv_heads, self.head_size = heads, kv_heads, head_size
        self.tokens, self.context = tokens, context
        self.key = torch.randn((context, kv_heads, head_size), generator=gen).to(dtype)
        self.value = torch.randn((context, kv_heads, head_size), generator=gen).to(dtype)
        self.query = torch.randn((tokens, heads, head_size), generator=gen).to(dtype)
        self.scale = head_size**-0.5
        self.seed = seed

    def block_table(self, block_size: int) -> torch.Tensor:
        n = -(-self.context // block_size)
        gen = torch.Generator().manual_seed(self.seed + block_size)
        return torch.randperm(n, generator=gen).view(1, n).to(torch.int32)

    def slots(self, block_table: torch.Tensor, block_size: int) -> torch.Tensor:
        offsets = torch.arange(block_size, dtype=torch.int64)
        return (block_table.to(torch.int64)[:, :, None] * block_size + offsets).reshape(-1)[: self.context]

    def metadata(self) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.tensor([0, self.tokens], dtype=torch.int32), torch.tensor([self.context], dtype=torch.int32))


def activekv_column(c: Chunk, backend: Any, block_size: int) -> tuple[Callable[[], None], torch.Tensor]:
    from tools.bench import activekv_layer, activekv_step

    table = c.block_table(block_size)
    slots = c.slots(table, block_size)
    builder, impl, layer, kv_cache = activekv_layer(backend, c.heads, c.kv_heads, c.head_size, c.key.dtype,
                                                    block_size, table.numel(), 1, {})
    impl.do_kv_cache_update(layer, c.key, c.value, kv_cache, slots)  # the context before the chunk
    first = c.context - c.tokens
    qsl, seq_lens = c.metadata()
    return activekv_step(builder, impl, layer, kv_cache, c.query, c.key[first:], c.value[first:], slots[first:],
                         qsl, seq_lens, table)


def cpu_attn_column(c: Chunk) -> tuple[Callable[[], None], torch.Tensor]:
    from vllm import _custom_ops as ops
    from vllm import envs
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    isa = _get_attn_isa(c.key.dtype, CPU_ATTN_BLOCK, c.head_size, "auto")
    table = c.block_table(CPU_ATTN_BLOCK)
    slots = c.slots(table, CPU_ATTN_BLOCK)
    blocks = table.numel()
    kv_cache = torch.zeros((blocks, c.kv_heads, CPU_ATTN_BLOCK, 2 * c.head_size), dtype=c.key.dtype)
    key_cache, value_cache = kv_cache.view(blocks, c.kv_heads, 2 * CPU_ATTN_BLOCK, c.head_size).chunk(2, dim=2)
    ops.cpu_attn_reshape_and_cache(c.key, c.value, key_cache, value_cache, slots, isa)
    first = c.context - c.tokens
    new_key, new_value, new_slots = c.key[first:], c.value[first:], slots[first:]
    qsl, seq_lens = c.metadata()
    out = torch.empty_like(c.query)

    def step() -> None:
        meta = ops.cpu_attn_get_scheduler_metadata(
            num_reqs=1, num_heads=c.heads, num_kv_heads=c.kv_heads, head_dim=c.head_size, seq_lens=seq_lens,
            dtype=c.key.dtype, query_start_loc=qsl, causal=True, sliding_window_size=-1, isa=isa,
            enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV)
        ops.cpu_attn_reshape_and_cache(new_key, new_value, key_cache, value_cache, new_slots, isa)
        ops.cpu_attention_with_kv_cache(
            query=c.query, key_cache=key_cache, value_cache=value_cache, output=out, query_start_loc=qsl,
            seq_lens=seq_lens, scale=c.scale, causal=True, alibi_slopes=None, sliding_window=-1, block_table=table,
            softcap=0.0, scheduler_metadata=meta, s_aux=None)

    return step, out


def sdpa_column(c: Chunk) -> tuple[Callable[[], None], torch.Tensor]:
    q = c.query.transpose(0, 1).unsqueeze(0)
    k = c.key.transpose(0, 1).unsqueeze(0).contiguous()
    v = c.value.transpose(0, 1).unsqueeze(0).contiguous()
    out = torch.empty_like(c.query)

    def step() -> None:
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=c.scale, enable_gqa=True)
        out.copy_(o.squeeze(0).transpose(0, 1))

    return step, out


def timed(step: Callable[[], None], seconds: float, threads: int) -> float:
    from torch.utils import benchmark

    m = benchmark.Timer(stmt="step()", globals={"step": step}, num_threads=threads).blocked_autorange(
        min_run_time=seconds)
    return statistics.median(m.times) * 1e3


def run_chunk(geometry: str, dtype: torch.dtype, tokens: int, context: int, block_sizes: list[int], args: Any,
              backend: Any) -> dict[str, Any]:
    heads, kvh, d = GEOMETRIES[geometry]
    c = Chunk(heads, kvh, d, tokens, context, dtype, args.seed)
    makers: dict[str, Callable[[], tuple[Callable[[], None], torch.Tensor]]] = {
        f"ActiveKV default, block {bs}": (lambda bs=bs: activekv_column(c, backend, bs)) for bs in block_sizes}
    makers["CPU_ATTN, block 128"] = lambda: cpu_attn_column(c)
    if tokens == context:
        makers["SDPA"] = lambda: sdpa_column(c)
    columns = {name: make() for name, make in makers.items()}
    for step, _ in columns.values():
        step()
    ref = columns["SDPA" if "SDPA" in columns else "CPU_ATTN, block 128"][1].float()
    diff = max(float((out.float() - ref).abs().max()) for _, out in columns.values())
    times: dict[str, list[float]] = {name: [] for name in columns}
    for _ in range(args.rounds):
        for name, (step, _) in columns.items():
            times[name].append(timed(step, args.budget_s, args.threads))
    ms = {name: statistics.median(t) for name, t in times.items()}
    return {"geometry": geometry, "dtype": str(dtype).removeprefix("torch."), "tokens": tokens, "context": context,
            "ms": ms, "per_round_ms": times, "max_diff": diff}


def table(rows: list[dict[str, Any]]) -> str:
    names = list(dict.fromkeys(n for r in rows for n in r["ms"]))
    akv = [n for n in names if n.startswith("ActiveKV")]
    head = ["geometry", "dtype", "chunk@context", *[f"{n} ms" for n in names],
            *[f"{n} / CPU_ATTN" for n in akv], "max diff"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        ms = r["ms"]
        cells = [r["geometry"], r["dtype"], f"{r['tokens']}@{r['context']}",
                 *[f"{ms[n]:.2f}" if n in ms else "-" for n in names],
                 *[f"{ms[n] / ms['CPU_ATTN, block 128']:.2f}x" for n in akv], f"{r['max_diff']:.1e}"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_prefill", description=__doc__.splitlines()[0])
    parser.add_argument("--geometry", nargs="+", choices=sorted(GEOMETRIES), default=["real"])
    parser.add_argument("--dtypes", nargs="+", choices=("float32", "bfloat16"), default=["float32", "bfloat16"])
    parser.add_argument("--chunks", type=parse_chunk, nargs="+", default=[(2048, 2048), (4096, 4096), (3072, 7168)],
                        metavar="L[@C]", help="query tokens, at the end of a context of C tokens")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[128, 16])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--budget-s", type=float, default=1.0, help="seconds per column per round")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, metavar="PATH")
    args = parser.parse_args(argv)
    if args.threads < 1 or args.rounds < 1 or args.budget_s <= 0:
        parser.error("--threads and --rounds must be at least 1 and --budget-s above 0")
    import platform

    import activekv._backend as backend  # after torch
    import vllm

    from tools.bench import git_commit, machine_info, write_json

    result: dict[str, Any] = {"tool": "tools.bench_prefill", "date": time.strftime("%Y-%m-%d"),
                              "commit": git_commit(), "machine": machine_info(),
                              "command": " ".join(["python -m tools.bench_prefill", *(argv or sys.argv[1:])]),
                              "versions": {"torch": torch.__version__, "vllm": vllm.__version__,
                                           "python": platform.python_version(), "activekv": backend.__version__},
                              "threads": args.threads, "rows": []}
    for geometry in args.geometry:
        for dt in args.dtypes:
            for tokens, context in args.chunks:
                row = run_chunk(geometry, getattr(torch, dt), tokens, context, args.block_sizes, args, backend)
                result["rows"].append(row)
                print(f"[bench_prefill] {geometry} {dt} {tokens}@{context}: "
                      + ", ".join(f"{n} {v:.2f} ms" for n, v in row["ms"].items()), file=sys.stderr, flush=True)
    print(table(result["rows"]), end="")
    if args.json is not None:
        write_json(args.json, result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
