"""Claim: GRPO rollouts on the native engine generate faster than transformers ``generate`` as the
rollout backend; and where one GRPO step's time goes (rollout, reward, train, weight sync).

    python benchmarks/grpo_step.py [--quick] [--out FILE]

Setup: the demo task (reversed-sum chat prompts), a Llama made locally (the quickstart's
tiny model with --quick; a 4x wider, 2x deeper one otherwise), fp32 on CPU, one thread.

1. Rollout throughput, same process, same prompts, same sampling (temperature 1, G samples
   per prompt, max_new_tokens, log-probs of the sampled tokens returned by both):
   - ours: ``mlplat.rl.rollout.RolloutWorker.generate`` (the engine: paged KV, continuous
     batching, the G samples sharing their prompt's KV blocks);
   - baseline: ``model.generate(do_sample=True, num_return_sequences=G, output_scores=True)``
     on the left-padded prompt batch, log-probs from the returned scores.
   Tokens = generated tokens (stop token included) / wall time; each side runs twice and the
   faster run counts (other processes only ever slow a run down).
2. The recipe: ``train_apps.grpo.run_grpo`` for a few steps on the local Ray cluster (2 training
   workers, 1 rollout actor); the per-phase seconds per step it logs (mean over steps after
   the first log window, which holds warm-up) are read back from MLflow.

JSON fields: rollout_throughput_ratio (ours / baseline tokens/s), rollout_s, reward_s,
train_s, sync_s (seconds per GRPO step, from the recipe), engine_tokens_per_s,
hf_tokens_per_s, recipe_rollout_tokens_per_s, setup.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def hf_rollouts(model, tokenizer, conversations: list[list[dict]], group_size: int, max_new_tokens: int, seed: int) -> int:
    """Baseline: transformers sampling with log-probs; returns generated tokens (stop token included)."""
    tokenizer.padding_side = "left"
    texts = [tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    torch.manual_seed(seed)
    with torch.inference_mode():
        out = model.generate(
            **enc, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, max_new_tokens=max_new_tokens, num_return_sequences=group_size,
            output_scores=True, return_dict_in_generate=True, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        )  # fmt: skip
        new = out.sequences[:, enc["input_ids"].shape[1] :]
        logprobs = torch.stack([torch.log_softmax(s.float(), -1) for s in out.scores], 1).gather(-1, new[..., None])[..., 0]
    finished = (new == tokenizer.eos_token_id).cumsum(1)
    generated = ((finished == 0) | ((finished == 1) & (new == tokenizer.eos_token_id))).sum()  # up to and including the stop token
    assert logprobs.shape == new.shape
    return int(generated)


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
    parser.add_argument("--out", type=Path, default=RESULTS / "grpo_step.json")
    args = parser.parse_args()

    import ray

    from mlplat.data.demo import DemoDataConfig, tokenizer_corpus, write_demo_data
    from mlplat.data.ingest import DataConfig
    from mlplat.models import TinyModelConfig, build_tiny_model, load_model, load_tokenizer
    from mlplat.rl.rollout import RolloutWorker
    from train_apps.grpo import GRPOConfig, run_grpo

    torch.set_num_threads(1)
    prompts, group_size, max_new_tokens = (8, 8, 8) if args.quick else (16, 8, 16)
    shape = TinyModelConfig() if args.quick else TinyModelConfig(hidden_size=768, intermediate_size=2048, num_hidden_layers=8, num_attention_heads=12, num_key_value_heads=4)
    work = Path(tempfile.mkdtemp(prefix="grpo_bench_"))
    data = write_demo_data(work / "data", DemoDataConfig(sft_rows=2000, eval_rows=50, preference_rows=50, rl_rows=400))
    model_dir = build_tiny_model(work / "model", tokenizer_corpus(data.sft), shape)
    with open(data.rl_prompts) as f:
        conversations = [json.loads(line)["messages"] for line in f][:prompts]

    engine = RolloutWorker(str(model_dir), {})
    params = {"n": group_size, "max_tokens": max_new_tokens, "temperature": 1.0, "seed": 0}
    engine_s, engine_tokens = best_of(2, lambda: sum(len(s.completion_ids) for s in engine.generate(conversations, params)))
    hf_model, tokenizer = load_model(model_dir).eval(), load_tokenizer(model_dir)
    hf_s, hf_tokens = best_of(2, lambda: hf_rollouts(hf_model, tokenizer, conversations, group_size, max_new_tokens, seed=0))

    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)
    steps, log_every = (6, 3) if args.quick else (20, 5)
    cfg = GRPOConfig(
        model=str(model_dir), data=DataConfig(path=str(data.rl_prompts)), max_steps=steps, log_every=log_every, checkpoint_every=steps,
        num_workers=2, batch_size_per_worker=prompts // 2 * group_size, num_generations=group_size, max_completion_length=max_new_tokens,
        storage_path=str(work / "ray_train"), registered_model=None,
    )  # fmt: skip
    tracking_uri = f"sqlite:///{work / 'mlflow.db'}"
    result = run_grpo(cfg, tracking_uri=tracking_uri, work_dir=work / "outputs")
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)

    def steady(metric: str) -> float:
        history = [m.value for m in sorted(client.get_metric_history(result.run_id, metric), key=lambda m: m.step)]
        return sum(history[1:]) / len(history[1:])  # every window after the first (warm-up)

    ray.shutdown()
    out = {
        "rollout_throughput_ratio": (engine_tokens / engine_s) / (hf_tokens / hf_s),
        "rollout_s": steady("time/rollout_s"),
        "reward_s": steady("time/reward_s"),
        "score_s": steady("time/score_s"),
        "train_s": steady("time/train_s"),
        "sync_s": steady("time/sync_s"),
        "engine_tokens_per_s": engine_tokens / engine_s,
        "hf_tokens_per_s": hf_tokens / hf_s,
        "recipe_rollout_tokens_per_s": steady("rollout/tokens_per_s"),
        "setup": {
            "quick": args.quick, "prompts": prompts, "group_size": group_size, "max_new_tokens": max_new_tokens,
            "model": shape.model_dump(), "threads": torch.get_num_threads(), "grpo_steps": steps, "training_workers": 2,
        },
    }  # fmt: skip
    rows = [
        ("rollout tokens/s, engine (ours)", f"{out['engine_tokens_per_s']:.0f}"),
        ("rollout tokens/s, transformers generate", f"{out['hf_tokens_per_s']:.0f}"),
        ("rollout_throughput_ratio", f"{out['rollout_throughput_ratio']:.2f}"),
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
