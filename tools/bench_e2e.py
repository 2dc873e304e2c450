"""End to end on CPU: vLLM's decode tokens/s and time to first token with ActiveKV exact mode against stock CPU_ATTN.

`python -m tools.bench_e2e [--models tiny real] [--dtypes float32 bfloat16] [--block-sizes 128 16]
[--configs default pool] [--decode 4096x1 4096x8 8192x1 8192x8] [--ttft 2048 4096 7168] [--real-decode ...]
[--real-ttft ...] [--new-tokens 8] [--repeats 1] [--rounds 1] [--json PATH]` is what `make bench-e2e` runs; `--json`
also writes every row and the run's provenance (command, machine, versions, commit, date), the data
`python -m tools.docs` renders into docs/benchmarks.md. The older form `--context C --batch B` measures one decode
cell (C tokens x B rows) and no time to first token, with the rows it always had.

What runs, per model and dtype, each engine fresh, in vLLM's default compiled mode (`--enforce-eager` runs every
backend eagerly), prefix caching off, vLLM's own `max_num_batched_tokens` (4096 on CPU: a longer prompt prefills in
chunks, as a user's does; `--max-num-batched-tokens` changes it), the same KV cache (`--kv-cache-gib`) for every
backend:
- CPU_ATTN at vLLM's CPU default block size, 128 (vLLM refuses CPU_ATTN at block 16);
- ActiveKV exact at block 128 and at block 16 (`--block-sizes`) with each of `--configs`: `default`, ActiveKV's
  default options (on CPU: placement in place, no pool, blocks read where they are in vLLM's KV cache); `pool`,
  `{"placement": "pool"}` (the explicit pool of 256 blocks per layer: blocks copied into it, a batch's long
  contexts streaming through it every step); `pool-all`, a pool holding the largest cell's contexts;
  `compressed`, `{"mode": "compressed"}` with its defaults; `compressed-dense`, the same with `dense_layers` 10 (the
  first third of the real geometry's 30 layers attend every block: `docs/quality_policy.md`; real geometry only).
Models: `tiny`, the tests' tiny random Llama (`tools/make_tiny_model.py`: 2 layers, 4 query heads, 2 KV heads, head
size 32) copied to `build/tiny-llama-e2e` with `max_position_embeddings` raised to the context; `real`, a
real-model-sized geometry with random weights (SmolLM2-135M's: 30 layers, 9 query heads, 3 KV heads (GQA 3), head
size 64, hidden 576, intermediate 1536) but a vocabulary of 4096 instead of 49152, so the unembedding costs little
time (`build/real-geometry-e2e`, written once).

In each engine, after a short warm-up generation, the cells run in order of size; a cell submits its seeded prompts
together (`LLMEngine.add_request`) and steps the engine (`LLMEngine.step()`): its time to first token is the time
from submitting until every row holds its first token (for one row, the TTFT a user sees, chunked prefill included);
then the next `--new-tokens` steps, every row decoding, are timed one by one and the rows aborted. A batch-1 decode
cell also gives the TTFT of its prompt length. Decode tokens/s = batch / median decode step over the rounds; TTFT is
the median over repeats and rounds. `--rounds` interleaves the backends (CPU_ATTN, then each ActiveKV run, then
again, a fresh engine each) so that a slow spell of the machine falls on all of them; `--repeats` repeats each cell
inside an engine. Memory: the process's resident set (VmRSS) before the engine starts, its peak while it runs
(VmHWM, reset at the start through /proc/self/clear_refs) and at its end, and ActiveKV's telemetry of its pool
(pool_blocks x bytes_per_block x num_layers); ActiveKV's extra memory is its peak and end RSS growth minus
CPU_ATTN's. Each cell also records vLLM's step count and ActiveKV's native forward calls (the proof the engine ran).

The defaults, sized to finish in about 35 minutes on a 2-core AVX2 machine: 8 decode steps per cell, 1 repeat, 1
round; the tiny model runs the whole matrix (decode 4k and 8k x batch 1 and 8, TTFT 2k, 4k, 7k; default and pool at
block 128 and 16). Cut on the real geometry, where prefill dominates (float32: a 4k prompt in about 23 s, so one
batch of 8 x 8k tokens would take minutes per engine): batch 8 (`--real-decode 4096x8 8192x8` adds it), the pool
(`--real-configs default pool`), and in bfloat16 the 7k and 8k prompts (`--skip` lists what is left out; its default
says why). The JSON is rewritten after every model and dtype, `"complete": false` until the last one.
"""

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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CPU_BLOCK_SIZE = 128  # vLLM's default block size on CPU (vllm/platforms/cpu.py)
CONFIGS = ("default", "pool", "pool-all", "compressed", "compressed-dense")
DENSE_LAYERS = 10  # compressed-dense: the layers quality_policy.md measured dense
MODELS = ("tiny", "real")
DTYPES = ("float32", "bfloat16")
# The real-model-sized geometry (SmolLM2-135M's, random weights; a small vocabulary saves unembedding time).
REAL_GEOMETRY: dict[str, Any] = {
    "num_hidden_layers": 30, "hidden_size": 576, "intermediate_size": 1536, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 4096, "initializer_range": 0.02,
    "tie_word_embeddings": True,
}
MODEL_LINES = {
    "tiny": "tiny Llama: 2 layers, 4 query heads, 2 KV heads, head size 32, vocabulary 512, random weights",
    "real": "real-model-sized Llama (SmolLM2-135M's geometry): 30 layers, 9 query heads, 3 KV heads, head size 64, "
            "hidden 576, intermediate 1536, vocabulary 4096 (not 49152), random weights",
}
VOCAB = {"tiny": 512, "real": REAL_GEOMETRY["vocab_size"]}
CPU_ATTN_LABEL = "CPU_ATTN (block 128)"
# bfloat16 prefill of the real geometry on a processor without bfloat16 instructions (AVX2 only) ran at about a
# quarter of float32's speed (2048 tokens: 32 s against 8 s): its 7k and 8k prompts are left out by default.
DEFAULT_SKIP = ("real:bfloat16:7168x1", "real:bfloat16:8192x1")


def _positions(need: int) -> int:
    return 1 << (need - 1).bit_length()


def e2e_model(max_len: int) -> Path:
    """The tiny model with max_position_embeddings >= max_len (written once, then kept)."""
    from tools.make_tiny_model import make_tiny_model

    base = make_tiny_model(ROOT / "build" / "tiny-llama")
    out = ROOT / "build" / "tiny-llama-e2e"
    need = _positions(max_len)
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


def real_geometry_model(max_len: int, seed: int = 0) -> Path:
    """REAL_GEOMETRY with seeded random weights (float32) in build/real-geometry-e2e, written once per spec."""
    from tools.make_tiny_model import publish, stamp_matches

    out = ROOT / "build" / "real-geometry-e2e"
    spec = {**REAL_GEOMETRY, "max_position_embeddings": _positions(max(max_len, 8192)), "seed": seed}
    stamp = "activekv_real_geometry.json"
    files = ("config.json", "model.safetensors")
    if stamp_matches(out, stamp, spec, files):
        return out

    def write(tmp: Path) -> dict[str, Any]:
        import torch
        from transformers import LlamaConfig, LlamaForCausalLM

        fields = {k: v for k, v in spec.items() if k != "seed"}
        config = LlamaConfig(**fields)
        config.architectures = ["LlamaForCausalLM"]
        torch.manual_seed(seed)
        LlamaForCausalLM(config).to(torch.float32).eval().save_pretrained(tmp, safe_serialization=True)
        return {"spec": spec}

    return publish(out, stamp, write, files)


@dataclass
class Run:
    """One engine configuration: a backend, its ActiveKV options and vLLM's block size (None: 128, the default)."""

    config: str  # "cpu_attn" or one of CONFIGS
    block_size: int | None
    options: dict[str, Any] | None = None

    @property
    def backend(self) -> str:
        return "CPU_ATTN" if self.config == "cpu_attn" else "ACTIVEKV"

    @property
    def block(self) -> int:
        return self.block_size or CPU_BLOCK_SIZE

    def label(self) -> str:
        if self.config == "cpu_attn":
            return CPU_ATTN_LABEL
        what = {"default": "default options (in place, no pool)",
                "pool": "pool 256 blocks",
                "compressed": "default options",
                "compressed-dense": f"dense_layers {DENSE_LAYERS}"}.get(self.config)
        if self.config == "pool-all":
            what = f"pool {self.options['pool_blocks']} blocks (the batch's contexts)"  # type: ignore[index]
        mode = "compressed" if self.config.startswith("compressed") else "exact"
        return f"ACTIVEKV {mode}, block {self.block}, {what}"


@dataclass
class Cell:
    """One (context, batch) cell: `new_tokens` timed decode steps after the prefill (0: time to first token only)."""

    context: int
    batch: int
    new_tokens: int
    ttft_s: list[float] = field(default_factory=list)
    decode_ms: list[list[float]] = field(default_factory=list)  # per repeat and round, each step
    steps: int = 0
    native_forwards: int = 0


def parse_cell(text: str) -> tuple[int, int]:
    """`CONTEXTxBATCH` -> (context, batch)."""
    try:
        context, batch = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"a decode cell is CONTEXTxBATCH, e.g. 4096x8; got {text!r}") from None
    if context < 1 or batch < 1:
        raise argparse.ArgumentTypeError(f"context and batch must be at least 1, got {text!r}")
    return context, batch


def plan_cells(decode: list[tuple[int, int]], ttft: list[int], new_tokens: int) -> list[Cell]:
    """Every decode cell, and a TTFT-only cell per prompt length no batch-1 decode cell already measures; by size."""
    cells = {(c, b): Cell(c, b, new_tokens) for c, b in decode}
    for p in ttft:
        cells.setdefault((p, 1), Cell(p, 1, 0))
    return sorted(cells.values(), key=lambda c: (c.batch, c.context))


def plan_runs(configs: list[str], block_sizes: list[int], cells: list[Cell]) -> list[Run]:
    """CPU_ATTN at block 128, then each ActiveKV configuration at each block size."""
    runs = [Run("cpu_attn", None)]
    for config in configs:
        for bs in block_sizes:
            # pool-all: every row's blocks, with room for the tokens a row decodes while later rows still prefill
            whole = max(c.batch * -(-(c.context + c.new_tokens + 64) // bs) for c in cells)
            options: dict[str, Any] = {"default": {}, "pool": {"placement": "pool"},
                                       "compressed": {"mode": "compressed"}, "pool-all": {"pool_blocks": whole},
                                       "compressed-dense": {"mode": "compressed", "dense_layers": DENSE_LAYERS}}[config]
            runs.append(Run(config, None if bs == CPU_BLOCK_SIZE else bs, options))
    return runs


def _status_kib(name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(name + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak_rss() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def measure(model: Path, model_key: str, dtype: str, run: Run, cells: list[Cell], args: argparse.Namespace) -> dict:
    """One round of one engine: start it, warm it up, run every cell `args.repeats` times (appending to the cells),
    and return its memory figures (MiB) and ActiveKV's pool bytes."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from tools.vllm_run import EngineConfig, VllmEngine, make_prompts, read_telemetry, telemetry_delta

    max_batch = max(c.batch for c in cells)
    max_len = max(c.context for c in cells) + args.new_tokens + 64
    config = EngineConfig(
        str(model), backend=run.backend, activekv=run.options if run.backend == "ACTIVEKV" else None,
        block_size=run.block_size, max_model_len=max_len, max_num_seqs=max_batch, kv_cache_gib=args.kv_cache_gib,
        max_num_batched_tokens=args.max_num_batched_tokens, enforce_eager=args.enforce_eager, dtype=dtype)
    gc_collect()
    rss0 = _status_kib("VmRSS")
    peak_ok = _reset_peak_rss()
    t_start = time.perf_counter()
    with VllmEngine(config) as engine:
        start_s = time.perf_counter() - t_start
        # Warm-up: a prefill, then decode steps of one row and of the largest batch (the shapes the cells time).
        engine.generate(make_prompts([256], VOCAB[model_key], args.seed), 4)
        engine.generate(make_prompts([256] + [32] * (max_batch - 1), VOCAB[model_key], args.seed), 4)
        rss_warm = _status_kib("VmRSS")
        llm_engine = engine.llm.llm_engine
        for n, cell in enumerate(cells):
            prompts = make_prompts([cell.context] * cell.batch, VOCAB[model_key], args.seed + n)
            # Rows decode while later rows still prefill in chunks: room for those tokens, then abort after the
            # timed steps.
            params = SamplingParams(temperature=0.0, max_tokens=cell.new_tokens + 64, detokenize=False,
                                    ignore_eos=True)
            for rep in range(args.repeats):
                ids = [f"cell{n}-rep{rep}-{time.monotonic_ns()}-{i}" for i in range(cell.batch)]
                tel0 = read_telemetry() if run.backend == "ACTIVEKV" else None
                t0 = time.perf_counter()
                for rid, p in zip(ids, prompts, strict=True):
                    llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=list(p)), params)
                started: set[str] = set()
                steps = 0
                while len(started) < cell.batch:
                    for out in llm_engine.step():
                        if out.outputs and out.outputs[0].token_ids:
                            started.add(out.request_id)
                    steps += 1
                cell.ttft_s.append(time.perf_counter() - t0)
                times = []
                for _ in range(cell.new_tokens):
                    t0 = time.perf_counter()
                    llm_engine.step()
                    times.append((time.perf_counter() - t0) * 1e3)
                    steps += 1
                if times:
                    cell.decode_ms.append(times)
                llm_engine.abort_request(ids)
                while llm_engine.has_unfinished_requests():
                    llm_engine.step()
                tel1 = read_telemetry() if run.backend == "ACTIVEKV" else None
                cell.steps = steps
                if tel0 is not None and tel1 is not None:
                    cell.native_forwards = telemetry_delta(tel0[0], tel1[0], tel1[1])["forward_calls"]
        rss_end = _status_kib("VmRSS")
        peak = _status_kib("VmHWM") if peak_ok else 0
        tel = read_telemetry() if run.backend == "ACTIVEKV" else None
        info = tel[0] if tel is not None else {}
    pool_bytes = info.get("pool_blocks", 0) * info.get("bytes_per_block", 0) * info.get("num_layers", 0)
    return {"rss_before_mib": rss0 / 1024, "rss_after_warmup_mib": rss_warm / 1024, "rss_end_mib": rss_end / 1024,
            "rss_peak_mib": peak / 1024 if peak else None, "pool_bytes": pool_bytes,
            "in_place": bool(info.get("in_place", 0)), "start_s": start_s}


def gc_collect() -> None:
    import gc

    gc.collect()


def summarise_run(model_key: str, dtype: str, run: Run, cells: list[Cell], memory: list[dict],
                  elapsed_s: float) -> dict:
    """A run's JSON row: its cells' TTFT and decode figures, and its memory per round."""
    out_cells = []
    for c in cells:
        row: dict[str, Any] = {"context": c.context, "batch": c.batch, "ttft_s": statistics.median(c.ttft_s),
                               "ttft_each_s": c.ttft_s, "steps": c.steps, "native_forwards": c.native_forwards}
        if c.decode_ms:
            step = statistics.median(t for rep in c.decode_ms for t in rep)
            row.update({"new_tokens": c.new_tokens, "step_ms": step, "tokens_per_s": c.batch / (step / 1e3),
                        "per_round": [statistics.median(rep) for rep in c.decode_ms], "decode_each_ms": c.decode_ms})
        out_cells.append(row)
    return {"model": model_key, "dtype": dtype, "config": run.config, "backend": run.label(), "block_size": run.block,
            "options": run.options, "cells": out_cells, "memory": memory, "elapsed_s": elapsed_s}


def legacy_rows(result: dict) -> list[dict]:
    """The older `--context/--batch` rows (one decode cell per backend): backend, prefill_s, step_ms, tokens_per_s,
    per_round, steps, native_forwards."""
    rows = []
    for r in result["runs"]:
        c = next(c for c in r["cells"] if "tokens_per_s" in c)
        rows.append({"backend": r["backend"], "prefill_s": c["ttft_s"], "step_ms": c["step_ms"],
                     "tokens_per_s": c["tokens_per_s"], "per_round": c["per_round"], "steps": c["steps"],
                     "native_forwards": c["native_forwards"]})
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_e2e", description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, help="default: tiny real (older form: tiny)")
    parser.add_argument("--dtypes", nargs="+", choices=DTYPES, help="default: float32 bfloat16 (older form: float32)")
    parser.add_argument("--block-sizes", type=int, nargs="+", default=[CPU_BLOCK_SIZE, 16],
                        help="ActiveKV's vLLM block sizes (CPU_ATTN runs at 128)")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=["default", "pool"],
                        help="ActiveKV configurations on the tiny model")
    parser.add_argument("--real-configs", nargs="+", choices=CONFIGS, default=["default"],
                        help="ActiveKV configurations on the real geometry")
    parser.add_argument("--decode", type=parse_cell, nargs="+", metavar="CONTEXTxBATCH",
                        default=[(4096, 1), (4096, 8), (8192, 1), (8192, 8)], help="decode cells (tiny model)")
    parser.add_argument("--real-decode", type=parse_cell, nargs="+", metavar="CONTEXTxBATCH",
                        default=[(4096, 1), (8192, 1)], help="decode cells (real geometry)")
    parser.add_argument("--ttft", type=int, nargs="*", default=[2048, 4096, 7168],
                        help="prompt lengths for time to first token, batch 1 (tiny model)")
    parser.add_argument("--real-ttft", type=int, nargs="*", default=[2048, 4096, 7168],
                        help="prompt lengths for time to first token, batch 1 (real geometry)")
    parser.add_argument("--skip", nargs="*", metavar="MODEL:DTYPE:CONTEXTxBATCH", default=list(DEFAULT_SKIP),
                        help="cells left out (a TTFT prompt is CONTEXTx1); default: " + " ".join(DEFAULT_SKIP))
    parser.add_argument("--context", type=int, help="older form: one decode cell of this context (no TTFT cells)")
    parser.add_argument("--batch", type=int, help="older form: that cell's rows (default 8)")
    parser.add_argument("--new-tokens", type=int, default=8, help="timed decode steps per cell")
    parser.add_argument("--repeats", type=int, default=1, help="times each cell runs in an engine")
    parser.add_argument("--rounds", type=int, default=1, help="turns each engine takes, interleaved")
    parser.add_argument("--kv-cache-gib", type=int, default=4, help="vLLM's KV cache, the same for every backend")
    parser.add_argument("--max-num-batched-tokens", type=int, default=None,
                        help="vLLM's per-step token limit (default: vLLM's, 4096 on CPU: long prompts in chunks)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true",
                        help="run every backend eagerly (default: vLLM's compiled mode, what users get)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the rows and provenance as JSON")
    args = parser.parse_args(argv)
    for name in ("new_tokens", "repeats", "rounds", "kv_cache_gib"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if "compressed-dense" in args.configs and (args.models is None or "tiny" in args.models):
        parser.error(f"--configs compressed-dense needs a model of more than {DENSE_LAYERS} layers; the tiny model "
                     "has 2 (use --real-configs compressed-dense)")
    legacy = args.context is not None or args.batch is not None
    if legacy:
        # The older form: one decode cell, the tiny model in float32, every legacy row, prefilled in one step.
        cell = (args.context or 8192, args.batch or 8)
        args.decode, args.real_decode, args.ttft, args.real_ttft, args.skip = [cell], [cell], [], [], []
        if args.max_num_batched_tokens is None:
            args.max_num_batched_tokens = cell[0] * cell[1]
    args.models = args.models or (["tiny"] if legacy else list(MODELS))
    args.dtypes = args.dtypes or (["float32"] if legacy else list(DTYPES))
    os.environ.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    from tools.bench import git_commit, machine_info, write_json

    machine = machine_info()  # the load average at start, before the engines load the machine
    import torch
    import vllm

    command = shlex.join(["python", "-m", "tools.bench_e2e", *(argv if argv is not None else sys.argv[1:])])
    result: dict[str, Any] = {
        "tool": "tools.bench_e2e", "command": command, "date": time.strftime("%Y-%m-%d"), "commit": git_commit(),
        "machine": machine,
        "versions": {"torch": torch.__version__, "vllm": vllm.__version__, "python": platform.python_version()},
        "setup": {"models": {m: MODEL_LINES[m] for m in args.models}, "dtypes": args.dtypes,
                  "block_sizes": args.block_sizes, "configs": args.configs, "real_configs": args.real_configs,
                  "new_tokens": args.new_tokens, "repeats": args.repeats, "rounds": args.rounds,
                  "kv_cache_gib": args.kv_cache_gib, "skipped": args.skip,
                  "max_num_batched_tokens": args.max_num_batched_tokens or "vLLM's default (4096 on CPU)",
                  "mode": "eager" if args.enforce_eager else "compiled (default)"},
        "runs": [], "complete": False}
    try:
        import activekv._backend as backend

        result["versions"]["activekv"] = backend.__version__
    except ImportError:
        pass
    t_all = time.perf_counter()
    for model_key in args.models:
        decode = args.decode if model_key == "tiny" else args.real_decode
        ttft = args.ttft if model_key == "tiny" else args.real_ttft
        configs = args.configs if model_key == "tiny" else args.real_configs
        if legacy:
            configs = ["default", "pool", "pool-all"]
        template = plan_cells(decode, ttft, args.new_tokens)
        result["setup"].setdefault("cells", {})[model_key] = {
            "decode": [f"{c}x{b}" for c, b in decode], "ttft": ttft}
        max_len = max(c.context for c in template) + args.new_tokens + 64
        model = e2e_model(max_len) if model_key == "tiny" else real_geometry_model(max_len, args.seed)
        runs = plan_runs(configs, args.block_sizes, template)
        for dtype in args.dtypes:
            skip = {parse_cell(x.split(":")[2]) for x in args.skip if x.split(":")[:2] == [model_key, dtype]}
            cells = [[c for c in plan_cells(decode, ttft, args.new_tokens) if (c.context, c.batch) not in skip]
                     for _ in runs]
            memory: list[list[dict]] = [[] for _ in runs]
            elapsed = [0.0 for _ in runs]
            for _ in range(args.rounds):
                for i, run in enumerate(runs):
                    t0 = time.perf_counter()
                    memory[i].append(measure(model, model_key, dtype, run, cells[i], args))
                    elapsed[i] += time.perf_counter() - t0
                    print(f"[bench_e2e] {model_key} {dtype} {run.label()}: {elapsed[i]:.0f} s", file=sys.stderr,
                          flush=True)
            result["runs"] += [summarise_run(model_key, dtype, run, cells[i], memory[i], elapsed[i])
                               for i, run in enumerate(runs)]
            result["setup"]["elapsed_s"] = time.perf_counter() - t_all
            if args.json is not None:
                write_json(args.json, result)
    result["complete"] = True
    result["setup"]["elapsed_s"] = time.perf_counter() - t_all
    if legacy:
        result["rows"] = legacy_rows(result)
    print(markdown(result), end="")
    if args.json is not None:
        write_json(args.json, result)
    return 0


# --- tables (tools/docs.py renders these into docs/benchmarks.md) ------------------------------------------------

def column_name(config: str, block_size: int) -> str:
    """A table column's name for an ActiveKV configuration at a block size."""
    name = {"default": "default", "pool": "pool 256", "pool-all": "pool all", "compressed": "compressed",
            "compressed-dense": f"compressed dense {DENSE_LAYERS}"}[config]
    return f"{name}, block {block_size}"


def _short(run: dict) -> str:
    return column_name(run["config"], run["block_size"])


def columns(result: dict) -> list[str]:
    """The ActiveKV column names, in the order the runs were planned (the first model's)."""
    seen: list[str] = []
    for r in result["runs"]:
        if r["config"] != "cpu_attn" and _short(r) not in seen:
            seen.append(_short(r))
    return seen


def _groups(result: dict) -> list[tuple[str, str, dict, dict[str, dict]]]:
    """(model, dtype, CPU_ATTN's run, {column: ActiveKV run}) per model and dtype, in run order."""
    out: list[tuple[str, str, dict, dict[str, dict]]] = []
    for r in result["runs"]:
        if r["config"] == "cpu_attn":
            out.append((r["model"], r["dtype"], r, {}))
        elif out and (out[-1][0], out[-1][1]) == (r["model"], r["dtype"]):
            out[-1][3][_short(r)] = r
    return out


def _cell(run: dict, context: int, batch: int) -> dict | None:
    return next((c for c in run["cells"] if (c["context"], c["batch"]) == (context, batch)), None)


def decode_ratios(result: dict) -> list[tuple[str, str, int, int, str, float]]:
    """(model, dtype, context, batch, column, ActiveKV tokens/s over CPU_ATTN's) for every measured decode cell."""
    out = []
    for model, dtype, base, runs in _groups(result):
        for b in base["cells"]:
            if "tokens_per_s" not in b:
                continue
            for col, run in runs.items():
                c = _cell(run, b["context"], b["batch"])
                if c is not None and "tokens_per_s" in c:
                    out.append((model, dtype, b["context"], b["batch"], col, c["tokens_per_s"] / b["tokens_per_s"]))
    return out


def ttft_ratios(result: dict) -> list[tuple[str, str, int, str, float]]:
    """(model, dtype, prompt, column, ActiveKV TTFT over CPU_ATTN's) for every TTFT prompt (batch 1)."""
    out = []
    for model, dtype, base, runs in _groups(result):
        prompts = set(result["setup"].get("cells", {}).get(model, {}).get("ttft", []))
        for b in base["cells"]:
            if b["batch"] != 1 or b["context"] not in prompts:
                continue
            for col, run in runs.items():
                c = _cell(run, b["context"], 1)
                if c is not None:
                    out.append((model, dtype, b["context"], col, c["ttft_s"] / b["ttft_s"]))
    return out


def _k(tokens: int) -> str:
    return f"{tokens / 1024:g}k"


def decode_table(result: dict) -> list[str]:
    """Decode tokens/s: CPU_ATTN's and the spread of its timed steps (a wide one: a slow spell inside the cell),
    then each ActiveKV column's as a ratio to it (above 1: faster)."""
    cols = columns(result)
    lines = ["| model | dtype | context | batch | CPU_ATTN tokens/s | its steps ms, min-max | "
             + " | ".join(f"{c} / CPU_ATTN" for c in cols) + " |", "|---|---|---|---|---|---|" + "---|" * len(cols)]
    for model, dtype, base, runs in _groups(result):
        for b in sorted(base["cells"], key=lambda c: (c["context"], c["batch"])):
            if "tokens_per_s" not in b:
                continue
            cells = []
            for col in cols:
                c = _cell(runs[col], b["context"], b["batch"]) if col in runs else None
                cells.append(f"{c['tokens_per_s'] / b['tokens_per_s']:.2f}x" if c and "tokens_per_s" in c else "-")
            steps = [t for rep in b.get("decode_each_ms", []) for t in rep]
            spread = f"{min(steps):.1f}-{max(steps):.1f}" if steps else "-"
            lines.append(f"| {model} | {dtype} | {_k(b['context'])} | {b['batch']} | {b['tokens_per_s']:.1f} | "
                         f"{spread} | " + " | ".join(cells) + " |")
    return lines


def ttft_table(result: dict) -> list[str]:
    """Time to first token, batch 1: CPU_ATTN's in seconds, then each ActiveKV column's over it (below 1: faster)."""
    cols = columns(result)
    lines = ["| model | dtype | prompt | CPU_ATTN TTFT s | " + " | ".join(f"{c} / CPU_ATTN" for c in cols) + " |",
             "|---|---|---|---|" + "---|" * len(cols)]
    for model, dtype, base, runs in _groups(result):
        prompts = set(result["setup"].get("cells", {}).get(model, {}).get("ttft", []))
        for b in base["cells"]:
            if b["batch"] != 1 or b["context"] not in prompts:
                continue
            cells = []
            for col in cols:
                c = _cell(runs[col], b["context"], 1) if col in runs else None
                cells.append(f"{c['ttft_s'] / b['ttft_s']:.2f}x" if c else "-")
            lines.append(f"| {model} | {dtype} | {_k(b['context'])} | {b['ttft_s']:.2f} | " + " | ".join(cells) + " |")
    return lines


def _mib(memory: list[dict], key: str) -> float | None:
    vals = [m[key] - m["rss_before_mib"] for m in memory if m.get(key) is not None]
    return statistics.median(vals) if vals else None


def memory_extra(result: dict) -> list[tuple[str, str, str, int, float, float]]:
    """(model, dtype, config, block size, peak, end) per ActiveKV run: its RSS growth minus CPU_ATTN's, MiB."""
    out = []
    for model, dtype, base, runs in _groups(result):
        bp, be = _mib(base["memory"], "rss_peak_mib"), _mib(base["memory"], "rss_end_mib")
        for run in runs.values():
            p, e = _mib(run["memory"], "rss_peak_mib"), _mib(run["memory"], "rss_end_mib")
            if None not in (p, e, bp, be):
                out.append((model, dtype, run["config"], run["block_size"], p - bp, e - be))  # type: ignore[operator]
    return out


def memory_table(result: dict) -> list[str]:
    """Resident memory per model and dtype, MiB as peak / end: CPU_ATTN's growth of the process RSS over its start (its
    peak while it ran, and at its end), each ActiveKV column's difference from it, and the pool its telemetry reports
    where it has one."""
    def fmt(x: float | None, sign: str = "") -> str:
        return format(x if x is not None else float("nan"), f"{sign}.0f")

    names = columns(result)
    lines = ["| model | dtype | CPU_ATTN, block 128: RSS growth | " + " | ".join(f"{n}: extra" for n in names) + " |",
             "|" + "---|" * (3 + len(names))]
    for model, dtype, base, runs in _groups(result):
        bp, be = _mib(base["memory"], "rss_peak_mib"), _mib(base["memory"], "rss_end_mib")
        cells = {}
        for name, run in runs.items():
            p, e = _mib(run["memory"], "rss_peak_mib"), _mib(run["memory"], "rss_end_mib")
            extra_p = p - bp if p is not None and bp is not None else None
            extra_e = e - be if e is not None and be is not None else None
            pool = max(m["pool_bytes"] for m in run["memory"]) / 2**20
            cells[name] = f"{fmt(extra_p, '+')} / {fmt(extra_e, '+')}" + (f" (pool {pool:.0f})" if pool else "")
        lines.append(f"| {model} | {dtype} | {fmt(bp)} / {fmt(be)} | " + " | ".join(cells.get(n, "-") for n in names)
                     + " |")
    return lines


def table(result: dict) -> list[str]:
    """The older one-cell table (the `--context/--batch` form): one line per backend."""
    base = result["rows"][0]["tokens_per_s"]
    lines = ["| backend | prefill step s | decode step ms (median) | per round | decode tokens/s | / CPU_ATTN | "
             "vLLM steps (last run) | native forward calls (last run) |", "|---|---|---|---|---|---|---|---|"]
    for r in result["rows"]:
        per_round = " / ".join(f"{ms:.2f}" for ms in r["per_round"])
        lines.append(f"| {r['backend']} | {r['prefill_s']:.2f} | {r['step_ms']:.2f} | {per_round} | "
                     f"{r['tokens_per_s']:.1f} | {r['tokens_per_s'] / base:.2f}x | {r['steps']} | "
                     f"{r['native_forwards']} |")
    return lines


def setup_line(result: dict) -> str:
    s = result["setup"]
    return (f"{'; '.join(s['models'].values())}; {', '.join(s['dtypes'])}; {s['new_tokens']} timed decode steps "
            f"per cell, {s['repeats']} repeat(s) x {s['rounds']} round(s) (backends interleaved); KV cache "
            f"{s['kv_cache_gib']} GiB for every backend; max_num_batched_tokens {s['max_num_batched_tokens']}; vLLM "
            f"{s['mode']} mode")


def markdown(result: dict) -> str:
    """The run as the tool prints it: command, set-up and machine lines, then the tables."""
    head = [f"command: `{result['command']}`", f"setup: {setup_line(result)}",
            f"machine: {result['machine']['line']}", ""]
    if "rows" in result:
        return "\n".join([*head, *table(result)]) + "\n"
    return "\n".join([*head, "Decode tokens/s:", "", *decode_table(result), "", "Time to first token (batch 1):", "",
                      *ttft_table(result), "", "Resident memory:", "", *memory_table(result)]) + "\n"


if __name__ == "__main__":
    sys.exit(main())
