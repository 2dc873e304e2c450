"""tools/real_text.py: the pydoc documents it takes prompts from, and how two greedy runs are compared (a difference
allowed only at a near tie, logprobs within the tolerance before it)."""

from __future__ import annotations

import pytest

from tools.real_text import LOGPROB_ATOL, NEAR_TIE, agreement, document, top_gap


def test_documents_are_pythons_own_help_text() -> None:
    text = document("typesmapping")
    assert "dict" in text and len(text) > 10_000
    with pytest.raises(KeyError, match="no-such-topic"):
        document("no-such-topic")


def test_top_gap() -> None:
    assert top_gap({1: -0.1, 2: -2.1, 3: -3.0}) == pytest.approx(2.0)
    assert top_gap({1: -0.1}) == float("inf")


def test_equal_runs_agree() -> None:
    top = [{5: -0.1, 6: -3.0}, {7: -0.2, 8: -2.0}]
    got = [{5: -0.1 + 1e-5, 6: -3.0}, {7: -0.2, 8: -2.0}]
    agree = agreement([5, 7], top, [5, 7], got)
    assert agree.equal and agree.ok and agree.compared == 2
    assert agree.max_logprob_diff == pytest.approx(1e-5)


def test_a_difference_at_a_near_tie_is_allowed_and_ends_the_comparison() -> None:
    want = [{5: -0.1, 6: -3.0}, {7: -0.69, 8: -0.69 - NEAR_TIE / 2}, {1: -0.1, 2: -5.0}]
    got = [{5: -0.1, 6: -3.0}, {8: -0.69, 7: -0.69 - NEAR_TIE / 4}, {3: -0.1, 4: -5.0}]
    agree = agreement([5, 7, 1], want, [5, 8, 3], got)
    assert not agree.equal and agree.ok
    assert agree.first_difference == 1 and agree.compared == 2
    assert "near tie" in agree.describe()


def test_a_difference_with_a_clear_margin_fails() -> None:
    want = [{5: -0.1, 6: -3.0}]
    got = [{6: -0.1, 5: -3.0}]
    agree = agreement([5], want, [6], got)
    assert not agree.ok and "DIFFERENCE" in agree.describe()


def test_logprobs_beyond_the_tolerance_fail_even_with_equal_tokens() -> None:
    agree = agreement([5], [{5: -0.1, 6: -3.0}], [5], [{5: -0.1 - 2 * LOGPROB_ATOL, 6: -3.0}])
    assert agree.equal and not agree.ok


def test_lengths_must_match() -> None:
    with pytest.raises(ValueError, match="lengths differ"):
        agreement([5, 6], [{5: 0.0}, {6: 0.0}], [5], [{5: 0.0}])
