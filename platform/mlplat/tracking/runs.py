"""MLflow runs. The embedded default is ``sqlite:///mlflow.db`` in the working directory
with artifacts beside it; ``MLFLOW_TRACKING_URI`` points everything at a real server.

Runs are created on the driver; training workers log to them by run id through an
``MlflowClient`` (no process-global active run), so any rank can log if asked to.
"""

from __future__ import annotations

import os
from pathlib import Path

import mlflow
from mlflow.tracking import MlflowClient

DEFAULT_DB = "mlflow.db"
DEFAULT_ARTIFACTS = "mlartifacts"


def default_tracking_uri() -> str:
    """``MLFLOW_TRACKING_URI`` if set, else an absolute sqlite URI for ./mlflow.db.

    Absolute, so Ray workers whose working directory differs reach the same store.
    """
    uri = os.environ.get("MLFLOW_TRACKING_URI")
    if uri:
        return uri
    return f"sqlite:///{Path(DEFAULT_DB).resolve()}"


def _local_artifact_root(tracking_uri: str) -> str | None:
    """For a local sqlite store, keep artifacts next to the database file."""
    if tracking_uri.startswith("sqlite:///"):
        db = Path(tracking_uri.removeprefix("sqlite:///"))
        return (db.parent / DEFAULT_ARTIFACTS).resolve().as_uri()
    return None


def ensure_experiment(client: MlflowClient, name: str, tracking_uri: str) -> str:
    experiment = client.get_experiment_by_name(name)
    if experiment is not None:
        return experiment.experiment_id
    return client.create_experiment(name, artifact_location=_local_artifact_root(tracking_uri))


def start_run(experiment: str, run_name: str | None = None, params: dict | None = None, tags: dict | None = None, tracking_uri: str | None = None) -> str:
    """Create a run (left open for workers to log into) and return its id."""
    tracking_uri = tracking_uri or default_tracking_uri()
    client = MlflowClient(tracking_uri)
    experiment_id = ensure_experiment(client, experiment, tracking_uri)
    run = client.create_run(experiment_id, run_name=run_name, tags=tags or {})
    logger = RunLogger(run.info.run_id, tracking_uri)
    if params:
        logger.log_params(params)
    return run.info.run_id


class RunLogger:
    """Logs into an existing run by id; picklable, so it can travel to Ray workers."""

    def __init__(self, run_id: str, tracking_uri: str | None = None):
        self.run_id = run_id
        self.tracking_uri = tracking_uri or default_tracking_uri()

    @property
    def client(self) -> MlflowClient:
        return MlflowClient(self.tracking_uri)

    def log_params(self, params: dict) -> None:
        items = [mlflow.entities.Param(k, str(v)[:6000]) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow caps a batch at 100 params
            self.client.log_batch(self.run_id, params=items[i : i + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        import time

        ts = int(time.time() * 1000)
        items = [mlflow.entities.Metric(k, float(v), ts, step or 0) for k, v in metrics.items()]
        self.client.log_batch(self.run_id, metrics=items)

    def set_tags(self, tags: dict) -> None:
        self.client.log_batch(self.run_id, tags=[mlflow.entities.RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifacts(self, local_dir: str | Path, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(local_dir), artifact_path)

    def log_dict(self, data: dict, artifact_file: str) -> None:
        self.client.log_dict(self.run_id, data, artifact_file)

    def end(self, status: str = "FINISHED") -> None:
        self.client.set_terminated(self.run_id, status=status)
