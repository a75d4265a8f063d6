"""Multi-LoRA in the engine (engine.lora): peft adapters with non-zero B on the tiny model, applied batched.

Each adapter's greedy output equals its merged checkpoint's; a batch mixing adapters and the base model
equals each request alone; prefix-cache blocks are kept apart per adapter; slots evict (LRU) and reload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file, save_file

from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
from mlplat.engine.block_manager import block_hash, block_hash_seed
from mlplat.engine.config import MultiLoRAConfig
from mlplat.engine.runner import read_safetensors

PROMPTS = ["12 + 34 = ", "7 + 8 = ", "100 + 250 = ", "the quick brown fox jumps over the lazy dog and"]
ENGINE = dict(num_kv_blocks=64, block_size=8, max_num_seqs=8, max_model_len=256)


def greedy(lora_name: str | None = None, max_tokens: int = 8) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, lora_name=lora_name)


def make_adapter(base_dir: Path, out_dir: Path, seed: int, r: int = 8, merged_dir: Path | None = None) -> Path:
    """A peft adapter on every linear of ``base_dir`` with random non-zero A and B (its output differs from the base
    model's), saved as the SFT recipe saves one (train.lora.save_adapter); with ``merged_dir``, also merged by peft."""
    from mlplat.models import load_model, load_tokenizer
    from mlplat.train.lora import LoRAConfig, apply_lora, merge_and_export, save_adapter

    model = apply_lora(load_model(str(base_dir)), LoRAConfig(r=r, alpha=2 * r)).eval()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * (0.2 if "lora_A" in name else 0.05))
    save_adapter(model, out_dir)
    if merged_dir is not None:
        merge_and_export(model, merged_dir, load_tokenizer(str(base_dir)))
    return out_dir


def foreign_adapter(adapter_dir: Path, out_dir: Path) -> Path:
    """The adapter as if trained for a base model with a wider MLP: its down_proj A and gate/up B do not fit this one."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "adapter_config.json").write_text((adapter_dir / "adapter_config.json").read_text())
    state = load_file(adapter_dir / "adapter_model.safetensors")
    wider = {k: torch.cat([v, v], dim=1 if "down_proj.lora_A" in k else 0) if ("down_proj.lora_A" in k or "up_proj.lora_B" in k) else v
             for k, v in state.items()}  # fmt: skip
    save_file(wider, out_dir / "adapter_model.safetensors")
    return out_dir


@pytest.fixture(scope="module")
def adapters(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    a1 = make_adapter(tiny_model, root / "a1", seed=1, r=8, merged_dir=root / "a1-merged")
    a2 = make_adapter(tiny_model, root / "a2", seed=2, r=16)
    big = make_adapter(tiny_model, root / "big", seed=3, r=32)
    return {"a1": a1, "a2": a2, "merged": root / "a1-merged", "foreign": foreign_adapter(a1, root / "foreign"), "big": big}


def lora_engine(model, adapters, max_loras: int = 2, max_cpu_loras: int | None = None, **kwargs) -> LLMEngine:
    names = {n: str(adapters[n]) for n in ("a1", "a2", "foreign", "big")}
    lora = MultiLoRAConfig(max_loras=max_loras, max_lora_rank=16, max_cpu_loras=max_cpu_loras, adapters=names)
    return LLMEngine(EngineConfig(model=str(model), **ENGINE, **kwargs, lora=lora))


@pytest.fixture(scope="module")
def engine(tiny_model, adapters):
    return lora_engine(tiny_model, adapters)


@pytest.fixture(scope="module")
def solo(engine):
    """Each prompt's greedy tokens alone, per adapter (None: the base model)."""
    return {(p, name): engine.generate([p], greedy(name))[0].outputs[0].token_ids for p in PROMPTS for name in (None, "a1", "a2")}


def check_idle(engine: LLMEngine) -> None:
    engine.block_manager.check_invariants([])
    assert not any(engine.runner.lora.pins.values()), "a finished request left its adapter pinned"


def test_adapter_output_equals_merged_checkpoint(engine, solo, adapters):
    merged = LLMEngine(EngineConfig(model=str(adapters["merged"]), **ENGINE))
    expected = [o.outputs[0].token_ids for o in merged.generate(PROMPTS, greedy())]
    assert [solo[(p, "a1")] for p in PROMPTS] == expected
    assert any(solo[(p, "a1")] != solo[(p, None)] for p in PROMPTS), "the adapter does not change the output: B is zero?"
    assert any(solo[(p, "a2")] != solo[(p, "a1")] for p in PROMPTS)


def test_mixed_batch_equals_each_alone(engine, solo):
    names = [None, "a1", "a2", "a1", None, "a2"]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(len(names))]
    outs = engine.generate(prompts, [greedy(n) for n in names])
    assert [o.outputs[0].token_ids for o in outs] == [solo[(p, n)] for p, n in zip(prompts, names)]
    check_idle(engine)


@settings(max_examples=6, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.tuples(st.sampled_from(PROMPTS), st.sampled_from([None, "a1", "a2"])), min_size=1, max_size=4))
def test_property_any_adapter_assignment_equals_solo_runs(engine, solo, rows):
    outs = engine.generate([p for p, _ in rows], [greedy(n, max_tokens=4) for _, n in rows])  # greedy: the solo runs' first 4
    assert [o.outputs[0].token_ids for o in outs] == [solo[row][:4] for row in rows]
    check_idle(engine)


def test_prefix_cache_blocks_are_kept_apart_per_adapter(engine, solo):
    bm, bs = engine.block_manager, engine.cfg.block_size
    prompt = engine.tokenizer.encode("dog lazy the over jumps fox brown quick the, " * 2, add_special_tokens=False)  # new here
    assert len(prompt) > 2 * bs
    first = block_hash(prompt[:bs], None)
    base_hit, a1_hit = [], []
    for name, hits in ((None, base_hit), ("a1", a1_hit), ("a1", a1_hit)):
        before = bm.hit_tokens
        engine.generate([prompt], greedy(name, max_tokens=1))
        hits.append(bm.hit_tokens - before)
    assert a1_hit[0] == 0, "the adapter's prefill reused blocks the base model computed"
    assert a1_hit[1] > 0, "the adapter's own cached prefix was not reused"
    assert first in bm.hash_to_block and block_hash(prompt[:bs], block_hash_seed("a1")) in bm.hash_to_block
    assert block_hash_seed("a1") != block_hash_seed("a2") and block_hash_seed(None) is None


def test_lru_slots_evict_and_reload_with_the_same_output(tiny_model, adapters, solo):
    engine = lora_engine(tiny_model, adapters, max_loras=1)
    lora = engine.runner.lora
    names = ["a1", "a2", "a1", None, "a2"]
    prompts = (PROMPTS * 2)[: len(names)]
    outs = engine.generate(prompts, [greedy(n, max_tokens=4) for n in names])  # a2 waits while a1 holds the one slot, then takes it
    assert [o.outputs[0].token_ids for o in outs] == [solo[(p, n)][:4] for p, n in zip(prompts, names)]
    assert lora.num_slot_loads == 2 and list(lora.slots) == ["a2"]
    assert engine.generate([PROMPTS[1]], greedy("a1", 4))[0].outputs[0].token_ids == solo[(PROMPTS[1], "a1")][:4]  # evicts a2, reloads a1
    assert lora.num_slot_loads == 3 and list(lora.slots) == ["a1"]
    # The host keeps max_cpu_loras (unset: max_loras, 1) adapters read: admission read a1 and a2 once each, and every
    # slot load above read its adapter again.
    assert list(lora.host) == ["a1"] and lora.num_reads == 5
    check_idle(engine)
    engine.update_weights(read_safetensors(Path(tiny_model)))  # checkpoint names still load into the wrapped linears
    assert engine.generate([PROMPTS[0]], greedy("a1", 4))[0].outputs[0].token_ids == solo[(PROMPTS[0], "a1")][:4]


def test_the_host_keeps_max_cpu_loras_adapters_and_rereads_the_others(tiny_model, adapters, tmp_path):
    import shutil

    a3 = make_adapter(tiny_model, tmp_path / "a3", seed=4, r=4)
    no_rank = shutil.copytree(adapters["a1"], tmp_path / "no_rank")  # a config that lost its rank: refused, not a KeyError
    config = json.loads((no_rank / "adapter_config.json").read_text())
    del config["r"]
    (no_rank / "adapter_config.json").write_text(json.dumps(config))
    names = {"a1": str(adapters["a1"]), "a2": str(adapters["a2"]), "a3": str(a3), "no_rank": str(no_rank)}
    lora_cfg = MultiLoRAConfig(max_loras=1, max_lora_rank=16, max_cpu_loras=2, adapters=names)
    engine = LLMEngine(EngineConfig(model=str(tiny_model), **ENGINE, lora=lora_cfg))
    lora = engine.runner.lora
    for name in ["a1", "a2", "a1", "a2"]:  # both fit on the host: read once each, however often the one slot turns over
        engine.generate([PROMPTS[0]], greedy(name, 2))
    assert (lora.num_reads, lora.num_slot_loads, list(lora.host)) == (2, 4, ["a1", "a2"])
    engine.generate([PROMPTS[0]], greedy("a3", 2))  # a third: the least recently used (a1) leaves the host
    assert (lora.num_reads, list(lora.host)) == (3, ["a2", "a3"])
    engine.generate([PROMPTS[0]], greedy("a1", 2))  # read again
    assert (lora.num_reads, list(lora.host)) == (4, ["a3", "a1"])
    with pytest.raises(ValueError, match="lacks 'r'"):
        lora.check("no_rank")
    with pytest.raises(ValueError, match="lacks 'r'"):
        lora.pin("no_rank")
    assert list(lora.slots) == ["a1"], "a failed read evicted the resident adapter"
    check_idle(engine)
    with pytest.raises(ValueError, match="max_cpu_loras"):
        MultiLoRAConfig(max_loras=2, max_cpu_loras=1)


@pytest.mark.parametrize("linears", [{"cpu_packed_weights": False}, {"quantization": "int8"}])
def test_adapters_wrap_whatever_linear_is_in_place(tiny_model, adapters, solo, linears):
    """Plain (input-major) fp32 linears give the packed ones' tokens; int8 ones run the adapter too."""
    engine = lora_engine(tiny_model, adapters, **linears)
    outs = engine.generate(PROMPTS[:2], [greedy("a1", 4), greedy(None, 4)])
    if "quantization" not in linears:
        assert [o.outputs[0].token_ids for o in outs] == [solo[(PROMPTS[0], "a1")][:4], solo[(PROMPTS[1], None)][:4]]
    else:
        assert outs[0].outputs[0].token_ids != engine.generate([PROMPTS[0]], greedy(None, 4))[0].outputs[0].token_ids
    check_idle(engine)


def test_unknown_incompatible_and_oversized_adapters_are_refused(engine):
    with pytest.raises(ValueError, match="unknown adapter 'nope'"):
        engine.add_request("1 + 1 = ", greedy("nope"))
    with pytest.raises(ValueError, match="another base model"):
        engine.add_request("1 + 1 = ", greedy("foreign"))
    with pytest.raises(ValueError, match="max_lora_rank"):
        engine.add_request("1 + 1 = ", greedy("big"))
    assert not engine.has_unfinished
    config = json.loads((Path(engine.runner.lora.paths["a1"]) / "adapter_config.json").read_text())
    assert config["r"] == 8 and config["peft_type"] == "LORA"
