"""Prometheus alerting and recording rules as code, built from the metrics catalogue (like the dashboards).

One list of rules, :data:`GROUPS`, gives three committed files under ``alerts/``
(``mlplat alerts export``; ``tests/test_alerts.py`` fails when they are stale):

- ``mlplat.rules.yml``: the Prometheus rule file (``rule_files:`` in a prometheus.yml),
  checked by ``promtool check rules``;
- ``mlplat.rules.test.yml``: ``promtool test rules`` unit tests, built from each alert's
  :class:`Case`\\ s: input series on which it fires (with the labels and annotations it
  must carry) and healthy ones on which it stays quiet;
- the PrometheusRule object for the prometheus-operator (``cluster_configs/monitoring/``),
  made from the parsed ``mlplat.rules.yml`` itself, so what promtool tests is what deploys.

Every series a rule names is a catalogue metric's exported name (``ray_mlplat_...``) or one
of Ray's own in :data:`~mlplat.observability.catalogue.RAY_SERIES`; a latency SLO's
threshold must be one of its histogram's bucket boundaries (a ``le`` that exists), or
:func:`slo_error_ratio` refuses it. Each alert's :attr:`Alert.probe` (its expression without
the threshold comparison) is evaluated against a live Prometheus in
``tests/test_observability_prometheus.py``: it must return a series, so no rule watches a
series nothing exports.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

from mlplat.observability import catalogue as c
from mlplat.observability.metrics import Metric

RULES_FILE, TESTS_FILE = "mlplat.rules.yml", "mlplat.rules.test.yml"
DEFAULT_OUT = "alerts"
RUNBOOK = "docs/observability.md#alerts in the mlplat repository"  # no canonical URL for it: set one here if published
EVALUATION_INTERVAL = "1m"
# promtool evaluates every rule at each step up to a case's eval_time (7 h, 27 h here): every 5 minutes keeps
# `promtool test rules` at ~2 s instead of ~9 s, and every `for:` in the rules is at most 15 minutes.
TEST_EVALUATION_INTERVAL = "5m"


@dataclass(frozen=True)
class Case:
    """promtool input: ``series`` (``'name{labels}': 'values'`` in promtool's expanding notation, 1 min apart),
    evaluated at ``at``; ``fires``: the label sets the alert carries then (beyond its own labels), empty: quiet."""

    series: dict[str, str]
    at: str
    fires: tuple[dict[str, str], ...] = ()


@dataclass(frozen=True)
class Alert:
    name: str
    probe: str  # the measured value: what the live test evaluates (must return a series)
    condition: str  # appended to ``(probe)``: the threshold comparison, and any guard
    summary: str
    meaning: str  # what it means and what to do: the description annotation and the docs
    for_: str = "0m"
    severity: str = "warning"
    cases: tuple[Case, ...] = ()

    @property
    def expr(self) -> str:
        return f"({self.probe}) {self.condition}"

    def to_rule(self) -> dict:
        rule = {"alert": self.name, "expr": self.expr}
        if self.for_ != "0m":
            rule["for"] = self.for_
        rule["labels"] = {"severity": self.severity}
        rule["annotations"] = {"summary": self.summary, "description": self.meaning, "runbook": RUNBOOK}
        return rule


@dataclass(frozen=True)
class Record:
    record: str
    expr: str

    def to_rule(self) -> dict:
        return {"record": self.record, "expr": self.expr}


@dataclass(frozen=True)
class Group:
    name: str
    rules: tuple[Alert | Record, ...]
    interval: str = EVALUATION_INTERVAL


# -- latency SLOs: multi-window, multi-burn-rate (Google SRE workbook, "Alerting on SLOs") ----------
@dataclass(frozen=True)
class LatencySLO:
    key: str  # ttft, itl
    metric: Metric
    threshold_s: float  # a bucket boundary of the metric
    objective: float = 0.99  # fraction of observations at or under the threshold
    what: str = ""

    @property
    def budget(self) -> float:
        return round(1.0 - self.objective, 6)


def le_label(metric: Metric, threshold: float) -> str:
    """The ``le`` label value of ``metric``'s bucket at ``threshold``; refuses a threshold that is not a boundary."""
    if metric.kind != "histogram":
        raise ValueError(f"{metric.name} is a {metric.kind}: an SLO threshold needs a histogram")
    if threshold not in metric.boundaries:
        raise ValueError(
            f"{metric.name}: SLO threshold {threshold:g} s is not a bucket boundary ({', '.join(f'{b:g}' for b in metric.boundaries)}); "
            "Prometheus cannot count observations under it exactly"
        )
    if float(threshold).is_integer():  # Ray writes 1.0, Prometheus 3 normalises to 1: only fractional boundaries read the same
        raise ValueError(f"{metric.name}: use a fractional bucket boundary for an SLO threshold, not {threshold:g}")
    return repr(float(threshold))


def slo_error_ratio(slo: LatencySLO, window: str) -> str:
    """Fraction of observations over the threshold in ``window``, by model."""
    bucket, count = slo.metric.series_names[0], slo.metric.series_names[2]
    le = le_label(slo.metric, slo.threshold_s)
    return f'1 - sum by (model) (rate({bucket}{{le="{le}"}}[{window}])) / sum by (model) (rate({count}[{window}]))'


def slo_record(slo: LatencySLO, window: str) -> str:
    return f"mlplat:serve_{slo.key}_slo_errors:ratio_rate{window}"


# (alert suffix, severity, long window, short window, burn rate, for): the workbook's page and ticket pairs
BURN_WINDOWS = (("Fast", "critical", "1h", "5m", 14.4, "2m"), ("Slow", "warning", "6h", "30m", 6.0, "15m"))
SLOS = (
    LatencySLO("ttft", c.SERVE_TTFT, 2.5, 0.99, "time to first token"),
    LatencySLO("itl", c.SERVE_ITL, 0.1, 0.99, "inter-token latency"),
)


def _histogram_series(metric: Metric, le: str, good_per_min: int, total_per_min: int, minutes: int) -> dict[str, str]:
    labels = 'model="m"'
    return {
        f'{metric.series_names[0]}{{{labels}, le="{le}"}}': f"0+{good_per_min}x{minutes}",
        f'{metric.series_names[0]}{{{labels}, le="+Inf"}}': f"0+{total_per_min}x{minutes}",
        f"{metric.series_names[2]}{{{labels}}}": f"0+{total_per_min}x{minutes}",
    }


def _burn_alerts(slo: LatencySLO) -> list[Alert]:
    le = le_label(slo.metric, slo.threshold_s)
    alerts = []
    for suffix, severity, long_w, short_w, burn, for_ in BURN_WINDOWS:
        limit = round(burn * slo.budget, 6)
        # Fires: half of all requests over the threshold for 7 h; quiet: 0.5 % over (half the budget).
        bad, good = _histogram_series(slo.metric, le, 30, 60, 420), _histogram_series(slo.metric, le, 995, 1000, 420)
        alerts.append(Alert(
            name=f"MlplatServe{slo.key.upper()}BurnRate{suffix}",
            probe=slo_record(slo, long_w),
            condition=f"> {limit} and {slo_record(slo, short_w)} > {limit}",
            for_=for_,
            severity=severity,
            summary=f"Serving {slo.what} SLO: error budget burning {burn:g}x too fast",
            meaning=(
                f"More than {limit:.2%} of requests had a {slo.what} over {slo.threshold_s:g} s over the last {long_w} and {short_w} "
                f"(objective: {slo.objective:.0%} under {slo.threshold_s:g} s, so {burn:g}x the sustainable error rate"
                f"{'; the 30-day budget goes in ~2 days' if suffix == 'Fast' else '; the 30-day budget goes in ~5 days'}). "
                "Look at queue length, KV cache usage and replica count on the serving dashboard; scale out or shed load."
            ),
            cases=(Case(bad, "7h", ({"model": "m"},)), Case(good, "7h")),
        ))  # fmt: skip
    return alerts


# -- the rules --------------------------------------------------------------------------------
_RUN = 'recipe="sft", run_id="r1"'
_STEP_S = f'{c.TRAIN_STEP_SECONDS.exported}{{{_RUN}, rank="0"}}'
_SERVE_OK = {f'{c.SERVE_REQUESTS.exported}{{model="m", status="200"}}': "0+600x30"}

TRAINING = Group("mlplat-training", (
    Alert(
        name="MlplatTrainingStraggler",
        probe=f"max by (recipe, run_id, rank, node) ({c.TRAIN_RANK_SLOWDOWN.exported})",
        condition="> 1.25",
        for_="5m",
        summary="A training rank is a straggler",
        meaning="One rank's local step time has been over 1.25x the other ranks' median for 5 minutes (the straggler "
                "detector's default margin): the whole synchronous job runs at its pace. Check the node (`mlplat health check`); "
                "with health.straggler.action=stop the job restarts away from it.",
        cases=(
            Case({f'{c.TRAIN_RANK_SLOWDOWN.exported}{{{_RUN}, rank="1", node="n1"}}': "1.8x20",
                  f'{c.TRAIN_RANK_SLOWDOWN.exported}{{{_RUN}, rank="0", node="n0"}}': "1x20"},
                 "10m", ({"recipe": "sft", "run_id": "r1", "rank": "1", "node": "n1"},)),
            Case({f'{c.TRAIN_RANK_SLOWDOWN.exported}{{{_RUN}, rank="1", node="n1"}}': "1.1x20"}, "10m"),
        ),
    ),
    Alert(
        name="MlplatTrainingRankHung",
        probe=f"sum by (recipe, run_id) (increase({c.TRAIN_STEPS.exported}[15m]))",
        # Ray's metrics agent keeps a dead process's counters but drops its gauges after two report intervals:
        # the per-rank step-time gauge says the job's workers are still alive (a finished job is not hung).
        condition=f"== 0 and on (recipe, run_id) max by (recipe, run_id) ({c.TRAIN_STEP_SECONDS.exported})",
        for_="5m",
        severity="critical",
        summary="A training job has stopped taking steps",
        meaning="No optimizer step in 15 minutes while the job's workers are alive: a rank is hung (a collective waiting on a "
                "dead or wedged peer, a stuck data loader). The hang watchdog (health.hang.timeout_s) dumps every rank's stacks "
                "into the MLflow run and fails the job for Ray Train to restart; look there.",
        cases=(
            Case({f"{c.TRAIN_STEPS.exported}{{{_RUN}}}": "0+10x10 100x30", _STEP_S: "0.5x40"},
                 "35m", ({"recipe": "sft", "run_id": "r1"},)),
            Case({f"{c.TRAIN_STEPS.exported}{{{_RUN}}}": "0+10x40", _STEP_S: "0.5x40"},
                 "35m"),
            # Finished: the counter stays exported, the workers' gauges are gone.
            Case({f"{c.TRAIN_STEPS.exported}{{{_RUN}}}": "0+10x10 100x30", _STEP_S: "0.5x10"},
                 "35m"),
        ),
    ),
    Alert(
        name="MlplatTrainingJobRestarting",
        probe=f"time() - max by (recipe, run_id) ({c.TRAIN_ATTEMPT_STARTED.exported})",
        condition=f'< 1800 and on (recipe, run_id) max by (recipe, run_id) ({c.TRAIN_ATTEMPT_STARTED.exported}{{restarted="true"}})',
        summary="A training job restarted after a failure",
        meaning="The job's current attempt started in the last 30 minutes by restoring its own checkpoint after a failure "
                "(a dead worker, a hang, a straggler stop). One restart is what fault tolerance is for; repeated ones use up "
                "FailureConfig.max_failures: read the failed attempt's error in the Ray Train logs.",
        cases=(
            Case({f'{c.TRAIN_ATTEMPT_STARTED.exported}{{{_RUN}, restarted="true"}}': "600x20"}, "20m",
                 ({"recipe": "sft", "run_id": "r1"},)),
            Case({f'{c.TRAIN_ATTEMPT_STARTED.exported}{{{_RUN}, restarted="false"}}': "600x20"}, "20m"),
            Case({f'{c.TRAIN_ATTEMPT_STARTED.exported}{{{_RUN}, restarted="true"}}': "0x60"}, "60m"),
        ),
    ),
))  # fmt: skip

HEALTH = Group("mlplat-cluster-health", (
    Alert(
        name="MlplatNodeFailedAcceptance",
        probe=f"min by (node) ({c.HEALTH_NODE_PASSED.exported})",
        condition="== 0",
        severity="critical",
        summary="A node failed its acceptance check",
        meaning="The last `mlplat health check` found the node below its hardware profile's floor or an outlier against "
                "the other nodes (the report lists which figure). With action=quarantine it is kept out of opted-in jobs; "
                "fix or replace it, then check it again.",
        cases=(
            Case({f'{c.HEALTH_NODE_PASSED.exported}{{node="n1"}}': "0x5", f'{c.HEALTH_NODE_PASSED.exported}{{node="n0"}}': "1x5"},
                 "2m", ({"node": "n1"},)),
            Case({f'{c.HEALTH_NODE_PASSED.exported}{{node="n1"}}': "1x5"}, "2m"),
        ),
    ),
    Alert(
        name="MlplatLinkFailedAcceptance",
        probe=f"min by (node, peer) ({c.HEALTH_PAIR_PASSED.exported})",
        condition="== 0",
        summary="The link between two nodes failed its acceptance check",
        meaning="In the last `mlplat health check` the all-reduce between these two ring neighbours was below the profile's "
                "floor or an outlier against the other pairs, while both nodes were fine with their other neighbour: the "
                "cable, switch port or route between them (or one NIC on that path). No node is quarantined for it; a job "
                "spanning both runs at the link's pace. Check the link, then run the check again.",
        cases=(
            Case({f'{c.HEALTH_PAIR_PASSED.exported}{{node="n0", peer="n1"}}': "0x5",
                  f'{c.HEALTH_PAIR_PASSED.exported}{{node="n1", peer="n2"}}': "1x5"}, "2m", ({"node": "n0", "peer": "n1"},)),
            Case({f'{c.HEALTH_PAIR_PASSED.exported}{{node="n0", peer="n1"}}': "1x5"}, "2m"),
        ),
    ),
    Alert(
        name="MlplatNodeQuarantined",
        probe=f"max by (node) ({c.HEALTH_NODE_QUARANTINED.exported})",
        condition="== 1",
        summary="A node is quarantined",
        meaning="The node holds mlplat_accepted_node=0 (failed acceptance, or a flagged straggler): jobs that opt in no longer "
                "run there, so the cluster is smaller. `mlplat health nodes` gives the reason; `mlplat health unmark` accepts it again.",
        cases=(
            Case({f'{c.HEALTH_NODE_QUARANTINED.exported}{{node="n1"}}': "1x5"}, "2m", ({"node": "n1"},)),
            Case({f'{c.HEALTH_NODE_QUARANTINED.exported}{{node="n1"}}': "0x5"}, "2m"),
        ),
    ),
    Alert(
        name="MlplatHealthReportStale",
        probe=f"time() - max({c.HEALTH_REPORT_TIMESTAMP.exported})",
        # 25 h, held for 1 h: 26 h. Also when no report is exported at all (never checked, or the actor is gone with the head).
        condition=f"> 90000 or absent({c.HEALTH_REPORT_TIMESTAMP.exported})",
        for_="1h",
        summary="No node acceptance check for over 26 hours",
        meaning="The health exporter actor's last report is more than 26 hours old, or no report has been exported for an hour: "
                "the scheduled `mlplat health check` (daily) has stopped running or cannot finish, or the exporter actor is gone "
                "(a head restart without GCS fault tolerance). Node verdicts are out of date: run the check, and fix its schedule.",
        cases=(
            Case({f"{c.HEALTH_REPORT_TIMESTAMP.exported}": "0x1700"}, "27h", ({},)),
            Case({f"{c.HEALTH_REPORT_TIMESTAMP.exported}": "0+60x1700"}, "27h"),
            Case({f'{c.HEALTH_NODE_PASSED.exported}{{node="n1"}}': "1x150"}, "2h", ({},)),
            Case({f"{c.HEALTH_REPORT_TIMESTAMP.exported}": "0+60x150"}, "2h"),
        ),
    ),
))  # fmt: skip

SLO_RECORDS = tuple(Record(slo_record(slo, w), slo_error_ratio(slo, w)) for slo in SLOS for w in ("5m", "30m", "1h", "6h"))
_REQ, _RAY_STARTS = c.SERVE_REQUESTS.exported, c.RAY_SERVE_REPLICA_STARTS


def _status_ratio(matcher: str) -> str:
    # `or ... * 0`: 0, not nothing, while no request has that status (the live test needs a series)
    return (f'(sum by (model) (rate({_REQ}{{status=~"{matcher}"}}[5m])) or sum by (model) (rate({_REQ}[5m])) * 0)'
            f" / sum by (model) (rate({_REQ}[5m]))")  # fmt: skip


SERVING = Group("mlplat-serving", (
    *SLO_RECORDS,
    *_burn_alerts(SLOS[0]),
    *_burn_alerts(SLOS[1]),
    Alert(
        name="MlplatServeKVCacheNearFull",
        probe=f"max by (role, WorkerId) ({c.SERVE_KV_USAGE.exported})",
        condition="> 0.9",
        for_="10m",
        summary="An engine replica's KV cache is nearly full",
        meaning="Over 90% of a replica's KV cache blocks have been in use for 10 minutes: new requests queue or preempt running "
                "ones, and TTFT rises. Add replicas (or KV memory: num_kv_blocks, gpu memory), or lower max_num_seqs.",
        cases=(
            Case({f'{c.SERVE_KV_USAGE.exported}{{role="decode", WorkerId="w1"}}': "0.95x20"}, "15m",
                 ({"role": "decode", "WorkerId": "w1"},)),
            Case({f'{c.SERVE_KV_USAGE.exported}{{role="decode", WorkerId="w1"}}': "0.5x20"}, "15m"),
        ),
    ),
    Alert(
        name="MlplatServe5xxRate",
        probe=_status_ratio("5.."),
        condition="> 0.05",
        for_="5m",
        severity="critical",
        summary="Serving answers over 5% of requests with a 5xx",
        meaning="More than 5% of a model's requests failed on the server side (internal error, engine unavailable, timeout) "
                "for 5 minutes. The rejections panel gives the reason; the replicas' logs (by request id) the error.",
        cases=(
            Case({**_SERVE_OK, f'{_REQ}{{model="m", status="503"}}': "0+100x30"}, "20m", ({"model": "m"},)),
            Case({**_SERVE_OK, f'{_REQ}{{model="m", status="500"}}': "0+6x30"}, "20m"),
            Case(_SERVE_OK, "20m"),
        ),
    ),
    Alert(
        name="MlplatServe429Rate",
        probe=_status_ratio("429"),
        condition="> 0.1",
        for_="10m",
        summary="Serving refuses over 10% of requests with 429",
        meaning="More than 10% of a model's requests were refused as rate-limited or overloaded (queue full) for 10 minutes: "
                "demand exceeds capacity or a tenant's limit. Scale out, or raise the limit if it is the tenant's.",
        cases=(
            Case({**_SERVE_OK, f'{_REQ}{{model="m", status="429"}}': "0+200x30"}, "20m", ({"model": "m"},)),
            Case({**_SERVE_OK, f'{_REQ}{{model="m", status="429"}}': "0+20x30"}, "20m"),
        ),
    ),
    Alert(
        name="MlplatServeReplicaRestarts",
        # Replicas are new actors: a replica started in the last 30 min is a series absent 30 min ago.
        probe=f"count by (application, deployment) ({_RAY_STARTS} unless {_RAY_STARTS} offset 30m)",
        condition=f"> 2 and on (application, deployment) count by (application, deployment) ({_RAY_STARTS} offset 30m)",
        summary="Serve replicas of a deployment keep restarting",
        meaning="More than 2 replicas of a deployment that already ran 30 minutes ago started in the last 30 minutes: Serve is "
                "replacing crashed or unhealthy replicas (or the deployment was redeployed or scaled up). Read the replicas' "
                "logs under logs/serve for the crash.",
        cases=(
            Case({f'{_RAY_STARTS}{{application="a", deployment="d", replica="r0"}}': "1x60",
                  f'{_RAY_STARTS}{{application="a", deployment="d", replica="r1"}}': "_x40 1x20",
                  f'{_RAY_STARTS}{{application="a", deployment="d", replica="r2"}}': "_x45 1x15",
                  f'{_RAY_STARTS}{{application="a", deployment="d", replica="r3"}}': "_x50 1x10"},
                 "59m", ({"application": "a", "deployment": "d"},)),
            Case({f'{_RAY_STARTS}{{application="a", deployment="d", replica="r{i}"}}': "_x40 1x20" for i in range(4)}, "59m"),
            Case({f'{_RAY_STARTS}{{application="a", deployment="d", replica="r0"}}': "1x60"}, "59m"),
        ),
    ),
))  # fmt: skip

GROUPS: tuple[Group, ...] = (TRAINING, HEALTH, SERVING)


def alerts() -> list[Alert]:
    return [r for g in GROUPS for r in g.rules if isinstance(r, Alert)]


def records() -> dict[str, str]:
    return {r.record: r.expr for g in GROUPS for r in g.rules if isinstance(r, Record)}


def inline_records(expr: str) -> str:
    """``expr`` with every recorded series replaced by its recording rule's expression (for a Prometheus without the rules)."""
    recorded = records()
    return re.sub(r"\bmlplat:[a-z0-9_:]+", lambda m: f"({recorded[m.group(0)]})" if m.group(0) in recorded else m.group(0), expr)


# -- files ----------------------------------------------------------------------------------------
class _Dumper(yaml.SafeDumper):
    pass


def _str(dumper, value: str):  # expressions stay on one line; multi-line text (a dashboard's JSON) is a literal block
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style="|" if "\n" in value else None)


_Dumper.add_representer(str, _str)


def _dump(content) -> str:
    return yaml.dump(content, Dumper=_Dumper, sort_keys=False, width=1_000_000, allow_unicode=True)


def rules_file() -> dict:
    return {"groups": [{"name": g.name, "interval": g.interval, "rules": [r.to_rule() for r in g.rules]} for g in GROUPS]}


def render_rules() -> str:
    header = "# Generated by `mlplat alerts export` from platform/mlplat/observability/alerts.py: edit that, not this file.\n"
    return header + _dump(rules_file())


def tests_file() -> dict:
    tests = []
    for alert in alerts():
        for i, case in enumerate(alert.cases):
            expected = [
                {"exp_labels": {**labels, "severity": alert.severity}, "exp_annotations": alert.to_rule()["annotations"]}
                for labels in case.fires
            ]
            tests.append({
                "name": f"{alert.name} {'fires' if case.fires else 'quiet'} ({i})",
                "interval": "1m",
                "input_series": [{"series": s, "values": v} for s, v in case.series.items()],
                "alert_rule_test": [{"eval_time": case.at, "alertname": alert.name, "exp_alerts": expected}],
            })  # fmt: skip
    return {"rule_files": [RULES_FILE], "evaluation_interval": TEST_EVALUATION_INTERVAL, "tests": tests}


def render_tests() -> str:
    header = "# Generated by `mlplat alerts export`: promtool test rules mlplat.rules.test.yml (each alert fires, and stays quiet).\n"
    return header + _dump(tests_file())


def rendered() -> dict[str, str]:
    return {RULES_FILE: render_rules(), TESTS_FILE: render_tests()}


def export(out_dir: str | Path) -> list[Path]:
    if problems := check_rules():
        raise ValueError("alert rules: " + "; ".join(problems))
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, text in rendered().items():
        (out / name).write_text(text)
        paths.append(out / name)
    return paths


_SERIES = re.compile(r"\bray_[a-z0-9_]+")


def series_in(expr: str) -> set[str]:
    return set(_SERIES.findall(expr))


def check_rules() -> list[str]:
    """Rules naming a series neither the catalogue nor RAY_SERIES knows, alerts without a firing and a quiet case, duplicates."""
    known, problems, names = c.exported_series() | c.RAY_SERIES, [], set()
    for group in GROUPS:
        for rule in group.rules:
            name = rule.name if isinstance(rule, Alert) else rule.record
            if isinstance(rule, Record) and name in names:
                problems.append(f"{name}: recorded twice")
            names.add(name)
            if unknown := series_in(rule.expr) - known:
                problems.append(f"{name}: {sorted(unknown)} not in the metrics catalogue")
            if isinstance(rule, Alert) and not (any(k.fires for k in rule.cases) and any(not k.fires for k in rule.cases)):
                problems.append(f"{name}: needs a case where it fires and one where it stays quiet")
    return problems


# -- the PrometheusRule (prometheus-operator), from the committed rule file -------------------------
PROMETHEUS_RULE_NAME = "mlplat-alerts"
SELECTOR_LABELS = {"release": "prometheus"}  # kube-prometheus-stack's default ruleSelector/podMonitorSelector


def prometheus_rule(rules_text: str, namespace: str = "monitoring") -> dict:
    groups = yaml.safe_load(rules_text)["groups"]
    return {
        "apiVersion": "monitoring.coreos.com/v1",
        "kind": "PrometheusRule",
        "metadata": {"name": PROMETHEUS_RULE_NAME, "namespace": namespace,
                     "labels": {"app.kubernetes.io/part-of": "mlplat", **SELECTOR_LABELS}},
        "spec": {"groups": groups},
    }  # fmt: skip
