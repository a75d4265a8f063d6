"""Pipeline SDK: steps as Ray tasks, wired by passing outputs, tracked and cached in MLflow.

    from mlplat.pipeline import Dataset, pipeline, step, step_context

    @step(num_cpus=1, retries=2)
    def make_data(rows: int) -> Dataset:
        out = Path(step_context().workdir) / "data"
        ...                                   # write files
        return Dataset(out)                   # logged to MLflow, passed on as runs:/... URI

    @step(num_gpus=1, timeout_s=3600)
    def train(data: Dataset) -> Model:
        files = data.local_path()
        ...

    @pipeline(experiment="demo")
    def demo(rows: int = 1000):
        return {"model": train(make_data(rows))}

``mlplat run FILE --param rows=10`` runs it on a local (or ``--address``) Ray cluster;
``mlplat submit FILE --address http://HEAD:8265`` runs it as a Ray job.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Imported on first use: `mlplat --help` and `mlplat submit` must not wait for Ray and MLflow to import.
_EXPORTS = {
    "mlplat.pipeline.artifacts": ["Artifact", "Checkpoint", "Dataset", "Model"],
    "mlplat.pipeline.graph": ["PipelineDefinitionError", "StepOutput"],
    "mlplat.pipeline.definition": ["Pipeline", "pipeline"],
    "mlplat.pipeline.executor": ["PipelineError", "PipelineResult"],
    "mlplat.pipeline.steps": ["Step", "StepContext", "StepOptions", "step", "step_context"],
}
_MODULE_OF = {name: module for module, names in _EXPORTS.items() for name in names}
__all__ = [  # noqa: RUF022 - grouped as in _EXPORTS
    "Artifact", "Checkpoint", "Dataset", "Model",
    "PipelineDefinitionError", "StepOutput",
    "Pipeline", "pipeline",
    "PipelineError", "PipelineResult",
    "Step", "StepContext", "StepOptions", "step", "step_context",
]

if TYPE_CHECKING:
    from mlplat.pipeline.artifacts import Artifact, Checkpoint, Dataset, Model
    from mlplat.pipeline.definition import Pipeline, pipeline
    from mlplat.pipeline.executor import PipelineError, PipelineResult
    from mlplat.pipeline.graph import PipelineDefinitionError, StepOutput
    from mlplat.pipeline.steps import Step, StepContext, StepOptions, step, step_context


def __getattr__(name: str):
    if name not in _MODULE_OF:
        raise AttributeError(f"module 'mlplat.pipeline' has no attribute {name!r}")
    return getattr(importlib.import_module(_MODULE_OF[name]), name)
