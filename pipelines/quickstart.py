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


class QuickstartResult(BaseModel):
    run_id: str
    model_uri: str
    accuracy_before: float
    accuracy_after: float
    first_loss: float
    final_loss: float
    tracking_uri: str


def run_quickstart(cfg: QuickstartConfig = QuickstartConfig(), address: str | None = None) -> QuickstartResult:
    workdir = Path(cfg.workdir).resolve()
    tracking_uri = default_tracking_uri()

    print(f"[1/5] demo data -> {workdir / 'data'}")
    paths = write_demo_data(workdir / "data", cfg.data)

    print(f"[2/5] tiny model -> {workdir / 'models' / 'base'}")
    base_dir = build_tiny_model(workdir / "models" / "base", tokenizer_corpus(paths.sft), cfg.model)
    before = evaluate_exact_match(base_dir, paths.eval, limit=cfg.eval_limit)
    print(f"      exact match before SFT: {before.accuracy:.1%} ({before.correct}/{before.total})")

    print(f"[3/5] SFT on Ray Train ({cfg.num_workers} workers, {cfg.max_steps} steps)")
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
    print(f"[4/5] eval of {model_uri} (version {sft.model_version.version})")
    after = evaluate_exact_match(resolve_model(model_uri, tracking_uri=tracking_uri), paths.eval, limit=cfg.eval_limit)
    RunLogger(sft.run_id, tracking_uri).log_metrics(
        {"eval.exact_match_before": before.accuracy, "eval.exact_match": after.accuracy}
    )

    result = QuickstartResult(
        run_id=sft.run_id,
        model_uri=model_uri,
        accuracy_before=before.accuracy,
        accuracy_after=after.accuracy,
        first_loss=sft.first_loss,
        final_loss=sft.final_loss,
        tracking_uri=tracking_uri,
    )
    _print_summary(result, after.samples, dashboard_url)
    return result


def _print_summary(r: QuickstartResult, samples: list[dict], dashboard: str | None) -> None:
    print("[5/5] done")
    print(f"  exact match on held-out prompts: {r.accuracy_before:.1%} before SFT -> {r.accuracy_after:.1%} after")
    print(f"  training loss: {r.first_loss:.3f} -> {r.final_loss:.3f}")
    for s in samples[:3]:
        print(f"  e.g. {s['prompt']!r} -> {s['completion']!r} (expected {s['answer']!r})")
    print(f"  MLflow run: {r.run_id}   model: {r.model_uri}")
    print(f"  MLflow UI:  mlflow ui --backend-store-uri {r.tracking_uri}   (then open http://127.0.0.1:5000)")
    if dashboard:
        print(f"  Ray dashboard: http://{dashboard}   (while this cluster runs; `ray start --head` keeps one up)")
