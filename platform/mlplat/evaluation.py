"""Exact-match evaluation of a model on held-out prompts with plain transformers generation.

The native engine replaces `generate` here once it lands; the metric stays the same.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import torch
from pydantic import BaseModel

from mlplat.errors import DataError
from mlplat.models import load_model, load_tokenizer
from mlplat.observability.progress import ProgressReporter


def extract_answer(completion: str) -> str:
    """The first run of digits in a completion ('' if none): what exact match compares."""
    match = re.search(r"\d+", completion)
    return match.group(0) if match else ""


class EvalResult(BaseModel):
    accuracy: float
    correct: int
    total: int
    samples: list[dict]  # a few (prompt, completion, answer) triples to eyeball


def read_eval_rows(path: str | Path, limit: int | None = None) -> list[dict]:
    path = Path(path)
    if not path.is_file():
        raise DataError(f"{path}: eval file not found")
    rows = []
    with open(path) as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(rows) >= limit:
                break
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}:{lineno}: not valid JSON ({err.msg})") from None
            if not isinstance(row, dict) or "messages" not in row or "answer" not in row:
                raise DataError(f"{path}:{lineno}: eval rows need 'messages' and 'answer'")
            rows.append(row)
    return rows


@torch.inference_mode()
def generate(model, tokenizer, conversations: list[list[dict]], max_new_tokens: int, batch_size: int, progress: str = "eval") -> list[str]:
    """Greedy completions for chat conversations (left-padded batches); ``progress`` names them on the console."""
    tokenizer.padding_side = "left"
    completions = []
    reporter = ProgressReporter(progress, len(conversations), unit="row")
    for start in range(0, len(conversations), batch_size):
        texts = [
            tokenizer.apply_chat_template(c, tokenize=False, add_generation_prompt=True)
            for c in conversations[start : start + batch_size]
        ]
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
        out = model.generate(
            **enc,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        completions += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
        reporter.update(len(completions))
    return completions


def evaluate_exact_match(
    model_dir: str | Path,
    eval_path: str | Path,
    limit: int | None = None,
    max_new_tokens: int = 8,
    batch_size: int = 64,
    device: str = "cpu",
    progress: str = "eval",
) -> EvalResult:
    rows = read_eval_rows(eval_path, limit)
    if not rows:
        raise DataError(f"{eval_path}: no eval rows")
    model = load_model(model_dir, device=device).eval()
    tokenizer = load_tokenizer(model_dir)
    completions = generate(model, tokenizer, [r["messages"] for r in rows], max_new_tokens, batch_size, progress)
    correct = [extract_answer(c) == str(r["answer"]) for c, r in zip(completions, rows)]
    samples = [
        {"prompt": r["messages"][-1]["content"], "completion": c, "answer": r["answer"]}
        for r, c in zip(rows[:5], completions[:5])
    ]
    return EvalResult(accuracy=sum(correct) / len(rows), correct=sum(correct), total=len(rows), samples=samples)
