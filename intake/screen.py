"""The two screens: ``scan`` (given files and folders, whole, no git) and ``check`` (what changed since a revision).

Both apply every rule to the payload side of the tree; the dev-side folders (``tests/``, ``tools/``, ``release/``,
``intake/``) are not payload, so none of the rules looks at them (their C++ and Python may do what dev tools do;
``tests/intake_corpus/`` is full of deliberate violations). A payload file ``intake.files`` refuses (a FIFO, device,
socket or folder link, a link out of the tree, a file over the size cap) is an ``unreadable-file`` finding and no
other rule reads it. The baseline is applied last.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from intake import baseline, files, native, patches, pyfiles
from intake.cache import Cache
from intake.findings import Finding
from intake.flags import CompileDatabase, is_header, is_native


class ToolError(Exception):
    """The screen cannot run (exit 2); the message says why."""


@dataclass
class Options:
    compile_commands: Path | None = None  # default: ROOT/compile_commands.json when it exists
    baseline: Path | None = None  # default: ROOT/intake/baseline.toml when it exists
    vllm_src: Path | None = None  # default: the reference tree of tools/vllm_tree.py
    cache: Path | None = None  # default: $ACTIVEKV_INTAKE_CACHE, ROOT/build/intake-cache, ~/.cache/activekv-intake
    use_cache: bool = True
    jobs: int = field(default_factory=lambda: os.cpu_count() or 1)


@dataclass
class Result:
    command: str
    root: Path
    findings: list[Finding]
    files: int  # files screened
    baselined: int
    parsed: int = 0  # translation units parsed (not from the cache)
    cached: int = 0
    preludes: int = 0  # shared preludes built (intake/prelude.py)


def _rel(root: Path, path: Path) -> str:
    return path.relative_to(root).as_posix()


def _database(root: Path, opts: Options) -> CompileDatabase:
    path = opts.compile_commands
    if path is None:
        default = root / "compile_commands.json"
        path = default if default.exists() else None
    elif not path.exists():
        raise ToolError(f"--compile-commands {path} does not exist")
    return CompileDatabase(root, path)


def _cache(root: Path, opts: Options) -> Cache:
    if not opts.use_cache:
        return Cache(None, root)
    env = os.environ.get("ACTIVEKV_INTAKE_CACHE")
    directory = opts.cache or (Path(env) if env else None)
    if directory is None:
        # build/ holds the build outputs (ignored by git); a tree without one gets the user's cache folder instead,
        # so the cache never shows up as untracked files. Keys hold absolute paths: sharing a folder is safe.
        user_cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "activekv-intake"
        directory = root / "build" / "intake-cache" if (root / "build").is_dir() else user_cache
    return Cache(directory, root)


def _baseline(root: Path, opts: Options) -> tuple[list[baseline.Entry], str]:
    path = opts.baseline or root / baseline.BASELINE
    try:
        rel = _rel(root, path.resolve())
    except ValueError:
        rel = str(path)
    if not path.exists():
        if opts.baseline is not None:
            raise ToolError(f"--baseline {path} does not exist")
        return [], rel
    try:
        text = files.read_text(path)
    except files.Refused as e:
        raise ToolError(f"cannot read the baseline: {e}") from e
    return baseline.parse(text, rel), rel


def _program_sources(root: Path, db: CompileDatabase, extra: list[Path]) -> list[Path]:
    sources = {Path(p) for p in db.entries if _payload(root, Path(p)) and files.refusal(Path(p), root) is None}
    sources |= {p for p in extra if not is_header(p)}
    return sorted(sources)


def _payload(root: Path, path: Path) -> bool:
    try:
        rel = _rel(root, path)
    except ValueError:
        return False
    return not pyfiles.is_dev_side(rel)


def _native(
    root: Path, opts: Options, extra: list[Path], headers: list[Path]
) -> tuple[list[Finding], set[str], native.Program, Cache]:
    db = _database(root, opts)
    cache = _cache(root, opts)
    program = native.load_program(root, _program_sources(root, db, extra), headers, db, cache, opts.jobs)
    findings, analysed = native.judge(root, program)
    return findings, analysed, program, cache


def _finish(
    command: str,
    root: Path,
    findings: list[Finding],
    entries: list[baseline.Entry],
    baseline_rel: str,
    stale_scope: set[str],
    count: int,
    program: native.Program | None,
    cache: Cache | None,
    pool: list[Finding] | None = None,
) -> Result:
    """Apply the baseline; ``pool``: every finding the screen saw (unfiltered), to tell stale entries."""
    kept, allowed, used = baseline.apply(entries, findings)
    if pool is not None:
        used |= baseline.apply(entries, pool)[2]
    kept += baseline.stale(entries, used, stale_scope, baseline_rel)
    unique = sorted({f.key(): f for f in kept}.values(), key=lambda f: (f.path, f.line, f.column, f.rule))
    return Result(
        command,
        root,
        unique,
        count,
        allowed,
        parsed=program.parsed if program else 0,
        cached=cache.hits if cache else 0,
        preludes=program.preludes if program else 0,
    )


# ---------------------------------------------------------------------------------------------------------- scan


def scan(paths: list[Path], root: Path, opts: Options) -> Result:
    root = root.resolve()
    found: list[Path] = []
    for given in paths:
        p = Path(os.path.normpath(given.absolute()))
        if not os.path.lexists(p):
            raise ToolError(f"{given}: no such file or folder")
        try:
            p.relative_to(root)
        except ValueError as e:
            raise ToolError(f"{given} is outside the root {root} (--root)") from e
        # A folder named here is walked (a link the user names included); anything else is one entry, refused below
        # unless it is a regular file.
        found += files.walk(p) if p.is_dir() else [p]
    found = sorted(set(found))
    series_dirs = {d for d in {f.parent for f in found} if patches.is_series_dir(d)}
    screened = {_rel(root, f) for f in found}

    findings: list[Finding] = []
    payload: list[Path] = []
    for f in found:
        if not _payload(root, f):
            continue
        reason = files.refusal(f, root)
        if reason:
            findings.append(files.finding(_rel(root, f), reason))
        else:
            payload.append(f)
    for f in payload:
        rel = _rel(root, f)
        head = pyfiles.read_head(f, root)
        if pyfiles.is_python(rel, head):
            findings.append(pyfiles.finding(rel, head))

    natives = [f for f in payload if is_native(f)]
    native_findings, analysed, program, cache = _native(
        root, opts, natives, [f for f in natives if is_header(f)]
    )
    findings += [f for f in native_findings if f.path in screened]

    if series_dirs:
        vllm_src = patches.reference_tree(opts.vllm_src)
        for d in sorted(series_dirs):
            if _payload(root, d):
                findings += patches.screen_series(root, d, vllm_src)

    entries, baseline_rel = _baseline(root, opts)
    return _finish("scan", root, findings, entries, baseline_rel, screened, len(found), program, cache)


# --------------------------------------------------------------------------------------------------------- check


def check(base: str, repo: Path, staged: bool, opts: Options) -> Result:
    from intake import gitdiff  # gitpython is needed by check only

    try:
        d = gitdiff.diff(repo, base, staged)
    except gitdiff.GitError as e:
        raise ToolError(str(e)) from e
    root = d.root
    present = [c for c in d.changes if c.status != "D"]
    changed = {c.path for c in present}
    touched = changed | {c.old_path for c in d.changes if c.old_path} | {c.path for c in d.changes}

    findings: list[Finding] = []
    refused: set[str] = set()
    for c in present:
        if pyfiles.is_dev_side(c.path):
            continue
        reason = files.refusal(root / c.path, root)
        if reason:
            findings.append(files.finding(c.path, reason))
            refused.add(c.path)
            continue
        head = pyfiles.read_head(root / c.path, root)
        if not pyfiles.is_python(c.path, head):
            continue
        if c.status == "A":
            findings.append(pyfiles.finding(c.path, head))
        elif c.status == "C":
            findings.append(pyfiles.finding(c.path, head, c.old_path, copied=True))
        elif c.status == "R":
            findings.append(pyfiles.finding(c.path, head, c.old_path))
        else:  # modified: new only when the base version was not Python (a shebang added)
            before = d.base_head(c.path, 256)
            if before is not None and not pyfiles.is_python(c.path, before):
                findings.append(pyfiles.finding(c.path, head))

    natives = [
        root / c.path
        for c in present
        if is_native(c.path) and not pyfiles.is_dev_side(c.path) and c.path not in refused
    ]
    program = cache = None
    analysed: set[str] = set()
    native_findings: list[Finding] = []
    entries, baseline_rel = _baseline(root, opts)
    # The whole program is analysed whenever something native changed, a compile database says what the program
    # is, or the baseline changed (its entries are judged against every site).
    if natives or (root / "compile_commands.json").exists() or opts.compile_commands or baseline_rel in touched:
        listed = d.repo.git.ls_files("-z", "--cached", "--others", "--exclude-standard").split("\0")
        sources = [root / p for p in listed if p and is_native(p) and not is_header(p) and not pyfiles.is_dev_side(p)]
        sources = [p for p in sources if files.refusal(p, root) is None]
        native_findings, analysed, program, cache = _native(
            root, opts, sorted(set(sources) | set(natives)), [p for p in natives if is_header(p)]
        )
        findings += [f for f in native_findings if f.path in changed or any(r in changed for r in f.related)]

    series_dirs = set()
    for rel in touched:
        parent = (root / rel).parent
        while parent != root and root in parent.parents:
            if patches.is_series_dir(parent):
                series_dirs.add(parent)
                break
            parent = parent.parent
    if series_dirs:
        vllm_src = patches.reference_tree(opts.vllm_src)
        for s in sorted(series_dirs):
            if _payload(root, s):
                findings += patches.screen_series(root, s, vllm_src)

    stale_scope = set(changed)
    if baseline_rel in touched:
        try:
            before = d.base_text(baseline_rel)
        except files.Refused as e:
            raise ToolError(f"cannot read the baseline at {base}: {e}") from e
        base_entries = baseline.parse(before, f"{base}:{baseline_rel}") if before else []
        if touched - {baseline_rel}:
            findings += baseline.changes(base_entries, entries, baseline_rel)
        stale_scope |= analysed
    return _finish(
        "check", root, findings, entries, baseline_rel, stale_scope, len(present), program, cache, native_findings
    )
