"""KV payloads for prefill/decode disaggregation: a prompt's KV plus its first token.

The KV is compact ([layers, 2, tokens, kv_heads, head_dim], no block padding), so the
prefill and decode engines may use different block sizes; model shape and dtype must
match, and are checked on import.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class KVPayload:
    prompt_token_ids: list[int]
    first_token: int
    first_logprob: float
    kv: torch.Tensor  # [layers, 2, len(prompt_token_ids), kv_heads, head_dim]
    layout: dict  # num_layers, num_kv_heads, head_dim, dtype of the producing engine
    created_at: float = 0.0  # time.time() when prefill finished, to measure the handoff
    rng_state: torch.Tensor | None = None  # a seeded request's generator after the first draw

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
