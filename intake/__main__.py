"""Command line: ``python -m intake check|scan``. Exit 0 clean, 1 findings, 2 the screen could not run."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from intake import __doc__ as package_doc

FORMATS = ("text", "json", "sarif")


def _common(parser: argparse.ArgumentParser, defaults: bool) -> None:
    """Options both subcommands take, before or after the subcommand name."""

    def d(value: object) -> object:
        return value if defaults else argparse.SUPPRESS

    parser.add_argument("--format", choices=FORMATS, default=d("text"), help="output format (default: text)")
    parser.add_argument(
        "--compile-commands",
        type=Path,
        metavar="FILE",
        default=d(None),
        help="compile database (default: ROOT/compile_commands.json when it exists, else default flags)",
    )
    parser.add_argument(
        "--baseline", type=Path, metavar="FILE", default=d(None), help="default: ROOT/intake/baseline.toml"
    )
    parser.add_argument(
        "--vllm-src",
        type=Path,
        metavar="DIR",
        default=d(None),
        help="vLLM reference tree for uncited-python-line (default: the one `python -m tools.vllm_tree` builds)",
    )
    parser.add_argument(
        "--cache",
        type=Path,
        metavar="DIR",
        default=d(None),
        help="parse cache (default: $ACTIVEKV_INTAKE_CACHE, else ROOT/build/intake-cache when ROOT/build exists, "
        "else ~/.cache/activekv-intake)",
    )
    parser.add_argument("--no-cache", action="store_true", default=d(False), help="parse everything afresh")
    parser.add_argument(
        "--jobs", type=int, metavar="N", default=d(os.cpu_count() or 1), help="parallel parses (default: CPUs)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m intake",
        description=(package_doc or "").strip().split("\n\n")[0],
        epilog="Exit status: 0 clean, 1 findings, 2 the screen could not run (the reason is printed).",
    )
    _common(parser, defaults=True)
    sub = parser.add_subparsers(dest="command", required=True)
    check = sub.add_parser("check", help="screen what changed since --base (work tree, untracked files included)")
    _common(check, defaults=False)
    check.add_argument("--base", required=True, metavar="REV", help="the revision to compare with (HEAD, main, ...)")
    check.add_argument("--repo", type=Path, default=Path("."), metavar="DIR", help="repository (default: .)")
    check.add_argument(
        "--staged", action="store_true", help="screen the staged change only (index vs --base), as a pre-commit hook"
    )
    scan = sub.add_parser("scan", help="screen the given files and folders whole (no git)")
    _common(scan, defaults=False)
    scan.add_argument("paths", nargs="+", type=Path, metavar="PATH")
    scan.add_argument(
        "--root", type=Path, default=Path("."), metavar="DIR", help="paths are reported relative to it (default: .)"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import clang.cindex  # noqa: F401 - fail early, with the reason, when libclang is missing

        from intake import findings, screen
        from intake.baseline import BaselineError
        from intake.flags import FlagsError
        from intake.patches import PatchesError
    except ImportError as e:
        print(
            f"intake: error: {e}; install the screen's dependencies: "
            ".venv/bin/pip install libclang==18.1.1 gitpython (`make venv` does it for a new .venv)",
            file=sys.stderr,
        )
        return 2
    opts = screen.Options(
        compile_commands=args.compile_commands.absolute() if args.compile_commands else None,
        baseline=args.baseline.absolute() if args.baseline else None,
        vllm_src=args.vllm_src.absolute() if args.vllm_src else None,
        cache=args.cache.absolute() if args.cache else None,
        use_cache=not args.no_cache,
        jobs=max(1, args.jobs),
    )
    try:
        if args.command == "check":
            result = screen.check(args.base, args.repo.absolute(), args.staged, opts)
        else:
            result = screen.scan(args.paths, args.root.absolute(), opts)
    except ImportError as e:  # gitpython, only check needs it
        print(f"intake: error: {e}; install it: .venv/bin/pip install gitpython", file=sys.stderr)
        return 2
    except (screen.ToolError, BaselineError, FlagsError, PatchesError, clang.cindex.LibclangError) as e:
        print(f"intake: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - a bug in the screen is still "could not run", never a pass
        print(f"intake: error: internal error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2
    info = findings.summary(result.findings, result.files, result.baselined, result.command)
    info["parsed"] = result.parsed
    info["from_cache"] = result.cached
    info["preludes"] = result.preludes
    if args.format == "json":
        out = findings.render_json(result.findings, info)
    elif args.format == "sarif":
        out = findings.render_sarif(result.findings, info, result.root.as_uri() + "/")
    else:
        out = findings.render_text(result.findings, info)
    sys.stdout.write(out)
    return 1 if result.findings else 0


if __name__ == "__main__":
    sys.exit(main())
