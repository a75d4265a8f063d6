"""The OpenAI-compatible ingress: validation, auth, chat templates, detokenization, SSE.

Requests are tokenized here; token ids go to the engine deployments and token ids come
back, detokenized incrementally per choice. In PD mode the ingress asks a prefill replica
for a KV payload and hands the *response reference* to a decode replica, so the KV moves
through the object store between them and never through this process.
"""


import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import ValidationError
from ray import serve
from ray.exceptions import RayActorError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError
from starlette.exceptions import HTTPException as StarletteHTTPException

from mlplat.engine import QueueFullError, RequestFailedError
from mlplat.models.checkpoint import load_tokenizer
from mlplat.observability import catalogue as metrics
from mlplat.observability.logs import RequestIdMiddleware, current_request_id, request_id_of
from mlplat.observability.serving import RequestTimer, rejection_reason
from mlplat.serve.async_engine import DeadlineExceededError, EngineDeadError
from mlplat.serve.auth import Denied, Gatekeeper
from mlplat.serve.openai_protocol import ChatCompletionRequest, CompletionRequest, error_body, generation_defaults, new_id, now
from mlplat.serve.tool_parsers import get_parser

app = FastAPI(title="mlplat OpenAI-compatible API")
log = logging.getLogger("mlplat.serve")


def _count_response(status: int) -> None:
    metrics.SERVE_REQUESTS.inc(model=getattr(app.state, "model_name", ""), status=str(status))


def _label_metrics(model_name: str) -> None:
    """The model label of the requests and rejections counters. Serve pickles the ingress class by value, and with it
    a copy of ``app`` in its methods' globals: ``app.state`` set there never reached the middleware, which reads this
    module's ``app`` (the counters had no model label). A module function is pickled by reference: it sets the real one."""
    app.state.model_name = model_name


app.add_middleware(RequestIdMiddleware, on_response=_count_response)  # X-Request-Id into logs and error bodies; requests by status


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None, headers: dict | None = None,
                 reason: str | None = None):  # fmt: skip
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers
        self.reason = reason or rejection_reason(status, code)  # the metric label


def _error_response(request: Request, status: int, body: dict, reason: str, headers: dict | None = None) -> JSONResponse:
    body["error"]["request_id"] = request_id_of(request)  # quote it when reporting a problem: it is in every log line of the request
    metrics.SERVE_REJECTIONS.inc(model=getattr(app.state, "model_name", ""), reason=reason)
    return JSONResponse(body, status_code=status, headers=headers)


@app.exception_handler(APIError)
async def _api_error(request: Request, err: APIError):
    type_ = "invalid_request_error" if err.status < 500 else "server_error"
    return _error_response(request, err.status, error_body(err.message, err.param, err.code, type_), err.reason, err.headers)


@app.exception_handler(RequestValidationError)
async def _validation_error(request: Request, err: RequestValidationError):
    first = err.errors()[0]
    loc = [str(p) for p in first["loc"] if p != "body"]
    param = ".".join(loc) or None
    if first["type"] == "json_invalid":
        message = "request body is not valid JSON"
    elif first["type"] == "extra_forbidden":  # a field the server does not handle: refused, never silently dropped
        message = f"{param}: not supported by this server; leave it out (docs/serving.md lists the supported fields)"
    elif param is None and first["type"] == "value_error":  # a check across fields: its message starts with the field it names
        message = first["msg"].removeprefix("Value error, ")
        param = message.split(":", 1)[0] if ":" in message and " " not in message.split(":", 1)[0] else None
    else:
        message = f"{param}: {first['msg']}"
    return _error_response(request, 400, error_body(message, param), "invalid_request")


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, err: StarletteHTTPException):  # unknown routes, wrong methods
    message = f"{request.method} {request.url.path}: {err.detail}"
    if err.status_code == 404:
        message += "; routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions, GET /health"
    return _error_response(request, err.status_code, error_body(message, code="not_found" if err.status_code == 404 else None),
                           rejection_reason(err.status_code, None))  # fmt: skip


# Where a request went wrong, as the client should hear it: (status, code, retry); the rest is a 500.
OVERLOADED = (503, "overloaded", True)  # the engines are full: retry soon, maybe on another replica
UNAVAILABLE = (503, "engine_unavailable", True)  # the replica's engine stopped; Serve is replacing it
FAILURES = {
    QueueFullError: OVERLOADED,
    BackPressureError: OVERLOADED,
    EngineDeadError: UNAVAILABLE,
    RayActorError: UNAVAILABLE,  # the replica process died (also ActorDiedError, ActorUnavailableError)
    DeploymentUnavailableError: UNAVAILABLE,
    DeadlineExceededError: (504, "timeout", False),
    RequestFailedError: (500, "request_failed", False),
}


def sse_event(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _causes(err: BaseException) -> list[BaseException]:
    """The error and what it wraps: a replica's exception reaches the ingress inside Ray's
    RayTaskError (``.cause``), possibly twice (a decode call whose prefill argument failed)."""
    chain = [err]
    while (cause := getattr(chain[-1], "cause", None)) is not None and len(chain) < 8:
        chain.append(cause)
    return chain


class Detokenizer:
    """Incremental text for one choice: holds back what a stop string or a partial
    UTF-8 character could still change."""

    def __init__(self, tokenizer, stop: list[str]):
        self.tokenizer, self.ids, self.sent = tokenizer, [], ""
        self.holdback = max((len(s) for s in stop), default=1) - 1

    def push(self, token_ids: list[int]) -> str:
        self.ids += token_ids
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        ready = text[: len(text) - self.holdback] if self.holdback else text
        ready = ready.rstrip("\ufffd")
        new = ready[len(self.sent) :] if ready.startswith(self.sent) else ""
        self.sent += new
        return new

    def finish(self, final_text: str) -> str:
        new = final_text[len(self.sent) :] if final_text.startswith(self.sent) else ""
        self.sent += new
        return new


@serve.deployment  # limits and health checks: serve_apps.llm.build_app, from mlplat.serve.admission
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, model_dir: str, model_name: str, mode: str, default_max_tokens: int | None, max_model_len: int, vocab_size: int,
                 request_timeout_s: float, max_sequences_in_flight: int, gate: Gatekeeper, llm=None, prefill=None, decode=None,
                 tool_call_parser: str = "hermes"):  # fmt: skip
        self.tokenizer = load_tokenizer(model_dir)
        self.tool_parser = get_parser(tool_call_parser)
        self.generation_defaults = generation_defaults(model_dir)
        self.model_name, self.mode = model_name, mode
        self.default_max_tokens, self.max_model_len, self.vocab_size = default_max_tokens, max_model_len, vocab_size
        self.request_timeout_s = request_timeout_s
        self.max_sequences_in_flight, self.sequences_in_flight = max_sequences_in_flight, 0  # see mlplat.serve.admission
        self.gate = gate
        self.llm, self.prefill, self.decode = llm, prefill, decode
        _label_metrics(model_name)  # one ingress per replica process: the label of its metrics

    # -- routes -------------------------------------------------------------------------------
    @app.get("/health")
    async def health(self):
        """200 when every engine deployment answers through its engine loop; 503 otherwise."""
        try:
            for engines in filter(None, (self.llm, self.prefill, self.decode)):
                await asyncio.wait_for(engines.health.remote(), timeout=10)
        except Exception as err:  # noqa: BLE001
            reason = str(_causes(err)[-1]) or type(_causes(err)[-1]).__name__
            raise APIError(503, f"unhealthy: {reason}", code="engine_unavailable", headers={"Retry-After": "1"}, reason="unavailable") from None
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self, request: Request):
        self._authorize(request)
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": now(), "owned_by": "mlplat"}]}

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        prompts = body.prompts()
        many = len(prompts) > 1 or prompts[0] is not body.prompt
        ids = [self._prompt_ids(p, f"prompt.{i}." if many else "prompt.") for i, p in enumerate(prompts)]
        if not many:
            return await self._respond(body, ids[0], chat=False, logprobs=body.logprobs is not None, request=request,
                                       echo=self._echo(body, prompts[0], ids[0]))  # fmt: skip
        if body.stream:
            raise APIError(400, "prompt: a list of prompts is served without stream only; send one request per prompt to stream", "prompt")
        # Every prompt's samples in one response, choice i * n + j being prompt i's sample j (as OpenAI and vLLM).
        logprobs = body.logprobs is not None
        parts = await asyncio.gather(*(self._respond(body, i, chat=False, logprobs=logprobs, request=request, echo=self._echo(body, p, i))
                                       for p, i in zip(prompts, ids)), return_exceptions=True)  # fmt: skip
        failed = next((p for p in parts if isinstance(p, BaseException)), None)
        if failed is not None:
            raise failed
        usage = {key: sum(p["usage"][key] for p in parts) for key in parts[0]["usage"]}
        choices = [{**c, "index": i * body.n + c["index"]} for i, p in enumerate(parts) for c in p["choices"]]
        return {**parts[0], "choices": choices, "usage": usage}

    def _echo(self, body: CompletionRequest, prompt: str | list[int], ids: list[int]) -> str:
        """What ``echo`` puts before the completion: the prompt's text ("" without echo)."""
        return "" if not body.echo else prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)

    def _prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """A completions prompt as token ids; ids outside the vocabulary are a 400 naming the position."""
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=False)
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}{bad}: token id {prompt[bad]} is outside the model's vocabulary [0, {self.vocab_size})",
                           f"{param}{bad}", "invalid_token_id")  # fmt: skip
        return prompt

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        tools = body.template_tools()  # in the prompt through the chat template's tools section
        text = self.tokenizer.apply_chat_template(body.template_messages(), tools=tools, tokenize=False, add_generation_prompt=True)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)
        return await self._respond(body, prompt_ids, chat=True, logprobs=body.logprobs, request=request)

    def _tool_calls(self, body, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a chat answer: calls parsed out where the request has active tools."""
        if not isinstance(body, ChatCompletionRequest) or not body.tools_active():
            return text, []
        content, calls = self.tool_parser.parse(text, {t.function.name for t in body.tools})
        return content, [c.as_openai() for c in calls]

    # -- helpers --------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> str:
        """The caller's tenant; 401 without a valid key, 429 over the tenant's rate limit."""
        try:
            return self.gate.admit(request.headers.get("authorization"))
        except Denied as d:
            headers = {"Retry-After": str(d.retry_after_s)} if d.retry_after_s else None
            raise APIError(d.status, d.message, code=d.code, headers=headers) from None

    def _check_model(self, model: str) -> None:
        if model != self.model_name:
            raise APIError(404, f"model {model!r} is not served here; available: [{self.model_name!r}]", "model", "model_not_found")

    async def _respond(self, body, prompt_ids: list[int], chat: bool, logprobs: bool, request: Request, echo: str = ""):
        try:
            # The config's, else the checkpoint's, else OpenAI's: a chat answer may fill the context, a completion is 16 tokens.
            default_max_tokens = (self.default_max_tokens or self.generation_defaults.get("max_tokens")
                                  or (max(1, self.max_model_len - len(prompt_ids)) if chat else 16))  # fmt: skip
            params = body.sampling_params(default_max_tokens, logprobs, self.generation_defaults)
        except ValidationError as err:  # fields valid alone, not together (e.g. min_tokens > max_tokens)
            first = err.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"{param or 'request'}: {first['msg']}", param) from None
        bad = next((t for t in [*params.logit_bias, *params.stop_token_ids] if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            param = "logit_bias" if bad in params.logit_bias else "stop_token_ids"
            message = f"{param}: token id {bad} is outside the model's vocabulary [0, {self.vocab_size})"
            raise APIError(400, message, param, "invalid_token_id")
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            param = "max_tokens" if len(prompt_ids) < self.max_model_len else ("messages" if chat else "prompt")
            raise APIError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                f"model's context of {self.max_model_len} tokens", param, "context_length_exceeded")
        if self.sequences_in_flight + params.n > self.max_sequences_in_flight:
            raise APIError(503, f"server overloaded: {self.sequences_in_flight} sequences in flight on this ingress "
                                f"(limit {self.max_sequences_in_flight}); retry shortly", code="overloaded",
                           headers={"Retry-After": "1"}, reason="overloaded")  # fmt: skip
        self.sequences_in_flight += params.n
        streaming = False
        try:
            request_id = new_id("chatcmpl" if chat else "cmpl")
            log.info("request %s: %s, %d prompt tokens", request_id, "chat" if chat else "completion", len(prompt_ids))
            timer = RequestTimer(self.model_name, getattr(request.state, "started", None))
            waited = time.perf_counter() - getattr(request.state, "started", time.perf_counter())  # since arrival
            deadline = time.time() - waited + self.request_timeout_s  # wall clock: the engine replicas check it too
            deltas = self._until(self._generate(prompt_ids, params, request_id, deadline), deadline)
            try:
                first = await anext(deltas)  # errors (overload, bad request) surface before any byte is sent
            except Exception as err:  # noqa: BLE001
                raise self._as_api_error(err) from None
            timer.on_delta(first["index"], len(first["token_ids"]))
            if body.stream:
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                sse = self._sse(first, deltas, params, request_id, chat, timer, len(prompt_ids), include_usage, echo, body)
                streaming = True  # the stream gives the sequences back when it ends
                return StreamingResponse(self._releasing(sse, params.n), media_type="text/event-stream")
            return await self._collect(first, deltas, params, prompt_ids, request_id, chat, timer, echo, body)
        finally:
            if not streaming:
                self.sequences_in_flight -= params.n

    async def _releasing(self, events: AsyncIterator[str], n: int) -> AsyncIterator[str]:
        try:
            async for event in events:
                yield event
        finally:
            self.sequences_in_flight -= n

    @staticmethod
    async def _until(deltas: AsyncIterator[dict], deadline: float) -> AsyncIterator[dict]:
        """The deadline, held here too: the engine enforces it on requests it holds (freeing their
        blocks), this catches time spent before (Serve's queues, a prefill in PD mode)."""
        try:
            while True:
                try:  # a second past the engine's own check, whose error says more
                    delta = await asyncio.wait_for(anext(deltas), timeout=max(0.0, deadline - time.time()) + 1.0)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise DeadlineExceededError("request ran past its deadline (request_timeout_s)") from None
                yield delta
        finally:
            await deltas.aclose()

    def _as_api_error(self, err: BaseException) -> APIError:
        if isinstance(err, APIError):
            return err
        for cause in _causes(err):
            for kind, (status, code, retry) in FAILURES.items():
                if isinstance(cause, kind):
                    reason = {"overloaded": "overloaded", "engine_unavailable": "unavailable", "timeout": "timeout"}.get(code)
                    message = f"server overloaded: {cause}" if code == "overloaded" else str(cause) or type(cause).__name__
                    return APIError(status, message, code=code, headers={"Retry-After": "1"} if retry else None, reason=reason)
            if isinstance(cause, ValueError):  # the engine's checks (the innermost: Ray's wrapper is a ValueError too, with a traceback)
                message = str(next((c for c in reversed(_causes(err)) if isinstance(c, ValueError)), cause))
                return APIError(400, message, "structured_outputs" if message.startswith("structured_outputs:") else None)
        log.error("request failed: %r", err)
        return APIError(500, f"internal error: {type(_causes(err)[-1]).__name__}")

    async def _generate(self, prompt_ids: list[int], params, request_id: str, deadline: float) -> AsyncIterator[dict]:
        if params.n == 1 or self.mode == "colocated":
            async for d in self._one(prompt_ids, params, request_id, deadline):
                yield d
            return
        # PD with n > 1: n independent prefill->decode pipelines (the prefill replica's prefix
        # cache makes the repeats cheap), merged into one stream with choice indices.
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(i: int):
            seed = None if params.seed is None else params.seed + i
            try:
                async for d in self._one(prompt_ids, params.model_copy(update={"n": 1, "seed": seed}), f"{request_id}-{i}", deadline):
                    await queue.put({**d, "index": i})
            except Exception as err:  # noqa: BLE001
                await queue.put(err)

        tasks = [asyncio.create_task(pump(i)) for i in range(params.n)]
        try:
            done = 0
            while done < params.n:
                item = await queue.get()
                if isinstance(item, Exception):
                    raise item
                done += item["finish_reason"] is not None
                yield item
        finally:
            for t in tasks:
                t.cancel()

    async def _one(self, prompt_ids: list[int], params, request_id: str, deadline: float) -> AsyncIterator[dict]:
        p = params.model_dump()
        if self.mode == "colocated":
            stream = self.llm.options(stream=True).generate.remote(prompt_ids, p, request_id, deadline)
        else:
            payload = self.prefill.prefill.remote(prompt_ids, p)  # a reference: not awaited here
            stream = self.decode.options(stream=True).generate_prefilled.remote(payload, p, request_id, deadline)
        async for d in stream:
            yield d

    async def _sse(self, first, deltas, params, request_id: str, chat: bool, timer: RequestTimer, prompt_tokens: int,
                   include_usage: bool = False, echo: str = "", body=None):  # fmt: skip
        detok = {i: Detokenizer(self.tokenizer, params.stop) for i in range(params.n)}
        # With active tools the answer is held back until it ends, then sent as tool-call deltas or as content.
        tools = chat and isinstance(body, ChatCompletionRequest) and body.tools_active()
        base = {"id": request_id, "object": "chat.completion.chunk" if chat else "text_completion", "created": now(), "model": self.model_name}
        if chat:
            for i in range(params.n):
                yield sse_event({**base, "choices": [{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}]})
        elif echo:
            for i in range(params.n):
                yield sse_event({**base, "choices": [{"index": i, "text": echo, "logprobs": None, "finish_reason": None}]})
        completion_tokens = 0
        try:
            d = first
            while True:
                completion_tokens += len(d["token_ids"])
                if tools:
                    if d["finish_reason"] is None:
                        d = await anext(deltas, None)
                        if d is None:
                            break
                        timer.on_delta(d["index"], len(d["token_ids"]))
                        continue
                    for chunk in self._tool_chunks(body, d, base):
                        yield chunk
                    d = await anext(deltas, None)
                    if d is None:
                        break
                    timer.on_delta(d["index"], len(d["token_ids"]))
                    continue
                text = detok[d["index"]].push(d["token_ids"]) if d["finish_reason"] is None else detok[d["index"]].finish(d["text"])
                if text or d["finish_reason"]:
                    choice = {"index": d["index"], "finish_reason": d["finish_reason"]}
                    choice.update({"delta": {"content": text} if text else {}} if chat else {"text": text, "logprobs": None})
                    yield sse_event({**base, "choices": [choice]})
                d = await anext(deltas, None)
                if d is None:
                    break
                timer.on_delta(d["index"], len(d["token_ids"]))
            timer.finish(prompt_tokens)
            if include_usage:
                usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens}
                yield sse_event({**base, "choices": [], "usage": usage | {"total_tokens": prompt_tokens + completion_tokens}})
        except Exception as err:  # noqa: BLE001  (mid-stream: report in-band, then end the stream)
            e = self._as_api_error(err)
            metrics.SERVE_REJECTIONS.inc(model=self.model_name, reason=e.reason)
            log.warning("request %s failed mid-stream: %s", request_id, e.message)
            type_ = "invalid_request_error" if e.status < 500 else "server_error"
            yield sse_event({"error": {**error_body(e.message, e.param, e.code, type_)["error"], "request_id": current_request_id()}})
        yield "data: [DONE]\n\n"

    def _tool_chunks(self, body, d: dict, base: dict) -> list[str]:
        """The SSE events of one finished choice of a tools request: its content, each call (id and name, then the
        arguments), then the finish reason (tool_calls where it called any)."""
        content, calls = self._tool_calls(body, d["text"])
        i, events = d["index"], []
        if content:
            events.append(sse_event({**base, "choices": [{"index": i, "delta": {"content": content}, "finish_reason": None}]}))
        for k, c in enumerate(calls):
            head = {"index": k, "id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": ""}}
            events.append(sse_event({**base, "choices": [{"index": i, "delta": {"tool_calls": [head]}, "finish_reason": None}]}))
            args = {"index": k, "function": {"arguments": c["function"]["arguments"]}}
            events.append(sse_event({**base, "choices": [{"index": i, "delta": {"tool_calls": [args]}, "finish_reason": None}]}))
        reason = "tool_calls" if calls else d["finish_reason"]
        events.append(sse_event({**base, "choices": [{"index": i, "delta": {}, "finish_reason": reason}]}))
        return events

    async def _collect(self, first, deltas, params, prompt_ids, request_id: str, chat: bool, timer: RequestTimer, echo: str = "",
                       body=None):  # fmt: skip
        tokens = {i: [] for i in range(params.n)}
        logprobs = {i: [] for i in range(params.n)}
        final = {}
        d = first
        try:
            while d is not None:
                tokens[d["index"]] += d["token_ids"]
                logprobs[d["index"]] += d["logprobs"]
                if d["finish_reason"] is not None:
                    final[d["index"]] = d
                d = await anext(deltas, None)
                if d is not None:
                    timer.on_delta(d["index"], len(d["token_ids"]))
        except Exception as err:  # noqa: BLE001
            raise self._as_api_error(err) from None
        timer.finish(len(prompt_ids))
        choices = []
        for i in range(params.n):
            text, reason = final[i]["text"], final[i]["finish_reason"]
            lp = self._logprobs(tokens[i], logprobs[i], chat) if params.logprobs else None
            if chat:
                content, calls = self._tool_calls(body, text)
                message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": "tool_calls" if calls else reason})
            else:
                choices.append({"index": i, "text": echo + text, "logprobs": lp, "finish_reason": reason})
        completion_tokens = sum(len(t) for t in tokens.values())
        return {
            "id": request_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": now(),
            "model": self.model_name,
            "choices": choices,
            "usage": {"prompt_tokens": len(prompt_ids), "completion_tokens": completion_tokens, "total_tokens": len(prompt_ids) + completion_tokens},
        }

    def _logprobs(self, token_ids: list[int], logprobs: list[float], chat: bool) -> dict:
        pieces = [self.tokenizer.decode([t]) for t in token_ids]
        if chat:
            return {"content": [{"token": p, "logprob": lp, "bytes": list(p.encode()), "top_logprobs": []} for p, lp in zip(pieces, logprobs)]}
        offsets, pos = [], 0
        for p in pieces:
            offsets.append(pos)
            pos += len(p)
        return {"tokens": pieces, "token_logprobs": logprobs, "top_logprobs": None, "text_offset": offsets}
