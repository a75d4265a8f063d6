"""GRPO (group relative policy optimisation) with rollout actors, on the shared recipe skeleton.

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

import sys
import time
from pathlib import Path

import ray
import torch
from pydantic import BaseModel, Field, field_validator, model_validator

from mlplat.data.ingest import DataConfig
from mlplat.data.rl_prompts import prepare_rl_prompt_dataset, prompt_messages
from mlplat.evaluation import read_eval_rows
from mlplat.health.training import RankHealth
from mlplat.models import load_model, load_tokenizer
from mlplat.observability import catalogue as oc
from mlplat.rl.experience import RowsCollate, batch_moments, completion_mask, micro_batches, rollout_batch, score_completions
from mlplat.rl.rewards import RewardConfig, build_reward_fn, start_reward_model, weighted_rewards
from mlplat.rl.rollout import RolloutConfig, held_out_exact_match, start_rollout_workers, sync_weights
from mlplat.tracking import ModelRef, resolve_model
from mlplat.train import collectives
from mlplat.train.logprobs import labelled_logprobs
from mlplat.train.loop import (
    MetricWindow,
    RecipeConfig,
    checkpoint_meta,
    crossed,
    frozen_reference,
    record_step,
    save,
    train_shard,
    trainable,
    worker_setup,
)
from mlplat.train.losses import (
    AdvantageEstimator,
    LossType,
    ScaleRewards,
    advantages,
    clipped_surrogate,
    k3_kl,
    summed_token_loss,
    token_loss_units,
)
from mlplat.train.optim import OptimizerConfig
from mlplat.train.recipe import RecipeRun
from mlplat.train.step import train_step
from mlplat.train.worker import WorkerEnv


class GRPOConfig(RecipeConfig):
    data: DataConfig  # RL prompt rows: {"prompt" | "messages", ...task fields}
    eval_data: str | None = None  # held-out {"messages", "answer"} JSONL: greedy exact match before and after
    eval_limit: int | None = None
    batch_size_per_worker: int = Field(default=8, gt=0)  # completions per micro-batch per worker (TRL's per_device_train_batch_size)
    num_generations: int = Field(default=8, ge=2)  # completions per prompt (G)
    steps_per_generation: int | None = Field(default=None, gt=0)  # micro-batches each rollout feeds; None: grad_accum_steps (one optimizer step)
    num_iterations: int = Field(default=1, ge=1)  # passes over each rollout (PPO epochs, TRL's mu)
    max_completion_length: int = Field(default=256, gt=0)
    temperature: float = Field(default=1.0, gt=0)  # sampling; the trainer's log-probs are taken at it too
    top_p: float = Field(default=1.0, gt=0, le=1)
    beta: float = Field(default=0.0, ge=0)  # k3 KL penalty to the reference model; 0 loads no reference
    epsilon: float = Field(default=0.2, gt=0)  # clip range of the ratio, lower side
    epsilon_high: float | None = Field(default=None, gt=0)  # upper side (DAPO's clip-higher); None: epsilon
    loss_type: LossType = "dapo"
    scale_rewards: ScaleRewards = "group"  # group_norm's divisor: the group's std, the batch's, or none (Dr. GRPO)
    advantage_estimator: AdvantageEstimator = "group_norm"
    mask_truncated_completions: bool = False  # completions cut at max_completion_length add nothing to the loss
    reward: list[RewardConfig] = Field(default_factory=lambda: [RewardConfig()])  # one source (a mapping) or several, summed (TRL's reward_funcs)
    reward_weights: list[float] | None = None  # one per reward source; None: all 1
    rollout: RolloutConfig = RolloutConfig()
    optim: OptimizerConfig = OptimizerConfig(lr=1e-6, warmup_steps=0, min_lr_ratio=1.0)
    experiment: str = "mlplat-grpo"
    registered_model: str | None = "grpo-model"

    @field_validator("reward", mode="before")
    @classmethod
    def _one_or_several(cls, value):
        return [value] if isinstance(value, dict | RewardConfig) else value

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
        labels = [r.label for r in self.reward]
        if not labels:
            raise ValueError("reward: give at least one reward source")
        if len(set(labels)) < len(labels):
            raise ValueError(f"reward: sources need distinct names (got {labels}); set reward[i].name")
        if self.reward_weights is not None and len(self.reward_weights) != len(labels):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} weights for {len(labels)} reward sources {labels}")
        return self


class GRPOResult(BaseModel):
    run_id: str
    model_dir: str
    model_version: ModelRef | None
    rewards: list[float]  # mean reward per log window, in order
    eval_before: float | None  # held-out exact match (greedy) of the starting model
    eval_after: float | None
    max_logprob_diff: float  # largest |trainer - rollout engine| log-prob seen on sampled tokens, whole run


class GRPOObjective:
    """The clipped policy gradient (+ beta k3 KL) on a micro-batch of completions, averaged by ``loss_type``.

    The batch carries each row's ``advantages``, ``old_logprobs`` and, with beta > 0, ``ref_logprobs``."""

    def __init__(self, cfg: GRPOConfig):
        self.cfg = cfg

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return token_loss_units(completion_mask(batch), self.cfg.loss_type, self.cfg.max_completion_length)

    def __call__(self, policy, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        cfg, mask = self.cfg, completion_mask(batch)
        logprobs = labelled_logprobs(policy, batch, cfg.temperature)
        per_token, clipped = clipped_surrogate(logprobs, batch["old_logprobs"], batch["advantages"], cfg.epsilon, cfg.epsilon_high)
        stats = {"clip_fraction": summed_token_loss(clipped.float(), mask, cfg.loss_type)}
        if cfg.beta > 0:
            kl = k3_kl(logprobs, batch["ref_logprobs"])
            per_token = per_token + cfg.beta * kl
            stats["kl"] = summed_token_loss(kl.detach(), mask, cfg.loss_type)
        return summed_token_loss(per_token, mask, cfg.loss_type), stats


def grpo_loop(cfg: GRPOConfig, env: WorkerEnv, rollout_workers: list, reward_scorers: dict | None = None) -> None:
    """Every rank's loop (mlplat.train.worker), sampling from its rollout actor."""
    health = RankHealth(cfg.health, cfg.debug, env, "grpo")
    try:
        _train(cfg, env, rollout_workers, reward_scorers, health)
    finally:
        health.close()


def _train(cfg: GRPOConfig, env: WorkerEnv, rollout_workers: list, reward_scorers: dict | None, health: RankHealth) -> None:
    worker_setup(cfg)
    rank, world_size, device, logger = collectives.rank(), collectives.world_size(), env.device, env.logger
    tokenizer = load_tokenizer(cfg.model)
    reward_fns = {r.label: build_reward_fn(r, (reward_scorers or {}).get(r.label)) for r in cfg.reward}
    reward_weights = cfg.reward_weights or [1.0] * len(reward_fns)
    my_rollout = rollout_workers[rank % len(rollout_workers)]

    loader = train_shard(env, cfg.prompts_per_generation, cfg.seed, RowsCollate())
    policy, optimizer, scheduler, state = trainable(load_model(cfg.model), cfg, env)
    reference = frozen_reference(cfg, env, policy) if cfg.beta > 0 else None
    if state.step > 0:  # restarted from a checkpoint: the actors may hold other weights
        sync_weights(policy, rollout_workers, rank, device)
    meta = checkpoint_meta(cfg)
    sampling = {"n": cfg.num_generations, "max_tokens": cfg.max_completion_length, "temperature": cfg.temperature, "top_p": cfg.top_p}
    eval_rows = read_eval_rows(cfg.eval_data, cfg.eval_limit) if cfg.eval_data and logger else None
    if eval_rows and state.step == 0:
        logger.log_metrics({"eval/exact_match_before": held_out_exact_match(my_rollout, eval_rows, cfg.max_completion_length)}, step=0)
    objective, moments = GRPOObjective(cfg), batch_moments(device)
    window, max_logprob_diff = MetricWindow(device, maxima=("rollout/logprob_diff_max", "run/logprob_diff_max")), 0.0
    own_work_s: list[float] = []  # per rollout: this rank's scoring and training, what the straggler check compares

    while state.step < cfg.max_steps:
        step_before = state.step
        health.inject_faults(state.step + 1)
        rows = loader.next()
        start = time.perf_counter()
        samples = ray.get(my_rollout.generate.remote([prompt_messages(r) for r in rows], {**sampling, "seed": cfg.seed + 1000 * state.step + rank}))
        rollout_s = time.perf_counter() - start

        start = time.perf_counter()
        rewards, per_source = weighted_rewards(reward_fns, reward_weights, samples, [row for row in rows for _ in range(cfg.num_generations)])
        adv = advantages(rewards, cfg.num_generations, cfg.advantage_estimator, cfg.scale_rewards, moments)
        reward_s = time.perf_counter() - start

        start = time.perf_counter()
        batch = {k: v.to(device) for k, v in {**rollout_batch(samples, tokenizer.pad_token_id, cfg.mask_truncated_completions), "advantages": adv}.items()}
        mask = completion_mask(batch)
        scored = score_completions(policy, batch, cfg.batch_size_per_worker, cfg.temperature, entropy=True)
        batch["old_logprobs"] = scored["logprobs"]
        if reference is not None:
            batch["ref_logprobs"] = score_completions(reference, batch, cfg.batch_size_per_worker, cfg.temperature)["logprobs"]
        # The trainer and the rollout engine must agree on the sampled tokens' log-probs: stale weights would not.
        logprob_diff = ((scored["raw_logprobs"] - batch["engine_logprobs"]).abs() * mask).max().item()
        max_logprob_diff = max(max_logprob_diff, logprob_diff)
        score_s = time.perf_counter() - start

        start, step_stats = time.perf_counter(), []
        micro = micro_batches(batch, cfg.batch_size_per_worker)
        for _ in range(cfg.num_iterations):
            for first in range(0, len(micro), cfg.grad_accum_steps):
                if state.step == cfg.max_steps:
                    break
                stats = train_step(policy, micro[first : first + cfg.grad_accum_steps], optimizer, scheduler, cfg.optim.grad_clip,
                                   cfg.use_gpu and cfg.bf16, objective=objective)  # fmt: skip
                record_step(state, stats, cfg.max_bad_steps_in_row)
                if not stats.skipped:
                    step_stats.append({"loss": stats.loss, "grad_norm": stats.grad_norm, **stats.metrics})
        train_s = time.perf_counter() - start
        own_work_s.append(score_s + train_s)

        start = time.perf_counter()
        sync_weights(policy, rollout_workers, rank, device)
        sync_s = time.perf_counter() - start
        state.data = loader.position.model_copy()

        completion_tokens = sum(len(s.completion_ids) for s in samples)
        window.add({
            **{k: sum(s[k] for s in step_stats) / len(step_stats) for k in (step_stats[0] if step_stats else {})},
            "reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(),
            **({f"rewards/{name}/{stat}": getattr(values, stat)().item() for name, values in per_source.items() for stat in ("mean", "std")}
               if len(per_source) > 1 else {}),
            "entropy": ((scored["entropy"] * mask).sum() / mask.sum().clamp(min=1)).item(),
            "completions/mean_length": completion_tokens / len(samples),
            "completions/clipped_ratio": sum(s.finish_reason == "length" for s in samples) / len(samples),
            "rollout/tokens_per_s": completion_tokens / rollout_s, "rollout/logprob_diff_max": logprob_diff, "run/logprob_diff_max": max_logprob_diff,
            "time/rollout_s": rollout_s, "time/reward_s": reward_s, "time/score_s": score_s, "time/train_s": train_s, "time/sync_s": sync_s,
        })  # fmt: skip

        last = state.step == cfg.max_steps
        if last or crossed(step_before, state.step, cfg.log_every):
            metrics = {**window.pop(), "lr": scheduler.get_last_lr()[0], "skipped_steps": state.skipped_steps}
            metrics["rollout/tokens_per_s"] *= world_size  # every rank's rollouts together
            metrics |= health.end_window(metrics, local_s=sum(own_work_s) / len(own_work_s))  # this rank's, not the window's mean
            own_work_s = []
            if last and eval_rows:
                metrics["eval/exact_match"] = held_out_exact_match(my_rollout, eval_rows, cfg.max_completion_length)
            if logger:
                logger.log_metrics(metrics, step=state.step)
                export_metrics(metrics, env.run_id)
        if last or crossed(step_before, state.step, cfg.checkpoint_every):
            save(env, {"step": state.step}, policy, optimizer, scheduler, state, meta, tokenizer, export_hf=cfg.checkpoint_hf or last)
        health.step_done()


def export_metrics(metrics: dict[str, float], run_id: str) -> None:
    """Rank 0's log window as Prometheus metrics (mlplat.observability.catalogue)."""
    job = {"recipe": "grpo", "run_id": run_id}
    for metric, key in ((oc.RL_REWARD_MEAN, "reward/mean"), (oc.RL_REWARD_STD, "reward/std"), (oc.RL_KL, "kl"),
                        (oc.RL_ROLLOUT_TOKENS_PER_S, "rollout/tokens_per_s"), (oc.RL_RESPONSE_LENGTH, "completions/mean_length"),
                        (oc.TRAIN_LOSS, "loss"), (oc.TRAIN_LR, "lr"), (oc.TRAIN_GRAD_NORM, "grad_norm")):  # fmt: skip
        if key in metrics:
            metric.set(metrics[key], **job)
    for phase in ("rollout", "reward", "score", "train", "sync"):
        oc.TRAIN_STEP_PHASE_SECONDS.set(metrics[f"time/{phase}_s"], phase=phase, rank="0", **job)


def run_grpo(cfg: GRPOConfig, tracking_uri: str | None = None, work_dir: str | Path = "outputs") -> GRPOResult:
    """Run the recipe on the connected Ray cluster (a local one is started if needed)."""
    run = RecipeRun("grpo", cfg, tracking_uri, work_dir)
    rollout_workers, scorers = [], {}
    try:
        with run.tracked():
            dataset, data_report = prepare_rl_prompt_dataset(cfg.data, rejects_dir=run.work_dir / run.run_id)
            run.log_data_report(data_report)
            rollout_workers = start_rollout_workers(str(run.model_dir), cfg.rollout)
            for source in cfg.reward:
                if source.kind == "reward_model":
                    rm_dir = resolve_model(source.reward_model, download_dir=run.work_dir / "downloads", tracking_uri=run.tracking_uri)
                    scorers[source.label] = start_reward_model(source, str(rm_dir))
            result = run.fit(grpo_loop, {"train": dataset}, extra={"rollout_workers": rollout_workers, "reward_scorers": scorers})
            final_dir, version = run.finish(result)
    finally:
        for actor in [*rollout_workers, *scorers.values()]:
            ray.kill(actor)
    client = run.logger.client
    rewards = sorted(client.get_metric_history(run.run_id, "reward/mean"), key=lambda m: m.step)
    metrics = client.get_run(run.run_id).data.metrics
    return GRPOResult(
        run_id=run.run_id,
        model_dir=str(final_dir),
        model_version=version,
        rewards=[m.value for m in rewards],
        eval_before=metrics.get("eval/exact_match_before"),
        eval_after=metrics.get("eval/exact_match"),
        max_logprob_diff=metrics["run/logprob_diff_max"],
    )


def main(argv: list[str] | None = None) -> None:
    from mlplat.cli import main as cli_main

    cli_main(["train", "grpo", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    main()
