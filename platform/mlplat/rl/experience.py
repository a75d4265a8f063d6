"""The trainer's side of a rollout: sampled completions as a training batch, scored by the policy and the reference.

Shared by the RL recipes (GRPO, PPO): prompt rows from Ray Data, the batch of prompt +
completion rows with the rollout engine's log-probs aligned to target positions, the no-grad
scoring of that batch one micro-batch at a time (chunked over the vocabulary,
``mlplat.train.logprobs``), and mean/std over every rank's values.
"""

from __future__ import annotations

import json

import torch

from mlplat import collectives
from mlplat.rl.rollout import Sample
from mlplat.train.batch import IGNORE_INDEX, pad_collate
from mlplat.train.logprobs import labelled_logprobs, labelled_logprobs_and_entropy


class RowsCollate:
    """Prompt rows stay JSON text in Ray Data (task fields vary); the trainer gets dicts."""

    def __call__(self, batch: dict) -> list[dict]:
        return [json.loads(text) for text in batch["text"]]


def rollout_batch(samples: list[Sample], pad_token_id: int, mask_truncated: bool = False) -> dict[str, torch.Tensor]:
    """Prompt + completion rows, labels on completion tokens only (none for a truncated completion with
    ``mask_truncated``), and the engine's log-probs per target position (``engine_logprobs`` [B, L-1])."""
    ids = [s.prompt_ids + s.completion_ids for s in samples]
    labels = [[IGNORE_INDEX] * len(s.prompt_ids) + ([IGNORE_INDEX] * len(s.completion_ids) if mask_truncated and s.finish_reason == "length" else s.completion_ids)
              for s in samples]  # fmt: skip
    batch = pad_collate({"input_ids": ids, "labels": labels}, pad_token_id)
    engine_logprobs = torch.zeros(batch["labels"][:, 1:].shape)
    for i, s in enumerate(samples):  # target position t predicts token t+1
        start = len(s.prompt_ids) - 1
        engine_logprobs[i, start : start + len(s.logprobs)] = torch.tensor(s.logprobs)
    return {**batch, "engine_logprobs": engine_logprobs}


def completion_mask(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """bool [B, L-1]: target positions that hold a completion token."""
    return batch["labels"][:, 1:] != IGNORE_INDEX


def micro_batches(batch: dict[str, torch.Tensor], rows: int) -> list[dict[str, torch.Tensor]]:
    """The batch split into consecutive micro-batches of ``rows`` rows."""
    size = batch["input_ids"].shape[0]
    return [{k: v[i : i + rows] for k, v in batch.items()} for i in range(0, size, rows)]


@torch.no_grad()
def score_completions(model, batch: dict[str, torch.Tensor], micro_batch_size: int, temperature: float, entropy: bool = False) -> dict[str, torch.Tensor]:
    """No-grad log-probs [B, L-1] of the completion tokens at ``temperature`` (``logprobs``), and with
    ``entropy`` also the raw ones the engine reports (``raw_logprobs``) and the per-token entropy at
    ``temperature``; one micro-batch of rows at a time."""
    parts: dict[str, list[torch.Tensor]] = {"logprobs": []} | ({"raw_logprobs": [], "entropy": []} if entropy else {})
    for micro in micro_batches(batch, micro_batch_size):
        if not entropy:
            parts["logprobs"].append(labelled_logprobs(model, micro, temperature))
            continue
        logprobs, entropies = labelled_logprobs_and_entropy(model, micro, temperature)
        parts["logprobs"].append(logprobs)
        parts["entropy"].append(entropies)
        parts["raw_logprobs"].append(logprobs if temperature == 1.0 else labelled_logprobs(model, micro))
    return {k: torch.cat(v) for k, v in parts.items()}


def batch_moments(device: torch.device):
    """(mean, std) of a per-rank tensor over every rank's values: one all-reduce of count, sum, sum of squares."""

    def moments(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        v = values.double()
        n, total, squares = collectives.all_reduce(torch.stack([torch.tensor(float(v.numel()), dtype=torch.float64), v.sum(), (v * v).sum()]), device).cpu()
        mean = total / n
        return mean.float(), ((squares - n * mean * mean) / (n - 1).clamp(min=1)).clamp(min=0).sqrt().float()

    return moments
