"""`specdecode serve`: the OpenAI-compatible server, driven over real HTTP on loopback.

Each server runs uvicorn in a background thread on a free port, over tiny float64 models
made here. Answers are compared with `Pipeline.generate` on a pipeline of its own, so a
server that mixed up requests, slots or caches would fail.
"""

from __future__ import annotations

import asyncio
import copy
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import httpx
import openai
import pytest
import schemathesis
from conftest import TargetSpec, cached_tokenizer, draft_model, target_model
from hypothesis import HealthCheck, given, settings
from schemathesis.generation import GenerationMode
from transformers import PreTrainedTokenizerBase

import specdecode
from specdecode import (
    Chunk,
    DraftModelConfig,
    GenerationConfig,
    HFBackend,
    Pipeline,
    SamplingParams,
    SpecdecodeError,
)
from specdecode.backends.native import NativeBackend
from specdecode.cli import build_parser, main
from specdecode.loadtest import percentile
from specdecode.server import ServerSettings, create_app
from specdecode.server.chat import DEFAULT_TEMPLATE, render
from specdecode.server.metrics import Metrics
from specdecode.server.schemas import Message
from specdecode.server.serve import Server, listen
from specdecode.server.settings import settings_from_args
from specdecode.server.slots import Closing, Job, Outbox, SlotPool
from specdecode.testing import save_model

SPEC = TargetSpec(seed=5)
DRAFT_CONFIG = DraftModelConfig(n_max=4, p_min=0.0)
MODEL_ID = "tiny"
MAX_TOKENS_LIMIT = 256
GREEDY = SamplingParams(temperature=0)
PROMPTS = [f"def f{i}(x):\n    return x * {i}" for i in range(16)]


class SlowBackend(HFBackend):
    """A target that takes at least 20 ms a pass: a 250-token generation lasts seconds, long
    enough to look at the server while it runs, whatever the machine's speed."""

    def evaluate(self, ids, logits_rows=None):
        time.sleep(0.02)
        return super().evaluate(ids, logits_rows)


class FailingBackend(HFBackend):
    """A target whose passes after the prompt fail, with details a client must not see."""

    def evaluate(self, ids, logits_rows=None):
        if self.tokens:
            raise RuntimeError("secret detail: the private weights' location")
        return super().evaluate(ids, logits_rows)


def make_pipeline(
    spec_types: list[str] | None = None,
    target: type[HFBackend] = HFBackend,
    draft_config: DraftModelConfig = DRAFT_CONFIG,
    tokenizer: PreTrainedTokenizerBase | None = None,
) -> Pipeline:
    tokenizer = tokenizer or cached_tokenizer()
    return Pipeline(
        target(target_model(SPEC), tokenizer),
        HFBackend(draft_model(SPEC, 0.1), tokenizer),
        spec_types=spec_types,
        draft_config=draft_config,
    )


def alone(
    prompt: str, n: int, sampling: SamplingParams = GREEDY, draft_config: DraftModelConfig = DRAFT_CONFIG
) -> specdecode.Result:
    """What the library gives for a request, on a pipeline no server touches."""
    return make_pipeline(draft_config=draft_config).generate(prompt, sampling, GenerationConfig(n_predict=n))


def slow_tokenizer(seconds: float) -> PreTrainedTokenizerBase:
    """A copy of the test tokenizer (and of its own copies) that takes `seconds` to tokenize,
    as a text of megabytes does; sleeping lets other threads run, as the Rust tokenizer does.
    The one-character texts a backend tokenizes as it loads take no time."""
    base = cached_tokenizer()

    def tokenize(self, *args, **kwargs):
        text = args[0] if args else kwargs.get("text")
        if not (isinstance(text, str) and len(text) <= 1):
            time.sleep(seconds)
        return type(base).__call__(self, *args, **kwargs)

    tokenizer = copy.deepcopy(base)
    tokenizer.__class__ = type("SlowTokenizer", (type(base),), {"__call__": tokenize})
    return tokenizer


@contextmanager
def running(
    target: type[HFBackend] = HFBackend, pipeline: Pipeline | None = None, **settings
) -> Iterator[tuple[str, Server]]:
    """A server on a free loopback port for the duration of the block: its base URL, and the
    server, whose `should_exit` starts the shutdown as SIGTERM does."""
    options = {"model_id": MODEL_ID, "max_tokens": MAX_TOKENS_LIMIT, **settings}
    app = create_app(pipeline or make_pipeline(target=target), ServerSettings(**options))
    sock = listen("127.0.0.1", 0)
    server = Server(app, log_level="warning")
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}", server
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


@contextmanager
def serving(target: type[HFBackend] = HFBackend, **settings) -> Iterator[str]:
    """A server on a free loopback port for the duration of the block; yields its base URL."""
    with running(target, **settings) as (base, _):
        yield base


@pytest.fixture(scope="module")
def url() -> Iterator[str]:
    with serving(parallel=4) as base:
        yield base


@pytest.fixture(scope="module")
def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)


def metric(url: str, name: str) -> float:
    """One sample of /metrics, e.g. 'specdecode_requests_total{outcome="completed"}'."""
    for line in httpx.get(f"{url}/metrics", timeout=30).text.splitlines():
        if line.startswith(f"{name} "):
            return float(line.split()[-1])
    raise AssertionError(f"{name} is not in /metrics")


def sse_events(response: httpx.Response) -> list[str]:
    return [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]


# --------------------------------------------------------------------------- answers


def test_greedy_completion_equals_pipeline_generate(client):
    expected = alone(PROMPTS[0], 40)
    reply = client.completions.create(model=MODEL_ID, prompt=PROMPTS[0], max_tokens=40, temperature=0)
    assert reply.choices[0].text == expected.text
    assert reply.usage.prompt_tokens == expected.stats.n_prompt
    assert reply.usage.completion_tokens == len(expected.tokens)
    assert reply.choices[0].finish_reason == ("length" if len(expected.tokens) == 40 else "stop")
    assert reply.system_fingerprint.startswith("fp_")
    timings = reply.model_extra["timings"]
    assert timings["prompt_n"] + timings["cache_n"] == expected.stats.n_prompt
    assert timings["predicted_n"] == len(expected.tokens)
    assert timings["draft_n"] == expected.stats.totals.n_drafted > 0
    assert timings["draft_n_accepted"] == expected.stats.totals.n_accepted
    assert timings["predicted_ms"] > 0 and timings["predicted_per_second"] > 0


def test_seeded_sampling_equals_pipeline_generate(client):
    sampling = SamplingParams(temperature=0.9, top_k=0, top_p=0.9, min_p=0.0, seed=11)
    expected = alone(PROMPTS[1], 24, sampling)
    reply = client.completions.create(
        prompt=PROMPTS[1],
        max_tokens=24,
        temperature=0.9,
        top_p=0.9,
        seed=11,
        extra_body={"top_k": 0, "min_p": 0.0},
        model=MODEL_ID,
    )
    assert reply.choices[0].text == expected.text


def test_token_id_prompt_and_missing_model_are_accepted(url):
    ids = make_pipeline().encode(PROMPTS[2])
    reply = httpx.post(f"{url}/v1/completions", json={"prompt": ids, "max_tokens": 12, "temperature": 0})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == alone(PROMPTS[2], 12).text
    assert reply.json()["model"] == MODEL_ID


def test_stream_equals_whole_answer_and_ends_with_timings(client, url):
    expected = alone(PROMPTS[3], 40)
    chunks = list(
        client.completions.create(
            model=MODEL_ID, prompt=PROMPTS[3], max_tokens=40, temperature=0, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in chunks) == expected.text
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])
    last = chunks[-1]
    assert last.choices[0].finish_reason in ("stop", "length")
    assert last.model_extra["timings"]["draft_n"] == expected.stats.totals.n_drafted
    assert all(c.usage is None for c in chunks)  # usage only when stream_options asks
    assert len({c.id for c in chunks}) == 1 and len({c.system_fingerprint for c in chunks}) == 1
    body = {"prompt": PROMPTS[3], "max_tokens": 8, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] is not None
    assert not any("usage" in json.loads(event) for event in events[:-1])


def test_include_usage_adds_openais_usage_chunk(client, url):
    expected = alone(PROMPTS[3], 24)
    chunks = list(
        client.completions.create(
            model=MODEL_ID,
            prompt=PROMPTS[3],
            max_tokens=24,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    *text_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.completion_tokens == len(expected.tokens)
    assert usage_chunk.usage.prompt_tokens == expected.stats.n_prompt
    assert all(c.usage is None for c in text_chunks)
    assert text_chunks[-1].choices[0].finish_reason in ("stop", "length")
    assert "".join(c.choices[0].text for c in text_chunks) == expected.text
    body = {"prompt": PROMPTS[3], "max_tokens": 4, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        events = [json.loads(e) for e in sse_events(response)[:-1]]
    assert all(e["usage"] is None for e in events[:-1])  # present, and null, until the last
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, "stream": True}
    with httpx.stream(
        "POST", f"{url}/v1/chat/completions", json={**chat, "stream_options": {}}, timeout=60
    ) as response:
        events = [json.loads(e) for e in sse_events(response)[:-1]]
    assert not any("usage" in e for e in events)  # {} leaves include_usage off
    refused = httpx.post(f"{url}/v1/completions", json={**body, "stream": False})
    check_refusal(refused, 400, "stream_options", None)


def test_chat_uses_the_default_template_when_the_tokenizer_has_none(client):
    messages = [Message(role="system", content="Be short."), Message(role="user", content="def add(a, b):")]
    prompt = render(cached_tokenizer(), messages)
    assert prompt == "system: Be short.\nuser: def add(a, b):\nassistant:"
    expected = alone(prompt, 32)
    as_dicts = [m.model_dump(exclude_none=True) for m in messages]
    reply = client.chat.completions.create(model=MODEL_ID, messages=as_dicts, max_tokens=32, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.choices[0].message.refusal is None and "refusal" in reply.choices[0].message.model_fields_set
    assert reply.system_fingerprint.startswith("fp_")
    assert reply.usage.prompt_tokens == expected.stats.n_prompt
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=as_dicts, max_tokens=32, temperature=0, stream=True
    )
    chunks = list(stream)
    opening = chunks[0].choices[0].delta
    assert (opening.role, opening.content, opening.refusal) == ("assistant", "", None)  # role only
    assert all(c.choices[0].delta.role is None for c in chunks[1:])
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_uses_the_tokenizers_own_template(tmp_path):
    tokenizer = cached_tokenizer()
    templated = type(tokenizer).from_pretrained(save_model(tmp_path / "m", target_model(SPEC), tokenizer))
    templated.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    )
    assert render(templated, [Message(role="user", content="hi")]) == "<user>hi<assistant>"


def test_messages_the_chat_template_refuses_are_a_bad_request():
    tokenizer = copy.deepcopy(cached_tokenizer())
    tokenizer.chat_template = "{{ raise_exception('Conversation roles must alternate user/assistant') }}"
    with running(pipeline=make_pipeline(tokenizer=tokenizer), parallel=1) as (base, _):
        refused = post(base, "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
    check_refusal(refused, 400, "messages", None)
    assert "roles must alternate" in refused.json()["error"]["message"]


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok"
    assert health["slots_idle"] + health["slots_processing"] == 4


# --------------------------------------------------------------------------- refusals

LONG = [5] * 600  # token ids: more than the 512-token context
HUGE = "x" * 3_900_000  # characters: under the 4 MiB body limit, far past what the context holds
BAD_COMPLETIONS = {
    "malformed JSON": (b'{"prompt": "x",', 400, None, "json_invalid"),
    "not UTF-8": (b"\xff\xfe", 400, None, "json_invalid"),
    "not an object": (b'["x"]', 400, None, "model_type"),
    "no prompt": ({"max_tokens": 4}, 400, "prompt", "missing"),
    "prompt of the wrong type": ({"prompt": ["a", 1.5]}, 400, "prompt", "string_type"),
    "max_tokens as a string": ({"prompt": "x", "max_tokens": "4"}, 400, "max_tokens", "int_type"),
    "temperature as a string": ({"prompt": "x", "temperature": "hot"}, 400, "temperature", "float_type"),
    "stream as a number": ({"prompt": "x", "stream": 1}, 400, "stream", "bool_type"),
    "unknown field": ({"prompt": "x", "max_tokenz": 4}, 400, "max_tokenz", "extra_forbidden"),
    "unknown model": ({"prompt": "x", "model": "gpt-4"}, 404, "model", "model_not_found"),
    "empty prompt": ({"prompt": ""}, 400, "prompt", None),
    "empty token list": ({"prompt": []}, 400, "prompt", None),
    "token id past the vocabulary": ({"prompt": [1, 100000]}, 400, "prompt", None),
    "prompt longer than the context": ({"prompt": LONG}, 400, "prompt", "context_length_exceeded"),
    "prompt + max_tokens past the context": (
        {"prompt": LONG[:500], "max_tokens": 100},
        400,
        "max_tokens",
        "context_length_exceeded",
    ),
    "max_tokens 0": ({"prompt": "x", "max_tokens": 0}, 400, "max_tokens", None),
    "max_tokens negative": ({"prompt": "x", "max_tokens": -1}, 400, "max_tokens", None),
    "max_tokens above the limit": (
        {"prompt": "x", "max_tokens": MAX_TOKENS_LIMIT + 1},
        400,
        "max_tokens",
        None,
    ),
    "n 17": ({"prompt": "x", "n": 17}, 400, "n", "less_than_equal"),
    "logprobs 6": ({"prompt": "x", "logprobs": 6}, 400, "logprobs", "value_error"),
    "top_p 0": ({"prompt": "x", "top_p": 0}, 400, "top_p", "greater_than"),
    "negative seed": ({"prompt": "x", "seed": -1}, 400, "seed", "greater_than_equal"),
    "seed 2^64": ({"prompt": "x", "seed": 2**64}, 400, "seed", "less_than"),
    "five stop strings": ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "too_long"),
    "infinite temperature": (b'{"prompt": "x", "temperature": 1e999}', 400, None, None),
    "JSON nested 1000 deep": (b'{"prompt": ' + b"[" * 1000 + b"]" * 1000 + b"}", 400, None, "json_invalid"),
    "JSON nested 900 deep": (b'{"prompt": ' + b"[" * 900 + b"]" * 900 + b"}", 400, "prompt", None),
    "lone surrogate in the prompt": (b'{"prompt": "def \\ud800"}', 400, "prompt", "value_error"),
    "lone surrogate, streamed": (b'{"prompt": "\\udfff", "stream": true}', 400, "prompt", "value_error"),
    "lone surrogate in a stop string": (b'{"prompt": "x", "stop": ["\\ud800"]}', 400, "stop", "value_error"),
    "text longer than the context can hold": (
        {"prompt": HUGE},
        400,
        "prompt",
        "context_length_exceeded",
    ),
    "speculative.n_max above the server's": (
        {"prompt": "x", "speculative.n_max": 5},
        400,
        "speculative.n_max",
        None,
    ),
    "speculative.n_min above n_max": (
        {"prompt": "x", "speculative.n_max": 2, "speculative.n_min": 3},
        400,
        "speculative.n_min",
        None,
    ),
    "speculative.p_min past 1": ({"prompt": "x", "speculative.p_min": 1.5}, 400, "speculative.p_min", None),
}
BAD_CHATS = {
    "no messages": ({"messages": []}, 400, "messages", "too_short"),
    "unknown role": ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "literal_error"),
    "content of the wrong type": ({"messages": [{"role": "user", "content": 3}]}, 400, "messages", None),
    "unknown model": ({"messages": [{"role": "user", "content": "hi"}], "model": "x"}, 404, "model", None),
    "lone surrogate in content": (
        b'{"messages": [{"role": "user", "content": "a\\ud800b"}]}',
        400,
        "messages",
        "value_error",
    ),
    "lone surrogate in a text part, streamed": (
        b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udbff"}]}], "stream": true}',
        400,
        "messages",
        "value_error",
    ),
    "tools": ({"messages": [{"role": "user", "content": "hi"}], "tools": [{}]}, 400, "tools", "unsupported"),
    "messages longer than the context can hold": (
        {"messages": [{"role": "user", "content": HUGE}]},
        400,
        "messages",
        "context_length_exceeded",
    ),
}
BAD_NATIVE = {
    "n_predict 0": ({"prompt": "x", "n_predict": 0}, 400, "n_predict", None),
    "n_predict -2": ({"prompt": "x", "n_predict": -2}, 400, "n_predict", None),
    "seed -2": ({"prompt": "x", "seed": -2}, 400, "seed", "greater_than_equal"),
    "n_probs 101": ({"prompt": "x", "n_probs": 101}, 400, "n_probs", "less_than_equal"),
    "max_tokens (an OpenAI name)": ({"prompt": "x", "max_tokens": 3}, 400, "max_tokens", "extra_forbidden"),
    "seventeen stop strings": ({"prompt": "x", "stop": ["s"] * 17}, 400, "stop", "too_long"),
    "lone surrogate": (b'{"prompt": "\\ud800", "stream": true}', 400, "prompt", "value_error"),
    "n_predict past the context": (
        {"prompt": LONG[:500], "n_predict": 100},
        400,
        "n_predict",
        "context_length_exceeded",
    ),
    "speculative.n_max 0": ({"prompt": "x", "speculative.n_max": 0}, 400, "speculative.n_max", None),
}
BAD_TOKENS = {
    "/tokenize: lone surrogate": ("/tokenize", b'{"content": "\\ud800"}', 400, "content", "value_error"),
    "/tokenize: no content": ("/tokenize", {"add_special": True}, 400, "content", "missing"),
    "/tokenize: too long": ("/tokenize", {"content": HUGE}, 400, "content", "context_length_exceeded"),
    "/detokenize: id past the vocabulary": ("/detokenize", {"tokens": [1, 320]}, 400, "tokens", None),
    "/detokenize: negative id": ("/detokenize", {"tokens": [-1]}, 400, "tokens", None),
}
ERROR_TYPES = {  # llama-server's types where it has its own; OpenAI's otherwise
    "context_length_exceeded": "exceed_context_size_error",
    "unsupported": "not_supported_error",
    "invalid_api_key": "authentication_error",
    "shutting_down": "unavailable_error",
}


def check_refusal(response: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["message"] and error["param"] == param
    if code is not None:
        assert error["code"] == code
    assert error["type"] == ERROR_TYPES.get(error["code"], "invalid_request_error")
    extra = {"n_ctx", "n_prompt_tokens"} if error["type"] == "exceed_context_size_error" else set()
    assert {"message", "type", "param", "code"} <= set(error) <= {"message", "type", "param", "code", *extra}
    if extra:
        assert error["n_ctx"] == 512


def post(url: str, path: str, body: dict | bytes) -> httpx.Response:
    if isinstance(body, bytes):
        return httpx.post(f"{url}{path}", content=body, headers={"Content-Type": "application/json"})
    return httpx.post(f"{url}{path}", json=body)


@pytest.mark.parametrize("case", BAD_COMPLETIONS)
def test_bad_completion_requests_get_an_openai_error(url, case):
    body, status, param, code = BAD_COMPLETIONS[case]
    check_refusal(post(url, "/v1/completions", body), status, param, code)


@pytest.mark.parametrize("case", BAD_CHATS)
def test_bad_chat_requests_get_an_openai_error(url, case):
    body, status, param, code = BAD_CHATS[case]
    check_refusal(post(url, "/v1/chat/completions", body), status, param, code)


@pytest.mark.parametrize("case", BAD_NATIVE)
def test_bad_native_completions_get_an_openai_error(url, case):
    body, status, param, code = BAD_NATIVE[case]
    check_refusal(post(url, "/completion", body), status, param, code)


@pytest.mark.parametrize("case", BAD_TOKENS)
def test_bad_tokenize_requests_get_an_openai_error(url, case):
    path, body, status, param, code = BAD_TOKENS[case]
    check_refusal(post(url, path, body), status, param, code)


def test_refusals_of_size_route_and_method_and_the_server_keeps_serving(url, client):
    check_refusal(post(url, "/v1/completions", {"prompt": "x" * (5 << 20)}), 413, None, "request_too_large")
    check_refusal(httpx.get(f"{url}/v1/nothing"), 404, None, None)
    refused = httpx.get(f"{url}/v1/completions")
    check_refusal(refused, 405, None, None)
    assert refused.headers["allow"] == "POST"
    assert httpx.post(f"{url}/v1/models").headers["allow"] == "GET"
    reply = client.completions.create(model=MODEL_ID, prompt=PROMPTS[11], max_tokens=5, temperature=0)
    assert reply.choices[0].text == alone(PROMPTS[11], 5).text
    assert metric(url, 'specdecode_requests_total{outcome="failed"}') == 0


def test_openai_client_sees_refusals_as_bad_requests(client):
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=MODEL_ID, prompt="x", max_tokens=0)
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="gpt-4", prompt="x", max_tokens=4)


# --------------------------------------------------------------------------- concurrency


def test_parallel_streams_each_get_their_own_answer(url):
    """16 streaming clients on 4 slots: 12 wait in the queue, none sees another's tokens."""
    expected = {prompt: alone(prompt, 48).text for prompt in PROMPTS}

    def stream(prompt: str) -> str:
        body = {"prompt": prompt, "max_tokens": 48, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=300) as response:
            events = sse_events(response)
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        answers = dict(zip(PROMPTS, pool.map(stream, PROMPTS), strict=True))
    assert answers == expected
    assert httpx.get(f"{url}/health").json()["slots_idle"] == 4


def native_pipeline() -> Pipeline:
    """The native backend, whose forks share one forward: slots batch into shared passes."""
    tokenizer = cached_tokenizer()
    return Pipeline(
        NativeBackend(target_model(SPEC), tokenizer),
        NativeBackend(draft_model(SPEC, 0.1), tokenizer),
        spec_types=["ngram-simple", "draft"],
        draft_config=DRAFT_CONFIG,
    )


def test_64_clients_share_passes_and_each_gets_its_solo_answer():
    """64 concurrent clients on 8 slots, greedy and seeded, streamed and whole: no error, every
    answer is what the library gives the request alone, and decode passes were shared."""
    solo = native_pipeline()
    requests = []
    for index in range(64):
        sampling = GREEDY if index % 2 else SamplingParams(temperature=0.8, seed=index)
        requests.append((PROMPTS[index % len(PROMPTS)], sampling, index % 4 == 0))
    expected = [
        solo.generate(prompt, sampling, GenerationConfig(n_predict=24)).text
        for prompt, sampling, _ in requests
    ]

    def ask(base: str, prompt: str, sampling: SamplingParams, stream: bool) -> str:
        body = {"prompt": prompt, "max_tokens": 24, "temperature": sampling.temperature, "stream": stream}
        if sampling.seed is not None:
            body["seed"] = sampling.seed
        if not stream:
            reply = httpx.post(f"{base}/v1/completions", json=body, timeout=300)
            assert reply.status_code == 200, reply.text
            return reply.json()["choices"][0]["text"]
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=300) as response:
            events = sse_events(response)
        assert events[-1] == "[DONE]"
        return "".join(json.loads(e)["choices"][0]["text"] for e in events[:-1])

    with running(pipeline=native_pipeline(), parallel=8) as (base, _):
        with ThreadPoolExecutor(64) as pool:
            answers = list(pool.map(lambda request: ask(base, *request), requests))
        assert answers == expected
        assert metric(base, 'specdecode_requests_total{outcome="completed"}') == 64
        assert metric(base, "specdecode_batch_size_mean") > 1.5
        assert httpx.get(f"{base}/health").json()["slots_idle"] == 8


def test_health_answers_while_every_slot_generates():
    with serving(SlowBackend, parallel=1) as base:
        body = {"prompt": PROMPTS[4], "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            health = httpx.get(f"{base}/health", timeout=5).json()
            assert health["slots_processing"] == 1
            (slot,) = httpx.get(f"{base}/slots", timeout=5).json()
            assert slot["is_processing"] and slot["id"] == 0 and slot["id_task"] >= 0
            assert slot["params"]["n_predict"] == 100 and slot["params"]["temperature"] == 0
            assert slot["next_token"]["n_decoded"] >= 1
            assert slot["next_token"]["n_remain"] == 100 - slot["next_token"]["n_decoded"]
            assert [line for line in lines if line][-1] == "data: [DONE]"
        assert not httpx.get(f"{base}/slots", timeout=5).json()[0]["is_processing"]


def test_a_client_that_leaves_mid_stream_frees_its_slot():
    with serving(SlowBackend, parallel=1) as base:
        body = {"prompt": PROMPTS[5], "max_tokens": 250, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            next(lines)  # two events in, the client hangs up
        deadline = time.monotonic() + 10
        while httpx.get(f"{base}/health").json()["slots_idle"] != 1:
            assert time.monotonic() < deadline, "the slot was not freed"
            time.sleep(0.02)
        assert metric(base, 'specdecode_requests_total{outcome="cancelled"}') == 1
        assert metric(base, "specdecode_generated_tokens_total") < 250
        reply = httpx.post(
            f"{base}/v1/completions", json={"prompt": PROMPTS[6], "max_tokens": 8, "temperature": 0}
        )
        assert reply.json()["choices"][0]["text"] == alone(PROMPTS[6], 8).text
        assert metric(base, 'specdecode_requests_total{outcome="completed"}') == 1


def test_a_client_that_leaves_while_its_choices_wait_for_slots_frees_every_slot():
    # 4 choices on 2 slots: 2 generate (250 tokens take seconds here) while 2 wait for a slot
    with serving(SlowBackend, parallel=2) as base:
        body = {"prompt": PROMPTS[8], "max_tokens": 250, "temperature": 0, "n": 4}
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(f"{base}/v1/completions", json=body, timeout=1)
        deadline = time.monotonic() + 10
        while (health := httpx.get(f"{base}/health").json())["slots_idle"] != 2 or health["requests_waiting"]:
            assert time.monotonic() < deadline, "the slots were not freed"
            time.sleep(0.02)
        assert metric(base, 'specdecode_requests_total{outcome="cancelled"}') == 2
        assert metric(base, 'specdecode_requests_total{outcome="completed"}') == 0
        assert metric(base, "specdecode_generated_tokens_total") < 2 * 250


def test_a_streamed_choice_waiting_for_a_slot_holds_back_none_of_the_others():
    with serving(SlowBackend, parallel=1) as base:
        body = {"prompt": PROMPTS[8], "max_tokens": 150, "temperature": 0, "n": 2, "stream": True}
        texts = ["", ""]
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            data = (line.removeprefix("data: ") for line in lines if line.startswith("data: "))
            events = (json.loads(event) for event in data if event != "[DONE]")
            first = next(events)
            # choice 0 streams while choice 1 still waits for the one slot
            assert first["choices"][0]["index"] == 0 and first["choices"][0]["text"]
            health = httpx.get(f"{base}/health", timeout=5).json()
            assert health["slots_processing"] == 1 and health["requests_waiting"] == 1
            for event in [first, *events]:
                for choice in event["choices"]:
                    texts[choice["index"]] += choice["text"]
        assert texts == [alone(PROMPTS[8], 150).text] * 2


def test_a_prompt_goes_to_the_free_slot_whose_cache_holds_it():
    """llama-server's --slot-prompt-similarity: of the free slots, the one whose cache the
    prompt reuses most; with 0, the least recently used, which here holds another prompt."""
    body = {"prompt": PROMPTS[3], "n_predict": 8, "temperature": 0}
    for similarity in (0.1, 0.0):
        # the native forward keeps every cached position (see the cache_prompt test below)
        with serving(NativeBackend, parallel=4, slot_prompt_similarity=similarity) as base:
            first = post(base, "/completion", body).json()
            for other in ("import os\nprint(os.name)", "class A:\n    x = 1"):  # sharing only BOS
                post(base, "/completion", {**body, "prompt": other})
            again = [post(base, "/completion", body).json() for _ in range(3)]
            fresh = post(base, "/completion", {**body, "cache_prompt": False}).json()
        n_prompt = first["tokens_evaluated"]
        assert first["tokens_cached"] == 0 and fresh["tokens_cached"] == 0
        assert {answer["content"] for answer in [first, *again]} == {fresh["content"]}
        cached = [answer["tokens_cached"] for answer in again]
        if similarity:
            assert cached == [n_prompt - 1] * 3
            assert {answer["id_slot"] for answer in again} == {first["id_slot"]}
            assert [answer["timings"]["prompt_n"] for answer in again] == [1] * 3
        else:  # slots 3 (empty), then 0 (which held the prompt), then 1 (another prompt)
            assert cached == [0, n_prompt - 1, 1]


def test_outbox_hands_events_posted_before_its_delivery_over_in_one_wake_up_in_order():
    async def scenario() -> None:
        loop = asyncio.get_running_loop()
        wake_ups: list[object] = []
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(callback, *args):
            wake_ups.append(callback)
            return call_soon_threadsafe(callback, *args)

        loop.call_soon_threadsafe = counted
        outbox = Outbox(loop)
        queues: list[asyncio.Queue] = [asyncio.Queue(), asyncio.Queue()]
        for event in range(6):
            outbox.post(queues[event % 2], event)
        await asyncio.sleep(0)
        assert len(wake_ups) == 1
        assert [queues[0].get_nowait() for _ in range(3)] == [0, 2, 4]
        assert [queues[1].get_nowait() for _ in range(3)] == [1, 3, 5]
        outbox.post(queues[0], "later")  # after the delivery: a wake-up of its own
        await asyncio.sleep(0)
        assert len(wake_ups) == 2 and queues[0].get_nowait() == "later"

    asyncio.run(scenario())


def test_slot_pool_queues_requests_beyond_its_slots():
    """One slot, two jobs: the second waits until the first's events are closed."""
    pool = SlotPool([make_pipeline(target=SlowBackend)], Metrics(["draft"]))
    prompt = make_pipeline().encode(PROMPTS[7])
    job = Job(prompt, GREEDY, GenerationConfig(n_predict=100))

    async def scenario() -> None:
        first = pool.start(await pool.acquire(), job).events()
        await anext(first)
        assert pool.busy == 1
        waiting = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.2)
        assert not waiting.done() and pool.waiting == 1
        await first.aclose()
        second = await asyncio.wait_for(waiting, 30)
        assert pool.waiting == 0
        pool.release(second)

    asyncio.run(scenario())
    pool.shutdown()


def test_slot_pool_drain_refuses_waiters_and_cuts_runs_after_the_grace():
    pool = SlotPool([make_pipeline(target=SlowBackend)], Metrics(["draft"]))
    job = Job(make_pipeline().encode(PROMPTS[7]), GREEDY, GenerationConfig(n_predict=200))

    async def scenario() -> None:
        run = pool.start(await pool.acquire(), job)
        events = run.events()
        await anext(events)
        waiting = asyncio.ensure_future(pool.acquire())
        await asyncio.sleep(0.05)
        started = time.monotonic()
        await pool.drain(grace=0.3)
        assert time.monotonic() - started >= 0.3
        with pytest.raises(Closing):
            await waiting
        with pytest.raises(Closing):
            await pool.acquire()
        with pytest.raises(Closing):  # the text so far, then Closing instead of the Generation
            async for event in events:
                assert isinstance(event, Chunk)

    asyncio.run(scenario())
    pool.shutdown()


def test_forks_share_weights_and_shared_state_but_not_caches():
    pipeline = make_pipeline(["ngram-mod", "ngram-cache", "draft"])
    fork = pipeline.fork()
    assert fork.shared is pipeline.shared
    assert fork.target.model is pipeline.target.model and fork.draft.model is pipeline.draft.model
    assert fork.target.tokenizer is not pipeline.target.tokenizer
    fork.generate(PROMPTS[8], GREEDY, GenerationConfig(n_predict=8))
    assert fork.target.tokens and not pipeline.target.tokens


# --------------------------------------------------------------------------- metrics, key, command


def test_metrics_move_with_each_request(client, url):
    names = [
        'specdecode_requests_total{outcome="completed"}',
        "specdecode_prompt_tokens_total",
        "specdecode_generated_tokens_total",
        'specdecode_drafted_tokens_total{strategy="draft"}',
        "specdecode_verify_seconds_total",
    ]
    before = {name: metric(url, name) for name in names}
    expected = alone(PROMPTS[9], 30)
    client.completions.create(model=MODEL_ID, prompt=PROMPTS[9], max_tokens=30, temperature=0)
    after = {name: metric(url, name) for name in names}
    assert after[names[0]] == before[names[0]] + 1
    assert after[names[1]] == before[names[1]] + expected.stats.n_prompt
    assert after[names[2]] == before[names[2]] + len(expected.tokens)
    assert after[names[3]] == before[names[3]] + expected.stats.totals.n_drafted
    assert after[names[4]] > before[names[4]]
    assert metric(url, "process_resident_memory_bytes") > 1e6


def test_the_suffix_store_is_shared_by_the_slots_and_reported_in_metrics():
    """Requests at once on two slots answer as alone; the suffix strategy's store learns each
    one, and /metrics reports its size."""
    prompts = [PROMPTS[1], PROMPTS[2], PROMPTS[1]]
    with running(pipeline=make_pipeline(["suffix"]), parallel=2) as (base, _):
        api = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=120)
        with ThreadPoolExecutor(len(prompts)) as pool:
            answers = list(
                pool.map(
                    lambda p: api.completions.create(model=MODEL_ID, prompt=p, max_tokens=24, temperature=0),
                    prompts,
                )
            )
        assert [a.choices[0].text for a in answers] == [alone(p, 24).text for p in prompts]
        assert metric(base, "specdecode_suffix_cache_requests") == len(prompts)
        assert metric(base, "specdecode_suffix_cache_tokens") > 0
        assert metric(base, "specdecode_suffix_cache_bytes") > 0


KEYED_PATHS = [
    ("GET", "/v1/models"),
    ("GET", "/models"),
    ("GET", "/metrics"),
    ("GET", "/props"),
    ("GET", "/slots"),
    ("GET", "/openapi.json"),
    ("POST", "/v1/completions"),
    ("POST", "/completions"),
    ("POST", "/v1/chat/completions"),
    ("POST", "/chat/completions"),
    ("POST", "/completion"),
    ("POST", "/tokenize"),
    ("POST", "/detokenize"),
    ("GET", "/no-such-route"),
]


def test_api_key_is_required_when_set():
    with serving(api_key="s3cret") as base:
        for method, path in KEYED_PATHS:
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
                refused = httpx.request(method, f"{base}{path}", headers=headers, content=b"{not json")
                assert refused.status_code == 401, (path, headers)  # the key is checked before the body
                check_refusal(refused, 401, None, "invalid_api_key")
                assert refused.headers["www-authenticate"].startswith("Bearer")
        assert httpx.get(f"{base}/health").status_code == 200
        for scheme in ("Bearer", "bearer", "BEARER"):  # auth schemes are case-insensitive
            headers = {"Authorization": f"{scheme} s3cret"}
            assert httpx.get(f"{base}/v1/models", headers=headers).status_code == 200
        assert httpx.get(f"{base}/v1/models", headers={"Authorization": "Bearer S3CRET"}).status_code == 401
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        reply = good.completions.create(model=MODEL_ID, prompt=PROMPTS[10], max_tokens=6, temperature=0)
        assert reply.choices[0].text == alone(PROMPTS[10], 6).text


@pytest.mark.parametrize("key", ["", " "])
def test_an_empty_api_key_is_refused(key):
    with pytest.raises(SpecdecodeError, match="API key is empty"):
        ServerSettings(model_id=MODEL_ID, api_key=key)


@pytest.fixture(scope="module")
def saved_pair(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("serve-models")
    tokenizer = cached_tokenizer()
    return (
        save_model(root / "target", target_model(SPEC), tokenizer),
        save_model(root / "draft", draft_model(SPEC, 0.1), tokenizer),
    )


def test_serve_command_prints_one_line_and_serves(saved_pair):
    target, draft = saved_pair
    env = {**os.environ, "PYTHONPATH": str(Path(specdecode.__file__).parents[1])}
    command = [sys.executable, "-m", "specdecode.cli", "serve", "-m", str(target), "-md", str(draft)]
    process = subprocess.Popen(
        [*command, "--port", "0", "-t", "1", "--alias", "pair"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("specdecode serve: listening on http://127.0.0.1:"), process.stderr.read()
        assert "model pair + draft draft" in line and "strategies draft" in line
        base = line.split()[4]
        assert httpx.get(f"{base}/v1/models").json()["data"][0]["id"] == "pair"
        assert httpx.get(f"{base}/props").json()["model_path"] == str(target)
    finally:
        process.terminate()
        # uvicorn shuts down, then raises the signal again: the process reports how it ended.
        assert process.wait(30) == -signal.SIGTERM
    assert "Traceback" not in process.stderr.read()


def test_serve_flags_make_the_settings():
    cors = ["--cors", "https://a.example,https://b.example", "--cors", "*"]
    others = ["--accept-any-model", "--shutdown-grace", "2.5", "--api-key", "k", "-m", "somewhere/target"]
    args = build_parser().parse_args(["serve", *cors, *others, "-sps", "0.5"])
    settings = settings_from_args(args, make_pipeline(), GREEDY)
    assert settings.cors_origins == ("https://a.example", "https://b.example", "*")
    assert settings.accept_any_model and settings.shutdown_grace == 2.5 and settings.api_key == "k"
    assert settings.model_path == "somewhere/target" and settings.slot_prompt_similarity == 0.5
    defaults = settings_from_args(build_parser().parse_args(["serve"]), make_pipeline(), GREEDY)
    assert defaults.cors_origins == () and not defaults.accept_any_model and defaults.shutdown_grace == 10
    assert defaults.slot_prompt_similarity == 0.1  # llama-server's
    with pytest.raises(SpecdecodeError, match="--slot-prompt-similarity"):
        ServerSettings(model_id="m", slot_prompt_similarity=1.5)


@pytest.mark.parametrize("how", ["flag", "environment"])
def test_serve_command_refuses_an_empty_api_key(saved_pair, capsys, monkeypatch, how):
    args = ["serve", "-m", str(saved_pair[0]), "--port", "0"]
    if how == "flag":
        args += ["--api-key", ""]
    else:
        monkeypatch.setenv("SPECDECODE_API_KEY", "")
    assert main(args) == 2
    *phases, error = capsys.readouterr().err.splitlines()
    assert error.startswith("error: the API key is empty")
    assert all(line.startswith("specdecode: ") for line in phases)  # the start-up phases before it


def test_serve_command_refuses_a_port_in_use(saved_pair, capsys):
    with listen("127.0.0.1", 0) as taken:
        port = str(taken.getsockname()[1])
        assert main(["serve", "-m", str(saved_pair[0]), "--port", port]) == 2
    assert capsys.readouterr().err.startswith(f"error: cannot listen on 127.0.0.1:{port}")


def test_loadtest_reports_throughput_latency_and_memory(url, capsys):
    assert main(["loadtest", "--url", url, "--clients", "3", "--duration", "0.5", "--max-tokens", "4"]) == 0
    out = capsys.readouterr().out
    assert out.startswith(f"loadtest: 3 clients for 0.5 s against {url}")
    assert ", 0 errors in " in out and "requests/s" in out and "tokens/s" in out
    assert "latency   p50 " in out and " p99 " in out
    assert "server    resident memory " in out


def test_loadtest_fails_when_requests_fail(url, capsys):
    args = ["loadtest", "--url", url, "--clients", "1", "--duration", "0.2", "--max-tokens", "100000"]
    assert main(args) == 2
    captured = capsys.readouterr()
    assert "0 ok" in captured.out
    assert "requests failed; the first: HTTP 400" in captured.err


def test_percentile_is_nearest_rank():
    values = [float(v) for v in range(1, 101)]
    assert (percentile(values, 50), percentile(values, 99), percentile(values, 100)) == (50.0, 99.0, 100.0)
    assert percentile([3.0], 99) == 3.0


# --------------------------------------------------------------------------- faults under hostile input


def test_huge_prompts_are_refused_at_once_and_stall_no_one(url):
    """Four prompts of 3.9 MB (under the body limit): each is refused by its length, before
    any tokenizing, while /health keeps answering."""
    with ThreadPoolExecutor(4) as pool:
        started = time.monotonic()
        replies = [pool.submit(post, url, "/v1/completions", {"prompt": HUGE}) for _ in range(4)]
        health = httpx.get(f"{url}/health", timeout=10)
        answered = [reply.result() for reply in replies]
    assert health.status_code == 200
    # Tokenizing one such prompt (a single 3.9M-character word) takes minutes; refusing all
    # four takes about a second, and 30 s leaves room for a busy machine.
    assert time.monotonic() - started < 30
    for reply in answered:
        check_refusal(reply, 400, "prompt", "context_length_exceeded")


def test_tokenizing_runs_beside_the_event_loop():
    """A prompt that takes 4 s to tokenize: /health answers meanwhile, then the answer comes."""
    pipeline = make_pipeline(tokenizer=slow_tokenizer(4.0))
    with running(pipeline=pipeline, parallel=1) as (base, _), ThreadPoolExecutor(1) as pool:
        body = {"prompt": PROMPTS[0], "max_tokens": 4, "temperature": 0}
        pending = pool.submit(post, base, "/v1/completions", body)
        time.sleep(0.5)
        started = time.monotonic()
        assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        # A loop blocked by the tokenizing would answer 3.5 s later; a busy machine, in well under 2.5 s.
        assert time.monotonic() - started < 2.5 and not pending.done()
        assert pending.result().json()["choices"][0]["text"] == alone(PROMPTS[0], 4).text


def test_a_failure_of_the_server_is_logged_not_sent(caplog):
    """A generation that raises: a generic 500 (or, streamed, a generic error event and
    [DONE]); the details go to the log, and the server keeps serving."""
    with serving(FailingBackend, parallel=1) as base:
        body = {"prompt": PROMPTS[1], "max_tokens": 8}
        failed = post(base, "/v1/completions", body)
        assert failed.status_code == 500
        assert failed.json()["error"]["type"] == "server_error" and "secret" not in failed.text
        with httpx.stream("POST", f"{base}/v1/completions", json={**body, "stream": True}) as response:
            events = sse_events(response)
        assert events[-1] == "[DONE]" and "secret" not in "".join(events)
        assert json.loads(events[-2])["error"]["type"] == "server_error"
        native = {"prompt": PROMPTS[1], "n_predict": 8, "stream": True}
        with httpx.stream("POST", f"{base}/completion", json=native) as response:
            events = sse_events(response)
        assert json.loads(events[-1])["error"]["type"] == "server_error" and "secret" not in "".join(events)
        assert httpx.get(f"{base}/health").json()["slots_idle"] == 1
        assert metric(base, 'specdecode_requests_total{outcome="failed"}') == 3
    assert sum("secret detail" in record.exc_text for record in caplog.records if record.exc_text) == 3


# --------------------------------------------------------------------------- shutdown


def test_shutdown_cuts_generations_past_the_grace_and_refuses_queued_requests():
    """Two slots: a stream and a whole answer run past the 1 s grace and are cut, the stream
    with an error event and [DONE], the whole answer with a 503. A queued stream and a queued
    whole request get a 503 before any header."""
    with running(SlowBackend, parallel=2, shutdown_grace=1.0) as (base, server):
        body = {"prompt": PROMPTS[5], "max_tokens": 250, "temperature": 0, "stream": True}
        whole = {**body, "stream": False}
        with ThreadPoolExecutor(3) as pool:
            with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
                lines = response.iter_lines()
                first = next(lines)
                others = {"running whole": pool.submit(post, base, "/v1/completions", whole)}
                wait_for(base, "slots_processing", 2)
                others["queued stream"] = pool.submit(post, base, "/v1/completions", body)
                others["queued whole"] = pool.submit(post, base, "/v1/completions", whole)
                wait_for(base, "requests_waiting", 2)
                server.should_exit = True  # what SIGTERM does
                started = time.monotonic()
                events = [e.removeprefix("data: ") for e in [first, *lines] if e.startswith("data: ")]
                cut_after = time.monotonic() - started
            for reply in others.values():
                check_refusal(reply.result(), 503, None, "shutting_down")
    assert 1.0 <= cut_after < 10
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["error"]["code"] == "shutting_down"
    text = "".join(json.loads(e)["choices"][0]["text"] for e in events[:-2])
    assert text and alone(PROMPTS[5], 250).text.startswith(text)


def wait_for(base: str, gauge: str, value: int) -> None:
    """Until /health shows `value` for `gauge`."""
    deadline = time.monotonic() + 10
    while httpx.get(f"{base}/health").json()[gauge] != value:
        assert time.monotonic() < deadline, f"{gauge} did not reach {value}"
        time.sleep(0.02)


def test_shutdown_lets_a_generation_finish_within_the_grace():
    with running(SlowBackend, parallel=1, shutdown_grace=60) as (base, server):
        body = {"prompt": PROMPTS[6], "max_tokens": 30, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            events = [next(lines)]
            server.should_exit = True
            events += lines
            with pytest.raises(httpx.ConnectError):  # no longer accepting
                httpx.get(f"{base}/health")
    data = [e.removeprefix("data: ") for e in events if e.startswith("data: ")]
    assert data[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["text"] for e in data[:-1]) == alone(PROMPTS[6], 30).text


# --------------------------------------------------------------------------- llama-server's API


def test_routes_without_v1_are_aliases(url):
    client = openai.OpenAI(base_url=url, api_key="unused", max_retries=0, timeout=120)
    expected = alone(PROMPTS[12], 16)
    reply = client.completions.create(model=MODEL_ID, prompt=PROMPTS[12], max_tokens=16, temperature=0)
    assert reply.choices[0].text == expected.text
    messages = [{"role": "user", "content": "def add(a, b):"}]
    chat = client.chat.completions.create(model=MODEL_ID, messages=messages, max_tokens=16, temperature=0)
    prompt = render(cached_tokenizer(), [Message(**messages[0])])
    assert chat.choices[0].message.content == alone(prompt, 16).text
    assert [m.id for m in client.models.list().data] == [MODEL_ID]


def test_native_completion_answers_as_llama_server(url):
    expected = alone(PROMPTS[13], 20)
    body = {"prompt": PROMPTS[13], "n_predict": 20, "temperature": 0, "return_tokens": True}
    reply = post(url, "/completion", body).json()
    assert reply["content"] == expected.text and reply["tokens"] == expected.tokens
    assert reply["stop"] is True and reply["stopping_word"] == "" and reply["truncated"] is False
    assert reply["stop_type"] == ("limit" if len(expected.tokens) == 20 else "eos")
    assert reply["tokens_predicted"] == len(expected.tokens)
    assert reply["tokens_evaluated"] == expected.stats.n_prompt
    timings = reply["timings"]
    assert timings["draft_n"] == expected.stats.totals.n_drafted > 0
    assert timings["draft_n_accepted"] == expected.stats.totals.n_accepted
    assert timings["cache_n"] == reply["tokens_cached"]
    assert timings["prompt_n"] + timings["cache_n"] == expected.stats.n_prompt
    settings = reply["generation_settings"]
    assert settings["n_ctx"] == 512 and settings["n_predict"] == 20 and settings["temperature"] == 0
    assert (settings["speculative.n_max"], settings["speculative.p_min"]) == (4, 0.0)
    assert post(url, "/completion", {**body, "return_tokens": False}).json()["tokens"] == []

    word = expected.text[10:13]
    stopped = post(url, "/completion", {**body, "stop": [word, "never there"]}).json()
    assert stopped["content"] == expected.text[: expected.text.index(word)]
    assert (stopped["stop_type"], stopped["stopping_word"]) == ("word", word)

    with httpx.stream("POST", f"{url}/completion", json={**body, "stream": True}, timeout=60) as response:
        events = [json.loads(e) for e in sse_events(response)]  # no [DONE] here, as llama-server
    *chunks, last = events
    assert "".join(c["content"] for c in chunks) == expected.text
    assert [t for c in chunks for t in c["tokens"]] == expected.tokens
    assert not any(c["stop"] for c in chunks)
    assert last["stop"] is True and last["content"] == "" and last["timings"]["predicted_n"] == 20


def test_per_request_drafting_settings_reach_that_generation_only(url, client):
    narrow = replace(DRAFT_CONFIG, n_max=2)
    expected = alone(PROMPTS[14], 24, draft_config=narrow)
    assert expected.stats.totals.n_drafted != alone(PROMPTS[14], 24).stats.totals.n_drafted
    body = {"prompt": PROMPTS[14], "n_predict": 24, "temperature": 0, "speculative.n_max": 2}
    native = post(url, "/completion", body).json()
    assert native["content"] == expected.text
    assert native["timings"]["draft_n"] == expected.stats.totals.n_drafted
    assert native["generation_settings"]["speculative.n_max"] == 2
    openai_reply = client.completions.create(
        model=MODEL_ID, prompt=PROMPTS[14], max_tokens=24, temperature=0, extra_body={"speculative.n_max": 2}
    )
    assert openai_reply.model_extra["timings"]["draft_n"] == expected.stats.totals.n_drafted
    strict = alone(PROMPTS[14], 24, draft_config=replace(DRAFT_CONFIG, p_min=0.9, n_min=1))
    reply = post(
        url, "/completion", {**body, "speculative.n_max": 4, "speculative.p_min": 0.9, "speculative.n_min": 1}
    )
    assert reply.json()["timings"]["draft_n"] == strict.stats.totals.n_drafted
    for _ in range(4):  # every slot still drafts with the server's settings
        plain = client.completions.create(model=MODEL_ID, prompt=PROMPTS[14], max_tokens=24, temperature=0)
        assert plain.model_extra["timings"]["draft_n"] == alone(PROMPTS[14], 24).stats.totals.n_drafted


def test_cache_prompt_reuses_the_slots_prefix_unless_told_not_to():
    # the native forward keeps every cached position (its rows are invariant); transformers'
    # forward keeps only whole n_batch chunks, none of this short prompt (tests/test_prompt_cache.py)
    with serving(NativeBackend, parallel=1) as base:
        body = {"prompt": PROMPTS[15], "n_predict": 8, "temperature": 0}
        first, again = (post(base, "/completion", body).json() for _ in range(2))
        fresh = post(base, "/completion", {**body, "cache_prompt": False}).json()
    n_prompt = first["tokens_evaluated"]
    assert first["tokens_cached"] == 0 and first["timings"]["prompt_n"] == n_prompt
    assert again["tokens_cached"] == n_prompt - 1 and again["timings"]["prompt_n"] == 1
    assert fresh["tokens_cached"] == 0 and fresh["timings"]["prompt_n"] == n_prompt
    assert first["content"] == again["content"] == fresh["content"]


def test_props_and_slots_as_llama_server_gives_them(url):
    props = httpx.get(f"{url}/props").json()
    assert props["total_slots"] == 4 and props["chat_template"] == DEFAULT_TEMPLATE
    assert props["model_path"] == "model" and props["build_info"].startswith("specdecode ")
    defaults = props["default_generation_settings"]
    assert defaults["n_ctx"] == 512 and defaults["speculative"] is True and not defaults["is_processing"]
    params = defaults["params"]
    assert params["n_predict"] == -1 and params["seed"] == 0xFFFFFFFF and params["temperature"] == 0.8
    assert (params["speculative.n_max"], params["speculative.n_min"], params["speculative.p_min"]) == (
        4,
        0,
        0.0,
    )
    slots = httpx.get(f"{url}/slots").json()
    assert [slot["id"] for slot in slots] == [0, 1, 2, 3]
    assert all(
        slot["n_ctx"] == 512 and set(slot) >= {"is_processing", "params", "next_token"} for slot in slots
    )


def test_tokenize_and_detokenize_as_llama_server(url):
    tokenizer = cached_tokenizer()
    text = PROMPTS[15]
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert post(url, "/tokenize", {"content": text}).json() == {"tokens": ids}
    with_bos = post(url, "/tokenize", {"content": text, "add_special": True}).json()["tokens"]
    assert with_bos == tokenizer(text)["input_ids"] and with_bos[0] == tokenizer.bos_token_id
    pieces = post(url, "/tokenize", {"content": text, "with_pieces": True}).json()["tokens"]
    assert [piece["id"] for piece in pieces] == ids and "".join(piece["piece"] for piece in pieces) == text
    special = {"content": tokenizer.bos_token}
    assert post(url, "/tokenize", special).json()["tokens"] == [tokenizer.bos_token_id]
    assert (
        tokenizer.bos_token_id
        not in post(url, "/tokenize", {**special, "parse_special": False}).json()["tokens"]
    )
    assert post(url, "/detokenize", {"tokens": ids}).json() == {"content": text}


def test_cors_is_off_by_default_and_answers_preflights_when_on(url):
    origin = "https://app.example"
    preflight = {
        "Origin": origin,
        "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type",
    }
    off = httpx.options(f"{url}/v1/completions", headers=preflight)
    assert off.status_code == 405 and "access-control-allow-origin" not in off.headers
    assert (
        "access-control-allow-origin" not in httpx.get(f"{url}/v1/models", headers={"Origin": origin}).headers
    )
    with serving(api_key="k", cors_origins=(origin,)) as base:
        answered = httpx.options(f"{base}/v1/completions", headers=preflight)  # no key: preflights carry none
        assert answered.status_code == 200 and answered.headers["access-control-allow-origin"] == origin
        assert "POST" in answered.headers["access-control-allow-methods"]
        assert "authorization" in answered.headers["access-control-allow-headers"].lower()
        stranger = httpx.options(
            f"{base}/v1/completions", headers={**preflight, "Origin": "https://evil.example"}
        )
        assert stranger.status_code == 400 and "access-control-allow-origin" not in stranger.headers
        keyed = {"Origin": origin, "Authorization": "Bearer k"}
        assert httpx.get(f"{base}/v1/models", headers=keyed).headers["access-control-allow-origin"] == origin
        refused = httpx.get(f"{base}/v1/models", headers={"Origin": origin})
        assert refused.status_code == 401 and refused.headers["access-control-allow-origin"] == origin


def test_any_model_name_is_served_only_when_allowed():
    with serving(accept_any_model=True) as base:
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)
        reply = client.completions.create(model="gpt-4o", prompt=PROMPTS[2], max_tokens=6, temperature=0)
        assert reply.choices[0].text == alone(PROMPTS[2], 6).text and reply.model == MODEL_ID


# --------------------------------------------------------------------------- fuzzing the published schema

FUZZ_EXAMPLES = 30  # per operation and mode (valid, invalid); at most, where fewer exist


def test_fuzzed_requests_get_no_server_error(capsys):
    """Requests generated by schemathesis from the server's own /openapi.json, fitting it and
    not (wrong types, missing and unknown fields, odd strings and numbers), for every
    operation: each gets an answer, and none is a 5xx. The server answers at most 8 tokens,
    so that the valid requests cost little."""
    tally: Counter[str] = Counter()
    with serving(parallel=2, max_tokens=8) as base:
        schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
        for result in schema.get_all_operations():
            operation = result.ok()
            has_body = operation.method.upper() == "POST"
            for mode in [GenerationMode.POSITIVE, GenerationMode.NEGATIVE][: 1 + has_body]:

                @given(case=operation.as_strategy(generation_mode=mode))
                @settings(
                    max_examples=FUZZ_EXAMPLES,
                    deadline=None,
                    derandomize=True,
                    database=None,
                    suppress_health_check=list(HealthCheck),
                )
                def call(case: schemathesis.Case) -> None:
                    response = case.call(timeout=60)
                    tally[f"{response.status_code // 100}xx"] += 1
                    assert response.status_code < 500, (case.method, case.path, case.body, response.text)

                call()
        assert httpx.get(f"{base}/health").json()["slots_idle"] == 2
    counts = ", ".join(f"{tally[kind]} {kind}" for kind in ("2xx", "4xx", "5xx"))
    with capsys.disabled():
        print(f"\nfuzz: {sum(tally.values())} requests: {counts}")
    assert tally["4xx"] > 0 and tally["2xx"] > 0 and tally["5xx"] == 0
