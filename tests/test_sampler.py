"""The batched sampler against a per-request reference written with plain loops: logit_bias, min_tokens,
presence / frequency / repetition penalties, temperature, top-k, top-p, min-p; seeded draws that do not
depend on the batch; and SamplingParams refusing out-of-range values. The engine-level effects (a
request's output) are in tests/test_engine.py."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from mlplat.engine.sampling import SamplingParams, adjust_logits, draw, sample, sampling_probs

EOS = 0


@dataclass
class History:  # what the engine's Sequence gives the sampler
    token_ids: list[int]
    num_prompt_tokens: int


# -- the reference: one request at a time, one token at a time ------------------------------------------
def reference_logits(logits: list[float], p: SamplingParams, prompt: list[int], output: list[int], eos: set[int]) -> list[float]:
    """vLLM's order: logit_bias, min_tokens' mask, repetition penalty, frequency penalty, presence penalty."""
    x = list(logits)
    for t, bias in p.logit_bias.items():
        x[t] += bias
    if len(output) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else eos):
            x[t] = -math.inf
    for t in range(len(x)):
        if t in prompt or t in output:
            x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
        x[t] -= p.frequency_penalty * output.count(t)
        x[t] -= p.presence_penalty * (t in output)
    return x


def reference_probs(x: list[float], p: SamplingParams) -> list[float]:
    """Temperature, top-k (ties with the k-th kept), softmax, top-p (the smallest prefix reaching it), min-p."""
    z = [v / p.temperature for v in x]
    if 0 < p.top_k < len(z):
        kth = sorted(z, reverse=True)[p.top_k - 1]
        z = [v if v >= kth else -math.inf for v in z]
    top = max(z)
    e = [math.exp(v - top) for v in z]
    probs = [v / sum(e) for v in e]
    if p.top_p < 1.0:
        mass, kept = 0.0, set()
        for t in sorted(range(len(probs)), key=lambda t: -probs[t]):
            if mass >= p.top_p:
                break
            kept.add(t)
            mass += probs[t]
        probs = [v if t in kept else 0.0 for t, v in enumerate(probs)]
    floor = p.min_p * max(probs)
    probs = [v if v >= floor else 0.0 for v in probs]
    return [v / sum(probs) for v in probs]


# -- random batches: logits [B, V], each row with its own controls and token history --------------------
@st.composite
def rows(draw, vocab: int):
    token = st.integers(0, vocab - 1)
    params = SamplingParams(
        temperature=draw(st.sampled_from([0.0, 0.5, 1.0, 1.7])),
        top_k=draw(st.sampled_from([-1, 1, 3, 8])),
        top_p=draw(st.sampled_from([1.0, 0.9, 0.6])),
        min_p=draw(st.sampled_from([0.0, 0.05, 0.3])),
        presence_penalty=draw(st.sampled_from([0.0, 0.0, -1.5, 0.7, 2.0])),
        frequency_penalty=draw(st.sampled_from([0.0, 0.0, -0.5, 1.2, 2.0])),
        repetition_penalty=draw(st.sampled_from([1.0, 1.0, 0.6, 1.3, 2.5])),
        logit_bias=draw(st.dictionaries(token, st.floats(-100, 100), max_size=3)),
        min_tokens=draw(st.integers(0, 3)),
        stop_token_ids=draw(st.lists(st.integers(1, 2), max_size=2)),  # with EOS = 0, at least one token stays unmasked
        ignore_eos=draw(st.booleans()),
    )
    return params, History(draw(st.lists(token, min_size=1, max_size=14)), 0)


@st.composite
def batches(draw):
    vocab = draw(st.integers(4, 24))
    batch = draw(st.lists(rows(vocab), min_size=1, max_size=6))
    for _, h in batch:  # split each history into its prompt and its output
        h.num_prompt_tokens = draw(st.integers(1, len(h.token_ids)))
    logits = torch.randn(len(batch), vocab, generator=torch.Generator().manual_seed(draw(st.integers(0, 2**16)))) * 3
    return logits, [p for p, _ in batch], [h for _, h in batch]


@settings(max_examples=50, deadline=None)
@given(batches())
def test_batched_sampler_equals_the_per_request_reference(batch):
    logits, params, history = batch
    adjusted = adjust_logits(logits, params, history, {EOS})
    tokens, logprobs = sample(logits, params, [None] * len(params), history, {EOS})
    for i, (p, h) in enumerate(zip(params, history)):
        prompt, output = h.token_ids[: h.num_prompt_tokens], h.token_ids[h.num_prompt_tokens :]
        expected = reference_logits(logits[i].tolist(), p, prompt, output, {EOS})
        torch.testing.assert_close(adjusted[i], torch.tensor(expected), rtol=1e-5, atol=1e-5)
        if p.greedy:  # the argmax of the adjusted logits (a tie may go either way)
            assert expected[int(tokens[i])] >= max(expected) - 1e-4
        else:
            probs = reference_probs(expected, p)
            torch.testing.assert_close(sampling_probs(adjusted[i : i + 1], [p])[0], torch.tensor(probs), rtol=0, atol=1e-5)
            assert probs[int(tokens[i])] > 0  # drawn from that distribution's support
    # The log-probs stay the raw model's, whatever the controls did.
    torch.testing.assert_close(logprobs, torch.log_softmax(logits, -1).gather(1, tokens[:, None])[:, 0])
    # One row's distribution does not depend on the rows batched with it.
    sampled = [i for i, p in enumerate(params) if not p.greedy]
    if sampled:
        together = sampling_probs(adjusted[sampled], [params[i] for i in sampled])
        alone = torch.cat([sampling_probs(adjusted[i : i + 1], [params[i]]) for i in sampled])
        torch.testing.assert_close(together, alone, rtol=0, atol=1e-6)


def test_draw_samples_each_row_from_its_distribution():
    probs = torch.softmax(torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, -3.0]), -1).masked_fill(torch.arange(6) == 3, 0.0)
    probs /= probs.sum()
    torch.manual_seed(0)
    counts = torch.bincount(draw(probs.expand(40_000, 6), [None] * 40_000), minlength=6)
    assert counts[3] == 0  # a dropped token is never drawn
    torch.testing.assert_close(counts / 40_000, probs, atol=0.01, rtol=0)


def test_logit_bias_and_top_k_1_in_the_sampler():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(1))
    forced = [SamplingParams(temperature=t, logit_bias={17: 100.0}) for t in (0.0, 1.0)]
    tokens, _ = sample(logits[:2], forced, [None, None])
    assert tokens.tolist() == [17, 17]
    top_1 = [SamplingParams(temperature=1.5, top_k=1, seed=s) for s in range(4)]
    assert sample(logits, top_1, [torch.Generator().manual_seed(s) for s in range(4)])[0].tolist() == logits.argmax(-1).tolist()


def test_a_seed_draws_the_same_alone_and_in_a_batch_of_8():
    """A seeded row's draws depend on its logits, controls and generator only, not on the 7 rows beside it."""
    vocab, steps = 64, 30
    target = SamplingParams(temperature=0.9, top_k=40, top_p=0.95, min_p=0.01, presence_penalty=0.4, repetition_penalty=1.2, seed=7)
    others = [
        SamplingParams(temperature=0.0, logit_bias={3: 5.0}),
        SamplingParams(temperature=1.0, seed=7),  # the same seed, other controls
        SamplingParams(temperature=1.0),  # unseeded: the global RNG
        SamplingParams(temperature=0.7, top_p=0.5, frequency_penalty=2.0, seed=1),
        SamplingParams(temperature=1.2, min_p=0.2, min_tokens=5, seed=2),
        SamplingParams(temperature=0.0, repetition_penalty=2.0),
        SamplingParams(temperature=1.0, top_k=1, logit_bias={9: -100.0}),
    ]
    all_logits = torch.randn(steps, 8, vocab, generator=torch.Generator().manual_seed(0)) * 2

    def run(params: list[SamplingParams]) -> list[int]:
        generators = [None if p.seed is None else torch.Generator().manual_seed(p.seed) for p in params]
        history = [History([1, 2, 3, 4], 4) for _ in params]
        for logits in all_logits[:, : len(params)]:
            for h, t in zip(history, sample(logits, params, generators, history, {EOS})[0].tolist()):
                h.token_ids.append(t)
        return history[0].token_ids[4:]

    alone = run([target])
    assert run([target, *others]) == alone
    assert len(set(alone)) > 5  # really sampled


def test_penalties_and_min_tokens_need_the_history():
    with pytest.raises(ValueError, match="history"):
        sample(torch.zeros(1, 8), [SamplingParams(presence_penalty=1.0)], [None])


@pytest.mark.parametrize("field, value", [
    ("presence_penalty", 3.0), ("presence_penalty", -2.5), ("frequency_penalty", 2.1), ("min_p", 1.5), ("min_p", -0.1),
    ("repetition_penalty", 0.0), ("repetition_penalty", -1.0), ("repetition_penalty", math.inf),
    ("logit_bias", {5: 200.0}), ("logit_bias", {-1: 1.0}), ("min_tokens", -1), ("min_tokens", 17),  # > max_tokens (16)
])  # fmt: skip
def test_out_of_range_values_are_refused(field, value):
    with pytest.raises(ValidationError, match=field):
        SamplingParams(**{field: value})


def test_new_params_survive_serialization():
    """The serving layer hands params over as model_dump() dicts (and JSON): the PD decode side gets them back."""
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=-1.0, repetition_penalty=1.3, logit_bias={5: -3.5, 9: 100.0},
                            min_tokens=4, min_p=0.1)  # fmt: skip
    assert SamplingParams(**params.model_dump()) == params
    assert SamplingParams.model_validate_json(params.model_dump_json()) == params


@settings(max_examples=30, deadline=None)
@given(batches(), st.data())
def test_top_logprobs_are_the_raw_distributions_k_likeliest_sorted_and_hold_the_greedy_token(batch, data):
    """Each asking row's k alternatives: the k largest raw log-probs, likeliest first; a greedy row's top-1 is its token
    where nothing adjusts its logits, and a chosen token at least as likely as the k-th is among them with its log-prob."""
    from mlplat.engine.sampling import top_logprobs

    logits, params, history = batch
    ks = data.draw(st.lists(st.integers(0, 6), min_size=len(params), max_size=len(params)))
    tokens, chosen, top = sample(logits, params, [None] * len(params), history, {EOS}, num_top_logprobs=ks)
    raw = torch.log_softmax(logits, -1)
    for i, k in enumerate(ks):
        if k == 0:
            assert top[i] is None
            continue
        ids, values = [t for t, _ in top[i]], [lp for _, lp in top[i]]
        assert len(ids) == min(k, logits.shape[1]) == len(set(ids))
        assert values == sorted(values, reverse=True)
        torch.testing.assert_close(torch.tensor(values), raw[i].topk(len(ids)).values)
        torch.testing.assert_close(torch.tensor(values), raw[i, ids])
        if params[i].greedy and not params[i].adjusts_logits:
            assert raw[i, int(tokens[i])] >= values[0] - 1e-6  # the greedy token is the top-1 (or tied with it)
        if float(chosen[i]) > values[-1] + 1e-6:  # the chosen token is likelier than the k-th: it is listed, with its log-prob
            assert abs(dict(top[i])[int(tokens[i])] - float(chosen[i])) < 1e-6
    assert sample(logits, params, [None] * len(params), history, {EOS}, num_top_logprobs=[0] * len(params))[2] == [None] * len(params)
    assert top_logprobs(raw, [0] * len(params)) == [None] * len(params)
