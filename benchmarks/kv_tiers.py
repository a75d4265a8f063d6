"""Claim: a tiered context cache (EngineConfig.kv_tiers: host memory, then local disk, below the KV pool) turns a prefix
the pool has evicted into a load instead of a recomputation: TTFT on prefixes asked again at least 3x better than the
pool alone. Baseline in the same run: the same engine config without tiers, on the same model and prompts.

    python benchmarks/kv_tiers.py [--quick] [--shape qwen2.5-0.5b|qwen2.5-7b] [--out FILE]

Setup: ``--shape`` (default qwen2.5-0.5b: Qwen2.5-0.5B's configuration with random weights, mlplat.models.shapes; fp32
on CPU, 24 KB of KV per token) and the tiny tokenizer. 32 distinct prefixes of ``prefix_tokens`` random tokens (512;
128 with --quick), each asked twice with a different short tail (1 output token: time to first token): the first pass
fills the caches, the second is timed, one request at a time, in the same order. The pool holds 1/8 of the prefixes'
KV, the host tier another 1/8: their KV is 4x pool + host, so by the time a prefix comes back the pool has long
evicted it and so has host memory: the disk tier serves it (or nothing: pool only recomputes it). Before the timed pass
the tier's files are synced and dropped from the page cache (posix_fadvise DONTNEED), so loads read the disk.
The engines run one after the other (pool only first), to hold one copy of the weights at a time.

JSON fields (default benchmarks/results/kv_tiers.json, kv_tiers_<shape>.json for another shape):
- ``tiered_cache_ttft_speedup``: median TTFT of the timed pass, pool only / tiered (goal >= 3);
- ``ttft_pool_only_s``, ``ttft_tiered_s``: those medians; ``ttft_*_mean_s`` the means;
- ``tier_load_gb_s``: bytes of KV loaded from the disk tier / time in those loads (open, read, CRC32, header checks);
- ``disk_read_gb_s``: a large file read sequentially after its pages were dropped (the disk);
  ``disk_read_cached_gb_s``: read again from the page cache; ``memcpy_gb_s``: a 256 MB tensor copy (its bytes / time);
- ``tier_loads``: blocks loaded from host, from disk, refused; ``tier_hit_tokens`` of ``prompt_tokens_timed``;
  ``pool_only_hit_tokens`` (the baseline's prefix-cache hits in the timed pass);
- ``block_bytes``, ``pool_bytes``, ``host_bytes``, ``disk_bytes``, ``prefix_kv_bytes`` (all prefixes);
- ``shape``, ``prefix_tokens``, ``num_prefixes``, ``loadavg_start``/``loadavg_end``, ``bench_wall_s``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch

from mlplat.data.demo import DemoDataConfig, tokenizer_corpus, write_demo_data
from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
from mlplat.engine.config import KVTiersConfig
from mlplat.engine.kv_tiers import HEADER
from mlplat.models.shapes import SHAPES, build_random_model

NUM_PREFIXES = 32
BLOCK_SIZE = 16
FIRST_TOKEN = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)


def build_model(work: Path, shape: str) -> Path:
    paths = write_demo_data(work / "data", DemoDataConfig(sft_rows=2000, eval_rows=10, preference_rows=10, rl_rows=10))
    return build_random_model(work / "model", SHAPES[shape], tokenizer_corpus(paths.sft))


def drop_from_page_cache(path: Path) -> None:
    """Write ``path`` out and drop its pages, so that the next read comes from the disk (Linux; elsewhere a no-op)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def disk_read_rates(directory: Path, nbytes: int) -> tuple[float, float]:
    """GB/s of a sequential read of an ``nbytes`` file: from the disk (pages dropped), then from the page cache."""
    path = directory / "read_probe.bin"
    chunk = torch.randint(0, 255, (8 << 20,), dtype=torch.uint8).numpy()
    with open(path, "wb") as f:
        for _ in range(nbytes // chunk.nbytes):
            f.write(chunk)
    drop_from_page_cache(path)
    rates = []
    for _ in range(2):
        start = time.perf_counter()
        with open(path, "rb", buffering=0) as f:
            while f.readinto(chunk):
                pass
        rates.append(nbytes / (time.perf_counter() - start) / 1e9)
    path.unlink()
    return rates[0], rates[1]


def memcpy_rate(nbytes: int = 256 << 20) -> float:
    src = torch.ones(nbytes // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def ttft(engine: LLMEngine, prompt: list[int]) -> float:
    start = time.perf_counter()
    engine.add_request(prompt, FIRST_TOKEN)
    while engine.has_unfinished:
        engine.step()
    return time.perf_counter() - start


def two_passes(engine: LLMEngine, first: list[list[int]], second: list[list[int]], before_timed=None) -> tuple[list[float], int]:
    """Run ``first`` (untimed), then time each of ``second``; the prefix-cache hit tokens of the timed pass."""
    for prompt in first:
        ttft(engine, prompt)
    if before_timed is not None:
        before_timed(engine)
    hits = engine.block_manager.hit_tokens
    times = [ttft(engine, prompt) for prompt in second]
    return times, engine.block_manager.hit_tokens - hits


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="128-token prefixes instead of 512 (under 3 minutes)")
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen2.5-0.5b", help="a real model's shape, random weights")
    parser.add_argument("--out", type=Path, default=None, help="default: results/kv_tiers.json (qwen2.5-0.5b), kv_tiers_<shape>.json")
    args = parser.parse_args()
    name = "kv_tiers.json" if args.shape == "qwen2.5-0.5b" else f"kv_tiers_{args.shape}.json"
    out = args.out or Path(__file__).parent / "results" / name
    wall, loadavg_start = time.perf_counter(), os.getloadavg()
    prefix_tokens = 128 if args.quick else 512
    work = Path(tempfile.mkdtemp(prefix="kv_tiers_bench_"))
    try:
        report = measure(args, work, prefix_tokens)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the checkpoint (2 GB at 0.5B) and the tier's files
    report |= {"loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(), "bench_wall_s": round(time.perf_counter() - wall, 1)}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"{'measure':34} value")
    for key in ("tiered_cache_ttft_speedup", "ttft_pool_only_s", "ttft_tiered_s", "tier_load_gb_s", "disk_read_gb_s",
                "disk_read_cached_gb_s", "memcpy_gb_s", "tier_loads", "tier_hit_tokens", "pool_only_hit_tokens",
                "bench_wall_s"):  # fmt: skip
        print(f"{key:34} {report[key]}")
    print(f"-> {out}")


def measure(args, work: Path, prefix_tokens: int) -> dict:
    model_dir = build_model(work, args.shape)
    print(f"{time.strftime('%H:%M:%S')} model built", flush=True)

    shape = SHAPES[args.shape]
    block_bytes = shape.num_hidden_layers * 2 * BLOCK_SIZE * shape.num_key_value_heads * shape.head_dim * 4  # fp32
    prefix_blocks = prefix_tokens // BLOCK_SIZE
    total_blocks = NUM_PREFIXES * prefix_blocks
    pool_blocks = max(total_blocks // 8, prefix_blocks + 2)  # at least one prompt (prefix, tail, its token) fits
    host_blocks = total_blocks // 8
    disk_bytes = (total_blocks + 2 * NUM_PREFIXES) * (block_bytes + HEADER.size)  # every prefix, with room for the tails
    rng = random.Random(0)
    vocab = range(3, 6000)  # the tiny tokenizer's ids: inside the real vocabulary
    prefixes = [[rng.choice(vocab) for _ in range(prefix_tokens)] for _ in range(NUM_PREFIXES)]
    first = [p + [rng.choice(vocab) for _ in range(rng.randint(4, 12))] for p in prefixes]
    second = [p + [rng.choice(vocab) for _ in range(rng.randint(4, 12))] for p in prefixes]
    common = dict(model=str(model_dir), block_size=BLOCK_SIZE, num_kv_blocks=pool_blocks, max_model_len=prefix_tokens + 64,
                  max_num_batched_tokens=prefix_tokens + 64)  # fmt: skip

    engine = LLMEngine(EngineConfig(**common))
    pool_times, pool_hits = two_passes(engine, first, second)
    del engine
    print(f"{time.strftime('%H:%M:%S')} pool only: median TTFT {statistics.median(pool_times):.3f} s", flush=True)

    tiers = KVTiersConfig(host_bytes=host_blocks * block_bytes, disk_path=work / "tier", disk_bytes=disk_bytes)
    engine = LLMEngine(EngineConfig(**common, kv_tiers=tiers))
    cache = engine.block_manager.tiers
    assert cache.block_bytes == block_bytes

    def cold_disk_tier(engine: LLMEngine) -> None:
        cache = engine.block_manager.tiers
        cache.disk.flush()
        for path in cache.disk.dir.glob("*.kv"):
            drop_from_page_cache(path)
        cache.disk_load_s = 0.0
        cache.num_host_loads = cache.num_disk_loads = cache.num_failed_loads = 0

    tiered_times, tier_hits = two_passes(engine, first, second, cold_disk_tier)
    loaded_disk_bytes, disk_load_s = cache.num_disk_loads * block_bytes, cache.disk_load_s
    tier_loads = {"host": cache.num_host_loads, "disk": cache.num_disk_loads, "refused": cache.num_failed_loads}
    del engine, cache

    disk_read, disk_read_cached = disk_read_rates(work, (256 if args.quick else 1024) << 20)
    return {
        "tiered_cache_ttft_speedup": round(statistics.median(pool_times) / statistics.median(tiered_times), 2),
        "ttft_pool_only_s": round(statistics.median(pool_times), 4),
        "ttft_tiered_s": round(statistics.median(tiered_times), 4),
        "ttft_pool_only_mean_s": round(statistics.mean(pool_times), 4),
        "ttft_tiered_mean_s": round(statistics.mean(tiered_times), 4),
        "tier_load_gb_s": round(loaded_disk_bytes / disk_load_s / 1e9, 3) if disk_load_s else None,
        "disk_read_gb_s": round(disk_read, 3),
        "disk_read_cached_gb_s": round(disk_read_cached, 3),
        "memcpy_gb_s": round(memcpy_rate(), 2),
        "tier_loads": tier_loads,
        "tier_hit_tokens": tier_hits,
        "pool_only_hit_tokens": pool_hits,
        "prompt_tokens_timed": sum(map(len, second)),
        "block_bytes": block_bytes,
        "pool_bytes": pool_blocks * block_bytes,
        "host_bytes": host_blocks * block_bytes,
        "disk_bytes": disk_bytes,
        "prefix_kv_bytes": total_blocks * block_bytes,
        "shape": args.shape,
        "prefix_tokens": prefix_tokens,
        "num_prefixes": NUM_PREFIXES,
    }


if __name__ == "__main__":
    main()
