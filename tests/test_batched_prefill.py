"""Batched prefill (issue 35, point 1), without Ray: prefill-only requests are engine requests like any other, stepped
together in one continuous batch; n > 1 prefills once and forks the prompt's blocks on decode (shared full blocks,
a copied partial block); the first token is streamed as soon as it is known. Block accounting after every step."""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from mlplat.engine import EngineConfig, LLMEngine, RequestFailedError, SamplingParams
from mlplat.engine.kv_transfer import add_export
from mlplat.serve.async_engine import AsyncEngine

BLOCK, BLOCKS = 4, 96
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
SEEDED = SamplingParams(temperature=1.0, seed=7, max_tokens=6, ignore_eos=True, logprobs=True, top_logprobs=2)
PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30], [40, 41, 42], list(range(50, 75))]
POISON = 99


@pytest.fixture(scope="module")
def make(tiny_model):
    """Engines by role and config, shared by this module's tests (engines take seconds to build on a busy machine):
    each test leaves the ones it used empty, which ``drain`` checks."""
    engines = {}

    def get(role: str, **kw) -> LLMEngine:
        key = (role, tuple(sorted(kw.items())))
        if key not in engines:
            engines[key] = LLMEngine(EngineConfig(model=str(tiny_model), block_size=BLOCK, num_kv_blocks=BLOCKS, max_num_seqs=8, **kw))
        engines[key].fault_hook = None
        return engines[key]

    return get


class BatchLog:
    """The engine's fault hook as a probe: which requests each step (counted from now) sampled, i.e. the batches; and a
    poisoned prompt's failure."""

    def __init__(self, engine: LLMEngine):
        self.engine, self.start, self.batches = engine, engine.num_steps, defaultdict(set)
        engine.fault_hook = self

    def __call__(self, stage: str, seq) -> None:
        if stage == "sample":
            self.batches[self.engine.num_steps - self.start].add(seq.request_id)
            if POISON in seq.token_ids[: seq.num_prompt_tokens]:
                raise RuntimeError("poisoned prompt")


def drain(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished:
        done.update({out.request_id: out for out in engine.step()})
        engine.block_manager.check_invariants(engine.live_sequences())
    assert engine.block_manager.num_free_blocks == BLOCKS, "blocks leaked"
    return done


def decode_all(decode: LLMEngine, payloads: list, params: SamplingParams) -> list[list[list[int]]]:
    ids = [decode.add_prefilled(p, params) for p in payloads]
    done = drain(decode)
    return [[o.token_ids for o in sorted(done[i].outputs, key=lambda o: o.index)] for i in ids]


def test_concurrent_prefills_run_in_one_batch_and_match_one_at_a_time(make):
    payloads, batches = {}, {}
    for name, engine in (("batched", make("prefill")), ("single", make("prefill", max_num_prefills=1))):
        log = BatchLog(engine)
        ids = [add_export(engine, p, GREEDY) for p in PROMPTS]
        done = drain(engine)
        payloads[name] = [done[i].kv_payload for i in ids]
        batches[name] = [log.batches[s] for s in sorted(log.batches)]
    assert batches["batched"] == [set(ids)]  # every prompt in the first step's batch, each handed off from it
    assert [len(b) for b in batches["single"]] == [1] * len(PROMPTS)  # the baseline: one prompt per step
    for a, b in zip(payloads["batched"], payloads["single"]):
        assert a.prompt_token_ids == b.prompt_token_ids and a.first_token == b.first_token
        assert a.kv.shape[2] == len(a.prompt_token_ids) and torch.allclose(a.kv, b.kv, atol=1e-5)
    # Decoded elsewhere, greedy: bit-identical tokens to the colocated engine and to the one-at-a-time path.
    reference = [[o.outputs[0].token_ids] for o in make("colocated").generate(PROMPTS, GREEDY)]
    assert decode_all(make("decode"), payloads["batched"], GREEDY) == reference
    assert decode_all(make("decode"), payloads["single"], GREEDY) == reference


def test_a_long_prompt_is_chunked_beside_the_others(make):
    engine = make("prefill", max_num_batched_tokens=16)
    log = BatchLog(engine)
    short, long = add_export(engine, [5, 6, 7], GREEDY), add_export(engine, list(range(100, 140)), GREEDY)
    handed = [{out.request_id: out.kv_payload for out in engine.step()} for _ in range(3)]
    assert not engine.has_unfinished and engine.block_manager.num_free_blocks == BLOCKS
    assert dict(log.batches) == {1: {short, long}, 2: {long}, 3: {long}}  # 3 + 13, 16, 11 tokens: the 40-token prompt chunked
    assert list(handed[0]) == [short] and handed[0][short].kv.shape[2] == 3  # handed off as soon as its prompt is done
    assert list(handed[1]) == [] and list(handed[2]) == [long] and handed[2][long].kv.shape[2] == 40


@pytest.mark.parametrize("prompt_len", [10, 8], ids=["partial-last-block", "whole-blocks"])
def test_n_samples_prefill_once_and_share_the_prompt_blocks_on_decode(make, prompt_len):
    prompt = list(range(30, 30 + prompt_len))
    params = SEEDED.model_copy(update={"n": 4})
    prefill, decode = make("prefill"), make("decode")
    log = BatchLog(prefill)
    payload = prefill.prefill(prompt, params)
    assert sum(map(len, log.batches.values())) == 1  # one sequence computed the prompt; four first tokens drawn from its logits
    assert len(payload.samples) == 4 and payload.kv.shape[2] == prompt_len
    request_id = decode.add_prefilled(payload, params)
    seqs = decode.requests[request_id]
    full = prompt_len // BLOCK
    decode.block_manager.check_invariants(decode.live_sequences())
    assert all(s.block_table[:full] == seqs[0].block_table[:full] for s in seqs)  # the full blocks: one copy, shared
    assert all(decode.block_manager.blocks[b].ref_count == 4 for b in seqs[0].block_table[:full])
    tails = [s.block_table[full:] for s in seqs]
    assert len({b for t in tails for b in t}) == sum(map(len, tails)) == (4 if prompt_len % BLOCK else 0)  # partial: copied per sample
    done = drain(decode)[request_id]
    colocated = make("colocated").generate([prompt], params)[0]
    assert [o.token_ids for o in done.outputs] == [o.token_ids for o in colocated.outputs]  # sample j seeded with seed + j in both
    for forked, alone in zip(done.outputs, colocated.outputs):
        assert forked.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
        assert [[t for t, _ in alt] for alt in forked.top_logprobs] == [[t for t, _ in alt] for alt in alone.top_logprobs]
    assert len({tuple(o.token_ids) for o in done.outputs}) > 1


def test_a_failing_prefill_fails_alone(make):
    engine = make("prefill")
    BatchLog(engine)
    ok, doomed = add_export(engine, [5, 6, 7], GREEDY), add_export(engine, [5, POISON, 7], GREEDY)
    done = drain(engine)
    assert done[ok].kv_payload is not None and done[ok].error is None
    assert done[doomed].kv_payload is None and isinstance(done[doomed].error, RequestFailedError)
    assert not engine.exports and not engine.requests


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(requests=st.lists(st.tuples(st.lists(st.integers(3, 200), min_size=1, max_size=18), st.integers(1, 4), st.integers(1, 4),
                                   st.booleans()), min_size=1, max_size=3),  # (prompt, n, max_tokens, stop on the first token)
       budget=st.sampled_from([8, 64]))  # fmt: skip
def test_prefill_and_decode_mixes_keep_the_block_accounting(make, requests, budget):
    """Any mix of prompts, n and max_tokens, exported in one batch (chunked under a small budget) and imported together;
    some samples stop on their first token. Every step: exact block accounting; at the end every block free and every
    request out once with its n samples."""
    prefill, decode = make("prefill", max_num_batched_tokens=budget), make("decode", max_num_batched_tokens=budget)
    asked = [SamplingParams(temperature=1.0, seed=i, n=n, max_tokens=m) for i, (_, n, m, _) in enumerate(requests)]
    ids = [add_export(prefill, prompt, p) for (prompt, *_), p in zip(requests, asked)]
    exported = drain(prefill)
    imported = {}
    for rid, p, (prompt, n, _, stop_first) in zip(ids, asked, requests):
        payload = exported[rid].kv_payload
        assert payload.prompt_token_ids == prompt and len(payload.samples) == n and payload.kv.shape[2] == len(prompt)
        if stop_first:  # sample 0 ends on admission, the others (unless they drew the same token) decode on
            p = p.model_copy(update={"stop_token_ids": [payload.first_token]})
        imported[decode.add_prefilled(payload, p)] = p
        decode.block_manager.check_invariants(decode.live_sequences())
    done = drain(decode)
    assert set(done) == set(imported) and not decode.requests
    for rid, p in imported.items():
        assert sorted(o.index for o in done[rid].outputs) == list(range(p.n))
        assert all(len(o.sampled_token_ids) <= p.max_tokens and o.finish_reason in ("stop", "length") for o in done[rid].outputs)


# -- the serving loop (AsyncEngine) ------------------------------------------------------------------------------------
def run(coro, timeout=120):
    return asyncio.run(asyncio.wait_for(coro, timeout))  # a hang fails the test instead of the suite


async def collect(stream) -> list:
    return [d async for d in stream]


class Gate:
    """Holds the engine thread in its ``at``-th forward pass until opened: what the test sees meanwhile came before it."""

    def __init__(self, at: int = 1):
        self.at, self.forwards, self.reached, self.open = at, 0, threading.Event(), threading.Event()

    def __call__(self, stage: str, seq) -> None:
        if stage == "forward":
            self.forwards += 1
            if self.forwards == self.at:
                self.reached.set()
                assert self.open.wait(60), "the test never opened the gate"


def test_prefills_in_flight_are_batched_by_the_serving_loop(tiny_model, make):
    engine = AsyncEngine(EngineConfig(model=str(tiny_model), block_size=BLOCK, num_kv_blocks=BLOCKS, max_num_seqs=8))
    gate = Gate()
    batches = defaultdict(set)

    def hook(stage, seq):
        gate(stage, seq)
        if stage == "sample":
            batches[engine.engine.num_steps].add(seq.request_id)
            if POISON in seq.token_ids[: seq.num_prompt_tokens]:
                raise RuntimeError("poisoned prompt")

    async def main():
        await engine.set_fault_hook(hook)
        decoding = asyncio.create_task(collect(engine.generate([5, 6], GREEDY, "decoding")))
        await asyncio.to_thread(gate.reached.wait, 60)  # the loop is in a step: the prefills below queue up meanwhile
        prefills = [asyncio.create_task(engine.prefill(p, GREEDY, f"p{i}")) for i, p in enumerate(PROMPTS)]
        doomed = asyncio.create_task(engine.prefill([5, POISON, 7], GREEDY, "doomed"))
        await asyncio.sleep(0)  # each task runs up to its submit to the engine's inbox
        gate.open.set()
        payloads = await asyncio.gather(*prefills)
        with pytest.raises(RequestFailedError, match="poisoned prompt"):
            await doomed
        await decoding
        return payloads, await engine.stats()

    payloads, stats = run(main())
    together = [ids for ids in batches.values() if {f"p{i}" for i in range(len(PROMPTS))} <= ids]
    assert together and "decoding" in together[0] and "doomed" in together[0]  # one step: 4 prefills, the failing one, a decode
    assert [p.first_token for p in payloads] == [make("prefill").prefill(p, GREEDY).first_token for p in PROMPTS]
    assert stats["running"] == stats["waiting"] == 0 and stats["free_kv_blocks"] == BLOCKS


def test_the_first_token_is_streamed_before_the_next_step(tiny_model, make):
    engine = AsyncEngine(EngineConfig(model=str(tiny_model), block_size=BLOCK, num_kv_blocks=BLOCKS))
    payload = make("prefill").prefill([5, 6, 7], GREEDY)
    expected = make("colocated").generate([[5, 6, 7]], GREEDY)[0].outputs[0].token_ids

    async def first_then_rest(gate: Gate, stream) -> list[list[int]]:
        """The first delta arrives while the engine thread is held before (or in) the step after it; then the rest."""
        await engine.set_fault_hook(gate)
        first = await asyncio.wait_for(anext(stream), 30)  # held back until the next step, it would never come
        assert not gate.open.is_set()
        gate.open.set()
        return [first.token_ids] + [d.token_ids for d in await collect(stream)]

    async def main():
        # Colocated: the first token goes out after the prefill step, while the next one (its first decode) is held.
        colocated = await first_then_rest(Gate(at=2), engine.generate([5, 6, 7], GREEDY, "colocated"))
        # PD: the first token comes in the payload and goes out at admission, before the decode side's first step.
        pd = await first_then_rest(Gate(at=1), engine.generate_prefilled(payload, GREEDY, "pd"))
        return colocated, pd

    for deltas in run(main()):
        assert deltas[0] == [payload.first_token] and [t for d in deltas for t in d] == expected
