"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5/3) over a paged KV cache.

Plain single-device PyTorch. A step takes the new tokens of every scheduled
sequence flattened into one batch (prefill chunks and decodes alike); attention
reads each sequence's keys and values through its block table. q/k/v and gate/up
projections are fused, so a step makes two matmuls per block instead of five.
HF checkpoints load through ``hf_state_dict_to_engine`` beside the model.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


@dataclass
class AttentionMetadata:
    """Where the step's new tokens go and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    query_lens: list[int]  # new tokens per sequence (1 for a decode)
    context_lens: torch.Tensor  # [B] tokens in the cache per sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] padded with 0
    block_size: int

    @property
    def decode_only(self) -> bool:
        return all(n == 1 for n in self.query_lens)


def _head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return {"rope_type": "default", **params}


class Rotary(nn.Module):
    """Cos/sin tables for every position, from transformers' RoPE init (all rope scalings)."""

    def __init__(self, config: PretrainedConfig, max_positions: int):
        super().__init__()
        rope_type = _rope_parameters(config)["rope_type"]
        if rope_type == "default":
            base = _rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = _head_dim(config)
            inv_freq, scale = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        else:
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        self.register_buffer("cos", freqs.cos() * scale, persistent=False)
        self.register_buffer("sin", freqs.sin() * scale, persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated at ``positions`` [T] (HF's half-split convention)."""
        cos = self.cos[positions].unsqueeze(1).to(x.dtype)
        sin = self.sin[positions].unsqueeze(1).to(x.dtype)
        x1, x2 = x.chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q [T, H, D] for the step's new tokens; caches [num_blocks, block_size, KV, D] already hold them."""
    num_heads = q.shape[1]
    if meta.decode_only:
        # One query per sequence: gather every sequence's blocks and attend in one batched call.
        B, max_blocks = meta.block_tables.shape
        flat = meta.block_tables.flatten()  # index_select copies ~2x faster than advanced indexing on CPU
        k = k_cache.index_select(0, flat).view(B, -1, *k_cache.shape[2:]).transpose(1, 2)  # [B, KV, L, D]
        v = v_cache.index_select(0, flat).view(B, -1, *v_cache.shape[2:]).transpose(1, 2)
        valid = torch.arange(k.shape[2], device=q.device)[None, :] < meta.context_lens[:, None]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2), k, v, attn_mask=valid[:, None, None, :], scale=scale, enable_gqa=True
        )  # [B, H, 1, D]
        return out.squeeze(2)
    outs, start = [], 0
    for i, n in enumerate(meta.query_lens):
        ctx = int(meta.context_lens[i])
        blocks = meta.block_tables[i, : (ctx + meta.block_size - 1) // meta.block_size]
        k = k_cache.index_select(0, blocks).flatten(0, 1)[:ctx].transpose(0, 1)  # [KV, ctx, D]
        v = v_cache.index_select(0, blocks).flatten(0, 1)[:ctx].transpose(0, 1)
        qi = q[start : start + n].transpose(0, 1)  # [H, n, D]
        if ctx == n:
            out = F.scaled_dot_product_attention(qi, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:  # a chunk after cached tokens: query j sits at position ctx - n + j
            mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
            out = F.scaled_dot_product_attention(qi, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        outs.append(out.transpose(0, 1))
        start += n
    assert start == q.shape[0] and all(o.shape[1] == num_heads for o in outs)
    return torch.cat(outs)


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = _head_dim(config)
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.qk_norm = config.model_type == "qwen3"  # Qwen3 normalises each head's q and k
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, positions, rotary: Rotary, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        T = x.shape[0]
        q, k, v = self.qkv_proj(x).split(
            [self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1
        )
        q = q.view(T, self.num_heads, self.head_dim)
        k = k.view(T, self.num_kv_heads, self.head_dim)
        v = v.view(T, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rotary(q, positions), rotary(k, positions)
        k_cache, v_cache = kv_cache
        k_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, meta.slot_mapping, v)
        out = paged_attention(q, k_cache, v_cache, meta, self.head_dim**-0.5)
        return self.o_proj(out.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, positions, rotary, kv_cache, meta):
        x = x + self.self_attn(self.input_layernorm(x), positions, rotary, kv_cache, meta)
        return x + self.mlp(self.post_attention_layernorm(x))


class CausalLM(nn.Module):
    def __init__(self, config: PretrainedConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = Rotary(config, max_positions)

    def forward(self, input_ids, positions, kv_caches, meta: AttentionMetadata, logits_indices: torch.Tensor) -> torch.Tensor:
        """Logits [len(logits_indices), V] for the selected positions of the flattened step."""
        x = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(x, positions, self.rotary, kv_cache, meta)
        return self.lm_head(self.norm(x[logits_indices]))


def hf_state_dict_to_engine(items, config: PretrainedConfig):
    """Map HF Llama-family tensors (name, tensor) to this model's names, fusing q/k/v and gate/up.

    Yields (name, tensor) as soon as each fused group is complete, so a streaming
    iterator (a weight sync from a trainer) never holds the whole model twice."""
    pending: dict[str, dict[str, torch.Tensor]] = {}
    groups = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2), "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)}
    sizes = {"qkv_proj": 3, "gate_up_proj": 2}
    for name, tensor in items:
        name = name.removeprefix("model.")
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        if "rotary_emb" in name:
            continue
        parts = name.split(".")
        if len(parts) >= 2 and parts[-2] in groups:
            fused, index = groups[parts[-2]]
            key = ".".join(parts[:-2] + [fused, parts[-1]])
            pending.setdefault(key, {})[index] = tensor
            if len(pending[key]) == sizes[fused]:
                shards = pending.pop(key)
                yield key, torch.cat([shards[i] for i in range(sizes[fused])], dim=0)
            continue
        yield name, tensor
    assert not pending, f"incomplete fused weights: {sorted(pending)}"
