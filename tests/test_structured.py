"""Structured outputs in the engine, without Ray: grammar masks in the batched sampler, the compile cache and its
limits, n > 1, the PD handoff, speculation, and Hypothesis-drawn JSON schemas whose output always validates on
the untrained tiny model."""

from __future__ import annotations

import json
import re
import time

import jsonschema
import llguidance
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
from mlplat.engine.config import SpeculativeConfig
from mlplat.engine.structured import GrammarCompiler, StructuredLimits, StructuredOutputs, apply_masks

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 8},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
        "count": {"type": "integer", "minimum": 0, "maximum": 999},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "tags", "count", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def engine(tiny_model):
    return LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=128, max_num_seqs=8))


def structured(**spec) -> StructuredOutputs:
    return StructuredOutputs(**spec)


def test_json_schema_output_always_validates_with_n_samples_and_compiles_once(engine):
    params = SamplingParams(max_tokens=120, temperature=1.0, n=3, seed=7, structured=structured(json=SCHEMA))
    compiled = engine.grammars.num_compiled
    outs = engine.generate(["hello", "What is 1 + 2?"], params)
    assert engine.grammars.num_compiled == compiled + 1  # one grammar for both prompts and all samples
    texts = [c.text for o in outs for c in o.outputs]
    assert len(texts) == 6 and len(set(texts)) > 1  # samples differ: each has its own grammar state
    for o in outs:
        for c in o.outputs:
            assert c.finish_reason == "stop"
            jsonschema.validate(json.loads(c.text), SCHEMA)
    engine.generate(["again"], params.model_copy(update={"n": 1}))
    assert engine.grammars.num_compiled == compiled + 1  # the same schema again: cached, nothing compiled


def test_regex_choice_grammar_and_json_object(engine):
    cases = [
        (structured(regex=r"[a-c]{3}-\d\d"), lambda t: re.fullmatch(r"[a-c]{3}-\d\d", t)),
        (structured(choice=["yes", "no", "maybe"]), lambda t: t in {"yes", "no", "maybe"}),
        (structured(grammar='start: "x" ("+" "x"){0,3} "=" NUM\nNUM: /[0-9]{1,3}/'), lambda t: re.fullmatch(r"x(\+x){0,3}=[0-9]{1,3}", t)),
        (structured(json_object=True), lambda t: isinstance(json.loads(t), dict)),
    ]
    for spec, check in cases:
        for seed in range(3):
            out = engine.generate(["hi"], SamplingParams(max_tokens=60, temperature=1.0, seed=seed, structured=spec))[0].outputs[0]
            if spec.json_object and out.finish_reason == "length":
                continue  # any object: an untrained model may go on past max_tokens
            assert check(out.text), (spec, out.text)


def test_greedy_constrained_row_masked_and_free_rows_untouched(engine):
    free = SamplingParams(max_tokens=6, temperature=0)
    expected = engine.generate(["hello"], free)[0].outputs[0].text
    outs = engine.generate(["hello", "hello"], [free, SamplingParams(max_tokens=20, temperature=0, structured=structured(choice=["zz"]))])
    assert outs[0].outputs[0].text == expected  # the batch's other row is not constrained
    assert outs[1].outputs[0].text == "zz"


def test_apply_masks_touches_constrained_rows_only(engine):
    matcher = engine.grammars.matcher(structured(choice=["a"]))
    logits = torch.zeros(3, engine.vocab_size)
    apply_masks(logits, [None, matcher, None])
    assert (logits[[0, 2]] == 0).all()  # untouched
    allowed = (logits[1] == 0).nonzero().flatten().tolist()
    assert (logits[1][logits[1] != 0] <= -1e29).all()  # refused: probability 0 after softmax
    assert torch.softmax(logits[1], -1)[allowed].sum() == 1
    assert allowed and all(engine.tokenizer.decode([t]) in ("a", "") or "a".startswith(engine.tokenizer.decode([t])) for t in allowed)


def test_bad_or_oversized_or_slow_grammar_fails_its_own_request_only(engine, tiny_model):
    with pytest.raises(ValueError, match="invalid grammar or schema"):
        engine.add_request("hi", SamplingParams(structured=structured(grammar="start: undefined_rule")))
    with pytest.raises(ValueError, match="invalid grammar or schema"):
        engine.add_request("hi", SamplingParams(structured=structured(json='{"type": ')))
    assert not engine.has_unfinished  # nothing of the refused requests was queued
    out = engine.generate(["hello"], SamplingParams(max_tokens=4, temperature=0))[0]  # others run on
    assert out.outputs[0].finish_reason
    limits = StructuredLimits(max_grammar_bytes=200, compile_timeout_s=0.2)
    small = GrammarCompiler(engine.tokenizer, engine.vocab_size, engine.eos_token_ids, limits)
    with pytest.raises(ValueError, match="max_grammar_bytes"):
        small.matcher(structured(json={"enum": ["x" * 300]}))
    build = small._build
    small._build = lambda spec: (time.sleep(1.0), build(spec))[1]  # a grammar that takes longer than the limit
    start = time.perf_counter()
    with pytest.raises(ValueError, match="compile_timeout_s"):
        small.matcher(structured(regex="[0-9]+"))
    assert time.perf_counter() - start < 0.9  # the caller is not held past the limit


def test_pd_handoff_continues_the_grammar(engine):
    params = SamplingParams(max_tokens=120, temperature=1.0, seed=3, structured=structured(json=SCHEMA))
    payload = engine.prefill("hello", params)
    rid = engine.add_prefilled(payload, params)
    done = {}
    while engine.has_unfinished:
        done |= {o.request_id: o for o in engine.step()}
    text = done[rid].outputs[0].text
    assert done[rid].outputs[0].token_ids[0] == payload.first_token
    jsonschema.validate(json.loads(text), SCHEMA)


def test_speculation_is_off_for_constrained_requests(tiny_model):
    spec = LLMEngine(EngineConfig(model=str(tiny_model), num_kv_blocks=64, speculative=SpeculativeConfig(method="ngram")))
    assert SamplingParams(structured=structured(json=SCHEMA)).adjusts_logits  # the speculator skips such sequences
    outs = spec.generate(["hello"] * 2, SamplingParams(max_tokens=120, temperature=1.0, seed=1, structured=structured(json=SCHEMA)))
    for o in outs:
        jsonschema.validate(json.loads(o.outputs[0].text), SCHEMA)
    assert spec.speculator.drafter is not None and spec.spec_acceptance_rate == 0.0


# -- Hypothesis: small JSON schemas ----------------------------------------------------------------------------
leaf = st.one_of(
    st.builds(lambda n: {"type": "string", "maxLength": n}, st.integers(0, 6)),
    st.builds(lambda lo, w: {"type": "integer", "minimum": lo, "maximum": lo + w}, st.integers(-50, 50), st.integers(0, 100)),
    st.just({"type": "boolean"}),
    st.just({"type": "null"}),
    st.builds(lambda vs: {"enum": vs}, st.lists(st.sampled_from(["a", "b", 1, 2, True, None]), min_size=1, max_size=3, unique=True)),
)


def _object(children):
    return st.builds(
        lambda props, k: {"type": "object", "properties": props, "required": sorted(props)[:k], "additionalProperties": False},
        st.dictionaries(st.sampled_from(["a", "b", "c", "d"]), children, min_size=1, max_size=3),
        st.integers(0, 3),
    )


schemas = st.recursive(
    leaf,
    lambda children: st.one_of(
        _object(children), st.builds(lambda items, n: {"type": "array", "items": items, "maxItems": n}, children, st.integers(0, 3))
    ),
    max_leaves=6,
)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(schema=schemas, seed=st.integers(0, 1000))
def test_generated_schemas_always_validate(engine, schema, seed):
    assert llguidance.LLMatcher.validate_grammar(llguidance.LLMatcher.grammar_from_json_schema(schema)) == ""
    out = engine.generate(["hi"], SamplingParams(max_tokens=200, temperature=1.0, seed=seed, structured=structured(json=schema)))[0]
    assert out.outputs[0].finish_reason == "stop", (schema, out.outputs[0].text)
    jsonschema.validate(json.loads(out.outputs[0].text), schema)
