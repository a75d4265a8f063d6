"""The metrics catalogue, the committed Grafana dashboards generated from it, their provisioning,
structured logs, the step-time summary and engine-step profiling. Fast: no Ray cluster; the tiny
model only for `mlplat profile engine`, whose subprocess (imports, a new MLflow store) takes most of the time."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import ClassVar

import httpx
import mlflow
import pytest
import yaml
from conftest import MLPLAT
from fastapi import Request

from mlplat.cli import main as cli_main
from mlplat.errors import MlplatError
from mlplat.observability import CATALOGUE, Metric, exported_series
from mlplat.observability import catalogue as c
from mlplat.observability.dashboards import DASHBOARDS, render, series_in, validate_dashboard
from mlplat.observability.logs import REQUEST_ID, JsonFormatter, RequestIdMiddleware, configure_logging
from mlplat.observability.profiling import step_time_summary
from mlplat.observability.provisioning import DATASOURCE_UID, FOLDER_UID, install, write_provisioning
from mlplat.observability.serving import rejection_reason

COMMITTED = Path(__file__).resolve().parents[1] / "dashboards"


# -- catalogue ---------------------------------------------------------------------------------
def test_catalogue_names_are_unique_and_know_their_prometheus_names():
    assert len(CATALOGUE) >= 30 and all(name.startswith("mlplat_") for name in CATALOGUE)
    # Ray 2.60 exports ray.util.metrics with a ray_ prefix; its OpenTelemetry exporter adds _total to counters.
    assert c.TRAIN_LOSS.exported == "ray_mlplat_train_loss"
    assert c.SERVE_REQUESTS.exported == "ray_mlplat_serve_requests_total"
    assert c.SERVE_TTFT.series_names == tuple(f"ray_mlplat_serve_time_to_first_token_seconds_{s}" for s in ("bucket", "sum", "count"))
    assert len(exported_series()) == sum(len(m.series_names) for m in CATALOGUE.values())
    for m in CATALOGUE.values():
        assert not set(m.labels) & {"request_id", "prompt"}, m.name  # low cardinality only


def test_metric_definitions_refuse_mistakes():
    with pytest.raises(ValueError, match="unbounded"):
        Metric("mlplat_x_latency_seconds", "histogram", "seconds", "h", ("request_id",), (0.1,))
    with pytest.raises(ValueError, match="no _total"):
        Metric("mlplat_x_requests_total", "counter", "requests", "h")
    with pytest.raises(ValueError, match="boundaries"):
        Metric("mlplat_x_seconds", "histogram", "seconds", "h")
    with pytest.raises(ValueError, match="unit"):
        Metric("mlplat_x", "gauge", "furlongs", "h")
    with pytest.raises(TypeError, match="is a gauge"):
        c.TRAIN_LOSS.inc(1, recipe="sft", run_id="r")
    with pytest.raises(ValueError, match="labels"):
        c.TRAIN_LOSS.set(1.0, recipe="sft")  # run_id missing: refused even where nothing is exported


# -- dashboards --------------------------------------------------------------------------------
def test_committed_dashboards_are_current():
    """Regenerate with `mlplat dashboards export` when this fails."""
    for name, dashboard in DASHBOARDS.items():
        path = COMMITTED / f"{name}.json"
        assert path.is_file(), f"{path} missing: run `mlplat dashboards export`"
        assert path.read_text() == render(dashboard), f"{path} is stale: run `mlplat dashboards export`"
    assert sorted(p.stem for p in COMMITTED.glob("*.json")) == sorted(DASHBOARDS)


def test_committed_dashboards_name_only_catalogue_metrics_and_cover_it():
    known, used = exported_series(), set()
    for name in DASHBOARDS:
        model = json.loads((COMMITTED / f"{name}.json").read_text())
        for panel in model["panels"]:
            for target in panel["targets"]:
                named = series_in(target["expr"])
                assert named, (name, panel["title"], target["expr"])
                assert named <= known, f"{name} / {panel['title']}: {sorted(named - known)} not in the catalogue"
                used |= named
    unused = [m.name for m in CATALOGUE.values() if not set(m.series_names) & used]
    assert not unused, f"metrics no dashboard shows: {unused}"


def test_committed_dashboards_follow_grafanas_model():
    for name in DASHBOARDS:
        model = json.loads((COMMITTED / f"{name}.json").read_text())
        assert validate_dashboard(model) == [], name
        assert model["uid"].startswith("mlplat-") and model["schemaVersion"] >= 36
        assert {v["name"] for v in model["templating"]["list"]} >= {"datasource"}


def test_dashboard_validation_catches_broken_models():
    model = json.loads((COMMITTED / "serving.json").read_text())
    model["panels"][0]["gridPos"]["w"] = 30  # wider than the 24-column grid
    model["panels"][1]["id"] = model["panels"][2]["id"]
    model["panels"][3]["targets"].append(dict(model["panels"][3]["targets"][0]))  # refId repeated
    model["panels"][4]["targets"][0]["expr"] += " + on() vector($undefined_var)"
    del model["schemaVersion"]
    model["uid"] = "x" * 41
    problems = "\n".join(validate_dashboard(model))
    for expected in ("gridPos", "repeated", "refIds", "$undefined_var", "schemaVersion", "uid"):
        assert expected in problems, expected


def test_export_cli_writes_and_checks(tmp_path, capsys):
    cli_main(["dashboards", "export", "--out", str(tmp_path)])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(f"{n}.json" for n in DASHBOARDS)
    cli_main(["dashboards", "export", "--out", str(tmp_path), "--check"])
    (tmp_path / "serving.json").write_text("{}")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["dashboards", "export", "--out", str(tmp_path), "--check"])
    assert exit_.value.code == 1 and "stale dashboards" in capsys.readouterr().err


# -- provisioning ------------------------------------------------------------------------------
def test_file_provisioning_standalone(tmp_path):
    written = write_provisioning(tmp_path / "grafana", "http://prom:9090")
    root = (tmp_path / "grafana").resolve()
    ini = (root / "grafana.ini").read_text()
    assert f"provisioning = {root / 'provisioning'}" in ini and "allow_embedding = true" in ini
    provider = yaml.safe_load((root / "provisioning" / "dashboards" / "mlplat.yml").read_text())["providers"][0]
    assert provider["type"] == "file" and provider["folderUid"] == FOLDER_UID
    dashboards = Path(provider["options"]["path"])
    assert sorted(p.stem for p in dashboards.glob("*.json")) == sorted(DASHBOARDS)
    assert (dashboards / "training.json").read_text() == (COMMITTED / "training.json").read_text()
    source = yaml.safe_load(written["datasources"].read_text())["datasources"][0]
    assert source == {
        **source,
        "type": "prometheus",
        "url": "http://prom:9090",
        "uid": DATASOURCE_UID,
        "isDefault": True,
        "access": "proxy",
    }


def test_file_provisioning_beside_rays_own(tmp_path):
    """Into the directory Ray's dashboard writes (<session>/metrics/grafana): Ray's files stay as they were."""
    root = tmp_path / "metrics" / "grafana"
    (root / "provisioning" / "datasources").mkdir(parents=True)
    (root / "provisioning" / "dashboards").mkdir()
    (root / "dashboards").mkdir()
    ray_ini = "[paths]\nprovisioning = /somewhere/provisioning\n"
    (root / "grafana.ini").write_text(ray_ini)
    ray_source = {
        "apiVersion": 1,
        "datasources": [{"name": "Prometheus", "type": "prometheus", "isDefault": True, "url": "http://localhost:9090"}],
    }
    (root / "provisioning" / "datasources" / "default.yml").write_text(yaml.safe_dump(ray_source))
    write_provisioning(root, "http://localhost:9090")
    assert (root / "grafana.ini").read_text() == ray_ini
    ours = yaml.safe_load((root / "provisioning" / "datasources" / "mlplat.yml").read_text())["datasources"][0]
    assert ours["isDefault"] is False  # Grafana refuses two default data sources in one org
    assert not list((root / "dashboards").iterdir())  # Ray's provider scans that directory: ours live elsewhere
    assert len(list((root / "mlplat").glob("*.json"))) == len(DASHBOARDS)


class _RecordingGrafana(BaseHTTPRequestHandler):
    """Answers the few Grafana API calls `install` makes the way Grafana documents them, and records them.
    A stand-in: no Grafana server runs on the test machines (see docs/observability.md)."""

    calls: ClassVar[list] = []

    def _reply(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self.calls.append(("GET", self.path, self.headers.get("Authorization"), None))
        self._reply(404, {"message": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.calls.append(("POST", self.path, self.headers.get("Authorization"), body))
        if self.path == "/api/dashboards/db":
            uid = body["dashboard"]["uid"]
            self._reply(200, {"status": "success", "uid": uid, "url": f"/d/{uid}/x", "version": 1})
        else:
            self._reply(200, {"message": "created", "id": 1, "uid": body.get("uid")})

    def log_message(self, *args):
        pass


def test_install_through_the_http_api(monkeypatch):
    server = ThreadingHTTPServer(("127.0.0.1", 0), _RecordingGrafana)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        monkeypatch.delenv("GRAFANA_TOKEN", raising=False)
        with pytest.raises(MlplatError, match=r"\$GRAFANA_TOKEN is empty"):
            install(url)
        monkeypatch.setenv("GRAFANA_TOKEN", "glsa_secret")
        urls = install(url, prometheus_url="http://prom:9090")
    finally:
        server.shutdown()
    calls = _RecordingGrafana.calls
    assert all(auth == "Bearer glsa_secret" for _, _, auth, _ in calls)
    posts = {(path, (body.get("dashboard") or {}).get("uid", body.get("uid"))): body for method, path, _, body in calls if method == "POST"}
    assert posts[("/api/datasources", DATASOURCE_UID)]["url"] == "http://prom:9090"
    assert ("/api/folders", FOLDER_UID) in posts
    for dashboard in DASHBOARDS.values():
        body = posts[("/api/dashboards/db", dashboard.uid)]
        assert body["overwrite"] is True and body["folderUid"] == FOLDER_UID and body["dashboard"] == dashboard.to_grafana()
    assert urls == [f"{url}/d/{d.uid}/x" for d in DASHBOARDS.values()]


# -- logs, request ids, summaries --------------------------------------------------------------
def test_json_logs_carry_request_and_run_ids(capsys):
    logger = configure_logging(json_format=True, logger="mlplat.test_obs")
    token = REQUEST_ID.set("req-abc")
    try:
        logger.info("hello %s", "world", extra={"run_id": "run-1"})
    finally:
        REQUEST_ID.reset(token)
        logger.handlers.clear()
    line = json.loads(capsys.readouterr().err.strip().splitlines()[-1])
    assert line["message"] == "hello world" and line["request_id"] == "req-abc" and line["run_id"] == "run-1"
    assert line["level"] == "INFO" and line["logger"] == "mlplat.test_obs" and line["ts"].endswith("Z")
    record = logging.LogRecord("x", logging.ERROR, __file__, 1, "boom", None, None)
    assert "request_id" not in json.loads(JsonFormatter().format(record))  # absent, not empty


def test_request_id_middleware_honours_the_header():
    import asyncio

    from fastapi import FastAPI

    app = FastAPI()
    statuses = []
    app.add_middleware(RequestIdMiddleware, on_response=statuses.append)

    @app.get("/id")
    async def which(request: Request):
        return {"state": request.state.request_id, "context": REQUEST_ID.get()}

    async def calls():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return (await client.get("/id", headers={"X-Request-Id": "client-42"})).json(), (await client.get("/id")).json()

    given, fresh = asyncio.run(calls())
    assert given == {"state": "client-42", "context": "client-42"}
    assert len(fresh["state"]) == 32 and fresh["context"] == fresh["state"]
    assert statuses == [200, 200]


def test_rejection_reasons_are_a_fixed_set():
    assert rejection_reason(401, "invalid_api_key") == "unauthorized"
    assert rejection_reason(429, "rate_limit_exceeded") == "rate_limited"
    assert rejection_reason(400, "context_length_exceeded") == "context_length"
    assert rejection_reason(400, None) == "invalid_request" and rejection_reason(500, None) == "internal_error"


def test_step_time_summary():
    summary = step_time_summary({"data_wait": 1.0, "forward": 2.0, "backward": 4.0, "comm": 1.0, "optimizer": 1.0}, 10.0)
    assert summary == pytest.approx({
        "step_time_fraction/data": 0.1, "step_time_fraction/compute": 0.6, "step_time_fraction/comm": 0.1,
        "step_time_fraction/optimizer": 0.1, "step_time_fraction/other": 0.1,
    })  # fmt: skip
    assert step_time_summary({}, 0.0) == {}


# -- engine profiling --------------------------------------------------------------------------
@pytest.mark.slow  # a fresh interpreter runs the CLI end to end: `make test`, not the fast lane
def test_profile_engine_logs_a_trace_and_prints_the_top_operators(tiny_model, tracking_uri, tmp_path):
    args = ["profile", "engine", "--model", str(tiny_model), "--steps", "2", "--wait-steps", "1", "--prompts", "4", "--max-tokens", "16"]
    env = os.environ | {"MLFLOW_TRACKING_URI": tracking_uri}
    out = subprocess.run([MLPLAT, *args, "--set", "num_kv_blocks=64"], capture_output=True, text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    assert "aten::" in out.stdout and "profile/trace.json" in out.stdout

    client = mlflow.MlflowClient(tracking_uri)
    [run] = client.search_runs([client.get_experiment_by_name("mlplat-profile").experiment_id])
    assert run.data.tags["mlplat.profile.target"] == "engine" and run.data.params["engine.num_kv_blocks"] == "64"
    # 4 sequences, one token each per step: 1 skipped + 1 warm-up + 2 recorded steps.
    assert run.data.metrics["profile/recorded_steps"] == 2 and run.data.metrics["profile/tokens_generated"] == 16
    assert run.data.metrics["profile/mean_step_s"] > 0
    trace = json.loads(Path(client.download_artifacts(run.info.run_id, "profile/trace.json", str(tmp_path))).read_text())
    assert trace["traceEvents"]
    assert "aten::" in Path(client.download_artifacts(run.info.run_id, "profile/top_operators.txt", str(tmp_path))).read_text()


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        (["--model", "/nowhere"], "/nowhere: model directory not found"),
        (["--steps", "0"], "--steps must be > 0"),
        (["--set", "no_such_field=1"], "no_such_field: unknown field"),
    ],
)
def test_profile_engine_refuses_bad_input_in_one_line(flags, message, tiny_model, tracking_uri, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli_main(["profile", "engine", "--model", str(tiny_model), *flags])  # a later --model wins
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("mlplat: error: ") and message in err and err.count("\n") == 1
