"""Real models' shapes with random weights: scale checks without downloading anything.

A benchmark or estimate that claims something "at a real model's size" builds the model from
one of these shapes (the published configs of Qwen2.5, with q/k/v biases and tied embeddings
where the release has them) and random weights; the tokenizer is the locally trained tiny one,
whose ids all fall inside the real vocabulary.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from mlplat.config import Config


class ModelShape(Config):
    """The numbers that decide a Qwen2-family model's compute and memory."""

    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    rope_theta: float = 1_000_000.0
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 32768

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self) -> int:
        """Every weight and bias, the tied embedding once."""
        h, kv = self.hidden_size, self.num_key_value_heads * self.head_dim
        attention = h * h + 2 * h * kv + h * h + h + 2 * kv  # q, k, v, o weights; q, k, v biases
        mlp = 3 * h * self.intermediate_size
        layer = attention + mlp + 2 * h  # two RMSNorms
        embeddings = self.vocab_size * h * (1 if self.tie_word_embeddings else 2)
        return self.num_hidden_layers * layer + embeddings + h  # final norm

    def hf_config(self, eos_token_id: int | None = None, pad_token_id: int | None = None):
        from transformers import Qwen2Config

        return Qwen2Config(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size, intermediate_size=self.intermediate_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, rope_theta=self.rope_theta, tie_word_embeddings=self.tie_word_embeddings,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=1e-6, bos_token_id=None,
            eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        )  # fmt: skip


SHAPES = {
    "qwen2.5-0.5b": ModelShape(name="qwen2.5-0.5b", vocab_size=151_936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                               num_attention_heads=14, num_key_value_heads=2, tie_word_embeddings=True),
    "qwen2.5-7b": ModelShape(name="qwen2.5-7b", vocab_size=152_064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                             num_attention_heads=28, num_key_value_heads=4, tie_word_embeddings=False),
}  # fmt: skip


def build_random_model(out_dir: str | Path, shape: ModelShape, corpus: Iterable[str], seed: int = 0) -> Path:
    """An HF checkpoint of ``shape`` with random weights and the tiny chat tokenizer trained on ``corpus``."""
    import torch
    from transformers import AutoModelForCausalLM, GenerationConfig

    from mlplat.models.tokenizer import train_chat_tokenizer

    out_dir = Path(out_dir)
    tokenizer = train_chat_tokenizer(corpus)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(shape.hf_config(tokenizer.eos_token_id, tokenizer.pad_token_id))
    model.generation_config = GenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=False)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    return out_dir
