"""Alerts as code and the monitoring manifests: the committed rule file, its promtool unit tests and the
Kubernetes objects are what platform/mlplat/observability/{alerts,monitoring}.py generate; every rule
names only catalogue metrics; promtool (Debian's `prometheus` package, which `make test` installs)
checks the rules and runs the tests (each alert fires on its input series and stays quiet on healthy
ones); the PodMonitors, PrometheusRule and dashboard ConfigMaps validate against the prometheus-operator
CRDs. Whether each rule's expression returns a series on real metrics: tests/test_observability_prometheus.py.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from mlplat.cli import main as cli_main
from mlplat.cluster.validate import MONITORING_CRD_FILES, prometheus_operator_schemas_dir, validate_document, validate_paths
from mlplat.observability import alerts, monitoring
from mlplat.observability import catalogue as c
from mlplat.observability.dashboards import DASHBOARDS

ROOT = Path(__file__).resolve().parents[1]
ALERTS, MONITORING = ROOT / "alerts", ROOT / "cluster_configs" / "monitoring"
PROMTOOL = shutil.which("promtool")
OPERATOR_SCHEMAS = prometheus_operator_schemas_dir()  # $MLPLAT_PROMETHEUS_OPERATOR_SCHEMAS, else ../shared/schemas/prometheus-operator


def need_promtool() -> str:
    if PROMTOOL is None:
        if os.environ.get("CI") == "true":  # CI installs it (make test): missing there is a broken run, not a skip
            pytest.fail("promtool is not installed under CI=true (Debian: apt-get install prometheus; `make test` does it)")
        pytest.skip("promtool is not installed (Debian: apt-get install prometheus; `make test` does it where apt works)")
    return PROMTOOL


needs_operator_crds = pytest.mark.skipif(
    not all((OPERATOR_SCHEMAS / f).is_file() for f in MONITORING_CRD_FILES.values()),
    reason=f"prometheus-operator CRDs not at {OPERATOR_SCHEMAS} (set MLPLAT_PROMETHEUS_OPERATOR_SCHEMAS to their folder)",
)


def test_committed_rules_and_manifests_are_current(capsys):
    """Regenerate with `mlplat alerts export` when this fails."""
    for name, text in alerts.rendered().items():
        assert (ALERTS / name).read_text() == text, f"alerts/{name} is stale: run `mlplat alerts export`"
    for name, text in monitoring.manifests((ALERTS / alerts.RULES_FILE).read_text()).items():
        assert (MONITORING / name).read_text() == text, f"cluster_configs/monitoring/{name} is stale: run `mlplat alerts export`"
    cli_main(["alerts", "export", "--out", str(ALERTS), "--monitoring-out", str(MONITORING), "--check"])
    assert "5 files up to date" in capsys.readouterr().out


def test_export_cli_writes_and_checks(tmp_path, capsys):
    cli_main(["alerts", "export", "--out", str(tmp_path / "a"), "--monitoring-out", str(tmp_path / "m")])
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == sorted(alerts.rendered())
    assert (tmp_path / "m" / "prometheusrule.yaml").read_text() == (MONITORING / "prometheusrule.yaml").read_text()
    (tmp_path / "a" / alerts.RULES_FILE).write_text("groups: []\n")
    with pytest.raises(SystemExit) as exit_:
        cli_main(["alerts", "export", "--out", str(tmp_path / "a"), "--monitoring-out", str(tmp_path / "m"), "--check"])
    assert exit_.value.code == 1 and "stale" in capsys.readouterr().err


def test_rules_name_only_catalogue_metrics_and_each_alert_has_both_cases():
    assert alerts.check_rules() == []
    known = c.exported_series() | c.RAY_SERIES
    committed = yaml.safe_load((ALERTS / alerts.RULES_FILE).read_text())
    for group in committed["groups"]:
        for rule in group["rules"]:
            named = alerts.series_in(rule["expr"])
            assert named <= known, f"{rule.get('alert') or rule['record']}: {sorted(named - known)} not in the catalogue"
            assert all(s.startswith("ray_") for s in named)
    # The alerts the issue asks for, and promtool cases for each: one that fires, one that stays quiet.
    names = {a.name for a in alerts.alerts()}
    assert names >= {"MlplatTrainingStraggler", "MlplatTrainingRankHung", "MlplatTrainingJobRestarting", "MlplatNodeFailedAcceptance",
                     "MlplatNodeQuarantined", "MlplatHealthReportStale", "MlplatServeTTFTBurnRateFast", "MlplatServeTTFTBurnRateSlow",
                     "MlplatServeITLBurnRateFast", "MlplatServeITLBurnRateSlow", "MlplatServeKVCacheNearFull", "MlplatServe5xxRate",
                     "MlplatServe429Rate", "MlplatServeReplicaRestarts"}  # fmt: skip
    tests = yaml.safe_load((ALERTS / alerts.TESTS_FILE).read_text())["tests"]
    for name in names:
        outcomes = [bool(t["alert_rule_test"][0]["exp_alerts"]) for t in tests if t["alert_rule_test"][0]["alertname"] == name]
        assert True in outcomes and False in outcomes, name
    # A rule naming a series nothing exports is refused.
    bad = alerts.Alert("Bad", "max(ray_mlplat_no_such_metric)", "> 1", "s", "m", cases=alerts.alerts()[0].cases)
    saved = alerts.GROUPS
    try:
        alerts.GROUPS = (alerts.Group("g", (bad,)),)
        assert any("ray_mlplat_no_such_metric" in p for p in alerts.check_rules())
    finally:
        alerts.GROUPS = saved


def test_slo_thresholds_sit_on_bucket_boundaries():
    for slo in alerts.SLOS:
        assert slo.threshold_s in slo.metric.boundaries
    assert alerts.le_label(c.SERVE_TTFT, 2.5) == "2.5"
    with pytest.raises(ValueError, match="not a bucket boundary"):
        alerts.le_label(c.SERVE_TTFT, 2.0)
    with pytest.raises(ValueError, match="not a bucket boundary"):
        alerts.slo_error_ratio(alerts.LatencySLO("ttft", c.SERVE_TTFT, 0.3), "5m")
    with pytest.raises(ValueError, match="histogram"):
        alerts.le_label(c.SERVE_KV_USAGE, 0.5)
    # Burn-rate pairs: a long and a short window, both recorded.
    rules = {r["record"]: r["expr"] for g in alerts.rules_file()["groups"] for r in g["rules"] if "record" in r}
    for slo in alerts.SLOS:
        for window in ("5m", "30m", "1h", "6h"):
            assert f'le="{alerts.le_label(slo.metric, slo.threshold_s)}"' in rules[alerts.slo_record(slo, window)]


def test_promtool_checks_and_unit_tests_the_rules(tmp_path):
    promtool = need_promtool()
    check = subprocess.run([promtool, "check", "rules", alerts.RULES_FILE], cwd=ALERTS, capture_output=True, text=True, timeout=60)
    assert check.returncode == 0, check.stdout + check.stderr
    assert f"SUCCESS: {sum(len(g.rules) for g in alerts.GROUPS)} rules found" in check.stdout
    run = subprocess.run([promtool, "test", "rules", alerts.TESTS_FILE], cwd=ALERTS, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    # The tests can fail: with every expectation inverted (quiet <-> fires), every one of them does.
    inverted = yaml.safe_load((ALERTS / alerts.TESTS_FILE).read_text())
    for test in inverted["tests"]:
        step = test["alert_rule_test"][0]
        step["exp_alerts"] = [] if step["exp_alerts"] else [{"exp_labels": {"severity": "warning"}}]
    shutil.copy(ALERTS / alerts.RULES_FILE, tmp_path)
    (tmp_path / "inverted.yml").write_text(yaml.safe_dump(inverted))
    run = subprocess.run([promtool, "test", "rules", "inverted.yml"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    report = run.stdout + run.stderr
    assert report.count("    name: ") == len(inverted["tests"]), report[-3000:]


def test_prometheus_rule_is_the_tested_rule_file():
    rule = yaml.safe_load((MONITORING / "prometheusrule.yaml").read_text())
    assert rule["kind"] == "PrometheusRule"
    assert rule["spec"]["groups"] == yaml.safe_load((ALERTS / alerts.RULES_FILE).read_text())["groups"]


def test_monitoring_manifests_shape():
    head, workers = yaml.safe_load_all((MONITORING / "podmonitors.yaml").read_text())
    for monitor, node_type in ((head, "head"), (workers, "worker")):
        assert monitor["kind"] == "PodMonitor" and monitor["spec"]["selector"]["matchLabels"] == {"ray.io/node-type": node_type}
        assert [e["port"] for e in monitor["spec"]["podMetricsEndpoints"]] == ["metrics"]  # KubeRay's 8080 on every Ray container
    maps = list(yaml.safe_load_all((MONITORING / "grafana-dashboards.yaml").read_text()))
    assert len(maps) == len(DASHBOARDS) and all(m["metadata"]["labels"]["grafana_dashboard"] == "1" for m in maps)
    assert (ROOT / "dashboards" / "serving.json").read_text() in [v for m in maps for v in m["data"].values()]


@needs_operator_crds
def test_monitoring_manifests_validate_against_prometheus_operator_crds():
    assert validate_paths([MONITORING]) == 3 + len(DASHBOARDS)


@needs_operator_crds
@pytest.mark.parametrize(
    "name, index, edit, expected",
    [
        ("podmonitors.yaml", 0, lambda d: d["spec"].update(podMetricEndpoints=[]), "'podMetricEndpoints' was unexpected"),
        ("podmonitors.yaml", 1, lambda d: d["spec"]["podMetricsEndpoints"][0].update(port=8080), "spec.podMetricsEndpoints.0.port"),
        ("prometheusrule.yaml", 0, lambda d: d["spec"]["groups"][0]["rules"][0].update(severity="page"), "'severity' was unexpected"),
        ("prometheusrule.yaml", 0, lambda d: d["spec"]["groups"][0]["rules"][0].pop("expr"), "'expr' is a required"),
        ("grafana-dashboards.yaml", 0, lambda d: d["data"].update(n=1), "data.n"),
    ],
)
def test_validation_names_the_broken_monitoring_field(name, index, edit, expected):
    doc = copy.deepcopy(list(yaml.safe_load_all((MONITORING / name).read_text()))[index])
    assert validate_document(doc, monitoring_schemas_dir=OPERATOR_SCHEMAS) == []
    edit(doc)
    problems = validate_document(doc, monitoring_schemas_dir=OPERATOR_SCHEMAS)
    assert problems and any(expected in p for p in problems), problems
