"""Int8 weight-only quantization: symmetric, one scale per output channel, chosen at load time.

Decode is memory-bound, so reading 1 byte per weight instead of 4 (fp32) or 2 (bf16)
is the win; activations stay in the compute dtype. On CPU the matmul runs in
PyTorch's int8 weight-only kernel; elsewhere the weight is dequantized per call.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """int8 weight [out, in] and fp32 scales [out] with weight ~= int8 * scale."""
    scale = weight.float().abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(weight.float() / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8Linear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.compute_dtype = linear.weight.dtype
        q, scale = quantize_per_channel(linear.weight.detach())
        self.register_buffer("qweight", q)
        self.register_buffer("scale", scale.to(self.compute_dtype))
        self.bias = linear.bias

    @torch.no_grad()
    def load_weight(self, weight: torch.Tensor) -> None:
        q, scale = quantize_per_channel(weight.to(self.qweight.device))
        self.qweight.copy_(q)
        self.scale.copy_(scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type == "cpu":
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.qweight, self.scale)
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


def weight_bytes(model: nn.Module) -> int:
    """Bytes of parameters and buffers that hold weights (the KV cache is not part of the model)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *(b for n, b in model.named_buffers() if n.endswith(("qweight", "scale")))]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
