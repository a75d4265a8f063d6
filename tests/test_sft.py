"""The SFT recipe on a real local Ray cluster (2 DDP workers, gloo) tracked in a real MLflow store: a run and its exact resume
(LoRA: tests/test_recipe_loops.py)."""

import pytest
import torch
from conftest import SFT_BATCH, SFT_STEPS
from mlflow.tracking import MlflowClient

from mlplat.models import load_model
from mlplat.train.checkpoint import MODEL_DIR, SHARDED_DIR, TRAIN_STATE


@pytest.mark.slow
def test_sft_on_two_workers_improves_loss_and_registers(sft_run, tiny_model):
    result, tracking_uri, tmp_path = sft_run.result, sft_run.tracking_uri, sft_run.workdir

    # Learning happened: the last loss is well below the step-10 loss.
    assert result.final_loss < 0.8 * result.first_loss, (result.first_loss, result.final_loss)
    base, tuned = load_model(tiny_model), load_model(result.model_dir)
    assert not torch.equal(base.model.layers[0].mlp.up_proj.weight, tuned.model.layers[0].mlp.up_proj.weight)

    # MLflow: config as params, per-step metrics from rank 0, a registered version.
    client = MlflowClient(tracking_uri)
    run = client.get_run(result.run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["optim.lr"] == "0.001" and run.data.params["num_workers"] == "2"
    assert [m.step for m in client.get_metric_history(result.run_id, "loss")] == list(range(10, SFT_STEPS + 1, 10))
    for name in ("tokens_per_s", "tokens_per_s_per_worker", "mfu", "time/forward_s", "time/backward_s", "time/optimizer_s"):
        assert all(m.value > 0 for m in client.get_metric_history(result.run_id, name)), name
    assert 0 <= run.data.metrics["data_wait_fraction"] < 1 and 0 <= result.data_wait_fraction < 1
    assert run.data.metrics["mfu"] < 1
    assert 0.5 < run.data.metrics["data/packing_efficiency"] <= 1  # packed rows: mostly real tokens
    assert run.data.metrics["data/tokens"] > SFT_STEPS * 32 * 10  # cumulative, all ranks
    assert len(run.data.tags["mlplat.data.fingerprint"]) == 16 and run.data.tags["mlplat.checkpoint.latest"] == result.checkpoint_path
    assert run.data.metrics["data/bad_rows"] == 2  # the two rows the fixture spoiled
    # Straggler detection ran every window and, with no slow rank, flagged nothing (tests/test_sft_resume.py injects one).
    assert [m.value for m in client.get_metric_history(result.run_id, "health/stragglers")] == [0.0] * (SFT_STEPS // sft_run.cfg.log_every)
    assert not any(key.startswith("mlplat.health") for key in run.data.tags)
    assert result.model_version.uri == "models:/test-sft-model/1"
    assert str(client.get_model_version_by_alias("test-sft-model", "candidate").version) == "1"

    # The embedded local cluster runs Ray Train without its preemption watcher (mlplat.runtime.init_ray): never started, alive or dead.
    from ray._private.state import actors  # the state API (ray.util.state) needs the dashboard, which this cluster does not run

    assert "PreemptionWatcher" not in {a["ActorClassName"] for a in actors().values()}
    version = client.get_model_version("test-sft-model", "1")
    assert version.run_id == result.run_id and version.source.endswith("/model")

    # Ray Train kept the last two checkpoints, each a sharded (DCP) state plus an HF export.
    checkpoints = sorted(p for p in (tmp_path / "ray_train").glob("sft-*/checkpoint_*") if p.is_dir())
    assert len(checkpoints) == 2
    for ckpt in checkpoints:
        assert (ckpt / MODEL_DIR / "model.safetensors").is_file() and (ckpt / TRAIN_STATE).is_file()
        assert (ckpt / SHARDED_DIR / ".metadata").is_file()
    state = torch.load(checkpoints[-1] / TRAIN_STATE, weights_only=True)["state"]
    assert state["step"] == SFT_STEPS and state["data"]["rows_consumed"] == SFT_STEPS * SFT_BATCH


