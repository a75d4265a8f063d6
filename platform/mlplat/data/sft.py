"""Chat SFT ingestion with Ray Data: read sources -> validate -> mix -> chat template -> tokenize.

Validation, rejects and mixing are ``mlplat.data.ingest`` (shared by every task): one
streaming pass that keeps only the (rare) bad rows and per-source counts, then the
lazy good rows. Tokenization is a second, lazy pass that the trainer drives through
``get_dataset_shard``; labels only on assistant tokens (of the ``completion`` only, for
prompt-completion rows), as the chat template renders them (the checkpoint's template, or
``chat_template`` instead; see ``mlplat.data.chat``).
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import ray
import ray.data
from pydantic import Field

from mlplat.data.chat import load_chat_tokenizer, resolve_chat_template, tokenize_chat
from mlplat.data.ingest import (
    DataConfig,
    DataReport,
    SourceReport,
    prepare_rows,
    tokenize_rows,
)
from mlplat.data.packing import pack_dataset
from mlplat.data.preference import tokenize_response
from mlplat.data.schemas import as_messages

__all__ = ["ChatTokenizer", "DataReport", "SFTDataConfig", "SourceReport", "prepare_sft_dataset", "tokenize_sft_row"]


class SFTDataConfig(DataConfig):
    # path / sources: JSONL or Parquet files, directories or globs; local or any pyarrow filesystem URI
    max_seq_len: int = 128
    tokenize_concurrency: int | None = Field(default=None, gt=0)  # tokenizer tasks at once; None: as many as the cluster has free CPUs
    pack: bool = False  # pack examples into max_seq_len rows (no cross-document attention or loss)
    pack_window_rows: int = 1024  # examples packed together (first-fit-decreasing) per window
    chat_template: str | None = None  # Jinja string, .jinja file or shipped name (qwen2.5, llama3) used instead of the checkpoint's


def tokenize_sft_row(tokenizer, row: dict, max_seq_len: int) -> tuple[list[int], list[int]]:
    """Token ids and labels of one valid chat row: ``messages`` (loss on every assistant turn), or
    ``prompt`` + ``completion`` (loss on the completion's assistant turns only)."""
    if "messages" in row:
        return tokenize_chat(tokenizer, row["messages"], max_seq_len, tools=row.get("tools"))
    prompt, completion = as_messages(row["prompt"], "user"), as_messages(row["completion"], "assistant")
    return tokenize_response(tokenizer, prompt, completion, max_seq_len, tools=row.get("tools"))


class ChatTokenizer:
    """Ray Data map_batches UDF: loads the tokenizer (and template override) once per worker process (mlplat.data.ingest.tokenize_rows)."""

    def __init__(self, tokenizer_path: str, max_seq_len: int, chat_template: str | None = None):
        self.tokenizer = load_chat_tokenizer(tokenizer_path, chat_template)
        self.max_seq_len = max_seq_len

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        input_ids, labels = [], []
        for line in batch["text"]:
            ids, lab = tokenize_sft_row(self.tokenizer, json.loads(line), self.max_seq_len)
            input_ids.append(np.asarray(ids, dtype=np.int64))
            labels.append(np.asarray(lab, dtype=np.int64))
        return {"input_ids": input_ids, "labels": labels}


def prepare_sft_dataset(cfg: SFTDataConfig, tokenizer_path: str, rejects_dir: str | Path) -> tuple[ray.data.Dataset, DataReport]:
    """Validate the sources of ``cfg`` (one pass, keeping only bad rows) and return the lazy tokenized dataset."""
    template = resolve_chat_template(cfg.chat_template) if cfg.chat_template is not None else None
    tokenizer = load_chat_tokenizer(tokenizer_path, template)  # a template that cannot mark assistant tokens fails here
    rows, report = prepare_rows(cfg, "chat", rejects_dir)
    tokenized = tokenize_rows(rows, ChatTokenizer, tokenizer_path, cfg.max_seq_len, template, cfg.tokenize_concurrency)
    if cfg.pack:
        tokenized = pack_dataset(tokenized, cfg.max_seq_len, tokenizer.pad_token_id, cfg.pack_window_rows, cfg.tokenize_concurrency)
    return tokenized, report
