"""Pipeline SDK: the DAG is validated before anything runs; runs on the session Ray cluster
retry, time out, fail with the step's name, and resume from the cache."""

import json

import pytest
from mlflow.tracking import MlflowClient

from mlplat.cli import main as cli_main
from mlplat.data.demo import DemoDataConfig
from mlplat.errors import ConfigError
from mlplat.pipeline import Dataset, PipelineDefinitionError, PipelineError, pipeline, step
from mlplat.pipeline.definition import load_pipeline
from mlplat.pipeline.executor import cache_key
from mlplat.pipeline.graph import Graph
from mlplat.pipeline.steps import code_hash

DEMO_DATA = DemoDataConfig()


@step
def load(rows: int) -> dict:
    return {"rows": rows}


@step(num_cpus=2)
def train(data: dict, lr: float = 1e-3) -> dict:
    return {"loss": 1.0}


@step(num_gpus=1, resources={"rdma": 1}, launches={"CPU": 4})
def evaluate(model: dict, data: dict) -> float:
    return 0.5


def test_definition_errors_are_caught_before_anything_runs():
    @pipeline
    def missing_input():
        train()

    with pytest.raises(PipelineDefinitionError, match="step 'train': missing a required argument: 'data'"):
        missing_input.build()

    @pipeline
    def unserialisable():
        train(load(1), lr=lambda: 0)

    with pytest.raises(PipelineDefinitionError, match="step 'train': argument 'lr' is a function, which cannot be serialised"):
        unserialisable.build()

    @pipeline
    def cycle():
        data = load(1)
        model = train(data)
        data.after(model)

    with pytest.raises(PipelineDefinitionError, match="has a cycle: (load -> train -> load|train -> load -> train)"):
        cycle.build()

    @pipeline
    def branches_on_output():
        if load(1)["rows"]:
            train({})

    with pytest.raises(PipelineDefinitionError, match="is not known while the pipeline is defined"):
        branches_on_output.build()

    with pytest.raises(ConfigError, match=r"@step of .*: retries: Input should be greater than or equal to 0"):
        step(retries=-1)(lambda: None)


def test_parameters_are_typed_and_unknown_ones_refused():
    @pipeline
    def demo(rows: int, data: DemoDataConfig = DEMO_DATA):
        return load(rows)

    graph = demo.build(overrides=["rows=7", "data.sft_rows=100"])
    assert graph.params["rows"] == 7 and graph.params["data"].sft_rows == 100
    assert graph.nodes["load"].arguments() == {"rows": 7}
    with pytest.raises(ConfigError, match="unknown parameter 'rosw' \\(parameters: rows, data\\)"):
        demo.build(overrides=["rosw=7"])
    with pytest.raises(ConfigError, match="missing parameter 'rows'"):
        demo.build()
    with pytest.raises(ConfigError, match="parameter: rows: Input should be a valid integer"):
        demo.build(overrides=["rows=many"])
    with pytest.raises(ConfigError, match="parameter: data.sft_rowz: unknown field"):
        demo.build(overrides=["rows=1", "data.sft_rowz=1"])


def test_peak_resources_sum_only_steps_that_can_run_together():
    @pipeline
    def chain():
        data = load(1)
        evaluate(train(data), data)

    # A chain holds its largest step at a time; evaluate's GPU, rdma and the 4 CPUs it launches included.
    assert chain.build().peak_resources() == {"CPU": 5, "GPU": 1, "rdma": 1}

    @pipeline
    def fan_out():
        data = load(1)
        train(data)
        train(data, lr=1e-4)

    assert fan_out.build().peak_resources() == {"CPU": 4}  # the two trains at once


def test_cache_key_follows_code_and_inputs_not_decorators_or_comments():
    def f(x):
        return x + 1

    def f_commented(x):
        # a comment changes nothing
        return x + 1

    def f_changed(x):
        return x + 2

    f_commented.__name__ = f_changed.__name__ = "f"
    assert code_hash(f) != code_hash(f_changed)
    assert step(retries=3)(f).code_hash == step(f).code_hash

    graph = Graph("p", {})
    node = graph.nodes[graph.add(train, ({"rows": 1},), {})._node]
    assert cache_key(node, {"data": {"rows": 1}}) == cache_key(node, {"data": {"rows": 1}})
    assert cache_key(node, {"data": {"rows": 1}}) != cache_key(node, {"data": {"rows": 2}})
    assert cache_key(node, {"data": Dataset("runs:/a/x")}) != cache_key(node, {"data": Dataset("runs:/b/x")})
    bumped = Graph("p", {})
    bumped_node = bumped.nodes[bumped.add(train.options(version="2"), ({"rows": 1},), {})._node]
    assert cache_key(bumped_node, {"data": {"rows": 1}}) != cache_key(node, {"data": {"rows": 1}})


PIPELINE_FILE = '''
import json
import time
from pathlib import Path

from mlplat.pipeline import Dataset, pipeline, step, step_context


def bump(counter: str) -> int:
    path = Path(counter)
    count = int(path.read_text()) + 1 if path.exists() else 1
    path.write_text(str(count))
    return count


@step(num_cpus=0.5)
def make_rows(n: int, counter: str) -> Dataset:
    bump(counter)
    out = Path(step_context().workdir) / "rows"
    out.mkdir(parents=True)
    (out / "rows.jsonl").write_text("".join(json.dumps({"x": i}) + "\\n" for i in range(n)))
    return Dataset(out)


@step(num_cpus=0.5, retries=1, retry_backoff_s=0.1)
def total(rows: Dataset, fixed: str) -> int:
    if not Path(fixed).exists():
        raise ValueError("the data looks wrong")
    return sum(json.loads(line)["x"] for line in (rows.local_path() / "rows.jsonl").read_text().splitlines())


@step(num_cpus=0.5)
def report(total: int) -> str:
    return f"total={total}"


@step(num_cpus=0.5, timeout_s=3)
def hang() -> None:
    time.sleep(600)


@pipeline(experiment="resume")
def resume(n: int, counter: str, fixed: str):
    return report(total(make_rows(n, counter), fixed))


@pipeline(experiment="resume")
def stuck():
    hang()
'''


@pytest.mark.slow
def test_failed_step_names_itself_and_a_rerun_resumes_from_it(ray_cluster, tracking_uri, tmp_path, capsys):
    file = tmp_path / "resume_pipeline.py"
    file.write_text(PIPELINE_FILE)
    counter, fixed = tmp_path / "counter", tmp_path / "fixed"
    resume = load_pipeline(file, "resume")
    params = {"n": 5, "counter": str(counter), "fixed": str(fixed)}

    with pytest.raises(PipelineError) as failure:
        resume.run(params, workdir=tmp_path / "work")
    message = str(failure.value)
    assert "step 'total' raised ValueError: the data looks wrong (2 attempts" in message and "resumes here" in message
    assert "\n" not in message

    client = MlflowClient(tracking_uri)
    experiment = client.get_experiment_by_name("resume").experiment_id
    runs = {r.data.tags.get("mlplat.step", "<pipeline>"): r for r in client.search_runs([experiment])}
    assert runs["<pipeline>"].info.status == "FAILED" and runs["total"].info.status == "FAILED"
    assert runs["make_rows"].info.status == "FINISHED" and "report" not in runs
    assert runs["total"].data.tags["mlplat.error"] == "ValueError: the data looks wrong"
    assert runs["total"].data.tags["mlflow.parentRunId"] == runs["<pipeline>"].info.run_id
    # Lineage: the dataset went in as the URI of make_rows' artifact, not a pickled blob.
    rows_uri = f"runs:/{runs['make_rows'].info.run_id}/outputs/output"
    assert json.loads(runs["total"].data.params["input.rows"])["uri"] == rows_uri

    fixed.touch()
    result = resume.run(params, workdir=tmp_path / "work")
    assert result.outputs == "total=10"
    assert counter.read_text() == "1"  # make_rows ran once: the rerun reused it
    assert [result.steps[s].status for s in ("make_rows", "total", "report")] == ["cached", "succeeded", "succeeded"]
    assert result.steps["make_rows"].cached_from == runs["make_rows"].info.run_id

    # A step past its timeout is cancelled and fails the pipeline with that as its error.
    with pytest.raises(PipelineError, match="step 'hang' raised TimeoutError: timed out after 3s"):
        load_pipeline(file, "stuck").run(workdir=tmp_path / "work")
    err = capsys.readouterr().err  # the executor's lines are status, on stderr; stdout is for results
    assert "total: attempt 1 failed: ValueError: the data looks wrong; retrying in 0.1s" in err
    assert "make_rows: cached" in err


def test_cli_errors_are_one_line(tmp_path, monkeypatch, capsys):
    for var in ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "RAY_ADDRESS"):
        monkeypatch.delenv(var, raising=False)
    broken = tmp_path / "broken_pipeline.py"
    broken.write_text("from mlplat.pipeline import pipeline\n\n@pipeline\ndef p(:\n    pass\n")
    good = tmp_path / "good_pipeline.py"
    good.write_text("from mlplat.pipeline import pipeline, step\n\n@step\ndef s(n: int):\n    return n\n\n"
                    "@pipeline\ndef good(n: int = 1):\n    return s(n)\n")
    cases = {
        "broken_pipeline.py:4: syntax error": ["run", str(broken)],
        "no_such.py: pipeline file not found": ["run", str(tmp_path / "no_such.py")],
        "unknown parameter 'm' (parameters: n)": ["run", str(good), "--param", "m=2"],
        "cannot reach the Ray Jobs API at http://127.0.0.1:9": ["submit", str(good), "--address", "127.0.0.1:9", "--working-dir", str(tmp_path)],
    }
    for expected, argv in cases.items():
        with pytest.raises(SystemExit) as exit_:
            cli_main(argv)
        err = capsys.readouterr().err
        assert exit_.value.code == 2, err
        assert err.startswith("mlplat: error: ") and err.count("\n") == 1 and expected in err, err


def test_shipped_tenants_file_validates():
    from conftest import REPO_ROOT

    from mlplat.config import load_config
    from mlplat.pipeline.tenants import TenantsConfig

    tenants = load_config(TenantsConfig, REPO_ROOT / "cluster_configs" / "tenants.yaml").tenants
    assert tenants and all(q.cpus is None or q.cpus > 0 for q in tenants.values())


def test_preference_pipeline_trains_sft_unless_given_a_policy():
    from pipelines.preference import preference

    assert set(preference.build().nodes) == {"demo_data", "tiny_model", "sft", "reward_model", "dpo", "eval_sft", "eval_dpo"}
    given = preference.build(overrides=["cfg.policy=models:/quickstart-tiny@quickstart"])
    assert set(given.nodes) == {"demo_data", "reward_model", "dpo", "eval_sft", "eval_dpo"}
    assert given.nodes["dpo"].arguments()["policy"].uri == "models:/quickstart-tiny@quickstart"


def test_the_readmes_pipeline_snippet_runs(ray_cluster, tracking_uri, tmp_path):
    from conftest import readme_snippet

    (tmp_path / "demo.py").write_text(readme_snippet("python", "@pipeline"))
    result = load_pipeline(tmp_path / "demo.py", "demo").run({"rows": 10}, workdir=tmp_path / "work")
    assert result.outputs == 10
    assert readme_snippet("bash", "mlplat run demo.py").startswith("mlplat run demo.py --param rows=10")
