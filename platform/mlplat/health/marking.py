"""Acting on a verdict: keep failing nodes out of the platform's jobs, reversibly.

Ray's node labels are fixed when a node starts, but a node's resources can be resized at
run time through the GCS (the RPC behind in-place pod resizing in Ray's autoscaler). So a
node that passes the check holds the custom resource ``mlplat_accepted_node: 1`` and one
that fails has it set to 0 (quarantined). Jobs that opt in, with ``health.accepted_nodes_only``
in the training recipes or ``resources={ACCEPTED_NODE: 0.001}`` on any task or actor, run
only on accepted nodes; work already running is left alone. ``mlplat health unmark``
accepts a node again. The resource lives in the raylet, so a restarted node comes back
without it: not accepted until it is checked again.

``drain`` goes further: it asks Ray to drain the node (no new work at all, for every job;
what runs there may finish). Ray cannot undo a drain: restart the node's raylet instead.
"""

from __future__ import annotations

import json
import time

import ray
from ray.experimental import internal_kv

from mlplat.errors import MlplatError

ACCEPTED_NODE = "mlplat_accepted_node"
_WORKER_SHARE = 0.001  # of the accepted-node resource per worker: any number of workers fit on a node
_KV_NAMESPACE = "mlplat_health"
_KV_PREFIX = "quarantined/"


def _gcs():
    """The driver's GCS client (set up by ray.init()): the one `ray drain-node` talks through."""
    if not ray.is_initialized():
        raise MlplatError("not connected to a Ray cluster: call ray.init() or pass --address")
    return internal_kv.internal_kv_get_gcs_client()


def accept(node_id: str) -> None:
    """Let opted-in jobs use the node (again)."""
    _gcs().resize_raylet_resource_instances(node_id, {ACCEPTED_NODE: 1.0})
    internal_kv._internal_kv_del(_KV_PREFIX + node_id, namespace=_KV_NAMESPACE)


def quarantine(node_id: str, reason: str) -> None:
    """Keep opted-in jobs off the node; the reason is kept for ``quarantined()``."""
    _gcs().resize_raylet_resource_instances(node_id, {ACCEPTED_NODE: 0.0})
    record = json.dumps({"reason": reason, "at": time.strftime("%Y-%m-%dT%H:%M:%S%z")})
    internal_kv._internal_kv_put(_KV_PREFIX + node_id, record, overwrite=True, namespace=_KV_NAMESPACE)


def quarantined() -> dict[str, dict]:
    """Quarantined node ids -> {reason, at}."""
    keys = internal_kv._internal_kv_list(_KV_PREFIX, namespace=_KV_NAMESPACE)
    records = {}
    for key in keys:
        key = key.decode() if isinstance(key, bytes) else key
        value = internal_kv._internal_kv_get(key, namespace=_KV_NAMESPACE)
        if value is not None:
            records[key.removeprefix(_KV_PREFIX)] = json.loads(value)
    return records


def accepted_nodes() -> set[str]:
    """Alive nodes that hold the accepted-node resource now (the GCS's live view, not the static node table)."""
    return {node_id for node_id, total in ray._private.state.total_resources_per_node().items() if total.get(ACCEPTED_NODE, 0.0) > 0}


def draining() -> set[str]:
    """Nodes Ray is draining (by ``drain`` or by the autoscaler)."""
    return set(ray._private.state.state.get_draining_nodes())


def drain(node_id: str, reason: str) -> None:
    """Ask Ray to drain the node: no new tasks or actors of any job. Irreversible until the node restarts."""
    from ray.core.generated import autoscaler_pb2

    accepted, rejection = _gcs().drain_node(node_id, autoscaler_pb2.DrainNodeReason.Value("DRAIN_NODE_REASON_PREEMPTION"), reason, 0)
    if not accepted:
        raise MlplatError(f"node {node_id}: Ray refused to drain it: {rejection}")


def accepted_worker_resources(use_gpu: bool) -> dict[str, float]:
    """Ray Train ``resources_per_worker`` that places workers only on accepted nodes.

    Fails fast when no node is accepted yet: the job would otherwise wait forever for resources.
    """
    if ray.cluster_resources().get(ACCEPTED_NODE, 0.0) <= 0.0:
        raise MlplatError(
            f"health.accepted_nodes_only: no node holds {ACCEPTED_NODE} yet; run `mlplat health check` on this cluster first"
        )
    return {"GPU" if use_gpu else "CPU": 1.0, ACCEPTED_NODE: _WORKER_SHARE}
