"""The one way intake walks and reads files: regular files only, opened without blocking, never past a size cap.

What the screen is handed may be hostile: a FIFO (opening it blocks until a writer comes), a device (``/dev/zero``
never ends), a socket, a link that dangles or leads out of the tree, a file of gigabytes. Every file intake reads
goes through ``read_bytes``/``read_text``/``read_head``, and every folder it walks through ``walk``:

- a path that is not a regular file is refused before anything opens it (``refusal``, from ``stat``, which never
  blocks); what is opened is opened with ``O_NONBLOCK`` and checked again with ``fstat`` before the first read, so a
  file swapped for a FIFO in between is refused, not waited on;
- a symbolic link is followed only when it ends at a regular file inside ``root`` (the screened tree), when a root is
  given; links to folders are not followed (``walk`` reports them as entries, refused);
- a file bigger than ``MAX_FILE_BYTES`` is refused from its size, never read, and reading stops there whatever the
  size said (a file that grows while read is refused too).

A refused path raises ``Refused``; its message says what came and what was expected. The screen reports a refused
payload file as an ``unreadable-file`` finding (intake/screen.py); a refused configuration file (compile database,
baseline) stops the screen (exit 2).
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterator
from pathlib import Path

from intake.findings import Finding

MAX_FILE_BYTES = 8 << 20  # 8 MiB: the project's biggest source is under 100 KiB, its compile database under 1 MiB
_OPEN_FLAGS = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY
_SKIP_DIRS = frozenset({".git", "__pycache__"})


class Refused(Exception):
    """A path intake will not read; the message says what came and what was expected."""


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    ):
        if test(mode):
            return name
    return "not a regular file"


def _expected(limit: int) -> str:
    return f"expected a regular file of at most {limit} bytes; the screen did not read it"


def refusal(path: Path, root: Path | None = None, limit: int = MAX_FILE_BYTES) -> str | None:
    """Why ``path`` is not a file intake reads (None when it is), from ``lstat``/``stat`` alone: nothing is opened.

    ``root``: the file must resolve inside it (an absolute, resolved folder), links and linked parent folders
    included; None for files the user names (a compile database, a baseline), which may live anywhere."""
    try:
        st = os.lstat(path)
    except OSError as e:
        return f"cannot be examined ({e.strerror}): {_expected(limit)}"
    via = ""
    if stat.S_ISLNK(st.st_mode):
        try:
            target = os.path.realpath(path, strict=True)
            st = os.stat(target)
        except FileNotFoundError:
            return f"a link to {os.readlink(path)}, which does not exist: {_expected(limit)}"
        except OSError as e:
            return f"a link to {os.readlink(path)} that cannot be followed ({e.strerror}): {_expected(limit)}"
        via = f"a link to {target}, "
    if not stat.S_ISREG(st.st_mode):
        return f"{via}{_kind(st.st_mode)}: {_expected(limit)}"
    if root is not None:
        target = os.path.realpath(path)
        if not Path(target).is_relative_to(root):
            return f"{via or f'resolves to {target}, '}outside the screened tree {root}: {_expected(limit)}"
    if st.st_size > limit:
        return f"{via}{st.st_size} bytes: {_expected(limit)}"
    return None


def read_bytes(path: Path, root: Path | None = None, limit: int = MAX_FILE_BYTES) -> bytes:
    """The whole file; ``Refused`` for anything but a regular file of at most ``limit`` bytes (see ``refusal``)."""
    return _read(path, root, limit, limit + 1)  # one byte more than allowed tells a file that grew while read


def read_head(path: Path, size: int, root: Path | None = None) -> bytes:
    """The first ``size`` bytes of a file ``read_bytes`` would read (the size cap applies to the file, not the head)."""
    return _read(path, root, MAX_FILE_BYTES, size)


def read_text(path: Path, root: Path | None = None) -> str:
    """``read_bytes`` decoded as UTF-8; ``Refused`` for bytes that are not UTF-8."""
    data = read_bytes(path, root)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise Refused(f"{path}: not UTF-8 text ({e})") from e


def _read(path: Path, root: Path | None, cap: int, take: int) -> bytes:
    """At most ``take`` bytes of ``path``, refused when it is no regular file of at most ``cap`` bytes."""
    reason = refusal(path, root, cap)
    if reason:
        raise Refused(f"{path}: {reason}")
    try:
        fd = os.open(path, _OPEN_FLAGS)
    except OSError as e:
        raise Refused(f"{path}: cannot be opened ({e.strerror}): {_expected(cap)}") from e
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > cap:  # swapped since refusal() looked
            what = f"{st.st_size} bytes" if stat.S_ISREG(st.st_mode) else _kind(st.st_mode)
            raise Refused(f"{path}: {what}: {_expected(cap)}")
        chunks: list[bytes] = []
        got = 0
        while got < take:
            chunk = os.read(fd, min(1 << 20, take - got))
            if not chunk:
                break
            chunks.append(chunk)
            got += len(chunk)
    except OSError as e:
        raise Refused(f"{path}: cannot be read ({e.strerror}): {_expected(cap)}") from e
    finally:
        os.close(fd)
    if got > cap:
        raise Refused(f"{path}: grew past {cap} bytes while read: {_expected(cap)}")
    return b"".join(chunks)


def walk(top: Path) -> Iterator[Path]:
    """Every entry under ``top`` that is not a folder, sorted; links to folders are entries (not followed), so the
    caller sees and refuses them. ``.git`` and ``__pycache__`` are skipped."""
    for dirpath, dirnames, filenames in os.walk(top):
        d = Path(dirpath)
        links = [n for n in dirnames if os.path.islink(d / n)]
        dirnames[:] = sorted(n for n in dirnames if n not in _SKIP_DIRS and n not in links)
        yield from (d / n for n in sorted(filenames + links))


def finding(rel: str, reason: str, line: int = 1, column: int = 1) -> Finding:
    """The ``unreadable-file`` finding for a payload file the screen refused (``reason``: ``refusal``'s text)."""
    return Finding("unreadable-file", rel, line, column, reason)
