"""The DAG of a pipeline, recorded by calling its function with every step call deferred.

Inside a ``@pipeline`` function a step call adds a node and returns a ``StepOutput``, a
placeholder for the value the step will return; passing it to another step is an edge.
Everything is checked here, before anything runs: arguments bind to the step's signature,
literal arguments are serialisable, and the graph has no cycle.
"""

from __future__ import annotations

import contextvars
import graphlib
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from mlplat.errors import MlplatError
from mlplat.pipeline.artifacts import map_values, to_json

if TYPE_CHECKING:
    from mlplat.pipeline.steps import Step


class PipelineDefinitionError(MlplatError):
    """A pipeline that cannot run as written (bad arguments, a cycle, an unserialisable value)."""


class StepOutput:
    """What a step will return, inside a pipeline definition; index it (``out["model"]``, ``out.model``) for a field."""

    __slots__ = ("_graph", "_node", "_path")

    def __init__(self, graph: Graph, node: str, path: tuple = ()):
        self._graph, self._node, self._path = graph, node, path

    def __getitem__(self, key: str | int) -> StepOutput:
        return StepOutput(self._graph, self._node, (*self._path, key))

    def __getattr__(self, name: str) -> StepOutput:
        if name.startswith("_"):
            raise AttributeError(name)
        return self[name]

    def after(self, *others: StepOutput) -> StepOutput:
        """Run this step only after ``others`` finished, even though it takes none of their outputs."""
        for other in others:
            if not isinstance(other, StepOutput):
                raise PipelineDefinitionError(f"step {self._node!r}: after() takes step outputs, not {type(other).__name__}")
            self._graph.nodes[self._node].after.add(other._node)
        return self

    def __bool__(self):
        raise PipelineDefinitionError(
            f"the output of step {self._node!r} is not known while the pipeline is defined: branch inside a step, not on its output"
        )

    def __iter__(self):
        raise PipelineDefinitionError(f"the output of step {self._node!r} cannot be unpacked while the pipeline is defined: index it")

    def __repr__(self) -> str:
        return f"<output of step {self._node!r}{''.join(f'[{p!r}]' for p in self._path)}>"

    @property
    def label(self) -> str:
        return self._node + "".join(f".{p}" for p in self._path)


@dataclass
class Node:
    name: str
    step: Step
    args: tuple
    kwargs: dict
    after: set[str] = field(default_factory=set)

    def arguments(self) -> dict[str, Any]:
        """Arguments by parameter name (positional ones named by the signature)."""
        return dict(self.step.signature.bind(*self.args, **self.kwargs).arguments)

    def inputs(self) -> set[str]:
        found: set[str] = set()
        map_values((self.args, self.kwargs), lambda v: found.add(v._node) if isinstance(v, StepOutput) else None)
        return found

    def dependencies(self) -> set[str]:
        return self.inputs() | self.after


@dataclass
class Graph:
    pipeline: str
    params: dict[str, Any]
    nodes: dict[str, Node] = field(default_factory=dict)
    outputs: Any = None  # what the pipeline function returned (with StepOutputs in it)

    def add(self, step: Step, args: tuple, kwargs: dict) -> StepOutput:
        name = step.name
        if name in self.nodes:  # the same step used twice: evaluate, evaluate_2, ...
            name = next(f"{step.name}_{i}" for i in range(2, 10_000) if f"{step.name}_{i}" not in self.nodes)
        try:
            step.signature.bind(*args, **kwargs)
        except TypeError as err:
            raise PipelineDefinitionError(f"pipeline {self.pipeline!r}: step {name!r}: {err}") from None
        node = Node(name, step, args, kwargs)
        for param, value in node.arguments().items():
            self._check_argument(name, param, value)
        self.nodes[name] = node
        return StepOutput(self, name)

    def _check_argument(self, node: str, param: str, value: Any) -> None:
        def check(v):
            if isinstance(v, StepOutput):
                if v._graph is not self:
                    raise PipelineDefinitionError(f"step {node!r}: argument {param!r} is an output of another pipeline's step {v._node!r}")
                return
            try:
                to_json(v)
            except Exception:  # noqa: BLE001 - pydantic raises several types for values it cannot serialise
                raise PipelineDefinitionError(
                    f"pipeline {self.pipeline!r}: step {node!r}: argument {param!r} is a {type(v).__name__}, which cannot be "
                    "serialised: pass JSON values, pydantic configs, artifacts (Dataset, Model, Checkpoint) or step outputs"
                ) from None

        map_values(value, check)

    def order(self) -> list[str]:
        """Node names in an order that runs every node after its dependencies; a cycle is an error."""
        sorter = graphlib.TopologicalSorter({name: node.dependencies() for name, node in self.nodes.items()})
        try:
            return list(sorter.static_order())
        except graphlib.CycleError as err:
            cycle = " -> ".join(reversed(err.args[1]))
            raise PipelineDefinitionError(f"pipeline {self.pipeline!r} has a cycle: {cycle}") from None

    def validate(self) -> None:
        for node in self.nodes.values():
            for other in node.after:
                if other not in self.nodes:
                    raise PipelineDefinitionError(f"step {node.name!r} runs after {other!r}, which is not a step of this pipeline")
        self.order()
        map_values(self.outputs, lambda v: self._check_argument("<pipeline return>", "value", v))

    def ancestors(self) -> dict[str, set[str]]:
        result: dict[str, set[str]] = {}
        for name in self.order():
            deps = self.nodes[name].dependencies()
            result[name] = set(deps).union(*(result[d] for d in deps))
        return result

    def peak_resources(self) -> dict[str, float]:
        """An upper bound on what the pipeline's steps hold at once.

        Steps that neither depend on each other nor on a common chain may run together, so for
        each step: its own request plus those of every step it is unordered with; the maximum
        over steps. Exact for a chain (the largest step) and for independent steps (their sum).
        """
        ancestors = self.ancestors()
        peak: dict[str, float] = {}
        for name, node in self.nodes.items():
            concurrent = [
                other for other in self.nodes.values()
                if other.name != name and other.name not in ancestors[name] and name not in ancestors[other.name]
            ]
            total = dict(node.step.settings.requested())
            for other in concurrent:
                for key, amount in other.step.settings.requested().items():
                    total[key] = total.get(key, 0) + amount
            for key, amount in total.items():
                peak[key] = max(peak.get(key, 0), amount)
        return peak


_GRAPH: contextvars.ContextVar[Graph | None] = contextvars.ContextVar("mlplat_pipeline_graph", default=None)


def current_graph() -> Graph | None:
    return _GRAPH.get()


def trace(graph: Graph, fn, kwargs: dict[str, Any]) -> Graph:
    """Call the pipeline function with step calls recorded into ``graph``."""
    token = _GRAPH.set(graph)
    try:
        graph.outputs = fn(**kwargs)
    finally:
        _GRAPH.reset(token)
    graph.validate()
    return graph
