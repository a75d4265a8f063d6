"""Claim: prefill/decode disaggregation (mode: pd) keeps streaming decodes smooth when long
prompts arrive among them, where a colocated engine stalls every decode on its replica for
the length of a long prefill; and the prefix-aware prefill router beats round robin on TTFT
when requests share system prompts. Baselines in the same run: the colocated app on the same
engine threads, and the PD app with ``prefill_router: round_robin``.

    python benchmarks/serving.py [--quick] [--out FILE] [--port 8123] [--ttft-slo S] [--itl-slo S] [--shape tiny|qwen2.5-0.5b]
                                 [--only prefill_batching]

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
3. Batched prefill: a burst of 16 fresh prompts (32-128 tokens, 2 output tokens) sent together to a PD app with one
   prefill replica, batched (the replica's engine admits them into one continuous batch) vs the same engine limited
   to one prefill at a time (EngineConfig.max_num_prefills: 1, as prefill replicas ran before), 8 bursts per app,
   alternating which goes first. prefill_batching_throughput_ratio = prompts/s batched / one at a time, prompts/s
   being the burst's prompts over the time from its send to its last first token; prefill_batching_ttft_speedup
   the mean TTFT ratio. The same bursts on the prefill replica's engine loop alone (AsyncEngine in this process, one
   torch thread) give prefill_batching_engine_*: batching's effect without the per-request costs of Serve, the
   ingress and the handoff around it. And n = 4 in PD mode, counted on engines in this process: prompt tokens the prefill engine
   computes when the four samples' first tokens come from one prefill (forked) vs prefilling the prompt 4 times
   (n4_prefill_tokens_saved_fraction) and vs the four n = 1 pipelines on one prefill replica, whose prefix cache
   made the repeats cheap (..._vs_one_replica); KV handoff bytes and decode-side KV blocks saved beside them.
   Left out of --quick runs (the deploy alone fills their 3 minutes): --only prefill_batching [--quick] runs it
   alone (3 bursts per app with --quick), to results/serving_prefill_batching.json.
4. KV-event routing: PD apps with 2 prefill replicas (PREFIX_ENGINE, +1 decode), one per prefill router (kv_events,
   prefix_aware, round_robin), on the trace of 2. (16 system prompts, ~9 fit one replica's cache): kv_event_routing_ttft_speedup
   = round-robin mean TTFT / kv_events mean TTFT, kv_event_over_hash_system_prompts the same over prefix_aware. Then
   documents: 16 prompts that share a 128-token preamble and then diverge (448 tokens each: ~11 fit one replica, all fit
   two), plus a 16-32-token question, 3 requests/s, kv_events vs prefix_aware: hashing the first 64 tokens sends every
   document to one replica (kv_event_over_hash_routing = prefix_aware mean TTFT / kv_events mean TTFT). Each trace
   after a warm-up that shows every prompt once. Left out of --quick runs: --only kv_routing [--quick] runs it alone
   (one 12 s run per app with --quick), to results/serving_kv_routing.json; per-router stats under kv_routing.

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
rates, engine args, model shape, deploy time, load averages), bench_wall_s, shape; full runs and --only prefill_batching:
prefill_batching_throughput_ratio, prefill_batching_ttft_speedup, prefill_batched and prefill_one_at_a_time (per app:
prompts_per_s, ttft_mean_s, ttft_p99_s, burst_makespan_s), prefill_batching_engine_throughput_ratio and
prefill_batching_engine_ttft_speedup (the same bursts on the replica's engine loop alone, in this process) with their
stats (prefill_batching_engine), n4_prefill_tokens_saved_fraction,
n4_prefill_tokens_saved_fraction_vs_one_replica, n4_handoff_bytes_saved_fraction, n4_decode_kv_blocks_saved_fraction, n4_counts;
full runs and --only kv_routing: kv_event_routing_ttft_speedup, kv_event_over_hash_routing, kv_event_over_hash_system_prompts,
kv_routing (per trace, per router: the stats of summarize()).

``--shape qwen2.5-0.5b`` (mlplat.models.shapes: 494M parameters, a tied 151,936-entry vocabulary,
random weights edited as above; default output serving_<shape>.json) serves a real model's
weights, head and logits. On this 2-core, 23 GiB machine it runs the PD vs colocated comparison
only (4 replicas, one fp32 copy of the weights each, ~2.5 GB), on the mixed trace slowed to 0.1
requests/s for 120 s (one run per app): a 0.5B decode step on one engine thread takes ~50x the
tiny model's, so give it SLOs to match (e.g. --ttft-slo 30 --itl-slo 2). The routing apps (6 more
replicas) need a machine with the memory.
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
from mlplat.models.shapes import SHAPES, build_random_model
from mlplat.runtime import init_ray
from mlplat.serve.config import ServeConfig
from serve_apps.llm import build_app

RESULTS = Path(__file__).resolve().parent / "results"
SHAPE = TinyModelConfig(hidden_size=384, intermediate_size=1024, num_hidden_layers=6, num_attention_heads=6, num_key_value_heads=2,
                        max_position_embeddings=1024, tie_word_embeddings=False)  # fmt: skip
TINY = "tiny"  # SHAPE; --shape may name a real model's shape instead (mlplat.models.shapes)
# A real shape (--shape qwen2.5-0.5b): one fp32 copy of the weights per replica (packed: two, 4.5 GB at 0.5B), the mixed
# trace slowed to what one engine thread keeps up with (a decode step ~50x the tiny model's), and the mixed comparison
# only: the routing apps' 6 more replicas of a 2 GB model do not fit a 23 GiB machine beside the first 4.
REAL_SHAPE_ENGINE = {"cpu_packed_weights": False}
REAL_SHAPE_MIXED_RATE, REAL_SHAPE_MIXED_S = 0.1, 120.0
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


def build_model(work: Path, shape: str = TINY) -> tuple[Path, list[int]]:
    """The random-weight Llama (or ``shape``, a real model's shape), edited to sample only tokens that decode to whole characters.

    Every input embedding gets a large constant in dimension 0, which the residual stream
    carries to the last norm (h[0] ~ +16 after it); the LM-head rows of all other tokens (stop,
    special, partial UTF-8 bytes, ids past the tiny tokenizer's) get -3 there, putting them > 40 nats
    below every clean one. A tied head is the embedding itself: its clean rows keep the +10 (it lifts
    every clean token's logit alike), the others' -3 is never an input (prompts are clean tokens)."""
    data = write_demo_data(work / "data", DemoDataConfig(sft_rows=2000, eval_rows=10, preference_rows=10, rl_rows=10))
    if shape in SHAPES:
        model_dir = build_random_model(work / "model", SHAPES[shape], tokenizer_corpus(data.sft))
    else:
        model_dir = build_tiny_model(work / "model", tokenizer_corpus(data.sft), SHAPE)
    tok = load_tokenizer(model_dir)
    texts = {t: tok.decode([t], skip_special_tokens=True) for t in range(len(tok))}  # as the ingress decodes (special: "")
    clean = [t for t, text in texts.items() if t not in tok.all_special_ids and text and "\ufffd" not in text]
    weights = load_file(model_dir / "model.safetensors")
    embedding = weights["model.embed_tokens.weight"]
    if "lm_head.weight" in weights:
        embedding[:, 0] = 10.0
        head = weights["lm_head.weight"]
        head[:, 0] = 0.0
    else:  # tied
        embedding[clean, 0] = 10.0
        head = embedding
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
        # The engine streams each token as it is sampled, so a stream is max_tokens chunks (max_tokens - 1 before it
        # streamed the first one at once); fewer means merged chunks and a coarser ITL.
        "merged_streams": sum(r["chunks"] < r["max_tokens"] for r in ok),
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


# -- batched prefill (issue 35): a burst on one prefill replica, batched vs one prompt at a time; n = 4 forked -----------
BURST, BURST_TOKENS = 16, (32, 128)  # prompts arriving together, and their lengths
BURST_ENGINE = {"block_size": 16, "num_kv_blocks": 1024}  # the batched app's; the baseline's adds max_num_prefills: 1


def burst(vocab: list[int], seed: int) -> list[Request]:
    """BURST fresh prompts (no prefix hits between bursts), all sent at once; 2 output tokens (TTFT is the point)."""
    rng = random.Random(seed)
    return [Request(0.0, [rng.choice(vocab) for _ in range(rng.randint(*BURST_TOKENS))], 2, "burst", seed * 100_000 + i)
            for i in range(BURST)]  # fmt: skip


def burst_stats(results: list[list[dict]]) -> dict:
    """Per app, over its bursts: mean TTFT, and prompts/s = prompts / the time from a burst's send to its last first token."""
    ok = [r for out in results for r in out if r["status"] == 200]
    makespans = [max(r["ttft"] for r in out if r["status"] == 200) for out in results if any(r["status"] == 200 for r in out)]
    return {"requests": sum(map(len, results)), "ok": len(ok), "errors": sum(map(len, results)) - len(ok),
            "ttft_mean_s": float(np.mean([r["ttft"] for r in ok])) if ok else None, "ttft_p99_s": pct([r["ttft"] for r in ok], 99),
            "prompts_per_s": len(ok) / sum(makespans) if makespans else None, "burst_makespan_s": makespans}  # fmt: skip


def prefill_batching(port: int, common: dict, vocab: list[int], rounds: int, accounting: dict, runs: dict) -> dict:
    """The burst on a PD app with one prefill replica, batched vs the same engine limited to one prefill at a time
    (EngineConfig.max_num_prefills: 1, how a prefill replica ran before), alternating which goes first."""
    apps = {"prefill_batched": ServeConfig(**common, mode="pd", engine_args=BURST_ENGINE, prefill=REPLICA, decode=REPLICA),
            "prefill_one_at_a_time": ServeConfig(**common, mode="pd", engine_args={**BURST_ENGINE, "max_num_prefills": 1},
                                                 prefill=REPLICA, decode=REPLICA)}  # fmt: skip
    start = time.perf_counter()
    serve.run_many([serve.RunTarget(build_app(cfg), name=name, route_prefix=f"/{name}") for name, cfg in apps.items()])
    runs["prefill_batching/deploy"] = {"wall_s": time.perf_counter() - start}
    try:
        asyncio.run(warm_up(port, {name: burst(vocab, 900) for name in apps}))
        results = {name: [] for name in apps}
        for r in range(rounds):
            trace = burst(vocab, 900 + 1 + r)
            for name in list(apps) if r % 2 == 0 else list(apps)[::-1]:
                begin, (total0, mine0) = time.perf_counter(), cpu_seconds()
                results[name].append(asyncio.run(run_trace(port, name, trace)))
                (total1, mine1), wall = cpu_seconds(), time.perf_counter() - begin
                others = other_share(total1 - total0, mine1 - mine0, wall)
                runs[f"{name}/run{r}"] = {"wall_s": wall, "requests": BURST, "other_processes_cpu_share": others}
                accounting[f"{name}/run{r}"] = wait_idle(name, apps[name])
        stats = {name: burst_stats(out) for name, out in results.items()}
    finally:
        for name in apps:
            serve.delete(name)
    batched, single = stats["prefill_batched"], stats["prefill_one_at_a_time"]
    for name, st in stats.items():
        print(f"  {name:22} {st['ok']:3}/{st['requests']} ok: {st['prompts_per_s']:.1f} prompts/s, mean TTFT {st['ttft_mean_s']:.3f} s",
              flush=True)  # fmt: skip
    return {"prefill_batching_throughput_ratio": ratio(batched["prompts_per_s"], single["prompts_per_s"]),
            "prefill_batching_ttft_speedup": ratio(single["ttft_mean_s"], batched["ttft_mean_s"]), **stats}  # fmt: skip


def prefill_batching_in_engine(model_dir: Path, vocab: list[int], rounds: int) -> dict:
    """The same bursts on the prefill replica's engine loop alone (AsyncEngine in this process, one torch thread as a
    replica has; no Serve, ingress or handoff): what batching changes inside the replica, apart from the per-request
    costs around it that the app-level figure includes."""
    import torch

    from mlplat.engine import EngineConfig, SamplingParams
    from mlplat.serve.async_engine import AsyncEngine

    async def one_burst(engine: AsyncEngine, trace: list[Request]) -> list[dict]:
        start = time.perf_counter()

        async def prefill(req: Request) -> dict:
            await engine.prefill(req.prompt, SamplingParams(temperature=1.0, seed=req.seed, max_tokens=req.max_tokens))
            return {"status": 200, "ttft": time.perf_counter() - start}

        return list(await asyncio.gather(*(prefill(r) for r in trace)))

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        engines = {name: AsyncEngine(EngineConfig(model=str(model_dir), **BURST_ENGINE, **extra))
                   for name, extra in (("prefill_batched", {}), ("prefill_one_at_a_time", {"max_num_prefills": 1}))}  # fmt: skip
        results = {name: [] for name in engines}
        for r in range(-1, rounds):  # round -1 warms up
            for name in list(engines) if r % 2 == 0 else list(engines)[::-1]:
                out = asyncio.run(one_burst(engines[name], burst(vocab, 950 + r)))
                results[name] += [out] if r >= 0 else []
    finally:
        torch.set_num_threads(threads)
    stats = {name: burst_stats(out) for name, out in results.items()}
    batched, single = stats["prefill_batched"], stats["prefill_one_at_a_time"]
    return {"prefill_batching_engine_throughput_ratio": ratio(batched["prompts_per_s"], single["prompts_per_s"]),
            "prefill_batching_engine_ttft_speedup": ratio(single["ttft_mean_s"], batched["ttft_mean_s"]),
            "prefill_batching_engine": stats}  # fmt: skip


def n4_fork_savings(model_dir: Path, vocab: list[int], prompts: int = 8) -> dict:
    """``n = 4`` in PD mode, counted on engines in this process (no timing): one prefill whose four first tokens come from its
    logits and one import whose samples share the prompt's blocks (forked), against the four prefill -> decode pipelines
    of n = 1 it replaced: prefilled 4 times (no prefix cache, or the four on four prefill replicas), and on one prefill
    replica, whose prefix cache turned the repeats into recomputes of the last partial block."""
    from mlplat.engine import EngineConfig, LLMEngine, SamplingParams

    params = SamplingParams(temperature=1.0, seed=1, n=4, max_tokens=2)
    as_before = [params.model_copy(update={"n": 1, "seed": params.seed + j}) for j in range(4)]  # one pipeline per sample
    ways = {"forked": [params], "one_replica": as_before, "no_prefix_cache": as_before}
    engines = {way: LLMEngine(EngineConfig(model=str(model_dir), **BURST_ENGINE, enable_prefix_caching=way != "no_prefix_cache"))
               for way in ways}  # fmt: skip
    decode = LLMEngine(EngineConfig(model=str(model_dir), **BURST_ENGINE))
    computed, handoff_bytes, decode_blocks = dict.fromkeys(ways, 0), dict.fromkeys(ways, 0), dict.fromkeys(ways, 0)
    rng = random.Random(4)
    for _ in range(prompts):  # random prompts: no prefix hits between them
        prompt = [rng.choice(vocab) for _ in range(rng.randint(*BURST_TOKENS))]
        for way, asks in ways.items():
            prefill = engines[way]
            hits = prefill.block_manager.hit_tokens
            payloads = [prefill.prefill(prompt, p) for p in asks]
            computed[way] += len(prompt) * len(asks) - (prefill.block_manager.hit_tokens - hits)  # prompt tokens run through the model
            handoff_bytes[way] += sum(p.nbytes for p in payloads)
            ids = [decode.add_prefilled(payload, p) for payload, p in zip(payloads, asks)]
            decode_blocks[way] += len(decode.block_manager.blocks) - decode.block_manager.num_free_blocks  # held by the imports
            for i in ids:
                decode.abort(i)
    saved = lambda counts, way: 1 - counts["forked"] / counts[way]  # noqa: E731
    return {"n4_prefill_tokens_saved_fraction": saved(computed, "no_prefix_cache"),  # vs prefilling the prompt 4 times
            "n4_prefill_tokens_saved_fraction_vs_one_replica": saved(computed, "one_replica"),
            "n4_handoff_bytes_saved_fraction": saved(handoff_bytes, "one_replica"),
            "n4_decode_kv_blocks_saved_fraction": saved(decode_blocks, "one_replica"),
            "n4_counts": {"prompts": prompts, "prompt_tokens_computed": computed, "handoff_bytes": handoff_bytes,
                          "decode_kv_blocks_held": decode_blocks}}  # fmt: skip


def prefill_batching_alone(args) -> dict:
    """``--only prefill_batching``: the burst comparison's two apps alone on a fresh local cluster, and the n = 4 counts."""
    building = ThreadPoolExecutor(1).submit(build_model, Path(tempfile.mkdtemp(prefix="serving_bench_")), args.shape)  # while Ray starts
    init_ray(num_training_workers=2, include_dashboard=False, log_to_driver=False)
    accounting, runs = {}, {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        model_dir, vocab = building.result()
        common = dict(model=str(model_dir), model_name=MODEL_NAME, ingress=INGRESS, auth={"enabled": False})  # Serve is on loopback
        report = prefill_batching(args.port, common, vocab, 3 if args.quick else 8, accounting, runs)
    finally:
        ray.shutdown()  # the local cluster, Serve with it
    report |= prefill_batching_in_engine(model_dir, vocab, 3 if args.quick else 8)
    return {**report, **n4_fork_savings(model_dir, vocab), "block_accounting_ok": all(a["idle"] for a in accounting.values()),
            "block_accounting": accounting, "runs": runs,
            "setup": {"quick": args.quick, "cpu_count": os.cpu_count(), "burst_prompts": BURST, "burst_prompt_tokens": BURST_TOKENS,
                      "engine_args": BURST_ENGINE, "shape": args.shape, "loadavg_end": os.getloadavg()}}  # fmt: skip


# -- KV-event routing (issue 35): the system prompts on three prefill routers; documents behind one preamble on two ------
ROUTERS = ("kv_events", "prefix_aware", "round_robin")
PREAMBLE_LEN, DOCUMENTS, DOCUMENT_LEN = 128, 16, 448  # 16 x 28 blocks + the preamble's 8: over one replica's 320, under two's


def documents(vocab: list[int]) -> list[list[int]]:
    """DOCUMENTS prompts that share their first PREAMBLE_LEN tokens (an instruction preamble) and then diverge."""
    preamble = [random.Random(2000).choice(vocab) for _ in range(PREAMBLE_LEN)]
    return [preamble + [random.Random(2001 + k).choice(vocab) for _ in range(DOCUMENT_LEN)] for k in range(DOCUMENTS)]


def document_trace(vocab: list[int], seed: int, rate: float, duration: float) -> list[Request]:
    """Each request: one of the documents (preamble included), then its own question; 4 output tokens."""
    rng, docs = random.Random(seed), documents(vocab)
    return [Request(at, rng.choice(docs) + [rng.choice(vocab) for _ in range(rng.randint(16, 32))], 4, "document", seed * 100_000 + i)
            for i, at in enumerate(arrivals(rng, rate, duration))]  # fmt: skip


def kv_routing(port: int, common: dict, vocab: list[int], rounds: int, duration_s: float, slo: tuple, accounting: dict,
               runs: dict) -> dict:  # fmt: skip
    """PD apps with 2 prefill replicas, one per prefill router, on the system-prompt trace (all three) and the document
    trace (kv_events vs prefix_aware: hashing the first 64 tokens cannot tell the documents apart), each after a warm-up
    that shows every prompt once."""
    apps = {f"route_{name}": ServeConfig(**common, mode="pd", engine_args=PREFIX_ENGINE, prefill={**REPLICA, "num_replicas": 2},
                                         decode=REPLICA, prefill_router=name) for name in ROUTERS}  # fmt: skip
    start = time.perf_counter()
    serve.run_many([serve.RunTarget(build_app(cfg), name=name, route_prefix=f"/{name}") for name, cfg in apps.items()])
    runs["kv_routing/deploy"] = {"wall_s": time.perf_counter() - start}
    stats = {}
    try:
        for kind, prompts, trace, names in (
            ("system_prompts", system_prompts(vocab), prefix_trace, list(apps)),
            ("documents", documents(vocab), document_trace, ["route_kv_events", "route_prefix_aware"]),
        ):
            seen = [Request(0.1 * k, p + [vocab[k]] * 8, 4, "warmup", k) for k, p in enumerate(prompts)]  # each prompt once
            asyncio.run(warm_up(port, {name: seen for name in names}))
            traces = [trace(vocab, 300 + r, PREFIX_RATE, duration_s) for r in range(rounds)]
            checks, timing = {}, {}
            out = compare(port, {name: apps[name] for name in names}, traces, slo, checks, timing)
            stats[kind] = {name.removeprefix("route_"): st for name, st in out.items()}
            accounting |= {f"{kind}:{k}": v for k, v in checks.items()}
            runs |= {f"{kind}:{k}": v for k, v in timing.items()}
    finally:
        for name in apps:
            serve.delete(name)
    sp, docs = stats["system_prompts"], stats["documents"]
    for kind, by_router in stats.items():
        print("  " + kind + ": " + ", ".join(f"{r} mean TTFT {st['ttft_mean_s']:.3f} s" for r, st in by_router.items()), flush=True)
    return {"kv_event_routing_ttft_speedup": ratio(sp["round_robin"]["ttft_mean_s"], sp["kv_events"]["ttft_mean_s"]),
            "kv_event_over_hash_routing": ratio(docs["prefix_aware"]["ttft_mean_s"], docs["kv_events"]["ttft_mean_s"]),
            "kv_event_over_hash_system_prompts": ratio(sp["prefix_aware"]["ttft_mean_s"], sp["kv_events"]["ttft_mean_s"]),
            "kv_routing": stats}  # fmt: skip


def kv_routing_alone(args) -> dict:
    """``--only kv_routing``: the routing apps alone on a fresh local cluster."""
    building = ThreadPoolExecutor(1).submit(build_model, Path(tempfile.mkdtemp(prefix="serving_bench_")), args.shape)  # while Ray starts
    init_ray(num_training_workers=2, include_dashboard=False, log_to_driver=False)
    accounting, runs = {}, {}
    rounds, duration_s = (1, 12.0) if args.quick else (3, 20.0)
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        model_dir, vocab = building.result()
        common = dict(model=str(model_dir), model_name=MODEL_NAME, ingress=INGRESS, auth={"enabled": False})  # Serve is on loopback
        report = kv_routing(args.port, common, vocab, rounds, duration_s, (args.ttft_slo, args.itl_slo), accounting, runs)
    finally:
        ray.shutdown()  # the local cluster, Serve with it
    return {**report, "block_accounting_ok": all(a["idle"] for a in accounting.values()), "block_accounting": accounting, "runs": runs,
            "setup": {"quick": args.quick, "cpu_count": os.cpu_count(), "runs_per_app": rounds, "duration_s": duration_s,
                      "rate_req_s": PREFIX_RATE, "system_prompts": SYSTEM_PROMPTS, "system_prompt_tokens": SYSTEM_PROMPT_LEN,
                      "documents": DOCUMENTS, "preamble_tokens": PREAMBLE_LEN, "document_tokens": DOCUMENT_LEN,
                      "engine_args": PREFIX_ENGINE, "shape": args.shape, "loadavg_end": os.getloadavg()}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="shorter traces, one run per app (under 3 minutes)")
    parser.add_argument("--out", type=Path, default=None, help="default: results/serving.json (tiny), serving_<shape>.json otherwise")
    parser.add_argument("--port", type=int, default=8123, help="Serve's HTTP port (not 8000: runs beside a Serve on the default)")
    parser.add_argument("--ttft-slo", type=float, default=1.0, help="seconds to the first token")
    parser.add_argument("--itl-slo", type=float, default=0.25, help="seconds: the longest gap between two tokens of a request")
    parser.add_argument("--shape", choices=[TINY, *SHAPES], default=TINY,
                        help="the model: the tiny Llama, or a real model's shape with random weights (the mixed comparison only)")
    parser.add_argument("--only", choices=["prefill_batching", "kv_routing"], default=None,
                        help="one section alone (its own apps), to results/serving_<section>.json; full runs include it, --quick ones not")
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded
    bench_start, loadavg_start = time.perf_counter(), os.getloadavg()
    if args.only:
        alone = {"prefill_batching": prefill_batching_alone, "kv_routing": kv_routing_alone}[args.only]
        report = {**alone(args), "loadavg_start": loadavg_start, "bench_wall_s": time.perf_counter() - bench_start}
        print(json.dumps({k: v for k, v in report.items() if not isinstance(v, dict | list)}, indent=1))
        out = args.out or RESULTS / f"serving_{args.only}.json"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps(report, indent=2))
        print(f"wrote {out}")
        return
    rounds, mixed_s, prefix_s = (1, 8.0, 6.0) if args.quick else (3, 30.0, 20.0)
    real_shape = args.shape in SHAPES
    args.out = args.out or RESULTS / ("serving.json" if not real_shape else f"serving_{args.shape}.json")
    engine_args, mixed_rate = ({**ENGINE, **REAL_SHAPE_ENGINE}, REAL_SHAPE_MIXED_RATE) if real_shape else (ENGINE, MIXED_RATE)
    if real_shape:
        rounds, mixed_s = 1, REAL_SHAPE_MIXED_S
    slo = (args.ttft_slo, args.itl_slo)

    building = ThreadPoolExecutor(1).submit(build_model, Path(tempfile.mkdtemp(prefix="serving_bench_")), args.shape)  # while Ray starts
    init_ray(num_training_workers=2, include_dashboard=False, log_to_driver=False)
    accounting: dict = {}
    runs: dict = {}
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": args.port})
        model_dir, vocab = building.result()
        common = dict(model=str(model_dir), model_name=MODEL_NAME, ingress=INGRESS, auth={"enabled": False})  # Serve is on loopback
        prefix_app = dict(**common, mode="pd", engine_args=PREFIX_ENGINE, prefill={**REPLICA, "num_replicas": 2}, decode=REPLICA)
        mixed_apps = {
            "pd": ServeConfig(**common, mode="pd", engine_args=engine_args, prefill=REPLICA, decode=REPLICA),
            "colocated": ServeConfig(**common, mode="colocated", engine_args=engine_args, colocated={**REPLICA, "num_replicas": 2}),
        }
        routers = () if real_shape else ("prefix_aware", "round_robin")
        prefix_apps = {name: ServeConfig(**prefix_app, prefill_router=name) for name in routers}
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
        traces = [mixed_trace(vocab, r, mixed_rate, mixed_s) for r in range(rounds)]
        mixed = compare(args.port, mixed_apps, traces, slo, accounting, runs)
        traces = [prefix_trace(vocab, 100 + r, PREFIX_RATE, prefix_s) for r in range(rounds)]
        routing = compare(args.port, prefix_apps, traces, slo, accounting, runs)
        # Batched prefill (--only prefill_batching runs it alone; --quick leaves it out to stay under 3 minutes), on the
        # CPUs of the apps above, deleted first (the local cluster's 4 logical CPUs hold those or these)
        batching = {}
        if not (args.quick or real_shape):
            for name in apps:
                serve.delete(name)
            batching = prefill_batching(args.port, common, vocab, 8, accounting, runs)
        # KV-event routing (--only kv_routing runs it alone; left out of --quick runs as batched prefill is)
        kv_routes = {} if args.quick or real_shape else kv_routing(args.port, common, vocab, rounds, prefix_s, slo, accounting, runs)
    finally:
        ray.shutdown()  # the local cluster, Serve with it
    batching |= {} if args.quick or real_shape else {**prefill_batching_in_engine(model_dir, vocab, 8), **n4_fork_savings(model_dir, vocab)}

    not_run = summarize([], 1.0, *slo)  # the routing comparison on a real shape: no requests, every figure None
    pd, colo, pa, rr = mixed["pd"], mixed["colocated"], routing.get("prefix_aware", not_run), routing.get("round_robin", not_run)
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
        "shape": args.shape,
        **batching,
        **kv_routes,
        **stats,
        "slo": {"ttft_s": args.ttft_slo, "max_itl_s": args.itl_slo},
        "block_accounting": accounting,
        "runs": runs,  # per run: wall time, requests, share of the CPUs other processes took meanwhile
        "setup": {
            "quick": args.quick, "cpu_count": os.cpu_count(), "runs_per_app": rounds, "engine_threads_per_replica": 1,
            "mixed": {"rate_req_s": mixed_rate, "duration_s": mixed_s, "long_fraction": LONG_FRACTION, "engine_args": engine_args},
            "prefix": {"rate_req_s": PREFIX_RATE, "duration_s": prefix_s, "system_prompts": SYSTEM_PROMPTS,
                       "system_prompt_tokens": SYSTEM_PROMPT_LEN, "engine_args": PREFIX_ENGINE},
            "model": (SHAPES[args.shape] if real_shape else SHAPE).model_dump(), "deploy_s": deploy_s,
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
