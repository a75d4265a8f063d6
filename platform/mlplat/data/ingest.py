"""Validated, mixed rows from one or more sources: the Ray Data machinery every task shares.

``prepare_rows(cfg, task, rejects_dir)`` runs one streaming validation pass over every
source that keeps only the (rare) bad rows plus per-source counts. Bad rows are
skipped, counted and written with their file, row and reason to a rejects file, never
silently; with ``on_bad_row="fail"`` the first one stops the job before training.
It returns a DataReport and the lazy dataset of good rows ``{"text", "path", "row",
"source"}`` (``text``: the row as JSON, see ``mlplat.data.sources``) that the task's
tokenizer consumes; validation runs again inside that stream (cheap next to
tokenizing, and it keeps the pass above free of anything but the bad rows).

**Mixing.** With several sources, ``weight`` is each source's share of the rows in
the mixture: source *i* contributes ``w_i / sum(w)`` of them. The mixture is the
largest one that needs no row twice: the source that runs out first relative to its
weight is used in full, every other source is subsampled uniformly (each valid row
kept independently with probability ``fraction_i``, decided by a hash of the seed,
the source index and the row's text, so a seed always picks the same rows, whatever
Ray's block layout or worker timing). The counts from the validation pass give the
fractions, so mixing costs no extra pass. Realised shares are the weights up to
Bernoulli noise (about ``sqrt(n)`` rows). Without weights every valid row of every
source is used. In both cases the sources are interleaved in the stream (Ray Data's
``mix``: blocks of ``mix_block_rows`` rows, always from the source furthest behind
its share), so any stretch of the stream, not just the whole of it, holds the mixture.
Which rows are used is fixed by the seed; their order follows Ray's streaming.
"""

from __future__ import annotations

import functools
import hashlib
from collections import Counter
from pathlib import Path
from typing import Literal

import numpy as np
import pyarrow as pa
import ray.data
from pydantic import BaseModel, Field, model_validator
from ray.data.expressions import col

from mlplat.config import Config
from mlplat.data.schemas import Task, reason_category, row_error
from mlplat.data.sources import Listing, SourceConfig, list_files, read_source
from mlplat.errors import DataError


class DataConfig(Config):
    """Where rows come from and what happens to bad ones; the part of every task's data config they share."""

    path: str | None = None  # shorthand for sources: [{path: ...}]
    sources: list[SourceConfig] = Field(default_factory=list)  # several sources, optionally weighted (see mlplat.data.ingest)
    seed: int = 0  # picks the rows of subsampled sources in a weighted mixture
    on_bad_row: Literal["skip", "fail"] = "skip"
    mix_block_rows: int = Field(default=64, gt=0)  # sources alternate in blocks of this many rows

    @model_validator(mode="after")
    def _one_way_to_name_sources(self):
        if (self.path is None) == (not self.sources):
            raise ValueError("give either data.path (one source) or data.sources (a list of {path, weight}), not both")
        weighted = [s.weight is not None for s in self.sources]
        if any(weighted) and not all(weighted):
            raise ValueError("data.sources: give every source a weight, or none (then all rows of every source are used)")
        return self

    def source_list(self) -> list[SourceConfig]:
        return self.sources or [SourceConfig(path=self.path)]


class SourceReport(BaseModel):
    path: str
    files: int
    rows_read: int
    bad_rows: int
    share: float  # target share of the mixture's rows (its normalised weight; row counts without weights)
    fraction: float  # share of this source's valid rows used (1.0: all of them)
    rows_used: int  # expected rows in the mixture: exact when fraction is 1, else +- sampling noise


class DataReport(BaseModel):
    """What the validation pass found, known before training starts.

    Everything here comes from the one validation pass (no tokenizer involved):
    ``rows_read``, ``bad_rows`` (and ``bad_rows_by_reason``: reason with row details
    stripped -> count), per-source counts and mixture shares, ``rows_used``. Token
    counts, truncated rows and packing efficiency exist only once rows are tokenized,
    i.e. while the trainer streams them (``mlplat.train.batch`` / ``packing_efficiency``
    on its batches); nothing here tokenizes, so no second tokenization pass is needed.
    """

    bad_rows: int
    rejects_path: str | None
    first_error: str | None
    rows_read: int = 0
    rows_used: int = 0  # expected rows in the (mixed) dataset, before tokenization and packing
    bad_rows_by_reason: dict[str, int] = Field(default_factory=dict)
    sources: list[SourceReport] = Field(default_factory=list)
    fingerprint: str = ""  # of the data config and every file's path, size and mtime: same value, same data


def fingerprint(cfg: DataConfig, listings: list[Listing]) -> str:
    """A short hash naming the dataset a run trained on, cheap to compute (file metadata, not contents)."""
    digest = hashlib.sha256(cfg.model_dump_json().encode())
    for listing in listings:
        for info in listing.fs.get_file_info([path for path, _ in listing.files]):
            digest.update(f"{listing.prefix}{info.path}\0{info.size}\0{info.mtime_ns}\n".encode())
    return digest.hexdigest()[:16]


def _errors(batch: pa.Table, task: Task) -> np.ndarray:
    return np.array([row_error(task, t) for t in batch.column("text").to_pylist()], dtype=object)


def _summarise(batch: pa.Table, task: Task) -> pa.Table:
    """Bad rows in full (``rows`` = 1), good rows as one count row per source (``text`` = '')."""
    errors = _errors(batch, task)
    bad = errors != ""
    out = batch.filter(pa.array(bad)).append_column("error", pa.array(errors[bad].tolist(), pa.string()))
    out = out.append_column("reason", pa.array([reason_category(e) for e in errors[bad]], pa.string()))
    out = out.append_column("rows", pa.array(np.ones(int(bad.sum()), dtype=np.int64)))
    sources = batch.column("source").to_numpy()
    good_sources, good_counts = np.unique(sources[~bad], return_counts=True)
    counts = pa.table(
        {
            "text": pa.array([""] * len(good_sources), pa.string()),
            "path": pa.array([""] * len(good_sources), pa.string()),
            "row": pa.array(np.zeros(len(good_sources), dtype=np.int64)),
            "source": pa.array(good_sources, pa.int64()),
            "error": pa.array([""] * len(good_sources), pa.string()),
            "reason": pa.array([""] * len(good_sources), pa.string()),
            "rows": pa.array(good_counts.astype(np.int64)),
        }
    )
    return pa.concat_tables([out.select(counts.column_names), counts])


def keep_fraction(texts: list[str], fraction: float, seed: int, source: int) -> np.ndarray:
    """Bernoulli(fraction) per row, decided by a hash of (seed, source, text): the same rows every run."""
    if fraction >= 1.0:
        return np.ones(len(texts), dtype=bool)
    key = f"{seed}:{source}".encode()
    draws = [int.from_bytes(hashlib.blake2b(t.encode(), digest_size=8, key=key).digest(), "little") for t in texts]
    return np.asarray(draws, dtype=np.uint64) < np.uint64(int(fraction * 2**64) if fraction > 0 else 0)


def _keep_valid(batch: pa.Table, task: Task, fraction: float, seed: int, source: int) -> pa.Table:
    keep = _errors(batch, task) == ""
    keep &= keep_fraction(batch.column("text").to_pylist(), fraction, seed, source)
    return batch.filter(pa.array(keep))


def _plan(cfg: DataConfig, valid: list[int]) -> tuple[list[float], list[float]]:
    """(share, fraction) per source: see the module docstring."""
    sources = cfg.source_list()
    if sources[0].weight is None:
        total = sum(valid)
        return [v / total if total else 0.0 for v in valid], [1.0] * len(valid)
    weights = [s.weight / sum(s.weight for s in sources) for s in sources]
    for s, v in zip(sources, valid):
        if v == 0:
            raise DataError(f"{s.path}: no valid rows in this weighted source (see the rejects file for why)")
    mixture = min(v / w for v, w in zip(valid, weights))  # rows in the largest mixture without repeats
    return weights, [min(1.0, w * mixture / v) for w, v in zip(weights, valid)]


def check_sources(cfg: DataConfig) -> list[Listing]:
    """Every source's files, found and of a known format: a DataError naming the path otherwise (no Ray needed)."""
    return [list_files(s) for s in cfg.source_list()]


def prepare_rows(cfg: DataConfig, task: Task, rejects_dir: str | Path) -> tuple[ray.data.Dataset, DataReport]:
    """Validate every source of ``cfg`` as ``task`` rows (one pass) and return the lazy mixed good rows."""
    sources = cfg.source_list()
    listings = check_sources(cfg)  # every path and extension checked before any Ray work
    reads = [read_source(s, i, listing) for i, (s, listing) in enumerate(zip(sources, listings))]
    everything = reads[0].union(*reads[1:]) if len(reads) > 1 else reads[0]
    summary = everything.map_batches(_summarise, fn_kwargs={"task": task}, batch_format="pyarrow").materialize()

    rows_read, bad, by_reason = Counter(), Counter(), Counter()
    for batch in summary.iter_batches(batch_format="pyarrow", batch_size=None):
        for source, reason, rows in zip(*(batch.column(c).to_pylist() for c in ("source", "reason", "rows"))):
            rows_read[source] += rows
            if reason:
                bad[source] += rows
                by_reason[reason] += rows
    report = DataReport(
        bad_rows=sum(bad.values()),
        rejects_path=None,
        first_error=None,
        rows_read=sum(rows_read.values()),
        bad_rows_by_reason=dict(by_reason.most_common()),
        fingerprint=fingerprint(cfg, listings),
    )
    if report.bad_rows:
        rejected = summary.filter(expr=col("error") != "").select_columns(["text", "path", "row", "error"])
        first = rejected.take(1)[0]
        report.first_error = f"{first['path']}: row {first['row']}: {first['error']}: {first['text'][:120]!r}"
        if cfg.on_bad_row == "fail":
            raise DataError(f"{report.first_error} ({report.bad_rows} bad rows; set data.on_bad_row=skip to skip them)")
        rejects = Path(rejects_dir) / "rejects"
        # One file, replaced on a rerun into the same directory (appending would double-count).
        rejected.repartition(1).write_json(str(rejects), mode=ray.data.SaveMode.OVERWRITE)
        report.rejects_path = str(rejects)

    valid = [rows_read[i] - bad[i] for i in range(len(sources))]
    shares, fractions = _plan(cfg, valid)
    report.sources = [
        SourceReport(
            path=s.path,
            files=len(listing.files),
            rows_read=rows_read[i],
            bad_rows=bad[i],
            share=shares[i],
            fraction=fractions[i],
            rows_used=round(valid[i] * fractions[i]),
        )
        for i, (s, listing) in enumerate(zip(sources, listings))
    ]
    report.rows_used = sum(s.rows_used for s in report.sources)
    if report.rows_used == 0:
        where = sources[0].path if len(sources) == 1 else "data.sources"
        raise DataError(f"{where}: no valid rows to train on ({report.rows_read} read, {report.bad_rows} bad; first: {report.first_error})")

    streams = [
        ds.map_batches(_keep_valid, fn_kwargs={"task": task, "fraction": f, "seed": cfg.seed, "source": i}, batch_format="pyarrow")
        for i, (ds, f) in enumerate(zip(reads, fractions))
    ]
    if len(streams) == 1:
        return streams[0], report
    used = [(ds.repartition(target_num_rows_per_block=cfg.mix_block_rows, strict=True), share) for ds, share in zip(streams, shares) if share > 0]
    if len(used) == 1:
        return used[0][0], report
    mixed = used[0][0].mix(
        *(ds for ds, _ in used[1:]),
        weights=[share for _, share in used],
        # Every sampled row is used: sampling already made the shares, so a source that
        # ends a little early (sampling noise) must not cut the others off.
        stopping_condition=ray.data.MixStoppingCondition.STOP_ON_LONGEST_DROP,
    )
    return mixed, report


@functools.cache
def _cached_tokenizer(tokenizer_udf: type, tokenizer_path: str, max_seq_len: int, chat_template: str | None):
    return tokenizer_udf(tokenizer_path, max_seq_len, chat_template)


def _tokenize(batch: dict, tokenizer_udf: type, tokenizer_path: str, max_seq_len: int, chat_template: str | None) -> dict:
    return _cached_tokenizer(tokenizer_udf, tokenizer_path, max_seq_len, chat_template)(batch)


def tokenize_rows(rows: ray.data.Dataset, tokenizer_udf: type, tokenizer_path: str, max_seq_len: int,
                  chat_template: str | None, concurrency: int | None) -> ray.data.Dataset:
    """Run a task's tokenizer UDF over validated rows as Ray tasks, at most ``concurrency`` at once
    (None: as many as the cluster has free CPUs).

    Tasks, not an actor pool: they run in Ray's pooled worker processes, which keep the
    tokenizer (cached per process) and its imports from one pipeline to the next, where
    every actor pool starts fresh processes (seconds of imports before the first batch).
    """
    return rows.map_batches(
        _tokenize,
        fn_kwargs={"tokenizer_udf": tokenizer_udf, "tokenizer_path": tokenizer_path, "max_seq_len": max_seq_len, "chat_template": chat_template},
        batch_format="numpy",
        compute=ray.data.TaskPoolStrategy(size=concurrency),
    )
