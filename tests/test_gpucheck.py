"""The prepared GPU check (mlplat.gpucheck, issue 38) on CPU: `--device cpu --quick` through its command line,
as a bare GPU machine runs it (PYTHONPATH=platform, a subprocess): every check with a CPU path passes, and only
the CUDA-only ones are skipped, each saying why. Its arguments and its missing-import message are checked here too."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from mlplat.gpucheck.cli import BY_NAME, CHECKS, WHEELS, missing_import_message, parse_args

ROOT = Path(__file__).resolve().parents[1]
CUDA_ONLY = {"cuda_graphs", "rooflines", "nccl_collectives"}


@pytest.mark.slow  # an end-to-end run of every CPU check (~15 s): `make test`, not the fast lane
def test_cpu_quick_run_passes_every_cpu_check_and_skips_only_the_cuda_ones(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT / "platform"), os.environ.get("PYTHONPATH")]))}
    done = subprocess.run([sys.executable, "-m", "mlplat.gpucheck", "--out", str(tmp_path), "--device", "cpu", "--quick",
                           "--timeout-scale", "3"],  # the checks' budgets are a GPU's; 2 busy CPU cores need more
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
    report = json.loads((tmp_path / "gpucheck.json").read_text())
    failed = {name: r.get("problems") for name, r in report["checks"].items() if r["status"] not in ("passed", "skipped")}
    assert done.returncode == 0 and not failed, f"{failed}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.startswith("versions: ")  # versions first, before any check
    assert report["passed"] and report["settings"] == {"device": "cpu", "quick": True, "only": None, "timeout_scale": 3.0}
    assert list(report["checks"]) == [c.name for c in CHECKS]
    assert {c.name for c in CHECKS if c.cuda_only} == CUDA_ONLY
    for name, result in report["checks"].items():
        if name in CUDA_ONLY:
            assert result["status"] == "skipped" and "CPU" in result["reason"], (name, result)
        else:
            assert result["status"] == "passed" and result["figures"], (name, result)
            assert json.loads((tmp_path / "checks" / f"{name}.json").read_text())["status"] == "passed"
    figures = {name: r["figures"] for name, r in report["checks"].items()}
    assert figures["sft_step"]["backend"] == "gloo" and all(n > 0 for n in figures["sft_step"]["collectives_per_step"])
    assert figures["grpo_step"]["collectives_in_step"] > 0
    assert {"sdpa", "flex"} <= set(figures["engine_throughput"]) and "c64_ratio" in figures["engine_throughput"]["flex"]
    assert all(f"{arch}_{backend}" in figures["greedy_parity"] for arch in ("llama", "qwen2", "qwen3") for backend in ("sdpa", "flex"))
    for name in report["checks"]:  # the table on stdout
        assert name in done.stdout


def test_an_unknown_check_name_is_refused_with_the_list_of_checks(capsys):
    with pytest.raises(SystemExit) as exit_:
        parse_args(["--out", "x", "--only", "greedy_parity", "no_such_check"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "unknown check(s) no_such_check" in err and all(name in err for name in BY_NAME)
    with pytest.raises(SystemExit):
        parse_args(["--out", "x", "--device", "tpu"])
    assert parse_args(["--out", "x", "--only", "sft_step", "grpo_step"]).only == ["sft_step", "grpo_step"]


def test_a_missing_package_names_the_wheels_to_bring_at_the_versions_installed_here():
    message = missing_import_message(ModuleNotFoundError("No module named 'pydantic'", name="pydantic"))
    assert all(wheel in message for wheel in WHEELS["pydantic_core"]) and "--no-index" in message
    assert "llguidance-" in missing_import_message(ModuleNotFoundError("No module named 'llguidance'", name="llguidance"))
    for wheel in {w for wheels in WHEELS.values() for w in wheels}:
        name, version = wheel.split("-")[:2]
        assert importlib.metadata.version(name) == version, f"{wheel}: this repository runs {name} {importlib.metadata.version(name)}"
        assert wheel.endswith("-py3-none-any.whl") or "-cp312-" in wheel or "-abi3-" in wheel
