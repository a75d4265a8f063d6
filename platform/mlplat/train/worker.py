"""Where a recipe's loop runs: what it reads (device, data shard, checkpoint to restore) and where its
results go (metrics, checkpoints), as one ``WorkerEnv``.

A recipe's loop is one function of its config and a ``WorkerEnv``, called on every rank of a
process group. Ray Train launches it with ``mlplat.train.recipe.RayWorkerEnv`` (datasets streamed by
Ray Data, checkpoints reported to Ray Train, metrics to MLflow); ``run_local`` launches it under
plain ``torch.distributed`` with ``LocalWorkerEnv`` (rows in memory, checkpoints in a directory,
metrics in a JSONL file), so the loop itself can be tested in seconds, and checked on a GPU machine
that has no Ray. This module imports neither Ray nor MLflow.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import socket
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mlplat import collectives


class MetricsLog(Protocol):
    """Where rank 0's metrics and tags go (``mlplat.tracking.RunLogger`` under Ray)."""

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None: ...

    def set_tags(self, tags: dict) -> None: ...


class DataShard(Protocol):
    """This rank's part of a dataset: Ray Data's ``DataIterator`` or ``RowShard``."""

    def iter_torch_batches(self, *, batch_size: int, collate_fn: Callable | None, drop_last: bool,
                           local_shuffle_buffer_size: int | None, local_shuffle_seed: int | None) -> Iterator: ...  # fmt: skip


class WorkerEnv(Protocol):
    run_id: str
    tracking_uri: str | None  # MLflow, for what a rank records outside the loop's metrics (a hang's stacks); None: nowhere
    device: torch.device
    logger: MetricsLog | None  # rank 0 only
    restore_from: Any  # the checkpoint to start from (a restart's latest, or resume_from): a directory or a Ray Train Checkpoint
    restarted: bool  # this attempt restores the run's own latest checkpoint after a failure
    start_time: float  # when the job was submitted (time.time()), for time-to-first-step

    def dataset_shard(self, name: str) -> DataShard: ...

    def save_checkpoint(self, metrics: dict[str, float], write: Callable[[Path], None]) -> None:
        """Every rank calls ``write(directory)`` for its part of the checkpoint at ``metrics["step"]``."""
        ...

    def node(self) -> dict[str, str]:
        """This rank's node: ``node_id`` and ``ip``."""
        ...


@contextmanager
def checkpoint_directory(checkpoint) -> Iterator[Path]:
    """A checkpoint (directory or Ray Train ``Checkpoint``) as a local directory for the ``with`` block."""
    if isinstance(checkpoint, (str, Path)):
        with nullcontext(Path(checkpoint)) as directory:
            yield directory
    else:
        with checkpoint.as_directory() as directory:
            yield Path(directory)


class RowShard:
    """Rows held in memory as this rank's shard: every ``world_size``-th row from ``rank``, cut to the same
    count on every rank, batched as Ray Data's numpy batches (a dict of columns) for the collate function."""

    def __init__(self, rows: Sequence[dict], rank: int, world_size: int):
        per_rank = len(rows) // world_size
        self.rows = list(rows[rank::world_size][:per_rank])

    def iter_torch_batches(self, *, batch_size, collate_fn, drop_last, local_shuffle_buffer_size, local_shuffle_seed) -> Iterator:
        rows = list(self.rows)
        if local_shuffle_buffer_size:
            random.Random(local_shuffle_seed).shuffle(rows)  # the whole shard: a buffer as large as the data
        stop = len(rows) - len(rows) % batch_size if drop_last else len(rows)
        for start in range(0, stop, batch_size):
            chunk = rows[start : start + batch_size]
            columns = {key: [row[key] for row in chunk] for key in chunk[0]}
            yield collate_fn(columns) if collate_fn else {k: torch.as_tensor(np.stack(v)) for k, v in columns.items()}


@dataclass
class JsonlLog:
    """Rank 0's metrics as JSON lines (``{"step": ..., **metrics}``) and its tags, kept in memory too."""

    path: Path
    records: list[dict] = field(default_factory=list)
    tags: dict = field(default_factory=dict)

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        record = {"step": step, **metrics}
        self.records.append(record)
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def set_tags(self, tags: dict) -> None:
        self.tags.update(tags)

    @staticmethod
    def read(path: Path) -> list[dict]:
        return [json.loads(line) for line in Path(path).read_text().splitlines()] if Path(path).is_file() else []


class LocalWorkerEnv:
    """One rank of a plain ``torch.distributed`` run: data from rows in memory, checkpoints under
    ``storage/checkpoint_<step>`` (every rank writes its own files into the one directory; the oldest
    beyond ``num_to_keep`` are removed), metrics in ``storage/metrics.jsonl``."""

    def __init__(self, storage: Path, datasets: dict[str, Sequence[dict]], device: torch.device,
                 restore_from: Path | None = None, num_to_keep: int | None = None, run_id: str = "local"):  # fmt: skip
        self.storage, self.datasets, self.device = Path(storage), datasets, device
        self.restore_from, self.restarted, self.num_to_keep = restore_from, False, num_to_keep
        self.run_id, self.tracking_uri, self.start_time = run_id, None, time.time()
        self.logger = JsonlLog(self.storage / "metrics.jsonl") if collectives.rank() == 0 else None

    def dataset_shard(self, name: str) -> RowShard:
        return RowShard(self.datasets[name], collectives.rank(), collectives.world_size())

    def save_checkpoint(self, metrics: dict[str, float], write: Callable[[Path], None]) -> None:
        directory = self.storage / f"checkpoint_{int(metrics['step']):06d}"
        directory.mkdir(parents=True, exist_ok=True)
        write(directory)
        collectives.barrier(self.device)  # complete on every rank before an old one goes
        if collectives.rank() == 0 and self.num_to_keep:
            for old in local_checkpoints(self.storage)[: -self.num_to_keep]:
                shutil.rmtree(old)

    def node(self) -> dict[str, str]:
        host = socket.gethostname()
        return {"node_id": host, "ip": socket.gethostbyname(host) if host else "127.0.0.1"}


def local_checkpoints(storage: Path) -> list[Path]:
    """A local run's checkpoints, oldest first."""
    return sorted(Path(storage).glob("checkpoint_*"))


@dataclass
class LocalRun:
    storage: Path
    metrics: list[dict]  # rank 0's logged metrics, in order
    checkpoints: list[Path]  # oldest first


def run_local(loop: Callable, cfg, world_size: int, storage: str | Path, datasets: dict[str, Sequence[dict]],
              restore_from: str | Path | None = None, backend: str = "gloo", timeout_s: float = 600) -> LocalRun:  # fmt: skip
    """Run ``loop(cfg, env)`` on ``world_size`` processes of a fresh ``torch.distributed`` group on this
    machine (gloo on CPU; NCCL puts rank r on ``cuda:r``), without Ray. ``loop`` must be importable by name."""
    with LocalGroup(world_size, backend, timeout_s) as group:
        return group.run(loop, cfg, storage, datasets, restore_from)


class LocalGroup:
    """``world_size`` processes on this machine that run loops one after another, each run on a fresh
    ``torch.distributed`` group. The processes are spawned once, so each pays Python's, torch's and the
    recipes' imports once (seconds per process), not once per run: many short runs (the loop-level tests)
    cost what their steps cost. A run that fails on any rank stops every process (the others may be
    waiting on it in a collective) and raises; the next run spawns new ones."""

    def __init__(self, world_size: int, backend: str = "gloo", timeout_s: float = 600):
        self.world_size, self.backend, self.timeout_s = world_size, backend, timeout_s
        self.processes: list = []

    def __enter__(self) -> LocalGroup:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self) -> None:
        context = mp.get_context("spawn")
        self.jobs, self.results = [context.Queue() for _ in range(self.world_size)], context.Queue()
        rank_args = [(r, self.world_size, self.backend, self.timeout_s, self.jobs[r], self.results) for r in range(self.world_size)]
        self.processes = [context.Process(target=_group_rank, args=args, daemon=True) for args in rank_args]
        for process in self.processes:
            process.start()

    def run(self, loop: Callable, cfg, storage: str | Path, datasets: dict[str, Sequence[dict]],
            restore_from: str | Path | None = None) -> LocalRun:  # fmt: skip
        """``loop(cfg, env)`` on every rank, as ``run_local``; returns when every rank has finished."""
        if not self.processes:
            self._start()
        storage = Path(storage)
        storage.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as rendezvous:
            for jobs in self.jobs:
                jobs.put((loop, cfg, storage, datasets, restore_from and Path(restore_from), Path(rendezvous) / "store"))
            failure = self._wait()
        if failure:
            self.close()
            raise RuntimeError(f"{getattr(loop, '__name__', loop)} failed: {failure}")
        return LocalRun(storage, JsonlLog.read(storage / "metrics.jsonl"), local_checkpoints(storage))

    def _wait(self) -> str | None:
        """None once every rank has reported success; else the first failure (a rank's traceback, or a process gone)."""
        import queue

        finished = 0
        while finished < self.world_size:
            try:
                rank, error = self.results.get(timeout=1.0)
            except queue.Empty:
                gone = [p for p in self.processes if not p.is_alive()]
                if gone:
                    return f"rank process {gone[0].pid} exited with code {gone[0].exitcode}"
                continue
            if error:
                return f"on rank {rank}:\n{error}"
            finished += 1
        return None

    def close(self) -> None:
        for jobs in getattr(self, "jobs", []):
            jobs.put(None)
        for process in self.processes:
            process.join(timeout=5)
            if process.is_alive():
                process.kill()
                process.join()
        self.processes = []


def _group_rank(rank: int, world_size: int, backend: str, timeout_s: float, jobs, results) -> None:
    import traceback
    from datetime import timedelta

    device = torch.device(f"cuda:{rank}") if backend == "nccl" else torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the ranks share this machine's cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world_size))
    while (job := jobs.get()) is not None:
        loop, cfg, storage, datasets, restore_from, store = job
        try:
            timeout = timedelta(seconds=timeout_s)
            dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world_size, timeout=timeout)
            try:
                loop(cfg, LocalWorkerEnv(storage, datasets, device, restore_from, getattr(cfg, "num_checkpoints_to_keep", None)))
            finally:
                dist.destroy_process_group()
        except BaseException:
            results.put((rank, traceback.format_exc()))
            return
        results.put((rank, None))
