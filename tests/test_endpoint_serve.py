"""ActiveKV's native endpoint plugin in a running server: `activekv serve` (the native launcher of this build, in
.venv) on the tiny Llama with --api-key, VLLM_PLUGINS left to the launcher, the engine core in its own process, eager
(tests/serving.py `EAGER`: the routes are checked, not the tokens).

Checks that vLLM loads the plugin through its entry point, that GET /activekv/telemetry and /activekv/health answer
with live numbers that move while requests run (and agree with /metrics, which carries the mode and pool gauges too),
that they need no API key while /v1 does (vLLM's /health and /metrics alike), 405 for other methods, a 500 with a
JSON body when the engines' telemetry segments are unavailable while the server keeps serving, that a profile of the
API server process during those calls (py-spy, native frames included) shows the native route code running and no
ActiveKV Python frame, and, last, that once the engine core is killed both routes answer 503 as vLLM's /health does.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests import serving
from tools.make_tiny_model import SPEC, make_tiny_model
from tools.make_tokenizer import make_tokenizer

pytestmark = pytest.mark.vllm

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = REPO / ".venv" / "bin" / "activekv"
PY_SPY = REPO / ".venv" / "bin" / "py-spy"
START_TIMEOUT_S = 600
NUM_LAYERS = SPEC["num_hidden_layers"]
KEY = "activekv-test-key"
POOL_BLOCKS = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    if not LAUNCHER.is_file():
        pytest.skip(f"{LAUNCHER} missing: run `make build patch-vllm`")
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    make_tokenizer(model)
    tmp = tmp_path_factory.mktemp("endpoint")
    segments = tmp / "segments"
    segments.mkdir()
    port, log = serving.free_port(), tmp / "serve.log"
    # vLLM's API server exits within 5 s of its engine's death (watchdog_loop and terminate_if_errored,
    # vllm/entrypoints/launchers/launcher.py:312-333) unless VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1: set, the server
    # stays up after the last test kills the engine core, so its 503s are answered rather than refused.
    env = serving.vllm_env(ACTIVEKV_TELEMETRY_DIR=str(segments), VLLM_KEEP_ALIVE_ON_ENGINE_DEATH="1")
    env.pop("VLLM_PLUGINS", None)  # the launcher's rule for an unset VLLM_PLUGINS is under test
    options = {"activekv": {"pool_blocks": POOL_BLOCKS, "tile_blocks": 4}}
    cmd = [str(LAUNCHER), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
           "--max-model-len", "2048", "--block-size", "16", "--served-model-name", "tiny",
           "--api-key", KEY, *serving.EAGER, "--additional-config", json.dumps(options)]
    with serving.served(cmd, log, env, START_TIMEOUT_S, port) as proc:
        yield {"proc": proc, "port": port, "log": log, "segments": segments, "tmp": tmp}


def get(server: dict, path: str, key: str | None = KEY, method: str = "GET") -> tuple[int, dict, dict]:
    req = urllib.request.Request(f"http://127.0.0.1:{server['port']}{path}", method=method)
    if key is not None:
        req.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def complete(server: dict, prompt: list[int], max_tokens: int) -> dict:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server['port']}/v1/completions", body,
                                 {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def test_the_plugin_is_loaded_through_its_entry_point(server: dict) -> None:
    log = server["log"].read_text(errors="replace")
    assert "Loaded endpoint plugin activekv" in log
    assert "VLLM_PLUGINS is not set" not in log
    # The stat-logger plugin of the same name still loads: /metrics carries the activekv_* families.
    with urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/metrics", timeout=30) as r:
        assert "activekv_forward_calls_total" in r.read().decode()


def test_routes_need_no_api_key_as_vllms_health_and_metrics(server: dict) -> None:
    for path in ("/activekv/telemetry", "/activekv/health"):
        assert get(server, path, key=None)[0] == 200
        assert get(server, path, key="wrong")[0] == 200  # the middleware does not look at them at all
    for path in ("/health", "/metrics"):
        with urllib.request.urlopen(f"http://127.0.0.1:{server['port']}{path}", timeout=30) as r:
            assert r.status == 200
    status, _, body = get(server, "/v1/models", key=None)  # --api-key still guards /v1
    assert status == 401 and body == {"error": "Unauthorized"}
    assert get(server, "/v1/models")[0] == 200
    assert get(server, "/v1/activekv/health")[0] == 404  # nothing left at the old place


def test_other_methods_get_405(server: dict) -> None:
    for method in ("POST", "PUT", "DELETE"):
        status, headers, body = get(server, "/activekv/telemetry", method=method)
        assert status == 405 and headers["allow"] == "GET, HEAD" and body["error"]["code"] == 405


def test_numbers_move_while_requests_run(server: dict) -> None:
    status, _, before = get(server, "/activekv/telemetry")
    assert status == 200 and before["engines"] >= 1 and before["info"]["num_layers"] == NUM_LAYERS
    result: dict = {}
    worker = threading.Thread(target=lambda: result.update(complete(server, list(range(1, 301)), 48)))
    worker.start()
    during: list[tuple[int, dict]] = []
    while worker.is_alive():
        status, _, t = get(server, "/activekv/telemetry")
        h_status, _, h = get(server, "/activekv/health")
        assert status == 200 and h_status == 200, (t, h)
        during.append((t["counters"]["forward_calls"], h))
        time.sleep(0.02)
    worker.join()
    assert result["usage"]["completion_tokens"] == 48
    _, _, after = get(server, "/activekv/telemetry")
    seen = sorted({calls for calls, _ in during})
    assert len(seen) >= 2, f"forward_calls did not move across {len(during)} reads during the request: {seen}"
    assert before["counters"]["forward_calls"] <= seen[0] and seen[-1] <= after["counters"]["forward_calls"]
    d = {k: after["counters"][k] - before["counters"][k] for k in ("build_calls", "forward_calls", "tokens_written")}
    assert d["build_calls"] >= 48 and d["forward_calls"] == NUM_LAYERS * d["build_calls"]
    assert d["tokens_written"] == NUM_LAYERS * (300 + 48 - 1)
    assert after["gauges"]["pool_capacity_blocks"] == POOL_BLOCKS * NUM_LAYERS
    status, _, health = get(server, "/activekv/health")
    assert status == 200 and health["status"] == "ok" and health["mode"] == "exact"
    pool = health["pool"]
    assert pool["capacity_blocks"] == POOL_BLOCKS * NUM_LAYERS and 0 < pool["resident_blocks"] <= pool["capacity_blocks"]
    assert pool["occupancy"] == pytest.approx(pool["resident_blocks"] / pool["capacity_blocks"])
    assert 0 <= health["last_step"]["age_s"] < 120 and health["last_step"]["forward_us"] >= 0
    ages = [h["last_step"]["unix_time"] for _, h in during if h["last_step"]]
    assert len(set(ages)) >= 2  # the last step time moved too
    # The same numbers as the Prometheus families on /metrics (the engine is idle now).
    with urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/metrics", timeout=30) as r:
        metrics = r.read().decode()
    def metric(name: str) -> float:
        return float(next(x for x in metrics.splitlines() if x.startswith(name + "{")).split()[-1])

    assert metric("activekv_forward_calls_total") == after["counters"]["forward_calls"]
    assert metric("activekv_mode") == 0 and metric("activekv_pool_capacity_blocks") == POOL_BLOCKS * NUM_LAYERS
    assert metric("activekv_pool_resident_blocks") == after["gauges"]["pool_resident_blocks"]
    assert metric("activekv_last_step_timestamp_seconds") == after["gauges"]["last_step_unix_us"] * 1e-6
    server["telemetry"] = after
    if os.environ.get("ACTIVEKV_ENDPOINT_OUT"):  # docs/async-native.md's sample responses are captured this way
        Path(os.environ["ACTIVEKV_ENDPOINT_OUT"]).write_text(json.dumps({"telemetry": after, "health": health}))


@pytest.mark.skipif(not PY_SPY.is_file(), reason="py-spy not installed in .venv (pip install py-spy)")
def test_profile_of_the_api_server_shows_native_routes_and_no_activekv_python(server: dict) -> None:
    out = server["tmp"] / "profile.txt"
    spy = subprocess.Popen([str(PY_SPY), "record", "--pid", str(server["proc"].pid), "--native", "--rate", "250",
                            "--duration", "8", "--format", "raw", "--output", str(out)],
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    time.sleep(1.5)
    deadline, calls = time.monotonic() + 5, 0
    while time.monotonic() < deadline:
        for path in ("/activekv/telemetry", "/activekv/health"):
            assert get(server, path)[0] == 200
            calls += 1
    spy_out, _ = spy.communicate(timeout=120)
    assert spy.returncode == 0, spy_out
    stacks: Counter[str] = Counter()
    for line in out.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        stacks[stack] += int(n)
    ours = {s: n for s, n in stacks.items() if "activekv::" in s or "_endpoint" in s or "endpoint.cpp" in s
            or "aw_am_send" in s}
    assert ours, f"no sample of the native route code in {sum(stacks.values())} samples over {calls} calls"
    python_files = {f.split("(")[-1].split(":")[0] for s in stacks for f in s.split(";") if ".py:" in f}
    activekv_python = sorted(f for f in python_files if "activekv" in Path(f).name or "/activekv/" in f)
    assert activekv_python == [], activekv_python
    if os.environ.get("ACTIVEKV_PROFILE_OUT"):
        top = sorted(ours.items(), key=lambda kv: -kv[1])[:5]
        Path(os.environ["ACTIVEKV_PROFILE_OUT"]).write_text(json.dumps(
            {"calls": calls, "samples": sum(stacks.values()), "samples_in_route_code": sum(ours.values()),
             "python_files": sorted(python_files), "activekv_python_files": activekv_python,
             "top_route_stacks": top}, indent=1))


def test_unavailable_telemetry_is_a_json_500_and_the_server_keeps_serving(server: dict) -> None:
    segments: Path = server["segments"]
    away = server["tmp"] / "away"
    away.mkdir(exist_ok=True)
    moved = [shutil.move(str(p), str(away / p.name)) for p in sorted(segments.iterdir())]
    assert moved, "no telemetry segment to move"
    try:
        for path in ("/activekv/telemetry", "/activekv/health"):
            status, headers, body = get(server, path)
            assert status == 500 and headers["content-type"] == "application/json"
            assert body["error"]["type"] == "ActiveKVTelemetryUnavailable" and str(segments) in body["error"]["message"]
        assert complete(server, [1, 2, 3, 4], 4)["usage"]["completion_tokens"] == 4  # vLLM keeps serving
        with urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/health", timeout=30) as r:
            assert r.status == 200
    finally:
        for p in sorted(away.iterdir()):
            shutil.move(str(p), str(segments / p.name))
    status, _, body = get(server, "/activekv/telemetry")
    assert status == 200 and body["counters"]["forward_calls"] > server.get("telemetry", {"counters": {
        "forward_calls": 0}})["counters"]["forward_calls"]


def test_a_dead_engine_is_a_503_as_vllms_health(server: dict) -> None:
    """Last in this module (the server has no engine afterwards): the engine core killed, vLLM's client marks the
    engine dead (its monitor thread sees the process end) and /health answers 503; so do both routes. The server
    outlives its engine only with VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=1 (the fixture sets it); without it vLLM shuts
    the server down within 5 s and these requests would race that shutdown."""
    status, _, body = get(server, "/activekv/telemetry")
    assert status == 200 and len(body["pids"]) == 1, body
    os.kill(body["pids"][0], signal.SIGKILL)  # the engine core: this server's child, started by this test's fixture
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/health", timeout=30).close()
        except urllib.error.HTTPError as e:
            assert e.code == 503
            break
        time.sleep(0.5)
    else:
        pytest.fail("vLLM's /health did not answer 503 within 60 s of the engine core's death")
    for path in ("/activekv/health", "/activekv/telemetry"):
        status, headers, body = get(server, path, key=None)
        assert status == 503 and headers["content-type"] == "application/json", (status, body)
        assert body["error"]["type"] == "EngineDeadError" and body["error"]["code"] == 503
