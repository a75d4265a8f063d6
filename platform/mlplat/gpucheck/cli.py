"""``python -m mlplat.gpucheck --out DIR [--only NAME...] [--device cpu|cuda] [--quick]``.

The parent process only imports (the check's whole import set, so a missing package is named before anything
runs), prints versions, and forks one child per check with its own timeout: a fork starts with those imports
done, where a spawned process would pay them again (seconds per check). The parent never initialises CUDA, since
a process that did cannot fork children that use it: torch counts devices through NVML here
(PYTORCH_NVML_BASED_CUDA_CHECK), and a forked probe checks that CUDA works in a child before any check runs; if it
does not, the checks are spawned instead. Each child writes its outcome to
DIR/checks/NAME.json as it goes; the parent folds it into DIR/gpucheck.json after every check, so a run cut
off anywhere still reports.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import multiprocessing
import os
import platform
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

# Third-party packages the check imports beyond the GPU image's own (Python 3.12, torch, triton, transformers with
# its dependencies, peft, safetensors): the exact wheels to bring, matching this repository's pins (pyproject.toml)
# and the versions its tests run with. docs/gpu.md says how to install them offline.
PYDANTIC_WHEELS = (
    "pydantic-2.14.4-py3-none-any.whl",
    "pydantic_core-2.50.5-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.whl",
    "annotated_types-0.8.0-py3-none-any.whl",
    "typing_inspection-0.4.5-py3-none-any.whl",
    "typing_extensions-4.16.0-py3-none-any.whl",  # pydantic 2.14 needs >= 4.16; torch's may be older
)
WHEELS = {
    **dict.fromkeys(("pydantic", "pydantic_core", "annotated_types", "typing_inspection", "typing_extensions"), PYDANTIC_WHEELS),
    "llguidance": ("llguidance-1.9.1-cp39-abi3-manylinux_2_31_x86_64.whl",),  # the engine's structured outputs, imported with it
    "yaml": ("pyyaml-6.0.4-cp312-cp312-manylinux2014_x86_64.manylinux_2_17_x86_64.manylinux_2_28_x86_64.whl",),  # transformers' own dependency
}
# What the checks import: the engine, the training step code, the pure parts of mlplat.rl, and the model classes.
# Imported by the parent before it forks the checks, so each check starts with them loaded.
REQUIRED_MODULES = (
    "torch", "transformers", "safetensors", "mlplat.engine", "mlplat.engine.kv_transfer", "mlplat.engine.quant",
    "mlplat.train.step", "mlplat.train.parallel", "mlplat.train.batch", "mlplat.train.optim", "mlplat.train.perf",
    "mlplat.train.logprobs", "mlplat.train.losses", "mlplat.collectives", "mlplat.models", "mlplat.models.shapes",
    "mlplat.rl.experience", "mlplat.rl.rollout", "mlplat.gpucheck.engine_checks", "mlplat.gpucheck.train_checks",
    # transformers imports a model's code on first use: here once, not in every forked check
    "transformers.models.llama.modeling_llama", "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen3.modeling_qwen3",
)  # fmt: skip
VERSIONED = ("torch", "transformers", "peft", "safetensors", "triton", "tokenizers", "pydantic", "pydantic_core", "llguidance")


@dataclass(frozen=True)
class Check:
    name: str
    target: str  # module:function, called with (Settings, Outcome)
    timeout_s: int  # seconds, at full sizes on a GPU; --quick allows half
    cuda_only: str | None = None  # why it has no CPU path


ENGINE, TRAIN = "mlplat.gpucheck.engine_checks", "mlplat.gpucheck.train_checks"
# Correctness first, speed last: a run cut off by the machine's time still has the checks that matter most. The timeouts
# leave room for FlexAttention's first compiles on CUDA (a handful of Triton kernels per shape, cached on disk after).
CHECKS = (
    Check("greedy_parity", f"{ENGINE}:greedy_parity", 120),
    Check("serving_bf16", f"{ENGINE}:serving_bf16", 60),
    Check("kv_handoff", f"{ENGINE}:kv_handoff", 40),
    Check("nccl_collectives", f"{TRAIN}:nccl_collectives", 30,
          cuda_only="NCCL runs on GPUs only (on CPU, sft_step and grpo_step issue the same collectives through gloo)"),
    Check("grpo_step", f"{TRAIN}:grpo_step", 45),
    Check("sft_step", f"{TRAIN}:sft_step", 75),
    Check("engine_throughput", f"{ENGINE}:engine_throughput_check", 150),
    Check("cuda_graphs", f"{ENGINE}:cuda_graphs", 120, cuda_only="CUDA graphs capture GPU kernel launches: there is no CPU path"),
    Check("rooflines", f"{ENGINE}:rooflines", 90,
          cuda_only="the bf16 rooflines are the GPU's copy bandwidth and tensor-core matmul rate; a CPU's say nothing about them"),
)  # fmt: skip
BY_NAME = {c.name: c for c in CHECKS}


def missing_import_message(err: ImportError) -> str:
    missing = err.name.split(".")[0] if err.name else None
    wheels = WHEELS.get(missing) or next((w for name, w in WHEELS.items() if name in str(err)), None)
    if wheels is None:
        return f"cannot import what the check needs: {err}"
    return (f"cannot import {missing or 'a dependency'} ({err}). Bring these wheels (cp312, manylinux x86_64), install them offline with "
            f"`python3 -m pip install --no-index --no-deps --target .deps WHEELS` and run with PYTHONPATH=platform:.deps "
            f"(docs/gpu.md):\n  " + "\n  ".join(wheels))  # fmt: skip


def preflight() -> str | None:
    """Import everything the checks import; the reason it failed, naming the wheels to bring, or None."""
    for module in REQUIRED_MODULES:
        try:
            importlib.import_module(module)
        except ImportError as err:
            return missing_import_message(err)
    return None


def versions() -> dict:
    """Static versions: read without initialising CUDA."""
    import torch

    out = {"python": sys.version.split()[0], "platform": platform.platform(), "torch_cuda": torch.version.cuda}
    for name in VERSIONED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = None
    return out


def _device_probe(path: Path) -> None:
    import torch

    info = {"cuda_available": torch.cuda.is_available()}
    if info["cuda_available"]:
        from mlplat.gpucheck.train_checks import nccl_version

        props = torch.cuda.get_device_properties(0)
        info.update(name=props.name, capability=f"{props.major}.{props.minor}", memory_gib=round(props.total_memory / 2**30, 1),
                    device_count=torch.cuda.device_count(), nccl=nccl_version())  # fmt: skip
        info["cuda_works"] = torch.ones(2, device="cuda").sum().item() == 2.0  # raises where CUDA cannot initialise in this process
    path.write_text(json.dumps(info))


def probe_device(out: Path, visible_gpus: int) -> tuple[dict, str]:
    """(the device's description, the start method for the checks): fork, unless CUDA fails in a forked child."""
    path = out / "device_probe.json"
    for method in ("fork", "spawn"):
        path.unlink(missing_ok=True)
        exitcode, _ = start(_device_probe, (path,), 120, method)
        info = json.loads(path.read_text()) if exitcode == 0 and path.exists() else {"probe_exit_code": exitcode}
        if not visible_gpus or info.get("cuda_works"):
            return info, method
    return info, "fork"  # CUDA fails either way: the checks will say so


def _run_child(target: str, settings, result_path: Path) -> None:
    from mlplat.gpucheck.common import run_check

    module, _, function = target.partition(":")
    run_check(getattr(importlib.import_module(module), function), settings, result_path)


def start(target, args: tuple, timeout_s: float, method: str) -> tuple[int | None, float]:
    """Run ``target(*args)`` in a child process; (exit code, None if killed at the timeout; seconds)."""
    # Not a daemon: a daemonic process may not start processes of its own (torch.compile's compile workers may).
    process = multiprocessing.get_context(method).Process(target=target, args=args)
    start = time.perf_counter()
    process.start()
    process.join(timeout_s)
    if process.is_alive():
        process.kill()
        process.join()
        return None, time.perf_counter() - start
    return process.exitcode, time.perf_counter() - start


def run_one(check: Check, settings, out: Path, timeout_s: float, method: str) -> dict:
    result_path = out / "checks" / f"{check.name}.json"
    result_path.unlink(missing_ok=True)
    exitcode, seconds = start(_run_child, (check.target, settings, result_path), timeout_s, method)
    state = json.loads(result_path.read_text()) if result_path.exists() else {"status": "running", "figures": {}, "problems": []}
    if exitcode is None:
        state["status"] = "timeout"
        state["problems"].append(f"killed after its timeout of {timeout_s:.0f} s (figures above are what it had measured)")
    elif state["status"] == "running":
        state["status"] = "failed"
        state["problems"].append(f"the check's process died (exit code {exitcode}) before finishing")
    return {"status": state["status"], "seconds": round(seconds, 2), "timeout_s": timeout_s, "problems": state["problems"], "figures": state["figures"]}


HEADLINES = {
    "engine_throughput": lambda f: " ".join(f"{k} c64 x{v['c64_ratio']:.2f}" for k, v in f.items() if isinstance(v, dict) and "c64_ratio" in v),
    "cuda_graphs": lambda f: f"graphs over eager: c1 x{f['c1_speedup']:.2f} c64 x{f['c64_speedup']:.2f}" if "c1_speedup" in f else "",
    "rooflines": lambda f: " ".join(f"{k} mem {v['memory_roofline_fraction_c1']:.2f} compute {v['compute_roofline_fraction_c64']:.2f}"
                                    for k, v in f.items() if isinstance(v, dict) and "memory_roofline_fraction_c1" in v),
    "sft_step": lambda f: f"{f.get('backend')} mfu {f['mfu']:.3f} {f['tokens_per_s']:.0f} tok/s" if "mfu" in f else "",
    "grpo_step": lambda f: f"{f.get('backend')} collectives {f.get('collectives_in_step')}" if "backend" in f else "",
    "nccl_collectives": lambda f: f"nccl {f.get('nccl_version')}" if f else "",
}  # fmt: skip


def headline(name: str, result: dict) -> str:
    if result["status"] == "skipped":
        return result["reason"]
    if result["problems"]:
        return result["problems"][0].splitlines()[-1][:110]
    try:
        return HEADLINES.get(name, lambda f: "")(result["figures"])
    except (KeyError, TypeError, ValueError):
        return ""


def print_table(report: dict) -> None:
    print(f"\n{'check':20} {'status':8} {'seconds':>8}  notes")
    for name, result in report["checks"].items():
        seconds = f"{result['seconds']:.1f}" if result.get("seconds") is not None else ""
        print(f"{name:20} {result['status']:8} {seconds:>8}  {headline(name, result)}")
    print(f"{'all passed' if report['passed'] else 'FAILED'} in {report['wall_s']:.0f} s; JSON: {report['json']}")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m mlplat.gpucheck", description="The prepared GPU check (issue 38): docs/gpu.md")
    parser.add_argument("--out", type=Path, required=True, help="directory for gpucheck.json, each check's file and the models built")
    parser.add_argument("--only", nargs="+", metavar="NAME", help=f"run only these checks, of: {', '.join(BY_NAME)}")
    parser.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda where a GPU is visible, else cpu")
    parser.add_argument("--quick", action="store_true", help="tiny sizes (the CPU run in CI); without it Qwen2.5-0.5B's shape")
    parser.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every check's timeout (default 1)")
    args = parser.parse_args(argv)
    unknown = [n for n in args.only or [] if n not in BY_NAME]
    if unknown:
        parser.error(f"unknown check(s) {', '.join(unknown)}; the checks are: {', '.join(BY_NAME)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded: every model is built here
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # counting devices (here or in transformers' imports) leaves CUDA uninitialised
    started = time.perf_counter()
    out: Path = args.out.resolve()
    (out / "checks").mkdir(parents=True, exist_ok=True)
    report = {"command": sys.argv, "started": datetime.now(timezone.utc).isoformat(timespec="seconds"), "versions": versions(),
              "json": str(out / "gpucheck.json")}  # fmt: skip
    print("versions: " + ", ".join(f"{k} {v}" for k, v in report["versions"].items()), flush=True)
    problem = preflight()
    if problem:
        print(problem, file=sys.stderr)
        return 2
    import torch

    visible_gpus = torch.cuda.device_count()
    report["device_info"], method = probe_device(out, visible_gpus)
    device = args.device or ("cuda" if visible_gpus else "cpu")
    report["start_method"] = method
    print(f"device: {device}; " + ", ".join(f"{k} {v}" for k, v in report["device_info"].items()) + f"; checks start by {method}", flush=True)

    from mlplat.gpucheck.common import Settings

    settings = Settings(device=device, quick=args.quick, work=out / "work")
    selected = [BY_NAME[n] for n in args.only] if args.only else list(CHECKS)
    report.update(settings={"device": device, "quick": args.quick, "only": args.only, "timeout_scale": args.timeout_scale}, passed=None, wall_s=0.0)
    report["checks"] = {c.name: {"status": "pending"} for c in selected}

    def write() -> None:
        report["wall_s"] = round(time.perf_counter() - started, 1)
        (out / "gpucheck.json").write_text(json.dumps(report, indent=1, default=str))

    write()
    if device == "cuda" and not report["device_info"].get("cuda_works"):
        problem = f"CUDA does not work in a check's process (device probe: {report['device_info']}; GPUs NVML sees: {visible_gpus})"
        for c in selected:
            report["checks"][c.name] = {"status": "failed", "seconds": 0.0, "problems": [problem], "figures": {}}
    for check in selected:
        if report["checks"][check.name]["status"] != "pending":
            continue
        if device == "cpu" and check.cuda_only:
            report["checks"][check.name] = {"status": "skipped", "reason": check.cuda_only, "seconds": 0.0, "problems": [], "figures": {}}
        else:
            print(f"-- {check.name}", flush=True)
            timeout_s = check.timeout_s * args.timeout_scale / (2 if args.quick else 1)
            report["checks"][check.name] = run_one(check, settings, out, timeout_s, method)
            print(f"   {report['checks'][check.name]['status']} in {report['checks'][check.name]['seconds']:.1f} s", flush=True)
        write()
    report["passed"] = all(r["status"] in ("passed", "skipped") for r in report["checks"].values())
    report["finished"] = datetime.now(timezone.utc).isoformat(timespec="seconds")
    write()
    print_table(report)
    return 0 if report["passed"] else 1
