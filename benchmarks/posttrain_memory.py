"""Claim: the peak memory of one SFT, DPO and GRPO step of Qwen2.5-0.5B's shape under FSDP2 is what
``mlplat.train.memory.estimate_step_memory`` says it is (0.8 <= measured / estimate <= 1.3 per rank), no
step builds full-vocabulary logits for its batch, and the same formula puts Qwen2.5-7B's steps on
8 x 80 GB GPUs inside 80 GB.

    python benchmarks/posttrain_memory.py [--quick] [--out FILE] [--layers N] [--tokens N] [--chunk-tokens N]

``--quick`` (a smoke run, under 3 minutes) keeps the shape's width and vocabulary but 4 of its 24
decoder layers, 32-token rows and 16-token completions; the claim is the full run's.

Setup: Qwen2.5-0.5B's configuration with random weights (``SHAPES["qwen2.5-0.5b"]``: 494M parameters,
151,936-entry vocabulary, tied embeddings), fp32 on CPU, FSDP2 over 2 worker processes (gloo, plain
``torch.distributed``, one thread each), activation checkpointing per decoder layer, the chunked
log-prob head (``chunk_tokens`` positions per chunk) installed as ``mlplat.train.loop.trainable``
does (the benchmark calls ``trainable`` and ``frozen_reference`` themselves), AdamW.

- SFT: ``CausalLMObjective`` on a micro-batch of ``rows x tokens`` per rank (the first quarter of
  each row is prompt, unlabelled);
- DPO: ``DPOObjective`` (sigmoid, beta 0.1) on one micro-batch of pairs per rank (chosen + rejected
  rows, ``rows x tokens`` together), against the frozen reference sharded like the policy;
- GRPO: a native ``LLMEngine`` (mlplat.engine, fp32, one plain copy of the weights: no packed copies,
  a KV cache of the blocks the batch needs) on rank 0 generates 4 completions of 128 tokens
  (ignore_eos) for each rank's 64-token prompt, built before the trainer as the recipe starts its
  rollout actors first; rank 1 gets its group through an all-gather; both ranks score the batch
  with the policy (with entropy) and the reference (beta = 0.04 > 0), train on it with
  ``GRPOObjective``, and stream the new weights into the engine layer by layer
  (``full_weights_by_layer``, what ``sync_weights`` does).

Every recipe runs two optimizer steps (SFT, DPO: two micro-batches; GRPO: two passes over its rollout,
``num_iterations`` = 2) so that the second runs with AdamW's state allocated: the steady-state peak,
which the estimate describes (the first step's backward runs before AdamW allocates its state).
Each recipe runs in 2 fresh processes; per rank, the peak is VmHWM (/proc/self/status) minus VmRSS
just before the first model (or engine) is built, after imports and the process group. RSS and
VmHWM are also recorded after each phase (build, shard, reference, generate, score, forward,
backward, optimizer step, sync), so a gap to the estimate can be located. The machine's peak is the
largest sum of VmRSS over the parent and both workers, sampled every 20 ms (the sum of the three
VmHWMs, an upper bound, is reported beside it). Every step runs under ``VocabTensorWatch``: the
largest vocabulary-sized tensor it saw, in rows, must not exceed min(chunk_tokens, labelled positions
of a micro-batch); a full logit tensor of the batch would have rows x tokens rows.

The 7B figures are the same formula for Qwen2.5-7B on 8 GPUs: bf16 compute (gathered weights,
activations), fp32 sharded master weights, gradients and AdamW state, micro-batch 1 x 4096 tokens,
activation checkpointing, chunk_tokens 1024; the reference sharded like the policy; GRPO with a
colocated bf16 rollout engine holding the whole model and a KV cache for its batch
(``ROLLOUT_7B``: 32 sequences x 2048 tokens per GPU).

JSON fields: peak_over_estimate_{sft,dpo,grpo} (the larger rank's measured / estimate), machine_peak_gib,
machine_peak_hwm_sum_gib, full_vocab_logits_materialised, estimate_7b_8gpu_gb_{sft,dpo,grpo} (GB, 1e9
bytes), per_rank (per recipe and rank: measured_gib, estimate_gib, ratio, largest_vocab_rows, phases),
estimate_terms (per recipe and rank, GiB), estimate_7b_terms, setup (shape, world size, micro-batch,
chunk_tokens, threads, machine, date), seconds per recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import torch

RESULTS = Path(__file__).resolve().parent / "results"
GIB = 2**30
WORLD = 2
GENERATIONS = 4  # GRPO: per rank, one prompt's group of completions
ROLLOUT_7B = {"sequences": 32, "tokens": 2048}  # the 7B GRPO engine's KV cache: its batch per GPU


def status_kib(pid: int | str = "self") -> dict[str, int]:
    """VmRSS and VmHWM of a process, in KiB."""
    out = {}
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0])
    return out


def measured_shape(layers: int):
    """Qwen2.5-0.5B's shape, with ``layers`` of its 24 decoder layers (--quick: 4; the claim: all 24)."""
    from mlplat.models.shapes import SHAPES

    return SHAPES["qwen2.5-0.5b"].model_copy(update={"num_hidden_layers": layers})


def _build_model(out_dir: str, layers: int) -> None:
    from mlplat.data.demo import DemoDataConfig, tokenizer_corpus, write_demo_data
    from mlplat.models.shapes import build_random_model

    data = write_demo_data(Path(out_dir) / "data", DemoDataConfig(sft_rows=500, eval_rows=20, preference_rows=20, rl_rows=20))
    build_random_model(Path(out_dir) / "model", measured_shape(layers), tokenizer_corpus(data.sft))


# -- one rank ---------------------------------------------------------------------------------
class Phases:
    """RSS and VmHWM after each named phase, in GiB above the baseline taken at construction."""

    def __init__(self):
        self.base_kib = status_kib()["VmRSS"]
        self.rows: list[dict] = []
        self.start = time.perf_counter()

    def __call__(self, name: str) -> None:
        s = status_kib()
        self.rows.append({
            "phase": name, "t_s": time.perf_counter() - self.start, "rss_gib": (s["VmRSS"] - self.base_kib) / 2**20,
            "hwm_gib": (s["VmHWM"] - self.base_kib) / 2**20,
        })  # fmt: skip

    def peak_gib(self) -> float:
        return (status_kib()["VmHWM"] - self.base_kib) / 2**20


class ProbedObjective:
    """An objective that records the RSS after its forward (the loss with its graph)."""

    def __init__(self, objective, phases: Phases, step: list[int]):
        self.objective, self.phases, self.step = objective, phases, step

    def units(self, batch):
        return self.objective.units(batch)

    def __call__(self, model, batch):
        out = self.objective(model, batch)
        self.phases(f"step{self.step[0]}:forward")
        return out


def random_rows(rows: int, tokens: int, vocab: int, prompt: int, seed: int) -> dict[str, torch.Tensor]:
    from mlplat.train.batch import IGNORE_INDEX

    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (rows, tokens), generator=g)
    labels = ids.clone()
    labels[:, :prompt] = IGNORE_INDEX
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels}


def _worker(rank: int, recipe: str, args: dict, store: str, out_dir: str) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    from datetime import timedelta

    import torch.distributed as dist

    from mlplat import collectives
    from mlplat.data.ingest import DataConfig
    from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
    from mlplat.models import load_model, load_tokenizer
    from mlplat.rl.experience import micro_batches, rollout_batch, score_completions
    from mlplat.rl.objectives import GRPOObjective
    from mlplat.rl.rollout import Sample
    from mlplat.train.logprobs import install_logprob_head
    from mlplat.train.loop import RecipeConfig, frozen_reference, trainable
    from mlplat.train.memory import VocabTensorWatch
    from mlplat.train.optim import OptimizerConfig
    from mlplat.train.parallel import full_weights_by_layer, unwrap
    from mlplat.train.step import CausalLMObjective, train_step
    from train_apps.dpo import DPOObjective
    from train_apps.grpo import GRPOConfig

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=WORLD, timeout=timedelta(seconds=1800))
    model_dir, chunk = args["model_dir"], args["chunk_tokens"]
    prompt_tokens, completion_tokens = args["prompt_tokens"], args["completion_tokens"]
    tokenizer = load_tokenizer(model_dir)
    vocab_ids = len(tokenizer)
    device = torch.device("cpu")
    env = SimpleNamespace(restore_from=None, device=device)
    common = {"model": model_dir, "data": DataConfig(path="unused"), "max_steps": 2, "optim": OptimizerConfig(warmup_steps=0),
              "parallel": {"strategy": "fsdp", "activation_checkpointing": True}, "num_workers": WORLD}  # fmt: skip
    cfg = (GRPOConfig(**common, num_generations=GENERATIONS, batch_size_per_worker=GENERATIONS, max_completion_length=completion_tokens,
                      num_iterations=2, beta=0.04) if recipe == "grpo" else RecipeConfig(**common))  # fmt: skip
    collectives.barrier(device)
    phases = Phases()  # the baseline: libraries imported, process group up, nothing built
    engine = None
    if recipe == "grpo" and rank == 0:
        blocks = 2 * GENERATIONS * -(-(prompt_tokens + completion_tokens) // 16)  # both ranks' groups, unshared
        engine = LLMEngine(EngineConfig(model=model_dir, dtype="float32", num_kv_blocks=blocks, max_num_seqs=2 * GENERATIONS,
                                        max_model_len=prompt_tokens + completion_tokens, cpu_packed_weights=False, cpu_kernels=False))  # fmt: skip
        phases("engine built")
    collectives.barrier(device)
    model = install_logprob_head(load_model(model_dir), chunk_tokens=chunk)
    policy, optimizer, scheduler, _ = trainable(model, cfg, env)
    del model
    phases("policy sharded")
    reference = None
    if recipe in ("dpo", "grpo"):
        reference = frozen_reference(cfg, env, policy)
        unwrap(reference).get_output_embeddings().chunk_tokens = chunk
        phases("reference sharded")

    step = [0]

    def on_backward(*_):
        phases(f"step{step[0]}:backward")

    def on_step(*_):
        phases(f"step{step[0]}:optimizer")

    optimizer.register_step_pre_hook(on_backward)
    optimizer.register_step_post_hook(on_step)
    watch = VocabTensorWatch(unwrap(policy).config.vocab_size, unwrap(policy).config.hidden_size)
    rows, tokens = args["rows"], args["tokens"]
    labelled_per_micro = 0
    start = time.perf_counter()
    if recipe in ("sft", "dpo"):
        objective = CausalLMObjective() if recipe == "sft" else DPOObjective(reference, beta=0.1)
        for i in range(2):
            step[0] = i + 1
            batch = random_rows(rows, tokens, vocab_ids, tokens // 4, seed=100 * rank + i)
            labelled_per_micro = int((batch["labels"][:, 1:] != -100).sum())
            with watch:
                train_step(policy, batch, optimizer, scheduler, 1.0, objective=ProbedObjective(objective, phases, step))
    else:
        prompts = [torch.randint(0, vocab_ids, (prompt_tokens,), generator=torch.Generator().manual_seed(r)).tolist() for r in range(WORLD)]
        samples = None
        if engine is not None:
            params = SamplingParams(n=GENERATIONS, max_tokens=completion_tokens, temperature=1.0, ignore_eos=True, logprobs=True, seed=0)
            samples = [[Sample(out.prompt_token_ids, c.sampled_token_ids, c.sampled_logprobs, c.text, c.finish_reason)
                        for c in sorted(out.outputs, key=lambda c: c.index)] for out in engine.generate(prompts, params)]  # fmt: skip
            phases("generated")
        mine = collectives.all_gather_object(samples)[0][rank]
        batch = rollout_batch(mine, tokenizer.pad_token_id)
        batch["advantages"] = torch.linspace(-1.0, 1.0, GENERATIONS)
        labelled_per_micro = int((batch["labels"][:, 1:] != -100).sum())
        rows, tokens = batch["input_ids"].shape
        with watch:
            scored = score_completions(policy, batch, cfg.batch_size_per_worker, cfg.temperature, entropy=True)
            batch["old_logprobs"] = scored["logprobs"]
            batch["ref_logprobs"] = score_completions(reference, batch, cfg.batch_size_per_worker, cfg.temperature)["logprobs"]
        phases("scored")
        objective = ProbedObjective(GRPOObjective.from_config(cfg), phases, step)
        for i in range(cfg.num_iterations):
            step[0] = i + 1
            with watch:
                train_step(policy, micro_batches(batch, cfg.batch_size_per_worker), optimizer, scheduler, 1.0, objective=objective)
        for layer in full_weights_by_layer(policy):
            if engine is not None and layer:
                engine.update_weights(layer)
        collectives.barrier(device)
        phases("weights synced")
    seconds = time.perf_counter() - start
    result = {"rank": rank, "measured_gib": phases.peak_gib(), "baseline_gib": phases.base_kib / 2**20, "phases": phases.rows,
              "largest_vocab_rows": watch.largest_rows, "largest_vocab_shape": list(watch.largest_shape), "rows": rows, "tokens": tokens,
              "labelled_per_micro_batch": labelled_per_micro, "step_seconds": seconds}  # fmt: skip
    Path(out_dir, f"{recipe}_{rank}.json").write_text(json.dumps(result))
    collectives.barrier(device)
    dist.destroy_process_group()


# -- the parent -------------------------------------------------------------------------------
class MachinePeak:
    """The largest sum of VmRSS over the given processes, sampled every ``interval`` seconds."""

    def __init__(self, pids: list[int], interval: float = 0.02):
        self.pids, self.interval, self.peak_kib = pids, interval, 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            total = 0
            for pid in self.pids:
                try:
                    total += status_kib(pid)["VmRSS"]
                except (FileNotFoundError, ProcessLookupError, KeyError):
                    pass
            self.peak_kib = max(self.peak_kib, total)
            time.sleep(self.interval)

    def close(self) -> float:
        self.stop.set()
        self.thread.join()
        return self.peak_kib / 2**20


def run_recipe(recipe: str, args: dict, work: Path) -> tuple[list[dict], float, float]:
    """(per-rank results, machine peak GiB, sum of VmHWMs GiB) of one recipe in 2 fresh processes."""
    import torch.multiprocessing as mp

    store = work / f"store_{recipe}"
    saved_env = dict(os.environ)
    if args["allocator"] == "mmap":  # every allocation over 128 KiB its own mapping, unmapped when freed: RSS = live memory
        os.environ["MALLOC_MMAP_THRESHOLD_"] = str(128 * 1024)
    try:
        ctx = mp.start_processes(_worker, args=(recipe, args, str(store), str(work)), nprocs=WORLD, join=False, start_method="spawn")
    finally:
        os.environ.clear()
        os.environ.update(saved_env)
    pids = [p.pid for p in ctx.processes]
    monitor = MachinePeak([os.getpid(), *pids])
    hwm_kib = {pid: 0 for pid in pids}
    while not ctx.join(timeout=0.5):
        for pid in pids:
            try:
                hwm_kib[pid] = max(hwm_kib[pid], status_kib(pid)["VmHWM"])
            except (FileNotFoundError, ProcessLookupError, KeyError):
                pass
    machine = monitor.close()
    hwm_sum = (sum(hwm_kib.values()) + status_kib()["VmHWM"]) / 2**20
    return [json.loads((work / f"{recipe}_{r}.json").read_text()) for r in range(WORLD)], machine, hwm_sum


def estimates(recipe: str, rank: int, result: dict, args: dict):
    from mlplat.train.memory import MemorySetup, estimate_step_memory

    shape = measured_shape(args["layers"])
    engine = recipe == "grpo" and rank == 0
    kv_tokens = 2 * GENERATIONS * -(-(args["prompt_tokens"] + args["completion_tokens"]) // 16) * 16 if engine else 0
    setup = MemorySetup(
        shape=shape, world_size=WORLD, rows=result["rows"], tokens=result["tokens"], labelled_tokens=result["labelled_per_micro_batch"],
        chunk_tokens=args["chunk_tokens"], activation_checkpointing=True, reference="sharded" if recipe != "sft" else None,
        engine_weight_bytes=4 if engine else 0, engine_kv_tokens=kv_tokens, engine_kv_bytes=4, collective_copies=1,  # gloo
    )  # fmt: skip
    return estimate_step_memory(setup)


def estimate_7b(recipe: str):
    from mlplat.models.shapes import SHAPES
    from mlplat.train.memory import estimate_step_memory, gpu_recipe_setup

    return estimate_step_memory(
        gpu_recipe_setup(SHAPES["qwen2.5-7b"], recipe, rollout_sequences=ROLLOUT_7B["sequences"], rollout_tokens=ROLLOUT_7B["tokens"])
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="4 decoder layers, fewer tokens per micro-batch (< 3 minutes)")
    parser.add_argument("--layers", type=int, default=None, help="decoder layers of the 0.5B shape; default 24, 4 with --quick")
    parser.add_argument("--tokens", type=int, default=None, help="tokens per row (SFT, DPO); default 1024, 32 with --quick")
    parser.add_argument("--rows", type=int, default=2, help="rows per micro-batch (SFT; DPO: chosen + rejected)")
    parser.add_argument("--chunk-tokens", type=int, default=None, help="the log-prob head's chunk; default 1024, 32 with --quick")
    parser.add_argument("--recipes", default="sft,dpo,grpo")
    parser.add_argument(
        "--glibc-default-recipes",
        default=None,
        help="recipes to run again under glibc's default malloc (RSS with its heap retention); default none",
    )
    parser.add_argument("--out", type=Path, default=RESULTS / "posttrain_memory.json")
    args = parser.parse_args()
    started = time.perf_counter()
    work = Path(tempfile.mkdtemp(prefix="posttrain_memory_"))
    try:
        run(args, work, started)
    finally:
        shutil.rmtree(work, ignore_errors=True)  # the 2 GB checkpoint


def run(args, work: Path, started: float) -> None:
    import torch.multiprocessing as mp

    layers = args.layers or (4 if args.quick else 24)
    tokens = args.tokens or (32 if args.quick else 1024)
    chunk = args.chunk_tokens or (32 if args.quick else 1024)
    prompt_tokens, completion_tokens = (8, 16) if args.quick else (64, 128)
    recipes = args.recipes.split(",")
    default_recipes = [r for r in (args.glibc_default_recipes if args.glibc_default_recipes is not None else "").split(",") if r]
    builder = mp.get_context("spawn").Process(target=_build_model, args=(str(work), layers))  # the full model never lives in this process
    builder.start()
    builder.join()
    assert builder.exitcode == 0, "building the random model failed"
    wargs = {
        "model_dir": str(work / "model"),
        "rows": args.rows,
        "tokens": tokens,
        "chunk_tokens": chunk,
        "allocator": "mmap",
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "layers": layers,
    }
    build_s = time.perf_counter() - started

    per_rank, terms, ratios, seconds = {}, {}, {}, {}
    machine_peak = hwm_peak = 0.0
    materialised = False
    for recipe in recipes:
        t0 = time.perf_counter()
        results, machine, hwm_sum = run_recipe(recipe, wargs, work)
        seconds[recipe] = time.perf_counter() - t0
        machine_peak, hwm_peak = max(machine_peak, machine), max(hwm_peak, hwm_sum)
        per_rank[recipe], terms[recipe] = [], []
        for r in results:
            est = estimates(recipe, r["rank"], r, wargs)
            bound = min(chunk, r["labelled_per_micro_batch"])
            r["full_vocab_logits_materialised"] = r["largest_vocab_rows"] > bound
            materialised |= r["full_vocab_logits_materialised"]
            per_rank[recipe].append(
                {**r, "estimate_gib": est.total / GIB, "ratio": r["measured_gib"] / (est.total / GIB), "vocab_rows_bound": bound}
            )
            terms[recipe].append({k: v / GIB for k, v in est.terms.items()})
        ratios[recipe] = max(p["measured_gib"] for p in per_rank[recipe]) / max(p["estimate_gib"] for p in per_rank[recipe])
    glibc = {}
    for recipe in default_recipes:
        t0 = time.perf_counter()
        results, machine, hwm_sum = run_recipe(recipe, {**wargs, "allocator": "default"}, work)
        seconds[f"{recipe}_glibc_default"] = time.perf_counter() - t0
        estimate = [estimates(recipe, r["rank"], r, wargs).total / GIB for r in results]
        glibc[recipe] = {"measured_gib": [r["measured_gib"] for r in results], "estimate_gib": estimate, "machine_peak_gib": machine,
                         "ratio": max(r["measured_gib"] for r in results) / max(estimate), "phases": [r["phases"] for r in results]}  # fmt: skip
        machine_peak, hwm_peak = max(machine_peak, machine), max(hwm_peak, hwm_sum)
    est7 = {recipe: estimate_7b(recipe) for recipe in ("sft", "dpo", "grpo")}
    shape = measured_shape(layers)
    out = {
        **{f"peak_over_estimate_{r}": ratios[r] for r in recipes},
        "machine_peak_gib": machine_peak,
        "machine_peak_hwm_sum_gib": hwm_peak,
        "full_vocab_logits_materialised": materialised,
        **{f"estimate_7b_8gpu_gb_{r}": e.total / 1e9 for r, e in est7.items()},
        "per_rank": per_rank,
        "glibc_default_malloc": glibc,
        "estimate_terms": terms,
        "estimate_7b_terms": {r: {k: v / 1e9 for k, v in e.terms.items()} for r, e in est7.items()},
        "seconds": {"build_model": build_s, **seconds, "total": time.perf_counter() - started},
        "setup": {
            "quick": args.quick, "shape": shape.model_dump(), "num_parameters": shape.num_parameters(), "world_size": WORLD,
            "backend": "gloo", "dtype": "float32", "micro_batch": {"rows": args.rows, "tokens": tokens},
            "allocator": "glibc malloc with MALLOC_MMAP_THRESHOLD_=131072 in the workers (glibc_default_malloc: without it)",
            "grpo": {"prompt_tokens": prompt_tokens, "generations": GENERATIONS, "completion_tokens": completion_tokens, "beta": 0.04,
                     "engine": "LLMEngine on rank 0, fp32, plain weights, KV blocks for both ranks' groups"},
            "chunk_tokens": chunk, "threads_per_rank": 1, "activation_checkpointing": True, "optimizer_steps": 2,
            "rollout_7b": ROLLOUT_7B, "machine": f"{platform.node()} {platform.machine()} {os.cpu_count()} cpus",
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        },
    }  # fmt: skip
    print(f"{'recipe':<6} {'rank':>4} {'measured GiB':>13} {'estimate GiB':>13} {'ratio':>6} {'vocab rows':>11} {'bound':>6} {'step s':>7}")
    for recipe in recipes:
        for p in per_rank[recipe]:
            print(f"{recipe:<6} {p['rank']:>4} {p['measured_gib']:>13.2f} {p['estimate_gib']:>13.2f} {p['ratio']:>6.2f} "
                  f"{p['largest_vocab_rows']:>11} {p['vocab_rows_bound']:>6} {p['step_seconds']:>7.1f}")  # fmt: skip
    for recipe, g in glibc.items():
        print(f"{recipe:<6} glibc default malloc: measured {' / '.join(f'{m:.2f}' for m in g['measured_gib'])} GiB, ratio {g['ratio']:.2f}")
    print(f"machine peak (sampled sum of RSS): {machine_peak:.2f} GiB; sum of VmHWM: {hwm_peak:.2f} GiB; "
          f"full-vocabulary logits materialised: {materialised}")  # fmt: skip
    for recipe, e in est7.items():
        print(f"Qwen2.5-7B, 8 x 80 GB, {recipe}: {e.total / 1e9:.1f} GB per GPU")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2))
    print(f"wrote {args.out} ({out['seconds']['total']:.0f} s)")


if __name__ == "__main__":
    main()
