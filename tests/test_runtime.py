"""The embedded local cluster beside another one on the same machine (a quickstart next to the test suite)."""

import os
import subprocess
import sys

import pytest
import ray

SECOND_CLUSTER = """
import sys, ray
print(ray.init(num_cpus=1, include_dashboard=True).dashboard_url, flush=True)
sys.stdin.read()  # until the test closes stdin
ray.shutdown()
"""


@ray.remote(num_cpus=0)
class StateProbe:
    """Asks the state API about an actor the way Ray Train's placement-group cleaner does."""

    def ask(self, actor_id: str, gcs_address: str) -> str:
        from ray.util.state import get_actor
        from ray.util.state.exception import RayStateApiException

        os.environ["RAY_ADDRESS"] = gcs_address  # what the cleaner's cached cluster discovery resolves to
        try:
            state = get_actor(actor_id, timeout=10)
        except RayStateApiException:
            return "unavailable"  # no dashboard here: the cleaner keeps monitoring
        return "missing" if state is None else state.state


@pytest.mark.slow
def test_a_cluster_without_a_dashboard_never_hears_another_clusters_state_api(ray_cluster):
    from ray._private import ray_constants
    from ray.experimental.internal_kv import _internal_kv_get

    ours = _internal_kv_get(ray_constants.DASHBOARD_ADDRESS, namespace=ray_constants.KV_NAMESPACE_DASHBOARD).decode()
    other = subprocess.Popen([sys.executable, "-c", SECOND_CLUSTER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    probe = StateProbe.remote()
    try:
        theirs = other.stdout.readline().strip()
        assert theirs, "the second cluster did not start"
        assert ours != theirs, "both clusters advertise the same state API address"
        # Before the fix this answered "missing" (from the other cluster), and the cleaner removed a healthy run's placement group.
        assert ray.get(probe.ask.remote(probe._actor_id.hex(), ray.get_runtime_context().gcs_address)) in ("unavailable", "ALIVE")
    finally:
        ray.kill(probe)
        other.stdin.close()
        other.wait(timeout=60)


def test_ray_address_in_the_environment_is_joined_not_restarted(ray_cluster):
    """Inside `ray job submit` (or with RAY_ADDRESS exported) the recipes join that cluster."""
    gcs_address = ray.get_runtime_context().gcs_address
    code = "import ray; from mlplat.runtime import init_ray; init_ray(None, 2); print(ray.get_runtime_context().gcs_address)"
    out = subprocess.run([sys.executable, "-c", code], env=os.environ | {"RAY_ADDRESS": gcs_address}, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == gcs_address
