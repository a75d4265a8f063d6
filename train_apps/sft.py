"""Supervised fine-tuning (SFT) of a causal LM on Ray Train.

    input: an HF checkpoint (path or models:/ URI), chat JSONL/Parquet sources
    1. validate rows (bad ones to a rejects file, counted), mix sources, tokenize with
       the checkpoint's chat template, optionally pack; labels on assistant tokens  [Ray Data]
    2. on each of N workers (gloo on CPU, NCCL on GPU):                              [Ray Train]
         model <- HF checkpoint (+ LoRA adapters), activation checkpointing, DDP or FSDP2
         restore model, optimizer, scheduler, RNG and data position from the last checkpoint, if any
         for step in 1..max_steps:
             micro-batches <- next grad_accum_steps batches of this worker's shard
             loss <- sum of token cross-entropies / target tokens in the global batch
             skip the update if loss or gradient norm is not finite (abort after too many in a row)
             AdamW step (grad clip across shards), LR warmup + cosine
             every log_every: loss, lr, grad norm, tokens/s, MFU, time per phase -> MLflow (rank 0)
             every checkpoint_every: Ray Train checkpoint (sharded DCP or consolidated) + HF export
    3. register the final HF checkpoint (LoRA merged) as an MLflow model version, with an alias [MLflow]
    output: run id, model version, losses, data-wait fraction

Run: ``python -m train_apps.sft --config sft.yaml --set optim.lr=3e-4``.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from pathlib import Path
from typing import Literal

import ray
import ray.train
import torch
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from pydantic import BaseModel, Field, model_validator
from ray.train import Checkpoint, CheckpointConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from mlplat.config import to_flat_params
from mlplat.data.ingest import check_sources
from mlplat.data.loader import deterministic_data_config
from mlplat.data.sft import DataReport, SFTDataConfig, prepare_sft_dataset
from mlplat.errors import CheckpointError, ConfigError
from mlplat.health.marking import accepted_worker_resources
from mlplat.health.training import FaultInjection, RankHealth, TrainingHealthConfig
from mlplat.models import load_model, load_tokenizer
from mlplat.observability import catalogue as metrics_catalogue
from mlplat.observability.profiling import ProfileConfig, StepProfiler, step_time_summary
from mlplat.runtime import init_ray
from mlplat.tracking import ModelRef, RunLogger, register_model_dir, resolve_model, start_run
from mlplat.train.batch import PadCollate
from mlplat.train.checkpoint import MODEL_DIR, TRAIN_STATE, CheckpointFormat, CheckpointMeta, TrainState, load_checkpoint, read_train_state
from mlplat.train.data_workers import warm_data_workers
from mlplat.train.lora import LoRAConfig, apply_lora
from mlplat.train.optim import build_lr_scheduler, build_optimizer
from mlplat.train.parallel import parallelize, unwrap
from mlplat.train.perf import PhaseTimer, flops_per_token, measure_cpu_peak_flops, peak_flops
from mlplat.train.recipe import RecipeConfig, fit_and_release, git_commit, next_micro_batches, record_step, save_and_report, train_shard
from mlplat.train.step import StepStats, train_step


class SFTConfig(RecipeConfig):
    data: SFTDataConfig
    lora: LoRAConfig | None = None  # train LoRA adapters instead of all weights; exported merged
    max_steps: int = Field(default=500, gt=0)
    batch_size_per_worker: int = Field(default=32, gt=0)  # rows per micro-batch
    deterministic_data: bool = True  # same batches in the same order on every run: exact resume (see mlplat.data.loader)
    checkpoint_every: int = Field(default=250, gt=0)
    checkpoint_format: CheckpointFormat = "sharded"
    checkpoint_hf: bool = True  # also export a servable HF model into every checkpoint (always into the last)
    checkpoint_score_metric: str | None = None  # e.g. "loss": keep the best by it instead of the latest
    checkpoint_score_order: Literal["min", "max"] = "min"
    resume_from: str | None = None  # a checkpoint directory of an earlier run to continue from
    peak_tflops: float | None = None  # per device, for MFU; default: table of GPUs, measured on CPU
    experiment: str = "mlplat-sft"
    registered_model: str | None = "sft-model"  # None: log the model but do not register it
    health: TrainingHealthConfig = TrainingHealthConfig()  # straggler and hang detection; accepted nodes only (mlplat.health)
    debug: FaultInjection = FaultInjection()  # test hooks: a slow or a hung rank, to exercise the detectors
    profile: ProfileConfig | None = None  # torch profiler trace of a few steps on rank 0 -> MLflow (mlplat.observability)

    @model_validator(mode="after")
    def _checks(self):
        if self.parallel.strategy == "fsdp" and self.lora is not None:
            raise ValueError("lora with parallel.strategy=fsdp is not supported yet: use parallel.strategy=ddp for LoRA")
        if self.profile and self.max_steps < (needed := self.profile.wait_steps + 1 + self.profile.steps):
            # the trace is written once the profiler's schedule completes
            raise ValueError(f"profile: wait_steps + 1 warm-up + steps = {needed} steps, more than max_steps={self.max_steps}: raise max_steps or lower profile.steps")
        return self


class SFTResult(BaseModel):
    run_id: str
    model_dir: str  # local HF checkpoint of the final model
    model_version: ModelRef | None
    first_loss: float
    final_loss: float
    skipped_steps: int
    data_wait_fraction: float  # of rank 0's step time spent waiting for the next batch, whole run
    checkpoint_path: str  # the last Ray Train checkpoint
    data: DataReport


def train_loop_per_worker(config: dict) -> None:
    cfg = SFTConfig.model_validate(config["sft"])
    context = ray.train.get_context()
    rank, world_size = context.get_world_rank(), context.get_world_size()
    logger = RunLogger(config["run_id"], config["tracking_uri"]) if rank == 0 else None
    monitor = SystemMetricsMonitor(config["run_id"], tracking_uri=config["tracking_uri"]) if rank == 0 else None
    if monitor:
        monitor.start()  # MLflow's system/* metrics (CPU, memory, GPU) of rank 0's node
    health = RankHealth(cfg.health, cfg.debug, config["run_id"], config["tracking_uri"], ray.train.torch.get_device(), logger)
    try:
        _train(cfg, config, rank, world_size, logger, health)
    finally:
        health.close()
        if monitor:
            monitor.finish()


def _train(cfg: SFTConfig, config: dict, rank: int, world_size: int, logger: RunLogger | None, health: RankHealth) -> None:
    torch.manual_seed(cfg.seed)
    if not cfg.use_gpu:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    device = ray.train.torch.get_device()
    tokenizer = load_tokenizer(config["model_dir"])
    # A restart after a failure continues from this run's latest checkpoint; a new run from resume_from.
    checkpoint = ray.train.get_checkpoint() or (Checkpoint(cfg.resume_from) if cfg.resume_from else None)

    # The data stream starts first, at the checkpoint's data position: its start-up overlaps building the model.
    collate = None if cfg.data.pack else PadCollate(tokenizer.pad_token_id)  # packed rows are fixed-length
    loader = train_shard(cfg.batch_size_per_worker, cfg.seed, collate, checkpoint)
    model = load_model(config["model_dir"])
    if cfg.lora:
        model = apply_lora(model, cfg.lora)
    model = parallelize(model, cfg.parallel, device)
    optimizer = build_optimizer(model, cfg.optim)
    scheduler = build_lr_scheduler(optimizer, cfg.optim, cfg.max_steps)
    state = TrainState()
    if checkpoint:
        with checkpoint.as_directory() as ckpt:
            state = load_checkpoint(Path(ckpt), model, optimizer, scheduler)
        if logger:
            logger.log_metrics({"restored_from_step": state.step}, step=state.step)
    timer = PhaseTimer(device)
    meta = CheckpointMeta(base_model=config["model_dir"], lora=cfg.lora.model_dump() if cfg.lora else None, format=cfg.checkpoint_format)
    window = _Window(world_size, flops_per_token(unwrap(model), cfg.data.max_seq_len), peak_flops(device, config["peak_tflops"]))
    gauges = _Gauges(config["run_id"], rank)
    profiler = StepProfiler(cfg.profile, device, logger) if cfg.profile and rank == 0 else None
    bf16 = cfg.use_gpu and cfg.bf16
    while state.step < cfg.max_steps:
        step_start = time.perf_counter()
        with timer.phase("data_wait"):
            health.inject_faults(state.step + 1)
            micro_batches = next_micro_batches(loader, cfg, device)
        stats = train_step(model, micro_batches, optimizer, scheduler, cfg.optim.grad_clip, bf16, timer)
        state.data = loader.position.model_copy()
        record_step(state, stats, cfg.max_bad_steps_in_row)
        window.add(stats, time.perf_counter() - step_start, timer.reset())
        if profiler:
            profiler.step()
        if state.step == 1:
            window.time_to_first_step_s = time.time() - config["job_start_time"]
        if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
            metrics = {"lr": scheduler.get_last_lr()[0], "skipped_steps": state.skipped_steps, "epoch": state.data.epoch, **window.metrics()}
            metrics |= health.end_window(metrics)  # per-rank local step times compared; may stop a job with a straggler
            last = state.step == cfg.max_steps
            if logger:
                logger.log_metrics(metrics | (step_time_summary(window.total_phase_s, window.total_step_s) if last else {}), step=state.step)
            gauges.set(metrics, window.steps, window.skipped)
            save = state.step % cfg.checkpoint_every == 0 or last
            if save:
                save_and_report({"step": state.step, **metrics}, (model, optimizer, scheduler, state, meta, tokenizer), export_hf=cfg.checkpoint_hf or last)
            window = window.next()
        health.step_done()
    if profiler:
        profiler.close()


class _Window:
    """Metrics over the steps since the last log line, plus whole-run data-wait totals."""

    PHASES = ("data_wait", "forward", "backward", "optimizer", "comm")

    def __init__(self, world_size: int, flops_per_token: float, peak_flops: float):
        self.world_size, self.flops_per_token, self.peak_flops = world_size, flops_per_token, peak_flops
        self.total_wait_s = self.total_step_s = 0.0
        self.total_tokens = 0
        self.total_phase_s = dict.fromkeys(self.PHASES, 0.0)  # whole run, for the step-time summary
        self.time_to_first_step_s: float | None = None
        self._reset()

    def _reset(self) -> None:
        self.steps = self.targets = self.tokens = self.slots = self.skipped = 0
        self.loss_sum = self.grad_norm_sum = self.step_s = 0.0
        self.phase_s = dict.fromkeys(self.PHASES, 0.0)

    def next(self) -> _Window:
        self._reset()
        return self

    def add(self, stats: StepStats, step_s: float, phase_s: dict[str, float]) -> None:
        self.steps += 1
        self.skipped += int(stats.skipped)
        if not stats.skipped:
            self.loss_sum += stats.loss * stats.units
            self.targets += stats.units
            self.grad_norm_sum += stats.grad_norm
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
        metrics = {
            "loss": self.loss_sum / max(1, self.targets),
            "grad_norm": self.grad_norm_sum / max(1, self.steps),
            "tokens_per_s": tokens_per_s,
            "tokens_per_s_per_worker": per_worker,
            "mfu": per_worker * self.flops_per_token / self.peak_flops,
            "time/step_s": self.step_s / self.steps,
            **{f"time/{name}_s": seconds / self.steps for name, seconds in self.phase_s.items()},
            "data_wait_fraction": self.phase_s["data_wait"] / self.step_s,
            "data/packing_efficiency": self.tokens / max(1, self.slots),  # non-pad / all token positions
            "data/tokens": self.total_tokens,  # produced by the pipeline and trained on, all ranks
            "run/data_wait_s": self.total_wait_s,
            "run/step_s": self.total_step_s,
        }
        if self.time_to_first_step_s is not None:
            metrics["time_to_first_step_s"] = self.time_to_first_step_s
        return metrics


class _Gauges:
    """The log window's figures as Prometheus metrics (mlplat.observability.catalogue); rank 0 reports the job's."""

    def __init__(self, run_id: str, rank: int):
        self.job = {"recipe": "sft", "run_id": run_id}
        self.rank = {**self.job, "rank": str(rank)}
        self.is_rank0 = rank == 0

    def set(self, metrics: dict[str, float], steps: int, skipped: int) -> None:
        m = metrics_catalogue
        m.TRAIN_STEP_SECONDS.set(metrics["time/step_s"], **self.rank)
        m.TRAIN_DATA_WAIT_FRACTION.set(metrics["data_wait_fraction"], **self.rank)
        for name in _Window.PHASES:
            m.TRAIN_STEP_PHASE_SECONDS.set(metrics[f"time/{name}_s"], phase=name, **self.rank)
        if not self.is_rank0:
            return
        m.TRAIN_LOSS.set(metrics["loss"], **self.job)
        m.TRAIN_GRAD_NORM.set(metrics["grad_norm"], **self.job)
        m.TRAIN_LR.set(metrics["lr"], **self.job)
        m.TRAIN_TOKENS_PER_S.set(metrics["tokens_per_s"], **self.job)
        m.TRAIN_MFU.set(metrics["mfu"], **self.job)
        m.TRAIN_STEPS.inc(steps, **self.job)
        m.TRAIN_SKIPPED_STEPS.inc(skipped, **self.job)


def run_sft(cfg: SFTConfig, tracking_uri: str | None = None, work_dir: str | Path = "outputs") -> SFTResult:
    """Run the recipe on the connected Ray cluster (``ray.init()`` is called if needed)."""
    from mlplat.tracking.runs import default_tracking_uri

    job_start_time = time.time()
    tracking_uri = tracking_uri or default_tracking_uri()
    model_dir = resolve_model(cfg.model, download_dir=Path(work_dir) / "downloads", tracking_uri=tracking_uri)
    if cfg.resume_from:
        if "://" not in cfg.resume_from:  # workers may run elsewhere: an absolute path
            cfg = cfg.model_copy(update={"resume_from": str(Path(cfg.resume_from).resolve())})
        try:
            resumed_step = read_train_state(Checkpoint(cfg.resume_from)).step
        except FileNotFoundError:
            raise CheckpointError(f"resume_from: {cfg.resume_from} is not a training checkpoint directory (no {TRAIN_STATE})") from None
        except Exception as err:  # noqa: BLE001 - a truncated or foreign file: say which and why, not a traceback
            raise CheckpointError(f"resume_from: cannot read {cfg.resume_from}/{TRAIN_STATE} ({type(err).__name__}: {err})") from None
        if resumed_step >= cfg.max_steps:
            raise ConfigError(f"resume_from: the checkpoint is at step {resumed_step}, not before max_steps={cfg.max_steps}: raise max_steps")
    check_sources(cfg.data)  # a wrong data path fails here, before a cluster or an MLflow run is started
    # Measured before Ray and the data pipeline start, on one worker's threads (Ray gives each one CPU).
    peak_tflops = cfg.peak_tflops or (None if cfg.use_gpu else measure_cpu_peak_flops(threads=1) / 1e12)
    init_ray(num_training_workers=cfg.num_workers)
    tags = {"mlplat.recipe": "sft", "mlplat.resumed_from": cfg.resume_from or ""}
    if commit := git_commit():
        tags["mlflow.source.git.commit"] = commit
    if peak_tflops:
        tags["mlplat.mfu.peak_tflops_per_worker"] = f"{peak_tflops:.4g}"
    run_id = start_run(cfg.experiment, cfg.run_name, params=to_flat_params(cfg), tags=tags, tracking_uri=tracking_uri)
    logger = RunLogger(run_id, tracking_uri)
    try:
        dataset, report = prepare_sft_dataset(cfg.data, str(model_dir), rejects_dir=Path(work_dir) / run_id)
        logger.set_tags({"mlplat.data.fingerprint": report.fingerprint})
        for reason, rows in report.bad_rows_by_reason.items():
            metrics_catalogue.TRAIN_REJECTED_ROWS.inc(rows, recipe="sft", run_id=run_id, reason=reason[:80])
        logger.log_metrics({
            "data.bad_rows": report.bad_rows,
            "data.rows_read": report.rows_read,
            "data.rows_used": report.rows_used,
            **{f"data.source{i}.rows_used": s.rows_used for i, s in enumerate(report.sources)},
        })
        storage = str(Path(cfg.storage_path).resolve()) if "://" not in cfg.storage_path else cfg.storage_path
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={
                "sft": cfg.model_dump(mode="json"),
                "run_id": run_id,
                "tracking_uri": tracking_uri,
                "model_dir": str(model_dir),
                "job_start_time": job_start_time,
                "peak_tflops": peak_tflops,
            },
            scaling_config=ScalingConfig(
                num_workers=cfg.num_workers,
                use_gpu=cfg.use_gpu,
                resources_per_worker=accepted_worker_resources(cfg.use_gpu) if cfg.health.accepted_nodes_only else None,
            ),
            datasets={"train": dataset},
            dataset_config=deterministic_data_config() if cfg.deterministic_data else None,
            run_config=RunConfig(
                name=f"sft-{run_id}",
                storage_path=storage,
                failure_config=FailureConfig(max_failures=cfg.max_failures),
                checkpoint_config=CheckpointConfig(
                    num_to_keep=cfg.num_checkpoints_to_keep,
                    checkpoint_score_attribute=cfg.checkpoint_score_metric,
                    checkpoint_score_order=cfg.checkpoint_score_order,
                ),
            ),
        )
        warm_data_workers(cfg.num_workers)  # the pipeline's first task processes start beside the trainer's
        result = fit_and_release(trainer)
        losses = logger.client.get_metric_history(run_id, "loss")
        final_dir = Path(work_dir) / run_id / "final"
        with result.checkpoint.as_directory() as ckpt:
            shutil.copytree(Path(ckpt) / MODEL_DIR, final_dir, dirs_exist_ok=True)
        checkpoints = [{"path": c.path, "step": m.get("step"), "loss": m.get("loss")} for c, m in result.best_checkpoints]
        logger.log_dict({"checkpoints": checkpoints, "latest": result.checkpoint.path}, "checkpoints.json")
        logger.set_tags({"mlplat.checkpoint.latest": result.checkpoint.path})
        version = None
        if cfg.registered_model:
            version = register_model_dir(run_id, final_dir, cfg.registered_model, cfg.registered_alias, tracking_uri)
        else:
            logger.log_artifacts(final_dir, "model")
        logger.end()
    except BaseException:
        logger.end("FAILED")
        raise
    final = result.metrics
    return SFTResult(
        run_id=run_id,
        model_dir=str(final_dir),
        model_version=version,
        first_loss=min(losses, key=lambda m: m.step).value,
        final_loss=max(losses, key=lambda m: m.step).value,
        skipped_steps=int(final["skipped_steps"]),
        data_wait_fraction=final["run/data_wait_s"] / final["run/step_s"],
        checkpoint_path=result.checkpoint.path,
        data=report,
    )


def main(argv: list[str] | None = None) -> None:
    from mlplat.cli import main as cli_main

    cli_main(["train", "sft", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    main()
