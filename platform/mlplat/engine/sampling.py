"""Sampling parameters (validated at the edge) and the batched sampler."""

from __future__ import annotations

import torch
from pydantic import Field, model_validator

from mlplat.config import Config


class SamplingParams(Config):
    max_tokens: int = Field(16, ge=1)
    temperature: float = Field(1.0, ge=0.0)  # 0: greedy
    top_k: int = Field(-1, ge=-1)  # -1: off
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = None  # per-request seed: the same seed gives the same sample
    n: int = Field(1, ge=1)  # samples per prompt; they share the prompt's KV blocks
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-prob of each chosen token

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probs(row: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, then top-p."""
    row = row.float() / p.temperature
    if 0 < p.top_k < row.numel():
        kth = torch.topk(row, p.top_k).values[-1]
        row = row.masked_fill(row < kth, float("-inf"))
    probs = torch.softmax(row, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep the smallest prefix whose mass reaches top_p (always at least one token).
        drop = sorted_probs.cumsum(0) - sorted_probs >= p.top_p
        probs = probs.scatter(0, order, sorted_probs.masked_fill(drop, 0.0))
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row of ``logits`` [B, V]; returns (token ids [B], their log-probs [B]).

    Log-probs are of the model's raw distribution (before temperature, top-k, top-p),
    which is what an RL trainer recomputes and compares against.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    tokens = logits.argmax(dim=-1)
    for i, (p, g) in enumerate(zip(params, generators)):
        if not p.greedy:
            tokens[i] = torch.multinomial(probs(logits[i], p), 1, generator=g)[0]
    return tokens, logprobs.gather(1, tokens[:, None])[:, 0]
