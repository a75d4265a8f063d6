"""The inner loop every recipe shares, on any ``WorkerEnv`` (Ray Train's or plain ``torch.distributed``):
its config fields, set-up (seed, threads, data shard, parallelized model restored from a checkpoint),
the bookkeeping after each optimizer step, the metric window, checkpoints and, for recipes with a fixed
objective (reward model, DPO), the whole loop (``run_steps``). Nothing here needs a Ray cluster or MLflow.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
from pydantic import Field

from mlplat.config import Config
from mlplat.data.ingest import DataConfig
from mlplat.data.loader import ShardLoader
from mlplat.train import collectives
from mlplat.train.checkpoint import CheckpointFormat, CheckpointMeta, TrainState, load_checkpoint, read_train_state, save_checkpoint
from mlplat.train.logprobs import TokenLogprobHead, install_logprob_head
from mlplat.train.lora import LoRAConfig, apply_lora
from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
from mlplat.train.parallel import ParallelConfig, parallelize, unwrap
from mlplat.train.step import Objective, StepStats, train_step
from mlplat.train.worker import WorkerEnv, checkpoint_directory


class RecipeConfig(Config):
    model: str  # local HF checkpoint directory or models:/NAME/VERSION|@ALIAS (a local directory by the time the loop runs)
    data: DataConfig  # each recipe narrows it to its task's rows
    optim: OptimizerConfig = OptimizerConfig()
    parallel: ParallelConfig = ParallelConfig()
    max_steps: int = Field(default=200, gt=0)
    batch_size_per_worker: int = Field(default=16, gt=0)  # rows per micro-batch
    grad_accum_steps: int = Field(default=1, gt=0)  # micro-batches per optimizer step
    num_workers: int = Field(default=2, gt=0)
    use_gpu: bool = False
    bf16: bool = True  # autocast to bf16 on GPU; CPU trains in fp32
    log_every: int = Field(default=10, gt=0)
    checkpoint_every: int = Field(default=100, gt=0)
    checkpoint_format: CheckpointFormat = "sharded"  # DCP shards per rank; "consolidated": rank 0 gathers the full state
    checkpoint_hf: bool = False  # also export a servable HF model into every checkpoint (always into the last)
    lora: LoRAConfig | None = None  # train LoRA adapters instead of all weights (the reference is the base: adapters off); exported merged
    num_checkpoints_to_keep: int | None = 2
    checkpoint_score_metric: str | None = None  # e.g. "loss": keep the best by it instead of the latest
    checkpoint_score_order: Literal["min", "max"] = "min"
    resume_from: str | None = None  # a checkpoint directory of an earlier run to continue from (weights, optimizer, data position)
    deterministic_data: bool = True  # same batches in the same order on every run: exact resume (see mlplat.data.loader)
    max_bad_steps_in_row: int = Field(default=5, gt=0)  # non-finite loss/grad norm: skip the step; abort after this many in a row
    max_failures: int = Field(default=0, ge=-1)  # restarts from the last checkpoint after a worker dies (-1: unlimited)
    seed: int = 0
    storage_path: str = "outputs/ray_train"
    experiment: str = "mlplat-posttrain"
    run_name: str | None = None
    registered_model: str | None = None  # None: log the model but do not register it
    registered_alias: str | None = "candidate"


def worker_setup(cfg: RecipeConfig) -> None:
    """Seed, and CPU threads as the launcher allotted them (Ray gives each worker one CPU)."""
    torch.manual_seed(cfg.seed)
    if not cfg.use_gpu:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))


def train_shard(env: WorkerEnv, batch_size: int, seed: int, collate_fn: Callable | None) -> ShardLoader:
    """This worker's shard of the "train" dataset, streaming from now on, at the restored checkpoint's data
    position (from the start without one). Made before the model, so the pipeline starts while the model loads."""
    position = read_train_state(env.restore_from).data if env.restore_from else None
    return ShardLoader(env.dataset_shard("train"), batch_size, collate_fn, seed, position=position)


def trainable(model: torch.nn.Module, cfg: RecipeConfig, env: WorkerEnv):
    """(model, optimizer, scheduler, state): parallelized, and restored from ``env.restore_from`` if there is one.

    A causal LM gets the chunked log-prob head (``mlplat.train.logprobs``): its objectives never build
    full-vocabulary logits for the batch."""
    if _is_causal_lm(model):
        if cfg.lora is not None:
            model = apply_lora(model, cfg.lora)
        install_logprob_head(model)
    model = parallelize(model, cfg.parallel, env.device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, cfg.max_steps)
    state = TrainState()
    if env.restore_from:
        with checkpoint_directory(env.restore_from) as directory:
            state = load_checkpoint(directory, model, optimizer, scheduler)
    return model, optimizer, scheduler, state


def _is_causal_lm(model: torch.nn.Module) -> bool:
    return isinstance(getattr(model, "get_output_embeddings", lambda: None)(), torch.nn.Linear | TokenLogprobHead)


def frozen_reference(cfg: RecipeConfig, env: WorkerEnv, policy: torch.nn.Module) -> torch.nn.Module:
    """The reference policy for a KL term or DPO: with LoRA, the policy itself with its adapters disabled
    (the base model, no second copy); otherwise the checkpoint frozen, sharded like the policy under
    FSDP2 (each rank holds 1/world of it), with the chunked log-prob head."""
    if cfg.lora is not None:
        return AdaptersDisabled(policy)
    from mlplat.models import load_model

    reference = install_logprob_head(load_model(cfg.model)).eval().requires_grad_(False)
    if cfg.parallel.strategy == "fsdp":
        return parallelize(reference, cfg.parallel.model_copy(update={"activation_checkpointing": False}), env.device)
    return reference.to(env.device)  # DDP: a frozen model needs no wrapper, only a replica


class AdaptersDisabled:
    """A LoRA policy seen with its adapters off: the base model's outputs from the same weights."""

    def __init__(self, policy: torch.nn.Module):
        self.policy = policy

    def __call__(self, *args, **kwargs):
        with unwrap(self.policy).disable_adapter():
            return self.policy(*args, **kwargs)

    def get_output_embeddings(self) -> torch.nn.Module:
        return unwrap(self.policy).get_output_embeddings()


def checkpoint_meta(cfg: RecipeConfig) -> CheckpointMeta:
    return CheckpointMeta(base_model=cfg.model, lora=cfg.lora.model_dump() if cfg.lora else None, format=cfg.checkpoint_format)


def save(env: WorkerEnv, metrics: dict, model, optimizer, scheduler, state: TrainState, meta: CheckpointMeta, tokenizer, export_hf: bool = True) -> None:
    """Every rank writes its part of the checkpoint at ``state.step`` (with the servable HF export unless
    ``export_hf=False``) and hands it to the env with the metrics.

    Under Ray Train, recipes report only with a checkpoint: metrics already reach MLflow and
    Prometheus from the loop, and a report blocks the step until Ray Train's controller polls the
    workers (every 2 s by default), a stall in every log window."""
    write = partial(save_checkpoint, model=model, optimizer=optimizer, scheduler=scheduler, state=state, meta=meta, tokenizer=tokenizer, export_hf=export_hf)
    env.save_checkpoint({**metrics, "step": state.step}, write)


def record_step(state: TrainState, stats: StepStats, max_bad_steps_in_row: int) -> None:
    """The bookkeeping after every optimizer step: the step count and the non-finite guard (a skipped
    step is counted; too many in a row abort the run with what to change)."""
    state.step += 1
    state.bad_steps_in_row = state.bad_steps_in_row + 1 if stats.skipped else 0
    state.skipped_steps += stats.skipped
    if state.bad_steps_in_row >= max_bad_steps_in_row:
        raise FloatingPointError(
            f"step {state.step}: loss or gradient norm was not finite for {state.bad_steps_in_row} steps in a row "
            f"(last loss {stats.loss}, grad norm {stats.grad_norm}); lower optim.lr, check the data, or raise max_bad_steps_in_row"
        )


def crossed(before: int, after: int, every: int) -> bool:
    """Optimizer steps ``before`` -> ``after`` (one rollout's, say) reached a multiple of ``every``."""
    return after // every > before // every


def next_micro_batches(loader: ShardLoader, cfg: RecipeConfig, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """The next optimizer step's ``grad_accum_steps`` micro-batches of this worker's shard, on ``device``."""
    return [{k: v.to(device) for k, v in loader.next().items()} for _ in range(cfg.grad_accum_steps)]


def run_steps(
    cfg: RecipeConfig,
    env: WorkerEnv,
    loader: ShardLoader,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainState,
    objective: Objective,
    tokenizer,
    final_metrics: Callable[[], dict[str, float]] | None = None,
) -> None:
    """The optimizer loop a recipe with a fixed objective runs from ``state.step`` to ``max_steps``:
    micro-batched steps (``grad_accum_steps``) with the exact mean over the global batch, bf16 autocast on
    GPU, the non-finite guard, a metric window logged every ``log_every`` steps (with ``final_metrics()``
    added on the last; every rank calls it) and a checkpoint every ``checkpoint_every`` steps and on the
    last, whatever the log cadence."""
    window, metrics, meta = MetricWindow(env.device), {}, checkpoint_meta(cfg)
    while state.step < cfg.max_steps:
        micro_batches = next_micro_batches(loader, cfg, env.device)
        stats = train_step(model, micro_batches, optimizer, scheduler, cfg.optim.grad_clip, cfg.use_gpu and cfg.bf16, objective=objective)
        state.data = loader.position.model_copy()
        record_step(state, stats, cfg.max_bad_steps_in_row)
        if not stats.skipped:
            window.add({"loss": stats.loss, "grad_norm": stats.grad_norm, **stats.metrics})
        last = state.step == cfg.max_steps
        if state.step % cfg.log_every == 0 or last:
            metrics = {**window.pop(), "lr": scheduler.get_last_lr()[0], "skipped_steps": state.skipped_steps}
            if last and final_metrics:
                metrics.update(final_metrics())
            if env.logger:
                env.logger.log_metrics(metrics, step=state.step)
        if state.step % cfg.checkpoint_every == 0 or last:
            save(env, metrics, model, optimizer, scheduler, state, meta, tokenizer, export_hf=cfg.checkpoint_hf or last)


class MetricWindow:
    """Per-step statistics between two log lines, reduced over the ranks once per window on the training device.

    Keys in ``maxima`` keep their largest value (over the window's steps, then the ranks); the others their mean."""

    def __init__(self, device: torch.device, maxima: tuple[str, ...] = ()):
        self.device, self.maxima = device, frozenset(maxima)
        self.values: dict[str, float] = {}
        self.steps = 0

    def add(self, stats: dict[str, float]) -> None:
        self.steps += 1
        for key, value in stats.items():
            previous = self.values.get(key)
            if previous is None:
                self.values[key] = value
            else:
                self.values[key] = max(previous, value) if key in self.maxima else previous + value

    def pop(self) -> dict[str, float]:
        """This window over every rank; starts a new window. Every rank must call it (one all-gather)."""
        keys = sorted(self.values)
        local = [self.values[k] if k in self.maxima else self.values[k] / max(1, self.steps) for k in keys]
        ranks = torch.stack(collectives.all_gather(torch.tensor(local, dtype=torch.float64), self.device)).cpu()  # one copy back
        self.values, self.steps = {}, 0
        return {k: float(ranks[:, i].max() if k in self.maxima else ranks[:, i].mean()) for i, k in enumerate(keys)}
