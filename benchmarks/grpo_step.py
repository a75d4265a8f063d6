"""Claim: GRPO rollouts on the native engine generate faster than transformers ``generate`` as the
rollout backend; and where one GRPO step's time goes (rollout, reward, scoring, train, weight sync).

    python benchmarks/grpo_step.py [--quick] [--shape tiny|wide|qwen2.5-0.5b] [--out FILE]

Setup: the demo task (reversed-sum chat prompts), fp32 on CPU, one thread for both sides. Shapes:
``tiny`` (the quickstart's model; --quick), ``wide`` (4x wider, 2x deeper; the default), and
``qwen2.5-0.5b`` (Qwen2.5-0.5B's configuration with random weights: 494M parameters, 151,936-entry
vocabulary; mlplat.models.shapes), whose weights, not per-step overhead, decide the time.

1. Rollout throughput, same process, same prompts, same sampling (temperature 1, G completions per
   prompt, every completion's tokens with their log-probs). Random weights rarely emit the stop
   token, so lengths are set: each prompt's completions get ``max_tokens`` drawn uniformly from
   [max_len / 4, max_len] (seeded), with ``ignore_eos``; the equal-length ratio (every completion
   max_len tokens) is reported beside it.
   - ours: the rollout actor's engine (``RolloutWorker``: paged KV, continuous batching, the G
     completions sharing their prompt's KV blocks), log-probs returned by the sampler;
   - baseline, as TRL does it: ``model.generate(do_sample=True, num_return_sequences=G)`` on the
     left-padded prompt batch, each row stopped at its length (a per-row stopping criterion: the
     batch runs until its longest row is done), then the sampled tokens' log-probs from one
     forward pass over prompt + completion, a few rows at a time (TRL's per-token log-probs),
     not from ``output_scores``.
   Tokens = completion tokens / wall time. Each side runs twice (once on the 0.5B shape) and the
   faster run counts (other processes only ever slow a run down).
2. The recipe: ``train_apps.grpo.run_grpo`` for a few steps on the local Ray cluster (2 training
   workers, 1 rollout actor; on the 0.5B shape 1 worker, activation checkpointing, micro-batches of
   one group: two fp32 workers with AdamW beside the engine outgrow the machine); the per-phase
   seconds per step it logs (mean over the log windows after the first, which holds warm-up; the
   only window if there is one) are read back from MLflow.

JSON fields: rollout_throughput_ratio (ours / baseline tokens/s, lengths as drawn),
rollout_throughput_ratio_equal_length, rollout_s, reward_s, score_s, train_s, sync_s (seconds per
rollout, from the recipe), engine_tokens_per_s, hf_tokens_per_s, recipe_rollout_tokens_per_s, setup.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import random
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def completion_lengths(prompts: int, max_len: int, equal: bool, seed: int = 0) -> list[int]:
    """max_tokens per prompt: uniform in [max_len / 4, max_len], or max_len for all."""
    rng = random.Random(seed)
    return [max_len if equal else rng.randint(max(1, max_len // 4), max_len) for _ in range(prompts)]


def engine_rollouts(worker, conversations: list[list[dict]], group_size: int, lengths: list[int], seed: int) -> int:
    """Ours: every prompt's G completions with their log-probs; returns the completion tokens."""
    from mlplat.engine import SamplingParams

    engine = worker.engine
    for conversation, length in zip(conversations, lengths):
        params = SamplingParams(n=group_size, max_tokens=length, temperature=1.0, ignore_eos=True, logprobs=True, seed=seed)
        engine.add_request(worker.prompt_ids(conversation), params)
    tokens = 0
    while engine.has_unfinished:
        for out in engine.step():
            if out.finished:
                tokens += sum(len(c.sampled_token_ids) for c in out.outputs)
                assert all(len(c.sampled_logprobs) == len(c.sampled_token_ids) for c in out.outputs)
    return tokens


def hf_rollouts(model, tokenizer, conversations: list[list[dict]], group_size: int, lengths: list[int], seed: int, logprob_rows: int = 4) -> int:
    """Baseline: transformers sampling, each row stopped at its length, then log-probs from one forward pass."""
    from transformers import StoppingCriteria, StoppingCriteriaList

    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    prompt_len = enc["input_ids"].shape[1]
    row_lengths = torch.tensor(lengths).repeat_interleave(group_size)

    class RowLengths(StoppingCriteria):
        def __call__(self, input_ids, scores, **kwargs):
            return (input_ids.shape[1] - prompt_len) >= row_lengths

    torch.manual_seed(seed)
    with torch.inference_mode():
        sequences = model.generate(
            **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max(lengths), num_return_sequences=group_size,
            stopping_criteria=StoppingCriteriaList([RowLengths()]), eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        completion = torch.arange(sequences.shape[1] - prompt_len)[None] < row_lengths[:, None]
        attention = torch.cat([enc["attention_mask"].repeat_interleave(group_size, 0), completion.long()], dim=1)
        logprobs = []
        for rows in torch.arange(sequences.shape[0]).split(logprob_rows):
            logits = model(input_ids=sequences[rows], attention_mask=attention[rows]).logits[:, prompt_len - 1 : -1]
            logprobs.append(torch.log_softmax(logits.float(), -1).gather(-1, sequences[rows, prompt_len:, None])[..., 0] * completion[rows])
    return int(completion.sum())


def compare_rollouts(model_dir: str, conversations, group_size: int, prompts: int, max_len: int, runs: int, big: bool) -> dict:
    """Both rollout backends on the same prompts, lengths drawn and equal: seconds and tokens of each."""
    from mlplat.models import load_model, load_tokenizer
    from mlplat.rl.rollout import RolloutWorker

    torch.set_num_threads(1)
    engine = RolloutWorker(model_dir, {"kv_cache_memory_gb": 0.25})
    hf_model, tokenizer = load_model(model_dir).eval(), load_tokenizer(model_dir)
    measured = {}
    for name, equal in (("drawn", False), ("equal", True)):
        lengths = completion_lengths(prompts, max_len, equal)
        engine_s, engine_tokens = best_of(runs, lambda: engine_rollouts(engine, conversations, group_size, lengths, seed=0))  # noqa: B023
        hf_s, hf_tokens = best_of(runs, lambda: hf_rollouts(hf_model, tokenizer, conversations, group_size, lengths, seed=0))  # noqa: B023
        assert engine_tokens == hf_tokens == group_size * sum(lengths)
        measured[name] = {"lengths": lengths, "tokens": engine_tokens, "engine_s": engine_s, "hf_s": hf_s}
    return measured


def best_of(runs: int, fn) -> tuple[float, int]:
    best, tokens = float("inf"), 0
    for _ in range(runs):
        start = time.perf_counter()
        tokens = fn()
        best = min(best, time.perf_counter() - start)
    return best, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model and fewer steps (< 3 minutes)")
    parser.add_argument("--shape", choices=["tiny", "wide", "qwen2.5-0.5b"], default=None, help="default: tiny with --quick, else wide")
    parser.add_argument("--out", type=Path, default=RESULTS / "grpo_step.json")
    args = parser.parse_args()
    shape_name = args.shape or ("tiny" if args.quick else "wide")

    import ray

    from mlplat.data.demo import DemoDataConfig, tokenizer_corpus, write_demo_data
    from mlplat.data.ingest import DataConfig
    from mlplat.models import TinyModelConfig, build_tiny_model
    from mlplat.models.shapes import SHAPES, build_random_model
    from train_apps.grpo import GRPOConfig, run_grpo

    torch.set_num_threads(1)
    big = shape_name == "qwen2.5-0.5b"
    prompts, group_size, max_len = {"tiny": (8, 8, 8), "wide": (16, 8, 16), "qwen2.5-0.5b": (8, 4, 48)}[shape_name]
    runs = 1 if big else 2
    work = Path(tempfile.mkdtemp(prefix="grpo_bench_"))
    data = write_demo_data(work / "data", DemoDataConfig(sft_rows=2000, eval_rows=50, preference_rows=50, rl_rows=400))
    if big:
        shape = SHAPES[shape_name]
        model_dir = build_random_model(work / "model", shape, tokenizer_corpus(data.sft))
    else:
        shape = TinyModelConfig() if shape_name == "tiny" else TinyModelConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4)
        model_dir = build_tiny_model(work / "model", tokenizer_corpus(data.sft), shape)
    with open(data.rl_prompts) as f:
        conversations = [json.loads(line)["messages"] for line in f][:prompts]

    # In a process of its own: its two copies of the weights are gone before the recipe's workers load theirs.
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        measured = pool.submit(compare_rollouts, str(model_dir), conversations, group_size, prompts, max_len, runs, big).result()
    ratios = {name: m["hf_s"] / m["engine_s"] for name, m in measured.items()}
    print(f"rollout_throughput_ratio: {ratios['drawn']:.2f} (lengths drawn), {ratios['equal']:.2f} (equal lengths)", flush=True)

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    steps, log_every = (2, 1) if big else (6, 3) if args.quick else (20, 5)
    workers = 1 if big else 2
    cfg = GRPOConfig(
        model=str(model_dir), data=DataConfig(path=str(data.rl_prompts)), max_steps=steps, log_every=log_every, checkpoint_every=steps,
        num_workers=workers, num_generations=group_size, max_completion_length=max_len, storage_path=str(work / "ray_train"),
        registered_model=None,
        # each worker's prompts x G completions make one optimizer step; on the 0.5B shape in micro-batches of one group, layers
        # recomputed in backward (two workers' fp32 weights, gradients and AdamW state beside the engine outgrow 23 GiB)
        batch_size_per_worker=group_size if big else prompts // workers * group_size, grad_accum_steps=prompts if big else 1,
        parallel={"activation_checkpointing": big},
        rollout={"kv_cache_memory_gb": 0.25},
    )  # fmt: skip
    tracking_uri = f"sqlite:///{work / 'mlflow.db'}"
    result = run_grpo(cfg, tracking_uri=tracking_uri, work_dir=work / "outputs")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)

    def steady(metric: str) -> float:
        history = [m.value for m in sorted(client.get_metric_history(result.run_id, metric), key=lambda m: m.step)]
        steady_windows = history[1:] or history  # every window after the first (warm-up)
        return sum(steady_windows) / len(steady_windows)

    ray.shutdown()
    drawn = measured["drawn"]
    out = {
        "rollout_throughput_ratio": ratios["drawn"],
        "rollout_throughput_ratio_equal_length": ratios["equal"],
        "rollout_s": steady("time/rollout_s"),
        "reward_s": steady("time/reward_s"),
        "score_s": steady("time/score_s"),
        "train_s": steady("time/train_s"),
        "sync_s": steady("time/sync_s"),
        "engine_tokens_per_s": drawn["tokens"] / drawn["engine_s"],
        "hf_tokens_per_s": drawn["tokens"] / drawn["hf_s"],
        "recipe_rollout_tokens_per_s": steady("rollout/tokens_per_s"),
        "rollouts": measured,
        "setup": {
            "quick": args.quick, "shape": shape_name, "prompts": prompts, "num_generations": group_size, "max_len": max_len,
            "length_distribution": "per prompt, uniform integer in [max_len // 4, max_len], seed 0; ignore_eos", "runs_per_side": runs,
            "model": shape.model_dump(), "threads": torch.get_num_threads(), "grpo_steps": steps, "training_workers": workers,
            "date": time.strftime("%Y-%m-%d"),
        },
    }  # fmt: skip
    rows = [
        ("rollout tokens/s, engine (ours)", f"{out['engine_tokens_per_s']:.0f}"),
        ("rollout tokens/s, transformers generate", f"{out['hf_tokens_per_s']:.0f}"),
        ("rollout_throughput_ratio (lengths drawn)", f"{out['rollout_throughput_ratio']:.2f}"),
        ("rollout_throughput_ratio (equal lengths)", f"{out['rollout_throughput_ratio_equal_length']:.2f}"),
        ("GRPO step: rollout s", f"{out['rollout_s']:.3f}"),
        ("GRPO step: reward s", f"{out['reward_s']:.4f}"),
        ("GRPO step: scoring (old/ref log-probs) s", f"{out['score_s']:.3f}"),
        ("GRPO step: train s", f"{out['train_s']:.3f}"),
        ("GRPO step: weight sync s", f"{out['sync_s']:.3f}"),
    ]
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value:>10}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
