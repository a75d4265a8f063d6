"""What every post-training recipe (reward model, DPO, GRPO) shares: its config fields, the
MLflow run around the Ray Train job, the job itself, and the final model's registration.

A recipe in ``train_apps/`` supplies its loop per worker and its datasets; this module
does the plumbing the same way for all of them, so they read like their algorithm box.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import ray
import ray.train
import torch
from pydantic import Field
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from mlplat.config import Config, to_flat_params
from mlplat.data.ingest import DataConfig, DataReport, check_sources
from mlplat.data.loader import ShardLoader, deterministic_data_config
from mlplat.errors import ConfigError
from mlplat.runtime import init_ray
from mlplat.tracking import ModelRef, RunLogger, register_model_dir, resolve_model, start_run
from mlplat.tracking.runs import default_tracking_uri
from mlplat.train import collectives
from mlplat.train.checkpoint import MODEL_DIR, TrainState, load_checkpoint, read_train_state, save_checkpoint
from mlplat.train.data_workers import warm_data_workers
from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
from mlplat.train.parallel import ParallelConfig, parallelize
from mlplat.train.step import Objective, StepStats, train_step


def fit_and_release(trainer: TorchTrainer) -> ray.train.Result:
    """``trainer.fit()``, then let go of the finished run's controller.

    Ray Train's ``fit`` installs a SIGINT handler that holds the controller actor's handle, so the
    run's controller, dataset manager and split coordinator (a process each) outlive it until the
    next ``fit`` or the end of the process; in a pipeline step that is an idle Ray worker, kept for
    minutes. Restoring the previous handler drops the handle and Ray reclaims them."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if in_main_thread else None
    try:
        return trainer.fit()
    finally:
        if previous is not None:  # None: a handler not set from Python, which Python cannot put back
            signal.signal(signal.SIGINT, previous)


class RecipeConfig(Config):
    model: str  # local HF checkpoint directory or models:/NAME/VERSION|@ALIAS
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
    num_checkpoints_to_keep: int | None = 2
    max_bad_steps_in_row: int = Field(default=5, gt=0)  # non-finite loss/grad norm: skip the step; abort after this many in a row
    max_failures: int = Field(default=0, ge=-1)  # restarts from the last checkpoint after a worker dies (-1: unlimited)
    seed: int = 0
    storage_path: str = "outputs/ray_train"
    experiment: str = "mlplat-posttrain"
    run_name: str | None = None
    registered_model: str | None = None  # None: log the model but do not register it
    registered_alias: str | None = "candidate"


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


class RecipeRun:
    """One recipe run: its MLflow run (parent of every metric), resolved model and Ray Train job."""

    def __init__(self, recipe: str, cfg: RecipeConfig, tracking_uri: str | None, work_dir: str | Path):
        self.recipe, self.cfg = recipe, cfg
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.work_dir = Path(work_dir)
        eval_data = getattr(cfg, "eval_data", None)
        if eval_data and "://" not in eval_data and not Path(eval_data).is_file():
            raise ConfigError(f"eval_data: {eval_data} is not a file: give a held-out JSONL path, or leave eval_data unset")
        check_sources(cfg.data)  # before a cluster or an MLflow run is started
        self.model_dir = resolve_model(cfg.model, download_dir=self.work_dir / "downloads", tracking_uri=self.tracking_uri)
        init_ray(num_training_workers=cfg.num_workers)
        tags = {"mlplat.recipe": recipe, "mlplat.base_model": cfg.model}
        if commit := git_commit():
            tags["mlflow.source.git.commit"] = commit
        self.run_id = start_run(cfg.experiment, cfg.run_name, params=to_flat_params(cfg), tags=tags, tracking_uri=self.tracking_uri)
        self.logger = RunLogger(self.run_id, self.tracking_uri)

    @contextmanager
    def tracked(self):
        """The body of a run: its MLflow run ends FINISHED, or FAILED if the body raises."""
        try:
            yield self
        except BaseException:
            self.logger.end("FAILED")
            raise
        self.logger.end()

    def log_data_report(self, report: DataReport) -> None:
        self.logger.set_tags({"mlplat.data.fingerprint": report.fingerprint})
        self.logger.log_metrics({"data.rows_read": report.rows_read, "data.bad_rows": report.bad_rows})

    def loop_config(self, **extra) -> dict:
        """What every worker gets: the recipe config, where to log, and the resolved model."""
        return {
            "cfg": self.cfg.model_dump(mode="json"),
            "run_id": self.run_id,
            "tracking_uri": self.tracking_uri,
            "model_dir": str(self.model_dir),
            **extra,
        }

    def fit(self, train_loop: Callable[[dict], None], loop_config: dict, datasets: dict) -> ray.train.Result:
        cfg = self.cfg
        storage = str(Path(cfg.storage_path).resolve()) if "://" not in cfg.storage_path else cfg.storage_path
        trainer = TorchTrainer(
            train_loop,
            train_loop_config=loop_config,
            scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu),
            datasets=datasets,
            dataset_config=deterministic_data_config(),
            run_config=RunConfig(
                name=f"{self.recipe}-{self.run_id}",
                storage_path=storage,
                failure_config=FailureConfig(max_failures=cfg.max_failures),
                checkpoint_config=CheckpointConfig(num_to_keep=cfg.num_checkpoints_to_keep),
            ),
        )
        warm_data_workers(cfg.num_workers)  # the pipeline's first task processes start beside the trainer's
        return fit_and_release(trainer)

    def finish(self, result: ray.train.Result) -> tuple[Path, ModelRef | None]:
        """Copy the final HF model out of the last checkpoint; register it (or log it) in MLflow."""
        final_dir = self.work_dir / self.run_id / "final"
        with result.checkpoint.as_directory() as ckpt:
            shutil.copytree(Path(ckpt) / MODEL_DIR, final_dir, dirs_exist_ok=True)
        self.logger.set_tags({"mlplat.checkpoint.latest": result.checkpoint.path})
        version = None
        if self.cfg.registered_model:
            version = register_model_dir(self.run_id, final_dir, self.cfg.registered_model, self.cfg.registered_alias, self.tracking_uri)
        else:
            self.logger.log_artifacts(final_dir, "model")
        return final_dir, version


def save_and_report(metrics: dict, checkpoint: tuple, export_hf: bool = True) -> None:
    """Every rank writes its part of a checkpoint, ``(model, optimizer, scheduler, state, meta, tokenizer)``
    (with the servable HF export unless ``export_hf=False``), and reports it to Ray Train with the metrics.

    Recipes report to Ray Train only with a checkpoint: metrics already reach MLflow and
    Prometheus from the loop, and a report blocks the step until Ray Train's controller polls
    the workers (every 2 s by default), a stall in every log window.
    """
    model, optimizer, scheduler, state, meta, tokenizer = checkpoint
    with tempfile.TemporaryDirectory() as tmp:
        save_checkpoint(Path(tmp), model, optimizer, scheduler, state, meta, tokenizer, export_hf=export_hf)
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp) if any(Path(tmp).iterdir()) else None)


def trainable(model: torch.nn.Module, cfg: RecipeConfig, device: torch.device):
    """(model, optimizer, scheduler, state): parallelized, and restored from this run's last checkpoint after a restart."""
    model = parallelize(model, cfg.parallel, device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, cfg.max_steps)
    state = TrainState()
    if checkpoint := ray.train.get_checkpoint():
        with checkpoint.as_directory() as ckpt:
            state = load_checkpoint(Path(ckpt), model, optimizer, scheduler)
    return model, optimizer, scheduler, state


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


def run_steps(
    cfg: RecipeConfig,
    loader: ShardLoader,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainState,
    objective: Objective,
    checkpoint: tuple,
    logger: RunLogger | None,
    final_metrics: Callable[[], dict[str, float]] | None = None,
) -> None:
    """The optimizer loop a recipe with a fixed objective runs from ``state.step`` to ``max_steps``:
    micro-batched steps (``grad_accum_steps``) with the exact mean over the global batch, bf16 autocast on
    GPU, the non-finite guard, a metric window logged every ``log_every`` steps (with ``final_metrics()``
    added on the last) and a checkpoint every ``checkpoint_every`` steps and on the last, whatever the log
    cadence. ``checkpoint`` is ``(meta, tokenizer)`` for ``save_and_report``."""
    device = next(model.parameters()).device
    window, metrics = MetricWindow(device), {}
    while state.step < cfg.max_steps:
        micro_batches = next_micro_batches(loader, cfg, device)
        stats = train_step(model, micro_batches, optimizer, scheduler, cfg.optim.grad_clip, cfg.use_gpu and cfg.bf16, objective=objective)
        state.data = loader.position
        record_step(state, stats, cfg.max_bad_steps_in_row)
        if not stats.skipped:
            window.add({"loss": stats.loss, "grad_norm": stats.grad_norm, **stats.metrics})
        last = state.step == cfg.max_steps
        if state.step % cfg.log_every == 0 or last:
            metrics = {**window.pop(), "lr": scheduler.get_last_lr()[0], "skipped_steps": state.skipped_steps}
            if last and final_metrics:
                metrics.update(final_metrics())
            if logger:
                logger.log_metrics(metrics, step=state.step)
        if state.step % cfg.checkpoint_every == 0 or last:
            save_and_report({**metrics, "step": state.step}, (model, optimizer, scheduler, state, *checkpoint))


def next_micro_batches(loader: ShardLoader, cfg: RecipeConfig, device: torch.device) -> list[dict[str, torch.Tensor]]:
    """The next optimizer step's ``grad_accum_steps`` micro-batches of this worker's shard, on ``device``."""
    return [{k: v.to(device) for k, v in loader.next().items()} for _ in range(cfg.grad_accum_steps)]


def train_shard(batch_size: int, seed: int, collate_fn: Callable | None, checkpoint: Checkpoint | None) -> ShardLoader:
    """This worker's shard of the "train" dataset, streaming from now on, at ``checkpoint``'s data position
    (from the start without one). Made before the model, so the pipeline starts while the model loads."""
    position = read_train_state(checkpoint).data if checkpoint else None
    return ShardLoader(ray.train.get_dataset_shard("train"), batch_size, collate_fn, seed, position=position)


def worker_setup(cfg: RecipeConfig) -> torch.device:
    """Seed, CPU threads as Ray allotted them, and this worker's device."""
    torch.manual_seed(cfg.seed)
    if not cfg.use_gpu:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    return ray.train.torch.get_device()



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
