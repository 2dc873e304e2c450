"""The prompts and the scoring of compressed mode's quality measurement on the real model (tools/quality.py).

Every prompt is one user turn of SmolLM2-135M-Instruct's chat template (tools/real_model.py) holding a document, then
a question, with the assistant turn opened by the first words of the answer ("The pass key is"), so that the model's
next tokens are the answer itself. The document is Python's own documentation (`pydoc_data.topics`, installed with
the interpreter: the topics in name order, paragraph by paragraph, always from the first), cut to the context length,
with short sentences planted between its paragraphs, each at the paragraph start nearest a token offset:

- passkey (`passkey_stream`): "The pass key is 48213. Remember it. 48213 is the pass key." (the needle of Mohtashami
  and Jaggi's passkey test) at one offset; "What is the pass key?", answered from "The pass key is". One needle is cut
  at several context lengths, so it sits at a different depth of each (offset 1,800: 90% of a 2k prompt, 45% of 4k).
- facts (`facts`): one document with nine planted sentences, asked six questions: the keys of four names ("The key
  for Alice is 12345.", one name asked per prompt: multikey), a six-digit code in two halves at two places ("The first
  half of the secret code is 417." ... "The second half of the secret code is 862.", the whole asked: splitkey) and
  three fruits of the day spread through the document, all asked at once (listing: attention must reach every one of
  them in the same steps, the aggregation case where top-k selection is known to lose, MagicPIG).
- continuation (`continuation`): a passkey needle's document alone, no question; the model continues it (compared
  with exact mode, not scored).

Any two prompts share their tokens up to the first planted sentence where they differ, and the prompts cut from one
needle share everything before their question: with vLLM's prefix caching an engine computes such a prefix once
(`unique_tokens` counts what is left to compute). That is what lets `make quality` afford nine engines.

Scoring (`score`), on the generated text up to the end of the turn: for a key, the answer's digit groups (maximal runs
of digits) are joined in order, and the answer is right when the first one, or the first two (a key given in two
halves, "417 and the second half is 862"), equal the planted digits: "48213. Remember it." -> 48213 is right,
"4821" and "482130" are not. For the listing, the share of the planted fruits the answer names as whole words
(case-insensitive).
"""

from __future__ import annotations

import random
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any

PASSKEY = "passkey"
MULTIKEY = "multikey"
SPLITKEY = "splitkey"
LISTING = "listing"
CONTINUATION = "continuation"
TASKS = (PASSKEY, MULTIKEY, SPLITKEY, LISTING, CONTINUATION)
KEY_TASKS = (PASSKEY, MULTIKEY, SPLITKEY)

NAMES = ("Alice", "Bob", "Carol", "Dave")
FRUITS = ("mango", "cherry", "lemon", "banana", "peach", "grape", "plum", "melon")
# Where `facts` plants its sentences, as fractions of the document: kinds interleaved through it.
FACT_LAYOUT = (("fruit", 0.1), ("name", 0.2), ("half", 0.3), ("name", 0.4), ("fruit", 0.5), ("name", 0.6),
               ("half", 0.7), ("name", 0.8), ("fruit", 0.9))


def stream_paragraphs() -> list[str]:
    """The document stream: every `pydoc_data.topics` topic in name order, split at blank lines, stripped."""
    from pydoc_data.topics import topics

    return [p.strip() for name in sorted(topics) for p in str(topics[name]).split("\n\n") if p.strip()]


def key_answered(text: str, key: str) -> bool:
    """Whether an answer gives `key`: its first digit group, or its first two joined, equal the key's digits."""
    groups = re.findall(r"\d+", text)
    return bool(groups) and (groups[0] == key or "".join(groups[:2]) == key)


def words_found(text: str, words: Sequence[str]) -> list[str]:
    """The `words` that occur in `text` as whole words, case-insensitive, in the order given."""
    return [w for w in words if re.search(rf"\b{re.escape(w)}\b", text, re.IGNORECASE)]


@dataclass(frozen=True)
class Case:
    """One prompt and what a correct answer holds.

    task: one of TASKS. context: the context length it stands for, prompt + new tokens (1024, 2048, ...).
    depth: where the asked sentence starts, as a fraction of the prompt (the first of them for splitkey and listing;
        None for a continuation). prompt: token ids. expected: the key's digits (one string) or the listing's words;
        empty for a continuation. asked: the name asked for (multikey), else "".
    """

    task: str
    context: int
    depth: float | None
    prompt: tuple[int, ...] = field(repr=False)
    expected: tuple[str, ...]
    asked: str = ""

    @property
    def name(self) -> str:
        """A stable name for reports: task/context/depth in percent[/name asked]."""
        depth = "-" if self.depth is None else f"{round(100 * self.depth)}"
        return f"{self.task}/{self.context}/{depth}" + (f"/{self.asked}" if self.asked else "")


def score(case: Case, text: str) -> float:
    """1.0 or 0.0 for a key, the share of the words named for a listing. Raises ValueError for a continuation."""
    if case.task in KEY_TASKS:
        return float(key_answered(text, case.expected[0]))
    if case.task == LISTING:
        return len(words_found(text, case.expected)) / len(case.expected)
    raise ValueError(f"{case.task} cases are compared with exact mode, not scored")


class Builder:
    """Builds prompts as token ids for one tokenizer (a transformers tokenizer with SmolLM2's chat template).

    The document stream is tokenized paragraph by paragraph (each followed by a blank line), so a document is a
    concatenation of whole-paragraph token lists, and the same part of the stream is the same tokens in every prompt.
    """

    PLACEHOLDER = "\x00CONTENT\x00"

    def __init__(self, tokenizer: Any, paragraphs: Sequence[str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.paragraphs = list(paragraphs) if paragraphs is not None else stream_paragraphs()
        text = tokenizer.apply_chat_template([{"role": "user", "content": self.PLACEHOLDER}],
                                             add_generation_prompt=True, tokenize=False)
        head, tail = text.split(self.PLACEHOLDER)
        self.head = self.encode(head)
        self.tail = self.encode(tail)

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    @cached_property
    def stream(self) -> tuple[list[int], list[int]]:
        """(token ids of the whole stream, the offsets where its paragraphs start)."""
        ids: list[int] = []
        starts: list[int] = []
        for p in self.paragraphs:
            starts.append(len(ids))
            ids += self.encode(p + "\n\n")
        return ids, starts

    def document(self, filler: int, planted: Sequence[tuple[int, str]]) -> tuple[list[int], list[int]]:
        """The first `filler` tokens of the stream (the last paragraph cut at a token), with each planted sentence
        inserted as a paragraph of its own at the paragraph start nearest its offset (in stream tokens).

        Returns (token ids, the offset of each planted sentence in them). Raises ValueError when the stream is shorter
        than `filler`, or an offset is not in [0, filler) or not after the one before."""
        ids, starts = self.stream
        if filler > len(ids):
            raise ValueError(f"the document stream holds {len(ids)} tokens, {filler} asked")
        offsets = [o for o, _ in planted]
        if any(not 0 <= o < filler for o in offsets) or any(a >= b for a, b in zip(offsets, offsets[1:])):
            raise ValueError(f"planted offsets must be increasing within [0, {filler}), got {offsets}")
        out: list[int] = []
        at_out: list[int] = []
        cut = 0
        for offset, sentence in planted:
            # the paragraph start nearest the offset, not before the last insertion, within the filler
            at = min((s for s in starts if cut <= s <= filler), key=lambda s: abs(s - offset), default=filler)
            out += ids[cut:at]
            at_out.append(len(out))
            out += self.encode(sentence + "\n\n")
            cut = at
        out += ids[cut:filler]
        return out, at_out

    def question_end(self, question: str, answer_start: str) -> list[int]:
        """The tokens after the document: the question, the end of the user turn, the answer's first words."""
        return self.encode("\n\n" + question) + self.tail + self.encode(answer_start)

    def filler_for(self, context: int, new_tokens: int, sentences: Sequence[str], question: str,
                   answer_start: str) -> int:
        """Stream tokens that make a `chat` prompt of exactly `context - new_tokens` tokens."""
        fixed = len(self.head) + len(self.question_end(question, answer_start))
        return context - new_tokens - fixed - sum(len(self.encode(s + "\n\n")) for s in sentences)

    def chat(self, context: int, new_tokens: int, planted: Sequence[tuple[int, str]], question: str,
             answer_start: str) -> tuple[list[int], list[int]]:
        """A chat prompt of exactly `context - new_tokens` tokens: head, document, question, tail, answer start.
        Returns (prompt, offsets of the planted sentences in the prompt). Raises ValueError when it does not fit."""
        filler = self.filler_for(context, new_tokens, [s for _, s in planted], question, answer_start)
        if filler <= 0:
            raise ValueError(f"a context of {context} tokens leaves no room for the document")
        doc, offsets = self.document(filler, planted)
        prompt = self.head + doc + self.question_end(question, answer_start)
        return prompt, [len(self.head) + o for o in offsets]


def _key(rng: random.Random, digits: int = 5) -> str:
    return str(rng.randrange(10 ** (digits - 1), 10 ** digits))


def passkey_sentence(seed: int) -> tuple[str, str]:
    """(the key, the sentence planting it) for a seed."""
    key = _key(random.Random(seed))
    return key, f"The pass key is {key}. Remember it. {key} is the pass key."


def passkey_stream(b: Builder, offset: int, contexts: Sequence[int], new_tokens: int, seed: int) -> list[Case]:
    """One pass key planted at `offset` stream tokens, in a prompt of each context length (the same document cut at
    each length: the prompts share everything before their question)."""
    key, sentence = passkey_sentence(seed)
    cases = []
    for context in contexts:
        prompt, at = b.chat(context, new_tokens, [(offset, sentence)], "What is the pass key?", "The pass key is")
        cases.append(Case(PASSKEY, context, at[0] / len(prompt), tuple(prompt), (key,)))
    return cases


MULTIKEY_QUESTION = "What is the key for {name}?"
SPLITKEY_QUESTION = "What are the first half and the second half of the secret code?"
LISTING_QUESTION = "The text names three fruits of the day. Which are they?"


def facts(b: Builder, context: int, new_tokens: int, seed: int) -> list[Case]:
    """One document with FACT_LAYOUT's nine sentences (four names' keys, a code in two halves, three fruits) and six
    prompts on it: each name's key, the whole code, the three fruits."""
    rng = random.Random(seed)
    names = list(NAMES)
    rng.shuffle(names)
    keys = {n: _key(rng) for n in names}
    halves = [_key(rng, 3), _key(rng, 3)]
    fruits = rng.sample(FRUITS, 3)
    pending = {"name": iter(names), "half": iter(range(2)), "fruit": iter(fruits)}
    sentences, where = [], {}
    for kind, _ in FACT_LAYOUT:
        item = next(pending[kind])
        if kind == "name":
            sentences.append(f"The key for {item} is {keys[item]}.")
        elif kind == "half":
            sentences.append(f"The {('first', 'second')[item]} half of the secret code is {halves[item]}.")
        else:
            sentences.append(f"The fruit of the day is {item}.")
        where[(kind, item)] = len(sentences) - 1
    asks = [(MULTIKEY, MULTIKEY_QUESTION.format(name=n), f"The key for {n} is", (keys[n],), n, where[("name", n)])
            for n in names]
    asks.append((SPLITKEY, SPLITKEY_QUESTION, "The first half of the secret code is", ("".join(halves),), "",
                 where[("half", 0)]))
    asks.append((LISTING, LISTING_QUESTION, "The three fruits of the day are", tuple(fruits), "",
                 where[("fruit", fruits[0])]))
    # One document for all six: sized for the longest question, so the prompts differ only after it.
    longest = max(asks, key=lambda a: len(b.question_end(a[1], a[2])))
    filler = b.filler_for(context, new_tokens, sentences, longest[1], longest[2])
    planted = [(round(f * filler), s) for (_, f), s in zip(FACT_LAYOUT, sentences)]
    doc, offsets = b.document(filler, planted)
    cases = []
    for task, question, start, expected, asked, index in asks:
        prompt = b.head + doc + b.question_end(question, start)
        cases.append(Case(task, context, (len(b.head) + offsets[index]) / len(prompt), tuple(prompt), expected,
                          asked))
    return cases


def continuation(b: Builder, context: int, new_tokens: int, planted: Sequence[tuple[int, str]] = ()) -> Case:
    """The document alone (with those of `planted` that fall within it, placed as `Builder.document` does), no
    question: for greedy agreement with exact mode. Planting a passkey needle's sentence makes it the same document as that needle's prompts, so
    the two share their tokens up to the shorter one's question."""
    room = context - new_tokens - len(b.head)
    kept = [(o, sentence) for o, sentence in planted if o < room]
    filler = room - sum(len(b.encode(sentence + "\n\n")) for _, sentence in kept)
    doc, _ = b.document(filler, [(o, sentence) for o, sentence in kept if o < filler])
    if len(doc) != room:
        raise ValueError(f"a continuation of {context} tokens cannot hold {[o for o, _ in planted]}")
    return Case(CONTINUATION, context, None, tuple(b.head + doc), ())


def unique_tokens(prompts: Sequence[Sequence[int]], block_size: int) -> int:
    """Tokens an engine with prefix caching computes for `prompts` submitted in this order: each prompt's tokens past
    the longest run of whole blocks it shares with an earlier prompt (at least its last token, which vLLM always
    computes). Blocks are told apart as vLLM does, by a hash chained over the blocks before them."""
    seen: set[int] = set()
    total = 0
    for p in prompts:
        h, shared, sharing = 0, 0, True
        for end in range(block_size, len(p) + 1, block_size):
            h = hash((h, tuple(p[end - block_size:end])))
            if sharing and h in seen:
                shared = end
            else:
                sharing = False
            seen.add(h)
        total += len(p) - min(shared, len(p) - 1)
    return total
