"""Direct Preference Optimization (DPO) of a causal LM on Ray Train.

    input: an HF checkpoint (usually the SFT model), preference pairs (prompt, chosen, rejected)
    1. validate, render both sides with the chat template, tokenize                  [Ray Data]
    2. on each of N workers:                                                           [Ray Train]
         pi_theta <- the checkpoint (trained, DDP/FSDP2); pi_ref <- the same checkpoint, frozen
         for step in 1..max_steps:
             (chosen, rejected) <- next grad_accum_steps micro-batches of pairs; one forward per model scores both sides
             log pi_ref(y|x) under no_grad, on the worker, once per micro-batch  (*)
             r(y) = beta * (log pi_theta(y|x) - log pi_ref(y|x))             implicit rewards
             loss <- mean over the global batch's pairs of, by loss_type (h = (r_c - r_r) / beta):
                     sigmoid: -(1-eps) log sigmoid(beta h) - eps log sigmoid(-beta h)  (cDPO, eps = label_smoothing)
                     | robust | hinge: max(0, 1 - beta h) | ipo: (h - 1/(2 beta))^2 on per-token mean log-probs
                     (pairs whose response max_seq_len cut to nothing: left out, counted)
             AdamW step (skipped if not finite); log loss, rewards/{chosen,rejected,margins,accuracies} -> MLflow
    3. held-out pairs, before and after (scored on every rank): implicit reward margin and accuracy,
       and the log-prob margin log pi(chosen) - log pi(rejected); register the model
    output: run id, model version, held-out margins

(*) The reference log-probs are computed per batch on the worker rather than precomputed
in a Ray Data pass: one extra no-grad forward per step, but the data pipeline stays
model-free (no GPU actors in it), any change of data or template needs no recompute,
and resume needs nothing but the checkpoint. With a large reference model the precompute
pass is the better trade; the loss is the same.

Run: ``mlplat train dpo --config dpo.yaml``.
"""

from __future__ import annotations

from pathlib import Path

import torch
from pydantic import BaseModel, Field

from mlplat import recipes
from mlplat.data.preference import PreferenceDataConfig, prepare_preference_dataset, read_preference_pairs
from mlplat.models import load_model, load_tokenizer
from mlplat.recipes import Recipe
from mlplat.tracking import ModelRef
from mlplat.train.batch import IGNORE_INDEX, PairCollate, PairCounter, answered_pairs
from mlplat.train.logprobs import sequence_logprobs
from mlplat.train.loop import RecipeConfig, frozen_reference, run_steps, train_shard, trainable, worker_setup
from mlplat.train.losses import DPOLossType, dpo_loss
from mlplat.train.optim import OptimizerConfig
from mlplat.train.parallel import unwrap
from mlplat.train.recipe import RecipeRun
from mlplat.train.worker import WorkerEnv


class DPOConfig(RecipeConfig):
    data: PreferenceDataConfig
    eval_data: str | None = None  # held-out preference JSONL: margins before and after
    beta: float = Field(default=0.1, gt=0)  # strength of the KL constraint to the reference
    label_smoothing: float = Field(default=0.0, ge=0, lt=0.5)  # assumed label-flip probability (cDPO, robust)
    loss_type: DPOLossType = "sigmoid"  # sigmoid | ipo | hinge | robust (TRL's)
    optim: OptimizerConfig = OptimizerConfig(lr=1e-5, warmup_steps=10)
    experiment: str = "mlplat-dpo"
    registered_model: str | None = "dpo-model"


class HeldOutMargins(BaseModel):
    rewards_margin: float  # mean beta * ((log pi - log pi_ref)(chosen) - (log pi - log pi_ref)(rejected))
    rewards_accuracy: float  # pairs with a positive implicit reward margin
    logp_margin: float  # mean log pi(chosen) - log pi(rejected)


class DPOResult(BaseModel):
    run_id: str
    model_dir: str
    model_version: ModelRef | None
    first_loss: float
    final_loss: float
    eval_before: HeldOutMargins | None
    eval_after: HeldOutMargins | None


class DPOObjective:
    """DPO per pair against a frozen reference: chosen rows first, then rejected (PairCollate). Pairs whose
    response was truncated to nothing are left out of the loss and counted (``truncated``)."""

    def __init__(self, reference: torch.nn.Module, beta: float, label_smoothing: float = 0.0, loss_type: DPOLossType = "sigmoid"):
        self.reference, self.beta, self.label_smoothing, self.loss_type = reference, beta, label_smoothing, loss_type
        self.truncated = PairCounter()

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return answered_pairs(batch["labels"]).sum()

    def logprobs(self, model, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) sequence log-probs [B]; IPO's are per-token means (TRL's length normalisation)."""
        logps = sequence_logprobs(model, batch)
        if self.loss_type == "ipo":
            logps = logps / (batch["labels"][:, 1:] != IGNORE_INDEX).sum(-1).clamp(min=1)
        return logps.chunk(2)

    def __call__(self, policy, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        answered = answered_pairs(batch["labels"])
        self.truncated.add(answered)
        with torch.no_grad():
            ref_chosen, ref_rejected = self.logprobs(self.reference, batch)
        chosen, rejected = self.logprobs(policy, batch)
        losses, chosen_rewards, rejected_rewards = dpo_loss(chosen, rejected, ref_chosen, ref_rejected, self.beta, self.label_smoothing, self.loss_type)
        keep = answered.to(losses.dtype)
        margins = chosen_rewards - rejected_rewards
        return (losses * keep).sum(), {
            "rewards/chosen": (chosen_rewards * keep).sum(), "rewards/rejected": (rejected_rewards * keep).sum(),
            "rewards/margins": (margins * keep).sum(), "rewards/accuracies": ((margins > 0) & answered).sum(),
            "logps/chosen": (chosen.detach() * keep).sum(), "logps/rejected": (rejected.detach() * keep).sum(),
        }  # fmt: skip


def dpo_loop(cfg: DPOConfig, env: WorkerEnv) -> None:
    """Every rank's loop (mlplat.train.worker): DPO steps on the shared skeleton."""
    worker_setup(cfg)
    tokenizer = load_tokenizer(cfg.model)
    loader = train_shard(env, cfg.batch_size_per_worker, cfg.seed, PairCollate(tokenizer.pad_token_id))
    policy, optimizer, scheduler, state = trainable(load_model(cfg.model), cfg, env)
    reference = frozen_reference(cfg, env, policy)
    # Every rank scores the held-out pairs (forwards stay in step under FSDP); rank 0 logs them.
    held_out = read_preference_pairs(cfg.eval_data, tokenizer, cfg.data.max_seq_len) if cfg.eval_data else None

    def margins(prefix: str) -> dict[str, float]:
        return _prefixed(held_out_margins(unwrap(policy), reference, held_out, tokenizer, cfg.beta, env.device), prefix) if held_out else {}

    if state.step == 0 and (before := margins("eval_before")) and env.logger:
        env.logger.log_metrics(before)
    objective = DPOObjective(reference, cfg.beta, cfg.label_smoothing, cfg.loss_type)

    def final_metrics() -> dict[str, float]:
        return {**margins("eval"), "data/truncated_pairs": objective.truncated.total(env.device)}

    run_steps(cfg, env, loader, policy, optimizer, scheduler, state, objective, tokenizer, "dpo", final_metrics)


def _prefixed(margins: HeldOutMargins, prefix: str) -> dict[str, float]:
    return {f"{prefix}/{key}": value for key, value in margins.model_dump().items()}


@torch.no_grad()
def held_out_margins(policy, reference, pairs: list[dict], tokenizer, beta: float, device, batch_size: int = 64) -> HeldOutMargins:
    """Implicit reward margin, its accuracy, and the plain log-prob margin over held-out pairs."""
    was_training = policy.training
    policy.eval()
    collate, logps = PairCollate(tokenizer.pad_token_id), {"policy": [], "reference": []}
    for start in range(0, len(pairs), batch_size):
        chunk = pairs[start : start + batch_size]
        batch = {k: v.to(device) for k, v in collate({key: [p[key] for p in chunk] for key in chunk[0]}).items()}
        for name, model in (("policy", policy), ("reference", reference)):
            logps[name].append(torch.stack(sequence_logprobs(model, batch).chunk(2)))
    policy.train(was_training)
    (pc, pr), (rc, rr) = torch.cat(logps["policy"], dim=1), torch.cat(logps["reference"], dim=1)
    margins = beta * ((pc - rc) - (pr - rr))
    return HeldOutMargins(
        rewards_margin=margins.mean().item(), rewards_accuracy=(margins > 0).float().mean().item(), logp_margin=(pc - pr).mean().item()
    )


def run_dpo(cfg: DPOConfig, tracking_uri: str | None = None, work_dir: str | Path = "outputs") -> DPOResult:
    """Run the recipe on the connected Ray cluster (a local one is started if needed)."""
    run = RecipeRun("dpo", cfg, tracking_uri, work_dir)
    with run.tracked():
        dataset, data_report = prepare_preference_dataset(cfg.data, str(run.model_dir), rejects_dir=run.work_dir / run.run_id)
        run.log_data_report(data_report)
        result = run.fit(dpo_loop, {"train": dataset})
        final_dir, version = run.finish(result)
    client = run.logger.client
    losses = client.get_metric_history(run.run_id, "loss")
    metrics = client.get_run(run.run_id).data.metrics

    def margins(prefix: str) -> HeldOutMargins | None:
        keys = HeldOutMargins.model_fields
        return HeldOutMargins(**{k: metrics[f"{prefix}/{k}"] for k in keys}) if f"{prefix}/logp_margin" in metrics else None

    return DPOResult(
        run_id=run.run_id,
        model_dir=str(final_dir),
        model_version=version,
        first_loss=min(losses, key=lambda m: m.step).value,
        final_loss=max(losses, key=lambda m: m.step).value,
        eval_before=margins("eval_before"),
        eval_after=margins("eval"),
    )


RECIPE = Recipe("dpo", DPOConfig, run_dpo)  # registered in pyproject.toml's mlplat.recipes entry points


def main(argv: list[str] | None = None) -> None:
    recipes.main("dpo", argv)


if __name__ == "__main__":
    main()
