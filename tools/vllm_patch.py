"""The dev side of ActiveKV's vLLM patch series: its one reader, and ``export``.

Usage::

    python -m tools.vllm_patch export --from GIT_TREE [--base REV] [--patches DIR]

Applying, checking, reverting and reporting the series on a vLLM tree is the native launcher's
(``activekv patch apply|check|revert|status [--vllm DIR] [--patches DIR]``, bindings/launcher/, series/;
``make patch-vllm`` / ``make unpatch-vllm`` call it): this module applies nothing itself.

- :class:`Series` reads a series folder (``series`` names the ``000N-*.patch`` files, one a line) with the launcher's
  rules; release/audit.py, tools/contracts.py, tools/census.py and intake/ read the series through it.
- :func:`materialize` gives the dev-side checks both sides of the files the series touches, made by the launcher.
- ``export``: maintainers only: ``git format-patch`` the commits ``BASE..HEAD`` of an edited copy of the reference
  tree (tools/vllm_tree.py) into the patch directory and rewrite its ``series`` file.

Exit codes: 0 done, 1 failed (the message says why), 2 bad usage.
"""

from __future__ import annotations

import argparse
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
    """An option's DIR: ``Path("")`` is the current directory, never what an empty ``--patches=`` meant."""
    if not value:
        raise argparse.ArgumentTypeError("needs DIR, got an empty value")
    return Path(value)


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


def launcher() -> Path:
    """The native ``activekv`` launcher: the one beside this interpreter (where ``make build`` and a wheel put it),
    else the first on ``PATH``."""
    beside = Path(sys.executable).parent / "activekv"
    found = beside if beside.is_file() else (Path(p) if (p := shutil.which("activekv")) else None)
    if found is None:
        raise PatchError(f"no activekv launcher at {beside} or on PATH; run `make build`")
    return found


def activekv_patch(command: str, root: Path, series: Series) -> subprocess.CompletedProcess[str]:
    """``activekv patch COMMAND --vllm ROOT --patches SERIES`` (output captured; the caller reads the exit code)."""
    return subprocess.run(
        [str(launcher()), "patch", command, "--vllm", str(root), "--patches", str(series.directory)],
        capture_output=True,
        text=True,
        timeout=300,
    )


def series_state(root: Path, series: Series) -> str:
    """``applied``, ``not applied`` or ``partially applied``: the first line of ``activekv patch status``."""
    done = activekv_patch("status", root, series)
    first = done.stdout.partition("\n")[0]
    for state in ("applied", "not applied", "partially applied"):
        if first.startswith(f"{state}: "):
            return state
    raise PatchError(f"activekv patch status on {root} said {(done.stdout + done.stderr).strip()!r}")


def materialize(root: Path, series: Series, dest: Path) -> tuple[Path, Path]:
    """Copy the series' files from ``root`` into ``dest/original`` and ``dest/patched`` (each holding ``vllm/...``).

    ``root`` may be unpatched or patched (it is only read); the missing side is made by ``activekv patch apply`` or
    ``revert`` on the copy. Returns the two roots.
    """
    original, patched = dest / "original", dest / "patched"
    state = series_state(root, series)
    if state == "partially applied":
        raise PatchError(f"the series is partially applied at {root}; revert or apply it first")
    here, there = (patched, original) if state == "applied" else (original, patched)
    for rel in series.touched_files() + ["vllm/__init__.py", "vllm/_version.py"]:
        if (root / rel).is_file():
            (here / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, here / rel)
    shutil.copytree(here, there)
    done = activekv_patch("revert" if state == "applied" else "apply", there, series)
    if done.returncode != 0:
        raise PatchError(f"cannot materialise the series from {root}:\n{(done.stdout + done.stderr).strip()}")
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
    parser.add_argument("command", choices=["export"])
    parser.add_argument("--patches", metavar="DIR", type=_dir_arg, default=DEFAULT_PATCHES,
                        help="patch series directory")
    parser.add_argument("--from", dest="work", metavar="GIT_TREE", type=_dir_arg, required=True,
                        help="the edited git tree")
    parser.add_argument("--base", metavar="REV", help="the unpatched commit (default: the root commit)")
    args = parser.parse_args(argv)
    try:
        print(export(args.work.resolve(), args.base, args.patches.resolve()))
    except (PatchError, subprocess.CalledProcessError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
