"""Tiers below the prefix cache (engine.kv_tiers): host memory and disk, LRU within byte bounds; blocks evicted from a
small KV pool come back from them with outputs identical to recomputing; a block missing or corrupt on disk is
recomputed, never served; new weights clear every tier."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_engine import GREEDY, make_checkpoint

from mlplat.engine import EngineConfig, LLMEngine
from mlplat.engine.config import KVTiersConfig
from mlplat.engine.kv_tiers import HEADER, TieredKVCache
from mlplat.engine.runner import read_safetensors
from mlplat.models import load_tokenizer
from mlplat.serve.config import ServeConfig

BLOCK = 4
POOL_BLOCKS = 16  # 64 tokens: two of the prompts below do not fit together, so prefixes are evicted
PARAMS = GREEDY.model_copy(update={"max_tokens": 4})


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_model):
    torch.manual_seed(0)
    return make_checkpoint(tmp_path_factory.mktemp("llama"), load_tokenizer(tiny_model), "llama")


def engine_for(path, tiers: KVTiersConfig | None = None, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), block_size=BLOCK, num_kv_blocks=POOL_BLOCKS, max_model_len=64, kv_tiers=tiers, **kw))


def tiers_config(block_bytes: int, disk: Path | None, host_blocks: int = 3, disk_blocks: int = 24) -> KVTiersConfig:
    return KVTiersConfig(host_bytes=host_blocks * block_bytes, disk_path=disk,
                         disk_bytes=disk_blocks * (block_bytes + HEADER.size) if disk is not None else 0)  # fmt: skip


def shared_prefix_prompts(num_prefixes: int = 3, prefix_len: int = 24, seed: int = 0) -> list[list[int]]:
    """Each prefix twice, with different tails: the second asks for what the pool has evicted by then."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(3, 200) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [p + [rng.randrange(3, 200) for _ in range(rng.randint(1, 6))] for _ in range(2) for p in prefixes]


def run(engine: LLMEngine, prompts: list[list[int]], params: list | None = None) -> list[list[int]]:
    """Greedy outputs of ``prompts`` run together, checking block accounting (and the tiers' bounds) after every step."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompts, params or [PARAMS] * len(prompts))]
    outputs = {}
    while engine.has_unfinished:
        for out in engine.step():
            outputs[out.request_id] = out.outputs[0].token_ids
        engine.block_manager.check_invariants(engine.live_sequences())
    assert engine.block_manager.num_free_blocks == POOL_BLOCKS, "blocks leaked"
    return [outputs[i] for i in ids]


def run_one_at_a_time(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    return [run(engine, [p])[0] for p in prompts]


@pytest.fixture(scope="module")
def plain(llama) -> LLMEngine:
    return engine_for(llama, max_num_seqs=3)


@pytest.fixture(scope="module")
def reference(plain) -> list[list[int]]:
    return run_one_at_a_time(plain, shared_prefix_prompts())


@pytest.fixture(scope="module")
def block_bytes(plain) -> int:
    return plain.runner.kv_cache[:, :, 0].nbytes


def test_evicted_prefixes_come_back_from_host_and_disk_with_identical_outputs(llama, reference, block_bytes, tmp_path):
    engine = engine_for(llama, tiers_config(block_bytes, tmp_path, host_blocks=8))
    tiers = engine.block_manager.tiers
    prompts = shared_prefix_prompts()
    first = run_one_at_a_time(engine, prompts[:3])
    tiers.disk.flush()  # the second pass reads the disk tier's files, not blocks still queued for writing
    second = run_one_at_a_time(engine, prompts[3:])
    assert first + second == reference
    assert tiers.num_host_loads > 0 and tiers.num_disk_loads > 0 and tiers.num_failed_loads == 0
    assert engine.block_manager.tier_hit_tokens == (tiers.num_host_loads + tiers.num_disk_loads) * BLOCK


def test_a_block_corrupt_or_missing_on_disk_is_recomputed_and_dropped(llama, reference, block_bytes, tmp_path):
    engine = engine_for(llama, tiers_config(block_bytes, tmp_path, host_blocks=1))
    tiers = engine.block_manager.tiers
    prompts = shared_prefix_prompts()
    first = run_one_at_a_time(engine, prompts[:3])
    tiers.disk.flush()
    files = sorted(tiers.disk.dir.glob("*.kv"))
    assert len(files) >= 4
    corrupted = {}
    for i, path in enumerate(files):  # every block file: one byte flipped in its payload, or gone
        if i % 2:
            path.unlink()
        else:
            data = bytearray(path.read_bytes())
            data[HEADER.size + len(data) // 3 % (len(data) - HEADER.size)] ^= 0x40
            corrupted[path] = bytes(data)
            path.write_bytes(corrupted[path])
    second = run_one_at_a_time(engine, prompts[3:])
    assert first + second == reference
    assert tiers.num_failed_loads > 0
    tiers.disk.flush()
    for path in files:  # each bad block: refused and dropped (if not hit above, now), unless written afresh since
        h = int(path.stem, 16)
        if tiers.disk.read(h) is None:
            assert h not in tiers.disk
        else:
            assert path.read_bytes() != corrupted.get(path), "a corrupt block was served"


def test_a_failed_block_stops_the_load_there_and_the_rest_of_the_prompt_is_computed(llama, reference, block_bytes, tmp_path):
    """A block of a prompt's chain is corrupt on disk and later ones are sound: nothing after it is loaded
    (a later block's KV would sit behind the recomputed gap, but its slot would count as computed), and the output is
    the recomputed one."""
    from mlplat.engine.block_manager import block_hash

    engine = engine_for(llama, tiers_config(block_bytes, tmp_path, host_blocks=1))
    tiers, bm = engine.block_manager.tiers, engine.block_manager
    prompts = shared_prefix_prompts()
    run_one_at_a_time(engine, prompts[:3])
    tiers.disk.flush()
    prompt, chain, parent = prompts[3], [], None
    for i in range((len(prompt) - 1) // BLOCK):
        parent = block_hash(prompt[i * BLOCK : (i + 1) * BLOCK], parent)
        chain.append(parent)
    in_tiers = [h for h in chain if h not in bm.hash_to_block]  # after the pool's cached prefix: host, then disk blocks
    on_disk = [h for h in in_tiers if h in tiers.disk and h not in tiers.host]
    assert on_disk and on_disk[0] != in_tiers[-1] and all(h in tiers for h in in_tiers), "the test needs sound blocks after it"
    bad = on_disk[0]
    path = tiers.disk.path(bad)
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))
    loads, failed = tiers.num_host_loads + tiers.num_disk_loads, tiers.num_failed_loads
    assert run(engine, [prompt])[0] == reference[3]
    # the blocks before the bad one loaded, none after it
    assert tiers.num_failed_loads == failed + 1 and tiers.num_host_loads + tiers.num_disk_loads == loads + in_tiers.index(bad)


def test_new_weights_clear_every_tier(llama, reference, block_bytes, tmp_path):
    engine = engine_for(llama, tiers_config(block_bytes, tmp_path))
    tiers = engine.block_manager.tiers
    prompts = shared_prefix_prompts()
    run_one_at_a_time(engine, prompts[:3])
    assert tiers.hashes()
    engine.update_weights(read_safetensors(Path(llama)))  # the same weights: only the caches' staleness is under test
    tiers.disk.flush()
    assert not tiers.hashes() and not list(tiers.disk.dir.glob("*.kv")), "stale KV must never be served"
    assert engine.block_manager.take_kv_events(snapshot=True) == ([], [])
    loads = tiers.num_host_loads + tiers.num_disk_loads
    assert run_one_at_a_time(engine, prompts[3:]) == reference[3:]
    assert tiers.num_host_loads + tiers.num_disk_loads == loads, "nothing computed before the update came back"


def block_cache(num_blocks: int = 6) -> torch.Tensor:
    """A KV pool of [layers=2, k/v, blocks, block_size=2, kv_heads=1, head_dim=3], each block filled with its id."""
    return torch.arange(num_blocks, dtype=torch.float32)[None, None, :, None, None, None].expand(2, 2, num_blocks, 2, 1, 3).clone()


def test_each_tier_keeps_its_byte_bound_in_lru_order_and_refuses_bad_files(tmp_path):
    kv = block_cache()
    block_bytes = kv[:, :, 0].nbytes
    events = []
    tiers = TieredKVCache(tiers_config(block_bytes, tmp_path, host_blocks=2, disk_blocks=3), kv, lambda kind, h: events.append((kind, h)))
    for h in range(10, 16):  # hash h from block h - 10
        tiers.offload(h, h - 10)
        tiers.check_invariants()
        assert tiers.host.nbytes <= 2 * block_bytes and tiers.disk.nbytes <= tiers.disk.capacity_bytes
    assert list(tiers.host.slots) == [14, 15] and list(tiers.disk.files) == [11, 12, 13]  # 10: dropped, least recent
    assert events == [*(("offloaded", h) for h in range(10, 15)), ("dropped", 10), ("offloaded", 15)]
    assert [h in tiers for h in (14, 15, 11, 10, 12)] == [True, True, True, False, True]  # host, host, disk, dropped, disk
    tiers.disk.flush()
    assert tiers.load(11, 0) and torch.equal(kv[:, :, 0], torch.full_like(kv[:, :, 0], 1.0))  # read back from disk
    assert list(tiers.disk.files) == [12, 13, 11], "a load refreshes LRU order"
    assert tiers.load(14, 1) and list(tiers.host.slots) == [15, 14] and torch.equal(kv[:, :, 1], torch.full_like(kv[:, :, 1], 4.0))
    data = bytearray(tiers.disk.path(12).read_bytes())
    data[-1] ^= 1
    tiers.disk.path(12).write_bytes(bytes(data))
    tiers.disk.path(11).rename(tiers.disk.path(13))  # 13's file holds 11's block (its header says so)
    for h in (12, 13):
        assert not tiers.load(h, 2) and h not in tiers and ("dropped", h) in events
    assert torch.equal(kv[:, :, 2], torch.full_like(kv[:, :, 2], 2.0)), "a refused block writes nothing"
    tiers.close()
    assert not tiers.disk.dir.exists()


def test_tier_sizes_are_checked_with_the_field_named(llama, tmp_path):
    with pytest.raises(ValidationError, match="disk_bytes"):
        KVTiersConfig(host_bytes=1 << 20, disk_path=tmp_path)
    with pytest.raises(ValidationError, match="enable_prefix_caching"):
        EngineConfig(model=str(llama), enable_prefix_caching=False, kv_tiers=KVTiersConfig(host_bytes=1 << 20))
    with pytest.raises(ValueError, match=r"kv_tiers\.host_bytes \(100\) is under one KV block"):
        engine_for(llama, KVTiersConfig(host_bytes=100))
    with pytest.raises(ValueError, match=r"kv_tiers\.disk_bytes \(100\) is under one block file"):
        engine_for(llama, KVTiersConfig(host_bytes=1 << 20, disk_path=tmp_path, disk_bytes=100))
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    with pytest.raises(ValueError, match=r"kv_tiers\.disk_path .*a_file.*: cannot make a directory there"):
        engine_for(llama, KVTiersConfig(host_bytes=1 << 20, disk_path=a_file, disk_bytes=1 << 20))
    assert list(tmp_path.iterdir()) == [a_file]  # nothing made by the refused configs
    with pytest.raises(ValidationError, match="engine_args"):  # vLLM has its own offloading: nothing is translated to it
        ServeConfig(model="m", engine="vllm", engine_args={"kv_tiers": {"host_bytes": 1 << 30}}, auth={"enabled": False})


# A script of request waves: each request a prefix (of three, so they repeat), a tail and a length; a wave runs together
# (up to 3 sequences of up to 37 tokens on a 64-token pool: admissions wait, and long decodes preempt).
waves = st.lists(
    st.lists(st.tuples(st.integers(0, 2), st.integers(1, 9), st.integers(1, 12)), min_size=1, max_size=3), min_size=1, max_size=4
)


@pytest.fixture(scope="module")
def tiered(llama, block_bytes, tmp_path_factory):
    return engine_for(llama, tiers_config(block_bytes, tmp_path_factory.mktemp("tiers"), host_blocks=2, disk_blocks=10), max_num_seqs=3)


def test_any_request_script_gives_the_outputs_of_an_engine_without_tiers(plain, tiered):
    @settings(max_examples=10, deadline=None)
    @given(waves, st.randoms(use_true_random=False))
    @example([[(0, 9, 12), (1, 9, 12), (2, 9, 12)], [(0, 1, 1), (1, 1, 1), (2, 1, 1)]], random.Random(0))  # evicts, then asks again
    def scripts(script, rng):
        prefixes = [[rng.randrange(3, 200) for _ in range(16)] for _ in range(3)]
        for wave in script:
            prompts = [prefixes[p] + [rng.randrange(3, 200) for _ in range(tail)] for p, tail, _ in wave]
            params = [PARAMS.model_copy(update={"max_tokens": m}) for _, _, m in wave]
            assert run(tiered, prompts, params) == run(plain, prompts, params)  # run checks invariants, the tiers' bounds too

    tiers = tiered.block_manager.tiers
    scripts()
    assert tiers.num_host_loads + tiers.num_disk_loads > 0, "no script was served from a tier: the property tested nothing"
