"""Online RL building blocks: rollout actors over the native engine, and reward sources."""

from mlplat.rl.rewards import RewardConfig, RewardModelScorer, build_reward_fn
from mlplat.rl.rollout import RolloutConfig, RolloutWorker, Sample

__all__ = ["RewardConfig", "RewardModelScorer", "RolloutConfig", "RolloutWorker", "Sample", "build_reward_fn"]
