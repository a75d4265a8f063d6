"""Connecting to Ray: a real cluster by address, or the embedded local one."""

from __future__ import annotations

import os

import ray
import ray.data


def init_ray(address: str | None = None, num_training_workers: int = 2, progress_bars: bool = False) -> str | None:
    """Connect to ``address`` or start a local cluster; returns the dashboard URL if we started one.

    A local cluster advertises at least ``num_training_workers + 2`` logical CPUs: the
    training workers hold one each, and the data pipeline's tasks must still be
    schedulable beside them even on a 2-core laptop (they share the cores).
    """
    ray.data.DataContext.get_current().enable_progress_bars = progress_bars
    if ray.is_initialized():
        return None
    num_cpus = None if address else max(os.cpu_count() or 1, num_training_workers + 2)
    return ray.init(address=address, num_cpus=num_cpus).dashboard_url
