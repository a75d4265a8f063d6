"""A training worker's side of the data: the shard loader's early start and resume position,
tokenizer tasks that never load torch, and data tasks that start in warm processes."""

import json
import os
import subprocess
import sys
import time

import pytest

from mlplat.data.loader import DataPosition, ShardLoader
from mlplat.data.sft import ChatTokenizer
from mlplat.models import load_tokenizer


def ordered_rows(n: int):
    import ray.data

    ds = ray.data.range(n, override_num_blocks=4)
    ds.context.execution_options.preserve_order = True  # the same rows in the same order on every pass
    return ds


def drawn(loader: ShardLoader, batches: int) -> list[list[int]]:
    return [loader.next()["id"].tolist() for _ in range(batches)]


def test_the_stream_starts_when_the_loader_is_made(ray_cluster, tmp_path):
    # A recipe makes its loader before building its model: the pipeline must be running by the
    # time the first batch is asked for, not start then.
    marker = tmp_path / "ran"

    def mark(batch):
        marker.touch()
        return batch

    loader = ShardLoader(ordered_rows(64).map_batches(mark).iterator(), batch_size=4, collate_fn=None, seed=0)
    deadline = time.monotonic() + 120
    while not marker.exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert marker.exists(), "nothing of the pipeline ran before the first batch was asked for"
    assert loader.wait_s == 0.0  # nobody has waited yet
    assert len(loader.next()["id"]) == 4 and loader.position.batches_in_epoch == 1


def test_a_resumed_loader_continues_where_the_checkpoint_left_off(ray_cluster):
    straight = drawn(ShardLoader(ordered_rows(64).iterator(), batch_size=4, collate_fn=None, seed=3), 6)
    resumed = ShardLoader(ordered_rows(64).iterator(), batch_size=4, collate_fn=None, seed=3, position=DataPosition(batches_in_epoch=4, rows_consumed=16))
    assert drawn(resumed, 2) == straight[4:]
    assert resumed.position == DataPosition(batches_in_epoch=6, rows_consumed=24)


def test_an_error_in_the_stream_reaches_the_trainer(ray_cluster):
    def fail(batch):
        raise ValueError("row 7 is unreadable")

    loader = ShardLoader(ordered_rows(16).map_batches(fail).iterator(), batch_size=4, collate_fn=None, seed=0)
    with pytest.raises(Exception, match="row 7 is unreadable"):
        loader.next()


def test_tokenizer_tasks_never_import_torch(tiny_model):
    # Ray Data runs the tokenizer UDFs in pooled worker processes: importing torch there (~2 s) and
    # transformers' AutoTokenizer (~4 s with it) delayed every pipeline's first batch.
    code = f"""
import sys
import mlplat.data.ingest, mlplat.data.packing, mlplat.data.rl_prompts
from mlplat.data.preference import PreferenceTokenizer
from mlplat.data.sft import ChatTokenizer
ChatTokenizer({str(tiny_model)!r}, 64), PreferenceTokenizer({str(tiny_model)!r}, 64)
print('torch' in sys.modules)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


def test_the_light_tokenizer_load_is_what_autotokenizer_gives(tiny_model, demo_data):
    from transformers import AutoTokenizer

    ours, auto = load_tokenizer(tiny_model), AutoTokenizer.from_pretrained(tiny_model)
    assert type(ours) is type(auto) and ours.chat_template == auto.chat_template
    rows = [json.loads(line) for line in open(demo_data.sft)][:100]
    batch = {"text": [json.dumps(r) for r in rows]}
    from mlplat.data.chat import tokenize_chat

    expected = [tokenize_chat(auto, r["messages"], 64) for r in rows]
    tokenized = ChatTokenizer(str(tiny_model), 64)(batch)
    assert [(ids.tolist(), labels.tolist()) for ids, labels in zip(tokenized["input_ids"], tokenized["labels"])] == [
        (ids, labels) for ids, labels in expected
    ]


def test_a_train_jobs_data_tasks_run_in_the_processes_warmed_for_it(ray_cluster, tmp_path, monkeypatch):
    # Ray Train's own runtime env keeps a job's data tasks off the driver's warm processes;
    # warm_data_workers must start processes that the job's tasks do get. A Ray Train variable
    # at a value of its own (the default plus one) gives this job a runtime env, and so a pool,
    # that no earlier job in the session left warm processes in: without the warm-up, every
    # data task here would start a fresh process.
    import ray
    import ray.train
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchTrainer

    from mlplat.train.data_workers import warm_data_workers
    from mlplat.train.recipe import fit_and_release

    def pid_column(batch):  # defined here: pickled by value, as Ray workers cannot import test modules
        import numpy as np

        return {"pid": np.full(len(batch["id"]), os.getpid())}

    def record_shard_pids(config):
        pids = {int(p) for batch in ray.train.get_dataset_shard("train").iter_batches(batch_size=8) for p in batch["pid"]}
        (config["out"] / "pids.json").write_text(json.dumps(sorted(pids)))

    monkeypatch.setenv("RAY_TRAIN_COLLECTIVE_WARN_INTERVAL_S", "61")
    warmed = set(ray.get(warm_data_workers(num_training_workers=1)))
    assert warmed, "no data workers were warmed: trainer_runtime_env() knows no env for this Ray"
    rows = ray.data.range(64, override_num_blocks=4).map_batches(pid_column)
    trainer = TorchTrainer(
        record_shard_pids,
        train_loop_config={"out": tmp_path},
        scaling_config=ScalingConfig(num_workers=1),
        datasets={"train": rows},
        run_config=RunConfig(storage_path=str(tmp_path / "ray_train")),
    )
    fit_and_release(trainer)
    ran_in = set(json.loads((tmp_path / "pids.json").read_text()))
    assert ran_in & warmed, f"the job's data tasks ran in {sorted(ran_in)}, none of them the warmed {sorted(warmed)}"
