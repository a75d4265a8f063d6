"""Replica choice for the PD app, as pure policies plus the Serve routers that apply them.

Prefill: requests sharing a prompt prefix should land where that prefix is cached.
Rendezvous hashing of the prefix's first blocks ranks the replicas the same way for
every request with that prefix; a replica already holding more than ``load_factor``
times the mean load (plus one) drops to the back, so one hot prefix cannot swamp it
(consistent hashing with bounded loads, Mirrokni et al. 2018).
Round robin (``prefill_router: round_robin``): each replica in turn, no affinity; the
baseline the prefix-aware router is measured against (benchmarks/serving.py).
Decode: the replica with the most free KV blocks, as its replicas report them.

The Serve routers use FIFOMixin: without it, Ray 2.60's out-of-order matching left
concurrent requests unrouted (a hang seen in tests/test_serve.py). With it, in a burst
a request may take the replica ranked for the request ahead of it, so affinity is
best-effort under contention and exact when requests arrive one at a time.
"""

from __future__ import annotations

import hashlib
from collections.abc import Hashable, Sequence

from ray.serve.request_router import FIFOMixin, PendingRequest, RequestRouter, RunningReplica

from mlplat.engine.block_manager import block_hash


def prefix_key(prompt_ids: Sequence[int], block_size: int = 16, max_blocks: int = 4) -> int | None:
    """Hash of the prompt's first full blocks (None when shorter than a block)."""
    key = None
    for i in range(min(max_blocks, len(prompt_ids) // block_size)):
        key = block_hash(list(prompt_ids[i * block_size : (i + 1) * block_size]), key)
    return key


def _weight(key: int, replica: Hashable) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}:{replica}".encode(), digest_size=8).digest(), "little")


def rank_prefill_replicas(key: int | None, replicas: Sequence[Hashable], loads: dict, load_factor: float = 1.25) -> list:
    """Replicas in preference order for a prompt with prefix ``key``."""
    if key is None:  # no shared prefix to exploit: least loaded first
        return sorted(replicas, key=lambda r: loads.get(r, 0))
    ranked = sorted(replicas, key=lambda r: _weight(key, r), reverse=True)
    bound = load_factor * sum(loads.get(r, 0) for r in replicas) / max(1, len(replicas)) + 1
    return [r for r in ranked if loads.get(r, 0) <= bound] + [r for r in ranked if loads.get(r, 0) > bound]


def round_robin_order(replicas: Sequence[Hashable], turn: int) -> list:
    """Replicas in preference order for the ``turn``-th request: the next one in a fixed order
    first, then the ones after it (so a full replica passes the request on)."""
    ordered = sorted(replicas, key=str)
    start = turn % len(ordered) if ordered else 0
    return ordered[start:] + ordered[:start]


def rank_decode_replicas(replicas: Sequence[Hashable], free_blocks: dict) -> list:
    """Most free KV blocks first (unknown counts last)."""
    return sorted(replicas, key=lambda r: free_blocks.get(r, -1), reverse=True)


class PrefixAwareRouter(FIFOMixin, RequestRouter):
    """Serve router for prefill replicas: ``rank_prefill_replicas`` on the prompt's token ids."""

    def initialize_state(self, block_size: int = 16, load_factor: float = 1.25) -> None:
        self.block_size, self.load_factor = block_size, load_factor

    async def choose_replicas(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None):
        args = pending_request.args if pending_request is not None else []
        if not candidate_replicas or not args or not isinstance(args[0], list):
            return [candidate_replicas]  # not a prefill call (e.g. stats): any replica
        by_id = {r.replica_id: r for r in candidate_replicas}
        loads = {rid: self._replica_queue_len_cache.get(rid) or 0 for rid in by_id}
        key = prefix_key(args[0], self.block_size)
        return [[by_id[rid]] for rid in rank_prefill_replicas(key, list(by_id), loads, self.load_factor)]


class RoundRobinRouter(FIFOMixin, RequestRouter):
    """Serve router for prefill replicas without affinity: ``round_robin_order``, one turn per routing attempt
    (each caller, i.e. ingress replica, keeps its own turn)."""

    def initialize_state(self) -> None:
        self.turn = 0

    async def choose_replicas(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None):
        by_id = {r.replica_id: r for r in candidate_replicas}
        ranked = round_robin_order(list(by_id), self.turn)
        self.turn += 1
        return [[by_id[rid]] for rid in ranked]


class FreeKVRouter(FIFOMixin, RequestRouter):
    """Serve router for decode replicas: ``rank_decode_replicas`` on their reported free KV blocks."""

    def initialize_state(self) -> None:
        pass

    async def choose_replicas(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None):
        if not candidate_replicas:
            return []
        by_id = {r.replica_id: r for r in candidate_replicas}
        free = {rid: r.routing_stats.get("free_kv_blocks", -1) for rid, r in by_id.items()}
        return [[by_id[rid]] for rid in rank_decode_replicas(list(by_id), free)]
