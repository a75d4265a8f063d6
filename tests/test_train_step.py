"""The train step on one process: gradient accumulation is exact, non-finite steps are skipped."""

import math

import pytest
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


def _pairs(pairs: int, length: int = 16, seed: int = 1) -> dict[str, torch.Tensor]:
    """A PairCollate-shaped batch: ``pairs`` chosen rows, then their rejected rows; prompts (first 4 tokens) unlabelled."""
    batch = _batch(2 * pairs, length, seed)
    batch["labels"][:, :4] = -100
    return batch


def _pair_halves(batch: dict[str, torch.Tensor]) -> list[dict[str, torch.Tensor]]:
    """Two micro-batches of whole pairs: each keeps its chosen rows first and their rejected rows after."""
    pairs = batch["input_ids"].shape[0] // 2
    rows = [[*range(pairs // 2), *range(pairs, pairs + pairs // 2)], [*range(pairs // 2, pairs), *range(pairs + pairs // 2, 2 * pairs)]]
    return [{k: v[r] for k, v in batch.items()} for r in rows]


@pytest.mark.parametrize("recipe", ["reward_model", "dpo"])
def test_preference_objectives_accumulate_exactly_and_skip_non_finite_steps(recipe, tiny_model):
    from mlplat.models import load_reward_model
    from train_apps.dpo import DPOObjective
    from train_apps.reward_model import PairwiseObjective

    def setup():
        model = load_reward_model(tiny_model) if recipe == "reward_model" else load_model(tiny_model)
        torch.manual_seed(0)
        if recipe == "reward_model":
            torch.nn.init.normal_(model.score.weight, std=0.5)  # a fresh head: identical in both copies
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, optimizer, build_lr_scheduler(optimizer, OptimizerConfig(lr=0.1, warmup_steps=1), 10)

    reference = load_model(tiny_model).eval().requires_grad_(False)
    objective = PairwiseObjective() if recipe == "reward_model" else DPOObjective(reference, beta=0.5, label_smoothing=0.1)
    batch = _pairs(4)
    whole, accumulated = setup(), setup()
    for _ in range(2):  # the second step starts from weights the first one moved
        a = train_step(whole[0], batch, *whole[1:], grad_clip=10.0, objective=objective)
        b = train_step(accumulated[0], _pair_halves(batch), *accumulated[1:], grad_clip=10.0, objective=objective)
        assert a.units == b.units == 4 and not a.skipped  # the units are pairs
        assert math.isclose(a.loss, b.loss, rel_tol=1e-5) and math.isclose(a.grad_norm, b.grad_norm, rel_tol=1e-4)
        assert a.metrics.keys() == b.metrics.keys() and a.metrics == pytest.approx(b.metrics, rel=1e-5, abs=1e-6)
    for p, q in zip(whole[0].parameters(), accumulated[0].parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4)

    # The loss is the mean over pairs of the per-pair loss, computed here from the model's own outputs.
    model = whole[0]
    with torch.no_grad():
        if recipe == "reward_model":
            scores = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, 0]
            expected = sum(math.log1p(math.exp(-(scores[i] - scores[i + 4]).item())) for i in range(4)) / 4
        else:
            from mlplat.train.logprobs import sequence_logprobs

            pi, ref = sequence_logprobs(model, batch), sequence_logprobs(reference, batch)
            margins = [0.5 * ((pi[i] - ref[i]) - (pi[i + 4] - ref[i + 4])).item() for i in range(4)]
            expected = sum(0.9 * math.log1p(math.exp(-m)) + 0.1 * math.log1p(math.exp(m)) for m in margins) / 4
    state = train_step(model, batch, *whole[1:], grad_clip=10.0, objective=objective)
    assert state.loss == pytest.approx(expected, rel=1e-5)

    # A poisoned batch: no update, the step reported as skipped.
    model, optimizer, scheduler = setup()
    with torch.no_grad():
        next(model.parameters()).fill_(float("nan"))
    weights = [p.detach().clone() for p in model.parameters()]
    assert train_step(model, batch, optimizer, scheduler, grad_clip=10.0, objective=objective).skipped
    for p, w in zip(model.parameters(), weights):
        torch.testing.assert_close(p, w, equal_nan=True)
