"""Telemetry across processes (engine/src/telemetry.cpp): shared segments, the process-tree reader, the Prometheus
collector of activekv._telemetry, and the telemetry_json option of the Builder.

Engines run in child processes started by this test (as vLLM's engine core is a child of its API server), each with
its own ACTIVEKV_TELEMETRY_DIR under tmp_path, so other tests' engines and other users of /dev/shm never interfere.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import activekv._backend as backend  # after torch: the modules' import guard needs it
import activekv._telemetry as telemetry

REPO = Path(__file__).resolve().parents[1]

# A child that builds an engine, drives one step on layer 0 (tests/test_telemetry.py's drive), prints READY and
# waits for stdin to close. With DAEMON=1 it double-forks first, so the engine lives in a process that does not
# descend from the test.
CHILD = textwrap.dedent(
    """
    import os, sys
    import torch
    from tests.test_telemetry import make_engine, drive
    if os.environ.get("DAEMON") == "1":
        r, w = os.pipe()
        if os.fork() > 0:
            os.close(w)
            sys.stdout.write(os.read(r, 100).decode())
            sys.stdout.flush()
            os._exit(0)
        os.setsid()
        if os.fork() > 0:
            os._exit(0)
        devnull = os.open(os.devnull, os.O_RDWR)  # let the caller's pipes close: it waits for their EOF
        for fd in (0, 1, 2):
            os.dup2(devnull, fd)
        engine = make_engine()
        cache = drive(engine)
        os.write(w, f"READY {os.getpid()}\\n".encode())
        import time
        time.sleep(float(os.environ.get("HOLD", "30")))
        os._exit(0)
    engine = make_engine()
    cache = drive(engine)
    print("READY", os.getpid(), flush=True)
    sys.stdin.read()
    """
)


def start_child(env: dict[str, str]) -> tuple[subprocess.Popen[str], int]:
    proc = subprocess.Popen([sys.executable, "-c", CHILD], cwd=REPO, env=env, stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    line = proc.stdout.readline()  # type: ignore[union-attr]
    assert line.startswith("READY"), line
    return proc, int(line.split()[1])


@pytest.fixture
def seg_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    monkeypatch.setenv("ACTIVEKV_TELEMETRY_DIR", str(tmp_path))
    return {**os.environ, "ACTIVEKV_TELEMETRY_DIR": str(tmp_path), "PYTHONPATH": str(REPO)}


def child_snapshots(pid: int) -> list[dict]:
    return [s for s in telemetry.process_tree_snapshots() if s["pid"] == pid]


def test_a_child_engine_is_read_from_its_segment_and_gone_when_it_exits(seg_dir: dict[str, str]) -> None:
    proc, pid = start_child(seg_dir)
    try:
        assert telemetry.telemetry_dir() == seg_dir["ACTIVEKV_TELEMETRY_DIR"]
        segments = list(Path(seg_dir["ACTIVEKV_TELEMETRY_DIR"]).glob(f"activekv-telemetry.{pid}.*"))
        assert len(segments) == 1
        assert segments[0].stat().st_mode & 0o777 == 0o600
        (snap,) = child_snapshots(pid)
        assert (snap["build_calls"], snap["kv_update_calls"], snap["forward_calls"]) == (1, 1, 1)
        assert snap["tokens_written"] == 11 and snap["padding_slots"] == 2
        assert snap["histograms"]["forward_latency_us"]["count"] == 1
        assert snap["histograms"]["blocks_admitted_per_forward"]["sum"] == 3.0
        assert snap["info"]["num_layers"] == 2
    finally:
        proc.communicate("", timeout=60)
    assert child_snapshots(pid) == []
    assert list(Path(seg_dir["ACTIVEKV_TELEMETRY_DIR"]).glob(f"activekv-telemetry.{pid}.*")) == []


def test_a_killed_child_segment_is_removed_and_unrelated_processes_are_ignored(seg_dir: dict[str, str]) -> None:
    proc, pid = start_child(seg_dir)
    os.kill(pid, signal.SIGKILL)
    proc.wait(timeout=30)
    assert len(list(Path(seg_dir["ACTIVEKV_TELEMETRY_DIR"]).glob(f"activekv-telemetry.{pid}.*"))) == 1
    assert child_snapshots(pid) == []  # dead: skipped, and its segment removed
    assert list(Path(seg_dir["ACTIVEKV_TELEMETRY_DIR"]).glob(f"activekv-telemetry.{pid}.*")) == []
    daemon = subprocess.run([sys.executable, "-c", CHILD], cwd=REPO, env={**seg_dir, "DAEMON": "1", "HOLD": "600"},
                            stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=120)
    dpid = int(daemon.stdout.split()[1])
    try:
        assert len(list(Path(seg_dir["ACTIVEKV_TELEMETRY_DIR"]).glob(f"activekv-telemetry.{dpid}.*"))) == 1
        assert child_snapshots(dpid) == []  # alive but not a descendant: not ours to report (nor to remove)
        assert len(list(Path(seg_dir["ACTIVEKV_TELEMETRY_DIR"]).glob(f"activekv-telemetry.{dpid}.*"))) == 1
    finally:
        os.kill(dpid, signal.SIGKILL)


def test_collector_exposes_prometheus_families_that_move(seg_dir: dict[str, str]) -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest

    registry = prometheus_client.CollectorRegistry()
    registry.register(telemetry.Collector({"model_name": "tiny"}))

    def value(name: str) -> float:
        return registry.get_sample_value(name, {"model_name": "tiny"}) or 0.0

    forward0, engines0 = value("activekv_forward_calls_total"), value("activekv_engines")
    proc, pid = start_child(seg_dir)
    try:
        assert value("activekv_forward_calls_total") == forward0 + 1
        assert value("activekv_engines") == engines0 + 1
        text = prometheus_client.generate_latest(registry).decode()
        assert "# TYPE activekv_forward_calls_total counter" in text
        assert "# TYPE activekv_forward_latency_seconds histogram" in text
        assert 'activekv_forward_latency_seconds_bucket{le="+Inf",model_name="tiny"}' in text
        assert "# TYPE activekv_host_to_pool_bytes_total counter" in text
        om = openmetrics_latest(registry).decode()  # what a Prometheus server asks for
        assert "# UNIT activekv_forward_latency_seconds seconds" in om and om.endswith("# EOF\n")
        # Buckets are cumulative and the +Inf bucket equals _count.
        le = [registry.get_sample_value("activekv_blocks_admitted_per_forward_bucket", {"model_name": "tiny", "le": b})
              for b in ("1.0", "2.0", "4.0", "+Inf")]
        assert le == sorted(le) and le[-1] == value("activekv_blocks_admitted_per_forward_count")
    finally:
        proc.communicate("", timeout=60)
    assert value("activekv_engines") == engines0


def test_stat_logger_registers_once_with_the_registry_vllm_serves() -> None:
    prometheus_client = pytest.importorskip("prometheus_client")
    registry = prometheus_client.CollectorRegistry()
    config = SimpleNamespace(model_config=SimpleNamespace(served_model_name="tiny"))
    first = telemetry.StatLogger(config, [0], lambda: registry)
    second = telemetry.StatLogger(config, [0], lambda: registry)  # a second AsyncLLM: no DuplicateTimeseries
    assert registry.get_sample_value("activekv_engines", {"model_name": "tiny"}) is not None
    assert first.record(None, None) is None and first.log_engine_initialized() is None
    assert second.collector is not first.collector


# ------------------------------------------------------------------------------------------ telemetry_json option


def vllm_config(options: dict) -> SimpleNamespace:
    model_config = SimpleNamespace(get_num_attention_heads=lambda parallel_config: 4)
    return SimpleNamespace(model_config=model_config, parallel_config=SimpleNamespace(),
                           additional_config={"activekv": options})


SPEC = SimpleNamespace(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32, sliding_window=None)


@pytest.mark.parametrize(
    ("value", "error", "match"),
    [
        (3, TypeError, r"telemetry_json'\] must be a str, got 3"),
        ("", ValueError, r"telemetry_json'\] must be a file path"),
        ("/nonexistent-dir/t.json", ValueError, r"directory '/nonexistent-dir' must exist and be writable"),
    ],
)
def test_telemetry_json_is_validated(value: object, error: type, match: str) -> None:
    with pytest.raises(error, match=match):
        backend.Builder(SPEC, ["l0"], vllm_config({"telemetry_json": value}), torch.device("cpu"))


def test_telemetry_json_is_written_when_the_engine_goes(tmp_path: Path) -> None:
    out = tmp_path / "telemetry.json"
    code = textwrap.dedent(
        f"""
        import gc, torch
        import activekv._backend as backend
        from tests.test_telemetry_publish import SPEC, vllm_config
        b = backend.Builder(SPEC, ["l0", "l1"], vllm_config({{"telemetry_json": {str(out)!r}}}), torch.device("cpu"))
        del b
        gc.collect()
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"counters", "histograms", "info"}
    assert set(data["counters"]) == set(telemetry.COUNTERS)
    assert data["info"]["num_layers"] == 2
    assert data["histograms"]["forward_latency_us"]["le"][-1] == "+Inf"
    assert len(data["histograms"]["forward_latency_us"]["counts"]) == 24


def test_telemetry_json_is_written_at_exit_for_a_live_engine(tmp_path: Path) -> None:
    out = tmp_path / "telemetry.json"
    code = textwrap.dedent(
        f"""
        import torch
        import activekv._backend as backend
        from tests.test_telemetry_publish import SPEC, vllm_config
        keep = backend.Builder(SPEC, ["l0"], vllm_config({{"telemetry_json": {str(out)!r}}}), torch.device("cpu"))
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(out.read_text())["info"]["num_layers"] == 1


def test_telemetry_json_of_a_child_that_ends_with_os_exit_is_written_by_its_ancestor(
    seg_dir: dict[str, str], tmp_path: Path
) -> None:
    # vLLM's engine-core process ends with os._exit: no destructor, no atexit. The segment keeps the final values and
    # the ancestor's reader (the API server's collector) writes the file when it finds the process gone.
    out = tmp_path / "engine-core.json"
    code = textwrap.dedent(
        f"""
        import os, torch
        import activekv._backend as backend
        from tests.test_telemetry_publish import SPEC, vllm_config
        b = backend.Builder(SPEC, ["l0", "l1", "l2"], vllm_config({{"telemetry_json": {str(out)!r}}}),
                            torch.device("cpu"))
        os._exit(0)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=seg_dir, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    assert not out.exists()
    assert len(list(Path(seg_dir["ACTIVEKV_TELEMETRY_DIR"]).glob("activekv-telemetry.*"))) == 1
    telemetry.process_tree_snapshots()
    assert json.loads(out.read_text())["info"]["num_layers"] == 3
    assert list(Path(seg_dir["ACTIVEKV_TELEMETRY_DIR"]).glob("activekv-telemetry.*")) == []
