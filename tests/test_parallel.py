"""DDP, FSDP2, activation checkpointing and DCP checkpoints: 2 CPU ranks (gloo) against one process.

One run on the session's two rank processes (``local_group``) covers every distributed scenario
(starting ranks costs more than the tiny model's steps); the ranks write what they saw to files and the assertions run
here, in the test process, against a single-process reference on the whole batch.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
from transformers import AutoModelForCausalLM

from mlplat.config import validate
from mlplat.errors import ConfigError
from mlplat.models import load_model
from mlplat.train.batch import IGNORE_INDEX
from mlplat.train.logprobs import install_logprob_head
from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
from mlplat.train.parallel import ParallelConfig, full_state_dict, full_weights_by_layer, load_sharded, parallelize, save_sharded, unwrap
from mlplat.train.step import train_step

WORLD = 2
ROWS = 8  # global batch; each rank takes half
OPTIM = OptimizerConfig(lr=3e-3, warmup_steps=1, weight_decay=0.1, grad_clip=0.5)  # small clip: clipping is active
TOL = 1e-5  # losses and gradient norms, single process vs 2 ranks
WEIGHT_TOL = 1e-4  # ~lr / 30; see test_fsdp_and_ddp_train_like_one_process


def _batches(vocab_size: int, steps: int = 5, length: int = 20) -> list[dict[str, torch.Tensor]]:
    """Right-padded rows of uneven lengths, prompts masked: target counts differ across ranks."""
    gen = torch.Generator().manual_seed(0)
    batches = []
    for _ in range(steps):
        input_ids = torch.randint(3, vocab_size, (ROWS, length), generator=gen)
        lengths = torch.randint(6, length + 1, (ROWS,), generator=gen)
        prompts = torch.randint(1, 5, (ROWS,), generator=gen)
        pos = torch.arange(length)
        attention_mask = (pos[None] < lengths[:, None]).long()
        input_ids = input_ids.masked_fill(attention_mask == 0, 0)
        labels = input_ids.masked_fill((attention_mask == 0) | (pos[None] < prompts[:, None]), IGNORE_INDEX)
        batches.append({"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels})
    return batches


def _rows(batch: dict[str, torch.Tensor], start: int, stop: int) -> dict[str, torch.Tensor]:
    return {k: v[start:stop] for k, v in batch.items()}


def _train(model, batches, micro_batches: int = 1):
    """Optimizer, scheduler and one train_step per batch; each rank trains on its half of each batch."""
    optimizer = build_optimizer(model, OPTIM)
    scheduler = build_lr_scheduler(optimizer, OPTIM, total_steps=10)
    stats = [_step(model, batch, optimizer, scheduler, micro_batches) for batch in batches]
    return optimizer, scheduler, stats


def _step(model, batch, optimizer, scheduler, micro_batches: int = 1):
    world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
    per_rank = ROWS // world
    local = _rows(batch, rank * per_rank, (rank + 1) * per_rank)
    size = per_rank // micro_batches
    return train_step(model, [_rows(local, i * size, (i + 1) * size) for i in range(micro_batches)], optimizer, scheduler, OPTIM.grad_clip)


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def _max_diff(a, b) -> float:
    """Largest absolute difference between two nested state dicts (local shards of DTensors)."""
    if isinstance(a, dict):
        assert a.keys() == b.keys(), (sorted(a), sorted(b))
        return max((_max_diff(a[k], b[k]) for k in a), default=0.0)
    if isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        return max((_max_diff(x, y) for x, y in zip(a, b)), default=0.0)
    if isinstance(a, torch.Tensor):
        return (_local(a).double() - _local(b).double()).abs().max().item() if a.numel() else 0.0
    return 0.0 if a == b else float("inf")


def _worker(cfg: dict, env) -> None:
    """One rank of every distributed scenario, in the group the caller set up; results go to ``out/rank{rank}.pt``."""
    rank, model_dir, out, cpu = dist.get_rank(), cfg["model_dir"], Path(cfg["out"]), torch.device("cpu")
    # The FSDP runs use the chunked log-prob head the recipes install (DDP's: full logits), so they are compared too.
    model = install_logprob_head(load_model(model_dir), chunk_tokens=16)
    batches = _batches(model.config.vocab_size)
    result = {}

    # FSDP2 with activation checkpointing and two micro-batches per rank: 3 steps.
    fsdp = parallelize(model, ParallelConfig(strategy="fsdp", activation_checkpointing=True), cpu)
    optimizer, scheduler, stats = _train(fsdp, batches[:3], micro_batches=2)
    result["fsdp"] = [(s.loss, s.grad_norm) for s in stats]
    full = full_state_dict(fsdp)
    layers = list(full_weights_by_layer(fsdp))  # the rollout weight sync's stream: a layer at a time, on rank 0
    result["streamed"] = {"buckets": len(layers), "keys": [sorted(b) for b in layers],
                          "equal_full": rank > 0 or _max_diff({k: v for b in layers for k, v in b.items()}, full) == 0.0}  # fmt: skip
    _save_full_training_state(out / "fsdp_state.pt", fsdp, optimizer)
    if rank == 0:  # the HF export as the recipe will do it
        torch.save(full, out / "fsdp_full.pt")
        unwrap(fsdp).save_pretrained(out / "hf", state_dict=full, safe_serialization=True)
    else:
        assert full is None

    # DCP: each rank into its own directory, merged into one as Ray Train does.
    save_sharded(out / f"fsdp_rank{rank}", fsdp, optimizer, extra={"step": 3, "scheduler": scheduler.state_dict()})
    dist.barrier()
    if rank == 0:
        for r in range(WORLD):
            shutil.copytree(out / f"fsdp_rank{r}", out / "fsdp_merged", dirs_exist_ok=True)
    dist.barrier()

    # A fresh FSDP model (no activation checkpointing this time) and optimizer, loaded from the merge.
    resumed = parallelize(install_logprob_head(load_model(model_dir), chunk_tokens=16), ParallelConfig(strategy="fsdp"), cpu)
    resumed_optimizer = build_optimizer(resumed, OPTIM)
    resumed_scheduler = build_lr_scheduler(resumed_optimizer, OPTIM, total_steps=10)
    extra = load_sharded(out / "fsdp_merged", resumed, resumed_optimizer)
    resumed_scheduler.load_state_dict(extra["scheduler"])
    result["extra_step"] = extra["step"]
    original_state, resumed_state = get_state_dict(fsdp, optimizer), get_state_dict(resumed, resumed_optimizer)
    result["resume_diff"] = (_max_diff(original_state[0], resumed_state[0]), _max_diff(original_state[1], resumed_state[1]))
    # Two more steps each: the second step's loss depends on the first's update (optimizer state, LR).
    result["continued"] = [_step(fsdp, batch, optimizer, scheduler).loss for batch in batches[3:]]
    result["resumed"] = [_step(resumed, batch, resumed_optimizer, resumed_scheduler).loss for batch in batches[3:]]
    result["after_resume_diff"] = _max_diff(get_state_dict(fsdp, optimizer), get_state_dict(resumed, resumed_optimizer))

    # DDP: 3 steps, then DCP into per-rank directories (merged and loaded by the test process).
    ddp = parallelize(load_model(model_dir), ParallelConfig(strategy="ddp"), cpu)
    optimizer, _, stats = _train(ddp, batches[:3])
    result["ddp"] = [(s.loss, s.grad_norm) for s in stats]
    _save_full_training_state(out / "ddp_state.pt", ddp, optimizer)
    save_sharded(out / f"ddp_rank{rank}", ddp, optimizer, extra={"step": 3})

    torch.save(result, out / f"rank{rank}.pt")


def _save_full_training_state(path: Path, model, optimizer) -> None:
    """Rank 0 saves the gathered model and optimizer state (collective: every rank calls it)."""
    state = get_state_dict(unwrap(model), optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if dist.get_rank() == 0:
        torch.save(state, path)


def _merge(out: Path, prefix: str) -> tuple[list[set[str]], Path]:
    """Copy the per-rank DCP directories into one; the files each rank wrote."""
    files = [set(os.listdir(out / f"{prefix}_rank{r}")) for r in range(WORLD)]
    merged = out / f"{prefix}_merged"
    for r in range(WORLD):
        shutil.copytree(out / f"{prefix}_rank{r}", merged, dirs_exist_ok=True)
    return files, merged


@pytest.fixture(scope="module")
def reference(tiny_model):
    """Single process on the whole batch: per-step (loss, grad norm) for 5 steps, the weights after 3."""
    model = parallelize(load_model(tiny_model), ParallelConfig(), torch.device("cpu"))  # no process group: as is
    batches = _batches(model.config.vocab_size)
    optimizer, scheduler, stats = _train(model, batches[:3])
    weights = {k: v.detach().clone() for k, v in model.state_dict().items()}
    stats += [_step(model, batch, optimizer, scheduler) for batch in batches[3:]]
    return {"steps": [(s.loss, s.grad_norm) for s in stats], "weights": weights}


@pytest.fixture(scope="module")
def two_ranks(tiny_model, tmp_path_factory, local_group) -> Path:
    out = tmp_path_factory.mktemp("parallel")
    local_group.run(_worker, {"model_dir": str(tiny_model), "out": str(out)}, out, {})
    return out


def _results(out: Path) -> list[dict]:
    return [torch.load(out / f"rank{r}.pt", weights_only=False) for r in range(WORLD)]


def test_fsdp_and_ddp_train_like_one_process(reference, two_ranks, tiny_model):
    ref = reference["steps"][:3]
    assert all(norm > OPTIM.grad_clip for _, norm in ref), ref  # clipping really happened
    for result in _results(two_ranks):  # every rank reports the global loss and the global gradient norm
        for strategy in ("fsdp", "ddp"):
            # The norm checks the gradient scale (token-averaged, as one process): clipped AdamW
            # updates are scale-invariant, so the weights alone would not show a wrong scale.
            flat, flat_ref = [x for pair in result[strategy] for x in pair], [x for pair in ref for x in pair]
            assert flat == pytest.approx(flat_ref, abs=TOL), (strategy, result[strategy], ref)

    # Weights after 3 steps, gathered to full CPU tensors. Adam divides each gradient element by
    # its running RMS, so elements with ~0 gradient turn float summation-order noise into update
    # noise of a fraction of lr: one process with 2 micro-batches differs from 1 by ~1e-5 too.
    full = torch.load(two_ranks / "fsdp_full.pt", weights_only=True)
    assert full.keys() == reference["weights"].keys()
    assert all(t.device.type == "cpu" and type(t) is torch.Tensor for t in full.values())
    assert _max_diff(full, reference["weights"]) < WEIGHT_TOL
    assert _max_diff(torch.load(two_ranks / "ddp_state.pt", weights_only=False)[0], reference["weights"]) < WEIGHT_TOL
    exported = AutoModelForCausalLM.from_pretrained(two_ranks / "hf", local_files_only=True)  # the HF model class
    assert _max_diff(full, exported.state_dict()) == 0.0

    # Streamed a decoder layer at a time (then embeddings, norm, head): the same tensors as the full gather, on rank 0 only.
    streamed = [result["streamed"] for result in _results(two_ranks)]
    assert all(s["equal_full"] for s in streamed) and streamed[0]["buckets"] == AutoModelForCausalLM.from_pretrained(tiny_model).config.num_hidden_layers + 1
    assert sorted(k for keys in streamed[0]["keys"] for k in keys) == sorted(full) and not any(streamed[1]["keys"])


def test_dcp_per_rank_dirs_merge_and_resume(reference, two_ranks, tiny_model):
    for result in _results(two_ranks):
        # A fresh FSDP model and optimizer on 2 ranks, loaded from the merged directories, equal the
        # originals exactly and continue exactly as they do.
        assert result["extra_step"] == 3
        assert result["resume_diff"] == (0.0, 0.0)
        assert result["resumed"] == result["continued"]
        assert result["after_resume_diff"] == 0.0
        assert result["continued"] == pytest.approx([loss for loss, _ in reference["steps"][3:]], abs=TOL)

    for strategy in ("fsdp", "ddp"):
        files, merged = _merge(two_ranks, strategy)
        # Each rank names its files by rank; only rank 0 writes the index.
        assert files[0] & files[1] == set(), files
        assert ".metadata" in files[0] and not any("metadata" in f for f in files[1]), files
        assert all(f.startswith(f"__{r}_") and f.endswith(".distcp") for r in range(WORLD) for f in files[r] - {".metadata"}), files
        # The merged directory also loads into a single process (resharded from 2 ranks), exactly.
        model = load_model(tiny_model)
        optimizer = build_optimizer(model, OPTIM)
        build_lr_scheduler(optimizer, OPTIM, total_steps=10)  # before the load, as a recipe does: it adds initial_lr
        assert load_sharded(merged, model, optimizer)["step"] == 3
        expected = torch.load(two_ranks / f"{strategy}_state.pt", weights_only=False)
        assert _max_diff(get_state_dict(model, optimizer), expected) == 0.0, strategy


def test_config_refuses_bad_values():
    assert ParallelConfig().model_dump() == {
        "strategy": "ddp",
        "activation_checkpointing": False,
        "param_dtype": "bfloat16",
        "reduce_dtype": "float32",
    }
    with pytest.raises(ConfigError, match=r"parallel: strategy: Input should be 'ddp' or 'fsdp'"):
        validate(ParallelConfig, {"strategy": "zero3"}, "parallel")
    with pytest.raises(ConfigError, match=r"param_dtype: Input should be 'float32' or 'bfloat16'"):
        validate(ParallelConfig, {"param_dtype": "fp16"}, "parallel")
    with pytest.raises(ConfigError, match=r"activation_checkpoint: unknown field"):
        validate(ParallelConfig, {"activation_checkpoint": True}, "parallel")


def test_single_process_activation_checkpointing_keeps_names_and_gradients(tiny_model, tmp_path):
    plain = load_model(tiny_model)
    checkpointed = parallelize(load_model(tiny_model), ParallelConfig(activation_checkpointing=True), torch.device("cpu"))
    assert unwrap(checkpointed) is checkpointed  # no process group: no DDP wrapper
    assert checkpointed.state_dict().keys() == plain.state_dict().keys()  # HF names, so save_pretrained is unchanged
    # named_parameters() from the root does show the wrapper ("_checkpoint_wrapped_module."); DCP strips it.
    names = [n.replace("_checkpoint_wrapped_module.", "") for n, _ in checkpointed.named_parameters()]
    assert names == [n for n, _ in plain.named_parameters()]
    batch = _batches(plain.config.vocab_size, steps=1)[0]
    for model in (plain, checkpointed):
        model(**{k: batch[k] for k in ("input_ids", "attention_mask")}, labels=batch["labels"]).loss.backward()
    for (name, p), (_, q) in zip(plain.named_parameters(), checkpointed.named_parameters()):
        torch.testing.assert_close(q.grad, p.grad, msg=name)
    checkpointed.save_pretrained(tmp_path / "hf")
    assert _max_diff(AutoModelForCausalLM.from_pretrained(tmp_path / "hf").state_dict(), plain.state_dict()) == 0.0

    with pytest.raises(RuntimeError, match="needs an initialised process group"):
        parallelize(plain, ParallelConfig(strategy="fsdp"), torch.device("cpu"))
