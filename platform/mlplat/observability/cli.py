"""``mlplat dashboards export|install`` and ``mlplat profile``."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlplat.errors import MlplatError

DEFAULT_OUT = "dashboards"


def add_commands(sub) -> None:
    dashboards = sub.add_parser("dashboards", help="Grafana dashboards generated from the metrics catalogue")
    actions = dashboards.add_subparsers(dest="dashboards_command", required=True, metavar="ACTION")
    p = actions.add_parser("export", help="write the dashboards' Grafana JSON (committed under dashboards/)")
    p.add_argument("--out", default=DEFAULT_OUT, help=f"output directory (default: {DEFAULT_OUT}/)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files in --out differ from the catalogue's")
    p = actions.add_parser("install", help="put the dashboards and a Prometheus data source into a Grafana")
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--grafana-url", help="push through Grafana's HTTP API (credential from $GRAFANA_TOKEN, see --token-env)")
    where.add_argument("--to-dir", help="write Grafana file provisioning there, e.g. /tmp/ray/session_latest/metrics/grafana (Ray's)")
    p.add_argument("--prometheus-url", default=None, help="the data source's URL (default: $RAY_PROMETHEUS_HOST or http://localhost:9090)")
    p.add_argument("--token-env", default="GRAFANA_TOKEN", help="environment variable holding a service-account token or user:password")

    p = sub.add_parser("profile", help="profile a few training steps with torch.profiler (trace + top operators in MLflow)")
    p.add_argument("recipe", choices=["sft"], help="the recipe to profile")
    p.add_argument("--config", help="YAML config file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE", help="override a config field (repeatable)")
    p.add_argument("--steps", type=int, default=3, help="steps recorded (default 3)")
    p.add_argument("--wait-steps", type=int, default=2, help="steps skipped before recording (default 2), then one warm-up step")
    p.add_argument("--address", help="Ray cluster address (default: start a local one)")


def run_command(args: argparse.Namespace) -> None:
    if args.command == "dashboards" and args.dashboards_command == "export":
        _export(Path(args.out), args.check)
    elif args.command == "dashboards" and args.dashboards_command == "install":
        import os

        from mlplat.observability import provisioning

        prometheus_url = args.prometheus_url or os.environ.get("RAY_PROMETHEUS_HOST") or provisioning.DEFAULT_PROMETHEUS_URL
        if args.to_dir:
            print(provisioning.dump_json(provisioning.write_provisioning(args.to_dir, prometheus_url)))
        else:
            for url in provisioning.install(args.grafana_url, args.token_env, prometheus_url):
                print(url)
    elif args.command == "profile":
        _profile(args)


def _export(out: Path, check: bool) -> None:
    from mlplat.observability.dashboards import DASHBOARDS, export, render

    if not check:
        for path in export(out):
            print(path)
        return
    stale = [
        name for name, d in DASHBOARDS.items() if not (out / f"{name}.json").is_file() or (out / f"{name}.json").read_text() != render(d)
    ]
    if stale:
        print(f"stale dashboards in {out}: {', '.join(stale)}; run `mlplat dashboards export --out {out}`", file=sys.stderr)
        sys.exit(1)
    print(f"{out}: {len(DASHBOARDS)} dashboards up to date")


def _profile(args: argparse.Namespace) -> None:
    from mlplat.config import load_config
    from mlplat.observability.profiling import ARTIFACT_DIR, TOP_OPERATORS
    from mlplat.runtime import init_ray
    from mlplat.tracking.runs import default_tracking_uri
    from train_apps.sft import SFTConfig, run_sft

    if args.steps <= 0 or args.wait_steps < 0:
        raise MlplatError("--steps must be > 0 and --wait-steps >= 0")
    profile = [f"profile.steps={args.steps}", f"profile.wait_steps={args.wait_steps}"]
    cfg = load_config(SFTConfig, args.config, [*args.overrides, *profile])
    needed = args.wait_steps + 1 + args.steps
    if cfg.max_steps < needed:  # the trace is only written once the schedule completes
        cfg = cfg.model_copy(update={"max_steps": needed})
    init_ray(args.address, cfg.num_workers)
    result = run_sft(cfg)
    import mlflow

    client = mlflow.MlflowClient(default_tracking_uri())
    local = client.download_artifacts(result.run_id, f"{ARTIFACT_DIR}/{TOP_OPERATORS}")
    print(Path(local).read_text())
    print(f"trace: MLflow run {result.run_id}, artifacts {ARTIFACT_DIR}/trace.json (open in https://ui.perfetto.dev)")
