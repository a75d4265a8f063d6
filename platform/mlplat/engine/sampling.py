"""Sampling parameters (validated at the edge) and the batched sampler.

The controls are vLLM's, applied in vLLM's order, each as one op over the whole [B, V] batch and
skipped where no row uses it:

1. on the logits, for greedy and sampled rows alike: ``logit_bias``, ``min_tokens`` (EOS and the
   stop token ids masked), then the repetition, frequency and presence penalties;
2. greedy rows take the argmax; sampled rows divide by the temperature, keep the top-k tokens,
   the top-p nucleus and the tokens of at least min_p x the top probability, and draw one.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from typing import Annotated, Protocol

import torch
from pydantic import Field, model_validator

from mlplat.config import Config
from mlplat.engine.structured import StructuredOutputs, apply_masks


class SamplingParams(Config):
    max_tokens: int = Field(16, ge=1)
    min_tokens: int = Field(0, ge=0)  # EOS and stop_token_ids are masked until this many tokens were generated
    temperature: float = Field(1.0, ge=0.0)  # 0: greedy
    top_k: int = Field(-1, ge=-1)  # -1: off
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    min_p: float = Field(0.0, ge=0.0, le=1.0)  # drop tokens below min_p x the top token's probability; 0: off
    # OpenAI's, over the tokens generated so far: a token's logit loses presence_penalty once it has appeared,
    # and frequency_penalty per time it appeared. Negative values encourage repetition.
    presence_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(0.0, ge=-2.0, le=2.0)
    # CTRL's, over the prompt and the tokens generated so far: a seen token's logit is divided by it where
    # positive and multiplied by it where not. 1: off; > 1 discourages repetition.
    repetition_penalty: float = Field(1.0, gt=0.0, allow_inf_nan=False)
    logit_bias: dict[Annotated[int, Field(ge=0)], Annotated[float, Field(ge=-100.0, le=100.0)]] = {}  # token id -> added to its logit
    seed: int | None = None  # per-request seed: the same seed gives the same sample
    n: int = Field(1, ge=1)  # samples per prompt; they share the prompt's KV blocks
    stop: list[str] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False  # return the log-prob of each chosen token
    # With logprobs: also the top_logprobs most likely tokens at each generated position, with their log-probs (of the
    # same raw distribution as the chosen token's); 0: none. The engine bounds it (EngineConfig.max_logprobs).
    top_logprobs: int = Field(0, ge=0)
    # The prompt tokens' log-probs (each given the tokens before it; the first has none), computed during the prefill,
    # with this many top alternatives per position; None: not computed. vLLM's prompt_logprobs, for echo + logprobs.
    prompt_logprobs: int | None = Field(None, ge=0)
    structured: StructuredOutputs | None = None  # a grammar the output must follow (engine.structured)
    # The LoRA adapter to run this request through, by the name the engine knows it (EngineConfig.lora.adapters); None: the
    # base model. Not a sampling control, but it travels with them through every path (PD handoffs included).
    lora_name: str | None = None

    @model_validator(mode="after")
    def _check(self) -> "SamplingParams":
        if self.top_k == 0:
            raise ValueError("top_k must be -1 (off) or >= 1")
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs")
        if self.min_tokens > self.max_tokens:
            raise ValueError(f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})")
        return self

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def needs_history(self) -> bool:
        """Whether the sampler reads this request's token ids (the penalties and min_tokens do)."""
        return self.penalized or self.min_tokens > 0

    @property
    def adjusts_logits(self) -> bool:
        """Whether the logits are changed before greedy and sampling alike (stage 1 above)."""
        return self.needs_history or bool(self.logit_bias) or self.structured is not None


class TokenHistory(Protocol):
    """A row's tokens as the engine's Sequence holds them: the prompt's, then those generated so far."""

    token_ids: list[int]
    num_prompt_tokens: int


def sample(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator | None],
    history: Sequence[TokenHistory] | None = None,
    eos_token_ids: Collection[int] = (),
    matchers: Sequence | None = None,
    num_top_logprobs: Sequence[int] | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | tuple[torch.Tensor, torch.Tensor, list[list[tuple[int, float]] | None]]:
    """One token per row of ``logits`` [B, V]; returns (token ids [B], their log-probs [B]), and with
    ``num_top_logprobs`` (per row, 0 for none) a third item: each asking row's top alternatives (``top_logprobs``).

    ``history`` (each row's token ids) is read by the penalties and min_tokens, and needed only where a
    row uses them; min_tokens holds off ``eos_token_ids`` (unless ignore_eos) and the row's stop_token_ids.
    Log-probs are of the model's raw distribution (before logit_bias, penalties, temperature, top-k,
    top-p, min-p), which is what an RL trainer recomputes and compares against. ``matchers`` (one per row, None
    where unconstrained) mask each constrained row to the tokens its grammar allows, after the other adjustments.
    """
    logits = logits.float()
    logprobs = torch.log_softmax(logits, dim=-1)
    if any(p.adjusts_logits for p in params):
        logits = adjust_logits(logits, params, history, eos_token_ids)
    if matchers is not None and any(m is not None for m in matchers):
        logits = apply_masks(logits, list(matchers))
    tokens = logits.argmax(dim=-1)
    rows = [i for i, p in enumerate(params) if not p.greedy]
    if rows:
        every = len(rows) == len(params)
        dist = sampling_probs(logits if every else logits[rows], [params[i] for i in rows])
        tokens[rows] = draw(dist, [generators[i] for i in rows])
    chosen = logprobs.gather(1, tokens[:, None])[:, 0]
    if num_top_logprobs is None:
        return tokens, chosen
    return tokens, chosen, top_logprobs(logprobs, num_top_logprobs)


def top_logprobs(logprobs: torch.Tensor, ks: Sequence[int]) -> list[list[tuple[int, float]] | None]:
    """Row i's ``ks[i]`` most likely (token id, log-prob) pairs of ``logprobs`` [B, V], most likely first; None where
    ``ks[i]`` is 0. One topk of the largest k over the asking rows only: a batch where none asks costs nothing."""
    rows = [i for i, k in enumerate(ks) if k > 0]
    out: list[list[tuple[int, float]] | None] = [None] * len(ks)
    if not rows:
        return out
    k = min(max(ks[i] for i in rows), logprobs.shape[-1])
    picked = logprobs if len(rows) == len(ks) else logprobs[rows]
    values, ids = picked.topk(k, dim=-1)  # sorted, largest first
    for i, v, t in zip(rows, values.tolist(), ids.tolist()):
        out[i] = list(zip(t[: ks[i]], v[: ks[i]]))
    return out


# -- 1. the logits, greedy rows included --------------------------------------------------------------
def adjust_logits(
    logits: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[TokenHistory] | None, eos_token_ids: Collection[int]
) -> torch.Tensor:
    """A copy of ``logits`` [B, V] with logit_bias added, min_tokens' stop tokens masked, then the penalties."""
    if history is None and any(p.needs_history for p in params):
        raise ValueError("penalties and min_tokens read each row's token ids: pass the rows' history")
    logits = logits.clone()  # the caller's tensor stays the raw logits
    rows, ids, bias = [], [], []
    for i, p in enumerate(params):
        rows += [i] * len(p.logit_bias)
        ids += p.logit_bias.keys()
        bias += p.logit_bias.values()
    if rows:
        logits[_index(rows, logits), _index(ids, logits)] += torch.tensor(bias, dtype=logits.dtype, device=logits.device)
    rows, ids = _held_stop_tokens(logits.shape[1], params, history, eos_token_ids)
    if rows:
        logits[_index(rows, logits), _index(ids, logits)] = float("-inf")
    if any(p.penalized for p in params):
        logits = apply_penalties(logits, params, history)
    return logits


def _held_stop_tokens(
    vocab_size: int, params: Sequence[SamplingParams], history: Sequence[TokenHistory], eos_token_ids: Collection[int]
) -> tuple[list[int], list[int]]:
    """(row, token id) pairs that min_tokens masks: the rows' stop tokens while they are short of it."""
    rows, ids = [], []
    for i, p in enumerate(params):
        if p.min_tokens and len(history[i].token_ids) - history[i].num_prompt_tokens < p.min_tokens:
            stop = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_token_ids))
            stop = [t for t in stop if 0 <= t < vocab_size]  # an id outside the vocabulary is never sampled anyway
            rows += [i] * len(stop)
            ids += stop
    return rows, ids


def apply_penalties(logits: torch.Tensor, params: Sequence[SamplingParams], history: Sequence[TokenHistory]) -> torch.Tensor:
    """vLLM's penalties on ``logits`` [B, V]: repetition (over prompt and output), then frequency and presence
    (over the output). Rows without penalties get neutral values, and their tokens are not counted."""
    vocab_size = logits.shape[1]
    outputs = [h.token_ids[h.num_prompt_tokens :] if p.penalized else [] for p, h in zip(params, history)]
    counts = token_counts(outputs, vocab_size, logits.device)
    generated = counts > 0
    if any(p.repetition_penalty != 1.0 for p in params):
        prompts = [h.token_ids[: h.num_prompt_tokens] if p.repetition_penalty != 1.0 else [] for p, h in zip(params, history)]
        seen = generated | (token_counts(prompts, vocab_size, logits.device) > 0)
        penalty = _per_row([p.repetition_penalty for p in params], logits)
        logits = torch.where(seen, torch.where(logits > 0, logits / penalty, logits * penalty), logits)
    logits = logits - _per_row([p.frequency_penalty for p in params], logits) * counts
    return logits - _per_row([p.presence_penalty for p in params], logits) * generated


def token_counts(token_ids: Sequence[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token id occurs in each row's list: [B, V] float, by one scatter_add over the padded lists."""
    width = max(map(len, token_ids), default=0)
    # Pad with the id one past the vocabulary: its counts land in an extra column that is dropped.
    padded = torch.tensor([ids + [vocab_size] * (width - len(ids)) for ids in token_ids], dtype=torch.long, device=device)
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)
    return counts.scatter_add_(1, padded, torch.ones(padded.shape, device=device))[:, :vocab_size]


def _index(values: list[int], like: torch.Tensor) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long, device=like.device)


def _per_row(values: list[float], like: torch.Tensor) -> torch.Tensor:
    """A [B, 1] column of per-row values, to broadcast over a [B, V] batch."""
    return torch.tensor(values, dtype=like.dtype, device=like.device)[:, None]


# -- 2. the sampled rows' distributions, and the draw -------------------------------------------------
def sampling_probs(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """The distributions [R, V] that rows of (adjusted) ``logits`` [R, V] sample from, none greedy: temperature,
    then top-k, then top-p (the smallest prefix whose mass reaches it, at least one token), then min-p."""
    vocab_size = logits.shape[1]
    logits = logits / _per_row([p.temperature for p in params], logits)
    top_k_rows = [i for i, p in enumerate(params) if 0 < p.top_k < vocab_size]
    if top_k_rows:
        k = [params[i].top_k for i in top_k_rows]
        rows = logits[top_k_rows]
        # Each row's k-th largest logit, from one topk of the largest k asked for; ties with it are kept.
        kth = torch.topk(rows, max(k), dim=-1).values.gather(1, _index(k, logits)[:, None] - 1)
        logits[top_k_rows] = rows.masked_fill(rows < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    top_p_rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if top_p_rows:
        top_p = _per_row([params[i].top_p for i in top_p_rows], probs)
        sorted_probs, order = probs[top_p_rows].sort(dim=-1, descending=True)
        drop = sorted_probs.cumsum(dim=-1) - sorted_probs >= top_p
        probs[top_p_rows] = torch.zeros_like(sorted_probs).scatter_(1, order, sorted_probs.masked_fill(drop, 0.0))
    any_min_p = any(p.min_p > 0.0 for p in params)
    if any_min_p:
        # Relative to the top probability: the same before or after top-k and top-p renormalize; a row at 0 keeps all.
        threshold = _per_row([p.min_p for p in params], probs) * probs.amax(dim=-1, keepdim=True)
        probs = probs.masked_fill(probs < threshold, 0.0)
    if top_p_rows or any_min_p:
        probs = probs / probs.sum(dim=-1, keepdim=True)
    return probs


def draw(probs: torch.Tensor, generators: Sequence[torch.Generator | None]) -> torch.Tensor:
    """One token per row of ``probs`` [R, V]: argmax(p / q) with q ~ Exp(1), the exponential race that
    torch.multinomial runs for one sample. A row with a generator draws its noise from it alone, so a seed
    gives the same token whatever else is in the batch; the others share one draw from the global RNG."""
    noise = torch.empty_like(probs)
    seeded = [i for i, g in enumerate(generators) if g is not None]
    if len(seeded) < len(generators):
        noise.exponential_()
    for i in seeded:
        noise[i].exponential_(generator=generators[i])
    return (probs / noise).argmax(dim=-1)
