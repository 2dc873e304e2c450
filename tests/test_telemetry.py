"""activekv._telemetry: counters and histograms of the live engines in this process (bindings/modules/telemetry.cpp).

Other test modules may leave engines alive in this process, so in-process checks compare deltas against a snapshot
taken after gc; absolute values of the process-wide registry are checked in a fresh subprocess.
"""

from __future__ import annotations

import gc
import math
import subprocess
import sys
import textwrap

import pytest
import torch

import activekv._backend as backend  # after torch: the modules' import guard needs it
import activekv._kv_state as kv_state
import activekv._telemetry as telemetry
from tests.reference import engine as ref

NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 2, 4, 2, 8, 4
POOL_BLOCKS, TILE_BLOCKS = 4, 2
NUM_BLOCKS = 6
HISTOGRAMS = ("forward_latency_us", "blocks_admitted_per_forward")
INFO = {"num_layers": NUM_LAYERS, "pool_blocks": POOL_BLOCKS, "tile_blocks": TILE_BLOCKS, "block_size": BLOCK_SIZE,
        "bytes_per_block": NUM_KV_HEADS * 2 * BLOCK_SIZE * HEAD_SIZE * 4, "in_place": 0}


def make_engine() -> backend.Engine:
    return backend.Engine(NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, POOL_BLOCKS,
                          TILE_BLOCKS)


def drive(engine: backend.Engine, seq_len: int = 3 * BLOCK_SIZE - 1, padding: int = 2) -> torch.Tensor:
    """One prefill step on layer 0 over a new KV cache: one KV update (seq_len tokens + padding entries), one build,
    one forward. Returns the cache: the engine knows a host tier by its data pointer, so a caller that drives again
    keeps it alive to get a new one (a freed cache's address may be handed out again)."""
    gen = torch.Generator().manual_seed(0)
    cache = torch.zeros(NUM_BLOCKS, NUM_KV_HEADS, BLOCK_SIZE, 2 * HEAD_SIZE)
    key = torch.randn(seq_len + padding, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    value = torch.randn(seq_len + padding, NUM_KV_HEADS, HEAD_SIZE, generator=gen)
    engine.update_kv(0, key, value, cache, torch.tensor(list(range(seq_len)) + [-1] * padding))
    nb = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    plan = engine.build(torch.tensor([0, seq_len], dtype=torch.int32), torch.tensor([seq_len], dtype=torch.int32),
                        torch.tensor([list(range(nb))], dtype=torch.int32), 1, seq_len)
    query = torch.randn(seq_len, NUM_HEADS, HEAD_SIZE, generator=gen)
    output = torch.empty(seq_len, NUM_HEADS, HEAD_SIZE)
    engine.forward(0, plan, query, cache, output, HEAD_SIZE**-0.5)
    return cache


def expected_counters(seq_len: int = 3 * BLOCK_SIZE - 1, padding: int = 2) -> dict[str, int]:
    nb = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    counts = dict.fromkeys(telemetry.COUNTERS, 0)
    counts.update(build_calls=1, kv_update_calls=1, forward_calls=1, request_rows=1, tokens_written=seq_len,
                  padding_slots=padding, blocks_admitted=nb, bytes_h2d=nb * INFO["bytes_per_block"],
                  tiles_computed=(nb + TILE_BLOCKS - 1) // TILE_BLOCKS, planned_blocks=nb,
                  planned_tiles=(nb + TILE_BLOCKS - 1) // TILE_BLOCKS)
    return counts


def counters(snapshot: dict) -> dict[str, int]:
    return {name: snapshot.get(name, 0) for name in telemetry.COUNTERS}


def live_ids() -> list[int]:
    return [s["engine_id"] for s in telemetry.engine_snapshots()]


def assert_histogram_shape(h: dict) -> None:
    assert set(h) == {"le", "counts", "count", "sum"}
    le, counts = h["le"], h["counts"]
    assert len(le) == len(counts) == 24
    assert all(a < b for a, b in zip(le, le[1:]))
    assert le[0] == 1.0 and le[-2] == 2.0**22 and math.isinf(le[-1])
    assert all(isinstance(c, int) and c >= 0 for c in counts)
    assert h["count"] == sum(counts)


# --- names and shapes ----------------------------------------------------------------------------------------------


def test_counter_names() -> None:
    assert isinstance(telemetry.COUNTERS, tuple)
    assert telemetry.COUNTERS == ref.COUNTERS
    assert len(set(telemetry.COUNTERS)) == len(telemetry.COUNTERS)


def test_engine_snapshot_structure() -> None:
    engine = make_engine()
    snap = engine.snapshot()
    assert set(snap) == set(telemetry.COUNTERS) | {"histograms", "info"}
    assert counters(snap) == dict.fromkeys(telemetry.COUNTERS, 0)
    assert set(snap["histograms"]) == set(HISTOGRAMS)
    for h in snap["histograms"].values():
        assert_histogram_shape(h)
        assert h["count"] == 0 and h["sum"] == 0.0
    assert snap["info"] == INFO


@pytest.mark.parametrize(("seq_len", "admitted_bucket_le"), [(1, 1.0), (BLOCK_SIZE, 1.0), (BLOCK_SIZE + 1, 2.0),
                                                             (3 * BLOCK_SIZE - 1, 4.0), (4 * BLOCK_SIZE, 4.0)])
def test_counters_and_histograms_after_one_step(seq_len: int, admitted_bucket_le: float) -> None:
    engine = make_engine()
    drive(engine, seq_len=seq_len)
    snap = engine.snapshot()
    assert counters(snap) == expected_counters(seq_len=seq_len)
    for h in snap["histograms"].values():
        assert_histogram_shape(h)
        assert h["count"] == 1
    admitted = snap["histograms"]["blocks_admitted_per_forward"]
    nb = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    assert admitted["sum"] == float(nb)
    assert admitted["counts"][admitted["le"].index(admitted_bucket_le)] == 1
    assert snap["histograms"]["forward_latency_us"]["sum"] > 0.0


def test_in_place_engine_counts_blocks_in_place_and_copies_nothing() -> None:
    """Placement in place: every block a tile attends is counted in place; nothing is admitted, hit or copied."""
    engine = backend.Engine(NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, 0, TILE_BLOCKS,
                            placement="in_place")
    seq_len = 3 * BLOCK_SIZE - 1
    drive(engine, seq_len=seq_len)
    snap = engine.snapshot()
    nb = (seq_len + BLOCK_SIZE - 1) // BLOCK_SIZE
    assert counters(snap) == {**expected_counters(seq_len=seq_len), "blocks_admitted": 0, "bytes_h2d": 0,
                              "blocks_in_place": nb}
    assert snap["info"] == {**INFO, "pool_blocks": 0, "in_place": 1}
    admitted = snap["histograms"]["blocks_admitted_per_forward"]
    assert (admitted["count"], admitted["sum"]) == (1, 0.0)


# --- the registry --------------------------------------------------------------------------------------------------


def test_snapshot_sums_over_live_engines() -> None:
    gc.collect()
    base = telemetry.snapshot()
    ids_before = set(live_ids())
    first, second = make_engine(), make_engine()
    drive(first)
    total = telemetry.snapshot()
    assert total["engines"] == base["engines"] + 2
    expected = expected_counters()
    assert {k: v - counters(base)[k] for k, v in counters(total).items()} == expected
    assert counters(first.snapshot()) == expected
    assert counters(second.snapshot()) == dict.fromkeys(telemetry.COUNTERS, 0)
    # Info: num_layers adds up over engines; the other facts are reported where every live engine agrees (other
    # tests' engines may still be alive here, so only num_layers is checked as a difference).
    assert total["info"]["num_layers"] - base["info"].get("num_layers", 0) == 2 * INFO["num_layers"]
    for key, value in INFO.items():
        if key != "num_layers" and key in total["info"]:
            assert total["info"][key] == value, key
    for name in HISTOGRAMS:
        assert_histogram_shape(total["histograms"][name])
        base_count = base["histograms"][name]["count"] if base["histograms"] else 0
        assert total["histograms"][name]["count"] - base_count == 1

    new_ids = sorted(set(live_ids()) - ids_before)
    assert len(new_ids) == 2
    by_id = {s["engine_id"]: s for s in telemetry.engine_snapshots()}
    first_snap, second_snap = by_id[new_ids[0]], by_id[new_ids[1]]   # creation order
    assert counters(first_snap) == expected
    assert counters(second_snap) == dict.fromkeys(telemetry.COUNTERS, 0)
    assert first_snap["info"] == INFO
    assert set(first_snap) == set(telemetry.COUNTERS) | {"histograms", "info", "engine_id"}


def test_engine_snapshots_are_in_creation_order() -> None:
    engines = [make_engine() for _ in range(3)]
    ids = live_ids()
    assert ids == sorted(ids)
    assert len(set(ids)) == len(ids) >= len(engines)


def test_released_engine_leaves_the_registry() -> None:
    gc.collect()
    base = telemetry.snapshot()
    ids_before = set(live_ids())
    engine = make_engine()
    drive(engine)
    (new_id,) = set(live_ids()) - ids_before
    assert telemetry.snapshot()["engines"] == base["engines"] + 1
    del engine
    gc.collect()
    assert new_id not in live_ids()
    after = telemetry.snapshot()
    assert after["engines"] == base["engines"]
    assert counters(after) == counters(base)


def test_a_step_plan_keeps_its_engine_alive() -> None:
    gc.collect()
    ids_before = set(live_ids())
    engine = make_engine()
    plan = engine.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                        torch.tensor([[0]], dtype=torch.int32), 1, 1)
    (new_id,) = set(live_ids()) - ids_before
    del engine
    gc.collect()
    assert new_id in live_ids()
    assert plan.num_reqs == 1
    del plan
    gc.collect()
    assert new_id not in live_ids()


def test_standalone_kv_state_is_not_registered() -> None:
    gc.collect()
    before = telemetry.snapshot()["engines"]
    state = kv_state.KVState(1, NUM_HEADS, NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE, torch.float32, 2)
    assert telemetry.snapshot()["engines"] == before
    assert state.counters()["tokens_written"] == 0


def test_reset_telemetry_zeroes_counters_and_histograms() -> None:
    engine, other = make_engine(), make_engine()
    first_cache = drive(engine)
    drive(other)
    engine.reset_telemetry()
    snap = engine.snapshot()
    assert counters(snap) == dict.fromkeys(telemetry.COUNTERS, 0)
    for h in snap["histograms"].values():
        assert_histogram_shape(h)
        assert h["count"] == 0 and h["sum"] == 0.0 and not any(h["counts"])
    assert snap["info"] == INFO                       # static facts are not telemetry to reset
    assert counters(other.snapshot()) == expected_counters()   # per engine: the other one keeps its counts
    second_cache = drive(engine)                      # and counting resumes from zero
    assert second_cache.data_ptr() != first_cache.data_ptr()
    assert counters(engine.snapshot()) == {**expected_counters(), "host_rebinds": 1}


FRESH_PROCESS = textwrap.dedent(
    """
    import gc
    import sys

    import torch

    import activekv._backend as backend
    import activekv._telemetry as telemetry

    def fail(msg):
        sys.exit(msg)

    empty = telemetry.snapshot()
    if empty != {"histograms": {}, "info": {}, "engines": 0}:
        fail(f"no live engine, got {empty!r}")
    if telemetry.engine_snapshots() != []:
        fail("engine_snapshots not empty")
    a = backend.Engine(1, 2, 1, 4, 4, torch.float32, 2, 1)
    b = backend.Engine(1, 2, 1, 4, 4, torch.float32, 2, 1)
    cache = torch.zeros(2, 1, 4, 8)
    a.update_kv(0, torch.ones(3, 1, 4), torch.ones(3, 1, 4), cache, torch.tensor([0, 1, -1]))
    b.update_kv(0, torch.ones(1, 1, 4), torch.ones(1, 1, 4), cache, torch.tensor([5]))
    snap = telemetry.snapshot()
    if (snap["engines"], snap["tokens_written"], snap["padding_slots"], snap["kv_update_calls"]) != (2, 3, 1, 2):
        fail(f"sums over two engines, got {snap!r}")
    if [s["engine_id"] for s in telemetry.engine_snapshots()] != [0, 1]:
        fail("engine ids are not 0, 1 in creation order")
    del a
    gc.collect()
    snap = telemetry.snapshot()
    if (snap["engines"], snap["tokens_written"]) != (1, 1):
        fail(f"after del, got {snap!r}")
    if [s["engine_id"] for s in telemetry.engine_snapshots()] != [1]:
        fail("engine 0 still registered")
    """
)


def test_registry_in_a_fresh_process() -> None:
    """Absolute values: empty registry, ids from 0, sums over exactly the live engines."""
    proc = subprocess.run([sys.executable, "-c", FRESH_PROCESS], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr


def test_pool_to_host_bytes_help_says_what_it_counts() -> None:
    """activekv_pool_to_host_bytes counts the new K/V a tiered engine's KV updates copy device -> host tier."""
    families = {f.name: f for f in telemetry.Collector().collect()}
    doc = families["activekv_pool_to_host_bytes"].documentation
    assert "KV updates" in doc and "device to host" in doc and "today" not in doc
    assert telemetry.METRIC_NAMES["bytes_d2h"] == "activekv_pool_to_host_bytes_total"


def _float_repr_cases() -> list[float]:
    """Seeded random bit patterns (every exponent, subnormals, NaNs with either sign), values and integers of the
    callers' ranges, every power of two and ten a double holds, the edges of the format's rules, inf and nan."""
    import random
    import struct

    rng = random.Random(20240531)
    bits = [struct.unpack("<d", rng.getrandbits(64).to_bytes(8, "little"))[0] for _ in range(50000)]
    subnormal = [struct.unpack("<d", rng.getrandbits(52).to_bytes(8, "little"))[0] for _ in range(2000)]
    ranges = [rng.uniform(0, 1) for _ in range(5000)] + [rng.getrandbits(53) * 1e-6 for _ in range(5000)]
    integers = [float(i) for i in range(-1000, 1001)] + [float(rng.getrandbits(rng.randrange(1, 64))) for _ in
                                                          range(3000)]
    powers = [2.0**e for e in range(-1074, 1024)] + [10.0**e for e in range(-323, 309)] + [
        2.0**i * 1e-6 for i in range(23)]  # the latency histogram's bucket bounds in seconds
    edges = [5e-324, -5e-324, 2.2250738585072009e-308, 2.2250738585072014e-308, 1.7976931348623157e308, 0.0, -0.0,
             1e15, 1e16, 9999999999999998.0, 1e16 - 2, 123456789012345678.0, 1e-4, 1e-5, 0.00009999999999999999,
             0.1, 0.2, 0.30000000000000004, 1 / 3, 2 / 3, 9007199254740993.0, math.inf, -math.inf, math.nan,
             -math.nan]
    return bits + subnormal + ranges + integers + powers + edges


def test_float_repr_is_pythons_repr() -> None:
    cases = _float_repr_cases()
    assert sum(math.isnan(v) for v in cases) >= 2 and sum(0 < abs(v) < 2.2250738585072014e-308 for v in cases) > 2000
    wrong = [(v.hex(), telemetry.float_repr(v), repr(v)) for v in cases if telemetry.float_repr(v) != repr(v)]
    assert wrong == [], f"{len(wrong)} of {len(cases)} differ from repr, e.g. {wrong[:5]}"
    assert [telemetry.float_repr(v) for v in (1.0, -0.0, 1e16, 1e-5, 0.0001, 1e15)] == [
        "1.0", "-0.0", "1e+16", "1e-05", "0.0001", "1000000000000000.0"]
    with pytest.raises(TypeError, match="float_repr"):
        telemetry.float_repr("1.0")


def test_histogram_le_labels_are_prometheus_clients() -> None:
    """The le labels the collector writes are those prometheus_client writes for the same bounds (floatToGoString)."""
    from prometheus_client.utils import floatToGoString

    families = {f.name: f for f in telemetry.Collector().collect()}
    for name, scale in (("activekv_forward_latency_seconds", 1e-6), ("activekv_blocks_admitted_per_forward", 1.0)):
        les = [s.labels["le"] for s in families[name].samples if s.name == name + "_bucket"]
        assert les == [floatToGoString(2.0**i * scale) for i in range(len(les) - 1)] + ["+Inf"]
