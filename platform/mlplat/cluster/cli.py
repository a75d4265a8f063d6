"""``mlplat cluster render`` and ``mlplat cluster validate``: the cluster part of the ``mlplat`` command."""

from __future__ import annotations

import argparse
from pathlib import Path

DEFAULT_CONFIG = "cluster_configs/cluster.yaml"


def add_commands(sub) -> None:
    cluster = sub.add_parser("cluster", help="KubeRay manifests and Ray cluster launcher YAMLs").add_subparsers(
        dest="cluster_command", required=True, metavar="ACTION")
    p = cluster.add_parser("render", help="write KubeRay manifests and launcher YAMLs from one cluster config")
    p.add_argument("--config", default=DEFAULT_CONFIG, help=f"cluster config (default: {DEFAULT_CONFIG})")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a field, e.g. --set gpu_workers.nodes=4 (repeatable)")
    p.add_argument("--out", help="output folder (default: the config's folder)")
    p = cluster.add_parser("validate", help="check KubeRay and monitoring manifests against their CRDs, launcher YAMLs against Ray's")
    p.add_argument("paths", nargs="*", help="files or folders (default: cluster_configs/kuberay, monitoring and launcher)")
    p.add_argument("--schemas", help="folder with KubeRay's CRDs (default: $MLPLAT_KUBERAY_SCHEMAS, else ../shared/schemas/kuberay)")


def run_command(args: argparse.Namespace) -> None:
    if args.cluster_command == "render":
        from mlplat.cluster import ClusterConfig, render
        from mlplat.config import load_config

        cfg = load_config(ClusterConfig, args.config, args.overrides)
        for path in render(cfg, args.out or Path(args.config).parent, source=args.config):
            print(path)
    elif args.cluster_command == "validate":
        from mlplat.cluster.validate import validate_paths

        paths = args.paths or [Path(DEFAULT_CONFIG).parent / d for d in ("kuberay", "monitoring", "launcher")]
        count = validate_paths(paths, Path(args.schemas) if args.schemas else None)
        print(f"{count} documents valid")
