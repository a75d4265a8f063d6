"""Claim: the SFT train step (mlplat.train.step) runs on every device we target, and bf16
autocast on a GPU beats fp32 on the same GPU. Baseline in the same run: fp32 on the same
device (and CPU fp32 for scale).

    python benchmarks/sft_step_throughput.py [--quick] [--out FILE] [--steps N]

For each available (device, precision) and model size it times ``train_step`` on padded
demo batches after warm-up and reports tokens/s. On CUDA it also checks the whole path
the recipe takes on a GPU: DDP over NCCL (one rank), bf16 training of the tiny model on
the demo task, then exact-match eval with generation on the GPU.
JSON fields: rows[{model, device, precision, batch, seq_len, step_ms, tokens_per_s}],
ratios{...}, cuda_check{...} (CUDA only).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

from mlplat.data.demo import DemoDataConfig, tokenizer_corpus, write_demo_data
from mlplat.data.chat import tokenize_chat
from mlplat.evaluation import evaluate_exact_match
from mlplat.models import TinyModelConfig, build_tiny_model, load_model, load_tokenizer
from mlplat.train.batch import pad_collate
from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
from mlplat.train.step import train_step

SIZES = {
    "tiny": TinyModelConfig(),
    # ~110M parameters: large enough for the GPU's matrix units to matter.
    "110m": TinyModelConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, num_key_value_heads=4),
}


def batches(rows, tokenizer, batch_size: int, device: str):
    i = 0
    while True:
        chunk = [rows[(i + j) % len(rows)] for j in range(batch_size)]
        i += batch_size
        yield {k: v.to(device) for k, v in pad_collate({"input_ids": [r[0] for r in chunk], "labels": [r[1] for r in chunk]}, tokenizer.pad_token_id).items()}


def time_steps(model_dir, rows, tokenizer, device, bf16, batch_size, steps, warmup=5):
    model = load_model(model_dir, device=device)
    cfg = OptimizerConfig(warmup_steps=10)
    optimizer = build_optimizer(model, cfg)
    scheduler = build_lr_scheduler(optimizer, cfg, steps + warmup)
    data = batches(rows, tokenizer, batch_size, device)
    for _ in range(warmup):
        train_step(model, next(data), optimizer, scheduler, 1.0, bf16)
    if device == "cuda":
        torch.cuda.synchronize()
    start, tokens, losses = time.perf_counter(), 0, []
    for _ in range(steps):
        stats = train_step(model, next(data), optimizer, scheduler, 1.0, bf16)
        tokens += stats.tokens
        losses.append(stats.loss)
    if device == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - start
    return {"step_ms": 1000 * elapsed / steps, "tokens_per_s": tokens / elapsed, "first_loss": losses[0], "last_loss": losses[-1]}


def cuda_check(model_dir, rows, tokenizer, eval_path, steps: int) -> dict:
    """DDP over NCCL (one rank) + bf16 training + GPU generation, end to end."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    dist.init_process_group("nccl", rank=0, world_size=1)
    try:
        model = DistributedDataParallel(load_model(model_dir, device="cuda"), device_ids=[0])
        cfg = OptimizerConfig()
        optimizer = build_optimizer(model, cfg)
        scheduler = build_lr_scheduler(optimizer, cfg, steps)
        data = batches(rows, tokenizer, 64, "cuda")
        start = time.perf_counter()
        losses = [train_step(model, next(data), optimizer, scheduler, cfg.grad_clip, bf16=True).loss for _ in range(steps)]
        torch.cuda.synchronize()
        train_s = time.perf_counter() - start
    finally:
        dist.destroy_process_group()
    with tempfile.TemporaryDirectory() as out:
        model.module.save_pretrained(out)
        tokenizer.save_pretrained(out)
        start = time.perf_counter()
        result = evaluate_exact_match(out, eval_path, device="cuda")
        eval_s = time.perf_counter() - start
    return {
        "backend": "nccl",
        "steps": steps,
        "train_s": train_s,
        "first_loss": losses[0],
        "last_loss": losses[-1],
        "exact_match": result.accuracy,
        "eval_rows": result.total,
        "eval_s": eval_s,
        "device_name": torch.cuda.get_device_name(0),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="fewer steps (finishes in well under 3 minutes)")
    parser.add_argument("--out", default="benchmarks/results/sft_step_throughput.json")
    parser.add_argument("--steps", type=int, default=None)
    args = parser.parse_args()
    steps = args.steps or (10 if args.quick else 30)

    work = Path(tempfile.mkdtemp(prefix="sft_bench_"))
    paths = write_demo_data(work / "data", DemoDataConfig(sft_rows=4000, eval_rows=500))
    rows_raw = [json.loads(line)["messages"] for line in open(paths.sft)]
    configs = [("cpu", False)]
    if torch.cuda.is_available():
        configs += [("cuda", False), ("cuda", True)]

    results, rows = [], {}
    for size, model_cfg in SIZES.items():
        model_dir = build_tiny_model(work / size, tokenizer_corpus(paths.sft), model_cfg)
        tokenizer = load_tokenizer(model_dir)
        rows[size] = [tokenize_chat(tokenizer, m, 128) for m in rows_raw]
        for device, bf16 in configs:
            if size != "tiny" and device == "cpu" and args.quick:
                continue  # the 110M model on 2 CPU cores is minutes per handful of steps
            batch = 64
            r = time_steps(model_dir, rows[size], tokenizer, device, bf16, batch, steps)
            results.append({"model": size, "device": device, "precision": "bf16" if bf16 else "fp32", "batch": batch, **r})
            print(f"{size:>5} {device:>4} {'bf16' if bf16 else 'fp32'}  {r['step_ms']:9.1f} ms/step  {r['tokens_per_s']:12.0f} tok/s", flush=True)

    def tps(model, device, precision):
        return next((r["tokens_per_s"] for r in results if (r["model"], r["device"], r["precision"]) == (model, device, precision)), None)

    ratios = {}
    for size in SIZES:
        if tps(size, "cuda", "bf16") and tps(size, "cuda", "fp32"):
            ratios[f"{size}.cuda_bf16_over_cuda_fp32"] = tps(size, "cuda", "bf16") / tps(size, "cuda", "fp32")
        if tps(size, "cuda", "bf16") and tps(size, "cpu", "fp32"):
            ratios[f"{size}.cuda_bf16_over_cpu_fp32"] = tps(size, "cuda", "bf16") / tps(size, "cpu", "fp32")
    report = {"steps": steps, "rows": results, "ratios": ratios}
    if torch.cuda.is_available():
        report["cuda_check"] = cuda_check(work / "tiny", rows["tiny"], load_tokenizer(work / "tiny"), paths.eval, 300 if args.quick else 800)
        print("cuda check:", json.dumps(report["cuda_check"]))
    print("ratios:", json.dumps(ratios))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
