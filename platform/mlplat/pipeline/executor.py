"""Run a pipeline's DAG on Ray: one task per step, one MLflow run per step, cached results reused.

    parent MLflow run (the pipeline: parameters, pipeline.json with every step's run and outputs)
      child run per step (tags: cache keys, code hash; params: its inputs as URIs or values)
        runs the step started itself, nested with ``step_context().nest(run_id)``

A step becomes a task when all it depends on has succeeded. Before that, its cache key (its
code, ``version``, resolved inputs, the contents behind path inputs, the modules it loaded
last time: ``mlplat.pipeline.cache``) is looked up among the experiment's successful step
runs; a hit reuses that run's outputs without running anything, which is also how a rerun
after a failure resumes where the failed run stopped.

A step's cache entry lists the project modules loaded in the worker process that ran it. Ray
reuses a worker only for tasks with the same runtime_env, so each step gets one naming this
pipeline run and its *worker chain* (``worker_chains``): a chain of steps each taking the
previous one's outputs. A worker thus never carries code loaded in another pipeline run (before
an edit), and a step's list holds, besides its own modules, only those of steps upstream of it
in its chain: an edit there reruns that step first anyway (this one then misses even where the
upstream step's new outputs equal the old: a spare rerun, never a stale hit).

Failed or timed-out attempts are retried after ``retry_backoff_s``, doubling; after the last one the
pipeline stops launching steps, lets those already running finish (a rerun reuses them), and
raises a ``PipelineError`` naming the step and its error.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import mlflow
import ray
from mlflow.tracking import MlflowClient
from pydantic import BaseModel

from mlplat.errors import MlplatError
from mlplat.observability.console import status
from mlplat.pipeline import cache
from mlplat.pipeline.artifacts import ARTIFACT_KEY, Dataset, from_json, map_values, to_json
from mlplat.pipeline.graph import Graph, Node, StepOutput
from mlplat.pipeline.steps import StepContext, execute_step
from mlplat.runtime import init_ray
from mlplat.tracking import RunLogger, default_tracking_uri
from mlplat.tracking.runs import ensure_experiment

OUTPUTS_FILE = "mlplat/outputs.json"
CACHE_KEY_TAG = cache.KEY_TAG

_step_task = ray.remote(execute_step)


class PipelineError(MlplatError):
    """A pipeline run that stopped: the message names the step, its error and how to resume."""


class StepRecord(BaseModel):
    status: Literal["succeeded", "cached", "failed", "not run"]
    run_id: str | None = None
    attempts: int = 0
    cached_from: str | None = None  # the run whose outputs a cached step reused
    error: str | None = None
    seconds: float = 0.0


class PipelineResult(BaseModel):
    pipeline: str
    run_id: str  # the pipeline's MLflow run; each step's run is its child
    experiment: str
    tracking_uri: str
    outputs: Any  # what the pipeline function returned, with step outputs filled in
    steps: dict[str, StepRecord]
    dashboard_url: str | None = None  # set when the run started its own local Ray cluster


def cache_key(node: Node, arguments: dict[str, Any], paths: dict[str, str] | None = None) -> str:
    """The step's base cache key (``mlplat.pipeline.cache``): what is known before it runs."""
    return _base_key(node, arguments, paths or {})[0]


def _base_key(node: Node, arguments: dict[str, Any], paths: dict[str, str]) -> tuple[str, dict]:
    step = node.step
    return cache.base_key(cache.step_function_name(step.fn), step.code_hash, step.settings.version, arguments, paths)


def worker_chains(graph: Graph) -> dict[str, int]:
    """Steps grouped into chains that may share worker processes: each step follows a step whose
    outputs it takes (and which no other step followed yet), else starts a chain."""
    chain: dict[str, int] = {}
    followed: set[str] = set()
    for name in graph.order():
        parent = next((p for p in sorted(graph.nodes[name].inputs()) if p not in followed), None)
        if parent is None:
            chain[name] = len(set(chain.values()))
        else:
            followed.add(parent)
            chain[name] = chain[parent]
    return chain


@dataclass
class _Attempt:
    node: str
    number: int
    ref: ray.ObjectRef
    deadline: float | None


def run_graph(
    graph: Graph,
    *,
    experiment: str,
    use_cache: bool = True,
    address: str | None = None,
    namespace: str | None = None,
    workdir: str | Path | None = None,
    tracking_uri: str | None = None,
    code_root: str | None = None,
) -> PipelineResult:
    dashboard_url = init_ray(address, namespace=namespace)  # joins RAY_ADDRESS inside a Ray job
    run = _PipelineRun(graph, experiment, use_cache, tracking_uri or default_tracking_uri(), workdir, code_root)
    result = run.execute()
    result.dashboard_url = dashboard_url
    return result


class _PipelineRun:
    def __init__(self, graph: Graph, experiment: str, use_cache: bool, tracking_uri: str, workdir, code_root: str | None):
        self.graph, self.experiment, self.use_cache, self.tracking_uri = graph, experiment, use_cache, tracking_uri
        self.client = MlflowClient(tracking_uri)
        self.experiment_id = ensure_experiment(self.client, experiment, tracking_uri)
        params = _flat(to_json(graph.params), "param.")
        self.run_id = self.client.create_run(self.experiment_id, run_name=graph.pipeline, tags={
            "mlplat.pipeline": graph.pipeline, "mlplat.pipeline.steps": ",".join(graph.nodes),
        }).info.run_id
        RunLogger(self.run_id, tracking_uri).log_params(params)
        base = Path(workdir) if workdir else Path("outputs") / "pipelines" / graph.pipeline
        self.workdir = base.resolve() / self.run_id[:8]
        # Steps run in worker processes: they see the pipeline's tracking store and can import its module.
        env = {"MLFLOW_TRACKING_URI": tracking_uri}
        if code_root:
            env["PYTHONPATH"] = os.pathsep.join(p for p in (code_root, os.environ.get("PYTHONPATH")) if p)
        chains = worker_chains(graph)
        self.runtime_envs = {
            name: {"env_vars": {**env, "MLPLAT_STEP_WORKER": f"{self.run_id}.{chains[name]}"}} for name in graph.nodes
        }
        self.outputs: dict[str, Any] = {}
        self.records: dict[str, StepRecord] = {name: StepRecord(status="not run") for name in graph.nodes}
        self.keys: dict[str, tuple[str, dict]] = {}  # step -> (base key, what it covers)
        self.lineage: dict[str, dict[str, str]] = {}
        self.started: dict[str, float] = {}
        self.failure: str | None = None

    def log(self, message: str) -> None:
        status(f"[{self.graph.pipeline}] {message}")

    # -- the loop -------------------------------------------------------------------------

    def execute(self) -> PipelineResult:
        order = self.graph.order()
        self.log(f"{len(order)} steps: {' -> '.join(order)}   MLflow run {self.run_id} ({self.experiment})")
        pending = list(order)
        running: dict[ray.ObjectRef, _Attempt] = {}
        retries: list[tuple[float, str, int]] = []  # (when, step, attempt number)
        try:
            while True:
                if self.failure is None:
                    for name in [n for n in pending if self._ready(n)]:
                        pending.remove(name)
                        if not self._start_step(name):
                            continue
                        running_attempt = self._submit(name, 1)
                        running[running_attempt.ref] = running_attempt
                    # A cache hit can make more steps ready at once: go round before waiting.
                    if any(self._ready(n) for n in pending):
                        continue
                if not running and not retries:
                    break
                now = time.monotonic()
                wakeups = [a.deadline for a in running.values() if a.deadline] + [when for when, _, _ in retries]
                timeout = max(0.0, min(wakeups) - now) if wakeups else None
                if running:
                    done, _ = ray.wait(list(running), num_returns=1, timeout=timeout)
                else:
                    time.sleep(timeout or 0)
                    done = []
                for ref in done:
                    attempt = running.pop(ref)
                    try:
                        self._succeeded(attempt, ray.get(ref))
                    except Exception as err:  # noqa: BLE001 - the step's own exception, or a Ray error (worker died, ...)
                        self._attempt_failed(attempt, err, retries)
                now = time.monotonic()
                for ref, attempt in list(running.items()):
                    if attempt.deadline is not None and now >= attempt.deadline:
                        ray.cancel(ref, force=True)
                        running.pop(ref)
                        timeout_s = self.graph.nodes[attempt.node].step.settings.timeout_s
                        self._attempt_failed(attempt, TimeoutError(f"timed out after {timeout_s:g}s"), retries)
                for entry in [r for r in retries if r[0] <= now]:
                    retries.remove(entry)
                    _, name, number = entry
                    retried = self._submit(name, number)
                    running[retried.ref] = retried
        except BaseException as err:
            for ref in running:
                ray.cancel(ref, force=True)
            self._finish("FAILED" if isinstance(err, Exception) else "KILLED")  # KILLED: Ctrl-C
            raise
        self._finish("FAILED" if self.failure else "FINISHED")
        if self.failure:
            raise PipelineError(self.failure)
        return PipelineResult(
            pipeline=self.graph.pipeline,
            run_id=self.run_id,
            experiment=self.experiment,
            tracking_uri=self.tracking_uri,
            outputs=self._resolve(self.graph.outputs),
            steps=self.records,
        )

    def _ready(self, name: str) -> bool:
        return all(self.records[d].status in ("succeeded", "cached") for d in self.graph.nodes[name].dependencies())

    # -- one step -------------------------------------------------------------------------

    def _start_step(self, name: str) -> bool:
        """Resolve inputs, then reuse a cached result (False: nothing to run) or open the step's run (True)."""
        node = self.graph.nodes[name]
        self.started[name] = time.monotonic()
        arguments = self._resolve(node.arguments())
        cacheable = node.step.settings.cache
        try:
            paths = cache.path_fingerprints(arguments, self.tracking_uri)
        except MlplatError as err:
            raise PipelineError(f"pipeline {self.graph.pipeline!r}: step {name!r}: {err}") from None
        base, identity = self.keys[name] = _base_key(node, arguments, paths)
        cached = self._find_cached(base) if self.use_cache and cacheable else None
        tags = {
            "mlflow.parentRunId": self.run_id,
            "mlplat.pipeline": self.graph.pipeline,
            "mlplat.pipeline.run_id": self.run_id,
            "mlplat.step": name,
            "mlplat.step.function": node.step.fn.__qualname__,
            "mlplat.step.code_hash": node.step.code_hash,
        }
        if cacheable and cached is None:  # a run that will hold a result: an entry once it succeeds
            tags[cache.BASE_TAG] = base
        inputs = {param: _describe_input(value) for param, value in arguments.items()}
        run_id = self.client.create_run(self.experiment_id, run_name=name, tags=tags).info.run_id
        logger = RunLogger(run_id, self.tracking_uri)
        logger.log_params({f"input.{k}": v for k, v in inputs.items()})
        _log_dataset_inputs(self.client, run_id, arguments)
        self.lineage[name] = {
            "mlplat.pipeline": self.graph.pipeline,
            "mlplat.pipeline.run_id": self.run_id,
            "mlplat.step": name,
            "mlplat.step.run_id": run_id,
            "mlplat.inputs": json.dumps(inputs),
        }
        record = self.records[name]
        record.run_id = run_id
        if cached is not None:
            cached_run, outputs = cached
            self.outputs[name] = outputs
            logger.log_dict(to_json(outputs), OUTPUTS_FILE)
            logger.set_tags({"mlplat.cached_from": cached_run})
            logger.end("FINISHED")
            record.status, record.cached_from = "cached", cached_run
            self.log(f"{name}: cached (outputs of run {cached_run})")
            return False
        return True

    def _submit(self, name: str, number: int) -> _Attempt:
        node = self.graph.nodes[name]
        settings = node.step.settings
        record = self.records[name]
        record.attempts = number
        context = StepContext(
            pipeline=self.graph.pipeline,
            step=name,
            run_id=record.run_id,
            parent_run_id=self.run_id,
            experiment=self.experiment,
            tracking_uri=self.tracking_uri,
            workdir=str(self.workdir / name),
            attempt=number,
        )
        bound = node.step.signature.bind(*self._resolve(node.args), **self._resolve(node.kwargs))
        ref = _step_task.options(
            name=f"{self.graph.pipeline}.{name}", runtime_env=self.runtime_envs[name], **settings.ray_options()
        ).remote(node.step.fn, bound.args, bound.kwargs, context, self.lineage[name])
        total = settings.retries + 1
        self.log(f"{name}: running" + (f" (attempt {number}/{total})" if total > 1 else ""))
        deadline = time.monotonic() + settings.timeout_s if settings.timeout_s else None
        return _Attempt(name, number, ref, deadline)

    def _succeeded(self, attempt: _Attempt, returned: tuple[Any, dict[str, str]]) -> None:
        name = attempt.node
        outputs, modules = returned
        record = self.records[name]
        record.seconds = time.monotonic() - self.started[name]
        logger = RunLogger(record.run_id, self.tracking_uri)
        logger.log_dict(to_json(outputs), OUTPUTS_FILE)
        step = self.graph.nodes[name].step
        if step.settings.cache:
            base, identity = self.keys[name]
            # The step's own module too: a step is pickled by value (its module's attribute is the Step,
            # not the function), so helpers from its file travel with it and its worker never imports that file.
            modules = {**modules, **cache.current_module_hashes([step.fn.__module__])}
            cache.record_entry(self.client, record.run_id, base, identity, dict(sorted(modules.items())))
        logger.set_tags({"mlplat.step.attempts": attempt.number})
        logger.end("FINISHED")
        self.outputs[name] = outputs
        record.status = "succeeded"
        self.log(f"{name}: done in {record.seconds:.1f}s")

    def _attempt_failed(self, attempt: _Attempt, err: BaseException, retries: list) -> None:
        name = attempt.node
        settings = self.graph.nodes[name].step.settings
        summary, details = _describe_error(err)
        record = self.records[name]
        if attempt.number <= settings.retries:
            delay = settings.retry_backoff_s * 2 ** (attempt.number - 1)
            self.log(f"{name}: attempt {attempt.number} failed: {summary}; retrying in {delay:g}s")
            retries.append((time.monotonic() + delay, name, attempt.number + 1))
            return
        record.status, record.error = "failed", summary
        record.seconds = time.monotonic() - self.started[name]
        logger = RunLogger(record.run_id, self.tracking_uri)
        logger.client.log_text(record.run_id, details, "mlplat/error.txt")
        logger.set_tags({"mlplat.error": summary[:5000], "mlplat.step.attempts": attempt.number})
        logger.end("FAILED")
        attempts = f"{attempt.number} attempt{'s' if attempt.number > 1 else ''}"
        self.log(f"{name}: failed after {attempts}: {summary}")
        if self.failure is None:
            self.failure = (
                f"pipeline {self.graph.pipeline!r} failed: step {name!r} raised {summary} ({attempts}; traceback in MLflow run "
                f"{record.run_id}, mlplat/error.txt); the steps that succeeded are cached, so running it again resumes here"
            )

    def _find_cached(self, base: str) -> tuple[str, Any] | None:
        run_id = cache.find_entry(self.client, self.experiment_id, base)
        if run_id is None:
            return None
        with tempfile.TemporaryDirectory() as tmp:
            path = self.client.download_artifacts(run_id, OUTPUTS_FILE, tmp)
            outputs = from_json(json.loads(Path(path).read_text()))
        return run_id, outputs

    # -- values and bookkeeping -----------------------------------------------------------

    def _resolve(self, value: Any) -> Any:
        """Replace step outputs by the values their steps returned."""

        def resolve(v):
            if not isinstance(v, StepOutput):
                return v
            result = self.outputs[v._node]
            for part in v._path:
                try:
                    result = result[part]
                except (KeyError, IndexError, TypeError):
                    raise PipelineError(f"step {v._node!r} returned no {part!r} (it returned {_short(result)}): check {v.label}") from None
            return result

        return map_values(value, resolve)

    def _finish(self, status: str) -> None:
        summary = {
            "steps": {
                name: {**record.model_dump(), "after": sorted(self.graph.nodes[name].dependencies())}
                for name, record in self.records.items()
            },
        }
        if status == "FINISHED":
            summary["outputs"] = to_json(self._resolve(self.graph.outputs))
        tags = {"mlplat.status": status.lower(), "mlplat.steps.cached": sum(r.status == "cached" for r in self.records.values())}
        if self.failure:
            tags["mlplat.error"] = self.failure[:5000]
        logger = RunLogger(self.run_id, self.tracking_uri)
        logger.log_dict(summary, "pipeline.json")
        logger.set_tags(tags)
        logger.end(status)
        state = {"FINISHED": "succeeded", "FAILED": "failed", "KILLED": "interrupted"}[status]
        self.log(f"{state}: MLflow run {self.run_id} (experiment {self.experiment!r} at {self.tracking_uri})")


def _describe_error(err: BaseException) -> tuple[str, str]:
    """(one line for messages, full text with the remote traceback for error.txt)."""
    cause = getattr(err, "cause", None) or err
    lines = str(cause).strip().splitlines()
    if isinstance(err, ray.exceptions.RayTaskError) and cause is err:  # the cause could not be deserialised
        lines = [line for line in lines if line.strip()][-1:]
    message = lines[0] if lines else ""
    summary = f"{type(cause).__name__}: {message}" if message else type(cause).__name__
    details = str(err) if isinstance(err, ray.exceptions.RayError) else "".join(traceback.format_exception(err))
    return summary, details


def _describe_input(value: Any) -> str:
    text = json.dumps(to_json(value), sort_keys=True)
    return text if len(text) <= 500 else text[:497] + "..."


def _short(value: Any) -> str:
    text = json.dumps(to_json(value))
    return text if len(text) <= 80 else text[:77] + "..."


def _flat(value: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """``{"cfg": {"lr": 1}}`` -> ``{"cfg.lr": "1"}`` (MLflow params)."""
    out: dict[str, str] = {}
    for key, v in value.items():
        if isinstance(v, dict) and ARTIFACT_KEY in v:  # an artifact parameter: its URI
            out[f"{prefix}{key}"] = v["uri"]
        elif isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = v if isinstance(v, str) else json.dumps(v)
    return out


def _log_dataset_inputs(client: MlflowClient, run_id: str, arguments: dict[str, Any]) -> None:
    """Dataset inputs as MLflow dataset entities too: the run page lists them under "Datasets used"."""
    found: list[tuple[str, Dataset]] = []
    for param, value in arguments.items():
        map_values(value, lambda v, p=param: found.append((p, v)) if isinstance(v, Dataset) else None)
    if not found:
        return
    inputs = [
        mlflow.entities.DatasetInput(
            mlflow.entities.Dataset(name=param, digest=hashlib.sha256(d.uri.encode()).hexdigest()[:8], source_type="mlplat", source=d.uri),
            tags=[mlflow.entities.InputTag("mlflow.data.context", "input")],
        )
        for param, d in found
    ]
    client.log_inputs(run_id, datasets=inputs)
