"""tools/quality_attention.py's kept_mass: the selection rules it compares, on keys made to show each one."""

from __future__ import annotations

import torch

from tools.quality_attention import kept_mass


def test_concentrated_attention_is_kept_by_every_rule_but_the_fixed_blocks() -> None:
    torch.manual_seed(0)
    k = torch.randn(1, 16 * 20, 8) * 0.01
    q = torch.zeros(2, 8)
    q[:, 0] = 1.0
    k[0, 16 * 9 + 3, 0] = 40.0  # one key in block 9 holds almost all the mass
    kept = kept_mass(q, k, 1.0, 16, 16 * 4)  # sink 1, recent 2, k 1
    assert kept.shape == (2, 4)
    assert (kept[:, :3] > 0.99).all() and (kept[:, 3] < 0.01).all()


def test_uniform_attention_keeps_the_share_of_blocks_selected() -> None:
    k = torch.zeros(2, 16 * 10, 4)
    q = torch.ones(4, 4)
    kept = kept_mass(q, k, 1.0, 16, 16 * 5)  # 5 of 10 blocks: half the mass, 3 of 10 fixed
    assert torch.allclose(kept[:, :3], torch.full((4, 3), 0.5))
    assert torch.allclose(kept[:, 3], torch.full((4,), 0.3))


def test_per_query_head_choice_beats_the_shared_one_when_heads_disagree() -> None:
    k = torch.zeros(1, 16 * 12, 2)
    k[0, 16 * 4, 0] = 30.0  # head 0's block
    k[0, 16 * 7, 1] = 29.0  # head 1's block, a lower bound for its head than head 0's block for head 0
    q = torch.eye(2)
    kept = kept_mass(q, k, 1.0, 16, 16 * 4)  # k 1: the KV head keeps one of the two blocks
    quest, oracle, per_qhead = kept[:, 0], kept[:, 1], kept[:, 2]
    assert quest[0] > 0.99 and quest[1] < 0.01  # the max over query heads picks head 0's block
    assert (per_qhead > 0.99).all() and oracle.sum() < per_qhead.sum()


def test_a_context_within_the_budget_is_not_selected() -> None:
    assert kept_mass(torch.ones(2, 4), torch.zeros(1, 16 * 4, 4), 1.0, 16, 16 * 4) is None
