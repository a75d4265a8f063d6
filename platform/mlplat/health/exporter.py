"""The health check's results, held for Prometheus: a detached Ray actor that outlives the check.

``mlplat health check`` runs for a minute and exits, and a Ray metric lives only as long as the
process that set it. So the check pushes its report to :class:`HealthExporter`, a named,
detached actor on the head node (placed with the head's ``node:__internal_head__`` resource,
no CPU), which sets the cluster-health gauges of the catalogue through Ray's metrics and keeps
them exported: every node's measured figures and verdict, each ring pair's all-reduce bandwidth and
whether the check named its link, the cluster all-reduce bandwidth, the
report's finish time (``mlplat_health_report_timestamp_seconds``: its age is ``time() - that``,
and the ``MlplatHealthReportStale`` alert fires past 26 h), and which nodes are quarantined
(read from the GCS every :data:`REFRESH_S` s, so a straggler's quarantine shows too).

The report is also kept in the GCS key-value store: a restarted actor (``max_restarts=-1``)
exports the last report again, with its original timestamp.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time

import ray
from ray.experimental import internal_kv

from mlplat.health.report import HealthReport

log = logging.getLogger(__name__)

ACTOR_NAME, ACTOR_NAMESPACE = "mlplat-health-exporter", "mlplat"
# Ray's metrics agent drops a gauge not refreshed for two report intervals (2 x 10 s by default): set them all again
# well within that, and read the quarantined nodes from the GCS at the same time.
REFRESH_S = 5.0
_KV_NAMESPACE, _KV_KEY = "mlplat_health", "exporter/last_report"
HEAD_RESOURCE = "node:__internal_head__"


@ray.remote(num_cpus=0, max_restarts=-1, max_task_retries=-1)
class HealthExporter:
    def __init__(self):
        self._lock = threading.Lock()
        self._report: dict | None = None
        self._finished_at: float | None = None
        self._nodes: set[str] = set()
        stored = internal_kv._internal_kv_get(_KV_KEY, namespace=_KV_NAMESPACE)
        if stored:
            kept = json.loads(stored)
            self._apply(kept["report"], kept["finished_at"])
        self._stop = threading.Event()
        threading.Thread(target=self._refresh_loop, name="mlplat-health-exporter", daemon=True).start()

    def publish(self, report: dict, finished_at: float) -> None:
        """Replace the held report (``HealthReport.model_dump(mode="json")``); ``finished_at``: unix time."""
        internal_kv._internal_kv_put(_KV_KEY, json.dumps({"report": report, "finished_at": finished_at}), overwrite=True,
                                     namespace=_KV_NAMESPACE)  # fmt: skip
        self._apply(report, finished_at)

    def last(self) -> dict | None:
        """The held report, its finish time and age, and this process's pid; None before any check."""
        with self._lock:
            if self._report is None:
                return None
            return {"report": self._report, "finished_at": self._finished_at, "age_s": time.time() - self._finished_at, "pid": os.getpid()}

    def _apply(self, report: dict, finished_at: float) -> None:
        with self._lock:
            self._report, self._finished_at = report, finished_at
            self._nodes |= {n["node_id"] for n in report.get("nodes", [])}
        self._set_gauges()

    def _set_gauges(self) -> None:
        from mlplat.health import marking
        from mlplat.observability import catalogue as oc

        with self._lock:
            if self._report is None:
                return
            report, finished_at = HealthReport.model_validate(self._report), self._finished_at
        for node in report.nodes:
            for measurement, value in node.metrics.items():
                oc.HEALTH_MEASUREMENT.set(value, node=node.node_id, measurement=measurement)
            oc.HEALTH_NODE_PASSED.set(float(node.passed), node=node.node_id)
        for link in report.links:
            pair = {"node": link.nodes[0], "peer": link.nodes[1]}
            if link.busbw_gbps:
                oc.HEALTH_PAIR_BUSBW.set(link.busbw_gbps, **pair)
            oc.HEALTH_PAIR_PASSED.set(float(not (link.failures and not link.suspects)), **pair)
        if report.collective and report.collective.busbw_gbps:
            oc.HEALTH_ALLREDUCE_BUSBW.set(report.collective.busbw_gbps)
        oc.HEALTH_REPORT_TIMESTAMP.set(finished_at)
        try:
            quarantined = set(marking.quarantined())
        except Exception as err:  # noqa: BLE001 -- a GCS hiccup: keep the last values, try again next refresh
            log.warning("health exporter: cannot read quarantined nodes: %s", err)
            return
        with self._lock:
            self._nodes |= quarantined
            nodes = sorted(self._nodes)
        for node_id in nodes:
            oc.HEALTH_NODE_QUARANTINED.set(float(node_id in quarantined), node=node_id)

    def _refresh_loop(self) -> None:
        while not self._stop.wait(REFRESH_S):
            try:
                self._set_gauges()
            except Exception:  # noqa: BLE001 -- never let the thread die: the gauges would go stale silently
                log.exception("health exporter: refresh failed")


def exporter() -> ray.actor.ActorHandle:
    """The cluster's exporter actor, started on the head node if it is not running yet (needs ray.init())."""
    options = {"name": ACTOR_NAME, "namespace": ACTOR_NAMESPACE, "lifetime": "detached", "get_if_exists": True}
    if ray.cluster_resources().get(HEAD_RESOURCE):
        options["resources"] = {HEAD_RESOURCE: 0.001}
    return HealthExporter.options(**options).remote()


def publish(report: HealthReport, finished_at: float | None = None, timeout_s: float = 60.0) -> None:
    """Hand ``report`` to the exporter actor, which keeps its gauges exported until the next report."""
    handle = exporter()
    ray.get(handle.publish.remote(report.model_dump(mode="json"), time.time() if finished_at is None else finished_at), timeout=timeout_s)


def last_report(timeout_s: float = 30.0) -> dict | None:
    """What the exporter holds (report, finished_at, age_s), or None: no exporter, or no report yet."""
    try:
        handle = ray.get_actor(ACTOR_NAME, namespace=ACTOR_NAMESPACE)
    except ValueError:
        return None
    return ray.get(handle.last.remote(), timeout=timeout_s)
