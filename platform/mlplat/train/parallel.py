"""Parallelisms for training, applied to a plain HF model by small functions in a fixed order.

torchtitan style: the model code stays single-device; ``parallelize`` wraps it in place:
1. activation checkpointing, per decoder layer (``model.model.layers``);
2. data parallel: DDP (a full replica per rank) or FSDP2 (``fully_shard``: parameters,
   gradients and optimizer state sharded over ranks, gathered one layer at a time).

Checkpoints of training state use torch.distributed.checkpoint (DCP): every rank writes
only its own shard, named by rank (``__{rank}_{n}.distcp``), and rank 0 adds the
``.metadata`` index, so per-rank directories merged into one (as Ray Train does with
each worker's checkpoint directory) load as a whole. ``full_state_dict`` gathers plain
CPU tensors for an HF export.
"""

from __future__ import annotations

import contextlib
import pickle
import re
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointImpl, checkpoint_wrapper
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from torch.nn.parallel import DistributedDataParallel

from mlplat import collectives
from mlplat.config import Config

if TYPE_CHECKING:
    from transformers import PreTrainedModel

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
_EXTRA_KEY = "extra"  # in a DCP checkpoint: the caller's extra state, pickled as one blob


class ParallelConfig(Config):
    strategy: Literal["ddp", "fsdp"] = "ddp"  # fsdp: FSDP2 (torch.distributed.fsdp.fully_shard)
    activation_checkpointing: bool = False  # recompute each decoder layer in backward: memory for ~1/3 more compute
    # FSDP2 mixed precision, GPU only: parameters are gathered and computed in param_dtype,
    # gradients reduced in reduce_dtype; the sharded master weights and optimizer stay fp32.
    param_dtype: Literal["float32", "bfloat16"] = "bfloat16"
    reduce_dtype: Literal["float32", "bfloat16"] = "float32"


def decoder_layers(model: PreTrainedModel) -> torch.nn.ModuleList:
    """The transformer blocks of an HF Llama-family causal LM (``model.model.layers``), under LoRA too."""
    if hasattr(model, "get_base_model"):  # a peft PeftModel
        model = model.get_base_model()
    layers = getattr(getattr(model, "model", None), "layers", None)
    if not isinstance(layers, torch.nn.ModuleList):
        raise TypeError(f"{type(model).__name__}: expected decoder layers at model.model.layers (Llama / Qwen2 / Mistral family)")
    return layers


def apply_activation_checkpointing(model: PreTrainedModel) -> None:
    """Wrap each decoder layer so its activations are recomputed in backward instead of kept.

    The non-reentrant implementation supports keyword arguments (HF layers take all but
    the hidden states as keywords) and composes with FSDP2, whose hooks stay outside the
    wrapper. The wrapper strips its own prefix from parameter names and state dicts, so
    HF names and checkpoints are unchanged.
    """
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, checkpoint_impl=CheckpointImpl.NO_REENTRANT, preserve_rng_state=False)
    model.register_forward_pre_hook(_no_kv_cache_with_grad, with_kwargs=True)


def _no_kv_cache_with_grad(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    # HF models build a KV cache in every forward unless told not to (config.use_cache), and
    # each layer appends its keys and values to it: the recompute in backward would append a
    # second time (shape errors), and the cache would keep every layer's K/V alive, undoing
    # the memory saving. Generation (no grad) keeps its cache. Not keyed on module.training:
    # from_pretrained returns models in eval mode, and nothing needs them in train mode.
    if torch.is_grad_enabled():
        kwargs["use_cache"] = False
    return args, kwargs


def apply_ddp(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    model = model.to(device)
    if collectives.world_size() == 1:
        return model
    return DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" and device.index is not None else None)


def apply_fsdp(model: PreTrainedModel, cfg: ParallelConfig, device: torch.device) -> PreTrainedModel:
    """Shard each decoder layer, then the root (embeddings, final norm, LM head), in place.

    One unit per layer is what lets FSDP2 gather a layer's parameters just before it runs
    and free them after, overlapping the all-gather of layer i+1 with the compute of layer
    i. Tied embeddings stay correct because both uses belong to the root unit.
    """
    if not collectives.active():
        raise RuntimeError("strategy 'fsdp' needs an initialised process group (Ray Train sets one up per worker)")
    # The model arrives fully materialised on CPU: moving it to the device first costs one
    # full copy per rank for a moment. Models too large for that need meta-device init and
    # a sharded load instead (load_sharded, or set_model_state_dict with broadcast_from_rank0).
    model.to(device)
    mesh = init_device_mesh(device.type, (collectives.world_size(),))
    # Mixed precision on GPU only: CPU runs are tests and tiny models, where fp32 keeps
    # them bit-comparable with single-process references; CPUs without bf16 matmul units
    # run bf16 slower than fp32, and gloo's support for bf16 collectives is patchy.
    mp = MixedPrecisionPolicy(DTYPES[cfg.param_dtype], DTYPES[cfg.reduce_dtype]) if device.type == "cuda" else MixedPrecisionPolicy()
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again at once by backward: keep them gathered.
        fully_shard(layer, mesh=mesh, mp_policy=mp, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp)
    return model


def parallelize(model: PreTrainedModel, cfg: ParallelConfig, device: torch.device) -> torch.nn.Module:
    """Apply activation checkpointing, then data parallelism; returns the module to train.

    Build the optimizer from the returned module (under FSDP2 its parameters are the
    sharded DTensors). Without a process group (or with one rank) DDP is a no-op.
    """
    if cfg.activation_checkpointing:
        apply_activation_checkpointing(model)
    if cfg.strategy == "fsdp":
        return apply_fsdp(model, cfg, device)
    return apply_ddp(model, device)


def unwrap(model: torch.nn.Module) -> PreTrainedModel:
    """The HF model under a DDP wrapper (FSDP2 shards in place: the module is the model)."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def save_sharded(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer, extra: dict | None = None) -> None:
    """Write model and optimizer state with DCP; every rank calls it, each writes its own shards.

    ``directory`` may be the same on every rank or a rank-local one: file names carry the
    rank and rank 0 writes ``.metadata``, so the per-rank directories merge without clashes.
    Replicated values (all of DDP's state, ``extra``) are written once, by whichever rank
    DCP picks to balance the load, so a load needs every rank's files. ``extra`` (scheduler
    state, step: anything picklable, the same on every rank) comes back from ``load_sharded``.
    """
    model_state, optim_state = get_state_dict(unwrap(model), optimizer)
    # Pickled as one blob: DCP would flatten a nested dict into keys that a load must know in advance.
    state = {"model": model_state, "optimizer": optim_state, _EXTRA_KEY: pickle.dumps(extra or {})}
    with _single_process_is_intended():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(directory), no_dist=not collectives.active())


def load_sharded(directory: Path, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load ``save_sharded`` state into ``model`` and ``optimizer`` in place; returns ``extra``.

    Every rank calls it. DCP reshards on load: the checkpoint may come from FSDP or DDP,
    and the model may be FSDP (any world size), DDP or a single process. Only
    the keys the optimizer already has are loaded, so build the LR scheduler first (it adds
    ``initial_lr`` to the parameter groups) and then load its state from ``extra``.
    """
    model_state, optim_state = get_state_dict(unwrap(model), optimizer)
    state = {"model": model_state, "optimizer": optim_state, _EXTRA_KEY: b""}
    with _single_process_is_intended():
        dcp.load(state, storage_reader=dcp.FileSystemReader(directory), no_dist=not collectives.active())
    set_state_dict(unwrap(model), optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
    return pickle.loads(state[_EXTRA_KEY])


@contextlib.contextmanager
def _single_process_is_intended():
    # DCP warns on every save/load without a process group, even when asked for no_dist.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def full_weights_by_layer(model: torch.nn.Module, every_rank: bool = False) -> Iterator[dict[str, torch.Tensor]]:
    """The whole model as plain CPU tensors under HF names, one decoder layer at a time, then the rest.

    For streaming weights to inference engines without a full copy anywhere: rank 0 gets each
    layer's tensors (LoRA adapters merged into their base weights), other ranks an empty dict per
    layer unless ``every_rank``. Collective under FSDP2 (one all-gather per tensor): every rank
    iterates it to the end.
    """
    from mlplat.train.lora import is_lora, lora_scaling, merge_lora_state_dict

    module, rank = unwrap(model), collectives.rank()
    state = module.state_dict()  # under FSDP2: this rank's shards, nothing gathered yet
    groups: dict[str, list[str]] = {}
    for key in state:
        layer = _LAYER_KEY.match(key)
        groups.setdefault(layer.group(0) if layer else "", []).append(key)
    scaling = lora_scaling(module) if is_lora(module) else None
    for prefix in sorted(groups, key=lambda p: (p == "", int(_LAYER_KEY.match(p).group(1)) if p else 0)):
        bucket = {}
        for key in groups[prefix]:
            tensor = state[key].full_tensor() if isinstance(state[key], DTensor) else state[key]
            if rank == 0 or every_rank:
                bucket[key] = tensor.detach().to("cpu", copy=True)
        yield merge_lora_state_dict(bucket, scaling) if scaling is not None and bucket else bucket


_LAYER_KEY = re.compile(r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.")


def full_state_dict(model: torch.nn.Module) -> dict[str, torch.Tensor] | None:
    """The whole model as plain CPU tensors under HF names, on rank 0; None on other ranks.

    Collective under FSDP2 (every rank must call it). For an HF export on rank 0:
    ``unwrap(model).save_pretrained(path, state_dict=full_state_dict(model))``.
    """
    state = get_model_state_dict(unwrap(model), options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if collectives.rank() == 0 else None
