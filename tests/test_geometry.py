"""activekv._geometry: context geometry and the frozen KV-cache layout (bindings/modules/geometry.cpp).

Layout under test (engine/include/activekv/geometry.h):

    // [num_blocks, num_kv_heads, 2, block_size, head_size]   (2: 0 = K, 1 = V)

a pure reinterpretation of vLLM's per-layer view [num_blocks, num_kv_heads, block_size, 2 * head_size].
"""

from __future__ import annotations

import pytest
import torch

import activekv._geometry as geometry  # after torch: the module's import guard needs it

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
# num_layers, num_heads, num_kv_heads, head_size, block_size
SHAPE = (2, 8, 2, 4, 16)


def make(dtype: torch.dtype = torch.float32, tile_blocks: int = 1, **overrides: int) -> geometry.Geometry:
    args = dict(zip(("num_layers", "num_heads", "num_kv_heads", "head_size", "block_size"), SHAPE))
    args.update(overrides)
    return geometry.Geometry(dtype=dtype, tile_blocks=tile_blocks, **args)


# --- construction --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fields_read_back(dtype: torch.dtype) -> None:
    g = geometry.Geometry(3, 12, 4, 64, 32, dtype, 5)
    assert (g.num_layers, g.num_heads, g.num_kv_heads, g.head_size, g.block_size, g.tile_blocks) == (3, 12, 4, 64,
                                                                                                       32, 5)
    assert g.dtype == dtype
    assert g.tile_tokens == 5 * 32


def test_tile_blocks_defaults_to_one() -> None:
    g = geometry.Geometry(1, 4, 4, 8, 16, torch.float32)
    assert g.tile_blocks == 1
    assert g.tile_tokens == 16


def test_fields_are_read_only() -> None:
    g = make()
    with pytest.raises(AttributeError):
        g.block_size = 32  # type: ignore[misc]
    assert g.block_size == SHAPE[4]


@pytest.mark.parametrize(("num_heads", "num_kv_heads", "group"), [(8, 8, 1), (8, 4, 2), (8, 2, 4), (8, 1, 8),
                                                                  (1, 1, 1)])
def test_group_size(num_heads: int, num_kv_heads: int, group: int) -> None:
    assert make(num_heads=num_heads, num_kv_heads=num_kv_heads).group_size == group


@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 3), (6, 4), (2, 4)])
def test_heads_not_a_multiple_of_kv_heads_is_rejected(num_heads: int, num_kv_heads: int) -> None:
    with pytest.raises(ValueError, match=rf"num_heads must be a multiple of num_kv_heads \(GQA\), got {num_heads} "
                                         rf"and {num_kv_heads}"):
        make(num_heads=num_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("field", ["num_layers", "num_heads", "num_kv_heads", "head_size", "block_size",
                                   "tile_blocks"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_size_is_rejected(field: str, value: int) -> None:
    args = dict(zip(("num_layers", "num_heads", "num_kv_heads", "head_size", "block_size"), SHAPE), tile_blocks=1)
    args[field] = value
    with pytest.raises(ValueError, match=rf"{field} must be > 0, got {value}"):
        geometry.Geometry(dtype=torch.float32, **args)


@pytest.mark.parametrize("dtype", [torch.float64, torch.int32, torch.int8, torch.bool])
def test_unsupported_dtype_is_a_type_error(dtype: torch.dtype) -> None:
    with pytest.raises(TypeError, match="dtype must be float32, bfloat16 or float16"):
        make(dtype=dtype)


def test_supported_lists() -> None:
    assert geometry.supported_dtypes() == list(DTYPES)
    assert geometry.supported_block_sizes() == [16, 32, 64, 128]
    sizes = geometry.supported_head_sizes()
    assert sizes == sorted(sizes) and 64 in sizes and 128 in sizes and all(s > 0 for s in sizes)


# --- slots and blocks ----------------------------------------------------------------------------------------------

BS = SHAPE[4]


@pytest.mark.parametrize("slot", [0, 1, BS - 1, BS, BS + 1, 3 * BS + 7, 2**40 + 3])
def test_slot_to_block(slot: int) -> None:
    assert make().slot_to_block(slot) == (slot // BS, slot % BS)


@pytest.mark.parametrize("slot", [-1, -BS, -(2**40)])
def test_negative_slot_is_an_index_error(slot: int) -> None:
    with pytest.raises(IndexError, match=rf"slot must be >= 0, got {slot}"):
        make().slot_to_block(slot)


@pytest.mark.parametrize(("length", "blocks"), [(0, 0), (1, 1), (BS - 1, 1), (BS, 1), (BS + 1, 2), (2 * BS, 2),
                                                (2 * BS + 1, 3)])
def test_blocks_for(length: int, blocks: int) -> None:
    assert make().blocks_for(length) == blocks


def test_blocks_for_negative_length() -> None:
    with pytest.raises(ValueError, match="length must be >= 0, got -1"):
        make().blocks_for(-1)


@pytest.mark.parametrize(("dtype", "itemsize"), [(torch.float32, 4), (torch.bfloat16, 2), (torch.float16, 2)])
def test_bytes_per_block(dtype: torch.dtype, itemsize: int) -> None:
    g = make(dtype=dtype)
    _, _, kvh, d, bs = SHAPE
    assert g.elements_per_block() == kvh * 2 * bs * d
    assert g.bytes_per_block() == kvh * 2 * bs * d * itemsize
    # The unit matches a real block of a real tensor in the layout.
    assert g.bytes_per_block() == torch.empty(g.kv_cache_shape(1), dtype=dtype).nbytes


@pytest.mark.parametrize("num_blocks", [0, 1, 7])
def test_cache_shapes(num_blocks: int) -> None:
    g = make()
    _, _, kvh, d, bs = SHAPE
    assert g.kv_cache_shape(num_blocks) == [num_blocks, kvh, 2, bs, d]
    assert g.vllm_cache_shape(num_blocks) == [num_blocks, kvh, bs, 2 * d]


@pytest.mark.parametrize("method", ["kv_cache_shape", "vllm_cache_shape"])
def test_cache_shape_negative_blocks(method: str) -> None:
    with pytest.raises(ValueError, match="num_blocks must be >= 0, got -2"):
        getattr(make(), method)(-2)


# --- as_block_layout -----------------------------------------------------------------------------------------------


def vllm_cache(g: geometry.Geometry, num_blocks: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(g.vllm_cache_shape(num_blocks), generator=gen).to(g.dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("num_blocks", [0, 1, 5])
def test_vllm_shape_becomes_a_view_of_the_same_bytes(dtype: torch.dtype, num_blocks: int) -> None:
    g = make(dtype=dtype)
    cache = vllm_cache(g, num_blocks)
    before = cache.clone()
    view = geometry.as_block_layout(g, cache)
    assert list(view.shape) == g.kv_cache_shape(num_blocks)
    assert view.dtype == dtype
    assert view.is_contiguous()
    assert view.data_ptr() == cache.data_ptr()
    assert torch.equal(view, cache.view(g.kv_cache_shape(num_blocks)))
    assert torch.equal(cache, before)


def test_reinterpretation_is_per_block_and_head_bytes() -> None:
    """[bs, 2d] -> [2, bs, d] within each (block, head): element [b, h, c, t, :] is the flat run's chunk c * bs + t,
    which is *not* the semantic K/V split [b, h, t, :d] / [b, h, t, d:] of vLLM's row."""
    g = make()
    _, _, kvh, d, bs = SHAPE
    cache = vllm_cache(g, 3, seed=1)
    view = geometry.as_block_layout(g, cache)
    for b in range(3):
        for h in range(kvh):
            flat = cache[b, h].reshape(-1)
            for c in range(2):
                for t in (0, 1, bs - 1):
                    start = (c * bs + t) * d
                    assert torch.equal(view[b, h, c, t], flat[start:start + d])
    # K of token 0 is vLLM row 0's first half; K of token 1 is vLLM row 0's *second* half.
    assert torch.equal(view[1, 1, 0, 0], cache[1, 1, 0, :d])
    assert torch.equal(view[1, 1, 0, 1], cache[1, 1, 0, d:])


def test_writes_through_the_view_reach_the_original() -> None:
    g = make()
    cache = torch.zeros(g.vllm_cache_shape(2))
    view = geometry.as_block_layout(g, cache)
    _, _, kvh, d, bs = SHAPE
    view[1, 0, 1, 3].fill_(7.0)  # V of token 3, block 1, KV head 0
    start = ((1 * kvh + 0) * 2 * bs + (1 * bs + 3)) * d
    flat = cache.view(-1)
    assert torch.equal(flat[start:start + d], torch.full((d,), 7.0))
    assert int(flat.count_nonzero()) == d


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_block_layout_passes_through(dtype: torch.dtype) -> None:
    g = make(dtype=dtype)
    cache = torch.zeros(g.kv_cache_shape(4), dtype=dtype)
    view = geometry.as_block_layout(g, cache)
    assert view.data_ptr() == cache.data_ptr()
    assert list(view.shape) == g.kv_cache_shape(4)


def test_contiguous_slice_with_offset_is_accepted() -> None:
    g = make()
    cache = vllm_cache(g, 4)[1:3]
    view = geometry.as_block_layout(g, cache)
    assert view.data_ptr() == cache.data_ptr()
    assert torch.equal(view, cache.view(g.kv_cache_shape(2)))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.int32])
def test_as_block_layout_wrong_dtype(dtype: torch.dtype) -> None:
    g = make(dtype=torch.float32)
    cache = torch.zeros(g.vllm_cache_shape(2), dtype=dtype)
    with pytest.raises(TypeError, match="kv_cache must have dtype Float"):
        geometry.as_block_layout(g, cache)


def test_as_block_layout_names_the_argument() -> None:
    g = make()
    with pytest.raises(TypeError, match="my_cache must have dtype"):
        geometry.as_block_layout(g, torch.zeros(g.vllm_cache_shape(1), dtype=torch.float64), "my_cache")


@pytest.mark.parametrize(
    "shape",
    [
        [2, 2, 16, 4],      # [.., 2 * head_size] missing its factor 2
        [2, 2, 32, 4],      # vLLM CPU_ATTN's [.., 2 * block_size, head_size] reading of the same bytes
        [2, 4, 16, 8],      # wrong num_kv_heads
        [2, 2, 8, 8],       # wrong block_size
        [2, 2, 3, 16, 4],   # 5-D with 3 in the K/V slot
        [2, 2, 2, 16, 8],   # 5-D with the wrong head_size
    ],
)
def test_as_block_layout_wrong_shape(shape: list[int]) -> None:
    g = make()
    with pytest.raises(ValueError, match=r"kv_cache must be \[2, 2, "):
        geometry.as_block_layout(g, torch.zeros(shape))


@pytest.mark.parametrize("shape", [[2, 2, 16], [64], [1, 2, 2, 2, 16, 4]])
def test_as_block_layout_wrong_rank(shape: list[int]) -> None:
    g = make()
    with pytest.raises(ValueError, match=r"kv_cache must be \[num_blocks, num_kv_heads, 2, block_size, head_size\] "
                                         r"or vLLM's"):
        geometry.as_block_layout(g, torch.zeros(shape))


@pytest.mark.parametrize("kind", ["transposed", "strided_blocks"])
def test_as_block_layout_non_contiguous(kind: str) -> None:
    g = make()
    nb, (_, _, kvh, d, bs) = 4, SHAPE
    if kind == "transposed":
        cache = torch.zeros(nb, kvh, 2 * d, bs).transpose(2, 3)
    else:
        cache = torch.zeros(2 * nb, kvh, bs, 2 * d)[::2]
    assert list(cache.shape) == g.vllm_cache_shape(nb) and not cache.is_contiguous()
    with pytest.raises(ValueError, match="kv_cache must be contiguous"):
        geometry.as_block_layout(g, cache)
