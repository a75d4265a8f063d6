"""The ``mlplat`` command. Errors the user can fix print as one line (exit 2), not a traceback."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from mlplat import recipes
from mlplat.errors import MlplatError, exit_on_user_error


def add_verbose_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument("-v", "--verbose", action="store_true",
                   help="show Ray's, Ray Train's and MLflow's own logs here (default: in a log file whose path is printed)")


def _add_config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config field, e.g. --set optim.lr=3e-4 (repeatable)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlplat", description="LLM training and serving on Ray, tracked in MLflow.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = sub.add_parser("quickstart", help="demo data -> tiny model -> SFT on Ray Train -> MLflow -> eval")
    _add_config_args(p)
    p.add_argument("--address", help="Ray cluster address (default: start a local one)")
    add_verbose_arg(p)

    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True, metavar="ACTION")
    p = data.add_parser("demo", help="write the demo JSONL splits (sft, eval, preferences, rl_prompts)")
    p.add_argument("--out", required=True, help="output directory")
    _add_config_args(p)

    model = sub.add_parser("model", help="model checkpoints").add_subparsers(dest="model_command", required=True, metavar="ACTION")
    p = model.add_parser("tiny", help="make a tiny Llama checkpoint (HF format) with a tokenizer trained on a chat JSONL")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--corpus", required=True, help="chat JSONL whose texts train the tokenizer")
    _add_config_args(p)
    p = model.add_parser("export", help="write a servable HF checkpoint (LoRA merged) from a training checkpoint")
    p.add_argument("--checkpoint", required=True, help="a Ray Train checkpoint directory of an mlplat run")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--base-model", help="the base HF checkpoint, if it moved since training")
    p = model.add_parser("resolve", help="print the local directory of a path or models:/NAME/VERSION|@ALIAS")
    p.add_argument("uri")

    train = sub.add_parser("train", help="training recipes").add_subparsers(dest="recipe", required=True, metavar="RECIPE")
    for name, ep in recipes.registered().items():  # the mlplat.recipes entry points; no recipe is imported here
        recipes.add_args(train.add_parser(name, help=recipes.summary(ep)))

    p = sub.add_parser("serve", help="serve a model over the OpenAI API on Ray Serve (PD-disaggregated or colocated)")
    _add_config_args(p)
    p.add_argument("--address", help="Ray cluster address (default: start a local one)")
    p.add_argument("--print-config", action="store_true",
                   help="engine: vllm: print the Ray Serve LLM config (YAML for `serve deploy`) and exit; starts no Ray")

    p = sub.add_parser("eval", help="exact-match accuracy of a model on held-out prompts")
    p.add_argument("--model", required=True, help="HF checkpoint directory or models:/NAME/VERSION|@ALIAS")
    p.add_argument("--data", required=True, help="eval JSONL with 'messages' and 'answer'")
    p.add_argument("--limit", type=int, help="evaluate only the first N rows")

    from mlplat.pipeline.cli import add_commands as add_pipeline_commands

    add_pipeline_commands(sub)  # run, submit, jobs, cache

    from mlplat.cluster.cli import add_commands as add_cluster_commands

    add_cluster_commands(sub)  # cluster render, cluster validate

    from mlplat.health.cli import add_commands as add_health_commands

    add_health_commands(sub)  # health check, health nodes, health unmark

    from mlplat.observability.cli import add_commands as add_observability_commands

    add_observability_commands(sub)  # dashboards export|install, alerts export, profile
    return parser


def _run(args: argparse.Namespace) -> None:
    from mlplat.config import load_config

    if args.command == "quickstart":
        from mlplat.observability.console import command_terminal
        from pipelines.quickstart import QuickstartConfig, run_quickstart

        cfg = load_config(QuickstartConfig, args.config, args.overrides)
        with command_terminal("quickstart", cfg.workdir, args.verbose):
            run_quickstart(cfg, address=args.address)
    elif args.command == "data":
        from mlplat.data.demo import DemoDataConfig, write_demo_data

        paths = write_demo_data(args.out, load_config(DemoDataConfig, args.config, args.overrides))
        print(json.dumps({k: str(v) for k, v in paths.model_dump().items()}, indent=2))
    elif args.command == "model" and args.model_command == "tiny":
        from mlplat.data.demo import tokenizer_corpus
        from mlplat.models import TinyModelConfig, build_tiny_model

        if not Path(args.corpus).is_file():
            raise MlplatError(f"{args.corpus}: corpus file not found")
        print(build_tiny_model(args.out, tokenizer_corpus(args.corpus), load_config(TinyModelConfig, args.config, args.overrides)))
    elif args.command == "model" and args.model_command == "export":
        from mlplat.train.checkpoint import export_checkpoint

        print(export_checkpoint(Path(args.checkpoint), Path(args.out), args.base_model))
    elif args.command == "model" and args.model_command == "resolve":
        from mlplat.tracking import resolve_model

        print(resolve_model(args.uri))
    elif args.command == "train":
        recipes.run(recipes.load(args.recipe), args)
    elif args.command == "serve":
        from mlplat.serve.config import ServeConfig

        cfg = load_config(ServeConfig, args.config, args.overrides)
        if args.print_config:
            from mlplat.serve.vllm_backend import serve_config_yaml

            print(serve_config_yaml(cfg), end="")
            return
        _serve(cfg, args.address)
    elif args.command == "eval":
        from mlplat.evaluation import evaluate_exact_match
        from mlplat.tracking import resolve_model

        result = evaluate_exact_match(resolve_model(args.model), args.data, limit=args.limit)
        print(result.model_dump_json(indent=2))
    elif args.command in ("run", "submit", "jobs", "cache"):
        from mlplat.pipeline.cli import run_command

        run_command(args)
    elif args.command == "cluster":
        from mlplat.cluster.cli import run_command as run_cluster_command

        run_cluster_command(args)
    elif args.command == "health":
        from mlplat.health.cli import run_command as run_health_command

        run_health_command(args)
    elif args.command in ("dashboards", "alerts", "profile"):
        from mlplat.observability.cli import run_command as run_observability_command

        run_observability_command(args)


def _serve(cfg, address: str | None) -> None:
    """Deploy and wait; Ctrl-C stops it in every state, deploying included."""
    import signal
    import threading

    import ray

    from mlplat.runtime import init_ray
    from mlplat.serve.config import fit_to_cluster
    from serve_apps.llm import run as run_app

    init_ray(address, num_training_workers=0)
    # Ctrl-C can land inside library code that swallows KeyboardInterrupt (a broad except around an
    # import, say): the flag remembers it, and the app is stopped as soon as the deploy call returns.
    interrupted = threading.Event()

    def on_sigint(signum, frame):
        interrupted.set()
        raise KeyboardInterrupt

    signal.signal(signal.SIGINT, on_sigint)
    try:
        resources = ray.cluster_resources()
        try:
            cfg, note = fit_to_cluster(cfg, resources.get("CPU", 0.0), resources.get("GPU", 0.0))
        except ValueError as err:
            raise MlplatError(str(err)) from None
        if note:
            print(f"mlplat serve: {note}", flush=True)
        print("deploying (Ctrl-C to stop) ...", flush=True)
        url = run_app(cfg)
        if interrupted.is_set():
            raise KeyboardInterrupt
        print(f"OpenAI API at {url} (Ctrl-C to stop)", flush=True)
        interrupted.wait()  # Ctrl-C's handler raises KeyboardInterrupt out of the wait
        raise KeyboardInterrupt
    except KeyboardInterrupt:
        print("stopping ...", file=sys.stderr, flush=True)
        from ray import serve

        try:
            serve.delete(cfg.app_name)
        except Exception:  # noqa: BLE001  (interrupted before Serve started: nothing to delete)
            pass
        raise SystemExit(130) from None  # the shell's code for "stopped by Ctrl-C"
    finally:
        ray.shutdown()


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    exit_on_user_error(lambda: _run(args))


if __name__ == "__main__":
    main()
