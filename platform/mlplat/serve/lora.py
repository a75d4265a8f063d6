"""LoRA adapters of a serve config (ServeConfig.lora), resolved for the native engine and the ingress.

Each adapter (a models:/ URI of a version holding only the adapter, or a peft directory) resolves to local files,
which every engine replica reads on first use (engine.lora). An adapter recorded as trained on another base model
is not handed to the engines: the ingress answers its requests with a 400 that says so. Adapters whose shapes do
not fit the model are refused by the engine when first used (also a 400).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from mlplat.errors import CheckpointError
from mlplat.serve.config import LoRAServingConfig
from mlplat.tracking import parse_model_uri, resolve_adapter, resolve_model


@dataclass
class ResolvedAdapters:
    paths: dict[str, str] = field(default_factory=dict)  # served name -> local adapter directory (to the engines)
    refused: dict[str, str] = field(default_factory=dict)  # served name -> why it cannot run on this model (to the ingress)

    def engine_config(self, lora: LoRAServingConfig) -> dict:
        """EngineConfig.lora's fields."""
        return {"max_loras": lora.max_loras, "max_lora_rank": lora.max_lora_rank, "max_cpu_loras": lora.max_cpu_loras,
                "adapters": dict(self.paths)}


def _same_model(base: str, model: str, model_dir: Path) -> bool:
    """Whether ``base`` (what the adapter was trained on) names the served model: the same string, the same registered
    model (any version: the adapter's shapes are checked by the engine), or the same directory."""
    if base == model:
        return True
    if base.startswith("models:/") and model.startswith("models:/"):
        return parse_model_uri(base).name == parse_model_uri(model).name
    try:
        return resolve_model(base).resolve() == model_dir.resolve()
    except (CheckpointError, OSError):  # recorded as a path that is not here (trained elsewhere): nothing to compare with
        return not base.startswith("models:/")


def resolve_adapters(lora: LoRAServingConfig, model: str, model_dir: Path, model_name: str) -> ResolvedAdapters:
    """Every adapter's local files, and those refused for a mismatched base model; a name that clashes with the base
    model's, or an adapter that cannot be found, is a ValueError (a config error: nothing can serve it)."""
    out = ResolvedAdapters()
    for name, source in lora.adapters.items():
        if name == model_name:
            raise ValueError(f"lora.adapters: {name!r} is the base model's served name; give the adapter another name")
        try:
            ref = resolve_adapter(source)
        except CheckpointError as err:
            raise ValueError(f"lora.adapters.{name}: {err}") from None
        if ref.base_model is not None and not _same_model(ref.base_model, model, model_dir):
            out.refused[name] = f"adapter {name!r} was trained for another base model ({ref.base_model}); this server runs {model}"
            continue
        out.paths[name] = str(ref.path)
    return out
