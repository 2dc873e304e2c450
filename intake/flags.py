"""Compile flags for libclang: the project's compile_commands.json, and what a file without an entry gets.

- A file with an entry is parsed with that entry's arguments (compiler, ``-o``/``-c``/dependency-file options,
  ``-fopenmp`` (see ``_is_openmp``) and the source itself removed; relative include paths made absolute against the entry's ``directory``).
- A file without an entry (a header, a file added since the last ``make build``) gets the flags of a file in the
  same target: an entry whose include directories (``-I``, ``-isystem``, ``-iquote``) hold the file, else any entry;
  among those the one sharing the longest leading path with the file, provided they share at least the top-level
  folder (``bindings/launcher/main.cpp`` takes ``bindings/modules/*.cpp``'s flags, an engine header
  ``engine/src/*.cpp``'s). Headers are parsed as C++ when that entry is C++.
- Otherwise the documented default: ``-x c++ -std=c++17 -I ROOT/engine/include -I ROOT/bindings/include`` plus the
  running interpreter's Python include directory and the pybind11/ATen headers that torch bundles (found without
  importing torch) as system includes; ``-x c -std=c11`` for ``.c`` files.

libclang from PyPI ships no compiler resource headers (``stddef.h``, ``immintrin.h``, ...). The clang-tidy wheel of
the same LLVM release (18) does, and ``-resource-dir`` points libclang at them. Without it, the compiler's own
directory (``CXX -print-file-name=include``) is appended with ``-idirafter``: enough for portable code, not for
GCC's x86 intrinsics headers, which use builtins clang does not know.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import shlex
import subprocess
import sysconfig
from dataclasses import dataclass
from pathlib import Path

from intake import files

CXX_SOURCE_SUFFIXES = (".cc", ".cpp", ".cxx", ".c++", ".cu")
C_SOURCE_SUFFIXES = (".c",)
HEADER_SUFFIXES = (".h", ".hh", ".hpp", ".hxx", ".h++", ".inl", ".ipp", ".cuh")
NATIVE_SUFFIXES = CXX_SOURCE_SUFFIXES + C_SOURCE_SUFFIXES + HEADER_SUFFIXES

# Options (and the number of values they take) that say nothing about how the code is read.
_DROP_WITH_VALUE = {"-o", "-MF", "-MT", "-MQ", "--output", "-Xlinker", "-L"}
_DROP_ALONE = {"-c", "-MD", "-MMD", "-M", "-MM", "-MP", "--", "-pipe", "-shared"}
_PATH_OPTIONS = ("-I", "-isystem", "-iquote", "-idirafter", "-include", "-imacros", "-isysroot", "--sysroot")


class FlagsError(Exception):
    """compile_commands.json cannot be read (the tool cannot run: exit 2)."""


@dataclass(frozen=True)
class Flags:
    args: tuple[str, ...]
    source: str  # where they come from, for messages: "entry of engine/src/x.cpp", "default"
    compiler: str = "c++"


def is_native(path: str | Path) -> bool:
    return str(path).endswith(NATIVE_SUFFIXES)


def is_header(path: str | Path) -> bool:
    return str(path).endswith(HEADER_SUFFIXES)


@functools.lru_cache(maxsize=None)
def resource_dir() -> str | None:
    """clang's resource directory from the clang-tidy wheel (found without importing it), or None."""
    spec = importlib.util.find_spec("clang_tidy")
    if spec is None or not spec.submodule_search_locations:
        return None
    base = Path(next(iter(spec.submodule_search_locations))) / "data" / "lib" / "clang"
    found = sorted(base.glob("*/include/stddef.h")) if base.is_dir() else []
    return str(found[-1].parent.parent) if found else None


def builtin_args(compiler: str) -> list[str]:
    """Arguments that give libclang its builtin headers (see the module docstring)."""
    res = resource_dir()
    if res:
        return ["-resource-dir", res]
    gcc = builtin_include(compiler)
    return ["-idirafter", gcc] if gcc else []


@functools.lru_cache(maxsize=None)
def builtin_include(compiler: str) -> str | None:
    """The compiler's builtin header directory (``stddef.h`` and friends), or None when it cannot say."""
    for cc in (compiler, "c++", "g++", "cc"):
        try:
            done = subprocess.run([cc, "-print-file-name=include"], capture_output=True, text=True, timeout=20)
        except (OSError, subprocess.TimeoutExpired):
            continue
        path = done.stdout.strip()
        if done.returncode == 0 and os.path.isabs(path) and os.path.isfile(os.path.join(path, "stddef.h")):
            return path
    return None


def _absolutize(args: list[str], directory: str) -> list[str]:
    out: list[str] = []
    i = 0
    while i < len(args):
        a = args[i]
        for opt in _PATH_OPTIONS:
            if a == opt and i + 1 < len(args):
                value = args[i + 1]
                out += [opt, value if os.path.isabs(value) else os.path.normpath(os.path.join(directory, value))]
                i += 2
                break
            if a.startswith(opt) and len(a) > len(opt) and opt in ("-I", "-iquote", "-isystem", "-idirafter"):
                value = a[len(opt) :]
                out.append(opt + (value if os.path.isabs(value) else os.path.normpath(os.path.join(directory, value))))
                i += 1
                break
        else:
            out.append(a)
            i += 1
    return out


def _is_openmp(arg: str) -> bool:
    """``-fopenmp``: dropped for libclang. With it, ``_OPENMP`` makes ATen's ParallelOpenMP.h include ``<omp.h>``, which
    only the compiler's builtin directory has, and GCC's copy uses GCC-only attribute syntax clang rejects. Without
    it ATen's headers take their serial branch, where ``at::parallel_for`` calls the same function object directly:
    the calls the screen follows are the same, and ``#pragma omp`` lines are not calls."""
    return arg == "-fopenmp" or arg.startswith("-fopenmp=")


def _clean(argv: list[str], source: str, directory: str) -> list[str]:
    """Compiler argv (argv[0] the compiler) -> libclang arguments (no compiler, output, or source file)."""
    out: list[str] = []
    skip = False
    for a in argv[1:]:
        if skip:
            skip = False
            continue
        if a in _DROP_WITH_VALUE:
            skip = True
            continue
        joined_output = (a.startswith("-o") and len(a) > 2) or (a.startswith("-MF") and len(a) > 3)
        if a in _DROP_ALONE or joined_output or a.startswith("-Wl,") or _is_openmp(a):
            continue
        if not a.startswith("-") and os.path.normpath(os.path.join(directory, a)) == source:
            continue
        out.append(a)
    return out


def include_dirs(args: tuple[str, ...]) -> list[str]:
    dirs = []
    for i, a in enumerate(args):
        if a in ("-I", "-isystem", "-iquote") and i + 1 < len(args):
            dirs.append(args[i + 1])
        elif a.startswith("-I") and len(a) > 2:
            dirs.append(a[2:])
        elif a.startswith("-isystem") and len(a) > len("-isystem"):
            dirs.append(a[len("-isystem") :])
    return dirs


def torch_include() -> str | None:
    """torch's bundled include directory (pybind11, ATen), found without importing torch."""
    spec = importlib.util.find_spec("torch")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations))) / "include"
    return str(path) if path.is_dir() else None


class CompileDatabase:
    """compile_commands.json (or nothing) for one root, and the flags rule for files without an entry."""

    def __init__(self, root: Path, path: Path | None) -> None:
        self.root = root
        self.path = path
        self.entries: dict[str, Flags] = {}  # absolute, normalised file path -> flags
        if path is not None:
            self._load(path)

    def _load(self, path: Path) -> None:
        try:
            data = json.loads(files.read_text(path))
        except (files.Refused, ValueError) as e:
            raise FlagsError(f"cannot read {path}: {e}") from e
        if not isinstance(data, list):
            raise FlagsError(f"{path}: expected a JSON array of compile commands")
        base = path.resolve().parent
        for entry in data:
            if not isinstance(entry, dict) or "file" not in entry:
                raise FlagsError(f"{path}: an entry has no 'file'")
            directory = str((base / entry.get("directory", ".")).resolve())
            if "arguments" in entry:
                argv = list(entry["arguments"])
            elif "command" in entry:
                argv = shlex.split(entry["command"])
            else:
                raise FlagsError(f"{path}: the entry for {entry['file']} has neither 'arguments' nor 'command'")
            source = os.path.normpath(os.path.join(directory, entry["file"]))
            args = _absolutize(_clean(argv, source, directory), directory)
            try:
                rel = os.path.relpath(source, self.root)
            except ValueError:
                rel = source
            self.entries[source] = Flags(tuple(args), f"compile_commands.json entry of {rel}", argv[0])

    def entry(self, file: Path) -> Flags | None:
        return self.entries.get(os.path.normpath(str(file)))

    def flags_for(self, file: Path) -> Flags:
        """The flags to parse ``file`` with (absolute path), builtin include directory appended."""
        flags = self.entry(file) or self._same_target(file) or self.default(file)
        args = list(flags.args)
        if is_header(file) and not any(a == "-x" or a.startswith("-x") for a in args):
            args = ["-x", "c" if flags.source.endswith(C_SOURCE_SUFFIXES) else "c++", *args]
        # GCC-only warning options in the entry are no concern of the screen's.
        args += ["-Wno-unknown-warning-option", *builtin_args(flags.compiler)]
        return Flags(tuple(args), flags.source, flags.compiler)

    def _same_target(self, file: Path) -> Flags | None:
        if not self.entries:
            return None
        target = os.path.normpath(str(file))
        holders = [
            src
            for src, fl in self.entries.items()
            if any(target.startswith(os.path.normpath(d) + os.sep) for d in include_dirs(fl.args))
        ]
        pool = holders or list(self.entries)
        try:
            rel_target = Path(target).relative_to(self.root).parts
        except ValueError:
            return None

        def shared(src: str) -> int:
            try:
                parts = Path(src).relative_to(self.root).parts
            except ValueError:
                return 0
            n = 0
            for a, b in zip(parts[:-1], rel_target[:-1]):
                if a != b:
                    break
                n += 1
            return n

        best = max(sorted(pool), key=shared)
        if shared(best) == 0:
            return None
        fl = self.entries[best]
        if file.suffix in C_SOURCE_SUFFIXES and not best.endswith(C_SOURCE_SUFFIXES):
            return None
        return Flags(fl.args, fl.source.replace("entry of", "entry of (same target)"), fl.compiler)

    def default(self, file: Path) -> Flags:
        if file.suffix in C_SOURCE_SUFFIXES:
            args = ["-x", "c", "-std=c11"]
        else:
            args = ["-x", "c++", "-std=c++17"]
        for sub in ("engine/include", "bindings/include"):
            if (self.root / sub).is_dir():
                args.append(f"-I{self.root / sub}")
        py_include = sysconfig.get_paths().get("include")
        if py_include:
            args += ["-isystem", py_include]
        torch = torch_include()
        if torch:
            args += ["-isystem", torch, "-isystem", os.path.join(torch, "torch", "csrc", "api", "include")]
        return Flags(tuple(args), "default flags (no compile_commands.json entry in the same target)")
