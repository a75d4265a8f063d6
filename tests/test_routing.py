"""The PD app's replica-choice policies, on their own."""

import asyncio
import random
from types import SimpleNamespace

from mlplat.serve.routing import RoundRobinRouter, prefix_key, rank_decode_replicas, rank_prefill_replicas, round_robin_order

REPLICAS = ["r0", "r1", "r2", "r3"]


def prompt(prefix_seed: int, tail_seed: int, prefix_len=64, tail_len=20) -> list[int]:
    a, b = random.Random(prefix_seed), random.Random(tail_seed)
    return [a.randrange(1000) for _ in range(prefix_len)] + [b.randrange(1000) for _ in range(tail_len)]


def test_shared_prefix_goes_to_the_same_replica():
    idle = {r: 0 for r in REPLICAS}
    firsts = {rank_prefill_replicas(prefix_key(prompt(1, tail)), REPLICAS, idle)[0] for tail in range(20)}
    assert len(firsts) == 1  # only the tail differs: the first 4 blocks decide


def test_distinct_prefixes_spread_over_replicas():
    idle = {r: 0 for r in REPLICAS}
    counts = {r: 0 for r in REPLICAS}
    for seed in range(400):
        counts[rank_prefill_replicas(prefix_key(prompt(seed, 0)), REPLICAS, idle)[0]] += 1
    assert min(counts.values()) > 60, counts  # ~100 each


def test_hot_prefix_is_bounded_by_load():
    key = prefix_key(prompt(7, 0))
    home = rank_prefill_replicas(key, REPLICAS, {r: 0 for r in REPLICAS})[0]
    overloaded = {r: 1 for r in REPLICAS} | {home: 12}
    ranked = rank_prefill_replicas(key, REPLICAS, overloaded)
    assert ranked[0] != home and ranked[-1] == home
    assert rank_prefill_replicas(key, REPLICAS, {r: 2 for r in REPLICAS} | {home: 3})[0] == home  # within the bound


def test_short_prompts_go_to_the_least_loaded():
    assert prefix_key([1, 2, 3]) is None
    assert rank_prefill_replicas(None, REPLICAS, {"r0": 3, "r1": 0, "r2": 5, "r3": 1})[0] == "r1"


def test_decode_prefers_free_kv_blocks():
    assert rank_decode_replicas(REPLICAS, {"r0": 10, "r1": 300, "r2": 42}) == ["r1", "r2", "r0", "r3"]


def test_round_robin_takes_replicas_in_turn_whatever_the_prefix():
    firsts = [round_robin_order(list(reversed(REPLICAS)), turn)[0] for turn in range(8)]
    assert firsts == REPLICAS + REPLICAS  # a fixed order, each replica once per round
    assert round_robin_order(REPLICAS, 2) == ["r2", "r3", "r0", "r1"]  # the rest follow, for when the first is full
    router = RoundRobinRouter.__new__(RoundRobinRouter)  # the policy as Serve calls it (no Serve needed)
    router.initialize_state()
    replicas = [SimpleNamespace(replica_id=r) for r in REPLICAS[:2]]
    same_prefix = SimpleNamespace(args=[prompt(1, 0)])
    chosen = [asyncio.run(router.choose_replicas(replicas, same_prefix))[0][0].replica_id for _ in range(4)]
    assert chosen == ["r0", "r1", "r0", "r1"]  # no affinity: a shared prefix alternates
