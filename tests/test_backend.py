"""activekv._backend: the engine's vLLM-facing entry points (Builder, Impl, StepPlan, Engine), driven with stand-ins
shaped like vLLM 0.32.0's objects (KV-cache spec, VllmConfig, CommonAttentionMetadata, attention layer)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import activekv._backend as backend
import activekv._telemetry as telemetry

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
H, KVH, D, BS = 4, 2, 32, 16
# Output of one engine run against SDPA on the same K/V: float32 math in both, different summation order.
SDPA_ATOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def vllm_config(options: dict | None = None, extra: object = None,
                impls: dict[str, backend.Impl] | None = None) -> SimpleNamespace:
    """impls: {layer name: Impl}, the attention layers vLLM registers in compilation_config.static_forward_context
    (each layer's impl the patch's ActiveKVImpl, whose _native is the Impl): a Builder binds its engine to them."""
    # The model configuration's accessors state spec()'s geometry over LAYERS (what check_config reads).
    model_config = SimpleNamespace(get_num_attention_heads=lambda parallel_config: H,
                                   get_num_kv_heads=lambda parallel_config: KVH, get_head_size=lambda: D,
                                   get_num_layers_by_block_type=lambda parallel_config, block_type: len(LAYERS),
                                   dtype=torch.float32)
    additional = extra if extra is not None else ({"activekv": options} if options is not None else {})
    layers = {name: SimpleNamespace(layer_name=name, impl=SimpleNamespace(_native=impl))
              for name, impl in (impls or {}).items()}
    return SimpleNamespace(model_config=model_config, parallel_config=SimpleNamespace(), additional_config=additional,
                           compilation_config=SimpleNamespace(static_forward_context=layers),
                           cache_config=SimpleNamespace(block_size=BS), device_config=SimpleNamespace(device_type="cpu"))


def spec(dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    return SimpleNamespace(block_size=BS, num_kv_heads=KVH, head_size=D, dtype=dtype, sliding_window=None)


def common_metadata(qsl: list[int], seq_lens: list[int], table: list[list[int]], slot_mapping: list[int],
                    causal: object = True) -> SimpleNamespace:
    q = torch.tensor(qsl, dtype=torch.int32)
    return SimpleNamespace(query_start_loc=q, query_start_loc_cpu=q, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                           block_table_tensor=torch.tensor(table, dtype=torch.int32),
                           slot_mapping=torch.tensor(slot_mapping, dtype=torch.int64), num_reqs=len(seq_lens),
                           num_actual_tokens=qsl[-1], causal=causal)


def sdpa_rows(q: torch.Tensor, cache: torch.Tensor, table: list[int], seq_len: int) -> torch.Tensor:
    """Plain attention for one request row over its blocks: the accuracy yardstick (not the parity one)."""
    kv = cache.view(cache.shape[0], KVH, 2, BS, D)[table].permute(2, 1, 0, 3, 4).reshape(2, KVH, -1, D)
    k, v = kv[0, :, :seq_len].float(), kv[1, :, :seq_len].float()
    lq = q.shape[0]
    mask = torch.ones(lq, seq_len, dtype=torch.bool).tril(seq_len - lq)
    out = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, attn_mask=mask,
                                                           enable_gqa=True)
    return out.transpose(0, 1)


def run_in_place_steps(options: dict, dtype: torch.dtype) -> list[torch.Tensor]:
    """Outputs of a prefill (70 + 20 tokens) and a decode step of two requests through one layer, seeded."""
    torch.manual_seed(0)
    impl = backend.Impl(H, D, D ** -0.5, KVH, None, None, "auto", None, "decoder", None)
    b = backend.Builder(spec(dtype), LAYERS[:1], vllm_config(options, impls={LAYERS[0]: impl}), torch.device("cpu"))
    cache, layer = torch.zeros(16, KVH, BS, 2 * D, dtype=dtype), SimpleNamespace(layer_name=LAYERS[0])
    tables, outs = [[9, 2, 14, 5, 0], [7, 3, 0, 0, 0]], []
    for qsl, seq_lens in (([0, 70, 90], [70, 20]), ([0, 1, 2], [71, 21])):
        slots = [tables[r][p // BS] * BS + p % BS for r in range(2)
                 for p in range(seq_lens[r] - (qsl[r + 1] - qsl[r]), seq_lens[r])]
        cm = common_metadata(qsl, seq_lens, tables, slots)
        plan, t = b.build(0, cm), qsl[-1]
        q, k, v = torch.randn(t, H, D).to(dtype), torch.randn(t, KVH, D).to(dtype), torch.randn(t, KVH, D).to(dtype)
        impl.do_kv_cache_update(layer, k, v, cache, cm.slot_mapping)
        outs.append(impl.forward(layer, q, k, v, cache, plan, torch.empty(t, H, D, dtype=dtype)))
    return outs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_tile_far_beyond_the_context_attends_as_one_that_covers_it(dtype: torch.dtype) -> None:
    # A tile is one online-softmax merge; the kernel's scratch follows the blocks a call reads, not the tile's size
    # (2^40 blocks of scratch per thread was std::bad_alloc on the first request).
    huge = run_in_place_steps({"tile_blocks": 2 ** 40}, dtype)
    covering = run_in_place_steps({"tile_blocks": 64}, dtype)
    for a, b in zip(huge, covering, strict=True):
        assert torch.equal(a, b)


@pytest.fixture()
def builder() -> backend.Builder:
    return backend.Builder(spec(), LAYERS, vllm_config({"pool_blocks": 3, "tile_blocks": 2}), torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_vllm_step_sequence_matches_sdpa_and_counts_entries(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    impl = backend.Impl(H, D, D ** -0.5, KVH, None, None, "auto", None, "decoder", None)
    b = backend.Builder(spec(dtype), LAYERS, vllm_config({"pool_blocks": 3, "tile_blocks": 2},
                                                         impls=dict.fromkeys(LAYERS, impl)), torch.device("cpu"))
    caches = [torch.zeros(16, KVH, BS, 2 * D, dtype=dtype) for _ in LAYERS]
    layers = [SimpleNamespace(layer_name=n) for n in LAYERS]
    # Two requests, physical blocks out of order; prefill 70 + 20 tokens, then one decode step each.
    tables = [[9, 2, 14, 5, 0], [7, 3, 0, 0, 0]]
    prompt = [70, 20]
    steps = [([0, 70, 90], [70, 20]), ([0, 1, 2], [71, 21])]
    before = b.engine.snapshot()
    for qsl, seq_lens in steps:
        slots = []
        for r in range(2):
            lq = qsl[r + 1] - qsl[r]
            slots += [tables[r][p // BS] * BS + p % BS for p in range(seq_lens[r] - lq, seq_lens[r])]
        cm = common_metadata(qsl, seq_lens, tables, slots)
        plan = b.build(0, cm)
        t = qsl[-1]
        for layer, cache in zip(layers, caches):
            q = torch.randn(t, H, D).to(dtype)
            k, v = torch.randn(t, KVH, D).to(dtype), torch.randn(t, KVH, D).to(dtype)
            impl.do_kv_cache_update(layer, k, v, cache, cm.slot_mapping)
            out = torch.empty(t, H, D, dtype=dtype)
            assert impl.forward(layer, q, k, v, cache, plan, out) is out
            for r in range(2):
                rows = slice(qsl[r], qsl[r + 1])
                want = sdpa_rows(q[rows], cache, tables[r], seq_lens[r])
                torch.testing.assert_close(out[rows].float(), want, atol=SDPA_ATOL[dtype], rtol=SDPA_ATOL[dtype])
    snap = b.engine.snapshot()
    assert snap["build_calls"] - before["build_calls"] == 2
    assert snap["forward_calls"] == snap["kv_update_calls"] == 2 * len(LAYERS)
    assert snap["tokens_written"] == (sum(prompt) + 2) * len(LAYERS)
    assert snap["blocks_evicted"] > 0 and snap["blocks_admitted"] > 0


def test_warmup_forward_without_metadata_leaves_output_untouched() -> None:
    impl = backend.Impl(H, D, 0.1, KVH)
    builder = backend.Builder(spec(), LAYERS, vllm_config({"pool_blocks": 3, "tile_blocks": 2},
                                                          impls=dict.fromkeys(LAYERS, impl)), torch.device("cpu"))
    out = torch.full((3, H, D), 5.0)
    q = torch.randn(3, H, D)
    res = impl.forward(SimpleNamespace(layer_name=LAYERS[0]), q, q, q, torch.zeros(4, KVH, BS, 2 * D), None, out)
    assert res is out and torch.equal(out, torch.full((3, H, D), 5.0))
    snap = builder.engine.snapshot()
    assert snap["forward_skipped"] == 1 and snap["forward_calls"] == 0


def test_forward_without_metadata_before_any_builder_is_a_no_op() -> None:
    """vLLM's compiled mode warms the model up (profile_run) before initialize_kv_cache creates any metadata builder:
    the forward arrives with no metadata, an empty KV cache and no engine serving the layer. By the backend contract
    (vLLM's cpu_attn.py returns output untouched) that is a no-op, not an error."""
    impl = backend.Impl(H, D, 0.1, KVH)
    out = torch.full((3, H, D), 5.0)
    q = torch.randn(3, H, D)
    layer = SimpleNamespace(layer_name="model.layers.0.before_any_builder")
    assert impl.forward(layer, q, q, q, torch.tensor([]), None, out) is out
    assert torch.equal(out, torch.full((3, H, D), 5.0))


def test_forward_without_metadata_counts_only_on_the_engine_its_cache_identifies() -> None:
    """A second LLM's warm-up in a process whose first LLM's engine is alive (same layer names): the warm-up forward
    belongs to no engine yet, so the first engine's telemetry does not move; once its own builder exists and binds
    the cache, a forward without metadata on that cache counts on that engine alone."""
    names = ["test.forward_skipped.0", "test.forward_skipped.1"]  # no other test's engine serves these names
    impl = backend.Impl(H, D, D ** -0.5, KVH)
    opts = vllm_config({"pool_blocks": 3, "tile_blocks": 1}, impls=dict.fromkeys(names, impl))
    layer, q, kv = SimpleNamespace(layer_name=names[0]), torch.randn(1, H, D), torch.randn(2, KVH, D)
    first, cache_a = backend.Builder(spec(), names, opts, torch.device("cpu")), torch.zeros(8, KVH, BS, 2 * D)
    impl.do_kv_cache_update(layer, kv, kv, cache_a, torch.arange(2))  # binds the first engine's layer to cache_a
    impl.forward(layer, q, q, q, torch.tensor([]), None, torch.zeros(1, H, D))
    assert first.engine.snapshot()["forward_skipped"] == 0
    second = backend.Builder(spec(), names, opts, torch.device("cpu"))
    impl.forward(layer, q, q, q, torch.zeros(8, KVH, BS, 2 * D), None, torch.zeros(1, H, D))  # unbound: the second
    impl.forward(layer, q, q, q, cache_a, None, torch.zeros(1, H, D))  # cache_a: the first
    assert first.engine.snapshot()["forward_skipped"] == 1 and second.engine.snapshot()["forward_skipped"] == 1


BAD_OPTIONS = [
    ({"pool_blocks": 4, "bogus": 1}, ValueError, "unknown ActiveKV option.*bogus"),
    ({"mode": "sparse"}, ValueError, "mode must be 'exact' or 'compressed', got 'sparse'"),
    ({"mode": "compressed", "budget_tokens": 48, "sink_blocks": 1, "recent_blocks": 2}, ValueError,
     r"budget_tokens \(48\) must cover sink_blocks \+ recent_blocks \+ one block = 64 tokens"),
    ({"mode": "compressed", "budget_tokens": 256, "pool_blocks": 20}, ValueError,
     r"pool_blocks \(20\) must hold the worst-case union .* = 29 blocks"),
    ({"mode": "compressed", "recent_blocks": 0}, ValueError, r"recent_blocks must be in \[1, 2\^40\]"),
    ({"mode": "compressed", "sink_blocks": -1}, ValueError, r"sink_blocks.\] must be in \[0, 2\^40\], got -1"),
    ({"pool_blocks": 2, "tile_blocks": 4}, ValueError, r"pool_blocks \(2\) must be >= tile_blocks \(4\)"),
    ({"pool_blocks": "8"}, TypeError, "pool_blocks'\\] must be an int"),
    ({"tile_blocks": 0}, ValueError, r"tile_blocks'\] must be in \[1, 2\^40\], got 0"),
    ({"placement": "host"}, ValueError, "placement must be 'pool' or 'in_place', got 'host'"),
    ({"placement": "in_place", "pool_blocks": 8}, ValueError,
     r"\['placement'\] 'in_place' has no pool: drop additional_config\['activekv'\]\['pool_blocks'\]"),
    ({"pool_blocks": 0}, ValueError, r"pool_blocks'\] must be in \[1, 2\^40\], got 0"),
    ({"pool_blocks": -1}, ValueError, r"pool_blocks'\] must be in \[1, 2\^40\], got -1"),
    ({"mode": "compressed", "dense_layers": -1}, ValueError, r"dense_layers'\] must be in \[0, 2\^40\], got -1"),
    ({"mode": "compressed", "dense_layers": 3}, ValueError,
     r"dense_layers'\] must be in \[0, 2\] \(the model's attention layers\), got 3"),
    ({"mode": "compressed", "dense_layers": 1.5}, TypeError, "dense_layers'\\] must be an int"),
    # Options only compressed mode reads, given without it (mode absent or exact): refused, not ignored.
    ({"budget_tokens": 512}, ValueError, r"\['budget_tokens'\] applies to mode 'compressed' only, got it with mode "
     r"'exact': set additional_config\['activekv'\]\['mode'\] to 'compressed' or drop it"),
    ({"mode": "exact", "sink_blocks": 1}, ValueError, r"\['sink_blocks'\] applies to mode 'compressed' only"),
    ({"mode": "exact", "recent_blocks": 2, "pool_blocks": 64}, ValueError,
     r"\['recent_blocks'\] applies to mode 'compressed' only"),
    ({"dense_layers": 0}, ValueError, r"\['dense_layers'\] applies to mode 'compressed' only"),
]


@pytest.mark.parametrize(("options", "exc", "match"), BAD_OPTIONS)
def test_builder_rejects_bad_options(options: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        backend.Builder(spec(), LAYERS, vllm_config(options), torch.device("cpu"))


@pytest.mark.parametrize(("options", "exc", "match"), BAD_OPTIONS)
def test_check_config_rejects_what_the_builder_rejects(options: dict, exc: type, match: str) -> None:
    # The patch's early check (CpuPlatform.check_and_update_config) with the Builder's own messages.
    with pytest.raises(exc, match=match):
        backend.check_config(vllm_config(options))


@pytest.mark.parametrize("options", [{}, {"mode": "compressed"}, {"pool_blocks": 64, "tile_blocks": 8},
                                     {"mode": "compressed", "budget_tokens": 256, "pool_blocks": 29},
                                     {"placement": "in_place", "tile_blocks": 4}])
def test_check_config_accepts_what_the_builder_accepts(options: dict) -> None:
    cfg = vllm_config(options)
    assert backend.check_config(cfg) is None
    backend.Builder(spec(), LAYERS, cfg, torch.device("cpu"))


def test_check_config_defers_what_it_cannot_know_yet_to_the_builder() -> None:
    bad = {"pool_blocks": 2, "tile_blocks": 4}
    no_block_size = vllm_config(bad)
    no_block_size.cache_config.block_size = None  # the platform settles it later: the Builder checks
    assert backend.check_config(no_block_size) is None
    no_model = vllm_config(bad)
    no_model.model_config = None
    assert backend.check_config(no_model) is None
    with pytest.raises(ValueError, match=r"pool_blocks \(2\) must be >= tile_blocks \(4\)"):
        backend.Builder(spec(), LAYERS, no_block_size, torch.device("cpu"))


def test_check_config_takes_the_kernel_block_size_vllm_will_choose() -> None:
    odd = vllm_config({})
    odd.cache_config.block_size = 8  # no kernel block size divides it: vLLM's engine core would fail to start
    with pytest.raises(ValueError, match="take KV blocks of 16, 32, 64, 128 tokens: .* got 8"):
        backend.check_config(odd)
    # A cache block of 256 is split into kernel blocks of 128 (vLLM's select_common_block_size): the budget must cover
    # sinks + recent + one block of 128 tokens (512), not of 256.
    large = vllm_config({"mode": "compressed", "budget_tokens": 512})
    large.cache_config.block_size = 256
    assert backend.check_config(large) is None
    large.additional_config["activekv"]["budget_tokens"] = 511
    with pytest.raises(ValueError, match=r"budget_tokens \(511\) must cover .* = 512 tokens at block_size 128"):
        backend.check_config(large)


def test_check_config_refuses_pools_beyond_the_machines_memory() -> None:
    # The Builder would only find it by failing to allocate them in the engine core, after the model has loaded.
    with pytest.raises(ValueError, match=r"pool_blocks'\] = 1099511627776 needs .* GiB of pools \(2 layers, 8192 "
                                         r"bytes per block\), more than this machine's memory"):
        backend.check_config(vllm_config({"pool_blocks": 2 ** 40}))
    assert backend.check_config(vllm_config({"pool_blocks": 4096})) is None  # 64 MiB


def test_check_config_names_what_it_reads_wrongly() -> None:
    on_xpu = vllm_config({"mode": "exact"})
    on_xpu.device_config.device_type = "xpu"
    with pytest.raises(ValueError, match="ActiveKV runs on the CPU or a CUDA device, got device_type 'xpu'"):
        backend.check_config(on_xpu)
    no_options = vllm_config({})
    no_options.device_config.device_type = "xpu"
    assert backend.check_config(no_options) is None  # no options: nothing of the user's to check
    bad_heads = vllm_config({"mode": "exact"})
    bad_heads.model_config.get_num_kv_heads = lambda parallel_config: "2"
    with pytest.raises(TypeError, match=r"model_config.get_num_kv_heads\(parallel_config\) must be an int, got '2'"):
        backend.check_config(bad_heads)


def test_builder_rejects_non_dict_options() -> None:
    with pytest.raises(TypeError, match=r"additional_config\['activekv'\] must be a dict"):
        backend.Builder(spec(), LAYERS, vllm_config(extra={"activekv": 3}), torch.device("cpu"))


def test_compressed_builder_defaults_its_pool_to_the_worst_case_union() -> None:
    b = backend.Builder(spec(), LAYERS, vllm_config({"mode": "compressed", "budget_tokens": 8192, "placement": "pool"}),
                        torch.device("cpu"))
    # k = 8192 / 16 - 1 - 2 = 509; union = 2 * 509 + 3 = 1021 blocks
    assert (b.engine.mode, b.engine.top_k, b.engine.pool_blocks) == ("compressed", 509, 1021)


@pytest.mark.parametrize(("max_num_seqs", "num_gpu_blocks", "pool"), [
    (3, 100_000, 3 * 1021),  # one worst-case union per scheduler row
    (3, 2500, 2500),  # capped at the KV cache's blocks
    (3, 500, 1021),  # never below one row's union (the engine's minimum)
    (1, 100_000, 1021),
    (None, 100_000, 1021),  # vLLM's config lacks a figure (e.g. None while profiling): one row's union
    (3, None, 1021),
    (True, 100_000, 1021),  # not an int
])
def test_compressed_default_pool_scales_with_max_num_seqs_capped_by_the_kv_cache(max_num_seqs, num_gpu_blocks,
                                                                                 pool) -> None:
    cfg = vllm_config({"mode": "compressed", "budget_tokens": 8192, "placement": "pool"})
    cfg.scheduler_config = SimpleNamespace(max_num_seqs=max_num_seqs)
    cfg.cache_config = SimpleNamespace(num_gpu_blocks=num_gpu_blocks)
    b = backend.Builder(spec(), LAYERS, cfg, torch.device("cpu"))
    assert b.engine.pool_blocks == pool
    explicit = vllm_config({"mode": "compressed", "budget_tokens": 8192, "pool_blocks": 2000})
    explicit.scheduler_config, explicit.cache_config = cfg.scheduler_config, cfg.cache_config
    assert backend.Builder(spec(), LAYERS, explicit, torch.device("cpu")).engine.pool_blocks == 2000  # option wins


def test_builder_defaults_and_layer_registry() -> None:
    b = backend.Builder(spec(), LAYERS, vllm_config(), torch.device("cpu"))
    # On the CPU, with no pool asked for, blocks are read in place: no pool at all.
    assert (b.engine.placement, b.engine.pool_blocks, b.engine.tile_blocks, b.engine.mode) == ("in_place", 0, 128,
                                                                                              "exact")
    assert b.engine.snapshot()["info"]["in_place"] == 1
    assert [b.engine.layer_index(n) for n in LAYERS] == [0, 1]
    with pytest.raises(ValueError, match="not served by this ActiveKV engine"):
        b.engine.layer_index("model.layers.7.self_attn.attn")


@pytest.mark.parametrize(("options", "placement", "pool_blocks", "tile_blocks"), [
    ({}, "in_place", 0, 128),  # the CPU default: no pool, tiles of 2048 tokens (128 blocks of BS = 16)
    ({"mode": "compressed"}, "in_place", 0, 128),
    ({"pool_blocks": 64}, "pool", 64, 16),  # a pool asked for keeps the copy-through-the-pool path
    ({"pool_blocks": 8}, "pool", 8, 8),  # a pool smaller than the default tile takes tiles of its size
    ({"pool_blocks": 8, "tile_blocks": 4}, "pool", 8, 4),
    ({"placement": "pool"}, "pool", 256, 16),
    ({"placement": "in_place", "tile_blocks": 4}, "in_place", 0, 4),
])
def test_builder_placement_pool_and_tile(options: dict, placement: str, pool_blocks: int, tile_blocks: int) -> None:
    e = backend.Builder(spec(), LAYERS, vllm_config(options), torch.device("cpu")).engine
    assert (e.placement, e.pool_blocks, e.tile_blocks) == (placement, pool_blocks, tile_blocks)


@pytest.mark.parametrize(("block_size", "options", "tile_blocks"), [
    (16, {}, 128), (32, {}, 64), (128, {}, 16), (256, {}, 16), (4096, {}, 16),  # in place: >= 2048 tokens, >= 16 blocks
    (16, {"tile_blocks": 4}, 4),  # given: taken as it is
    (16, {"pool_blocks": 64}, 16),  # a pool keeps 16-block tiles (the unit streamed through it)
])
def test_builder_in_place_tile_spans_2048_tokens(block_size: int, options: dict, tile_blocks: int) -> None:
    """In place on the CPU a tile is only the online softmax's merge step: with no tile_blocks given it spans at least
    2048 tokens (options.h kCpuInPlaceTileTokens) and 16 blocks."""
    s = SimpleNamespace(block_size=block_size, num_kv_heads=KVH, head_size=D, dtype=torch.float32, sliding_window=None)
    assert backend.Builder(s, LAYERS, vllm_config(options), torch.device("cpu")).engine.tile_blocks == tile_blocks


@pytest.mark.parametrize(("kwargs", "match"), [
    ({"alibi_slopes": [0.1]}, "ALiBi"),
    ({"sliding_window": 128}, "sliding-window"),
    ({"kv_cache_dtype": "fp8"}, "kv_cache_dtype 'auto' only"),
    ({"logits_soft_cap": 30.0}, "soft-capping"),
    ({"attn_type": "encoder_only"}, "decoder attention only"),
    ({"kv_sharing_target_layer_name": "model.layers.0.self_attn.attn"}, "KV sharing"),
    ({"sinks": torch.zeros(H)}, "attention sinks"),
])
def test_impl_rejects_unsupported_features(kwargs: dict, match: str) -> None:
    with pytest.raises(NotImplementedError, match=match):
        backend.Impl(H, D, 0.1, KVH, **kwargs)


def test_impl_rejects_bad_head_counts_and_sizes() -> None:
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        backend.Impl(6, D, 0.1, 4)
    with pytest.raises(NotImplementedError, match="supports head sizes .* got 48"):
        backend.Impl(H, 48, 0.1, KVH)


@pytest.mark.parametrize("config", [None, 3, SimpleNamespace()])
def test_check_config_without_a_vllm_config_is_a_type_error(config: object) -> None:
    with pytest.raises(TypeError, match=r"vllm_config must be vLLM's VllmConfig \(with an additional_config\), got "):
        backend.check_config(config)


def test_builder_rejects_the_head_sizes_impl_rejects() -> None:
    """A KV-cache spec of a head size Impl refuses is refused by the Builder too, with the same message."""
    bad = SimpleNamespace(**{**vars(spec()), "head_size": 72})
    with pytest.raises(NotImplementedError, match=r"^kv_cache_spec.head_size: ActiveKV's vLLM backend supports head "
                                                  r"sizes .* got 72"):
        backend.Builder(bad, LAYERS, vllm_config({"pool_blocks": 4}), torch.device("cpu"))


def test_build_rejects_non_causal_and_bad_metadata(builder: backend.Builder) -> None:
    with pytest.raises(NotImplementedError, match="causal attention only"):
        builder.build(0, common_metadata([0, 1], [1], [[0]], [0], causal=False))
    with pytest.raises(ValueError, match=r"seq_lens\[0\] \(1\) must be >= the row's query tokens \(2\)"):
        builder.build(0, common_metadata([0, 2], [1], [[0]], [0, 1]))
    with pytest.raises(ValueError, match="needs 2 blocks but block_table has 1 columns"):
        builder.build(0, common_metadata([0, 1], [17], [[0]], [16]))
    with pytest.raises(ValueError, match="non-decreasing"):
        builder.build(0, common_metadata([0, 2, 1], [2, 2], [[0], [1]], [0, 1]))


def test_forward_rejects_bad_inputs_without_side_effects(builder: backend.Builder) -> None:
    impl = backend.Impl(H, D, 0.1, KVH)
    layer = SimpleNamespace(layer_name=LAYERS[0])
    cache = torch.zeros(4, KVH, BS, 2 * D)
    plan = builder.build(0, common_metadata([0, 1], [1], [[9]], [0]))  # block 9 is outside a 4-block cache
    q = torch.randn(1, H, D)
    before = builder.engine.snapshot()
    with pytest.raises(IndexError, match=r"block_table\[0, 0\] must be in \[0, 4\)"):
        impl.forward(layer, q, q, q, cache, plan, torch.empty(1, H, D))
    with pytest.raises(TypeError, match="attn_metadata must be an activekv StepPlan"):
        impl.forward(layer, q, q, q, cache, {"not": "a plan"}, torch.empty(1, H, D))
    with pytest.raises(TypeError, match="query must have dtype Float"):
        impl.forward(layer, q.double(), q, q, cache, plan, torch.empty(1, H, D))
    with pytest.raises(ValueError, match=r"kv_cache must be \[4, 2, 16, 64\]"):
        impl.forward(layer, q, q, q, torch.zeros(4, KVH, BS, D), plan, torch.empty(1, H, D))
    with pytest.raises(NotImplementedError, match="fused output quantization"):
        impl.forward(layer, q, q, q, cache, plan, torch.empty(1, H, D), torch.ones(1))
    with pytest.raises(TypeError, match="layer must be a vLLM attention layer"):
        impl.forward(object(), q, q, q, cache, plan, torch.empty(1, H, D))
    after = builder.engine.snapshot()
    for key in ("forward_calls", "blocks_admitted", "tiles_computed"):
        assert after[key] == before[key], key


def test_kv_update_for_a_layer_without_engine_is_a_clear_error() -> None:
    impl = backend.Impl(H, D, 0.1, KVH)
    k = torch.zeros(1, KVH, D)
    with pytest.raises(ValueError, match="no ActiveKV engine serves layer 'nowhere'"):
        impl.do_kv_cache_update(SimpleNamespace(layer_name="nowhere"), k, k, torch.zeros(2, KVH, BS, 2 * D),
                                torch.zeros(1, dtype=torch.int64))


def test_engine_rejects_plan_of_another_engine() -> None:
    args = (1, H, KVH, D, BS, torch.float32, 4, 2)
    e1, e2 = backend.Engine(*args), backend.Engine(*args)
    one = torch.tensor([0, 1], dtype=torch.int32)
    plan = e1.build(one, torch.tensor([1], dtype=torch.int32), torch.zeros(1, 1, dtype=torch.int32), 1, 1)
    with pytest.raises(ValueError, match="plan was built by another ActiveKV engine"):
        e2.forward(0, plan, torch.zeros(1, H, D), torch.zeros(2, KVH, BS, 2 * D), torch.zeros(1, H, D), 0.1)


def test_engines_keep_separate_state_and_telemetry() -> None:
    args = (1, H, KVH, D, BS, torch.float32, 4, 2)
    e1, e2 = backend.Engine(*args), backend.Engine(*args)
    e1.update_kv(0, torch.ones(3, KVH, D), torch.ones(3, KVH, D), torch.zeros(2, KVH, BS, 2 * D),
                 torch.arange(3, dtype=torch.int64))
    assert e1.snapshot()["tokens_written"] == 3 and e2.snapshot()["tokens_written"] == 0
    ids = {s["engine_id"] for s in telemetry.engine_snapshots()}
    assert len(ids) >= 2


def test_capabilities() -> None:
    assert backend.name() == "ACTIVEKV"
    assert backend.supported_dtypes() == [torch.float32, torch.bfloat16, torch.float16]
    assert backend.supported_kv_cache_dtypes() == ["auto"]
    assert 32 in backend.supported_head_sizes() and 128 in backend.supported_head_sizes()
    assert backend.supported_block_sizes() == [16, 32, 64, 128]
    assert not any(f() for f in (backend.supports_sliding_window, backend.supports_sink, backend.supports_non_causal,
                                 backend.supports_kv_connector))
    assert backend.supports_attn_type("decoder") and not backend.supports_attn_type("encoder")
    assert backend.vllm_patch_version == "0.32.0"
    assert backend.torch_version == torch.__version__


def test_importing_a_module_before_torch_is_a_clear_import_error() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", "import activekv._backend"], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert "ImportError: activekv._backend needs torch" in proc.stderr


# --- faults found by the new-user review, each guarded here -------------------------------------------------------


def _prefill_and_check(b: backend.Builder, impl: backend.Impl, cache: torch.Tensor, seed: int) -> None:
    """One 40-token prefill through a builder's engine: KV update, forward, compare with SDPA."""
    g = torch.Generator().manual_seed(seed)
    layer = SimpleNamespace(layer_name=LAYERS[0])
    table = [[3, 1, 6]]
    slots = [table[0][p // BS] * BS + p % BS for p in range(40)]
    cm = common_metadata([0, 40], [40], table, slots)
    plan = b.build(0, cm)
    q, k, v = torch.randn(40, H, D, generator=g), torch.randn(40, KVH, D, generator=g), torch.randn(40, KVH, D, generator=g)
    impl.do_kv_cache_update(layer, k, v, cache, cm.slot_mapping)
    out = torch.empty(40, H, D)
    impl.forward(layer, q, k, v, cache, plan, out)
    torch.testing.assert_close(out, sdpa_rows(q, cache, table[0], 40), atol=2e-5, rtol=2e-5)


def test_two_builders_with_the_same_layer_names_keep_their_own_caches() -> None:
    """Two builders serving one Impl's layer (vLLM's micro-batching makes one per micro-batch): each KV update
    reaches the engine bound to that KV cache, not the newest engine."""
    impl = backend.Impl(H, D, D ** -0.5, KVH)
    opts = vllm_config({"pool_blocks": 3, "tile_blocks": 1}, impls=dict.fromkeys(LAYERS, impl))
    first, cache_a = backend.Builder(spec(), LAYERS, opts, torch.device("cpu")), torch.zeros(8, KVH, BS, 2 * D)
    _prefill_and_check(first, impl, cache_a, seed=1)
    second, cache_b = backend.Builder(spec(), LAYERS, opts, torch.device("cpu")), torch.zeros(8, KVH, BS, 2 * D)
    _prefill_and_check(second, impl, cache_b, seed=2)
    _prefill_and_check(first, impl, cache_a, seed=3)  # the older engine still serves its own cache correctly
    assert first.engine.snapshot()["kv_update_calls"] == 2 and second.engine.snapshot()["kv_update_calls"] == 1


THREAD_SCRIPT = """
import threading, torch
import activekv._backend as backend
H, KVH, D, BS = 4, 2, 32, 16
e = backend.Engine(1, H, KVH, D, BS, torch.float32, 4, 2)
cache = torch.zeros(16, KVH, BS, 2 * D)
e.update_kv(0, torch.randn(256, KVH, D), torch.randn(256, KVH, D), cache, torch.arange(256))
plan = e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([200], dtype=torch.int32),
               torch.arange(16, dtype=torch.int32)[None], 1, 1)
q = torch.randn(1, H, D)
want = torch.empty(1, H, D)
e.forward(0, plan, q, cache, want, 0.2)
bad = []
def work():
    for _ in range(100):
        out = torch.empty(1, H, D)
        e.forward(0, plan, q, cache, out, 0.2)
        if not torch.equal(out, want):
            bad.append(1)
threads = [threading.Thread(target=work) for _ in range(4)]
[t.start() for t in threads]
[t.join() for t in threads]
print("bad", len(bad))
"""


def test_one_engine_driven_from_several_threads_stays_correct() -> None:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", THREAD_SCRIPT], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "bad 0"


def test_plan_tensors_are_copies() -> None:
    e = backend.Engine(1, H, KVH, D, BS, torch.float32, 4, 2)
    plan = e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                   torch.zeros(1, 1, dtype=torch.int32), 1, 1)
    plan.seq_lens[0] = 2 ** 31 - 1
    plan.query_start_loc[0] = 30
    assert plan.seq_lens.tolist() == [3] and plan.query_start_loc.tolist() == [0, 1]


@pytest.mark.parametrize(("name", "args"), [
    ("seq_lens", ([0, 1], [2 ** 32 + 1], [[0]])),
    ("block_table", ([0, 1], [1], [[2 ** 32 + 3]])),
    ("query_start_loc", ([0, -2 ** 33], [1], [[0]])),
])
def test_int64_plan_values_outside_int32_are_rejected(name: str, args: tuple) -> None:
    e = backend.Engine(1, H, KVH, D, BS, torch.float32, 4, 2)
    qsl, sl, bt = (torch.tensor(a, dtype=torch.int64) for a in args)
    with pytest.raises(ValueError, match=f"{name} values must fit in int32"):
        e.build(qsl, sl, bt, 1, 1)


def test_zero_dim_seq_lens_is_a_clear_error() -> None:
    e = backend.Engine(1, H, KVH, D, BS, torch.float32, 4, 2)
    with pytest.raises(ValueError, match="seq_lens must be 1-D"):
        e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor(1, dtype=torch.int32),
                torch.zeros(1, 1, dtype=torch.int32), 1, 1)


def test_grad_and_inference_tensors_are_rejected_before_anything_changes() -> None:
    e = backend.Engine(1, H, KVH, D, BS, torch.float32, 4, 2)
    cache = torch.zeros(4, KVH, BS, 2 * D)
    k = torch.randn(3, KVH, D)
    e.update_kv(0, k, k, cache, torch.arange(3))
    plan = e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                   torch.zeros(1, 1, dtype=torch.int32), 1, 1)
    before = e.snapshot()
    q = torch.randn(1, H, D)
    with pytest.raises(ValueError, match="output must not require grad"):
        e.forward(0, plan, q, cache, torch.zeros(1, H, D, requires_grad=True), 0.1)
    with pytest.raises(ValueError, match="query must not require grad"):
        e.forward(0, plan, q.clone().requires_grad_(), cache, torch.zeros(1, H, D), 0.1)
    with pytest.raises(ValueError, match="key must not require grad"):
        e.update_kv(0, k.clone().requires_grad_(), k, cache, torch.arange(3))
    with torch.inference_mode():
        inference_out = torch.zeros(1, H, D)
        inference_cache = torch.zeros(4, KVH, BS, 2 * D)
    with pytest.raises(ValueError, match="output is an inference tensor"):
        e.forward(0, plan, q, cache, inference_out, 0.1)
    with pytest.raises(ValueError, match="kv_cache is an inference tensor"):
        e.update_kv(0, k, k, inference_cache, torch.arange(3))
    after = e.snapshot()
    for key in ("forward_calls", "kv_update_calls", "blocks_admitted", "tiles_computed", "host_rebinds"):
        assert after[key] == before[key], key
    assert not cache.requires_grad
    with torch.inference_mode():  # under inference mode (vLLM's), inference tensors are fine
        e.forward(0, plan, q, cache, inference_out, 0.1)


def test_duplicate_slots_are_rejected() -> None:
    e = backend.Engine(1, H, KVH, D, BS, torch.float32, 4, 2)
    k = torch.randn(3, KVH, D)
    with pytest.raises(ValueError, match=r"slot_mapping\[2\] = 5 repeats an earlier slot"):
        e.update_kv(0, k, k, torch.zeros(4, KVH, BS, 2 * D), torch.tensor([4, 5, 5]))


@pytest.mark.parametrize(("options", "exc", "match"), [
    ({"pool_blocks": 10 ** 12}, ValueError, "pool_blocks = 1000000000000 needs .* GiB of pools .* more than this "
                                            "machine's memory"),
    ({"pool_blocks": 2 ** 70}, ValueError, r"pool_blocks'\] must be in \[1, 2\^40\]"),
    ({"mode": None}, TypeError, r"mode'\] must be a str, got None"),
    ({"kernel": 3}, TypeError, r"kernel'\] must be a str"),
])
def test_absurd_option_values_name_the_option(options: dict, exc: type, match: str) -> None:
    with pytest.raises(exc, match=match):
        backend.Builder(spec(), LAYERS, vllm_config(options), torch.device("cpu"))


def test_geometry_overflow_is_rejected() -> None:
    with pytest.raises(ValueError, match="below 2\\^40 elements per block"):
        backend.Engine(1, 1, 1, 2 ** 31, 2 ** 31, torch.float32, 1, 1)


def test_aggregate_info_does_not_add_up_sizes() -> None:
    args = (1, H, KVH, D, BS, torch.float32, 4, 2)
    engines = [backend.Engine(*args), backend.Engine(*args)]
    info = telemetry.snapshot()["info"]
    assert info["block_size"] == BS and info["num_layers"] >= len(engines)


ACCESSORS_DURING_FORWARD = """
import threading, torch
import activekv._backend as backend
H, KVH, D, BS = 4, 2, 32, 16
e = backend.Engine(1, H, KVH, D, BS, torch.float32, 64, 2, mode="compressed", budget_tokens=64, sink_blocks=1,
                   recent_blocks=1)
cache = torch.zeros(64, KVH, BS, 2 * D)
e.update_kv(0, torch.randn(1000, KVH, D), torch.randn(1000, KVH, D), cache, torch.arange(1000))
plan = e.build(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([1000, 900], dtype=torch.int32),
               torch.stack([torch.arange(64, dtype=torch.int32), torch.arange(64, dtype=torch.int32)]), 2, 2)
q = torch.randn(2, H, D)
stop = False
def step():
    for _ in range(300):
        e.forward(0, plan, q, cache, torch.empty(2, H, D), 0.2)
def read():
    while not stop:
        sel = e.selection(0)
        assert all(t.shape[0] == KVH for t in sel.values())
        e.pool(0), e.key_min(0), e.key_max(0), e.resident(0)
readers = [threading.Thread(target=read) for _ in range(2)]
[t.start() for t in readers]
step()
stop = True
[t.join() for t in readers]
print("ok", sorted(e.selection(0)))
"""


def test_state_accessors_while_another_thread_steps() -> None:
    """Engine.selection() (and the other accessors) read the engine's state while a compressed forward on another
    thread rewrote it: SIGSEGV. They now copy under the engine's lock. A subprocess, so a crash fails one test."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", ACCESSORS_DURING_FORWARD], capture_output=True, text=True,
                          timeout=300)
    assert (done.returncode, done.stdout.strip()) == (0, "ok [0, 1]"), done.stderr[-3000:]


def test_engine_accessors_hand_out_copies() -> None:
    """pool(layer) / key_min(layer) returned the engine's own tensors: set_() on one swapped the engine's storage and
    the next step read or wrote out of bounds."""
    e = backend.Engine(1, H, KVH, D, BS, torch.float32, 4, 2)
    c = backend.Engine(1, H, KVH, D, BS, torch.float32, 0, 2, mode="compressed", placement="in_place")  # key min/max
    cache, c_cache = torch.zeros(4, KVH, BS, 2 * D), torch.zeros(4, KVH, BS, 2 * D)
    e.update_kv(0, torch.ones(3, KVH, D), torch.ones(3, KVH, D), cache, torch.arange(3))
    c.update_kv(0, torch.ones(3, KVH, D), torch.ones(3, KVH, D), c_cache, torch.arange(3))
    for got in (e.pool(0), c.key_min(0), c.key_max(0)):
        got.set_(torch.empty(0))
    assert e.pool(0).shape == (4, KVH, 2, BS, D) and c.key_min(0).shape == c.key_max(0).shape == (4, KVH, D)
    plan = e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                   torch.zeros(1, 1, dtype=torch.int32), 1, 1)
    out = torch.empty(1, H, D)
    e.forward(0, plan, torch.ones(1, H, D), cache, out, 0.1)
    torch.testing.assert_close(out, torch.ones(1, H, D))  # every value is 1: the mean of ones


def test_a_query_start_loc_that_wraps_in_32_bits_is_rejected_before_counting() -> None:
    """A decreasing query_start_loc whose difference wraps in 32-bit arithmetic was accepted; the forward that then
    failed had already advanced the counters."""
    block_size, first = 2 ** 16, 2 ** 30 + 1  # row 0 holds 2^30 + 1 query tokens: a block table of 16385 columns
    e = backend.Engine(1, 1, 1, 8, block_size, torch.float32, 2, 1)
    before = e.snapshot()
    qsl = torch.tensor([0, first, -first], dtype=torch.int32)  # -first - first = -2^31 - 2 wraps to 2^31 - 2 in int32
    table = torch.zeros(2, first // block_size + 1, dtype=torch.int32)
    with pytest.raises(ValueError, match=f"query_start_loc must be non-decreasing, got {first} then {-first}"):
        e.build(qsl, torch.tensor([first, 1], dtype=torch.int32), table, 2, 2)
    assert e.snapshot() == before


@pytest.mark.parametrize("other", ["kv_cache", "query"])
def test_an_output_overlapping_what_forward_reads_is_rejected(other: str) -> None:
    e = backend.Engine(1, H, KVH, D, BS, torch.float32, 4, 2)
    cache = torch.zeros(4, KVH, BS, 2 * D)
    e.update_kv(0, torch.ones(3, KVH, D), torch.ones(3, KVH, D), cache, torch.arange(3))
    plan = e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([3], dtype=torch.int32),
                   torch.zeros(1, 1, dtype=torch.int32), 1, 1)
    q = torch.ones(1, H, D)
    out = cache.view(-1)[: H * D].view(1, H, D) if other == "kv_cache" else q
    before, snap = cache.clone(), e.snapshot()
    with pytest.raises(ValueError, match=f"output and {other} must not share memory"):
        e.forward(0, plan, q, cache, out, 0.1)
    assert torch.equal(cache, before) and e.snapshot() == snap


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_scale_is_rejected(scale: float) -> None:
    with pytest.raises(ValueError, match="scale must be a finite number, got"):
        backend.Impl(H, D, scale, KVH)
    e = backend.Engine(1, H, KVH, D, BS, torch.float32, 4, 2)
    cache = torch.zeros(4, KVH, BS, 2 * D)
    plan = e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                   torch.zeros(1, 1, dtype=torch.int32), 1, 1)
    with pytest.raises(ValueError, match="scale must be a finite number, got"):
        e.forward(0, plan, torch.ones(1, H, D), cache, torch.empty(1, H, D), scale)


@pytest.mark.parametrize(("options", "match"), [
    ({"mode\udc80": "exact"}, r"an additional_config\['activekv'\] key must be text UTF-8 can encode, got 'mode\\udc80'"),
    ({"mode": "exact\udc80"}, r"additional_config\['activekv'\]\['mode'\] must be text UTF-8 can encode"),
])
def test_option_text_with_a_lone_surrogate_is_named(options: dict, match: str) -> None:
    """pybind11 said "Unable to cast Python instance of type <class 'str'> to C++ type '?'"."""
    with pytest.raises(ValueError, match=match):
        backend.Builder(spec(), LAYERS, vllm_config(options), torch.device("cpu"))


def test_activekv_options_in_a_mapping_that_is_no_dict_are_refused() -> None:
    """A MappingProxyType additional_config holding "activekv" was silently ignored (default options ran)."""
    from types import MappingProxyType

    extra = MappingProxyType({"activekv": {"pool_blocks": 3, "tile_blocks": 2}})
    with pytest.raises(TypeError, match="additional_config must be a dict to carry ActiveKV options, got a "
                                        "<class 'mappingproxy'>"):
        backend.Builder(spec(), LAYERS, vllm_config(extra=extra), torch.device("cpu"))
    other = backend.Builder(spec(), LAYERS, vllm_config(extra=MappingProxyType({"someone_else": 1})),
                            torch.device("cpu"))  # a mapping without ActiveKV options belongs to someone else
    assert (other.engine.placement, other.engine.pool_blocks) == ("in_place", 0)


@pytest.mark.parametrize("key", ["ActiveKV", "ACTIVEKV", "activeKV"])
def test_options_under_a_mis_cased_key_are_refused_not_ignored(key: str) -> None:
    """{"ActiveKV": {...}} was never read: the engine ran with default options and said nothing."""
    extra = {key: {"mode": "compressed"}, "someone_else": {"x": 1}, 3: "a non-str key"}
    msg = rf"additional_config\['{key}'\] is not read: ActiveKV's options go under the lower-case key 'activekv'"
    with pytest.raises(ValueError, match=msg):
        backend.Builder(spec(), LAYERS, vllm_config(extra=extra), torch.device("cpu"))
    with pytest.raises(ValueError, match=msg):
        backend.check_config(vllm_config(extra=extra))
    extra = {"activekv": {"pool_blocks": 32}, "someone_else": {"x": 1}, 3: "a non-str key"}
    b = backend.Builder(spec(), LAYERS, vllm_config(extra=extra), torch.device("cpu"))
    assert (b.engine.placement, b.engine.pool_blocks) == ("pool", 32)


def test_a_nan_in_a_later_tokens_value_stays_out_of_earlier_rows_on_every_kernel() -> None:
    """A 40-token prefill whose token 39 has a NaN in its V: on the ATen path (every non-CPU device, and
    kernel 'aten') 0 x NaN in P x V made rows 0-38 NaN; the native CPU kernel was right. Both now agree there."""
    torch.manual_seed(3)
    k, v, q = torch.randn(40, KVH, D), torch.randn(40, KVH, D), torch.randn(40, H, D)
    v[39, 0, 7] = float("nan")
    outs = {}
    for kernel in ("aten", "native"):
        e = backend.Engine(1, H, KVH, D, BS, torch.float32, 4, 2, kernel=kernel)
        cache = torch.zeros(4, KVH, BS, 2 * D)
        e.update_kv(0, k, v, cache, torch.arange(40))
        plan = e.build(torch.tensor([0, 40], dtype=torch.int32), torch.tensor([40], dtype=torch.int32),
                       torch.arange(3, dtype=torch.int32)[None], 1, 40)
        outs[kernel] = torch.empty(40, H, D)
        e.forward(0, plan, q, cache, outs[kernel], D ** -0.5)
    for out in outs.values():
        assert bool(out[:39].isfinite().all()) and bool(out[39, :2, 7].isnan().all())
    torch.testing.assert_close(outs["aten"][:39], outs["native"][:39], atol=2e-5, rtol=2e-5)


def test_each_llm_reaches_its_own_engine_through_its_own_impls() -> None:
    """Two LLMs in one process (same layer names, each with its own attention Impls, as vLLM builds them): a Builder
    binds its engine to the Impls of the layers it serves, so each KV update reaches its LLM's engine without any
    lookup by layer name across engines; an Impl no builder bound is served by no engine, whatever its layer name."""
    impl_a, impl_b = backend.Impl(H, D, D ** -0.5, KVH), backend.Impl(H, D, D ** -0.5, KVH)
    opts = {"pool_blocks": 3, "tile_blocks": 1}
    first = backend.Builder(spec(), LAYERS, vllm_config(opts, impls={LAYERS[0]: impl_a}), torch.device("cpu"))
    second = backend.Builder(spec(), LAYERS, vllm_config(opts, impls={LAYERS[0]: impl_b}), torch.device("cpu"))
    cache_a, cache_b = torch.zeros(8, KVH, BS, 2 * D), torch.zeros(8, KVH, BS, 2 * D)
    _prefill_and_check(first, impl_a, cache_a, seed=4)
    _prefill_and_check(second, impl_b, cache_b, seed=5)
    _prefill_and_check(first, impl_a, cache_a, seed=6)
    assert first.engine.snapshot()["kv_update_calls"] == 2 and second.engine.snapshot()["kv_update_calls"] == 1
    late = backend.Impl(H, D, D ** -0.5, KVH)  # made after both builders: neither bound it
    k = torch.zeros(1, KVH, D)
    with pytest.raises(ValueError, match=f"no ActiveKV engine serves layer '{LAYERS[0]}'"):
        late.do_kv_cache_update(SimpleNamespace(layer_name=LAYERS[0]), k, k, cache_a, torch.zeros(1, dtype=torch.int64))
    assert first.engine.snapshot()["kv_update_calls"] == 2


def test_a_released_builders_engine_no_longer_serves_its_impls() -> None:
    import gc

    impl = backend.Impl(H, D, D ** -0.5, KVH)
    b = backend.Builder(spec(), LAYERS, vllm_config({"pool_blocks": 3, "tile_blocks": 1},
                                                    impls=dict.fromkeys(LAYERS, impl)), torch.device("cpu"))
    k, cache, layer = torch.zeros(1, KVH, D), torch.zeros(4, KVH, BS, 2 * D), SimpleNamespace(layer_name=LAYERS[1])
    impl.do_kv_cache_update(layer, k, k, cache, torch.zeros(1, dtype=torch.int64))
    assert b.engine.snapshot()["kv_update_calls"] == 1
    del b
    gc.collect()
    with pytest.raises(ValueError, match="was not created or was released"):
        impl.do_kv_cache_update(layer, k, k, cache, torch.zeros(1, dtype=torch.int64))


def test_a_static_forward_context_that_is_no_dict_is_named() -> None:
    cfg = vllm_config({"pool_blocks": 3, "tile_blocks": 1})
    cfg.compilation_config.static_forward_context = [LAYERS[0]]
    with pytest.raises(TypeError, match=r"compilation_config.static_forward_context must be a dict .*got \["):
        backend.Builder(spec(), LAYERS, cfg, torch.device("cpu"))


def test_key_min_and_key_max_are_in_the_kv_dtype() -> None:
    e = backend.Engine(1, H, KVH, D, BS, torch.bfloat16, 0, 2, mode="compressed", placement="in_place")
    k = torch.randn(3, KVH, D).to(torch.bfloat16)
    e.update_kv(0, k, k, torch.zeros(2, KVH, BS, 2 * D, dtype=torch.bfloat16), torch.arange(3))
    assert e.key_min(0).dtype == e.key_max(0).dtype == torch.bfloat16
    for doc in (backend.Engine.key_min.__doc__, backend.Engine.key_max.__doc__):
        assert "in the KV dtype" in doc and "float32" not in doc


KEY_METADATA_BY_MODE = '''
import torch
import activekv._backend as backend
import activekv._telemetry as telemetry
L, H, KVH, D, BS, NB = 2, 4, 2, 32, 16, 12
def gauge():
    return {f.name: f.samples[0].value for f in telemetry.Collector().collect()}["activekv_key_metadata_bytes"]
def engine(dtype, **kw):
    e = backend.Engine(L, H, KVH, D, BS, dtype, kw.pop("pool_blocks", 0), 2, **kw)
    for layer in range(L):
        e.update_kv(layer, torch.ones(3, KVH, D, dtype=dtype), torch.ones(3, KVH, D, dtype=dtype),
                    torch.zeros(NB, KVH, BS, 2 * D, dtype=dtype), torch.arange(3))
    return e
out = []
exact = [engine(torch.float32, placement="in_place"), engine(torch.bfloat16, pool_blocks=4)]
out.append([e.key_min(0) is None and e.key_max(1) is None for e in exact] + [gauge()])
c = engine(torch.bfloat16, placement="in_place", mode="compressed")
out.append([c.key_min(1).shape == c.key_max(0).shape == (NB, KVH, D), gauge()])
print(out)
'''


def test_exact_mode_holds_no_key_metadata_and_compressed_does() -> None:
    """Exact mode never reads per-block key min/max (1/block_size of the KV cache's bytes): it allocates none, in place
    or with a pool; compressed mode holds them for every block of every layer. activekv_key_metadata_bytes says so.
    A subprocess: the gauge sums every live engine of the process."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", KEY_METADATA_BY_MODE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    compressed_bytes = 2 * 12 * KVH * D * 2 * 2  # (min, max) x blocks x heads x dims x bf16 bytes x layers
    assert done.stdout.strip() == str([[True, True, 0.0], [True, float(compressed_bytes)]])


def test_engine_build_takes_the_engines_argument_order() -> None:
    """Engine.build(query_start_loc, seq_lens, block_table, num_reqs, num_actual_tokens), as the C++ build: rows past
    num_reqs (vLLM's padding) are not planned."""
    e = backend.Engine(1, H, KVH, D, BS, torch.float32, 4, 2)
    plan = e.build(torch.tensor([0, 1, 2], dtype=torch.int32), torch.tensor([3, 5], dtype=torch.int32),
                   torch.zeros(2, 1, dtype=torch.int32), 1, 1)
    assert (plan.num_reqs, plan.num_actual_tokens, plan.seq_lens.tolist()) == (1, 1, [3])
    signature = backend.Engine.build.__doc__.split("\n")[0]
    assert signature.index("block_table") < signature.index("num_reqs") < signature.index("num_actual_tokens")


def test_supports_compute_capability_on_cpu_and_cuda_answers() -> None:
    """vLLM's CPU routing (patch 0003) validates ACTIVEKV with device_capability=None: True, never an error. A CUDA
    capability is answered (this CPU build has no CUDA kernel: any architecture); anything else is a TypeError."""
    assert backend.supports_compute_capability(None) is True
    assert backend.supports_compute_capability(SimpleNamespace(major=9, minor=0)) is True
    for bad in (SimpleNamespace(major=9), SimpleNamespace(major="9", minor=0), SimpleNamespace(major=True, minor=0),
                SimpleNamespace(major=2**70, minor=0), 90):
        with pytest.raises(TypeError, match="capability must be None or a DeviceCapability"):
            backend.supports_compute_capability(bad)
    with pytest.raises(ValueError, match="minor in"):
        backend.supports_compute_capability(SimpleNamespace(major=9, minor=10))


def test_kv_cache_allocation_delegates_leave_cpu_caches_alone() -> None:
    """Patch 0005's two delegates in vllm/v1/worker/utils.py, loaded by CPU vLLM too: a CPU KV cache keeps vLLM's
    device and buffer (the same tensor object); a meta buffer of the wrong kind is refused by name."""
    config = SimpleNamespace(kv_cache_tensors=[SimpleNamespace(layers=list(LAYERS))])
    assert backend.kv_cache_device(config, torch.device("cpu")) == torch.device("cpu")
    buf = torch.zeros(64, dtype=torch.int8)
    assert backend.host_tier_buffer(buf) is buf
    with pytest.raises(ValueError, match="1-D int8 meta tensor"):
        backend.host_tier_buffer(torch.empty(4, 4, dtype=torch.int8, device="meta"))
