"""Training checkpoints: model + optimizer + scheduler + RNG + data position, and HF export.

A checkpoint directory holds, by ``format``:

- ``sharded``: ``sharded/`` is a torch.distributed.checkpoint (DCP) of model and
  optimizer, every rank writing its own shard (no gather, the only option at scale);
  it loads onto the same or another world size.
- ``consolidated``: ``full_state.pt`` holds the full model and optimizer state, written
  by rank 0 (a gather: fine for small models, one portable file).

and in both ``train_state.pt`` (rank 0: step, data position, scheduler, RNG),
``checkpoint.json`` (what the weights apply to: base model, LoRA config, format; read
by ``export_checkpoint``, i.e. ``mlplat model export``) and, when asked, ``model/``: a plain HF checkpoint (safetensors + tokenizer) that serving
and ``mlplat eval`` load as-is. Each rank writes into its own local directory and Ray
Train merges them into one checkpoint (file names never collide across ranks).
"""

from __future__ import annotations

import io
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import torch
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)

from mlplat import collectives
from mlplat.data.loader import DataPosition
from mlplat.errors import CheckpointError
from mlplat.train.lora import is_lora, merge_and_export, save_adapter_from_state
from mlplat.train.parallel import full_state_dict, load_sharded, save_sharded, unwrap

if TYPE_CHECKING:
    from ray.train import Checkpoint

CheckpointFormat = Literal["sharded", "consolidated"]
MODEL_DIR = "model"  # the HF export, servable as-is
ADAPTER_DIR = "adapter"  # beside it, with LoRA: the adapter alone (peft's files), servable by name on the base model
TRAIN_STATE = "train_state.pt"
FULL_STATE = "full_state.pt"
SHARDED_DIR = "sharded"
META = "checkpoint.json"


class CheckpointMeta(BaseModel):
    base_model: str  # the HF checkpoint directory training started from
    lora: dict | None = None  # the LoRAConfig, if adapters were trained
    format: CheckpointFormat


class TrainState(BaseModel):
    step: int = 0
    data: DataPosition = DataPosition()
    skipped_steps: int = 0  # steps skipped for a non-finite loss or gradient norm, in total
    bad_steps_in_row: int = 0


def save_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
    state: TrainState,
    meta: CheckpointMeta,
    tokenizer=None,
    export_hf: bool = False,
) -> None:
    """Write this rank's part of a checkpoint into ``directory``. Every rank must call it."""
    directory = Path(directory)
    if meta.format == "sharded":
        save_sharded(directory / SHARDED_DIR, model, optimizer)
    else:
        options = StateDictOptions(full_state_dict=True, cpu_offload=True)
        model_state, optim_state = get_state_dict(model, optimizer, options=options)
        if collectives.rank() == 0:
            torch.save({"model": model_state, "optimizer": optim_state}, directory / FULL_STATE)
    if export_hf:
        export_hf_model(directory / MODEL_DIR, model, tokenizer)
    if collectives.rank() == 0:
        torch.save(
            {"state": state.model_dump(), "scheduler": scheduler.state_dict(), "rng": torch.get_rng_state()},
            directory / TRAIN_STATE,
        )
        (directory / META).write_text(meta.model_dump_json(indent=2))


def load_checkpoint(
    directory: Path,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    scheduler: torch.optim.lr_scheduler.LRScheduler,
) -> TrainState:
    """Restore model, optimizer, scheduler and RNG in place (after ``parallelize``); return the train state."""
    directory = Path(directory)
    if (directory / SHARDED_DIR).is_dir():
        load_sharded(directory / SHARDED_DIR, model, optimizer)
    elif (directory / FULL_STATE).is_file():
        full = torch.load(directory / FULL_STATE, weights_only=True, map_location="cpu")
        set_state_dict(
            model, optimizer, model_state_dict=full["model"], optim_state_dict=full["optimizer"],
            options=StateDictOptions(full_state_dict=True),
        )  # fmt: skip
    else:
        raise FileNotFoundError(f"{directory} is not an mlplat training checkpoint: no {SHARDED_DIR}/ or {FULL_STATE}")
    saved = torch.load(directory / TRAIN_STATE, weights_only=True)
    scheduler.load_state_dict(saved["scheduler"])
    torch.set_rng_state(saved["rng"])
    return TrainState.model_validate(saved["state"])


def read_train_state(checkpoint: Checkpoint | str | Path) -> TrainState:
    """A checkpoint's train state alone (step, data position), read from wherever it is stored
    without fetching the weights: what a worker needs before its model is built."""
    if isinstance(checkpoint, (str, Path)):
        data = (Path(checkpoint) / TRAIN_STATE).read_bytes()
    else:
        with checkpoint.filesystem.open_input_file(f"{checkpoint.path}/{TRAIN_STATE}") as f:
            data = f.read()
    return TrainState.model_validate(torch.load(io.BytesIO(data), weights_only=True)["state"])


def export_hf_model(out_dir: Path, model: torch.nn.Module, tokenizer=None) -> None:
    """Save a plain HF checkpoint of ``model`` on rank 0 (a collective gather under FSDP)."""
    state = full_state_dict(model)
    if collectives.rank() != 0:
        return
    hf_model = unwrap(model)
    if is_lora(hf_model):  # LoRA: adapters merged into the base weights, a plain HF checkpoint
        merge_and_export(hf_model, out_dir, tokenizer, state_dict=state)
        save_adapter_from_state(hf_model, state, Path(out_dir).with_name(ADAPTER_DIR))
        return
    hf_model.save_pretrained(out_dir, state_dict=state, safe_serialization=True)
    if tokenizer is not None:
        tokenizer.save_pretrained(out_dir)


def export_checkpoint(directory: Path, out_dir: Path, base_model: str | None = None) -> Path:
    """Write a plain HF checkpoint (LoRA merged) from a training checkpoint, in one process.

    For checkpoints saved without ``model/`` (``checkpoint_hf: false``): DCP reshards the
    saved model state onto a single process, so any checkpoint exports on one CPU machine.
    """
    from mlplat.models import load_model, load_tokenizer
    from mlplat.train.lora import LoRAConfig, apply_lora

    directory = Path(directory)
    if not (directory / META).is_file():
        raise CheckpointError(f"{directory}: not an mlplat training checkpoint (no {META})")
    meta = CheckpointMeta.model_validate_json((directory / META).read_text())
    base = base_model or meta.base_model
    model = load_model(base)
    if meta.lora is not None:
        model = apply_lora(model, LoRAConfig.model_validate(meta.lora))
    if meta.format == "sharded":
        state = {"model": get_model_state_dict(model)}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # DCP warns whenever it runs without a process group
            dcp.load(state, storage_reader=dcp.FileSystemReader(directory / SHARDED_DIR), no_dist=True)
        set_model_state_dict(model, state["model"])
    else:
        full = torch.load(directory / FULL_STATE, weights_only=True, map_location="cpu")
        set_model_state_dict(model, full["model"], options=StateDictOptions(full_state_dict=True))
    export_hf_model(Path(out_dir), model, load_tokenizer(base))
    return Path(out_dir)
