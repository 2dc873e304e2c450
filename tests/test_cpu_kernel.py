"""The fast CPU kernel (engine/src/cpu/) against the ATen tile path, under the contract of
docs/parity.md: same admission, transfers and telemetry; outputs within the per-dtype tolerance below; bit-identical
run to run, across thread counts; every CPU capability within the same tolerance."""

from __future__ import annotations

import os
import random
import subprocess
import sys

import pytest
import torch

import activekv._backend as backend
from tools.parity_cells import Cell, compressed_cells, exact_cells, host_blocks_for, run_engine

# Native kernel vs ATen tile path, compared on the output tensor (in the model dtype). Both accumulate in float32;
# they differ in summation order (vectorised dot products, per-block rescaling) and in exp (at::vec's exp_u20, the
# one PyTorch's CPU flash attention uses, vs ATen's exp), a few float32 ulps before the output is rounded. float32 outputs: 2e-6 covers that with margin (seen: <= 6e-7).
# bfloat16/float16 outputs: the float32 difference can flip the final rounding, one ulp of the output dtype:
# bf16 ulp at |x| < 4 is <= 2^-6 = 0.0156; fp16 ulp at |x| < 4 is <= 2^-9 = 0.002 (outputs here are |x| < 4).
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}


def _cells() -> list[Cell]:
    rng = random.Random(1)
    return rng.sample(exact_cells(), 12) + rng.sample(compressed_cells(), 12)


CELLS = _cells()


def run(cell: Cell, kernel: str, selections: list | None = None,
        tile_blocks: int | None = None, fill: float = 0.0) -> tuple[list[torch.Tensor], dict]:
    """Replay the cell on one engine; returns (every forward's output, counters). `selections`, if given, receives
    every forward's compressed-mode selection per request row ({row: [num_kv_heads, per_head] block ids});
    `tile_blocks`, if given, replaces the cell's tile (the pool must hold it); `fill` is the value of every KV cache
    slot no token has been written to."""
    outs, eng = run_engine(cell, kernel, selections, tile_blocks, fill)
    snap = eng.snapshot()
    return outs, {k: v for k, v in snap.items() if k not in ("histograms", "info")}


def run_aten_one_thread(cell: Cell, tile_blocks: int | None = None) -> tuple[list[torch.Tensor], dict]:
    """run(cell, "aten") with one intra-op thread (tools/parity_cells.py says why): at head size 40 / block 8, with two
    threads, the ATen path's first forward came out 1e-4 away from its own usual result in about 1 process in 20 (the
    native side did not move), a BLAS split rather than the engine; one thread fixes its summation order."""
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        return run(cell, "aten", tile_blocks=tile_blocks)
    finally:
        torch.set_num_threads(threads)


def assert_native_within_tolerance(cell: Cell, tile_blocks: int | None = None) -> None:
    """The cell replayed with the native kernel and with the ATen path (one thread): the same counters (admission,
    transfers, tiles, selections), at least one forward, every output within TOLERANCE of the dtype."""
    native, snap_n = run(cell, "native", tile_blocks=tile_blocks)
    aten, snap_a = run_aten_one_thread(cell, tile_blocks=tile_blocks)
    assert snap_n == snap_a and len(native) == len(aten) > 0
    tol = TOLERANCE[cell.dtype]
    for i, (a, b) in enumerate(zip(native, aten)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"{cell.id} forward {i}: {m}")


@pytest.mark.parametrize("cell", CELLS, ids=[c.id for c in CELLS])
def test_native_kernel_within_tolerance_of_aten_path(cell: Cell) -> None:
    assert_native_within_tolerance(cell)


# Geometries off the vector width (the engine takes any; vLLM's backend only multiples of 16): block size 8 and head
# size 40 leave partial groups of keys and a scalar tail of the head in every part of the kernel.
ODD_CELLS = [Cell(dtype, 40, 4, 8, context, streaming, 2, True, mode=mode)
             for dtype in (torch.float32, torch.bfloat16)
             for context, streaming, mode in (("unaligned", True, "exact"), ("unaligned", False, "compressed"))]


@pytest.mark.parametrize("cell", ODD_CELLS, ids=[c.id for c in ODD_CELLS])
def test_native_kernel_off_the_vector_width_within_tolerance(cell: Cell) -> None:
    assert_native_within_tolerance(cell)


# Tiles of 8 blocks of 32 keys at head size 128: a chunk's V (32-128 KiB) outgrows the kernel's L1 bound, so P x V runs
# block by block (the parity cells' 2-block tiles keep every chunk's V within it and walk the chunk per vector of the
# head); rows of fewer blocks than a tile still take the other loop. Prefill and decode rows, exact and compressed.
LARGE_TILE_CELLS = [Cell(dtype, 128, 4, 32, context, False, 3, True, mode=mode)
                    for dtype in (torch.float32, torch.bfloat16)
                    for context, mode in (("unaligned", "exact"), ("multiple", "compressed"))]


@pytest.mark.parametrize("cell", LARGE_TILE_CELLS, ids=[c.id for c in LARGE_TILE_CELLS])
def test_native_kernel_with_large_tiles_within_tolerance(cell: Cell) -> None:
    assert_native_within_tolerance(cell, tile_blocks=8)


SELECTING_CELLS = [c for c in random.Random(0).sample(compressed_cells(), 48) if c.selects]


@pytest.mark.parametrize("cell", SELECTING_CELLS, ids=[c.id for c in SELECTING_CELLS])
def test_native_selection_picks_the_same_blocks_as_the_aten_path(cell: Cell) -> None:
    """With kernel 'native' the Quest bound is scored by the CPU kernel (engine/src/cpu/quest_scores.cpp
    quest_scores), with 'aten' by the matmuls the reference repeats: on the parity cells (tests/test_parity.py's
    compressed subset, those that select) every step's blocks per KV head are identical."""
    sel_native: list = []
    sel_aten: list = []
    run(cell, "native", sel_native)
    run(cell, "aten", sel_aten)
    assert len(sel_native) == len(sel_aten) and any(sel_aten)
    for i, (a, b) in enumerate(zip(sel_native, sel_aten)):
        assert a.keys() == b.keys(), i
        assert all(torch.equal(a[r], b[r]) for r in a), f"{cell.id} forward {i}"


def run_many_selecting_rows(kernel: str, threads: int) -> tuple[torch.Tensor, dict, dict]:
    """One compressed decode step of 8 rows (12 blocks of 16 keys each, budget 4 blocks: every row selects) after a
    prefill that writes every row's KV; returns (output, selections {row: [KVH, 4] block ids}, counters)."""
    kvh, gqa, d, bs, rows, nb = 2, 4, 64, 16, 8, 12
    gen = torch.Generator().manual_seed(5)
    block_table = torch.randperm(rows * nb, generator=gen).view(rows, nb).to(torch.int32)
    slots = (block_table.long()[:, :, None] * bs + torch.arange(bs)).reshape(-1)  # every key of every row
    k = torch.randn(rows * nb * bs, kvh, d, generator=gen)
    v = torch.randn(rows * nb * bs, kvh, d, generator=gen)
    q = torch.randn(rows, kvh * gqa, d, generator=gen)
    saved = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        eng = backend.Engine(1, kvh * gqa, kvh, d, bs, torch.float32, 64, 2, mode="compressed",
                             budget_tokens=4 * bs, sink_blocks=1, recent_blocks=1, kernel=kernel)
        cache = torch.zeros(rows * nb, kvh, bs, 2 * d)
        eng.update_kv(0, k, v, cache, slots)
        last = torch.arange(rows) * nb * bs + nb * bs - 1  # each row's decode token: its last key
        plan = eng.build(torch.arange(rows + 1, dtype=torch.int32), torch.full((rows,), nb * bs, dtype=torch.int32),
                         block_table, rows, rows)
        eng.update_kv(0, k[last], v[last], cache, slots[last])
        out = torch.full_like(q, 7.0)
        eng.forward(0, plan, q, cache, out, d ** -0.5)
        snap = eng.snapshot()
    finally:
        torch.set_num_threads(saved)
    return out, eng.selection(0), {k: v for k, v in snap.items() if k not in ("histograms", "info")}


def test_many_selecting_rows_choose_as_row_by_row() -> None:
    """With at least two compressed decode rows per thread the native path chooses all rows' blocks in one parallel
    region, a row per task (selection.cpp select_rows); the ATen path chooses row by row. Same blocks per row and KV head,
    same counters, outputs within tolerance, and the native output bit-identical for 1 and 2 threads."""
    native2, sel_native, snap_native = run_many_selecting_rows("native", 2)
    native1, sel_native1, _ = run_many_selecting_rows("native", 1)
    aten, sel_aten, snap_aten = run_many_selecting_rows("aten", 1)
    assert sorted(sel_native) == sorted(sel_aten) == list(range(8))
    assert all(torch.equal(sel_native[r], sel_aten[r]) and torch.equal(sel_native1[r], sel_aten[r]) for r in sel_aten)
    assert snap_native == snap_aten and snap_native["compressed_rows"] == 8
    assert not torch.equal(native2, torch.full_like(native2, 7.0))
    assert torch.equal(native1, native2)
    tol = TOLERANCE[torch.float32]
    torch.testing.assert_close(native2, aten, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_native_kernel_is_bit_identical_run_to_run_and_across_thread_counts(dtype: torch.dtype) -> None:
    """bfloat16 at head size 128 / block 16 runs on AMX where the processor has it (cpu_kernel_amx)."""
    cell = Cell(dtype, 128, 4, 16, "unaligned", True, 3, True)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one, _ = run(cell, "native")
        torch.set_num_threads(2)
        two, _ = run(cell, "native")
        again, _ = run(cell, "native")
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(one, two))
    assert all(torch.equal(a, b) for a, b in zip(two, again))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_native_kernel_output_does_not_depend_on_the_pool_size(dtype: torch.dtype) -> None:
    """The kernel merges its online softmax once per tile (chunks of tile_blocks blocks from the start of each call),
    and exact mode hands it whole tiles, so a pool that streams the context one tile at a time and a pool that holds
    it all give bit-identical outputs (the arithmetic per (row, KV head) does not depend on how tiles group into
    rounds)."""
    streaming = Cell(dtype, 64, 4, 16, "unaligned", True, 3, True)
    resident = Cell(dtype, 64, 4, 16, "unaligned", False, 3, True)
    assert streaming.pool_blocks < resident.pool_blocks and host_blocks_for(streaming) == host_blocks_for(resident)
    small, snap_small = run(streaming, "native")
    large, snap_large = run(resident, "native")
    assert snap_small["blocks_evicted"] > 0 == snap_large["blocks_evicted"]  # the small pool did stream
    assert len(small) == len(large) and all(torch.equal(a, b) for a, b in zip(small, large))


@pytest.mark.parametrize("kernel", ["native", "aten"])
@pytest.mark.parametrize("mode", ["exact", "compressed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_unwritten_slots_holding_nan_do_not_reach_the_output(kernel: str, mode: str, dtype: torch.dtype) -> None:
    """The slots of a row's last block past its length hold whatever the cache held (vLLM reuses freed blocks): with
    every unwritten slot NaN, each forward's output is bit-identical to the run where they are zero. Both kernels
    read those slots (whole blocks, whole tiles) and must keep them out of P x V, not only out of the scores. The ATen
    path runs on one thread (run_aten_one_thread says why)."""
    cell = Cell(dtype, 128, 4, 16, "unaligned", True, 3, True, mode=mode)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1 if kernel == "aten" else threads)
        zeros, snap_zeros = run(cell, kernel)
        nans, snap_nans = run(cell, kernel, fill=float("nan"))
    finally:
        torch.set_num_threads(threads)
    assert snap_zeros == snap_nans and len(zeros) == len(nans)
    assert all(torch.equal(a, b) for a, b in zip(zeros, nans))


def _nan_step(kernel: str, tokens: int, nan_query: tuple[int, int] | None, nan_key: tuple[int, int] | None,
              context: int = 0) -> torch.Tensor:
    """One step of `tokens` query tokens at the end of a context of context + tokens (GQA 3, head size 64, block 16),
    with a NaN in query (token, head) and/or key (position, KV head), in place; returns the output."""
    h, kvh, d, bs = 9, 3, 64, 16
    seq = context + tokens
    nb = -(-seq // bs)
    gen = torch.Generator().manual_seed(5)
    k, v = (torch.randn(seq, kvh, d, generator=gen) for _ in range(2))
    q = torch.randn(tokens, h, d, generator=gen)
    if nan_query is not None:
        q[nan_query[0], nan_query[1], 7] = float("nan")
    if nan_key is not None:
        k[nan_key[0], nan_key[1], 3] = float("nan")
    cache = torch.zeros(nb, kvh, bs, 2 * d)
    e = backend.Engine(1, h, kvh, d, bs, torch.float32, 0, 4, kernel=kernel, placement="in_place")
    e.update_kv(0, k, v, cache, torch.arange(seq))
    plan = e.build(torch.tensor([0, tokens], dtype=torch.int32), torch.tensor([seq], dtype=torch.int32),
                   torch.arange(nb, dtype=torch.int32).view(1, nb), 1, tokens)
    out = torch.empty(tokens, h, d)
    e.forward(0, plan, q, cache, out, d ** -0.5)
    return out


@pytest.mark.parametrize("tokens,context", [(40, 0), (1, 300)], ids=["prefill", "decode"])
@pytest.mark.parametrize("where", ["query", "key"])
def test_a_nan_in_the_query_or_a_visible_key_gives_nan_where_the_aten_path_does(tokens: int, context: int,
                                                                                 where: str) -> None:
    """A NaN in a query row or in a key a row sees makes exactly the outputs NaN that it makes on the ATen path (the
    fast exp clamps its argument, so the kernel's online softmax carries the NaN itself); every other output stays
    within the tolerance. Prefill: 40 query tokens (the packed path), decode: one token over 300 (segments)."""
    nan_query = (tokens - 1, 4) if where == "query" else None
    nan_key = (context + tokens // 2, 1) if where == "key" else None
    native = _nan_step("native", tokens, nan_query, nan_key, context)
    aten = _nan_step("aten", tokens, nan_query, nan_key, context)
    assert aten.isnan().any(), "the case must put a NaN into the output"
    assert torch.equal(native.isnan(), aten.isnan())
    keep = ~aten.isnan()
    torch.testing.assert_close(native[keep], aten[keep], atol=TOLERANCE[torch.float32], rtol=TOLERANCE[torch.float32])


AMX_SCRIPT = """
import sys, torch
import activekv._backend as backend
from tests.test_cpu_kernel import run
from tools.parity_cells import Cell
torch.set_num_threads(int(sys.argv[2]))
bf = torch.bfloat16
cells = [  # (cell, tile_blocks): decode and prefill rows, 1 to 8 query rows per KV head, short and long tiles
    (Cell(bf, 128, 4, 16, "unaligned", True, 3, True), None),
    (Cell(bf, 64, 8, 32, "aligned", False, 1, False), None),
    (Cell(bf, 128, 1, 16, "multiple", False, 3, True, mode="compressed"), None),
    (Cell(bf, 64, 4, 32, "unaligned", True, 3, True, mode="compressed"), None),
    (Cell(bf, 128, 4, 32, "unaligned", False, 3, True), 8),
    (Cell(bf, 64, 4, 16, "unaligned", False, 3, True), 9),
    (Cell(bf, 128, 4, 128, "unaligned", False, 1, False), None),
    (Cell(bf, 32, 4, 48, "unaligned", True, 3, True), None),
    (Cell(bf, 96, 2, 16, "multiple", False, 3, True, mode="compressed"), None),
    (Cell(bf, 256, 3, 16, "unaligned", False, 1, False), None),
]
torch.save([run(c, "native", tile_blocks=t)[0] for c, t in cells], sys.argv[1])
print(backend.cpu_kernel_amx())
"""


def _processor_has_amx_bf16() -> bool:
    with open("/proc/cpuinfo") as f:
        flags = next((line for line in f if line.startswith("flags")), "")
    return {"amx_bf16", "amx_tile", "avx512_bf16"} <= set(flags.split())


def test_amx_path_agrees_with_the_avx512_path_within_tolerance(tmp_path) -> None:
    """bfloat16 KV on AMX tiles (cpu_kernel.h) against the AVX-512 path of the same kernel (ACTIVEKV_CPU_AMX=0), on
    cells that reach its row padding (1 and 8 query rows per KV head), short last tiles, several runs of keys per
    tile (tile 8 x block 32), a tile that is not a multiple of 32 keys (9 x 16), a block longer than a run (128
    keys), a block of 48 keys, head sizes 32, 96 (an odd count of 16-value tiles) and 256, and 3 query rows per KV
    head; the AMX run is also bit-identical across 1 and 2 threads. Skipped where the processor or kernel has no AMX:
    then both runs are the same path."""
    if not (_processor_has_amx_bf16() and backend.cpu_kernel_capability() == "avx512"):
        pytest.skip("no AMX-BF16 with the avx512 capability here: the kernel never takes the AMX path")
    root = os.path.dirname(os.path.dirname(__file__))
    results = {}
    for name, amx, threads in (("amx", "1", 2), ("amx1", "1", 1), ("avx512", "0", 2)):
        out = tmp_path / f"{name}.pt"
        env = dict(os.environ, ACTIVEKV_CPU_AMX=amx)
        proc = subprocess.run([sys.executable, "-c", AMX_SCRIPT, str(out), str(threads)], env=env,
                              capture_output=True, text=True, timeout=300, cwd=root)
        assert proc.returncode == 0, proc.stderr
        results[name] = (proc.stdout.strip().splitlines()[-1], torch.load(out))
    if results["amx"][0] != "True":
        pytest.skip("the processor has AMX but this kernel may not use it (Linux before 5.16 refuses the tile state)")
    assert results["avx512"][0] == "False"
    tol = TOLERANCE[torch.bfloat16]
    amx, avx = results["amx"][1], results["avx512"][1]
    assert len(amx) == len(avx) == 10
    for i, (cell_a, cell_b, cell_1) in enumerate(zip(amx, avx, results["amx1"][1])):
        assert len(cell_a) == len(cell_b) > 0
        for a, b, one in zip(cell_a, cell_b, cell_1):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m, i=i: f"cell {i}: {m}")
            assert torch.equal(a, one), f"cell {i}: AMX output differs between 1 and 2 threads"


CAPABILITY_SCRIPT = """
import sys, torch
import activekv._backend as backend
from tests.test_cpu_kernel import run
from tools.parity_cells import Cell
cell = Cell(getattr(torch, sys.argv[2]), 80, 4, 16, "multiple", False, 3, True, mode="compressed")
outs, _ = run(cell, "native")
torch.save(outs, sys.argv[1])
print(backend.cpu_kernel_capability())
"""


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_every_cpu_capability_agrees_within_tolerance(tmp_path, dtype: str) -> None:
    """ATEN_CPU_CAPABILITY caps the kernel's capability (as it caps ATen's): default, avx2, avx512 all agree. In
    bfloat16 this also compares AVX-512's bfloat16 dot-product scoring (on a processor with AVX512-BF16) with the
    widen-then-multiply-add scoring of the other capabilities; head size 80 takes its 16-value tail."""
    results = {}
    for cap in ("default", "avx2", "avx512"):
        out = tmp_path / f"{cap}.pt"
        env = dict(os.environ, ATEN_CPU_CAPABILITY=cap)
        proc = subprocess.run([sys.executable, "-c", CAPABILITY_SCRIPT, str(out), dtype], env=env, capture_output=True,
                              text=True, timeout=300, cwd=os.path.dirname(os.path.dirname(__file__)))
        assert proc.returncode == 0, proc.stderr
        results[proc.stdout.strip().splitlines()[-1]] = torch.load(out)
    assert "default" in results
    base = results["default"]
    tol = TOLERANCE[getattr(torch, dtype)]
    for cap, outs in results.items():
        assert len(outs) == len(base)
        for a, b in zip(outs, base):
            torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m, cap=cap: f"{cap} vs default: {m}")


def test_kernel_option_is_validated_and_reported() -> None:
    args = (1, 4, 2, 64, 16, torch.float32, 4, 2)
    assert backend.Engine(*args).kernel == "native"
    assert backend.Engine(*args, kernel="aten").kernel == "aten"
    with pytest.raises(ValueError, match="kernel must be 'native' or 'aten', got 'fast'"):
        backend.Engine(*args, kernel="fast")
    assert backend.cpu_kernel_capability() in ("avx512", "avx2", "default")
    if backend.cpu_kernel_capability() != "avx512":
        assert backend.cpu_kernel_amx() is False  # AMX is only built into the AVX512 kernel


def test_engine_parallel_for_uses_the_intra_op_threads() -> None:
    """The kernel and the Quest scoring split work with at::parallel_for, a header template that runs every range on
    the calling thread unless the engine library itself is compiled with OpenMP (it once was not: native attention
    used one thread whatever torch.set_num_threads said)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert backend.parallel_for_threads(8) == 2
        assert backend.parallel_for_threads(1) == 1  # one task, one thread
        torch.set_num_threads(1)
        assert backend.parallel_for_threads(8) == 1
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        backend.parallel_for_threads(0)


def _long_prefill(dtype: torch.dtype, kernel: str, threads: int, first: int = 1100) -> list[torch.Tensor]:
    """Two prefill chunks of one request on an in-place engine (9 query heads, GQA 3, head size 64, block 16): `first`
    tokens, then 300 more after them. The CPU path splits the first chunk's rows into tasks per KV head and run of 512
    tokens (two runs and a short one: 76 tokens, or 6 at first = 1030), each task the run's rows of the 3 GQA group
    members in one call; the second (at most 512 tokens) by KV heads only. The kernel scores them with its
    matrix-product scorer (16 query rows or more per call: a run of 6 takes the row-by-row path, member by member)."""
    h, kvh, d, bs, second = 9, 3, 64, 16, 300
    seq = first + second
    nb = -(-seq // bs)
    gen = torch.Generator().manual_seed(7)
    k, v = (torch.randn(seq, kvh, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(seq, h, d, generator=gen).to(dtype)
    cache = torch.zeros(nb, kvh, bs, 2 * d, dtype=dtype)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        e = backend.Engine(1, h, kvh, d, bs, dtype, 0, 16, placement="in_place", kernel=kernel)
        outs = []
        for start, n in ((0, first), (first, second)):
            e.update_kv(0, k[start:start + n], v[start:start + n], cache, torch.arange(start, start + n))
            plan = e.build(torch.tensor([0, n], dtype=torch.int32), torch.tensor([start + n], dtype=torch.int32),
                           torch.arange(nb, dtype=torch.int32).view(1, nb), 1, n)
            out = torch.empty(n, h, d, dtype=dtype)
            e.forward(0, plan, q[start:start + n], cache, out, d ** -0.5)
            outs.append(out)
    finally:
        torch.set_num_threads(previous)
    return outs


@pytest.mark.parametrize("first", [1100, 1030])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_long_prefill_chunks_within_tolerance_and_bit_identical_across_threads(dtype: torch.dtype,
                                                                               first: int) -> None:
    """Prefill chunks of hundreds of tokens (the rows split over tasks, the kernel's matrix-product scorer): within
    the kernel's tolerance of the ATen path (one thread), bit-identical run to run and for 1 and 2 threads."""
    one = _long_prefill(dtype, "native", 1, first)
    two = _long_prefill(dtype, "native", 2, first)
    again = _long_prefill(dtype, "native", 2, first)
    aten = _long_prefill(dtype, "aten", 1, first)
    assert all(torch.equal(a, b) for a, b in zip(one, two)) and all(torch.equal(a, b) for a, b in zip(two, again))
    tol = TOLERANCE[dtype]
    for i, (a, b) in enumerate(zip(two, aten)):
        torch.testing.assert_close(a, b, atol=tol, rtol=tol, msg=lambda m: f"chunk {i}: {m}")


def _decode_row(dtype: torch.dtype, kernel: str, threads: int, pool_blocks: int = 0) -> torch.Tensor:
    """One decode token of a 1000-token context on an engine of 9 query heads, 3 KV heads (GQA 3), head size 64,
    block 16, tile 4 blocks: 63 blocks, 16 tiles, so the CPU path splits the row into 8 segments of 2 tiles. In place,
    or through a pool of `pool_blocks` blocks (rounds of a few tiles each)."""
    h, kvh, d, bs, seq = 9, 3, 64, 16, 1000
    nb = -(-seq // bs)
    gen = torch.Generator().manual_seed(11)
    k, v = (torch.randn(seq, kvh, d, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(1, h, d, generator=gen).to(dtype)
    cache = torch.zeros(nb, kvh, bs, 2 * d, dtype=dtype)
    previous = torch.get_num_threads()
    try:
        torch.set_num_threads(threads)
        options = {"placement": "in_place"} if pool_blocks == 0 else {}
        e = backend.Engine(1, h, kvh, d, bs, dtype, pool_blocks, 4, kernel=kernel, **options)
        e.update_kv(0, k, v, cache, torch.arange(seq))
        plan = e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq], dtype=torch.int32),
                       torch.arange(nb, dtype=torch.int32).view(1, nb), 1, 1)
        out = torch.empty(1, h, d, dtype=dtype)
        e.forward(0, plan, q, cache, out, d ** -0.5)
    finally:
        torch.set_num_threads(previous)
    kk, vv = (x.double().repeat_interleave(h // kvh, 1).transpose(0, 1) for x in (k, v))  # [H, seq, D]
    p = torch.softmax((q.double().transpose(0, 1) @ kk.transpose(1, 2)) * d ** -0.5, -1)
    return out, (p @ vv).transpose(0, 1).to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["float32", "bfloat16"])
def test_decode_row_in_segments_is_exact_and_the_same_for_any_threads_or_pool(dtype: torch.dtype) -> None:
    """A decode row of 3 KV heads is split into segments of whole tiles (each its own online-softmax state, merged in
    order) so that 2 threads share it evenly: within the kernel's tolerance of float64 attention and of the ATen
    path, and bit-identical for 1, 2 and 3 threads and for a pool that streams it in rounds."""
    one, want = _decode_row(dtype, "native", 1)
    two, _ = _decode_row(dtype, "native", 2)
    three, _ = _decode_row(dtype, "native", 3)
    pooled, _ = _decode_row(dtype, "native", 2, pool_blocks=12)
    aten, _ = _decode_row(dtype, "aten", 1)
    assert torch.equal(one, two) and torch.equal(two, three) and torch.equal(two, pooled)
    tol = TOLERANCE[dtype]
    torch.testing.assert_close(two, want, atol=max(tol, 1e-5), rtol=tol)  # float32: against float64 rounded once
    torch.testing.assert_close(two, aten, atol=tol, rtol=tol)
