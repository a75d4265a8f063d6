"""LoRA through peft: only the adapter trains, merged export, adapter state round trip, errors."""

import copy
import json

import peft
import pytest
import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (
    checkpoint_wrapper,
)
from transformers import AutoModelForCausalLM

from mlplat.config import validate
from mlplat.engine.config import EngineConfig
from mlplat.engine.runner import ModelRunner
from mlplat.errors import CheckpointError, ConfigError
from mlplat.models import load_model, load_tokenizer, validate_checkpoint_dir
from mlplat.train.batch import pad_collate
from mlplat.train.lora import (
    LoRAConfig,
    adapter_state_dict,
    apply_lora,
    load_adapter,
    load_adapter_state_dict,
    merge_and_export,
    save_adapter,
    trainable_parameter_counts,
)
from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
from mlplat.train.step import train_step

LORA = LoRAConfig(r=8, alpha=16)
OPTIM = OptimizerConfig(lr=5e-3, warmup_steps=0)  # 1e-2 oscillates at this size
STEPS = 30
TEXTS = ["12 + 34 = 64", "7 + 8 = 51", "100 + 250 = 053", "99 + 1 = 001"]


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def hf_name(peft_key: str) -> str:
    """``base_model.model.<layer>.base_layer.weight`` -> ``<layer>.weight``."""
    return peft_key.removeprefix("base_model.model.").replace(".base_layer.", ".")


@pytest.fixture(scope="module")
def batch(tiny_model):
    tokenizer = load_tokenizer(tiny_model)
    rows = [tokenizer(t)["input_ids"] for t in TEXTS]
    return pad_collate({"input_ids": rows, "labels": rows}, tokenizer.pad_token_id)


@pytest.fixture(scope="module")
def trained(tiny_model, batch):
    """A LoRA model overfitted on one batch; tests read it and must not change it."""
    torch.manual_seed(0)
    model = apply_lora(load_model(tiny_model), LORA)
    optimizer = build_optimizer(model, OPTIM)
    scheduler = build_lr_scheduler(optimizer, OPTIM, STEPS)
    losses = [
        train_step(model, batch, optimizer, scheduler, OPTIM.grad_clip).loss
        for _ in range(STEPS)
    ]
    return model.eval(), optimizer, losses


def test_only_the_adapter_trains_and_the_loss_drops(tiny_model, trained):
    model, _, losses = trained
    base = load_model(tiny_model)
    trainable, total = trainable_parameter_counts(model)
    base_total = sum(p.numel() for p in base.parameters())
    targeted = [
        m
        for name, m in base.named_modules()
        if isinstance(m, nn.Linear) and name.rpartition(".")[2] in LORA.target_modules
    ]
    assert len(targeted) == 7 * base.config.num_hidden_layers
    assert trainable == sum(LORA.r * (m.in_features + m.out_features) for m in targeted)
    assert total == base_total + trainable and trainable < 0.2 * total
    assert all("lora_" in n for n, p in model.named_parameters() if p.requires_grad), (
        "only adapter weights may train"
    )

    assert losses[-1] < 0.6 * losses[0], losses  # ~5.8 -> ~2.8
    base_state = base.state_dict()
    for key, value in model.state_dict().items():
        if "lora_" not in key:  # every base weight is bit-for-bit what was loaded
            torch.testing.assert_close(value, base_state[hf_name(key)], rtol=0, atol=0)
    assert all(
        p.abs().max() > 0 for n, p in model.named_parameters() if "lora_B" in n
    ), "B starts at zero and must have trained"


def test_packed_rows_run_through_the_peft_model(tiny_model):
    """A fresh adapter (B = 0) changes nothing, whichever input form the forward takes."""
    from mlplat.train.batch import model_inputs

    base = load_model(tiny_model)
    model = apply_lora(load_model(tiny_model), LORA).eval()
    ids = torch.arange(3, 15)[None]
    packed = {
        "input_ids": ids,
        "position_ids": torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 5, 6]]),
        "seq_ids": torch.tensor([[0] * 5 + [1] * 7]),
    }
    with torch.no_grad():
        got = model(**model_inputs(packed)).logits
        want = base(**model_inputs(packed)).logits
    torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_merge_and_export_writes_a_plain_checkpoint(tiny_model, trained, tmp_path):
    model, _, _ = trained
    ids = torch.tensor([[5, 17, 42, 8, 99, 3, 7]])
    before = logits(model, ids)

    out = merge_and_export(model, tmp_path / "merged", load_tokenizer(tiny_model))
    names = {p.name for p in out.iterdir()}
    assert "model.safetensors" in names and not any("adapter" in n for n in names)
    assert "peft" not in (out / "config.json").read_text()
    validate_checkpoint_dir(out)  # weights, config and tokenizer all there

    merged = AutoModelForCausalLM.from_pretrained(out, local_files_only=True)
    assert type(merged).__name__ == "LlamaForCausalLM"
    torch.testing.assert_close(logits(merged, ids), before, rtol=0, atol=1e-5)
    assert (
        logits(merged, ids) - logits(load_model(tiny_model), ids)
    ).abs().max() > 1e-2
    # The same weights peft's own (destructive) merge gives; the live model is untouched.
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    saved = load_file(out / "model.safetensors")
    assert saved.keys() <= reference.keys()
    for key, value in saved.items():
        torch.testing.assert_close(value, reference[key], rtol=0, atol=0)
    assert isinstance(model, peft.PeftModel)
    torch.testing.assert_close(logits(model, ids), before, rtol=0, atol=0)

    runner = ModelRunner(
        EngineConfig(model=str(out), num_kv_blocks=4)
    )  # the engine loads it
    assert runner.hf_config.model_type == "llama"


@pytest.mark.filterwarnings(
    "ignore:.*is_gradient_checkpointing:FutureWarning"
)  # inside peft
def test_adapter_state_round_trip(tiny_model, trained, tmp_path):
    model, optimizer, _ = trained
    ids = torch.tensor([[5, 17, 42, 8, 99, 3, 7]])
    state = adapter_state_dict(model)
    assert state and all(".lora_A.weight" in k or ".lora_B.weight" in k for k in state)
    assert all(v.device.type == "cpu" for v in state.values())

    fresh = apply_lora(load_model(tiny_model), LORA).eval()
    assert not torch.equal(logits(fresh, ids), logits(model, ids))
    load_adapter_state_dict(fresh, state)
    torch.testing.assert_close(logits(fresh, ids), logits(model, ids), rtol=0, atol=0)
    # Resuming: the optimizer over the fresh model's trainable parameters takes the saved state.
    build_optimizer(fresh, OPTIM).load_state_dict(optimizer.state_dict())

    # The on-disk form is peft's: peft loads it, and so do we.
    adapter_dir = save_adapter(model, tmp_path / "adapter")
    assert json.loads((adapter_dir / "adapter_config.json").read_text())["r"] == LORA.r
    via_peft = peft.PeftModel.from_pretrained(load_model(tiny_model), adapter_dir)
    torch.testing.assert_close(
        logits(via_peft.eval(), ids), logits(model, ids), rtol=0, atol=0
    )
    again = apply_lora(load_model(tiny_model), LORA).eval()
    load_adapter(again, adapter_dir)
    torch.testing.assert_close(logits(again, ids), logits(model, ids), rtol=0, atol=0)

    other_rank = apply_lora(load_model(tiny_model), LoRAConfig(r=4))
    with pytest.raises(CheckpointError, match="lora.r"):
        load_adapter_state_dict(other_rank, state)
    fewer = apply_lora(load_model(tiny_model), LoRAConfig(target_modules=["q_proj"]))
    with pytest.raises(CheckpointError, match="lora.target_modules.*unexpected"):
        load_adapter_state_dict(fewer, state)


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["q_proj", "qproj"], r"'qproj' matches no module; .*: q_proj, k_proj, v_proj"),
        (["qproj", "vproj"], r"'qproj', 'vproj' match no module"),
        (
            ["norm"],
            r"'norm' selects model.norm \(LlamaRMSNorm\), which is not a linear",
        ),
        (["lm_head"], r"'lm_head' .* shares its weight with the input embeddings"),
    ],
)
def test_bad_target_modules_are_refused_clearly(tiny_model, targets, message):
    with pytest.raises(ConfigError, match=r"^lora\.target_modules: " + message):
        apply_lora(load_model(tiny_model), LoRAConfig(target_modules=targets))


@pytest.mark.parametrize(
    "field", [{"r": 0}, {"dropout": 1.0}, {"target_modules": []}, {"rank": 8}]
)
def test_config_validation(field):
    with pytest.raises(ConfigError, match="^lora: "):
        validate(LoRAConfig, field, source="lora")


def test_ddp_and_activation_checkpointing(tiny_model, batch, tmp_path):
    """DDP without find_unused_parameters (frozen weights are not DDP's), and adapter
    state under activation checkpointing's wrappers (peft's own lookup misses it there)."""
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        model = apply_lora(load_model(tiny_model), LORA)
        # Training wants no KV cache: with one (config default), the recompute in backward
        # appends to it a second time and padded batches fail on a doubled key length.
        model.get_base_model().config.use_cache = False
        layers = model.get_base_model().model.layers
        for i, layer in enumerate(layers):
            layers[i] = checkpoint_wrapper(layer)
        ddp = nn.parallel.DistributedDataParallel(model)
        optimizer = build_optimizer(ddp, OPTIM)
        scheduler = build_lr_scheduler(optimizer, OPTIM, 3)
        # DDP reports unused trainable parameters at the start of the next step.
        for _ in range(3):
            train_step(ddp, batch, optimizer, scheduler, OPTIM.grad_clip)
        state = adapter_state_dict(ddp)
        assert len(state) == 2 * 7 * len(layers)
        assert any(v.abs().max() > 0 for k, v in state.items() if "lora_B" in k)
    finally:
        dist.destroy_process_group()


def test_with_adapters_off_the_policy_is_the_base_model(tiny_model):
    """The LoRA reference (mlplat.train.loop.AdaptersDisabled): with a non-zero B, the policy's log-probs differ from the
    reference's, and the reference's are the base model's."""
    from mlplat.train.logprobs import install_logprob_head, labelled_logprobs
    from mlplat.train.loop import AdaptersDisabled

    policy = install_logprob_head(apply_lora(load_model(tiny_model), LORA))
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.2)
    ids = torch.tensor([[5, 9, 14, 20, 33, 41, 7, 8]])
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    with torch.no_grad():
        trained, reference = labelled_logprobs(policy, batch), labelled_logprobs(AdaptersDisabled(policy), batch)
        base = labelled_logprobs(load_model(tiny_model), batch)
    assert (trained - reference).abs().max() > 1e-3
    torch.testing.assert_close(reference, base, atol=1e-6, rtol=0)
    assert (labelled_logprobs(policy, batch) - trained).abs().max() == 0  # the adapters are back on after the reference pass
