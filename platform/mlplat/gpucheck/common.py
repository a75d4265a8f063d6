"""What every check shares: its settings, its outcome (written as it goes), the models it runs on, and
the rule that compares two greedy outputs where near-ties may legitimately flip."""

from __future__ import annotations

import json
import os
import shutil
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

# Greedy outputs are compared token by token up to their first difference; a difference passes only where the
# reference's top-2 logit margin is below the tolerance (random weights give near-ties, and two correct kernels
# may order a near-tie differently; everything after it then legitimately differs). fp32 kernels agree to ~1e-5
# on these logits; bf16 ones to a few hundredths.
MARGIN_TOLERANCE = {"float32": 1e-3, "bfloat16": 0.25}

# Small prompts and outputs everywhere: the checks are about paths, not speed (engine_throughput aside).
CORPUS = [f"{a} + {b} = {a + b}. The quick brown fox jumps over the lazy dog; what is {a} times {b}?" for a in range(40) for b in range(0, 40, 7)]


@dataclass(frozen=True)
class Settings:
    """One run's choices, handed to every check."""

    device: str  # "cuda" or "cpu"
    quick: bool  # tiny sizes (CI on CPU); off: the sizes (Qwen2.5-0.5B's shape)
    work: Path  # models built by one check and reused by the next

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cuda", 0) if self.device == "cuda" else torch.device("cpu")

    @property
    def serving_dtype(self) -> str:
        return "bfloat16"  # the serving checks' precision on both devices (CPU: the same code at tiny sizes)

    def engine_kwargs(self) -> dict:
        """EngineConfig fields every check's engine takes: the device, and on CPU no C++ kernel build (the CPU
        specialisations are the suite's business, not this check's)."""
        return {"device": self.device} | ({"cpu_kernels": False} if self.device == "cpu" else {})


class CheckFailed(Exception):
    """A check cannot go on; its message is the reason."""


@dataclass
class Outcome:
    """A check's figures and problems, written to its file at every ``record`` so that a check cut off by its
    timeout still reports what it measured."""

    path: Path
    figures: dict = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)

    def record(self, **figures) -> None:
        self.figures.update(figures)
        self.save()

    def fail(self, problem: str) -> None:
        self.problems.append(problem)
        self.save()

    def expect(self, ok: bool, problem: str) -> bool:
        if not ok:
            self.fail(problem)
        return ok

    def save(self, status: str | None = None) -> None:
        state = {"status": status or "running", "figures": self.figures, "problems": self.problems}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(state, indent=1, default=str))
        tmp.replace(self.path)


def run_check(fn: Callable[[Settings, Outcome], None], settings: Settings, result_path: Path) -> None:
    """A check's body in its own process: its outcome lands in ``result_path`` whatever happens."""
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # one bar per model saved or loaded: noise in the check's output
    outcome = Outcome(result_path)
    outcome.save()
    try:
        if settings.device == "cuda":
            torch.cuda.set_device(0)
        torch.set_float32_matmul_precision("highest")  # fp32 parity: no TF32
        fn(settings, outcome)
    except CheckFailed as err:
        outcome.problems.append(str(err))
    except Exception:
        outcome.problems.append(traceback.format_exc(limit=8).strip())
    outcome.save("passed" if not outcome.problems else "failed")


ATTENTION_BACKENDS = ("sdpa", "flex")  # the fallback and the paged-attention path (EngineConfig.attention_backend)


# -- models, built once per run and shared through the work directory --------------------------------------
def built(path: Path, build: Callable[[Path], object]) -> Path:
    """``path``, built by ``build`` into a temporary sibling and renamed into place, so that a check killed
    mid-build leaves nothing half-written for the next."""
    if (path / ".complete").exists():
        return path
    tmp = path.with_name(f"{path.name}.tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    build(tmp)
    (tmp / ".complete").touch()
    shutil.rmtree(path, ignore_errors=True)
    tmp.rename(path)
    return path


def tokenizer_dir(settings: Settings) -> Path:
    from mlplat.models.tokenizer import train_chat_tokenizer

    return built(settings.work / "tokenizer", lambda d: train_chat_tokenizer(CORPUS).save_pretrained(d))


def arch_checkpoint(settings: Settings, arch: str, seed: int = 0) -> Path:
    """The engine tests' configs (tests/test_engine.py): random weights whose logits are peaked enough that
    greedy has few near-ties. llama: GQA, tied embeddings; qwen2: QKV bias, untied, Llama-3 rope scaling;
    qwen3: per-head q/k RMSNorm, explicit head_dim."""

    def build(path: Path) -> None:
        from transformers import (
            LlamaConfig,
            LlamaForCausalLM,
            PreTrainedTokenizerFast,
            Qwen2Config,
            Qwen2ForCausalLM,
            Qwen3Config,
            Qwen3ForCausalLM,
        )

        tokenizer = PreTrainedTokenizerFast.from_pretrained(tokenizer_dir(settings))
        common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)  # fmt: skip
        torch.manual_seed(seed)
        if arch == "llama":
            model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
        elif arch == "qwen2":
            rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 32}  # fmt: skip
            model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False, rope_parameters=rope))
        else:
            model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, tie_word_embeddings=False))
        model.save_pretrained(path)
        tokenizer.save_pretrained(path)

    return built(settings.work / f"{arch}-{seed}", build)


def shape_checkpoint(settings: Settings) -> tuple[Path, object]:
    """Qwen2.5-0.5B's shape with random weights (mlplat.models.shapes), or with --quick a tiny model of the same
    family (GQA, QKV biases, tied embeddings); returns (checkpoint, shape)."""
    from mlplat.models.shapes import SHAPES, ModelShape, build_random_model

    shape = SHAPES["qwen2.5-0.5b"]
    if settings.quick:
        shape = ModelShape(name="tiny-qwen2", vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=1024)  # fmt: skip
    return built(settings.work / shape.name, lambda d: build_random_model(d, shape, CORPUS)), shape


# -- comparing greedy outputs ---------------------------------------------------------------------------------
def top2_margins(top_logprobs: list[list[tuple[int, float]]]) -> list[float]:
    """Per position, the gap between the two likeliest tokens' log-probs (= their logit gap)."""
    return [top[0][1] - top[1][1] if len(top) > 1 else float("inf") for top in top_logprobs]


def compare_greedy(reference: list[list[int]], margins: list[list[float]], got: list[list[int]], tolerance: float) -> dict:
    """Token-by-token agreement of ``got`` with ``reference`` up to each sequence's first difference, which is
    allowed only where the reference's top-2 margin is below ``tolerance``."""
    compared, near_ties, mismatches = 0, 0, []
    for i, (ref, margin, out) in enumerate(zip(reference, margins, got, strict=True)):
        for t, (a, b) in enumerate(zip(ref, out)):
            if a != b:
                if margin[t] < tolerance:
                    near_ties += 1
                else:
                    mismatches.append({"sequence": i, "position": t, "expected": a, "got": b, "margin": round(margin[t], 5)})
                break
            compared += 1
        else:
            if len(ref) != len(out):
                mismatches.append({"sequence": i, "expected_length": len(ref), "got_length": len(out)})
    total = sum(len(r) for r in reference)
    return {"tokens_compared": compared, "tokens_total": total, "near_tie_stops": near_ties, "mismatches": mismatches, "tolerance": tolerance}


def expect_greedy_match(outcome: Outcome, what: str, comparison: dict, min_compared: float = 0.5) -> None:
    """No difference above the tolerance, and enough tokens compared that the check says something."""
    outcome.expect(not comparison["mismatches"], f"{what}: greedy tokens differ where the top-2 margin exceeds "
                                                 f"{comparison['tolerance']}: {comparison['mismatches'][:3]}")  # fmt: skip
    share = comparison["tokens_compared"] / max(1, comparison["tokens_total"])
    outcome.expect(share >= min_compared, f"{what}: only {share:.0%} of the tokens were compared (near-ties stopped the rest)")


def prompts(n: int, seed: int = 0, vocab: int = 256, lengths: tuple[int, int] = (3, 41)) -> list[list[int]]:
    import random

    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(*lengths))] for _ in range(n)]


def engine_greedy(engine, batch: list[list[int]], max_tokens: int) -> tuple[list[list[int]], list[list[float]]]:
    """The engine's greedy tokens for each prompt, with the top-2 margin at each position."""
    from mlplat.engine import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=True, top_logprobs=2)
    outs = engine.generate(batch, params)
    return [o.outputs[0].token_ids for o in outs], [top2_margins(o.outputs[0].top_logprobs) for o in outs]
