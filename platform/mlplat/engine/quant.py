"""Int8 weight-only quantization: symmetric, one scale per output channel, chosen at load time.

Decode is memory-bound, so reading 1 byte per weight instead of 4 (fp32) or 2 (bf16)
is the win. On CPU, a few rows at a time (decoding) go through PyTorch's int8 weight-only
kernel (``_weight_int8pack_mm``) with bf16 activations: its vectorized path; with fp32 or
fp16 activations it falls back to scalar code 10-100x slower than an fp32 matmul. Larger
batches (prefill, scoring) are compute-bound: there, and on other devices, the weight is
dequantized per call and the matmul runs in the compute dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight [out, in] and fp32 scales [out] with weight ~= int8 * scale."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous(), scale


class Int8Linear(nn.Module):
    # Up to this many rows the int8 kernel beats dequantize + fp32 matmul (measured on a 2-core AVX-512 CPU).
    int8_kernel_max_rows = 4

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        q, scale = quantize_per_channel(linear.weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.to(self.compute_dtype))
        self.register_buffer("scale_bf16", scale.to(torch.bfloat16), persistent=False)  # the int8 kernel's
        self.bias = linear.bias

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor) -> None:
        """Quantize ``weight`` [out, in] into this module's buffers, in place."""
        if tuple(weight.shape) != (self.out_features, self.in_features):
            raise ValueError(f"shape {tuple(weight.shape)} != {(self.out_features, self.in_features)}")
        q, scale = quantize_per_channel(weight.to(self.qweight.device))
        self.qweight.copy_(q)
        self.scale.copy_(scale)
        self.scale_bf16.copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if x.device.type == "cpu" and rows.shape[0] <= self.int8_kernel_max_rows:
            y = torch._weight_int8pack_mm(rows.to(torch.bfloat16), self.qweight, self.scale_bf16).to(x.dtype)
            y = y.reshape(*x.shape[:-1], self.out_features)
        else:
            y = F.linear(x, self.qweight.to(x.dtype)) * self.scale
        return y + self.bias if self.bias is not None else y


def quantize_int8_(model: nn.Module) -> nn.Module:
    """Replace every nn.Linear in ``model`` with an Int8Linear, in place."""
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if isinstance(child, nn.Linear):
                setattr(module, child_name, Int8Linear(child))
    return model


def weight_bytes(model: nn.Module, include_packed: bool = True) -> int:
    """Bytes of parameters and buffers that hold weights (the KV cache is not part of the model).

    ``include_packed``: what the model holds in memory, with the oneDNN copies that packed CPU fp32
    linears run on instead of their plain weight (engine.cpu.PackedLinear; its parameter is then a meta
    placeholder). False: the checkpoint's weights, every parameter at its shape and dtype."""
    seen, total = set(), 0
    for t in [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith(("qweight", "scale")))]:
        placeholder = t.device.type == "meta"
        key = id(t) if placeholder else t.data_ptr()  # ties share storage: count it once
        if key in seen or (placeholder and include_packed):
            continue
        seen.add(key)
        total += t.numel() * t.element_size()
    if include_packed:
        for m in model.modules():
            for packed in (getattr(m, "packed_weight", None), getattr(m, "gemv_weight", None)):
                total += packed.numel() * packed.element_size() if packed is not None else 0
    return total
