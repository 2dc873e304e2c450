"""``python -m intake check --base REV`` on fixture git repositories: each test makes a small repository, commits a
base, makes one change (committed, staged, unstaged or untracked), and runs the public CLI on it.

C++ fixtures include only ``Python.h`` (or pybind11 where a per-step path needs it) and have no compile database, so
they are parsed with the documented default flags.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SERIES = REPO / "patches" / "vllm" / "v0.32.0"
GIT_ENV = {
    "GIT_AUTHOR_NAME": "intake test",
    "GIT_AUTHOR_EMAIL": "intake@activekv.invalid",
    "GIT_COMMITTER_NAME": "intake test",
    "GIT_COMMITTER_EMAIL": "intake@activekv.invalid",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "GIT_CONFIG_NOSYSTEM": "1",
}

BASE_FILES = {
    "README.md": "fixture\n",
    ".gitignore": "build/\n",
    "intake/baseline.toml": "schema = 1\n",
    "tests/test_a.py": "def test_a():\n    assert True\n",
    "bindings/modules/old.cpp": (
        "#include <Python.h>\n"
        "\n"
        "PyObject* legacy() { return PyImport_ImportModule(\"json\"); }\n"  # committed before: not this change's
    ),
    "bindings/launcher/tool": "#!/bin/sh\necho tool\n",
}


def git(root: Path, *args: str) -> str:
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GIT_")}, **GIT_ENV}
    done = subprocess.run(["git", "-C", str(root), *args], env=env, capture_output=True, text=True, check=True)
    return done.stdout


def write(root: Path, files: dict[str, str]) -> None:
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "repo"
    write(root, BASE_FILES)
    git(root, "init", "-q", "-b", "main")
    git(root, "add", "-A")
    git(root, "commit", "-q", "-m", "base")
    return root


@pytest.fixture(scope="module")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("intake-check-cache")


def check(root: Path, cache: Path, *extra: str) -> tuple[int, dict, str]:
    """Run ``check --base HEAD --repo ROOT --format json``; (exit status, report or {}, stderr)."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "intake", "check", "--base", "HEAD", "--repo", str(root), "--format", "json",
         "--cache", str(cache), *extra],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return done.returncode, (json.loads(done.stdout) if done.stdout else {}), done.stderr


def found(report: dict) -> list[tuple[str, str, int]]:
    return sorted((f["rule"], f["path"], f["line"]) for f in report["findings"])


# ----------------------------------------------------------------------------------------------- new-python-module


def test_untracked_python_module_in_bindings_is_rejected(repo: Path, cache: Path) -> None:
    write(repo, {"bindings/modules/helper.py": "def helper():\n    return 1\n"})
    status, report, _ = check(repo, cache)
    assert status == 1
    assert found(report) == [("new-python-module", "bindings/modules/helper.py", 1)]
    assert report["summary"]["command"] == "check"


def test_pyi_stub_under_bindings_is_rejected(repo: Path, cache: Path) -> None:
    write(repo, {"bindings/activekv/_backend.pyi": "def name() -> str: ...\n"})
    git(repo, "add", "-A")
    status, report, _ = check(repo, cache)
    assert (status, found(report)) == (1, [("new-python-module", "bindings/activekv/_backend.pyi", 1)])


def test_extensionless_file_with_a_python_shebang_is_rejected(repo: Path, cache: Path) -> None:
    write(
        repo,
        {
            "bindings/launcher/activekv-run": "#!/usr/bin/env python3\nprint('run')\n",
            "bindings/launcher/run.sh": "#!/bin/sh\nexec true\n",  # not Python: accepted
        },
    )
    status, report, _ = check(repo, cache)
    assert (status, found(report)) == (1, [("new-python-module", "bindings/launcher/activekv-run", 1)])
    assert "by its Python shebang" in report["findings"][0]["message"]


def test_shebang_turning_a_file_into_python_is_rejected(repo: Path, cache: Path) -> None:
    write(repo, {"bindings/launcher/tool": "#!/usr/bin/python3.11 -u\nprint('tool')\n"})
    status, report, _ = check(repo, cache)
    assert (status, found(report)) == (1, [("new-python-module", "bindings/launcher/tool", 1)])


def test_python_files_in_dev_side_folders_are_accepted(repo: Path, cache: Path) -> None:
    write(
        repo,
        {
            "tests/test_new.py": "def test_new():\n    assert 1 + 1 == 2\n",
            "tools/report.py": "print('report')\n",
            "intake/extra.py": "X = 1\n",
            "release/audit_extra.py": "Y = 2\n",
        },
    )
    status, report, _ = check(repo, cache)
    assert (status, report["findings"]) == (0, [])
    assert report["summary"]["files_screened"] == 4


def test_move_from_tests_into_bindings_is_rejected(repo: Path, cache: Path) -> None:
    (repo / "bindings" / "modules").mkdir(parents=True, exist_ok=True)
    shutil.move(repo / "tests" / "test_a.py", repo / "bindings" / "modules" / "test_a.py")  # no git mv: found anyway
    status, report, _ = check(repo, cache)
    assert (status, found(report)) == (1, [("new-python-module", "bindings/modules/test_a.py", 1)])
    assert "moved here from tests/test_a.py" in report["findings"][0]["message"]


def test_committed_change_is_screened_against_an_older_base(repo: Path, cache: Path) -> None:
    write(repo, {"bindings/modules/committed.py": "X = 1\n"})
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "adds a module")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    done = subprocess.run(
        [sys.executable, "-m", "intake", "check", "--base", "HEAD~1", "--repo", str(repo), "--cache", str(cache)],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 1
    assert done.stdout.startswith("bindings/modules/committed.py:1:1: new-python-module: a Python file (by its ext")


# ------------------------------------------------------------------------------------------------------ C/C++ rules


def test_an_import_added_in_c_is_rejected_and_old_sites_are_out_of_scope(repo: Path, cache: Path) -> None:
    write(repo, {"bindings/modules/new.cpp": '#include <Python.h>\n\nint run() { return PyRun_SimpleString("1"); }\n'})
    status, report, _ = check(repo, cache)
    assert (status, found(report)) == (1, [("python-import-from-cpp", "bindings/modules/new.cpp", 3)])


def test_a_file_that_does_not_parse_is_a_finding(repo: Path, cache: Path) -> None:
    write(repo, {"bindings/modules/bad.cpp": "#include <Python.h>\n\nint broken( { return 1; }\n"})
    status, report, _ = check(repo, cache)
    assert (status, found(report)) == (1, [("parse-error", "bindings/modules/bad.cpp", 3)])
    assert "default flags" in report["findings"][0]["message"]


def test_python_header_added_to_engine_is_rejected(repo: Path, cache: Path) -> None:
    write(repo, {"engine/src/part.cpp": "#include <vector>\n#include <Python.h>\n\nint part() { return 1; }\n"})
    status, report, _ = check(repo, cache)
    assert (status, found(report)) == (1, [("python-in-engine", "engine/src/part.cpp", 2)])


def test_a_new_binding_makes_an_unchanged_python_call_per_step(repo: Path, cache: Path) -> None:
    write(
        repo,
        {
            "bindings/modules/lib.cpp": (
                "#include <pybind11/pybind11.h>\n"
                "\n"
                "int call_it(pybind11::object f) { return f(1).cast<int>(); }\n"
            )
        },
    )
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "a helper no step reaches")
    assert check(repo, cache)[0] == 0
    write(
        repo,
        {
            "bindings/modules/mod.cpp": (
                "#include <pybind11/pybind11.h>\n"
                "\n"
                "int call_it(pybind11::object f);\n"
                "\n"
                "PYBIND11_MODULE(mod, m) { m.def(\"forward\", [](pybind11::object f) { return call_it(f); }); }\n"
            )
        },
    )
    status, report, _ = check(repo, cache)
    assert (status, found(report)) == (1, [("per-step-python-callback", "bindings/modules/lib.cpp", 3)])
    assert "binding 'forward' (bindings/modules/mod.cpp:5)" in report["findings"][0]["message"]


C_API_MODULE = """#include <Python.h>

static PyObject* hook = nullptr;

static PyObject* set_hook(PyObject*, PyObject* fn) {
  Py_XINCREF(fn);
  Py_XDECREF(hook);
  hook = fn;
  Py_RETURN_NONE;
}

static PyObject* step(PyObject*, PyObject* args) { return %s; }

static PyMethodDef methods[] = {
    {"set_hook", set_hook, METH_O, nullptr},
    {"%s", step, METH_VARARGS, nullptr},
    {nullptr, nullptr, 0, nullptr}};
"""


def test_a_new_c_api_module_that_keeps_a_python_object_for_forward_is_rejected(repo: Path, cache: Path) -> None:
    """A module on CPython's C API alone (no pybind11): its PyMethodDef entries are bindings, so a method named
    forward that calls a kept object, and the method that keeps it, are what a pybind11 module's would be."""
    write(repo, {"bindings/modules/hooks.cpp": C_API_MODULE % ("PyObject_CallObject(hook, args)", "forward")})
    status, report, stderr = check(repo, cache)
    assert (status, found(report)) == (1, [("per-step-python-callback", "bindings/modules/hooks.cpp", 12),
                                           ("per-step-python-callback", "bindings/modules/hooks.cpp", 15)]), stderr
    call, store = report["findings"]
    assert "binding 'forward' (bindings/modules/hooks.cpp:16)" in call["message"]
    assert store["message"].startswith("binding 'set_hook' takes `PyObject *` and stores a Python callable into `hook`")


def test_its_benign_twins_are_accepted(repo: Path, cache: Path) -> None:
    """The same module when the kept object is called by a method that is not per-step, or when forward reads only
    its arguments."""
    write(repo, {"bindings/modules/hooks.cpp": C_API_MODULE % ("PyObject_CallObject(hook, args)", "configure"),
                 "bindings/modules/steps.cpp": C_API_MODULE % ("PyLong_FromSsize_t(PyTuple_Size(args))", "forward")})
    status, report, stderr = check(repo, cache)
    assert (status, report["findings"]) == (0, []), stderr


# --------------------------------------------------------------------------------------------------------- baseline

ENTRY = """
[[allow]]
rule = "python-import-from-cpp"
path = "{path}"
call = '{call}'
why = "reviewed"
"""


def test_a_new_baseline_entry_with_its_site_is_a_finding(repo: Path, cache: Path) -> None:
    write(repo, {"bindings/modules/new.cpp": '#include <Python.h>\n\nint run() { return PyRun_SimpleString("1"); }\n'})
    baseline = repo / "intake" / "baseline.toml"
    entry = ENTRY.format(path="bindings/modules/new.cpp", call='PyRun_SimpleString("1")')
    baseline.write_text(baseline.read_text() + entry)
    status, report, _ = check(repo, cache)
    assert (status, found(report)) == (1, [("baseline-change", "intake/baseline.toml", 3)])
    assert report["summary"]["baselined"] == 1


def test_a_baseline_only_change_is_accepted(repo: Path, cache: Path) -> None:
    baseline = repo / "intake" / "baseline.toml"
    baseline.write_text(
        baseline.read_text() + ENTRY.format(path="bindings/modules/old.cpp", call='PyImport_ImportModule("json")')
    )
    status, report, stderr = check(repo, cache)
    assert (status, report["findings"]) == (0, []), stderr


def test_a_baseline_entry_for_no_site_is_stale(repo: Path, cache: Path) -> None:
    baseline = repo / "intake" / "baseline.toml"
    baseline.write_text(
        baseline.read_text() + ENTRY.format(path="bindings/modules/old.cpp", call='PyImport_ImportModule("os")')
    )
    status, report, _ = check(repo, cache)
    assert (status, found(report)) == (1, [("baseline-stale", "intake/baseline.toml", 3)])


def test_a_malformed_baseline_stops_the_screen(repo: Path, cache: Path) -> None:
    (repo / "intake" / "baseline.toml").write_text("schema = 1\n[[allow]]\nrule = 'no-such-rule'\n")
    status, _, stderr = check(repo, cache)
    assert status == 2 and "unknown rule 'no-such-rule'" in stderr


# ------------------------------------------------------------------------------------------------ patch series


@pytest.fixture
def series_repo(repo: Path) -> Path:
    shutil.copytree(SERIES, repo / "patches" / "vllm" / "v0.32.0")
    git(repo, "add", "-A")
    git(repo, "commit", "-q", "-m", "the series")
    return repo


@pytest.fixture(scope="module")
def vllm_src() -> Path:
    from tools import vllm_tree

    return vllm_tree.reference_tree()


def test_a_python_line_without_a_contract_is_rejected(series_repo: Path, cache: Path, vllm_src: Path) -> None:
    patch = next((series_repo / "patches" / "vllm" / "v0.32.0").glob("0002-*.patch"))
    lines = patch.read_text().splitlines(keepends=True)
    hunk = next(i for i, line in enumerate(lines) if line.startswith("@@ -0,0 +1,"))
    count = int(lines[hunk].split("+1,")[1].split(" ")[0])
    lines[hunk] = lines[hunk].replace(f"+1,{count} ", f"+1,{count + 1} ")
    last = max(i for i, line in enumerate(lines) if line.startswith("+") and not line.startswith("+++"))
    lines.insert(last + 1, "+ACTIVEKV_DEBUG = True\n")
    patch.write_text("".join(lines))
    status, report, stderr = check(series_repo, cache, "--vllm-src", str(vllm_src))
    rel = patch.relative_to(series_repo).as_posix()
    assert (status, found(report)) == (1, [("uncited-python-line", rel, last + 2)]), stderr
    assert "has no [[contract]] entry" in report["findings"][0]["message"]


def test_a_stale_citation_is_rejected(series_repo: Path, cache: Path, vllm_src: Path) -> None:
    contracts = series_repo / "patches" / "vllm" / "v0.32.0" / "contracts.toml"
    text = contracts.read_text()
    assert "line = 433\n" in text
    contracts.write_text(text.replace("line = 433\n", "line = 432\n", 1))
    status, report, _ = check(series_repo, cache, "--vllm-src", str(vllm_src))
    patch = next((series_repo / "patches" / "vllm" / "v0.32.0").glob("0001-*.patch"))
    added = next(n for n, line in enumerate(patch.read_text().splitlines(), 1) if line.startswith("+    ACTIVEKV = "))
    assert (status, found(report)) == (1, [("uncited-python-line", patch.relative_to(series_repo).as_posix(), added)])
    assert "stale citation" in report["findings"][0]["message"]


# ----------------------------------------------------------------------------------------- files it will not read


def test_a_link_to_dev_zero_and_an_include_of_a_fifo_are_findings_not_a_hang(repo: Path, cache: Path) -> None:
    """A hang fails (timeout) and reading /dev/zero fails fast (address-space limit) instead of filling memory."""
    import resource

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    (repo / "engine").mkdir()
    (repo / "engine" / "zero.h").symlink_to("/dev/zero")  # git records the link: an added file
    os.mkfifo(repo / "bindings" / "modules" / "pipe.h")  # git never sees a FIFO, but libclang would open it
    write(repo, {"bindings/modules/uses.cpp": 'int uses();\n#include "pipe.h"\n'})
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "intake", "check", "--base", "HEAD", "--repo", str(repo), "--format", "json",
             "--cache", str(cache)],
            cwd=REPO, env=env, capture_output=True, text=True, timeout=120, preexec_fn=limit,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("intake check hung (still running after 120 s)")
    assert done.returncode == 1, done.stderr
    report = json.loads(done.stdout)
    assert found(report) == [
        ("unreadable-file", "bindings/modules/uses.cpp", 2),
        ("unreadable-file", "engine/zero.h", 1),
    ]
    messages = [f["message"] for f in report["findings"]]
    assert messages[0].startswith(f'`#include "pipe.h"` opens {repo.resolve()}/bindings/modules/pipe.h: a FIFO:')
    assert messages[1] == ("a link to /dev/zero, a character device: expected a regular file of at most 8388608 "
                           "bytes; the screen did not read it")


# ------------------------------------------------------------------------------------------- --staged, exit status


def test_staged_screens_the_index_only(repo: Path, cache: Path) -> None:
    write(repo, {"bindings/staged.py": "A = 1\n", "bindings/untracked.py": "B = 2\n"})
    git(repo, "add", "bindings/staged.py")
    status, report, _ = check(repo, cache, "--staged")
    assert (status, found(report)) == (1, [("new-python-module", "bindings/staged.py", 1)])
    write(repo, {"bindings/staged.py": "A = 3\n"})  # an unstaged edit of a staged file: contents would lie
    status, _, stderr = check(repo, cache, "--staged")
    assert status == 2 and "unstaged edits: bindings/staged.py" in stderr


def test_a_clean_change_passes(repo: Path, cache: Path) -> None:
    ok_cpp = "#include <Python.h>\n\nint ok() { return 2; }\n"
    write(repo, {"README.md": "fixture, edited\n", "bindings/modules/ok.cpp": ok_cpp})
    status, report, _ = check(repo, cache)
    assert (status, report["findings"], report["summary"]["files_screened"]) == (0, [], 2)


def test_an_unknown_base_or_no_repository_cannot_run(repo: Path, tmp_path: Path, cache: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(REPO)}

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "intake", "check", *args], cwd=REPO, env=env, capture_output=True, text=True
        )

    bad_rev = run("--base", "no-such-rev", "--repo", str(repo))
    assert bad_rev.returncode == 2 and "unknown base revision 'no-such-rev'" in bad_rev.stderr
    plain = tmp_path / "plain"
    plain.mkdir()
    no_repo = run("--base", "HEAD", "--repo", str(plain))
    assert no_repo.returncode == 2 and "is not inside a git repository" in no_repo.stderr


def test_the_pre_commit_hook_screens_the_staged_change(repo: Path, cache: Path) -> None:
    import yaml

    hooks = yaml.safe_load((REPO / ".pre-commit-hooks.yaml").read_text())
    hook = next(h for h in hooks if h["id"] == "activekv-intake")
    assert (hook["language"], hook["pass_filenames"]) == ("script", False)
    entry = REPO / hook["entry"]
    assert os.access(entry, os.X_OK)
    write(repo, {"bindings/hooked.py": "A = 1\n"})
    git(repo, "add", "-A")
    env = {**os.environ, "ACTIVEKV_INTAKE_PYTHON": sys.executable, "ACTIVEKV_INTAKE_CACHE": str(cache)}
    done = subprocess.run([str(entry)], cwd=repo, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 1, done.stderr
    assert done.stdout.startswith("bindings/hooked.py:1:1: new-python-module: ")
