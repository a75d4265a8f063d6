"""One metric definition, and how a value reaches Prometheus through Ray's metrics.

A :class:`Metric` is declared once in :mod:`mlplat.observability.catalogue`; code records
values with ``TRAIN_LOSS.set(2.3, recipe="sft", run_id=run_id)``. The Ray metric object
behind it is made on first use in each process (Ray needs one per process), so
importing the catalogue costs nothing and recording outside a Ray worker is a no-op.

Ray exports every ``ray.util.metrics`` metric with a ``ray_`` prefix, and (Ray 2.60's
OpenTelemetry exporter) counters with a ``_total`` suffix; histograms become
``_bucket``/``_sum``/``_count`` series. :attr:`Metric.exported` is that name, the one
dashboards and PromQL use. Ray adds its own labels (``NodeAddress``, ``WorkerId``,
``SessionName``, ...); queries aggregate them away with ``sum by``/``max by``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Literal

MetricKind = Literal["counter", "gauge", "histogram"]
RAY_PREFIX = "ray_"
_NAME = re.compile(r"^mlplat_[a-z][a-z0-9_]*$")
# Labels that would make one series per request or per prompt: refused at definition.
FORBIDDEN_LABELS = frozenset({"request_id", "prompt", "user", "text", "trace_id"})

# Grafana's unit ids for the units the catalogue uses.
GRAFANA_UNITS = {
    "seconds": "s",
    "bytes": "bytes",
    "ratio": "percentunit",
    "tokens_per_second": "short",
    "tokens": "short",
    "requests": "short",
    "rows": "short",
    "steps": "short",
    "blocks": "short",
    "1": "short",
}


@dataclass(frozen=True)
class Metric:
    name: str  # as registered with Ray: mlplat_<area>_<what>[_<unit>]
    kind: MetricKind
    unit: str  # a key of GRAFANA_UNITS
    help: str
    labels: tuple[str, ...] = ()
    boundaries: tuple[float, ...] = ()  # histogram bucket upper bounds, ascending
    _ray: dict = field(default_factory=dict, compare=False, repr=False)  # per process: the Ray metric object

    def __post_init__(self):
        if not _NAME.match(self.name) or self.name.endswith("_total"):
            raise ValueError(f"metric name {self.name!r}: want mlplat_<area>_<what>, lowercase, no _total (Ray adds it to counters)")
        if self.unit not in GRAFANA_UNITS:
            raise ValueError(f"metric {self.name}: unit {self.unit!r} is not one of {sorted(GRAFANA_UNITS)}")
        if bad := FORBIDDEN_LABELS.intersection(self.labels):
            raise ValueError(f"metric {self.name}: labels {sorted(bad)} are unbounded (one series per request); log them instead")
        if (self.kind == "histogram") != bool(self.boundaries):
            raise ValueError(f"metric {self.name}: histograms, and only histograms, need boundaries")
        if list(self.boundaries) != sorted(set(self.boundaries)) or any(b <= 0 for b in self.boundaries):
            raise ValueError(f"metric {self.name}: boundaries must be positive and strictly ascending")

    @property
    def exported(self) -> str:
        """The Prometheus name: what a PromQL query names (histograms: plus _bucket/_sum/_count)."""
        return RAY_PREFIX + self.name + ("_total" if self.kind == "counter" else "")

    @property
    def series_names(self) -> tuple[str, ...]:
        if self.kind == "histogram":
            return tuple(f"{self.exported}_{s}" for s in ("bucket", "sum", "count"))
        return (self.exported,)

    @property
    def grafana_unit(self) -> str:
        return GRAFANA_UNITS[self.unit]

    # -- recording -------------------------------------------------------------------------
    def set(self, value: float, **labels: str) -> None:
        self._record("gauge", value, labels)

    def inc(self, value: float = 1.0, **labels: str) -> None:
        if value > 0:  # Ray refuses non-positive increments
            self._record("counter", value, labels)

    def observe(self, value: float, **labels: str) -> None:
        self._record("histogram", value, labels)

    def _record(self, kind: MetricKind, value: float, labels: dict[str, str]) -> None:
        if kind != self.kind:
            raise TypeError(f"metric {self.name} is a {self.kind}, not a {kind}")
        if set(labels) != set(self.labels):
            raise ValueError(f"metric {self.name}: labels {sorted(labels)} given, {sorted(self.labels)} declared")
        ray_metric = self._ray_metric()
        if ray_metric is None:
            return
        tags = {k: str(v) for k, v in labels.items()}
        if kind == "gauge":
            ray_metric.set(float(value), tags=tags)
        elif kind == "counter":
            ray_metric.inc(float(value), tags=tags)
        else:
            ray_metric.observe(float(value), tags=tags)

    def _ray_metric(self):
        import os

        import ray

        if not ray.is_initialized():  # a plain process (a unit test, a CLI before ray.init): nothing to export to
            return None
        pid = os.getpid()  # a forked child must make its own
        if pid not in self._ray:
            from ray.util import metrics

            if self.kind == "gauge":
                made = metrics.Gauge(self.name, self.help, tag_keys=self.labels)
            elif self.kind == "counter":
                made = metrics.Counter(self.name, self.help, tag_keys=self.labels)
            else:
                made = metrics.Histogram(self.name, self.help, boundaries=list(self.boundaries), tag_keys=self.labels)
            self._ray.clear()
            self._ray[pid] = made
        return self._ray[pid]
