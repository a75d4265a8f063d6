"""Preference tuning as a pipeline: the alternative to the quickstart's GRPO.

    demo data -> tiny model -> SFT on Ray Train ------------------> eval_sft
                    (or `policy`: start from an SFT model you have)
                        |-> reward model (Bradley-Terry): held-out pairwise accuracy -> registered
                        \\-> DPO against the frozen SFT model: held-out reward margin -> eval_dpo -> registered

The reward model and DPO both start from the SFT policy and run side by side, each a Ray
Train job inside its step's MLflow run (train_apps/reward_model.py, train_apps/dpo.py). The
reward model is what GRPO's `reward: reward_model` scores rollouts with.

    mlplat run pipelines/preference.py [--param cfg.sft_steps=800]
    mlplat run pipelines/preference.py --param cfg.policy=models:/quickstart-tiny@quickstart
    mlplat submit pipelines/preference.py --address http://HEAD:8265 --follow
"""

from __future__ import annotations

from pathlib import Path

from pydantic import Field

from mlplat.config import Config
from mlplat.data.demo import DemoDataConfig
from mlplat.data.preference import PreferenceDataConfig
from mlplat.models import TinyModelConfig
from mlplat.pipeline import Dataset, Model, pipeline, step, step_context
from mlplat.train.optim import OptimizerConfig
from pipelines.quickstart import SFT_OPTIM, demo_data, evaluate, sft, tiny_model


class PreferenceStageConfig(Config):
    max_steps: int = Field(gt=0)
    optim: OptimizerConfig
    num_workers: int = Field(1, gt=0)
    batch_size_per_worker: int = Field(16, gt=0)
    max_seq_len: int = Field(64, gt=0)  # per side; the demo's prompt + answer fit in ~40 tokens
    registered_model: str | None


class PreferenceConfig(Config):
    workdir: str = "preference"  # step scratch space (mlplat run: --workdir)
    data: DemoDataConfig = DemoDataConfig()
    model: TinyModelConfig = TinyModelConfig()
    policy: str | None = None  # an SFT model (directory or models:/...) to start from; None: train one here
    sft_steps: int = Field(1000, gt=0)  # as the quickstart's SFT (see its max_steps)
    sft_optim: OptimizerConfig = SFT_OPTIM  # as the quickstart's SFT
    sft_registered_model: str = "demo-sft"
    reward_model: PreferenceStageConfig = PreferenceStageConfig(
        max_steps=160, optim=OptimizerConfig(lr=3e-4, warmup_steps=10), registered_model="demo-reward-model"
    )
    dpo: PreferenceStageConfig = PreferenceStageConfig(
        max_steps=30, optim=OptimizerConfig(lr=1e-4, warmup_steps=5), registered_model="demo-dpo"
    )
    beta: float = Field(0.1, gt=0)  # DPO's KL strength
    eval_limit: int = 500


DEFAULTS = PreferenceConfig()


def _preference_data(data: Dataset, stage: PreferenceStageConfig) -> dict:
    root = data.local_path()
    return {"data": PreferenceDataConfig(path=str(root / "preferences.jsonl"), max_seq_len=stage.max_seq_len),
            "eval_data": str(root / "preferences_eval.jsonl")}


def _recipe_fields(stage: PreferenceStageConfig, run_name: str) -> dict:
    workdir = Path(step_context().workdir)
    return {"max_steps": stage.max_steps, "optim": stage.optim, "num_workers": stage.num_workers,
            "batch_size_per_worker": stage.batch_size_per_worker, "log_every": max(1, stage.max_steps // 4),
            "storage_path": str(workdir / "ray_train"), "experiment": step_context().experiment, "run_name": run_name,
            "registered_model": stage.registered_model}


@step(num_cpus=0, launches={"CPU": 1})  # the task only drives Ray Train; its worker holds the CPU
def reward_model(policy: Model, data: Dataset, stage: PreferenceStageConfig) -> dict:
    """A scalar-head reward model from the policy, trained on the preference pairs (Bradley-Terry)."""
    from train_apps.reward_model import RewardModelConfig, run_reward_model

    context = step_context()
    cfg = RewardModelConfig(model=policy.uri, **_preference_data(data, stage), **_recipe_fields(stage, "preference-reward-model"))
    result = run_reward_model(cfg, tracking_uri=context.tracking_uri, work_dir=Path(context.workdir) / "outputs")
    context.nest(result.run_id)
    context.log_metrics({"eval/pairwise_accuracy": result.eval_accuracy})
    model = Model(result.model_version.uri if result.model_version else result.model_dir)
    return {"model": model, "run_id": result.run_id, "eval_accuracy": result.eval_accuracy,
            "first_loss": result.first_loss, "final_loss": result.final_loss}


@step(num_cpus=0, launches={"CPU": 1})
def dpo(policy: Model, data: Dataset, stage: PreferenceStageConfig, beta: float) -> dict:
    """DPO from the policy against a frozen copy of it; held-out implicit-reward margins before and after."""
    from train_apps.dpo import DPOConfig, run_dpo

    context = step_context()
    cfg = DPOConfig(model=policy.uri, beta=beta, **_preference_data(data, stage), **_recipe_fields(stage, "preference-dpo"))
    result = run_dpo(cfg, tracking_uri=context.tracking_uri, work_dir=Path(context.workdir) / "outputs")
    context.nest(result.run_id)
    context.log_metrics({"eval/rewards_margin": result.eval_after.rewards_margin, "eval/rewards_accuracy": result.eval_after.rewards_accuracy})
    model = Model(result.model_version.uri if result.model_version else result.model_dir)
    return {"model": model, "run_id": result.run_id, "first_loss": result.first_loss, "final_loss": result.final_loss,
            "eval_before": result.eval_before.model_dump(), "eval_after": result.eval_after.model_dump()}


@pipeline(experiment="mlplat-preference")
def preference(cfg: PreferenceConfig = DEFAULTS):
    data = demo_data(cfg.data)
    if cfg.policy:
        policy = Model(cfg.policy)
    else:
        base = tiny_model(data, cfg.model)
        policy = sft(base, data, cfg.sft_optim, cfg.sft_steps, 2, 32, cfg.sft_registered_model)["model"]
    scorer = reward_model(policy, data, cfg.reward_model)
    tuned = dpo(policy, data, cfg.dpo, cfg.beta)
    after_sft = evaluate.options(name="eval_sft")(policy, data, cfg.eval_limit)
    after_dpo = evaluate.options(name="eval_dpo")(tuned["model"], data, cfg.eval_limit)
    return {"reward_model": scorer, "dpo": tuned, "eval_sft": after_sft, "eval_dpo": after_dpo}


if __name__ == "__main__":
    preference.main()
