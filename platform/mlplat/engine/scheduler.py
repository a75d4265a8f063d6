"""Continuous batching with a per-step token budget, chunked prefill and preemption.

Every step, running sequences go first (one token each for decodes, the next chunk
for a prefill in progress), then waiting ones are admitted while the token budget,
the sequence limit and free KV blocks allow. When a running sequence needs a block
and none is free, the most recently admitted one is preempted: its blocks are freed
and it waits again at the front, to be recomputed (its prefix is likely still cached).
"""

from __future__ import annotations

from collections import deque

from mlplat.engine.block_manager import BlockManager
from mlplat.engine.config import EngineConfig
from mlplat.engine.lora import LoRAManager
from mlplat.engine.sequence import Sequence, Status


class QueueFullError(RuntimeError):
    """The waiting queue is at its bound: the caller should retry later (HTTP 429/503)."""


class Scheduler:
    def __init__(self, cfg: EngineConfig, block_manager: BlockManager, lora: LoRAManager | None = None):
        self.max_num_seqs = cfg.max_num_seqs
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        self.max_waiting = cfg.max_waiting
        self.max_num_prefills = cfg.max_num_prefills
        self.block_manager = block_manager
        self.lora = lora  # adapter slots: a sequence with an adapter runs only while its adapter holds a slot
        self.waiting: deque[Sequence] = deque()
        self.running: deque[Sequence] = deque()
        self.num_preemptions = 0

    def check_room(self, num_seqs: int) -> None:
        """QueueFullError unless ``num_seqs`` more sequences fit: the engine holds max_num_seqs running plus max_waiting
        waiting (mlplat.serve.admission counts on it), so queued sequences fill the free running slots first, which the
        next step admits them to. (Counting max_waiting alone refused the 5th of 6 sequences added between two steps to an
        idle engine of 4 + 4: a PD decode replica receiving a burst of handoffs.)"""
        if len(self.waiting) + num_seqs > self.max_waiting + max(0, self.max_num_seqs - len(self.running)):
            raise QueueFullError(f"waiting queue is full ({self.max_waiting} sequences); retry later")

    def add(self, seqs: list[Sequence]) -> None:
        self.check_room(len(seqs))
        self.waiting.extend(seqs)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> list[tuple[Sequence, int]]:
        """The (sequence, number of new tokens) pairs for the next step."""
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Sequence, int]] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(len(seq) - seq.num_computed_tokens, budget)
            while not self.block_manager.allocate_slots(seq, n):
                if self._reclaim_waiting_blocks(seq):  # a waiting import's KV goes before a running sequence's
                    continue
                victim = self.running.pop()  # the most recently admitted
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            else:
                scheduled.append((seq, n))
                budget -= n
                i += 1
                continue
            break  # seq itself was preempted; everything after it already was too
        if preempted:
            return scheduled  # no admissions in a step that had to evict
        skipped: list[Sequence] = []
        prefilling = sum(s.num_computed_tokens < s.num_prompt_tokens for s in self.running)
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            leader = seq.leader
            if leader is not None and not leader.is_finished and leader.num_computed_tokens < leader.num_prompt_tokens:
                # n > 1: wait until sample 0 has computed the prompt, then share its cached blocks.
                skipped.append(self.waiting.popleft())
                continue
            if seq.params.lora_name is not None and not self.lora.can_pin(seq.params.lora_name):
                # every adapter slot is held by running sequences of other adapters: wait for one to finish
                skipped.append(self.waiting.popleft())
                continue
            fresh = seq.num_computed_tokens == 0  # not an imported (prefilled) sequence
            if fresh and self.max_num_prefills is not None and prefilling >= self.max_num_prefills:
                break  # it waits for a prompt in progress to finish (EngineConfig.max_num_prefills)
            # A prompt whose log-probs are asked for is computed whole: cached positions would have no logits.
            cached = self.block_manager.cached_prefix(seq) if fresh and not seq.needs_prompt_logprobs else []
            # Blocks after those in lower tiers (EngineConfig.kv_tiers): loaded whole at admission, outside the token budget.
            tiered = self.block_manager.tiered_prefix(seq, cached) if fresh and not seq.needs_prompt_logprobs else []
            n, admitted = self._allocate_prefix(seq, cached, tiered, budget, fresh)
            if not admitted and tiered:  # too few free blocks to load it all now: compute it chunk by chunk instead
                tiered = []
                n, admitted = self._allocate_prefix(seq, cached, tiered, budget, fresh)
            if not admitted:
                if self.running or not self._reclaim_waiting_blocks(seq):
                    break
                continue  # the head again, with the blocks taken back
            self.waiting.popleft()
            if tiered:  # blocks that fail to load (gone, corrupt) are computed: the n tokens after them come later
                self.block_manager.load_tiered_prefix(seq, tiered)
            if seq.params.lora_name is not None:
                seq.lora_slot = self.lora.pin(seq.params.lora_name)
            seq.status = Status.RUNNING
            self.running.append(seq)
            scheduled.append((seq, n))
            budget -= n
            prefilling += fresh
        self.waiting.extendleft(reversed(skipped))
        return scheduled

    def _allocate_prefix(self, seq: Sequence, cached: list[int], tiered: list[int], budget: int, after_lookup: bool) -> tuple[int, bool]:
        """Blocks for a waiting sequence: its cached prefix shared, fresh ones for its ``tiered`` blocks (to load) and
        its first chunk of new tokens. Returns (that chunk's tokens, whether the blocks were free)."""
        bs = self.block_manager.block_size
        n = min(len(seq) - (len(cached) + len(tiered)) * bs - seq.num_computed_tokens, budget)
        return n, self.block_manager.allocate_slots(seq, len(tiered) * bs + n, cached, after_lookup=after_lookup)

    def _reclaim_waiting_blocks(self, head: Sequence) -> bool:
        """Free the blocks that a waiting sequence holds (one imported with its prompt's KV, the latest
        first) for ``head``, which does not fit: a running sequence short of blocks, or the head of the
        queue while nothing runs. The holder is recomputed when its turn comes, like a preempted one.
        Without this, imported requests that hold the whole cache wait for each other forever, and a
        prompt that cannot use the prefix cache (its log-probs asked for) is preempted mid-prefill and
        recomputed from the start again and again."""
        holder = next((s for s in reversed(self.waiting) if s is not head and s.block_table), None)
        if holder is None:
            return False
        self.block_manager.free_sequence(holder)
        self.num_preemptions += 1
        return True

    def _unpin_lora(self, seq: Sequence) -> None:
        if seq.lora_slot >= 0:
            self.lora.unpin(seq.params.lora_name)
            seq.lora_slot = -1

    def _preempt(self, seq: Sequence) -> None:
        self._unpin_lora(seq)
        self.block_manager.free_sequence(seq)
        seq.status = Status.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def finish(self, seq: Sequence, reason: str) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        self._unpin_lora(seq)
        self.block_manager.free_sequence(seq)
        self.running.remove(seq)

    def abort(self, request_id: str) -> list[Sequence]:
        """Drop every sequence of a request, freeing its blocks at once."""
        aborted = [s for s in (*self.waiting, *self.running) if s.request_id == request_id]
        for seq in aborted:
            if seq.status == Status.RUNNING:
                self.running.remove(seq)
                self._unpin_lora(seq)
            else:
                self.waiting.remove(seq)
            self.block_manager.free_sequence(seq)
            seq.status = Status.FINISHED
            seq.finish_reason = "abort"
        return aborted
