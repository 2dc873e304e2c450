"""Run the vLLM-on-GPU end-to-end suite on the device's H200 from a pack (`make gpu-vllm-check`, after the build).

    python -m tools.gpu_vllm_check [--pack build/gpu-vllm] [--out build/gpu] [-- PYTEST_ARGS...]

Installs the pack that `make gpu-vllm-pack` wrote (tools/gpu_vllm_pack.py) under a temporary prefix: the patched vLLM
tree and its `vllm-0.32.0+cu130` record into PREFIX/tree, the test-harness stand-ins into that tree's vllm/, the wheels
with `pip install --no-index --no-deps --target PREFIX/site`. Then runs tests/test_gpu_vllm.py with
PYTHONPATH=PREFIX/tree:PREFIX/site and the settings ../shared/design/GPU_VLLM.md lists (in-process engine core, no
FlashInfer sampler, model runner V1, offline). Where `git` is missing, ACTIVEKV_SKIP_PATCH_CHECK=1: the tree was
patched before packing. Writes OUT/gpu_vllm_junit.xml, OUT/gpu_vllm_log.txt and OUT/gpu_vllm_check.json (the facts
of the run: git present, seconds per phase, pytest's exit status). Exits with pytest's status.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SUITE = "tests/test_gpu_vllm.py"


def install(pack: Path, prefix: Path) -> dict[str, float]:
    times: dict[str, float] = {}
    t0 = time.monotonic()
    tree, site = prefix / "tree", prefix / "site"
    with tarfile.open(pack / "vllm-tree.tar.gz") as tar:
        tar.extractall(tree, filter="data")
    shutil.copytree(pack / "standins" / "vllm", tree / "vllm", dirs_exist_ok=True)
    times["unpack_s"] = time.monotonic() - t0
    t0 = time.monotonic()
    wheels = sorted(str(p) for p in (pack / "wheels").glob("*.whl"))
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                    "--no-cache-dir", "--target", str(site), *wheels], check=True)
    times["wheels_s"] = time.monotonic() - t0
    return times


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_vllm_check", description=__doc__.splitlines()[0])
    ap.add_argument("--pack", type=Path, default=ROOT / "build" / "gpu-vllm")
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "gpu")
    ap.add_argument("pytest_args", nargs="*", help="extra pytest arguments (after --)")
    args = ap.parse_args(argv)
    if not (args.pack / "vllm-tree.tar.gz").is_file():
        print(f"gpu-vllm-check: no pack at {args.pack}: run `make gpu-vllm-pack` here and carry it", file=sys.stderr)
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    facts: dict[str, object] = {"git": shutil.which("git") is not None}
    with tempfile.TemporaryDirectory(prefix="activekv-gpu-vllm-") as tmp:
        prefix = Path(tmp)
        facts.update(install(args.pack, prefix))
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join([str(prefix / "tree"), str(prefix / "site"), str(ROOT)]),
            "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_USE_FLASHINFER_SAMPLER": "0",
            "VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_CACHE_ROOT": str(prefix / "vllm-cache"),
            "ACTIVEKV_GPU_VLLM": "1", "ACTIVEKV_GPU_VLLM_MODELS": str(prefix / "models"), "PYTHONUNBUFFERED": "1",
        })
        if not facts["git"]:
            env["ACTIVEKV_SKIP_PATCH_CHECK"] = "1"  # no git there: the tree was patched before packing
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rA", SUITE,
               f"--junitxml={args.out / 'gpu_vllm_junit.xml'}", *args.pytest_args]
        with open(args.out / "gpu_vllm_log.txt", "w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
            assert proc.stdout is not None
            for line in proc.stdout:
                sys.stdout.write(line)
                log.write(line)
            rc = proc.wait()
        facts["pytest_s"] = time.monotonic() - t0
        facts["pytest_rc"] = rc
    (args.out / "gpu_vllm_check.json").write_text(json.dumps(facts, indent=1) + "\n")
    print(f"gpu-vllm-check: {json.dumps(facts)}")
    return rc


if __name__ == "__main__":
    sys.exit(main())
