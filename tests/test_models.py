"""The tiny-model factory, the chat tokenizer, and loading local HF checkpoints."""

import json
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
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


# -- real models' shapes (mlplat.models.shapes): what the benchmarks' `--shape` builds ----------------------------
def meta_models(shape):
    """HF's model and the engine's, built from ``shape`` on the meta device (no memory)."""
    from transformers import AutoModelForCausalLM

    from mlplat.engine.model import CausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shape.hf_config()), CausalLM(shape.hf_config(), max_positions=64)


def test_qwen25_05b_shape_is_the_published_config():
    from mlplat.models.shapes import SHAPES

    shape = SHAPES["qwen2.5-0.5b"]
    numbers = ("num_hidden_layers", "hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rope_theta", "vocab_size", "tie_word_embeddings")  # fmt: skip
    assert {k: getattr(shape, k) for k in numbers} == dict(zip(numbers, (24, 896, 4864, 14, 2, 64, 1e6, 151_936, True)))
    config = shape.hf_config()
    in_config = [k for k in numbers if k not in ("head_dim", "rope_theta")]
    assert config.model_type == "qwen2" and {k: getattr(config, k) for k in in_config} == {k: getattr(shape, k) for k in in_config}
    assert config.rope_parameters == {"rope_type": "default", "rope_theta": 1e6}  # transformers 5 keeps rope_theta here
    hf, engine = meta_models(shape)
    attention = hf.model.layers[0].self_attn
    assert all(getattr(attention, p).bias is not None for p in ("q_proj", "k_proj", "v_proj")) and attention.o_proj.bias is None
    assert hf.lm_head.weight is hf.model.embed_tokens.weight  # tied
    assert shape.num_parameters() == sum(p.numel() for p in hf.parameters()) == 494_032_768  # the release's count
    assert engine.layers[0].self_attn.qkv_proj.bias is not None and engine.lm_head.weight is engine.embed_tokens.weight


@st.composite
def model_shapes(draw):
    from mlplat.models.shapes import ModelShape

    kv_heads = draw(st.integers(1, 4))
    heads = kv_heads * draw(st.integers(1, 4))
    return ModelShape(name="drawn", vocab_size=draw(st.integers(8, 4096)), hidden_size=heads * 2 * draw(st.integers(1, 16)),
                      intermediate_size=draw(st.integers(1, 256)), num_hidden_layers=draw(st.integers(1, 3)), num_attention_heads=heads,
                      num_key_value_heads=kv_heads, tie_word_embeddings=draw(st.booleans()))  # fmt: skip


@settings(max_examples=25, deadline=None)
@given(model_shapes())
def test_any_shape_loads_into_the_engine_weight_for_weight(shape):
    """Every tensor of the shape's HF checkpoint lands on an engine parameter of the same shape (q/k/v biases
    included, a tied head once), and the parameter count is the shape's own."""
    from mlplat.engine.model import hf_state_dict_to_engine

    hf, engine = meta_models(shape)
    mapped = dict(hf_state_dict_to_engine(hf.state_dict().items(), hf.config))
    params = dict(engine.named_parameters())  # a tied head's weight is the embedding's: named once
    assert {k: tuple(v.shape) for k, v in mapped.items()} == {k: tuple(v.shape) for k, v in params.items()}
    assert sum(p.numel() for p in hf.parameters()) == sum(p.numel() for p in params.values()) == shape.num_parameters()
    assert all(layer.self_attn.qkv_proj.bias is not None for layer in engine.layers)


def test_a_random_model_of_a_shape_serves_greedy_equal_to_transformers(demo_data, tmp_path):
    """build_random_model at the real vocabulary (151,936) with narrow layers: the engine's greedy tokens are
    `generate`'s (tied head, q/k/v biases, rope_theta 1e6), on the tiny tokenizer's ids."""
    from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
    from mlplat.models.shapes import SHAPES, build_random_model

    narrow = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    shape = SHAPES["qwen2.5-0.5b"].model_copy(update=narrow)
    model_dir = build_random_model(tmp_path / "model", shape, tokenizer_corpus(demo_data.sft))
    tokenizer, hf = load_tokenizer(model_dir), load_model(model_dir)
    assert hf.config.vocab_size == 151_936 > len(tokenizer) and hf.config.tie_word_embeddings
    assert hf.config.rope_parameters["rope_theta"] == 1e6  # saved and loaded back: both sides rotate at the shape's base
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 12 + 34?", "7 + 8 =")]
    engine = LLMEngine(EngineConfig(model=str(model_dir), block_size=16, num_kv_blocks=64))
    outs = engine.generate(prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    with torch.no_grad():
        for prompt, out in zip(prompts, outs):
            expected = hf.generate(torch.tensor([prompt]), max_new_tokens=8, min_new_tokens=8, do_sample=False)[0, len(prompt) :]
            assert out.outputs[0].token_ids == expected.tolist()
