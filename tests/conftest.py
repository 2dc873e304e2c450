"""Shared pytest configuration: the `vllm` marker, and the repository root on sys.path so `tools.*` imports work
under a bare `pytest` as well as `python -m pytest`. Fixtures live next to the tests that use them; the one used by
several files (`model_dir`, the tiny model with its tokenizer) lives here. Every vLLM the tests start, in process or as
a child (which inherits this environment), caches its compiled graphs as tools/vllm_run.py's COMPILE_CACHE_ENV says,
unless the shell that ran pytest chose otherwise.

`make test` runs the suites on pytest-xdist workers, whole files per worker (`--dist loadfile`) in the order
pytest_collection_modifyitems below gives them (`--no-loadscope-reorder`). Each worker keeps its own vLLM cache
(VLLM_CACHE_ROOT/<worker>): two engines compiling the same model at once would otherwise write one cache directory
together. TorchInductor's cache (TORCHINDUCTOR_CACHE_DIR) stays shared: it writes each entry atomically."""

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

from tools.vllm_run import COMPILE_CACHE_ENV, VLLM_CACHE_ROOT  # noqa: E402 (the repository root is on sys.path)

for _key, _value in COMPILE_CACHE_ENV.items():
    os.environ.setdefault(_key, _value)
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("VLLM_CACHE_ROOT", str(VLLM_CACHE_ROOT / os.environ["PYTEST_XDIST_WORKER"]))

# Files that take minutes (real-model engines, servers under load, many vLLM start-ups): they are handed out first in
# their group, so the other worker is not left idle at the end while one of them runs alone.
LONGEST_FIRST = ("test_e2e_real.py", "test_serve_load.py", "test_launcher_vllm.py", "test_backend_series.py")


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
    """Run the files with a `vllm` test after every other file, and in each of those its `vllm` tests last. An
    in-process vLLM engine changes process-wide state that other suites rely on: its CPU worker pins the intra-op
    thread pool (seen here: `torch.set_num_threads(1)` afterwards still reports 2 threads), which the parity suites
    need at one thread. Grouping by file keeps that true on every pytest-xdist worker, which takes whole files in this
    order, each file's tests together. Within each group the LONGEST_FIRST files lead; stable order otherwise."""
    vllm_files = {item.path for item in items if item.get_closest_marker("vllm")}
    first: dict[Path, int] = {}
    for index, item in enumerate(items):
        first.setdefault(item.path, index)

    def key(item: pytest.Item) -> tuple[bool, int, int, bool]:
        heavy = LONGEST_FIRST.index(item.path.name) if item.path.name in LONGEST_FIRST else len(LONGEST_FIRST)
        return item.path in vllm_files, heavy, first[item.path], item.get_closest_marker("vllm") is not None

    items.sort(key=key)


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
