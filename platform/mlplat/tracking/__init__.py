"""MLflow tracking: runs, metrics from training workers, the model registry and `models:/` URIs."""

from mlplat.tracking.registry import ModelRef, parse_model_uri, register_model_dir, resolve_model
from mlplat.tracking.runs import RunLogger, default_tracking_uri, start_run

__all__ = [
    "ModelRef",
    "RunLogger",
    "default_tracking_uri",
    "parse_model_uri",
    "register_model_dir",
    "resolve_model",
    "start_run",
]
