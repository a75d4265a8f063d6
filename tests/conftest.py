"""Shared fixtures: one local Ray cluster per session, small demo data and a tiny model."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
MLPLAT = str(Path(sys.executable).with_name("mlplat"))  # the console script of the venv running the tests
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from mlplat.runtime import init_ray

    # The embedded local cluster, as `mlplat` starts it: on 2 cores it advertises 4 CPUs,
    # so that two training workers and the data pipeline's tasks are schedulable at once.
    init_ray(num_training_workers=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    from mlplat.data.demo import DemoDataConfig, write_demo_data

    cfg = DemoDataConfig(sft_rows=2000, eval_rows=100, preference_rows=200, rl_rows=200)
    return write_demo_data(tmp_path_factory.mktemp("demo"), cfg)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, demo_data) -> Path:
    from mlplat.data.demo import tokenizer_corpus
    from mlplat.models import build_tiny_model

    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "model", tokenizer_corpus(demo_data.sft))


@pytest.fixture
def tracking_uri(tmp_path, monkeypatch) -> str:
    """A fresh sqlite MLflow store per test, set the way users set it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri
