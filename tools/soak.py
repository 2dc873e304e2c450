"""Soak: many requests of mixed lengths through one in-process vLLM with ActiveKV; resident memory and telemetry.

    python -m tools.soak MODEL_DIR [--requests 1000] [--batch 8] [--every 100] [--kv-cache-gib 1]
                                   [--activekv '{"pool_blocks": 16, "tile_blocks": 4}'] [--backend CPU_ATTN]
                                   [--json OUT]

One vLLM engine (tools/vllm_run.py: in-process engine core, float32, eager, token-id prompts, KV cache sized
explicitly by --kv-cache-gib), ACTIVEKV backend (--backend CPU_ATTN: the same load on stock vLLM, the control for
the memory figures; its telemetry columns stay 0). Requests go in batches of --batch with prompt lengths drawn from
[8, max_model_len / 2] and 1-32 new tokens each (seeded), greedy. vLLM may chunk prefills and preempt: that is part
of the load. Printed: resident set size (VmRSS of this process, which holds the engine core) at start (after the
engine is up), after every --every requests and at the end, with the native telemetry totals at each point. Not a
timed test: a tool whose figures go into docs/reliability.md.
"""

from __future__ import annotations

import argparse
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
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    activekv = json.loads(args.activekv) if args.backend == ACTIVEKV else None
    config = EngineConfig(model=args.model, backend=args.backend, activekv=activekv, block_size=args.block_size,
                          max_model_len=args.max_model_len, max_num_seqs=args.batch, kv_cache_gib=args.kv_cache_gib)
    vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]
    rng = random.Random(args.seed)
    rows = []

    def record(done: int, started: float) -> None:
        snap = read_telemetry()
        tel = snap[0] if snap else {}
        row = {"requests": done, "rss_mib": round(rss_mib(), 1), "seconds": round(time.monotonic() - started, 1),
               **{k: tel.get(k, 0) for k in TOTALS}}
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
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
