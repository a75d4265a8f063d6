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
    3. register the final HF checkpoint (LoRA merged; with lora.register_as: adapter, the adapter alone,
       served by name on its base model) as an MLflow model version, with an alias             [MLflow]
    output: run id, model version, losses, data-wait fraction

Run: ``python -m train_apps.sft --config sft.yaml --set optim.lr=3e-4``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from mlplat import recipes
from mlplat.data.sft import DataReport, SFTDataConfig, prepare_sft_dataset
from mlplat.models import load_model, load_tokenizer
from mlplat.recipes import Recipe
from mlplat.tracking import ModelRef
from mlplat.train.batch import PadCollate
from mlplat.train.loop import RecipeConfig, run_steps, train_shard, trainable, worker_setup
from mlplat.train.recipe import RecipeRun
from mlplat.train.step import CausalLMObjective
from mlplat.train.worker import WorkerEnv


class SFTConfig(RecipeConfig):
    data: SFTDataConfig
    max_steps: int = Field(default=500, gt=0)
    batch_size_per_worker: int = Field(default=32, gt=0)  # rows per micro-batch
    checkpoint_every: int = Field(default=250, gt=0)
    checkpoint_hf: bool = True  # also export a servable HF model into every checkpoint (always into the last)
    experiment: str = "mlplat-sft"
    registered_model: str | None = "sft-model"  # None: log the model but do not register it


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
    """Every rank's loop (mlplat.train.worker): next-token cross-entropy on the shared skeleton."""
    worker_setup(cfg)
    tokenizer = load_tokenizer(cfg.model)
    # The data stream starts first, at the checkpoint's data position: its start-up overlaps building the model.
    collate = None if cfg.data.pack else PadCollate(tokenizer.pad_token_id)  # packed rows are fixed-length
    loader = train_shard(env, cfg.batch_size_per_worker, cfg.seed, collate)
    model, optimizer, scheduler, state = trainable(load_model(cfg.model), cfg, env)
    run_steps(cfg, env, loader, model, optimizer, scheduler, state, CausalLMObjective(), tokenizer, "sft")


def run_sft(cfg: SFTConfig, tracking_uri: str | None = None, work_dir: str | Path = "outputs") -> SFTResult:
    """Run the recipe on the connected Ray cluster (``ray.init()`` is called if needed)."""
    run = RecipeRun("sft", cfg, tracking_uri, work_dir)
    with run.tracked():
        dataset, report = prepare_sft_dataset(cfg.data, str(run.model_dir), rejects_dir=run.work_dir / run.run_id)
        run.log_data_report(report)
        result = run.fit(sft_loop, {"train": dataset})
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


RECIPE = Recipe("sft", SFTConfig, run_sft)  # registered in pyproject.toml's mlplat.recipes entry points


def main(argv: list[str] | None = None) -> None:
    recipes.main("sft", argv)


if __name__ == "__main__":
    main()
