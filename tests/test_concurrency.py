"""Concurrency: two engines in one process keep separate state and telemetry, and native compute runs without the
GIL (a Python thread keeps running while native attention computes; two threads' native calls overlap in time and
still give the single-threaded results)."""

from __future__ import annotations

import threading
import time

import torch

import activekv._attention as attention  # after torch: the modules' import guard needs it
import activekv._backend as backend
import activekv._telemetry as telemetry
from tests.reference import engine as ref

H, KVH, D, BS = 4, 2, 64, 16


def step(e: backend.Engine, seed: int, blocks: int = 6):
    """Prefill one request of blocks * BS - 3 tokens and decode one: (prefill output, decode output, cache)."""
    g = torch.Generator().manual_seed(seed)
    seq = blocks * BS - 3
    cache = torch.zeros(blocks + 2, KVH, BS, 2 * D)
    table = torch.randperm(blocks + 2, generator=g)[:blocks].to(torch.int32)[None]
    slots = torch.tensor([int(table[0, p // BS]) * BS + p % BS for p in range(seq + 1)])
    k, v, q = (torch.randn(seq + 1, n, D, generator=g) for n in (KVH, KVH, H))
    e.update_kv(0, k[:seq], v[:seq], cache, slots[:seq])
    plan = e.build(torch.tensor([0, seq], dtype=torch.int32), torch.tensor([seq], dtype=torch.int32), table, 1, seq)
    out1 = torch.zeros(seq, H, D)
    e.forward(0, plan, q[:seq], cache, out1, D ** -0.5)
    e.update_kv(0, k[seq:], v[seq:], cache, slots[seq:])
    plan = e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([seq + 1], dtype=torch.int32), table, 1, 1)
    out2 = torch.zeros(1, H, D)
    e.forward(0, plan, q[seq:], cache, out2, D ** -0.5)
    return out1, out2, cache


def make(pool_blocks: int) -> backend.Engine:
    return backend.Engine(1, H, KVH, D, BS, torch.float32, pool_blocks, 2, kernel="aten")


def counters(e: backend.Engine) -> dict:
    snap = e.snapshot()
    return {k: snap[k] for k in ref.COUNTERS}


def test_two_engines_interleaved_keep_separate_state_and_telemetry() -> None:
    """Steps of two engines (different pools, different data) interleaved equal each engine run on its own: outputs,
    KV caches, pools, page tables and counters; the process-wide snapshot is their sum."""
    solo_a, solo_b = make(3), make(5)
    want_a, want_b = step(solo_a, 1), step(solo_b, 2)
    a, b = make(3), make(5)
    base = telemetry.snapshot()
    got_a_first = step(a, 1)  # a runs its request, then b its own: b must not disturb a
    got_b = step(b, 2)
    for x, y in zip(got_a_first + got_b, want_a + want_b):
        assert torch.equal(x, y)
    assert torch.equal(a.pool(0), solo_a.pool(0)) and torch.equal(b.pool(0), solo_b.pool(0))
    assert a.resident(0) == solo_a.resident(0) and b.resident(0) == solo_b.resident(0)
    assert counters(a) == counters(solo_a) and counters(b) == counters(solo_b)
    assert counters(a) != counters(b)  # different pools: different admissions, so the comparison can tell them apart
    total = telemetry.snapshot()
    for k in ("tokens_written", "forward_calls", "blocks_admitted", "blocks_evicted"):
        assert total[k] - base[k] == counters(a)[k] + counters(b)[k], k


def _long_attention() -> tuple[torch.Tensor, torch.Tensor, int]:
    g = torch.Generator().manual_seed(0)
    q = torch.randn(256, 8, 64, generator=g)
    kv = torch.randn(192, 2, 2, 16, 64, generator=g)
    return q, kv, 192 * 16


def test_gil_is_released_while_native_attention_computes() -> None:
    """A Python thread ticks every millisecond; while native attention runs in another thread (called until 0.2 s),
    the ticks go on. Were the GIL held, no tick could land inside the call."""
    q, kv, seq = _long_attention()
    want = attention.tiled_attention(q, kv, seq, 8, 0.125)
    ticks: list[float] = []
    stop = threading.Event()

    def ticker() -> None:
        while not stop.is_set():
            ticks.append(time.perf_counter())
            time.sleep(0.001)

    t = threading.Thread(target=ticker)
    t.start()
    calls: list[tuple[float, float]] = []
    try:
        time.sleep(0.02)
        # Enough calls for at least 0.2 s inside native code, however fast the machine (one call took 0.020 s on a
        # quiet one, too short to tell on its own).
        while sum(end - start for start, end in calls) < 0.2:
            start = time.perf_counter()
            got = attention.tiled_attention(q, kv, seq, 8, 0.125)
            calls.append((start, time.perf_counter()))
            assert torch.equal(got, want)
    finally:
        stop.set()
        t.join()
    inside = [x for x in ticks if any(start < x < end for start, end in calls)]
    native = sum(end - start for start, end in calls)
    assert len(inside) >= 3, f"{len(inside)} ticks during {len(calls)} native calls of {native:.3f} s in all"


def test_two_threads_run_native_forward_concurrently_with_correct_results() -> None:
    """Two threads, one engine each, many forwards: every result equals the single-threaded one, and the native calls
    of the two threads overlap in time (impossible if either held the GIL through its call)."""
    engines = [backend.Engine(1, H, KVH, D, BS, torch.float32, 8, 4) for _ in range(2)]
    setups = []
    for i, e in enumerate(engines):
        g = torch.Generator().manual_seed(10 + i)
        cache = torch.zeros(64, KVH, BS, 2 * D)
        e.update_kv(0, torch.randn(1000, KVH, D, generator=g), torch.randn(1000, KVH, D, generator=g), cache,
                    torch.arange(1000))
        plan = e.build(torch.tensor([0, 4], dtype=torch.int32), torch.tensor([1000], dtype=torch.int32),
                       torch.arange(64, dtype=torch.int32)[None], 1, 4)
        q = torch.randn(4, H, D, generator=g)
        want = torch.zeros(4, H, D)
        e.forward(0, plan, q, cache, want, 0.125)
        setups.append((e, plan, q, cache, want))
    spans: list[list[tuple[float, float]]] = [[], []]
    wrong = [0, 0]

    def work(i: int) -> None:
        e, plan, q, cache, want = setups[i]
        for _ in range(40):
            out = torch.zeros(4, H, D)
            s = time.perf_counter()
            e.forward(0, plan, q, cache, out, 0.125)
            spans[i].append((s, time.perf_counter()))
            wrong[i] += not torch.equal(out, want)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [0, 0]
    overlaps = sum(1 for a0, a1 in spans[0] for b0, b1 in spans[1] if a0 < b1 and b0 < a1)
    assert overlaps > 0, "the two threads' native forwards never overlapped"
