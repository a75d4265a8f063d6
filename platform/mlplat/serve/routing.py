"""Replica choice for the PD app, as pure policies plus the Serve routers that apply them.

Prefill: requests sharing a prompt prefix should land where that prefix is cached.
Rendezvous hashing of the prefix's first blocks ranks the replicas the same way for
every request with that prefix; a replica already holding more than ``load_factor``
times the mean load (plus one) drops to the back, so one hot prefix cannot swamp it
(consistent hashing with bounded loads, Mirrokni et al. 2018).
Round robin (``prefill_router: round_robin``): each replica in turn, no affinity; the
baseline the prefix-aware router is measured against (benchmarks/serving.py).
KV events (``prefill_router: kv_events``, the default; ``colocated_router: kv_events``): replicas publish the blocks
their prefix cache stores and evicts to the app's index (``mlplat.serve.kv_index``); a request
goes to the replica holding the longest cached prefix of its prompt, under the same load bound.
Where nothing is cached, the rendezvous hash above decides. Where the best match is a small
part of the prompt (under ``min_cached_fraction``: a common preamble before distinct
documents), the hash is taken one block past the match, so distinct continuations spread over
the replicas instead of all following the preamble (SGLang's cache-aware router spreads such
requests by cache size, with the same threshold).
Decode: the replica with the most free KV blocks, as its replicas report them.

The Serve routers use FIFOMixin: without it, Ray 2.60's out-of-order matching left
concurrent requests unrouted (a hang seen in tests/test_serve.py). With it, in a burst
a request may take the replica ranked for the request ahead of it, so affinity is
best-effort under contention and exact when requests arrive one at a time.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Hashable, Sequence

import ray
from ray.serve.request_router import FIFOMixin, PendingRequest, ReplicaID, RequestRouter, RunningReplica

from mlplat.engine.block_manager import block_hash, block_hash_seed
from mlplat.serve.kv_index import kv_index_actor, prompt_block_hashes

log = logging.getLogger("mlplat.serve")


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
    return _bounded(sorted(replicas, key=lambda r: _weight(key, r), reverse=True), loads, load_factor)


def _bounded(ranked: list, loads: dict, load_factor: float) -> list:
    """``ranked`` with replicas over ``load_factor`` x the mean load (+1) moved to the back, in order."""
    bound = load_factor * sum(loads.get(r, 0) for r in ranked) / max(1, len(ranked)) + 1
    return [r for r in ranked if loads.get(r, 0) <= bound] + [r for r in ranked if loads.get(r, 0) > bound]


def rank_by_cached_prefix(hashes: Sequence[int], matched: dict, replicas: Sequence[Hashable], loads: dict, fallback_key: int | None,
                          load_factor: float = 1.25, min_cached_fraction: float = 0.5) -> list:  # fmt: skip
    """Replicas in preference order for a prompt whose block hashes are ``hashes``, given how many leading blocks
    each replica holds (``matched``, from the KV-event index): longest cached prefix first, within the load bound.
    Nothing cached anywhere: ``rank_prefill_replicas`` on ``fallback_key`` (``prefix_key``). A best match under
    ``min_cached_fraction`` of the prompt: the same, keyed one block past the match (see the module docstring)."""
    best = max((matched.get(r, 0) for r in replicas), default=0)
    if best == 0:
        return rank_prefill_replicas(fallback_key, replicas, loads, load_factor)
    if best < min_cached_fraction * len(hashes):
        return rank_prefill_replicas(hashes[min(len(hashes), max(best + 1, 4)) - 1], replicas, loads, load_factor)
    tie_break = hashes[best - 1]  # replicas holding the same prefix: rendezvous order, as the hash policy
    return _bounded(sorted(replicas, key=lambda r: (matched.get(r, 0), _weight(tie_break, r)), reverse=True), loads, load_factor)


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


class KVEventRouter(FIFOMixin, RequestRouter):
    """Serve router for prefill or colocated replicas: ``rank_by_cached_prefix``, asking the deployment's KV-event
    index (``mlplat.serve.kv_index``) which replicas hold the prompt's blocks. Without an answer within
    ``index_timeout_s`` (no index yet, or one restarting) it routes as ``PrefixAwareRouter`` does. Replicas that
    leave the deployment are retired from the index with the next query."""

    def initialize_state(self, block_size: int = 16, load_factor: float = 1.25, min_cached_fraction: float = 0.5,
                         index_timeout_s: float = 0.5) -> None:  # fmt: skip
        self.block_size, self.load_factor, self.min_cached_fraction = block_size, load_factor, min_cached_fraction
        self.index_timeout_s = index_timeout_s
        self._index = None  # the index actor: the first router to ask creates it, the others find it by name
        self._retired: list[str] = []  # replicas seen leaving, not yet reported to the index
        self._reports: set[asyncio.Task] = set()  # reports of them in flight
        self._index_ok = True

    def update_replicas(self, replicas: list[RunningReplica]) -> None:
        self._retire(self._replica_id_set - {r.replica_id for r in replicas})
        super().update_replicas(replicas)

    def on_replica_actor_died(self, replica_id: ReplicaID) -> None:
        self._retire([replica_id])
        super().on_replica_actor_died(replica_id)

    def _retire(self, replica_ids) -> None:
        self._retired += [r.to_full_id_str() for r in replica_ids]
        if self._retired:  # report now: the next query may be a while (or a pool of one, which asks nothing)
            try:
                task = asyncio.get_running_loop().create_task(self._matched([], []))
                self._reports.add(task)  # held until done: the event loop keeps only a weak reference
                task.add_done_callback(self._reports.discard)
            except RuntimeError:  # no event loop in this thread: the next query carries them
                pass

    async def choose_replicas(self, candidate_replicas: list[RunningReplica], pending_request: PendingRequest | None = None):
        args = pending_request.args if pending_request is not None else []
        if len(candidate_replicas) < 2 or not args or not isinstance(args[0], list):
            return [candidate_replicas]  # one replica, or not a prompt (e.g. stats): nothing to choose
        by_id = {r.replica_id.to_full_id_str(): r for r in candidate_replicas}
        loads = {name: self._replica_queue_len_cache.get(r.replica_id) or 0 for name, r in by_id.items()}
        params = args[1] if len(args) > 1 and isinstance(args[1], dict) else {}
        hashes = prompt_block_hashes(args[0], self.block_size, block_hash_seed(params.get("lora_name")))
        matched = await self._matched(hashes, list(by_id))
        ranked = rank_by_cached_prefix(hashes, matched, list(by_id), loads, prefix_key(args[0], self.block_size), self.load_factor,
                                       self.min_cached_fraction)  # fmt: skip
        return [[by_id[name]] for name in ranked]

    async def _matched(self, hashes: list[int], replicas: list[str]) -> dict[str, int]:
        if not hashes and not self._retired:
            return {}
        retired, self._retired = self._retired, []
        try:
            if self._index is None:  # a GCS lookup (or creation), off the event loop
                self._index = await asyncio.to_thread(kv_index_actor, self._deployment_id.app_name, self._deployment_id.name, True)
            matched = await asyncio.wait_for(self._index.score.remote(hashes, replicas, retired), self.index_timeout_s)
        except Exception as err:  # noqa: BLE001  (no answer in time, e.g. while the index starts: route on the hash alone)
            self._retired = retired + self._retired  # reported with the next query
            if isinstance(err, ray.exceptions.RayActorError):
                self._index = None  # gone with its owner: the next query finds or creates another
            if self._index_ok:
                log.warning("KV-event index unavailable (%s: %s): routing on prefix hashes", type(err).__name__, err)
            self._index_ok = False
            return {}
        self._index_ok = True
        return matched
