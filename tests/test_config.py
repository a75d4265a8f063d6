"""Typed configs reject bad input with the file and field named; the CLI prints one line."""

import os
import subprocess

import pytest
from conftest import MLPLAT

from mlplat.config import load_config, validate
from mlplat.errors import ConfigError
from train_apps.sft import SFTConfig


def write(tmp_path, text: str):
    path = tmp_path / "sft.yaml"
    path.write_text(text)
    return path


def test_valid_config_with_overrides(tmp_path):
    path = write(tmp_path, "model: /m\ndata:\n  path: /d.jsonl\noptim:\n  lr: 0.001\n")
    cfg = load_config(SFTConfig, path, ["optim.lr=3e-4", "max_steps=7"])
    assert cfg.optim.lr == 3e-4 and cfg.max_steps == 7 and cfg.data.path == "/d.jsonl"


def test_unknown_field_is_named(tmp_path):
    path = write(tmp_path, "model: /m\ndata:\n  path: /d.jsonl\noptim:\n  lerning_rate: 0.1\n")
    with pytest.raises(ConfigError, match=r"sft.yaml: optim.lerning_rate: unknown field"):
        load_config(SFTConfig, path)


def test_mistyped_field_is_named(tmp_path):
    path = write(tmp_path, "model: /m\ndata:\n  path: /d.jsonl\nmax_steps: lots\n")
    with pytest.raises(ConfigError, match=r"sft.yaml: max_steps: Input should be a valid integer"):
        load_config(SFTConfig, path)


def test_missing_required_field_is_named(tmp_path):
    with pytest.raises(ConfigError, match=r"data: Field required"):
        load_config(SFTConfig, write(tmp_path, "model: /m\n"))


@pytest.mark.parametrize(
    "text, message",
    [("model: [unclosed\n", "not valid YAML"), ("- a\n- b\n", "expected a mapping")],
)
def test_bad_yaml(tmp_path, text, message):
    with pytest.raises(ConfigError, match=message):
        load_config(SFTConfig, write(tmp_path, text))


def test_bad_override_syntax():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(SFTConfig, None, ["max_steps"])


CLI_ERRORS = [
    (["train", "sft", "--config", "/nonexistent.yaml"], "/nonexistent.yaml: config file not found"),
    (["train", "sft", "--set", "model=/m", "--set", "data.path=/d", "--set", "max_stepz=3"], "max_stepz: unknown field"),
    (["eval", "--model", "/nonexistent", "--data", "x.jsonl"], "/nonexistent: model directory not found"),
    (["model", "resolve", "models:/bad uri"], "expected models:/NAME/VERSION"),
]


@pytest.fixture(scope="module")
def cli_error_runs() -> dict[tuple, subprocess.CompletedProcess]:
    """Every case's CLI process, started at once: each is one thread that mostly imports, so two cores run them side by side."""
    procs = {tuple(args): subprocess.Popen([MLPLAT, *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for args, _ in CLI_ERRORS}
    runs = {}
    try:
        for args, p in procs.items():
            out, err = p.communicate(timeout=120)
            runs[args] = subprocess.CompletedProcess(args, p.returncode, out, err)
    finally:  # one that hangs fails the module; none is left running behind it
        for p in procs.values():
            p.kill()
    return runs


@pytest.mark.parametrize("args, message", CLI_ERRORS)
def test_cli_errors_are_one_line(cli_error_runs, args, message):
    out = cli_error_runs[tuple(args)]
    assert out.returncode == 2
    assert "Traceback" not in out.stderr
    lines = [line for line in out.stderr.splitlines() if line.startswith("mlplat: error:")]
    assert len(lines) == 1 and message in lines[0], out.stderr


@pytest.mark.slow  # a fresh interpreter runs the CLI end to end: `make test`, not the fast lane
def test_a_wrong_data_path_fails_before_a_cluster_or_a_run_starts(tiny_model, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    args = ["train", "sft", "--set", f"model={tiny_model}", "--set", f"data.path={tmp_path}/missing.jsonl"]
    out = subprocess.run([MLPLAT, *args], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert out.returncode == 2 and f"mlplat: error: {tmp_path}/missing.jsonl: data path not found" in out.stderr, out.stderr
    # Nothing was started or written for it: no local Ray cluster, no MLflow store with a failed run.
    assert "Started a local Ray instance" not in out.stderr and not (tmp_path / "mlflow.db").exists()


@pytest.mark.parametrize("recipe", ["reward_model", "dpo", "grpo"])
def test_post_training_recipes_check_their_data_before_starting_a_run(recipe, tiny_model, tmp_path):
    from mlplat import recipes
    from mlplat.errors import DataError

    entry = recipes.load(recipe)  # through the mlplat.recipes entry points, as `mlplat train` finds it
    cfg = entry.config(model=str(tiny_model), data={"path": str(tmp_path / "missing.jsonl")})
    with pytest.raises(DataError, match="missing.jsonl: data path not found"):
        entry.run(cfg, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", work_dir=tmp_path)
    assert not (tmp_path / "mlflow.db").exists()  # no MLflow run was started for it


@pytest.mark.parametrize(
    "train_state, message",
    [(None, "is not a training checkpoint directory"), (b"not a torch file", "cannot read .*train_state.pt \\(UnpicklingError")],
)
def test_resume_from_a_directory_that_is_no_training_checkpoint_is_refused_first(train_state, message, tiny_model, demo_data, tmp_path):
    from mlplat.errors import CheckpointError
    from train_apps.sft import SFTConfig, run_sft

    checkpoint = tmp_path / "checkpoint"
    checkpoint.mkdir()
    if train_state is not None:
        (checkpoint / "train_state.pt").write_bytes(train_state)
    cfg = SFTConfig(model=str(tiny_model), data={"path": str(demo_data.sft)}, resume_from=str(checkpoint))
    with pytest.raises(CheckpointError, match=f"resume_from: .*{message}"):
        run_sft(cfg, tracking_uri=f"sqlite:///{tmp_path / 'mlflow.db'}", work_dir=tmp_path)
    assert not (tmp_path / "mlflow.db").exists()


def test_cli_bad_arguments_are_usage_errors():
    out = subprocess.run([MLPLAT, "train", "nonsense"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "invalid choice" in out.stderr and "Traceback" not in out.stderr


def test_readme_recipe_configs_validate():
    """Every recipe YAML example in the README and docs/training.md validates as its recipe's config (docs that cannot drift).

    A block is another recipe's config when its first line names it (``# grpo.yaml``, ``# ppo.yaml``), else SFT's."""
    import re

    import yaml
    from conftest import REPO_ROOT

    from train_apps.grpo import GRPOConfig
    from train_apps.ppo import PPOConfig

    docs = (REPO_ROOT / "README.md").read_text() + (REPO_ROOT / "docs" / "training.md").read_text()
    texts = re.findall(r"```yaml\n(.*?)```", docs, re.S)
    recipes = [(t, yaml.safe_load(t)) for t in texts]
    recipes = [(t, b) for t, b in recipes if isinstance(b, dict) and "model" in b and "data" in b]
    schemas = {"# grpo.yaml": GRPOConfig, "# ppo.yaml": PPOConfig}
    validated: dict[type, list] = {}
    for text, block in recipes:
        schema = next((s for first, s in schemas.items() if text.startswith(first)), SFTConfig)
        validated.setdefault(schema, []).append(schema.model_validate(block))
    sft = validated.get(SFTConfig, [])
    assert len(validated.get(GRPOConfig, [])) >= 1 and len(validated.get(PPOConfig, [])) >= 1 and len(sft) >= 2
    assert {c.parallel.strategy for c in sft} == {"ddp", "fsdp"}


@pytest.mark.parametrize(
    "overrides, message",
    [
        ({"lora": {"r": 0}}, "lora.r"),
        ({"parallel": {"strategy": "zero3"}}, "parallel.strategy"),
        ({"grad_accum_steps": 0}, "grad_accum_steps"),
        ({"lora": {"target_modules": []}}, "lora.target_modules"),
        ({"max_steps": 4, "profile": {"steps": 3}}, "profile: wait_steps"),
    ],
)
def test_bad_sft_training_options_name_the_field(overrides, message):
    with pytest.raises(ConfigError, match=message.replace(".", r"\.")):
        validate(SFTConfig, {"model": "/m", "data": {"path": "/d.jsonl"}, **overrides})
