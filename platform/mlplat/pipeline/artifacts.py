"""Step outputs that are files: datasets, checkpoints and models, passed between steps as URIs.

A step returns ``Dataset("/scratch/data")`` (a local path on whatever node ran it); before
the output leaves the step, the directory is logged as an artifact of the step's MLflow run
and the output becomes ``Dataset("runs:/<run>/outputs/data")``. A registered model is passed
as ``Model("models:/name/3")``. The next step, on any node, calls ``.local_path()``: the
artifact directory itself when the store is local, a download otherwise. No blob is pickled.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import unquote, urlparse

import mlflow
from mlflow.tracking import MlflowClient
from pydantic import BaseModel

from mlplat.errors import MlplatError

# Step tasks import this module: it stays clear of mlplat.tracking, which imports torch and
# transformers (seconds per fresh worker) for model loading that only Model inputs need.

ARTIFACT_KEY = "$artifact"  # marks an artifact in JSON (outputs.json, cache keys)
OUTPUTS_DIR = "outputs"  # where a step run's file outputs live among its MLflow artifacts


@dataclass(frozen=True)
class Artifact:
    """A file or directory produced by a step: a local path until published, then a URI."""

    uri: str
    kind: ClassVar[str] = "artifact"

    def __init__(self, uri: str | Path):
        object.__setattr__(self, "uri", str(uri))

    @property
    def is_local(self) -> bool:
        return not self.uri.startswith(("runs:/", "models:/")) and "://" not in self.uri

    def local_path(self, download_dir: str | Path | None = None, tracking_uri: str | None = None) -> Path:
        """A local path to the files: the path itself, the local artifact store, or a download."""
        if self.is_local:
            return Path(self.uri)
        tracking_uri = tracking_uri or current_tracking_uri()
        if self.uri.startswith("runs:/"):
            run_id, _, path = self.uri.removeprefix("runs:/").partition("/")
            location = f"{MlflowClient(tracking_uri).get_run(run_id).info.artifact_uri}/{path}"
        else:
            location = self.uri
        parsed = urlparse(location)
        if parsed.scheme in ("", "file"):
            return Path(unquote(parsed.path))
        dst = str(download_dir) if download_dir else None
        return Path(mlflow.artifacts.download_artifacts(artifact_uri=location, dst_path=dst, tracking_uri=tracking_uri))


class Dataset(Artifact):
    kind = "dataset"


class Checkpoint(Artifact):
    kind = "checkpoint"


class Model(Artifact):
    """An HF checkpoint: a local directory, a published run artifact, or a registry URI ``models:/NAME/VERSION``."""

    kind = "model"

    def local_path(self, download_dir: str | Path | None = None, tracking_uri: str | None = None) -> Path:
        if self.uri.startswith("models:/"):
            from mlplat.tracking import resolve_model

            return resolve_model(self.uri, download_dir=download_dir, tracking_uri=tracking_uri or current_tracking_uri())
        return super().local_path(download_dir, tracking_uri)


def current_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` (which a pipeline sets for its steps), else mlplat's embedded default."""
    if uri := os.environ.get("MLFLOW_TRACKING_URI"):
        return uri
    from mlplat.tracking import default_tracking_uri

    return default_tracking_uri()


ARTIFACT_TYPES: dict[str, type[Artifact]] = {cls.kind: cls for cls in (Artifact, Dataset, Checkpoint, Model)}


def map_values(value: Any, fn) -> Any:
    """Apply ``fn`` to every leaf of nested dicts, lists and tuples (pydantic models are leaves)."""
    if isinstance(value, dict):
        return {k: map_values(v, fn) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_values(v, fn) for v in value)
    return fn(value)


def to_json(value: Any) -> Any:
    """A JSON value for outputs.json and cache keys; artifacts become ``{"$artifact": kind, "uri": ...}``."""
    from pydantic_core import to_jsonable_python

    def leaf(v):
        if isinstance(v, Artifact):
            return {ARTIFACT_KEY: v.kind, "uri": v.uri}
        if isinstance(v, BaseModel):
            return to_json(dict(v))  # keeps artifacts inside models recognisable
        return to_jsonable_python(v)

    return map_values(value, leaf)


def from_json(value: Any) -> Any:
    """Inverse of ``to_json`` for artifacts (other values stay JSON)."""
    if isinstance(value, dict) and ARTIFACT_KEY in value:
        return ARTIFACT_TYPES[value[ARTIFACT_KEY]](value["uri"])
    if isinstance(value, dict):
        return {k: from_json(v) for k, v in value.items()}
    if isinstance(value, list):
        return [from_json(v) for v in value]
    return value


def publish(value: Any, client: MlflowClient, run_id: str, lineage: dict[str, str]) -> Any:
    """Log local artifacts in a step's output to its run; tag registered models with their lineage.

    Each artifact is named by where it sits in the output (``outputs/model``, ``outputs/splits/train``).
    """

    def walk(v: Any, where: tuple[str, ...]) -> Any:
        if isinstance(v, Artifact):
            return _publish_one(v, "/".join(where) or "output", client, run_id, lineage)
        if isinstance(v, BaseModel):
            v = dict(v)
        if isinstance(v, dict):
            return {k: walk(x, (*where, str(k))) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [walk(x, (*where, str(i))) for i, x in enumerate(v)]
        return v

    return walk(value, ())


MODEL_VERSION_URI = re.compile(r"^models:/(?P<name>[^/@]+)/(?P<version>\d+)$")


def _publish_one(artifact: Artifact, name: str, client: MlflowClient, run_id: str, lineage: dict[str, str]) -> Artifact:
    if version := MODEL_VERSION_URI.match(artifact.uri):  # a fixed registry version: record which run and inputs made it
        for key, value in lineage.items():
            client.set_model_version_tag(version["name"], version["version"], key, value[:5000])
        return artifact
    if not artifact.is_local:
        return artifact  # already a URI (e.g. an input passed through)
    path = Path(artifact.uri)
    if not path.exists():
        raise MlplatError(f"output {name!r}: {type(artifact).__name__} path {path} does not exist")
    target = f"{OUTPUTS_DIR}/{name}"
    if path.is_dir():
        client.log_artifacts(run_id, str(path), target)
        return type(artifact)(f"runs:/{run_id}/{target}")
    client.log_artifact(run_id, str(path), target)
    return type(artifact)(f"runs:/{run_id}/{target}/{path.name}")
