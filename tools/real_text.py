"""Real-text prompts for the real model (tools/real_model.py), and how two greedy runs of them are compared.

Prompts are chat turns in the model's own template (`tools.real_model.chat_prompt`). Long documents come from Python's
own documentation as the interpreter installs it: `pydoc_data.topics.topics`, the text `help()` prints for a topic
(for example "typesmapping", the documentation of `dict`: 3,352 tokens of this model's tokenizer), so the prompts are
the same on every machine with the same Python and need no download.

Comparing greedy runs (`agreement`): two correct float32 attentions (vLLM's CPU_ATTN, ActiveKV exact) differ only in
summation order, so their logprobs differ by rounding (the end-to-end tests measure and bound it, LOGPROB_ATOL) and
their greedy tokens are equal, except where the reference's best and second-best tokens are within rounding of each
other: a near tie, where either choice is correct and the sequences then continue differently. A difference is
allowed only at a position whose top-1 / top-2 logprob gap, in either run, is below NEAR_TIE; after it the runs are
not compared.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Logprob tolerance between two correct float32 attentions, and the gap under which a top-1/top-2 pair is a near tie:
# the end-to-end tests' tolerance (tests/test_e2e_vllm.py, LOGPROB_ATOL), measured there at 30x the rounding seen.
LOGPROB_ATOL = 1e-3
NEAR_TIE = LOGPROB_ATOL


def document(topic: str) -> str:
    """The text of one `pydoc_data.topics` topic (Python's own documentation). Raises KeyError naming the topic."""
    from pydoc_data.topics import topics

    if topic not in topics:
        raise KeyError(f"pydoc_data.topics has no topic {topic!r}")
    return str(topics[topic])


def document_prompt(tokenizer: Any, topic: str, question: str) -> list[int]:
    """A chat turn holding Python's documentation of `topic`, then `question` about it."""
    from tools.real_model import chat_prompt

    return chat_prompt(tokenizer, f"{document(topic)}\n\n{question}")


def top_gap(top: Mapping[int, float]) -> float:
    """The gap between the best and second-best logprob of one position's {token: logprob} (inf with one entry)."""
    values = sorted(top.values(), reverse=True)
    return values[0] - values[1] if len(values) > 1 else float("inf")


@dataclass(frozen=True)
class Agreement:
    """How one prompt's greedy tokens of a run compare with the reference run's.

    compared: positions compared (all, or up to and including the first difference).
    first_difference: index of the first differing token, or None when all are equal.
    gap: the smaller top-1/top-2 gap of the two runs at that position (None when equal).
    max_logprob_diff: the largest |logprob difference| of the chosen tokens before the first difference.
    """

    compared: int
    first_difference: int | None
    gap: float | None
    max_logprob_diff: float

    @property
    def equal(self) -> bool:
        return self.first_difference is None

    @property
    def ok(self) -> bool:
        """Equal, or different only from a near tie on (and logprobs within LOGPROB_ATOL before it)."""
        near_tie_only = self.equal or (self.gap is not None and self.gap < NEAR_TIE)
        return near_tie_only and self.max_logprob_diff <= LOGPROB_ATOL

    def describe(self) -> str:
        if self.equal:
            return f"tokens equal ({self.compared} of {self.compared}), max |logprob diff| {self.max_logprob_diff:.2g}"
        return (f"tokens equal up to {self.first_difference}, then a {'near tie' if self.ok else 'DIFFERENCE'} "
                f"(top-1/top-2 gap {self.gap:.2g}), max |logprob diff| before it {self.max_logprob_diff:.2g}")


def agreement(want_ids: Sequence[int], want_top: Sequence[Mapping[int, float]], got_ids: Sequence[int],
              got_top: Sequence[Mapping[int, float]]) -> Agreement:
    """Compare one prompt's tokens and top logprobs (a `Generation`'s token_ids[i] and top_logprobs[i], generated with
    logprobs >= 2) of a run against the reference run's. Raises ValueError when the lengths differ."""
    if not (len(want_ids) == len(got_ids) == len(want_top) == len(got_top)):
        raise ValueError(f"lengths differ: tokens {len(want_ids)} vs {len(got_ids)}, "
                         f"logprobs {len(want_top)} vs {len(got_top)}")
    worst = 0.0
    for t, (a, b) in enumerate(zip(want_ids, got_ids)):
        if a != b:
            gap = min(top_gap(want_top[t]), top_gap(got_top[t]))
            return Agreement(t + 1, t, gap, worst)
        worst = max(worst, abs(want_top[t][a] - got_top[t][b]))
    return Agreement(len(want_ids), None, None, worst)
