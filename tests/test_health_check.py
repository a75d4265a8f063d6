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
import torch
import yaml
from mlflow.tracking import MlflowClient

from mlplat.errors import ConfigError
from mlplat.health.check import HealthCheckConfig, _best, _merge, _slow_links, pair_waves, ring_pairs
from mlplat.health.hardware import NVML_OK, HardwareProfile, load_hardware_profile
from mlplat.health.measurements import disk_throughput_mbps, nvml_status, rdma_ports
from mlplat.health.ranks import LocalRanks, describe, timed_all_reduce
from mlplat.health.report import HealthReport, LinkReport, NodeReport, Thresholds, judge_links, judge_nodes, render_table, robust_z_scores

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
    good = NodeReport(node_id="good", facts={"gpus": 8, "nvml": NVML_OK, "rdma_ports": [port, port | {"device": "mlx5_1"}]})
    slow_port = port | {"device": "mlx5_1", "rate_gbps": 200.0}
    bad = NodeReport(node_id="bad", facts={"gpus": 7, "nvml": NVML_OK, "rdma_ports": [port, slow_port]})
    judge_nodes([good, bad], profile, Thresholds())
    assert good.passed
    assert bad.failures == [
        "7 GPUs visible, the profile expects 8",
        "1 RDMA ports ACTIVE at >= 400 Gb/s (2 active in all), the profile expects 2",
    ]


def test_a_gpu_profile_fails_a_node_without_nvml_and_a_cpu_profile_does_not():
    gpu_profile, cpu_profile = HardwareProfile(name="g", gpus_per_node=2), load_hardware_profile("cpu-dev")
    status = nvml_status()  # this machine's real probe: no nvidia-ml-py or no driver here, so it says what is missing
    assert status != NVML_OK and ("nvidia-ml-py" in status or "NVML cannot start" in status)
    without = NodeReport(node_id="without", facts={"gpus": 2, "nvml": f"{status} (GPU 0, 1)"})
    watched = NodeReport(node_id="watched", facts={"gpus": 2, "nvml": NVML_OK})
    unprobed = NodeReport(node_id="unprobed", facts={"gpus": 2})
    judge_nodes([without, watched, unprobed], gpu_profile, Thresholds())
    assert watched.passed
    assert without.failures == [f"NVML unavailable: {status} (GPU 0, 1); a GPU profile needs it for the ECC, row-remapping, "
                                "clock-slowdown and XID checks"]  # fmt: skip
    assert unprobed.failures and unprobed.failures[0].startswith("NVML unavailable: not probed")
    # The same node under a CPU profile: NVML is reported (facts), not required.
    same = NodeReport(node_id="without", facts={"gpus": 2, "nvml": status})
    judge_nodes([same], cpu_profile, Thresholds())
    assert same.passed


def _gpu(index: int, tflops: float, nvml: str) -> dict:
    """One local rank's GPU outcome, as mlplat.health.ranks.measure_gpu returns it."""
    return {"id": str(index), "name": "H100", "metrics": {"gpu_bf16_tflops": tflops}, "faults": [], "nvml": nvml}


def test_a_gpu_node_is_its_slowest_gpu_and_fails_where_nvml_could_not_watch_it():
    node = {"NodeID": "n1", "NodeManagerAddress": "10.0.0.1"}
    cpu = {"metrics": {"cpu_matmul_gflops": 100.0}, "facts": {"hostname": "h"}, "faults": []}
    rounds = [cpu | {"gpus": [_gpu(0, 700, NVML_OK), _gpu(1, 600, NVML_OK)]},
              cpu | {"gpus": [_gpu(0, 650, NVML_OK), _gpu(1, 680, NVML_OK)]}]  # fmt: skip
    watched = _merge(node, _best(*rounds))  # each GPU's best round, then the node's slowest GPU
    assert watched.metrics == {"cpu_matmul_gflops": 100.0, "gpu_bf16_tflops": 680.0} and watched.facts["gpus"] == 2
    assert [g["gpu_bf16_tflops"] for g in watched.facts["gpu_figures"]] == [700.0, 680.0] and watched.facts["nvml"] == NVML_OK
    status = nvml_status()  # this machine's real probe result, as a GPU node without nvidia-ml-py would report it
    unwatched = _merge(node, cpu | {"gpus": [_gpu(0, 700, status), _gpu(1, 700, status)]})
    assert unwatched.facts["nvml"] == f"{status} (GPU 0, 1)"
    judge_nodes([watched, unwatched], HardwareProfile(name="g", gpus_per_node=2), Thresholds())
    assert watched.passed and unwatched.failures[0].startswith(f"NVML unavailable: {status} (GPU 0, 1)")


def _ring(busbw: list[float], nodes: str = "abcdefgh") -> tuple[list[LinkReport], list[NodeReport]]:
    """Links of a ring of len(busbw) nodes, link i between node i and node i+1, with these figures."""
    n = len(busbw)
    links = [LinkReport(nodes=(nodes[i], nodes[(i + 1) % n]), backend="gloo", ranks=2, size_mb=4, seconds=1.0, busbw_gbps=b)
             for i, b in enumerate(busbw)]  # fmt: skip
    return links, [NodeReport(node_id=nodes[i]) for i in range(n)]


def test_ring_pairs_and_their_waves():
    assert ring_pairs(1) == [] and ring_pairs(2) == [(0, 1)]
    assert ring_pairs(4) == [(0, 1), (1, 2), (2, 3), (3, 0)]
    assert pair_waves(ring_pairs(4), limit=2) == [[(0, 1), (2, 3)], [(1, 2), (3, 0)]]
    assert pair_waves(ring_pairs(5), limit=9) == [[(0, 1), (2, 3)], [(1, 2), (3, 4)], [(4, 0)]]  # odd ring: a third wave
    assert pair_waves(ring_pairs(4), limit=1) == [[p] for p in ring_pairs(4)]
    # The slow-link test hook names ring neighbours, or the check refuses to start.
    assert _slow_links(HealthCheckConfig(debug_slow_links={"d-a": 10, "b-c": 2}), list("abcd")) == {
        frozenset("ad"): 10.0, frozenset("bc"): 2.0}  # fmt: skip
    with pytest.raises(ConfigError, match="'a-c' is not two ring neighbours"):
        _slow_links(HealthCheckConfig(debug_slow_links={"a-c": 10}), list("abcd"))


def test_one_slow_pair_names_that_link_and_no_node():
    links, nodes = _ring([10.0, 10.3, 1.0, 9.8, 10.1])  # c <-> d slow; c and d are fine with b and e
    judge_links(links, nodes, HardwareProfile(name="p"), Thresholds())
    report = HealthReport(profile="p", started_at="t", duration_s=1.0, nodes=nodes, links=links)
    assert [link.nodes for link in report.failed_links] == [("c", "d")]
    assert links[2].failures == ["bus bandwidth 1 GB/s is an outlier: robust z -12.1 against the pairs' median 10 (threshold -3.5)"]
    assert all(n.passed for n in nodes) and not report.passed
    assert "c <-> d" in render_table(report) and "FAIL pair c <-> d:" in render_table(report)
    # Four nodes on a noisy machine: the good pairs spread widely, the z-score is blunt (-2.2), half the median is not.
    links, nodes = _ring([0.09, 0.58, 0.66, 0.9])
    judge_links(links, nodes, HardwareProfile(name="p"), Thresholds())
    assert links[0].failures == ["bus bandwidth 0.09 GB/s is under 0.5 x the pairs' median 0.62 (robust z -2.2)"]
    assert not any(link.failures for link in links[1:])
    assert not links[0].suspects and all(n.passed for n in nodes)


def test_a_node_slow_with_both_neighbours_is_named_and_fails():
    links, nodes = _ring([10.0, 2.0, 1.5, 9.8, 10.1])  # b-c and c-d slow: node c
    judge_links(links, nodes, HardwareProfile(name="p"), Thresholds())
    report = HealthReport(profile="p", started_at="t", duration_s=1.0, nodes=nodes, links=links)
    assert [n.node_id for n in report.failed_nodes] == ["c"] and report.failed_links == []
    assert nodes[2].failures[0].startswith("network: both of its ring pairs are slow (b <-> c 2 GB/s, c <-> d 1.5 GB/s")
    assert [link.suspects for link in links] == [[], ["c"], ["c"], [], []]
    links, nodes = _ring([0.85, 0.09, 0.1, 0.9])  # four nodes, c slow: its two pairs are half the ring, the median halves
    judge_links(links, nodes, HardwareProfile(name="p"), Thresholds())
    assert [n.node_id for n in nodes if not n.passed] == ["c"] and [link.suspects for link in links] == [[], ["c"], ["c"], []]
    # Below the profile's floor counts too, without a median (two nodes: one pair, nobody to blame but the link).
    pair, two = _ring([0.4], "xy")
    pair = pair[:1]
    judge_links(pair, two, HardwareProfile(name="p", expected={"pair_allreduce_busbw_gbps": 1.0}, tolerance=0.5), Thresholds())
    assert pair[0].failures == ["bus bandwidth 0.4 GB/s is below the profile's floor 0.5"] and not pair[0].suspects
    assert all(n.passed for n in two)


def test_every_pair_slow_blames_no_node_and_a_failed_pair_counts_as_slow():
    links, nodes = _ring([0.1, 0.1, 0.1, 0.1])
    judge_links(links, nodes, HardwareProfile(name="p", expected={"pair_allreduce_busbw_gbps": 1.0}), Thresholds())
    assert all(link.failures and not link.suspects for link in links) and all(n.passed for n in nodes)
    links, nodes = _ring([10.0, 10.0, 10.0, 10.0, 10.0])
    links[0].failures, links[4].failures = ["all-reduce failed: timeout"], ["all-reduce failed: timeout"]  # both of a's pairs
    judge_links(links, nodes, HardwareProfile(name="p"), Thresholds())
    assert [n.node_id for n in nodes if not n.passed] == ["a"] and [link.suspects for link in links] == [["a"], [], [], [], ["a"]]


def test_the_in_place_all_reduce_keeps_the_buffer_on_the_group_device():
    from mlplat import collectives

    buffer = torch.ones(3)
    assert collectives.all_reduce_(buffer, torch.device("cpu")) is buffer  # no process group: left as it is, no copy
    with pytest.raises(ValueError, match="the tensor is on meta, the group's device is cpu"):  # NCCL would refuse it too
        collectives.all_reduce_(torch.ones(3, device="meta"), torch.device("cpu"))


def test_local_ranks_share_the_node_and_form_one_process_group(monkeypatch):
    """The probe's local ranks: this process and a child that sees the same devices, one gloo group, a real all-reduce
    (checked: the group's sum of ones is its size)."""
    import socket
    import time

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what Ray sets for the probe, inherited by every local rank
    started = time.monotonic()
    with LocalRanks(2, threads=1) as ranks:
        seen = ranks.run(describe)
        assert [s["local_rank"] for s in seen] == [0, 1] and seen[0]["pid"] != seen[1]["pid"]
        assert {s["cuda_visible_devices"] for s in seen} == {""}
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        seconds = ranks.run(timed_all_reduce, init_method=f"tcp://127.0.0.1:{port}", first_rank=0, world_size=2,
                            backend="gloo", size_mb=4, trials=3, timeout_s=60)  # fmt: skip
        assert len(seconds) == 2 and all(0 < t < 10 for t in seconds)
        with pytest.raises(RuntimeError, match="local rank"):  # a group that cannot form (world 3, two ranks) fails, and says where
            ranks.run(timed_all_reduce, wait_s=20, init_method=f"tcp://127.0.0.1:{port}", first_rank=0, world_size=3,
                      backend="gloo", size_mb=1, trials=1, timeout_s=1)  # fmt: skip
        assert ranks.run(describe)[1]["pid"] != seen[1]["pid"]  # the failed call stopped the child; the next one starts anew
    print(f"local ranks: {time.monotonic() - started:.1f} s")


def test_one_probe_per_node_runs_the_node_all_reduce_over_its_local_ranks(ray_cluster, tmp_path):
    """The per-node all-reduce path of a GPU node, on the session's one CPU node: its probe actor starts a second local
    rank process (``python -m mlplat.health.ranks`` from inside a Ray worker) and the two time a gloo all-reduce.
    Nothing marked or exported: the session cluster's exporter keeps what tests/test_health_exporter.py gives it."""
    import time

    from mlplat.health.check import run_health_check

    (tmp_path / "profile.yaml").write_text(yaml.safe_dump(
        {"name": "tiny", "sizes": {"cpu_matmul": 64, "memory_mb": 4, "disk_mb": 8, "allreduce_mb": 2, "trials": 2}}))  # fmt: skip
    started = time.monotonic()
    cfg = HealthCheckConfig(profile=str(tmp_path / "profile.yaml"), debug_cpu_local_ranks=2, disk_dir=str(tmp_path),
                            action="report", out=None, experiment=None, export=False)  # fmt: skip
    report = run_health_check(cfg)
    print(f"one-node check with 2 local ranks: {time.monotonic() - started:.1f} s, phases {report.phases_s}")
    [node] = report.nodes
    assert node.metrics["node_allreduce_busbw_gbps"] > 0 and "node_allreduce_busbw_gbps" not in node.z_scores  # one node: no median
    assert node.passed and report.passed and report.links == [] and report.collective is None  # one node: no pairs
    assert list(report.phases_s) == ["measure", "node_all_reduce"]


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

    # The ring of pairwise all-reduces (2 ranks each, gloo): the slowed link is named, and no other pair or node for it:
    # its two nodes pass (each is fine with its other neighbour); the slow node's slowdown is in its measurements only.
    links, slow_link = report["links"], facts["slow_link"]
    assert [tuple(link["nodes"]) for link in links] == [(nodes[i], nodes[(i + 1) % 4]) for i in range(4)]
    assert all(link["backend"] == "gloo" and link["ranks"] == 2 and link["busbw_gbps"] > 0 for link in links)
    print("phases (s):", {k: round(v, 1) for k, v in report["phases_s"].items()})
    failed = [link for link in links if link["failures"]]
    assert [link["nodes"] for link in failed] == [slow_link], {tuple(n[:8] for n in link["nodes"]): link["failures"] for link in links}
    assert failed[0]["suspects"] == [] and all(("outlier" in f or "median" in f) for f in failed[0]["failures"])
    assert failed[0]["busbw_gbps"] < 0.3 * min(link["busbw_gbps"] for link in links if not link["failures"])
    assert not verdicts[slow_link[0]]["failures"] and not verdicts[slow_link[1]]["failures"]
    names = " <-> ".join(f"{verdicts[n]['ip']} {n[:8]}" for n in slow_link)
    assert f"FAIL pair {names}:" in facts["stdout"] and facts["stdout"].count("FAIL pair") == 1

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
    assert run.data.tags["mlplat.health.failed_links"] == "-".join(slow_link)
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
    """In its own process: 4 simulated nodes; `mlplat health check` with one node slowed 10x and, elsewhere in the ring,
    the link between two others slowed 10x; then unmark and drain."""
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
        slow_link = nodes[:2]  # ring neighbours: the ring is ordered by address, then node id (all share one address here)
        argv = ["health", "check", "--address", cluster.address]
        for setting in [
            f"profile={workdir / 'profile.yaml'}",
            "max_concurrent_nodes=1",  # the simulated nodes share two cores: one at a time,
            "rounds=3",  # and round-robin, so that all of them see the same background load
            # tmpfs: the fsync latency of the neighbours' I/O is not the node's
            "disk_dir=/dev/shm" if Path("/dev/shm").is_dir() else f"disk_dir={workdir}",
            f"debug_slowdown={{'{slow}': 10}}",
            f"debug_slow_links={{'{slow_link[0]}-{slow_link[1]}': 10}}",
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
        facts = {"slow": slow, "slow_link": slow_link, "nodes": nodes, "check_exit": check_exit, "stdout": stdout.getvalue()}
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

        def gone() -> bool:
            return slow in marking.draining() or slow not in {n["NodeID"] for n in ray.nodes() if n["Alive"]}

        facts["drained"] = _poll(gone, True)
        facts["alive_after_drain"] = sorted(n["NodeID"] for n in ray.nodes() if n["Alive"])
        (workdir / "facts.json").write_text(json.dumps(facts))
    finally:
        ray.shutdown()
        cluster.shutdown()


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    _scenario(Path(sys.argv[1]))
