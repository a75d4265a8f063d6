"""Log-probabilities of chosen tokens without a full-vocabulary logit tensor for the batch.

A causal LM's head turns [B, L, hidden] into [B, L, vocab] logits: 64 completions of 1k tokens
with a 152k vocabulary is ~40 GB in fp32, before the log-softmax copies it. Training and scoring
only need the log-prob of one token per position (and, for GRPO's logging, the entropy), so
``TokenLogprobHead`` replaces the model's ``lm_head`` and, while ``labelled_logprobs`` asks for
targets, computes them ``chunk_tokens`` positions at a time, on labelled positions only, each
chunk recomputed in backward instead of kept (activation checkpointing of the head). Without a
request it is the plain linear head, so generation and evaluation see ordinary logits. On a model
without the head (a unit test, a notebook) the same functions compute the same numbers from full
logits; ``mlplat.train.loop.trainable`` installs it on every causal LM a recipe trains.

The head runs inside the model's own forward, so DDP, FSDP2 (the root module's unsharded
weights) and LoRA wrappers need nothing special, and the weight stays tied to the embedding
(same ``Parameter``, same state-dict name ``lm_head.weight``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.utils.checkpoint import checkpoint

from mlplat.data.labels import IGNORE_INDEX
from mlplat.train.batch import model_inputs

DEFAULT_CHUNK_TOKENS = 1024  # x vocabulary x 4 bytes per chunk: 0.6 GB for a 152k vocabulary


@dataclass
class _Request:
    targets: torch.Tensor  # [B, L] the token each position predicts (IGNORE_INDEX: skip)
    temperature: float
    entropy: bool


class TokenLogprobHead(torch.nn.Module):
    """A drop-in ``lm_head`` (the same weight and bias) that returns target log-probs [B, L] while a request is set."""

    def __init__(self, head: torch.nn.Linear, chunk_tokens: int = DEFAULT_CHUNK_TOKENS):
        super().__init__()
        self.weight = head.weight
        self.bias = head.bias
        self.chunk_tokens = chunk_tokens
        self.request: _Request | None = None

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.request is None:
            return torch.nn.functional.linear(hidden, self.weight, self.bias)
        targets, temperature = self.request.targets, self.request.temperature
        assert targets.shape == hidden.shape[:2], f"targets {tuple(targets.shape)} for hidden states {tuple(hidden.shape)}"
        flat_targets = targets.reshape(-1)
        positions = (flat_targets != IGNORE_INDEX).nonzero().squeeze(-1)
        flat_hidden = hidden.reshape(-1, hidden.shape[-1])
        columns = 2 if self.request.entropy else 1
        out = hidden.new_zeros(*targets.shape, columns, dtype=torch.float32)  # not a view: FSDP2 hooks the root's outputs
        flat_out = out.view(-1, columns)
        for chunk in positions.split(self.chunk_tokens):
            args = (flat_hidden[chunk], flat_targets[chunk], self.weight, self.bias, temperature, self.request.entropy)
            values = checkpoint(_chunk_logprobs, *args, use_reentrant=False) if torch.is_grad_enabled() else _chunk_logprobs(*args)
            flat_out.index_copy_(0, chunk, values)
        return out


def _chunk_logprobs(hidden, targets, weight, bias, temperature: float, entropy: bool) -> torch.Tensor:
    """[N, 1] log-probs of ``targets`` under softmax(head(hidden) / temperature), with the entropy as a second column."""
    return _chunk_logits(torch.nn.functional.linear(hidden, weight, bias), targets, temperature, entropy)


def _chunk_logits(logits: torch.Tensor, targets: torch.Tensor, temperature: float, entropy: bool) -> torch.Tensor:
    logits = logits.float() / temperature
    normaliser = torch.logsumexp(logits, dim=-1)
    picked = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - normaliser
    if not entropy:
        return picked.unsqueeze(-1)
    with torch.no_grad():  # logged, never differentiated
        entropies = normaliser - (torch.softmax(logits, dim=-1) * logits).sum(-1)
    return torch.stack([picked, entropies], dim=-1)


def install_logprob_head(model: torch.nn.Module, chunk_tokens: int = DEFAULT_CHUNK_TOKENS) -> torch.nn.Module:
    """Swap the causal LM's output layer for a ``TokenLogprobHead`` (in place, idempotent); returns the model.
    Before ``parallelize``, so FSDP2 and DDP see the final module tree."""
    head = model.get_output_embeddings()
    if not isinstance(head, TokenLogprobHead):
        model.set_output_embeddings(TokenLogprobHead(head, chunk_tokens))
    return model


def _logprob_head(model: torch.nn.Module) -> TokenLogprobHead | None:
    inner = getattr(model, "module", model)  # DDP
    head = inner.get_output_embeddings()
    return head if isinstance(head, TokenLogprobHead) else None


def _shifted_targets(labels: torch.Tensor) -> torch.Tensor:
    """Position t predicts token t + 1: [B, L] targets from [B, L] labels, the last position unlabelled."""
    return torch.cat([labels[:, 1:], labels.new_full((labels.shape[0], 1), IGNORE_INDEX)], dim=1)


def _forward(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float, entropy: bool) -> torch.Tensor:
    """[B, L-1, 1 or 2]: target log-probs (and entropies) per position, through the chunked head if the model has one."""
    targets = _shifted_targets(batch["labels"])
    head = _logprob_head(model)
    if head is None:  # a plain model (unit tests, notebooks): full logits, the same numbers
        logits = model(**model_inputs(batch), use_cache=False).logits
        positions = targets != IGNORE_INDEX
        values = torch.zeros(*targets.shape, 2 if entropy else 1, device=logits.device)
        values[positions] = _chunk_logits(logits[positions], targets[positions], temperature, entropy)
        return values[:, :-1]
    head.request = _Request(targets, temperature, entropy)
    try:
        out = model(**model_inputs(batch), use_cache=False).logits
    finally:
        head.request = None
    return out[:, :-1]


def labelled_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0) -> torch.Tensor:
    """Log-probs [B, L-1] of each labelled next token under softmax(logits / temperature); 0 where unlabelled.
    Differentiable; chunked over the vocabulary when the model's output layer is a ``TokenLogprobHead``."""
    return _forward(model, batch, temperature, entropy=False)[..., 0]


def labelled_logprobs_and_entropy(
    model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0
) -> tuple[torch.Tensor, torch.Tensor]:
    """``labelled_logprobs`` and the entropy [B, L-1] of the next-token distribution at labelled positions (0 elsewhere)."""
    out = _forward(model, batch, temperature, entropy=True)
    return out[..., 0], out[..., 1]


def sequence_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """log pi(response | prompt) per row [B]: the summed log-probs of its labelled tokens."""
    return labelled_logprobs(model, batch).sum(-1)
