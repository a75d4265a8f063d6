"""An asyncio front for the (synchronous) engine, for Serve replicas.

One thread owns the engine and runs its loop: it drains an inbox of adds and aborts,
steps, and pushes each request's new tokens to that request's asyncio queue. The
event loop never blocks on a forward pass, and the engine is only ever touched by
its own thread (no locks around model state).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
from mlplat.engine.kv_transfer import KVPayload


@dataclass
class Delta:
    """New output of one sample since the last delta; ``finish_reason`` set on its last one."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    text: str | None = None  # the final text (stop strings cut off), on the last delta only


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    delivered: dict[int, int] = field(default_factory=dict)  # sample index -> tokens sent


class AsyncEngine:
    def __init__(self, cfg: EngineConfig, on_stats: Callable[[dict], None] | None = None, stats_period_s: float = 1.0):
        self.engine = LLMEngine(cfg)
        self.on_stats, self.stats_period_s, self._next_stats = on_stats, stats_period_s, 0.0  # e.g. metrics gauges, from the engine thread
        self.tokenizer = self.engine.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    # -- asyncio side -----------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str) -> AsyncIterator[Delta]:
        """Stream deltas of every sample; cancelling the consumer aborts the request."""
        async for delta in self._stream(("add", prompt_ids, params, request_id), request_id):
            yield delta

    async def generate_prefilled(self, payload: KVPayload, params: SamplingParams, request_id: str) -> AsyncIterator[Delta]:
        """Decode a request whose prompt KV and first token come from a prefill server."""
        async for delta in self._stream(("add_prefilled", payload, params, request_id), request_id):
            yield delta

    async def prefill(self, prompt_ids: list[int], params: SamplingParams) -> KVPayload:
        return await self._call("prefill", prompt_ids, params)

    async def stats(self) -> dict:
        return await self._call("stats")

    async def _stream(self, add: tuple, request_id: str) -> AsyncIterator[Delta]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        self._streams[request_id] = stream
        n, finished = add[2].n, set()
        try:
            await self._call(*add)  # raises QueueFullError / ValueError before anything streams
            while len(finished) < n:
                delta = await stream.queue.get()
                if isinstance(delta, BaseException):
                    raise delta
                if delta.finish_reason is not None:
                    finished.add(delta.index)
                yield delta
        finally:
            self._streams.pop(request_id, None)
            if len(finished) < n:
                self._submit("abort", request_id)  # the consumer went away: free the blocks now

    async def _call(self, op: str, *args):
        return await asyncio.wrap_future(self._submit(op, *args))

    def _submit(self, op: str, *args) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._inbox.put((future, op, args))
        self._wake.set()
        return future

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        engine = self.engine
        while True:
            if not engine.has_unfinished and self._inbox.empty():
                self._wake.wait(self.stats_period_s if self.on_stats else None)
                self._wake.clear()
            if self.on_stats and time.monotonic() >= self._next_stats:
                self._next_stats = time.monotonic() + self.stats_period_s
                try:
                    self.on_stats(self._apply("stats"))
                except Exception:  # a metrics hiccup must not stop the engine
                    logging.getLogger("mlplat.serve").exception("engine stats callback failed")
            while not self._inbox.empty():
                future, op, args = self._inbox.get()
                try:
                    future.set_result(self._apply(op, *args))
                except BaseException as err:  # handed to the awaiting coroutine
                    future.set_exception(err)
            if engine.has_unfinished:
                self._publish(engine.step())

    def _apply(self, op: str, *args):
        engine = self.engine
        if op == "add":
            prompt_ids, params, request_id = args
            return engine.add_request(prompt_ids, params, request_id)
        if op == "add_prefilled":
            payload, params, request_id = args
            engine.add_prefilled(payload, params, request_id)
            self._publish([])  # the first token is already there
            return request_id
        if op == "prefill":
            return engine.prefill(*args)
        if op == "abort":
            return engine.abort(*args)
        if op == "stats":
            bm = engine.block_manager
            return {
                "free_kv_blocks": bm.num_free_blocks,
                "kv_blocks_used": len(bm.blocks) - bm.num_free_blocks,
                "kv_usage": bm.usage,
                "prefix_hit_rate": bm.hit_rate,
                "waiting": len(engine.scheduler.waiting),
                "running": len(engine.scheduler.running),
                "spec_acceptance": engine.spec_acceptance_rate,
            }
        raise ValueError(f"unknown op {op}")

    def _publish(self, finished) -> None:
        for out in finished:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            for o in out.outputs:
                sent = stream.delivered.get(o.index, 0)
                delta = Delta(o.index, o.token_ids[sent:], (o.logprobs or [])[sent:], o.finish_reason, o.text)
                stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)
        for request_id, seqs in self.engine.requests.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            for seq in seqs:
                sent = stream.delivered.get(seq.sample_index, 0)
                if seq.is_finished or seq.num_output_tokens <= sent:
                    continue
                # Hold back the newest token: it may be a stop token, which is not output.
                upto = seq.num_output_tokens - 1
                if upto > sent:
                    stream.delivered[seq.sample_index] = upto
                    delta = Delta(seq.sample_index, seq.output_token_ids[sent:upto], seq.output_logprobs[sent:upto])
                    stream.loop.call_soon_threadsafe(stream.queue.put_nowait, delta)
