"""What changed between a base revision and the work tree (or the index), through gitpython.

The work tree is compared as git would commit it after ``git add -A``: uncommitted and untracked files included,
ignored files left out, renames and copies followed (``-M -C``). That is done in a temporary index (a copy of the
real one, ``GIT_INDEX_FILE``), so the user's index is never touched. ``--staged`` compares the real index instead
(what pre-commit is about to commit) and refuses to run when a staged file also has unstaged edits, since the
screen reads file contents from the work tree.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import git

from intake import files


class GitError(Exception):
    """Not a repository, an unknown revision, a git failure (the tool cannot run: exit 2)."""


@dataclass(frozen=True)
class Change:
    status: str  # A (added), M (modified), T (type changed), R (renamed), C (copied), D (deleted)
    path: str  # new path ('/'-separated, relative to the repository root)
    old_path: str | None = None  # R and C: where it came from


@dataclass
class Diff:
    root: Path
    base: str  # the resolved base commit
    changes: list[Change]
    repo: git.Repo

    def _blob(self, rel: str) -> git.Blob | None:
        try:
            blob = self.repo.commit(self.base).tree / rel
        except KeyError:
            return None
        return blob if isinstance(blob, git.Blob) else None

    def base_head(self, rel: str, size: int) -> bytes | None:
        """The first ``size`` bytes of the file at the base revision, or None when it was no file there."""
        blob = self._blob(rel)
        return None if blob is None else blob.data_stream.read(size)

    def base_text(self, rel: str) -> str | None:
        """The file's content at the base revision, or None when it was no file there; ``files.Refused`` when it
        is bigger than ``files.MAX_FILE_BYTES`` (its size is read from git's object header, the content never)."""
        blob = self._blob(rel)
        if blob is None:
            return None
        if blob.size > files.MAX_FILE_BYTES:
            raise files.Refused(f"{self.base}:{rel}: {blob.size} bytes, expected at most {files.MAX_FILE_BYTES}")
        return blob.data_stream.read().decode("utf-8", "replace")


def _parse_name_status(out: str) -> list[Change]:
    fields = out.split("\0")
    changes = []
    i = 0
    while i < len(fields) and fields[i]:
        status = fields[i]
        kind = status[0]
        if kind in ("R", "C"):
            changes.append(Change(kind, fields[i + 2], fields[i + 1]))
            i += 3
        else:
            changes.append(Change(kind, fields[i + 1]))
            i += 2
    return changes


def diff(repo_dir: Path, base: str, staged: bool) -> Diff:
    try:
        repo = git.Repo(repo_dir, search_parent_directories=True)
    except (git.InvalidGitRepositoryError, git.NoSuchPathError) as e:
        raise GitError(f"{repo_dir} is not inside a git repository") from e
    if repo.working_tree_dir is None:
        raise GitError(f"{repo_dir}: a bare repository has no work tree to screen")
    root = Path(repo.working_tree_dir).resolve()
    try:
        commit = repo.commit(base).hexsha
    except (git.BadName, ValueError, git.GitCommandError) as e:
        raise GitError(f"unknown base revision {base!r} in {root}") from e
    args = ["--cached", "-M", "-C", "--name-status", "-z", commit]
    try:
        if staged:
            out = repo.git.diff(*args)
            changes = _parse_name_status(out)
            paths = [c.path for c in changes if c.status != "D"]
            if paths:
                unstaged = repo.git.diff("--name-only", "-z", "--", *paths).split("\0")
                unstaged = [p for p in unstaged if p]
                if unstaged:
                    raise GitError(
                        "--staged reads staged files from the work tree, but these have unstaged edits: "
                        f"{', '.join(unstaged)}; stage or stash them (pre-commit stashes them for its hooks)"
                    )
        else:
            with tempfile.TemporaryDirectory(prefix="intake-index-") as tmp:
                index = Path(tmp) / "index"
                real = Path(repo.git_dir) / "index"
                if real.is_file():
                    shutil.copyfile(real, index)
                env = {**os.environ, "GIT_INDEX_FILE": str(index)}
                repo.git.add("-A", env=env)
                out = repo.git.diff(*args, env=env)
            changes = _parse_name_status(out)
    except git.GitCommandError as e:
        raise GitError(f"git failed: {e}") from e
    return Diff(root, commit, changes, repo)
