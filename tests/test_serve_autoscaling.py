"""Per-pool autoscaling: the typed `autoscaling` section (validated at the edge, handed to Serve as each
engine pool's autoscaling_config), and on the local cluster a decode pool that grows under load and
shrinks when idle while requests stream through both moves, none of them failing."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
import yaml
from hypothesis import given, settings
from hypothesis import strategies as st
from ray import serve
from ray.serve.config import AutoscalingConfig as ServeAutoscalingConfig

from mlplat.config import load_config, validate
from mlplat.engine import EngineConfig
from mlplat.errors import ConfigError
from mlplat.serve.admission import admission_limits
from mlplat.serve.config import ServeConfig, fit_to_cluster
from serve_apps.llm import _options, build_app

BOUNDS = {  # field: (lowest valid value, whether the bound is strict)
    "min_replicas": (0, False), "max_replicas": (1, False), "initial_replicas": (0, False), "target_ongoing_requests": (0, True),
    "upscale_delay_s": (0, False), "downscale_delay_s": (0, False), "metrics_interval_s": (0, True), "look_back_period_s": (0, True),
}  # fmt: skip


def violations(spec: dict) -> set[str]:
    """The fields of an autoscaling section that break a rule: the oracle the config must agree with."""
    bad = {k for k, v in spec.items() if k in BOUNDS and (v <= BOUNDS[k][0] if BOUNDS[k][1] else v < BOUNDS[k][0])}
    bad |= set(spec) - set(BOUNDS)
    if "max_replicas" not in spec:
        bad.add("max_replicas")
    if bad:
        return bad  # pydantic reports field errors before the cross-field checks run
    low, high = spec.get("min_replicas", 1), spec["max_replicas"]
    if low > high:
        bad |= {"min_replicas", "max_replicas"}
    if spec.get("initial_replicas") is not None and not low <= spec["initial_replicas"] <= high:
        bad.add("initial_replicas")
    if spec.get("look_back_period_s", 30.0) <= spec.get("metrics_interval_s", 10.0):
        bad |= {"look_back_period_s", "metrics_interval_s"}
    return bad


numbers = st.one_of(st.integers(-2, 6), st.floats(-1, 40, allow_nan=False))
specs = st.dictionaries(st.sampled_from([*BOUNDS, "max_replica"]), numbers, max_size=5).map(
    lambda d: {k: (int(v) if k.endswith("replicas") and isinstance(v, float) else v) for k, v in d.items()}
)


@settings(max_examples=300, deadline=None)
@given(spec=specs, pool=st.sampled_from(["prefill", "decode", "colocated"]))
def test_an_autoscaling_section_is_accepted_exactly_when_valid_and_errors_name_the_field(spec, pool):
    mode = "colocated" if pool == "colocated" else "pd"
    bad = violations(spec)
    try:
        cfg = validate(ServeConfig, {"model": "m", "mode": mode, pool: {"autoscaling": spec}})
    except ConfigError as err:
        assert bad, f"{spec} is valid but was refused: {err}"
        assert f"{pool}.autoscaling" in str(err)
        assert any(name in str(err) for name in bad), f"{err} names none of {bad}"
        return
    assert not bad, f"{spec} breaks {bad} but was accepted"
    replicas = getattr(cfg, pool)
    options = replicas.scaling_options()
    assert "num_replicas" not in options  # Serve refuses both
    serve_side = ServeAutoscalingConfig.model_validate(options["autoscaling_config"])  # what Serve itself accepts
    assert (serve_side.min_replicas, serve_side.max_replicas) == (replicas.autoscaling.min_replicas, replicas.max_replicas)
    assert serve_side.target_ongoing_requests == replicas.autoscaling.target_ongoing_requests


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["decode.num_replicas=2", "decode.autoscaling={max_replicas: 4}"], "decode: .*num_replicas and autoscaling both set"),
        (["decode.autoscaling={min_replicas: 2}"], r"decode.autoscaling.max_replicas: Field required"),
        (["decode.autoscaling={min_replicas: 3, max_replicas: 2}"], r"decode.autoscaling: .*min_replicas \(3\) exceeds max_replicas \(2\)"),
        (["prefill.autoscaling={max_replicas: 2, initial_replicas: 3}"], r"prefill.autoscaling: .*initial_replicas \(3\) must lie within"),
        (["decode.autoscaling={max_replicas: 2, metrics_interval_s: 5, look_back_period_s: 5}"],
         r"look_back_period_s \(5\) must exceed metrics_interval_s \(5\)"),
        (["decode.autoscaling={max_replicas: 2, upscale_delay: 1}"], "decode.autoscaling.upscale_delay: unknown field"),
        (["ingress.autoscaling={max_replicas: 2}"], "ingress: .*set ingress.num_replicas instead"),
    ],
)
def test_bad_autoscaling_configs_name_the_field_and_the_fix(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ServeConfig, None, ["model=m", *overrides])


def test_deployment_options_carry_the_autoscaling_config_and_the_limits_count_the_largest_pool():
    scaled = ServeConfig(model="m", decode={"autoscaling": {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4}})
    options = _options(scaled.decode, "decode", 8)
    assert "num_replicas" not in options
    assert options["autoscaling_config"] == {"min_replicas": 1, "max_replicas": 3, "target_ongoing_requests": 4.0,  # then Serve's defaults
                                             "upscale_delay_s": 30.0, "downscale_delay_s": 600.0, "metrics_interval_s": 10.0,
                                             "look_back_period_s": 30.0}  # fmt: skip
    assert _options(scaled.prefill, "prefill", 8)["num_replicas"] == 1
    # The ingress admits what 3 decode replicas hold (below that, the surplus waits in Serve's queue: the load Serve scales on).
    engine = EngineConfig(model="m", max_num_seqs=4, max_waiting=4)
    fixed = ServeConfig(model="m", decode={"num_replicas": 3})
    assert admission_limits(scaled, engine) == admission_limits(fixed, engine)
    # The cluster must hold every pool at its largest.
    big = ServeConfig(model="m", prefill={"num_cpus": 0.5}, decode={"num_cpus": 1, "autoscaling": {"max_replicas": 3}})
    with pytest.raises(ValueError, match=r"needs 4 CPUs \(ingress 1 x 0.5 CPU, prefill 1 x 0.5 CPU, decode 3 x 1 CPU\)"):
        fit_to_cluster(big, cluster_cpus=2)


def test_the_autoscaling_example_in_docs_validates():
    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    example = yaml.safe_load(docs.split("`llm-autoscaling.yaml`", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0])
    cfg = ServeConfig.model_validate({**example, "model": "m"})
    assert (cfg.prefill.max_replicas, cfg.decode.max_replicas, cfg.ingress.max_replicas) == (4, 8, 2)
    for pool in (cfg.prefill, cfg.decode):
        ServeAutoscalingConfig.model_validate(pool.scaling_options()["autoscaling_config"])
    EngineConfig.model_validate({**example["engine_args"], "model": "m"})


# --- on the local cluster --------------------------------------------------------------------------

APP = "autoscale"
SERVE_URL = "http://127.0.0.1:8000"  # Serve's HTTP proxy, as the suite's other Serve tests reach it
ENGINE = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4, "max_waiting": 4}
SMALL = {"num_cpus": 0.2}
# Short delays and a short averaging window (Serve's defaults wait 30 s up and 600 s down).
FAST = {"min_replicas": 1, "max_replicas": 2, "target_ongoing_requests": 2, "upscale_delay_s": 1, "downscale_delay_s": 2,
        "metrics_interval_s": 0.5, "look_back_period_s": 2}  # fmt: skip
MAX_TOKENS = 48
WAIT_S = 90  # for each move; it takes seconds


@dataclass
class Load:
    """Streaming requests sent back to back by ``workers`` tasks until told to stop; each one's outcome."""

    url: str
    done: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each complete stream
    failed: list[str] = field(default_factory=list)
    workers: int = 0
    stop: threading.Event = field(default_factory=threading.Event)

    async def stream_one(self, http: httpx.AsyncClient) -> None:
        start = time.monotonic()
        body = {"model": "tiny", "prompt": "What is 12 + 34?", "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True,
                "stream_options": {"include_usage": True}}  # fmt: skip
        try:
            async with http.stream("POST", f"{self.url}/completions", json=body) as r:
                events = [line.removeprefix("data: ") async for line in r.aiter_lines() if line.startswith("data: ")]
            if r.status_code != 200 or events[-1:] != ["[DONE]"]:
                self.failed.append(f"{r.status_code}: {events[-2:]}")
                return
            usage = json.loads(events[-2])["usage"]
            if usage["completion_tokens"] != MAX_TOKENS:
                self.failed.append(f"incomplete: {usage}")
                return
            self.done.append((start, time.monotonic()))
        except Exception as err:  # noqa: BLE001  (every failure counts, whatever its kind)
            self.failed.append(repr(err))

    async def worker(self, http: httpx.AsyncClient, index: int) -> None:
        while not self.stop.is_set() and index < self.workers:
            await self.stream_one(http)

    def run(self) -> None:
        async def main():
            async with httpx.AsyncClient(timeout=60) as http:
                tasks = {}
                while not self.stop.is_set():  # (re)start a task per wanted worker
                    for i in range(self.workers):
                        if i not in tasks or tasks[i].done():
                            tasks[i] = asyncio.create_task(self.worker(http, i))
                    await asyncio.sleep(0.05)
                await asyncio.gather(*tasks.values())

        asyncio.run(main())

    def in_flight_at(self, moment: float) -> int:
        return sum(start < moment < end for start, end in self.done)


def decode_replicas() -> dict[str, int]:
    return dict(serve.status().applications[APP].deployments["decode"].replica_states)


def wait_for(running: int, what: str, load: Load) -> tuple[float, float]:
    """Polls until the decode pool is ``running`` replicas; returns when it first changed (a replica
    starting or stopping) and when it got there."""
    deadline, before, changed = time.monotonic() + WAIT_S, decode_replicas(), None
    while (states := decode_replicas()) != {"RUNNING": running}:
        changed = changed or (time.monotonic() if states != before else None)
        assert not load.failed, f"requests failed while waiting for {what}: {load.failed[:3]}"
        assert time.monotonic() < deadline, f"the decode pool did not {what} in {WAIT_S} s (replica states {states})"
        time.sleep(0.2)
    return changed or time.monotonic(), time.monotonic()


@pytest.mark.slow
def test_the_decode_pool_grows_under_load_and_shrinks_when_idle_and_no_request_fails(ray_cluster, tiny_model, monkeypatch):
    monkeypatch.setenv("MLPLAT_API_KEYS", "")
    cfg = ServeConfig(model=str(tiny_model), model_name="tiny", mode="pd", engine_args=ENGINE, prefill=SMALL,
                      decode={**SMALL, "autoscaling": FAST}, ingress=SMALL, app_name=APP, route_prefix=f"/{APP}")  # fmt: skip
    serve.run(build_app(cfg), name=APP, route_prefix=f"/{APP}")
    load = Load(url=f"{SERVE_URL}/{APP}/v1")
    sender = threading.Thread(target=load.run, daemon=True)
    try:
        assert decode_replicas() == {"RUNNING": 1}
        sender.start()
        load.workers = 6  # 6 streams on a pool that targets 2 per replica: Serve wants 3, the config allows 2
        _, grown = wait_for(2, "grow to 2 replicas", load)
        # 2 streams, about one on each replica: 1 per replica is below the target, so Serve removes one,
        # which finishes (drains) the stream it holds while the other replica takes the next ones.
        load.workers = 2
        stopping, shrunk = wait_for(1, "shrink back to 1 replica", load)
    finally:
        load.stop.set()
        sender.join(timeout=120)
        serve.delete(APP)
    assert not sender.is_alive(), "the load did not stop"
    assert not load.failed, f"{len(load.failed)} requests failed: {load.failed[:3]}"
    # Requests were streaming while the pool grew and while a replica was being removed.
    assert load.in_flight_at(grown) >= 1 and load.in_flight_at(stopping) >= 1, (grown, stopping, load.done[-8:])
    assert len(load.done) >= 8
