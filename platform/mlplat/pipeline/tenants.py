"""Tenants: Ray namespaces with CPU/GPU quotas, checked when a job is submitted.

    tenants:                     # cluster_configs/tenants.yaml
      research: {cpus: 16, gpus: 2}
      prod: {cpus: 64, gpus: 8}

``mlplat submit --tenant research`` runs the job's driver in namespace ``research``, tags
the job with the tenant and what it requests, and refuses it when that request plus what
the tenant's pending and running jobs requested exceeds the quota. This is admission at
submission, not enforcement: jobs submitted around ``mlplat submit`` are not counted, and two
submissions at the same instant can both pass.
"""

from __future__ import annotations

from pydantic import Field

from mlplat.config import Config
from mlplat.errors import MlplatError
from mlplat.tenants import TenantName

TENANT_KEY = "mlplat.tenant"
PIPELINE_KEY = "mlplat.pipeline"
REQUEST_KEYS = {"CPU": "mlplat.request.cpus", "GPU": "mlplat.request.gpus"}



class QuotaExceeded(MlplatError):
    """A submission that would take a tenant over its quota."""


class TenantQuota(Config):
    cpus: float | None = Field(default=None, ge=0)  # None: no limit
    gpus: float | None = Field(default=None, ge=0)

    def limits(self) -> dict[str, float]:
        return {k: v for k, v in (("CPU", self.cpus), ("GPU", self.gpus)) if v is not None}


class TenantsConfig(Config):
    tenants: dict[TenantName, TenantQuota]

    def quota(self, tenant: str, source: str) -> TenantQuota:
        if tenant not in self.tenants:
            raise MlplatError(f"{source}: no tenant {tenant!r} (tenants: {', '.join(self.tenants) or 'none'})")
        return self.tenants[tenant]


def job_metadata(tenant: str | None, pipeline: str, request: dict[str, float]) -> dict[str, str]:
    metadata = {PIPELINE_KEY: pipeline, **{REQUEST_KEYS[k]: f"{request.get(k, 0):g}" for k in REQUEST_KEYS}}
    if tenant:
        metadata[TENANT_KEY] = tenant
    return metadata


def held_by_tenant(jobs, tenant: str) -> dict[str, float]:
    """What the tenant's pending and running jobs requested (from their mlplat metadata)."""
    held = {k: 0.0 for k in REQUEST_KEYS}
    for job in jobs:
        metadata = job.metadata or {}
        if metadata.get(TENANT_KEY) != tenant or job.status not in ("PENDING", "RUNNING"):  # a str enum
            continue
        for key, meta_key in REQUEST_KEYS.items():
            held[key] += float(metadata.get(meta_key, 0) or 0)
    return held


def check_quota(tenant: str, quota: TenantQuota, request: dict[str, float], held: dict[str, float]) -> None:
    units = {"CPU": "CPUs", "GPU": "GPUs"}
    for key, limit in quota.limits().items():
        wanted, used = request.get(key, 0), held.get(key, 0)
        if wanted + used > limit:
            raise QuotaExceeded(
                f"tenant {tenant!r}: this job requests {wanted:g} {units[key]} and the tenant's pending and running jobs hold "
                f"{used:g} of its {limit:g}: wait for them (mlplat jobs list --tenant {tenant}) or raise its quota"
            )
