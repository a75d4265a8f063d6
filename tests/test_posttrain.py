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

RAY_REWARD_MODEL_STEPS = 10


@pytest.fixture(scope="module")
def preference_run(ray_cluster, tmp_path_factory, sft_model, new_mlflow_store):
    """pipelines/preference.py from the SFT model: the reward model and DPO, side by side, as pipeline steps."""
    from pipelines.preference import PreferenceConfig, preference

    work = tmp_path_factory.mktemp("preference")
    # The reward model's Ray Train job stops early: how well it learns is the loop's, tested on two plain ranks below.
    reward_model = PreferenceConfig().reward_model.model_copy(update={"max_steps": RAY_REWARD_MODEL_STEPS})
    cfg = PreferenceConfig(workdir=str(work / "steps"), data=ONE_DIGIT, policy=str(sft_model), eval_limit=30, reward_model=reward_model)
    return preference.run({"cfg": cfg}, workdir=cfg.workdir, tracking_uri=new_mlflow_store(work / "mlflow.db"))


def _held_out_conversations(one_digit, n: int = 10) -> tuple[list, list]:
    """The first ``n`` held-out pairs as the scorer takes them: (chosen conversations, rejected conversations)."""
    with open(one_digit.preferences_eval) as f:
        pairs = [json.loads(line) for line in f][:n]
    return [p["prompt"] + p["chosen"] for p in pairs], [p["prompt"] + p["rejected"] for p in pairs]


def test_reward_model_trains_registers_and_scores_as_an_actor(preference_run, one_digit):
    import ray

    from mlplat.rl.rewards import RewardConfig, RewardModelScorer, start_reward_model

    result = preference_run.outputs["reward_model"]
    assert result["eval_accuracy"] is not None and 0.0 <= result["eval_accuracy"] <= 1.0, result  # scored held-out pairs
    assert result["model"].uri.startswith("models:/demo-reward-model/")

    # Served as a scoring function for RL: the registered checkpoint in a Ray actor scores as it does in this process.
    model_dir = result["model"].local_path(tracking_uri=preference_run.tracking_uri)
    scorer = start_reward_model(RewardConfig(kind="reward_model", reward_model=result["model"].uri), str(model_dir))
    conversations = [c for side in _held_out_conversations(one_digit) for c in side]
    assert ray.get(scorer.score.remote(conversations)) == pytest.approx(RewardModelScorer(str(model_dir)).score(conversations), abs=1e-5)
    ray.kill(scorer)


def test_reward_model_learns_to_rank_held_out_pairs(local_group, tmp_path, sft_model, one_digit):
    """The preference pipeline's reward-model stage (its steps, learning rate and global batch) on two ranks under
    plain torch.distributed: held-out pairwise accuracy far above chance, and the scorer RL uses ranks pairs so."""
    from mlplat.data.preference import PreferenceDataConfig, PreferenceTokenizer
    from mlplat.rl.rewards import RewardModelScorer
    from mlplat.train.checkpoint import MODEL_DIR
    from pipelines.preference import PreferenceConfig
    from train_apps.reward_model import RewardModelConfig, reward_model_loop

    stage = PreferenceConfig().reward_model
    assert stage.max_steps > RAY_REWARD_MODEL_STEPS
    with open(one_digit.preferences) as f:
        columns = PreferenceTokenizer(str(sft_model), stage.max_seq_len)({"text": f.readlines()})
    rows = [dict(zip(columns, values)) for values in zip(*columns.values())]
    cfg = RewardModelConfig(
        model=str(sft_model), data=PreferenceDataConfig(path=str(one_digit.preferences), max_seq_len=stage.max_seq_len),
        eval_data=str(one_digit.preferences_eval), max_steps=stage.max_steps, optim=stage.optim, num_workers=2,
        batch_size_per_worker=stage.batch_size_per_worker * stage.num_workers // 2, log_every=stage.max_steps // 4, registered_model=None,
    )  # fmt: skip
    run = local_group.run(reward_model_loop, cfg, tmp_path / "run", {"train": rows})
    losses = [m["loss"] for m in run.metrics if "loss" in m]
    assert losses[-1] < losses[0], losses
    accuracy = [m["eval/accuracy"] for m in run.metrics if "eval/accuracy" in m]
    assert accuracy and accuracy[-1] >= 0.75, accuracy  # chance is 0.5

    chosen, rejected = _held_out_conversations(one_digit)
    scorer = RewardModelScorer(str(run.checkpoints[-1] / MODEL_DIR))
    assert sum(c > r for c, r in zip(scorer.score(chosen), scorer.score(rejected))) >= 7


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
