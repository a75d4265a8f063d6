"""CPU specialisations of the engine's model, applied as module swaps after the weights load
(the way ``quant.quantize_int8_`` works), so that ``model.py`` stays plain model code.

- Weights, fp32: every Linear becomes a ``PackedLinear`` on two oneDNN copies of its weight, or,
  without oneDNN packing, keeps its weight stored input-major (``store_linear_weights_input_major_``).
- Kernels (csrc/cpu_kernels.cpp, fp32, where they build): RMSNorm with the skip connection's add,
  SwiGLU's activation and RoPE in C++; decodes attend through the kernel that reads the paged KV
  cache in place.

Swapped modules keep their parameters (a kernel module is the same module with another forward), so
loading new weights works the same before and after; a ``PackedLinear`` takes new weights through
``load_weight``, as ``Int8Linear`` does.
"""

from __future__ import annotations

import torch
from torch import nn

from mlplat.engine import cpu_kernels
from mlplat.engine.model import AttentionMetadata, PagedAttention, RMSNorm, RopeTables, Rotary, SiluAndMul


# -- weights -----------------------------------------------------------------------------------
class PackedLinear(nn.Module):
    """A Linear on two copies of its weight reordered for oneDNN instead of the plain one.

    One layout is blocked for batches (batched decodes, prefill chunks: MKL's GEMM re-packs a plain
    weight on every call, which at 8-32 rows costs about as much as the arithmetic; oneDNN measured
    1.3-2x faster) and one for a single row (a decode alone: oneDNN's GEMV on it streams the weights
    at ~20 GB/s where MKL's GEMV on the plain weight gets ~15, 2-core AVX2 CPU). The plain weight is
    dropped: ``weight`` stays as a meta-device parameter for its name and shape, so packing costs no
    memory over one copy per layout."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(torch.empty_like(linear.weight, device="meta"), requires_grad=False)
        self.bias = linear.bias
        self.packed_weight: torch.Tensor | None = None  # blocked for batches of rows
        self.gemv_weight: torch.Tensor | None = None  # blocked for one row
        self.load_weight(linear.weight.detach())

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor) -> None:
        """Pack ``weight`` [out, in] (also how new weights load: there is no plain weight to copy into)."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"shape {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        weight = weight.to(self.weight.dtype)
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 32)
        self.gemv_weight = torch.ops.mkldnn._reorder_linear_weight(weight, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = self.gemv_weight if x.shape[0] == 1 else self.packed_weight
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), weight, self.bias, "none", [], "")


def can_pack_weights() -> bool:
    return torch.backends.mkldnn.is_available()


def _tied_head(model: nn.Module) -> nn.Module | None:
    """A head that shares the embedding's weight keeps the embedding's row-major storage (lookups need rows)."""
    head, embed = getattr(model, "lm_head", None), getattr(model, "embed_tokens", None)
    return head if head is not None and embed is not None and head.weight is embed.weight else None


def pack_linear_weights_(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear but a tied head with a PackedLinear on its current weight, in place."""
    tied = _tied_head(model)
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear and child is not tied:
                setattr(module, name, PackedLinear(child))
    return model


def store_linear_weights_input_major_(model: nn.Module) -> nn.Module:
    """Keep each Linear weight [out, in] as a transposed view of an [in, out] tensor, in place.

    F.linear then hands MKL a plain (non-transposed) weight, which on CPU runs the small-batch
    GEMMs of decoding 1.3-2x faster. Shapes, names and in-place loading are unchanged."""
    tied = _tied_head(model)
    for module in model.modules():
        if isinstance(module, nn.Linear) and module is not tied:
            module.weight = nn.Parameter(module.weight.detach().t().contiguous().t(), requires_grad=module.weight.requires_grad)
    return model


# -- kernels -----------------------------------------------------------------------------------
class CpuRopeTables(RopeTables):
    def rotate(self, x: torch.Tensor) -> torch.Tensor:
        cpu_kernels.rotary_(x, self.cos, self.sin)  # in place: callers do not read x again
        return x


class CpuRotary(Rotary):
    tables_class = CpuRopeTables


class CpuRMSNorm(RMSNorm):
    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is not None:  # (norm(x + residual), x + residual), in place in x and residual
            cpu_kernels.add_rms_norm_(x, residual, self.weight, self.eps)
            return x, residual
        return cpu_kernels.rms_norm(x, self.weight, self.eps)


class CpuSiluAndMul(SiluAndMul):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return cpu_kernels.silu_and_mul(x)


class CpuPagedAttention(PagedAttention):
    """Decodes through the C++ kernel that reads the paged cache in place (the runner plans no gather
    groups: ``AttentionMetadata.decode_kernel``); prefills as in PagedAttention."""

    def decode(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> list[torch.Tensor]:
        if not meta.decode_kernel:
            return super().decode(q, k_cache, v_cache, meta, scale)
        n = meta.num_decodes
        return [cpu_kernels.paged_decode_attention(q[:n], k_cache, v_cache, meta.block_tables[:n], meta.context_lens[:n], scale)] if n else []


KERNEL_MODULES = {RMSNorm: CpuRMSNorm, SiluAndMul: CpuSiluAndMul, Rotary: CpuRotary}


def use_cpu_kernels_(model: nn.Module, decode_attention: bool) -> nn.Module:
    """Swap the norms, the activation and RoPE (and with ``decode_attention``, attention) for their
    C++-kernel versions, in place. Same parameters and buffers: only the forward changes."""
    swaps = KERNEL_MODULES | ({PagedAttention: CpuPagedAttention} if decode_attention else {})
    for module in model.modules():
        if type(module) in swaps:
            module.__class__ = swaps[type(module)]
    return model


def paged_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, k=None, v=None) -> torch.Tensor:
    """The attention the engine's model runs for ``meta``: through the decode kernel where the runner
    planned for it (``meta.decode_kernel``), else gather + SDPA. For tests and benchmarks."""
    attention = CpuPagedAttention() if meta.decode_kernel else PagedAttention()
    return attention(q, k_cache, v_cache, meta, scale, k, v)
