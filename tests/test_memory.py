"""The analytical step-memory estimate (mlplat.train.memory): its terms against real models' parameter counts
(built on the meta device: no memory), how they scale with the world size, and the 7B recipes on 8 x 80 GB."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from mlplat.models.shapes import SHAPES
from mlplat.train.memory import (
    LOGIT_COPIES_BACKWARD,
    MemorySetup,
    estimate_step_memory,
    gpu_recipe_setup,
    layer_parameters,
    root_parameters,
)


def meta_model(shape):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(shape.hf_config())


@pytest.fixture(scope="module", params=sorted(SHAPES))
def shape_and_model(request):
    shape = SHAPES[request.param]
    return shape, meta_model(shape)


def test_parameter_and_optimizer_terms_are_the_real_models_count_times_bytes(shape_and_model):
    shape, model = shape_and_model
    n = sum(p.numel() for p in model.parameters())  # a tied embedding once
    assert n == shape.num_parameters()
    assert sum(p.numel() for p in model.model.layers[0].parameters()) == layer_parameters(shape)
    root = sum(p.numel() for name, p in model.named_parameters() if ".layers." not in name)
    assert root == root_parameters(shape)
    assert root + shape.num_hidden_layers * layer_parameters(shape) == n
    for world in (1, 2, 8):
        terms = estimate_step_memory(MemorySetup(shape=shape, world_size=world, rows=1, tokens=128)).terms
        assert terms["params_shard"] == n * 4 // world  # fp32 master weights
        assert terms["optimizer_shard"] == n * 8 // world  # AdamW's exp_avg and exp_avg_sq, fp32


def test_sharded_terms_scale_with_world_size_and_the_rest_does_not():
    shape = SHAPES["qwen2.5-0.5b"]
    base = MemorySetup(shape=shape, world_size=1, rows=2, tokens=512, reference="sharded", engine_weight_bytes=4, engine_kv_tokens=1024)
    one, eight = estimate_step_memory(base), estimate_step_memory(dataclasses.replace(base, world_size=8))
    for key in ("params_shard", "optimizer_shard", "reference_shard"):
        assert eight.terms[key] == pytest.approx(one.terms[key] / 8, abs=8)
    for key in ("engine_weights", "engine_kv_cache", "reference_root_and_last_layer_gathered"):
        assert eight.terms[key] == one.terms[key]
    assert eight.terms["engine_weights"] == shape.num_parameters() * 4
    assert one.terms["engine_kv_cache"] == 1024 * shape.num_hidden_layers * 2 * shape.num_key_value_heads * shape.head_dim * 2
    replicated = estimate_step_memory(dataclasses.replace(base, world_size=8, reference="replicated"))
    assert replicated.terms["reference_replica"] == shape.num_parameters() * 4
    assert eight.total < one.total


def test_the_logit_term_is_bounded_by_the_chunk_not_the_batch():
    shape = SHAPES["qwen2.5-0.5b"]
    setup = MemorySetup(shape=shape, world_size=2, rows=8, tokens=4096, chunk_tokens=1024)
    head = estimate_step_memory(setup).moment_terms["head_backward"]
    assert head["logit_chunk"] == LOGIT_COPIES_BACKWARD * 1024 * shape.vocab_size * 4
    longer = estimate_step_memory(dataclasses.replace(setup, tokens=8192)).moment_terms["head_backward"]
    assert longer["logit_chunk"] == head["logit_chunk"]  # more tokens: more chunks, not larger ones
    assert longer["saved_activations"] == 2 * head["saved_activations"]
    few = estimate_step_memory(dataclasses.replace(setup, rows=1, tokens=256, labelled_tokens=100)).moment_terms["head_backward"]
    assert few["logit_chunk"] < head["logit_chunk"]  # a chunk holds at most the labelled positions
    small = estimate_step_memory(MemorySetup(shape=shape, world_size=2, rows=2, tokens=1024, chunk_tokens=1024))
    assert small.moment == "head_backward"


def test_activation_checkpointing_keeps_layer_inputs_only():
    shape = SHAPES["qwen2.5-7b"]
    setup = gpu_recipe_setup(shape, "sft")
    on = estimate_step_memory(setup).moments["layer_backward"]
    off = estimate_step_memory(dataclasses.replace(setup, activation_checkpointing=False)).moments["layer_backward"]
    assert off > on + 10 * 1e9  # 28 layers' activations at 4096 tokens: tens of GB


@pytest.mark.parametrize("recipe", ["sft", "dpo", "grpo"])
def test_qwen25_7b_recipes_fit_an_80gb_gpu_on_8(recipe):
    estimate = estimate_step_memory(gpu_recipe_setup(SHAPES["qwen2.5-7b"], recipe))
    n = SHAPES["qwen2.5-7b"].num_parameters()
    assert estimate.terms["params_shard"] + estimate.terms["optimizer_shard"] == n * 12 // 8
    assert estimate.total < 80e9, {k: round(v / 1e9, 2) for k, v in estimate.terms.items()}
    if recipe == "grpo":
        assert estimate.terms["engine_weights"] == n * 2  # bf16, one copy
    # the same step without FSDP (everything replicated: 16 bytes a parameter) does not fit
    assert estimate_step_memory(dataclasses.replace(gpu_recipe_setup(SHAPES["qwen2.5-7b"], recipe), world_size=1)).total > 80e9
