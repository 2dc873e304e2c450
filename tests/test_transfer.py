"""activekv._transfer: batched block copies between the host tier and the pool (bindings/modules/transfer.cpp).

copy_blocks(src, dst, src_ids, dst_ids): dst[dst_ids[i]] = src[src_ids[i]] along dim 0, one gather then one scatter;
returns the bytes copied.
"""

from __future__ import annotations

import pytest
import torch

import activekv._transfer as transfer  # after torch: the module's import guard needs it

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# Block shape of the layout [num_kv_heads, 2, block_size, head_size].
BLOCK = (2, 2, 4, 8)
SRC_BLOCKS, DST_BLOCKS = 7, 4


def blocks(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, *BLOCK, generator=gen).to(dtype)


def block_bytes(dtype: torch.dtype) -> int:
    return torch.empty(BLOCK, dtype=dtype).nbytes


ID_CASES = {
    "empty": ([], []),
    "one_block": ([3], [1]),
    "pool_boundary": ([SRC_BLOCKS - 1, 0], [DST_BLOCKS - 1, 0]),
    "reordered": ([5, 1, 6], [2, 0, 3]),
    "whole_pool": ([6, 4, 2, 0], [0, 1, 2, 3]),
    "same_source_twice": ([2, 2], [0, 3]),
}


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize(("src_ids", "dst_ids"), list(ID_CASES.values()), ids=list(ID_CASES))
def test_copies_exactly_the_listed_blocks(dtype: torch.dtype, src_ids: list[int], dst_ids: list[int]) -> None:
    src, dst = blocks(SRC_BLOCKS, dtype, seed=1), blocks(DST_BLOCKS, dtype, seed=2)
    src_before = src.clone()
    expected = dst.clone()
    for s, d in zip(src_ids, dst_ids):
        expected[d] = src[s]
    copied = transfer.copy_blocks(src, dst, src_ids, dst_ids)
    assert copied == len(src_ids) * block_bytes(dtype)
    assert torch.equal(dst, expected)
    assert torch.equal(src, src_before)


def test_empty_lists_copy_nothing_even_from_an_empty_source() -> None:
    src, dst = torch.zeros(0, *BLOCK), blocks(DST_BLOCKS, torch.float32, seed=3)
    before = dst.clone()
    assert transfer.copy_blocks(src, dst, [], []) == 0
    assert torch.equal(dst, before)


def test_pool_to_host_direction() -> None:
    host, pool = blocks(SRC_BLOCKS, torch.float32, seed=4), blocks(DST_BLOCKS, torch.float32, seed=5)
    expected = host.clone()
    expected[6], expected[0] = pool[1], pool[3]
    assert transfer.copy_blocks(pool, host, [1, 3], [6, 0]) == 2 * block_bytes(torch.float32)
    assert torch.equal(host, expected)


def test_within_one_tensor_gathers_before_scattering() -> None:
    """Overlapping ids in one tensor: every destination gets the source's bytes from before the call."""
    t = blocks(4, torch.float32, seed=6)
    before = t.clone()
    transfer.copy_blocks(t, t, [0, 1, 2], [1, 2, 3])
    assert torch.equal(t[0], before[0])
    assert torch.equal(t[1:], before[:3])


def test_non_contiguous_destination() -> None:
    """A strided view as destination (every other block of a larger tensor) receives the blocks in place."""
    src = blocks(SRC_BLOCKS, torch.float32, seed=7)
    backing = blocks(2 * DST_BLOCKS, torch.float32, seed=8)
    dst = backing[::2]
    expected = backing.clone()
    expected[2], expected[6] = src[0], src[5]
    assert transfer.copy_blocks(src, dst, [0, 5], [1, 3]) == 2 * block_bytes(torch.float32)
    assert torch.equal(backing, expected)


@pytest.mark.parametrize("trailing", [(2, 2, 4, 4), (1, 2, 4, 8), (2, 2, 8, 8)])
def test_mismatched_trailing_shape(trailing: tuple[int, ...]) -> None:
    src, dst = blocks(SRC_BLOCKS, torch.float32, seed=9), torch.zeros(DST_BLOCKS, *trailing)
    with pytest.raises(ValueError, match=r"src and dst must share their trailing block shape, got src \[7, 2, 2, 4, "
                                         r"8\] and dst \[4, "):
        transfer.copy_blocks(src, dst, [0], [0])
    assert int(dst.count_nonzero()) == 0


@pytest.mark.parametrize(("src_shape", "dst_shape"), [((7, 64), (4, 2, 32)), ((7,), (4, 1)), ((), ())])
def test_mismatched_rank(src_shape: tuple[int, ...], dst_shape: tuple[int, ...]) -> None:
    with pytest.raises(ValueError, match="src and dst must share their trailing block shape"):
        transfer.copy_blocks(torch.zeros(src_shape), torch.zeros(dst_shape), [], [])


@pytest.mark.parametrize("dst_dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_mismatched_dtype(dst_dtype: torch.dtype) -> None:
    src, dst = blocks(SRC_BLOCKS, torch.float32, seed=10), torch.zeros(DST_BLOCKS, *BLOCK, dtype=dst_dtype)
    with pytest.raises(TypeError, match="src and dst must share a dtype, got Float and "):
        transfer.copy_blocks(src, dst, [0], [0])
    assert int(dst.count_nonzero()) == 0


@pytest.mark.parametrize(("src_ids", "dst_ids"), [([0, 1], [0]), ([], [2]), ([3], [])])
def test_mismatched_lengths(src_ids: list[int], dst_ids: list[int]) -> None:
    src, dst = blocks(SRC_BLOCKS, torch.float32, seed=11), torch.zeros(DST_BLOCKS, *BLOCK)
    with pytest.raises(ValueError, match=rf"src_ids and dst_ids must have equal lengths, got {len(src_ids)} and "
                                         rf"{len(dst_ids)}"):
        transfer.copy_blocks(src, dst, src_ids, dst_ids)
    assert int(dst.count_nonzero()) == 0


@pytest.mark.parametrize(
    ("src_ids", "dst_ids", "match"),
    [
        ([SRC_BLOCKS], [0], rf"src_ids\[0\] must be in \[0, {SRC_BLOCKS}\), got {SRC_BLOCKS}"),
        ([0, -1], [0, 1], rf"src_ids\[1\] must be in \[0, {SRC_BLOCKS}\), got -1"),
        ([0, 1], [0, DST_BLOCKS], rf"dst_ids\[1\] must be in \[0, {DST_BLOCKS}\), got {DST_BLOCKS}"),
        ([2], [-3], rf"dst_ids\[0\] must be in \[0, {DST_BLOCKS}\), got -3"),
    ],
)
def test_out_of_range_ids_copy_nothing(src_ids: list[int], dst_ids: list[int], match: str) -> None:
    src, dst = blocks(SRC_BLOCKS, torch.float32, seed=12), torch.zeros(DST_BLOCKS, *BLOCK)
    with pytest.raises(IndexError, match=match):
        transfer.copy_blocks(src, dst, src_ids, dst_ids)
    assert int(dst.count_nonzero()) == 0   # the valid pairs before the bad one were not copied either
