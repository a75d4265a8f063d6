"""Pipelines as Ray jobs: submit from a laptop through the Jobs API, follow, list, stop.

``mlplat submit pipelines/x.py --address http://HEAD:8265`` validates the pipeline locally
(parameters, DAG), checks the tenant's quota, uploads the project directory as the job's
``working_dir`` (without venvs, MLflow stores and outputs) and runs ``mlplat run`` there:
the job's driver runs the pipeline on the cluster and tracks it where
``MLFLOW_TRACKING_URI`` says.

Token auth (Ray's ``RAY_AUTH_MODE=token``): the token is sent as a bearer header, read from
``--auth-token-file``, else ``RAY_AUTH_TOKEN``, else the file at ``RAY_AUTH_TOKEN_PATH``, else
``~/.ray/auth_token`` when ``RAY_AUTH_MODE=token``. It is never printed or put in the job's
environment.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shlex
import time
import uuid
from collections.abc import Iterator, Sequence
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
        except ConnectionError:
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
            return self.client.submit_job(**kwargs)

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
        else:
            print("note: MLFLOW_TRACKING_URI is not set, so the job tracks into its own working directory on the cluster")
    if (root / "platform" / "mlplat").is_dir():  # this repository: the job imports the uploaded mlplat
        env_vars.setdefault("PYTHONPATH", "platform")

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
        runtime_env={"working_dir": str(root), "excludes": EXCLUDES, "env_vars": env_vars},
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
