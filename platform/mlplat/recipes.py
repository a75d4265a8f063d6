"""Training recipes, found through the ``mlplat.recipes`` entry-point group.

A distribution registers a recipe in its ``pyproject.toml``::

    [project.entry-points."mlplat.recipes"]
    sft = "train_apps.sft:RECIPE"

where ``RECIPE = Recipe("sft", SFTConfig, run_sft)``. ``mlplat train NAME`` and the recipe's own
``python -m train_apps.NAME`` both run it through :func:`run`; nothing here names a recipe, and a
recipe's module is imported only when it runs (its help is the first line of its docstring, read
from the file, so ``mlplat --help`` imports neither torch nor Ray).
"""

from __future__ import annotations

import argparse
import ast
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path
from typing import Any

from mlplat.errors import MlplatError, exit_on_user_error

GROUP = "mlplat.recipes"


@dataclass(frozen=True)
class Recipe:
    """A training recipe: its name, its config class (a ``RecipeConfig``) and ``run(cfg) -> result``."""

    name: str
    config: type
    run: Callable[..., Any]


def registered() -> dict[str, EntryPoint]:
    """The recipes installed, by name (in the order their distributions declare them)."""
    found: dict[str, EntryPoint] = {}
    for ep in entry_points(group=GROUP):
        found.setdefault(ep.name, ep)
    return found


def summary(ep: EntryPoint) -> str:
    """The first line of the recipe module's docstring, read without importing the module."""
    try:
        spec = importlib.util.find_spec(ep.module)
        origin = spec.origin if spec else None
        doc = ast.get_docstring(ast.parse(Path(origin).read_text())) if origin and origin.endswith(".py") else None
    except (ImportError, OSError, SyntaxError, ValueError):
        doc = None
    line = doc.strip().splitlines()[0].rstrip(".") if doc else ep.value
    return f"{line} ({ep.module})"


def load(name: str) -> Recipe:
    recipes = registered()
    if name not in recipes:
        raise MlplatError(f"no recipe {name!r} (installed: {', '.join(recipes) or 'none'}; after adding one: pip install -e .)")
    recipe = recipes[name].load()
    if not isinstance(recipe, Recipe):
        raise MlplatError(f"entry point {name} = {recipes[name].value} is a {type(recipe).__name__}, not an mlplat.recipes.Recipe")
    return recipe


def add_args(p: argparse.ArgumentParser) -> None:
    """A recipe's command-line options: the same for ``mlplat train NAME`` and ``python -m train_apps.NAME``."""
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set optim.lr=3e-4 (repeatable)")
    p.add_argument("--address", help="Ray cluster address (default: start a local one)")
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show Ray's, Ray Train's and MLflow's own logs here (default: in a log file whose path is printed)")


def run(recipe: Recipe, args: argparse.Namespace) -> None:
    """Load the config (errors before anything starts), then run the recipe and print its result."""
    from mlplat.config import load_config
    from mlplat.observability.console import command_terminal, result
    from mlplat.runtime import init_ray

    cfg = load_config(recipe.config, args.config, args.overrides)
    with command_terminal(f"train-{recipe.name}", "outputs", args.verbose):
        if args.address:  # without one, the recipe starts a local cluster itself, after checking its inputs
            init_ray(args.address, cfg.num_workers)
        result(recipe.run(cfg).model_dump_json(indent=2))


def main(name: str, argv: Sequence[str] | None = None) -> None:
    """``python -m train_apps.NAME [--config FILE] [--set K=V] ...``: the same as ``mlplat train NAME``."""
    ep = registered().get(name)
    parser = argparse.ArgumentParser(prog=f"python -m {ep.module if ep else name}", description=summary(ep) if ep else None)
    add_args(parser)
    args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
    exit_on_user_error(lambda: run(load(name), args))
