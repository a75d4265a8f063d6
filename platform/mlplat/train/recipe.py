"""A recipe on Ray: the MLflow run around the Ray Train job, the job itself (its loop on every worker,
given a ``RayWorkerEnv``), and the final model's registration.

A recipe in ``train_apps/`` supplies its loop (``loop(cfg, env)``, mlplat.train.loop) and its datasets;
this module does the plumbing the same way for all of them, so they read like their algorithm box.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable
from contextlib import contextmanager
from functools import partial
from pathlib import Path

import ray
import ray.train
import ray.train.torch
from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor
from ray.data import ExecutionOptions
from ray.train import Checkpoint, CheckpointConfig, DataConfig, FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer

from mlplat.config import to_flat_params
from mlplat.data.ingest import DataReport, check_sources
from mlplat.errors import CheckpointError, ConfigError
from mlplat.health.marking import accepted_worker_resources
from mlplat.observability import catalogue
from mlplat.runtime import init_ray
from mlplat.tracking import ModelRef, RunLogger, register_adapter_dir, register_model_dir, resolve_model, start_run
from mlplat.tracking.runs import default_tracking_uri
from mlplat.train.checkpoint import ADAPTER_DIR, MODEL_DIR, TRAIN_STATE, read_train_state
from mlplat.train.data_workers import warm_data_workers
from mlplat.train.loop import RecipeConfig
from mlplat.train.perf import measure_cpu_peak_flops


def fit_and_release(trainer: TorchTrainer) -> ray.train.Result:
    """``trainer.fit()``, then let go of the finished run's controller.

    Ray Train's ``fit`` installs a SIGINT handler that holds the controller actor's handle, so the
    run's controller, dataset manager and split coordinator (a process each) outlive it until the
    next ``fit`` or the end of the process; in a pipeline step that is an idle Ray worker, kept for
    minutes. Restoring the previous handler drops the handle and Ray reclaims them."""
    in_main_thread = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGINT) if in_main_thread else None
    try:
        return trainer.fit()
    finally:
        if previous is not None:  # None: a handler not set from Python, which Python cannot put back
            signal.signal(signal.SIGINT, previous)


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def deterministic_data_config() -> DataConfig:
    """Ray Train ``dataset_config`` whose shards yield the same rows in the same order on every run (mlplat.data.loader)."""
    return DataConfig(execution_options=ExecutionOptions(preserve_order=True))


class RayWorkerEnv:
    """A Ray Train worker as a ``WorkerEnv`` (mlplat.train.worker): its device, its Ray Data shard, the
    checkpoint to restore (this run's latest after a restart, else ``resume_from``), checkpoints
    reported to Ray Train, and rank 0's metrics to the MLflow run."""

    def __init__(self, run_id: str, tracking_uri: str, start_time: float, resume_from: str | None = None):
        self.run_id, self.tracking_uri, self.start_time = run_id, tracking_uri, start_time
        self.device = ray.train.torch.get_device()
        latest = ray.train.get_checkpoint()
        self.restarted = latest is not None
        self.restore_from = latest or (Checkpoint(resume_from) if resume_from else None)
        self.logger = RunLogger(run_id, tracking_uri) if ray.train.get_context().get_world_rank() == 0 else None

    def dataset_shard(self, name: str):
        return ray.train.get_dataset_shard(name)

    def save_checkpoint(self, metrics: dict[str, float], write: Callable[[Path], None]) -> None:
        """Each rank writes into its own local directory; Ray Train merges them (file names never collide across ranks)."""
        with tempfile.TemporaryDirectory() as tmp:
            write(Path(tmp))
            ray.train.report(metrics, checkpoint=Checkpoint.from_directory(tmp) if any(Path(tmp).iterdir()) else None)

    def node(self) -> dict[str, str]:
        return {"node_id": ray.get_runtime_context().get_node_id(), "ip": ray.util.get_node_ip_address()}


def on_ray_train(loop: Callable, config_class: type[RecipeConfig], config: dict) -> None:
    """Ray Train's function per worker: the recipe's ``loop(cfg, env, **extra)`` on a ``RayWorkerEnv``."""
    cfg = config_class.model_validate(config["cfg"])
    env = RayWorkerEnv(config["run_id"], config["tracking_uri"], config["job_start_time"], cfg.resume_from)
    monitor = SystemMetricsMonitor(env.run_id, tracking_uri=env.tracking_uri) if env.logger else None
    if monitor:
        monitor.start()  # MLflow's system/* metrics (CPU, memory, GPU) of rank 0's node
    try:
        loop(cfg, env, **config["extra"])
    finally:
        if monitor:
            monitor.finish()


class RecipeRun:
    """One recipe run: its MLflow run (parent of every metric), resolved model and Ray Train job."""

    def __init__(self, recipe: str, cfg: RecipeConfig, tracking_uri: str | None, work_dir: str | Path, tags: dict[str, str] | None = None):
        self.start_time = time.time()
        self.recipe, self.cfg = recipe, cfg
        self.tracking_uri = tracking_uri or default_tracking_uri()
        self.work_dir = Path(work_dir)
        eval_data = getattr(cfg, "eval_data", None)
        if eval_data and "://" not in eval_data and not Path(eval_data).is_file():
            raise ConfigError(f"eval_data: {eval_data} is not a file: give a held-out JSONL path, or leave eval_data unset")
        if cfg.resume_from:
            self.cfg = cfg = cfg.model_copy(update={"resume_from": check_resume_from(cfg.resume_from, cfg.max_steps)})
        check_sources(cfg.data)  # before a cluster or an MLflow run is started
        if not cfg.peak_tflops and not cfg.use_gpu:
            # MFU's CPU peak, measured before Ray and the data pipeline start, on one worker's threads (Ray gives each one CPU)
            self.cfg = cfg = cfg.model_copy(update={"peak_tflops": measure_cpu_peak_flops(threads=1) / 1e12})
        self.model_dir = resolve_model(cfg.model, download_dir=self.work_dir / "downloads", tracking_uri=self.tracking_uri)
        init_ray(num_training_workers=cfg.num_workers)
        tags = {"mlplat.recipe": recipe, "mlplat.base_model": cfg.model, "mlplat.resumed_from": cfg.resume_from or "", **(tags or {})}
        if cfg.peak_tflops:
            tags["mlplat.mfu.peak_tflops_per_worker"] = f"{cfg.peak_tflops:.4g}"
        if commit := git_commit():
            tags["mlflow.source.git.commit"] = commit
        self.run_id = start_run(cfg.experiment, cfg.run_name, params=to_flat_params(cfg), tags=tags, tracking_uri=self.tracking_uri)
        self.logger = RunLogger(self.run_id, self.tracking_uri)

    @contextmanager
    def tracked(self):
        """The body of a run: its MLflow run ends FINISHED, or FAILED if the body raises."""
        try:
            yield self
        except BaseException:
            self.logger.end("FAILED")
            raise
        self.logger.end()

    def log_data_report(self, report: DataReport) -> None:
        self.logger.set_tags({"mlplat.data.fingerprint": report.fingerprint})
        self.logger.log_metrics({
            "data/rows_read": report.rows_read, "data/bad_rows": report.bad_rows, "data/rows_used": report.rows_used,
            **{f"data/source{i}/rows_used": s.rows_used for i, s in enumerate(report.sources)},
        })  # fmt: skip
        for reason, rows in report.bad_rows_by_reason.items():
            catalogue.TRAIN_REJECTED_ROWS.inc(rows, recipe=self.recipe, run_id=self.run_id, reason=reason[:80])

    def loop_cfg(self) -> RecipeConfig:
        """The config the workers' loop gets: the model resolved to a local directory."""
        return self.cfg.model_copy(update={"model": str(self.model_dir)})

    def fit(self, loop: Callable, datasets: dict, extra: dict | None = None) -> ray.train.Result:
        """Run ``loop(cfg, env, **extra)`` on ``num_workers`` Ray Train workers over ``datasets`` (only on nodes
        that passed ``mlplat health check`` with ``health.accepted_nodes_only``)."""
        cfg = self.cfg
        resources_per_worker = accepted_worker_resources(cfg.use_gpu) if cfg.health.accepted_nodes_only else None
        storage = str(Path(cfg.storage_path).resolve()) if "://" not in cfg.storage_path else cfg.storage_path
        config = {
            "cfg": self.loop_cfg().model_dump(mode="json"),
            "run_id": self.run_id,
            "tracking_uri": self.tracking_uri,
            "job_start_time": self.start_time,
            "extra": extra or {},
        }
        trainer = TorchTrainer(
            partial(on_ray_train, loop, type(cfg)),
            train_loop_config=config,
            scaling_config=ScalingConfig(num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker=resources_per_worker),
            datasets=datasets,
            dataset_config=deterministic_data_config() if cfg.deterministic_data else None,
            run_config=RunConfig(
                name=f"{self.recipe}-{self.run_id}",
                storage_path=storage,
                failure_config=FailureConfig(max_failures=cfg.max_failures),
                checkpoint_config=CheckpointConfig(
                    num_to_keep=cfg.num_checkpoints_to_keep,
                    checkpoint_score_attribute=cfg.checkpoint_score_metric,
                    checkpoint_score_order=cfg.checkpoint_score_order,
                ),
            ),
        )
        warm_data_workers(cfg.num_workers)  # the pipeline's first task processes start beside the trainer's
        return fit_and_release(trainer)

    def finish(self, result: ray.train.Result) -> tuple[Path, ModelRef | None]:
        """Copy the final HF model out of the last checkpoint; register it (or log it) in MLflow."""
        final_dir = self.work_dir / self.run_id / "final"
        with result.checkpoint.as_directory() as ckpt:
            shutil.copytree(Path(ckpt) / MODEL_DIR, final_dir, dirs_exist_ok=True)
            if (Path(ckpt) / ADAPTER_DIR).is_dir():  # LoRA: the adapter alone too
                shutil.copytree(Path(ckpt) / ADAPTER_DIR, final_dir.with_name(ADAPTER_DIR), dirs_exist_ok=True)
        checkpoints = [{"path": c.path, "step": m.get("step"), "loss": m.get("loss")} for c, m in result.best_checkpoints]
        self.logger.log_dict({"checkpoints": checkpoints, "latest": result.checkpoint.path}, "checkpoints.json")
        self.logger.set_tags({"mlplat.checkpoint.latest": result.checkpoint.path})
        version = None
        lora = getattr(self.cfg, "lora", None)
        if self.cfg.registered_model and lora is not None and lora.register_as == "adapter":  # served on its base model by name
            version = register_adapter_dir(self.run_id, final_dir.with_name(ADAPTER_DIR), self.cfg.registered_model, self.cfg.model,
                                           self.cfg.registered_alias, self.tracking_uri)  # fmt: skip
        elif self.cfg.registered_model:
            version = register_model_dir(self.run_id, final_dir, self.cfg.registered_model, self.cfg.registered_alias, self.tracking_uri)
        else:
            self.logger.log_artifacts(final_dir, "model")
        return final_dir, version


def check_resume_from(resume_from: str, max_steps: int) -> str:
    """``resume_from`` as the workers will read it (an absolute path: they may run elsewhere), or a clear error."""
    if "://" not in resume_from:
        resume_from = str(Path(resume_from).resolve())
    try:
        resumed_step = read_train_state(Checkpoint(resume_from)).step
    except FileNotFoundError:
        raise CheckpointError(f"resume_from: {resume_from} is not a training checkpoint directory (no {TRAIN_STATE})") from None
    except Exception as err:  # noqa: BLE001 - a truncated or foreign file: say which and why, not a traceback
        raise CheckpointError(f"resume_from: cannot read {resume_from}/{TRAIN_STATE} ({type(err).__name__}: {err})") from None
    if resumed_step >= max_steps:
        raise ConfigError(f"resume_from: the checkpoint is at step {resumed_step}, not before max_steps={max_steps}: raise max_steps")
    return resume_from
