"""Shared fixtures: one local Ray cluster per session, small demo data, a tiny model, the session's
SFT run (several modules inspect it) and a real Prometheus that can scrape it."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from mlplat.data.demo import DemoDataConfig

if TYPE_CHECKING:
    from train_apps.sft import SFTConfig, SFTResult

REPO_ROOT = Path(__file__).resolve().parents[1]


def readme_snippet(language: str, containing: str) -> str:
    """The README's fenced ``language`` block that contains ``containing`` (snippets a test runs cannot drift)."""
    import re

    blocks = re.findall(rf"```{language}\n(.*?)```", (REPO_ROOT / "README.md").read_text(), re.S)
    matching = [block for block in blocks if containing in block]
    assert len(matching) == 1, f"README: {len(matching)} {language} blocks contain {containing!r}"
    return matching[0]
MLPLAT = str(Path(sys.executable).with_name("mlplat"))  # the console script of the venv running the tests
PROMETHEUS = shutil.which("prometheus")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded


# `make test-fast` runs the unit tests: none that needs a Ray cluster (through these fixtures, or one it
# starts itself: marked `cluster`) and none of the `slow` end-to-end runs. `make test` runs everything.
CLUSTER_FIXTURES = {"ray_cluster", "ray_head", "token_auth_head"}


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the xdist_group marks (`--dist loadgroup`)
def pytest_collection_modifyitems(items):
    for item in items:
        if CLUSTER_FIXTURES & set(item.fixturenames):
            item.add_marker(pytest.mark.cluster)
        # `make test` runs two pytest-xdist workers, each a session of its own (docs/testing.md): one runs the tests on
        # the session's Ray cluster, in file order (one Serve on port 8000, the Prometheus that scrapes that cluster);
        # the other, beside it, everything else (unit tests, loop-level runs, tests with a Ray head of their own).
        item.add_marker(pytest.mark.xdist_group("session_cluster" if "ray_cluster" in item.fixturenames else "beside"))


def built_once(tmp_path_factory, name: str, build) -> Path:
    """``build(path)``, run by the first pytest-xdist worker that asks for ``name``; the others wait for it and reuse
    ``path`` (without xdist: once per session, as any session fixture)."""
    from filelock import FileLock

    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's base temp dir, which every worker's own lies in
    path, done = root / name, root / f"{name}.done"
    with FileLock(root / f"{name}.lock"):
        if not done.exists():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            build(path)
            done.touch()
    return path


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    from mlplat.runtime import init_ray

    # The embedded local cluster, as `mlplat` starts it: on 2 cores it advertises 4 CPUs,
    # so that two training workers and the data pipeline's tasks are schedulable at once.
    init_ray(num_training_workers=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def demo_data(tmp_path_factory):
    from mlplat.data.demo import DemoDataConfig, write_demo_data

    cfg = DemoDataConfig(sft_rows=2000, eval_rows=100, preference_rows=200, rl_rows=200)
    return write_demo_data(tmp_path_factory.mktemp("demo"), cfg)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory, demo_data) -> Path:
    from mlplat.data.demo import tokenizer_corpus
    from mlplat.models import build_tiny_model

    return built_once(tmp_path_factory, "tiny", lambda path: build_tiny_model(path / "model", tokenizer_corpus(demo_data.sft))) / "model"


# The post-training tests' task: one-digit reversed sums.
ONE_DIGIT = DemoDataConfig(max_digits=1, sft_rows=2000, eval_rows=30, preference_rows=400, rl_rows=400)


@pytest.fixture(scope="session")
def one_digit(tmp_path_factory):
    from mlplat.data.demo import write_demo_data

    return write_demo_data(tmp_path_factory.mktemp("one_digit"), ONE_DIGIT)


@pytest.fixture(scope="session")
def sft_model(tmp_path_factory, tiny_model, one_digit):
    """100 SFT steps in-process (no Ray: a fixture, not the recipe under test), the start of the post-training tests."""
    import json
    import random

    import torch

    from mlplat.data.chat import tokenize_chat
    from mlplat.models import load_model, load_tokenizer
    from mlplat.train.batch import pad_collate
    from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
    from mlplat.train.step import train_step

    def train(out: Path) -> None:
        torch.manual_seed(0)
        tokenizer, model = load_tokenizer(tiny_model), load_model(tiny_model)
        with open(one_digit.sft) as f:
            rows = [tokenize_chat(tokenizer, json.loads(line)["messages"], 64) for line in f]
        optim = OptimizerConfig(lr=1e-3, warmup_steps=50)
        optimizer = build_optimizer(model, optim)
        scheduler = build_lr_scheduler(optimizer, optim, 100)
        rng = random.Random(0)
        for _ in range(100):
            batch = rng.sample(rows, 32)
            train_step(model, pad_collate({"input_ids": [r[0] for r in batch], "labels": [r[1] for r in batch]}, tokenizer.pad_token_id),
                       optimizer, scheduler, 1.0)  # fmt: skip
        model.save_pretrained(out)
        tokenizer.save_pretrained(out)

    return built_once(tmp_path_factory, "sft", lambda path: train(path / "model")) / "model"


def free_ports(n: int) -> list[int]:
    """``n`` distinct TCP ports nothing listens on now (held open together, so no two are the same)."""
    sockets = [socket.socket() for _ in range(n)]
    for s in sockets:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in sockets]
    for s in sockets:
        s.close()
    return ports


def sampled_reward(model_dir, rows: list[dict], samples_per_prompt: int = 32) -> float:
    """Mean exact-match reward of temperature-1 samples: the quantity GRPO and PPO maximise, on fixed prompts."""
    from mlplat.rl.rewards import exact_match
    from mlplat.rl.rollout import RolloutWorker

    samples = RolloutWorker(str(model_dir), {}).generate([r["messages"] for r in rows], {"n": samples_per_prompt, "max_tokens": 8, "seed": 123})
    return sum(exact_match(samples, [r for r in rows for _ in range(samples_per_prompt)])) / len(samples)


@dataclass
class RLTask:
    rows: list[dict]  # the RL tests' prompts: 16 one-digit sums
    reward_before: float  # sampled_reward of sft_model on them

    def dataset(self, copies: int = 1) -> list[dict]:
        """The rows as the RL loop's "train" dataset takes them (JSON text, as Ray Data holds them), ``copies`` times."""
        return [{"text": json.dumps(r)} for r in self.rows] * copies


@pytest.fixture(scope="session")
def rl_task(one_digit, sft_model) -> RLTask:
    with open(one_digit.rl_prompts) as f:
        rows = [json.loads(line) for line in f][:16]
    return RLTask(rows, sampled_reward(sft_model, rows))


@pytest.fixture(scope="session")
def local_group():
    """Two rank processes for the session: the loop-level tests' many short runs under plain torch.distributed
    share them instead of spawning (and importing torch in) two new processes each (mlplat.train.worker.LocalGroup)."""
    from mlplat.train.worker import LocalGroup

    with LocalGroup(2) as group:
        yield group


@pytest.fixture(scope="session")
def new_mlflow_store(tmp_path_factory):
    """``new_mlflow_store(path)``: the URI of a new, empty sqlite MLflow store at ``path``.

    MLflow builds a new store by running its 68 schema migrations (~1.3 s here, for every store the
    suite makes); each store is instead a copy of one empty store that MLflow built at the start.
    Its Default experiment keeps the template's artifact location (the pytest process's ./mlruns/0);
    the recipes log to named experiments, whose locations each process sets when it creates them."""
    from mlflow import MlflowClient

    template = tmp_path_factory.mktemp("mlflow_template") / "mlflow.db"
    MlflowClient(f"sqlite:///{template}").search_experiments()  # migrations, then the Default experiment

    def make(path: Path) -> str:
        shutil.copyfile(template, path)
        return f"sqlite:///{path}"

    return make


@pytest.fixture
def tracking_uri(tmp_path, monkeypatch, new_mlflow_store) -> str:
    """A fresh sqlite MLflow store per test, set the way users set it."""
    uri = new_mlflow_store(tmp_path / "mlflow.db")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    return uri


class PrometheusServer:
    """Debian's Prometheus scraping the session's Ray cluster (Ray's service-discovery file format)."""

    def __init__(self, workdir: Path):
        import httpx

        from mlplat.observability.prometheus import scrape_config, service_discovery_file
        from mlplat.runtime import unused_port

        config = workdir / "prometheus.yml"
        # Late in the suite the cluster's /metrics page is large: a scrape takes ~1 s on 2 cores, and a
        # scrape's timeout is at most its interval (with 1 s, most scrapes failed: up == 0).
        config.write_text(scrape_config(service_discovery_file(workdir), scrape_interval="5s"))
        port = unused_port()
        log = workdir / "prometheus.log"
        command = [PROMETHEUS, f"--config.file={config}", f"--storage.tsdb.path={workdir / 'tsdb'}", f"--web.listen-address=127.0.0.1:{port}"]
        self.process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
        self.url, self.started = f"http://127.0.0.1:{port}", time.time()
        for _ in range(100):
            try:
                if httpx.get(f"{self.url}/-/ready", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        pytest.fail(f"prometheus did not start: {log.read_text()[-2000:]}")

    def stop(self) -> None:
        """Scrapes cost the rest of the suite CPU: the test that needs them stops the server when done."""
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=30)


@pytest.fixture(scope="session")
def prometheus(ray_cluster, tmp_path_factory):
    if PROMETHEUS is None:
        pytest.skip("the prometheus binary is not installed (Debian: apt-get install prometheus; `make test` does it where apt works)")
    server = PrometheusServer(tmp_path_factory.mktemp("prometheus"))
    yield server
    server.stop()


@dataclass
class SFTRun:
    cfg: SFTConfig
    result: SFTResult
    tracking_uri: str
    workdir: Path
    started: float  # time.time() when the run was started


SFT_STEPS, SFT_BATCH = 100, 8  # packed rows of 64 tokens per worker and step


@pytest.fixture(scope="session")
def sft_run(ray_cluster, demo_data, tiny_model, tmp_path_factory, new_mlflow_store) -> SFTRun:
    """The session's plain SFT run: 2 DDP workers, profiled, two bad rows in its data.

    A Ray Train job costs ~40-60 s to start here, so one run serves several tests:
    tests/test_sft.py (metrics, registry, checkpoints, exact resume) and
    tests/test_observability_prometheus.py (its metrics through Prometheus, its profile).
    """
    from mlplat.data.sft import SFTDataConfig
    from mlplat.observability.profiling import ProfileConfig
    from mlplat.train.optim import OptimizerConfig
    from train_apps.sft import SFTConfig, run_sft

    workdir = tmp_path_factory.mktemp("sft")
    data = workdir / "sft.jsonl"
    data.write_text(demo_data.sft.read_text() + '{"messages": "not a list"}\nnot json\n')  # two rejected rows
    cfg = SFTConfig(
        model=str(tiny_model),
        data=SFTDataConfig(path=str(data), pack=True, max_seq_len=64),  # the quickstart covers unpacked
        optim=OptimizerConfig(lr=1e-3, warmup_steps=10),
        # 100 steps (~10 s): long enough for the workers to export their gauges to Prometheus at least
        # once (Ray's processes send metrics to their node's agent every 10 s, and a worker's die with it).
        max_steps=SFT_STEPS,
        batch_size_per_worker=SFT_BATCH,
        num_workers=2,
        log_every=10,
        checkpoint_every=20,
        num_checkpoints_to_keep=2,
        storage_path=str(workdir / "ray_train"),
        experiment="test-sft",
        registered_model="test-sft-model",
        profile=ProfileConfig(steps=2, wait_steps=1, top=10),
    )
    tracking_uri = new_mlflow_store(workdir / "mlflow.db")
    started = time.time()
    return SFTRun(cfg, run_sft(cfg, tracking_uri=tracking_uri, work_dir=workdir / "outputs"), tracking_uri, workdir, started)
