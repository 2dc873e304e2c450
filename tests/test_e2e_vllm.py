"""End to end through vLLM 0.32.0: ActiveKV exact mode against stock CPU_ATTN on a tiny local Llama.

Each configuration runs in one in-process engine, started once per module and shut down before the next starts
(fixtures `cpu_attn_run`, `activekv_run`: placement pool through a small pool, and `in_place_run`: default options,
placement in place); the tests assert on what those runs recorded. Every engine runs in vLLM's
default mode (compiled with torch.compile, warmed up before the KV cache exists); ActiveKV runs a second time with
`enforce_eager`, the other mode users choose, against the same compiled CPU_ATTN run. The ActiveKV cases skip,
with the reason, only when `activekv._backend` does not import or vLLM lacks the ACTIVEKV backend; the CPU_ATTN
step-count check always runs.

The proof tests run `python -m tools.proof` in fresh processes (the serving process must be one that never imported
the reference): native entry counts against vLLM's step count, no import of tests.reference, and a profile of the
ActiveKV Python frames; then the control run with a planted Python frame and a planted reference import, which must
fail those checks.
"""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tools.make_tiny_model import SPEC, make_tiny_model
from tools.vllm_run import ACTIVEKV, CPU_ATTN, EngineConfig, Generation, VllmEngine, activekv_status, make_prompts

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]

PROMPT_LENGTHS = (37, 200, 513, 64)
MAX_TOKENS = 32
PROMPT_SEED = 0
NUM_LAYERS = SPEC["num_hidden_layers"]
# ActiveKV geometry: a pool of 8 blocks of 16 tokens (128 tokens) per layer, far below the longest context
# (513 + 32 tokens = 35 blocks), so exact mode must stream contexts through the pool and evict. pool_blocks given:
# placement pool, the copy-through-the-pool path (the CPU default, placement in place, runs in `in_place_run`).
BLOCK_SIZE = 16
EXACT = {"mode": "exact", "pool_blocks": 8, "tile_blocks": 4}
# Logprob tolerance (float32). Two correct float32 attentions differ only in summation order. Measured here over these
# prompts: vLLM CPU_ATTN against transformers' eager forward of the same weights, at most 2.9e-5 on the chosen tokens'
# logprobs; ActiveKV exact against CPU_ATTN, 2.3e-5. The smallest top-1/top-2 logprob margin is 0.030. 1e-3 leaves
# 30x room for rounding and stays 30x below that margin, so an error it admits could not flip a greedy token.
LOGPROB_ATOL = 1e-3


@dataclass
class StockRun:
    """CPU_ATTN generations plus the backend calls counted by wrapping vLLM's CPU_ATTN classes."""

    gen: Generation
    builds: int
    forwards: int
    forwards_without_metadata: int
    kv_updates: int


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    return make_prompts(PROMPT_LENGTHS, SPEC["vocab_size"], PROMPT_SEED)


def _counted_generate(
    engine: VllmEngine, prompts: list[list[int]], max_tokens: int, logprobs: int
) -> StockRun:
    """Generate with vLLM's CPU_ATTN builder and impl wrapped to count their calls (the engine core is in-process)."""
    from vllm.v1.attention.backends import cpu_attn

    counts = {"build": 0, "forward": 0, "forward_none": 0, "kv_update": 0}
    builder, impl = cpu_attn.CPUAttentionMetadataBuilder, cpu_attn.CPUAttentionBackendImpl
    build, forward, kv_update = builder.build, impl.forward, impl.do_kv_cache_update

    def counted_build(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["build"] += 1
        return build(self, *args, **kwargs)

    def counted_forward(self: Any, layer: Any, query: Any, key: Any, value: Any, kv_cache: Any,
                        attn_metadata: Any, *args: Any, **kwargs: Any) -> Any:
        counts["forward" if attn_metadata is not None else "forward_none"] += 1
        return forward(self, layer, query, key, value, kv_cache, attn_metadata, *args, **kwargs)

    def counted_kv_update(self: Any, *args: Any, **kwargs: Any) -> Any:
        counts["kv_update"] += 1
        return kv_update(self, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(builder, "build", counted_build)
        mp.setattr(impl, "forward", counted_forward)
        mp.setattr(impl, "do_kv_cache_update", counted_kv_update)
        gen = engine.generate(prompts, max_tokens, logprobs)
    return StockRun(gen, counts["build"], counts["forward"], counts["forward_none"], counts["kv_update"])


@pytest.fixture(scope="module")
def cpu_attn_run(tiny_model: str, prompts: list[list[int]]) -> dict[str, StockRun]:
    """Stock CPU_ATTN (vLLM's CPU default block size): the 4-prompt batch x 32 tokens, and 1 prompt x 8 tokens."""
    with VllmEngine(EngineConfig(tiny_model, backend=CPU_ATTN)) as engine:
        return {
            "batch": _counted_generate(engine, prompts, MAX_TOKENS, logprobs=2),
            "single": _counted_generate(engine, prompts[:1], 8, logprobs=1),
        }


@pytest.fixture(scope="module", params=["compiled", "eager"])
def activekv_run(request: pytest.FixtureRequest, tiny_model: str, prompts: list[list[int]],
                 cpu_attn_run: dict[str, StockRun]) -> Generation:
    """ActiveKV exact mode, pool smaller than every long context, in vLLM's default compiled mode and in eager mode;
    starts after the CPU_ATTN engine has shut down."""
    available, why = activekv_status()
    if not available:
        pytest.skip(why)
    config = EngineConfig(tiny_model, backend=ACTIVEKV, activekv=EXACT, block_size=BLOCK_SIZE,
                          enforce_eager=request.param == "eager")
    with VllmEngine(config) as engine:
        return engine.generate(prompts, MAX_TOKENS, logprobs=2)


@pytest.fixture(scope="module")
def in_place_run(tiny_model: str, prompts: list[list[int]], cpu_attn_run: dict[str, StockRun]) -> Generation:
    """ActiveKV with default options (the CPU default: placement in place, no pool), compiled mode."""
    available, why = activekv_status()
    if not available:
        pytest.skip(why)
    with VllmEngine(EngineConfig(tiny_model, backend=ACTIVEKV, activekv={}, block_size=BLOCK_SIZE)) as engine:
        return engine.generate(prompts, MAX_TOKENS, logprobs=2)


def test_in_place_default_matches_cpu_attn_and_copies_nothing(
    in_place_run: Generation, cpu_attn_run: dict[str, StockRun]
) -> None:
    stock = cpu_attn_run["batch"].gen
    for i, (got, want) in enumerate(zip(in_place_run.token_ids, stock.token_ids)):
        assert got == want, f"prompt {i} ({PROMPT_LENGTHS[i]} tokens): ActiveKV in place {got} != CPU_ATTN {want}"
    for i, (got, want) in enumerate(zip(in_place_run.logprobs, stock.logprobs)):
        worst = max(abs(a - b) for a, b in zip(got, want))
        assert worst <= LOGPROB_ATOL, f"prompt {i}: max |logprob diff| {worst:.3g} > {LOGPROB_ATOL}"
    tel = in_place_run.telemetry
    assert tel is not None
    assert (tel["in_place"], tel["pool_blocks"]) == (1, 0)
    assert tel["blocks_in_place"] > 0
    assert tel["blocks_admitted"] == tel["bytes_h2d"] == tel["blocks_hit"] == tel["blocks_evicted"] == 0
    assert tel["forward_calls"] == NUM_LAYERS * in_place_run.steps


@pytest.mark.parametrize(("run", "num_prompts", "max_tokens"), [("single", 1, 8), ("batch", 4, MAX_TOKENS)])
def test_cpu_attn_vllm_steps_equal_forward_passes(
    cpu_attn_run: dict[str, StockRun], run: str, num_prompts: int, max_tokens: int
) -> None:
    stock = cpu_attn_run[run]
    prompt_tokens = sum(PROMPT_LENGTHS[:num_prompts])
    assert stock.gen.steps == max_tokens  # one prefill step (all prompts together), then one step per token
    assert stock.builds == stock.gen.steps
    assert stock.forwards == NUM_LAYERS * stock.gen.steps
    assert stock.kv_updates == NUM_LAYERS * stock.gen.steps
    assert stock.forwards_without_metadata == 0
    assert stock.gen.step_tokens == prompt_tokens + num_prompts * max_tokens
    assert [len(t) for t in stock.gen.token_ids] == [max_tokens] * num_prompts


def test_activekv_exact_tokens_equal_cpu_attn(activekv_run: Generation, cpu_attn_run: dict[str, StockRun]) -> None:
    stock = cpu_attn_run["batch"].gen
    assert [len(t) for t in activekv_run.token_ids] == [MAX_TOKENS] * len(PROMPT_LENGTHS)
    for i, (got, want) in enumerate(zip(activekv_run.token_ids, stock.token_ids)):
        assert got == want, f"prompt {i} ({PROMPT_LENGTHS[i]} tokens): ActiveKV {got} != CPU_ATTN {want}"


def test_activekv_exact_logprobs_close_to_cpu_attn(
    activekv_run: Generation, cpu_attn_run: dict[str, StockRun]
) -> None:
    stock = cpu_attn_run["batch"].gen
    for i, (got, want) in enumerate(zip(activekv_run.logprobs, stock.logprobs)):
        assert len(got) == len(want) == MAX_TOKENS
        worst = max(abs(a - b) for a, b in zip(got, want))
        assert worst <= LOGPROB_ATOL, f"prompt {i}: max |logprob diff| {worst:.3g} > {LOGPROB_ATOL}"


def test_activekv_exact_streams_contexts_through_a_smaller_pool(activekv_run: Generation) -> None:
    tel = activekv_run.telemetry
    assert tel is not None
    assert (max(PROMPT_LENGTHS) + MAX_TOKENS) > EXACT["pool_blocks"] * BLOCK_SIZE
    assert tel["blocks_admitted"] > 0
    assert tel["blocks_evicted"] > 0


def test_activekv_native_calls_match_vllm_steps(activekv_run: Generation) -> None:
    tel = activekv_run.telemetry
    assert tel is not None
    assert tel["num_layers"] == NUM_LAYERS  # one live engine serving both layers
    assert activekv_run.steps == MAX_TOKENS
    assert tel["build_calls"] == activekv_run.steps
    assert tel["forward_calls"] == tel["num_layers"] * activekv_run.steps
    assert tel["kv_update_calls"] == tel["num_layers"] * activekv_run.steps
    assert tel["forward_skipped"] == 0


def run_proof(tiny_model: str, plant: str = "") -> dict[str, Any]:
    """`python -m tools.proof` in a fresh process (the serving process: engine core and worker run in it)."""
    available, why = activekv_status()
    if not available:
        pytest.skip(why)
    cmd = [sys.executable, "-m", "tools.proof", "--model", tiny_model, "--max-tokens", "8"]
    done = subprocess.run(cmd + (["--plant", plant] if plant else []), cwd=REPO, capture_output=True, text=True,
                          timeout=900)
    start = done.stdout.find("{\n")
    assert start >= 0, done.stdout[-2000:] + done.stderr[-4000:]
    report = json.loads(done.stdout[start:])
    assert done.returncode == (0 if report["ok"] else 1)
    return report


def test_proof_native_code_is_the_code_that_ran(tiny_model: str) -> None:
    report = run_proof(tiny_model)
    assert report["ok"], report["checks"]
    steps, layers = report["steps_vllm"], report["layers_model"]
    assert steps == 8 and layers == NUM_LAYERS  # counted by vLLM and read from the model's config
    assert report["native"] == {"build_calls": steps, "forward_calls": layers * steps,
                                "kv_update_calls": layers * steps, "forward_skipped": 0}
    assert report["reference_imports"] == []
    assert report["foreign_frames"] == {} and report["python_frames_under_delegates"] == {}
    names = {label.split()[-1]: n for label, n in report["delegate_frames"].items()}
    assert names == {"build": steps, "forward": layers * steps, "do_kv_cache_update": layers * steps}
    assert report["delegate_frames_per_step"] == 1 + 2 * layers


def test_proof_control_run_with_planted_python_fails(tiny_model: str) -> None:
    report = run_proof(tiny_model, "frame,reference")
    assert not report["ok"]
    checks = report["checks"]
    assert checks["no ActiveKV Python frame but the delegates"] is False
    assert checks["reference never imported"] is False
    assert checks["build_calls == steps"] and checks["forward_calls == layers x steps"]  # only the plants differ
    assert report["foreign_frames"] == {"activekv.py:1000 forward": NUM_LAYERS * report["steps_vllm"]}
    assert "tests.reference.engine" in report["reference_imports"]


def test_activekv_rejects_unknown_option_at_startup(tiny_model: str, cpu_attn_run: dict[str, StockRun]) -> None:
    # cpu_attn_run first, so its engine has shut down; the engine this test starts must fail inside LLM(...).
    available, why = activekv_status()
    if not available:
        pytest.skip(why)
    config = EngineConfig(tiny_model, backend=ACTIVEKV, activekv={**EXACT, "bogus_key": 1}, block_size=BLOCK_SIZE)
    with pytest.raises(ValueError, match="bogus_key"):
        VllmEngine(config)


@pytest.mark.parametrize(("options", "exc", "match"), [
    ({**EXACT, "bogus_key": 1}, ValueError, r"unknown ActiveKV option additional_config\['activekv'\]\['bogus_key'\]"),
    ({"mode": "fast"}, ValueError, "mode must be 'exact' or 'compressed', got 'fast'"),
    ({"pool_blocks": "8"}, TypeError, r"pool_blocks'\] must be an int, got '8'"),
    ({"pool_blocks": 4, "tile_blocks": 8}, ValueError, r"pool_blocks \(4\) must be >= tile_blocks \(8\)"),
    ({"mode": "compressed", "budget_tokens": 32}, ValueError,
     r"budget_tokens \(32\) must cover sink_blocks \+ recent_blocks \+ one block = 64 tokens at block_size 16"),
    ({"mode": "compressed", "dense_layers": NUM_LAYERS + 1}, ValueError,
     rf"dense_layers'\] must be in \[0, {NUM_LAYERS}\] \(the model's attention layers\)"),
    ({"budget_tokens": 512}, ValueError, r"\['budget_tokens'\] applies to mode 'compressed' only, got it with mode 'exact'"),
])
def test_bad_options_fail_as_vllm_makes_its_configuration(tiny_model: str, options: dict, exc: type,
                                                          match: str) -> None:
    # The patch's check in CpuPlatform.check_and_update_config: the error comes from making the configuration in the
    # user's process (what LLM(...) and `vllm serve` do first), before any engine core or model load.
    available, why = activekv_status()
    if not available:
        pytest.skip(why)
    from vllm.engine.arg_utils import EngineArgs

    kwargs = EngineConfig(tiny_model, backend=ACTIVEKV, activekv=options, block_size=BLOCK_SIZE).llm_kwargs()
    with pytest.raises(exc, match=match):
        EngineArgs(model=tiny_model, **kwargs).create_engine_config()
    good = EngineConfig(tiny_model, backend=ACTIVEKV, activekv=EXACT, block_size=BLOCK_SIZE).llm_kwargs()
    assert EngineArgs(model=tiny_model, **good).create_engine_config().additional_config == {"activekv": EXACT}


def test_a_block_size_no_kernel_takes_fails_as_vllm_makes_its_configuration(tiny_model: str) -> None:
    available, why = activekv_status()
    if not available:
        pytest.skip(why)
    from vllm.engine.arg_utils import EngineArgs

    kwargs = EngineConfig(tiny_model, backend=ACTIVEKV, block_size=8).llm_kwargs()
    with pytest.raises(ValueError, match="take KV blocks of 16, 32, 64, 128 tokens: .* got 8"):
        EngineArgs(model=tiny_model, **kwargs).create_engine_config()


def test_tiny_model_is_deterministic(tmp_path: Path, tiny_model: str) -> None:
    again = make_tiny_model(tmp_path / "again")
    for name in ("config.json", "model.safetensors"):
        assert (again / name).read_bytes() == (Path(tiny_model) / name).read_bytes()
