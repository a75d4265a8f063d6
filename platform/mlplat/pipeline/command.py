"""Running one pipeline from the command line: ``mlplat run FILE`` and a pipeline module's ``python -m``
(``Pipeline.main``) share these options and this run."""

from __future__ import annotations

import argparse
import json
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from mlplat.pipeline.definition import Pipeline


def add_run_args(p: argparse.ArgumentParser) -> None:
    """The options of a local run (``mlplat run`` adds the file and ``--pipeline``)."""
    p.add_argument("--param", dest="params", action="append", default=[], metavar="KEY=VALUE",
                   help="a pipeline parameter (YAML value; cfg.max_steps=50 reaches into a config parameter); repeatable")
    p.add_argument("--no-cache", action="store_true", help="run every step, even those with a cached result")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else start a local cluster)")
    p.add_argument("--namespace", help="Ray namespace for the run (set by submit --tenant)")
    p.add_argument("--workdir", help="scratch directory for step files (default: outputs/pipelines/NAME)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show Ray's and MLflow's own logs here (default: in a log file whose path is printed)")


def run_pipeline(pipe: Pipeline, args: argparse.Namespace) -> None:
    """Check the parameters (a one-line error before anything starts), run, print the result as JSON."""
    from mlplat.observability.console import command_terminal, result
    from mlplat.pipeline.artifacts import to_json

    pipe.build(overrides=args.params)
    with command_terminal(f"run-{pipe.name}", args.workdir or "outputs", args.verbose):
        run = pipe.run(overrides=args.params, use_cache=not args.no_cache, address=args.address, namespace=args.namespace,
                       workdir=args.workdir)
        result(json.dumps({"run_id": run.run_id, "experiment": run.experiment, "outputs": to_json(run.outputs)}, indent=2))
