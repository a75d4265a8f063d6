"""The quickstart: the whole platform on embedded defaults, as a pipeline.

    demo data -> tiny model ----------------------------> eval_before
                     \\-> SFT on Ray Train (2 DDP workers) -> eval_sft
                            \\-> GRPO (rollout actors + Ray Train) -> eval_grpo
                                 -> choose the better of the two on a validation split -> register @quickstart
                                 -> serve and ask

Every step is a Ray task with its own MLflow run under the pipeline's run; data and the
base model travel as MLflow artifacts (``runs:/...``), the trained model as a registered
version (``models:/quickstart-tiny/N``). Run again with the same settings and every step up
to ``register`` is reused from the cache.

    make quickstart | mlplat quickstart [--set max_steps=800]
    mlplat run pipelines/quickstart.py [--param cfg.max_steps=800]
    mlplat submit pipelines/quickstart.py --address http://HEAD:8265 --follow
    python -m pipelines.quickstart [--param cfg.max_steps=800]
"""

from __future__ import annotations

import json
from pathlib import Path

from pydantic import BaseModel

from mlplat.config import Config
from mlplat.data.demo import DemoDataConfig, tokenizer_corpus, write_demo_data
from mlplat.data.sft import SFTDataConfig
from mlplat.evaluation import evaluate_exact_match
from mlplat.models import TinyModelConfig, build_tiny_model
from mlplat.observability import console
from mlplat.pipeline import Dataset, Model, pipeline, step, step_context
from mlplat.tracking import parse_model_uri
from mlplat.train.optim import OptimizerConfig
from train_apps.sft import SFTConfig, run_sft

# The task's loss drops suddenly once the model learns carries; where that happens within 1000 steps depends on the
# CPU's floating-point kernels. On one 2-core machine 1000 steps at lr 1e-3 gave 98% held-out exact match, on another
# 84%; on the latter 1.5e-3 gave 95%, 2e-3 93%, and 3e-3 diverged (3%).
SFT_OPTIM = OptimizerConfig(lr=1.5e-3)


class QuickstartConfig(Config):
    workdir: str = "quickstart"  # step scratch space under mlplat quickstart / run_quickstart (mlplat run: --workdir)
    data: DemoDataConfig = DemoDataConfig()
    model: TinyModelConfig = TinyModelConfig()
    optim: OptimizerConfig = SFT_OPTIM
    # 600 steps (at lr 1e-3) sat on the edge of the task's sudden drop in loss: held-out exact match 7-70% by data
    # order (shuffle seed); 1000 got past it in every order tried on that machine, not on all (SFT_OPTIM). 3.5-6 minutes
    # of SFT on 2 CPU cores.
    max_steps: int = 1000
    num_workers: int = 2
    batch_size_per_worker: int = 32
    eval_limit: int = 500
    # GRPO from the SFT model on the RL prompts (exact-match reward); 0 skips post-training.
    grpo_steps: int = 20  # optimizer steps, two per rollout
    # A small step: at lr 1e-4, ten rollouts of GRPO took held-out exact match from 71% to 45% (the release kept SFT's model).
    grpo_optim: OptimizerConfig = OptimizerConfig(lr=1e-5, warmup_steps=0, min_lr_ratio=1.0)
    registered_model: str = "quickstart-tiny"
    alias: str = "quickstart"
    serve: bool = True  # end by serving the registered version (PD) and asking it through the openai client


class QuickstartResult(BaseModel):
    run_id: str
    served_answers: list[dict] = []
    eval_samples: list[dict] = []  # the first eval completions (transformers generate), to compare
    model_uri: str
    accuracy_before: float
    accuracy_sft: float
    accuracy_grpo: float | None  # None: post-training skipped (grpo_steps=0)
    grpo_max_logprob_diff: float | None = None  # largest |trainer - rollout actor| log-prob in GRPO: stale weights show here
    accuracy_after: float  # of the registered version: the better of SFT and GRPO
    first_loss: float
    final_loss: float
    tracking_uri: str


DEFAULTS = QuickstartConfig()


# -- steps -------------------------------------------------------------------------------


@step
def demo_data(cfg: DemoDataConfig) -> Dataset:
    """The demo splits (sft, eval, preferences, rl_prompts) as one dataset directory."""
    out = Path(step_context().workdir) / "data"
    write_demo_data(out, cfg)
    return Dataset(out)


@step
def tiny_model(data: Dataset, cfg: TinyModelConfig) -> Model:
    """A tiny Llama with a BPE tokenizer trained on the SFT chats (HF format)."""
    out = Path(step_context().workdir) / "model"
    build_tiny_model(out, tokenizer_corpus(data.local_path() / "sft.jsonl"), cfg)
    return Model(out)


@step
def evaluate(model: Model, data: Dataset, limit: int) -> dict:
    """Exact match on the held-out prompts (accuracy, counts, the first completions)."""
    result = evaluate_exact_match(model.local_path(), data.local_path() / "eval.jsonl", limit=limit, progress=step_context().step)
    step_context().log_metrics({"eval/exact_match": result.accuracy})
    return result.model_dump()


@step(num_cpus=0, launches={"CPU": 2})  # the task only drives Ray Train; its workers hold the CPUs
def sft(base: Model, data: Dataset, optim: OptimizerConfig, max_steps: int, num_workers: int, batch_size_per_worker: int,
        registered_model: str) -> dict:
    """SFT on Ray Train (train_apps/sft.py); the result is a new registered version."""
    context = step_context()
    workdir = Path(context.workdir)
    result = run_sft(
        SFTConfig(
            model=str(base.local_path()),
            data=SFTDataConfig(path=str(data.local_path() / "sft.jsonl")),
            optim=optim,
            max_steps=max_steps,
            num_workers=num_workers,
            batch_size_per_worker=batch_size_per_worker,
            storage_path=str(workdir / "ray_train"),
            experiment=context.experiment,
            run_name="quickstart-sft",
            registered_model=registered_model,
            registered_alias=None,  # `register` points the alias at it once it is evaluated
        ),
        tracking_uri=context.tracking_uri,
        work_dir=workdir / "outputs",
    )
    context.nest(result.run_id)  # the training run shows under this step in the MLflow UI
    return {"model": Model(result.model_version.uri), "run_id": result.run_id, "first_loss": result.first_loss, "final_loss": result.final_loss}


@step(num_cpus=0, launches={"CPU": 3})  # Ray Train workers and a rollout actor hold the CPUs
def grpo(policy: Model, data: Dataset, optim: OptimizerConfig, max_steps: int, num_workers: int, registered_model: str) -> dict:
    """GRPO from the SFT model (train_apps/grpo.py): exact-match reward on the RL prompts; a new registered version."""
    from mlplat.data.ingest import DataConfig
    from train_apps.grpo import GRPOConfig, run_grpo

    context = step_context()
    workdir = Path(context.workdir)
    result = run_grpo(
        GRPOConfig(
            model=policy.uri,
            data=DataConfig(path=str(data.local_path() / "rl_prompts.jsonl")),
            optim=optim,
            max_steps=max_steps,
            log_every=max(1, max_steps // 2),
            num_workers=num_workers,
            batch_size_per_worker=32,  # completions per optimizer step: 8 prompts x 8 per rollout, 2 steps each
            num_generations=8,
            steps_per_generation=2,
            max_completion_length=8,
            storage_path=str(workdir / "ray_train"),
            experiment=context.experiment,
            run_name="quickstart-grpo",
            registered_model=registered_model,
            registered_alias=None,
        ),
        tracking_uri=context.tracking_uri,
        work_dir=workdir / "outputs",
    )
    context.nest(result.run_id)
    return {"model": Model(result.model_version.uri), "run_id": result.run_id, "rewards": result.rewards,
            "max_logprob_diff": result.max_logprob_diff}


@step
def choose(data: Dataset, limit: int, sft_model: Model, sft_eval: dict,
           grpo_model: Model | None = None, grpo_eval: dict | None = None) -> dict:
    """The candidate to release: GRPO's model unless it scores below SFT's on the validation split (the
    held-out prompts, whose score is reported, play no part in the choice)."""
    if grpo_model is None:
        return {"model": sft_model, "accuracy": sft_eval["accuracy"], "samples": sft_eval["samples"]}
    context, validation = step_context(), data.local_path() / "validation.jsonl"
    scores = {name: evaluate_exact_match(model.local_path(), validation, limit=limit, progress=f"{context.step}/{name}").accuracy
              for name, model in (("sft", sft_model), ("grpo", grpo_model))}
    context.log_metrics({f"validation/exact_match_{name}": score for name, score in scores.items()})
    if scores["grpo"] >= scores["sft"]:
        return {"model": grpo_model, "accuracy": grpo_eval["accuracy"], "samples": grpo_eval["samples"], "validation": scores}
    return {"model": sft_model, "accuracy": sft_eval["accuracy"], "samples": sft_eval["samples"], "validation": scores}


@step(num_cpus=0, cache=False)  # moves an alias: always done, never replayed from the cache
def register(model: Model, accuracy: float, baseline: float, alias: str) -> Model:
    """Point ``models:/NAME@alias`` at the evaluated version; record its eval on the version and its training run."""
    ref = parse_model_uri(model.uri)
    context = step_context()
    client = context.client
    client.set_registered_model_alias(ref.name, alias, ref.version)
    client.set_model_version_tag(ref.name, ref.version, "eval/exact_match", f"{accuracy:.4f}")
    context.log_metrics({"eval/exact_match": accuracy, "eval/exact_match_before": baseline})
    training_run = client.get_model_version(ref.name, ref.version).run_id
    client.log_metric(training_run, "eval/exact_match_before", baseline)
    client.log_metric(training_run, "eval/exact_match", accuracy)
    return Model(f"models:/{ref.name}@{alias}")


@step(num_cpus=0, cache=False, launches={"CPU": 1.5})  # three Serve replicas of half a CPU each
def serve_and_ask(model: Model, data: Dataset, questions: int = 3) -> list[dict]:
    """Deploy the version as the PD-disaggregated OpenAI app and ask it a few held-out questions."""
    import openai
    from ray import serve

    from mlplat.serve.config import ReplicaConfig, ServeConfig
    from serve_apps.llm import run as run_app

    half = ReplicaConfig(num_cpus=0.5)
    cfg = ServeConfig(model=model.uri, mode="pd", prefill=half, decode=half, ingress=half, app_name="quickstart", route_prefix="/quickstart")
    url = run_app(cfg)
    client = openai.OpenAI(base_url=url, api_key="quickstart", max_retries=0)
    answers = []
    try:
        with open(data.local_path() / "eval.jsonl") as f:
            rows = [json.loads(next(f)) for _ in range(questions)]
        served_name = client.models.list().data[0].id
        for row in rows:
            reply = client.chat.completions.create(model=served_name, messages=row["messages"], max_tokens=8, temperature=0)
            answers.append({"question": row["messages"][-1]["content"], "answer": reply.choices[0].message.content, "expected": row["answer"]})
            print(f"{answers[-1]['question']!r} -> {answers[-1]['answer']!r} (expected {row['answer']!r})", flush=True)
    finally:
        serve.delete(cfg.app_name)
    return answers


# -- the pipeline ------------------------------------------------------------------------


@pipeline(experiment="mlplat-quickstart")
def quickstart(cfg: QuickstartConfig = DEFAULTS):
    data = demo_data(cfg.data)
    base = tiny_model(data, cfg.model)
    before = evaluate.options(name="eval_before")(base, data, cfg.eval_limit)
    trained = sft.options(launches={"CPU": cfg.num_workers})(
        base, data, cfg.optim, cfg.max_steps, cfg.num_workers, cfg.batch_size_per_worker, cfg.registered_model
    )
    after_sft = evaluate.options(name="eval_sft")(trained["model"], data, cfg.eval_limit)
    if cfg.grpo_steps:
        tuned = grpo.options(launches={"CPU": cfg.num_workers + 1})(
            trained["model"], data, cfg.grpo_optim, cfg.grpo_steps, cfg.num_workers, cfg.registered_model
        )
        after_grpo = evaluate.options(name="eval_grpo")(tuned["model"], data, cfg.eval_limit)
        chosen = choose(data, cfg.eval_limit, trained["model"], after_sft, tuned["model"], after_grpo)
    else:
        tuned, after_grpo, chosen = None, None, choose(data, cfg.eval_limit, trained["model"], after_sft)
    released = register(chosen["model"], chosen["accuracy"], before["accuracy"], cfg.alias)
    answers = serve_and_ask(released, data) if cfg.serve else []
    return {"before": before, "after_sft": after_sft, "after_grpo": after_grpo, "chosen": chosen,
            "sft": trained, "grpo": tuned, "model": released, "served_answers": answers}


def run_quickstart(cfg: QuickstartConfig = DEFAULTS, address: str | None = None) -> QuickstartResult:
    run = quickstart.run({"cfg": cfg}, address=address, workdir=cfg.workdir)
    out = run.outputs
    result = QuickstartResult(
        run_id=out["sft"]["run_id"],
        served_answers=out["served_answers"],
        eval_samples=out["chosen"]["samples"],
        model_uri=out["model"].uri,
        accuracy_before=out["before"]["accuracy"],
        accuracy_sft=out["after_sft"]["accuracy"],
        accuracy_grpo=out["after_grpo"]["accuracy"] if out["after_grpo"] else None,
        grpo_max_logprob_diff=out["grpo"]["max_logprob_diff"] if out["grpo"] else None,
        accuracy_after=out["chosen"]["accuracy"],
        first_loss=out["sft"]["first_loss"],
        final_loss=out["sft"]["final_loss"],
        tracking_uri=run.tracking_uri,
    )
    _print_summary(result, run.run_id, run.dashboard_url)
    return result


def _print_summary(r: QuickstartResult, pipeline_run: str, dashboard: str | None) -> None:
    grpo = f" -> {r.accuracy_grpo:.1%} after GRPO" if r.accuracy_grpo is not None else ""
    lines = [
        "done",
        f"  exact match on held-out prompts: {r.accuracy_before:.1%} before SFT -> {r.accuracy_sft:.1%} after SFT{grpo}",
        f"  released (the better one on the validation split): {r.accuracy_after:.1%} on the held-out prompts",
        f"  training loss: {r.first_loss:.3f} -> {r.final_loss:.3f}",
    ]
    lines += [f"  served: {a['question']!r} -> {a['answer']!r} (expected {a['expected']!r})" for a in r.served_answers]
    if not r.served_answers:
        lines += [f"  e.g. {s['prompt']!r} -> {s['completion']!r} (expected {s['answer']!r})" for s in r.eval_samples[:3]]
    lines += [
        f"  MLflow run: {r.run_id}   model: {r.model_uri}   pipeline run: {pipeline_run}",
        f"  MLflow UI:  mlflow ui --backend-store-uri {r.tracking_uri}   (then open http://127.0.0.1:5000)",
    ]
    if dashboard:
        lines.append(f"  Ray dashboard: http://{dashboard}   (while this cluster runs; `ray start --head` keeps one up)")
    console.result("\n".join(lines))


if __name__ == "__main__":
    quickstart.main()
