"""``@step``: a function that runs as one Ray task of a pipeline.

Its options say what the task holds (CPUs, GPUs, memory, custom resources such as
``rdma``), how often a failure is retried and after how long a wait, when an attempt is
given up as timed out, and whether a previous successful run may stand in for it.
Outside a pipeline definition a step is the plain function, so it can be called directly.
"""

from __future__ import annotations

import ast
import contextvars
import functools
import hashlib
import inspect
import textwrap
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from mlflow.entities import Metric, RunTag
from mlflow.tracking import MlflowClient
from pydantic import BaseModel, ByteSize, Field

from mlplat.config import Config, validate
from mlplat.pipeline import cache  # noqa: F401 - notes when a worker loaded the runner (before the step's modules)


class StepOptions(Config):
    num_cpus: float = Field(default=1, ge=0)
    num_gpus: float = Field(default=0, ge=0)
    memory: ByteSize | None = None  # bytes or "4GiB": Ray schedules by it, it is not a limit
    resources: dict[str, float] = Field(default_factory=dict)  # custom node resources, e.g. {"rdma": 1}
    # What the Ray Train / Serve work the step starts will hold (its workers, not this task),
    # e.g. {"CPU": 2}; counted when a tenant's quota is checked at submission.
    launches: dict[str, float] = Field(default_factory=dict)
    retries: int = Field(default=0, ge=0)  # extra attempts after a failure or a timeout
    retry_backoff_s: float = Field(default=1.0, ge=0)  # wait before the first retry; doubles each time
    timeout_s: float | None = Field(default=None, gt=0)  # per attempt; the task is cancelled after it
    cache: bool = True  # reuse the outputs of a successful run with the same code and inputs (mlplat.pipeline.cache)
    version: str = ""  # part of the cache key: bump it for what the key cannot see (e.g. code only a subprocess imports)
    name: str | None = None  # the step's name in the pipeline (default: the function's)

    def ray_options(self) -> dict[str, Any]:
        options: dict[str, Any] = {"num_cpus": self.num_cpus, "num_gpus": self.num_gpus, "max_retries": 0}
        if self.memory is not None:
            options["memory"] = int(self.memory)
        if self.resources:
            options["resources"] = dict(self.resources)
        return options

    def requested(self) -> dict[str, float]:
        """Everything the step occupies while it runs: its task plus the work it launches."""
        total = {"CPU": self.num_cpus, "GPU": self.num_gpus, **self.resources}
        for key, amount in self.launches.items():
            total[key] = total.get(key, 0) + amount
        return {k: v for k, v in total.items() if v}


class Step:
    """A step function with its options; ``.options(...)`` returns a copy with some changed."""

    def __init__(self, fn: Callable, options: StepOptions):
        functools.update_wrapper(self, fn)
        self.fn = fn
        self.settings = options
        self.signature = inspect.signature(fn)

    @property
    def name(self) -> str:
        return self.settings.name or self.fn.__name__

    def options(self, **changes) -> Step:
        merged = {**self.settings.model_dump(exclude_unset=True), **changes}
        return Step(self.fn, validate(StepOptions, merged, f"step {self.fn.__name__!r} options"))

    @functools.cached_property
    def code_hash(self) -> str:
        return code_hash(self.fn)

    def __call__(self, *args, **kwargs):
        from mlplat.pipeline.graph import current_graph

        graph = current_graph()
        if graph is None:
            return self.fn(*args, **kwargs)
        return graph.add(self, args, kwargs)

    def __repr__(self) -> str:
        return f"<step {self.name}>"


def step(fn: Callable | None = None, **options) -> Step | Callable[[Callable], Step]:
    """``@step`` or ``@step(num_cpus=2, retries=3, timeout_s=600, cache=False, ...)``; see ``StepOptions``."""

    def wrap(f: Callable) -> Step:
        return Step(f, validate(StepOptions, options, f"@step of {f.__qualname__}"))

    return wrap(fn) if fn is not None else wrap


def code_hash(fn: Callable) -> str:
    """Hash of the function's source without its decorators or comments (they do not change results)."""
    try:
        source = textwrap.dedent(inspect.getsource(fn))
        tree = ast.parse(source)
        node = tree.body[0]
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            node.decorator_list = []
        text = ast.unparse(tree)
    except (OSError, TypeError, SyntaxError, IndexError):  # no source (e.g. defined in a REPL): the bytecode
        text = repr(fn.__code__.co_code) + repr(fn.__code__.co_consts)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


class StepContext(BaseModel):
    """What a running step knows about itself; ``step_context()`` inside a step returns it."""

    pipeline: str
    step: str
    run_id: str  # this step's MLflow run (a child of the pipeline's run)
    parent_run_id: str
    experiment: str
    tracking_uri: str
    workdir: str  # scratch space for this step on the node running it
    attempt: int = 1

    @property
    def client(self) -> MlflowClient:
        return MlflowClient(self.tracking_uri)

    def log_metrics(self, metrics: dict[str, float], step: int = 0) -> None:
        """Metrics on this step's run."""
        timestamp = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, float(v), timestamp, step) for k, v in metrics.items()])

    def nest(self, run_id: str) -> None:
        """Show another run (e.g. the training run a recipe started) under this step in the MLflow UI."""
        tags = {"mlflow.parentRunId": self.run_id, "mlplat.pipeline": self.pipeline, "mlplat.step": self.step}
        self.client.log_batch(run_id, tags=[RunTag(k, v) for k, v in tags.items()])


_CURRENT: contextvars.ContextVar[StepContext | None] = contextvars.ContextVar("mlplat_step_context", default=None)


def step_context() -> StepContext:
    context = _CURRENT.get()
    if context is None:
        raise RuntimeError("step_context() is only available inside a step run by a pipeline")
    return context


def execute_step(
    fn: Callable, args: tuple, kwargs: dict, context: StepContext, lineage: dict[str, str]
) -> tuple[Any, dict[str, str]]:
    """The body of a step's Ray task: run the function, publish its file outputs to MLflow, and
    list the project modules this process loaded with their hashes (the code its cache entry covers)."""
    from mlplat.pipeline.artifacts import publish
    from mlplat.pipeline.cache import loaded_project_modules

    Path(context.workdir).mkdir(parents=True, exist_ok=True)
    token = _CURRENT.set(context)
    try:
        result = fn(*args, **kwargs)
    finally:
        _CURRENT.reset(token)
    return publish(result, context.client, context.run_id, lineage), loaded_project_modules()
