"""GPU benchmark: transfers and decode attention on a CUDA device, each ceiling re-measured in the same run.

    python -m tools.bench_gpu [--out DIR] [--quick] [--sections [SECTION ...]] [--split-sweep] [--drift A]
                              [--compressed-breakdown [BATCHxCONTEXT[:QUERIES] ...]]
                              [--streamed-breakdown [BATCHxCONTEXT[:TILE] ...]]

Prints markdown tables and writes `gpu_bench.json` (every figure, with the command, date, device and versions) and
`gpu_decode.png` (time per decode step against context length) under --out. Committed as docs/data/bench_gpu.json,
it is what `python -m tools.docs` renders into docs/benchmarks.md ("GPU, engine level"), with the same tables and plot.
Geometry: Llama-3-8B-like, 32 query heads, 8 KV heads, head size 128, bfloat16, block 16 tokens (64 KiB per block, all
KV heads). Decode steps (ActiveKV's whole `Engine.forward` of one layer, host work included, and SDPA alike) are timed
with CUDA events around N back-to-back calls, the median of several such runs after warm-up; "kernel" times are the
device time of the kernels those calls ran (the profiler's CUDA activity), per call. Resident timings rotate through
enough layers (each its own KV) that the calls stream at least 512 MiB, several times the 60 MB L2 cache.

Sections (--sections picks some; the JSON then holds only those):
1. ceilings: one pinned host->device and device->host copy of 256 MiB; a device->device copy of 4 GiB (read + write);
2. blocks: transfer.copy_blocks_staged/mapped of 256 MiB as blocks of 16 KiB .. 4 MiB (CPU gather into pinned
   staging, one copy on a copy stream; or read straight from pinned memory: copy_blocks_mapped's own choice, and
   forced onto the copy engines and onto its gather kernel with ACTIVEKV_DMA_MIN_BYTES; scattered ids, one call at a
   time and 8 back to back, and in order with its own choice), against one plain pinned copy of the same bytes, and
   one `copy_` per block; then
   copy_blocks_mapped's gather kernel on 16 and 64 KiB blocks at each CTA count (ACTIVEKV_GATHER_CTAS: 2 .. 132, and
   the default), the JSON's "gather";
3. streamed: exact decode whose context lives in a pinned host tier and streams through a pool of 1/8 of it (the
   mapped transfer reading as it chooses, and with its gather kernel forced); achieved host->device rate against the
   pinned bus ceiling of section 1;
4. small_tiles: streamed exact decode as vLLM's streaming configuration runs it (tools/bench_gpu_vllm.py: a pool of
   1/8 of one row's context) at 8k and 32k, batch 1 and 8, with tiles of half the pool and of the whole pool, each
   tile's ids in the kernels' launch parameters (the default) and, with tiles of half the pool, uploaded per tile
   (ACTIVEKV_INLINE_IDS=0): ms/step, the achieved rate against the pinned bus, and the host's time per tile (one
   forward's wall clock, the device idle at its start);
5. resident: exact decode with every block on the device, in place (placement in_place: the KV cache on the device,
   no pool) and from a pool that holds the contexts (pool-resident), each step's decode rows in one launch (the decode
   batch); the ATen tile path beside them; against scaled_dot_product_attention (flash) on the same KV in
   [B, H, T, D] layout; KV read rate of each;
6. compressed: compressed decode (budget 2048 tokens) from a pinned host tier, against the same SDPA with the full
   context resident, with two kinds of queries: "random" rotates 4 random queries; "drift" gives each call a new query
   from an AR(1) process per query head (q_t = a q_{t-1} + sqrt(1 - a^2) eps_t, a = 0.95 or --drift), generated
   before timing. Per step: union blocks per row, blocks admitted, evicted and hit (engine counters), admitted over
   the union (batch x union per row) and the pool (KVH x (budget / 16 - 3) + 3 blocks per row) over the union; and
   the compressed target (batch 16, 128k, drifting queries: at most 2x SDPA flash's time, or admitted at most 10% of the
   union).
--split-sweep also times the decode batch's kernels in place at each ACTIVEKV_CUDA_SPLIT (16-token sub-tiles per work
item) and prints them (not kept in the JSON).
--compressed-breakdown profiles compressed decode (torch.profiler, CPU and CUDA activities) at the configurations it
names (default 16x32k and 16x128k, random queries), prints the top 15 host and device costs, writes them to
compressed_breakdown_b*_*k_*.txt under --out and a summary (host and device time per step, pool over the union,
admitted / evicted / hit per step) to the JSON's "compressed_breakdown".
--streamed-breakdown profiles streamed exact decode (pool 16k tokens, tiles of TILE blocks, default 256, at most the
pool's 1024) at the configurations it names (default 1x128k:256, 1x32k:128, 16x128k:256): from the profiler's trace,
the copy engine's busy time and rate on the tile copies, the gaps between them and how many the host caused, the
kernels' time and the host's CUDA runtime calls; the traces are written gzipped under --out, a summary to the JSON's
"streamed_breakdown".
A breakdown alone: `--sections` with no section names, e.g. `--sections --streamed-breakdown 1x32k:128`.
Needs a CUDA device: without one it says so and exits 2, writing nothing.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import shlex
import statistics
import sys
import time
from pathlib import Path

import torch

H, KVH, D, BS = 32, 8, 128, 16
DT = torch.bfloat16
BLOCK_BYTES = KVH * 2 * BS * D * 2  # 64 KiB
TOKEN_BYTES = KVH * 2 * D * 2  # K and V of one token, every KV head
SECTIONS = ("ceilings", "blocks", "streamed", "small_tiles", "resident", "compressed")


def timed(fn, reps: int = 10, warmup: int = 2) -> float:
    """Median seconds of fn() with a device synchronize on both sides."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def event_ms(fn, calls: int, reps: int = 5, warmup: int = 3) -> float:
    """Median over `reps` runs of the CUDA-event time of `calls` back-to-back calls of fn, per call, in ms."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def device_ms(fn, calls: int) -> float:
    """Device time of the kernels (and copies) `calls` calls of fn ran, per call, in ms (CUDA activity of the
    profiler, after one warm-up call)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us = sum(e.time_range.elapsed_us() for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)
    return us / calls / 1e3


def ceilings() -> dict:
    n = 256 << 20
    host = torch.empty(n, dtype=torch.uint8).pin_memory()
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    h2d = n / timed(lambda: dev.copy_(host, non_blocking=True)) / 1e9
    d2h = n / timed(lambda: host.copy_(dev, non_blocking=True)) / 1e9
    big = torch.empty(4 << 30, dtype=torch.uint8, device="cuda")
    big2 = torch.empty_like(big)
    d2d = 2 * big.numel() / timed(lambda: big2.copy_(big), reps=5) / 1e9
    del big, big2
    return {"h2d_GBps": h2d, "d2h_GBps": d2h, "d2d_GBps": d2d}


def gather_kernel_ms(fn, calls: int = 3) -> float | None:
    """Device time per call of the mapped gather's kernel alone (torch.profiler), or None where the call ran no such
    kernel (a build without it: index_select)."""
    fn()
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    us = sum(e.device_time_total for e in prof.key_averages() if "gather_kernel" in e.key)
    return us / calls / 1e3 if us > 0 else None


@contextlib.contextmanager
def env(name: str, value: str | None):
    """The environment variable `name` set to `value` (None: unset) inside the block, as it was after."""
    saved = os.environ.get(name)
    try:
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved


DMA_NEVER = str(1 << 50)  # ACTIVEKV_DMA_MIN_BYTES above any batch: copy_blocks_mapped always takes its gather kernel


def block_batches(quick: bool) -> list[dict]:
    """256 MiB of blocks of each size: copy_blocks_mapped with its own choice, forced onto the copy engines
    (ACTIVEKV_DMA_MIN_BYTES=0) and forced onto the gather kernel, over scattered ids (a random half of a host tier
    twice the batch) and, with its own choice, over ids in order (one run: a tile whose blocks lie in order)."""
    import activekv._transfer as transfer

    total = 256 << 20
    stream = torch.cuda.Stream()
    rows = []
    for block in ([16 << 10, 64 << 10, 1 << 20, 4 << 20] if quick else
                  [16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20]):
        n = total // block
        src = torch.randn(2 * n, block // 2).to(DT).pin_memory()  # a host tier twice the batch
        dst = torch.empty(n, block // 2, dtype=DT, device="cuda")
        ids = torch.randperm(2 * n)[:n].tolist()  # scattered blocks, as a page table gives them
        slots = list(range(n))
        in_order = list(range(n // 2, n // 2 + n))

        def mapped(batch=ids):
            return total / timed(lambda: transfer.copy_blocks_mapped(src, dst, batch, slots, stream), reps=5) / 1e9

        staged = total / timed(lambda: transfer.copy_blocks_staged(src, dst, ids, slots, stream), reps=5) / 1e9
        with env("ACTIVEKV_DMA_MIN_BYTES", None):
            chosen, ordered = mapped(), mapped(in_order)
            # As the engine issues them: calls back to back, each call's host work beside the last one's device work.
            back_to_back = total / event_ms(lambda: transfer.copy_blocks_mapped(src, dst, ids, slots, stream),
                                        calls=8, reps=3) / 1e6
        with env("ACTIVEKV_DMA_MIN_BYTES", "0"):
            dma = mapped() if transfer.mapped_dma_min_bytes() == 0 else None
        with env("ACTIVEKV_DMA_MIN_BYTES", DMA_NEVER):
            gather = mapped()
            kernel = gather_kernel_ms(lambda: transfer.copy_blocks_mapped(src, dst, ids, slots, stream))
        flat = src[:n].contiguous().pin_memory()
        plain = total / timed(lambda: dst.copy_(flat, non_blocking=True), reps=5) / 1e9
        per_block = None
        if block >= 64 << 10 or not quick:
            def each():
                for i, s in zip(ids, slots):
                    dst[s].copy_(src[i], non_blocking=True)
            per_block = total / timed(each, reps=2, warmup=1) / 1e9
        rows.append({"block_KiB": block >> 10, "blocks": n, "staged_GBps": staged, "mapped_GBps": chosen,
                     "mapped_back_to_back_GBps": back_to_back, "mapped_in_order_GBps": ordered,
                     "mapped_dma_GBps": dma, "mapped_gather_GBps": gather,
                     "gather_kernel_GBps": None if kernel is None else total / kernel / 1e6, "plain_GBps": plain,
                     "per_block_copy_GBps": per_block})
    return rows


GATHER_CTAS = (2, 4, 8, 16, 32, 64, 132)


def gather_sweep() -> list[dict]:
    """copy_blocks_mapped of 256 MiB as 16 and 64 KiB blocks through its gather kernel (ACTIVEKV_DMA_MIN_BYTES set
    above any batch) at each CTA count (ACTIVEKV_GATHER_CTAS, read at each call) and at the default; empty in a build
    without the kernel."""
    import activekv._transfer as transfer

    total = 256 << 20
    stream = torch.cuda.Stream()
    rows = []
    with env("ACTIVEKV_GATHER_CTAS", None), env("ACTIVEKV_DMA_MIN_BYTES", DMA_NEVER):
        default = transfer.mapped_gather_ctas()
        if default == 0:
            return rows
        for block in (16 << 10, 64 << 10):
            n = total // block
            src = torch.randn(2 * n, block // 2).to(DT).pin_memory()  # as block_batches: scattered from twice the batch
            dst = torch.empty(n, block // 2, dtype=DT, device="cuda")
            ids = torch.randperm(2 * n)[:n].tolist()
            slots = list(range(n))
            for ctas in (*GATHER_CTAS, None):
                with env("ACTIVEKV_GATHER_CTAS", None if ctas is None else str(ctas)):
                    assert transfer.mapped_gather_ctas() == (ctas or default)
                    rate = total / timed(lambda: transfer.copy_blocks_mapped(src, dst, ids, slots, stream),
                                         reps=5) / 1e9
                rows.append({"block_KiB": block >> 10, "ctas": ctas or default, "default": ctas is None,
                             "mapped_GBps": rate})
            del src, dst
    return rows


def make_engine(pool_blocks: int, tile_blocks: int, mode: str = "exact", budget: int = 2048,
                transfer: str = "mapped", kernel: str = "native"):
    import activekv._backend as backend

    return backend.Engine(1, H, KVH, D, BS, DT, pool_blocks, tile_blocks, device=torch.device("cuda"), mode=mode,
                          budget_tokens=budget, sink_blocks=1, recent_blocks=2, kernel=kernel, transfer=transfer)


def decode_plan(eng, batch: int, ctx: int):
    nb = ctx // BS
    table = torch.arange(batch * nb, dtype=torch.int32).view(batch, nb)
    qsl = torch.arange(batch + 1, dtype=torch.int32)
    return eng.build(qsl, torch.full((batch,), ctx, dtype=torch.int32), table, batch, batch)


def fill_host(batch: int, ctx: int, pinned: bool) -> torch.Tensor:
    """A host tier in vLLM's per-layer view [num_blocks, KVH, BS, 2 * D], random bf16."""
    nb = batch * ctx // BS
    kv = torch.empty((nb, KVH, BS, 2 * D), dtype=DT, device="cpu" if pinned else "cuda")
    if pinned:
        kv = kv.pin_memory()
        step = 1 << 12
        for i in range(0, nb, step):  # fill in chunks on the device (fast) and copy down
            kv[i:i + step].copy_(torch.randn(kv[i:i + step].shape, device="cuda").to(DT))
    else:
        kv.normal_()
    return kv


def rotation(batch: int, ctx: int) -> int:
    """Layers (each its own KV) resident timings rotate through: enough that back-to-back calls stream >= 512 MiB."""
    return max(1, -(-(512 << 20) // (batch * ctx * TOKEN_BYTES)))


def sdpa_decode(batch: int, ctx: int, calls: int) -> dict:
    import torch.nn.functional as F

    sets = [(torch.randn(batch, H, 1, D, dtype=DT, device="cuda"),
             torch.randn(batch, KVH, ctx, D, dtype=DT, device="cuda"),
             torch.randn(batch, KVH, ctx, D, dtype=DT, device="cuda")) for _ in range(rotation(batch, ctx))]
    it = itertools.cycle(sets)

    def step():
        q, k, v = next(it)
        return F.scaled_dot_product_attention(q, k, v, enable_gqa=True)

    backend = "flash"
    try:
        with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.FLASH_ATTENTION):
            ms, kms = event_ms(step, calls), device_ms(step, calls)
    except RuntimeError as e:  # flash refused the shape: say so and time torch's own choice
        print(f"(flash refused batch {batch} context {ctx}: {str(e).splitlines()[0]}; timing SDPA's default)")
        backend = "default"
        ms, kms = event_ms(step, calls), device_ms(step, calls)
    kv_bytes = batch * ctx * TOKEN_BYTES
    return {"batch": batch, "context": ctx, "backend": backend, "ms": ms, "kernel_ms": kms,
            "kv_GBps": kv_bytes / ms / 1e6, "kernel_kv_GBps": kv_bytes / kms / 1e6}


READS = {"own": None, "copy engines": "0", "gather kernel": DMA_NEVER}  # ACTIVEKV_DMA_MIN_BYTES per choice


def exact_decode(batch: int, ctx: int, tiered: bool, pool_tokens: int, tile_blocks: int,
                 transfer: str = "mapped", kernel: str = "native", read: str = "own") -> dict:
    """Streamed exact decode: the context in a pinned host tier, a pool smaller than it. `read`: the mapped transfer's
    own choice between the copy engines and its gather kernel, or one of them forced (READS)."""
    with env("ACTIVEKV_DMA_MIN_BYTES", READS[read]):
        eng = make_engine(pool_tokens // BS, tile_blocks, transfer=transfer, kernel=kernel)
        kv = fill_host(batch, ctx, pinned=tiered)
        plan = decode_plan(eng, batch, ctx)
        q = torch.randn(batch, H, D, dtype=DT, device="cuda")
        out = torch.empty_like(q)
        ms = event_ms(lambda: eng.forward(0, plan, q, kv, out, D ** -0.5), calls=2, reps=3, warmup=1)
        snap = eng.snapshot()
    kv_bytes = batch * ctx * TOKEN_BYTES
    return {"batch": batch, "context": ctx, "transfer": transfer, "kernel": kernel,
            "read": read if transfer == "mapped" else None, "ms": ms, "kv_GBps": kv_bytes / ms / 1e6,
            "h2d_bytes_per_step": snap["bytes_h2d"] / max(1, snap["forward_calls"])}


# The small-tile section: vLLM's streaming configuration (tools/bench_gpu_vllm.py), a pool of 1/8 of one row's context,
# at these contexts and batches, with tiles of half the pool and of the whole pool; each tile's ids in the kernels'
# launch parameters (the engine's default) and, with tiles of half the pool, uploaded per tile (ACTIVEKV_INLINE_IDS=0).
SMALL_TILE_CONTEXTS = (8192, 32768)
SMALL_TILE_BATCHES = (1, 8)
SMALL_TILE_IDS = {"in the launch": None, "uploaded": "0"}  # ACTIVEKV_INLINE_IDS per arm
SMALL_TILE_ARMS = (("half", "in the launch"), ("half", "uploaded"), ("pool", "in the launch"))  # (tile, ids)
HOST_CALLS = 5


def small_tile_decode(batch: int, ctx: int, ids: str, tile: str = "half") -> dict:
    """Streamed exact decode with vLLM's small tiles, where the host's work per tile can outlast the tile's bytes on
    the bus: ms/step by CUDA events over back-to-back calls, and the host's time per tile (one forward's wall clock
    with the device idle at its start and no synchronize inside it, over the tiles it ran). `tile`: half the pool or
    the whole pool (at most 256 blocks)."""
    pool = ctx // BS // 8
    tile_blocks = min(256, pool if tile == "pool" else pool // 2)
    with env("ACTIVEKV_INLINE_IDS", SMALL_TILE_IDS[ids]):
        eng = make_engine(pool, tile_blocks)
        kv = fill_host(batch, ctx, pinned=True)
        plan = decode_plan(eng, batch, ctx)
        q = torch.randn(batch, H, D, dtype=DT, device="cuda")
        out = torch.empty_like(q)

        def fwd() -> None:
            eng.forward(0, plan, q, kv, out, D ** -0.5)

        ms = event_ms(fwd, calls=4, reps=3, warmup=2)
        before = eng.snapshot()
        host = []
        for _ in range(HOST_CALLS):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fwd()
            host.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        after = eng.snapshot()
    tiles = (after["tiles_computed"] - before["tiles_computed"]) / HOST_CALLS
    h2d = (after["bytes_h2d"] - before["bytes_h2d"]) / HOST_CALLS
    del kv
    torch.cuda.empty_cache()
    return {"batch": batch, "context": ctx, "pool_blocks": pool, "tile_blocks": tile_blocks, "ids": ids, "ms": ms,
            "h2d_bytes_per_step": h2d, "tiles_per_step": tiles,
            "host_us_per_tile": statistics.median(host) * 1e6 / max(tiles, 1)}


def resident_decode(batch: int, ctx: int, placement: str, kernel: str = "native", calls: int = 20) -> dict:
    """Exact decode with every block on the device: in place (no pool) or from a pool holding every context (its first
    forward per layer admits, in the warm-up); `rotation` layers, each its own KV, called in turn."""
    import activekv._backend as backend

    layers = rotation(batch, ctx)
    pool = 0 if placement == "in_place" else batch * ctx // BS
    tile = 512 if kernel == "aten" else 16
    eng = backend.Engine(layers, H, KVH, D, BS, DT, pool, tile, device=torch.device("cuda"), kernel=kernel,
                         placement=placement)
    kvs = [fill_host(batch, ctx, pinned=False) for _ in range(layers)]
    plan = decode_plan(eng, batch, ctx)
    q = torch.randn(batch, H, D, dtype=DT, device="cuda")
    out = torch.empty_like(q)
    it = itertools.cycle(range(layers))

    def step():
        layer = next(it)
        eng.forward(layer, plan, q, kvs[layer], out, D ** -0.5)

    if kernel == "aten":
        ms, kms = event_ms(step, calls=2, reps=3, warmup=layers), None
    else:
        ms, kms = event_ms(step, calls, warmup=2 * layers), device_ms(step, calls)
    snap = eng.snapshot()
    kv_bytes = batch * ctx * TOKEN_BYTES
    return {"batch": batch, "context": ctx, "placement": placement, "kernel": kernel, "layers": layers, "ms": ms,
            "kernel_ms": kms, "kv_GBps": kv_bytes / ms / 1e6,
            "kernel_kv_GBps": None if kms is None else kv_bytes / kms / 1e6,
            "batch_rows_per_forward": snap["decode_batch_rows"] / max(1, snap["forward_calls"])}


def split_sweep(batches, ctxs) -> list[dict]:
    """The decode batch's kernel time in place at each split (ACTIVEKV_CUDA_SPLIT), and the plan's own choice."""
    rows = []
    for b in batches:
        for c in ctxs:
            for split in (None, 16, 32, 64):
                if split is None:
                    os.environ.pop("ACTIVEKV_CUDA_SPLIT", None)
                else:
                    os.environ["ACTIVEKV_CUDA_SPLIT"] = str(split)
                r = resident_decode(b, c, "in_place", calls=10)
                rows.append({"batch": b, "context": c, "split": split or "plan", "ms": r["ms"],
                             "kernel_ms": r["kernel_ms"]})
                torch.cuda.empty_cache()
    os.environ.pop("ACTIVEKV_CUDA_SPLIT", None)
    return rows


DRIFT_A = 0.95  # AR(1) coefficient of the drifting queries: consecutive queries' correlation per component


def query_steps(n: int, batch: int, kind: str, a: float = DRIFT_A, device: str = "cuda") -> torch.Tensor:
    """Decode queries for `n` steps, [n, batch, H, D] bfloat16, generated before any timing.

    kind "random": independent standard normal queries; "drift": per query head and component an AR(1) process
    q_t = a * q_{t-1} + sqrt(1 - a^2) * eps_t (eps_t standard normal), started from a standard normal q_0, so every
    step's query is standard normal and consecutive queries correlate with coefficient a (a^k at lag k)."""
    if kind not in ("random", "drift"):
        raise ValueError(f"queries must be 'random' or 'drift', got {kind!r}")
    if not 0.0 <= a < 1.0:
        raise ValueError(f"the drift coefficient must be in [0, 1), got {a}")
    eps = torch.randn(n, batch, H, D, device=device)
    if kind == "random":
        return eps.to(DT)
    q = torch.empty_like(eps)
    q[0] = eps[0]
    for t in range(1, n):
        q[t] = a * q[t - 1] + (1.0 - a * a) ** 0.5 * eps[t]
    return q.to(DT)


COUNTERS = ("forward_calls", "compressed_rows", "union_blocks", "selected_blocks", "blocks_admitted", "blocks_evicted",
            "blocks_hit")


def counters(eng) -> dict:
    snap = eng.snapshot()
    return {k: snap[k] for k in COUNTERS}


def compressed_setup(batch: int, ctx: int, budget: int, tile_blocks: int, queries: str, steps: int,
                     kernel: str = "native", a: float = DRIFT_A):
    """An engine in compressed mode over a pinned host tier of `batch` rows of `ctx` random tokens (filled through
    update_kv, which also writes the per-block key metadata); returns (engine, step, pool blocks, distinct queries),
    step() being one Engine.forward of the whole batch's decode plan with the next query. "random" rotates 4 random
    queries; "drift" takes `steps` AR(1) queries in turn (one per call when `steps` covers the calls). The pool holds
    one worst-case union per row: KVH * (budget / BS - 3) + 3 blocks (1 sink, 2 recent)."""
    per_row = KVH * (budget // BS - 3) + 3
    pool_blocks = max(per_row * batch, tile_blocks)
    eng = make_engine(pool_blocks, tile_blocks, mode="compressed", budget=budget, kernel=kernel)
    kv = torch.empty((batch * ctx // BS, KVH, BS, 2 * D), dtype=DT).pin_memory()
    chunk = 1 << 14
    for start in range(0, batch * ctx, chunk):  # KV updates: fill the host tier and the per-block key metadata
        k = torch.randn(chunk, KVH, D, dtype=DT, device="cuda")
        eng.update_kv(0, k, torch.randn_like(k), kv, torch.arange(start, start + chunk, device="cuda"))
    plan = decode_plan(eng, batch, ctx)
    qs = query_steps(4 if queries == "random" else steps, batch, queries, a)
    out = torch.empty_like(qs[0])
    it = itertools.count()

    def step():
        eng.forward(0, plan, qs[next(it) % qs.shape[0]], kv, out, D ** -0.5)

    return eng, step, pool_blocks, qs.shape[0]


# Compressed steps run before any timing. Back-to-back steps after setup run slower for a dozen or so calls (H100,
# 16x32k drift: 11.87 ms per step by events over calls 5-16 after 4 warm-up calls, 7.47 over calls 29-40; 128k 15.7
# throughout) while the caching allocators grow to what steps in flight together hold; 16 reach the steady state.
COMPRESSED_WARMUP = 16


def compressed_decode(batch: int, ctx: int, budget: int, tile_blocks: int, kernel: str = "native",
                      queries: str = "random", a: float = DRIFT_A) -> dict:
    """Compressed decode: `warmup` calls, then CUDA events over `reps` runs of `calls` back-to-back calls (the timed
    steps), then the kernels' device time of `calls` more. Per-step counters come from the engine's snapshot: over
    every call before the device timing (admitted_per_step, union_blocks_per_row, as always reported) and over the
    timed steps only (*_timed, the steady state once the pool is warm)."""
    warmup, calls, reps = COMPRESSED_WARMUP, 4, 3
    eng, step, pool_blocks, distinct = compressed_setup(batch, ctx, budget, tile_blocks, queries,
                                                        warmup + reps * calls + 1 + calls, kernel, a)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    c0 = counters(eng)
    ms = event_ms(step, calls=calls, reps=reps, warmup=0)
    c1 = counters(eng)
    kms = device_ms(step, calls)
    timed = {k: c1[k] - c0[k] for k in COUNTERS}
    steps, tsteps = max(1, c1["forward_calls"]), max(1, timed["forward_calls"])
    union_timed = timed["union_blocks"] / max(1, timed["compressed_rows"])
    admitted_timed = timed["blocks_admitted"] / tsteps
    return {"batch": batch, "context": ctx, "kernel": kernel, "ms": ms,
            "union_blocks_per_row": c1["union_blocks"] / max(1, c1["compressed_rows"]),
            "admitted_per_step": c1["blocks_admitted"] / steps,
            "queries": queries, "drift_a": a if queries == "drift" else None, "distinct_queries": distinct,
            "kernel_ms": kms, "pool_blocks": pool_blocks,
            "evicted_per_step": c1["blocks_evicted"] / steps, "hit_per_step": c1["blocks_hit"] / steps,
            "timed_steps": timed["forward_calls"],
            "union_blocks_per_row_timed": union_timed,
            "selected_blocks_per_row_timed": timed["selected_blocks"] / max(1, timed["compressed_rows"]),
            "admitted_per_step_timed": admitted_timed,
            "evicted_per_step_timed": timed["blocks_evicted"] / tsteps,
            "hit_per_step_timed": timed["blocks_hit"] / tsteps,
            "admitted_union_ratio": admitted_timed / max(1e-9, batch * union_timed),
            "pool_over_batch_union": pool_blocks / max(1e-9, batch * union_timed)}


def batch_context(shape: str) -> tuple[int, int]:
    """'BATCHxCONTEXT' (context in tokens or with a k suffix, any case) -> (batch, context); ValueError when either is
    not an integer. The breakdown parsers check the ranges."""
    b, c = shape.lower().split("x")
    return int(b), int(c[:-1]) * 1024 if c.endswith("k") else int(c)


def parse_breakdown(spec: str) -> tuple[int, int, str]:
    """'BATCHxCONTEXT[:QUERIES]' (context in tokens or with a k suffix, queries random or drift) -> (batch, context,
    queries); e.g. '16x32k', '16x131072:drift'."""
    shape, _, queries = spec.partition(":")
    queries = queries or "random"
    try:
        batch, ctx = batch_context(shape)
    except ValueError:
        msg = f"expected BATCHxCONTEXT[:random|drift] such as 16x32k, got {spec!r}"
        raise argparse.ArgumentTypeError(msg) from None
    if batch < 1 or ctx < BS or ctx % BS or queries not in ("random", "drift"):
        raise argparse.ArgumentTypeError(f"expected a batch >= 1, a context that is a multiple of {BS} and queries "
                                         f"random or drift, got {spec!r}")
    return batch, ctx, queries


BREAKDOWN_DEFAULT = ("16x32k", "16x128k")


def compressed_breakdown(batch: int, ctx: int, queries: str, out: Path, calls: int = 4, top: int = 15,
                         a: float = DRIFT_A) -> dict:
    """torch.profiler (CPU and CUDA activities) around `calls` compressed forwards after COMPRESSED_WARMUP calls, each
    inside a record_function range "bench::engine_forward" (its self CPU time is the engine's host work outside ATen
    ops and its own named ranges). Writes the top `top` rows by self CPU time and by self CUDA time to a text file
    under `out`;
    returns a summary (per step: wall time, profiled device time, counters) for the JSON."""
    from torch.profiler import ProfilerActivity, profile, record_function

    warmup = COMPRESSED_WARMUP
    eng, step, pool_blocks, _ = compressed_setup(batch, ctx, 2048, 64, queries, warmup + 2 * calls, a=a)
    for _ in range(warmup):
        step()
    torch.cuda.synchronize()
    c0 = counters(eng)
    t0 = time.perf_counter()
    for _ in range(calls):  # unprofiled wall time of the same kind of steps, for scale
        step()
    torch.cuda.synchronize()
    wall_ms = (time.perf_counter() - t0) * 1e3 / calls
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            with record_function("bench::engine_forward"):
                step()
        torch.cuda.synchronize()
    c1 = counters(eng)
    d = {k: (c1[k] - c0[k]) / (2 * calls) for k in COUNTERS if k != "forward_calls"}
    avgs = prof.key_averages()

    def self_dev(e) -> float:
        v = getattr(e, "self_device_time_total", None)
        return float(e.self_cuda_time_total if v is None else v)

    name = f"compressed_breakdown_b{batch}_{ctx // 1024}k_{queries}.txt"
    cuda, cpu = torch.autograd.DeviceType.CUDA, torch.autograd.DeviceType.CPU

    def on_device(e) -> bool:  # kernels and copies; not the record_function ranges kineto mirrors on the GPU
        return e.device_type == cuda and not getattr(e, "is_user_annotation", False)

    device_us = sum(e.time_range.elapsed_us() for e in prof.events() if on_device(e))
    fwd = [e for e in prof.events() if e.name == "bench::engine_forward" and e.device_type == cpu]
    union = d["union_blocks"] * 2 * calls / max(1, c1["compressed_rows"] - c0["compressed_rows"])
    summary = {"batch": batch, "context": ctx, "queries": queries, "drift_a": a if queries == "drift" else None,
               "profiled_steps": calls,
               "wall_ms_per_step": wall_ms,
               "forward_cpu_ms_per_step": sum(e.cpu_time_total for e in fwd) / 1e3 / calls,
               "forward_self_cpu_ms_per_step": sum(e.self_cpu_time_total for e in fwd) / 1e3 / calls,
               "device_ms_per_step": device_us / 1e3 / calls,
               "pool_blocks": pool_blocks, "union_blocks_per_row": union,
               "pool_over_batch_union": pool_blocks / max(1e-9, batch * union),
               "admitted_per_step": d["blocks_admitted"], "evicted_per_step": d["blocks_evicted"],
               "hit_per_step": d["blocks_hit"],
               "top_self_cpu": [{"name": e.key, "calls": e.count, "self_cpu_ms_per_step": e.self_cpu_time_total
                                 / 1e3 / calls} for e in sorted(avgs, key=lambda e: -e.self_cpu_time_total)[:5]],
               "top_self_cuda": [{"name": e.key, "calls": e.count, "self_cuda_ms_per_step": self_dev(e) / 1e3 / calls}
                                 for e in sorted(filter(on_device, avgs), key=lambda e: -self_dev(e))[:5]],
               "file": name}
    head = (f"compressed decode, batch {batch}, context {ctx}, {queries} queries, budget 2048: {calls} profiled "
            f"Engine.forward calls after {warmup} warm-up calls and {calls} unprofiled ones.\n"
            f"unprofiled wall {wall_ms:.2f} ms/step; profiled: host in Engine.forward "
            f"{summary['forward_cpu_ms_per_step']:.2f} ms/step, of it outside ATen ops and named ranges "
            f"{summary['forward_self_cpu_ms_per_step']:.2f}; device (kernels and copies) "
            f"{summary['device_ms_per_step']:.2f} ms/step.\n"
            f"pool {pool_blocks} blocks = {summary['pool_over_batch_union']:.2f} x batch x union "
            f"({union:.0f} blocks/row); per step (unprofiled and profiled calls): admitted {d['blocks_admitted']:.0f}, "
            f"evicted {d['blocks_evicted']:.0f}, hit {d['blocks_hit']:.0f}.\n"
            "bench::engine_forward's self CPU time is the engine's host work outside ATen ops and its named ranges "
            "(activekv::select_blocks, activekv::quest_scores_native); the profiler adds its own overhead on the "
            "host.\n")
    text = (head + f"\n## top {top} by self CPU time\n\n"
            + avgs.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60)
            + f"\n\n## top {top} by self CUDA time\n\n"
            + avgs.table(sort_by="self_cuda_time_total", row_limit=top, max_name_column_width=60) + "\n")
    (out / name).write_text(text)
    print(text, flush=True)
    return summary


STREAMED_BREAKDOWN_DEFAULT = ("1x128k:256", "1x32k:128", "16x128k:256")
STREAMED_POOL_TOKENS = 16384  # the streamed section's and breakdown's pool


def parse_streamed(spec: str) -> tuple[int, int, int]:
    """'BATCHxCONTEXT[:TILE]' (context in tokens or with a k suffix, tile in blocks, default 256) -> (batch, context,
    tile); e.g. '1x128k:256', '1x32k:128'."""
    msg = f"expected BATCHxCONTEXT[:TILE] such as 1x128k:256 (TILE in blocks), got {spec!r}"
    head, sep, tile = spec.partition(":")
    try:
        batch, ctx = batch_context(head)
        tile_blocks = int(tile) if sep else 256
    except ValueError:
        raise argparse.ArgumentTypeError(msg) from None
    pool = STREAMED_POOL_TOKENS // BS
    if batch < 1:
        raise argparse.ArgumentTypeError(f"the batch must be >= 1, got {spec!r}")
    if ctx < BS or ctx % BS:
        raise argparse.ArgumentTypeError(f"the context must be a positive multiple of {BS} tokens, got {spec!r}")
    if not 1 <= tile_blocks <= pool:
        raise argparse.ArgumentTypeError(f"the tile must be 1 to {pool} blocks (the pool of {STREAMED_POOL_TOKENS} "
                                         f"tokens), got {spec!r}")
    if batch * ctx <= STREAMED_POOL_TOKENS:
        raise argparse.ArgumentTypeError(f"batch x context must exceed the pool's {STREAMED_POOL_TOKENS} tokens, or "
                                         f"nothing streams (the step is attended from the pool), got {spec!r}")
    return batch, ctx, tile_blocks


def trace_stats(events: list[dict], steps: int, big_bytes: int = 1 << 20) -> dict:
    """Per step, from a Chrome trace's events (torch.profiler's export): the host-to-device copies of at least
    `big_bytes` (the tiles' reads), the time the copy engine spent on them, the gaps between consecutive ones and how
    many of those gaps the host caused (the copy's enqueueing call began after the previous copy had ended), the
    kernels' device time and how long kernels ran on after the last such copy had ended (the tail: attention that did
    not overlap the copies), and the host's CUDA runtime calls by total time."""
    copies = sorted((e for e in events if e.get("cat") == "gpu_memcpy" and "HtoD" in e.get("name", "")
                     and e.get("args", {}).get("bytes", 0) >= big_bytes), key=lambda e: e["ts"])
    runtime = {e["args"]["correlation"]: e for e in events if e.get("cat") == "cuda_runtime"
               and "correlation" in e.get("args", {})}
    gaps, host_late, host_late_us = [], 0, 0.0
    for prev, cur in zip(copies, copies[1:]):
        gap = cur["ts"] - (prev["ts"] + prev["dur"])
        gaps.append(max(0.0, gap))
        call = runtime.get(cur.get("args", {}).get("correlation"))
        if gap > 0 and call is not None and call["ts"] > prev["ts"] + prev["dur"]:
            host_late += 1
            host_late_us += gap
    busy = sum(e["dur"] for e in copies)
    nbytes = sum(e["args"]["bytes"] for e in copies)
    kernels = [e for e in events if e.get("cat") == "kernel"]
    calls: dict[str, list[float]] = {}
    for e in events:
        if e.get("cat") == "cuda_runtime":
            calls.setdefault(e["name"], []).append(e["dur"])
    top = sorted(calls.items(), key=lambda kv: -sum(kv[1]))[:6]
    span = (copies[-1]["ts"] + copies[-1]["dur"] - copies[0]["ts"]) if copies else 0.0
    # Device work still running after the last tile copy ended: attention the compute stream could not overlap.
    last = copies[-1]["ts"] + copies[-1]["dur"] if copies else None
    tail = (max((e["ts"] + e["dur"] - last for e in kernels if e["ts"] + e["dur"] > last), default=0.0)
            if copies else 0.0)
    ordered = sorted(gaps)
    return {"copies_per_step": len(copies) / steps, "copy_bytes_per_step": nbytes / steps,
            "copy_busy_ms_per_step": busy / 1e3 / steps,
            "copy_engine_GBps": nbytes / busy / 1e3 if busy else None,
            "copy_span_ms_per_step": span / 1e3 / steps,
            "gap_ms_per_step": sum(gaps) / 1e3 / steps,
            "gap_median_us": statistics.median(gaps) if gaps else None,
            "gap_p90_us": ordered[int(0.9 * (len(ordered) - 1))] if gaps else None,
            "gaps_host_late": host_late, "gaps": len(gaps), "host_late_ms_per_step": host_late_us / 1e3 / steps,
            "kernel_ms_per_step": sum(e["dur"] for e in kernels) / 1e3 / steps,
            "tail_ms_per_step": tail / 1e3 / steps,
            "runtime_calls": [{"name": n, "calls_per_step": len(d) / steps, "ms_per_step": sum(d) / 1e3 / steps,
                               "max_us": max(d)} for n, d in top]}


def streamed_breakdown(batch: int, ctx: int, tile_blocks: int, out: Path, pool_tokens: int = STREAMED_POOL_TOKENS,
                       calls: int = 4) -> dict:
    """Streamed exact decode (mapped transfer, its own read, CUDA kernel) profiled by torch.profiler over `calls`
    forwards after warm-up: where the copy engine waits (trace_stats), beside the unprofiled step time. The trace is
    written gzipped under `out`."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    eng = make_engine(pool_tokens // BS, tile_blocks)
    kv = fill_host(batch, ctx, pinned=True)
    plan = decode_plan(eng, batch, ctx)
    q = torch.randn(batch, H, D, dtype=DT, device="cuda")
    out_t = torch.empty_like(q)

    def step():
        eng.forward(0, plan, q, kv, out_t, D ** -0.5)

    ms = event_ms(step, calls=calls, reps=3, warmup=2)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            step()
        torch.cuda.synchronize()
    name = f"streamed_trace_b{batch}_{ctx // 1024}k_t{tile_blocks}.json"
    path = out / name
    prof.export_chrome_trace(str(path))
    trace = json.loads(path.read_text())
    with gzip.open(str(path) + ".gz", "wt") as f:
        json.dump(trace, f)
    path.unlink()
    events = trace["traceEvents"] if isinstance(trace, dict) else trace
    st = trace_stats(events, calls)
    kv_bytes = batch * ctx * TOKEN_BYTES
    r = {"batch": batch, "context": ctx, "tile_blocks": tile_blocks, "pool_tokens": pool_tokens, "ms": ms,
         "kv_GBps": kv_bytes / ms / 1e6, "file": name + ".gz", **st}
    print(f"streamed b{batch} {ctx // 1024}k tile {tile_blocks}: {ms:.2f} ms/step ({r['kv_GBps']:.1f} GB/s); "
          f"profiled per step: {st['copies_per_step']:.0f} copies of >= 1 MiB, busy {st['copy_busy_ms_per_step']:.2f}"
          f" ms at {st['copy_engine_GBps'] or 0:.1f} GB/s, gaps {st['gap_ms_per_step']:.2f} ms (median "
          f"{st['gap_median_us'] or 0:.0f} us, p90 {st['gap_p90_us'] or 0:.0f}; {st['gaps_host_late']} of "
          f"{st['gaps']} host-late, {st['host_late_ms_per_step']:.2f} ms), kernels {st['kernel_ms_per_step']:.2f} ms",
          flush=True)
    for c in st["runtime_calls"]:
        print(f"  {c['name']}: {c['calls_per_step']:.0f} calls {c['ms_per_step']:.2f} ms/step, max {c['max_us']:.0f} us")
    return r


def streamed_breakdown_table(res: dict) -> list[str]:
    """One row per profiled streamed configuration (--streamed-breakdown)."""
    lines = ["| batch | context | tile blocks | ms/step | KV GB/s | copies/step | copy engine busy ms | its GB/s | "
             "gaps ms/step | median gap us | host-late gaps | their ms/step | kernels ms/step | kernels after the last "
             "copy ms/step | largest host call |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res.get("streamed_breakdown", []):
        top = r["runtime_calls"][0] if r.get("runtime_calls") else None
        largest = "-" if top is None else f"{top['name']} {top['ms_per_step']:.2f} ms ({top['calls_per_step']:.0f})"
        rate = "-" if r.get("copy_engine_GBps") is None else f"{r['copy_engine_GBps']:.1f}"
        med = "-" if r.get("gap_median_us") is None else f"{r['gap_median_us']:.0f}"
        tail = "-" if r.get("tail_ms_per_step") is None else f"{r['tail_ms_per_step']:.2f}"
        lines.append(f"| {r['batch']} | {r['context'] // 1024}k | {r['tile_blocks']} | {r['ms']:.2f} | "
                     f"{r['kv_GBps']:.1f} | {r['copies_per_step']:.0f} | {r['copy_busy_ms_per_step']:.2f} | {rate} | "
                     f"{r['gap_ms_per_step']:.2f} | {med} | {r['gaps_host_late']} of {r['gaps']} | "
                     f"{r['host_late_ms_per_step']:.2f} | {r['kernel_ms_per_step']:.2f} | {tail} | {largest} |")
    return lines


def ceilings_table(res: dict) -> list[str]:
    c = res["ceilings"]
    return ["| pinned H2D GB/s | pinned D2H GB/s | D2D GB/s (read+write) |", "|---|---|---|",
            f"| {c['h2d_GBps']:.1f} | {c['d2h_GBps']:.1f} | {c['d2d_GBps']:.0f} |"]


def blocks_table(res: dict) -> list[str]:
    """One row per block size. copy_blocks_mapped is the whole call, one at a time (host work, the read over the bus on
    the copy stream, the scatter into dst on the compute stream): with its own choice over scattered ids, the same
    calls back to back (8 between two CUDA events, as the engine issues them), over ids in order (one run), then
    forced onto the copy engines and onto the gather kernel over the scattered ids; its gather kernel alone is the
    device time of that kernel (- where the data or the build has none)."""
    lines = ["| block | blocks | copy_blocks_mapped GB/s | back to back GB/s | in order GB/s | copy engines GB/s | "
             "gather kernel GB/s | its kernel alone GB/s | copy_blocks_staged GB/s | one plain copy GB/s | "
             "mapped / plain | one `copy_` per block GB/s |", "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in res["blocks"]:
        pb = "-" if r["per_block_copy_GBps"] is None else f"{r['per_block_copy_GBps']:.2f}"
        size = f"{r['block_KiB']} KiB" if r["block_KiB"] < 1024 else f"{r['block_KiB'] // 1024} MiB"
        lines.append(f"| {size} | {r['blocks']} | {r['mapped_GBps']:.1f} | "
                     f"{_cell(r, 'mapped_back_to_back_GBps', '.1f')} | {_cell(r, 'mapped_in_order_GBps', '.1f')} | "
                     f"{_cell(r, 'mapped_dma_GBps', '.1f')} | {_cell(r, 'mapped_gather_GBps', '.1f')} | "
                     f"{_cell(r, 'gather_kernel_GBps', '.1f')} | "
                     f"{r['staged_GBps']:.1f} | {r['plain_GBps']:.1f} | {r['mapped_GBps'] / r['plain_GBps']:.2f} | "
                     f"{pb} |")
    return lines


def gather_table(res: dict) -> list[str]:
    """copy_blocks_mapped by CTA count of its gather kernel, a column pair per block size: GB/s, and its ratio to one
    plain copy where the blocks section has it."""
    plain = {r["block_KiB"]: r["plain_GBps"] for r in res.get("blocks", [])}
    sizes = sorted({r["block_KiB"] for r in res["gather"]})
    rate = {(r["block_KiB"], r["ctas"], r["default"]): r["mapped_GBps"] for r in res["gather"]}
    lines = ["| gather CTAs | " + " | ".join(f"{k} KiB GB/s | {k} KiB / plain" for k in sizes) + " |",
             "|---|" + "---|---|" * len(sizes)]
    for ctas, default in dict.fromkeys((r["ctas"], r["default"]) for r in res["gather"]):
        cells = []
        for k in sizes:
            g = rate.get((k, ctas, default))
            cells += ["-" if g is None else f"{g:.1f}", "-" if g is None or k not in plain else f"{g / plain[k]:.2f}"]
        lines.append(f"| {ctas}{' (default)' if default else ''} | " + " | ".join(cells) + " |")
    return lines


def gather_line(res: dict) -> str:
    """The CTA sweep (the JSON's "gather") in one sentence: per block size, the rate at each count below 8 CTAs, the
    range from 8 up, and the default's."""
    parts = []
    for k in sorted({r["block_KiB"] for r in res["gather"]}):
        rows = [r for r in res["gather"] if r["block_KiB"] == k]
        low = [f"{r['mapped_GBps']:.1f} GB/s at {r['ctas']}" for r in rows if r["ctas"] < 8 and not r["default"]]
        high = [r for r in rows if r["ctas"] >= 8 and not r["default"]]
        default = next((r for r in rows if r["default"]), None)
        if high:
            low.append(f"{min(r['mapped_GBps'] for r in high):.1f}-{max(r['mapped_GBps'] for r in high):.1f} from "
                       f"{min(r['ctas'] for r in high)} to {max(r['ctas'] for r in high)}")
        part = f"{k} KiB blocks " + ", ".join(low)
        if default is not None:
            part += f" (the default, {default['ctas']}: {default['mapped_GBps']:.1f})"
        parts.append(part)
    return "copy_blocks_mapped by CTA count of its gather kernel (`ACTIVEKV_GATHER_CTAS`): " + "; ".join(parts) + "."


def streamed_table(res: dict) -> list[str]:
    """One row per run; "read" is the mapped transfer's way over the bus: its own choice (copy engines for a tile's
    run of 256 blocks in order, 16 MiB), or its gather kernel forced (- for staged, or data without the field)."""
    lines = ["| batch | transfer | read | kernel | ms/step | H2D GB/s achieved | / pinned H2D ceiling |",
             "|---|---|---|---|---|---|---|"]
    for r in res["streamed"]:
        rate = r["h2d_bytes_per_step"] / (r["ms"] / 1e3) / 1e9
        read = {"own": "own choice", None: "-"}.get(r.get("read"), r.get("read"))
        lines.append(f"| {r['batch']} | {r['transfer']} | {read} | {r['kernel']} | {r['ms']:.2f} | {rate:.1f} | "
                     f"{rate / res['ceilings']['h2d_GBps']:.2f} |")
    return lines


def small_tiles_table(res: dict) -> list[str]:
    """One row per configuration and tile size; each way of passing a tile's ids measured at it side by side."""
    ceiling = res.get("ceilings", {}).get("h2d_GBps")
    lines = ["| batch | context | pool blocks | tile blocks (MiB) | its bus time us | ids in the launch: ms/step | "
             "/ pinned H2D ceiling | host us per tile | uploaded: ms/step | / pinned H2D ceiling | host us per tile |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    keys: list[tuple[int, int, int, int]] = []
    for r in res["small_tiles"]:
        key = (r["batch"], r["context"], r["pool_blocks"], r["tile_blocks"])
        if key not in keys:
            keys.append(key)

    def arm(key: tuple[int, int, int, int], ids: str) -> list[str]:
        r = next((r for r in res["small_tiles"] if (r["batch"], r["context"], r["pool_blocks"], r["tile_blocks"]) == key
                  and r["ids"] == ids), None)
        if r is None:
            return ["-", "-", "-"]
        rate = r["h2d_bytes_per_step"] / (r["ms"] / 1e3) / 1e9
        return [f"{r['ms']:.2f}", f"{rate / ceiling:.2f}" if ceiling else "-", f"{r['host_us_per_tile']:.0f}"]

    for key in keys:
        batch, ctx, pool, tile = key
        tile_bytes = tile * BLOCK_BYTES
        bus_us = f"{tile_bytes / (ceiling * 1e3):.0f}" if ceiling else "-"
        cells = [str(batch), f"{ctx // 1024}k", str(pool), f"{tile} ({tile_bytes / 2**20:g})", bus_us,
                 *arm(key, "in the launch"), *arm(key, "uploaded")]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def resident_table(res: dict) -> list[str]:
    lines = ["| batch | context | SDPA flash ms | its KV GB/s | in place: forward ms | kernel ms | KV GB/s | "
             "/ SDPA rate | kernel / SDPA kernel rate | pool-resident: forward ms | kernel ms | / SDPA rate | "
             "ATen path ms |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    pool = {(r["batch"], r["context"]): r for r in res.get("resident_pool", [])}
    aten = {(r["batch"], r["context"]): r for r in res.get("resident_aten", [])}
    for a, sd in zip(res["resident"], res["sdpa"], strict=True):
        key = (a["batch"], a["context"])
        p, t = pool.get(key), aten.get(key)
        pool_cells = f"{p['ms']:.3f} | {p['kernel_ms']:.3f} | {sd['ms'] / p['ms']:.2f}" if p else "- | - | -"
        aten_cell = f"{t['ms']:.2f}" if t else "-"
        lines.append(f"| {a['batch']} | {a['context'] // 1024}k | {sd['ms']:.3f} | {sd['kv_GBps']:.0f} | "
                     f"{a['ms']:.3f} | {a['kernel_ms']:.3f} | {a['kv_GBps']:.0f} | {sd['ms'] / a['ms']:.2f} | "
                     f"{sd['kernel_ms'] / a['kernel_ms']:.2f} | {pool_cells} | {aten_cell} |")
    return lines


def sweep_table(rows: list[dict]) -> list[str]:
    lines = ["| batch | context | split | forward ms | kernel ms |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['context'] // 1024}k | {r['split']} | {r['ms']:.3f} | {r['kernel_ms']:.3f} |"
              for r in rows]
    return lines


def _cell(r: dict, key: str, fmt: str) -> str:
    return "-" if r.get(key) is None else format(r[key], fmt)


def compressed_table(res: dict) -> list[str]:
    """One row per (batch, context, queries). "all calls" counts every call up to the timed ones (the cold pool's first
    admissions included); "timed" counts the timed steps only; union = batch x union blocks per row."""
    lines = ["| batch | context | queries | compressed ms | kernel ms | union blocks/row | admitted blocks/step, all "
             "calls | timed: admitted/step | admitted / union | evicted/step | hit/step | pool / union | SDPA ms | "
             "SDPA / compressed |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    sd = {(s["batch"], s["context"]): s["ms"] for s in res["sdpa"]}
    for r in res["compressed"]:
        s = sd[(r["batch"], r["context"])]
        queries = r.get("queries", "random") + (f" (a={r['drift_a']})" if r.get("drift_a") is not None else "")
        lines.append(f"| {r['batch']} | {r['context'] // 1024}k | {queries} | {r['ms']:.2f} | "
                     f"{_cell(r, 'kernel_ms', '.2f')} | {r['union_blocks_per_row']:.0f} | "
                     f"{r['admitted_per_step']:.0f} | {_cell(r, 'admitted_per_step_timed', '.0f')} | "
                     f"{_cell(r, 'admitted_union_ratio', '.3f')} | {_cell(r, 'evicted_per_step_timed', '.0f')} | "
                     f"{_cell(r, 'hit_per_step_timed', '.0f')} | {_cell(r, 'pool_over_batch_union', '.2f')} | "
                     f"{s:.3f} | {s / r['ms']:.3f} |")
    return lines


TARGET_BATCH, TARGET_CONTEXT, TARGET_SDPA_FACTOR, TARGET_ADMITTED_RATIO = 16, 131072, 2.0, 0.10


def compressed_targets(res: dict) -> list[str]:
    """The compressed target, checked on the drifting-query row at batch 16, 128k: at most 2x SDPA flash's time (the
    full context resident), or admitted blocks per timed step at most 10% of the union (batch x union blocks per row).
    """
    row = next((r for r in res.get("compressed", []) if r.get("queries") == "drift"
                and (r["batch"], r["context"]) == (TARGET_BATCH, TARGET_CONTEXT)), None)
    head = (f"Target: compressed decode at batch {TARGET_BATCH}, {TARGET_CONTEXT // 1024}k, drifting queries, at most "
            f"{TARGET_SDPA_FACTOR:g}x SDPA flash's time, or admitted blocks per step at most "
            f"{TARGET_ADMITTED_RATIO:.0%} of the union")
    if row is None:
        return [head + ": not measured (no drifting-query row at that batch and context)."]
    sdpa = next(s["ms"] for s in res["sdpa"] if (s["batch"], s["context"]) == (TARGET_BATCH, TARGET_CONTEXT))
    time_ok = row["ms"] <= TARGET_SDPA_FACTOR * sdpa
    ratio_ok = row["admitted_union_ratio"] <= TARGET_ADMITTED_RATIO
    line = (head + f": {row['ms']:.2f} ms against {TARGET_SDPA_FACTOR:g} x {sdpa:.3f} = "
            f"{TARGET_SDPA_FACTOR * sdpa:.3f} ms ({'met' if time_ok else 'not met'}); admitted / union "
            f"{row['admitted_union_ratio']:.3f} ({'met' if ratio_ok else 'not met'}); "
            f"target {'met' if time_ok or ratio_ok else 'not met'}.")
    h2d = res.get("ceilings", {}).get("h2d_GBps")
    sel, union = row.get("selected_blocks_per_row_timed"), row.get("union_blocks_per_row_timed")
    if h2d and sel and union and row.get("admitted_per_step_timed") is not None:
        bus = row["admitted_per_step_timed"] * BLOCK_BYTES / (h2d * 1e6)
        limit = TARGET_SDPA_FACTOR * sdpa
        line += (f" The admitted bytes alone take {bus:.2f} ms on the pinned bus ({row['admitted_per_step_timed']:.0f} "
                 f"blocks of {BLOCK_BYTES >> 10} KiB at {h2d:.1f} GB/s), {'above' if bus > limit else 'within'} "
                 f"{limit:.3f} ms: a block is admitted with all {KVH} KV heads' K and V, while each head reads only "
                 f"the blocks it selected ({sel:.0f} per row over a union of {union:.0f}: {sel / union:.2f} heads per "
                 f"admitted block, {sel / (union * KVH):.0%} of the bytes admitted).")
    return [line]


def breakdown_table(res: dict) -> list[str]:
    """One row per profiled configuration (--compressed-breakdown): wall time per step, the host's time in
    Engine.forward and its part outside ATen ops and named ranges, the device's (kernels and copies, both streams
    summed), the blocks admitted per step and the time those bytes take on the pinned bus (the step's floor when
    admission is bus-bound), and the host's largest self cost."""
    lines = ["| batch | context | queries | wall ms/step | host in forward ms | of it outside ops ms | device ms | "
             "admitted blocks/step | their bus time ms | largest host self cost |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    h2d = res.get("ceilings", {}).get("h2d_GBps")
    for r in res.get("compressed_breakdown", []):
        queries = r["queries"] + (f" (a={r['drift_a']})" if r.get("drift_a") is not None else "")
        bus = "-" if not h2d else f"{r['admitted_per_step'] * BLOCK_BYTES / (h2d * 1e6):.2f}"
        top = r["top_self_cpu"][0] if r.get("top_self_cpu") else None
        largest = "-" if top is None else f"{top['name']} {top['self_cpu_ms_per_step']:.2f} ms ({top['calls']} calls)"
        lines.append(f"| {r['batch']} | {r['context'] // 1024}k | {queries} | {r['wall_ms_per_step']:.2f} | "
                     f"{r['forward_cpu_ms_per_step']:.2f} | {r['forward_self_cpu_ms_per_step']:.2f} | "
                     f"{r['device_ms_per_step']:.2f} | {r['admitted_per_step']:.0f} | {bus} | {largest} |")
    return lines


PLOT_SERIES = (("resident", "ActiveKV exact, in place on the device"),
               ("resident_pool", "ActiveKV exact, pool-resident"),
               ("resident_aten", "ActiveKV exact, pool-resident, ATen path"),
               ("streamed", "ActiveKV exact, streamed from a pinned host tier"),
               ("compressed", "ActiveKV compressed 2048, pinned host tier"),
               ("sdpa", "SDPA flash, resident"),
               ("compressed_drift", "ActiveKV compressed 2048, pinned host tier, drifting queries"))


def series_rows(res: dict, key: str) -> list[dict]:
    """The rows a plot series draws: "compressed" the random-query rows, "compressed_drift" the drifting ones, the
    streamed series its mapped transfer with the CUDA kernel, reading as it chooses."""
    if key in ("compressed", "compressed_drift"):
        want = "drift" if key == "compressed_drift" else "random"
        return [r for r in res.get("compressed", []) if r.get("queries", "random") == want]
    if key == "streamed":
        return [r for r in res.get(key, []) if (r["transfer"], r["kernel"], r.get("read", "own"))
                == ("mapped", "native", "own")]
    return res.get(key, [])


def plot(res: dict, path: Path) -> None:
    """ms per decode step against context, one panel per batch, log scales with the measured contexts as ticks and the
    legend below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, NullLocator

    batches = sorted({r["batch"] for r in res["resident"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(9, 4.2), sharey=True)
    markers = "osxD^v<"
    for ax, batch in zip(axes, batches, strict=True):
        contexts: set[int] = set()
        for (key, label), marker in zip(PLOT_SERIES, markers, strict=False):
            pts = sorted((r["context"], r["ms"]) for r in series_rows(res, key) if r["batch"] == batch)
            if not pts and key == "compressed_drift":
                continue
            contexts.update(p[0] for p in pts)
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker=marker, label=label)
        if "ceilings" in res and contexts:  # the floor: the step's K and V read once at the device copy rate
            cs = sorted(contexts)
            ax.plot(cs, [batch * c * TOKEN_BYTES / (res["ceilings"]["d2d_GBps"] * 1e6) for c in cs], "k--",
                    lw=1, label="KV bytes at the device copy rate (ceiling)")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.xaxis.set_minor_locator(NullLocator())
        ax.xaxis.set_minor_formatter(NullFormatter())
        ax.yaxis.set_minor_formatter(NullFormatter())
        ax.set_xticks(sorted(contexts), [f"{c // 1024}k" for c in sorted(contexts)])
        ax.set_xlabel("context (tokens)")
        ax.set_title(f"batch {batch}")
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("ms per decode step, one layer (log)")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=2, frameon=False)
    fig.suptitle(f"{res['device']}: 32 query / 8 KV heads, head size 128, bfloat16, block 16")
    fig.tight_layout(rect=(0, 0.22, 1, 1))
    fig.savefig(path, dpi=110, metadata={"Software": None})
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m tools.bench_gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("build/gpu"),
                    help="folder for gpu_bench.json, the plot and the breakdowns (default build/gpu)")
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    ap.add_argument("--sections", nargs="*", choices=SECTIONS, default=list(SECTIONS), metavar="SECTION",
                    help="sections to run, of " + ", ".join(SECTIONS) + " (default all; none: only the breakdowns "
                         "asked for)")
    ap.add_argument("--split-sweep", action="store_true", help="also time the decode batch at each split")
    ap.add_argument("--drift", type=float, default=DRIFT_A, metavar="A",
                    help=f"AR(1) coefficient of the compressed section's drifting queries (default {DRIFT_A})")
    ap.add_argument("--compressed-breakdown", nargs="*", type=parse_breakdown, metavar="BATCHxCONTEXT[:QUERIES]",
                    help="profile compressed decode (torch.profiler, CPU and CUDA) at these configurations (default "
                         + " and ".join(BREAKDOWN_DEFAULT) + ", random queries); print and write the top host and "
                         "device costs under --out")
    ap.add_argument("--streamed-breakdown", nargs="*", type=parse_streamed, metavar="BATCHxCONTEXT[:TILE]",
                    help="profile streamed exact decode (pool 16k tokens, TILE in blocks, default 256) at these "
                         "configurations (default "
                         + " ".join(STREAMED_BREAKDOWN_DEFAULT) + "): the copy engine's busy time and gaps, the "
                         "host's CUDA calls; the traces are written gzipped under --out")
    args = ap.parse_args()
    if args.compressed_breakdown == []:
        args.compressed_breakdown = [parse_breakdown(b) for b in BREAKDOWN_DEFAULT]
    if args.streamed_breakdown == []:
        args.streamed_breakdown = [parse_streamed(b) for b in STREAMED_BREAKDOWN_DEFAULT]
    if not 0.0 <= args.drift < 1.0:
        ap.error(f"--drift must be in [0, 1), got {args.drift}")
    if not torch.cuda.is_available():
        print("tools.bench_gpu needs a CUDA device: torch.cuda.is_available() is False (torch "
              f"{torch.__version__}); run it on the device (`make gpu-check`)", file=sys.stderr)
        sys.exit(2)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                 "command": shlex.join(["python", "-m", "tools.bench_gpu", *sys.argv[1:]])}
    want = set(args.sections)

    def save() -> None:
        """Write what is measured so far: a run cut off by a time limit still leaves its finished sections."""
        (args.out / "gpu_bench.json").write_text(json.dumps(res, indent=1))

    ctxs = [32768, 131072] if args.quick else [32768, 65536, 131072]
    batches = (1, 16)
    if "ceilings" in want:
        res["ceilings"] = ceilings()
        print(f"## ceilings ({res['device']}, torch {res['torch']})\n")
        print("\n".join(ceilings_table(res)) + "\n", flush=True)
        save()

    if "blocks" in want:
        res["blocks"] = block_batches(args.quick)
        print("## block batches, 256 MiB, host tier pinned -> device\n")
        print("\n".join(blocks_table(res)) + "\n", flush=True)
        res["gather"] = gather_sweep()
        if res["gather"]:
            print("## mapped gather by CTA count (ACTIVEKV_GATHER_CTAS), 256 MiB, host tier pinned -> device\n")
            print("\n".join(gather_table(res)) + "\n", flush=True)
        else:
            print("(no CUDA gather kernel in this build: copy_blocks_mapped uses index_select; no CTA sweep)\n")
        save()

    if "streamed" in want:
        res["streamed"] = [exact_decode(b, 131072, True, STREAMED_POOL_TOKENS, 256, tr, kn, rd) for b in batches
                           for tr, kn, rd in (("mapped", "native", "own"), ("mapped", "native", "gather kernel"),
                                              ("mapped", "aten", "own"), ("staged", "native", "own"))]
        print("## streamed exact decode: 128k context in a pinned host tier, pool 16k tokens, tile 256 blocks\n")
        if "ceilings" in res:
            print("\n".join(streamed_table(res)) + "\n", flush=True)
        save()

    if "small_tiles" in want:
        res["small_tiles"] = [small_tile_decode(b, c, ids, tile) for c in SMALL_TILE_CONTEXTS
                              for b in SMALL_TILE_BATCHES for tile, ids in SMALL_TILE_ARMS]
        print("## streamed exact decode with small tiles (pool 1/8 of a row's context, tiles of half of it and of "
              "all of it)\n")
        print("\n".join(small_tiles_table(res)) + "\n", flush=True)
        save()

    if "resident" in want or "compressed" in want:
        res["sdpa"] = []
        for b in batches:
            for c in ctxs:
                res["sdpa"].append(sdpa_decode(b, c, calls=20))
                torch.cuda.empty_cache()
    if "resident" in want:
        res["resident"], res["resident_pool"], res["resident_aten"] = [], [], []
        for b in batches:
            for c in ctxs:
                res["resident"].append(resident_decode(b, c, "in_place"))
                torch.cuda.empty_cache()
                res["resident_pool"].append(resident_decode(b, c, "pool"))
                torch.cuda.empty_cache()
                res["resident_aten"].append(resident_decode(b, c, "pool", kernel="aten"))
                torch.cuda.empty_cache()
        print("## resident exact decode vs SDPA flash (KV read rate = K and V bytes / step time; CUDA events over "
              "back-to-back calls; kernel = device time of the calls' kernels)\n")
        print("\n".join(resident_table(res)) + "\n", flush=True)
        save()

    if args.split_sweep:
        rows = split_sweep(batches, ctxs)
        print("## decode batch in place by split (16-token sub-tiles per work item)\n")
        print("\n".join(sweep_table(rows)) + "\n", flush=True)

    if "compressed" in want:
        res["compressed"] = []
        for b in batches:
            for c in ctxs:
                for queries in ("random", "drift"):
                    res["compressed"].append(compressed_decode(b, c, 2048, 64, queries=queries, a=args.drift))
                    torch.cuda.empty_cache()
        print("## compressed decode (budget 2048), pinned host tier, vs SDPA flash with the full context resident\n")
        print("queries: random rotates 4 random queries; drift gives each call a new query, an AR(1) process "
              f"(a = {args.drift}) per query head. Pool = {KVH} x (2048 / {BS} - 3) + 3 blocks per row; "
              "pool / union = pool blocks over batch x union blocks per row (timed steps).\n")
        print("\n".join(compressed_table(res)) + "\n")
        print("\n".join(compressed_targets(res)) + "\n", flush=True)
        save()
    if args.compressed_breakdown:
        print("## compressed decode breakdown (torch.profiler)\n")
        res["compressed_breakdown"] = []
        for b, c, queries in args.compressed_breakdown:
            res["compressed_breakdown"].append(compressed_breakdown(b, c, queries, args.out, a=args.drift))
            save()
            torch.cuda.empty_cache()
        print("\n".join(breakdown_table(res)) + "\n", flush=True)
    if args.streamed_breakdown:
        print("## streamed exact decode breakdown (torch.profiler)\n")
        res["streamed_breakdown"] = []
        for b, c, t in args.streamed_breakdown:
            res["streamed_breakdown"].append(streamed_breakdown(b, c, t, args.out))
            save()
            torch.cuda.empty_cache()
        print("\n".join(streamed_breakdown_table(res)) + "\n", flush=True)
    save()
    if want == set(SECTIONS):
        plot(res, args.out / "gpu_decode.png")
        print(f"\nwrote {args.out / 'gpu_bench.json'} and {args.out / 'gpu_decode.png'}")
    else:
        print(f"\nwrote {args.out / 'gpu_bench.json'}")


if __name__ == "__main__":
    main()
