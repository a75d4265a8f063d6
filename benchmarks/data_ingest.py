"""Claim: the SFT data pipeline (mlplat.data.sft: Ray Data read -> validate -> chat template
-> tokenize in Ray tasks -> pack) beats a single-process loop, packs rows far tighter
than padding, keeps Ray's object store bounded on a corpus several times larger than it,
and keeps the trainer fed. Baseline in the same run: plain Python (``datasets`` is not a
dependency) on the same corpus, tokenizer, template and ``max_seq_len``: read the JSONL,
``json.loads``, ``mlplat.data.chat.tokenize_chat`` per row.

    python benchmarks/data_ingest.py [--quick] [--out FILE]

Measures (all in one run, on a generated multi-turn chat corpus whose rows spread from
~16 to over ``max_seq_len`` tokens, and the tiny model's tokenizer trained on it):
- tokens/s of the whole pipeline (``prepare_sft_dataset(pack=True)``: its validation pass,
  then iterating every packed row) against the baseline; ``throughput_ratio`` = ours / baseline;
- ``packing_efficiency``: non-padding tokens / all tokens in the packed rows, and
  ``padding_efficiency``: the same for the unpacked rows right-padded to the longest row of
  each batch of ``pad_batch_size`` (corpus order; the baseline's token counts, which equal
  the pipeline's: checked);
- the same pipeline on a larger corpus (a directory of JSONL files: the one above plus
  more of the same, ``corpus_over_limit_ratio`` times the store: 5 in the full run, 0.25 with
  ``--quick``, where 5x Ray's minimum store would take minutes to tokenize) on a fresh Ray
  cluster whose object store is capped at ``object_store_limit_bytes`` (Ray's minimum,
  75 MiB); peak object-store use, spilling (bytes spilled, and the peak size of the spill
  directory) sampled from the raylet during the run, the driver's peak RSS;
  ``object_store_bounded``: the store never went over the limit and nothing was spilled
  or allocated outside it (so the footprint does not depend on the corpus size);
- ``data_wait_fraction`` of a short SFT run (``train_apps.sft.run_sft``, tiny model, 2
  workers, packed rows; 50 steps of 32 rows per worker, 20 of 8 with ``--quick``): share
  of rank 0's step time spent waiting for the next batch, as the recipe reports it
  (``SFTResult.data_wait_fraction``; skipped with a message if the recipe cannot report it);
  ``data_wait_fraction_after_first_window``: the same without the first log window, whose
  first batch waits for the pipeline to start (``first_window_data_wait_s``).
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import random
import resource
import shutil
import tempfile
import threading
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is ever downloaded

import numpy as np
import psutil
import ray
import ray.data

from mlplat.data.chat import load_chat_tokenizer, tokenize_chat
from mlplat.data.demo import tokenizer_corpus
from mlplat.data.sft import SFTDataConfig, prepare_sft_dataset
from mlplat.models import build_tiny_model
from mlplat.runtime import init_ray
from mlplat.train.batch import PAD_SEQ_ID

OBJECT_STORE_MIN = 75 * 1024 * 1024  # ray_constants.OBJECT_STORE_MINIMUM_MEMORY_BYTES: ray.init refuses less
NUM_CPUS = 4  # logical CPUs of the local clusters, as mlplat.runtime.init_ray sizes them for 2 trainers + data
PACKING_TARGET, DATA_WAIT_TARGET = 0.95, 0.05

_SYLLABLES = "ka to ri mon el sa qu ve an dor li pe us ta ne ro mi ga ber xi lo fa zu en tor il ha so ce wy".split()  # noqa: SIM905


def write_chat_corpus(path: Path, rows: int, seed: int) -> int:
    """``rows`` multi-turn chats (JSONL) of made-up words; returns the file's size in bytes.

    Word frequencies are Zipf-like over a 3000-word vocabulary; a conversation's length is
    log-normal (median ~40 words, i.e. ~100 tokens with the tiny tokenizer; ~5% of rows
    longer than 256 tokens, truncated by the pipeline), spread over 1-4 user/assistant turns
    with a system prompt in 30% of rows: realistic variety, so packing has work to do.
    """
    rng = random.Random(seed)
    vocab_rng = random.Random(1234)  # every file shares one vocabulary (the tokenizer is trained on it)
    words = ["".join(vocab_rng.choice(_SYLLABLES) for _ in range(vocab_rng.choice((1, 1, 2, 2, 2, 3, 3, 4)))) for _ in range(3000)]
    cum = np.cumsum([1 / (i + 1) for i in range(len(words))]).tolist()

    def text(n: int) -> str:
        return " ".join(rng.choices(words, cum_weights=cum, k=n))

    with open(path, "w") as f:
        for _ in range(rows):
            total = min(int(rng.lognormvariate(math.log(40), 0.8)) + 3, 400)
            turns = rng.choice((1, 1, 1, 2, 2, 3, 4))
            messages = [{"role": "system", "content": text(rng.randint(3, 10))}] if rng.random() < 0.3 else []
            per_turn = max(2, total // (2 * turns))
            for _ in range(turns):
                messages.append({"role": "user", "content": text(max(1, int(per_turn * rng.uniform(0.3, 1.0)))) + "?"})
                messages.append({"role": "assistant", "content": text(max(1, int(per_turn * rng.uniform(0.6, 1.7)))) + "."})
            f.write(json.dumps({"messages": messages}) + "\n")
    return path.stat().st_size


def baseline(path: Path, tokenizer_path: str, max_seq_len: int) -> tuple[list[int], float]:
    """Single-process plain Python: token count of every row and the seconds it took."""
    start = time.perf_counter()
    tokenizer = load_chat_tokenizer(tokenizer_path)
    lengths = []
    with open(path) as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                ids, _labels = tokenize_chat(tokenizer, row["messages"], max_seq_len, tools=row.get("tools"))
                lengths.append(len(ids))
    return lengths, time.perf_counter() - start


def pipeline(path: Path, tokenizer_path: str, max_seq_len: int, concurrency: int, work: Path) -> dict:
    """The SFT pipeline with packing, iterated to the end on the driver (no trainer)."""
    start = time.perf_counter()
    cfg = SFTDataConfig(path=str(path), max_seq_len=max_seq_len, pack=True, tokenize_concurrency=concurrency)
    ds, report = prepare_sft_dataset(cfg, tokenizer_path, rejects_dir=work / "rejects")
    validated = time.perf_counter()
    tokens = slots = packed_rows = docs = 0
    for batch in ds.iter_batches(batch_size=None, batch_format="numpy"):
        seq_ids = batch["seq_ids"]
        tokens += int((seq_ids != PAD_SEQ_ID).sum())
        slots += seq_ids.size
        packed_rows += len(seq_ids)
        docs += int((seq_ids.max(axis=1) + 1).sum())  # documents are numbered 0..k-1 in each packed row
    end = time.perf_counter()
    return {
        "seconds": end - start,
        "validation_seconds": validated - start,
        "tokens": tokens,
        "slots": slots,
        "packed_rows": packed_rows,
        "docs": docs,
        "rows_read": report.rows_read,
        "bad_rows": report.bad_rows,
    }


def padding_efficiency(lengths: list[int], batch_size: int) -> float:
    """Real tokens / tokens after right-padding each batch (in corpus order) to its longest row."""
    padded = sum(len(lengths[i : i + batch_size]) * max(lengths[i : i + batch_size]) for i in range(0, len(lengths), batch_size))
    return sum(lengths) / padded


class Monitor(threading.Thread):
    """Samples Ray's object store (this cluster's raylet) and the driver's RSS every ``interval`` s.

    Object store: ``ray._private.internal_api.get_memory_info_reply``, the raylet RPC behind
    ``ray memory --stats-only``; its ``store_stats`` are the plasma store's own counters:
    ``object_store_bytes_used`` (bytes allocated in shared memory now, primary copies and
    cached secondary ones), ``object_store_bytes_fallback`` (objects that did not fit and
    went to disk-backed fallback allocation), ``spilled_bytes_total`` and
    ``cumulative_created_bytes`` (everything ever put in the store). Usage changes a block
    at a time (a few MB), so sampling at 10 Hz sees the peak to within a block or two;
    ``ray.available_resources()["object_store_memory"]`` is a scheduling resource (what tasks
    reserve), not what the store holds, so it is not used. Spilled bytes still on disk: the
    size of the cluster's spill directory (``spill_dir``), whose files Ray deletes once every
    object in them is freed. The GCS address is given explicitly: other
    Ray clusters may run on the same machine.
    """

    def __init__(self, spill_dir: Path | None = None, interval: float = 0.1):
        super().__init__(daemon=True)
        self.spill_dir, self.peak_spill_on_disk = spill_dir, 0
        from ray._private.internal_api import get_state_from_address

        self.state = get_state_from_address(ray.get_runtime_context().gcs_address)
        self.interval, self.stopped = interval, threading.Event()
        self.process = psutil.Process()
        self.peak_used = self.peak_fallback = self.samples = 0
        self.peak_rss = self.process.memory_info().rss
        self.last = self._stats()
        self.first = self.last

    def _stats(self):
        from ray._private.internal_api import get_memory_info_reply

        return get_memory_info_reply(self.state, timeout_seconds=10).store_stats

    def run(self) -> None:
        while not self.stopped.is_set():
            self.sample()
            self.stopped.wait(self.interval)

    def sample(self) -> None:
        stats = self._stats()
        self.last = stats
        self.samples += 1
        self.peak_used = max(self.peak_used, stats.object_store_bytes_used)
        self.peak_fallback = max(self.peak_fallback, stats.object_store_bytes_fallback)
        self.peak_rss = max(self.peak_rss, self.process.memory_info().rss)
        if self.spill_dir is not None:  # spilled objects still referenced: their files are deleted once freed
            self.peak_spill_on_disk = max(self.peak_spill_on_disk, _tree_bytes(self.spill_dir))

    def stop(self) -> None:
        self.stopped.set()
        self.join()
        self.sample()


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            try:
                total += os.stat(os.path.join(dirpath, name)).st_size
            except FileNotFoundError:  # deleted while we walk
                pass
    return total


def start_ray(object_store_memory: int | None = None, spill_dir: Path | None = None) -> None:
    system_config = {"object_spilling_directory": str(spill_dir)} if spill_dir else None
    ray.init(
        num_cpus=NUM_CPUS,
        object_store_memory=object_store_memory,
        include_dashboard=False,
        log_to_driver=False,
        _system_config=system_config,
    )


def bounded_run(corpus_dir: Path, tokenizer_path: str, max_seq_len: int, concurrency: int, limit: int, work: Path) -> dict:
    """The pipeline over ``corpus_dir`` on a fresh cluster whose object store holds ``limit`` bytes."""
    spill_dir = work / "spill"
    start_ray(object_store_memory=limit, spill_dir=spill_dir)
    try:
        rss_before = psutil.Process().memory_info().rss
        monitor = Monitor(spill_dir)
        monitor.start()
        try:
            result = pipeline(corpus_dir, tokenizer_path, max_seq_len, concurrency, work)
        finally:
            monitor.stop()
        capacity = monitor.last.object_store_bytes_avail  # the store's capacity as the raylet sees it
    finally:
        ray.shutdown()
    spilled = monitor.last.spilled_bytes_total - monitor.first.spilled_bytes_total
    return {
        **result,
        "object_store_capacity_bytes": capacity,
        "peak_object_store_bytes": monitor.peak_used,
        "peak_object_store_fallback_bytes": monitor.peak_fallback,
        "spilled_bytes": spilled,
        "restored_bytes": monitor.last.restored_bytes_total - monitor.first.restored_bytes_total,
        "peak_spilled_on_disk_bytes": monitor.peak_spill_on_disk,
        "object_store_cumulative_bytes": monitor.last.cumulative_created_bytes - monitor.first.cumulative_created_bytes,
        "object_store_samples": monitor.samples,
        "driver_rss_before_bytes": rss_before,
        "driver_peak_rss_bytes": monitor.peak_rss,
        # Bounded: never above the limit in shared memory, nothing pushed to disk instead.
        "object_store_bounded": monitor.peak_used <= limit and monitor.peak_fallback == 0 and spilled == 0,
    }


def sft_data_wait(corpus: Path, model_dir: Path, max_seq_len: int, steps: int, batch_size: int, work: Path, num_workers: int = 2) -> dict:
    """A short SFT run of the real recipe on the corpus; rank 0's data-wait share of step time."""
    try:
        from train_apps.sft import SFTConfig, SFTResult, run_sft
    except ImportError as err:  # the recipe is broken: say so, measure the rest
        print(f"data_wait_fraction: skipped (cannot import train_apps.sft: {err})")
        return {"data_wait_fraction": None, "data_wait_fraction_after_first_window": None, "data_wait_skipped": f"cannot import train_apps.sft: {err}"}
    if "data_wait_fraction" not in SFTResult.model_fields:
        print("data_wait_fraction: skipped (train_apps.sft.SFTResult has no data_wait_fraction field yet)")
        return {"data_wait_fraction": None, "data_wait_fraction_after_first_window": None, "data_wait_skipped": "SFTResult has no data_wait_fraction"}
    cfg = SFTConfig(
        model=str(model_dir),
        # The recipe's default tokenize_concurrency: tokenizer tasks on whatever CPUs the trainers leave free.
        data=SFTDataConfig(path=str(corpus), max_seq_len=max_seq_len, pack=True),
        max_steps=steps,
        batch_size_per_worker=batch_size,
        num_workers=num_workers,
        log_every=10,
        checkpoint_every=10 * steps,  # one checkpoint, at the end
        optim={"warmup_steps": max(1, steps // 10)},
        storage_path=str(work / "ray_train"),
        registered_model=None,
    )
    init_ray(num_training_workers=num_workers, include_dashboard=False, log_to_driver=False)  # the cluster run_sft starts for itself
    tracking_uri = f"sqlite:///{work / 'mlflow.db'}"
    try:
        start = time.perf_counter()
        result = run_sft(cfg, tracking_uri=tracking_uri, work_dir=work / "sft")
        seconds = time.perf_counter() - start
    finally:
        ray.shutdown()
    first_window, later = data_wait_after_first_window(tracking_uri, result.run_id)
    return {
        "data_wait_fraction": result.data_wait_fraction,
        # The same share without the first log window, whose first batch waits for the pipeline to start
        # (fresh task processes importing the tokenizer): what the trainer waits once data flows.
        "data_wait_fraction_after_first_window": later,
        "first_window_data_wait_s": first_window,
        "sft_steps": steps,
        "sft_batch_size_per_worker": cfg.batch_size_per_worker,
        "sft_tokenize_concurrency": cfg.data.tokenize_concurrency,
        "sft_seconds": seconds,
        "sft_first_loss": result.first_loss,
        "sft_final_loss": result.final_loss,
    }


def data_wait_after_first_window(tracking_uri: str, run_id: str) -> tuple[float, float | None]:
    """(seconds rank 0 waited for data in the first log window, data-wait share of step time in the later ones),
    from the running totals the recipe logs at every window (``run/data_wait_s``, ``run/step_s``)."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri)
    wait, step = ({m.step: m.value for m in client.get_metric_history(run_id, key)} for key in ("run/data_wait_s", "run/step_s"))
    first, last = min(wait), max(wait)
    if first == last:
        return wait[first], None
    return wait[first], (wait[last] - wait[first]) / (step[last] - step[first])


def main() -> None:
    parser = argparse.ArgumentParser(description="SFT data pipeline vs single-process tokenization")
    parser.add_argument("--quick", action="store_true", help="smaller corpora and SFT run (under 3 minutes)")
    parser.add_argument("--out", default="benchmarks/results/data_ingest.json")
    parser.add_argument("--concurrency", type=int, default=os.cpu_count() or 1, help="tokenizer tasks at once (default: CPU count)")
    args = parser.parse_args()
    logging.getLogger("ray").setLevel(logging.WARNING)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False
    ctx.print_on_execution_start = False

    rows = 15_000 if args.quick else 200_000
    # Quick: a quarter of the store's size (5x Ray's minimum store, ~400 MB, takes ~10 minutes to tokenize on 2 cores).
    over_limit = 0.25 if args.quick else 5.0
    steps, sft_batch = (20, 8) if args.quick else (50, 32)  # full: the recipe's default batch; quick: two log windows
    max_seq_len, pad_batch = 256, 32  # the tiny model's context; batch for padding-to-longest
    limit = OBJECT_STORE_MIN
    work = Path(tempfile.mkdtemp(prefix="data_ingest_bench_"))
    try:
        report = run(args, work, rows, over_limit, (steps, sft_batch), max_seq_len, pad_batch, limit)
    finally:
        if ray.is_initialized():
            ray.shutdown()
        shutil.rmtree(work, ignore_errors=True)

    table = [
        ("tokens/s (whole pipeline)", report["ours_tokens_per_s"], report["baseline_tokens_per_s"], report["throughput_ratio"]),
        (
            "non-pad share: packed | padded/batch",
            report["packing_efficiency"],
            report["padding_efficiency"],
            report["packing_efficiency"] / report["padding_efficiency"],
        ),
        ("rows per epoch: packed | padded", report["packed_rows"], report["rows"], report["rows"] / report["packed_rows"]),
    ]
    print(f"\n{'measure':40} {'ours':>12} {'baseline':>12} {'ratio':>8}")
    for name, ours, base, ratio in table:
        print(f"{name:40} {ours:12.3f} {base:12.3f} {ratio:8.2f}" if ours < 10 else f"{name:40} {ours:12.0f} {base:12.0f} {ratio:8.2f}")
    mib = 2**20
    print(
        f"\nobject store limit {limit / mib:.0f} MiB, corpus {report['corpus_bytes'] / mib:.0f} MiB "
        f"({report['corpus_over_limit_ratio']:.1f}x, {report['object_store_rows']} rows): "
        f"peak {report['peak_object_store_bytes'] / mib:.1f} MiB, spilled {report['spilled_bytes'] / mib:.1f} MiB "
        f"(peak on disk {report['peak_spilled_on_disk_bytes'] / mib:.1f} MiB), "
        f"{report['object_store_cumulative_bytes'] / mib:.0f} MiB through the store, bounded: {report['object_store_bounded']}; "
        f"driver RSS peak {report['driver_peak_rss_bytes'] / mib:.0f} MiB (before {report['driver_rss_before_bytes'] / mib:.0f} MiB)"
    )
    wait, later = report["data_wait_fraction"], report.get("data_wait_fraction_after_first_window")
    print(f"data wait: {'skipped' if wait is None else f'{100 * wait:.1f}% of step time'} (target < {100 * DATA_WAIT_TARGET:.0f}%)", end="")
    if later is not None:
        print(f"; {100 * later:.1f}% after the first log window (it waited {report['first_window_data_wait_s']:.1f} s for the first batches)", end="")
    print()
    keys = (
        "throughput_ratio",
        "packing_efficiency",
        "padding_efficiency",
        "peak_object_store_bytes",
        "object_store_bounded",
        "corpus_over_limit_ratio",
        "data_wait_fraction",
        "data_wait_fraction_after_first_window",
    )
    print(json.dumps({k: report[k] for k in keys}, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))
    print(f"wrote {args.out}")


def run(args, work: Path, rows: int, over_limit: float, sft: tuple[int, int], max_seq_len: int, pad_batch: int, limit: int) -> dict:
    started = time.perf_counter()
    corpus_dir = work / "corpus"
    corpus_dir.mkdir()
    corpus = corpus_dir / "part-000.jsonl"
    corpus_bytes = write_chat_corpus(corpus, rows, seed=0)
    model_dir = build_tiny_model(work / "model", tokenizer_corpus(corpus))
    report: dict = {
        "quick": args.quick,
        "rows": rows,
        "max_seq_len": max_seq_len,
        "tokenize_concurrency": args.concurrency,
        "ray_num_cpus": NUM_CPUS,
        "machine_cpus": os.cpu_count(),
        "throughput_corpus_bytes": corpus_bytes,
    }

    # 1. Throughput: the baseline, then ours on a default-sized local cluster.
    lengths, base_seconds = baseline(corpus, str(model_dir), max_seq_len)
    start_ray()
    try:
        ours = pipeline(corpus, str(model_dir), max_seq_len, args.concurrency, work)
    finally:
        ray.shutdown()
    base_tokens = sum(lengths)
    report.update(
        tokens=base_tokens,
        baseline_seconds=base_seconds,
        baseline_tokens_per_s=base_tokens / base_seconds,
        ours_seconds=ours["seconds"],
        ours_validation_seconds=ours["validation_seconds"],
        ours_tokens_per_s=ours["tokens"] / ours["seconds"],
        tokens_match=ours["tokens"] == base_tokens and ours["docs"] == len(lengths),
        packed_rows=ours["packed_rows"],
        mean_tokens_per_row=base_tokens / len(lengths),
        truncated_row_fraction=sum(n >= max_seq_len for n in lengths) / len(lengths),
        pad_batch_size=pad_batch,
    )
    report["throughput_ratio"] = report["ours_tokens_per_s"] / report["baseline_tokens_per_s"]
    # 2. Packing against padding to the longest row of each batch.
    report["packing_efficiency"] = ours["tokens"] / ours["slots"]
    report["padding_efficiency"] = padding_efficiency(lengths, pad_batch)
    report["packing_target_met"] = report["packing_efficiency"] >= PACKING_TARGET
    print(f"[{time.perf_counter() - started:.0f}s] throughput and packing done", flush=True)

    # 3. Data wait of a short SFT run (default-sized cluster, as the recipe gets it).
    report.update(sft_data_wait(corpus, model_dir, max_seq_len, *sft, work))
    wait = report["data_wait_fraction"]
    report["data_wait_target_met"] = None if wait is None else wait < DATA_WAIT_TARGET
    print(f"[{time.perf_counter() - started:.0f}s] SFT run done", flush=True)

    # 4. Bounded object store: more of the same corpus, several times the store's limit.
    total_bytes, part = corpus_bytes, 1
    while total_bytes < over_limit * limit:
        more = max(1000, math.ceil((over_limit * limit - total_bytes) / (corpus_bytes / rows)))
        total_bytes += write_chat_corpus(corpus_dir / f"part-{part:03d}.jsonl", min(rows, more), seed=part)
        part += 1
    big = bounded_run(corpus_dir, str(model_dir), max_seq_len, args.concurrency, limit, work)
    report.update(
        object_store_limit_bytes=limit,
        corpus_bytes=total_bytes,
        corpus_files=part,
        corpus_over_limit_ratio=total_bytes / limit,
        stream_over_limit_ratio=big["object_store_cumulative_bytes"] / limit,  # bytes put through the store / its size
        object_store_rows=big["rows_read"],
        object_store_tokens_per_s=big["tokens"] / big["seconds"],
        object_store_seconds=big["seconds"],
        **{
            k: big[k]
            for k in (
                "peak_object_store_bytes",
                "peak_object_store_fallback_bytes",
                "spilled_bytes",
                "restored_bytes",
                "peak_spilled_on_disk_bytes",
                "object_store_bounded",
                "object_store_capacity_bytes",
                "object_store_cumulative_bytes",
                "object_store_samples",
                "driver_rss_before_bytes",
                "driver_peak_rss_bytes",
            )
        },
    )
    report["driver_lifetime_peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # whole run (Linux: KiB)
    report["seconds_total"] = time.perf_counter() - started
    print(f"[{report['seconds_total']:.0f}s] bounded object store run done", flush=True)
    return report


if __name__ == "__main__":
    main()
