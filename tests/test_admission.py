"""activekv._admission: exact-mode tiles and the page table's admission/eviction policy (bindings/modules/admission.cpp).

Policy under test (engine/include/activekv/admission.h): a resident block is a hit; a missing one takes the lowest
free slot, else evicts the least recently used unpinned slot (ties: lowest slot); a tile's slots stay pinned until
released; a tile larger than the unpinned pool is rejected before anything changes.
"""

from __future__ import annotations

import pytest
import torch

import activekv._admission as admission  # after torch: the module's import guard needs it


def admitted(slots: list[int], miss_blocks: list[int] = (), miss_slots: list[int] = (), hits: int = 0,
             evicted: int = 0) -> dict:
    return {"slots": list(slots), "miss_blocks": list(miss_blocks), "miss_slots": list(miss_slots), "hits": hits,
            "evicted": evicted}


def admit_and_release(pool: admission.PagePool, blocks: list[int]) -> dict:
    a = pool.admit(blocks)
    pool.release(a["slots"])
    return a


# --- modes ---------------------------------------------------------------------------------------------------------


def test_parse_mode() -> None:
    """A mode is a str everywhere in Python: the option spelling, as Engine(mode=...) takes and Engine.mode gives."""
    assert admission.parse_mode("exact") == "exact"
    assert admission.parse_mode("compressed") == "compressed"
    assert not hasattr(admission, "Mode")


@pytest.mark.parametrize("name", ["", "Exact", "lru", "topk"])
def test_parse_unknown_mode(name: str) -> None:
    with pytest.raises(ValueError, match=rf"mode must be 'exact' or 'compressed', got '{name}'"):
        admission.parse_mode(name)


# --- compressed-mode counts ------------------------------------------------------------------------------------------

BIG = 2 ** 63 - 1


@pytest.mark.parametrize(("options", "match"), [
    ({"sink_blocks": BIG, "recent_blocks": BIG, "budget_tokens": 16}, r"recent_blocks must be in \[1, 2\^40\]"),
    ({"sink_blocks": 3, "recent_blocks": BIG, "budget_tokens": 16}, r"recent_blocks must be in \[1, 2\^40\]"),
    ({"sink_blocks": BIG, "budget_tokens": 2048}, rf"sink_blocks must be in \[0, 2\^40\], got {BIG}"),
    ({"budget_tokens": BIG}, rf"budget_tokens must be in \[0, 2\^40\], got {BIG}"),
    ({"budget_tokens": 2 ** 40 + 16}, r"budget_tokens must be in \[0, 2\^40\]"),
    ({"budget_tokens": -16}, r"budget_tokens must be in \[0, 2\^40\], got -16"),
])
def test_engine_refuses_counts_whose_sums_would_overflow(options: dict, match: str) -> None:
    """Counts over 2^40 are refused by name before k = budget / block - sink - recent is formed (an int64 overflow
    there once gave a 'valid' top_k and an IndexError at the first forward)."""
    from activekv import _backend

    with pytest.raises(ValueError, match=match):
        _backend.Engine(2, 8, 2, 64, 16, torch.float32, pool_blocks=64, tile_blocks=2, mode="compressed", **options)


def test_engine_refuses_cpu_pools_larger_than_the_machine_before_allocating() -> None:
    """A direct Engine whose CPU pools exceed physical memory is refused by name (it was killed by the OOM killer
    while allocating them), as the same pool given through vLLM's options is."""
    import os

    from activekv import _backend

    block_bytes, layers = 2 * 2 * 16 * 64 * 4, 2  # K and V of 2 KV heads x 16 tokens x 64 floats, per layer
    pool = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // (block_bytes * layers) + 1
    with pytest.raises(ValueError, match=rf"pool_blocks = {pool} needs .* GiB of pools \(2 layers, 16384 bytes per "
                                         r"block\), more than this machine's memory"):
        _backend.Engine(layers, 8, 2, 64, 16, torch.float32, pool_blocks=pool, tile_blocks=2)
    from activekv import _kv_state  # the pools' owner, constructed on its own

    with pytest.raises(ValueError, match=rf"pool_blocks = {pool} needs .* more than this machine's memory"):
        _kv_state.KVState(layers, 8, 2, 64, 16, torch.float32, pool, torch.device("cpu"))


@pytest.mark.parametrize(("counts", "match"), [
    ((2 ** 62, 2 ** 62, 1), r"sink_blocks must be in \[0, 2\^40\], got 4611686018427387904"),
    ((1, 0, 1), r"recent_blocks must be in \[1, 2\^40\]"),
    ((1, 2, 2 ** 41), r"top_k must be in \[1, 2\^40\], got 2199023255552"),
])
def test_select_blocks_refuses_out_of_range_counts(counts: tuple[int, int, int], match: str) -> None:
    q, meta = torch.randn(1, 8, 64), torch.zeros(16, 2, 64)
    with pytest.raises(ValueError, match=match):
        admission.select_blocks(q, meta, meta, torch.arange(16), *counts)


# --- exact tiles ---------------------------------------------------------------------------------------------------

ROW = torch.randperm(64, generator=torch.Generator().manual_seed(0))[:11].to(torch.int32)


@pytest.mark.parametrize("tile_blocks", [1, 3, 4, 11, 12])
@pytest.mark.parametrize("num_blocks", [0, 1, 2, 3, 4, 5, 11])
def test_exact_tiles_chunks_the_row_prefix(num_blocks: int, tile_blocks: int) -> None:
    ids = ROW.tolist()[:num_blocks]
    expected = [ids[i:i + tile_blocks] for i in range(0, num_blocks, tile_blocks)]
    tiles = admission.exact_tiles(ROW, num_blocks, tile_blocks)
    assert tiles == expected
    assert sum(len(t) for t in tiles) == num_blocks
    assert all(len(t) == tile_blocks for t in tiles[:-1])


def test_exact_tiles_of_an_empty_row() -> None:
    assert admission.exact_tiles(torch.zeros(0, dtype=torch.int32), 0, 2) == []


@pytest.mark.parametrize(
    ("row", "match"),
    [
        (torch.arange(4, dtype=torch.int64), "block_row must be a contiguous 1-D int32 tensor, got Long"),
        (torch.zeros(2, 2, dtype=torch.int32), r"block_row must be a contiguous 1-D int32 tensor, got Int \[2, 2\]"),
        (torch.arange(8, dtype=torch.int32)[::2], "block_row must be a contiguous 1-D int32 tensor"),
    ],
)
def test_exact_tiles_rejects_a_bad_row(row: torch.Tensor, match: str) -> None:
    with pytest.raises(TypeError, match=match):
        admission.exact_tiles(row, 1, 1)


@pytest.mark.parametrize(("num_blocks", "tile_blocks", "match"), [
    (12, 1, r"num_blocks must be in \[0, 11\], got 12"),
    (-1, 1, r"num_blocks must be in \[0, 11\], got -1"),
    (3, 0, "tile_blocks must be >= 1, got 0"),
    (3, -2, "tile_blocks must be >= 1, got -2"),
])
def test_exact_tiles_rejects_bad_counts(num_blocks: int, tile_blocks: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        admission.exact_tiles(ROW, num_blocks, tile_blocks)


# --- page pool -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("pool_blocks", "host_blocks", "match"), [
    (0, 4, "pool_blocks must be >= 1, got 0"),
    (-1, 4, "pool_blocks must be >= 1, got -1"),
    (2, -1, "host_blocks must be >= 0, got -1"),
])
def test_page_pool_rejects_bad_sizes(pool_blocks: int, host_blocks: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        admission.PagePool(pool_blocks, host_blocks)


def test_empty_tile_changes_nothing() -> None:
    pool = admission.PagePool(2, 4)
    admit_and_release(pool, [1])
    assert pool.admit([]) == admitted([])
    pool.release([])
    assert pool.resident() == {1: 0}


def test_empty_host_accepts_only_empty_tiles() -> None:
    pool = admission.PagePool(1, 0)
    assert pool.admit([]) == admitted([])
    with pytest.raises(IndexError, match=r"block id must be in \[0, 0\), got 0"):
        pool.admit([0])


def test_misses_take_the_lowest_free_slots_in_tile_order() -> None:
    pool = admission.PagePool(4, 16)
    assert pool.admit([9, 2, 14]) == admitted([0, 1, 2], [9, 2, 14], [0, 1, 2])
    assert pool.resident() == {9: 0, 2: 1, 14: 2}


def test_one_block_tiles_fill_slots_in_order() -> None:
    pool = admission.PagePool(3, 8)
    for i, block in enumerate([7, 5, 6]):
        assert admit_and_release(pool, [block]) == admitted([i], [block], [i])
    assert pool.resident() == {7: 0, 5: 1, 6: 2}


def test_resident_blocks_are_hits() -> None:
    pool = admission.PagePool(4, 16)
    admit_and_release(pool, [9, 2, 14])
    assert pool.admit([2, 14, 9]) == admitted([1, 2, 0], hits=3)
    pool.release([1, 2, 0])
    # A mixed tile: hits keep their slot, the miss takes the one free slot.
    assert pool.admit([14, 3]) == admitted([2, 3], [3], [3], hits=1)


def test_duplicate_block_in_a_tile_is_one_miss_then_a_hit() -> None:
    pool = admission.PagePool(2, 4)
    a = pool.admit([3, 3])
    assert a == admitted([0, 0], [3], [0], hits=1)
    pool.release([0, 0])  # pinned twice, released twice
    with pytest.raises(ValueError, match="slot 0 is not a pinned pool slot"):
        pool.release([0])


def test_lru_eviction_of_unpinned_slots() -> None:
    pool = admission.PagePool(3, 16)
    admit_and_release(pool, [0, 1, 2])   # last use: slot0 < slot1 < slot2
    admit_and_release(pool, [0])         # slot0 is now the most recent: slot1 is the LRU
    assert admit_and_release(pool, [3]) == admitted([1], [3], [1], evicted=1)
    assert pool.resident() == {0: 0, 2: 2, 3: 1}
    assert admit_and_release(pool, [4]) == admitted([2], [4], [2], evicted=1)   # slot2 (block 2) was next
    assert admit_and_release(pool, [5, 6]) == admitted([0, 1], [5, 6], [0, 1], evicted=2)
    assert pool.resident() == {4: 2, 5: 0, 6: 1}


def test_a_tile_never_evicts_its_own_blocks() -> None:
    pool = admission.PagePool(2, 8)
    admit_and_release(pool, [0, 1])
    # Block 1 is a hit (pinned, most recent); block 2 must evict block 0, not block 1.
    assert pool.admit([1, 2]) == admitted([1, 0], [2], [0], hits=1, evicted=1)
    assert pool.resident() == {1: 1, 2: 0}


def test_pinned_slots_are_never_evicted() -> None:
    pool = admission.PagePool(3, 16)
    held = pool.admit([0])                 # slot 0: least recently used, but pinned
    admit_and_release(pool, [1, 2])
    assert admit_and_release(pool, [3, 4]) == admitted([1, 2], [3, 4], [1, 2], evicted=2)
    assert admit_and_release(pool, [5]) == admitted([1], [5], [1], evicted=1)
    assert pool.resident()[0] == 0
    pool.release(held["slots"])
    assert admit_and_release(pool, [6]) == admitted([0], [6], [0], evicted=1)   # unpinned now: evictable


@pytest.mark.parametrize("pool_blocks", [1, 2, 5])
def test_a_tile_of_the_whole_pool_fits(pool_blocks: int) -> None:
    pool = admission.PagePool(pool_blocks, 64)
    admit_and_release(pool, list(range(pool_blocks)))
    blocks = list(range(pool_blocks, 2 * pool_blocks))
    assert admit_and_release(pool, blocks) == admitted(list(range(pool_blocks)), blocks, list(range(pool_blocks)),
                                                       evicted=pool_blocks)


@pytest.mark.parametrize(("pool_blocks", "pinned", "tile"), [
    (1, 0, 2),   # pool boundary: one block more than the pool
    (4, 0, 5),
    (4, 1, 4),   # fits the pool, not the unpinned part of it
    (4, 3, 2),
    (2, 2, 1),   # nothing unpinned left
])
def test_a_tile_larger_than_the_unpinned_pool_is_rejected_unchanged(pool_blocks: int, pinned: int, tile: int) -> None:
    pool = admission.PagePool(pool_blocks, 64)
    held = pool.admit(list(range(pinned))) if pinned else admitted([])
    resident = pool.resident()
    blocks = list(range(10, 10 + tile))
    with pytest.raises(ValueError, match=rf"a tile of {tile} blocks does not fit the active pool \({pool_blocks} "
                                         rf"slots, {pinned} pinned\)"):
        pool.admit(blocks)
    assert pool.resident() == resident
    # Pins are as they were: the held slots release exactly once, and the pool still admits what fits.
    pool.release(held["slots"])
    if held["slots"]:
        with pytest.raises(ValueError, match="is not a pinned pool slot"):
            pool.release(held["slots"][:1])
    whole_pool = list(range(10, 10 + pool_blocks))
    assert len(admit_and_release(pool, whole_pool)["slots"]) == pool_blocks


@pytest.mark.parametrize("bad", [16, 17, -1, -(2**40)])
def test_block_id_out_of_range_is_rejected_unchanged(bad: int) -> None:
    pool = admission.PagePool(4, 16)
    admit_and_release(pool, [1, 2])
    with pytest.raises(IndexError, match=rf"block id must be in \[0, 16\), got {bad}"):
        pool.admit([3, 15, bad])   # valid ids first: none of them is admitted either
    assert pool.resident() == {1: 0, 2: 1}
    assert pool.admit([15, 3]) == admitted([2, 3], [15, 3], [2, 3])   # free slots and pins untouched


@pytest.mark.parametrize("slot", [0, 1, 3, -1, 4, 99])
def test_release_of_a_slot_that_is_not_pinned(slot: int) -> None:
    pool = admission.PagePool(4, 16)
    pool.release(pool.admit([5, 6, 7])["slots"])   # slots 0..2 held blocks once and are unpinned again; 3 is free
    with pytest.raises(ValueError, match=rf"slot {slot} is not a pinned pool slot"):
        pool.release([slot])


def test_release_checks_every_slot_before_unpinning() -> None:
    pool = admission.PagePool(4, 16)
    pool.admit([5, 6])                 # slots 0, 1 pinned once
    with pytest.raises(ValueError, match="slot 2 is not a pinned pool slot"):
        pool.release([0, 2])
    pool.release([0, 1])               # slot 0 still pinned: the failed release unpinned nothing


def test_release_of_a_slot_listed_more_often_than_pinned() -> None:
    """Releasing [s, s] when s is pinned once must be a ValueError that leaves the pin in place (the per-slot check
    has to count repeats), not an internal assertion after the first unpin."""
    pool = admission.PagePool(2, 4)
    pool.admit([3])                    # slot 0 pinned once
    with pytest.raises(ValueError, match="slot 0 is not a pinned pool slot"):
        pool.release([0, 0])
    pool.release([0])                  # the pin survived the rejected call
    with pytest.raises(ValueError, match="slot 0 is not a pinned pool slot"):
        pool.release([0])


def test_a_pool_of_one_tile_streams_a_long_context() -> None:
    pool = admission.PagePool(2, 64)
    row = torch.arange(40, 49, dtype=torch.int32)   # 9 blocks through a 2-slot pool, tiles of 2
    evicted = 0
    for i, tile in enumerate(admission.exact_tiles(row, 9, 2)):
        a = admit_and_release(pool, tile)
        assert a["miss_blocks"] == tile and a["hits"] == 0
        evicted += a["evicted"]
    assert evicted == 9 - 2
    assert pool.resident() == {48: 0, 47: 1}


class ModelPool:
    """The admission policy of admission.h, written from its description (not from the engine's code)."""

    def __init__(self, pool_blocks: int) -> None:
        self.block_of_slot = [-1] * pool_blocks
        self.last_use = [0] * pool_blocks
        self.pins = [0] * pool_blocks
        self.clock = 0

    def admit(self, blocks: list[int]) -> dict:
        slots, miss_b, miss_s, hits, evicted = [], [], [], 0, 0
        for b in blocks:
            if b in self.block_of_slot:
                s = self.block_of_slot.index(b)
                hits += 1
            else:
                free = [i for i, x in enumerate(self.block_of_slot) if x < 0]
                if free:
                    s = free[0]
                else:
                    s = min((i for i, p in enumerate(self.pins) if p == 0), key=lambda i: (self.last_use[i], i))
                    evicted += 1
                self.block_of_slot[s] = b
                miss_b.append(b)
                miss_s.append(s)
            self.clock += 1
            self.last_use[s] = self.clock
            self.pins[s] += 1
            slots.append(s)
        return admitted(slots, miss_b, miss_s, hits, evicted)

    def release(self, slots: list[int]) -> None:
        for s in slots:
            self.pins[s] -= 1

    def resident(self) -> dict[int, int]:
        return {b: s for s, b in enumerate(self.block_of_slot) if b >= 0}


@pytest.mark.parametrize("seed", range(4))
def test_random_trace_matches_the_policy(seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    pool_blocks, host_blocks = 5, 12
    native, model = admission.PagePool(pool_blocks, host_blocks), ModelPool(pool_blocks)
    held: list[list[int]] = []
    for _ in range(200):
        unpinned = sum(p == 0 for p in model.pins)
        size = int(torch.randint(1, 4, (1,), generator=gen))
        tile = torch.randint(0, host_blocks, (size,), generator=gen).tolist()
        if size > unpinned:
            with pytest.raises(ValueError, match="does not fit the active pool"):
                native.admit(tile)
        else:
            a = native.admit(tile)
            assert a == model.admit(tile)
            held.append(a["slots"])
        # Release the oldest held tile now and then, so pins persist across admissions.
        if held and (len(held) > 1 or int(torch.randint(0, 2, (1,), generator=gen))):
            slots = held.pop(0)
            native.release(slots)
            model.release(slots)
        assert native.resident() == model.resident()
