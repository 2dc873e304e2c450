"""Two `activekv serve` processes side by side (issue 7, item 7): two vLLM servers with ActiveKV on two ports of one
machine, each with its engine core in its own process (vLLM's default), each answering requests, each with its own
telemetry. Both run eager (tests/serving.py `EAGER`): what is checked is that the processes and their telemetry are
separate, and that both give the same tokens.

Memory is kept low: the tiny model, a KV cache of 64 blocks of 16 tokens per layer (`--num-gpu-blocks-override`),
`--max-model-len 512`, `--max-num-seqs 4`. The servers differ in one ActiveKV option (`pool_blocks` 8 and 12) so
that each telemetry file can be told apart by the pool it reports.

Checks:
- both answer at once (two requests in flight on the two servers from two threads) and give the same greedy tokens
  for the same prompt (same model, exact mode);
- separate telemetry: a request sent to one server moves that server's activekv_* counters by exactly its tokens and
  leaves the other's unchanged; each /metrics reports one live engine (its own engine core's);
- at SIGTERM each engine core writes its own `telemetry_json` file with its own pool size, whose counters are that
  server's last scrape and count only the requests sent to that server.
"""

from __future__ import annotations

import json
import re
import signal
import threading
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack
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
POOLS = {"a": 8, "b": 12}
SAMPLE = re.compile(r"^(activekv_[a-z_]+)(\{[^}]*\})? (\S+)$")
COUNTERS = ("activekv_build_calls_total", "activekv_forward_calls_total", "activekv_tokens_written_total")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, dict]]:
    if not LAUNCHER.is_file():
        pytest.skip(f"{LAUNCHER} missing: run `make build patch-vllm`")
    model = make_tiny_model(tmp_path_factory.mktemp("tiny-llama"))
    make_tokenizer(model)
    tmp = tmp_path_factory.mktemp("two-servers")
    env = serving.vllm_env()  # engine core spawned in its own process, 1 GiB KV space cap (64 blocks used)
    out: dict[str, dict] = {}
    with ExitStack() as stack:
        for name, pool in POOLS.items():
            port, log, tjson = serving.free_port(), tmp / f"serve-{name}.log", tmp / f"telemetry-{name}.json"
            options = {"activekv": {"pool_blocks": pool, "tile_blocks": 4, "telemetry_json": str(tjson)}}
            cmd = [str(LAUNCHER), "serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype",
                   "float32", "--max-model-len", "512", "--max-num-seqs", "4", "--block-size",
                   "16", "--num-gpu-blocks-override", "64", "--served-model-name", "tiny",
                   *serving.EAGER, "--additional-config", json.dumps(options)]
            proc = stack.enter_context(serving.served(cmd, log, env, START_TIMEOUT_S, port))
            out[name] = {"proc": proc, "port": port, "log": log, "json": tjson, "pool": pool}
        yield out


def scrape(server: dict) -> dict[str, float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{server['port']}/metrics", timeout=30) as r:
        text = r.read().decode()
    values: dict[str, float] = {}
    for line in text.splitlines():
        m = SAMPLE.match(line)
        if m and m.group(2) == '{model_name="tiny"}':
            values[m.group(1)] = float(m.group(3))
    return values


def complete(server: dict, prompt: list[int], max_tokens: int) -> list[int]:
    body = json.dumps({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "ignore_eos": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(f"http://127.0.0.1:{server['port']}/v1/completions", body,
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        reply = json.loads(r.read())
    assert reply["usage"]["completion_tokens"] == max_tokens
    return list(reply["choices"][0]["token_ids"])


def prompt(seed: int) -> list[int]:
    """200 tokens: longer than either pool. Each request of the telemetry test gets its own prompt: vLLM serves with
    prefix caching on, and a repeated prompt would write only its last partial block."""
    return [(7 * i + 3 * seed + 1) % SPEC["vocab_size"] for i in range(200)]


PROMPT = prompt(0)
TOKENS = 8


def test_two_servers_are_two_processes_with_their_own_engine(servers: dict[str, dict]) -> None:
    a, b = servers["a"], servers["b"]
    assert a["port"] != b["port"] and a["proc"].pid != b["proc"].pid
    assert a["proc"].poll() is None and b["proc"].poll() is None
    for s in (a, b):
        values = scrape(s)
        assert values["activekv_engines"] == 1  # its own engine core only, not the other server's
        assert values["activekv_layers"] == NUM_LAYERS


def test_both_answer_at_once_with_the_same_tokens(servers: dict[str, dict]) -> None:
    replies: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def ask(name: str) -> None:
        try:
            replies[name] = complete(servers[name], PROMPT, TOKENS)
        except BaseException as exc:  # re-raised below, in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=ask, args=(name,)) for name in servers]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors
    assert len(replies["a"]) == TOKENS and replies["a"] == replies["b"]
    servers["a"]["tokens"] = replies["a"]


def test_a_request_moves_only_its_own_servers_telemetry(servers: dict[str, dict]) -> None:
    assert "tokens" in servers["a"], "runs after test_both_answer_at_once_with_the_same_tokens"
    for seed, (target, other) in enumerate((("a", "b"), ("b", "a")), start=1):
        before = {n: scrape(servers[n]) for n in servers}
        assert len(complete(servers[target], prompt(seed), TOKENS)) == TOKENS
        after = {n: scrape(servers[n]) for n in servers}
        moved = {k: after[target][k] - before[target][k] for k in COUNTERS}
        # every layer writes each token once; the last sampled token is never written
        assert moved["activekv_tokens_written_total"] == NUM_LAYERS * (len(PROMPT) + TOKENS - 1), (target, moved)
        assert moved["activekv_build_calls_total"] >= TOKENS
        assert moved["activekv_forward_calls_total"] == NUM_LAYERS * moved["activekv_build_calls_total"]
        assert {k: after[other][k] for k in COUNTERS} == {k: before[other][k] for k in COUNTERS}, other
        servers[target]["last"] = after[target]


def test_each_server_writes_its_own_telemetry_json_at_shutdown(servers: dict[str, dict]) -> None:
    assert all("last" in s for s in servers.values()), "runs after test_a_request_moves_only_its_own_servers_telemetry"
    for s in servers.values():
        s["proc"].send_signal(signal.SIGTERM)
    for s in servers.values():
        s["proc"].wait(timeout=120)
    data = {n: json.loads(s["json"].read_text()) for n, s in servers.items()}
    for n, s in servers.items():
        assert data[n]["info"]["pool_blocks"] == s["pool"]
        assert data[n]["counters"]["build_calls"] == s["last"]["activekv_build_calls_total"]
        assert data[n]["counters"]["tokens_written"] == s["last"]["activekv_tokens_written_total"]
        # two requests of 200 new prompt tokens went to each server (one at once with the other server's, one alone)
        assert data[n]["counters"]["tokens_written"] == 2 * NUM_LAYERS * (len(PROMPT) + TOKENS - 1)
