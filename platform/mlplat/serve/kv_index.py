"""Which replica holds which KV blocks: an index fed by the replicas' block events, read by the router.

As Dynamo's KV router and llm-d's kv-cache manager do, every engine replica publishes what its
prefix cache gains and loses, keyed by the chained block hash the cache already uses
(``mlplat.engine.block_manager.block_hash``): ``("stored", h)``, ``("evicted", h)``, ``("cleared", None)``.
A replica with tiers below its pool (``EngineConfig.kv_tiers``: host memory, disk) also says what enters them,
``("offloaded", h)``, and leaves them, ``("dropped", h)``; a block there is loaded back instead of recomputed, so it
counts as held (the index keeps it apart, for operators: ``describe``).
The router walks a prompt's chained hashes and asks which replicas hold how long a prefix.

Transport, within Ray: one index actor per routed deployment (a named Ray actor, ``KVIndexActor``) that
engine replicas push numbered batches to and routers query per request, the llm-d shape (a central
index, scored per request; Ray Serve LLM's prefix-aware router keeps its tree in such an actor too).
Chosen over Serve's routing-stats channel (``record_routing_stats``), which the controller polls and
broadcasts as a latest value: a router that misses one poll loses that batch and cannot ask the
replica for a snapshot, and every batch would pass through the cluster-wide controller. A plain actor
rather than a Serve deployment because routers run inside Serve's handle machinery, where a nested
Serve call stalled routing in tests; an actor call is a plain awaitable. Any number of ingress
replicas (routers) read the same state. The first router to route on it creates the actor and owns
it (not detached: it goes with the app, and lives as long as an ingress replica, which engine
faults, autoscaling and replacements leave alone); replicas find it by name. If its owner goes, the
next query recreates it empty and the sequence check below refills it within a heartbeat.

Consistency: each replica numbers its batches 1, 2, 3, ... A batch that does not follow the
last one applied (a lost push, a restarted index, a replica the index has not seen) drops that
replica's entries and asks for a snapshot (``publish`` returns False); the replica's next batch
carries its whole cache. Replicas push at least every ``HEARTBEAT_S``, so a resync is never
waited on for long. A replica that leaves the deployment (replaced, scaled down) is retired by
the routers, which see the replica set change: its entries are dropped and its late pushes
ignored. Scores only count replicas the router names as candidates, so a stale entry never
routes a request.
"""

from __future__ import annotations

import asyncio
import logging
from collections import OrderedDict
from collections.abc import Iterable, Sequence

import ray

from mlplat.engine.block_manager import block_hash
from mlplat.serve.async_engine import EngineDeadError

log = logging.getLogger("mlplat.serve")

KV_INDEX_NAMESPACE = "mlplat"
PUBLISH_PERIOD_S = 0.05  # how often a replica drains its engine's events (a push only when there are some)
HEARTBEAT_S = 1.0  # an empty push at least this often: a restarted index asks for a snapshot within a second
MAX_RETIRED = 4096  # replica ids remembered as gone (their late pushes are ignored)

KVEvent = tuple[str, int | None]  # ("stored" | "evicted" | "offloaded" | "dropped", block hash) or ("cleared", None)


def prompt_block_hashes(prompt_ids: Sequence[int], block_size: int, seed: int | None = None) -> list[int]:
    """The chained hashes of the prompt's blocks that an engine could find cached: as ``BlockManager.cached_prefix``
    walks them (full blocks, leaving at least one token to compute). ``seed``: ``block_hash_seed`` of its adapter."""
    hashes, parent = [], seed
    for i in range((len(prompt_ids) - 1) // block_size):
        parent = block_hash(list(prompt_ids[i * block_size : (i + 1) * block_size]), parent)
        hashes.append(parent)
    return hashes


class KVBlockIndex:
    """Per replica: the set of block hashes its prefix cache holds (``blocks``: its KV pool; ``tiered``: its host and
    disk tiers), as its event stream implies."""

    def __init__(self) -> None:
        self.blocks: dict[str, set[int]] = {}
        self.tiered: dict[str, set[int]] = {}
        # block hash -> replicas holding it, in the pool or a tier (the inverse of ``blocks`` and ``tiered``)
        self.holders: dict[int, set[str]] = {}
        self.last_seq: dict[str, int] = {}
        self.retired: OrderedDict[str, None] = OrderedDict()

    def apply(self, replica: str, seq: int, events: Iterable[KVEvent] = (), snapshot: Iterable[int] | None = None) -> bool:
        """Apply batch ``seq`` of ``replica``; ``snapshot`` (all its hashes) replaces what is known first.
        False when the batch does not follow the last one: the replica's entries are dropped until a snapshot."""
        if replica in self.retired:
            return True  # gone: nothing to resync
        if snapshot is not None:
            self.drop(replica)
            self.blocks[replica], self.tiered[replica] = set(), set()
            for h in snapshot:
                self._store(replica, h)
        elif self.last_seq.get(replica) != seq - 1:
            self.drop(replica)
            return False
        self.last_seq[replica] = seq
        for kind, h in events:
            if kind == "stored":
                self._store(replica, h)
            elif kind == "evicted":
                self._evict(replica, h)
            elif kind == "offloaded":
                self._store(replica, h, self.tiered)
            elif kind == "dropped":
                self._evict(replica, h, self.tiered)
            elif kind == "cleared":
                for held in list(self.blocks[replica]):
                    self._evict(replica, held)
                for held in list(self.tiered[replica]):
                    self._evict(replica, held, self.tiered)
            else:
                raise ValueError(f"unknown KV event {kind!r}")
        return True

    def _store(self, replica: str, h: int, where: dict[str, set[int]] | None = None) -> None:
        (self.blocks if where is None else where)[replica].add(h)
        self.holders.setdefault(h, set()).add(replica)

    def _evict(self, replica: str, h: int, where: dict[str, set[int]] | None = None) -> None:
        (self.blocks if where is None else where)[replica].discard(h)
        if h not in self.blocks[replica] and h not in self.tiered[replica]:  # held still in the other
            self._unhold(replica, h)

    def _unhold(self, replica: str, h: int) -> None:
        holders = self.holders.get(h)
        if holders is not None:
            holders.discard(replica)
            if not holders:
                del self.holders[h]

    def drop(self, replica: str) -> None:
        """Forget ``replica``'s entries (it stays known: its next batch must be a snapshot)."""
        for h in self.blocks.pop(replica, set()) | self.tiered.pop(replica, set()):
            self._unhold(replica, h)
        self.last_seq.pop(replica, None)

    def retire(self, replicas: Iterable[str]) -> None:
        """Replicas that left the deployment: dropped for good (a replica id is never reused)."""
        for replica in replicas:
            self.drop(replica)
            self.retired[replica] = None
            while len(self.retired) > MAX_RETIRED:
                self.retired.popitem(last=False)

    def matched_blocks(self, hashes: Sequence[int], replicas: Iterable[str]) -> dict[str, int]:
        """For each of ``replicas``: how many leading blocks of ``hashes`` (a prompt's chain) it holds."""
        matched = dict.fromkeys(replicas, 0)
        active = set(matched)
        for i, h in enumerate(hashes):
            active &= self.holders.get(h, set())
            if not active:
                break
            for replica in active:
                matched[replica] = i + 1
        return matched


class KVIndexActor:
    """The ``KVBlockIndex`` of one deployment's replicas, as a Ray actor (``kv_index_actor``). Its methods run one at
    a time (a synchronous actor), so each call sees and leaves a consistent index."""

    def __init__(self) -> None:
        self.index = KVBlockIndex()

    def publish(self, replica: str, seq: int, events: list[KVEvent], snapshot: list[int] | None = None) -> bool:
        ok = self.index.apply(replica, seq, events, snapshot)
        if not ok:
            log.info("KV events of %s: batch %d out of sequence; asking for a snapshot", replica, seq)
        return ok

    def score(self, hashes: list[int], replicas: list[str], retired: list[str] = ()) -> dict[str, int]:
        """Leading blocks of ``hashes`` each candidate holds; ``retired``: replicas the router saw leave."""
        self.index.retire(retired)
        return self.index.matched_blocks(hashes, replicas)

    def describe(self, tiers: bool = False) -> dict[str, int] | dict[str, tuple[int, int]]:
        """Blocks held per known replica (for tests and operators); ``tiers``: (in its pool, in its tiers) each."""
        if tiers:
            return {replica: (len(blocks), len(self.index.tiered[replica])) for replica, blocks in self.index.blocks.items()}
        return {replica: len(blocks) for replica, blocks in self.index.blocks.items()}

    def holders(self, hashes: list[int]) -> dict[str, int]:
        """Leading blocks of ``hashes`` held by every known replica."""
        return self.index.matched_blocks(hashes, list(self.index.blocks))


def kv_index_name(app: str, deployment: str) -> str:
    return f"kv_index::{app}::{deployment}"


_created: dict[str, object] = {}  # index actors this process created: a non-detached actor lives while its owner holds a handle


def kv_index_actor(app: str, deployment: str, create: bool = False):
    """The index actor of ``deployment`` in ``app`` (created, owned by this process, if ``create`` and absent), or None."""
    name = kv_index_name(app, deployment)
    if create:
        actor = ray.remote(KVIndexActor).options(name=name, namespace=KV_INDEX_NAMESPACE, get_if_exists=True, num_cpus=0,
                                                 max_restarts=0).remote()  # fmt: skip
        _created[name] = actor
        return actor
    try:
        return ray.get_actor(name, namespace=KV_INDEX_NAMESPACE)
    except ValueError:  # not created yet (no replica has published) or gone with its owner
        return None


async def publish_kv_events(drain, app: str, deployment: str, replica: str) -> None:
    """A replica's publisher: drain its engine's events (``drain(snapshot: bool)`` -> (snapshot or None, events))
    every PUBLISH_PERIOD_S and push them to the index, numbered; a rejected or failed push means a snapshot next.
    Until a router has created the index it looks for it once per heartbeat (nothing is recorded meanwhile).
    Runs until the engine dies (``drain`` raises EngineDeadError)."""
    loop = asyncio.get_running_loop()
    seq, resync, last_push, last_lookup, index = 0, True, float("-inf"), float("-inf"), None
    while True:
        try:
            if index is None and loop.time() - last_lookup >= HEARTBEAT_S:
                last_lookup = loop.time()
                index = await asyncio.to_thread(kv_index_actor, app, deployment)  # a GCS lookup, off the event loop
                resync = True
            snapshot, events = await drain(resync) if index is not None else (None, [])
            if index is not None and (snapshot is not None or events or loop.time() - last_push >= HEARTBEAT_S):
                seq += 1
                resync = not await index.publish.remote(replica, seq, events, snapshot)
                last_push = loop.time()
        except EngineDeadError:  # the replica is being replaced; its successor publishes
            return
        except Exception as err:  # noqa: BLE001  (the index went with its owner: find the next one, send a snapshot)
            log.warning("publishing KV events failed (%s: %s); will send a snapshot", type(err).__name__, err)
            resync, index = True, None
        await asyncio.sleep(PUBLISH_PERIOD_S)
