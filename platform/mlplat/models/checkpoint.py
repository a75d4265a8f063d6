"""Load and check local HF checkpoints (Llama / Qwen2 / Mistral family). Never downloads."""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from mlplat.errors import CheckpointError

if TYPE_CHECKING:  # torch and transformers import only to load a model (~5 s): checkpoint checks and CLI errors need neither
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SUPPORTED_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")


def _read_json(file: Path) -> dict:
    try:
        return json.loads(file.read_text())
    except json.JSONDecodeError as err:
        raise CheckpointError(f"{file}: not valid JSON ({err})") from None


def validate_checkpoint_dir(path: str | Path) -> Path:
    """Check that ``path`` is an HF causal-LM checkpoint we can load; say what is missing if not."""
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: model directory not found")
    config_file = path / "config.json"
    if not config_file.is_file():
        raise CheckpointError(f"{path}: not an HF checkpoint (no config.json)")
    model_type = _read_json(config_file).get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"{config_file}: model_type {model_type!r} is not supported; "
            f"expected one of {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    if not any((path / f).is_file() for f in WEIGHT_FILES):
        raise CheckpointError(f"{path}: no weights (expected one of {', '.join(WEIGHT_FILES)})")
    if not any((path / f).is_file() for f in TOKENIZER_FILES):
        raise CheckpointError(f"{path}: no tokenizer (expected one of {', '.join(TOKENIZER_FILES)})")
    return path


# tokenizer_config.json classes that are the generic tokenizers-backed tokenizer (Llama 3, ours).
GENERIC_TOKENIZER_CLASSES = {"PreTrainedTokenizerFast", "TokenizersBackend"}


def load_tokenizer(path: str | Path) -> PreTrainedTokenizerBase:
    path = validate_checkpoint_dir(path)
    config_file = path / "tokenizer_config.json"
    tokenizer_class = _read_json(config_file).get("tokenizer_class") if config_file.is_file() else None
    if tokenizer_class in GENERIC_TOKENIZER_CLASSES and (path / "tokenizer.json").is_file():
        # The class AutoTokenizer would pick, without importing AutoTokenizer: that pulls in torch and
        # the model registry (~4 s), which every Ray Data tokenizer process would pay before its first row.
        from transformers import PreTrainedTokenizerFast as tokenizer_type
    else:
        from transformers import AutoTokenizer as tokenizer_type
    tokenizer = tokenizer_type.from_pretrained(path, local_files_only=True)
    if tokenizer.chat_template is None:
        raise CheckpointError(f"{path}: the tokenizer has no chat template (tokenizer_config.json)")
    return tokenizer


def load_model(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> PreTrainedModel:
    """The checkpoint as a transformers causal LM, in ``dtype`` (default float32) on ``device``."""
    import torch
    from transformers import AutoModelForCausalLM

    path = validate_checkpoint_dir(path)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype or torch.float32, local_files_only=True)
    return model.to(device)


def load_reward_model(path: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu") -> PreTrainedModel:
    """A scalar-head model (``*ForSequenceClassification``, one label) from a reward model or a causal-LM checkpoint.

    From a causal LM the head is new (randomly initialised) and the LM head is dropped.
    The score is read at each row's last non-pad token, so the config must know the pad id.
    """
    import torch
    from transformers import AutoModelForSequenceClassification

    path = validate_checkpoint_dir(path)
    with _quiet_transformers():  # "newly initialised weights: score.weight" is the point, not a warning
        model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype or torch.float32, local_files_only=True)
    if model.config.pad_token_id is None:
        model.config.pad_token_id = load_tokenizer(path).pad_token_id
    return model.to(device)


@contextmanager
def _quiet_transformers():
    from transformers.utils import logging

    level = logging.get_verbosity()
    logging.set_verbosity_error()
    try:
        yield
    finally:
        logging.set_verbosity(level)
