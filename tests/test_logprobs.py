"""Chunked log-probs (mlplat.train.logprobs): the numbers of full logits, without full-vocabulary logits for the batch."""

from __future__ import annotations

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlplat.models import load_model
from mlplat.train.batch import IGNORE_INDEX
from mlplat.train.logprobs import TokenLogprobHead, install_logprob_head, labelled_logprobs, labelled_logprobs_and_entropy
from mlplat.train.memory import VocabTensorWatch
from mlplat.train.optim import OptimizerConfig, build_lr_scheduler
from mlplat.train.step import train_step


def full_logits_reference(model, batch, temperature):
    """Log-probs and entropies [B, L-1] from the whole [B, L, V] logit tensor (the plain computation)."""
    logp = torch.log_softmax(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1].float() / temperature, -1)
    targets = batch["labels"][:, 1:]
    mask = targets != IGNORE_INDEX
    picked = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * mask
    return picked, -(logp.exp() * logp).sum(-1) * mask


def random_batch(vocab: int, rows: int, length: int, prompt: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, vocab, (rows, length), generator=g)
    labels = ids.clone()
    labels[:, :prompt] = IGNORE_INDEX
    lengths = torch.randint(prompt, length + 1, (rows,), generator=g)  # right padding after each row's length
    attention = (torch.arange(length)[None] < lengths[:, None]).long()
    labels[attention == 0] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": attention, "labels": labels}


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(rows=st.integers(1, 4), length=st.integers(2, 12), prompt=st.integers(0, 6), chunk=st.integers(1, 40),
       temperature=st.sampled_from([0.5, 1.0, 1.7]), seed=st.integers(0, 1000))  # fmt: skip
def test_chunked_head_gives_the_log_probs_entropy_and_gradients_of_full_logits(tiny_model, rows, length, prompt, chunk, temperature, seed):
    plain, chunked = load_model(tiny_model), install_logprob_head(load_model(tiny_model), chunk_tokens=chunk)
    batch = random_batch(plain.config.vocab_size, rows, length, min(prompt, length - 1), seed)
    logprobs, entropy = labelled_logprobs_and_entropy(chunked, batch, temperature)
    expected_logprobs, expected_entropy = full_logits_reference(plain, batch, temperature)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(entropy, expected_entropy, atol=2e-5, rtol=1e-5)

    labelled_logprobs(chunked, batch, temperature).sum().backward()
    expected_logprobs.sum().backward()
    for (name, p), q in zip(chunked.named_parameters(), plain.parameters()):
        if q.grad is not None:
            torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-4, msg=name)


def test_the_head_is_the_plain_layer_without_a_request_and_keeps_weights_tied(tiny_model):
    plain, model = load_model(tiny_model), install_logprob_head(load_model(tiny_model))
    assert isinstance(model.lm_head, TokenLogprobHead) and model.lm_head.weight is model.model.embed_tokens.weight
    assert install_logprob_head(model).lm_head is model.lm_head  # idempotent
    assert model.state_dict().keys() == plain.state_dict().keys()
    ids = torch.tensor([[5, 6, 7, 8]])
    torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits)  # generation and evaluation see logits


def test_recipe_steps_never_hold_logits_for_more_than_a_chunk_and_the_unchunked_path_is_caught(tiny_model):
    """SFT's loss, a DPO step and GRPO's scoring and step, watched under a TorchDispatchMode: with the head, no tensor with
    a vocabulary dimension holds more than chunk_tokens rows; a plain model's forward holds the whole batch's."""
    from mlplat.rl.experience import score_completions
    from train_apps.dpo import DPOObjective
    from train_apps.grpo import GRPOConfig, GRPOObjective

    chunk, rows, length = 8, 4, 24
    base = load_model(tiny_model)
    vocab, hidden = base.config.vocab_size, base.config.hidden_size
    batch = random_batch(vocab, rows, length, prompt=6, seed=0)
    grpo_batch = {**batch, "advantages": torch.tensor([1.0, -1.0, 0.5, -0.5])}
    grpo = GRPOConfig(model="/m", data={"path": "/p"}, num_generations=2, beta=0.1)
    reference = install_logprob_head(load_model(tiny_model), chunk_tokens=chunk).eval()

    def step(model, objective=None, batch=batch):
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
        return train_step(model, batch, optimizer, build_lr_scheduler(optimizer, OptimizerConfig(), 10), 1.0, objective=objective)

    def largest_rows(run, model) -> int:
        with VocabTensorWatch(vocab, hidden) as watch:
            run(model)
        return watch.largest_rows

    def grpo_step(model):
        scored = score_completions(model, grpo_batch, 2, 1.0, entropy=True)
        ref = score_completions(reference, grpo_batch, 2, 1.0)
        step(model, GRPOObjective(grpo), {**grpo_batch, "old_logprobs": scored["logprobs"], "ref_logprobs": ref["logprobs"]})

    runs = {
        "sft": lambda model: step(model),
        "dpo": lambda model: step(model, DPOObjective(reference, beta=0.1)),
        "grpo": grpo_step,
    }
    for name, run in runs.items():
        assert 0 < largest_rows(run, install_logprob_head(load_model(tiny_model), chunk_tokens=chunk)) <= chunk, name
    assert largest_rows(runs["sft"], load_model(tiny_model)) >= rows * (length - 1)  # the whole batch's logits: caught
