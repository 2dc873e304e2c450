"""Shared pytest configuration: the `vllm` marker, and the repository root on sys.path so `tools.*` imports work
under a bare `pytest` as well as `python -m pytest`. Fixtures live next to the tests that use them; the one used by
several files (`model_dir`, the tiny model with its tokenizer) lives here. Every vLLM the tests start, in process or as
a child (which inherits this environment), caches its compiled graphs as tools/vllm_run.py's COMPILE_CACHE_ENV says,
unless the shell that ran pytest chose otherwise."""

from __future__ import annotations

import os
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:
    sys.path.insert(0, str(REPO_ROOT))

from tools.vllm_run import COMPILE_CACHE_ENV  # noqa: E402 (the repository root is on sys.path from here)

for _key, _value in COMPILE_CACHE_ENV.items():
    os.environ.setdefault(_key, _value)


@pytest.fixture(autouse=True)
def _environment_restored() -> Iterator[None]:
    """Every test leaves os.environ as it found it. Tools' main() functions set variables before importing vLLM
    (VLLM_LOGGING_LEVEL among them), and a test that calls one in process would otherwise change the environment of
    every vLLM started after it, in process or as a child: the serve tests read vLLM's INFO lines from its log."""
    before = dict(os.environ)
    yield
    for key in set(os.environ) - set(before):
        del os.environ[key]
    for key, value in before.items():
        if os.environ.get(key) != value:
            os.environ[key] = value


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers", "vllm: starts in-process vLLM engines on a local tiny model (deselect with -m 'not vllm')"
    )


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    """Run the `vllm` tests last. An in-process vLLM engine changes process-wide state that other suites rely on: its
    CPU worker pins the intra-op thread pool (seen here: `torch.set_num_threads(1)` afterwards still reports 2
    threads), which the parity suites need at one thread. Stable order otherwise."""
    items.sort(key=lambda item: item.get_closest_marker("vllm") is not None)


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny model (tools/make_tiny_model.py) with a real tokenizer (tools/make_tokenizer.py), so text prompts
    work; a copy, so the tests never write into build/tiny-llama."""
    from tools.make_tiny_model import make_tiny_model
    from tools.make_tokenizer import make_tokenizer

    dest = tmp_path_factory.mktemp("models") / "tiny-llama"
    shutil.copytree(make_tiny_model(REPO_ROOT / "build" / "tiny-llama"), dest)
    make_tokenizer(dest)
    return dest
