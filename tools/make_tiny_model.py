"""Make the tiny random-weight Llama model that the vLLM tests, the demo and the docs run on.

`python -m tools.make_tiny_model OUTDIR [--seed N]` writes, with transformers, a 2-layer Llama (hidden 128, 4 query
heads, 2 KV heads: GQA 2, head size 32, vocab 512, 4096 positions) in float32 to OUTDIR as `model.safetensors`,
`config.json` and `generation_config.json`, plus `activekv_tiny_model.json`: the spec and the SHA-256 of every file.

- `initializer_range=0.3`, not transformers' 0.02: with 0.02 the logits are nearly uniform and two correct float32
  attentions pick different greedy tokens from rounding alone (docs: /work/shared/design/VLLM_NOTES.md).
- Deterministic: weights come from `torch.manual_seed(seed)` on CPU, so the same seed and library versions give the
  same bytes.
- Idempotent: when the stamp matches the spec and every file still has its recorded hash, nothing is written.
- Safe to call from several processes at once (the test workers of `make test`): a lock file beside OUTDIR serialises
  the check and the write, so no caller copies a model another is still moving into place.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

STAMP = "activekv_tiny_model.json"
FILES = ("config.json", "generation_config.json", "model.safetensors")
DEFAULT_SEED = 0

# The geometry the tests and the demo assume; change it here and nowhere else.
SPEC: dict[str, Any] = {
    "architecture": "LlamaForCausalLM",
    "num_hidden_layers": 2,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "initializer_range": 0.3,
    "dtype": "float32",
}


def _sha256(path: Path) -> str:
    with path.open("rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _wanted_stamp_spec(seed: int) -> dict[str, Any]:
    import torch
    import transformers

    return {**SPEC, "seed": seed, "torch": torch.__version__, "transformers": transformers.__version__}


def read_stamp(outdir: Path, stamp: str = STAMP) -> dict[str, Any] | None:
    """A model directory's stamp, or None when absent or unreadable."""
    try:
        return json.loads((Path(outdir) / stamp).read_text())
    except (OSError, json.JSONDecodeError):
        return None


def stamp_matches(outdir: Path, stamp: str, spec: dict[str, Any], files: tuple[str, ...] = FILES) -> bool:
    """True when `outdir`'s stamp file names `spec` and every one of `files` still has the hash it recorded."""
    found = read_stamp(outdir, stamp)
    if found is None or found.get("spec") != spec:
        return False
    hashes = found.get("sha256", {})
    return all((outdir / name).is_file() and hashes.get(name) == _sha256(outdir / name) for name in files)


def publish(outdir: Path, stamp: str, write: Callable[[Path], dict[str, Any]], files: tuple[str, ...] = FILES) -> Path:
    """Make a model directory atomically enough: `write(tmp)` writes `files` into a temporary sibling of `outdir` and
    returns the stamp's fields ("spec" among them); the files are checked, hashed into the stamp and moved into
    `outdir`, the stamp last, so an interrupted copy leaves a directory stamp_matches() rejects. Only our own files
    are replaced; anything else in `outdir` is left alone. Raises FileExistsError when `outdir` is not a directory."""
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise FileExistsError(f"{outdir} exists and is not a directory")
    outdir.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{outdir.name}-", dir=outdir.parent) as tmp_name:
        tmp = Path(tmp_name)
        fields = write(tmp)
        missing = [name for name in files if not (tmp / name).is_file()]
        if missing:
            raise RuntimeError(f"transformers did not write {missing} (wrote {sorted(p.name for p in tmp.iterdir())})")
        fields = {**fields, "sha256": {name: _sha256(tmp / name) for name in files}}
        (tmp / stamp).write_text(json.dumps(fields, indent=2, sort_keys=True) + "\n")
        outdir.mkdir(exist_ok=True)
        (outdir / stamp).unlink(missing_ok=True)
        for name in (*files, stamp):
            shutil.move(str(tmp / name), str(outdir / name))
    return outdir


def is_current(outdir: Path, seed: int = DEFAULT_SEED) -> bool:
    """True when `outdir` holds the model for `seed` made by these library versions, files unmodified."""
    return stamp_matches(outdir, STAMP, _wanted_stamp_spec(seed))


def _build(tmp: Path, seed: int) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()

    config = LlamaConfig(
        vocab_size=SPEC["vocab_size"],
        hidden_size=SPEC["hidden_size"],
        intermediate_size=SPEC["intermediate_size"],
        num_hidden_layers=SPEC["num_hidden_layers"],
        num_attention_heads=SPEC["num_attention_heads"],
        num_key_value_heads=SPEC["num_key_value_heads"],
        head_dim=SPEC["head_dim"],
        max_position_embeddings=SPEC["max_position_embeddings"],
        initializer_range=SPEC["initializer_range"],
        tie_word_embeddings=False,
    )
    config.architectures = [SPEC["architecture"]]
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(tmp, safe_serialization=True)


def make_tiny_model(outdir: Path | str, seed: int = DEFAULT_SEED) -> Path:
    """Create (or keep) the tiny model in `outdir`; returns `outdir` as a Path.

    Raises FileExistsError when `outdir` exists and is not a directory.
    """
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise FileExistsError(f"{outdir} exists and is not a directory")
    outdir.parent.mkdir(parents=True, exist_ok=True)
    with (outdir.parent / f".{outdir.name}.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if is_current(outdir, seed):
            return outdir

        def write(tmp: Path) -> dict[str, Any]:
            _build(tmp, seed)
            return {"spec": _wanted_stamp_spec(seed)}

        return publish(outdir, STAMP, write)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.make_tiny_model", description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, help="directory to write the model into")
    parser.add_argument("--seed", type=int, default=DEFAULT_SEED, help="torch.manual_seed for the weights")
    args = parser.parse_args(argv)
    was_current = is_current(args.outdir, args.seed)
    path = make_tiny_model(args.outdir, args.seed)
    state = "up to date" if was_current else "written"
    print(f"{path}: {state} ({_sha256(path / 'model.safetensors')[:16]} model.safetensors)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
