"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5/3) over a paged KV cache.

Plain single-device PyTorch. A step takes the new tokens of every scheduled
sequence flattened into one batch (prefill chunks and decodes alike); attention
reads each sequence's keys and values through its block table. q/k/v and gate/up
projections are fused, so a layer makes four matmuls instead of seven.
HF checkpoints load through ``hf_state_dict_to_engine`` beside the model. Backend
specialisations (CPU kernels and weight layouts: ``engine.cpu``; int8: ``engine.quant``)
swap modules of this model after it is built; nothing here knows of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import accumulate

import torch
import torch.nn.functional as F
from torch import nn
from transformers import PretrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


@dataclass
class AttentionMetadata:
    """Where the step's new tokens go and what each sequence attends to.

    The runner puts decodes (one new token each) first: they attend in one batched call.
    Every sequence after the leading decodes (a prefill chunk, a speculative verify) attends on its own."""

    slot_mapping: torch.Tensor  # [T] cache slot of each new token
    query_lens: list[int]  # new tokens per sequence (1 for a decode)
    context_lens: torch.Tensor  # [B] tokens in the cache per sequence after this step
    block_tables: torch.Tensor  # [B, max_blocks] padded with 0
    block_size: int
    # Reusable [blocks, block_size, KV, D] buffers for decode gathers (the runner keeps them across
    # steps): a fresh allocation per layer costs ~25% more, page faults included.
    gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None
    # Decodes attend through a kernel that reads the paged cache in place (engine.cpu's attention), so
    # no gather groups are planned for them.
    decode_kernel: bool = False

    def __post_init__(self):
        # Derived once per step rather than once per layer.
        context_lens = self.context_lens.tolist()
        self.num_decodes = next((i for i, n in enumerate(self.query_lens) if n != 1), len(self.query_lens))
        bs, device = self.block_size, self.context_lens.device
        self.decode_groups = []  # (first, end, block ids [rows * width], mask of real tokens [rows, 1, 1, width * bs])
        for first, end in [] if self.decode_kernel else decode_groups(context_lens[: self.num_decodes], bs):
            width = -(-max(context_lens[first:end]) // bs)  # blocks of the group's longest context
            valid = torch.arange(width * bs, device=device)[None, :] < self.context_lens[first:end, None]
            self.decode_groups.append((first, end, self.block_tables[first:end, :width].flatten(), valid[:, None, None, :]))
        self.max_decode_gather = max((len(blocks) for _, _, blocks, _ in self.decode_groups), default=0)
        starts = [0, *accumulate(self.query_lens)]
        self.prefills = [  # (first new token, new tokens, context, block ids) of each non-decode sequence
            (starts[i], n, context_lens[i], self.block_tables[i, : -(-context_lens[i] // bs)])
            for i, n in enumerate(self.query_lens)
            if i >= self.num_decodes
        ]

    @property
    def decode_only(self) -> bool:
        return self.num_decodes == len(self.query_lens)


# A decode group costs a fixed set of ops per layer; below about this many tokens of padding saved,
# splitting a batch of decodes in two does not pay.
GROUP_COST_TOKENS = 256


def decode_groups(context_lens: list[int], block_size: int) -> list[tuple[int, int]]:
    """Split decodes into contiguous groups that each attend in one batched call, padded to the group's longest.

    Minimises padded tokens + GROUP_COST_TOKENS per group (dynamic programming over split points). With
    the runner's decodes sorted longest first, 32 decodes with contexts spread over 32..800 pad ~1.1x instead of ~1.9x."""
    n = len(context_lens)
    if n == 0:
        return []
    widths = [-(-c // block_size) * block_size for c in context_lens]
    best, split = [0] + [float("inf")] * n, [0] * (n + 1)
    for end in range(1, n + 1):
        longest = 0
        for first in range(end - 1, -1, -1):
            longest = max(longest, widths[first])
            cost = best[first] + (end - first) * longest + GROUP_COST_TOKENS
            if cost < best[end]:
                best[end], split[end] = cost, first
    groups, end = [], n
    while end:
        groups.append((split[end], end))
        end = split[end]
    return groups[::-1]


def head_dim(config: PretrainedConfig) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def _rope_parameters(config: PretrainedConfig) -> dict:
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return {"rope_type": "default", **params}


@dataclass
class RopeTables:
    """cos and signed sin [T, 1, D] at the step's positions, looked up once per step."""

    cos: torch.Tensor
    sin: torch.Tensor

    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, heads, D] rotated (HF's half-split convention, same arithmetic as its rotate_half).
        A backend may rotate in place: callers do not read ``x`` again."""
        x1, x2 = x.chunk(2, dim=-1)
        return x * self.cos + torch.cat((x2, x1), dim=-1) * self.sin


class Rotary(nn.Module):
    """Cos/sin tables for every position, from transformers' RoPE init (all rope scalings)."""

    tables_class = RopeTables

    def __init__(self, config: PretrainedConfig, max_positions: int):
        super().__init__()
        rope_type = _rope_parameters(config)["rope_type"]
        if rope_type == "default":
            base = _rope_parameters(config).get("rope_theta", getattr(config, "rope_theta", 10000.0))
            dim = head_dim(config)
            inv_freq, scale = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), 1.0
        else:
            inv_freq, scale = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
        freqs = torch.outer(torch.arange(max_positions, dtype=torch.float), inv_freq)
        cos, sin = freqs.cos() * scale, freqs.sin() * scale
        # Full-width tables with rotate_half's sign folded into sin: x * cos + swap_halves(x) * sin.
        self.register_buffer("cos", torch.cat((cos, cos), dim=-1), persistent=False)
        self.register_buffer("sin", torch.cat((-sin, sin), dim=-1), persistent=False)

    def tables(self, positions: torch.Tensor, dtype: torch.dtype) -> RopeTables:
        """The tables at ``positions`` [T]."""
        return self.tables_class(self.cos[positions].unsqueeze(1).to(dtype), self.sin[positions].unsqueeze(1).to(dtype))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """x normalized; with ``residual``, the skip connection's add first: (norm(x + residual), x + residual)."""
        if residual is not None:
            residual = residual + x
            return self(residual), residual
        return F.rms_norm(x.float(), (x.shape[-1],), self.weight.float(), self.eps).to(x.dtype)


class SiluAndMul(nn.Module):
    """SwiGLU's activation, silu(gate) * up, of the fused gate/up projection's output [T, 2I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def gather_blocks(cache: torch.Tensor, blocks: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """[len(blocks) * block_size, KV, D]: the given blocks of a [num_blocks, block_size, KV, D] cache, in order."""
    # index_select copies whole blocks (contiguous rows); advanced indexing is ~2x slower on CPU.
    if out is None:
        return cache.index_select(0, blocks).flatten(0, 1)
    return torch.index_select(cache, 0, blocks, out=out[: len(blocks)]).flatten(0, 1)


class PagedAttention(nn.Module):
    """Attention of the step's queries over the paged KV cache: decodes first (batched in groups), then
    each prefill chunk or speculative verify on its own. No parameters: a module so that a backend can
    swap in its own decode path (engine.cpu)."""

    def forward(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k=None, v=None) -> torch.Tensor:
        """q [T, H, D] for the step's new tokens; caches [num_blocks, block_size, KV, D] already hold them.

        ``k``, ``v`` [T, KV, D]: the step's new keys and values, so a prefill with nothing cached
        attends to them directly instead of reading them back from the cache."""
        outs = self.decode(q, k_cache, v_cache, meta, scale) + self.prefill(q, k_cache, v_cache, meta, scale, k, v)
        return outs[0] if len(outs) == 1 else torch.cat(outs)

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> list[torch.Tensor]:
        num_heads, head_dim = q.shape[1:]
        kv_heads = k_cache.shape[2]
        outs = []
        for first, end, blocks, valid in meta.decode_groups:
            # One query per sequence: gather the group's blocks once and attend in one call. GQA: the
            # `group` query heads that share a KV head go in as that head's queries ([B, KV, group, D]), so
            # each key and value is read once per KV head, not once per query head (no causal mask needed).
            B = end - first
            k_buf, v_buf = meta.gather_buffers or (None, None)
            keys = gather_blocks(k_cache, blocks, k_buf).view(B, -1, kv_heads, head_dim).transpose(1, 2)  # [B, KV, L, D]
            values = gather_blocks(v_cache, blocks, v_buf).view(B, -1, kv_heads, head_dim).transpose(1, 2)
            qg = q[first:end].view(B, kv_heads, -1, head_dim)
            out = F.scaled_dot_product_attention(qg, keys, values, attn_mask=valid, scale=scale)  # [B, KV, group, D]
            outs.append(out.reshape(B, num_heads, head_dim))
        return outs

    def prefill(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k=None, v=None) -> list[torch.Tensor]:
        outs = []
        for start, n, ctx, blocks in meta.prefills:
            qi = q[start : start + n].transpose(0, 1)  # [H, n, D]
            if ctx == n and k is not None:  # nothing cached before this chunk: its own keys are all there is
                ki, vi = k[start : start + n].transpose(0, 1), v[start : start + n].transpose(0, 1)
            else:
                ki, vi = gather_blocks(k_cache, blocks)[:ctx].transpose(0, 1), gather_blocks(v_cache, blocks)[:ctx].transpose(0, 1)
            if ctx == n:
                out = F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, scale=scale, enable_gqa=True)
            else:  # a chunk after cached tokens: query j sits at position ctx - n + j
                mask = torch.arange(ctx, device=q.device)[None, :] <= torch.arange(ctx - n, ctx, device=q.device)[:, None]
                out = F.scaled_dot_product_attention(qi, ki, vi, attn_mask=mask, scale=scale, enable_gqa=True)
            outs.append(out.transpose(0, 1))
        return outs


class Attention(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim(config)
        bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=getattr(config, "attention_bias", False))
        self.attn = PagedAttention()
        self.qk_norm = config.model_type == "qwen3"  # Qwen3 normalises each head's q and k
        if self.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)

    def forward(self, x, rope: RopeTables, kv_cache: tuple[torch.Tensor, torch.Tensor], meta: AttentionMetadata):
        T, H, KV, D = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)
        v = qkv[:, (H + KV) * D :].view(T, KV, D)
        if self.qk_norm:
            q = rope.rotate(self.q_norm(qkv[:, : H * D].view(T, H, D)))
            k = rope.rotate(self.k_norm(qkv[:, H * D : (H + KV) * D].view(T, KV, D)))
        else:  # q and k rotate together: one set of elementwise ops
            q, k = rope.rotate(qkv[:, : (H + KV) * D].view(T, H + KV, D)).split([H, KV], dim=1)
        k_cache, v_cache = kv_cache
        k_cache.view(-1, KV, D).index_copy_(0, meta.slot_mapping, k)
        v_cache.view(-1, KV, D).index_copy_(0, meta.slot_mapping, v)
        out = self.attn(q, k_cache, v_cache, meta, D**-0.5, k, v)
        return self.o_proj(out.reshape(T, -1))


class MLP(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        bias = getattr(config, "mlp_bias", False)
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=bias)
        self.act = SiluAndMul()

    def forward(self, x):
        return self.down_proj(self.act(self.gate_up_proj(x)))


class DecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig):
        super().__init__()
        self.self_attn = Attention(config)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, residual, rope, kv_cache, meta):
        """(this layer's output, the residual stream it adds to). x is the previous layer's output, or the
        embeddings with ``residual`` None at the first layer: each skip connection's add goes into the next norm."""
        if residual is None:
            x, residual = self.input_layernorm(x), x
        else:
            x, residual = self.input_layernorm(x, residual)
        x = self.self_attn(x, rope, kv_cache, meta)
        x, residual = self.post_attention_layernorm(x, residual)
        return self.mlp(x), residual


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
        x, residual = self.embed_tokens(input_ids), None
        rope = self.rotary.tables(positions, x.dtype)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(x, residual, rope, kv_cache, meta)
        x, _ = self.norm(x[logits_indices], residual[logits_indices])
        return self.lm_head(x)


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
