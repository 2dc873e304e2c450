"""The vLLM-on-GPU benchmark's CPU-side parts (`tools/bench_gpu_vllm.py`): its plan of engines and cases, the budget's
projections, how step records become rows, the JSON it starts from, the tables, and its refusal without a CUDA
device. The measuring itself needs the device's H200 and the harness (`make gpu-vllm-bench`); nothing here times
anything, and the step records are made up to test the arithmetic, not measured."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tools import bench_gpu_vllm as bench

REPO_ROOT = Path(__file__).resolve().parents[1]


def _default_plan() -> tuple[list[bench.EnginePlan], list[tuple[int, int]]]:
    args = bench.parse_args([])
    return bench.plan_engines(args.contexts, args.batches, args.configs, args.steps, args.max_case_tokens,
                              main=args.main_model)


def test_case_grid_caps_batch_times_context_over_the_limit() -> None:
    runs, capped = bench.case_grid([32768, 8192, 131072], [1, 8], 262144)
    assert runs == [(8192, (8, 1)), (32768, (8, 1)), (131072, (1,))]
    assert capped == [(131072, 8)]
    assert bench.case_grid([131072], [8], 262144) == ([], [(131072, 8)])


def test_request_tokens_keep_one_request_through_every_batch_size() -> None:
    # the prefill's token, then steps + 1 decode steps per batch size the request is part of (largest first)
    assert bench.request_tokens([1, 8], 8) == [19] + [10] * 7
    assert bench.request_tokens([1], 8) == [10]
    assert bench.request_tokens([2, 4, 1], 3) == [13, 9, 5, 5]


def test_default_plan_runs_stock_first_the_breakdown_model_then_activekv_at_128k() -> None:
    plans, capped = _default_plan()
    assert [(p.config, [c for c, _ in p.contexts]) for p in plans] == [
        ("triton", [8192, 32768, 131072]), ("exact-resident", [8192, 32768]), ("exact-streamed", [8192]),
        ("exact-streamed", [32768]), ("compressed", [8192, 32768]), ("triton-heavy", [32768]),
        ("exact-streamed", [131072]), ("exact-resident", [131072]), ("compressed", [131072])]
    assert capped == [(131072, 8)]
    heavy = plans[5]
    assert heavy.spec == bench.HEAVY_MODEL and heavy.spec.kv_bytes_per_token == 128 << 10  # Llama-3-8B's
    assert bench.MAIN_MODEL.kv_bytes_per_token == 16 << 10


def test_engine_sizes_hold_every_request_in_one_prefill_step() -> None:
    plans, _ = _default_plan()
    for plan in plans:
        longest = max(c + max(bench.request_tokens(b, plan.steps)) for c, b in plan.contexts)
        assert plan.max_model_len >= longest and plan.max_model_len % bench.BLOCK == 0
        assert plan.max_num_batched_tokens >= max(max(b) * c for c, b in plan.contexts)
        assert plan.blocks * bench.BLOCK >= max(sum(c + n for n in bench.request_tokens(b, plan.steps))
                                                for c, b in plan.contexts)
        assert plan.kv_cache_bytes == plan.blocks * bench.BLOCK * plan.spec.kv_bytes_per_token
        assert plan.max_num_seqs == max(max(b) for _, b in plan.contexts)
    args = bench.parse_args([])
    assert max(p.max_model_len for p in plans) <= args.max_positions


def test_activekv_options_per_configuration() -> None:
    plans, _ = _default_plan()
    by = {(p.config, p.contexts[0][0]): p for p in plans}
    assert by[("triton", 8192)].activekv_options() is None
    resident = by[("exact-resident", 8192)]
    assert resident.activekv_options() == {"mode": "exact", "pool_blocks": resident.blocks}
    # streamed: a pool of 1/8 of one row's context, tiles of half the pool (at most 256 blocks)
    assert by[("exact-streamed", 8192)].activekv_options() == {"mode": "exact", "pool_blocks": 64, "tile_blocks": 32}
    assert by[("exact-streamed", 32768)].activekv_options() == {"mode": "exact", "pool_blocks": 256,
                                                                 "tile_blocks": 128}
    assert by[("exact-streamed", 131072)].activekv_options() == {"mode": "exact", "pool_blocks": 1024,
                                                                  "tile_blocks": 256}
    assert by[("compressed", 8192)].activekv_options() == {"mode": "compressed", "budget_tokens": 2048,
                                                           "sink_blocks": 1, "recent_blocks": 2}


def test_streamed_tile_of_the_whole_pool_is_asked_for() -> None:
    """--streamed-tile pool: exact-streamed's tiles are its whole pool (at most 256 blocks); the other configurations
    are as before; the JSON's setup records the choice."""
    plans, _ = bench.plan_engines([8192, 32768, 131072], [1], ["exact-streamed", "exact-resident"], 4, 1 << 20,
                                  streamed_tile="pool")
    streamed = {p.contexts[0][0]: p.activekv_options() for p in plans if p.config == "exact-streamed"}
    assert streamed == {8192: {"mode": "exact", "pool_blocks": 64, "tile_blocks": 64},
                        32768: {"mode": "exact", "pool_blocks": 256, "tile_blocks": 256},
                        131072: {"mode": "exact", "pool_blocks": 1024, "tile_blocks": 256}}
    resident = next(p for p in plans if p.config == "exact-resident")
    assert resident.activekv_options() == {"mode": "exact", "pool_blocks": resident.blocks}
    assert bench.parse_args(["--streamed-tile", "pool"]).streamed_tile == "pool"
    assert bench.parse_args([]).streamed_tile == "half"


def test_configs_choose_what_is_planned() -> None:
    plans, capped = bench.plan_engines([8192], [1], ["compressed", "triton"], 4, 1 << 20)
    assert [p.config for p in plans] == ["triton", "compressed"] and capped == []
    plans, _ = bench.plan_engines([8192], [1], ["triton-heavy"], 4, 1 << 20)
    assert [(p.config, p.contexts) for p in plans] == [("triton-heavy", [(32768, (8,))])]


def test_projection_grows_with_the_context_and_streams_over_the_bus() -> None:
    plans, _ = _default_plan()
    by = {(p.config, p.contexts[0][0]): p for p in plans}
    rates = bench.Rates()
    resident = by[("exact-resident", 8192)]
    short = bench.project_context_s(resident, 8192, (8, 1), rates, 50.0)
    long = bench.project_context_s(resident, 32768, (8, 1), rates, 50.0)
    assert long > 4 * (short - 1.0)  # the prefill term is quadratic in the context
    streamed = by[("exact-streamed", 32768)]
    assert (bench.project_context_s(streamed, 32768, (8, 1), rates, 10.0)
            > bench.project_context_s(streamed, 32768, (8, 1), rates, 100.0))


def test_rates_keep_activekv_longest_prefill_and_triton_default() -> None:
    rates = bench.Rates()
    spec = bench.MAIN_MODEL
    assert rates.start_s() == bench.DEFAULT_FIRST_START_S
    rates.starts += [40.0, 6.0, 9.0]
    assert rates.start_s() == 9.0  # the first start (imports, first-time set-up) is not the rule
    rates.record_prefill(bench.ACTIVEKV, 32768, 8, spec, 10.0)
    rates.record_prefill(bench.ACTIVEKV, 8192, 8, spec, 5.0)  # shorter: kept out
    assert rates.prefill_s_per_element[bench.ACTIVEKV] == pytest.approx(10.0 / bench.score_elements(32768, 8, spec))
    rates.record_prefill(bench.TRITON, 32768, 8, spec, 30.0)
    assert rates.prefill_s_per_element[bench.TRITON] == bench.DEFAULT_PREFILL_S_PER_ELEMENT[bench.TRITON]


def _records(batches: tuple[int, ...], steps: int, telemetry: bool = False) -> list[bench.StepRecord]:
    """Made-up step records shaped as run_context makes them: one prefill step, then steps + 1 decode steps per batch
    size, the first of each a slow warm-up (so a median that kept it would show)."""
    def tel(batch: int) -> dict[str, int] | None:
        return {"bytes_h2d": batch * 1_000_000, "forward_calls": 4, "blocks_admitted": batch * 10} if telemetry \
            else None

    recs = [bench.StepRecord(2.0, max(batches), max(batches), True, 1500.0, 1900.0, 4, tel(max(batches)))]
    for batch in sorted(batches, reverse=True):
        recs.append(bench.StepRecord(1.0, batch, batch, False, 900.0, 950.0, 4, tel(batch)))  # warm-up
        recs += [bench.StepRecord(0.010 * batch + 0.001 * i, batch, batch, False, 2.0 * batch, 4.0 * batch, 4,
                                  tel(batch)) for i in range(steps)]
    return recs


def test_summarise_drops_the_warm_up_and_takes_medians_per_batch() -> None:
    rows = bench.summarise(_records((8, 1), 5), (1, 8), bus_GBps=50.0)
    assert [r["batch"] for r in rows] == [8, 1]
    r8, r1 = rows
    assert r8["status"] == r1["status"] == "ok" and r8["steps_timed"] == r1["steps_timed"] == 5
    assert r8["step_ms"] == pytest.approx(82.0) and r1["step_ms"] == pytest.approx(12.0)  # medians of i = 0..4
    assert r8["tokens_per_s"] == pytest.approx(8 / 0.082)
    assert r8["attention_ms"] == 16.0 and r8["forward_ms"] == 32.0 and r8["attention_calls_per_step"] == 4
    assert r8["attention_share"] == pytest.approx(16.0 / 82.0)
    assert r8["prefill_s"] == r1["prefill_s"] == 2.0 and r8["prefill_steps"] == 1 and r8["prefill_prompts"] == 8
    assert "h2d_GBps" not in r8  # stock vLLM: no telemetry


def test_summarise_rates_the_streamed_bytes_over_attention_time() -> None:
    [r1] = bench.summarise(_records((1,), 3, telemetry=True), (1,), bus_GBps=50.0)
    # 1 MB per step over 2 ms of attention: 0.5 GB/s, 1/100 of a 50 GB/s bus
    assert r1["h2d_GBps"] == pytest.approx(0.5) and r1["bus_fraction"] == pytest.approx(0.01)
    assert r1["telemetry_per_step"]["bytes_h2d"] == 1_000_000 and r1["telemetry_per_step"]["selected_blocks"] == 0


def test_summarise_reports_compressed_reads_per_kv_head() -> None:
    recs = _records((1,), 3)
    for r in recs:
        r.telemetry = {"compressed_rows": 4, "selected_blocks": 4 * 8 * 128, "compressed_context_blocks": 4 * 2048}
    [row] = bench.summarise(recs, (1,), bus_GBps=50.0, kv_heads=8)
    assert row["selected_blocks_per_head"] == 128 and row["context_blocks_per_row"] == 2048


def test_summarise_marks_a_batch_size_without_decode_steps() -> None:
    recs = [r for r in _records((8, 1), 3) if r.running != 1]
    rows = bench.summarise(recs, (8, 1), bus_GBps=None)
    assert rows[0]["status"] == "ok"
    assert rows[1]["status"] == "error" and "no decode step at batch 1" in rows[1]["error"]


def test_summarise_leaves_attention_empty_when_no_layer_was_timed() -> None:
    recs = [bench.StepRecord(r.wall_s, r.running, r.outputs, r.prefill, 0.0, None, 0) for r in _records((1,), 3)]
    [row] = bench.summarise(recs, (1,), bus_GBps=None)
    assert row["attention_ms"] is None and row["attention_share"] is None and row["forward_ms"] is None


def _result(tmp_path: Path) -> dict:
    """A result as Run starts it, with made-up rows for the tables: stock and ActiveKV at 32k batch 8, the breakdown
    model, a capped and a skipped case."""
    args = bench.parse_args(["--out", str(tmp_path)])
    run = bench.Run(args, ["--out", str(tmp_path)], bench.Clock(args.budget_s))
    result = run.result
    result["device"], result["bus"] = {"name": "made-up device"}, {"h2d_GBps": 50.0}
    r8 = bench.summarise(_records((8,), 3), (8,), bus_GBps=50.0)[0]
    streamed = bench.summarise(_records((8,), 3, telemetry=True), (8,), bus_GBps=50.0)[0]
    result["cases"] += [
        {"config": "triton", "model": "main", "context": 32768, **r8},
        {"config": "exact-streamed", "model": "main", "context": 32768, **streamed},
        {"config": "triton-heavy", "model": "heavy", "context": 32768, **r8},
        {"config": "exact-resident", "model": "main", "context": 131072, "batch": 8, "status": "capped",
         "reason": "batch x context = 1048576 prompt tokens > --max-case-tokens 262144"},
        {"config": "compressed", "model": "main", "context": 131072, "batch": 1, "status": "skipped",
         "reason": "budget: 128k projected 40 s, 12 s left"},
    ]
    run.write()
    return json.loads((tmp_path / bench.JSON_NAME).read_text())


def test_the_json_holds_the_settings_models_and_rows(tmp_path: Path) -> None:
    result = _result(tmp_path)
    assert result["tool"] == "tools.bench_gpu_vllm" and result["command"].startswith("python -m tools.bench_gpu_vllm")
    assert result["setup"]["contexts"] == [8192, 32768, 131072] and result["setup"]["batches"] == [1, 8]
    assert result["setup"]["budget_s"] == bench.DEFAULT_BUDGET_S and result["setup"]["block_size"] == 16
    assert result["models"]["main"]["kv_bytes_per_token"] == 16 << 10
    assert result["models"]["heavy"]["layers"] == 16 and set(result["configs"]) == set(bench.CONFIGS)
    assert {r["status"] for r in result["cases"]} == {"ok", "capped", "skipped"}
    assert result["elapsed_s"] >= 0 and not (tmp_path / "bench_gpu_vllm.tmp").exists()


def test_tables_show_every_case_and_why_some_have_no_figures(tmp_path: Path) -> None:
    result = _result(tmp_path)
    table = bench.results_table(result)
    assert table[0].startswith("| configuration | context | batch | decode tokens/s |")
    body = table[2:]
    assert len(body) == 4  # the breakdown model has its own table
    # made-up steps of 80, 81 and 82 ms after the warm-up: median 81 ms, 8 / 0.081 s = 98.8 tokens/s
    assert body[0] == "| TRITON_ATTN | 32k | 8 | 98.8 | 81.00 | 16.00 | 0.20 | - | - | 2.0 |  |"
    # the streamed row: attention over stock's, and its bytes' rate over the bus (8 MB / 16 ms = 0.5 GB/s of 50)
    assert body[1] == ("| ActiveKV exact, pool 1/8 of a row | 32k | 8 | 98.8 | 81.00 | 16.00 | 0.20 | 1.00x | "
                       "0.5 (0.01) | 2.0 |  |")
    assert body[2] == ("| ActiveKV compressed 2048 | 128k | 1 | - | - | - | - | - | - | - | skipped: budget: 128k "
                       "projected 40 s, 12 s left |")
    assert body[3] == ("| ActiveKV exact, pool holds the batch | 128k | 8 | - | - | - | - | - | - | - | capped: "
                       "batch x context = 1048576 prompt tokens > --max-case-tokens 262144 |")
    breakdown = bench.breakdown_table(result)
    assert len(breakdown) == 4  # header, rule, the main model and the heavy one
    # step 81, forward 32, attention 16: the rest of the forward 16, outside it 49
    assert breakdown[2].startswith("| 4 layers, 8 query / 8 KV heads of 128")
    assert breakdown[2].endswith("| 16 KiB | 81.00 | 32.00 | 16.00 | 16.00 | 49.00 | 0.20 |")
    assert breakdown[3].endswith("| 128 KiB | 81.00 | 32.00 | 16.00 | 16.00 | 49.00 | 0.20 |")
    text = bench.markdown(result)
    assert "## vLLM decode per case" in text and "## TRITON_ATTN step-time breakdown" in text


def test_parse_args_builds_the_main_model_and_refuses_bad_values(capsys: pytest.CaptureFixture[str]) -> None:
    args = bench.parse_args(["--layers", "2", "--kv-heads", "4", "--group", "2", "--head-size", "64"])
    assert args.main_model == bench.ModelSpec(layers=2, heads=8, kv_heads=4, head_size=64)
    for bad, said in ((["--steps", "0"], "--steps must be at least 1, got 0"),
                      (["--batches", "0"], "--batches must be in [1, 64]"),
                      (["--contexts", "8"], "--contexts must be in [32, 1048576]"),
                      (["--budget-s", "0"], "--budget-s must be positive"),
                      (["--configs", "flash"], "invalid choice: 'flash'"),
                      (["--group", "0"], "--group must be at least 1, got 0")):
        with pytest.raises(SystemExit) as exc:
            bench.parse_args(bad)
        assert exc.value.code == 2 and said in capsys.readouterr().err, bad


def test_cli_without_a_cuda_device_says_so_and_writes_nothing(tmp_path: Path) -> None:
    torch = pytest.importorskip("torch")
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: the CLI would run the benchmark")
    proc = subprocess.run([sys.executable, "-m", "tools.bench_gpu_vllm", "--out", str(tmp_path / "out"),
                           "--models", str(tmp_path / "models")], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 2 and "no CUDA device" in proc.stderr
    assert not (tmp_path / "out").exists()


class _Out:
    def __init__(self, request_id: str) -> None:
        self.request_id = request_id


class _FakeLLMEngine:
    """LLMEngine's calls run_context makes, decoding as vLLM does: the first step samples every request's first
    token, each later one a token for every unfinished request; `fail_at` (context) raises in a step."""

    def __init__(self, fail_at: int | None) -> None:
        self.left: dict[str, int] = {}
        self.fail_at = fail_at
        self.context = 0

    def add_request(self, rid: str, prompt: object, params: object) -> None:
        self.left[rid] = params.max_tokens  # type: ignore[attr-defined]
        self.context = len(prompt["prompt_token_ids"])  # type: ignore[index]

    def has_unfinished_requests(self) -> bool:
        return bool(self.left)

    def get_num_unfinished_requests(self) -> int:
        return len(self.left)

    def abort_request(self, ids: list[str]) -> None:
        for rid in ids:
            self.left.pop(rid, None)

    def step(self) -> list[_Out]:
        if self.context == self.fail_at:
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
        out = [_Out(rid) for rid in self.left]
        self.left = {rid: n - 1 for rid, n in self.left.items() if n > 1}
        return out


class _FakeEngine:
    started: list[str] = []

    def __init__(self, config: object) -> None:
        options = config.activekv or {}  # type: ignore[attr-defined]
        if options.get("mode") == "compressed":
            raise ValueError("additional_config['activekv']: budget_tokens must be ...")
        fail_at = 32768 if "pool_blocks" in options and "tile_blocks" not in options else None
        self.llm = type("LLM", (), {})()
        self.llm.llm_engine = _FakeLLMEngine(fail_at)
        heavy = config.extra["kv_cache_memory_bytes"] > 16 << 30  # type: ignore[attr-defined]

        def collective_rpc(fn: object, args: tuple = ()) -> list[int]:
            if heavy:
                raise AttributeError("'GPUModelRunner' object has no attribute 'get_model'")
            args[0].installed = True  # the timer's wrappers are in place
            return [4]

        self.llm.collective_rpc = collective_rpc
        _FakeEngine.started.append(config.backend)  # type: ignore[attr-defined]

    def close(self) -> None:
        pass


@pytest.fixture
def fake_device(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """main() on made-up parts: a CUDA device that is not there, a vLLM that steps instantly (every ACTIVEKV engine
    with a resident pool fails at 32k, compressed engines fail to start, the breakdown model's timer cannot be
    installed), timings of 1 ms attention per step where the timer is installed."""
    import types

    import torch

    from tools import vllm_run

    vllm = types.ModuleType("vllm")
    vllm.SamplingParams = lambda **kw: types.SimpleNamespace(**kw)  # type: ignore[attr-defined]
    inputs = types.ModuleType("vllm.inputs")
    inputs.TokensPrompt = lambda **kw: kw  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "vllm", vllm)
    monkeypatch.setitem(sys.modules, "vllm.inputs", inputs)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench, "device_facts", lambda: {"name": "made-up device"})
    monkeypatch.setattr(bench, "versions", lambda: {})
    monkeypatch.setattr(bench, "pinned_h2d_GBps", lambda: 50.0)
    monkeypatch.setattr(bench, "make_model", lambda spec, root, positions: root / "model")
    monkeypatch.setattr(bench.StepTimer, "begin", lambda self: None)
    monkeypatch.setattr(bench.StepTimer, "end",
                        lambda self: (1.0, 2.0, 4) if getattr(self, "installed", False) else (0.0, None, 0))
    monkeypatch.setattr(vllm_run, "VllmEngine", _FakeEngine)
    monkeypatch.setattr(vllm_run, "make_prompts", lambda lengths, vocab, seed: [[0] * n for n in lengths])
    counter = iter(range(0, 1 << 40, 1 << 20))
    monkeypatch.setattr(vllm_run, "read_telemetry", lambda: ({"bytes_h2d": next(counter)}, frozenset()))
    _FakeEngine.started = []
    return tmp_path


def test_main_runs_every_engine_and_records_failures_without_stopping(fake_device: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    out = fake_device / "out"
    assert bench.main(["--out", str(out), "--models", str(fake_device / "models")]) == 0
    result = json.loads((out / bench.JSON_NAME).read_text())
    status = {(r["config"], r["context"], r["batch"]): r["status"] for r in result["cases"]}
    assert status[("triton", 32768, 8)] == status[("triton", 131072, 1)] == "ok"
    assert status[("triton", 131072, 8)] == "capped"
    assert status[("exact-resident", 8192, 8)] == "ok" and status[("exact-resident", 32768, 1)] == "error"
    assert status[("exact-streamed", 131072, 1)] == "ok" and status[("triton-heavy", 32768, 8)] == "ok"
    assert {s for (c, _, _), s in status.items() if c == "compressed"} == {"error", "capped"}
    assert len(status) == len(result["cases"])  # one row per configuration, context and batch
    errors = [r for r in result["cases"] if r["status"] == "error"]
    assert any("illegal memory access" in r["error"] for r in errors)
    assert any(r["error"].startswith("engine start: ValueError") for r in errors)
    row = next(r for r in result["cases"] if (r["config"], r["context"], r["batch"]) == ("exact-streamed", 8192, 8))
    # 1 MiB per step (the made-up counter) over 1 ms of attention
    assert row["steps_timed"] == 8 and row["h2d_GBps"] == pytest.approx(1.048576) and row["attention_ms"] == 1.0
    assert result["bus"]["h2d_GBps"] == result["bus"]["h2d_GBps_end"] == 50.0
    # no timer on the breakdown model: its steps are measured, its attention is not, and the engine says why
    heavy = next(r for r in result["cases"] if r["config"] == "triton-heavy")
    assert heavy["status"] == "ok" and heavy["attention_ms"] is None and heavy["forward_ms"] is None
    assert "get_model" in next(e for e in result["engines"] if e["config"] == "triton-heavy")["timer_error"]
    assert [e["config"] for e in result["engines"]][-3:] == ["exact-streamed", "exact-resident", "compressed"]
    printed = capsys.readouterr().out
    assert "\n".join(bench.results_table(result)) in printed and "\n".join(bench.breakdown_table(result)) in printed


def test_main_skips_what_the_budget_cannot_hold(fake_device: Path) -> None:
    out = fake_device / "out"
    assert bench.main(["--out", str(out), "--models", str(fake_device / "models"), "--budget-s", "20"]) == 1
    result = json.loads((out / bench.JSON_NAME).read_text())
    assert {r["status"] for r in result["cases"]} == {"skipped", "capped"} and _FakeEngine.started == []
    assert all(r["reason"].startswith("budget: engine start and") for r in result["cases"] if r["status"] == "skipped")


def test_headlines_quote_only_measured_cases(tmp_path: Path) -> None:
    result = _result(tmp_path)
    h = bench.headlines(result)
    assert h["resident_ms"] is None and h["triton_ms"] == 16.0  # exact-resident at 32k, batch 8 is not in the run
    assert h["streamed_bus"] == [pytest.approx(0.01), pytest.approx(0.01)]
    assert h["shares"] == {"main": pytest.approx(16 / 81), "heavy": pytest.approx(16 / 81)}
    assert bench.headlines({**result, "cases": []}) == {"resident_ms": None, "triton_ms": None, "streamed_bus": None,
                                                         "shares": {}}


def test_docs_render_a_run_and_say_not_yet_measured_without_one(tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    from tools import docs

    empty = docs.gpu_vllm_section(None)
    assert empty[0] == "## vLLM end to end, GPU" and any(line.startswith("**Not yet measured.**") for line in empty)
    assert docs.gpu_vllm_readme_rows(None) == []
    (tmp_path / "run").mkdir()
    result = _result(tmp_path / "run")
    section = docs.gpu_vllm_section(result)
    assert not any("Not yet measured" in line for line in section)
    assert "\n".join(bench.results_table(result)) in "\n".join(section)
    assert "\n".join(bench.breakdown_table(result)) in "\n".join(section)
    assert any(line.startswith("Measured: streaming every block from pinned host memory reaches 0.01 of the pinned "
                               "bus") for line in section)
    [row] = docs.gpu_vllm_readme_rows(result)
    spans = (f"{min(result['setup']['contexts']) // 1024}k-{max(result['setup']['contexts']) // 1024}k, batch "
             + " and ".join(map(str, sorted(result["setup"]["batches"]))))
    assert row[1] == f"streamed from host memory ({spans}): 0.01 of the pinned bus" and row[2] == "vllm-end-to-end-gpu"
    # the row names the card the run measured on, as the run's JSON does
    assert row[0].startswith(f"vLLM decode, {docs.short_device(result['device']['name'])}, 32k context"), row[0]
    # the page with the run committed beside the other data: its section and index row, within the page's rules
    data = tmp_path / "data"
    data.mkdir()
    for name in ("bench_cpu.json", "bench_e2e.json", "bench_gpu.json"):
        (data / name).write_text((docs.DATA / name).read_text())
    (data / docs.GPU_VLLM_DATA).write_text(json.dumps(result))
    monkeypatch.setattr(docs, "DATA", data)
    page = docs.benchmarks_page()
    assert "| [vLLM end to end, GPU](#vllm-end-to-end-gpu) | `make gpu-vllm-bench` | made-up device (device tool) |" \
        in page
    assert len(page.splitlines()) <= 300
    gpu_vllm = page.split("\n## vLLM end to end, GPU\n", 1)[1].split("\n## ", 1)[0].splitlines()
    assert next(i for i, line in enumerate(gpu_vllm) if line.startswith("| ")) <= 20
    assert "vllm-end-to-end-gpu" in docs.readme_results()
