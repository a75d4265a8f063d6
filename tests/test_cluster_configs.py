"""cluster_configs/: committed renders are fresh, every KubeRay manifest validates against KubeRay's CRDs
(read from ../shared/schemas/kuberay, never copied here) and every launcher YAML against Ray's own
cluster schema, the security defaults hold, and a bad cluster config is a one-line error."""

from __future__ import annotations

import copy
import json

import pytest
import yaml
from conftest import REPO_ROOT

from mlplat.cli import main
from mlplat.cluster import ClusterConfig, render
from mlplat.cluster.render import OUTPUTS
from mlplat.cluster.validate import CRD_FILES, kuberay_schemas_dir, validate_document, validate_paths
from mlplat.config import load_config

CONFIGS = REPO_ROOT / "cluster_configs"
SCHEMAS = kuberay_schemas_dir()  # $MLPLAT_KUBERAY_SCHEMAS, else ../shared/schemas/kuberay
needs_crds = pytest.mark.skipif(
    not all((SCHEMAS / f).is_file() for f in CRD_FILES.values()),
    reason=f"KubeRay CRDs not at {SCHEMAS} (set MLPLAT_KUBERAY_SCHEMAS to ray-operator/config/crd/bases of kuberay)",
)


def load(name: str) -> dict:
    return yaml.safe_load((CONFIGS / name).read_text())


def example() -> ClusterConfig:
    return load_config(ClusterConfig, CONFIGS / "cluster.yaml")


def test_committed_renders_are_fresh(tmp_path):
    written = render(example(), tmp_path, source="cluster_configs/cluster.yaml")
    assert [p.relative_to(tmp_path).as_posix() for p in written] == list(OUTPUTS)
    for name in OUTPUTS:
        assert (CONFIGS / name).read_text() == (tmp_path / name).read_text(), (
            f"cluster_configs/{name} is stale: run `mlplat cluster render` after changing cluster.yaml or the templates")


@needs_crds
def test_manifests_validate_against_kuberay_crds():
    assert validate_paths([CONFIGS / "kuberay"], SCHEMAS) == 3
    assert {load(f"kuberay/{n}")["kind"] for n in ("raycluster.yaml", "rayjob-sft.yaml", "rayservice-llm.yaml")} == set(CRD_FILES)


def test_launcher_yamls_validate_against_ray_schema():
    assert validate_paths([CONFIGS / "launcher"]) == 2


def kuberay_case(*args):
    return pytest.param(*args, marks=needs_crds)


@pytest.mark.parametrize(
    "name, edit, expected",
    [
        kuberay_case("kuberay/rayjob-sft.yaml", lambda d: d["spec"].update(entrypointNumGPU=1), "'entrypointNumGPU' was unexpected"),
        kuberay_case("kuberay/rayjob-sft.yaml", lambda d: d["spec"].update(shutdownAfterJobFinishes="yes"), "spec.shutdownAfterJobFinishes"),
        kuberay_case("kuberay/raycluster.yaml", lambda d: d["spec"]["authOptions"].update(mode="on"), "spec.authOptions.mode"),
        kuberay_case("kuberay/raycluster.yaml", lambda d: d["spec"]["workerGroupSpecs"][0].pop("maxReplicas"), "'maxReplicas' is a required"),
        kuberay_case("kuberay/raycluster.yaml", lambda d: d["metadata"].update(name="Bad_Name"), "metadata.name"),
        kuberay_case("kuberay/rayservice-llm.yaml",
                     lambda d: d["spec"].update(serveConfigV2=d["spec"]["serveConfigV2"].replace("mode: pd", "mode: pdd")), "args: mode"),
        kuberay_case("kuberay/raycluster.yaml", lambda d: d["spec"]["gcsFaultToleranceOptions"].update(backend="etcd"),
                     "spec.gcsFaultToleranceOptions.backend"),
        kuberay_case("kuberay/rayservice-llm.yaml",
                     lambda d: spec_of(d)["gcsFaultToleranceOptions"]["redisPassword"]["valueFrom"]["secretKeyRef"].pop("key"),
                     "'key' is a required"),
        kuberay_case("kuberay/raycluster.yaml", lambda d: d["spec"]["gcsFaultToleranceOptions"].update(redisPasword={"value": "x"}),
                     "'redisPasword' was unexpected"),
        ("launcher/aws.yaml", lambda d: d.update(head_node_type="cpu-head"), "head_node_type"),
        ("launcher/aws.yaml", lambda d: d.update(max_worker=4), "'max_worker' was unexpected"),
    ],
)
def test_validation_names_the_broken_field(name, edit, expected):
    doc = copy.deepcopy(load(name))
    assert validate_document(doc, SCHEMAS) == []
    edit(doc)
    problems = validate_document(doc, SCHEMAS)
    assert problems and any(expected in p for p in problems), problems


def test_security_defaults_in_every_config():
    cfg = example()
    for name in ("kuberay/raycluster.yaml", "kuberay/rayjob-sft.yaml", "kuberay/rayservice-llm.yaml"):
        doc = load(name)
        spec = {"RayCluster": lambda s: s, "RayJob": lambda s: s["rayClusterSpec"], "RayService": lambda s: s["rayClusterConfig"]}[
            doc["kind"]](doc["spec"])
        assert spec["authOptions"] == {"mode": "token", "secretName": cfg.ray_token_secret}, name
        assert spec["headGroupSpec"]["serviceType"] == "ClusterIP", name  # dashboard/Jobs API not exposed outside
        for group in spec["workerGroupSpecs"]:
            pod = group["template"]["spec"]
            limits = pod["containers"][0]["resources"]["limits"]
            assert limits["nvidia.com/gpu"] == "8" and limits[cfg.rdma.resource] == "1", name
            env = {e["name"]: e for e in pod["containers"][0]["env"]}
            assert {"NCCL_IB_HCA", "NCCL_SOCKET_IFNAME", "NCCL_IB_GID_INDEX"} <= set(env), name
            assert all("valueFrom" in e for n, e in env.items() if "KEY" in n or "TOKEN" in n), name  # secrets by reference only
            shm = next(v for v in pod["volumes"] if v["name"] == "dshm")
            assert shm["emptyDir"] == {"medium": "Memory", "sizeLimit": cfg.gpu_workers.shm}
    for name in ("launcher/aws.yaml", "launcher/local.yaml"):
        doc = load(name)
        assert all("RAY_AUTH_MODE=token" in c for c in doc["head_start_ray_commands"] + doc["worker_start_ray_commands"] if "ray start" in c)
        assert "--dashboard-host=127.0.0.1" in doc["head_start_ray_commands"][-1]


def test_job_and_service_shapes():
    cfg = example()
    job = load("kuberay/rayjob-sft.yaml")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == cfg.tenant
    assert job["spec"]["shutdownAfterJobFinishes"] is True  # Kueue admits RayJobs only so
    assert job["spec"]["entrypoint"].startswith(f"mlplat train sft --config {cfg.sft.config} --address auto")
    assert "num_workers=16" in job["spec"]["entrypoint"]
    service = load("kuberay/rayservice-llm.yaml")
    app = yaml.safe_load(service["spec"]["serveConfigV2"])["applications"][0]
    assert app["import_path"] == "serve_apps.llm:app_builder" and app["args"]["auth"]["enabled"] is True
    groups = {g["groupName"]: g for g in service["spec"]["rayClusterConfig"]["workerGroupSpecs"]}
    for role in ("prefill", "decode"):  # replicas need the custom resource only their own group offers
        assert app["args"][role]["resources"] == {role: 1}
        assert json.loads(json.loads(groups[role]["rayStartParams"]["resources"])) == {role: 8}
        env = {e["name"]: e for e in groups[role]["template"]["spec"]["containers"][0]["env"]}
        assert env["MLPLAT_API_KEYS"]["valueFrom"]["secretKeyRef"] == {"name": cfg.llm.api_keys_secret, "key": "api_keys"}


def test_render_follows_the_config(tmp_path):
    cfg = load_config(ClusterConfig, CONFIGS / "cluster.yaml", ["rdma.enabled=false", "gpu_workers.nodes=4", "gpu_workers.max_nodes=4",
                                                                "tenant=team-b", "gpu_type=A100"])
    render(cfg, tmp_path)
    cluster = yaml.safe_load((tmp_path / "kuberay/raycluster.yaml").read_text())
    assert cluster["metadata"]["namespace"] == "team-b" and cluster["spec"]["enableInTreeAutoscaling"] is False
    pod = cluster["spec"]["workerGroupSpecs"][0]["template"]["spec"]
    assert pod["nodeSelector"] == {"nvidia.com/gpu.product": "NVIDIA-A100-SXM4-80GB"}
    assert cfg.rdma.resource not in pod["containers"][0]["resources"]["limits"]
    assert {"name": "NCCL_IB_DISABLE", "value": "1"} in pod["containers"][0]["env"]
    assert "num_workers=32" in yaml.safe_load((tmp_path / "kuberay/rayjob-sft.yaml").read_text())["spec"]["entrypoint"]
    assert yaml.safe_load((tmp_path / "launcher/aws.yaml").read_text())["available_node_types"]["gpu"]["node_config"]["InstanceType"] == "p4de.24xlarge"


@pytest.mark.parametrize(
    "edit, field",
    [("gpu_workers: {nods: 3}", "gpu_workers.nods: unknown field"), ("tenant: Team_A", "tenant:"),
     ("gpu_workers: {nodes: 4, max_nodes: 2}", "gpu_workers:"), ("gpu_type: V100", "gpu_type:"),
     ("gcs_fault_tolerance: {redis_address: redis}", "gcs_fault_tolerance.redis_address:"),
     ("gcs_fault_tolerance: {password_secret: mlplat-redis}", "gcs_fault_tolerance.redis_address: Field required"),
     ("mlflow_tracking_uri: sqlite:///mlflow.db", "mlflow_tracking_uri:"),
     ("shared_pvc: null", "set shared_pvc")],
)
def test_bad_cluster_config_is_a_one_line_error(tmp_path, capsys, edit, field):
    config = tmp_path / "cluster.yaml"
    config.write_text(f"image: registry.example.com/mlplat:0.1.0\n{edit}\n")
    with pytest.raises(SystemExit) as exit_:
        main(["cluster", "render", "--config", str(config), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.startswith("mlplat: error: ") and field in err, err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert not (tmp_path / "out").exists()


def test_validate_cli(capsys, tmp_path):
    main(["cluster", "validate", str(CONFIGS / "launcher")])
    assert capsys.readouterr().out.strip() == "2 documents valid"
    (tmp_path / "notes.yaml").write_text("hello: world\n")
    with pytest.raises(SystemExit) as exit_:
        main(["cluster", "validate", str(tmp_path)])
    assert exit_.value.code == 2 and "neither a KubeRay manifest" in capsys.readouterr().err


def spec_of(doc: dict) -> dict:
    return {"RayCluster": lambda s: s, "RayJob": lambda s: s["rayClusterSpec"], "RayService": lambda s: s["rayClusterConfig"]}[doc["kind"]](
        doc["spec"])


def test_head_can_fail_and_every_node_tracks_to_one_server():
    cfg = example()
    server_uri = f"http://{cfg.name}-head-svc.{cfg.k8s_namespace}.svc:{cfg.mlflow_server.port}"
    for name in ("kuberay/raycluster.yaml", "kuberay/rayjob-sft.yaml", "kuberay/rayservice-llm.yaml"):
        doc = load(name)
        spec = spec_of(doc)
        ft = spec.get("gcsFaultToleranceOptions")
        if doc["kind"] == "RayJob":  # its cluster lives as long as the job: nothing to keep across a head restart
            assert ft is None, name
        else:  # GCS tables in Redis, the password from a Secret (by reference only)
            assert ft == {"redisAddress": cfg.gcs_fault_tolerance.redis_address,
                          "redisPassword": {"valueFrom": {"secretKeyRef": {"name": "mlplat-redis", "key": "password"}}}}, name
        pods = [spec["headGroupSpec"]["template"]["spec"]] + [g["template"]["spec"] for g in spec["workerGroupSpecs"]]
        for pod in pods:  # every node, head and workers, tracks to the same server
            env = {e["name"]: e.get("value") for e in pod["containers"][0]["env"]}
            assert env["MLFLOW_TRACKING_URI"] == server_uri, name
    head = load("kuberay/raycluster.yaml")["spec"]["headGroupSpec"]["template"]["spec"]
    ray_head, mlflow = head["containers"]
    assert ray_head["name"] == "ray-head" and {"containerPort": 5000, "name": "mlflow"} in ray_head["ports"]  # the head Service's port
    command = mlflow["command"][-1]
    assert "mlflow server --host 0.0.0.0 --port 5000 --workers 2 --backend-store-uri sqlite:////mnt/shared/mlflow/mlflow.db" in command
    assert f"--allowed-hosts {cfg.name}-head-svc.{cfg.k8s_namespace}.svc:5000," in command  # MLflow checks the Host header
    assert {"name": "shared", "mountPath": "/mnt/shared"} in mlflow["volumeMounts"]  # the store outlives the pod
    for name in ("launcher/aws.yaml", "launcher/local.yaml"):
        doc = load(name)
        text = (CONFIGS / name).read_text()
        assert ".svc" not in text, name  # nothing a VM cannot resolve
        head_start, worker_start = doc["head_start_ray_commands"], doc["worker_start_ray_commands"][-1]
        assert any(c.startswith("nohup sh -c 'mkdir -p /mnt/shared/mlflow") and "exec mlflow server" in c for c in head_start), name
        ray_start = head_start[-1]
        assert f"RAY_REDIS_ADDRESS={cfg.gcs_fault_tolerance.launcher_redis_address}" in ray_start, name
        assert '--redis-password="$(cat ~/.ray/redis_password)"' in ray_start and "~/.ray/redis_password" in doc["file_mounts"], name
        assert "MLFLOW_TRACKING_URI=http://$(hostname -I | cut -d' ' -f1):5000" in ray_start, name
        assert "MLFLOW_TRACKING_URI=http://$RAY_HEAD_IP:5000" in worker_start, name
        assert "RAY_gcs_rpc_server_reconnect_timeout_s=600" in worker_start, name  # workers outwait a head restart


def test_given_tracking_server_and_no_gcs_ft(tmp_path):
    overrides = ["mlflow_tracking_uri=https://mlflow.example.com", "gcs_fault_tolerance=null"]
    cfg = load_config(ClusterConfig, CONFIGS / "cluster.yaml", overrides)
    render(cfg, tmp_path)
    cluster = yaml.safe_load((tmp_path / "kuberay/raycluster.yaml").read_text())
    head = cluster["spec"]["headGroupSpec"]["template"]["spec"]
    assert "gcsFaultToleranceOptions" not in cluster["spec"] and [c["name"] for c in head["containers"]] == ["ray-head"]
    assert {"name": "MLFLOW_TRACKING_URI", "value": "https://mlflow.example.com"} in [
        {k: e[k] for k in ("name", "value") if k in e} for e in head["containers"][0]["env"]]
    aws = yaml.safe_load((tmp_path / "launcher/aws.yaml").read_text())
    assert aws["head_start_ray_commands"][1].startswith("RAY_AUTH_MODE=token MLFLOW_TRACKING_URI=https://mlflow.example.com ray start")
    assert "REDIS" not in (tmp_path / "launcher/aws.yaml").read_text() and "redis_password" not in aws["file_mounts"]
    # A Kubernetes Service name never reaches the launcher's VMs: they run the head's server instead.
    overrides = ["mlflow_tracking_uri=http://mlflow.mlflow.svc:5000", "gcs_fault_tolerance.launcher_redis_address=null"]
    render(load_config(ClusterConfig, CONFIGS / "cluster.yaml", overrides), tmp_path)
    aws = yaml.safe_load((tmp_path / "launcher/aws.yaml").read_text())
    assert "MLFLOW_TRACKING_URI=http://$RAY_HEAD_IP:5000" in aws["worker_start_ray_commands"][-1]
    assert ".svc" not in (tmp_path / "launcher/aws.yaml").read_text() + (tmp_path / "launcher/local.yaml").read_text()
    assert "http://mlflow.mlflow.svc:5000" in (tmp_path / "kuberay/rayjob-sft.yaml").read_text()
    assert "RAY_REDIS_ADDRESS" not in (tmp_path / "launcher/aws.yaml").read_text()  # redis.redis.svc: no launcher GCS FT
    assert "redisAddress: \"redis.redis.svc:6379\"" in (tmp_path / "kuberay/raycluster.yaml").read_text()



def test_the_heads_tracking_server_command_parses_and_admits_the_pods():
    """The RayCluster's mlflow container command, as MLflow's own CLI parses it (no server started: ~40 s on 2 cores),
    and MLflow's own Host-header check admits the URI every pod tracks to (the head Service's name) and nothing else."""
    import shlex

    from mlflow.cli import server
    from mlflow.server.security_utils import is_allowed_host_header

    head = load("kuberay/raycluster.yaml")["spec"]["headGroupSpec"]["template"]["spec"]
    sh, dash_c, script = head["containers"][1]["command"]
    setup, _, run = script.partition(" && exec ")
    assert (sh, dash_c) == ("sh", "-c") and setup.startswith("mkdir -p ")
    argv = shlex.split(run)
    assert argv[:2] == ["mlflow", "server"]
    params = server.make_context("server", argv[2:]).params  # unknown or malformed flags raise here
    assert params["backend_store_uri"] == "sqlite:////mnt/shared/mlflow/mlflow.db" and params["port"] == 5000
    allowed = params["allowed_hosts"].split(",")
    uri = next(e["value"] for e in head["containers"][0]["env"] if e["name"] == "MLFLOW_TRACKING_URI")
    for host in (uri.removeprefix("http://"), "localhost:5000", "127.0.0.1:5000"):  # the pods; a port-forward
        assert is_allowed_host_header(allowed, host), host
    assert not is_allowed_host_header(allowed, "attacker.example.com")
