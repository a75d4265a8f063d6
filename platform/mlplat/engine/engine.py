"""LLMEngine: requests in, tokens out. Owns the scheduler, block manager and model runner.

    engine = LLMEngine(EngineConfig(model="path/to/hf_checkpoint"))
    outputs = engine.generate(["What is 2 + 2?"], SamplingParams(temperature=0))

``step()`` is the continuous-batching loop body: schedule, run one forward, post-process
(sample, append, finish). Serving and RL rollouts drive it; ``generate`` is the offline
helper. Speculative decoding lives in ``spec_decode``, the prefill/decode handoff in
``kv_transfer``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from itertools import count

import torch

from mlplat.engine import kv_transfer
from mlplat.engine.block_manager import BlockManager
from mlplat.engine.config import EngineConfig
from mlplat.engine.kv_tiers import TieredKVCache
from mlplat.engine.kv_transfer import KVPayload
from mlplat.engine.runner import ModelRunner
from mlplat.engine.sampling import SamplingParams, sample, top_logprobs
from mlplat.engine.scheduler import QueueFullError, Scheduler
from mlplat.engine.sequence import Sequence, Status
from mlplat.engine.spec_decode import Speculator
from mlplat.engine.structured import GrammarCompiler, advance
from mlplat.models.checkpoint import load_tokenizer


class RequestFailedError(RuntimeError):
    """One request failed inside a step (e.g. in its sampling): the engine dropped it, freed its
    blocks and went on; the other requests in the batch are unaffected."""


# A test hook: called with ("forward", None) before each step's forward pass and ("sample", seq) for
# each sequence after it. What it raises at "sample" fails that request alone (RequestFailedError);
# at "forward" it propagates out of step(), as an engine fault would.
FaultHook = Callable[[str, "Sequence | None"], None]


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None  # params.top_logprobs: each token's alternatives, likeliest first
    # Every sampled token, the stop token included, with its log-prob: what an RL trainer scores.
    sampled_token_ids: list[int] = field(default_factory=list)
    sampled_logprobs: list[float] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = False
    # params.prompt_logprobs: each prompt token's (log-prob given the tokens before it, top alternatives); the first (None, None)
    prompt_logprobs: list[tuple[float | None, list[tuple[int, float]] | None]] | None = None
    error: RequestFailedError | None = None  # set when the request failed inside a step (outputs empty)
    kv_payload: KVPayload | None = None  # a prefill-only request's (kv_transfer.add_export): its prompt's KV, its first tokens


class LLMEngine:
    def __init__(self, cfg: EngineConfig):
        self.cfg = cfg
        self.runner = ModelRunner(cfg)
        self.tokenizer = load_tokenizer(cfg.model)
        tiers = TieredKVCache(cfg.kv_tiers, self.runner.kv_cache) if cfg.kv_tiers is not None else None
        self.block_manager = BlockManager(self.runner.num_blocks, cfg.block_size, cfg.enable_prefix_caching, tiers)
        self.scheduler = Scheduler(cfg, self.block_manager, self.runner.lora)
        self.requests: dict[str, list[Sequence]] = {}
        self.exports: dict[str, kv_transfer.Export] = {}  # prefill-only requests in flight (kv_transfer.add_export)
        self.eos_token_ids = {self.tokenizer.eos_token_id} | set(self._generation_eos())
        self._request_ids = count()
        self.finished_on_admission: list[str] = []  # requests that finished before entering the queues
        self.speculator = Speculator(cfg, self.block_manager, self.runner.max_model_len, self.vocab_size) if cfg.speculative else None
        self.num_steps = 0
        self._grammars: GrammarCompiler | None = None
        self.fault_hook: FaultHook | None = None

    def _generation_eos(self) -> list[int]:
        eos = getattr(self.runner.hf_config, "eos_token_id", None)
        return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, prompt: str | list[int], params: SamplingParams = SamplingParams(), request_id: str | None = None) -> str:
        """Queue a prompt (text or token ids). Raises QueueFullError when the waiting queue is full."""
        request_id = request_id or f"req-{next(self._request_ids)}"
        assert request_id not in self.requests, f"duplicate request id {request_id}"
        token_ids = self.tokenizer.encode(prompt, add_special_tokens=False) if isinstance(prompt, str) else list(prompt)
        self.check_prompt(token_ids, params.max_tokens)
        self.check_params(params)
        seqs = [Sequence(request_id, token_ids, params, i) for i in range(params.n)]
        for seq in seqs:
            self._attach_grammar(seq)
        for seq in seqs:
            if params.seed is not None:
                seq.generator = torch.Generator(device=self.runner.device).manual_seed(params.seed + seq.sample_index)
            seq.leader = seqs[0] if seq is not seqs[0] else None
        self.scheduler.add(seqs)
        self.requests[request_id] = seqs
        return request_id

    @property
    def grammars(self) -> GrammarCompiler:
        """The structured-output compiler and its cache (built on first use: wrapping the tokenizer takes ~1 s)."""
        if self._grammars is None:
            self._grammars = GrammarCompiler(self.tokenizer, self.vocab_size, self.eos_token_ids, self.cfg.structured_outputs)
        return self._grammars

    def _attach_grammar(self, seq: Sequence) -> None:
        """A constrained sequence's own grammar state (ValueError if the grammar fails to compile or is over a limit)."""
        if seq.params.structured is not None:
            seq.matcher = self.grammars.matcher(seq.params.structured)

    @property
    def vocab_size(self) -> int:
        return self.runner.hf_config.vocab_size

    @property
    def max_context(self) -> int:
        """Prompt + output tokens one sequence may hold: max_model_len, or what the KV cache holds."""
        return min(self.runner.max_model_len, self.runner.num_blocks * self.cfg.block_size)

    def check_prompt(self, token_ids: list[int], max_tokens: int) -> None:
        """ValueError for a prompt this engine cannot run; nothing invalid reaches a forward pass."""
        if not token_ids:
            raise ValueError("prompt is empty")
        bad = next((t for t in token_ids if not (isinstance(t, int) and 0 <= t < self.vocab_size)), None)
        if bad is not None:
            raise ValueError(f"prompt token id {bad!r} is outside the vocabulary [0, {self.vocab_size})")
        if len(token_ids) + max_tokens > self.max_context:
            raise ValueError(
                f"prompt ({len(token_ids)} tokens) + max_tokens ({max_tokens}) exceeds the model's "
                f"context of {self.max_context} tokens (max_model_len, or what the KV cache can hold)"
            )

    def check_params(self, params: SamplingParams) -> None:
        """ValueError for sampling parameters that name a token outside this engine's vocabulary, ask for more
        top log-probs than max_logprobs, or name a LoRA adapter this engine does not have or cannot run (its
        weights are read and checked here, on first use, so that nothing invalid reaches a step)."""
        if params.lora_name is not None:
            if self.runner.lora is None:
                raise ValueError(f"lora_name: {params.lora_name!r}, but this engine serves no adapters (EngineConfig.lora is unset)")
            self.runner.lora.check(params.lora_name)
        bad = next((t for t in params.logit_bias if t >= self.vocab_size), None)
        if bad is not None:
            raise ValueError(f"logit_bias token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        for name in ("top_logprobs", "prompt_logprobs"):
            if (getattr(params, name) or 0) > self.cfg.max_logprobs:
                raise ValueError(f"{name}: {getattr(params, name)} is over this engine's max_logprobs ({self.cfg.max_logprobs})")

    def abort(self, request_id: str) -> None:
        self.scheduler.abort(request_id)
        self.requests.pop(request_id, None)
        self.exports.pop(request_id, None)
        if request_id in self.finished_on_admission:
            self.finished_on_admission.remove(request_id)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self.finished_on_admission)

    # -- the loop ---------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One forward over the scheduled batch; returns outputs of requests that finished or failed.

        A failure in one sequence's sampling or post-processing fails its request alone (an output
        with ``error``); anything raised by scheduling or the forward pass propagates: the engine
        state is then not to be trusted."""
        self.num_steps += 1
        admitted_finished, self.finished_on_admission = self.finished_on_admission, []
        batch = self.scheduler.schedule()
        if not batch:
            return [self._pop_output(r) for r in admitted_finished]
        drafts = self.speculator.propose(batch, {s.seq_id for s in self.live_sequences()}) if self.speculator else [[] for _ in batch]
        rows = self._run(batch, drafts)
        return [self._pop_output(r) for r in admitted_finished] + self._postprocess(batch, drafts, rows)

    def _run(self, batch: list[tuple[Sequence, int]], drafts: list[list[int]]) -> tuple[torch.Tensor, ...]:
        """Logits per scheduled sequence: [1 + its drafts, V] (a draft's row verifies it)."""
        if self.fault_hook:
            self.fault_hook("forward", None)
        # A prefill whose prompt log-probs are asked for: logits at every position of the chunk (that sequence's only).
        num_logits = [n if seq.needs_prompt_logprobs else len(d) + 1 for (seq, n), d in zip(batch, drafts)]
        return self.runner.run([(s, n + len(d)) for (s, n), d in zip(batch, drafts)], num_logits).split(num_logits)

    def _postprocess(self, batch: list[tuple[Sequence, int]], drafts: list[list[int]], rows: tuple[torch.Tensor, ...]) -> list[RequestOutput]:
        failed: dict[str, BaseException] = {}
        sampled = self._sample_plain(batch, drafts, rows, failed)
        finished_requests = set()
        for i, ((seq, n), d) in enumerate(zip(batch, drafts)):
            if seq.request_id in failed:
                continue
            try:
                if self.fault_hook:
                    self.fault_hook("sample", seq)
                if seq.needs_prompt_logprobs:
                    self._record_prompt_logprobs(seq, n, rows[i])
                self._advance(seq, n, d, rows[i], sampled.get(i))
                if seq.is_finished and seq.request_id in self.exports:  # a prefill-only request: its other samples' first tokens
                    self.exports[seq.request_id].draw_other_samples(seq, rows[i][-1])
            except Exception as err:  # noqa: BLE001  (this request's failure, not the engine's)
                failed[seq.request_id] = err
                continue
            if seq.is_finished and all(s.is_finished for s in self.requests[seq.request_id]):
                finished_requests.add(seq.request_id)
        return [self._pop_output(r) for r in finished_requests - failed.keys()] + [self._fail(r, err) for r, err in failed.items()]

    PROMPT_LOGPROBS_CHUNK = 256  # prompt positions whose log-softmax is taken at once

    def _record_prompt_logprobs(self, seq: Sequence, n: int, rows: torch.Tensor) -> None:
        """The prompt tokens' log-probs from a prefill chunk's logits ``rows`` [n, V] (positions num_computed_tokens ..
        + n - 1, each predicting the next token): the target's log-softmax and the top alternatives, a chunk of
        positions at a time. The last position of the prompt predicts the first output token: not a prompt token's."""
        start, k = seq.num_computed_tokens, seq.params.prompt_logprobs
        begin = max(0, len(seq.prompt_logprobs) - 1 - start)  # rows whose target has one already (recomputed after preemption)
        count = min(n, seq.num_prompt_tokens - 1 - start)  # rows whose target is a prompt token
        for a in range(begin, count, self.PROMPT_LOGPROBS_CHUNK):
            b = min(count, a + self.PROMPT_LOGPROBS_CHUNK)
            logprobs = torch.log_softmax(rows[a:b].float(), dim=-1)
            targets = torch.tensor(seq.token_ids[start + a + 1 : start + b + 1], device=logprobs.device)
            chosen = logprobs.gather(1, targets[:, None])[:, 0].tolist()
            top = top_logprobs(logprobs, [k] * (b - a)) if k else [None] * (b - a)
            seq.prompt_logprobs.extend(zip(chosen, top))

    def _sample_plain(self, batch, drafts, rows, failed: dict) -> dict[int, list[tuple[int, float]]]:
        """Sample the rows without drafts, batched; if the batch fails, row by row, failing only the
        requests whose own row fails."""
        plain = [i for i, d in enumerate(drafts) if not d]
        if not plain:
            return {}
        try:
            return self._sample_rows(batch, rows, plain)
        except Exception:  # noqa: BLE001  (find the culprit: one row's parameters, not the batch)
            sampled = {}
            for i in plain:
                try:
                    sampled |= self._sample_rows(batch, rows, [i])
                except Exception as err:  # noqa: BLE001
                    failed[batch[i][0].request_id] = err
            return sampled

    def _sample_rows(self, batch, rows, index: list[int]) -> dict[int, list[tuple[int, float]]]:
        seqs = [batch[i][0] for i in index]
        logits = torch.stack([rows[i][-1] for i in index])
        matchers = [s.matcher for s in seqs] if any(s.matcher is not None for s in seqs) else None
        ks = [s.params.top_logprobs for s in seqs]
        args = (logits, [s.params for s in seqs], [s.generator for s in seqs], seqs, self.eos_token_ids, matchers)
        if not any(ks):
            tokens, logprobs = sample(*args)
            return {i: [(t, lp, None)] for i, t, lp in zip(index, tokens.tolist(), logprobs.tolist())}
        tokens, logprobs, top = sample(*args, num_top_logprobs=ks)  # only the asking rows' alternatives
        return {i: [(t, lp, alt)] for i, t, lp, alt in zip(index, tokens.tolist(), logprobs.tolist(), top)}

    def _advance(self, seq: Sequence, n: int, drafts: list[int], rows: torch.Tensor, emitted: list[tuple] | None) -> None:
        """Account one sequence's step: its computed tokens, then its new token(s) (``emitted``, the
        plain sample; verified drafts instead where it had drafts) unless it is mid-prefill."""
        seq.num_computed_tokens += n
        if drafts:
            emitted = self.speculator.accept(seq, rows, drafts)
        self.block_manager.cache_full_blocks(seq)  # before a finish frees the blocks
        if seq.num_computed_tokens < len(seq):
            return  # a prefill chunk: nothing to sample yet
        for j, (token, logprob, top) in enumerate(emitted):
            if j > 0:
                seq.num_computed_tokens += 1  # the accepted draft before this token is in the cache
            self._append(seq, token, logprob, top)
            if seq.is_finished:
                break
        if len(emitted) > 1 and not seq.is_finished:
            self.block_manager.cache_full_blocks(seq)  # blocks completed by accepted drafts

    def _fail(self, request_id: str, err: BaseException) -> RequestOutput:
        seqs = self.requests.get(request_id) or []
        prompt = seqs[0].token_ids[: seqs[0].num_prompt_tokens] if seqs else []
        self.abort(request_id)  # frees every block of every sample
        error = err if isinstance(err, RequestFailedError) else RequestFailedError(f"{type(err).__name__}: {err}")
        return RequestOutput(request_id, prompt, finished=True, error=error)

    @property
    def spec_acceptance_rate(self) -> float:
        return self.speculator.acceptance_rate if self.speculator else 0.0

    def _append(self, seq: Sequence, token: int, logprob: float, top: list[tuple[int, float]] | None = None) -> None:
        if seq.matcher is not None:
            advance(seq.matcher, token)
        seq.token_ids.append(token)
        seq.output_logprobs.append(logprob)
        if seq.params.top_logprobs:
            seq.output_top_logprobs.append(list(top or []))
        reason = self._finish_reason(seq)
        if reason is None:
            return
        if seq.on_finish:
            seq.on_finish(seq)
        if seq.status == Status.RUNNING:
            self.scheduler.finish(seq, reason)
        else:  # admitted already finished (an imported sample that stops on its first token): never queued
            self.block_manager.free_sequence(seq)
            seq.status, seq.finish_reason = Status.FINISHED, reason
            if all(s.is_finished for s in self.requests[seq.request_id]):  # output once, when its last sample finishes
                self.finished_on_admission.append(seq.request_id)

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return (not seq.params.ignore_eos and token in self.eos_token_ids) or token in seq.params.stop_token_ids

    def _finish_reason(self, seq: Sequence) -> str | None:
        if self._is_stop_token(seq, seq.token_ids[-1]):
            return "stop"
        if seq.params.stop and self._stop_string_at(seq) is not None:
            return "stop"
        if seq.num_output_tokens >= seq.params.max_tokens:
            return "length"
        return None

    def _stop_string_at(self, seq: Sequence) -> int | None:
        text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        hits = [text.find(s) for s in seq.params.stop if s in text]
        return min(hits) if hits else None

    def _pop_output(self, request_id: str) -> RequestOutput:
        seqs = self.requests.pop(request_id)
        out = RequestOutput(request_id, seqs[0].token_ids[: seqs[0].num_prompt_tokens], finished=True,
                            prompt_logprobs=seqs[0].prompt_logprobs)
        if request_id in self.exports:
            out.kv_payload = self.exports.pop(request_id).payload(seqs[0])
        for seq in seqs:
            ids = seq.output_token_ids
            if ids and self._is_stop_token(seq, ids[-1]):
                ids = ids[:-1]  # the stop token itself is not part of the text
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            cut = self._stop_string_at(seq) if seq.params.stop else None
            if cut is not None:
                text = text[:cut]
            out.outputs.append(
                CompletionOutput(
                    seq.sample_index, ids, text, seq.finish_reason,
                    logprobs=seq.output_logprobs[: len(ids)] if seq.params.logprobs else None,
                    top_logprobs=seq.output_top_logprobs[: len(ids)] if seq.params.top_logprobs else None,
                    sampled_token_ids=list(seq.output_token_ids),
                    sampled_logprobs=list(seq.output_logprobs) if seq.params.logprobs else None,
                )
            )  # fmt: skip
        return out

    def generate(self, prompts: Iterable[str | list[int]], params: SamplingParams | list[SamplingParams] = SamplingParams()) -> list[RequestOutput]:
        """Run prompts to completion with continuous batching; outputs in prompt order. ``params`` is
        one for all prompts or one per prompt (as vLLM's ``generate``)."""
        prompts = list(prompts)
        per_prompt = params if isinstance(params, list) else [params] * len(prompts)
        if len(per_prompt) != len(prompts):
            raise ValueError(f"{len(per_prompt)} sampling params for {len(prompts)} prompts; give one, or one per prompt")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, per_prompt)]
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished:
            for out in self.step():
                done[out.request_id] = out
        return [done[i] for i in ids]

    def score(self, token_ids: list[int]) -> list[float]:
        """Log-prob of each token after the first given the ones before it (teacher forcing).

        For perplexity and for RL's log-probs of given completions; runs between steps."""
        if len(token_ids) < 2 or len(token_ids) > self.runner.max_model_len:
            raise ValueError(f"score needs 2..{self.runner.max_model_len} tokens, got {len(token_ids)}")
        seq = Sequence("score", token_ids, SamplingParams())
        if not self.block_manager.allocate_slots(seq, len(token_ids)):
            raise QueueFullError("no free KV blocks to score this sequence; retry later")
        try:
            logits = self.runner.run([(seq, len(token_ids))], num_logits=[len(token_ids)])
        finally:
            self.block_manager.free_sequence(seq)
        targets = torch.tensor(token_ids[1:], device=logits.device)[:, None]
        return torch.log_softmax(logits[:-1].float(), dim=-1).gather(1, targets)[:, 0].tolist()

    # -- prefill/decode disaggregation ----------------------------------------------------------
    def prefill(self, prompt: str | list[int], params: SamplingParams = SamplingParams()) -> KVPayload:
        """A prompt's KV and its ``params.n`` samples' first tokens, for a decode engine elsewhere, now: steps the engine
        (the requests in flight with it) until this prompt is done. Serving adds it with kv_transfer.add_export instead and
        takes the payload from the step that finishes it, never blocking the loop on one prompt."""
        request_id = kv_transfer.add_export(self, prompt, params)
        while True:
            for out in self.step():
                if out.request_id == request_id:
                    if out.error is not None:
                        raise out.error
                    return out.kv_payload

    def add_prefilled(self, payload: KVPayload, params: SamplingParams = SamplingParams(), request_id: str | None = None) -> str:
        """Admit a request whose prompt KV and first tokens were computed elsewhere (the decode side).

        Its samples wait in the queue sharing the prompt's KV blocks, and decode from their first tokens on."""
        request_id = request_id or f"req-{next(self._request_ids)}"
        assert request_id not in self.requests, f"duplicate request id {request_id}"
        structured = params.structured
        # The grammars before any block is taken: each sample's own state, advanced by its first token below.
        matchers = [self.grammars.matcher(structured) if structured is not None else None for _ in range(params.n)]
        seqs = kv_transfer.import_prefilled(self, payload, params, request_id)
        self.requests[request_id] = seqs
        for seq, first, matcher in zip(seqs, payload.samples, matchers):
            seq.matcher = matcher
            self._append(seq, first.token, first.logprob, first.top_logprobs)
        self.scheduler.add([s for s in seqs if not s.is_finished])  # room checked by import_prefilled
        return request_id

    def live_sequences(self) -> list[Sequence]:
        return [s for seqs in self.requests.values() for s in seqs if s.status != Status.FINISHED]

    def update_weights(self, items: Iterable[tuple[str, torch.Tensor]] | dict[str, torch.Tensor]) -> int:
        """Load new HF-named weights in place (e.g. from a trainer); the KV cache is kept.

        Cached prefixes were computed by the old weights, so the prefix cache (and its tiers) is dropped."""
        if isinstance(items, dict):
            items = items.items()
        loaded = self.runner.update_weights(items)
        self.block_manager.clear_prefix_cache()
        return loaded
