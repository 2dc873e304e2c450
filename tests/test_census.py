"""tools.census: the dispatch census of the patch series (every call site in the Python it adds, and its callee)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools import vllm_tree  # noqa: E402
from tools import census  # noqa: E402
from tools.vllm_patch import DEFAULT_PATCHES  # noqa: E402


@pytest.fixture(scope="module")
def ref() -> Path:
    return vllm_tree.reference_tree()


def cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "tools.census", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=300)


def test_census_of_the_series(ref: Path) -> None:
    done = cli("--vllm-src", str(ref), "--format", "json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    sites = report["sites"]
    native = [s for s in sites if s["native"]]
    assert report["summary"] == f"{len(native)} of {len(sites)} dispatch sites are direct native calls"
    assert report["problems"] == []
    # Every call the two delegate modules make is native and resolves to a compiled callable of activekv.
    for s in sites:
        if s["file"] in ("vllm/v1/attention/backends/activekv.py", "vllm/v1/metrics/activekv.py"):
            assert s["native"] and s["resolved"].startswith("activekv._"), s
    assert {s["resolved"] for s in native} >= {
        "activekv._backend.Impl.forward", "activekv._backend.Impl.do_kv_cache_update",
        "activekv._backend.Builder.build", "activekv._telemetry.StatLogger", "activekv._telemetry.StatLogger.record",
    }
    # The exceptions: 0003's routing lines, each justified in contracts.toml.
    exceptions = [s for s in sites if not s["native"]]
    assert exceptions and all(s["file"] == "vllm/platforms/cpu.py" and s["why"] for s in exceptions)
    assert {s["callee"] for s in exceptions} == {
        "selected_backend.get_class", "backend.validate_configuration", "attn_selector_config._asdict", "ValueError",
        "selected_backend.get_path",
    }


def test_census_text_prints_the_count_and_the_exceptions(ref: Path) -> None:
    done = cli("--vllm-src", str(ref))
    assert done.returncode == 0, done.stdout + done.stderr
    assert re.search(r"^\d+ of \d+ dispatch sites are direct native calls$", done.stdout, re.M)
    assert "not direct native calls:\n  vllm/platforms/cpu.py:" in done.stdout


def broken_copy(tmp_path: Path, patch_old: str, patch_new: str, toml_old: str, toml_new: str) -> Path:
    patches = tmp_path / "patches"
    shutil.copytree(DEFAULT_PATCHES, patches)
    for p in patches.glob("*.patch"):
        p.write_text(p.read_text().replace(patch_old, patch_new))
    toml = patches / "contracts.toml"
    text = toml.read_text()
    assert toml_old in text
    toml.write_text(text.replace(toml_old, toml_new))
    return patches


def test_an_unjustified_exception_fails(ref: Path, tmp_path: Path) -> None:
    patches = tmp_path / "patches"
    shutil.copytree(DEFAULT_PATCHES, patches)
    toml = patches / "contracts.toml"
    lines = toml.read_text().splitlines()
    kept = [line for line in lines if not line.startswith('dispatch = "Builds the exception')]  # raise ValueError(...)
    assert len(kept) == len(lines) - 1
    toml.write_text("\n".join(kept) + "\n")
    done = cli("--vllm-src", str(ref), "--patches", str(patches))
    assert done.returncode == 1
    assert "vllm/platforms/cpu.py:154: ValueError is not a direct native call" in done.stdout


def test_a_native_looking_callee_that_is_not_compiled_fails(ref: Path, tmp_path: Path) -> None:
    old = "return self._native.log_engine_initialized()"
    new = "return self._native.no_such_method()"
    patches = broken_copy(tmp_path, old, new, f'line = "{old}"', f'line = "{new}"')
    done = cli("--vllm-src", str(ref), "--patches", str(patches))
    assert done.returncode == 1
    assert "self._native.no_such_method does not resolve to a compiled callable" in done.stdout


def test_is_compiled_tells_native_from_python() -> None:
    import torch  # noqa: F401

    import activekv._backend as backend

    assert census._is_compiled(backend.name) and census._is_compiled(backend.Impl.forward)
    assert census._is_compiled(backend.Builder)
    assert not census._is_compiled(lambda: None)
    assert not census._is_compiled(census.Site)


def test_census_reports_the_endpoint_plugin_contract(ref: Path) -> None:
    done = cli("--vllm-src", str(ref), "--format", "json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    members = {m["member"]: m for m in report["endpoint"]}
    assert report["endpoint_summary"].startswith("4 of 4 endpoint-plugin contract members met natively")
    # Every member of vLLM's EndpointPlugin protocol, with the interface line that declares it.
    assert {k: (m["kind"], m["how"]) for k, m in members.items() if not k.startswith("route")} == {
        "name": ("attribute", "native"), "required_tasks": ("attribute", "native"),
        "attach_router": ("method", "native"), "init_state": ("async method", "async protocol ported to native"),
    }
    assert all(re.fullmatch(r"vllm/plugins/endpoint_plugins/interface\.py:\d+", m["cites"])
               for k, m in members.items() if not k.startswith("route"))
    assert members["route /activekv/telemetry"]["how"] == members["route /activekv/health"]["how"] == \
        "native ASGI app"


class PythonPlugin:
    """A plugin written in Python, as the census must not count as native."""

    name = "py"
    required_tasks = None

    def attach_router(self, app):
        app.add_route("/v1/py", lambda scope, receive, send: None)

    async def init_state(self, engine_client, state, args):
        return None


def test_census_flags_a_python_endpoint_plugin(ref: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[project.entry-points."vllm.endpoint_plugins"]\npy = "tests.test_census:PythonPlugin"\n')
    monkeypatch.setattr(census, "PYPROJECT", pyproject)
    members, problems = census.endpoint_census(ref)
    assert {m.member: m.how.split(":")[0] for m in members} == {
        "name": "NOT native", "required_tasks": "NOT native", "attach_router": "NOT native",
        "init_state": "NOT native", "route /v1/py": "NOT native"}
    assert any("not a compiled callable" in p for p in problems)
