"""Where training time goes: a torch profiler trace of a few steps, and a whole-run step-time summary.

``profile: {steps: 3}`` in an SFT config (or ``mlplat profile sft --config ... --steps 3``)
profiles rank 0 for that many steps after ``wait_steps`` (start-up, first-step compilation
and allocator warm-up would otherwise dominate). The Chrome/Perfetto trace goes to the run's
MLflow artifacts under ``profile/`` (open it at https://ui.perfetto.dev or chrome://tracing)
with ``top_operators.txt``, the operators ranked by self time.

:func:`step_time_summary` turns the recipe's per-phase seconds into the fractions a reader
wants first: data, compute (forward + backward), communication, optimizer, other.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from pydantic import Field

from mlplat.config import Config

ARTIFACT_DIR = "profile"
TOP_OPERATORS = "top_operators.txt"


class ProfileConfig(Config):
    steps: int = Field(default=3, gt=0)  # steps recorded
    wait_steps: int = Field(default=2, ge=0)  # steps skipped first (start-up noise), then one warm-up step
    record_shapes: bool = False  # input shapes per operator (bigger trace)
    with_stack: bool = False  # Python stacks per operator (much bigger trace)
    top: int = Field(default=20, gt=0)  # operators listed in top_operators.txt


class StepProfiler:
    """Wraps a training loop's steps: call :meth:`step` after each one; the trace is logged when done."""

    def __init__(self, cfg: ProfileConfig, device: torch.device, logger):
        self.cfg, self.logger, self.done = cfg, logger, False
        self.cuda = device.type == "cuda"
        activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if self.cuda else [])
        schedule = torch.profiler.schedule(wait=cfg.wait_steps, warmup=1, active=cfg.steps, repeat=1)
        self.profiler = torch.profiler.profile(
            activities=activities, schedule=schedule, on_trace_ready=self._save, record_shapes=cfg.record_shapes, with_stack=cfg.with_stack
        )
        self.profiler.start()

    def step(self) -> None:
        if not self.done:
            self.profiler.step()

    def close(self) -> None:
        if not self.done:
            self.profiler.stop()  # fewer steps than the schedule: whatever was recorded is saved
            self.done = True

    def _save(self, prof: torch.profiler.profile) -> None:
        self.done = True
        sort = "self_cuda_time_total" if self.cuda else "self_cpu_time_total"
        table = prof.key_averages().table(sort_by=sort, row_limit=self.cfg.top)
        with tempfile.TemporaryDirectory() as tmp:
            trace = Path(tmp) / "trace.json"
            prof.export_chrome_trace(str(trace))
            (Path(tmp) / TOP_OPERATORS).write_text(
                f"torch profiler, {self.cfg.steps} steps after {self.cfg.wait_steps + 1}, sorted by {sort}\n{table}\n"
            )
            if self.logger:
                self.logger.log_artifacts(tmp, ARTIFACT_DIR)


def step_time_summary(phase_seconds: dict[str, float], step_seconds: float) -> dict[str, float]:
    """Fractions of step time: data, compute (forward + backward), comm, optimizer, other (the rest)."""
    if step_seconds <= 0:
        return {}
    groups = {
        "data": phase_seconds.get("data_wait", 0.0),
        "compute": phase_seconds.get("forward", 0.0) + phase_seconds.get("backward", 0.0),
        "comm": phase_seconds.get("comm", 0.0),
        "optimizer": phase_seconds.get("optimizer", 0.0),
    }
    fractions = {f"step_time_fraction/{k}": v / step_seconds for k, v in groups.items()}
    fractions["step_time_fraction/other"] = max(0.0, 1.0 - sum(fractions.values()))
    return fractions
