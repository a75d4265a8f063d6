"""The engine under generated interleavings (Hypothesis state machine, no Ray): requests added with any
sampling parameters (n, seeds, stop strings, stop tokens that may match the very first token), aborts
at any point, prefix hits, preemption under a small KV cache, KV payloads imported from a prefill
engine (some finishing on admission), bad prompts, and requests that fail inside a step. After every
step: block accounting is exact, every request ends exactly once (an output or an error), and the
engine keeps going. More examples: MLPLAT_HYPOTHESIS_EXAMPLES=2000 pytest tests/test_engine_state_machine.py
"""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from transformers import LlamaConfig, LlamaForCausalLM

from mlplat.engine import EngineConfig, LLMEngine, QueueFullError, SamplingParams, kv_transfer
from mlplat.models import load_tokenizer

EXAMPLES = int(os.environ.get("MLPLAT_HYPOTHESIS_EXAMPLES", "25"))
BLOCKS, BLOCK_SIZE, MAX_LEN = 12, 4, 64  # 48 tokens of KV: two long requests at once force preemption
BASES = [[5, 6, 7, 8, 9, 10, 11, 12], [40, 41, 42, 43, 44, 45, 46, 47]]  # shared prefixes: prefix hits
POISON = 99  # a request whose prompt holds it fails inside a step


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, tiny_model):
    torch.manual_seed(0)
    tokenizer = load_tokenizer(tiny_model)
    path = tmp_path_factory.mktemp("state_machine")
    LlamaForCausalLM(LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                 num_key_value_heads=1, max_position_embeddings=MAX_LEN, initializer_range=0.2,
                                 tie_word_embeddings=True)).save_pretrained(path)  # fmt: skip
    tokenizer.save_pretrained(path)
    return path


prompts = st.builds(lambda base, cut, tail: base[:cut] + tail, st.sampled_from(BASES), st.integers(0, 8),
                    st.lists(st.integers(3, 200), max_size=12)).filter(bool)  # fmt: skip
params = st.builds(
    SamplingParams,
    max_tokens=st.integers(1, 16),
    temperature=st.sampled_from([0.0, 1.0]),
    top_k=st.sampled_from([-1, 5]),
    seed=st.integers(0, 3),  # seeded: a replayed example must take the same path
    n=st.integers(1, 3),
    stop=st.lists(st.text("abcdefgh 0123", min_size=1, max_size=2), max_size=2),
    stop_token_ids=st.lists(st.integers(3, 200), max_size=3),
    ignore_eos=st.booleans(),
    logprobs=st.booleans(),
    prompt_logprobs=st.sampled_from([None, None, 0, 2]),  # computed during the (chunked, maybe preempted) prefill
)
# top_logprobs needs logprobs: 0 to 3 alternatives where it is on
params = st.tuples(params, st.integers(0, 3)).map(lambda p: p[0].model_copy(update={"top_logprobs": p[1] if p[0].logprobs else 0}))


def test_engine_state_machine(checkpoint):
    def make(**kw) -> LLMEngine:
        return LLMEngine(EngineConfig(model=str(checkpoint), block_size=BLOCK_SIZE, num_kv_blocks=BLOCKS, max_model_len=MAX_LEN,
                                      max_num_seqs=4, max_num_batched_tokens=16, max_waiting=6, **kw))  # fmt: skip

    class EngineMachine(RuleBasedStateMachine):
        def __init__(self):
            super().__init__()
            self.engine, self.prefill = make(), make()
            self.engine.fault_hook = lambda stage, seq: self._poisoned(stage, seq)
            self.live: dict[str, SamplingParams] = {}  # request id -> params, until it ends
            self.exports: set[str] = set()  # prefill-only requests (kv_transfer.add_export), batched with the rest
            self.ended: set[str] = set()

        @staticmethod
        def _poisoned(stage, seq):
            if stage == "sample" and POISON in seq.token_ids[: seq.num_prompt_tokens] and seq.num_output_tokens >= 1:
                raise RuntimeError("poisoned request")

        def _admit(self, add, params: SamplingParams) -> None:
            try:
                request_id = add()
            except (QueueFullError, ValueError):
                return  # refused: nothing of it may remain (checked by the invariants)
            self.live[request_id] = params

        @rule(prompt=prompts, params=params, poison=st.booleans())
        def add(self, prompt, params, poison):
            prompt = prompt + [POISON] if poison else prompt
            self._admit(lambda: self.engine.add_request(prompt, params), params)

        @rule(prompt=prompts, params=params)
        def export(self, prompt, params):
            try:
                request_id = kv_transfer.add_export(self.engine, prompt, params)
            except (QueueFullError, ValueError):
                return
            self.live[request_id] = params
            self.exports.add(request_id)

        @rule(prompt=prompts, params=params, stop_first=st.booleans())
        def add_prefilled(self, prompt, params, stop_first):
            try:  # n samples: one prefill, the prompt's blocks shared on import
                payload = self.prefill.prefill(prompt, params)
            except (QueueFullError, ValueError):
                return
            if stop_first:  # the first token already stops it: it finishes on admission
                params = params.model_copy(update={"stop_token_ids": [payload.first_token]})
            self._admit(lambda: self.engine.add_prefilled(payload, params), params)

        @rule(bad=st.sampled_from([[-1, 5], [5, 10**6], []]))
        def add_bad_prompt(self, bad):
            with pytest.raises(ValueError):
                self.engine.add_request(bad, SamplingParams())

        @precondition(lambda self: self.live)
        @rule(data=st.data())
        def abort(self, data):
            request_id = data.draw(st.sampled_from(sorted(self.live)))
            self.engine.abort(request_id)
            del self.live[request_id]
            self.ended.add(request_id)

        @rule()
        def step(self):
            for out in self.engine.step():
                assert out.request_id in self.live, f"{out.request_id} ended twice, or was never added"
                params = self.live.pop(out.request_id)
                self.ended.add(out.request_id)
                if out.error is not None:
                    assert "poisoned request" in str(out.error) and POISON in out.prompt_token_ids
                    continue
                if out.request_id in self.exports:  # its prompt's KV and every sample's first token
                    payload = out.kv_payload
                    assert len(payload.samples) == params.n and payload.prompt_token_ids == out.prompt_token_ids
                    assert payload.kv.shape[2] == len(out.prompt_token_ids)
                    continue
                assert sorted(o.index for o in out.outputs) == list(range(params.n))
                for o in out.outputs:
                    assert o.finish_reason in ("stop", "length") and len(o.sampled_token_ids) <= params.max_tokens
                    assert (o.logprobs is not None) == params.logprobs
                    assert (o.top_logprobs is not None) == (params.top_logprobs > 0)
                    if o.top_logprobs is not None:
                        assert len(o.top_logprobs) == len(o.token_ids) and all(len(a) == params.top_logprobs for a in o.top_logprobs)
                if params.prompt_logprobs is None:
                    assert out.prompt_logprobs is None
                else:  # every prompt position once, whatever chunking, preemption or a handoff did
                    assert len(out.prompt_logprobs) == len(out.prompt_token_ids) and out.prompt_logprobs[0] == (None, None)
                    assert all(lp <= 0 and len(alt or []) == params.prompt_logprobs for lp, alt in out.prompt_logprobs[1:])

        @invariant()
        def blocks_are_accounted_for(self):
            self.engine.block_manager.check_invariants(self.engine.live_sequences())
            assert set(self.engine.requests) == set(self.live) and set(self.engine.exports) <= set(self.live)
            if not self.engine.has_unfinished:
                assert not self.live and self.engine.block_manager.num_free_blocks == BLOCKS

        def teardown(self):
            for _ in range(500):  # every accepted request ends, one way or another
                if not self.engine.has_unfinished:
                    break
                self.step()
            assert not self.engine.has_unfinished and not self.live

    EngineMachine.TestCase.settings = settings(max_examples=EXAMPLES, stateful_step_count=30, deadline=None,
                                               suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much])  # fmt: skip
    EngineMachine.TestCase().runTest()


def test_a_prompt_that_skips_the_prefix_cache_takes_back_imported_blocks_instead_of_restarting_forever(checkpoint):
    """Found by the long state-machine run: a prompt whose log-probs are asked for (so it cannot reuse its own cached
    blocks) ran out of blocks mid-prefill while two imported requests held the rest of the cache waiting; it was
    preempted and recomputed from the start at every step, forever. The imports' blocks now go first."""
    make = lambda: LLMEngine(EngineConfig(model=str(checkpoint), block_size=BLOCK_SIZE, num_kv_blocks=BLOCKS, max_model_len=MAX_LEN,  # noqa: E731
                                          max_num_seqs=4, max_num_batched_tokens=16, max_waiting=6))  # fmt: skip
    engine, prefill = make(), make()
    engine.add_request(BASES[0] + [3] * 10, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0))  # 5 of 12 blocks
    for _ in range(2):  # 4 blocks each, held while they wait
        params = SamplingParams(max_tokens=2, temperature=0.0)
        engine.add_prefilled(prefill.prefill(BASES[0][:6] + [3] * 7, params), params)
    finished = []
    for _ in range(50):
        finished += engine.step()
        if not engine.has_unfinished:
            break
    assert not engine.has_unfinished and len(finished) == 3 and all(out.error is None for out in finished)
    asked = next(out for out in finished if out.prompt_logprobs is not None)
    assert len(asked.prompt_logprobs) == len(asked.prompt_token_ids) == len(BASES[0]) + 10
    assert engine.block_manager.num_free_blocks == BLOCKS
