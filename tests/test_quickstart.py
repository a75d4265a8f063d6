"""The quickstart end to end, with its default config: what `make quickstart` runs."""

import pytest

from pipelines.quickstart import QuickstartConfig, run_quickstart


@pytest.mark.slow
def test_quickstart_raises_held_out_accuracy(ray_cluster, tracking_uri, tmp_path, capsys):
    result = run_quickstart(QuickstartConfig(workdir=str(tmp_path / "quickstart")))
    # A random model scores ~0; a broken pipeline (labels on the prompt, no gradient
    # sync, wrong answers in the data) cannot reach this margin.
    assert result.accuracy_before < 0.05
    assert result.accuracy_after >= result.accuracy_before + 0.3, result
    assert result.final_loss < result.first_loss
    # The registered version, served PD-disaggregated, answers as offline generation did.
    assert len(result.served_answers) == 3
    assert [a["answer"] for a in result.served_answers] == [s["completion"] for s in result.eval_samples[:3]]
    out = capsys.readouterr().out
    assert result.run_id in out and "mlflow ui --backend-store-uri" in out and "after" in out
