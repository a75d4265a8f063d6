"""Pipeline caching never serves a stale result: editing a function a step called, moving a
``models:/...@alias`` and changing a path input's contents each miss the cache; nothing else does."""

import os
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mlflow.tracking import MlflowClient

from mlplat.cli import main as cli_main
from mlplat.config import Config
from mlplat.errors import MlplatError
from mlplat.pipeline import Dataset, Model, cache
from mlplat.pipeline.definition import load_pipeline

PIPELINE = '''
from mlplat.pipeline import Dataset, Model, pipeline, step


@step(num_cpus=0.5)
def compute(x: int) -> int:
    import cache_helper  # imported as it runs, invisible in this source: like a recipe reached through an entry point

    return cache_helper.f(x)


@step(num_cpus=0.5)
def count_lines(data: Dataset) -> int:
    return len(data.local_path().read_text().splitlines())


@step(num_cpus=0.5)
def model_uri(model: Model) -> str:
    return model.uri


@pipeline(experiment="cache")
def cached(x: int, data: Dataset, model: Model):
    return {"compute": compute(x), "lines": count_lines(data), "model": model_uri(model)}
'''
HELPER = "def f(x):\n    return x + 1\n"


def _statuses(result) -> dict[str, str]:
    return {name: record.status for name, record in result.steps.items()}


@pytest.mark.slow
def test_only_a_called_function_an_alias_or_file_contents_miss(ray_cluster, tracking_uri, tmp_path, capsys):
    (tmp_path / "cache_pipeline.py").write_text(PIPELINE)
    helper, unrelated = tmp_path / "cache_helper.py", tmp_path / "cache_unrelated.py"
    helper.write_text(HELPER)
    unrelated.write_text("def g():\n    return 0\n")
    data = tmp_path / "rows.txt"
    data.write_text("a\nb\n")
    client = MlflowClient(tracking_uri)
    client.create_registered_model("cache-model")
    for _ in range(2):
        client.create_model_version("cache-model", source=str(tmp_path))
    client.set_registered_model_alias("cache-model", "champion", "1")

    pipe = load_pipeline(tmp_path / "cache_pipeline.py")
    params = {"x": 1, "data": Dataset(data), "model": Model("models:/cache-model@champion")}

    def run(expect_run: set[str]):
        result = pipe.run(params, workdir=tmp_path / "work")
        assert _statuses(result) == {s: "succeeded" if s in expect_run else "cached" for s in ("compute", "count_lines", "model_uri")}
        return result.outputs

    assert run({"compute", "count_lines", "model_uri"}) == {"compute": 2, "lines": 2, "model": "models:/cache-model@champion"}
    assert run(set())["compute"] == 2  # a rerun

    # Nothing else misses: a comment in the called module and in the pipeline file, an edit to a
    # project module no step loaded, a path input touched without a change of contents.
    helper.write_text("# a comment, and the same code laid out differently\ndef f( x ):\n    return x+1  # same\n")
    (tmp_path / "cache_pipeline.py").write_text(PIPELINE + "# a comment at the end\n")
    unrelated.write_text("def g():\n    return 1\n")
    os.utime(data, (time.time() + 5, time.time() + 5))
    run(set())

    helper.write_text("def f(x):\n    return x + 2\n")  # the called function: only the step that called it runs
    assert run({"compute"})["compute"] == 3
    # The alias moves and the file gets new contents: only the step that takes each runs.
    client.set_registered_model_alias("cache-model", "champion", "2")
    data.write_text("a\nb\nc\n")
    assert run({"model_uri", "count_lines"})["lines"] == 3

    # The entries the runs left, and taking some out of the cache.
    capsys.readouterr()
    cli_main(["cache", "ls", "--experiment", "cache"])
    table = capsys.readouterr().out.splitlines()
    assert table[0].split()[:4] == ["STEP", "KEY", "CREATED", "SIZE"]
    rows = [line.split() for line in table[1:]]
    assert sorted(row[0] for row in rows) == sorted(["cached.compute", "cached.count_lines", "cached.model_uri"] * 2)
    compute_row = next(line for line in table if line.startswith("cached.compute"))
    assert "cache_helper 1" in compute_row and "cache_pipeline 1" in compute_row and "cache_unrelated" not in compute_row
    cli_main(["cache", "rm", "cached.compute", "--experiment", "cache"])
    assert capsys.readouterr().out == "removed 2 cache entries\n"
    run({"compute"})
    with pytest.raises(SystemExit) as exit_:
        cli_main(["cache", "rm"])
    assert exit_.value.code == 2 and "name a step, a key or a run id, or pass --all" in capsys.readouterr().err


def test_module_hash_ignores_comments_layout_and_step_functions(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("import x\n\n@step\ndef a():\n    return 1\n\ndef helper():\n    return 2\n")
    before = cache.source_hash(module)
    module.write_text("import x  # why\n\n@step(retries=2)\ndef a():\n    return 100\n\n\ndef helper( ):\n    return 2\n")
    assert cache.source_hash(module) == before  # a step's own body is in its own key, not in its module's
    module.write_text("import x\n\ndef helper():\n    return 3\n")
    assert cache.source_hash(module) != before
    assert cache.is_project_file(cache.__file__) and not cache.is_project_file(os.__file__) and not cache.is_project_file(pytest.__file__)


class _Inner(Config):
    lr: float = 1e-3
    names: list[str] = []


@settings(max_examples=60, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=5), st.integers() | st.text(max_size=5), min_size=1, max_size=6),
       st.floats(min_value=-1e6, max_value=1e6))
def test_base_key_covers_values_not_their_order(values, lr):
    reordered = dict(reversed(list(values.items())))
    key = cache.base_key("m.f", "code", "", {"cfg": _Inner(lr=lr), "extra": values}, {})[0]
    assert key == cache.base_key("m.f", "code", "", {"extra": reordered, "cfg": _Inner(lr=lr)}, {})[0]
    changed = {**values, next(iter(values)): "changed!"}
    assert key != cache.base_key("m.f", "code", "", {"cfg": _Inner(lr=lr), "extra": changed}, {})[0]
    assert key != cache.base_key("m.f", "code", "", {"cfg": _Inner(lr=lr + 1), "extra": values}, {})[0]
    assert key != cache.base_key("m.f", "code", "2", {"cfg": _Inner(lr=lr), "extra": values}, {})[0]


def test_path_inputs_count_by_contents(tmp_path):
    from pyarrow import fs

    file, folder = tmp_path / "data.jsonl", tmp_path / "shards"
    file.write_text("1\n")
    (folder / "sub").mkdir(parents=True)
    (folder / "sub" / "a").write_text("a")

    def fingerprints():
        return cache.path_fingerprints({"d": Dataset(file), "cfg": {"c": [Dataset(f"file://{folder}")]}, "r": Dataset("runs:/r/x")})

    first = fingerprints()
    assert set(first) == {str(file), f"file://{folder}"}  # runs:/ names fixed contents
    later = time.time() + 10
    for path in (file, folder / "sub" / "a"):
        os.utime(path, (later, later))
    assert fingerprints() == first  # touched: the same contents
    (folder / "sub" / "a").write_text("b")
    assert fingerprints()[f"file://{folder}"] != first[f"file://{folder}"]
    (folder / "sub" / "a").rename(folder / "sub" / "b")
    assert fingerprints() != first
    file.write_text("2\n")
    assert fingerprints()[str(file)] != first[str(file)]

    # Other filesystems (s3://, gs://) by what pyarrow lists: each file's size and modification time.
    local = fs.LocalFileSystem()
    remote = cache.filesystem_fingerprint(local, str(folder))
    assert cache.filesystem_fingerprint(local, str(folder)) == remote
    os.utime(folder / "sub" / "b", (later + 10, later + 10))
    assert cache.filesystem_fingerprint(local, str(folder)) != remote


def test_model_alias_inputs_resolve_in_the_registry(tracking_uri, tmp_path):
    client = MlflowClient(tracking_uri)
    client.create_registered_model("m")
    for _ in range(2):
        client.create_model_version("m", source=str(tmp_path))
    client.set_registered_model_alias("m", "best", "2")
    found = cache.path_fingerprints({"a": Model("models:/m@best"), "b": Model("models:/m/1"), "c": Model("models:/m/latest")})
    assert found == {"models:/m@best": "models:/m/2", "models:/m/1": "models:/m/1", "models:/m/latest": "models:/m/2"}
    with pytest.raises(MlplatError, match="model input models:/m@nope: cannot resolve it in the registry"):
        cache.path_fingerprints({"a": Model("models:/m@nope")})


def test_steps_share_workers_only_along_chains_of_outputs():
    from mlplat.pipeline import pipeline, step
    from mlplat.pipeline.executor import worker_chains

    @step
    def a() -> int:
        return 1

    @step
    def b(x: int) -> int:
        return x

    @pipeline
    def shape():
        first = a()
        left, right = b(first), b(first)  # a's worker goes on with one of them only
        b(left)
        a().after(right)  # after() passes no outputs: a chain of its own

    chains = worker_chains(shape.build())
    assert chains["b_3"] == chains["b"]
    assert (chains["b"] == chains["a"]) != (chains["b_2"] == chains["a"])
    assert chains["a_2"] not in {chains[n] for n in ("a", "b", "b_2", "b_3")}
    assert len(set(chains.values())) == 3
