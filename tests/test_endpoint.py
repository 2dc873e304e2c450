"""activekv._endpoint: vLLM's endpoint-plugin contract in C++ (bindings/modules/endpoint.cpp, docs/async-native.md).

The native awaitable is driven by hand (send/throw/close, values forwarded both ways), then by asyncio, then through
Starlette's routing with its TestClient: status codes, JSON bodies, 405, HEAD, the 500 and 503 paths, bad input, and
vLLM's API-key middleware in front (the routes are outside its guarded prefixes, like vLLM's /health and /metrics).
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import textwrap
import types
from argparse import Namespace

import pytest
import torch  # noqa: F401  (the native modules need torch imported first)

import activekv._endpoint as endpoint
import activekv._telemetry as telemetry
from tests.test_telemetry import drive, make_engine

HTTP = {"type": "http", "method": "GET", "path": endpoint.TELEMETRY_PATH, "headers": []}


class Client:
    """What init_state receives in vLLM (an EngineClient); the routes read its `errored` property only."""

    def __init__(self, errored: object = False) -> None:
        self._errored = errored

    @property
    def errored(self) -> bool:
        if isinstance(self._errored, BaseException):
            raise self._errored
        return self._errored


def ready_plugin(client: object = None) -> endpoint.EndpointPlugin:
    plugin = endpoint.EndpointPlugin()
    aw = plugin.init_state(Client() if client is None else client, types.SimpleNamespace(), Namespace())
    with pytest.raises(StopIteration) as stop:
        aw.__await__().send(None)
    assert stop.value.value is None
    assert plugin.initialized
    return plugin


def routes(plugin: endpoint.EndpointPlugin) -> dict[str, endpoint.AsgiRoute]:
    added = {}

    class App:
        def add_route(self, path, route, methods=None, name=None, include_in_schema=True):
            assert methods is None and include_in_schema is False
            added[path] = route

    plugin.attach_router(App())
    return added


@types.coroutine
def suspend(log: list, tag: str, catch: bool = False):
    """A send() awaitable that suspends once: yields `tag` out to whoever drives the coroutine, records what is
    sent back in (or thrown in, when `catch`), and returns it."""
    try:
        got = yield tag
    except ValueError as e:
        if not catch:
            raise
        got = f"caught {e}"
    log.append((tag, got))
    return got


def test_contract_shape() -> None:
    from vllm.plugins.endpoint_plugins.interface import EndpointPlugin

    plugin = endpoint.EndpointPlugin()
    assert isinstance(plugin, EndpointPlugin)  # vLLM's runtime-checkable Protocol
    assert plugin.name == "activekv" and plugin.required_tasks is None and not plugin.initialized
    added = routes(plugin)
    assert set(added) == {"/activekv/telemetry", "/activekv/health"}
    from vllm.entrypoints.serve.middleware.authenticate import GUARDED_PREFIX

    assert not [p for p in added if p.startswith(GUARDED_PREFIX)]  # operational routes: no API key, as /health
    # vLLM's serve_http logs `endpoint.__name__` of every route registered without methods (launcher.py:206).
    assert {r.__name__ for r in added.values()} == {"activekv_telemetry", "activekv_health"}
    assert type(plugin.init_state(None, None, None)) is endpoint.Awaitable


def test_values_are_forwarded_both_ways() -> None:
    log: list = []
    messages: list = []

    def send(message):
        messages.append(message)
        return suspend(log, message["type"])

    aw = routes(ready_plugin())["/activekv/health"](dict(HTTP, method="POST"), None, send)
    it = aw.__await__()
    assert it is aw  # the awaitable is its own iterator
    assert it.send(None) == "http.response.start"  # what send's awaitable yields goes out to the driver
    assert it.send(41) == "http.response.body"     # ... and what the driver sends comes back into it
    with pytest.raises(StopIteration) as stop:
        it.send(42)
    assert stop.value.value is None
    assert log == [("http.response.start", 41), ("http.response.body", 42)]
    start, body = messages
    assert start["status"] == 405 and (b"allow", b"GET, HEAD") in start["headers"]
    error = json.loads(body["body"])["error"]
    assert error["code"] == 405 and "POST" in error["message"] and body["more_body"] is False
    with pytest.raises(RuntimeError, match="already finished"):
        it.send(None)


def test_throw_is_forwarded_into_the_awaited_send() -> None:
    log: list = []
    send = lambda m: suspend(log, m["type"], catch=True)  # noqa: E731
    it = routes(ready_plugin())["/activekv/health"](dict(HTTP, method="PUT"), None, send).__await__()
    assert next(it) == "http.response.start"
    assert it.throw(ValueError("boom")) == "http.response.body"  # caught inside send: the response goes on
    with pytest.raises(StopIteration):
        it.send(None)
    assert log == [("http.response.start", "caught boom"), ("http.response.body", None)]
    # Not caught inside send: it ends the awaitable with that exception.
    it = routes(ready_plugin())["/activekv/health"](dict(HTTP, method="PUT"), None,
                                                         lambda m: suspend([], "x")).__await__()
    next(it)
    with pytest.raises(ValueError, match="again"):
        it.throw(ValueError("again"))
    with pytest.raises(RuntimeError, match="already finished"):
        next(it)


def test_close_closes_the_awaited_send() -> None:
    closed = []

    def send(message):
        def gen():
            try:
                yield "suspended"
            except GeneratorExit:
                closed.append(message["type"])
                raise
        return types.coroutine(gen)()

    it = routes(ready_plugin())["/activekv/health"](dict(HTTP, method="DELETE"), None, send).__await__()
    assert next(it) == "suspended"
    assert it.close() is None
    assert closed == ["http.response.start"]


def test_awaitable_protocol_rejections() -> None:
    plugin = endpoint.EndpointPlugin()
    aw = plugin.init_state(None, None, None)
    aw.__await__()
    with pytest.raises(RuntimeError, match="awaited only once"):
        aw.__await__()
    with pytest.raises(TypeError, match="non-None value"):
        plugin.init_state(None, None, None).send(1)
    with pytest.raises(TypeError, match="cannot create"):
        endpoint.Awaitable()
    it = routes(ready_plugin())["/activekv/health"](dict(HTTP, method="POST"), None, lambda m: 7).__await__()
    with pytest.raises(TypeError, match="not awaitable"):
        next(it)


def test_reentry_is_refused() -> None:
    """Python code run by the awaitable (here: send) may not re-enter it, as a running generator may not be: closing
    it from inside would free the C++ job under its own frame."""
    holder = {}

    def send(message):
        holder["aw"].close()

    aw = holder["aw"] = routes(ready_plugin())["/activekv/health"](dict(HTTP, method="POST"), None, send)
    with pytest.raises(ValueError, match="already executing"):
        aw.send(None)
    with pytest.raises(RuntimeError, match="already finished"):
        aw.send(None)


def test_asyncio_drives_it_with_a_real_event_loop() -> None:
    messages: list = []

    async def send(message):
        await asyncio.sleep(0)  # yields to the loop: the native awaitable must pass that through
        messages.append(message)

    async def main():
        plugin = endpoint.EndpointPlugin()
        assert await plugin.init_state(Client(), types.SimpleNamespace(), Namespace()) is None
        await routes(plugin)["/activekv/health"](dict(HTTP, method="PATCH"), None, send)
        return plugin

    assert asyncio.run(main()).initialized
    assert [m["type"] for m in messages] == ["http.response.start", "http.response.body"]


def test_cancellation_reaches_the_awaited_send() -> None:
    cancelled = []

    async def send(message):
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.append(message["type"])
            raise

    async def main():
        task = asyncio.ensure_future(
            routes(ready_plugin())["/activekv/health"](dict(HTTP, method="POST"), None, send).__await__())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert cancelled == ["http.response.start"]


def test_bad_input_is_a_clear_exception() -> None:
    route = routes(ready_plugin())["/activekv/telemetry"]
    with pytest.raises(TypeError, match="scope must be a dict, got int"):
        route(1, None, lambda m: None)
    with pytest.raises(TypeError, match="send must be callable, got str"):
        route(dict(HTTP), None, "send")
    with pytest.raises(ValueError, match="'http' scopes only, got type 'websocket'"):
        route(dict(HTTP, type="websocket"), None, lambda m: None)
    with pytest.raises(ValueError, match="'method' as a str"):
        route({"type": "http"}, None, lambda m: None)
    with pytest.raises(TypeError, match="add_route"):
        endpoint.EndpointPlugin().attach_router(object())

    def send(message):
        raise OSError("client went away")

    with pytest.raises(OSError, match="client went away"):
        next(route(dict(HTTP), None, send).__await__())


@pytest.fixture()
def app_client():
    from fastapi import FastAPI
    from fastapi.testclient import TestClient

    def make(client: object = None, init: bool = True):
        app = FastAPI()
        plugin = endpoint.EndpointPlugin()
        plugin.attach_router(app)
        if init:
            asyncio.run(_init(plugin, client))
        return TestClient(app)

    async def _init(plugin, client):
        await plugin.init_state(client, types.SimpleNamespace(), Namespace())

    return make


def test_routes_serve_the_process_tree_telemetry(app_client) -> None:
    engine = make_engine()
    cache = drive(engine)
    client = app_client(Client())
    r = client.get("/activekv/telemetry")
    assert r.status_code == 200 and r.headers["content-type"] == "application/json"
    data = r.json()
    assert data["object"] == "activekv.telemetry" and data["engines"] >= 1
    assert set(data) >= {"counters", "histograms", "info", "gauges", "pids"}
    assert data["counters"]["forward_calls"] >= 1
    assert data["counters"]["forward_calls"] == sum(s["forward_calls"] for s in telemetry.process_tree_snapshots())
    h = client.get("/activekv/health")
    assert h.status_code == 200, h.text
    health = h.json()
    assert health["status"] == "ok" and health["mode"] in ("exact", "mixed")
    assert health["pool"]["capacity_blocks"] >= 4 * 2 and health["pool"]["resident_blocks"] >= 3
    assert 0 < health["pool"]["occupancy"] <= 1
    assert health["last_step"]["age_s"] >= 0 and health["last_step"]["forward_us"] >= 0
    head = client.head("/activekv/health")
    assert head.status_code == 200 and head.content == b"" and int(head.headers["content-length"]) > 0
    r = client.post("/activekv/telemetry")
    assert r.status_code == 405 and r.headers["allow"] == "GET, HEAD" and r.json()["error"]["code"] == 405
    # /metrics carries the same mode and pool numbers (the stat logger's collector reads the same segments).
    gauges = {f.name: f.samples[0].value for f in telemetry.Collector().collect() if f.type == "gauge"}
    assert gauges["activekv_mode"] == {"exact": 0, "compressed": 1, "mixed": -1}[health["mode"]]
    assert gauges["activekv_pool_capacity_blocks"] == health["pool"]["capacity_blocks"]
    assert gauges["activekv_pool_resident_blocks"] == health["pool"]["resident_blocks"]
    assert gauges["activekv_last_step_timestamp_seconds"] == pytest.approx(health["last_step"]["unix_time"], abs=1e-6)
    assert gauges["activekv_last_forward_seconds"] == pytest.approx(health["last_step"]["forward_us"] * 1e-6)
    del engine, cache


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_error_paths_answer_json(app_client) -> None:
    r = app_client(init=False).get("/activekv/telemetry")
    assert r.status_code == 500 and r.json()["error"]["type"] == "ActiveKVNotInitialized"
    r = app_client(None).get("/activekv/health")  # vLLM's render server: no engine client
    assert r.status_code == 500 and r.json()["error"]["type"] == "ActiveKVNoEngine"
    for path in ("/activekv/health", "/activekv/telemetry"):  # a dead engine: 503, as vLLM's /health answers
        r = app_client(Client(errored=True)).get(path)
        assert r.status_code == 503 and r.json()["error"] == {
            "message": "vLLM's engine client reports the engine has errored", "type": "EngineDeadError",
            "param": None, "code": 503}
        r = app_client(Client(errored=KeyError("gone"))).get(path)  # also logged as unraisable
        assert r.status_code == 500 and r.json()["error"]["type"] == "InternalServerError"
        assert "gone" in r.json()["error"]["message"]


def test_vllms_api_key_guards_v1_but_not_these_routes() -> None:
    """vLLM's own middleware (what --api-key installs) in front of an app with the routes and a /v1 route: the
    routes answer without the key, as vLLM's /health and /metrics do; /v1 still needs it."""
    from fastapi import FastAPI
    from fastapi.testclient import TestClient
    from vllm.entrypoints.serve.middleware.authenticate import AuthenticationMiddleware

    engine = make_engine()
    cache = drive(engine)
    app = FastAPI()
    app.add_api_route("/v1/models", lambda: {"data": []})
    plugin = endpoint.EndpointPlugin()
    plugin.attach_router(app)
    asyncio.run(_await(plugin.init_state(Client(), types.SimpleNamespace(), Namespace())))
    app.add_middleware(AuthenticationMiddleware, tokens=["secret"])
    client = TestClient(app)
    assert client.get("/v1/models").status_code == 401
    assert client.get("/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200
    for path in ("/activekv/health", "/activekv/telemetry"):
        assert client.get(path).status_code == 200
        assert client.get("/v1" + path).status_code == 401  # the old place is guarded, and gone:
        assert client.get("/v1" + path, headers={"Authorization": "Bearer secret"}).status_code == 404
    del engine, cache


async def _await(aw):
    return await aw


@pytest.mark.parametrize("folder_mode", [None, 0o755])
def test_no_engine_is_a_500_with_json(tmp_path, folder_mode) -> None:
    """A fresh process with no engine and no segment folder, or one not private to this user: snapshot unavailable,
    the message saying what is wrong with the folder."""
    if folder_mode is not None:
        (tmp_path / f"activekv-telemetry-{os.geteuid()}").mkdir(mode=folder_mode)
        os.chmod(tmp_path / f"activekv-telemetry-{os.geteuid()}", folder_mode)
    script = textwrap.dedent("""
        import asyncio, json, sys, types
        import torch
        import activekv._endpoint as endpoint
        plugin = endpoint.EndpointPlugin()
        async def main():
            await plugin.init_state(types.SimpleNamespace(errored=False), None, None)
            out = []
            async def send(m):
                out.append(m)
            route = {}
            plugin.attach_router(types.SimpleNamespace(add_route=lambda p, r, **k: route.__setitem__(p, r)))
            for path in sorted(route):
                await route[path]({"type": "http", "method": "GET"}, None, send)
            return out
        out = asyncio.run(main())
        print(json.dumps([[m["status"] for m in out[0::2]], [json.loads(m["body"]) for m in out[1::2]]]))
    """)
    env = {"ACTIVEKV_TELEMETRY_DIR": str(tmp_path), "PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    statuses, bodies = json.loads(done.stdout)
    assert statuses == [500, 500]
    for body in bodies:
        assert body["error"]["type"] == "ActiveKVTelemetryUnavailable" and str(tmp_path) in body["error"]["message"]
        # what is wrong with the folder, instead of a guess at the backend
        expected = ("does not exist: no engine of this user has published there" if folder_mode is None else
                    "must be a directory owned by uid %d with mode 0700 (not a symbolic link), found mode 0755"
                    % os.geteuid())
        assert expected in body["error"]["message"], body
