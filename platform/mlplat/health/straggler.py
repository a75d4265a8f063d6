"""Straggler detection: a rank consistently slower than the others (after MegaScale's straggler detection).

Each log window, every rank contributes its *local* seconds per step: the phases in which
it does not wait for its peers. Synchronous data parallelism evens out whole step times
(a fast rank waits in the collectives for the slow one), so step times cannot tell who is
slow; the time spent outside the collectives can. A rank is slow in a window when its
local time exceeds the median of the other ranks' by more than ``margin`` (and by at
least ``min_excess_s``); it is flagged as a straggler after ``windows`` slow windows in a
row, so a single hiccup (a GC pause, a noisy neighbour) raises nothing.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from pydantic import Field

from mlplat.config import Config


class StragglerConfig(Config):
    enabled: bool = True
    margin: float = Field(default=0.25, gt=0)  # slow: local time > (1 + margin) x the other ranks' median
    min_excess_s: float = Field(default=0.0, ge=0)  # and at least this many seconds more per step (ignore noise on tiny steps)
    windows: int = Field(default=3, gt=0)  # consecutive slow log windows before a rank is flagged
    action: Literal["log", "stop"] = "log"  # stop: fail the job so that Ray Train restarts it (FailureConfig.max_failures)


class StragglerError(RuntimeError):
    """Raised on every rank when a straggler is flagged and the policy is ``stop``."""


@dataclass
class StragglerVerdict:
    """One window: each rank's local time over the other ranks' median, and who is flagged."""

    slowdowns: list[float]
    flagged: list[int] = field(default_factory=list)  # ranks slow for ``windows`` windows or more in a row
    newly_flagged: list[int] = field(default_factory=list)  # of those, the ones that reached it in this window


class StragglerDetector:
    """Pure logic over per-rank seconds, one call per window; the same inputs give the same verdict on every rank."""

    def __init__(self, cfg: StragglerConfig):
        self.cfg = cfg
        self.slow_streak: list[int] = []

    def observe(self, seconds: Sequence[float]) -> StragglerVerdict:
        if len(self.slow_streak) != len(seconds):
            self.slow_streak = [0] * len(seconds)
        verdict = StragglerVerdict(slowdowns=[1.0] * len(seconds))
        if len(seconds) < 2:
            return verdict  # nobody to compare with
        for rank, mine in enumerate(seconds):
            others = statistics.median([s for r, s in enumerate(seconds) if r != rank])
            verdict.slowdowns[rank] = mine / others if others > 0 else 1.0
            slow = mine > (1.0 + self.cfg.margin) * others and mine - others >= self.cfg.min_excess_s
            self.slow_streak[rank] = self.slow_streak[rank] + 1 if slow else 0
            if self.slow_streak[rank] >= self.cfg.windows:
                verdict.flagged.append(rank)
                if self.slow_streak[rank] == self.cfg.windows:
                    verdict.newly_flagged.append(rank)
        return verdict
