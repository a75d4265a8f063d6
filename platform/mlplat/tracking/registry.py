"""The MLflow model registry holding HF checkpoint directories.

A registered version's source is the run's ``model/`` artifact directory (an HF
checkpoint as-is, loadable by transformers and vLLM alike). ``resolve_model``
turns ``models:/name/3``, ``models:/name@alias`` or ``models:/name/latest`` back
into a local directory: the artifact directory itself when the store is local,
a download otherwise.
"""

from __future__ import annotations

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
    logger = RunLogger(run_id, tracking_uri)
    logger.log_artifacts(local_dir, "model")
    client = logger.client
    try:
        client.get_registered_model(name)
    except MlflowException:
        client.create_registered_model(name, description="HF-format causal LM registered by mlplat")
    source = f"{client.get_run(run_id).info.artifact_uri}/model"
    version = client.create_model_version(name, source=source, run_id=run_id)
    if alias:
        client.set_registered_model_alias(name, alias, version.version)
    return ModelRef(name=name, version=str(version.version))


def resolve_model(model: str | Path, download_dir: str | Path | None = None, tracking_uri: str | None = None) -> Path:
    """A local HF checkpoint directory for a path or a ``models:/`` URI."""
    model = str(model)
    if not model.startswith("models:/"):
        return validate_checkpoint_dir(model)
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
    return validate_checkpoint_dir(local)
