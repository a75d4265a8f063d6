"""End to end through a real Prometheus: it scrapes the test Ray cluster (Ray's service-discovery
file format), the session's SFT run (profiled; tests/conftest.py) and a small PD serving app emit metrics, and every panel
of the training and serving dashboards returns data through Prometheus' HTTP API. Also: the step-time
summary and the profiler trace land in MLflow, and a request id travels from the client through
prefill and decode and back in error bodies.

The same live Prometheus checks the alert rules (alerts/mlplat.rules.yml): every alert's expression
without its threshold, and every recording rule's, returns a series on these real metrics (the
cluster-health ones come from the health exporter actor, which the test hands a report to), so no
rule watches a series nothing exports. And every query of every dashboard panel returns data on its own.

Needs Debian's `prometheus` binary (`make test` installs it where apt works); skipped otherwise.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient
from ray import serve

from mlplat.health import exporter
from mlplat.health.report import CollectiveReport, HealthReport, LinkReport, NodeReport
from mlplat.observability import alerts
from mlplat.observability import catalogue as c
from mlplat.observability.dashboards import HEALTH, RL, SERVING, TRAINING
from mlplat.observability.profiling import ARTIFACT_DIR, TOP_OPERATORS
from mlplat.observability.prometheus import ray_session_dir
from mlplat.serve.config import ServeConfig
from serve_apps.llm import build_app

ENGINE = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4, "max_waiting": 4}
SMALL = {"num_cpus": 0.2}
# What Grafana substitutes into the committed queries: "All" for every variable, a rate window.
GRAFANA_VARIABLES = {"$run_id": ".*", "$model": ".*", "$node": ".*", "$__rate_interval": "30s"}


def _query_range(url: str, expr: str, start: float) -> list[float]:
    r = httpx.get(f"{url}/api/v1/query_range", params={"query": expr, "start": start, "end": time.time(), "step": 2}, timeout=30)
    assert r.status_code == 200, (expr, r.text)
    return [float(v) for series in r.json()["data"]["result"] for _, v in series["values"]]


def _queries_without_data(url: str, dashboard, start: float) -> list[str]:
    """Every query of every panel, each on its own: a panel whose second query is empty shows half a story."""
    empty = []
    for panel in dashboard.to_grafana()["panels"]:
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(var, value)
            if not [v for v in _query_range(url, expr, start) if not math.isnan(v)]:
                empty.append(f"{dashboard.uid} / {panel['title']} / {target['refId']}")
    return empty


def _rules_without_series(url: str, start: float) -> list[str]:
    """Alerts whose expression without its threshold (recorded series inlined), and recording rules, that return no
    series carrying the labels they group by (an alert's labels: `by (application, deployment)` of nothing is one empty set)."""
    probes = {a.name: alerts.inline_records(a.probe) for a in alerts.alerts()} | alerts.records()
    missing = []
    for name, expr in probes.items():
        r = httpx.get(f"{url}/api/v1/query_range", params={"query": expr, "start": start, "end": time.time(), "step": 2}, timeout=30)
        assert r.status_code == 200, (name, expr, r.text)
        by = re.search(r"\bby \(([^)]*)\)", expr)
        labels = {label.strip() for label in by.group(1).split(",")} if by else set()
        result = r.json()["data"]["result"]
        if not [s for s in result if labels <= set(s["metric"]) and not all(math.isnan(float(v)) for _, v in s["values"])]:
            missing.append(name)
    return missing


def _health_report() -> HealthReport:
    """What `mlplat health check` hands the exporter actor, for this cluster's node (its measurements: tests/test_health_check.py)."""
    import ray

    node = next(n for n in ray.nodes() if n["Alive"])
    return HealthReport(profile="cpu-test", started_at=time.strftime("%Y%m%d-%H%M%S"), duration_s=1.0,
                        nodes=[NodeReport(node_id=node["NodeID"], ip=node["NodeManagerAddress"], metrics={"cpu_matmul_gflops": 100.0})],
                        collective=CollectiveReport(backend="gloo", ranks=2, size_mb=1, busbw_gbps=1.0),
                        links=[LinkReport(nodes=(node["NodeID"], "peer-node"), backend="gloo", ranks=2, size_mb=1, seconds=0.1,
                                          busbw_gbps=0.01)])  # fmt: skip


def _post(url: str, **kwargs) -> httpx.Response:
    # Where several Ray clusters share a machine (developers' runs), their Serve proxies share port
    # 8000 and a connection can land on another cluster's proxy, which knows no /obs route: retry those.
    for _ in range(20):
        r = httpx.post(url, timeout=60, **kwargs)
        if not (r.status_code == 404 and r.text.startswith("Path ")):
            return r
        time.sleep(0.2)
    return r


def _requests(base: str, request_id: str) -> None:
    body = {"model": "tiny", "prompt": "What is 12 + 34?", "max_tokens": 6, "temperature": 0}
    for i in range(3):
        r = _post(f"{base}/v1/completions", json=body, headers={"X-Request-Id": f"{request_id}-{i}"})
        assert r.status_code == 200, r.text
        assert r.headers.get_list("x-request-id") == [f"{request_id}-{i}"]  # Serve's proxy echoes it, once
    r = _post(f"{base}/v1/completions", json={**body, "stream": True})
    assert r.status_code == 200 and "[DONE]" in r.text
    bad = _post(f"{base}/v1/completions", json={**body, "temperature": -1}, headers={"X-Request-Id": f"{request_id}-bad"})
    assert bad.status_code == 400 and bad.json()["error"]["request_id"] == f"{request_id}-bad"


@pytest.mark.slow
def test_dashboards_show_training_and_serving_through_prometheus(prometheus, sft_run, tiny_model, tmp_path):
    # Prometheus first, then the session's SFT run (profiled, two bad rows: conftest.py) on a cluster with
    # nothing else placed, as the default test order has it: its 2 workers and data pipeline need all 4 CPUs.
    if sft_run.started < prometheus.started:
        pytest.skip("the session's SFT run ran before Prometheus started: run this module before tests/test_sft.py (the default order)")
    start, result, tracking_uri = prometheus.started, sft_run.result, sft_run.tracking_uri
    request_id = f"obs-{uuid.uuid4().hex[:8]}"

    app = build_app(ServeConfig(model=str(tiny_model), model_name="tiny", mode="pd", engine_args=ENGINE,
                                prefill=SMALL, decode=SMALL, ingress=SMALL, app_name="obs", route_prefix="/obs"))  # fmt: skip
    serve.run(app, name="obs", route_prefix="/obs")
    exporter.publish(_health_report())  # the cluster-health gauges, held by the detached exporter actor
    base = "http://127.0.0.1:8000/obs"
    try:
        _requests(base, request_id)
        # Replicas report to their node's metrics agent every few seconds and rates need an increase
        # between two scrapes: keep sending small batches until every query and rule has data (or give up).
        # The RL dashboard needs a GRPO run, which this suite does not run under Prometheus: only its panels
        # shared with SFT (step time by phase, loss) are checked.
        shared = (c.TRAIN_STEP_PHASE_SECONDS.name, c.TRAIN_LOSS.name)
        rl_shared = [f"{RL.uid} / {p.title} / A" for p in RL.panels if p.queries[0].metric.name in shared]

        def missing_data() -> list[str]:
            rl = [q for q in _queries_without_data(prometheus.url, RL, start) if q in rl_shared]
            dashboards = [q for d in (TRAINING, SERVING, HEALTH) for q in _queries_without_data(prometheus.url, d, start)]
            return dashboards + rl + _rules_without_series(prometheus.url, start)

        deadline, batch = time.monotonic() + 90, 0
        while (missing := missing_data()) and time.monotonic() < deadline:
            time.sleep(3)
            batch += 1
            _requests(base, f"{request_id}-{batch}")
        assert missing == []

        # The request id reached both engine deployments: Serve stamps it on their replicas' log lines.
        logs = ray_session_dir() / "logs" / "serve"
        for deployment in ("prefill", "decode"):
            text = "".join(p.read_text(errors="replace") for p in logs.glob(f"replica_obs_{deployment}_*.log"))
            assert f"{request_id}-0" in text, deployment
    finally:
        serve.delete("obs")
        prometheus.stop()  # nothing after this test reads it; its scrapes would cost the rest of the suite CPU

    # Profiling and the step-time summary are in the run.
    client = MlflowClient(tracking_uri)
    artifacts = {a.path for a in client.list_artifacts(result.run_id, ARTIFACT_DIR)}
    assert artifacts == {f"{ARTIFACT_DIR}/trace.json", f"{ARTIFACT_DIR}/{TOP_OPERATORS}"}
    trace = json.loads(Path(client.download_artifacts(result.run_id, f"{ARTIFACT_DIR}/trace.json", str(tmp_path))).read_text())
    assert any(e.get("name", "").startswith("aten::") for e in trace["traceEvents"])
    top = Path(client.download_artifacts(result.run_id, f"{ARTIFACT_DIR}/{TOP_OPERATORS}", str(tmp_path))).read_text()
    assert "aten::" in top and "Self CPU" in top
    metrics = client.get_run(result.run_id).data.metrics
    fractions = {k: v for k, v in metrics.items() if k.startswith("step_time_fraction/")}
    assert set(fractions) == {f"step_time_fraction/{k}" for k in ("data", "compute", "comm", "optimizer", "other")}
    assert sum(fractions.values()) == pytest.approx(1.0, abs=1e-6) and fractions["step_time_fraction/compute"] > 0
    assert metrics["data/bad_rows"] == 2
