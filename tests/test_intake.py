"""The intake screen's C++ rules on the corpus (tests/intake_corpus), through the public CLI: ``python -m intake scan``.

The corpus is copied to a temporary root with a ``compile_commands.json`` written for it (see its README.md): engine
files get the engine target's kind of flags (no Python or pybind11 on the include path), binding files the Python
and pybind11 headers and ``-DLOAD_FROM_FLAGS(name)=...``. One scan covers the whole corpus; each file is then
checked against its ``// expect: RULE`` markers: exactly those rules, at exactly those lines, nothing else.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CORPUS = REPO / "tests" / "intake_corpus"
MARKER = re.compile(r"//\s*expect:\s*([a-z\-]+(?:\s*,\s*[a-z\-]+)*)\s*$")
CASES = sorted(
    p.relative_to(CORPUS).as_posix() for p in CORPUS.rglob("*") if p.suffix in (".cpp", ".h", ".cu") and p.is_file()
)


def intake(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "intake", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=600
    )


def torch_include() -> str:
    import importlib.util

    spec = importlib.util.find_spec("torch")
    assert spec is not None and spec.submodule_search_locations
    return str(Path(next(iter(spec.submodule_search_locations))) / "include")


def write_compile_commands(root: Path) -> None:
    torch = torch_include()
    entries = []
    for src in sorted(root.rglob("*.cpp")):
        rel = src.relative_to(root).as_posix()
        args = ["c++", "-std=c++17", f"-I{root / 'engine' / 'include'}"]
        if rel.startswith("bindings/"):
            args += [
                f"-I{root / 'bindings' / 'include'}",
                "-isystem",
                sysconfig.get_paths()["include"],
                "-isystem",
                torch,
                "-isystem",
                f"{torch}/torch/csrc/api/include",
                "-DLOAD_FROM_FLAGS(name)=pybind11::module_::import(name)",
            ]
        args += ["-o", f"{rel}.o", "-c", rel]  # relative file: resolved against "directory"
        entries.append({"directory": str(root), "arguments": args, "file": rel})
    (root / "compile_commands.json").write_text(json.dumps(entries, indent=1))


def expected(rel: str) -> set[tuple[str, int]]:
    out = set()
    for n, line in enumerate((CORPUS / rel).read_text().splitlines(), 1):
        m = MARKER.search(line)
        if m:
            out |= {(rule.strip(), n) for rule in m.group(1).split(",")}
    return out


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("intake") / "corpus"
    shutil.copytree(CORPUS, root)
    write_compile_commands(root)
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("intake-cache")


@pytest.fixture(scope="module")
def scan(corpus: Path, cache: Path) -> dict:
    done = intake("scan", "engine", "bindings", "--format", "json", "--cache", str(cache), cwd=corpus)
    assert done.returncode == 1, done.stderr
    return json.loads(done.stdout)


# ------------------------------------------------------------------------------------------------ every corpus case


@pytest.mark.parametrize("rel", CASES)
def test_corpus_case(scan: dict, rel: str) -> None:
    got = {(f["rule"], f["line"]) for f in scan["findings"] if f["path"] == rel}
    assert got == expected(rel), [f for f in scan["findings"] if f["path"] == rel]


def test_corpus_has_every_rule_and_accepted_files() -> None:
    rules = {rule for rel in CASES for rule, _ in expected(rel)}
    assert rules == {"python-in-engine", "python-import-from-cpp", "per-step-python-callback", "parse-error",
                     "request-path-python-call"}
    accepted = [rel for rel in CASES if not expected(rel)]
    assert {"bindings/modules/gil_release.cpp", "bindings/modules/c_api_module_ok.cpp", "engine/src/clean.cpp",
            "engine/src/transitive.cpp", "engine/src/cuda/clean_kernel.cu"} <= set(accepted)


def test_the_corpus_is_parsed_against_shared_preludes(scan: dict) -> None:
    """The findings above come from units parsed against the shared preludes (intake/prelude.py): one for the
    engine's flags, one for the bindings' (c_api_module*.cpp, which define PY_SSIZE_T_CLEAN first, get their own)."""
    assert scan["summary"]["preludes"] == 3


def plan_of(root: Path, files: dict[str, str], main: str) -> tuple[tuple[str, ...], list[str]] | None:
    from intake import prelude

    """The prelude plan of ``main`` in a tree under ``root``/project; ``third/`` files lie outside it (third-party)."""
    project = root / "project"
    for rel, text in files.items():
        path = (root if rel.startswith("third/") else project) / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    flags = ("-I", str(project / "include"), "-isystem", str(root / "third"))
    return prelude.Planner(project).unit(project / main, flags)


def test_a_prelude_holds_the_third_party_includes_and_the_macros_before_them(tmp_path: Path) -> None:
    tree = {
        "third/big.h": "int big();\n",
        "third/cond.h": "int cond();\n",
        "include/proj.h": "#ifndef PROJ_H\n#define PROJ_H\n#include <big.h>\n#define OWN_MACRO 1\n#endif\n",
        "src/a.cpp": '#define PY_SSIZE_T_CLEAN\n#include "proj.h"\n#include <vector>\n#if X\n#include <cond.h>\n#endif\n',
    }
    # <vector> is found in none of the flags' folders and <cond.h> is conditional: both stay in the unit.
    assert plan_of(tmp_path, tree, "src/a.cpp") == (("#define PY_SSIZE_T_CLEAN",), ["<big.h>"])


def test_a_unit_a_lexical_read_cannot_follow_gets_no_prelude(tmp_path: Path) -> None:
    third = {"third/big.h": "int big();\n"}
    macro = {**third, "src/m.cpp": "#define H <big.h>\n#include H\n"}
    assert plan_of(tmp_path / "m", macro, "src/m.cpp") is None
    conditional_define = {**third, "src/d.cpp": "#ifdef Y\n#define Z 1\n#endif\n#include <big.h>\n"}
    assert plan_of(tmp_path / "d", conditional_define, "src/d.cpp") is None
    conditional_project = {**third, "include/p.h": "#include <big.h>\n", "src/p.cpp": '#if Y\n#include "p.h"\n#endif\n'}
    assert plan_of(tmp_path / "p", conditional_project, "src/p.cpp") is None


def test_json_report_shape(scan: dict) -> None:
    assert set(scan) == {"findings", "summary"}
    for f in scan["findings"]:
        assert set(f) == {"rule", "path", "line", "column", "message"}
        assert not Path(f["path"]).is_absolute()
        assert f["line"] >= 1 and f["column"] >= 1
    summary = scan["summary"]
    assert summary["command"] == "scan"
    assert summary["findings"] == len(scan["findings"]) == sum(summary["by_rule"].values())
    assert summary["files_screened"] == len(CASES)


def line_of(rel: str, snippet: str) -> int:
    return next(n for n, line in enumerate((CORPUS / rel).read_text().splitlines(), 1) if snippet in line)


def test_messages_name_the_call_and_the_way_out(scan: dict) -> None:
    def message(rel: str, snippet: str) -> str:
        line = line_of(rel, snippet)
        return next(f["message"] for f in scan["findings"] if (f["path"], f["line"]) == (rel, line))

    pointer = message("bindings/modules/imports_c_api.cpp", "api.import_module(")
    assert pointer.startswith(
        '`api.import_module("vllm.entrypoints.cli.main")` calls PyImport_ImportModule through the pointer '
        "`corpus_c_api::Api::import_module`"
    )
    assert "binding argument" in pointer
    macro = message("bindings/modules/imports_pybind11.cpp", 'LOAD("math")')
    assert macro.startswith('`LOAD("math")` calls pybind11::module_::import (through the macro LOAD)')
    step = message("bindings/modules/per_step_calls.cpp", "return fn(1)")
    assert "binding 'forward'" in step and "corpus_step::indirect -> corpus_step::calls_python" in step
    trampoline = message("bindings/modules/per_step_trampoline.cpp", "PYBIND11_OVERRIDE_PURE")
    assert trampoline.startswith("`PYBIND11_OVERRIDE_PURE(int,Policy,score,block)`")
    assert "corpus_trampoline::Policy::score -> corpus_trampoline::PyPolicy::score" in trampoline
    store = message("bindings/modules/per_step_store.cpp", '"set_hook"')
    assert "binding 'set_hook' takes `std::function<void (int)>`" in store and "corpus_store::Engine::hook_" in store
    kept = message("bindings/modules/c_api_module.cpp", '{"set_on_step"')
    assert kept.startswith("binding 'set_on_step' takes `PyObject *` and stores a Python callable into "
                           "`corpus_c_api_module::Engine::on_step`")
    assert "reached from binding 'forward' at bindings/modules/c_api_module.cpp:" in kept
    member = message("bindings/modules/c_api_module.cpp", '{"progress"')
    assert "`corpus_c_api_module::Engine::progress`" in member and "written by PyMemberDef" in member
    called = message("bindings/modules/c_api_module.cpp", "PyObject_CallObject(")
    assert called.startswith("`PyObject_CallObject(e->on_step,args)` calls PyObject_CallObject: a Python call on the "
                             "per-step path: binding 'forward'")
    broken = message("bindings/modules/broken.cpp", "broken(")
    assert "compile_commands.json entry of bindings/modules/broken.cpp" in broken


def test_text_and_exit_status(corpus: Path, cache: Path) -> None:
    done = intake("scan", "engine/src/includes_python.cpp", "--cache", str(cache), cwd=corpus)
    assert done.returncode == 1
    assert done.stdout.splitlines()[0].startswith("engine/src/includes_python.cpp:2:1: python-in-engine: `Python.h`")
    assert done.stdout.splitlines()[-1] == "intake: 1 finding(s) (python-in-engine 1); 1 file(s) screened, 0 baselined"
    clean = intake("scan", "engine/src/clean.cpp", "--cache", str(cache), cwd=corpus)
    assert (clean.returncode, clean.stdout) == (0, "intake: clean; 1 file(s) screened, 0 baselined\n")


def test_sarif(corpus: Path, cache: Path) -> None:
    rel = "bindings/modules/imports_pybind11.cpp"
    done = intake("scan", rel, "--format", "sarif", "--cache", str(cache), cwd=corpus)
    assert done.returncode == 1
    doc = json.loads(done.stdout)
    assert doc["version"] == "2.1.0"
    run = doc["runs"][0]
    rules = [r["id"] for r in run["tool"]["driver"]["rules"]]
    assert "python-import-from-cpp" in rules and len(rules) == len(set(rules))
    assert run["originalUriBaseIds"]["SRCROOT"]["uri"] == corpus.as_uri() + "/"
    results = run["results"]
    assert len(results) == len(expected(rel))
    for r in results:
        assert rules[r["ruleIndex"]] == r["ruleId"] == "python-import-from-cpp"
        loc = r["locations"][0]["physicalLocation"]
        assert loc["artifactLocation"] == {"uri": rel, "uriBaseId": "SRCROOT"}
        assert loc["region"]["startLine"] >= 1
    prints = [r["partialFingerprints"]["activekvIntake/v1"] for r in results]
    assert len(set(prints)) == len(prints)


def test_warm_scan_comes_from_the_cache(corpus: Path, cache: Path, scan: dict) -> None:
    done = intake("scan", "engine", "bindings", "--format", "json", "--cache", str(cache), cwd=corpus)
    warm = json.loads(done.stdout)
    assert warm["summary"]["parsed"] == 0 and warm["summary"]["from_cache"] > 0
    assert warm["findings"] == scan["findings"]


def test_scan_refuses_what_it_cannot_run(corpus: Path) -> None:
    missing = intake("scan", "no/such/dir", cwd=corpus)
    assert missing.returncode == 2 and "no/such/dir: no such file or folder" in missing.stderr
    bad_db = corpus.parent / "bad_compile_commands.json"
    bad_db.write_text("{not json")
    done = intake("scan", "engine/src/clean.cpp", "--compile-commands", str(bad_db), cwd=corpus)
    assert done.returncode == 2 and "cannot read" in done.stderr
    usage = intake("scan", "--format", "xml", "engine", cwd=corpus)
    assert usage.returncode == 2


def test_bench_prints_cold_and_warm_times(tmp_path: Path) -> None:
    (tmp_path / "bindings").mkdir()
    (tmp_path / "bindings" / "tiny.cpp").write_text("#include <Python.h>\n\nint tiny() { return 1; }\n")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "intake.bench", "bindings", "--root", str(tmp_path), "--warm-runs", "1"],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert re.match(r"cold: +\d+\.\d\d s  \(1 units parsed, 1 files screened, 0 findings\)$", lines[1])
    assert re.match(r"warm: +\d+\.\d\d s  \(0 parsed, 1 from the cache\)  run 1$", lines[2])


def test_an_openmp_entry_parses(tmp_path: Path) -> None:
    """An entry compiled with -fopenmp (the engine's, since at::parallel_for needs it) parses: with _OPENMP, ATen's
    ParallelOpenMP.h includes <omp.h>, which libclang does not have (GCC's copy uses GCC-only attributes), so the
    screen drops -fopenmp and reads ATen's serial branch (the same calls). It once failed CI as a parse error."""
    root = tmp_path / "root"
    (root / "engine" / "src").mkdir(parents=True)
    (root / "engine" / "src" / "par.cpp").write_text(
        "#include <ATen/Parallel.h>\n"
        "void each(int64_t n) { at::parallel_for(0, n, 1, [](int64_t, int64_t) {}); }\n"
    )
    args = ["c++", "-std=c++17", "-fopenmp", "-isystem", torch_include(), "-o", "par.o", "-c", "engine/src/par.cpp"]
    (root / "compile_commands.json").write_text(
        json.dumps([{"directory": str(root), "arguments": args, "file": "engine/src/par.cpp"}])
    )
    done = intake("scan", "engine", cwd=root)
    assert done.returncode == 0 and "intake: clean" in done.stdout, done.stdout + done.stderr


# ------------------------------------------------------------------------------------------- files it will not read


def scan_bounded(root: Path, *paths: str) -> tuple[int, dict]:
    """``scan PATHS --format json`` in a child bounded in time (a hang fails, never hangs) and address space (reading
    /dev/zero fails fast instead of taking the machine's memory); (exit status, report)."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "intake", "scan", *paths, "--format", "json", "--no-cache", "--jobs", "1"],
            cwd=root, env=env, capture_output=True, text=True, timeout=120, preexec_fn=limit,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail(f"intake scan {' '.join(paths)} hung (still running after 120 s)")
    assert done.stdout, f"exit {done.returncode}: {done.stderr}"
    return done.returncode, json.loads(done.stdout)


def unreadable(report: dict) -> list[tuple[str, int, str]]:
    return sorted((f["path"], f["line"], f["message"]) for f in report["findings"] if f["rule"] == "unreadable-file")


@pytest.fixture
def hostile(tmp_path: Path) -> Path:
    """A tree with one clean C++ file; each test adds what it screens."""
    root = tmp_path / "root"
    (root / "engine" / "src").mkdir(parents=True)
    (root / "engine" / "src" / "ok.cpp").write_text("int ok() { return 1; }\n")
    return root


def test_a_fifo_in_a_scanned_folder_is_a_finding_not_a_hang(hostile: Path) -> None:
    os.mkfifo(hostile / "engine" / "src" / "pipe.cpp")
    os.mkfifo(hostile / "engine" / "src" / "notes")
    status, report = scan_bounded(hostile, "engine")
    assert status == 1
    assert unreadable(report) == [
        ("engine/src/notes", 1, "a FIFO: expected a regular file of at most 8388608 bytes; the screen did not read it"),
        ("engine/src/pipe.cpp", 1, "a FIFO: expected a regular file of at most 8388608 bytes; the screen did not read "
         "it"),
    ]
    assert report["summary"]["files_screened"] == 3


def test_a_fifo_named_on_the_command_line_is_a_finding(hostile: Path) -> None:
    os.mkfifo(hostile / "engine" / "src" / "pipe.h")
    status, report = scan_bounded(hostile, "engine/src/pipe.h")
    assert (status, [p for p, _, _ in unreadable(report)]) == (1, ["engine/src/pipe.h"])


def test_a_link_to_dev_zero_named_like_a_header_is_never_read(hostile: Path) -> None:
    (hostile / "engine" / "src" / "zero.h").symlink_to("/dev/zero")
    status, report = scan_bounded(hostile, "engine")
    assert status == 1
    assert unreadable(report) == [
        ("engine/src/zero.h", 1, "a link to /dev/zero, a character device: expected a regular file of at most 8388608 "
         "bytes; the screen did not read it"),
    ]


def test_an_include_of_a_file_it_will_not_read_is_a_finding_and_is_not_parsed(hostile: Path) -> None:
    src = hostile / "engine" / "src"
    (src / "zero.h").symlink_to("/dev/zero")
    os.mkfifo(src / "pipe.h")
    (src / "uses_zero.cpp").write_text('int a();\n#include "zero.h"\n')
    (src / "uses_pipe.cpp").write_text('#  include "pipe.h"\n')
    (src / "uses_dev.cpp").write_text('#include "/dev/zero"\n')
    status, report = scan_bounded(hostile, "engine")
    assert status == 1
    got = [(p, line) for p, line, _ in unreadable(report)]
    assert got == [("engine/src/pipe.h", 1), ("engine/src/uses_dev.cpp", 1), ("engine/src/uses_pipe.cpp", 1),
                   ("engine/src/uses_zero.cpp", 2), ("engine/src/zero.h", 1)]
    message = next(m for p, _, m in unreadable(report) if p == "engine/src/uses_zero.cpp")
    assert message.startswith(f'`#include "zero.h"` opens {src / "zero.h"}: a link to /dev/zero, a character device:')
    assert "libclang did not parse this file" in message


def test_links_are_followed_inside_the_tree_only(hostile: Path) -> None:
    (hostile / "tools").mkdir()
    (hostile / "tools" / "run").write_text("#!/usr/bin/env python3\nprint('run')\n")
    outside = hostile.parent / "outside.h"
    outside.write_text("int outside();\n")
    (hostile / "bindings").mkdir()
    (hostile / "bindings" / "run").symlink_to("../tools/run")  # inside: followed, and read as Python
    (hostile / "bindings" / "outside.h").symlink_to(outside)
    (hostile / "bindings" / "dangling.h").symlink_to("no-such-file.h")
    (hostile / "bindings" / "folder").symlink_to(hostile / "tools")
    status, report = scan_bounded(hostile, "bindings")
    assert status == 1
    assert sorted((f["rule"], f["path"]) for f in report["findings"]) == [
        ("new-python-module", "bindings/run"),
        ("unreadable-file", "bindings/dangling.h"),
        ("unreadable-file", "bindings/folder"),
        ("unreadable-file", "bindings/outside.h"),
    ]
    messages = {p: m for p, _, m in unreadable(report)}
    assert messages["bindings/outside.h"].startswith(f"a link to {outside}, outside the screened tree {hostile}:")
    assert messages["bindings/dangling.h"].startswith("a link to no-such-file.h, which does not exist:")
    assert messages["bindings/folder"].startswith(f"a link to {hostile / 'tools'}, a folder:")


def test_a_file_over_the_size_cap_is_a_finding_never_a_read(hostile: Path) -> None:
    big = hostile / "engine" / "blob.bin"
    with big.open("wb") as f:
        f.truncate(9 << 20)  # sparse: 9 MiB on paper, nothing on disk
    status, report = scan_bounded(hostile, "engine")
    assert status == 1
    assert unreadable(report) == [
        ("engine/blob.bin", 1, "9437184 bytes: expected a regular file of at most 8388608 bytes; the screen did not "
         "read it"),
    ]


def test_a_socket_is_a_finding(hostile: Path) -> None:
    import socket

    sock = socket.socket(socket.AF_UNIX)
    try:
        sock.bind(str(hostile / "engine" / "src" / "s.sock"))
        status, report = scan_bounded(hostile, "engine")
    finally:
        sock.close()
    got = [(p, m.split(":")[0]) for p, _, m in unreadable(report)]
    assert (status, got) == (1, [("engine/src/s.sock", "a socket")])


def test_a_fifo_in_a_patch_series_is_a_finding_and_the_series_is_not_loaded(hostile: Path) -> None:
    series = hostile / "patches" / "vllm" / "v0.32.0"
    series.mkdir(parents=True)
    (series / "series").write_text("0001-x.patch\n")
    (series / "contracts.toml").write_text("")
    os.mkfifo(series / "0001-x.patch")  # the series names it: loading the series would open it and wait
    vllm_src = hostile.parent / "vllm-src"
    (vllm_src / "vllm").mkdir(parents=True)  # never read: the series is refused before its contracts are checked
    status, report = scan_bounded(hostile, "patches", "--vllm-src", str(vllm_src))
    assert status == 1
    assert sorted((f["rule"], f["path"]) for f in report["findings"]) == [
        ("parse-error", "patches/vllm/v0.32.0/series"),
        ("unreadable-file", "patches/vllm/v0.32.0/0001-x.patch"),
    ]
    series_message = next(f["message"] for f in report["findings"] if f["rule"] == "parse-error")
    assert series_message.startswith("the patch series cannot be read: 0001-x.patch: a FIFO: expected a regular file")


def test_a_configuration_file_it_will_not_read_stops_the_screen(hostile: Path) -> None:
    os.mkfifo(hostile / "baseline.fifo")
    os.mkfifo(hostile / "compile_commands.fifo")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for option, fifo, said in [
        ("--baseline", "baseline.fifo", "intake: error: cannot read the baseline: "),
        ("--compile-commands", "compile_commands.fifo", "intake: error: cannot read "),
    ]:
        try:
            done = subprocess.run(
                [sys.executable, "-m", "intake", "scan", "engine", option, fifo, "--no-cache", "--jobs", "1"],
                cwd=hostile, env=env, capture_output=True, text=True, timeout=120,
            )  # fmt: skip
        except subprocess.TimeoutExpired:
            pytest.fail(f"intake scan {option} {fifo} hung (still running after 120 s)")
        assert done.returncode == 2, done.stdout + done.stderr
        assert done.stderr.startswith(said) and f"{fifo}: a FIFO: expected a regular file" in done.stderr
