"""Where rewards come from: a Python function (verifiable), a reward model actor, or an LLM judge (RLAIF).

Every source is a callable ``(samples, rows) -> list[float]``: ``rows[i]`` is the task row
(its ``answer`` and any other fields) that sample ``i`` answers. ``build_reward_fn`` picks
one from a ``RewardConfig``; a reward model runs as its own Ray actor
(``RewardModelScorer``) that every training rank shares. A recipe may sum several sources
with weights (TRL's ``reward_funcs`` and ``reward_weights``): ``weighted_rewards``.
"""

from __future__ import annotations

import importlib
import os
import re
from collections.abc import Callable
from typing import Literal

import ray
import torch
from pydantic import Field, model_validator

from mlplat.config import Config
from mlplat.data.rl_prompts import prompt_messages
from mlplat.errors import ConfigError
from mlplat.evaluation import extract_answer
from mlplat.rl.rollout import Sample

RewardFn = Callable[[list[Sample], list[dict]], list[float]]

JUDGE_PROMPT = (
    "Rate how well the answer solves the task, from 0 (wrong) to 10 (fully correct). "
    "Reply with the number only.\n\nTask: {question}\n\nAnswer: {answer}"
)


class RewardConfig(Config):
    kind: Literal["exact_match", "function", "reward_model", "judge"] = "exact_match"
    name: str | None = Field(default=None, min_length=1)  # in metric names (rewards/{name}/mean); default: the function's name or the kind
    function: str | None = None  # kind=function: "package.module:name", called as f(completion: str, row: dict) -> float
    reward_model: str | None = None  # kind=reward_model: HF directory or models:/ URI of a reward model
    reward_model_num_cpus: float = 1
    judge_url: str | None = None  # kind=judge: an OpenAI-compatible base URL, e.g. our own Serve app's .../v1
    judge_model: str | None = None
    judge_api_key_env: str = "MLPLAT_JUDGE_API_KEY"  # the key is read from this environment variable, never from config
    judge_prompt: str = JUDGE_PROMPT

    @model_validator(mode="after")
    def _needs(self):
        needed = {"function": "function", "reward_model": "reward_model", "judge": "judge_url"}.get(self.kind)
        if needed and getattr(self, needed) is None:
            raise ValueError(f"reward.kind={self.kind} needs reward.{needed}")
        return self

    @property
    def label(self) -> str:
        if self.name is not None:
            return self.name
        return self.function.rpartition(":")[2] if self.kind == "function" else self.kind


def exact_match(samples: list[Sample], rows: list[dict]) -> list[float]:
    """1 if the completion's answer (its first run of digits) equals the row's ``answer``, else 0."""
    return [float(extract_answer(s.text) == str(row["answer"])) for s, row in zip(samples, rows)]


def load_function(path: str) -> Callable[[str, dict], float]:
    module, _, name = path.partition(":")
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError, ValueError) as err:
        raise ConfigError(f"reward.function: cannot import {path!r} ({err}); expected 'package.module:function'") from None


class RewardModelScorer:
    """A reward model as a Ray actor: scores (conversation, response) pairs with its scalar head."""

    def __init__(self, model_dir: str):
        from mlplat.models import load_reward_model, load_tokenizer

        self.model = load_reward_model(model_dir).eval()
        self.tokenizer = load_tokenizer(model_dir)

    @torch.no_grad()
    def score(self, conversations: list[list[dict]]) -> list[float]:
        """One score per full conversation (prompt turns + the assistant response), right-padded batch."""
        texts = [self.tokenizer.apply_chat_template(c, tokenize=False) for c in conversations]
        self.tokenizer.padding_side = "right"  # the head reads the last non-pad token
        enc = self.tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        return self.model(**enc).logits[:, 0].tolist()


class LLMJudge:
    """RLAIF: an LLM behind an OpenAI-compatible endpoint grades each answer 0-10; reward = grade / 10."""

    def __init__(self, base_url: str, model: str | None, api_key: str | None, prompt: str):
        import openai

        self.client = openai.OpenAI(base_url=base_url, api_key=api_key or "none", max_retries=2)
        self.model = model or self.client.models.list().data[0].id
        self.prompt = prompt
        self.unparsed = 0  # replies without a grade (scored 0)

    def grade(self, question: str, answer: str) -> float:
        reply = self.client.chat.completions.create(
            model=self.model, messages=[{"role": "user", "content": self.prompt.format(question=question, answer=answer)}],
            max_tokens=4, temperature=0,
        )  # fmt: skip
        match = re.search(r"\d+(\.\d+)?", reply.choices[0].message.content or "")
        if match is None:
            self.unparsed += 1
            return 0.0
        return min(10.0, float(match.group(0))) / 10.0

    def __call__(self, samples: list[Sample], rows: list[dict]) -> list[float]:
        return [self.grade(prompt_messages(row)[-1]["content"], s.text) for s, row in zip(samples, rows)]


def start_reward_model(cfg: RewardConfig, model_dir: str):
    """The shared scorer actor for kind=reward_model (started by the driver, handed to the trainers)."""
    return ray.remote(RewardModelScorer).options(num_cpus=cfg.reward_model_num_cpus).remote(model_dir)


def build_reward_fn(cfg: RewardConfig, scorer=None) -> RewardFn:
    if cfg.kind == "exact_match":
        return exact_match
    if cfg.kind == "function":
        fn = load_function(cfg.function)
        return lambda samples, rows: [float(fn(s.text, row)) for s, row in zip(samples, rows)]
    if cfg.kind == "reward_model":
        assert scorer is not None, "kind=reward_model needs the scorer actor (start_reward_model)"

        def score(samples: list[Sample], rows: list[dict]) -> list[float]:
            conversations = [[*prompt_messages(row), {"role": "assistant", "content": s.text}] for s, row in zip(samples, rows)]
            return ray.get(scorer.score.remote(conversations))

        return score
    return LLMJudge(cfg.judge_url, cfg.judge_model, os.environ.get(cfg.judge_api_key_env), cfg.judge_prompt)


def weighted_rewards(fns: dict[str, RewardFn], weights: list[float], samples: list[Sample], rows: list[dict]) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The weighted sum of every source's rewards [N], and each source's own [N] by name."""
    each = {name: torch.tensor(fn(samples, rows), dtype=torch.float32) for name, fn in fns.items()}
    for name, values in each.items():
        if values.shape != (len(samples),):
            raise ValueError(f"reward {name!r} returned {tuple(values.shape)} values for {len(samples)} completions")
    return sum(w * values for w, values in zip(weights, each.values(), strict=True)), each
