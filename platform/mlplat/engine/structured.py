"""Structured outputs: grammars that constrain decoding, with llguidance.

A request's ``SamplingParams.structured`` (a ``StructuredOutputs``: one of ``json``, ``regex``, ``choice``,
``grammar`` (Lark), ``json_object``) becomes an llguidance grammar, compiled once per distinct spec into an
``LLMatcher`` that is cached as a template; each sequence decodes with its own ``deep_copy`` of it (so n > 1
samples and the PD decode side start from the same state). Compiling runs on a thread pool under a time limit
(llguidance drops the GIL while it builds a grammar): a slow or bad grammar fails its own request with a
ValueError (a 400 at the ingress) and never stalls the engine loop; the serving engine compiles before a
request reaches the loop (``compile_async``), so the loop only ever finds the cache warm.

Per step, the constrained rows' allowed tokens are filled into one int32 bitmask [B, V/32] and applied to those
rows' logits (``apply_masks``); after a token is chosen the sequence's matcher consumes it (``advance``).
Speculative decoding skips constrained sequences (``SamplingParams.adjusts_logits``).

Why llguidance rather than xgrammar (vLLM supports both): on this CPU machine ``pip install xgrammar`` pulls
triton (~1 GB, unused on CPU) into the quickstart's install, while llguidance is a ~3 MB wheel with no
dependencies; its masks cost well under a millisecond per row at a 152k vocabulary (benchmarks/structured.py).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import threading
import time
from typing import Any

import llguidance
import llguidance.hf
import llguidance.numpy
import numpy as np
import torch
from pydantic import Field, model_validator

from mlplat.config import Config
from mlplat.engine.config import StructuredLimits


class StructuredOutputs(Config):
    """vLLM's ``structured_outputs``: exactly one of these constrains the output."""

    json_: dict | str | None = Field(None, alias="json")  # a JSON schema (object or its text)
    regex: str | None = None
    choice: list[str] | None = Field(None, min_length=1)
    grammar: str | None = None  # Lark (llguidance's dialect; %json{...} embeds a JSON schema)
    json_object: bool = False  # any JSON object

    model_config = {"populate_by_name": True, "extra": "forbid"}

    @model_validator(mode="after")
    def _one(self) -> "StructuredOutputs":
        given = [k for k in ("json_", "regex", "choice", "grammar") if getattr(self, k) is not None]
        given += ["json_object"] if self.json_object else []
        if len(given) != 1:
            raise ValueError(f"structured_outputs needs exactly one of json, regex, choice, grammar, json_object; got {given or 'none'}")
        return self

    def grammar_text(self) -> str:
        """The llguidance grammar this spec stands for."""
        if self.json_ is not None:
            schema = json.loads(self.json_) if isinstance(self.json_, str) else self.json_
            return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        if self.json_object:
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults={"whitespace_flexible": False})
        if self.regex is not None:
            return llguidance.LLMatcher.grammar_from_regex(self.regex)
        if self.choice is not None:
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choice))
        return llguidance.LLMatcher.grammar_from_lark(self.grammar)

    def key(self) -> str:
        return hashlib.sha256(self.model_dump_json(by_alias=True).encode()).hexdigest()


class GrammarCompiler:
    """Compiles specs to template matchers, cached per spec (least recently used dropped), off the caller's thread."""

    def __init__(self, hf_tokenizer, vocab_size: int, eos_token_ids: list[int], limits: StructuredLimits | None = None):
        self.limits = limits or StructuredLimits()
        eos = [t for t in eos_token_ids if t < vocab_size] or None
        self.tokenizer = llguidance.hf.from_tokenizer(hf_tokenizer, n_vocab=vocab_size, eos_token=eos)
        self.vocab_size = vocab_size
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="grammar")
        self._cache: dict[str, concurrent.futures.Future] = {}
        self._lock = threading.Lock()
        self.num_compiled = 0  # grammars actually built (cache misses)
        self.last_compile_ms = 0.0

    def check(self, spec: StructuredOutputs) -> None:
        size = len(spec.model_dump_json(by_alias=True, exclude_defaults=True))
        if size > self.limits.max_grammar_bytes:
            raise ValueError(f"structured_outputs: the grammar or schema is {size} bytes, over the limit of "
                             f"{self.limits.max_grammar_bytes} (max_grammar_bytes)")  # fmt: skip

    def _build(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        start = time.perf_counter()
        try:
            grammar = spec.grammar_text()
        except Exception as err:  # noqa: BLE001  (the spec's own fault)
            raise ValueError(f"structured_outputs: invalid grammar or schema: {err}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, grammar, log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs: invalid grammar or schema: {matcher.get_error()}")
        self.num_compiled += 1
        self.last_compile_ms = (time.perf_counter() - start) * 1000
        return matcher

    def _future(self, spec: StructuredOutputs) -> concurrent.futures.Future:
        self.check(spec)
        key = spec.key()
        with self._lock:
            fut = self._cache.pop(key, None)
            if fut is None or (fut.done() and fut.exception() is not None and not isinstance(fut.exception(), ValueError)):
                fut = self._pool.submit(self._build, spec)
            self._cache[key] = fut  # most recently used last
            while len(self._cache) > self.limits.max_cached_grammars:
                self._cache.pop(next(iter(self._cache)))
        return fut

    def _result(self, fut: concurrent.futures.Future) -> llguidance.LLMatcher:
        if fut.done():
            return fut.result()
        try:
            return fut.result(timeout=self.limits.compile_timeout_s)
        except concurrent.futures.TimeoutError:
            raise ValueError(f"structured_outputs: the grammar took over {self.limits.compile_timeout_s} s to compile "
                             "(compile_timeout_s); simplify the schema") from None  # fmt: skip

    def matcher(self, spec: StructuredOutputs) -> llguidance.LLMatcher:
        """A fresh matcher for one sequence (compiling if this spec is not cached; blocks up to the time limit)."""
        return self._result(self._future(spec)).deep_copy()

    async def compile_async(self, spec: StructuredOutputs) -> None:
        """Compile (or find cached) without blocking the event loop; ValueError as ``matcher``."""
        import asyncio

        fut = self._future(spec)
        if fut.done():
            fut.result()
            return
        try:
            await asyncio.wait_for(asyncio.wrap_future(fut), timeout=self.limits.compile_timeout_s)
        except TimeoutError:
            raise ValueError(f"structured_outputs: the grammar took over {self.limits.compile_timeout_s} s to compile "
                             "(compile_timeout_s); simplify the schema") from None  # fmt: skip


REFUSED = -1e30  # added to a refused token's logit: its probability is exactly 0 after softmax, as with -inf


def apply_masks(logits: torch.Tensor, matchers: list[Any]) -> torch.Tensor:
    """Mask the rows of ``logits`` [B, V] whose matcher is not None to the tokens their grammar allows (in place).

    The bitmask (bit j of word i: token 32 i + j) is filled and unpacked with numpy rather than by llguidance.torch,
    whose kernel is a torch.compile function (seconds of compiling per new batch shape on a CPU replica) and whose
    import alone loads torch's compiler stack (~2.5 s in every engine process on 2 cores)."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if not rows:
        return logits
    vocab = logits.shape[1]
    bitmask = llguidance.numpy.allocate_token_bitmask(len(rows), vocab)
    for j, i in enumerate(rows):
        llguidance.numpy.fill_next_token_bitmask(matchers[i], bitmask, j)
    allowed = np.unpackbits(bitmask.view(np.uint8), axis=1, count=vocab, bitorder="little")
    # REFUSED added where a bit is 0: arithmetic over float rows is ~10x faster on CPU than masked_fill with a bool mask
    # Moved as bytes (a quarter of a float row per token on a GPU), made a float penalty on the logits' device.
    penalty = torch.from_numpy(allowed).to(logits.device).to(logits.dtype).sub_(1).mul_(-REFUSED)
    if len(rows) == len(matchers):
        logits.add_(penalty)
    else:
        index = torch.tensor(rows, device=logits.device)
        logits[index] = logits[index].add_(penalty)
    return logits


def advance(matcher, token: int) -> None:
    """The sequence's grammar state after ``token``; a token the grammar refuses fails the request."""
    if matcher.is_stopped():
        return
    matcher.consume_token(token)
    if matcher.is_error():
        raise RuntimeError(f"structured output: token {token} refused by the grammar: {matcher.get_error()}")
