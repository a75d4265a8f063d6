"""Straggler and hang detection inside a real 2-worker SFT run (Ray Train, gloo, MLflow).

One run covers both: rank 1 is slowed on every step (a straggler, policy ``log``) and, in
the first attempt, hangs before step 10. The straggler must be flagged within a few log
windows; the hang must leave both ranks' stacks in the run's artifacts and end in one
restart from the step-8 checkpoint that finishes the job. The healthy counterpart (no
flag without a delay) is asserted on the plain SFT run in tests/test_sft.py.
"""

from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from mlplat.data.sft import SFTDataConfig
from mlplat.health.hang import HangConfig
from mlplat.health.straggler import StragglerConfig
from mlplat.health.training import FaultInjection, TrainingHealthConfig
from mlplat.train.optim import OptimizerConfig
from train_apps.sft import SFTConfig, run_sft


@pytest.mark.slow
def test_sft_flags_a_slow_rank_and_restarts_after_a_hang(ray_cluster, tracking_uri, demo_data, tiny_model, tmp_path):
    cfg = SFTConfig(
        model=str(tiny_model),
        data=SFTDataConfig(path=str(demo_data.sft), pack=True, max_seq_len=128),
        optim=OptimizerConfig(lr=2e-3, warmup_steps=5),
        max_steps=12,
        batch_size_per_worker=4,
        num_workers=2,
        log_every=2,
        checkpoint_every=8,
        checkpoint_format="consolidated",
        checkpoint_hf=False,
        max_failures=1,
        storage_path=str(tmp_path / "ray_train"),
        experiment="test-health-sft",
        registered_model=None,
        health=TrainingHealthConfig(straggler=StragglerConfig(margin=0.5, windows=3), hang=HangConfig(timeout_s=8, exit_grace_s=5)),
        debug=FaultInjection(step_delay_s={1: 0.3}, hang_rank=1, hang_at_step=10),
    )
    result = run_sft(cfg, tracking_uri=tracking_uri, work_dir=tmp_path / "outputs")

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

    # The hang: detected on both ranks (rank 0 waits in a collective for rank 1), stacks saved, one restart from step 8.
    assert "no step completed for 8 s" in run.data.tags["mlplat.health.hang.rank1"]
    dumps = [d.path for d in client.list_artifacts(result.run_id, "health/hang")]
    assert any("-rank0-" in p for p in dumps) and any("-rank1-" in p for p in dumps), dumps
    hung = next(p for p in dumps if "-rank1-" in p)
    stacks = Path(client.download_artifacts(result.run_id, hung, str(tmp_path / "dl"))).read_text()
    assert "inject_faults" in stacks and "train_loop_per_worker" in stacks  # where rank 1 was stuck, in the training thread
    restored = client.get_metric_history(result.run_id, "restored_from_step")
    assert [int(m.value) for m in restored] == [8]  # exactly one restart: the watchdog stayed quiet in the second attempt
    assert max(m.step for m in client.get_metric_history(result.run_id, "loss")) == 12
