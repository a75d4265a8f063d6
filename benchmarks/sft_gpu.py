"""Claim: FSDP2 bf16 SFT of a ~100M-parameter Llama on one GPU, with the recipe's own training
components (mlplat.train: parallelize, train_step, optimizer, MFU), runs at a sound tokens/s
and MFU, and learns. Baselines in the same run: the same model and batches under DDP
(one rank), FSDP2 in fp32, FSDP2 with activation checkpointing, and unpacked full-length
rows (causal mask only).

    python benchmarks/sft_gpu.py [--quick] [--out FILE] [--steps N] [--activation-checkpointing]

A prepared check for a GPU machine: no Ray, no MLflow, nothing downloaded (only torch,
transformers and mlplat's ray-free modules: mlplat.train.{parallel,step,perf,batch,optim}, mlplat.gpucheck.measure,
mlplat.models, mlplat.data.{demo,chat}, mlplat.evaluation). It runs from a bare checkout
too: without an installed mlplat it imports it from ./platform.

- Model: a randomly initialised Llama (hidden 768, 12 layers, 12 heads / 4 KV heads,
  MLP 2048, vocab 32000, tied embeddings: ~100M parameters), made here.
- Data: synthetic packed rows of --seq-len tokens (documents of seq_len/16 to seq_len/2
  tokens, ~0.85 of the positions real tokens), the recipe's packed format (seq_ids,
  per-document position_ids, first label of each document ignored, padding at row ends,
  block-diagonal mask through mlplat.train.batch.model_inputs). The documents (random
  tokens, random lengths) come from a small fixed pool, so a model that learns shows it:
  the loss falls from ~ln(vocab) as it memorises them.
- One process, a 1-rank process group (nccl on CUDA, gloo on CPU; MASTER_ADDR/PORT set
  here), so fully_shard applies exactly as on N ranks. On CUDA, bf16 as the recipe runs
  it: FSDP2 MixedPrecisionPolicy (bf16 params, fp32 reduce) plus autocast in train_step.
- Timing: --warmup steps untimed, then --steps steps between CUDA synchronisations;
  tokens = non-padding tokens (count_tokens); MFU = tokens/s x flops_per_token / peak
  (mlplat.train.perf: the datasheet table, H100/H200 = 989 dense bf16 TFLOP/s; a CPU's
  peak is measured). The fp32 row's MFU is against the same bf16 peak.
- Demo check (kept from the old sft_step_throughput.py): the tiny Llama on the demo task,
  padded batches of 64, bf16 under an explicit DDP wrapper over the same process group,
  then exact-match eval with generation on the same device.

--quick (for CPU, the way it is tested without a GPU): a tiny config, 128-token rows,
few steps, fp32, gloo; the demo check with 20 steps and 20 eval rows.

JSON fields: device, device_name, model_params, flops_per_token, seq_len, batch_rows,
tokens_per_s, mfu, peak_memory_gib, first_loss, last_loss (the main FSDP2 row), rows[{name,
strategy, precision, activation_checkpointing, packed, steps, step_ms, tokens_per_s, mfu,
peak_memory_gib, phase_ms, first_loss, last_loss}], ratios{...}, demo_check{...}.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from transformers import LlamaConfig, LlamaForCausalLM

try:
    import mlplat  # noqa: F401
except ImportError:  # a bare checkout on a GPU machine: the package lives under ./platform
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "platform"))

from mlplat.gpucheck.measure import init_process_group, synthetic_batches
from mlplat.train.batch import count_tokens, pad_collate
from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
from mlplat.train.parallel import ParallelConfig, parallelize
from mlplat.train.perf import PhaseTimer, flops_per_token, peak_flops
from mlplat.train.step import train_step

MODELS = {
    # ~100M parameters (24.6M of them the tied embedding), Llama-3-style GQA.
    "100m": {"vocab_size": 32000, "hidden_size": 768, "intermediate_size": 2048, "num_hidden_layers": 12, "num_attention_heads": 12, "num_key_value_heads": 4},
    # --quick on CPU: the tiny model's shape.
    "tiny": {"vocab_size": 512, "hidden_size": 192, "intermediate_size": 512, "num_hidden_layers": 4, "num_attention_heads": 6, "num_key_value_heads": 2},
}


def build_model(name: str, seq_len: int, seed: int = 0) -> LlamaForCausalLM:
    config = LlamaConfig(**MODELS[name], max_position_embeddings=seq_len, tie_word_embeddings=True, bos_token_id=None, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def peak_memory_gib(device: torch.device) -> float | None:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return None  # CPU: see process_max_rss_gib in the JSON (whole process, never reset)


def run_row(name: str, args, device: torch.device, batches, steps: int, warmup: int, strategy: str, bf16: bool,
            activation_checkpointing: bool, peak: float) -> dict:
    """Train a fresh model (same seed) on ``batches`` in turn; time ``steps`` steps after ``warmup``."""
    gc.collect()  # the previous row's model and optimizer state
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    model = build_model(args.model, args.seq_len)
    model.train()
    fpt = flops_per_token(model, args.seq_len)  # before wrapping: the same count the recipe takes from unwrap(model)
    if strategy == "ddp":
        # An explicit wrapper: parallelize() leaves a 1-rank model bare, and the point of this
        # row is DDP's gradient all-reduce over the process group, as on N ranks.
        model = DistributedDataParallel(model.to(device), device_ids=[device.index] if device.type == "cuda" else None)
    else:
        pcfg = ParallelConfig(strategy="fsdp", activation_checkpointing=activation_checkpointing, param_dtype="bfloat16" if bf16 else "float32")
        model = parallelize(model, pcfg, device)
    optim_cfg = OptimizerConfig(lr=args.lr, warmup_steps=max(1, warmup))
    optimizer = build_optimizer(model, optim_cfg)
    scheduler = build_lr_scheduler(optimizer, optim_cfg, warmup + steps)
    timer = PhaseTimer(device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    losses, tokens = [], 0
    for i in range(warmup + steps):
        if i == warmup:
            sync()
            timer.reset()
            start = time.perf_counter()
        stats = train_step(model, batches[i % len(batches)], optimizer, scheduler, optim_cfg.grad_clip, bf16, timer)
        losses.append(stats.loss)
        if i >= warmup:
            tokens += stats.tokens
    sync()
    elapsed = time.perf_counter() - start
    phases = timer.reset()
    tokens_per_s = tokens / elapsed
    row = {
        "name": name,
        "strategy": strategy,
        "precision": "bf16" if bf16 else "fp32",
        "activation_checkpointing": activation_checkpointing,
        "packed": "seq_ids" in batches[0],
        "steps": steps,
        "warmup": warmup,
        "step_ms": 1000 * elapsed / steps,
        "tokens_per_s": tokens_per_s,
        "mfu": tokens_per_s * fpt / peak,
        "peak_memory_gib": peak_memory_gib(device),
        "phase_ms": {k: 1000 * v / steps for k, v in phases.items()},
        "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / len(losses[-10:]),
        "finite": all(math.isfinite(x) for x in losses),
        "flops_per_token": fpt,
    }
    mem = f"{row['peak_memory_gib']:.1f} GiB" if row["peak_memory_gib"] is not None else "n/a"
    print(f"{name:34} {row['step_ms']:9.1f} {tokens_per_s:12.0f} {100 * row['mfu']:7.1f} {mem:>10} "
          f"{row['first_loss']:7.3f} -> {row['last_loss']:.3f}", flush=True)
    del model, optimizer, scheduler
    return row


def demo_check(device: torch.device, steps: int, eval_rows: int, bf16: bool) -> dict:
    """The tiny Llama on the demo task under an explicit DDP wrapper, then exact match with generation."""
    from mlplat.data.chat import tokenize_chat
    from mlplat.data.demo import DemoDataConfig, tokenizer_corpus, write_demo_data
    from mlplat.evaluation import evaluate_exact_match
    from mlplat.models import build_tiny_model, load_model, load_tokenizer

    work = Path(tempfile.mkdtemp(prefix="sft_gpu_demo_"))
    sft_rows = min(20_000, max(2_000, steps * 64))  # one pass at most
    paths = write_demo_data(work / "data", DemoDataConfig(sft_rows=sft_rows, eval_rows=max(eval_rows, 10), preference_rows=10, rl_rows=10))
    model_dir = build_tiny_model(work / "model", tokenizer_corpus(paths.sft))
    tokenizer = load_tokenizer(model_dir)
    with open(paths.sft) as f:
        rows = [tokenize_chat(tokenizer, json.loads(line)["messages"], 128) for line in f]
    model = DistributedDataParallel(load_model(model_dir, device=device), device_ids=[device.index] if device.type == "cuda" else None)
    cfg = OptimizerConfig()  # the recipe's defaults: lr 1e-3, 100 warm-up steps, cosine
    optimizer = build_optimizer(model, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg, steps)
    batch_size = 64
    start = time.perf_counter()
    losses = []
    for step in range(steps):
        chunk = [rows[(step * batch_size + j) % len(rows)] for j in range(batch_size)]
        batch = pad_collate({"input_ids": [r[0] for r in chunk], "labels": [r[1] for r in chunk]}, tokenizer.pad_token_id)
        losses.append(train_step(model, {k: v.to(device) for k, v in batch.items()}, optimizer, scheduler, cfg.grad_clip, bf16).loss)
    if device.type == "cuda":
        torch.cuda.synchronize()
    train_s = time.perf_counter() - start
    model.module.save_pretrained(work / "trained")
    tokenizer.save_pretrained(work / "trained")
    start = time.perf_counter()
    result = evaluate_exact_match(work / "trained", paths.eval, limit=eval_rows, device=str(device))
    return {
        "backend": dist.get_backend(),
        "precision": "bf16" if bf16 else "fp32",
        "steps": steps,
        "batch": batch_size,
        "train_s": train_s,
        "first_loss": losses[0],
        "last_loss": sum(losses[-10:]) / len(losses[-10:]),
        "exact_match": result.accuracy,
        "eval_rows": result.total,
        "eval_s": time.perf_counter() - start,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description="FSDP2 bf16 SFT of a ~100M Llama on one GPU: tokens/s and MFU")
    parser.add_argument("--quick", action="store_true", help="tiny model, few steps (the CPU smoke run, under 3 minutes)")
    parser.add_argument("--out", default="benchmarks/results/sft_gpu.json")
    parser.add_argument("--steps", type=int, default=None, help="timed steps of the main FSDP2 row (default 300; --quick 8)")
    parser.add_argument("--warmup", type=int, default=None, help="untimed steps first (default 20; --quick 2)")
    parser.add_argument("--compare-steps", type=int, default=None, help="timed steps of each comparison row (default 100; --quick 4)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per row (default 1024; --quick 128)")
    parser.add_argument("--batch", type=int, default=None, help="rows per step (default 16; --quick 4)")
    parser.add_argument("--lr", type=float, default=3e-4)
    parser.add_argument("--activation-checkpointing", action="store_true", help="main row with activation checkpointing")
    parser.add_argument("--peak-tflops", type=float, default=None, help="device peak for MFU (default: mlplat.train.perf's table)")
    parser.add_argument("--demo-steps", type=int, default=None, help="demo-task check steps (default 800; --quick 20; 0 skips it)")
    parser.add_argument("--cpu", action="store_true", help="run on CPU even if a GPU is present")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    bench_start = time.perf_counter()

    cuda = torch.cuda.is_available() and not args.cpu
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    quick = args.quick
    args.model = "tiny" if quick else "100m"
    steps = args.steps or (8 if quick else 300)
    warmup = args.warmup if args.warmup is not None else (2 if quick else 20)
    compare_steps = args.compare_steps or (4 if quick else 100)
    args.seq_len = args.seq_len or (128 if quick else 1024)
    batch_rows = args.batch or (4 if quick else 16)
    demo_steps = args.demo_steps if args.demo_steps is not None else (20 if quick else 800)
    if not cuda and not quick:
        print("no GPU here: the full run is for a GPU machine (a 100M model on CPU takes many seconds per step); "
              "running anyway. Use --quick for the CPU smoke run.", flush=True)
    bf16 = cuda  # the recipe: bf16 on GPU, fp32 on CPU
    peak = peak_flops(device, args.peak_tflops)
    vocab = MODELS[args.model]["vocab_size"]
    doc_len = (max(8, args.seq_len // 16), args.seq_len // 2)
    packed = synthetic_batches(vocab, 8, batch_rows, args.seq_len, doc_len, packed=True)
    full_rows = synthetic_batches(vocab, 8, batch_rows, args.seq_len, doc_len, packed=False)
    packed = [{k: v.to(device) for k, v in b.items()} for b in packed]
    full_rows = [{k: v.to(device) for k, v in b.items()} for b in full_rows]

    init_process_group(device)
    try:
        print(f"device {torch.cuda.get_device_name(device) if cuda else 'cpu'}; model {args.model}; rows {batch_rows} x {args.seq_len}; "
              f"packing efficiency {sum(int(count_tokens(b)) for b in packed) / sum(b['input_ids'].numel() for b in packed):.2f}", flush=True)
        print(f"{'row':34} {'ms/step':>9} {'tokens/s':>12} {'MFU %':>7} {'peak mem':>10} loss first -> last", flush=True)
        ac = args.activation_checkpointing
        main_row = run_row(f"fsdp2 {'bf16' if bf16 else 'fp32'} packed{' +AC' if ac else ''}", args, device, packed, steps, warmup, "fsdp", bf16, ac, peak)
        precision = "bf16" if bf16 else "fp32"
        cw = max(2, warmup // 4)
        ddp = run_row(f"ddp {precision} packed", args, device, packed, compare_steps, cw, "ddp", bf16, False, peak)
        other_ac = run_row(f"fsdp2 {precision} packed{'' if ac else ' +AC'}", args, device, packed, compare_steps, cw, "fsdp", bf16, not ac, peak)
        full = run_row(f"fsdp2 {precision} full rows (causal only)", args, device, full_rows, compare_steps, cw, "fsdp", bf16, ac, peak)
        rows = [main_row, ddp, other_ac, full]
        ratios = {
            "fsdp_over_ddp": main_row["tokens_per_s"] / ddp["tokens_per_s"],
            "packed_over_full_rows": main_row["tokens_per_s"] / full["tokens_per_s"],
            ("ac_over_no_ac" if ac else "no_ac_over_ac"): main_row["tokens_per_s"] / other_ac["tokens_per_s"],
        }
        if bf16:  # on CPU the main row is already fp32
            fp32 = run_row("fsdp2 fp32 packed", args, device, packed, max(2, compare_steps // 2), cw, "fsdp", False, ac, peak)
            rows.append(fp32)
            ratios["bf16_over_fp32"] = main_row["tokens_per_s"] / fp32["tokens_per_s"]
        demo = demo_check(device, demo_steps, 20 if quick else 500, bf16) if demo_steps else None
        if demo:
            print(f"demo check: {demo['steps']} steps in {demo['train_s']:.1f} s, loss {demo['first_loss']:.3f} -> {demo['last_loss']:.3f}, "
                  f"exact match {demo['exact_match']:.2f} on {demo['eval_rows']} rows ({demo['eval_s']:.1f} s)", flush=True)
    finally:
        with contextlib.suppress(Exception):
            dist.destroy_process_group()

    report = {
        "device": device.type,
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "torch": torch.__version__,
        "quick": quick,
        "model": args.model,
        "model_params": sum(p.numel() for p in build_model(args.model, args.seq_len).parameters()),
        "flops_per_token": main_row["flops_per_token"],
        "peak_tflops": peak / 1e12,
        "seq_len": args.seq_len,
        "batch_rows": batch_rows,
        "tokens_per_s": main_row["tokens_per_s"],
        "mfu": main_row["mfu"],
        "peak_memory_gib": main_row["peak_memory_gib"],
        "process_max_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
        "first_loss": main_row["first_loss"],
        "last_loss": main_row["last_loss"],
        "loss_decreased": main_row["last_loss"] < main_row["first_loss"],
        "rows": rows,
        "ratios": ratios,
        "demo_check": demo,
        "bench_wall_s": time.perf_counter() - bench_start,
    }
    print("ratios:", json.dumps(ratios))
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, (dict, list))}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
