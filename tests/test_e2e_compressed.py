"""End to end through vLLM 0.32.0: ActiveKV compressed mode generating on the tiny local Llama, every step replayed.

One in-process engine (mode=compressed, a 128-token budget, contexts of 300-723 tokens) generates greedily while
`tools.capture` records each layer forward: query, output, step plan, selections and the KV blocks the rows
reference. The tests then check the selection telemetry (fewer blocks attended than the contexts hold) and replay every
recorded layer forward on a fresh `tests.reference.engine.RefEngine` (compressed mode, same options): outputs and
selections must be equal bit for bit (`torch.equal`), prefill steps (exact) and decode steps (selected) alike.
`tools/capture.py` says why a fresh engine's replay equals the serving engine's step despite different pool and LRU
state. The engine's own replay on a fresh native engine is checked the same way.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tools.capture import LayerCall, Recorder, capture, replay_mismatches
from tools.make_tiny_model import SPEC, make_tiny_model
from tools.vllm_run import ACTIVEKV, EngineConfig, Generation, VllmEngine, activekv_status, make_prompts

pytestmark = pytest.mark.vllm

PROMPT_LENGTHS = (300, 517, 700)
MAX_TOKENS = 24
BLOCK_SIZE = 16
NUM_LAYERS = SPEC["num_hidden_layers"]
NUM_KV_HEADS = SPEC["num_key_value_heads"]
# budget 128 tokens = 8 blocks per KV head: 1 sink + 5 selected + 2 recent; every prompt is longer (19-44 blocks).
# The pool (16 blocks) holds the worst-case union of one row (2 * 5 + 1 + 2 = 13) but not a context, so prefill
# streams through it and decode evicts. pool_blocks given: placement pool, the copy-through-the-pool path (the CPU
# default, placement in place, is tests/test_e2e_vllm.py's in_place_run).
COMPRESSED = {"mode": "compressed", "budget_tokens": 128, "sink_blocks": 1, "recent_blocks": 2, "pool_blocks": 16,
              "tile_blocks": 4}
PER_HEAD = COMPRESSED["budget_tokens"] // BLOCK_SIZE


def _aten_kernel_option() -> dict[str, str]:
    """{"kernel": "aten"} when the installed engine has a kernel option (its ATen path is the one the reference
    mirrors bit for bit); {} when it has only that path."""
    import activekv._backend as backend

    try:
        backend.Engine(1, 2, 1, 32, BLOCK_SIZE, torch.float32, 4, 2, kernel="aten")
    except TypeError:
        return {}
    return {"kernel": "aten"}


def _ref_engine() -> Any:
    from tests.reference.engine import RefEngine

    return RefEngine(1, SPEC["num_attention_heads"], NUM_KV_HEADS, SPEC["head_dim"], BLOCK_SIZE, torch.float32,
                     COMPRESSED["pool_blocks"], COMPRESSED["tile_blocks"], mode="compressed",
                     budget_tokens=COMPRESSED["budget_tokens"], sink_blocks=COMPRESSED["sink_blocks"],
                     recent_blocks=COMPRESSED["recent_blocks"])


def _native_engine(options: dict[str, Any]) -> Any:
    import activekv._backend as backend

    return backend.Engine(1, SPEC["num_attention_heads"], NUM_KV_HEADS, SPEC["head_dim"], BLOCK_SIZE, torch.float32,
                          COMPRESSED["pool_blocks"], COMPRESSED["tile_blocks"], mode="compressed",
                          budget_tokens=COMPRESSED["budget_tokens"], sink_blocks=COMPRESSED["sink_blocks"],
                          recent_blocks=COMPRESSED["recent_blocks"], **options)


@pytest.fixture(scope="module")
def compressed_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[Generation, Recorder, dict[str, str]]:
    available, why = activekv_status()
    if not available:
        pytest.skip(why)
    model = str(make_tiny_model(tmp_path_factory.mktemp("tiny-llama")))
    kernel = _aten_kernel_option()
    config = EngineConfig(model, backend=ACTIVEKV, activekv={**COMPRESSED, **kernel}, block_size=BLOCK_SIZE)
    prompts = make_prompts(PROMPT_LENGTHS, SPEC["vocab_size"], seed=1)
    with VllmEngine(config) as engine, capture() as rec:
        gen = engine.generate(prompts, MAX_TOKENS)
    return gen, rec, kernel


def test_every_layer_forward_was_recorded(compressed_run: tuple[Generation, Recorder, dict[str, str]]) -> None:
    gen, rec, _ = compressed_run
    assert gen.steps == MAX_TOKENS
    assert rec.steps_seen == gen.steps
    assert len(rec.calls) == NUM_LAYERS * gen.steps
    assert [c.is_decode for c in rec.calls] == [False] * NUM_LAYERS + [True] * (len(rec.calls) - NUM_LAYERS)


def test_selection_attends_fewer_blocks_than_the_contexts_hold(
    compressed_run: tuple[Generation, Recorder, dict[str, str]]
) -> None:
    gen, rec, _ = compressed_run
    tel = gen.telemetry
    assert tel is not None
    decode_rows = len(PROMPT_LENGTHS) * (MAX_TOKENS - 1)
    assert tel["compressed_rows"] == NUM_LAYERS * decode_rows  # every decode row is longer than the budget
    assert 0 < tel["selected_blocks"] < tel["compressed_context_blocks"] * NUM_KV_HEADS
    assert tel["selected_blocks"] == tel["compressed_rows"] * NUM_KV_HEADS * PER_HEAD
    assert tel["compressed_rows"] <= tel["union_blocks"] <= tel["selected_blocks"]
    for call in rec.calls[NUM_LAYERS:]:
        assert sorted(call.selection) == list(range(call.num_reqs))
        for r, ids in call.selection.items():
            assert ids.shape == (NUM_KV_HEADS, PER_HEAD)
            row = set(call.row_blocks(r).tolist())
            assert set(ids.reshape(-1).tolist()) <= row and len(row) > PER_HEAD


@pytest.mark.parametrize("which", ["reference", "native"])
def test_each_step_equals_a_fresh_engines_replay(
    compressed_run: tuple[Generation, Recorder, dict[str, str]], which: str
) -> None:
    _, rec, kernel = compressed_run
    mismatches = replay_mismatches(rec.calls, _ref_engine if which == "reference" else lambda: _native_engine(kernel))
    assert not mismatches, "\n".join(mismatches[:10])


def test_recorded_outputs_are_not_trivial(compressed_run: tuple[Generation, Recorder, dict[str, str]]) -> None:
    # Guards the replay test against comparing zeros with zeros.
    _, rec, _ = compressed_run
    call: LayerCall
    for call in rec.calls:
        assert call.output.abs().amax() > 0 and torch.isfinite(call.output).all()
