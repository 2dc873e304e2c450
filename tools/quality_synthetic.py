"""Compressed mode's selection on synthetic keys, through the native engine: the parts of docs/quality.md that need
no model (tools/quality.py runs them after the real model's).

- `needle_strength`: a planted needle block among noise keys; how often Quest's bound selects it as the needle
  weakens. Quest's bound is an upper bound, so a block of noisy keys can outscore a faint needle.
- `measure_spread`: attention spread evenly, where top-k selection is known to lose: a soft count over marker tokens
  (the attention mass on them) and fully uniform attention, compressed against exact.

Block size 16, sink 1 block; recent 1 block for the needle, 2 for the spread cases.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from typing import Any

import torch

BLOCK_SIZE = 16
SINK_BLOCKS, RECENT_BLOCKS = 1, 2
FRACTIONS = (16, 8, 4)  # spread: budgets of 1/16, 1/8, 1/4 of the context
NEEDLE_LENGTHS = (4.0, 2.0, 1.0, 0.5, 0.25)
NEEDLE_TRIALS = 64


def planted_needle_recall(block_size: int, context_blocks: int, budget_blocks: int, trials: int,
                          noise: float = 0.1, needle: float = 4.0,
                          positions: Sequence[int] | None = None) -> float:
    """Through the engine: noise keys everywhere, one block whose keys align with the decode query (the needle);
    returns the fraction of (trial, KV head) where the needle block was among the attended blocks.

    Geometry: 2 KV heads, GQA 4, head size 16, float32; sink 1 block, recent 1 block, the needle drawn uniformly from
    the blocks in between (`positions`: one trial per listed block position instead, `trials` ignored).
    noise: standard deviation of the noise keys; needle: the needle keys' length along each KV head's summed query.

    Quest's bound is an upper bound: a block of noisy keys scores sum_d |q_d| * spread_d, so the needle must stand out
    against the noise's per-dimension spread (noise 0.1, needle 4.0 by default). With noise 0.3 and needle 2.0 the
    bound of noise blocks exceeded the needle's and recall was 0 (measured while writing tests/test_selection.py)."""
    import activekv._backend as backend

    kvh, gqa, d = 2, 4, 16
    sink, recent = 1, 1
    g = torch.Generator().manual_seed(context_blocks * 131 + block_size)
    hits = total = 0
    plan_positions: list[int | None] = list(positions) if positions is not None else [None] * trials
    for fixed in plan_positions:
        eng = backend.Engine(1, kvh * gqa, kvh, d, block_size, torch.float32, kvh * budget_blocks + 2, 2,
                             mode="compressed", budget_tokens=budget_blocks * block_size, sink_blocks=sink,
                             recent_blocks=recent)
        seq = context_blocks * block_size
        cache = torch.zeros(context_blocks, kvh, block_size, 2 * d)
        q = torch.randn(1, kvh * gqa, d, generator=g)
        keys = noise * torch.randn(seq, kvh, d, generator=g)
        if fixed is None:
            pos = int(torch.randint(sink, context_blocks - recent, (1,), generator=g))
        else:
            pos = int(fixed)
            if not sink <= pos < context_blocks - recent:
                raise ValueError(f"needle position {pos} must be in [{sink}, {context_blocks - recent})")
        # keys of the needle block point along each head's (summed) query direction
        direction = q.view(kvh, gqa, d).sum(1)
        keys[pos * block_size:(pos + 1) * block_size] = needle * direction / direction.norm(dim=-1, keepdim=True)
        table = torch.randperm(context_blocks, generator=g).to(torch.int32)
        slots = (table.long().repeat_interleave(block_size) * block_size + torch.arange(seq) % block_size)
        eng.update_kv(0, keys, torch.randn(seq, kvh, d, generator=g), cache, slots)
        plan = eng.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq], dtype=torch.int32),
                         table[None], 1, 1)
        eng.forward(0, plan, q, cache, torch.empty(1, kvh * gqa, d), d ** -0.5)
        chosen = eng.selection(0)[0]
        for h in range(kvh):
            hits += int(int(table[pos]) in chosen[h].tolist())
            total += 1
    return hits / total


def needle_strength() -> list[dict[str, Any]]:
    """Recall of the planted needle against its length (noise std 0.1; context 128 blocks, budget 8 blocks,
    NEEDLE_TRIALS random positions x 2 KV heads each)."""
    return [{"needle": n, "noise": 0.1, "context_tokens": 128 * BLOCK_SIZE, "budget_blocks": 8,
             "cases": 2 * NEEDLE_TRIALS, "recall": planted_needle_recall(BLOCK_SIZE, 128, 8, NEEDLE_TRIALS, noise=0.1,
                                                                         needle=n)}
            for n in NEEDLE_LENGTHS]


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per head: relative L2 error and cosine similarity of got against want ([H, D])."""
    got, want = got.double(), want.double()
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).tolist()
    return rel, cos


def measure_spread() -> dict[str, Any]:
    """(d), synthetic, through native engines: counting and uniform attention at budgets 1/16, 1/8, 1/4.

    Context 2048 tokens, 2 KV heads, GQA 4, head size 32. Counting: every `period`-th token is a marker whose key is
    2.0 * u (u a unit vector), the others carry noise keys (0.1 * N(0, 1)); the query is 8.0 * u for every head, so a
    marker outscores a non-marker by about 16 * scale = 2.8 logits; values are e_0 on markers and 0 elsewhere. The exact
    output's coordinate 0 is the attention mass on markers, a soft count of them. Uniform: every key equal, values
    N(0, 1); the exact output is the mean of all values.
    """
    import activekv._backend as backend

    kvh, gqa, d, seq = 2, 4, 32, 2048
    nb = seq // BLOCK_SIZE
    scale = d ** -0.5
    g = torch.Generator().manual_seed(7)
    u = torch.randn(d, generator=g)
    u /= u.norm()
    q = (8.0 * u).expand(1, kvh * gqa, d).contiguous()
    table = torch.randperm(nb, generator=g).to(torch.int32)
    slots = table.long().repeat_interleave(BLOCK_SIZE) * BLOCK_SIZE + torch.arange(seq) % BLOCK_SIZE

    def run(keys: torch.Tensor, values: torch.Tensor, mode: str, budget: int) -> torch.Tensor:
        k = budget // BLOCK_SIZE - SINK_BLOCKS - RECENT_BLOCKS
        eng = backend.Engine(1, kvh * gqa, kvh, d, BLOCK_SIZE, torch.float32, max(256, kvh * k + 3), 16, mode=mode,
                             budget_tokens=budget, sink_blocks=SINK_BLOCKS, recent_blocks=RECENT_BLOCKS)
        cache = torch.zeros(nb, kvh, BLOCK_SIZE, 2 * d)
        eng.update_kv(0, keys, values, cache, slots)
        plan = eng.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq], dtype=torch.int32),
                         table[None], 1, 1)
        out = torch.zeros(1, kvh * gqa, d)
        eng.forward(0, plan, q, cache, out, scale)
        return out[0]

    counting = []
    for period in (16, 32, 64, 128, 256, 1024):
        keys = 0.1 * torch.randn(seq, kvh, d, generator=g)
        values = torch.zeros(seq, kvh, d)
        marks = torch.arange(period // 2, seq, period)
        keys[marks] = 2.0 * u
        values[marks, :, 0] = 1.0
        exact = run(keys, values, "exact", 2048)[:, 0]
        row = {"markers": int(marks.numel()), "marker_blocks": int(torch.unique(marks // BLOCK_SIZE).numel()),
               "exact_mass": float(exact.mean()), "budgets": {}}
        for frac in FRACTIONS:
            budget = seq // frac
            got = run(keys, values, "compressed", budget)[:, 0]
            row["budgets"][str(frac)] = {"budget_blocks": budget // BLOCK_SIZE, "mass": float(got.mean()),
                                         "rel_error": float(((got - exact).abs() / exact).mean())}
        counting.append(row)
    keys = torch.ones(seq, kvh, d) * 0.5
    values = torch.randn(seq, kvh, d, generator=g)
    exact = run(keys, values, "exact", 2048)
    uniform = {}
    for frac in FRACTIONS:
        got = run(keys, values, "compressed", seq // frac)
        rel, cos = _errors(got, exact)
        uniform[str(frac)] = {"rel_error_mean": statistics.fmean(rel), "cosine_mean": statistics.fmean(cos)}
    return {"counting": counting, "uniform": uniform, "context_tokens": seq}
