"""The MLflow model registry holding HF checkpoint directories.

A registered version's source is the run's ``model/`` artifact directory (an HF
checkpoint as-is, loadable by transformers and vLLM alike). ``resolve_model``
turns ``models:/name/3``, ``models:/name@alias`` or ``models:/name/latest`` back
into a local directory: the artifact directory itself when the store is local,
a download otherwise.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from urllib.parse import unquote, urlparse

import mlflow
from mlflow.exceptions import MlflowException
from mlflow.tracking import MlflowClient
from pydantic import BaseModel

from mlplat.errors import CheckpointError
from mlplat.models.checkpoint import validate_checkpoint_dir
from mlplat.tracking.runs import RunLogger, default_tracking_uri

MODEL_URI = re.compile(r"^models:/(?P<name>[^/@]+)(?:/(?P<version>\d+|latest)|@(?P<alias>[\w-]+))$")


class ModelRef(BaseModel):
    name: str
    version: str | None = None  # a number or "latest"
    alias: str | None = None

    @property
    def uri(self) -> str:
        return f"models:/{self.name}@{self.alias}" if self.alias else f"models:/{self.name}/{self.version}"


def parse_model_uri(uri: str) -> ModelRef:
    match = MODEL_URI.match(uri)
    if not match:
        raise CheckpointError(f"{uri!r}: expected models:/NAME/VERSION, models:/NAME/latest or models:/NAME@ALIAS")
    return ModelRef(**match.groupdict())


def register_model_dir(run_id: str, local_dir: str | Path, name: str, alias: str | None = None, tracking_uri: str | None = None) -> ModelRef:
    """Log an HF checkpoint directory as the run's ``model`` artifact and register it as a new version."""
    validate_checkpoint_dir(local_dir)
    return _register_version(run_id, local_dir, "model", name, "HF-format causal LM registered by mlplat", {}, alias, tracking_uri)


def _register_version(run_id: str, local_dir: str | Path, artifact_path: str, name: str, description: str, tags: dict[str, str],
                      alias: str | None, tracking_uri: str | None) -> ModelRef:  # fmt: skip
    """Log ``local_dir`` as the run's ``artifact_path`` artifact and register it as a new version of ``name`` (created
    with ``description`` if new), tagged ``tags``, under ``alias`` if given."""
    logger = RunLogger(run_id, tracking_uri)
    logger.log_artifacts(local_dir, artifact_path)
    client = logger.client
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description=description)
    source = f"{client.get_run(run_id).info.artifact_uri}/{artifact_path}"
    version = client.create_model_version(name, source=source, run_id=run_id, tags=tags or None)
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    return ModelRef(name=name, version=str(version.version))


def resolve_model(model: str | Path, download_dir: str | Path | None = None, tracking_uri: str | None = None) -> Path:
    """A local HF checkpoint directory for a path or a ``models:/`` URI."""
    model = str(model)
    if not model.startswith("models:/"):
        return validate_checkpoint_dir(model)
    return validate_checkpoint_dir(_version_dir(model, download_dir, tracking_uri)[0])


# A version holding only a LoRA adapter (peft's files) records the base model it was trained on under this tag.
BASE_MODEL_TAG = "mlplat.base_model"
ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class AdapterRef(BaseModel):
    path: Path  # local directory with peft's adapter files
    base_model: str | None = None  # what it was trained on: a models:/ URI or a path, as the training config named it


def register_adapter_dir(run_id: str, adapter_dir: str | Path, name: str, base_model: str, alias: str | None = None,
                         tracking_uri: str | None = None) -> ModelRef:  # fmt: skip
    """Log a LoRA adapter directory as the run's ``adapter`` artifact and register it alone (no base weights) as a new
    version of ``name``, tagged with the ``base_model`` it was trained on; serve it with ServeConfig.lora.adapters."""
    adapter_dir = Path(adapter_dir)
    missing = [f for f in ADAPTER_FILES if not (adapter_dir / f).is_file()]
    if missing:
        raise CheckpointError(f"{adapter_dir}: not a LoRA adapter directory ({', '.join(missing)} missing)")
    return _register_version(run_id, adapter_dir, "adapter", name, "LoRA adapter (peft format) by mlplat; serve it on its base model",
                             {BASE_MODEL_TAG: base_model}, alias, tracking_uri)  # fmt: skip


def resolve_adapter(adapter: str | Path, download_dir: str | Path | None = None, tracking_uri: str | None = None) -> AdapterRef:
    """A local LoRA adapter directory, and the base model it was trained on, for a path or a ``models:/`` URI."""
    adapter = str(adapter)
    if adapter.startswith("models:/"):
        local, tags = _version_dir(adapter, download_dir, tracking_uri)
        base = tags.get(BASE_MODEL_TAG)
    else:
        local, base = Path(adapter), None
    missing = [f for f in ADAPTER_FILES if not (local / f).is_file()]
    if missing:
        hint = " (a merged model? serve it as `model`)" if (local / "config.json").is_file() else ""
        raise CheckpointError(f"{adapter}: not a LoRA adapter ({', '.join(missing)} missing in {local}){hint}")
    if base is None:  # a directory: what peft wrote
        base = json.loads((local / ADAPTER_FILES[0]).read_text()).get("base_model_name_or_path")
    return AdapterRef(path=local, base_model=base)


def _version_dir(model: str, download_dir: str | Path | None, tracking_uri: str | None) -> tuple[Path, dict[str, str]]:
    """The local directory of a ``models:/`` URI's version (its artifacts; downloaded unless the store is local) and its tags."""
    ref = parse_model_uri(model)
    client = MlflowClient(tracking_uri or default_tracking_uri())
    try:
        if ref.alias:
            version = client.get_model_version_by_alias(ref.name, ref.alias)
        elif ref.version == "latest":
            versions = client.search_model_versions(f"name='{ref.name}'")
            if not versions:
                raise CheckpointError(f"{model}: registered model has no versions")
            version = max(versions, key=lambda v: int(v.version))
        else:
            version = client.get_model_version(ref.name, ref.version)
    except CheckpointError:
        raise
    except MlflowException as err:
        raise CheckpointError(f"{model}: not found in the registry at {client.tracking_uri} ({err.message})") from None
    source = client.get_model_version_download_uri(ref.name, version.version)
    parsed = urlparse(source)
    if parsed.scheme in ("", "file"):
        local = Path(unquote(parsed.path))
    else:
        dst = Path(download_dir) if download_dir else None
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=source, dst_path=dst, tracking_uri=client.tracking_uri))
    return local, dict(version.tags or {})
