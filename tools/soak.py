"""Soak: many requests of mixed lengths through one in-process vLLM with ActiveKV; resident memory and telemetry.

    python -m tools.soak MODEL_DIR [--requests 1000] [--batch 8] [--every 100] [--kv-cache-gib 1]
                                   [--activekv '{"pool_blocks": 16, "tile_blocks": 4}'] [--backend CPU_ATTN]
                                   [--trim] [--tracemalloc] [--json OUT]

One vLLM engine (tools/vllm_run.py: in-process engine core, float32, eager, token-id prompts, KV cache sized
explicitly by --kv-cache-gib), ACTIVEKV backend (--backend CPU_ATTN: the same load on stock vLLM, the control for
the memory figures; its telemetry columns stay 0). Requests go in batches of --batch with prompt lengths drawn from
[8, max_model_len / 2] and 1-32 new tokens each (seeded), greedy. vLLM may chunk prefills and preempt: that is part
of the load. Printed: resident set size (VmRSS of this process, which holds the engine core) at start (after the
engine is up), after every --every requests and at the end, with the native telemetry totals at each point. Not a
timed test: a tool whose figures go into docs/reliability.md.

Where the memory goes (every row, from the same process):
- glibc's allocator: `mallinfo2()` summed over all arenas: `heap_in_use_mib` (uordblks + hblkhd: bytes malloc has
  handed out and not had back, mmapped chunks included) and `heap_free_mib` (fordblks: freed bytes glibc still holds
  in its arenas, which RSS counts where the pages were touched). RSS growing while heap_in_use stays flat is
  allocator retention/fragmentation, not a leak.
- `--trim`: after the reading, `malloc_trim(0)` hands free arena pages back to the kernel and the RSS is read again
  (`rss_trimmed_mib`); what RSS keeps after a trim is memory something still holds.
- `--tracemalloc`: `traced_mib`, the Python objects' memory (tracemalloc's current size; Python allocations only,
  not torch's or the engine's), and at the end the 15 source lines whose traced memory grew most since the first row.
- ActiveKV's own allocations: `pool_mib` (every layer's pool as the telemetry's info reports it: pool_blocks x
  block bytes), fixed at start-up, and the native counters.
`MALLOC_ARENA_MAX=N` in the environment caps glibc's arenas (one per thread by default, up to 8 x cores).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import random
import sys
import time
from pathlib import Path

from tools.vllm_run import ACTIVEKV, CPU_ATTN, EngineConfig, VllmEngine, read_telemetry

TOTALS = ("build_calls", "forward_calls", "kv_update_calls", "tokens_written", "blocks_admitted", "blocks_evicted",
          "blocks_hit", "tiles_computed", "host_rebinds")


def rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (malloc.h, glibc >= 2.33): every field a size_t."""

    _fields_ = [(name, ctypes.c_size_t) for name in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


_LIBC = ctypes.CDLL("libc.so.6")
_LIBC.mallinfo2.restype = _MallInfo2
_LIBC.malloc_trim.argtypes = [ctypes.c_size_t]


def heap_mib() -> tuple[float, float]:
    """(in use, free) MiB of glibc's malloc over all arenas (mallinfo2: uordblks + hblkhd, fordblks)."""
    info = _LIBC.mallinfo2()
    return (info.uordblks + info.hblkhd) / 2**20, info.fordblks / 2**20


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--requests", type=int, default=1000)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--every", type=int, default=100)
    ap.add_argument("--kv-cache-gib", type=int, default=1)
    ap.add_argument("--max-model-len", type=int, default=2048)
    ap.add_argument("--activekv", default='{"pool_blocks": 16, "tile_blocks": 4}')
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--block-size", type=int, default=16, help="vLLM's KV block size (CPU_ATTN needs a multiple of 32)")
    ap.add_argument("--backend", default=ACTIVEKV, choices=[ACTIVEKV, CPU_ATTN])
    ap.add_argument("--trim", action="store_true", help="malloc_trim(0) after each reading; RSS read again")
    ap.add_argument("--tracemalloc", action="store_true", help="trace Python allocations (slower)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    if args.tracemalloc:
        import tracemalloc

        tracemalloc.start(1)
    first_trace = None

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    activekv = json.loads(args.activekv) if args.backend == ACTIVEKV else None
    config = EngineConfig(model=args.model, backend=args.backend, activekv=activekv, block_size=args.block_size,
                          max_model_len=args.max_model_len, max_num_seqs=args.batch, kv_cache_gib=args.kv_cache_gib)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    rows = []

    def record(done: int, started: float) -> None:
        nonlocal first_trace
        snap = read_telemetry()
        tel = snap[0] if snap else {}
        in_use, free = heap_mib()
        row = {"requests": done, "rss_mib": round(rss_mib(), 1), "seconds": round(time.monotonic() - started, 1),
               "heap_in_use_mib": round(in_use, 1), "heap_free_mib": round(free, 1),
               "pool_mib": round(tel.get("num_layers", 0) * tel.get("pool_blocks", 0) * tel.get("bytes_per_block", 0)
                                 / 2**20, 1),
               **{k: tel.get(k, 0) for k in TOTALS}}
        if args.tracemalloc:
            import tracemalloc

            row["traced_mib"] = round(tracemalloc.get_traced_memory()[0] / 2**20, 1)
            if first_trace is None:
                first_trace = tracemalloc.take_snapshot()
        if args.trim:
            _LIBC.malloc_trim(0)
            row["rss_trimmed_mib"] = round(rss_mib(), 1)
        rows.append(row)
        print(" ".join(f"{k}={v}" for k, v in row.items()), flush=True)

    with VllmEngine(config) as engine:
        started = time.monotonic()
        record(0, started)
        done = 0
        while done < args.requests:
            n = min(args.batch, args.requests - done)
            prompts = [TokensPrompt(prompt_token_ids=[rng.randrange(vocab) for _ in range(
                rng.randint(8, args.max_model_len // 2))]) for _ in range(n)]
            params = [SamplingParams(temperature=0.0, max_tokens=rng.randint(1, 32), detokenize=False,
                                     ignore_eos=True) for _ in range(n)]
            outs = engine.llm.generate(prompts, params, use_tqdm=False)
            for out, p in zip(outs, params):
                if len(out.outputs[0].token_ids) != p.max_tokens:
                    raise RuntimeError(f"a request returned {len(out.outputs[0].token_ids)} of {p.max_tokens} tokens")
            before = done
            done += n
            if done // args.every > before // args.every or done == args.requests:
                record(done, started)
    if args.tracemalloc and first_trace is not None:
        import tracemalloc

        for stat in tracemalloc.take_snapshot().compare_to(first_trace, "lineno")[:15]:
            print(f"traced growth: {stat}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
