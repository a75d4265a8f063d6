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

import sys
import time
from pathlib import Path

from pydantic import BaseModel, Field, model_validator

from mlplat.data.ingest import check_sources
from mlplat.data.sft import DataReport, SFTDataConfig, prepare_sft_dataset
from mlplat.health.marking import accepted_worker_resources
from mlplat.health.training import FaultInjection, RankHealth, TrainingHealthConfig
from mlplat.models import load_model, load_tokenizer
from mlplat.observability import catalogue as metrics_catalogue
from mlplat.observability.profiling import ProfileConfig, StepProfiler, step_time_summary
from mlplat.tracking import ModelRef
from mlplat.train import collectives
from mlplat.train.batch import PadCollate
from mlplat.train.loop import RecipeConfig, checkpoint_meta, next_micro_batches, record_step, save, train_shard, trainable, worker_setup
from mlplat.train.parallel import unwrap
from mlplat.train.perf import PhaseTimer, flops_per_token, measure_cpu_peak_flops, peak_flops
from mlplat.train.recipe import RecipeRun
from mlplat.train.step import StepStats, train_step
from mlplat.train.worker import WorkerEnv


class SFTConfig(RecipeConfig):
    data: SFTDataConfig
    max_steps: int = Field(default=500, gt=0)
    batch_size_per_worker: int = Field(default=32, gt=0)  # rows per micro-batch
    checkpoint_every: int = Field(default=250, gt=0)
    checkpoint_hf: bool = True  # also export a servable HF model into every checkpoint (always into the last)
    peak_tflops: float | None = None  # per device, for MFU; default: table of GPUs, measured on CPU
    experiment: str = "mlplat-sft"
    registered_model: str | None = "sft-model"  # None: log the model but do not register it
    health: TrainingHealthConfig = TrainingHealthConfig()  # straggler and hang detection; accepted nodes only (mlplat.health)
    debug: FaultInjection = FaultInjection()  # test hooks: a slow or a hung rank, to exercise the detectors
    profile: ProfileConfig | None = None  # torch profiler trace of a few steps on rank 0 -> MLflow (mlplat.observability)

    @model_validator(mode="after")
    def _checks(self):
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


def sft_loop(cfg: SFTConfig, env: WorkerEnv) -> None:
    """Every rank's loop (mlplat.train.worker)."""
    health = RankHealth(cfg.health, cfg.debug, env)
    try:
        _train(cfg, env, health)
    finally:
        health.close()


def _train(cfg: SFTConfig, env: WorkerEnv, health: RankHealth) -> None:
    worker_setup(cfg)
    device, logger = env.device, env.logger
    tokenizer = load_tokenizer(cfg.model)
    # The data stream starts first, at the checkpoint's data position: its start-up overlaps building the model.
    collate = None if cfg.data.pack else PadCollate(tokenizer.pad_token_id)  # packed rows are fixed-length
    loader = train_shard(env, cfg.batch_size_per_worker, cfg.seed, collate)
    model, optimizer, scheduler, state = trainable(load_model(cfg.model), cfg, env)
    if env.restore_from and logger:
        logger.log_metrics({"restored_from_step": state.step}, step=state.step)
    timer = PhaseTimer(device)
    meta = checkpoint_meta(cfg)
    window = _Window(collectives.world_size(), flops_per_token(unwrap(model), cfg.data.max_seq_len), peak_flops(device, cfg.peak_tflops))
    gauges = _Gauges(env.run_id, collectives.rank())
    profiler = StepProfiler(cfg.profile, device, logger) if cfg.profile and logger else None
    bf16, metrics = cfg.use_gpu and cfg.bf16, {}
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
            window.time_to_first_step_s = time.time() - env.start_time
        if state.step % cfg.log_every == 0 or state.step == cfg.max_steps:
            metrics = {"lr": scheduler.get_last_lr()[0], "skipped_steps": state.skipped_steps, "epoch": state.data.epoch, **window.metrics()}
            metrics |= health.end_window(metrics)  # per-rank local step times compared; may stop a job with a straggler
            last = state.step == cfg.max_steps
            if logger:
                logger.log_metrics(metrics | (step_time_summary(window.total_phase_s, window.total_step_s) if last else {}), step=state.step)
            gauges.set(metrics, window.steps, window.skipped)
            window = window.next()
        if state.step % cfg.checkpoint_every == 0 or state.step == cfg.max_steps:  # whatever log_every is
            save(env, metrics, model, optimizer, scheduler, state, meta, tokenizer, export_hf=cfg.checkpoint_hf or state.step == cfg.max_steps)
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
    check_sources(cfg.data)  # a wrong data path fails here, before a cluster or an MLflow run is started
    # Measured before Ray and the data pipeline start, on one worker's threads (Ray gives each one CPU).
    if not cfg.peak_tflops and not cfg.use_gpu:
        cfg = cfg.model_copy(update={"peak_tflops": measure_cpu_peak_flops(threads=1) / 1e12})
    tags = {"mlplat.mfu.peak_tflops_per_worker": f"{cfg.peak_tflops:.4g}"} if cfg.peak_tflops else {}
    run = RecipeRun("sft", cfg, tracking_uri, work_dir, tags=tags)
    with run.tracked():
        dataset, report = prepare_sft_dataset(cfg.data, str(run.model_dir), rejects_dir=run.work_dir / run.run_id)
        run.log_data_report(report)
        for reason, rows in report.bad_rows_by_reason.items():
            metrics_catalogue.TRAIN_REJECTED_ROWS.inc(rows, recipe="sft", run_id=run.run_id, reason=reason[:80])
        run.logger.log_metrics({"data.rows_used": report.rows_used, **{f"data.source{i}.rows_used": s.rows_used for i, s in enumerate(report.sources)}})
        resources = accepted_worker_resources(cfg.use_gpu) if cfg.health.accepted_nodes_only else None
        result = run.fit(sft_loop, {"train": dataset}, resources_per_worker=resources)
        final_dir, version = run.finish(result)
    losses = run.logger.client.get_metric_history(run.run_id, "loss")
    final = result.metrics
    return SFTResult(
        run_id=run.run_id,
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
