"""activekv_* metrics on a running server's /metrics: `activekv serve` (the native launcher of this build, in .venv)
with no ActiveKV flag, the engine core in its own process (vLLM's default), eager (tests/serving.py `EAGER`: the
counters are checked, not the tokens), requests over HTTP.

Checks that the activekv_* families are exposed with Prometheus' conventions, that the native entry counters, tokens
written and the latency histogram move as requests run, and that the telemetry_json option
(`--additional-config '{"activekv": {"telemetry_json": ...}}'`) is written by the engine-core process at shutdown
and agrees with the last scrape.
"""

from __future__ import annotations

import json
import os
import re
import signal
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import serving
from tools.make_tiny_model import SPEC, make_tiny_model
from tools.make_tokenizer import make_tokenizer

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / ".venv" / "bin" / "activekv"
START_TIMEOUT_S = 600
NUM_LAYERS = SPEC["num_hidden_layers"]
POOL_BLOCKS = 8
SAMPLE = re.compile(r"^(activekv_[a-z_]+)(\{[^}]*\})? (\S+)$")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if not LAUNCHER.is_file():
        pytest.skip(f"{LAUNCHER} missing: run `make build patch-vllm`")
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    make_tokenizer(model)
    tmp = tmp_path_factory.mktemp("serve")
    port, log, tjson = serving.free_port(), tmp / "serve.log", tmp / "telemetry.json"
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # spawn the engine core
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    options = {"activekv": {"pool_blocks": POOL_BLOCKS, "tile_blocks": 4, "telemetry_json": str(tjson)}}
    cmd = [str(LAUNCHER), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--block-size", "16", "--served-model-name", "tiny", *serving.EAGER,
           "--additional-config", json.dumps(options)]
    with serving.served(cmd, log, env, START_TIMEOUT_S, port) as proc:
        yield {"proc": proc, "port": port, "log": log, "json": tjson}


def scrape(server: dict) -> tuple[str, dict[str, float]]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/metrics", timeout=30) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m:
            values[m.group(1) + (m.group(2) or "")] = float(m.group(3))
    return text, values


def complete(server: dict, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server['port']}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def get(values: dict[str, float], name: str) -> float:
    return values[f'{name}{{model_name="tiny"}}']


def test_metrics_follow_prometheus_conventions(server: dict) -> None:
    text, values = scrape(server)
    types = dict(re.findall(r"^# TYPE (activekv_\S+) (\S+)$", text, re.M))
    counters = [n for n, t in types.items() if t == "counter"]
    assert len(counters) == 23 and all(n.endswith("_total") for n in counters)
    assert types["activekv_forward_latency_seconds"] == "histogram"
    assert types["activekv_blocks_admitted_per_forward"] == "histogram"
    gauges = ("activekv_engines", "activekv_layers", "activekv_mode", "activekv_pool_resident_blocks",
              "activekv_pool_capacity_blocks", "activekv_last_step_timestamp_seconds", "activekv_last_forward_seconds")
    assert {n: types[n] for n in gauges} == dict.fromkeys(gauges, "gauge")
    assert "activekv_host_to_pool_bytes_total" in types
    assert get(values, "activekv_engines") >= 1  # the engine core, another process, publishes its engine
    assert get(values, "activekv_layers") == NUM_LAYERS
    assert get(values, "activekv_mode") == 0  # exact, the default
    assert get(values, "activekv_pool_capacity_blocks") == POOL_BLOCKS * NUM_LAYERS  # summed over layers
    assert 0 <= get(values, "activekv_pool_resident_blocks") <= get(values, "activekv_pool_capacity_blocks")
    assert 'activekv_forward_latency_seconds_bucket{le="+Inf",model_name="tiny"}' in values


def test_metrics_move_as_requests_run(server: dict) -> None:
    _, before = scrape(server)
    reply = complete(server, list(range(1, 301)), 8)  # 300 tokens: longer than the pool (8 blocks x 16 tokens)
    assert reply["usage"]["completion_tokens"] == 8
    text, after = scrape(server)
    if os.environ.get("ACTIVEKV_SCRAPE_OUT"):  # docs/telemetry.md's sample scrape is captured this way
        Path(os.environ["ACTIVEKV_SCRAPE_OUT"]).write_text(text)
    d = {k: get(after, k) - get(before, k) for k in (
        "activekv_build_calls_total", "activekv_forward_calls_total", "activekv_kv_update_calls_total",
        "activekv_tokens_written_total", "activekv_blocks_admitted_total", "activekv_blocks_evicted_total",
        "activekv_host_to_pool_bytes_total", "activekv_forward_latency_seconds_count")}
    assert d["activekv_build_calls_total"] >= 8  # one prefill + 7 decode steps at least
    assert d["activekv_forward_calls_total"] == NUM_LAYERS * d["activekv_build_calls_total"]
    assert d["activekv_kv_update_calls_total"] == NUM_LAYERS * d["activekv_build_calls_total"]
    assert d["activekv_forward_latency_seconds_count"] == d["activekv_forward_calls_total"]
    # Every layer writes each token once; the last sampled token is never written.
    assert d["activekv_tokens_written_total"] == NUM_LAYERS * (300 + 8 - 1)
    assert d["activekv_blocks_admitted_total"] > 0 and d["activekv_blocks_evicted_total"] > 0
    assert d["activekv_host_to_pool_bytes_total"] > 0
    assert get(after, "activekv_forward_latency_seconds_sum") > get(before, "activekv_forward_latency_seconds_sum")
    server["last"] = after


def test_telemetry_json_is_written_at_shutdown(server: dict) -> None:
    assert "last" in server, "runs after test_metrics_move_as_requests_run"
    proc = server["proc"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(timeout=120)
    data = json.loads(server["json"].read_text())
    assert data["counters"]["build_calls"] == get(server["last"], "activekv_build_calls_total")
    assert data["counters"]["forward_calls"] == get(server["last"], "activekv_forward_calls_total")
    assert data["info"]["num_layers"] == NUM_LAYERS
