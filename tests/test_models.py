"""The tiny-model factory, the chat tokenizer, and loading local HF checkpoints."""

import json
import shutil

import pytest
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

from mlplat.data.demo import tokenizer_corpus
from mlplat.errors import CheckpointError
from mlplat.models import build_tiny_model, load_model, load_tokenizer

FILES = {"config.json", "model.safetensors", "generation_config.json", "tokenizer.json", "tokenizer_config.json"}


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=torch.tensor([ids])).logits


def test_checkpoint_has_hf_files(tiny_model):
    assert FILES <= {p.name for p in tiny_model.iterdir()}
    config = json.loads((tiny_model / "config.json").read_text())
    assert config["model_type"] == "llama" and config["num_key_value_heads"] < config["num_attention_heads"]
    assert load_tokenizer(tiny_model).chat_template


def test_save_load_round_trip_gives_same_logits(tiny_model, tmp_path):
    model = load_model(tiny_model)
    tokenizer = load_tokenizer(tiny_model)
    ids = tokenizer("What is 12 + 34?")["input_ids"]
    model.save_pretrained(tmp_path / "copy")
    tokenizer.save_pretrained(tmp_path / "copy")
    torch.testing.assert_close(logits(load_model(tmp_path / "copy"), ids), logits(model, ids), rtol=0, atol=0)


def test_factory_is_deterministic(demo_data, tiny_model, tmp_path):
    again = build_tiny_model(tmp_path / "again", tokenizer_corpus(demo_data.sft))
    assert (again / "tokenizer.json").read_bytes() == (tiny_model / "tokenizer.json").read_bytes()
    ids = load_tokenizer(again)("7 + 8")["input_ids"]
    torch.testing.assert_close(logits(load_model(again), ids), logits(load_model(tiny_model), ids), rtol=0, atol=0)


def test_digits_are_single_tokens(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    ids = tokenizer("12345 + 678", add_special_tokens=False)["input_ids"]
    pieces = [tokenizer.decode([i]).strip() for i in ids]
    assert [p for p in pieces if p.isdigit()] == list("12345678")
    assert tokenizer.decode(ids) == "12345 + 678"


def test_loads_a_qwen2_family_checkpoint(tiny_model, tmp_path):
    tokenizer = load_tokenizer(tiny_model)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    Qwen2ForCausalLM(config).save_pretrained(tmp_path / "qwen")
    tokenizer.save_pretrained(tmp_path / "qwen")
    model = load_model(tmp_path / "qwen")
    assert model.config.model_type == "qwen2"
    assert logits(model, [1, 2, 3]).shape == (1, 3, len(tokenizer))


@pytest.mark.parametrize(
    "breakage, message",
    [
        (lambda d: shutil.rmtree(d), "model directory not found"),
        (lambda d: (d / "config.json").unlink(), "not an HF checkpoint \\(no config.json\\)"),
        (lambda d: (d / "config.json").write_text('{"model_type": "bert"}'), "model_type 'bert' is not supported"),
        (lambda d: (d / "config.json").write_text("{oops"), "config.json: not valid JSON"),
        (lambda d: (d / "model.safetensors").unlink(), "no weights"),
        (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer"),
    ],
)
def test_not_a_checkpoint_is_a_clear_error(tiny_model, tmp_path, breakage, message):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    breakage(broken)
    with pytest.raises(CheckpointError, match=message):
        load_model(broken)


def test_a_broken_tokenizer_config_is_named(tiny_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(tiny_model, broken)
    (broken / "tokenizer_config.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="tokenizer_config.json: not valid JSON"):
        load_tokenizer(broken)
