"""The serving app's one typed config (also what a Serve config YAML's `args` holds)."""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationInfo, field_validator, model_validator

from mlplat.config import Config
from mlplat.serve.auth import AuthConfig


class AutoscalingConfig(Config):
    """Serve's request-based autoscaler for one pool, with Serve's field names and defaults
    (ray.serve.config.AutoscalingConfig). Each pool scales on its own load: Serve adds replicas while
    the pool's ongoing + queued requests per replica stay above ``target_ongoing_requests`` for
    ``upscale_delay_s``, and removes them while below it for ``downscale_delay_s``; a replica being
    removed takes no new requests and finishes the ones it has (draining) before it stops."""

    min_replicas: int = Field(1, ge=0)  # 0 scales to zero: the next request then waits for a replica to start
    max_replicas: int = Field(ge=1)  # what the cluster and the ingress's admission limits are sized for
    initial_replicas: int | None = Field(None, ge=0)  # at deploy time (default: min_replicas)
    target_ongoing_requests: float = Field(2.0, gt=0)  # per replica
    upscale_delay_s: float = Field(30.0, ge=0)
    downscale_delay_s: float = Field(600.0, ge=0)
    # How often callers report the pool's load, and the window Serve averages it over. Serve marks
    # metrics_interval_s deprecated (for env vars) but Ray 2.60 still reads it as the push interval.
    metrics_interval_s: float = Field(10.0, gt=0)
    look_back_period_s: float = Field(30.0, gt=0)

    @model_validator(mode="after")
    def _consistent(self) -> AutoscalingConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(f"min_replicas ({self.min_replicas}) exceeds max_replicas ({self.max_replicas}): raise max_replicas")
        if self.initial_replicas is not None and not self.min_replicas <= self.initial_replicas <= self.max_replicas:
            raise ValueError(f"initial_replicas ({self.initial_replicas}) must lie within min_replicas ({self.min_replicas}) "
                             f"and max_replicas ({self.max_replicas})")
        # Serve only warns; its average would then hold one report at most
        if self.look_back_period_s <= self.metrics_interval_s:
            raise ValueError(f"look_back_period_s ({self.look_back_period_s:g}) must exceed "
                             f"metrics_interval_s ({self.metrics_interval_s:g})")
        return self


class ReplicaConfig(Config):
    num_replicas: int = Field(1, ge=1)  # a fixed pool; or `autoscaling` below, not both
    num_cpus: float = Field(1.0, ge=0)
    num_gpus: float = Field(0.0, ge=0)
    resources: dict[str, float] = Field(default_factory=dict)  # custom Ray resources, e.g. {prefill: 1} to pin replicas to a node group
    # Serve calls each replica's check_health this often; a replica whose engine stopped fails it and is replaced.
    health_check_period_s: float = Field(10.0, gt=0)
    health_check_timeout_s: float = Field(30.0, gt=0)
    autoscaling: AutoscalingConfig | None = None  # engine pools only (prefill, decode, colocated)

    @model_validator(mode="after")
    def _fixed_or_autoscaled(self) -> ReplicaConfig:
        if self.autoscaling is not None and "num_replicas" in self.model_fields_set:
            raise ValueError("num_replicas and autoscaling both set: keep num_replicas for a fixed pool, "
                             "or autoscaling.min_replicas/max_replicas for a scaled one")
        return self

    @property
    def max_replicas(self) -> int:
        """The most replicas this pool runs: what the cluster and the admission limits must allow for."""
        return self.autoscaling.max_replicas if self.autoscaling else self.num_replicas

    def scaling_options(self) -> dict[str, Any]:
        """Serve deployment options for the replica count: ``num_replicas`` or ``autoscaling_config``."""
        if self.autoscaling is None:
            return {"num_replicas": self.num_replicas}
        return {"autoscaling_config": self.autoscaling.model_dump(exclude_none=True)}


# The KV connectors Ray Serve LLM documents for prefill/decode and registers a backend for
# (ray/llm/_internal/serve/engines/vllm/kv_transfer/factory.py); NIXL needs UCX, LMCache `pip install lmcache`.
KVConnector = Literal["NixlConnector", "LMCacheConnectorV1"]

# What to do instead, for settings only the native engine reads.
NATIVE_ONLY_HINTS = {
    "engine_args": "with engine: vllm put vLLM's engine arguments in vllm.engine_kwargs",
    "default_max_tokens": "with engine: vllm clients set max_tokens (without it vLLM may generate up to the context length)",
    "prefill_router": "with engine: vllm Ray Serve LLM routes requests itself",
    "colocated_router": "with engine: vllm Ray Serve LLM routes requests itself",
    "request_timeout_s": "with engine: vllm set Serve's http_options.request_timeout_s or a gateway timeout",
    "limits": "with engine: vllm set vLLM's own limits in vllm.engine_kwargs (e.g. max_logprobs)",
}

# Ray Serve LLM derives these from the rest of the config (and refuses the first two in engine_kwargs).
ENGINE_KWARGS_SET_BY_MLPLAT = {"model": "model", "served_model_name": "model_name", "kv_transfer_config": "vllm.kv_connector",
                               "enable_lora": "lora", "max_loras": "lora.max_loras", "max_lora_rank": "lora.max_lora_rank"}
# Where Ray Serve LLM downloads LoRA adapters from (LoraConfig.dynamic_lora_loading_path accepts only these).
REMOTE_STORAGE = ("s3://", "gs://", "abfss://", "azure://")


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
    # With a lora section: the cloud storage folder holding one directory per adapter, which Ray Serve LLM
    # downloads on first use; clients ask for an adapter as `MODEL_ID:ADAPTER` (MODEL_ID: model_name).
    dynamic_lora_loading_path: str | None = None

    @field_validator("dynamic_lora_loading_path")
    @classmethod
    def _remote_adapter_store(cls, path: str | None) -> str | None:
        if path is not None and not path.startswith(REMOTE_STORAGE):
            raise ValueError(f"{path!r}: Ray Serve LLM loads adapters from {', '.join(REMOTE_STORAGE)} only: upload them there")
        return path

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
        # Ray Serve LLM's LLMConfig accepts the constants of this public module (its AcceleratorType enumerates them);
        # the package ray.util.accelerators re-exports only some of them (no H200, B200, A100-80G)
        from ray.util.accelerators import accelerators

        known = {value for key, value in vars(accelerators).items() if not key.startswith("_") and isinstance(value, str)}
        known |= {"A10"}  # Ray maps A10 to A10G
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


class LoRAServingConfig(Config):
    """LoRA adapters served on the base model: a request names one as its ``model``. The fields are vLLM's and Ray Serve
    LLM's; the native engine takes them as EngineConfig.lora (engine.lora), with the adapters resolved to local files."""

    max_loras: int = Field(4, ge=1)  # adapters resident per engine replica (LRU; loaded on first use), mixed in one batch
    max_lora_rank: int = Field(16, ge=1)  # the largest rank accepted
    max_cpu_loras: int | None = Field(None, ge=1)  # adapters kept read in host memory per replica (LRU); None: max_loras
    # served name -> models:/NAME@ALIAS (registered with only the adapter, e.g. by the SFT recipe's lora.register_as: adapter)
    # or a peft adapter directory
    adapters: dict[str, str] = Field(default_factory=dict)

    @field_validator("adapters")
    @classmethod
    def _names(cls, adapters: dict[str, str]) -> dict[str, str]:
        for name, source in adapters.items():
            if not name.strip() or not source.strip():
                raise ValueError(f"adapters: {name!r}: {source!r}: give each adapter a name and a models:/ URI or directory")
        return adapters

    @model_validator(mode="after")
    def _cpu_at_least_device(self):
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:  # as EngineConfig.lora and vLLM check
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) < max_loras ({self.max_loras}): raise max_cpu_loras or leave it unset")
        return self


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
    # engine: native, mode: pd: how prompts are spread over prefill replicas (mlplat.serve.routing). kv_events:
    # to the replica whose prefix cache holds the longest prefix of the prompt, as the replicas' block events
    # report it (an index actor per pool of 2+ replicas); prefix_aware: a hash of the prompt's first 64
    # tokens picks the replica; round_robin: in turn, no affinity (the benchmark's baseline, or uniform traffic)
    prefill_router: Literal["kv_events", "prefix_aware", "round_robin"] = "kv_events"
    # engine: native, mode: colocated: the same choice for colocated replicas, or power_of_two: Serve's
    # default (the shorter queue of two random replicas), no affinity
    colocated_router: Literal["kv_events", "prefix_aware", "round_robin", "power_of_two"] = "power_of_two"
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
    lora: LoRAServingConfig | None = None  # LoRA adapters on the base model, by name as the request's `model`; None: none
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

    @field_validator("engine_args", "default_max_tokens", "prefill_router", "colocated_router", "request_timeout_s", "limits")
    @classmethod
    def _native_only(cls, value: Any, info: ValidationInfo) -> Any:
        if info.data.get("engine") == "vllm":
            raise ValueError(f"applies to engine: native only; {NATIVE_ONLY_HINTS[info.field_name]}")
        return value

    @field_validator("prefill_router", "colocated_router")
    @classmethod
    def _router_of_the_mode(cls, value: str, info: ValidationInfo) -> str:
        mode = "pd" if info.field_name == "prefill_router" else "colocated"
        if info.data.get("mode") != mode:
            other = "colocated_router" if mode == "pd" else "prefill_router"
            raise ValueError(f"routes mode: {mode} replicas; with mode: {info.data.get('mode')} set {other}")
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

    @field_validator("lora")
    @classmethod
    def _vllm_loads_adapters_from_storage(cls, lora: LoRAServingConfig | None, info: ValidationInfo) -> LoRAServingConfig | None:
        if lora is None or info.data.get("engine") != "vllm":
            return lora
        if lora.adapters:
            raise ValueError("with engine: vllm Ray Serve LLM loads each adapter by name from vllm.dynamic_lora_loading_path "
                             "(clients ask for MODEL_ID:ADAPTER) and reads no models:/ URIs or local directories: "
                             "upload each adapter's directory there and leave lora.adapters empty")
        if (vllm := info.data.get("vllm")) is not None and vllm.dynamic_lora_loading_path is None:
            raise ValueError("with engine: vllm set vllm.dynamic_lora_loading_path: the s3:// (gs://, abfss://, azure://) "
                             "folder that holds one directory per adapter")
        return lora

    @model_validator(mode="after")
    def _adapter_store_needs_lora(self) -> ServeConfig:
        if self.engine == "vllm" and self.vllm.dynamic_lora_loading_path and self.lora is None:
            raise ValueError("vllm.dynamic_lora_loading_path serves adapters only with a lora section: add lora: {max_loras: N}")
        return self

    @field_validator("ingress")
    @classmethod
    def _fixed_ingress(cls, ingress: ReplicaConfig) -> ReplicaConfig:
        # admission (and per-tenant rate) limits are split among a known number of ingress replicas
        if ingress.autoscaling is not None:
            raise ValueError("autoscaling applies to the engine pools (prefill, decode, colocated); the ingress splits admission "
                             "and rate limits among a fixed number of replicas: set ingress.num_replicas instead")
        return ingress

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
    need_cpus = sum(g.max_replicas * g.num_cpus for g in groups.values())  # an autoscaled pool at its largest
    need_gpus = sum(g.max_replicas * g.num_gpus for g in groups.values())
    asked = ", ".join(f"{name} {g.max_replicas} x {g.num_cpus:g} CPU" + (f" + {g.num_gpus:g} GPU" if g.num_gpus else "") for name, g in groups.items())
    if need_gpus > cluster_gpus:
        raise ValueError(f"the app needs {need_gpus:g} GPUs ({asked}); the cluster has {cluster_gpus:g}: "
                         "lower the replicas' num_gpus or num_replicas (autoscaling.max_replicas)")
    if need_cpus <= cluster_cpus:
        return cfg, None
    fixed = [name for name, g in groups.items() if name in cfg.model_fields_set and "num_cpus" in g.model_fields_set]
    if fixed:
        raise ValueError(f"the app needs {need_cpus:g} CPUs ({asked}); the cluster has {cluster_cpus:g}: "
                         f"lower {', '.join(f'{name}.num_cpus' for name in fixed)} or num_replicas (autoscaling.max_replicas), "
                         "or add nodes")  # fmt: skip
    scale = cluster_cpus / need_cpus
    update = {name: g.model_copy(update={"num_cpus": int(g.num_cpus * scale * 100) / 100}) for name, g in groups.items()}
    fitted = cfg.model_copy(update=update)
    now = ", ".join(f"{name} {g.num_cpus:g}" for name, g in update.items())
    return fitted, f"the default replica CPUs ({need_cpus:g} in all) exceed the cluster's {cluster_cpus:g}: using {now} CPUs per replica"
