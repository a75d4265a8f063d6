"""Batches for causal-LM training: dynamic padding and a token-summed loss."""

from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from mlplat import collectives
from mlplat.data.labels import IGNORE_INDEX, PAD_SEQ_ID


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



class PadCollate:
    """``iter_torch_batches`` collate function: right-pad tokenized rows (mlplat.data.sft) into tensors."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return pad_collate(batch, self.pad_token_id)


class PairCollate:
    """Preference pairs (mlplat.data.preference): chosen rows then rejected rows, right-padded into one
    batch of 2B, so one forward scores both sides."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        both = {key: [*batch[f"chosen_{key}"], *batch[f"rejected_{key}"]] for key in ("input_ids", "labels")}
        return pad_collate(both, self.pad_token_id)


def answered_pairs(labels: torch.Tensor) -> torch.Tensor:
    """bool [B] for a PairCollate batch's labels [2B, L]: both sides kept at least one response token
    (a response truncated to nothing by ``max_seq_len`` compares prompts, not answers)."""
    return (labels != IGNORE_INDEX).any(-1).view(2, -1).all(0)


class PairCounter:
    """Pairs an objective left out for having no response tokens, counted on this rank without a sync
    (``total()`` is one all-reduce, every rank calling it)."""

    def __init__(self):
        self.local = 0

    def add(self, answered: torch.Tensor) -> None:
        self.local += (~answered).sum()

    def total(self, device: torch.device) -> int:
        return int(collectives.all_reduce(torch.as_tensor(self.local, dtype=torch.float64), device).item())

def document_causal_mask(seq_ids: torch.Tensor) -> torch.Tensor:
    """``[batch, 1, L, L]`` bool, True where query i may attend key j: same document and j <= i.

    Padding (seq id -1) forms a block of its own, so no query row is fully masked
    (an all-masked row makes softmax NaN, and NaNs poison the backward pass).
    """
    length = seq_ids.shape[-1]
    same_doc = seq_ids[:, :, None] == seq_ids[:, None, :]
    causal = torch.ones(length, length, dtype=torch.bool, device=seq_ids.device).tril()
    return (same_doc & causal)[:, None]


def packed_model_inputs(
    batch: dict[str, torch.Tensor],
    attn_implementation: Literal["sdpa", "eager"] = "sdpa",
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Keyword arguments for an HF Llama-family forward on packed rows: ``model(**inputs)``.

    transformers passes a 4D ``attention_mask`` through as-is (``masking_utils``), so it
    must already be in the attention kernel's form: SDPA takes a bool mask (True =
    attend); eager *adds* the mask to the scores, so it gets 0 / dtype-min in ``dtype``
    (the model's compute dtype). The mask is O(L^2) per row; flash/varlen kernels that
    take cumulative sequence lengths instead are the way for long rows on GPU.
    """
    mask = document_causal_mask(batch["seq_ids"])
    if attn_implementation == "eager":
        mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
    elif attn_implementation != "sdpa":
        raise ValueError(f"attn_implementation {attn_implementation!r}: expected 'sdpa' or 'eager'")
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "attention_mask": mask}


def model_inputs(batch: dict[str, torch.Tensor], attn_implementation: str = "sdpa", dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
    """Forward kwargs for a padded batch (2-D ``attention_mask``) or a packed one (``seq_ids``)."""
    if "seq_ids" in batch:
        return packed_model_inputs(batch, attn_implementation, dtype)
    return {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}


def count_tokens(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Non-padding tokens in a padded or packed batch."""
    return (batch["seq_ids"] != PAD_SEQ_ID).sum() if "seq_ids" in batch else batch["attention_mask"].sum()
