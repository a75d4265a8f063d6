"""The engine's checks: greedy parity with transformers, bf16 serving features, the KV handoff, throughput
against ``generate``, CUDA graphs, and the decode step against the device's rooflines."""

from __future__ import annotations

import time

import torch

from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
from mlplat.engine.config import SpeculativeConfig
from mlplat.gpucheck.common import (
    ATTENTION_BACKENDS,
    MARGIN_TOLERANCE,
    Outcome,
    Settings,
    arch_checkpoint,
    compare_greedy,
    engine_greedy,
    expect_greedy_match,
    prompts,
    shape_checkpoint,
)
from mlplat.gpucheck.measure import copy_bandwidth, decode_step_time, engine_throughput, hf_throughput, matmul_rate, workload

ARCHS = ("llama", "qwen2", "qwen3")
INT8_MARGIN = 0.5


def small_engine(settings: Settings, path, **kw) -> LLMEngine:
    """An engine over a test checkpoint. Blocks of 16 tokens, the smallest FlexAttention's compiled kernels take (prompts still
    span several); 768 tokens of cache hold every batch here, and a small cache keeps FlexAttention's eager CPU reference fast."""
    return LLMEngine(EngineConfig(model=str(path), **{"block_size": 16, "num_kv_blocks": 48, **settings.engine_kwargs(), **kw}))


def hf_greedy(path, batch: list[list[int]], max_new_tokens: int, device: torch.device) -> tuple[list[list[int]], list[list[float]]]:
    """transformers ``generate``'s greedy tokens on ``device`` in fp32, one prompt at a time, with the top-2 logit margin at each step."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device).eval()
    model.generation_config.eos_token_id = None  # the engine runs with ignore_eos
    tokens, margins = [], []
    for ids in batch:
        out = model.generate(torch.tensor([ids], device=device), attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device),
                             max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)  # fmt: skip
        tokens.append(out.sequences[0, len(ids) :].tolist())
        top2 = torch.stack(out.logits)[:, 0].float().topk(2, dim=-1).values
        margins.append((top2[:, 0] - top2[:, 1]).tolist())
    return tokens, margins


def greedy_parity(settings: Settings, outcome: Outcome) -> None:
    """The engine's greedy output equals transformers ``generate`` on the same device in fp32, for the Llama, Qwen2
    and Qwen3 test configs, on each attention path."""
    tolerance = MARGIN_TOLERANCE["float32"]
    batch, max_tokens = prompts(2 if settings.quick else 8), 8 if settings.quick else 24
    for arch in ARCHS:
        path = arch_checkpoint(settings, arch)
        reference, margins = hf_greedy(path, batch, max_tokens, settings.torch_device)
        for backend in ATTENTION_BACKENDS:
            engine = small_engine(settings, path, attention_backend=backend)
            got, _ = engine_greedy(engine, batch, max_tokens)
            comparison = compare_greedy(reference, margins, got, tolerance)
            outcome.record(**{f"{arch}_{backend}": comparison})
            expect_greedy_match(outcome, f"{arch} ({backend})", comparison)


def serving_bf16(settings: Settings, outcome: Outcome) -> None:
    """bf16 serving features on the Llama test config: a prefix-cache hit gives the uncached output, seeded
    sampling reproduces, int8 weight-only stays close to the full model, speculative decoding (n-gram and a
    draft model) gives plain greedy's output."""
    dtype = settings.serving_dtype
    tolerance = MARGIN_TOLERANCE[dtype]
    llama = arch_checkpoint(settings, "llama")
    make = lambda **kw: small_engine(settings, llama, dtype=dtype, **kw)  # noqa: E731
    max_tokens = 8 if settings.quick else 16

    # Prefix cache: the first request fills it, the rest hit it; the same prompts on an engine without a cache.
    shared = prompts(1, seed=1, lengths=(40, 40))[0]  # two full blocks of 16: hits the others can take
    batch = [shared + [5, 6, 7], shared + [9], shared[:-2]]
    engine = make()
    first, first_margins = engine_greedy(engine, batch[:1], max_tokens)
    hits_before = engine.block_manager.hit_tokens
    rest, rest_margins = engine_greedy(engine, batch[1:], max_tokens)
    hit_tokens = engine.block_manager.hit_tokens - hits_before
    uncached, _ = engine_greedy(make(enable_prefix_caching=False), batch, max_tokens)
    comparison = compare_greedy(first + rest, first_margins + rest_margins, uncached, tolerance)
    outcome.record(prefix_hit_tokens=hit_tokens, prefix_cache=comparison)
    outcome.expect(hit_tokens > 0, "prefix cache: the second and third prompts hit no cached block")
    expect_greedy_match(outcome, "prefix cache hit vs uncached", comparison)

    # Seeded sampling: the same shapes on a fresh engine draw the same tokens.
    params = SamplingParams(temperature=0.8, top_p=0.9, n=2, seed=3, max_tokens=max_tokens, logprobs=True, ignore_eos=True)
    sampled = [[o.token_ids for o in r.outputs] for r in make().generate(prompts(3, seed=4), params)]
    again = [[o.token_ids for o in r.outputs] for r in make().generate(prompts(3, seed=4), params)]
    outcome.record(seeded_sampling_reproducible=sampled == again, seeded_samples_distinct=any(len({tuple(t) for t in r}) > 1 for r in sampled))
    outcome.expect(sampled == again, "seeded sampling: a fresh engine drew other tokens with the same seed")

    # int8 weight-only against the same engine unquantized, both over fp32 weights as the engine's tests run it (the int8
    # kernel computes in bf16 either way): teacher-forced log-probs close, and first greedy tokens equal wherever the
    # unquantized model's top-2 margin exceeds INT8_MARGIN (int8 moves log-probs by a few hundredths).
    from mlplat.engine.quant import weight_bytes

    full, int8 = small_engine(settings, llama), small_engine(settings, llama, quantization="int8")
    tokens = prompts(1, seed=15)[0]
    drift = (torch.tensor(full.score(tokens)) - torch.tensor(int8.score(tokens))).abs().mean().item()
    reference, margins = engine_greedy(full, prompts(16, seed=16), 1)
    got, _ = engine_greedy(int8, prompts(16, seed=16), 1)
    comparison = compare_greedy(reference, margins, got, INT8_MARGIN)
    ratio = weight_bytes(int8.runner.model) / weight_bytes(full.runner.model, include_packed=False)  # CPU: not its oneDNN copies
    outcome.record(int8_logprob_drift=drift, int8_first_tokens=comparison, int8_weight_bytes_ratio=ratio)
    outcome.expect(drift < 0.1, f"int8: mean teacher-forced log-prob drift {drift:.4f} >= 0.1")
    expect_greedy_match(outcome, "int8 first tokens", comparison)
    outcome.expect(ratio < 0.5, f"int8: weights take {ratio:.2f} of the unquantized bytes")

    # Speculative decoding, lossless for greedy: n-gram lookup on a repetitive prompt, and the target as its own draft.
    batch = [[5, 6, 7, 8, 9, 10] * 6, *prompts(3, seed=17)]
    reference, margins = engine_greedy(make(), batch, max_tokens)
    for method, draft in (("ngram", None), ("draft_model", str(llama))):
        spec = make(speculative=SpeculativeConfig(method=method, num_speculative_tokens=4, draft_model=draft))
        got = [o.outputs[0].token_ids for o in spec.generate(batch, SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True))]
        comparison = compare_greedy(reference, margins, got, tolerance)
        outcome.record(**{f"speculative_{method}": comparison, f"speculative_{method}_acceptance": spec.spec_acceptance_rate,
                          f"speculative_{method}_draft_tokens": spec.speculator.num_draft_tokens})  # fmt: skip
        outcome.expect(spec.speculator.num_draft_tokens > 0, f"speculative {method}: no token was drafted")
        expect_greedy_match(outcome, f"speculative {method}", comparison)


def kv_handoff(settings: Settings, outcome: Outcome) -> None:
    """A prompt's KV exported by one engine and imported by another on the same device (other block size) gives the
    continuation one engine alone gives: greedy, and seeded sampling continuing the same random stream."""
    dtype = settings.serving_dtype
    llama = arch_checkpoint(settings, "llama")
    max_tokens = 8 if settings.quick else 16
    batch = prompts(3, seed=11)
    reference, margins = engine_greedy(small_engine(settings, llama, dtype=dtype), batch, max_tokens)
    prefill = small_engine(settings, llama, dtype=dtype, block_size=16)
    decode = small_engine(settings, llama, dtype=dtype, block_size=32, num_kv_blocks=24)
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    ids, nbytes, handoff_s = [], 0, 0.0
    for prompt in batch:
        payload = prefill.prefill(prompt, greedy)
        start = time.perf_counter()
        ids.append(decode.add_prefilled(payload, greedy))
        handoff_s += time.perf_counter() - start
        nbytes += payload.nbytes
    done = {}
    while decode.has_unfinished:
        done.update({o.request_id: o for o in decode.step()})
    comparison = compare_greedy(reference, margins, [done[i].outputs[0].token_ids for i in ids], MARGIN_TOLERANCE[dtype])
    outcome.record(greedy=comparison, payload_bytes=nbytes, import_ms_per_request=1000 * handoff_s / len(batch), payload_device=str(payload.kv.device))
    expect_greedy_match(outcome, "KV handoff greedy", comparison)
    outcome.expect(prefill.block_manager.num_free_blocks == prefill.runner.num_blocks, "the prefill engine kept blocks after exporting")
    # Seeded sampling: the same block size on both sides, so the decode engine runs the very shapes the single engine runs.
    sampled = SamplingParams(temperature=1.0, seed=4, max_tokens=max_tokens, ignore_eos=True)
    alone = small_engine(settings, llama, dtype=dtype).generate([batch[0]], sampled)[0].outputs[0].token_ids
    decode = small_engine(settings, llama, dtype=dtype, block_size=16)
    handed = decode.add_prefilled(prefill.prefill(batch[0], sampled), sampled)
    while decode.has_unfinished:
        done.update({o.request_id: o for o in decode.step()})
    outcome.record(seeded_continuation_equal=done[handed].outputs[0].token_ids == alone)
    outcome.expect(done[handed].outputs[0].token_ids == alone, "KV handoff: a seeded request sampled other tokens after the handoff")


# -- speed ----------------------------------------------------------------------------------------------------
def throughput_sizes(settings: Settings) -> dict:
    """Per concurrency: (requests, prompt length range, output length range)."""
    if settings.quick:
        return {1: (2, (4, 8), (4, 4)), 8: (8, (4, 8), (2, 4)), 64: (64, (4, 8), (2, 4))}
    return {1: (3, (64, 256), (64, 64)), 8: (16, (64, 256), (32, 64)), 64: (64, (64, 256), (32, 64))}


def shape_engine(settings: Settings, path, **kw) -> LLMEngine:
    dtype = "bfloat16" if settings.device == "cuda" else "float32"  # CPU: fp32, the CPU's serving precision
    # --quick: 1024 tokens of cache, enough for 64 tiny requests (FlexAttention's eager CPU reference slows with the cache's size);
    # else 1 GB: ~87k tokens of Qwen2.5-0.5B's bf16 KV, the 64 x 1024 tokens of the roofline's c=64 step with room to spare
    size = {"num_kv_blocks": 64} if settings.quick else {"kv_cache_memory_gb": 1.0}
    # max_model_len: the longest sequence here (the roofline's 1024-token context) with room, instead of the shape's 32k:
    # block tables (and CUDA graphs' static ones) only as wide as needed
    return LLMEngine(EngineConfig(model=str(path), dtype=dtype, block_size=16, max_num_seqs=64, max_num_batched_tokens=4096,
                                  max_model_len=2048, **{**size, **settings.engine_kwargs(), **kw}))  # fmt: skip


def throughput_rows(engine: LLMEngine, settings: Settings, vocab: int, hf=None) -> dict:
    """Output tokens/s at concurrency 1, 8, 64 on the engine (and ``generate`` if given), each after a warm-up on
    other prompts of the same shape (allocations, kernels, prefixes not cached); --quick runs no warm-up (its figures
    only show that the paths run)."""
    rows = {}
    for c, (n, prompt_range, output_range) in throughput_sizes(settings).items():
        requests = workload(n, prompt_range, output_range, vocab, seed=c)
        warm_up = [] if settings.quick else workload(min(n, 8), prompt_range, output_range, vocab, seed=1000 + c)
        if warm_up:
            engine_throughput(engine, warm_up, c)
            if hf is not None:
                hf_throughput(hf, warm_up, c)
        rows[f"c{c}_engine_tok_s"] = engine_throughput(engine, requests, c)
        if hf is not None:
            rows[f"c{c}_hf_tok_s"] = hf_throughput(hf, requests, c)
            rows[f"c{c}_ratio"] = rows[f"c{c}_engine_tok_s"] / rows[f"c{c}_hf_tok_s"]
    return rows


def engine_throughput_check(settings: Settings, outcome: Outcome) -> None:
    """Output tokens/s at concurrency 1, 8, 64 on Qwen2.5-0.5B's shape (bf16 on CUDA), each attention path, eager,
    against transformers ``generate`` in the same precision on the same device."""
    from transformers import AutoModelForCausalLM

    path, shape = shape_checkpoint(settings)
    dtype = torch.bfloat16 if settings.device == "cuda" else torch.float32
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(settings.torch_device).eval()
    outcome.record(model=shape.name, parameters=shape.num_parameters(), dtype=str(dtype))
    hf_rows = None
    for backend in ATTENTION_BACKENDS:
        engine = shape_engine(settings, path, attention_backend=backend)
        rows = throughput_rows(engine, settings, shape.vocab_size, hf if hf_rows is None else None)
        if hf_rows is None:  # generate once: it does not depend on the engine's path
            hf_rows = {k: v for k, v in rows.items() if "_hf_" in k}
        else:
            rows.update(hf_rows)
            rows.update({f"c{c}_ratio": rows[f"c{c}_engine_tok_s"] / rows[f"c{c}_hf_tok_s"] for c in throughput_sizes(settings)})
        outcome.record(**{backend: rows})
        del engine
    if settings.device == "cuda":
        torch.cuda.empty_cache()


def cuda_graphs(settings: Settings, outcome: Outcome) -> None:
    """Decode steps replayed from CUDA graphs (batch sizes 1..64; the engine allows them on the FlexAttention path
    only) against the same path eager: greedy output equal, output tokens/s at concurrency 1, 8, 64."""
    path, shape = shape_checkpoint(settings)
    batch = prompts(8, seed=21, vocab=shape.vocab_size, lengths=(16, 64))
    eager = shape_engine(settings, path, attention_backend="flex")
    reference, margins = engine_greedy(eager, batch, 16)
    eager_rows = throughput_rows(eager, settings, shape.vocab_size)
    outcome.record(flex_eager=eager_rows)
    del eager
    start = time.perf_counter()
    graphed = shape_engine(settings, path, attention_backend="flex", cuda_graph_batch_sizes=[1, 2, 4, 8, 16, 32, 64])
    outcome.record(engine_start_with_capture_s=time.perf_counter() - start)
    got, _ = engine_greedy(graphed, batch, 16)
    comparison = compare_greedy(reference, margins, got, MARGIN_TOLERANCE["bfloat16"])
    graph_rows = throughput_rows(graphed, settings, shape.vocab_size)
    speedups = {f"c{c}_speedup": graph_rows[f"c{c}_engine_tok_s"] / eager_rows[f"c{c}_engine_tok_s"] for c in throughput_sizes(settings)}
    outcome.record(greedy_vs_eager=comparison, flex_cuda_graphs=graph_rows, **speedups)
    expect_greedy_match(outcome, "CUDA graphs vs eager", comparison)


def rooflines(settings: Settings, outcome: Outcome) -> None:
    """The decode step against the device's own rates, timed in this run: at c=1, (weights + KV bytes read) / copy
    bandwidth over the step time (memory roofline); at c=64, the step's FLOPs / the bf16 matmul rate at the step's
    shapes over the step time (compute roofline). For the fallback path, the paged-attention path, and with CUDA graphs."""
    path, shape = shape_checkpoint(settings)
    device = settings.torch_device
    context = 16 if settings.quick else 1024
    h, i, layers, v = shape.hidden_size, shape.intermediate_size, shape.num_hidden_layers, shape.vocab_size
    q, kv = shape.num_attention_heads * shape.head_dim, shape.num_key_value_heads * shape.head_dim
    copy_rate = copy_bandwidth(device)
    linear_shapes = lambda m: [(m, h, q + 2 * kv), (m, h, q), (m, h, 2 * i), (m, i, h), (m, h, v)]  # noqa: E731
    matmul64 = matmul_rate(device, linear_shapes(64))
    outcome.record(copy_gb_s=copy_rate / 1e9, bf16_matmul_tflop_s_at_c64_shapes=matmul64 / 1e12, context=context)
    linear_flops_per_row = 2 * (layers * (h * (q + 2 * kv) + h * q + h * 2 * i + i * h) + h * v)
    attention_flops_per_row = 4 * layers * context * q  # QK^T and PV over the context, every query head
    kv_bytes_per_row = 2 * layers * context * kv * 2  # K and V, bf16
    paths = [("fallback_sdpa", {"attention_backend": "sdpa"}), ("flex", {"attention_backend": "flex"}),
             ("flex_cuda_graphs", {"attention_backend": "flex", "cuda_graph_batch_sizes": [1, 64]})]  # fmt: skip
    for name, kw in paths:
        engine = shape_engine(settings, path, **kw, **({"num_kv_blocks": 256} if settings.quick else {}))  # 64 x (16 + 10) tokens fit
        weight_bytes = sum(p.numel() * p.element_size() for p in engine.runner.model.parameters())
        t1 = decode_step_time(engine, 1, context, v)
        t64 = decode_step_time(engine, 64, context, v)
        outcome.record(**{name: {
            "c1_step_ms": 1000 * t1, "c64_step_ms": 1000 * t64,
            "memory_roofline_fraction_c1": (weight_bytes + kv_bytes_per_row) / copy_rate / t1,
            "compute_roofline_fraction_c64": 64 * (linear_flops_per_row + attention_flops_per_row) / matmul64 / t64,
        }})  # fmt: skip
        del engine
        torch.cuda.empty_cache()
