"""The native inference engine: paged KV cache, continuous batching, prefix caching.

Files, in reading order: config, sampling, sequence, block_manager, scheduler,
model (Llama family over paged attention, plain), runner (weights + KV cache), engine
(the step: schedule -> run -> post-process); beside them: cpu (CPU kernels and weight
layouts, swapped into the model), quant (int8), spec_decode, kv_transfer (PD handoff),
kv_tiers (host and disk tiers below the prefix cache), structured (grammar-constrained
decoding with llguidance), flex (paged attention through
FlexAttention, swapped into the model), cuda_graph (decode steps replayed from CUDA graphs) and lora
(many LoRA adapters on one base model, applied batched: wrappers swapped around the projections).
"""

from mlplat.engine.config import EngineConfig
from mlplat.engine.engine import CompletionOutput, LLMEngine, RequestFailedError, RequestOutput
from mlplat.engine.sampling import SamplingParams
from mlplat.engine.scheduler import QueueFullError

__all__ = ["CompletionOutput", "EngineConfig", "LLMEngine", "QueueFullError", "RequestFailedError", "RequestOutput", "SamplingParams"]
