"""HF-format checkpoints: the tiny-model factory, the chat tokenizer, loading and saving."""

from mlplat.models.checkpoint import load_model, load_reward_model, load_tokenizer, validate_checkpoint_dir
from mlplat.models.tiny import TinyModelConfig, build_tiny_model

__all__ = [
    "TinyModelConfig",
    "build_tiny_model",
    "load_model",
    "load_reward_model",
    "load_tokenizer",
    "validate_checkpoint_dir",
]
