"""Memory checks for training steps: the largest vocabulary-sized tensor a step creates.

A full-vocabulary logit tensor for the whole batch ([B, L, V] in fp32) is the first thing that
runs a real model out of memory in post-training (64 completions x 1k tokens x 152k vocabulary
is ~40 GB). ``VocabTensorWatch`` records, under a ``TorchDispatchMode``, every tensor an
operation returns that has a dimension of the vocabulary's size, so a test or a benchmark can
say how many rows of logits it held at most (forward and backward alike). The vocabulary-by-hidden
matrices (the embedding and head weight, its gradient, optimizer state, their transposes) are
parameters, not logits, and are left out.

``estimate_step_memory`` is the analytical side: the peak bytes per rank of a training step under FSDP2 with
activation checkpointing and the chunked head, from the model's shape, the world size, the dtypes, the micro-batch,
the head's chunk, a reference model and a colocated rollout engine (``benchmarks/posttrain_memory.py`` measures
it against real steps; ``gpu_recipe_setup`` describes the recipes on GPUs).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from mlplat.models.shapes import ModelShape


class VocabTensorWatch(TorchDispatchMode):
    """Records the largest tensor with a vocabulary-sized dimension that any op returns, in rows of the vocabulary."""

    def __init__(self, vocab_size: int, hidden_size: int):
        super().__init__()
        self.vocab_size = vocab_size
        self.parameter_shapes = {(vocab_size, hidden_size), (hidden_size, vocab_size), (vocab_size,)}
        self.largest_rows = 0  # elements / vocab_size of the largest such tensor
        self.largest_shape: tuple[int, ...] = ()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for value in tree_flatten(out)[0]:
            if not isinstance(value, torch.Tensor) or self.vocab_size not in value.shape or tuple(value.shape) in self.parameter_shapes:
                continue
            rows = value.numel() // self.vocab_size
            if rows > self.largest_rows:
                self.largest_rows, self.largest_shape = rows, tuple(value.shape)
        return out


# -- the analytical estimate of a step's peak memory per rank -------------------------------------------------------------
#
# Where a step's memory goes, per rank, under FSDP2 (``mlplat.train.parallel.apply_fsdp``: one unit per decoder layer,
# then the root holding the embeddings, final norm and head) with the chunked log-prob head (``mlplat.train.logprobs``).
#
# Held for the whole step:
#   - the sharded master weights (N x master_bytes / world) and AdamW's two states (N x 8 / world; the first optimizer
#     step allocates them, so they are held from the second step on: the steady state this estimates);
#   - a frozen reference sharded like the policy (N x reference_bytes / world) and, once it has run a forward, its root
#     and last layer gathered: FSDP2 does not reshard the root after forward (it expects a backward), apply_fsdp keeps
#     the last layer gathered, and a no-grad model never runs the backward that would reshard them;
#   - a colocated rollout engine's weights (one full copy) and its KV cache.
# On top of that, the largest of these moments of the step (the peak is one of them, not their sum):
#   - head_backward, the first thing backward does: the policy's root and last layer gathered (they stay gathered from
#     forward to backward) with the head's unsharded weight gradient, the saved activations (every layer's input under
#     activation checkpointing, else every layer's activations), and one chunk of the head recomputed:
#     max(5 fp32 [chunk, vocab] logit tensors (the log-softmax input it saves, x - logsumexp, its exp, the gradient,
#     the gather's scatter into zeros), 2 of them + the chunk's head-weight gradient [vocab, hidden] before it is added
#     into the unsharded one); no sharded gradients yet (zero_grad(set_to_none) freed them);
#   - layer_backward: the saved activations, one layer recomputed and its activation gradients, two layers gathered
#     (this one and the prefetched next), this layer's unsharded gradient and reduce-scatter's flat copy of it (in the
#     reduce dtype), the root and its gradient, the sharded gradients of the layers after it (at most all but the root's);
#   - embedding_backward, the last op of backward: the sharded gradients of every layer, the root gathered with its
#     unsharded gradient, the embedding's dense [vocab, hidden] gradient and, for a tied embedding, the out-of-place
#     sum autograd accumulates it into (a third vocab x hidden tensor, for a moment);
#   - root_reduce_scatter: the root resharded, its unsharded gradient, reduce-scatter's flat copy of it (in the reduce
#     dtype), its sharded gradient, and the other sharded gradients;
#   - optimizer_step: every sharded gradient and the single-tensor AdamW's temporaries (CPU has no foreach kernels:
#     two tensors the size of the largest parameter shard, the embedding's).
# Every all-gather and reduce-scatter on gloo also stages a full-size copy of its output (all-gather) or input
# (reduce-scatter): ``collective_copies`` = 1 for gloo, 0 for NCCL, which works in place.
# GRPO's no-grad scoring with the entropy holds 3 chunks of logits at most: below the training step's 5.

LOGIT_COPIES_BACKWARD = 5  # fp32 [chunk, vocab] tensors alive at once in one head chunk's backward (see above)
LOGIT_COPIES_WITH_WEIGHT_GRAD = 2  # alive while the chunk's head-weight gradient is computed


@dataclass(frozen=True)
class MemorySetup:
    """What decides a training step's memory per rank (bytes per element in the ``*_bytes`` fields)."""

    shape: ModelShape
    world_size: int
    rows: int  # micro-batch rows per rank (DPO: chosen + rejected)
    tokens: int  # tokens per row
    labelled_tokens: int | None = None  # target positions per micro-batch (the head's work); None: rows x tokens
    master_bytes: int = 4  # sharded parameters: fp32 master weights
    grad_bytes: int = 4  # sharded gradients (FSDP2's reduce dtype)
    optimizer_bytes: int = 8  # AdamW's exp_avg and exp_avg_sq, fp32
    compute_bytes: int = 4  # gathered parameters, their unsharded gradients and activations (bf16: 2)
    activation_checkpointing: bool = True
    chunk_tokens: int = 1024  # the log-prob head's chunk (mlplat.train.logprobs)
    reference: Literal["sharded", "replicated"] | None = None  # a frozen reference model (DPO, GRPO with beta > 0)
    reference_bytes: int = 4  # its stored parameters (load_model's default: fp32)
    engine_weight_bytes: int = 0  # a colocated rollout engine's weights, one copy (0: no engine)
    engine_kv_tokens: int = 0  # token slots its KV cache holds
    engine_kv_bytes: int = 2
    collective_copies: int = 0  # full-size staging copies a collective makes: gloo 1, NCCL 0


@dataclass
class MemoryEstimate:
    terms: dict[str, int]  # bytes: the held terms, then the peak moment's terms
    moment: str  # the moment of the step that peaks
    moments: dict[str, int]  # each moment's bytes on top of the held terms
    moment_terms: dict[str, dict[str, int]]  # each moment's terms

    @property
    def total(self) -> int:
        return sum(self.terms.values())


def layer_parameters(shape: ModelShape) -> int:
    """One decoder layer's weights and biases."""
    h, kv = shape.hidden_size, shape.num_key_value_heads * shape.head_dim
    return 2 * h * h + 2 * h * kv + h + 2 * kv + 3 * h * shape.intermediate_size + 2 * h


def root_parameters(shape: ModelShape) -> int:
    """FSDP2's root unit: the embedding, the head when it is not tied, the final norm."""
    return shape.vocab_size * shape.hidden_size * (1 if shape.tie_word_embeddings else 2) + shape.hidden_size


def layer_activations_per_token(shape: ModelShape) -> int:
    """Elements one Qwen2 decoder layer keeps for backward per token (HF's modules, SDPA attention with a flash
    kernel: no [L, L] scores): each RMSNorm its input and output (2 x 2h), the q/k/v projections' outputs (h + 2kv),
    RoPE's rotate_half copies and outputs of q and k (2 x (h + kv)), the attention output (h), the MLP's gate and up
    outputs, SiLU's output and the product (4I)."""
    h, kv, i = shape.hidden_size, shape.num_key_value_heads * shape.head_dim, shape.intermediate_size
    return 4 * h + (h + 2 * kv) + 2 * (h + kv) + h + 4 * i


def engine_kv_bytes_per_token(shape: ModelShape, dtype_bytes: int) -> int:
    return shape.num_hidden_layers * 2 * shape.num_key_value_heads * shape.head_dim * dtype_bytes


def estimate_step_memory(setup: MemorySetup) -> MemoryEstimate:
    """Peak bytes per rank of a steady-state FSDP2 training step: the held terms plus the largest moment (see above)."""
    s, w, c, g = setup.shape, setup.world_size, setup.compute_bytes, setup.grad_bytes
    n = s.num_parameters()
    tokens = setup.rows * setup.tokens
    root, layer = root_parameters(s), layer_parameters(s)
    vocab_by_hidden = s.vocab_size * s.hidden_size
    staging = setup.collective_copies
    held = {"params_shard": n * setup.master_bytes // w, "optimizer_shard": n * setup.optimizer_bytes // w}
    if setup.reference == "sharded":
        held["reference_shard"] = n * setup.reference_bytes // w
        held["reference_root_and_last_layer_gathered"] = (root + layer) * c
    elif setup.reference == "replicated":
        held["reference_replica"] = n * setup.reference_bytes
    if setup.engine_weight_bytes:
        held["engine_weights"] = n * setup.engine_weight_bytes
        held["engine_kv_cache"] = setup.engine_kv_tokens * engine_kv_bytes_per_token(s, setup.engine_kv_bytes)

    layer_grads = (n - root) * g // w  # every sharded gradient but the root's
    per_token_layer = layer_activations_per_token(s) * c
    if setup.activation_checkpointing:
        saved = s.num_hidden_layers * tokens * s.hidden_size * c  # each layer's input
        recompute = 2 * tokens * per_token_layer  # one layer's activations and their gradients
    else:
        saved, recompute = s.num_hidden_layers * tokens * per_token_layer, tokens * per_token_layer
    saved += 3 * tokens * s.hidden_size * c  # the final norm's input and output, the head's input
    chunk_rows = min(setup.chunk_tokens, setup.labelled_tokens if setup.labelled_tokens is not None else tokens)
    chunk = chunk_rows * s.vocab_size * 4
    head_chunk = max(LOGIT_COPIES_BACKWARD * chunk, LOGIT_COPIES_WITH_WEIGHT_GRAD * chunk + vocab_by_hidden * c)
    if c != 4:  # bf16 compute: the head's output and the gradient cast back for its matmul are one more copy, in bf16
        head_chunk += chunk_rows * s.vocab_size * c
    root_gathered = {"root_gathered": root * c, "root_unsharded_grad": root * c}
    moments = {
        "head_backward": {**root_gathered, "layers_gathered": 2 * layer * c, "saved_activations": saved, "logit_chunk": head_chunk},
        "layer_backward": {
            **root_gathered, "layers_gathered": (2 + staging) * layer * c,
            "layer_unsharded_grad_and_reduce_scatter_copies": layer * c + (1 + staging) * layer * g,
            "saved_activations": saved, "layer_recompute": recompute, "grads_shard": layer_grads,
        },
        "embedding_backward": {
            **root_gathered, "tied_embedding_grad_and_sum": vocab_by_hidden * c * (2 if s.tie_word_embeddings else 0), "grads_shard": layer_grads,
        },
        "root_reduce_scatter": {
            "root_unsharded_grad": root * c, "root_reduce_scatter_copies": (1 + staging) * root * g, "grads_shard": layer_grads + root * g // w,
        },
        "optimizer_step": {"grads_shard": n * g // w, "adamw_temporaries": 2 * vocab_by_hidden * 4 // w},
    }  # fmt: skip
    totals = {name: sum(parts.values()) for name, parts in moments.items()}
    peak = max(totals, key=totals.get)
    return MemoryEstimate(terms={**held, **moments[peak]}, moment=peak, moments=totals, moment_terms=moments)


def gpu_recipe_setup(shape: ModelShape, recipe: Literal["sft", "dpo", "grpo"], world_size: int = 8, rows: int = 1, tokens: int = 4096,
                     chunk_tokens: int = 1024, rollout_sequences: int = 32, rollout_tokens: int = 2048) -> MemorySetup:  # fmt: skip
    """A recipe's step on GPUs as the recipes run it there: FSDP2 over NCCL with bf16 compute (gathered weights,
    activations) and fp32 master weights, gradients and AdamW state sharded over ``world_size``; activation
    checkpointing; DPO and GRPO with the reference sharded like the policy; GRPO with a colocated bf16 rollout
    engine on every GPU holding the whole model and a KV cache for ``rollout_sequences x rollout_tokens``."""
    grpo = recipe == "grpo"
    return MemorySetup(
        shape=shape, world_size=world_size, rows=rows, tokens=tokens, compute_bytes=2, activation_checkpointing=True,
        chunk_tokens=chunk_tokens, reference="sharded" if recipe in ("dpo", "grpo") else None, engine_weight_bytes=2 if grpo else 0,
        engine_kv_tokens=rollout_sequences * rollout_tokens if grpo else 0, engine_kv_bytes=2, collective_copies=0,
    )  # fmt: skip
