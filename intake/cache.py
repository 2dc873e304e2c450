"""The parse cache: a translation unit's facts, keyed by its content and compile flags, checked against its includes.

Key: sha256 of (facts format, the extractor's source, libclang version, the file's path, its flags, the sha256 of its
content). An entry
also records every file the unit included, with a signature: the content's sha256 for project files, size and
mtime for the rest (torch, pybind11 and system headers change only with the environment). An entry is used only
when every signature still matches, so editing a header re-parses every unit that includes it.

Layout: ``DIR/ab/abcdef....json``, written atomically; nothing is ever evicted (``make clean`` removes
``build/``, where the default cache lives).
"""

from __future__ import annotations

import hashlib
import json
import os
from importlib import metadata
from pathlib import Path
from typing import Any

from intake import files
from intake.cxx import EXCLUDED_TOP
from intake.flags import Flags

FACTS_FORMAT = 4
# The extractor's own source is part of the key: changing how facts are gathered invalidates every entry.
_EXTRACTOR = hashlib.sha256(files.read_bytes(Path(__file__).with_name("cxx.py"))).hexdigest()


def _libclang_version() -> str:
    try:
        return metadata.version("libclang")
    except metadata.PackageNotFoundError:
        return "unknown"


class Signatures:
    """File signatures, computed once per run."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.memo: dict[str, str] = {}

    def project(self, path: str) -> bool:
        try:
            parts = Path(path).relative_to(self.root).parts
        except ValueError:
            return False
        return bool(parts) and parts[0] not in EXCLUDED_TOP and "site-packages" not in parts

    def of(self, path: str) -> str:
        sig = self.memo.get(path)
        if sig is None:
            try:
                if self.project(path):
                    sig = "sha256:" + hashlib.sha256(files.read_bytes(Path(path), self.root)).hexdigest()
                else:
                    st = os.stat(path)
                    sig = f"stat:{st.st_size}:{st.st_mtime_ns}"
            except files.Refused as e:
                sig = f"refused: {e}"
            except OSError:
                sig = "missing"
            self.memo[path] = sig
        return sig


class Cache:
    def __init__(self, directory: Path | None, root: Path) -> None:
        self.directory = directory
        self.signatures = Signatures(root)
        self.version = _libclang_version()
        self.hits = 0
        self.misses = 0

    def key(self, main: str, flags: Flags) -> str:
        content = self.signatures.of(main) if self.signatures.project(main) else self._content(main)
        blob = json.dumps([FACTS_FORMAT, _EXTRACTOR, self.version, main, list(flags.args), flags.source, content])
        return hashlib.sha256(blob.encode()).hexdigest()

    @staticmethod
    def _content(path: str) -> str:
        try:
            return "sha256:" + hashlib.sha256(files.read_bytes(Path(path))).hexdigest()
        except files.Refused as e:
            return f"refused: {e}"

    def _file(self, key: str) -> Path:
        assert self.directory is not None
        return self.directory / key[:2] / f"{key}.json"

    def get(self, key: str) -> dict[str, Any] | None:
        if self.directory is None:
            return None
        try:
            entry = json.loads(files.read_text(self._file(key)))
        except (files.Refused, ValueError):
            self.misses += 1
            return None
        deps = entry.get("deps", {})
        if any(self.signatures.of(path) != sig for path, sig in deps.items()):
            self.misses += 1
            return None
        self.hits += 1
        return entry["facts"]

    def put(self, key: str, facts: dict[str, Any]) -> None:
        if self.directory is None:
            return
        deps = {path: self.signatures.of(path) for path in facts.get("deps", [])}
        target = self._file(key)
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps({"deps": deps, "facts": facts}))
        os.replace(tmp, target)
