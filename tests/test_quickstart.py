"""The quickstart end to end: the same pipeline `make quickstart` runs, on the one-digit task.

The default config (3-digit sums, 1000 SFT steps) would take ~10 of the suite's minutes; its
accuracy is what `make quickstart` prints, checked from a fresh clone before the README quotes
it. Here the same steps run on one-digit sums, which the same model learns in a quarter of the
steps, so every assertion keeps its margin.
"""

import pytest

from mlplat.data.demo import DemoDataConfig
from mlplat.train.optim import OptimizerConfig
from pipelines.quickstart import QuickstartConfig, run_quickstart

ONE_DIGIT = dict(
    data=DemoDataConfig(max_digits=1, sft_rows=4000, eval_rows=30, preference_rows=100, rl_rows=400),
    max_steps=150,  # 63-67% held-out exact match here (30 prompts, by machine), from 0%
    optim=OptimizerConfig(lr=1e-3, warmup_steps=30),
    eval_limit=30,
    grpo_steps=4,  # two rollouts: the second samples from weights synced after two optimizer steps
)


@pytest.mark.slow
def test_quickstart_raises_held_out_accuracy(ray_cluster, tracking_uri, tmp_path, capsys):
    result = run_quickstart(QuickstartConfig(workdir=str(tmp_path / "quickstart"), **ONE_DIGIT))
    # A random model scores ~0; a broken pipeline (labels on the prompt, no gradient
    # sync, wrong answers in the data) cannot reach this margin.
    assert result.accuracy_before < 0.05
    assert result.accuracy_after >= result.accuracy_before + 0.3, result
    assert result.accuracy_grpo is not None  # post-training ran and was evaluated
    # GRPO's rollout actor sampled from the weights each step had just trained (Ray's object store carried them).
    assert result.grpo_max_logprob_diff < 1e-4
    assert result.final_loss < result.first_loss
    # The registered version, served PD-disaggregated, answers as offline generation did.
    assert len(result.served_answers) == 3
    assert [a["answer"] for a in result.served_answers] == [s["completion"] for s in result.eval_samples[:3]]
    out = capsys.readouterr().out
    assert result.run_id in out and "mlflow ui --backend-store-uri" in out and "after" in out


def test_default_config_is_the_documented_one():
    # What `make quickstart` runs and the README's numbers describe: 3-digit sums, 1000 steps, then GRPO.
    cfg = QuickstartConfig()
    assert (cfg.data.max_digits, cfg.max_steps, cfg.num_workers, cfg.batch_size_per_worker) == (3, 1000, 2, 32)
    assert cfg.grpo_steps > 0 and cfg.serve
