"""Deploying mlplat: KubeRay manifests and Ray cluster launcher YAMLs rendered from one typed config, and their validation."""

from mlplat.cluster.config import ClusterConfig
from mlplat.cluster.render import render

__all__ = ["ClusterConfig", "render"]
