"""The OpenAI-compatible serving app on a real local Ray cluster, over real HTTP, with the
real `openai` client: PD-disaggregated and colocated apps side by side."""

from __future__ import annotations

import collections
import json
import os
import re
import time
from typing import Annotated, Literal

import httpx
import openai
import pytest
from pydantic import BaseModel, Field
from ray import serve

from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
from mlplat.serve.config import ServeConfig
from serve_apps.llm import build_app

KEY = "test-key-123"
ENGINE = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4, "max_waiting": 4}
SMALL = {"num_cpus": 0.2}
ENGINES = {**SMALL, "health_check_period_s": 1.0}  # a replica whose engine stopped is replaced within seconds
TIMEOUT_S = 10.0  # the colocated app's request_timeout_s


@pytest.fixture(scope="module")
def apps(ray_cluster, tiny_model, monkeypatch_module):
    monkeypatch_module.setenv("MLPLAT_API_KEYS", "")
    pd = build_app(ServeConfig(model=str(tiny_model), model_name="tiny", mode="pd", engine_args=ENGINE,
                               prefill=ENGINES, decode=ENGINES, ingress=SMALL, app_name="pd", route_prefix="/pd"))
    monkeypatch_module.setenv("MLPLAT_API_KEYS", f"other,{KEY}")
    colo = build_app(ServeConfig(model=str(tiny_model), model_name="tiny", mode="colocated", engine_args=ENGINE, request_timeout_s=TIMEOUT_S,
                                 colocated=ENGINES, ingress=SMALL, app_name="colo", route_prefix="/colo"))
    # Both at once: their replicas start side by side rather than one app after the other.
    serve.run_many([serve.RunTarget(pd, name="pd", route_prefix="/pd"), serve.RunTarget(colo, name="colo", route_prefix="/colo")])
    yield {"pd": "http://127.0.0.1:8000/pd/v1", "colo": "http://127.0.0.1:8000/colo/v1"}
    serve.delete("pd")
    serve.delete("colo")


@pytest.fixture(scope="module")
def monkeypatch_module():
    mp = pytest.MonkeyPatch()
    yield mp
    mp.undo()


def client(apps, mode: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=apps[mode], api_key=KEY if mode == "colo" else "unused", max_retries=0)


CHAT = [{"role": "user", "content": "What is 12 + 34? Answer with the digits of the sum from last to first."}]


def test_pd_and_colocated_match_the_engine(apps, tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model)))
    prompt = engine.tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)
    expected = engine.generate([prompt], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    for mode in ("pd", "colo"):
        assert [m.id for m in client(apps, mode).models.list().data] == ["tiny"]
        r = client(apps, mode).chat.completions.create(model="tiny", messages=CHAT, max_tokens=12, temperature=0)
        assert r.choices[0].message.content == expected.text, mode
        assert r.choices[0].finish_reason == expected.finish_reason
        assert r.usage.completion_tokens == len(expected.token_ids) and r.usage.prompt_tokens > 20


def test_streaming_n_samples_with_seed(apps):
    results = {}
    decode = serve.get_deployment_handle("decode", app_name="pd")
    handoffs = decode.stats.remote().result()["handoffs"]["count"]
    for mode in ("pd", "colo"):
        kwargs = dict(model="tiny", prompt="What is", max_tokens=10, n=4, seed=5, temperature=1.0)
        whole = client(apps, mode).completions.create(**kwargs)
        texts, reasons = dict.fromkeys(range(4), ""), {}
        for chunk in client(apps, mode).completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
        assert texts == {c.index: c.text for c in whole.choices}, mode
        assert set(reasons) == set(range(4))
        results[mode] = texts
    assert results["pd"] == results["colo"]  # sample i is seeded with seed + i in both topologies
    # PD: one prefill and one KV handoff per request, whose four samples share the prompt's blocks on the decode replica
    assert decode.stats.remote().result()["handoffs"]["count"] == handoffs + 2


def test_chat_streaming_logprobs_and_stop(apps):
    c = client(apps, "pd")
    r = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0, logprobs=True)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens and all(t.logprob <= 0 for t in content)
    full = c.completions.create(model="tiny", prompt="What is", max_tokens=12, temperature=0).choices[0].text
    stop = full[3:5]
    cut = c.completions.create(model="tiny", prompt="What is", max_tokens=12, temperature=0, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop" and cut.text == full[: full.index(stop)]
    pieces = [ch.choices[0].delta.content or "" for ch in c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0, stream=True) if ch.choices]
    assert "".join(pieces) == c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=8, temperature=0).choices[0].message.content


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
        ({"model": "tiny", "prompt": "hi " * 400, "max_tokens": 4}, "prompt"),
        ({"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
        ({"model": "tiny", "prompt": "hi", "n": 100}, "n"),
        ({"model": "tiny", "prompt": ""}, "prompt"),
        ({"model": "tiny", "prompt": "hi", "suffix": "!"}, "suffix"),  # not supported: refused, never dropped
        ({"model": "tiny", "prompt": "hi", "logprobs": 21}, "logprobs"),  # over limits.max_top_logprobs
        ({"model": "tiny", "prompt": "hi", "logit_bias": {"99999": 5}}, "logit_bias"),  # outside the vocabulary
        ({"model": "tiny", "prompt": "hi", "logit_bias": {"5": 500}}, "logit_bias"),
        ({"model": "tiny", "prompt": "hi", "stop_token_ids": [-1]}, "stop_token_ids"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 2, "min_tokens": 3}, "min_tokens"),
        ({"model": "tiny", "prompt": "hi", "presence_penalty": 3}, "presence_penalty"),
        ({"model": "tiny", "prompt": "hi", "stop": ["a", "b", "c", "d", "e"]}, "stop"),
        ({"model": "tiny", "prompt": "hi", "stream_options": {"include_usage": True}}, "stream_options"),  # without stream
        ({"model": "tiny", "prompt": [[5, 6], [7, 99999]]}, "prompt.1.1"),  # the second prompt's second token id
        ({"model": "tiny", "prompt": ["hi"] * 65}, "prompt"),
        ({"model": "tiny", "prompt": "hi", "logit_bias": {str(t): 1 for t in range(301)}}, "logit_bias"),
    ],
)
def test_bad_completion_requests_are_400_naming_the_field(apps, body, param):
    r = httpx.post(f"{apps['pd']}/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "") + error["message"]


@pytest.mark.parametrize(
    "body, param",
    [
        ({"model": "tiny", "messages": []}, "messages"),
        ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "role"),
        ({"model": "tiny", "messages": CHAT, "response_format": {"type": "json_schema"}}, "response_format"),  # without its schema
        ({"model": "tiny", "messages": CHAT, "guided_json": {"type": "object"}}, "structured_outputs"),  # vLLM's old key: named the new one
        ({"model": "tiny", "messages": CHAT, "structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs"),
        ({"model": "tiny", "messages": CHAT, "tool_choice": "required"}, "tool_choice"),  # without tools
        ({"model": "tiny", "messages": CHAT, "tools": []}, "tools"),
        ({"model": "tiny", "messages": CHAT, "top_logprobs": 2}, "top_logprobs"),  # without logprobs
        ({"model": "tiny", "messages": CHAT, "top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"model": "tiny", "messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]}, "content"),
    ],
)
def test_bad_chat_requests_are_400(apps, body, param):
    r = httpx.post(f"{apps['pd']}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and param in r.json()["error"]["message"]


def test_per_request_limits_come_from_the_serve_config():
    """RequestLimits: typed and validated in the serve config, with OpenAI's / vLLM's defaults; a request over one names the field
    and the limit."""
    from pydantic import ValidationError

    from mlplat.serve.config import RequestLimits
    from mlplat.serve.openai_protocol import ChatCompletionRequest, CompletionRequest

    limits = RequestLimits()
    assert (limits.max_n, limits.max_stop, limits.max_logit_bias, limits.max_top_logprobs) == (8, 4, 300, 20)
    assert ServeConfig(model="m", limits={"max_n": 2}).limits.max_n == 2
    with pytest.raises(ValidationError, match="max_n"):
        ServeConfig(model="m", limits={"max_n": 0})
    with pytest.raises(ValidationError, match="limits"):
        ServeConfig(model="m", engine="vllm", auth={"enabled": False}, limits={"max_n": 2})
    chat = ChatCompletionRequest(model="tiny", messages=CHAT, n=3, logprobs=True, top_logprobs=5, stop=["a", "b"])
    assert chat.over_limit(limits) is None
    assert chat.over_limit(RequestLimits(max_n=2)) == ("n", "n: 3 is over this server's limit of 2 (serve config limits.max_n)")
    assert chat.over_limit(RequestLimits(max_stop=1))[0] == "stop"
    assert chat.over_limit(RequestLimits(max_top_logprobs=4))[1].endswith("limit of 4 (serve config limits.max_top_logprobs)")
    completion = CompletionRequest(model="tiny", prompt=["a", "b", "c"], logprobs=3, logit_bias={1: 1, 2: 1})
    assert completion.over_limit(RequestLimits(max_prompts=2))[0] == "prompt"
    assert completion.over_limit(RequestLimits(max_logit_bias=1))[0] == "logit_bias"
    assert completion.over_limit(RequestLimits(max_top_logprobs=2))[0] == "logprobs"


def test_completions_tokenize_with_the_tokenizers_special_tokens():
    """A Llama-3-style tokenizer adds its BOS to a completions prompt, as vLLM tokenizes it (chat templates write their own)."""
    from test_chat_templates import LLAMA3_SPLIT, train_tokenizer

    from mlplat.serve.ingress import completion_prompt_ids

    llama = train_tokenizer(LLAMA3_SPLIT, ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"], bos_token="<|begin_of_text|>",
                            eos_token="<|eot_id|>", pad_token="<|end_of_text|>")  # fmt: skip
    ids = completion_prompt_ids(llama, "What is 1 + 2?")
    assert ids[0] == llama.bos_token_id and ids[1:] == llama.encode("What is 1 + 2?", add_special_tokens=False)


def test_tool_call_holdback_streams_everything_but_a_possible_marker():
    from mlplat.serve.ingress import ToolCallHoldback

    def run(pieces: list[str]) -> list[str]:
        h = ToolCallHoldback("<tool_call>")
        return [h.push(p) for p in pieces]

    assert run(["Hello", " wor", "ld"]) == ["Hello", " wor", "ld"]  # no marker can be forming: nothing waits
    assert run(["Hi <", "tool", "_ca", "ll>{", "}"]) == ["Hi ", "", "", "", ""]  # from a possible marker prefix on it waits
    assert run(["a <to", "p> b"]) == ["a ", "<top> b"]  # not the marker after all: released
    h = ToolCallHoldback("<tool_call>")
    assert h.push("Sure. <tool_call>{}") == "Sure. " and h.push("</tool_call> done") == ""
    assert h.rest("Sure.  done") == " done"  # at the end, the content around the calls not sent yet
    h = ToolCallHoldback("<tool_call>")
    assert h.push("x <tool_") == "x " and h.rest("x <tool_") == "<tool_"


def test_the_clients_fields_are_each_handled_or_refused_by_name():
    """Every field the openai client can send: a field of our request model (honoured, or accepted with no effect on the
    output: NO_EFFECT), or refused by name, never dropped without a word."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params
    from pydantic import ValidationError

    from mlplat.serve.openai_protocol import NO_EFFECT, ChatCompletionRequest, CompletionRequest

    required = {CompletionRequest: {"model": "tiny", "prompt": "hi"}, ChatCompletionRequest: {"model": "tiny", "messages": CHAT}}
    for model, params in ((CompletionRequest, completion_create_params), (ChatCompletionRequest, chat_create_params)):
        assert NO_EFFECT <= model.model_fields.keys()
        for name in params.CompletionCreateParamsBase.__annotations__:
            if name in model.model_fields:
                continue
            with pytest.raises(ValidationError) as refused:
                model.model_validate({**required[model], name: None})
            assert [(e["type"], e["loc"]) for e in refused.value.errors()] == [("extra_forbidden", (name,))], name


def test_the_checkpoints_generation_config_sets_the_defaults_a_request_leaves_unset(tmp_path):
    import json

    from mlplat.serve.openai_protocol import ChatCompletionRequest, generation_defaults

    config = {"do_sample": True, "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_new_tokens": 64,
              "eos_token_id": 2}  # fmt: skip
    (tmp_path / "generation_config.json").write_text(json.dumps(config))
    defaults = generation_defaults(tmp_path)
    assert defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05, "max_tokens": 64}
    plain = ChatCompletionRequest(model="tiny", messages=CHAT).sampling_params(100, False, defaults)
    assert (plain.temperature, plain.top_p, plain.top_k, plain.repetition_penalty, plain.max_tokens) == (0.7, 0.8, 20, 1.05, 100)
    own = ChatCompletionRequest(model="tiny", messages=CHAT, temperature=0, top_k=-1).sampling_params(100, False, defaults)
    assert (own.temperature, own.top_k, own.top_p) == (0, -1, 0.8)  # the request's values win, field by field
    assert generation_defaults(tmp_path / "no-such-checkpoint") == {}
    assert ChatCompletionRequest(model="tiny", messages=CHAT).sampling_params(100, False, {}).temperature == 1.0


def test_sampling_fields_take_effect(apps, tiny_model):
    from mlplat.models import load_tokenizer

    c = client(apps, "pd")
    greedy = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    # top_k = 1 is greedy, whatever the temperature.
    top1 = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=6, temperature=1.0, seed=3,
                                     extra_body={"ignore_eos": True, "top_k": 1})  # fmt: skip
    assert top1.choices[0].message.content == greedy.choices[0].message.content
    # A bias of 100 on one token: only that token, sampled or greedy.
    token = load_tokenizer(tiny_model).encode("7", add_special_tokens=False)[0]
    for temperature in (0.0, 1.0):
        biased = c.completions.create(model="tiny", prompt="hi", max_tokens=5, temperature=temperature, logit_bias={str(token): 100},
                                      logprobs=0, extra_body={"ignore_eos": True})  # fmt: skip
        assert biased.choices[0].logprobs.tokens == ["7"] * 5, biased.choices[0]
    # max_completion_tokens (chat's newer name) bounds the answer; content as text parts and the developer role read as a
    # string and the system role.
    capped = c.chat.completions.create(model="tiny", messages=CHAT, max_completion_tokens=3, temperature=0, extra_body={"ignore_eos": True})
    assert capped.usage.completion_tokens == 3
    system = [{"role": "system", "content": "Be brief."}, *CHAT]
    parts = [{"role": "developer", "content": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}]},
             {"role": "user", "content": [{"type": "text", "text": CHAT[0]["content"]}]}]  # fmt: skip
    answers = [c.chat.completions.create(model="tiny", messages=m, max_tokens=8, temperature=0).choices[0].message.content
               for m in (system, parts)]  # fmt: skip
    assert answers[0] == answers[1]
    # stream_options.include_usage: a last chunk with the usage and no choices.
    chunks = list(c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=4, temperature=0, stream=True,
                                            stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))  # fmt: skip
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 4
    assert chunks[-1].usage.prompt_tokens == greedy.usage.prompt_tokens and all(ch.usage is None for ch in chunks[:-1])
    # Without max_tokens: OpenAI's defaults, 16 tokens for a completion, the rest of the context for a chat answer.
    assert c.completions.create(model="tiny", prompt="hi", temperature=0, extra_body={"ignore_eos": True}).usage.completion_tokens == 16
    too_long = httpx.post(f"{apps['pd']}/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 100_000}, timeout=60)
    context = int(re.search(r"context of (\d+) tokens", too_long.json()["error"]["message"]).group(1))
    whole = c.chat.completions.create(model="tiny", messages=CHAT, temperature=0, extra_body={"ignore_eos": True})
    assert whole.usage.prompt_tokens + whole.usage.completion_tokens == context and whole.choices[0].finish_reason == "length"
    # A list of prompts: choice i * n + j is prompt i's sample j, usage summed; each choice as its prompt alone gives it.
    batch = c.completions.create(model="tiny", prompt=["hi", "What is 1 + 2?", "ok"], n=2, max_tokens=4, temperature=0)
    alone = [c.completions.create(model="tiny", prompt=p, max_tokens=4, temperature=0) for p in ("hi", "What is 1 + 2?", "ok")]
    assert [ch.index for ch in batch.choices] == list(range(6))
    assert [ch.text for ch in batch.choices] == [a.choices[0].text for a in alone for _ in range(2)]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    ids = c.completions.create(model="tiny", prompt=[[5, 6, 7], [8, 9]], max_tokens=2, temperature=0)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5
    # echo: the prompt's text before the completion, streamed first.
    plain = c.completions.create(model="tiny", prompt="What is 1 + 2?", max_tokens=4, temperature=0)
    echoed = c.completions.create(model="tiny", prompt="What is 1 + 2?", max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text == "What is 1 + 2?" + plain.choices[0].text
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="What is 1 + 2?", max_tokens=4, temperature=0,
                                                                         echo=True, stream=True) if ch.choices)  # fmt: skip
    assert streamed == echoed.choices[0].text
    # Fields with no effect on the output are accepted.
    assert c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=2, user="u1", metadata={"k": "v"}, store=False).choices


class Pet(BaseModel):
    name: str = Field(max_length=8)
    tags: list[Annotated[str, Field(max_length=4)]] = Field(max_length=3)
    age: int = Field(ge=0, le=30)
    kind: Literal["cat", "dog"]


# The tiny model's 256-token context holds one small tool, a call and a short conversation (its tokenizer has 384 entries).
ADD = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 99}}, "required": ["a"]}}}
ASK = [{"role": "user", "content": "2 + 3?"}]


def test_structured_outputs_parse_and_validate_with_the_real_client(apps):
    for mode in ("pd", "colo"):
        c = client(apps, mode)
        r = c.chat.completions.parse(model="tiny", messages=CHAT, response_format=Pet, temperature=1.0, seed=1, n=2, max_tokens=150)
        for choice in r.choices:  # the client parses and validates each answer against the model
            assert isinstance(choice.message.parsed, Pet) and choice.finish_reason == "stop", choice.message.content
        obj = c.chat.completions.create(model="tiny", messages=CHAT, response_format={"type": "json_object"}, max_tokens=150,
                                        temperature=0)  # fmt: skip
        assert obj.choices[0].finish_reason == "length" or isinstance(json.loads(obj.choices[0].message.content), dict)
        choice = c.completions.create(model="tiny", prompt="hi", max_tokens=10,
                                      extra_body={"structured_outputs": {"choice": ["yes", "ok"]}})  # fmt: skip
        assert choice.choices[0].text in ("yes", "ok")
        regex = c.chat.completions.create(model="tiny", messages=CHAT, max_tokens=20,
                                          extra_body={"structured_outputs": {"regex": "[a-c]{2}[0-9]"}})  # fmt: skip
        assert re.fullmatch("[a-c]{2}[0-9]", regex.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="max_grammar_bytes") as too_big:  # a per-request limit: the schema's size
        client(apps, "colo").chat.completions.create(model="tiny", messages=CHAT, max_tokens=5,
                                                     extra_body={"structured_outputs": {"choice": ["x" * 70_000]}})
    assert too_big.value.body["param"] == "structured_outputs"
    with pytest.raises(openai.BadRequestError, match="invalid grammar"):  # a bad grammar fails its own request; the app lives on
        client(apps, "pd").chat.completions.create(model="tiny", messages=CHAT, max_tokens=5,
                                                   extra_body={"structured_outputs": {"grammar": "start: nope"}})  # fmt: skip
    assert client(apps, "pd").chat.completions.create(model="tiny", messages=CHAT, max_tokens=3).choices[0].finish_reason


def test_tool_calls_non_stream_stream_and_a_two_turn_round_trip(apps):
    for mode in ("pd", "colo"):
        c = client(apps, mode)
        for choice in ("required", {"type": "function", "function": {"name": "add"}}):
            r = c.chat.completions.create(model="tiny", messages=ASK, tools=[ADD], tool_choice=choice, temperature=1.0, seed=3)
            call = r.choices[0].message.tool_calls[0]
            assert r.choices[0].finish_reason == "tool_calls" and r.choices[0].message.content is None, r
            assert call.type == "function" and call.function.name == "add" and call.id.startswith("call_")
            assert 0 <= json.loads(call.function.arguments)["a"] <= 99  # the arguments follow the function's schema
        # streaming: the call arrives as tool-call deltas (id and name, then the arguments), then finish_reason tool_calls
        calls, reasons = {}, []
        for chunk in c.chat.completions.create(model="tiny", messages=ASK, tools=[ADD], tool_choice="required", stream=True, seed=4):
            for ch in chunk.choices:
                reasons += [ch.finish_reason] if ch.finish_reason else []
                for d in ch.delta.tool_calls or []:
                    call = calls.setdefault(d.index, {"id": d.id, "name": d.function.name, "arguments": ""})
                    call["arguments"] += d.function.arguments or ""
        assert reasons == ["tool_calls"] and len(calls) == 1 and calls[0]["name"] == "add" and calls[0]["id"]
        assert set(json.loads(calls[0]["arguments"])) == {"a"}
        # turn two: the call and its result go back; the model answers (tool_choice none: no calls parsed)
        first = c.chat.completions.create(model="tiny", messages=ASK, tools=[ADD], tool_choice="required", seed=5)
        call = first.choices[0].message.tool_calls[0]
        messages = ASK + [first.choices[0].message.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": call.id, "content": "5"}]
        second = c.chat.completions.create(model="tiny", messages=messages, tools=[ADD], tool_choice="none", max_tokens=4, temperature=0)
        assert second.choices[0].message.tool_calls is None and second.choices[0].finish_reason in ("stop", "length")
        alone = c.chat.completions.create(model="tiny", messages=ASK, max_tokens=1).usage.prompt_tokens  # no tools in either prompt
        assert second.usage.prompt_tokens > alone + 40  # the call and the tool's result are in the prompt
        auto = c.chat.completions.create(model="tiny", messages=messages, tools=[ADD], max_tokens=4, temperature=0)  # free decoding, parsed
        assert auto.choices[0].message.tool_calls is None and auto.choices[0].finish_reason in ("stop", "length")


def test_top_logprobs_in_chat_and_completions_streaming_or_not(apps):
    """Each generated token's k likeliest alternatives, sorted; under temperature 0 the top-1 is the chosen token and carries
    its log-prob; streamed, the same numbers arrive with the tokens."""
    for mode in ("pd", "colo"):
        c = client(apps, mode)
        kwargs = dict(model="tiny", messages=CHAT, max_tokens=6, temperature=0, logprobs=True, top_logprobs=3,
                      extra_body={"ignore_eos": True})  # fmt: skip
        whole = c.chat.completions.create(**kwargs).choices[0].logprobs.content
        assert len(whole) == 6
        for t in whole:
            values = [a.logprob for a in t.top_logprobs]
            assert len(values) == 3 and values == sorted(values, reverse=True)
            assert t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob  # greedy: the top-1 is the token
        streamed = [t for ch in c.chat.completions.create(**kwargs, stream=True) for choice in ch.choices
                    for t in (choice.logprobs.content if choice.logprobs else [])]  # fmt: skip
        tokens = lambda entries: [(t.token, [a.token for a in t.top_logprobs]) for t in entries]  # noqa: E731
        assert tokens(streamed) == tokens(whole)
        assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in whole], abs=1e-5)
        # completions: logprobs k gives each position a {token: log-prob} of the chosen token and the k likeliest (k + 1 at most)
        sampled = c.completions.create(model="tiny", prompt="What is", max_tokens=5, temperature=1.0, seed=2, logprobs=2,
                                       extra_body={"ignore_eos": True}).choices[0].logprobs  # fmt: skip
        for token, logprob, top in zip(sampled.tokens, sampled.token_logprobs, sampled.top_logprobs):
            assert 2 <= len(top) <= 3 and top[token] == pytest.approx(logprob)
            assert logprob <= max(top.values())
        chunks = [ch.choices[0].logprobs for ch in c.completions.create(model="tiny", prompt="What is", max_tokens=5, temperature=1.0,
                                                                         seed=2, logprobs=2, stream=True, extra_body={"ignore_eos": True})
                  if ch.choices and ch.choices[0].logprobs]  # fmt: skip
        assert [t for lp in chunks for t in lp.tokens] == sampled.tokens
        assert [d for lp in chunks for d in lp.top_logprobs] == [pytest.approx(d) for d in sampled.top_logprobs]


def test_echo_with_logprobs_returns_the_prompts_log_probs_first(apps, tiny_model):
    """echo + logprobs: the prompt's tokens come first with their log-probs (the first None), as the engine scores them,
    then the completion's; streamed, the prompt's arrive in the first chunk."""
    from mlplat.serve.ingress import completion_prompt_ids

    engine = LLMEngine(EngineConfig(model=str(tiny_model)))
    prompt = "What is 1 + 2?"
    ids = completion_prompt_ids(engine.tokenizer, prompt)
    expected = engine.score(ids)
    for mode in ("pd", "colo"):
        c = client(apps, mode)
        r = c.completions.create(model="tiny", prompt=[prompt, "ok"], n=2, max_tokens=3, temperature=0, echo=True, logprobs=1,
                                 extra_body={"ignore_eos": True})  # fmt: skip
        assert len(r.choices) == 4
        for choice in r.choices[:2]:  # prompt 0's two samples
            lp = choice.logprobs
            assert choice.text.startswith(prompt) and len(lp.tokens) == len(ids) + 3
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            assert lp.token_logprobs[1 : len(ids)] == pytest.approx(expected, abs=1e-4)
            assert all(lp.tokens[k] in lp.top_logprobs[k] for k in range(1, len(lp.tokens)))
            assert "".join(lp.tokens[: len(ids)]) == prompt and lp.text_offset[len(ids)] == len(prompt)
        assert r.choices[2].text.startswith("ok") and r.choices[2].logprobs.token_logprobs[0] is None
        first = next(ch for ch in c.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0,
                                                        stream=True) if ch.choices)  # fmt: skip
        assert first.choices[0].text == prompt and first.choices[0].logprobs.token_logprobs[1:] == pytest.approx(expected, abs=1e-4)


def test_a_list_of_prompts_streams_with_choice_indices(apps):
    for mode in ("pd", "colo"):
        c = client(apps, mode)
        kwargs = dict(model="tiny", prompt=["hi", "What is 1 + 2?", "ok"], n=2, max_tokens=4, temperature=0)
        whole = c.completions.create(**kwargs)
        texts, reasons = collections.defaultdict(str), {}
        for chunk in c.completions.create(**kwargs, stream=True, stream_options={"include_usage": True}):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
                reasons[choice.index] = choice.finish_reason or reasons.get(choice.index)
            usage = chunk.usage or None
        assert dict(texts) == {ch.index: ch.text for ch in whole.choices} and sorted(texts) == list(range(6))
        assert reasons == {ch.index: ch.finish_reason for ch in whole.choices}
        assert usage.prompt_tokens == whole.usage.prompt_tokens and usage.completion_tokens == whole.usage.completion_tokens


def test_streaming_with_tools_auto_sends_content_as_it_comes_then_tool_call_deltas(apps):
    """tool_choice auto: content is streamed while no <tool_call> can be forming; a call is sent as tool-call deltas."""
    c = client(apps, "pd")
    kwargs = dict(model="tiny", messages=ASK, tools=[ADD], max_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    whole = c.chat.completions.create(**kwargs).choices[0].message.content
    pieces = [ch.choices[0].delta.content for ch in c.chat.completions.create(**kwargs, stream=True)
              if ch.choices and ch.choices[0].delta.content]  # fmt: skip
    assert "".join(pieces) == whole and len(pieces) >= 2  # not held back to the end
    # An answer (forced by a regex, still parsed as auto) with text before a call: the text streams first, then the call.
    regex = r'Sure\. <tool_call>\n\{"name": "add", "arguments": \{"a": 5\}\}\n</tool_call>'
    events = []
    forced = {**kwargs, "max_tokens": 85, "extra_body": {"structured_outputs": {"regex": regex}}}  # no ignore_eos: the grammar ends it
    for ch in c.chat.completions.create(**forced, stream=True):
        for choice in ch.choices:
            if choice.delta.content:
                events.append(("content", choice.delta.content))
            for d in choice.delta.tool_calls or []:
                events.append(("call", d.function.name or d.function.arguments))
            if choice.finish_reason:
                events.append(("finish", choice.finish_reason))
    assert "".join(e[1] for e in events if e[0] == "content").strip() == "Sure."
    assert events[-3:] == [("call", "add"), ("call", '{"a": 5}'), ("finish", "tool_calls")], events
    assert all(kind == "content" for kind, _ in events[:-3])


def test_responses_are_the_openai_packages_types_on_the_wire(apps):
    """The bodies are what openai's own types dump, with only the fields OpenAI sends: strict validation passes."""
    from openai.types import Completion
    from openai.types.chat import ChatCompletion, ChatCompletionChunk

    headers = {"Authorization": f"Bearer {KEY}"}
    chat = httpx.post(f"{apps['colo']}/chat/completions", json={"model": "tiny", "messages": CHAT, "max_tokens": 2}, headers=headers,
                      timeout=60).json()  # fmt: skip
    assert ChatCompletion.model_validate(chat, strict=True).object == "chat.completion"
    assert chat.keys() == {"id", "object", "created", "model", "choices", "usage"}
    assert chat["choices"][0].keys() == {"index", "message", "logprobs", "finish_reason"}
    assert chat["choices"][0]["message"].keys() == {"role", "content"}
    completion = httpx.post(f"{apps['colo']}/completions", json={"model": "tiny", "prompt": "hi", "max_tokens": 2}, headers=headers,
                            timeout=60).json()  # fmt: skip
    assert Completion.model_validate(completion, strict=True).usage.completion_tokens <= 2
    with httpx.stream("POST", f"{apps['colo']}/chat/completions", headers=headers, timeout=60,
                      json={"model": "tiny", "messages": CHAT, "max_tokens": 2, "stream": True}) as r:  # fmt: skip
        events = [line.removeprefix("data: ") for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]" and all(ChatCompletionChunk.model_validate_json(e).object == "chat.completion.chunk" for e in events[:-1])


def test_invalid_json_is_400(apps):
    r = httpx.post(f"{apps['pd']}/completions", content=b"{not json", headers={"content-type": "application/json"}, timeout=60)
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]


def test_api_keys(apps):
    base = apps["colo"]
    assert httpx.get(f"{base}/models", timeout=60).status_code == 401
    assert httpx.get(f"{base}/models", headers={"Authorization": "Bearer wrong"}, timeout=60).status_code == 401
    assert httpx.get(f"{base}/models", headers={"Authorization": f"Bearer {KEY}"}, timeout=60).status_code == 200
    body = httpx.get(f"{base}/models", timeout=60).json()
    assert body["error"]["code"] == "invalid_api_key" and KEY not in str(body)


# -- generated requests: Schemathesis from the app's own OpenAPI schema -------------------------------------------------
FUZZ_EXAMPLES = int(os.environ.get("MLPLAT_FUZZ_EXAMPLES", "200"))  # per mode; docs/testing.md: the longer run
FUZZ_MAX_TOKENS = 4  # generated answers stay short: the fuzzer is after the request surface, not long generations
FUZZ_PROMPT_CHARS = 24


FUZZ_STREAMED = {"model", "prompt", "messages", "max_tokens", "temperature", "seed", "n", "echo", "logprobs", "top_logprobs", "stop"}


def _fuzz_case(case, keep_model: int):
    """A generated request made cheap to serve, and mostly for the served model: max_tokens capped (left invalid where it is,
    set where absent) and n at most 2; ``model`` replaced by the served one unless ``keep_model`` is 0 (then it stays whatever
    was generated, mostly a 404). For ``keep_model`` 7, a streamed request of the generated values of a few common fields (few
    generated requests would otherwise be both valid and streamed)."""
    body = case.body
    if isinstance(body, dict) and keep_model == 7:
        body = case.body = {k: v for k, v in body.items() if k in FUZZ_STREAMED} | {"stream": True}
    if isinstance(body, dict):
        if keep_model and isinstance(body.get("model"), str):
            body["model"] = "tiny"
        for key in ("max_tokens", "max_completion_tokens"):
            if isinstance(body.get(key), int) and not isinstance(body[key], bool) and body[key] > FUZZ_MAX_TOKENS:
                body[key] = FUZZ_MAX_TOKENS
        if "max_tokens" not in body and "max_completion_tokens" not in body:
            body["max_tokens"] = FUZZ_MAX_TOKENS
        if isinstance(body.get("n"), int) and not isinstance(body["n"], bool) and 2 < body["n"] <= 8:
            body["n"] = 2
        # prompts short enough for the tiny model's 256-token context (generated text is mostly multi-byte characters)
        if isinstance(body.get("prompt"), str):
            body["prompt"] = body["prompt"][:FUZZ_PROMPT_CHARS]
        elif isinstance(body.get("prompt"), list) and all(isinstance(p, str) for p in body["prompt"]):
            body["prompt"] = [p[:FUZZ_PROMPT_CHARS] for p in body["prompt"]]
        if isinstance(body.get("messages"), list):
            for m in body["messages"]:
                if isinstance(m, dict) and isinstance(m.get("content"), str):
                    m["content"] = m["content"][:FUZZ_PROMPT_CHARS]
    return case


def _check_response(case, response) -> str:
    """2xx, or a 4xx with an OpenAI error body; never a 5xx. A stream's events are JSON, end with [DONE], and hold no server
    error. Returns the outcome's kind, for the tally."""
    where = f"{case.method} {case.path} {case.body!r:.600}"
    assert response.status_code < 500, f"{response.status_code} for {where}: {response.text[:600]}"
    if response.status_code >= 400:
        error = response.json()["error"]
        assert isinstance(error["message"], str) and error["type"] == "invalid_request_error" and {"param", "code"} <= error.keys(), where
        return str(response.status_code)
    assert response.status_code == 200, where
    if response.headers["content-type"].startswith("text/event-stream"):
        events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]", where
        for event in map(json.loads, events[:-1]):
            assert event.get("error", {}).get("type") != "server_error", f"{event} for {where}"
        return "stream"
    body = response.json()
    if case.path == "/v1/chat/completions":
        from openai.types.chat import ChatCompletion

        ChatCompletion.model_validate(body)  # what the openai client reads
    elif case.path == "/v1/completions":
        assert body["object"] == "text_completion" and all(isinstance(c["text"], str) for c in body["choices"]), where
    return "200"


@pytest.mark.parametrize("mode", ["pd", "colo"])
def test_generated_requests_are_2xx_or_4xx_with_an_openai_error_and_the_app_lives_on(apps, mode):
    """Schemathesis (valid and invalid requests, from /openapi.json of the running app) against every route, FUZZ_EXAMPLES
    requests per mode; then the app still answers."""
    import collections

    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import strategies as st
    from schemathesis import GenerationMode

    base = apps[mode].removesuffix("/v1")
    headers = {"Authorization": f"Bearer {KEY}"}
    document = httpx.get(f"{base}/openapi.json", timeout=60).json()  # the app's own schema, as served
    assert {"/v1/completions", "/v1/chat/completions", "/v1/models", "/health"} <= document["paths"].keys()
    schema = schemathesis.openapi.from_dict(document)
    operations = [result.ok() for result in schema.get_all_operations()]
    cases = st.one_of([op.as_strategy(generation_mode=m) for op in operations for m in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE)])
    tally, reasons = collections.Counter(), collections.Counter()
    http = httpx.Client(timeout=60)

    def send(case):
        # Schemathesis' own transport (requests) breaks where urllib3-future replaces urllib3 (grafana-client pulls it in
        # through niquests): the request it builds is sent with httpx instead.
        kw = case.as_transport_kwargs(base_url=base, headers=headers)
        data = kw.get("data")
        if "json" in kw:
            body = {"json": kw["json"]}
        else:
            body = {"content": data} if isinstance(data, bytes | str) else {"data": data} if data else {}
        return http.request(kw["method"], kw["url"], headers=kw["headers"], params=kw.get("params") or None, **body)

    @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=cases, keep_model=st.integers(0, 7))
    def fuzz(case, keep_model):
        case = _fuzz_case(case, keep_model)
        response = send(case)
        tally[_check_response(case, response)] += 1
        if response.status_code >= 400:
            reasons[response.json()["error"]["message"].split(":")[0][:40]] += 1

    with http:
        fuzz()
    print(f"{mode}: {sum(tally.values())} generated requests: {dict(tally)}; most refused for: {reasons.most_common(8)}")
    assert sum(tally.values()) >= FUZZ_EXAMPLES and tally["200"] + tally["stream"] > 0 and tally["400"] > 0
    assert httpx.get(f"{base}/health", timeout=60).status_code == 200
    assert client(apps, mode).completions.create(model="tiny", prompt="hi", max_tokens=2).choices[0].finish_reason


def test_overload_is_503_with_retry_after_and_nothing_leaks(apps):
    import asyncio

    async def fire(n):
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"model": "tiny", "prompt": "What is", "max_tokens": 60, "temperature": 0}
            return await asyncio.gather(*(http.post(f"{apps['pd']}/completions", json=body) for _ in range(n)))

    responses = asyncio.run(fire(24))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 503} and 503 in codes and 200 in codes, codes
    for r in responses:  # the ingress's own OpenAI error, not Serve's plain-text rejection; 429 is a tenant's rate limit
        if r.status_code == 503:
            assert r.headers.get("retry-after") and r.json()["error"]["code"] == "overloaded", r.text
    assert_idle(apps)


def assert_idle(apps, timeout=30):
    """Both engines of the PD app back to zero running sequences and all KV blocks free."""
    deadline = time.time() + timeout
    while True:
        stats = [serve.get_deployment_handle(name, app_name="pd").stats.remote().result() for name in ("prefill", "decode")]
        if all(s["running"] == 0 and s["waiting"] == 0 and s["free_kv_blocks"] == ENGINE["num_kv_blocks"] for s in stats):
            return stats
        assert time.time() < deadline, stats
        time.sleep(0.5)


def test_client_disconnect_aborts_and_frees_blocks(apps):
    # Counted in engine steps, not seconds: with 20 ms steps the 200 tokens would take 200 more steps
    # (4 s); the abort must arrive within a few steps of the disconnect.
    decode = serve.get_deployment_handle("decode", app_name="pd")
    decode.set_fault_hook.remote(lambda stage, seq: time.sleep(0.02) if stage == "forward" else None).result()
    try:
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{apps['pd']}/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            mid = decode.stats.remote().result()
            assert mid["running"] == 1  # mid-stream
        stats = assert_idle(apps)
    finally:
        decode.set_fault_hook.remote(None).result()
    assert stats[1]["steps"] - mid["steps"] < 50, (mid["steps"], stats[1]["steps"])
    handoffs = stats[1]["handoffs"]
    assert handoffs["count"] > 0 and handoffs["bytes"] > 0 and handoffs["import_failures"] == 0


def test_incompatible_kv_payload_is_recomputed_on_decode(apps, tiny_model):
    engine = LLMEngine(EngineConfig(model=str(tiny_model)))
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    expected = engine.generate([[5, 6, 7, 8, 9]], params)[0].outputs[0].token_ids
    payload = engine.prefill([5, 6, 7, 8, 9], params)
    payload.layout = {**payload.layout, "dtype": "torch.float16"}  # as if from a differently-configured prefill
    decode = serve.get_deployment_handle("decode", app_name="pd")
    before = decode.stats.remote().result()["handoffs"]["import_failures"]
    deltas = list(decode.options(stream=True).generate_prefilled.remote(payload, params.model_dump(), "import-test"))
    assert [t for d in deltas for t in d["token_ids"]] == expected
    assert decode.stats.remote().result()["handoffs"]["import_failures"] == before + 1


def test_hundreds_of_concurrent_streams_end_in_200_or_503_and_free_every_block(apps):
    import asyncio

    async def stream(http: httpx.AsyncClient, i: int) -> tuple[int, list[str]]:
        body = {"model": "tiny", "prompt": f"What is {i} +", "max_tokens": 12, "temperature": 0, "stream": True}
        async with http.stream("POST", f"{apps['pd']}/completions", json=body) as r:
            return r.status_code, [line async for line in r.aiter_lines() if line]

    async def fire(n: int):
        limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
        async with httpx.AsyncClient(timeout=180, limits=limits) as http:
            return await asyncio.gather(*(stream(http, i) for i in range(n)))

    results = asyncio.run(fire(300))
    codes = [code for code, _ in results]
    assert set(codes) <= {200, 503} and codes.count(200) >= ENGINE["max_num_seqs"], sorted(set(codes))
    for code, lines in results:
        if code == 200:  # every accepted stream ran to its end: chunks, then [DONE]
            assert lines[-1] == "data: [DONE]" and len(lines) >= 2 and "error" not in "".join(lines), lines[-3:]
    assert_idle(apps)


def openai_error(r: httpx.Response, status: int, code: str | None = None) -> dict:
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert error["message"] and error["type"] == ("invalid_request_error" if status < 500 else "server_error"), error
    assert code is None or error["code"] == code, error
    return error


def test_unknown_model_and_route_are_404_and_health_is_200(apps):
    for mode in ("pd", "colo"):
        headers = {"Authorization": f"Bearer {KEY}"}
        openai_error(httpx.post(f"{apps[mode]}/completions", json={"model": "nope", "prompt": "hi"}, headers=headers, timeout=60),
                     404, "model_not_found")  # fmt: skip
        openai_error(httpx.post(f"{apps[mode]}/embeddings", json={"model": "tiny", "input": "hi"}, headers=headers, timeout=60), 404)
        openai_error(httpx.post(f"{apps[mode]}/responses", json={"model": "tiny", "input": "hi"}, headers=headers, timeout=60), 404)
        openai_error(httpx.get(f"{apps[mode]}/completions", headers=headers, timeout=60), 405)
        root = apps[mode].removesuffix("/v1")
        assert httpx.get(f"{root}/health", timeout=60).json() == {"status": "ok"}
    with pytest.raises(openai.NotFoundError):
        client(apps, "pd").completions.create(model="nope", prompt="hi")


def test_prompt_token_ids_outside_the_vocabulary_are_400_and_the_replica_lives_on(apps, tiny_model):
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(tiny_model).vocab_size
    for mode in ("pd", "colo"):
        for bad in ([5, vocab, 6], [-1, 5]):
            r = httpx.post(f"{apps[mode]}/completions", json={"model": "tiny", "prompt": bad, "max_tokens": 4},
                           headers={"Authorization": f"Bearer {KEY}"}, timeout=60)  # fmt: skip
            assert "vocabulary" in openai_error(r, 400, "invalid_token_id")["message"]
        assert client(apps, mode).completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=4, temperature=0).choices[0].text is not None


def test_pd_request_whose_first_token_is_a_stop_token(apps):
    # The decode replica imports a prompt whose first token (sampled on prefill) already stops it.
    prefill = serve.get_deployment_handle("prefill", app_name="pd")
    decode = serve.get_deployment_handle("decode", app_name="pd")
    params = SamplingParams(temperature=0, max_tokens=12)
    payload = prefill.prefill.remote([5, 6, 7, 8], params.model_dump()).result()
    stop = params.model_copy(update={"stop_token_ids": [payload.first_token]}).model_dump()
    for i in range(3):
        deltas = list(decode.options(stream=True).generate_prefilled.remote(payload, stop, f"first-token-stop-{i}"))
        assert [(d["token_ids"], d["finish_reason"], d["text"]) for d in deltas] == [([], "stop", "")]
    reply = client(apps, "pd").completions.create(model="tiny", prompt="What is", max_tokens=6, temperature=0)
    assert reply.choices[0].finish_reason in ("stop", "length")
    assert_idle(apps)


def test_a_failing_request_is_500_and_the_next_one_succeeds(apps):
    def fault(stage, seq):  # a request whose prompt holds token 99 fails in its third decode step
        if stage == "sample" and 99 in seq.token_ids[: seq.num_prompt_tokens] and seq.num_output_tokens == 2:
            raise RuntimeError("injected request fault")

    handles = {"pd": serve.get_deployment_handle("decode", app_name="pd"), "colo": serve.get_deployment_handle("llm", app_name="colo")}
    for handle in handles.values():
        handle.set_fault_hook.remote(fault).result()
    try:
        for mode in ("pd", "colo"):
            c = client(apps, mode)
            with pytest.raises(openai.InternalServerError, match="injected request fault"):
                c.completions.create(model="tiny", prompt=[5, 99, 7], max_tokens=20, temperature=0)
            assert c.completions.create(model="tiny", prompt=[5, 6, 7], max_tokens=20, temperature=0).choices[0].finish_reason
        # Streaming: a token was already sent, so the failure arrives in-band, then [DONE].
        body = {"model": "tiny", "prompt": [5, 99, 7], "max_tokens": 20, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{apps['colo']}/completions", json=body, headers={"Authorization": f"Bearer {KEY}"}, timeout=60) as r:
            lines = [line for line in r.iter_lines() if line]
        assert r.status_code == 200 and lines[-1] == "data: [DONE]" and '"code": "request_failed"' in lines[-2], lines
    finally:
        for handle in handles.values():
            handle.set_fault_hook.remote(None).result()
    assert_idle(apps)


def test_a_request_past_its_deadline_is_504_and_frees_its_blocks(apps):
    import asyncio

    llm = serve.get_deployment_handle("llm", app_name="colo")
    llm.set_fault_hook.remote(lambda stage, seq: time.sleep(0.2) if stage == "forward" else None).result()  # 200 tokens: 40 s

    async def both():
        body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0}
        async with httpx.AsyncClient(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as http:
            async def stream():
                async with http.stream("POST", f"{apps['colo']}/completions", json={**body, "stream": True}) as r:
                    return r.status_code, [line async for line in r.aiter_lines() if line]
            return await asyncio.gather(http.post(f"{apps['colo']}/completions", json=body), stream())

    started = time.time()
    try:
        whole, (status, lines) = asyncio.run(both())
        elapsed = time.time() - started
        stats = llm.stats.remote().result()
    finally:
        llm.set_fault_hook.remote(None).result()
    openai_error(whole, 504, "timeout")
    assert status == 200 and lines[-1] == "data: [DONE]" and '"code": "timeout"' in lines[-2], lines[-3:]
    assert elapsed < TIMEOUT_S + 5 and stats["running"] == 0 and stats["free_kv_blocks"] == ENGINE["num_kv_blocks"], (elapsed, stats)


def test_an_engine_fault_is_503_at_once_and_serve_replaces_the_replica(apps):
    llm = serve.get_deployment_handle("llm", app_name="colo")
    (victim,) = replicas("colo", "llm")
    llm.set_fault_hook.remote(lambda stage, seq: time.sleep(0.05) if stage == "forward" else None).result()
    headers = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 200, "temperature": 0}
    with httpx.stream("POST", f"{apps['colo']}/completions", json={**body, "stream": True}, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")

        def fault(stage, seq):
            if stage == "forward":
                raise RuntimeError("injected engine fault")

        llm.set_fault_hook.remote(fault).result()
        rest = [line for line in lines if line]
    assert rest[-1] == "data: [DONE]" and '"code": "engine_unavailable"' in rest[-2], rest[-3:]
    r = httpx.post(f"{apps['colo']}/completions", json=body, headers=headers, timeout=60)
    assert openai_error(r, 503, "engine_unavailable") and r.headers.get("retry-after")
    deadline = time.time() + 120
    while victim in replicas("colo", "llm") or serve.status().applications["colo"].deployments["llm"].status != "HEALTHY":
        assert time.time() < deadline, "Serve did not replace the replica whose engine stopped in 120 s"
        time.sleep(0.5)
    assert client(apps, "colo").completions.create(model="tiny", prompt="What is", max_tokens=6, temperature=0).choices[0].text is not None
    assert httpx.get(f"{apps['colo'].removesuffix('/v1')}/health", timeout=60).status_code == 200


def replicas(app: str, deployment: str) -> list[str]:
    """Live replica actors (named SERVE_REPLICA::app#deployment#id), from the GCS."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith(prefix)]


def test_a_killed_decode_replica_is_replaced_and_new_requests_succeed(apps):
    # Last in this module: the PD app loses its only decode replica.
    import ray

    (victim,) = replicas("pd", "decode")
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    deadline = time.time() + 120
    while not ((live := replicas("pd", "decode")) and victim not in live
               and serve.status().applications["pd"].deployments["decode"].status == "HEALTHY"):
        assert time.time() < deadline, "Serve did not replace the killed decode replica in 120 s"
        time.sleep(1)
    for stream in (False, True):
        reply = client(apps, "pd").completions.create(model="tiny", prompt="What is 1 + 2?", max_tokens=6, temperature=0, stream=stream)
        text = "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text
        assert text
    assert_idle(apps)


def test_mlplat_serve_stops_on_ctrl_c_while_deploying(ray_cluster, tiny_model):
    # Against the session's cluster (--address), so no second Ray starts; SIGINT as soon as it deploys.
    import os
    import signal
    import subprocess

    import ray
    from conftest import MLPLAT

    command = [MLPLAT, "serve", "--address", ray.get_runtime_context().gcs_address, "--set", f"model={tiny_model}",
               "--set", "mode=colocated", "--set", "app_name=ctrl-c", "--set", "route_prefix=/ctrl-c"]  # fmt: skip
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        lines = []
        for line in process.stdout:
            lines.append(line)
            if line.startswith("deploying"):
                process.send_signal(signal.SIGINT)
                break
        assert process.wait(timeout=60) == 130, "".join(lines[-20:] + [process.stdout.read()])
    finally:
        if process.poll() is None:
            os.kill(process.pid, signal.SIGKILL)
            serve.delete("ctrl-c")  # a failed stop must not leave replicas holding the suite's CPUs
    assert "ctrl-c" not in serve.status().applications


def test_the_readmes_client_snippet_runs(apps, capsys):
    from conftest import readme_snippet

    snippet = readme_snippet("python", "openai.OpenAI(")
    assert 'base_url="http://127.0.0.1:8000/v1"' in snippet and 'model="quickstart-tiny"' in snippet
    # The same code against this suite's app: its route and its model's name.
    names = {}
    exec(snippet.replace("http://127.0.0.1:8000/v1", apps["pd"]).replace('"quickstart-tiny"', '"tiny"'), names)
    assert names["reply"].choices[0].finish_reason in ("stop", "length")
    assert capsys.readouterr().out == names["reply"].choices[0].message.content + "\n"  # the reply's text (the untrained model's: any)
