"""The driver every online RL recipe shares: one MLflow run, the prompt rows through Ray Data, the rollout
actors and reward-model actors started beside the Ray Train job and killed after it, the final policy
registered, and what the run logged read back for the caller."""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import ray
from pydantic import BaseModel

from mlplat.data.rl_prompts import prepare_rl_prompt_dataset
from mlplat.rl.loop import RLConfig
from mlplat.rl.rewards import start_reward_model
from mlplat.rl.rollout import start_rollout_workers
from mlplat.tracking import ModelRef, resolve_model
from mlplat.train.recipe import RecipeRun


class RLRunResult(BaseModel):
    run_id: str
    model_dir: str
    model_version: ModelRef | None
    rewards: list[float]  # mean reward (the reward sources' weighted sum) per log window, in order
    eval_before: float | None  # held-out exact match (greedy) of the starting model
    eval_after: float | None
    max_logprob_diff: float  # largest |trainer - rollout engine| log-prob seen on sampled tokens, whole run


Resolve = Callable[[str], Path]  # a model reference (path, models:/name@alias) -> a local directory


def run_rl(recipe: str, cfg: RLConfig, loop: Callable, tracking_uri: str | None, work_dir: str | Path,
           setup: Callable[[RecipeRun, Resolve], dict[str, Any]] | None = None) -> RLRunResult:  # fmt: skip
    """Run ``loop`` (the recipe's ``rl_loop``) on the connected Ray cluster; ``setup(run, resolve)`` returns the
    recipe's own extra arguments for it (PPO's critic)."""
    run = RecipeRun(recipe, cfg, tracking_uri, work_dir)
    resolve = partial(resolve_model, download_dir=run.work_dir / "downloads", tracking_uri=run.tracking_uri)
    rollout_workers, scorers = [], {}
    try:
        with run.tracked():
            dataset, data_report = prepare_rl_prompt_dataset(cfg.data, rejects_dir=run.work_dir / run.run_id)
            run.log_data_report(data_report)
            extra = setup(run, resolve) if setup else {}
            rollout_workers = start_rollout_workers(str(run.model_dir), cfg.rollout)
            for source in cfg.reward:
                if source.kind == "reward_model":
                    scorers[source.label] = start_reward_model(source, str(resolve(source.reward_model)))
            result = run.fit(loop, {"train": dataset}, extra={"rollout_workers": rollout_workers, "reward_scorers": scorers, **extra})
            final_dir, version = run.finish(result)
    finally:
        for actor in [*rollout_workers, *scorers.values()]:
            ray.kill(actor)
    client = run.logger.client
    rewards = sorted(client.get_metric_history(run.run_id, "reward/mean"), key=lambda m: m.step)
    metrics = client.get_run(run.run_id).data.metrics
    return RLRunResult(
        run_id=run.run_id,
        model_dir=str(final_dir),
        model_version=version,
        rewards=[m.value for m in rewards],
        eval_before=metrics.get("eval/exact_match_before"),
        eval_after=metrics.get("eval/exact_match"),
        max_logprob_diff=metrics["run/logprob_diff_max"],
    )
