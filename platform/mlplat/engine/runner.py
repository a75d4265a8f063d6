"""The model runner: loads weights, owns the KV cache, turns a scheduled batch into one forward."""

from __future__ import annotations

import json
import logging
import mmap
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from transformers import AutoConfig

from mlplat.engine import cpu, cpu_kernels, flex
from mlplat.engine.config import EngineConfig
from mlplat.engine.cuda_graph import DecodeGraphs
from mlplat.engine.lora import LoRAManager, enable_lora_
from mlplat.engine.model import AttentionMetadata, CausalLM, head_dim, hf_state_dict_to_engine
from mlplat.engine.quant import quantize_int8_
from mlplat.engine.sequence import Sequence
from mlplat.errors import CheckpointError
from mlplat.models.checkpoint import validate_checkpoint_dir

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def read_safetensors(model_dir: Path) -> Iterable[tuple[str, torch.Tensor]]:
    index = model_dir / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.is_file() else ["model.safetensors"]
    for file in files:
        if not (model_dir / file).is_file():
            raise CheckpointError(f"{model_dir}: the engine loads safetensors weights; {file} is missing")
        with safe_open(model_dir / file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


HUGE_PAGE = 2 * 2**20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on 2 MB pages where the OS gives them (Linux transparent huge pages on request).

    For the KV cache: decode attention reads blocks scattered over all of it, and on 4 KB pages almost
    every block costs TLB misses. Measured here, 32 decodes of a mixed workload: attention ~10% and
    the decode step 6-11% faster. Elsewhere (no madvise, THP off) the pages are whatever the OS gives."""
    if not hasattr(mmap, "MAP_PRIVATE"):  # Windows: no anonymous private mappings to ask for them
        return torch.zeros(shape, dtype=dtype)
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    buffer = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            buffer.madvise(mmap.MADV_HUGEPAGE)
        except OSError:  # THP compiled out: 4 KB pages
            pass
    raw = torch.frombuffer(buffer, dtype=torch.uint8)  # keeps a reference to the mapping: unmapped with the tensor
    start = -raw.data_ptr() % HUGE_PAGE  # 2 MB-aligned, so every huge page lies wholly inside the cache
    return raw[start : start + nbytes].view(dtype).view(shape).zero_()  # touched now: the memory is taken at start, as on a GPU


class ModelRunner:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        model_dir = validate_checkpoint_dir(cfg.model)
        self.hf_config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
        self.device = torch.device(cfg.device)
        self.dtype = DTYPES[cfg.dtype]
        self.max_model_len = cfg.max_model_len or self.hf_config.max_position_embeddings
        with torch.device(self.device):
            self.model = CausalLM(self.hf_config, self.max_model_len).to(self.dtype)
        # fp32 on CPU: matmuls run on oneDNN-packed copies of the weights (engine.cpu.PackedLinear).
        cpu_fp32 = self.device.type == "cpu" and self.dtype == torch.float32
        self.pack_weights = cfg.cpu_packed_weights and cpu_fp32 and cfg.quantization is None and cpu.can_pack_weights()
        if self.device.type == "cpu" and not self.pack_weights:
            cpu.store_linear_weights_input_major_(self.model)
        self.update_weights(read_safetensors(model_dir))
        if self.pack_weights:
            cpu.pack_linear_weights_(self.model)
        if cfg.quantization == "int8":
            quantize_int8_(self.model)
        self.model.eval()
        self.lora: LoRAManager | None = None  # cfg.lora: adapter slots wrapped around the projections, whatever linear is in place
        if cfg.lora is not None:
            context, modules = enable_lora_(self.model, cfg.lora, self.device, self.dtype)
            self.lora = LoRAManager(cfg.lora, context, modules, self.dtype)

        c = self.hf_config
        self.block_size = cfg.block_size
        head_size = head_dim(c)
        block_bytes = c.num_hidden_layers * 2 * cfg.block_size * c.num_key_value_heads * head_size * self.dtype.itemsize
        self.num_blocks = cfg.num_kv_blocks or max(1, int(cfg.kv_cache_memory_gb * 2**30) // block_bytes)
        # [layers, k/v, blocks, block_size, kv_heads, head_dim], allocated once. With FlexAttention one spare block past
        # those the block manager hands out, where the padding rows of a CUDA-graphed step write; there with or without
        # graphs, so that engines of one model compile FlexAttention for the same cache shape.
        spare = 1 if cfg.attention_backend == "flex" else 0
        shape = (c.num_hidden_layers, 2, self.num_blocks + spare, cfg.block_size, c.num_key_value_heads, head_size)
        if self.device.type == "cpu":
            self.kv_cache = zeros_on_huge_pages(shape, self.dtype)
        else:
            self.kv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.kv_caches = [(layer[0], layer[1]) for layer in self.kv_cache]
        self.gather_buffers: tuple[torch.Tensor, torch.Tensor] | None = None  # grown on demand, see AttentionMetadata
        self.use_cpu_kernels = cfg.cpu_kernels and cpu_fp32 and cpu_kernels.load()
        sdpa = cfg.attention_backend == "sdpa"  # else FlexAttention takes decodes too
        self.decode_kernel = self.use_cpu_kernels and sdpa and cpu_kernels.supports_decode_attention(head_size, c.num_attention_heads, c.num_key_value_heads)
        if self.use_cpu_kernels and sdpa and not self.decode_kernel:
            log.warning("no CPU attention kernel for head_dim %d with %d query heads per KV head; decodes use gather + SDPA",
                        head_size, c.num_attention_heads // c.num_key_value_heads)
        if self.use_cpu_kernels:
            cpu.use_cpu_kernels_(self.model, decode_attention=self.decode_kernel)
        if cfg.attention_backend == "flex":
            flex.use_flex_attention_(self.model, cfg.block_size, compile=self.device.type == "cuda")
        self.decode_graphs = None
        if cfg.cuda_graph_batch_sizes:
            assert cfg.attention_backend == "flex", "CUDA graphs replay FlexAttention's decode path (EngineConfig checks this)"
            # Capture needs CUDA; elsewhere (tests) the same static buffers run eagerly.
            self.decode_graphs = DecodeGraphs(self, cfg.cuda_graph_batch_sizes, capture=self.device.type == "cuda")

    @property
    def kv_layout(self) -> dict:
        num_layers, _, _, _, kv_heads, head_dim = self.kv_cache.shape
        return {"num_layers": num_layers, "num_kv_heads": kv_heads, "head_dim": head_dim, "dtype": str(self.dtype)}

    @torch.inference_mode()
    def update_weights(self, items: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Copy HF-named tensors into the live parameters in place (no reallocation, KV cache untouched)."""
        params = dict(self.model.named_parameters())
        modules = dict(self.model.named_modules())
        head, tied = self.model.lm_head, self.hf_config.tie_word_embeddings
        loaded = 0
        for name, tensor in hf_state_dict_to_engine(items, self.hf_config):
            module_name, _, attr = name.rpartition(".")
            module = modules.get(module_name)
            if attr == "weight" and hasattr(module, "load_weight"):  # swapped in (packed, int8): it keeps its own form
                try:
                    module.load_weight(tensor.to(self.device))
                except ValueError as err:
                    raise CheckpointError(f"weight {name!r}: {err}") from None
            elif name in params:
                if params[name].shape != tensor.shape:
                    raise CheckpointError(f"weight {name!r}: shape {tuple(tensor.shape)} != {tuple(params[name].shape)}")
                params[name].copy_(tensor)
            else:
                raise CheckpointError(f"unexpected weight {name!r} for model_type {self.hf_config.model_type!r}")
            if name == "embed_tokens.weight" and tied and hasattr(head, "load_weight"):
                head.load_weight(tensor.to(self.device))  # a swapped-in head tied to the embedding holds its own copy
            loaded += 1
        return loaded

    def prepare(self, batch: list[tuple[Sequence, int]], num_logits: list[int] | None = None):
        """Flatten (sequence, number of new tokens) pairs into the model's step inputs.

        Decodes (one new token) go first, longest context first, so attention batches them in
        groups of similar length; logits come back in ``batch`` order. ``num_logits[i]``: how many
        of sequence i's last new tokens need logits (default 1)."""
        decodes = sorted((i for i, (_, n) in enumerate(batch) if n == 1), key=lambda i: -len(batch[i][0]))
        order = decodes + [i for i, (_, n) in enumerate(batch) if n != 1]
        input_ids, positions, slots, query_lens, context_lens, tables, ends = [], [], [], [], [], [], {}
        lora_slots = []  # each new token's adapter slot (-1: base model)
        bs = self.block_size
        max_blocks = max(len(seq.block_table) for seq, _ in batch)
        for i in order:
            seq, n = batch[i]
            start = seq.num_computed_tokens
            table = seq.block_table
            input_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [table[p // bs] * bs + p % bs for p in range(start, start + n)]
            query_lens.append(n)
            context_lens.append(start + n)
            tables.append(table + [0] * (max_blocks - len(table)))
            ends[i] = len(input_ids)
            if self.lora is not None:
                lora_slots += [seq.lora_slot] * n
        logits_indices = []
        for i in range(len(batch)):
            logits_indices += range(ends[i] - (num_logits[i] if num_logits else 1), ends[i])
        as_tensor = lambda x: torch.tensor(x, dtype=torch.long, device=self.device)  # noqa: E731
        if self.lora is not None:
            self.lora.context.set_step(lora_slots)
        meta = self.attention_metadata(as_tensor(slots), query_lens, as_tensor(context_lens), as_tensor(tables))
        return as_tensor(input_ids), as_tensor(positions), meta, as_tensor(logits_indices)

    def attention_metadata(self, slot_mapping, query_lens: list[int], context_lens, block_tables) -> AttentionMetadata:
        if self.cfg.attention_backend == "flex":
            c = self.hf_config
            return flex.FlexAttentionMetadata(slot_mapping, query_lens, context_lens, block_tables, self.block_size,
                                              num_kv_blocks=self.kv_cache.shape[2], group=c.num_attention_heads // c.num_key_value_heads)
        return AttentionMetadata(
            slot_mapping=slot_mapping,
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=block_tables,
            block_size=self.block_size,
            decode_kernel=self.decode_kernel,
        )

    @torch.inference_mode()
    def run(self, batch: list[tuple[Sequence, int]], num_logits: list[int] | None = None) -> torch.Tensor:
        """Logits [sum(num_logits), V] at each sequence's last ``num_logits[i]`` new tokens (default 1)."""
        if self.decode_graphs is not None and self.decode_graphs.fits(batch, num_logits):
            return self.decode_graphs.run(batch)
        input_ids, positions, meta, logits_indices = self.prepare(batch, num_logits)
        if meta.max_decode_gather:
            if self.gather_buffers is None or self.gather_buffers[0].shape[0] < meta.max_decode_gather:
                shape = (meta.max_decode_gather * 5 // 4, *self.kv_cache.shape[3:])  # headroom: contexts grow
                self.gather_buffers = tuple(torch.empty(shape, dtype=self.dtype, device=self.device) for _ in range(2))
            meta.gather_buffers = self.gather_buffers
        return self.model(input_ids, positions, self.kv_caches, meta, logits_indices)

    def _slots(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        bs = self.block_size
        return torch.tensor([block_table[p // bs] * bs + p % bs for p in range(num_tokens)], device=self.device)

    def read_kv(self, block_table: list[int], num_tokens: int) -> torch.Tensor:
        """The first ``num_tokens`` tokens' KV, compact: [layers, 2, tokens, kv_heads, head_dim]."""
        return self.kv_cache.flatten(2, 3).index_select(2, self._slots(block_table, num_tokens))

    def write_kv(self, block_table: list[int], kv: torch.Tensor) -> None:
        self.kv_cache.flatten(2, 3)[:, :, self._slots(block_table, kv.shape[2])] = kv.to(self.device, self.dtype)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) block's KV, every layer (copy-on-write of a block that samples share)."""
        if pairs:
            src, dst = (torch.tensor(ids, device=self.device) for ids in zip(*pairs))
            self.kv_cache[:, :, dst] = self.kv_cache.index_select(2, src)
