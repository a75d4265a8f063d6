"""Grafana dashboards as code: training, serving, RL and cluster health, built from the catalogue.

Every query names its metric through a catalogue entry (``Q(TRAIN_LOSS, "max by (run_id) ({m}{sel})")``),
so a dashboard cannot name a metric the code does not export. ``mlplat dashboards export``
writes the JSON committed under ``dashboards/``; ``tests/test_observability.py`` fails when
the committed files differ from what this module generates.

The JSON follows Grafana's classic dashboard model (schemaVersion 39, the one Grafana 10/11
export and import): ``timeseries`` panels on a 24-column grid, Prometheus targets with a
``${datasource}`` variable so the dashboards work with whatever Prometheus data source a
Grafana has (Ray's own provisioning calls it "Prometheus"). :func:`validate_dashboard`
checks the structure Grafana relies on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from mlplat.observability import catalogue as c
from mlplat.observability.metrics import Metric

SCHEMA_VERSION = 39
GRID_COLUMNS = 24
PANEL_HEIGHT, PANEL_WIDTH = 8, 12
RATE = "$__rate_interval"  # Grafana picks a window of at least four scrape intervals


@dataclass(frozen=True)
class Q:
    """One PromQL target; ``{m}`` is the metric's exported name, ``{sel}`` the dashboard's label selector."""

    metric: Metric
    expr: str
    legend: str = ""

    def render(self, selector: str) -> str:
        return self.expr.format(m=self.metric.exported, sel=selector)


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Q, ...]
    description: str = ""
    unit: str | None = None  # Grafana unit id; default: the first metric's

    @property
    def metrics(self) -> tuple[Metric, ...]:
        return tuple(q.metric for q in self.queries)


def quantiles(metric: Metric, by: str = "", qs: tuple[float, ...] = (0.5, 0.99)) -> tuple[Q, ...]:
    """p50/p99 of a histogram over the rate window."""
    group = f"le{', ' + by if by else ''}"
    return tuple(
        Q(
            metric,
            f"histogram_quantile({q}, sum by ({group}) (rate({{m}}_bucket{{sel}}[{RATE}])))",
            f"p{round(q * 100)}{' {{' + by + '}}' if by else ''}",
        )
        for q in qs
    )


@dataclass(frozen=True)
class Variable:
    name: str  # a label of the metric
    metric: Metric

    def to_grafana(self) -> dict:
        query = f"label_values({self.metric.series_names[0]}, {self.name})"
        return {
            "name": self.name,
            "label": self.name,
            "type": "query",
            "datasource": {"type": "prometheus", "uid": "${datasource}"},
            "definition": query,
            "query": {"query": query, "refId": "PrometheusVariableQueryEditor-VariableQuery"},
            "refresh": 2,  # on time range change
            "includeAll": True,
            "allValue": ".*",
            "multi": True,
            "current": {"selected": True, "text": ["All"], "value": ["$__all"]},
            "sort": 1,
        }


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    panels: tuple[Panel, ...]
    variables: tuple[Variable, ...] = ()
    tags: tuple[str, ...] = field(default=("mlplat",))

    @property
    def selector(self) -> str:
        if not self.variables:
            return ""
        return "{" + ", ".join(f'{v.name}=~"${v.name}"' for v in self.variables) + "}"

    def to_grafana(self) -> dict:
        panels = []
        for i, panel in enumerate(self.panels):
            targets = [
                {
                    "refId": chr(ord("A") + j),
                    "datasource": {"type": "prometheus", "uid": "${datasource}"},
                    "expr": q.render(self.selector),
                    "legendFormat": q.legend or "__auto",
                    "range": True,
                    "editorMode": "code",
                }
                for j, q in enumerate(panel.queries)
            ]
            panels.append({
                "id": i + 1,
                "type": "timeseries",
                "title": panel.title,
                "description": panel.description or panel.queries[0].metric.help,
                "datasource": {"type": "prometheus", "uid": "${datasource}"},
                "gridPos": {"h": PANEL_HEIGHT, "w": PANEL_WIDTH, "x": (i % 2) * PANEL_WIDTH, "y": (i // 2) * PANEL_HEIGHT},
                "fieldConfig": {"defaults": {"unit": panel.unit or panel.queries[0].metric.grafana_unit}, "overrides": []},
                "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True}, "tooltip": {"mode": "multi", "sort": "none"}},
                "targets": targets,
            })  # fmt: skip
        datasource = {
            "name": "datasource",
            "label": "Data source",
            "type": "datasource",
            "query": "prometheus",
            "current": {},
            "hide": 0,
            "refresh": 1,
            "includeAll": False,
            "multi": False,
        }
        return {
            "uid": self.uid,
            "title": self.title,
            "description": self.description,
            "tags": list(self.tags),
            "schemaVersion": SCHEMA_VERSION,
            "version": 1,
            "editable": True,
            "graphTooltip": 1,
            "timezone": "browser",
            "fiscalYearStartMonth": 0,
            "refresh": "10s",
            "time": {"from": "now-1h", "to": "now"},
            "timepicker": {},
            "links": [],
            "annotations": {"list": []},
            "templating": {"list": [datasource, *(v.to_grafana() for v in self.variables)]},
            "panels": panels,
        }


def _by_run(metric: Metric, agg: str = "max", extra: str = "") -> Q:
    by = f"run_id{', ' + extra if extra else ''}"
    legend = "{{run_id}}" + (f" {{{{{extra}}}}}" if extra else "")
    return Q(metric, f"{agg} by ({by}) ({{m}}{{sel}})", legend)


# A counter Ray has not exported yet (nothing counted) reads 0 where its job is running, not "No data".
_ZERO_STEPS = f"sum by (run_id) (rate({c.TRAIN_STEPS.exported}{{sel}}[{RATE}])) * 0"

TRAINING = Dashboard(
    uid="mlplat-training",
    title="mlplat / Training",
    description="SFT and post-training jobs: loss, throughput, MFU, where step time goes, input data, stragglers.",
    variables=(Variable("run_id", c.TRAIN_LOSS),),
    panels=(
        Panel("Loss", (_by_run(c.TRAIN_LOSS),)),
        Panel("Tokens / s (all ranks)", (_by_run(c.TRAIN_TOKENS_PER_S),)),
        Panel("MFU", (_by_run(c.TRAIN_MFU),)),
        Panel("Step time by phase (mean over ranks)", (_by_run(c.TRAIN_STEP_PHASE_SECONDS, "avg", "phase"),),
              "Mean seconds per step in each phase; data_wait high = the input pipeline is the bottleneck, comm high = the network."),
        Panel("Step time per rank", (Q(c.TRAIN_STEP_SECONDS, "max by (run_id, rank) ({m}{sel})", "{{run_id}} rank {{rank}}"),)),
        Panel("Data wait fraction per rank", (Q(c.TRAIN_DATA_WAIT_FRACTION, "max by (run_id, rank) ({m}{sel})", "{{run_id}} rank {{rank}}"),)),
        Panel("Straggler score (rank slowdown)", (Q(c.TRAIN_RANK_SLOWDOWN, "max by (run_id, rank, node) ({m}{sel})", "rank {{rank}} {{node}}"),),
              "A rank's local step time over the other ranks' median; above the straggler threshold for a few windows flags it.", "short"),
        Panel("Steps / s", (Q(c.TRAIN_STEPS, f"sum by (run_id) (rate({{m}}{{sel}}[{RATE}]))", "{{run_id}}"),
                            Q(c.TRAIN_SKIPPED_STEPS, f"sum by (run_id) (rate({{m}}{{sel}}[{RATE}])) or {_ZERO_STEPS}", "{{run_id}} skipped")),
              "Skipped steps show as 0 until the first one (Ray exports a counter from its first increment).", unit="short"),
        Panel("Gradient norm", (_by_run(c.TRAIN_GRAD_NORM),)),
        Panel("Learning rate", (_by_run(c.TRAIN_LR),)),
        Panel("Rejected input rows by reason", (Q(c.TRAIN_REJECTED_ROWS, "max by (run_id, reason) ({m}{sel})", "{{run_id}} {{reason}}"),)),
        Panel("Attempt started (restarted = after a failure)",
              (Q(c.TRAIN_ATTEMPT_STARTED, "max by (run_id, restarted) ({m}{sel}) * 1000", "{{run_id}} restarted={{restarted}}"),),
              "When the job's current attempt started; a restarted=true series means Ray Train restarted it from its checkpoint.",
              "dateTimeAsIso"),
    ),
)  # fmt: skip

SERVING = Dashboard(
    uid="mlplat-serving",
    title="mlplat / Serving",
    description="The OpenAI ingress and its engine replicas: latency as the client sees it, load, KV cache, PD handoff, refusals.",
    variables=(Variable("model", c.SERVE_REQUESTS),),
    panels=(
        Panel("Time to first token", quantiles(c.SERVE_TTFT)),
        Panel("Inter-token latency", quantiles(c.SERVE_ITL)),
        Panel("End-to-end latency", quantiles(c.SERVE_E2E)),
        Panel("Requests / s by status", (Q(c.SERVE_REQUESTS, f"sum by (status) (rate({{m}}{{sel}}[{RATE}]))", "{{status}}"),), unit="reqps"),
        Panel("Output tokens / s", (Q(c.SERVE_GENERATED_TOKENS, f"sum(rate({{m}}{{sel}}[{RATE}]))", "output"),
                                    Q(c.SERVE_PROMPT_TOKENS, f"sum(rate({{m}}{{sel}}[{RATE}]))", "prompt")), unit="short"),
        Panel("Rejections / s by reason", (Q(c.SERVE_REJECTIONS, f"sum by (reason) (rate({{m}}{{sel}}[{RATE}]))", "{{reason}}"),), unit="reqps"),
        Panel("Queue length", (Q(c.SERVE_QUEUE_LENGTH, "sum by (role) ({m})", "{{role}}"),)),
        Panel("Running requests", (Q(c.SERVE_RUNNING, "sum by (role) ({m})", "{{role}}"),)),
        Panel("KV blocks used", (Q(c.SERVE_KV_BLOCKS_USED, "sum by (role) ({m})", "{{role}}"),)),
        Panel("KV cache usage", (Q(c.SERVE_KV_USAGE, "max by (role) ({m})", "{{role}} (fullest replica)"),)),
        Panel("Prefix cache hit rate", (Q(c.SERVE_PREFIX_HIT_RATE, "avg by (role) ({m})", "{{role}}"),)),
        Panel("Speculative acceptance rate", (Q(c.SERVE_SPEC_ACCEPTANCE, "avg by (role) ({m})", "{{role}}"),),
              "Zero unless the engine runs speculative decoding."),
        Panel("KV handoff: bytes / s and import failures / s",
              (Q(c.SERVE_KV_HANDOFF_BYTES, f"sum(rate({{m}}_sum[{RATE}]))", "bytes/s"),
               Q(c.SERVE_KV_HANDOFF_FAILURES, f"sum(rate({{m}}[{RATE}])) or sum(rate({c.SERVE_KV_HANDOFF_BYTES.exported}_count[{RATE}])) * 0",
                 "failures/s (prefill recomputed)")), "Import failures show as 0 while payloads arrive and none failed.", unit="Bps"),
        Panel("KV handoff latency", quantiles(c.SERVE_KV_HANDOFF_SECONDS)),
    ),
)  # fmt: skip

RL = Dashboard(
    uid="mlplat-rl",
    title="mlplat / RL (GRPO)",
    description="Online RL: rewards, KL to the reference, rollout throughput and where a step's time goes.",
    variables=(Variable("run_id", c.RL_REWARD_MEAN),),
    panels=(
        Panel("Reward (mean, std)", (_by_run(c.RL_REWARD_MEAN), Q(c.RL_REWARD_STD, "max by (run_id) ({m}{sel})", "{{run_id}} std"))),
        Panel("KL to reference", (_by_run(c.RL_KL),)),
        Panel("Rollout tokens / s", (_by_run(c.RL_ROLLOUT_TOKENS_PER_S),)),
        Panel("Response length", (_by_run(c.RL_RESPONSE_LENGTH),)),
        Panel("Step time by phase", (_by_run(c.TRAIN_STEP_PHASE_SECONDS, "avg", "phase"),), "rollout, reward, train and weight sync seconds per step."),
        Panel("Loss", (_by_run(c.TRAIN_LOSS),)),
    ),
)  # fmt: skip

HEALTH = Dashboard(
    uid="mlplat-cluster-health",
    title="mlplat / Cluster health",
    description="Results of `mlplat health check` per node, and the straggler score of running training jobs.",
    variables=(Variable("node", c.HEALTH_NODE_PASSED),),
    panels=(
        Panel("Node passed acceptance (1 = yes)", (Q(c.HEALTH_NODE_PASSED, "max by (node) ({m}{sel})", "{{node}}"),)),
        Panel("Measured figures per node", (Q(c.HEALTH_MEASUREMENT, "max by (node, measurement) ({m}{sel})", "{{node}} {{measurement}}"),)),
        Panel("All-reduce bus bandwidth (GB/s)", (Q(c.HEALTH_ALLREDUCE_BUSBW, "max({m})", "busbw"),)),
        Panel("Pairwise all-reduce bus bandwidth (GB/s)",
              (Q(c.HEALTH_PAIR_BUSBW, "max by (node, peer) ({m}{sel})", "{{node}} <-> {{peer}}"),),
              "Each pair of ring neighbours' own all-reduce: a node slow with both neighbours fails (its NIC), a pair slow "
              "alone names the link."),
        Panel("Pair passed (0 = the link was named slow)",
              (Q(c.HEALTH_PAIR_PASSED, "min by (node, peer) ({m}{sel})", "{{node}} <-> {{peer}}"),)),
        Panel("Quarantined nodes (1 = quarantined)", (Q(c.HEALTH_NODE_QUARANTINED, "max by (node) ({m}{sel})", "{{node}}"),)),
        Panel("Age of the last health report", (Q(c.HEALTH_REPORT_TIMESTAMP, "time() - max({m})", "age"),),
              "Seconds since the last `mlplat health check` reported to the health exporter actor; "
              "MlplatHealthReportStale fires past 26 h."),
        Panel("Training stragglers (rank slowdown)", (Q(c.TRAIN_RANK_SLOWDOWN, "max by (run_id, node) ({m}{sel})", "{{run_id}} {{node}}"),), unit="short"),
    ),
)  # fmt: skip

DASHBOARDS: dict[str, Dashboard] = {"training": TRAINING, "serving": SERVING, "rl": RL, "cluster_health": HEALTH}


def render(dashboard: Dashboard) -> str:
    """The committed file's exact text (sorted keys: stable diffs)."""
    return json.dumps(dashboard.to_grafana(), indent=2, sort_keys=True) + "\n"


def export(out_dir: str | Path) -> list[Path]:
    """Write ``<name>.json`` for every dashboard; returns the paths."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for name, dashboard in DASHBOARDS.items():
        model = dashboard.to_grafana()
        if problems := validate_dashboard(model):
            raise ValueError(f"dashboard {name} is not a valid Grafana dashboard: {problems}")
        path = out / f"{name}.json"
        path.write_text(render(dashboard))
        paths.append(path)
    return paths


# -- checks ----------------------------------------------------------------------------------
_SERIES = re.compile(r"\bray_mlplat_[a-z0-9_]+")
_UID = re.compile(r"^[a-zA-Z0-9_-]{1,40}$")  # Grafana's uid: at most 40 characters of these


def series_in(expr: str) -> set[str]:
    """The mlplat series a PromQL expression names."""
    return set(_SERIES.findall(expr))


def _is_int(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def validate_dashboard(model: dict) -> list[str]:
    """What in ``model`` breaks Grafana's dashboard JSON model (classic), as messages; [] when valid.

    Field names, types and ranges follow Grafana's dashboard schema (the ``Spec`` of its
    dashboard kind and the grafana-foundation-sdk builders): schemaVersion an integer,
    uid 1-40 of [a-zA-Z0-9_-], graphTooltip 0-2, panels with unique integer ids, a type,
    gridPos ``h > 0, 0 < w <= 24, 0 <= x < 24, y >= 0`` and x + w <= 24, targets with
    unique refIds; template variables with a name and type; time with from/to.
    """
    problems = []

    def need(obj: dict, key: str, kind, where: str) -> bool:
        ok = key in obj and (kind(obj[key]) if callable(kind) and not isinstance(kind, type) else isinstance(obj[key], kind))
        if not ok:
            problems.append(f"{where}.{key}: missing or not {getattr(kind, '__name__', kind)}")
        return ok

    need(model, "title", str, "dashboard")
    if need(model, "uid", str, "dashboard") and not _UID.match(model["uid"]):
        problems.append("dashboard.uid: want 1-40 characters of [a-zA-Z0-9_-]")
    if need(model, "schemaVersion", _is_int, "dashboard") and not 0 < model["schemaVersion"] < 2**16:
        problems.append("dashboard.schemaVersion: out of uint16 range")
    if "graphTooltip" in model and model["graphTooltip"] not in (0, 1, 2):
        problems.append("dashboard.graphTooltip: want 0, 1 or 2")
    if "fiscalYearStartMonth" in model and not (_is_int(model["fiscalYearStartMonth"]) and 0 <= model["fiscalYearStartMonth"] < 12):
        problems.append("dashboard.fiscalYearStartMonth: want 0-11")
    for key, kind in (("tags", list), ("editable", bool), ("refresh", str), ("links", list)):
        if key in model and not isinstance(model[key], kind):
            problems.append(f"dashboard.{key}: not {kind.__name__}")
    if need(model, "time", dict, "dashboard"):
        for key in ("from", "to"):
            need(model["time"], key, str, "dashboard.time")
    variable_names = set()
    if "templating" in model and need(model["templating"], "list", list, "dashboard.templating"):
        for i, var in enumerate(model["templating"]["list"]):
            where = f"templating.list[{i}]"
            if need(var, "name", str, where) and need(var, "type", str, where):
                variable_names.add(var["name"])
                if var["type"] not in ("query", "custom", "constant", "datasource", "interval", "textbox", "adhoc", "groupby", "switch"):
                    problems.append(f"{where}.type: {var['type']!r} is not a Grafana variable type")
    if not need(model, "panels", list, "dashboard"):
        return problems
    ids = set()
    for i, panel in enumerate(model["panels"]):
        where = f"panels[{i}]"
        if not isinstance(panel, dict):
            problems.append(f"{where}: not an object")
            continue
        need(panel, "type", str, where)
        need(panel, "title", str, where)
        if need(panel, "id", _is_int, where):
            if panel["id"] in ids or panel["id"] < 0:
                problems.append(f"{where}.id: {panel['id']} repeated or negative")
            ids.add(panel["id"])
        if need(panel, "gridPos", dict, where):
            g = panel["gridPos"]
            in_grid = g.get("h", 0) > 0 and 0 < g.get("w", 0) <= GRID_COLUMNS and 0 <= g.get("x", -1) < GRID_COLUMNS and g.get("y", -1) >= 0
            if all(need(g, k, _is_int, f"{where}.gridPos") for k in "hwxy") and not (in_grid and g["x"] + g["w"] <= GRID_COLUMNS):
                problems.append(f"{where}.gridPos: {g} outside the 24-column grid")
        if panel.get("type") == "row":
            continue
        if need(panel, "targets", list, where):
            ref_ids = [t.get("refId") for t in panel["targets"]]
            if len(set(ref_ids)) != len(ref_ids) or not all(isinstance(r, str) and r for r in ref_ids):
                problems.append(f"{where}.targets: refIds must be unique non-empty strings")
            for j, target in enumerate(panel["targets"]):
                need(target, "expr", str, f"{where}.targets[{j}]")
                for var in re.findall(r"\$\{?([A-Za-z_]\w*)", json.dumps(target)):
                    if not var.startswith("__") and var not in variable_names:
                        problems.append(f"{where}.targets[{j}]: uses ${var}, which no template variable defines")
        unit = panel.get("fieldConfig", {}).get("defaults", {}).get("unit")
        if unit is not None and not isinstance(unit, str):
            problems.append(f"{where}.fieldConfig.defaults.unit: not a string")
    return problems
