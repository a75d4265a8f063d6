"""A head that can fail: a real Ray head whose GCS keeps its tables in a real Redis (Debian's
redis-server, password set), as the KubeRay manifests' `gcsFaultToleranceOptions` and the launcher
configs' RAY_REDIS_ADDRESS set it up. A Serve app (deployed through the Serve REST API, as a
RayService deploys serveConfigV2) and a submitted job's record must outlive the GCS process: it is
killed, and restarted with its own command line within Ray's reconnect timeout (on Kubernetes the
head pod's restart does this; a local Ray does not restart it by itself).

The app is the serving app (serve_apps.llm, colocated: the OpenAI ingress and one engine replica) on
the session's tiny model; its greedy answer must stay the same through the outage.

Everything here is its own: Redis and the head on free ports (Serve's HTTP port included), their
own temp dirs, HOME and process groups; both are stopped, whatever happens, by signalling those
processes only (never `ray stop`, which would stop every Ray on the machine).
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
import uuid
from collections import Counter
from pathlib import Path

import httpx
import pytest
from conftest import free_ports

REDIS, REDIS_CLI = shutil.which("redis-server"), shutil.which("redis-cli")  # Debian: redis-server (redis-cli comes with it)
RAY = str(Path(sys.executable).with_name("ray"))
START_TIMEOUT_S = 120
RECONNECT_TIMEOUT_S = 60  # RAY_gcs_rpc_server_reconnect_timeout_s: raylet, dashboard and workers wait this long for the GCS
ENGINE = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4, "max_waiting": 4}
SMALL = {"num_cpus": 0.2}
PROMPT = {"model": "tiny", "prompt": "12+34=", "max_tokens": 4, "temperature": 0}

pytestmark = [pytest.mark.slow, pytest.mark.cluster]


def redis_cli(port: int, password: str, *command: str) -> str:
    out = subprocess.run([REDIS_CLI, "-p", str(port), "--no-auth-warning", "-a", password, *command],
                         capture_output=True, text=True, timeout=10, check=False)
    return out.stdout


def processes_with(marker: str) -> list[int]:
    """Pids of the processes whose environment holds ``marker``: only those this test started (and their children)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if marker.encode() in (proc / "environ").read_bytes():
                    pids.append(int(proc.name))
            except OSError:
                pass
    return pids


def kill_all(marker: str, groups: list[int]) -> None:
    for sig, grace in ((signal.SIGTERM, 2), (signal.SIGKILL, 5)):
        for pgid in groups:
            try:
                os.killpg(pgid, sig)
            except ProcessLookupError:
                pass
        for pid in processes_with(marker):
            try:
                os.kill(pid, sig)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + grace
        while processes_with(marker) and time.monotonic() < deadline:
            time.sleep(0.1)


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def gcs_server(port: int) -> int:
    """The pid of the GCS serving ``port`` (the session's own Ray has another)."""
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                argv = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if argv[0].endswith(b"gcs_server") and f"--gcs_server_port={port}".encode() in argv:
                return int(proc.name)
    raise AssertionError(f"no gcs_server process serves port {port}")


@pytest.fixture
def redis():
    if REDIS is None or REDIS_CLI is None:
        why = "redis-server is not installed (Debian: apt-get install redis-server; `make test` installs it where apt works)"
        if os.environ.get("CI") == "true":
            pytest.fail(f"{why}; CI=true requires it")
        pytest.skip(why)
    tmp = Path(tempfile.mkdtemp(prefix="redis", dir="/tmp"))
    marker = f"MLPLAT_TEST_REDIS={uuid.uuid4().hex}"
    (port,) = free_ports(1)
    password = secrets.token_hex(16)
    server = subprocess.Popen(
        [REDIS, "--port", str(port), "--bind", "127.0.0.1", "--requirepass", password, "--save", "", "--appendonly", "no",
         "--dir", str(tmp), "--logfile", str(tmp / "redis.log")],
        env={**os.environ, marker.split("=")[0]: marker.split("=")[1]}, stdout=subprocess.DEVNULL, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 30
        while "PONG" not in redis_cli(port, password, "PING"):
            assert server.poll() is None and time.monotonic() < deadline, (tmp / "redis.log").read_text()[-2000:]
            time.sleep(0.1)
        yield port, password
    finally:
        kill_all(marker, [server.pid])
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def ft_head(redis):
    """`ray start --head` with RAY_REDIS_ADDRESS and --redis-password: its GCS stores its tables in that Redis."""
    redis_port, password = redis
    tmp = Path(tempfile.mkdtemp(prefix="rayft", dir="/tmp"))  # short: Ray's socket paths must fit in 107 bytes
    key, value = "MLPLAT_TEST_HEAD", uuid.uuid4().hex
    names = ("port", "dashboard-port", "ray-client-server-port", "dashboard-agent-listen-port", "dashboard-agent-grpc-port",
             "runtime-env-agent-port", "metrics-export-port", "node-manager-port", "object-manager-port", "serve")
    ports = dict(zip(names, free_ports(len(names)), strict=True))
    serve_port = ports.pop("serve")
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "MLFLOW_", "MLPLAT_API_KEYS"))}
    env |= {"HOME": str(tmp), "PATH": f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}", key: value,
            "RAY_REDIS_ADDRESS": f"127.0.0.1:{redis_port}", "RAY_external_storage_namespace": f"mlplat-test-{value[:8]}",
            "RAY_gcs_rpc_server_reconnect_timeout_s": str(RECONNECT_TIMEOUT_S), "RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0"}
    # The engine's C++ kernels: the build `make test` made, not a new one under this HOME.
    env["TORCH_EXTENSIONS_DIR"] = os.environ.get("TORCH_EXTENSIONS_DIR") or str(Path.home() / ".cache" / "torch_extensions")
    log = tmp / "start.log"
    # Not --block: that mode kills the whole node as soon as one of its processes (the GCS, here) dies.
    start = subprocess.Popen(
        [RAY, "start", "--head", "--num-cpus=2", "--node-ip-address=127.0.0.1", "--include-dashboard=true",
         "--dashboard-host=127.0.0.1", f"--temp-dir={tmp / 'ray'}", "--disable-usage-stats", f"--redis-password={password}",
         *(f"--{k}={v}" for k, v in ports.items())],
        env=env, stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )
    try:
        assert start.wait(START_TIMEOUT_S) == 0, log.read_text()[-3000:]
        yield {"dashboard": f"http://127.0.0.1:{ports['dashboard-port']}", "serve": f"http://127.0.0.1:{serve_port}",
               "serve_port": serve_port, "gcs_port": ports["port"], "tmp": tmp, "redis": redis}
    finally:
        kill_all(f"{key}={value}", [start.pid])
        shutil.rmtree(tmp, ignore_errors=True)


def complete(url: str, timeout: float) -> int | str:
    """One greedy completion: its HTTP status (200 only with a completion), or "timeout" (a hang)."""
    try:
        response = httpx.post(f"{url}/v1/completions", json=PROMPT, timeout=timeout)
        return response.status_code if response.status_code != 200 or response.json()["choices"][0]["text"] is not None else response.text
    except httpx.TimeoutException:
        return "timeout"
    except httpx.TransportError as err:
        return type(err).__name__


def answer(url: str) -> str:
    response = httpx.post(f"{url}/v1/completions", json=PROMPT, timeout=30)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def serve_status(dashboard: str) -> str | None:
    try:
        apps = httpx.get(f"{dashboard}/api/serve/applications/", timeout=10).json()["applications"]
    except (httpx.HTTPError, ValueError, KeyError):
        return None
    return apps.get("llm", {}).get("status")


def test_serving_app_and_job_record_survive_a_gcs_restart(ft_head, tiny_model):
    from ray.job_submission import JobSubmissionClient

    dashboard, serve_url = ft_head["dashboard"], ft_head["serve"]
    started = time.monotonic()
    # As a RayService deploys its serveConfigV2: through the dashboard's Serve REST API.
    config = {
        "proxy_location": "HeadOnly",
        "http_options": {"host": "127.0.0.1", "port": ft_head["serve_port"]},
        "applications": [{"name": "llm", "route_prefix": "/", "import_path": "serve_apps.llm:app_builder",
                          "args": {"model": str(tiny_model), "model_name": "tiny", "mode": "colocated", "engine_args": ENGINE,
                                   "colocated": SMALL, "ingress": SMALL, "app_name": "llm"}}],
    }
    assert httpx.put(f"{dashboard}/api/serve/applications/", json=config, timeout=60).status_code == 200
    jobs = JobSubmissionClient(dashboard)
    job_id = jobs.submit_job(entrypoint="python -c 'print(6 * 7)'")
    deadline = time.monotonic() + 300  # ~20 s quiet; a 2-core machine busy with other work has taken over 120 s
    while (status := serve_status(dashboard)) != "RUNNING" or not jobs.get_job_status(job_id).is_terminal():
        assert status not in ("DEPLOY_FAILED", "UNHEALTHY") and time.monotonic() < deadline, httpx.get(
            f"{dashboard}/api/serve/applications/", timeout=10).text[-3000:]
        time.sleep(0.5)
    assert jobs.get_job_info(job_id).status.value == "SUCCEEDED" and "42" in jobs.get_job_logs(job_id)
    before = answer(serve_url)
    deployed = time.monotonic()

    # The GCS dies; remember how it was started, as a pod's restart would.
    pid = gcs_server(ft_head["gcs_port"])
    proc = Path(f"/proc/{pid}")
    argv = [a.decode() for a in (proc / "cmdline").read_bytes().split(b"\0") if a]
    environ = dict(e.decode().split("=", 1) for e in (proc / "environ").read_bytes().split(b"\0") if b"=" in e)
    cwd = os.readlink(proc / "cwd")
    os.kill(pid, signal.SIGKILL)
    killed = time.monotonic()
    while listening(ft_head["gcs_port"]):  # the kernel closes a killed process's sockets as it exits
        assert time.monotonic() - killed < 10, "the killed GCS still listens"
        time.sleep(0.05)

    # While it is down (nothing listens on its port): the app keeps answering (a request may fail with 503), none hangs.
    outage: Counter = Counter()
    while sum(outage.values()) < 5 and time.monotonic() - killed < 8:
        assert not listening(ft_head["gcs_port"]), "the GCS is up again"
        outage[complete(serve_url, 5)] += 1
    assert set(outage) <= {200, 503} and outage[200] >= 1, outage

    # Restarted with its own command line, well within the reconnect timeout: it reloads its tables from Redis.
    gcs_log = ft_head["tmp"] / "gcs-restarted.log"
    with gcs_log.open("w") as out:
        restarted = subprocess.Popen(argv, env=environ, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    assert time.monotonic() - killed < RECONNECT_TIMEOUT_S / 2
    deadline = time.monotonic() + 60
    record, error = None, None
    while record is None or serve_status(dashboard) != "RUNNING":
        assert restarted.poll() is None and time.monotonic() < deadline, f"{error}\n{gcs_log.read_text()[-3000:]}"
        time.sleep(0.5)
        try:
            record = JobSubmissionClient(dashboard).get_job_info(job_id)
        except Exception as err:  # noqa: BLE001  (until the dashboard has reconnected to the new GCS)
            error = err
    assert gcs_server(ft_head["gcs_port"]) == restarted.pid
    assert record.status.value == "SUCCEEDED" and record.entrypoint == "python -c 'print(6 * 7)'"
    assert answer(serve_url) == before
    port, password = ft_head["redis"]
    assert "RAYmlplat-test-" in redis_cli(port, password, "KEYS", "*")  # the tables lived in Redis all along
    print(f"deployed in {deployed - started:.1f}s; outage replies {dict(outage)}; back {time.monotonic() - killed:.1f}s after the kill")
