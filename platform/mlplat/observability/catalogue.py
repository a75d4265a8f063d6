"""Every metric mlplat exports, defined once: training, serving, RL, cluster health.

Labels stay low-cardinality: a run id (one per job), a rank or node (bounded by the
cluster), a phase, role, reason or benchmark name (fixed sets). Never a request id or
a prompt: those go to the logs (see :mod:`mlplat.observability.logs`).
"""

from __future__ import annotations

from mlplat.observability.metrics import Metric

# Latency buckets (seconds): a CPU tiny model answers in milliseconds, a GPU 70B in tens of seconds.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TOKEN_GAP_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
BYTES_BUCKETS = (1e3, 1e4, 1e5, 1e6, 1e7, 1e8, 1e9)

TRAIN = ("recipe", "run_id")
TRAIN_RANK = (*TRAIN, "rank")

# -- training (every recipe; rank 0 reports the whole job's figures, per-rank ones carry `rank`) --
TRAIN_LOSS = Metric("mlplat_train_loss", "gauge", "1", "training loss, mean over the last log window", TRAIN)
TRAIN_GRAD_NORM = Metric("mlplat_train_grad_norm", "gauge", "1", "gradient norm before clipping, mean over the last log window", TRAIN)
TRAIN_LR = Metric("mlplat_train_learning_rate", "gauge", "1", "learning rate at the last step", TRAIN)
TRAIN_TOKENS_PER_S = Metric(
    "mlplat_train_tokens_per_second", "gauge", "tokens_per_second", "tokens trained per second, all ranks, last log window", TRAIN
)
TRAIN_MFU = Metric("mlplat_train_mfu", "gauge", "ratio", "model FLOPs utilisation per device, last log window", TRAIN)
TRAIN_STEPS = Metric("mlplat_train_steps", "counter", "steps", "optimizer steps taken (skipped non-finite steps included)", TRAIN)
TRAIN_SKIPPED_STEPS = Metric(
    "mlplat_train_skipped_steps", "counter", "steps", "steps skipped for a non-finite loss or gradient norm", TRAIN
)
TRAIN_STEP_SECONDS = Metric(
    "mlplat_train_step_seconds", "gauge", "seconds", "mean wall time of one step on this rank, last log window", TRAIN_RANK
)
TRAIN_STEP_PHASE_SECONDS = Metric(
    "mlplat_train_step_phase_seconds", "gauge", "seconds",
    "mean seconds per step in each phase (SFT: data_wait, forward, backward, comm, optimizer; GRPO: rollout, reward, train, sync)",
    (*TRAIN_RANK, "phase"),
)  # fmt: skip
TRAIN_DATA_WAIT_FRACTION = Metric(
    "mlplat_train_data_wait_fraction", "gauge", "ratio", "fraction of step time spent waiting for the next batch", TRAIN_RANK
)
TRAIN_REJECTED_ROWS = Metric(
    "mlplat_train_rejected_rows", "counter", "rows", "input rows refused by validation, by reason", (*TRAIN, "reason")
)
TRAIN_RANK_SLOWDOWN = Metric(
    "mlplat_train_rank_slowdown", "gauge", "ratio",
    "straggler score: a rank's local step time / the other ranks' median (1 = typical), last log window",
    (*TRAIN_RANK, "node"),
)  # fmt: skip

# -- RL (GRPO) --
RL_REWARD_MEAN = Metric("mlplat_rl_reward_mean", "gauge", "1", "mean reward of the sampled completions, last log window", TRAIN)
RL_REWARD_STD = Metric("mlplat_rl_reward_std", "gauge", "1", "standard deviation of rewards, last log window", TRAIN)
RL_KL = Metric("mlplat_rl_kl", "gauge", "1", "KL(policy || reference), k3 estimate, last log window", TRAIN)
RL_ROLLOUT_TOKENS_PER_S = Metric(
    "mlplat_rl_rollout_tokens_per_second",
    "gauge",
    "tokens_per_second",
    "completion tokens sampled per second by the rollout actors, all ranks",
    TRAIN,
)
RL_RESPONSE_LENGTH = Metric("mlplat_rl_response_length_tokens", "gauge", "tokens", "mean completion length, last log window", TRAIN)

# -- serving: the ingress sees what the client sees --
SERVE = ("model",)
SERVE_REQUESTS = Metric("mlplat_serve_requests", "counter", "requests", "requests answered, by HTTP status", (*SERVE, "status"))
SERVE_REJECTIONS = Metric(
    "mlplat_serve_rejections", "counter", "requests",
    "requests refused or failed, by reason: invalid_request, not_found, context_length, unauthorized, rate_limited, "
    "overloaded, unavailable, timeout, internal_error",
    (*SERVE, "reason"),
)  # fmt: skip
SERVE_TTFT = Metric(
    "mlplat_serve_time_to_first_token_seconds",
    "histogram",
    "seconds",
    "time from request arrival to the first token",
    SERVE,
    LATENCY_BUCKETS,
)
SERVE_ITL = Metric(
    "mlplat_serve_inter_token_latency_seconds",
    "histogram",
    "seconds",
    "time between consecutive output tokens of one request",
    SERVE,
    TOKEN_GAP_BUCKETS,
)
SERVE_E2E = Metric(
    "mlplat_serve_e2e_latency_seconds", "histogram", "seconds", "time from request arrival to the last token", SERVE, LATENCY_BUCKETS
)
SERVE_GENERATED_TOKENS = Metric("mlplat_serve_generated_tokens", "counter", "tokens", "output tokens sent to clients", SERVE)
SERVE_PROMPT_TOKENS = Metric("mlplat_serve_prompt_tokens", "counter", "tokens", "prompt tokens of admitted requests", SERVE)

# -- serving: each engine replica reports its own state (role: prefill, decode or colocated) --
ENGINE = ("role",)
SERVE_QUEUE_LENGTH = Metric("mlplat_serve_queue_length", "gauge", "requests", "requests waiting in the engine's scheduler", ENGINE)
SERVE_RUNNING = Metric("mlplat_serve_running_requests", "gauge", "requests", "requests being prefilled or decoded", ENGINE)
SERVE_KV_BLOCKS_USED = Metric("mlplat_serve_kv_blocks_used", "gauge", "blocks", "KV cache blocks in use", ENGINE)
SERVE_KV_USAGE = Metric("mlplat_serve_kv_usage_ratio", "gauge", "ratio", "fraction of KV cache blocks in use", ENGINE)
SERVE_PREFIX_HIT_RATE = Metric(
    "mlplat_serve_prefix_cache_hit_rate", "gauge", "ratio", "prompt tokens found in the prefix cache / tokens looked up", ENGINE
)
SERVE_SPEC_ACCEPTANCE = Metric(
    "mlplat_serve_spec_acceptance_rate", "gauge", "ratio", "speculative draft tokens accepted / proposed", ENGINE
)
SERVE_KV_HANDOFF_BYTES = Metric(
    "mlplat_serve_kv_handoff_bytes", "histogram", "bytes", "size of one prefill -> decode KV payload", (), BYTES_BUCKETS
)
SERVE_KV_HANDOFF_SECONDS = Metric(
    "mlplat_serve_kv_handoff_seconds",
    "histogram",
    "seconds",
    "from the prefill payload's creation to its arrival in the decode replica",
    (),
    LATENCY_BUCKETS,
)
SERVE_KV_HANDOFF_FAILURES = Metric(
    "mlplat_serve_kv_handoff_failures", "counter", "requests", "payloads decode could not import (prefill recomputed)", ()
)

# -- cluster health: `mlplat health check` results --
HEALTH = ("node",)
HEALTH_MEASUREMENT = Metric(
    "mlplat_health_node_measurement", "gauge", "1",
    "a node acceptance measurement's figure (unit in the measurement's name: _gflops, _gbps, _mbps, _tflops)",
    (*HEALTH, "measurement"),
)  # fmt: skip
HEALTH_NODE_PASSED = Metric("mlplat_health_node_passed", "gauge", "1", "1 if the node passed its last acceptance check, else 0", HEALTH)
HEALTH_ALLREDUCE_BUSBW = Metric(
    "mlplat_health_allreduce_busbw_gbps", "gauge", "1", "all-reduce bus bandwidth across the checked nodes, GB/s", ()
)
# The ring of pairwise all-reduces: one series per pair of ring neighbours (node, peer), bounded by the cluster.
HEALTH_PAIR = ("node", "peer")
HEALTH_PAIR_BUSBW = Metric(
    "mlplat_health_pair_busbw_gbps", "gauge", "1", "all-reduce bus bandwidth between two ring neighbours (pairwise test), GB/s", HEALTH_PAIR
)
HEALTH_PAIR_PASSED = Metric(
    "mlplat_health_pair_passed", "gauge", "1",
    "0 if the last acceptance check named the link between the two nodes slow (both nodes fine with their other neighbours), else 1",
    HEALTH_PAIR,
)  # fmt: skip

HEALTH_NODE_QUARANTINED = Metric(
    "mlplat_health_node_quarantined", "gauge", "1",
    "1 while the node is quarantined (by the acceptance check or a flagged straggler), from the health exporter actor", HEALTH,
)  # fmt: skip
HEALTH_REPORT_TIMESTAMP = Metric(
    "mlplat_health_report_timestamp_seconds", "gauge", "seconds",
    "unix time the last acceptance check finished; the health exporter actor holds it (age = time() - this)", (),
)  # fmt: skip

# -- training: restarts (rank 0, once per attempt) --
TRAIN_ATTEMPT_STARTED = Metric(
    "mlplat_train_attempt_started_timestamp_seconds", "gauge", "seconds",
    "unix time this attempt of the job started; restarted=true when it restored the run's checkpoint after a failure",
    (*TRAIN, "restarted"),
)  # fmt: skip

CATALOGUE: dict[str, Metric] = {m.name: m for m in globals().values() if isinstance(m, Metric)}

# Ray's own metrics that alert rules use (exported names, as Ray 2.60 writes them; not recorded by mlplat).
# ray/serve/_private/replica.py: a Counter every replica increments once when it starts, tags deployment/replica/application.
RAY_SERVE_REPLICA_STARTS = "ray_serve_deployment_replica_starts_total"
RAY_SERIES = frozenset({RAY_SERVE_REPLICA_STARTS})


def exported_series() -> set[str]:
    """Every Prometheus series name the catalogue can produce (histograms: _bucket, _sum, _count)."""
    return {name for m in CATALOGUE.values() for name in m.series_names}
