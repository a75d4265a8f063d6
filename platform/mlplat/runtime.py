"""Connecting to Ray: a real cluster by address, or the embedded local one."""

from __future__ import annotations

import os

import ray
import ray.data


def local_system_config(num_cpus: int) -> dict:
    """Raylet settings for a local cluster: keep idle worker processes warm.

    By default the raylet keeps at most ``num_cpus`` worker processes, actors included,
    and kills idle ones after 1 s. A Ray Train job alone runs ~8 actors (controller, workers,
    dataset coordinator, ...), so on a small machine every data task of every job started
    a fresh process and re-imported torch and transformers (measured: a second SFT job in
    a session took 62 s, 38 s with warm workers). Idle workers cost memory (~0.5 GB each
    with torch loaded), hence a bound.
    """
    return {"num_workers_soft_limit": 3 * num_cpus, "idle_worker_killing_time_threshold_ms": 300_000}


def init_ray(address: str | None = None, num_training_workers: int = 2, progress_bars: bool = False, **ray_init_kwargs) -> str | None:
    """Connect to ``address`` or start a local cluster; returns the dashboard URL if we started one.

    A local cluster advertises at least ``num_training_workers + 2`` logical CPUs: the
    training workers hold one each, and the data pipeline's tasks must still be
    schedulable beside them even on a 2-core laptop (they share the cores).
    """
    ray.data.DataContext.get_current().enable_progress_bars = progress_bars
    if ray.is_initialized():
        return None
    if address:
        return ray.init(address=address, **ray_init_kwargs).dashboard_url
    num_cpus = max(os.cpu_count() or 1, num_training_workers + 2)
    return ray.init(num_cpus=num_cpus, _system_config=local_system_config(num_cpus), **ray_init_kwargs).dashboard_url
