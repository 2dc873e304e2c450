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
contexts through the pool tile by tile. The references: stock TRITON_ATTN with HOST_BUDGET on the device, and ActiveKV
exact on its ATen path with a pool holding every context (RESIDENT_BLOCKS).

Tolerances (float32 model and KV everywhere; chosen-token logprobs, greedy tokens):
- against stock TRITON_ATTN, TF32_LOGPROB_TOL and TF32_NEAR_TIE. vLLM's Triton kernel
  (vllm/v1/attention/ops/triton_unified_attention.py) computes Q.K^T and P.V with `tl.dot` on float32 tiles without
  `input_precision`, which on NVIDIA sm_80+ is Triton's default "tf32" (triton/backends/nvidia/compiler.py
  default_dot_input_precision; TRITON_F32_DEFAULT unset). vLLM does not change it: VLLM_FLOAT32_MATMUL_PRECISION
  ("highest") sets torch's matmuls only (gpu_worker.py). TF32 keeps 10 of float32's 23 mantissa bits (each operand
  rounded to within 2^-11 ~ 4.9e-4 relative), so stock's scores and outputs carry ~1e-3 relative error; with
  initializer_range 0.3 the logits are large and chosen-token logprobs moved by up to 0.013 on the H200 through two
  layers. 0.05 keeps a margin of ~4x over that; a near tie is a position where stock's top two logprobs are within
  0.05, where TF32 rounding alone may flip the greedy token.
- against ActiveKV exact resident on the ATen path, FP32_LOGPROB_TOL and FP32_NEAR_TIE (1e-3): both sides are IEEE
  float32 (the CUDA kernel's FMAs; ATen's cuBLAS, no TF32 at vLLM's "highest"), only summation orders differ (tiles,
  the kernel's split); float32 rounding is 2^13 times finer than TF32's, so 1e-3 is loose for rounding and tight for
  any attention bug (a missed, stale or misplaced block moves logprobs by far more). This is the check that catches an
  exact-mode error hidden under the TF32 tolerance.
- a prompt may diverge only at a near tie of its reference, after which its tokens are not compared (they follow
  different prefixes); every other position's greedy token must be equal.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tools.vllm_run import GPU_EAGER_SETTINGS

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
RESIDENT_BLOCKS = 1024  # per layer: more than every workload's blocks together, so nothing is evicted
TF32_LOGPROB_TOL = 5e-2  # module docstring: stock TRITON_ATTN's tl.dot runs float32 as TF32
TF32_NEAR_TIE = 5e-2
FP32_LOGPROB_TOL = 1e-3  # module docstring: IEEE float32 on both sides, summation order only
FP32_NEAR_TIE = 1e-3
# name: (query heads, KV heads, head size)
MODELS = {"gqa4-d64": (8, 2, 64), "gqa8-d128": (16, 2, 128)}
BATCH8 = (1, 15, 16, 17, 32, 48, 1000, 3000)
# The last: the longest prompt max_model_len takes with MAX_TOKENS after it (test_largest_context_is_8x_stocks).
BATCH1 = ((1,), (17,), (3000,), (MAX_MODEL_LEN - MAX_TOKENS,))
EXACT = {"mode": "exact", "pool_blocks": POOL_BLOCKS, "tile_blocks": TILE_BLOCKS}
EXACT_RESIDENT = {"mode": "exact", "pool_blocks": RESIDENT_BLOCKS, "tile_blocks": TILE_BLOCKS, "kernel": "aten"}
# 256 tokens per KV head: 1 sink + 13 selected + 2 recent blocks; pool: the worst-case union of one row (2 * 13 + 3).
COMPRESSED = {"mode": "compressed", "budget_tokens": 256, "sink_blocks": 1, "recent_blocks": 2, "pool_blocks": 29,
              "tile_blocks": TILE_BLOCKS}
COMPRESSED_PROMPTS = (700, 1000, 1500, 3000)



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
        extra={**GPU_EAGER_SETTINGS, "kv_cache_memory_bytes": kv_bytes}))


def prompts(lengths: tuple[int, ...], seed: int) -> list[list[int]]:
    from tools.vllm_run import make_prompts

    return make_prompts(lengths, VOCAB, seed=seed)


def runs(eng: Any) -> dict[str, Any]:
    """Every workload of the exact comparison on one engine: batch 8 and each batch-1 prompt."""
    out = {"batch8": eng.generate(prompts(BATCH8, seed=1), MAX_TOKENS, logprobs=2)}
    for lengths in BATCH1:
        out[f"batch1-{lengths[0]}"] = eng.generate(prompts(lengths, seed=2), MAX_TOKENS, logprobs=2)
    return out


def compare(ref: Any, got: Any, logprob_tol: float, near_tie: float) -> tuple[list[str], float]:
    """Problems of Generation `got` against Generation `ref` ([] when none) and the largest chosen-token logprob
    difference seen. Greedy tokens must be equal except at a near tie of ref (its top two logprobs within near_tie),
    after which the prompt's later tokens are not compared; logprobs of equal tokens within logprob_tol."""
    problems: list[str] = []
    worst = 0.0
    for i, (want, have) in enumerate(zip(ref.token_ids, got.token_ids, strict=True)):
        for t, (a, b) in enumerate(zip(want, have, strict=True)):
            if a != b:
                top = sorted(ref.top_logprobs[i][t].values(), reverse=True)
                gap = top[0] - top[1] if len(top) >= 2 else math.inf
                if gap > near_tie:
                    problems.append(f"prompt {i} (len {ref.prompt_lens[i]}): token {t}: {b} != {a}, top-2 gap {gap}")
                break
            diff = abs(ref.logprobs[i][t] - got.logprobs[i][t])
            worst = max(worst, diff)
            if not diff <= logprob_tol:
                problems.append(f"prompt {i} (len {ref.prompt_lens[i]}): token {t}: logprob differs by {diff}")
    return problems, worst


def check(ref: Any, got: Any, logprob_tol: float, near_tie: float, what: str) -> None:
    """compare(), printed (pytest -rA keeps a passing test's output: the figures reach the log) and asserted with every
    problem in the message."""
    problems, worst = compare(ref, got, logprob_tol, near_tie)
    print(f"{what}: largest logprob difference {worst:.3e} (tolerance {logprob_tol:g}), {len(problems)} problems")
    assert not problems, f"{what}: {len(problems)} problems:\n" + "\n".join(problems)


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
    """Per model: stock TRITON_ATTN with HOST_BUDGET on the device, stock refused at DEVICE_BUDGET, ActiveKV exact
    streaming through POOL_BLOCKS, ActiveKV exact resident (ATen path, RESIDENT_BLOCKS)."""
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
    with engine(model, ACTIVEKV, HOST_BUDGET, EXACT_RESIDENT) as eng:
        res["resident"] = runs(eng)
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


def test_largest_context_is_8x_stocks(exact_results: dict[str, Any]) -> None:
    """The longest context ActiveKV attends exactly here (the last batch-1 prompt: its last decode step attends the
    prompt and every generated token but the last; compared with stock vLLM given HOST_BUDGET by the tests below) is at
    least 8x the tokens stock vLLM can schedule at DEVICE_BUDGET: whole blocks of the model's float32 K and V (every
    layer) less the null block vLLM's block pool keeps (vllm/v1/core/block_pool.py); 8.1x for gqa4-d64, 16.5x for
    gqa8-d128. ActiveKV's pool, every layer's, fits DEVICE_BUDGET (test_exact_streaming_equals_triton)."""
    _, kv_heads, head_size = MODELS[exact_results["model"]]
    stock_tokens = (DEVICE_BUDGET // (LAYERS * kv_heads * head_size * 2 * 4 * BLOCK) - 1) * BLOCK
    gen = exact_results["akv"][f"batch1-{BATCH1[-1][0]}"]
    attended = max(n + len(t) - 1 for n, t in zip(gen.prompt_lens, gen.token_ids, strict=True))
    print(f"{exact_results['model']}: stock schedules {stock_tokens} tokens at DEVICE_BUDGET; ActiveKV attended "
          f"{attended} ({attended / stock_tokens:.1f}x)")
    assert attended >= 8 * stock_tokens


@pytest.mark.parametrize("workload", ["batch8", *(f"batch1-{n[0]}" for n in BATCH1)])
def test_exact_streaming_equals_triton(exact_results: dict[str, Any], workload: str) -> None:
    """ActiveKV exact from the host tier through a pool far smaller than the contexts (and within the device budget
    stock vLLM refused) generates stock TRITON_ATTN's greedy tokens, logprobs within TF32_LOGPROB_TOL (stock's
    attention runs in TF32: module docstring)."""
    akv = exact_results["akv"][workload]
    check(exact_results["stock"][workload], akv, TF32_LOGPROB_TOL, TF32_NEAR_TIE,
          f"{exact_results['model']} {workload} ActiveKV streaming vs TRITON_ATTN")
    tel = akv.telemetry
    pool_bytes = tel["num_layers"] * tel["pool_blocks"] * tel["bytes_per_block"]  # every layer's pool
    assert tel["pool_blocks"] == POOL_BLOCKS and pool_bytes <= DEVICE_BUDGET


@pytest.mark.parametrize("workload", ["batch8", *(f"batch1-{n[0]}" for n in BATCH1)])
def test_exact_streaming_equals_resident_float32(exact_results: dict[str, Any], workload: str) -> None:
    """ActiveKV exact streaming (CUDA kernel, POOL_BLOCKS) against ActiveKV exact with every context resident (ATen
    path, RESIDENT_BLOCKS): both IEEE float32, so greedy tokens equal and logprobs within FP32_LOGPROB_TOL."""
    resident = exact_results["resident"][workload]
    check(resident, exact_results["akv"][workload], FP32_LOGPROB_TOL, FP32_NEAR_TIE,
          f"{exact_results['model']} {workload} ActiveKV streaming vs resident float32")
    tel = resident.telemetry
    assert tel["pool_blocks"] == RESIDENT_BLOCKS and tel["forward_calls"] == LAYERS * resident.steps


@pytest.mark.parametrize("workload", ["batch8", *(f"batch1-{n[0]}" for n in BATCH1)])
def test_exact_telemetry(exact_results: dict[str, Any], workload: str) -> None:
    """Native entries: one build per vLLM step and one forward and KV update per layer and step."""
    akv = exact_results["akv"][workload]
    tel = akv.telemetry
    assert akv.steps == MAX_TOKENS
    assert tel["build_calls"] == akv.steps
    assert tel["forward_calls"] == LAYERS * akv.steps
    assert tel["kv_update_calls"] == LAYERS * akv.steps


def _block_lookups(prompt_len: int) -> int:
    """Pool lookups of one request over MAX_TOKENS steps: exact mode attends every block of the context at every step
    (step k's context is prompt_len + k tokens: the prefill, then one new token per decode step), in every layer."""
    return LAYERS * sum(math.ceil(s / BLOCK) for s in range(prompt_len, prompt_len + MAX_TOKENS))


def test_exact_stream_bytes(exact_results: dict[str, Any]) -> None:
    """Batch 1, 3000-token prompt. Every lookup is a hit (the block is resident) or an admission of one block's bytes:
    blocks_admitted + blocks_hit == _block_lookups and bytes_h2d == blocks_admitted x bytes per block.

    Hits are bounded by the pool: a context of 188 blocks streams through POOL_BLOCKS (16) in LRU order, so every
    block is evicted before the next step reaches it again; only blocks resident when the generation starts can hit,
    at most POOL_BLOCKS per layer, in the prefill. They do: vLLM hands a new request the block ids the previous
    requests freed, last freed first (vllm/v1/core/block_pool.py free_blocks, "LIFO reuse"; a request's blocks are
    freed in reverse), so the prefill's first blocks are the previous request's last ones, still resident; the
    prefill's KV update writes each reused block through to its resident copy before forward reads it. Measured with
    CPU vLLM (same models, workloads, pool; gqa4-d64): this test's order gives 32 hits (16 per layer), 5998 admitted,
    98271232 bytes, as the H200; the request alone on a fresh engine gives no hit, 6030 admitted (_block_lookups),
    98795520 bytes. The resident reference admits each block at most once.
    """
    akv = exact_results["akv"]["batch1-3000"]
    tel = akv.telemetry
    lookups = _block_lookups(3000)
    print(f"{exact_results['model']} batch1-3000: lookups {lookups}, admitted {tel['blocks_admitted']}, "
          f"hits {tel['blocks_hit']}, bytes_h2d {tel['bytes_h2d']}")
    assert tel["blocks_admitted"] + tel["blocks_hit"] == lookups
    assert tel["bytes_h2d"] == tel["blocks_admitted"] * tel["bytes_per_block"]
    assert 0 <= tel["blocks_hit"] <= LAYERS * POOL_BLOCKS
    assert tel["bytes_d2h"] > 0  # the KV updates wrote the host tier from device tensors
    res = exact_results["resident"]["batch1-3000"].telemetry
    assert res["blocks_admitted"] + res["blocks_hit"] == lookups
    assert res["blocks_admitted"] <= LAYERS * math.ceil((3000 + MAX_TOKENS - 1) / BLOCK)
    assert res["bytes_h2d"] == res["blocks_admitted"] * res["bytes_per_block"]


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
    """The CUDA kernel's compressed run gives the ATen path's tokens and logprobs within the float32 tolerance (both
    IEEE float32, the same selections)."""
    check(compressed_results["aten"], compressed_results["native"], FP32_LOGPROB_TOL, FP32_NEAR_TIE,
          "compressed CUDA kernel vs ATen")
