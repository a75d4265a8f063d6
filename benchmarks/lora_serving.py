"""Claim: one base model serves many LoRA adapters mixed in one batch at most ~30% below the base model's throughput.

    python benchmarks/lora_serving.py [--quick] [--shape llama-90m|qwen2.5-0.5b] [--out FILE]

Engine level (LLMEngine driven directly, no Serve/HTTP: the serving app adds the same per-request cost either way):
8 requests in flight, each with its own random prompt (32-64 tokens) and 32 greedy output tokens; the LoRA side
sends each request through one of 4 distinct rank-16 adapters on all 7 linear layers (q, k, v, o, gate, up,
down; random weights, made by peft as the SFT recipe's ``lora:`` makes them), cycling, so every batch mixes
them; the baseline is the same engine config without LoRA on the same requests, same run. Both are timed step by step,
their steps interleaved one for one (the same batches on both sides, so a shared
machine's slow spells fall on both alike), after a warm-up; 2 rounds with --quick, 3 otherwise.

JSON (default benchmarks/results/lora_serving.json, lora_serving_<shape>.json for other shapes):
- ``multi_lora_throughput_ratio``: output tokens/s with the 4 adapters mixed / base model alone, the median of the
  rounds' ratios (goal >= 0.7);
- ``lora_tokens_per_s``, ``base_tokens_per_s``: the best round of each; ``*_runs_tokens_per_s``: every round;
- ``lora_load_ms``: an adapter's first use: reading peft's files and checking them against the model
  (``lora_read_ms``) plus writing it into a device slot (``lora_slot_load_ms``), mean of the 4;
- ``lora_adapter_bytes``: one loaded adapter's weights (host copy, A and scaled B at the model dtype);
  ``lora_slot_bytes``: the device memory of one adapter slot across all wrapped linears (every slot is sized for
  max_lora_rank); ``lora_slots_bytes_total`` for max_loras slots.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import tempfile
import time
from pathlib import Path

import torch
from engine import LLAMA_90M, build_model  # benchmarks/engine.py: the same models (--shape)

from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
from mlplat.engine.config import MultiLoRAConfig
from mlplat.models import load_model
from mlplat.models.shapes import SHAPES
from mlplat.train.lora import LoRAConfig, apply_lora, save_adapter

NUM_ADAPTERS, RANK, CONCURRENCY, OUTPUT_TOKENS = 4, 16, 8, 32


def make_adapters(model_dir: Path, work: Path, n: int) -> dict[str, str]:
    """``n`` rank-16 adapters on every linear layer with random non-zero A and B, saved as peft saves them."""
    model = apply_lora(load_model(str(model_dir)), LoRAConfig(r=RANK, alpha=2 * RANK)).eval()
    paths = {}
    for i in range(n):
        generator = torch.Generator().manual_seed(i)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_" in name:
                    p.copy_(torch.randn(p.shape, generator=generator) * (0.02 if "lora_A" in name else 0.01))
        paths[f"adapter-{i}"] = str(save_adapter(model, work / f"adapter-{i}"))
    return paths


class Driver:
    """One engine kept at CONCURRENCY requests in flight (a new one joins as one finishes), its steps timed one by one."""

    def __init__(self, engine: LLMEngine, prompts: list[list[int]], adapters: list[str | None]):
        self.engine, self.pending = engine, list(zip(prompts, adapters))
        self.in_flight = self.produced = 0
        self.seconds = 0.0

    @property
    def done(self) -> bool:
        return not self.pending and not self.engine.has_unfinished

    def step(self) -> None:
        while self.pending and self.in_flight < CONCURRENCY:
            prompt, name = self.pending.pop(0)
            self.engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=OUTPUT_TOKENS, ignore_eos=True, lora_name=name))
            self.in_flight += 1
        start = time.perf_counter()
        outs = self.engine.step()
        self.seconds += time.perf_counter() - start
        self.in_flight -= len(outs)
        self.produced += sum(len(out.outputs[0].token_ids) for out in outs)


def lockstep_tokens_per_s(drivers: list[Driver]) -> list[float]:
    """Output tokens/s of each driver, their steps interleaved one for one: the same workload in the same batches on each
    side, so a shared machine's slow spells fall on both alike."""
    while not all(d.done for d in drivers):
        for d in drivers:
            if not d.done:
                d.step()
    return [d.produced / d.seconds for d in drivers]


def load_times(engine: LLMEngine, names: list[str]) -> tuple[float, float]:
    """(read ms, slot load ms), mean over ``names``: each read from disk afresh, then written into a slot it did not hold."""
    lora, reads, loads = engine.runner.lora, [], []
    for name in names:
        lora.host.pop(name, None)
        start = time.perf_counter()
        lora.adapter(name)
        reads.append(time.perf_counter() - start)
        if name in lora.slots:  # make it load again: free its slot
            lora.slots.pop(name)
            lora.pins.pop(name, None)
        start = time.perf_counter()
        lora.pin(name)
        loads.append(time.perf_counter() - start)
        lora.unpin(name)
    return 1000 * sum(reads) / len(reads), 1000 * sum(loads) / len(loads)


def main() -> None:
    parser = argparse.ArgumentParser(description="multi-LoRA vs the base model alone (engine level)")
    parser.add_argument("--quick", action="store_true", help="fewer requests (under 3 minutes)")
    parser.add_argument("--shape", choices=[LLAMA_90M, *SHAPES], default=LLAMA_90M)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or f"benchmarks/results/lora_serving{'' if args.shape == LLAMA_90M else '_' + args.shape}.json")
    num_requests, rounds = (16, 2) if args.quick else (32, 3)
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model_dir = build_model(work, args.shape)
        adapters = make_adapters(model_dir, work, NUM_ADAPTERS)
        base_cfg = dict(model=str(model_dir), num_kv_blocks=512, block_size=16, max_num_seqs=CONCURRENCY, enable_prefix_caching=False)
        lora_cfg = MultiLoRAConfig(max_loras=NUM_ADAPTERS, max_lora_rank=RANK, adapters=adapters)
        base, engine = LLMEngine(EngineConfig(**base_cfg)), LLMEngine(EngineConfig(**base_cfg, lora=lora_cfg))
        rng = random.Random(0)
        prompts = [[rng.randrange(3, base.vocab_size) for _ in range(rng.randint(32, 64))] for _ in range(num_requests)]
        names = [f"adapter-{i % NUM_ADAPTERS}" for i in range(num_requests)]
        warm = prompts[:CONCURRENCY]  # warm-up: every adapter read and in its slot
        lockstep_tokens_per_s([Driver(base, warm, [None] * CONCURRENCY), Driver(engine, warm, names[:CONCURRENCY])])
        base_runs, lora_runs = [], []
        for _ in range(rounds):
            base_tps, lora_tps = lockstep_tokens_per_s([Driver(base, prompts, [None] * num_requests), Driver(engine, prompts, names)])
            base_runs.append(base_tps)
            lora_runs.append(lora_tps)
        ratios = sorted(lora / base for base, lora in zip(base_runs, lora_runs))
        base_tps, lora_tps = max(base_runs), max(lora_runs)
        read_ms, slot_ms = load_times(engine, list(adapters))
        lora = engine.runner.lora
        slot_bytes = lora.slot_bytes
        adapter_bytes = lora.adapter(names[0]).nbytes
    report = {
        "machine": f"{platform.machine()}, {torch.get_num_threads()} threads", "date": time.strftime("%Y-%m-%d"), "shape": args.shape,
        "level": "engine (LLMEngine driven directly, no Serve/HTTP)", "concurrency": CONCURRENCY, "adapters": NUM_ADAPTERS, "rank": RANK,
        "targets": "q,k,v,o,gate,up,down", "requests": num_requests, "output_tokens": OUTPUT_TOKENS,
        "rounds": rounds, "base_runs_tokens_per_s": base_runs, "lora_runs_tokens_per_s": lora_runs,
        "base_tokens_per_s": base_tps, "lora_tokens_per_s": lora_tps,
        "multi_lora_throughput_ratio": ratios[len(ratios) // 2],  # the median of the rounds' ratios
        "lora_read_ms": read_ms, "lora_slot_load_ms": slot_ms, "lora_load_ms": read_ms + slot_ms,
        "lora_adapter_bytes": adapter_bytes, "lora_slot_bytes": slot_bytes, "lora_slots_bytes_total": slot_bytes * NUM_ADAPTERS,
    }  # fmt: skip
    print(f"multi-LoRA, engine level (no Serve/HTTP), {args.shape}, c={CONCURRENCY}, {NUM_ADAPTERS} rank-{RANK} adapters on all linears")
    print(f"{'':34}{'value':>14}")
    rows = [("base model tokens/s", "base_tokens_per_s", "{:.1f}"), ("4 adapters mixed tokens/s", "lora_tokens_per_s", "{:.1f}"),
            ("multi_lora_throughput_ratio", "multi_lora_throughput_ratio", "{:.3f}"), ("lora_load_ms", "lora_load_ms", "{:.1f}"),
            ("  read + check (ms)", "lora_read_ms", "{:.1f}"), ("  slot load (ms)", "lora_slot_load_ms", "{:.2f}"),
            ("adapter weights (MB)", "lora_adapter_bytes", "{:.2f}"), ("one slot, device (MB)", "lora_slot_bytes", "{:.2f}")]  # fmt: skip
    for label, key, fmt in rows:
        value = report[key] / 2**20 if key.endswith("bytes") else report[key]
        print(f"{label:34}{fmt.format(value):>14}")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
