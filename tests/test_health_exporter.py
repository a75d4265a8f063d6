"""The health check's results outlive the check: the detached exporter actor holds the last report's gauges
and its timestamp, on the session's Ray cluster, and exports them through the node's metrics agent
(what Prometheus scrapes); a restarted actor exports the same report again."""

from __future__ import annotations

import re
import time

import httpx
import pytest
import ray

from mlplat.health import exporter
from mlplat.health.report import CollectiveReport, HealthReport, LinkReport, NodeReport
from mlplat.observability import catalogue as c
from mlplat.observability.prometheus import metrics_targets


def report(passed: bool = True) -> HealthReport:
    nodes = [NodeReport(node_id="exporter-test-node-a", metrics={"cpu_matmul_gflops": 120.0}),
             NodeReport(node_id="exporter-test-node-b", metrics={"cpu_matmul_gflops": 40.0},
                        failures=[] if passed else ["slow"])]  # fmt: skip
    return HealthReport(profile="cpu-test", started_at="20261205-120000", duration_s=3.0, nodes=nodes,
                        collective=CollectiveReport(backend="gloo", ranks=2, size_mb=1, busbw_gbps=1.5),
                        links=[LinkReport(nodes=("exporter-test-node-a", "exporter-test-node-b"), backend="gloo", ranks=2, size_mb=1,
                                          seconds=0.1, busbw_gbps=0.25, failures=[] if passed else ["slow"])])  # fmt: skip


def scraped(name: str, timeout_s: float = 45.0) -> dict[str, float]:
    """``name``'s samples on the nodes' metrics agents, by their label text, once every expected one is there."""
    pattern = re.compile(rf"^{name}\{{([^}}]*)\}} (\S+)$", re.M)
    deadline, found = time.monotonic() + timeout_s, {}
    while time.monotonic() < deadline:
        found = {}
        for target in metrics_targets():
            text = httpx.get(f"http://{target}/metrics", timeout=10).text
            found |= {labels: float(value) for labels, value in pattern.findall(text)}
        if found:
            return found
        time.sleep(2)
    return found


def test_exporter_holds_the_last_report_and_survives_a_restart(ray_cluster):
    finished = time.time() - 120  # the report finished two minutes ago
    exporter.publish(report(passed=False), finished_at=finished)
    held = exporter.last_report()
    assert held["finished_at"] == finished and held["age_s"] >= 120
    assert [n["node_id"] for n in held["report"]["nodes"]] == ["exporter-test-node-a", "exporter-test-node-b"]
    actor = ray.get_actor(exporter.ACTOR_NAME, namespace=exporter.ACTOR_NAMESPACE)

    # Through Ray's metrics: the agent's /metrics page, what the PodMonitors (and the suite's Prometheus) scrape.
    passed = scraped(c.HEALTH_NODE_PASSED.exported)
    verdicts = {m.group(1): v for labels, v in passed.items() if (m := re.search(r'node="(exporter-test-node-[ab])"', labels))}
    assert verdicts == {"exporter-test-node-a": 1.0, "exporter-test-node-b": 0.0}
    assert list(scraped(c.HEALTH_REPORT_TIMESTAMP.exported).values()) == [pytest.approx(finished)]
    figures = {m.group(1): v for labels, v in scraped(c.HEALTH_MEASUREMENT.exported).items()
               if 'measurement="cpu_matmul_gflops"' in labels and (m := re.search(r'node="(exporter-test-node-[ab])"', labels))}
    assert figures == {"exporter-test-node-a": 120.0, "exporter-test-node-b": 40.0}
    pair = ('node="exporter-test-node-a"', 'peer="exporter-test-node-b"')
    assert [v for labels, v in scraped(c.HEALTH_PAIR_BUSBW.exported).items() if all(p in labels for p in pair)] == [0.25]
    pair_passed = [v for labels, v in scraped(c.HEALTH_PAIR_PASSED.exported).items() if all(p in labels for p in pair)]
    assert pair_passed == [0.0]  # the report named the link between them
    quarantined = scraped(c.HEALTH_NODE_QUARANTINED.exported)
    assert {v for labels, v in quarantined.items() if "exporter-test-node" in labels} == {0.0}  # known to the check, not quarantined

    # A restarted actor (node failure, OOM) exports the same report, with its original timestamp.
    first_pid = held["pid"]
    ray.kill(actor, no_restart=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            held = exporter.last_report(timeout_s=10)
            if held is None or held["pid"] != first_pid:
                break
        except ray.exceptions.RayActorError:
            pass
        time.sleep(1)
    assert held is not None and held["pid"] != first_pid and held["finished_at"] == finished

    # The next check replaces it.
    exporter.publish(report(passed=True))
    assert exporter.last_report()["age_s"] < 60 and all(n["failures"] == [] for n in exporter.last_report()["report"]["nodes"])
