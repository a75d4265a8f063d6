"""The engine as a Serve deployment, in three roles from one class: colocated (prefill and
decode), prefill-only (returns KV payloads) and decode-only (imports them)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import asdict
from functools import partial

from ray import serve

from mlplat.engine import EngineConfig, SamplingParams
from mlplat.engine.engine import FaultHook
from mlplat.engine.kv_transfer import KVPayload
from mlplat.observability import catalogue as metrics
from mlplat.observability.serving import record_engine_stats
from mlplat.serve.async_engine import AsyncEngine, EngineDeadError
from mlplat.serve.kv_index import publish_kv_events as kv_event_publisher

log = logging.getLogger("mlplat.serve")
ROLES = {"prefill": "prefill", "decode": "decode"}  # deployment name -> metrics role; any other name serves both: colocated


def _deployment_name() -> str:
    try:
        return serve.get_replica_context().deployment
    except Exception:  # noqa: BLE001  (outside a Serve replica, e.g. a unit test)
        return ""


@serve.deployment  # limits and health checks: serve_apps.llm.build_app, from mlplat.serve.admission
class EngineServer:
    def __init__(self, engine_config: dict, publish_kv_events: bool = False):
        role = ROLES.get(_deployment_name(), "colocated")
        self.engine = AsyncEngine(EngineConfig(**engine_config), on_stats=partial(record_engine_stats, role=role))
        self.handoffs = {"count": 0, "bytes": 0, "latency_s": 0.0, "import_failures": 0}
        if publish_kv_events:  # this pool is routed on its replicas' KV block events (mlplat.serve.kv_index)
            context = serve.get_replica_context()
            self._kv_publisher = asyncio.get_running_loop().create_task(
                kv_event_publisher(self.engine.kv_events, context.app_name, context.deployment, context.replica_id.to_full_id_str()))

    def check_health(self) -> None:
        """Serve calls this every health_check_period_s: a replica whose engine loop stopped is replaced."""
        if not self.engine.alive:
            raise EngineDeadError(self.engine.dead_reason or "the engine loop is not running")

    async def health(self) -> bool:
        """For the ingress's GET /health: a round trip through the engine loop."""
        self.check_health()
        await self.engine.stats()
        return True

    async def set_fault_hook(self, hook: FaultHook | None) -> None:
        """Tests only: run ``hook`` inside this replica's engine steps (see mlplat.engine.engine.FaultHook)."""
        await self.engine.set_fault_hook(hook)

    async def generate(self, prompt_ids: list[int], params: dict, request_id: str, deadline: float | None = None) -> AsyncIterator[dict]:
        async for delta in self.engine.generate(prompt_ids, SamplingParams(**params), request_id, deadline):
            yield asdict(delta)

    async def prefill(self, prompt_ids: list[int], params: dict, request_id: str | None = None,
                      deadline: float | None = None) -> KVPayload:  # fmt: skip
        """The prompt's KV and its n samples' first tokens, prefilled in the engine's batch beside every other request."""
        return await self.engine.prefill(prompt_ids, SamplingParams(**params), request_id, deadline)

    async def generate_prefilled(self, payload: KVPayload, params: dict, request_id: str, deadline: float | None = None) -> AsyncIterator[dict]:
        """Decode from a prefill server's payload (resolved from the object store in this
        replica, never through the ingress); recompute the prefill here if import fails."""
        sampling = SamplingParams(**params)
        latency_s = max(0.0, time.time() - payload.created_at)
        self.handoffs["count"] += 1
        self.handoffs["bytes"] += payload.nbytes
        self.handoffs["latency_s"] += latency_s
        metrics.SERVE_KV_HANDOFF_BYTES.observe(payload.nbytes)
        metrics.SERVE_KV_HANDOFF_SECONDS.observe(latency_s)
        try:
            stream = self.engine.generate_prefilled(payload, sampling, request_id, deadline)
            first = await anext(stream)
        except ValueError as err:  # an incompatible payload (shape, dtype); overload (QueueFullError) propagates as 429
            log.warning("request %s: KV payload import failed (%s); recomputing the prefill", request_id, err)
            self.handoffs["import_failures"] += 1
            metrics.SERVE_KV_HANDOFF_FAILURES.inc()
            stream = self.engine.generate(payload.prompt_token_ids, sampling, request_id, deadline)
            first = await anext(stream)
        yield asdict(first)
        async for delta in stream:
            yield asdict(delta)

    async def stats(self) -> dict:
        return {**await self.engine.stats(), "handoffs": dict(self.handoffs)}

    async def record_routing_stats(self) -> dict:
        """Polled by Serve for routers: decode replicas are chosen by free KV blocks."""
        return await self.engine.stats()
