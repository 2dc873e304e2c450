"""The native engine alone, without vLLM: many steps of random batches, glibc's heap every --every steps.

    python -m tools.engine_soak [--mode exact|compressed] [--steps 6000] [--every 1000] [--seed 0]

One `activekv._backend.Engine` (2 layers, 4 query heads, 2 KV heads, head size 32, block size 16, pool 16 blocks,
tile 4 blocks: the tiny model's attention; compressed: budget 128 tokens, 1 sink, 2 recent blocks) over a 512-block
float32 KV cache per layer. Each step: 1-8 rows over disjoint random blocks, contexts of 1-1024 tokens, a fifth of
the rows prefilling their whole context and the rest decoding one token; `build`, then per layer `update_kv` and
`forward`. Printed every --every steps: RSS, glibc's heap in use and free (tools/soak.py's `heap_mib`). What it
separates from tools/soak.py: memory the engine itself keeps per step, with vLLM, torch's model code and oneDNN out
of the process's path. Not a timed test.
"""

from __future__ import annotations

import argparse
import random
import sys

import torch

from tools.soak import heap_mib, rss_mib

LAYERS, HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, CACHE_BLOCKS, ROW_BLOCKS = 2, 4, 2, 32, 16, 512, 64


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mode", choices=["exact", "compressed"], default="exact")
    ap.add_argument("--steps", type=int, default=6000)
    ap.add_argument("--every", type=int, default=1000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    import activekv._backend as backend

    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    opts = dict(mode="compressed", budget_tokens=128, sink_blocks=1, recent_blocks=2) if args.mode == "compressed" \
        else {}
    engine = backend.Engine(LAYERS, HEADS, KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, 16, 4, **opts)
    caches = [torch.zeros(CACHE_BLOCKS, KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE) for _ in range(LAYERS)]
    for step in range(args.steps + 1):
        nreq = rng.randint(1, 8)
        lens = [rng.randint(1, ROW_BLOCKS * BLOCK_SIZE) for _ in range(nreq)]
        qlens = [n if rng.random() < 0.2 else 1 for n in lens]
        qsl = [0]
        for q in qlens:
            qsl.append(qsl[-1] + q)
        tokens = qsl[-1]
        table = torch.randperm(CACHE_BLOCKS)[: nreq * ROW_BLOCKS].to(torch.int32).view(nreq, ROW_BLOCKS)
        slots = torch.cat([table[r, torch.arange(n - q, n) // BLOCK_SIZE].long() * BLOCK_SIZE
                           + torch.arange(n - q, n) % BLOCK_SIZE for r, (n, q) in enumerate(zip(lens, qlens))])
        plan = engine.build(torch.tensor(qsl, dtype=torch.int32), torch.tensor(lens, dtype=torch.int32), table, len(lens), tokens)
        for layer in range(LAYERS):
            engine.update_kv(layer, torch.randn(tokens, KV_HEADS, HEAD_SIZE), torch.randn(tokens, KV_HEADS, HEAD_SIZE),
                             caches[layer], slots)
            engine.forward(layer, plan, torch.randn(tokens, HEADS, HEAD_SIZE), caches[layer],
                           torch.zeros(tokens, HEADS, HEAD_SIZE), HEAD_SIZE ** -0.5)
        if step % args.every == 0:
            in_use, free = heap_mib()
            print(f"mode={args.mode} step={step} rss_mib={rss_mib():.1f} heap_in_use_mib={in_use:.1f} "
                  f"heap_free_mib={free:.1f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
