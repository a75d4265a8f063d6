"""The inner loop every recipe shares, on any ``WorkerEnv`` (Ray Train's or plain ``torch.distributed``):
its config fields, set-up (seed, threads, data shard, parallelized model restored from a checkpoint),
the bookkeeping after each optimizer step, the metric window, checkpoints and, for recipes with a fixed
objective (reward model, DPO), the whole loop (``run_steps``). Nothing here needs a Ray cluster or MLflow.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from functools import partial
from typing import Literal

import torch
from pydantic import Field, model_validator

from mlplat import collectives
from mlplat.config import Config
from mlplat.data.ingest import DataConfig
from mlplat.data.loader import ShardLoader
from mlplat.observability import catalogue
from mlplat.observability.profiling import ProfileConfig, StepProfiler, step_time_summary
from mlplat.observability.progress import ProgressReporter
from mlplat.train.checkpoint import CheckpointFormat, CheckpointMeta, TrainState, load_checkpoint, read_train_state, save_checkpoint
from mlplat.train.health import FaultInjection, RankHealth, TrainingHealthConfig
from mlplat.train.logprobs import TokenLogprobHead, install_logprob_head
from mlplat.train.lora import LoRAConfig, apply_lora
from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
from mlplat.train.parallel import ParallelConfig, parallelize, unwrap
from mlplat.train.perf import PhaseTimer, flops_per_token, peak_flops
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
    health: TrainingHealthConfig = TrainingHealthConfig()  # straggler and hang detection; accepted nodes only (mlplat.health)
    debug: FaultInjection = FaultInjection()  # test hooks: a slow or a hung rank, to exercise the detectors
    profile: ProfileConfig | None = None  # torch profiler trace of a few steps on rank 0 -> MLflow (mlplat.observability)
    peak_tflops: float | None = None  # per device, for MFU; default: the GPU's datasheet figure, measured once on CPU
    seed: int = 0
    storage_path: str = "outputs/ray_train"
    experiment: str = "mlplat-posttrain"
    run_name: str | None = None
    registered_model: str | None = None  # None: log the model but do not register it
    registered_alias: str | None = "candidate"

    @model_validator(mode="after")
    def _profile_fits(self):
        if self.profile and self.max_steps < (needed := self.profile.wait_steps + 1 + self.profile.steps):
            # the trace is written once the profiler's schedule completes
            raise ValueError(f"profile: wait_steps + 1 warm-up + steps = {needed} steps, more than max_steps={self.max_steps}: raise max_steps or lower profile.steps")
        return self


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
    recipe: str,
    final_metrics: Callable[[], dict[str, float]] | None = None,
) -> None:
    """The optimizer loop of a recipe with a fixed objective (SFT, reward model, DPO), from ``state.step``
    to ``max_steps``: micro-batched steps (``grad_accum_steps``) with the exact mean over the global
    batch, bf16 autocast on GPU, the non-finite guard, straggler and hang checks (``health``), an
    optional profiler trace, a metric window logged every ``log_every`` steps to MLflow and Prometheus
    (with ``final_metrics()`` added on the last; every rank calls it), and a checkpoint every
    ``checkpoint_every`` steps and on the last, whatever the log cadence."""
    health = RankHealth(cfg.health, cfg.debug, env, recipe)
    try:
        _run_steps(cfg, env, loader, model, optimizer, scheduler, state, objective, tokenizer, recipe, final_metrics, health)
    finally:
        health.close()


def _run_steps(cfg, env, loader, model, optimizer, scheduler, state, objective, tokenizer, recipe, final_metrics, health) -> None:
    device, logger, meta = env.device, env.logger, checkpoint_meta(cfg)
    if env.restore_from and logger:
        logger.log_metrics({"restored_from_step": state.step}, step=state.step)
    timer = PhaseTimer(device)
    flops = flops_per_token(unwrap(model), getattr(cfg.data, "max_seq_len", 1024)) if _is_causal_lm(unwrap(model)) else None
    peak = peak_flops(device, cfg.peak_tflops) if flops and (cfg.peak_tflops or device.type == "cuda") else None
    window = StepWindow(collectives.world_size(), flops, peak)
    gauges = TrainGauges(recipe, env.run_id, collectives.rank())
    profiler = StepProfiler(cfg.profile, device, logger) if cfg.profile and logger else None
    progress = ProgressReporter(recipe, cfg.max_steps) if collectives.rank() == 0 else None
    metrics: dict[str, float] = {}
    while state.step < cfg.max_steps:
        step_start = time.perf_counter()
        with timer.phase("data_wait"):
            health.inject_faults(state.step + 1)
            micro_batches = next_micro_batches(loader, cfg, device)
        stats = train_step(model, micro_batches, optimizer, scheduler, cfg.optim.grad_clip, cfg.use_gpu and cfg.bf16, timer, objective)
        state.data = loader.position.model_copy()
        record_step(state, stats, cfg.max_bad_steps_in_row)
        if progress:
            progress.update(state.step, loss=stats.loss)
        window.add(stats, time.perf_counter() - step_start, timer.reset())
        if profiler:
            profiler.step()
        if state.step == 1:
            window.time_to_first_step_s = time.time() - env.start_time
        last = state.step == cfg.max_steps
        if state.step % cfg.log_every == 0 or last:
            metrics = {"lr": scheduler.get_last_lr()[0], "skipped_steps": state.skipped_steps, "epoch": state.data.epoch, **window.metrics()}
            metrics |= health.end_window(metrics)  # per-rank local step times compared; may stop a job with a straggler
            if last and final_metrics:
                metrics |= final_metrics()
            if logger:
                logger.log_metrics(metrics | (step_time_summary(window.total_phase_s, window.total_step_s) if last else {}), step=state.step)
            gauges.set(metrics, window.steps, window.skipped)
            window = window.next()
        if state.step % cfg.checkpoint_every == 0 or last:
            save(env, metrics, model, optimizer, scheduler, state, meta, tokenizer, export_hf=cfg.checkpoint_hf or last)
        health.step_done()
    if profiler:
        profiler.close()


class StepWindow:
    """A log window's figures from each step's global statistics and this rank's timings, plus whole-run totals.

    The loss and the objective's statistics are means per unit over the window's global batches; times
    are this rank's (the health checks compare them across ranks)."""

    PHASES = ("data_wait", "forward", "backward", "optimizer", "comm")

    def __init__(self, world_size: int, flops_per_token: float | None, peak_flops: float | None):
        self.world_size, self.flops_per_token, self.peak_flops = world_size, flops_per_token, peak_flops
        self.total_wait_s = self.total_step_s = 0.0
        self.total_tokens = 0
        self.total_phase_s = dict.fromkeys(self.PHASES, 0.0)  # whole run, for the step-time summary
        self.time_to_first_step_s: float | None = None
        self._reset()

    def _reset(self) -> None:
        self.steps = self.units = self.tokens = self.slots = self.skipped = 0
        self.loss_sum = self.grad_norm_sum = self.step_s = 0.0
        self.stat_sums: dict[str, float] = {}
        self.phase_s = dict.fromkeys(self.PHASES, 0.0)

    def next(self) -> StepWindow:
        self._reset()
        return self

    def add(self, stats: StepStats, step_s: float, phase_s: dict[str, float]) -> None:
        self.steps += 1
        self.skipped += int(stats.skipped)
        if not stats.skipped:
            self.loss_sum += stats.loss * stats.units
            self.units += stats.units
            self.grad_norm_sum += stats.grad_norm
            for name, mean in stats.metrics.items():
                self.stat_sums[name] = self.stat_sums.get(name, 0.0) + mean * stats.units
        self.tokens += stats.tokens
        self.slots += stats.slots
        self.total_tokens += stats.tokens
        self.step_s += step_s
        for name, seconds in phase_s.items():
            self.phase_s[name] += seconds
            self.total_phase_s[name] = self.total_phase_s.get(name, 0.0) + seconds
        self.total_wait_s += phase_s.get("data_wait", 0.0)
        self.total_step_s += step_s

    def metrics(self) -> dict[str, float]:
        tokens_per_s = self.tokens / self.step_s
        per_worker = tokens_per_s / self.world_size
        applied = max(1, self.steps - self.skipped)
        metrics = {
            "loss": self.loss_sum / max(1, self.units),
            **{name: total / max(1, self.units) for name, total in self.stat_sums.items()},
            "grad_norm": self.grad_norm_sum / applied,
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_worker": per_worker,
            "time/step_s": self.step_s / self.steps,
            **{f"time/{name}_s": seconds / self.steps for name, seconds in self.phase_s.items()},
            "data_wait_fraction": self.phase_s["data_wait"] / self.step_s,
            "data/packing_efficiency": self.tokens / max(1, self.slots),  # non-pad / all token positions
            "data/tokens": self.total_tokens,  # produced by the pipeline and trained on, all ranks
            "run/data_wait_s": self.total_wait_s,
            "run/step_s": self.total_step_s,
        }
        if self.flops_per_token and self.peak_flops:
            metrics["mfu"] = per_worker * self.flops_per_token / self.peak_flops
        if self.time_to_first_step_s is not None:
            metrics["time_to_first_step_s"] = self.time_to_first_step_s
        return metrics


class TrainGauges:
    """The log window's figures as Prometheus metrics (mlplat.observability.catalogue); rank 0 reports the job's."""

    def __init__(self, recipe: str, run_id: str, rank: int):
        self.job = {"recipe": recipe, "run_id": run_id}
        self.rank = {**self.job, "rank": str(rank)}
        self.is_rank0 = rank == 0

    def set(self, metrics: dict[str, float], steps: int, skipped: int) -> None:
        m = catalogue
        m.TRAIN_STEP_SECONDS.set(metrics["time/step_s"], **self.rank)
        m.TRAIN_DATA_WAIT_FRACTION.set(metrics["data_wait_fraction"], **self.rank)
        for name in StepWindow.PHASES:
            m.TRAIN_STEP_PHASE_SECONDS.set(metrics[f"time/{name}_s"], phase=name, **self.rank)
        if not self.is_rank0:
            return
        m.TRAIN_LOSS.set(metrics["loss"], **self.job)
        m.TRAIN_GRAD_NORM.set(metrics["grad_norm"], **self.job)
        m.TRAIN_LR.set(metrics["lr"], **self.job)
        m.TRAIN_TOKENS_PER_S.set(metrics["tokens_per_s"], **self.job)
        if "mfu" in metrics:
            m.TRAIN_MFU.set(metrics["mfu"], **self.job)
        m.TRAIN_STEPS.inc(steps, **self.job)
        m.TRAIN_SKIPPED_STEPS.inc(skipped, **self.job)


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
