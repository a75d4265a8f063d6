"""Preference pairs (reward model, DPO): validated rows -> chosen/rejected token ids with response-only labels.

A row is ``{"prompt", "chosen", "rejected"}``, each a string (prompt: one user turn;
chosen/rejected: one assistant turn) or a list of messages (see ``mlplat.data.schemas``).
Each side is rendered as prompt + response with the checkpoint's chat template (or
``chat_template``); labels are IGNORE_INDEX except on the response's assistant tokens,
as the template's ``{% generation %}`` blocks mark them. Assistant turns inside the
prompt (multi-turn prompts) carry no labels.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

import numpy as np
import ray
import ray.data
from pydantic import Field

from mlplat.data.chat import assistant_mask, load_chat_tokenizer, resolve_chat_template
from mlplat.data.ingest import DataConfig, DataReport, prepare_rows, tokenize_rows
from mlplat.data.labels import IGNORE_INDEX
from mlplat.data.schemas import as_messages
from mlplat.errors import DataError

SIDES = ("chosen", "rejected")
logger = logging.getLogger(__name__)


class PreferenceDataConfig(DataConfig):
    max_seq_len: int = 256  # per side: prompt + response, truncated on the right
    tokenize_concurrency: int | None = Field(default=None, gt=0)  # tokenizer tasks at once; None: as many as the cluster has free CPUs
    chat_template: str | None = None  # Jinja string or .jinja file used instead of the checkpoint's


def preference_conversations(row: dict) -> tuple[list[dict], list[dict], list[dict]]:
    """(prompt, chosen, rejected) as message lists: strings become one user / assistant turn."""
    return as_messages(row["prompt"], "user"), as_messages(row["chosen"], "assistant"), as_messages(row["rejected"], "assistant")


def _spans(mask: list[int]) -> list[tuple[int, int]]:
    """[start, end) of each run of 1s."""
    spans, start = [], None
    for i, m in enumerate([*mask, 0]):
        if m and start is None:
            start = i
        elif not m and start is not None:
            spans.append((start, i))
            start = None
    return spans


def tokenize_response(
    tokenizer, prompt: list[dict], response: list[dict], max_seq_len: int, tools: list[dict] | None = None
) -> tuple[list[int], list[int]]:
    """Token ids of prompt + response and labels on the response's assistant tokens only.

    Truncated to ``max_seq_len`` on the right; a response cut off entirely keeps no
    labels, which a recipe should check (``any(l != IGNORE_INDEX)``) before scoring it.
    """
    ids, mask = assistant_mask(tokenizer, prompt + response, tools)
    in_prompt = sum(m["role"] == "assistant" for m in prompt)
    if in_prompt:
        spans = _spans(mask)
        expected = in_prompt + sum(m["role"] == "assistant" for m in response)
        if len(spans) != expected:
            raise DataError(
                f"the chat template marks {len(spans)} assistant spans for {expected} assistant messages: "
                "cannot tell the prompt's assistant turns from the response's"
            )
        for start, end in spans[:in_prompt]:
            mask[start:end] = [0] * (end - start)
    ids, mask = ids[:max_seq_len], mask[:max_seq_len]
    return ids, [t if m else IGNORE_INDEX for t, m in zip(ids, mask)]


def tokenize_preference(tokenizer, row: dict, max_seq_len: int) -> dict[str, list[int]]:
    """``chosen_input_ids``, ``chosen_labels``, ``rejected_input_ids``, ``rejected_labels`` for one valid row."""
    prompt, *responses = preference_conversations(row)
    out = {}
    for side, response in zip(SIDES, responses):
        out[f"{side}_input_ids"], out[f"{side}_labels"] = tokenize_response(tokenizer, prompt, response, max_seq_len, row.get("tools"))
    return out


class PreferenceTokenizer:
    """Ray Data map_batches UDF: loads the tokenizer (and template override) once per worker process (mlplat.data.ingest.tokenize_rows)."""

    def __init__(self, tokenizer_path: str, max_seq_len: int, chat_template: str | None = None):
        self.tokenizer = load_chat_tokenizer(tokenizer_path, chat_template)
        self.max_seq_len = max_seq_len

    def __call__(self, batch: dict[str, np.ndarray]) -> dict[str, list]:
        out: dict[str, list] = {f"{side}_{key}": [] for side in SIDES for key in ("input_ids", "labels")}
        for line in batch["text"]:
            for key, values in tokenize_preference(self.tokenizer, json.loads(line), self.max_seq_len).items():
                out[key].append(np.asarray(values, dtype=np.int64))
        return out


def read_preference_pairs(path: str | Path, tokenizer, max_seq_len: int) -> list[dict[str, list[int]]]:
    """Tokenized pairs of a small held-out preference JSONL, read locally (for evaluation). Pairs whose
    response ``max_seq_len`` cut to nothing are left out, with a warning that counts them."""
    with open(path) as f:
        pairs = [tokenize_preference(tokenizer, json.loads(line), max_seq_len) for line in f if line.strip()]
    answered = [p for p in pairs if all(any(t != IGNORE_INDEX for t in p[f"{side}_labels"]) for side in SIDES)]
    if not answered:
        raise DataError(f"{path}: every one of the {len(pairs)} pairs has a response truncated to nothing at max_seq_len={max_seq_len}: raise data.max_seq_len")
    if len(answered) < len(pairs):
        logger.warning("%s: %d of %d pairs left out: a response truncated to nothing at max_seq_len=%d", path, len(pairs) - len(answered), len(pairs), max_seq_len)
    return answered


def prepare_preference_dataset(
    cfg: PreferenceDataConfig, tokenizer_path: str, rejects_dir: str | Path
) -> tuple[ray.data.Dataset, DataReport]:
    """Validate the sources of ``cfg`` as preference rows (one pass) and return the lazy tokenized pairs."""
    template = resolve_chat_template(cfg.chat_template) if cfg.chat_template is not None else None
    load_chat_tokenizer(tokenizer_path, template)  # a template that cannot mark assistant tokens fails here
    rows, report = prepare_rows(cfg, "preference", rejects_dir)
    tokenized = tokenize_rows(rows, PreferenceTokenizer, tokenizer_path, cfg.max_seq_len, template, cfg.tokenize_concurrency)
    return tokenized, report
