"""LoRA fine-tuning through peft: wrap a model, save/restore its adapter, export it merged.

A LoRA run trains only the adapter: checkpoints hold the adapter state (small) and
the optimizer, and the end of the run exports one plain HF checkpoint with the
adapter merged into the base weights, which transformers and the engine load like
any other model (nothing downstream needs to know about peft).
"""

from __future__ import annotations

import re
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
from pydantic import Field, field_validator
from safetensors.torch import load_file, save_file
from torch import nn
from torch.distributed.tensor import DTensor

from mlplat.config import Config
from mlplat.errors import CheckpointError, ConfigError

if TYPE_CHECKING:  # peft takes ~4 s to import, transformers ~3 s: a config check or a CLI error pays for neither
    import peft
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

ADAPTER = "default"  # peft's adapter name; we only ever train one
ADAPTER_WEIGHTS = "adapter_model.safetensors"  # peft's file name


class LoRAConfig(Config):
    r: int = Field(16, gt=0)  # rank of the update B @ A
    alpha: int = Field(32, gt=0)  # the update is scaled by alpha / r
    # Applied to the adapter's input, in train mode only.
    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    # Matched as peft does: a module whose dotted name equals an entry or ends with "." + entry.
    target_modules: list[str] = Field(
        default_factory=lambda: [
            "q_proj",
            "k_proj",
            "v_proj",
            "o_proj",
            "gate_proj",
            "up_proj",
            "down_proj",
        ],
        min_length=1,
    )
    # What the run registers in MLflow (registered_model): "merged", a plain checkpoint with the adapter merged in (servable
    # alone); "adapter", the adapter alone (peft's files, tagged with the base model), served by name on its base model
    # (ServeConfig.lora). Checkpoints hold both either way.
    register_as: Literal["merged", "adapter"] = "merged"

    @field_validator("target_modules")
    @classmethod
    def _names_not_blank(cls, names: list[str]) -> list[str]:
        if any(not n.strip() for n in names):
            raise ValueError("module names must not be empty")
        return names


def apply_lora(model: PreTrainedModel, cfg: LoRAConfig) -> peft.PeftModel:
    """Wrap ``model`` with LoRA adapters on ``cfg.target_modules``; only the adapters train.

    peft injects the adapters into ``model`` in place (its linear layers become LoRA
    layers, its weights are frozen), so use only the returned model afterwards. It is
    returned in train mode: peft's new layers start in train mode while
    ``from_pretrained`` leaves the rest in eval mode, and a half-and-half model would
    apply ``dropout`` in evaluation too. Call ``.eval()`` before evaluating.
    """
    import peft

    _check_target_modules(model, cfg.target_modules)
    lora = peft.LoraConfig(
        r=cfg.r,
        lora_alpha=cfg.alpha,
        lora_dropout=cfg.dropout,
        target_modules=list(cfg.target_modules),
        bias="none",
        task_type=peft.TaskType.CAUSAL_LM,
    )
    with warnings.catch_warnings():
        # peft 0.21 calls a transformers 5 API deprecated for v6; nothing for users to act on.
        warnings.filterwarnings(
            "ignore", message=".*is_gradient_checkpointing", category=FutureWarning
        )
        peft_model = peft.get_peft_model(model, lora)
    return peft_model.train()


def _matches(module_name: str, target: str) -> bool:
    return module_name == target or module_name.endswith("." + target)


def _check_target_modules(model: nn.Module, targets: list[str]) -> None:
    """Refuse targets peft would silently skip or fail on deep inside, naming what would work.

    peft ignores a misspelled name as long as another name matches something, so a
    typo would quietly train fewer layers than asked for; check every name up front.
    """
    from transformers import PreTrainedModel

    modules = dict(model.named_modules())
    is_hf = isinstance(model, PreTrainedModel)
    output = model.get_output_embeddings() if is_hf else None
    input_ = model.get_input_embeddings() if is_hf else None
    # A LoRA on a head that shares its weight with the input embeddings cannot be merged:
    # the merged weight would change the embeddings too (or, deduplicated on save, be lost).
    tied = output is not None and input_ is not None and output.weight is input_.weight
    linear = [
        n
        for n, m in modules.items()
        if isinstance(m, nn.Linear) and not (tied and m is output)
    ]
    available = ", ".join(dict.fromkeys(n.rpartition(".")[2] for n in linear))
    hint = f"{type(model).__name__}'s linear modules are: {available}"

    missing = [t for t in targets if not any(_matches(n, t) for n in modules)]
    if missing:
        names = ", ".join(repr(t) for t in missing)
        raise ConfigError(
            f"lora.target_modules: {names} {'matches' if len(missing) == 1 else 'match'} no module; {hint}"
        )
    for target in targets:
        for name, module in modules.items():
            if not _matches(name, target):
                continue
            if tied and module is output:
                raise ConfigError(
                    f"lora.target_modules: {target!r} selects {name}, which shares its weight with the input "
                    f"embeddings (tie_word_embeddings), so its adapter cannot be merged; {hint}"
                )
            if not isinstance(module, nn.Linear):
                raise ConfigError(
                    f"lora.target_modules: {target!r} selects {name} ({type(module).__name__}), "
                    f"which is not a linear layer; {hint}"
                )


def _unwrap(model: nn.Module) -> nn.Module:
    """The model inside a DDP (or similar ``.module``) wrapper, as ``train_apps`` unwrap it."""
    return (
        model.module
        if isinstance(model, nn.parallel.DistributedDataParallel)
        else model
    )


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` (possibly under DDP) carries LoRA adapters from ``apply_lora``."""
    peft = sys.modules.get("peft")  # never imported: nothing can be a PeftModel
    return peft is not None and isinstance(_unwrap(model), peft.PeftModel)


def _peft_model(model: nn.Module) -> peft.PeftModel:
    import peft

    model = _unwrap(model)
    if not isinstance(model, peft.PeftModel):
        raise TypeError(
            f"expected a model from apply_lora (a peft.PeftModel), got {type(model).__name__}"
        )
    return model


def trainable_parameter_counts(model: nn.Module) -> tuple[int, int]:
    """(trainable, total) parameter counts; tied weights count once."""
    params = list(_unwrap(model).parameters())  # a shared tensor is yielded once
    trainable = sum(p.numel() for p in params if p.requires_grad)
    return trainable, sum(p.numel() for p in params)


# An adapter weight in the model's state dict, e.g. "<layer>.lora_A.default.weight"; in
# the saved form (peft's adapter files) the adapter name is left out: "<layer>.lora_A.weight".
_ADAPTER_KEY = re.compile(rf"\.lora_[AB]\.{ADAPTER}\.weight$")


def _saved_key(key: str) -> str:
    return key.replace(f".{ADAPTER}.weight", ".weight")


def _adapter_keys(model: peft.PeftModel) -> dict[str, str]:
    """Saved form -> model state-dict key, for every adapter weight."""
    return {_saved_key(k): k for k in model.state_dict() if _ADAPTER_KEY.search(k)}


def adapter_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter weights only, as CPU copies under peft's saved names (``...lora_A.weight``).

    Safe to ``torch.save`` while training goes on; restore with
    :func:`load_adapter_state_dict` into a model from :func:`apply_lora` with the same
    :class:`LoRAConfig`. Under FSDP2 the shards are gathered: every rank must call it.
    Read from ``state_dict()`` rather than with ``peft.get_peft_model_state_dict``: peft
    0.21 finds adapter keys by module name, and activation checkpointing's wrappers put
    a prefix into module names that ``state_dict()`` leaves out, so peft returns nothing.
    """
    out = {}
    for key, value in _peft_model(model).state_dict().items():
        if _ADAPTER_KEY.search(key):
            value = value.full_tensor() if isinstance(value, DTensor) else value
            out[_saved_key(key)] = value.detach().to("cpu", copy=True)
    return out


def load_adapter_state_dict(model: nn.Module, state: dict[str, torch.Tensor]) -> None:
    """Copy adapter weights from :func:`adapter_state_dict` into ``model`` (in place, any device).

    Every adapter weight must be present and nothing else: a checkpoint made with
    another ``lora.r`` or target list fails here instead of resuming half-initialised.
    Under FSDP2, load before sharding the model (the weights here are full tensors).
    """
    peft_model = _peft_model(model)
    keys = _adapter_keys(peft_model)
    missing, unexpected = sorted(set(keys) - set(state)), sorted(set(state) - set(keys))
    if missing or unexpected:
        problems = [
            f"{len(names)} {what} (e.g. {names[0]})"
            for what, names in (("missing", missing), ("unexpected", unexpected))
            if names
        ]
        raise CheckpointError(
            "adapter weights do not match this model (different lora.target_modules?): "
            + ", ".join(problems)
        )
    try:
        peft_model.load_state_dict({keys[k]: v for k, v in state.items()}, strict=False)
    except RuntimeError as err:  # a shape mismatch: trained with another lora.r
        msg = f"adapter weights do not fit this model (different lora.r?): {err}"
        raise CheckpointError(msg.replace("\n", " ")) from None


def save_adapter(model: nn.Module, out_dir: str | Path) -> Path:
    """Write the adapter as peft does (``adapter_config.json``, ``adapter_model.safetensors``).

    Loadable by ``peft.PeftModel.from_pretrained`` and by :func:`load_adapter`. Written
    here rather than by ``PeftModel.save_pretrained`` for the reason given in
    :func:`adapter_state_dict` (which it calls: under FSDP2 every rank calls this).
    """
    out_dir = Path(out_dir)
    state = adapter_state_dict(model)
    out_dir.mkdir(parents=True, exist_ok=True)
    _peft_model(model).peft_config[ADAPTER].save_pretrained(str(out_dir))
    save_file(state, out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return out_dir


def save_adapter_from_state(model: nn.Module, state: dict[str, torch.Tensor], out_dir: str | Path) -> Path:
    """Write the adapter as :func:`save_adapter` does, from a full state dict of the ``PeftModel`` (e.g. gathered under
    FSDP2 by ``parallel.full_state_dict``): call it on one rank."""
    out_dir = Path(out_dir)
    adapter = {_saved_key(k): v.detach().to("cpu") for k, v in state.items() if _ADAPTER_KEY.search(k)}
    out_dir.mkdir(parents=True, exist_ok=True)
    _peft_model(model).peft_config[ADAPTER].save_pretrained(str(out_dir))
    save_file(adapter, out_dir / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    return out_dir


def load_adapter(model: nn.Module, adapter_dir: str | Path) -> None:
    """Load weights written by :func:`save_adapter` into a model from :func:`apply_lora`."""
    path = Path(adapter_dir) / ADAPTER_WEIGHTS
    if not path.is_file():
        raise CheckpointError(f"{adapter_dir}: no adapter weights ({ADAPTER_WEIGHTS})")
    load_adapter_state_dict(model, load_file(path))


def lora_scaling(model: nn.Module) -> float:
    """The factor peft applies to ``B @ A``: ``alpha / r`` for the configs :func:`apply_lora` makes."""
    cfg = _peft_model(model).peft_config[ADAPTER]
    if cfg.use_rslora or cfg.rank_pattern or cfg.alpha_pattern:
        raise NotImplementedError(
            "rsLoRA and per-module ranks/alphas are not supported by the merge"
        )
    return cfg.lora_alpha / cfg.r


@torch.no_grad()
def merge_lora_state_dict(
    state: dict[str, torch.Tensor], scaling: float
) -> dict[str, torch.Tensor]:
    """Merge a LoRA model's full state dict into plain HF names and weights.

    ``state`` holds plain tensors under peft's names, e.g. ``model.state_dict()`` of the
    ``PeftModel`` or a full gather of it under FSDP2 (``parallel.full_state_dict``):
    ``<layer>.base_layer.weight`` becomes ``<layer>.weight`` plus ``scaling * B @ A``
    (computed in float32, rounded once to the weight's dtype, as peft's merge does), and
    the adapter tensors are dropped. Merged weights are new CPU tensors; the others are
    passed through as they are.
    """
    state = {k.removeprefix("base_model.model."): v for k, v in state.items()}
    merged: dict[str, torch.Tensor] = {}
    for key, value in state.items():
        if ".lora_" in key:
            if not re.search(rf"\.lora_[AB]\.{ADAPTER}\.weight$", key):
                raise NotImplementedError(
                    f"{key}: only plain LoRA on linear layers can be merged"
                )
            continue
        layer, sep, param = key.rpartition(".base_layer.")
        if not sep:
            merged[key] = value
            continue
        if param == "weight":
            a = state[f"{layer}.lora_A.{ADAPTER}.weight"].float()
            b = state[f"{layer}.lora_B.{ADAPTER}.weight"].float()
            weight = value.float() + (b @ a) * scaling
            if not torch.isfinite(weight).all():
                raise ValueError(
                    f"{layer}: the merged weight has NaN/inf; the adapter has diverged"
                )
            value = weight.to(value.dtype).cpu()
        merged[f"{layer}.{param}"] = value
    return merged


def merge_and_export(
    model: nn.Module,
    out_dir: str | Path,
    tokenizer: PreTrainedTokenizerBase | None = None,
    state_dict: dict[str, torch.Tensor] | None = None,
) -> Path:
    """Save a plain HF checkpoint (config, safetensors, tokenizer if given) with the adapter merged.

    No adapter files and no peft config: ``AutoModelForCausalLM.from_pretrained`` and the
    engine load it as the base architecture. ``model`` is not modified (the merge is
    computed beside it, see :func:`merge_lora_state_dict`), so this can run mid-training;
    call it on one rank. Under FSDP2 pass ``state_dict``, the full state gathered by
    ``parallel.full_state_dict`` (a collective, so every rank calls that).
    """
    out_dir = Path(out_dir)
    peft_model = _peft_model(model)
    state = merge_lora_state_dict(
        peft_model.state_dict() if state_dict is None else state_dict,
        lora_scaling(peft_model),
    )
    # The base model's save_pretrained: the PeftModel's would write the adapter format.
    peft_model.get_base_model().save_pretrained(
        out_dir, state_dict=state, safe_serialization=True
    )
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)
    return out_dir
