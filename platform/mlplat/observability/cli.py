"""``mlplat dashboards export|install``, ``mlplat alerts export`` and ``mlplat profile engine``
(training steps: the recipes' ``profile:`` field)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlplat.errors import MlplatError

DEFAULT_OUT = "dashboards"
ALERTS_OUT, MONITORING_OUT = "alerts", "cluster_configs/monitoring"
PROFILE_EXPERIMENT = "mlplat-profile"  # engine profiles; SFT profiles live in their SFT run


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

    alerts = sub.add_parser("alerts", help="Prometheus alert and recording rules, and Kubernetes monitoring manifests, from the catalogue")
    actions = alerts.add_subparsers(dest="alerts_command", required=True, metavar="ACTION")
    p = actions.add_parser("export", help="write the rule file and its promtool tests (alerts/) and the PodMonitors, PrometheusRule and "
                                          "dashboard ConfigMaps (cluster_configs/monitoring/)")
    p.add_argument("--out", default=ALERTS_OUT, help=f"rules and promtool tests (default: {ALERTS_OUT}/)")
    p.add_argument("--monitoring-out", default=MONITORING_OUT, help=f"Kubernetes manifests (default: {MONITORING_OUT}/)")
    p.add_argument("--check", action="store_true", help="write nothing; exit 1 if the files differ from what the catalogue gives")

    profile = sub.add_parser("profile", help="profile a few inference engine steps with torch.profiler (trace + top operators in MLflow); for training steps set profile: in the recipe config")
    targets = profile.add_subparsers(dest="target", required=True, metavar="TARGET", help="what to profile")
    p = targets.add_parser(
        "engine",
        help="the native inference engine's steps on synthetic prompts, in experiment " + PROFILE_EXPERIMENT,
        description="Steps the native engine on synthetic prompts under torch.profiler. An engine step mixes prefill chunks and "
        "decodes: the first steps are prefill-heavy, later ones pure decode. The first step is never recorded (skipped or the "
        "warm-up), so to see prefill spread it over steps: --wait-steps 0 --set max_num_batched_tokens=128. See docs/observability.md.",
    )
    p.add_argument("--model", required=True, help="HF checkpoint directory or models:/NAME/VERSION|@ALIAS")
    p.add_argument("--prompts", type=int, default=8, help="requests submitted at once (default 8)")
    p.add_argument("--prompt-len", type=int, default=64, help="tokens per prompt, random from the vocabulary, seeded (default 64)")
    p.add_argument("--max-tokens", type=int, default=32, help="tokens per request, EOS ignored; raised to cover the schedule (default 32)")
    p.add_argument("--steps", type=int, default=5, help="engine steps recorded (default 5)")
    p.add_argument("--wait-steps", type=int, default=2, help="engine steps skipped before recording (default 2), then one warm-up step")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override an EngineConfig field, e.g. --set quantization=int8 --set device=cuda (repeatable)")


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
    elif args.command == "alerts" and args.alerts_command == "export":
        _export_alerts(Path(args.out), Path(args.monitoring_out), args.check)
    elif args.command == "profile" and args.target == "engine":
        _profile_engine(args)


def _export_alerts(out: Path, monitoring_out: Path, check: bool) -> None:
    from mlplat.observability import alerts, monitoring

    if not check:
        for path in alerts.export(out) + monitoring.export(monitoring_out, out / alerts.RULES_FILE):
            print(path)
        return
    wanted = {out / name: text for name, text in alerts.rendered().items()}
    wanted |= {monitoring_out / name: text for name, text in monitoring.manifests(alerts.render_rules()).items()}
    stale = [str(path) for path, text in wanted.items() if not path.is_file() or path.read_text() != text]
    if stale:
        print(f"stale: {', '.join(stale)}; run `mlplat alerts export --out {out} --monitoring-out {monitoring_out}`", file=sys.stderr)
        sys.exit(1)
    print(f"{out}, {monitoring_out}: {len(wanted)} files up to date")


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


def _profile_engine(args: argparse.Namespace) -> None:
    from mlplat.config import apply_overrides, to_flat_params, validate
    from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
    from mlplat.observability.profiling import ARTIFACT_DIR, ProfileConfig, profile_engine, synthetic_prompts
    from mlplat.tracking import RunLogger, default_tracking_uri, resolve_model, start_run

    counts = {"--prompts": args.prompts, "--prompt-len": args.prompt_len, "--max-tokens": args.max_tokens, "--steps": args.steps}
    for flag, value in counts.items():
        if value <= 0:
            raise MlplatError(f"{flag} must be > 0, got {value}")
    if args.wait_steps < 0:
        raise MlplatError(f"--wait-steps must be >= 0, got {args.wait_steps}")
    if any(o.partition("=")[0] == "model" for o in args.overrides):
        raise MlplatError("--set model=...: give the model with --model")
    tracking_uri = default_tracking_uri()
    model_dir = resolve_model(args.model, tracking_uri=tracking_uri)
    engine_cfg = validate(EngineConfig, apply_overrides({"model": str(model_dir)}, args.overrides), "--set")
    if args.prompts > engine_cfg.max_waiting:
        raise MlplatError(f"--prompts {args.prompts} exceeds the engine's queue (max_waiting={engine_cfg.max_waiting})")
    profile = ProfileConfig(steps=args.steps, wait_steps=args.wait_steps)
    # A sequence gains one token per step, so requests this long outlive the schedule
    # (speculative decoding can end them sooner: what was recorded is saved then).
    max_tokens = max(args.max_tokens, profile.wait_steps + 1 + profile.steps)
    engine = LLMEngine(engine_cfg)
    context = min(engine.runner.max_model_len, engine.runner.num_blocks * engine_cfg.block_size)
    if args.prompt_len + max_tokens > context:
        raise MlplatError(f"--prompt-len {args.prompt_len} + {max_tokens} generated tokens exceed the engine's context of {context} tokens")
    prompts = synthetic_prompts(engine.tokenizer, args.prompts, args.prompt_len)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    workload = {"workload.prompts": args.prompts, "workload.prompt_len": args.prompt_len, "workload.max_tokens": max_tokens}
    run_params = to_flat_params(engine_cfg, "engine.") | to_flat_params(profile, "profile.") | workload
    tags = {"mlplat.profile.target": "engine", "mlplat.base_model": args.model}
    run_id = start_run(PROFILE_EXPERIMENT, "profile-engine", params=run_params, tags=tags, tracking_uri=tracking_uri)
    logger = RunLogger(run_id, tracking_uri)
    try:
        result = profile_engine(engine, prompts, params, profile, logger)
    except BaseException:
        logger.end("FAILED")
        raise
    logger.end()
    print(result.top_operators or "no steps recorded: the requests finished before recording began")
    if result.recorded_steps < profile.steps:
        print(f"note: the requests ran out after {result.engine_steps} steps, {result.recorded_steps} of {profile.steps} recorded")
    if result.mean_step_seconds is not None:
        print(f"engine: {result.mean_step_seconds * 1e3:.1f} ms per recorded step (profiler overhead included), "
              f"{result.tokens_generated} tokens generated in {result.engine_steps} steps")  # fmt: skip
    print(f"trace: MLflow run {run_id} (experiment {PROFILE_EXPERIMENT}), artifacts {ARTIFACT_DIR}/trace.json (open in https://ui.perfetto.dev)")
