"""vLLM answering as text on a real model: stock vLLM against ActiveKV exact mode, then compressed mode.

`python -m tools.demo` (what `make demo` runs, after `make real-model`) loads SmolLM2-135M-Instruct
(build/smollm2-135m-instruct, float32) and asks two questions in its chat template, greedily, one batch:
- a chat question ("What is the capital of France?");
- a long document: Python's own documentation of `dict` (pydoc_data's "typesmapping", installed with the
  interpreter), about 3,400 tokens, with a question about it.
Four engines run one after the other in vLLM's default compiled mode: stock vLLM (CPU_ATTN), ActiveKV with its default
options (exact mode, in place in vLLM's KV cache, vLLM's block size), ActiveKV exact mode with a pool of 64 blocks of 16
tokens per layer (1,024 tokens, a third of the long context, so it streams through the pool), and ActiveKV compressed
mode (a budget of 512 tokens per KV head). Printed: each answer as text, whether both exact runs' tokens equal stock
vLLM's (tools/real_text.py: a difference counts only after a near tie), compressed mode's answer and how many of the
context's blocks it read per step, a few lines of ActiveKV's telemetry, and each engine's wall time.

Exit status: 0 when both exact runs' tokens equal stock vLLM's (near ties aside) and the native engine served every
step of both; 1 otherwise; 2 when ActiveKV is not built or vLLM is not patched.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import textwrap
import time
from pathlib import Path

from tools.real_model import DEFAULT_OUTDIR, SPEC, answer_text, chat_prompt, make_real_model
from tools.real_text import agreement, document_prompt
from tools.vllm_run import ACTIVEKV, CPU_ATTN, EngineConfig, Generation, VllmEngine, activekv_status

MAX_TOKENS = 32
BLOCK_SIZE = 16
MAX_MODEL_LEN = SPEC["max_position_embeddings"]
CHAT = "What is the capital of France?"
DOC_TOPIC = "typesmapping"
DOC_QUESTION = "In one sentence: what does dict.get(key, default) return when the key is missing?"
EXACT = {"mode": "exact", "pool_blocks": 64, "tile_blocks": 8}
COMPRESSED = {"mode": "compressed", "budget_tokens": 512, "sink_blocks": 1, "recent_blocks": 2, "pool_blocks": 96,
              "tile_blocks": 8}


def native_ran(gen: Generation) -> tuple[bool, str]:
    """Whether the telemetry shows the native engine served every vLLM step and layer; with the evidence."""
    tel = gen.telemetry or {}
    layers, builds, forwards = tel.get("num_layers", 0), tel.get("build_calls", 0), tel.get("forward_calls", 0)
    ok = gen.steps > 0 and builds == gen.steps and forwards == layers * gen.steps and layers > 0
    return ok, f"vLLM steps {gen.steps}, native builds {builds}, native forwards {forwards} over {layers} layers"


def _show(label: str, text: str) -> None:
    lines = textwrap.wrap(text.replace("\n", " "), 100) or [""]
    print(f"  {label:<22}{lines[0]}")
    for line in lines[1:]:
        print(f"  {'':<22}{line}")


def _run(config: EngineConfig, prompts: list[list[int]]) -> tuple[Generation, float]:
    start = time.monotonic()
    with VllmEngine(config) as engine:
        gen = engine.generate(prompts, MAX_TOKENS, logprobs=2)
    return gen, time.monotonic() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.demo", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_OUTDIR)
    parser.add_argument("--vllm-log-level", default="ERROR", help="VLLM_LOGGING_LEVEL, unless already set")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", args.vllm_log_level)  # read when vllm is first imported

    available, why = activekv_status()
    if not available:
        print(f"demo: {why}", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    model = make_real_model(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model)
    prompts = [chat_prompt(tokenizer, CHAT), document_prompt(tokenizer, DOC_TOPIC, DOC_QUESTION)]
    names = [f"chat ({len(prompts[0])} tokens)",
             f"long document ({len(prompts[1])} tokens: Python's documentation of dict, then a question)"]
    batched = sum(len(p) for p in prompts)
    common = {"max_model_len": MAX_MODEL_LEN, "max_num_seqs": 4, "max_num_batched_tokens": max(4096, batched)}
    pool_tokens = EXACT["pool_blocks"] * BLOCK_SIZE
    print(f"model: {model} (SmolLM2-135M-Instruct: Llama, {SPEC['num_hidden_layers']} layers, "
          f"{SPEC['num_attention_heads']} query / {SPEC['num_key_value_heads']} KV heads, float32)")
    print(f"{MAX_TOKENS} new tokens per prompt, greedy, one batch, vLLM's default compiled mode")
    print(f"ActiveKV exact: {json.dumps(EXACT)}, block {BLOCK_SIZE}: a pool of {pool_tokens} tokens per layer, "
          f"smaller than the long context")

    stock, t_stock = _run(EngineConfig(str(model), backend=CPU_ATTN, **common), prompts)
    default, t_default = _run(EngineConfig(str(model), backend=ACTIVEKV, **common), prompts)
    exact, t_exact = _run(EngineConfig(str(model), backend=ACTIVEKV, activekv=EXACT, block_size=BLOCK_SIZE, **common),
                          prompts)
    comp, t_comp = _run(EngineConfig(str(model), backend=ACTIVEKV, activekv=COMPRESSED, block_size=BLOCK_SIZE,
                                     **common), prompts)

    all_ok = True
    for i, name in enumerate(names):
        print(f"\n[{name}]")
        _show("question:", CHAT if i == 0 else f"(the document) {DOC_QUESTION}")
        _show("stock vLLM:", answer_text(tokenizer, stock.token_ids[i]))
        for label, gen in (("default", default), ("exact, pool", exact)):
            agree = agreement(stock.token_ids[i], stock.top_logprobs[i], gen.token_ids[i], gen.top_logprobs[i])
            all_ok &= agree.ok
            _show(f"ActiveKV {label}:", answer_text(tokenizer, gen.token_ids[i]))
            print(f"  {label + ' vs stock:':<22}{agree.describe()}")
        _show("ActiveKV compressed:", answer_text(tokenizer, comp.token_ids[i]))

    tel_c = comp.telemetry or {}
    kv_heads = SPEC["num_key_value_heads"]
    rows = max(tel_c.get("compressed_rows", 0), 1)
    context = tel_c.get("compressed_context_blocks", 0) / rows
    selected = tel_c.get("selected_blocks", 0) / (rows * kv_heads)
    print(f"\ncompressed mode ({json.dumps(COMPRESSED)}): each of the {tel_c.get('compressed_rows', 0)} layer-rows "
          f"over the budget read {selected:.0f} of its {context:.0f} blocks per KV head "
          f"({100 * selected / max(context, 1):.1f}%); the prefill and the rows within the budget ran exactly")
    ran_default, evidence_default = native_ran(default)
    tel_d = default.telemetry or {}
    print("\ntelemetry of the default run:")
    print(f"  {evidence_default}")
    print(f"  blocks attended in place {tel_d.get('blocks_in_place', 0)}, admitted into a pool "
          f"{tel_d.get('blocks_admitted', 0)}; {tel_d.get('bytes_h2d', 0) / 2**20:.0f} MiB copied")
    ran, evidence = native_ran(exact)
    ran &= ran_default
    tel = exact.telemetry or {}
    print("telemetry of the exact run with a pool:")
    print(f"  {evidence}")
    print(f"  blocks admitted into the pool {tel.get('blocks_admitted', 0)}, evicted {tel.get('blocks_evicted', 0)}, "
          f"hits {tel.get('blocks_hit', 0)}; {tel.get('bytes_h2d', 0) / 2**20:.0f} MiB copied into the pool")
    print(f"  tiles computed {tel.get('tiles_computed', 0)}, tokens written {tel.get('tokens_written', 0)}")
    print(f"\nwall time (start + generate): stock {t_stock:.0f} s, ActiveKV default {t_default:.0f} s, exact with a "
          f"pool {t_exact:.0f} s, compressed {t_comp:.0f} s (start-up dominates: the first engine of a fresh cache "
          "compiles the model, the later ones mostly reuse inductor's cache; speed: `make bench-e2e`)")
    print(f"exact mode equals stock vLLM (near ties aside): {all_ok}; native engine served every step: {ran}")
    return 0 if all_ok and ran else 1


if __name__ == "__main__":
    sys.exit(main())
