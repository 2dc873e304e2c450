"""The conftest guard that restores os.environ after every test (tests/conftest.py `_environment_restored`): a tool's
main() run in process (tests/test_bench_gpu_vllm.py runs tools.bench_gpu_vllm.main, which sets VLLM_LOGGING_LEVEL
before importing vLLM) must not change what the vLLM servers started by later tests log. The two tests run in file
order: the first changes the environment as such a main() does, the second sees it restored."""

from __future__ import annotations

import os

LEAK = "ACTIVEKV_TEST_ENVIRONMENT_GUARD"
_seen: dict[str, str | None] = {}


def test_a_test_that_changes_the_environment() -> None:
    _seen["VLLM_LOGGING_LEVEL"] = os.environ.get("VLLM_LOGGING_LEVEL")
    os.environ[LEAK] = "1"
    os.environ["VLLM_LOGGING_LEVEL"] = "CRITICAL" if _seen["VLLM_LOGGING_LEVEL"] != "CRITICAL" else "DEBUG"
    assert os.environ[LEAK] == "1"


def test_the_next_test_sees_it_restored() -> None:
    assert "VLLM_LOGGING_LEVEL" in _seen, "runs after test_a_test_that_changes_the_environment"
    assert LEAK not in os.environ
    assert os.environ.get("VLLM_LOGGING_LEVEL") == _seen["VLLM_LOGGING_LEVEL"]
