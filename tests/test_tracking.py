"""MLflow runs and the registry round trip: register an HF directory, resolve models:/ URIs."""

import filecmp

import pytest
from mlflow.tracking import MlflowClient

from mlplat.errors import CheckpointError
from mlplat.tracking import RunLogger, parse_model_uri, register_model_dir, resolve_model, start_run
from mlplat.tracking.runs import default_tracking_uri


def same_files(a, b) -> bool:
    cmp = filecmp.dircmp(a, b)
    return not cmp.left_only and not cmp.right_only and not filecmp.cmpfiles(a, b, cmp.common_files, shallow=False)[1]


def test_default_store_is_local_sqlite(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.chdir(tmp_path)
    assert default_tracking_uri() == f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = start_run("defaults", params={"a": 1})
    assert (tmp_path / "mlflow.db").is_file()
    assert MlflowClient(default_tracking_uri()).get_run(run_id).info.artifact_uri.startswith((tmp_path / "mlartifacts").as_uri())


def test_registry_round_trip(tracking_uri, tiny_model, tmp_path):
    run_id = start_run("registry", params={"lr": 1e-3})
    logger = RunLogger(run_id)
    logger.log_metrics({"loss": 2.0}, step=1)
    first = register_model_dir(run_id, tiny_model, "tiny", alias="champion")
    second = register_model_dir(run_id, tiny_model, "tiny")
    assert (first.version, second.version) == ("1", "2")

    for uri in ("models:/tiny/1", "models:/tiny@champion", "models:/tiny/latest"):
        local = resolve_model(uri)
        assert same_files(local, tiny_model), uri
    client = MlflowClient(tracking_uri)
    assert str(client.get_model_version_by_alias("tiny", "champion").version) == "1"
    assert client.get_run(run_id).data.params["lr"] == "0.001"


def test_resolve_errors(tracking_uri, tiny_model):
    with pytest.raises(CheckpointError, match="not found in the registry"):
        resolve_model("models:/missing/1")
    with pytest.raises(CheckpointError, match="expected models:/NAME/VERSION"):
        parse_model_uri("models:/a/b/c")
    with pytest.raises(CheckpointError, match="model directory not found"):
        resolve_model("/no/such/dir")
    assert resolve_model(str(tiny_model)) == tiny_model
