"""Who may call the OpenAI ingress: API keys that belong to tenants, and a request-rate limit per tenant.

Keys never live in a config: they come from an environment variable (in Kubernetes, a Secret
through ``env.valueFrom``) or a file (a mounted Secret), as ``tenant:key`` entries separated by
commas or newlines; a bare ``key`` belongs to the tenant ``default``. Only SHA-256 hashes of the
keys travel to the ingress replicas, so neither deployment args nor logs ever hold a key.

Each tenant has a token bucket (``requests_per_s`` refill, ``burst`` capacity): a request over
it is refused at once with 429 and ``Retry-After``, before it reaches an engine, so one tenant's
flood cannot fill the engines' queues and starve the others.
"""

from __future__ import annotations

import hashlib
import ipaddress
import logging
import math
import os
import time
from pathlib import Path

from pydantic import Field, TypeAdapter, ValidationError

from mlplat.config import Config
from mlplat.errors import ConfigError
from mlplat.tenants import TenantName

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"  # owner of bare keys, and of every request when the API is open


class RateLimit(Config):
    requests_per_s: float = Field(gt=0)  # sustained rate
    burst: int = Field(1, ge=1)  # requests accepted at once after an idle spell


class AuthConfig(Config):
    # true: keys required; false: no keys (say so explicitly); null: keys required unless Serve's
    # HTTP proxy listens on loopback only (a laptop: `serve.run`'s default), i.e. on every cluster.
    enabled: bool | None = None
    keys_env: str = "MLPLAT_API_KEYS"  # environment variable holding "tenant:key" entries
    keys_file: str | None = None  # a file of "tenant:key" entries, e.g. a mounted Kubernetes Secret
    rate_limits: dict[TenantName, RateLimit] = Field(default_factory=dict)  # per tenant
    default_rate_limit: RateLimit | None = None  # for tenants not in rate_limits; null: unlimited


class Denied(Exception):
    """A request the gate refuses: 401 (who are you?) or 429 (not now)."""

    def __init__(self, status: int, message: str, code: str, retry_after_s: int | None = None):
        super().__init__(message)
        self.status, self.message, self.code, self.retry_after_s = status, message, code, retry_after_s


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


_TENANT_NAME = TypeAdapter(TenantName)


def _is_tenant_name(name: str) -> bool:
    try:
        _TENANT_NAME.validate_python(name)
        return True
    except ValidationError:
        return False


def parse_api_keys(text: str, source: str) -> dict[str, str]:
    """``tenant:key`` entries (commas or newlines between them) -> {key: tenant}. Errors never echo a key."""
    keys: dict[str, str] = {}
    for n, entry in enumerate(e.strip() for e in text.replace("\n", ",").split(",")):
        if not entry:
            continue
        tenant, sep, key = entry.partition(":")
        tenant, key = (tenant.strip(), key.strip()) if sep else (DEFAULT_TENANT, entry)
        if not key or not _is_tenant_name(tenant):
            raise ConfigError(f"{source}: entry {n + 1} is not 'tenant:key' with a tenant like team-a (lowercase, digits, '-')")
        if keys.get(key, tenant) != tenant:
            raise ConfigError(f"{source}: entry {n + 1} gives a key already held by tenant {keys[key]!r} to {tenant!r}")
        keys[key] = tenant
    return keys


def read_api_keys(cfg: AuthConfig) -> dict[str, str]:
    """Every configured key -> its tenant, from ``$keys_env`` and ``keys_file``."""
    keys = parse_api_keys(os.environ.get(cfg.keys_env, ""), f"${cfg.keys_env}")
    if cfg.keys_file:
        path = Path(cfg.keys_file)
        if not path.is_file():
            raise ConfigError(f"auth.keys_file: {path} not found (mount the API-key Secret there, or unset keys_file)")
        for key, tenant in parse_api_keys(path.read_text(), f"auth.keys_file {path}").items():
            if keys.setdefault(key, tenant) != tenant:
                raise ConfigError(f"auth.keys_file {path}: a key there belongs to {tenant!r}, in ${cfg.keys_env} to {keys[key]!r}")
    return keys


class TokenBucket:
    """``capacity`` requests at once, refilled at ``rate`` per second."""

    def __init__(self, rate: float, capacity: float):
        self.rate, self.capacity = rate, capacity
        self.tokens, self.updated = capacity, time.monotonic()

    def take(self) -> float:
        """Take one token: 0.0 if granted, else the seconds until one is available."""
        now = time.monotonic()
        self.tokens = min(self.capacity, self.tokens + (now - self.updated) * self.rate)
        self.updated = now
        if self.tokens >= 1:
            self.tokens -= 1
            return 0.0
        return (1 - self.tokens) / self.rate


class Gatekeeper:
    """Admits a request: its API key names the tenant, the tenant's bucket says whether now.

    Built where the app is built (it reads the keys there) and handed to each ingress replica,
    which keeps its own buckets: a limit is divided among ``replicas`` ingress replicas, since
    Serve spreads requests evenly over them.
    """

    def __init__(self, key_tenants: dict[str, str], cfg: AuthConfig, replicas: int = 1):
        self.key_hashes = {hash_key(k): t for k, t in key_tenants.items()}  # empty: the API is open
        self.rate_limits = {tenant: _share(limit, replicas) for tenant, limit in cfg.rate_limits.items()}
        self.default_rate_limit = cfg.default_rate_limit and _share(cfg.default_rate_limit, replicas)
        self.buckets: dict[str, TokenBucket] = {}

    @property
    def open(self) -> bool:
        return not self.key_hashes

    def admit(self, authorization: str | None) -> str:
        """The caller's tenant, or :class:`Denied`."""
        tenant = DEFAULT_TENANT if self.open else self._tenant(authorization or "")
        limit = self.rate_limits.get(tenant, self.default_rate_limit)
        if limit is None:
            return tenant
        if tenant not in self.buckets:
            self.buckets[tenant] = TokenBucket(limit.requests_per_s, limit.burst)
        wait = self.buckets[tenant].take()
        if wait:
            retry_after = math.ceil(wait)
            raise Denied(429, f"rate limit reached for tenant {tenant!r}: retry after {retry_after} s", "rate_limit_exceeded", retry_after)
        return tenant

    def _tenant(self, authorization: str) -> str:
        scheme, _, key = authorization.partition(" ")
        tenant = self.key_hashes.get(hash_key(key.strip())) if scheme.lower() == "bearer" and key.strip() else None
        if tenant is None:
            raise Denied(401, "missing or invalid API key (send Authorization: Bearer <key>)", "invalid_api_key")
        return tenant


def _share(limit: RateLimit, replicas: int) -> RateLimit:
    return RateLimit(requests_per_s=limit.requests_per_s / replicas, burst=max(1, math.ceil(limit.burst / replicas)))


def serve_http_host() -> str | None:
    """Where Serve's HTTP proxies listen: the running instance's setting, else what `serve.run` starts them with."""
    import ray
    from ray.serve.config import HTTPOptions
    from ray.serve.context import _get_global_client  # no public getter for the running instance's HTTP options

    client = _get_global_client(raise_if_no_controller_running=False) if ray.is_initialized() else None
    return client.http_config.host if client else HTTPOptions().host


def is_loopback(host: str | None) -> bool:
    if host is None:  # proxies disabled: no HTTP at all
        return True
    try:
        return host == "localhost" or ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name
        return False


def build_gatekeeper(cfg: AuthConfig, replicas: int = 1) -> Gatekeeper:
    """The gate for one app; refuses (ConfigError) to open an API that other machines can reach unless told to."""
    keys = read_api_keys(cfg) if cfg.enabled is not False else {}
    if not keys and cfg.enabled is not False:
        host = serve_http_host()
        if cfg.enabled or not is_loopback(host):
            why = "auth.enabled is true" if cfg.enabled else f"Serve's HTTP proxy listens on {host}, reachable from other machines"
            raise ConfigError(f"auth: no API keys in ${cfg.keys_env}{' or ' + cfg.keys_file if cfg.keys_file else ''} and {why}: "
                              f"set {cfg.keys_env}=tenant:key,... (e.g. from a Kubernetes Secret), or auth.enabled=false to serve without keys")
        logger.warning("serving without API keys: Serve listens on loopback (%s) only; set %s to require keys", host, cfg.keys_env)
    return Gatekeeper(keys, cfg, replicas)
