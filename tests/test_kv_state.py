"""activekv._kv_state: host tier, active pool, page table and per-block key metadata (bindings/modules/kv_state.cpp).

KVState alone cannot make a block resident (admission lives in the engine), so write-through coherence is checked
through activekv._backend.Engine: update_kv, build, forward (admits), update_kv again into resident blocks.
"""

from __future__ import annotations

import pytest
import torch

import activekv._attention as attention  # after torch: the modules' import guard needs it
import activekv._backend as backend
import activekv._geometry as geometry
import activekv._kv_state as kv_state

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 4, 2, 8, 4
NUM_BLOCKS = 5
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE
POOL_BLOCKS = 3
PART_COUNTERS = ("tokens_written", "padding_slots", "write_through_tokens", "host_rebinds")


def make_state(dtype: torch.dtype = torch.float32, num_layers: int = 1) -> kv_state.KVState:
    return kv_state.KVState(num_layers, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype, POOL_BLOCKS)


def make_geometry(dtype: torch.dtype = torch.float32) -> geometry.Geometry:
    return geometry.Geometry(1, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype)


def vllm_cache(dtype: torch.dtype, num_blocks: int = NUM_BLOCKS, seed: int = 100) -> torch.Tensor:
    """A vLLM-shaped per-layer cache [nb, kvh, bs, 2d] holding recognisable non-zero bytes."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, generator=gen).to(dtype)


def kv_tokens(n: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    key = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    value = torch.randn(n, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    return key, value


def block_view(cache: torch.Tensor) -> torch.Tensor:
    """[nb, kvh, 2, bs, d] view of a cache, through the engine's own reinterpretation."""
    return geometry.as_block_layout(make_geometry(cache.dtype), cache)


def expected_host(before: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """Block layout after writing token i at slots[i] (-1 skipped), computed one token at a time."""
    host = block_view(before.clone()).clone()
    for i, s in enumerate(slots):
        if s == -1:
            continue
        host[s // BLOCK_SIZE, :, 0, s % BLOCK_SIZE] = key[i]
        host[s // BLOCK_SIZE, :, 1, s % BLOCK_SIZE] = value[i]
    return host


def part_counters(state: kv_state.KVState) -> dict[str, int]:
    c = state.counters()
    return {name: c[name] for name in PART_COUNTERS}


# --- placement -----------------------------------------------------------------------------------------------------

SLOT_CASES = {
    "empty": [],
    "one_token": [0],
    "one_token_mid_block": [6],
    "block_boundary": [BLOCK_SIZE - 1, BLOCK_SIZE],
    "prefill_two_blocks": list(range(2 * BLOCK_SIZE)),
    "pool_boundary_last_slot": [NUM_SLOTS - 1],
    "first_and_last_slot": [0, NUM_SLOTS - 1],
    "scattered": [17, 2, 9, 12, 3],
    "with_padding": [-1, 5, -1, 6, -1],
    "all_padding": [-1, -1, -1],
    "every_slot_permuted": torch.randperm(NUM_SLOTS, generator=torch.Generator().manual_seed(7)).tolist(),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("slots", list(SLOT_CASES.values()), ids=list(SLOT_CASES))
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_write_places_kv_at_slots(dtype: torch.dtype, slots: list[int], index_dtype: torch.dtype) -> None:
    state = make_state(dtype)
    cache = vllm_cache(dtype)
    before = cache.clone()
    key, value = kv_tokens(len(slots), dtype, seed=1)
    state.write(0, cache, key, value, torch.tensor(slots, dtype=index_dtype))
    assert torch.equal(block_view(cache), expected_host(before, key, value, slots))
    counters = part_counters(state)
    assert counters == {"tokens_written": sum(s != -1 for s in slots), "padding_slots": slots.count(-1),
                        "write_through_tokens": 0, "host_rebinds": 0}
    assert state.resident(0) == {}


def test_write_into_block_layout_cache() -> None:
    state = make_state()
    cache = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, 2, BLOCK_SIZE, HEAD_SIZE)
    key, value = kv_tokens(2, torch.float32, seed=2)
    state.write(0, cache, key, value, torch.tensor([5, 10]))
    assert torch.equal(cache[1, :, 0, 1], key[0]) and torch.equal(cache[1, :, 1, 1], value[0])
    assert torch.equal(cache[2, :, 0, 2], key[1]) and torch.equal(cache[2, :, 1, 2], value[1])
    assert int(cache.count_nonzero()) == 2 * 2 * NUM_KV_HEADS * HEAD_SIZE


def test_slot_mapping_shorter_than_key_writes_only_its_tokens() -> None:
    """vLLM pads key/value past num_actual_tokens; only the first len(slot_mapping) tokens are written."""
    state = make_state()
    cache = vllm_cache(torch.float32)
    before = cache.clone()
    key, value = kv_tokens(6, torch.float32, seed=3)
    state.write(0, cache, key, value, torch.tensor([8, 9]))
    assert torch.equal(block_view(cache), expected_host(before, key, value, [8, 9]))
    assert part_counters(state)["tokens_written"] == 2


def test_bind_host_returns_a_view_of_the_cache() -> None:
    state = make_state()
    cache = vllm_cache(torch.float32)
    host = state.bind_host(0, cache)
    assert host.data_ptr() == cache.data_ptr()
    assert list(host.shape) == [NUM_BLOCKS, NUM_KV_HEADS, 2, BLOCK_SIZE, HEAD_SIZE]
    assert torch.equal(host, block_view(cache))


def test_pool_starts_zeroed_and_empty() -> None:
    state = make_state(torch.bfloat16)
    pool = state.pool(0)
    assert list(pool.shape) == [POOL_BLOCKS, NUM_KV_HEADS, 2, BLOCK_SIZE, HEAD_SIZE]
    assert pool.dtype == torch.bfloat16
    assert int(pool.count_nonzero()) == 0
    assert state.resident(0) == {}


def test_key_metadata_is_undefined_before_the_first_bind() -> None:
    state = make_state()
    assert state.key_min(0) is None and state.key_max(0) is None
    state.bind_host(0, vllm_cache(torch.float32))
    assert torch.equal(state.key_min(0), torch.full((NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE), float("inf")))
    assert torch.equal(state.key_max(0), torch.full((NUM_BLOCKS, NUM_KV_HEADS, HEAD_SIZE), float("-inf")))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_without_key_metadata_writes_keep_none_and_the_same_tiers(dtype: torch.dtype) -> None:
    """key_metadata=False (an exact engine's state): no key min/max after a bind or a write, and the host tier and
    the pool hold the same bytes as a state that keeps them."""
    bare = kv_state.KVState(1, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype, POOL_BLOCKS,
                            key_metadata=False)
    full = make_state(dtype)
    cache, full_cache = vllm_cache(dtype), vllm_cache(dtype)
    bare.bind_host(0, cache)
    assert bare.key_min(0) is None and bare.key_max(0) is None
    prompt = list(range(2 * BLOCK_SIZE + 2)) + [-1]
    key, value = kv_tokens(len(prompt), dtype, seed=12)
    bare.write(0, cache, key, value, torch.tensor(prompt))
    full.write(0, full_cache, key, value, torch.tensor(prompt))
    assert bare.key_min(0) is None and bare.key_max(0) is None and full.key_min(0) is not None
    assert torch.equal(cache, full_cache) and torch.equal(bare.pool(0), full.pool(0))
    assert bare.counters()["tokens_written"] == full.counters()["tokens_written"] == len(prompt) - 1


def test_layers_are_independent() -> None:
    state = make_state(num_layers=2)
    cache0, cache1 = vllm_cache(torch.float32, seed=1), vllm_cache(torch.float32, seed=2)
    before1 = cache1.clone()
    key, value = kv_tokens(1, torch.float32, seed=4)
    state.write(0, cache0, key, value, torch.tensor([3]))
    assert torch.equal(cache1, before1)
    assert state.key_min(1) is None


# --- rejections leave everything as it was -------------------------------------------------------------------------


def snapshot(state: kv_state.KVState, cache: torch.Tensor) -> tuple:
    return (cache.clone(), state.pool(0).clone(), state.key_min(0).clone(), state.key_max(0).clone(),
            part_counters(state), state.resident(0))


def assert_unchanged(a: tuple, b: tuple) -> None:
    for x, y in zip(a[:4], b[:4]):
        assert torch.equal(x, y)
    assert a[4:] == b[4:]


@pytest.mark.parametrize(
    ("slots", "bad_index", "bad_slot"),
    [
        ([NUM_SLOTS], 0, NUM_SLOTS),                 # pool boundary: one past the last slot
        ([0, 1, NUM_SLOTS + 7], 2, NUM_SLOTS + 7),   # valid entries before the bad one are not written either
        ([-1, 4, -2], 2, -2),                        # negative other than PAD_SLOT_ID, after a padding entry
        ([5, -(2**40)], 1, -(2**40)),
    ],
)
def test_invalid_slot_is_an_index_error_and_changes_nothing(slots: list[int], bad_index: int, bad_slot: int) -> None:
    state = make_state()
    cache = vllm_cache(torch.float32)
    key, value = kv_tokens(4, torch.float32, seed=5)
    state.write(0, cache, key[:2], value[:2], torch.tensor([0, 1]))  # some metadata and counts to preserve
    before = snapshot(state, cache)
    with pytest.raises(IndexError, match=rf"slot_mapping\[{bad_index}\] must be -1 \(padding\) or in "
                                         rf"\[0, {NUM_SLOTS}\), got {bad_slot}"):
        state.write(0, cache, key, value, torch.tensor(slots))
    assert_unchanged(before, snapshot(state, cache))


def test_every_slot_rejected_on_an_empty_cache() -> None:
    state = make_state()
    cache = vllm_cache(torch.float32, num_blocks=0)
    key, value = kv_tokens(1, torch.float32, seed=6)
    with pytest.raises(IndexError, match=r"slot_mapping\[0\] must be -1 \(padding\) or in \[0, 0\), got 0"):
        state.write(0, cache, key, value, torch.tensor([0]))
    state.write(0, cache, key, value, torch.tensor([-1]))
    assert part_counters(state)["padding_slots"] == 1


@pytest.mark.parametrize(
    ("change", "exc", "match"),
    [
        ("key_dtype", TypeError, "key must have dtype Float, got Half"),
        ("value_dtype", TypeError, "value must have dtype Float, got BFloat16"),
        ("key_heads", ValueError, r"key must be \[num_tokens, 2, 8\], got \[3, 4, 8\]"),
        ("value_rank", ValueError, r"value must be \[num_tokens, 2, 8\], got \[3, 16\]"),
        ("value_tokens", ValueError, "key and value must have the same number of tokens, got 3 and 2"),
        ("slot_dtype", TypeError, "slot_mapping must be an int64 or int32 tensor, got Float"),
        ("slot_rank", ValueError, r"slot_mapping must be 1-D \[num_tokens\], got \[1, 3\]"),
        ("slot_too_long", ValueError, "slot_mapping has 4 entries but key holds only 3 tokens"),
    ],
)
def test_bad_arguments_are_rejected_and_change_nothing(change: str, exc: type, match: str) -> None:
    state = make_state()
    cache = vllm_cache(torch.float32)
    key, value = kv_tokens(3, torch.float32, seed=7)
    slots = torch.tensor([0, 1, 2])
    state.write(0, cache, key, value, slots)
    before = snapshot(state, cache)
    if change == "key_dtype":
        key = key.half()
    elif change == "value_dtype":
        value = value.bfloat16()
    elif change == "key_heads":
        key = torch.zeros(3, 2 * NUM_KV_HEADS, HEAD_SIZE)
    elif change == "value_rank":
        value = value.reshape(3, -1)
    elif change == "value_tokens":
        value = value[:2]
    elif change == "slot_dtype":
        slots = slots.float()
    elif change == "slot_rank":
        slots = slots.unsqueeze(0)
    elif change == "slot_too_long":
        slots = torch.tensor([0, 1, 2, 3])
    with pytest.raises(exc, match=match):
        state.write(0, cache, key, value, slots)
    assert_unchanged(before, snapshot(state, cache))


def test_wrong_cache_is_rejected() -> None:
    state = make_state()
    key, value = kv_tokens(1, torch.float32, seed=8)
    with pytest.raises(TypeError, match="kv_cache must have dtype Float, got Half"):
        state.write(0, vllm_cache(torch.float16), key, value, torch.tensor([0]))
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        state.bind_host(0, torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, 2 * HEAD_SIZE, BLOCK_SIZE).transpose(2, 3))
    assert state.key_min(0) is None


@pytest.mark.parametrize("layer", [-1, 1])
def test_layer_out_of_range(layer: int) -> None:
    state = make_state()
    key, value = kv_tokens(1, torch.float32, seed=9)
    match = rf"layer must be in \[0, 1\), got {layer}"
    with pytest.raises(IndexError, match=match):
        state.write(layer, vllm_cache(torch.float32), key, value, torch.tensor([0]))
    for method in ("resident", "pool", "key_min", "key_max", "reset_layer"):
        with pytest.raises(IndexError, match=match):
            getattr(state, method)(layer)


def test_device_mismatch_is_rejected() -> None:
    """The host tier and the new K/V must be on the engine's device (meta stands in for an accelerator here)."""
    state = kv_state.KVState(1, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, 2, torch.device("meta"))
    assert state.pool(0).device == torch.device("meta")
    with pytest.raises(ValueError, match=r"kv_cache must be on meta \(the engine's device\), got cpu"):
        state.bind_host(0, vllm_cache(torch.float32))
    meta_cache = torch.empty(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE, device="meta")
    key, value = kv_tokens(1, torch.float32, seed=30)
    with pytest.raises(ValueError, match="key must be on meta, got cpu"):
        state.write(0, meta_cache, key, value, torch.tensor([0]))
    assert part_counters(state)["tokens_written"] == 0


def test_invalid_pool_blocks() -> None:
    with pytest.raises(ValueError, match=r"pool_blocks must be >= 0 \(0: no pool, for placement in place\), got -1"):
        kv_state.KVState(1, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, -1)


def test_invalid_geometry() -> None:
    with pytest.raises(ValueError, match="num_heads must be a multiple of num_kv_heads"):
        kv_state.KVState(1, 3, 2, HEAD_SIZE, BLOCK_SIZE, torch.float32, 1)
    with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16"):
        kv_state.KVState(1, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float64, 1)


# --- key metadata --------------------------------------------------------------------------------------------------


def expected_minmax(key: torch.Tensor, slots: list[int], num_blocks: int = NUM_BLOCKS) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    kmin = torch.full((num_blocks, NUM_KV_HEADS, HEAD_SIZE), float("inf"))
    kmax = torch.full((num_blocks, NUM_KV_HEADS, HEAD_SIZE), float("-inf"))
    for i, s in enumerate(slots):
        if s == -1:
            continue
        b = s // BLOCK_SIZE
        kmin[b] = torch.minimum(kmin[b], key[i].float())
        kmax[b] = torch.maximum(kmax[b], key[i].float())
    return kmin.to(key.dtype), kmax.to(key.dtype)  # exact: every min / max is one of the keys


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_key_min_max_track_the_keys_written(dtype: torch.dtype) -> None:
    state = make_state(dtype)
    cache = vllm_cache(dtype)
    # A prompt of 2 full blocks and a partial third (block-boundary and partial-block cases), with padding.
    prompt = list(range(2 * BLOCK_SIZE + 2)) + [-1, -1]
    key, value = kv_tokens(len(prompt), dtype, seed=10)
    state.write(0, cache, key, value, torch.tensor(prompt))
    kmin, kmax = expected_minmax(key, prompt)
    assert state.key_min(0).dtype == dtype and state.key_max(0).dtype == dtype  # the KV dtype (kv_state.h)
    assert torch.equal(state.key_min(0), kmin) and torch.equal(state.key_max(0), kmax)

    # Decode: the partial block grows (no offset 0): its metadata accumulates.
    key2, value2 = kv_tokens(1, dtype, seed=11)
    state.write(0, cache, key2, value2, torch.tensor([2 * BLOCK_SIZE + 2]))
    kmin, kmax = expected_minmax(torch.cat([key, key2]), prompt + [2 * BLOCK_SIZE + 2])
    assert torch.equal(state.key_min(0), kmin) and torch.equal(state.key_max(0), kmax)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_key_metadata_resets_when_a_block_is_refilled(dtype: torch.dtype) -> None:
    """vLLM frees block 1 and gives it to a new request, which fills it from offset 0: the old request's keys must
    not survive in the block's min/max."""
    state = make_state(dtype)
    cache = vllm_cache(dtype)
    old = list(range(3 * BLOCK_SIZE))
    key_old, value_old = kv_tokens(len(old), dtype, seed=12)
    # Old keys are large, new keys small, so stale metadata would show in both min and max.
    key_old = (key_old.float() * 100).to(dtype)
    state.write(0, cache, key_old, value_old, torch.tensor(old))
    new = [BLOCK_SIZE, BLOCK_SIZE + 1]  # offsets 0 and 1 of block 1
    key_new, value_new = kv_tokens(len(new), dtype, seed=13)
    state.write(0, cache, key_new, value_new, torch.tensor(new))
    kmin, kmax = expected_minmax(key_old, old)
    new_min, new_max = expected_minmax(key_new, new)
    kmin[1], kmax[1] = new_min[1], new_max[1]
    assert torch.equal(state.key_min(0), kmin) and torch.equal(state.key_max(0), kmax)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cpu_write_matches_the_aten_index_put_and_scatter(dtype: torch.dtype) -> None:
    """On CPU the write is plain loops (kv_state.cpp write_cpu); other devices use ATen's index_put_ and
    scatter_reduce_. The cache bytes match index assignment bit for bit; the key min/max match scatter_reduce_
    amin/amax value for value with NaN, signed zeros and infinities in one block (a tie of -0 and +0 may keep either
    zero, and a NaN's payload may differ: ATen leaves both unspecified, and neither changes a Quest score). Key and value
    are strided views of a wider tensor, as vLLM's split of a fused qkv gives them."""
    state = make_state(dtype)
    cache = vllm_cache(dtype)
    before = cache.clone()
    n = 2 * BLOCK_SIZE + 1
    gen = torch.Generator().manual_seed(30)
    qkv = torch.randn(n, 3, NUM_KV_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    special = torch.tensor([float("nan"), 0.0, -0.0, float("inf"), -float("inf"), -0.0, 0.0, 1.0]).to(dtype)
    qkv[:HEAD_SIZE, 1, 0, 0] = special[:HEAD_SIZE]  # head 0, value 0 of tokens 0-7 (blocks 1 and 3)
    qkv[:2, 1, 1, :] = 1.0  # head 1 of block 1: tokens 0 and 1 above, then -0 and +0 tie for the min
    qkv[2, 1, 1, :] = -0.0
    qkv[3, 1, 1, :] = 0.0
    key, value = qkv[:, 1], qkv[:, 2]
    assert not key.is_contiguous()
    slots = torch.tensor([5, 4, 6, 7, 12, 13, 14, 15, 0])
    state.write(0, cache, key, value, slots)
    blk, off = slots // BLOCK_SIZE, slots % BLOCK_SIZE
    want = block_view(before.clone())
    want[blk, :, 0, off] = key
    want[blk, :, 1, off] = value
    assert torch.equal(block_view(cache).view(torch.int8), want.view(torch.int8))
    nb, width = NUM_BLOCKS, NUM_KV_HEADS * HEAD_SIZE
    index = blk.unsqueeze(1).expand(n, width)
    for name, reduce, init in (("key_min", "amin", float("inf")), ("key_max", "amax", -float("inf"))):
        expect = torch.full((nb, width), init, dtype=dtype)
        expect.scatter_reduce_(0, index, key.reshape(n, width), reduce, include_self=True)
        got = getattr(state, name)(0).reshape(nb, width)
        torch.testing.assert_close(got, expect, rtol=0, atol=0, equal_nan=True, msg=name)
        assert got.isnan().any()  # the NaN reached the metadata
    assert (state.key_min(0)[1, 1] == 0).all()  # block 1, head 1: the -0 / +0 tie is the min


def test_key_metadata_of_a_one_token_block() -> None:
    state = make_state()
    cache = vllm_cache(torch.float32)
    key, value = kv_tokens(1, torch.float32, seed=14)
    state.write(0, cache, key, value, torch.tensor([4 * BLOCK_SIZE]))  # first slot of the last block
    assert torch.equal(state.key_min(0)[4], key[0]) and torch.equal(state.key_max(0)[4], key[0])
    assert bool(state.key_min(0)[:4].isposinf().all()) and bool(state.key_max(0)[:4].isneginf().all())


# --- host rebinds --------------------------------------------------------------------------------------------------


def test_same_storage_is_not_a_rebind() -> None:
    state = make_state()
    cache = vllm_cache(torch.float32)
    key, value = kv_tokens(1, torch.float32, seed=15)
    state.write(0, cache, key, value, torch.tensor([1]))
    state.write(0, cache, key, value, torch.tensor([2]))
    state.bind_host(0, cache.view(NUM_BLOCKS, NUM_KV_HEADS, 2, BLOCK_SIZE, HEAD_SIZE))  # same bytes, other shape
    assert part_counters(state)["host_rebinds"] == 0
    assert torch.equal(state.key_max(0)[0], key[0])   # metadata of block 0 survived: no reset happened


@pytest.mark.parametrize("num_blocks", [NUM_BLOCKS, NUM_BLOCKS + 2, 1])
def test_new_storage_is_a_rebind_and_resets_metadata(num_blocks: int) -> None:
    state = make_state()
    key, value = kv_tokens(1, torch.float32, seed=16)
    first = vllm_cache(torch.float32)  # kept alive: identity is the data pointer, which a freed cache could recycle
    state.write(0, first, key, value, torch.tensor([0]))
    assert part_counters(state)["host_rebinds"] == 0
    other = vllm_cache(torch.float32, num_blocks=num_blocks, seed=101)
    host = state.bind_host(0, other)
    assert part_counters(state)["host_rebinds"] == 1
    assert host.data_ptr() == other.data_ptr()
    assert torch.equal(state.key_min(0), torch.full((num_blocks, NUM_KV_HEADS, HEAD_SIZE), float("inf")))
    assert torch.equal(state.key_max(0), torch.full((num_blocks, NUM_KV_HEADS, HEAD_SIZE), float("-inf")))
    assert state.resident(0) == {}


def test_first_bind_is_not_a_rebind() -> None:
    state = make_state()
    state.bind_host(0, vllm_cache(torch.float32))
    assert part_counters(state)["host_rebinds"] == 0


def test_reset_layer_keeps_metadata_and_bytes() -> None:
    state = make_state()
    cache = vllm_cache(torch.float32)
    key, value = kv_tokens(2, torch.float32, seed=17)
    state.write(0, cache, key, value, torch.tensor([0, 1]))
    kmin = state.key_min(0).clone()
    cache_before = cache.clone()
    state.reset_layer(0)
    assert state.resident(0) == {}
    assert torch.equal(state.key_min(0), kmin)
    assert torch.equal(cache, cache_before)


# --- write-through coherence (through the engine, the one place blocks become resident) ----------------------------

TILE_BLOCKS = 2


def make_engine(dtype: torch.dtype, pool_blocks: int) -> backend.Engine:
    # The ATen tile path: the coherence checks compare its output bit for bit with tiled_attention on the host bytes.
    return backend.Engine(1, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, dtype, pool_blocks, TILE_BLOCKS,
                          kernel="aten")


def run_forward(engine: backend.Engine, cache: torch.Tensor, row: list[int], seq_len: int, num_q: int,
                dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    query = torch.randn(num_q, NUM_HEADS, HEAD_SIZE, generator=gen).to(dtype)
    plan = engine.build(torch.tensor([0, num_q], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
                        torch.tensor([row], dtype=torch.int32), 1, num_q)
    output = torch.zeros(num_q, NUM_HEADS, HEAD_SIZE, dtype=dtype)
    engine.forward(0, plan, query, cache, output, HEAD_SIZE**-0.5)
    return query, output


def assert_pool_coherent(engine: backend.Engine, cache: torch.Tensor) -> None:
    host = block_view(cache)
    resident = engine.resident(0)
    assert resident
    pool = engine.pool(0)
    for block, slot in resident.items():
        assert torch.equal(pool[slot], host[block]), f"pool slot {slot} is stale for block {block}"


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_write_through_keeps_resident_blocks_coherent(dtype: torch.dtype) -> None:
    engine = make_engine(dtype, pool_blocks=4)
    cache = vllm_cache(dtype)
    row = [3, 0, 4]  # vLLM physical block ids of the request, out of order on purpose
    prompt_len = 2 * BLOCK_SIZE + 1
    slots = [row[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(prompt_len)]
    key, value = kv_tokens(prompt_len, dtype, seed=20)
    engine.update_kv(0, key, value, cache, torch.tensor(slots))
    run_forward(engine, cache, row, prompt_len, prompt_len, dtype, seed=21)
    assert engine.resident(0) == {3: 0, 0: 1, 4: 2}
    assert engine.snapshot()["write_through_tokens"] == 0

    # Decode into the resident partial block (offset 1 of block 4) and a padding entry.
    key2, value2 = kv_tokens(2, dtype, seed=22)
    engine.update_kv(0, key2, value2, cache, torch.tensor([4 * BLOCK_SIZE + 1, -1]))
    assert engine.snapshot()["write_through_tokens"] == 1
    assert_pool_coherent(engine, cache)

    # Block 0 is freed by vLLM and reused by another request from offset 0, while still resident here.
    key3, value3 = kv_tokens(BLOCK_SIZE, dtype, seed=23)
    engine.update_kv(0, key3, value3, cache, torch.arange(0, BLOCK_SIZE))
    assert engine.snapshot()["write_through_tokens"] == 1 + BLOCK_SIZE
    assert_pool_coherent(engine, cache)

    # A write to a block that is not resident does not touch the pool.
    pool_before = engine.pool(0).clone()
    key4, value4 = kv_tokens(1, dtype, seed=24)
    engine.update_kv(0, key4, value4, cache, torch.tensor([1 * BLOCK_SIZE + 2]))
    assert torch.equal(engine.pool(0), pool_before)
    assert engine.snapshot()["write_through_tokens"] == 1 + BLOCK_SIZE

    # The next decode step reads the pool (all hits): the result is attention over the current host bytes.
    seq_len = prompt_len + 1
    before = engine.snapshot()
    query, output = run_forward(engine, cache, row, seq_len, 1, dtype, seed=25)
    after = engine.snapshot()
    assert after["blocks_hit"] - before["blocks_hit"] == 3
    assert after["blocks_admitted"] == before["blocks_admitted"]
    host_row = block_view(cache)[torch.tensor(row)]
    expected = attention.tiled_attention(query, host_row, seq_len, TILE_BLOCKS, HEAD_SIZE**-0.5)
    assert torch.equal(output, expected.to(dtype))


def test_write_through_of_a_rejected_update_changes_nothing() -> None:
    engine = make_engine(torch.float32, pool_blocks=2)
    cache = vllm_cache(torch.float32)
    key, value = kv_tokens(BLOCK_SIZE, torch.float32, seed=26)
    engine.update_kv(0, key, value, cache, torch.arange(BLOCK_SIZE))
    run_forward(engine, cache, [0], BLOCK_SIZE, 1, torch.float32, seed=27)
    assert engine.resident(0) == {0: 0}
    pool_before, cache_before = engine.pool(0).clone(), cache.clone()
    with pytest.raises(IndexError, match=r"slot_mapping\[1\] must be -1 \(padding\) or in \[0, 20\), got 20"):
        engine.update_kv(0, key[:2], value[:2], cache, torch.tensor([0, NUM_SLOTS]))
    assert torch.equal(engine.pool(0), pool_before) and torch.equal(cache, cache_before)
    assert engine.snapshot()["write_through_tokens"] == 0


def test_rebind_through_the_engine_forgets_resident_blocks() -> None:
    engine = make_engine(torch.float32, pool_blocks=2)
    cache = vllm_cache(torch.float32)
    key, value = kv_tokens(BLOCK_SIZE, torch.float32, seed=28)
    engine.update_kv(0, key, value, cache, torch.arange(BLOCK_SIZE))
    run_forward(engine, cache, [0], BLOCK_SIZE, 1, torch.float32, seed=29)
    assert engine.resident(0) == {0: 0}
    other = vllm_cache(torch.float32, seed=102)
    engine.update_kv(0, key, value, other, torch.arange(BLOCK_SIZE))
    assert engine.snapshot()["host_rebinds"] == 1
    assert engine.snapshot()["write_through_tokens"] == 0
    assert engine.resident(0) == {}


def test_a_freed_cache_cannot_pass_for_a_new_one() -> None:
    """The bound host tier is held, so a cache allocated after vLLM frees the old one never reuses its address and is
    always seen as a rebind (a stale pool would otherwise serve the old cache's blocks)."""
    state = make_state()
    first = vllm_cache(torch.float32)
    first_ptr = first.data_ptr()
    state.bind_host(0, first)
    del first
    second = vllm_cache(torch.float32, seed=7)
    assert second.data_ptr() != first_ptr
    state.bind_host(0, second)
    assert state.counters()["host_rebinds"] == 1


def test_rejected_engine_update_neither_counts_nor_rebinds() -> None:
    eng = backend.Engine(1, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, POOL_BLOCKS, 1)
    bound = vllm_cache(torch.float32)
    k, v = kv_tokens(2, torch.float32, seed=1)
    eng.update_kv(0, k, v, bound, torch.tensor([0, 1]))
    before = eng.snapshot()
    other = vllm_cache(torch.float32, seed=3)
    with pytest.raises(IndexError, match=r"slot_mapping\[1\] must be -1 \(padding\) or in \[0, 20\), got 20"):
        eng.update_kv(0, k, v, other, torch.tensor([0, NUM_SLOTS]))
    with pytest.raises(TypeError, match="key must have dtype Float"):
        eng.update_kv(0, k.double(), v, other, torch.tensor([0, 1]))
    after = eng.snapshot()
    for name in ("kv_update_calls", "host_rebinds", "tokens_written"):
        assert after[name] == before[name], name
    assert torch.equal(other, vllm_cache(torch.float32, seed=3))


CONCURRENT_WRITES = """
import threading, torch
import activekv._kv_state as kv_state
NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, NUM_BLOCKS = 4, 2, 64, 16, 64
state = kv_state.KVState(1, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, 3)
cache = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
def work(t):
    g = torch.Generator().manual_seed(t)
    slots = torch.arange(t * 16 * BLOCK_SIZE, (t + 1) * 16 * BLOCK_SIZE)  # 16 blocks of its own
    for _ in range(200):
        k = torch.randn(len(slots), NUM_KV_HEADS, HEAD_SIZE, generator=g)
        state.write(0, cache, k, k, slots)
        state.key_min(0), state.pool(0), state.resident(0), state.counters()
threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
assert state.counters()["tokens_written"] == 4 * 200 * 16 * BLOCK_SIZE
print("ok")
"""


def test_writes_from_several_threads_are_serialised() -> None:
    """KVState.write releases the GIL: two threads writing at once corrupted the heap (abort). A subprocess with a
    timeout, so a crash or a deadlock fails this test instead of the run."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", CONCURRENT_WRITES], capture_output=True, text=True, timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, "ok"), done.stderr[-3000:]


def test_accessors_hand_out_copies() -> None:
    """pool / key_min / key_max return copies: set_() or writes on what they return never reach the state."""
    state = make_state()
    cache = vllm_cache(torch.float32)
    key, value = kv_tokens(3, torch.float32, seed=1)
    state.write(0, cache, key, value, torch.tensor([0, 1, 2]))
    before = (state.pool(0).clone(), state.key_min(0).clone(), state.key_max(0).clone())
    for got in (state.pool(0), state.key_min(0), state.key_max(0)):
        got.fill_(7.0)
        got.set_(torch.empty(0))
    assert all(torch.equal(a, b) for a, b in zip(before, (state.pool(0), state.key_min(0), state.key_max(0))))
    state.write(0, cache, key, value, torch.tensor([4, 5, 6]))  # the state's own storage is intact
    assert state.counters()["tokens_written"] == 6


@pytest.mark.parametrize("shrunk", ["kv_cache", "key", "value"])
def test_a_storage_shrunk_under_its_view_is_rejected(shrunk: str) -> None:
    """A tensor whose storage was resized below its view was written past its end (SIGSEGV at exit)."""
    state = make_state()
    cache = vllm_cache(torch.float32)
    key, value = kv_tokens(3, torch.float32, seed=2)
    state.write(0, cache, key, value, torch.tensor([0, 1, 2]))
    before = cache.clone()
    {"kv_cache": cache, "key": key, "value": value}[shrunk].untyped_storage().resize_(16)
    with pytest.raises(ValueError, match=rf"{shrunk} must lie inside its storage: the view needs \d+ bytes"):
        state.write(0, cache, key, value, torch.tensor([4, 5, 6]))
    if shrunk != "kv_cache":
        assert torch.equal(cache, before)


@pytest.mark.parametrize("alias", ["key", "value", "slot_mapping"])
def test_arguments_that_are_views_into_the_cache_are_rejected(alias: str) -> None:
    """Key or value viewing the cache being written made the bytes written depend on the loop order."""
    state = make_state()
    cache = vllm_cache(torch.float32)
    before = cache.clone()
    key, value = kv_tokens(2, torch.float32, seed=3)
    slots = torch.tensor([8, 9])
    if alias == "slot_mapping":  # the slots [8, 9] stored in the cache's first 16 bytes, read as int64
        cache.view(-1)[:4] = torch.tensor([8, 9]).view(torch.float32)
        before, slots = cache.clone(), cache.view(-1)[:4].view(torch.int64)
    else:
        view = block_view(cache)[0, :, 0, :2].transpose(0, 1)  # [2 tokens, KVH, D] inside block 0's keys
        key, value = (view, value) if alias == "key" else (key, view)
    with pytest.raises(ValueError, match=rf"{alias} and kv_cache must not share memory"):
        state.write(0, cache, key, value, slots)
    assert torch.equal(cache, before) and state.counters()["tokens_written"] == 0


def test_one_cache_bound_to_two_layers_is_rejected() -> None:
    """Each layer keeps pool copies of its own host tier: a second layer on the same memory served stale copies."""
    state = make_state(num_layers=2)
    cache = vllm_cache(torch.float32)
    key, value = kv_tokens(1, torch.float32, seed=4)
    state.write(0, cache, key, value, torch.tensor([0]))
    with pytest.raises(ValueError, match="layer 1's kv_cache and layer 0's bound kv_cache must not share memory"):
        state.write(1, cache, key, value, torch.tensor([1]))
    with pytest.raises(ValueError, match="must not share memory"):
        state.bind_host(1, cache)
    assert state.key_min(1) is None and state.counters()["tokens_written"] == 1
