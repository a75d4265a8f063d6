"""The loop every online RL recipe shares (GRPO, PPO), on any ``WorkerEnv``: rollouts on the engine actors,
rewards, no-grad scoring, optimizer steps through the shared ``train_step``, weight sync, metric windows
and checkpoints. A recipe supplies an ``RLAlgorithm``: what it adds to the scored batch (advantages, and
for PPO values and returns), what it trains (``Trainable``: the policy with its objective, and e.g. PPO's
critic with its own) and how many passes over each rollout.

    on every rank, until max_steps optimizer steps:
        rows <- the next algorithm.prompts_per_rollout prompts of this worker's shard
        samples <- algorithm.samples_per_prompt completions per prompt, with the engine's log-probs    (rollout)
        r <- sum_k reward_weights[k] reward_k(completion, row)                                           (reward)
        batch <- prompt + completion rows; old_logprobs and entropy at the sampling temperature, and
                 ref_logprobs if algorithm.uses_reference; the engine's log-probs checked against ours
                 metrics <- algorithm.experience(batch, r): advantages (values, returns...) into batch  (score)
        for epoch in 1..algorithm.epochs, for each optimizer step's grad_accum_steps micro-batches of
            batch_size_per_worker completions: one train_step per trainable, the policy first, on the
            same micro-batches (each its own optimizer, scheduler and grad_clip)                       (train)
        rank 0 pushes the policy's weights to every rollout actor in place                              (sync)
        a log window every log_every steps (MLflow, Prometheus), a checkpoint every checkpoint_every:
        the policy as every recipe saves it, each other trainable in the subdirectory named after it

Every collective goes through ``mlplat.collectives``; every log-prob through ``mlplat.train.logprobs``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Protocol

import torch
from pydantic import Field, field_validator, model_validator

from mlplat import collectives
from mlplat.data.ingest import DataConfig
from mlplat.data.rl_prompts import prompt_messages
from mlplat.evaluation import read_eval_rows
from mlplat.models import load_model, load_tokenizer
from mlplat.observability import catalogue as oc
from mlplat.observability.progress import ProgressReporter
from mlplat.rl.experience import RowsCollate, batch_moments, completion_mask, micro_batches, rollout_batch, score_completions
from mlplat.rl.rewards import RewardConfig, build_reward_fn, weighted_rewards
from mlplat.rl.rollout import RolloutConfig, generate, held_out_exact_match, sync_weights
from mlplat.train.checkpoint import TRAIN_STATE, CheckpointMeta, load_checkpoint, save_checkpoint
from mlplat.train.health import RankHealth
from mlplat.train.loop import (
    MetricWindow,
    RecipeConfig,
    checkpoint_meta,
    crossed,
    frozen_reference,
    record_step,
    train_shard,
    trainable,
    worker_setup,
)
from mlplat.train.losses import Moments
from mlplat.train.optim import OptimizerConfig
from mlplat.train.step import Objective, StepStats, train_step
from mlplat.train.worker import WorkerEnv, checkpoint_directory

log = logging.getLogger("mlplat.rl")


class RLConfig(RecipeConfig):
    """The fields every online RL recipe shares (TRL's names where TRL has them)."""

    data: DataConfig  # RL prompt rows: {"prompt" | "messages", ...task fields}
    eval_data: str | None = None  # held-out {"messages", "answer"} JSONL: greedy exact match before and after
    eval_limit: int | None = None
    batch_size_per_worker: int = Field(default=8, gt=0)  # completions per micro-batch per worker (TRL's per_device_train_batch_size)
    max_completion_length: int = Field(default=256, gt=0)
    temperature: float = Field(default=1.0, gt=0)  # sampling; the trainer's log-probs are taken at it too
    top_p: float = Field(default=1.0, gt=0, le=1)
    mask_truncated_completions: bool = False  # completions cut at max_completion_length add nothing to the loss
    reward: list[RewardConfig] = Field(default_factory=lambda: [RewardConfig()])  # one source (a mapping) or several, summed (TRL's reward_funcs)
    reward_weights: list[float] | None = None  # one per reward source; None: all 1
    rollout: RolloutConfig = RolloutConfig()
    optim: OptimizerConfig = OptimizerConfig(lr=1e-6, warmup_steps=0, min_lr_ratio=1.0)

    @field_validator("reward", mode="before")
    @classmethod
    def _one_or_several(cls, value):
        return [value] if isinstance(value, dict | RewardConfig) else value

    @model_validator(mode="after")
    def _reward_sources(self):
        labels = [r.label for r in self.reward]
        if not labels:
            raise ValueError("reward: give at least one reward source")
        if len(set(labels)) < len(labels):
            raise ValueError(f"reward: sources need distinct names (got {labels}); set reward[i].name")
        if self.reward_weights is not None and len(self.reward_weights) != len(labels):
            raise ValueError(f"reward_weights has {len(self.reward_weights)} weights for {len(labels)} reward sources {labels}")
        return self


@dataclass
class Trainable:
    """A model the loop trains: its optimizer and schedule, the objective ``train_step`` minimises, its ``grad_clip``.

    The first trainable is the policy (synced to the rollout actors, exported as the HF model; its statistics are
    logged unprefixed); another one's are logged as ``{name}/...`` and its state is checkpointed in ``<checkpoint>/{name}/``."""

    name: str
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    objective: Objective
    grad_clip: float
    meta: CheckpointMeta


class RLAlgorithm(Protocol):
    """What distinguishes one RL recipe from another on the shared loop (GRPO, PPO)."""

    recipe: str  # "grpo", "ppo": the health checks' and Prometheus' label
    samples_per_prompt: int  # completions the engine samples per prompt (GRPO's num_generations; PPO: 1)
    prompts_per_rollout: int  # prompts each worker samples per rollout (x samples_per_prompt: whole micro-batches)
    epochs: int  # passes over each rollout (GRPO's num_iterations, PPO's num_ppo_epochs)
    uses_reference: bool  # score ref_logprobs with the frozen reference (a KL term or penalty)
    policy_objective: Objective

    def extra_trainables(self, env: WorkerEnv, tokenizer) -> list[Trainable]:
        """Models trained beside the policy (PPO's critic: ``extra_trainable``); called once, after the policy is built."""
        ...

    def experience(self, batch: dict[str, torch.Tensor], rewards: torch.Tensor, moments: Moments) -> dict[str, float]:
        """Add what the objectives read to the scored ``batch`` on the device (it holds ``old_logprobs``, ``engine_logprobs``,
        ``ref_logprobs`` with a reference, and the rows' ``labels``): advantages, values, returns... ``rewards`` [N] are
        the completions' in order, ``moments`` mean and std over every rank's values. Returns this rollout's metrics."""
        ...


def extra_trainable(name: str, model: torch.nn.Module, cfg: RecipeConfig, env: WorkerEnv, objective: Objective, base_model: str,
                    optim: OptimizerConfig | None = None) -> Trainable:  # fmt: skip
    """A model trained beside the policy (not a causal LM: no LoRA, no log-prob head), parallelized like it, with its own
    optimizer (``optim``, default the policy's) and schedule, restored from ``<checkpoint>/{name}/`` when the run restarts
    or resumes from a checkpoint that has one (from scratch otherwise, with a warning)."""
    optim = optim or cfg.optim
    own = cfg.model_copy(update={"optim": optim, "lora": None})
    model, optimizer, scheduler, _ = trainable(model, own, SimpleNamespace(device=env.device, restore_from=None))
    if env.restore_from:
        with checkpoint_directory(env.restore_from) as directory:
            if (Path(directory) / name / TRAIN_STATE).is_file():
                load_checkpoint(Path(directory) / name, model, optimizer, scheduler)
            else:
                log.warning("%s: the checkpoint %s has no %s/ state: it starts from %s", name, directory, name, base_model)
    meta = CheckpointMeta(base_model=base_model, format=cfg.checkpoint_format)
    return Trainable(name, model, optimizer, scheduler, objective, optim.grad_clip, meta)


def save_trainables(env: WorkerEnv, trainables: list[Trainable], state, tokenizer, export_hf: bool) -> None:
    """Every rank writes its part of the checkpoint at ``state.step``: the policy as ``mlplat.train.loop.save`` does (with the
    servable HF export unless ``export_hf=False``), each other trainable's model, optimizer and schedule in ``{name}/``."""
    policy, others = trainables[0], trainables[1:]

    def write(directory: Path) -> None:
        save_checkpoint(directory, policy.model, policy.optimizer, policy.scheduler, state, policy.meta, tokenizer, export_hf)
        for t in others:
            (Path(directory) / t.name).mkdir(parents=True, exist_ok=True)
            save_checkpoint(Path(directory) / t.name, t.model, t.optimizer, t.scheduler, state, t.meta)

    env.save_checkpoint({"step": state.step}, write)


def rl_loop(cfg: RLConfig, env: WorkerEnv, algorithm: RLAlgorithm, rollout_workers: list, reward_scorers: dict | None = None) -> None:
    """Every rank's loop (mlplat.train.worker), sampling from its rollout worker (rank r uses rollout_workers[r % len]: a Ray
    actor, or an ``InProcessRollout`` of its own where the loop runs without Ray)."""
    health = RankHealth(cfg.health, cfg.debug, env, algorithm.recipe)
    try:
        _train(cfg, env, algorithm, rollout_workers, reward_scorers, health)
    finally:
        health.close()


def _train(cfg: RLConfig, env: WorkerEnv, algorithm: RLAlgorithm, rollout_workers: list, reward_scorers: dict | None, health: RankHealth) -> None:
    worker_setup(cfg)
    rank, world_size, device, logger = collectives.rank(), collectives.world_size(), env.device, env.logger
    tokenizer = load_tokenizer(cfg.model)
    reward_fns = {r.label: build_reward_fn(r, (reward_scorers or {}).get(r.label)) for r in cfg.reward}
    reward_weights = cfg.reward_weights or [1.0] * len(reward_fns)
    my_rollout = rollout_workers[rank % len(rollout_workers)]
    n = algorithm.samples_per_prompt
    if (algorithm.prompts_per_rollout * n) % cfg.batch_size_per_worker or (algorithm.prompts_per_rollout * n // cfg.batch_size_per_worker) % cfg.grad_accum_steps:
        raise ValueError(f"{algorithm.prompts_per_rollout} prompts x {n} completions per rollout: not whole optimizer steps of "
                         f"grad_accum_steps={cfg.grad_accum_steps} micro-batches of batch_size_per_worker={cfg.batch_size_per_worker}")  # fmt: skip

    loader = train_shard(env, algorithm.prompts_per_rollout, cfg.seed, RowsCollate())
    model, optimizer, scheduler, state = trainable(load_model(cfg.model), cfg, env)
    policy = Trainable("policy", model, optimizer, scheduler, algorithm.policy_objective, cfg.optim.grad_clip, checkpoint_meta(cfg))
    trainables = [policy, *algorithm.extra_trainables(env, tokenizer)]
    reference = frozen_reference(cfg, env, policy.model) if algorithm.uses_reference else None
    if state.step > 0:  # restarted from a checkpoint: the actors may hold other weights
        sync_weights(policy.model, rollout_workers, rank, device)
    sampling = {"n": n, "max_tokens": cfg.max_completion_length, "temperature": cfg.temperature, "top_p": cfg.top_p}
    eval_rows = read_eval_rows(cfg.eval_data, cfg.eval_limit) if cfg.eval_data and logger else None
    if eval_rows and state.step == 0:
        logger.log_metrics({"eval/exact_match_before": held_out_exact_match(my_rollout, eval_rows, cfg.max_completion_length)}, step=0)
    moments = batch_moments(device)
    window, max_logprob_diff = MetricWindow(device, maxima=("rollout/logprob_diff_max", "run/logprob_diff_max")), 0.0
    own_work_s: list[float] = []  # per rollout: this rank's scoring and training, what the straggler check compares

    progress = ProgressReporter(algorithm.recipe, cfg.max_steps) if rank == 0 else None
    while state.step < cfg.max_steps:
        step_before = state.step
        health.inject_faults(state.step + 1)
        rows = loader.next()
        start = time.perf_counter()
        # The actor seeds each completion seed + its index in the call: one disjoint range per (step, rank).
        seed = cfg.seed + (state.step * world_size + rank) * len(rows) * n
        samples = generate(my_rollout, [prompt_messages(r) for r in rows], {**sampling, "seed": seed})
        rollout_s = time.perf_counter() - start

        start = time.perf_counter()
        rewards, per_source = weighted_rewards(reward_fns, reward_weights, samples, [row for row in rows for _ in range(n)])
        reward_s = time.perf_counter() - start

        start = time.perf_counter()
        batch = {k: v.to(device) for k, v in rollout_batch(samples, tokenizer.pad_token_id, cfg.mask_truncated_completions).items()}
        mask = completion_mask(batch)
        scored = score_completions(policy.model, batch, cfg.batch_size_per_worker, cfg.temperature, entropy=True)
        batch["old_logprobs"] = scored["logprobs"]
        if reference is not None:
            batch["ref_logprobs"] = score_completions(reference, batch, cfg.batch_size_per_worker, cfg.temperature)["logprobs"]
        # The trainer and the rollout engine must agree on the sampled tokens' log-probs: stale weights would not.
        logprob_diff = ((scored["raw_logprobs"] - batch["engine_logprobs"]).abs() * mask).max().item()
        max_logprob_diff = max(max_logprob_diff, logprob_diff)
        experience_metrics = algorithm.experience(batch, rewards.to(device), moments)
        score_s = time.perf_counter() - start

        start, step_stats = time.perf_counter(), []
        micro = micro_batches(batch, cfg.batch_size_per_worker)
        for _ in range(algorithm.epochs):
            for first in range(0, len(micro), cfg.grad_accum_steps):
                if state.step == cfg.max_steps:
                    break
                stats = train_trainables(trainables, micro[first : first + cfg.grad_accum_steps], cfg.use_gpu and cfg.bf16)
                record_step(state, next((s for s in stats.values() if s.skipped), stats["policy"]), cfg.max_bad_steps_in_row)
                step_stats.append(step_metrics(stats))
        train_s = time.perf_counter() - start
        own_work_s.append(score_s + train_s)

        start = time.perf_counter()
        sync_weights(policy.model, rollout_workers, rank, device)
        sync_s = time.perf_counter() - start
        state.data = loader.position.model_copy()

        completion_tokens = sum(len(s.completion_ids) for s in samples)
        mean_reward = rewards.mean().item()
        if progress:
            progress.update(state.step, reward=mean_reward)
        window.add({
            **mean_of_steps(step_stats), **experience_metrics,
            "reward/mean": mean_reward, "reward/std": rewards.std().item(),
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
            metrics = {**window.pop(), "lr": policy.scheduler.get_last_lr()[0], "skipped_steps": state.skipped_steps}
            metrics["rollout/tokens_per_s"] *= world_size  # every rank's rollouts together
            metrics |= health.end_window(metrics, local_s=sum(own_work_s) / len(own_work_s))  # this rank's, not the window's mean
            own_work_s = []
            if last and eval_rows:
                metrics["eval/exact_match"] = held_out_exact_match(my_rollout, eval_rows, cfg.max_completion_length)
            if logger:
                logger.log_metrics(metrics, step=state.step)
                export_metrics(metrics, algorithm.recipe, env.run_id)
        if last or crossed(step_before, state.step, cfg.checkpoint_every):
            save_trainables(env, trainables, state, tokenizer, export_hf=cfg.checkpoint_hf or last)
        health.step_done()


def train_trainables(trainables: list[Trainable], micro: list[dict[str, torch.Tensor]], bf16: bool) -> dict[str, StepStats]:
    """One optimizer step of every trainable on the same micro-batches, the policy first: {name: its StepStats}."""
    return {t.name: train_step(t.model, micro, t.optimizer, t.scheduler, t.grad_clip, bf16, objective=t.objective) for t in trainables}


def step_metrics(stats: dict[str, StepStats]) -> dict[str, float]:
    """An optimizer step's figures: the policy's loss, grad norm and objective statistics unprefixed, another
    trainable's as ``{name}/...``; a skipped update adds none (``record_step`` counts it)."""
    out: dict[str, float] = {}
    for name, s in stats.items():
        if s.skipped:
            continue
        prefix = "" if name == "policy" else f"{name}/"
        out |= {f"{prefix}loss": s.loss, f"{prefix}grad_norm": s.grad_norm, **{f"{prefix}{k}": v for k, v in s.metrics.items()}}
    return out


def mean_of_steps(step_stats: list[dict[str, float]]) -> dict[str, float]:
    """Each key's mean over the optimizer steps that reported it."""
    keys = {k for s in step_stats for k in s}
    return {k: sum(s[k] for s in step_stats if k in s) / sum(k in s for s in step_stats) for k in sorted(keys)}


PHASES = ("rollout", "reward", "score", "train", "sync")


def export_metrics(metrics: dict[str, float], recipe: str, run_id: str) -> None:
    """Rank 0's log window as Prometheus metrics (mlplat.observability.catalogue)."""
    job = {"recipe": recipe, "run_id": run_id}
    for metric, key in ((oc.RL_REWARD_MEAN, "reward/mean"), (oc.RL_REWARD_STD, "reward/std"), (oc.RL_KL, "kl"),
                        (oc.RL_ROLLOUT_TOKENS_PER_S, "rollout/tokens_per_s"), (oc.RL_RESPONSE_LENGTH, "completions/mean_length"),
                        (oc.TRAIN_LOSS, "loss"), (oc.TRAIN_LR, "lr"), (oc.TRAIN_GRAD_NORM, "grad_norm")):  # fmt: skip
        if key in metrics:
            metric.set(metrics[key], **job)
    for phase in PHASES:
        oc.TRAIN_STEP_PHASE_SECONDS.set(metrics[f"time/{phase}_s"], phase=phase, rank="0", **job)

