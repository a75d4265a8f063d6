"""Policy objectives of the online RL recipes, here rather than in ``train_apps`` so that a Ray-free caller
(the prepared GPU check, mlplat.gpucheck) runs the same loss as the recipe."""

from __future__ import annotations

import torch

from mlplat.rl.experience import completion_mask
from mlplat.train.logprobs import labelled_logprobs
from mlplat.train.losses import LossType, clipped_surrogate, k3_kl, summed_token_loss, token_loss_units


class GRPOObjective:
    """The clipped policy gradient (+ beta k3 KL) on a micro-batch of completions, averaged by ``loss_type``.

    The batch carries each row's ``advantages``, ``old_logprobs`` and, with beta > 0, ``ref_logprobs``."""

    def __init__(self, temperature: float, loss_type: LossType, max_completion_length: int, epsilon: float,
                 epsilon_high: float | None = None, beta: float = 0.0):  # fmt: skip
        self.temperature, self.loss_type, self.max_completion_length = temperature, loss_type, max_completion_length
        self.epsilon, self.epsilon_high, self.beta = epsilon, epsilon_high, beta

    @classmethod
    def from_config(cls, cfg) -> GRPOObjective:
        """From a config with GRPO's fields (train_apps.grpo.GRPOConfig)."""
        return cls(cfg.temperature, cfg.loss_type, cfg.max_completion_length, cfg.epsilon, cfg.epsilon_high, cfg.beta)

    def units(self, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        return token_loss_units(completion_mask(batch), self.loss_type, self.max_completion_length)

    def __call__(self, policy, batch: dict[str, torch.Tensor]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        mask = completion_mask(batch)
        logprobs = labelled_logprobs(policy, batch, self.temperature)
        per_token, clipped = clipped_surrogate(logprobs, batch["old_logprobs"], batch["advantages"], self.epsilon, self.epsilon_high)
        stats = {"clip_fraction": summed_token_loss(clipped.float(), mask, self.loss_type)}
        if self.beta > 0:
            kl = k3_kl(logprobs, batch["ref_logprobs"])
            per_token = per_token + self.beta * kl
            stats["kl"] = summed_token_loss(kl.detach(), mask, self.loss_type)
        return summed_token_loss(per_token, mask, self.loss_type), stats
