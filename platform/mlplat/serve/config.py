"""The serving app's one typed config (also what a Serve config YAML's `args` holds)."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from mlplat.config import Config
from mlplat.serve.auth import AuthConfig


class ReplicaConfig(Config):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources, e.g. {prefill: 1} to pin replicas to a node group


class ServeConfig(Config):
    model: str  # local HF checkpoint directory or models:/NAME/VERSION|@ALIAS
    model_name: str | None = None  # the name clients pass as `model` (default: registry name or directory name)
    mode: Literal["pd", "colocated"] = "pd"  # pd: separate prefill and decode deployments
    engine_args: dict[str, Any] = {}  # mlplat.engine.EngineConfig fields except `model`
    prefill: ReplicaConfig = ReplicaConfig()
    decode: ReplicaConfig = ReplicaConfig()
    colocated: ReplicaConfig = ReplicaConfig()
    ingress: ReplicaConfig = ReplicaConfig(num_cpus=0.5)
    default_max_tokens: int = Field(256, ge=1)
    auth: AuthConfig = AuthConfig()  # API keys (tenant:key in $MLPLAT_API_KEYS) and per-tenant rate limits
    app_name: str = "mlplat-llm"
    route_prefix: str = "/"
