"""MLflow tracking: runs, metrics from training workers, the model registry and `models:/` URIs."""

from mlplat.tracking.registry import (
    AdapterRef,
    ModelRef,
    parse_model_uri,
    register_adapter_dir,
    register_model_dir,
    resolve_adapter,
    resolve_model,
)
from mlplat.tracking.runs import RunLogger, default_tracking_uri, start_run

__all__ = [
    "AdapterRef",
    "ModelRef",
    "RunLogger",
    "default_tracking_uri",
    "parse_model_uri",
    "register_adapter_dir",
    "register_model_dir",
    "resolve_adapter",
    "resolve_model",
    "start_run",
]
