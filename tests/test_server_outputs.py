"""What a server answer may carry besides its text: token probabilities (llama-server's `n_probs`,
OpenAI's `logprobs`), `logit_bias`, `n` choices, per-token timings, prompt progress and
`response_fields`; with speculation on.

Probabilities are checked against the target's own logits (a forward pass over the prompt and
the answer), and every answer against plain generation of the library: none of these options
may change a token, except logit_bias, whose answer must be plain generation's with the bias.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterator

import openai
import pytest
import torch
from conftest import TargetSpec, cached_tokenizer, draft_model, target_model
from fastapi.testclient import TestClient

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.backends.native import NativeBackend
from specdecode.chat import encode
from specdecode.sampling import distribution
from specdecode.server.app import ServerSettings, create_app
from specdecode.server.options import choice_jobs
from specdecode.server.slots import Job
from specdecode.stats import GenerationStats

SPEC = TargetSpec(seed=5)
PROMPT = "def f(x):\n    return"
SEEDED = {"temperature": 1.0, "seed": 11}
GREEDY = SamplingParams(temperature=0)


def pipeline(speculative: bool = True) -> Pipeline:
    tokenizer = cached_tokenizer()
    if not speculative:
        return Pipeline(HFBackend(target_model(SPEC), tokenizer))
    return Pipeline(
        HFBackend(target_model(SPEC), tokenizer),
        HFBackend(draft_model(SPEC, 0.1), tokenizer),
        spec_types=["draft"],
        draft_config=DraftModelConfig(n_max=4, p_min=0.0),
    )


@pytest.fixture(scope="module")
def plain() -> Pipeline:
    return pipeline(speculative=False)


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    settings = ServerSettings(
        model_id="tiny", max_tokens=256, parallel=2, sampling=SamplingParams(temperature=0)
    )
    with TestClient(create_app(pipeline(), settings)) as test_client:
        yield test_client


def expected(
    plain: Pipeline, n: int, sampling: SamplingParams = GREEDY, ignore_eos: bool = False
) -> list[int]:
    """Plain generation's tokens for PROMPT."""
    return plain.generate(PROMPT, sampling, GenerationConfig(n_predict=n, ignore_eos=ignore_eos)).tokens


def target_log_probs(tokens: list[int], prompt: str = PROMPT) -> torch.Tensor:
    """The target's log-probabilities at each answer token's position, [len(tokens), V]."""
    ids = encode(cached_tokenizer(), prompt)
    with torch.no_grad():
        logits = target_model(SPEC)(torch.tensor([ids + tokens])).logits[0]
    return torch.log_softmax(logits[len(ids) - 1 : len(ids) - 1 + len(tokens)].double(), dim=-1)


def events(client: TestClient, path: str, body: dict) -> list[dict]:
    """The JSON events of a stream ([DONE] left out)."""
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        lines = [line.removeprefix("data: ") for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


# --------------------------------------------------------------------------- n_probs


def test_n_probs_are_the_targets_and_change_no_token(client, plain, exactness_log):
    body = {"prompt": PROMPT, "n_predict": 12, "n_probs": 5, "return_tokens": True, "ignore_eos": True}
    answer = client.post("/completion", json=body).json()
    tokens = answer["tokens"]
    assert tokens == expected(plain, 12, ignore_eos=True)
    assert answer["timings"]["draft_n_accepted"] > 0  # speculation ran and was kept
    assert answer["generation_settings"]["n_probs"] == 5
    reference = target_log_probs(tokens)
    entries = answer["completion_probabilities"]
    assert [entry["id"] for entry in entries] == tokens
    for entry, row in zip(entries, reference, strict=True):
        assert entry["logprob"] == pytest.approx(float(row[entry["id"]]), abs=1e-9)
        top_values, top_ids = torch.topk(row, 5)
        assert [alt["id"] for alt in entry["top_logprobs"]] == top_ids.tolist()
        assert [alt["logprob"] for alt in entry["top_logprobs"]] == pytest.approx(
            top_values.tolist(), abs=1e-9
        )
        assert entry["top_logprobs"][0]["id"] == entry["id"]  # greedy: the best token
        assert entry["bytes"] == list(entry["token"].encode())
    streamed = events(client, "/completion", body)
    assert [e for event in streamed[:-1] for e in event["completion_probabilities"]] == entries
    assert "completion_probabilities" not in streamed[-1] and streamed[-1]["stop"]
    exactness_log.record("server/n-probs", "draft", _stats(answer), "n_predict")


def test_post_sampling_probs_are_what_the_sampler_drew_from(client, plain):
    body = {
        "prompt": PROMPT,
        "n_predict": 8,
        "n_probs": 100,
        "post_sampling_probs": True,
        "return_tokens": True,
    }
    answer = client.post("/completion", json={**body, **SEEDED, "ignore_eos": True}).json()
    sampling = SamplingParams(**SEEDED)
    tokens = answer["tokens"]
    assert tokens == expected(plain, 8, sampling, ignore_eos=True)
    ids = encode(cached_tokenizer(), PROMPT)
    with torch.no_grad():
        logits = target_model(SPEC)(torch.tensor([ids + tokens])).logits[0, len(ids) - 1 :]
    for position, entry in enumerate(answer["completion_probabilities"]):
        probs = distribution(logits[position].double(), sampling, ids + tokens[:position])
        assert entry["prob"] == pytest.approx(float(probs[entry["id"]]), abs=1e-9)
        listed = {alt["id"]: alt["prob"] for alt in entry["top_probs"]}
        assert set(listed) == set(torch.nonzero(probs).flatten().tolist())  # every candidate, no others
        assert sum(listed.values()) == pytest.approx(1.0)
        assert "logprob" not in entry


# --------------------------------------------------------------------------- OpenAI logprobs


def test_chat_logprobs_through_openais_client(client, plain):
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client)
    messages = [{"role": "user", "content": "def f(x):"}]
    reply = api.chat.completions.create(
        model="tiny", messages=messages, max_tokens=10, temperature=0, logprobs=True, top_logprobs=3
    )
    content = reply.choices[0].logprobs.content
    assert "".join(token.token for token in content) == reply.choices[0].message.content
    for token in content:
        assert token.logprob <= 0.0 and len(token.top_logprobs) == 3
        assert token.top_logprobs[0].logprob == token.logprob  # greedy
    stream = api.chat.completions.create(
        model="tiny",
        messages=messages,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        stream=True,
    )
    streamed = [
        token
        for chunk in stream
        if chunk.choices and chunk.choices[0].logprobs
        for token in chunk.choices[0].logprobs.content
    ]
    assert [token.model_dump() for token in streamed] == [token.model_dump() for token in content]
    plain_reply = api.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0)
    assert plain_reply.choices[0].logprobs is None
    assert plain_reply.choices[0].message.content == reply.choices[0].message.content


def test_completions_logprobs_in_the_legacy_shape(client, plain):
    body = {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "logprobs": 2}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    logprobs = choice["logprobs"]
    assert "".join(logprobs["tokens"]) == choice["text"]
    starts = [0]
    for token in logprobs["tokens"][:-1]:
        starts.append(starts[-1] + len(token))
    assert logprobs["text_offset"] == starts
    for value, top in zip(logprobs["token_logprobs"], logprobs["top_logprobs"], strict=True):
        assert len(top) <= 2 and max(top.values()) == value  # greedy: the best token's
    streamed = events(client, "/v1/completions", body)
    merged = {key: [] for key in logprobs}
    for event in streamed:
        for streamed_choice in event["choices"]:
            for key, values in (streamed_choice["logprobs"] or {}).items():
                merged[key] += values
    assert merged == logprobs


def test_a_stop_string_cuts_the_logprobs_with_the_text(client):
    full = client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0}
    )
    tokens = full.json()["choices"][0]["logprobs"]["tokens"]
    stop = tokens[3]
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "logprobs": 0, "stop": [stop]}
    choice = client.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert "".join(choice["logprobs"]["tokens"]) == choice["text"]


def test_a_stop_string_inside_a_token_lists_neither_that_token_nor_later_ones(client):
    """As llama-server leaves the stop string's tokens out: the token the stop begins in is not
    listed, whole or streamed, and a stream sends no entry for text it never sends."""
    body = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logprobs": 0}
    full = client.post("/v1/completions", json=body).json()["choices"][0]
    tokens, offsets, text = full["logprobs"]["tokens"], full["logprobs"]["text_offset"], full["text"]
    # a token whose text past its first character first occurs there: the stop cuts inside it
    index = next(
        i for i in range(1, len(tokens)) if len(tokens[i]) > 1 and text.find(tokens[i][1:]) == offsets[i] + 1
    )
    stopped = {**body, "stop": [tokens[index][1:]]}
    choice = client.post("/v1/completions", json=stopped).json()["choices"][0]
    assert choice["text"] == text[: offsets[index] + 1] and choice["finish_reason"] == "stop"
    assert choice["logprobs"]["tokens"] == tokens[:index]
    streamed = [c for event in events(client, "/v1/completions", stopped) for c in event["choices"]]
    assert "".join(c["text"] for c in streamed) == choice["text"]
    assert [t for c in streamed if c["logprobs"] for t in c["logprobs"]["tokens"]] == tokens[:index]
    native = {"prompt": PROMPT, "n_predict": 16, "n_probs": 1, "stop": stopped["stop"]}
    answer = client.post("/completion", json=native).json()
    assert [entry["token"] for entry in answer["completion_probabilities"]] == tokens[:index]


# --------------------------------------------------------------------------- logit_bias


def test_a_logit_bias_gives_plain_generations_answer_with_it(plain, exactness_log):
    """The library: speculative generation with a bias equals plain generation with it,
    greedy and seeded, and a token biased to -inf never appears."""
    speculative = pipeline()
    unbiased = expected(plain, 24)
    banned = {unbiased[0], unbiased[5]}
    for settings in ({"temperature": 0}, SEEDED, {"temperature": 0.7, "seed": 3}):
        bias = ((unbiased[0], -math.inf), (unbiased[5], -math.inf), (unbiased[2], 3.5))
        sampling = SamplingParams(**settings, logit_bias=bias)
        config = GenerationConfig(n_predict=24, ignore_eos=True)
        result = speculative.generate(PROMPT, sampling, config)
        assert result.tokens == plain.generate(PROMPT, sampling, config).tokens
        assert not banned & set(result.tokens)
        exactness_log.record("server/logit-bias", "draft", result.stats, result.stats.stop_reason)
    assert expected(plain, 24, SamplingParams(temperature=0, logit_bias=bias)) != unbiased


@pytest.mark.parametrize("form", ["openai", "pairs", "text", "false"])
def test_logit_bias_in_every_form_on_every_endpoint(client, plain, form, exactness_log):
    unbiased = expected(plain, 16)
    token = unbiased[1]
    piece = cached_tokenizer().decode([token])
    spec = {
        "openai": {str(token): -100},
        "pairs": [[token, -100]],
        "text": [[piece, -100]],
        "false": [[token, False]],
    }[form]
    ids = encode(cached_tokenizer(), piece, add_special=False)
    bias = tuple((i, -math.inf if form == "false" else -100.0) for i in (ids if form == "text" else [token]))
    reference = expected(plain, 16, SamplingParams(temperature=0, logit_bias=bias))
    assert reference != unbiased
    native = {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "logit_bias": spec, "return_tokens": True}
    answer = client.post("/completion", json=native).json()
    assert answer["tokens"] == reference
    exactness_log.record("server/logit-bias", "draft", _stats(answer), answer["stop_type"])
    completion = client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "logit_bias": spec}
    )
    assert completion.json()["choices"][0]["text"] == plain.target.detokenize(reference)


@pytest.mark.parametrize(
    "bias",
    [{"100000": 1}, [[-1, 1]], {"5": "1"}, [[5]], [[5, True]], {"5": float("nan")}, [[[5], 1]]],
)
def test_bad_logit_biases_are_refused(client, bias):
    response = client.post(
        "/completion", content=json.dumps({"prompt": PROMPT, "n_predict": 4, "logit_bias": bias})
    )
    assert response.status_code == 400, response.text
    assert response.json()["error"]["message"]


# --------------------------------------------------------------------------- n choices


def test_n_choices_each_their_own_generation(client, plain, exactness_log):
    greedy = client.post(
        "/v1/completions", json={"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "n": 3}
    ).json()
    assert [choice["index"] for choice in greedy["choices"]] == [0, 1, 2]
    assert len({choice["text"] for choice in greedy["choices"]}) == 1
    assert greedy["usage"]["completion_tokens"] == 3 * 8
    assert greedy["usage"]["total_tokens"] == greedy["usage"]["prompt_tokens"] + 3 * 8
    body = {"prompt": PROMPT, "max_tokens": 8, "n": 3, **SEEDED}
    seeded = client.post("/v1/completions", json=body).json()
    job = Job([1], SamplingParams(**SEEDED), GenerationConfig(n_predict=8))
    for choice, choice_job in zip(seeded["choices"], choice_jobs(job, 3), strict=True):
        tokens = expected(plain, 8, choice_job.sampling)
        assert choice["text"] == plain.target.detokenize(tokens)
    assert len({choice["text"] for choice in seeded["choices"]}) > 1
    alone = client.post("/v1/completions", json={**body, "n": 1}).json()
    assert alone["choices"][0]["text"] == seeded["choices"][0]["text"]  # n = 1 is choice 0
    exactness_log.record("server/n-choices", "draft", _stats(seeded), "")


def test_n_choices_stream_interleaved_by_index(client):
    messages = [{"role": "user", "content": "def f(x):"}]
    body = {
        "messages": messages,
        "max_tokens": 10,
        "n": 2,
        "stream_options": {"include_usage": True},
        **SEEDED,
    }
    whole = client.post("/v1/chat/completions", json={**body, "stream_options": None}).json()
    streamed = events(client, "/v1/chat/completions", body)
    texts, finishes = ["", ""], [None, None]
    for event in streamed[:-1]:
        for choice in event["choices"]:
            texts[choice["index"]] += choice["delta"].get("content", "")
            finishes[choice["index"]] = finishes[choice["index"]] or choice["finish_reason"]
    assert texts == [choice["message"]["content"] for choice in whole["choices"]]
    assert finishes == [choice["finish_reason"] for choice in whole["choices"]]
    assert streamed[-1]["choices"] == [] and streamed[-1]["usage"] == whole["usage"]


def test_too_many_choices_are_refused(client):
    response = client.post("/v1/completions", json={"prompt": PROMPT, "max_tokens": 4, "n": 17})
    assert response.status_code == 400 and response.json()["error"]["param"] == "n"


# --------------------------------------------------------------------------- timings, progress, fields


def test_timings_per_token_on_every_streamed_chunk(client):
    body = {"prompt": PROMPT, "n_predict": 10, "timings_per_token": True}
    streamed = events(client, "/completion", body)
    counted = 0
    for event in streamed[:-1]:
        counted += len(event["tokens"])
        assert event["timings"]["predicted_n"] >= counted and event["timings"]["prompt_n"] > 0
    chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 6, "timings_per_token": True}
    content_chunks = [
        e
        for e in events(client, "/v1/chat/completions", chat)
        if e["choices"] and e["choices"][0]["delta"].get("content")
    ]
    assert content_chunks and all("predicted_per_second" in e["timings"] for e in content_chunks)
    assert all(
        "timings" not in event
        for event in events(client, "/completion", {**body, "timings_per_token": False})[:-1]
    )


def test_return_progress_reports_the_prompt_before_the_first_token():
    # the native forward reuses every cached position (transformers' only whole n_batch chunks)
    tokenizer = cached_tokenizer()
    speculative = Pipeline(
        NativeBackend(target_model(SPEC), tokenizer),
        HFBackend(draft_model(SPEC, 0.1), tokenizer),
        spec_types=["draft"],
        draft_config=DraftModelConfig(n_max=4, p_min=0.0),
    )
    settings = ServerSettings(model_id="tiny", max_tokens=64, parallel=1)
    prompt = PROMPT + " x * 2\n" * 6
    n_prompt = len(encode(tokenizer, prompt))
    body = {"prompt": prompt, "n_predict": 4, "return_progress": True}
    with TestClient(create_app(speculative, settings)) as client:
        streamed = events(client, "/completion", body)
        again = events(
            client, "/v1/completions", {"prompt": prompt, "max_tokens": 4, "return_progress": True}
        )
        without = events(client, "/completion", {**body, "return_progress": False})
    progress = [event["prompt_progress"] for event in streamed if "prompt_progress" in event]
    first_token = next(i for i, event in enumerate(streamed) if event["tokens"])
    assert all("prompt_progress" in event for event in streamed[:first_token])
    assert progress[0] == {**progress[0], "total": n_prompt, "cache": 0, "processed": 0}
    assert progress[-1]["processed"] == n_prompt
    assert [p["processed"] for p in progress] == sorted({p["processed"] for p in progress})
    progress = [event["prompt_progress"] for event in again if "prompt_progress" in event]
    assert progress[0]["cache"] == progress[0]["processed"] == n_prompt - 1  # the slot held the prompt
    assert progress[-1]["processed"] == n_prompt
    assert all(event["choices"] == [] for event in again if "prompt_progress" in event)
    assert not any("prompt_progress" in event for event in without)


def test_response_fields_keep_only_the_listed_paths(client):
    body = {
        "prompt": PROMPT,
        "n_predict": 5,
        "response_fields": ["content", "generation_settings/n_predict", "nope/x"],
    }
    answer = client.post("/completion", json=body).json()
    assert set(answer) == {"content", "generation_settings/n_predict"}
    assert answer["generation_settings/n_predict"] == 5 and isinstance(answer["content"], str)


def test_no_response_fields_listed_is_every_field(client):
    """As llama-server: `response_fields: []` filters nothing."""
    body = {"prompt": PROMPT, "n_predict": 4}
    whole = client.post("/completion", json=body).json()
    assert client.post("/completion", json={**body, "response_fields": []}).json().keys() == whole.keys()


def test_completion_answers_carry_the_prompt(client):
    """As llama-server: `prompt` is the prompt's tokens decoded with the special ones shown, in
    the whole answer and in a stream's last event."""
    body = {"prompt": PROMPT, "n_predict": 4}
    whole = client.post("/completion", json=body).json()
    tokenizer = cached_tokenizer()
    shown = tokenizer.decode(encode(tokenizer, PROMPT), skip_special_tokens=False)
    assert shown.startswith(tokenizer.bos_token) and whole["prompt"] == shown
    assert events(client, "/completion", body)[-1]["prompt"] == shown


def test_a_completion_stream_sends_each_token_of_a_speculative_step_on_its_own(client, plain):
    """llama-server's /completion stream has one event per token, with its probabilities."""
    body = {"prompt": PROMPT, "n_predict": 24, "n_probs": 2, "ignore_eos": True, "return_tokens": True}
    whole = client.post("/completion", json=body).json()
    *chunks, last = events(client, "/completion", body)
    assert last["timings"]["draft_n_accepted"] > 0  # some steps gave several tokens
    assert [len(chunk["tokens"]) for chunk in chunks] == [1] * 24
    assert [c["tokens"][0] for c in chunks] == whole["tokens"] == expected(plain, 24, ignore_eos=True)
    assert "".join(chunk["content"] for chunk in chunks) == whole["content"]
    probabilities = [entry for chunk in chunks for entry in chunk["completion_probabilities"]]
    assert probabilities == whole["completion_probabilities"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}], "logprobs": 2}),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": "x"}], "logprobs": True, "top_logprobs": 21},
        ),
        ("/v1/completions", {"prompt": "x", "logprobs": 6}),
        ("/v1/completions", {"prompt": "x", "logprobs": True}),
        ("/v1/completions", {"prompt": "x", "logprobs": 1, "top_logprobs": 1}),
        ("/completion", {"prompt": "x", "n_probs": 101}),
        ("/completion", {"prompt": "x", "response_fields": "content"}),
    ],
)
def test_bad_probability_requests_are_refused(client, path, body):
    response = client.post(path, json={**body, "max_tokens" if path != "/completion" else "n_predict": 4})
    assert response.status_code == 400, response.text


def _stats(answer: dict) -> GenerationStats:
    """An answer's draft counts (its timings'), in the shape the exactness log reads."""
    stats = GenerationStats()
    stats.totals.n_drafted = answer["timings"]["draft_n"]
    stats.totals.n_accepted = answer["timings"]["draft_n_accepted"]
    return stats
