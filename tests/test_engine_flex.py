"""The FlexAttention backend (``attention_backend: flex``) and the static-buffer decode path that CUDA graphs
replay (``cuda_graph_batch_sizes``), on CPU: FlexAttention runs eagerly here, the static buffers without
capture. Outputs must equal the default path's (gather + SDPA, the C++ decode kernel)."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError
from test_engine import GREEDY, make_checkpoint, prompts, run_checked
from torch import nn
from torch.nn.attention.flex_attention import create_mask

from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
from mlplat.engine.config import SpeculativeConfig
from mlplat.engine.cuda_graph import DecodeGraphs
from mlplat.engine.flex import FlexAttentionMetadata, FlexPagedAttention, use_flex_attention_
from mlplat.engine.model import AttentionMetadata, PagedAttention
from mlplat.models import load_tokenizer


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_model):
    torch.manual_seed(0)
    return make_checkpoint(tmp_path_factory.mktemp("llama"), load_tokenizer(tiny_model), "llama")


def engine_for(path, graph_sizes=(), **kw) -> LLMEngine:
    cfg = EngineConfig(model=str(path), **{"block_size": 4, "num_kv_blocks": 64, **kw})
    if graph_sizes:  # the static-buffer path without capture: config validation allows it on CUDA only
        cfg = cfg.model_copy(update={"cuda_graph_batch_sizes": list(graph_sizes)})
    return LLMEngine(cfg)


def run_each(engine: LLMEngine, params: list[SamplingParams], prompt_ids) -> list[list[list[int]]]:
    """run_checked with one SamplingParams per prompt."""
    ids = [engine.add_request(p, sp) for p, sp in zip(prompt_ids, params)]
    done = {}
    while engine.has_unfinished:
        done |= {out.request_id: out for out in engine.step()}
        engine.block_manager.check_invariants(engine.live_sequences())
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks, "blocks leaked"
    return tokens([done[i] for i in ids])


def tokens(outs) -> list[list[list[int]]]:
    return [[o.token_ids for o in r.outputs] for r in outs]


# -- attention ---------------------------------------------------------------------------------
def check_block_mask(mask, real_rows: list[int], q_len: int):
    """The block mask agrees with its own mask_mod on every real query row: each block holding a visible
    key is listed once (partial or full), and a full block is visible throughout. (Eager FlexAttention
    ignores the block lists, compiled kernels read only them: this is what keeps the two the same.)"""
    B, _, M, num_blocks = mask.kv_indices.shape
    q_block, kv_block = mask.BLOCK_SIZE
    visible = create_mask(mask.mask_mod, B, 1, q_len, num_blocks * kv_block, device="cpu")[:, 0]  # [B, q_len, slots]
    for b in range(B):
        for m in range(M):
            rows = visible[b, m * q_block : min((m + 1) * q_block, real_rows[b])].unflatten(1, (num_blocks, kv_block))
            partial = mask.kv_indices[b, 0, m, : mask.kv_num_blocks[b, 0, m]].tolist()
            full = mask.full_kv_indices[b, 0, m, : mask.full_kv_num_blocks[b, 0, m]].tolist()
            assert len(set(partial + full)) == len(partial) + len(full), "a block listed twice"
            assert set(rows.any(-1).any(0).nonzero().flatten().tolist()) <= set(partial + full), "a visible key the kernel would skip"
            assert all(rows[:, j].all() for j in full), "a full block with masked keys"


@settings(max_examples=20, deadline=None)
@given(
    block_size=st.sampled_from([1, 2, 4, 8]),
    kv_heads_group=st.sampled_from([(1, 1), (2, 2), (2, 4), (1, 3)]),
    seqs=st.lists(st.tuples(st.integers(1, 9), st.integers(0, 30)), min_size=1, max_size=5),  # (new tokens, cached before)
    shared=st.integers(0, 3),
    q_block=st.sampled_from([1, 2, 4, 128]),
    data=st.data(),
)
def test_flex_attention_equals_gather_sdpa(block_size, kv_heads_group, seqs, shared, q_block, data):
    """Random decodes and chunks over scattered blocks, the first ``shared`` blocks of every sequence one and
    the same (a prefix-cache hit): FlexAttention over the cache in place equals gather + SDPA."""
    kv_heads, heads = kv_heads_group[0], kv_heads_group[0] * kv_heads_group[1]
    seqs = sorted(seqs, key=lambda s: s[0] != 1)  # decodes first, as the runner orders them
    query_lens, context_lens = [n for n, _ in seqs], [n + c for n, c in seqs]
    pages = [-(-c // block_size) for c in context_lens]
    shared = min(shared, *[p - 1 for p in pages])  # a sequence's last block is its own (it is being written)
    num_blocks = shared + sum(p - shared for p in pages) + 2
    free = data.draw(st.permutations(range(num_blocks)))
    common, free = free[:shared], free[shared:]
    tables = []
    for p in pages:
        own, free = free[: p - shared], free[p - shared :]
        tables.append(common + own + [0] * (max(pages) - p))  # padded with 0: a real block of some other sequence
    torch.manual_seed(0)
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, kv_heads, 8).unbind(0)
    q = torch.randn(sum(query_lens), heads, 8)
    args = (torch.zeros(0, dtype=torch.long), query_lens, torch.tensor(context_lens), torch.tensor(tables), block_size)
    meta = FlexAttentionMetadata(*args, num_kv_blocks=num_blocks, group=heads // kv_heads, q_block=q_block)
    with torch.inference_mode():
        expected = PagedAttention()(q, k_cache, v_cache, AttentionMetadata(*args), 8**-0.5)
        out = FlexPagedAttention()(q, k_cache, v_cache, meta, 8**-0.5)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    nd = meta.num_decodes
    if meta.decode_mask is not None:
        # Padded to a power of two, each decode's query heads as `group` rows of its KV head's query.
        check_block_mask(meta.decode_mask, [meta.group] * nd + [0] * (meta.decode_batch - nd), meta.group)
    if meta.prefill_mask is not None:
        check_block_mask(meta.prefill_mask, query_lens[nd:], meta.prefill_len)


@pytest.mark.skipif(not os.environ.get("MLPLAT_TEST_COMPILE"), reason="compiles FlexAttention's CPU kernels (~30 s); set MLPLAT_TEST_COMPILE=1")
@pytest.mark.parametrize("block_size, q_block", [(16, 128), (4, 2)])
def test_compiled_flex_attention_reads_only_the_listed_blocks(block_size, q_block):
    """Compiled FlexAttention (inductor's CPU kernels, which like the CUDA ones visit only the blocks the mask lists,
    full blocks without mask_mod) through the module swap the runner makes on CUDA, kernel options included."""
    torch.manual_seed(0)
    kv_heads, heads, num_blocks, dim = 2, 8, 48, 16
    query_lens, context_lens = [1, 1, 1, 20, 7], [40, 17, 5, 50, 7]
    order = torch.randperm(num_blocks).tolist()
    tables = [[order.pop() for _ in range(-(-c // block_size))] for c in context_lens]
    tables[1][:2] = tables[0][:2]  # a prefix shared by two sequences
    tables = [t + [0] * (13 - len(t)) for t in tables]
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim).unbind(0)
    q = torch.randn(sum(query_lens), heads, dim)
    args = (torch.zeros(0, dtype=torch.long), query_lens, torch.tensor(context_lens), torch.tensor(tables), block_size)
    attention = use_flex_attention_(nn.Sequential(PagedAttention()), block_size, compile=True)[0]
    meta = FlexAttentionMetadata(*args, num_kv_blocks=num_blocks, group=heads // kv_heads, q_block=q_block)
    with torch.inference_mode():
        expected = PagedAttention()(q, k_cache, v_cache, AttentionMetadata(*args), dim**-0.5)
        torch.testing.assert_close(attention(q, k_cache, v_cache, meta, dim**-0.5), expected, atol=1e-5, rtol=1e-5)


# -- the engine --------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_flex_greedy_equals_the_default_path(arch, tmp_path, tiny_model):
    torch.manual_seed(0)
    path = make_checkpoint(tmp_path / arch, load_tokenizer(tiny_model), arch)
    batch = prompts(3)
    engine = engine_for(path, attention_backend="flex")
    assert isinstance(engine.runner.model.layers[0].self_attn.attn, FlexPagedAttention) and not engine.runner.decode_kernel
    assert tokens(run_checked(engine, prompt_ids=batch)) == tokens(run_checked(engine_for(path), prompt_ids=batch))


def test_flex_greedy_equals_the_default_path_with_chunks_preemption_and_prefix_hits(llama):
    batch = prompts(5, seed=3)
    expected = tokens(run_checked(engine_for(llama), prompt_ids=batch))
    # 14 blocks of 4 tokens, 8 tokens a step: prefills in chunks, and preemption with recompute.
    engine = engine_for(llama, attention_backend="flex", num_kv_blocks=14, max_num_batched_tokens=8, max_model_len=56)
    assert tokens(run_checked(engine, prompt_ids=batch)) == expected
    assert engine.scheduler.num_preemptions > 0
    # Prompts sharing a prefix on a warm cache: their blocks are read by several sequences in one step.
    engine = engine_for(llama, attention_backend="flex")
    shared = prompts(1, seed=1)[0] + prompts(1, seed=2)[0]
    hits = [shared + [5, 6, 7], shared + [9], shared[:-2]]
    run_checked(engine, prompt_ids=[shared])
    assert tokens(run_checked(engine, prompt_ids=hits)) == tokens(run_checked(engine_for(llama, enable_prefix_caching=False), prompt_ids=hits))
    assert engine.block_manager.hit_tokens > 0


def test_flex_sampling_n_and_speculation_equal_the_default_path(llama):
    batch = prompts(3, seed=4)
    sampled = SamplingParams(temperature=0.8, top_p=0.9, n=2, seed=3, max_tokens=6, ignore_eos=True)
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    repetitive = [[5, 6, 7, 8, 9, 10] * 4, batch[0]]
    for kw, params, ids in [({}, sampled, batch), ({"speculative": spec}, GREEDY, repetitive)]:
        engine = engine_for(llama, attention_backend="flex", **kw)
        assert tokens(run_checked(engine, params, ids)) == tokens(run_checked(engine_for(llama, **kw), params, ids))
    assert engine.speculator.num_draft_tokens > 0


def test_padded_static_decode_path_equals_eager(llama, monkeypatch):
    """Decode-only steps through the static buffers CUDA graphs replay, padded up to the next size (5 -> 6, 3 -> 4,
    1 -> 2 as requests finish), give the eager outputs; prefills and speculative verifies stay eager."""
    batch = prompts(5, seed=5)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (3, 5, 7, 9, 11)]
    expected = run_each(engine_for(llama), params, batch)
    padded = []
    run = DecodeGraphs.run
    monkeypatch.setattr(DecodeGraphs, "run", lambda self, b: padded.append((len(b), next(s for s in self.sizes if s >= len(b)))) or run(self, b))
    engine = engine_for(llama, graph_sizes=[2, 4, 6], attention_backend="flex")
    assert engine.runner.kv_cache.shape[2] == engine.runner.num_blocks + 1  # the spare block padding rows write to
    assert run_each(engine, params, batch) == expected
    assert {(5, 6), (3, 4), (1, 2)} <= set(padded)
    # With n-gram drafts: verifies run eagerly, decodes without drafts through the buffers.
    spec = SpeculativeConfig(method="ngram", num_speculative_tokens=3)
    repetitive = [[5, 6, 7, 8, 9, 10] * 4, *batch[:2]]
    engine = engine_for(llama, graph_sizes=[2, 4], attention_backend="flex", speculative=spec)
    padded.clear()
    assert tokens(run_checked(engine, GREEDY, repetitive)) == tokens(run_checked(engine_for(llama), GREEDY, repetitive))
    assert padded and engine.speculator.num_draft_tokens > 0


def test_cuda_graph_sizes_are_checked_at_the_config_edge(llama):
    with pytest.raises(ValidationError, match="cuda_graph_batch_sizes needs device 'cuda'.*cuda_graph_batch_sizes: \\[\\]"):
        EngineConfig(model=str(llama), attention_backend="flex", cuda_graph_batch_sizes=[1, 8])
    with pytest.raises(ValidationError, match="needs attention_backend 'flex'"):
        EngineConfig(model=str(llama), device="cuda", cuda_graph_batch_sizes=[1, 8])
    with pytest.raises(ValidationError, match="positive"):
        EngineConfig(model=str(llama), device="cuda", attention_backend="flex", cuda_graph_batch_sizes=[0])
    assert EngineConfig(model=str(llama), device="cuda", attention_backend="flex", cuda_graph_batch_sizes=[1, 8]).cuda_graph_batch_sizes == [1, 8]
    with pytest.raises(ValidationError):
        EngineConfig(model=str(llama), attention_backend="triton")


@settings(max_examples=200, deadline=None)
@given(device=st.sampled_from(["cpu", "cuda", "cuda:1"]), backend=st.sampled_from(["sdpa", "flex"]), block_size=st.integers(1, 64),
       sizes=st.lists(st.integers(-2, 128), max_size=4))
def test_any_gpu_path_config_is_accepted_exactly_when_it_can_run(device, backend, block_size, sizes):
    """Generated settings of the two flags: accepted where the engine can run them, else refused naming the field."""
    kwargs = dict(model="/m", device=device, attention_backend=backend, block_size=block_size, cuda_graph_batch_sizes=sizes)
    cuda, flex = device.startswith("cuda"), backend == "flex"
    runnable = not (cuda and flex and block_size % 16) and (not sizes or (min(sizes) >= 1 and cuda and flex))
    if runnable:
        assert EngineConfig(**kwargs).cuda_graph_batch_sizes == sizes
    else:
        with pytest.raises(ValidationError, match="block_size|cuda_graph_batch_sizes"):
            EngineConfig(**kwargs)
