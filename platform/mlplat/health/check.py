"""``mlplat health check``: acceptance measurements on every node, collectives that localise slow links, verdicts, action.

    1. one probe actor per node, pinned with NodeAffinitySchedulingStrategy(soft=False), holding all of the
       node's GPUs: it is local rank 0 and starts one more process per further GPU, every one seeing all the
       node's GPUs (one process group per node, as Ray Train's ``share_cuda_visible_devices``; see
       ``mlplat.health.ranks``), never one actor per GPU masked by ``CUDA_VISIBLE_DEVICES``
    2. each measures its node (CPU matmul, memory and disk bandwidth, RDMA ports) and every GPU
       (bf16 matmul, HBM, host<->device, NVML health), ``max_concurrent_nodes`` nodes at a time
    3. collectives (gloo on CPU, NCCL on GPU), each figure an all-reduce's bus bandwidth as nccl-tests defines it:
       - per node: an all-reduce among the node's own GPUs (NVLink/NVSwitch), a node figure like the others;
       - per pair of ring neighbours (nodes sorted by address: 0-1, 1-2, ..., k-1 - 0): an all-reduce among the
         two nodes' ranks only, so a slow NIC or link shows in the pairs that cross it;
       - the whole cluster at once (the figure a training job's gradient all-reduce sees)
    4. verdicts against the hardware profile and against the cluster's median (``mlplat.health.report``): a node
       slow with both its neighbours is named, a pair slow on its own names the link between them
    5. failing nodes quarantined (``mlplat.health.marking``); a table, a JSON file and an MLflow run
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Hashable
from pathlib import Path
from typing import Any, Literal

import ray
import torch
from pydantic import Field
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from mlplat.config import Config, to_flat_params
from mlplat.errors import ConfigError, MlplatError
from mlplat.health import marking, measurements, ranks
from mlplat.health.hardware import NVML_OK, HardwareProfile, MeasurementSizes, load_hardware_profile
from mlplat.health.report import (
    CollectiveReport,
    HealthReport,
    LinkReport,
    NodeReport,
    Thresholds,
    judge_collective,
    judge_links,
    judge_nodes,
)
from mlplat.tracking import RunLogger, start_run


class HealthCheckConfig(Config):
    profile: str = "cpu-dev"  # a name in cluster_configs/hardware/ or a path to a profile YAML
    thresholds: Thresholds = Thresholds()
    disk_dir: str | None = None  # where the disk test writes on every node; default: the node's temp directory
    collective: bool = True  # time all-reduces: within each node, across each pair of ring neighbours, across all nodes
    max_concurrent_nodes: int | None = Field(default=None, gt=0)  # None: all at once; 1 when simulated nodes share a machine
    # Measure every node (and every pair) this many times, interleaved, keeping each figure's best: where nodes share
    # hardware (simulated nodes, a busy machine), every node then sees the same background load.
    rounds: int = Field(default=1, gt=0)
    action: Literal["report", "mark", "drain"] = "mark"  # mark: accept passing nodes, quarantine failing ones; drain: also drain them
    out: str | None = "health_report.json"  # the report as JSON; None: not written
    experiment: str | None = "mlplat-health"  # MLflow experiment of the check's run; None: no run
    export: bool = True  # hand the report to the cluster's health exporter (gauges, alerts); false: the last one stays exported
    timeout_s: float = Field(default=900.0, gt=0)  # for each wave of probes and for each collective
    debug_slowdown: dict[str, float] = Field(default_factory=dict)  # test hook: node id -> factor that node's timed trials are stretched by
    # Test hook: "NODE_A-NODE_B" (ring neighbours) -> factor every timed all-reduce of that pair is stretched by (a slow link).
    debug_slow_links: dict[str, float] = Field(default_factory=dict)
    # Test hook: local ranks of a CPU node (gloo), as a GPU node has one per GPU: the per-node all-reduce runs without GPUs.
    debug_cpu_local_ranks: int = Field(default=1, ge=1)


@ray.remote
class NodeProbe:
    """Measures the node it is pinned to with all of its GPUs, and takes part in collectives with all of them."""

    def __init__(self, threads: int, gpus: int, local_ranks: int):
        threads = max(1, min(threads, os.cpu_count() or 1))
        torch.set_num_threads(threads)  # the whole node, not the one CPU Ray reserved
        self.gpus = gpus
        self.backend = "nccl" if gpus else "gloo"
        self.ranks = ranks.LocalRanks(local_ranks, threads=max(1, threads // local_ranks))  # children start on first use

    def measure(self, sizes: MeasurementSizes, disk_dir: str | None, slowdown: float) -> dict[str, Any]:
        directory = Path(disk_dir) if disk_dir else Path(os.environ.get("TMPDIR", "/tmp"))
        metrics = {
            "cpu_matmul_gflops": measurements.cpu_matmul_gflops(sizes.cpu_matmul, sizes.trials, slowdown),
            "memory_bandwidth_gbps": measurements.memory_bandwidth_gbps(sizes.memory_mb, sizes.trials, slowdown),
        }
        write, read = measurements.disk_throughput_mbps(directory, sizes.disk_mb, sizes.trials, slowdown)
        metrics |= {"disk_write_mbps": write, "disk_read_mbps": read}
        ports = measurements.rdma_ports()
        facts = {
            "hostname": socket.gethostname(),
            "cpu_threads": torch.get_num_threads(),
            "disk_dir": str(directory),
            "disk_fs": measurements.filesystem_type(directory),
            "rdma_ports": [p.model_dump() for p in ports],
        }
        faults = [f"RDMA port {p.device}/{p.port} is {p.state}" for p in ports if p.state != "ACTIVE"]
        # Every GPU at once, each by its local rank's process (the node's GPUs share its PCIe and power as in a job).
        gpus = self.ranks.run(ranks.measure_gpu, sizes=sizes, slowdown=slowdown) if self.gpus else []
        return {"metrics": metrics, "facts": facts, "faults": faults, "gpus": gpus}

    def rendezvous(self) -> str:
        """A TCP address on this node for torch.distributed's store (this probe's local rank 0 is global rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def all_reduce(self, init_method: str, first_rank: int, world_size: int, size_mb: int, trials: int, timeout_s: float,
                   slowdown: float = 1.0) -> float:  # fmt: skip
        """Seconds of the group's fastest all-reduce, as its slowest local rank on this node saw it; this node's local
        ranks are global ranks ``first_rank ..``."""
        seconds = self.ranks.run(
            ranks.timed_all_reduce, wait_s=timeout_s + 60, init_method=init_method, first_rank=first_rank, world_size=world_size,
            backend=self.backend, size_mb=size_mb, trials=trials, timeout_s=timeout_s, slowdown=slowdown,
        )  # fmt: skip
        return max(seconds)


def local_ranks(node: dict, cpu_ranks: int = 1) -> int:
    """The node's ranks in a collective: one per GPU; on a CPU node one (``cpu_ranks``: the test hook)."""
    return int(node["Resources"].get("GPU", 0)) or cpu_ranks


def _start_probe(node: dict, count: int) -> ActorHandle:
    """One probe on ``node`` with ``count`` local ranks, holding all its GPUs (num_gpus = the node's GPUs), pinned there."""
    affinity = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
    threads, gpus = int(node["Resources"].get("CPU", 1)), int(node["Resources"].get("GPU", 0))
    return NodeProbe.options(num_cpus=0 if gpus else 1, num_gpus=gpus, scheduling_strategy=affinity).remote(threads, gpus, count)


def _measure(probes: dict[str, ActorHandle], cfg: HealthCheckConfig, sizes: MeasurementSizes) -> dict[str, dict | Exception]:
    """Every probe's measurement: ``max_concurrent_nodes`` nodes per wave, all nodes ``rounds`` times over."""
    node_ids = list(probes)
    wave_size = cfg.max_concurrent_nodes or len(node_ids)
    outcomes: dict[str, dict | Exception] = {}
    for _ in range(cfg.rounds):
        for start in range(0, len(node_ids), wave_size):
            refs = {
                node_id: probes[node_id].measure.remote(sizes, cfg.disk_dir, cfg.debug_slowdown.get(node_id, 1.0))
                for node_id in node_ids[start : start + wave_size]
            }
            ray.wait(list(refs.values()), num_returns=len(refs), timeout=cfg.timeout_s)
            for node_id, ref in refs.items():
                latest = _get(ref)
                outcomes[node_id] = _best(outcomes[node_id], latest) if node_id in outcomes else latest
    return outcomes


def _best(a: dict | Exception, b: dict | Exception) -> dict | Exception:
    """Two rounds of one probe: each figure's best (each GPU's too), every fault seen; a failed round fails the probe."""
    if isinstance(a, Exception) or isinstance(b, Exception):
        return a if isinstance(a, Exception) else b

    def best(x: dict, y: dict) -> dict:
        return {
            **y,
            "metrics": {m: max(v, y["metrics"].get(m, v)) for m, v in x["metrics"].items()},
            "faults": x["faults"] + [f for f in y["faults"] if f not in x["faults"]],
        }

    return {**best(a, b), "gpus": [best(x, y) for x, y in zip(a["gpus"], b["gpus"], strict=True)]}


def _get(ref: ray.ObjectRef) -> Any:
    try:
        return ray.get(ref, timeout=0)
    except GetTimeoutError:
        return TimeoutError("did not finish within timeout_s (not scheduled, or the node is very slow)")
    except RayError as err:
        return err


def _first_line(err: Exception) -> str:
    return (str(err) or type(err).__name__).strip().splitlines()[0]


def _merge(node: dict, outcome: dict | Exception) -> NodeReport:
    """One node's report: the GPU figures are its slowest GPU's (each GPU's in facts), NVML's state over all GPUs."""
    report = NodeReport(node_id=node["NodeID"], ip=node["NodeManagerAddress"], hostname=node.get("NodeManagerHostname", ""))
    if isinstance(outcome, Exception):
        report.failures.append(f"probe failed: {_first_line(outcome)}")
        return report
    report.metrics = dict(outcome["metrics"])
    report.facts = dict(outcome["facts"])
    report.failures += outcome["faults"]
    gpus = outcome["gpus"]
    for gpu in gpus:
        for metric, value in gpu["metrics"].items():
            report.metrics[metric] = min(value, report.metrics.get(metric, value))
        report.failures += [f"GPU {gpu['id']}: {fault}" for fault in gpu["faults"]]
    report.facts["gpus"] = len(gpus)
    if gpus:
        report.facts["gpu_figures"] = [{k: v for k, v in g.items() if k not in ("metrics", "faults")} | g["metrics"] for g in gpus]
        missing: dict[str, list[str]] = {}
        for gpu in gpus:
            if gpu.get("nvml") != NVML_OK:
                missing.setdefault(str(gpu.get("nvml", "not probed")), []).append(str(gpu["id"]))
        report.facts["nvml"] = "; ".join(f"{why} (GPU {', '.join(ids)})" for why, ids in missing.items()) or NVML_OK
    return report


def busbw_gbps(size_mb: int, seconds: float, ranks: int) -> float:
    """All-reduce bus bandwidth as nccl-tests defines it: size / time x 2(n-1)/n (what each link of a ring carries)."""
    return size_mb * 2**20 / seconds / 1e9 * 2 * (ranks - 1) / ranks


Member = tuple[ActorHandle, int]  # a node's probe and its local ranks


def _all_reduces(groups: dict[Hashable, tuple[list[Member], float]], cfg: HealthCheckConfig, sizes: MeasurementSizes) -> dict:
    """Concurrent all-reduces, one per group of nodes (each node in at most one): key -> seconds (slowest rank) or the error.
    A group's value: ``([(probe, local ranks), ...], slowdown)``; its first node's local rank 0 holds the store."""
    refs: dict[Hashable, list[ray.ObjectRef]] = {}
    results: dict[Hashable, float | Exception] = {}
    for key, (members, slowdown) in groups.items():
        try:
            init = ray.get(members[0][0].rendezvous.remote(), timeout=cfg.timeout_s)
        except (RayError, GetTimeoutError) as err:
            results[key] = err
            continue
        world, first, refs[key] = sum(n for _, n in members), 0, []
        for probe, n in members:
            refs[key].append(probe.all_reduce.remote(init, first, world, sizes.allreduce_mb, sizes.trials, cfg.timeout_s, slowdown))
            first += n
    if refs:
        ray.wait([r for rs in refs.values() for r in rs], num_returns=sum(map(len, refs.values())), timeout=cfg.timeout_s + 60)
    for key, group_refs in refs.items():
        seconds = [_get(ref) for ref in group_refs]
        errors = [s for s in seconds if isinstance(s, Exception)]
        results[key] = errors[0] if errors else max(seconds)  # the collective is as slow as its slowest rank
    return results


def ring_pairs(count: int) -> list[tuple[int, int]]:
    """Ring neighbours among ``count`` nodes: (0, 1), (1, 2), ..., (count-1, 0); one pair for two nodes."""
    if count < 2:
        return []
    return [(0, 1)] if count == 2 else [(i, (i + 1) % count) for i in range(count)]


def pair_waves(pairs: list[tuple[int, int]], limit: int) -> list[list[tuple[int, int]]]:
    """``pairs`` in waves that run at once: no node in two pairs of a wave, at most ``limit`` pairs a wave."""
    waves: list[list[tuple[int, int]]] = []
    for pair in pairs:
        wave = next((w for w in waves if len(w) < limit and not {n for p in w for n in p} & set(pair)), None)
        if wave is None:
            waves.append(wave := [])
        wave.append(pair)
    return waves


def _slow_links(cfg: HealthCheckConfig, ring: list[str]) -> dict[frozenset[str], float]:
    """``debug_slow_links`` as node-id pairs; each must be ring neighbours."""
    neighbours = {frozenset((ring[a], ring[b])) for a, b in ring_pairs(len(ring))}
    links = {}
    for key, factor in cfg.debug_slow_links.items():
        pair = frozenset(part.strip() for part in key.split("-"))
        if len(pair) != 2 or pair not in neighbours:
            raise ConfigError(
                f"debug_slow_links: {key!r} is not two ring neighbours 'NODE_A-NODE_B'; the ring: {' -> '.join(ring)}"
            )
        links[pair] = factor
    return links


def _intra_node(nodes: list[NodeReport], probes: dict[str, ActorHandle], locals_: dict[str, int], cfg: HealthCheckConfig,
                sizes: MeasurementSizes) -> None:  # fmt: skip
    """Each multi-GPU node's all-reduce among its own GPUs: the node figure ``node_allreduce_busbw_gbps``."""
    multi = [n for n in nodes if locals_.get(n.node_id, 1) >= 2]
    wave_size = cfg.max_concurrent_nodes or len(multi) or 1
    for _ in range(cfg.rounds):
        for start in range(0, len(multi), wave_size):
            wave = [n for n in multi[start : start + wave_size] if not any(f.startswith("node all-reduce failed") for f in n.failures)]
            groups = {n.node_id: ([(probes[n.node_id], locals_[n.node_id])], cfg.debug_slowdown.get(n.node_id, 1.0)) for n in wave}
            results = _all_reduces(groups, cfg, sizes)
            for node in wave:
                seconds = results[node.node_id]
                if isinstance(seconds, Exception):
                    node.failures.append(f"node all-reduce failed: {_first_line(seconds)}")
                    continue
                figure = busbw_gbps(sizes.allreduce_mb, seconds, locals_[node.node_id])
                node.metrics["node_allreduce_busbw_gbps"] = max(figure, node.metrics.get("node_allreduce_busbw_gbps", 0.0))


def _pairs(ring: list[NodeReport], probes: dict[str, ActorHandle], locals_: dict[str, int], backend: str, cfg: HealthCheckConfig,
           sizes: MeasurementSizes) -> list[LinkReport]:  # fmt: skip
    """The ring of pairwise all-reduces, ``rounds`` times over, each pair's best kept."""
    pairs = ring_pairs(len(ring))
    slow = _slow_links(cfg, [n.node_id for n in ring])
    links = [
        LinkReport(nodes=(ring[a].node_id, ring[b].node_id), names=(ring[a].name, ring[b].name), backend=backend,
                   ranks=locals_[ring[a].node_id] + locals_[ring[b].node_id], size_mb=sizes.allreduce_mb)
        for a, b in pairs
    ]  # fmt: skip
    waves = pair_waves(pairs, max(1, (cfg.max_concurrent_nodes or len(ring)) // 2))
    index = {pair: i for i, pair in enumerate(pairs)}
    for _ in range(cfg.rounds):
        for wave in waves:
            groups = {
                index[(a, b)]: ([(probes[ring[a].node_id], locals_[ring[a].node_id]), (probes[ring[b].node_id], locals_[ring[b].node_id])],
                                slow.get(frozenset((ring[a].node_id, ring[b].node_id)), 1.0))
                for a, b in wave
                if not links[index[(a, b)]].failures
            }  # fmt: skip
            for i, seconds in _all_reduces(groups, cfg, sizes).items():
                if isinstance(seconds, Exception):
                    links[i].failures.append(f"all-reduce failed: {_first_line(seconds)}")
                elif not links[i].seconds or seconds < links[i].seconds:
                    links[i].seconds, links[i].busbw_gbps = seconds, busbw_gbps(sizes.allreduce_mb, seconds, links[i].ranks)
    return links


def _collective(members: list[Member], backend: str, cfg: HealthCheckConfig, sizes: MeasurementSizes) -> CollectiveReport:
    """All-reduce bus bandwidth across every rank of ``members`` at once."""
    n = sum(count for _, count in members)
    report = CollectiveReport(backend=backend, ranks=n, size_mb=sizes.allreduce_mb)
    seconds = _all_reduces({"all": (members, 1.0)}, cfg, sizes)["all"]
    if isinstance(seconds, Exception):
        report.failures.append(f"all-reduce failed: {_first_line(seconds)}")
        return report
    report.seconds = seconds
    report.algbw_gbps = sizes.allreduce_mb * 2**20 / seconds / 1e9
    report.busbw_gbps = busbw_gbps(sizes.allreduce_mb, seconds, n)
    return report


def _act(report: HealthReport, action: str) -> None:
    for node in report.nodes:
        if node.passed:
            marking.accept(node.node_id)
            node.marked = "accepted"
            continue
        marking.quarantine(node.node_id, "; ".join(node.failures))
        node.marked = "quarantined"
        if action == "drain":
            try:
                marking.drain(node.node_id, "mlplat health check: " + "; ".join(node.failures))
                node.marked = "quarantined, drained"
            except MlplatError as err:
                node.marked = f"quarantined; {err}"


def _log_run(report: HealthReport, cfg: HealthCheckConfig, profile: HardwareProfile, tracking_uri: str | None) -> str:
    tags = {
        "mlplat.health.hardware_profile": profile.name,
        "mlplat.health.passed": str(report.passed),
        "mlplat.health.failed_nodes": ",".join(n.node_id for n in report.failed_nodes),
        "mlplat.health.failed_links": ",".join("-".join(link.nodes) for link in report.failed_links),
    }
    run_name = f"health-check-{report.started_at}"
    run_id = start_run(cfg.experiment, run_name, params=to_flat_params(cfg), tags=tags, tracking_uri=tracking_uri)
    logger = RunLogger(run_id, tracking_uri)
    metrics = {"nodes_checked": len(report.nodes), "nodes_failed": len(report.failed_nodes)}
    for node in report.nodes:
        key = f"node/{node.node_id[:12]}"
        metrics |= {f"{key}/{m}": v for m, v in node.metrics.items()}
        metrics |= {f"{key}/{m}_z": z for m, z in node.z_scores.items()}
        metrics[f"{key}/passed"] = float(node.passed)
    for link in report.links:
        metrics[f"pair/{link.nodes[0][:12]}-{link.nodes[1][:12]}/busbw_gbps"] = link.busbw_gbps
    if report.collective:
        metrics["cluster/allreduce_busbw_gbps"] = report.collective.busbw_gbps
        metrics["cluster/allreduce_algbw_gbps"] = report.collective.algbw_gbps
    logger.log_metrics(metrics)
    logger.log_dict(report.model_dump(mode="json", exclude={"mlflow_run_id"}), "health_report.json")
    logger.end()
    return run_id


def _export_metrics(report: HealthReport) -> None:
    """Each node's figures and verdict as Prometheus gauges (mlplat.observability.catalogue), held by the cluster's
    long-lived health exporter actor (mlplat.health.exporter): this process ends, the gauges stay exported."""
    from mlplat.health import exporter

    try:
        exporter.publish(report)
    except (RayError, GetTimeoutError) as err:  # the verdicts stand (table, MLflow, marks); only the gauges are missing
        import logging

        logging.getLogger(__name__).warning("health check: could not publish the report to the health exporter actor: %s", err)


def _ring_order(nodes: list[dict]) -> list[dict]:
    """The nodes that take part in collectives, in ring order (by address, then id): the GPU nodes, or all on a CPU
    cluster (a CPU-only head beside GPU workers has no NCCL to join)."""
    gpu = [n for n in nodes if n["Resources"].get("GPU", 0) >= 1]
    return sorted(gpu or nodes, key=lambda n: (n["NodeManagerAddress"], n["NodeID"]))


def run_health_check(cfg: HealthCheckConfig, tracking_uri: str | None = None) -> HealthReport:
    """Check every alive node of the connected Ray cluster; act on and record the verdicts."""
    profile = load_hardware_profile(cfg.profile)
    started = time.time()
    alive = [n for n in ray.nodes() if n["Alive"]]
    if unknown := set(cfg.debug_slowdown) - {n["NodeID"] for n in alive}:
        raise ConfigError(f"debug_slowdown: {sorted(unknown)} are not alive nodes of this cluster")
    runnable = [n for n in alive if n["Resources"].get("CPU", 0) >= 1 or n["Resources"].get("GPU", 0) >= 1]
    ring_nodes = _ring_order(runnable)
    _slow_links(cfg, [n["NodeID"] for n in ring_nodes])  # a bad test hook fails before anything runs
    locals_ = {n["NodeID"]: local_ranks(n, cfg.debug_cpu_local_ranks) for n in runnable}
    probes = {node["NodeID"]: _start_probe(node, locals_[node["NodeID"]]) for node in runnable}
    collective, links, phases = None, [], {}
    mark = time.monotonic()

    def phase(name: str) -> None:
        nonlocal mark
        phases[name], mark = time.monotonic() - mark, time.monotonic()

    try:
        outcomes = _measure(probes, cfg, profile.sizes)
        phase("measure")
        nodes = [_merge(node, outcomes[node["NodeID"]]) for node in runnable]
        by_id = {n.node_id: n for n in nodes}
        # Every node whose probe measured takes part: a slow node still can, a dead probe cannot.
        ring = [by_id[n["NodeID"]] for n in ring_nodes if not isinstance(outcomes[n["NodeID"]], Exception)]
        backend = "nccl" if any(n["Resources"].get("GPU", 0) >= 1 for n in ring_nodes) else "gloo"
        if cfg.collective and any(locals_[n.node_id] >= 2 for n in ring):
            _intra_node(ring, probes, locals_, cfg, profile.sizes)
            phase("node_all_reduce")
        judge_nodes(nodes, profile, cfg.thresholds)
        if cfg.collective and len(ring) >= 2:
            links = _pairs(ring, probes, locals_, backend, cfg, profile.sizes)
            judge_links(links, nodes, profile, cfg.thresholds)
            phase("pairs")
            # A pair whose all-reduce failed outright would stall the whole cluster's one until its timeout: leave both out.
            broken = {n for link in links if any(f.startswith("all-reduce failed") for f in link.failures) for n in link.nodes}
            members = [(probes[n.node_id], locals_[n.node_id]) for n in ring if n.node_id not in broken]
            if len(members) >= 2:
                collective = _collective(members, backend, cfg, profile.sizes)
                judge_collective(collective, profile)
            phase("cluster_all_reduce")
    finally:
        for probe in probes.values():
            ray.kill(probe)
    report = HealthReport(
        profile=profile.name,
        floors={m: profile.floor(m) for m in profile.expected},
        started_at=time.strftime("%Y%m%d-%H%M%S", time.localtime(started)),
        duration_s=time.time() - started,
        phases_s=phases,
        nodes=nodes,
        skipped_nodes=[f"{n['NodeManagerAddress']} {n['NodeID'][:8]}" for n in alive if n not in runnable],
        collective=collective,
        links=links,
        action=cfg.action,
    )
    if cfg.action != "report":
        _act(report, cfg.action)
    if cfg.export:
        _export_metrics(report)
    if cfg.experiment:
        report.mlflow_run_id = _log_run(report, cfg, profile, tracking_uri)
    if cfg.out:
        Path(cfg.out).write_text(report.model_dump_json(indent=2))
    return report
