"""Structured logs: one JSON object per line with the run, Ray job and request they belong to.

``configure_logging(json_format=True)`` (or ``MLPLAT_LOG_FORMAT=json`` in the environment of
the process, e.g. through a Ray runtime_env) makes the ``mlplat`` loggers write lines like::

    {"ts": "2026-12-01T06:03:23.182Z", "level": "INFO", "logger": "mlplat.serve", "message": "...",
     "request_id": "3f1c...", "job_id": "01000000", "run_id": "9a8b..."}

Request ids: Ray Serve's HTTP proxy honours an incoming ``X-Request-Id`` (or makes one),
returns it in the response, and carries it to every deployment the request reaches (its
replica logs show it on each line). :class:`RequestIdMiddleware` makes the same id
available to our code (``REQUEST_ID``), and the ingress puts it in every error body.
Ids are never metric labels (one series per request): they belong here.
"""

from __future__ import annotations

import contextvars
import json
import logging
import os
import time
import uuid

REQUEST_ID: contextvars.ContextVar[str] = contextvars.ContextVar("mlplat_request_id", default="")
RUN_ID: contextvars.ContextVar[str] = contextvars.ContextVar("mlplat_run_id", default="")


def new_request_id() -> str:
    return uuid.uuid4().hex


class RequestIdMiddleware:
    """ASGI middleware for Serve ingress apps: the request's id from ``X-Request-Id`` (which Serve's
    proxy has already set, from the client or fresh, and returns in the response) into ``REQUEST_ID``
    and ``request.state.request_id``; ``request.state.started`` marks arrival for latency metrics;
    ``on_response(status)`` is called once the response has started (e.g. to count it)."""

    def __init__(self, app, on_response=None):
        self.app, self.on_response = app, on_response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        incoming = next((v.decode("latin-1") for k, v in scope.get("headers", []) if k.lower() == b"x-request-id"), "")
        request_id = incoming[:128] or new_request_id()  # outside Serve (no proxy) there may be none
        state = scope.setdefault("state", {})
        state["request_id"], state["started"] = request_id, time.perf_counter()

        async def send_and_count(message):
            if message["type"] == "http.response.start" and self.on_response:
                self.on_response(message["status"])
            await send(message)

        token = REQUEST_ID.set(request_id)
        try:
            await self.app(scope, receive, send_and_count)
        finally:
            REQUEST_ID.reset(token)


def current_request_id() -> str:
    # A function, not the ContextVar itself, for code Serve pickles by value (a ContextVar does not pickle).
    return REQUEST_ID.get()


def request_id_of(request) -> str:
    return getattr(request.state, "request_id", "") or REQUEST_ID.get()


def _job_id() -> str:
    try:
        import ray

        return ray.get_runtime_context().get_job_id() if ray.is_initialized() else ""
    except Exception:  # noqa: BLE001  (logging must never fail)
        return ""


def _serve_request_id() -> str:
    try:
        from ray.serve.context import _get_serve_request_context  # no public getter; set inside Serve replicas

        return _get_serve_request_context().request_id or ""
    except Exception:  # noqa: BLE001
        return ""


class ContextFilter(logging.Filter):
    """Stamps records with the run, job and request they belong to (empty when none)."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.request_id = getattr(record, "request_id", "") or REQUEST_ID.get() or _serve_request_id()
        record.run_id = getattr(record, "run_id", "") or RUN_ID.get() or os.environ.get("MLPLAT_RUN_ID", "")
        record.job_id = getattr(record, "job_id", "") or _job_id()
        return True


class JsonFormatter(logging.Formatter):
    FIELDS = ("request_id", "run_id", "job_id")

    def format(self, record: logging.LogRecord) -> str:
        line = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created)) + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        line |= {f: getattr(record, f) for f in self.FIELDS if getattr(record, f, "")}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line)


def configure_logging(json_format: bool | None = None, level: int = logging.INFO, logger: str = "mlplat") -> logging.Logger:
    """A handler on the ``mlplat`` logger: JSON lines if asked (default: ``MLPLAT_LOG_FORMAT=json``), else plain text."""
    if json_format is None:
        json_format = os.environ.get("MLPLAT_LOG_FORMAT", "").lower() == "json"
    target = logging.getLogger(logger)
    for handler in [h for h in target.handlers if getattr(h, "_mlplat", False)]:
        target.removeHandler(handler)
    handler = logging.StreamHandler()
    handler._mlplat = True  # ours to replace on a second call
    handler.addFilter(ContextFilter())
    handler.setFormatter(
        JsonFormatter() if json_format else logging.Formatter("%(asctime)s %(levelname)s %(name)s [%(request_id)s] %(message)s")
    )
    target.addHandler(handler)
    target.setLevel(level)
    return target
