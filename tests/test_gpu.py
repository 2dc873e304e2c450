"""GPU path (CUDA): parity of the engine's ATen path with the reference on CUDA tensors, the transfer faults that
vLLM's own KV offloading shipped, each with a test that would catch it, and the CUDA kernels (per tile, and the decode
batch: a step's exact decode rows in one launch) against the ATen path and float64 attention.

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

import math
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
    buffer held before (the store is ordered on the stream after the kernel writing the KV, never racing it)."""
    eng, kv = _engine(pool_blocks=8, tile_blocks=4, num_blocks=8)
    src = torch.randn(16, 2, 128, device="cuda")
    key = torch.zeros_like(src)
    torch.cuda._sleep(200_000_000)  # keep the compute stream busy (~0.1 s) ...
    key.copy_(src)  # ... so this write is still queued when update_kv is called
    eng.update_kv(0, key, src, kv, torch.arange(16, device="cuda"))
    torch.cuda.synchronize()  # the host tier holds the tokens once the stream has run the update
    host_k = kv.view(8, 2, 2, 16, 128)[0, :, 0].transpose(0, 1)  # block 0, K: [bs, KVH, D]
    assert torch.equal(host_k, src.cpu())


def _resident_after_prefill(dtype: torch.dtype = torch.float32, mode: str = "exact"):
    """A bf16/fp32 engine whose pinned host tier holds 20 tokens (block 0 full, block 1 at offsets 0-3), both blocks
    resident in the pool after one forward. Returns (engine, kv, prefill keys [20, KVH, D])."""
    import activekv._backend as backend

    eng = backend.Engine(1, 8, 2, 128, 16, dtype, 8, 4, device=torch.device("cuda"), mode=mode,
                         budget_tokens=64, kernel="aten")  # compressed: sink 1 + recent 2 + top-1 per KV head fit 8
    kv = torch.zeros((8, 2, 16, 256), dtype=dtype).pin_memory()
    g = torch.Generator(device="cuda").manual_seed(5)
    k = torch.randn(20, 2, 128, device="cuda", generator=g).to(dtype)
    eng.update_kv(0, k, k, kv, torch.arange(20, device="cuda"))
    q = torch.randn(1, 8, 128, device="cuda").to(dtype)
    plan = eng.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([20], dtype=torch.int32),
                     torch.tensor([[0, 1]], dtype=torch.int32), 1, 1)
    eng.forward(0, plan, q, kv, torch.empty_like(q), 128 ** -0.5)
    torch.cuda.synchronize()
    assert dict(eng.resident(0)).keys() == {0, 1}
    return eng, kv, k


@pytest.mark.parametrize("mode", ["exact", "compressed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
def test_checked_kv_update_is_queued_without_waiting_for_the_stream(dtype: torch.dtype, index_dtype: torch.dtype,
                                                                  mode: str) -> None:
    """With the step's slot mapping checked by build (vLLM's builder passes common_attn_metadata.slot_mapping), a
    layer's KV update copies nothing to the host and waits for nothing: it returns while the stream is still busy.
    Once the stream has run it, the pinned host tier, the resident block's pool copy and the block's key metadata
    hold the new token (key a strided view, as vLLM's split of its QKV output is; a padding entry skipped). Key
    metadata exists in compressed mode only."""
    eng, kv, k0 = _resident_after_prefill(dtype, mode)
    qkv = torch.randn(2, 4, 128, device="cuda").to(dtype)
    key, value = qkv[:, :2], qkv[:, 2:]  # [2, KVH, D], stride(0) = 4 * 128
    slots = torch.tensor([20, -1], dtype=index_dtype, device="cuda")  # block 1, offset 4; then padding
    eng.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([21], dtype=torch.int32),
              torch.tensor([[0, 1]], dtype=torch.int32), 1, 1, slot_mapping=slots)
    before = eng.snapshot()
    torch.cuda._sleep(1_000_000_000)  # ~0.5 s of queued work ahead of the update
    eng.update_kv(0, key, value, kv, slots)
    assert not torch.cuda.current_stream().query()  # update_kv returned before the stream reached it
    torch.cuda.synchronize()
    host = kv.view(8, 2, 2, 16, 128)
    assert torch.equal(host[1, :, 0, 4], key[0].cpu()) and torch.equal(host[1, :, 1, 4], value[0].cpu())
    assert torch.equal(host[1, :, 0, 5], torch.zeros(2, 128, dtype=dtype))  # the padding token wrote nothing
    slot = dict(eng.resident(0))[1]
    pool = eng.pool(0)
    assert torch.equal(pool[slot, :, 0, 4], key[0]) and torch.equal(pool[slot, :, 1, 4], value[0])
    block_keys = torch.cat([k0[16:20], key[:1]])  # [5, KVH, D]: block 1's keys
    if mode == "compressed":
        assert torch.equal(eng.key_min(0)[1], block_keys.amin(0))
        assert torch.equal(eng.key_max(0)[1], block_keys.amax(0))
    else:
        assert eng.key_min(0) is None and eng.key_max(0) is None
    snap = eng.snapshot()
    assert snap["write_through_tokens"] - before["write_through_tokens"] == 1
    assert snap["padding_slots"] - before["padding_slots"] == 1
    assert snap["bytes_d2h"] - before["bytes_d2h"] == 2 * 2 * 128 * key.element_size()


def test_checked_slot_mapping_changed_by_an_op_is_checked_again() -> None:
    """A slot mapping changed in place after build (its version counter moves) is not trusted: the update copies it
    and rejects the bad slot before writing anything."""
    eng, kv, _ = _resident_after_prefill()
    slots = torch.tensor([20], dtype=torch.int64, device="cuda")
    eng.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([21], dtype=torch.int32),
              torch.tensor([[0, 1]], dtype=torch.int32), 1, 1, slot_mapping=slots)
    slots[0] = 10**6
    with pytest.raises(IndexError, match=r"slot_mapping\[0\] must be -1 \(padding\) or in \[0, 128\), got 1000000"):
        eng.update_kv(0, torch.ones(1, 2, 128, device="cuda"), torch.ones(1, 2, 128, device="cuda"), kv, slots)


def test_checked_slot_mapping_changed_behind_the_version_counter_writes_nothing_and_build_raises() -> None:
    """A slot mapping changed after its check without an ATen op seeing it (here through .data) reaches the device
    kernel with a slot outside the KV cache: the kernel writes nothing for it and the next build raises."""
    eng, kv, _ = _resident_after_prefill()
    slots = torch.tensor([20], dtype=torch.int64, device="cuda")
    args = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([21], dtype=torch.int32),
            torch.tensor([[0, 1]], dtype=torch.int32), 1, 1)
    eng.build(*args, slot_mapping=slots)
    slots.data[0] = 10**6  # no version bump: the record still covers the tensor
    host_before = kv.clone()
    eng.update_kv(0, torch.ones(1, 2, 128, device="cuda"), torch.ones(1, 2, 128, device="cuda"), kv, slots)
    torch.cuda.synchronize()
    assert torch.equal(kv, host_before)
    with pytest.raises(RuntimeError, match="slot mapping changed after Engine::build checked it"):
        eng.build(*args)
    eng.build(*args)  # reported once


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
    """Both tiered copies move the same bytes as indexing would (head 3 fp16: rows of 6 bytes, blocks of 384; the
    mapped path's fallback to index_select is test_mapped_gather_moves_index_selects_bytes's); bad input raises with a
    message that names it (building that message once crashed a GPU build whose compiler brought a second libstdc++:
    README, GPU)."""
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


def _random_blocks(num: int, block: tuple[int, ...], dtype: torch.dtype, offset: int = 0) -> torch.Tensor:
    """Pinned [num, *block] of random bytes (NaN and infinity patterns included), starting `offset` bytes into its
    pinned buffer."""
    size = torch.empty((), dtype=dtype).element_size()
    nbytes = num * size * torch.Size(block).numel()
    raw = torch.randint(0, 256, (offset + nbytes,), dtype=torch.uint8).pin_memory()
    return raw[offset:].view(dtype).view(num, *block)


def _copy_kernel_launches(fn) -> tuple[int, int]:
    """Launches of the engine's gather kernel (the read over the bus) and of its scatter kernel (the buffer into the
    pool's slots), engine/src/cuda/gather.cu, while fn() runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    keys = prof.key_averages()
    return tuple(sum(e.count for e in keys if "activekv" in e.key and name in e.key)
                 for name in ("gather_kernel", "scatter_kernel"))


def _scatters(block: tuple[int, ...], dtype: torch.dtype) -> int:
    """Scatter kernel launches a copy_blocks_mapped call makes: one where a block is a multiple of 16 bytes (its buffer
    and the pool are allocations, aligned), else none (index_copy_)."""
    return int(math.prod(block) * dtype.itemsize % 16 == 0)


# (block shape, dtype, src offset in bytes, whether the gather kernel takes it)
GATHER_CASES = [((2, 2, 16, 128), torch.bfloat16, 0, True),  # 16 KiB blocks
                ((1, 2, 3, 4), torch.float16, 0, True),  # 48 bytes: a warp's reads span several blocks
                ((2, 2, 16, 128), torch.bfloat16, 8, False),  # src not 16-byte aligned: index_select, 8-byte words
                ((1, 2, 1, 5), torch.float32, 0, False),  # 40 bytes: index_select, 8-byte words
                ((1, 2, 5, 3), torch.float16, 0, False)]  # 60 bytes: index_select, bytes


@pytest.mark.parametrize("ctas", [None, "1", "3", "132"])
@pytest.mark.parametrize("block,dtype,offset,kernel", GATHER_CASES)
def test_mapped_gather_moves_index_selects_bytes(block: tuple[int, ...], dtype: torch.dtype, offset: int,
                                                 kernel: bool, ctas: str | None,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """copy_blocks_mapped's gather (the CUDA gather kernel where a block is a multiple of 16 bytes at an aligned src,
    else index_select) lands exactly index_select's bytes: repeated src ids, a single block, and 203 blocks of 16 KiB
    (51 tiles of the kernel) from one CTA (ACTIVEKV_GATHER_CTAS=1: grid-stride over more tiles than CTAs)."""
    import activekv._transfer as transfer

    if ctas is None:
        monkeypatch.delenv("ACTIVEKV_GATHER_CTAS", raising=False)
    else:
        monkeypatch.setenv("ACTIVEKV_GATHER_CTAS", ctas)
    monkeypatch.setenv("ACTIVEKV_DMA_MIN_BYTES", str(1 << 50))  # the kernel whatever the runs (copy engines aside)
    assert transfer.mapped_gather_ctas() > 0  # make gpu-check's build has the kernel
    if ctas is not None:
        assert transfer.mapped_gather_ctas() == int(ctas)
    rng = random.Random(7)
    src = _random_blocks(300, block, dtype, offset)
    dst = torch.zeros(256, *block, dtype=dtype, device="cuda")
    stream = torch.cuda.Stream()
    for ids in ([rng.randrange(300) for _ in range(200)] + [17, 17, 17],  # repeats
                [299],  # one block, the last
                list(range(299, -1, -2))):
        slots = rng.sample(range(256), len(ids))
        dst.zero_()
        launches = _copy_kernel_launches(lambda: transfer.copy_blocks_mapped(src, dst, ids, slots, stream))
        assert launches == (int(kernel), _scatters(block, dtype)), (block, offset, launches)
        want = src.index_select(0, torch.tensor(ids))
        assert torch.equal(dst[slots].cpu().view(torch.uint8), want.view(torch.uint8))
        untouched = sorted(set(range(256)) - set(slots))
        assert not dst[untouched].view(torch.uint8).any()


@pytest.mark.parametrize("block,dtype,offset,kernel", GATHER_CASES)
def test_mapped_copy_engines_move_index_selects_bytes(block: tuple[int, ...], dtype: torch.dtype, offset: int,
                                                      kernel: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """ACTIVEKV_DMA_MIN_BYTES=0: every batch goes to the copy engines (one cudaMemcpyBatchAsync of its runs of
    consecutive source blocks) whatever the block size or alignment, and lands exactly index_select's bytes with no
    gather kernel: one run of 200 blocks, runs of 3, 2 and 1 with repeats and the last block, descending ids (runs of
    one)."""
    import activekv._transfer as transfer

    monkeypatch.setenv("ACTIVEKV_DMA_MIN_BYTES", "0")
    assert transfer.mapped_dma_min_bytes() == 0  # make gpu-check's CUDA 13 build has the copy-engine batch
    rng = random.Random(11)
    src = _random_blocks(300, block, dtype, offset)
    dst = torch.zeros(256, *block, dtype=dtype, device="cuda")
    stream = torch.cuda.Stream()
    for ids in (list(range(40, 240)), [5, 6, 7, 100, 101, 3, 3, 299], list(range(299, -1, -2))):
        slots = rng.sample(range(256), len(ids))
        dst.zero_()
        launches = _copy_kernel_launches(lambda: transfer.copy_blocks_mapped(src, dst, ids, slots, stream))
        assert launches == (0, _scatters(block, dtype)), (block, offset, launches)
        want = src.index_select(0, torch.tensor(ids))
        assert torch.equal(dst[slots].cpu().view(torch.uint8), want.view(torch.uint8))
        untouched = sorted(set(range(256)) - set(slots))
        assert not dst[untouched].view(torch.uint8).any()


def test_mapped_copy_takes_the_copy_engines_for_long_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """With the default threshold (1 MiB per run), 64 blocks of 16 KiB in order (one run of 1 MiB) go to the copy
    engines and 64 scattered ones (runs of one block) to the gather kernel; both land index_select's bytes."""
    import activekv._transfer as transfer

    monkeypatch.delenv("ACTIVEKV_DMA_MIN_BYTES", raising=False)
    assert transfer.mapped_dma_min_bytes() == 1 << 20
    src = _random_blocks(300, (2, 2, 16, 128), torch.bfloat16, 0)
    dst = torch.zeros(64, 2, 2, 16, 128, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    for ids, launches_want in ((list(range(100, 164)), 0), (list(range(0, 256, 4)), 1)):
        slots = list(range(63, -1, -1))
        launches = _copy_kernel_launches(lambda: transfer.copy_blocks_mapped(src, dst, ids, slots, stream))
        assert launches == (launches_want, 1), (ids[:3], launches)
        assert torch.equal(dst[slots].cpu().view(torch.uint8), src.index_select(0, torch.tensor(ids)).view(torch.uint8))


def _host_to_device_copies(fn) -> int:
    """Host-to-device copies fn queues, as the profiler records them: an index upload is one, a copy-engine run one,
    while the gather kernel's reads over the mapping are none."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if "Memcpy HtoD" in e.key)


@pytest.mark.parametrize("limit", [None, "0", "5"])
@pytest.mark.parametrize("read", ["gather kernel", "copy engines"])
def test_small_batches_pass_their_ids_in_the_launch(limit: str | None, read: str,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy_blocks_mapped batch of at most inline_ids_limit() blocks (ACTIVEKV_INLINE_IDS, default 256) passes its
    ids to the gather and scatter kernels in their launch parameters: no index upload; a larger batch, or any with the
    limit 0, uploads one index. Either way the bytes are index_select's: 1, 5, 6, 256 and 257 blocks, scattered (the
    gather kernel) and in order (one copy-engine run)."""
    import activekv._transfer as transfer

    if limit is None:
        monkeypatch.delenv("ACTIVEKV_INLINE_IDS", raising=False)
    else:
        monkeypatch.setenv("ACTIVEKV_INLINE_IDS", limit)
    monkeypatch.setenv("ACTIVEKV_DMA_MIN_BYTES", str(1 << 50) if read == "gather kernel" else "0")
    most = transfer.inline_ids_limit()
    assert most == (256 if limit is None else int(limit))
    rng = random.Random(13)
    src = _random_blocks(600, (2, 2, 16, 128), torch.bfloat16, 0)
    dst = torch.zeros(300, 2, 2, 16, 128, dtype=torch.bfloat16, device="cuda")
    stream = torch.cuda.Stream()
    for n in (1, 5, 6, 256, 257):
        if read == "gather kernel":
            ids = rng.sample(range(600), n)
        else:
            first = rng.randrange(600 - n)
            ids = list(range(first, first + n))
        slots = rng.sample(range(300), n)
        dst.zero_()
        copies = _host_to_device_copies(lambda: transfer.copy_blocks_mapped(src, dst, ids, slots, stream))
        runs = 0 if read == "gather kernel" else 1
        assert copies == runs + int(n > most), (n, most, copies)
        assert torch.equal(dst[slots].cpu().view(torch.uint8), src.index_select(0, torch.tensor(ids)).view(torch.uint8))
        untouched = sorted(set(range(300)) - set(slots))
        assert not dst[untouched].view(torch.uint8).any()


# (variable, the binding that reads it, values out of its range, a value at its edge)
TRANSFER_VARIABLES = [("ACTIVEKV_GATHER_CTAS", "mapped_gather_ctas", ["0", "1025", "-4", "32x", ""], 1024),
                      ("ACTIVEKV_DMA_MIN_BYTES", "mapped_dma_min_bytes", ["-1", "32x", "", str((1 << 50) + 1)], 0),
                      ("ACTIVEKV_INLINE_IDS", "inline_ids_limit", ["-1", "257", "8x", ""], 0)]


@pytest.mark.parametrize("name,reader,value,edge", [(n, r, v, e) for n, r, vs, e in TRANSFER_VARIABLES for v in vs])
def test_transfer_variable_out_of_range_is_the_default(name: str, reader: str, value: str, edge: int,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """ACTIVEKV_GATHER_CTAS, ACTIVEKV_DMA_MIN_BYTES and ACTIVEKV_INLINE_IDS, read at each call: a value out of range or
    not an integer is the default; one at the edge of the range is taken."""
    import activekv._transfer as transfer

    read = getattr(transfer, reader)
    monkeypatch.delenv(name, raising=False)
    default = read()
    monkeypatch.setenv(name, value)
    assert read() == default
    monkeypatch.setenv(name, str(edge))
    assert read() == edge


# ---- CUDA kernel (cuda_kernel.h) against the ATen path ------------------------------------------------------------

# The kernel's float32 math differs from the ATen tile path in summation order and exp, so it is held to a tolerance
# (docs/parity.md): max |native - aten| <= TOL * max(1, |aten|) elementwise, on outputs in the query dtype.
CUDA_KERNEL_TOL = {torch.float32: 1e-5, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}
KERNEL_CELLS = [c for c in EXACT + COMPRESSED + IN_PLACE if c.head_size in (64, 128)]


def _replay(cell: Cell, kernel: str, snapshot: dict | None = None,
            selections: list[dict] | None = None) -> list[torch.Tensor]:
    """The cell's steps on one CUDA engine (host tier on the device); every forward's output, in order. `snapshot`, if
    given, receives the engine's telemetry snapshot at the end; `selections`, each forward's selection."""
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
            if selections is not None:
                selections.append(eng.selection(layer))
    if snapshot is not None:
        snapshot.update(eng.snapshot())
    return outs


def _batch_taken(cell: Cell) -> bool:
    """Whether some decode step of the cell goes through the decode batch kernel (cuda_kernel.h cuda_batch_supports):
    a 16-bit dtype, the blocks on the device (in place, or a pool that holds the contexts), and a decode row that does
    not select (every exact row; in compressed mode one whose context fits the budget)."""
    from tools.parity_cells import BUDGET_BLOCKS

    exact_row = cell.mode == "exact" or -(-(min(cell.prompt_lens()) + 1) // cell.block_size) <= BUDGET_BLOCKS
    return cell.dtype != torch.float32 and (cell.placement == "in_place" or not cell.streaming) and exact_row


@pytest.mark.parametrize("cell", KERNEL_CELLS, ids=lambda c: c.id)
def test_cuda_kernel_within_tolerance_of_aten_path_and_repeatable(cell: Cell) -> None:
    aten = _replay(cell, "aten")
    snap: dict = {}
    native = _replay(cell, "native", snap)
    again = _replay(cell, "native")
    tol = CUDA_KERNEL_TOL[cell.dtype]
    for i, (a, n, n2) in enumerate(zip(aten, native, again)):
        assert torch.equal(n, n2), f"forward {i}: the CUDA kernel is not repeatable"
        err = ((n.float() - a.float()).abs() / a.float().abs().clamp_min(1.0)).max().item()
        assert err <= tol, f"forward {i}: {err:.3g} > {tol}"
    if _batch_taken(cell):
        assert snap["decode_batch_rows"] > 0
    elif cell.dtype == torch.float32:  # the batch kernel takes 16-bit KV only
        assert snap["decode_batch_rows"] == 0


STREAMED_KERNEL_CELLS = [c for c in KERNEL_CELLS if c.streaming and c.placement != "in_place"][:6]


@pytest.mark.parametrize("cell", STREAMED_KERNEL_CELLS, ids=lambda c: c.id)
def test_exact_tiles_with_slots_in_the_launch_equal_an_uploaded_index(cell: Cell,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """An exact tile's slots passed in the attention launch's parameters (the default) give the bits an uploaded index
    gives (ACTIVEKV_INLINE_IDS=0): the same blocks at the same positions, in the same order; and the default arm
    queues fewer host-to-device copies (no index per tile), so it did take the launch-parameter path."""
    monkeypatch.setenv("ACTIVEKV_INLINE_IDS", "0")
    uploaded: list[torch.Tensor] = []
    uploads = _host_to_device_copies(lambda: uploaded.extend(_replay(cell, "native")))
    monkeypatch.delenv("ACTIVEKV_INLINE_IDS")
    snap: dict = {}
    by_value: list[torch.Tensor] = []
    by_value_uploads = _host_to_device_copies(lambda: by_value.extend(_replay(cell, "native", snap)))
    assert snap["tiles_computed"] > 0
    assert by_value_uploads < uploads, (by_value_uploads, uploads)
    for i, (a, b) in enumerate(zip(uploaded, by_value, strict=True)):
        assert torch.equal(a, b), f"forward {i}"


def test_streamed_kernel_cells_exist() -> None:
    assert len(STREAMED_KERNEL_CELLS) >= 3 and any(c.mode == "exact" for c in STREAMED_KERNEL_CELLS)


SELECTING = [c for c in COMPRESSED if c.context != "short"]  # a "short" context fits the budget: no row selects


@pytest.mark.parametrize("cell", SELECTING, ids=lambda c: c.id)
def test_batched_selection_chooses_the_row_by_row_blocks(cell: Cell) -> None:
    """The CUDA path scores every selecting row of a layer at once (rows padded to the longest row's candidates, no
    wait for the device before the positions' copy); the ATen path row by row with the reference's ops. Every forward
    selects the same blocks for every row and KV head."""
    aten: list[dict] = []
    native: list[dict] = []
    _replay(cell, "aten", selections=aten)
    _replay(cell, "native", selections=native)
    assert len(aten) == len(native) and any(aten), "the cell never selected"
    for i, (a, n) in enumerate(zip(aten, native, strict=True)):
        assert a.keys() == n.keys(), f"forward {i}: rows {sorted(a)} vs {sorted(n)}"
        for row in a:
            assert torch.equal(a[row], n[row]), f"forward {i}, row {row}"


# selection.cpp kSelectBatchBytes: the widened key metadata one scoring batch of selecting rows may hold.
SELECT_BATCH_BYTES = 128 << 20


def test_batched_selection_in_several_batches_chooses_the_row_by_row_blocks() -> None:
    """Rows whose widened key metadata outgrows one scoring batch (SELECT_BATCH_BYTES) are scored batch by batch:
    five decode rows of 4k-6k blocks of one token, 16 KV heads of 128 (8 KiB of float32 metadata per candidate: two
    rows per batch, three batches). Every row and KV head selects the blocks the ATen path's row-by-row scoring
    selects; where a block differs, its Quest bound (float64, from the engine's key metadata) ties the k-th within
    float32 rounding."""
    import activekv._backend as backend

    kvh, d, bs, dtype, sink, recent, budget = 16, 128, 1, torch.bfloat16, 4, 8, 64
    top_k = budget // bs - sink - recent
    lens = [6000, 5200, 6100, 4000, 5900]
    per_batch = SELECT_BATCH_BYTES // ((max(lens) + 1 - sink - recent) * kvh * d * 4)
    assert 1 < per_batch < len(lens) - 1, per_batch  # several batches, more than one row in each but the last
    g = torch.Generator().manual_seed(5)
    blocks = [n + 1 for n in lens]
    nb = sum(blocks) + 8
    perm = torch.randperm(nb, generator=g)
    table = torch.zeros((len(lens), max(blocks)), dtype=torch.int32)
    start = 0
    for r, n in enumerate(blocks):
        table[r, :n] = perm[start:start + n].to(torch.int32)
        start += n
    prompt_slots = torch.cat([table[r, :n].long() for r, n in enumerate(lens)]).cuda()
    decode_slots = torch.tensor([table[r, n].item() for r, n in enumerate(lens)]).cuda()
    k_prompt = torch.randn((sum(lens), kvh, d), generator=g).to(dtype).cuda()
    v_prompt = torch.randn((sum(lens), kvh, d), generator=g).to(dtype).cuda()
    q, k, v = (torch.randn((len(lens), kvh, d), generator=g).to(dtype).cuda() for _ in range(3))
    qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
    seq = torch.tensor(blocks, dtype=torch.int32)
    chosen = {}
    for kernel in ("aten", "native"):
        eng = backend.Engine(1, kvh, kvh, d, bs, dtype, 0, 256, device=torch.device("cuda"), mode="compressed",
                             budget_tokens=budget, sink_blocks=sink, recent_blocks=recent, kernel=kernel,
                             placement="in_place")
        assert eng.top_k == top_k
        cache = torch.zeros((nb, kvh, bs, 2 * d), dtype=dtype, device="cuda")
        eng.update_kv(0, k_prompt, v_prompt, cache, prompt_slots)
        plan = eng.build(qsl, seq, table, len(lens), len(lens))
        eng.update_kv(0, k, v, cache, decode_slots)
        eng.forward(0, plan, q, cache, torch.empty_like(q), d ** -0.5)
        chosen[kernel] = eng.selection(0)
        kmin, kmax = eng.key_min(0).double().cpu(), eng.key_max(0).double().cpu()
    assert sorted(chosen["aten"]) == sorted(chosen["native"]) == list(range(len(lens)))
    differing = 0
    for r, n in enumerate(blocks):
        ids = table[r, sink:n - recent].long()
        qr = q[r].double().cpu()  # [KVH, D] (one query head per KV head)
        bound = (qr.clamp_min(0)[None] * kmax[ids] + qr.clamp_max(0)[None] * kmin[ids]).sum(-1)  # [C, KVH]
        for h in range(kvh):
            a, b = chosen["aten"][r][h].tolist(), chosen["native"][r][h].tolist()
            assert len(a) == len(b) == budget // bs
            if a == b:
                continue
            differing += 1
            kth = bound[:, h].topk(top_k).values[-1].item()
            pos = {int(x): i for i, x in enumerate(ids.tolist())}
            for blk in set(a) ^ set(b):
                assert abs(bound[pos[blk], h].item() - kth) <= 1e-4 * max(1.0, abs(kth)), (r, h, blk)
    assert differing <= kvh  # near-ties are rare: at most a few (row, head) pairs


def test_selecting_cells_hold_rows_of_different_lengths() -> None:
    """The batched selection's padding is exercised: some cell selects for two rows of different context lengths."""
    assert any(c.batch >= 2 and len(set(c.prompt_lens())) >= 2 for c in SELECTING)


def test_kernel_cells_take_the_decode_batch_in_place_and_from_the_pool() -> None:
    taken = [c for c in KERNEL_CELLS if _batch_taken(c)]
    assert {c.placement for c in taken} == {"in_place", "pool"}
    assert {c.dtype for c in taken} == {torch.bfloat16, torch.float16}


# ---- the decode batch: one launch per layer for every exact decode row of a step ----------------------------------

H, KVH, D, BS = 32, 8, 128, 16


def _batch_engine(placement: str, pool_blocks: int = 0, kernel: str = "native", dtype=torch.bfloat16, d: int = D,
                  heads: int = H, bs: int = BS, layers: int = 1):
    import activekv._backend as backend

    return backend.Engine(layers, heads, KVH, d, bs, dtype, pool_blocks, 16, device=torch.device("cuda"),
                          placement=placement, kernel=kernel)


def _filled_cache(blocks: int, seqs: dict[int, tuple[list[int], int]], dtype=torch.bfloat16, d: int = D,
                  bs: int = BS, seed: int = 0) -> torch.Tensor:
    """A KV cache [blocks, KVH, 2, bs, d] of random values in vLLM's per-layer view, with NaN in every slot past each
    row's context (unwritten slots may hold anything; none may reach an output)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    kv = torch.randn((blocks, KVH, 2, bs, d), generator=g, device="cuda").to(dtype)
    for table, seq in seqs.values():
        last = table[(seq - 1) // bs]
        kv[last, :, :, (seq - 1) % bs + 1:] = float("nan")
    return kv.view(blocks, KVH, bs, 2 * d)


def _attention64(q: torch.Tensor, kv: torch.Tensor, table: list[int], seq: int, lq: int) -> torch.Tensor:
    """float64 causal attention of a row's lq query tokens [lq, H', d] (the last lq positions of seq) over its
    blocks."""
    blocks = kv.shape[0]
    d = q.shape[-1]
    bs = kv.shape[2]
    kv5 = kv.view(blocks, KVH, 2, bs, d)[table].double()  # [nb, KVH, 2, bs, d]
    k = kv5[:, :, 0].permute(1, 0, 2, 3).reshape(KVH, -1, d)[:, :seq]
    v = kv5[:, :, 1].permute(1, 0, 2, 3).reshape(KVH, -1, d)[:, :seq]
    g = q.shape[1] // KVH
    k, v = k.repeat_interleave(g, 0), v.repeat_interleave(g, 0)  # [H', seq, d]
    s = torch.einsum("thd,hkd->htk", q.double(), k) * d ** -0.5
    pos = torch.arange(seq, device=q.device)
    s = s.masked_fill(pos.view(1, 1, -1) > (seq - lq + torch.arange(lq, device=q.device)).view(1, -1, 1),
                      float("-inf"))
    return torch.einsum("htk,hkd->thd", s.softmax(-1), v)


# A mixed step: long and short decode rows, unaligned and aligned contexts, and a prefill chunk (which the batch does
# not take) between them; block ids scattered as vLLM's allocator hands them out.
MIXED = [(5003, 1), (300, 7), (17, 1), (1024, 1), (2049, 1)]


def _mixed_step(seed: int = 0, bs: int = BS):
    rng = random.Random(seed)
    need = [-(-seq // bs) for seq, _ in MIXED]
    ids = list(range(sum(need) + 8))
    rng.shuffle(ids)
    tables, at = [], 0
    for n in need:
        tables.append(ids[at:at + n])
        at += n
    width = max(need)
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    qsl = [0]
    for _, lq in MIXED:
        qsl.append(qsl[-1] + lq)
    return (torch.tensor(qsl, dtype=torch.int32), torch.tensor([s for s, _ in MIXED], dtype=torch.int32), table,
            len(ids), {i: (tables[i], seq) for i, (seq, _) in enumerate(MIXED)})


@pytest.mark.parametrize("placement", ["in_place", "pool"])
@pytest.mark.parametrize("dtype,d,heads,bs", [(torch.bfloat16, 128, 32, 16), (torch.float16, 64, 16, 32),
                                              (torch.bfloat16, 256, 64, 16), (torch.bfloat16, 128, 8, 16)])
def test_decode_batch_matches_float64_attention_and_the_aten_path(placement: str, dtype, d: int, heads: int,
                                                                   bs: int) -> None:
    """Every exact decode row of a mixed step in one launch (in place, or from a pool that holds them), NaN in every
    unwritten slot: within the CUDA kernel's tolerance of the ATen path and of float64 attention, the prefill row's
    output as the per-tile path gives it, and bit-identical when repeated."""
    qsl, seqs, table, blocks, rows = _mixed_step(bs=bs)
    kv = _filled_cache(blocks, rows, dtype, d, bs)
    torch.manual_seed(1)
    tokens = int(qsl[-1])
    q = torch.randn(tokens + 3, heads, d, device="cuda").to(dtype)  # 3 padding tokens past the real ones
    outs, snaps = {}, {}
    for kernel in ("native", "aten"):
        pool = 0 if placement == "in_place" else blocks
        eng = _batch_engine(placement, pool, kernel, dtype, d, heads, bs)
        plan = eng.build(qsl, seqs, table, len(MIXED), tokens + 3)
        runs = []
        for _ in range(3 if placement == "pool" else 2):  # the pool's first forward admits; then all is resident
            out = torch.full_like(q, 7.0)
            eng.forward(0, plan, q, kv, out, d ** -0.5)
            runs.append(out)
        outs[kernel], snaps[kernel] = runs, eng.snapshot()
    native, aten = outs["native"][-1], outs["aten"][-1]
    assert torch.equal(native, outs["native"][-2]), "the decode batch is not repeatable"
    assert torch.equal(native[tokens:], q[tokens:].new_full((3, heads, d), 7.0)), "padding rows were written"
    tol = CUDA_KERNEL_TOL[dtype]
    err = ((native[:tokens].float() - aten[:tokens].float()).abs() / aten[:tokens].float().abs().clamp_min(1.0)).max()
    assert err.item() <= tol, err.item()
    for i, (seq, lq) in enumerate(MIXED):
        q0 = int(qsl[i])
        want = _attention64(q[q0:q0 + lq], kv, rows[i][0], seq, lq)
        got = native[q0:q0 + lq].double()
        assert ((got - want).abs() / want.abs().clamp_min(1.0)).max().item() <= tol, i
    n = snaps["native"]
    decode_rows = sum(1 for _, lq in MIXED if lq == 1)
    forwards = n["forward_calls"]
    taken = forwards if placement == "in_place" else forwards - 1  # the pool's first forward admitted the blocks
    assert n["decode_batch_rows"] == decode_rows * taken
    assert snaps["aten"]["decode_batch_rows"] == 0
    # The same counters as the ATen path: every block read once per forward, tiles as planned.
    for name in ("tiles_computed", "blocks_in_place", "blocks_hit", "blocks_admitted", "blocks_evicted"):
        assert n[name] == snaps["aten"][name], name


def test_decode_batch_is_one_launch_per_layer() -> None:
    """Two kernels per layer for the whole batch (split and merge), no per-row launch or copy."""
    from torch.profiler import ProfilerActivity, profile

    qsl, seqs, table, blocks, rows = _mixed_step()
    decode = [i for i, (_, lq) in enumerate(MIXED) if lq == 1]
    # Only the decode rows: one query token each.
    qsl = torch.arange(len(decode) + 1, dtype=torch.int32)
    seqs, table = seqs[decode], table[decode]
    kv = _filled_cache(blocks, {i: rows[r] for i, r in enumerate(decode)})
    eng = _batch_engine("in_place", layers=3)
    plan = eng.build(qsl, seqs, table, len(decode), len(decode))
    q = torch.randn(len(decode), H, D, device="cuda").to(torch.bfloat16)
    out = torch.empty_like(q)
    caches = [kv.clone() for _ in range(3)]
    for layer in range(3):  # warm-up: each layer binds its KV cache (key metadata allocated) at its first call
        eng.forward(layer, plan, q, caches[layer], out, D ** -0.5)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for layer in range(3):
            eng.forward(layer, plan, q, caches[layer], out, D ** -0.5)
        torch.cuda.synchronize()
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    names = [e.name.split("<")[0] for e in kernels]  # "void activekv::(anonymous namespace)::batch_split_kernel"
    assert sum("batch_split_kernel" in n for n in names) == 3, names
    assert sum("batch_merge_kernel" in n for n in names) == 3, names
    assert len(names) == 6, names  # nothing else: no copies, no per-row work


def test_decode_batch_reads_the_pool_through_its_page_table_after_evictions() -> None:
    """A pool that streamed another context (evicting, slots reused out of block order), then holds this step's blocks:
    the batch finds each block's slot in the page table on the device, brought up to date whole, then (a row grown
    into one new block) by its changed entries."""
    rng = random.Random(7)
    blocks = 600
    ids = list(range(blocks))
    rng.shuffle(ids)
    seqs = [1000, 333, 2049]
    tables, at = [], 0
    for seq in seqs:
        tables.append(ids[at:at + -(-seq // BS)])
        at += len(tables[-1])
    spare = ids[at]
    kv = _filled_cache(blocks, {})
    eng = _batch_engine("pool", pool_blocks=at + 8)
    q = torch.randn(len(seqs), H, D, device="cuda").to(torch.bfloat16)
    one = torch.tensor([0, 1], dtype=torch.int32)

    def plan_of(seq_list, table_list):
        width = max(len(t) for t in table_list)
        table = torch.tensor([t + [0] * (width - len(t)) for t in table_list], dtype=torch.int32)
        return eng.build(torch.arange(len(seq_list) + 1, dtype=torch.int32), torch.tensor(seq_list, dtype=torch.int32),
                         table, len(seq_list), len(seq_list))

    def check(out, seq_list, table_list):
        for i, (seq, table) in enumerate(zip(seq_list, table_list)):
            want = _attention64(q[i:i + 1], kv, table, seq, 1)
            err = ((out[i:i + 1].double() - want).abs() / want.abs().clamp_min(1.0)).max().item()
            assert err <= CUDA_KERNEL_TOL[torch.bfloat16], (i, err)

    # Another context over every block, in reverse: the pool fills and evicts.
    other = eng.build(one, torch.tensor([blocks * BS], dtype=torch.int32),
                      torch.arange(blocks - 1, -1, -1, dtype=torch.int32).view(1, -1), 1, 1)
    eng.forward(0, other, q[:1], kv, torch.empty_like(q[:1]), D ** -0.5)
    assert eng.snapshot()["blocks_evicted"] > 0
    plan = plan_of(seqs, tables)
    outs = []
    for _ in range(3):  # admits the missing blocks, then the batch twice
        out = torch.full_like(q, 7.0)
        eng.forward(0, plan, q, kv, out, D ** -0.5)
        outs.append(out)
    assert eng.snapshot()["decode_batch_rows"] == 2 * len(seqs)
    assert torch.equal(outs[1], outs[2])
    check(outs[2], seqs, tables)
    # Row 0 grows into a new block: admitted (one eviction), then the batch again with two changed page entries.
    seqs2 = [seqs[0] + (BS - seqs[0] % BS) + 2] + seqs[1:]
    tables2 = [tables[0] + [spare]] + tables[1:]
    plan2 = plan_of(seqs2, tables2)
    for _ in range(2):
        out = torch.full_like(q, 7.0)
        eng.forward(0, plan2, q, kv, out, D ** -0.5)
    snap = eng.snapshot()
    assert snap["decode_batch_rows"] == 3 * len(seqs)
    check(out, seqs2, tables2)


@pytest.mark.parametrize("split", ["1", "7", "64"])
def test_decode_batch_any_split_is_within_tolerance(split: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """ACTIVEKV_CUDA_SPLIT (sub-tiles per work item) changes only the order of the additions."""
    monkeypatch.setenv("ACTIVEKV_CUDA_SPLIT", split)
    test_decode_batch_matches_float64_attention_and_the_aten_path("in_place", torch.bfloat16, 128, 32, 16)


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
    assert "split_kernel" not in names["aten"] and "batch_split_kernel" not in names["aten"]
