"""The GPU engine benchmark's CPU-side parts (`tools/bench_gpu.py`): the compressed section's queries (random, and
drifting as an AR(1) process), its table, target line and plot series on the committed data plus made-up drift rows,
the breakdown's configuration parser, and the CLI's --help and argument checks. No GPU: the timed parts run on the
device (`make gpu-check`); no figure here is a speed."""

from __future__ import annotations

import argparse
import copy
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tools import bench_gpu

REPO_ROOT = Path(__file__).resolve().parents[1]


def lag1_correlation(q: torch.Tensor) -> float:
    x = q.float().flatten(1)
    return torch.corrcoef(torch.stack([x[:-1].flatten(), x[1:].flatten()]))[0, 1].item()


def test_drifting_queries_are_ar1_with_unit_variance_and_random_ones_are_independent() -> None:
    torch.manual_seed(0)
    drift = bench_gpu.query_steps(200, 2, "drift", a=0.95, device="cpu")
    assert drift.shape == (200, 2, bench_gpu.H, bench_gpu.D) and drift.dtype == bench_gpu.DT
    assert lag1_correlation(drift) == pytest.approx(0.95, abs=0.01)
    assert drift.float().var().item() == pytest.approx(1.0, abs=0.1)  # stationary: every step standard normal
    assert not torch.equal(drift[1], drift[0])  # each step a new query
    rand = bench_gpu.query_steps(200, 2, "random", device="cpu")
    assert abs(lag1_correlation(rand)) < 0.01
    assert rand.float().var().item() == pytest.approx(1.0, abs=0.05)


@pytest.mark.parametrize(("kind", "a", "match"), [("walk", 0.9, "queries must be"), ("drift", 1.0, "in \\[0, 1\\)"),
                                                  ("drift", -0.1, "in \\[0, 1\\)")])
def test_query_steps_refuses_an_unknown_kind_or_coefficient(kind: str, a: float, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        bench_gpu.query_steps(4, 1, kind, a=a, device="cpu")


def test_breakdown_configurations_parse_with_tokens_or_k_and_optional_queries() -> None:
    assert bench_gpu.parse_breakdown("16x32k") == (16, 32768, "random")
    assert bench_gpu.parse_breakdown("1X131072:drift") == (1, 131072, "drift")
    assert [bench_gpu.parse_breakdown(s) for s in bench_gpu.BREAKDOWN_DEFAULT] == [(16, 32768, "random"),
                                                                                   (16, 131072, "random")]
    for bad in ("16", "16x", "x32k", "16x32k:walk", "0x32k", "16x100"):
        with pytest.raises(argparse.ArgumentTypeError, match="got"):
            bench_gpu.parse_breakdown(bad)


def test_streamed_breakdown_configurations_parse_with_an_optional_tile() -> None:
    assert bench_gpu.parse_streamed("1x128k") == (1, 131072, 256)
    assert bench_gpu.parse_streamed("16X32768:128") == (16, 32768, 128)
    assert [bench_gpu.parse_streamed(s) for s in bench_gpu.STREAMED_BREAKDOWN_DEFAULT] == [
        (1, 131072, 256), (1, 32768, 128), (16, 131072, 256)]
    for bad in ("1", "1x", "x32k", "1x32k:", "1x32k:big"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected BATCHxCONTEXT\[:TILE\] .* \(TILE in blocks\)"):
            bench_gpu.parse_streamed(bad)
    for bad, why in (("0x32k", "the batch must be >= 1"), ("1x100", "a positive multiple of 16 tokens"),
                     ("1x32k:0", "the tile must be 1 to 1024 blocks"), ("1x32k:1025", "the tile must be 1 to 1024"),
                     ("1x8k:32", "must exceed the pool's 16384 tokens"), ("2x8k", "nothing streams")):
        with pytest.raises(argparse.ArgumentTypeError, match=why + ".*got"):
            bench_gpu.parse_streamed(bad)
    assert bench_gpu.parse_streamed("1x32k:1024") == (1, 32768, 1024)  # the whole pool
    assert bench_gpu.parse_streamed("8x8k:32") == (8, 8192, 32)  # the rows evict each other's blocks


def copy_event(ts: float, dur: float, corr: int, nbytes: int = 16 << 20) -> dict:
    return {"cat": "gpu_memcpy", "name": "Memcpy HtoD (Pinned -> Device)", "ts": ts, "dur": dur,
            "args": {"bytes": nbytes, "correlation": corr}}


def runtime_event(name: str, ts: float, dur: float, corr: int) -> dict:
    return {"cat": "cuda_runtime", "name": name, "ts": ts, "dur": dur, "args": {"correlation": corr}}


def test_trace_stats_times_the_copy_engine_and_blames_gaps_on_a_late_host() -> None:
    # Two steps: three tile copies of 16 MiB (300 us each) and one small index copy (ignored). Copy 2 was enqueued
    # while copy 1 ran (a device-side gap of 20 us); copy 3's call began after copy 2 had ended (host-late, 50 us).
    events = [copy_event(0, 300, 1), runtime_event("cudaMemcpyAsync", -10, 5, 1),
              copy_event(320, 300, 2), runtime_event("cudaMemcpyAsync", 100, 5, 2),
              copy_event(670, 300, 3), runtime_event("cudaMemcpyAsync", 640, 25, 3),
              copy_event(980, 2, 4, nbytes=4096), runtime_event("cudaMemcpyAsync", 700, 5, 4),
              {"cat": "kernel", "name": "attend", "ts": 630, "dur": 40, "args": {}},
              runtime_event("cudaLaunchKernel", 600, 8, 5)]
    st = bench_gpu.trace_stats(events, steps=2)
    assert st["copies_per_step"] == 1.5 and st["copy_bytes_per_step"] == 1.5 * (16 << 20)
    assert st["copy_busy_ms_per_step"] == pytest.approx(0.45)
    assert st["copy_engine_GBps"] == pytest.approx(3 * (16 << 20) / 900 / 1e3)
    assert st["copy_span_ms_per_step"] == pytest.approx(0.485)
    assert st["gaps"] == 2 and st["gap_ms_per_step"] == pytest.approx(0.035)
    assert st["gap_median_us"] == pytest.approx(35) and st["gap_p90_us"] == pytest.approx(20)
    assert st["gaps_host_late"] == 1 and st["host_late_ms_per_step"] == pytest.approx(0.025)
    assert st["kernel_ms_per_step"] == pytest.approx(0.02)
    assert st["tail_ms_per_step"] == 0.0  # the kernel ended (670) before the last tile copy (970)
    late = bench_gpu.trace_stats(events + [{"cat": "kernel", "name": "attend", "ts": 990, "dur": 50, "args": {}}], 2)
    assert late["tail_ms_per_step"] == pytest.approx(0.035)  # ran on 70 us past the last copy's end, over 2 steps
    top = st["runtime_calls"][0]
    assert top == {"name": "cudaMemcpyAsync", "calls_per_step": 2, "ms_per_step": pytest.approx(0.02), "max_us": 25}
    assert [c["name"] for c in st["runtime_calls"]] == ["cudaMemcpyAsync", "cudaLaunchKernel"]


def test_trace_stats_of_a_trace_without_copies_reports_none_rather_than_dividing_by_zero() -> None:
    st = bench_gpu.trace_stats([runtime_event("cudaLaunchKernel", 0, 8, 1)], steps=1)
    assert st["copies_per_step"] == 0 and st["copy_engine_GBps"] is None and st["gap_median_us"] is None
    row = {"batch": 1, "context": 131072, "tile_blocks": 256, "ms": 12.0, "kv_GBps": 44.7, **st}
    lines = bench_gpu.streamed_breakdown_table({"streamed_breakdown": [row]})
    assert len(lines) == 3 and lines[2].startswith("| 1 | 128k | 256 | 12.00 | 44.7 | 0 | 0.00 | - |")
    assert lines[2].endswith("| 0.00 | cudaLaunchKernel 0.01 ms (1) |")
    del row["tail_ms_per_step"]  # data written before the column
    assert bench_gpu.streamed_breakdown_table({"streamed_breakdown": [row]})[2].endswith(
        "| - | cudaLaunchKernel 0.01 ms (1) |")


# The keys of a compressed row that data written before the timed-step counters lacks.
OLD_ROW_KEYS = ("batch", "context", "kernel", "ms", "union_blocks_per_row", "admitted_per_step")


def older_data() -> dict:
    """The committed GPU data as an older run wrote it: random-query compressed rows with only OLD_ROW_KEYS."""
    res = json.loads((REPO_ROOT / "docs" / "data" / "bench_gpu.json").read_text())
    res["compressed"] = [{k: r[k] for k in OLD_ROW_KEYS} for r in res["compressed"]
                         if r.get("queries", "random") == "random"]
    return res


def with_drift_rows(ms_128k_b16: float, admitted_ratio: float) -> dict:
    """Older data (older_data) with a drifting-query row (every new key filled) after each random one."""
    res = older_data()
    rows = []
    for r in res["compressed"]:
        d = copy.deepcopy(r)
        union = r["union_blocks_per_row"]
        d.update(queries="drift", drift_a=0.95, distinct_queries=21, kernel_ms=0.5, pool_blocks=1003 * r["batch"],
                 evicted_per_step=10.0, hit_per_step=union * r["batch"], timed_steps=12,
                 union_blocks_per_row_timed=union, selected_blocks_per_row_timed=8 * 125 + 3,
                 admitted_per_step_timed=admitted_ratio * r["batch"] * union, evicted_per_step_timed=5.0,
                 hit_per_step_timed=union * r["batch"], admitted_union_ratio=admitted_ratio,
                 pool_over_batch_union=1003 / union)
        if (r["batch"], r["context"]) == (16, 131072):
            d["ms"] = ms_128k_b16
        rows += [r, d]
    res["compressed"] = rows
    return res


def test_compressed_table_has_a_row_per_cell_and_query_kind_and_dashes_what_older_data_lacks() -> None:
    res = with_drift_rows(3.0, 0.05)
    lines = bench_gpu.compressed_table(res)
    header, rule, body = lines[0], lines[1], lines[2:]
    columns = header.count("|") - 1
    assert rule.count("---") == columns and all(line.count("|") - 1 == columns for line in body)
    assert len(body) == len(res["compressed"]) == 12
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in body]
    names = [c.strip() for c in header.strip("|").split("|")]
    old, new = dict(zip(names, cells[-2], strict=True)), dict(zip(names, cells[-1], strict=True))
    assert (old["batch"], old["context"], old["queries"]) == ("16", "128k", "random")
    assert old["admitted / union"] == old["evicted/step"] == old["kernel ms"] == "-"  # the committed data's rows
    assert new["queries"] == "drift (a=0.95)" and new["admitted / union"] == "0.050"
    sdpa = next(s["ms"] for s in res["sdpa"] if (s["batch"], s["context"]) == (16, 131072))
    assert new["compressed ms"] == "3.00" and float(new["SDPA / compressed"]) == pytest.approx(sdpa / 3.0, abs=1e-3)
    assert new["pool / union"] == f"{1003 / res['compressed'][-1]['union_blocks_per_row']:.2f}"


@pytest.mark.parametrize(("ms", "ratio", "time_met", "ratio_met"), [(3.0, 0.5, True, False), (30.0, 0.05, False, True),
                                                                    (30.0, 0.5, False, False)])
def test_compressed_target_is_2x_sdpa_or_a_tenth_of_the_union_at_batch_16_128k_drifting(
        ms: float, ratio: float, time_met: bool, ratio_met: bool) -> None:
    res = with_drift_rows(ms, ratio)
    sdpa = next(s["ms"] for s in res["sdpa"] if (s["batch"], s["context"]) == (16, 131072))
    [line] = bench_gpu.compressed_targets(res)
    assert f"{ms:.2f} ms against 2 x {sdpa:.3f}" in line
    assert f"({'met' if time_met else 'not met'}); admitted / union {ratio:.3f} ({'met' if ratio_met else 'not met'})" \
        in line
    assert f"; target {'met' if time_met or ratio_met else 'not met'}. The admitted bytes alone take" in line


def test_compressed_target_names_the_admitted_bytes_bus_time_and_the_heads_share_of_them() -> None:
    res = with_drift_rows(30.0, 0.5)
    res["ceilings"] = {"h2d_GBps": 50.0}
    row = next(r for r in res["compressed"] if r.get("queries") == "drift"
               and (r["batch"], r["context"]) == (16, 131072))
    row.update(admitted_per_step_timed=6000.0, selected_blocks_per_row_timed=1003.0, union_blocks_per_row_timed=950.0)
    [line] = bench_gpu.compressed_targets(res)
    bus = 6000 * 65536 / 50e6  # 7.86 ms
    assert f"The admitted bytes alone take {bus:.2f} ms on the pinned bus (6000 blocks of 64 KiB at 50.0 GB/s), above" \
        in line
    assert line.endswith("(1003 per row over a union of 950: 1.06 heads per admitted block, 13% of the bytes "
                         "admitted).")
    row["admitted_per_step_timed"] = 10.0
    assert "within" in bench_gpu.compressed_targets(res)[0]
    del res["ceilings"]  # no bus figure in the data: the sentence is left out
    assert bench_gpu.compressed_targets(res)[0].endswith("target not met.")


def test_compressed_target_says_not_measured_without_a_drift_row() -> None:
    res = older_data()
    [line] = bench_gpu.compressed_targets(res)
    assert line.endswith("not measured (no drifting-query row at that batch and context).")


def test_gather_line_gives_the_low_counts_the_range_from_8_and_the_default() -> None:
    res = {"gather": [{"block_KiB": 16, "ctas": c, "default": False, "mapped_GBps": g}
                      for c, g in ((2, 20.0), (4, 40.0), (8, 44.0), (132, 45.5))]
           + [{"block_KiB": 16, "ctas": 32, "default": True, "mapped_GBps": 44.6},
              {"block_KiB": 64, "ctas": 8, "default": False, "mapped_GBps": 47.0}]}
    assert bench_gpu.gather_line(res) == (
        "copy_blocks_mapped by CTA count of its gather kernel (`ACTIVEKV_GATHER_CTAS`): 16 KiB blocks 20.0 GB/s at 2, "
        "40.0 GB/s at 4, 44.0-45.5 from 8 to 132 (the default, 32: 44.6); 64 KiB blocks 47.0-47.0 from 8 to 8.")


def test_breakdown_table_has_a_row_per_profile_with_the_admitted_bytes_bus_time() -> None:
    res = older_data()
    res["ceilings"] = {"h2d_GBps": 50.0}
    res["compressed_breakdown"] = [
        {"batch": 16, "context": 131072, "queries": "drift", "drift_a": 0.95, "wall_ms_per_step": 14.0,
         "forward_cpu_ms_per_step": 12.5, "forward_self_cpu_ms_per_step": 3.25, "device_ms_per_step": 15.5,
         "admitted_per_step": 1000.0,
         "top_self_cpu": [{"name": "cudaMemcpyAsync", "calls": 400, "self_cpu_ms_per_step": 4.5}]},
        {"batch": 1, "context": 32768, "queries": "random", "drift_a": None, "wall_ms_per_step": 1.0,
         "forward_cpu_ms_per_step": 0.9, "forward_self_cpu_ms_per_step": 0.2, "device_ms_per_step": 0.8,
         "admitted_per_step": 0.0, "top_self_cpu": []}]
    lines = bench_gpu.breakdown_table(res)
    names = [c.strip() for c in lines[0].strip("|").split("|")]
    assert lines[1].count("---") == len(names) and len(lines) == 4
    first, second = (dict(zip(names, [c.strip() for c in line.strip("|").split("|")], strict=True))
                     for line in lines[2:])
    assert (first["batch"], first["context"], first["queries"]) == ("16", "128k", "drift (a=0.95)")
    assert first["their bus time ms"] == f"{1000 * 65536 / 50e9 * 1e3:.2f}" == "1.31"
    assert first["largest host self cost"] == "cudaMemcpyAsync 4.50 ms (400 calls)"
    assert (second["their bus time ms"], second["largest host self cost"]) == ("0.00", "-")
    del res["ceilings"]
    assert bench_gpu.breakdown_table(res)[2].split("|")[9].strip() == "-"  # no ceiling measured: no bus time


def test_blocks_table_shows_the_gather_kernel_alone_and_dashes_data_without_it() -> None:
    res = older_data()
    for r in res["blocks"]:  # as data from before the kernel-alone, in-order and forced-read columns
        for key in ("gather_kernel_GBps", "mapped_in_order_GBps", "mapped_dma_GBps", "mapped_gather_GBps",
                    "mapped_back_to_back_GBps"):
            r.pop(key, None)
    res["blocks"][0]["gather_kernel_GBps"] = 51.0
    lines = bench_gpu.blocks_table(res)
    names = [c.strip() for c in lines[0].strip("|").split("|")]
    rows = [dict(zip(names, [c.strip() for c in line.strip("|").split("|")], strict=True)) for line in lines[2:]]
    assert len(rows) == len(res["blocks"]) and lines[1].count("---") == len(names)
    assert rows[0]["its kernel alone GB/s"] == "51.0"
    assert {r["its kernel alone GB/s"] for r in rows[1:]} == {"-"}
    assert {r[c] for r in rows for c in ("back to back GB/s", "in order GB/s", "copy engines GB/s",
                                         "gather kernel GB/s")} == {"-"}
    res["blocks"][1].update(mapped_in_order_GBps=45.5, mapped_dma_GBps=25.7, mapped_gather_GBps=42.3,
                            mapped_back_to_back_GBps=46.25)
    row = dict(zip(names, [c.strip() for c in bench_gpu.blocks_table(res)[3].strip("|").split("|")], strict=True))
    assert (row["back to back GB/s"], row["in order GB/s"], row["copy engines GB/s"], row["gather kernel GB/s"]) == (
        "46.2", "45.5", "25.7", "42.3")
    assert row["copy_blocks_mapped GB/s"] == f"{res['blocks'][1]['mapped_GBps']:.1f}"


def test_committed_data_renders_its_breakdown_rows() -> None:
    res = json.loads((REPO_ROOT / "docs" / "data" / "bench_gpu.json").read_text())
    assert len(bench_gpu.breakdown_table(res)) == 2 + len(res.get("compressed_breakdown", []))


def test_plot_series_split_random_and_drifting_rows_and_the_plot_draws(tmp_path: Path) -> None:
    res = with_drift_rows(3.0, 0.05)
    rand, drift = bench_gpu.series_rows(res, "compressed"), bench_gpu.series_rows(res, "compressed_drift")
    assert len(rand) == len(drift) == 6
    assert {r.get("queries", "random") for r in rand} == {"random"} and {r["queries"] for r in drift} == {"drift"}
    assert all((r["transfer"], r["kernel"]) == ("mapped", "native") for r in bench_gpu.series_rows(res, "streamed"))
    forced = dict(res["streamed"][0], transfer="mapped", kernel="native", read="gather kernel")
    assert forced not in bench_gpu.series_rows(dict(res, streamed=[*res["streamed"], forced]), "streamed")
    bench_gpu.plot(res, tmp_path / "gpu_decode.png")
    assert (tmp_path / "gpu_decode.png").read_bytes().startswith(b"\x89PNG")


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tools.bench_gpu", *args], cwd=REPO_ROOT, capture_output=True,
                          text=True, timeout=120)


def test_cli_help_works_without_a_gpu_and_names_the_new_options() -> None:
    proc = run_cli("--help")
    assert proc.returncode == 0, proc.stderr
    assert "--compressed-breakdown" in proc.stdout and "--drift" in proc.stdout
    text = " ".join(proc.stdout.split())  # argparse wraps at the terminal's width
    assert "--streamed-breakdown" in text and "TILE in blocks" in text
    assert text.startswith("usage: python -m tools.bench_gpu") and "(default build/gpu)" in text


@pytest.mark.parametrize(("args", "message"), [(("--drift", "1.0"), "--drift must be in [0, 1)"),
                                               (("--compressed-breakdown", "16x32k:walk"), "expected a batch"),
                                               (("--streamed-breakdown", "1x32k:0"), "the tile must be 1 to 1024"),
                                               (("--streamed-breakdown", "1x32k:5000"), "the tile must be 1 to 1024")])
def test_cli_refuses_bad_arguments_before_touching_the_device(args: tuple[str, ...], message: str) -> None:
    proc = run_cli(*args)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the run without a CUDA device")
def test_cli_without_a_cuda_device_says_so_and_writes_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = run_cli("--out", str(out), "--sections", "--streamed-breakdown", "1x32k:128")
    assert proc.returncode == 2 and "needs a CUDA device: torch.cuda.is_available() is False" in proc.stderr
    assert "Traceback" not in proc.stderr and not out.exists()


class FakeEngine:
    """Stands in for the engine in compressed mode: a snapshot of counters that grow with each forward."""

    def __init__(self) -> None:
        self.calls = 0

    def snapshot(self) -> dict:
        n = self.calls
        return {"forward_calls": n, "compressed_rows": 16 * n, "union_blocks": 16 * 900 * n,
                "selected_blocks": 16 * 1003 * n, "blocks_admitted": 1440 * n, "blocks_evicted": 1000 * n,
                "blocks_hit": 12960 * n, "info": {}}


@pytest.mark.filterwarnings("ignore:CUDA is not available")
def test_breakdown_profiles_the_steps_and_writes_its_tables_and_summary(tmp_path: Path,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    eng = FakeEngine()
    a = torch.randn(256, 256)

    def step() -> None:
        eng.calls += 1
        (a @ a).sum()

    def setup(batch, ctx, budget, tile_blocks, queries, steps, kernel="native", a=bench_gpu.DRIFT_A):
        assert (batch, ctx, budget, queries, a) == (16, 32768, 2048, "drift", 0.9)
        assert steps >= bench_gpu.COMPRESSED_WARMUP + 2 * 4
        return eng, step, 16048, steps

    monkeypatch.setattr(bench_gpu, "compressed_setup", setup)
    monkeypatch.setattr(bench_gpu.torch.cuda, "synchronize", lambda: None)
    summary = bench_gpu.compressed_breakdown(16, 32768, "drift", tmp_path, a=0.9)
    assert summary["drift_a"] == 0.9
    assert eng.calls == bench_gpu.COMPRESSED_WARMUP + 4 + 4  # warm-up, unprofiled, profiled
    assert summary["union_blocks_per_row"] == 900 and summary["pool_over_batch_union"] == pytest.approx(16048 / 14400)
    assert (summary["admitted_per_step"], summary["evicted_per_step"], summary["hit_per_step"]) == (1440, 1000, 12960)
    assert summary["forward_cpu_ms_per_step"] > 0 and summary["device_ms_per_step"] == 0  # no GPU: no device events
    assert "aten::mm" in [e["name"] for e in summary["top_self_cpu"]]
    text = (tmp_path / summary["file"]).read_text()
    assert summary["file"] == "compressed_breakdown_b16_32k_drift.txt"
    assert "## top 15 by self CPU time" in text and "## top 15 by self CUDA time" in text and "aten::mm" in text
    assert "bench::engine_forward" in text


def test_compressed_decode_keeps_its_keys_and_adds_the_timed_steps_counters(monkeypatch: pytest.MonkeyPatch) -> None:
    eng = FakeEngine()
    warm = 4  # the cold pool: the warm-up calls admit 5x as much as a timed step

    def step() -> None:
        eng.calls += 1

    snapshot = eng.snapshot

    def cold_snapshot() -> dict:
        s = snapshot()
        s["blocks_admitted"] += 4 * 1440 * min(eng.calls, warm)
        return s

    eng.snapshot = cold_snapshot

    def setup(batch, ctx, budget, tile_blocks, queries, steps, kernel="native", a=bench_gpu.DRIFT_A):
        assert steps >= bench_gpu.COMPRESSED_WARMUP + 3 * 4 + 1 + 4  # a new drifting query for every call
        return eng, step, 16048, steps

    def event_ms(fn, calls, reps=5, warmup=3):
        for _ in range(warmup + reps * calls):
            fn()
        return 40.0

    def device_ms(fn, calls):
        for _ in range(calls + 1):
            fn()
        return 30.0

    monkeypatch.setattr(bench_gpu, "compressed_setup", setup)
    monkeypatch.setattr(bench_gpu, "event_ms", event_ms)
    monkeypatch.setattr(bench_gpu, "device_ms", device_ms)
    monkeypatch.setattr(bench_gpu.torch.cuda, "synchronize", lambda: None)
    r = bench_gpu.compressed_decode(16, 32768, 2048, 64, queries="drift", a=0.9)
    assert {"batch", "context", "kernel", "ms", "union_blocks_per_row", "admitted_per_step"} <= set(r)
    assert (r["batch"], r["context"], r["ms"], r["kernel_ms"], r["queries"], r["drift_a"]) == (16, 32768, 40.0, 30.0,
                                                                                                "drift", 0.9)
    w = bench_gpu.COMPRESSED_WARMUP
    assert r["timed_steps"] == 12 and eng.calls == w + 12 + 5
    # every call before the device timing, the cold ones included
    assert r["admitted_per_step"] == pytest.approx(1440 + 4 * 1440 * 4 / (w + 12))
    assert r["admitted_per_step_timed"] == 1440 and r["admitted_union_ratio"] == pytest.approx(1440 / (16 * 900))
    assert (r["evicted_per_step_timed"], r["hit_per_step_timed"]) == (1000, 12960)
    assert r["union_blocks_per_row_timed"] == 900 and r["selected_blocks_per_row_timed"] == 1003
    assert r["pool_blocks"] == 16048 and r["pool_over_batch_union"] == pytest.approx(16048 / 14400)


def test_small_tiles_table_puts_each_way_of_passing_ids_side_by_side() -> None:
    """A row per configuration and tile size: the launch-parameter arm and the uploaded arm of the same tile side by
    side, '-' where an arm was not run; the rate against the ceiling and the tile's own bus time."""
    def row(tile: int, ids: str, ms: float) -> dict:
        return {"batch": 1, "context": 8192, "pool_blocks": 64, "tile_blocks": tile, "ids": ids, "ms": ms,
                "h2d_bytes_per_step": 32 << 20, "tiles_per_step": 1024 // tile, "host_us_per_tile": 40.0}

    res = {"ceilings": {"h2d_GBps": 50.0},
           "small_tiles": [row(32, "in the launch", 0.7), row(32, "uploaded", 1.4), row(64, "in the launch", 0.68)]}
    lines = bench_gpu.small_tiles_table(res)
    assert len(lines) == 4
    rate = (32 << 20) / 0.7e-3 / 1e9 / 50.0
    bus_us = 32 * bench_gpu.BLOCK_BYTES / 50e3
    assert lines[2] == f"| 1 | 8k | 64 | 32 (2) | {bus_us:.0f} | 0.70 | {rate:.2f} | 40 | 1.40 | {rate / 2:.2f} | 40 |"
    assert lines[3].startswith("| 1 | 8k | 64 | 64 (4) |") and lines[3].endswith("| - | - | - |")
