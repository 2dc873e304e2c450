"""The step plan (engine/include/activekv/step_plan.h): build checks a step's block ids and plans its tiles once, and
every layer's forward reuses them.

Counters `planned_blocks` and `planned_tiles` count the block ids plan_step checks and the exact tiles it plans: over a
multi-layer run they equal the per-step sums, not layers x steps, so planning per layer fails here. A plan is checked
against each forward's KV cache (its largest block id against the cache's size), whatever cache, if any, was bound when
it was built. The CPU kernel's rounds made at build (for the build's thread count) give the same bytes as rounds made
by a forward at another thread count.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import activekv._backend as backend

LAYERS, H, KVH, D, BS, TB = 3, 8, 2, 32, 16, 2
NUM_BLOCKS = 64


def engine(kernel: str, mode: str = "exact", pool: int = 32) -> backend.Engine:
    kw = {"mode": mode, "kernel": kernel}
    if mode == "compressed":
        kw.update(budget_tokens=5 * BS, sink_blocks=1, recent_blocks=2)  # 2 chosen per KV head: 5 blocks per head
    return backend.Engine(LAYERS, H, KVH, D, BS, torch.float32, pool, TB, **kw)


def blocks_for(n: int) -> int:
    return (n + BS - 1) // BS


class Run:
    """Rows whose contexts grow by their query tokens each step, every layer updated and forwarded."""

    def __init__(self, e: backend.Engine, seed: int = 0) -> None:
        self.e = e
        self.gen = torch.Generator().manual_seed(seed)
        self.caches = [torch.zeros(NUM_BLOCKS, KVH, BS, 2 * D) for _ in range(LAYERS)]
        perm = torch.randperm(NUM_BLOCKS, generator=self.gen)
        self.table = torch.stack([perm[:20], perm[20:40], perm[40:60]]).to(torch.int32)  # 3 rows of 20 blocks
        self.lens = [0, 0, 0]
        self.expected_blocks = self.expected_tiles = 0

    def step(self, new: list[int], per_head: int = 0) -> list[torch.Tensor]:
        qsl, slots = [0], []
        for r, n in enumerate(new):
            for t in range(self.lens[r], self.lens[r] + n):
                slots.append(int(self.table[r, t // BS]) * BS + t % BS)
            self.lens[r] += n
            qsl.append(qsl[-1] + n)
            if n:
                nb = blocks_for(self.lens[r])
                self.expected_blocks += nb
                if not (per_head and n == 1 and nb > per_head):
                    self.expected_tiles += (nb + TB - 1) // TB
        tokens = qsl[-1]
        plan = self.e.build(torch.tensor(qsl, dtype=torch.int32), torch.tensor(self.lens, dtype=torch.int32),
                            self.table, len(new), tokens)
        outs = []
        for layer in range(LAYERS):
            k = torch.randn(tokens, KVH, D, generator=self.gen)
            v = torch.randn(tokens, KVH, D, generator=self.gen)
            self.e.update_kv(layer, k, v, self.caches[layer], torch.tensor(slots))
            q = torch.randn(tokens, H, D, generator=self.gen)
            out = torch.empty(tokens, H, D)
            self.e.forward(layer, plan, q, self.caches[layer], out, D**-0.5)
            outs.append(out)
        return outs


@pytest.mark.parametrize("kernel", ["native", "aten"])
@pytest.mark.parametrize("mode", ["exact", "compressed"])
def test_block_checks_and_tiles_are_planned_once_per_step_not_per_layer(kernel: str, mode: str) -> None:
    e = engine(kernel, mode)
    run = Run(e)
    per_head = 5 if mode == "compressed" else 0
    steps = [[40, 100, 0], [1, 1, 70], [1, 1, 1], [1, 0, 1], [1, 1, 1]]
    for new in steps:
        run.step(new, per_head)
    snap = e.snapshot()
    assert snap["build_calls"] == len(steps)
    assert snap["forward_calls"] == LAYERS * len(steps)
    assert run.expected_blocks > 0 and run.expected_tiles > 0
    assert snap["planned_blocks"] == run.expected_blocks  # layers x this if a forward re-checked the block ids
    assert snap["planned_tiles"] == run.expected_tiles  # layers x this if a forward re-planned its tiles
    if mode == "compressed":
        assert snap["compressed_rows"] > 0  # decode rows past 5 blocks selected, per layer
        assert snap["compressed_rows"] % LAYERS == 0


def test_a_plan_is_checked_against_each_forwards_cache() -> None:
    """A plan built before any cache is bound reads block 40: a 32-block cache refuses it with nothing changed, a
    64-block one serves it; the same plan then still refuses the smaller cache."""
    e = engine("native")
    plan = e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([BS + 1], dtype=torch.int32),
                   torch.tensor([[3, 40]], dtype=torch.int32), 1, 1)
    small, big = torch.zeros(32, KVH, BS, 2 * D), torch.zeros(64, KVH, BS, 2 * D)
    q, out = torch.randn(1, H, D), torch.zeros(1, H, D)
    before = e.snapshot()
    with pytest.raises(IndexError, match=r"block_table\[0, 1\] must be in \[0, 32\) \(the KV cache's blocks\), got 40"):
        e.forward(0, plan, q, small, out, 0.1)
    after = e.snapshot()
    assert all(after[k] == before[k] for k in ("forward_calls", "blocks_admitted", "host_rebinds"))
    assert len(e.resident(0)) == 0 and bool((out == 0).all())
    e.forward(0, plan, q, big, out, 0.1)
    assert sorted(e.resident(0)) == [3, 40]
    with pytest.raises(IndexError, match=r"block_table\[0, 1\] must be in \[0, 32\)"):
        e.forward(1, plan, q, small, out, 0.1)


def test_build_takes_the_step_slot_mapping_and_the_update_still_checks_it_on_cpu() -> None:
    """build accepts the step's slot mapping (vLLM's builder passes it; a CUDA engine checks it there once, see
    tests/test_gpu.py); on a CPU engine it is not kept: the update checks its own slot mapping, bad entries included,
    and changes nothing on a rejected one."""
    e = engine("native")
    slots = torch.tensor([BS, 7 * BS * NUM_BLOCKS])
    e.build(torch.tensor([0, 1], dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
            torch.tensor([[1]], dtype=torch.int32), 1, 1, slot_mapping=slots)
    cache = torch.zeros(NUM_BLOCKS, KVH, BS, 2 * D)
    with pytest.raises(IndexError, match=rf"slot_mapping\[1\] must be -1 \(padding\) or in \[0, {NUM_BLOCKS * BS}\)"):
        e.update_kv(0, torch.ones(2, KVH, D), torch.ones(2, KVH, D), cache, slots)
    assert bool((cache == 0).all()) and e.snapshot()["tokens_written"] == 0


@pytest.mark.parametrize("pool", [32, 4])
def test_cpu_rounds_planned_at_build_match_rounds_made_by_forward(pool: int) -> None:
    """The CPU kernel's rounds (and their task split) are planned at build for build's thread count; a forward at
    another count makes its own. The outputs and counters are the same bytes either way (a small pool makes several
    rounds per layer)."""
    threads = torch.get_num_threads()
    results = []
    try:
        for build_threads in (1, 2):
            e = engine("native", pool=pool)
            run = Run(e, seed=3)
            original = e.build

            def build(*args, _orig=original, _n=build_threads):  # plan at one thread count, forward at another
                torch.set_num_threads(_n)
                try:
                    return _orig(*args)
                finally:
                    torch.set_num_threads(2)

            run.e = SimpleNamespace(build=build, update_kv=e.update_kv, forward=e.forward)
            torch.set_num_threads(2)
            outs = [run.step([40, 100, 30]), run.step([1, 1, 1])]
            snap = e.snapshot()
            results.append((outs, {k: snap[k] for k in ("blocks_admitted", "blocks_hit", "blocks_evicted",
                                                         "tiles_computed")}, [e.resident(i) for i in range(LAYERS)]))
    finally:
        torch.set_num_threads(threads)
    (a, ca, ra), (b, cb, rb) = results
    for x, y in zip(a, b):
        for ox, oy in zip(x, y):
            assert torch.equal(ox, oy)
    assert ca == cb and ra == rb
    if pool == 4:
        assert ca["blocks_evicted"] > 0
