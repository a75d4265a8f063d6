"""``mlplat run``, ``mlplat submit``, ``mlplat jobs`` and ``mlplat cache``: the pipeline part of the ``mlplat`` command."""

from __future__ import annotations

import argparse
import os
from datetime import datetime

from mlplat.pipeline.command import add_run_args, run_pipeline

COMMANDS = ("run", "submit", "jobs", "cache")


def _add_pipeline_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("file", help="a .py file defining a @pipeline, e.g. pipelines/quickstart.py")
    p.add_argument("--pipeline", help="which @pipeline, when the file defines several")
    p.add_argument("--param", dest="params", action="append", default=[], metavar="KEY=VALUE",
                   help="a pipeline parameter (YAML value; cfg.max_steps=50 reaches into a config parameter); repeatable")
    p.add_argument("--no-cache", action="store_true", help="run every step, even those with a cached result")


def _add_cluster_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--address", help="Ray Jobs API, e.g. http://HEAD:8265 (default: RAY_ADDRESS if http, else http://127.0.0.1:8265)")
    p.add_argument("--auth-token-file", help="Ray auth token file (default: RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, "
                   "or ~/.ray/auth_token with RAY_AUTH_MODE=token)")


def add_commands(sub) -> None:
    p = sub.add_parser("run", help="run a pipeline on a local Ray cluster (or --address)")
    p.add_argument("file", help="a .py file defining a @pipeline, e.g. pipelines/quickstart.py")
    p.add_argument("--pipeline", help="which @pipeline, when the file defines several")
    add_run_args(p)  # --param, --no-cache, --address, ...: the same as a pipeline module's python -m

    p = sub.add_parser("submit", help="run a pipeline as a Ray job on a cluster (Jobs API)")
    _add_pipeline_args(p)
    _add_cluster_args(p)
    p.add_argument("--follow", action="store_true", help="stream the job's logs until it ends; fail if it fails")
    p.add_argument("--working-dir", default=".", help="project directory uploaded as the job's working_dir (default: .)")
    p.add_argument("--env", action="append", default=[], metavar="NAME=VALUE", help="environment variable for the job; repeatable")
    p.add_argument("--tenant", help="run in this tenant's namespace, within its quota (see --tenants-file)")
    p.add_argument("--tenants-file", help="tenants and quotas (default: MLPLAT_TENANTS_FILE, else cluster_configs/tenants.yaml)")
    p.add_argument("--entrypoint-num-cpus", type=float, help="CPUs reserved for the job's driver")
    p.add_argument("--entrypoint-num-gpus", type=float, help="GPUs reserved for the job's driver")

    jobs = sub.add_parser("jobs", help="Ray jobs on a cluster").add_subparsers(dest="jobs_command", required=True, metavar="ACTION")
    p = jobs.add_parser("list", help="jobs with their status and tenant")
    _add_cluster_args(p)
    p.add_argument("--tenant", help="only this tenant's jobs")
    p = jobs.add_parser("logs", help="a job's logs")
    p.add_argument("job_id")
    _add_cluster_args(p)
    p.add_argument("--follow", action="store_true", help="stream until the job ends")
    p = jobs.add_parser("stop", help="stop a job")
    p.add_argument("job_id")
    _add_cluster_args(p)

    cache = sub.add_parser("cache", help="cached step results: list them, take them out of the cache")
    cache = cache.add_subparsers(dest="cache_command", required=True, metavar="ACTION")
    p = cache.add_parser("ls", help="cache entries: step, key, created, size of outputs, modules the key covers")
    _add_cache_args(p)
    p = cache.add_parser("rm", help="take entries out of the cache (their runs and outputs stay in MLflow)")
    p.add_argument("target", nargs="?", help="a step (STEP or PIPELINE.STEP), a key (or its first 6+ characters) or a run id")
    p.add_argument("--all", action="store_true", help="every entry (of --experiment, if given)")
    _add_cache_args(p)


def _add_cache_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--experiment", help="only this MLflow experiment (a pipeline's: pipeline-NAME unless it names one)")
    p.add_argument("--tracking-uri", help="MLflow tracking URI (default: MLFLOW_TRACKING_URI, else sqlite:///mlflow.db)")


def run_command(args: argparse.Namespace) -> None:
    if args.command == "run":
        from mlplat.pipeline.definition import load_pipeline

        run_pipeline(load_pipeline(args.file, args.pipeline), args)
        return

    if args.command == "cache":
        _cache_command(args)
        return

    from mlplat.pipeline.jobs import Jobs, submit_pipeline

    if args.command == "submit":
        submit_pipeline(
            args.file,
            address=args.address,
            pipeline_name=args.pipeline,
            overrides=args.params,
            use_cache=not args.no_cache,
            working_dir=args.working_dir,
            env=args.env,
            tenant=args.tenant,
            tenants_file=args.tenants_file,
            entrypoint_num_cpus=args.entrypoint_num_cpus,
            entrypoint_num_gpus=args.entrypoint_num_gpus,
            token_file=args.auth_token_file,
            follow=args.follow,
        )
        return
    jobs = Jobs(args.address, args.auth_token_file)
    if args.jobs_command == "list":
        print(f"{'SUBMISSION ID':<40} {'STATUS':<10} {'TENANT':<12} {'STARTED':<19} ENTRYPOINT")
        for job in jobs.list(args.tenant):
            started = datetime.fromtimestamp(job.start_time / 1000).strftime("%Y-%m-%d %H:%M:%S") if job.start_time else "-"
            tenant = (job.metadata or {}).get("mlplat.tenant", "-")
            print(f"{job.submission_id or job.job_id or '-':<40} {job.status.value:<10} {tenant:<12} {started:<19} {job.entrypoint}")
    elif args.jobs_command == "logs":
        if args.follow:
            jobs.follow(args.job_id)
        else:
            print(jobs.logs(args.job_id), end="")
    elif args.jobs_command == "stop":
        stopped = jobs.stop(args.job_id)
        print(f"stopping job {args.job_id}" if stopped else f"job {args.job_id} was not running ({jobs.status(args.job_id).lower()})")


def _cache_command(args: argparse.Namespace) -> None:
    from mlflow.tracking import MlflowClient

    from mlplat.errors import MlplatError
    from mlplat.pipeline import cache
    from mlplat.tracking import default_tracking_uri

    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # one small file per entry
    client = MlflowClient(args.tracking_uri or default_tracking_uri())
    entries = cache.list_entries(client, args.experiment)
    if args.cache_command == "ls":
        print(f"{'STEP':<32} {'KEY':<12} {'CREATED':<19} {'SIZE':>10}  DEPENDENCIES")
        for e in entries:
            created = datetime.fromtimestamp(e.created).strftime("%Y-%m-%d %H:%M:%S")
            print(f"{e.pipeline + '.' + e.step:<32} {e.key[:12]:<12} {created:<19} {cache.format_size(e.size):>10}  {e.summary()}")
        return
    if args.all == bool(args.target):
        raise MlplatError("cache rm: name a step, a key or a run id, or pass --all (not both)")
    chosen = entries if args.all else cache.select(entries, args.target)
    if not chosen and not args.all:
        raise MlplatError(f"cache rm: no cache entry matches {args.target!r} (see mlplat cache ls)")
    cache.remove_entries(client, chosen)
    print(f"removed {len(chosen)} cache entr{'y' if len(chosen) == 1 else 'ies'}")
