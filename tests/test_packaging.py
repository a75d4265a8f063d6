"""Install layout: `platform/` is a source root, never the stdlib-shadowing `platform` package."""

import re
import subprocess
import sys

import pytest
from conftest import MLPLAT, REPO_ROOT


def run_python(code: str, cwd) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=120)


def test_stdlib_platform_still_works_from_repo_root():
    assert not (REPO_ROOT / "platform" / "__init__.py").exists()
    out = run_python("import platform; print(platform.system()); import ray; print(ray.__version__)", REPO_ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[0] in {"Linux", "Darwin", "Windows"}


@pytest.mark.slow  # a fresh interpreter imports every package (~5 s): `make test`, not the fast lane
def test_installed_packages_import_from_anywhere(tmp_path):
    out = run_python(
        "import mlplat, train_apps, serve_apps, pipelines, train_apps.sft, pipelines.quickstart; print(mlplat.__file__)",
        tmp_path,
    )
    assert out.returncode == 0, out.stderr
    assert "platform/mlplat/__init__.py" in out.stdout


def test_heavy_libraries_import_only_when_used(tmp_path):
    # `mlplat model resolve` and the CLI's checkpoint errors load no model: they need neither torch nor
    # transformers (~5 s); a recipe's config (what `mlplat train` checks before it starts anything)
    # needs no transformers (~3 s); training without LoRA needs no peft (~4 s).
    heavy = "sorted({'torch', 'transformers', 'peft'} & set(sys.modules))"
    # An engine process (every Serve replica, rollout actor) starts without torch's compiler stack (~2.5 s of
    # imports on 2 cores): FlexAttention compiles only where it is chosen, structured outputs use no torch.compile.
    compiler = "sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules)"
    out = run_python(f"import sys, mlplat.models, mlplat.tracking; print({heavy}); import train_apps.sft; print({heavy}); "
                     f"import mlplat.engine; print({compiler})", tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines() == ["[]", "['torch']", "[]"], out.stdout


def test_cli_help_imports_neither_ray_torch_nor_mlflow(tmp_path):
    # `mlplat --help` (and a typo's usage error) answers at once: the heavy stacks load with the command that needs them.
    code = (
        "import sys\nfrom mlplat.cli import main\ntry:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'ray', 'torch', 'mlflow', 'transformers'}))"
    )
    out = run_python(code, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout.splitlines()[-1] == "[]", out.stdout[-500:]


def test_cli_help_lists_subcommands():
    out = subprocess.run([MLPLAT, "--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0
    for command in ("quickstart", "data", "model", "train", "serve", "eval"):
        assert command in out.stdout


def test_ci_runs_the_readme_test_command():
    readme = (REPO_ROOT / "README.md").read_text()
    command = re.search(r"make test", readme)
    assert command, "README names no test command"
    ci = (REPO_ROOT / ".ci" / "run").read_text()
    assert "make test" in ci and "make quickstart" not in ci
