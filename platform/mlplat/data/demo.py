"""Deterministic demo data: reversed-sum addition as chat, with a verifiable answer.

The user asks for ``a + b``; the assistant answers with the digits of the sum
least-significant first (``123 + 456 = 579`` -> ``975``). Small transformers learn
addition in this order far faster than in the usual one (Lee et al., 2023,
"Teaching Arithmetic to Small Transformers"), so a 2M-parameter model on two CPU
cores gets well above zero in minutes, yet stays below 100%, which leaves room for
post-training to show a gain.

Splits (JSONL, one object per line):
- ``sft.jsonl``: ``{"messages": [user, assistant]}``
- ``eval.jsonl``: ``{"messages": [user], "answer": "975"}``, held out from every other split
- ``preferences.jsonl``: ``{"prompt": [user], "chosen": [assistant], "rejected": [assistant]}``
- ``preferences_eval.jsonl``: the same, on the held-out eval problems (reward model accuracy, DPO margins)
- ``rl_prompts.jsonl``: ``{"messages": [user], "answer": "975"}``
- ``validation.jsonl``: as ``eval.jsonl``, for choosing between models (checkpoints, SFT or RL) without
  touching the held-out problems whose score is then reported
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from pydantic import BaseModel, Field, model_validator

from mlplat.config import Config

QUESTION = "What is {a} + {b}? Answer with the digits of the sum from last to first."


class DemoDataConfig(Config):
    seed: int = 0
    max_digits: int = Field(3, ge=1, le=9)
    sft_rows: int = 20_000
    eval_rows: int = 500
    preference_rows: int = 2_000
    rl_rows: int = 2_000
    validation_rows: int = Field(300, ge=0)

    @model_validator(mode="after")
    def _room_for_training_problems(self) -> DemoDataConfig:
        # Eval problems are held out of every other split: if they took (nearly) all the distinct
        # problems, drawing training problems would never end.
        distinct = (10**self.max_digits) ** 2
        if self.eval_rows > distinct // 2:
            raise ValueError(f"eval_rows={self.eval_rows} holds out more than half of the {distinct} distinct "
                             f"{self.max_digits}-digit problems; lower eval_rows or raise max_digits")
        return self


class DemoDataPaths(BaseModel):
    sft: Path
    eval: Path
    preferences: Path
    preferences_eval: Path
    rl_prompts: Path
    validation: Path


def question(a: int, b: int) -> str:
    return QUESTION.format(a=a, b=b)


def reversed_sum(a: int, b: int) -> str:
    return str(a + b)[::-1]


def _operand(rng: random.Random, max_digits: int) -> int:
    digits = rng.randint(1, max_digits)
    return rng.randint(0 if digits == 1 else 10 ** (digits - 1), 10**digits - 1)


def _wrong_answer(rng: random.Random, a: int, b: int) -> str:
    """A plausible mistake: the sum in the usual order, or one digit off."""
    right = reversed_sum(a, b)
    if len(right) > 1 and right != right[::-1] and rng.random() < 0.5:
        return right[::-1]
    i = rng.randrange(len(right))
    digit = str((int(right[i]) + rng.randint(1, 9)) % 10)
    return right[:i] + digit + right[i + 1 :]


def _user(a: int, b: int) -> dict:
    return {"role": "user", "content": question(a, b)}


def _assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


def write_demo_data(out_dir: str | Path, cfg: DemoDataConfig = DemoDataConfig()) -> DemoDataPaths:
    """Write the six splits to ``out_dir``; the same config always writes the same bytes."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    rng = random.Random(cfg.seed)

    held_out: set[tuple[int, int]] = set()
    eval_problems: list[tuple[int, int]] = []
    while len(eval_problems) < cfg.eval_rows:
        a, b = _operand(rng, cfg.max_digits), _operand(rng, cfg.max_digits)
        if (a, b) not in held_out:
            held_out.add((a, b))
            eval_problems.append((a, b))
    eval_rows = [{"messages": [_user(a, b)], "answer": reversed_sum(a, b)} for a, b in eval_problems]

    def training_problems(n: int) -> list[tuple[int, int]]:
        problems = []
        while len(problems) < n:
            a, b = _operand(rng, cfg.max_digits), _operand(rng, cfg.max_digits)
            if (a, b) not in held_out:
                problems.append((a, b))
        return problems

    sft_rows = [{"messages": [_user(a, b), _assistant(reversed_sum(a, b))]} for a, b in training_problems(cfg.sft_rows)]
    preference_rows = [
        {"prompt": [_user(a, b)], "chosen": [_assistant(reversed_sum(a, b))], "rejected": [_assistant(_wrong_answer(rng, a, b))]}
        for a, b in training_problems(cfg.preference_rows)
    ]
    rl_rows = [{"messages": [_user(a, b)], "answer": reversed_sum(a, b)} for a, b in training_problems(cfg.rl_rows)]
    eval_rng = random.Random(cfg.seed + 1)  # its own stream: the other splits' bytes do not depend on this one
    preference_eval_rows = [
        {"prompt": [_user(a, b)], "chosen": [_assistant(reversed_sum(a, b))], "rejected": [_assistant(_wrong_answer(eval_rng, a, b))]}
        for a, b in eval_problems
    ]
    validation_rng = random.Random(cfg.seed + 2)  # its own stream too
    validation_rows = []
    while len(validation_rows) < cfg.validation_rows:
        a, b = _operand(validation_rng, cfg.max_digits), _operand(validation_rng, cfg.max_digits)
        if (a, b) not in held_out:
            validation_rows.append({"messages": [_user(a, b)], "answer": reversed_sum(a, b)})

    paths = DemoDataPaths(
        sft=out_dir / "sft.jsonl",
        eval=out_dir / "eval.jsonl",
        preferences=out_dir / "preferences.jsonl",
        preferences_eval=out_dir / "preferences_eval.jsonl",
        rl_prompts=out_dir / "rl_prompts.jsonl",
        validation=out_dir / "validation.jsonl",
    )
    for path, rows in [(paths.sft, sft_rows), (paths.eval, eval_rows), (paths.preferences, preference_rows),
                       (paths.preferences_eval, preference_eval_rows), (paths.rl_prompts, rl_rows), (paths.validation, validation_rows)]:
        with open(path, "w") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return paths


def tokenizer_corpus(sft_path: str | Path, limit: int = 5_000) -> list[str]:
    """Texts to train the tiny tokenizer on: the rendered chat turns of the first ``limit`` SFT rows."""
    texts = ["system", "user", "assistant"]  # role names, so the template's headers merge too
    with open(sft_path) as f:
        for i, line in enumerate(f):
            if i >= limit:
                break
            texts.extend(m["content"] for m in json.loads(line)["messages"])
    return texts
