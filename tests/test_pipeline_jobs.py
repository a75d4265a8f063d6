"""Pipelines as Ray jobs, against a real Ray head started here with `ray start --head`
(loopback, token auth, its own ports and temp dir) in a separate process group."""

import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import pytest
from conftest import MLPLAT, free_ports
from mlflow.tracking import MlflowClient

from mlplat.cli import main as cli_main
from mlplat.pipeline.jobs import Jobs

VENV_BIN = Path(sys.executable).parent

PIPELINE = '''
import json
from pathlib import Path

import ray

from mlplat.pipeline import Dataset, pipeline, step, step_context


@step(num_cpus=0.5)
def make_rows(n: int) -> Dataset:
    out = Path(step_context().workdir) / "rows"
    out.mkdir(parents=True)
    (out / "rows.jsonl").write_text("".join(json.dumps({"x": i}) + "\\n" for i in range(n)))
    return Dataset(out)


@step(num_cpus=0.5, retries=2, retry_backoff_s=0.1)
def flaky_total(rows: Dataset, counter: str) -> dict:
    path = Path(counter)
    attempt = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(attempt))
    if attempt < 3:
        raise ConnectionError(f"transient failure {attempt}")
    total = sum(json.loads(line)["x"] for line in (rows.local_path() / "rows.jsonl").read_text().splitlines())
    return {"total": total, "namespace": ray.get_runtime_context().namespace}


@step(num_cpus=1)
def wait(seconds: float) -> None:
    import time

    time.sleep(seconds)


@pipeline(experiment="jobs-e2e")
def tiny(counter: str, n: int = 5):
    return flaky_total(make_rows(n), counter)


@pipeline(experiment="jobs-sleeper")
def sleeper(seconds: float = 600):
    wait(seconds)
'''

TENANTS = "tenants:\n  research: {cpus: 4}\n  small: {cpus: 2, gpus: 0}\n"


def _wait_for_dashboard(url: str, token: str, head: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 300  # a loaded 2-core machine can take minutes
    request = urllib.request.Request(f"{url}/api/version", headers={"Authorization": f"Bearer {token}"})
    while time.monotonic() < deadline:
        if head.poll() is not None:
            pytest.fail(f"ray start --head exited with {head.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(request, timeout=5) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(1)
    pytest.fail(f"the Ray head's dashboard did not come up:\n{log.read_text()[-3000:]}")


@pytest.fixture(scope="module")
def ray_head():
    """A Ray head with token auth on loopback; stopped by signalling its own process group only."""
    temp_dir = Path(tempfile.mkdtemp(prefix="mlplat-head-", dir="/tmp"))  # short: Ray's socket paths have a length limit
    token_file = temp_dir / "token"
    token_file.write_text(secrets.token_hex(16))
    gcs, dashboard, agent_http, agent_grpc, client, metrics, env_agent, node_manager, object_manager = free_ports(9)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    env |= {"PATH": f"{VENV_BIN}{os.pathsep}{env.get('PATH', '')}", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(token_file)}
    log = temp_dir / "head.log"
    command = [
        str(VENV_BIN / "ray"), "start", "--head", "--block", "--disable-usage-stats", "--num-cpus=4",
        "--node-ip-address=127.0.0.1", f"--port={gcs}", f"--temp-dir={temp_dir}",
        "--include-dashboard=true", "--dashboard-host=127.0.0.1", f"--dashboard-port={dashboard}",
        f"--dashboard-agent-listen-port={agent_http}", f"--dashboard-agent-grpc-port={agent_grpc}",
        f"--ray-client-server-port={client}", f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
        f"--node-manager-port={node_manager}", f"--object-manager-port={object_manager}",
    ]
    with open(log, "w") as out:
        head = subprocess.Popen(command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        address = f"http://127.0.0.1:{dashboard}"
        _wait_for_dashboard(address, token_file.read_text(), head, log)
        yield {"address": address, "token_file": token_file}
    finally:
        _stop_process_group(head)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _stop_process_group(process: subprocess.Popen) -> None:
    """SIGTERM, a short grace, then SIGKILL: to the head's own process group, nothing else."""
    for sig, grace in ((signal.SIGTERM, 5), (signal.SIGKILL, 10)):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            return
        try:
            process.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            pass
    try:  # stragglers of the group, whether or not `ray start` itself is gone
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    root = tmp_path_factory.mktemp("project")
    (root / "jobs_pipeline.py").write_text(PIPELINE)
    (root / "tenants.yaml").write_text(TENANTS)
    return root


def mlplat_in_process(args: list[str], monkeypatch, capsys, **env) -> tuple[int, str, str]:
    """The CLI in this process (no interpreter start-up); env as given, Ray and MLflow variables cleared."""
    for var in [v for v in os.environ if v.startswith(("RAY_", "MLFLOW_"))]:
        monkeypatch.delenv(var)
    for var, value in env.items():
        monkeypatch.setenv(var, value)
    code = 0
    try:
        cli_main(args)
    except SystemExit as exit_:
        code = exit_.code
    out, err = capsys.readouterr()
    return code, out, err


def mlplat(args: list[str], cwd: Path, tracking_uri: str | None = None, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_"))}
    if tracking_uri:
        clean["MLFLOW_TRACKING_URI"] = tracking_uri
    return subprocess.run([MLPLAT, *args], check=False, cwd=cwd, env=clean | env, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
def test_submit_follows_a_pipeline_job_to_success_and_tracks_it(ray_head, project, tracking_uri, tmp_path, monkeypatch, capsys):
    counter = tmp_path / "attempts"
    out = mlplat(
        ["submit", "jobs_pipeline.py", "--pipeline", "tiny", "--param", f"counter={counter}", "--follow",
         "--address", ray_head["address"], "--auth-token-file", str(ray_head["token_file"]),
         "--tenant", "research", "--tenants-file", "tenants.yaml"],
        cwd=project, tracking_uri=tracking_uri,
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    job_id = re.search(r"submitted job (\S+) for tenant research \(requests 0.5 CPU\)", out.stdout).group(1)
    assert f"{ray_head['address']}/#/jobs/{job_id}" in out.stdout
    # --follow streamed the job's own log: the flaky step failed twice, then succeeded.
    assert "flaky_total: attempt 2 failed: ConnectionError: transient failure 2; retrying in 0.2s" in out.stdout
    assert f"job {job_id} succeeded" in out.stdout
    assert counter.read_text() == "3"

    # The runs are in MLflow: the pipeline's run and a child per step, with the step's outputs.
    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("jobs-e2e").experiment_id
    runs = {r.data.tags.get("mlplat.step", "<pipeline>"): r for r in client.search_runs([experiment])}
    assert {name: r.info.status for name, r in runs.items()} == {"<pipeline>": "FINISHED", "make_rows": "FINISHED", "flaky_total": "FINISHED"}
    assert runs["flaky_total"].data.tags["mlplat.step.attempts"] == "3"
    summary = json.loads(Path(client.download_artifacts(runs["<pipeline>"].info.run_id, "pipeline.json", str(tmp_path))).read_text())
    assert summary["outputs"] == {"total": 10, "namespace": "research"}  # the tenant's namespace

    code, listed, err = mlplat_in_process(["jobs", "list", "--tenant", "research", "--address", ray_head["address"]],
                                          monkeypatch, capsys, RAY_AUTH_TOKEN=ray_head["token_file"].read_text())
    assert code == 0 and re.search(rf"{job_id}\s+SUCCEEDED\s+research", listed), listed + err


def test_tenant_quota_counts_running_jobs_and_jobs_stop(ray_head, project, monkeypatch, capsys):
    monkeypatch.chdir(project)
    auth = {"RAY_AUTH_TOKEN_PATH": str(ray_head["token_file"])}
    common = ["--address", ray_head["address"], "--tenant", "small", "--tenants-file", "tenants.yaml"]
    code, out, err = mlplat_in_process(["submit", "jobs_pipeline.py", "--pipeline", "sleeper", *common], monkeypatch, capsys, **auth)
    assert code == 0, err
    job_id = re.search(r"submitted job (small-sleeper-\S+) for tenant small \(requests 1 CPU\)", out).group(1)
    try:
        # 1 CPU for the sleeper's step + 0.5 for this driver, with the first job's 1 CPU held: over the 2-CPU quota.
        code, out, err = mlplat_in_process(["submit", "jobs_pipeline.py", "--pipeline", "sleeper", "--entrypoint-num-cpus", "0.5", *common],
                                           monkeypatch, capsys, **auth)
        assert code == 2 and "submitted" not in out
        assert err == (
            "mlplat: error: tenant 'small': this job requests 1.5 CPUs and the tenant's pending and running jobs hold 1 of its 2: "
            "wait for them (mlplat jobs list --tenant small) or raise its quota\n"
        )
    finally:
        code, out, err = mlplat_in_process(["jobs", "stop", job_id, "--address", ray_head["address"]], monkeypatch, capsys, **auth)
    assert code == 0 and f"stopping job {job_id}" in out, err


def test_token_is_required_and_checked_but_never_printed(ray_head, project, tmp_path, monkeypatch, capsys):
    listing = ["jobs", "list", "--address", ray_head["address"]]
    # A fresh process: Ray adds ~/.ray/auth_token by itself in a process where ray.init enabled token mode.
    missing = mlplat(listing, cwd=project)
    assert missing.returncode == 2 and missing.stderr.count("\n") == 1
    assert "requires a token (Ray token auth): pass --auth-token-file FILE" in missing.stderr
    wrong = tmp_path / "wrong_token"
    wrong.write_text("not-the-token")
    code, out, err = mlplat_in_process([*listing, "--auth-token-file", str(wrong)], monkeypatch, capsys)
    assert code == 2 and "rejected the token from --auth-token-file" in err
    assert "not-the-token" not in out + err


def python_for_jobs(folder: Path, *flags: str, site_packages: bool = False) -> str:
    """A folder with a `python` that stands for another cluster's Python: this interpreter without site
    initialisation (-S: mlplat's editable install is not found), with or without this venv's packages."""
    import site

    folder.mkdir(parents=True)
    extra = f'export PYTHONPATH="${{PYTHONPATH:+$PYTHONPATH:}}{":".join(site.getsitepackages())}"\n' if site_packages else ""
    (folder / "python").write_text(f"#!/bin/sh\n{extra}exec {sys.executable} {' '.join(flags)} \"$@\"\n")
    (folder / "python").chmod(0o755)
    return f"PATH={folder}{os.pathsep}{VENV_BIN}{os.pathsep}/usr/bin{os.pathsep}/bin"


@pytest.mark.slow
def test_submit_checks_the_clusters_python_before_the_job(ray_head, project, tracking_uri, tmp_path):
    """The job's PATH leads to a Python that cannot import mlplat: refused in one line without mlplat's dependencies,
    shipped this machine's mlplat (runtime_env py_modules) with them, which that Python then imports."""
    common = ["submit", "jobs_pipeline.py", "--pipeline", "sleeper", "--param", "seconds=0", "--address", ray_head["address"],
              "--auth-token-file", str(ray_head["token_file"])]
    bare = mlplat([*common, "--env", python_for_jobs(tmp_path / "bare", "-I", "-S")], cwd=project, tracking_uri=tracking_uri)
    assert bare.returncode == 2 and "submitted" not in bare.stdout, bare.stdout + bare.stderr
    errors = [line for line in bare.stderr.splitlines() if "error" in line.lower()]  # besides Ray's INFO lines on the upload
    assert len(errors) == 1 and re.match(r"mlplat: error: \S+: the cluster's Python [0-9.]+ lacks .*mlflow", errors[0]), bare.stderr
    assert "cluster_configs/Dockerfile" in errors[0]

    nosite = python_for_jobs(tmp_path / "nosite", "-S", site_packages=True)
    shipped = mlplat([*common, "--env", nosite], cwd=project, tracking_uri=tracking_uri)
    assert shipped.returncode == 0, shipped.stdout[-3000:] + shipped.stderr[-3000:]
    assert "note: the cluster's Python cannot import mlplat: shipping this machine's mlplat 0.1.0 with the job" in shipped.stdout
    job_id = re.search(r"submitted job (sleeper-\S+)", shipped.stdout).group(1)
    # The job carries the package; its Python imports it from there (the probe again, in the job's own runtime_env:
    # cheaper than following the whole pipeline run, which tests above do).
    jobs = Jobs(ray_head["address"], str(ray_head["token_file"]))
    try:
        runtime_env = jobs.info(job_id).runtime_env
        assert len(runtime_env["py_modules"]) == 1 and runtime_env["env_vars"]["PATH"] == nosite.removeprefix("PATH=")
        assert jobs.probe({k: runtime_env[k] for k in ("working_dir", "py_modules", "env_vars")}).mlplat == "0.1.0"
    finally:
        jobs.stop(job_id)
