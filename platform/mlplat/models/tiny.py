"""The tiny-model factory: a randomly initialised Llama checkpoint in HF format, made locally."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from mlplat.config import Config


class TinyModelConfig(Config):
    """Shape of the tiny Llama. Defaults: ~1.9M parameters, learns the demo task on 2 CPU cores."""

    vocab_size: int = 384
    hidden_size: int = 192
    intermediate_size: int = 512
    num_hidden_layers: int = 4
    num_attention_heads: int = 6
    num_key_value_heads: int = 2  # GQA, as in Llama 3 / Qwen2, so the engine's GQA path is exercised
    max_position_embeddings: int = 256
    rope_theta: float = 10000.0
    tie_word_embeddings: bool = True
    seed: int = 0


def build_tiny_model(out_dir: str | Path, corpus: Iterable[str], cfg: TinyModelConfig = TinyModelConfig()) -> Path:
    """Train a tokenizer on ``corpus`` and write config.json, model.safetensors,
    generation_config.json and tokenizer files (with the chat template) to ``out_dir``."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    from mlplat.models.tokenizer import train_chat_tokenizer

    out_dir = Path(out_dir)
    tokenizer = train_chat_tokenizer(corpus, vocab_size=cfg.vocab_size)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads,
        max_position_embeddings=cfg.max_position_embeddings,
        rope_theta=cfg.rope_theta,
        tie_word_embeddings=cfg.tie_word_embeddings,
        bos_token_id=None,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(cfg.seed)
    model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
