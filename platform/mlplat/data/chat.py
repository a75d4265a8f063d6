"""Chat rows as token ids: schema checks and the chat template with assistant-only labels.

Pure functions on one row; ``mlplat.data.sft`` runs them inside Ray Data.
"""

from __future__ import annotations

import json

from mlplat.errors import DataError
from mlplat.train.batch import IGNORE_INDEX

ROLES = ("system", "user", "assistant", "tool")


def chat_row_error(line: str) -> str:
    """Why a JSONL line is not a valid chat SFT row ('' if it is)."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as err:
        return f"not valid JSON ({err.msg} at column {err.colno})"
    if not isinstance(row, dict) or "messages" not in row:
        return "missing field 'messages' (a list of {role, content})"
    messages = row["messages"]
    if not isinstance(messages, list) or not messages:
        return "field 'messages' must be a non-empty list"
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in ROLES:
            return f"messages[{i}].role must be one of {list(ROLES)}"
        if not isinstance(m.get("content"), str):
            return f"messages[{i}].content must be a string"
    if not any(m["role"] == "assistant" for m in messages):
        return "no assistant message: nothing to learn from"
    return ""


def tokenize_chat(tokenizer, messages: list[dict], max_seq_len: int) -> tuple[list[int], list[int]]:
    """Token ids and labels for one conversation; labels are IGNORE_INDEX except on assistant tokens."""
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True
    )
    input_ids = list(out["input_ids"])[:max_seq_len]
    mask = list(out["assistant_masks"])[:max_seq_len]
    if not any(mask):
        raise DataError(
            "the chat template marks no assistant tokens: it needs {% generation %} blocks "
            "around assistant content (see mlplat.models.tokenizer.CHAT_TEMPLATE)"
        )
    labels = [t if m else IGNORE_INDEX for t, m in zip(input_ids, mask)]
    return input_ids, labels


def check_chat_template(tokenizer, source: str) -> None:
    """Fail before any work starts if the template cannot mark assistant tokens."""
    probe = [{"role": "user", "content": "1 + 1"}, {"role": "assistant", "content": "2"}]
    try:
        tokenize_chat(tokenizer, probe, max_seq_len=10_000)
    except DataError as err:
        raise DataError(f"{source}: {err}") from None
