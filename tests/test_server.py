"""`specdecode serve`: the OpenAI-compatible server, driven over real HTTP on loopback.

Each server runs uvicorn in a background thread on a free port, over tiny float64 models
made here. Answers are compared with `Pipeline.generate` on a pipeline of its own, so a
server that mixed up requests, slots or caches would fail.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
import uvicorn
from conftest import TargetSpec, cached_tokenizer, draft_model, target_model

import specdecode
from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.cli import main
from specdecode.loadtest import percentile
from specdecode.server import ServerSettings, create_app
from specdecode.server.chat import render
from specdecode.server.metrics import Metrics
from specdecode.server.schemas import Message
from specdecode.server.serve import listen
from specdecode.server.slots import Job, SlotPool
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


def make_pipeline(spec_types: list[str] | None = None, target: type[HFBackend] = HFBackend) -> Pipeline:
    tokenizer = cached_tokenizer()
    return Pipeline(
        target(target_model(SPEC), tokenizer),
        HFBackend(draft_model(SPEC, 0.1), tokenizer),
        spec_types=spec_types,
        draft_config=DRAFT_CONFIG,
    )


def alone(prompt: str, n: int, sampling: SamplingParams = GREEDY) -> specdecode.Result:
    """What the library gives for a request, on a pipeline no server touches."""
    return make_pipeline().generate(prompt, sampling, GenerationConfig(n_predict=n))


@contextmanager
def serving(target: type[HFBackend] = HFBackend, **settings) -> Iterator[str]:
    """A server on a free loopback port for the duration of the block; yields its base URL."""
    options = {"model_id": MODEL_ID, "max_tokens": MAX_TOKENS_LIMIT, **settings}
    app = create_app(make_pipeline(target=target), ServerSettings(**options))
    sock = listen("127.0.0.1", 0)
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the server did not start"
        time.sleep(0.02)
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()


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
    timings = reply.model_extra["timings"]
    assert timings["prompt_n"] == expected.stats.n_prompt
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


def test_stream_equals_whole_answer_and_ends_with_usage(client, url):
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
    assert last.usage.completion_tokens == len(expected.tokens)
    assert last.model_extra["timings"]["draft_n"] == expected.stats.totals.n_drafted
    assert len({c.id for c in chunks}) == 1
    body = {"prompt": PROMPTS[3], "max_tokens": 8, "stream": True, "temperature": 0}
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=60) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = sse_events(response)
    assert events[-1] == "[DONE]"
    assert json.loads(events[-2])["choices"][0]["finish_reason"] is not None


def test_chat_uses_the_default_template_when_the_tokenizer_has_none(client):
    messages = [Message(role="system", content="Be short."), Message(role="user", content="def add(a, b):")]
    prompt = render(cached_tokenizer(), messages)
    assert prompt == "system: Be short.\nuser: def add(a, b):\nassistant:"
    expected = alone(prompt, 32)
    as_dicts = [m.model_dump(exclude_none=True) for m in messages]
    reply = client.chat.completions.create(model=MODEL_ID, messages=as_dicts, max_tokens=32, temperature=0)
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == expected.text
    assert reply.usage.prompt_tokens == expected.stats.n_prompt
    stream = client.chat.completions.create(
        model=MODEL_ID, messages=as_dicts, max_tokens=32, temperature=0, stream=True
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == expected.text
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_chat_uses_the_tokenizers_own_template(tmp_path):
    tokenizer = cached_tokenizer()
    templated = type(tokenizer).from_pretrained(save_model(tmp_path / "m", target_model(SPEC), tokenizer))
    templated.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}<assistant>"
    )
    assert render(templated, [Message(role="user", content="hi")]) == "<user>hi<assistant>"


def test_models_and_health(client, url):
    assert [m.id for m in client.models.list().data] == [MODEL_ID]
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok"
    assert health["slots_idle"] + health["slots_processing"] == 4


# --------------------------------------------------------------------------- refusals

LONG = [5] * 600  # token ids: more than the 512-token context
BAD_COMPLETIONS = {
    "malformed JSON": (b'{"prompt": "x",', 400, None, "json_invalid"),
    "not UTF-8": (b"\xff\xfe", 400, None, "json_invalid"),
    "not an object": (b'["x"]', 400, None, "model_type"),
    "no prompt": ({"max_tokens": 4}, 400, "prompt", "missing"),
    "prompt of the wrong type": ({"prompt": ["a", "b"]}, 400, "prompt", "string_type"),
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
    "n 2": ({"prompt": "x", "n": 2}, 400, "n", "literal_error"),
    "top_p 0": ({"prompt": "x", "top_p": 0}, 400, "top_p", "greater_than"),
    "negative seed": ({"prompt": "x", "seed": -1}, 400, "seed", "greater_than_equal"),
    "seed 2^64": ({"prompt": "x", "seed": 2**64}, 400, "seed", "less_than"),
    "five stop strings": ({"prompt": "x", "stop": ["a", "b", "c", "d", "e"]}, 400, "stop", "too_long"),
    "infinite temperature": (b'{"prompt": "x", "temperature": 1e999}', 400, None, None),
}
BAD_CHATS = {
    "no messages": ({"messages": []}, 400, "messages", "too_short"),
    "unknown role": ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages", "literal_error"),
    "content of the wrong type": ({"messages": [{"role": "user", "content": 3}]}, 400, "messages", None),
    "unknown model": ({"messages": [{"role": "user", "content": "hi"}], "model": "x"}, 404, "model", None),
}


def check_refusal(response: httpx.Response, status: int, param: str | None, code: str | None) -> None:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["message"] and error["type"] == "invalid_request_error"
    assert error["param"] == param
    if code is not None:
        assert error["code"] == code


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


def test_refusals_of_size_route_and_method_and_the_server_keeps_serving(url, client):
    check_refusal(post(url, "/v1/completions", {"prompt": "x" * (5 << 20)}), 413, None, "request_too_large")
    check_refusal(httpx.get(f"{url}/v1/nothing"), 404, None, None)
    check_refusal(httpx.get(f"{url}/v1/completions"), 405, None, None)
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


def test_health_answers_while_every_slot_generates():
    with serving(SlowBackend, parallel=1) as base:
        body = {"prompt": PROMPTS[4], "max_tokens": 100, "temperature": 0, "stream": True}
        with httpx.stream("POST", f"{base}/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            next(lines)
            health = httpx.get(f"{base}/health", timeout=5).json()
            assert health["slots_processing"] == 1
            assert [line for line in lines if line][-1] == "data: [DONE]"


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


def test_slot_pool_queues_requests_beyond_its_slots():
    """One slot, two jobs: the second waits until the first's iterator is closed."""
    pool = SlotPool([make_pipeline(target=SlowBackend)], Metrics(["draft"]))
    prompt = make_pipeline().encode(PROMPTS[7])
    job = Job(prompt, GREEDY, GenerationConfig(n_predict=100))

    async def scenario() -> None:
        first = pool.generate(job)
        await anext(first)
        assert pool.busy == 1
        second = pool.generate(job)
        waiting = asyncio.ensure_future(anext(second))
        await asyncio.sleep(0.2)
        assert not waiting.done() and pool.waiting == 1
        await first.aclose()
        await asyncio.wait_for(waiting, 30)
        assert pool.waiting == 0
        await second.aclose()

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


def test_api_key_is_required_when_set():
    with serving(api_key="s3cret") as base:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            refused = httpx.get(f"{base}/v1/models", headers=headers)
            assert refused.status_code == 401
            assert refused.json()["error"]["code"] == "invalid_api_key"
        refused = httpx.post(f"{base}/v1/completions", content=b"{not json")
        assert refused.status_code == 401  # the key is checked before the body
        assert httpx.get(f"{base}/metrics").status_code == 401
        assert httpx.get(f"{base}/health").status_code == 200
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()
        good = openai.OpenAI(base_url=f"{base}/v1", api_key="s3cret", max_retries=0)
        reply = good.completions.create(model=MODEL_ID, prompt=PROMPTS[10], max_tokens=6, temperature=0)
        assert reply.choices[0].text == alone(PROMPTS[10], 6).text


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
    finally:
        process.terminate()
        process.wait(30)


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
