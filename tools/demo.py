"""vLLM generating with ActiveKV exact mode on a local tiny model, compared token for token with stock vLLM.

`python -m tools.demo` (what `make demo` runs) makes the tiny Llama under build/tiny-llama, generates 32 tokens
greedily for a batch of 4 prompts (37, 200, 513, 64 tokens; the two longer contexts, up to 545 tokens = 35 blocks,
exceed ActiveKV's pool of 8 blocks of 16 tokens per layer), once with stock CPU_ATTN and once with ActiveKV exact mode, one engine after the other, and
prints per prompt the tokens and whether they are equal, the forward steps vLLM counted, and ActiveKV's telemetry.

Exit status: 0 when every prompt's tokens are equal and the native engine ran (one build per vLLM step, one forward
per layer per step); 1 otherwise; 2 when ActiveKV is not built or vLLM is not patched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from tools.make_tiny_model import SPEC, make_tiny_model
from tools.vllm_run import ACTIVEKV, CPU_ATTN, EngineConfig, Generation, VllmEngine, activekv_status, make_prompts

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_MODEL_DIR = REPO_ROOT / "build" / "tiny-llama"
PROMPT_LENGTHS = (37, 200, 513, 64)
MAX_TOKENS = 32
BLOCK_SIZE = 16
EXACT = {"mode": "exact", "pool_blocks": 8, "tile_blocks": 4}


def native_ran(gen: Generation) -> tuple[bool, str]:
    """Whether the telemetry shows the native engine served every vLLM step and layer; with the evidence."""
    tel = gen.telemetry or {}
    layers, builds, forwards = tel.get("num_layers", 0), tel.get("build_calls", 0), tel.get("forward_calls", 0)
    ok = gen.steps > 0 and builds == gen.steps and forwards == layers * gen.steps and layers > 0
    return ok, f"vLLM steps {gen.steps}, native builds {builds}, native forwards {forwards} over {layers} layers"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR)
    parser.add_argument("--seed", type=int, default=0, help="prompt seed")
    parser.add_argument("--vllm-log-level", default="ERROR", help="VLLM_LOGGING_LEVEL, unless already set")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", args.vllm_log_level)  # read when vllm is first imported

    available, why = activekv_status()
    if not available:
        print(f"demo: {why}", file=sys.stderr)
        return 2
    model = str(make_tiny_model(args.model_dir))
    prompts = make_prompts(PROMPT_LENGTHS, SPEC["vocab_size"], args.seed)
    pool_tokens = EXACT["pool_blocks"] * BLOCK_SIZE
    print(f"model: {model} (tiny Llama, {SPEC['num_hidden_layers']} layers, float32)")
    print(f"prompts: {list(PROMPT_LENGTHS)} tokens, {MAX_TOKENS} new tokens each, greedy, one batch")
    print(f"ActiveKV: {json.dumps(EXACT)}, block_size {BLOCK_SIZE}: pool {pool_tokens} tokens per layer, "
          f"longest context {max(PROMPT_LENGTHS) + MAX_TOKENS} tokens")

    with VllmEngine(EngineConfig(model, backend=CPU_ATTN)) as engine:
        stock = engine.generate(prompts, MAX_TOKENS)
    with VllmEngine(EngineConfig(model, backend=ACTIVEKV, activekv=EXACT, block_size=BLOCK_SIZE)) as engine:
        ours = engine.generate(prompts, MAX_TOKENS)

    all_equal = True
    for n, want, got in zip(PROMPT_LENGTHS, stock.token_ids, ours.token_ids):
        equal = want == got
        all_equal &= equal
        print(f"\nprompt of {n} tokens: {'EQUAL' if equal else 'DIFFERENT'}")
        print(f"  CPU_ATTN: {want}")
        print(f"  ACTIVEKV: {got}")
    ran, evidence = native_ran(ours)
    print(f"\ntokens equal for all prompts: {all_equal}")
    print(f"native engine served every step: {ran} ({evidence})")
    print(f"telemetry (change over the ActiveKV run): {json.dumps(ours.telemetry, sort_keys=True)}")
    return 0 if all_equal and ran else 1


if __name__ == "__main__":
    sys.exit(main())
