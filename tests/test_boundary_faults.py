"""One regression test per fault the binding-boundary fuzz suite (tests/fuzz_bindings.py) found; docs/reliability.md
lists them. Each was an unnamed ATen/pybind11 error, undefined behaviour, a silently unspecified result, or a
half-applied change; each is now a named ValueError/TypeError/IndexError with nothing changed."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import activekv._admission as admission  # after torch: the modules' import guard needs it
import activekv._attention as attention
import activekv._backend as backend
import activekv._geometry as geometry
import activekv._kv_state as kv_state
import activekv._transfer as transfer

META = torch.device("meta")


def test_tile_mask_position_overflow_is_a_value_error() -> None:
    """Was signed int64 overflow (undefined behaviour) and then ATen's unnamed 'upper bound and lower bound
    inconsistent with step sign'."""
    with pytest.raises(ValueError, match=r"first_query_pos \+ num_q_tokens must fit in int64"):
        attention.tile_mask(2**63 - 1, 2, 0, 1)
    with pytest.raises(ValueError, match=r"key_start \+ num_keys must fit in int64"):
        attention.tile_mask(0, 1, 2**63 - 2, 3)
    assert attention.tile_mask(2**63 - 3, 2, 2**63 - 4, 1).tolist() == [[False], [False]]


def test_geometry_with_a_block_size_near_int64_max_is_a_value_error() -> None:
    """Was `2 * block_size` computed before the overflow check: signed overflow (undefined behaviour), found by UBSan
    in `make sanitize`'s run of fuzz_geometry (block_size 2^62)."""
    with pytest.raises(ValueError, match="below 2\\^40 elements per block"):
        geometry.Geometry(1, 1, 1, 1, 2**62, torch.float32, 1)


def test_group_query_with_no_heads_is_a_value_error() -> None:
    """Was ATen's 'Stride calculation overflowed' for q [0, 0, 2] and num_kv_heads 2^62."""
    with pytest.raises(ValueError, match=r"q must have num_heads > 0, got \[0, 0, 2\]"):
        attention.group_query(torch.zeros(0, 0, 2), 2**62)


def _selection_args(**kw):
    args = {"q": torch.randn(1, 2, 4), "key_min": torch.zeros(6, 1, 4), "key_max": torch.ones(6, 1, 4),
            "row_blocks": torch.arange(6), "sink_blocks": 1, "recent_blocks": 1, "top_k": 1}
    args.update(kw)
    return args


@pytest.mark.parametrize(("kw", "match"), [
    ({"q": torch.randn(1, 0, 4)}, r"q must have num_heads > 0"),
    ({"row_blocks": torch.arange(6, device=META)}, "row_blocks must hold data"),
    ({"key_min": torch.zeros(6, 1, 4, device=META)}, "key_min must hold data"),
    ({"q": torch.randn(1, 2, 4, device=META)}, "q must hold data"),
])
def test_select_blocks_rejects_empty_heads_and_meta_tensors(kw: dict, match: str) -> None:
    """Were ATen's unnamed 'amax(): Expected reduction dim 1 to have non-zero size', 'Tensor.item() cannot be called
    on meta tensors' and device-mismatch errors."""
    with pytest.raises(ValueError, match=match):
        admission.select_blocks(**_selection_args(**kw))


def test_exact_tiles_rejects_a_meta_row() -> None:
    """exact_tiles reads the row by pointer: a meta tensor has none (was ATen's 'data is not allocated yet')."""
    with pytest.raises(ValueError, match="block_row must hold data"):
        admission.exact_tiles(torch.arange(3, dtype=torch.int32, device=META), 3, 1)


def test_copy_blocks_rejects_grad_dst_repeated_dst_ids_and_meta_src() -> None:
    """Were autograd's unnamed 'a leaf Variable that requires grad is being used in an in-place operation', a silently
    unspecified result (which of two copies into one block lands), and 'Cannot copy out of meta tensor'."""
    src, dst = torch.randn(3, 2), torch.zeros(3, 2)
    with pytest.raises(ValueError, match="dst must not require grad"):
        transfer.copy_blocks(src, dst.clone().requires_grad_(True), [0], [1])
    with pytest.raises(ValueError, match=r"dst_ids\[1\] = 1 repeats an earlier destination block"):
        transfer.copy_blocks(src, dst, [0, 2], [1, 1])
    assert torch.equal(dst, torch.zeros(3, 2))
    with pytest.raises(ValueError, match="src must hold data"):
        transfer.copy_blocks(torch.empty(3, 2, device=META), dst, [0], [1])


@pytest.mark.parametrize("name", ["query_start_loc", "seq_lens", "block_table"])
def test_build_rejects_meta_index_tensors(name: str) -> None:
    """Was 'Cannot copy out of meta tensor; no data!' naming no argument."""
    e = backend.Engine(1, 2, 1, 4, 2, torch.float32, 2, 1)
    args = {"query_start_loc": torch.tensor([0, 1]), "seq_lens": torch.tensor([1]),
            "block_table": torch.tensor([[0]])}
    args[name] = args[name].to(META)
    with pytest.raises(ValueError, match=f"{name} must hold data"):
        e.build(args["query_start_loc"], args["seq_lens"], args["block_table"], 1, 1)


def test_build_rejects_a_negative_block_id_in_a_used_column() -> None:
    """Was accepted by build and rejected only at forward; a negative id is never valid (unused columns may hold
    anything: vLLM pads them)."""
    e = backend.Engine(1, 2, 1, 4, 2, torch.float32, 2, 1)
    with pytest.raises(IndexError, match=r"block_table\[0, 1\] must be a block id >= 0, got -1"):
        e.build(torch.tensor([0, 1]), torch.tensor([3]), torch.tensor([[0, -1, 5]]), 1, 1)
    plan = e.build(torch.tensor([0, 1]), torch.tensor([3]), torch.tensor([[0, 1, -1]]), 1, 1)
    assert plan.num_reqs == 1


@pytest.mark.parametrize("which", ["kv_cache", "key", "slot_mapping"])
def test_kv_state_write_rejects_grad_and_meta_inputs_with_nothing_changed(which: str) -> None:
    """The _kv_state binding wrote straight into a kv_cache/key that required grad: the page table was rebound and the
    padding counted before autograd's unnamed in-place error (half-applied). A meta slot_mapping failed unnamed."""
    s = kv_state.KVState(1, 2, 1, 4, 2, torch.float32, 2)
    cache = torch.randn(3, 1, 2, 8)
    s.bind_host(0, cache)
    key, value, slots = torch.randn(2, 1, 4), torch.randn(2, 1, 4), torch.tensor([0, -1])
    before = (cache.clone(), s.counters())
    args = {"kv_cache": cache, "key": key, "slot_mapping": slots}
    args[which] = args[which].to(META) if which == "slot_mapping" else args[which].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=which if which != "key" else "key and value must not require grad"):
        s.write(0, args["kv_cache"], args["key"], value, args["slot_mapping"])
    assert torch.equal(cache, before[0]) and s.counters() == before[1]


SPEC = dict(block_size=4, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=None)


def _config(options: dict | None = None) -> SimpleNamespace:
    return SimpleNamespace(model_config=SimpleNamespace(get_num_attention_heads=lambda pc: 4),
                           parallel_config=SimpleNamespace(), additional_config={"activekv": options or {}})


@pytest.mark.parametrize(("attr", "value", "match"), [
    ("block_size", "16", r"kv_cache_spec.block_size must be an int, got '16'"),
    ("dtype", "float32", r"kv_cache_spec.dtype must be a torch.dtype, got 'float32'"),
])
def test_builder_names_a_kv_cache_spec_attribute_of_the_wrong_type(attr: str, value: object, match: str) -> None:
    """Was pybind11's "Unable to cast Python instance of type <class 'str'> to C++ type '?'"."""
    with pytest.raises(TypeError, match=match):
        backend.Builder(SimpleNamespace(**{**SPEC, attr: value}), ["bf.0"], _config(), torch.device("cpu"))


def test_builder_start_up_errors_say_where_the_value_came_from() -> None:
    with pytest.raises(ValueError, match=r"additional_config\['activekv'\]: mode must be 'exact' or 'compressed'"):
        backend.Builder(SimpleNamespace(**SPEC), ["bf.0"], _config({"mode": "fast"}), torch.device("cpu"))
    with pytest.raises(TypeError, match=r"kv_cache_spec \(block_size 4, .*dtype Double\).*dtype must be float32"):
        backend.Builder(SimpleNamespace(**{**SPEC, "dtype": torch.float64}), ["bf.0"], _config(),
                        torch.device("cpu"))


def test_builder_build_and_impl_name_vllm_attributes_of_the_wrong_type() -> None:
    b = backend.Builder(SimpleNamespace(**SPEC), ["bf.1"], _config({"pool_blocks": 4, "tile_blocks": 2}),
                        torch.device("cpu"))
    q = torch.tensor([0, 1], dtype=torch.int32)
    cm = dict(query_start_loc=q, query_start_loc_cpu=q, seq_lens=torch.tensor([1], dtype=torch.int32),
              block_table_tensor=torch.tensor([[0]], dtype=torch.int32), num_reqs=1, num_actual_tokens=1, causal=True)
    for attr, value, match in (("seq_lens", [1], "common_attn_metadata.seq_lens must be a tensor, got \\[1\\]"),
                               ("num_reqs", "1", "common_attn_metadata.num_reqs must be an int, got '1'")):
        with pytest.raises(TypeError, match=match):
            b.build(0, SimpleNamespace(**{**cm, attr: value}))
    impl = backend.Impl(4, 32, 0.2, 2)
    with pytest.raises(TypeError, match="layer.layer_name must be a str, got 3"):
        impl.do_kv_cache_update(SimpleNamespace(layer_name=3), torch.zeros(1, 2, 32), torch.zeros(1, 2, 32),
                                torch.zeros(2, 2, 4, 64), torch.tensor([0]))
    with pytest.raises(TypeError, match="num_kv_heads must be an int or None, got '2'"):
        backend.Impl(4, 32, 0.2, "2")
    with pytest.raises(TypeError, match="logits_soft_cap must be a float or None, got 'x'"):
        backend.Impl(4, 32, 0.2, 2, None, None, "auto", "x")
    with pytest.raises(TypeError, match="attn_type must be a str"):
        backend.Impl(4, 32, 0.2, 2, None, None, "auto", None, 3)
