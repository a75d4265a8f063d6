"""``mlplat health check``: acceptance measurements on every node, a collective across them, verdicts, action.

    1. one probe actor per node (one per GPU on GPU nodes), pinned with NodeAffinitySchedulingStrategy(soft=False)
    2. each measures its node (CPU matmul, memory and disk bandwidth, RDMA ports) and its GPU
       (bf16 matmul, HBM, host<->device, NVML health), ``max_concurrent_nodes`` nodes at a time
    3. all probes join one torch.distributed group (gloo on CPU, NCCL on GPU) and time an all-reduce
    4. verdicts against the hardware profile and against the cluster's median (``mlplat.health.report``)
    5. failing nodes quarantined (``mlplat.health.marking``); a table, a JSON file and an MLflow run
"""

from __future__ import annotations

import os
import socket
import statistics
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import ray
import torch
import torch.distributed as dist
from pydantic import Field
from ray.actor import ActorHandle
from ray.exceptions import GetTimeoutError, RayError
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from mlplat.config import Config, to_flat_params
from mlplat.errors import ConfigError, MlplatError
from mlplat.health import marking, measurements
from mlplat.health.hardware import HardwareProfile, MeasurementSizes, load_hardware_profile
from mlplat.health.report import CollectiveReport, HealthReport, NodeReport, Thresholds, judge_collective, judge_nodes
from mlplat.tracking import RunLogger, start_run


class HealthCheckConfig(Config):
    profile: str = "cpu-dev"  # a name in cluster_configs/hardware/ or a path to a profile YAML
    thresholds: Thresholds = Thresholds()
    disk_dir: str | None = None  # where the disk test writes on every node; default: the node's temp directory
    collective: bool = True  # time an all-reduce across all probes (needs two or more)
    max_concurrent_nodes: int | None = Field(default=None, gt=0)  # None: all at once; 1 when simulated nodes share a machine
    # Measure every node this many times, interleaved, keeping each figure's best: where nodes share hardware
    # (simulated nodes, a busy machine), every node then sees the same background load.
    rounds: int = Field(default=1, gt=0)
    action: Literal["report", "mark", "drain"] = "mark"  # mark: accept passing nodes, quarantine failing ones; drain: also drain them
    out: str | None = "health_report.json"  # the report as JSON; None: not written
    experiment: str | None = "mlplat-health"  # MLflow experiment of the check's run; None: no run
    timeout_s: float = Field(default=900.0, gt=0)  # for each wave of probes and for the collective
    debug_slowdown: dict[str, float] = Field(default_factory=dict)  # test hook: node id -> factor that node's timed trials are stretched by


@ray.remote
class NodeProbe:
    """Measures the node it is pinned to; with a GPU assigned, that GPU too."""

    def __init__(self, node_level: bool, threads: int):
        self.node_level = node_level
        torch.set_num_threads(max(1, min(threads, os.cpu_count() or 1)))  # the whole node, not the one CPU Ray reserved

    def measure(self, sizes: MeasurementSizes, disk_dir: str | None, slowdown: float) -> dict[str, Any]:
        metrics: dict[str, float] = {}
        facts: dict[str, Any] = {"hostname": socket.gethostname()}
        faults: list[str] = []
        if torch.cuda.is_available():
            device = torch.device("cuda", 0)  # Ray assigned this probe one GPU
            gpu = measurements.GpuHealth(device)  # watching for XIDs from before the load starts
            metrics |= measurements.gpu_figures(device, sizes, slowdown)
            gpu_id = ray.get_gpu_ids()[0]  # the node's numbering, as in CUDA_VISIBLE_DEVICES
            faults += [f"GPU {gpu_id}: {fault}" for fault in gpu.faults()]
            facts["gpu"] = {"id": gpu_id, "name": torch.cuda.get_device_name(device), **gpu.facts}
        if self.node_level:
            directory = Path(disk_dir) if disk_dir else Path(os.environ.get("TMPDIR", "/tmp"))
            metrics["cpu_matmul_gflops"] = measurements.cpu_matmul_gflops(sizes.cpu_matmul, sizes.trials, slowdown)
            metrics["memory_bandwidth_gbps"] = measurements.memory_bandwidth_gbps(sizes.memory_mb, sizes.trials, slowdown)
            write, read = measurements.disk_throughput_mbps(directory, sizes.disk_mb, sizes.trials, slowdown)
            metrics |= {"disk_write_mbps": write, "disk_read_mbps": read}
            ports = measurements.rdma_ports()
            facts |= {
                "cpu_threads": torch.get_num_threads(),
                "disk_dir": str(directory),
                "disk_fs": measurements.filesystem_type(directory),
                "rdma_ports": [p.model_dump() for p in ports],
            }
            faults += [f"RDMA port {p.device}/{p.port} is {p.state}" for p in ports if p.state != "ACTIVE"]
        return {"metrics": metrics, "facts": facts, "faults": faults}

    def rendezvous(self) -> str:
        """A TCP address on this node for torch.distributed's store (this probe is rank 0)."""
        with socket.socket() as s:
            s.bind(("", 0))
            port = s.getsockname()[1]
        return f"tcp://{ray.util.get_node_ip_address()}:{port}"

    def all_reduce(self, init_method: str, rank: int, world_size: int, size_mb: int, trials: int, timeout_s: float) -> float:
        """Median seconds of one all-reduce of ``size_mb`` MiB of fp32 across the group."""
        backend = "nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size, timeout=timedelta(seconds=timeout_s))
        try:
            device = torch.device("cuda", 0) if backend == "nccl" else torch.device("cpu")
            sync = (lambda: torch.cuda.synchronize(device)) if backend == "nccl" else (lambda: None)
            tensor = torch.ones(size_mb * 2**20 // 4, dtype=torch.float32, device=device)
            dist.all_reduce(tensor)  # the first one also sets up the connections
            sync()
            times = []
            for _ in range(trials):
                start = time.perf_counter()
                dist.all_reduce(tensor)
                sync()
                times.append(time.perf_counter() - start)
            return statistics.median(times)
        finally:
            dist.destroy_process_group()


@dataclass
class _Probe:
    node_id: str
    actor: ActorHandle
    gpu: bool


def _start_probes(node: dict) -> list[_Probe]:
    """One probe per GPU on GPU nodes (the first also measures the node), else one, pinned to ``node``."""
    affinity = NodeAffinitySchedulingStrategy(node["NodeID"], soft=False)
    threads, gpus = int(node["Resources"].get("CPU", 1)), int(node["Resources"].get("GPU", 0))
    if not gpus:
        return [_Probe(node["NodeID"], NodeProbe.options(num_cpus=1, scheduling_strategy=affinity).remote(True, threads), gpu=False)]
    return [
        _Probe(node["NodeID"], NodeProbe.options(num_cpus=0, num_gpus=1, scheduling_strategy=affinity).remote(i == 0, threads), gpu=True)
        for i in range(gpus)
    ]


def _measure(probes: dict[str, list[_Probe]], cfg: HealthCheckConfig, sizes: MeasurementSizes) -> dict[str, list[dict | Exception]]:
    """Every probe's measurement: ``max_concurrent_nodes`` nodes per wave, all nodes ``rounds`` times over."""
    node_ids = list(probes)
    wave_size = cfg.max_concurrent_nodes or len(node_ids)
    outcomes: dict[str, list[dict | Exception]] = {}
    for _ in range(cfg.rounds):
        for start in range(0, len(node_ids), wave_size):
            refs = {
                node_id: [p.actor.measure.remote(sizes, cfg.disk_dir, cfg.debug_slowdown.get(node_id, 1.0)) for p in probes[node_id]]
                for node_id in node_ids[start : start + wave_size]
            }
            ray.wait([r for rs in refs.values() for r in rs], num_returns=sum(map(len, refs.values())), timeout=cfg.timeout_s)
            for node_id, node_refs in refs.items():
                latest = [_get(ref) for ref in node_refs]
                outcomes[node_id] = [_best(a, b) for a, b in zip(outcomes[node_id], latest, strict=True)] if node_id in outcomes else latest
    return outcomes


def _best(a: dict | Exception, b: dict | Exception) -> dict | Exception:
    """Two rounds of one probe: each figure's best, every fault seen; a failed round fails the probe."""
    if isinstance(a, Exception) or isinstance(b, Exception):
        return a if isinstance(a, Exception) else b
    return {
        "metrics": {m: max(v, b["metrics"].get(m, v)) for m, v in a["metrics"].items()},
        "facts": b["facts"],
        "faults": a["faults"] + [f for f in b["faults"] if f not in a["faults"]],
    }


def _get(ref: ray.ObjectRef) -> dict | Exception:
    try:
        return ray.get(ref, timeout=0)
    except GetTimeoutError:
        return TimeoutError("did not finish within timeout_s (not scheduled, or the node is very slow)")
    except RayError as err:
        return err


def _merge(node: dict, outcomes: list[dict | Exception]) -> NodeReport:
    """One node's report from its probes: the GPU figures are its slowest GPU's, per-GPU ones kept in facts."""
    report = NodeReport(node_id=node["NodeID"], ip=node["NodeManagerAddress"], hostname=node.get("NodeManagerHostname", ""))
    gpus = []
    for index, outcome in enumerate(outcomes):
        if isinstance(outcome, Exception):
            report.failures.append(f"probe {index} failed: {(str(outcome) or type(outcome).__name__).splitlines()[0]}")
            continue
        if gpu := outcome["facts"].pop("gpu", None):
            gpus.append({**gpu, **{m: v for m, v in outcome["metrics"].items() if m.startswith(("gpu_", "host_", "device_"))}})
        for metric, value in outcome["metrics"].items():
            report.metrics[metric] = min(value, report.metrics.get(metric, value))
        report.facts |= outcome["facts"]
        report.failures += outcome["faults"]
    report.facts |= {"gpus": len(gpus), "gpu_figures": gpus} if gpus else {"gpus": 0}
    return report


def _collective(probes: list[_Probe], cfg: HealthCheckConfig, sizes: MeasurementSizes) -> CollectiveReport:
    """All-reduce bus bandwidth across ``probes`` (one rank each), as nccl-tests defines it."""
    n = len(probes)
    report = CollectiveReport(backend="nccl" if all(p.gpu for p in probes) else "gloo", ranks=n, size_mb=sizes.allreduce_mb)
    try:
        init = ray.get(probes[0].actor.rendezvous.remote(), timeout=cfg.timeout_s)
        refs = [p.actor.all_reduce.remote(init, rank, n, sizes.allreduce_mb, sizes.trials, cfg.timeout_s) for rank, p in enumerate(probes)]
        report.seconds = max(ray.get(refs, timeout=cfg.timeout_s))  # the collective is as slow as its slowest rank
    except (RayError, GetTimeoutError) as err:
        report.failures.append(f"all-reduce failed: {str(err).splitlines()[0]}")
        return report
    report.algbw_gbps = sizes.allreduce_mb * 2**20 / report.seconds / 1e9
    report.busbw_gbps = report.algbw_gbps * 2 * (n - 1) / n
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


def run_health_check(cfg: HealthCheckConfig, tracking_uri: str | None = None) -> HealthReport:
    """Check every alive node of the connected Ray cluster; act on and record the verdicts."""
    profile = load_hardware_profile(cfg.profile)
    started = time.time()
    alive = [n for n in ray.nodes() if n["Alive"]]
    if unknown := set(cfg.debug_slowdown) - {n["NodeID"] for n in alive}:
        raise ConfigError(f"debug_slowdown: {sorted(unknown)} are not alive nodes of this cluster")
    runnable = [n for n in alive if n["Resources"].get("CPU", 0) >= 1 or n["Resources"].get("GPU", 0) >= 1]
    probes = {node["NodeID"]: _start_probes(node) for node in runnable}
    try:
        outcomes = _measure(probes, cfg, profile.sizes)
        nodes = [_merge(node, outcomes[node["NodeID"]]) for node in runnable]
        judge_nodes(nodes, profile, cfg.thresholds)
        # Every node whose probes all measured takes part: a slow node still can, a dead probe cannot.
        measured = [node_id for node_id, results in outcomes.items() if not any(isinstance(r, Exception) for r in results)]
        ranks = [p for node_id in measured for p in probes[node_id]]
        collective = None
        if cfg.collective and len(ranks) >= 2:
            collective = _collective(ranks, cfg, profile.sizes)
            judge_collective(collective, profile)
    finally:
        for node_probes in probes.values():
            for p in node_probes:
                ray.kill(p.actor)
    report = HealthReport(
        profile=profile.name,
        floors={m: profile.floor(m) for m in profile.expected},
        started_at=time.strftime("%Y%m%d-%H%M%S", time.localtime(started)),
        duration_s=time.time() - started,
        nodes=nodes,
        skipped_nodes=[f"{n['NodeManagerAddress']} {n['NodeID'][:8]}" for n in alive if n not in runnable],
        collective=collective,
        action=cfg.action,
    )
    if cfg.action != "report":
        _act(report, cfg.action)
    _export_metrics(report)
    if cfg.experiment:
        report.mlflow_run_id = _log_run(report, cfg, profile, tracking_uri)
    if cfg.out:
        Path(cfg.out).write_text(report.model_dump_json(indent=2))
    return report

