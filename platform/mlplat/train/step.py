"""One optimizer step of causal-LM training, token-averaged over the global batch.

The global batch is every rank's micro-batches (gradient accumulation) together. DDP
and FSDP average gradients over ranks, so each rank scales its summed loss by
world_size / (target tokens in the global batch): the result is the exact token-level
mean, however unevenly the targets fall across micro-batches and ranks. A step whose
loss or gradient norm is not finite is skipped (no update) and reported, so one bad
batch does not poison the weights; the caller decides when too many in a row is fatal.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch

from mlplat.train import collectives
from mlplat.train.batch import IGNORE_INDEX, causal_lm_loss, count_tokens, model_inputs
from mlplat.train.perf import PhaseTimer


@dataclass
class StepStats:
    loss: float  # mean cross-entropy per target token over the global batch
    target_tokens: int  # tokens that carried loss, all ranks
    tokens: int  # tokens processed (padding excluded), all ranks
    slots: int  # token positions in the batches, padding included, all ranks (tokens / slots: packing efficiency)
    grad_norm: float  # before clipping
    skipped: bool  # non-finite loss or gradient norm: no update was applied


def _gradient_sync(model: torch.nn.Module, enabled: bool):
    """Context that defers the gradient all-reduce on all but the last micro-batch."""
    if enabled:
        return contextlib.nullcontext()
    if hasattr(model, "no_sync"):  # DDP
        return model.no_sync()
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: reduce-scatter only on the last micro-batch
        model.set_requires_gradient_sync(False)
        return _RestoreFSDPSync(model)
    return contextlib.nullcontext()


class _RestoreFSDPSync(contextlib.AbstractContextManager):
    def __init__(self, model):
        self.model = model

    def __exit__(self, *exc):
        self.model.set_requires_gradient_sync(True)


def train_step(
    model: torch.nn.Module,
    micro_batches: dict[str, torch.Tensor] | list[dict[str, torch.Tensor]],
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    grad_clip: float,
    bf16: bool = False,
    timer: PhaseTimer | None = None,
) -> StepStats:
    """Forward and backward over ``micro_batches`` (or one batch), clip, step. Single-process, DDP or FSDP2."""
    if isinstance(micro_batches, dict):
        micro_batches = [micro_batches]
    timer = timer or PhaseTimer(micro_batches[0]["input_ids"].device)
    device_type = micro_batches[0]["input_ids"].device.type
    with timer.phase("comm"):
        local = torch.stack(
            [torch.stack([(b["labels"][:, 1:] != IGNORE_INDEX).sum(), count_tokens(b), torch.tensor(b["input_ids"].numel(), device=b["input_ids"].device)]) for b in micro_batches]
        ).sum(0)
        counts = collectives.all_reduce(local.to(torch.float64), local.device)
    scale = collectives.world_size() / counts[0].clamp(min=1)

    loss_sum = torch.zeros((), dtype=torch.float64, device=counts.device)
    for i, batch in enumerate(micro_batches):
        with _gradient_sync(model, enabled=i == len(micro_batches) - 1):
            with timer.phase("forward"):
                autocast = torch.autocast(device_type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
                with autocast:
                    logits = model(**model_inputs(batch), use_cache=False).logits  # a KV cache is for generation
                micro_loss, _ = causal_lm_loss(logits, batch["labels"])
            with timer.phase("backward"):
                (micro_loss * scale).backward()
        loss_sum += micro_loss.detach().to(torch.float64)

    with timer.phase("optimizer"):
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # DTensor under FSDP2
        global_loss = (collectives.all_reduce(loss_sum, loss_sum.device) / counts[0].clamp(min=1)).item()
        skipped = not (math.isfinite(global_loss) and math.isfinite(grad_norm))  # the same verdict on every rank
        if not skipped:
            optimizer.step()
        scheduler.step()  # the schedule follows steps taken, skipped or not
        optimizer.zero_grad(set_to_none=True)
    return StepStats(loss=global_loss, target_tokens=int(counts[0]), tokens=int(counts[1]), slots=int(counts[2]), grad_norm=grad_norm, skipped=skipped)
