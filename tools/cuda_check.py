"""Compile-only check of the CUDA sources (engine/src/cuda/*.cu) on a machine without a GPU or a CUDA toolkit.

    python -m tools.cuda_check [--toolkit build/cuda-toolkit]

`make cuda-check` first installs NVIDIA's CUDA 13.0 compiler wheels from PyPI into the toolkit folder (nvcc, crt,
nvvm, the runtime headers, cccl: the CUDA of the device machine's torch 2.11+cu130). This compiles every .cu for
sm_90 against the venv's torch headers, as the CMake build does on a CUDA machine, and fails on any error, warning,
or register spill that ptxas reports. Nothing runs: the kernels' results are checked on a GPU (`make gpu-check`).

The CPU torch wheel ships the c10/cuda headers but not the one CMake generates for CUDA builds,
c10/cuda/impl/cuda_cmake_macros.h; the check writes it (one define, as a shared-library CUDA build of torch has it)
into a shim folder of the toolkit. The shim exists for this check only; real builds use torch's own.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch.utils.cpp_extension as cpp_ext

ROOT = Path(__file__).resolve().parents[1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--toolkit", type=Path, default=ROOT / "build" / "cuda-toolkit")
    ap.add_argument("--arch", default="sm_90")
    ap.add_argument("--sources", type=Path, default=ROOT / "engine" / "src", help="folder searched for .cu files")
    args = ap.parse_args()
    cuda = args.toolkit / "nvidia" / "cu13"
    nvcc = cuda / "bin" / "nvcc"
    if not nvcc.is_file():
        print(f"cuda-check: no nvcc at {nvcc}: run `make cuda-check`, which installs it", file=sys.stderr)
        return 2
    shim = args.toolkit / "shim" / "c10" / "cuda" / "impl"
    shim.mkdir(parents=True, exist_ok=True)
    (shim / "cuda_cmake_macros.h").write_text("#pragma once\n#define C10_CUDA_BUILD_SHARED_LIBS\n")
    sources = sorted(args.sources.rglob("*.cu"))
    if not sources:
        print(f"cuda-check: no .cu files under {args.sources}", file=sys.stderr)
        return 2
    includes = ["-I", str(ROOT / "engine" / "include"), "-isystem", str(args.toolkit / "shim")]
    for inc in cpp_ext.include_paths():
        includes += ["-isystem", inc]
    out_dir = args.toolkit / "obj"
    out_dir.mkdir(exist_ok=True)

    def compile_one(src: Path) -> subprocess.CompletedProcess:
        cmd = [str(nvcc), "-std=c++17", f"-arch={args.arch}", "-c", str(src), "-o", str(out_dir / (src.stem + ".o")),
               *includes, f"-I{cuda / 'include'}", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch_abi())}",
               "-Xptxas=-v,-warn-spills", "-Werror=all-warnings", "--expt-relaxed-constexpr"]
        return subprocess.run(cmd, capture_output=True, text=True)

    # One nvcc per core: each spends most of its time in the host compiler on torch's headers, single-threaded.
    with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
        results = list(pool.map(compile_one, sources))
    failed = 0
    for src, done in zip(sources, results):
        log = done.stdout + done.stderr
        spills = [ln for ln in log.splitlines() if re.search(r"[1-9]\d* bytes spill (stores|loads)", ln)]
        regs = sorted({int(m) for m in re.findall(r"Used (\d+) registers", log)})
        rel = src.relative_to(ROOT) if src.is_relative_to(ROOT) else src
        if done.returncode != 0 or spills:
            failed += 1
            print(f"FAIL {rel}\n{log}")
        else:
            kernels = f"registers per thread {regs[0]}-{regs[-1]}" if regs else "no kernels"
            print(f"ok   {rel}: compiled for {args.arch}, {kernels}, no spills")
    return 1 if failed else 0


def torch_abi() -> bool:
    import torch

    return bool(torch._C._GLIBCXX_USE_CXX11_ABI)


if __name__ == "__main__":
    sys.exit(main())
