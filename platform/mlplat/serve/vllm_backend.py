"""``engine: vllm``: the serving topology of ``serve_apps/llm.py`` on Ray Serve LLM, with vLLM engines.

The ServeConfig that builds the native app translates into the args of Ray Serve LLM's builders:

    mode: pd         ray.serve.llm:build_pd_openai_app  {prefill_config, decode_config, ingress_deployment_config}
    mode: colocated  ray.serve.llm:build_openai_app     {llm_configs: [one], ingress_deployment_config}

Each ``*_config`` is an LLMConfig as a dict: the model (a local HF directory, or a registry URI
resolved to one, as for the native engine), ``vllm.engine_kwargs``, the role's replicas (fixed, or
Serve's ``autoscaling_config``), LoRA slots and the adapters' storage; in pd mode both roles carry a
``kv_transfer_config`` naming ``vllm.kv_connector``, through which a decode replica pulls the
prompt's KV from the prefill replica (NIXL: GPU to GPU over UCX/RDMA). What Ray Serve LLM cannot
express (adapters by registry URI or local directory, an autoscaled ingress) ServeConfig refuses.

The translation is pure and imports neither vllm nor ``ray.serve.llm`` (which needs vllm), so it
runs and is tested without GPUs; only ``build_vllm_app`` imports them. docs/serving.md says how to
run it on a GPU cluster.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import yaml

from mlplat.errors import ConfigError, MlplatError
from mlplat.serve.config import ReplicaConfig, ServeConfig
from mlplat.tracking import resolve_model

if TYPE_CHECKING:
    from ray.serve import Application

PD_BUILDER = "ray.serve.llm:build_pd_openai_app"
COLOCATED_BUILDER = "ray.serve.llm:build_openai_app"
VLLM_MISSING = "engine: vllm needs the vllm extra: pip install 'mlplat[vllm]' on a GPU node"

Role = Literal["prefill", "decode", "colocated"]


def kv_transfer_config(cfg: ServeConfig) -> dict[str, Any]:
    # kv_both on both roles, as Ray's PD docs set it: Ray's PD orchestrator tells each request's
    # prefill replica to produce KV and its decode replica to consume it.
    config: dict[str, Any] = {"kv_connector": cfg.vllm.kv_connector, "kv_role": "kv_both"}
    if cfg.vllm.kv_connector_extra_config:
        config["kv_connector_extra_config"] = cfg.vllm.model_dump(mode="json")["kv_connector_extra_config"]
    return config


def deployment_config(replicas: ReplicaConfig) -> dict[str, Any]:
    """Serve deployment options. For an engine replica, Ray Serve LLM adds these actor resources to
    the first bundle of the replica's placement group (the engine workers' GPUs are the bundles)."""
    actor: dict[str, Any] = {"num_cpus": replicas.num_cpus}
    if replicas.num_gpus:  # only the ingress may have some: ServeConfig refuses them on vllm engine replicas
        actor["num_gpus"] = replicas.num_gpus
    if replicas.resources:
        actor["resources"] = dict(replicas.resources)
    options = {**replicas.scaling_options(), "ray_actor_options": actor}  # num_replicas or autoscaling_config
    options |= {key: getattr(replicas, key) for key in ("health_check_period_s", "health_check_timeout_s") if key in replicas.model_fields_set}
    return options


def llm_config(cfg: ServeConfig, role: Role, model_dir: Path) -> dict[str, Any]:
    """One Ray Serve LLM ``LLMConfig`` (as a dict) for the prefill, decode or colocated deployment."""
    vllm = cfg.vllm.model_dump(mode="json")  # fresh copies: Ray's builders fill in the dicts they get
    engine_kwargs = vllm["engine_kwargs"]
    if role != "colocated":
        engine_kwargs["kv_transfer_config"] = kv_transfer_config(cfg)
    if cfg.lora is not None:  # vLLM's LoRA slots; ServeConfig requires vllm.dynamic_lora_loading_path with it
        engine_kwargs |= {"enable_lora": True, "max_loras": cfg.lora.max_loras, "max_lora_rank": cfg.lora.max_lora_rank}
        if cfg.lora.max_cpu_loras is not None:
            engine_kwargs["max_cpu_loras"] = cfg.lora.max_cpu_loras
    config: dict[str, Any] = {
        "model_loading_config": {"model_id": cfg.served_name(model_dir), "model_source": str(model_dir)},
        "engine_kwargs": engine_kwargs,
        "deployment_config": deployment_config(getattr(cfg, role)),
    }
    if cfg.vllm.accelerator_type:
        config["accelerator_type"] = cfg.vllm.accelerator_type
    if cfg.vllm.runtime_env:
        config["runtime_env"] = vllm["runtime_env"]
    if cfg.lora is not None:  # adapters Ray Serve LLM downloads on first use and keeps per replica, LRU
        config["lora_config"] = {"dynamic_lora_loading_path": cfg.vllm.dynamic_lora_loading_path,
                                 "max_num_adapters_per_replica": cfg.lora.max_loras}  # fmt: skip
    return config


def pd_serving_args(cfg: ServeConfig, model_dir: Path) -> dict[str, Any]:
    """The args of ``build_pd_openai_app`` (Ray's PDServingArgs)."""
    return {
        "prefill_config": llm_config(cfg, "prefill", model_dir),
        "decode_config": llm_config(cfg, "decode", model_dir),
        "ingress_deployment_config": deployment_config(cfg.ingress),
    }


def llm_serving_args(cfg: ServeConfig, model_dir: Path) -> dict[str, Any]:
    """The args of ``build_openai_app`` (Ray's LLMServingArgs) for one colocated model."""
    return {"llm_configs": [llm_config(cfg, "colocated", model_dir)], "ingress_deployment_config": deployment_config(cfg.ingress)}


def builder_args(cfg: ServeConfig, model_dir: Path) -> tuple[str, dict[str, Any]]:
    """(import path of the Ray Serve LLM builder, its args) for ``cfg.mode``."""
    if cfg.mode == "pd":
        return PD_BUILDER, pd_serving_args(cfg, model_dir)
    return COLOCATED_BUILDER, llm_serving_args(cfg, model_dir)


def serve_config(cfg: ServeConfig, model_dir: Path | None = None) -> dict[str, Any]:
    """A Serve config (``serve deploy``, a RayService's serveConfigV2) that needs Ray and vllm, not mlplat.

    The model directory is resolved here, so it must be the path the GPU nodes see (shared storage).
    """
    if cfg.engine != "vllm":
        raise ConfigError("the Ray Serve LLM config is for engine: vllm (set engine=vllm); "
                          "engine: native deploys with import_path serve_apps.llm:app_builder")
    import_path, args = builder_args(cfg, model_dir or resolve_model(cfg.model))
    return {"applications": [{"name": cfg.app_name, "route_prefix": cfg.route_prefix, "import_path": import_path, "args": args}]}


def serve_config_yaml(cfg: ServeConfig, model_dir: Path | None = None) -> str:
    return yaml.safe_dump(serve_config(cfg, model_dir), sort_keys=False)


def vllm_installed() -> bool:
    return importlib.util.find_spec("vllm") is not None


def build_vllm_app(cfg: ServeConfig) -> Application:
    """The Serve application of ``cfg`` on Ray Serve LLM; needs vllm (a GPU node's install)."""
    if not vllm_installed():  # checked first: `import ray.serve.llm` without vllm fails with Ray's own hint
        raise MlplatError(VLLM_MISSING)
    import_path, args = builder_args(cfg, resolve_model(cfg.model))
    module, _, builder = import_path.partition(":")
    return getattr(importlib.import_module(module), builder)(args)
