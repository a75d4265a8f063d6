"""RL prompts (GRPO and friends): validated rows for rollouts, task fields kept for the reward.

A row is ``{"prompt": str | [messages]}`` or ``{"messages": [messages]}`` plus any task
fields (``answer`` ...), see ``mlplat.data.schemas``. Rows stay JSON text in Ray Data
(``text``; task fields differ in type from task to task, which a columnar schema
would not hold); ``prompt_messages`` turns one into the chat the policy answers.
"""

from __future__ import annotations

from pathlib import Path

import ray.data

from mlplat.data.ingest import DataConfig, DataReport, prepare_rows
from mlplat.data.schemas import as_messages


def prompt_messages(row: dict) -> list[dict]:
    """The conversation to answer: ``prompt`` (a string is one user turn) or ``messages``."""
    return as_messages(row["prompt"], "user") if "prompt" in row else row["messages"]


def task_fields(row: dict) -> dict:
    """Everything but the prompt (``answer`` ...), as the row gave it."""
    return {k: v for k, v in row.items() if k not in ("prompt", "messages", "tools")}


def prepare_rl_prompt_dataset(cfg: DataConfig, rejects_dir: str | Path) -> tuple[ray.data.Dataset, DataReport]:
    """Validate the sources of ``cfg`` as RL prompt rows (one pass); lazy good rows ``{"text", "path", "source"}``.

    ``json.loads(row["text"])`` gives the row; ``prompt_messages`` / ``task_fields`` split it.
    """
    return prepare_rows(cfg, "rl_prompt", rejects_dir)

