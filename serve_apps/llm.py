"""The LLM serving app: OpenAI ingress -> prefill -> KV handoff -> decode (or colocated).

    serve run serve_apps.llm:app_builder model=models:/quickstart-tiny@quickstart mode=pd
    mlplat serve --set model=... --set mode=colocated
    mlplat serve --set engine=vllm --set auth.enabled=false ...   # on GPUs: docs/serving.md

``build_app(ServeConfig)`` returns the Serve application; ``app_builder(args)`` is the
import path for `serve run` and Serve config YAMLs (``args`` holds ServeConfig fields).
"""

from __future__ import annotations

from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from mlplat.config import validate
from mlplat.engine import EngineConfig
from mlplat.serve.admission import admission_limits
from mlplat.serve.auth import build_gatekeeper
from mlplat.serve.config import ReplicaConfig, ServeConfig
from mlplat.serve.ingress import OpenAIIngress
from mlplat.serve.lora import ResolvedAdapters, resolve_adapters
from mlplat.serve.routing import FreeKVRouter, KVEventRouter, PrefixAwareRouter, RoundRobinRouter
from mlplat.serve.servers import EngineServer
from mlplat.serve.vllm_backend import build_vllm_app
from mlplat.tracking import resolve_model


def _options(replicas: ReplicaConfig, name: str, max_ongoing_requests: int, max_queued_requests: int = -1) -> dict:
    return {"name": name, **replicas.scaling_options(),  # num_replicas, or autoscaling_config for a pool Serve sizes
            "ray_actor_options": {"num_cpus": replicas.num_cpus, "num_gpus": replicas.num_gpus, "resources": replicas.resources},
            "max_ongoing_requests": max_ongoing_requests, "max_queued_requests": max_queued_requests,
            "health_check_period_s": replicas.health_check_period_s, "health_check_timeout_s": replicas.health_check_timeout_s}


def _routed(router: str, block_size: int, replicas: ReplicaConfig) -> tuple[dict, dict]:
    """Deployment options and EngineServer bind arguments for an engine pool routed by ``router`` (ServeConfig.prefill_router,
    colocated_router; mlplat.serve.routing)."""
    if router == "power_of_two":  # Serve's default router
        return {}, {}
    routers = {"kv_events": (KVEventRouter, {"block_size": block_size}), "prefix_aware": (PrefixAwareRouter, {"block_size": block_size}),
               "round_robin": (RoundRobinRouter, {})}  # fmt: skip
    router_class, router_kwargs = routers[router]
    options = {"request_router_config": RequestRouterConfig(request_router_class=router_class, request_router_kwargs=router_kwargs)}
    # kv_events: the pool's replicas publish their KV block events to an index the router asks (mlplat.serve.kv_index);
    # a pool that never has a second replica has nothing to choose
    return options, ({"publish_kv_events": True} if router == "kv_events" and replicas.max_replicas > 1 else {})


def build_app(cfg: ServeConfig) -> Application:
    if cfg.engine == "vllm":  # the same topology on Ray Serve LLM (mlplat.serve.vllm_backend)
        return build_vllm_app(cfg)
    model_dir = resolve_model(cfg.model)
    # the engine's max_logprobs follows the ingress's limit unless engine_args sets it
    given = {"max_logprobs": cfg.limits.max_top_logprobs, **cfg.engine_args, "model": str(model_dir)}
    adapters = ResolvedAdapters()
    if cfg.lora is not None:  # adapters by name, resolved to local files that every engine replica reads on first use
        if "lora" in cfg.engine_args:
            raise ValueError("engine_args.lora: set the adapters in the top-level lora section (it resolves models:/ URIs)")
        adapters = resolve_adapters(cfg.lora, cfg.model, model_dir, cfg.served_name(model_dir))
        given["lora"] = adapters.engine_config(cfg.lora)
    engine_cfg = validate(EngineConfig, given, "engine_args")
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    limits = admission_limits(cfg, engine_cfg)
    common = dict(
        model_dir=str(model_dir),
        model_name=cfg.served_name(model_dir),
        mode=cfg.mode,
        default_max_tokens=cfg.default_max_tokens,
        max_model_len=engine_cfg.max_model_len or hf_config.max_position_embeddings,
        vocab_size=hf_config.vocab_size,
        request_timeout_s=cfg.request_timeout_s,
        max_sequences_in_flight=limits.ingress_sequences,
        gate=build_gatekeeper(cfg.auth, cfg.ingress.num_replicas),  # holds key hashes only, never keys
        tool_call_parser=cfg.tool_call_parser,
        limits=cfg.limits,
        adapters={**dict.fromkeys(adapters.paths), **adapters.refused},  # served name -> None, or why it is refused
    )
    engine_args = engine_cfg.model_dump(mode="json")
    ingress = OpenAIIngress.options(**_options(cfg.ingress, "ingress", limits.ingress_max_ongoing_requests))

    def engines(replicas: ReplicaConfig, name: str, bind_kwargs: dict | None = None, **options):
        # A replica Serve removes (downscale, redeploy) drains: it finishes its requests, which end by their deadline.
        deployment = EngineServer.options(**_options(replicas, name, limits.engine_max_ongoing_requests, limits.engine_max_queued_requests),
                                          graceful_shutdown_timeout_s=cfg.request_timeout_s, **options)  # fmt: skip
        return deployment.bind(engine_args, **(bind_kwargs or {}))

    if cfg.mode == "colocated":
        options, bind_kwargs = _routed(cfg.colocated_router, engine_cfg.block_size, cfg.colocated)
        return ingress.bind(**common, llm=engines(cfg.colocated, "llm", bind_kwargs, **options))
    options, bind_kwargs = _routed(cfg.prefill_router, engine_cfg.block_size, cfg.prefill)
    prefill = engines(cfg.prefill, "prefill", bind_kwargs, **options)
    decode = engines(cfg.decode, "decode",
                     request_router_config=RequestRouterConfig(request_router_class=FreeKVRouter, request_routing_stats_period_s=1.0))
    return ingress.bind(**common, prefill=prefill, decode=decode)


def app_builder(args: dict) -> Application:
    """Entry point for `serve run serve_apps.llm:app_builder key=value ...`."""
    return build_app(validate(ServeConfig, dict(args), "serve args"))


def run(cfg: ServeConfig, blocking: bool = False) -> str:
    """Deploy on the connected Ray cluster; returns the base URL of the OpenAI API."""
    app = build_app(cfg)
    serve.run(app, name=cfg.app_name, route_prefix=cfg.route_prefix, blocking=blocking)
    return f"http://127.0.0.1:8000{cfg.route_prefix.rstrip('/')}/v1"
