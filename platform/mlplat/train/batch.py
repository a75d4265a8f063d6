"""Batches for causal-LM training: dynamic padding and a token-summed loss."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

IGNORE_INDEX = -100


def pad_collate(batch: dict[str, np.ndarray], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-pad variable-length ``input_ids``/``labels`` to the longest row in the batch."""
    rows, labels = batch["input_ids"], batch["labels"]
    length = max(len(r) for r in rows)
    input_ids = torch.full((len(rows), length), pad_token_id, dtype=torch.long)
    target = torch.full((len(rows), length), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((len(rows), length), dtype=torch.long)
    for i, (r, lab) in enumerate(zip(rows, labels)):
        input_ids[i, : len(r)] = torch.as_tensor(r)
        target[i, : len(lab)] = torch.as_tensor(lab)
        attention_mask[i, : len(r)] = 1
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": target}


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed next-token cross-entropy over unmasked labels, and how many tokens that is.

    Returning the sum lets callers average over tokens across micro-batches and
    ranks instead of averaging per-batch means (which overweights short batches).
    """
    shift_logits = logits[:, :-1].reshape(-1, logits.size(-1)).float()
    shift_labels = labels[:, 1:].reshape(-1)
    loss_sum = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX, reduction="sum")
    return loss_sum, (shift_labels != IGNORE_INDEX).sum()
