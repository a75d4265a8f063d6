"""A node's local ranks: one process per GPU, each seeing every GPU of the node, run by the node's probe.

Ray Train's ``share_cuda_visible_devices`` gives every worker on a node the node's whole
``CUDA_VISIBLE_DEVICES`` and lets each pick its device by local rank: NCCL then sees the node's
NVLink/NVSwitch topology and every peer GPU, which it needs for peer-to-peer transfers and NVLS.
Masking each process to its one GPU (an actor per GPU with ``num_gpus=1``) hides the peers, and NCCL
falls back to slower paths or fails on NVSwitch machines. So the health check runs one probe actor per
node that holds all of the node's GPUs (``num_gpus`` = its GPUs); the probe's own process is local rank
0 and starts local ranks 1..L-1 as child processes, which inherit its ``CUDA_VISIBLE_DEVICES``; local
rank r uses device r. On a CPU node L = 1: the probe alone.

Every local rank runs this module's functions on request (:meth:`LocalRanks.run`): one GPU's
measurements, and a timed all-reduce in a process group (the node alone, a pair of nodes, the
whole cluster) named by its rendezvous address, the node's first global rank and the world size.
The all-reduce goes through :mod:`mlplat.collectives`, which keeps the buffer on the
group's device (NCCL refuses CPU tensors).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from datetime import timedelta
from multiprocessing.connection import Client, Connection, Listener
from typing import Any

import torch
import torch.distributed as dist

from mlplat.health import measurements
from mlplat.health.hardware import MeasurementSizes
from mlplat import collectives

_AUTHKEY_ENV = "MLPLAT_HEALTH_RANK_AUTHKEY"


def device_for(local_rank: int, backend: str) -> torch.device:
    return torch.device("cuda", local_rank) if backend == "nccl" else torch.device("cpu")


def timed_all_reduce(
    local_rank: int,
    init_method: str,
    first_rank: int,
    world_size: int,
    backend: str,
    size_mb: int,
    trials: int,
    timeout_s: float,
    slowdown: float = 1.0,
) -> float:
    """Seconds of this rank's (global rank ``first_rank + local_rank``) fastest all-reduce of ``size_mb`` MiB
    of fp32 across the group, after one untimed warm-up that also sets up the connections. ``slowdown``: test
    hook, stretches each timed trial with a sleep inside the timed loop (every rank of the group gets the same
    factor)."""
    device = device_for(local_rank, backend)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend, init_method=init_method, rank=first_rank + local_rank, world_size=world_size, timeout=timeout)
    try:
        tensor = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32, device=device)
        sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
        seconds = measurements.best_seconds(lambda: collectives.all_reduce_(tensor, device), trials, slowdown, sync)
        # The figure counts only if the group reduced: one more all-reduce of ones must give the world size.
        check = collectives.all_reduce_(torch.ones(4, device=device), device)
        if not bool((check == world_size).all()):
            raise RuntimeError(f"all-reduce of ones over {world_size} ranks gave {check.tolist()}")
        return seconds
    finally:
        dist.destroy_process_group()


def measure_gpu(local_rank: int, sizes: MeasurementSizes, slowdown: float = 1.0) -> dict[str, Any]:
    """This rank's GPU: its figures, NVML faults and facts (``nvml``: "ok" or what is missing)."""
    device = torch.device("cuda", local_rank)
    torch.cuda.set_device(device)
    gpu = measurements.GpuHealth(device)  # watching for XIDs from before the load starts
    metrics = measurements.gpu_figures(device, sizes, slowdown)
    faults = gpu.faults()
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "")
    ids = [v for v in visible.split(",") if v]
    return {
        "id": ids[local_rank] if local_rank < len(ids) else str(local_rank),  # the node's numbering
        "name": torch.cuda.get_device_name(device),
        "metrics": metrics,
        "faults": faults,
        **gpu.facts,
    }


def describe(local_rank: int) -> dict[str, Any]:
    """What this rank sees: its pid, its local rank and the node's devices (a test reads it)."""
    return {
        "pid": os.getpid(),
        "local_rank": local_rank,
        "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
        "cuda_devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
    }


class LocalRanks:
    """``count`` local ranks of this node: this process (local rank 0) and ``count - 1`` children it starts
    (``python -m mlplat.health.ranks``, on first use), which see this process's environment and devices.
    A call that fails or times out on any rank stops the children (the others may be stuck in a
    collective waiting on it); the next call starts new ones."""

    def __init__(self, count: int, threads: int = 1, start_timeout_s: float = 120.0):
        if count < 1:
            raise ValueError("LocalRanks: count must be at least 1")
        self.count, self.threads, self.start_timeout_s = count, threads, start_timeout_s
        self._processes: list[subprocess.Popen] = []
        self._conns: list[Connection] = []

    def __enter__(self) -> LocalRanks:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def run(self, fn: Callable[..., Any], wait_s: float = 600.0, **kwargs) -> list[Any]:
        """``fn(local_rank=r, **kwargs)`` on every local rank at once (``fn`` a module-level function); the
        results in local-rank order. Raises ``RuntimeError`` naming the first rank that failed."""
        if self.count > 1 and not self._conns:
            self._start()
        for conn in self._conns:
            conn.send((fn, kwargs))
        results: list[Any] = [None] * self.count
        failure = None
        try:
            results[0] = fn(local_rank=0, **kwargs)
        except Exception:  # noqa: BLE001 -- reported with the children's outcome below
            failure = f"local rank 0: {traceback.format_exc(limit=3)}"
        deadline = time.monotonic() + wait_s
        for index, conn in enumerate(self._conns, start=1):
            if failure:
                break
            if not conn.poll(max(0.0, deadline - time.monotonic())):
                failure = f"local rank {index} did not answer within {wait_s:g} s"
                break
            try:
                ok, value = conn.recv()
            except EOFError:
                failure = f"local rank {index} exited (code {self._processes[index - 1].poll()})"
                break
            if not ok:
                failure = f"local rank {index}: {value}"
                break
            results[index] = value
        if failure:
            self.close(kill=True)  # the others may wait in the collective until its timeout: no point waiting for them
            raise RuntimeError(failure)
        return results

    def _start(self) -> None:
        authkey = os.urandom(16)
        listener = Listener(("127.0.0.1", 0), authkey=authkey)
        host, port = listener.address
        env = {**os.environ, _AUTHKEY_ENV: authkey.hex(), "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
        accepted: dict[int, Connection] = {}

        def accept() -> None:
            try:
                while len(accepted) < self.count - 1:
                    conn = listener.accept()
                    accepted[conn.recv()] = conn  # each child says which local rank it is
            except OSError:  # the listener was closed: start-up timed out
                pass

        try:
            for local_rank in range(1, self.count):
                argv = [sys.executable, "-m", "mlplat.health.ranks", host, str(port), str(local_rank), str(self.threads)]
                self._processes.append(subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL))
            acceptor = threading.Thread(target=accept, daemon=True)
            acceptor.start()
            deadline = time.monotonic() + self.start_timeout_s
            while acceptor.is_alive() and time.monotonic() < deadline:
                if exited := [p for p in self._processes if p.poll() is not None]:
                    raise RuntimeError(f"a local rank process exited at start-up with code {exited[0].returncode}")
                acceptor.join(0.1)
            if len(accepted) < self.count - 1:
                raise RuntimeError(f"{self.count - 1 - len(accepted)} local rank processes did not start within {self.start_timeout_s:g} s")
            self._conns = [accepted[r] for r in range(1, self.count)]
        except BaseException:
            self.close(kill=True)
            raise
        finally:
            listener.close()

    def close(self, kill: bool = False) -> None:
        """Stop the children: asked to finish (``kill``: killed at once), killed if they have not within 5 s."""
        for conn in self._conns:
            try:
                conn.send(None)
                conn.close()
            except OSError:
                pass
        for process in self._processes:
            if kill:
                process.kill()
            try:
                process.wait(timeout=5)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
        self._conns, self._processes = [], []


def _serve(host: str, port: int, local_rank: int, threads: int) -> None:
    """A child's loop: run each requested function, send back (ok, result or traceback); stop on None or EOF."""
    torch.set_num_threads(max(1, threads))
    with Client((host, port), authkey=bytes.fromhex(os.environ.pop(_AUTHKEY_ENV))) as conn:
        conn.send(local_rank)
        while True:
            try:
                job = conn.recv()
            except (EOFError, OSError):  # the probe is gone
                return
            if job is None:
                return
            fn, kwargs = job
            try:
                conn.send((True, fn(local_rank=local_rank, **kwargs)))
            except Exception:  # noqa: BLE001 -- the traceback goes to the probe
                conn.send((False, traceback.format_exc(limit=5)))


if __name__ == "__main__":
    from mlplat.health.ranks import _serve as serve  # the importable module's copy, whose functions the probe pickles

    serve(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))
