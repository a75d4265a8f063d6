"""Node acceptance check: verdicts on synthetic figures, profiles, sysfs parsing, and a real multi-node run.

The multi-node run needs its own Ray cluster (``ray.cluster_utils.Cluster``, 4 simulated
nodes), which cannot share this process with the session cluster: this module runs itself
as a script in a subprocess for it (``python tests/test_health_check.py WORKDIR``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from mlplat.errors import ConfigError
from mlplat.health.hardware import HardwareProfile, load_hardware_profile
from mlplat.health.measurements import disk_throughput_mbps, rdma_ports
from mlplat.health.report import NodeReport, Thresholds, judge_nodes, robust_z_scores

CPU_FIGURES = {"cpu_matmul_gflops": 100.0, "memory_bandwidth_gbps": 20.0, "disk_write_mbps": 500.0, "disk_read_mbps": 900.0}


def _nodes(*scales: float, **facts) -> list[NodeReport]:
    return [NodeReport(node_id=f"node{i}", metrics={k: v * s for k, v in CPU_FIGURES.items()}, facts=facts) for i, s in enumerate(scales)]


def test_robust_z_flags_the_slow_node_only_and_tolerates_a_tight_cluster():
    scores = robust_z_scores({"a": 100, "b": 102, "c": 98, "d": 101, "e": 40}, mad_floor=0.05)
    assert scores["e"] < -3.5 and all(abs(scores[k]) < 1 for k in "abcd")
    # Identical figures give MAD 0: the floor keeps a 2% difference from looking infinite.
    assert robust_z_scores({"a": 100, "b": 100, "c": 100, "d": 98}, mad_floor=0.05)["d"] == pytest.approx(-0.27, abs=0.01)


def test_judge_nodes_against_profile_and_median():
    profile = HardwareProfile(name="p", tolerance=0.2, expected={"cpu_matmul_gflops": 100.0})  # floor 80
    nodes = _nodes(1.0, 1.03, 0.97, 1.01, 0.5, gpus=0)
    nodes[1].metrics["cpu_matmul_gflops"] = 78.0  # below the floor, yet not an outlier among 5 (z -2.6)
    judge_nodes(nodes, profile, Thresholds())
    assert [n.passed for n in nodes] == [True, False, True, True, False]
    assert nodes[1].failures == ["cpu_matmul_gflops 78 is below the profile's floor 80 (expected 100 - 20%)"]
    assert len(nodes[4].failures) == 5 and all("outlier" in f for f in nodes[4].failures[1:])  # below the floor, and every figure halved
    assert nodes[4].z_scores["memory_bandwidth_gbps"] < -3.5

    # Two nodes: no median comparison, only the profile.
    pair = _nodes(1.0, 0.5, gpus=0)
    judge_nodes(pair, HardwareProfile(name="p"), Thresholds())
    assert all(n.passed and not n.z_scores for n in pair)


def test_judge_nodes_checks_gpu_count_and_rdma_ports():
    profile = HardwareProfile(name="p", gpus_per_node=8, rdma={"active_ports": 2, "rate_gbps": 400})
    port = {"device": "mlx5_0", "port": 1, "state": "ACTIVE", "rate_gbps": 400.0, "link_layer": "InfiniBand"}
    good = NodeReport(node_id="good", facts={"gpus": 8, "rdma_ports": [port, port | {"device": "mlx5_1"}]})
    bad = NodeReport(node_id="bad", facts={"gpus": 7, "rdma_ports": [port, port | {"device": "mlx5_1", "rate_gbps": 200.0}]})
    judge_nodes([good, bad], profile, Thresholds())
    assert good.passed
    assert bad.failures == [
        "7 GPUs visible, the profile expects 8",
        "1 RDMA ports ACTIVE at >= 400 Gb/s (2 active in all), the profile expects 2",
    ]


def test_rdma_ports_from_sysfs(tmp_path):
    for device, port, state, rate in [("mlx5_0", 1, "4: ACTIVE", "400 Gb/sec (4X NDR)"), ("mlx5_1", 1, "1: DOWN", "10 Gb/sec (4X SDR)")]:
        d = tmp_path / device / "ports" / str(port)
        d.mkdir(parents=True)
        (d / "state").write_text(state + "\n")
        (d / "rate").write_text(rate + "\n")
        (d / "link_layer").write_text("InfiniBand\n")
    ports = rdma_ports(tmp_path)
    assert [(p.device, p.state, p.rate_gbps) for p in ports] == [("mlx5_0", "ACTIVE", 400.0), ("mlx5_1", "DOWN", 10.0)]
    assert rdma_ports(tmp_path / "absent") == []


def test_hardware_profiles_load_by_name_and_reject_typos(tmp_path):
    h100 = load_hardware_profile("h100-8x-ib")
    assert h100.gpus_per_node == 8 and h100.floor("gpu_bf16_tflops") == pytest.approx(650 * 0.8)
    assert load_hardware_profile("cpu-dev").floor("cpu_matmul_gflops") == pytest.approx(20)
    with pytest.raises(ConfigError, match=r"no hardware profile named 'h200'.*cpu-dev"):
        load_hardware_profile("h200")
    typo = tmp_path / "typo.yaml"
    typo.write_text("name: t\nexpected: {cpu_matmul_gflop: 1}\n")
    with pytest.raises(ConfigError, match="expected.cpu_matmul_gflop"):
        load_hardware_profile(str(typo))


def test_disk_measurement_writes_reads_and_cleans_up(tmp_path):
    write, read = disk_throughput_mbps(tmp_path, mb=8, trials=1)
    assert write > 0 and read > 0
    assert list(tmp_path.iterdir()) == []


@pytest.mark.slow
@pytest.mark.cluster
def test_check_on_a_four_node_cluster_flags_marks_and_unmarks_the_slow_node(tracking_uri, tmp_path):
    profile = {
        "name": "test-tiny",
        "expected": {"cpu_matmul_gflops": 1e-3, "allreduce_busbw_gbps": 1e-6},  # floors nobody misses: the median decides
        "sizes": {"cpu_matmul": 384, "memory_mb": 32, "disk_mb": 16, "allreduce_mb": 4, "trials": 2},
    }
    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(profile))
    out = subprocess.run([sys.executable, __file__, str(tmp_path)], capture_output=True, text=True, timeout=400, check=False)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]
    print(out.stdout)
    facts = json.loads((tmp_path / "facts.json").read_text())
    slow, nodes = facts["slow"], facts["nodes"]
    report = json.loads((tmp_path / "report.json").read_text())

    # One probe per node; the slowed node fails on its median comparisons, the other three pass.
    assert facts["check_exit"] == 1 and len(report["nodes"]) == 4
    verdicts = {n["node_id"]: n for n in report["nodes"]}
    assert set(verdicts) == set(nodes)
    assert verdicts[slow]["failures"] and all("outlier" in f for f in verdicts[slow]["failures"])
    assert facts["exported"] == {node: node != slow for node in nodes}  # what the health gauges export (mlplat.health.exporter)
    assert [n for n, v in verdicts.items() if v["failures"]] == [slow], {n[:8]: v["failures"] for n, v in verdicts.items()}
    assert verdicts[slow]["metrics"]["cpu_matmul_gflops"] < 0.5 * verdicts[nodes[0]]["metrics"]["cpu_matmul_gflops"]
    collective = report["collective"]
    assert collective["backend"] == "gloo" and collective["ranks"] == 4 and collective["busbw_gbps"] > 0
    assert collective["busbw_gbps"] == pytest.approx(collective["algbw_gbps"] * 2 * 3 / 4)
    assert f"FAIL {verdicts[slow]['ip']} {slow[:8]} [quarantined]" in facts["stdout"]

    # Marked: the slow node lost the accepted-node resource, opted-in tasks spread over the other three only.
    assert facts["accepted"] == {n: (0.0 if n == slow else 1.0) for n in nodes}
    assert facts["quarantined"] == [slow]
    states = {line.split()[1]: line.split()[2] for line in facts["nodes_table"].splitlines()}  # `mlplat health nodes`
    assert states == {n: "quarantined" if n == slow else "accepted" for n in nodes}
    assert set(facts["opted_in_ran_on"]) <= set(nodes) - {slow}
    # Reversible: unmark by id prefix brings it back; draining is the one-way option.
    assert facts["accepted_after_unmark"] == 1.0 and facts["quarantined_after_unmark"] == []
    assert facts["drained"] and facts["alive_after_drain"] in (nodes, sorted(set(nodes) - {slow}))

    # MLflow: one run with per-node figures, the failed node in a tag, the report as an artifact.
    client = MlflowClient(tracking_uri)
    run = client.get_run(report["mlflow_run_id"])
    assert run.data.tags["mlplat.health.failed_nodes"] == slow and run.data.tags["mlplat.health.passed"] == "False"
    assert run.data.metrics["nodes_failed"] == 1 and run.data.metrics[f"node/{slow[:12]}/passed"] == 0
    assert min(v for k, v in run.data.metrics.items() if k.startswith(f"node/{slow[:12]}/") and k.endswith("_z")) < -3.5
    assert "health_report.json" in [a.path for a in client.list_artifacts(run.info.run_id)]


def _poll(read, expected, timeout_s: float = 60.0):
    """``read()`` once it equals ``expected``, else its last value after ``timeout_s``: the GCS's view of node
    resources catches up with the raylets asynchronously."""
    import time

    deadline = time.monotonic() + timeout_s
    while (value := read()) != expected and time.monotonic() < deadline:
        time.sleep(0.5)
    return value


def _scenario(workdir: Path) -> None:
    """In its own process: 4 simulated nodes; `mlplat health check` with one node slowed 10x; then unmark and drain."""
    import contextlib
    import io

    import ray
    from ray.cluster_utils import Cluster

    from mlplat.cli import main
    from mlplat.health import marking

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    try:
        for _ in range(3):
            cluster.add_node(num_cpus=1)
        cluster.wait_for_nodes()
        ray.init(address=cluster.address, log_to_driver=False)
        nodes = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        slow = nodes[2]
        argv = ["health", "check", "--address", cluster.address]
        for setting in [
            f"profile={workdir / 'profile.yaml'}",
            "max_concurrent_nodes=1",  # the simulated nodes share two cores: one at a time,
            "rounds=3",  # and round-robin, so that all of them see the same background load
            # tmpfs: the fsync latency of the neighbours' I/O is not the node's
            "disk_dir=/dev/shm" if Path("/dev/shm").is_dir() else f"disk_dir={workdir}",
            f"debug_slowdown={{'{slow}': 10}}",
            f"out={workdir / 'report.json'}",
            "experiment=test-health",
        ]:
            argv += ["--set", setting]
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            try:
                main(argv)
                check_exit = 0
            except SystemExit as exit_:
                check_exit = exit_.code
        facts = {"slow": slow, "nodes": nodes, "check_exit": check_exit, "stdout": stdout.getvalue()}
        print(facts["stdout"])

        report = json.loads((workdir / "report.json").read_text())
        verdicts = {n["node_id"]: 0.0 if n["failures"] else 1.0 for n in report["nodes"]}
        resources = ray._private.state.total_resources_per_node  # the GCS's live view (ray.nodes() shows the resources at start)
        facts["accepted"] = _poll(lambda: {node: r.get(marking.ACCEPTED_NODE, 0.0) for node, r in resources().items()}, verdicts)
        facts["quarantined"] = list(marking.quarantined())
        from mlplat.health import exporter

        held = exporter.last_report()  # the check's process has exited its run: the detached exporter actor holds the report
        facts["exported"] = {n["node_id"]: not n["failures"] for n in held["report"]["nodes"]} if held else None
        table = io.StringIO()
        with contextlib.redirect_stdout(table):
            main(["health", "nodes", "--address", cluster.address])
        facts["nodes_table"] = table.getvalue()

        @ray.remote(num_cpus=0, resources={marking.ACCEPTED_NODE: 0.001}, scheduling_strategy="SPREAD")
        def where() -> str:
            return ray.get_runtime_context().get_node_id()

        facts["opted_in_ran_on"] = sorted(set(ray.get([where.remote() for _ in range(12)], timeout=120)))

        main(["health", "unmark", "--address", cluster.address, slow[:10]])
        facts["accepted_after_unmark"] = _poll(lambda: resources()[slow].get(marking.ACCEPTED_NODE, 0.0), 1.0)
        facts["quarantined_after_unmark"] = list(marking.quarantined())
        marking.drain(slow, "test: drain")  # an idle drained node's raylet exits: it goes from draining to dead
        gone = lambda: slow in marking.draining() or slow not in {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        facts["drained"] = _poll(gone, True)
        facts["alive_after_drain"] = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        (workdir / "facts.json").write_text(json.dumps(facts))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    _scenario(Path(sys.argv[1]))
