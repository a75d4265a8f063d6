"""The training checks: one SFT step and one GRPO step of the recipes' shared inner loop under a world-size-1
process group (NCCL on CUDA, gloo on CPU) with FSDP2, bf16 mixed precision on CUDA and activation checkpointing,
each counting the collectives it issued through mlplat.collectives; and NCCL itself through that helper."""

from __future__ import annotations

import contextlib
import math
import time

import torch
import torch.distributed as dist

from mlplat import collectives
from mlplat.gpucheck.common import Outcome, Settings, shape_checkpoint
from mlplat.gpucheck.measure import init_process_group, synchronize, synthetic_batches
from mlplat.rl.objectives import GRPOObjective
from mlplat.train.losses import advantages
from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
from mlplat.train.parallel import ParallelConfig, parallelize
from mlplat.train.step import train_step


@contextlib.contextmanager
def process_group(settings: Settings):
    init_process_group(settings.torch_device)
    try:
        yield
    finally:
        dist.destroy_process_group()


def trainable(path, settings: Settings, lr: float = 1e-4):
    """The policy as the recipes build it (mlplat.train.loop.trainable without a restore): the chunked log-prob head,
    then activation checkpointing and FSDP2 (bf16 parameters, fp32 reduction on CUDA); AdamW and its schedule."""
    from mlplat.models import load_model
    from mlplat.train.logprobs import install_logprob_head

    model = install_logprob_head(load_model(path)).train()
    model = parallelize(model, ParallelConfig(strategy="fsdp", activation_checkpointing=True), settings.torch_device)
    optim = OptimizerConfig(lr=lr, warmup_steps=1)
    optimizer = build_optimizer(model, optim)
    return model, optimizer, build_lr_scheduler(optimizer, optim, 10), optim


def nccl_version() -> str:
    version = torch.cuda.nccl.version()
    return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)


def issued() -> int:
    return sum(collectives.ISSUED.values())


def sft_step(settings: Settings, outcome: Outcome) -> None:
    """SFT steps (packed rows, the recipe's loss) on Qwen2.5-0.5B's shape: loss finite, an update applied, the
    collectives each step issued counted (zero fails), tokens/s and MFU against the device's peak (mlplat.train.perf)."""
    from mlplat.train.parallel import unwrap
    from mlplat.train.perf import flops_per_token, peak_flops

    path, shape = shape_checkpoint(settings)
    rows, seq_len = (2, 64) if settings.quick else (8, 1024)
    device, bf16 = settings.torch_device, settings.device == "cuda"
    batch = synthetic_batches(shape.vocab_size, 1, rows, seq_len, (max(8, seq_len // 16), seq_len // 2), packed=True)[0]
    batch = {k: v.to(device) for k, v in batch.items()}
    with process_group(settings):
        outcome.record(backend=dist.get_backend(), world_size=dist.get_world_size(), model=shape.name, rows=rows, seq_len=seq_len)
        model, optimizer, scheduler, optim = trainable(path, settings, lr=1e-3 if settings.quick else 3e-4)
        fpt = flops_per_token(unwrap(model), seq_len)
        peak = peak_flops(device)
        per_step, losses, tokens, seconds = [], [], 0, 0.0
        for i in range(4):  # the same rows each step: the loss must fall
            before = issued()
            synchronize(device)
            start = time.perf_counter()
            stats = train_step(model, batch, optimizer, scheduler, optim.grad_clip, bf16)
            synchronize(device)
            if i > 0:  # the first step warms up (allocations, kernels)
                seconds += time.perf_counter() - start
                tokens += stats.tokens
            per_step.append(issued() - before)
            losses.append(stats.loss)
            outcome.expect(not stats.skipped and math.isfinite(stats.loss), f"step {i}: skipped or non-finite (loss {stats.loss}, grad norm {stats.grad_norm})")
        tokens_per_s = tokens / seconds
        outcome.record(collectives_per_step=per_step, losses=losses, tokens_per_s=tokens_per_s, flops_per_token=fpt, peak_tflops=peak / 1e12,
                       mfu=tokens_per_s * fpt / peak, precision="bf16" if bf16 else "fp32", activation_checkpointing=True, strategy="fsdp2",
                       peak_memory_gib=torch.cuda.max_memory_allocated(device) / 2**30 if bf16 else None)  # fmt: skip
        outcome.expect(all(n > 0 for n in per_step), f"a step issued no collective through mlplat.collectives: {per_step}")
        outcome.expect(losses[-1] < losses[0], f"the loss did not fall over {len(losses)} steps on repeated rows: {losses}")


def grpo_step(settings: Settings, outcome: Outcome) -> None:
    """One GRPO step as the recipe runs it without Ray: G samples per prompt from the in-process rollout engine with
    their log-probs, rewards, group-normalised advantages, the policy's no-grad scoring (checked against the
    engine's log-probs), the clipped objective through the shared train_step, and the weights streamed back into
    the engine layer by layer (the engine then scores like the updated policy)."""
    from mlplat.rl.experience import completion_mask, micro_batches, rollout_batch, score_completions
    from mlplat.rl.rollout import InProcessRollout, RolloutConfig, generate, sync_weights

    settings_small = Settings(settings.device, True, settings.work)  # the tiny Qwen2-family model in every mode: the step's paths, not its speed
    path, _ = shape_checkpoint(settings_small)
    device, bf16 = settings.torch_device, settings.device == "cuda"
    group, max_tokens = 4, 8
    rollout = InProcessRollout(str(path), RolloutConfig(device=settings.device, dtype="bfloat16" if bf16 else "float32", kv_cache_memory_gb=0.05))
    conversations = [[{"role": "user", "content": f"What is {a} + {b}?"}] for a, b in ((12, 7), (30, 45))]
    samples = generate(rollout, conversations, {"n": group, "max_tokens": max_tokens, "temperature": 1.0, "seed": 0, "ignore_eos": True})
    # A reward that varies within each group: the share of even token ids in the completion.
    rewards = torch.tensor([sum(t % 2 == 0 for t in s.completion_ids) / len(s.completion_ids) for s in samples])
    batch = rollout_batch(samples, rollout.worker.tokenizer.pad_token_id)
    batch["advantages"] = advantages(rewards, group)
    batch = {k: v.to(device) for k, v in batch.items()}
    mask = completion_mask(batch)
    with process_group(settings):
        # A large step (AdamW moves every weight by ~lr at once), so that the sync below has a change to carry that
        # bf16's noise cannot hide.
        policy, optimizer, scheduler, optim = trainable(path, settings, lr=1e-2)
        # Scored as the recipe scores (mlplat.rl.loop): no autocast; under FSDP2 mixed precision the forward runs in bf16.
        old = score_completions(policy, batch, micro_batch_size=4, temperature=1.0)["logprobs"]
        diff = ((old - batch["engine_logprobs"]).abs() * mask).max().item()
        batch["old_logprobs"] = batch["ref_logprobs"] = old  # the reference is the starting policy
        before = issued()
        stats = train_step(policy, micro_batches(batch, 4), optimizer, scheduler, optim.grad_clip, bf16,
                           objective=GRPOObjective(temperature=1.0, loss_type="dapo", max_completion_length=max_tokens, epsilon=0.2, beta=0.04))  # fmt: skip
        step_collectives = issued() - before
        outcome.record(backend=dist.get_backend(), samples=len(samples), reward_mean=rewards.mean().item(), rollout_logprob_diff_max=diff,
                       loss=stats.loss, grad_norm=stats.grad_norm, step_metrics=stats.metrics, collectives_in_step=step_collectives)  # fmt: skip
        outcome.expect(step_collectives > 0, "the GRPO step issued no collective through mlplat.collectives")
        outcome.expect(not stats.skipped and math.isfinite(stats.loss) and stats.grad_norm > 0, f"the update was skipped or empty: {stats}")
        tolerance = 0.1 if bf16 else 1e-3  # bf16 engine against the FSDP2 bf16 forward; fp32 on both sides on CPU
        outcome.expect(diff < tolerance, f"the trainer's log-probs differ from the engine's by {diff:.4f} (tolerance {tolerance})")
        # The weight sync of the recipe: layer by layer out of the FSDP2 shards into the engine, in place.
        before = issued()
        sync_weights(policy, [rollout], 0, device)
        outcome.record(collectives_in_sync=issued() - before)
        new = score_completions(policy, batch, micro_batch_size=4, temperature=1.0)["logprobs"]
    engine_new = torch.zeros_like(new)
    for i, s in enumerate(samples):
        scored = rollout.worker.score(s.prompt_ids + s.completion_ids)[len(s.prompt_ids) - 1 :]
        engine_new[i, len(s.prompt_ids) - 1 : len(s.prompt_ids) - 1 + len(scored)] = torch.tensor(scored, device=device)
    synced = ((new - engine_new).abs() * mask).max().item()
    moved = ((new - old).abs() * mask).max().item()
    outcome.record(synced_logprob_diff_max=synced, policy_logprob_change_max=moved)
    outcome.expect(synced < tolerance, f"after the weight sync the engine's log-probs differ from the policy's by {synced:.4f}")
    outcome.expect(moved > 3 * tolerance, f"the step moved the policy's log-probs by {moved:.2e} at most: too little for the sync check to prove anything")


def nccl_collectives(settings: Settings, outcome: Outcome) -> None:
    """Every helper of mlplat.collectives under NCCL at world size 1, handed CPU tensors (the helper places them on
    the device), each call counted; and NCCL itself refusing a CPU tensor, which is what the helper guards against."""
    device = settings.torch_device
    with process_group(settings):
        counts = {}
        before = dict(collectives.ISSUED)
        reduced = collectives.all_reduce(torch.ones(4), device)
        values = collectives.reduce_values({"a": 1.0, "b": 2.0}, device)
        gathered = collectives.all_gather(torch.arange(3), device)
        objects = collectives.all_gather_object({"rank": 0})
        collectives.barrier(device)
        counts = {k: v - before.get(k, 0) for k, v in collectives.ISSUED.items() if v != before.get(k, 0)}
        outcome.record(backend=dist.get_backend(), issued=counts, nccl_version=nccl_version())
        outcome.expect(reduced.device.type == "cuda" and reduced.tolist() == [1.0] * 4, f"all_reduce gave {reduced}")
        outcome.expect(values == {"a": 1.0, "b": 2.0}, f"reduce_values gave {values}")
        outcome.expect(len(gathered) == 1 and gathered[0].tolist() == [0, 1, 2], f"all_gather gave {gathered}")
        outcome.expect(objects == [{"rank": 0}], f"all_gather_object gave {objects}")
        outcome.expect(set(counts) == {"all_reduce", "all_gather", "all_gather_object", "barrier"}, f"issued: {counts}")
        try:
            dist.all_reduce(torch.ones(1))  # what a metric built on the CPU would hit without the helper
            synchronize(device)
            refused = False
        except Exception as err:  # NCCL's error type is not public API: any refusal counts
            refused, message = True, str(err).splitlines()[0][:200]
        outcome.record(nccl_refuses_cpu_tensor=refused, refusal=message if refused else None)
        outcome.expect(refused, "NCCL took a CPU tensor: the check for CPU tensors in collectives would prove nothing here")
