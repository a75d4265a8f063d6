"""Speculative decoding: cheap drafts, verified by the target model in one step.

A drafter proposes up to k tokens per decoding sequence; the target runs the last
token plus the drafts as one chunk and yields k + 1 next-token distributions. Greedy
requests keep drafts while they equal the target's argmax, then take the target's
token: output identical to plain greedy. Sampled requests use rejection sampling
(Leviathan et al., 2023) with deterministic drafts (q one-hot at the draft token):
accept d with probability p(d), else sample from p with d removed; the output
distribution is exactly the target's. Either way every step emits at least one token.

Requests whose logits are adjusted before sampling (logit_bias, min_tokens, penalties: see
``sampling``) do not speculate: their adjustment at each draft's position would depend on the
drafts before it. min-p is part of ``sampling_probs``, which rejection sampling uses: those do.
"""

from __future__ import annotations

import torch

from mlplat.engine.block_manager import BlockManager
from mlplat.engine.config import EngineConfig, SpeculativeConfig
from mlplat.engine.sampling import SamplingParams, sampling_probs, top_logprobs
from mlplat.engine.sequence import Sequence


def verify(logits: torch.Tensor, drafts: list[int], params: SamplingParams, generator: torch.Generator | None) -> list[int]:
    """Tokens to emit given target ``logits`` [len(drafts) + 1, V] at the last token and each draft."""
    if params.greedy:
        target = logits.argmax(dim=-1).tolist()
        out = []
        for j, d in enumerate(drafts):
            if target[j] != d:
                return out + [target[j]]
            out.append(d)
        return out + [target[len(drafts)]]
    probs = sampling_probs(logits.float(), [params] * len(logits))
    out = []
    for j, d in enumerate(drafts):
        if torch.rand((), generator=generator, device=probs.device) < probs[j, d]:
            out.append(d)
            continue
        residual = probs[j].clone()
        residual[d] = 0.0
        return out + [int(torch.multinomial(residual / residual.sum(), 1, generator=generator))]
    return out + [int(torch.multinomial(probs[len(drafts)], 1, generator=generator))]


class NgramDrafter:
    """Prompt lookup: find the sequence's last n tokens earlier in it and propose what followed."""

    def __init__(self, cfg: SpeculativeConfig):
        self.cfg = cfg

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[list[int]]:
        return [self._one(seq.token_ids, k) for seq, k in zip(seqs, budgets)]

    def _one(self, tokens: list[int], k: int) -> list[int]:
        """What followed an earlier occurrence of the sequence's tail: the longest tail (n from ngram_max
        down) that occurs earlier; among its occurrences the most recent with k tokens after it, else
        the longest continuation. In a run of one repeated token the most recent occurrence overlaps
        the tail and has a single token after it; the one k back has k."""
        for n in range(self.cfg.ngram_max, self.cfg.ngram_min - 1, -1):
            if len(tokens) <= n or k <= 0:
                continue
            tail, best = tokens[-n:], []
            for start in range(len(tokens) - n - 1, -1, -1):  # most recent first
                if tokens[start : start + n] == tail:
                    follow = tokens[start + n : start + n + k]
                    if len(follow) == k:
                        return follow
                    best = max(best, follow, key=len)
            if best:
                return best
        return []

    def retain(self, live_seq_ids: set[int]) -> None:
        pass


class DraftModelDrafter:
    """A smaller model with the same tokenizer, drafting greedily over its own paged KV cache.

    It mirrors each target sequence; after the target accepts or rejects, the mirror
    keeps the KV of the common prefix and recomputes only what changed."""

    def __init__(self, runner, block_size: int):
        self.runner = runner
        self.blocks = BlockManager(runner.num_blocks, block_size, enable_prefix_caching=False)
        self.mirrors: dict[int, Sequence] = {}

    def propose(self, seqs: list[Sequence], budgets: list[int]) -> list[list[int]]:
        active = []
        for seq, k in zip(seqs, budgets):
            mirror = self.mirrors.get(seq.seq_id)
            if mirror is None:
                mirror = self.mirrors[seq.seq_id] = Sequence(seq.request_id, seq.token_ids, seq.params)
            common = next((i for i, (a, b) in enumerate(zip(mirror.token_ids, seq.token_ids)) if a != b), min(len(mirror), len(seq)))
            mirror.token_ids = list(seq.token_ids)
            mirror.num_computed_tokens = min(mirror.num_computed_tokens, common, len(seq) - 1)
            active.append((mirror, k))
        drafts: list[list[int]] = [[] for _ in seqs]
        for step in range(max(budgets, default=0)):
            batch = []
            for i, (mirror, k) in enumerate(active):
                n = len(mirror) - mirror.num_computed_tokens
                if step < k and self.blocks.allocate_slots(mirror, n):
                    batch.append((i, mirror, n))
            if not batch:
                break
            tokens = self.runner.run([(m, n) for _, m, n in batch]).argmax(dim=-1).tolist()
            for (i, mirror, n), token in zip(batch, tokens):
                mirror.num_computed_tokens += n
                mirror.token_ids.append(token)
                drafts[i].append(token)
        return drafts

    def retain(self, live_seq_ids: set[int]) -> None:
        """Free the mirrors of sequences that finished or were aborted."""
        for seq_id in [s for s in self.mirrors if s not in live_seq_ids]:
            self.blocks.free_sequence(self.mirrors.pop(seq_id))


def build_drafter(cfg: EngineConfig, target_vocab_size: int):
    spec = cfg.speculative
    if spec.method == "ngram":
        return NgramDrafter(spec)
    if spec.draft_model is None:
        raise ValueError("speculative.draft_model is required for method 'draft_model'")
    from mlplat.engine.runner import ModelRunner

    # the draft proposes from the base model: the target's adapters (cfg.lora) are checked in its verify step
    runner = ModelRunner(cfg.model_copy(update={"model": spec.draft_model, "speculative": None, "quantization": None, "lora": None}))
    if runner.hf_config.vocab_size != target_vocab_size:
        raise ValueError(
            f"draft model vocab ({runner.hf_config.vocab_size}) differs from the target's "
            f"({target_vocab_size}): they must share a tokenizer"
        )
    return DraftModelDrafter(runner, cfg.block_size)


class Speculator:
    """Speculative decoding inside the engine's step: ``propose`` appends drafts to the decoding
    sequences before the forward pass (with KV slots for them), ``accept`` takes them back off after
    it and returns the tokens to emit, with their log-probs."""

    def __init__(self, cfg: EngineConfig, block_manager: BlockManager, max_model_len: int, target_vocab_size: int):
        self.k = cfg.speculative.num_speculative_tokens
        self.drafter = build_drafter(cfg, target_vocab_size)
        self.block_manager, self.max_model_len = block_manager, max_model_len
        self.num_draft_tokens = self.num_accepted_tokens = 0

    def propose(self, batch: list[tuple[Sequence, int]], live_seq_ids: set[int]) -> list[list[int]]:
        """Draft tokens per scheduled sequence ([] where none)."""
        self.drafter.retain(live_seq_ids)
        drafts: list[list[int]] = [[] for _ in batch]
        # Decoding sequences only, and none whose logits are adjusted before sampling (see the module's docstring).
        decoding = [
            i for i, (s, n) in enumerate(batch)
            if s.num_output_tokens > 0 and s.num_computed_tokens + n == len(s) and not s.params.adjusts_logits
        ]  # fmt: skip
        budgets = [min(self.k, s.params.max_tokens - s.num_output_tokens - 1, self.max_model_len - len(s) - 1) for s in (batch[i][0] for i in decoding)]
        for i, d in zip(decoding, self.drafter.propose([batch[i][0] for i in decoding], budgets)):
            seq, n = batch[i]
            if d and self.block_manager.allocate_slots(seq, n + len(d)):
                seq.token_ids += d
                drafts[i] = d
        return drafts

    def accept(self, seq: Sequence, rows: torch.Tensor, drafts: list[int]) -> list[tuple[int, float, list | None]]:
        """Take the drafts back off ``seq`` (they join it only once verified) and verify them against the
        target's ``rows`` [len(drafts) + 1, V]: the tokens to emit, with their log-probs (and top alternatives
        where the request asks for them)."""
        del seq.token_ids[len(seq) - len(drafts) :]
        emitted = verify(rows, drafts, seq.params, seq.generator)
        self.num_draft_tokens += len(drafts)
        self.num_accepted_tokens += len(emitted) - 1
        logprobs = torch.log_softmax(rows.float(), dim=-1)
        top = top_logprobs(logprobs[: len(emitted)], [seq.params.top_logprobs] * len(emitted))
        return [(t, logprobs[j, t].item(), top[j]) for j, t in enumerate(emitted)]

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0
