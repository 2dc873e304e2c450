"""End to end through vLLM 0.32.0 on the real model (SmolLM2-135M-Instruct, tools/real_model.py): real-text prompts of
up to several thousand tokens, float32, vLLM's default compiled mode.

Three in-process engines run one after the other, each once per module: stock CPU_ATTN, ActiveKV exact mode with a
pool of 64 blocks of 16 tokens (1,024 tokens per layer, smaller than the two documents), and ActiveKV compressed mode
(budget 512 tokens) under `tools.capture`. One batch of three chat turns: "What is the capital of France?", Python's
documentation of the import system (pydoc_data "import", 2,090 tokens) and of pdb ("debugger", 5,260 tokens), each
followed by a question; 12 new tokens each, greedy. Compressed mode runs the first two (its ATen path, which the
reference mirrors, prefills the 5,260-token document several times slower than the fast kernel; measured: the three
prompts took 560 s of the module's 870 s on a loaded machine).

- Stock vLLM answers the chat question with Paris (the model is the trained one, not noise).
- Exact mode's greedy tokens equal CPU_ATTN's, a difference allowed only after a near tie (tools/real_text.py), and
  the chosen tokens' logprobs agree within LOGPROB_ATOL before any difference; the contexts stream through the pool.
- Compressed mode completes; rows over the budget attend fewer blocks than their contexts hold; every layer forward of
  two decode steps (the first and the last) is replayed on a fresh `tests.reference.engine.RefEngine` with the same
  options, outputs and selections equal bit for bit (tools/capture.py says why a fresh engine replays a step).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tools.capture import Recorder, capture, replay_mismatches
from tools.real_model import CHECK_ANSWER, CHECK_QUESTION, SPEC, answer_text, chat_prompt, make_real_model
from tools.real_text import LOGPROB_ATOL, agreement, document_prompt
from tools.vllm_run import ACTIVEKV, CPU_ATTN, EngineConfig, Generation, VllmEngine, activekv_status

pytestmark = pytest.mark.vllm

MAX_TOKENS = 12
BLOCK_SIZE = 16
NUM_LAYERS = SPEC["num_hidden_layers"]
NUM_KV_HEADS = SPEC["num_key_value_heads"]
DOCUMENTS = (("import", "In one sentence: what does the import statement do first?"),
             ("debugger", "In one sentence: how do you set a breakpoint in pdb?"))
COMMON = {"max_model_len": SPEC["max_position_embeddings"], "max_num_seqs": 4, "max_num_batched_tokens": 8192}
# Both configurations give pool_blocks: placement pool, streaming through a pool smaller than the documents (the CPU
# default, placement in place, runs in tests/test_e2e_vllm.py).
EXACT = {"mode": "exact", "pool_blocks": 64, "tile_blocks": 8}
# 512 tokens = 32 blocks per KV head: 1 sink + 2 recent + 29 selected; the pool holds one row's worst-case union
# (3 KV heads x 29 + 3 = 90 blocks), not the contexts.
COMPRESSED = {"mode": "compressed", "budget_tokens": 512, "sink_blocks": 1, "recent_blocks": 2, "pool_blocks": 96,
              "tile_blocks": 8}
PER_HEAD = COMPRESSED["budget_tokens"] // BLOCK_SIZE
COMPRESSED_PROMPTS = 2


@pytest.fixture(scope="module")
def model() -> Path:
    return make_real_model()


@pytest.fixture(scope="module")
def tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model)


@pytest.fixture(scope="module")
def prompts(tokenizer: Any) -> list[list[int]]:
    return [chat_prompt(tokenizer, CHECK_QUESTION)] + [document_prompt(tokenizer, t, q) for t, q in DOCUMENTS]


@pytest.fixture(scope="module")
def stock(model: Path, prompts: list[list[int]]) -> Generation:
    with VllmEngine(EngineConfig(str(model), backend=CPU_ATTN, **COMMON)) as engine:
        return engine.generate(prompts, MAX_TOKENS, logprobs=2)


@pytest.fixture(scope="module")
def exact(model: Path, prompts: list[list[int]], stock: Generation) -> Generation:
    available, why = activekv_status()
    if not available:
        pytest.skip(why)
    config = EngineConfig(str(model), backend=ACTIVEKV, activekv=EXACT, block_size=BLOCK_SIZE, **COMMON)
    with VllmEngine(config) as engine:
        return engine.generate(prompts, MAX_TOKENS, logprobs=2)


def _aten_kernel_option() -> dict[str, str]:
    from tests.test_e2e_compressed import _aten_kernel_option as option

    return option()


@pytest.fixture(scope="module")
def compressed(model: Path, prompts: list[list[int]], exact: Generation) -> tuple[Generation, Recorder]:
    # The ATen path: the one tests/reference mirrors bit for bit.
    config = EngineConfig(str(model), backend=ACTIVEKV, activekv={**COMPRESSED, **_aten_kernel_option()},
                          block_size=BLOCK_SIZE, **COMMON)
    keep = {1, MAX_TOKENS - 1}  # step 0 is the prefill
    with VllmEngine(config) as engine, capture(keep=lambda step, plan: step in keep) as rec:
        gen = engine.generate(prompts[:COMPRESSED_PROMPTS], MAX_TOKENS)
    return gen, rec


def test_the_prompts_are_long_real_text(prompts: list[list[int]]) -> None:
    lengths = [len(p) for p in prompts]
    assert lengths[0] < 64 and min(lengths[1:]) > 2000 and max(lengths) > 5000
    assert max(lengths) + MAX_TOKENS <= SPEC["max_position_embeddings"]
    assert min(lengths[1:]) > EXACT["pool_blocks"] * BLOCK_SIZE  # the documents do not fit the exact pool


def test_stock_vllm_answers_the_chat_question(stock: Generation, tokenizer: Any) -> None:
    assert CHECK_ANSWER in answer_text(tokenizer, stock.token_ids[0])


def test_exact_tokens_equal_cpu_attn_near_ties_aside(stock: Generation, exact: Generation,
                                                     prompts: list[list[int]]) -> None:
    assert [len(t) for t in exact.token_ids] == [MAX_TOKENS] * len(prompts)
    for i, n in enumerate(len(p) for p in prompts):
        agree = agreement(stock.token_ids[i], stock.top_logprobs[i], exact.token_ids[i], exact.top_logprobs[i])
        assert agree.ok, f"prompt {i} ({n} tokens): {agree.describe()}"
        assert agree.max_logprob_diff <= LOGPROB_ATOL


def test_exact_streams_the_documents_through_the_pool(exact: Generation) -> None:
    tel = exact.telemetry
    assert tel is not None
    assert tel["num_layers"] == NUM_LAYERS and tel["pool_blocks"] == EXACT["pool_blocks"]
    assert exact.steps == MAX_TOKENS
    assert tel["build_calls"] == exact.steps and tel["forward_calls"] == NUM_LAYERS * exact.steps
    assert tel["blocks_admitted"] > 0 and tel["blocks_evicted"] > 0


def test_compressed_completes_and_reads_fewer_blocks(compressed: tuple[Generation, Recorder],
                                                     prompts: list[list[int]]) -> None:
    gen, rec = compressed
    assert [len(t) for t in gen.token_ids] == [MAX_TOKENS] * COMPRESSED_PROMPTS
    tel = gen.telemetry
    assert tel is not None
    long_rows = sum(len(p) > COMPRESSED["budget_tokens"] for p in prompts[:COMPRESSED_PROMPTS])
    assert long_rows == 1
    assert tel["compressed_rows"] == NUM_LAYERS * long_rows * (MAX_TOKENS - 1)
    assert tel["selected_blocks"] == tel["compressed_rows"] * NUM_KV_HEADS * PER_HEAD
    assert 0 < tel["selected_blocks"] < tel["compressed_context_blocks"] * NUM_KV_HEADS
    assert len(rec.calls) == 2 * NUM_LAYERS
    assert all(c.is_decode and c.output.abs().amax() > 0 and torch.isfinite(c.output).all() for c in rec.calls)


def test_compressed_steps_replay_on_the_reference(compressed: tuple[Generation, Recorder]) -> None:
    from tests.reference.engine import RefEngine

    _, rec = compressed
    for call in rec.calls:
        assert len(call.selection) == sum(int(n) > COMPRESSED["budget_tokens"] for n in call.seq_lens)

    def fresh() -> RefEngine:
        return RefEngine(1, SPEC["num_attention_heads"], NUM_KV_HEADS, SPEC["head_dim"], BLOCK_SIZE, torch.float32,
                         COMPRESSED["pool_blocks"], COMPRESSED["tile_blocks"], mode="compressed",
                         budget_tokens=COMPRESSED["budget_tokens"], sink_blocks=COMPRESSED["sink_blocks"],
                         recent_blocks=COMPRESSED["recent_blocks"])

    mismatches = replay_mismatches(rec.calls, fresh)
    assert not mismatches, "\n".join(mismatches[:10])
