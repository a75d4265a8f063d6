"""The quickstart: the whole platform on embedded defaults, in one command.

    demo data -> tiny Llama (HF format, local BPE tokenizer) -> eval before
    -> SFT on Ray Train (2 DDP workers) -> MLflow run + registered model version
    -> eval of the registered version (resolved from models:/) -> summary

``make quickstart`` or ``mlplat quickstart [--set max_steps=800]``.
"""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel

from mlplat.config import Config
from mlplat.data.demo import DemoDataConfig, tokenizer_corpus, write_demo_data
from mlplat.data.sft import SFTDataConfig
from mlplat.evaluation import evaluate_exact_match
from mlplat.models import TinyModelConfig, build_tiny_model
from mlplat.runtime import init_ray
from mlplat.tracking import RunLogger, default_tracking_uri, resolve_model
from mlplat.train.optim import OptimizerConfig
from train_apps.sft import SFTConfig, run_sft


class QuickstartConfig(Config):
    workdir: str = "quickstart"
    data: DemoDataConfig = DemoDataConfig()
    model: TinyModelConfig = TinyModelConfig()
    optim: OptimizerConfig = OptimizerConfig()
    # Calibrated on 2 CPU cores: ~60% exact match, leaving room for post-training.
    max_steps: int = 600
    num_workers: int = 2
    batch_size_per_worker: int = 32
    eval_limit: int = 500
    registered_model: str = "quickstart-tiny"
    alias: str = "quickstart"
    serve: bool = True  # end by serving the registered version (PD) and asking it through the openai client


class QuickstartResult(BaseModel):
    run_id: str
    served_answers: list[dict] = []
    eval_samples: list[dict] = []  # the first eval completions (transformers generate), to compare
    model_uri: str
    accuracy_before: float
    accuracy_after: float
    first_loss: float
    final_loss: float
    tracking_uri: str


def run_quickstart(cfg: QuickstartConfig = QuickstartConfig(), address: str | None = None) -> QuickstartResult:
    workdir = Path(cfg.workdir).resolve()
    tracking_uri = default_tracking_uri()

    print(f"[1/6] demo data -> {workdir / 'data'}")
    paths = write_demo_data(workdir / "data", cfg.data)

    print(f"[2/6] tiny model -> {workdir / 'models' / 'base'}")
    base_dir = build_tiny_model(workdir / "models" / "base", tokenizer_corpus(paths.sft), cfg.model)
    before = evaluate_exact_match(base_dir, paths.eval, limit=cfg.eval_limit)
    print(f"      exact match before SFT: {before.accuracy:.1%} ({before.correct}/{before.total})")

    print(f"[3/6] SFT on Ray Train ({cfg.num_workers} workers, {cfg.max_steps} steps)")
    dashboard_url = init_ray(address, cfg.num_workers)
    sft = run_sft(
        SFTConfig(
            model=str(base_dir),
            data=SFTDataConfig(path=str(paths.sft)),
            optim=cfg.optim,
            max_steps=cfg.max_steps,
            num_workers=cfg.num_workers,
            batch_size_per_worker=cfg.batch_size_per_worker,
            storage_path=str(workdir / "ray_train"),
            experiment="mlplat-quickstart",
            run_name="quickstart-sft",
            registered_model=cfg.registered_model,
            registered_alias=cfg.alias,
        ),
        tracking_uri=tracking_uri,
        work_dir=workdir / "outputs",
    )

    model_uri = f"models:/{cfg.registered_model}@{cfg.alias}"
    print(f"[4/6] eval of {model_uri} (version {sft.model_version.version})")
    after = evaluate_exact_match(resolve_model(model_uri, tracking_uri=tracking_uri), paths.eval, limit=cfg.eval_limit)
    RunLogger(sft.run_id, tracking_uri).log_metrics(
        {"eval.exact_match_before": before.accuracy, "eval.exact_match": after.accuracy}
    )

    answers = _serve_and_ask(model_uri, paths.eval) if cfg.serve else []
    result = QuickstartResult(
        run_id=sft.run_id,
        served_answers=answers,
        eval_samples=after.samples,
        model_uri=model_uri,
        accuracy_before=before.accuracy,
        accuracy_after=after.accuracy,
        first_loss=sft.first_loss,
        final_loss=sft.final_loss,
        tracking_uri=tracking_uri,
    )
    _print_summary(result, after.samples, dashboard_url)
    return result


def _serve_and_ask(model_uri: str, eval_path, questions: int = 3) -> list[dict]:
    """Deploy the registered version as the PD-disaggregated OpenAI app and ask it a few questions."""
    import json

    import openai
    from ray import serve

    from mlplat.serve.config import ReplicaConfig, ServeConfig
    from serve_apps.llm import run as run_app

    print(f"[5/6] serving {model_uri}: OpenAI API, prefill and decode on separate Serve replicas")
    half = ReplicaConfig(num_cpus=0.5)
    cfg = ServeConfig(model=model_uri, mode="pd", prefill=half, decode=half, ingress=half, app_name="quickstart", route_prefix="/quickstart")
    url = run_app(cfg)
    client = openai.OpenAI(base_url=url, api_key="quickstart", max_retries=0)
    answers = []
    try:
        with open(eval_path) as f:
            rows = [json.loads(next(f)) for _ in range(questions)]
        for row in rows:
            model = client.models.list().data[0].id
            reply = client.chat.completions.create(model=model, messages=row["messages"], max_tokens=8, temperature=0)
            answers.append({"question": row["messages"][-1]["content"], "answer": reply.choices[0].message.content, "expected": row["answer"]})
            print(f"      {answers[-1]['question']!r} -> {answers[-1]['answer']!r} (expected {row['answer']!r})")
    finally:
        serve.delete(cfg.app_name)
    return answers


def _print_summary(r: QuickstartResult, samples: list[dict], dashboard: str | None) -> None:
    print("[6/6] done")
    print(f"  exact match on held-out prompts: {r.accuracy_before:.1%} before SFT -> {r.accuracy_after:.1%} after")
    print(f"  training loss: {r.first_loss:.3f} -> {r.final_loss:.3f}")
    if not r.served_answers:
        for s in samples[:3]:
            print(f"  e.g. {s['prompt']!r} -> {s['completion']!r} (expected {s['answer']!r})")
    print(f"  MLflow run: {r.run_id}   model: {r.model_uri}")
    print(f"  MLflow UI:  mlflow ui --backend-store-uri {r.tracking_uri}   (then open http://127.0.0.1:5000)")
    if dashboard:
        print(f"  Ray dashboard: http://{dashboard}   (while this cluster runs; `ray start --head` keeps one up)")
