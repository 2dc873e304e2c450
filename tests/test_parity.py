"""Parity: the native engine's ATen path and the Python reference agree bit for bit (torch.equal) on outputs, both KV
tiers, per-block key metadata, page tables, compressed-mode selections and telemetry counters, cell by cell.

Exact mode: every cell of the matrix (256). Compressed mode: a seeded, representative subset of the matrix here;
`make parity` (tools/parity.py) runs every cell of both modes and writes the report."""

from __future__ import annotations

import random

import pytest
import torch

from tests.parity_cells import Cell, compressed_cells, exact_cells, run_cell

EXACT_CELLS = exact_cells()
COMPRESSED_SUBSET = random.Random(0).sample(compressed_cells(), 60)


@pytest.fixture(autouse=True)
def one_intra_op_thread():
    """One intra-op thread, so every matmul's summation order is fixed and torch.equal tests the engine alone (the
    reason in full: tests/parity_cells.py)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _values(cells: list[Cell], attr: str) -> set:
    return {getattr(c, attr) for c in cells}


def test_exact_matrix_covers_every_dimension() -> None:
    assert len(EXACT_CELLS) == 256
    for attr, values in {"dtype": {torch.float32, torch.bfloat16}, "head_size": {64, 128}, "gqa": {1, 4},
                         "block_size": {16, 32}, "context": {"aligned", "unaligned"}, "streaming": {True, False},
                         "batch": {1, 3}, "padded": {True, False}}.items():
        assert _values(EXACT_CELLS, attr) == values, attr


def test_compressed_subset_covers_every_dimension() -> None:
    assert len(COMPRESSED_SUBSET) >= 48
    full = compressed_cells()
    for attr in ("dtype", "head_size", "gqa", "block_size", "context", "streaming", "batch"):
        assert _values(COMPRESSED_SUBSET, attr) == _values(full, attr), attr


@pytest.mark.parametrize("cell", EXACT_CELLS, ids=[c.id for c in EXACT_CELLS])
def test_exact_engine_matches_reference_bit_for_bit(cell: Cell) -> None:
    run_cell(cell)


@pytest.mark.parametrize("cell", COMPRESSED_SUBSET, ids=[c.id for c in COMPRESSED_SUBSET])
def test_compressed_engine_matches_reference_bit_for_bit(cell: Cell) -> None:
    snap = run_cell(cell)
    selecting = cell.context != "short"
    assert (snap["compressed_rows"] > 0) == selecting
    if selecting:  # fewer blocks attended per head than the contexts held
        assert snap["selected_blocks"] < snap["compressed_context_blocks"] * 2


def test_streaming_cells_evict_and_fit_cells_do_not() -> None:
    """The matrix really exercises both regimes: a pool smaller than the context evicts, a large one only hits."""
    for streaming in (True, False):
        snap = run_cell(Cell(torch.float32, 64, 1, 16, "aligned", streaming, 3, False))
        assert snap["blocks_admitted"] > 0
        assert (snap["blocks_evicted"] > 0) == streaming
        assert (snap["blocks_hit"] > 0) == (not streaming)
