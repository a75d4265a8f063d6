"""LoRA adapters served by name through the PD app (prefill and decode both apply them), one from the MLflow registry
(a version holding only the adapter), with the real `openai` client over real HTTP on the local Ray cluster."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from ray import serve
from test_engine_lora import foreign_adapter, make_adapter

from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
from mlplat.errors import CheckpointError
from mlplat.serve.config import LoRAServingConfig, ServeConfig
from mlplat.tracking import register_adapter_dir, resolve_adapter, start_run
from serve_apps.llm import build_app

ENGINE = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4, "max_waiting": 8}
SMALL = {"num_cpus": 0.2}
PROMPTS = ["12 + 34 = ", "7 + 8 = ", "100 + 250 = "]


@pytest.fixture(scope="module")
def lora_app(ray_cluster, tiny_model, tmp_path_factory, new_mlflow_store):
    root = tmp_path_factory.mktemp("lora_serving")
    a1 = make_adapter(tiny_model, root / "a1", seed=11, r=8, merged_dir=root / "a1-merged")
    a2 = make_adapter(tiny_model, root / "a2", seed=12, r=16)
    uri = new_mlflow_store(root / "mlflow.db")
    mp = pytest.MonkeyPatch()
    mp.setenv("MLFLOW_TRACKING_URI", uri)
    mp.setenv("MLPLAT_API_KEYS", "")
    # each registered alone by its own run, with the base model it was trained on (as the SFT recipe's lora.register_as: adapter does)
    for adapter, name, base in ((a1, "tiny-a1", str(tiny_model)), (a2, "other-a2", "models:/some-other-base@prod")):
        register_adapter_dir(start_run("lora-serving", tracking_uri=uri), adapter, name, base_model=base, alias="prod", tracking_uri=uri)
    adapters = {"a1": "models:/tiny-a1@prod", "a2": str(a2), "foreign": str(foreign_adapter(a1, root / "foreign")),
                "other-base": "models:/other-a2@prod"}  # fmt: skip
    cfg = ServeConfig(model=str(tiny_model), model_name="tiny", mode="pd", engine_args=ENGINE, prefill=SMALL, decode=SMALL, ingress=SMALL,
                      lora=LoRAServingConfig(max_loras=2, adapters=adapters), app_name="lora", route_prefix="/lora")  # fmt: skip
    serve.run(build_app(cfg), name="lora", route_prefix="/lora")
    yield {"client": openai.OpenAI(base_url="http://127.0.0.1:8000/lora/v1", api_key="unused", max_retries=0),
           "merged": root / "a1-merged"}  # fmt: skip
    serve.delete("lora")
    mp.undo()


def complete(client: openai.OpenAI, model: str, prompt: str) -> str:
    return client.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0).choices[0].text


@pytest.fixture(scope="module")
def expected(lora_app, tiny_model):
    """Greedy texts of the base model and of a1 merged into it by peft, from the engine in this process."""

    def texts(model) -> list[str]:
        engine = LLMEngine(EngineConfig(model=str(model), **ENGINE))
        ids = [engine.tokenizer.encode(p) for p in PROMPTS]  # as the completions route tokenizes
        return [o.outputs[0].text for o in engine.generate(ids, SamplingParams(temperature=0, max_tokens=8))]

    return {"tiny": texts(tiny_model), "a1": texts(lora_app["merged"])}


@pytest.mark.slow
def test_adapters_by_name_in_a_mixed_batch_equal_the_merged_model(lora_app, expected):
    client = lora_app["client"]
    models = client.models.list().data
    assert [(m.id, getattr(m, "parent", None)) for m in models] == [("tiny", None), ("a1", "tiny"), ("a2", "tiny"), ("foreign", "tiny")]
    jobs = [(m, i) for i in range(len(PROMPTS)) for m in ("tiny", "a1", "a2")]
    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: the engines batch base and adapter requests together
        texts = dict(zip(jobs, pool.map(lambda job: complete(client, job[0], PROMPTS[job[1]]), jobs)))
    assert [texts[("a1", i)] for i in range(len(PROMPTS))] == expected["a1"]  # the registry's adapter == its merged checkpoint
    assert [texts[("tiny", i)] for i in range(len(PROMPTS))] == expected["tiny"]
    assert any(texts[("a2", i)] != texts[("tiny", i)] for i in range(len(PROMPTS)))
    response = client.completions.create(model="a1", prompt=PROMPTS[0], max_tokens=8, temperature=0)
    assert response.model == "a1"
    stream = client.chat.completions.create(model="a2", messages=[{"role": "user", "content": "1 + 2"}], max_tokens=4, stream=True)
    assert sum(1 for chunk in stream if chunk.choices and chunk.choices[0].delta.content is not None) >= 1


@pytest.mark.slow
def test_unknown_model_is_404_and_an_adapter_for_another_base_is_400(lora_app):
    client = lora_app["client"]
    with pytest.raises(openai.NotFoundError, match="not served here"):
        complete(client, "no-such-adapter", PROMPTS[0])
    for name in ("foreign", "other-base"):  # shapes that do not fit (the engine's check); the registry's base model (the ingress's)
        with pytest.raises(openai.BadRequestError, match="another base model") as err:
            complete(client, name, PROMPTS[0])
        assert err.value.body["param"] == "model", name
    assert complete(client, "a1", PROMPTS[1])  # the app lives on


@settings(max_examples=25, deadline=None)
@given(st.dictionaries(st.text(min_size=0, max_size=6), st.text(min_size=0, max_size=6), max_size=3),
       st.integers(min_value=-2, max_value=80), st.integers(min_value=-2, max_value=300),
       st.none() | st.integers(min_value=-2, max_value=100))  # fmt: skip
def test_property_lora_section_is_validated_at_the_edge(adapters, max_loras, max_lora_rank, max_cpu_loras):
    """Any lora section is either a valid config or a ValidationError naming the field; never something in between."""
    try:
        cfg = ServeConfig(model="m", lora={"adapters": adapters, "max_loras": max_loras, "max_lora_rank": max_lora_rank,
                                           "max_cpu_loras": max_cpu_loras})  # fmt: skip
    except ValidationError as err:
        assert all(e["loc"][0] == "lora" for e in err.errors())
        return
    assert cfg.lora.max_loras >= 1 and cfg.lora.max_lora_rank >= 1
    assert cfg.lora.max_cpu_loras is None or cfg.lora.max_cpu_loras >= cfg.lora.max_loras
    assert all(name.strip() and source.strip() for name, source in cfg.lora.adapters.items())


def test_resolve_adapter_refuses_a_merged_checkpoint(tiny_model):
    with pytest.raises(CheckpointError, match="not a LoRA adapter.*merged model"):
        resolve_adapter(str(tiny_model))


def test_the_docs_examples_validate():
    import re
    from pathlib import Path

    import yaml

    from mlplat.train.lora import LoRAConfig

    section = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text().split("## Serving LoRA adapters", 1)[1]
    sft, serving = (yaml.safe_load(block) for block in re.findall(r"```yaml\n(.*?)```", section.split("\n## ", 1)[0], re.S))
    assert LoRAConfig.model_validate(sft["lora"]).register_as == "adapter"
    assert set(ServeConfig.model_validate(serving).lora.adapters) == {"support", "sql"}
