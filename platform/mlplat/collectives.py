"""Every collective that training code issues, in one place.

Two rules that a one-GPU check could not otherwise see broken:
- tensors go to the training device first: NCCL refuses CPU tensors (gloo takes either), so
  a metric built on the CPU and all-reduced works on a CPU cluster and fails on the first GPU;
- nothing short-circuits while a process group exists: a run at world size 1 issues the same
  collectives as one at 64, so a check on one GPU exercises them. Only a process without any
  process group (a unit test, a notebook) computes locally.

Each call is counted in ``ISSUED`` (by name), so a check can see that a step issued collectives.
Recipes call these instead of ``torch.distributed`` (tests/test_collectives.py scans for it).
"""

from __future__ import annotations

from collections import Counter
from typing import Literal

import torch
import torch.distributed as dist

ReduceOp = Literal["sum", "mean", "max", "min"]
ISSUED: Counter[str] = Counter()  # collective name -> calls issued by this process
_OPS = {"sum": dist.ReduceOp.SUM, "mean": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def active() -> bool:
    """A process group exists: collectives are issued (at any world size)."""
    return dist.is_available() and dist.is_initialized()


def world_size() -> int:
    return dist.get_world_size() if active() else 1


def rank() -> int:
    return dist.get_rank() if active() else 0


def all_reduce(tensor: torch.Tensor, device: torch.device, op: ReduceOp = "sum") -> torch.Tensor:
    """``tensor`` reduced over the ranks, returned on ``device`` (the caller's tensor is left as it was)."""
    return all_reduce_(tensor.to(device=device, copy=True), device, op)


def all_reduce_(tensor: torch.Tensor, device: torch.device, op: ReduceOp = "sum") -> torch.Tensor:
    """``tensor`` reduced over the ranks in place: for a buffer already on ``device`` that a bandwidth check
    times (no copy inside the timed call); one elsewhere is refused, as NCCL would refuse a CPU tensor."""
    device = torch.device(device)
    if tensor.device.type != device.type or (device.index is not None and tensor.device.index != device.index):
        raise ValueError(f"all_reduce_: the tensor is on {tensor.device}, the group's device is {device}")
    if active():
        dist.all_reduce(tensor, op=_OPS[op])
        ISSUED["all_reduce"] += 1
        if op == "mean":
            tensor /= dist.get_world_size()
    return tensor


def reduce_values(values: dict[str, float], device: torch.device, op: ReduceOp = "sum") -> dict[str, float]:
    """Python numbers reduced over the ranks in one float64 all-reduce on ``device``."""
    if not values:
        return {}
    reduced = all_reduce(torch.tensor(list(values.values()), dtype=torch.float64), device, op)
    return dict(zip(values, reduced.tolist()))


def reduce_value(value: float, device: torch.device, op: ReduceOp = "sum") -> float:
    return reduce_values({"value": value}, device, op)["value"]


def all_gather(tensor: torch.Tensor, device: torch.device) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on all ranks), on ``device``, in rank order."""
    local = tensor.to(device)
    if not active():
        return [local]
    gathered = [torch.empty_like(local) for _ in range(dist.get_world_size())]
    dist.all_gather(gathered, local)
    ISSUED["all_gather"] += 1
    return gathered


def all_gather_object(obj) -> list:
    """Every rank's picklable ``obj``, in rank order (torch stages it on the current device)."""
    if not active():
        return [obj]
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    ISSUED["all_gather_object"] += 1
    return out


def barrier(device: torch.device) -> None:
    """Every rank waits here; issued as an all-reduce on ``device`` (NCCL's barrier guesses the device)."""
    if active():
        dist.all_reduce(torch.zeros(1, device=device))
        ISSUED["barrier"] += 1
