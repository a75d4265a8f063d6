"""KV-event routing: the block manager's events, the index they feed, the policy on top, and the router inside Serve."""

from __future__ import annotations

import random
import tempfile
import time

import httpx
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from mlplat.engine import SamplingParams
from mlplat.engine.block_manager import BlockManager
from mlplat.engine.config import KVTiersConfig
from mlplat.engine.kv_tiers import HEADER, TieredKVCache
from mlplat.engine.sequence import Sequence
from mlplat.serve.kv_index import KVBlockIndex, kv_index_actor, prompt_block_hashes
from mlplat.serve.routing import prefix_key, rank_by_cached_prefix, rank_prefill_replicas

BLOCK = 4

# One engine's life, as the block manager sees it: run a prompt (drawn from few tokens, so prefixes repeat), hold it
# or free it, free the oldest held, clear the prefix cache (new weights), or hand the events so far to the index.
ops = st.lists(
    st.one_of(
        st.tuples(st.just("run"), st.lists(st.integers(0, 2), min_size=1, max_size=14), st.booleans()),
        st.tuples(st.just("free")),
        st.tuples(st.just("clear")),
        st.tuples(st.just("publish"), st.booleans()),  # True: the batch is lost on the way (a gap)
    ),
    max_size=40,
)


def run_prompt(bm: BlockManager, tokens: list[int]) -> Sequence | None:
    seq = Sequence("r", tokens, SamplingParams())
    cached = bm.cached_prefix(seq)
    tiered = bm.tiered_prefix(seq, cached)  # with tiers (engine.kv_tiers): blocks loaded back from them
    if not bm.allocate_slots(seq, len(seq) - len(cached) * BLOCK, cached):
        return None
    bm.load_tiered_prefix(seq, tiered)
    seq.num_computed_tokens = len(seq)
    bm.cache_full_blocks(seq)
    return seq


@settings(max_examples=150, deadline=None)
@given(ops, st.integers(3, 8))
def test_the_index_holds_what_the_event_stream_implies_and_a_gap_forces_a_resync(script, num_blocks):
    check_the_index_follows(BlockManager(num_blocks, BLOCK), script)


@settings(max_examples=60, deadline=None)
@given(ops, st.integers(3, 8), st.integers(1, 3), st.sampled_from([0, 2, 5]))
def test_the_index_also_knows_what_each_replica_holds_in_its_host_and_disk_tiers(script, num_blocks, host_blocks, disk_blocks):
    kv_cache = torch.zeros(1, 2, num_blocks, BLOCK, 1, 1)  # one layer, one head of one channel: 32 bytes a block
    with tempfile.TemporaryDirectory() as disk:
        cfg = KVTiersConfig(host_bytes=host_blocks * 32, disk_path=disk if disk_blocks else None,
                            disk_bytes=disk_blocks * (32 + HEADER.size))  # fmt: skip
        tiers = TieredKVCache(cfg, kv_cache)
        check_the_index_follows(BlockManager(num_blocks, BLOCK, tiers=tiers), script)
        tiers.close()


def check_the_index_follows(bm: BlockManager, script: list) -> None:
    """Run ``script`` on ``bm``, publishing its events to an index: after each batch that arrives the index equals the
    replica's prefix cache (pool and tiers); after a lost one it knows nothing of the replica until a snapshot."""
    index, held, seq_no, resync = KVBlockIndex(), [], 0, True
    tiered = bm.tiers.hashes if bm.tiers is not None else list
    for op in script:
        if op[0] == "run" and (seq := run_prompt(bm, op[1])) is not None:
            if op[2]:
                held.append(seq)
            else:
                bm.free_sequence(seq)
        elif op[0] == "free" and held:
            bm.free_sequence(held.pop(0))
        elif op[0] == "clear":
            bm.clear_prefix_cache()
        elif op[0] == "publish":
            snapshot, events = bm.take_kv_events(resync)
            seq_no += 1
            if op[1]:  # lost: the next batch arrives out of sequence
                continue
            resync = not index.apply("r0", seq_no, events, snapshot)
            if resync:  # the gap dropped everything the index knew of this replica
                assert snapshot is None and not index.blocks.get("r0") and all("r0" not in h for h in index.holders.values())
            else:
                assert index.blocks["r0"] == set(bm.hash_to_block), "the index must equal the replica's prefix cache"
                assert index.tiered["r0"] == set(tiered()), "and its tiers"
        bm.check_invariants(held)
    snapshot, events = bm.take_kv_events(resync)
    if not index.apply("r0", seq_no + 1, events, snapshot):  # the last batch was lost: one more round trip
        snapshot, events = bm.take_kv_events(True)
        assert index.apply("r0", seq_no + 2, events, snapshot)
    assert index.blocks["r0"] == set(bm.hash_to_block) and index.tiered["r0"] == set(tiered())
    assert {h for h, holders in index.holders.items() if "r0" in holders} == index.blocks["r0"] | index.tiered["r0"]


def publish(bm: BlockManager, index: KVBlockIndex, replica: str, seq_no: int) -> bool:
    snapshot, events = bm.take_kv_events()
    return index.apply(replica, seq_no, events, snapshot)


def test_events_name_the_hash_the_prefix_cache_uses_and_a_retired_replica_is_forgotten():
    bm, index = BlockManager(4, BLOCK), KVBlockIndex()
    assert publish(bm, index, "a", 1)  # the first take is a snapshot (empty): recording starts
    prompt = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    seq = run_prompt(bm, prompt)
    assert bm.kv_events == [("stored", h) for h in prompt_block_hashes(prompt, BLOCK)]
    assert publish(bm, index, "a", 2)
    assert index.matched_blocks(prompt_block_hashes(prompt, BLOCK), ["a", "b"]) == {"a": 2, "b": 0}
    bm.free_sequence(seq)
    run_prompt(bm, [7] * 15)  # needs every block: the prompt's are evicted
    assert [kind for kind, _ in bm.kv_events] == ["evicted", "evicted", "stored", "stored", "stored"]
    assert publish(bm, index, "a", 3)
    assert index.matched_blocks(prompt_block_hashes(prompt, BLOCK), ["a"]) == {"a": 0}
    assert not publish(bm, index, "a", 5) and "a" not in index.blocks  # a gap: forgotten until a snapshot
    assert publish(bm, index, "a", 6) is False  # still no snapshot asked for: still out
    index.apply("a", 7, *reversed(bm.take_kv_events(snapshot=True)))
    assert index.blocks["a"] == set(bm.hash_to_block) and len(index.blocks["a"]) == 3
    index.retire(["a"])
    assert "a" not in index.blocks and not index.holders
    assert index.apply("a", 8, [("stored", 1)]) and "a" not in index.blocks  # a late push from a retired replica: ignored


REPLICAS = ["r0", "r1", "r2"]


def test_the_replica_holding_the_longest_prefix_comes_first_within_the_load_bound():
    prompt = [random.Random(0).randrange(1000) for _ in range(200)]
    hashes, key = prompt_block_hashes(prompt, 16), prefix_key(prompt)
    by_hash = rank_prefill_replicas(key, REPLICAS, {})
    holder = by_hash[-1]  # the replica the hash likes least
    idle = {r: 0 for r in REPLICAS}
    assert rank_by_cached_prefix(hashes, {holder: 10}, REPLICAS, idle, key)[0] == holder
    assert rank_by_cached_prefix(hashes, {holder: 10, by_hash[0]: 8}, REPLICAS, idle, key)[0] == holder  # longest wins
    assert rank_by_cached_prefix(hashes, {}, REPLICAS, idle, key) == by_hash  # nothing cached: the hash policy
    overloaded = {**idle, holder: 12}
    assert rank_by_cached_prefix(hashes, {holder: 10}, REPLICAS, overloaded, key)[-1] == holder  # the load bound holds


@settings(max_examples=100, deadline=None)
@given(st.integers(0, 10_000), st.dictionaries(st.sampled_from(REPLICAS), st.integers(0, 12)),
       st.dictionaries(st.sampled_from(REPLICAS), st.integers(0, 5)))  # fmt: skip
def test_the_ranking_is_a_permutation_led_by_a_longest_match_or_the_hash(seed, matched, loads):
    prompt = [random.Random(seed).randrange(1000) for _ in range(200)]
    hashes, key = prompt_block_hashes(prompt, 16), prefix_key(prompt)
    ranked = rank_by_cached_prefix(hashes, matched, REPLICAS, loads, key)
    assert sorted(ranked) == sorted(REPLICAS)
    best = max(matched.values(), default=0)
    bound = 1.25 * sum(loads.get(r, 0) for r in REPLICAS) / len(REPLICAS) + 1
    if best >= 0.5 * len(hashes) and any(matched.get(r, 0) == best and loads.get(r, 0) <= bound for r in REPLICAS):
        assert matched.get(ranked[0], 0) == best
    if best == 0:
        assert ranked == rank_prefill_replicas(key, REPLICAS, loads)


def test_a_short_shared_preamble_spreads_distinct_continuations():
    rng = random.Random(1)
    preamble = [rng.randrange(1000) for _ in range(128)]  # 8 blocks, in front of every document
    docs = [preamble + [rng.randrange(1000) for _ in range(384)] for _ in range(24)]
    idle = {r: 0 for r in REPLICAS}
    # r0 holds the preamble only: a weak match, so each document goes where the hash past the preamble says
    firsts = {rank_by_cached_prefix(prompt_block_hashes(d, 16), {"r0": 8}, REPLICAS, idle, prefix_key(d))[0] for d in docs}
    assert firsts == set(REPLICAS)
    assert len({rank_prefill_replicas(prefix_key(d), REPLICAS, idle)[0] for d in docs}) == 1  # the first 64 tokens cannot tell


def test_each_router_setting_belongs_to_its_mode():
    from pydantic import ValidationError

    from mlplat.serve.config import ServeConfig

    assert ServeConfig(model="m", prefill_router="kv_events").prefill_router == "kv_events"
    assert ServeConfig(model="m", mode="colocated", colocated_router="kv_events").colocated_router == "kv_events"
    with pytest.raises(ValidationError, match="mode: colocated set colocated_router"):
        ServeConfig(model="m", mode="colocated", prefill_router="kv_events")
    with pytest.raises(ValidationError, match="mode: pd set prefill_router"):
        ServeConfig(model="m", colocated_router="kv_events")


# -- inside Serve -------------------------------------------------------------------------------------------------------

# The tiny model's context is 256 tokens; 48 blocks of 16 hold about 3 of the prompts below per replica besides the shared
# preamble, so a few long prompts evict them.
ENGINE = {"block_size": 16, "num_kv_blocks": 48, "max_num_seqs": 2, "max_waiting": 4}
APP = "kvroute"


def complete(prompt: list[int], attempts: int = 1) -> None:
    body = {"model": "tiny", "prompt": prompt, "max_tokens": 2}
    for attempt in range(attempts + 3):  # attempts > 1: right after a replica died, the first try may still pick it
        r = httpx.post(f"http://127.0.0.1:8000/{APP}/v1/completions", json=body, timeout=120)
        if r.status_code == 200:
            return
        if r.status_code != 404 and attempt + 1 >= attempts:  # 404: another Ray cluster's Serve proxy on this machine's
            break                                             # port 8000 took the connection (a shared machine)
    raise AssertionError(f"{r.status_code}: {r.text}")


def wait_for(what: str, condition, timeout_s: float = 120.0):
    """Poll ``condition`` until it returns something truthy (events reach the index within ~0.1 s; a replica starts in seconds)."""
    deadline = time.time() + timeout_s
    while not (value := condition()):
        assert time.time() < deadline, f"{what}: not within {timeout_s:.0f} s"
        time.sleep(0.2)
    return value


@pytest.mark.slow
def test_requests_go_where_the_prefix_is_cached_evictions_and_replaced_replicas_leave_the_index(ray_cluster, tiny_model):
    import ray
    from ray import serve

    from mlplat.serve.config import ServeConfig
    from serve_apps.llm import build_app

    cfg = ServeConfig(model=str(tiny_model), model_name="tiny", mode="colocated", colocated_router="kv_events", engine_args=ENGINE,
                      colocated={"num_cpus": 0.2, "num_replicas": 2}, ingress={"num_cpus": 0.1}, auth={"enabled": False},
                      app_name=APP, route_prefix=f"/{APP}")  # fmt: skip
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    try:
        wait_for("the route at the proxy", lambda: httpx.get(f"http://127.0.0.1:8000/{APP}/health", timeout=60).status_code == 200)
        def index(method: str, *args):  # looked up each time: the actor goes with the replica that created it
            try:
                return ray.get(getattr(kv_index_actor(APP, "llm"), method).remote(*args))
            except (AttributeError, ray.exceptions.RayActorError):  # none yet, or gone with its owner: refilled soon
                return {}

        rng = random.Random(7)
        tokens = lambda n: [rng.randrange(3, 200) for _ in range(n)]  # noqa: E731
        complete(tokens(40))  # the first prompt routed on its blocks creates the index (in the ingress); the replicas find it
        replicas = wait_for("both replicas' first snapshots", lambda: sorted(index("describe")) if len(index("describe")) == 2 else None)
        held = lambda p: index("holders", prompt_block_hashes(p, 16))  # noqa: E731
        # Documents behind one 64-token preamble: the hash of the first 64 tokens sends them all to one replica;
        # the preamble is too small a part of each to pin them there, so they spread over both.
        preamble, docs = tokens(64), []
        by_hash = rank_prefill_replicas(prefix_key(preamble), replicas, {})[0]
        for _ in range(6):
            docs.append(preamble + tokens(160))
            complete(docs[-1])
        holders = [wait_for("a document's blocks in the index", lambda d=d: {r for r, n in held(d).items() if n > 4}) for d in docs]
        assert all(len(h) == 1 for h in holders), holders
        away = [(d, h) for d, (h,) in zip(docs, holders) if h != by_hash]
        assert away, "every document went where the preamble's hash points: change the seed"

        # A request whose prefix one replica holds goes there, though the hash policy would send it to the other.
        doc, holder = away[0]
        longer = doc + tokens(14)
        complete(longer)
        wait_for("the continuation's blocks", lambda: held(longer).get(holder) == len(prompt_block_hashes(longer, 16)))
        assert held(longer).get(by_hash) == 4, "only the preamble on the other replica"

        # Eviction: prompts new to both replicas, hashed to the holder, together more than its cache.
        fillers = [f for f in (tokens(240) for _ in range(200)) if rank_prefill_replicas(prefix_key(f), replicas, {})[0] == holder][:4]
        for filler in fillers:
            complete(filler)
        wait_for("the evicted document to leave the index", lambda: held(longer).get(holder) == 0)

        # Replacement: the holder dies (Serve starts another replica meanwhile); the router retires it from the index,
        # which lives on in the ingress (its entries are not dropped by the index restarting).
        index_actor = kv_index_actor(APP, "llm")
        ray.kill(ray.get_actor(holder, namespace="serve"), no_restart=True)
        live = lambda: {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)  # noqa: E731
                        if a["name"].startswith(f"SERVE_REPLICA::{APP}#llm#")}  # fmt: skip
        wait_for("the dead replica to leave the GCS", lambda: holder not in live())
        complete(doc, attempts=10)  # goes to the survivor; the router's query reports the replica it saw leave
        wait_for("the dead replica's entries to be dropped", lambda: index("describe") and holder not in index("describe"))
        assert set(index("describe")) <= live(), "the index knows only live replicas"
        assert kv_index_actor(APP, "llm")._actor_id == index_actor._actor_id, "the same index, told by the router"
    finally:
        serve.delete(APP)
