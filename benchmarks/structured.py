"""Claim: structured decoding (grammar masks from llguidance in the batched sampler) costs little next to free
decoding, at a real vocabulary size; grammars compile once per schema.

    python benchmarks/structured.py [--quick] [--out FILE]

A ~100M-parameter random-weight Llama with Qwen2.5's vocabulary size (151,936 entries: a synthetic byte-level
BPE of that size, since nothing is downloaded, so that llguidance's masks walk a real-size token trie and the
mask is applied over [B, 151936] logits). The same prompts at concurrency 1 and 8 (the engine keeps c requests
in flight), each timed on its second pass (warm):
- free decoding vs ``json_schema`` decoding vs a forced tool call (the grammar ``tool_choice: required`` builds):
  output tokens/s, ratios structured / free;
- grammar compile time of a new schema, and of the same schema again (cached: nothing compiled);
- the sampler's penalties (presence, frequency, repetition) plus a 100-entry logit_bias vs none, c8 tokens/s ratio.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from itertools import product
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
from mlplat.engine.structured import StructuredOutputs
from mlplat.models.tokenizer import CHAT_TEMPLATE, IM_END, IM_START, PAD
from mlplat.serve.openai_protocol import ChatCompletionRequest

VOCAB = 151_936
# Strings long enough that every request runs to max_tokens, free or constrained: the same tokens per request on both
# sides, so the ratio is the cost per token (a grammar that ended early would shift the prefill/decode mix instead).
SCHEMA = {"type": "object", "properties": {"title": {"type": "string", "maxLength": 400},
                                           "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
                                           "score": {"type": "integer", "minimum": 0, "maximum": 1000}},
          "required": ["title", "tags", "score"], "additionalProperties": False}  # fmt: skip
TOOL = {"type": "function", "function": {"name": "search", "parameters": {"type": "object", "required": ["query", "limit"], "properties": {
    "query": {"type": "string", "maxLength": 400}, "limit": {"type": "integer", "minimum": 1, "maximum": 50}}}}}


def big_tokenizer() -> PreTrainedTokenizerFast:
    """A byte-level BPE with exactly VOCAB entries: the 256 bytes, every pair of them, then triples of letters and digits."""
    alphabet = list(pre_tokenizers.ByteLevel.alphabet())
    alphabet.sort()
    specials = [PAD, IM_START, IM_END]
    vocab = {c: i for i, c in enumerate(alphabet)}
    merges = []
    for a, b in product(alphabet, alphabet):
        vocab[a + b] = len(vocab)
        merges.append((a, b))
    chars = "etaoinshrdlucmfwypvbgkjqxzETAOINSHRDLUCMFWYPVBGKJQXZ0123456789"
    for a, b, c in product(chars, chars, chars):
        if len(vocab) >= VOCAB - len(specials):
            break
        vocab[a + b + c] = len(vocab)
        merges.append((a + b, c))
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=IM_END, pad_token=PAD, chat_template=CHAT_TEMPLATE)


def build_model(work: Path) -> Path:
    tokenizer = big_tokenizer()
    assert len(tokenizer) == VOCAB, len(tokenizer)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=512, intermediate_size=1408, num_hidden_layers=6, num_attention_heads=8,
                         num_key_value_heads=4, max_position_embeddings=1024, tie_word_embeddings=True,
                         eos_token_id=tokenizer.eos_token_id)  # fmt: skip
    torch.manual_seed(0)
    model = LlamaForCausalLM(config)
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, vocabulary {VOCAB}")
    model.save_pretrained(work / "model")
    tokenizer.save_pretrained(work / "model")
    return work / "model"


def throughput(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams, concurrency: int) -> float:
    """Output tokens/s with ``concurrency`` requests in flight."""
    pending, in_flight, produced = list(prompts), 0, 0
    start = time.perf_counter()
    while pending or engine.has_unfinished:
        while pending and in_flight < concurrency:
            engine.add_request(pending.pop(0), params)
            in_flight += 1
        for out in engine.step():
            assert out.error is None, out.error
            in_flight -= 1
            produced += len(out.outputs[0].sampled_token_ids)
    return produced / (time.perf_counter() - start)


def warm(engine, prompts, params, concurrency) -> float:
    throughput(engine, prompts, params, concurrency)  # first pass: warm-up (and, for grammars, the compile)
    return throughput(engine, prompts, params, concurrency)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true", help="smaller workload (under 3 minutes)")
    parser.add_argument("--out", default="benchmarks/results/structured.json")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_model(Path(tmp))
        engine = LLMEngine(EngineConfig(model=str(model_dir), num_kv_blocks=256, max_num_seqs=8))
        rng = random.Random(0)
        n_c1, n_c8, max_tokens = (2, 8, 48) if args.quick else (6, 24, 96)
        words = ["alpha", "beta", "gamma", "delta", "omega", "query", "search", "json"]
        texts = [" ".join(rng.choice(words) for _ in range(rng.randint(8, 24))) for _ in range(max(n_c1, n_c8))]
        prompts = [engine.tokenizer.encode(t) for t in texts]
        free = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        start = time.perf_counter()
        grammars = engine.grammars
        tokenizer_ms = (time.perf_counter() - start) * 1000
        spec = StructuredOutputs(json=SCHEMA)
        start = time.perf_counter()
        grammars.matcher(spec)
        compile_first = (time.perf_counter() - start) * 1000
        compiled = grammars.num_compiled
        start = time.perf_counter()
        grammars.matcher(spec)
        compile_cached = (time.perf_counter() - start) * 1000
        assert grammars.num_compiled == compiled, "the same schema compiled again"
        structured = SamplingParams(max_tokens=max_tokens, temperature=0, structured=spec)
        tool_req = ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "x"}], tools=[TOOL], tool_choice="required")
        tool = SamplingParams(max_tokens=max_tokens, temperature=0, structured=tool_req.structured())
        bias = {rng.randrange(VOCAB): rng.uniform(-5, 5) for _ in range(100)}
        penalties = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, presence_penalty=0.5, frequency_penalty=0.5,
                                   repetition_penalty=1.1, logit_bias=bias)  # fmt: skip
        report = {"vocab_size": VOCAB, "quick": args.quick, "max_tokens": max_tokens, "grammar_tokenizer_init_ms": tokenizer_ms}
        for c, n in ((1, n_c1), (8, n_c8)):
            report[f"free_tok_s_c{c}"] = warm(engine, prompts[:n], free, c)
            report[f"structured_tok_s_c{c}"] = warm(engine, prompts[:n], structured, c)
            report[f"structured_throughput_ratio_c{c}"] = report[f"structured_tok_s_c{c}"] / report[f"free_tok_s_c{c}"]
        report["tool_call_tok_s_c8"] = warm(engine, prompts[:n_c8], tool, 8)
        report["tool_call_throughput_ratio_c8"] = report["tool_call_tok_s_c8"] / report["free_tok_s_c8"]
        report["penalty_tok_s_c8"] = warm(engine, prompts[:n_c8], penalties, 8)
        report["penalty_sampler_overhead"] = report["penalty_tok_s_c8"] / report["free_tok_s_c8"]
        report["grammar_compile_ms_first"] = compile_first
        report["grammar_compile_ms_cached"] = compile_cached
        small = {**SCHEMA, "properties": {**SCHEMA["properties"], "title": {"type": "string", "maxLength": 12}}}
        example = engine.generate([prompts[0]], SamplingParams(max_tokens=200, temperature=0, structured=StructuredOutputs(json=small)))
        example = example[0].outputs[0].text
        json.loads(example)  # a schema it can finish within max_tokens: JSON that follows it
        report["example_output"] = example
    print(json.dumps(report, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
