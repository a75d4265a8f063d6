"""Post-training objectives, named and parameterised the way TRL / OpenRLHF users know them.

- ``bradley_terry_loss``: reward model, -log sigmoid(r_chosen - r_rejected).
- ``dpo_loss``: Rafailov et al. 2023, sigmoid loss with conservative label smoothing (cDPO).
- ``group_advantages`` + ``grpo_loss``: Shao et al. 2024 (DeepSeekMath): rewards normalised
  within each prompt's group of samples, the PPO clipped surrogate, and a KL penalty to the
  reference model with the k3 estimator (Schulman 2020), averaged over tokens (not
  sequences: long answers are not down-weighted, as in DAPO).

Preference losses are per pair (a step sums and averages them over the global batch, mlplat.train.step);
GRPO's returns its loss and the statistics a run logs, detached.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from mlplat.train.batch import IGNORE_INDEX


def token_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each next token under ``logits`` ([B, L, V] -> [B, L-1]) and the mask of labelled ones."""
    targets = labels[:, 1:]
    mask = targets != IGNORE_INDEX
    logprobs = torch.log_softmax(logits[:, :-1].float(), dim=-1)
    picked = logprobs.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return picked * mask, mask


def sequence_logprobs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Summed log-prob of each row's labelled tokens: log pi(response | prompt), [B]."""
    picked, _ = token_logprobs(logits, labels)
    return picked.sum(-1)


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """Per-pair -log sigmoid(r_c - r_r) [B] (a sum over pairs is what an optimizer step averages)."""
    return -F.logsigmoid(chosen - rejected)


def dpo_loss(
    policy_chosen: torch.Tensor,
    policy_rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    beta: float,
    label_smoothing: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """DPO's sigmoid loss from summed sequence log-probs [B] of policy and reference: per-pair losses
    and the implicit rewards of both sides, beta * (log pi - log pi_ref), each [B] (as TRL's ``dpo_loss``).

    ``label_smoothing`` is the assumed probability that a pair's preference label is flipped (0: plain DPO).
    """
    chosen_rewards = beta * (policy_chosen - ref_chosen)
    rejected_rewards = beta * (policy_rejected - ref_rejected)
    logits = chosen_rewards - rejected_rewards
    losses = -(1 - label_smoothing) * F.logsigmoid(logits) - label_smoothing * F.logsigmoid(-logits)
    return losses, chosen_rewards.detach(), rejected_rewards.detach()


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6, scale: bool = True) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps); rows are grouped consecutively by prompt.

    A group whose samples all got the same reward has advantage 0: it teaches nothing.
    ``scale=False`` keeps only the mean baseline (Dr. GRPO), avoiding the bias toward
    groups of near-equal rewards.
    """
    assert rewards.numel() % group_size == 0, "rewards must come in whole groups"
    grouped = rewards.view(-1, group_size)
    centered = grouped - grouped.mean(dim=1, keepdim=True)
    if scale:
        centered = centered / (grouped.std(dim=1, keepdim=True) + eps)
    return centered.reshape(-1)


def grpo_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    clip_ratio: float,
    ref_logprobs: torch.Tensor | None = None,
    kl_coef: float = 0.0,
    num_tokens: torch.Tensor | float | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Clipped policy-gradient loss plus kl_coef * KL(pi || pi_ref), summed over tokens / ``num_tokens``.

    ``logprobs``/``old_logprobs``/``ref_logprobs``/``mask`` are per token [B, T]; ``advantages``
    per sequence [B]. ``num_tokens`` defaults to this batch's response tokens; pass the
    global count (all ranks and micro-batches) so the average is over every token once.
    """
    mask = mask.float()
    num_tokens = mask.sum().clamp(min=1) if num_tokens is None else num_tokens
    ratio = torch.exp(logprobs - old_logprobs)
    adv = advantages[:, None]
    unclipped, clipped = ratio * adv, ratio.clamp(1 - clip_ratio, 1 + clip_ratio) * adv
    per_token = -torch.minimum(unclipped, clipped)
    stats = {"clip_fraction": (((unclipped > clipped).float() * mask).sum() / mask.sum().clamp(min=1)).item()}
    if ref_logprobs is not None and kl_coef > 0:
        log_ratio = ref_logprobs - logprobs
        kl = torch.exp(log_ratio) - log_ratio - 1  # k3: unbiased, always >= 0
        per_token = per_token + kl_coef * kl
        stats["kl"] = ((kl * mask).sum() / mask.sum().clamp(min=1)).item()
    loss = (per_token * mask).sum() / num_tokens
    return loss, stats
