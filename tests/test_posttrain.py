"""Post-training recipes end to end: reward model and DPO on the real local Ray cluster, GRPO's loop on two ranks.

The reward model and DPO run as steps of pipelines/preference.py. They all start from a
small SFT model trained in-process on one-digit reversed sums (conftest's ``sft_model``)
(~30% held-out exact match): good enough for a reward model to learn from and for
GRPO's groups to hold both right and wrong answers, far enough from 100% to improve.
"""

from __future__ import annotations

import json

import pytest
from conftest import ONE_DIGIT, sampled_reward

pytestmark = pytest.mark.slow

@pytest.fixture(scope="module")
def preference_run(ray_cluster, tmp_path_factory, sft_model, new_mlflow_store):
    """pipelines/preference.py from the SFT model: the reward model and DPO, side by side, as pipeline steps."""
    from pipelines.preference import PreferenceConfig, preference

    work = tmp_path_factory.mktemp("preference")
    cfg = PreferenceConfig(workdir=str(work / "steps"), data=ONE_DIGIT, policy=str(sft_model), eval_limit=30)
    return preference.run({"cfg": cfg}, workdir=cfg.workdir, tracking_uri=new_mlflow_store(work / "mlflow.db"))


def test_reward_model_ranks_held_out_pairs_and_scores_as_an_actor(preference_run, one_digit):
    import ray

    from mlplat.rl.rewards import RewardConfig, start_reward_model

    result = preference_run.outputs["reward_model"]
    assert result["final_loss"] < result["first_loss"]
    assert result["eval_accuracy"] >= 0.75, result  # chance is 0.5
    assert result["model"].uri.startswith("models:/demo-reward-model/")

    # Served as a scoring function for RL: the registered checkpoint in a Ray actor.
    model_dir = result["model"].local_path(tracking_uri=preference_run.tracking_uri)
    scorer = start_reward_model(RewardConfig(kind="reward_model", reward_model=result["model"].uri), str(model_dir))
    with open(one_digit.preferences_eval) as f:
        pairs = [json.loads(line) for line in f][:10]
    chosen = ray.get(scorer.score.remote([p["prompt"] + p["chosen"] for p in pairs]))
    rejected = ray.get(scorer.score.remote([p["prompt"] + p["rejected"] for p in pairs]))
    assert sum(c > r for c, r in zip(chosen, rejected)) >= 7
    ray.kill(scorer)


def test_dpo_raises_the_held_out_margin(preference_run):
    result = preference_run.outputs["dpo"]
    assert result["final_loss"] < result["first_loss"]
    before, after = result["eval_before"], result["eval_after"]
    assert before["rewards_margin"] == pytest.approx(0.0, abs=1e-4)  # the policy starts as its reference
    assert after["rewards_margin"] > 0.1 and after["rewards_accuracy"] >= 0.6, after  # chance: 0.5
    assert after["logp_margin"] > before["logp_margin"] + 1.0, (before, after)
    # Every stage is a step run under the pipeline's MLflow run.
    assert set(preference_run.steps) == {"demo_data", "reward_model", "dpo", "eval_sft", "eval_dpo"}


TRAIN_RUN_ACTORS = {"TrainController", "DatasetManager", "SplitCoordinator"}  # a Ray Train run's own actors


def test_finished_training_jobs_leave_no_processes_behind(preference_run):
    """The pipeline ran the reward model and DPO as Ray Train jobs inside Ray tasks, whose worker
    processes stay (idle) for the next task: nothing of the finished jobs may live on in them."""
    import time

    from ray._private.state import actors  # the state API (ray.util.state) needs the dashboard, which this cluster does not run

    def alive():
        return sorted(a["ActorClassName"] for a in actors(actor_state_name="ALIVE").values() if a["ActorClassName"] in TRAIN_RUN_ACTORS)

    deadline = time.time() + 30  # handles are released at once; the actors exit a moment later
    while alive() and time.time() < deadline:
        time.sleep(0.5)
    assert not alive(), alive()


def test_grpo_raises_the_verifiable_reward_with_synced_rollouts(local_group, tmp_path, sft_model, one_digit, rl_task):
    """The GRPO loop on 2 ranks under plain torch.distributed, each rank sampling from an in-process engine that
    loads its weights after every update (the quickstart test runs GRPO as a Ray Train job with a rollout actor)."""
    from functools import partial

    from mlplat.data.ingest import DataConfig
    from mlplat.rl.rollout import InProcessRollout
    from mlplat.train.checkpoint import MODEL_DIR
    from train_apps.grpo import GRPOConfig, grpo_loop

    # 16 prompts: each rollout's 2 ranks x 8 is all of them (2 optimizer steps of 32 completions per rank),
    # so before/after compare on the same prompts.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rl_task.rows))
    cfg = GRPOConfig(
        model=str(sft_model), data=DataConfig(path=str(prompts)), eval_data=str(one_digit.eval),
        max_steps=60, num_workers=2, batch_size_per_worker=32, num_generations=8, steps_per_generation=2, max_completion_length=8, log_every=20,
        optim={"lr": 1e-4, "warmup_steps": 0, "min_lr_ratio": 1.0}, registered_model=None,
    )  # fmt: skip
    loop = partial(grpo_loop, rollout_workers=[InProcessRollout(str(sft_model))])
    run = local_group.run(loop, cfg, tmp_path / "run", {"train": rl_task.dataset()})
    logged = {key: [m[key] for m in run.metrics if key in m] for key in ("reward/mean", "run/logprob_diff_max", "eval/exact_match_before", "eval/exact_match")}
    # Every step's rollouts came from the weights just trained: trainer and engine agree on their log-probs.
    assert logged["run/logprob_diff_max"] and logged["run/logprob_diff_max"][-1] < 1e-4
    # No update leaves the reward where it was, a flipped sign pushes it down (stale weights fail the check above).
    rewards = logged["reward/mean"]
    after = sampled_reward(run.checkpoints[-1] / MODEL_DIR, rl_task.rows)
    assert after > rl_task.reward_before + 0.1, (rl_task.reward_before, after, rewards)
    assert rewards[-1] > rewards[0], rewards
    assert logged["eval/exact_match_before"] and logged["eval/exact_match"]  # held-out exact match, logged both ends
