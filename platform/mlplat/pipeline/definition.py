"""``@pipeline``: a function that wires steps together; its parameters are the pipeline's.

    @pipeline(experiment="demo")
    def demo(rows: int = 100):
        data = make_data(rows)
        return {"model": train(data)}

    demo.run(overrides=["rows=1000"])          # on the connected (or a new local) Ray cluster
    python -m pipelines.demo --param rows=1000  # the same, from a module with demo.main()
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, create_model

from mlplat.config import Config, apply_overrides, parse_override, validate
from mlplat.errors import ConfigError
from mlplat.pipeline.graph import Graph, trace

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")


class _Parameters(Config):
    model_config = ConfigDict(**Config.model_config, arbitrary_types_allowed=True)


class Pipeline:
    def __init__(self, fn: Callable, name: str | None = None, experiment: str | None = None):
        self.fn = fn
        self.name = name or fn.__name__
        if not NAME.match(self.name):
            raise ConfigError(f"@pipeline {fn.__qualname__}: name {self.name!r}: use letters, digits, '_', '.', '-'")
        self.experiment = experiment or f"pipeline-{self.name}"
        try:  # string annotations (from __future__ import annotations) as types, to validate parameters
            self.signature = inspect.signature(fn, eval_str=True)
        except Exception:  # noqa: BLE001 - an annotation only a type checker can resolve
            self.signature = inspect.signature(fn)
        self.__doc__ = fn.__doc__

    def resolve_params(self, params: dict[str, Any] | None = None, overrides: Sequence[str] = ()) -> dict[str, Any]:
        """Typed parameter values from ``params`` and ``KEY=VALUE`` overrides (``cfg.max_steps=5`` reaches into a config)."""
        params = dict(params or {})
        known = self.signature.parameters
        for key in [*params, *(parse_override(o)[0][0] for o in overrides)]:
            if key not in known:
                raise ConfigError(f"pipeline {self.name!r}: unknown parameter {key!r} (parameters: {', '.join(known) or 'none'})")
        # Overrides edit the JSON form of a parameter, so a config default can be changed field by field.
        touched = {parse_override(o)[0][0] for o in overrides}
        data = {}
        for key in touched:
            base = params.get(key, known[key].default)
            data[key] = base.model_dump() if isinstance(base, BaseModel) else ({} if base is inspect.Parameter.empty else base)
        data = apply_overrides(data, list(overrides))
        provided = {**params, **data}
        for key, parameter in known.items():
            if key not in provided and parameter.default is inspect.Parameter.empty:
                raise ConfigError(f"pipeline {self.name!r}: missing parameter {key!r}: pass --param {key}=VALUE")
        try:
            validated = validate(self._parameters_model(), provided, f"pipeline {self.name!r}: parameter")
        except ConfigError as err:
            raise ConfigError(str(err).replace("\n", "; ")) from None
        return {key: getattr(validated, key) for key in known}

    def _parameters_model(self) -> type[Config]:
        """The function's parameters as a config class, so values validate like any config."""
        fields = {}
        for key, parameter in self.signature.parameters.items():
            annotation = parameter.annotation
            if annotation is inspect.Parameter.empty or isinstance(annotation, str):  # none, or not resolvable
                annotation = Any
            fields[key] = (annotation, ... if parameter.default is inspect.Parameter.empty else parameter.default)
        return create_model(f"{self.name}_parameters", __base__=_Parameters, **fields)

    def build(self, params: dict[str, Any] | None = None, overrides: Sequence[str] = ()) -> Graph:
        """The validated DAG for these parameters; nothing runs."""
        values = self.resolve_params(params, overrides)
        return trace(Graph(self.name, values), self.fn, values)

    def run(
        self,
        params: dict[str, Any] | None = None,
        *,
        overrides: Sequence[str] = (),
        use_cache: bool = True,
        address: str | None = None,
        namespace: str | None = None,
        workdir: str | Path | None = None,
        tracking_uri: str | None = None,
    ):
        """Build, validate and run on Ray; returns a ``PipelineResult`` (outputs, MLflow run ids)."""
        from mlplat.pipeline.executor import run_graph

        graph = self.build(params, overrides)
        return run_graph(
            graph,
            experiment=self.experiment,
            use_cache=use_cache,
            address=address,
            namespace=namespace,
            workdir=workdir,
            tracking_uri=tracking_uri,
            code_root=_code_root(self.fn),
        )

    def main(self, argv: list[str] | None = None) -> None:
        """``python -m package.module --param k=v [--no-cache]``: the same as ``mlplat run FILE``."""
        import argparse

        from mlplat.errors import exit_on_user_error
        from mlplat.pipeline.command import add_run_args, run_pipeline

        parser = argparse.ArgumentParser(prog=f"python -m {self.fn.__module__}", description=f"run pipeline {self.name!r}")
        add_run_args(parser)
        args = parser.parse_args(sys.argv[1:] if argv is None else argv)
        # Loaded again from its file under its package path, so step workers import the same module.
        exit_on_user_error(lambda: run_pipeline(load_pipeline(inspect.getsourcefile(self.fn), self.name), args))

    def __repr__(self) -> str:
        return f"<pipeline {self.name}>"


def pipeline(fn: Callable | None = None, *, name: str | None = None, experiment: str | None = None):
    """``@pipeline`` or ``@pipeline(name=..., experiment=...)`` (MLflow experiment; default ``pipeline-<name>``)."""

    def wrap(f: Callable) -> Pipeline:
        return Pipeline(f, name, experiment)

    return wrap(fn) if fn is not None else wrap


def _code_root(fn: Callable) -> str | None:
    """The directory from which the function's module imports (above its packages), for step workers."""
    module = sys.modules.get(fn.__module__)
    file = getattr(module, "__file__", None)
    if not file:
        return None
    root = Path(file).resolve().parent
    for _ in fn.__module__.split(".")[1:]:
        root = root.parent
    return str(root)


def load_pipeline(file: str | Path, name: str | None = None) -> Pipeline:
    """The ``@pipeline`` of a .py file (``name``: which one, when it defines several)."""
    from mlplat.errors import MlplatError
    from mlplat.pipeline.loader import import_file

    module = import_file(file)
    pipelines = {p.name: p for p in vars(module).values() if isinstance(p, Pipeline)}
    if name is not None:
        if name not in pipelines:
            raise MlplatError(f"{file}: no pipeline named {name!r} (found: {', '.join(pipelines) or 'none'})")
        return pipelines[name]
    if not pipelines:
        raise MlplatError(f"{file}: no @pipeline found (decorate the function that wires the steps with @pipeline)")
    if len(pipelines) > 1:
        raise MlplatError(f"{file}: several pipelines ({', '.join(pipelines)}): choose one with --pipeline NAME")
    return next(iter(pipelines.values()))
