"""Observability: the metrics catalogue (catalogue.py, metrics.py), Grafana dashboards generated from it
(dashboards.py) and their provisioning (provisioning.py), Prometheus scraping of a Ray cluster
(prometheus.py), torch profiler traces of training and engine steps (profiling.py), structured logs (logs.py)."""

from mlplat.observability.catalogue import CATALOGUE, exported_series
from mlplat.observability.metrics import Metric

__all__ = ["CATALOGUE", "Metric", "exported_series"]
