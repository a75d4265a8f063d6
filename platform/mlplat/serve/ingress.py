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
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk
from pydantic import BaseModel, ValidationError
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
from mlplat.serve.config import RequestLimits
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


def completion_prompt_ids(tokenizer, prompt: str) -> list[int]:
    """A completions text prompt's token ids, with the tokenizer's default special tokens (BOS for Llama-family
    tokenizers), as vLLM tokenizes them; chat prompts are rendered by a template that writes its own."""
    return tokenizer.encode(prompt)


class ToolCallHoldback:
    """The streamed content of a chat answer with active tools: text passes as it comes while no tool-call start marker
    can be forming in it; a possible prefix of the marker waits for the next text, and from a whole marker on everything
    waits for the end, where the answer is parsed (``rest``)."""

    def __init__(self, marker: str):
        self.marker, self.pending, self.sent, self.seen = marker, "", "", False

    def push(self, text: str) -> str:
        self.pending += text
        if self.seen:
            return ""
        at = self.pending.find(self.marker)
        if at >= 0:
            self.seen = True
            out = self.pending[:at]
        else:
            longest = min(len(self.marker) - 1, len(self.pending))
            keep = next((k for k in range(longest, 0, -1) if self.pending.endswith(self.marker[:k])), 0)
            out = self.pending[: len(self.pending) - keep]
        self.pending = self.pending[len(out) :]
        self.sent += out
        return out

    def rest(self, content: str) -> str:
        """At the end: what of the parsed answer's ``content`` (the text around its calls) was not sent yet."""
        if content.startswith(self.sent):
            return content[len(self.sent) :]
        sent = self.sent.strip()  # the parser strips the content around calls
        return content[len(sent) :] if content.startswith(sent) else ""


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


async def _chain(head: list[dict], rest: AsyncIterator[dict], timer: RequestTimer) -> AsyncIterator[dict]:
    """The deltas already read (and timed), then the rest, timed as they come; closing it closes ``rest`` (a client that
    went away aborts the request in the engine at once)."""
    try:
        for d in head:
            yield d
        async for d in rest:
            timer.on_delta(d["index"], len(d["token_ids"]))
            yield d
    finally:
        await rest.aclose()


def _wire(model: type[BaseModel], data: dict, loose: bool = False) -> dict:
    """``data`` as the ``openai`` package's own ``model`` validates and serializes it (fields left out stay out, so the
    wire format is what OpenAI sends). ``loose``: built as the openai client builds what it receives (``construct``, no
    validation), for the nulls OpenAI's API sends where the package's types have no room for them: a streamed completion
    chunk's ``finish_reason``, the first prompt token's log-prob under echo."""
    obj = model.construct(**data) if loose else model.model_validate(data)
    return obj.model_dump(mode="json", exclude_unset=True, warnings=False)


def _clamp(logprob: float) -> float:
    return max(logprob, -9999.0)  # -inf is not JSON; vLLM and OpenAI send -9999.0


class _Output:
    """One request's choices as the OpenAI API writes them, built from the engine's deltas: the whole response
    (``add`` then ``response``), or SSE chunks (``opening``, ``chunks`` per delta, ``usage_chunk``). Built with the
    ``openai`` package's types: ``ChatCompletion``, ``ChatCompletionChunk``, ``Completion``, ``CompletionUsage``."""

    def __init__(self, ingress: "OpenAIIngress", body, chat: bool, params, request_id: str, prompts: list[list[int]], echoes: list[str]):
        self.ingress, self.tokenizer, self.body, self.chat, self.params = ingress, ingress.tokenizer, body, chat, params
        self.request_id, self.prompts, self.echoes, self.n = request_id, prompts, echoes, params.n
        self.num_choices = params.n * len(prompts)
        self.top = body.top_logprobs_asked()
        self.tools = chat and body.tools_active()
        self.base = {"id": request_id, "created": now(), "model": body.model,  # the base model's name or an adapter's
                     "object": "chat.completion.chunk" if (chat and body.stream) else "chat.completion" if chat else "text_completion"}
        self.prompt_logprobs: dict[int, list] = {}  # prompt index -> [(log-prob, [(id, log-prob)])] of its tokens
        self.want_prompt_logprobs = params.prompt_logprobs is not None
        # whole responses
        self.tokens = {i: [] for i in range(self.num_choices)}
        self.logprobs = {i: [] for i in range(self.num_choices)}
        self.tops = {i: [] for i in range(self.num_choices)}
        self.final: dict[int, dict] = {}
        # streams
        self.detok = {i: Detokenizer(self.tokenizer, params.stop) for i in range(self.num_choices)}
        self.holdback = {i: ToolCallHoldback(ingress.tool_parser.START) for i in range(self.num_choices)} if self.tools else {}
        self.offsets = {i: 0 for i in range(self.num_choices)}  # completions' text_offset, per choice

    # -- both -----------------------------------------------------------------------------------
    def has_prompt_logprobs(self, deltas: list[dict]) -> bool:
        for d in deltas:
            if d.get("prompt_logprobs") is not None:
                self.prompt_logprobs[d["index"] // self.n] = d["prompt_logprobs"]
        return not self.want_prompt_logprobs or len(self.prompt_logprobs) == len(self.prompts)

    def _chat_logprobs(self, token_ids: list[int], logprobs: list[float], tops: list | None) -> dict:
        def entry(token_id: int, logprob: float) -> dict:
            piece = self.tokenizer.decode([token_id])
            return {"token": piece, "logprob": _clamp(logprob), "bytes": list(piece.encode())}

        return {"content": [entry(t, lp) | {"top_logprobs": [entry(a, alp) for a, alp in (tops[k] if tops else [])[: self.top]]}
                            for k, (t, lp) in enumerate(zip(token_ids, logprobs))]}  # fmt: skip

    def _completion_logprobs(self, index: int, token_ids: list[int], logprobs: list, tops: list | None) -> dict:
        """OpenAI's legacy form: each token's text, log-prob, text offset, and a {text: log-prob} of the chosen token and the
        ``logprobs`` likeliest (up to logprobs + 1 entries, as vLLM)."""
        pieces = [self.tokenizer.decode([t]) for t in token_ids]
        offsets = []
        for p in pieces:
            offsets.append(self.offsets[index])
            self.offsets[index] += len(p)
        top_logprobs = []
        for k, (t, piece, lp) in enumerate(zip(token_ids, pieces, logprobs)):
            if lp is None:  # the first prompt token: nothing before it to condition on
                top_logprobs.append(None)
                continue
            alternatives = {piece: _clamp(lp)}
            for a, alp in (tops[k] if tops else None) or []:
                if len(alternatives) > self.top:
                    break
                alternatives.setdefault(self.tokenizer.decode([a]), _clamp(alp))
            top_logprobs.append(alternatives)
        token_logprobs = [None if lp is None else _clamp(lp) for lp in logprobs]
        return {"tokens": pieces, "token_logprobs": token_logprobs, "top_logprobs": top_logprobs, "text_offset": offsets}

    def _echo_logprobs(self, index: int) -> dict:
        """The prompt's tokens' log-probs (echo + logprobs), the first one None, as vLLM."""
        prompt = self.prompts[index // self.n]
        entries = self.prompt_logprobs.get(index // self.n) or [(None, None)] * len(prompt)
        return self._completion_logprobs(index, prompt, [lp for lp, _ in entries], [alt for _, alt in entries])

    # -- whole responses --------------------------------------------------------------------------
    def add(self, d: dict) -> None:
        i = d["index"]
        self.tokens[i] += d["token_ids"]
        self.logprobs[i] += d["logprobs"]
        self.tops[i] += d.get("top_logprobs") or []
        if d["finish_reason"] is not None:
            self.final[i] = d

    def response(self, prompt_tokens: int) -> dict:
        choices = []
        for i in range(self.num_choices):
            text, reason = self.final[i]["text"], self.final[i]["finish_reason"]
            if self.chat:
                lp = self._chat_logprobs(self.tokens[i], self.logprobs[i], self.tops[i]) if self.params.logprobs else None
                content, calls = self.ingress._tool_calls(self.body, text)
                message = {"role": "assistant", "content": content} | ({"tool_calls": calls} if calls else {})
                choices.append({"index": i, "message": message, "logprobs": lp, "finish_reason": "tool_calls" if calls else reason})
                continue
            lp = None
            if self.params.logprobs:
                prompt = self._echo_logprobs(i) if self.want_prompt_logprobs else None
                lp = self._completion_logprobs(i, self.tokens[i], self.logprobs[i], self.tops[i] if self.top else None)
                if prompt is not None:
                    lp = {key: prompt[key] + lp[key] for key in lp}
            choices.append({"index": i, "text": self.echoes[i // self.n] + text, "logprobs": lp, "finish_reason": reason})
        completion_tokens = sum(len(t) for t in self.tokens.values())
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
        data = {**self.base, "choices": choices, "usage": usage}
        return _wire(ChatCompletion, data) if self.chat else _wire(Completion, data, loose=self.want_prompt_logprobs)

    # -- streams ------------------------------------------------------------------------------------
    def _chunk(self, choices: list[dict], usage: dict | None = None) -> dict:
        data = {**self.base, "choices": choices} | ({"usage": usage} if usage is not None else {})
        return _wire(ChatCompletionChunk, data) if self.chat else _wire(Completion, data, loose=True)

    def opening(self) -> list[dict]:
        """Chat: each choice's role; completions with echo: each choice's prompt text (with its log-probs under logprobs)."""
        if self.chat:
            return [self._chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
                    for i in range(self.num_choices)]  # fmt: skip
        events = []
        for i in range(self.num_choices):
            if self.echoes[i // self.n]:
                lp = self._echo_logprobs(i) if self.want_prompt_logprobs else None
                events.append(self._chunk([{"index": i, "text": self.echoes[i // self.n], "logprobs": lp, "finish_reason": None}]))
        return events

    def chunks(self, d: dict) -> list[dict]:
        """The SSE events of one engine delta: its text (held back where a stop string or a tool call may be forming),
        with its tokens' log-probs where asked; on the choice's last delta, any tool calls and the finish reason."""
        i, reason = d["index"], d["finish_reason"]
        text = self.detok[i].push(d["token_ids"]) if reason is None else self.detok[i].finish(d["text"])
        lp = None
        if self.params.logprobs and d["token_ids"]:
            tops = d.get("top_logprobs") if self.top else None
            lp = (self._chat_logprobs if self.chat else partial(self._completion_logprobs, i))(d["token_ids"], d["logprobs"], tops)
        if not self.chat:
            if not (text or reason or lp):
                return []
            return [self._chunk([{"index": i, "text": text, "logprobs": lp, "finish_reason": reason}])]
        events, calls = [], []
        if self.tools:
            text = self.holdback[i].push(text)
            if reason is not None:  # the whole answer: the calls, and the content not yet sent
                content, calls = self.ingress._tool_calls(self.body, d["text"])
                text += self.holdback[i].rest(content or "")
        if text or lp:
            events.append(self._chunk([{"index": i, "delta": {"content": text} if text else {}, "logprobs": lp, "finish_reason": None}]))
        for k, c in enumerate(calls):
            head = {"index": k, "id": c["id"], "type": "function", "function": {"name": c["function"]["name"], "arguments": ""}}
            events.append(self._chunk([{"index": i, "delta": {"tool_calls": [head]}, "finish_reason": None}]))
            args = {"index": k, "function": {"arguments": c["function"]["arguments"]}}
            events.append(self._chunk([{"index": i, "delta": {"tool_calls": [args]}, "finish_reason": None}]))
        if reason is not None:
            events.append(self._chunk([{"index": i, "delta": {}, "finish_reason": "tool_calls" if calls else reason}]))
        return events

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens, "total_tokens": prompt_tokens + completion_tokens}
        return self._chunk([], usage)


@serve.deployment  # limits and health checks: serve_apps.llm.build_app, from mlplat.serve.admission
@serve.ingress(app)
class OpenAIIngress:
    def __init__(self, model_dir: str, model_name: str, mode: str, default_max_tokens: int | None, max_model_len: int, vocab_size: int,
                 request_timeout_s: float, max_sequences_in_flight: int, gate: Gatekeeper, llm=None, prefill=None, decode=None,
                 tool_call_parser: str = "hermes", limits: RequestLimits | None = None,
                 adapters: dict[str, str | None] | None = None):  # fmt: skip
        self.tokenizer = load_tokenizer(model_dir)
        self.tool_parser = get_parser(tool_call_parser)
        self.limits = limits or RequestLimits()
        self.adapters = adapters or {}  # LoRA adapters by served name -> None, or why one cannot run on this model (a 400)
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
        card = {"object": "model", "created": now(), "owned_by": "mlplat"}
        adapters = [{"id": name, **card, "parent": self.model_name} for name, refused in self.adapters.items() if refused is None]
        return {"object": "list", "data": [{"id": self.model_name, **card}, *adapters]}  # adapters with their parent, as vLLM

    @app.post("/v1/completions")
    async def completions(self, body: CompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        self._check_limits(body)
        prompts = body.prompts()
        many = len(prompts) > 1 or prompts[0] is not body.prompt
        ids = [self._prompt_ids(p, f"prompt.{i}." if many else "prompt.") for i, p in enumerate(prompts)]
        # One response (or stream) for every prompt's samples: choice i * n + j is prompt i's sample j (as OpenAI and vLLM).
        return await self._respond(body, ids, chat=False, request=request, echoes=[self._echo(body, p, i) for p, i in zip(prompts, ids)])

    def _echo(self, body: CompletionRequest, prompt: str | list[int], ids: list[int]) -> str:
        """What ``echo`` puts before the completion: the prompt's text ("" without echo)."""
        return "" if not body.echo else prompt if isinstance(prompt, str) else self.tokenizer.decode(ids)

    def _prompt_ids(self, prompt: str | list[int], param: str) -> list[int]:
        """A completions prompt as token ids; ids outside the vocabulary are a 400 naming the position."""
        if isinstance(prompt, str):
            return completion_prompt_ids(self.tokenizer, prompt)
        bad = next((i for i, t in enumerate(prompt) if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"{param}{bad}: token id {prompt[bad]} is outside the model's vocabulary [0, {self.vocab_size})",
                           f"{param}{bad}", "invalid_token_id")  # fmt: skip
        return prompt

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, request: Request):
        self._authorize(request)
        self._check_model(body.model)
        self._check_limits(body)
        tools = body.template_tools()  # in the prompt through the chat template's tools section
        text = self.tokenizer.apply_chat_template(body.template_messages(), tools=tools, tokenize=False, add_generation_prompt=True)
        prompt_ids = self.tokenizer.encode(text, add_special_tokens=False)  # the template writes any BOS itself
        return await self._respond(body, [prompt_ids], chat=True, request=request)

    def _tool_calls(self, body, text: str) -> tuple[str | None, list[dict]]:
        """(content, tool calls) of a chat answer: calls parsed out where the request has active tools."""
        if not isinstance(body, ChatCompletionRequest) or not body.tools_active():
            return text, []
        content, calls = self.tool_parser.parse(text, {t.function.name for t in body.tools})
        return content, [c.as_openai() for c in calls]

    def _check_limits(self, body) -> None:
        """The serve config's per-request limits (RequestLimits): a 400 naming the field and the limit."""
        over = body.over_limit(self.limits)
        if over is not None:
            raise APIError(400, over[1], over[0], "limit_exceeded")

    # -- helpers --------------------------------------------------------------------------------
    def _authorize(self, request: Request) -> str:
        """The caller's tenant; 401 without a valid key, 429 over the tenant's rate limit."""
        try:
            return self.gate.admit(request.headers.get("authorization"))
        except Denied as d:
            headers = {"Retry-After": str(d.retry_after_s)} if d.retry_after_s else None
            raise APIError(d.status, d.message, code=d.code, headers=headers) from None

    def _check_model(self, model: str) -> None:
        """404 for a model this server does not have; 400 for an adapter trained for another base model."""
        if model != self.model_name and model not in self.adapters:
            available = [self.model_name, *(n for n, refused in self.adapters.items() if refused is None)]
            raise APIError(404, f"model {model!r} is not served here; available: {available}", "model", "model_not_found")
        if self.adapters.get(model) is not None:
            raise APIError(400, self.adapters[model], "model", "incompatible_adapter")

    async def _respond(self, body, prompts: list[list[int]], chat: bool, request: Request, echoes: list[str] | None = None):
        """One response (or SSE stream) for every prompt's ``n`` samples: choice i * n + j is prompt i's sample j."""
        echoes = echoes or [""] * len(prompts)
        top = body.top_logprobs_asked()
        logprobs = body.logprobs if chat else body.logprobs is not None
        # echo + logprobs: the prompt's tokens' log-probs too, computed by the engine during the prefill
        prompt_logprobs = top if not chat and body.echo and logprobs else None
        try:
            # The config's, else the checkpoint's, else OpenAI's: a chat answer may fill the context, a completion is 16 tokens.
            default_max_tokens = (self.default_max_tokens or self.generation_defaults.get("max_tokens")
                                  or (max(1, self.max_model_len - len(prompts[0])) if chat else 16))  # fmt: skip
            params = body.sampling_params(default_max_tokens, logprobs, self.generation_defaults, top, prompt_logprobs)
            if body.model != self.model_name:  # a LoRA adapter's name (checked by _check_model): the engines apply it
                params = params.model_copy(update={"lora_name": body.model})
        except ValidationError as err:  # fields valid alone, not together (e.g. min_tokens > max_tokens)
            first = err.errors()[0]
            param = ".".join(str(p) for p in first["loc"]) or None
            raise APIError(400, f"{param or 'request'}: {first['msg']}", param) from None
        bad = next((t for t in [*params.logit_bias, *params.stop_token_ids] if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            param = "logit_bias" if bad in params.logit_bias else "stop_token_ids"
            message = f"{param}: token id {bad} is outside the model's vocabulary [0, {self.vocab_size})"
            raise APIError(400, message, param, "invalid_token_id")
        for prompt_ids in prompts:
            if len(prompt_ids) + params.max_tokens > self.max_model_len:
                param = "max_tokens" if len(prompt_ids) < self.max_model_len else ("messages" if chat else "prompt")
                raise APIError(400, f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                                    f"model's context of {self.max_model_len} tokens", param, "context_length_exceeded")
        sequences = params.n * len(prompts)
        if sequences > self.max_sequences_in_flight:  # more than the engines behind this ingress hold: retrying cannot help
            param = "prompt" if len(prompts) > 1 and params.n == 1 else "n"
            raise APIError(400, f"{param}: {sequences} sequences (n x prompts) are more than this server runs at once "
                                f"({self.max_sequences_in_flight}); send fewer", param, "limit_exceeded")  # fmt: skip
        if self.sequences_in_flight + sequences > self.max_sequences_in_flight:
            raise APIError(503, f"server overloaded: {self.sequences_in_flight} sequences in flight on this ingress "
                                f"(limit {self.max_sequences_in_flight}); retry shortly", code="overloaded",
                           headers={"Retry-After": "1"}, reason="overloaded")  # fmt: skip
        self.sequences_in_flight += sequences
        streaming = False
        try:
            request_id = new_id("chatcmpl" if chat else "cmpl")
            prompt_tokens = sum(map(len, prompts))
            kind = "chat" if chat else "completion"
            log.info("request %s: %s, %d prompt(s), %d prompt tokens", request_id, kind, len(prompts), prompt_tokens)
            timer = RequestTimer(self.model_name, getattr(request.state, "started", None))
            waited = time.perf_counter() - getattr(request.state, "started", time.perf_counter())  # since arrival
            deadline = time.time() - waited + self.request_timeout_s  # wall clock: the engine replicas check it too
            deltas = self._until(self._generate(prompts, params, request_id, deadline), deadline)
            out = _Output(self, body, chat, params, request_id, prompts, echoes)
            try:
                first = await anext(deltas)  # errors (overload, bad request) surface before any byte is sent
                head = [first]
                while not out.has_prompt_logprobs(head):  # echo + logprobs: each prompt's, which come with its sample 0
                    head.append(await anext(deltas))
            except Exception as err:  # noqa: BLE001
                raise self._as_api_error(err) from None
            for d in head:
                timer.on_delta(d["index"], len(d["token_ids"]))
            deltas = _chain(head, deltas, timer)
            if body.stream:
                include_usage = body.stream_options is not None and body.stream_options.include_usage
                sse = self._sse(out, deltas, timer, prompt_tokens, include_usage)
                streaming = True  # the stream gives the sequences back when it ends
                return StreamingResponse(self._releasing(sse, sequences), media_type="text/event-stream")
            return await self._collect(out, deltas, timer, prompt_tokens)
        finally:
            if not streaming:
                self.sequences_in_flight -= sequences

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
                param = "structured_outputs" if message.startswith("structured_outputs:") else None
                param = "model" if message.startswith("adapter ") else param  # engine.lora: an adapter that does not fit
                return APIError(400, message, param)
        log.error("request failed: %r", err)
        return APIError(500, f"internal error: {type(_causes(err)[-1]).__name__}")

    def _pipelines(self, prompts: list[list[int]], params, request_id: str, deadline: float) -> list[tuple[int, AsyncIterator[dict]]]:
        """(first choice index, delta stream) per engine request: one per prompt with its n samples. In PD mode that is one
        prefill (the n first tokens drawn from its last logits) and one decode whose samples share the prompt's KV blocks."""
        return [(i * params.n, self._one(prompt_ids, params, request_id if len(prompts) == 1 else f"{request_id}-{i}", deadline))
                for i, prompt_ids in enumerate(prompts)]  # fmt: skip

    async def _generate(self, prompts: list[list[int]], params, request_id: str, deadline: float) -> AsyncIterator[dict]:
        """Every choice's deltas, merged into one stream with the request's choice indices."""
        pipes = self._pipelines(prompts, params, request_id, deadline)
        if len(pipes) == 1:
            async for d in pipes[0][1]:
                yield d
            return
        queue: asyncio.Queue = asyncio.Queue()

        async def pump(offset: int, stream: AsyncIterator[dict]):
            try:
                async for d in stream:
                    await queue.put({**d, "index": offset + d["index"]})
            except Exception as err:  # noqa: BLE001
                await queue.put(err)

        tasks = [asyncio.create_task(pump(offset, stream)) for offset, stream in pipes]
        try:
            done = 0
            while done < params.n * len(prompts):
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
            payload = self.prefill.prefill.remote(prompt_ids, p, f"{request_id}-prefill", deadline)  # a reference: not awaited here
            stream = self.decode.options(stream=True).generate_prefilled.remote(payload, p, request_id, deadline)
        async for d in stream:
            yield d

    async def _sse(self, out: "_Output", deltas, timer: RequestTimer, prompt_tokens: int, include_usage: bool = False):
        completion_tokens = 0
        try:
            for event in out.opening():
                yield sse_event(event)
            async for d in deltas:
                completion_tokens += len(d["token_ids"])
                for event in out.chunks(d):
                    yield sse_event(event)
            timer.finish(prompt_tokens)
            if include_usage:
                yield sse_event(out.usage_chunk(prompt_tokens, completion_tokens))
        except Exception as err:  # noqa: BLE001  (mid-stream: report in-band, then end the stream)
            e = self._as_api_error(err)
            metrics.SERVE_REJECTIONS.inc(model=self.model_name, reason=e.reason)
            log.warning("request %s failed mid-stream: %s", out.request_id, e.message)
            type_ = "invalid_request_error" if e.status < 500 else "server_error"
            yield sse_event({"error": {**error_body(e.message, e.param, e.code, type_)["error"], "request_id": current_request_id()}})
        yield "data: [DONE]\n\n"

    async def _collect(self, out: "_Output", deltas, timer: RequestTimer, prompt_tokens: int) -> dict:
        try:
            async for d in deltas:
                out.add(d)
        except Exception as err:  # noqa: BLE001
            raise self._as_api_error(err) from None
        timer.finish(prompt_tokens)
        return out.response(prompt_tokens)
