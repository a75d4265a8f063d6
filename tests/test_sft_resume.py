"""SFT that survives: restart after a killed worker, NaN abort (exact resume: tests/test_sft.py).

All on the real local Ray cluster with 2 gloo workers; losses come from the real MLflow store.
"""

import contextlib
import os
import signal
import threading
import time

import psutil
import pytest
from mlflow.tracking import MlflowClient

from mlplat.data.sft import SFTDataConfig
from mlplat.train.optim import OptimizerConfig
from train_apps.sft import SFTConfig, run_sft


def _config(demo_data, tiny_model, tmp_path, **overrides) -> SFTConfig:
    base = {
        "model": str(tiny_model),
        "data": SFTDataConfig(path=str(demo_data.sft), pack=True, max_seq_len=64),
        "optim": OptimizerConfig(lr=2e-3, warmup_steps=5),
        "max_steps": 20,
        "batch_size_per_worker": 4,
        "num_workers": 2,
        "log_every": 1,
        "checkpoint_every": 10,
        "num_checkpoints_to_keep": None,
        "storage_path": str(tmp_path / "ray_train"),
        "experiment": "test-sft-resume",
        "registered_model": None,
    }
    return SFTConfig(**(base | overrides))


def _losses(tracking_uri: str, run_id: str) -> dict[int, float]:
    return {m.step: m.value for m in MlflowClient(tracking_uri).get_metric_history(run_id, "loss")}


def _train_worker_pids() -> list[int]:
    """Ray Train worker processes of this test session's cluster (descendants of this process)."""
    pids = []
    for proc in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if " ".join(proc.cmdline()).startswith("ray::RayTrainWorker"):
                pids.append(proc.pid)
    return pids


def _kill_a_worker_after_step(tracking_uri: str, experiment: str, step: int, killed: dict) -> None:
    """Wait until the running job has logged ``step``, then SIGKILL one Ray Train worker process."""
    client = MlflowClient(tracking_uri)
    deadline = time.time() + 300
    while time.time() < deadline:
        exp = client.get_experiment_by_name(experiment)
        runs = client.search_runs([exp.experiment_id], "attributes.status = 'RUNNING'") if exp else []
        if runs and any(m.step >= step for m in client.get_metric_history(runs[0].info.run_id, "loss")):
            killed["at_step"] = max(m.step for m in client.get_metric_history(runs[0].info.run_id, "loss"))
            victim = max(_train_worker_pids())
            os.kill(victim, signal.SIGKILL)
            killed["pid"] = victim
            return
        time.sleep(0.1)


@pytest.mark.slow
def test_killed_worker_restores_from_last_checkpoint_and_finishes(ray_cluster, tracking_uri, demo_data, tiny_model, tmp_path):
    cfg = _config(
        demo_data, tiny_model, tmp_path,
        max_steps=60, log_every=2, checkpoint_every=10, checkpoint_format="consolidated", max_failures=1,
        experiment="test-sft-worker-loss",
    )  # fmt: skip
    killed = {}
    killer = threading.Thread(target=_kill_a_worker_after_step, args=(tracking_uri, cfg.experiment, 24, killed), daemon=True)
    killer.start()
    result = run_sft(cfg, tracking_uri, tmp_path / "out")
    killer.join(timeout=5)
    assert "pid" in killed, "the worker was never killed"

    client = MlflowClient(tracking_uri)
    history = client.get_metric_history(result.run_id, "loss")
    restored = client.get_metric_history(result.run_id, "restored_from_step")
    assert len(restored) == 1, restored  # one restart
    restored_step = int(restored[0].value)
    # Restored from the last checkpoint before the kill: lost at most the steps since then.
    assert restored_step % 10 == 0 and 10 <= restored_step <= killed["at_step"] + 10, (restored_step, killed)
    assert max(m.step for m in history) == 60
    # Replayed steps (logged before the kill and again after the restore) saw the same data: same loss.
    by_step = {}
    for m in sorted(history, key=lambda m: m.timestamp):
        by_step.setdefault(m.step, []).append(m.value)
    replayed = [values for step, values in by_step.items() if len(values) > 1]
    for values in replayed:
        assert values[1] == pytest.approx(values[0], rel=1e-5, abs=1e-6)
    assert result.final_loss < result.first_loss


@pytest.mark.slow
def test_diverging_run_aborts_with_a_clear_message(ray_cluster, tracking_uri, demo_data, tiny_model, tmp_path):
    cfg = _config(demo_data, tiny_model, tmp_path, optim=OptimizerConfig(lr=1e30, warmup_steps=1), max_bad_steps_in_row=3, num_workers=1)
    with pytest.raises(Exception, match="not finite for 3 steps in a row"):
        run_sft(cfg, tracking_uri, tmp_path / "out")
