"""An asyncio front for the (synchronous) engine, for Serve replicas.

One thread owns the engine and runs its loop: it drains an inbox of adds and aborts,
steps, and pushes each request's new tokens to that request's asyncio queue. The
event loop never blocks on a forward pass, and the engine is only ever touched by
its own thread (no locks around model state).

Failures: a request's own failure (bad input at admission, an error in its sampling) ends
that request alone. Anything else that escapes the loop is fatal: the loop stops, every
request in flight and every later one gets ``EngineDeadError`` at once (never a hang), and
``alive`` turns False so that the replica's health check fails and Serve replaces it.
Every request may carry a deadline (wall-clock seconds); past it the loop aborts the
request, freeing its blocks, and its stream raises ``DeadlineExceededError``.
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
from itertools import count

from mlplat.engine import EngineConfig, LLMEngine, QueueFullError, RequestFailedError, SamplingParams, kv_transfer
from mlplat.engine.engine import FaultHook
from mlplat.engine.kv_transfer import KVPayload

log = logging.getLogger("mlplat.serve")


# What an op may raise for one request (bad input, overload, its own failure in a step); anything
# else escaping an op or a step stops the loop.
REQUEST_ERRORS = (ValueError, QueueFullError, RequestFailedError)


class EngineDeadError(RuntimeError):
    """The engine loop has stopped on a fault that was not one request's: retry on another replica."""


class DeadlineExceededError(TimeoutError):
    """The request ran past its deadline and was aborted."""


@dataclass
class Delta:
    """New output of one sample since the last delta; ``finish_reason`` set on its last one."""

    index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str | None = None
    text: str | None = None  # the final text (stop strings cut off), on the last delta only
    top_logprobs: list | None = None  # params.top_logprobs: each token's [(token id, log-prob)] alternatives
    prompt_logprobs: list | None = None  # params.prompt_logprobs: on sample 0's first delta (RequestOutput.prompt_logprobs)


@dataclass
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue
    deadline: float | None = None  # time.time() past which the request is aborted
    delivered: dict[int, int] = field(default_factory=dict)  # sample index -> tokens sent
    prompt_logprobs_sent: bool = False


class AsyncEngine:
    def __init__(self, cfg: EngineConfig, on_stats: Callable[[dict], None] | None = None, stats_period_s: float = 1.0):
        self.engine = LLMEngine(cfg)
        self.on_stats, self.stats_period_s, self._next_stats = on_stats, stats_period_s, 0.0  # e.g. metrics gauges, from the engine thread
        self.tokenizer = self.engine.tokenizer
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._wake = threading.Event()
        self._streams: dict[str, _Stream] = {}
        self._prefill_ids = count()
        self.dead_reason: str | None = None  # set once, when the loop stops on a fault
        self._thread = threading.Thread(target=self._run, name="engine-loop", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self.dead_reason is None and self._thread.is_alive()

    # -- asyncio side -----------------------------------------------------------------------
    async def generate(self, prompt_ids: list[int], params: SamplingParams, request_id: str, deadline: float | None = None) -> AsyncIterator[Delta]:
        """Stream deltas of every sample; cancelling the consumer aborts the request."""
        await self._compile(params)
        async for delta in self._stream(("add", prompt_ids, params, request_id), request_id, deadline):
            yield delta

    async def generate_prefilled(self, payload: KVPayload, params: SamplingParams, request_id: str,
                                 deadline: float | None = None) -> AsyncIterator[Delta]:  # fmt: skip
        """Decode a request whose prompt KV and first token come from a prefill server."""
        await self._compile(params)
        async for delta in self._stream(("add_prefilled", payload, params, request_id), request_id, deadline):
            yield delta

    async def prefill(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None,
                      deadline: float | None = None) -> KVPayload:  # fmt: skip
        """A prompt's KV payload with its ``params.n`` samples' first tokens. The prompt is a request in the loop's
        continuous batch like any other (kv_transfer.add_export): the loop steps on while it waits or prefills, and the
        step that finishes it hands the payload over. Cancelling the caller aborts it."""
        await self._compile(params)
        request_id = request_id or f"prefill-{next(self._prefill_ids)}"
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), deadline)
        self._streams[request_id] = stream
        admitted, item = False, None
        try:
            await self._call("export", prompt_ids, params, request_id)  # raises QueueFullError / ValueError at admission
            admitted = True
            item = await stream.queue.get()
        finally:
            self._streams.pop(request_id, None)
            if admitted and item is None:
                self._submit("abort", request_id)  # the caller went away: free the blocks now
        if isinstance(item, BaseException):
            raise item
        return item

    async def _compile(self, params: SamplingParams) -> None:
        """A constrained request's grammar, compiled (or found cached) here, off the engine loop and under its time
        limit, so the loop's add_request only copies a cached matcher; ValueError for a bad or slow grammar. Likewise a
        LoRA request's adapter, read from disk and checked on its first use here rather than in the loop."""
        if params.structured is not None:
            grammars = await asyncio.to_thread(lambda: self.engine.grammars)  # the first use wraps the tokenizer (~1 s)
            await grammars.compile_async(params.structured)
        lora = self.engine.runner.lora
        if params.lora_name is not None and lora is not None and params.lora_name not in lora.host:
            await asyncio.to_thread(lora.adapter, params.lora_name)  # the loop's check then finds it read (a race reads it twice)

    async def stats(self) -> dict:
        return await self._call("stats")

    async def kv_events(self, snapshot: bool = False) -> tuple[list[int] | None, list]:
        """The prefix cache's block events since the last call, or a snapshot (``BlockManager.take_kv_events``)."""
        return await self._call("kv_events", snapshot)

    async def set_fault_hook(self, hook: FaultHook | None) -> None:
        """Tests only: see ``mlplat.engine.engine.FaultHook``."""
        await self._call("fault_hook", hook)

    async def _stream(self, add: tuple, request_id: str, deadline: float | None) -> AsyncIterator[Delta]:
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue(), deadline)
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
        if self.dead_reason is not None:  # nobody is left to run it
            self._fail_inbox()
        return future

    # -- engine thread ------------------------------------------------------------------------
    def _run(self) -> None:
        try:
            self._loop()
        except BaseException as err:  # noqa: BLE001  (not one request's: the engine's state is suspect)
            log.exception("the engine loop stopped; failing every request and the health check")
            self.dead_reason = f"the engine failed ({type(err).__name__}: {err}); retry on another replica"
            for stream in list(self._streams.values()):
                self._deliver(stream, EngineDeadError(self.dead_reason))
            self._fail_inbox()

    def _loop(self) -> None:
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
                    log.exception("engine stats callback failed")
            while not self._inbox.empty():
                future, op, args = self._inbox.get()
                try:
                    future.set_result(self._apply(op, *args))
                except REQUEST_ERRORS as err:  # the request's own: handed to the awaiting coroutine
                    future.set_exception(err)
                except BaseException:
                    self._inbox.put((future, op, args))  # failed with the others by _run
                    raise
            self._expire_deadlines()
            if engine.has_unfinished:
                self._publish(engine.step())

    def _fail_inbox(self) -> None:
        while True:
            try:
                future, _, _ = self._inbox.get_nowait()
            except queue.Empty:
                return
            if future.set_running_or_notify_cancel():
                future.set_exception(EngineDeadError(self.dead_reason))

    def _expire_deadlines(self) -> None:
        now = time.time()
        for request_id, stream in list(self._streams.items()):
            if stream.deadline is not None and now > stream.deadline and request_id in self.engine.requests:
                self.engine.abort(request_id)
                self._deliver(stream, DeadlineExceededError(f"request {request_id} ran past its deadline and was aborted"))

    def _deliver(self, stream: _Stream, item) -> None:
        try:
            stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
        except RuntimeError:  # the consumer's event loop has closed: nobody is listening
            pass

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
        if op == "export":
            prompt_ids, params, request_id = args
            return kv_transfer.add_export(engine, prompt_ids, params, request_id)
        if op == "abort":
            return engine.abort(*args)
        if op == "fault_hook":
            engine.fault_hook = args[0]
            return None
        if op == "kv_events":
            return engine.block_manager.take_kv_events(*args)
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
                "steps": engine.num_steps,
                "kv_cached_blocks": len(bm.hash_to_block),
            }
        raise ValueError(f"unknown op {op}")

    def _publish(self, finished) -> None:
        for out in finished:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.error is not None:
                self._deliver(stream, out.error)
                continue
            if out.kv_payload is not None:  # a prefill-only request (AsyncEngine.prefill)
                self._deliver(stream, out.kv_payload)
                continue
            for o in out.outputs:
                sent = stream.delivered.get(o.index, 0)
                top = o.top_logprobs[sent:] if o.top_logprobs is not None else None
                self._deliver(stream, Delta(o.index, o.token_ids[sent:], (o.logprobs or [])[sent:], o.finish_reason, o.text, top,
                                            self._prompt_logprobs(stream, o.index, out.prompt_logprobs)))  # fmt: skip
        for request_id, seqs in self.engine.requests.items():
            stream = self._streams.get(request_id)
            if stream is None:
                continue
            for seq in seqs:
                sent = stream.delivered.get(seq.sample_index, 0)
                if seq.is_finished or seq.num_output_tokens <= sent:
                    continue
                # Every token so far, the newest too: a stop token or stop string finishes its sequence in the step
                # that appends it (the finished outputs above cut those), so a running sequence's tokens are final.
                upto = seq.num_output_tokens
                if upto > sent:
                    stream.delivered[seq.sample_index] = upto
                    top = seq.output_top_logprobs[sent:upto] if seq.params.top_logprobs else None
                    prompt = self._prompt_logprobs(stream, seq.sample_index, seqs[0].prompt_logprobs)
                    self._deliver(stream, Delta(seq.sample_index, seq.output_token_ids[sent:upto], seq.output_logprobs[sent:upto],
                                                top_logprobs=top, prompt_logprobs=prompt))  # fmt: skip

    @staticmethod
    def _prompt_logprobs(stream: _Stream, index: int, prompt_logprobs: list | None) -> list | None:
        """The prompt's log-probs, once per request: on sample 0's first delta (its prefill is done by then)."""
        if index != 0 or stream.prompt_logprobs_sent or prompt_logprobs is None:
            return None
        stream.prompt_logprobs_sent = True
        return prompt_logprobs
