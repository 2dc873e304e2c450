"""GPU benchmark: transfers and decode attention on a CUDA device, each ceiling re-measured in the same run.

    python -m tools.bench_gpu [--out DIR] [--quick] [--sections ...] [--split-sweep]

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
   staging, one copy on a copy stream; or a device gather reading pinned memory), against one plain pinned copy of the
   same bytes, and one `copy_` per block; then copy_blocks_mapped of 16 and 64 KiB blocks at each CTA count of its
   gather kernel (ACTIVEKV_GATHER_CTAS: 2 .. 132, and the default), the JSON's "gather";
3. streamed: exact decode whose context lives in a pinned host tier and streams through a pool of 1/8 of it;
   achieved host->device rate against the pinned bus ceiling of section 1;
4. resident: exact decode with every block on the device, in place (placement in_place: the KV cache on the device,
   no pool) and from a pool that holds the contexts (pool-resident), each step's decode rows in one launch (the decode
   batch); the ATen tile path beside them; against scaled_dot_product_attention (flash) on the same KV in
   [B, H, T, D] layout; KV read rate of each;
5. compressed: compressed decode (budget 2048 tokens) from a pinned host tier, against the same SDPA with the full
   context resident.
--split-sweep also times the decode batch's kernels in place at each ACTIVEKV_CUDA_SPLIT (16-token sub-tiles per work
item) and prints them (not kept in the JSON).
"""

from __future__ import annotations

import argparse
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
SECTIONS = ("ceilings", "blocks", "streamed", "resident", "compressed")


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


def block_batches(quick: bool) -> list[dict]:
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
        staged = total / timed(lambda: transfer.copy_blocks_staged(src, dst, ids, slots, stream), reps=5) / 1e9
        mapped = total / timed(lambda: transfer.copy_blocks_mapped(src, dst, ids, slots, stream), reps=5) / 1e9
        flat = src[:n].contiguous().pin_memory()
        plain = total / timed(lambda: dst.copy_(flat, non_blocking=True), reps=5) / 1e9
        per_block = None
        if block >= 64 << 10 or not quick:
            def each():
                for i, s in zip(ids, slots):
                    dst[s].copy_(src[i], non_blocking=True)
            per_block = total / timed(each, reps=2, warmup=1) / 1e9
        rows.append({"block_KiB": block >> 10, "blocks": n, "staged_GBps": staged, "mapped_GBps": mapped,
                     "plain_GBps": plain,
                     "per_block_copy_GBps": per_block})
    return rows


GATHER_CTAS = (2, 4, 8, 16, 32, 64, 132)


def gather_sweep() -> list[dict]:
    """copy_blocks_mapped of 256 MiB as 16 and 64 KiB blocks at each CTA count of its gather kernel
    (ACTIVEKV_GATHER_CTAS, read at each call) and at the default; empty in a build without the kernel."""
    import activekv._transfer as transfer

    total = 256 << 20
    stream = torch.cuda.Stream()
    saved = os.environ.pop("ACTIVEKV_GATHER_CTAS", None)
    default = transfer.mapped_gather_ctas()
    rows = []
    try:
        if default == 0:
            return rows
        for block in (16 << 10, 64 << 10):
            n = total // block
            src = torch.randn(2 * n, block // 2).to(DT).pin_memory()  # as block_batches: scattered from twice the batch
            dst = torch.empty(n, block // 2, dtype=DT, device="cuda")
            ids = torch.randperm(2 * n)[:n].tolist()
            slots = list(range(n))
            for ctas in (*GATHER_CTAS, None):
                if ctas is None:
                    os.environ.pop("ACTIVEKV_GATHER_CTAS", None)
                else:
                    os.environ["ACTIVEKV_GATHER_CTAS"] = str(ctas)
                assert transfer.mapped_gather_ctas() == (ctas or default)
                rate = total / timed(lambda: transfer.copy_blocks_mapped(src, dst, ids, slots, stream), reps=5) / 1e9
                rows.append({"block_KiB": block >> 10, "ctas": ctas or default, "default": ctas is None,
                             "mapped_GBps": rate})
            del src, dst
    finally:
        if saved is None:
            os.environ.pop("ACTIVEKV_GATHER_CTAS", None)
        else:
            os.environ["ACTIVEKV_GATHER_CTAS"] = saved
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


def exact_decode(batch: int, ctx: int, tiered: bool, pool_tokens: int, tile_blocks: int,
                 transfer: str = "mapped", kernel: str = "native") -> dict:
    """Streamed exact decode: the context in a pinned host tier, a pool smaller than it."""
    eng = make_engine(pool_tokens // BS, tile_blocks, transfer=transfer, kernel=kernel)
    kv = fill_host(batch, ctx, pinned=tiered)
    plan = decode_plan(eng, batch, ctx)
    q = torch.randn(batch, H, D, dtype=DT, device="cuda")
    out = torch.empty_like(q)
    ms = event_ms(lambda: eng.forward(0, plan, q, kv, out, D ** -0.5), calls=2, reps=3, warmup=1)
    snap = eng.snapshot()
    kv_bytes = batch * ctx * TOKEN_BYTES
    return {"batch": batch, "context": ctx, "transfer": transfer, "kernel": kernel, "ms": ms,
            "kv_GBps": kv_bytes / ms / 1e6,
            "h2d_bytes_per_step": snap["bytes_h2d"] / max(1, snap["forward_calls"])}


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


def compressed_decode(batch: int, ctx: int, budget: int, tile_blocks: int, kernel: str = "native") -> dict:
    per_row = KVH * (budget // BS - 3) + 3
    eng = make_engine(max(per_row * batch, tile_blocks), tile_blocks, mode="compressed", budget=budget, kernel=kernel)
    kv = torch.empty((batch * ctx // BS, KVH, BS, 2 * D), dtype=DT).pin_memory()
    chunk = 1 << 14
    for start in range(0, batch * ctx, chunk):  # KV updates: fill the host tier and the per-block key metadata
        k = torch.randn(chunk, KVH, D, dtype=DT, device="cuda")
        eng.update_kv(0, k, torch.randn_like(k), kv, torch.arange(start, start + chunk, device="cuda"))
    plan = decode_plan(eng, batch, ctx)
    qs = [torch.randn(batch, H, D, dtype=DT, device="cuda") for _ in range(4)]
    out = torch.empty_like(qs[0])
    it = iter(range(1 << 30))
    ms = event_ms(lambda: eng.forward(0, plan, qs[next(it) % 4], kv, out, D ** -0.5), calls=4, reps=3, warmup=4)
    snap = eng.snapshot()
    steps = max(1, snap["forward_calls"])
    return {"batch": batch, "context": ctx, "kernel": kernel, "ms": ms, "union_blocks_per_row":
            snap["union_blocks"] / max(1, snap["compressed_rows"]),
            "admitted_per_step": snap["blocks_admitted"] / steps}


def ceilings_table(res: dict) -> list[str]:
    c = res["ceilings"]
    return ["| pinned H2D GB/s | pinned D2H GB/s | D2D GB/s (read+write) |", "|---|---|---|",
            f"| {c['h2d_GBps']:.1f} | {c['d2h_GBps']:.1f} | {c['d2d_GBps']:.0f} |"]


def blocks_table(res: dict) -> list[str]:
    lines = ["| block | blocks | copy_blocks_mapped GB/s | copy_blocks_staged GB/s | one plain copy GB/s | "
             "mapped / plain | one `copy_` per block GB/s |", "|---|---|---|---|---|---|---|"]
    for r in res["blocks"]:
        pb = "-" if r["per_block_copy_GBps"] is None else f"{r['per_block_copy_GBps']:.2f}"
        size = f"{r['block_KiB']} KiB" if r["block_KiB"] < 1024 else f"{r['block_KiB'] // 1024} MiB"
        lines.append(f"| {size} | {r['blocks']} | {r['mapped_GBps']:.1f} | {r['staged_GBps']:.1f} | "
                     f"{r['plain_GBps']:.1f} | {r['mapped_GBps'] / r['plain_GBps']:.2f} | {pb} |")
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


def streamed_table(res: dict) -> list[str]:
    lines = ["| batch | transfer | kernel | ms/step | H2D GB/s achieved | / pinned H2D ceiling |",
             "|---|---|---|---|---|---|"]
    for r in res["streamed"]:
        rate = r["h2d_bytes_per_step"] / (r["ms"] / 1e3) / 1e9
        lines.append(f"| {r['batch']} | {r['transfer']} | {r['kernel']} | {r['ms']:.2f} | {rate:.1f} | "
                     f"{rate / res['ceilings']['h2d_GBps']:.2f} |")
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


def compressed_table(res: dict) -> list[str]:
    lines = ["| batch | context | compressed ms | union blocks/row | admitted blocks/step | SDPA ms | "
             "SDPA / compressed |",
             "|---|---|---|---|---|---|---|"]
    sd = {(s["batch"], s["context"]): s["ms"] for s in res["sdpa"]}
    for r in res["compressed"]:
        s = sd[(r["batch"], r["context"])]
        lines.append(f"| {r['batch']} | {r['context'] // 1024}k | {r['ms']:.2f} | {r['union_blocks_per_row']:.0f} | "
                     f"{r['admitted_per_step']:.0f} | {s:.3f} | {s / r['ms']:.3f} |")
    return lines


PLOT_SERIES = (("resident", "ActiveKV exact, in place on the device"),
               ("resident_pool", "ActiveKV exact, pool-resident"),
               ("resident_aten", "ActiveKV exact, pool-resident, ATen path"),
               ("streamed", "ActiveKV exact, streamed from a pinned host tier"),
               ("compressed", "ActiveKV compressed 2048, pinned host tier"),
               ("sdpa", "SDPA flash, resident"))


def plot(res: dict, path: Path) -> None:
    """ms per decode step against context, one panel per batch, log scales with the measured contexts as ticks and the
    legend below the panels."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import NullFormatter, NullLocator

    batches = sorted({r["batch"] for r in res["resident"]})
    fig, axes = plt.subplots(1, len(batches), figsize=(9, 4.2), sharey=True)
    markers = "osxD^v"
    for ax, batch in zip(axes, batches, strict=True):
        contexts: set[int] = set()
        for (key, label), marker in zip(PLOT_SERIES, markers, strict=False):
            pts = sorted((r["context"], r["ms"]) for r in res.get(key, []) if r["batch"] == batch
                         and (key != "streamed" or (r["transfer"], r["kernel"]) == ("mapped", "native")))
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("build/gpu"))
    ap.add_argument("--quick", action="store_true", help="fewer sizes (a smoke run)")
    ap.add_argument("--sections", nargs="+", choices=SECTIONS, default=list(SECTIONS))
    ap.add_argument("--split-sweep", action="store_true", help="also time the decode batch at each split")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    res: dict = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
                 "command": shlex.join(["python", "-m", "tools.bench_gpu", *sys.argv[1:]])}
    want = set(args.sections)
    ctxs = [32768, 131072] if args.quick else [32768, 65536, 131072]
    batches = (1, 16)
    if "ceilings" in want:
        res["ceilings"] = ceilings()
        print(f"## ceilings ({res['device']}, torch {res['torch']})\n")
        print("\n".join(ceilings_table(res)) + "\n", flush=True)

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

    if "streamed" in want:
        res["streamed"] = [exact_decode(b, 131072, True, 16384, 256, tr, kn) for b in batches
                           for tr, kn in (("mapped", "native"), ("mapped", "aten"), ("staged", "native"))]
        print("## streamed exact decode: 128k context in a pinned host tier, pool 16k tokens, tile 256 blocks\n")
        if "ceilings" in res:
            print("\n".join(streamed_table(res)) + "\n", flush=True)

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

    if args.split_sweep:
        rows = split_sweep(batches, ctxs)
        print("## decode batch in place by split (16-token sub-tiles per work item)\n")
        print("\n".join(sweep_table(rows)) + "\n", flush=True)

    if "compressed" in want:
        res["compressed"] = [compressed_decode(b, c, 2048, 64) for b in batches for c in ctxs]
        print("## compressed decode (budget 2048), pinned host tier, vs SDPA flash with the full context resident\n")
        print("\n".join(compressed_table(res)))
    (args.out / "gpu_bench.json").write_text(json.dumps(res, indent=1))
    if want == set(SECTIONS):
        plot(res, args.out / "gpu_decode.png")
        print(f"\nwrote {args.out / 'gpu_bench.json'} and {args.out / 'gpu_decode.png'}")
    else:
        print(f"\nwrote {args.out / 'gpu_bench.json'}")


if __name__ == "__main__":
    main()
