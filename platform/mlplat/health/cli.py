"""``mlplat health check | nodes | unmark``: the health part of the ``mlplat`` command."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from mlplat.errors import MlplatError


def add_commands(sub) -> None:
    health = sub.add_parser("health", help="node acceptance checks; quarantine of failing nodes")
    actions = health.add_subparsers(dest="health_command", required=True, metavar="ACTION")
    address_help = "Ray cluster address (default: the running local cluster)"
    p = actions.add_parser("check", help="measure every node against a hardware profile and the cluster median; exit 1 if any fails")
    p.add_argument("--config", help="health check config YAML (HealthCheckConfig)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set profile=h100-8x-ib --set disk_dir=/mnt/nvme (repeatable)")
    p.add_argument("--address", help=address_help + ", else a new local one")
    p = actions.add_parser("nodes", help="list nodes: accepted, quarantined (with the reason) or not checked")
    p.add_argument("--address", help=address_help)
    p = actions.add_parser("unmark", help="accept quarantined nodes again")
    p.add_argument("node_ids", nargs="*", metavar="NODE_ID", help="node ids, or unique prefixes of them as the check prints")
    p.add_argument("--all", action="store_true", help="every quarantined node")
    p.add_argument("--address", help=address_help)


def run_command(args: argparse.Namespace) -> None:
    """Run ``mlplat health ACTION``; ``check`` exits with status 1 when a node or the collective fails."""
    # Imported here, not at the top: `mlplat --help` and every other command must not pay for ray/torch.
    from mlplat.config import load_config
    from mlplat.health import marking
    from mlplat.health.check import HealthCheckConfig, run_health_check
    from mlplat.health.report import render_table
    if args.health_command == "check":
        cfg = load_config(HealthCheckConfig, args.config, args.overrides)  # a bad config fails before Ray starts
        _connect(args.address, start_local=True)
        report = run_health_check(cfg)
        print(render_table(report))
        if cfg.out:
            print(f"report: {Path(cfg.out).resolve()}")
        if report.mlflow_run_id:
            print(f"MLflow run: {report.mlflow_run_id} (experiment {cfg.experiment})")
        if not report.passed:
            sys.exit(1)
        return
    _connect(args.address, start_local=False)
    if args.health_command == "nodes":
        print(_nodes_table())
        return
    quarantined = marking.quarantined()
    if args.all:
        node_ids = list(quarantined)
    elif args.node_ids:
        node_ids = [_resolve_node(prefix) for prefix in args.node_ids]
    else:
        raise MlplatError("unmark: name the nodes (ids or prefixes, see `mlplat health nodes`) or pass --all")
    for node_id in node_ids:
        marking.accept(node_id)
        print(f"accepted {node_id}" + (f" (was quarantined: {quarantined[node_id]['reason']})" if node_id in quarantined else ""))


def _connect(address: str | None, start_local: bool) -> None:
    import ray

    if ray.is_initialized():
        return
    try:
        ray.init(address=address if address or start_local else "auto", log_to_driver=False)
    except ConnectionError as err:
        raise MlplatError(f"no Ray cluster at {address or 'this machine'} ({err}): start one or pass --address") from None


def _alive_nodes() -> list[dict]:
    import ray

    return [n for n in ray.nodes() if n["Alive"]]


def _resolve_node(prefix: str) -> str:
    from mlplat.health import marking

    matches = [n["NodeID"] for n in _alive_nodes() if n["NodeID"].startswith(prefix)] or [
        node_id for node_id in marking.quarantined() if node_id.startswith(prefix)
    ]
    if len(matches) != 1:
        raise MlplatError(f"unmark: {prefix!r} matches {len(matches)} nodes; give more of the node id (see `mlplat health nodes`)")
    return matches[0]


def _nodes_table() -> str:
    from mlplat.health import marking

    quarantined, accepted, draining = marking.quarantined(), marking.accepted_nodes(), marking.draining()
    lines = []
    for node in _alive_nodes():
        node_id = node["NodeID"]
        if node_id in quarantined:
            state = f"quarantined {quarantined[node_id]['at']}: {quarantined[node_id]['reason']}"
        else:
            state = "accepted" if node_id in accepted else "not checked"
        lines.append(f"{node['NodeManagerAddress']:<15} {node_id}  {state}{' (draining)' if node_id in draining else ''}")
    return "\n".join(lines)
