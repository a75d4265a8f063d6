"""KV payloads for prefill/decode disaggregation: a prompt's KV plus its first token.

The KV is compact ([layers, 2, tokens, kv_heads, head_dim], no block padding), so the
prefill and decode engines may use different block sizes; model shape and dtype must
match, and are checked on import.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from mlplat.engine.sampling import SamplingParams
from mlplat.engine.scheduler import QueueFullError
from mlplat.engine.sequence import Sequence

if TYPE_CHECKING:
    from mlplat.engine.engine import LLMEngine


@dataclass
class KVPayload:
    prompt_token_ids: list[int]
    first_token: int
    first_logprob: float
    kv: torch.Tensor  # [layers, 2, len(prompt_token_ids), kv_heads, head_dim]
    layout: dict  # num_layers, num_kv_heads, head_dim, dtype of the producing engine
    created_at: float = 0.0  # time.time() when prefill finished, to measure the handoff
    rng_state: torch.Tensor | None = None  # a seeded request's generator after the first draw
    first_top_logprobs: list[tuple[int, float]] | None = None  # params.top_logprobs: the first token's alternatives
    prompt_logprobs: list | None = None  # params.prompt_logprobs: computed here, during the prefill (Sequence.prompt_logprobs)

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
def export_prefill(engine: LLMEngine, prompt: str | list[int], params: SamplingParams) -> KVPayload:
    """Compute a prompt's KV and first token only, and hand them back (the prefill side).

    Other requests in flight keep stepping meanwhile; the sequence's blocks are released after the
    copy, taken just before its finish frees them (its prefix stays in the prefix cache)."""
    # stop_token_ids stay: min_tokens holds them off the first token too (a stop token ends a 1-token request either way).
    request_id = engine.add_request(prompt, params.model_copy(update={"n": 1, "max_tokens": 1, "stop": []}))
    seq = engine.requests[request_id][0]
    exported: list[torch.Tensor] = []
    seq.on_finish = lambda s: exported.append(engine.runner.read_kv(s.block_table, s.num_prompt_tokens))
    while not seq.is_finished:
        failed = [out.error for out in engine.step() if out.error is not None and out.request_id == request_id]
        if failed:
            raise failed[0]
    engine.requests.pop(request_id, None)
    n = seq.num_prompt_tokens
    rng_state = seq.generator.get_state() if seq.generator is not None else None
    top = seq.output_top_logprobs[0] if seq.output_top_logprobs else None
    return KVPayload(seq.token_ids[:n], seq.token_ids[n], seq.output_logprobs[0], exported[0], engine.runner.kv_layout, time.time(),
                     rng_state, top, seq.prompt_logprobs)  # fmt: skip


def import_prefilled(engine: LLMEngine, payload: KVPayload, params: SamplingParams, request_id: str) -> Sequence:
    """Admit a request whose prompt KV and first token were computed elsewhere (the decode side): it
    holds its KV blocks from now on and decodes from its first token (which may already finish it)."""
    payload.check_compatible(engine.runner.kv_layout)
    engine.check_prompt(payload.prompt_token_ids + [payload.first_token], params.max_tokens - 1)
    engine.check_params(params)
    if params.n != 1:
        raise ValueError("a prefilled request carries one sample (n=1)")
    engine.scheduler.check_room(1)
    seq = Sequence(request_id, payload.prompt_token_ids, params)
    if params.seed is not None:
        seq.generator = torch.Generator(device=engine.runner.device).manual_seed(params.seed)
        if payload.rng_state is not None:  # continue the prefill side's random stream
            seq.generator.set_state(payload.rng_state)
    if not engine.block_manager.allocate_slots(seq, len(payload.prompt_token_ids)):
        raise QueueFullError("no free KV blocks for the imported prompt; retry later")
    engine.runner.write_kv(seq.block_table, payload.kv)
    seq.num_computed_tokens = len(payload.prompt_token_ids)
    engine.block_manager.cache_full_blocks(seq)
    return seq
