"""tools/real_model.py without vLLM: the converted model in build/ (made by `make real-model`, which `make test`
runs first) is the float32 Llama SPEC describes, with no trace of its GGUF quantization and a chat template; its
stamp is current and notices a changed file; the geometry check names what differs. tests/test_e2e_real.py runs it
in vLLM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from tools import real_model
from tools.real_model import SPEC


@pytest.fixture(scope="module")
def model_dir() -> Path:
    return real_model.make_real_model()


def test_the_converted_model_is_the_float32_llama_spec_describes(model_dir: Path) -> None:
    import safetensors

    config = json.loads((model_dir / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == [SPEC["architecture"]]
    for key in ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                "vocab_size", "max_position_embeddings"):
        assert config[key] == SPEC[key], key
    with safetensors.safe_open(model_dir / "model.safetensors", "pt") as f:
        names = list(f.keys())
        dtypes = {str(f.get_slice(name).get_dtype()) for name in names}
    assert dtypes == {"F32"}
    assert sum(".self_attn.k_proj.weight" in n for n in names) == SPEC["num_hidden_layers"]


def test_the_tokenizer_has_the_chat_template(model_dir: Path) -> None:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids = real_model.chat_prompt(tokenizer, real_model.CHECK_QUESTION)
    text = tokenizer.decode(ids)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert real_model.CHECK_QUESTION in text
    assert real_model.answer_text(tokenizer, [*tokenizer.encode("Paris."), tokenizer.eos_token_id, 42]) == "Paris."


def test_the_stamp_is_current_and_notices_a_changed_file(model_dir: Path, tmp_path: Path) -> None:
    assert real_model.is_current(model_dir)
    copy = tmp_path / "model"
    shutil.copytree(model_dir, copy)
    assert real_model.is_current(copy)
    (copy / "tokenizer_config.json").write_text("{}")
    assert not real_model.is_current(copy)


def test_geometry_check_names_every_field_that_differs() -> None:
    config = SimpleNamespace(architectures=["LlamaForCausalLM"], num_hidden_layers=30, hidden_size=576,
                             num_attention_heads=9, num_key_value_heads=1, head_dim=64, vocab_size=49152,
                             max_position_embeddings=2048)
    with pytest.raises(RuntimeError, match=r"num_key_value_heads.*1 \(expected 3\).*max_position_embeddings"):
        real_model.check_geometry(config)


def test_a_file_in_place_of_the_model_folder_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model").write_text("")
    with pytest.raises(FileExistsError, match="not a directory"):
        real_model.make_real_model(tmp_path / "model")
