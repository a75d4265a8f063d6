"""Collectives go through mlplat.collectives: on the training device, counted, never skipped
while a process group exists. Ranks are real gloo process groups (world size 1 and 2); the rule
that recipes never call torch.distributed themselves is an AST scan of the tree."""

from __future__ import annotations

import ast
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from mlplat import collectives
from mlplat.train.loop import MetricWindow

ROOT = Path(__file__).resolve().parents[1]
COLLECTIVE_NAMES = {
    "all_reduce", "all_gather", "all_gather_object", "all_gather_into_tensor", "reduce_scatter", "reduce_scatter_tensor",
    "broadcast", "broadcast_object_list", "barrier", "reduce", "gather", "gather_object", "scatter", "scatter_object_list",
    "all_to_all", "all_to_all_single", "send", "recv", "isend", "irecv", "monitored_barrier",
}  # fmt: skip


def _dotted(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute) and (base := _dotted(node.value)):
        return f"{base}.{node.attr}"
    return None


def distributed_uses(source: str) -> list[tuple[int, str]]:
    """(line, name) of every reference to ``torch.distributed`` itself (not its submodules, such as the
    checkpoint or FSDP APIs) and every call of one of its collectives, however it was imported or aliased."""
    tree = ast.parse(source)
    modules = {"torch.distributed"}  # names bound to the module
    functions: dict[str, str] = {}  # names bound to one of its functions -> that function
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name == "torch.distributed" and alias.asname:
                    modules.add(alias.asname)
        elif isinstance(node, ast.ImportFrom) and node.module in ("torch", "torch.distributed"):
            for alias in node.names:
                if node.module == "torch" and alias.name == "distributed":
                    modules.add(alias.asname or alias.name)
                elif node.module == "torch.distributed" and alias.name in COLLECTIVE_NAMES:
                    functions[alias.asname or alias.name] = alias.name
    for node in ast.walk(tree):  # plain assignments: d = torch.distributed; ar = d.all_reduce
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            value = _dotted(node.value)
            if value in modules:
                modules.add(node.targets[0].id)
            elif value and value.rpartition(".")[0] in modules and value.rpartition(".")[2] in COLLECTIVE_NAMES:
                functions[node.targets[0].id] = value.rpartition(".")[2]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call):
            name = _dotted(node.func)
            if name in functions:
                found.append((node.lineno, f"torch.distributed.{functions[name]}"))
            elif name and name.rpartition(".")[0] in modules and name.rpartition(".")[2] in COLLECTIVE_NAMES:
                found.append((node.lineno, f"torch.distributed.{name.rpartition('.')[2]}"))
        elif isinstance(node, ast.ImportFrom) and node.module == "torch.distributed":
            found.append((node.lineno, "from torch.distributed import ..."))
        elif isinstance(node, ast.Import) and any(a.name == "torch.distributed" for a in node.names):
            found.append((node.lineno, "import torch.distributed"))
        elif isinstance(node, ast.ImportFrom) and node.module == "torch" and any(a.name == "distributed" for a in node.names):
            found.append((node.lineno, "from torch import distributed"))
    return sorted(set(found))


def _collective_calls(source: str) -> list[tuple[int, str]]:
    return [(line, what) for line, what in distributed_uses(source) if "import" not in what]


@pytest.mark.parametrize(
    "source",
    [
        "import torch.distributed as dist\ndist.all_reduce(t)",
        "import torch\ntorch.distributed.barrier()",
        "from torch import distributed as D\nD.broadcast(t, 0)",
        "from torch.distributed import all_reduce as ar\nar(t)",
        "import torch\nd = torch.distributed\nd.all_gather(out, t)",
        "import torch.distributed as dist\nreduce_it = dist.all_reduce\nreduce_it(t)",
        "def f(t):\n    import torch.distributed\n    torch.distributed.all_gather_object(out, t)",
    ],
)
def test_the_scan_catches_a_collective_however_it_is_imported(source):
    assert _collective_calls(source), source


def test_the_scan_ignores_collectives_of_other_modules():
    assert not distributed_uses("from mlplat import collectives\ncollectives.all_reduce(t, device)\nimport torch.distributed.checkpoint as dcp")


def test_recipes_never_touch_torch_distributed_and_platform_code_calls_collectives_only_through_the_helper():
    recipes = {str(p.relative_to(ROOT)): distributed_uses(p.read_text()) for p in sorted((ROOT / "train_apps").glob("*.py"))}
    assert not any(recipes.values()), {k: v for k, v in recipes.items() if v}
    helper = ROOT / "platform/mlplat/collectives.py"
    scanned = [*(ROOT / "platform/mlplat/train").glob("*.py"), *(ROOT / "platform/mlplat/rl").glob("*.py")]  # train/health.py included
    calls = {str(p.relative_to(ROOT)): _collective_calls(p.read_text()) for p in scanned if p != helper}
    assert not any(calls.values()), {k: v for k, v in calls.items() if v}
    assert _collective_calls(helper.read_text())  # the scan sees the helper's own calls: it is looking


def test_without_a_process_group_values_stay_local_and_nothing_is_issued():
    assert not collectives.active()
    before = sum(collectives.ISSUED.values())
    assert collectives.reduce_values({"a": 2.0}, torch.device("cpu"), "sum") == {"a": 2.0}
    window = MetricWindow(torch.device("cpu"), maxima=("m",))
    window.add({"x": 1.0, "m": 5.0})
    window.add({"x": 3.0, "m": 2.0})
    assert window.pop() == {"x": 2.0, "m": 5.0}
    assert sum(collectives.ISSUED.values()) == before


def _rank(cfg: dict, env) -> None:
    """One rank's scenario, in a process group set up by the caller; what it saw goes to ``world{W}_rank{R}.pt``."""
    from mlplat.models import load_model
    from mlplat.train.optim import OptimizerConfig, build_lr_scheduler, build_optimizer
    from mlplat.train.step import train_step

    rank, world, model_dir, out = dist.get_rank(), cfg["world"], cfg["model_dir"], cfg["out"]
    issued_before = dict(collectives.ISSUED)  # the processes may have run other loops
    cpu, result = torch.device("cpu"), {}
    values = {"a": float(rank + 1), "b": float(10 * rank)}
    result["sum"] = collectives.reduce_values(values, cpu, "sum")
    result["mean"] = collectives.reduce_values(values, cpu, "mean")
    result["max"] = collectives.reduce_values(values, cpu, "max")
    source = torch.ones(2)
    reduced = collectives.all_reduce(source, cpu)
    result["source_untouched"] = source.tolist() == [1.0, 1.0] and reduced.device == cpu

    window = MetricWindow(cpu, maxima=("diff_max",))
    window.add({"loss": float(rank), "diff_max": float(rank)})
    window.add({"loss": float(rank + 2), "diff_max": 0.5})
    result["window"] = window.pop()
    result["nodes"] = collectives.all_gather_object({"rank": rank})

    model = load_model(model_dir)
    optim = OptimizerConfig(lr=1e-3, warmup_steps=0)
    optimizer = build_optimizer(model, optim)
    scheduler = build_lr_scheduler(optimizer, optim, 2)
    batch = {"input_ids": torch.arange(3, 19).view(2, 8), "attention_mask": torch.ones(2, 8, dtype=torch.long)}
    batch["labels"] = batch["input_ids"].clone()
    before = sum(collectives.ISSUED.values())
    train_step(model, batch, optimizer, scheduler, 1.0)
    result["train_step_collectives"] = sum(collectives.ISSUED.values()) - before
    collectives.barrier(cpu)
    result["issued"] = {op: n - issued_before.get(op, 0) for op, n in collectives.ISSUED.items() if n > issued_before.get(op, 0)}
    torch.save(result, Path(out) / f"world{world}_rank{rank}.pt")


@pytest.mark.parametrize("world", [1, 2])
def test_collectives_reduce_over_the_group_and_are_issued_at_any_world_size(world, tiny_model, tmp_path, local_group):
    cfg = {"model_dir": str(tiny_model), "out": str(tmp_path), "world": world}
    if world == 2:
        local_group.run(_rank, cfg, tmp_path, {})
    else:  # a group of one, in this process
        dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1, timeout=timedelta(seconds=60))
        try:
            _rank(cfg, None)
        finally:
            dist.destroy_process_group()
    results = [torch.load(tmp_path / f"world{world}_rank{r}.pt", weights_only=False) for r in range(world)]
    ranks = range(world)
    for result in results:
        assert result["sum"] == {"a": sum(r + 1 for r in ranks), "b": sum(10 * r for r in ranks)}
        assert result["mean"] == pytest.approx({"a": sum(r + 1 for r in ranks) / world, "b": sum(10 * r for r in ranks) / world})
        assert result["max"] == {"a": world, "b": 10 * (world - 1)}
        assert result["source_untouched"]
        # loss: the mean over steps and ranks; diff_max: the largest value of any step on any rank.
        assert result["window"] == pytest.approx({"loss": sum(r + 1 for r in ranks) / world, "diff_max": max(world - 1, 0.5)})
        assert result["nodes"] == [{"rank": r} for r in ranks]
        # The token count and the loss: all-reduced at world size 1 as well (no short-circuit to hide a CPU tensor).
        assert result["train_step_collectives"] == 2
        assert result["issued"] == {"all_reduce": 6, "all_gather": 1, "all_gather_object": 1, "barrier": 1}
