"""The recipes' loops under plain torch.distributed (gloo, 2 processes, no Ray): exact resume, gradient
accumulation equal to one big batch, and the non-finite guard, for SFT, the reward model and DPO.

Each run goes to the session's two rank processes (``local_group``: ``mlplat.train.worker.LocalGroup``, what
``run_local`` spawns for one run): the loop is the one Ray Train launches, on a ``LocalWorkerEnv`` (rows in
memory, checkpoints in a directory). The Ray side (Ray
Data's deterministic shards, Ray Train's restarts) is tested end to end in test_sft*.py and test_posttrain.py.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch
from conftest import MLPLAT
from safetensors.torch import load_file

from mlplat.data.preference import PreferenceDataConfig, PreferenceTokenizer
from mlplat.data.sft import ChatTokenizer, SFTDataConfig
from mlplat.errors import CheckpointError, ConfigError
from mlplat.train.checkpoint import MODEL_DIR, export_checkpoint
from mlplat.train.optim import OptimizerConfig
from train_apps.dpo import DPOConfig, dpo_loop
from train_apps.reward_model import RewardModelConfig, reward_model_loop
from train_apps.sft import SFTConfig, sft_loop

pytestmark = pytest.mark.slow  # a few runs of 2 ranks per test: in `make test`, not `make test-fast`

WORLD = 2


def _rows(udf, path, limit: int) -> list[dict]:
    """Tokenized rows, made by the Ray Data pipeline's own tokenizer function over one batch of JSONL lines."""
    with open(path) as f:
        columns = udf({"text": [line for line, _ in zip(f, range(limit))]})
    return [dict(zip(columns, values)) for values in zip(*columns.values())]


@pytest.fixture(scope="module")
def recipes(demo_data, tiny_model):
    """(config, loop, rows) per recipe: 6 steps of 2 ranks x 4 rows, logged every step and checkpointed every 3."""
    common = {
        "model": str(tiny_model), "max_steps": 6, "batch_size_per_worker": 4, "num_workers": WORLD,
        "log_every": 1, "checkpoint_every": 3, "num_checkpoints_to_keep": None, "registered_model": None,
    }  # fmt: skip
    sft_data = SFTDataConfig(path=str(demo_data.sft), max_seq_len=64)
    preference_data = PreferenceDataConfig(path=str(demo_data.preferences), max_seq_len=64)
    return {
        "sft": (SFTConfig(data=sft_data, optim=OptimizerConfig(lr=2e-3, warmup_steps=2), checkpoint_format="sharded", peak_tflops=1.0, **common),
                sft_loop, _rows(ChatTokenizer(str(tiny_model), 64), demo_data.sft, 96)),
        "reward_model": (RewardModelConfig(data=preference_data, optim=OptimizerConfig(lr=1e-3, warmup_steps=2), **common),
                         reward_model_loop, _rows(PreferenceTokenizer(str(tiny_model), 64), demo_data.preferences, 96)),
        "dpo": (DPOConfig(data=preference_data, optim=OptimizerConfig(lr=1e-3, warmup_steps=2), **common),
                dpo_loop, _rows(PreferenceTokenizer(str(tiny_model), 64), demo_data.preferences, 96)),
    }  # fmt: skip


def _weights(checkpoint) -> dict[str, torch.Tensor]:
    return load_file(checkpoint / MODEL_DIR / "model.safetensors")


@pytest.mark.parametrize("recipe", ["sft", "reward_model", "dpo"])
def test_a_run_resumed_from_its_checkpoint_continues_exactly_and_accumulation_equals_one_big_batch(recipes, recipe, tmp_path, local_group):
    cfg, loop, rows = recipes[recipe]
    straight = local_group.run(loop, cfg, tmp_path / "straight", {"train": rows})
    assert [m["step"] for m in straight.metrics] == [1, 2, 3, 4, 5, 6]
    assert [c.name for c in straight.checkpoints] == ["checkpoint_000003", "checkpoint_000006"]  # every 3 steps, whatever log_every
    if recipe == "sft":  # in 6 steps only SFT's loss is sure to fall
        assert straight.metrics[-1]["loss"] < straight.metrics[0]["loss"]

    # A new run from the step-3 checkpoint (weights, optimizer, scheduler, RNG, data position) redoes steps 4-6.
    resumed = local_group.run(loop, cfg, tmp_path / "resumed", {"train": rows}, restore_from=straight.checkpoints[0])
    windows = [m for m in resumed.metrics if "loss" in m]
    assert [m["step"] for m in windows] == [4, 5, 6]
    if recipe == "sft":
        assert resumed.metrics[0] == {"step": 3, "restored_from_step": 3}
    for redone, original in zip(windows, straight.metrics[3:]):
        assert redone["loss"] == pytest.approx(original["loss"], rel=1e-5, abs=1e-7), redone["step"]
    for name, tensor in _weights(straight.checkpoints[-1]).items():
        torch.testing.assert_close(_weights(resumed.checkpoints[-1])[name], tensor, rtol=1e-5, atol=1e-7, msg=name)

    # Half the rows per micro-batch, two micro-batches per step: the same global batches, so the first step's mean loss
    # and gradient norm (same weights) agree to float precision. Later steps only approximately: Adam turns summation-
    # order noise in near-zero gradients into updates of up to lr.
    accumulated = cfg.model_copy(update={"batch_size_per_worker": 2, "grad_accum_steps": 2})
    first = local_group.run(loop, accumulated, tmp_path / "accumulated", {"train": rows}).metrics
    assert first[0]["loss"] == pytest.approx(straight.metrics[0]["loss"], rel=1e-5)
    assert first[0]["grad_norm"] == pytest.approx(straight.metrics[0]["grad_norm"], rel=1e-4)
    assert [m["loss"] for m in first] == pytest.approx([m["loss"] for m in straight.metrics], rel=2e-2)


def test_a_sharded_checkpoint_exports_on_one_process_as_saved(recipes, tmp_path, local_group):
    """DCP shards written by 2 ranks, resharded onto one process: the same weights as the run's own HF export."""
    cfg, loop, rows = recipes["sft"]
    run = local_group.run(loop, cfg.model_copy(update={"max_steps": 3}), tmp_path / "run", {"train": rows})
    exported = export_checkpoint(run.checkpoints[-1], tmp_path / "exported")
    for name, tensor in _weights(run.checkpoints[-1]).items():
        torch.testing.assert_close(load_file(exported / "model.safetensors")[name], tensor, rtol=0, atol=0, msg=name)


def test_resume_from_is_checked_before_anything_starts(tmp_path):
    from mlplat.train.recipe import check_resume_from

    with pytest.raises(CheckpointError, match="not a training checkpoint directory"):
        check_resume_from(str(tmp_path), max_steps=10)
    (tmp_path / "train_state.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError, match="cannot read"):
        check_resume_from(str(tmp_path), max_steps=10)


def test_resume_from_a_finished_run_is_refused(recipes, tmp_path, local_group):
    from mlplat.train.recipe import check_resume_from

    cfg, loop, rows = recipes["reward_model"]
    run = local_group.run(loop, cfg.model_copy(update={"max_steps": 1}), tmp_path / "run", {"train": rows})
    with pytest.raises(ConfigError, match="at step 1, not before max_steps=1"):
        check_resume_from(str(run.checkpoints[-1]), max_steps=1)
    assert json.loads((run.checkpoints[-1] / "checkpoint.json").read_text())["base_model"] == cfg.model


@pytest.mark.parametrize("strategy", ["fsdp", "ddp"])
def test_dpo_with_lora_trains_adapters_against_the_base_model_as_reference(recipes, strategy, tmp_path, local_group):
    """LoRA under FSDP2 and DDP: the reference is the policy with its adapters off (no second copy). At step 1 the
    adapters are still zero (B = 0), so every implicit reward is exactly 0; then the adapters train, and the
    export merges them into the base weights."""
    from mlplat.train.lora import LoRAConfig

    cfg, loop, rows = recipes["dpo"]
    cfg = cfg.model_copy(update={"max_steps": 3, "lora": LoRAConfig(r=4, target_modules=["q_proj", "v_proj"]),
                                 "parallel": cfg.parallel.model_copy(update={"strategy": strategy})})  # fmt: skip
    run = local_group.run(loop, cfg, tmp_path / "run", {"train": rows})
    assert run.metrics[0]["rewards/chosen"] == 0 and run.metrics[0]["rewards/rejected"] == 0
    assert run.metrics[-1]["rewards/chosen"] != 0
    base, merged = load_file(cfg.model + "/model.safetensors"), _weights(run.checkpoints[-1])
    changed = {name for name, tensor in base.items() if not torch.equal(tensor, merged[name])}
    assert changed and all(".q_proj." in name or ".v_proj." in name for name in changed), changed


def test_lora_sft_exports_a_merged_plain_checkpoint(recipes, tmp_path, local_group):
    """SFT with LoRA: the last checkpoint's HF export is a plain checkpoint (adapters merged, no peft files) in which only
    the target modules changed; ``mlplat model export`` rebuilds the same weights from the sharded state alone."""
    from mlplat.train.lora import LoRAConfig

    cfg, loop, rows = recipes["sft"]
    update = {"max_steps": 12, "checkpoint_every": 12, "log_every": 4, "optim": OptimizerConfig(lr=5e-3, warmup_steps=2)}
    cfg = cfg.model_copy(update={**update, "lora": LoRAConfig(r=8, alpha=16)})
    run = local_group.run(loop, cfg, tmp_path / "run", {"train": rows})
    assert run.metrics[-1]["loss"] < run.metrics[0]["loss"]
    model_dir = run.checkpoints[-1] / MODEL_DIR
    assert "adapter_config.json" not in {p.name for p in model_dir.iterdir()}
    base, tuned = load_file(cfg.model + "/model.safetensors"), _weights(run.checkpoints[-1])
    changed = {name for name, tensor in base.items() if not torch.equal(tensor, tuned[name])}
    assert changed and all(any(f".{target}." in name for target in cfg.lora.target_modules) for name in changed), changed
    # beside it the adapter alone (lora.register_as: adapter registers that), which the engine serves by name on the base model
    from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
    from mlplat.engine.config import MultiLoRAConfig
    from mlplat.train.checkpoint import ADAPTER_DIR

    lora = MultiLoRAConfig(adapters={"sft": str(run.checkpoints[-1] / ADAPTER_DIR)})
    prompts, greedy = ["12 + 34 = ", "7 + 8 = "], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    served = LLMEngine(EngineConfig(model=cfg.model, lora=lora)).generate(prompts, greedy.model_copy(update={"lora_name": "sft"}))
    merged = LLMEngine(EngineConfig(model=str(model_dir))).generate(prompts, greedy)
    assert [o.outputs[0].token_ids for o in served] == [o.outputs[0].token_ids for o in merged]

    out = subprocess.run([MLPLAT, "model", "export", "--checkpoint", str(run.checkpoints[-1]), "--out", str(tmp_path / "exported")],
                         check=False, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert out.returncode == 0, out.stderr
    exported = load_file(tmp_path / "exported" / "model.safetensors")
    for name, tensor in tuned.items():
        torch.testing.assert_close(exported[name], tensor, rtol=0, atol=0, msg=name)


def test_a_diverging_run_stops_with_what_to_change(recipes, tmp_path, local_group):
    # Last in the module: the failed run stops the group's processes (the next user would spawn new ones).
    cfg, loop, rows = recipes["sft"]
    diverging = cfg.model_copy(update={"optim": OptimizerConfig(lr=1e30, warmup_steps=1), "max_bad_steps_in_row": 3, "max_steps": 10})
    with pytest.raises(Exception, match=r"not finite for 3 steps in a row.*lower optim.lr"):
        local_group.run(loop, diverging, tmp_path / "run", {"train": rows})
