"""Straggler and hang detection wired into a recipe's loop: the ``health:`` and ``debug:`` sections of a recipe.

In the loop, per rank (``env``: the loop's mlplat.train.worker.WorkerEnv)::

    health = RankHealth(cfg.health, cfg.debug, env, recipe)
    every step:        health.inject_faults(step)   (inside the data-wait phase; no-op unless cfg.debug says so)
                       ... the step ...
                       health.step_done()
    every log window:  metrics |= health.end_window(metrics)   (all ranks; may raise StragglerError)
    at the end:        health.close()
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import torch
from pydantic import Field

from mlplat import collectives
from mlplat.config import Config
from mlplat.health import marking
from mlplat.health.hang import HangConfig, HangWatchdog
from mlplat.health.straggler import StragglerConfig, StragglerDetector, StragglerError
from mlplat.observability.catalogue import TRAIN_ATTEMPT_STARTED, TRAIN_RANK_SLOWDOWN
from mlplat.tracking import RunLogger
from mlplat.train.worker import WorkerEnv

log = logging.getLogger("mlplat.health")

# Phases of a step in which a rank waits for nobody (see mlplat.train.step): the data wait, the
# forward (no collective under DDP) and the optimizer. Backward and "comm" hold the collectives
# in which fast ranks wait for slow ones, so they would hide exactly the difference sought.
LOCAL_PHASES = ("data_wait", "forward", "optimizer")
HANG_EXIT_CODE = 75  # the worker process exits with this after a hang; Ray Train sees a dead worker and restarts the group


class TrainingHealthConfig(Config):
    straggler: StragglerConfig = StragglerConfig()
    hang: HangConfig = HangConfig()
    accepted_nodes_only: bool = False  # place workers only on nodes that passed `mlplat health check` (see mlplat.health.marking)


class FaultInjection(Config):
    """Test hooks that make a healthy run misbehave, to exercise the detectors. Leave empty in real runs."""

    step_delay_s: dict[int, float] = Field(default_factory=dict)  # rank -> seconds added to each of its steps (as data wait)
    hang_rank: int | None = None
    hang_at_step: int | None = None  # hang_rank stops before this step in the first attempt (none of this run's checkpoints to restore)


class RankHealth:
    """One rank's straggler detector and hang watchdog; rank 0 reports to MLflow, Prometheus and the log."""

    def __init__(self, cfg: TrainingHealthConfig, debug: FaultInjection, env: WorkerEnv, recipe: str = "sft"):
        self.cfg, self.debug, self.env, self.device, self.logger = cfg, debug, env, env.device, env.logger
        self.recipe = recipe
        self.run_id = env.run_id
        self.rank, self.world_size = collectives.rank(), collectives.world_size()
        self.first_attempt = not env.restarted  # a restart after a failure restores this run's latest checkpoint
        self.detector = StragglerDetector(cfg.straggler)
        self.nodes = collectives.all_gather_object(env.node())
        if self.rank == 0:  # MlplatTrainingJobRestarting: an attempt that restored this run's checkpoint after a failure
            TRAIN_ATTEMPT_STARTED.set(time.time(), recipe=recipe, run_id=self.run_id, restarted=str(env.restarted).lower())
        self.watchdog = None
        if cfg.hang.enabled:
            stacks = Path(tempfile.gettempdir()) / "mlplat-health" / f"{self.run_id}-rank{self.rank}-pid{os.getpid()}-stacks.txt"
            self.watchdog = HangWatchdog(cfg.hang.timeout_s, stacks, self._on_hang).start()

    def inject_faults(self, step: int) -> None:
        """Debug hooks: sleep (a slow rank) or stop for good (a hung rank) before ``step``."""
        if delay := self.debug.step_delay_s.get(self.rank):
            time.sleep(delay)
        if self.debug.hang_rank == self.rank and self.debug.hang_at_step == step and self.first_attempt:
            log.warning("debug.hang_at_step: rank %d hangs before step %d", self.rank, step)
            threading.Event().wait()  # forever: only the hang watchdog ends this

    def step_done(self) -> None:
        if self.watchdog:
            self.watchdog.beat()

    def end_window(self, metrics: dict[str, float], local_s: float | None = None) -> dict[str, float]:
        """Compare this window's local step times across ranks (a collective: call on every rank); metrics for rank 0 to log.

        ``local_s``: this rank's own seconds per step, where the step's phases are not the optimizer loop's
        (an RL step's scoring and training, not its wait for the rollout actors)."""
        if not self.cfg.straggler.enabled or self.world_size == 1:
            return {}
        local_s = sum(metrics[f"time/{p}_s"] for p in LOCAL_PHASES) if local_s is None else local_s
        local = torch.tensor([local_s], dtype=torch.float64)
        seconds = [float(t) for t in collectives.all_gather(local, self.device)]
        verdict = self.detector.observe(seconds)  # the same on every rank: all of them stop together, or none
        if self.rank == 0:
            for rank, slowdown in enumerate(verdict.slowdowns):
                TRAIN_RANK_SLOWDOWN.set(slowdown, recipe=self.recipe, run_id=self.run_id, rank=str(rank), node=self.nodes[rank]["node_id"])
            for rank in verdict.newly_flagged:
                self._report_straggler(rank, verdict.slowdowns[rank], seconds)
        if verdict.flagged and self.cfg.straggler.action == "stop":
            raise StragglerError(
                f"straggler policy 'stop': ranks {verdict.flagged} on nodes {[self.nodes[r]['ip'] for r in verdict.flagged]} were slower "
                f"than the others for {self.cfg.straggler.windows} log windows in a row; failing the job for Ray Train to restart it"
            )
        return {"health/max_rank_slowdown": max(verdict.slowdowns), "health/stragglers": float(len(verdict.flagged))}

    def _report_straggler(self, rank: int, slowdown: float, seconds: list[float]) -> None:
        node = self.nodes[rank]
        message = (
            f"rank {rank} on node {node['ip']} {node['node_id'][:8]}: {slowdown:.2f}x the other ranks' median local step time "
            f"({seconds[rank]:.3g} s) for {self.cfg.straggler.windows} log windows in a row"
        )
        log.warning("straggler: %s", message)
        if self.logger:
            self.logger.set_tags({f"mlplat.health.straggler.rank{rank}": message, "mlplat.health.straggler_node": node["node_id"]})
        if self.cfg.straggler.action == "stop" and self.cfg.accepted_nodes_only:
            marking.quarantine(node["node_id"], f"straggler in MLflow run {self.run_id}: {message}")  # the restart lands elsewhere

    def _on_hang(self, stacks_file: Path) -> None:
        """Runs on the watchdog thread: record the stacks in the run, then end this process for Ray Train to restart the group."""
        message = f"rank {self.rank} on node {self.nodes[self.rank]['ip']}: no step completed for {self.cfg.hang.timeout_s:g} s"
        log.error("hang: %s; stacks in %s", message, stacks_file)
        try:
            if self.env.tracking_uri:
                logger = RunLogger(self.run_id, self.env.tracking_uri)
                logger.client.log_artifact(self.run_id, str(stacks_file), "health/hang")
                logger.set_tags({f"mlplat.health.hang.rank{self.rank}": message})
            time.sleep(self.cfg.hang.exit_grace_s)
        finally:
            logging.shutdown()
            os._exit(HANG_EXIT_CODE)

    def close(self) -> None:
        if self.watchdog:
            self.watchdog.close()

