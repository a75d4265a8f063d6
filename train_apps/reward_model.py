"""Reward model: an LM with a scalar head, trained on preference pairs (Bradley-Terry), on Ray Train.

    input: an HF causal-LM checkpoint (usually the SFT model), preference pairs (prompt, chosen, rejected)
    1. validate, render both sides with the chat template, tokenize                  [Ray Data]
    2. on each of N workers:                                                           [Ray Train]
         r_theta <- the checkpoint's transformer + a new linear head to one scalar,
                    read at each sequence's last token
         for step in 1..max_steps:
             (chosen, rejected) <- next grad_accum_steps micro-batches of pairs; one forward scores both sides
             loss <- mean over the global batch's pairs of -log sigmoid(r(chosen) - r(rejected))  (Bradley-Terry)
             AdamW step (skipped if not finite), LR warmup + cosine; log loss, accuracy, reward margin -> MLflow
    3. pairwise accuracy on held-out pairs (every rank scores them all); the HF checkpoint (architecture
       *ForSequenceClassification) is registered in MLflow and scores responses for RL
       through ``mlplat.rl.rewards.RewardModelScorer``
    output: run id, model version, held-out accuracy

Run: ``mlplat train reward_model --config rm.yaml``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, model_validator

from mlplat import recipes
from mlplat.data.preference import PreferenceDataConfig, prepare_preference_dataset, read_preference_pairs
from mlplat.models import load_reward_model, load_tokenizer
from mlplat.recipes import Recipe
from mlplat.tracking import ModelRef
from mlplat.train.batch import PairCollate, PairCounter, answered_pairs
from mlplat.train.loop import RecipeConfig, run_steps, train_shard, trainable, worker_setup
from mlplat.train.losses import bradley_terry_loss
from mlplat.train.parallel import unwrap
from mlplat.train.recipe import RecipeRun
from mlplat.train.worker import WorkerEnv


class RewardModelConfig(RecipeConfig):
    data: PreferenceDataConfig
    eval_data: str | None = None  # held-out preference JSONL: pairwise accuracy at the end
    experiment: str = "mlplat-reward-model"
    registered_model: str | None = "reward-model"

    @model_validator(mode="after")
    def _no_lora(self):
        if self.lora is not None:
            raise ValueError("lora: not supported for the reward model (its new score head must train in full); remove lora")
        return self


class RewardModelResult(BaseModel):
    run_id: str
    model_dir: str
    model_version: ModelRef | None
    first_loss: float
    final_loss: float
    eval_accuracy: float | None  # held-out pairs with r(chosen) > r(rejected)


class PairwiseObjective:
    """Bradley-Terry on the scalar head's scores, per pair: chosen rows first, then rejected (PairCollate).
    Pairs whose response was truncated to nothing are left out of the loss and counted (``truncated``)."""

    def __init__(self):
        self.truncated = PairCounter()

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return answered_pairs(batch["labels"]).sum()

    def __call__(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        answered = answered_pairs(batch["labels"])
        self.truncated.add(answered)
        chosen, rejected = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0].chunk(2)
        margin, keep = (chosen - rejected).detach(), answered.to(chosen.dtype)
        return (bradley_terry_loss(chosen, rejected) * keep).sum(), {"accuracy": ((margin > 0) & answered).sum(), "reward_margin": (margin * keep).sum()}


def reward_model_loop(cfg: RewardModelConfig, env: WorkerEnv) -> None:
    """Every rank's loop (mlplat.train.worker): Bradley-Terry steps on the shared skeleton."""
    worker_setup(cfg)
    tokenizer = load_tokenizer(cfg.model)
    loader = train_shard(env, cfg.batch_size_per_worker, cfg.seed, PairCollate(tokenizer.pad_token_id))
    model, optimizer, scheduler, state = trainable(load_reward_model(cfg.model), cfg, env)

    objective = PairwiseObjective()

    def final_metrics() -> dict[str, float]:  # every rank scores the held-out pairs: forwards stay in step under FSDP
        held_out = {"eval/accuracy": pairwise_accuracy(unwrap(model), tokenizer, cfg.eval_data, cfg.data.max_seq_len, env.device)} if cfg.eval_data else {}
        return {**held_out, "data/truncated_pairs": objective.truncated.total(env.device)}

    run_steps(cfg, env, loader, model, optimizer, scheduler, state, objective, tokenizer, "reward_model", final_metrics)


@torch.no_grad()
def pairwise_accuracy(model, tokenizer, path: str, max_seq_len: int, device: torch.device, batch_size: int = 64) -> float:
    """Fraction of held-out pairs the model scores chosen above rejected."""
    was_training = model.training
    model.eval()
    pairs, collate, correct = read_preference_pairs(path, tokenizer, max_seq_len), PairCollate(tokenizer.pad_token_id), 0
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        batch = collate({key: [p[key] for p in chunk] for key in chunk[0]})
        scores = model(input_ids=batch["input_ids"].to(device), attention_mask=batch["attention_mask"].to(device)).logits[:, 0]
        chosen, rejected = scores.chunk(2)
        correct += int((chosen > rejected).sum())
    model.train(was_training)
    return correct / len(pairs)


def run_reward_model(cfg: RewardModelConfig, tracking_uri: str | None = None, work_dir: str | Path = "outputs") -> RewardModelResult:
    """Run the recipe on the connected Ray cluster (a local one is started if needed)."""
    run = RecipeRun("reward_model", cfg, tracking_uri, work_dir)
    with run.tracked():
        dataset, data_report = prepare_preference_dataset(cfg.data, str(run.model_dir), rejects_dir=run.work_dir / run.run_id)
        run.log_data_report(data_report)
        result = run.fit(reward_model_loop, {"train": dataset})
        final_dir, version = run.finish(result)
    losses = run.logger.client.get_metric_history(run.run_id, "loss")
    return RewardModelResult(
        run_id=run.run_id,
        model_dir=str(final_dir),
        model_version=version,
        first_loss=min(losses, key=lambda m: m.step).value,
        final_loss=max(losses, key=lambda m: m.step).value,
        eval_accuracy=result.metrics.get("eval/accuracy"),
    )


RECIPE = Recipe("reward_model", RewardModelConfig, run_reward_model)  # registered in pyproject.toml's mlplat.recipes entry points


def main(argv: list[str] | None = None) -> None:
    recipes.main("reward_model", argv)


if __name__ == "__main__":
    main()
