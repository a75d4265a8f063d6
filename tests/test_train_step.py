"""The train step on one process: gradient accumulation is exact, non-finite steps are skipped."""

import math

import torch

from mlplat.models import load_model
from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
from mlplat.train.perf import PhaseTimer, flops_per_token
from mlplat.train.step import train_step


def _batch(rows: int, length: int = 24, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(4, 300, (rows, length), generator=g)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, length // 2 :] = 0  # one short row: tokens differ per micro-batch
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


def _setup(tiny_model, sgd: bool = False):
    model = load_model(tiny_model)
    # SGD where weights are compared: Adam's normalised update blows float noise in near-zero gradients up to lr.
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1) if sgd else build_optimizer(model, OptimizerConfig(lr=1e-2, warmup_steps=1))
    return model, optimizer, build_lr_scheduler(optimizer, OptimizerConfig(lr=1e-2, warmup_steps=1), 10)


def test_gradient_accumulation_equals_one_big_batch(tiny_model):
    batch = _batch(8)
    halves = [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}]
    whole, accumulated = _setup(tiny_model, sgd=True), _setup(tiny_model, sgd=True)
    for _ in range(2):
        a = train_step(whole[0], batch, *whole[1:], grad_clip=1.0)
        b = train_step(accumulated[0], halves, *accumulated[1:], grad_clip=1.0)
        assert math.isclose(a.loss, b.loss, rel_tol=1e-5) and math.isclose(a.grad_norm, b.grad_norm, rel_tol=1e-4)
        assert a.tokens == b.tokens == 8 * 24 - 12 and a.slots == b.slots == 8 * 24 and not a.skipped
    for p, q in zip(whole[0].parameters(), accumulated[0].parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)


def test_non_finite_step_is_skipped_without_touching_weights(tiny_model):
    model, optimizer, scheduler = _setup(tiny_model)
    timer = PhaseTimer(torch.device("cpu"))
    weight = model.model.layers[0].mlp.up_proj.weight
    saved = weight.detach().clone()
    with torch.no_grad():
        weight[0, 0] = float("inf")
    stats = train_step(model, _batch(4), optimizer, scheduler, grad_clip=1.0, timer=timer)
    assert stats.skipped and not math.isfinite(stats.loss)
    assert all(p.grad is None for p in model.parameters())  # nothing left to leak into the next step
    assert scheduler.last_epoch == 1  # the schedule still follows the step count
    with torch.no_grad():
        weight[0, 0] = saved[0, 0]
    torch.testing.assert_close(weight, saved)  # the optimizer did not apply the NaN update
    stats = train_step(model, _batch(4), optimizer, scheduler, grad_clip=1.0, timer=timer)
    assert not stats.skipped and math.isfinite(stats.loss)
    assert not torch.equal(weight, saved)
    assert set(timer.reset()) == {"comm", "forward", "backward", "optimizer"}


def test_flops_per_token_counts_matmuls_with_the_tied_lm_head_and_attention(tiny_model):
    model = load_model(tiny_model)
    c = model.config
    assert c.tie_word_embeddings  # the LM head shares the embedding: counted once as a matmul, never as a lookup
    layers = sum(p.numel() for p in model.model.layers.parameters()) + model.model.norm.weight.numel()
    lm_head = c.vocab_size * c.hidden_size
    assert flops_per_token(model, 128) == 6 * (layers + lm_head) + 12 * c.num_hidden_layers * c.hidden_size * 128
