"""End-to-end decode throughput: vLLM generating on the local model with ActiveKV exact mode against stock CPU_ATTN.

`python -m tools.bench_e2e [--context 8192] [--batch 8] [--new-tokens 32] [--repeats 3] [--rounds 2]
[--enforce-eager] [--json PATH]` (what `make bench-e2e` runs; `--json` also writes the rows and the run's provenance,
the data `python -m tools.docs` renders into docs/benchmarks.md). The model is the tests' tiny random Llama
(`tools/make_tiny_model.py`: 2 layers, 4 query heads, 2 KV heads, head size 32, float32) copied to
`build/tiny-llama-e2e` with `max_position_embeddings` raised to cover the context (the default RoPE has no scaling:
the weights do not depend on it). Per backend and round, one in-process vLLM engine (`tools/vllm_run.py`, greedy, in
vLLM's default compiled mode for every backend unless `--enforce-eager`, prefix caching off, `max_num_batched_tokens`
= batch x context so each batch prefills in one step): `--batch` seeded prompts of `--context` tokens submitted
together to vLLM's engine (`LLMEngine.add_request`), then `LLMEngine.step()` until they finish: the first step is the
prefill (timed alone), the next `--new-tokens` steps decode the batch, timed step by step; `--repeats` times. The
backends take turns for `--rounds` rounds (CPU_ATTN, then the five ActiveKV runs, then again), each round a fresh
engine, so that a slow spell of the machine falls on all of them rather than on one. Decode tokens/s = batch / median
decode step time over every round; the table also gives each round's median. (The decode steps are timed one by one:
a difference of whole-generation times would mix the prefill's run-to-run noise into the few decode steps.) ActiveKV
runs in exact mode at vLLM block size 16 three times: with its default options (placement in place: no pool, blocks
read where they are in vLLM's KV cache), with a pool of 256 blocks (tile 16: a batch of long contexts streams through
the pool every step) and with a pool that holds the batch's contexts; then twice at the platform's default block size
(128, what a vLLM user gets without `block_size`): default options, and a pool that holds the contexts; CPU_ATTN at
that default block size (128). The table says how many forward steps vLLM counted and, for ActiveKV, how many native
forward calls its telemetry counted (the proof the native path ran)."""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def e2e_model(context: int, new_tokens: int) -> Path:
    """The tiny model with max_position_embeddings >= context + new tokens (written once, then kept)."""
    from tools.make_tiny_model import make_tiny_model

    base = make_tiny_model(ROOT / "build" / "tiny-llama")
    out = ROOT / "build" / "tiny-llama-e2e"
    need = 1 << (context + new_tokens + 16 - 1).bit_length()
    config_path = out / "config.json"
    if config_path.exists() and json.loads(config_path.read_text())["max_position_embeddings"] >= need:
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(base, tmp)
    config = json.loads((tmp / "config.json").read_text())
    config["max_position_embeddings"] = need
    (tmp / "config.json").write_text(json.dumps(config, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def measure(model: Path, backend: str, args: argparse.Namespace, options: dict | None = None,
            block_size: int | None = None) -> dict:
    """One round of one backend at vLLM block size `block_size` (None: the platform default, 128 on CPU): a fresh
    engine, a warm-up generation, then `args.repeats` timed batches. Returns the prefill and decode step times (s) and
    the last batch's step and native forward counts."""
    from tools.vllm_run import ACTIVEKV, EngineConfig, VllmEngine, make_prompts

    config = EngineConfig(
        str(model), backend=backend, activekv=(options or {}) if backend == ACTIVEKV else None,
        block_size=block_size, max_model_len=args.context + args.new_tokens + 16,
        max_num_seqs=args.batch, kv_cache_gib=args.kv_cache_gib, max_num_batched_tokens=args.batch * args.context,
        enforce_eager=args.enforce_eager)
    prompts = make_prompts([args.context] * args.batch, vocab_size=512, seed=args.seed)
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tools.vllm_run import read_telemetry, telemetry_delta

    params = SamplingParams(temperature=0.0, max_tokens=args.new_tokens + 1, detokenize=False, ignore_eos=True)
    prefill: list[float] = []
    decode_steps: list[float] = []
    steps = native = 0
    with VllmEngine(config) as engine:
        engine.generate(prompts, 1)  # warm-up
        llm_engine = engine.llm.llm_engine
        for rep in range(args.repeats):
            for i, p in enumerate(prompts):
                llm_engine.add_request(f"bench-{rep}-{i}", TokensPrompt(prompt_token_ids=list(p)), params)
            tel0 = read_telemetry() if backend == ACTIVEKV else None
            t0 = time.perf_counter()
            llm_engine.step()
            prefill.append(time.perf_counter() - t0)
            steps = 1
            while llm_engine.has_unfinished_requests():
                t0 = time.perf_counter()
                llm_engine.step()
                decode_steps.append(time.perf_counter() - t0)
                steps += 1
            tel1 = read_telemetry() if backend == ACTIVEKV else None
            if tel0 is not None and tel1 is not None:
                native = telemetry_delta(tel0[0], tel1[0], tel1[1])["forward_calls"]
    return {"prefill": prefill, "decode": decode_steps, "steps": steps, "native_forwards": native}


def summarise(label: str, rounds: list[dict], batch: int) -> dict:
    """The rounds of one backend as a table row: medians over every round's steps, and each round's decode median."""
    decode = [t for r in rounds for t in r["decode"]]
    step_s = statistics.median(decode)
    return {"backend": label, "prefill_s": statistics.median([t for r in rounds for t in r["prefill"]]),
            "step_ms": step_s * 1e3, "tokens_per_s": batch / step_s,
            "per_round": [statistics.median(r["decode"]) * 1e3 for r in rounds],
            "steps": rounds[-1]["steps"], "native_forwards": rounds[-1]["native_forwards"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--context", type=int, default=8192, help="prompt tokens per request")
    parser.add_argument("--batch", type=int, default=8, help="requests decoded together")
    parser.add_argument("--new-tokens", type=int, default=32, help="decode tokens per request")
    parser.add_argument("--repeats", type=int, default=3, help="timed batches per round")
    parser.add_argument("--rounds", type=int, default=2, help="turns each backend takes, interleaved")
    parser.add_argument("--kv-cache-gib", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every backend eagerly (default: vLLM's compiled mode, what users get)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rows and provenance as JSON")
    args = parser.parse_args(argv)
    for name in ("context", "batch", "new_tokens", "repeats", "rounds"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from tools.vllm_run import ACTIVEKV, CPU_ATTN

    model = e2e_model(args.context, args.new_tokens)
    from tools.bench import git_commit, machine_info

    machine = machine_info()  # the load average at start, before the engines load the machine

    def whole_batch(block_size: int) -> int:  # blocks of block_size the batch's contexts fill
        return args.batch * -(-(args.context + args.new_tokens + 16) // block_size)

    # (label, backend, ActiveKV options, vLLM block size: None is the platform default, 128 on CPU)
    runs = [("CPU_ATTN (block 128)", CPU_ATTN, None, None),
            ("ACTIVEKV exact, block 128, default options (in place, no pool)", ACTIVEKV, {}, None),
            ("ACTIVEKV exact, block 16, default options (in place, no pool)", ACTIVEKV, {}, 16),
            ("ACTIVEKV exact, block 16, pool 256 blocks", ACTIVEKV, {"pool_blocks": 256}, 16),
            (f"ACTIVEKV exact, block 16, pool {whole_batch(16)} blocks (the batch's contexts)", ACTIVEKV,
             {"pool_blocks": whole_batch(16)}, 16),
            (f"ACTIVEKV exact, block 128, pool {whole_batch(128)} blocks (the batch's contexts)", ACTIVEKV,
             {"pool_blocks": whole_batch(128)}, None)]
    results: list[list[dict]] = [[] for _ in runs]
    for _ in range(args.rounds):
        for i, (_, backend, options, block_size) in enumerate(runs):
            results[i].append(measure(model, backend, args, options, block_size))
    rows = [summarise(label, results[i], args.batch) for i, (label, _, _, _) in enumerate(runs)]
    import torch
    import vllm

    result = {
        "tool": "tools.bench_e2e",
        "command": shlex.join(["python", "-m", "tools.bench_e2e", *(argv if argv is not None else sys.argv[1:])]),
        "date": time.strftime("%Y-%m-%d"), "commit": git_commit(), "machine": machine,
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "python": platform.python_version()},
        "setup": {"model": "tiny Llama: 2 layers, 4 query heads, 2 KV heads, head size 32, float32",
                  "context": args.context, "batch": args.batch, "new_tokens": args.new_tokens,
                  "repeats": args.repeats, "rounds": args.rounds,
                  "mode": "eager" if args.enforce_eager else "compiled (default)"},
        "rows": rows}
    print(markdown(result), end="")
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


def setup_line(result: dict) -> str:
    setup = result["setup"]
    return (f"{setup['model']}; context {setup['context']}, batch {setup['batch']}, {setup['new_tokens']} decode "
            f"tokens per request, {setup['repeats']} repeats x {setup['rounds']} rounds (backends interleaved); vLLM "
            f"{setup['mode']} mode")


def table(result: dict) -> list[str]:
    """One line per backend: prefill, median decode step (overall and per round), tokens/s, ratio to CPU_ATTN."""
    base = result["rows"][0]["tokens_per_s"]
    lines = ["| backend | prefill step s | decode step ms (median) | per round | decode tokens/s | / CPU_ATTN | "
             "vLLM steps (last run) | native forward calls (last run) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        per_round = " / ".join(f"{ms:.2f}" for ms in r["per_round"])
        lines.append(f"| {r['backend']} | {r['prefill_s']:.2f} | {r['step_ms']:.2f} | {per_round} | "
                     f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | {r['steps']} | "
                     f"{r['native_forwards']} |")
    return lines


def markdown(result: dict) -> str:
    """The run as the tool prints it: command, set-up and machine lines, then the table."""
    return "\n".join([f"command: `{result['command']}`",
                      f"setup: {setup_line(result)}", f"machine: {result['machine']['line']}", "",
                      *table(result)]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
