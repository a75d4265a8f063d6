"""Post-training objectives against hand-computed values, and trainer <-> rollout engine weight-sync parity."""

from __future__ import annotations

import math

import pytest
import torch

from mlplat.rl.rollout import RolloutWorker, Sample
from mlplat.train.batch import IGNORE_INDEX
from mlplat.train.losses import bradley_terry_loss, dpo_loss, group_advantages, grpo_loss, token_logprobs
from train_apps.grpo import rollout_batch


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_dpo_sigmoid_loss_matches_a_hand_computed_example():
    # beta=0.5: chosen reward 0.5 * (-1 - -2) = 0.5, rejected 0.5 * (-3 - -2) = -0.5, margin 1.
    t = torch.tensor
    losses, chosen, rejected = dpo_loss(t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0]), beta=0.5)
    assert losses.item() == pytest.approx(softplus(-1.0))  # -log sigmoid(1)
    assert chosen.item() == pytest.approx(0.5) and rejected.item() == pytest.approx(-0.5)
    smoothed, _, _ = dpo_loss(t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0]), beta=0.5, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(0.9 * softplus(-1.0) + 0.1 * softplus(1.0))


def test_bradley_terry_loss_per_pair():
    losses = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert losses.tolist() == pytest.approx([softplus(-1.0), softplus(1.0)])


def test_group_advantages_normalise_within_each_group():
    adv = group_advantages(torch.tensor([1.0, 0, 0, 0, 1, 1, 1, 1]), group_size=4)
    # group 1: mean 0.25, sample std 0.5; group 2 all equal: nothing to learn.
    torch.testing.assert_close(adv, torch.tensor([1.5, -0.5, -0.5, -0.5, 0, 0, 0, 0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(group_advantages(torch.tensor([1.0, 0]), 2, scale=False), torch.tensor([0.5, -0.5]))


def test_grpo_loss_pushes_up_good_samples_clips_and_penalises_kl():
    old = torch.full((2, 2), -1.0)
    adv, mask = torch.tensor([1.0, -1.0]), torch.ones(2, 2)
    logprobs = old.clone().requires_grad_(True)
    loss, stats = grpo_loss(logprobs, old, adv, mask, clip_ratio=0.2)
    loss.backward()
    assert loss.item() == pytest.approx(0.0) and stats["clip_fraction"] == 0.0
    assert (logprobs.grad[0] < 0).all() and (logprobs.grad[1] > 0).all()  # descent raises the good sample's log-prob

    # ratio 1.5 > 1 + clip: the good sample's gain is clipped (no gradient), the bad one's penalty is not.
    logprobs = (old + math.log(1.5)).requires_grad_(True)
    loss, stats = grpo_loss(logprobs, old, adv, mask, clip_ratio=0.2)
    loss.backward()
    assert loss.item() == pytest.approx((-1.2 * 2 + 1.5 * 2) / 4)
    assert stats["clip_fraction"] == 0.5
    assert (logprobs.grad[0] == 0).all() and (logprobs.grad[1] > 0).all()

    _, stats = grpo_loss(old, old, adv, mask, 0.2, ref_logprobs=old - 0.1, kl_coef=0.1)
    assert stats["kl"] == pytest.approx(math.exp(-0.1) + 0.1 - 1, rel=1e-5)  # k3 estimator (float32)


def test_rollout_batch_aligns_engine_logprobs_with_target_positions():
    batch = rollout_batch([Sample([5, 6, 7], [8, 9], [-0.1, -0.2], "", "stop"), Sample([5], [4], [-0.3], "", "length")],
                          torch.tensor([1.0, -1.0]), pad_token_id=0)  # fmt: skip
    assert batch["labels"].tolist() == [[IGNORE_INDEX] * 3 + [8, 9], [IGNORE_INDEX, 4, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    # target position t scores token t+1: the first completion token is predicted at len(prompt) - 1.
    torch.testing.assert_close(batch["engine_logprobs"], torch.tensor([[0, 0, -0.1, -0.2], [-0.3, 0, 0, 0]]))


def test_after_a_weight_sync_the_rollout_engine_scores_tokens_like_the_trainer(tiny_model):
    from mlplat.models import load_model

    rollout = RolloutWorker(str(tiny_model), {})
    trainer = load_model(tiny_model)
    tokens = rollout.prompt_ids([{"role": "user", "content": "What is 12 + 34?"}]) + [7, 8, 9]

    def trainer_logprobs() -> torch.Tensor:
        ids = torch.tensor([tokens])
        with torch.no_grad():
            return token_logprobs(trainer(input_ids=ids).logits, ids)[0][0]

    torch.testing.assert_close(torch.tensor(rollout.score(tokens)), trainer_logprobs(), atol=1e-4, rtol=0)
    # One optimizer step on the trainer: the engine is stale until the sync.
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    ids = torch.tensor([tokens])
    (-token_logprobs(trainer(input_ids=ids).logits, ids)[0].sum()).backward()
    optimizer.step()
    assert (torch.tensor(rollout.score(tokens)) - trainer_logprobs()).abs().max() > 1e-2
    assert rollout.update_weights({k: v.detach() for k, v in trainer.state_dict().items()}) > 0
    torch.testing.assert_close(torch.tensor(rollout.score(tokens)), trainer_logprobs(), atol=1e-4, rtol=0)


def test_grpo_config_refuses_mini_batches_that_do_not_divide_the_samples():
    from mlplat.config import validate
    from mlplat.errors import ConfigError
    from train_apps.grpo import GRPOConfig

    base = {"model": "/m", "data": {"path": "/p.jsonl"}, "batch_size_per_worker": 3, "group_size": 4}
    assert validate(GRPOConfig, {**base, "num_mini_batches": 4}).num_mini_batches == 4
    with pytest.raises(ConfigError, match="num_mini_batches=5 must divide"):
        validate(GRPOConfig, {**base, "num_mini_batches": 5})


@pytest.mark.parametrize(("recipe", "config_name"), [("reward_model", "RewardModelConfig"), ("dpo", "DPOConfig"), ("grpo", "GRPOConfig")])
def test_a_missing_eval_file_is_an_error_before_any_run_starts(recipe, config_name, tmp_path):
    import importlib

    from mlplat.config import load_config
    from mlplat.errors import ConfigError

    module = importlib.import_module(f"train_apps.{recipe}")
    cfg = load_config(getattr(module, config_name), None, ["model=/nowhere", f"data.path={tmp_path}/d.jsonl", f"eval_data={tmp_path}/missing.jsonl"])
    run = getattr(module, f"run_{recipe}")
    with pytest.raises(ConfigError, match=f"eval_data: {tmp_path}/missing.jsonl is not a file"):
        run(cfg, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", work_dir=tmp_path)  # before /nowhere is even looked at
    assert not (tmp_path / "mlflow.db").exists()


def test_the_cli_prints_it_as_one_line(tmp_path):
    import subprocess

    from conftest import MLPLAT

    out = subprocess.run(
        [MLPLAT, "train", "dpo", "--set", "model=/nowhere", "--set", f"data.path={tmp_path}/d.jsonl", "--set", f"eval_data={tmp_path}/missing.jsonl"],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("mlplat: error")]
    assert errors == [f"mlplat: error: eval_data: {tmp_path}/missing.jsonl is not a file: give a held-out JSONL path, or leave eval_data unset"]
    assert "Traceback" not in out.stderr
    assert "Started a local Ray instance" not in out.stderr  # inputs are checked before a cluster starts
