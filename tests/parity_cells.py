"""Exact-mode parity scenarios shared by tests/test_parity.py (and later the parity report tool).

A cell is one configuration: dtype x head size x GQA ratio x block size x prompt alignment x pool size x batch x
padded slot mapping. Each cell replays the same vLLM-like step sequence (a prefill chunk, the rest of the prompt, then
decode steps) on the native engine and on the Python reference, feeding both the same tensors.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

NUM_LAYERS = 2
NUM_KV_HEADS = 2
TILE_BLOCKS = 2
DECODE_STEPS = 3


@dataclass(frozen=True)
class Cell:
    dtype: torch.dtype
    head_size: int
    gqa: int
    block_size: int
    aligned: bool
    streaming: bool  # pool smaller than the context (streams through it) or larger
    batch: int
    padded: bool

    @property
    def id(self) -> str:
        dt = str(self.dtype).removeprefix("torch.")
        return (f"{dt}-d{self.head_size}-gqa{self.gqa}-bs{self.block_size}-{'al' if self.aligned else 'un'}-"
                f"{'stream' if self.streaming else 'fit'}-b{self.batch}-{'pad' if self.padded else 'nopad'}")

    @property
    def pool_blocks(self) -> int:
        return TILE_BLOCKS + 1 if self.streaming else 64

    def prompt_lens(self) -> list[int]:
        bs = self.block_size
        blocks = [5, 2, 7][: self.batch]
        return [b * bs if self.aligned else b * bs - 3 - i for i, b in enumerate(blocks)]


def all_cells() -> list[Cell]:
    dims = itertools.product(
        (torch.float32, torch.bfloat16), (64, 128), (1, 4), (16, 32), (True, False), (True, False), (1, 3),
        (False, True))
    return [Cell(*d) for d in dims]


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


def make_steps(cell: Cell, num_host_blocks: int, seed: int = 0) -> list[Step]:
    """A deterministic step sequence: prefill chunk (2/3 of each prompt), rest of the prompt, decode steps.
    Physical block ids are a seeded permutation, as vLLM's allocator hands out non-contiguous ids."""
    g = torch.Generator().manual_seed(seed)
    bs, heads = cell.block_size, NUM_KV_HEADS * cell.gqa
    prompts = cell.prompt_lens()
    final = [p + DECODE_STEPS for p in prompts]
    width = max((f + bs - 1) // bs for f in final)
    perm = torch.randperm(num_host_blocks, generator=g).tolist()
    tables, nxt = [], 0
    for f in final:
        nb = (f + bs - 1) // bs
        tables.append(perm[nxt:nxt + nb] + [0] * (width - nb))
        nxt += nb
    block_table = torch.tensor(tables, dtype=torch.int32)
    done = [0] * cell.batch
    chunks = [[(2 * p) // 3 for p in prompts], [p - (2 * p) // 3 for p in prompts]]
    chunks += [[1] * cell.batch for _ in range(DECODE_STEPS)]
    steps = []
    for new in chunks:
        qsl, slots = [0], []
        for r, n in enumerate(new):
            for pos in range(done[r], done[r] + n):
                slots.append(tables[r][pos // bs] * bs + pos % bs)
            done[r] += n
            qsl.append(qsl[-1] + n)
        t = qsl[-1]
        pad = 5 if cell.padded else 0
        slot_mapping = torch.tensor(slots + [-1] * pad, dtype=torch.int64)

        def rnd(*shape: int) -> torch.Tensor:
            return torch.randn(*shape, generator=g).to(cell.dtype)

        steps.append(Step(
            query_start_loc=torch.tensor(qsl, dtype=torch.int32),
            seq_lens=torch.tensor(done, dtype=torch.int32),
            block_table=block_table.clone(),
            slot_mapping=slot_mapping,
            num_actual_tokens=t + pad,
            q=[rnd(t + pad, heads, cell.head_size) for _ in range(NUM_LAYERS)],
            k=[rnd(t + pad, NUM_KV_HEADS, cell.head_size) for _ in range(NUM_LAYERS)],
            v=[rnd(t + pad, NUM_KV_HEADS, cell.head_size) for _ in range(NUM_LAYERS)],
        ))
    return steps


def host_blocks_for(cell: Cell) -> int:
    return 2 * sum((f + DECODE_STEPS + cell.block_size - 1) // cell.block_size for f in cell.prompt_lens()) + 4
