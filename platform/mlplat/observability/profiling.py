"""Where time goes: a torch profiler trace of a few training or engine steps, and a whole-run step-time summary.

``profile: {steps: 3}`` in an SFT config (``--set profile.steps=3`` on the command line)
profiles rank 0 for that many steps after ``wait_steps`` (start-up, first-step compilation
and allocator warm-up would otherwise dominate). The Chrome/Perfetto trace goes to the run's
MLflow artifacts under ``profile/`` (open it at https://ui.perfetto.dev or chrome://tracing)
with ``top_operators.txt``, the operators ranked by self time.

:func:`profile_engine` (``mlplat profile engine --model ...``) does the same for the native
inference engine's steps, with the same schedule. An engine step mixes prefill chunks and
decodes, so the first steps are prefill-heavy and later ones pure decode: ``wait_steps``
picks which the trace shows. The first step is never recorded (skipped or the warm-up), so a
prefill that fits one step's token budget is not in the trace; a smaller
``max_num_batched_tokens`` spreads it over several.

:func:`step_time_summary` turns the recipe's per-phase seconds into the fractions a reader
wants first: data, compute (forward + backward), communication, optimizer, other.
"""

from __future__ import annotations

import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from pydantic import Field

from mlplat.config import Config

if TYPE_CHECKING:  # the engine and tokenizer stay unimported for training workers that only profile steps
    from transformers import PreTrainedTokenizerBase

    from mlplat.engine import LLMEngine, RequestOutput, SamplingParams
    from mlplat.tracking import RunLogger

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
        self.report: str | None = None  # the top_operators.txt text, once the trace is saved
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
            self.report = f"torch profiler, {self.cfg.steps} steps after {self.cfg.wait_steps + 1}, sorted by {sort}\n{table}\n"
            (Path(tmp) / TOP_OPERATORS).write_text(self.report)
            if self.logger:
                self.logger.log_artifacts(tmp, ARTIFACT_DIR)


@dataclass(frozen=True)
class EngineProfile:
    """What :func:`profile_engine` measured. Step times include the profiler's overhead: compare them only with each other."""

    engine_steps: int  # steps run, skipped and warm-up ones included
    recorded_steps: int  # fewer than ProfileConfig.steps when the requests ran out first
    mean_step_seconds: float | None  # over the recorded steps; None if none was recorded
    tokens_generated: int  # over all steps run
    top_operators: str | None  # the top_operators.txt text; None if the requests ran out before recording began


def synthetic_prompts(tokenizer: PreTrainedTokenizerBase, count: int, length: int, seed: int = 0) -> list[list[int]]:
    """``count`` random token-id prompts of ``length`` tokens, no special tokens, the same for the same seed.

    Random, hence distinct: prefix caching cannot skip their prefill as it would for repeated text."""
    vocab = torch.arange(len(tokenizer))
    allowed = vocab[~torch.isin(vocab, torch.tensor(tokenizer.all_special_ids, dtype=torch.long))]
    picks = torch.randint(len(allowed), (count, length), generator=torch.Generator().manual_seed(seed))
    return allowed[picks].tolist()


def profile_engine(
    engine: LLMEngine, prompts: list[str | list[int]], params: SamplingParams, cfg: ProfileConfig, logger: RunLogger | None = None
) -> EngineProfile:
    """Submit ``prompts``, then step the engine under :class:`StepProfiler`: ``cfg.wait_steps`` skipped,
    one warm-up, ``cfg.steps`` recorded. The trace and top operators go to ``logger`` under ``profile/``
    with the ``profile/*`` metrics.

    Steps stop when the schedule completes or the requests run out (whatever was recorded is saved);
    the prompts' unfinished requests are then aborted, so none outlives the call. Each sequence gains
    one token per step (more with speculative decoding), so ``ignore_eos=True`` and ``max_tokens`` of at
    least ``wait_steps + 1 + steps`` record every step."""
    schedule_steps = cfg.wait_steps + 1 + cfg.steps
    request_ids: list[str] = []
    finished: list[RequestOutput] = []
    step_seconds: list[float] = []
    try:
        for prompt in prompts:
            request_ids.append(engine.add_request(prompt, params))
        profiler = StepProfiler(cfg, torch.device(engine.cfg.device), logger)
        try:
            while len(step_seconds) < schedule_steps and engine.has_unfinished:
                start = time.perf_counter()
                finished += engine.step()
                # step() ends by reading the sampled tokens on the host, so on GPU this waits for the step's kernels;
                # taken before profiler.step(), which may export the trace.
                step_seconds.append(time.perf_counter() - start)
                profiler.step()
        finally:
            profiler.close()
        ours = set(request_ids)
        tokens = sum(len(c.sampled_token_ids) for out in finished if out.request_id in ours for c in out.outputs)
        tokens += sum(seq.num_output_tokens for rid in request_ids for seq in engine.requests.get(rid, []))
    finally:
        for rid in request_ids:
            engine.abort(rid)  # a no-op for finished ones
    recorded = step_seconds[cfg.wait_steps + 1 :]
    result = EngineProfile(
        engine_steps=len(step_seconds),
        recorded_steps=len(recorded),
        mean_step_seconds=sum(recorded) / len(recorded) if recorded else None,
        tokens_generated=tokens,
        top_operators=profiler.report,
    )
    if logger:
        metrics = {
            "profile/engine_steps": result.engine_steps,
            "profile/recorded_steps": result.recorded_steps,
            "profile/tokens_generated": result.tokens_generated,
        }
        if result.mean_step_seconds is not None:
            metrics["profile/mean_step_s"] = result.mean_step_seconds
        logger.log_metrics(metrics)
    return result


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
