"""The acceptance check's result: verdicts per node, per pair of nodes, the collective, and how they are shown.

A node fails a figure when it is below the hardware profile's floor, or when its robust
z-score against the other nodes, 0.6745 * (x - median) / MAD (Iglewicz and Hoaglin), is
below ``-z_threshold``. Every figure is higher-is-better, so only the slow side fails.

Pairs of ring neighbours (nodes 0-1, 1-2, ..., k-1 - 0) are judged the same way against the
profile's ``pair_allreduce_busbw_gbps`` and the pairs' median (and fail below half that median
however wide the pairs' spread), then localised: a node both of whose pairs are slow is named
(its NIC, cable or switch port) and fails; a slow pair whose two nodes are fine with their other
neighbours names the link between them.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from typing import Any

from pydantic import BaseModel, Field

from mlplat.config import Config
from mlplat.health.hardware import NODE_METRICS, NVML_OK, HardwareProfile


class Thresholds(Config):
    z_threshold: float = Field(default=3.5, gt=0)  # robust z below -z_threshold fails (the usual outlier cut)
    mad_floor: float = Field(default=0.05, ge=0)  # MAD is at least this fraction of the median: noise in a tight cluster is no outlier
    min_nodes_for_z: int = Field(default=3, ge=3)  # with fewer nodes a median says nothing about who is slow
    # A pair of nodes below this fraction of the pairs' median fails however wide their spread: a ring of few pairs
    # (4 nodes: 4 pairs) has a wide MAD whenever one pair is slow, which blunts the z-score.
    pair_median_fraction: float = Field(default=0.5, gt=0, le=1)


class NodeReport(BaseModel):
    node_id: str
    ip: str = ""
    hostname: str = ""
    metrics: dict[str, float] = {}
    z_scores: dict[str, float] = {}
    facts: dict[str, Any] = {}
    failures: list[str] = []
    marked: str | None = None  # the action taken on the node: accepted, quarantined, drained

    @property
    def passed(self) -> bool:
        return not self.failures

    @property
    def name(self) -> str:
        return f"{self.ip} {self.node_id[:8]}"


class CollectiveReport(BaseModel):
    backend: str
    ranks: int
    size_mb: int
    seconds: float = 0.0  # one all-reduce, fastest of trials, slowest rank
    algbw_gbps: float = 0.0  # bytes / seconds
    busbw_gbps: float = 0.0  # algbw * 2(n-1)/n: what each link carried in a ring (nccl-tests' definition)
    failures: list[str] = []


class LinkReport(BaseModel):
    """An all-reduce among the ranks of two ring neighbours only (all their GPUs; one rank each on CPU nodes)."""

    nodes: tuple[str, str]  # node ids
    names: tuple[str, str] = ("", "")  # as the table shows nodes: "IP id[:8]"
    backend: str
    ranks: int
    size_mb: int
    seconds: float = 0.0  # the fastest all-reduce, slowest rank, best of the rounds
    busbw_gbps: float = 0.0
    z_score: float | None = None  # against the other pairs
    failures: list[str] = []  # why the pair is slow: below the floor, an outlier, or the test failed
    suspects: list[str] = []  # nodes both of whose pairs are slow (named and failed); empty: the link between the two

    @property
    def name(self) -> str:
        return " <-> ".join(n or node_id[:8] for n, node_id in zip(self.names, self.nodes, strict=True))


class HealthReport(BaseModel):
    profile: str
    floors: dict[str, float] = {}  # the profile's lowest passing figure per metric
    started_at: str
    duration_s: float
    phases_s: dict[str, float] = {}  # seconds of each phase: measure, node_all_reduce, pairs, cluster_all_reduce
    nodes: list[NodeReport]
    skipped_nodes: list[str] = []  # alive nodes with no CPU or GPU to run a probe on (e.g. a head with num-cpus=0)
    collective: CollectiveReport | None = None
    links: list[LinkReport] = []  # the ring of pairwise tests, in ring order
    action: str = "report"
    mlflow_run_id: str | None = None

    @property
    def failed_nodes(self) -> list[NodeReport]:
        return [n for n in self.nodes if not n.passed]

    @property
    def failed_links(self) -> list[LinkReport]:
        """Slow pairs that no failed node explains: the report names the link between the two nodes."""
        return [link for link in self.links if link.failures and not link.suspects]

    @property
    def passed(self) -> bool:
        return not self.failed_nodes and not self.failed_links and not (self.collective and self.collective.failures)


def robust_z_scores(values: dict[str, float], mad_floor: float) -> dict[str, float]:
    """0.6745 * (x - median) / MAD for each key, the MAD floored at ``mad_floor * |median|``."""
    median = statistics.median(values.values())
    mad = statistics.median(abs(v - median) for v in values.values())
    scale = max(mad, mad_floor * abs(median), 1e-12)
    return {key: 0.6745 * (v - median) / scale for key, v in values.items()}


def judge_nodes(nodes: list[NodeReport], profile: HardwareProfile, thresholds: Thresholds) -> None:
    """Fill in each node's z-scores and its failures against the profile and against the cluster."""
    for metric in NODE_METRICS:
        values = {n.node_id: n.metrics[metric] for n in nodes if metric in n.metrics}
        floor = profile.floor(metric)
        medians = statistics.median(values.values()) if values else 0.0
        scores = robust_z_scores(values, thresholds.mad_floor) if len(values) >= thresholds.min_nodes_for_z else {}
        for node in nodes:
            if metric not in node.metrics:
                continue
            value = node.metrics[metric]
            if floor is not None and value < floor:
                node.failures.append(
                    f"{metric} {value:.3g} is below the profile's floor {floor:.3g} "
                    f"(expected {profile.expected[metric]:.3g} - {1 - floor / profile.expected[metric]:.0%})"
                )
            if node.node_id in scores:
                node.z_scores[metric] = scores[node.node_id]
                if scores[node.node_id] < -thresholds.z_threshold:
                    node.failures.append(
                        f"{metric} {value:.3g} is an outlier: robust z {scores[node.node_id]:.1f} "
                        f"against the cluster median {medians:.3g} (threshold -{thresholds.z_threshold:g})"
                    )
    for node in nodes:
        gpus = node.facts.get("gpus", 0)
        if gpus < profile.gpus_per_node:
            node.failures.append(f"{gpus} GPUs visible, the profile expects {profile.gpus_per_node}")
        if profile.gpus_per_node and gpus and (nvml := node.facts.get("nvml", "not probed")) != NVML_OK:
            node.failures.append(
                f"NVML unavailable: {nvml}; a GPU profile needs it for the ECC, row-remapping, clock-slowdown and XID checks"
            )
        if profile.rdma is not None:
            ports = [p for p in node.facts.get("rdma_ports", []) if p["state"] == "ACTIVE"]
            fast = [p for p in ports if p["rate_gbps"] >= profile.rdma.rate_gbps]
            if len(fast) < profile.rdma.active_ports:
                node.failures.append(
                    f"{len(fast)} RDMA ports ACTIVE at >= {profile.rdma.rate_gbps:g} Gb/s "
                    f"({len(ports)} active in all), the profile expects {profile.rdma.active_ports}"
                )


def judge_links(links: list[LinkReport], nodes: list[NodeReport], profile: HardwareProfile, thresholds: Thresholds) -> None:
    """Each pair against the profile's floor and the pairs' median; then who is to blame for the slow ones.

    A node in two slow pairs (its neighbours on both sides) gets the failure, and those pairs
    name it as their suspect; a slow pair whose nodes are both fine with their other neighbour
    is the link's fault (or one of the two NICs on that path only). With every pair slow
    (three or more) no node stands out: the failures stay on the pairs.
    """
    floor = profile.floor("pair_allreduce_busbw_gbps")
    measured = {i: link.busbw_gbps for i, link in enumerate(links) if not link.failures and link.seconds > 0}
    median = statistics.median(measured.values()) if measured else 0.0
    scores = robust_z_scores(measured, thresholds.mad_floor) if len(measured) >= thresholds.min_nodes_for_z else {}
    for i, value in measured.items():
        link = links[i]
        if floor is not None and value < floor:
            link.failures.append(f"bus bandwidth {value:.3g} GB/s is below the profile's floor {floor:.3g}")
        if i in scores:
            link.z_score = scores[i]
            if scores[i] < -thresholds.z_threshold:
                link.failures.append(
                    f"bus bandwidth {value:.3g} GB/s is an outlier: robust z {scores[i]:.1f} against the pairs' median "
                    f"{median:.3g} (threshold -{thresholds.z_threshold:g})"
                )
            elif value < thresholds.pair_median_fraction * median:
                link.failures.append(
                    f"bus bandwidth {value:.3g} GB/s is under {thresholds.pair_median_fraction:g} x the pairs' median {median:.3g} "
                    f"(robust z {scores[i]:.1f})"
                )
    slow = [link for link in links if link.failures]
    if not slow or (len(links) >= 3 and len(slow) == len(links)):
        return
    pairs_of: dict[str, list[LinkReport]] = defaultdict(list)
    for link in links:
        for node_id in set(link.nodes):
            pairs_of[node_id].append(link)
    suspects = {node_id for node_id, its in pairs_of.items() if len(its) >= 2 and all(link.failures for link in its)}
    by_id = {node.node_id: node for node in nodes}
    for node_id in sorted(suspects):
        figures = ", ".join(f"{link.name} {link.busbw_gbps:.3g} GB/s" for link in pairs_of[node_id])
        if node_id in by_id:
            by_id[node_id].failures.append(
                f"network: both of its ring pairs are slow ({figures}; pairs' median {median:.3g}): "
                "this node's NIC, cable or switch port"
            )
    for link in slow:
        link.suspects = [node_id for node_id in link.nodes if node_id in suspects]


def judge_collective(collective: CollectiveReport, profile: HardwareProfile) -> None:
    floor = profile.floor("allreduce_busbw_gbps")
    if floor is not None and collective.busbw_gbps < floor:
        collective.failures.append(f"all-reduce bus bandwidth {collective.busbw_gbps:.3g} GB/s is below the profile's floor {floor:.3g}")


_COLUMNS = {
    "cpu_matmul_gflops": "CPU GFLOP/s",
    "memory_bandwidth_gbps": "mem GB/s",
    "disk_write_mbps": "disk w MB/s",
    "disk_read_mbps": "disk r MB/s",
    "gpu_bf16_tflops": "GPU TFLOP/s",
    "gpu_memory_bandwidth_gbps": "HBM GB/s",
    "host_to_device_gbps": "H2D GB/s",
    "device_to_host_gbps": "D2H GB/s",
    "node_allreduce_busbw_gbps": "node AR GB/s",
}


def render_table(report: HealthReport) -> str:
    """The report as text: one row per node (figures marked ``!`` where they failed), then reasons and actions."""
    metrics = [m for m in _COLUMNS if any(m in n.metrics for n in report.nodes)]
    header = ["node", *(_COLUMNS[m] for m in metrics), "status"]
    rows = []
    for node in report.nodes:
        cells = [node.name]
        for m in metrics:
            failed = any(f.startswith(f"{m} ") for f in node.failures)
            cells.append(f"{node.metrics[m]:.4g}{'!' if failed else ''}" if m in node.metrics else "-")
        rows.append([*cells, "ok" if node.passed else "FAIL"])
    rows.append([f"floor ({report.profile})", *(f"{report.floors[m]:.4g}" if m in report.floors else "-" for m in metrics), ""])
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = ["  ".join([r[0].ljust(widths[0]), *(c.rjust(w) for c, w in zip(r[1:], widths[1:], strict=True))]) for r in [header, *rows]]
    lines.insert(1, "-" * len(lines[0]))
    if c := report.collective:
        verdict = "FAIL: " + "; ".join(c.failures) if c.failures else "ok"
        lines.append(
            f"all-reduce ({c.backend}, {c.ranks} ranks, {c.size_mb} MB): bus bandwidth {c.busbw_gbps:.4g} GB/s "
            f"(algorithm {c.algbw_gbps:.4g} GB/s) -- {verdict}"
        )
    if report.links:
        first = report.links[0]
        values = [link.busbw_gbps for link in report.links if link.busbw_gbps]
        median = f"{statistics.median(values):.4g}" if values else "-"
        lines.append(f"pairs of ring neighbours ({first.backend}, {first.ranks} ranks each, {first.size_mb} MB): bus bandwidth GB/s, "
                     f"median {median}")  # fmt: skip
        width = max(len(link.name) for link in report.links)
        for link in report.links:
            if not link.failures:
                verdict = "ok"
            elif link.suspects:
                verdict = "slow: node " + ", ".join(s[:8] for s in link.suspects) + " (slow with both neighbours)"
            else:
                verdict = "FAIL: this link (both nodes are fine with their other neighbour)"
            lines.append(f"  {link.name.ljust(width)}  {link.busbw_gbps:>8.4g}{'!' if link.failures else ' '}  {verdict}")
    for link in report.failed_links:
        lines.append(f"FAIL pair {link.name}:")
        lines.extend(f"  - {reason}" for reason in link.failures)
    for node in report.failed_nodes:
        lines.append(f"FAIL {node.name}{f' [{node.marked}]' if node.marked else ''}:")
        lines.extend(f"  - {reason}" for reason in node.failures)
    if report.skipped_nodes:
        lines.append(f"skipped (no CPU or GPU to run on): {', '.join(report.skipped_nodes)}")
    passed = len(report.nodes) - len(report.failed_nodes)
    links = f", {len(report.links) - len(report.failed_links)} of {len(report.links)} pairs" if report.links else ""
    lines.append(f"{passed} of {len(report.nodes)} nodes{links} passed in {report.duration_s:.0f} s; action: {report.action}")
    return "\n".join(lines)
