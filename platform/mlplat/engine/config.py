"""The engine's one typed config."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, model_validator

from mlplat.config import Config


class SpeculativeConfig(Config):
    method: Literal["ngram", "draft_model"]
    num_speculative_tokens: int = Field(4, ge=1)
    ngram_max: int = Field(3, ge=1)  # prompt lookup: longest suffix n-gram to match
    ngram_min: int = Field(1, ge=1)
    draft_model: str | None = None  # HF checkpoint sharing the target's tokenizer


class StructuredLimits(Config):
    """Per-request limits on structured outputs (engine.structured); exceeding one is a ValueError naming it (a 400)."""

    max_grammar_bytes: int = Field(65536, ge=1)  # the schema / regex / grammar / choices as JSON text
    compile_timeout_s: float = Field(10.0, gt=0)  # a grammar still compiling after this fails its request
    max_cached_grammars: int = Field(256, ge=1)


class MultiLoRAConfig(Config):
    """Many LoRA adapters on one base model (engine.lora); the names are vLLM's and Ray Serve LLM's."""

    max_loras: int = Field(4, ge=1)  # adapters resident per replica (device slots, LRU): a batch mixes up to this many
    max_lora_rank: int = Field(16, ge=1)  # the largest adapter rank accepted; every slot is sized for it
    # adapters kept read in host memory (LRU; one evicted there is read from its directory again); None: max_loras
    max_cpu_loras: int | None = Field(None, ge=1)
    # served name -> peft adapter directory (the serve app also takes models:/NAME@ALIAS and resolves it); read on first use
    adapters: dict[str, str] = {}

    @model_validator(mode="after")
    def _cpu_at_least_device(self):
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) < max_loras ({self.max_loras}): the host keeps at least as "
                             "many adapters as the device (vLLM's rule); raise max_cpu_loras or leave it unset")
        return self


class KVTiersConfig(Config):
    """A second (and third) tier for the prefix cache (engine.kv_tiers): blocks evicted from the KV pool are kept in host
    memory, and what falls out of host memory on local disk, keyed by the same chained block hash; a prompt whose prefix
    is found there loads those blocks instead of recomputing them (LMCache's and Mooncake's offloading, in one process).
    Sizes are in bytes; each tier must hold at least one block (checked when the engine starts, once a block's size is known)."""

    host_bytes: int = Field(gt=0)  # host-memory tier, allocated at start (pinned on CUDA)
    # local-disk tier: the engine writes under a directory of its own inside this one (removed when it exits); None: no disk tier
    disk_path: Path | None = None
    disk_bytes: int = Field(0, ge=0)  # the disk tier's bound (block files, with their headers)

    @model_validator(mode="after")
    def _disk_has_a_size(self):
        if self.disk_path is not None and self.disk_bytes == 0:
            raise ValueError(f"kv_tiers.disk_path is {str(self.disk_path)!r} but kv_tiers.disk_bytes is 0: set disk_bytes to the "
                             "disk tier's size in bytes, or remove disk_path")
        if self.disk_path is None and self.disk_bytes:
            raise ValueError("kv_tiers.disk_bytes is set without kv_tiers.disk_path: set disk_path to a local directory")
        return self


class EngineConfig(Config):
    model: str  # local HF checkpoint directory (resolve models:/ URIs before building)
    device: str = "cpu"  # "cuda" on a GPU; the same code runs on both
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    block_size: int = Field(16, ge=1)  # tokens per KV block
    num_kv_blocks: int | None = Field(None, ge=1)  # None: as many as kv_cache_memory_gb holds
    kv_cache_memory_gb: float = Field(1.0, gt=0)
    max_num_seqs: int = Field(64, ge=1)  # sequences decoded together
    max_num_batched_tokens: int = Field(2048, ge=1)  # token budget per step (prefill chunks + decodes)
    max_waiting: int = Field(1024, ge=0)  # bounded queue: beyond it, add_request is refused
    # Prompts prefilling at once (each chunked within the token budget); None: as many as the budget admits. 1 prefills one
    # prompt at a time, as a prefill replica did before batched prefill (benchmarks/serving.py's baseline).
    max_num_prefills: int | None = Field(None, ge=1)
    max_model_len: int | None = None  # default: the checkpoint's max_position_embeddings
    enable_prefix_caching: bool = True
    quantization: Literal["int8"] | None = None  # int8: weight-only, per-output-channel scales
    # CPU fp32: each linear runs on two oneDNN-packed copies of its weight instead of the plain one, one
    # for batches (1.3-2x faster at 8-32 rows) and one for a single row (~1.3x); costs a second copy of
    # the weights in memory. False: one copy, MKL only.
    cpu_packed_weights: bool = True
    # CPU fp32: decode attention through a C++ kernel that reads the paged KV cache in place, and RMSNorm (with
    # the skip connection's add), SwiGLU's activation and RoPE in C++ (built on first use, ~20 s once, cached; see
    # engine.cpu_kernels). False, or where they cannot be built: gather + SDPA and ATen's ops.
    cpu_kernels: bool = True
    speculative: SpeculativeConfig | None = None
    # The most top log-probs a request may ask for per token (top_logprobs, prompt_logprobs), as vLLM's max_logprobs
    max_logprobs: int = Field(20, ge=0)
    structured_outputs: StructuredLimits = StructuredLimits()  # per-request limits on grammars (engine.structured)
    # "flex": attention reads the paged KV cache in place through FlexAttention with a block mask over the page
    # table (engine.flex; compiled kernels on CUDA, an eager reference on CPU). "sdpa": gather + SDPA, and on
    # CPU in fp32 the C++ decode kernel.
    attention_backend: Literal["sdpa", "flex"] = "sdpa"
    # CUDA only, with attention_backend "flex": a decode-only step of up to max(sizes) sequences is padded to the
    # next of these batch sizes and replayed from a CUDA graph captured at start-up (engine.cuda_graph). [] = eager.
    cuda_graph_batch_sizes: list[int] = []
    lora: MultiLoRAConfig | None = None  # serve LoRA adapters (requests name one in SamplingParams.lora_name); None: off
    kv_tiers: KVTiersConfig | None = None  # host-memory (and disk) tiers below the prefix cache (engine.kv_tiers); None: pool only

    @model_validator(mode="after")
    def _tiers_extend_the_prefix_cache(self):
        if self.kv_tiers is not None and not self.enable_prefix_caching:
            raise ValueError("kv_tiers extends the prefix cache, which enable_prefix_caching: false turns off: "
                             "set enable_prefix_caching: true, or remove kv_tiers")
        return self

    @model_validator(mode="after")
    def _check_gpu_paths(self):
        cuda = self.device.startswith("cuda")
        if cuda and self.attention_backend == "flex" and self.block_size % 16:
            raise ValueError(f"attention_backend 'flex' on CUDA needs block_size a multiple of 16 (its kernels' smallest KV tile), "
                             f"got {self.block_size}: set block_size: 16, or attention_backend: sdpa")
        sizes = self.cuda_graph_batch_sizes
        if sizes and self.lora is not None:
            raise ValueError("lora: the adapters' per-step slot indices are not captured by CUDA graphs: "
                             "set cuda_graph_batch_sizes: [] to serve adapters")
        if not sizes:
            return self
        if any(s < 1 for s in sizes):
            raise ValueError(f"cuda_graph_batch_sizes must be positive, got {sizes}")
        if not cuda:
            raise ValueError(f"cuda_graph_batch_sizes needs device 'cuda' (got device {self.device!r}): set device: cuda, or cuda_graph_batch_sizes: []")
        if self.attention_backend != "flex":
            raise ValueError("cuda_graph_batch_sizes needs attention_backend 'flex' (the sdpa path plans each step on the host, "
                             "which a graph cannot replay): set attention_backend: flex, or cuda_graph_batch_sizes: []")
        return self
