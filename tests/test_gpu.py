"""GPU path (CUDA): parity of the engine's ATen path with the reference on CUDA tensors, and the transfer faults that
vLLM's own KV offloading shipped, each with a test that would catch it.

Skipped without CUDA (CI has none). Run on the device machine with `make gpu-check` (README, "GPU"), which builds the
engine there from a clean tree, runs this file and the GPU benchmark.

Placements of the host tier (docs/design.md, "GPU path"):
- in place: the host tier (kv_cache) is device memory and attention reads it there (no pool);
- resident: the host tier (kv_cache) is device memory, the pool is device memory;
- tiered: the host tier is pinned CPU memory, the pool is device memory; admissions go through transfer.h's
  copy_blocks_mapped (a device gather kernel reading pinned host memory, on a copy stream) or copy_blocks_staged
  (CPU gather into pinned staging, one host-to-device copy per batch on a copy stream); either way the compute
  stream waits on an event, then scatters into the pool.
"""

from __future__ import annotations

import random

import pytest
import torch

from tools.parity_cells import Cell, compressed_cells, exact_cells, in_place_cells, run_cell

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (run with make gpu-check)")


def _representative(cells: list[Cell], count: int, seed: int) -> list[Cell]:
    """A seeded sample that still holds every value of every axis at least once (greedy cover, then random fill)."""
    rng = random.Random(seed)
    pool = cells[:]
    rng.shuffle(pool)
    axes = ("dtype", "head_size", "gqa", "block_size", "context", "streaming", "batch", "padded")
    missing = {(a, getattr(c, a)) for c in cells for a in axes}
    chosen: list[Cell] = []
    for c in pool:
        gain = {(a, getattr(c, a)) for a in axes} & missing
        if gain:
            chosen.append(c)
            missing -= gain
    chosen += [c for c in pool if c not in chosen][: max(0, count - len(chosen))]
    return chosen


EXACT = _representative(exact_cells(), 24, seed=1)
COMPRESSED = _representative(compressed_cells(), 24, seed=2)
IN_PLACE = random.Random(3).sample(in_place_cells(), 12)


@pytest.mark.parametrize("placement", ["resident", "tiered-mapped", "tiered-staged"])
@pytest.mark.parametrize("cell", EXACT + COMPRESSED, ids=lambda c: c.id)
def test_gpu_parity(cell: Cell, placement: str) -> None:
    """Engine (ATen path on CUDA) == reference (same torch ops on CUDA), bit for bit: outputs, selections, both
    tiers, key metadata, page tables, counters."""
    tiered = placement != "resident"
    snap = run_cell(cell, device="cuda", tiered=tiered, transfer=placement.removeprefix("tiered-") if tiered
                    else "mapped")
    assert snap["forward_calls"] > 0 and snap["tiles_computed"] > 0
    if tiered:
        assert snap["bytes_d2h"] > 0  # KV updates wrote the pinned host tier from device tensors
    else:
        assert snap["bytes_d2h"] == 0


@pytest.mark.parametrize("cell", IN_PLACE, ids=lambda c: c.id)
def test_gpu_in_place_parity(cell: Cell) -> None:
    """Placement in place on CUDA (the host tier on the device, no pool): the ATen path == the reference, bit for
    bit."""
    snap = run_cell(cell, device="cuda")
    assert snap["blocks_in_place"] > 0 and snap["blocks_admitted"] == 0 and snap["bytes_h2d"] == 0


def test_gpu_cells_cover_every_axis() -> None:
    for cells in (EXACT, COMPRESSED):
        every = exact_cells() if cells is EXACT else compressed_cells()
        for axis in ("dtype", "head_size", "gqa", "block_size", "context", "streaming", "batch"):
            assert {getattr(c, axis) for c in cells} == {getattr(c, axis) for c in every}, axis


# ---- transfer faults ------------------------------------------------------------------------------------------------

def _engine(pool_blocks: int, tile_blocks: int, num_blocks: int, bs: int = 16, d: int = 128,
            transfer: str = "mapped"):
    import activekv._backend as backend

    eng = backend.Engine(1, 8, 2, d, bs, torch.float32, pool_blocks, tile_blocks, device=torch.device("cuda"),
                         kernel="aten", transfer=transfer)
    kv = torch.zeros((num_blocks, 2, bs, 2 * d), dtype=torch.float32).pin_memory()  # vLLM's per-layer view
    return eng, kv


def _prefill(eng, kv: torch.Tensor, ctx: int, seed: int = 0):
    """Write a context of `ctx` tokens into blocks 0.. of the (pinned) host tier through update_kv."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(ctx, 2, 128, device="cuda", generator=g)
    v = torch.randn(ctx, 2, 128, device="cuda", generator=g)
    eng.update_kv(0, k, v, kv, torch.arange(ctx, device="cuda"))
    return k, v


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """float64 attention of one decode token [H, D] over k/v [T, KVH, D] (GQA by repeat)."""
    g = q.shape[0] // k.shape[1]
    kk = k.double().repeat_interleave(g, 1).transpose(0, 1)  # [H, T, D]
    vv = v.double().repeat_interleave(g, 1).transpose(0, 1)
    p = torch.softmax((q.double().unsqueeze(1) @ kk.transpose(1, 2)) * q.shape[1] ** -0.5, -1)
    return (p @ vv).squeeze(1)


def test_store_waits_for_the_kernel_that_writes_the_kv() -> None:
    """A KV update right after a slow kernel that produces the keys must store the produced values, not what the
    buffer held before (the copy must not race the kernel writing the KV)."""
    eng, kv = _engine(pool_blocks=8, tile_blocks=4, num_blocks=8)
    src = torch.randn(16, 2, 128, device="cuda")
    key = torch.zeros_like(src)
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy (~0.1 s) ...
    key.copy_(src)  # ... so this write is still queued when update_kv is called
    eng.update_kv(0, key, src, kv, torch.arange(16, device="cuda"))
    host_k = kv.view(8, 2, 2, 16, 128)[0, :, 0].transpose(0, 1)  # block 0, K: [bs, KVH, D]
    assert torch.equal(host_k, src.cpu())


@pytest.mark.parametrize("transfer", ["mapped", "staged"])
def test_reused_pool_slot_is_not_overwritten_before_attention_reads_it(transfer: str) -> None:
    """Streaming a context 8x the pool reuses every slot many times in one forward. With the compute stream held
    back, the copy stream runs ahead; a scatter into the pool on the copy stream would overwrite slots that queued
    attention has not read yet (write-after-read). The output must still equal float64 attention."""
    bs, ctx = 16, 16 * 64
    eng, kv = _engine(pool_blocks=8, tile_blocks=4, num_blocks=64, transfer=transfer)
    k, v = _prefill(eng, kv, ctx)
    q = torch.randn(1, 8, 128, device="cuda")
    out = torch.empty_like(q)
    plan = eng.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32),
                     torch.arange(64, dtype=torch.int32).view(1, 64), 1, 1)
    torch.cuda._sleep(200_000_000)
    eng.forward(0, plan, q, kv, out, 128 ** -0.5)
    torch.cuda.synchronize()
    want = _sdpa(q[0], k, v)
    assert (out[0].double() - want).abs().max().item() < 1e-4
    snap = eng.snapshot()
    assert snap["blocks_evicted"] >= 64 - 8  # the slots really were reused


@pytest.mark.parametrize("transfer", ["mapped", "staged"])
def test_one_host_to_device_copy_per_batch_not_per_block(transfer: str) -> None:
    """Every block its own copy fills the stream's queue and reaches ~2% of the bus (GPU_NOTES.md): the staged path
    issues a bounded number of host-to-device copies per admitted tile, whatever the blocks per tile."""
    from torch.profiler import ProfilerActivity, profile

    counts = {}
    for tile_blocks in (4, 32):
        eng, kv = _engine(pool_blocks=32, tile_blocks=tile_blocks, num_blocks=128, transfer=transfer)
        _prefill(eng, kv, 16 * 128)
        q = torch.randn(1, 8, 128, device="cuda")
        plan = eng.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([16 * 128], dtype=torch.int32),
                         torch.arange(128, dtype=torch.int32).view(1, 128), 1, 1)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            eng.forward(0, plan, q, kv, torch.empty_like(q), 128 ** -0.5)
            torch.cuda.synchronize()
        htod = sum(e.count for e in prof.key_averages() if "HtoD" in e.key)
        snap = eng.snapshot()
        counts[tile_blocks] = (htod, snap["tiles_computed"], snap["blocks_admitted"])
    for tile_blocks, (htod, tiles, admitted) in counts.items():
        assert admitted == 128
        # staging copy (staged only) + gather index (mapped only) + pool-slot index + tile-slot index: at most 3
        # host-to-device copies per tile; the mapped gather kernel reads host memory without a memcpy
        assert 0 < htod <= 3 * tiles, (tile_blocks, counts)
    assert counts[32][0] < counts[4][0]  # fewer, larger copies when tiles hold more blocks


@pytest.mark.parametrize("where", ["pinned", "pageable"])
def test_in_place_on_cuda_needs_the_kv_cache_on_the_device(where: str) -> None:
    import activekv._backend as backend

    eng = backend.Engine(1, 8, 2, 128, 16, torch.float32, 0, 4, device=torch.device("cuda"), placement="in_place")
    kv = torch.zeros((8, 2, 16, 256), dtype=torch.float32)
    if where == "pinned":
        kv = kv.pin_memory()
    match = "placement 'in_place' reads blocks where they are: kv_cache must be on cuda:0, got cpu" if \
        where == "pinned" else "pinned memory"  # pageable host memory is refused before placement is looked at
    with pytest.raises(ValueError, match=match):
        eng.update_kv(0, torch.zeros(1, 2, 128, device="cuda"), torch.zeros(1, 2, 128, device="cuda"), kv,
                      torch.zeros(1, dtype=torch.int64, device="cuda"))
    plan = eng.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                     torch.zeros(1, 1, dtype=torch.int32), 1, 1)
    q = torch.zeros(1, 8, 128, device="cuda")
    with pytest.raises(ValueError, match=match):
        eng.forward(0, plan, q, kv, torch.empty_like(q), 1.0)


def test_tiered_host_tier_must_be_pinned() -> None:
    eng, _ = _engine(pool_blocks=8, tile_blocks=4, num_blocks=8)
    pageable = torch.zeros((8, 2, 16, 256), dtype=torch.float32)
    with pytest.raises(ValueError, match="pinned memory"):
        eng.update_kv(0, torch.zeros(1, 2, 128, device="cuda"), torch.zeros(1, 2, 128, device="cuda"), pageable,
                      torch.zeros(1, dtype=torch.int64, device="cuda"))


@pytest.mark.parametrize("fn", ["copy_blocks_staged", "copy_blocks_mapped"])
@pytest.mark.parametrize("dtype,head", [(torch.float32, 128), (torch.bfloat16, 80), (torch.float16, 3)])
def test_tiered_copies_match_plain_copy_and_check_their_input(fn: str, dtype: torch.dtype, head: int) -> None:
    """Both tiered copies move the same bytes as indexing would (head 3 fp16: a block of 6-byte rows, not a multiple
    of 8 bytes, takes the mapped path's byte-wise gather); bad input raises with a message that names it (building
    that message once crashed a GPU build whose compiler brought a second libstdc++: README, GPU)."""
    import activekv._transfer as transfer

    copy = getattr(transfer, fn)
    src = torch.randn(64, 2, 2, 16, head).to(dtype).pin_memory()
    dst = torch.zeros(16, 2, 2, 16, head, dtype=dtype, device="cuda")
    stream = torch.cuda.Stream()
    ids, slots = [5, 63, 0, 17], [3, 0, 15, 7]
    n = copy(src, dst, ids, slots, stream)
    assert n == 4 * src[0].numel() * src.element_size()
    torch.cuda.synchronize()
    assert torch.equal(dst[slots].cpu(), src[ids])
    with pytest.raises(ValueError, match="pinned"):
        copy(src.clone(), dst, ids, slots, stream)  # pageable
    with pytest.raises(IndexError, match=r"src_ids\[0\] must be in \[0, 64\), got 64"):
        copy(src, dst, [64], [0], stream)
    with pytest.raises(ValueError, match="copy stream's CUDA device"):
        copy(src, dst.cpu(), ids, slots, stream)


# ---- CUDA kernel (cuda_kernel.h) against the ATen path ------------------------------------------------------------

# The kernel's float32 math differs from the ATen tile path in summation order and exp, so it is held to a tolerance
# (docs/parity.md): max |native - aten| <= TOL * max(1, |aten|) elementwise, on outputs in the query dtype.
CUDA_KERNEL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
KERNEL_CELLS = [c for c in EXACT + COMPRESSED + IN_PLACE if c.head_size in (64, 128)]


def _replay(cell: Cell, kernel: str) -> list[torch.Tensor]:
    """The cell's steps on one CUDA engine (host tier on the device); every forward's output, in order."""
    import activekv._backend as backend
    from tools.parity_cells import NUM_LAYERS, host_blocks_for, make_steps

    nb = host_blocks_for(cell)
    kwargs = dict(cell.engine_kwargs(), kernel=kernel)
    eng = backend.Engine(*cell.engine_args(), device=torch.device("cuda"), **kwargs)
    caches = [torch.zeros((nb, 2, cell.block_size, 2 * cell.head_size), dtype=cell.dtype, device="cuda")
              for _ in range(NUM_LAYERS)]
    outs = []
    for st in make_steps(cell, nb):
        plan = eng.build(st.query_start_loc, st.seq_lens, st.block_table, st.num_reqs, st.num_actual_tokens)
        for layer in range(NUM_LAYERS):
            q, k, v = (x[layer].cuda() for x in (st.q, st.k, st.v))
            eng.update_kv(layer, k, v, caches[layer], st.slot_mapping)
            out = torch.full_like(q, 7.0)
            eng.forward(layer, plan, q, caches[layer], out, cell.head_size ** -0.5)
            outs.append(out)
    return outs


@pytest.mark.parametrize("cell", KERNEL_CELLS, ids=lambda c: c.id)
def test_cuda_kernel_within_tolerance_of_aten_path_and_repeatable(cell: Cell) -> None:
    aten = _replay(cell, "aten")
    native = _replay(cell, "native")
    again = _replay(cell, "native")
    tol = CUDA_KERNEL_TOL[cell.dtype]
    for i, (a, n, n2) in enumerate(zip(aten, native, again)):
        assert torch.equal(n, n2), f"forward {i}: the CUDA kernel is not repeatable"
        err = ((n.float() - a.float()).abs() / a.float().abs().clamp_min(1.0)).max().item()
        assert err <= tol, f"forward {i}: {err:.3g} > {tol}"


def test_cuda_kernel_runs() -> None:
    """kernel='native' on CUDA really launches the CUDA kernel (and 'aten' does not)."""
    from torch.profiler import ProfilerActivity, profile

    cell = next(c for c in KERNEL_CELLS if c.mode == "exact")
    names = {}
    for kernel in ("native", "aten"):
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            _replay(cell, kernel)
            torch.cuda.synchronize()
        names[kernel] = " ".join(e.key for e in prof.key_averages())
    assert "split_kernel" in names["native"] and "merge_kernel" in names["native"]
    assert "split_kernel" not in names["aten"]
