"""The serving app's one typed config (also what a Serve config YAML's `args` holds)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator

from mlplat.config import Config
from mlplat.serve.auth import AuthConfig


class ReplicaConfig(Config):
    num_replicas: int = Field(1, ge=1)
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources, e.g. {prefill: 1} to pin replicas to a node group
    # Serve calls each replica's check_health this often; a replica whose engine stopped fails it and is replaced.
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)


# The KV connectors Ray Serve LLM documents for prefill/decode and registers a backend for
# (ray/llm/_internal/serve/engines/vllm/kv_transfer/factory.py); NIXL needs UCX, LMCache `pip install lmcache`.
KVConnector = Literal["NixlConnector", "LMCacheConnectorV1"]

# What to do instead, for settings only the native engine reads.
NATIVE_ONLY_HINTS = {
    "engine_args": "with engine: vllm put vLLM's engine arguments in vllm.engine_kwargs",
    "default_max_tokens": "with engine: vllm clients set max_tokens (without it vLLM may generate up to the context length)",
    "prefill_router": "with engine: vllm Ray Serve LLM routes requests itself",
    "request_timeout_s": "with engine: vllm set Serve's http_options.request_timeout_s or a gateway timeout",
    "limits": "with engine: vllm set vLLM's own limits in vllm.engine_kwargs (e.g. max_logprobs)",
}

# Ray Serve LLM derives these from the rest of the config (and refuses the first two in engine_kwargs).
ENGINE_KWARGS_SET_BY_MLPLAT = {"model": "model", "served_model_name": "model_name", "kv_transfer_config": "vllm.kv_connector"}


class VLLMConfig(Config):
    """``engine: vllm``: each replica runs a vLLM engine under Ray Serve LLM (see docs/serving.md)."""

    # vLLM engine arguments for every prefill/decode/colocated replica, e.g. tensor_parallel_size,
    # max_model_len, gpu_memory_utilization, quantization. A replica takes tensor_parallel_size x
    # pipeline_parallel_size GPUs, one per engine worker, placed by Ray Serve LLM.
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    kv_connector: KVConnector = "NixlConnector"  # mode: pd: how decode replicas fetch the prompt's KV from prefill replicas
    kv_connector_extra_config: dict[str, Any] = Field(default_factory=dict)  # to the connector, e.g. {backends: [UCX]} for NIXL
    accelerator_type: str | None = None  # the GPU type replicas must run on, as Ray names it: H100, H200, A100-80G, L4, ...
    runtime_env: dict[str, Any] = Field(default_factory=dict)  # of replicas and engine workers, e.g. {env_vars: {UCX_TLS: all}}

    @field_validator("engine_kwargs")
    @classmethod
    def _no_derived_kwargs(cls, kwargs: dict[str, Any]) -> dict[str, Any]:
        for key, source in ENGINE_KWARGS_SET_BY_MLPLAT.items():
            if key in kwargs:
                raise ValueError(f"{key!r} comes from `{source}`: remove it from vllm.engine_kwargs")
        return kwargs

    @field_validator("runtime_env")
    @classmethod
    def _env_vars_are_strings(cls, runtime_env: dict[str, Any]) -> dict[str, Any]:
        # `--set vllm.runtime_env.env_vars.X=True` parses as a bool; Ray would refuse it only on the cluster
        env_vars = runtime_env.get("env_vars") or {}
        if not isinstance(env_vars, dict):
            raise ValueError("env_vars: expected a mapping of NAME: value")
        for name, value in env_vars.items():
            if not isinstance(value, str):
                raise ValueError(f"env_vars.{name}: {value!r} must be a string (quote it in YAML, e.g. '\"{value}\"')")
        return runtime_env

    @field_validator("accelerator_type")
    @classmethod
    def _known_accelerator(cls, name: str | None) -> str | None:
        try:  # the list Ray Serve LLM's LLMConfig checks against (importable without vllm)
            from ray.llm._internal.serve.core.configs.accelerators import AcceleratorType
        except ImportError:  # moved in another Ray version: Ray's LLMConfig still checks it when the app is built
            return name
        known = {t.value for t in AcceleratorType if isinstance(t.value, str)} | {"A10"}  # Ray maps A10 to A10G
        if name is not None and name not in known:
            close = difflib.get_close_matches(name, known, n=3)
            hint = f"did you mean {' or '.join(close)}?" if close else "e.g. H100, H200, A100-80G, L4 (ray.util.accelerators lists them)"
            raise ValueError(f"unknown accelerator type {name!r}: {hint}")
        return name


class RequestLimits(Config):
    """Per-request limits of the native ingress (engine: native). A request over one is a 400 that names the field and
    the limit. The size of a structured-output schema / grammar is the engine's: engine_args.structured_outputs."""

    max_n: int = Field(8, ge=1)  # samples per prompt (`n`)
    max_stop: int = Field(4, ge=0)  # stop strings (OpenAI's limit)
    max_logit_bias: int = Field(300, ge=0)  # logit_bias entries (OpenAI's limit)
    # top log-probs per token: chat top_logprobs, completions logprobs (vLLM's default max_logprobs); the engine's
    # max_logprobs follows it unless engine_args sets it
    max_top_logprobs: int = Field(20, ge=0)
    max_prompts: int = Field(64, ge=1)  # prompts in one completions request
    max_tools: int = Field(64, ge=1)  # tools in one chat request


class ServeConfig(Config):
    model: str  # local HF checkpoint directory or models:/NAME/VERSION|@ALIAS
    model_name: str | None = None  # the name clients pass as `model` (default: registry name or directory name)
    mode: Literal["pd", "colocated"] = "pd"  # pd: separate prefill and decode deployments
    engine: Literal["native", "vllm"] = "native"  # vllm: the same topology on Ray Serve LLM (GPU nodes, `mlplat[vllm]`)
    engine_args: dict[str, Any] = {}  # engine: native: mlplat.engine.EngineConfig fields except `model`
    vllm: VLLMConfig = VLLMConfig()  # engine: vllm: vLLM engine arguments, KV connector, GPU type
    prefill: ReplicaConfig = ReplicaConfig()
    decode: ReplicaConfig = ReplicaConfig()
    colocated: ReplicaConfig = ReplicaConfig()
    # engine: native, mode: pd: prefix_aware sends prompts sharing a prefix to the replica that caches it;
    # round_robin takes the replicas in turn (no affinity): the benchmark's baseline, or for uniform traffic
    prefill_router: Literal["prefix_aware", "round_robin"] = "prefix_aware"
    ingress: ReplicaConfig = ReplicaConfig(num_cpus=0.5)
    # engine: native: max_tokens of requests that give none; None: OpenAI's (chat: the rest of the context; completions: 16)
    default_max_tokens: int | None = Field(None, ge=1)
    # engine: native: a request still running this long after it arrived ends with 504 (an error event
    # in a stream) and its KV blocks are freed.
    request_timeout_s: float = Field(600.0, gt=0)
    # engine: native: how tool calls are read from a chat answer (mlplat.serve.tool_parsers): hermes is
    # <tool_call>{"name": ..., "arguments": {...}}</tool_call> (Hermes 2 Pro, Qwen2.5)
    tool_call_parser: Literal["hermes"] = "hermes"
    # engine: native: per-request limits (n, stop strings, logit_bias entries, top log-probs, prompts, tools)
    limits: RequestLimits = RequestLimits()
    # API keys (tenant:key in $MLPLAT_API_KEYS) and per-tenant rate limits. Validated even when left
    # at its default, because engine: vllm must say `enabled: false` (see _keys_need_the_native_ingress).
    auth: AuthConfig = Field(AuthConfig(), validate_default=True)
    app_name: str = "mlplat-llm"
    route_prefix: str = "/"

    def served_name(self, model_dir: Path) -> str:
        """The name clients pass as ``model``, the same for both engines: ``model_name``, else the
        registered model's name, else the checkpoint directory's."""
        if self.model_name:
            return self.model_name
        if self.model.startswith("models:/"):
            from mlplat.tracking import parse_model_uri

            return parse_model_uri(self.model).name
        return model_dir.name

    # Settings one engine would silently ignore are errors. These validators see `mode` and `engine`
    # (declared above them) in info.data, and, but for `auth`, run only on fields the config sets.

    @field_validator("engine_args", "default_max_tokens", "prefill_router", "request_timeout_s", "limits")
    @classmethod
    def _native_only(cls, value: Any, info: ValidationInfo) -> Any:
        if info.data.get("engine") == "vllm":
            raise ValueError(f"applies to engine: native only; {NATIVE_ONLY_HINTS[info.field_name]}")
        return value

    @field_validator("vllm")
    @classmethod
    def _vllm_section(cls, vllm: VLLMConfig, info: ValidationInfo) -> VLLMConfig:
        if info.data.get("engine") == "native":
            raise ValueError("applies to engine: vllm only; set engine=vllm or remove the vllm section")
        if info.data.get("mode") == "colocated" and vllm.model_fields_set & {"kv_connector", "kv_connector_extra_config"}:
            raise ValueError("kv_connector moves KV between prefill and decode: it applies to mode: pd only")
        return vllm

    @field_validator("prefill", "decode", "colocated")
    @classmethod
    def _vllm_places_gpus(cls, replicas: ReplicaConfig, info: ValidationInfo) -> ReplicaConfig:
        # Ray Serve LLM gives each engine worker a GPU of the replica's placement group; GPUs on the
        # replica actor itself would be reserved on top and never used.
        if replicas.num_gpus and info.data.get("engine") == "vllm":
            raise ValueError("with engine: vllm a replica has vllm.engine_kwargs.tensor_parallel_size x pipeline_parallel_size "
                             "GPUs, placed by Ray Serve LLM: leave num_gpus at 0")
        return replicas

    @field_validator("auth")
    @classmethod
    def _keys_need_the_native_ingress(cls, auth: AuthConfig, info: ValidationInfo) -> AuthConfig:
        # Ray Serve LLM's OpenAI ingress checks no mlplat API keys: rather than serve an open API by
        # surprise, engine: vllm asks the config to say so and the docs to put a gateway in front.
        if info.data.get("engine") == "vllm" and (auth.enabled is not False or auth.rate_limits or auth.default_rate_limit):
            raise ValueError("engine: vllm serves through Ray Serve LLM's ingress, which checks no API keys or rate limits: "
                             "set auth.enabled=false (and no rate limits) and put an authenticating gateway in front")
        return auth


def replica_groups(cfg: ServeConfig) -> dict[str, ReplicaConfig]:
    """The deployments the app runs, by config field name."""
    return {"ingress": cfg.ingress, **({"colocated": cfg.colocated} if cfg.mode == "colocated" else {"prefill": cfg.prefill, "decode": cfg.decode})}


def fit_to_cluster(cfg: ServeConfig, cluster_cpus: float, cluster_gpus: float = 0.0) -> tuple[ServeConfig, str | None]:
    """The config with replica CPUs that fit the cluster, and a note saying what changed.

    Replica CPUs left at their defaults are scaled down together when the app would not fit (on a
    2-core laptop the PD defaults ask for 2.5 CPUs, and Serve would wait for them forever); CPUs or
    GPUs the config sets, or more GPUs than the cluster has, raise ``ValueError`` naming what the app
    needs and what the cluster has, since waiting cannot help."""
    groups = replica_groups(cfg)
    need_cpus = sum(g.num_replicas * g.num_cpus for g in groups.values())
    need_gpus = sum(g.num_replicas * g.num_gpus for g in groups.values())
    asked = ", ".join(f"{name} {g.num_replicas} x {g.num_cpus:g} CPU" + (f" + {g.num_gpus:g} GPU" if g.num_gpus else "") for name, g in groups.items())
    if need_gpus > cluster_gpus:
        raise ValueError(f"the app needs {need_gpus:g} GPUs ({asked}); the cluster has {cluster_gpus:g}: lower the replicas' num_gpus or num_replicas")
    if need_cpus <= cluster_cpus:
        return cfg, None
    fixed = [name for name, g in groups.items() if name in cfg.model_fields_set and "num_cpus" in g.model_fields_set]
    if fixed:
        raise ValueError(f"the app needs {need_cpus:g} CPUs ({asked}); the cluster has {cluster_cpus:g}: "
                         f"lower {', '.join(f'{name}.num_cpus' for name in fixed)} or num_replicas, or add nodes")  # fmt: skip
    scale = cluster_cpus / need_cpus
    update = {name: g.model_copy(update={"num_cpus": int(g.num_cpus * scale * 100) / 100}) for name, g in groups.items()}
    fitted = cfg.model_copy(update=update)
    now = ", ".join(f"{name} {g.num_cpus:g}" for name, g in update.items())
    return fitted, f"the default replica CPUs ({need_cpus:g} in all) exceed the cluster's {cluster_cpus:g}: using {now} CPUs per replica"
