"""Parity: the native engine's ATen path and the Python reference agree bit for bit (torch.equal) on outputs, both KV
tiers, per-block key metadata, page tables, compressed-mode selections and telemetry counters, cell by cell.

Here: a seeded subset of each matrix (48 cells of each mode) that holds every value of every axis (checked below), and
16 of the 108 cells of placement in place (no pool: blocks read where they are in the host tier), and 12 of the 54
compressed cells whose first layer is dense (dense_layers 1); `make parity`
(tools/parity.py) runs every cell of both modes, in place included, and writes the report."""

from __future__ import annotations

import random

import pytest
import torch

from tools.parity_cells import Cell, compressed_cells, dense_cells, exact_cells, in_place_cells, run_cell

SUBSET_CELLS = 48
EXACT_SUBSET = random.Random(0).sample(exact_cells(), SUBSET_CELLS)
COMPRESSED_SUBSET = random.Random(0).sample(compressed_cells(), SUBSET_CELLS)
IN_PLACE_SUBSET = random.Random(0).sample(in_place_cells(), 16)
DENSE_SUBSET = random.Random(0).sample(dense_cells(), 12)
AXES = ("dtype", "head_size", "gqa", "block_size", "context", "streaming", "batch", "padded")


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """One intra-op thread, so every matmul's summation order is fixed and torch.equal tests the engine alone (the
    reason in full: tools/parity_cells.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _values(cells: list[Cell], attr: str) -> set:
    return {getattr(c, attr) for c in cells}


def test_matrices_cover_every_value_the_issue_asks_for() -> None:
    exact, compressed = exact_cells(), compressed_cells()
    assert len(exact) >= 96 and len(compressed) >= 96
    for cells in (exact, compressed):
        for attr, values in {"dtype": {torch.float32, torch.bfloat16, torch.float16}, "head_size": {64, 80, 128},
                             "gqa": {1, 4, 8}, "block_size": {16, 32}, "streaming": {True, False},
                             "batch": {1, 3}, "padded": {True, False}}.items():
            assert _values(cells, attr) == values, attr
        assert all(c.decode_steps > c.block_size for c in cells)  # every row fills a whole block while decoding
    assert _values(exact, "context") == {"aligned", "unaligned"}
    assert _values(compressed, "context") == {"short", "multiple", "unaligned"}
    # every pair of main-axis values meets (the 54 combinations are crossed, not sampled)
    for cells in (exact, compressed):
        assert len({(c.dtype, c.head_size, c.gqa, c.block_size) for c in cells}) == 54


@pytest.mark.parametrize("full, subset", [(exact_cells(), EXACT_SUBSET), (compressed_cells(), COMPRESSED_SUBSET)],
                         ids=["exact", "compressed"])
def test_subset_covers_every_value_of_every_axis(full: list[Cell], subset: list[Cell]) -> None:
    assert len(subset) >= 48
    for attr in AXES:
        assert _values(subset, attr) == _values(full, attr), attr


@pytest.mark.parametrize("cell", EXACT_SUBSET, ids=[c.id for c in EXACT_SUBSET])
def test_exact_engine_matches_reference_bit_for_bit(cell: Cell) -> None:
    run_cell(cell)


@pytest.mark.parametrize("cell", COMPRESSED_SUBSET, ids=[c.id for c in COMPRESSED_SUBSET])
def test_compressed_engine_matches_reference_bit_for_bit(cell: Cell) -> None:
    snap = run_cell(cell)
    assert (snap["compressed_rows"] > 0) == cell.selects
    if cell.selects:  # fewer blocks attended per head than the contexts held
        assert snap["selected_blocks"] < snap["compressed_context_blocks"] * 2


def test_streaming_cells_evict_and_fit_cells_do_not() -> None:
    """The matrix really exercises both regimes: a pool smaller than the context evicts, a large one only hits."""
    for streaming in (True, False):
        snap = run_cell(Cell(torch.float32, 64, 1, 16, "aligned", streaming, 3, False))
        assert snap["blocks_admitted"] > 0
        assert (snap["blocks_evicted"] > 0) == streaming
        assert (snap["blocks_hit"] > 0) == (not streaming)


@pytest.mark.parametrize("cell", IN_PLACE_SUBSET, ids=[c.id for c in IN_PLACE_SUBSET])
def test_in_place_engine_matches_reference_bit_for_bit(cell: Cell) -> None:
    snap = run_cell(cell)
    assert snap["blocks_in_place"] > 0
    assert snap["blocks_admitted"] == snap["bytes_h2d"] == snap["blocks_hit"] == 0


def test_in_place_cells_cover_both_modes_and_every_main_value() -> None:
    cells = in_place_cells()
    assert {c.mode for c in cells} == {"exact", "compressed"} and {c.pool_blocks for c in cells} == {0}
    for mode in ("exact", "compressed"):
        of_mode = [c for c in cells if c.mode == mode]
        assert len({(c.dtype, c.head_size, c.gqa, c.block_size) for c in of_mode}) == 54
        assert _values(of_mode, "batch") == {1, 3} and _values(of_mode, "padded") == {False, True}
    assert any(c.selects for c in cells)


@pytest.mark.parametrize("cell", DENSE_SUBSET, ids=[c.id for c in DENSE_SUBSET])
def test_dense_layers_engine_matches_reference_bit_for_bit(cell: Cell) -> None:
    """dense_layers 1: layer 0 attends every block (no selection recorded), layer 1 selects as compressed mode."""
    snap = run_cell(cell)
    assert (snap["compressed_rows"] > 0) == cell.selects


def test_dense_cells_cover_every_main_value_and_pool() -> None:
    cells = dense_cells()
    assert {(c.mode, c.dense_layers) for c in cells} == {("compressed", 1)}
    assert len({(c.dtype, c.head_size, c.gqa, c.block_size) for c in cells}) == 54
    assert {(c.context, c.pool) for c in cells} == {(x, p) for x in ("short", "multiple", "unaligned")
                                                    for p in ("stream", "fit", "inplace")}
    assert _values(cells, "batch") == {1, 3} and any(c.selects for c in cells)
    assert {c.mode for c in DENSE_SUBSET} == {"compressed"} and any(c.selects for c in DENSE_SUBSET)


def test_dense_layer_attends_every_block_and_the_others_select() -> None:
    """A selecting cell with dense_layers 1 records selections on layer 1 only, and its layer 0 equals, bit for bit,
    layer 0 of the same cell with every layer dense (dense_layers 2: no selection anywhere, the same steps and pool)."""
    from dataclasses import replace

    from tools.parity_cells import run_engine

    cell = next(c for c in dense_cells() if c.selects and c.placement == "pool")
    sel_one: list = []
    outs_one, _ = run_engine(cell, "aten", selections=sel_one)
    assert all(not s for s in sel_one[0::2]) and any(s for s in sel_one[1::2])
    sel_all: list = []
    outs_all, _ = run_engine(replace(cell, dense_layers=2), "aten", selections=sel_all)
    assert not any(sel_all)
    assert all(torch.equal(a, b) for a, b in zip(outs_one[0::2], outs_all[0::2]))
    assert not all(torch.equal(a, b) for a, b in zip(outs_one[1::2], outs_all[1::2]))
