"""Post-training objectives, named and parameterised the way TRL / OpenRLHF users know them.

- ``bradley_terry_loss``: reward model, -log sigmoid(r_chosen - r_rejected).
- ``dpo_loss``: DPO (Rafailov et al. 2023) and its variants by TRL's ``loss_type``: sigmoid (cDPO), robust, hinge, IPO.
- ``advantages``: GRPO's group-normalised rewards (Shao et al. 2024), RLOO's leave-one-out baseline
  and REINFORCE++'s batch-normalised ones (OpenRLHF's ``advantage_estimator`` names).
- ``clipped_surrogate`` + ``k3_kl``: the PPO clipped policy gradient (with DAPO's clip-higher) and
  the k3 KL to a reference model (Schulman 2020), per token; ``token_loss_units`` and
  ``summed_token_loss`` average them over completions, tokens or micro-batches by TRL's ``loss_type``.
- ``kl_penalised_rewards``, ``gae``, ``masked_whiten``, ``clipped_value_loss``: PPO with a critic (TRL's PPOTrainer):
  per-token rewards, generalised advantage estimation and the clipped value loss.

Every loss here is summed over its units (pairs, completions, tokens): a step sums and averages it
over the global batch (mlplat.train.step).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per-pair -log sigmoid(r_c - r_r) [B] (a sum over pairs is what an optimizer step averages)."""
    return -F.logsigmoid(chosen - rejected)


DPOLossType = Literal["sigmoid", "ipo", "hinge", "robust"]


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
    loss_type: DPOLossType = "sigmoid",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's per-pair losses [B] from sequence log-probs [B] of policy and reference, and the implicit
    rewards of both sides, beta * (log pi - log pi_ref), each [B] (TRL's ``dpo_loss`` and ``loss_type``).

    With h = (log pi - log pi_ref)(chosen) - (log pi - log pi_ref)(rejected) and eps = ``label_smoothing``
    (the assumed probability that a pair's label is flipped):
    - ``sigmoid`` (Rafailov et al. 2023; cDPO with eps > 0): -(1 - eps) log s(beta h) - eps log s(-beta h);
    - ``robust`` (Chowdhury et al. 2024): (-(1 - eps) log s(beta h) + eps log s(-beta h)) / (1 - 2 eps);
    - ``hinge`` (SLiC, Zhao et al. 2023): max(0, 1 - beta h);
    - ``ipo`` (Azar et al. 2023): (h - 1 / (2 beta))^2, on per-token mean log-probs (the caller's to pass).
    """
    chosen_rewards = beta * (policy_chosen - ref_chosen)
    rejected_rewards = beta * (policy_rejected - ref_rejected)
    h = (policy_chosen - ref_chosen) - (policy_rejected - ref_rejected)
    if loss_type == "sigmoid":
        losses = -(1 - label_smoothing) * F.logsigmoid(beta * h) - label_smoothing * F.logsigmoid(-beta * h)
    elif loss_type == "robust":
        losses = (-(1 - label_smoothing) * F.logsigmoid(beta * h) + label_smoothing * F.logsigmoid(-beta * h)) / (1 - 2 * label_smoothing)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        losses = (h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss_type {loss_type!r}")
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


AdvantageEstimator = Literal["group_norm", "rloo", "reinforce", "reinforce_baseline"]
ScaleRewards = Literal["group", "batch", "none"]
LossType = Literal["grpo", "dr_grpo", "dapo", "bnpo"]
Moments = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # values -> (mean, std) over the whole batch


def local_moments(values: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return values.mean(), values.std()


def advantages(
    rewards: torch.Tensor,
    num_generations: int,
    estimator: AdvantageEstimator = "group_norm",
    scale_rewards: ScaleRewards = "group",
    batch_moments: Moments = local_moments,
    eps: float = 1e-4,
) -> torch.Tensor:
    """Per-completion advantages from rewards [N]; completions come in consecutive groups of one prompt.

    - ``group_norm`` (GRPO): r - mean of its group, divided by the group's std (``scale_rewards="group"``),
      the whole batch's std (``"batch"``) or nothing (``"none"``, Dr. GRPO);
    - ``rloo``: r_i - mean of the other G-1 rewards of its group (leave-one-out baseline, no scaling);
    - ``reinforce`` (REINFORCE++): (r - batch mean) / batch std, no per-group baseline;
    - ``reinforce_baseline`` (REINFORCE++-baseline): r - mean of its group, divided by the batch's std.

    "Batch" means every rank's completions of the step: ``batch_moments`` gives their mean and std
    (a collective in the recipe; local by default). A group whose rewards are all equal gets 0 from
    every estimator but ``reinforce``.
    """
    assert rewards.numel() % num_generations == 0, "rewards must come in whole groups"
    grouped = rewards.view(-1, num_generations)
    group_mean = grouped.mean(dim=1, keepdim=True)
    if estimator == "rloo":
        assert num_generations > 1, "rloo needs at least 2 completions per prompt"
        return (grouped - (grouped.sum(dim=1, keepdim=True) - grouped) / (num_generations - 1)).reshape(-1)
    if estimator == "reinforce":
        mean, std = batch_moments(rewards)
        return (rewards - mean) / (std + eps)
    centered = (grouped - group_mean).reshape(-1)
    if estimator == "reinforce_baseline" or scale_rewards == "batch":
        return centered / (batch_moments(rewards)[1] + eps)
    if scale_rewards == "group":
        return centered / (grouped.std(dim=1, keepdim=True).expand_as(grouped).reshape(-1) + eps)
    return centered


def clipped_surrogate(
    logprobs: torch.Tensor, old_logprobs: torch.Tensor, advantages: torch.Tensor, epsilon: float, epsilon_high: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped policy-gradient loss per token [B, T] and where the clip bound it (bool [B, T]).

    ``advantages`` are per completion [B]; the ratio is clipped to [1 - epsilon, 1 + epsilon_high]
    (``epsilon_high`` defaults to ``epsilon``; higher is DAPO's clip-higher)."""
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    unclipped = ratio * adv
    clipped = ratio.clamp(1 - epsilon, 1 + (epsilon if epsilon_high is None else epsilon_high)) * adv
    return -torch.minimum(unclipped, clipped), unclipped > clipped


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """KL(pi || pi_ref) per token with the k3 estimator (Schulman 2020): unbiased and never negative."""
    log_ratio = ref_logprobs - logprobs
    return torch.exp(log_ratio) - log_ratio - 1


def token_loss_units(mask: torch.Tensor, loss_type: LossType, max_completion_length: int) -> torch.Tensor:
    """What ``loss_type`` averages a micro-batch's summed token loss over (a step divides by the global total):
    completions (``grpo``), completions x max_completion_length (``dr_grpo``), completion tokens (``dapo``),
    or one per micro-batch (``bnpo``: each micro-batch's own token mean, then the mean of those)."""
    rows = torch.tensor(mask.shape[0], device=mask.device)
    return {"grpo": rows, "dr_grpo": rows * max_completion_length, "dapo": mask.sum(), "bnpo": torch.ones((), device=mask.device)}[loss_type]


def summed_token_loss(values: torch.Tensor, mask: torch.Tensor, loss_type: LossType) -> torch.Tensor:
    """A micro-batch's per-token ``values`` [B, T] summed the way ``loss_type`` averages them over its units:
    per-completion token means summed (``grpo``), the token sum (``dr_grpo``, ``dapo``), or the token mean (``bnpo``)."""
    mask = mask.to(values.dtype)
    if loss_type == "grpo":
        return ((values * mask).sum(-1) / mask.sum(-1).clamp(min=1)).sum()
    if loss_type == "bnpo":
        return (values * mask).sum() / mask.sum().clamp(min=1)
    return (values * mask).sum()


# PPO with a learned critic (Ouyang et al. 2022; TRL's PPOTrainer, OpenRLHF's names): per-token rewards, GAE, the clipped value loss.


def masked_whiten(values: torch.Tensor, mask: torch.Tensor, batch_moments: Moments | None = None, shift_mean: bool = True, eps: float = 1e-8) -> torch.Tensor:
    """``values`` [B, T] standardised over the positions in ``mask`` (TRL's ``masked_whiten``): (v - mean) / std, or
    with ``shift_mean=False`` (v - mean) / std + mean (scaled, the mean kept). ``batch_moments`` gives the
    mean and (sample) std of the masked values over every rank (default: this batch's); 0 outside the mask."""
    mask = mask.bool()
    mean, std = (batch_moments or local_moments)(values[mask])
    whitened = (values - mean) * torch.rsqrt(std * std + eps)
    return (whitened if shift_mean else whitened + mean) * mask


def kl_penalised_rewards(scores: torch.Tensor, logprobs: torch.Tensor, ref_logprobs: torch.Tensor, mask: torch.Tensor, kl_coef: float) -> torch.Tensor:
    """PPO's per-token rewards [B, T] (TRL's PPOTrainer): -kl_coef (log pi_old - log pi_ref) on every completion token
    (the k1 estimate of the KL to the reference), plus the sequence's score [B] on its last completion token."""
    rewards = -kl_coef * (logprobs - ref_logprobs) * mask
    has_tokens = mask.any(-1)
    last = (mask.long() * torch.arange(mask.shape[-1], device=mask.device)).argmax(-1)  # the last True per row
    rows = has_tokens.nonzero().squeeze(-1)
    rewards[rows, last[rows]] += scores[rows].to(rewards.dtype)
    return rewards


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation (Schulman et al. 2016) per token: (advantages, returns) [B, T].

    delta_t = r_t + gamma V_{t+1} - V_t; A_t = delta_t + gamma lam A_{t+1}; returns = A + V. Positions outside
    ``mask`` (prompt, padding) count as neither reward nor value, so each completion ends at its last token
    (V after it = 0) and its advantages are 0 elsewhere. Completions are contiguous runs of ``mask``."""
    mask = mask.to(values.dtype)
    rewards, values = rewards * mask, values * mask
    advantages = torch.zeros_like(values)
    next_value = torch.zeros_like(values[:, 0])
    next_advantage = torch.zeros_like(values[:, 0])
    for t in reversed(range(values.shape[1])):
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        advantages[:, t] = (delta + gamma * lam * next_advantage) * mask[:, t]
        next_value, next_advantage = values[:, t], advantages[:, t]
    return advantages, (advantages + values) * mask


def clipped_value_loss(values: torch.Tensor, old_values: torch.Tensor, returns: torch.Tensor, cliprange_value: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss per token [B, T], 0.5 max((V - R)^2, (V_clip - R)^2) with V_clip = old V +- cliprange_value
    (TRL's ``vf_loss`` before its mean), and where the clipped term was the larger (bool [B, T], TRL's ``vf_clipfrac``)."""
    clipped_values = old_values + (values - old_values).clamp(-cliprange_value, cliprange_value)
    unclipped, clipped = (values - returns) ** 2, (clipped_values - returns) ** 2
    return 0.5 * torch.maximum(unclipped, clipped), clipped > unclipped
