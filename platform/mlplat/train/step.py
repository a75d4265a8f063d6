"""One optimizer step, averaged exactly over the global batch, for any recipe's objective.

The global batch is every rank's micro-batches (gradient accumulation) together. An
``Objective`` gives each micro-batch's loss as a *sum* over its units (target tokens for a
language-model loss, pairs for a preference loss) and how many units that is. DDP and FSDP
average gradients over ranks, so each rank scales its summed loss by world_size / (units in
the global batch): the result is the exact mean over units, however unevenly they fall across
micro-batches and ranks. A step whose loss or gradient norm is not finite is skipped (no
update) and reported, so one bad batch does not poison the weights; the caller decides when
too many in a row is fatal.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Protocol

import torch

from mlplat import collectives
from mlplat.train.batch import IGNORE_INDEX, count_tokens
from mlplat.train.logprobs import labelled_logprobs
from mlplat.train.perf import PhaseTimer


class Objective(Protocol):
    """What a step minimises, per micro-batch: a loss summed over the batch's units, and statistics summed the same way."""

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        """How many units (0-d tensor) the micro-batch's summed loss covers."""
        ...

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(summed loss with a graph, {name: summed statistic, detached})."""
        ...


class CausalLMObjective:
    """Next-token cross-entropy on labelled tokens: SFT's loss, averaged per target token."""

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return (batch["labels"][:, 1:] != IGNORE_INDEX).sum()

    def __call__(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        return -labelled_logprobs(model, batch).sum(), {}  # the summed cross-entropy, chunked over the vocabulary


@dataclass
class StepStats:
    loss: float  # mean loss per unit (target token, pair) over the global batch
    units: int  # what the loss is averaged over, all ranks: target tokens (language-model loss), pairs (preference losses)
    tokens: int  # tokens processed (padding excluded), all ranks
    slots: int  # token positions in the batches, padding included, all ranks (tokens / slots: packing efficiency)
    grad_norm: float  # before clipping
    skipped: bool  # non-finite loss or gradient norm: no update was applied
    metrics: dict[str, float] = field(default_factory=dict)  # the objective's statistics, means per unit over the global batch


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
    objective: Objective | None = None,
) -> StepStats:
    """Forward and backward of ``objective`` (default: causal-LM cross-entropy) over ``micro_batches``
    (or one batch), clip, step. Single-process, DDP or FSDP2."""
    if isinstance(micro_batches, dict):
        micro_batches = [micro_batches]
    objective = objective or CausalLMObjective()
    timer = timer or PhaseTimer(micro_batches[0]["input_ids"].device)
    device = micro_batches[0]["input_ids"].device
    with timer.phase("comm"):
        local = torch.stack(
            [torch.stack([objective.units(b), count_tokens(b), torch.tensor(b["input_ids"].numel(), device=device)]) for b in micro_batches]
        ).sum(0)
        counts = collectives.all_reduce(local.double(), device)
    units = counts[0].clamp(min=1)
    scale = collectives.world_size() / units

    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    stat_sums: dict[str, torch.Tensor] = {}
    for i, batch in enumerate(micro_batches):
        with _gradient_sync(model, enabled=i == len(micro_batches) - 1):
            with timer.phase("forward"):
                autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else contextlib.nullcontext()
                with autocast:
                    micro_loss, stats = objective(model, batch)
            with timer.phase("backward"):
                (micro_loss * scale).backward()
        loss_sum += micro_loss.detach().to(torch.float64)
        for name, value in stats.items():
            stat_sums[name] = stat_sums.get(name, 0.0) + value.detach().to(torch.float64)

    with timer.phase("optimizer"):
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
        grad_norm = float(grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm)  # DTensor under FSDP2
        names = sorted(stat_sums)
        sums = collectives.all_reduce(torch.stack([loss_sum, *(stat_sums[n].reshape(()) for n in names)]), device)
        global_loss, *means = (sums / units).tolist()
        skipped = not (math.isfinite(global_loss) and math.isfinite(grad_norm))  # the same verdict on every rank
        if not skipped:
            optimizer.step()
        scheduler.step()  # the schedule follows steps taken, skipped or not
        optimizer.zero_grad(set_to_none=True)
    return StepStats(
        loss=global_loss, units=int(counts[0]), tokens=int(counts[1]), slots=int(counts[2]), grad_norm=grad_norm,
        skipped=skipped, metrics=dict(zip(names, means)),
    )  # fmt: skip
