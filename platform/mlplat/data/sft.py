"""Chat SFT ingestion with Ray Data: read JSONL -> validate -> chat template -> tokenize.

Bad rows are skipped and counted, never silently: each is written with its file and
reason to a rejects file, and the run summary reports the count. With
``on_bad_row="fail"`` the first bad row stops the job instead, naming file and reason.
Validation is one streaming pass that keeps only the (rare) bad rows; tokenization
is a second, lazy pass that the trainer drives through ``get_dataset_shard``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Literal

import numpy as np
import ray
import ray.data
import torch
from pydantic import BaseModel
from ray.data.collate_fn import NumpyBatchCollateFn
from ray.data.expressions import col

from mlplat.config import Config
from mlplat.data.chat import chat_row_error, check_chat_template, tokenize_chat
from mlplat.data.packing import pack_dataset
from mlplat.errors import DataError
from mlplat.train.batch import pad_collate


class SFTDataConfig(Config):
    path: str  # a JSONL file, a directory of them, or a glob; local or any pyarrow filesystem URI
    max_seq_len: int = 128
    on_bad_row: Literal["skip", "fail"] = "skip"
    tokenize_concurrency: int = 1
    pack: bool = False  # pack examples into max_seq_len rows (no cross-document attention or loss)
    pack_window_rows: int = 1024  # examples packed together (first-fit-decreasing) per window


class DataReport(BaseModel):
    bad_rows: int
    rejects_path: str | None
    first_error: str | None


def validate_chat_batch(batch: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    batch["error"] = np.array([chat_row_error(line) for line in batch["text"]], dtype=object)
    return batch


class ChatTokenizer:
    """Ray Data map_batches UDF: loads the tokenizer once per actor."""

    def __init__(self, tokenizer_path: str, max_seq_len: int):
        from mlplat.models import load_tokenizer

        self.tokenizer = load_tokenizer(tokenizer_path)
        self.max_seq_len = max_seq_len

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        input_ids, labels = [], []
        for line in batch["text"]:
            ids, lab = tokenize_chat(self.tokenizer, json.loads(line)["messages"], self.max_seq_len)
            input_ids.append(np.asarray(ids, dtype=np.int64))
            labels.append(np.asarray(lab, dtype=np.int64))
        return {"input_ids": input_ids, "labels": labels}


class PadCollate(NumpyBatchCollateFn):
    """``iter_torch_batches`` collate function: right-pad the tokenized rows into tensors."""

    def __init__(self, pad_token_id: int):
        self.pad_token_id = pad_token_id

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
        return pad_collate(batch, self.pad_token_id)


def read_jsonl_lines(path: str) -> ray.data.Dataset:
    """Rows of ``{"text": line, "path": file}``; raises DataError if nothing is there."""
    local = Path(path.removeprefix("file://"))
    if "://" not in path or path.startswith("file://"):
        if not any(ch in path for ch in "*?[") and not local.exists():
            raise DataError(f"{path}: data path not found")
    try:
        return ray.data.read_text(path, include_paths=True, drop_empty_lines=True)
    except (FileNotFoundError, ValueError) as err:
        raise DataError(f"{path}: cannot read data ({err})") from None


def prepare_sft_dataset(cfg: SFTDataConfig, tokenizer_path: str, rejects_dir: str | Path) -> tuple[ray.data.Dataset, DataReport]:
    """Validate ``cfg.path`` (one pass, keeping only bad rows) and return the lazy tokenized dataset."""
    from mlplat.models import load_tokenizer

    tokenizer = load_tokenizer(tokenizer_path)
    check_chat_template(tokenizer, tokenizer_path)
    validated = read_jsonl_lines(cfg.path).map_batches(validate_chat_batch, batch_format="numpy")
    bad = validated.filter(expr=col("error") != "").materialize()
    bad_rows = bad.count()
    report = DataReport(bad_rows=bad_rows, rejects_path=None, first_error=None)
    if bad_rows:
        first = bad.take(1)[0]
        report.first_error = f"{first['path']}: {first['error']}: {first['text'][:120]!r}"
        if cfg.on_bad_row == "fail":
            raise DataError(f"{report.first_error} ({bad_rows} bad rows; set data.on_bad_row=skip to skip them)")
        rejects = Path(rejects_dir) / "rejects"
        bad.repartition(1).write_json(str(rejects))
        report.rejects_path = str(rejects)
    good = validated.filter(expr=col("error") == "")
    tokenized = good.map_batches(
        ChatTokenizer,
        fn_constructor_kwargs={"tokenizer_path": tokenizer_path, "max_seq_len": cfg.max_seq_len},
        batch_format="numpy",
        compute=ray.data.ActorPoolStrategy(size=cfg.tokenize_concurrency),
    )
    if cfg.pack:
        tokenized = pack_dataset(tokenized, cfg.max_seq_len, tokenizer.pad_token_id, cfg.pack_window_rows)
    return tokenized, report
