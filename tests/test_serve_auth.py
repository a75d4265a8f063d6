"""API keys and per-tenant rate limits on the OpenAI ingress: a real Serve app on the session Ray
cluster, over real HTTP. No key: 401. A tenant over its limit: 429 with Retry-After. A tenant
flooding the API does not starve another."""

from __future__ import annotations

import asyncio
import os
import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest
from ray import serve

from mlplat.errors import ConfigError
from mlplat.serve.auth import AuthConfig, build_gatekeeper, is_loopback, parse_api_keys
from mlplat.serve.config import ServeConfig
from serve_apps.llm import build_app

# Small engine queues (as in test_serve.py): 30 concurrent requests overflow them.
ENGINE = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4, "max_waiting": 4}
SMALL = {"num_cpus": 0.2}
LIMITS = {
    "team-a": {"requests_per_s": 0.2, "burst": 2},  # two at once, then one per 5 s
    "flood": {"requests_per_s": 1, "burst": 2},
}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def start_serve() -> str:
    """Serve's HTTP address: the session's running instance, else a new one on a free port (another
    process on this machine may hold 8000; Serve's proxies share a port with SO_REUSEPORT)."""
    from ray.serve.context import _get_global_client  # no public getter for the proxy's port

    if _get_global_client(raise_if_no_controller_running=False) is None:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{_get_global_client().http_config.port}"


def wait_for_route(base: str, prefix: str, timeout_s: float = 120) -> None:
    """The HTTP proxy learns new routes shortly after serve.run returns."""
    deadline = time.monotonic() + timeout_s
    while prefix not in httpx.get(f"{base}/-/routes", timeout=30).json():
        assert time.monotonic() < deadline, f"route {prefix} never appeared"
        time.sleep(0.2)


@pytest.fixture(scope="module")
def app(ray_cluster, tiny_model, tmp_path_factory):
    keys_file = tmp_path_factory.mktemp("secrets") / "api_keys"  # as a mounted Kubernetes Secret
    keys_file.write_text("team-b:key-b\nquiet:key-quiet\n")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TEST_MLPLAT_API_KEYS", "team-a:key-a,flood:key-flood")
        auth = {"keys_env": "TEST_MLPLAT_API_KEYS", "keys_file": str(keys_file), "rate_limits": LIMITS}
        cfg = ServeConfig(model=str(tiny_model), model_name="tiny", mode="colocated", engine_args=ENGINE, colocated=SMALL,
                          ingress=SMALL, auth=auth, app_name="auth", route_prefix="/auth")
        base = start_serve()
        serve.run(build_app(cfg), name="auth", route_prefix="/auth")
    wait_for_route(base, "/auth")
    yield f"{base}/auth/v1"
    serve.delete("auth")


def test_missing_or_unknown_key_is_401(app):
    for headers in ({}, bearer("nope"), {"Authorization": "Basic key-b"}, {"Authorization": "Bearer"}):
        r = httpx.get(f"{app}/models", headers=headers, timeout=60)
        assert r.status_code == 401, (headers, r.text)
        assert set(r.json()["error"]) == {"message", "type", "param", "code", "request_id"} and r.json()["error"]["code"] == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=app, api_key="nope", max_retries=0).models.list()
    # A key from the keys file works, through the openai client.
    client = openai.OpenAI(base_url=app, api_key="key-b", max_retries=0)
    r = client.completions.create(model="tiny", prompt="What is", max_tokens=4, temperature=0)
    assert r.choices[0].finish_reason in ("length", "stop")


def test_tenant_over_its_limit_is_429_with_retry_after(app):
    codes = [httpx.get(f"{app}/models", headers=bearer("key-a"), timeout=60) for _ in range(3)]
    assert [r.status_code for r in codes] == [200, 200, 429]
    over = codes[-1]
    assert 1 <= int(over.headers["retry-after"]) <= 5  # one request per 5 s
    error = over.json()["error"]
    assert error["code"] == "rate_limit_exceeded" and "team-a" in error["message"] and "key-a" not in over.text
    with pytest.raises(openai.RateLimitError):
        openai.OpenAI(base_url=app, api_key="key-a", max_retries=0).models.list()
    assert httpx.get(f"{app}/models", headers=bearer("key-b"), timeout=60).status_code == 200  # other tenants unaffected


def test_one_tenants_flood_does_not_starve_another(app):
    body = {"model": "tiny", "prompt": "What is", "max_tokens": 16, "temperature": 0}

    async def fire():
        async with httpx.AsyncClient(timeout=180) as http:
            flood = [http.post(f"{app}/completions", json=body, headers=bearer("key-flood")) for _ in range(30)]
            quiet = [http.post(f"{app}/completions", json=body, headers=bearer("key-quiet")) for _ in range(4)]
            return await asyncio.gather(asyncio.gather(*flood), asyncio.gather(*quiet))

    # 34 requests at once would overflow the engine's 8 places (4 running + 4 waiting) and
    # refuse some of the quiet tenant's; the flood's excess is refused at the ingress instead.
    flood, quiet = asyncio.run(fire())
    assert [r.status_code for r in quiet] == [200] * 4, [r.text for r in quiet]
    refused = [r for r in flood if r.status_code == 429]
    assert len(refused) >= 30 - 4, [r.status_code for r in flood]  # burst 2, plus what 1/s refills meanwhile
    assert all(r.json()["error"]["code"] == "rate_limit_exceeded" and r.headers.get("retry-after") for r in refused)
    assert {r.status_code for r in flood} <= {200, 429}


def test_an_exposed_api_without_keys_is_refused_unless_disabled(tmp_path):
    # No keys and auth.enabled unset: fine while Serve listens on loopback only (a laptop)...
    assert build_gatekeeper(AuthConfig(keys_env="TEST_MLPLAT_NO_KEYS")).open
    # ...refused when it listens on every interface, as Serve on a cluster does (a fresh process
    # started the way KubeRay's Serve is configured), and when keys are required outright.
    code = ("from mlplat.serve.auth import AuthConfig, build_gatekeeper\n"
            "try:\n    build_gatekeeper(AuthConfig(keys_env='TEST_MLPLAT_NO_KEYS'))\nexcept Exception as e:\n    print(e)\n"
            "print(build_gatekeeper(AuthConfig(enabled=False)).open)")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, "RAY_SERVE_DEFAULT_HTTP_HOST": "0.0.0.0"},
                         capture_output=True, text=True, timeout=300, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    refusal, disabled = out.stdout.strip().splitlines()
    assert "Serve's HTTP proxy listens on 0.0.0.0" in refusal and "auth.enabled=false" in refusal and disabled == "True"
    with pytest.raises(ConfigError, match=r"auth: no API keys in \$TEST_MLPLAT_NO_KEYS and auth.enabled is true"):
        build_gatekeeper(AuthConfig(enabled=True, keys_env="TEST_MLPLAT_NO_KEYS"))
    with pytest.raises(ConfigError, match="auth.keys_file"):
        build_gatekeeper(AuthConfig(keys_file=str(tmp_path / "missing")))
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback(None) and not is_loopback("0.0.0.0")


def test_key_parsing_never_echoes_a_key():
    assert parse_api_keys("team-a:k1, team-b:k2\nk3", "$X") == {"k1": "team-a", "k2": "team-b", "k3": "default"}
    for text in ("Team_A:s3cret-value", "a:s3cret-value,b:s3cret-value"):
        with pytest.raises(ConfigError) as err:
            parse_api_keys(text, "$X")
        assert "s3cret-value" not in str(err.value) and str(err.value).startswith("$X: entry ")
