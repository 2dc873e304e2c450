"""Compressed-mode selection time of one decode row, the benchmark's geometry, three ways, in one run.

`python -m tools.profile_selection [--contexts 8192 16384 32768] [--reps R] [--threads T]`. 32 query heads, 8 KV
heads, head size 128, block 16, budget 2048 tokens, sink 1, recent 2 (k = 125), key min/max of random keys, the row's
blocks a seeded permutation. Median milliseconds per call of:

- `sort` (the selection before top-k): the ATen Quest bound (`activekv._admission.quest_scores`), then a stable
  descending sort and a stable ascending sort of the first k, as admission.cpp did;
- `aten`: `activekv._admission.select_blocks` (ATen bound, `at::topk` for the k-th score, lowest-position ties), the
  path the reference repeats (kernel `aten`);
- `native`: the same with `native_scores=True`, the CPU kernel's bound read in place (kernel `native`, the default).

It also checks the three choose the same blocks. A timing on a shared machine: print the load with it.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

H, KVH, D, BS, BUDGET, SINK, RECENT = 32, 8, 128, 16, 2048, 1, 2


def median_ms(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[reps // 2] * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.profile_selection", description=__doc__.splitlines()[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8192, 16384, 32768])
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    import activekv._admission as admission  # after torch

    torch.set_num_threads(args.threads)
    k = BUDGET // BS - SINK - RECENT
    print(f"load average {', '.join(f'{x:.2f}' for x in os.getloadavg())}; {args.threads} threads; "
          f"{H} heads / {KVH} KV heads, head size {D}, block {BS}, k {k}; median ms of {args.reps} calls")
    print("| context | candidates | sort (before) | aten (top-k) | native | sort / native |")
    print("|---|---|---|---|---|---|")
    for context in args.contexts:
        g = torch.Generator().manual_seed(context)
        nb = context // BS
        kmin = torch.randn(nb, KVH, D, generator=g)
        kmax = kmin + torch.rand(nb, KVH, D, generator=g)
        row = torch.randperm(nb, generator=g)
        q = torch.randn(1, H, D, generator=g)
        ids = row.narrow(0, SINK, nb - SINK - RECENT)

        def by_sort() -> torch.Tensor:
            score = admission.quest_scores(q, kmin, kmax, ids)
            order = torch.sort(score, stable=True, dim=1, descending=True)[1]
            return torch.sort(order.narrow(1, 0, k), stable=True, dim=1)[0]

        def aten() -> torch.Tensor:
            return admission.select_blocks(q, kmin, kmax, row, SINK, RECENT, k)

        def native() -> torch.Tensor:
            return admission.select_blocks(q, kmin, kmax, row, SINK, RECENT, k, native_scores=True)

        chosen = aten()
        assert torch.equal(chosen.narrow(1, SINK, k), by_sort().add(SINK)) and torch.equal(chosen, native())
        t_sort, t_aten, t_native = (median_ms(f, args.reps) for f in (by_sort, aten, native))
        print(f"| {context // 1024}k | {nb - SINK - RECENT} | {t_sort:.2f} | {t_aten:.2f} | {t_native:.2f} | "
              f"{t_sort / t_native:.1f}x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
