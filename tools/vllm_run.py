"""Run vLLM 0.32.0 in this process on a local model from token ids: the harness for the demo, the bench and the tests.

`VllmEngine(EngineConfig(...))` builds one `vllm.LLM` (in-process engine core, float32, vLLM's default compiled mode
unless `enforce_eager`, tokenizer skipped, KV cache sized explicitly, stats on); `engine.generate(prompts, max_tokens, logprobs)` decodes greedily and returns the
tokens, the chosen tokens' logprobs, the number of forward steps counted on vLLM's side and, for ActiveKV, the change
of the native telemetry; `engine.close()` (or leaving the `with` block) shuts the engine down. Run engines one after
the other: `LLM.get_metrics()` reads the process-wide Prometheus registry, and each new engine unregisters the metrics
of the one before (vllm/v1/metrics/loggers.py, `PrometheusStatLogger.__init__` calls `unregister_vllm_metrics()`), so
only the newest engine can count its steps; `generate` refuses on an older one.

`python -m tools.vllm_run MODEL_DIR [--backend NAME] [--activekv JSON]` generates for a few seeded prompts and prints
tokens, steps and telemetry.

Counting forward steps on vLLM's side (`Generation.steps`): the change, over one `generate`, of the sample count of
vLLM's `vllm:iteration_tokens_total` histogram. Why that count is the number of model forward passes that ran with
attention metadata (the passes that call the backend's metadata builder once and each layer's KV update and forward
once):
- `LLMEngine.step` (vllm/v1/engine/llm_engine.py) takes one `EngineCoreOutputs` from the engine core and, when it holds
  any request output, makes one `IterationStats`; `PrometheusStatLogger.record` observes it once in that histogram
  (value: prompt tokens computed + tokens generated in the step). Steps without outputs are not observed.
- With `VLLM_ENABLE_V1_MULTIPROCESSING=0` the engine core is an `InprocClient`: each `get_output()` runs exactly one
  `EngineCore.step()`: schedule, one `execute_model` (one forward of the whole batch), update from output. The CPU
  platform forces `async_scheduling = False` (vllm/platforms/cpu.py), so no step is split over two calls or overlapped.
- A forward always yields an output for every request that sampled a token. The only forward that samples nothing
  is one where every scheduled request is a partial (chunked) prefill, or a preempted one; `generate` rules both
  out: the prompts must fit `max_num_batched_tokens` and `max_num_seqs` (checked before), and vLLM's
  `vllm:num_preemptions` counter must not move (checked after).
- Profiling and warm-up forwards run inside `LLM(...)` with `attn_metadata` None (backends return `output`
  untouched): in compiled mode the CPU worker's warm-up (`profile_run`, before the KV cache and the metadata builders
  exist), in eager mode none. They never go through `LLMEngine.step`, so they are never observed; counts are also taken
  as a delta around `generate`.
Measured on stock CPU_ATTN with the tiny model: 1 prompt x 8 new tokens -> 8 steps, 8 metadata builds, 16 layer
forwards (2 layers); 4 prompts batched x 32 new tokens -> 32 steps, 32 builds, 64 layer forwards
(tests/test_e2e_vllm.py checks this on every run).
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import weakref
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ACTIVEKV = "ACTIVEKV"
CPU_ATTN = "CPU_ATTN"
# vLLM's cache folder (torch.compile artifacts, model info) for every engine the dev tools and tests start: under
# build/, so `make clean` removes it and nothing lands in the user's ~/.cache/vllm.
VLLM_CACHE_ROOT = Path(__file__).resolve().parents[1] / "build" / "vllm-cache"
# How a compiled engine's graphs are cached between starts. vLLM 0.32.0's AOT-compile cache (its default with torch
# 2.13) never serves a later start on CPU: loading its artifact of the inductor backend fails ("'function' object has
# no attribute 'finalize_loading'", vllm/compilation/decorators.py:314) and vLLM compiles again, about 100 s on the
# real model here at every start. Without AOT compile, inductor's own cache (under VLLM_CACHE_ROOT) serves the next
# start: measured 102 s then 43 s to start the real model. The graphs run are the same: compiled, as by default.
COMPILE_CACHE_ENV = {"VLLM_USE_AOT_COMPILE": "0", "TORCHINDUCTOR_CACHE_DIR": str(VLLM_CACHE_ROOT / "inductor")}
STEP_HISTOGRAM = "vllm:iteration_tokens_total"
PREEMPTION_COUNTER = "vllm:num_preemptions"
# Telemetry values that are sizes, not event counts: reported as read after the run, never differenced.
TELEMETRY_GAUGES = frozenset({"engines", "num_layers"})
# `vllm.LLM` keyword arguments for vLLM's pure-Python tree on a CUDA device, in-process and eager (EngineConfig.extra,
# with enforce_eager=True), as ../shared/design/GPU_VLLM.md found them required: no custom ops, and vLLM's IR ops on
# their native implementations (custom ops off does not cover them; CUDA's default order tries the compiled
# `torch.ops._C.rms_norm` first, absent there); a small device share (kv_cache_memory_bytes, when given, sizes the KV
# cache instead); no asynchronous scheduling, so each LLMEngine.step() is one forward. tests/test_gpu_vllm.py and
# tools/bench_gpu_vllm.py run vLLM with these.
GPU_EAGER_SETTINGS: dict[str, Any] = {
    "compilation_config": {"custom_ops": ["none"]},
    "ir_op_priority": {"rms_norm": ["native"], "fused_add_rms_norm": ["native"], "gelu_and_mul_sparse": ["native"]},
    "gpu_memory_utilization": 0.2,
    "async_scheduling": False,
}

_newest_engine: weakref.ref[VllmEngine] | None = None


@dataclass(frozen=True)
class EngineConfig:
    """One vLLM engine configuration.

    model: directory with config.json + model.safetensors (e.g. from tools.make_tiny_model).
    backend: vLLM attention backend name, `CPU_ATTN` (stock) or `ACTIVEKV` (needs the patched vLLM).
    activekv: passed as `additional_config={"activekv": activekv}`; None leaves additional_config unset.
    block_size: vLLM's KV block size in tokens; None keeps the platform default (128 on CPU).
    kv_cache_gib: vLLM's KV cache in GiB, through `VLLM_CPU_KVCACHE_SPACE` (the CPU worker reads it at start-up).
    enable_prefix_caching: off by default, so a repeated prompt recomputes and every run exercises the KV update path.
    max_num_batched_tokens: vLLM's per-step token limit; None keeps vLLM's default (4096 on CPU). Raise it to prefill
        a batch of long prompts in one step (`generate` refuses prompts that would be chunked).
    num_gpu_blocks: KV-cache blocks per layer, through vLLM's `num_gpu_blocks_override` (applied to the CPU KV cache
        too: vllm/v1/core/kv_cache_utils.py); None sizes the cache from kv_cache_gib. A small value forces preemption.
    enforce_eager: False (vLLM's default) compiles the model with torch.compile (inductor) and warms it up before the
        KV cache exists; True runs it eagerly with no warm-up. Compiled graphs are cached under VLLM_CACHE_ROOT.
    dtype: the model dtype vLLM runs in.
    extra: further `vllm.LLM` keyword arguments, applied last (the GPU harness's settings: tests/test_gpu_vllm.py).
    """

    model: str
    backend: str = CPU_ATTN
    activekv: Mapping[str, Any] | None = None
    block_size: int | None = None
    max_model_len: int = 2048
    max_num_seqs: int = 16
    kv_cache_gib: int = 1
    enable_prefix_caching: bool = False
    seed: int = 0
    max_num_batched_tokens: int | None = None
    num_gpu_blocks: int | None = None
    enforce_eager: bool = False
    dtype: str = "float32"
    extra: Mapping[str, Any] | None = None

    def llm_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for `vllm.LLM` (besides the model path)."""
        kwargs: dict[str, Any] = {
            "skip_tokenizer_init": True,
            "dtype": self.dtype,
            "enforce_eager": self.enforce_eager,
            "max_model_len": self.max_model_len,
            "max_num_seqs": self.max_num_seqs,
            "attention_config": {"backend": self.backend},
            "enable_prefix_caching": self.enable_prefix_caching,
            "disable_log_stats": False,  # LLM defaults to True, which leaves get_metrics() empty
            "seed": self.seed,
        }
        if self.block_size is not None:
            kwargs["block_size"] = self.block_size
        if self.max_num_batched_tokens is not None:
            kwargs["max_num_batched_tokens"] = self.max_num_batched_tokens
        if self.num_gpu_blocks is not None:
            kwargs["num_gpu_blocks_override"] = self.num_gpu_blocks
        if self.activekv is not None:
            kwargs["additional_config"] = {"activekv": dict(self.activekv)}
        if self.extra is not None:
            kwargs.update(self.extra)
        return kwargs


@dataclass
class Generation:
    """What one `VllmEngine.generate` returned; lists are per prompt, in prompt order.

    token_ids[i]: the generated token ids (max_tokens of them; EOS is ignored).
    logprobs[i][t]: vLLM's logprob of token_ids[i][t] (raw log-softmax of the logits, float).
    top_logprobs[i][t]: {token id: logprob} for the top-K tokens plus the chosen one.
    steps: forward steps counted on vLLM's side (module docstring says why this equals the model forward passes).
    step_tokens: tokens those steps computed (prompt + generated), the histogram's sum.
    telemetry: change of the native counters over the call, gauges (num_layers, engines, ...) as read after
        (see read_telemetry); None when the backend is not ActiveKV.
    """

    token_ids: list[list[int]]
    logprobs: list[list[float]]
    top_logprobs: list[list[dict[int, float]]]
    steps: int
    step_tokens: int
    telemetry: dict[str, int] | None = None
    prompt_lens: list[int] = field(default_factory=list)


def activekv_status() -> tuple[bool, str]:
    """(True, "") when `activekv._backend` imports and vLLM's AttentionBackendEnum has ACTIVEKV; else (False, why)."""
    import torch  # noqa: F401  (the native modules use torch's types: torch must be loaded first)

    try:
        import activekv._backend  # noqa: F401
    except ImportError as exc:
        return False, f"activekv._backend is not importable ({exc}); run `make build`"
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if ACTIVEKV not in AttentionBackendEnum.__members__:
        return False, "vLLM is not patched: AttentionBackendEnum has no ACTIVEKV; run `make patch-vllm`"
    return True, ""


def read_telemetry() -> tuple[dict[str, int], frozenset[str]] | None:
    """The newest live ActiveKV engine's snapshot, flattened to ({name: int}, gauge names); None when not importable.

    The newest engine is the one the newest `LLM` created; an older LLM's engine may still be alive until it is
    collected, and must not be counted as this run's (a process-wide sum would). Top-level ints are event counters
    (build_calls, forward_calls, blocks_admitted, ...); the `info` dict holds sizes (num_layers, pool_blocks, ...),
    merged here as gauges, and `engines` (live engines in the process) is a gauge too. Histograms are left out.
    """
    import torch  # noqa: F401  (the native modules use torch's types: torch must be loaded first)

    try:
        import activekv._telemetry as telemetry
    except ImportError:
        return None
    snaps = telemetry.engine_snapshots()
    flat: dict[str, int] = {"engines": len(snaps)}
    gauges = set(TELEMETRY_GAUGES)
    if not snaps:
        return flat, frozenset(gauges)
    for key, value in snaps[-1].items():
        if key == "engine_id":
            continue
        if isinstance(value, int):
            flat[str(key)] = int(value)
        elif key == "info" and isinstance(value, dict):
            flat.update({str(k): int(v) for k, v in value.items()})
            gauges.update(str(k) for k in value)
    return flat, frozenset(gauges)


def telemetry_delta(before: Mapping[str, int], after: Mapping[str, int], gauges: frozenset[str]) -> dict[str, int]:
    """after - before for counters; gauges as read in `after`."""
    return {k: (v if k in gauges else v - before.get(k, 0)) for k, v in after.items()}


def make_prompts(lengths: Sequence[int], vocab_size: int, seed: int = 0) -> list[list[int]]:
    """Token-id prompts of the given lengths, uniform in [0, vocab_size), from a seeded torch generator."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def _prepare_environment(kv_cache_gib: int) -> None:
    # Set before vLLM reads them: the engine core in this process (telemetry readable, monkeypatchable backends),
    # no network, the KV cache size in GiB (vllm/platforms/cpu.py reads it from os.environ at start-up), and vLLM's
    # cache (compiled graphs, COMPILE_CACHE_ENV) under this checkout's build/ unless the caller chose otherwise.
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
    os.environ.setdefault("VLLM_CACHE_ROOT", str(VLLM_CACHE_ROOT))
    for key, value in COMPILE_CACHE_ENV.items():
        os.environ.setdefault(key, value)


class VllmEngine:
    """One in-process `vllm.LLM`; use as a context manager, or call `close()`.

    Raises whatever `vllm.LLM(...)` raises at start-up (e.g. a rejected additional_config), after releasing what the
    failed start-up left behind.
    """

    def __init__(self, config: EngineConfig) -> None:
        global _newest_engine
        self.config = config
        _prepare_environment(config.kv_cache_gib)
        from vllm import LLM

        self._llm: Any = None
        _newest_engine = None  # any LLM(...), even one that fails, may replace the registered metrics
        try:
            self._llm = LLM(model=config.model, **config.llm_kwargs())
        except BaseException:
            _release_distributed_state()
            raise
        _newest_engine = weakref.ref(self)

    @property
    def llm(self) -> Any:
        if self._llm is None:
            raise RuntimeError("engine is closed")
        return self._llm

    def _metric(self, name: str) -> tuple[int, float]:
        """(count, sum) of a histogram, or (value, value) of a counter, summed over this model's label sets."""
        count, total = 0, 0.0
        for metric in self.llm.get_metrics():
            if metric.name != name or metric.labels.get("model_name", self.config.model) != self.config.model:
                continue
            if hasattr(metric, "count"):
                count, total = count + int(metric.count), total + float(metric.sum)
            else:
                count, total = count + int(metric.value), total + float(metric.value)
        return count, total

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int, logprobs: int = 1,
                 chunked: bool = False) -> Generation:
        """Greedy decode of `max_tokens` tokens for each prompt, all submitted as one batch.

        chunked: let vLLM prefill the prompts in chunks of `max_num_batched_tokens` over several steps and queue rows
            beyond `max_num_seqs` (a step whose rows are all partial prefills samples nothing and is not counted, so
            `steps` is then not the number of forward passes).

        Raises RuntimeError when this engine is not the newest one (its metrics were unregistered), when the prompts
        would be chunked or queued and `chunked` is False (steps would then not equal forward passes), or when vLLM
        preempted a request.
        """
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if _newest_engine is None or _newest_engine() is not self:
            raise RuntimeError("a newer VllmEngine replaced this one's vLLM metrics; close engines in order")
        scheduler = self.llm.llm_engine.vllm_config.scheduler_config
        total = sum(len(p) for p in prompts)
        if not chunked and (total > scheduler.max_num_batched_tokens or len(prompts) > scheduler.max_num_seqs):
            raise RuntimeError(
                f"{len(prompts)} prompts of {total} tokens exceed max_num_batched_tokens="
                f"{scheduler.max_num_batched_tokens} or max_num_seqs={scheduler.max_num_seqs}: prefill would be split"
            )
        params = SamplingParams(
            temperature=0.0, max_tokens=max_tokens, detokenize=False, logprobs=logprobs, ignore_eos=True
        )
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        steps0, tokens0 = self._metric(STEP_HISTOGRAM)
        preempt0, _ = self._metric(PREEMPTION_COUNTER)
        tel0 = read_telemetry() if self.config.backend == ACTIVEKV else None
        outputs = self.llm.generate(requests, params, use_tqdm=False)
        tel1 = read_telemetry() if self.config.backend == ACTIVEKV else None
        steps1, tokens1 = self._metric(STEP_HISTOGRAM)
        preempt1, _ = self._metric(PREEMPTION_COUNTER)
        if preempt1 != preempt0:
            raise RuntimeError(f"vLLM preempted {preempt1 - preempt0} requests; step count would not match forwards")
        token_ids, chosen, tops = [], [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            per_pos = [{int(t): float(lp.logprob) for t, lp in pos.items()} for pos in completion.logprobs or []]
            token_ids.append(ids)
            tops.append(per_pos)
            chosen.append([pos[t] for t, pos in zip(ids, per_pos)])
        return Generation(
            token_ids=token_ids,
            logprobs=chosen,
            top_logprobs=tops,
            steps=steps1 - steps0,
            step_tokens=round(tokens1 - tokens0),
            telemetry=telemetry_delta(tel0[0], tel1[0], tel1[1]) if tel0 is not None and tel1 is not None else None,
            prompt_lens=[len(p) for p in prompts],
        )

    def close(self) -> None:
        """Shut the engine core down and free the model, KV cache and backend state (idempotent)."""
        if self._llm is None:
            return
        llm, self._llm = self._llm, None
        try:
            llm.llm_engine.engine_core.shutdown()
        finally:
            del llm
            gc.collect()

    def __enter__(self) -> VllmEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _release_distributed_state() -> None:
    # vLLM's teardown for in-process engines (EngineCore.shutdown calls it); a failed LLM(...) never reaches that,
    # so the process group and memory of the half-built worker are released here before the next engine starts.
    try:
        from vllm.distributed import cleanup_dist_env_and_memory
    except ImportError:
        return
    cleanup_dist_env_and_memory()
    gc.collect()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.vllm_run", description=__doc__.splitlines()[0])
    parser.add_argument("model", type=Path, help="model directory (python -m tools.make_tiny_model DIR)")
    parser.add_argument("--backend", default=CPU_ATTN, help="CPU_ATTN or ACTIVEKV")
    parser.add_argument("--activekv", type=json.loads, default=None, help='JSON, e.g. {"mode": "exact"}')
    parser.add_argument("--block-size", type=int, default=None)
    parser.add_argument("--lengths", type=int, nargs="+", default=[37, 200, 513, 64])
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--vocab-size", type=int, default=512)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--enforce-eager", action="store_true", help="run vLLM eagerly (default: compiled)")
    parser.add_argument("--vllm-log-level", default="ERROR", help="VLLM_LOGGING_LEVEL, unless already set")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", args.vllm_log_level)  # read when vllm is first imported
    config = EngineConfig(str(args.model), args.backend, args.activekv, args.block_size, seed=args.seed,
                          enforce_eager=args.enforce_eager)
    with VllmEngine(config) as engine:
        gen = engine.generate(make_prompts(args.lengths, args.vocab_size, args.seed), args.max_tokens)
    for n, ids in zip(gen.prompt_lens, gen.token_ids):
        print(f"prompt of {n} tokens -> {ids}")
    print(f"steps (vLLM iteration_tokens_total count): {gen.steps}, tokens computed: {gen.step_tokens}")
    if gen.telemetry is not None:
        print(f"telemetry: {json.dumps(gen.telemetry, sort_keys=True)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
