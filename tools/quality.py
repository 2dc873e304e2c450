"""Measure compressed mode's quality and write docs/quality.md.

`python -m tools.quality [--model build/tiny-trained] [--out docs/quality.md] [--json build/quality/quality.json]
[--parts abcd]` (what `make quality` runs after `python -m tools.train_tiny`):

(a) Planted needle, through the native engine: noise keys everywhere and one block whose keys point along the decode
    query; the fraction of (trial, KV head) where that block is among the attended blocks, for every candidate needle
    position at several context lengths and budgets, and for needles of decreasing strength.
(b) Attention-output error on real activations: vLLM (in this process, ActiveKV exact mode) generates on the trained
    model from held-out prompts of 2048 tokens while `tools.capture` records every layer's query, step plan and KV
    blocks at a few decode steps; each (step, layer, request row) is replayed on fresh native engines, exact and
    compressed with budgets of 1/16, 1/8 and 1/4 of that row's context. Reported per query head:
    relative L2 error and cosine similarity of the compressed output against the exact one, and the share of the exact
    softmax mass that falls in the attended blocks; two selections computed in Python next to Quest's give a floor
    and a ceiling at the same budget: a static window (sink + most recent blocks) and an oracle (the blocks with the
    most exact attention mass, summed over the group's query heads).
(c) Greedy token agreement in vLLM: the same prompts, 256 new tokens, compressed at the three budgets against exact.
    Prefix agreement = (index of the first differing token) / 256, averaged over prompts (1.0 when all agree);
    positionwise agreement = share of positions with equal tokens (the more lenient figure: byte-level continuations
    can fall back into step after one differing token). At the first difference, the exact run's margin between its
    top two tokens says how near a tie it was. A CPU_ATTN run against ActiveKV exact gives the floor that rounding
    alone leaves. The compressed run at 1/4 also has three steps recorded and replayed on fresh engines (item 8 on
    the trained model).
(d) Attention spread evenly: synthetic counting (one query that matches marker keys spread through the context; the
    output's first coordinate is the attention mass on markers, i.e. a soft count) and fully uniform attention; and
    the trained model on a repetitive prompt (one line repeated) replayed as in (b).

Runtime on this 2-core machine: about 100 s when it is quiet, several times that when shared (five vLLM engine starts,
each generating 256 tokens for nine prompts of about 2k tokens: eight held-out, one repetitive).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

BLOCK_SIZE = 16
SINK_BLOCKS, RECENT_BLOCKS = 1, 2
FRACTIONS = (16, 8, 4)  # budgets of 1/16, 1/8, 1/4 of the context
PROMPT_TOKENS = 2048
NUM_PROMPTS = 8
NEW_TOKENS = 256
CAPTURE_STEPS = (1, 64, 128, 192, 255)  # decode steps recorded for (b) (step 0 is the prefill)
REPLAY_STEPS = (1, 128, 255)  # steps of the compressed 1/4 run replayed on fresh engines
REPEATED_LINE = b"    total = total + count  # add the count\n"
REPEATED_SHORTER = 8  # the repetitive prompt is this many tokens shorter: its batch row is told apart by seq_len


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------------- (a)

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


def measure_needle() -> dict[str, Any]:
    """(a): every candidate position at several context lengths and budgets; then recall against needle strength."""
    grid = []
    for context_blocks in (16, 32, 64, 128, 256):
        for budget in sorted({max(context_blocks // frac, 3) for frac in FRACTIONS}):
            positions = list(range(1, context_blocks - 1))
            recall = planted_needle_recall(BLOCK_SIZE, context_blocks, budget, 0, positions=positions)
            grid.append({"context_tokens": context_blocks * BLOCK_SIZE, "budget_blocks": budget,
                         "positions": len(positions), "cases": 2 * len(positions), "recall": recall})
    strength = []
    for needle in (4.0, 2.0, 1.0, 0.5, 0.25):
        recall = planted_needle_recall(BLOCK_SIZE, 128, 8, 64, noise=0.1, needle=needle)
        strength.append({"needle": needle, "noise": 0.1, "context_tokens": 128 * BLOCK_SIZE, "budget_blocks": 8,
                         "cases": 128, "recall": recall})
    return {"grid": grid, "strength": strength}


# ----------------------------------------------------------------------------------------------------------- (b)

def _budget_tokens(seq: int, frac: int) -> int:
    """Budget of 1/frac of a context of seq tokens, in whole blocks, at least sink + recent + 1 blocks."""
    return max((seq // frac) // BLOCK_SIZE, SINK_BLOCKS + RECENT_BLOCKS + 1) * BLOCK_SIZE


def _engine(spec: dict[str, Any], mode: str, budget_tokens: int = 2048) -> Any:
    import activekv._backend as backend

    kvh = spec["num_key_value_heads"]
    k = budget_tokens // BLOCK_SIZE - SINK_BLOCKS - RECENT_BLOCKS
    pool = max(256, kvh * k + SINK_BLOCKS + RECENT_BLOCKS)
    return backend.Engine(1, spec["num_attention_heads"], kvh, spec["head_dim"], BLOCK_SIZE, torch.float32, pool, 16,
                          mode=mode, budget_tokens=budget_tokens, sink_blocks=SINK_BLOCKS,
                          recent_blocks=RECENT_BLOCKS)


def _subset_attention(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                      token_mask: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
    """q [H, D], keys/values [S, KVH, D], token_mask bool [KVH, S] or None (all) -> (output [H, D] float64,
    exact probabilities [H, S] float64 over all tokens)."""
    h, d = q.shape
    kvh = keys.shape[1]
    g = h // kvh
    k = keys.double().permute(1, 0, 2).repeat_interleave(g, 0)  # [H, S, D]
    v = values.double().permute(1, 0, 2).repeat_interleave(g, 0)
    logits = torch.einsum("hd,hsd->hs", q.double(), k) * scale
    probs = torch.softmax(logits, -1)
    if token_mask is not None:
        logits = logits.masked_fill(~token_mask.repeat_interleave(g, 0), float("-inf"))
    out = torch.einsum("hs,hsd->hd", torch.softmax(logits, -1), v)
    return out, probs


def _chosen(positions: torch.Tensor, nb: int) -> torch.Tensor:
    """positions int64 [KVH, m] block positions in the row -> bool [KVH, nb]."""
    return torch.zeros(positions.shape[0], nb, dtype=torch.bool).scatter_(1, positions, True)


def _token_mask(positions: torch.Tensor, nb: int, seq: int) -> torch.Tensor:
    """positions int64 [KVH, m] -> bool [KVH, seq]: the tokens of the chosen blocks."""
    return _chosen(positions, nb).repeat_interleave(BLOCK_SIZE, 1)[:, :seq]


def _mass_recall(block_mass: torch.Tensor, positions: torch.Tensor) -> list[float]:
    """block_mass [KVH, G, nb] exact softmax mass per query head and block; positions [KVH, m] -> per query head
    (KV head major) the mass inside the chosen blocks."""
    kvh, g, nb = block_mass.shape
    return (block_mass * _chosen(positions, nb)[:, None, :]).sum(-1).reshape(-1).tolist()


def _errors(got: torch.Tensor, want: torch.Tensor) -> tuple[list[float], list[float]]:
    """Per head: relative L2 error and cosine similarity of got against want ([H, D])."""
    got, want = got.double(), want.double()
    rel = ((got - want).norm(dim=-1) / want.norm(dim=-1)).tolist()
    cos = torch.nn.functional.cosine_similarity(got, want, dim=-1).tolist()
    return rel, cos


def replay_quality(calls: Sequence[Any], spec: dict[str, Any], rows: Callable[[Any], list[int]]) -> dict[str, Any]:
    """(b) on recorded decode calls: per method and budget, rel. error / cosine / attention-mass recall lists."""
    from tools.capture import replay

    kvh, g = spec["num_key_value_heads"], spec["num_attention_heads"] // spec["num_key_value_heads"]
    res: dict[str, dict[str, list[float]]] = {}

    def add(key: str, rel: list[float], cos: list[float], mass: list[float], layer: int) -> None:
        r = res.setdefault(key, {"rel": [], "cos": [], "mass": []})
        r["rel"] += rel
        r["cos"] += cos
        r["mass"] += mass
        r.setdefault(f"rel_layer{layer}", []).extend(rel)

    for call in calls:
        for r in rows(call):
            exact = replay(call, _engine(spec, "exact"), rows=[r]).output[0]  # [H, D]
            keys, values, _ = call.row_kv(r)
            seq, nb = keys.shape[0], -(-keys.shape[0] // BLOCK_SIZE)
            q = call.query[call.query_start_loc[r]]
            full, probs = _subset_attention(q, keys, values, call.scale, None)
            # exact softmax mass per (KV head, query head of its group, block)
            mass = torch.nn.functional.pad(probs, (0, nb * BLOCK_SIZE - seq)).view(kvh, g, nb, BLOCK_SIZE).sum(-1)
            pos_of = {int(b): i for i, b in enumerate(call.row_blocks(r).tolist())}
            for frac in FRACTIONS:
                budget = _budget_tokens(seq, frac)
                per_head = budget // BLOCK_SIZE
                top_k = per_head - SINK_BLOCKS - RECENT_BLOCKS
                got = replay(call, _engine(spec, "compressed", budget), rows=[r])
                if 0 not in got.selection:  # context within the budget: ran exact
                    continue
                sel = got.selection[0].apply_(lambda b: pos_of[b])  # [KVH, per_head] positions
                rel, cos = _errors(got.output[0], exact)
                add(f"quest/{frac}", rel, cos, _mass_recall(mass, sel), call.layer)
                # the same selection in float64 Python: checks that the window and oracle rows compare like with like
                out, _ = _subset_attention(q, keys, values, call.scale, _token_mask(sel, nb, seq))
                add("quest_vs_float64", _errors(got.output[0], out)[0], [], [], call.layer)
                fixed = list(range(SINK_BLOCKS)) + list(range(nb - RECENT_BLOCKS, nb))
                cand = torch.tensor([b for b in range(nb) if b not in fixed])
                window = torch.tensor(list(range(SINK_BLOCKS)) + list(range(nb - per_head + SINK_BLOCKS, nb)))
                group_mass = mass.sum(1)  # [KVH, nb]
                oracle = torch.stack([
                    torch.cat([torch.tensor(fixed), cand[group_mass[h, cand].topk(top_k).indices]]) for h in range(kvh)
                ])
                for name, positions in (("window", window.expand(kvh, -1)), ("oracle", oracle)):
                    out, _ = _subset_attention(q, keys, values, call.scale, _token_mask(positions, nb, seq))
                    rel, cos = _errors(out, exact)
                    add(f"{name}/{frac}", rel, cos, _mass_recall(mass, positions), call.layer)
            # sanity: the engine's exact output against float64 attention (context for the error figures)
            rel, _ = _errors(exact, full)
            add("exact_vs_float64", rel, [], [], call.layer)
    return res


def _summary(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    s = sorted(values)
    return {"n": len(s), "mean": statistics.fmean(s), "median": statistics.median(s),
            "p95": s[min(len(s) - 1, math.ceil(0.95 * len(s)) - 1)], "p5": s[max(0, math.floor(0.05 * len(s)))],
            "min": s[0], "max": s[-1]}


# ----------------------------------------------------------------------------------------------------------- (c)

@dataclass
class Agreement:
    prefix: list[float]  # per prompt: first differing index / n (1.0 when equal)
    positionwise: list[float]
    margins: list[float | None]  # per prompt: the reference run's top-1 - top-2 logprob where the first difference is

    @staticmethod
    def of(got: Sequence[Sequence[int]], want: Sequence[Sequence[int]],
           want_top: Sequence[Sequence[dict[int, float]]]) -> Agreement:
        """got / want: generated token ids per prompt; want_top: the reference run's top logprobs per position."""
        prefix, pos, margins = [], [], []
        for a, b, top in zip(got, want, want_top):
            n = len(b)
            first = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), n)
            prefix.append(first / n)
            pos.append(sum(x == y for x, y in zip(a, b)) / n)
            best = sorted(top[first].values(), reverse=True) if first < n else []
            margins.append(best[0] - best[1] if len(best) >= 2 else None)
        return Agreement(prefix, pos, margins)

    def as_dict(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "positionwise": self.positionwise, "margins_at_divergence": self.margins,
                "prefix_mean": statistics.fmean(self.prefix), "positionwise_mean": statistics.fmean(self.positionwise)}


def make_prompts() -> tuple[list[list[int]], list[int]]:
    """NUM_PROMPTS held-out prompts of PROMPT_TOKENS (BOS + bytes from evenly spaced offsets of the held-out text),
    plus the repetitive prompt (BOS + REPEATED_LINE repeated, PROMPT_TOKENS - REPEATED_SHORTER tokens) for (d)."""
    from tools.train_tiny import BOS, heldout_tokens

    held = heldout_tokens()
    span = len(held) - PROMPT_TOKENS
    prompts = [[BOS] + held[i * span // NUM_PROMPTS:i * span // NUM_PROMPTS + PROMPT_TOKENS - 1]
               for i in range(NUM_PROMPTS)]
    line = list(REPEATED_LINE)
    repeated = [BOS] + (line * (PROMPT_TOKENS // len(line) + 1))[:PROMPT_TOKENS - REPEATED_SHORTER - 1]
    return prompts, repeated


def agreement(got: Any, exact: Any, real: bool) -> dict[str, Any]:
    """Agreement of two `tools.vllm_run.Generation`s over the held-out prompts (real) or the repetitive one."""
    part = slice(0, NUM_PROMPTS) if real else slice(NUM_PROMPTS, None)
    return Agreement.of(got.token_ids[part], exact.token_ids[part], exact.top_logprobs[part]).as_dict()


def measure_vllm(model: str, spec: dict[str, Any]) -> dict[str, Any]:
    """(b), (c) and the natural half of (d): one exact run with capture, CPU_ATTN, three compressed runs."""
    from tools.capture import capture, replay
    from tools.vllm_run import ACTIVEKV, CPU_ATTN, EngineConfig, VllmEngine, activekv_status

    available, why = activekv_status()
    if not available:
        raise RuntimeError(why)
    prompts, repeated = make_prompts()
    batch = prompts + [repeated]
    common = {"max_model_len": PROMPT_TOKENS + NEW_TOKENS + BLOCK_SIZE,
              "max_num_batched_tokens": (NUM_PROMPTS + 1) * PROMPT_TOKENS,
              "kv_cache_gib": 1}
    out: dict[str, Any] = {"prompt_tokens": PROMPT_TOKENS, "new_tokens": NEW_TOKENS, "prompts": len(prompts),
                           "num_kv_heads": spec["num_key_value_heads"]}
    timings: dict[str, float] = {}

    t0 = time.monotonic()
    exact_cfg = EngineConfig(model, backend=ACTIVEKV, activekv={"mode": "exact"}, block_size=BLOCK_SIZE, **common)
    with VllmEngine(exact_cfg) as engine, capture(keep=lambda step, plan: step in CAPTURE_STEPS) as rec:
        exact = engine.generate(batch, NEW_TOKENS, logprobs=2)
    timings["exact_run_s"] = time.monotonic() - t0
    _log(f"exact run: {timings['exact_run_s']:.0f} s, {len(rec.calls)} layer forwards recorded")

    t0 = time.monotonic()
    def rows_of(prompt_len: int) -> Callable[[Any], list[int]]:
        # vLLM orders batch rows itself: a row is told by its context length (prompt + decode step)
        return lambda call: [r for r in range(call.num_reqs) if int(call.seq_lens[r]) == prompt_len + call.step]

    out["replay"] = replay_quality(rec.calls, spec, rows_of(PROMPT_TOKENS))
    out["replay_repeated"] = replay_quality(rec.calls, spec, rows_of(PROMPT_TOKENS - REPEATED_SHORTER))
    out["replay_cases"] = {"steps": list(CAPTURE_STEPS), "layers": spec["num_hidden_layers"], "rows": len(prompts)}
    timings["replay_s"] = time.monotonic() - t0
    del rec
    _log(f"replays: {timings['replay_s']:.0f} s")

    t0 = time.monotonic()
    with VllmEngine(EngineConfig(model, backend=CPU_ATTN, **common)) as engine:
        stock = engine.generate(batch, NEW_TOKENS)
    timings["cpu_attn_run_s"] = time.monotonic() - t0
    out["cpu_attn_vs_exact"] = agreement(stock, exact, real=True)
    out["cpu_attn_vs_exact_repeated"] = agreement(stock, exact, real=False)

    out["compressed"] = {}
    for frac in FRACTIONS:
        budget = _budget_tokens(PROMPT_TOKENS, frac)
        opts = {"mode": "compressed", "budget_tokens": budget, "sink_blocks": SINK_BLOCKS,
                "recent_blocks": RECENT_BLOCKS}
        cfg = EngineConfig(model, backend=ACTIVEKV, activekv=opts, block_size=BLOCK_SIZE, **common)
        keep = (lambda step, plan: step in REPLAY_STEPS) if frac == 4 else (lambda step, plan: False)
        t0 = time.monotonic()
        with VllmEngine(cfg) as engine, capture(keep=keep) as rec:
            gen = engine.generate(batch, NEW_TOKENS)
        timings[f"compressed_1_{frac}_run_s"] = time.monotonic() - t0
        tel = gen.telemetry or {}
        entry = {
            "budget_tokens": budget,
            "agreement": agreement(gen, exact, real=True),
            "agreement_repeated": agreement(gen, exact, real=False),
            "telemetry": {k: tel.get(k, 0) for k in ("compressed_rows", "compressed_context_blocks",
                                                      "selected_blocks", "union_blocks")},
        }
        if rec.calls:
            entry["replay_check"] = replay_check(rec.calls, spec, opts)
        out["compressed"][str(frac)] = entry
        _log(f"compressed 1/{frac}: prefix agreement {entry['agreement']['prefix_mean']:.3f}, "
             f"{timings[f'compressed_1_{frac}_run_s']:.0f} s")
    out["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
    return out


def replay_check(calls: Sequence[Any], spec: dict[str, Any], opts: dict[str, Any]) -> dict[str, Any]:
    """Item 8 on the trained model: recorded layer forwards of a compressed run against fresh engines' replays.

    A fresh native engine with the run's options must give bit-equal outputs and equal selections. The reference
    (`RefEngine`) mirrors the engine's ATen tile path: its selections must be equal; its outputs are bit-equal when
    the run used that path, and differ by rounding when the engine computed tiles with its native kernel (an engine
    with a `kernel` option, default "native"), so the largest absolute difference is reported."""
    import activekv._backend as backend

    from tests.reference.engine import RefEngine
    from tools.capture import replay

    kvh = spec["num_key_value_heads"]
    k = opts["budget_tokens"] // BLOCK_SIZE - SINK_BLOCKS - RECENT_BLOCKS
    pool = max(256, kvh * k + SINK_BLOCKS + RECENT_BLOCKS)
    args = (1, spec["num_attention_heads"], kvh, spec["head_dim"], BLOCK_SIZE, torch.float32, pool, 16)
    kw = {"mode": "compressed", "budget_tokens": opts["budget_tokens"], "sink_blocks": SINK_BLOCKS,
          "recent_blocks": RECENT_BLOCKS}
    native = backend.Engine(*args, **kw)
    result: dict[str, Any] = {"calls": len(calls), "kernel": str(getattr(native, "kernel", "aten")),
                              "native_equal": 0, "native_selections_equal": 0, "reference_equal": 0,
                              "reference_selections_equal": 0, "reference_max_abs_diff": 0.0}

    def same(a: dict[int, torch.Tensor], b: dict[int, torch.Tensor]) -> bool:
        return sorted(a) == sorted(b) and all(torch.equal(a[r], b[r]) for r in b)

    for call in calls:
        nat = replay(call, backend.Engine(*args, **kw))
        ref = replay(call, RefEngine(*args, **kw))
        result["native_equal"] += int(torch.equal(nat.output, call.output))
        result["native_selections_equal"] += int(same(nat.selection, call.selection))
        result["reference_equal"] += int(torch.equal(ref.output, call.output))
        result["reference_selections_equal"] += int(same(ref.selection, call.selection))
        result["reference_max_abs_diff"] = max(result["reference_max_abs_diff"],
                                               float((ref.output - call.output).abs().max()))
    return result


# ----------------------------------------------------------------------------------------------------------- (d)

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


# ----------------------------------------------------------------------------------------------------------- report

def _pct(x: float) -> str:
    return f"{100 * x:.1f}%"


def render(results: dict[str, Any], command: str) -> str:
    """docs/quality.md from the results dict."""
    lines = ["# ActiveKV compressed mode: measured quality", "",
             f"Made by `{command}` (`make quality` trains the model first if needed, then runs this). Machine: "
             f"{results['machine']}. Figures are from the run recorded in `build/quality/quality.json`.", "",
             "Compressed mode: each decode row attends, per KV head, `sink_blocks` = 1 first block, `recent_blocks` = "
             f"2 last blocks and the top `k = budget / {BLOCK_SIZE} - 3` other blocks by Quest's bound "
             "(`engine/include/activekv/admission.h`); prefill and contexts within the budget run exactly. "
             f"Block size {BLOCK_SIZE} throughout.", ""]
    lines += _headline(results)
    model = results.get("model")
    if model:
        res = model["result"]
        sp = model["spec"]
        lines += ["## The model", "",
                  f"`python -m tools.train_tiny build/tiny-trained`: Llama, {sp['num_hidden_layers']} layers, hidden "
                  f"{sp['hidden_size']}, {sp['num_attention_heads']} query heads / {sp['num_key_value_heads']} KV "
                  "heads "
                  f"(head size {sp['head_dim']}), MLP {sp['intermediate_size']}, byte-level vocab {sp['vocab_size']}, "
                  f"{res['parameters']:,} parameters. Trained {sp['steps'] - sp['long_steps']} steps x "
                  f"{sp['batch_size']} windows of {sp['seq_len']} tokens, then {sp['long_steps']} steps x "
                  f"{sp['long_batch_size']} windows "
                  f"of {sp['long_seq_len']} ({res['train_tokens']:,} tokens; `tools/train_tiny.py` says why the "
                  "long phase) on the top-level `*.py` files of "
                  f"Python {sp['python']}'s standard library ({sp['corpus_files']} files, every tenth held out: "
                  f"{res['heldout_bytes']:,} bytes), seed {sp['seed']}, {sp['threads']} threads: "
                  f"**{res['train_seconds']:.0f} s** of training on this machine.", "",
                  "| | windows of 512 tokens | windows of 2048 tokens | 2048, positions >= 512 only |",
                  "|---|---|---|---|",
                  f"| held-out loss (nats/byte) | {res['heldout_loss_512']:.3f} "
                  f"({res['heldout_loss_512'] / math.log(2):.2f} bits/byte) | "
                  f"{res['heldout_loss_2048']:.3f} | {res['heldout_loss_2048_positions_ge_512']:.3f} |", ""]
    a = results.get("needle")
    if a:
        total = sum(r["cases"] for r in a["grid"])
        hits = sum(r["recall"] * r["cases"] for r in a["grid"])
        lines += ["## (a) Planted needle", "",
                  "`tools.quality.planted_needle_recall` (also `tests/test_selection.py`): through the native engine, "
                  "noise keys (std 0.1) and one needle block whose keys point along the query (length 4.0), 2 KV "
                  "heads x GQA 4, head size 16; sink 1 and recent 1 block. Every candidate needle position, each "
                  "context length, budgets 1/16, 1/8, 1/4 of the context (at least 3 blocks):", "",
                  "| context (tokens) | budget (blocks) | needle positions | recall |", "|---|---|---|---|"]
        lines += [f"| {r['context_tokens']} | {r['budget_blocks']} | {r['positions']} | {_pct(r['recall'])} |"
                  for r in a["grid"]]
        lines += ["", f"**{_pct(hits / total)}** of {total} (position, KV head) cases.", "",
                  "Needle strength (random positions, 64 trials x 2 KV heads, context 2048, budget 8 blocks): "
                  "the bound of a noise block grows with the noise's spread, so a weak needle is missed.", "",
                  "| needle length | noise std | recall |", "|---|---|---|"]
        lines += [f"| {r['needle']} | {r['noise']} | {_pct(r['recall'])} |" for r in a["strength"]]
        lines.append("")
    v = results.get("vllm")
    if v:
        lines += _render_vllm(v, results)
    s = results.get("spread")
    if s:
        lines += ["## (d) Attention spread evenly: where top-k selection degrades", "",
                  f"Synthetic, through native engines (`tools.quality.measure_spread`): context {s['context_tokens']} "
                  "tokens. **Counting**: marker tokens every `period` tokens, each with the same key, the query "
                  "matching it; values 1 on markers (coordinate 0), so the exact output is the attention mass on "
                  "markers, a soft count, and it depends on every token: the many non-markers each carry a little "
                  "mass. Quest keeps the blocks with markers first and renormalises over what it keeps, so the "
                  "background it drops leaves the markers with too large a share: the soft count is overestimated, "
                  "the more the sparser the markers. Only with a marker in every block (period 16) is the share "
                  "kept.", "",
                  "| markers | blocks with a marker | exact mass | " + " | ".join(
                      f"1/{f}: mass (rel. error)" for f in FRACTIONS) + " |",
                  "|---|---|---|" + "---|" * len(FRACTIONS)]
        for r in s["counting"]:
            cells = [f"{r['budgets'][str(f)]['mass']:.3f} ({_pct(r['budgets'][str(f)]['rel_error'])})"
                     for f in FRACTIONS]
            lines.append(f"| {r['markers']} | {r['marker_blocks']} | {r['exact_mass']:.3f} | " + " | ".join(cells)
                         + " |")
        lines += ["", "**Uniform attention** (all keys equal, values N(0, 1)): the exact output is the mean of 2048 "
                  "values; the compressed one is the mean of the budget's tokens.", "",
                  "| budget | rel. error (mean over heads) | cosine |", "|---|---|---|"]
        lines += [f"| 1/{f} | {s['uniform'][str(f)]['rel_error_mean']:.2f} | "
                  f"{s['uniform'][str(f)]['cosine_mean']:.3f} |" for f in FRACTIONS]
        lines.append("")
        if v and "replay_repeated" in v:
            rr = v["replay_repeated"]
            lines += ["**Trained model, repetitive prompt** (BOS + `" + REPEATED_LINE.decode().rstrip("\n")
                      + f"\\n` repeated, {PROMPT_TOKENS - REPEATED_SHORTER} tokens; every earlier copy of the line "
                      "is an equally good match), "
                      "replayed as in (b):", "",
                      "| budget | Quest rel. error mean / p95 | cosine mean | mass recall mean | "
                      "window rel. error mean | oracle rel. error mean |", "|---|---|---|---|---|---|"]
            for f in FRACTIONS:
                q, w, o = (_summary(rr[f"{m}/{f}"]["rel"]) for m in ("quest", "window", "oracle"))
                lines.append(f"| 1/{f} | {q['mean']:.3f} / {q['p95']:.3f} | "
                             f"{_summary(rr[f'quest/{f}']['cos'])['mean']:.4f} | "
                             f"{_pct(_summary(rr[f'quest/{f}']['mass'])['mean'])} | {w['mean']:.3f} | "
                             f"{o['mean']:.3f} |")
            c = v["compressed"]
            lines += ["", "Greedy agreement on this prompt (prefix): " + ", ".join(
                f"1/{f}: {_pct(c[str(f)]['agreement_repeated']['prefix_mean'])}" for f in FRACTIONS) + ".", ""]
    return "\n".join(lines) + "\n"


def _headline(results: dict[str, Any]) -> list[str]:
    """The figures in brief, each from the section below that holds it."""
    out = ["## In brief", ""]
    a, v, s = results.get("needle"), results.get("vllm"), results.get("spread")
    if a:
        total = sum(r["cases"] for r in a["grid"])
        hits = sum(r["recall"] * r["cases"] for r in a["grid"])
        weak = ", ".join(f"length {r['needle']}: {_pct(r['recall'])}" for r in a["strength"] if r["recall"] < 1.0)
        out.append(f"- (a) Planted needle selected in {_pct(hits / total)} of {total} cases (every position, contexts "
                   f"256-4096 tokens, budgets 1/16-1/4). Weaker needles against noise of std 0.1 are missed ({weak}): "
                   "Quest's bound is an upper bound, and noise blocks' bounds grow with their spread.")
    if v:
        rp = v["replay"]
        figs = ", ".join(f"1/{f}: {_summary(rp[f'quest/{f}']['rel'])['mean']:.3f} / "
                         f"{_summary(rp[f'quest/{f}']['cos'])['mean']:.3f}" for f in FRACTIONS)
        win = ", ".join(f"{_summary(rp[f'window/{f}']['rel'])['mean']:.3f}" for f in FRACTIONS)
        ora = ", ".join(f"{_summary(rp[f'oracle/{f}']['rel'])['mean']:.3f}" for f in FRACTIONS)
        out.append(f"- (b) Attention output on the trained model's captured activations, compressed against exact, "
                   f"mean relative error / mean cosine per query head: {figs}. A recency window of the same budget: "
                   f"{win}; the best blocks by exact attention mass (oracle): {ora}.")
        agr = ", ".join(f"1/{f}: {_pct(v['compressed'][str(f)]['agreement']['prefix_mean'])}" for f in FRACTIONS)
        a4 = v["compressed"]["4"]["agreement"]
        out.append(f"- (c) Greedy tokens in vLLM, {v['prompts']} prompts of {v['prompt_tokens']} tokens x "
                   f"{v['new_tokens']} new, agreement with exact up to the first difference: {agr} (target 95% at "
                   f"1/4: {'met' if a4['prefix_mean'] >= 0.95 else 'missed'}; positionwise at 1/4: "
                   f"{_pct(a4['positionwise_mean'])}).")
    if s:
        worst = max(r["budgets"]["4"]["rel_error"] for r in s["counting"])
        out.append(f"- (d) Attention spread evenly breaks top-k: a soft count over markers is overestimated by up to "
                   f"{_pct(worst)} at budget 1/4, and uniform attention gives a relative error of "
                   f"{s['uniform']['4']['rel_error_mean']:.2f} at 1/4.")
    return out + [""]


def _render_vllm(v: dict[str, Any], results: dict[str, Any]) -> list[str]:
    rp = v["replay"]
    cases = v["replay_cases"]
    ctx_lo, ctx_hi = v["prompt_tokens"] + min(cases["steps"]), v["prompt_tokens"] + max(cases["steps"])
    lines = ["## (b) Attention-output error on the trained model's activations", "",
             f"vLLM 0.32.0 in this process, ActiveKV exact mode, {v['prompts']} held-out prompts of "
             f"{v['prompt_tokens']} tokens (BOS + bytes of the held-out files) plus the repetitive prompt of (d), "
             f"greedy. `tools.capture` records each layer's query, step plan and KV blocks at decode steps "
             f"{', '.join(map(str, cases['steps']))} ({cases['layers']} layers x {cases['rows']} rows x "
             f"{len(cases['steps'])} steps = {cases['layers'] * cases['rows'] * len(cases['steps'])} layer-rows, x 8 "
             "query heads per figure); each layer-row is replayed on fresh native engines, exact and compressed "
             f"with a budget of 1/16, 1/8, 1/4 of its context ({ctx_lo}-{ctx_hi} tokens, "
             f"{-(-ctx_lo // BLOCK_SIZE)}-{-(-ctx_hi // BLOCK_SIZE)} blocks). Errors are per "
             "query head: `|o_c - o_e| / |o_e|` and `cos(o_c, o_e)`; mass recall is the share of the exact softmax "
             "mass inside the blocks the head's KV head attended. *Window* (sink + the most recent blocks) and "
             "*oracle* (per KV head, the blocks with the most exact mass summed over its 4 query heads, plus sink "
             "and recent) are the same budget selected in Python, as floor and ceiling.", "",
             "| budget | selection | rel. error mean | median | p95 | max | cosine mean | min | mass recall mean "
             "| p5 |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for f in FRACTIONS:
        for m in ("quest", "window", "oracle"):
            d = rp[f"{m}/{f}"]
            r, c, ms = _summary(d["rel"]), _summary(d["cos"]), _summary(d["mass"])
            name = {"quest": "**Quest (engine)**", "window": "window", "oracle": "oracle"}[m]
            lines.append(f"| 1/{f} | {name} | {r['mean']:.4f} | {r['median']:.4f} | {r['p95']:.4f} | {r['max']:.4f} | "
                         f"{c['mean']:.5f} | {c['min']:.4f} | {_pct(ms['mean'])} | {_pct(ms['p5'])} |")
    layers = sorted(int(k.removeprefix("rel_layer")) for k in rp["quest/4"] if k.startswith("rel_layer"))
    lines += ["", "Quest's mean relative error per layer:", "",
              "| budget | " + " | ".join(f"layer {i}" for i in layers) + " |", "|---|" + "---|" * len(layers)]
    for f in FRACTIONS:
        lines.append(f"| 1/{f} | " + " | ".join(f"{statistics.fmean(rp[f'quest/{f}'][f'rel_layer{i}']):.4f}"
                                              for i in layers) + " |")
    ev, qv = _summary(rp["exact_vs_float64"]["rel"]), _summary(rp["quest_vs_float64"]["rel"])
    lines += ["", f"For scale: the engine's exact output against float64 attention over the whole context, relative "
              f"error mean {ev['mean']:.1e}, max {ev['max']:.1e}; the engine's compressed output against float64 "
              f"attention over the blocks it selected, max {qv['max']:.1e} (so the window and oracle rows, computed "
              "that way, compare like with like).", ""]
    lines += ["## (c) Greedy token agreement in vLLM", "",
              f"Same engine settings and prompts as (b), {v['new_tokens']} new tokens each, greedy, float32; the "
              f"compressed budget is a fraction of the {v['prompt_tokens']}-token prompt (contexts grow to "
              f"{v['prompt_tokens'] + v['new_tokens'] - 1}). *Prefix*: index of "
              f"the first token that differs from ActiveKV exact, over {v['new_tokens']}, mean over the "
              f"{v['prompts']} prompts (the figure the 95% target is held to). *Positionwise*: share of equal "
              "positions.", "",
              "| run | budget (tokens) | prefix agreement (mean) | per prompt | positionwise (mean) | "
              "exact run's top-1 - top-2 logprob at each first difference |",
              "|---|---|---|---|---|---|"]

    def margins(a: dict[str, Any]) -> str:
        got = [f"{m:.3f}" for m in a["margins_at_divergence"] if m is not None]
        return ", ".join(got) if got else "-"

    st = v["cpu_attn_vs_exact"]
    lines.append(f"| vLLM CPU_ATTN vs ActiveKV exact (rounding floor) | - | {_pct(st['prefix_mean'])} | "
                 f"{', '.join(_pct(x) for x in st['prefix'])} | {_pct(st['positionwise_mean'])} | {margins(st)} |")
    for f in FRACTIONS:
        c = v["compressed"][str(f)]
        a = c["agreement"]
        lines.append(f"| compressed 1/{f} | {c['budget_tokens']} | **{_pct(a['prefix_mean'])}** | "
                     f"{', '.join(_pct(x) for x in a['prefix'])} | {_pct(a['positionwise_mean'])} | "
                     f"{margins(a)} |")
    c4 = v["compressed"]["4"]
    a4 = c4["agreement"]
    full = sum(x == 1.0 for x in a4["prefix"])
    lines += ["", f"Target: at least 95% at budget 1/4. Prefix agreement {_pct(a4['prefix_mean'])}: "
              + ("**met**" if a4["prefix_mean"] >= 0.95 else "**missed**")
              + f"; {full} of {len(a4['prefix'])} prompts agree on all {v['new_tokens']} tokens"
              + ("" if full == len(a4["prefix"]) else
                 (", the other first differs" if len(a4["prefix"]) - full == 1 else ", the others first differ")
                 + " where the exact run's top two tokens were "
                 + ", ".join(f"{m:.3f}" for m in a4["margins_at_divergence"] if m is not None)
                 + " nats apart")
              + f". Positionwise {_pct(a4['positionwise_mean'])}: "
              + ("met." if a4["positionwise_mean"] >= 0.95 else "missed.")
              + f" With {len(a4['prefix'])} prompts, one prompt moves the prefix mean by up to "
              f"{100 / len(a4['prefix']):.1f} points."]
    tel = c4["telemetry"]
    held = tel["compressed_context_blocks"] * v["num_kv_heads"]
    lines += ["", f"Selection telemetry of the 1/4 run: {tel['compressed_rows']} compressed layer-rows, "
              f"{tel['selected_blocks']} (KV head, block) pairs attended out of {held} held "
              f"({_pct(tel['selected_blocks'] / max(1, held))}), "
              f"{tel['union_blocks']} blocks admitted as per-row unions."]
    chk = c4.get("replay_check")
    if chk:
        n = chk["calls"]
        ref = (f"bit-equal to `tests.reference.engine.RefEngine`'s replay in {chk['reference_equal']}/{n}"
               if chk["reference_equal"] == n else
               f"within {chk['reference_max_abs_diff']:.1e} (largest absolute difference) of "
               f"`tests.reference.engine.RefEngine`'s replay, which mirrors the ATen tile path while this run used "
               f"the engine's `{chk['kernel']}` kernel")
        lines += ["", "End to end check on this model: decode steps "
                  f"{', '.join(map(str, REPLAY_STEPS))} of the 1/4 run recorded with `tools.capture` ({n} layer "
                  "forwards) and replayed on fresh engines: "
                  f"outputs bit-equal to a fresh native engine's replay in {chk['native_equal']}/{n}, "
                  f"selections equal in {chk['native_selections_equal']}/{n}; outputs {ref}; the reference's "
                  f"selections equal in {chk['reference_selections_equal']}/{n}. "
                  "(`tests/test_e2e_compressed.py` checks every step bit for bit against the reference on the tiny "
                  "random model with the ATen path.)"]
    t = v["timings_s"]
    names = {"exact_run_s": "exact run (with capture)", "replay_s": "replays for (b) and (d)",
             "cpu_attn_run_s": "CPU_ATTN run",
             **{f"compressed_1_{f}_run_s": f"compressed 1/{f} run" for f in FRACTIONS}}
    lines += ["", "Wall time on this machine, engine start-up included (the 2 cores are shared with other work, so "
              "these vary run to run): " + ", ".join(f"{names.get(k, k)} {x:.0f} s" for k, x in t.items()) + ".", ""]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.quality", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("build/tiny-trained"), help="from tools.train_tiny")
    parser.add_argument("--out", type=Path, default=Path("docs/quality.md"))
    parser.add_argument("--json", type=Path, default=Path("build/quality/quality.json"))
    parser.add_argument("--parts", default="abcd", help="subset of a, b, c, d ((b) and (c) run together)")
    parser.add_argument("--vllm-log-level", default="ERROR", help="VLLM_LOGGING_LEVEL, unless already set")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", args.vllm_log_level)
    import activekv._backend  # noqa: F401  (fails early with the build hint when not built)

    from tools.train_tiny import read_stamp

    results: dict[str, Any] = {"machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, "
                                          f"{torch.get_num_threads()} threads"}
    stamp = read_stamp(args.model)
    if stamp is not None:
        results["model"] = {"spec": stamp["spec"], "result": stamp["result"]}
    if "a" in args.parts:
        t0 = time.monotonic()
        results["needle"] = measure_needle()
        _log(f"(a) needle: {time.monotonic() - t0:.0f} s")
    if "b" in args.parts or "c" in args.parts:
        if stamp is None:
            raise SystemExit(f"{args.model} has no trained model: run `python -m tools.train_tiny {args.model}`")
        results["vllm"] = measure_vllm(str(args.model), stamp["spec"])
    if "d" in args.parts:
        results["spread"] = measure_spread()
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(results, indent=1, default=float) + "\n")
    command = "python -m tools.quality" + ("" if args.parts == "abcd" else f" --parts {args.parts}")
    args.out.write_text(render(results, command))
    print(f"wrote {args.out} and {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
