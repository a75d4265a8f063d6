"""Ray token authentication, as the cluster configs turn it on: a real `ray start --head` with
RAY_AUTH_MODE=token refuses Jobs API callers without the token and runs a job for one with it.

The head runs in its own process group, temp dir and HOME (so neither ~/.ray/auth_token nor the
session's Ray cluster is touched), on free ports, and is stopped by signalling that group only
(`ray stop` would stop every Ray on the machine). Clients run in subprocesses: Ray reads its auth
mode and token once per process.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import pytest

RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 240  # the machine may be busy with other suites

CLIENT = """
import sys
from ray.job_submission import JobStatus, JobSubmissionClient
try:
    client = JobSubmissionClient(sys.argv[1])
    job = client.submit_job(entrypoint="python -c 'print(40 + 2)'")
    status = client.get_job_status(job)
    while not status.is_terminal():
        status = client.get_job_status(job)
    print(status.value, client.get_job_logs(job).strip().splitlines()[-1])
except Exception as err:
    print("REFUSED", type(err).__name__, str(err).splitlines()[0])
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(home: Path, **extra: str) -> dict[str, str]:
    """This environment without any Ray auth settings, HOME pointing at ``home``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    return {**env, "HOME": str(home), **extra}


def submit(url: str, env: dict[str, str]) -> str:
    """Submit a tiny job from a fresh process; its final status and output line, or why it was refused."""
    out = subprocess.run([sys.executable, "-c", CLIENT, url], env=env, capture_output=True, text=True, timeout=START_TIMEOUT_S, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip()


@pytest.fixture
def token_auth_head():
    """A Ray head with token auth and its dashboard (Jobs API) on loopback; yields (url, token, tmp)."""
    tmp = Path(tempfile.mkdtemp(prefix="rayauth", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    token = secrets.token_hex(32)
    ports = {name: free_port() for name in ("port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port",
                                            "dashboard-agent-grpc-port", "runtime-env-agent-port", "metrics-export-port",
                                            "node-manager-port", "object-manager-port")}
    log = tmp / "head.log"
    head = subprocess.Popen(
        [RAY, "start", "--head", "--block", "--num-cpus=1", "--include-dashboard=true", "--dashboard-host=127.0.0.1",
         f"--temp-dir={tmp / 'ray'}", "--disable-usage-stats", *(f"--{k}={v}" for k, v in ports.items())],
        # No drain on SIGTERM: nothing here to hand over, so stop at once.
        env=clean_env(tmp, RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token, RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S="0"),
        stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + START_TIMEOUT_S
        while "block forever" not in log.read_text():  # printed once every head process is up
            assert head.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.5)
        yield f"http://127.0.0.1:{ports['dashboard-port']}", token, tmp
    finally:
        os.killpg(head.pid, signal.SIGTERM)  # `ray start --block` drains and stops its node
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(head.pid, signal.SIGKILL)  # whatever of that group is left
        except ProcessLookupError:
            pass
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.mark.slow
def test_jobs_api_needs_the_token(token_auth_head):
    url, token, tmp = token_auth_head
    assert httpx.get(f"{url}/api/jobs/", timeout=30).status_code == 401
    assert httpx.get(f"{url}/api/jobs/", headers={"Authorization": "Bearer wrong"}, timeout=30).status_code == 403

    refused = submit(url, clean_env(tmp / "client"))
    assert refused.startswith("REFUSED AuthenticationError") and "token" in refused, refused
    wrong = submit(url, clean_env(tmp / "client", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN="not-the-token"))
    assert wrong.startswith("REFUSED AuthenticationError"), wrong

    assert submit(url, clean_env(tmp / "client", RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=token)) == "SUCCEEDED 42"
