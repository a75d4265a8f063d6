"""Measuring helpers shared by the GPU check and the benchmarks (benchmarks/engine.py, benchmarks/sft_gpu.py).

Engine side: a seeded workload, output tokens/s with c requests in flight (engine) or in batches of c
(transformers ``generate``, the baseline), one decode step's time. Device side: the copy bandwidth and
the matmul rate of the device itself, timed in the same run as the figures set against them. Training
side: packed synthetic batches in the recipe's format, a one-process group for FSDP2 at world size 1.
"""

from __future__ import annotations

import os
import random
import socket
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from mlplat.train.batch import IGNORE_INDEX, PAD_SEQ_ID

if TYPE_CHECKING:  # the engine (and its llguidance) only where engine helpers run: benchmarks/sft_gpu.py imports this module too
    from mlplat.engine import LLMEngine

Request = tuple[list[int], int]  # (prompt token ids, output tokens)


def workload(n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int = 0) -> list[Request]:
    rng = random.Random(seed)
    return [([rng.randrange(3, vocab) for _ in range(rng.randint(*prompt_range))], rng.randint(*output_range)) for _ in range(n)]


def synchronize(device: torch.device | str) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Callable[[], object], device: torch.device | str = "cpu") -> float:
    """Seconds ``fn`` takes, the device's queued work included."""
    synchronize(device)
    start = time.perf_counter()
    fn()
    synchronize(device)
    return time.perf_counter() - start


def engine_throughput(engine: LLMEngine, requests: list[Request], concurrency: int, steps: list | None = None) -> float:
    """Output tokens/s with ``concurrency`` requests in flight. ``steps``, if given, receives each
    step's (seconds, [(new tokens, context) per sequence]): what the step ran, for the roofline."""
    from mlplat.engine import SamplingParams

    pending = list(requests)
    in_flight = 0
    produced = 0
    run, ran = engine.runner.run, []

    def noting_run(batch, num_logits=None):
        ran[:] = [(n, seq.num_computed_tokens + n) for seq, n in batch]
        return run(batch, num_logits)

    engine.runner.run = noting_run
    try:
        start = time.perf_counter()
        while pending or engine.has_unfinished:
            while pending and in_flight < concurrency:
                prompt, max_tokens = pending.pop(0)
                engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))
                in_flight += 1
            ran.clear()
            step_start = time.perf_counter()
            for out in engine.step():  # sampled tokens come back to the host: the step's GPU work is done
                in_flight -= 1
                produced += len(out.outputs[0].token_ids)
            if steps is not None and ran:
                steps.append((time.perf_counter() - step_start, list(ran)))
        return produced / (time.perf_counter() - start)
    finally:
        del engine.runner.run  # the runner's own method again


@torch.inference_mode()
def hf_throughput(model, requests: list[Request], batch_size: int) -> float:
    """Output tokens/s of transformers ``generate`` on batches of ``batch_size`` left-padded requests, each
    batch run until its longest request is done (only requested tokens count)."""
    produced = 0
    synchronize(model.device)
    start = time.perf_counter()
    for i in range(0, len(requests), batch_size):
        batch = requests[i : i + batch_size]
        width = max(len(p) for p, _ in batch)
        ids = torch.tensor([[0] * (width - len(p)) + p for p, _ in batch], device=model.device)
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in batch], device=model.device)
        longest = max(m for _, m in batch)
        model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=longest, min_new_tokens=longest, do_sample=False, pad_token_id=0)
        produced += sum(m for _, m in batch)
    synchronize(model.device)
    return produced / (time.perf_counter() - start)


def decode_step_time(engine: LLMEngine, batch: int, context: int, vocab: int, steps: int = 8) -> float:
    """Median time of a pure decode step with ``batch`` sequences at ``context`` tokens."""
    from mlplat.engine import SamplingParams

    for prompt, _ in workload(batch, (context, context), (1, 1), vocab, seed=batch):
        engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=steps + 2, ignore_eos=True))
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in engine.live_sequences()):
        engine.step()  # prefill
    times = [timed(engine.step, engine.runner.device) for _ in range(steps)]
    while engine.has_unfinished:
        engine.step()
    return sorted(times)[len(times) // 2]


def copy_bandwidth(device: torch.device, nbytes: int = 2**30, trials: int = 5) -> float:
    """Bytes per second a large on-device copy moves (each byte read once and written once; the traffic is twice
    this): the memory roofline's rate, as benchmarks/engine.py defines it."""
    x = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device).normal_()
    y = torch.empty_like(x)
    y.copy_(x)  # pages touched and kernels loaded before timing
    return nbytes / min(timed(lambda: y.copy_(x), device) for _ in range(trials))


def matmul_rate(device: torch.device, shapes: list[tuple[int, int, int]], dtype: torch.dtype = torch.bfloat16, trials: int = 5) -> float:
    """FLOP/s of x[M,K] @ w[K,N] in ``dtype`` over ``shapes`` (summed FLOPs / summed best times): the compute
    roofline's rate at the shapes a step runs, timed on this device."""
    flops, seconds = 0.0, 0.0
    for m, k, n in shapes:
        x, w = torch.randn(m, k, device=device, dtype=dtype), torch.randn(k, n, device=device, dtype=dtype)
        x @ w
        seconds += min(timed(lambda x=x, w=w: x @ w, device) for _ in range(trials))
        flops += 2 * m * k * n
    return flops / seconds


def synthetic_batches(vocab: int, n_batches: int, rows: int, seq_len: int, doc_len: tuple[int, int], packed: bool,
                      pool: int = 64, seed: int = 0) -> list[dict[str, torch.Tensor]]:  # fmt: skip
    """Rows in the recipe's packed format, made of documents drawn from a fixed pool of random ones.

    ``packed=False``: every row is one document of exactly ``seq_len`` tokens with a plain
    2-D attention mask (causal only, no padding): what a flash kernel can take as is.
    """
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    if not packed:
        docs = [torch.randint(3, vocab, (seq_len,), generator=gen) for _ in range(pool)]
        out = []
        for _ in range(n_batches):
            input_ids = torch.stack([docs[rng.randrange(pool)] for _ in range(rows)])
            out.append({"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids.clone()})
        return out
    docs = [torch.randint(3, vocab, (rng.randint(*doc_len),), generator=gen) for _ in range(pool)]
    out = []
    for _ in range(n_batches):
        batch = {
            "input_ids": torch.zeros(rows, seq_len, dtype=torch.long),
            "labels": torch.full((rows, seq_len), IGNORE_INDEX, dtype=torch.long),
            "position_ids": torch.zeros(rows, seq_len, dtype=torch.long),
            "seq_ids": torch.full((rows, seq_len), PAD_SEQ_ID, dtype=torch.long),
        }
        for r in range(rows):
            start, doc_index = 0, 0
            while True:  # documents until the next one drawn does not fit: the rest is padding, as in streaming packing
                doc = docs[rng.randrange(pool)]
                if len(doc) > seq_len - start:
                    break
                end = start + len(doc)
                batch["input_ids"][r, start:end] = doc
                batch["labels"][r, start + 1 : end] = doc[1:]  # a document's first token is never a target
                batch["position_ids"][r, start:end] = torch.arange(len(doc))
                batch["seq_ids"][r, start:end] = doc_index
                start, doc_index = end, doc_index + 1
            batch["position_ids"][r, start:] = torch.arange(seq_len - start)  # padding, as mlplat.data.packing does
        out.append(batch)
    return out


def init_process_group(device: torch.device) -> None:
    """A one-process group on a free local port: NCCL on CUDA, gloo on CPU; collectives are issued at world size 1."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", WORLD_SIZE="1", LOCAL_RANK="0")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=0, world_size=1)
