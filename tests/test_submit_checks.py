"""What `mlplat submit` checks before a job reaches a cluster, without one: the probe script run by
real Pythons (this venv's; one that cannot import mlplat but has its dependencies; one with
neither), the decision to ship this mlplat with the job or refuse, and the refusal of a multi-node
cluster without a tracking server. The probe as a real job on a real head: tests/test_pipeline_jobs.py."""

from __future__ import annotations

import json
import site
import subprocess
import sys
from pathlib import Path

import pytest

import mlplat
from mlplat.errors import MlplatError
from mlplat.pipeline.jobs import PROBE, ClusterProbe, check_tracking, is_tracking_server, mlplat_requirements, mlplat_shipment

ADDRESS = "http://10.0.0.1:8265"
HEAD = {"is_head_node": True, "resources_total": {"CPU": 8.0}}
WORKER = {"is_head_node": False, "resources_total": {"CPU": 96.0, "GPU": 8.0}}


def probe_with(tmp_path: Path, *python_args: str, **env: str) -> ClusterProbe:
    """PROBE as the cluster runs it (`python -c PROBE REQUIREMENTS`), by this machine's Python with ``python_args``."""
    out = subprocess.run([sys.executable, *python_args, "-c", PROBE, json.dumps(mlplat_requirements())], cwd=tmp_path,
                         env={"PATH": "/usr/bin:/bin", **env}, capture_output=True, text=True, timeout=60, check=True)
    line = next(line for line in out.stdout.splitlines() if line.startswith("MLPLAT_PROBE "))
    return ClusterProbe.from_dict(json.loads(line.removeprefix("MLPLAT_PROBE ")))


def test_a_cluster_with_this_mlplat_gets_nothing_shipped(tmp_path, capsys):
    probe = probe_with(tmp_path, MLFLOW_TRACKING_URI="http://mlflow:5000")
    assert probe.mlplat == mlplat.__version__ and probe.missing == [] and probe.tracking_uri == "http://mlflow:5000"
    assert probe.python == ".".join(map(str, sys.version_info[:3]))
    assert mlplat_shipment(probe, ADDRESS) == [] and capsys.readouterr().out == ""


def test_a_cluster_without_mlplat_but_with_its_dependencies_gets_this_mlplat_shipped(tmp_path, capsys):
    # No site initialisation (-S): the editable install's finder is not loaded, site-packages still hold the dependencies.
    probe = probe_with(tmp_path, "-S", PYTHONPATH=":".join(site.getsitepackages()))
    assert probe.mlplat is None and probe.missing == [] and probe.tracking_uri is None
    assert mlplat_shipment(probe, ADDRESS) == [str(Path(mlplat.__file__).parent)]
    assert capsys.readouterr().out == ("note: the cluster's Python cannot import mlplat: shipping this machine's mlplat "
                                       f"{mlplat.__version__} with the job (runtime_env py_modules)\n")
    other = ClusterProbe(python=probe.python, mlplat="0.0.1", missing=[], tracking_uri=None)  # an older mlplat in the image
    assert mlplat_shipment(other, ADDRESS) == [str(Path(mlplat.__file__).parent)] and "has mlplat 0.0.1" in capsys.readouterr().out


def test_a_cluster_without_mlplats_dependencies_is_refused_in_one_line(tmp_path):
    probe = probe_with(tmp_path, "-I", "-S")  # a bare Python: the head started outside the project's environment
    assert probe.mlplat is None and {"mlflow", "ray", "torch", "transformers"} <= set(probe.missing)
    with pytest.raises(MlplatError) as err:
        mlplat_shipment(probe, ADDRESS)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{ADDRESS}: the cluster's Python {probe.python} lacks ")
    assert "mlflow" in message and "install" in message and "cluster_configs/Dockerfile" in message


@pytest.mark.parametrize(
    "nodes, uri, refused",
    [
        ([HEAD, WORKER], None, True),
        ([HEAD, WORKER], "sqlite:////home/me/mlflow.db", True),
        ([HEAD, WORKER], "/home/me/mlruns", True),
        ([HEAD, WORKER], "file:///mnt/shared/mlruns", True),
        ([{**HEAD, "resources_total": {"CPU": 0.0}}], "sqlite:///mlflow.db", True),  # a head that runs no work: steps land elsewhere
        ([HEAD, WORKER], "http://mlplat-head-svc.team-a.svc:5000", False),
        ([HEAD, WORKER], "https://mlflow.example.com", False),
        ([HEAD, WORKER], "databricks", False),
        ([HEAD], "sqlite:////home/me/mlflow.db", False),  # one node: the driver's store is every step's
        ([HEAD], None, False),
    ],
)
def test_a_multi_node_cluster_needs_a_tracking_server(nodes, uri, refused):
    if not refused:
        check_tracking(nodes, uri, ADDRESS)
        return
    with pytest.raises(MlplatError) as err:
        check_tracking(nodes, uri, ADDRESS)
    message = str(err.value)
    assert "\n" not in message and message.startswith(f"{ADDRESS} is a multi-node cluster ({len(nodes)} nodes) and MLFLOW_TRACKING_URI")
    assert "set MLFLOW_TRACKING_URI (or --env MLFLOW_TRACKING_URI=...) to a tracking server every node reaches" in message


@pytest.mark.parametrize(
    "uri, server",
    [("http://h:5000", True), ("https://mlflow.example.com/", True), ("databricks", True), ("databricks://profile", True),
     ("sqlite:///mlflow.db", False), ("/mnt/shared/mlruns", False), ("file:///x", False), ("", False), (None, False)],
)
def test_tracking_servers(uri, server):
    assert is_tracking_server(uri) is server
