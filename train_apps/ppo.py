"""PPO with a learned critic (the classic RLHF recipe, Ouyang et al. 2022) with rollout actors, on the shared RL loop.

    input: an HF checkpoint (usually the SFT model), RL prompts with task fields, a reward source
    0. start rollout actors (the native engine) on the same weights                  [Ray actors]
    1. validate the prompt rows                                                         [Ray Data]
    2. on each of N training workers:                                                   [Ray Train]
         pi_theta <- the checkpoint (DDP/FSDP2); pi_ref <- the same, frozen (only if kl_coef > 0)
         V_phi <- critic_model (default: the reward model; else the policy checkpoint, a new zero head):
                  its scalar score head applied at every position, a value per token
         until max_steps optimizer steps (of each model):
             prompts <- the next batch_size_per_worker x grad_accum_steps x num_mini_batches of this
                  worker's shard; one completion each, with the engine's log-probs    (rollout)
             s <- sum_k reward_weights[k] reward_k(completion, row): reward model | exact match
                  | function | LLM judge                                                (reward)
             log pi_old, log pi_ref, V_old <- no-grad forwards, one micro-batch at a time, log-probs at
                  the sampling temperature (pi_old checked against the engine's log-probs)
             r_t <- -kl_coef (log pi_old - log pi_ref)_t, + s on the completion's last token
                  (whitened, scale only, with whiten_rewards)
             A_t <- GAE(r, V_old; gamma, lam); R_t <- A_t + V_old_t; A whitened over the batch (all ranks) (score)
             for epoch in 1..num_ppo_epochs, for each of num_mini_batches optimizer steps of grad_accum_steps
                  micro-batches of batch_size_per_worker completions:
                 policy, per token: -min(ratio A, clip(ratio, 1 - cliprange, 1 + cliprange) A),
                        ratio = pi_theta / pi_old; the mean over the step's completion tokens (all ranks)
                 critic, per token: vf_coef 0.5 max((V - R)^2, (clip(V, V_old +- cliprange_value) - R)^2), same mean
                 AdamW step of each through the shared train_step, the same micro-batches (skipped if
                 not finite, bf16 on GPU)                                                 (train)
             rank 0 pushes pi_theta's weights to every rollout actor in place         (sync)
             every log_every steps: reward, KL, value and return means, clip fractions, entropy,
                              completion length, rollout tokens/s, time per phase -> MLflow
    3. exact match on held-out prompts (greedy, via a rollout actor) before and after;
       the final policy registered in MLflow like SFT's; the critic's state in each checkpoint's critic/
    output: run id, model version, rewards and held-out accuracy

Names, meanings and defaults are TRL's PPOConfig's (``kl_coef``, ``cliprange``, ``cliprange_value``,
``vf_coef``, ``gamma``, ``lam``, ``whiten_rewards``, ``num_ppo_epochs``, ``num_mini_batches``); the
fields it shares with GRPO keep GRPO's names (``batch_size_per_worker``, ``max_completion_length``,
``temperature``, ``reward``).

Run: ``mlplat train ppo --config ppo.yaml``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import Field, model_validator

from mlplat import recipes
from mlplat.models import load_reward_model
from mlplat.recipes import Recipe
from mlplat.rl.experience import completion_mask, micro_batches
from mlplat.rl.loop import RLConfig, Trainable, extra_trainable, rl_loop
from mlplat.rl.run import RLRunResult, run_rl
from mlplat.train.batch import model_inputs
from mlplat.train.logprobs import labelled_logprobs
from mlplat.train.losses import Moments, clipped_surrogate, clipped_value_loss, gae, kl_penalised_rewards, masked_whiten
from mlplat.train.optim import OptimizerConfig
from mlplat.train.recipe import RecipeRun
from mlplat.train.worker import WorkerEnv


class PPOConfig(RLConfig):
    num_ppo_epochs: int = Field(default=4, ge=1)  # passes over each rollout
    num_mini_batches: int = Field(default=1, ge=1)  # optimizer steps per pass: a rollout is num_mini_batches x grad_accum_steps micro-batches
    kl_coef: float = Field(default=0.05, ge=0)  # per-token KL penalty to the reference in the reward (k1); 0 loads no reference
    cliprange: float = Field(default=0.2, gt=0)  # the policy ratio's clip range
    cliprange_value: float = Field(default=0.2, gt=0)  # how far a value may move from its rollout value before the clip
    vf_coef: float = Field(default=0.1, gt=0)  # the value loss's weight (its own optimizer: scales its gradient before clipping)
    gamma: float = Field(default=1.0, ge=0, le=1)  # discount
    lam: float = Field(default=0.95, ge=0, le=1)  # GAE's lambda
    whiten_rewards: bool = False  # scale the per-token rewards to unit std over the batch before GAE
    critic_model: str | None = None  # HF directory or models:/ URI; default: the reward model (kind=reward_model), else the policy + a new head
    critic_optim: OptimizerConfig | None = None  # the critic's optimizer and schedule; None: optim's
    experiment: str = "mlplat-ppo"
    registered_model: str | None = "ppo-model"

    @property
    def prompts_per_generation(self) -> int:
        """Prompts (= completions) each worker samples per rollout."""
        return self.batch_size_per_worker * self.grad_accum_steps * self.num_mini_batches

    @model_validator(mode="after")
    def _one_critic_source(self):
        reward_models = [r.label for r in self.reward if r.kind == "reward_model"]
        if self.critic_model is None and len(reward_models) > 1:
            raise ValueError(f"critic_model: several reward models ({reward_models}) could initialise the critic; name one")
        return self

    def critic_source(self) -> str | None:
        """What the critic starts from: critic_model, else the reward model, else None (the policy checkpoint with a new head)."""
        return self.critic_model or next((r.reward_model for r in self.reward if r.kind == "reward_model"), None)


class PPOResult(RLRunResult):
    critic_model: str  # the directory the critic started from


class TokenValues(torch.nn.Module):
    """The critic: a scalar-head model (``*ForSequenceClassification``) whose head scores every position, [B, L].

    It keeps the backbone as ``model`` and the head as ``score``, as the HF class does (same state-dict names, the
    decoder layers where FSDP2 and activation checkpointing look for them), and is the root DDP / FSDP2 wrap."""

    def __init__(self, scalar_model: torch.nn.Module, zero_head: bool = False):
        super().__init__()
        self.model = getattr(scalar_model, scalar_model.base_model_prefix)
        self.score = scalar_model.score
        self.config = scalar_model.config
        if zero_head:  # a new head: values start at 0 rather than at random, so the first advantages are the returns themselves
            torch.nn.init.zeros_(self.score.weight)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor:
        hidden = self.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).last_hidden_state
        return self.score(hidden)[..., 0].float()


def token_values(critic, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """The critic's value [B, L-1] at each target position (the state before that position's token is sampled)."""
    return critic(**model_inputs(batch))[:, :-1]


class _PerCompletionToken:
    """A PPO objective summed over the batch's completion tokens: a step averages it over every rank's tokens."""

    def __init__(self, cfg: PPOConfig):
        self.cfg = cfg

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return completion_mask(batch).sum()


class PPOPolicyObjective(_PerCompletionToken):
    """The clipped surrogate per completion token with per-token advantages; the batch carries ``old_logprobs`` and
    ``advantages`` [B, L-1]."""

    def __call__(self, policy, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = completion_mask(batch).float()
        logprobs = labelled_logprobs(policy, batch, self.cfg.temperature)
        old, adv = batch["old_logprobs"], batch["advantages"]
        per_token, clipped = clipped_surrogate(logprobs.reshape(-1, 1), old.reshape(-1, 1), adv.reshape(-1), self.cfg.cliprange)
        per_token, clipped = per_token.view_as(logprobs), clipped.view_as(logprobs)
        approx_kl = 0.5 * (logprobs.detach() - old) ** 2  # TRL's policy/approxkl
        return (per_token * mask).sum(), {"clip_fraction": (clipped * mask).sum(), "approx_kl": (approx_kl * mask).sum()}


class ValueObjective(_PerCompletionToken):
    """vf_coef x the clipped value loss per completion token; the batch carries ``old_values`` and ``returns`` [B, L-1]."""

    def __call__(self, critic, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = completion_mask(batch).float()
        values = token_values(critic, batch)
        per_token, clipped = clipped_value_loss(values, batch["old_values"], batch["returns"], self.cfg.cliprange_value)
        error = (values.detach() - batch["returns"]) ** 2
        return self.cfg.vf_coef * (per_token * mask).sum(), {"clip_fraction": (clipped * mask).sum(), "value_mse": (error * mask).sum()}


class PPO:
    """PPO as an ``RLAlgorithm`` (mlplat.rl.loop): one completion per prompt, the critic trained beside the policy."""

    recipe = "ppo"
    samples_per_prompt = 1

    def __init__(self, cfg: PPOConfig, critic_dir: str, new_value_head: bool = False):
        self.cfg, self.critic_dir, self.new_value_head = cfg, critic_dir, new_value_head
        self.prompts_per_rollout = cfg.prompts_per_generation
        self.epochs = cfg.num_ppo_epochs
        self.uses_reference = cfg.kl_coef > 0
        self.policy_objective = PPOPolicyObjective(cfg)
        self.critic: torch.nn.Module | None = None

    def extra_trainables(self, env: WorkerEnv, tokenizer) -> list[Trainable]:
        critic = extra_trainable("critic", TokenValues(load_reward_model(self.critic_dir), self.new_value_head), self.cfg, env, ValueObjective(self.cfg),
                                 self.critic_dir, self.cfg.critic_optim)  # fmt: skip
        self.critic = critic.model
        return [critic]

    @torch.no_grad()
    def experience(self, batch: dict[str, torch.Tensor], rewards: torch.Tensor, moments: Moments) -> dict[str, float]:
        cfg, mask = self.cfg, completion_mask(batch)
        values = torch.cat([token_values(self.critic, micro) for micro in micro_batches(batch, cfg.batch_size_per_worker)]) * mask
        old = batch["old_logprobs"]
        ref = batch.get("ref_logprobs", old)  # kl_coef = 0: no reference, no penalty
        token_rewards = kl_penalised_rewards(rewards, old, ref, mask, cfg.kl_coef)
        if cfg.whiten_rewards:
            token_rewards = masked_whiten(token_rewards, mask, moments, shift_mean=False)
        adv, returns = gae(token_rewards, values, mask, cfg.gamma, cfg.lam)
        batch["advantages"] = masked_whiten(adv, mask, moments)
        batch["old_values"], batch["returns"] = values, returns
        tokens = mask.sum().clamp(min=1)
        return {
            "objective/kl": ((old - ref) * mask).sum(-1).mean().item(),  # k1 per completion, summed over its tokens (TRL's name)
            "values/mean": (values.sum() / tokens).item(),
            "returns/mean": (returns.sum() / tokens).item(),
            "advantages/mean_unwhitened": (adv.sum() / tokens).item(),
        }


def ppo_loop(cfg: PPOConfig, env: WorkerEnv, rollout_workers: list, reward_scorers: dict | None = None, critic_dir: str | None = None) -> None:
    """Every rank's loop (mlplat.train.worker): the shared RL loop with PPO; the critic from ``critic_dir``, or from the
    policy checkpoint with a new value head (zero-initialised) without one."""
    rl_loop(cfg, env, PPO(cfg, critic_dir or cfg.model, new_value_head=critic_dir is None), rollout_workers, reward_scorers)


def run_ppo(cfg: PPOConfig, tracking_uri: str | None = None, work_dir: str | Path = "outputs") -> PPOResult:
    """Run the recipe on the connected Ray cluster (a local one is started if needed)."""

    critic_start: list[str] = []  # the directory the critic starts from, once resolved

    def critic(run: RecipeRun, resolve) -> dict:
        run.logger.set_tags({"mlplat.ppo.critic_model": cfg.critic_source() or f"{cfg.model} (new value head)"})
        critic_dir = str(resolve(cfg.critic_source())) if cfg.critic_source() else None  # None: the policy + a new head
        critic_start.append(critic_dir or str(run.model_dir))
        return {"critic_dir": critic_dir}

    result = run_rl("ppo", cfg, ppo_loop, tracking_uri, work_dir, setup=critic)
    return PPOResult(**result.model_dump(), critic_model=critic_start[0])


RECIPE = Recipe("ppo", PPOConfig, run_ppo)  # registered in pyproject.toml's mlplat.recipes entry points


def main(argv: list[str] | None = None) -> None:
    recipes.main("ppo", argv)


if __name__ == "__main__":
    main()
