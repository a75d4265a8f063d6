"""The native engine against transformers: greedy equality, paged attention, prefix cache,
chunked prefill, preemption, abort, sampling, KV export/import, in-place weight updates.
Block accounting is checked after every step of every engine run here."""

from __future__ import annotations

import random

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM, Qwen3Config, Qwen3ForCausalLM

from mlplat.engine import EngineConfig, LLMEngine, QueueFullError, SamplingParams
from mlplat.engine.config import SpeculativeConfig
from mlplat.engine.cpu import CpuPagedAttention, CpuRMSNorm, CpuRopeTables, CpuRotary, CpuSiluAndMul, PackedLinear, paged_attention
from mlplat.engine.model import AttentionMetadata
from mlplat.engine.spec_decode import NgramDrafter, verify
from mlplat.models import load_tokenizer

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def make_checkpoint(path, tokenizer, arch: str):
    """A random-weight checkpoint whose logits are peaked enough that greedy has no near-ties."""
    common = dict(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2)
    if arch == "llama":  # the tiny model's family: GQA, tied embeddings
        model = LlamaForCausalLM(LlamaConfig(**common, tie_word_embeddings=True))
    elif arch == "qwen2":  # QKV bias, untied embeddings, Llama-3 rope scaling
        rope = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                "high_freq_factor": 4.0, "original_max_position_embeddings": 32}
        model = Qwen2ForCausalLM(Qwen2Config(**common, tie_word_embeddings=False, rope_parameters=rope))
    else:  # qwen3: per-head q/k RMSNorm, explicit head_dim
        model = Qwen3ForCausalLM(Qwen3Config(**common, head_dim=32, tie_word_embeddings=False))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def checkpoint(request, tmp_path_factory, tiny_model):
    torch.manual_seed(0)
    return make_checkpoint(tmp_path_factory.mktemp(request.param), load_tokenizer(tiny_model), request.param)


@pytest.fixture(scope="module")
def llama(tmp_path_factory, tiny_model):
    torch.manual_seed(0)
    return make_checkpoint(tmp_path_factory.mktemp("llama"), load_tokenizer(tiny_model), "llama")


def prompts(n=5, seed=0, vocab=256) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, vocab) for _ in range(rng.randint(3, 41))] for _ in range(n)]


def hf_greedy(path, prompt_ids: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    out = []
    for ids in prompt_ids:
        generated = model.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                                   max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0)
        out.append(generated[0, len(ids):].tolist())
    return out


def run_checked(engine: LLMEngine, params=GREEDY, prompt_ids=None, on_step=None) -> list:
    """Run to completion, checking block accounting after every step."""
    ids = [engine.add_request(p, params) for p in prompt_ids]
    done = {}
    step = 0
    while engine.has_unfinished:
        for out in engine.step():
            done[out.request_id] = out
        engine.block_manager.check_invariants(engine.live_sequences())
        step += 1
        if on_step:
            on_step(engine, step)
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks, "blocks leaked"
    return [done[i] for i in ids]


def engine_for(path, **kw) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(path), **{"block_size": 4, "num_kv_blocks": 128, **kw}))


@pytest.mark.parametrize("kernels", [True, False], ids=["cpu-kernels", "aten"])
def test_greedy_equals_transformers_generate(checkpoint, kernels):
    batch = prompts()
    engine = engine_for(checkpoint, cpu_kernels=kernels)
    model = engine.runner.model
    assert engine.runner.decode_kernel == kernels
    swapped = [isinstance(m, cls) for m, cls in ((model.norm, CpuRMSNorm), (model.layers[0].mlp.act, CpuSiluAndMul),
                                                 (model.rotary, CpuRotary), (model.layers[0].self_attn.attn, CpuPagedAttention))]
    assert swapped == [kernels] * 4
    outs = run_checked(engine, prompt_ids=batch)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(checkpoint, batch, GREEDY.max_tokens)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device on this machine: the engine's GPU path is checked where there is one")


@needs_cuda
def test_greedy_on_cuda_equals_transformers_generate(checkpoint):
    """The same code on the GPU: paged prefill, gather + SDPA decodes. fp32 (cuBLAS keeps TF32 off by default):
    on these peaked logits greedy must agree with the CPU reference token for token."""
    batch = prompts()
    engine = engine_for(checkpoint, device="cuda")
    assert engine.runner.kv_cache.is_cuda and not engine.runner.decode_kernel
    outs = run_checked(engine, prompt_ids=batch)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(checkpoint, batch, GREEDY.max_tokens)


@needs_cuda
@pytest.mark.parametrize("dtype, quantization", [("bfloat16", None), ("float16", None), ("float32", "int8")])
def test_cuda_serving_features(llama, dtype, quantization):
    """Half precision and int8 on the GPU: seeded n>1 sampling reproducible, prefix-cache hits and logprobs."""
    make = lambda: engine_for(llama, device="cuda", dtype=dtype, quantization=quantization)  # noqa: E731
    params = SamplingParams(temperature=0.8, top_p=0.9, n=2, seed=3, max_tokens=8, logprobs=True, ignore_eos=True)
    batch = prompts(3, seed=4)
    engine = make()
    first = run_checked(engine, params, batch)
    # Same shapes on a fresh engine: the same draws. (A pass over cached prefixes runs other shapes, whose
    # half-precision logits differ in the last bits: a draw near a boundary could flip, so it is not compared.)
    assert [[o.token_ids for o in r.outputs] for r in run_checked(make(), params, batch)] == [[o.token_ids for o in r.outputs] for r in first]
    cached = run_checked(engine, params, batch)
    assert engine.block_manager.hit_rate > 0
    for r in first + cached:
        assert all(len(o.token_ids) == 8 and all(lp <= 0 for lp in o.logprobs) for o in r.outputs)


def dense_attention(q, k, v, scale):
    """Causal attention of the last len(q) positions over [ctx, KV, D] keys and values, GQA by repetition."""
    n, heads, ctx = q.shape[0], q.shape[1], k.shape[0]
    k = k.repeat_interleave(heads // k.shape[1], dim=1).transpose(0, 1)  # [H, ctx, D]
    v = v.repeat_interleave(heads // v.shape[1], dim=1).transpose(0, 1)
    scores = q.transpose(0, 1) @ k.transpose(1, 2) * scale  # [H, n, ctx]
    causal = torch.arange(ctx)[None, :] <= torch.arange(ctx - n, ctx)[:, None]
    return (scores.masked_fill(~causal, float("-inf")).softmax(-1) @ v).transpose(0, 1)


@pytest.mark.parametrize("decode_kernel", [False, True], ids=["gather-sdpa", "kernel"])
@pytest.mark.parametrize("query_lens, context_lens, group_cost", [
    ([1, 1, 1], [5, 17, 9], None),  # decodes in one padded group
    ([1, 1, 1, 4], [17, 9, 5, 12], 0),  # decodes split into groups by length, then a chunk
    ([7, 3, 1], [7, 11, 20], None),
])
def test_paged_attention_equals_dense(query_lens, context_lens, group_cost, decode_kernel, monkeypatch):
    from mlplat.engine import cpu_kernels, model

    assert not decode_kernel or cpu_kernels.load(), "the C++ decode kernel did not build (see the warning)"
    if group_cost is not None:
        monkeypatch.setattr(model, "GROUP_COST_TOKENS", group_cost)
        assert len(model.decode_groups(context_lens[:3], 4)) == 3
    torch.manual_seed(0)
    block_size, kv_heads, heads, num_blocks = 4, 2, 4, 32
    dim = 16 if decode_kernel else 8  # 8: a head_dim the kernel does not take, which SDPA still must
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, kv_heads, dim).unbind(0)
    order = torch.randperm(num_blocks).tolist()  # blocks scattered over the cache
    tables, dense_k, dense_v = [], [], []
    for ctx in context_lens:
        table = [order.pop() for _ in range((ctx + block_size - 1) // block_size)]
        tables.append(table + [0] * (8 - len(table)))
        dense_k.append(k_cache[table].flatten(0, 1)[:ctx])
        dense_v.append(v_cache[table].flatten(0, 1)[:ctx])
    q = torch.randn(sum(query_lens), heads, dim)
    meta = AttentionMetadata(torch.zeros(0, dtype=torch.long), query_lens, torch.tensor(context_lens), torch.tensor(tables), block_size,
                             decode_kernel=decode_kernel)
    if group_cost is not None:  # decode gathers into reused buffers, larger than needed and full of garbage
        meta.gather_buffers = tuple(torch.full((20, block_size, kv_heads, dim), float("nan")) for _ in range(2))
    out = paged_attention(q, k_cache, v_cache, meta, dim**-0.5)
    start = 0
    for n, k, v in zip(query_lens, dense_k, dense_v):
        torch.testing.assert_close(out[start:start + n], dense_attention(q[start:start + n], k, v, dim**-0.5), atol=1e-5, rtol=1e-5)
        start += n


@pytest.mark.parametrize("head_dim", [16, 32, 64, 128])
@pytest.mark.parametrize("kv_heads, heads", [(1, 1), (2, 6), (2, 16)])  # no GQA, groups of 3 (the tiny model), of 8
# The kernel's two ways to split the work: 5 sequences on 1 thread, one whole sequence per work item; on 4,
# too few sequences for that, so one KV head of a sequence per item.
@pytest.mark.parametrize("threads", [1, 4], ids=["sequence-per-item", "head-per-item"])
def test_decode_kernel_reads_the_paged_cache_in_place(head_dim, kv_heads, heads, threads):
    from mlplat.engine import cpu_kernels

    assert cpu_kernels.load(), "the C++ decode kernel did not build (see the warning)"
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        _check_decode_kernel(cpu_kernels, head_dim, kv_heads, heads)
    finally:
        torch.set_num_threads(previous)


def _check_decode_kernel(cpu_kernels, head_dim, kv_heads, heads):
    torch.manual_seed(head_dim + heads)
    block_size, num_blocks, context_lens = 16, 64, [1, 16, 17, 100, 304]  # the last fills its table's 19 blocks exactly
    k_cache, v_cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim).unbind(0)
    order = torch.randperm(num_blocks).tolist()
    tables = [[order.pop() for _ in range(-(-ctx // block_size))] for ctx in context_lens]
    width = max(map(len, tables))
    # A poisoned row after the table: a kernel that attended past the full-width sequence's last block would
    # read block -1 (memory before the cache) and miss the dense reference.
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables] + [[-1] * width])[:-1]
    # q as the model hands it over: a slice of the rotated [T, H + KV, D] tensor, so rows are strided.
    q = torch.randn(len(context_lens), heads + kv_heads, head_dim)[:, :heads]
    out = cpu_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, torch.tensor(context_lens), head_dim**-0.5)
    for i, (ctx, table) in enumerate(zip(context_lens, tables)):
        k, v = k_cache[table].flatten(0, 1)[:ctx], v_cache[table].flatten(0, 1)[:ctx]
        torch.testing.assert_close(out[i:i + 1], dense_attention(q[i:i + 1], k, v, head_dim**-0.5), atol=1e-5, rtol=1e-5)
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu_kernels.paged_decode_attention(q.double(), k_cache, v_cache, block_tables, torch.tensor(context_lens), 1.0)
    with pytest.raises(RuntimeError, match=r"context_lens\[1\] = 0 is outside 1\.\.304"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, torch.tensor([1, 0, 1, 1, 1]), 1.0)
    block_tables[4, 18] = num_blocks
    with pytest.raises(RuntimeError, match=r"block_tables\[4, 18\] = 64 is outside 0\.\.63"):
        cpu_kernels.paged_decode_attention(q, k_cache, v_cache, block_tables, torch.tensor(context_lens), 1.0)


@pytest.mark.parametrize("shape", [(1, 64), (5, 48), (3, 4, 16), (2, 33), (0, 16)])
def test_rms_norm_kernel_equals_aten(shape):
    from mlplat.engine import cpu_kernels

    assert cpu_kernels.load(), "the C++ kernels did not build (see the warning)"
    torch.manual_seed(len(shape))
    x, weight = torch.randn(*shape) * 3, torch.randn(shape[-1])
    torch.testing.assert_close(cpu_kernels.rms_norm(x, weight, 1e-6), F.rms_norm(x, (shape[-1],), weight, 1e-6))
    # Strided views: every other column, and Qwen3's per-head q norm ([T, H, D] view of the fused qkv rows' first H * D).
    wide = torch.randn(shape[0], 2 * shape[-1])
    torch.testing.assert_close(cpu_kernels.rms_norm(wide[:, 1::2], weight, 1e-5), F.rms_norm(wide[:, 1::2], (shape[-1],), weight, 1e-5))
    heads = torch.randn(shape[0], 6 * shape[-1])[:, : 4 * shape[-1]].view(shape[0], 4, shape[-1])
    torch.testing.assert_close(cpu_kernels.rms_norm(heads, weight, 1e-6), F.rms_norm(heads, (shape[-1],), weight, 1e-6))
    with pytest.raises(RuntimeError, match="float32 only"):
        cpu_kernels.rms_norm(x.double(), weight.double(), 1e-6)
    with pytest.raises(RuntimeError, match=r"x \[\.\.\., N\] and weight \[N\]"):
        cpu_kernels.rms_norm(x, weight[:-1], 1e-6)


@pytest.mark.parametrize("rows", [1, 5, 300])  # 300 rows: several parallel tasks
def test_fused_kernels_equal_aten(rows):
    from mlplat.engine import cpu_kernels
    from mlplat.engine.model import RopeTables

    assert cpu_kernels.load(), "the C++ kernels did not build (see the warning)"
    torch.manual_seed(rows)
    # The skip connection's add and the norm after it, in place.
    x, residual, weight = torch.randn(rows, 96), torch.randn(rows, 96) * 3, torch.randn(96)
    expected_residual = residual + x
    expected = F.rms_norm(expected_residual, (96,), weight, 1e-6)
    cpu_kernels.add_rms_norm_(x, residual, weight, 1e-6)
    torch.testing.assert_close(residual, expected_residual)
    torch.testing.assert_close(x, expected)
    with pytest.raises(RuntimeError, match="x and residual"):
        cpu_kernels.add_rms_norm_(x, residual[:, :48], weight, 1e-6)
    # SwiGLU on the fused [gate | up] projection.
    gate_up = torch.randn(rows, 2 * 40) * 4
    torch.testing.assert_close(cpu_kernels.silu_and_mul(gate_up), F.silu(gate_up[:, :40]) * gate_up[:, 40:])
    with pytest.raises(RuntimeError, match=r"x \[T, 2N\]"):
        cpu_kernels.silu_and_mul(gate_up[:, :-1])
    # RoPE on q and k as the model hands them over: views into the fused qkv rows (strided tokens).
    heads, kv_heads, head_dim = 4, 2, 32
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim)
    angles = torch.rand(rows, 1, head_dim // 2) * 10
    cos, sin = torch.cat((angles.cos(), angles.cos()), -1), torch.cat((-angles.sin(), angles.sin()), -1)
    qk = qkv[:, : (heads + kv_heads) * head_dim].view(rows, heads + kv_heads, head_dim)
    expected = RopeTables(cos, sin).rotate(qk)
    untouched = qkv[:, (heads + kv_heads) * head_dim :].clone()
    assert CpuRopeTables(cos, sin).rotate(qk) is qk
    torch.testing.assert_close(qk, expected)
    torch.testing.assert_close(qkv[:, (heads + kv_heads) * head_dim :], untouched)  # v is not rotated
    with pytest.raises(RuntimeError, match="cos and sin"):
        cpu_kernels.rotary_(qk, cos[:, :, :-1], sin)


def test_prefix_cache_hits_give_identical_outputs(llama):
    shared = prompts(1, seed=1)[0] + prompts(1, seed=2)[0]
    batch = [shared + [5, 6, 7], shared + [9], shared[:-2]]
    engine = engine_for(llama)
    first = run_checked(engine, prompt_ids=batch[:1])
    hits_before = engine.block_manager.hit_tokens
    rest = run_checked(engine, prompt_ids=batch[1:])
    assert engine.block_manager.hit_tokens - hits_before >= 2 * (len(shared) // 4 - 1) * 4
    assert 0 < engine.block_manager.hit_rate <= 1
    uncached = run_checked(engine_for(llama, enable_prefix_caching=False), prompt_ids=batch)
    # A prefill-only request (the PD prefill side) leaves its prompt in the cache too.
    hits_before = engine.block_manager.hit_tokens
    engine.prefill(shared + [11, 12], GREEDY)
    engine.prefill(shared + [13, 14], GREEDY)
    assert engine.block_manager.hit_tokens - hits_before >= 2 * (len(shared) // 4) * 4
    assert [o.outputs[0].token_ids for o in first + rest] == [o.outputs[0].token_ids for o in uncached]


def test_chunked_prefill_and_preemption_leak_nothing(llama):
    batch = prompts(6, seed=3)
    reference = [o.outputs[0].token_ids for o in run_checked(engine_for(llama), prompt_ids=batch)]
    # 14 blocks of 4 tokens cannot hold six 3-41 token prompts plus 12 outputs: preemption must happen.
    engine = engine_for(llama, num_kv_blocks=14, max_num_batched_tokens=8, max_model_len=56)
    outs = run_checked(engine, prompt_ids=batch)
    assert engine.scheduler.num_preemptions > 0
    assert [o.outputs[0].token_ids for o in outs] == reference


def test_abort_frees_blocks_at_once(llama):
    engine = engine_for(llama)
    ids = [engine.add_request(p, GREEDY) for p in prompts(3, seed=4)]
    engine.step()
    engine.step()
    free_before = engine.block_manager.num_free_blocks
    held = len(engine.requests[ids[1]][0].block_table)
    engine.abort(ids[1])
    assert held > 0 and engine.block_manager.num_free_blocks == free_before + held
    engine.block_manager.check_invariants(engine.live_sequences())
    finished = []
    while engine.has_unfinished:
        finished += engine.step()
    assert sorted(o.request_id for o in finished) == sorted([ids[0], ids[2]])
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_seeded_sampling_is_reproducible_and_n_samples_share_the_prompt(llama):
    params = SamplingParams(temperature=1.0, top_k=50, top_p=0.9, seed=7, max_tokens=10, n=4, ignore_eos=True)
    prompt = prompts(1, seed=5)[0] + prompts(1, seed=6)[0]
    engine = engine_for(llama)
    a = run_checked(engine, params, [prompt])[0]
    shared_blocks = (len(prompt) - 1) // 4
    assert engine.block_manager.hit_tokens == 3 * shared_blocks * 4  # samples 1..3 reuse sample 0's prompt
    b = run_checked(engine_for(llama), params, [prompt])[0]
    assert [o.token_ids for o in a.outputs] == [o.token_ids for o in b.outputs]
    assert len({tuple(o.token_ids) for o in a.outputs}) > 1
    c = run_checked(engine_for(llama), params.model_copy(update={"seed": 8}), [prompt])[0]
    assert [o.token_ids for o in c.outputs] != [o.token_ids for o in a.outputs]


def test_logprobs_are_the_models(llama):
    prompt = prompts(1, seed=9)[0]
    out = run_checked(engine_for(llama), GREEDY.model_copy(update={"logprobs": True}), [prompt])[0].outputs[0]
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([prompt + out.token_ids])).logits[0, len(prompt) - 1:-1]
    expected = F.log_softmax(logits, -1).gather(1, torch.tensor(out.token_ids)[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(out.logprobs), expected, atol=1e-4, rtol=1e-4)


def test_stop_token_ids_stop_strings_and_max_tokens(llama):
    engine = engine_for(llama)
    prompt = prompts(1, seed=10)[0]
    full = run_checked(engine, prompt_ids=[prompt])[0].outputs[0]
    assert full.finish_reason == "length" and len(full.token_ids) == GREEDY.max_tokens
    stop_id = full.token_ids[4]
    cut = full.token_ids.index(stop_id)
    stopped = run_checked(engine, GREEDY.model_copy(update={"stop_token_ids": [stop_id]}), [prompt])[0].outputs[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == full.token_ids[:cut]
    # A stop string: the text of a later token that decodes to plain ASCII on its own.
    stop_text = next(t for t in (engine.tokenizer.decode([i]) for i in full.token_ids[2:]) if t.isascii() and t.strip())
    by_text = run_checked(engine, GREEDY.model_copy(update={"stop": [stop_text]}), [prompt])[0].outputs[0]
    assert by_text.finish_reason == "stop"
    assert by_text.text == full.text[: full.text.index(stop_text)]


def test_kv_export_import_gives_identical_continuation(llama):
    batch = prompts(3, seed=11)
    reference = [o.outputs[0].token_ids for o in run_checked(engine_for(llama), prompt_ids=batch)]
    prefill = engine_for(llama, block_size=4)
    decode = engine_for(llama, block_size=8)  # a different block size: payloads are compact
    ids = []
    for prompt in batch:
        payload = prefill.prefill(prompt, GREEDY)
        assert payload.kv.shape[2] == len(prompt) and payload.nbytes > 0
        ids.append(decode.add_prefilled(payload, GREEDY))
    assert prefill.block_manager.num_free_blocks == prefill.runner.num_blocks
    done = {}
    while decode.has_unfinished:
        done.update({o.request_id: o for o in decode.step()})
        decode.block_manager.check_invariants(decode.live_sequences())
    assert [done[i].outputs[0].token_ids for i in ids] == reference
    # Seeded sampling continues the same random stream across the handoff.
    sampled = SamplingParams(temperature=1.0, seed=4, max_tokens=10, ignore_eos=True)
    alone = run_checked(engine_for(llama), sampled, [batch[0]])[0].outputs[0].token_ids
    handed = decode.add_prefilled(prefill.prefill(batch[0], sampled), sampled)
    while decode.has_unfinished:
        done.update({o.request_id: o for o in decode.step()})
    assert done[handed].outputs[0].token_ids == alone
    payload.layout = {**payload.layout, "dtype": "torch.bfloat16"}
    with pytest.raises(ValueError, match="dtype"):
        decode.add_prefilled(payload, GREEDY)


def test_update_weights_in_place(llama, tmp_path, tiny_model):
    torch.manual_seed(1)
    other = make_checkpoint(tmp_path / "other", load_tokenizer(tiny_model), "llama")
    engine = engine_for(llama)
    cache = engine.runner.kv_cache.data_ptr()
    batch = prompts(2, seed=12)
    before = [o.outputs[0].token_ids for o in run_checked(engine, prompt_ids=batch)]
    state = AutoModelForCausalLM.from_pretrained(other).state_dict()
    assert engine.update_weights(state) > 0
    after = [o.outputs[0].token_ids for o in run_checked(engine, prompt_ids=batch)]
    assert engine.runner.kv_cache.data_ptr() == cache
    assert after == [o.outputs[0].token_ids for o in run_checked(engine_for(other), prompt_ids=batch)] != before


def test_back_pressure_and_bad_requests(llama):
    engine = engine_for(llama, max_waiting=2, max_num_seqs=1)
    accepted = [engine.add_request(p, GREEDY) for p in prompts(3, seed=13)]  # 1 running (once scheduled) + 2 waiting
    with pytest.raises(QueueFullError, match="waiting queue is full"):
        engine.add_request([5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        engine.add_request([5] * 250, GREEDY)
    with pytest.raises(ValidationError, match="top_p"):
        SamplingParams(top_p=0)
    finished = []
    while engine.has_unfinished:
        finished += engine.step()
    assert sorted(o.request_id for o in finished) == sorted(accepted)


def test_score_matches_transformers(llama):
    tokens = prompts(1, seed=14)[0]
    engine = engine_for(llama)
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0, :-1]
    expected = F.log_softmax(logits, -1).gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    torch.testing.assert_close(torch.tensor(engine.score(tokens)), expected, atol=1e-4, rtol=1e-4)
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_cpu_packed_weights_match_the_plain_weights(llama):
    from mlplat.engine.quant import weight_bytes

    packed, plain = engine_for(llama), engine_for(llama, cpu_packed_weights=False)
    linears = {n: m for n, m in packed.runner.model.named_modules() if isinstance(m, PackedLinear)}
    assert len(linears) == 2 * 4  # qkv, o, gate_up, down in each of 2 layers; the tied head stays unpacked
    assert all(m.gemv_weight is not None and m.weight.device.type == "meta" for m in linears.values())  # no plain copy kept
    assert not any(isinstance(m, PackedLinear) for m in plain.runner.model.modules())
    assert weight_bytes(packed.runner.model, include_packed=False) == weight_bytes(plain.runner.model)
    # Two oneDNN layouts in place of the plain weight: about twice the projections' memory, not three times.
    assert weight_bytes(plain.runner.model) < weight_bytes(packed.runner.model) < 2.2 * weight_bytes(plain.runner.model)
    # Teacher-forced scoring runs every row at once (the batch copy): same log-probs, same greedy batch;
    # one request alone decodes one row per step (the one-row copy): same tokens.
    tokens = prompts(1, seed=17)[0]
    torch.testing.assert_close(torch.tensor(packed.score(tokens)), torch.tensor(plain.score(tokens)), atol=1e-4, rtol=1e-4)
    for batch in (prompts(6, seed=18), prompts(1, seed=19)):
        assert [o.outputs[0].token_ids for o in run_checked(packed, prompt_ids=batch)] == [
            o.outputs[0].token_ids for o in run_checked(plain, prompt_ids=batch)
        ]
    # Each row count reads its own copy: a zeroed one-row copy zeroes one row's output, not a batch's.
    name, linear = next(iter(linears.items()))
    reference = dict(plain.runner.model.named_modules())[name]
    rows = torch.randn(4, linear.in_features)
    with torch.no_grad():
        torch.testing.assert_close(linear(rows[:1]), reference(rows[:1]), atol=1e-4, rtol=1e-4)
        linear.gemv_weight = torch.ops.mkldnn._reorder_linear_weight(torch.zeros(linear.weight.shape), 1)
        assert linear(rows[:1]).abs().max() == 0
        torch.testing.assert_close(linear(rows), reference(rows), atol=1e-4, rtol=1e-4)


def test_int8_weight_only(llama, tmp_path, tiny_model):
    from mlplat.engine.quant import Int8Linear, weight_bytes

    full, int8 = engine_for(llama), engine_for(llama, quantization="int8")
    linears = [m for m in int8.runner.model.modules() if isinstance(m, Int8Linear)]
    assert len(linears) == 2 * 4 + 1  # qkv, o, gate_up, down in each of 2 layers, and the lm_head
    # Memory: every projection stored in 1 byte per weight (plus scales) instead of 4.
    assert weight_bytes(int8.runner.model) < 0.5 * weight_bytes(full.runner.model)
    # Quality: teacher-forced log-probs stay close; the first greedy token mostly agrees
    # (later ones compound any divergence, so they say little about the quantizer).
    tokens = prompts(1, seed=15)[0]
    drift = (torch.tensor(full.score(tokens)) - torch.tensor(int8.score(tokens))).abs().mean().item()
    assert drift < 0.05, drift
    batch = prompts(8, seed=16)
    first = GREEDY.model_copy(update={"max_tokens": 1})
    ref = [o.outputs[0].token_ids for o in run_checked(full, first, prompt_ids=batch)]
    got = [o.outputs[0].token_ids for o in run_checked(int8, first, prompt_ids=batch)]
    assert sum(r == g for r, g in zip(ref, got)) >= 6, (ref, got)
    # Decoding runs a few rows at a time through the int8 kernel (bf16 activations), prefill and
    # scoring through dequantized weights: both compute the same model, to bf16 precision.
    layer = linears[0]
    x = torch.randn(2, layer.in_features)
    dequantized = F.linear(x, layer.qweight.float() * layer.scale[:, None], layer.bias)
    torch.testing.assert_close(layer(x), dequantized, atol=0.02 * dequantized.abs().max().item(), rtol=0)
    decoded = run_checked(int8, GREEDY.model_copy(update={"max_tokens": 4, "logprobs": True}), prompt_ids=[tokens])[0].outputs[0]
    rescored = int8.score(tokens + decoded.token_ids)[len(tokens) - 1 :]
    torch.testing.assert_close(torch.tensor(decoded.logprobs), torch.tensor(rescored), atol=0.02, rtol=0.05)
    # In-place weight updates re-quantize.
    torch.manual_seed(1)
    other = make_checkpoint(tmp_path / "other", load_tokenizer(tiny_model), "llama")
    int8.update_weights(AutoModelForCausalLM.from_pretrained(other).state_dict())
    other_int8 = engine_for(other, quantization="int8")
    assert int8.score(tokens) == pytest.approx(other_int8.score(tokens), abs=1e-5)


def spec_engine(path, method: str, draft=None, **kw) -> LLMEngine:
    spec = SpeculativeConfig(method=method, num_speculative_tokens=4, draft_model=str(draft) if draft else None)
    return engine_for(path, speculative=spec, **kw)


def test_ngram_speculation_is_lossless_for_greedy(llama):
    batch = [[5, 6, 7, 8, 9, 10] * 6, *prompts(3, seed=17)]  # one repetitive prompt, for lookups to hit
    reference = [o.outputs[0].token_ids for o in run_checked(engine_for(llama), prompt_ids=batch)]
    engine = spec_engine(llama, "ngram")
    assert [o.outputs[0].token_ids for o in run_checked(engine, prompt_ids=batch)] == reference
    assert engine.speculator.num_draft_tokens > 0


def test_ngram_drafts_take_the_latest_match_with_k_tokens_after_it():
    drafter = NgramDrafter(SpeculativeConfig(method="ngram", ngram_max=3))
    assert drafter._one([1, 2, 3, 4, 5, 9, 1, 2, 3, 7, 1, 2, 3], 2) == [7, 1]  # the latest of two matches
    assert drafter._one([1, 2, 3, 4, *[9] * 8], 4) == [9, 9, 9, 9]  # a run: not the overlapping latest match's one token
    assert drafter._one([9, 9, 9, 9, 9], 4) == [9, 9]  # no match of the 3-token tail has 4 after it: its longest continuation
    assert drafter._one([5, 6, 7, 8], 3) == []  # no earlier match of any length


def test_draft_model_speculation(llama, tmp_path, tiny_model):
    batch = prompts(4, seed=18)
    reference = [o.outputs[0].token_ids for o in run_checked(engine_for(llama), prompt_ids=batch)]
    # The target as its own draft: every draft must be accepted.
    same = spec_engine(llama, "draft_model", draft=llama)
    assert [o.outputs[0].token_ids for o in run_checked(same, prompt_ids=batch)] == reference
    assert same.spec_acceptance_rate == 1.0
    # An unrelated draft: outputs still identical to plain greedy, whatever is accepted.
    torch.manual_seed(2)
    other = make_checkpoint(tmp_path / "draft", load_tokenizer(tiny_model), "llama")
    engine = spec_engine(llama, "draft_model", draft=other, num_kv_blocks=24, max_num_batched_tokens=16)
    assert [o.outputs[0].token_ids for o in run_checked(engine, prompt_ids=batch)] == reference
    assert engine.speculator.num_draft_tokens > 0 and engine.spec_acceptance_rate < 1.0
    engine.speculator.drafter.retain(set())  # what the next step does once those sequences are gone
    assert not engine.speculator.drafter.mirrors and engine.speculator.drafter.blocks.num_free_blocks == engine.speculator.drafter.runner.num_blocks


@pytest.mark.parametrize("draft", [0, 4])  # the most and the least likely token as the draft
def test_rejection_sampling_keeps_the_target_distribution(draft):
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0], [0.0] * 6])
    params = SamplingParams(temperature=1.0)
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(6)
    trials = 20_000
    for _ in range(trials):
        counts[verify(logits, [draft], params, generator)[0]] += 1
    torch.testing.assert_close(counts / trials, torch.softmax(logits[0], -1), atol=0.012, rtol=0)


def test_speculative_sampling_is_seeded(llama):
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=10, ignore_eos=True)
    batch = [[5, 6, 7, 8] * 8]
    a = run_checked(spec_engine(llama, "ngram"), params, batch)[0].outputs[0].token_ids
    b = run_checked(spec_engine(llama, "ngram"), params, batch)[0].outputs[0].token_ids
    assert a == b and len(a) == 10


def test_kv_cache_sized_by_memory(llama):
    engine = LLMEngine(EngineConfig(model=str(llama), block_size=4, kv_cache_memory_gb=2**-15))  # 32 KiB
    c = engine.runner.hf_config
    block_bytes = c.num_hidden_layers * 2 * 4 * c.num_key_value_heads * (c.hidden_size // c.num_attention_heads) * 4
    assert engine.runner.num_blocks == 2**15 // block_bytes
    capacity = engine.runner.num_blocks * 4
    assert capacity < engine.runner.max_model_len  # so the cache, not the context, is the limit
    with pytest.raises(ValueError, match="what the KV cache can hold"):
        engine.add_request([5] * (capacity - 3), GREEDY)


def huge_pages_on_request() -> bool:
    try:
        return "[never]" not in open("/sys/kernel/mm/transparent_hugepage/enabled").read()
    except OSError:
        return False


@pytest.mark.skipif(not huge_pages_on_request(), reason="no transparent huge pages on this OS: the KV cache stays on 4 KB pages")
def test_kv_cache_lies_on_huge_pages(llama):
    from mlplat.engine.runner import HUGE_PAGE

    engine = engine_for(llama, num_kv_blocks=2048)  # 4 MB of cache: at least one whole 2 MB page
    cache = engine.runner.kv_cache
    assert cache.data_ptr() % HUGE_PAGE == 0 and not cache.any()
    address, huge_kb = cache.data_ptr(), None
    with open("/proc/self/smaps") as smaps:  # the mapping that holds the cache, and how much of it is on huge pages
        inside = False
        for line in smaps:
            if "-" in line.split()[0] and ":" not in line.split()[0]:
                start, end = (int(x, 16) for x in line.split()[0].split("-"))
                inside = start <= address < end
            elif inside and line.startswith("AnonHugePages:"):
                huge_kb = int(line.split()[1])
    assert huge_kb is not None and huge_kb >= HUGE_PAGE // 1024, f"the KV cache's mapping has {huge_kb} kB on huge pages"
    outs = run_checked(engine, prompt_ids=prompts(2))  # and the engine runs on it
    assert all(len(o.outputs[0].token_ids) == GREEDY.max_tokens for o in outs)


# -- a request's failure is its own ----------------------------------------------------------------
def test_prompt_token_ids_outside_the_vocabulary_are_refused(llama):
    engine = engine_for(llama)
    vocab = engine.vocab_size
    for bad in ([5, vocab, 6], [-1, 5], [5, 2**40]):
        with pytest.raises(ValueError, match="outside the vocabulary"):
            engine.add_request(bad, GREEDY)
    payload = engine_for(llama).prefill([5, 6, 7], GREEDY)
    payload.prompt_token_ids[1] = vocab  # as if from a prefill engine of another model
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_prefilled(payload, GREEDY)
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.runner.num_blocks
    assert run_checked(engine, prompt_ids=[[5, 6, 7]])[0].outputs[0].finish_reason == "length"


def test_an_imported_request_that_stops_on_its_first_token(llama):
    # The PD decode side: the prefill's first token is already a stop token, so the request never
    # enters the scheduler's queues; it must still come out of the next step, or be abortable.
    prefill, decode = engine_for(llama), engine_for(llama)
    payload = prefill.prefill([5, 6, 7, 8], GREEDY)
    stop_at_once = GREEDY.model_copy(update={"stop_token_ids": [payload.first_token]})
    request_id = decode.add_prefilled(payload, stop_at_once)
    assert decode.has_unfinished
    (out,) = decode.step()
    assert out.request_id == request_id and out.outputs[0].finish_reason == "stop" and out.outputs[0].token_ids == []
    aborted = decode.add_prefilled(payload, stop_at_once)
    decode.abort(aborted)  # the client left before the step that would have returned it
    assert not decode.has_unfinished
    assert run_checked(decode, prompt_ids=[[5, 6, 7, 9]])[0].outputs[0].finish_reason == "length"


def test_a_request_that_fails_in_a_step_fails_alone(llama):
    batch = prompts(3, seed=20)
    reference = [o.outputs[0].token_ids for o in run_checked(engine_for(llama), prompt_ids=batch)]
    engine = engine_for(llama)

    def fault(stage, seq):  # the middle request fails in its fourth decode step
        if stage == "sample" and seq.token_ids[: seq.num_prompt_tokens] == batch[1] and seq.num_output_tokens == 3:
            raise RuntimeError("injected fault")

    engine.fault_hook = fault
    ids = [engine.add_request(p, GREEDY) for p in batch]
    done = {}
    while engine.has_unfinished:
        done |= {o.request_id: o for o in engine.step()}
        engine.block_manager.check_invariants(engine.live_sequences())
    assert "injected fault" in str(done[ids[1]].error) and not done[ids[1]].outputs
    assert [done[ids[0]].outputs[0].token_ids, done[ids[2]].outputs[0].token_ids] == [reference[0], reference[2]]
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks and not engine.requests


def test_a_row_whose_sampling_fails_fails_its_request_alone(llama, monkeypatch):
    import mlplat.engine.engine as engine_module

    real_sample = engine_module.sample

    def sample(logits, params, *rest):  # one request's parameters break the batched sampler
        if any(p.seed == 666 for p in params):
            raise RuntimeError("bad sampling row")
        return real_sample(logits, params, *rest)

    monkeypatch.setattr(engine_module, "sample", sample)
    batch = prompts(3, seed=21)
    reference = [o.outputs[0].token_ids for o in run_checked(engine_for(llama), prompt_ids=batch)]
    engine = engine_for(llama)
    ids = [engine.add_request(batch[0], GREEDY), engine.add_request(batch[1], GREEDY.model_copy(update={"seed": 666, "n": 2})),
           engine.add_request(batch[2], GREEDY)]  # fmt: skip
    done = {}
    while engine.has_unfinished:
        done |= {o.request_id: o for o in engine.step()}
        engine.block_manager.check_invariants(engine.live_sequences())
    assert "bad sampling row" in str(done[ids[1]].error)
    assert [done[ids[0]].outputs[0].token_ids, done[ids[2]].outputs[0].token_ids] == [reference[0], reference[2]]
    assert engine.block_manager.num_free_blocks == engine.runner.num_blocks


def test_a_fault_in_the_forward_pass_propagates(llama):
    engine = engine_for(llama)
    engine.add_request([5, 6, 7], GREEDY)
    engine.fault_hook = lambda stage, seq: (_ for _ in ()).throw(RuntimeError("device lost")) if stage == "forward" else None
    with pytest.raises(RuntimeError, match="device lost"):
        engine.step()


def test_imported_requests_holding_the_whole_cache_do_not_wait_for_each_other(llama):
    # Found by tests/test_engine_state_machine.py: on a decode engine, waiting imported requests hold
    # their prompts' KV; with every block held that way and nothing running, the head of the queue
    # could never get the block for its next token, and the engine stepped forever without progress.
    prefill, decode = engine_for(llama), engine_for(llama, num_kv_blocks=6, max_num_seqs=1)
    batch = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19, 20], [21, 22, 23, 24, 25, 26, 27, 28]]
    params = GREEDY.model_copy(update={"max_tokens": 4})
    reference = [o.outputs[0].token_ids for o in run_checked(engine_for(llama), params, batch)]
    ids = [decode.add_prefilled(prefill.prefill(p, params), params) for p in batch]  # 2 blocks each: all 6 held
    done, steps = {}, 0
    while decode.has_unfinished:
        done |= {o.request_id: o for o in decode.step()}
        decode.block_manager.check_invariants(decode.live_sequences())
        steps += 1
        assert steps < 100, "no progress"
    assert [done[i].outputs[0].token_ids for i in ids] == reference
    assert decode.block_manager.num_free_blocks == 6


# -- sampling controls: logit_bias, min_tokens, penalties, min_p (the formulas: tests/test_sampler.py) ------------
def test_logit_bias_forces_a_token_and_the_log_probs_stay_the_models(llama):
    engine = engine_for(llama)
    prompt = prompts(1, seed=22)[0]
    sampled = SamplingParams(temperature=1.0, top_p=0.9, seed=0, max_tokens=12, ignore_eos=True)
    for params in (GREEDY, sampled):
        out = run_checked(engine, params.model_copy(update={"logit_bias": {42: 100.0}, "logprobs": True}), [prompt])[0].outputs[0]
        assert out.token_ids == [42] * 12
        # Log-probs of the raw model (what an RL trainer recomputes), not of the biased distribution (where 42 is certain).
        raw = engine.score(prompt + out.token_ids)[len(prompt) - 1 :]
        torch.testing.assert_close(torch.tensor(out.logprobs), torch.tensor(raw), atol=1e-4, rtol=1e-4)
        assert max(out.logprobs) < -0.5


def test_top_k_1_equals_greedy(llama):
    batch = prompts(4, seed=23)
    engine = engine_for(llama)
    greedy = [o.outputs[0].token_ids for o in run_checked(engine, GREEDY, batch)]
    top_1 = SamplingParams(temperature=1.3, top_k=1, max_tokens=12, ignore_eos=True)
    assert [o.outputs[0].token_ids for o in run_checked(engine, top_1, batch)] == greedy


def test_min_tokens_holds_off_eos_and_stop_tokens(llama):
    engine = engine_for(llama)
    eos = engine.tokenizer.eos_token_id
    prompt = prompts(1, seed=24)[0]
    # A request whose answer stops at once: EOS pushed to the top.
    stops_at_once = GREEDY.model_copy(update={"ignore_eos": False, "logit_bias": {eos: 100.0}})
    out = run_checked(engine, stops_at_once, [prompt])[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids == [] and out.sampled_token_ids == [eos]
    for params in (stops_at_once, stops_at_once.model_copy(update={"temperature": 1.0, "seed": 1})):
        held = run_checked(engine, params.model_copy(update={"min_tokens": 5}), [prompt])[0].outputs[0]
        assert held.finish_reason == "stop" and len(held.token_ids) == 5 and eos not in held.token_ids
        assert held.sampled_token_ids == held.token_ids + [eos]
    # A stop token id likewise.
    stop = GREEDY.model_copy(update={"logit_bias": {42: 100.0}, "stop_token_ids": [42], "min_tokens": 3})
    out = run_checked(engine, stop, [prompt])[0].outputs[0]
    assert out.finish_reason == "stop" and len(out.token_ids) == 3 and 42 not in out.token_ids
    # Under ignore_eos, EOS is a plain token: min_tokens leaves it be.
    plain_eos = GREEDY.model_copy(update={"logit_bias": {eos: 100.0}, "min_tokens": 5})
    assert run_checked(engine, plain_eos, [prompt])[0].outputs[0].token_ids == [eos] * 12


def test_penalties_apply_to_each_requests_own_history(llama):
    """Greedy with penalties: each token is the argmax of the model's logits adjusted over the request's prompt and
    output so far, through plain steps, speculative decoding (such requests do not speculate) and preemption."""
    from types import SimpleNamespace

    from mlplat.engine.sampling import adjust_logits

    params = GREEDY.model_copy(update={"presence_penalty": 1.0, "frequency_penalty": 0.5, "repetition_penalty": 1.5})
    batch = [[5, 6, 7, 8, 9, 10] * 6, *prompts(3, seed=25)]  # a repetitive prompt: n-gram drafts would hit
    model = AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32).eval()
    expected = []
    for prompt in batch:
        ids = list(prompt)
        for _ in range(params.max_tokens):
            with torch.no_grad():
                logits = model(torch.tensor([ids])).logits[0, -1:]
            ids.append(int(adjust_logits(logits, [params], [SimpleNamespace(token_ids=ids, num_prompt_tokens=len(prompt))], ()).argmax()))
        expected.append(ids[len(prompt) :])
    assert expected != [o.outputs[0].token_ids for o in run_checked(engine_for(llama), prompt_ids=batch)]  # the penalties did something
    assert [o.outputs[0].token_ids for o in run_checked(engine_for(llama), params, batch)] == expected
    spec = spec_engine(llama, "ngram")
    assert [o.outputs[0].token_ids for o in run_checked(spec, params, batch)] == expected
    assert spec.speculator.num_draft_tokens == 0
    plain = [[5, 6, 7, 8, 9, 10] * 6, *prompts(3, seed=17)]  # beside plain requests, which still speculate
    mixed = spec.generate(batch + plain, [params] * len(batch) + [GREEDY] * len(plain))
    assert [o.outputs[0].token_ids for o in mixed[: len(batch)]] == expected and spec.speculator.num_draft_tokens > 0
    preempting = engine_for(llama, num_kv_blocks=14, max_num_batched_tokens=8, max_model_len=56)
    assert [o.outputs[0].token_ids for o in run_checked(preempting, params, batch)] == expected
    assert preempting.scheduler.num_preemptions > 0


def test_sampling_controls_survive_a_pd_handoff(llama):
    eos = engine_for(llama).tokenizer.eos_token_id
    batch = prompts(3, seed=26)
    prefill, decode = engine_for(llama), engine_for(llama)
    sampled = SamplingParams(temperature=0.8, seed=5, max_tokens=10, min_tokens=4, min_p=0.05, presence_penalty=0.8, frequency_penalty=0.3,
                             repetition_penalty=1.2, logit_bias={eos: 3.0, 7: 2.0})  # fmt: skip
    held = GREEDY.model_copy(update={"ignore_eos": False, "logit_bias": {eos: 100.0}, "min_tokens": 5})
    for params in (sampled, held):
        alone = [o.outputs[0].token_ids for o in run_checked(engine_for(llama), params, batch)]
        payloads = [prefill.prefill(p, params) for p in batch]
        assert params is sampled or all(p.first_token != eos for p in payloads)  # min_tokens held on the prefill side too
        ids = [decode.add_prefilled(p, params) for p in payloads]
        done = {}
        while decode.has_unfinished:
            done |= {o.request_id: o for o in decode.step()}
        assert [done[i].outputs[0].token_ids for i in ids] == alone


def test_a_seeded_request_samples_the_same_alone_and_in_a_batch_of_8(llama):
    seeded = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, min_p=0.02, presence_penalty=0.5, repetition_penalty=1.1, seed=11,
                            max_tokens=12, ignore_eos=True)  # fmt: skip
    prompt = prompts(1, seed=27)[0]
    alone = run_checked(engine_for(llama), seeded, [prompt])[0].outputs[0].token_ids
    others = [
        GREEDY.model_copy(update={"logit_bias": {9: 5.0}, "max_tokens": 4}),
        SamplingParams(temperature=1.0, seed=11, max_tokens=6, ignore_eos=True),  # the same seed, other controls
        SamplingParams(temperature=1.0, max_tokens=12, ignore_eos=True),  # unseeded
        SamplingParams(temperature=0.7, top_p=0.5, frequency_penalty=2.0, seed=1, max_tokens=9, ignore_eos=True),
        SamplingParams(temperature=1.2, min_p=0.2, min_tokens=3, seed=2, max_tokens=5),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, n=2, max_tokens=7, ignore_eos=True),
    ]  # fmt: skip
    another_seed = seeded.model_copy(update={"seed": 12})
    outs = engine_for(llama).generate([prompt, *prompts(7, seed=28)[1:], prompt], [seeded, *others, another_seed])
    assert outs[0].outputs[0].token_ids == alone
    assert outs[-1].outputs[0].token_ids != alone  # another seed: another sample
    assert len(set(alone)) > 3


def test_logit_bias_outside_the_vocabulary_is_refused(llama):
    engine = engine_for(llama)
    bad = GREEDY.model_copy(update={"logit_bias": {5: 1.0, engine.vocab_size: 2.0}})
    with pytest.raises(ValueError, match=rf"logit_bias token id {engine.vocab_size} is outside the vocabulary"):
        engine.add_request([5, 6, 7], bad)
    payload = engine_for(llama).prefill([5, 6, 7], GREEDY)
    with pytest.raises(ValueError, match="logit_bias token id"):
        engine.add_prefilled(payload, bad)
    assert not engine.requests and engine.block_manager.num_free_blocks == engine.runner.num_blocks
