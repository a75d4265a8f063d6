"""GRPO (group relative policy optimisation) with rollout actors, on the shared RL loop (mlplat.rl.loop).

    input: an HF checkpoint (usually the SFT model), RL prompts with task fields (e.g. ``answer``)
    0. start rollout actors (the native engine) on the same weights                  [Ray actors]
    1. validate the prompt rows                                                         [Ray Data]
    2. on each of N training workers:                                                   [Ray Train]
         pi_theta <- the checkpoint (DDP/FSDP2); pi_ref <- the same, frozen (only if beta > 0)
         until max_steps optimizer steps:
             prompts <- the next batch_size_per_worker x steps_per_generation / G of this worker's shard
             G completions per prompt, with the engine's log-probs <- its rollout actor   (rollout)
             r <- sum_k reward_weights[k] reward_k(completion, row), each source exact match | function
                  | reward model | LLM judge                                                 (reward)
             A <- advantage_estimator(r): group_norm (r - group mean, / std by scale_rewards) | rloo
                  | reinforce (REINFORCE++) | reinforce_baseline                      (advantages)
             log pi_old, log pi_ref <- no-grad forwards, one micro-batch at a time, log-probs at the
                  sampling temperature (pi_old checked against the engine's log-probs)  (score)
             for iteration in 1..num_iterations, for each optimizer step's grad_accum_steps micro-batches
                  of batch_size_per_worker completions (steps_per_generation micro-batches per rollout):
                 ratio = pi_theta / pi_old per token
                 per token: -min(ratio A, clip(ratio, 1 - epsilon, 1 + epsilon_high) A) + beta KL_k3(pi_theta || pi_ref)
                 loss <- its mean by loss_type (dapo: over every completion token of the step, all ranks;
                         grpo: per completion, then over completions; dr_grpo: / (completions x max length); bnpo)
                 AdamW step through the shared train_step (skipped if not finite, bf16 on GPU)   (train)
             rank 0 pushes pi_theta's weights to every rollout actor in place         (sync)
             every log_every steps: reward mean/std, KL, entropy, completion length, clip fraction,
                              rollout tokens/s, time per phase -> MLflow
    3. exact match on held-out prompts (greedy, via a rollout actor) before and after;
       the final model registered in MLflow like SFT's
    output: run id, model version, rewards and held-out accuracy

Names, meanings and defaults are TRL's GRPOConfig's (``num_generations``, ``beta``, ``epsilon``,
``loss_type``, ``scale_rewards``, ...); ``advantage_estimator`` is OpenRLHF's.

Run: ``mlplat train grpo --config grpo.yaml``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import Field, model_validator

from mlplat import recipes
from mlplat.recipes import Recipe
from mlplat.rl.loop import RLConfig, rl_loop
from mlplat.rl.objectives import GRPOObjective
from mlplat.rl.run import RLRunResult, run_rl
from mlplat.train.losses import AdvantageEstimator, LossType, Moments, ScaleRewards, advantages
from mlplat.train.worker import WorkerEnv


class GRPOConfig(RLConfig):
    num_generations: int = Field(default=8, ge=2)  # completions per prompt (G)
    steps_per_generation: int | None = Field(default=None, gt=0)  # micro-batches each rollout feeds; None: grad_accum_steps (one optimizer step)
    num_iterations: int = Field(default=1, ge=1)  # passes over each rollout (PPO epochs, TRL's mu)
    beta: float = Field(default=0.0, ge=0)  # k3 KL penalty to the reference model; 0 loads no reference
    epsilon: float = Field(default=0.2, gt=0)  # clip range of the ratio, lower side
    epsilon_high: float | None = Field(default=None, gt=0)  # upper side (DAPO's clip-higher); None: epsilon
    loss_type: LossType = "dapo"
    scale_rewards: ScaleRewards = "group"  # group_norm's divisor: the group's std, the batch's, or none (Dr. GRPO)
    advantage_estimator: AdvantageEstimator = "group_norm"
    experiment: str = "mlplat-grpo"
    registered_model: str | None = "grpo-model"

    @property
    def micro_batches_per_generation(self) -> int:
        return self.steps_per_generation or self.grad_accum_steps

    @property
    def prompts_per_generation(self) -> int:
        """Prompts each worker samples per rollout."""
        return self.batch_size_per_worker * self.micro_batches_per_generation // self.num_generations

    @model_validator(mode="after")
    def _whole_groups_and_steps(self):
        completions = self.batch_size_per_worker * self.micro_batches_per_generation
        if completions % self.num_generations:
            raise ValueError(
                f"num_generations={self.num_generations} must divide the completions each worker trains on per rollout "
                f"(batch_size_per_worker x steps_per_generation = {completions}): every prompt's group whole"
            )
        if self.micro_batches_per_generation % self.grad_accum_steps:
            raise ValueError(f"grad_accum_steps={self.grad_accum_steps} must divide steps_per_generation={self.micro_batches_per_generation}")
        return self


GRPOResult = RLRunResult


class GRPO:
    """GRPO as an ``RLAlgorithm`` (mlplat.rl.loop): G completions per prompt, advantages from their rewards alone."""

    recipe = "grpo"

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg
        self.samples_per_prompt = cfg.num_generations
        self.prompts_per_rollout = cfg.prompts_per_generation
        self.epochs = cfg.num_iterations
        self.uses_reference = cfg.beta > 0
        self.policy_objective = GRPOObjective.from_config(cfg)

    def extra_trainables(self, env: WorkerEnv, tokenizer) -> list:
        return []

    def experience(self, batch: dict[str, torch.Tensor], rewards: torch.Tensor, moments: Moments) -> dict[str, float]:
        cfg = self.cfg
        batch["advantages"] = advantages(rewards, cfg.num_generations, cfg.advantage_estimator, cfg.scale_rewards, moments)
        return {}


def grpo_loop(cfg: GRPOConfig, env: WorkerEnv, rollout_workers: list, reward_scorers: dict | None = None) -> None:
    """Every rank's loop (mlplat.train.worker): the shared RL loop with GRPO."""
    rl_loop(cfg, env, GRPO(cfg), rollout_workers, reward_scorers)


def run_grpo(cfg: GRPOConfig, tracking_uri: str | None = None, work_dir: str | Path = "outputs") -> GRPOResult:
    """Run the recipe on the connected Ray cluster (a local one is started if needed)."""
    return run_rl("grpo", cfg, grpo_loop, tracking_uri, work_dir)


RECIPE = Recipe("grpo", GRPOConfig, run_grpo)  # registered in pyproject.toml's mlplat.recipes entry points


def main(argv: list[str] | None = None) -> None:
    recipes.main("grpo", argv)


if __name__ == "__main__":
    main()
