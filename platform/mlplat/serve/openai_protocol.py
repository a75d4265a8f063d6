"""OpenAI-compatible request/response schemas and error bodies (the subset we serve)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from mlplat.engine import SamplingParams

MAX_N = 8
MAX_STOP = 4  # stop strings per request (OpenAI's limit)
MAX_LOGIT_BIAS = 300  # logit_bias entries per request (OpenAI's limit)
MAX_PROMPTS = 64  # prompts in one completions request

# Fields an OpenAI client may send that change nothing in this server's responses: accepted and ignored,
# as vLLM does (docs/serving.md lists them). Any other field the server does not handle is a 400 naming it.
NO_EFFECT = {"user", "metadata", "store", "service_tier", "prompt_cache_key", "prompt_cache_retention", "safety_identifier"}


# A checkpoint's generation_config.json keys that set sampling defaults, as vLLM reads them (its
# --generation-config auto): the checkpoint's recommended values for requests that do not say.
GENERATION_DEFAULTS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                       "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}  # fmt: skip


def generation_defaults(model_dir: str | Path) -> dict:
    """The sampling defaults a checkpoint's generation_config.json sets (request field -> value); {} without one."""
    path = Path(model_dir) / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return {field: config[key] for key, field in GENERATION_DEFAULTS.items() if config.get(key) is not None}


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]  # images, audio and files: this server serves text models
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None
    tool_call_id: str | None = None

    def for_template(self) -> dict:
        """The message as chat templates take it: text parts joined; ``developer`` (OpenAI's newer name for
        the instructions role, which templates do not know) as ``system``."""
        content = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content}
        return message | {k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id)) if v is not None}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False  # a last chunk with the usage and no choices


class _Common(BaseModel):
    # A field this server does not handle is refused by name (the ingress turns extra_forbidden into a 400),
    # never silently dropped: a client asking for e.g. response_format must not get a 200 without it.
    model_config = ConfigDict(extra="forbid")
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: Annotated[dict[int, float], Field(max_length=MAX_LOGIT_BIAS)] | None = None  # token id (a string in JSON) -> bias
    # vLLM's extra sampling fields (the openai client's extra_body)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # accepted, no effect on the output (NO_EFFECT)
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None

    @field_validator("stream_options")
    @classmethod
    def _only_with_a_stream(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream: true")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, default_max_tokens: int, logprobs: bool, defaults: dict | None = None) -> SamplingParams:
        """The engine's parameters: the request's fields, and for those it leaves unset ``defaults`` (the
        checkpoint's generation_config.json: ``generation_defaults``), else the fields' own defaults."""
        given = {name: getattr(self, name) for name in self.model_fields_set}
        field = {**(defaults or {}), **given}.get
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        controls = {"presence_penalty": self.presence_penalty, "frequency_penalty": self.frequency_penalty,
                    "repetition_penalty": field("repetition_penalty", 1.0), "logit_bias": self.logit_bias or {},
                    "min_p": field("min_p", 0.0), "min_tokens": self.min_tokens}  # fmt: skip
        return SamplingParams(
            max_tokens=self.requested_max_tokens() or default_max_tokens,
            temperature=field("temperature", 1.0),
            top_p=field("top_p", 1.0),
            top_k=field("top_k", -1),
            n=self.n,
            seed=self.seed,
            stop=stop,
            stop_token_ids=self.stop_token_ids or [],
            ignore_eos=self.ignore_eos,
            logprobs=logprobs,
            # only what differs from the engine's defaults, so requests that use none of them build plain params
            **{k: v for k, v in controls.items() if v != SamplingParams.model_fields[k].default},
        )


Prompt = Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]  # text, or token ids


class CompletionRequest(_Common):
    # one prompt, or several (OpenAI's batch form: choice i * n + j is prompt i's sample j)
    prompt: Prompt | Annotated[list[Annotated[str, Field(min_length=1)]] | list[Annotated[list[int], Field(min_length=1)]],
                               Field(min_length=1, max_length=MAX_PROMPTS)]  # fmt: skip
    logprobs: int | None = Field(None, ge=0, le=0)  # 0: the chosen tokens' log-probs; top alternatives are not returned
    echo: bool = False  # the prompt's text before the completion

    @field_validator("echo")
    @classmethod
    def _echo_without_logprobs(cls, value, info):
        if value and info.data.get("logprobs") is not None:  # OpenAI's echo + logprobs scores the prompt too
            raise ValueError("with logprobs it would need the prompt's log-probs, which this server does not return yet")
        return value


    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of a list."""
        one = isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int))
        return [self.prompt] if one else list(self.prompt)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=0)  # top alternatives are not returned; 0 or unset
    parallel_tool_calls: Any = None  # no effect without tools (which are refused)

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


def error_body(message: str, param: str | None = None, code: str | None = None, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
