"""Where a training step's time goes, and how much of the hardware it uses (MFU).

MFU = achieved model FLOP/s per device / the device's peak FLOP/s. Model FLOPs per
token follow the PaLM / torchtitan estimate: 6 x (parameters in matmuls: all but the
input embedding, a lookup; the LM head counts even when it shares the embedding's
weight) for forward + backward, plus 12 x layers x hidden x sequence length for
attention scores and values. Peaks come from a table of dense bf16 datasheet figures
(override with ``peak_tflops``); a CPU has no datasheet figure worth trusting, so its
peak is measured with a large fp32 matmul, once, before anything else runs (a
measurement taken beside the data pipeline measures the neighbours, not the CPU).
"""

from __future__ import annotations

import time
from collections import defaultdict
from contextlib import contextmanager

import torch

# Dense (no sparsity) bf16 tensor-core peaks, TFLOP/s, matched as substrings of the CUDA device name.
PEAK_TFLOPS_BF16 = {
    "H200": 989.0,
    "H100": 989.0,  # SXM; the PCIe part is ~756, set peak_tflops for it
    "H800": 989.0,
    "A100": 312.0,
    "A800": 312.0,
    "L40S": 362.0,
    "A10G": 125.0,
    "L4": 121.0,
}


def flops_per_token(model: torch.nn.Module, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of an HF decoder-only model."""
    config = model.config
    embedding, lm_head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    params = sum(p.numel() for p in model.parameters() if p is not embedding)
    if lm_head is embedding:  # tied: parameters() yields the shared weight once, but the head is still a matmul
        params += lm_head.numel()
    return 6.0 * params + 12.0 * config.num_hidden_layers * config.hidden_size * seq_len


def measure_cpu_peak_flops(threads: int | None = None, size: int = 1024, trials: int = 10) -> float:
    """FLOP/s of a square fp32 matmul on ``threads`` threads (default: this process's): the CPU 'peak' for MFU.

    The best of several trials: on a shared machine the slow ones measure the neighbours.
    """
    saved = torch.get_num_threads()
    torch.set_num_threads(threads or saved)
    try:
        a, b = torch.randn(size, size), torch.randn(size, size)
        a @ b  # warm up the BLAS threads
        best = float("inf")
        for _ in range(trials):
            start = time.perf_counter()
            a @ b
            best = min(best, time.perf_counter() - start)
    finally:
        torch.set_num_threads(saved)
    return 2.0 * size**3 / best


def peak_flops(device: torch.device, peak_tflops: float | None = None, table: dict[str, float] = PEAK_TFLOPS_BF16) -> float:
    """Peak FLOP/s of one device: the override, the table entry for the GPU, or a CPU measurement."""
    if peak_tflops is not None:
        return peak_tflops * 1e12
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        for key, tflops in table.items():
            if key in name:
                return tflops * 1e12
        raise ValueError(f"no peak FLOP/s known for GPU {name!r}: set peak_tflops in the config")
    return measure_cpu_peak_flops()


class PhaseTimer:
    """Wall time per named phase, summed until ``reset``; CUDA work is synchronised at phase ends.

    The synchronise costs a little overlap between phases on GPU, which is what makes
    the per-phase split true rather than a measure of kernel launch time.
    """

    def __init__(self, device: torch.device):
        self.sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        self.seconds: dict[str, float] = defaultdict(float)

    @contextmanager
    def phase(self, name: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.sync()
            self.seconds[name] += time.perf_counter() - start

    def reset(self) -> dict[str, float]:
        seconds, self.seconds = dict(self.seconds), defaultdict(float)
        return seconds
