"""Claim: prefill/decode disaggregation (mode: pd) keeps streaming decodes smooth when long
prompts arrive among them, where a colocated engine stalls every decode on its replica for
the length of a long prefill; and the prefix-aware prefill router beats round robin on TTFT
when requests share system prompts. Baselines in the same run: the colocated app on the same
engine threads, and the PD app with ``prefill_router: round_robin``.

    python benchmarks/serving.py [--quick] [--out FILE] [--port 8123] [--ttft-slo S] [--itl-slo S]

Everything goes through the real app (serve_apps/llm.py on a local Ray cluster, Serve's HTTP
proxy on ``--port``, OpenAI ``/v1/completions`` with ``stream: true``), driven open-loop: each
request is sent at its Poisson arrival time whether or not earlier ones have finished
(asyncio + httpx in this process). Per request: TTFT (send to the first SSE chunk with text),
ITL (gaps between text chunks), status. All four apps are deployed at once (an idle app costs
nothing) and each comparison runs its apps one after the other on the same trace (same seed),
alternating which goes first when there are several runs (not --quick), so a noisy neighbour
hits both sides.

Model: a random-weight Llama made locally (384 wide, 6 layers, ~10M parameters, fp32: a
600-token prefill takes ~0.4 s on one core, a decode step ~25 ms). Its weights are edited so
it samples only tokens that decode to whole characters, never a stop or special token: every
request runs to ``max_tokens`` and streams a chunk per engine step, as a trained model's text
mostly does (random ids end on a partial UTF-8 byte ~40% of the time; the ingress holds
those back and merges chunks). Temperature 1 with a per-request seed: both apps of a
comparison generate the same tokens.

1. PD vs colocated on the same engine threads: PD = 1 prefill + 1 decode replica, colocated =
   2 replicas behind Serve's default router; every engine replica runs one torch thread (Ray
   sets OMP_NUM_THREADS = max(1, floor(num_cpus))). Two engine threads for the two cores on
   both sides; 2 x 1 rather than 1 colocated replica with 2 threads because one thread per
   engine is what each PD engine gets too, and how colocated serving scales out. Trace:
   2.5 requests/s; 70% short prompts (16-64 tokens) streaming 32-96 tokens, 30% long prompts
   (512-768 tokens) asking for 16; engine defaults otherwise (max_num_batched_tokens 2048: a
   long prompt is one prefill step). Reported: TTFT and ITL p50/p99, output tokens/s, goodput =
   requests/s meeting both SLOs (TTFT <= --ttft-slo, 1 s; no gap between two tokens longer than
   --itl-slo, 0.25 s: a visible freeze of the stream), errors (non-2xx other than a 503 overload or
   a 429 rate limit, broken or short streams, exceptions) and those rejections apart.
2. Prefix routing: the PD app with 2 prefill replicas (+1 decode), prefix-aware vs round-robin
   prefill router, same trace: 3 requests/s, each one of 16 system prompts (512 tokens) plus
   its own 16-64-token question, 4 output tokens (TTFT is the point). Each replica's KV cache
   (320 blocks of 16 tokens) holds about 9 of the 16 prompts: with affinity each replica keeps
   its share cached; round robin sends every prompt to both, where they evict each other (LRU).
   With one shared prompt both routers would keep it cached on both replicas after a miss
   each: affinity pays once the shared prefixes outgrow one replica's cache. Before the trace
   each app sees every system prompt once (a warm cache, as a long-running service has).
   prefix_routing_ttft_speedup = round-robin mean TTFT / prefix-aware mean TTFT (p50 and p99
   ratios beside it).
After every run each engine replica must be back to no running or waiting sequences and all
KV blocks free (read per replica through the stats call Serve polls for routing):
block_accounting.

What 2 CPU cores cannot show. PD's gain is isolation: a decode engine that never runs a
prefill step. Here the prefill and decode engines are separate threads but share two cores
with the ingress, Serve's proxy, Ray and this load generator, so a prefill still slows the
decode steps running beside it (less than a stall, more than nothing). And PD spends one of
its two engine threads on prefill alone while colocated decodes and prefills on both: PD's
decode batch runs on half the compute (higher ITL p50), and its one prefill thread queues
long prompts that colocated spreads over two (higher TTFT p50). The ITL tail (p99, max) is
where PD wins here; goodput depends on which SLO binds. The KV handoff goes through Ray's
object store on one machine. On GPUs (an engine per GPU, KV over NIXL) the isolation is
complete, decode batches are far larger and the prefill share can be sized to the load
(e.g. 1 prefill : 3 decode): expect a larger ITL tail ratio and goodput favouring PD at tight
ITL SLOs. Timings also move with whatever else runs on the machine: runs.*.other_processes_cpu_share
is the share of the CPUs that processes other than this benchmark's took during each run.
Most of a --quick run (2.7-2.9 min on this 2-core machine when nothing else runs) is starting
the 14 replica processes, each importing torch, transformers and Ray Serve: setup.deploy_s,
85-100 s here then, 100-280 s with other jobs running.

JSON fields: itl_p99_colocated_over_pd, ttft_p99_colocated_over_pd, goodput_pd_over_colocated,
prefix_routing_ttft_speedup, errors (all runs), rejected (503 overloaded or 429), throughput_pd_over_colocated and
the p50 ratios, the stats behind them per app (pd, colocated, prefix_aware, round_robin), slo,
block_accounting_ok and block_accounting (per run: free KV blocks and prefix-cache hit rate
per replica), runs (per run: wall time, other processes' CPU share), setup (quick, cpu_count,
rates, engine args, model shape, deploy time, load averages), bench_wall_s.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import numpy as np
import psutil
import ray
from ray import serve
from safetensors.torch import load_file, save_file

from mlplat.data.demo import DemoDataConfig, tokenizer_corpus, write_demo_data
from mlplat.models import TinyModelConfig, build_tiny_model, load_tokenizer
from mlplat.runtime import init_ray
from mlplat.serve.config import ServeConfig
from serve_apps.llm import build_app

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = TinyModelConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                        max_position_embeddings=1024, tie_word_embeddings=False)  # fmt: skip
ENGINE = {"block_size": 16, "num_kv_blocks": 1024}  # the rest: EngineConfig defaults
PREFIX_ENGINE = {"block_size": 16, "num_kv_blocks": 320}  # ~9 of the 16 system prompts (32 blocks + question) per replica
# One torch thread per engine replica: Ray sets OMP_NUM_THREADS = max(1, floor(num_cpus)). Logical CPUs
# small enough that all four apps fit on the local cluster's 4 at once.
REPLICA = {"num_cpus": 0.25}
INGRESS = {"num_cpus": 0.1}
MODEL_NAME = "bench"
REJECTED = (503, 429)  # the ingress shedding load (overloaded), a tenant over its rate limit
MIXED_RATE, LONG_FRACTION = 2.5, 0.3  # requests/s; share of long prompts
PREFIX_RATE, SYSTEM_PROMPTS, SYSTEM_PROMPT_LEN = 3.0, 16, 512


@dataclass
class Request:
    at: float  # seconds after the trace starts
    prompt: list[int]
    max_tokens: int
    kind: str
    seed: int


def build_model(work: Path) -> tuple[Path, list[int]]:
    """The random-weight Llama, edited to sample only tokens that decode to whole characters.

    Every input embedding gets a large constant in dimension 0, which the residual stream
    carries to the last norm (h[0] ~ +16 after it); the LM-head rows of all other tokens (stop,
    special, partial UTF-8 bytes) get -3 there, putting them > 40 nats below every clean one."""
    data = write_demo_data(work / "data", DemoDataConfig(sft_rows=2000, eval_rows=10, preference_rows=10, rl_rows=10))
    model_dir = build_tiny_model(work / "model", tokenizer_corpus(data.sft), SHAPE)
    tok = load_tokenizer(model_dir)
    texts = {t: tok.decode([t], skip_special_tokens=True) for t in range(len(tok))}  # as the ingress decodes (special: "")
    clean = [t for t, text in texts.items() if t not in tok.all_special_ids and text and "\ufffd" not in text]
    weights = load_file(model_dir / "model.safetensors")
    weights["model.embed_tokens.weight"][:, 0] = 10.0
    head = weights["lm_head.weight"]
    head[:, 0] = 0.0
    head[sorted(set(range(head.shape[0])) - set(clean)), 0] = -3.0
    save_file(weights, model_dir / "model.safetensors", metadata={"format": "pt"})
    return model_dir, clean


def arrivals(rng: random.Random, rate: float, duration: float) -> list[float]:
    times, t = [], rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def mixed_trace(vocab: list[int], seed: int, rate: float, duration: float) -> list[Request]:
    """Mostly short prompts streaming long outputs; long prompts (LONG_FRACTION) arriving among them."""
    rng = random.Random(seed)
    trace = []
    for i, at in enumerate(arrivals(rng, rate, duration)):
        long = rng.random() < LONG_FRACTION
        prompt = [rng.choice(vocab) for _ in range(rng.randint(512, 768) if long else rng.randint(16, 64))]
        trace.append(Request(at, prompt, 16 if long else rng.randint(32, 96), "long" if long else "short", seed * 100_000 + i))
    return trace


def system_prompts(vocab: list[int]) -> list[list[int]]:
    return [[random.Random(1000 + k).choice(vocab) for _ in range(SYSTEM_PROMPT_LEN)] for k in range(SYSTEM_PROMPTS)]


def prefix_trace(vocab: list[int], seed: int, rate: float, duration: float) -> list[Request]:
    """Each request: one of the shared system prompts, then its own question; 4 output tokens."""
    rng, prompts = random.Random(seed), system_prompts(vocab)
    return [Request(at, rng.choice(prompts) + [rng.choice(vocab) for _ in range(rng.randint(16, 64))], 4, "prefix", seed * 100_000 + i)
            for i, at in enumerate(arrivals(rng, rate, duration))]  # fmt: skip


async def stream_one(http: httpx.AsyncClient, url: str, req: Request, t0: float) -> dict:
    await asyncio.sleep(max(0.0, t0 + req.at - time.perf_counter()))
    sent = time.perf_counter()
    out = {"kind": req.kind, "max_tokens": req.max_tokens, "send_lag_s": sent - t0 - req.at}
    body = {"model": MODEL_NAME, "prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 1.0, "seed": req.seed, "stream": True}
    chunks, finish = [], None
    try:
        async with http.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                return {**out, "status": r.status_code, "detail": r.text[:200]}
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    return {**out, "status": "stream_error", "detail": event["error"].get("message")}
                if event["choices"][0]["text"]:
                    chunks.append(time.perf_counter())
                finish = event["choices"][0]["finish_reason"] or finish
    except (httpx.HTTPError, json.JSONDecodeError) as err:
        return {**out, "status": type(err).__name__, "detail": str(err)[:200]}
    if finish != "length" or not chunks:  # the edited model never stops early: anything else is a broken stream
        return {**out, "status": "short_stream", "detail": f"finish_reason {finish}, {len(chunks)} chunks"}
    itl = [b - a for a, b in zip(chunks, chunks[1:])]
    return {**out, "status": 200, "ttft": chunks[0] - sent, "itl": itl, "chunks": len(chunks), "e2e": chunks[-1] - sent,
            "end": chunks[-1] - t0}  # fmt: skip


async def run_trace(port: int, app: str, trace: list[Request]) -> list[dict]:
    url = f"http://127.0.0.1:{port}/{app}/v1/completions"
    async with httpx.AsyncClient(timeout=httpx.Timeout(300.0), limits=httpx.Limits(max_connections=None)) as http:
        t0 = time.perf_counter() + 0.2
        return list(await asyncio.gather(*(stream_one(http, url, r, t0) for r in trace)))


def pct(xs, q) -> float | None:
    return float(np.percentile(xs, q)) if len(xs) else None


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b else None


def summarize(results: list[dict], span_s: float, ttft_slo: float, itl_slo: float) -> dict:
    """``span_s``: seconds from each run's start to its last chunk, summed over the runs pooled here."""
    ok = [r for r in results if r["status"] == 200]
    itl, ttft = [g for r in ok for g in r["itl"]], [r["ttft"] for r in ok]
    good = [r for r in ok if r["ttft"] <= ttft_slo and max(r["itl"], default=0.0) <= itl_slo]
    return {
        "requests": len(results), "ok": len(ok), "rejected": sum(r["status"] in REJECTED for r in results),
        "errors": sum(r["status"] not in (200, *REJECTED) for r in results),
        "error_samples": sorted({f"{r['status']}: {r.get('detail')}" for r in results if r["status"] not in (200, *REJECTED)})[:5],
        # The engine streams the last two tokens together (it holds back the newest one in case it is a stop
        # token), so a stream is max_tokens - 1 chunks; fewer means merged chunks and a coarser ITL.
        "merged_streams": sum(r["chunks"] < r["max_tokens"] - 1 for r in ok),
        "ttft_p50_s": pct(ttft, 50), "ttft_p99_s": pct(ttft, 99), "ttft_mean_s": float(np.mean(ttft)) if ttft else None,
        "ttft_p50_by_kind_s": {k: pct([r["ttft"] for r in ok if r["kind"] == k], 50) for k in sorted({r["kind"] for r in ok})},
        "itl_p50_s": pct(itl, 50), "itl_p90_s": pct(itl, 90), "itl_p99_s": pct(itl, 99), "itl_p999_s": pct(itl, 99.9),
        "itl_max_s": max(itl, default=None),
        "e2e_p50_s": pct([r["e2e"] for r in ok], 50),
        "output_tokens_per_s": sum(r["max_tokens"] for r in ok) / span_s, "requests_per_s": len(ok) / span_s,
        "goodput_req_s": len(good) / span_s, "slo_attainment": len(good) / len(results) if results else None,
        "max_send_lag_s": max((r["send_lag_s"] for r in results), default=0.0),  # ~0: the load generator kept up
        "span_s": span_s,
    }  # fmt: skip


def replica_stats(app: str, deployment: str) -> list[dict]:
    """Each replica's engine stats, through the per-replica call Serve polls for routing (a handle reaches one replica)."""
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix))
    return ray.get([ray.get_actor(n, namespace="serve").record_routing_stats.remote() for n in names])


def wait_idle(app: str, cfg: ServeConfig, timeout: float = 60.0) -> dict:
    """Block accounting: every engine replica back to no running or waiting sequences and all KV blocks free."""
    deployments, blocks = ("llm",) if cfg.mode == "colocated" else ("prefill", "decode"), cfg.engine_args["num_kv_blocks"]
    deadline = time.time() + timeout
    while True:
        stats = {d: replica_stats(app, d) for d in deployments}
        flat = [s for ss in stats.values() for s in ss]
        idle = bool(flat) and all(s["running"] == 0 and s["waiting"] == 0 and s["free_kv_blocks"] == blocks for s in flat)
        if idle or time.time() > deadline:
            return {"idle": idle, "replicas": len(flat), "num_kv_blocks": blocks,
                    "free_kv_blocks": {d: [s["free_kv_blocks"] for s in ss] for d, ss in stats.items()},
                    "prefix_hit_rate": {d: [round(s["prefix_hit_rate"], 3) for s in ss] for d, ss in stats.items()}}  # fmt: skip
        time.sleep(0.5)


def cpu_seconds() -> tuple[float, float]:
    """CPU seconds used so far by everything on the machine, and by this benchmark (this process and
    its descendants: the local Ray cluster it started, Serve and every replica)."""
    t = psutil.cpu_times()
    total, mine = t.user + t.nice + t.system + t.irq + t.softirq, 0.0
    me = psutil.Process()
    for proc in [me, *me.children(recursive=True)]:
        try:
            mine += sum(proc.cpu_times()[:2])
        except psutil.Error:  # exited meanwhile
            pass
    return total, mine


async def warm_up(port: int, warmups: dict[str, list[Request]]) -> None:
    """All apps at once (nothing is measured): first calls in every replica, and the caches a long-running service has."""
    results = await asyncio.gather(*(run_trace(port, name, trace) for name, trace in warmups.items()))
    failed = [r for out in results for r in out if r["status"] != 200]
    if failed:
        raise RuntimeError(f"{len(failed)} warm-up requests failed, e.g. {failed[0]['status']}: {failed[0].get('detail')}")


def other_share(total_cpu_s: float, mine_cpu_s: float, wall_s: float) -> float:
    return max(0.0, total_cpu_s - mine_cpu_s) / (wall_s * (os.cpu_count() or 1))


def compare(port: int, apps: dict[str, ServeConfig], traces: list[list[Request]], slo: tuple[float, float], accounting: dict,
            runs: dict) -> dict:  # fmt: skip
    """Run the same traces on each app, alternating which goes first. ``runs`` gets, per run, the share
    of the machine's CPU that other processes took meanwhile (the noise)."""
    results, spans = {name: [] for name in apps}, {name: 0.0 for name in apps}
    for r, trace in enumerate(traces):
        for name in list(apps) if r % 2 == 0 else list(apps)[::-1]:
            start, (total0, mine0) = time.perf_counter(), cpu_seconds()
            out = asyncio.run(run_trace(port, name, trace))
            (total1, mine1), wall = cpu_seconds(), time.perf_counter() - start
            others = other_share(total1 - total0, mine1 - mine0, wall)
            runs[f"{name}/run{r}"] = {"wall_s": wall, "requests": len(out), "other_processes_cpu_share": others}
            results[name] += out
            span = max((o["end"] for o in out if o["status"] == 200), default=trace[-1].at)
            spans[name] += span
            check = accounting[f"{name}/run{r}"] = wait_idle(name, apps[name])
            s = summarize(out, span, *slo)
            print(
                f"  run {r} {name:13} {len(out):3} requests: ttft p99 {s['ttft_p99_s']:.3f} s, itl p99 {s['itl_p99_s']:.3f} s, "
                f"errors {s['errors']}, rejected (503/429) {s['rejected']}, idle and all KV blocks free after: {check['idle']}; "
                f"other processes took {others:.0%} of the CPUs",
                flush=True,
            )
    return {name: summarize(results[name], spans[name], *slo) for name in apps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter traces, one run per app (under 3 minutes)")
    parser.add_argument("--out", type=Path, default=RESULTS / "serving.json")
    parser.add_argument("--port", type=int, default=8123, help="Serve's HTTP port (not 8000: runs beside a Serve on the default)")
    parser.add_argument("--ttft-slo", type=float, default=1.0, help="seconds to the first token")
    parser.add_argument("--itl-slo", type=float, default=0.25, help="seconds: the longest gap between two tokens of a request")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    bench_start, loadavg_start = time.perf_counter(), os.getloadavg()
    rounds, mixed_s, prefix_s = (1, 8.0, 6.0) if args.quick else (3, 30.0, 20.0)
    slo = (args.ttft_slo, args.itl_slo)

    building = ThreadPoolExecutor(1).submit(build_model, Path(tempfile.mkdtemp(prefix="serving_bench_")))  # while Ray starts
    init_ray(num_training_workers=2, include_dashboard=False, log_to_driver=False)
    accounting: dict = {}
    runs: dict = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        model_dir, vocab = building.result()
        common = dict(model=str(model_dir), model_name=MODEL_NAME, ingress=INGRESS, auth={"enabled": False})  # Serve is on loopback
        prefix_app = dict(**common, mode="pd", engine_args=PREFIX_ENGINE, prefill={**REPLICA, "num_replicas": 2}, decode=REPLICA)
        mixed_apps = {
            "pd": ServeConfig(**common, mode="pd", engine_args=ENGINE, prefill=REPLICA, decode=REPLICA),
            "colocated": ServeConfig(**common, mode="colocated", engine_args=ENGINE, colocated={**REPLICA, "num_replicas": 2}),
        }
        prefix_apps = {name: ServeConfig(**prefix_app, prefill_router=name) for name in ("prefix_aware", "round_robin")}
        start, (total0, mine0) = time.perf_counter(), cpu_seconds()
        # All four apps at once (idle ones cost nothing): one wait for replica processes instead of two.
        apps = {**mixed_apps, **prefix_apps}
        serve.run_many([serve.RunTarget(build_app(cfg), name=name, route_prefix=f"/{name}") for name, cfg in apps.items()])
        deploy_s = time.perf_counter() - start
        (total1, mine1) = cpu_seconds()
        runs["deploy"] = {"wall_s": deploy_s, "other_processes_cpu_share": other_share(total1 - total0, mine1 - mine0, deploy_s)}
        print(
            f"apps deployed in {deploy_s:.0f} s (other processes took {runs['deploy']['other_processes_cpu_share']:.0%} of the CPUs)",
            flush=True,
        )
        warm = [Request(0.1 * i, [vocab[i]] * (600 if i % 2 else 24), 8, "warmup", i) for i in range(4)]
        seen = [Request(0.1 * k, p + [vocab[k]] * 8, 4, "warmup", k) for k, p in enumerate(system_prompts(vocab))]  # each prompt once
        asyncio.run(warm_up(args.port, {**{name: warm for name in mixed_apps}, **{name: seen for name in prefix_apps}}))
        traces = [mixed_trace(vocab, r, MIXED_RATE, mixed_s) for r in range(rounds)]
        mixed = compare(args.port, mixed_apps, traces, slo, accounting, runs)
        traces = [prefix_trace(vocab, 100 + r, PREFIX_RATE, prefix_s) for r in range(rounds)]
        routing = compare(args.port, prefix_apps, traces, slo, accounting, runs)
    finally:
        ray.shutdown()  # the local cluster, Serve with it

    pd, colo, pa, rr = mixed["pd"], mixed["colocated"], routing["prefix_aware"], routing["round_robin"]
    stats = {"pd": pd, "colocated": colo, "prefix_aware": pa, "round_robin": rr}
    report = {
        "itl_p99_colocated_over_pd": ratio(colo["itl_p99_s"], pd["itl_p99_s"]),
        "ttft_p99_colocated_over_pd": ratio(colo["ttft_p99_s"], pd["ttft_p99_s"]),
        "goodput_pd_over_colocated": ratio(pd["goodput_req_s"], colo["goodput_req_s"]),
        "prefix_routing_ttft_speedup": ratio(rr["ttft_mean_s"], pa["ttft_mean_s"]),  # mean TTFT, round robin / prefix-aware
        "errors": sum(s["errors"] for s in stats.values()),
        "rejected": sum(s["rejected"] for s in stats.values()),
        "throughput_pd_over_colocated": ratio(pd["output_tokens_per_s"], colo["output_tokens_per_s"]),
        "itl_p50_colocated_over_pd": ratio(colo["itl_p50_s"], pd["itl_p50_s"]),
        "itl_max_colocated_over_pd": ratio(colo["itl_max_s"], pd["itl_max_s"]),
        "ttft_p50_colocated_over_pd": ratio(colo["ttft_p50_s"], pd["ttft_p50_s"]),
        "prefix_routing_ttft_p50_speedup": ratio(rr["ttft_p50_s"], pa["ttft_p50_s"]),
        "prefix_routing_ttft_p99_speedup": ratio(rr["ttft_p99_s"], pa["ttft_p99_s"]),
        "block_accounting_ok": all(a["idle"] for a in accounting.values()),
        **stats,
        "slo": {"ttft_s": args.ttft_slo, "max_itl_s": args.itl_slo},
        "block_accounting": accounting,
        "runs": runs,  # per run: wall time, requests, share of the CPUs other processes took meanwhile
        "setup": {
            "quick": args.quick, "cpu_count": os.cpu_count(), "runs_per_app": rounds, "engine_threads_per_replica": 1,
            "mixed": {"rate_req_s": MIXED_RATE, "duration_s": mixed_s, "long_fraction": LONG_FRACTION, "engine_args": ENGINE},
            "prefix": {"rate_req_s": PREFIX_RATE, "duration_s": prefix_s, "system_prompts": SYSTEM_PROMPTS,
                       "system_prompt_tokens": SYSTEM_PROMPT_LEN, "engine_args": PREFIX_ENGINE},
            "model": SHAPE.model_dump(), "deploy_s": deploy_s,
            "loadavg_start": loadavg_start, "loadavg_end": os.getloadavg(),
        },
        "bench_wall_s": time.perf_counter() - bench_start,
    }  # fmt: skip

    def row(key: str, a: dict, b: dict) -> str:
        columns = ((a[key], 10, 3), (b[key], 10, 3), (ratio(b[key], a[key]), 8, 2))
        cells = [f"{x:{w}.{d}f}" if x is not None else f"{'-':>{w}}" for x, w, d in columns]
        return f"{key:26} {' '.join(cells)}"

    print(f"\n{'measure':26} {'pd':>10} {'colocated':>10} {'colo/pd':>8}")
    for key in ("ttft_p50_s", "ttft_p99_s", "itl_p50_s", "itl_p99_s", "itl_p999_s", "itl_max_s", "output_tokens_per_s", "goodput_req_s"):
        print(row(key, pd, colo))
    print(
        f"goodput SLO: TTFT <= {args.ttft_slo} s and no gap between tokens > {args.itl_slo} s; "
        f"met by {pd['slo_attainment']:.0%} (pd), {colo['slo_attainment']:.0%} (colocated) of requests"
    )
    print(f"\n{'measure':26} {'prefix':>10} {'round-rob':>10} {'rr/prefix':>8}")
    for key in ("ttft_mean_s", "ttft_p50_s", "ttft_p99_s"):
        print(row(key, pa, rr))
    hit_rates = {k: v["prefix_hit_rate"]["prefill"] for k, v in accounting.items() if k.split("/")[0] in prefix_apps}
    print(f"prefill replicas' prefix-cache hit rates (of prompt tokens, warm-up included): {hit_rates}")
    noise = max(r["other_processes_cpu_share"] for k, r in runs.items() if k != "deploy")
    print(
        f"errors {report['errors']}, rejected (503/429) {report['rejected']}, block accounting ok: {report['block_accounting_ok']}, "
        f"other processes' share of the CPUs during runs: up to {noise:.0%}, "
        f"wall {report['bench_wall_s']:.0f} s"
    )
    print(json.dumps({k: v for k, v in report.items() if not isinstance(v, dict)}, indent=1))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
