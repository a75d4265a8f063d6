"""End to end through a real Prometheus: it scrapes the test Ray cluster (Ray's service-discovery
file format), the session's SFT run (profiled; tests/conftest.py) and a small PD serving app emit metrics, and every panel
of the training and serving dashboards returns data through Prometheus' HTTP API. Also: the step-time
summary and the profiler trace land in MLflow, and a request id travels from the client through
prefill and decode and back in error bodies.

Needs Debian's `prometheus` binary (`make test` installs it where apt works); skipped otherwise.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from pathlib import Path

import httpx
import pytest
from mlflow import MlflowClient
from ray import serve

from mlplat.observability.dashboards import SERVING, TRAINING
from mlplat.observability.profiling import ARTIFACT_DIR, TOP_OPERATORS
from mlplat.observability.prometheus import ray_session_dir
from mlplat.serve.config import ServeConfig
from serve_apps.llm import build_app

ENGINE = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4, "max_waiting": 4}
SMALL = {"num_cpus": 0.2}
# What Grafana substitutes into the committed queries: "All" for every variable, a rate window.
GRAFANA_VARIABLES = {"$run_id": ".*", "$model": ".*", "$__rate_interval": "30s"}


def _query_range(url: str, expr: str, start: float) -> list[float]:
    r = httpx.get(f"{url}/api/v1/query_range", params={"query": expr, "start": start, "end": time.time(), "step": 2}, timeout=30)
    assert r.status_code == 200, (expr, r.text)
    return [float(v) for series in r.json()["data"]["result"] for _, v in series["values"]]


def _panels_without_data(url: str, dashboard, start: float) -> list[str]:
    empty = []
    for panel in dashboard.to_grafana()["panels"]:
        values = []
        for target in panel["targets"]:
            expr = target["expr"]
            for var, value in GRAFANA_VARIABLES.items():
                expr = expr.replace(var, value)
            values += [v for v in _query_range(url, expr, start) if not math.isnan(v)]
        if not values:  # a panel with several queries (e.g. steps and skipped steps) shows data if any has some
            empty.append(panel["title"])
    return empty


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
    base = "http://127.0.0.1:8000/obs"
    try:
        _requests(base, request_id)
        # Replicas report to their node's metrics agent every few seconds and rates need an increase
        # between two scrapes: keep sending small batches until every panel has data (or give up).
        deadline, batch = time.monotonic() + 90, 0
        while (missing := _panels_without_data(prometheus.url, TRAINING, start) + _panels_without_data(prometheus.url, SERVING, start)) and (
            time.monotonic() < deadline
        ):
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
    assert metrics["data.bad_rows"] == 2
