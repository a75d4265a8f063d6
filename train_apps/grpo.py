"""GRPO (group relative policy optimisation) with rollout actors, on Ray Train.

    input: an HF checkpoint (usually the SFT model), RL prompts with task fields (e.g. ``answer``)
    0. start rollout actors (the native engine) on the same weights                  [Ray actors]
    1. validate the prompt rows                                                         [Ray Data]
    2. on each of N training workers:                                                   [Ray Train]
         pi_theta <- the checkpoint (DDP/FSDP2); pi_ref <- the same, frozen (if kl_coef > 0)
         for step in 1..max_steps:
             prompts <- next batch of this worker's prompts
             G samples per prompt with their log-probs <- its rollout actor            (rollout)
             r <- reward(sample, row): exact match | function | reward model | LLM judge (reward)
             A <- (r - mean_group(r)) / (std_group(r) + eps)                  group-normalised advantages
             log pi_old <- pi_theta(samples), no grad (checked against the engine's log-probs)
             for epoch in 1..ppo_epochs, for each of num_mini_batches:                  (train)
                 ratio = pi_theta / pi_old per token
                 loss <- sum over tokens of -min(ratio A, clip(ratio, 1-eps, 1+eps) A)
                         + kl_coef * KL_k3(pi_theta || pi_ref),  / tokens in the global batch
                 AdamW step
             rank 0 pushes pi_theta's weights to every rollout actor in place         (sync)
             every log_every: reward mean/std, KL, entropy, response length, clip fraction,
                              rollout tokens/s, time per phase -> MLflow
    3. exact match on held-out prompts (greedy, via a rollout actor) before and after;
       the final model registered in MLflow like SFT's
    output: run id, model version, rewards and held-out accuracy

Run: ``mlplat train grpo --config grpo.yaml``.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np
import ray
import torch
from pydantic import BaseModel, Field, model_validator

from mlplat.data.ingest import DataConfig
from mlplat.data.rl_prompts import prepare_rl_prompt_dataset, prompt_messages
from mlplat.evaluation import extract_answer, read_eval_rows
from mlplat.models import load_model, load_tokenizer
from mlplat.observability import catalogue as oc
from mlplat.rl.rewards import RewardConfig, build_reward_fn, start_reward_model
from mlplat.rl.rollout import RolloutConfig, Sample, start_rollout_workers
from mlplat.tracking import ModelRef, resolve_model
from mlplat.train import collectives
from mlplat.train.batch import IGNORE_INDEX, pad_collate
from mlplat.train.checkpoint import CheckpointMeta
from mlplat.train.loop import MetricWindow, RecipeConfig, save, train_shard, trainable, worker_setup
from mlplat.train.losses import group_advantages, grpo_loss, token_logprobs
from mlplat.train.optim import OptimizerConfig
from mlplat.train.parallel import full_state_dict
from mlplat.train.recipe import RecipeRun
from mlplat.train.worker import WorkerEnv


class GRPOConfig(RecipeConfig):
    data: DataConfig  # RL prompt rows: {"prompt" | "messages", ...task fields}
    eval_data: str | None = None  # held-out {"messages", "answer"} JSONL: greedy exact match before and after
    eval_limit: int | None = None
    batch_size_per_worker: int = Field(default=8, gt=0)  # prompts per worker per step
    group_size: int = Field(default=8, ge=2)  # samples per prompt (G)
    max_new_tokens: int = Field(default=8, gt=0)
    temperature: float = Field(default=1.0, gt=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    clip_ratio: float = Field(default=0.2, gt=0)  # PPO's epsilon
    kl_coef: float = Field(default=0.0, ge=0)  # KL penalty to the reference model (TRL's beta); 0 skips the reference
    scale_rewards: bool = True  # divide advantages by the group's std (False: Dr. GRPO)
    ppo_epochs: int = Field(default=1, ge=1)  # passes over each rollout batch
    num_mini_batches: int = Field(default=1, ge=1)  # optimizer steps per pass
    reward: RewardConfig = RewardConfig()
    rollout: RolloutConfig = RolloutConfig()
    optim: OptimizerConfig = OptimizerConfig(lr=1e-5, warmup_steps=0, min_lr_ratio=1.0)
    experiment: str = "mlplat-grpo"
    registered_model: str | None = "grpo-model"


    @model_validator(mode="after")
    def _whole_mini_batches(self):
        samples = self.batch_size_per_worker * self.group_size
        if samples % self.num_mini_batches:
            raise ValueError(
                f"num_mini_batches={self.num_mini_batches} must divide the samples per worker per step "
                f"(batch_size_per_worker x group_size = {samples})"
            )
        return self


class GRPOResult(BaseModel):
    run_id: str
    model_dir: str
    model_version: ModelRef | None
    rewards: list[float]  # mean reward per log window, in order
    eval_before: float | None  # held-out exact match (greedy) of the starting model
    eval_after: float | None
    max_logprob_diff: float  # largest |trainer - rollout engine| log-prob seen on sampled tokens, whole run


class RowsCollate:
    """Prompt rows stay JSON text in Ray Data (task fields vary); the trainer gets dicts."""

    def __call__(self, batch: dict[str, np.ndarray]) -> list[dict]:
        return [json.loads(text) for text in batch["text"]]


def rollout_batch(samples: list[Sample], advantages: torch.Tensor, pad_token_id: int) -> dict[str, torch.Tensor]:
    """Prompt + completion rows, labels on completion tokens only, and the engine's log-probs per target position."""
    ids = [s.prompt_ids + s.completion_ids for s in samples]
    labels = [[IGNORE_INDEX] * len(s.prompt_ids) + s.completion_ids for s in samples]
    batch = pad_collate({"input_ids": ids, "labels": labels}, pad_token_id)
    engine_logprobs = torch.zeros(batch["labels"][:, 1:].shape)
    for i, s in enumerate(samples):  # target position t predicts token t+1
        start = len(s.prompt_ids) - 1
        engine_logprobs[i, start : start + len(s.logprobs)] = torch.tensor(s.logprobs)
    return {**batch, "advantages": advantages, "engine_logprobs": engine_logprobs}


def policy_logprobs(model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of the completion tokens [B, L-1] (0 elsewhere), and the logits."""
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], use_cache=False).logits
    return token_logprobs(logits, batch["labels"])[0], logits


def entropy(logits: torch.Tensor, mask: torch.Tensor) -> float:
    logp = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    per_token = -(logp.exp() * logp).sum(-1)
    return ((per_token * mask).sum() / mask.sum().clamp(min=1)).item()


def grpo_loop(cfg: GRPOConfig, env: WorkerEnv, rollout_workers: list, reward_scorer=None) -> None:
    """Every rank's loop (mlplat.train.worker), sampling from its rollout actor."""
    worker_setup(cfg)
    rank, world_size, device, logger = collectives.rank(), collectives.world_size(), env.device, env.logger
    tokenizer = load_tokenizer(cfg.model)
    reward_fn = build_reward_fn(cfg.reward, reward_scorer)
    my_rollout = rollout_workers[rank % len(rollout_workers)]

    loader = train_shard(env, cfg.batch_size_per_worker, cfg.seed, RowsCollate())
    policy, optimizer, scheduler, state = trainable(load_model(cfg.model), cfg, env)
    reference = load_model(cfg.model, device=device).eval().requires_grad_(False) if cfg.kl_coef > 0 else None
    if state.step > 0:  # restarted from a checkpoint: the actors may hold other weights
        sync_weights(policy, rollout_workers, rank, device)
    meta = CheckpointMeta(base_model=cfg.model, format="consolidated")
    sampling = {"n": cfg.group_size, "max_tokens": cfg.max_new_tokens, "temperature": cfg.temperature, "top_p": cfg.top_p}
    eval_rows = read_eval_rows(cfg.eval_data, cfg.eval_limit) if cfg.eval_data and logger else None
    if eval_rows and state.step == 0:
        logger.log_metrics({"eval/exact_match_before": held_out_exact_match(my_rollout, eval_rows, cfg.max_new_tokens)}, step=0)
    window, max_logprob_diff = MetricWindow(device, maxima=("rollout/logprob_diff_max", "run/logprob_diff_max")), 0.0

    while state.step < cfg.max_steps:
        rows = loader.next()
        start = time.perf_counter()
        samples = ray.get(my_rollout.generate.remote([prompt_messages(r) for r in rows], {**sampling, "seed": cfg.seed + 1000 * state.step + rank}))
        rollout_s = time.perf_counter() - start

        start = time.perf_counter()
        group_rows = [row for row in rows for _ in range(cfg.group_size)]
        rewards = torch.tensor(reward_fn(samples, group_rows), dtype=torch.float32)
        advantages = group_advantages(rewards, cfg.group_size, scale=cfg.scale_rewards)
        reward_s = time.perf_counter() - start

        start = time.perf_counter()
        batch = {k: v.to(device) for k, v in rollout_batch(samples, advantages, tokenizer.pad_token_id).items()}
        mask = batch["labels"][:, 1:] != IGNORE_INDEX
        with torch.no_grad():
            old_logprobs, logits = policy_logprobs(policy, batch)
            ref_logprobs = token_logprobs(reference(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits, batch["labels"])[0] if reference else None
            step_entropy = entropy(logits, mask)
        # The trainer and the rollout engine must agree on the sampled tokens' log-probs: stale weights would not.
        logprob_diff = ((old_logprobs - batch["engine_logprobs"]).abs() * mask).max().item()
        max_logprob_diff = max(max_logprob_diff, logprob_diff)
        stats = {"clip_fraction": 0.0, "kl": 0.0}
        rows_per_mini_batch = len(samples) // cfg.num_mini_batches
        for _ in range(cfg.ppo_epochs):
            for mb in torch.arange(len(samples)).split(rows_per_mini_batch):
                # Token-level mean over every rank's mini-batch: DDP averages gradients over ranks.
                global_tokens = collectives.reduce_value(mask[mb].sum().item(), device)
                logprobs, _ = policy_logprobs(policy, {k: v[mb] for k, v in batch.items()})
                loss, mb_stats = grpo_loss(
                    logprobs, old_logprobs[mb], batch["advantages"][mb], mask[mb], cfg.clip_ratio,
                    ref_logprobs[mb] if reference is not None else None, cfg.kl_coef, num_tokens=max(1.0, global_tokens) / world_size,
                )  # fmt: skip
                loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(policy.parameters(), cfg.optim.grad_clip)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
                stats = {k: stats.get(k, 0.0) + v / (cfg.ppo_epochs * cfg.num_mini_batches) for k, v in mb_stats.items()}
        scheduler.step()
        train_s = time.perf_counter() - start

        start = time.perf_counter()
        sync_weights(policy, rollout_workers, rank, device)
        sync_s = time.perf_counter() - start

        state.step += 1
        state.data = loader.position.model_copy()
        completion_tokens = sum(len(s.completion_ids) for s in samples)
        window.add({
            "reward/mean": rewards.mean().item(), "reward/std": rewards.std().item(), "entropy": step_entropy,
            "response_length": completion_tokens / len(samples), "grad_norm": float(grad_norm), "loss": loss.item(),
            "rollout/tokens_per_s": completion_tokens / rollout_s, "rollout/logprob_diff_max": logprob_diff, "run/logprob_diff_max": max_logprob_diff,
            "time/rollout_s": rollout_s, "time/reward_s": reward_s, "time/train_s": train_s, "time/sync_s": sync_s, **stats,
        })  # fmt: skip

        last = state.step == cfg.max_steps
        if state.step % cfg.log_every == 0 or last:
            metrics = {**window.pop(), "lr": scheduler.get_last_lr()[0]}
            metrics["rollout/tokens_per_s"] *= world_size  # every rank's rollouts together
            if last and eval_rows:
                metrics["eval/exact_match"] = held_out_exact_match(my_rollout, eval_rows, cfg.max_new_tokens)
            if logger:
                logger.log_metrics(metrics, step=state.step)
                export_metrics(metrics, env.run_id)
            if state.step % cfg.checkpoint_every == 0 or last:
                save(env, metrics, policy, optimizer, scheduler, state, meta, tokenizer)


def export_metrics(metrics: dict[str, float], run_id: str) -> None:
    """Rank 0's log window as Prometheus metrics (mlplat.observability.catalogue)."""
    job = {"recipe": "grpo", "run_id": run_id}
    for metric, key in ((oc.RL_REWARD_MEAN, "reward/mean"), (oc.RL_REWARD_STD, "reward/std"), (oc.RL_KL, "kl"),
                        (oc.RL_ROLLOUT_TOKENS_PER_S, "rollout/tokens_per_s"), (oc.RL_RESPONSE_LENGTH, "response_length"),
                        (oc.TRAIN_LOSS, "loss"), (oc.TRAIN_LR, "lr"), (oc.TRAIN_GRAD_NORM, "grad_norm")):  # fmt: skip
        if key in metrics:
            metric.set(metrics[key], **job)
    for phase in ("rollout", "reward", "train", "sync"):
        oc.TRAIN_STEP_PHASE_SECONDS.set(metrics[f"time/{phase}_s"], phase=phase, rank="0", **job)


def sync_weights(policy, rollout_workers: list, rank: int, device: torch.device) -> None:
    """Push the policy's full weights into every rollout actor in place; all ranks wait for it.

    One ``ray.put`` of the CPU state dict, read by every actor through the object store (a
    collective broadcast replaces it where the actors hold GPUs in the trainers' group)."""
    state = full_state_dict(policy)  # a gather under FSDP: every rank takes part
    if rank == 0:
        ref = ray.put({name: tensor.detach().cpu() for name, tensor in state.items()})
        ray.get([worker.update_weights.remote(ref) for worker in rollout_workers])
    collectives.barrier(device)  # no rank samples from the old weights


def held_out_exact_match(rollout_worker, rows: list[dict], max_new_tokens: int) -> float:
    """Greedy exact match through a rollout actor (its weights are the policy's after each sync)."""
    samples = ray.get(rollout_worker.generate.remote([r["messages"] for r in rows], {"n": 1, "max_tokens": max_new_tokens, "temperature": 0}))
    return sum(extract_answer(s.text) == str(r["answer"]) for s, r in zip(samples, rows)) / len(rows)


def run_grpo(cfg: GRPOConfig, tracking_uri: str | None = None, work_dir: str | Path = "outputs") -> GRPOResult:
    """Run the recipe on the connected Ray cluster (a local one is started if needed)."""
    run = RecipeRun("grpo", cfg, tracking_uri, work_dir)
    rollout_workers, scorer = [], None
    try:
        with run.tracked():
            dataset, data_report = prepare_rl_prompt_dataset(cfg.data, rejects_dir=run.work_dir / run.run_id)
            run.log_data_report(data_report)
            rollout_workers = start_rollout_workers(str(run.model_dir), cfg.rollout)
            if cfg.reward.kind == "reward_model":
                rm_dir = resolve_model(cfg.reward.reward_model, download_dir=run.work_dir / "downloads", tracking_uri=run.tracking_uri)
                scorer = start_reward_model(cfg.reward, str(rm_dir))
            result = run.fit(grpo_loop, {"train": dataset}, extra={"rollout_workers": rollout_workers, "reward_scorer": scorer})
            final_dir, version = run.finish(result)
    finally:
        for actor in [*rollout_workers, *([scorer] if scorer else [])]:
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
