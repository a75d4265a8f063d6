"""SFT that survives: a straggler flagged, restarts after a hang and a killed worker, NaN abort
(exact resume: tests/test_sft.py).

All on the real local Ray cluster with 2 gloo workers; losses come from the real MLflow store.
"""

import contextlib
import os
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
from mlflow.tracking import MlflowClient

from mlplat.data.sft import SFTDataConfig
from mlplat.health.hang import HangConfig
from mlplat.health.straggler import StragglerConfig
from mlplat.train.health import FaultInjection, TrainingHealthConfig
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
    deadline = time.time() + 900  # two job start-ups and a hang come first
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
def test_a_slow_rank_is_flagged_and_the_run_survives_a_hang_and_a_killed_worker(ray_cluster, tracking_uri, demo_data, tiny_model, tmp_path):
    """One run, three attempts: rank 1 is slowed on every step (a straggler, policy ``log``); in the
    first attempt it hangs before step 10, which the watchdog turns into stacks in the run and a
    restart from the step-8 checkpoint; in the second attempt a worker process is SIGKILLed from
    outside after step 18, and the third attempt restores the last checkpoint and finishes."""
    cfg = _config(
        demo_data, tiny_model, tmp_path,
        max_steps=24, log_every=2, checkpoint_every=8, checkpoint_format="consolidated", checkpoint_hf=False, max_failures=2,
        experiment="test-sft-faults",
        health=TrainingHealthConfig(straggler=StragglerConfig(margin=0.5, windows=3), hang=HangConfig(timeout_s=5, exit_grace_s=2)),
        debug=FaultInjection(step_delay_s={1: 0.3}, hang_rank=1, hang_at_step=10),
    )  # fmt: skip
    killed = {}
    killer = threading.Thread(target=_kill_a_worker_after_step, args=(tracking_uri, cfg.experiment, 18, killed), daemon=True)
    killer.start()
    result = run_sft(cfg, tracking_uri, tmp_path / "out")
    killer.join(timeout=5)
    assert "pid" in killed, "the worker was never killed"

    client = MlflowClient(tracking_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"

    # The straggler: rank 1 (never rank 0) flagged by the third window of 2 steps, with a tag and a metric.
    assert "rank 1 on node" in run.data.tags["mlplat.health.straggler.rank1"]
    assert not any(key.startswith("mlplat.health.straggler.rank0") for key in run.data.tags)
    stragglers = sorted(client.get_metric_history(result.run_id, "health/stragglers"), key=lambda m: (m.timestamp, m.step))
    first_flag = min(m.step for m in stragglers if m.value >= 1)
    assert first_flag <= 8, [(m.step, m.value) for m in stragglers]
    assert all(m.value == 0 for m in stragglers if m.step < 6)  # K=3 windows: never before the third
    assert max(m.value for m in client.get_metric_history(result.run_id, "health/max_rank_slowdown")) > 1.5

    # The hang: detected on both ranks (rank 0 waits in a collective for rank 1), stacks saved.
    assert "no step completed for 5 s" in run.data.tags["mlplat.health.hang.rank1"]
    dumps = [d.path for d in client.list_artifacts(result.run_id, "health/hang")]
    assert any("-rank0-" in p for p in dumps) and any("-rank1-" in p for p in dumps), dumps
    hung = next(p for p in dumps if "-rank1-" in p)
    stacks = Path(client.download_artifacts(result.run_id, hung, str(tmp_path / "dl"))).read_text()
    assert "inject_faults" in stacks and "sft_loop" in stacks  # where rank 1 was stuck, in the training thread

    # Two restarts: from step 8 after the hang (the watchdog stayed quiet afterwards), then from a checkpoint
    # before the kill: the one at step 16, or at step 8 when the kill lands before Ray Train's controller
    # has taken in the step-16 report (it polls the workers every few seconds).
    restored = [int(m.value) for m in sorted(client.get_metric_history(result.run_id, "restored_from_step"), key=lambda m: m.timestamp)]
    assert len(restored) == 2 and restored[0] == 8, restored
    assert restored[1] in (8, 16), (restored, killed)
    history = client.get_metric_history(result.run_id, "loss")
    assert max(m.step for m in history) == 24
    # Replayed steps (logged before a failure and again after its restore) saw the same data: the same loss.
    by_step = {}
    for m in sorted(history, key=lambda m: m.timestamp):
        by_step.setdefault(m.step, []).append(m.value)
    replayed = [values for values in by_step.values() if len(values) > 1]
    assert replayed, by_step
    for values in replayed:
        assert values[1:] == pytest.approx(values[:1] * (len(values) - 1), rel=1e-5, abs=1e-6)
    assert result.final_loss < result.first_loss
