"""Tenant names: one rule shared by serving's API keys, cluster configs and pipeline quotas."""

from __future__ import annotations

from typing import Annotated

from pydantic import StringConstraints

# A Kubernetes namespace / label value: lowercase alphanumerics and '-', at most 63 characters.
TenantName = Annotated[str, StringConstraints(pattern=r"^[a-z0-9]([a-z0-9-]*[a-z0-9])?$", max_length=63)]
