"""KV payloads for prefill/decode disaggregation: a prompt's KV plus its samples' first tokens.

The KV is compact ([layers, 2, tokens, kv_heads, head_dim], no block padding), so the
prefill and decode engines may use different block sizes; model shape and dtype must
match, and are checked on import.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mlplat.engine.sampling import SamplingParams, sample
from mlplat.engine.scheduler import QueueFullError
from mlplat.engine.sequence import Sequence

if TYPE_CHECKING:
    from mlplat.engine.engine import LLMEngine


@dataclass
class FirstToken:
    """One sample's first token, drawn on the prefill side from the prompt's last-position logits."""

    token: int
    logprob: float
    top_logprobs: list[tuple[int, float]] | None = None  # params.top_logprobs: its alternatives
    rng_state: torch.Tensor | None = None  # a seeded sample's generator after the draw: the decode side continues it


@dataclass
class KVPayload:
    prompt_token_ids: list[int]
    kv: torch.Tensor  # [layers, 2, len(prompt_token_ids), kv_heads, head_dim]
    layout: dict  # num_layers, num_kv_heads, head_dim, dtype of the producing engine
    samples: list[FirstToken]  # one per sample (params.n), all drawn from the one prefill's logits
    created_at: float = 0.0  # time.time() when prefill finished, to measure the handoff
    prompt_logprobs: list | None = None  # params.prompt_logprobs: computed here, during the prefill (Sequence.prompt_logprobs)

    @property
    def first_token(self) -> int:
        return self.samples[0].token

    @property
    def first_top_logprobs(self) -> list[tuple[int, float]] | None:
        return self.samples[0].top_logprobs

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def check_compatible(self, layout: dict) -> None:
        for key in ("num_layers", "num_kv_heads", "head_dim", "dtype"):
            if self.layout[key] != layout[key]:
                raise ValueError(f"KV payload {key}={self.layout[key]} does not match this engine's {key}={layout[key]}")
        expected = (layout["num_layers"], 2, len(self.prompt_token_ids), layout["num_kv_heads"], layout["head_dim"])
        if tuple(self.kv.shape) != expected:
            raise ValueError(f"KV payload shape {tuple(self.kv.shape)} != expected {expected}")


# -- the engine's two halves of a handoff ---------------------------------------------------------
def add_export(engine: LLMEngine, prompt: str | list[int], params: SamplingParams, request_id: str | None = None) -> str:
    """Queue a prefill-only request (the prefill side): an engine request like any other, admitted, chunked and batched
    with the rest by the scheduler, that stops after its first token. The step that finishes it returns its prompt's KV
    and its ``params.n`` samples' first tokens as ``RequestOutput.kv_payload``; its blocks stay in the prefix cache."""
    # One sequence computes the prompt; the other samples' first tokens come from its last logits (Export.draw_other_samples).
    # stop_token_ids stay: min_tokens holds them off the first token too (a stop token ends a 1-token request either way).
    request_id = engine.add_request(prompt, params.model_copy(update={"n": 1, "max_tokens": 1, "stop": []}), request_id)
    engine.exports[request_id] = Export(engine, engine.requests[request_id][0], params)
    return request_id


class Export:
    """A prefill-only request in flight: reads its prompt's KV as it finishes (before the finish frees the blocks) and
    draws the other samples' first tokens from the same logits, with the seeds (params.seed + j) and sampling controls
    each sample has in a colocated engine."""

    def __init__(self, engine: LLMEngine, seq: Sequence, params: SamplingParams):
        self.engine, self.params = engine, params
        self.kv: torch.Tensor | None = None
        self.others: list[FirstToken] = []
        seq.on_finish = self._read_kv

    def _read_kv(self, seq: Sequence) -> None:
        self.kv = self.engine.runner.read_kv(seq.block_table, seq.num_prompt_tokens)

    def draw_other_samples(self, seq: Sequence, logits: torch.Tensor) -> None:
        """Samples 1..n-1's first tokens from ``logits`` [V], the prompt's last position (sample 0 drew from it in the step)."""
        engine, p = self.engine, seq.params
        others = [Sequence(seq.request_id, seq.token_ids[: seq.num_prompt_tokens], p, j) for j in range(1, self.params.n)]
        if not others:
            return
        device = engine.runner.device
        generators = [None if p.seed is None else torch.Generator(device=device).manual_seed(p.seed + s.sample_index) for s in others]
        matchers = [engine.grammars.matcher(p.structured) for _ in others] if p.structured is not None else None
        drawn = sample(logits.expand(len(others), -1), [p] * len(others), generators, others, engine.eos_token_ids, matchers,
                       num_top_logprobs=[p.top_logprobs] * len(others))  # fmt: skip
        for token, logprob, top, generator in zip(drawn[0].tolist(), drawn[1].tolist(), drawn[2], generators):
            self.others.append(FirstToken(token, logprob, top, generator.get_state() if generator is not None else None))

    def payload(self, seq: Sequence) -> KVPayload:
        n = seq.num_prompt_tokens
        first = FirstToken(seq.token_ids[n], seq.output_logprobs[0], seq.output_top_logprobs[0] if seq.output_top_logprobs else None,
                           seq.generator.get_state() if seq.generator is not None else None)  # fmt: skip
        return KVPayload(seq.token_ids[:n], self.kv, self.engine.runner.kv_layout, [first, *self.others], time.time(), seq.prompt_logprobs)


def import_prefilled(engine: LLMEngine, payload: KVPayload, params: SamplingParams, request_id: str) -> list[Sequence]:
    """Admit a request whose prompt KV and first tokens were computed elsewhere (the decode side): its ``params.n``
    samples hold the prompt's KV blocks from now on, one copy shared (BlockManager.fork), and decode from their first
    tokens (which the caller appends; one may already finish its sample)."""
    payload.check_compatible(engine.runner.kv_layout)
    if len(payload.samples) != params.n:
        raise ValueError(f"the KV payload carries {len(payload.samples)} first token(s) for n={params.n} samples: prefill with the same n")
    for first in payload.samples:
        engine.check_prompt(payload.prompt_token_ids + [first.token], params.max_tokens - 1)
    engine.check_params(params)
    engine.scheduler.check_room(params.n)
    seqs = [Sequence(request_id, payload.prompt_token_ids, params, j) for j in range(params.n)]
    for seq, first in zip(seqs, payload.samples):
        if params.seed is not None:
            seq.generator = torch.Generator(device=engine.runner.device).manual_seed(params.seed + seq.sample_index)
            if first.rng_state is not None:  # continue the prefill side's random stream
                seq.generator.set_state(first.rng_state)
    head, num_prompt = seqs[0], len(payload.prompt_token_ids)
    if not engine.block_manager.allocate_slots(head, num_prompt):
        raise QueueFullError("no free KV blocks for the imported prompt; retry later")
    engine.runner.write_kv(head.block_table, payload.kv)
    head.num_computed_tokens = num_prompt
    engine.block_manager.cache_full_blocks(head)
    for seq in seqs[1:]:
        copies = engine.block_manager.fork(head, seq)
        if copies is None:
            for s in seqs:
                engine.block_manager.free_sequence(s)
            raise QueueFullError("no free KV blocks for the imported prompt's samples; retry later")
        engine.runner.copy_blocks(copies)
    if head.prompt_logprobs is not None and payload.prompt_logprobs is not None:
        head.prompt_logprobs = list(payload.prompt_logprobs)  # computed by the prefill side
    return seqs
