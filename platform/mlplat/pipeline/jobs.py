"""Pipelines as Ray jobs: submit from a laptop through the Jobs API, follow, list, stop.

``mlplat submit pipelines/x.py --address http://HEAD:8265`` validates the pipeline locally
(parameters, DAG), checks the tenant's quota, uploads the project directory as the job's
``working_dir`` (without venvs, MLflow stores and outputs) and runs ``mlplat run`` there:
the job's driver runs the pipeline on the cluster and tracks it where
``MLFLOW_TRACKING_URI`` says.

Before the job, a probe job (a second's Python, deleted after) checks the environment the job will
run in: a cluster whose Python cannot import mlplat gets this machine's mlplat shipped with the job
(``runtime_env`` ``py_modules``), one that lacks mlplat's dependencies is refused, and so is a
multi-node cluster whose tracking URI is not a server (a sqlite file on the driver's node is not
seen by steps on other nodes).

Token auth (Ray's ``RAY_AUTH_MODE=token``): the token is sent as a bearer header, read from
``--auth-token-file``, else ``RAY_AUTH_TOKEN``, else the file at ``RAY_AUTH_TOKEN_PATH``, else
``~/.ray/auth_token`` when ``RAY_AUTH_MODE=token``. It is never printed or put in the job's
environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.metadata
import json
import os
import re
import shlex
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

from mlplat.errors import MlplatError
from mlplat.pipeline.tenants import TENANT_KEY, TenantsConfig, check_quota, held_by_tenant, job_metadata

DEFAULT_ADDRESS = "http://127.0.0.1:8265"
# Never uploaded: environments, MLflow stores, run outputs, caches (Ray also honours .gitignore).
EXCLUDES = [
    ".git", ".venv", "venv", ".tox", "**/__pycache__", "*.egg-info", ".pytest_cache", ".ruff_cache",
    "mlruns", "mlartifacts", "mlflow.db", "quickstart", "outputs", "benchmarks/results",
]
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")


def jobs_address(address: str | None) -> str:
    """``--address``, else ``RAY_ADDRESS`` when it is an HTTP address, else the local head; ``http://`` added if missing."""
    env = os.environ.get("RAY_ADDRESS", "")
    address = address or (env if env.startswith(("http://", "https://")) else DEFAULT_ADDRESS)
    return (address if "://" in address else f"http://{address}").rstrip("/")


def auth_token(token_file: str | None = None) -> tuple[str | None, str]:
    """(token or None, where it came from: for messages, never the token itself)."""
    if token_file:
        return _read_token(Path(token_file), "--auth-token-file"), f"--auth-token-file {token_file}"
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "disabled":
        return None, "RAY_AUTH_MODE=disabled"
    if token := os.environ.get("RAY_AUTH_TOKEN", "").strip():
        return token, "RAY_AUTH_TOKEN"
    if path := os.environ.get("RAY_AUTH_TOKEN_PATH"):
        return _read_token(Path(path).expanduser(), "RAY_AUTH_TOKEN_PATH"), f"RAY_AUTH_TOKEN_PATH={path}"
    if os.environ.get("RAY_AUTH_MODE", "").lower() == "token":
        default = Path.home() / ".ray" / "auth_token"
        return _read_token(default, "RAY_AUTH_MODE=token"), str(default)
    return None, "no token"


def _read_token(path: Path, source: str) -> str:
    try:
        token = path.read_text().strip()
    except OSError as err:
        raise MlplatError(f"{source}: cannot read the token file {path} ({err.strerror})") from None
    if not token:
        raise MlplatError(f"{source}: the token file {path} is empty")
    return token


class Jobs:
    """The Ray Jobs API of one cluster, with errors turned into one-line messages."""

    def __init__(self, address: str | None = None, token_file: str | None = None):
        from ray.job_submission import JobSubmissionClient

        self.address = jobs_address(address)
        token, self.token_source = auth_token(token_file)
        headers = {"Authorization": f"Bearer {token}"} if token else None
        with self._errors():
            self.client = JobSubmissionClient(self.address, headers=headers)

    @contextlib.contextmanager
    def _errors(self) -> Iterator[None]:
        import requests
        from ray.exceptions import AuthenticationError

        try:
            yield
        except AuthenticationError as err:
            if "Authentication failed" in str(err):
                raise MlplatError(f"{self.address} rejected the token from {self.token_source}: check it is this cluster's token") from None
            raise MlplatError(
                f"{self.address} requires a token (Ray token auth): pass --auth-token-file FILE, set RAY_AUTH_TOKEN or "
                "RAY_AUTH_TOKEN_PATH, or RAY_AUTH_MODE=token with ~/.ray/auth_token"
            ) from None
        except (ConnectionError, requests.exceptions.ConnectionError):  # requests raises its own, not the builtin
            raise MlplatError(
                f"cannot reach the Ray Jobs API at {self.address}: is a Ray head running there, with its dashboard port open?"
            ) from None
        except RuntimeError as err:  # the API answered with an error status
            raise MlplatError(f"{self.address}: {str(err).strip().splitlines()[0]}") from None

    def list(self, tenant: str | None = None):
        with self._errors():
            jobs = self.client.list_jobs()
        if tenant:
            jobs = [j for j in jobs if (j.metadata or {}).get(TENANT_KEY) == tenant]
        return sorted(jobs, key=lambda j: j.start_time or 0)

    def submit(self, **kwargs) -> str:
        with self._errors():
            return self._submit(**kwargs)

    def _submit(self, agent_wait_s: float = 60, **kwargs) -> str:
        # A head that has just started answers 500 "No available agent to submit job, please try again later" until its
        # node's dashboard agent has registered (seconds; longer on a busy machine): wait for it as that message asks.
        deadline = time.monotonic() + agent_wait_s
        while True:
            try:
                return self.client.submit_job(**kwargs)
            except RuntimeError as err:
                if "No available agent" not in str(err) or time.monotonic() > deadline:
                    raise
            time.sleep(1)

    def status(self, job_id: str) -> str:
        with self._errors():
            return str(self.client.get_job_info(job_id).status.value)

    def info(self, job_id: str):
        with self._errors():
            return self.client.get_job_info(job_id)

    def logs(self, job_id: str) -> str:
        with self._errors():
            return self.client.get_job_logs(job_id)

    def stop(self, job_id: str) -> bool:
        with self._errors():
            return self.client.stop_job(job_id)

    def follow(self, job_id: str) -> str:
        """Print the job's logs as they come until it ends; returns its final status."""
        last_error: list[str] = []

        async def tail() -> None:
            async for chunk in self.client.tail_job_logs(job_id):
                print(chunk, end="", flush=True)
                last_error.extend(line for line in chunk.splitlines() if line.startswith("mlplat: error:"))

        with self._errors():
            asyncio.run(tail())
            status = self.status(job_id)
            for _ in range(50):  # the log stream closes as the job ends; its status follows shortly
                if status in TERMINAL:
                    break
                time.sleep(0.2)
                status = self.status(job_id)
        if status != "SUCCEEDED":
            reason = last_error[-1].removeprefix("mlplat: error: ") if last_error else (self.info(job_id).message or "").strip()
            raise MlplatError(f"job {job_id} {status.lower()}: {reason.splitlines()[0] if reason else 'see mlplat jobs logs ' + job_id}")
        return status

    def dashboard_link(self, job_id: str) -> str:
        return f"{self.address}/#/jobs/{job_id}"

    def nodes(self) -> list[dict]:
        """The cluster's alive nodes (state API), each with ``is_head_node`` and ``resources_total``."""
        with self._errors():
            response = self.client._do_request("GET", "/api/v0/nodes?limit=10000&detail=false")
        if response.status_code != 200:
            raise MlplatError(f"{self.address}: listing the cluster's nodes failed ({response.status_code}): {response.text.strip()[:200]}")
        rows = response.json()["data"]["result"]["result"]
        return [n for n in rows if n.get("state") == "ALIVE"]

    def probe(self, runtime_env: dict, timeout_s: float = 300) -> ClusterProbe:
        """Run PROBE in the job's runtime_env (working_dir, env_vars) on the cluster; the job record is deleted after."""
        requirements = mlplat_requirements()
        with self._errors():
            job_id = self._submit(entrypoint=shlex.join(["python", "-c", PROBE, json.dumps(requirements)]),
                                  runtime_env=runtime_env, entrypoint_num_cpus=0,
                                  submission_id=f"mlplat-probe-{uuid.uuid4().hex[:8]}")
            deadline = time.monotonic() + timeout_s
            while (info := self.client.get_job_info(job_id)).status.value not in TERMINAL:
                if time.monotonic() > deadline:
                    self.client.stop_job(job_id)
                    raise MlplatError(f"{self.address}: the environment probe job {job_id} did not finish in {timeout_s:g}s: "
                                      f"is the cluster busy, or its runtime_env set-up stuck? (mlplat jobs logs {job_id})")
                time.sleep(0.2)
            logs = self.client.get_job_logs(job_id)
            with contextlib.suppress(Exception):  # a probe leaves no record behind; a failed delete costs nothing
                self.client.delete_job(job_id)
        found = re.search(r"^MLPLAT_PROBE (.*)$", logs, re.MULTILINE)
        if info.status.value != "SUCCEEDED" or not found:
            why = (logs.strip().splitlines() or [info.message or "no output"])[-1]
            raise MlplatError(f"{self.address}: the cluster could not run Python for this job ({why}): "
                              "check that `python` on the head's PATH is the cluster's environment")
        return ClusterProbe.from_dict(json.loads(found.group(1)))


# Run on the cluster with the job's runtime_env: what that Python has of what mlplat needs (stdlib only).
PROBE = """
import importlib.metadata as md, importlib.util, json, os, sys
def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None
mlplat = None
if importlib.util.find_spec("mlplat"):
    import mlplat
    mlplat = getattr(mlplat, "__version__", None) or version("mlplat") or "unknown"
print("MLPLAT_PROBE " + json.dumps({"python": "%d.%d.%d" % sys.version_info[:3], "mlplat": mlplat,
      "missing": [d for d in json.loads(sys.argv[1]) if version(d) is None], "tracking_uri": os.environ.get("MLFLOW_TRACKING_URI")}))
"""


@dataclass(frozen=True)
class ClusterProbe:
    python: str  # the job's Python version
    mlplat: str | None  # the mlplat version it imports, None if it cannot
    missing: list[str]  # mlplat's requirements it does not have
    tracking_uri: str | None  # MLFLOW_TRACKING_URI the job will see (ours, else the cluster's)

    @classmethod
    def from_dict(cls, data: dict) -> ClusterProbe:
        return cls(python=data["python"], mlplat=data["mlplat"], missing=list(data["missing"]), tracking_uri=data["tracking_uri"])


def mlplat_requirements() -> list[str]:
    """The distributions this mlplat needs at run time (no extras), by name."""
    from packaging.requirements import Requirement

    names = []
    for text in importlib.metadata.requires("mlplat") or []:
        req = Requirement(text)
        if req.marker is None or req.marker.evaluate({"extra": ""}):
            names.append(req.name)
    return sorted(set(names))


def mlplat_shipment(probe: ClusterProbe, address: str) -> list[str]:
    """``py_modules`` for the job: [] if the cluster runs this mlplat, else this machine's package; refuses what shipping cannot fix."""
    import mlplat

    local = mlplat.__version__
    if probe.missing:
        shown = ", ".join(probe.missing[:6]) + (f" and {len(probe.missing) - 6} more" if len(probe.missing) > 6 else "")
        raise MlplatError(f"{address}: the cluster's Python {probe.python} lacks {shown}, which mlplat needs: run the cluster from "
                          "an image with mlplat installed (cluster_configs/Dockerfile), or start its head from this project's environment")
    if probe.mlplat == local:
        return []
    from packaging.specifiers import SpecifierSet

    needs = importlib.metadata.metadata("mlplat").get("Requires-Python") or ""
    if probe.python not in SpecifierSet(needs):
        raise MlplatError(f"{address}: the cluster's Python {probe.python} cannot run mlplat (needs Python {needs}): "
                          "run the cluster from an image with mlplat installed (cluster_configs/Dockerfile)")
    have = "cannot import mlplat" if probe.mlplat is None else f"has mlplat {probe.mlplat}"
    print(f"note: the cluster's Python {have}: shipping this machine's mlplat {local} with the job (runtime_env py_modules)")
    return [str(Path(mlplat.__file__).parent)]


def is_tracking_server(uri: str | None) -> bool:
    """An MLflow server every node reaches (http(s), Databricks), unlike a file or sqlite store on one node."""
    return bool(uri) and (uri == "databricks" or urlparse(uri).scheme in ("http", "https", "databricks"))


def check_tracking(nodes: list[dict], tracking_uri: str | None, address: str) -> None:
    """Refuse a multi-node cluster (or one whose head runs no work) without a tracking server: steps track where the driver cannot see."""
    head_cpus = next((n.get("resources_total", {}).get("CPU", 0) for n in nodes if n.get("is_head_node")), 0)
    if (len(nodes) > 1 or head_cpus == 0) and not is_tracking_server(tracking_uri):
        where = f"MLFLOW_TRACKING_URI is {tracking_uri}" if tracking_uri else "MLFLOW_TRACKING_URI is not set"
        raise MlplatError(f"{address} is a multi-node cluster ({len(nodes)} nodes) and {where}, a store only the driver's node sees: "
                          "set MLFLOW_TRACKING_URI (or --env MLFLOW_TRACKING_URI=...) to a tracking server every node reaches, "
                          "e.g. the head's http://HEAD:5000 (docs/kubernetes.md#mlflow-tracking-server)")


def submit_pipeline(
    file: str,
    *,
    address: str | None = None,
    pipeline_name: str | None = None,
    overrides: Sequence[str] = (),
    use_cache: bool = True,
    working_dir: str = ".",
    env: Sequence[str] = (),
    tenant: str | None = None,
    tenants_file: str | None = None,
    entrypoint_num_cpus: float | None = None,
    entrypoint_num_gpus: float | None = None,
    token_file: str | None = None,
    follow: bool = False,
) -> str:
    from mlplat.config import load_config
    from mlplat.pipeline.definition import load_pipeline
    from mlplat.tracking import default_tracking_uri

    root = Path(working_dir).resolve()
    path = Path(file).resolve()
    if not path.is_relative_to(root):
        raise MlplatError(f"{file}: the pipeline file must be inside the working directory {root} (set --working-dir)")
    # Validate everything we can here, before anything is uploaded.
    pipe = load_pipeline(path, pipeline_name)
    graph = pipe.build(overrides=overrides)
    request = graph.peak_resources()
    request["CPU"] = request.get("CPU", 0) + (entrypoint_num_cpus or 0)
    request["GPU"] = request.get("GPU", 0) + (entrypoint_num_gpus or 0)
    env_vars = _env_vars(env)

    jobs = Jobs(address, token_file)
    if tenant:
        tenants_file = tenants_file or os.environ.get("MLPLAT_TENANTS_FILE", "cluster_configs/tenants.yaml")
        quota = load_config(TenantsConfig, tenants_file).quota(tenant, tenants_file)
        check_quota(tenant, quota, request, held_by_tenant(jobs.list(), tenant))

    if "MLFLOW_TRACKING_URI" not in env_vars:
        tracking_uri = os.environ.get("MLFLOW_TRACKING_URI")
        if tracking_uri is None and _is_loopback(jobs.address):  # the head is this machine: track where a local run would
            tracking_uri = default_tracking_uri()
        if tracking_uri:
            env_vars["MLFLOW_TRACKING_URI"] = tracking_uri
    if (root / "platform" / "mlplat").is_dir():  # this repository: the job imports the uploaded mlplat
        env_vars.setdefault("PYTHONPATH", "platform")

    runtime_env = {"working_dir": str(root), "excludes": EXCLUDES, "env_vars": env_vars}
    probe = jobs.probe(runtime_env)  # the job's own environment, as the cluster gives it
    check_tracking(jobs.nodes(), probe.tracking_uri, jobs.address)
    if not probe.tracking_uri:
        print("note: MLFLOW_TRACKING_URI is not set, so the job tracks into its own working directory on the cluster")
    if py_modules := mlplat_shipment(probe, jobs.address):
        runtime_env["py_modules"] = py_modules

    command = ["python", "-m", "mlplat.cli", "run", path.relative_to(root).as_posix(), "--pipeline", pipe.name, "--verbose"]  # the job log is the log
    for override in overrides:
        command += ["--param", override]
    if not use_cache:
        command.append("--no-cache")
    if tenant:
        command += ["--namespace", tenant]
    job_id = jobs.submit(
        entrypoint=shlex.join(command),
        submission_id=f"{tenant + '-' if tenant else ''}{pipe.name}-{uuid.uuid4().hex[:8]}",
        runtime_env=runtime_env,
        metadata=job_metadata(tenant, pipe.name, request),
        entrypoint_num_cpus=entrypoint_num_cpus,
        entrypoint_num_gpus=entrypoint_num_gpus,
    )
    held = ", ".join(f"{v:g} {k}" for k, v in request.items() if v) or "no resources"
    print(f"submitted job {job_id}" + (f" for tenant {tenant}" if tenant else "") + f" (requests {held})")
    print(f"  dashboard: {jobs.dashboard_link(job_id)}")
    print(f"  logs:      mlplat jobs logs {job_id} --address {jobs.address} --follow", flush=True)
    if follow:
        jobs.follow(job_id)
        print(f"job {job_id} succeeded")
    return job_id


def _env_vars(pairs: Sequence[str]) -> dict[str, str]:
    env = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise MlplatError(f"--env {pair!r}: expected NAME=VALUE")
        env[key] = value
    return env


def _is_loopback(address: str) -> bool:
    return (urlparse(address).hostname or "") in ("127.0.0.1", "localhost", "::1")
