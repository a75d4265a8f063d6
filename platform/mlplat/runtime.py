"""Connecting to Ray: a real cluster by address, or the embedded local one."""

from __future__ import annotations

import os
import socket

import ray
import ray.data

RAY_TRAIN_ACTORS = 8  # a Ray Train job's controller, dataset manager, split coordinator, ... besides its workers


def local_system_config(num_cpus: int) -> dict:
    """Raylet settings for a local cluster: keep idle worker processes warm.

    By default the raylet keeps at most ``num_cpus`` worker processes, actors included,
    and kills idle ones above that after 1 s. A Ray Train job's own actors fill that pool on
    a small machine, so every data task of every job started a fresh process and
    re-imported torch and transformers (measured: a second SFT job in a session took 62 s,
    38 s with warm workers). Room for those actors, and 5 minutes before an idle worker
    above the limit goes; each costs memory (~0.5 GB with torch loaded), hence no more.
    """
    return {"num_workers_soft_limit": num_cpus + RAY_TRAIN_ACTORS, "idle_worker_killing_time_threshold_ms": 300_000}


def init_ray(address: str | None = None, num_training_workers: int = 2, progress_bars: bool = False, **ray_init_kwargs) -> str | None:
    """Connect to ``address`` (or ``RAY_ADDRESS``) or start a local cluster; returns the dashboard URL if we started one.

    A local cluster advertises at least ``num_training_workers + 2`` logical CPUs: the
    training workers hold one each, and the data pipeline's tasks must still be
    schedulable beside them even on a 2-core laptop (they share the cores).
    """
    ray.data.DataContext.get_current().enable_progress_bars = progress_bars
    if ray.is_initialized():
        return None
    address = address or os.environ.get("RAY_ADDRESS")  # set inside a Ray job (ray job submit)
    if address:
        ray.init(address=address, **ray_init_kwargs)
        return None
    num_cpus = max(os.cpu_count() or 1, num_training_workers + 2)
    # Ray Train on one machine, set before the cluster starts so that every process inherits it: nothing here is
    # ever preempted (without this, every job starts a preemption-watcher actor: one more process per job), and
    # polling the workers is cheap, while a checkpoint's report and the end of a run wait for the next poll (2 s).
    os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
    if ray_init_kwargs.get("include_dashboard") is False:
        ray_init_kwargs.setdefault("dashboard_port", unused_port())
    return ray.init(num_cpus=num_cpus, _system_config=local_system_config(num_cpus), **ray_init_kwargs).dashboard_url


def unused_port() -> int:
    """A TCP port nothing listens on now, for a cluster started without a dashboard.

    Such a cluster still advertises ``127.0.0.1:<dashboard_port>`` (default 8265) as its
    state API. When another local cluster serves its dashboard there, every state query
    from this one reaches that cluster: Ray Train's placement-group cleaner then hears that
    the controller of a healthy run does not exist and removes the run's placement group
    (its workers die with "placement group was removed"). A port of its own keeps the
    queries failing plainly, which the cleaner tolerates.
    """
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
