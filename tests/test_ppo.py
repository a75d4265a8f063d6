"""PPO (train_apps/ppo.py): GAE, the KL-penalised rewards, whitening and the clipped value loss against plain loops,
the policy and critic objectives on a tiny batch, and the loop raising the reward on two ranks."""

from __future__ import annotations

import json
import math
from functools import partial

import pytest
import torch
from conftest import sampled_reward

from mlplat.rl.experience import completion_mask, rollout_batch
from mlplat.rl.rollout import Sample
from mlplat.train.batch import IGNORE_INDEX
from mlplat.train.losses import clipped_value_loss, gae, kl_penalised_rewards, masked_whiten

# 3 rows of target positions (T = 7): a completion starts after its prompt and ends before the padding.
MASK = [[0, 0, 1, 1, 1, 1, 0], [0, 1, 1, 0, 0, 0, 0], [0, 0, 0, 1, 1, 1, 1]]
REWARDS = [[0.0, 0.0, 0.1, -0.2, 0.05, 1.0, 0.0], [0.0, 0.3, -0.5, 0.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.2, 0.0, -0.1, 2.0]]
VALUES = [[9.0, 9.0, 0.5, 0.4, 0.6, 0.8, 9.0], [9.0, -0.2, 0.1, 9.0, 9.0, 9.0, 9.0], [9.0, 9.0, 9.0, 1.0, 1.2, 0.9, 1.5]]  # 9: ignored


def _completion(row: list[float], mask_row: list[int]) -> list[float]:
    return [v for v, m in zip(row, mask_row) if m]


def test_gae_matches_a_plain_loop_over_each_completion():
    gamma, lam = 0.9, 0.8
    mask = torch.tensor(MASK, dtype=torch.bool)
    advantages, returns = gae(torch.tensor(REWARDS), torch.tensor(VALUES), mask, gamma, lam)
    for i in range(3):
        r, v = _completion(REWARDS[i], MASK[i]), _completion(VALUES[i], MASK[i])
        expected, running = [0.0] * len(r), 0.0
        for t in reversed(range(len(r))):
            next_value = v[t + 1] if t + 1 < len(r) else 0.0  # the completion ends: nothing after its last token
            running = r[t] + gamma * next_value - v[t] + gamma * lam * running
            expected[t] = running
        assert _completion(advantages[i].tolist(), MASK[i]) == pytest.approx(expected, rel=1e-5, abs=1e-6)
        assert _completion(returns[i].tolist(), MASK[i]) == pytest.approx([a + b for a, b in zip(expected, v)], rel=1e-5, abs=1e-6)
        outside = [a for a, m in zip(advantages[i].tolist() + returns[i].tolist(), MASK[i] * 2) if not m]
        assert outside == [0.0] * len(outside)  # prompt and padding positions: nothing


def test_gamma_and_lambda_one_give_the_reward_to_go_minus_the_value():
    mask = torch.tensor(MASK, dtype=torch.bool)
    advantages, returns = gae(torch.tensor(REWARDS), torch.tensor(VALUES), mask, 1.0, 1.0)
    for i in range(3):
        r, v = _completion(REWARDS[i], MASK[i]), _completion(VALUES[i], MASK[i])
        assert _completion(returns[i].tolist(), MASK[i]) == pytest.approx([sum(r[t:]) for t in range(len(r))], rel=1e-5, abs=1e-6)
        assert _completion(advantages[i].tolist(), MASK[i]) == pytest.approx([sum(r[t:]) - v[t] for t in range(len(r))], rel=1e-5, abs=1e-6)


def test_rewards_are_the_score_on_the_last_token_minus_the_kl_penalty():
    mask = torch.tensor(MASK, dtype=torch.bool)
    g = torch.Generator().manual_seed(0)
    logprobs, ref = -torch.rand(3, 7, generator=g), -torch.rand(3, 7, generator=g)
    scores, kl_coef = [1.0, -0.5, 0.25], 0.1
    rewards = kl_penalised_rewards(torch.tensor(scores), logprobs, ref, mask, kl_coef)
    for i in range(3):
        last = max(t for t in range(7) if MASK[i][t])
        for t in range(7):
            expected = -kl_coef * (logprobs[i, t].item() - ref[i, t].item()) if MASK[i][t] else 0.0
            expected += scores[i] if t == last else 0.0
            assert rewards[i, t].item() == pytest.approx(expected, rel=1e-5, abs=1e-7)
    # A completion with no tokens left (masked as truncated) gets nothing.
    empty = kl_penalised_rewards(torch.tensor([1.0]), logprobs[:1], ref[:1], torch.zeros(1, 7, dtype=torch.bool), kl_coef)
    assert empty.abs().sum() == 0


def test_masked_whiten_uses_the_completion_tokens_only():
    mask = torch.tensor(MASK, dtype=torch.bool)
    values = torch.tensor(VALUES)
    kept = [v for i in range(3) for v in _completion(VALUES[i], MASK[i])]
    mean = sum(kept) / len(kept)
    std = math.sqrt(sum((v - mean) ** 2 for v in kept) / (len(kept) - 1))  # unbiased, as TRL's masked_var
    whitened, scaled = masked_whiten(values, mask), masked_whiten(values, mask, shift_mean=False)
    for i in range(3):
        for t in range(7):
            v = VALUES[i][t]
            assert whitened[i, t].item() == pytest.approx((v - mean) / std if MASK[i][t] else 0.0, rel=1e-5, abs=1e-6)
            assert scaled[i, t].item() == pytest.approx((v - mean) / std + mean if MASK[i][t] else 0.0, rel=1e-5, abs=1e-6)


def test_clipped_value_loss_matches_a_plain_loop():
    old = [[0.5, -1.0, 2.0], [0.0, 0.3, 1.0]]
    new = [[0.9, -1.1, 1.5], [0.5, 0.0, 1.25]]
    ret = [[1.0, -2.0, 1.0], [1.0, 0.5, 1.2]]
    clip = 0.2
    loss, clipped = clipped_value_loss(torch.tensor(new), torch.tensor(old), torch.tensor(ret), clip)
    for i in range(2):
        for t in range(3):
            bounded = min(max(new[i][t], old[i][t] - clip), old[i][t] + clip)
            a, b = (new[i][t] - ret[i][t]) ** 2, (bounded - ret[i][t]) ** 2
            assert loss[i, t].item() == pytest.approx(0.5 * max(a, b), rel=1e-5, abs=1e-6)
            assert bool(clipped[i, t]) == (b > a)
    assert clipped.tolist() == [[True, False, True], [True, False, False]]  # moved past the range, away from the return


def _ppo_batch(tiny_model):
    """A fake rollout of the tiny model: prompts of 2-3 tokens, completions of 1-4 tokens, per-token advantages, old
    log-probs near the model's own, old values and returns."""
    from mlplat.models import load_model

    g = torch.Generator().manual_seed(0)
    samples = [Sample([5, 6, 7][: 2 + i % 2], torch.randint(8, 60, (1 + i % 4,), generator=g).tolist(), [-1.0] * (1 + i % 4), "", "stop")
               for i in range(6)]  # fmt: skip
    batch = rollout_batch(samples, pad_token_id=0)
    mask = completion_mask(batch)
    model = load_model(tiny_model)
    with torch.no_grad():
        logp = torch.log_softmax(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits[:, :-1] / 0.7, dim=-1)
        old = logp.gather(-1, batch["labels"][:, 1:].clamp(min=0)[..., None])[..., 0] * mask
    batch["old_logprobs"] = old + 0.3 * torch.randn(old.shape, generator=g) * mask  # ratios far enough from 1 to clip some
    batch["advantages"] = torch.randn(old.shape, generator=g) * mask
    batch["old_values"] = torch.randn(old.shape, generator=g) * mask
    batch["returns"] = torch.randn(old.shape, generator=g) * mask
    return batch


def test_ppo_policy_objective_equals_a_plain_loop_over_completion_tokens(tiny_model):
    from mlplat.models import load_model
    from mlplat.train.logprobs import install_logprob_head
    from train_apps.ppo import PPOConfig, PPOPolicyObjective

    cfg = PPOConfig(model="/m", data={"path": "/p"}, temperature=0.7, cliprange=0.2)
    batch, model = _ppo_batch(tiny_model), install_logprob_head(load_model(tiny_model))
    objective = PPOPolicyObjective(cfg)
    loss, stats = objective(model, batch)
    with torch.no_grad():  # full logits: the plain linear head without a log-prob request
        logp = torch.log_softmax(model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float() / 0.7, dim=-1)
    total, clipped, tokens = 0.0, 0, 0
    for i in range(batch["input_ids"].shape[0]):
        for t in range(batch["input_ids"].shape[1] - 1):
            token = batch["labels"][i, t + 1].item()
            if token == IGNORE_INDEX:
                continue
            ratio = math.exp(logp[i, t, token].item() - batch["old_logprobs"][i, t].item())
            a = batch["advantages"][i, t].item()
            bounded = min(max(ratio, 0.8), 1.2)
            total += -min(ratio * a, bounded * a)
            clipped += ratio * a > bounded * a
            tokens += 1
    assert objective.units(batch).item() == tokens
    assert (loss / tokens).item() == pytest.approx(total / tokens, rel=1e-4)
    assert stats["clip_fraction"].item() == clipped and 0 < clipped < tokens


def test_the_critic_scores_every_position_with_the_reward_models_head(tiny_model):
    """The critic wraps the scalar-head model: its value at a row's last token is the reward model's score, its state
    dict is the reward model's, and its value loss is vf_coef x the clipped loss over completion tokens."""
    from mlplat.models import load_reward_model
    from train_apps.ppo import PPOConfig, TokenValues, ValueObjective

    rm = load_reward_model(tiny_model)
    with torch.no_grad():
        rm.score.weight.normal_(std=0.1)  # a new head is random anyway; make it clearly non-zero
    critic = TokenValues(rm)
    assert critic.state_dict().keys() == rm.state_dict().keys()
    ids = torch.randint(8, 60, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        values = critic(input_ids=ids, attention_mask=torch.ones_like(ids))
        scores = rm(input_ids=ids, attention_mask=torch.ones_like(ids)).logits[:, 0]
    assert values.shape == (2, 6)
    torch.testing.assert_close(values[:, -1], scores, rtol=1e-5, atol=1e-6)

    cfg = PPOConfig(model="/m", data={"path": "/p"}, cliprange_value=0.2, vf_coef=0.1)
    batch = _ppo_batch(tiny_model)
    loss, stats = ValueObjective(cfg)(critic, batch)
    with torch.no_grad():
        v = critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    total, clipped, tokens = 0.0, 0, 0
    for i in range(batch["input_ids"].shape[0]):
        for t in range(batch["input_ids"].shape[1] - 1):
            if batch["labels"][i, t + 1].item() == IGNORE_INDEX:
                continue
            new, old, ret = v[i, t].item(), batch["old_values"][i, t].item(), batch["returns"][i, t].item()
            bounded = min(max(new, old - 0.2), old + 0.2)
            total += 0.1 * 0.5 * max((new - ret) ** 2, (bounded - ret) ** 2)
            clipped += (bounded - ret) ** 2 > (new - ret) ** 2
            tokens += 1
    assert (loss / tokens).item() == pytest.approx(total / tokens, rel=1e-4)
    assert stats["clip_fraction"].item() == clipped


@pytest.mark.parametrize("trained", ["policy", "critic"])
def test_ppo_objectives_accumulate_exactly_over_micro_batches(trained, tiny_model):
    """Both objectives are means over the step's completion tokens: micro-batches of 2 and 4 completions give the loss,
    statistics and update of one micro-batch of 6."""
    from mlplat.models import load_model, load_reward_model
    from mlplat.train.logprobs import install_logprob_head
    from mlplat.train.optim import OptimizerConfig, build_lr_scheduler
    from mlplat.train.step import train_step
    from train_apps.ppo import PPOConfig, PPOPolicyObjective, TokenValues, ValueObjective

    cfg = PPOConfig(model="/m", data={"path": "/p"}, temperature=0.7, cliprange=0.2, cliprange_value=0.2, vf_coef=0.1)
    batch = _ppo_batch(tiny_model)
    objective = PPOPolicyObjective(cfg) if trained == "policy" else ValueObjective(cfg)

    def setup():
        torch.manual_seed(0)  # the critic's new head alike in both copies
        model = install_logprob_head(load_model(tiny_model)) if trained == "policy" else TokenValues(load_reward_model(tiny_model))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, optimizer, build_lr_scheduler(optimizer, OptimizerConfig(lr=0.1, warmup_steps=1), 10)

    whole, accumulated = setup(), setup()
    a = train_step(whole[0], batch, *whole[1:], grad_clip=10.0, objective=objective)
    parts = [{k: v[:2] for k, v in batch.items()}, {k: v[2:] for k, v in batch.items()}]
    b = train_step(accumulated[0], parts, *accumulated[1:], grad_clip=10.0, objective=objective)
    assert a.grad_norm > 0 and math.isclose(a.loss, b.loss, rel_tol=1e-5) and math.isclose(a.grad_norm, b.grad_norm, rel_tol=1e-4)
    assert a.metrics and a.metrics == pytest.approx(b.metrics, rel=1e-5, abs=1e-7)
    for p, q in zip(whole[0].parameters(), accumulated[0].parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_ppo_experience_whitens_gae_advantages_over_the_completion_tokens(tiny_model):
    from mlplat.models import load_reward_model
    from mlplat.train.losses import local_moments
    from train_apps.ppo import PPO, PPOConfig, TokenValues

    cfg = PPOConfig(model="/m", data={"path": "/p"}, kl_coef=0.1, gamma=0.95, lam=0.9, batch_size_per_worker=4)
    algorithm = PPO(cfg, str(tiny_model))
    algorithm.critic = TokenValues(load_reward_model(tiny_model))
    batch = _ppo_batch(tiny_model)
    mask = completion_mask(batch)
    batch["ref_logprobs"] = batch["old_logprobs"] - 0.1 * mask
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    metrics = algorithm.experience(batch, scores, local_moments)
    with torch.no_grad():
        values = algorithm.critic(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])[:, :-1] * mask
    torch.testing.assert_close(batch["old_values"], values, rtol=1e-5, atol=1e-6)  # micro-batched scoring: the same values
    rewards = kl_penalised_rewards(scores, batch["old_logprobs"], batch["ref_logprobs"], mask, 0.1)
    adv, returns = gae(rewards, values, mask, 0.95, 0.9)
    torch.testing.assert_close(batch["returns"], returns)
    kept = batch["advantages"][mask]
    assert kept.mean().item() == pytest.approx(0.0, abs=1e-5) and kept.std().item() == pytest.approx(1.0, rel=1e-4)
    torch.testing.assert_close(batch["advantages"], masked_whiten(adv, mask))
    assert metrics["objective/kl"] == pytest.approx(0.1 * mask.sum(-1).float().mean().item(), rel=1e-5)  # k1 of 0.1 per token, summed per completion


def test_ppo_config_names_and_critic_source():
    from mlplat.config import validate
    from mlplat.errors import ConfigError
    from train_apps.ppo import PPOConfig

    base = {"model": "/m", "data": {"path": "/p.jsonl"}}
    cfg = validate(PPOConfig, {**base, "batch_size_per_worker": 4, "grad_accum_steps": 2, "num_mini_batches": 3})
    assert cfg.prompts_per_generation == 24 and cfg.critic_source() is None  # the policy checkpoint, with a new head
    rm = {"kind": "reward_model", "reward_model": "/rm"}
    assert validate(PPOConfig, {**base, "reward": rm}).critic_source() == "/rm"
    assert validate(PPOConfig, {**base, "reward": rm, "critic_model": "/critic"}).critic_source() == "/critic"
    with pytest.raises(ConfigError, match="several reward models"):
        validate(PPOConfig, {**base, "reward": [{**rm, "name": "a"}, {**rm, "name": "b"}]})
    with pytest.raises(ConfigError, match="distinct names"):
        validate(PPOConfig, {**base, "reward": [{"kind": "exact_match"}, {"kind": "exact_match"}]})


@pytest.mark.slow
def test_ppo_raises_the_reward_with_synced_rollouts_on_two_ranks(local_group, tmp_path, sft_model, one_digit, rl_task):
    """The PPO loop on 2 ranks under plain torch.distributed, each sampling from an in-process engine that loads the
    policy after every update (GRPO's Ray Train job with a rollout actor: the quickstart test)."""
    from mlplat.data.ingest import DataConfig
    from mlplat.rl.rollout import InProcessRollout
    from mlplat.train.checkpoint import MODEL_DIR
    from train_apps.ppo import PPOConfig, ppo_loop

    # GRPO's test's 16 prompts, each 8 times: PPO samples one completion per prompt, so each rollout (2 ranks x 64
    # prompts, the whole dataset) holds 8 of every prompt, as GRPO's groups do; before/after compare on the same prompts.
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rl_task.rows) * 8)
    cfg = PPOConfig(
        model=str(sft_model), data=DataConfig(path=str(prompts)), eval_data=str(one_digit.eval),
        max_steps=60, num_workers=2, batch_size_per_worker=32, num_mini_batches=2, num_ppo_epochs=1, max_completion_length=8,
        kl_coef=0.01, log_every=20, reward={"kind": "exact_match"},  # the critic: the policy checkpoint with a new value head
        optim={"lr": 1e-4, "warmup_steps": 0, "min_lr_ratio": 1.0}, critic_optim={"lr": 1e-3, "warmup_steps": 0, "min_lr_ratio": 1.0},
        registered_model=None,
    )  # fmt: skip
    loop = partial(ppo_loop, rollout_workers=[InProcessRollout(str(sft_model))])
    run = local_group.run(loop, cfg, tmp_path / "run", {"train": rl_task.dataset(copies=8)})
    last = run.metrics[-1]
    assert last["run/logprob_diff_max"] < 1e-4  # every rollout came from the weights just trained
    rewards = [m["reward/mean"] for m in run.metrics if "reward/mean" in m]
    after = sampled_reward(run.checkpoints[-1] / MODEL_DIR, rl_task.rows)
    # GRPO's threshold on the same prompts, steps and lr: one process gave 0.37 -> 0.55 here with this config.
    # Updates that ignore the reward leave it where it was; a flipped sign or stale rollouts push it down.
    assert after > rl_task.reward_before + 0.1, (rl_task.reward_before, after, rewards)
    assert rewards[-1] > rewards[0], rewards
    assert "eval/exact_match" in last and any("eval/exact_match_before" in m for m in run.metrics)
    assert {"objective/kl", "values/mean", "critic/loss", "critic/value_mse", "critic/clip_fraction", "clip_fraction"} <= last.keys()
    # The critic's state beside the policy's.
    assert (run.checkpoints[-1] / "critic" / "train_state.pt").is_file() and (run.checkpoints[-1] / MODEL_DIR / "model.safetensors").is_file()
