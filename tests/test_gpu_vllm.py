"""vLLM 0.32.0 end to end on a CUDA device with ActiveKV: the KV cache in pinned host memory, attended exactly through a
device pool (`make gpu-vllm-check` on the device's H200; skipped elsewhere: CI has no GPU and no CUDA vLLM).

The harness (tools/gpu_vllm_check.py) runs vLLM's pure-Python tree with the patch series applied and sets
ACTIVEKV_GPU_VLLM=1. Models: tiny random Llamas made here with transformers (2 layers, vocab 512, float32,
initializer_range 0.3 so that greedy tokens are not decided by rounding: ../shared/design/VLLM_NOTES.md), one with
GQA 4 and head size 64, one with GQA 8 and head size 128. vLLM runs eagerly (GPU_VLLM.md's settings), in float32,
which TRITON_ATTN takes, with KV blocks of 16 tokens.

Budgets: stock vLLM gets DEVICE_BUDGET bytes of KV cache (kv_cache_memory_bytes) and refuses the models' 8192-token
max_model_len; ActiveKV gets HOST_BUDGET through the same setting (its host tier, pinned CPU memory) and a device pool
of POOL_BLOCKS blocks per layer that fits DEVICE_BUDGET, far smaller than the contexts, so every step streams the
contexts through the pool tile by tile. The reference for tokens is stock TRITON_ATTN with HOST_BUDGET on the device.

Tolerances (float32 both sides; summation orders differ between Triton, the CUDA kernel and the ATen tiles):
- chosen-token logprobs: |ActiveKV - TRITON_ATTN| <= LOGPROB_TOL;
- greedy tokens equal; a prompt may diverge only at a near tie (stock's top-2 logprobs within NEAR_TIE of each other
  at that position), after which its tokens are not compared (they follow different prefixes).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not (os.environ.get("ACTIVEKV_GPU_VLLM") == "1" and torch.cuda.is_available()),
    reason="needs a CUDA device and the vLLM-on-GPU harness (make gpu-vllm-check on the device)",
)

BLOCK = 16
LAYERS = 2
VOCAB = 512
MAX_MODEL_LEN = 8192
POOL_BLOCKS = 16
TILE_BLOCKS = 4
MAX_TOKENS = 16
DEVICE_BUDGET = 2 << 20
HOST_BUDGET = 256 << 20
LOGPROB_TOL = 2e-3
NEAR_TIE = 1e-3
# name: (query heads, KV heads, head size)
MODELS = {"gqa4-d64": (8, 2, 64), "gqa8-d128": (16, 2, 128)}
BATCH8 = (1, 15, 16, 17, 32, 48, 1000, 3000)
BATCH1 = ((1,), (17,), (3000,))
EXACT = {"mode": "exact", "pool_blocks": POOL_BLOCKS, "tile_blocks": TILE_BLOCKS}
# 256 tokens per KV head: 1 sink + 13 selected + 2 recent blocks; pool: the worst-case union of one row (2 * 13 + 3).
COMPRESSED = {"mode": "compressed", "budget_tokens": 256, "sink_blocks": 1, "recent_blocks": 2, "pool_blocks": 29,
              "tile_blocks": TILE_BLOCKS}
COMPRESSED_PROMPTS = (700, 1000, 1500, 3000)

GPU_SETTINGS: dict[str, Any] = {
    "compilation_config": {"custom_ops": ["none"]},
    "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"], "gelu_and_mul_sparse": ["native"]},
    "gpu_memory_utilization": 0.2,
    "async_scheduling": False,
}


def make_model(name: str) -> str:
    heads, kv_heads, head_dim = MODELS[name]
    out = Path(os.environ.get("ACTIVEKV_GPU_VLLM_MODELS", "/tmp/activekv-gpu-vllm-models")) / name
    if (out / "model.safetensors").is_file():
        return str(out)
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=LAYERS,
                         num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                         max_position_embeddings=MAX_MODEL_LEN, initializer_range=0.3, tie_word_embeddings=False)
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(torch.float32).save_pretrained(out, safe_serialization=True)
    return str(out)


def engine(model: str, backend: str, kv_bytes: int, activekv: dict[str, Any] | None = None) -> Any:
    from tools.vllm_run import EngineConfig, VllmEngine

    return VllmEngine(EngineConfig(
        model=model, backend=backend, activekv=activekv, block_size=BLOCK, max_model_len=MAX_MODEL_LEN,
        max_num_seqs=8, max_num_batched_tokens=16384, enforce_eager=True,
        extra={**GPU_SETTINGS, "kv_cache_memory_bytes": kv_bytes}))


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    from tools.vllm_run import make_prompts

    return make_prompts(lengths, VOCAB, seed=seed)


def runs(eng: Any) -> dict[str, Any]:
    """Every workload of the exact comparison on one engine: batch 8 and each batch-1 prompt."""
    out = {"batch8": eng.generate(prompts(BATCH8, seed=1), MAX_TOKENS, logprobs=2)}
    for lengths in BATCH1:
        out[f"batch1-{lengths[0]}"] = eng.generate(prompts(lengths, seed=2), MAX_TOKENS, logprobs=2)
    return out


def compare(stock: Any, akv: Any) -> list[str]:
    """Problems between two Generations under the module's tolerances ([] when none)."""
    problems = []
    for i, (want, got) in enumerate(zip(stock.token_ids, akv.token_ids, strict=True)):
        for t, (a, b) in enumerate(zip(want, got, strict=True)):
            if a != b:
                top = sorted(stock.top_logprobs[i][t].values(), reverse=True)
                if len(top) < 2 or top[0] - top[1] > NEAR_TIE:
                    problems.append(f"prompt {i} (len {stock.prompt_lens[i]}): token {t}: {b} != {a}, no near tie")
                break
            diff = abs(stock.logprobs[i][t] - akv.logprobs[i][t])
            if not diff <= LOGPROB_TOL:
                problems.append(f"prompt {i}: token {t}: logprob differs by {diff}")
    return problems


def worker_facts(eng: Any) -> list[Any]:
    """(platform is CUDA, backend names of the attention groups, each KV cache's device, pinned flag)."""
    def facts(worker: Any) -> Any:
        from vllm.platforms import current_platform

        runner = worker.model_runner
        names = sorted({g.backend.get_name() for groups in runner.attn_groups for g in groups})
        caches = [(t.device.type, bool(t.is_pinned()) if t.device.type == "cpu" else False) for t in runner.kv_caches]
        return current_platform.is_cuda(), names, caches

    return eng.llm.collective_rpc(facts)


@pytest.fixture(scope="module", params=list(MODELS))
def exact_results(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    """Per model: stock TRITON_ATTN with HOST_BUDGET on the device, stock refused at DEVICE_BUDGET, ActiveKV exact."""
    from tools.vllm_run import ACTIVEKV

    model = make_model(request.param)
    res: dict[str, Any] = {"model": request.param}
    with engine(model, "TRITON_ATTN", HOST_BUDGET) as eng:
        res["stock_facts"] = worker_facts(eng)
        res["stock"] = runs(eng)
    try:
        with engine(model, "TRITON_ATTN", DEVICE_BUDGET):
            res["stock_small"] = None
    except ValueError as exc:
        res["stock_small"] = str(exc)
    with engine(model, ACTIVEKV, HOST_BUDGET, EXACT) as eng:
        res["akv_facts"] = worker_facts(eng)
        res["akv"] = runs(eng)
    yield res


def test_routing_and_host_tier(exact_results: dict[str, Any]) -> None:
    """ACTIVEKV is selected on the CUDA platform by vLLM's generic path, and its KV cache is pinned CPU memory; stock
    TRITON_ATTN's stays on the device."""
    [(cuda, names, caches)] = exact_results["akv_facts"]
    assert cuda and names == ["ACTIVEKV"]
    assert len(caches) == LAYERS and all(c == ("cpu", True) for c in caches), caches
    [(cuda, names, caches)] = exact_results["stock_facts"]
    assert cuda and names == ["TRITON_ATTN"] and all(c[0] == "cuda" for c in caches), caches


def test_stock_refuses_the_device_budget(exact_results: dict[str, Any]) -> None:
    """Stock vLLM cannot hold one max_model_len context in DEVICE_BUDGET: it refuses at start-up."""
    assert exact_results["stock_small"] is not None and "KV cache" in exact_results["stock_small"]


@pytest.mark.parametrize("workload", ["batch8", *(f"batch1-{n[0]}" for n in BATCH1)])
def test_exact_streaming_equals_triton(exact_results: dict[str, Any], workload: str) -> None:
    """ActiveKV exact from the host tier through a pool far smaller than the contexts (and within the device budget
    stock vLLM refused) generates stock TRITON_ATTN's greedy tokens, logprobs within LOGPROB_TOL."""
    akv = exact_results["akv"][workload]
    assert compare(exact_results["stock"][workload], akv) == []
    tel = akv.telemetry
    pool_bytes = tel["pool_capacity_blocks"] * tel["bytes_per_block"]
    assert tel["pool_blocks"] == POOL_BLOCKS and pool_bytes <= DEVICE_BUDGET


@pytest.mark.parametrize("workload", ["batch8", *(f"batch1-{n[0]}" for n in BATCH1)])
def test_exact_telemetry(exact_results: dict[str, Any], workload: str) -> None:
    """Native entries: one build per vLLM step and one forward and KV update per layer and step."""
    akv = exact_results["akv"][workload]
    tel = akv.telemetry
    assert akv.steps == MAX_TOKENS
    assert tel["build_calls"] == akv.steps
    assert tel["forward_calls"] == LAYERS * akv.steps
    assert tel["kv_update_calls"] == LAYERS * akv.steps


def _expected_stream_bytes(prompt_len: int, bytes_per_block: int) -> int:
    seqs = range(prompt_len, prompt_len + MAX_TOKENS)
    return LAYERS * bytes_per_block * sum(math.ceil(s / BLOCK) for s in seqs)


def test_exact_stream_bytes(exact_results: dict[str, Any]) -> None:
    """Batch 1, 3000-token prompt: bytes_h2d == layers x bytes per block x the blocks of every step's context."""
    akv = exact_results["akv"]["batch1-3000"]
    tel = akv.telemetry
    want = _expected_stream_bytes(3000, tel["bytes_per_block"])
    assert tel["bytes_h2d"] == want
    assert tel["blocks_admitted"] == want // tel["bytes_per_block"]
    assert tel["bytes_d2h"] > 0  # the KV updates wrote the host tier from device tensors


@pytest.fixture(scope="module")
def compressed_results() -> Iterator[dict[str, Any]]:
    from tools.vllm_run import ACTIVEKV

    model = make_model("gqa4-d64")
    res: dict[str, Any] = {}
    for kernel in ("aten", "native"):
        with engine(model, ACTIVEKV, HOST_BUDGET, {**COMPRESSED, "kernel": kernel}) as eng:
            res[kernel] = eng.generate(prompts(COMPRESSED_PROMPTS, seed=3), MAX_TOKENS, logprobs=2)
    yield res


@pytest.mark.parametrize("kernel", ["aten", "native"])
def test_compressed_selects_fewer_blocks(compressed_results: dict[str, Any], kernel: str) -> None:
    """Compressed mode runs from the host tier and each selecting decode row attends fewer blocks than its context."""
    gen = compressed_results[kernel]
    tel = gen.telemetry
    assert all(len(t) == MAX_TOKENS for t in gen.token_ids)
    assert tel["compressed_rows"] == LAYERS * len(COMPRESSED_PROMPTS) * (MAX_TOKENS - 1)
    per_head = COMPRESSED["budget_tokens"] // BLOCK
    assert tel["selected_blocks"] == tel["compressed_rows"] * MODELS["gqa4-d64"][1] * per_head
    assert tel["selected_blocks"] < tel["compressed_context_blocks"] * MODELS["gqa4-d64"][1]


def test_compressed_cuda_kernel_equals_aten(compressed_results: dict[str, Any]) -> None:
    """The CUDA kernel's compressed run gives the ATen path's tokens and logprobs within the tolerance."""
    assert compare(compressed_results["aten"], compressed_results["native"]) == []
