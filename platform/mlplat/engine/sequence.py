"""A sequence: one prompt and one sample's output, with its KV block table."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum, auto
from itertools import count

import torch

from mlplat.engine.sampling import SamplingParams


class Status(Enum):
    WAITING = auto()
    RUNNING = auto()
    FINISHED = auto()


class Sequence:
    _ids = count()

    def __init__(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, sample_index: int = 0):
        assert prompt_token_ids, "empty prompt"
        self.seq_id = next(Sequence._ids)
        self.request_id = request_id
        self.sample_index = sample_index  # which of the request's n samples
        self.token_ids = list(prompt_token_ids)
        self.num_prompt_tokens = len(prompt_token_ids)
        self.num_computed_tokens = 0  # tokens whose KV is in the cache
        self.block_table: list[int] = []
        self.num_hashed_blocks = 0  # leading blocks already registered in the prefix cache
        self.params = params
        self.status = Status.WAITING
        self.finish_reason: str | None = None
        self.output_logprobs: list[float] = []
        self.output_top_logprobs: list[list[tuple[int, float]]] = []  # params.top_logprobs: each output token's alternatives
        # params.prompt_logprobs (sample 0 only): each prompt token's (log-prob, alternatives), the first (None, None)
        self.prompt_logprobs: list[tuple[float | None, list[tuple[int, float]] | None]] | None = (
            [(None, None)] if params.prompt_logprobs is not None and sample_index == 0 else None
        )
        self.generator: torch.Generator | None = None
        self.leader: Sequence | None = None  # n > 1: sample 0, whose prefill the others reuse
        self.on_finish: Callable[[Sequence], None] | None = None  # called as it finishes, before its blocks are freed
        self.matcher = None  # params.structured: this sample's grammar state (an llguidance LLMatcher)
        self.lora_slot = -1  # params.lora_name: its adapter's slot while running (the scheduler pins it); -1: none

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Whether prompt positions still lack their log-probs: such a sequence computes its whole prompt (no prefix
        cache hits, whose positions would have no logits) and gets logits at every prompt position it computes."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED

    def num_blocks(self, block_size: int) -> int:
        return (len(self) + block_size - 1) // block_size

    def block_tokens(self, i: int, block_size: int) -> list[int]:
        return self.token_ids[i * block_size : (i + 1) * block_size]
