"""Where compressed mode loses: per layer, the share of a decode query's exact attention mass that the selection keeps.

    python -m tools.quality_attention [--model DIR] [--context 2048]

SmolLM2-135M-Instruct (tools/real_model.py) in transformers, float32, one forward per prompt: the 2k prompts of
`tools/quality.py` (passkey, multikey, listing), each followed by its expected answer's first tokens (teacher forcing),
so the measured queries are the answer's decode steps (the first answer token comes from the prefill, which compressed
mode computes exactly). A custom attention function sees every layer's query and key (RoPE applied, before GQA
repetition) and, for each of those decode positions and each query head, takes the exact softmax over the keys it
sees, the block-by-block mass, and the mass inside:

- `quest`: compressed mode's selection (selection.h): sink and recent blocks, then the top k other blocks per KV head
  by Quest's bound, a KV head scoring a block by the maximum of its query heads' bounds;
- `oracle`: the same sink, recent and k, the k blocks holding the most exact mass of the KV head's query heads
  (what a perfect score would choose at this budget per KV head);
- `per_qhead`: Quest's bound with each query head choosing its own k blocks;
- `fixed`: the sink and recent blocks alone.

Printed per layer, mean over positions and query heads, for block 16 at budgets 256 and 512 and block 128 at 512. No
native module is needed; this reproduces the selection rule in ATen ops, independently of the engine.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path
from typing import Any

import torch

CONFIGS = ((16, 256), (16, 512), (128, 512))  # (block size, budget tokens)
SINK_BLOCKS, RECENT_BLOCKS = 1, 2
ANSWER_TOKENS = 6
COLUMNS = ("quest", "oracle", "per_qhead", "fixed")


def kept_mass(q: torch.Tensor, k: torch.Tensor, scaling: float, block_size: int, budget: int,
              sink: int = SINK_BLOCKS, recent: int = RECENT_BLOCKS) -> torch.Tensor | None:
    """One decode query against the keys it sees: q [H, D], k [KVH, n, D] (H a multiple of KVH). Returns [H, 4], the
    exact attention mass each query head keeps under each rule of COLUMNS, or None when the context's blocks fit the
    budget (no selection)."""
    h, kvh, n = q.shape[0], k.shape[0], k.shape[1]
    g = h // kvh
    nb = math.ceil(n / block_size)
    per_head = budget // block_size
    top_k = per_head - sink - recent
    if nb <= per_head:
        return None
    p = torch.softmax((k.repeat_interleave(g, 0) @ q.unsqueeze(-1)).squeeze(-1) * scaling, dim=-1)  # [H, n]
    pad = nb * block_size - n
    kb = torch.nn.functional.pad(k, (0, 0, 0, pad), value=float("nan")).view(kvh, nb, block_size, -1)
    kmin = torch.nan_to_num(kb, nan=float("inf")).amin(2)
    kmax = torch.nan_to_num(kb, nan=float("-inf")).amax(2)
    qg = q.view(kvh, g, -1)
    bound = qg.clamp(min=0) @ kmax.transpose(1, 2) + qg.clamp(max=0) @ kmin.transpose(1, 2)  # [KVH, g, nb]
    mass = torch.nn.functional.pad(p, (0, pad)).view(h, nb, block_size).sum(-1)  # [H, nb]
    fixed = torch.zeros(nb, dtype=torch.bool)
    fixed[:sink] = True
    fixed[nb - recent:] = True

    def pick(score: torch.Tensor) -> torch.Tensor:
        idx = score.masked_fill(fixed, float("-inf")).topk(top_k, dim=-1).indices
        return torch.zeros_like(score, dtype=torch.bool).scatter_(-1, idx, True) | fixed

    rules = (pick(bound.amax(1)).repeat_interleave(g, 0), pick(mass.view(kvh, g, nb).sum(1)).repeat_interleave(g, 0),
             pick(bound.reshape(h, nb)), fixed.expand(h, nb))
    return torch.stack([(mass * m).sum(-1) for m in rules], -1)


class Recorder:
    """Collects kept_mass for the last `positions` queries of every layer's forward."""

    def __init__(self) -> None:
        self.positions = 0
        self.stats: dict[tuple[int, int, int], list[torch.Tensor]] = {}

    def __call__(self, layer: int, query: torch.Tensor, key: torch.Tensor, scaling: float) -> None:
        s, length = key.shape[2], query.shape[2]
        for t in range(length - self.positions, length):
            n = s - length + t + 1  # the keys this query sees (causal)
            for bs, budget in CONFIGS:
                kept = kept_mass(query[0, :, t].float(), key[0, :, :n].float(), scaling, bs, budget)
                if kept is not None:
                    self.stats.setdefault((bs, budget, layer), []).append(kept)

    def table(self, block_size: int, budget: int) -> list[tuple[int, torch.Tensor]]:
        return [(layer, torch.cat(v).mean(0)) for (bs, b, layer), v in sorted(self.stats.items())
                if (bs, b) == (block_size, budget)]


def measure(model_dir: Path, context: int) -> Recorder:
    from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from tools.quality import FACT_CONTEXTS, PASSKEY_STREAMS, build_cases
    from tools.quality_tasks import LISTING, MULTIKEY, PASSKEY, Builder

    rec = Recorder()

    def attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, attention_mask: Any,
                  scaling: float | None = None, dropout: float = 0.0, **kw: Any) -> Any:
        rec(module.layer_idx, query, key, scaling if scaling is not None else query.shape[-1] ** -0.5)
        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kw)

    AttentionInterface.register("activekv_quality_attention", attention)
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                 attn_implementation="activekv_quality_attention").eval()
    b = Builder(tok)
    cases = [c for c in build_cases(b, PASSKEY_STREAMS, FACT_CONTEXTS, ())
             if c.task in (PASSKEY, MULTIKEY, LISTING) and c.context == context]
    for c in cases:
        answer = " " + (", ".join(c.expected) if c.task == LISTING else c.expected[0])
        ans = b.encode(answer)[:ANSWER_TOKENS]
        rec.positions = len(ans) - 1  # the queries that predict the answer's second token on: decode steps
        with torch.no_grad():
            model(torch.tensor([list(c.prompt) + ans[:-1]]))
        print(f"measured {c.name}", file=sys.stderr, flush=True)
    return rec


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.quality_attention", description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None, help="default: make_real_model()'s output")
    parser.add_argument("--context", type=int, default=2048, help="the prompts' context length (1024 or 2048)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    if args.model is None:
        from tools.real_model import make_real_model
        args.model = make_real_model()
    rec = measure(args.model, args.context)
    for bs, budget in CONFIGS:
        rows = rec.table(bs, budget)
        print(f"\nblock {bs}, budget {budget}: attention mass kept per layer ({' | '.join(COLUMNS)})")
        for layer, m in rows:
            print(f"L{layer:02d} " + " | ".join(f"{x:.2f}" for x in m.tolist()))
        print("all " + " | ".join(f"{x:.2f}" for x in torch.stack([m for _, m in rows]).mean(0).tolist()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
