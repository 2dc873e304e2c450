"""Compressed-mode block selection (activekv._admission.select_blocks, engine/src/selection.cpp): Quest's bound,
GQA combination, tie-breaking, the planted-needle recall, bit-for-bit agreement with the reference, and the native
scoring path (the CPU kernel, used with kernel 'native') against the ATen one."""

from __future__ import annotations

import itertools

import pytest
import torch

import activekv._admission as admission
from tests.reference.engine import select_blocks as ref_select_blocks
from tools.quality_synthetic import planted_needle_recall

KVH, D = 2, 16


def metadata_from_keys(keys: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys [nb * bs, KVH, D] -> per-block (min, max) [nb, KVH, D] float32."""
    blocks = keys.float().view(-1, block_size, keys.shape[1], keys.shape[2])
    return blocks.amin(1), blocks.amax(1)


def quest_bound(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's definition, written out: sum_d max(q_d * min_d, q_d * max_d); q [G, D], kmin/kmax [C, D] -> [G, C]."""
    return torch.maximum(q[:, None, :] * kmin[None], q[:, None, :] * kmax[None]).sum(-1)


@pytest.mark.parametrize(("gqa", "nb", "sink", "recent", "k"), [(1, 12, 1, 1, 3), (4, 20, 2, 1, 5), (8, 9, 0, 1, 2)])
def test_selection_is_quest_top_k_per_head_with_group_max(gqa: int, nb: int, sink: int, recent: int, k: int) -> None:
    g = torch.Generator().manual_seed(nb)
    q = torch.randn(1, KVH * gqa, D, generator=g)
    kmin = torch.randn(nb, KVH, D, generator=g)
    kmax = kmin + torch.rand(nb, KVH, D, generator=g)
    row = torch.arange(nb, dtype=torch.int64)
    pos = admission.select_blocks(q, kmin, kmax, row, sink, recent, k)
    assert pos.shape == (KVH, sink + k + recent) and pos.dtype == torch.int64
    for h in range(KVH):
        cand = slice(sink, nb - recent)
        score = quest_bound(q[0, h * gqa:(h + 1) * gqa], kmin[cand, h], kmax[cand, h]).amax(0)
        want_top = sorted((torch.argsort(-score, stable=True)[:k] + sink).tolist())
        want = list(range(sink)) + want_top + list(range(nb - recent, nb))
        assert pos[h].tolist() == want, h


@pytest.mark.parametrize("native", [False, True], ids=["aten", "native"])
def test_ties_break_by_lowest_block_index(native: bool) -> None:
    nb, sink, recent, k = 10, 1, 2, 3
    same = torch.ones(nb, KVH, D)
    pos = admission.select_blocks(torch.ones(1, KVH, D), same, same, torch.arange(nb), sink, recent, k,
                                  native_scores=native)
    assert pos.tolist() == [[0, 1, 2, 3, 8, 9]] * KVH
    # a partial tie at the k-th score: blocks 2..7 score 1, 4 and 6 score 2 -> 4, 6 and the lowest tied one (2)
    kmax = same.clone()
    kmax[[4, 6]] = 2.0
    pos = admission.select_blocks(torch.ones(1, KVH, D), same, kmax, torch.arange(nb), sink, recent, k,
                                  native_scores=native)
    assert pos.tolist() == [[0, 1, 4, 6, 8, 9]] * KVH


@pytest.mark.parametrize("native", [False, True], ids=["aten", "native"])
def test_nan_scores_rank_first_and_exactly_k_are_chosen(native: bool) -> None:
    nb, sink, recent, k = 12, 1, 1, 3
    kmin = torch.zeros(nb, KVH, D)
    kmax = torch.arange(nb, dtype=torch.float32).view(nb, 1, 1).expand(nb, KVH, D).contiguous()
    kmax[5, 0, 0] = float("nan")
    pos = admission.select_blocks(torch.ones(1, KVH, D), kmin, kmax, torch.arange(nb), sink, recent, k,
                                  native_scores=native)
    assert pos.tolist() == [[0, 5, 9, 10, 11], [0, 8, 9, 10, 11]]


@pytest.mark.parametrize("seed", range(6))
def test_native_top_k_takes_the_set_of_the_aten_top_k_with_ties_nan_and_infinities(seed: int) -> None:
    """The native path chooses with std::nth_element, the ATen path with at::topk and a tie rule. Scores here are
    small integers (and +-inf, NaN, -0), exact in either summation order, with many ties at the k-th score: both paths
    must take the same blocks."""
    g = torch.Generator().manual_seed(seed)
    nb, gqa = 40, 2
    q = torch.zeros(1, KVH * gqa, D)
    q[0, :, 0] = 1.0  # the bound is kmax[:, h, 0] (the other dimensions are 0 x finite values)
    kmin = torch.zeros(nb, KVH, D)
    kmax = torch.randint(-2, 3, (nb, KVH, D), generator=g).float()
    specials = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0])
    where = torch.randint(0, nb, (4, KVH), generator=g)
    for i in range(4):
        for h in range(KVH):
            kmax[where[i, h], h, 0] = specials[i]
    kmin[:, :, 0] = torch.minimum(kmax[:, :, 0].nan_to_num(0.0), torch.zeros(()))  # min <= max where finite
    row = torch.randperm(nb, generator=g)
    for k in (1, 5, 17, 34):
        aten = admission.select_blocks(q, kmin, kmax, row, 2, 3, k)
        native = admission.select_blocks(q, kmin, kmax, row, 2, 3, k, native_scores=True)
        assert torch.equal(native, aten), (seed, k)
        assert torch.equal(native, ref_select_blocks(q, kmin, kmax, row, 2, 3, k)), (seed, k)


@pytest.mark.parametrize("gqa", [1, 3, 4, 8])
@pytest.mark.parametrize("d", [40, 64, 80, 128])
def test_native_scores_are_within_float32_rounding_of_aten_and_select_the_same_blocks(gqa: int, d: int) -> None:
    """The CPU kernel sums the bound in another order (vectorised fused multiply-adds) than the two matmuls: scores
    agree to a few float32 ulps of the terms' magnitude (tolerance: 1e-5 relative to sum_d |q_d| max(|min_d|,
    |max_d|), about 50 ulps), and on these inputs they select the same blocks. Head size 40 is off AVX-512's vector
    width (a scalar tail per head after the vector part); 16 heads are summed at a time, 4 to 32 query heads per
    block (a last group of fewer than 16, groups of 3 that do not divide 16)."""
    g = torch.Generator().manual_seed(d * gqa)
    kvh, hb = 4, 600
    q = torch.randn(1, kvh * gqa, d, generator=g)
    kmin = torch.randn(hb, kvh, d, generator=g)
    kmax = kmin + torch.rand(hb, kvh, d, generator=g)
    ids = torch.randperm(hb, generator=g)[:500]
    aten = admission.quest_scores(q, kmin, kmax, ids)
    native = admission.quest_scores(q, kmin, kmax, ids, native=True)
    assert native.shape == aten.shape == (kvh, 500) and native.dtype == torch.float32
    magnitude = (q.abs().view(kvh, gqa, 1, d) * torch.maximum(kmin.abs(), kmax.abs())[ids].permute(1, 0, 2)
                 .unsqueeze(1)).sum(-1).amax(1)
    assert ((native - aten).abs() <= 1e-5 * magnitude).all()
    for k in (1, 37, 200):
        args = (q, kmin, kmax, ids, 2, 3, k)
        assert torch.equal(admission.select_blocks(*args, native_scores=True), admission.select_blocks(*args))


def test_native_scores_do_not_depend_on_the_thread_count() -> None:
    g = torch.Generator().manual_seed(7)
    q = torch.randn(1, 32, 128, generator=g)
    kmin = torch.randn(3000, 8, 128, generator=g)
    kmax = kmin + torch.rand(3000, 8, 128, generator=g)
    ids = torch.randperm(3000, generator=g)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        one = admission.quest_scores(q, kmin, kmax, ids, native=True)
        torch.set_num_threads(2)
        two = admission.quest_scores(q, kmin, kmax, ids, native=True)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("native", [False, True], ids=["aten", "native"])
@pytest.mark.parametrize("d", [16, 40])
def test_metadata_in_the_kv_dtype_scores_as_its_float32_widening(dtype: torch.dtype, native: bool, d: int) -> None:
    """The engine keeps key metadata in the KV dtype (kv_state.h). Both scoring paths widen it exactly, so the bound
    is bit for bit the one of the same values in float32, and so is the selection; head size 40 runs the native
    kernel's scalar tail."""
    g = torch.Generator().manual_seed(d)
    nb, gqa = 48, 4
    q = torch.randn(1, KVH * gqa, d, generator=g)
    keys = torch.randn(nb * 16, KVH, d, generator=g).to(dtype)
    kmin, kmax = metadata_from_keys(keys, 16)
    kmin_d, kmax_d = kmin.to(dtype), kmax.to(dtype)
    assert torch.equal(kmin_d.float(), kmin) and torch.equal(kmax_d.float(), kmax)  # exact in the KV dtype
    ids = torch.randperm(nb, generator=g)
    got = admission.quest_scores(q, kmin_d, kmax_d, ids, native=native)
    assert got.dtype == torch.float32
    assert torch.equal(got, admission.quest_scores(q, kmin, kmax, ids, native=native))
    row = torch.arange(nb)
    assert torch.equal(admission.select_blocks(q, kmin_d, kmax_d, row, 1, 2, 9, native_scores=native),
                       admission.select_blocks(q, kmin, kmax, row, 1, 2, 9, native_scores=native))


def test_selection_matches_reference_bit_for_bit() -> None:
    g = torch.Generator().manual_seed(3)
    for dtype, gqa in itertools.product((torch.float32, torch.bfloat16, torch.float16), (1, 4)):
        q = torch.randn(1, KVH * gqa, D, generator=g).to(dtype)
        kmin = torch.randn(64, KVH, D, generator=g).to(dtype)  # metadata in the KV dtype, as the engine keeps it
        kmax = (kmin.float() + torch.rand(64, KVH, D, generator=g)).to(dtype)
        row = torch.randperm(64, generator=g)[:40]
        args = (q, kmin, kmax, row, 1, 2, 6)
        assert torch.equal(admission.select_blocks(*args), ref_select_blocks(*args)), (dtype, gqa)


@pytest.mark.parametrize(("kwargs", "exc", "match"), [
    ({"q": torch.zeros(2, KVH, D)}, ValueError, r"q must be \[1, num_heads, head_size\]"),
    ({"key_min": torch.zeros(8, KVH, D, dtype=torch.float64)}, TypeError, "must both be float32, bfloat16 or float16"),
    ({"key_min": torch.zeros(8, KVH, D, dtype=torch.bfloat16)}, TypeError,
     "must both be float32, bfloat16 or float16, got BFloat16 and Float"),
    ({"row_blocks": torch.arange(8, dtype=torch.int32)}, TypeError, "row_blocks must be a 1-D int64 tensor"),
    ({"row_blocks": torch.tensor([0, 1, 2, 3, 4, 5, 99])}, IndexError, r"row_blocks must be in \[0, 8\)"),
    ({"recent_blocks": 0}, ValueError, r"recent_blocks must be in \[1, 2\^40\]"),
    ({"top_k": 5}, ValueError, "needs more than sink \\+ recent \\+ k = 7 blocks, got 7"),
])
def test_bad_selection_inputs_are_rejected(kwargs: dict, exc: type, match: str) -> None:
    args = {"q": torch.zeros(1, KVH, D), "key_min": torch.zeros(8, KVH, D), "key_max": torch.zeros(8, KVH, D),
            "row_blocks": torch.arange(7), "sink_blocks": 1, "recent_blocks": 1, "top_k": 2}
    args.update(kwargs)
    with pytest.raises(exc, match=match):
        admission.select_blocks(**args)


@pytest.mark.parametrize(("block_size", "context_blocks", "budget_blocks"),
                         [(16, 32, 4), (16, 64, 8), (32, 48, 6), (16, 128, 4)])
def test_planted_needle_is_always_selected(block_size: int, context_blocks: int, budget_blocks: int) -> None:
    assert planted_needle_recall(block_size, context_blocks, budget_blocks, trials=8) == 1.0


def test_planted_needle_at_every_position() -> None:
    # each candidate block position holds the needle once.
    assert planted_needle_recall(16, 24, 4, 0, positions=range(1, 23)) == 1.0


def test_weak_needle_is_missed() -> None:
    # Quest's bound is an upper bound: below the noise blocks' bound the needle loses (docs/quality.md, synthetic).
    assert planted_needle_recall(16, 64, 4, 8, noise=0.1, needle=0.25) < 0.5
