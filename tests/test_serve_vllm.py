"""engine: vllm: ServeConfig -> Ray Serve LLM configs, checked against Ray's own schemas.

No GPU and no vllm here, so nothing is deployed: the translation is checked against the
pydantic models Ray Serve LLM validates its builders' args with. Each role's config is validated
with Ray's ``LLMConfig``: the public ``ray.serve.llm.LLMConfig`` where vllm is installed;
without vllm ``import ray.serve.llm`` fails, and the class it subclasses unchanged is imported
from where Ray defines it (no public path to it without vllm). The builders' args models
(PDServingArgs, LLMServingArgs) and the KV connector registry are read from Ray's source
instead. No Ray cluster is started.
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
from ray.serve.config import AutoscalingConfig

from mlplat.config import load_config
from mlplat.errors import ConfigError, MlplatError
from mlplat.serve import vllm_backend
from mlplat.serve.config import ServeConfig
from mlplat.serve.vllm_backend import llm_serving_args, pd_serving_args, serve_config, serve_config_yaml

try:  # Ray Serve LLM's public API (installed with the vllm extra)
    from ray.serve.llm import LLMConfig
except ImportError:  # ray.serve.llm needs vllm; its LLMConfig is this class, subclassed unchanged
    from ray.llm._internal.serve.core.configs.llm_config import LLMConfig

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


def source_constant(source: Path, name: str):
    """A module-level literal of Ray's source, read without importing the module (private, and it imports vllm's kin)."""
    tree = ast.parse(source.read_text())
    [value] = [n.value for n in tree.body if isinstance(n, ast.Assign) and any(getattr(t, "id", None) == name for t in n.targets)]
    return ast.literal_eval(value)


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


def test_autoscaled_pools_hand_their_autoscaling_config_to_ray_serve_llm(model_dir):
    cfg = vllm_cfg(model_dir, "prefill.autoscaling={min_replicas: 1, max_replicas: 4, target_ongoing_requests: 8}",
                   "decode.autoscaling={min_replicas: 2, max_replicas: 8, target_ongoing_requests: 32, downscale_delay_s: 300}")
    args = pd_serving_args(cfg, model_dir)
    for key, (low, high, target) in {"prefill_config": (1, 4, 8), "decode_config": (2, 8, 32)}.items():
        deployment = LLMConfig.model_validate(args[key]).deployment_config
        assert "num_replicas" not in deployment  # else Ray Serve LLM drops the autoscaling config
        # Every field written out, so Ray Serve LLM's default target (1e9 ongoing requests) never fills in.
        assert set(deployment["autoscaling_config"]) >= {"target_ongoing_requests", "min_replicas", "max_replicas"}
        scaling = AutoscalingConfig.model_validate(deployment["autoscaling_config"])
        assert (scaling.min_replicas, scaling.max_replicas, scaling.target_ongoing_requests) == (low, high, target)
        assert_serve_deployment_options(deployment)
    assert AutoscalingConfig.model_validate(args["decode_config"]["deployment_config"]["autoscaling_config"]).downscale_delay_s == 300
    assert args["ingress_deployment_config"]["num_replicas"] == 1

    colocated = llm_serving_args(vllm_cfg(model_dir, "mode=colocated", "colocated.autoscaling={max_replicas: 3}"), model_dir)
    [llm] = [LLMConfig.model_validate(c) for c in colocated["llm_configs"]]
    assert llm.deployment_config["autoscaling_config"]["max_replicas"] == 3 and "num_replicas" not in llm.deployment_config


@pytest.mark.parametrize("mode", ["pd", "colocated"])
def test_lora_maps_to_vllms_slots_and_ray_serve_llms_adapter_store(model_dir, mode):
    cfg = vllm_cfg(model_dir, f"mode={mode}", "lora={max_loras: 6, max_lora_rank: 32, max_cpu_loras: 12}",
                   "vllm.dynamic_lora_loading_path=s3://bucket/adapters/")
    args = pd_serving_args(cfg, model_dir) if mode == "pd" else llm_serving_args(cfg, model_dir)
    roles = [args["prefill_config"], args["decode_config"]] if mode == "pd" else args["llm_configs"]
    for role in map(LLMConfig.model_validate, roles):  # pd: the same store on both legs, as PDServingArgs requires
        assert (role.lora_config.dynamic_lora_loading_path, role.lora_config.max_num_adapters_per_replica) == ("s3://bucket/adapters", 6)
        assert {k: role.engine_kwargs[k] for k in ("enable_lora", "max_loras", "max_lora_rank", "max_cpu_loras")} == {
            "enable_lora": True, "max_loras": 6, "max_lora_rank": 32, "max_cpu_loras": 12}  # fmt: skip
    assert "lora_config" not in llm_serving_args(vllm_cfg(model_dir, "mode=colocated"), model_dir)["llm_configs"][0]


def test_the_vllm_extra_is_ray_llm_at_the_ray_the_suite_runs():
    from importlib.metadata import requires

    from packaging.requirements import Requirement

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"]
    [ray_pin] = [r for r in map(Requirement, project["dependencies"]) if r.name == "ray"]
    assert str(ray_pin.specifier) == f"=={ray.__version__}"  # pinned to the Ray installed here, the one tested
    [extra] = map(Requirement, project["optional-dependencies"]["vllm"])
    assert (extra.name, extra.extras, extra.specifier) == ("ray", {"llm"}, ray_pin.specifier)
    # ray[llm] pins one vLLM, the one that Ray release is built and tested with
    [vllm] = [r for r in map(Requirement, requires("ray")) if r.name == "vllm" and r.marker and r.marker.evaluate({"extra": "llm"})]
    assert str(vllm.specifier).startswith("=="), vllm


@pytest.mark.parametrize("connector", ["NixlConnector", "LMCacheConnectorV1"])
def test_kv_connectors_are_ones_ray_serve_llm_sets_up(model_dir, connector):
    builtin = source_constant(RAY_LLM_SERVE / "engines/vllm/kv_transfer/factory.py", "BUILTIN_BACKENDS")
    assert connector in builtin  # else Ray falls back to a default backend without the connector's setup
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
        ([*VLLM_OK, "ingress.autoscaling={max_replicas: 2}"], "overrides: ingress: .*set ingress.num_replicas instead"),
        ([*VLLM_OK, "lora={max_loras: 2}"], "overrides: lora: .*set vllm.dynamic_lora_loading_path"),
        ([*VLLM_OK, "lora.adapters.support=models:/support@prod", "vllm.dynamic_lora_loading_path=s3://b/a"],
         "overrides: lora: .*reads no models:/ URIs or local directories"),
        ([*VLLM_OK, "vllm.dynamic_lora_loading_path=/mnt/adapters", "lora={}"], "overrides: vllm.dynamic_lora_loading_path: .*s3://"),
        ([*VLLM_OK, "vllm.dynamic_lora_loading_path=gs://b/a"], "dynamic_lora_loading_path serves adapters only with a lora section"),
        ([*VLLM_OK, "vllm.engine_kwargs.max_loras=8"], "overrides: vllm.engine_kwargs: .*'max_loras' comes from `lora.max_loras`"),
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


def test_mlplat_imports_no_private_ray_llm_module():
    # Public APIs only (ray.serve.llm, ray.serve.config, ray.util.accelerators); Ray's private modules change between releases.
    root = Path(__file__).resolve().parents[1]
    private = []
    for path in [*(root / "platform").rglob("*.py"), *(root / "serve_apps").rglob("*.py")]:
        if "ray.llm" not in (text := path.read_text()):
            continue
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ImportFrom):
                modules = [node.module or ""]
            elif isinstance(node, ast.Import):
                modules = [alias.name for alias in node.names]
            else:
                continue
            private += [(path.relative_to(root), m) for m in modules if m.startswith("ray.llm._internal")]
    assert not private


def test_the_example_in_docs_translates(model_dir):
    docs = (Path(__file__).resolve().parents[1] / "docs" / "serving.md").read_text()
    example = yaml.safe_load(docs.split("`llm-vllm.yaml`", 1)[1].split("```yaml\n", 1)[1].split("```", 1)[0])
    cfg = ServeConfig.model_validate({**example, "model": str(model_dir)})
    args = pd_serving_args(cfg, model_dir)
    roles = [LLMConfig.model_validate(args[k]) for k in ("prefill_config", "decode_config")]
    gpus = sum(r.deployment_config["num_replicas"] * r.engine_kwargs["tensor_parallel_size"] for r in roles)
    assert gpus == 8  # as the docs say
