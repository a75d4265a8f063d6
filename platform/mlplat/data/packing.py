"""Sequence packing for SFT: many short examples per fixed-length row, no cross-talk.

Examples are packed into ``max_len`` blocks with first-fit-decreasing inside a window
of rows (streaming: one window at a time, so a window's last blocks may be part-full).
Each block carries ``seq_ids`` (document index per token, -1 on padding) and
``position_ids`` restarting at 0 per document; ``mlplat.train.batch.model_inputs`` turns these into
a block-diagonal causal mask so no token attends to another document, and the label of
every document's first token is IGNORE_INDEX so it is never predicted from the previous
document. A packed row thus gives exactly the per-document losses of the unpacked rows.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import ray.data

from mlplat.data.labels import IGNORE_INDEX, PAD_SEQ_ID


def first_fit_decreasing(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """Group item indices into bins of total length <= capacity (longest first, first bin with room).

    Items longer than ``capacity`` count as ``capacity`` (the caller truncates them).
    Indices inside each bin are in ascending (input) order.
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])  # stable: ties keep input order
    free = np.full(len(lengths), capacity)  # never more bins than items; unopened bins are all free
    bins: list[list[int]] = []
    for i in order:
        n = min(lengths[i], capacity)
        b = int(np.argmax(free >= n))  # first opened bin with room, else the next unopened one
        if b == len(bins):
            bins.append([])
        bins[b].append(i)
        free[b] -= n
    return [sorted(b) for b in bins]


def pack_examples(
    examples: Sequence[tuple[Sequence[int], Sequence[int]]], max_len: int, pad_token_id: int
) -> dict[str, np.ndarray]:
    """Pack ``(input_ids, labels)`` pairs into ``[n_blocks, max_len]`` int64 arrays.

    Returns ``input_ids`` (``pad_token_id`` on padding), ``labels`` (IGNORE_INDEX on padding
    and on each document's first token), ``position_ids`` (0.. per document; padding counts
    0.. as well) and ``seq_ids`` (0..k-1 per document in a block, -1 on padding).
    Examples longer than ``max_len`` are truncated to their first ``max_len`` tokens;
    empty examples are dropped.
    """
    docs = []
    for ids, labels in examples:
        if len(ids) != len(labels):
            raise ValueError(f"input_ids and labels differ in length ({len(ids)} != {len(labels)})")
        if len(ids):
            docs.append((np.asarray(ids, dtype=np.int64)[:max_len], np.asarray(labels, dtype=np.int64)[:max_len]))
    bins = first_fit_decreasing([len(ids) for ids, _ in docs], max_len)
    shape = (len(bins), max_len)
    out = {
        "input_ids": np.full(shape, pad_token_id, dtype=np.int64),
        "labels": np.full(shape, IGNORE_INDEX, dtype=np.int64),
        "position_ids": np.zeros(shape, dtype=np.int64),
        "seq_ids": np.full(shape, PAD_SEQ_ID, dtype=np.int64),
    }
    for row, members in enumerate(bins):
        start = 0
        for doc, i in enumerate(members):
            ids, labels = docs[i]
            end = start + len(ids)
            out["input_ids"][row, start:end] = ids
            out["labels"][row, start:end] = labels
            # The loss predicts labels[t] from position t-1: at a document's first
            # token that is the previous document's last token, so it must carry no loss.
            # (Alone, a document's first label is never predicted either: same loss.)
            out["labels"][row, start] = IGNORE_INDEX
            out["position_ids"][row, start:end] = np.arange(len(ids))
            out["seq_ids"][row, start:end] = doc
            start = end
        out["position_ids"][row, start:] = np.arange(max_len - start)
    return out


def _pack_batch(batch: dict[str, np.ndarray], max_len: int, pad_token_id: int) -> dict[str, np.ndarray]:
    return pack_examples(list(zip(batch["input_ids"], batch["labels"])), max_len, pad_token_id)


def pack_dataset(
    ds: ray.data.Dataset, max_len: int, pad_token_id: int, window_rows: int = 1024, concurrency: int | None = None
) -> ray.data.Dataset:
    """Pack a dataset of variable-length ``input_ids``/``labels`` rows into fixed ``max_len`` rows.

    Each window of ``window_rows`` input rows is packed on its own (larger windows pack
    tighter, smaller ones stream with less memory). Output columns are those of
    ``pack_examples``; other input columns are dropped (a packed row has no single source row).
    ``concurrency``: give the upstream tokenizer's (``tokenize_rows``), so Ray fuses packing
    into its tasks and the unpacked rows never go through the object store.
    """
    return ds.map_batches(
        _pack_batch,
        fn_kwargs={"max_len": max_len, "pad_token_id": pad_token_id},
        batch_size=window_rows,
        batch_format="numpy",
        compute=ray.data.TaskPoolStrategy(size=concurrency),
    )


def packing_efficiency(seq_ids) -> float:
    """Share of non-padding tokens in packed rows (an array or tensor of seq_ids): non-pad tokens / total tokens."""
    seq_ids = np.asarray(seq_ids)
    return float((seq_ids != PAD_SEQ_ID).sum() / max(seq_ids.size, 1))
