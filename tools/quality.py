"""Measure compressed mode's quality on the real model and write docs/quality.md with its plots.

    python -m tools.quality            # what `make quality` runs: measure, write docs/data/quality.json, render
    python -m tools.quality --quick    # 1k contexts, one budget, three engines: a few minutes, for development
    python -m tools.quality --render   # render docs/quality.md and docs/img/quality_*.png from the JSON only
    python -m tools.quality --tasks multikey,listing --budgets '16:256,512' --contexts 1024,2048
                                       # a restricted run: exact and those engines only, figures printed,
                                       # JSON to build/quality/partial.json (never the page)

SmolLM2-135M-Instruct (tools/real_model.py, float32) in vLLM 0.32.0 in this process, vLLM's default compiled mode, one
engine per configuration, one after the other: stock vLLM (CPU_ATTN, its default block 128), ActiveKV exact mode
(block 16, in place: the CPU default), and ActiveKV compressed mode at budgets 256, 512, 1024 and 2048 tokens at block
16 and 512, 1024 and 2048 at block 128 (the smallest budget a block-128 layout takes with 1 sink and 2 recent blocks:
the engine needs sink + recent + at least one selected block per KV head). Every engine gets all its prompts in one
`generate` call, greedy, NEW_TOKENS new tokens, with prefix caching on and chunked prefill: the prompts are built to
share long prefixes (tools/quality_tasks.py), which is what lets nine engines fit `make quality`'s 30 minutes on a
2-core machine. The tasks and their scoring are in tools/quality_tasks.py; compressed mode is judged against exact
mode's answers to the same prompts:

- passkey: PASSKEY_STREAMS, every engine.
- facts (multikey, splitkey, listing) and continuations: FACT_CONTEXTS and CONTINUATION_CONTEXTS, exact mode and the
  block-16 budgets.
- A prompt whose context (prompt + new tokens) fits a compressed engine's budget is not run there: a decode row
  selects only when it holds more blocks than the budget (engine/src/step_plan.cpp, `selects`), so such a row
  attends every block, as in exact mode, and its answer is exact mode's. The tables mark those cells.
- Continuations: greedy agreement with exact mode up to the first differing token, and at that token the gap between
  exact mode's logprob of its own choice and of compressed mode's (from exact's top LOGPROBS).
- CPU_ATTN against exact: per passkey prompt, equal tokens, a difference allowed only after a near tie
  (tools/real_text.py), and equal accuracy.

Then the synthetic parts through the native engine (tools/quality_synthetic.py): a planted needle against its
strength, and spread attention (a soft count over markers, uniform attention).

The JSON (docs/data/quality.json, committed) holds the command, machine, versions, commit, date, every prompt's
answer and score per engine, and the timings; the page and its plots are rendered from it alone (`--render`), and
tests/test_quality_tools.py checks that the committed page is what the committed JSON renders.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tools.quality_tasks import (
    CONTINUATION, LISTING, MULTIKEY, PASSKEY, SPLITKEY, Builder, Case, continuation, facts, passkey_sentence,
    passkey_stream, score, unique_tokens,
)

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data" / "quality.json"
PAGE = ROOT / "docs" / "quality.md"
IMG = ROOT / "docs" / "img"
PARTIAL = ROOT / "build" / "quality" / "partial.json"  # where a restricted run writes (never the page)

NEW_TOKENS = 24
LOGPROBS = 5
SINK_BLOCKS, RECENT_BLOCKS = 1, 2
DENSE_LAYERS = 0  # compressed engines' dense_layers (the engine's default); --dense-layers N measures N
BUDGETS = {16: (256, 512, 1024, 2048), 128: (512, 1024, 2048)}
# (offset of the pass key in document tokens, the contexts cut from that document): a needle serves several lengths
# at several depths (offset 1,800: about 90% of 2k, 45% of 4k, 25% of 7k). Sized for `make quality`'s 30 minutes:
# every engine computes the 7k prompt (7,144 tokens), so 4k and 7k get one prompt each, 2k three and 1k two.
PASSKEY_STREAMS: tuple[tuple[int, tuple[int, ...]], ...] = ((1800, (2048, 4096, 7168)), (900, (1024, 2048)),
                                                            (300, (1024, 2048)))
PASSKEY_SEED = 100  # needle i's key: passkey_sentence(PASSKEY_SEED + i)
FACT_CONTEXTS = (1024, 2048)
# The first needle's document, continued: its tokens are that needle's prompts' (no extra prefill).
CONTINUATION_CONTEXTS = (1024, 2048, 4096, 7168)
QUICK = {"streams": ((900, (1024,)), (500, (1024,)), (200, (1024,))), "facts": (1024,), "continuations": (1024,),
         "budgets": {16: (512,)}}
COMMON = {"max_model_len": 8192, "max_num_seqs": 32, "max_num_batched_tokens": 1024, "kv_cache_gib": 3,
          "enable_prefix_caching": True}
EXACT_RUN = "exact"
CPU_ATTN_RUN = "cpu_attn"
SHARED_MACHINE = ("The machine is shared with other engineers' builds and tests, so the timings vary from run to run "
                  "with its load.")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------------------- the runs

@dataclass(frozen=True)
class Run:
    """One engine configuration. budget None: exact mode (ActiveKV) or stock vLLM (CPU_ATTN)."""

    name: str
    backend: str
    block_size: int
    budget: int | None
    tasks: tuple[str, ...]
    dense_layers: int = DENSE_LAYERS  # compressed: the first layers attend every block

    def options(self) -> dict[str, Any] | None:
        if self.backend == "CPU_ATTN":
            return None
        if self.budget is None:
            return {"mode": "exact"}
        return {"mode": "compressed", "budget_tokens": self.budget, "sink_blocks": SINK_BLOCKS,
                "recent_blocks": RECENT_BLOCKS, "dense_layers": self.dense_layers}

    def fits(self, case: Case) -> bool:
        """Whether the case's whole context fits this compressed engine's budget (then it runs exact)."""
        return self.budget is not None and case.context <= self.budget


ALL_TASKS = (PASSKEY, MULTIKEY, SPLITKEY, LISTING, CONTINUATION)


def runs(budgets: dict[int, tuple[int, ...]], tasks: Sequence[str] = ALL_TASKS, stock: bool = True,
         dense_layers: int = DENSE_LAYERS) -> list[Run]:
    """CPU_ATTN (passkey; unless `stock` is False), exact (everything), then compressed per block size and budget:
    block 16 everything, other block sizes the passkey; each restricted to `tasks`, a run left with none dropped."""
    out = [Run(CPU_ATTN_RUN, "CPU_ATTN", 128, None, (PASSKEY,))] if stock else []
    out.append(Run(EXACT_RUN, "ACTIVEKV", 16, None, ALL_TASKS))
    for block, bs in sorted(budgets.items()):
        out += [Run(f"b{block}/{b}", "ACTIVEKV", block, b, ALL_TASKS if block == 16 else (PASSKEY,), dense_layers)
                for b in bs]
    out = [Run(r.name, r.backend, r.block_size, r.budget, tuple(t for t in r.tasks if t in tasks), r.dense_layers)
           for r in out]
    return [r for r in out if r.tasks]


def build_cases(b: Builder, streams: Sequence[tuple[int, Sequence[int]]], fact_contexts: Sequence[int],
                continuation_contexts: Sequence[int]) -> list[Case]:
    """Every prompt, seeded: passkey needles, facts documents, continuations."""
    cases = [c for i, (offset, contexts) in enumerate(streams)
             for c in passkey_stream(b, offset, contexts, NEW_TOKENS, seed=PASSKEY_SEED + i)]
    cases += [c for i, ctx in enumerate(fact_contexts) for c in facts(b, ctx, NEW_TOKENS, seed=200 + i)]
    # the first needle's document: the continuations share their tokens with its prompts
    needle = [(streams[0][0], passkey_sentence(PASSKEY_SEED)[1])]
    cases += [continuation(b, ctx, NEW_TOKENS, needle) for ctx in continuation_contexts]
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise ValueError(f"case names must be unique: {names}")
    return cases


def run_engine(model: str, run: Run, cases: Sequence[Case], tokenizer: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """Start the engine, generate for its cases (longest first), close it. Returns (the run's JSON record, {case
    name: (token ids, top logprobs per position)} for the agreement figures)."""
    from tools.real_model import answer_text
    from tools.vllm_run import EngineConfig, VllmEngine

    todo = sorted((c for c in cases if c.task in run.tasks and not run.fits(c)), key=lambda c: -len(c.prompt))
    config = EngineConfig(model, backend=run.backend, activekv=run.options(),
                          block_size=None if run.backend == "CPU_ATTN" else run.block_size, **COMMON)
    t0 = time.monotonic()
    with VllmEngine(config) as engine:
        t1 = time.monotonic()
        gen = engine.generate([list(c.prompt) for c in todo], NEW_TOKENS, logprobs=LOGPROBS, chunked=True)
        t2 = time.monotonic()
    t3 = time.monotonic()
    results, raw = {}, {}
    for i, c in enumerate(todo):
        text = answer_text(tokenizer, gen.token_ids[i])
        entry: dict[str, Any] = {"text": text, "tokens": gen.token_ids[i]}
        if c.task != CONTINUATION:
            entry["score"] = score(c, text)
        results[c.name] = entry
        raw[c.name] = (gen.token_ids[i], gen.top_logprobs[i])
    tel = gen.telemetry or {}
    record = {
        "backend": run.backend, "block_size": run.block_size, "budget": run.budget, "tasks": list(run.tasks),
        "options": run.options(), "prompts": len(todo),
        "prompt_tokens": sum(len(c.prompt) for c in todo),
        "unique_prompt_tokens": unique_tokens([c.prompt for c in todo], run.block_size),
        "steps": gen.steps, "step_tokens": gen.step_tokens, "start_s": round(t1 - t0, 1),
        "generate_s": round(t2 - t1, 1), "close_s": round(t3 - t2, 1), "results": results,
        "not_run": sorted(c.name for c in cases if c.task in run.tasks and run.fits(c)),
        "telemetry": {k: tel[k] for k in ("compressed_rows", "compressed_context_blocks", "selected_blocks")
                      if k in tel},
    }
    _log(f"{run.name}: {len(todo)} prompts, {record['unique_prompt_tokens']} prompt tokens to compute, start "
         f"{record['start_s']:.0f} s, generate {record['generate_s']:.0f} s")
    return record, raw


def first_difference(want: Sequence[int], got: Sequence[int]) -> int | None:
    """Index of the first differing token, None when equal (compared over the shorter)."""
    return next((i for i, (a, b) in enumerate(zip(want, got)) if a != b), None)


def continuation_agreement(exact: tuple[list[int], list[dict[int, float]]], got: Sequence[int]) -> dict[str, Any]:
    """Where a compressed continuation first differs from exact mode's, and how far apart exact mode held the two
    tokens there: `gap` = exact's logprob of its token - exact's logprob of compressed's token (None when that token
    is not in exact's top LOGPROBS: then the gap exceeds `gap_at_least`, exact's top-1 - its last listed), and
    `top2_gap` = exact's top-1 - top-2 (how near a tie the position was)."""
    ids, top = exact
    i = first_difference(ids, got)
    if i is None:
        return {"first_difference": None, "agreement": 1.0}
    ranked = sorted(top[i].values(), reverse=True)
    own = top[i][ids[i]]
    other = top[i].get(got[i])
    return {"first_difference": i, "agreement": i / len(ids), "top2_gap": ranked[0] - ranked[1],
            "gap": None if other is None else own - other, "gap_at_least": own - ranked[-1]}


def measure(model: Path, quick: bool, tasks: Sequence[str] = ALL_TASKS,
            budgets: dict[int, tuple[int, ...]] | None = None, contexts: Sequence[int] | None = None,
            dense_layers: int = DENSE_LAYERS) -> dict[str, Any]:
    """Every engine of `runs`, then the agreement figures; the synthetic parts; a JSON-ready dict. A restricted
    measurement (`tasks`, `budgets` or `contexts` given: the same prompts, only those tasks, budgets and context
    lengths) runs exact mode and those compressed engines only: no CPU_ATTN, no synthetic part."""
    restricted = tuple(tasks) != ALL_TASKS or budgets is not None or contexts is not None
    from transformers import AutoTokenizer

    from tools.real_text import agreement
    from tools import quality_synthetic as synthetic

    t_start = time.monotonic()
    tokenizer = AutoTokenizer.from_pretrained(model)
    b = Builder(tokenizer)
    q = QUICK if quick else {"streams": PASSKEY_STREAMS, "facts": FACT_CONTEXTS,
                             "continuations": CONTINUATION_CONTEXTS, "budgets": BUDGETS}
    cases = build_cases(b, q["streams"], q["facts"], q["continuations"])
    cases = [c for c in cases if c.task in tasks and (contexts is None or c.context in contexts)]
    if not cases:
        raise ValueError(f"no prompt of tasks {list(tasks)} at contexts {contexts}")
    plan = runs(q["budgets"] if budgets is None else budgets, tasks, stock=not restricted, dense_layers=dense_layers)
    records: dict[str, Any] = {}
    raws: dict[str, Any] = {}
    for run in plan:
        records[run.name], raws[run.name] = run_engine(str(model), run, cases, tokenizer)
    exact = records[EXACT_RUN]["results"]
    # The cells a budget covers whole are exact mode's (module docstring).
    for run in plan:
        for name in records[run.name]["not_run"]:
            records[run.name]["results"][name] = {**exact[name], "within_budget": True}
    stock = raws.get(CPU_ATTN_RUN, {})
    vs_stock = {}
    for name, (ids, top) in stock.items():
        a = agreement(ids, top, *raws[EXACT_RUN][name])
        vs_stock[name] = {"equal": a.equal, "ok": a.ok, "first_difference": a.first_difference, "gap": a.gap,
                          "max_logprob_diff": a.max_logprob_diff}
    agree: dict[str, dict[str, Any]] = {}
    for run in plan:
        if run.budget is None or CONTINUATION not in run.tasks:
            continue
        agree[run.name] = {c.name: ({"first_difference": None, "agreement": 1.0, "within_budget": True}
                                    if run.fits(c) else
                                    continuation_agreement(raws[EXACT_RUN][c.name], raws[run.name][c.name][0]))
                           for c in cases if c.task == CONTINUATION}
    t_vllm = time.monotonic() - t_start
    t0 = time.monotonic()
    syn = None if restricted else {"needle": synthetic.needle_strength(), "spread": synthetic.measure_spread()}
    t_syn = time.monotonic() - t0
    return {
        "cases": [{"name": c.name, "task": c.task, "context": c.context, "depth": c.depth,
                   "prompt_tokens": len(c.prompt), "expected": list(c.expected), "asked": c.asked} for c in cases],
        "runs": records, "cpu_attn_vs_exact": vs_stock, "continuation_agreement": agree, "synthetic": syn,
        "timings_s": {"vllm": round(t_vllm, 1), "synthetic": round(t_syn, 1),
                      "total": round(time.monotonic() - t_start, 1)},
        "quick": quick,
        "restricted": restricted,
    }


def provenance(argv: Sequence[str], dense_layers: int = DENSE_LAYERS) -> dict[str, Any]:
    import torch
    import transformers
    import vllm

    import activekv._backend as backend
    from tools.bench import git_commit, machine_info
    from tools.real_model import PACKAGE, SPEC

    return {
        "tool": "tools.quality", "command": shlex.join(["python", "-m", "tools.quality", *argv]),
        "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "machine": machine_info(),
        "versions": {"activekv": backend.__version__, "torch": torch.__version__, "vllm": vllm.__version__,
                     "transformers": transformers.__version__, "python": platform.python_version()},
        "model": {"name": "SmolLM2-135M-Instruct", "package": PACKAGE, **SPEC},
        "setup": {"new_tokens": NEW_TOKENS, "logprobs": LOGPROBS, "sink_blocks": SINK_BLOCKS,
                  "recent_blocks": RECENT_BLOCKS, "dense_layers": dense_layers, **{k: v for k, v in COMMON.items()}},
    }


# --------------------------------------------------------------------------------------------------- reading

def case_index(data: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in data["cases"]}


def run_names(data: dict[str, Any], task: str) -> list[str]:
    """The runs that answered `task`, in run order."""
    return [name for name, r in data["runs"].items() if task in r["tasks"]]


def accuracy(data: dict[str, Any], run: str, task: str, context: int | None = None) -> tuple[float, int]:
    """(mean score, number of prompts) of one run on one task, optionally at one context length."""
    cases = case_index(data)
    scores = [r["score"] for name, r in data["runs"][run]["results"].items()
              if cases[name]["task"] == task and (context is None or cases[name]["context"] == context)]
    return (statistics.fmean(scores) if scores else float("nan")), len(scores)


def contexts_of(data: dict[str, Any], task: str) -> list[int]:
    return sorted({c["context"] for c in data["cases"] if c["task"] == task})


def run_label(data: dict[str, Any], run: str) -> str:
    r = data["runs"][run]
    if r["backend"] == "CPU_ATTN":
        return "CPU_ATTN"
    if r["budget"] is None:
        return "exact"
    return f"{r['budget']} @{r['block_size']}"


def below_target(data: dict[str, Any], ratio: float = 0.95) -> list[dict[str, Any]]:
    """Every (task, run, context or None for all) where compressed mode's accuracy is below `ratio` x exact's (and
    exact's is above 0)."""
    out = []
    for task in (PASSKEY, MULTIKEY, SPLITKEY, LISTING):
        for run in run_names(data, task):
            if data["runs"][run]["budget"] is None:
                continue
            for ctx in [None, *contexts_of(data, task)]:
                want, n = accuracy(data, EXACT_RUN, task, ctx)
                got, _ = accuracy(data, run, task, ctx)
                if n and want > 0 and got < ratio * want:
                    out.append({"task": task, "run": run, "context": ctx, "exact": want, "compressed": got, "n": n})
    return out


# --------------------------------------------------------------------------------------------------- rendering

GENERATED = ("<!-- Generated by `python -m tools.quality` from docs/data/quality.json (`--render` re-renders it): "
             "change the data or tools/quality.py, then run it. -->")


def _k(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else f"{tokens / 1024:.1f}k"


def _pct(x: float) -> str:
    return "-" if x != x else f"{100 * x:.0f}%"


def _cell(data: dict[str, Any], run: str, task: str, ctx: int | None) -> str:
    acc, n = accuracy(data, run, task, ctx)
    if task == LISTING:
        return f"{_pct(acc)}"
    return f"{round(acc * n)}/{n}"


def _all_within(data: dict[str, Any], run: str, task: str, ctx: int | None) -> bool:
    cases = case_index(data)
    rs = [r for name, r in data["runs"][run]["results"].items()
          if cases[name]["task"] == task and (ctx is None or cases[name]["context"] == ctx)]
    return bool(rs) and all(r.get("within_budget") for r in rs)


def accuracy_table(data: dict[str, Any], task: str) -> list[str]:
    """Rows: context lengths and all; columns: the runs that answered the task. Cells whose prompts all fit the
    budget are marked (=)."""
    names = run_names(data, task)
    head = "| context | " + " | ".join(run_label(data, r) for r in names) + " |"
    lines = [head, "|---|" + "---|" * len(names)]
    for ctx in [*contexts_of(data, task), None]:
        cells = [_cell(data, r, task, ctx) + (" (=)" if _all_within(data, r, task, ctx) else "") for r in names]
        label = "all" if ctx is None else _k(ctx)
        if ctx is None:
            cells = [f"**{c}**" for c in cells]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    return lines


def prompt_table(data: dict[str, Any], task: str) -> list[str]:
    """One row per prompt: context, depth, what was asked; a mark per run: ✓ right, ✗ wrong, = not run (within the
    budget: exact mode's answer)."""
    names = run_names(data, task)
    lines = ["| prompt | depth | " + " | ".join(run_label(data, r) for r in names) + " |",
             "|---|---|" + "---|" * len(names)]
    for c in data["cases"]:
        if c["task"] != task:
            continue
        marks = []
        for r in names:
            res = data["runs"][r]["results"][c["name"]]
            mark = "✓" if res["score"] == 1 else ("✗" if res["score"] == 0 else f"{res['score']:.2f}")
            marks.append("=" if res.get("within_budget") else mark)
        what = _k(c["context"]) + (f", {c['asked']}" if c["asked"] else "")
        lines.append(f"| {what} | {100 * c['depth']:.0f}% | " + " | ".join(marks) + " |")
    return lines


def exact_answers(data: dict[str, Any], task: str, limit: int = 48) -> list[str]:
    """Exact mode's answer to each prompt of a task, as text (lines joined with " / ", cut), with what was
    expected."""
    out = []
    for c in data["cases"]:
        if c["task"] != task:
            continue
        lines = data["runs"][EXACT_RUN]["results"][c["name"]]["text"].strip().splitlines()
        first = " / ".join(line.strip() for line in lines if line.strip())
        first = first if len(first) <= limit else first[:limit] + "..."
        out.append(f"{_k(c['context'])} at {100 * c['depth']:.0f}%" + (f" ({c['asked']})" if c["asked"] else "")
                   + f": expected {', '.join(c['expected'])}; exact said `{first.replace('`', '')}`")
    return out


def stock_summary(data: dict[str, Any]) -> str:
    vs = data["cpu_attn_vs_exact"]
    equal = sum(v["equal"] for v in vs.values())
    ties = [v for v in vs.values() if not v["equal"]]
    acc_s, n = accuracy(data, CPU_ATTN_RUN, PASSKEY)
    acc_e, _ = accuracy(data, EXACT_RUN, PASSKEY)
    same = "equal" if acc_s == acc_e else "NOT equal"
    text = (f"Exact mode's passkey accuracy {_pct(acc_e)} and CPU_ATTN's {_pct(acc_s)} over {n} prompts: **{same}**. "
            f"Greedy tokens equal on {equal} of {len(vs)} prompts")
    if ties:
        text += ("; the others first differ at a near tie (" if all(v["ok"] for v in ties) else
                 "; **not at a near tie** on some (") + ", ".join(
            f"token {v['first_difference']}, top-1/top-2 gap {v['gap']:.1e}" for v in ties) + ")"
    worst = max(v["max_logprob_diff"] for v in vs.values())
    return text + f"; largest logprob difference before any difference {worst:.1e}."


def agreement_rows(data: dict[str, Any]) -> list[str]:
    cases = case_index(data)
    first = next(iter(data["continuation_agreement"].values()), {})
    ctxs = ", ".join(_k(cases[n]["context"]) for n in first)
    lines = [f"| budget | prefix agreement, mean | first difference per prompt ({ctxs}; of "
             f"{data['setup']['new_tokens']}) | exact's logprob gap to compressed's token there | exact's top-1 - "
             "top-2 there |", "|---|---|---|---|---|"]

    def each(v: dict[str, Any], what: str) -> str:
        if v.get("within_budget"):
            return "="
        if v["first_difference"] is None:
            return "-"
        if what == "first":
            return str(v["first_difference"])
        if what == "gap":
            return f"{v['gap']:.2f}" if v["gap"] is not None else f">{v['gap_at_least']:.1f}"
        return f"{v['top2_gap']:.2f}"

    for run, per in data["continuation_agreement"].items():
        cols = [", ".join(each(v, what) for v in per.values()) for what in ("first", "gap", "top2")]
        lines.append(f"| {run_label(data, run)} | **{_pct(mean_agreement(data, run))}** | " + " | ".join(cols) + " |")
    return lines


def mean_agreement(data: dict[str, Any], run: str) -> float:
    per = data["continuation_agreement"].get(run) or {}
    return statistics.fmean(v["agreement"] for v in per.values()) if per else float("nan")


def timing_table(data: dict[str, Any]) -> list[str]:
    lines = ["| engine | prompts | prompt tokens (computed, prefix caching) | start s | generate s |",
             "|---|---|---|---|---|"]
    for name, r in data["runs"].items():
        lines.append(f"| {run_label(data, name)} | {r['prompts']} | {r['prompt_tokens']:,} "
                     f"({r['unique_prompt_tokens']:,}) | {r['start_s']:.0f} | {r['generate_s']:.0f} |")
    return lines


def read_share(data: dict[str, Any], run: str) -> str:
    tel = data["runs"][run]["telemetry"]
    held = tel.get("compressed_context_blocks", 0) * data["model"]["num_key_value_heads"]
    if not held:
        return "-"
    return _pct(tel["selected_blocks"] / held)


def render(data: dict[str, Any]) -> str:
    """docs/quality.md from the JSON."""
    m = data["machine"]
    t = data["timings_s"]
    s = data["setup"]
    lines = [GENERATED, "", "# ActiveKV compressed mode: quality on a real model", "",
             f"SmolLM2-135M-Instruct ({data['model']['package']}, converted to float32 by `make real-model`; "
             f"{data['model']['num_hidden_layers']} layers, {data['model']['num_attention_heads']} query heads, "
             f"{data['model']['num_key_value_heads']} KV heads, head size {data['model']['head_dim']}) in vLLM "
             f"{data['versions']['vllm']} on the CPU, compiled mode, greedy, float32. Compressed mode: each decode "
             f"row whose context exceeds the budget attends, per KV head, {s['sink_blocks']} sink block, "
             f"{s['recent_blocks']} recent blocks and the top "
             f"`budget / block_size - {s['sink_blocks'] + s['recent_blocks']}` other blocks by Quest's bound "
             "(`engine/include/activekv/selection.h`), "
             + (f"in every layer but the first {s['dense_layers']}, which attend every block (option "
                f"`dense_layers` {s['dense_layers']})" if s.get("dense_layers") else
                "in every layer (option `dense_layers` 0)")
             + "; prefill runs exactly. "
             "Compressed mode is judged against exact mode's answers to the same prompts.", "",
             f"- command: `{data['command']}` (`make quality`); {'**quick run**; ' if data['quick'] else ''}"
             f"data `docs/data/quality.json`, commit {data['commit']}, {data['date']}",
             f"- machine: {m['cpu']}, {m['nproc']} cores, load average {m['load_average'][0]:.2f} at start; "
             + ", ".join(f"{k} {v}" for k, v in data["versions"].items()),
             f"- runtime: **{t['total'] / 60:.1f} min** for the tool ({t['vllm'] / 60:.1f} min for the "
             f"{len(data['runs'])} vLLM engines, {t['synthetic']:.0f} s for the synthetic part). {SHARED_MACHINE}",
             "- how it is built and scored: `tools/quality.py`, `tools/quality_tasks.py` (module docstrings)",
             "- where compressed mode loses, layer by layer, and the `dense_layers` option measured against it: "
             "`docs/quality_policy.md`", ""]
    lines += headline(data)
    lines += passkey_section(data)
    lines += retrieval_section(data)
    lines += listing_section(data)
    lines += continuation_section(data)
    lines += synthetic_section(data)
    lines += ["## Engines and time", "",
              f"One engine per configuration, one after the other; {s['new_tokens']} new tokens per prompt, prefix "
              f"caching on, chunked prefill of {s['max_num_batched_tokens']} tokens per step, "
              f"{s['kv_cache_gib']} GiB KV cache. The prompt tokens computed are what prefix caching leaves "
              "(`tools.quality_tasks.unique_tokens`); compressed mode's prefill is exact, so each engine pays it "
              "again.", ""]
    lines += timing_table(data)
    lines.append("")
    return "\n".join(lines)


def headline(data: dict[str, Any]) -> list[str]:
    out = ["## In brief", ""]
    pk = [r for r in run_names(data, PASSKEY)]
    out.append("- Passkey accuracy, all contexts: " + ", ".join(
        f"{run_label(data, r)} {_pct(accuracy(data, r, PASSKEY)[0])}" for r in pk) + ".")
    ctxs = contexts_of(data, PASSKEY)
    by_ctx = ", ".join(f"{_k(c)} {_pct(accuracy(data, EXACT_RUN, PASSKEY, c)[0])}" for c in ctxs)
    loses = accuracy(data, EXACT_RUN, PASSKEY, ctxs[-1])[0] < accuracy(data, EXACT_RUN, PASSKEY, ctxs[0])[0]
    out.append(f"- Exact mode's passkey accuracy by context: {by_ctx}"
               + (": the 135M model itself loses the key in long contexts" if loses else "")
               + "; compressed mode is judged against exact mode's answers.")
    out.append("- " + stock_summary(data))
    for task in (MULTIKEY, SPLITKEY, LISTING):
        never = accuracy(data, EXACT_RUN, task)[0] == 0
        out.append(f"- {task}: " + ", ".join(f"{run_label(data, r)} {_pct(accuracy(data, r, task)[0])}"
                                             for r in run_names(data, task))
                   + (": exact mode never answers it, so it says nothing about compressed mode." if never else "."))
    runs_c = [r for r in data["continuation_agreement"] if data["continuation_agreement"][r]]
    if runs_c:
        out.append("- Continuations, greedy agreement with exact mode up to the first difference: " + ", ".join(
            f"{run_label(data, r)} {_pct(mean_agreement(data, r))}" for r in runs_c) + ".")
    low = below_target(data)
    if low:
        out += ["", "Where compressed mode is below 95% of exact mode's accuracy (exact above 0):", "",
                "| task | engine | context | exact | compressed |", "|---|---|---|---|---|"]
        out += [f"| {x['task']} | {run_label(data, x['run'])} | {'all' if x['context'] is None else _k(x['context'])} "
                f"| {_pct(x['exact'])} | {_pct(x['compressed'])} |" for x in low]
    else:
        out.append("- Compressed mode is at or above 95% of exact mode's accuracy in every task, budget and context.")
    return out + [""]


def passkey_section(data: dict[str, Any]) -> list[str]:
    cases = [c for c in data["cases"] if c["task"] == PASSKEY]
    return [
        "## Passkey retrieval", "",
        "\"The pass key is NNNNN. Remember it. NNNNN is the pass key.\" planted between paragraphs of Python's "
        "documentation, then \"What is the pass key?\", the answer opened with \"The pass key is\"; right when the "
        f"answer's digits are the key. {len(cases)} prompts: each needle is cut at up to three context lengths, so it "
        "sits at a different depth of each (the table below gives every prompt's depth). Each cell: prompts "
        "answered right / prompts. (=): every prompt of the cell fits the budget: a decode row selects only when it "
        "holds more blocks than the budget (`engine/src/step_plan.cpp`), so compressed mode attends every block of "
        "these rows, as exact mode does; the cell is exact mode's answers, not run again.", "",
        *accuracy_table(data, PASSKEY), "",
        "![Passkey accuracy against budget](img/quality_passkey.png)", "",
        "Per prompt (✓ right, ✗ wrong, = within the budget):", "",
        *prompt_table(data, PASSKEY), "",
        "Exact mode's answers:", "",
        *[f"- {x}" for x in exact_answers(data, PASSKEY)], "",
        "Share of the held (KV head, block) pairs each compressed engine read on its compressed rows (telemetry): "
        + ", ".join(f"{run_label(data, r)} {read_share(data, r)}" for r in run_names(data, PASSKEY)
                    if data["runs"][r]["budget"] is not None) + ".", ""]


def retrieval_section(data: dict[str, Any]) -> list[str]:
    return [
        "## Harder retrieval: several keys, and a key in two halves", "",
        "One document per context holds nine planted sentences: keys for four names (\"The key for Alice is "
        "12345.\"), a six-digit code in two halves at 30% and 70% (\"The first half of the secret code is 417.\", "
        "\"The second half of the secret code is 862.\") and three fruits of the day (next section), and is asked six "
        "questions, one per prompt. multikey: one name's key (\"What is the key for Carol?\", opened with \"The key "
        "for Carol is\"); splitkey: the whole code (\"What are the first half and the second half of the secret "
        "code?\", opened with \"The first half of the secret code is\"), right when the answer's first two digit "
        "groups joined are the code. Block 16 only.", "",
        "**multikey**", "", *accuracy_table(data, MULTIKEY), "",
        *prompt_table(data, MULTIKEY), "",
        "**splitkey**", "", *accuracy_table(data, SPLITKEY), "",
        "Exact mode's answers: " + "; ".join(exact_answers(data, SPLITKEY, 80)) + ".", "",
        "![Multikey and splitkey accuracy against budget](img/quality_retrieval.png)", ""]


def listing_section(data: dict[str, Any]) -> list[str]:
    return [
        "## Aggregation: listing what is spread through the context", "",
        "The same documents: three fruits of the day at 10%, 50% and 90%, all asked at once (\"The text names three "
        "fruits of the day. Which are they?\", opened with \"The three fruits of the day are\"). Each step of the "
        "answer needs attention on several places at once, the case where top-k selection is known to lose "
        "(MagicPIG). Cell: mean share of the three fruits the answer names.", "",
        *accuracy_table(data, LISTING), "",
        "Exact mode's answers: " + "; ".join(exact_answers(data, LISTING, 80)) + ".", "",
        "![Listing accuracy against budget](img/quality_listing.png)", "",
        "The synthetic counting case below shows the mechanism on attention alone.", ""]


def continuation_section(data: dict[str, Any]) -> list[str]:
    return [
        "## Greedy agreement on long-document continuations", "",
        f"The document alone (no question: the model continues Python's documentation inside the user turn), "
        f"{data['setup']['new_tokens']} new tokens, greedy; compressed mode against exact mode. Prefix agreement: "
        "index of the first differing token over the tokens generated (100% when all agree), mean over the prompts; "
        "= marks a prompt whose context fits the budget (exact mode's tokens, counted as 100%), - one that agrees "
        "throughout. At the first difference: how many nats exact mode's logprob of its own token exceeded its "
        f"logprob of the token compressed mode chose (`>x`: not in exact's top {data['setup']['logprobs']}), and "
        "exact's top-1 - top-2 gap there (how near a tie it was).", "",
        *agreement_rows(data), "",
        "![Greedy agreement against budget](img/quality_agreement.png)", ""]


def synthetic_section(data: dict[str, Any]) -> list[str]:
    syn = data["synthetic"]
    sp = syn["spread"]
    fr = sorted(sp["uniform"], key=int, reverse=True)
    lines = [
        "## Synthetic, through the native engine", "",
        "`tools/quality_synthetic.py`, no model: the engine's selection on keys made to show one mechanism each.", "",
        "**Planted needle against its strength**: noise keys (std 0.1) and one block whose keys point along the "
        "decode query with the given length; 2 KV heads x GQA 4, head size 16, block 16, context "
        f"{syn['needle'][0]['context_tokens']} tokens, budget {syn['needle'][0]['budget_blocks']} blocks (sink 1, "
        "recent 1), the needle at random positions. Quest's bound is an upper bound, and a block of noisy keys has "
        "a large one, so a faint needle loses to noise blocks (every position of a strong needle is selected: "
        "`tests/test_selection.py`).", "",
        "| needle length | cases | recall |", "|---|---|---|",
        *[f"| {r['needle']} | {r['cases']} | {_pct(r['recall'])} |" for r in syn["needle"]], "",
        f"**Counting**: context {sp['context_tokens']} tokens, marker tokens every `period` tokens with the same key, "
        "the query matching it, values 1 on markers (coordinate 0): the exact output is the attention mass on "
        "markers, a soft count that depends on every token. Compressed mode keeps the blocks with markers first and "
        "renormalises over what it keeps, so the background it drops leaves the markers too large a share: the "
        "count is overestimated, the more the sparser the markers. **Uniform**: all keys equal, values N(0, 1); "
        "exact output = mean of all values.", "",
        "| markers | blocks with a marker | exact mass | " + " | ".join(
            f"budget 1/{f}: mass (rel. error)" for f in fr) + " |", "|---|---|---|" + "---|" * len(fr)]
    for r in sp["counting"]:
        lines.append(f"| {r['markers']} | {r['marker_blocks']} | {r['exact_mass']:.3f} | " + " | ".join(
            f"{r['budgets'][f]['mass']:.3f} ({_pct(r['budgets'][f]['rel_error'])})" for f in fr) + " |")
    lines += ["", "| uniform attention | " + " | ".join(f"budget 1/{f}" for f in fr) + " |",
              "|---|" + "---|" * len(fr),
              "| rel. error (mean over heads) | " + " | ".join(
                  f"{sp['uniform'][f]['rel_error_mean']:.2f}" for f in fr) + " |", ""]
    return lines


# ------------------------------------------------------------------------------------------------------- plots

def _plot_setup() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _budget_axis(ax: Any, budgets: Sequence[int]) -> None:
    from matplotlib.ticker import NullFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget (tokens per KV head)")
    ax.set_ylim(-0.05, 1.05)
    ax.grid(True, alpha=0.3)


def _series(data: dict[str, Any], task: str, block: int, ctx: int | None,
            value: Callable[[str], float] | None = None) -> tuple[list[int], list[float]]:
    pts = [(r["budget"], value(name) if value else accuracy(data, name, task, ctx)[0])
           for name, r in data["runs"].items() if r["budget"] is not None and r["block_size"] == block
           and task in r["tasks"]]
    return [p[0] for p in pts], [p[1] for p in pts]


def _budgets(data: dict[str, Any]) -> list[int]:
    return sorted({r["budget"] for r in data["runs"].values() if r["budget"] is not None})


def plot_passkey(data: dict[str, Any], path: Path) -> None:
    """Accuracy against budget, a panel per context and one for all: block 16 and block 128 lines, exact and
    CPU_ATTN as horizontal lines."""
    plt = _plot_setup()
    ctxs: list[int | None] = [*contexts_of(data, PASSKEY), None]
    fig, axes = plt.subplots(1, len(ctxs), figsize=(3.0 * len(ctxs), 3.4), sharey=True, squeeze=False)
    for ax, ctx in zip(axes[0], ctxs):
        for block, marker in ((16, "o"), (128, "s")):
            xs, ys = _series(data, PASSKEY, block, ctx)
            if xs:
                ax.plot(xs, ys, marker=marker, label=f"compressed, block {block}")
        ax.axhline(accuracy(data, EXACT_RUN, PASSKEY, ctx)[0], color="k", linestyle="--", label="exact")
        ax.axhline(accuracy(data, CPU_ATTN_RUN, PASSKEY, ctx)[0], color="tab:red", linestyle=":",
                   label="vLLM CPU_ATTN")
        _budget_axis(ax, _budgets(data))
        n = accuracy(data, EXACT_RUN, PASSKEY, ctx)[1]
        ax.set_title(f"{'all contexts' if ctx is None else _k(ctx) + ' context'} ({n} prompt{'s' if n > 1 else ''})",
                     fontsize=9)
    axes[0][0].set_ylabel("accuracy")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=4, frameon=False, fontsize=8.5)
    fig.suptitle("Passkey retrieval, SmolLM2-135M-Instruct in vLLM", fontsize=10)
    fig.tight_layout(rect=(0, 0.1, 1, 1))
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def _tasks_plot(data: dict[str, Any], path: Path, tasks: Sequence[str], title: str, ylabel: str) -> None:
    plt = _plot_setup()
    fig, axes = plt.subplots(1, len(tasks), figsize=(4.2 * len(tasks), 3.4), sharey=True, squeeze=False)
    for ax, task in zip(axes[0], tasks):
        for ctx, marker in zip([*contexts_of(data, task), None], "o^sv"):
            xs, ys = _series(data, task, 16, ctx)
            line = ax.plot(xs, ys, marker=marker, label=f"{'all' if ctx is None else _k(ctx)}: compressed")
            ax.axhline(accuracy(data, EXACT_RUN, task, ctx)[0], color=line[0].get_color(), linestyle="--",
                       label=f"{'all' if ctx is None else _k(ctx)}: exact")
        _budget_axis(ax, _budgets(data))
        ax.set_title(f"{task}, block 16", fontsize=9)
        ax.legend(fontsize=7.5, frameon=False)
    axes[0][0].set_ylabel(ylabel)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def plot_retrieval(data: dict[str, Any], path: Path) -> None:
    _tasks_plot(data, path, (MULTIKEY, SPLITKEY), "Harder retrieval, SmolLM2-135M-Instruct in vLLM", "accuracy")


def plot_listing(data: dict[str, Any], path: Path) -> None:
    _tasks_plot(data, path, (LISTING,), "Listing three fruits spread through the context",
                "share of the fruits named")


def plot_agreement(data: dict[str, Any], path: Path) -> None:
    plt = _plot_setup()
    fig, ax = plt.subplots(figsize=(5.2, 3.4))
    xs, ys = _series(data, CONTINUATION, 16, None, lambda name: mean_agreement(data, name))
    ax.plot(xs, ys, marker="o", label="compressed, block 16")
    _budget_axis(ax, _budgets(data))
    ax.set_ylabel("prefix agreement with exact (mean)")
    ax.legend(fontsize=8, frameon=False)
    fig.suptitle("Greedy continuations of long documents", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100, metadata={"Software": None})
    plt.close(fig)


def images(data: dict[str, Any]) -> dict[str, Callable[[Path], None]]:
    return {"quality_passkey.png": lambda p: plot_passkey(data, p),
            "quality_retrieval.png": lambda p: plot_retrieval(data, p),
            "quality_listing.png": lambda p: plot_listing(data, p),
            "quality_agreement.png": lambda p: plot_agreement(data, p)}


def write_page(data: dict[str, Any], page: Path, img: Path) -> None:
    page.write_text(render(data))
    img.mkdir(parents=True, exist_ok=True)
    for name, draw in images(data).items():
        draw(img / name)


def _tasks_arg(text: str) -> tuple[str, ...]:
    tasks = tuple(t.strip() for t in text.split(",") if t.strip())
    bad = [t for t in tasks if t not in ALL_TASKS]
    if not tasks or bad:
        raise argparse.ArgumentTypeError(f"tasks must be among {', '.join(ALL_TASKS)}, got {text!r}")
    return tuple(t for t in ALL_TASKS if t in tasks)


def _budgets_arg(text: str) -> dict[int, tuple[int, ...]]:
    out: dict[int, tuple[int, ...]] = {}
    try:
        for part in text.split():
            block, budgets = part.split(":")
            out[int(block)] = tuple(int(b) for b in budgets.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"budgets must read like '16:256,512 128:512', got {text!r}") from None
    if not out or any(b not in BUDGETS or not set(bs) <= set(BUDGETS[b]) for b, bs in out.items()):
        raise argparse.ArgumentTypeError(f"budgets must be among {BUDGETS}, got {text!r}")
    return out


def _contexts_arg(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(c) for c in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"contexts must be comma-separated token counts, got {text!r}") from None


def summary_lines(data: dict[str, Any]) -> list[str]:
    """A restricted run's figures: per task and context, exact mode's accuracy and each compressed engine's."""
    lines = []
    for task in (PASSKEY, MULTIKEY, SPLITKEY, LISTING):
        names = [r for r in run_names(data, task) if data["runs"][r]["budget"] is not None]
        if not names or not any(c["task"] == task for c in data["cases"]):
            continue
        for ctx in [*contexts_of(data, task), None]:
            cells = [f"exact {_cell(data, EXACT_RUN, task, ctx)}"] + [
                f"{run_label(data, r)} {_cell(data, r, task, ctx)}" for r in names]
            lines.append(f"{task} {'all' if ctx is None else _k(ctx)}: " + ", ".join(cells))
    for run, per in data["continuation_agreement"].items():
        lines.append(f"continuation {run_label(data, run)}: prefix agreement "
                     f"{_pct(statistics.fmean(v['agreement'] for v in per.values()))}")
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="python -m tools.quality", description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1k contexts, budget 512 at block 16 only")
    parser.add_argument("--render", action="store_true", help="render the page and plots from --json, measure nothing")
    parser.add_argument("--json", type=Path, default=DATA)
    parser.add_argument("--out", type=Path, default=PAGE)
    parser.add_argument("--img", type=Path, default=IMG)
    parser.add_argument("--model", type=Path, default=None, help="default: make_real_model()'s output")
    parser.add_argument("--vllm-log-level", default="ERROR", help="VLLM_LOGGING_LEVEL, unless already set")
    parser.add_argument("--tasks", type=_tasks_arg, default=None,
                        help=f"restrict to these tasks, comma-separated ({', '.join(ALL_TASKS)})")
    parser.add_argument("--budgets", type=_budgets_arg, default=None,
                        help="restrict the compressed engines, e.g. '16:256,512 128:512' (block:budgets)")
    parser.add_argument("--contexts", type=_contexts_arg, default=None, help="restrict to these context lengths")
    parser.add_argument("--dense-layers", type=int, default=DENSE_LAYERS,
                        help=f"compressed engines' dense_layers option (default {DENSE_LAYERS})")
    args = parser.parse_args(argv)
    restricted = args.tasks is not None or args.budgets is not None or args.contexts is not None
    if restricted and args.json == DATA:
        args.json = PARTIAL  # docs/data/quality.json holds full runs only
    if args.render:
        write_page(json.loads(args.json.read_text()), args.out, args.img)
        print(f"wrote {args.out} and {args.img}/quality_*.png from {args.json}")
        return 0
    os.environ.setdefault("VLLM_LOGGING_LEVEL", args.vllm_log_level)
    from tools.real_model import make_real_model
    from tools.vllm_run import activekv_status

    available, why = activekv_status()
    if not available:
        print(f"quality: {why}", file=sys.stderr)
        return 2
    model = args.model or make_real_model()
    data = {**provenance(argv, args.dense_layers),
            **measure(model, args.quick, args.tasks or ALL_TASKS, args.budgets, args.contexts, args.dense_layers)}
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(data, indent=1) + "\n")
    if data["restricted"]:
        print("\n".join(summary_lines(data)))
        print(f"wrote {args.json} in {data['timings_s']['total'] / 60:.1f} min (a restricted run: no page)")
        return 0
    write_page(data, args.out, args.img)
    print(f"wrote {args.json}, {args.out} and {args.img}/quality_*.png in {data['timings_s']['total'] / 60:.1f} min")
    return 0


if __name__ == "__main__":
    sys.exit(main())
