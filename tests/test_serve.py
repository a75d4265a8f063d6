"""The OpenAI-compatible serving app on a real local Ray cluster, over real HTTP, with the
real `openai` client: PD-disaggregated and colocated apps side by side."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from ray import serve

from mlplat.engine import EngineConfig, LLMEngine, SamplingParams
from mlplat.serve.config import ServeConfig
from serve_apps.llm import build_app

KEY = "test-key-123"
ENGINE = {"block_size": 16, "num_kv_blocks": 64, "max_num_seqs": 4, "max_waiting": 4}
SMALL = {"num_cpus": 0.2}


@pytest.fixture(scope="module")
def apps(ray_cluster, tiny_model, monkeypatch_module):
    monkeypatch_module.setenv("MLPLAT_API_KEYS", "")
    pd = build_app(ServeConfig(model=str(tiny_model), model_name="tiny", mode="pd", engine_args=ENGINE,
                               prefill=SMALL, decode=SMALL, ingress=SMALL, app_name="pd", route_prefix="/pd"))
    serve.run(pd, name="pd", route_prefix="/pd")
    monkeypatch_module.setenv("MLPLAT_API_KEYS", f"other,{KEY}")
    colo = build_app(ServeConfig(model=str(tiny_model), model_name="tiny", mode="colocated", engine_args=ENGINE,
                                 colocated=SMALL, ingress=SMALL, app_name="colo", route_prefix="/colo"))
    serve.run(colo, name="colo", route_prefix="/colo")
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
    for mode in ("pd", "colo"):
        kwargs = dict(model="tiny", prompt="What is", max_tokens=10, n=2, seed=5, temperature=1.0)
        whole = client(apps, mode).completions.create(**kwargs)
        texts, reasons = {0: "", 1: ""}, {}
        for chunk in client(apps, mode).completions.create(**kwargs, stream=True):
            for c in chunk.choices:
                texts[c.index] += c.text
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
        assert texts == {c.index: c.text for c in whole.choices}, mode
        assert set(reasons) == {0, 1}
        results[mode] = texts
    assert results["pd"] == results["colo"]  # sample i is seeded with seed + i in both topologies


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
        ({"model": "nope", "prompt": "hi"}, "model"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 0}, "max_tokens"),
        ({"model": "tiny", "prompt": "hi", "max_tokens": 100_000}, "max_tokens"),
        ({"model": "tiny", "prompt": "hi " * 400, "max_tokens": 4}, "prompt"),
        ({"model": "tiny", "prompt": "hi", "temperature": -1}, "temperature"),
        ({"model": "tiny", "prompt": "hi", "n": 100}, "n"),
        ({"model": "tiny", "prompt": ""}, "prompt"),
    ],
)
def test_bad_completion_requests_are_400_naming_the_field(apps, body, param):
    r = httpx.post(f"{apps['pd']}/completions", json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "") + error["message"]


@pytest.mark.parametrize(
    "body, param",
    [({"model": "tiny", "messages": []}, "messages"), ({"model": "tiny", "messages": [{"role": "robot", "content": "x"}]}, "role")],
)
def test_bad_chat_requests_are_400(apps, body, param):
    r = httpx.post(f"{apps['pd']}/chat/completions", json=body, timeout=60)
    assert r.status_code == 400 and param in r.json()["error"]["message"]


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


def test_overload_is_429_and_nothing_leaks(apps):
    import asyncio

    async def fire(n):
        async with httpx.AsyncClient(timeout=120) as http:
            body = {"model": "tiny", "prompt": "What is", "max_tokens": 60, "temperature": 0}
            return await asyncio.gather(*(http.post(f"{apps['pd']}/completions", json=body) for _ in range(n)))

    responses = asyncio.run(fire(24))
    codes = [r.status_code for r in responses]
    assert set(codes) <= {200, 429} and 429 in codes and 200 in codes, codes
    assert all(r.headers.get("retry-after") for r in responses if r.status_code == 429)
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
    body = {"model": "tiny", "prompt": "What is", "max_tokens": 200, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{apps['pd']}/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: ")
        decode = serve.get_deployment_handle("decode", app_name="pd").stats.remote().result()
        assert decode["running"] == 1  # mid-stream
    stats = assert_idle(apps)
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


def test_hundreds_of_concurrent_streams_end_in_200_or_429_and_free_every_block(apps):
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
    assert set(codes) <= {200, 429} and codes.count(200) >= ENGINE["max_num_seqs"], sorted(set(codes))
    for code, lines in results:
        if code == 200:  # every accepted stream ran to its end: chunks, then [DONE]
            assert lines[-1] == "data: [DONE]" and len(lines) >= 2 and "error" not in "".join(lines), lines[-3:]
    assert_idle(apps)


def test_a_killed_decode_replica_is_replaced_and_new_requests_succeed(apps):
    # Last in this module: the PD app loses its only decode replica.
    import ray

    def decode_replicas() -> list[str]:  # live replica actors (named SERVE_REPLICA::app#deployment#id), from the GCS
        return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].startswith("SERVE_REPLICA::pd#decode#")]

    (victim,) = decode_replicas()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    deadline = time.time() + 120
    while not ((replicas := decode_replicas()) and victim not in replicas
               and serve.status().applications["pd"].deployments["decode"].status == "HEALTHY"):
        assert time.time() < deadline, "Serve did not replace the killed decode replica in 120 s"
        time.sleep(1)
    for stream in (False, True):
        reply = client(apps, "pd").completions.create(model="tiny", prompt="What is 1 + 2?", max_tokens=6, temperature=0, stream=stream)
        text = "".join(c.choices[0].text for c in reply) if stream else reply.choices[0].text
        assert text
    assert_idle(apps)
