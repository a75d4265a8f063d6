"""Post-training objectives against hand-computed values, and trainer <-> rollout engine weight-sync parity."""

from __future__ import annotations

import math

import pytest
import torch

from mlplat.rl.experience import rollout_batch
from mlplat.rl.rollout import RolloutWorker, Sample
from mlplat.train.batch import IGNORE_INDEX
from mlplat.train.logprobs import install_logprob_head
from mlplat.train.losses import (
    advantages,
    bradley_terry_loss,
    clipped_surrogate,
    dpo_loss,
    k3_kl,
    summed_token_loss,
    token_loss_units,
)


def plain_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Log-probs [B, L-1] of each labelled next token from full logits (0 where unlabelled): the oracle."""
    targets = labels[:, 1:]
    picked = torch.log_softmax(logits[:, :-1].float(), dim=-1).gather(-1, targets.clamp(min=0)[..., None])[..., 0]
    return picked * (targets != IGNORE_INDEX)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def test_dpo_sigmoid_loss_matches_a_hand_computed_example():
    # beta=0.5: chosen reward 0.5 * (-1 - -2) = 0.5, rejected 0.5 * (-3 - -2) = -0.5, margin 1.
    t = torch.tensor
    losses, chosen, rejected = dpo_loss(t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0]), beta=0.5)
    assert losses.item() == pytest.approx(softplus(-1.0))  # -log sigmoid(1)
    assert chosen.item() == pytest.approx(0.5) and rejected.item() == pytest.approx(-0.5)
    smoothed, _, _ = dpo_loss(t([-1.0]), t([-3.0]), t([-2.0]), t([-2.0]), beta=0.5, label_smoothing=0.1)
    assert smoothed.item() == pytest.approx(0.9 * softplus(-1.0) + 0.1 * softplus(1.0))


@pytest.mark.parametrize("loss_type", ["sigmoid", "robust", "hinge", "ipo"])
@pytest.mark.parametrize("label_smoothing", [0.0, 0.2])
def test_dpo_loss_types_match_their_formulas(loss_type, label_smoothing):
    pc, pr, rc, rr = [-1.0, -4.0, -2.5], [-3.0, -2.0, -2.5], [-2.0, -3.0, -1.0], [-2.0, -2.5, -3.0]
    beta, eps = 0.5, label_smoothing
    expected = []
    for i in range(3):
        h = (pc[i] - rc[i]) - (pr[i] - rr[i])
        log_s, log_s_neg = -softplus(-beta * h), -softplus(beta * h)  # log sigmoid(beta h), log sigmoid(-beta h)
        expected.append({
            "sigmoid": -(1 - eps) * log_s - eps * log_s_neg,
            "robust": (-(1 - eps) * log_s + eps * log_s_neg) / (1 - 2 * eps),
            "hinge": max(0.0, 1 - beta * h),
            "ipo": (h - 1 / (2 * beta)) ** 2,
        }[loss_type])  # fmt: skip
    t = torch.tensor
    losses, chosen, rejected = dpo_loss(t(pc), t(pr), t(rc), t(rr), beta, eps, loss_type)
    assert losses.tolist() == pytest.approx(expected, rel=1e-5)
    assert chosen.tolist() == pytest.approx([beta * (a - b) for a, b in zip(pc, rc)])
    assert rejected.tolist() == pytest.approx([beta * (a - b) for a, b in zip(pr, rr)])


def test_dpo_objective_leaves_out_and_counts_pairs_truncated_to_nothing(tiny_model):
    """A pair whose rejected response max_seq_len cut away adds nothing: the loss is the other pairs' mean, and it is counted.
    IPO's log-probs are per-token means."""
    from mlplat.models import load_model, load_reward_model
    from train_apps.dpo import DPOObjective
    from train_apps.reward_model import PairwiseObjective

    g = torch.Generator().manual_seed(3)
    ids = torch.randint(8, 60, (6, 10), generator=g)  # 3 pairs: chosen rows 0-2, rejected rows 3-5
    labels = ids.clone()
    labels[:, :4] = IGNORE_INDEX
    labels[4] = IGNORE_INDEX  # pair 1's rejected response: nothing left
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}
    policy, reference = load_model(tiny_model), load_model(tiny_model).eval()
    with torch.no_grad():
        policy.model.layers[0].mlp.down_proj.weight.mul_(1.5)  # the policy differs from its reference
    for loss_type in ("sigmoid", "ipo"):
        objective = DPOObjective(reference, beta=0.5, loss_type=loss_type)
        loss, stats = objective(policy, batch)
        assert objective.units(batch).item() == 2 and int(objective.truncated.local) == 1
        with torch.no_grad():
            tokens = (labels[:, 1:] != IGNORE_INDEX).sum(-1).clamp(min=1) if loss_type == "ipo" else torch.ones(6)
            pi = plain_logprobs(policy(input_ids=ids).logits, labels).sum(-1) / tokens
            ref = plain_logprobs(reference(input_ids=ids).logits, labels).sum(-1) / tokens
        expected = 0.0
        for c, r in ((0, 3), (2, 5)):
            h = ((pi[c] - ref[c]) - (pi[r] - ref[r])).item()
            expected += softplus(-0.5 * h) if loss_type == "sigmoid" else (h - 1.0) ** 2
        assert loss.item() == pytest.approx(expected, rel=1e-4)
        assert stats["rewards/accuracies"].item() <= 2

    rm = load_reward_model(tiny_model)
    pairwise = PairwiseObjective()
    loss, _ = pairwise(rm, batch)
    with torch.no_grad():
        scores = rm(input_ids=ids, attention_mask=batch["attention_mask"]).logits[:, 0]
    assert pairwise.units(batch).item() == 2 and int(pairwise.truncated.local) == 1
    assert loss.item() == pytest.approx(sum(softplus(-(scores[c] - scores[r]).item()) for c, r in ((0, 3), (2, 5))), rel=1e-5)


def test_bradley_terry_loss_per_pair():
    losses = bradley_terry_loss(torch.tensor([2.0, 0.0]), torch.tensor([1.0, 1.0]))
    assert losses.tolist() == pytest.approx([softplus(-1.0), softplus(1.0)])


def _mean(xs):
    return sum(xs) / len(xs)


def _std(xs):  # sample std, as torch.std
    m = _mean(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


REWARDS = [1.0, 0.0, 0.0, 0.5, 1.0, 1.0, 1.0, 1.0, 0.0, 2.0, 1.0, 0.0]  # 3 prompts x G=4; the second group all equal


@pytest.mark.parametrize(("estimator", "scale"), [("group_norm", "group"), ("group_norm", "batch"), ("group_norm", "none"),
                                                  ("rloo", "group"), ("reinforce", "group"), ("reinforce_baseline", "group")])  # fmt: skip
def test_advantage_estimators_match_plain_loops(estimator, scale):
    G, eps = 4, 1e-4
    groups = [REWARDS[i : i + G] for i in range(0, len(REWARDS), G)]
    expected = []
    for group in groups:
        for i, r in enumerate(group):
            if estimator == "rloo":
                expected.append(r - sum(group[j] for j in range(G) if j != i) / (G - 1))
            elif estimator == "reinforce":
                expected.append((r - _mean(REWARDS)) / (_std(REWARDS) + eps))
            elif estimator == "reinforce_baseline" or scale == "batch":
                expected.append((r - _mean(group)) / (_std(REWARDS) + eps))
            elif scale == "group":
                expected.append((r - _mean(group)) / (_std(group) + eps))
            else:
                expected.append(r - _mean(group))
    got = advantages(torch.tensor(REWARDS), G, estimator, scale)
    assert got.tolist() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    if estimator != "reinforce":
        assert got[4:8].tolist() == [0.0] * 4  # a group of equal rewards teaches nothing


def test_batch_moments_over_ranks_are_the_whole_batchs(tmp_path, local_group):
    """Two gloo ranks holding part of the rewards each: the batch mean and std are the whole batch's, not a rank's."""
    import json

    local_group.run(_moments_on_two_ranks, None, tmp_path, {})
    whole = REWARDS + [0.0] * 4
    for rank in (0, 1):
        mean, std = json.loads((tmp_path / f"moments{rank}.json").read_text())
        assert mean == pytest.approx(_mean(whole)) and std == pytest.approx(_std(whole), rel=1e-5)


def _moments_on_two_ranks(cfg, env):
    import json

    from mlplat import collectives
    from mlplat.rl.experience import batch_moments

    rank = collectives.rank()
    mean, std = batch_moments(env.device)(torch.tensor(REWARDS[:8] if rank == 0 else REWARDS[8:] + [0.0] * 4))
    (env.storage / f"moments{rank}.json").write_text(json.dumps([mean.item(), std.item()]))


def test_clipped_surrogate_and_k3_match_plain_loops():
    old = [[-1.0, -2.0], [-1.5, -0.5]]
    new = [[-1.0 + math.log(1.5), -2.0 + math.log(0.7)], [-1.5 + math.log(1.1), -0.5 + math.log(0.5)]]
    adv, eps_low, eps_high = [1.0, -2.0], 0.2, 0.28
    loss, clipped = clipped_surrogate(torch.tensor(new), torch.tensor(old), torch.tensor(adv), eps_low, eps_high)
    for i in range(2):
        for t in range(2):
            ratio = math.exp(new[i][t] - old[i][t])
            bounded = min(max(ratio, 1 - eps_low), 1 + eps_high)
            assert loss[i, t].item() == pytest.approx(-min(ratio * adv[i], bounded * adv[i]), rel=1e-5)
            assert bool(clipped[i, t]) == (ratio * adv[i] > bounded * adv[i])
    assert clipped.tolist() == [[True, False], [False, True]]  # 1.5 > 1.28 with A > 0; 0.5 < 0.8 with A < 0
    ref = [[-1.2, -1.9], [-1.5, -1.0]]
    kl = k3_kl(torch.tensor(new), torch.tensor(ref))
    for i in range(2):
        for t in range(2):
            d = ref[i][t] - new[i][t]
            assert kl[i, t].item() == pytest.approx(math.exp(d) - d - 1, rel=1e-4, abs=1e-7)
    assert (kl >= 0).all()


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo", "bnpo"])
def test_loss_types_average_like_trl(loss_type):
    values = torch.tensor([[1.0, 2.0, 3.0], [4.0, 0.0, 0.0], [5.0, 6.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0], [1, 1, 0]], dtype=torch.bool)
    max_len = 5
    rows = [[v for v, m in zip(vr, mr) if m] for vr, mr in zip(values.tolist(), mask.tolist())]
    expected = {
        "grpo": _mean([_mean(r) for r in rows]),
        "dr_grpo": sum(map(sum, rows)) / (len(rows) * max_len),
        "dapo": sum(map(sum, rows)) / sum(map(len, rows)),
        "bnpo": sum(map(sum, rows)) / sum(map(len, rows)),
    }[loss_type]
    mean = summed_token_loss(values, mask, loss_type) / token_loss_units(mask, loss_type, max_len)
    assert mean.item() == pytest.approx(expected)


def _rollout(tiny_model, completions: int = 8):
    """A fake rollout of the tiny model: prompts of 3 tokens, completions of 1-4 tokens, rewards, old log-probs."""
    from mlplat.models import load_model

    g = torch.Generator().manual_seed(0)
    samples = [Sample([5, 6, 7], torch.randint(8, 60, (1 + i % 4,), generator=g).tolist(), [-1.0] * (1 + i % 4), "", "stop") for i in range(completions)]
    batch = {**rollout_batch(samples, pad_token_id=0), "advantages": advantages(torch.rand(completions, generator=g), 4)}
    model = load_model(tiny_model)
    with torch.no_grad():  # from full logits: the plain computation the chunked head must match
        logp = torch.log_softmax(model(input_ids=batch["input_ids"]).logits[:, :-1] / 0.7, dim=-1)
        targets = batch["labels"][:, 1:]
        old = logp.gather(-1, targets.clamp(min=0)[..., None])[..., 0] * (targets != IGNORE_INDEX)
    batch["old_logprobs"] = old + 0.05 * torch.randn(old.shape, generator=g) * (batch["labels"][:, 1:] != IGNORE_INDEX)
    batch["ref_logprobs"] = old - 0.1
    return batch


@pytest.mark.parametrize("loss_type", ["grpo", "dr_grpo", "dapo"])
def test_grpo_objective_accumulates_exactly_over_micro_batches(loss_type, tiny_model):
    """dapo, grpo and dr_grpo are means over the whole step's completions or tokens: two micro-batches of
    4 completions give the loss, statistics and update of one of 8 (bnpo is, by definition, per micro-batch)."""
    from mlplat.models import load_model
    from mlplat.rl.objectives import GRPOObjective
    from mlplat.train.optim import OptimizerConfig, build_lr_scheduler
    from mlplat.train.step import train_step
    from train_apps.grpo import GRPOConfig

    cfg = GRPOConfig(model="/m", data={"path": "/p"}, num_generations=4, loss_type=loss_type, beta=0.04, temperature=0.7,
                     epsilon_high=0.28, max_completion_length=4)  # fmt: skip
    objective, batch = GRPOObjective.from_config(cfg), _rollout(tiny_model)

    def setup():
        model = install_logprob_head(load_model(tiny_model))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        return model, optimizer, build_lr_scheduler(optimizer, OptimizerConfig(lr=0.1, warmup_steps=1), 10)

    whole, accumulated = setup(), setup()
    a = train_step(whole[0], batch, *whole[1:], grad_clip=10.0, objective=objective)
    b = train_step(accumulated[0], [{k: v[:4] for k, v in batch.items()}, {k: v[4:] for k, v in batch.items()}], *accumulated[1:],
                   grad_clip=10.0, objective=objective)  # fmt: skip
    assert math.isclose(a.loss, b.loss, rel_tol=1e-5) and math.isclose(a.grad_norm, b.grad_norm, rel_tol=1e-4)
    assert a.metrics.keys() == {"clip_fraction", "kl"} and a.metrics == pytest.approx(b.metrics, rel=1e-5, abs=1e-7)
    for p, q in zip(whole[0].parameters(), accumulated[0].parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5)


def test_grpo_objective_equals_a_plain_loop_over_completions_and_tokens(tiny_model):
    """The default loss (dapo) from the model's own log-probs, by loops: every completion token's clipped term
    plus beta * k3, over all completion tokens; log-probs at the sampling temperature."""
    from mlplat.models import load_model
    from mlplat.rl.objectives import GRPOObjective
    from train_apps.grpo import GRPOConfig

    cfg = GRPOConfig(model="/m", data={"path": "/p"}, num_generations=4, beta=0.04, temperature=0.7, epsilon_high=0.28)
    batch, model = _rollout(tiny_model), install_logprob_head(load_model(tiny_model))
    loss, _ = GRPOObjective.from_config(cfg)(model, batch)
    with torch.no_grad():  # the plain loop works from full logits (no log-prob request: the head is the plain linear layer)
        logp = torch.log_softmax(model(input_ids=batch["input_ids"]).logits.float() / 0.7, dim=-1)
    total, tokens = 0.0, 0
    for i in range(batch["input_ids"].shape[0]):
        for t in range(batch["input_ids"].shape[1] - 1):
            token = batch["labels"][i, t + 1].item()
            if token == IGNORE_INDEX:
                continue
            new, old, ref, a = logp[i, t, token].item(), batch["old_logprobs"][i, t].item(), batch["ref_logprobs"][i, t].item(), batch["advantages"][i].item()
            ratio = math.exp(new - old)
            surrogate = -min(ratio * a, min(max(ratio, 0.8), 1.28) * a)
            total += surrogate + 0.04 * (math.exp(ref - new) - (ref - new) - 1)
            tokens += 1
    assert (loss / GRPOObjective.from_config(cfg).units(batch)).item() == pytest.approx(total / tokens, rel=1e-4)


def test_rollout_batch_aligns_engine_logprobs_with_target_positions():
    batch = rollout_batch([Sample([5, 6, 7], [8, 9], [-0.1, -0.2], "", "stop"), Sample([5], [4], [-0.3], "", "length")], pad_token_id=0)
    assert batch["labels"].tolist() == [[IGNORE_INDEX] * 3 + [8, 9], [IGNORE_INDEX, 4, IGNORE_INDEX, IGNORE_INDEX, IGNORE_INDEX]]
    # target position t scores token t+1: the first completion token is predicted at len(prompt) - 1.
    torch.testing.assert_close(batch["engine_logprobs"], torch.tensor([[0, 0, -0.1, -0.2], [-0.3, 0, 0, 0]]))


def test_seeded_rollouts_draw_independently_for_identical_prompts(tiny_model):
    # One completion per prompt, the same prompt four times: seeding every request alike would give four equal samples.
    rollout = RolloutWorker(str(tiny_model), {})
    chats = [[{"role": "user", "content": "What is 12 + 34?"}]] * 4
    params = {"n": 1, "max_tokens": 12, "temperature": 1.0, "seed": 5, "ignore_eos": True}
    first = [s.completion_ids for s in rollout.generate(chats, params)]
    assert len(set(map(tuple, first))) > 1
    assert [s.completion_ids for s in rollout.generate(chats, params)] == first  # still reproducible
    # With n samples, prompt i's are seeded seed + i * n + j: prompt 1 of a call seeded 5 is prompt 0 of one seeded 7.
    two = rollout.generate(chats[:2], {**params, "n": 2})
    shifted = rollout.generate(chats[:1], {**params, "n": 2, "seed": 7})
    assert [s.completion_ids for s in two[2:]] == [s.completion_ids for s in shifted]


def test_after_a_weight_sync_the_rollout_engine_scores_tokens_like_the_trainer(tiny_model):
    from mlplat.models import load_model

    rollout = RolloutWorker(str(tiny_model), {})
    trainer = load_model(tiny_model)
    tokens = rollout.prompt_ids([{"role": "user", "content": "What is 12 + 34?"}]) + [7, 8, 9]

    def trainer_logprobs() -> torch.Tensor:
        ids = torch.tensor([tokens])
        with torch.no_grad():
            return plain_logprobs(trainer(input_ids=ids).logits, ids)[0]

    torch.testing.assert_close(torch.tensor(rollout.score(tokens)), trainer_logprobs(), atol=1e-4, rtol=0)
    # One optimizer step on the trainer: the engine is stale until the sync.
    optimizer = torch.optim.AdamW(trainer.parameters(), lr=1e-2)
    ids = torch.tensor([tokens])
    (-plain_logprobs(trainer(input_ids=ids).logits, ids).sum()).backward()
    optimizer.step()
    assert (torch.tensor(rollout.score(tokens)) - trainer_logprobs()).abs().max() > 1e-2
    assert rollout.update_weights({k: v.detach() for k, v in trainer.state_dict().items()}) > 0
    torch.testing.assert_close(torch.tensor(rollout.score(tokens)), trainer_logprobs(), atol=1e-4, rtol=0)


def test_grpo_config_refuses_rollouts_that_split_a_prompts_group():
    from mlplat.config import validate
    from mlplat.errors import ConfigError
    from train_apps.grpo import GRPOConfig

    base = {"model": "/m", "data": {"path": "/p.jsonl"}, "batch_size_per_worker": 6, "num_generations": 4}
    cfg = validate(GRPOConfig, {**base, "steps_per_generation": 2})
    assert cfg.prompts_per_generation == 3 and cfg.micro_batches_per_generation == 2
    with pytest.raises(ConfigError, match="num_generations=4 must divide"):
        validate(GRPOConfig, base)  # 6 completions per rollout: one and a half groups
    with pytest.raises(ConfigError, match="grad_accum_steps=4 must divide steps_per_generation=2"):
        validate(GRPOConfig, {**base, "steps_per_generation": 2, "grad_accum_steps": 4})


def short_answer(completion: str, row: dict) -> float:
    """A function reward for the tests below: 1 for an answer of at most 3 characters."""
    return float(len(completion.strip()) <= 3)


def test_several_reward_sources_are_summed_with_their_weights():
    from mlplat.config import validate
    from mlplat.rl.rewards import build_reward_fn, weighted_rewards
    from train_apps.grpo import GRPOConfig

    cfg = validate(GRPOConfig, {"model": "/m", "data": {"path": "/p.jsonl"}, "reward_weights": [1.0, 0.5],
                                "reward": [{"kind": "exact_match"}, {"kind": "function", "function": f"{__name__}:short_answer"}]})  # fmt: skip
    assert [r.label for r in cfg.reward] == ["exact_match", "short_answer"]
    samples = [Sample([1], [2], [0.0], text, "stop") for text in ("42", "41", "the answer is 42", "nope")]
    rows = [{"answer": "42"}] * 4
    total, each = weighted_rewards({r.label: build_reward_fn(r) for r in cfg.reward}, cfg.reward_weights, samples, rows)
    assert each["exact_match"].tolist() == [1, 0, 1, 0] and each["short_answer"].tolist() == [1, 1, 0, 0]
    assert total.tolist() == [1.5, 0.5, 1.0, 0.0]
    with pytest.raises(ValueError, match="returned"):
        weighted_rewards({"bad": lambda s, r: [1.0]}, [1.0], samples, rows)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"reward": [{"kind": "exact_match"}, {"kind": "exact_match"}]}, "distinct names"),
        ({"reward": [{"kind": "exact_match"}], "reward_weights": [1.0, 2.0]}, "2 weights for 1 reward sources"),
        ({"reward": []}, "at least one reward source"),
        ({"reward": {"kind": "function"}}, "needs reward.function"),
    ],
)
def test_grpo_config_refuses_bad_reward_sources(fields, message):
    from mlplat.config import validate
    from mlplat.errors import ConfigError
    from train_apps.grpo import GRPOConfig

    with pytest.raises(ConfigError, match=message):
        validate(GRPOConfig, {"model": "/m", "data": {"path": "/p.jsonl"}, **fields})


@pytest.mark.parametrize(("recipe", "config_name"), [("reward_model", "RewardModelConfig"), ("dpo", "DPOConfig"), ("grpo", "GRPOConfig")])
def test_a_missing_eval_file_is_an_error_before_any_run_starts(recipe, config_name, tmp_path):
    import importlib

    from mlplat.config import load_config
    from mlplat.errors import ConfigError

    module = importlib.import_module(f"train_apps.{recipe}")
    cfg = load_config(getattr(module, config_name), None, ["model=/nowhere", f"data.path={tmp_path}/d.jsonl", f"eval_data={tmp_path}/missing.jsonl"])
    run = getattr(module, f"run_{recipe}")
    with pytest.raises(ConfigError, match=f"eval_data: {tmp_path}/missing.jsonl is not a file"):
        run(cfg, tracking_uri=f"sqlite:///{tmp_path}/mlflow.db", work_dir=tmp_path)  # before /nowhere is even looked at
    assert not (tmp_path / "mlflow.db").exists()


@pytest.mark.slow  # a fresh interpreter runs the CLI end to end: `make test`, not the fast lane
def test_the_cli_prints_it_as_one_line(tmp_path):
    import subprocess

    from conftest import MLPLAT

    out = subprocess.run(
        [MLPLAT, "train", "dpo", "--set", "model=/nowhere", "--set", f"data.path={tmp_path}/d.jsonl", "--set", f"eval_data={tmp_path}/missing.jsonl"],
        check=False, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert out.returncode == 2, out.stderr
    errors = [line for line in out.stderr.splitlines() if line.startswith("mlplat: error")]
    assert errors == [f"mlplat: error: eval_data: {tmp_path}/missing.jsonl is not a file: give a held-out JSONL path, or leave eval_data unset"]
    assert "Traceback" not in out.stderr
    assert "Started a local Ray instance" not in out.stderr  # inputs are checked before a cluster starts


def test_a_lora_policy_streamed_layer_by_layer_scores_tokens_in_the_engine_like_the_trainer(tiny_model):
    """GRPO with LoRA: the weights streamed to the rollout engine (full_weights_by_layer, as sync_weights sends them)
    are the adapters merged into the base, so the engine's log-probs are the trained policy's."""
    from mlplat.models import load_model
    from mlplat.train.lora import LoRAConfig, apply_lora
    from mlplat.train.parallel import full_weights_by_layer

    rollout = RolloutWorker(str(tiny_model), {})
    policy = apply_lora(load_model(tiny_model), LoRAConfig(r=4)).eval()
    with torch.no_grad():
        for name, param in policy.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    tokens = rollout.prompt_ids([{"role": "user", "content": "What is 12 + 34?"}]) + [7, 8, 9]
    ids = torch.tensor([tokens])
    with torch.no_grad():
        trained = plain_logprobs(policy(input_ids=ids).logits, ids)[0]
    assert (torch.tensor(rollout.score(tokens)) - trained).abs().max() > 1e-2  # the engine still holds the base weights
    loaded = sum(rollout.update_weights(layer) for layer in full_weights_by_layer(policy))
    assert loaded > 0
    torch.testing.assert_close(torch.tensor(rollout.score(tokens)), trained, atol=1e-4, rtol=0)
