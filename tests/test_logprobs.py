"""Chunked log-probs (mlplat.train.logprobs): the numbers of full logits, without full-vocabulary logits for the batch."""

from __future__ import annotations

import pytest
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
    from mlplat.rl.objectives import GRPOObjective
    from train_apps.dpo import DPOObjective
    from train_apps.grpo import GRPOConfig

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
        step(model, GRPOObjective.from_config(grpo), {**grpo_batch, "old_logprobs": scored["logprobs"], "ref_logprobs": ref["logprobs"]})

    runs = {
        "sft": lambda model: step(model),
        "dpo": lambda model: step(model, DPOObjective(reference, beta=0.1)),
        "grpo": grpo_step,
    }
    for name, run in runs.items():
        assert 0 < largest_rows(run, install_logprob_head(load_model(tiny_model), chunk_tokens=chunk)) <= chunk, name
    assert largest_rows(runs["sft"], load_model(tiny_model)) >= rows * (length - 1)  # the whole batch's logits: caught


# -- the serving engine's log-probs: each generated token's top alternatives, and the prompt's (echo + logprobs) ---------
def _engine(tiny_model, **kw):
    from mlplat.engine import EngineConfig, LLMEngine

    # 4-token blocks and 5-token steps: prompts are prefilled in chunks, and their full blocks land in the prefix cache
    return LLMEngine(EngineConfig(model=str(tiny_model), block_size=4, num_kv_blocks=64, max_num_batched_tokens=5, **kw))


def _run(engine, prompt, params):
    out = engine.generate([prompt], params)[0]
    engine.block_manager.check_invariants(engine.live_sequences())
    assert engine.block_manager.num_free_blocks == len(engine.block_manager.blocks)
    return out


PROMPT = "What is 12 + 34? Answer with the digits"


def test_engine_top_logprobs_and_prompt_logprobs(tiny_model):
    from mlplat.engine import SamplingParams

    engine = _engine(tiny_model)
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)
    _run(engine, prompt, SamplingParams(temperature=0, max_tokens=2))  # the prompt's blocks are now in the prefix cache
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=3, prompt_logprobs=2, n=2)
    out = _run(engine, prompt, params)
    for o in out.outputs:
        assert len(o.top_logprobs) == len(o.token_ids) == 6
        for token, logprob, alternatives in zip(o.token_ids, o.logprobs, o.top_logprobs):
            ids, values = zip(*alternatives)
            assert len(ids) == 3 and list(values) == sorted(values, reverse=True)
            assert ids[0] == token and abs(values[0] - logprob) < 1e-6  # greedy: the top-1 is the chosen token
    # The prompt's log-probs, computed during its (chunked) prefill despite the cached prefix, are what scoring gives.
    assert out.prompt_logprobs[0] == (None, None) and len(out.prompt_logprobs) == len(prompt)
    expected = engine.score(prompt)
    torch.testing.assert_close(torch.tensor([lp for lp, _ in out.prompt_logprobs[1:]]), torch.tensor(expected), atol=1e-5, rtol=1e-5)
    for (logprob, alternatives) in out.prompt_logprobs[1:]:
        assert len(alternatives) == 2 and alternatives[0][1] >= alternatives[1][1] >= -1e9 and logprob <= alternatives[0][1] + 1e-6
    # Asking nothing returns nothing; over the engine's max_logprobs is refused by name.
    plain = _run(engine, prompt, SamplingParams(temperature=0, max_tokens=3, logprobs=True))
    assert plain.prompt_logprobs is None and plain.outputs[0].top_logprobs is None
    torch.testing.assert_close(torch.tensor(plain.outputs[0].logprobs), torch.tensor(out.outputs[0].logprobs[:3]), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="top_logprobs: 21 is over this engine's max_logprobs"):
        engine.add_request(prompt, SamplingParams(logprobs=True, top_logprobs=21))


def test_top_logprobs_through_the_pd_handoff_and_speculative_decoding(tiny_model):
    from mlplat.engine import SamplingParams
    from mlplat.engine.config import SpeculativeConfig

    prefill, decode = _engine(tiny_model), _engine(tiny_model)
    prompt = prefill.tokenizer.encode(PROMPT, add_special_tokens=False)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=True, top_logprobs=2, prompt_logprobs=1)
    alone = _run(_engine(tiny_model), prompt, params)
    payload = prefill.prefill(prompt, params)
    assert payload.first_top_logprobs[0][0] == payload.first_token and len(payload.prompt_logprobs) == len(prompt)
    decode.add_prefilled(payload, params, "r")
    done = [o for _ in range(20) for o in decode.step()]
    assert done[0].prompt_logprobs == alone.prompt_logprobs
    assert done[0].outputs[0].token_ids == alone.outputs[0].token_ids
    for got, want in zip(done[0].outputs[0].top_logprobs, alone.outputs[0].top_logprobs):
        assert [t for t, _ in got] == [t for t, _ in want]
        torch.testing.assert_close(torch.tensor([lp for _, lp in got]), torch.tensor([lp for _, lp in want]), atol=1e-5, rtol=1e-5)
    # Accepted drafts get their alternatives too, from the verifying rows.
    spec = _engine(tiny_model, speculative=SpeculativeConfig(method="ngram", num_speculative_tokens=3))
    drafted = _run(spec, prompt, params.model_copy(update={"prompt_logprobs": None}))
    assert spec.speculator.num_draft_tokens > 0
    ids = lambda out: [[t for t, _ in alt] for alt in out.outputs[0].top_logprobs]  # noqa: E731
    assert ids(drafted) == ids(alone)


def test_prompt_logprobs_survive_preemption_mid_prefill(tiny_model):
    """A prompt whose log-probs are asked for, preempted part-way through its chunked prefill (a decoding request needs its
    blocks), is recomputed from the start: each position's log-prob is recorded once and equals scoring's."""
    from mlplat.engine import EngineConfig, LLMEngine, SamplingParams

    engine = LLMEngine(EngineConfig(model=str(tiny_model), block_size=4, num_kv_blocks=5, max_num_batched_tokens=4))
    prompt = engine.tokenizer.encode(PROMPT, add_special_tokens=False)[:12]
    decoding = engine.add_request(prompt[:6], SamplingParams(temperature=0, max_tokens=14, ignore_eos=True))
    for _ in range(3):
        engine.step()  # the first request is decoding, and will need a block every 4 tokens
    asking = engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, prompt_logprobs=1))
    done = {}
    while engine.has_unfinished:
        done |= {out.request_id: out for out in engine.step()}
        engine.block_manager.check_invariants(engine.live_sequences())
    assert engine.scheduler.num_preemptions > 0 and set(done) == {decoding, asking}
    logprobs = done[asking].prompt_logprobs
    assert len(logprobs) == len(prompt) and logprobs[0] == (None, None)
    torch.testing.assert_close(torch.tensor([lp for lp, _ in logprobs[1:]]), torch.tensor(engine.score(prompt)), atol=1e-5, rtol=1e-5)
