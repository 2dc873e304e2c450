"""activekv._attention: online-softmax tiled attention, GQA, causal chunks and decode (bindings/modules/attention.cpp).

Three references:
- tests.reference.engine (same torch ops in the same order): bit for bit, torch.equal;
- torch SDPA in the KV dtype (what a stock backend returns): within TOLERANCE[dtype];
- torch SDPA in float64 on the same values: within TOLERANCE[float32] for every dtype, since the engine's math is
  float32 whatever the KV dtype.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import activekv._attention as attention  # after torch: the module's import guard needs it
from tests.reference import engine as ref

DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# (atol, rtol) of the engine's float32 output against SDPA computed in the KV dtype. Outputs are O(1) (convex
# combinations of N(0, 1) values). The gap is the reference's own rounding:
# - float32: both sides compute in float32 with different summation orders (online softmax vs one softmax); measured
#   <= 1e-6, so torch's float32 defaults (1e-5, 1.3e-6) hold.
# - bfloat16: SDPA rounds the probabilities before P @ V and the output to bfloat16 (8 significant bits: 2^-9
#   relative per rounding); measured <= 8e-3 absolute, so atol 2^-6 with torch's bfloat16 rtol 1.6e-2.
# - float16: the same roundings with 11 significant bits (2^-12 relative each); measured <= 1e-3, so 2^-9 each.
TOLERANCE = {
    torch.float32: (1e-5, 1.3e-6),
    torch.bfloat16: (2**-6, 1.6e-2),
    torch.float16: (2**-9, 2**-9),
}


def make_inputs(num_q: int, seq_len: int, num_heads: int, num_kv_heads: int, head_size: int, block_size: int,
                num_blocks: int, dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(num_q, num_heads, head_size, generator=gen).to(dtype)
    kv = torch.randn(num_blocks, num_kv_heads, 2, block_size, head_size, generator=gen).to(dtype)
    return q, kv


def sdpa(q: torch.Tensor, kv: torch.Tensor, seq_len: int, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """SDPA of the last Lq positions of seq_len, causally, with an explicit bool mask (True = attend).

    q [Lq, H, D], kv [nb, KVH, 2, bs, D] -> [Lq, H, D] in `dtype`. Query head h reads KV head h // (H / KVH).
    """
    lq, h, d = q.shape
    kvh = kv.shape[1]
    k = kv[:, :, 0].permute(1, 0, 2, 3).reshape(kvh, -1, d)[:, :seq_len].repeat_interleave(h // kvh, 0)
    v = kv[:, :, 1].permute(1, 0, 2, 3).reshape(kvh, -1, d)[:, :seq_len].repeat_interleave(h // kvh, 0)
    query_pos = torch.arange(seq_len - lq, seq_len)
    mask = torch.arange(seq_len).unsqueeze(0) <= query_pos.unsqueeze(1)   # [Lq, seq_len]
    out = F.scaled_dot_product_attention(q.transpose(0, 1).to(dtype), k.to(dtype), v.to(dtype), attn_mask=mask,
                                         scale=scale)
    return out.transpose(0, 1)


# num_q, seq_len, num_heads, num_kv_heads, head_size, block_size, num_blocks, tile_blocks
CASES = {
    "one_token_context": (1, 1, 4, 4, 16, 16, 1, 1),
    "decode": (1, 37, 8, 2, 32, 16, 3, 2),
    "decode_block_boundary": (1, 32, 8, 4, 32, 16, 2, 1),
    "decode_one_past_boundary": (1, 33, 8, 4, 32, 16, 3, 1),
    "decode_one_before_boundary": (1, 31, 8, 8, 32, 16, 2, 1),
    "prefill": (37, 37, 4, 1, 16, 8, 5, 2),
    "prefill_block_aligned": (32, 32, 4, 2, 16, 8, 4, 3),
    "chunk": (5, 40, 8, 2, 16, 8, 6, 2),
    "chunk_unaligned": (7, 29, 8, 4, 64, 16, 2, 1),
    "spare_blocks_in_kv": (3, 20, 4, 2, 16, 8, 6, 4),
    "tile_larger_than_row": (4, 50, 8, 2, 32, 16, 4, 10),
    "one_block_tiles": (9, 100, 6, 3, 16, 16, 7, 1),
    "pool_boundary_full_kv": (2, 64, 4, 2, 16, 16, 4, 4),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_bit_exact_with_the_reference(case: tuple[int, ...], dtype: torch.dtype) -> None:
    lq, seq_len, h, kvh, d, bs, nb, tb = case
    q, kv = make_inputs(lq, seq_len, h, kvh, d, bs, nb, dtype, seed=1)
    out = attention.tiled_attention(q, kv, seq_len, tb, d**-0.5)
    assert out.dtype == torch.float32 and list(out.shape) == [lq, h, d]
    assert torch.equal(out, ref.tiled_attention(q, kv, seq_len, tb, d**-0.5))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_matches_sdpa_in_the_kv_dtype(case: tuple[int, ...], dtype: torch.dtype) -> None:
    lq, seq_len, h, kvh, d, bs, nb, tb = case
    q, kv = make_inputs(lq, seq_len, h, kvh, d, bs, nb, dtype, seed=2)
    out = attention.tiled_attention(q, kv, seq_len, tb, d**-0.5)
    atol, rtol = TOLERANCE[dtype]
    torch.testing.assert_close(out, sdpa(q, kv, seq_len, d**-0.5, dtype).float(), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES.values()), ids=list(CASES))
def test_math_is_float32_whatever_the_kv_dtype(case: tuple[int, ...], dtype: torch.dtype) -> None:
    lq, seq_len, h, kvh, d, bs, nb, tb = case
    q, kv = make_inputs(lq, seq_len, h, kvh, d, bs, nb, dtype, seed=3)
    out = attention.tiled_attention(q, kv, seq_len, tb, d**-0.5)
    atol, rtol = TOLERANCE[torch.float32]
    torch.testing.assert_close(out.double(), sdpa(q, kv, seq_len, d**-0.5, torch.float64), atol=atol, rtol=rtol)


@pytest.mark.parametrize("group", [1, 2, 4])
def test_gqa_query_head_reads_kv_head_h_over_group(group: int) -> None:
    """Each query head attends over exactly its KV head: run head by head with one KV head and compare."""
    kvh, d, bs, seq_len, lq = 2, 16, 8, 21, 3
    q, kv = make_inputs(lq, seq_len, kvh * group, kvh, d, bs, 3, torch.float32, seed=4)
    out = attention.tiled_attention(q, kv, seq_len, 2, d**-0.5)
    for head in range(kvh * group):
        one = attention.tiled_attention(q[:, head:head + 1], kv[:, head // group:head // group + 1], seq_len, 2,
                                        d**-0.5)
        torch.testing.assert_close(out[:, head], one[:, 0], atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_result_independent_of_tile_blocks(dtype: torch.dtype) -> None:
    """Different tilings change float32 summation order, so equal within float32 rounding, not bit for bit."""
    lq, seq_len, h, kvh, d, bs, nb = 6, 75, 8, 2, 32, 8, 10
    q, kv = make_inputs(lq, seq_len, h, kvh, d, bs, nb, dtype, seed=5)
    base = attention.tiled_attention(q, kv, seq_len, 1, d**-0.5)
    for tb in (2, 3, 7, 10, 11, 1000):
        torch.testing.assert_close(attention.tiled_attention(q, kv, seq_len, tb, d**-0.5), base, atol=1e-6,
                                   rtol=1e-5)


def test_each_query_sees_only_its_causal_prefix() -> None:
    """A prefill's query i equals a decode of seq_len i + 1 over the same KV (future keys have no influence)."""
    seq_len, h, kvh, d, bs = 19, 4, 2, 16, 8
    q, kv = make_inputs(seq_len, seq_len, h, kvh, d, bs, 3, torch.float32, seed=6)
    prefill = attention.tiled_attention(q, kv, seq_len, 2, d**-0.5)
    for i in (0, 1, bs - 1, bs, seq_len - 1):
        decode = attention.tiled_attention(q[i:i + 1], kv, i + 1, 2, d**-0.5)
        torch.testing.assert_close(prefill[i], decode[0], atol=1e-6, rtol=1e-5)


def test_first_query_of_a_prefill_copies_the_first_value() -> None:
    """Query 0 of a prefill attends to key 0 only: its output is V[0] of its KV head exactly."""
    q, kv = make_inputs(10, 10, 4, 2, 16, 4, 3, torch.float32, seed=7)
    out = attention.tiled_attention(q, kv, 10, 1, 0.25)
    assert torch.equal(out[0], kv[0, :, 1, 0].repeat_interleave(2, 0))


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_unwritten_tail_has_no_influence(dtype: torch.dtype) -> None:
    """Keys/values past seq_len (the rest of the last block, spare blocks) are masked: huge finite garbage there
    leaves the result bit for bit the same."""
    lq, seq_len, h, kvh, d, bs, nb = 3, 13, 4, 2, 16, 8, 3
    q, kv = make_inputs(lq, seq_len, h, kvh, d, bs, nb, dtype, seed=8)
    base = attention.tiled_attention(q, kv, seq_len, 2, d**-0.5)
    junk = kv.clone()
    big = 6e4 if dtype == torch.float16 else 1e30
    junk[1, :, :, seq_len - bs:] = big
    junk[2] = -big
    assert torch.equal(attention.tiled_attention(q, junk, seq_len, 2, d**-0.5), base)


def test_strided_inputs() -> None:
    """vLLM's query is a column slice of the fused QKV output and a row's KV may be a strided view: same result as
    contiguous copies."""
    gen = torch.Generator().manual_seed(11)
    qkv = torch.randn(5, 12, 16, generator=gen)
    q = qkv[:, 4:8]
    kv = torch.randn(8, 2, 2, 4, 16, generator=gen)[::2]
    assert not q.is_contiguous() and not kv.is_contiguous()
    out = attention.tiled_attention(q, kv, 14, 2, 0.25)
    assert torch.equal(out, attention.tiled_attention(q.contiguous(), kv.contiguous(), 14, 2, 0.25))


def test_scale_is_applied() -> None:
    q, kv = make_inputs(2, 10, 4, 2, 16, 8, 2, torch.float32, seed=9)
    for scale in (0.0, 0.1, 2.0):
        torch.testing.assert_close(attention.tiled_attention(q, kv, 10, 1, scale),
                                   sdpa(q, kv, 10, scale, torch.float64).float(), atol=1e-5, rtol=1.3e-6)


# --- grouping and masks --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("num_q", "num_heads", "num_kv_heads"), [(1, 4, 4), (3, 8, 2), (5, 8, 1), (2, 6, 3)])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_group_query_and_ungroup_output(num_q: int, num_heads: int, num_kv_heads: int, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(10)
    q = torch.randn(num_q, num_heads, 8, generator=gen).to(dtype)
    g = num_heads // num_kv_heads
    qg = attention.group_query(q, num_kv_heads)
    assert qg.dtype == torch.float32 and list(qg.shape) == [num_kv_heads, g * num_q, 8]
    assert torch.equal(qg, ref.group_query(q, num_kv_heads))
    # Row g_i * num_q + i of KV head k is query token i, head k * g + g_i.
    for k in range(num_kv_heads):
        for gi in range(g):
            for i in range(num_q):
                assert torch.equal(qg[k, gi * num_q + i], q[i, k * g + gi].float())
    back = attention.ungroup_output(qg, num_q)
    assert torch.equal(back, q.float())
    assert torch.equal(back, ref.ungroup_output(qg, num_q))


MASK_CASES = {
    "decode": (36, 1, 32, 16),
    "prefill_first_tile": (0, 8, 0, 8),
    "prefill_later_tile": (0, 8, 4, 8),
    "chunk": (10, 3, 8, 4),
    "tile_past_every_query": (0, 2, 16, 4),
    "no_keys": (5, 2, 0, 0),
}


@pytest.mark.parametrize("case", list(MASK_CASES.values()), ids=list(MASK_CASES))
def test_tile_mask(case: tuple[int, int, int, int]) -> None:
    first_query_pos, num_q, key_start, num_keys = case
    mask = attention.tile_mask(first_query_pos, num_q, key_start, num_keys)
    assert mask.dtype == torch.bool and list(mask.shape) == [num_q, num_keys]
    for i in range(num_q):
        for j in range(num_keys):
            assert bool(mask[i, j]) == (key_start + j > first_query_pos + i)
    assert torch.equal(mask, ref.tile_mask(first_query_pos, num_q, key_start, num_keys))


@pytest.mark.parametrize(
    ("fn", "args", "match"),
    [
        ("group_query", (torch.zeros(2, 4), 1), r"q must be \[num_q_tokens, num_heads, head_size\], got \[2, 4\]"),
        ("group_query", (torch.zeros(2, 4, 8), 3), r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        ("group_query", (torch.zeros(2, 4, 8), -2), r"num_heads \(4\) must be a multiple of num_kv_heads \(-2\)"),
        ("ungroup_output", (torch.zeros(2, 6), 1), r"out must be \[num_kv_heads, group_size \* num_q_tokens, "
                                                   r"head_size\], got \[2, 6\]"),
        ("ungroup_output", (torch.zeros(2, 6, 8), 4), r"out rows \(6\) must be a multiple of num_q_tokens \(4\)"),
        ("ungroup_output", (torch.zeros(2, 6, 8), -3), r"out rows \(6\) must be a multiple of num_q_tokens \(-3\)"),
        ("tile_mask", (0, -1, 0, 2), "num_q_tokens must be >= 0, got -1"),
        ("tile_mask", (0, 1, 0, -3), "num_keys must be >= 0, got -3"),
    ],
    ids=["q_2d", "heads_not_multiple", "negative_kv_heads", "out_2d", "rows_not_multiple", "negative_num_q_tokens",
         "mask_negative_q_tokens", "mask_negative_keys"],
)
def test_building_blocks_reject_bad_arguments(fn: str, args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        getattr(attention, fn)(*args)


ZERO_DIVISOR_SCRIPT = textwrap.dedent(
    """
    import sys

    import torch

    import activekv._attention as attention

    for name, args, expected in [
        ("group_query", (torch.zeros(2, 4, 8), 0), "must be a multiple of num_kv_heads (0)"),
        ("ungroup_output", (torch.zeros(2, 6, 8), 0), "must be a multiple of num_q_tokens (0)"),
    ]:
        try:
            getattr(attention, name)(*args)
        except ValueError as e:
            if expected not in str(e):
                sys.exit(f"{name}: unexpected message {e}")
        else:
            sys.exit(f"{name}: no ValueError")
    """
)


def test_building_blocks_reject_a_zero_divisor() -> None:
    """group_query(q, 0) and ungroup_output(out, 0) divide by their argument: they must raise ValueError, not kill
    the process with SIGFPE. In a subprocess, so that a regression fails this test instead of the whole session."""
    proc = subprocess.run([sys.executable, "-c", ZERO_DIVISOR_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"exit status {proc.returncode}: {proc.stderr}"


def test_tile_mask_values() -> None:
    assert attention.tile_mask(2, 2, 0, 4).tolist() == [[False, False, False, True], [False, False, False, False]]
    assert attention.tile_mask(0, 1, 0, 3).tolist() == [[False, True, True]]


# --- rejections ----------------------------------------------------------------------------------------------------

GOOD_Q = torch.zeros(2, 4, 8)
GOOD_KV = torch.zeros(3, 2, 2, 4, 8)


@pytest.mark.parametrize(
    ("q", "kv", "seq_len", "tile_blocks", "match"),
    [
        (torch.zeros(4, 8), GOOD_KV, 5, 1, r"q must be \[num_q_tokens, num_heads, head_size\], got \[4, 8\]"),
        (torch.zeros(1, 2, 4, 8), GOOD_KV, 5, 1, r"q must be \[num_q_tokens, num_heads, head_size\], got \[1, 2, 4, "
                                                r"8\]"),
        (GOOD_Q, torch.zeros(3, 2, 8, 8), 5, 1, r"kv must be \[num_blocks, num_kv_heads, 2, block_size, head_size\] "
                                                r"with head_size 8, got \[3, 2, 8, 8\]"),
        (GOOD_Q, torch.zeros(3, 2, 3, 4, 8), 5, 1, r"kv must be .* got \[3, 2, 3, 4, 8\]"),
        (GOOD_Q, torch.zeros(3, 2, 2, 4, 16), 5, 1, r"kv must be .* with head_size 8, got \[3, 2, 2, 4, 16\]"),
        (GOOD_Q, torch.zeros(3, 3, 2, 4, 8), 5, 1, r"num_heads \(4\) must be a multiple of num_kv_heads \(3\)"),
        (GOOD_Q, torch.zeros(3, 0, 2, 4, 8), 5, 1, r"num_heads \(4\) must be a multiple of num_kv_heads \(0\)"),
        (GOOD_Q, GOOD_KV, 5, 0, "tile_blocks must be > 0, got 0"),
        (GOOD_Q, GOOD_KV, 5, -1, "tile_blocks must be > 0, got -1"),
        (torch.zeros(0, 4, 8), GOOD_KV, 5, 1, r"q must hold at least one query token, got \[0, 4, 8\]"),
        (GOOD_Q, GOOD_KV, 1, 1, r"need num_q_tokens \(2\) <= seq_len \(1\) <= num_blocks \* block_size \(12\)"),
        (GOOD_Q, GOOD_KV, 13, 1, r"need num_q_tokens \(2\) <= seq_len \(13\) <= num_blocks \* block_size \(12\)"),
        (GOOD_Q, torch.zeros(0, 2, 2, 4, 8), 2, 1, r"<= num_blocks \* block_size \(0\)"),
        (torch.zeros(2, 0, 8), GOOD_KV, 5, 1, r"q must have num_heads > 0, got \[2, 0, 8\]"),
    ],
    ids=["q_2d", "q_4d", "kv_4d", "kv_not_k_and_v", "kv_head_size", "gqa_ratio", "no_kv_heads", "tile_zero",
         "tile_negative", "empty_query", "seq_shorter_than_query", "seq_past_kv", "empty_kv", "no_query_heads"],
)
def test_invalid_shapes(q: torch.Tensor, kv: torch.Tensor, seq_len: int, tile_blocks: int, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        attention.tiled_attention(q, kv, seq_len, tile_blocks, 1.0)


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_scale_is_refused_as_the_engine_refuses_it(scale: float) -> None:
    with pytest.raises(ValueError, match="scale must be a finite number, got "):
        attention.tiled_attention(GOOD_Q, GOOD_KV, 5, 1, scale)


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.int32, torch.float32), (torch.float32, torch.int64),
                                                  (torch.bool, torch.bool)])
def test_non_floating_inputs_are_a_type_error(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="q and kv must be floating-point tensors, got "):
        attention.tiled_attention(GOOD_Q.to(q_dtype), GOOD_KV.to(kv_dtype), 5, 1, 1.0)


def test_kv_on_another_device_is_rejected() -> None:
    with pytest.raises(ValueError, match="kv must be on q's device cpu, got meta"):
        attention.tiled_attention(GOOD_Q, GOOD_KV.to("meta"), 5, 1, 1.0)


@pytest.mark.parametrize(("q_dtype", "kv_dtype"), [(torch.bfloat16, torch.float32), (torch.float32, torch.float16)])
def test_mixed_float_dtypes_compute_in_float32(q_dtype: torch.dtype, kv_dtype: torch.dtype) -> None:
    q, kv = make_inputs(3, 20, 4, 2, 16, 8, 3, torch.float32, seed=12)
    q, kv = q.to(q_dtype), kv.to(kv_dtype)
    out = attention.tiled_attention(q, kv, 20, 2, 0.25)
    assert torch.equal(out, attention.tiled_attention(q.float(), kv.float(), 20, 2, 0.25))


def test_boundary_seq_lens_are_accepted() -> None:
    """seq_len == num_q_tokens and seq_len == num_blocks * block_size are both legal."""
    assert list(attention.tiled_attention(GOOD_Q, GOOD_KV, 2, 1, 1.0).shape) == [2, 4, 8]
    assert list(attention.tiled_attention(GOOD_Q, GOOD_KV, 12, 1, 1.0).shape) == [2, 4, 8]


# --- GIL -----------------------------------------------------------------------------------------------------------

GIL_SCRIPT = textwrap.dedent(
    """
    import sys
    import threading

    import torch

    import activekv._attention as attention

    # One intra-op thread per call: the float32 matmuls round according to how they are split across intra-op
    # threads, which varies from call to call; with one, any difference between results is interference.
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(256, 16, 64, generator=gen)
    kv = torch.randn(64, 4, 2, 16, 64, generator=gen)
    single = attention.tiled_attention(q, kv, 1024, 4, 0.125)
    barrier = threading.Barrier(2, timeout=30)
    results = [None, None]
    errors = []

    def work(i):
        try:
            barrier.wait()
            results[i] = attention.tiled_attention(q, kv, 1024, 4, 0.125)
        except BaseException as e:  # reported through the exit status
            errors.append(repr(e))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        sys.exit("thread failed: " + "; ".join(errors))
    for i, r in enumerate(results):
        if r is None or not torch.equal(r, single):
            sys.exit(f"thread {i} result differs from the single-thread result")
    """
)


def test_concurrent_calls_from_two_threads() -> None:
    """tiled_attention releases the GIL; two threads at once must neither deadlock nor disturb each other's result
    (bit for bit, with one intra-op thread each). Runs in a subprocess with a timeout so that a deadlock fails the
    test instead of hanging the session."""
    proc = subprocess.run([sys.executable, "-c", GIL_SCRIPT], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_non_finite_value_reaches_only_the_rows_that_see_its_key(bad: float, dtype: torch.dtype) -> None:
    """A prefill chunk of 4 queries whose last key's V holds a NaN (or an inf): the earlier 3 rows never see that key,
    yet 0 x NaN in P x V made them NaN. They now equal attention over the keys they see; the last row, which sees it,
    is non-finite; the engine and the reference agree bit for bit."""
    q, kv = make_inputs(4, 20, 4, 2, 16, 8, 3, dtype, seed=7)
    kv[2, 1, 1, 3, 5] = bad  # block 2 offset 3 = position 19, the last query's own key; KV head 1, dimension 5
    out = attention.tiled_attention(q, kv, 20, 1, 0.25)
    want = ref.tiled_attention(q, kv, 20, 1, 0.25)
    torch.testing.assert_close(out, want, atol=0, rtol=0, equal_nan=True)
    clean = kv.clone()
    clean[2, 1, 1, 3, 5] = 0.0
    earlier = attention.tiled_attention(q, clean, 20, 1, 0.25)[:3]
    assert bool(out[:3].isfinite().all())
    torch.testing.assert_close(out[:3], earlier, atol=1e-6, rtol=1e-6)
    assert not bool(out[3, 2:, 5].isfinite().any())  # query heads 2-3 read KV head 1
    assert bool(out[3, :2].isfinite().all()) and bool(out[3, 2:, :5].isfinite().all())
