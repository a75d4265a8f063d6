"""The serving app's admission limits and resource fitting, as pure functions (no Ray): the limits
of every layer agree for any config, and `mlplat serve` fits default replica CPUs to the cluster or
says what it needs."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from mlplat.engine import EngineConfig
from mlplat.serve.admission import INGRESS_HEADROOM, admission_limits
from mlplat.serve.config import ReplicaConfig, ServeConfig, fit_to_cluster, replica_groups

replicas = st.builds(ReplicaConfig, num_replicas=st.integers(1, 8), num_cpus=st.floats(0, 8, allow_nan=False))
engines = st.builds(lambda seqs, waiting: EngineConfig(model="m", max_num_seqs=seqs, max_waiting=waiting),
                    st.integers(1, 512), st.integers(0, 4096))  # fmt: skip


@settings(max_examples=200, deadline=None)
@given(mode=st.sampled_from(["pd", "colocated"]), ingress=replicas, serving=replicas, engine=engines)
def test_admission_limits_agree_across_layers(mode, ingress, serving, engine):
    cfg = ServeConfig(model="m", mode=mode, ingress=ingress, decode=serving, colocated=serving)
    limits = admission_limits(cfg, engine)  # checks its own invariants too
    engines_hold = serving.num_replicas * (engine.max_num_seqs + engine.max_waiting)
    # The ingresses together admit what the serving engines hold, never much more...
    assert engines_hold <= limits.ingress_sequences * ingress.num_replicas < engines_hold + ingress.num_replicas
    # ...and shed it themselves, below Serve's limit, so Serve never answers with its plain-text rejection.
    assert limits.ingress_max_ongoing_requests == limits.ingress_sequences + INGRESS_HEADROOM
    assert limits.engine_max_ongoing_requests == engine.max_num_seqs + engine.max_waiting


def test_admission_limits_at_default_settings():
    limits = admission_limits(ServeConfig(model="m"), EngineConfig(model="m"))
    assert (limits.ingress_sequences, limits.engine_max_ongoing_requests) == (64 + 1024, 64 + 1024)


def test_pd_defaults_fit_a_two_core_cluster():
    fitted, note = fit_to_cluster(ServeConfig(model="m", mode="pd"), cluster_cpus=2)
    assert sum(g.num_replicas * g.num_cpus for g in replica_groups(fitted).values()) <= 2
    assert "2.5" in note and fitted.prefill.num_cpus == fitted.decode.num_cpus > fitted.ingress.num_cpus > 0
    assert fit_to_cluster(ServeConfig(model="m", mode="pd"), cluster_cpus=16) == (ServeConfig(model="m", mode="pd"), None)


def test_what_the_config_sets_is_never_changed_but_refused_with_what_is_needed():
    with pytest.raises(ValueError, match=r"needs 4 CPUs .* the cluster has 2: lower decode.num_cpus"):
        fit_to_cluster(ServeConfig(model="m", mode="pd", decode={"num_cpus": 2.5}), cluster_cpus=2)
    with pytest.raises(ValueError, match="needs 1 GPUs .* the cluster has 0"):
        fit_to_cluster(ServeConfig(model="m", mode="colocated", colocated={"num_gpus": 1}), cluster_cpus=8)


@settings(max_examples=200, deadline=None)
@given(mode=st.sampled_from(["pd", "colocated"]), n=st.integers(1, 4), cpus=st.floats(0.5, 64, allow_nan=False))
def test_fitted_defaults_fit_and_keep_their_proportions(mode, n, cpus):
    cfg = ServeConfig(model="m", mode=mode, ingress={"num_replicas": n}, decode={"num_replicas": n}, colocated={"num_replicas": n})
    fitted, note = fit_to_cluster(cfg, cluster_cpus=cpus)
    groups = replica_groups(fitted)
    assert sum(g.num_replicas * g.num_cpus for g in groups.values()) <= cpus + 1e-9
    assert (note is None) == (fitted == cfg)
    ratios = {name: g.num_cpus / getattr(cfg, name).num_cpus for name, g in groups.items()}
    assert max(ratios.values()) - min(ratios.values()) < 0.02 / min(g.num_cpus for g in replica_groups(cfg).values())
