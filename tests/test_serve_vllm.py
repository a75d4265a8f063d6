"""engine: vllm: ServeConfig -> Ray Serve LLM configs, checked against Ray's own schemas.

No GPU and no vllm here, so nothing is deployed: the translation is checked against the
pydantic models Ray Serve LLM validates its builders' args with. ``ray.serve.llm`` and the
PD builder import vllm, but ``LLMConfig`` lives in a module that does not, so each role's
config is validated with the real ``LLMConfig``; the builders' args models (PDServingArgs,
LLMServingArgs) are read from Ray's source instead (their field names and their checks).
No Ray cluster is started.
"""

from __future__ import annotations

import ast
import filecmp
import inspect
import subprocess
import sys
import types
from pathlib import Path

import pytest
import ray.llm
import yaml

# Ray's own LLMConfig: `ray.serve.llm.LLMConfig` is the same class, but importing ray.serve.llm needs vllm.
from ray.llm._internal.serve.core.configs.llm_config import LLMConfig
from ray.llm._internal.serve.engines.vllm.kv_transfer.factory import BUILTIN_BACKENDS

from mlplat.config import load_config
from mlplat.errors import ConfigError, MlplatError
from mlplat.serve import vllm_backend
from mlplat.serve.config import ServeConfig
from mlplat.serve.vllm_backend import llm_serving_args, pd_serving_args, serve_config, serve_config_yaml

RAY_LLM_SERVE = Path(ray.llm.__file__).parent / "_internal" / "serve"
VLLM_OK = ["engine=vllm", "auth.enabled=false"]  # the least a vllm config says


@pytest.fixture
def model_dir(tmp_path) -> Path:
    """What resolve_model accepts as an HF checkpoint; the translation only needs its path."""
    path = tmp_path / "Qwen-mini"
    path.mkdir()
    (path / "config.json").write_text('{"model_type": "qwen2"}')
    (path / "model.safetensors").write_bytes(b"weights")
    (path / "tokenizer.json").write_text("{}")
    return path


def vllm_cfg(model_dir: Path, *overrides: str) -> ServeConfig:
    return load_config(ServeConfig, None, [f"model={model_dir}", *VLLM_OK, *overrides])


def args_model_fields(source: Path, class_name: str) -> set[str]:
    """The annotated fields of a pydantic model in Ray's source (the module itself imports vllm)."""
    tree = ast.parse(source.read_text())
    cls = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == class_name)
    return {s.target.id for s in cls.body if isinstance(s, ast.AnnAssign) and isinstance(s.target, ast.Name)}


def assert_serve_deployment_options(options: dict) -> None:
    """What `serve.deployment(**options)` and Serve's deployment schema accept (LLMConfig's own check is loose)."""
    from ray import serve
    from ray.serve.schema import DeploymentSchema, RayActorOptionsSchema

    assert set(options) <= set(inspect.signature(serve.deployment).parameters), options
    assert set(options.get("ray_actor_options", {})) <= set(RayActorOptionsSchema.model_fields), options
    DeploymentSchema.model_validate({"name": "x", **options})


def test_pd_translation_validates_with_rays_llm_config(model_dir):
    cfg = vllm_cfg(
        model_dir,
        "vllm.engine_kwargs={tensor_parallel_size: 2, max_model_len: 8192, gpu_memory_utilization: 0.9}",
        "vllm.accelerator_type=H100",
        "vllm.runtime_env.env_vars.UCX_TLS=all",
        "prefill.num_replicas=2",
        "prefill.resources={prefill_node: 1}",
        "decode.num_replicas=3",
        "ingress.num_replicas=2",
    )
    args = pd_serving_args(cfg, model_dir)

    # build_pd_openai_app validates its dict as PDServingArgs: only its fields, each *_config an LLMConfig.
    assert set(args) <= args_model_fields(RAY_LLM_SERVE / "serving_patterns/prefill_decode/builder.py", "PDServingArgs")
    prefill, decode = (LLMConfig.model_validate(args[k]) for k in ("prefill_config", "decode_config"))
    # ... with PDServingArgs' checks: one model id, a kv_transfer_config on both roles.
    assert prefill.model_id == decode.model_id == "Qwen-mini"
    for role, replicas in ((prefill, 2), (decode, 3)):
        assert role.model_loading_config.model_source == str(model_dir)
        assert role.engine_kwargs["kv_transfer_config"] == {"kv_connector": "NixlConnector", "kv_role": "kv_both"}
        assert role.engine_kwargs["tensor_parallel_size"] == 2 and role.engine_kwargs["max_model_len"] == 8192
        assert role.deployment_config["num_replicas"] == replicas
        assert role.accelerator_type == "H100"
        assert role.runtime_env == {"env_vars": {"UCX_TLS": "all"}}
        assert_serve_deployment_options(role.deployment_config)
    assert prefill.deployment_config["ray_actor_options"]["resources"] == {"prefill_node": 1}
    assert "resources" not in decode.deployment_config["ray_actor_options"]
    assert args["ingress_deployment_config"]["num_replicas"] == 2
    assert_serve_deployment_options(args["ingress_deployment_config"])


def test_colocated_translation_validates_and_has_no_kv_transfer(model_dir):
    cfg = vllm_cfg(model_dir, "mode=colocated", "model_name=chat", "colocated.num_replicas=4", "vllm.engine_kwargs.quantization=fp8")
    args = llm_serving_args(cfg, model_dir)

    assert set(args) <= args_model_fields(RAY_LLM_SERVE / "core/ingress/builder.py", "LLMServingArgs")
    [llm] = [LLMConfig.model_validate(c) for c in args["llm_configs"]]
    assert llm.model_id == "chat"
    assert llm.engine_kwargs == {"quantization": "fp8"}  # no kv_transfer_config: one engine does prefill and decode
    assert llm.deployment_config["num_replicas"] == 4
    assert llm.accelerator_type is None
    assert_serve_deployment_options(llm.deployment_config)


@pytest.mark.parametrize("connector", ["NixlConnector", "LMCacheConnectorV1"])
def test_kv_connectors_are_ones_ray_serve_llm_sets_up(model_dir, connector):
    assert connector in BUILTIN_BACKENDS  # else Ray falls back to a default backend without the connector's setup
    cfg = vllm_cfg(model_dir, f"vllm.kv_connector={connector}", "vllm.kv_connector_extra_config={backends: [UCX]}")
    args = pd_serving_args(cfg, model_dir)
    for key in ("prefill_config", "decode_config"):
        kv = LLMConfig.model_validate(args[key]).engine_kwargs["kv_transfer_config"]
        assert kv == {"kv_connector": connector, "kv_role": "kv_both", "kv_connector_extra_config": {"backends": ["UCX"]}}
    # Fresh dicts per role: Ray's builders and connector backends fill in the ones they get.
    assert args["prefill_config"]["engine_kwargs"] is not args["decode_config"]["engine_kwargs"]
    args["prefill_config"]["engine_kwargs"]["kv_transfer_config"]["kv_connector_extra_config"]["x"] = 1
    assert cfg.vllm.kv_connector_extra_config == {"backends": ["UCX"]}


def test_serve_config_yaml_is_a_serve_config_for_the_pd_builder(model_dir):
    from ray.serve.schema import ServeDeploySchema

    cfg = vllm_cfg(model_dir, "app_name=llm", "route_prefix=/llm")
    doc = yaml.safe_load(serve_config_yaml(cfg))
    [app] = ServeDeploySchema.model_validate(doc).applications
    assert (app.name, app.route_prefix, app.import_path) == ("llm", "/llm", "ray.serve.llm:build_pd_openai_app")
    assert app.args == pd_serving_args(cfg, model_dir)

    colocated = yaml.safe_load(serve_config_yaml(vllm_cfg(model_dir, "mode=colocated")))
    assert colocated["applications"][0]["import_path"] == "ray.serve.llm:build_openai_app"

    with pytest.raises(ConfigError, match="engine: vllm"):
        serve_config(load_config(ServeConfig, None, [f"model={model_dir}"]))


def test_registry_uri_resolves_to_the_registered_directory(tracking_uri, model_dir):
    from mlplat.tracking import register_model_dir, start_run

    register_model_dir(start_run("vllm-serving"), model_dir, "qwen-mini", alias="prod")
    cfg = load_config(ServeConfig, None, ["model=models:/qwen-mini@prod", *VLLM_OK])
    args = serve_config(cfg)["applications"][0]["args"]
    loading = LLMConfig.model_validate(args["decode_config"]).model_loading_config
    assert loading.model_id == "qwen-mini"  # the registry name, as the native app serves it
    source = Path(loading.model_source)
    assert source != model_dir and not filecmp.dircmp(source, model_dir).diff_files
    assert sorted(p.name for p in source.iterdir()) == sorted(p.name for p in model_dir.iterdir())


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["engine=vllm"], "overrides: auth: .*set auth.enabled=false"),
        ([*VLLM_OK, "auth.default_rate_limit.requests_per_s=5"], "overrides: auth: .*no rate limits"),
        ([*VLLM_OK, "engine_args.device=cuda"], "overrides: engine_args: .*vllm.engine_kwargs"),
        ([*VLLM_OK, "default_max_tokens=64"], "overrides: default_max_tokens: .*engine: native only"),
        ([*VLLM_OK, "prefill_router=round_robin"], "overrides: prefill_router: .*engine: native only"),
        ([*VLLM_OK, "decode.num_gpus=1"], "overrides: decode: .*tensor_parallel_size.*leave num_gpus at 0"),
        ([*VLLM_OK, "vllm.kv_connector=P2pNcclConnector"], "overrides: vllm.kv_connector: .*'NixlConnector' or 'LMCacheConnectorV1'"),
        ([*VLLM_OK, "mode=colocated", "vllm.kv_connector=LMCacheConnectorV1"], "overrides: vllm: .*mode: pd only"),
        ([*VLLM_OK, "vllm.engine_kwargs.kv_transfer_config={kv_connector: NixlConnector}"],
         "overrides: vllm.engine_kwargs: .*'kv_transfer_config' comes from `vllm.kv_connector`"),
        ([*VLLM_OK, "vllm.engine_kwargs.served_model_name=x"], "overrides: vllm.engine_kwargs: .*comes from `model_name`"),
        ([*VLLM_OK, "vllm.accelerator_type=H300"], "overrides: vllm.accelerator_type: .*did you mean H200"),
        ([*VLLM_OK, "vllm.runtime_env.env_vars.VLLM_NIXL_SIDE_CHANNEL_PORT=5601"], "overrides: vllm.runtime_env: .*must be a string"),
        ([*VLLM_OK, "vllm.tensor_parallel_size=2"], "overrides: vllm.tensor_parallel_size: unknown field"),
        (["engine=native", "vllm.engine_kwargs.tensor_parallel_size=2"], "overrides: vllm: .*engine: vllm only"),
        (["engine=vLLM"], "overrides: engine: .*'native' or 'vllm'"),
    ],
)
def test_bad_vllm_configs_name_the_field(model_dir, overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(ServeConfig, None, [f"model={model_dir}", *overrides])


def test_native_configs_are_unchanged(model_dir):
    native = load_config(ServeConfig, None, [f"model={model_dir}", "engine_args.device=cpu", "default_max_tokens=8", "prefill.num_gpus=1"])
    assert native.engine == "native" and native.auth.enabled is None


@pytest.mark.skipif(vllm_backend.vllm_installed(), reason="vllm is installed: the app builds for real (a GPU node)")
def test_build_app_without_vllm_says_how_to_install_it(model_dir):
    from serve_apps.llm import build_app

    with pytest.raises(MlplatError) as err:
        build_app(vllm_cfg(model_dir))
    assert str(err.value) == "engine: vllm needs the vllm extra: pip install 'mlplat[vllm]' on a GPU node"


@pytest.mark.parametrize("mode, builder", [("pd", "build_pd_openai_app"), ("colocated", "build_openai_app")])
def test_build_app_hands_the_translation_to_ray_serve_llm(model_dir, monkeypatch, mode, builder):
    # What a GPU node runs, with a stand-in for ray.serve.llm (it cannot import without vllm).
    from serve_apps.llm import build_app

    calls = []
    fake = types.ModuleType("ray.serve.llm")
    fake.build_pd_openai_app = lambda args: calls.append(("build_pd_openai_app", args)) or "pd app"
    fake.build_openai_app = lambda args: calls.append(("build_openai_app", args)) or "colocated app"
    monkeypatch.setitem(sys.modules, "ray.serve.llm", fake)
    monkeypatch.setattr(vllm_backend, "vllm_installed", lambda: True)

    cfg = vllm_cfg(model_dir, f"mode={mode}")
    assert build_app(cfg) == f"{mode} app"
    expected = pd_serving_args(cfg, model_dir) if mode == "pd" else llm_serving_args(cfg, model_dir)
    assert calls == [(builder, expected)]


def test_served_name_is_model_name_then_registry_name_then_directory(model_dir):
    # One rule for both engines (ServeConfig.served_name), so clients need not know which one serves.
    assert vllm_cfg(model_dir, "model_name=chat").served_name(model_dir) == "chat"
    assert vllm_cfg(model_dir).model_copy(update={"model": "models:/reverse-sum@prod"}).served_name(model_dir) == "reverse-sum"
    assert vllm_cfg(model_dir).served_name(model_dir) == "Qwen-mini"
    assert pd_serving_args(vllm_cfg(model_dir, "model_name=chat"), model_dir)["decode_config"]["model_loading_config"]["model_id"] == "chat"


def test_translation_imports_neither_vllm_nor_ray_serve_llm(tmp_path):
    code = "import sys, mlplat.serve.vllm_backend; print(sorted({'vllm', 'ray.serve.llm'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_example_in_docs_translates(model_dir):
    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    example = yaml.safe_load(docs.split("`llm-vllm.yaml`", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0])
    cfg = ServeConfig.model_validate({**example, "model": str(model_dir)})
    args = pd_serving_args(cfg, model_dir)
    roles = [LLMConfig.model_validate(args[k]) for k in ("prefill_config", "decode_config")]
    gpus = sum(r.deployment_config["num_replicas"] * r.engine_kwargs["tensor_parallel_size"] for r in roles)
    assert gpus == 8  # as the docs say
