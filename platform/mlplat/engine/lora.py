"""Multi-LoRA: many peft adapters served on one base model, applied batched inside its linear layers.

An adapter is peft's directory (``adapter_config.json`` + ``adapter_model.safetensors``, as the SFT recipe's
``lora:`` writes it, mlplat.train.lora.save_adapter). Its q/k/v (gate/up) updates land on output slices of the
engine's fused ``qkv_proj`` (``gate_up_proj``).

- ``LoRALinear`` wraps whatever linear module is in place (nn.Linear, cpu.PackedLinear, quant.Int8Linear: a
  module swap, as quantize_int8_ does) with ``max_loras`` slots of stacked A and B buffers. A step computes, for
  every token at once, ``base(x) + ((x A) * mask) B``: A stacks every slot's columns, ``mask`` keeps each
  token's own slot's (none for a token of the base model, which adds exact zeros). A shrink and an expand per
  output slice for any mix of adapters, no loop over requests: ``max_loras * max_lora_rank`` columns (4 x 16 = 64)
  beside the base matmul's thousands. Far more slots would want a segmented matmul (vLLM's punica kernels).
- ``LoRAManager``: the adapters a replica knows by name, read from disk and checked against the model on first
  use (kept on the host after), and the device slots, an LRU of ``max_loras`` in which an adapter that a running
  sequence uses is pinned (the scheduler pins on admission, unpins on finish or preemption).
"""

from __future__ import annotations

import json
from collections import Counter, OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from mlplat.engine.config import MultiLoRAConfig

ADAPTER_CONFIG, ADAPTER_WEIGHTS = "adapter_config.json", "adapter_model.safetensors"  # peft's file names

# peft target (HF module name) -> (engine module in a decoder layer, output slice of it)
TARGETS = {
    "q_proj": ("self_attn.qkv_proj", 0), "k_proj": ("self_attn.qkv_proj", 1), "v_proj": ("self_attn.qkv_proj", 2),
    "o_proj": ("self_attn.o_proj", 0),
    "gate_proj": ("mlp.gate_up_proj", 0), "up_proj": ("mlp.gate_up_proj", 1),
    "down_proj": ("mlp.down_proj", 0),
}  # fmt: skip


class LoRAContext:
    """The step's per-token adapter columns, set by the runner once per step and read by every LoRALinear."""

    def __init__(self, max_loras: int, max_rank: int, device: torch.device, dtype: torch.dtype):
        self.device, self.dtype = device, dtype
        self.column_slot = torch.arange(max_loras * max_rank, device=device) // max_rank  # column -> slot
        self.mask: torch.Tensor | None = None  # [T, max_loras * max_rank]; None: no token uses an adapter
        self._tiled: dict[int, torch.Tensor] = {}

    def set_step(self, token_slots: list[int]) -> None:
        """Each new token's slot (-1: the base model), in the step's token order."""
        self._tiled = {}
        if all(s < 0 for s in token_slots):
            self.mask = None
            return
        slots = torch.tensor(token_slots, device=self.device)
        self.mask = (slots[:, None] == self.column_slot[None, :]).to(self.dtype)

    def tiled(self, num_slices: int) -> torch.Tensor:
        """The mask repeated for a fused linear's ``num_slices`` outputs (built once per step and size)."""
        if num_slices not in self._tiled:
            self._tiled[num_slices] = self.mask.repeat(1, num_slices)
        return self._tiled[num_slices]


class LoRALinear(nn.Module):
    """``base`` plus each token's adapter. Stored input-major, as the CPU path stores base weights (MKL then gets plain,
    non-transposed operands): ``lora_a`` [in, slices * L * R], slice i's slot s in columns (i * L + s) * R ..; per output
    slice i, ``lora_b{i}`` [L * R, slice out], slot s in rows s * R .., with ``scaling`` folded in. Each slice expands
    into its own columns of the output, so the fused q/k/v (gate/up) projections carry no block-diagonal zeros."""

    def __init__(self, base: nn.Module, slice_sizes: list[int], max_loras: int, max_rank: int, context: LoRAContext,
                 dtype: torch.dtype):  # fmt: skip
        super().__init__()
        self.base, self.context = base, context
        self.in_features, self.out_features = base.in_features, base.out_features
        assert sum(slice_sizes) == self.out_features, (slice_sizes, self.out_features)
        self.slice_sizes, self.max_loras, self.max_rank = slice_sizes, max_loras, max_rank
        self.slice_starts = [sum(slice_sizes[:i]) for i in range(len(slice_sizes))]
        # The base's parameters under this module's own names too, so that checkpoint names (qkv_proj.weight, .bias) still
        # load in place (ModelRunner.update_weights); a swapped-in base (packed, int8) loads through its load_weight.
        for name in ("weight", "bias"):
            if isinstance(getattr(base, name, None), nn.Parameter):
                setattr(self, name, getattr(base, name))
        if hasattr(base, "load_weight"):
            self.load_weight = base.load_weight
        width, device = max_loras * max_rank, context.device
        self.register_buffer("lora_a", torch.zeros(self.in_features, len(slice_sizes) * width, dtype=dtype, device=device), persistent=False)
        for i, size in enumerate(slice_sizes):
            self.register_buffer(f"lora_b{i}", torch.zeros(width, size, dtype=dtype, device=device), persistent=False)

    def lora_b(self, i: int) -> torch.Tensor:
        return getattr(self, f"lora_b{i}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.context.mask is None:
            return y
        shrunk = torch.mm(x, self.lora_a).mul_(self.context.tiled(len(self.slice_sizes)))  # [T, slices * L * R], own slot only
        width = self.max_loras * self.max_rank
        for i, (start, size) in enumerate(zip(self.slice_starts, self.slice_sizes)):  # 1-3 slices, whatever the batch
            y[:, start : start + size].addmm_(shrunk[:, i * width : (i + 1) * width], self.lora_b(i))
        return y

    @torch.no_grad()
    def set_slot(self, slot: int, slices: list[tuple[torch.Tensor, torch.Tensor] | None]) -> None:
        """Write one adapter's (A [r, in], scaled B [slice out, r]) per output slice into ``slot`` (None: that slice unadapted)."""
        L, R = self.max_loras, self.max_rank
        for i, ab in enumerate(slices):
            a_cols, b_rows = self.lora_a[:, (i * L + slot) * R : (i * L + slot + 1) * R], self.lora_b(i)[slot * R : (slot + 1) * R]
            a_cols.zero_()
            b_rows.zero_()
            if ab is not None:
                a, b = ab
                a_cols[:, : a.shape[0]].copy_(a.t())
                b_rows[: b.shape[1]].copy_(b.t())


def enable_lora_(model: nn.Module, cfg: MultiLoRAConfig, device: torch.device,
                 dtype: torch.dtype) -> tuple[LoRAContext, dict[str, LoRALinear]]:  # fmt: skip
    """Wrap every decoder layer's projections in a LoRALinear, in place; returns the shared context and the wrapped
    modules by name (``layers.3.self_attn.qkv_proj``)."""
    context = LoRAContext(cfg.max_loras, cfg.max_lora_rank, device, dtype)
    c = model.config
    hd = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    slice_sizes = {
        "self_attn.qkv_proj": [c.num_attention_heads * hd, c.num_key_value_heads * hd, c.num_key_value_heads * hd],
        "self_attn.o_proj": [c.hidden_size],
        "mlp.gate_up_proj": [c.intermediate_size, c.intermediate_size],
        "mlp.down_proj": [c.hidden_size],
    }
    wrapped = {}
    for i, layer in enumerate(model.layers):
        for path, sizes in slice_sizes.items():
            parent_name, _, attr = path.rpartition(".")
            parent = layer.get_submodule(parent_name)
            module = LoRALinear(getattr(parent, attr), sizes, cfg.max_loras, cfg.max_lora_rank, context, dtype)
            setattr(parent, attr, module)
            wrapped[f"layers.{i}.{path}"] = module
    return context, wrapped


@dataclass
class LoRAAdapter:
    """One adapter's weights on the host, per wrapped module: (A [r, in], B * scaling [slice out, r]) per output slice."""

    name: str
    path: Path
    rank: int
    weights: dict[str, list[tuple[torch.Tensor, torch.Tensor] | None]]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for slices in self.weights.values() for ab in slices if ab for t in ab)


def read_adapter(name: str, path: str | Path, modules: dict[str, LoRALinear], max_rank: int, dtype: torch.dtype) -> LoRAAdapter:
    """An adapter's weights from peft's files, checked against the wrapped model: ValueError naming the problem (an
    adapter for another base model, an unsupported target or variant, a rank over max_lora_rank)."""
    path = Path(path)
    if not (path / ADAPTER_CONFIG).is_file() or not (path / ADAPTER_WEIGHTS).is_file():
        raise ValueError(f"adapter {name!r}: {path} is not a peft LoRA adapter directory ({ADAPTER_CONFIG} + {ADAPTER_WEIGHTS})")
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    if config.get("peft_type", "LORA") != "LORA" or config.get("use_rslora") or config.get("use_dora") \
            or config.get("rank_pattern") or config.get("alpha_pattern"):  # fmt: skip
        raise ValueError(f"adapter {name!r}: only plain LoRA is served (no rsLoRA, DoRA or per-module ranks)")
    missing = [key for key in ("r", "lora_alpha") if key not in config]
    if missing:
        raise ValueError(f"adapter {name!r}: {ADAPTER_CONFIG} lacks {' and '.join(map(repr, missing))}: save it with peft")
    rank = int(config["r"])
    if rank > max_rank:
        raise ValueError(f"adapter {name!r}: rank {rank} is over this engine's max_lora_rank ({max_rank}); raise lora.max_lora_rank")
    scaling = config["lora_alpha"] / rank
    tensors: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
    with safe_open(path / ADAPTER_WEIGHTS, framework="pt") as f:
        for key in f.keys():
            module, _, kind = key.removesuffix(".weight").rpartition(".")  # ...layers.0.self_attn.q_proj, lora_A
            hf_module = module.removeprefix("base_model.model.").removeprefix("model.")
            prefix, _, target = hf_module.rpartition(".")
            if kind not in ("lora_A", "lora_B") or target not in TARGETS:
                raise ValueError(f"adapter {name!r}: {key} is not supported; the engine serves LoRA on {', '.join(TARGETS)}")
            engine_path, index = TARGETS[target]
            engine_name = f"{prefix.rpartition('.')[0]}.{engine_path}"  # layers.0.self_attn + qkv_proj
            if engine_name not in modules:
                raise ValueError(f"adapter {name!r} was trained for another base model: it adapts {hf_module}, "
                                 f"which this model ({len(modules) // 4} layers) does not have")  # fmt: skip
            tensors.setdefault((engine_name, index), {})[kind] = f.get_tensor(key)
    weights: dict[str, list] = {}
    for (engine_name, index), ab in tensors.items():
        module = modules[engine_name]
        a, b = ab.get("lora_A"), ab.get("lora_B")
        if a is None or b is None:
            raise ValueError(f"adapter {name!r}: {engine_name} slice {index} has lora_{'A' if a is None else 'B'} missing")
        expected_a, expected_b = (rank, module.in_features), (module.slice_sizes[index], rank)
        if tuple(a.shape) != expected_a or tuple(b.shape) != expected_b:
            raise ValueError(f"adapter {name!r} was trained for another base model: {engine_name} (slice {index}) has A {tuple(a.shape)}, "
                             f"B {tuple(b.shape)} where this model takes A {expected_a}, B {expected_b}")  # fmt: skip
        slices = weights.setdefault(engine_name, [None] * len(module.slice_sizes))
        slices[index] = (a.to(dtype).contiguous(), (b.float() * scaling).to(dtype).contiguous())
    if not weights:
        raise ValueError(f"adapter {name!r}: {path / ADAPTER_WEIGHTS} holds no LoRA weights")
    return LoRAAdapter(name, path, rank, weights)


class LoRAManager:
    """Adapters by name (read on first use, then kept on the host, LRU) and the device slots (LRU, pinned while in use)."""

    def __init__(self, cfg: MultiLoRAConfig, context: LoRAContext, modules: dict[str, LoRALinear], dtype: torch.dtype):
        self.cfg, self.context, self.modules, self.dtype = cfg, context, modules, dtype
        self.paths: dict[str, Path] = {name: Path(p) for name, p in cfg.adapters.items()}
        self.host: OrderedDict[str, LoRAAdapter] = OrderedDict()  # read adapters, least recently used first
        self.max_host = cfg.max_cpu_loras or cfg.max_loras
        self.num_reads = 0
        self.checked: set[str] = set()  # adapters read once and found compatible: admission need not read them again
        self.slots: OrderedDict[str, int] = OrderedDict()  # resident adapters, least recently used first
        self.pins: Counter[str] = Counter()  # running sequences per resident adapter
        self.num_slot_loads = 0

    @property
    def slot_bytes(self) -> int:
        """Device memory of one slot across every wrapped linear (each sized for max_lora_rank)."""
        total = sum(b.numel() * b.element_size() for m in self.modules.values() for n, b in m.named_buffers() if n.startswith("lora_"))
        return total // self.cfg.max_loras

    def check(self, name: str) -> None:
        """Admission's check: ValueError for an unknown or incompatible adapter (read once, not on every request)."""
        if name not in self.checked:
            self.adapter(name)
            self.checked.add(name)

    def adapter(self, name: str) -> LoRAAdapter:
        """The adapter's host weights, read and checked on first use: ValueError for an unknown or incompatible one."""
        if name in self.host:
            self.host.move_to_end(name)
            return self.host[name]
        if name not in self.paths:
            raise ValueError(f"lora_name: unknown adapter {name!r}; this engine has {sorted(self.paths)}")
        adapter = read_adapter(name, self.paths[name], self.modules, self.cfg.max_lora_rank, self.dtype)
        self.num_reads += 1
        self.host[name] = adapter
        while len(self.host) > self.max_host:  # a replica addressed by many adapters keeps only max_cpu_loras of them read
            self.host.popitem(last=False)
        return adapter

    def can_pin(self, name: str) -> bool:
        return name in self.slots or len(self.slots) < self.cfg.max_loras or any(self.pins[n] == 0 for n in self.slots)

    def pin(self, name: str) -> int:
        """The adapter's slot, loading it there first if needed (evicting the least recently used unpinned one)."""
        if name in self.slots:
            self.slots.move_to_end(name)
        else:
            adapter = self.adapter(name)  # before any eviction: a read that fails leaves the slots as they were
            used = set(self.slots.values())
            free = [s for s in range(self.cfg.max_loras) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(n for n in self.slots if self.pins[n] == 0)  # can_pin said there is one
                slot = self.slots.pop(victim)
                del self.pins[victim]
            for module_name, module in self.modules.items():
                module.set_slot(slot, adapter.weights.get(module_name, [None] * len(module.slice_sizes)))
            self.slots[name] = slot
            self.num_slot_loads += 1
        self.pins[name] += 1
        return self.slots[name]

    def unpin(self, name: str) -> None:
        assert self.pins[name] > 0, f"adapter {name!r} unpinned more often than pinned"
        self.pins[name] -= 1
