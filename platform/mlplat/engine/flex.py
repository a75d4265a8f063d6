"""Paged attention through PyTorch's FlexAttention (``attention_backend: flex``), swapped into the model
after it is built, as ``engine.cpu`` swaps in its decode kernel.

The whole KV cache is the keys and values of one FlexAttention call, [1, KV, blocks * block_size, D]
(a view: nothing is gathered), and a ``BlockMask`` over the page table says which KV blocks each
sequence's queries read: the kernel visits only those, in place. Its KV block is the engine's block,
so a page-table entry is a block-mask index. Pages wholly before a query block are "full" (no mask
evaluated); the others go through ``mask_mod``, which maps a physical slot back to its position in
the sequence through a per-step [batch, num_blocks] table. That table is per sequence because the
prefix cache shares a block between sequences: "which sequence owns this block" has no single answer.

Decodes attend in one call, B padded up to a power of two, the query heads that share a KV head as
that head's query rows ([B, KV, group, D]: each KV block is read once per KV head, whatever the group
size); the step's prefill chunks and speculative verifies in another, padded to the longest (query
blocks past a sequence's own tokens have no KV blocks, so the kernel skips them). The masks are built
once per step from device tensors without reading them back, so a decode step's whole forward can be
captured in a CUDA graph (``engine.cuda_graph``).

On CUDA ``flex_attention`` is compiled (Triton kernels): decodes with static shapes, since its
decoding kernel needs a static batch (hence the power-of-two padding: a handful of compiled shapes),
prefills with dynamic ones on the main kernel. The kernels' KV tile must divide the block
(``kernel_options``' BLOCK_N). On CPU it runs eagerly: an unfused reference that scores every query
against the whole cache, for tests, not for speed.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from mlplat.engine.model import AttentionMetadata, PagedAttention

Q_BLOCK = 128  # query rows per block-mask tile: FlexAttention's default, a multiple of its kernels' tiles


@dataclass
class FlexAttentionMetadata(AttentionMetadata):
    """AttentionMetadata with the step's block masks in place of gather groups."""

    num_kv_blocks: int = 0  # blocks in the cache: the masks' KV length is num_kv_blocks * block_size
    group: int = 1  # query heads per KV head
    q_block: int = Q_BLOCK

    def __post_init__(self):
        # Nothing here reads a device tensor back: a decode step's metadata is built inside a CUDA graph.
        self.num_decodes = next((i for i, n in enumerate(self.query_lens) if n != 1), len(self.query_lens))
        self.decode_groups, self.max_decode_gather, self.prefills = [], 0, []  # the gather path's plan: none
        nd, device = self.num_decodes, self.block_tables.device
        self.decode_mask = self.prefill_mask = None
        if nd:
            # Padding rows have no context: no KV blocks, an output of zeros that is dropped.
            self.decode_batch = 1 << (nd - 1).bit_length()
            pad = self.decode_batch - nd
            tables, context_lens = F.pad(self.block_tables[:nd], (0, 0, 0, pad)), F.pad(self.context_lens[:nd], (0, pad))
            ones = torch.ones(self.decode_batch, dtype=torch.long, device=device)
            self.decode_mask = self._mask(tables, context_lens, ones, self.group, rows_per_query=self.group)
        lens = self.query_lens[nd:]
        if lens:
            # Prefill queries padded to the longest chunk: [P * longest] rows of the step (a padding row
            # repeats its sequence's last), and where each real row lands in the padded output.
            longest, start = max(lens), nd  # the decodes' one token each come first
            rows, out_rows = [], []
            for p, n in enumerate(lens):
                rows += [start + min(j, n - 1) for j in range(longest)]
                out_rows += range(p * longest, p * longest + n)
                start += n
            self.prefill_len = longest
            self.prefill_rows = torch.tensor(rows, device=device)
            self.prefill_out_rows = torch.tensor(out_rows, device=device)
            query_lens = torch.tensor(lens, device=device)
            self.prefill_mask = self._mask(self.block_tables[nd:], self.context_lens[nd:], query_lens, longest)

    def _mask(self, block_tables, context_lens, query_lens, q_len: int, rows_per_query: int = 1) -> BlockMask:
        return paged_block_mask(block_tables, context_lens, query_lens, q_len, self.block_size, self.num_kv_blocks, self.q_block, rows_per_query)


def paged_block_mask(block_tables, context_lens, query_lens, q_len: int, block_size: int, num_blocks: int,
                     q_block: int = Q_BLOCK, rows_per_query: int = 1) -> BlockMask:
    """The causal BlockMask of B sequences' queries over a paged cache of ``num_blocks`` blocks.

    Sequence b's ``query_lens[b]`` queries are the last tokens of its ``context_lens[b]``, in rows
    0..query_lens[b] * rows_per_query - 1 of a [B, H, q_len, D] query, ``rows_per_query`` consecutive rows
    each; its KV is its first blocks in ``block_tables`` [B, W] (padded with anything). Tensor ops only, on
    the tables' device, with no read back to the host."""
    B, bs, device = block_tables.shape[0], block_size, block_tables.device
    block_tables = block_tables[:, :num_blocks]  # a sequence cannot hold more blocks than the cache has
    width = block_tables.shape[1]
    cols = torch.arange(width, device=device)
    live = cols < (context_lens[:, None] + bs - 1) // bs  # [B, W]: the sequence's own blocks
    # Physical block -> its logical index in each sequence (-1: not the sequence's). A block shared through
    # the prefix cache maps in every row that holds it; padding entries go to a spare last column.
    logical = torch.full((B, num_blocks + 1), -1, dtype=torch.int32, device=device)
    logical.scatter_(1, torch.where(live, block_tables, num_blocks), cols.to(torch.int32).expand(B, width).contiguous())
    q_start = context_lens - query_lens  # position of each sequence's first query

    def mask_mod(b, h, q_idx, kv_idx):
        page = logical[b, kv_idx // bs]
        return (page >= 0) & (page * bs + kv_idx % bs <= q_start[b] + q_idx // rows_per_query)

    # Per query block: its first and last real query's positions; it reads blocks up to the last one's,
    # and those wholly at or before the first one's need no mask.
    tiles = torch.arange(-(-q_len // q_block), device=device) * q_block  # [M] first row of each query block
    first = q_start[:, None] + tiles // rows_per_query
    last = q_start[:, None] + torch.minimum((tiles + q_block - 1) // rows_per_query, query_lens[:, None] - 1)
    empty = first > last  # a query block wholly in the padding
    needed = torch.where(empty, 0, last // bs + 1)
    full = torch.where(empty, 0, (first + 1) // bs)
    partial_index = (full[:, :, None] + cols).clamp(max=width - 1)  # [B, M, W]: blocks after the full ones
    M = tiles.shape[0]
    kv_indices = torch.zeros(B, 1, M, num_blocks, dtype=torch.int32, device=device)
    kv_indices[:, 0, :, :width] = torch.gather(block_tables[:, None, :].expand(B, M, width), 2, partial_index).to(torch.int32)
    full_kv_indices = torch.zeros(B, 1, M, num_blocks, dtype=torch.int32, device=device)
    full_kv_indices[:, 0, :, :width] = block_tables[:, None, :].to(torch.int32)
    return BlockMask.from_kv_blocks(
        (needed - full)[:, None].to(torch.int32), kv_indices, full[:, None].to(torch.int32), full_kv_indices,
        BLOCK_SIZE=(q_block, bs), mask_mod=mask_mod, seq_lengths=(q_len, num_blocks * bs), compute_q_blocks=False,
    )  # fmt: skip


def decode_attention(q, keys, values, block_mask: BlockMask, scale: float, kernel_options: dict | None) -> torch.Tensor:
    return flex_attention(q, keys, values, block_mask=block_mask, scale=scale, kernel_options=kernel_options)


def prefill_attention(q, keys, values, block_mask: BlockMask, scale: float, kernel_options: dict | None) -> torch.Tensor:
    # Its own function, so that it compiles on its own (dynamic shapes, a cache of its own).
    return flex_attention(q, keys, values, block_mask=block_mask, scale=scale, enable_gqa=True, kernel_options=kernel_options)


class FlexPagedAttention(PagedAttention):
    """Decodes, then prefill chunks, each one FlexAttention call over the paged cache read in place."""

    # use_flex_attention_ puts compiled ones here on CUDA, with kernel options that fit the block size.
    decode_attention = staticmethod(decode_attention)
    prefill_attention = staticmethod(prefill_attention)
    decode_options: dict | None = None
    prefill_options: dict | None = None

    def forward(self, q, k_cache, v_cache, meta: FlexAttentionMetadata, scale: float, k=None, v=None) -> torch.Tensor:
        num_blocks, bs, kv_heads, head_dim = k_cache.shape
        # [1, KV, slots, D] views of the caches: the kernel reads blocks through the mask's indices.
        keys = k_cache.view(1, num_blocks * bs, kv_heads, head_dim).transpose(1, 2)
        values = v_cache.view(1, num_blocks * bs, kv_heads, head_dim).transpose(1, 2)
        outs = []
        if meta.decode_mask is not None:
            nd, heads = meta.num_decodes, q.shape[1]
            qd = F.pad(q[:nd], (0, 0, 0, 0, 0, meta.decode_batch - nd)).view(-1, kv_heads, heads // kv_heads, head_dim)  # [B, KV, group, D]
            out = self.decode_attention(qd, keys, values, meta.decode_mask, scale, self.decode_options)
            outs.append(out[:nd].reshape(nd, heads, head_dim))
        if meta.prefill_mask is not None:
            heads, longest = q.shape[1], meta.prefill_len
            qp = q.index_select(0, meta.prefill_rows).view(-1, longest, heads, head_dim).transpose(1, 2)  # [P, H, longest, D]
            out = self.prefill_attention(qp, keys, values, meta.prefill_mask, scale, self.prefill_options)
            outs.append(out.transpose(1, 2).reshape(-1, heads, head_dim).index_select(0, meta.prefill_out_rows))
        return outs[0] if len(outs) == 1 else torch.cat(outs)


def use_flex_attention_(model: nn.Module, block_size: int, compile: bool) -> nn.Module:
    """Swap every PagedAttention for FlexPagedAttention, in place (no parameters: only the forward changes).
    ``compile``: FlexAttention's fused kernels (CUDA; ``block_size`` a multiple of 16) instead of its eager reference."""
    if compile:
        functions = compiled_attention()
        tile = {"BLOCK_N": next((n for n in (64, 32, 16) if block_size % n == 0), block_size)}  # a KV tile divides a block
        # Prefills on the main kernel: the decoding one needs a chunk's length x query heads per KV head to fit a 128-row query block.
        options = (tile, {**tile, "FORCE_USE_FLEX_ATTENTION": True})
    for module in model.modules():
        if isinstance(module, PagedAttention):
            module.__class__ = FlexPagedAttention
            if compile:
                module.decode_attention, module.prefill_attention = functions
                module.decode_options, module.prefill_options = options
    return model


@functools.cache
def compiled_attention():
    """Compiled decode_attention and prefill_attention, shared by every layer and engine in the process."""
    return torch.compile(decode_attention, fullgraph=True, dynamic=False), torch.compile(prefill_attention, fullgraph=True)
