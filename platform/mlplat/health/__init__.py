"""Cluster health: node acceptance measurements, and slow- and hung-rank detection during training.

- ``check``: ``mlplat health check`` -- measurements pinned to every node, all-reduces within each node,
  across each pair of ring neighbours and across all, verdicts against a hardware profile
  (``cluster_configs/hardware/``) and the cluster's median that name a slow node or link
- ``ranks``: a node's local ranks (one process per GPU, all seeing the node's GPUs) for the check
- ``marking``: failing nodes quarantined (reversibly) so that opted-in jobs avoid them
- ``straggler``: flags a rank slower than the others for K consecutive log windows
- ``hang``: a watchdog that dumps every thread's stack and fails the job when steps stop
- ``training``: the above wired for a Ray Train loop (``health:`` and ``debug:`` sections of a recipe)
"""
