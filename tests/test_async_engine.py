"""The serving replicas' engine loop (AsyncEngine) without Ray: a request's failure ends that
request alone, an engine fault ends every request at once and the health check with them, and
deadlines abort requests within a step. Faults are injected through the engine's test hook."""

from __future__ import annotations

import asyncio
import time

import pytest

from mlplat.engine import EngineConfig, RequestFailedError, SamplingParams
from mlplat.serve.async_engine import AsyncEngine, DeadlineExceededError, EngineDeadError

BLOCKS = 64
LONG = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)


@pytest.fixture
def engine(tiny_model):
    return AsyncEngine(EngineConfig(model=str(tiny_model), block_size=4, num_kv_blocks=BLOCKS, max_num_seqs=4))


def run(coro, timeout=60):
    return asyncio.run(asyncio.wait_for(coro, timeout))  # a hang fails the test instead of the suite


async def collect(stream) -> list:
    return [d async for d in stream]


def test_a_failing_request_ends_alone_and_the_loop_goes_on(engine):
    def fault(stage, seq):
        if stage == "sample" and 99 in seq.token_ids[: seq.num_prompt_tokens]:
            raise RuntimeError("injected request fault")

    async def main():
        await engine.set_fault_hook(fault)
        healthy = asyncio.create_task(collect(engine.generate([5, 6, 7], LONG, "healthy")))
        with pytest.raises(RequestFailedError, match="injected request fault"):
            await collect(engine.generate([5, 99, 7], LONG, "doomed"))
        deltas = await healthy
        assert sum(len(d.token_ids) for d in deltas) == LONG.max_tokens and deltas[-1].finish_reason == "length"
        with pytest.raises(ValueError, match="outside the vocabulary"):
            await collect(engine.generate([5, 10**6], LONG, "bad-ids"))
        assert (await collect(engine.generate([5, 6], LONG.model_copy(update={"max_tokens": 3}), "after")))[-1].finish_reason
        return await engine.stats()

    stats = run(main())
    assert engine.alive and stats["running"] == stats["waiting"] == 0 and stats["free_kv_blocks"] == BLOCKS


def test_an_engine_fault_ends_every_request_at_once_and_fails_the_health_check(engine):
    def fault(stage, seq):
        if stage == "forward":
            raise RuntimeError("injected engine fault")

    async def main():
        stream = engine.generate([5, 6, 7], LONG, "in-flight")
        await anext(stream)  # decoding
        await engine.set_fault_hook(fault)
        with pytest.raises(EngineDeadError, match="injected engine fault"):
            await collect(stream)
        with pytest.raises(EngineDeadError):  # later requests fail at once rather than wait for a dead loop
            await collect(engine.generate([5, 6], LONG, "later"))
        with pytest.raises(EngineDeadError):
            await engine.stats()

    run(main())
    assert not engine.alive and "injected engine fault" in engine.dead_reason


def test_a_request_past_its_deadline_is_aborted_within_a_step(engine):
    async def main():
        await engine.set_fault_hook(lambda stage, seq: time.sleep(0.02) if stage == "forward" else None)  # slow steps
        before = (await engine.stats())["steps"]
        with pytest.raises(DeadlineExceededError):
            await collect(engine.generate([5, 6, 7], LONG, "slow", deadline=time.time() + 0.3))
        stats = await engine.stats()
        # 100 tokens take >= 100 steps; aborted at ~15, its blocks freed at once
        assert stats["steps"] - before < LONG.max_tokens // 2 and stats["running"] == 0 and stats["free_kv_blocks"] == BLOCKS
        await engine.set_fault_hook(None)
        return await collect(engine.generate([5, 6], LONG.model_copy(update={"max_tokens": 3}), "next", deadline=time.time() + 30))

    assert run(main())[-1].finish_reason == "length"
