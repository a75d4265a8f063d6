"""Paged KV-cache bookkeeping with prefix caching.

A full block is keyed by the hash of its tokens chained with its parent block's
hash, so equal keys mean equal prefixes. Blocks are reference-counted: sequences
with a common prefix share its blocks. A block whose count drops to zero goes to the
back of the free queue but keeps its hash: until it is reused (oldest first, LRU), a
new sequence with the same prefix picks it up without recomputing. With tiers (engine.kv_tiers), a hashed block
that is reused is first copied to host memory (and from there to disk), and a prefix that continues there is loaded
back into fresh blocks (``tiered_prefix``, ``load_tiered_prefix``) instead of recomputed.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from typing import TYPE_CHECKING

from mlplat.engine.sequence import Sequence

if TYPE_CHECKING:
    from mlplat.engine.kv_tiers import TieredKVCache


def block_hash(token_ids: list[int], parent_hash: int | None) -> int:
    h = hashlib.blake2b(digest_size=8)
    if parent_hash is not None:
        h.update(parent_hash.to_bytes(8, "little"))
    h.update(b"".join(t.to_bytes(4, "little") for t in token_ids))
    return int.from_bytes(h.digest(), "little")


def block_hash_seed(lora_name: str | None) -> int | None:
    """The parent hash of a sequence's first block: None for the base model; for a LoRA adapter, its name's hash, so that
    blocks computed through different adapters (different KV for the same tokens) never share a key."""
    if lora_name is None:
        return None
    return int.from_bytes(hashlib.blake2b(lora_name.encode(), digest_size=8, person=b"lora").digest(), "little")


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = None
        self.token_ids: list[int] = []


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True, tiers: TieredKVCache | None = None):
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # LRU order
        self.hash_to_block: dict[int, int] = {}
        self.queried_tokens = 0
        self.hit_tokens = 0  # of which tier_hit_tokens were loaded from the tiers
        self.tier_hit_tokens = 0
        # Prefix-cache changes for a KV-event router (mlplat.serve.kv_index): recorded once take_kv_events is first called.
        self.kv_events: list[tuple[str, int | None]] | None = None
        self.tiers = tiers  # host (and disk) tiers below the pool; they report blocks entering and leaving them here
        if tiers is not None:
            tiers.record = self._record
        # Past one event per block held (pool and tiers) a snapshot is smaller than the events.
        self.max_kv_events = num_blocks + (tiers.capacity_blocks if tiers is not None else 0)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free) / len(self.blocks)

    @property
    def hit_rate(self) -> float:
        """Fraction of prompt tokens looked up in the prefix cache that were found there."""
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0

    def cached_prefix(self, seq: Sequence) -> list[int]:
        """Block ids holding the longest cached prefix of ``seq``'s full blocks.

        At least one token is always left to compute, so the step yields logits."""
        if not self.enable_prefix_caching:
            return []
        found, parent = [], block_hash_seed(seq.params.lora_name)
        for i in range((len(seq) - 1) // self.block_size):
            tokens = seq.block_tokens(i, self.block_size)
            parent = block_hash(tokens, parent)
            block_id = self.hash_to_block.get(parent)
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            found.append(block_id)
        return found

    def allocate_slots(self, seq: Sequence, num_new_tokens: int, cached: list[int] = (), after_lookup: bool = False) -> bool:
        """Make ``seq``'s block table cover ``num_computed + num_new_tokens`` tokens.

        ``cached`` (for a sequence not yet started) are prefix blocks to share, found by
        ``cached_prefix``; ``after_lookup`` counts the lookup in the hit rate. Returns
        False, changing nothing, when there are not enough free blocks."""
        assert not cached or not seq.block_table
        needed = (seq.num_computed_tokens + len(cached) * self.block_size + num_new_tokens + self.block_size - 1) // self.block_size
        new = needed - len(seq.block_table) - len(cached)
        reusable = sum(1 for b in cached if b in self.free)  # cached blocks sitting in the free queue
        if new + reusable > len(self.free):
            return False
        for block_id in cached:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self.free[block_id]
            block.ref_count += 1
            seq.block_table.append(block_id)
        if after_lookup and self.enable_prefix_caching:
            self.queried_tokens += len(seq) - 1
            self.hit_tokens += len(cached) * self.block_size
        seq.num_computed_tokens += len(cached) * self.block_size
        for _ in range(max(0, new)):
            block_id, _ = self.free.popitem(last=False)  # least recently freed
            block = self.blocks[block_id]
            if block.hash is not None and self.hash_to_block.get(block.hash) == block_id:
                del self.hash_to_block[block.hash]  # evict from the prefix cache
                self._record("evicted", block.hash)
                if self.tiers is not None:  # its KV, before the new owner's step overwrites it
                    self.tiers.offload(block.hash, block_id)
            block.hash, block.token_ids, block.ref_count = None, [], 1
            seq.block_table.append(block_id)
        return True

    def fork(self, parent: Sequence, child: Sequence) -> list[tuple[int, int]] | None:
        """Give ``child`` (a new sample of ``parent``'s prompt, not yet started) ``parent``'s computed KV: its full blocks
        shared by reference, as for a prefix hit; its partial last block, which the child will write its own tokens into,
        as a fresh block (copy-on-write). Returns the (source, destination) block pairs whose KV the caller copies, or None,
        changing nothing, when no block is free for the copy."""
        assert not child.block_table and parent.num_computed_tokens > 0
        full = parent.num_computed_tokens // self.block_size
        partial = parent.block_table[full : (parent.num_computed_tokens + self.block_size - 1) // self.block_size]
        if len(partial) > len(self.free):
            return None
        for block_id in parent.block_table[:full]:
            assert self.blocks[block_id].ref_count > 0  # held by the parent: never in the free queue
            self.blocks[block_id].ref_count += 1
            child.block_table.append(block_id)
        child.num_computed_tokens = full * self.block_size
        child.num_hashed_blocks = min(parent.num_hashed_blocks, full)
        allocated = self.allocate_slots(child, parent.num_computed_tokens - child.num_computed_tokens)
        assert allocated
        child.num_computed_tokens = parent.num_computed_tokens
        return list(zip(partial, child.block_table[full:]))

    def tiered_prefix(self, seq: Sequence, cached: list[int]) -> list[int]:
        """Hashes of the blocks that continue ``seq``'s pool-cached prefix (``cached``, from ``cached_prefix``) in the
        tiers, in order; as there, at least one token is left to compute."""
        if self.tiers is None or not self.enable_prefix_caching:
            return []
        found, parent = [], self.blocks[cached[-1]].hash if cached else block_hash_seed(seq.params.lora_name)
        for i in range(len(cached), (len(seq) - 1) // self.block_size):
            parent = block_hash(seq.block_tokens(i, self.block_size), parent)
            if parent not in self.tiers:
                break
            found.append(parent)
        self.tiers.touch(reversed(found))  # the first block most recent: a chain is only as long as its first gap
        return found

    def load_tiered_prefix(self, seq: Sequence, hashes: list[int]) -> int:
        """Load the blocks ``tiered_prefix`` found into the fresh blocks that ``allocate_slots`` gave ``seq`` after its
        cached prefix, each registered in the prefix cache as if computed. Stops at the first block no tier can serve
        (its file gone or corrupt): from there the prompt is computed. Returns how many blocks were loaded."""
        first = seq.num_computed_tokens // self.block_size
        assert seq.num_computed_tokens % self.block_size == 0 and len(seq.block_table) >= first + len(hashes)
        loaded = 0
        for i, h in enumerate(hashes, start=first):
            block = self.blocks[seq.block_table[i]]
            assert block.ref_count == 1 and block.hash is None, "a fresh block of this sequence"
            if not self.tiers.load(h, block.block_id):
                break
            block.token_ids, block.hash = seq.block_tokens(i, self.block_size), h
            if self.hash_to_block.setdefault(h, block.block_id) == block.block_id:  # not a duplicate
                self._record("stored", h)
            loaded += 1
        seq.num_computed_tokens += loaded * self.block_size
        self.hit_tokens += loaded * self.block_size
        self.tier_hit_tokens += loaded * self.block_size
        return loaded

    def cache_full_blocks(self, seq: Sequence) -> None:
        """Register the blocks that ``seq`` has completely computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        start = seq.num_hashed_blocks
        parent = self.blocks[seq.block_table[start - 1]].hash if start else block_hash_seed(seq.params.lora_name)
        for i in range(start, seq.num_computed_tokens // self.block_size):
            block = self.blocks[seq.block_table[i]]
            if block.hash is None:
                block.token_ids = seq.block_tokens(i, self.block_size)
                block.hash = block_hash(block.token_ids, parent)
                if self.hash_to_block.setdefault(block.hash, block.block_id) == block.block_id:  # not a duplicate
                    self._record("stored", block.hash)
            parent = block.hash
            seq.num_hashed_blocks = i + 1

    def clear_prefix_cache(self) -> None:
        """Forget every cached prefix (e.g. new weights made their KV stale); blocks in use keep their KV."""
        self.hash_to_block.clear()
        for block in self.blocks:
            block.hash, block.token_ids = None, []
        if self.tiers is not None:
            self.tiers.clear()
        if self.kv_events is not None:
            self.kv_events = [("cleared", None)]  # subsumes what came before

    def _record(self, kind: str, h: int) -> None:
        # Past one event per block a snapshot is smaller: stop recording, take_kv_events sends one.
        if self.kv_events is not None and len(self.kv_events) <= self.max_kv_events:
            self.kv_events.append((kind, h))

    def take_kv_events(self, snapshot: bool = False) -> tuple[list[int] | None, list[tuple[str, int | None]]]:
        """The prefix cache's changes since the last call: (None, events), or (every cached hash, []) when
        ``snapshot`` is asked, on the first call (recording starts then) or when a snapshot is smaller. With tiers, a
        snapshot's events say what the tiers hold: ("offloaded", h) each."""
        events, self.kv_events = self.kv_events, []
        if snapshot or events is None or len(events) > self.max_kv_events:
            return list(self.hash_to_block), [("offloaded", h) for h in self.tiers.hashes()] if self.tiers is not None else []
        return None, events

    def free_sequence(self, seq: Sequence) -> None:
        # Release tail first, so a sequence's prefix is the last of it to be evicted.
        for block_id in reversed(seq.block_table):
            block = self.blocks[block_id]
            block.ref_count -= 1
            assert block.ref_count >= 0
            if block.ref_count == 0:
                self.free[block_id] = None
        seq.block_table = []
        seq.num_computed_tokens = 0
        seq.num_hashed_blocks = 0

    def check_invariants(self, live: list[Sequence]) -> None:
        """Every block is either free or referenced exactly as often as live tables hold it."""
        refs = [0] * len(self.blocks)
        for seq in live:
            for block_id in seq.block_table:
                refs[block_id] += 1
        for block in self.blocks:
            assert block.ref_count == refs[block.block_id], f"block {block.block_id}: {block.ref_count} != {refs[block.block_id]}"
            assert (block.ref_count == 0) == (block.block_id in self.free), f"block {block.block_id} free-list mismatch"
        for h, block_id in self.hash_to_block.items():
            assert self.blocks[block_id].hash == h, f"block {block_id} is cached under a hash it does not have"
        if self.tiers is not None:
            self.tiers.check_invariants()
