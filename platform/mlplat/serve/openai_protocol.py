"""OpenAI-compatible request/response schemas and error bodies (the subset we serve)."""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from mlplat.engine import SamplingParams

MAX_N = 8


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")  # OpenAI clients send fields we do not use (e.g. user)
    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0.0, le=2.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    n: int = Field(1, ge=1, le=MAX_N)
    seed: int | None = None
    stop: str | list[str] | None = None
    stream: bool = False

    def sampling_params(self, default_max_tokens: int, logprobs: bool) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_tokens=self.max_tokens or default_max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            n=self.n,
            seed=self.seed,
            stop=stop,
            logprobs=logprobs,
        )


class CompletionRequest(_Common):
    prompt: Annotated[str, Field(min_length=1)] | Annotated[list[int], Field(min_length=1)]
    logprobs: int | None = Field(None, ge=0, le=5)  # we return the chosen token's log-prob only


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=5)  # accepted; only the chosen token's log-prob is returned


def error_body(message: str, param: str | None = None, code: str | None = None, type_: str = "invalid_request_error") -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def now() -> int:
    return int(time.time())
