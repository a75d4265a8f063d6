"""Rollout actors: the native engine generating G samples per prompt, with log-probs, for RL.

A ``RolloutWorker`` is a Ray actor holding one ``LLMEngine``. Trainers send it chats and
get back token ids with the log-prob of every sampled token (stop token included), and
push new weights into it in place (``update_weights``) after each policy update: on CPU
through the object store (one ``ray.put`` of the state dict, read by every actor).

Where the RL loop runs without Ray (``mlplat.train.worker.LocalGroup``), an ``InProcessRollout`` puts a
``RolloutWorker`` in each rank's own process instead; ``generate`` and ``sync_weights`` take either.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from pydantic import Field

from mlplat.config import Config
from mlplat.engine import EngineConfig, LLMEngine, SamplingParams


class RolloutConfig(Config):
    num_actors: int = Field(default=1, ge=1)  # rollout actors (not Ray Train workers); training rank r uses actor r % num_actors
    num_cpus: float = Field(default=1, gt=0)  # per actor
    num_gpus: float = Field(default=0, ge=0)  # per actor; 0 on CPU
    device: str = "cpu"
    dtype: str = "float32"
    kv_cache_memory_gb: float = Field(default=0.25, gt=0)
    max_num_seqs: int = Field(default=256, ge=1)


@dataclass
class Sample:
    prompt_ids: list[int]
    completion_ids: list[int]  # every sampled token, the stop token included
    logprobs: list[float]  # the engine's log-prob of each completion token (raw distribution)
    text: str  # the completion without its stop token
    finish_reason: str | None


class RolloutWorker:
    """One engine; use as a Ray actor: ``ray.remote(RolloutWorker).options(...).remote(model_dir, cfg)``."""

    def __init__(self, model_dir: str, cfg: dict):
        cfg = RolloutConfig.model_validate(cfg)
        self.engine = LLMEngine(
            EngineConfig(model=model_dir, device=cfg.device, dtype=cfg.dtype, kv_cache_memory_gb=cfg.kv_cache_memory_gb, max_num_seqs=cfg.max_num_seqs)
        )
        self.tokenizer = self.engine.tokenizer

    def prompt_ids(self, conversation: list[dict]) -> list[int]:
        text = self.tokenizer.apply_chat_template(conversation, tokenize=False, add_generation_prompt=True)
        return self.tokenizer.encode(text, add_special_tokens=False)

    def generate(self, conversations: list[list[dict]], params: dict) -> list[Sample]:
        """``n`` samples per conversation, grouped consecutively (all of prompt 0's, then prompt 1's...).

        With a ``seed``, prompt i's samples are seeded ``seed + i * n + j``: the engine seeds sample j of
        one request ``seed + j``, so one seed for every prompt would draw the same noise for all of them."""
        params = SamplingParams.model_validate({**params, "logprobs": True})
        prompts = [self.prompt_ids(c) for c in conversations]
        per_prompt = [params if params.seed is None else params.model_copy(update={"seed": params.seed + i * params.n}) for i in range(len(prompts))]
        samples = []
        for prompt, out in zip(prompts, self.engine.generate(prompts, per_prompt)):
            for c in sorted(out.outputs, key=lambda c: c.index):
                samples.append(Sample(prompt, c.sampled_token_ids, c.sampled_logprobs, c.text, c.finish_reason))
        return samples

    def update_weights(self, state: dict[str, torch.Tensor]) -> int:
        """Load HF-named weights in place (the trainer's policy after an update)."""
        return self.engine.update_weights(state)

    def score(self, token_ids: list[int]) -> list[float]:
        """Log-prob of each token after the first given the ones before it (parity checks)."""
        return self.engine.score(token_ids)


class InProcessRollout:
    """A ``RolloutWorker`` made on first use in the process that uses it: each rank of a run without Ray
    gets an engine of its own (it pickles as its settings), samples from it, and loads into it the
    weights it just trained itself."""

    def __init__(self, model_dir: str, cfg: RolloutConfig | None = None):
        self.model_dir, self.cfg = model_dir, cfg or RolloutConfig()
        self._worker: RolloutWorker | None = None

    def __getstate__(self) -> dict:
        return {"model_dir": self.model_dir, "cfg": self.cfg, "_worker": None}

    @property
    def worker(self) -> RolloutWorker:
        if self._worker is None:
            self._worker = RolloutWorker(self.model_dir, self.cfg.model_dump())
        return self._worker


def generate(rollout_worker, conversations: list[list[dict]], params: dict) -> list[Sample]:
    """``RolloutWorker.generate`` on a rollout actor (through Ray) or an ``InProcessRollout``."""
    if isinstance(rollout_worker, InProcessRollout):
        return rollout_worker.worker.generate(conversations, params)
    import ray  # here, not at the top: Sample and InProcessRollout import without Ray (mlplat.gpucheck)

    return ray.get(rollout_worker.generate.remote(conversations, params))


def start_rollout_workers(model_dir: str, cfg: RolloutConfig) -> list:
    import ray

    actor = ray.remote(RolloutWorker).options(num_cpus=cfg.num_cpus, num_gpus=cfg.num_gpus)
    workers = [actor.remote(model_dir, cfg.model_dump()) for _ in range(cfg.num_actors)]
    ray.get([w.__ray_ready__.remote() for w in workers])  # fail here, not on the first rollout, if one cannot start
    return workers


def sync_weights(policy, rollout_workers: list, rank: int, device: torch.device) -> None:
    """Stream the policy's weights into every rollout actor in place, one decoder layer at a time; all
    ranks wait for it.

    Each layer is gathered from the shards (every rank takes part under FSDP2), put in the object
    store by rank 0 and loaded by every actor before the next: no full state dict on any rank, no
    full copy in the object store (a 7B model's 15 GB in bf16). A collective broadcast replaces the
    object store where the actors hold GPUs in the trainers' group. In-process rollouts (one per rank)
    each load the layers on their own rank."""
    import ray

    from mlplat import collectives
    from mlplat.train.parallel import full_weights_by_layer

    in_process = all(isinstance(worker, InProcessRollout) for worker in rollout_workers)
    for layer in full_weights_by_layer(policy, every_rank=in_process):
        if in_process:
            for worker in rollout_workers:
                worker.worker.update_weights(layer)
        elif rank == 0 and layer:
            ref = ray.put(layer)
            ray.get([worker.update_weights.remote(ref) for worker in rollout_workers])
            del ref
    collectives.barrier(device)  # no rank samples from the old weights


def held_out_exact_match(rollout_worker, rows: list[dict], max_tokens: int) -> float:
    """Greedy exact match through a rollout worker (its weights are the policy's after each sync)."""
    from mlplat.evaluation import extract_answer

    samples = generate(rollout_worker, [r["messages"] for r in rows], {"n": 1, "max_tokens": max_tokens, "temperature": 0})
    return sum(extract_answer(s.text) == str(r["answer"]) for s, r in zip(samples, rows)) / len(rows)
