"""OpenAI-compatible request/response schemas and error bodies (the subset we serve)."""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic.json_schema import SkipJsonSchema

from mlplat.engine import SamplingParams
from mlplat.engine.structured import StructuredOutputs
from mlplat.serve.config import RequestLimits

# vLLM's old structured-output fields, which current vLLM dropped for structured_outputs: refused with a 400 naming it
GUIDED = ("guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend", "guided_whitespace_pattern")

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


class ToolCallFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None  # None: an assistant turn that only calls tools
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCall] | None = None  # an earlier assistant turn's calls

    @model_validator(mode="after")
    def _content(self) -> "ChatMessage":
        if self.content is None and not (self.role == "assistant" and self.tool_calls):
            raise ValueError("content is required (only an assistant message with tool_calls may leave it out)")
        return self

    def for_template(self) -> dict:
        """The message as chat templates take it: text parts joined; ``developer`` (OpenAI's newer name for
        the instructions role, which templates do not know) as ``system``; tool calls' arguments as objects
        (what Hermes/Qwen-style templates render with ``tojson``)."""
        content = self.content if isinstance(self.content, str | None) else "".join(part.text for part in self.content)
        message = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:
            message["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.function.name, "arguments": _json_or_text(c.function.arguments)}}
                for c in self.tool_calls
            ]
        return message | {k: v for k, v in (("name", self.name), ("tool_call_id", self.tool_call_id)) if v is not None}


def _closed(schema):
    """A JSON schema whose objects that leave additionalProperties unsaid allow none (as OpenAI's strict mode): arguments
    still valid for the original, and a model cannot wander off into invented keys until max_tokens cuts the JSON."""
    if isinstance(schema, list):
        return [_closed(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: (_closed(v) if k not in ("enum", "const", "default", "examples") else v) for k, v in schema.items()}
    if "properties" in schema:
        out["properties"] = {k: _closed(v) for k, v in schema["properties"].items()}
    if (schema.get("type") == "object" or "properties" in schema) and "additionalProperties" not in schema:
        out["additionalProperties"] = False
    return out


def _json_or_text(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text


class JSONSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict = Field(default_factory=dict, alias="schema")
    strict: bool | None = None  # the schema is enforced either way, as vLLM does (docs/serving.md)


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema(self) -> "ResponseFormat":
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("json_schema is required with type json_schema, and only then")
        return self

    def structured(self) -> StructuredOutputs | None:
        if self.type == "json_object":
            return StructuredOutputs(json_object=True)
        return StructuredOutputs(json=self.json_schema.schema_) if self.type == "json_schema" else None


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict = Field(default_factory=lambda: {"type": "object", "properties": {}})
    strict: bool | None = None  # no effect: a forced call's arguments always follow the schema; auto is parsed as written


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["function"]
    function: NamedFunction


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
    n: int = Field(1, ge=1)  # at most limits.max_n (the serve config's RequestLimits), as the other per-request limits
    seed: int | None = Field(None, ge=-(2**63), le=2**63 - 1)  # a 64-bit seed, as vLLM's
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    logit_bias: dict[int, float] | None = None  # token id (a string in JSON) -> bias
    # vLLM's extra sampling fields (the openai client's extra_body)
    top_k: int = Field(-1, ge=-1)
    min_p: float = Field(0.0, ge=0.0, le=1.0)
    repetition_penalty: float = Field(1.0, gt=0.0)
    min_tokens: int = Field(0, ge=0)
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    # structured outputs (engine.structured): OpenAI's response_format, or vLLM's structured_outputs
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # GUIDED: refused with a 400 naming structured_outputs; left out of the OpenAPI schema, which lists what is served
    guided_json: SkipJsonSchema[Any] = None
    guided_regex: SkipJsonSchema[Any] = None
    guided_choice: SkipJsonSchema[Any] = None
    guided_grammar: SkipJsonSchema[Any] = None
    guided_decoding_backend: SkipJsonSchema[Any] = None
    guided_whitespace_pattern: SkipJsonSchema[Any] = None
    # accepted, no effect on the output (NO_EFFECT)
    user: Any = None
    metadata: Any = None
    store: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    prompt_cache_retention: Any = None
    safety_identifier: Any = None

    @field_validator(*GUIDED)
    @classmethod
    def _guided(cls, value, info):
        raise ValueError(f"removed in current vLLM; use structured_outputs instead (e.g. structured_outputs: "
                         f"{{\"{info.field_name.removeprefix('guided_')}\": ...}})")  # fmt: skip

    @model_validator(mode="after")
    def _one_structure(self):
        if self.structured_outputs is not None and self.response_format is not None and self.response_format.type != "text":
            raise ValueError("structured_outputs: give it or response_format, not both")
        return self

    def structured(self) -> StructuredOutputs | None:
        """The grammar the output must follow, if the request asks for one."""
        return self.structured_outputs or (self.response_format.structured() if self.response_format else None)

    @field_validator("stream_options")
    @classmethod
    def _only_with_a_stream(cls, value, info):
        if value is not None and not info.data.get("stream"):
            raise ValueError("only allowed with stream: true")
        return value

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def top_logprobs_asked(self) -> int:
        """Top alternatives per generated token (chat top_logprobs, completions logprobs); 0: none."""
        return 0

    def over_limit(self, limits: RequestLimits) -> tuple[str, str] | None:
        """(field, message) for the first per-request limit of the serve config that this request exceeds; None if within."""
        stops = [self.stop] if isinstance(self.stop, str) else self.stop or []
        checks = [("n", self.n, limits.max_n, "max_n"), ("stop", len(stops), limits.max_stop, "max_stop"),
                  ("logit_bias", len(self.logit_bias or {}), limits.max_logit_bias, "max_logit_bias"),
                  *self._more_limits(limits)]  # fmt: skip
        for field, value, limit, key in checks:
            if value > limit:
                return field, f"{field}: {value} is over this server's limit of {limit} (serve config limits.{key})"
        return None

    def _more_limits(self, limits: RequestLimits) -> list[tuple[str, int, int, str]]:
        return []

    def sampling_params(self, default_max_tokens: int, logprobs: bool, defaults: dict | None = None, top_logprobs: int = 0,
                        prompt_logprobs: int | None = None) -> SamplingParams:  # fmt: skip
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
            top_logprobs=top_logprobs,
            prompt_logprobs=prompt_logprobs,
            structured=self.structured(),
            # only what differs from the engine's defaults, so requests that use none of them build plain params
            **{k: v for k, v in controls.items() if v != SamplingParams.model_fields[k].default},
        )


Prompt = Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]  # text, or token ids


class CompletionRequest(_Common):
    # one prompt, or several (OpenAI's batch form: choice i * n + j is prompt i's sample j)
    prompt: Prompt | Annotated[list[Annotated[str, Field(min_length=1)]] | list[Annotated[list[int], Field(min_length=1)]],
                               Field(min_length=1)]  # at most limits.max_prompts  # fmt: skip
    # the chosen tokens' log-probs and this many top alternatives (at most limits.max_top_logprobs); with echo the
    # prompt's tokens' too
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False  # the prompt's text before the completion

    def top_logprobs_asked(self) -> int:
        return self.logprobs or 0

    def _more_limits(self, limits: RequestLimits) -> list[tuple[str, int, int, str]]:
        return [("logprobs", self.logprobs or 0, limits.max_top_logprobs, "max_top_logprobs"),
                ("prompt", len(self.prompts()), limits.max_prompts, "max_prompts")]  # fmt: skip

    def prompts(self) -> list[str | list[int]]:
        """The request's prompts: one, or each of a list."""
        one = isinstance(self.prompt, str) or (self.prompt and isinstance(self.prompt[0], int))
        return [self.prompt] if one else list(self.prompt)


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # top alternatives per token, with logprobs (at most limits.max_top_logprobs)
    tools: Annotated[list[Tool], Field(min_length=1)] | None = None  # at most limits.max_tools
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None  # None: auto with tools, else none
    parallel_tool_calls: bool | None = None  # auto may return several calls; required and a named function force one

    def top_logprobs_asked(self) -> int:
        return (self.top_logprobs or 0) if self.logprobs else 0

    def _more_limits(self, limits: RequestLimits) -> list[tuple[str, int, int, str]]:
        return [("top_logprobs", self.top_logprobs or 0, limits.max_top_logprobs, "max_top_logprobs"),
                ("tools", len(self.tools or []), limits.max_tools, "max_tools")]  # fmt: skip

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs and not self.logprobs:  # as OpenAI and vLLM
            raise ValueError("top_logprobs: needs logprobs: true")
        return self

    @model_validator(mode="after")
    def _tool_choice(self):
        if self.tool_choice not in (None, "none") and not self.tools:
            raise ValueError("tool_choice: needs tools")
        if isinstance(self.tool_choice, NamedToolChoice) and self.tool_choice.function.name not in {t.function.name for t in self.tools}:
            raise ValueError(f"tool_choice: no tool named {self.tool_choice.function.name!r} in tools")
        if self.forced_tools() and (self.response_format is not None and self.response_format.type != "text" or self.structured_outputs):
            raise ValueError("tool_choice: required or a named function cannot be combined with response_format or structured_outputs")
        return self

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    def tools_active(self) -> bool:
        """Whether the model sees the tools and the output is parsed for tool calls."""
        return bool(self.tools) and self.tool_choice != "none"

    def forced_tools(self) -> list[Tool]:
        """The tools one of which the output must call (required: any; a named function: that one); [] if free."""
        if not self.tools or self.tool_choice in (None, "none", "auto"):
            return []
        if self.tool_choice == "required":
            return list(self.tools)
        return [t for t in self.tools if t.function.name == self.tool_choice.function.name]

    def structured(self) -> StructuredOutputs | None:
        forced = self.forced_tools()
        if not forced:
            return super().structured()
        # Hermes' format: one <tool_call> whose JSON names a function and gives arguments valid for its parameters.
        calls = [{"type": "object", "properties": {"name": {"const": t.function.name}, "arguments": _closed(t.function.parameters)},
                  "required": ["name", "arguments"], "additionalProperties": False} for t in forced]  # fmt: skip
        schema = (calls[0] if len(calls) == 1 else {"anyOf": calls}) | {"x-guidance": {"whitespace_flexible": False}}  # compact JSON
        return StructuredOutputs(grammar=f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json{json.dumps(schema)}')

    def template_tools(self) -> list[dict] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools_active() else None

    def template_messages(self) -> list[dict]:
        return [m.for_template() for m in self.messages]


def error_body(message: str, param: str | None = None, code: str | None = None, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
