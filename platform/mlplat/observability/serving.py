"""Serving metrics at their two sources: one request as the ingress sees it, one engine replica's state."""

from __future__ import annotations

import time

from mlplat.observability import catalogue as c


class RequestTimer:
    """TTFT, inter-token gaps and end-to-end latency of one request, from its arrival at the ingress."""

    def __init__(self, model: str, started: float | None = None):
        self.model = model
        self.started = started if started is not None else time.perf_counter()
        self.first: float | None = None
        self.last: dict[int, float] = {}  # choice index -> when its latest tokens arrived
        self.tokens = 0

    def on_delta(self, index: int, num_tokens: int) -> None:
        now = time.perf_counter()
        if num_tokens <= 0:
            return
        if self.first is None:
            self.first = now
            c.SERVE_TTFT.observe(now - self.started, model=self.model)
        elif index in self.last:
            gap = (now - self.last[index]) / num_tokens  # tokens that arrive together share the gap
            for _ in range(min(num_tokens, 16)):
                c.SERVE_ITL.observe(gap, model=self.model)
        self.last[index] = now
        self.tokens += num_tokens

    def finish(self, prompt_tokens: int) -> None:
        c.SERVE_E2E.observe(time.perf_counter() - self.started, model=self.model)
        c.SERVE_GENERATED_TOKENS.inc(self.tokens, model=self.model)
        c.SERVE_PROMPT_TOKENS.inc(prompt_tokens, model=self.model)


def rejection_reason(status: int, code: str | None) -> str:
    """The `reason` label of a refused request (a fixed set); the ingress says ``overloaded`` itself."""
    if status == 401:
        return "unauthorized"
    if status == 429:
        return "rate_limited"
    if status == 404:
        return "not_found"
    if code == "context_length_exceeded":
        return "context_length"
    if status == 504:
        return "timeout"
    if status == 503:
        return "unavailable"
    if status >= 500:
        return "internal_error"
    return "invalid_request"


def record_engine_stats(stats: dict, role: str) -> None:
    """One engine replica's scheduler and KV cache state (``AsyncEngine.stats()``) as gauges."""
    c.SERVE_QUEUE_LENGTH.set(stats["waiting"], role=role)
    c.SERVE_RUNNING.set(stats["running"], role=role)
    c.SERVE_KV_USAGE.set(stats["kv_usage"], role=role)
    c.SERVE_PREFIX_HIT_RATE.set(stats["prefix_hit_rate"], role=role)
    c.SERVE_SPEC_ACCEPTANCE.set(stats["spec_acceptance"], role=role)
    if "kv_blocks_used" in stats:
        c.SERVE_KV_BLOCKS_USED.set(stats["kv_blocks_used"], role=role)
