"""Supervised fine-tuning (SFT) of a causal LM on Ray Train.

    input: an HF checkpoint (path or models:/ URI), chat JSONL
    1. validate rows (bad ones to a rejects file, counted) and tokenize with the
       checkpoint's chat template; labels only on assistant tokens          [Ray Data]
    2. on each of N workers (DDP; gloo on CPU, NCCL on GPU):                 [Ray Train]
         for step in 1..max_steps:
             batch  <- next padded batch from this worker's dataset shard
             loss   <- sum of token cross-entropies / tokens in the global batch
             AdamW step (grad clip), LR warmup + cosine
             every log_every:        report loss, lr, tokens/s; rank 0 logs to MLflow
             every checkpoint_every: Ray Train checkpoint = HF model + optimizer state
    3. register the final HF checkpoint as a new MLflow model version         [MLflow]
    output: run id, model version, final loss

Run: ``python -m train_apps.sft --config sft.yaml --set optim.lr=3e-4``.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import ray
import ray.train
import torch
from pydantic import BaseModel
from ray.train import Checkpoint, CheckpointConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from mlplat.config import Config, to_flat_params
from mlplat.data.sft import DataReport, PadCollate, SFTDataConfig, prepare_sft_dataset
from mlplat.models import load_model, load_tokenizer
from mlplat.runtime import init_ray
from mlplat.tracking import ModelRef, RunLogger, register_model_dir, resolve_model, start_run
from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
from mlplat.train.step import StepStats, train_step

MODEL_DIR = "model"  # inside a checkpoint: the HF checkpoint, servable as-is
TRAIN_STATE = "train_state.pt"  # inside a checkpoint: optimizer, scheduler, step


class SFTConfig(Config):
    model: str  # local HF checkpoint directory or models:/NAME/VERSION|@ALIAS
    data: SFTDataConfig
    optim: OptimizerConfig = OptimizerConfig()
    max_steps: int = 500
    batch_size_per_worker: int = 32
    num_workers: int = 2
    use_gpu: bool = False
    bf16: bool = True  # autocast to bf16 on GPU; CPU trains in fp32
    log_every: int = 10
    checkpoint_every: int = 250
    num_checkpoints_to_keep: int = 2
    seed: int = 0
    storage_path: str = "outputs/ray_train"  # Ray Train run storage (local path or URI)
    experiment: str = "mlplat-sft"
    run_name: str | None = None
    registered_model: str | None = "sft-model"  # None: log the model but do not register it
    registered_alias: str | None = None


class SFTResult(BaseModel):
    run_id: str
    model_dir: str  # local HF checkpoint of the final model
    model_version: ModelRef | None
    first_loss: float
    final_loss: float
    data: DataReport


def train_loop_per_worker(config: dict) -> None:
    cfg = SFTConfig.model_validate(config["sft"])
    logger = RunLogger(config["run_id"], config["tracking_uri"]) if ray.train.get_context().get_world_rank() == 0 else None
    torch.manual_seed(cfg.seed)
    if not cfg.use_gpu:
        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))

    checkpoint = ray.train.get_checkpoint()  # set when Ray Train restarts us after a failure
    with checkpoint.as_directory() if checkpoint else contextlib.nullcontext() as ckpt:
        model = load_model(Path(ckpt) / MODEL_DIR if ckpt else config["model_dir"])
        optimizer = build_optimizer(model, cfg.optim)
        scheduler = build_lr_scheduler(optimizer, cfg.optim, cfg.max_steps)
        step = 0
        if ckpt:
            state = torch.load(Path(ckpt) / TRAIN_STATE, weights_only=True)
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            step = state["step"]
    tokenizer = load_tokenizer(config["model_dir"])
    model = ray.train.torch.prepare_model(model)  # moves to the worker's device, wraps in DDP
    device = ray.train.torch.get_device()
    bf16 = cfg.use_gpu and cfg.bf16

    shard = ray.train.get_dataset_shard("train")
    window = _Window()
    while step < cfg.max_steps:
        batches = shard.iter_torch_batches(
            batch_size=cfg.batch_size_per_worker,
            collate_fn=None if cfg.data.pack else PadCollate(tokenizer.pad_token_id),  # packed rows are fixed-length
            drop_last=True,  # equal batch counts on every rank, so DDP never waits on a missing peer
            local_shuffle_buffer_size=8 * cfg.batch_size_per_worker,
            local_shuffle_seed=cfg.seed + step,
        )
        for batch in batches:
            stats = train_step(model, {k: v.to(device) for k, v in batch.items()}, optimizer, scheduler, cfg.optim.grad_clip, bf16)
            step += 1
            window.add(stats)
            if step % cfg.log_every == 0 or step == cfg.max_steps:
                metrics = {"lr": scheduler.get_last_lr()[0], **window.metrics()}
                if logger:
                    logger.log_metrics(metrics, step=step)
                save = step % cfg.checkpoint_every == 0 or step == cfg.max_steps
                _report({"step": step, **metrics}, model, tokenizer, optimizer, scheduler, step, save)
                window = _Window()
            if step >= cfg.max_steps:
                break


class _Window:
    """Metrics over the steps since the last log line."""

    def __init__(self):
        self.loss_sum, self.targets, self.tokens, self.start = 0.0, 0, 0, time.perf_counter()

    def add(self, stats: StepStats) -> None:
        self.loss_sum += stats.loss * stats.target_tokens
        self.targets += stats.target_tokens
        self.tokens += stats.tokens

    def metrics(self) -> dict[str, float]:
        return {"loss": self.loss_sum / max(1, self.targets), "tokens_per_s": self.tokens / (time.perf_counter() - self.start)}


def _report(metrics, model, tokenizer, optimizer, scheduler, step, save: bool) -> None:
    """Report metrics from every rank; rank 0 attaches a checkpoint when ``save``."""
    if not (save and ray.train.get_context().get_world_rank() == 0):
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory() as tmp:
        unwrapped = model.module if hasattr(model, "module") else model
        unwrapped.save_pretrained(Path(tmp) / MODEL_DIR, safe_serialization=True)
        tokenizer.save_pretrained(Path(tmp) / MODEL_DIR)
        torch.save(
            {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(), "step": step},
            Path(tmp) / TRAIN_STATE,
        )
        ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp))


def run_sft(cfg: SFTConfig, tracking_uri: str | None = None, work_dir: str | Path = "outputs") -> SFTResult:
    """Run the recipe on the connected Ray cluster (``ray.init()`` is called if needed)."""
    from mlplat.tracking.runs import default_tracking_uri

    tracking_uri = tracking_uri or default_tracking_uri()
    model_dir = resolve_model(cfg.model, download_dir=Path(work_dir) / "downloads", tracking_uri=tracking_uri)
    init_ray(num_training_workers=cfg.num_workers)
    run_id = start_run(cfg.experiment, cfg.run_name, params=to_flat_params(cfg), tags={"mlplat.recipe": "sft"}, tracking_uri=tracking_uri)
    logger = RunLogger(run_id, tracking_uri)
    try:
        dataset, report = prepare_sft_dataset(cfg.data, str(model_dir), rejects_dir=Path(work_dir) / run_id)
        logger.log_metrics({
            "data.bad_rows": report.bad_rows,
            "data.rows_read": report.rows_read,
            "data.rows_used": report.rows_used,
            **{f"data.source{i}.rows_used": s.rows_used for i, s in enumerate(report.sources)},
        })
        trainer = TorchTrainer(
            train_loop_per_worker,
            train_loop_config={"sft": cfg.model_dump(mode="json"), "run_id": run_id, "tracking_uri": tracking_uri, "model_dir": str(model_dir)},
            scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu),
            datasets={"train": dataset},
            run_config=RunConfig(
                name=f"sft-{run_id}",
                storage_path=str(Path(cfg.storage_path).resolve()) if "://" not in cfg.storage_path else cfg.storage_path,
                checkpoint_config=CheckpointConfig(num_to_keep=cfg.num_checkpoints_to_keep),
            ),
        )
        result = trainer.fit()
        losses = logger.client.get_metric_history(run_id, "loss")
        final_dir = Path(work_dir) / run_id / "final"
        with result.checkpoint.as_directory() as ckpt:
            shutil.copytree(Path(ckpt) / MODEL_DIR, final_dir, dirs_exist_ok=True)
        version = None
        if cfg.registered_model:
            version = register_model_dir(run_id, final_dir, cfg.registered_model, cfg.registered_alias, tracking_uri)
        else:
            logger.log_artifacts(final_dir, "model")
        logger.end()
    except BaseException:
        logger.end("FAILED")
        raise
    return SFTResult(
        run_id=run_id,
        model_dir=str(final_dir),
        model_version=version,
        first_loss=min(losses, key=lambda m: m.step).value,
        final_loss=max(losses, key=lambda m: m.step).value,
        data=report,
    )


def main(argv: list[str] | None = None) -> None:
    from mlplat.cli import main as cli_main

    cli_main(["train", "sft", *(argv if argv is not None else sys.argv[1:])])


if __name__ == "__main__":
    main()
