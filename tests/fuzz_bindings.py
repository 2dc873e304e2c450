"""Property-based fuzz cases of the binding boundary (hypothesis). Not collected by pytest on its own:
tests/test_fuzz_bindings.py runs each `fuzz_*` case with `python -m tests.fuzz_bindings CASE` in a subprocess, so a
segfault or an abort is a test failure, not a lost test run.

Every case builds a valid input for a native entry point, then (most examples) changes one argument: wrong dtype,
device (meta), rank, shape, stride/contiguity, requires_grad, None, out-of-range block-table / slot-mapping entries,
sequence lengths beyond the geometry, mismatched batch sizes, extreme integers. The oracle:
- accepted input: the result matches the Python reference (tests/reference/engine.py) bit for bit on the ATen path,
  within docs/parity.md's tolerance on the native kernel;
- rejected input: ValueError / TypeError / IndexError / RuntimeError (NotImplementedError is one) whose message names
  the argument, and nothing changed (KV cache bytes, pool, page table, telemetry counters);
- a mutation marked "must reject" that is accepted is a failure.

Example counts: ACTIVEKV_FUZZ_EXAMPLES (default 300 per case, derandomized so CI is repeatable); setting it also
switches to random exploration (ACTIVEKV_FUZZ_SEED fixes the seed).
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
from hypothesis import HealthCheck, assume, given, note, settings
from hypothesis import strategies as st

import activekv._admission as admission  # after torch: the modules' import guard needs it
import activekv._attention as attention
import activekv._backend as backend
import activekv._endpoint as endpoint
import activekv._geometry as geometry
import activekv._kv_state as kv_state
import activekv._telemetry as telemetry
import activekv._transfer as transfer
from tests.reference import engine as ref

_EXAMPLES = os.environ.get("ACTIVEKV_FUZZ_EXAMPLES")
settings.register_profile(
    "activekv", max_examples=int(_EXAMPLES or 300), deadline=None, derandomize=_EXAMPLES is None, database=None,
    print_blob=True, suppress_health_check=list(HealthCheck))
settings.load_profile("activekv")

ERRORS = (ValueError, TypeError, IndexError, RuntimeError)
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
TOLERANCE = {torch.float32: 2e-6, torch.bfloat16: 1.6e-2, torch.float16: 2e-3}  # docs/parity.md, native kernel
INT64_MAX = 2**63 - 1
EXTREME = st.sampled_from([-(2**63), -(2**62), -2, -1, 0, 2**31, 2**40, 2**62, INT64_MAX])

STATS = {"examples": 0, "accepted": 0, "rejected": 0}


def expect_rejected(fn, names: tuple[str, ...]) -> BaseException:
    """Call fn; it must raise one of ERRORS whose message names one of `names` (the argument) and carries no C++
    backtrace or pybind11 cast failure."""
    try:
        fn()
    except ERRORS as e:
        msg = str(e)
        assert any(n in msg for n in names), f"message does not name {names}: {type(e).__name__}: {msg}"
        assert "Exception raised from" not in msg and "Unable to cast" not in msg, msg
        assert "INTERNAL ASSERT" not in msg, msg
        STATS["rejected"] += 1
        return e
    raise AssertionError(f"invalid input naming {names} was accepted")


def call(fn, names: tuple[str, ...], must_reject: bool):
    """Run fn: (True, result) if accepted, (False, exc) if rejected (checked as in expect_rejected)."""
    if must_reject:
        return False, expect_rejected(fn, names)
    try:
        out = fn()
    except ERRORS:
        return False, expect_rejected(fn, names)
    STATS["accepted"] += 1
    return True, out


def example() -> None:
    STATS["examples"] += 1


# ---- tensor mutations: (description, function, must_reject) --------------------------------------------------------

def strided(t: torch.Tensor) -> torch.Tensor:
    """The same values, not contiguous (every other element of a buffer twice as long in the last dim)."""
    if t.dim() == 0 or t.numel() == 0:
        return t
    buf = torch.zeros(*t.shape[:-1], 2 * t.shape[-1], dtype=t.dtype)
    buf[..., ::2] = t
    return buf[..., ::2]


def other_dtype(t: torch.Tensor) -> torch.dtype:
    if t.dtype.is_floating_point:
        return torch.float64 if t.dtype != torch.float64 else torch.float32
    return torch.float32


def tensor_mutations(t: torch.Tensor, *, contiguous_required: bool, floating: bool, dim0_free: bool):
    """Mutations of one tensor argument and whether each must be rejected."""
    out = [
        ("dtype", lambda: t.to(other_dtype(t)), True),
        ("meta device", lambda: torch.empty_like(t, device="meta"), True),
        ("rank +1", lambda: t.unsqueeze(0), True),
        ("rank -1", lambda: t.reshape(-1) if t.dim() > 1 else (t[0] if t.numel() else t.sum()), True),
        ("strided", lambda: strided(t), contiguous_required and t.dim() > 0 and t.numel() > 1),
        ("None", lambda: None, True),
    ]
    if t.dim() >= 1:
        out.append(("dim0 + 1", lambda: torch.cat([t, t[:1]]) if t.shape[0] else t.new_zeros(1, *t.shape[1:]),
                    not dim0_free))
    if t.dim() >= 2:
        out.append(("last dim + 1", lambda: torch.cat([t, t[..., :1]], dim=-1), True))
    if floating:
        out.append(("int dtype", lambda: t.to(torch.int32), True))
        out.append(("requires_grad", lambda: t.detach().clone().requires_grad_(True), True))
    if t.numel() > 0:
        out.append(("storage shrunk under the view", lambda: shrunk(t), True))
    return out


def shrunk(t: torch.Tensor) -> torch.Tensor:
    """A copy of t whose storage is then resized to half its bytes: the view reaches past the storage's end."""
    c = t.clone()
    c.untyped_storage().resize_(c.untyped_storage().nbytes() // 2)
    return c


# ---- geometry -----------------------------------------------------------------------------------------------------

@st.composite
def geometries(draw, max_heads: int = 4):
    kvh = draw(st.sampled_from([1, 2]))
    group = draw(st.sampled_from([1, 2]))
    return SimpleNamespace(num_layers=draw(st.integers(1, 2)), num_heads=kvh * group, num_kv_heads=kvh,
                           head_size=draw(st.sampled_from([4, 8, 12])), block_size=draw(st.sampled_from([1, 2, 4])),
                           dtype=draw(st.sampled_from(DTYPES)), tile_blocks=draw(st.integers(1, 3)))


def geometry_valid(nl, h, kvh, d, bs, dtype, tb) -> bool:
    if min(nl, h, kvh, d, bs, tb) <= 0 or h % kvh or dtype not in DTYPES:
        return False
    elems = kvh * 2 * bs * d
    return elems <= 2**40 and tb * bs <= INT64_MAX


@given(st.lists(st.integers(1, 6), min_size=6, max_size=6), st.one_of(st.none(), st.integers(0, 5)),
       st.one_of(st.integers(-2, 0), EXTREME), st.sampled_from(DTYPES + (torch.float64, torch.int32, torch.bool)))
def fuzz_geometry(ints, bad_at, bad, dtype) -> None:
    """Geometry's constructor and helpers with small, negative and extreme integers (one at a time, or none)."""
    example()
    if bad_at is not None:
        ints[bad_at] = bad
    nl, h, kvh, d, bs, tb = ints
    if bad_at is None and dtype in DTYPES:
        h = kvh * h  # a valid GQA ratio
    if geometry_valid(nl, h, kvh, d, bs, dtype, tb):
        g = geometry.Geometry(nl, h, kvh, d, bs, dtype, tb)
        STATS["accepted"] += 1
        assert (g.num_heads, g.group_size, g.tile_tokens) == (h, h // kvh, tb * bs)
        for length in (0, 1, bs, 2**40):
            assert g.blocks_for(length) == -(-length // bs)
        expect_rejected(lambda: g.blocks_for(-1), ("length",))
        expect_rejected(lambda: g.slot_to_block(-2), ("slot",))
        assert g.slot_to_block(2**40) == (2**40 // bs, 2**40 % bs)
        expect_rejected(lambda: g.kv_cache_shape(-1), ("num_blocks",))
        assert g.vllm_cache_shape(3) == [3, kvh, bs, 2 * d]
    else:
        names = ("num_layers", "num_heads", "num_kv_heads", "head_size", "block_size", "tile_blocks", "dtype")
        expect_rejected(lambda: geometry.Geometry(nl, h, kvh, d, bs, dtype, tb), names)


@given(geometries(), st.integers(0, 4), st.data())
def fuzz_as_block_layout(gs, num_blocks, data) -> None:
    """as_block_layout: both accepted layouts view the same bytes; any other tensor is rejected by name."""
    example()
    g = geometry.Geometry(gs.num_layers, gs.num_heads, gs.num_kv_heads, gs.head_size, gs.block_size, gs.dtype,
                          gs.tile_blocks)
    cache = torch.randn(num_blocks, gs.num_kv_heads, gs.block_size, 2 * gs.head_size).to(gs.dtype)
    want = cache.view(num_blocks, gs.num_kv_heads, 2, gs.block_size, gs.head_size)
    assert torch.equal(geometry.as_block_layout(g, cache), want)
    muts = tensor_mutations(cache, contiguous_required=True, floating=True, dim0_free=True)
    desc, mutate, must = data.draw(st.sampled_from(muts))
    note(desc)
    if desc in ("meta device", "requires_grad"):
        must = False  # a view: no bytes are read or written (the engine's host_view rejects any device but its own)
    ok, res = call(lambda: geometry.as_block_layout(g, mutate(), "my_cache"), ("my_cache", "geometry"), must)
    if ok:
        assert res.shape[1:] == want.shape[1:]


# ---- attention building blocks -------------------------------------------------------------------------------------

@given(st.integers(1, 3), st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.sampled_from([4, 8]),
       st.sampled_from([1, 2, 4]), st.integers(1, 4), st.integers(1, 3), st.sampled_from(DTYPES), st.data())
def fuzz_tiled_attention(lq, kvh, group, d, bs, nb, tile_blocks, dtype, data) -> None:
    """tiled_attention against the reference (bit for bit, one thread), and with one argument changed."""
    example()
    h = kvh * group
    seq = data.draw(st.integers(lq, max(lq, nb * bs)))
    nb = max(nb, -(-seq // bs))
    q = torch.randn(lq, h, d).to(dtype)
    kv = torch.randn(nb, kvh, 2, bs, d).to(dtype)
    scale = d ** -0.5
    assert torch.equal(attention.tiled_attention(q, kv, seq, tile_blocks, scale),
                       ref.tiled_attention(q, kv, seq, tile_blocks, scale))
    STATS["accepted"] += 1
    which = data.draw(st.sampled_from(["q", "kv", "seq_len", "tile_blocks"]))
    args = {"q": q, "kv": kv, "seq_len": seq, "tile_blocks": tile_blocks}
    if which in ("q", "kv"):
        muts = [m for m in tensor_mutations(args[which], contiguous_required=False, floating=True, dim0_free=True)
                if m[0] not in ("requires_grad",)]
        desc, mutate, must = data.draw(st.sampled_from(muts))
        if desc == "dtype":  # another floating dtype is computed in float32 like any other
            must = False
        if desc == "dim0 + 1" and which == "q":
            must = lq + 1 > seq
    else:
        desc, bad = data.draw(st.sampled_from([("zero", 0), ("negative", -1), ("extreme", INT64_MAX),
                                               ("too long", nb * bs + 1), ("below lq", lq - 1)]))
        mutate, must = (lambda: bad), True
        if which == "tile_blocks" and bad > 0:
            must = False
    note(f"{which}: {desc}")
    args[which] = mutate()
    names = {"q": ("q", "with head_size"), "kv": ("kv", "num_kv_heads", "head_size"), "seq_len": ("seq_len",),
             "tile_blocks": ("tile_blocks",)}[which] + ("num_heads", "num_q_tokens")
    ok, res = call(lambda: attention.tiled_attention(args["q"], args["kv"], args["seq_len"], args["tile_blocks"],
                                                     scale), names, must)
    if ok:
        assert torch.equal(res, ref.tiled_attention(args["q"], args["kv"], args["seq_len"], args["tile_blocks"],
                                                    scale), )


@given(st.one_of(st.integers(-3, 40), EXTREME), st.integers(0, 8), st.one_of(st.integers(-3, 40), EXTREME),
       st.integers(0, 8))
def fuzz_tile_mask(first_query_pos, num_q_tokens, key_start, num_keys) -> None:
    """tile_mask with extreme positions: the reference's mask, or a ValueError when a position overflows int64."""
    example()
    overflow = first_query_pos + num_q_tokens > INT64_MAX or key_start + num_keys > INT64_MAX
    if overflow:
        expect_rejected(lambda: attention.tile_mask(first_query_pos, num_q_tokens, key_start, num_keys),
                        ("first_query_pos", "key_start"))
        return
    got = attention.tile_mask(first_query_pos, num_q_tokens, key_start, num_keys)
    STATS["accepted"] += 1
    assert torch.equal(got, ref.tile_mask(first_query_pos, num_q_tokens, key_start, num_keys))


@given(st.integers(0, 3), st.integers(0, 4), st.integers(0, 6), st.one_of(st.integers(-2, 5), EXTREME),
       st.booleans())
def fuzz_group_query(lq, h, d, num_kv_heads, strided_out) -> None:
    """group_query / ungroup_output: the reference's layout for any divisible shape, a named error otherwise."""
    example()
    q = torch.randn(lq, h, d)
    if num_kv_heads > 0 and h > 0 and h % num_kv_heads == 0:
        qg = attention.group_query(q, num_kv_heads)
        STATS["accepted"] += 1
        assert torch.equal(qg, ref.group_query(q, num_kv_heads))
        out = strided(qg) if strided_out else qg
        if lq > 0:
            assert torch.equal(attention.ungroup_output(out, lq), ref.ungroup_output(qg.contiguous(), lq))
        expect_rejected(lambda: attention.ungroup_output(qg, 0), ("num_q_tokens",))
    else:
        expect_rejected(lambda: attention.group_query(q, num_kv_heads), ("num_kv_heads", "num_heads"))


# ---- transfers -----------------------------------------------------------------------------------------------------

@given(st.integers(1, 5), st.integers(1, 5), st.sampled_from(DTYPES), st.data())
def fuzz_copy_blocks(n_src, n_dst, dtype, data) -> None:
    """copy_blocks: dst[dst_ids[i]] = src[src_ids[i]]; bad ids, shapes, dtypes rejected with dst untouched."""
    example()
    src = torch.randn(n_src, 2, 3).to(dtype)
    dst = torch.randn(n_dst, 2, 3).to(dtype)
    k = data.draw(st.integers(0, n_dst))
    dst_ids = data.draw(st.permutations(range(n_dst)))[:k]
    src_ids = [data.draw(st.integers(0, n_src - 1)) for _ in range(k)]
    kind = data.draw(st.sampled_from(["valid", "src_ids", "dst_ids", "dst dup", "lengths", "dtype", "shape",
                                      "dst meta", "dst grad"]))
    note(kind)
    must = kind != "valid"
    names: tuple[str, ...] = ("src", "dst")
    if kind == "src_ids":
        src_ids = src_ids + [data.draw(st.one_of(st.integers(n_src, n_src + 3), st.integers(-3, -1), EXTREME
                                                 .filter(lambda x: x < 0 or x >= n_src)))]
        dst_ids = dst_ids + [0] if 0 not in dst_ids else dst_ids + [n_dst]
        names = ("src_ids", "dst_ids")
    elif kind == "dst_ids":
        dst_ids = dst_ids + [data.draw(st.one_of(st.integers(n_dst, n_dst + 3), st.integers(-3, -1)))]
        src_ids = src_ids + [0]
        names = ("dst_ids",)
    elif kind == "dst dup":
        if not dst_ids:
            return
        dst_ids, src_ids = dst_ids + [dst_ids[0]], src_ids + [0]
        names = ("dst_ids",)
    elif kind == "lengths":
        src_ids = src_ids + [0]
        names = ("src_ids",)
    elif kind == "dtype":
        dst = dst.to(torch.float64)
    elif kind == "shape":
        dst = torch.randn(n_dst, 3, 2).to(dtype)
    elif kind == "dst meta":
        dst = torch.empty_like(dst, device="meta")
        must = False  # a meta destination copies nothing real, but is not an error of the caller's data
    elif kind == "dst grad":
        dst = dst.requires_grad_(True)
    before = dst.detach().clone() if dst.device.type != "meta" else None
    ok, res = call(lambda: transfer.copy_blocks(src, dst, src_ids, dst_ids), names, must)
    if ok:
        if before is not None:
            want = before.clone()
            for s, t in zip(src_ids, dst_ids):
                want[t] = src[s]
            assert torch.equal(dst, want)
        assert res == len(src_ids) * src[0].numel() * src.element_size()
    elif before is not None:
        assert torch.equal(dst.detach(), before), "rejected copy changed dst"


# ---- admission -----------------------------------------------------------------------------------------------------

@given(st.integers(1, 5), st.integers(0, 8),
       st.lists(st.tuples(st.booleans(), st.lists(st.integers(-2, 9), max_size=6)), min_size=1, max_size=12))
def fuzz_page_pool(pool_blocks, host_blocks, ops) -> None:
    """PagePool admit/release sequences against the reference admission (reference RefEngine._admit), with invalid
    ids, oversized tiles and unpinned releases rejected and the page table unchanged."""
    example()
    p = admission.PagePool(pool_blocks, host_blocks)
    r = ref.RefEngine(1, 1, 1, 1, 1, torch.float32, pool_blocks, 1)
    lay = r.layers[0]
    lay.host_blocks, lay.slot_of_block = host_blocks, [-1] * host_blocks
    for is_admit, ids in ops:
        before = p.resident()
        pins = list(lay.pins)
        if is_admit:
            valid = all(0 <= b < host_blocks for b in ids) and len(ids) <= pool_blocks - sum(x > 0 for x in pins)
            ok, res = call(lambda: p.admit(ids), ("block id", "tile"), not valid)
            if ok:
                slots, miss_b, miss_s, hits, evicted = r._admit(lay, ids)
                assert res == {"slots": slots, "miss_blocks": miss_b, "miss_slots": miss_s, "hits": hits,
                               "evicted": evicted}
        else:
            counts = {s: ids.count(s) for s in ids}
            valid = all(0 <= s < pool_blocks and pins[s] >= c for s, c in counts.items())
            ok, _ = call(lambda: p.release(ids), ("slot",), not valid)
            if ok:
                for s in ids:
                    lay.pins[s] -= 1
        if not ok:
            assert p.resident() == before
        assert p.resident() == {b: s for b, s in enumerate(lay.slot_of_block) if s >= 0}


@given(st.sampled_from([1, 2]), st.sampled_from([1, 2]), st.sampled_from([4, 8]), st.integers(0, 2),
       st.integers(1, 2), st.integers(1, 3), st.sampled_from(DTYPES), st.data())
def fuzz_select_blocks(kvh, group, d, sink, recent, top_k, dtype, data) -> None:
    """Quest selection against the reference; bad shapes, dtypes, devices, ids and parameters rejected by name."""
    example()
    h = kvh * group
    per_head = sink + recent + top_k
    nb = data.draw(st.integers(per_head + 1, per_head + 4))
    host = nb + data.draw(st.integers(0, 3))
    q = torch.randn(1, h, d).to(dtype)
    a, b = torch.randn(host, kvh, d), torch.randn(host, kvh, d)
    kmin, kmax = torch.minimum(a, b), torch.maximum(a, b)
    rows = torch.tensor(data.draw(st.permutations(range(host)))[:nb], dtype=torch.int64)
    args = {"q": q, "key_min": kmin, "key_max": kmax, "row_blocks": rows, "sink_blocks": sink,
            "recent_blocks": recent, "top_k": top_k}
    which = data.draw(st.sampled_from(["none", "q", "key_min", "key_max", "row_blocks", "row id", "row short",
                                       "sink_blocks", "recent_blocks", "top_k", "q no heads"]))
    note(which)
    must = True
    if which in ("q", "key_min", "key_max", "row_blocks"):
        muts = [m for m in tensor_mutations(args[which], contiguous_required=False, floating=False, dim0_free=True)]
        desc, mutate, must = data.draw(st.sampled_from(muts))
        note(desc)
        if which == "q" and desc in ("dtype", "strided"):
            must = False
        if which in ("key_min", "key_max") and desc == "dim0 + 1":
            must = False
        if which == "row_blocks" and desc == "dim0 + 1":
            must = False  # one more (repeated) block id is a longer row, still valid
        args[which] = mutate()
    elif which == "row id":
        bad = data.draw(st.sampled_from([-1, -2, host, INT64_MAX]))
        args["row_blocks"] = rows.clone()
        args["row_blocks"][data.draw(st.integers(0, nb - 1))] = bad
        which = "row_blocks"
    elif which == "row short":
        args["row_blocks"] = rows[: per_head]
        which = "row_blocks"
    elif which in ("sink_blocks", "recent_blocks", "top_k"):
        args[which] = data.draw(st.sampled_from([-1, 0, -(2**63)]))
        must = not (which == "sink_blocks" and args[which] == 0)
    elif which == "q no heads":
        args["q"] = torch.randn(1, 0, d)
        which = "q"
    else:
        must = False
    names = (which, "blocks", "num_kv_heads", "head_size")
    ok, res = call(lambda: admission.select_blocks(**args), names, must)
    if ok:
        want = ref.select_blocks(args["q"], args["key_min"], args["key_max"], args["row_blocks"],
                                 args["sink_blocks"], args["recent_blocks"], args["top_k"])
        assert torch.equal(res, want)


# ---- KV state and the engine ---------------------------------------------------------------------------------------

@st.composite
def steps(draw, gs):
    """One vLLM step for geometry gs: rows with context/new tokens, block tables, slot mapping with padding."""
    bs = gs.block_size
    num_reqs = draw(st.integers(1, 3))
    seqs, lqs = [], []
    for _ in range(num_reqs):
        seq = draw(st.integers(1, 6 * bs))
        seqs.append(seq)
        lqs.append(draw(st.sampled_from([1, seq, min(seq, 1 + seq // 2)])))
    width = max(-(-s // bs) for s in seqs) + draw(st.integers(0, 1))
    need = sum(-(-s // bs) for s in seqs)
    host_blocks = need + draw(st.integers(0, 2))
    perm = draw(st.permutations(range(host_blocks)))
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    at = 0
    for r, s in enumerate(seqs):
        n = -(-s // bs)
        table[r, :n] = torch.tensor(perm[at:at + n], dtype=torch.int32)
        at += n
    qsl = [0]
    slots = []
    for r in range(num_reqs):
        qsl.append(qsl[-1] + lqs[r])
        for pos in range(seqs[r] - lqs[r], seqs[r]):
            slots.append(int(table[r, pos // bs]) * bs + pos % bs)
    pad = draw(st.integers(0, 2))
    return SimpleNamespace(qsl=torch.tensor(qsl, dtype=torch.int32), seq_lens=torch.tensor(seqs, dtype=torch.int32),
                           table=table, slots=torch.tensor(slots + [-1] * pad, dtype=torch.int64),
                           tokens=qsl[-1] + pad, num_actual=qsl[-1], host_blocks=host_blocks, num_reqs=num_reqs)


def engine_pair(gs, pool_extra: int, mode: str, kernel: str):
    kw = dict(mode=mode)
    if mode == "compressed":
        kw.update(budget_tokens=4 * gs.block_size, sink_blocks=1, recent_blocks=1)  # k = 2
        pool = gs.num_kv_heads * 2 + 2 + pool_extra
    else:
        pool = gs.tile_blocks + pool_extra
    pool = max(pool, gs.tile_blocks)
    args = (gs.num_layers, gs.num_heads, gs.num_kv_heads, gs.head_size, gs.block_size, gs.dtype, pool,
            gs.tile_blocks)
    return (backend.Engine(*args, torch.device("cpu"), kernel=kernel, **kw),
            ref.RefEngine(*args, kernel="aten", **kw))


def state_of(e: backend.Engine, caches: list[torch.Tensor]):
    snap = e.snapshot()
    return ([c.clone() for c in caches], [e.pool(i).clone() for i in range(e.num_layers)],
            [e.resident(i) for i in range(e.num_layers)], {k: snap[k] for k in ref.COUNTERS})


def assert_same_state(a, b) -> None:
    for x, y in zip(a[0] + a[1], b[0] + b[1]):
        assert torch.equal(x, y), "a rejected call changed a KV tier"
    assert a[2:] == b[2:], "a rejected call changed the page table or telemetry"


UPDATE_ARGS = ("layer", "key", "value", "kv_cache", "slot_mapping")
BUILD_ARGS = ("query_start_loc", "seq_lens", "block_table", "num_reqs", "num_actual_tokens")
FORWARD_ARGS = ("layer", "query", "kv_cache", "output")


def mutate_step(data, call_name: str, args: dict, gs, step):
    """Change one argument of a call; returns (arg name, description, must_reject)."""
    name = data.draw(st.sampled_from({"update_kv": UPDATE_ARGS, "build": BUILD_ARGS,
                                      "forward": FORWARD_ARGS}[call_name]))
    v = args[name]
    if isinstance(v, torch.Tensor):
        floating = v.dtype.is_floating_point
        contiguous_required = name in ("kv_cache", "output")
        dim0_free = name in ("key", "value", "query", "output", "kv_cache")
        muts = tensor_mutations(v, contiguous_required=contiguous_required, floating=floating, dim0_free=dim0_free)
        if name in ("query_start_loc", "seq_lens", "block_table", "slot_mapping"):
            muts = [m for m in muts if m[0] != "dtype"] + [
                ("int32<->int64", lambda: v.to(torch.int64 if v.dtype == torch.int32 else torch.int32), False),
                ("float", lambda: v.to(torch.float32), True), ("bool", lambda: v.to(torch.bool), True)]
            muts += index_value_mutations(name, v, gs, step)
        if name == "output":
            muts.append(("flat [T, H*D]", lambda: v.view(v.shape[0], -1), False))
        if name == "kv_cache":
            muts.append(("block layout [nb, kvh, 2, bs, d]",
                         lambda: v.view(v.shape[0], gs.num_kv_heads, 2, gs.block_size, gs.head_size), False))
        muts += alias_mutations(call_name, name, v, args)
        desc, mutate, must = data.draw(st.sampled_from(muts))
        if name == "key" and desc == "dim0 + 1" or name == "value" and desc == "dim0 + 1":
            must = True  # key and value must agree on the token count
        if name == "seq_lens" and desc == "dim0 + 1":
            must = False  # rows past num_reqs are ignored (vLLM pads them)
        if name == "block_table" and desc == "last dim + 1":
            must = False  # a wider table is fine
        if name == "kv_cache" and desc == "dim0 + 1":
            must = False  # one more block: a valid (rebound) KV cache
        if name in ("query_start_loc",) and desc == "dim0 + 1":
            must = False  # extra entries past num_reqs + 1 are ignored (vLLM pads them)
        if name == "block_table" and desc == "dim0 + 1":
            must = False
        args[name] = mutate()
    else:
        desc, bad, must = data.draw(st.sampled_from(int_mutations(name, v, gs, step)))
        args[name] = bad
    return name, desc, must


def alias_mutations(call_name: str, name: str, v: torch.Tensor, args: dict):
    """An argument replaced by a view of the same dtype and shape into memory the call writes (the KV cache an
    update writes; the output a forward writes) or, for a forward's output, into what it reads: must be rejected."""
    def view_into(other: torch.Tensor):
        return lambda: other.reshape(-1)[: v.numel()].view(v.shape)

    out = []
    cache = args.get("kv_cache")
    if call_name == "update_kv" and name in ("key", "value") and cache.dtype == v.dtype and cache.numel() >= v.numel():
        out.append(("view into kv_cache", view_into(cache), True))
    if call_name == "forward" and name == "output" and v.numel() > 0:
        if cache.dtype == v.dtype and cache.numel() >= v.numel():
            out.append(("view into kv_cache", view_into(cache), True))
        if args["query"].shape == v.shape:
            out.append(("the query itself", lambda: args["query"], True))
    if call_name == "forward" and name == "query" and v.numel() > 0 and args["output"].shape == v.shape:
        out.append(("the output itself", lambda: args["output"], True))
    return out


def int_mutations(name, v, gs, step):
    if name == "layer":
        return [("-1", -1, True), ("num_layers", gs.num_layers, True), ("extreme", INT64_MAX, True),
                ("str", "0", True)]
    if name == "num_actual_tokens":
        return [("below used", step.num_actual - 1, True), ("negative", -1, True), ("extreme", INT64_MAX, False),
                ("float", 1.5, True)]
    if name == "num_reqs":
        return [("None", None, True), ("+1", step.num_reqs + 1, True), ("negative", -1, True),
                ("extreme", INT64_MAX, True), ("0", 0, False)]
    raise AssertionError(name)


def index_value_mutations(name, v, gs, step):
    bs = gs.block_size
    out = []

    def setting(i, value):
        def f():
            t = v.clone()
            t.view(-1)[i] = value
            return t
        return f
    if name == "slot_mapping" and v.numel():
        num_slots = step.host_blocks * bs
        out += [("slot -2", setting(0, -2), True), ("slot num_slots", setting(0, num_slots), True),
                ("slot extreme", setting(0, INT64_MAX), True), ("slot -1 (PAD)", setting(0, -1), False),
                ("slot int64 min", setting(0, -(2**63)), True)]
        if v.numel() > 1 and int(v[1]) != -1 and int(v[0]) != -1:
            out.append(("duplicate slot", setting(1, int(v[0])), True))
    if name == "block_table":
        # build rejects a negative id in a used column; an id beyond the KV cache only forward can see (it is not
        # build's argument) and rejects with nothing changed.
        out += [("block -1 in use", setting(0, -1), True),
                ("block beyond cache", setting(0, step.host_blocks + 7), False),
                ("block 2^31-1", setting(0, 2**31 - 1), False)]
    if name == "seq_lens":
        width = step.table.shape[1]
        out += [("seq beyond table", setting(0, width * bs + 1), True), ("seq negative", setting(0, -1), True),
                ("seq below query", setting(0, int(step.qsl[1]) - 1), int(step.qsl[1]) > 0)]
    if name == "query_start_loc":
        out += [("qsl[0] != 0", setting(0, 1), True), ("qsl decreasing", setting(1, -1), True),
                ("qsl beyond tokens", setting(len(v) - 1, step.num_actual + 5), True)]
    return out


@given(geometries(), st.integers(0, 3), st.sampled_from(["exact", "compressed"]),
       st.sampled_from(["aten", "native"]), st.data())
def fuzz_engine_step(gs, pool_extra, mode, kernel, data) -> None:
    """Engine.update_kv / build / forward over random steps against the reference engine (ATen kernel: bit for bit;
    native kernel: outputs within docs/parity.md's tolerance, everything else bit for bit); then one call again with
    one argument changed: rejected by name with nothing changed, or accepted and still equal to the reference."""
    example()
    e, r = engine_pair(gs, pool_extra, mode, kernel)
    step = data.draw(steps(gs))
    layer = data.draw(st.integers(0, gs.num_layers - 1))
    init = torch.randn(step.host_blocks, gs.num_kv_heads, gs.block_size, 2 * gs.head_size).to(gs.dtype)
    caches = [init.clone() for _ in range(gs.num_layers)]
    rcaches = [init.clone() for _ in range(gs.num_layers)]
    key = torch.randn(step.tokens, gs.num_kv_heads, gs.head_size).to(gs.dtype)
    value = torch.randn(step.tokens, gs.num_kv_heads, gs.head_size).to(gs.dtype)
    query = torch.randn(step.tokens, gs.num_heads, gs.head_size).to(gs.dtype)
    scale = gs.head_size ** -0.5
    target = data.draw(st.sampled_from(["update_kv", "build", "forward", "none"]))
    note(f"target {target}")

    def run(call_name: str, args: dict, mutated: tuple | None):
        nonlocal plan, rplan
        names = (mutated[0],) if mutated else ()
        names += {"kv_cache": ("kv_cache",), "query": ("query",), "output": ("output",)}.get(
            mutated[0] if mutated else "", ())
        names += ("layer", "num_reqs", "query_start_loc", "seq_lens", "block_table", "slot_mapping", "key",
                  "value", "incompatible function arguments")
        before = state_of(e, caches)
        kc = args.get("kv_cache")
        kc_copy = kc.clone() if isinstance(kc, torch.Tensor) and kc.device.type == "cpu" else None
        if call_name == "update_kv":
            fn = lambda: e.update_kv(args["layer"], args["key"], args["value"], args["kv_cache"],  # noqa: E731
                                     args["slot_mapping"])
        elif call_name == "build":
            fn = lambda: e.build(args["query_start_loc"], args["seq_lens"], args["block_table"],  # noqa: E731
                                 args["num_reqs"], args["num_actual_tokens"])
        else:
            fn = lambda: e.forward(args["layer"], plan, args["query"], args["kv_cache"], args["output"],  # noqa: E731
                                   scale)
        ok, res = call(fn, names, bool(mutated and mutated[2]))
        if not ok:
            assert_same_state(before, state_of(e, caches))
            return False, None
        rargs = dict(args)
        if "kv_cache" in rargs:  # the reference's own copy of the same cache
            kc = args["kv_cache"]
            rargs["kv_cache"] = rcaches[args["layer"]] if kc.data_ptr() == caches[args["layer"]].data_ptr() else None
            if rargs["kv_cache"] is None:  # the mutation made a new cache tensor: the reference gets its copy
                rargs["kv_cache"] = kc_copy
                rcaches[args["layer"]] = rargs["kv_cache"]
                caches[args["layer"]] = kc
        if call_name == "update_kv":
            r.update_kv(rargs["layer"], rargs["key"], rargs["value"], rargs["kv_cache"], rargs["slot_mapping"])
        elif call_name == "build":
            plan = res
            rplan = r.build(rargs["query_start_loc"], rargs["seq_lens"], rargs["block_table"],
                            rargs["num_reqs"], rargs["num_actual_tokens"])
        else:
            rout = torch.zeros_like(rargs["output"])
            r.forward(rargs["layer"], rplan, rargs["query"], rargs["kv_cache"], rout, scale)
            got = args["output"][: step.num_actual].float()
            want = rout[: step.num_actual].float()
            if kernel == "aten":
                assert torch.equal(got, want)
            else:
                torch.testing.assert_close(got, want, atol=TOLERANCE[gs.dtype], rtol=TOLERANCE[gs.dtype])
        return True, res

    plan = rplan = None
    upd = {"layer": layer, "key": key, "value": value, "kv_cache": caches[layer], "slot_mapping": step.slots}
    bld = {"query_start_loc": step.qsl, "seq_lens": step.seq_lens, "block_table": step.table,
           "num_reqs": step.num_reqs, "num_actual_tokens": step.num_actual}
    out = torch.zeros(step.tokens, gs.num_heads, gs.head_size, dtype=gs.dtype)
    fwd = {"layer": layer, "query": query, "kv_cache": caches[layer], "output": out}
    for call_name, args in (("update_kv", upd), ("build", bld), ("forward", fwd)):
        mutated = None
        if call_name == target:
            # One clean run first (so forward has a plan and resident blocks), then the mutated one.
            if call_name == "forward":
                run(call_name, dict(args), None)
            args = dict(args)
            mutated = mutate_step(data, call_name, args, gs, step)
            note(f"{call_name}: {mutated[0]} {mutated[1]} must_reject={mutated[2]}")
        ok, _ = run(call_name, args, mutated)
        if not ok and call_name != "forward":
            ok, _ = run(call_name, {"update_kv": upd, "build": bld}[call_name], None)
            assert ok
        if call_name == "forward" and target == "forward":
            break
    # Both tiers and the counters still agree with the reference.
    for lay in range(gs.num_layers):
        assert torch.equal(caches[lay], rcaches[lay])
        assert torch.equal(e.pool(lay), r.layers[lay].pool)
    snap = e.snapshot()
    assert {k: snap[k] for k in ref.COUNTERS} == r.counters


@given(geometries(), st.data())
def fuzz_kv_state_write(gs, data) -> None:
    """KVState.write against the reference's update_kv (host tier and per-block key min/max), with one argument
    changed: rejected by name with both unchanged, or accepted and still equal."""
    example()
    step = data.draw(steps(gs))
    s = kv_state.KVState(gs.num_layers, gs.num_heads, gs.num_kv_heads, gs.head_size, gs.block_size, gs.dtype,
                         gs.tile_blocks)
    # The reference in compressed mode keeps key metadata, as the KVState (key_metadata defaults to True) does.
    r = ref.RefEngine(gs.num_layers, gs.num_heads, gs.num_kv_heads, gs.head_size, gs.block_size, gs.dtype,
                      gs.tile_blocks, gs.tile_blocks, mode="compressed")
    cache = torch.randn(step.host_blocks, gs.num_kv_heads, gs.block_size, 2 * gs.head_size).to(gs.dtype)
    rcache = cache.clone()
    key = torch.randn(step.tokens, gs.num_kv_heads, gs.head_size).to(gs.dtype)
    value = torch.randn(step.tokens, gs.num_kv_heads, gs.head_size).to(gs.dtype)
    args = {"layer": 0, "key": key, "value": value, "kv_cache": cache, "slot_mapping": step.slots}
    mutated = data.draw(st.booleans())
    must = False
    if mutated:
        name, desc, must = mutate_step(data, "update_kv", args, gs, step)
        if name == "key" or name == "value":
            must = must or desc in ("dim0 + 1",)
        note(f"{name} {desc} {must}")
    before = cache.clone()
    kc = args["kv_cache"]
    rc = rcache if isinstance(kc, torch.Tensor) and kc.data_ptr() == cache.data_ptr() else (
        kc.clone() if isinstance(kc, torch.Tensor) and kc.device.type == "cpu" else None)
    ok, _ = call(lambda: s.write(args["layer"], args["kv_cache"], args["key"], args["value"], args["slot_mapping"]),
                 (mutated and name or "kv_cache", "kv_cache", "key", "value", "slot_mapping", "layer",
                  "incompatible function arguments"), must)
    if not ok:
        assert torch.equal(cache, before), "a rejected write changed the host tier"
        return
    r.update_kv(args["layer"], args["key"], args["value"], rc, args["slot_mapping"])
    assert torch.equal(kc, rc)
    assert torch.equal(s.key_min(args["layer"]), r.layers[args["layer"]].key_min)
    assert torch.equal(s.key_max(args["layer"]), r.layers[args["layer"]].key_max)


@given(st.integers(-1, 6), st.integers(0, 8), st.integers(-1, 4), st.sampled_from(["i32", "i64", "strided", "meta"]),
       st.sampled_from(["exact", "compressed", "Exact", ""]), st.sampled_from(["native", "aten", "fast"]))
def fuzz_exact_tiles_and_names(num_blocks, width, tile_blocks, kind, mode, kernel) -> None:
    """exact_tiles (a raw pointer read: its tensor must be a contiguous CPU int32 row holding num_blocks ids) and the
    option parsers."""
    example()
    row = torch.arange(width, dtype=torch.int32)
    t = {"i32": row, "i64": row.long(), "strided": strided(row), "meta": row.to("meta")}[kind]
    valid = kind == "i32" or (kind == "strided" and width <= 1)
    valid = valid and 0 <= num_blocks <= width and tile_blocks >= 1
    ok, tiles = call(lambda: admission.exact_tiles(t, num_blocks, tile_blocks),
                     ("block_row", "num_blocks", "tile_blocks"), not valid)
    if ok:
        ids = list(range(num_blocks))
        assert tiles == [ids[i:i + tile_blocks] for i in range(0, num_blocks, tile_blocks)]
    call(lambda: admission.parse_mode(mode), ("mode",), mode not in ("exact", "compressed"))


@given(geometries(), st.one_of(st.integers(1, 40), st.integers(-1, 0), EXTREME),
       st.sampled_from(["exact", "compressed", "compressed", "x"]), st.sampled_from(["native", "aten", "x"]),
       st.integers(-1, 80), st.integers(-1, 3), st.integers(-1, 3), st.sampled_from(["cpu", "cpu", "cpu", "meta"]))
def fuzz_engine_config(gs, pool_blocks, mode, kernel, budget_tokens, sink, recent, device) -> None:
    """Engine construction: impossible configurations (pool smaller than a tile, a budget below sinks + recent + one
    block, a compressed pool below the worst-case union, unknown mode/kernel) fail with one
    message naming the setting; possible ones build an engine with exactly those settings."""
    example()
    bs, kvh = gs.block_size, gs.num_kv_heads
    k = budget_tokens // bs - sink - recent
    # meta is accepted as an engine device (the tests' stand-in for an accelerator): the tensors must match it.
    valid = (mode in ("exact", "compressed") and kernel in ("native", "aten")
             and pool_blocks >= max(1, gs.tile_blocks) and pool_blocks <= 2**20)
    if mode == "compressed":
        valid = valid and recent >= 1 and sink >= 0 and k >= 1 and pool_blocks >= kvh * k + sink + recent
    if pool_blocks > 2**20 and pool_blocks * kvh * 2 * bs * gs.head_size * 4 < 2**36:
        return  # an allocation this machine might grant: not a fuzz case on a shared machine
    # Larger pools are refused by the int64 overflow check or by the allocator (a ValueError naming pool_blocks).
    fn = lambda: backend.Engine(gs.num_layers, gs.num_heads, kvh, gs.head_size, bs, gs.dtype,  # noqa: E731
                                pool_blocks, gs.tile_blocks, torch.device(device), mode=mode,
                                budget_tokens=budget_tokens, sink_blocks=sink, recent_blocks=recent, kernel=kernel)
    names = ("pool_blocks", "budget_tokens", "recent_blocks", "sink_blocks", "mode", "kernel", "device",
             "active pool")
    ok, e = call(fn, names, not valid)
    if ok:
        assert (e.pool_blocks, e.tile_blocks, e.mode, e.kernel) == (pool_blocks, gs.tile_blocks, mode, kernel)
        if mode == "compressed":
            assert e.top_k == k
        for bad in (-1, gs.num_layers):
            expect_rejected(lambda: e.resident(bad), ("layer",))
            expect_rejected(lambda: e.pool(bad), ("layer",))


@given(geometries(), st.integers(-2, 3), st.sampled_from(["resident", "pool", "key_min", "reset_layer",
                                                             "bind_host", "counters"]), st.data())
def fuzz_kv_state_accessors(gs, layer, method, data) -> None:
    """KVState's accessors and bind_host with in- and out-of-range layers and mutated KV caches."""
    example()
    s = kv_state.KVState(gs.num_layers, gs.num_heads, gs.num_kv_heads, gs.head_size, gs.block_size, gs.dtype, 2)
    valid_layer = 0 <= layer < gs.num_layers
    if method == "bind_host":
        cache = torch.randn(3, gs.num_kv_heads, gs.block_size, 2 * gs.head_size).to(gs.dtype)
        desc, mutate, must = data.draw(st.sampled_from(
            tensor_mutations(cache, contiguous_required=True, floating=True, dim0_free=True)
            + [("valid", lambda: cache, False)]))
        if desc == "requires_grad":
            must = False  # binding reads nothing and writes nothing
        note(desc)
        ok, host = call(lambda: s.bind_host(layer, mutate()), ("kv_cache", "layer"), must or not valid_layer)
        if ok:
            assert host.shape == (host.shape[0], gs.num_kv_heads, 2, gs.block_size, gs.head_size)
            assert s.resident(layer) == {}
        return
    if method == "counters":
        assert s.counters()["tokens_written"] == 0
        STATS["accepted"] += 1
        return
    ok, res = call(lambda: getattr(s, method)(layer), ("layer",), not valid_layer)
    if ok and method == "pool":
        assert res.shape == (2, gs.num_kv_heads, 2, gs.block_size, gs.head_size)


# ---- vLLM-facing objects -------------------------------------------------------------------------------------------

OPTION_VALUES = st.one_of(st.integers(-2, 40), EXTREME, st.booleans(), st.floats(allow_nan=True), st.text(max_size=4),
                          st.none(), st.sampled_from(["exact", "compressed", "native", "aten"]),
                          st.lists(st.integers(), max_size=2))
OPTION_KEYS = st.sampled_from(["mode", "pool_blocks", "tile_blocks", "kernel", "budget_tokens", "sink_blocks",
                               "recent_blocks", "pool", "Mode", ""])


def vllm_config(num_heads, options, impls: dict | None = None) -> SimpleNamespace:
    """impls: {layer name: Impl} registered as vLLM registers its attention layers (static_forward_context, each
    layer's impl holding the native Impl as the patch's ActiveKVImpl does): the Builder binds its engine to them."""
    model_config = SimpleNamespace(get_num_attention_heads=lambda parallel_config: num_heads)
    layers = {n: SimpleNamespace(layer_name=n, impl=SimpleNamespace(_native=i)) for n, i in (impls or {}).items()}
    return SimpleNamespace(model_config=model_config, parallel_config=SimpleNamespace(), additional_config=options,
                           compilation_config=SimpleNamespace(static_forward_context=layers))


# telemetry_json values a start-up must refuse: a directory (spelled several ways), a NUL (the C library would see a
# shorter path), a lone surrogate os.fsencode() cannot encode, no file name, a missing directory, not a str.
BAD_TELEMETRY_JSON = st.sampled_from(["/tmp", ".", "..", "/tmp/.", "/tmp/", "", "/tmp/run\0.json", "\0",
                                      "/tmp/run-\ud800.json", "/nonexistent-dir/t.json", 3, None, b"/tmp/t.json"])

VALID_OPTIONS = st.fixed_dictionaries({}, optional={
    "mode": st.sampled_from(["exact", "compressed"]), "pool_blocks": st.integers(2, 64),
    "tile_blocks": st.integers(1, 4), "kernel": st.sampled_from(["native", "aten"]),
    "budget_tokens": st.integers(16, 256), "sink_blocks": st.integers(0, 2), "recent_blocks": st.integers(1, 2)})


@given(VALID_OPTIONS, st.one_of(st.none(), st.tuples(OPTION_KEYS, OPTION_VALUES),
                                st.tuples(st.just("telemetry_json"), BAD_TELEMETRY_JSON)),
       st.sampled_from(["int"] * 6 + ["str", "none", "float", "tensor"]),
       st.sampled_from(DTYPES * 3 + (torch.float64, "x")))
def fuzz_builder(options, bad, block_size_kind, dtype) -> None:
    """Builder start-up with additional_config['activekv'] options (valid ones, and one random key/value pair or one
    bad telemetry_json in most examples) and kv_cache_spec attribute types: an engine whose settings are the options
    given, or one clear error naming the option or attribute."""
    example()
    if bad is not None:
        options[bad[0]] = bad[1]
    bs = {"int": 4, "str": "4", "none": None, "float": 4.0, "tensor": torch.tensor([4, 4])}[block_size_kind]
    spec = SimpleNamespace(block_size=bs, num_kv_heads=2, head_size=32, dtype=dtype, sliding_window=None)
    names = tuple(f"['{k}']" for k in options) + ("kv_cache_spec", "pool_blocks",
                                                   "budget_tokens", "additional_config['activekv']: mode",
                                                   "additional_config['activekv']: kernel")
    cfg = vllm_config(4, {"activekv": options})
    try:
        b = backend.Builder(spec, ["l0", "l1"], cfg, torch.device("cpu"))
    except ERRORS:
        expect_rejected(lambda: backend.Builder(spec, ["l0", "l1"], cfg, torch.device("cpu")), names)
        return
    STATS["accepted"] += 1
    assert block_size_kind == "int" and dtype in DTYPES
    assert "telemetry_json" not in options, f"telemetry_json {options['telemetry_json']!r} accepted"
    e = b.engine
    for k in ("pool_blocks", "tile_blocks", "mode", "kernel"):
        if k in options:
            assert getattr(e, k) == options[k]


@given(st.one_of(st.integers(1, 8), st.integers(-1, 0), EXTREME), st.sampled_from([32, 64, 128, 0, -64, 7, 2**40]),
       st.one_of(st.none(), st.integers(1, 4), st.integers(-1, 0), st.just("2")),
       st.sampled_from(["auto"] * 4 + ["fp8", ""]), st.sampled_from([None, "decoder"] * 3 + ["encoder", 3]),
       st.sampled_from([None, 0.0] * 3 + [30.0, "x"]))
def fuzz_impl(num_heads, head_size, num_kv_heads, kv_cache_dtype, attn_type, soft_cap) -> None:
    """Impl's constructor: accepted exactly for supported configurations, otherwise a named error."""
    example()
    kvh = num_heads if num_kv_heads is None else num_kv_heads
    valid = (isinstance(kvh, int) and num_heads > 0 and kvh > 0 and num_heads % kvh == 0
             and head_size in backend.supported_head_sizes() and kv_cache_dtype == "auto"
             and attn_type in (None, "decoder") and soft_cap in (None, 0.0) and num_heads <= INT64_MAX)
    fn = lambda: backend.Impl(num_heads, head_size, 0.5, num_kv_heads, None, None, kv_cache_dtype,  # noqa: E731
                              soft_cap, attn_type)
    names = ("num_heads", "num_kv_heads", "head size", "kv_cache_dtype", "attention", "soft-cap", "logits_soft_cap", "attn_type",
             "incompatible function arguments")
    ok, impl = call(fn, names, not valid)
    if ok:
        assert (impl.num_heads, impl.num_kv_heads, impl.head_size) == (num_heads, kvh, head_size)


@given(st.sampled_from(["ok", "missing", "int", "bytes", "unknown"]),
       st.sampled_from(["plan", "none", "str", "other plan"]),
       st.sampled_from(["ok", "seq_lens list", "num_reqs str", "causal int", "block_table None"]))
def fuzz_impl_forward(layer_kind, meta_kind, cm_kind) -> None:
    """Impl.forward / do_kv_cache_update / Builder.build with odd vLLM objects: named errors, never a crash."""
    example()
    spec = SimpleNamespace(block_size=4, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=None)
    impl = backend.Impl(4, 32, 32 ** -0.5, 2)
    b = backend.Builder(spec, ["fz.0"], vllm_config(4, {"activekv": {"pool_blocks": 4, "tile_blocks": 2}},
                                                    {"fz.0": impl}), torch.device("cpu"))
    q = torch.tensor([0, 1], dtype=torch.int32)
    cm = SimpleNamespace(query_start_loc=q, query_start_loc_cpu=q, seq_lens=torch.tensor([1], dtype=torch.int32),
                         block_table_tensor=torch.tensor([[0]], dtype=torch.int32), num_reqs=1, num_actual_tokens=1,
                         causal=True)
    cm_names = ("causal",)
    if cm_kind == "seq_lens list":
        cm.seq_lens, cm_names = [1], ("seq_lens",)
    elif cm_kind == "num_reqs str":
        cm.num_reqs, cm_names = "1", ("num_reqs",)
    elif cm_kind == "causal int":
        cm.causal = 1
    elif cm_kind == "block_table None":
        cm.block_table_tensor, cm_names = None, ("block_table",)
    ok, plan = call(lambda: b.build(0, cm), cm_names, cm_kind != "ok")
    if not ok:
        plan = b.build(0, SimpleNamespace(**{**vars(cm), "seq_lens": torch.tensor([1], dtype=torch.int32),
                                             "num_reqs": 1, "causal": True,
                                             "block_table_tensor": torch.tensor([[0]], dtype=torch.int32)}))
    layer = {"ok": SimpleNamespace(layer_name="fz.0"), "missing": SimpleNamespace(),
             "int": SimpleNamespace(layer_name=3), "bytes": SimpleNamespace(layer_name=b"fz.0"),
             "unknown": SimpleNamespace(layer_name="fz.9")}[layer_kind]
    other = backend.Builder(spec, ["fz.x"], vllm_config(4, {"activekv": {"pool_blocks": 4, "tile_blocks": 2}}),
                            torch.device("cpu")).build(0, cm if cm_kind == "ok" else SimpleNamespace(
                                **{**vars(cm), "seq_lens": torch.tensor([1], dtype=torch.int32), "num_reqs": 1,
                                   "causal": True, "block_table_tensor": torch.tensor([[0]], dtype=torch.int32)}))
    metadata = {"plan": plan, "none": None, "str": "plan", "other plan": other}[meta_kind]
    cache = torch.zeros(2, 2, 4, 64)
    x = torch.randn(1, 2, 32)
    out = torch.zeros(1, 4, 32)
    layer_names = ("layer", "layer_name", "fz.9")
    upd_ok = layer_kind == "ok"
    call(lambda: impl.do_kv_cache_update(layer, x, x, cache, torch.tensor([0])), layer_names, not upd_ok)
    # Without metadata (vLLM's warm-up, which compiled mode runs before any builder exists) forward is a no-op for
    # any named layer, served or not; with a plan, the layer must be the plan's engine's.
    fwd_ok = (layer_kind == "ok" and meta_kind == "plan") or (layer_kind in ("ok", "unknown") and meta_kind == "none")
    call(lambda: impl.forward(layer, torch.randn(1, 4, 32), None, None, cache, metadata, out),
         layer_names + ("attn_metadata", "not served", "fz.0"), not fwd_ok)


@given(st.lists(st.integers(0, 3), min_size=1, max_size=4), st.data())
def fuzz_telemetry(layer_counts, data) -> None:
    """Several live engines: snapshot() is the sum of engine_snapshots() and counts the live engines; a deleted
    engine drops out."""
    example()
    base = len(telemetry.engine_snapshots())
    engines = [backend.Engine(n + 1, 2, 1, 4, 2, torch.float32, 2, 1) for n in layer_counts]
    for e in engines:
        for _ in range(data.draw(st.integers(0, 2))):
            e.build(torch.tensor([0, 1]), torch.tensor([1]), torch.tensor([[0]]), 1, 1)
    snaps = telemetry.engine_snapshots()
    total = telemetry.snapshot()
    assert total["engines"] == len(snaps) == base + len(engines)
    for k in telemetry.COUNTERS:
        assert total[k] == sum(s[k] for s in snaps), k
    mine = [s for s in snaps if s["info"]["pool_blocks"] == 2 and s["info"]["block_size"] == 2]
    assert sum(s["build_calls"] for s in mine) >= sum(e.snapshot()["build_calls"] for e in engines)
    del engines, mine, e
    assert len(telemetry.engine_snapshots()) == base
    STATS["accepted"] += 1


# Entries named like segments in the telemetry folder or its base (writable by every local user), and what the
# folder itself may be. "another user" is uid 65534, given by chown (as root; such examples are skipped otherwise).
_PLANTS = st.sampled_from(["fifo", "socket", "directory", "link to a file", "link to a dead segment",
                           "dead segment of another user", "dead segment of mode 0644", "dead segment one byte short",
                           "dead segment one byte long", "empty file", "garbage of a page's size", "dead segment",
                           "dead segment naming a json path"])
_FOLDERS = st.sampled_from(["private", "private", "private", "mode 0755", "a link to a private folder",
                            "another user's"])
_TEMPLATES: dict[str, bytes] = {}


def dead_segments() -> dict[str, bytes]:
    """The bytes of two segments left by a child that ended with os._exit (as vLLM's engine core does): one engine
    without telemetry_json ("plain"), one whose page names a json path ("json", the file `victim` beside them). Made
    once per process, in a folder of their own."""
    import shutil
    import subprocess
    import tempfile
    from pathlib import Path

    if not _TEMPLATES:
        base = Path(tempfile.mkdtemp(prefix="activekv-fuzz-templates-"))
        code = ("import os, torch\nimport activekv._backend as backend\n"
                "from tests.test_telemetry_publish import SPEC, vllm_config\n"
                "e = backend.Engine(1, 2, 1, 4, 2, torch.float32, 2, 1)\n"
                f"b = backend.Builder(SPEC, ['l0'], vllm_config({{'telemetry_json': {str(base / 'victim')!r}}}), "
                "torch.device('cpu'))\nos._exit(0)\n")
        env = {**os.environ, "ACTIVEKV_TELEMETRY_DIR": str(base)}
        try:
            done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
            assert done.returncode == 0, done.stderr
            for seg in (base / f"activekv-telemetry-{os.geteuid()}").iterdir():
                data = seg.read_bytes()
                _TEMPLATES["json" if str(base / "victim").encode() in data else "plain"] = data
        finally:
            shutil.rmtree(base, ignore_errors=True)
        assert set(_TEMPLATES) == {"json", "plain"}, _TEMPLATES.keys()
        _TEMPLATES["victim"] = str(base / "victim").encode()  # gone: the collector must not create it either
    return _TEMPLATES


def entry_state(path) -> tuple:
    """What a planted entry is: kind, owner, mode, size and (regular files, link targets) its bytes."""
    import stat as st_mod

    s = os.lstat(path)
    content = None
    if st_mod.S_ISREG(s.st_mode):
        content = open(path, "rb").read()
    elif st_mod.S_ISLNK(s.st_mode):
        content = (os.readlink(path), open(path, "rb").read() if os.path.isfile(path) else None)
    return st_mod.S_IFMT(s.st_mode), s.st_uid, s.st_mode & 0o7777, s.st_size, content


@given(plants=st.lists(st.tuples(_PLANTS, st.sampled_from(["folder", "base"])), min_size=1, max_size=6),
       folder_kind=_FOLDERS, seed=st.integers(0, 2**32 - 1))
def fuzz_telemetry_folder(plants, folder_kind, seed) -> None:
    """Special and foreign entries named like segments in the telemetry folder and in its base, and a folder that
    is not private: reading the process tree (process_tree_snapshots, Collector.collect, a scrape) never blocks (the
    case's subprocess has a timeout), follows or writes through none of them, reports exactly this process's live
    engines, and removes only dead, plain segments of this user in its private folder (and its own at the end)."""
    import random
    import shutil
    import socket
    import tempfile
    from pathlib import Path

    import prometheus_client

    others = folder_kind == "another user's" or any(k.endswith("another user") for k, _ in plants)
    assume(os.geteuid() == 0 or not others)  # chown to another uid needs root
    example()
    templates = dead_segments()
    rng = random.Random(seed)
    root = Path(tempfile.mkdtemp(prefix="activekv-fuzz-folder-"))
    base, real = root / "base", root / "real"
    base.mkdir()
    real.mkdir(mode=0o700)
    folder = base / f"activekv-telemetry-{os.geteuid()}"
    old_env = os.environ.get("ACTIVEKV_TELEMETRY_DIR")
    os.environ["ACTIVEKV_TELEMETRY_DIR"] = str(base)
    try:
        if folder_kind == "a link to a private folder":
            folder.symlink_to(real)
        else:
            folder.mkdir(mode=0o700)
            if folder_kind == "mode 0755":
                folder.chmod(0o755)
            elif folder_kind == "another user's":
                os.chown(folder, 65534, 65534)
        private = folder_kind == "private"
        engine = backend.Engine(1, 2, 1, 4, 2, torch.float32, 2, 1)  # publishes in the folder only when private
        own = set(folder.iterdir()) if folder.is_dir() else set()
        assert len(own) == (1 if private else 0) and list(real.iterdir()) == [], (own, folder_kind)
        victim = root / "victim"
        victim.write_bytes(b"precious\n")
        (root / "away").mkdir()
        planted = {}
        for i, (kind, where) in enumerate(plants):
            path = (folder if where == "folder" else base) / f"activekv-telemetry.{rng.randrange(2, 2**22)}.{i}"
            if kind == "fifo":
                os.mkfifo(path, 0o600)
            elif kind == "socket":
                sock = socket.socket(socket.AF_UNIX)
                sock.bind(str(path))
                sock.close()
            elif kind == "directory":
                path.mkdir(mode=0o700)
            elif kind == "link to a file":
                path.symlink_to(victim)
            elif kind == "link to a dead segment":
                away = root / "away" / path.name
                away.write_bytes(templates["plain"])
                away.chmod(0o600)
                path.symlink_to(away)
            elif kind == "empty file":
                path.write_bytes(b"")
                path.chmod(0o600)
            elif kind == "garbage of a page's size":
                path.write_bytes(rng.randbytes(len(templates["plain"])))
                path.chmod(0o600)
            else:
                data = templates["json" if kind == "dead segment naming a json path" else "plain"]
                data = data[:-1] if kind.endswith("short") else data + b"\0" if kind.endswith("long") else data
                path.write_bytes(data)
                path.chmod(0o644 if kind.endswith("0644") else 0o600)
                if kind.endswith("another user"):
                    os.chown(path, 65534, 65534)
            planted[path] = (kind, where, entry_state(path))
        note(f"planted {[(k, w) for k, w, _ in planted.values()]}, folder {folder_kind}")
        json_target = Path(templates["victim"].decode())
        json_before = json_target.read_bytes() if json_target.exists() else None

        live = telemetry.engine_snapshots()
        tree = telemetry.process_tree_snapshots()
        families = telemetry.Collector({"model_name": "fz"}).collect()
        registry = prometheus_client.CollectorRegistry()
        registry.register(telemetry.Collector({"model_name": "fz"}))
        text = prometheus_client.generate_latest(registry).decode()

        assert [(s["pid"], s["engine_id"]) for s in tree] == [(os.getpid(), s["engine_id"]) for s in live]
        assert any(f.name == "activekv_engines" for f in families)
        assert f'activekv_engines{{model_name="fz"}} {float(len(live))}' in text
        assert victim.read_bytes() == b"precious\n"
        assert (json_target.read_bytes() if json_target.exists() else None) == json_before
        for path, (kind, where, before) in planted.items():
            removable = kind == "dead segment" and where == "folder" and private
            if removable:
                assert not os.path.lexists(path), (kind, where, folder_kind)
            else:
                assert entry_state(path) == before, (kind, where, folder_kind)
        entries = {p for p in base.iterdir()} | ({p for p in folder.iterdir()} if folder.is_dir() else set())
        assert own <= entries and entries <= set(planted) | own | {folder}, entries - set(planted) - own
        del engine
        assert not any(p.exists() for p in own)  # the engine removed its own segment, and only that
        STATS["accepted"] += 1
    finally:
        if old_env is None:
            os.environ.pop("ACTIVEKV_TELEMETRY_DIR", None)
        else:
            os.environ["ACTIVEKV_TELEMETRY_DIR"] = old_env
        shutil.rmtree(root, ignore_errors=True)


_LABEL_NAMES = st.from_regex(r"[a-zA-Z_][a-zA-Z0-9_]{0,6}", fullmatch=True)
_BAD_LABEL_NAMES = st.one_of(st.text(max_size=4), st.integers(-2, 2), st.none(), st.sampled_from(
    ["le", "__name__", "__x", "model-name", "", "modèle", "\udc80", "9a", "a b", "a:b"]))
_LABEL_VALUES = st.one_of(st.text(max_size=8), st.sampled_from(['a"b\\c\nd', "", "é", "\r", "{x=\"y\"}"]))
_BAD_LABEL_VALUES = st.one_of(st.sampled_from(["\udc80", "a\ud800b"]), st.integers(-2, 2), st.none(),
                              st.binary(max_size=3))


@given(st.dictionaries(_LABEL_NAMES, _LABEL_VALUES, max_size=3),
       st.one_of(st.none(), st.tuples(st.one_of(_LABEL_NAMES, _BAD_LABEL_NAMES),
                                      st.one_of(_LABEL_VALUES, _BAD_LABEL_VALUES))))
def fuzz_collector_labels(labels, extra) -> None:
    """Collector labels: rejected at construction (TypeError/ValueError naming them) unless every name matches
    [a-zA-Z_][a-zA-Z0-9_]*, is not '__...' nor 'le', and every value is UTF-8 text; accepted ones never break a
    scrape (text and OpenMetrics) and come back unchanged from prometheus_client's parser."""
    import re

    import prometheus_client
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
    from prometheus_client.parser import text_string_to_metric_families

    example()
    if extra is not None:
        labels[extra[0]] = extra[1]

    def utf8(v: str) -> bool:
        try:
            v.encode()
        except UnicodeEncodeError:
            return False
        return True

    valid = all(isinstance(k, str) and re.fullmatch(r"[a-zA-Z_][a-zA-Z0-9_]*", k) and not k.startswith("__")
                and k != "le" and isinstance(v, str) and utf8(v) for k, v in labels.items())
    if not valid:
        expect_rejected(lambda: telemetry.Collector(labels), ("Collector labels",))
        return
    registry = prometheus_client.CollectorRegistry()
    registry.register(telemetry.Collector(labels))
    text = prometheus_client.generate_latest(registry).decode()
    assert openmetrics_latest(registry).decode().endswith("# EOF\n")
    engines = [s for f in text_string_to_metric_families(text) for s in f.samples if s.name == "activekv_engines"]
    assert [s.labels for s in engines] == [labels]
    STATS["accepted"] += 1


_SCOPES = st.sampled_from(
    [{"type": "http", "method": m} for m in ("GET", "HEAD", "POST", "get", "X", "GET", "HEAD")]
    + [{"type": t} for t in ("websocket", "lifespan", "", None, 3)]
    + [{"type": "http", "method": m} for m in (None, 1, b"GET")]
    + [None, 1, "scope", [("type", "http")], ()])
# What send returns: a coroutine, a generator-based coroutine that suspends k times, an object with __await__, a
# non-awaitable, or send raising at once.
_SENDS = st.sampled_from(["coroutine", "suspends", "await_object", "not_awaitable", "raises", "not_callable"])
# How the awaitable is driven after its first step: values sent, exceptions thrown, close(), next().
_DRIVES = st.lists(st.sampled_from(["send_none", "send_value", "throw_value_error", "throw_cancel", "close", "next"]),
                   max_size=8)


@given(scope=_SCOPES, send_kind=_SENDS, drive=_DRIVES, init=st.sampled_from(["none", "client", "no"]),
       route=st.sampled_from(["/activekv/telemetry", "/activekv/health"]))
def fuzz_endpoint(scope, send_kind, drive, init, route) -> None:
    """The endpoint plugin's ASGI routes and their awaitables with odd scopes, odd send callables and any driving
    sequence: never a crash; a rejected call is a TypeError/ValueError naming what was expected; a driven awaitable
    ends in StopIteration, the exception thrown into it or one it raised about itself, and never runs again."""
    import asyncio
    import types as pytypes

    example()
    plugin = endpoint.EndpointPlugin()
    added = {}
    plugin.attach_router(SimpleNamespace(add_route=lambda path, app, **kw: added.__setitem__(path, app)))
    if init != "no":
        aw = plugin.init_state(None if init == "none" else SimpleNamespace(errored=False), None, None)
        try:
            aw.send(None)
        except StopIteration:
            pass
    messages = []

    @pytypes.coroutine
    def suspends(n):
        for _ in range(n):
            yield "suspended"

    class AwaitObject:
        def __await__(self):
            return suspends(1)

    async def coro(m):
        messages.append(m)

    def send(m):
        messages.append(m)
        if send_kind == "coroutine":
            return coro(m)
        if send_kind == "suspends":
            return suspends(2)
        if send_kind == "await_object":
            return AwaitObject()
        if send_kind == "raises":
            raise OSError("client went away")
        return 7

    app = added[route]
    send_arg = "not callable" if send_kind == "not_callable" else send
    ok, aw = call(lambda: app(scope, None, send_arg), ("scope", "send", "method", "'http'"),
                  must_reject=not (isinstance(scope, dict) and scope.get("type") == "http"
                                   and isinstance(scope.get("method"), str)) or send_kind == "not_callable")
    if not ok:
        return
    ended = False
    for step in ["send_none"] + drive:
        try:
            if step == "send_none":
                aw.send(None)
            elif step == "send_value":
                aw.send(42)
            elif step == "throw_value_error":
                aw.throw(ValueError("thrown"))
            elif step == "throw_cancel":
                aw.throw(asyncio.CancelledError())
            elif step == "close":
                aw.close()
                ended = True
            else:
                next(aw)
        except StopIteration:
            ended = True
        except (ValueError, asyncio.CancelledError, OSError):
            ended = True  # thrown in (forwarded or not), or send's own error
        except TypeError as e:
            msg = str(e)
            assert "not awaitable" in msg or "non-None value" in msg, msg
            ended = ended or "not awaitable" in msg
        except RuntimeError as e:
            assert "already finished" in str(e), e
            assert ended, "a RuntimeError before the awaitable ended"
    for m in messages:
        assert m["type"] in ("http.response.start", "http.response.body"), m
        if m["type"] == "http.response.start":
            status = m["status"]
            assert status in (200, 405, 500), status
            assert (status == 405) == (scope["method"] not in ("GET", "HEAD")), (status, scope)
            assert init != "no" or status in (405, 500)
    STATS["accepted"] += 1


@given(geometries(), st.sampled_from(["exact", "compressed"]), st.sampled_from(["native", "aten"]),
       st.lists(st.sampled_from(["update_kv", "forward", "selection", "pool", "key_min", "resident", "snapshot",
                                 "kv_state_write", "kv_state_read"]), min_size=2, max_size=4))
def fuzz_concurrent_entry_points(gs, mode, kernel, workers) -> None:
    """Entry points called from several threads at once on one engine (and one KVState): no crash, no error; every
    forward of the fixed plan gives the same output (its blocks are never written meanwhile), every KV update lands
    (disjoint slots), and the final caches equal the reference's sequential writes."""
    import threading

    example()
    e, r = engine_pair(gs, 2, mode, kernel)
    s = kv_state.KVState(gs.num_layers, gs.num_heads, gs.num_kv_heads, gs.head_size, gs.block_size, gs.dtype, 2)
    bs, kvh, d = gs.block_size, gs.num_kv_heads, gs.head_size
    blocks = 4 + 2 * len(workers)  # blocks 0-3 hold the planned context; each worker writes two blocks of its own
    init = torch.randn(blocks, kvh, bs, 2 * d).to(gs.dtype)
    cache, rcache, scache = init.clone(), init.clone(), init.clone()
    seq = 4 * bs
    plan = e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq], dtype=torch.int32),
                   torch.arange(4, dtype=torch.int32)[None], 1, 1)
    q = torch.randn(1, gs.num_heads, d).to(gs.dtype)
    first = torch.empty(1, gs.num_heads, d, dtype=gs.dtype)
    e.forward(0, plan, q, cache, first, d ** -0.5)
    writes = []
    failures: list[BaseException] = []

    def work(i: int, kind: str) -> None:
        slots = torch.arange((4 + 2 * i) * bs, (6 + 2 * i) * bs)
        g = torch.Generator().manual_seed(i)
        k = torch.randn(len(slots), kvh, d, generator=g).to(gs.dtype)
        try:
            for _ in range(5):
                if kind == "update_kv":
                    e.update_kv(0, k, k, cache, slots)
                elif kind == "forward":
                    out = torch.empty(1, gs.num_heads, d, dtype=gs.dtype)
                    e.forward(0, plan, q, cache, out, d ** -0.5)
                    assert torch.equal(out, first), "a forward of an unchanged context changed its output"
                elif kind == "kv_state_write":
                    s.write(0, scache, k, k, slots)
                elif kind == "kv_state_read":
                    s.key_min(0), s.pool(0), s.resident(0), s.counters()
                elif kind == "snapshot":
                    e.snapshot()
                else:
                    {"selection": e.selection, "pool": e.pool, "key_min": e.key_min, "resident": e.resident}[kind](0)
        except BaseException as exc:  # noqa: BLE001  (reported after the join)
            failures.append(exc)
        writes.append((kind, slots, k))

    threads = [threading.Thread(target=work, args=(i, kind)) for i, kind in enumerate(workers)]
    [t.start() for t in threads]
    [t.join(timeout=120) for t in threads]
    assert not any(t.is_alive() for t in threads), "a thread did not finish: deadlock?"
    assert not failures, failures
    STATS["accepted"] += 5 * len(workers)
    rscache = init.clone()
    for kind, slots, k in writes:
        if kind == "update_kv":
            r.update_kv(0, k, k, rcache, slots)
        elif kind == "kv_state_write":
            r.update_kv(0, k, k, rscache, slots)
    assert torch.equal(cache, rcache) and torch.equal(scache, rscache), "concurrent writes lost or mixed"


_SERIES_FILES = st.sampled_from(["series", "first patch", "last patch", "contracts.toml"])
_SERIES_KINDS = st.sampled_from(["fifo", "/dev/zero", "over the cap", "directory", "dangling link", "none"])
_SERIES_ENTRIES = st.sampled_from(["../x.patch", "/etc/x.patch", "a/b.patch", "x\x01.patch", ".patch", "x.txt",
                                   "duplicate", "none"])


@settings(max_examples=min(int(_EXAMPLES or 60), 60))  # a valid series runs `git apply --check` on the tree
@given(which=_SERIES_FILES, kind=_SERIES_KINDS, entry=_SERIES_ENTRIES)
def fuzz_series_folder(which, kind, entry) -> None:
    """_backend.check_patch_series (the start-up check every Python process with ACTIVEKV runs) on a copy of the
    installed series with one file replaced by a special file (a FIFO, a link to /dev/zero, a file over the 16 MiB
    cap, a folder, a dangling link) and/or one hostile entry in the series file: a RuntimeError naming the file or the
    entry, never a hang (the case's subprocess has a timeout), a crash or a patch read from outside the folder; with
    neither, the copy checks as applied to this venv's patched vLLM."""
    import shutil
    import sysconfig
    import tempfile
    from pathlib import Path

    example()
    installed = Path(__file__).resolve().parents[1] / "patches" / "vllm" / "v0.32.0"
    root = Path(tempfile.mkdtemp(prefix="activekv-fuzz-series-"))
    try:
        series = root / "v0.32.0"
        shutil.copytree(installed, series)
        names = [n for n in (series / "series").read_text().split() if n]
        target = {"series": series / "series", "first patch": series / names[0], "last patch": series / names[-1],
                  "contracts.toml": series / "contracts.toml"}[which]
        if entry != "none":
            bad = names[0] if entry == "duplicate" else entry
            (series / "series").write_text("\n".join(names + [bad]) + "\n")
        if kind != "none":
            target.unlink()
            if kind == "fifo":
                os.mkfifo(target)
            elif kind == "/dev/zero":
                target.symlink_to("/dev/zero")
            elif kind == "over the cap":
                with target.open("wb") as f:
                    f.truncate((16 << 20) + 1)  # sparse
            elif kind == "directory":
                target.mkdir()
            else:
                target.symlink_to(root / "nowhere")
        # contracts.toml is not read by the check: replacing it alone leaves a valid series
        must = entry != "none" or (kind != "none" and which != "contracts.toml")
        ok, res = call(lambda: backend.check_patch_series(sysconfig.get_paths()["purelib"], str(series)),
                       (str(target), repr(entry)[1:-1] if entry != "duplicate" else names[0], "series"), must)
        if ok:
            assert res["state"] == "applied", res
    finally:
        shutil.rmtree(root, ignore_errors=True)


CASES = sorted(n for n in dir() if n.startswith("fuzz_"))


def main(argv: list[str]) -> int:
    torch.set_num_threads(1)  # one intra-op thread: the ATen path's parity with the reference is bit for bit
    if os.environ.get("ACTIVEKV_FUZZ_SEED") and _EXAMPLES:
        from hypothesis import seed
        for name in CASES:
            globals()[name] = seed(int(os.environ["ACTIVEKV_FUZZ_SEED"]))(globals()[name])
    for name in argv or CASES:
        for k in STATS:
            STATS[k] = 0
        globals()[name]()
        print(f"{name}: ok, {STATS['examples']} examples, {STATS['accepted']} accepted calls, "
              f"{STATS['rejected']} rejected calls", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
