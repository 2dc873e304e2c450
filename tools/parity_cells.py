"""Parity scenarios and the one cell runner shared by tests/test_parity.py and the parity report tool (tools/parity.py).

A cell is one configuration: mode x dtype x head size x GQA ratio x block size x context x pool x batch x padding;
the pool axis is a pool smaller than the contexts (stream), larger (fit), or placement in place (no pool: blocks read
where they are in the host tier, `in_place_cells`).
Each cell replays the same vLLM-like step sequence on the native engine and on the Python reference, feeding both the
same tensors: a prefill chunk, the rest of the prompt, `block_size + 3` decode steps (so every row fills at least one
whole block one decode token at a time: metadata updates, block-table growth and, with a small pool, evictions on
every step); then a new request takes over the first row's freed blocks (prefill from offset 0, so stale pool copies
and key metadata must be overwritten) and decodes.

Both matrices cross every dtype (float32, bfloat16, float16), head size (64, 128, 80), GQA ratio (1, 4, 8) and block
size (16, 32) with each other (54 combinations), then with a balanced half of the remaining axes (`_half`), so that
every value of every axis meets every value of the four main axes while the run stays a few minutes.
`run_cell` compares them bit for bit and raises `Mismatch` naming the first item that differs.

Run cells with one intra-op thread (`torch.set_num_threads(1)`): with several, the BLAS under torch's matmul may split
a product differently from one call to the next (seen here: 1 run in 20 under load), which is not the engine's doing.
One thread makes every matmul's summation order fixed, so `torch.equal` tests the engine alone.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

import activekv._backend as backend
from tests.reference.engine import COUNTERS, RefEngine

NUM_LAYERS = 2
NUM_KV_HEADS = 2
TILE_BLOCKS = 2
# Compressed mode: 1 sink block, 1 recent block, k = 2 -> a budget of 4 blocks per KV head.
SINK_BLOCKS, RECENT_BLOCKS, TOP_K = 1, 1, 2
BUDGET_BLOCKS = SINK_BLOCKS + TOP_K + RECENT_BLOCKS
REUSE_DECODE_STEPS = 2  # decode steps of the request that reuses the first row's freed blocks


@dataclass(frozen=True)
class Cell:
    dtype: torch.dtype
    head_size: int
    gqa: int
    block_size: int
    context: str  # exact: "aligned" | "unaligned"; compressed: "short" | "multiple" | "unaligned" (vs the budget)
    streaming: bool  # pool smaller than the context (streams through it) or larger; unused in place
    batch: int
    padded: bool
    mode: str = "exact"
    placement: str = "pool"  # "pool" | "in_place" (blocks read where they are in the host tier: no pool)
    dense_layers: int = 0  # compressed: the first layers attend every block (engine.h EngineConfig::dense_layers)

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        mode = f"{self.mode}-dense{self.dense_layers}" if self.dense_layers else self.mode
        if self.placement == "in_place":  # no pool: "inplace" where other cells name their placement's pool size
            return (f"{mode}-inplace-{dt}-d{self.head_size}-gqa{self.gqa}-bs{self.block_size}-{self.context}-"
                    f"b{self.batch}-{'pad' if self.padded else 'nopad'}")
        return (f"{mode}-{dt}-d{self.head_size}-gqa{self.gqa}-bs{self.block_size}-{self.context}-"
                f"{self.pool}-b{self.batch}-{'pad' if self.padded else 'nopad'}")

    @property
    def pool(self) -> str:
        """The pool axis: "stream" (smaller than the context), "fit" (larger) or "inplace" (no pool)."""
        return "inplace" if self.placement == "in_place" else "stream" if self.streaming else "fit"

    @property
    def decode_steps(self) -> int:
        return self.block_size + 3

    @property
    def selects(self) -> bool:
        """Whether some decode step of the cell runs compressed-mode selection: a decode row whose context (the new
        token included) spans more blocks than one KV head's budget (sink + k + recent)."""
        if self.mode != "compressed":
            return False
        blocks = lambda n: -(-n // self.block_size)  # noqa: E731
        finals = [p + self.decode_steps for p in self.prompt_lens()] + [self.prompt_lens()[0] + REUSE_DECODE_STEPS]
        return any(blocks(f) > BUDGET_BLOCKS for f in finals)

    @property
    def budget_tokens(self) -> int:
        return BUDGET_BLOCKS * self.block_size

    @property
    def pool_blocks(self) -> int:
        if self.placement == "in_place":
            return 0
        if self.mode == "compressed":
            union = NUM_KV_HEADS * TOP_K + SINK_BLOCKS + RECENT_BLOCKS  # worst case for one row
            return union if self.streaming else 64
        return TILE_BLOCKS + 1 if self.streaming else 64

    def engine_args(self) -> tuple:
        return (NUM_LAYERS, NUM_KV_HEADS * self.gqa, NUM_KV_HEADS, self.head_size, self.block_size, self.dtype,
                self.pool_blocks, TILE_BLOCKS)

    def engine_kwargs(self) -> dict:
        # The parity matrix is defined on the ATen tile path (docs/parity.md); the fast kernel is checked against it.
        return {"mode": self.mode, "budget_tokens": self.budget_tokens, "sink_blocks": SINK_BLOCKS,
                "recent_blocks": RECENT_BLOCKS, "kernel": "aten", "placement": self.placement,
                "dense_layers": self.dense_layers}

    def prompt_lens(self) -> list[int]:
        bs = self.block_size
        if self.mode == "exact":
            blocks = [5, 2, 7][: self.batch]
            return [b * bs if self.context == "aligned" else b * bs - 3 - i for i, b in enumerate(blocks)]
        unit = {"short": 2, "multiple": 3 * BUDGET_BLOCKS, "unaligned": 5 * BUDGET_BLOCKS // 2}[self.context]
        lens = [unit * bs, max(1, unit // 2) * bs + bs // 2, (3 * unit // 2) * bs][: self.batch]
        return [n - 3 if self.context == "unaligned" else n for n in lens]


MAIN_AXES = ((torch.float32, torch.bfloat16, torch.float16), (64, 128, 80), (1, 4, 8), (16, 32))


def _half(binary_axes: int, i: int) -> list[tuple[bool, ...]]:
    """Half of the 2^n combinations of n two-valued axes: those whose count of True has the parity of `i`. Each half
    holds every value of every axis equally often; consecutive `i` alternate halves, so all 2^n combinations occur."""
    return [c for c in itertools.product((False, True), repeat=binary_axes) if sum(c) % 2 == i % 2]


def exact_cells() -> list[Cell]:
    """54 main combinations x 8 of the 16 (context aligned/unaligned, pool stream/fit, batch 1/3, padded) = 432."""
    cells = []
    for i, (dt, hs, gqa, bs) in enumerate(itertools.product(*MAIN_AXES)):
        for unaligned, streaming, batch3, padded in _half(4, i):
            cells.append(Cell(dt, hs, gqa, bs, "unaligned" if unaligned else "aligned", streaming, 3 if batch3 else 1,
                              padded))
    return cells


def compressed_cells() -> list[Cell]:
    """54 main combinations x 3 contexts (short, multiple, unaligned vs the budget) x 2 of the 4 (pool stream/fit,
    batch 1/3; batch 3 is also padded) = 324."""
    cells = []
    main = itertools.product(*MAIN_AXES, ("short", "multiple", "unaligned"))
    for i, (dt, hs, gqa, bs, context) in enumerate(main):
        for streaming, batch3 in _half(2, i):
            cells.append(Cell(dt, hs, gqa, bs, context, streaming, batch=3 if batch3 else 1, padded=batch3,
                              mode="compressed"))
    return cells


def in_place_cells() -> list[Cell]:
    """Placement in place, 54 main combinations x each mode = 108: exact cells alternate context, batch and padding;
    compressed cells cycle the three contexts and alternate batch 1/3 (batch 3 padded)."""
    cells = []
    for i, (dt, hs, gqa, bs) in enumerate(itertools.product(*MAIN_AXES)):
        batch3 = (i // 2) % 2 == 1
        cells.append(Cell(dt, hs, gqa, bs, "unaligned" if i % 2 else "aligned", False, 3 if batch3 else 1,
                          padded=(i // 4) % 2 == 1, placement="in_place"))
        cells.append(Cell(dt, hs, gqa, bs, ("short", "multiple", "unaligned")[i % 3], False, 3 if i % 2 else 1,
                          padded=i % 2 == 1, mode="compressed", placement="in_place"))
    return cells


def dense_cells() -> list[Cell]:
    """Compressed mode with its first layer dense (dense_layers 1 of the 2 layers: layer 0 attends every block,
    layer 1 selects), 54 main combinations: the three contexts cycled, the pool cycled through stream, fit and in
    place, batch 1/3 alternated (batch 3 padded)."""
    cells = []
    for i, (dt, hs, gqa, bs) in enumerate(itertools.product(*MAIN_AXES)):
        pool = i // 3 % 3
        cells.append(Cell(dt, hs, gqa, bs, ("short", "multiple", "unaligned")[i % 3], pool == 0, 3 if i % 2 else 1,
                          padded=i % 2 == 1, mode="compressed", placement="in_place" if pool == 2 else "pool",
                          dense_layers=1))
    return cells


@dataclass
class Step:
    query_start_loc: torch.Tensor  # int32 [B + 1]
    seq_lens: torch.Tensor  # int32 [B]
    block_table: torch.Tensor  # int32 [B, W]
    slot_mapping: torch.Tensor  # int64 [T (+ padding)]
    num_actual_tokens: int
    q: list[torch.Tensor]  # per layer [T, H, D]
    k: list[torch.Tensor]  # per layer [T, KVH, D]
    v: list[torch.Tensor]

    @property
    def num_reqs(self) -> int:
        return self.seq_lens.shape[0]


def _step(cell: Cell, g: torch.Generator, tables: list[list[int]], done: list[int], new: list[int]) -> Step:
    bs, heads = cell.block_size, NUM_KV_HEADS * cell.gqa
    qsl, slots = [0], []
    for r, n in enumerate(new):
        for pos in range(done[r], done[r] + n):
            slots.append(tables[r][pos // bs] * bs + pos % bs)
        done[r] += n
        qsl.append(qsl[-1] + n)
    t = qsl[-1]
    pad = 5 if cell.padded else 0

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g).to(cell.dtype)

    return Step(
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(done, dtype=torch.int32),
        block_table=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
        num_actual_tokens=t + pad,
        q=[rnd(t + pad, heads, cell.head_size) for _ in range(NUM_LAYERS)],
        k=[rnd(t + pad, NUM_KV_HEADS, cell.head_size) for _ in range(NUM_LAYERS)],
        v=[rnd(t + pad, NUM_KV_HEADS, cell.head_size) for _ in range(NUM_LAYERS)],
    )


def make_steps(cell: Cell, num_host_blocks: int, seed: int = 0) -> list[Step]:
    """A deterministic step sequence. Physical block ids are a seeded permutation, as vLLM's allocator hands out
    non-contiguous ids; the last phase reuses the first row's blocks for a new request."""
    g = torch.Generator().manual_seed(seed)
    bs = cell.block_size
    prompts = cell.prompt_lens()
    final = [p + cell.decode_steps for p in prompts]
    width = max((f + bs - 1) // bs for f in final)
    perm = torch.randperm(num_host_blocks, generator=g).tolist()
    tables, nxt = [], 0
    for f in final:
        nb = (f + bs - 1) // bs
        tables.append(perm[nxt:nxt + nb] + [0] * (width - nb))
        nxt += nb
    done = [0] * cell.batch
    chunks = [[(2 * p) // 3 for p in prompts], [p - (2 * p) // 3 for p in prompts]]
    chunks += [[1] * cell.batch for _ in range(cell.decode_steps)]
    steps = [_step(cell, g, tables, done, new) for new in chunks]
    # Row 0's request finished; a new one gets the same blocks (vLLM frees and reuses them) and runs alone.
    reuse_done = [0]
    steps.append(_step(cell, g, tables[:1], reuse_done, [prompts[0]]))
    steps += [_step(cell, g, tables[:1], reuse_done, [1]) for _ in range(REUSE_DECODE_STEPS)]
    return steps


def host_blocks_for(cell: Cell) -> int:
    bs = cell.block_size
    return 2 * sum((p + cell.decode_steps + bs - 1) // bs for p in cell.prompt_lens()) + 4


def run_engine(cell: Cell, kernel: str, selections: list | None = None, tile_blocks: int | None = None,
               fill: float = 0.0) -> tuple[list[torch.Tensor], backend.Engine]:
    """Every step of the cell on one native engine (no reference): (every forward's output, in step then layer order;
    the engine). `selections`, if given, receives every forward's compressed-mode selection per request row ({row:
    [num_kv_heads, per_head] block ids}); `tile_blocks`, if given, replaces the cell's tile (the pool must hold more
    than one); `fill` is the value of every KV cache slot no token has been written to."""
    nb = host_blocks_for(cell)
    args = cell.engine_args()
    if tile_blocks is not None:
        assert args[-2] > tile_blocks, "the pool must hold more than one tile"
        args = (*args[:-1], tile_blocks)
    eng = backend.Engine(*args, **{**cell.engine_kwargs(), "kernel": kernel})
    caches = [torch.full((nb, 2, cell.block_size, 2 * cell.head_size), fill, dtype=cell.dtype)
              for _ in range(NUM_LAYERS)]
    outs = []
    for st in make_steps(cell, nb):
        plan = eng.build(st.query_start_loc, st.seq_lens, st.block_table, st.num_reqs, st.num_actual_tokens)
        for layer in range(NUM_LAYERS):
            eng.update_kv(layer, st.k[layer], st.v[layer], caches[layer], st.slot_mapping)
            out = torch.full_like(st.q[layer], 7.0)
            eng.forward(layer, plan, st.q[layer], caches[layer], out, cell.head_size ** -0.5)
            outs.append(out)
            if selections is not None:
                selections.append(eng.selection(layer))
    return outs, eng


class Mismatch(AssertionError):
    """The engine and the reference disagree. The message names the cell, where (step, layer) and the first item that
    differs; `snapshot` holds the engine's telemetry counters when the difference was found."""

    def __init__(self, message: str, snapshot: dict[str, Any]) -> None:
        super().__init__(message)
        self.snapshot = snapshot


def first_difference(engine: torch.Tensor, reference: torch.Tensor) -> str:
    """Where two tensors that are not torch.equal first differ (row-major), or how their shapes/dtypes differ."""
    if engine.shape != reference.shape or engine.dtype != reference.dtype:
        return (f"engine {tuple(engine.shape)} {engine.dtype} vs reference {tuple(reference.shape)} "
                f"{reference.dtype}")
    unequal = engine != reference  # NaN != NaN, as torch.equal counts it
    where = tuple(unequal.nonzero()[0].tolist())
    return (f"first at {list(where)}: engine {engine[where].item()!r} vs reference {reference[where].item()!r} "
            f"({int(unequal.sum())} of {unequal.numel()} elements differ)")


def first_key_difference(engine: Mapping[Any, Any], reference: Mapping[Any, Any]) -> str:
    """The first key (sorted) whose value differs between two mappings, or that only one of them has."""
    for key in sorted(set(engine) | set(reference)):
        if key not in engine or key not in reference:
            return f"key {key!r} only in {'engine' if key in engine else 'reference'}"
        a, b = engine[key], reference[key]
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            if not torch.equal(a, b):
                return f"key {key!r}: {first_difference(a, b)}"
        elif a != b:
            return f"key {key!r}: engine {a!r} vs reference {b!r}"
    return "no difference found"


def run_cell(cell: Cell, device: str = "cpu", tiered: bool = False, transfer: str = "mapped") -> dict[str, Any]:
    """Replay the cell on the native engine (its ATen path) and on the reference; compare outputs and selections at
    every step and layer, then telemetry counters, both KV tiers, key metadata and page tables; all bit for bit
    (torch.equal / ==). Returns the native telemetry snapshot; raises `Mismatch` at the first item that differs.

    `device` is the pool's device (the engine's and the reference's); the query, K/V and output tensors live there.
    With `tiered` (CUDA only) the host tier is pinned CPU memory and admissions take the engine's `transfer` path
    ("mapped" or "staged", engine/include/activekv/transfer.h); the reference copies the same bytes plainly."""
    nb = host_blocks_for(cell)
    dev = torch.device(device)
    eng = backend.Engine(*cell.engine_args(), device=dev, transfer=transfer, **cell.engine_kwargs())
    ref = RefEngine(*cell.engine_args(), device=dev, **cell.engine_kwargs())

    def fail(where: str, what: str) -> Mismatch:
        return Mismatch(f"{cell.id}: {where}: {what}", eng.snapshot())

    shape = (nb, 2, cell.block_size, 2 * cell.head_size)  # vLLM's LBHNC per-layer view, 2 KV heads
    def cache() -> torch.Tensor:
        return torch.zeros(shape, dtype=cell.dtype).pin_memory() if tiered else torch.zeros(shape, dtype=cell.dtype,
                                                                                              device=dev)

    caches_n = [cache() for _ in range(NUM_LAYERS)]
    caches_r = [cache() for _ in range(NUM_LAYERS)]
    scale = cell.head_size ** -0.5
    for si, st in enumerate(make_steps(cell, nb)):
        if dev.type != "cpu":
            st.q, st.k, st.v = ([x.to(dev) for x in xs] for xs in (st.q, st.k, st.v))
        plan_n = eng.build(st.query_start_loc, st.seq_lens, st.block_table, st.num_reqs, st.num_actual_tokens)
        plan_r = ref.build(st.query_start_loc, st.seq_lens, st.block_table, st.num_reqs, st.num_actual_tokens)
        for layer in range(NUM_LAYERS):
            eng.update_kv(layer, st.k[layer], st.v[layer], caches_n[layer], st.slot_mapping)
            ref.update_kv(layer, st.k[layer], st.v[layer], caches_r[layer], st.slot_mapping)
            out_n = torch.full_like(st.q[layer], 7.0)
            out_r = torch.full_like(st.q[layer], 7.0)
            eng.forward(layer, plan_n, st.q[layer], caches_n[layer], out_n, scale)
            ref.forward(layer, plan_r, st.q[layer], caches_r[layer], out_r, scale)
            where = f"step {si}, layer {layer}"
            if not torch.equal(out_n, out_r):
                raise fail(where, f"output differs, {first_difference(out_n, out_r)}")
            sel_n, sel_r = eng.selection(layer), ref.selection[layer]
            if sel_n.keys() != sel_r.keys():
                raise fail(where, f"selecting rows differ: engine {sorted(sel_n)} vs reference {sorted(sel_r)}")
            if not all(torch.equal(sel_n[r], sel_r[r]) for r in sel_r):
                raise fail(where, f"selected blocks differ, row {first_key_difference(sel_n, sel_r)}")
    snap = eng.snapshot()
    counters = {k: snap[k] for k in COUNTERS}
    if counters != ref.counters:
        raise fail("end", f"telemetry differs, counter {first_key_difference(counters, ref.counters)}")
    for layer in range(NUM_LAYERS):
        where = f"end, layer {layer}"
        tiers = (("host tier", caches_n[layer], caches_r[layer]),
                 ("pool", eng.pool(layer), ref.layers[layer].pool),
                 ("key_min", eng.key_min(layer), ref.layers[layer].key_min),
                 ("key_max", eng.key_max(layer), ref.layers[layer].key_max))
        for name, a, b in tiers:
            if (a is None) != (b is None):  # key metadata: held in compressed mode only, by both or by neither
                raise fail(where, f"{name}: engine {'holds none' if a is None else 'holds it'}, reference "
                                  f"{'holds none' if b is None else 'holds it'}")
            if a is not None and not torch.equal(a, b):
                raise fail(where, f"{name} differs, {first_difference(a, b)}")
        ref_resident = {b: s for b, s in enumerate(ref.layers[layer].slot_of_block) if s >= 0}
        resident = eng.resident(layer)
        if resident != ref_resident:
            raise fail(where, f"page table differs, block {first_key_difference(resident, ref_resident)}")
    return snap
