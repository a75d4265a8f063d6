"""One optimizer step of causal-LM training, token-averaged over the global batch."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from mlplat.train.batch import causal_lm_loss, count_tokens, model_inputs


@dataclass
class StepStats:
    loss: float  # mean cross-entropy per target token over the global batch
    target_tokens: int  # tokens that carried loss, all ranks
    tokens: int  # tokens processed (padding excluded), all ranks


def _all_reduce_sum(t: torch.Tensor) -> torch.Tensor:
    if dist.is_available() and dist.is_initialized():
        dist.all_reduce(t)
    return t


def train_step(
    model: torch.nn.Module,
    batch: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float,
    bf16: bool = False,
) -> StepStats:
    """Forward, backward, clip, step. Works single-process and under DDP.

    DDP averages gradients over ranks, so each rank scales its summed loss by
    world_size / (target tokens in the global batch): the result is the exact
    token-level mean, however unevenly the targets fall across ranks.
    """
    world_size = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    device_type = batch["input_ids"].device.type
    autocast = torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
    with autocast:
        logits = model(**model_inputs(batch)).logits
    loss_sum, n_targets = causal_lm_loss(logits, batch["labels"])
    counts = _all_reduce_sum(torch.stack([n_targets, count_tokens(batch)]).to(torch.float64))
    (loss_sum * world_size / counts[0].clamp(min=1)).backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
    optimizer.step()
    scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    global_loss = _all_reduce_sum(loss_sum.detach().to(torch.float64))
    return StepStats(
        loss=(global_loss / counts[0].clamp(min=1)).item(),
        target_tokens=int(counts[0].item()),
        tokens=int(counts[1].item()),
    )
