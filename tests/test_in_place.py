"""Placement in place (engine.h Placement): a forward reads the blocks it attends where they are in the host tier
(vLLM's KV cache), with no pool, no admission and no copy.

Here: its output equals the pooled path's bit for bit on each kernel (both read the same bytes in the same order; only
where they lie differs), telemetry counts every block attended in place and nothing admitted, and its checks. The
Python reference models it too: tools/parity_cells.py in_place_cells, run by tests/test_parity.py and `make parity`.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

import activekv._backend as backend
from tools.parity_cells import NUM_LAYERS, Cell, run_engine

# A pool smaller than the contexts (evictions on every step) against no pool at all.
EXACT = Cell(torch.bfloat16, 128, 4, 16, "unaligned", True, 3, True)
COMPRESSED = Cell(torch.float32, 64, 4, 16, "multiple", True, 3, True, mode="compressed")


def replay(cell: Cell, kernel: str) -> tuple[list[torch.Tensor], dict, backend.Engine]:
    """Every step of the cell on one engine: the outputs of every (step, layer), its snapshot and the engine."""
    outs, eng = run_engine(cell, kernel)
    return outs, eng.snapshot(), eng


@pytest.mark.parametrize("kernel", ["aten", "native"])
@pytest.mark.parametrize("cell", [EXACT, COMPRESSED], ids=["exact", "compressed"])
def test_in_place_output_equals_the_pooled_paths_bit_for_bit(cell: Cell, kernel: str) -> None:
    pooled, snap_p, _ = replay(cell, kernel)
    in_place, snap_i, eng = replay(dataclasses.replace(cell, placement="in_place"), kernel)
    assert eng.placement == "in_place" and eng.pool_blocks == 0
    assert len(pooled) == len(in_place)
    for i, (a, b) in enumerate(zip(pooled, in_place)):
        assert torch.equal(a, b), f"step/layer {i}"
    # The pooled engine streamed (admitted and evicted); in place, the same blocks were attended and none moved.
    assert snap_p["blocks_admitted"] > 0 and snap_p["blocks_evicted"] > 0 and snap_p["blocks_in_place"] == 0
    assert snap_i["blocks_in_place"] == snap_p["blocks_admitted"] + snap_p["blocks_hit"]
    for name in ("blocks_admitted", "blocks_hit", "blocks_evicted", "bytes_h2d", "write_through_tokens"):
        assert snap_i[name] == 0, name
    for name in ("tiles_computed", "planned_blocks", "planned_tiles", "selected_blocks", "union_blocks"):
        assert snap_i[name] == snap_p[name], name
    if cell.mode == "compressed":
        assert snap_i["compressed_rows"] > 0
    for layer in range(NUM_LAYERS):  # no pool, nothing resident
        assert eng.pool(layer).shape[0] == 0 and eng.resident(layer) == {}


def engine(pool_blocks: int, placement: str, device: str = "cpu") -> backend.Engine:
    return backend.Engine(1, 4, 2, 8, 4, torch.float32, pool_blocks, 2, device=torch.device(device),
                          placement=placement)


@pytest.mark.parametrize(("pool_blocks", "placement", "device", "match"), [
    (4, "in_place", "cpu", "placement 'in_place' has no pool: pool_blocks must be 0, got 4"),
    (0, "in_place", "meta", "placement 'in_place' needs the CPU .* got device meta"),
    (0, "pool", "cpu", r"pool_blocks \(0\) must be >= tile_blocks \(2\)"),
    (0, "inplace", "cpu", "placement must be 'pool' or 'in_place', got 'inplace'"),
])
def test_placement_checks(pool_blocks: int, placement: str, device: str, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        engine(pool_blocks, placement, device)


def test_engine_placement_defaults_to_the_pool() -> None:
    """The Engine class keeps a pool unless told otherwise; the vLLM backend's default on the CPU is in place
    (tests/test_backend.py)."""
    eng = backend.Engine(1, 4, 2, 8, 4, torch.float32, 4, 2)
    assert (eng.placement, eng.pool_blocks, eng.snapshot()["info"]["in_place"]) == ("pool", 4, 0)
