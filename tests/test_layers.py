"""The import layering of docs/design.md, as contracts (.importlinter) that the suite enforces.

Apps (train_apps, serve_apps, pipelines) sit on mlplat, and mlplat reaches them only from the CLI's
dispatch; nothing imports the `mlplat` command; no two sibling packages or modules import each other,
however indirectly. Recipes register through the `mlplat.recipes` entry points, not a table in the CLI.
"""

import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import MLPLAT, REPO_ROOT

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def test_import_contracts_hold():
    assert LINT_IMPORTS.exists(), "lint-imports missing: pip install -e '.[dev]' (import-linter)"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO_ROOT / "platform"), str(REPO_ROOT)])}
    out = subprocess.run([str(LINT_IMPORTS), "--no-cache"], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
    assert "0 broken" in out.stdout


def test_recipes_are_registered_entry_points():
    from mlplat import recipes

    names = set(recipes.registered())
    assert {"sft", "reward_model", "dpo", "grpo", "ppo"} <= names, "reinstall: pip install -e . (entry points in pyproject.toml)"
    sft = recipes.load("sft")
    from train_apps.sft import SFTConfig, run_sft

    assert (sft.name, sft.config, sft.run) == ("sft", SFTConfig, run_sft)
    out = subprocess.run([MLPLAT, "train", "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "Supervised fine-tuning" in out.stdout and "grpo" in out.stdout, out.stdout


@pytest.mark.slow  # a fresh interpreter runs the CLI end to end: `make test`, not the fast lane
def test_recipe_module_main_gives_the_cli_one_line_errors(tmp_path):
    out = subprocess.run([sys.executable, "-m", "train_apps.sft", "--config", "/nonexistent.yaml"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert out.stderr.strip().splitlines()[-1] == "mlplat: error: /nonexistent.yaml: config file not found", out.stderr


@pytest.mark.slow  # a fresh interpreter runs the CLI end to end: `make test`, not the fast lane
def test_pipeline_module_main_gives_the_cli_one_line_errors(tmp_path):
    out = subprocess.run([sys.executable, "-m", "pipelines.quickstart", "--param", "nonsense=1"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "mlplat: error:" in out.stderr and "unknown parameter 'nonsense'" in out.stderr, out.stderr
