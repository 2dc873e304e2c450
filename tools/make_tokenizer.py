"""Give the tiny model a real tokenizer, so `vllm serve` / `activekv serve` accept text prompts.

`python -m tools.make_tokenizer MODEL_DIR` trains a byte-level BPE tokenizer with the `tokenizers` library on the
Markdown the project ships (README.md and docs/*.md) to exactly the model's vocabulary size (512), and writes
`tokenizer.json` and `tokenizer_config.json` (a transformers `PreTrainedTokenizerFast`) into MODEL_DIR. Special
tokens take the ids the model's config names: `<unk>` 0, `<s>` 1 (bos), `</s>` 2 (eos). Byte-level, so any text
encodes. Training on a fixed text is deterministic; the files are rewritten only when their content changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPECIALS = ("<unk>", "<s>", "</s>")  # ids 0, 1, 2: the tiny model's config has bos_token_id 1, eos_token_id 2


def training_text(repo: Path = REPO) -> list[str]:
    """The project's own prose: README.md and docs/*.md, in a fixed order."""
    files = [repo / "README.md", *sorted((repo / "docs").glob("*.md"))]
    return [f.read_text() for f in files if f.is_file()]


def make_tokenizer(model_dir: Path, vocab_size: int | None = None) -> Path:
    """Write tokenizer.json and tokenizer_config.json into ``model_dir``; returns the tokenizer.json path."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    if vocab_size is None:
        vocab_size = json.loads((model_dir / "config.json").read_text())["vocab_size"]
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIALS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(training_text(), trainer=trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"trained {tokenizer.get_vocab_size()} tokens, the model has {vocab_size}")
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "model_max_length": 4096,
        "clean_up_tokenization_spaces": False,
    }
    outputs = {
        model_dir / "tokenizer.json": tokenizer.to_str(pretty=True) + "\n",
        model_dir / "tokenizer_config.json": json.dumps(config, indent=2) + "\n",
    }
    for path, text in outputs.items():
        if not path.is_file() or path.read_text() != text:
            path.write_text(text)
    return model_dir / "tokenizer.json"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.make_tokenizer", description=__doc__.splitlines()[0])
    parser.add_argument("model_dir", type=Path)
    args = parser.parse_args(argv)
    print(make_tokenizer(args.model_dir))
    return 0


if __name__ == "__main__":
    sys.exit(main())
