"""Request lifecycle inside vLLM 0.32.0 with ActiveKV (issue 7, item 4): mixed lengths, aborts, preemption, prefix hits.

An in-process ActiveKV engine (a pool of 8 blocks x 16 tokens per layer; exact mode, then compressed mode) runs with prefix caching on and a
KV cache of only NUM_BLOCKS blocks (vLLM's `num_gpu_blocks_override`) and a step budget of MAX_NUM_BATCHED_TOKENS
tokens (longer prompts are prefilled in chunks), driven request by request through `LLMEngine.add_request` / `step` /
`abort_request`, in five phases:

1. lengths: prompts of 5, 37, 130 and 300 tokens (the last two longer than the pool);
2. aborts: one request aborted before any step, one after its prefill step, one mid-decode; two run to the end;
3. preemption: four requests that together need more blocks than the KV cache holds, so vLLM preempts (checked on
   vLLM's own `vllm:num_preemptions` counter, never assumed);
4. prefix hits: a 200-token prefix with one suffix, then the same prefix with another suffix and the first prompt
   again (checked on vLLM's `vllm:prefix_cache_hits` counter and each output's `num_cached_tokens`);
5. chunked prefill under preemption: two prompts longer than the step budget, prefilled chunk by chunk (rows whose
   prefill stops short of the prompt are counted), which together outgrow the KV cache while decoding, so vLLM
   preempts one (counted on `vllm:num_preemptions`) and recomputes it, in chunks again.

After every step (a metadata build wrapped as `tools.capture` does records the step's block table) and at the end of
each phase, for both layers:
- coherence: every pool slot is free or holds exactly (`torch.equal`) the bytes of its block in the host tier (vLLM's
  kv_cache for the layer, viewed as [num_blocks, num_kv_heads, 2, block_size, head_size]); resident slots are distinct
  and below pool_blocks;
- freed blocks: the engine is never told that vLLM freed a block (vLLM passes block tables, not frees), so a freed
  block may stay resident until LRU evicts it; what is checked is (a) such a block stays byte-coherent with the host
  tier, including when vLLM then holds the id again while it is resident (handed to a new request and rewritten from
  offset 0, or re-held as a prefix-cache hit; counted, and required to happen), and (b) after any step whose rows
  referenced at least pool_blocks distinct blocks, every resident block is one of that step's blocks: a freed block
  outlives no such step (LRU: the pool then holds the step's pool_blocks most recently used blocks). A step that
  references fewer blocks may leave freed blocks resident; they are only checked for coherence.
- key metadata: in compressed mode, for every block a step used, the engine's per-KV-head, per-dimension key min/max
  (what compressed mode selects by; every KV update maintains them) bound the keys of the block's filled tokens in the
  host tier; in exact mode, which never reads them, the engine holds none.
A control test runs the same checks on a native Engine driven directly, with a stale resident block, a host write the
pool missed and a key outside its block's bounds, and requires each to be reported.
- replay: every layer forward of every step (`tools.capture` records query, output, plan, selections and the blocks
  the rows reference) runs again on a fresh native Engine of the same options, whose pool, LRU order and key
  metadata start empty; its output and, for compressed rows, its selection must be equal bit for bit
  (`torch.equal`): the oracle `tests/test_e2e_compressed.py` uses, here after aborts, preemption and recomputation,
  prefix-cache hits and chunked prefill (`tools/capture.py` says why the replay is exact under each).
Finally, in exact mode, every request that finished equals stock vLLM (CPU_ATTN, default block size, ample KV cache,
no prefix caching, default step budget) token for token, greedy float32; in compressed mode (approximate by design)
every request not aborted finishes with all its tokens and decode rows ran compressed; in both modes the replay
above holds. The LRU bound applies to exact mode only (a compressed decode row admits only its selection).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from tools.capture import Recorder, capture, replay
from tools.make_tiny_model import SPEC
from tools.vllm_run import ACTIVEKV, CPU_ATTN, EngineConfig, VllmEngine, activekv_status, make_prompts

pytestmark = pytest.mark.vllm

BLOCK_SIZE = 16
POOL_BLOCKS = 8
EXACT = {"mode": "exact", "pool_blocks": POOL_BLOCKS, "tile_blocks": 4}
# budget 64 tokens = 4 blocks per KV head: 1 sink + 1 selected + 2 recent; the union (2 x 1 + 3 = 5) fits the pool
COMPRESSED = {"mode": "compressed", "pool_blocks": POOL_BLOCKS, "tile_blocks": 4, "budget_tokens": 64,
              "sink_blocks": 1, "recent_blocks": 2}
MODES = {"exact": EXACT, "compressed": COMPRESSED}
NUM_BLOCKS = 48  # 768 tokens of KV cache per layer
MAX_MODEL_LEN = 512
MAX_NUM_BATCHED_TOKENS = 256  # vLLM's step budget: longer prompts (and batches) are prefilled in chunks
NUM_KV_HEADS = SPEC["num_key_value_heads"]
HEAD_SIZE = SPEC["head_dim"]
NUM_LAYERS = SPEC["num_hidden_layers"]
VOCAB = SPEC["vocab_size"]

LENGTHS = (5, 37, 130, 300)
LENGTHS_TOKENS = 12
ABORT_LENGTHS = (90, 150, 200, 60, 120)
ABORT_TOKENS = 24
# request index -> number of engine steps after which it is aborted (0: before the first step)
ABORT_AFTER = {0: 0, 1: 1, 2: 6}
PREEMPT_LENGTHS = (150, 150, 150, 150)
PREEMPT_TOKENS = 100  # 4 x (150 + 100) tokens = 64 blocks > NUM_BLOCKS
PREFIX_LEN = 200
PREFIX_TOKENS = 12
# each prompt > MAX_NUM_BATCHED_TOKENS; prompts 22 + 22 blocks <= NUM_BLOCKS (both admitted), finished 25 + 25 blocks
# > NUM_BLOCKS: vLLM preempts one mid-decode and prefills its recomputation (prompt + tokens so far) in chunks again
CHUNKED_LENGTHS = (350, 340)
CHUNKED_TOKENS = 48


@dataclass
class Phase:
    name: str
    prompts: dict[str, list[int]]
    max_tokens: int
    outputs: dict[str, list[int]] = field(default_factory=dict)
    cached_tokens: dict[str, int] = field(default_factory=dict)
    aborted: list[str] = field(default_factory=list)
    preemptions: int = 0
    prefix_hits: int = 0
    steps: int = 0
    partial_prefill_rows: int = 0  # rows whose prefill chunk ended before the phase's shortest prompt


@dataclass
class Observed:
    lru: bool  # apply the LRU bound (exact mode: every block of every row passes through the pool)
    phases: dict[str, Phase] = field(default_factory=dict)
    steps_checked: int = 0
    builds: int = 0  # metadata builds (one per step that ran a forward)
    bounds_checked: int = 0  # (layer, block) key min/max bound checks (compressed mode)
    no_metadata_checked: int = 0  # (layer, step) checks that an exact engine holds no key min/max
    compressed_rows: int = 0  # the engine's telemetry: decode rows that attended a selection (all layers)
    replayed: int = 0  # layer forwards replayed on a fresh native engine
    replayed_selections: int = 0  # compressed rows among them (selection compared)
    lru_steps_checked: int = 0
    freed_resident_seen: int = 0  # resident blocks that vLLM held for no request at a check
    freed_then_reheld: int = 0  # resident blocks vLLM freed, then held again while resident: handed to a new request
    # (a fresh allocation, rewritten from offset 0) or re-held as a prefix-cache hit; coherent at every check
    problems: list[str] = field(default_factory=list)


class Harness:
    """The ActiveKV engine objects reached in-process: the native Engine, each layer's host tier, vLLM's scheduler."""

    def __init__(self, vllm: VllmEngine, engine: Any) -> None:
        core = vllm.llm.llm_engine.engine_core.engine_core  # InprocClient -> EngineCore
        runner = core.model_executor.driver_worker.worker.model_runner
        self.llm_engine = vllm.llm.llm_engine
        self.scheduler = core.scheduler
        self.engine = engine
        self.hosts: dict[int, torch.Tensor] = {}
        for name, layer in runner.vllm_config.compilation_config.static_forward_context.items():
            cache = getattr(layer, "kv_cache", None)
            if isinstance(cache, list):
                cache = cache[0]
            if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
                continue
            assert cache.is_contiguous() and cache.shape[1:] == (NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE), cache.shape
            self.hosts[int(engine.layer_index(name))] = cache.view(cache.shape[0], NUM_KV_HEADS, 2, BLOCK_SIZE,
                                                                   HEAD_SIZE)
        assert sorted(self.hosts) == list(range(SPEC["num_hidden_layers"]))
        # the small KV cache took effect: vLLM's block pool and each layer's cache hold NUM_BLOCKS blocks
        assert self.scheduler.kv_cache_manager.block_pool.num_gpu_blocks == NUM_BLOCKS
        assert all(h.shape[0] == NUM_BLOCKS for h in self.hosts.values()), [h.shape for h in self.hosts.values()]

    def held_blocks(self) -> set[int]:
        """Block ids vLLM's block pool holds for a live request (ref_cnt > 0)."""
        return {b.block_id for b in self.scheduler.kv_cache_manager.block_pool.blocks if b.ref_cnt > 0}

    def resident(self, layer: int) -> dict[int, int]:
        return {int(b): int(s) for b, s in self.engine.resident(layer).items()}


def check_pool(h: Harness, obs: Observed, where: str, step_blocks: set[int] | None,
               freed_before: dict[int, set[int]]) -> dict[int, set[int]]:
    """Coherence and the LRU bound for every layer; returns {layer: resident blocks vLLM holds for no request}."""
    held = h.held_blocks()
    freed_now: dict[int, set[int]] = {}
    for layer, host in h.hosts.items():
        res = h.resident(layer)
        pool = h.engine.pool(layer)
        slots = list(res.values())
        if len(set(slots)) != len(slots) or any(not 0 <= s < POOL_BLOCKS for s in slots):
            obs.problems.append(f"{where} layer {layer}: bad slots {res}")
        for block, slot in res.items():
            if not torch.equal(pool[slot], host[block]):
                diff = float((pool[slot] - host[block]).abs().max())
                obs.problems.append(f"{where} layer {layer}: block {block} in slot {slot} differs (max {diff:.3g})")
        if obs.lru and step_blocks is not None and len(step_blocks) >= POOL_BLOCKS and not set(res) <= step_blocks:
            obs.problems.append(f"{where} layer {layer}: resident {sorted(set(res) - step_blocks)} not used by a "
                                f"step over {len(step_blocks)} blocks")
        freed_now[layer] = set(res) - held
        obs.freed_resident_seen += len(freed_now[layer])
        # freed at the previous check, held again now and still resident
        obs.freed_then_reheld += len(freed_before.get(layer, set()) & (set(res) & held))
    if step_blocks is not None:
        obs.steps_checked += 1
        obs.lru_steps_checked += obs.lru and len(step_blocks) >= POOL_BLOCKS
    return freed_now


def check_key_bounds(h: Harness, obs: Observed, where: str, filled: dict[int, int]) -> None:
    """Every block the step used: the engine's per-KV-head, per-dimension key min/max bound the keys its filled tokens
    hold in the host tier (the metadata compressed mode selects by, maintained by every KV update); an exact engine,
    which never reads them, holds none."""
    for layer, host in h.hosts.items():
        kmin, kmax = h.engine.key_min(layer), h.engine.key_max(layer)
        if h.engine.mode == "exact":
            if kmin is not None or kmax is not None:
                obs.problems.append(f"{where} layer {layer}: an exact engine holds key min/max")
            obs.no_metadata_checked += 1
            continue
        for block, n in filled.items():
            keys = host[block, :, 0, :n, :]  # [num_kv_heads, n, head_size]
            if not ((kmin[block].unsqueeze(1) <= keys).all() and (keys <= kmax[block].unsqueeze(1)).all()):
                obs.problems.append(f"{where} layer {layer}: key min/max of block {block} do not bound its {n} keys")
            obs.bounds_checked += 1


def check_replay(rec: Recorder, obs: Observed, where: str, options: dict[str, Any]) -> None:
    """Replay each layer forward recorded since the last call on a fresh native Engine (same options); outputs and
    selections must be equal bit for bit. Drops the recorded calls (a call holds copies of its rows' blocks)."""
    import activekv._backend as backend

    extra = {k: v for k, v in options.items() if k not in ("pool_blocks", "tile_blocks")}
    for call in rec.calls:
        fresh = backend.Engine(1, SPEC["num_attention_heads"], NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32,
                               options["pool_blocks"], options["tile_blocks"], **extra)
        got = replay(call, fresh)
        if not torch.equal(got.output, call.output):
            worst = float((got.output - call.output).abs().max())
            obs.problems.append(f"{where} layer {call.layer}: output differs from a fresh engine's replay (max abs "
                                f"{worst:.3g})")
        if sorted(got.selection) != sorted(call.selection) or not all(
            torch.equal(got.selection[r], call.selection[r]) for r in call.selection
        ):
            obs.problems.append(f"{where} layer {call.layer}: selection differs from a fresh engine's replay")
        obs.replayed += 1
        obs.replayed_selections += len(call.selection)
    rec.calls.clear()


def run_phase(h: Harness, vllm: VllmEngine, obs: Observed, phase: Phase, rec_blocks: list[dict[int, int]],
              rec: Recorder, options: dict[str, Any], abort_after: dict[str, int] | None = None,
              waves: list[list[str]] | None = None) -> None:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=phase.max_tokens, detokenize=False, ignore_eos=True)
    abort_after = abort_after or {}
    preempt0, _ = vllm._metric("vllm:num_preemptions")
    hits0, _ = vllm._metric("vllm:prefix_cache_hits")
    freed: dict[int, set[int]] = {}
    shortest = min(len(p) for p in phase.prompts.values())
    for wave in waves or [list(phase.prompts)]:
        for rid in wave:
            h.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=phase.prompts[rid]), params)
        steps = 0
        while True:
            for rid, n in abort_after.items():
                if n == steps and rid in wave and rid not in phase.aborted:
                    h.llm_engine.abort_request([rid])
                    phase.aborted.append(rid)
            if not h.llm_engine.has_unfinished_requests():
                break
            built = len(rec_blocks)
            for out in h.llm_engine.step():
                if out.finished:
                    phase.outputs[out.request_id] = list(out.outputs[0].token_ids)
                    phase.cached_tokens[out.request_id] = int(out.num_cached_tokens or 0)
            steps += 1
            filled = {b: n for step_filled in rec_blocks[built:] for b, n in step_filled.items()}
            step_blocks = set(filled) if len(rec_blocks) > built else None
            freed = check_pool(h, obs, f"{phase.name} step {steps}", step_blocks, freed)
            check_key_bounds(h, obs, f"{phase.name} step {steps}", filled)
            for call in (c for c in rec.calls if c.layer == 0):  # the step's rows, counted once (layer 0)
                q_lens = (call.query_start_loc[1:] - call.query_start_loc[:-1]).tolist()
                phase.partial_prefill_rows += sum(q > 1 and int(n) < shortest
                                                  for q, n in zip(q_lens, call.seq_lens.tolist()))
            check_replay(rec, obs, f"{phase.name} step {steps}", options)
        phase.steps += steps
    check_pool(h, obs, f"{phase.name} end", None, freed)
    preempt1, _ = vllm._metric("vllm:num_preemptions")
    hits1, _ = vllm._metric("vllm:prefix_cache_hits")
    phase.preemptions, phase.prefix_hits = preempt1 - preempt0, int(hits1 - hits0)
    obs.phases[phase.name] = phase


def make_phases() -> list[tuple[Phase, dict[str, int], list[list[str]] | None]]:
    lengths = make_prompts(LENGTHS, VOCAB, seed=11)
    aborts = make_prompts(ABORT_LENGTHS, VOCAB, seed=12)
    preempt = make_prompts(PREEMPT_LENGTHS, VOCAB, seed=13)
    prefix, s1, s2 = make_prompts((PREFIX_LEN, 40, 30), VOCAB, seed=14)
    return [
        (Phase("lengths", {f"len{i}": p for i, p in enumerate(lengths)}, LENGTHS_TOKENS), {}, None),
        (Phase("aborts", {f"ab{i}": p for i, p in enumerate(aborts)}, ABORT_TOKENS),
         {f"ab{i}": n for i, n in ABORT_AFTER.items()}, None),
        (Phase("preemption", {f"pre{i}": p for i, p in enumerate(preempt)}, PREEMPT_TOKENS), {}, None),
        (Phase("prefix", {"pfx_a": prefix + s1, "pfx_b": prefix + s2, "pfx_a2": prefix + s1}, PREFIX_TOKENS), {},
         [["pfx_a"], ["pfx_b", "pfx_a2"]]),
        (Phase("chunked", {f"chk{i}": p for i, p in enumerate(make_prompts(CHUNKED_LENGTHS, VOCAB, seed=15))},
               CHUNKED_TOKENS), {}, None),
    ]


def _run_activekv(model_dir: Path, options: dict[str, Any]) -> tuple[Observed, list[Phase]]:
    obs = Observed(lru=options["mode"] == "exact")
    phases = make_phases()
    rec_blocks: list[dict[int, int]] = []  # per step: {block id: tokens of it the step's rows hold}

    def keep(step: int, plan: Any) -> bool:  # records each step's blocks and their filled tokens; layer forwards too
        bt, lens = plan.block_table, plan.seq_lens
        filled: dict[int, int] = {}
        for r in range(int(plan.num_reqs)):
            n = int(lens[r])
            for i, b in enumerate(bt[r, : -(-n // BLOCK_SIZE)].tolist()):
                filled[int(b)] = max(filled.get(int(b), 0), min(BLOCK_SIZE, n - i * BLOCK_SIZE))
        rec_blocks.append(filled)
        return True

    config = EngineConfig(str(model_dir), backend=ACTIVEKV, activekv=options, block_size=BLOCK_SIZE,
                          max_model_len=MAX_MODEL_LEN, enable_prefix_caching=True, num_gpu_blocks=NUM_BLOCKS,
                          max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS)
    with VllmEngine(config) as vllm, capture(keep) as rec:
        h = Harness(vllm, _engine_of(vllm))
        assert h.engine.mode == options["mode"]
        for phase, abort_after, waves in phases:
            run_phase(h, vllm, obs, phase, rec_blocks, rec, options, abort_after, waves)
        obs.builds = len(rec_blocks)
        obs.compressed_rows = int(h.engine.snapshot()["compressed_rows"])
        assert len(rec.engines) == 1 and rec.engines[0] is h.engine  # every step was built by the engine checked
    return obs, [phase for phase, _, _ in phases]


@pytest.fixture(scope="module")
def lifecycle(model_dir: Path) -> tuple[dict[str, Observed], dict[str, dict[str, list[int]]]]:
    """({mode: what the ActiveKV run observed}, {phase: {request id: CPU_ATTN tokens}}); engines run one at a time."""
    available, why = activekv_status()
    if not available:
        pytest.skip(why)
    runs = {mode: _run_activekv(model_dir, options) for mode, options in MODES.items()}
    stock: dict[str, dict[str, list[int]]] = {}
    with VllmEngine(EngineConfig(str(model_dir), backend=CPU_ATTN)) as ref:
        for phase in runs["exact"][1]:
            done = [rid for rid in phase.prompts if rid not in phase.aborted]
            gen = ref.generate([phase.prompts[r] for r in done], phase.max_tokens)
            stock[phase.name] = dict(zip(done, gen.token_ids))
    return {mode: obs for mode, (obs, _) in runs.items()}, stock


def _engine_of(vllm: VllmEngine) -> Any:
    """The native Engine of the ActiveKV metadata builder (one KV-cache group: one builder, one engine)."""
    runner = vllm.llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner
    engines = [b._native.engine for group in runner.attn_groups for g in group for b in g.metadata_builders]
    assert len(engines) >= 1 and all(e is engines[0] for e in engines)
    return engines[0]


@pytest.mark.parametrize("mode", list(MODES))
def test_every_pool_slot_is_free_or_coherent_after_every_step(lifecycle: Any, mode: str) -> None:
    obs = lifecycle[0][mode]
    assert not obs.problems, "\n".join(obs.problems[:20])
    assert obs.builds > 0 and obs.steps_checked == obs.builds  # every step that ran a forward was checked
    assert obs.lru_steps_checked > 0 if mode == "exact" else obs.lru_steps_checked == 0  # exercised where applied
    assert obs.bounds_checked > 0 if mode == "compressed" else obs.no_metadata_checked > 0


@pytest.mark.parametrize("mode", list(MODES))
def test_every_layer_forward_equals_a_fresh_engines_replay(lifecycle: Any, mode: str) -> None:
    obs = lifecycle[0][mode]
    assert not [p for p in obs.problems if "replay" in p], "\n".join(obs.problems[:20])
    assert obs.replayed == NUM_LAYERS * obs.builds  # every layer forward of every step was replayed
    # compressed: selections compared on every decode row that ran compressed (the telemetry counts all layers)
    assert obs.replayed_selections == (obs.compressed_rows if mode == "compressed" else 0)
    assert mode == "exact" or obs.replayed_selections > 0


@pytest.mark.parametrize("mode", list(MODES))
def test_freed_blocks_stayed_coherent_and_were_reused(lifecycle: Any, mode: str) -> None:
    obs = lifecycle[0][mode]
    assert obs.freed_resident_seen > 0  # blocks vLLM freed were resident at some check
    assert obs.freed_then_reheld > 0  # and some were held again by vLLM while still resident


@pytest.mark.parametrize("mode", list(MODES))
def test_vllm_preempted_aborted_and_hit_the_prefix_cache(
    lifecycle: Any, mode: str, capsys: pytest.CaptureFixture[str]
) -> None:
    obs = lifecycle[0][mode]
    phases = obs.phases
    with capsys.disabled():  # the figures docs/reliability.md quotes
        print(f"\n[{mode}]", end="")
        for p in phases.values():
            print(f"\n{p.name}: steps {p.steps}, finished {len(p.outputs)}, aborted {len(p.aborted)}, preemptions "
                  f"{p.preemptions}, prefix-cache hit tokens {p.prefix_hits}, partial prefill rows "
                  f"{p.partial_prefill_rows}, cached tokens {p.cached_tokens}")
        print(f"steps checked {obs.steps_checked} (LRU bound applied on {obs.lru_steps_checked}), freed blocks seen "
              f"resident {obs.freed_resident_seen}, freed then reused while resident {obs.freed_then_reheld}, key "
              f"bound checks {obs.bounds_checked}, compressed rows {obs.compressed_rows}, layer forwards replayed "
              f"{obs.replayed} ({obs.replayed_selections} selections)")
    assert phases["preemption"].preemptions > 0
    assert sorted(phases["aborts"].aborted) == sorted(f"ab{i}" for i in ABORT_AFTER)
    assert not set(phases["aborts"].outputs) & set(phases["aborts"].aborted)
    assert phases["prefix"].prefix_hits > 0
    full_blocks = PREFIX_LEN // BLOCK_SIZE * BLOCK_SIZE
    assert phases["prefix"].cached_tokens["pfx_b"] >= full_blocks
    assert phases["prefix"].cached_tokens["pfx_a2"] >= full_blocks
    assert phases["chunked"].preemptions > 0  # chunked prefill under preemption
    assert phases["chunked"].partial_prefill_rows >= len(CHUNKED_LENGTHS)  # every prompt was prefilled in chunks


def test_finished_requests_equal_stock_vllm(lifecycle: Any) -> None:
    # exact mode only: compressed mode attends a selection, so its tokens may differ from full attention
    obs, stock = lifecycle[0]["exact"], lifecycle[1]
    for name, phase in obs.phases.items():
        assert sorted(phase.outputs) == sorted(stock[name]), name
        for rid, want in stock[name].items():
            assert len(want) == phase.max_tokens
            assert phase.outputs[rid] == want, f"{name}/{rid}: ActiveKV {phase.outputs[rid]} != CPU_ATTN {want}"


def test_compressed_run_finished_every_request_it_did_not_abort(lifecycle: Any) -> None:
    obs, stock = lifecycle[0]["compressed"], lifecycle[1]
    assert obs.phases["preemption"].preemptions > 0
    assert obs.compressed_rows > 0  # decode rows beyond the budget attended a selection
    for name, phase in obs.phases.items():
        assert sorted(phase.outputs) == sorted(stock[name]), name
        assert all(len(ids) == phase.max_tokens for ids in phase.outputs.values()), name



class _FakeHarness(Harness):
    """A Harness over a native Engine driven directly (no vLLM): for the control test of `check_pool`."""

    def __init__(self, engine: Any, host: torch.Tensor) -> None:  # Harness.__init__ reads a live vLLM: not called
        self.engine, self.hosts = engine, {0: host}

    def held_blocks(self) -> set[int]:
        return set()


def test_check_pool_reports_an_incoherent_slot_and_a_stale_resident_block() -> None:
    # Control: the checks above must be able to fail. One layer, 12 blocks of one row streamed through the pool.
    available, why = activekv_status()
    if not available:
        pytest.skip(why)
    import activekv._backend as backend

    heads = SPEC["num_attention_heads"]
    engine = backend.Engine(1, heads, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, POOL_BLOCKS, 4)
    nb, seq = 16, 12 * BLOCK_SIZE
    cache = torch.zeros(nb, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    gen = torch.Generator().manual_seed(0)
    keys, values = (torch.randn(seq, NUM_KV_HEADS, HEAD_SIZE, generator=gen) for _ in range(2))
    engine.update_kv(0, keys, values, cache, torch.arange(seq))
    plan = engine.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq], dtype=torch.int32),
                        torch.arange(nb, dtype=torch.int32).view(1, nb), 1, 1)
    engine.forward(0, plan, torch.randn(1, heads, HEAD_SIZE, generator=gen), cache,
                   torch.zeros(1, heads, HEAD_SIZE), HEAD_SIZE ** -0.5)
    h = _FakeHarness(engine, cache.view(nb, NUM_KV_HEADS, 2, BLOCK_SIZE, HEAD_SIZE))
    resident = h.resident(0)
    assert len(resident) == POOL_BLOCKS

    clean = Observed(lru=True)
    check_pool(h, clean, "clean", set(range(12)), {})
    assert clean.problems == []
    stale = Observed(lru=True)  # a step said to use 8 other blocks: the resident ones are not among them
    check_pool(h, stale, "stale", set(range(100, 100 + POOL_BLOCKS)), {})
    assert len(stale.problems) == 1 and "not used by a step" in stale.problems[0]
    block = next(iter(resident))
    cache.view(nb, NUM_KV_HEADS, 2, BLOCK_SIZE, HEAD_SIZE)[block, 0, 1, 0, 0] += 1.0  # a host write the pool missed
    dirty = Observed(lru=True)
    check_pool(h, dirty, "dirty", None, {})
    assert len(dirty.problems) == 1 and f"block {block} in slot" in dirty.problems[0]
    filled = {b: BLOCK_SIZE for b in range(12)}
    check_key_bounds(h, clean, "clean", filled)  # exact: no key metadata held
    assert clean.problems == [] and clean.no_metadata_checked == 1 and clean.bounds_checked == 0
    # The key bounds on a compressed engine (in place: no pool to size) over the same keys, and an exact engine that
    # held key metadata.
    meta = backend.Engine(1, heads, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, 0, 4, mode="compressed",
                          placement="in_place")
    meta_cache = torch.zeros_like(cache)
    meta.update_kv(0, keys, values, meta_cache, torch.arange(seq))
    hm = _FakeHarness(meta, meta_cache.view(nb, NUM_KV_HEADS, 2, BLOCK_SIZE, HEAD_SIZE))
    check_key_bounds(hm, clean, "clean", filled)
    assert clean.problems == [] and clean.bounds_checked == 12
    hm.hosts[0][block, 1, 0, 3, 5] = float(meta.key_max(0)[block, 1, 5]) + 1.0  # a key above its block's maximum
    check_key_bounds(hm, dirty, "dirty", filled)
    assert len(dirty.problems) == 2 and f"key min/max of block {block}" in dirty.problems[1]
    holding = Observed(lru=True)
    fake_exact = SimpleNamespace(mode="exact", key_min=meta.key_min, key_max=meta.key_max)
    check_key_bounds(_FakeHarness(fake_exact, hm.hosts[0]), holding, "holding", filled)
    assert holding.problems == ["holding layer 0: an exact engine holds key min/max"]
