"""Scraping a Ray cluster with Prometheus: the service-discovery file and a scrape config.

Ray's dashboard process writes ``<session dir>/prom_metrics_service_discovery.json``
(Prometheus file_sd: every node's metrics-agent address, plus the dashboard's and the
autoscaler's) and refreshes it every few seconds; Ray's own ``prometheus.yml`` scrapes
through it. A cluster started without the dashboard (``include_dashboard=False``, as the
tests do) still runs each node's metrics agent but writes no such file:
:func:`service_discovery_file` then writes the same content from ``ray.nodes()``.
"""

from __future__ import annotations

import json
from pathlib import Path

SD_FILE = "prom_metrics_service_discovery.json"  # ray._private.ray_constants.PROMETHEUS_SERVICE_DISCOVERY_FILE


def ray_session_dir() -> Path:
    """The connected (driver-side) Ray's session directory."""
    from ray._private.worker import global_worker  # Ray 2.60 has no public getter for the session dir

    return Path(global_worker.node.get_session_dir_path())


def metrics_targets() -> list[str]:
    """host:port of every alive node's metrics agent (what Ray's discovery file lists per node)."""
    import ray

    return [f"{n['NodeManagerAddress']}:{n['MetricsExportPort']}" for n in ray.nodes() if n["Alive"] and n.get("MetricsExportPort")]


def service_discovery_file(out_dir: str | Path | None = None) -> Path:
    """Ray's service-discovery file if its dashboard writes one, else an equivalent file in ``out_dir``."""
    ray_file = ray_session_dir() / SD_FILE
    if ray_file.is_file():
        return ray_file
    path = Path(out_dir or ray_session_dir()) / SD_FILE
    path.write_text(json.dumps([{"labels": {"job": "ray"}, "targets": metrics_targets()}]))
    return path


def scrape_config(sd_file: str | Path, scrape_interval: str = "10s") -> str:
    """A prometheus.yml scraping the Ray cluster through ``sd_file`` (Ray's template, interval adjustable)."""
    return (
        "global:\n"
        f"  scrape_interval: {scrape_interval}\n"
        f"  evaluation_interval: {scrape_interval}\n"
        "scrape_configs:\n"
        "  - job_name: ray\n"
        "    file_sd_configs:\n"
        f"      - files: ['{Path(sd_file).resolve()}']\n"
        "        refresh_interval: 5s\n"
    )
