"""How many requests each layer of the serving app admits, derived from one source so they agree.

The engine's capacity (``max_num_seqs`` running + ``max_waiting`` waiting sequences per replica)
is the unit. The ingress sheds load itself (503 with an OpenAI error body and Retry-After) once the
sequences it has in flight would fill every serving replica's engine; Serve's own limits sit above
that, so Serve never queues a request the engines cannot take or answers with its plain-text
rejection. Serve's limits count requests, the engines' count sequences (a request holds ``n``): a
request past an engine's own bound still ends in the same 503, through QueueFullError.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from mlplat.engine import EngineConfig
from mlplat.serve.config import ServeConfig

# Serve's per-replica limit on the ingress sits this far above the ingress's own shedding point: the
# requests being answered with 503, /health and /v1/models must not wait in Serve's queue.
INGRESS_HEADROOM = 64


@dataclass(frozen=True)
class AdmissionLimits:
    engine_sequences: int  # per engine replica: max_num_seqs + max_waiting (the engine refuses more)
    engine_max_ongoing_requests: int  # Serve, per engine replica (prefill, decode, colocated)
    engine_max_queued_requests: int  # Serve, per caller: what waits at an ingress for a busy engine replica
    ingress_sequences: int  # per ingress replica: in flight above this, the ingress answers 503
    ingress_max_ongoing_requests: int  # Serve, per ingress replica

    def check(self) -> None:
        assert self.ingress_max_ongoing_requests > self.ingress_sequences, "Serve would queue before the ingress sheds"
        assert self.engine_max_ongoing_requests <= self.engine_sequences, "Serve would send an engine more than it holds"
        assert self.engine_max_queued_requests >= self.ingress_sequences, "an ingress's admitted requests must fit Serve's queue"


def admission_limits(cfg: ServeConfig, engine: EngineConfig) -> AdmissionLimits:
    per_engine = engine.max_num_seqs + engine.max_waiting
    serving = cfg.colocated if cfg.mode == "colocated" else cfg.decode  # where sequences live until they finish
    # An autoscaled pool counts at its largest: below it, what the replicas cannot take yet waits in Serve's
    # queue, and that queue is the load Serve scales the pool on.
    per_ingress = math.ceil(per_engine * serving.max_replicas / cfg.ingress.num_replicas)
    limits = AdmissionLimits(
        engine_sequences=per_engine,
        engine_max_ongoing_requests=per_engine,
        engine_max_queued_requests=per_ingress,
        ingress_sequences=per_ingress,
        ingress_max_ongoing_requests=per_ingress + INGRESS_HEADROOM,
    )
    limits.check()
    return limits
