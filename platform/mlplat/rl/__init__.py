"""Online RL building blocks: rollout actors over the native engine, and reward sources.

Exports resolve on first use, so the pure parts (``mlplat.rl.experience``, ``Sample``) import without
Ray: the prepared GPU check (mlplat.gpucheck) runs a GRPO step on a machine that has no Ray.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "RewardConfig": "mlplat.rl.rewards", "RewardModelScorer": "mlplat.rl.rewards", "build_reward_fn": "mlplat.rl.rewards",
    "RolloutConfig": "mlplat.rl.rollout", "RolloutWorker": "mlplat.rl.rollout", "Sample": "mlplat.rl.rollout",
}  # fmt: skip
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'mlplat.rl' has no attribute {name!r}")
    return getattr(importlib.import_module(_EXPORTS[name]), name)
