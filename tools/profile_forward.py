"""Where one ActiveKV decode forward spends its time: torch.profiler over `Impl.forward`, ATen ops by self CPU time.

`python -m tools.profile_forward [--context N] [--batch B] [--pool-fraction F] [--mode exact|compressed] [--reps R]`.
The geometry is the benchmark's (32 query heads, 8 KV heads, head size 128, float32, block 16, tile 16 blocks);
`--mode compressed` uses the benchmark's compressed options (budget 2048 tokens, sink 1, recent 2) and the default
pool (one row's worst-case union per row of the batch; `--pool-fraction` is then ignored). A profile, not a timing.
"""

from __future__ import annotations

import argparse
from types import SimpleNamespace

import torch

from tools.bench import COMPRESSED

H, KVH, D, BS, TILE = 32, 8, 128, 16, 16


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profile_forward", description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--pool-fraction", type=int, default=1, help="pool = blocks read per step / this")
    parser.add_argument("--mode", choices=("exact", "compressed"), default="exact")
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args(argv)
    import activekv._backend as backend  # after torch

    torch.manual_seed(0)
    per_row = -(-args.context // BS)
    nb = per_row * args.batch
    pool = max(TILE, nb // args.pool_fraction)
    options = {"pool_blocks": pool} if args.mode == "exact" else dict(COMPRESSED)
    spec = SimpleNamespace(block_size=BS, num_kv_heads=KVH, head_size=D, dtype=torch.float32, sliding_window=None)
    impl = backend.Impl(H, D, D ** -0.5, KVH)
    # the attention layer as vLLM registers it: its impl (the patch's ActiveKVImpl) holds the native Impl
    layer = SimpleNamespace(layer_name="profile.layers.0.attn", impl=SimpleNamespace(_native=impl))
    cfg = SimpleNamespace(model_config=SimpleNamespace(get_num_attention_heads=lambda parallel_config: H),
                          parallel_config=None,
                          # as vLLM sets them before it makes the builders (compressed mode's default pool reads them)
                          scheduler_config=SimpleNamespace(max_num_seqs=args.batch),
                          cache_config=SimpleNamespace(num_gpu_blocks=nb),
                          compilation_config=SimpleNamespace(static_forward_context={layer.layer_name: layer}),
                          additional_config={"activekv": {**options, "tile_blocks": TILE}})
    builder = backend.Builder(spec, [layer.layer_name], cfg, torch.device("cpu"))
    cache = torch.zeros(nb, KVH, BS, 2 * D)
    table = torch.randperm(nb, dtype=torch.int32).view(args.batch, per_row)
    slots = (table.long().unsqueeze(-1) * BS + torch.arange(BS)).view(-1)
    impl.do_kv_cache_update(layer, torch.randn(nb * BS, KVH, D), torch.randn(nb * BS, KVH, D), cache, slots)
    qsl = torch.arange(args.batch + 1, dtype=torch.int32)
    md = SimpleNamespace(query_start_loc_cpu=qsl, seq_lens=torch.full((args.batch,), args.context, dtype=torch.int32),
                         block_table_tensor=table, num_reqs=args.batch, num_actual_tokens=args.batch, causal=True)
    q, out = torch.randn(args.batch, H, D), torch.empty(args.batch, H, D)
    plan = builder.build(0, md)
    for _ in range(3):
        impl.forward(layer, q, q, q, cache, plan, out)
    with torch.profiler.profile() as prof:
        for _ in range(args.reps):
            impl.forward(layer, q, q, q, cache, plan, out)
    pool_text = f"pool {pool} blocks" if args.mode == "exact" else "default pool"
    print(f"{args.mode} mode, context {args.context}, batch {args.batch}, {pool_text}, {args.reps} forwards")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=12))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
