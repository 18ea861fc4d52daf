"""llama-server's request features on the server: prompts of ids and text (several per
request), /apply-template, grammars and schemas on chat, continuing the assistant's message,
CORS with credentials and Anthropic's x-api-key. Answers are compared with `Pipeline.generate`
on a pipeline no server touches."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from conftest import TargetSpec, cached_tokenizer, draft_model, target_model
from fastapi.testclient import TestClient

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.chat import encode
from specdecode.server import ServerSettings, create_app

SPEC = TargetSpec(seed=5)
GREEDY = SamplingParams(temperature=0)
PROMPTS = ["def f(x):\n    return x", "import os\n", "class A:\n"]


def pipeline() -> Pipeline:
    tokenizer = cached_tokenizer()
    return Pipeline(
        HFBackend(target_model(SPEC), tokenizer),
        HFBackend(draft_model(SPEC, 0.1), tokenizer),
        spec_types=["draft"],
        draft_config=DraftModelConfig(n_max=4, p_min=0.0),
    )


def serve(**settings) -> TestClient:
    options = {"model_id": "tiny", "parallel": 2, "sampling": GREEDY, **settings}
    return TestClient(create_app(pipeline(), ServerSettings(**options)))


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    with serve() as test_client:
        yield test_client


def ids(text: str, add_special: bool = True) -> list[int]:
    return encode(cached_tokenizer(), text, add_special)


# --------------------------------------------------------------------------- prompts


def test_mixed_prompt_is_one_prompt_with_bos_only_before_leading_text(client, exactness_log):
    head, tail = "def f(x):\n", "    return x"
    mixed = [head, *ids(tail, add_special=False)]
    reply = client.post("/completion", json={"prompt": mixed, "n_predict": 8, "return_tokens": True})
    assert reply.status_code == 200, reply.text
    prompt_ids = ids(head) + ids(tail, add_special=False)
    result = pipeline().generate(prompt_ids, GREEDY, GenerationConfig(n_predict=8))
    exactness_log.record("server/mixed-prompt", "draft", result.stats, result.stats.stop_reason)
    assert reply.json()["tokens"] == result.tokens and reply.json()["tokens_evaluated"] == len(prompt_ids)
    ids_first = client.post("/completion", json={"prompt": [*ids("x", add_special=False), " = 1"]})
    assert ids_first.json()["tokens_evaluated"] == len(ids("x", False) + ids(" = 1", False))  # no BOS


def test_several_prompts_get_a_list_on_completion_and_choices_on_v1(client, exactness_log):
    prompts = [PROMPTS[0], ids(PROMPTS[1]), [PROMPTS[2]]]  # text, ids, a mixed list of one text
    native = client.post("/completion", json={"prompt": prompts, "n_predict": 6})
    assert native.status_code == 200, native.text
    expected = []
    for prompt in (PROMPTS[0], ids(PROMPTS[1]), PROMPTS[2]):
        result = pipeline().generate(prompt, GREEDY, GenerationConfig(n_predict=6))
        exactness_log.record("server/several-prompts", "draft", result.stats, result.stats.stop_reason)
        expected.append(result.text)
    assert [answer["content"] for answer in native.json()] == expected
    openai = client.post("/v1/completions", json={"prompt": prompts, "max_tokens": 6}).json()
    assert [choice["text"] for choice in openai["choices"]] == expected
    assert [choice["index"] for choice in openai["choices"]] == [0, 1, 2]
    answers = [client.post("/v1/completions", json={"prompt": p, "max_tokens": 6}).json() for p in prompts]
    assert openai["usage"]["prompt_tokens"] == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert openai["usage"]["completion_tokens"] == sum(a["usage"]["completion_tokens"] for a in answers)
    two_strings = client.post("/completion", json={"prompt": ["a", "b"], "n_predict": 2}).json()
    assert isinstance(two_strings, list) and len(two_strings) == 2  # texts alone are several prompts


@pytest.mark.parametrize(
    ("prompt", "stream", "message"),
    [
        ([PROMPTS[0], [10**6]], False, "token ids"),  # every prompt is checked before any runs
        (["a", [1, [2]]], False, None),  # lists nest one level only: refused by the schema
        ([[]], False, "empty"),
        ([], False, "empty"),
        (["a", "b"], True, "streamed"),
        (["a"] * 65, False, "at most 64 prompts"),
        ([1, True], False, None),  # strict: true is no id
    ],
)
def test_bad_prompts_are_refused_before_any_generation(client, prompt, stream, message):
    for path, limit in (("/completion", "n_predict"), ("/v1/completions", "max_tokens")):
        reply = client.post(path, json={"prompt": prompt, limit: 4, "stream": stream})
        assert reply.status_code == 400, (path, prompt, reply.text)
        assert message is None or message in reply.json()["error"]["message"]
    assert client.get("/health").json()["slots_processing"] == 0


# --------------------------------------------------------------------------- chat templates

CHAT = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}]


def test_apply_template_renders_as_the_chat_route_does(client, exactness_log):
    rendered = client.post("/apply-template", json={"messages": CHAT})
    assert rendered.json() == {"prompt": "system: Be terse.\nuser: Hi\nassistant:"}
    reply = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 6}).json()
    result = pipeline().generate(rendered.json()["prompt"], GREEDY, GenerationConfig(n_predict=6))
    exactness_log.record("server/apply-template", "draft", result.stats, result.stats.stop_reason)
    assert reply["choices"][0]["message"]["content"] == result.text
    closed = client.post("/apply-template", json={"messages": CHAT, "add_generation_prompt": False})
    assert closed.json()["prompt"] == "system: Be terse.\nuser: Hi\n"


def test_the_assistants_last_message_is_continued(client, exactness_log):
    prefilled = [*CHAT, {"role": "assistant", "content": "Hello, I"}]
    expected_prompt = "system: Be terse.\nuser: Hi\nassistant: Hello, I"
    for extra in ({}, {"continue_final_message": True, "add_generation_prompt": False}):
        rendered = client.post("/apply-template", json={"messages": prefilled, **extra}).json()
        assert rendered["prompt"] == expected_prompt, extra
    body = {
        "messages": prefilled,
        "max_tokens": 6,
        "continue_final_message": True,
        "add_generation_prompt": False,
    }
    reply = client.post("/v1/chat/completions", json=body).json()
    result = pipeline().generate(expected_prompt, GREEDY, GenerationConfig(n_predict=6))
    exactness_log.record("server/continue-final-message", "draft", result.stats, result.stats.stop_reason)
    assert reply["choices"][0]["message"]["content"] == result.text


@pytest.mark.parametrize(
    ("messages", "extra", "message"),
    [
        ([*CHAT, {"role": "assistant", "content": "Hel"}], {"continue_final_message": True}, "both"),
        (CHAT, {"continue_final_message": True, "add_generation_prompt": False}, "assistant's"),
        (
            [*CHAT, {"role": "assistant", "content": "a"}, {"role": "assistant", "content": "b"}],
            {},
            "two or more assistant messages",
        ),
    ],
)
def test_continuing_refuses_what_llama_server_refuses(client, messages, extra, message):
    for path in ("/v1/chat/completions", "/apply-template"):
        reply = client.post(path, json={"messages": messages, "max_tokens": 4, **extra})
        assert reply.status_code == 400 and message in reply.json()["error"]["message"], reply.text


# --------------------------------------------------------------------------- grammars on chat


def chat_answer(client: TestClient, **fields) -> str:
    reply = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 40, **fields})
    assert reply.status_code == 200, reply.text
    return reply.json()["choices"][0]["message"]["content"]


def test_chat_takes_grammar_json_schema_and_an_inline_response_format_schema(client):
    assert chat_answer(client, grammar='root ::= "yes" | "no"') in ("yes", "no")
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "maximum": 9, "minimum": 0}},
        "required": ["n"],
    }
    for fields in (
        {"json_schema": schema},
        {"response_format": {"type": "json_object", "schema": schema}},
        {"response_format": {"type": "json_schema", "schema": schema}},
        {"response_format": {"type": "json_schema", "json_schema": {"schema": schema}}},  # no name
        {"json_schema": {"const": 1}, "response_format": {"type": "json_object", "schema": schema}},
    ):
        assert isinstance(json.loads(chat_answer(client, **fields))["n"], int), fields
    assert isinstance(json.loads(chat_answer(client, json_schema={})), dict)  # empty: any object
    text = client.post("/v1/completions", json={"prompt": "x", "max_tokens": 8, "grammar": 'root ::= "ab"'})
    assert text.json()["choices"][0]["text"] == "ab"


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"grammar": 'root ::= "a"', "json_schema": {}}, None),
        ({"grammar": 'root ::= "a"', "response_format": {"type": "json_object"}}, None),
        ({"response_format": {"type": "text", "schema": {}}}, None),
        ({"response_format": {"type": "json_schema"}}, None),
        ({"grammar": "root ::= nowhere"}, "grammar"),
        ({"json_schema": {"type": "object", "not": {}}}, "json_schema"),
    ],
)
def test_bad_chat_constraints_are_refused(client, fields, param):
    reply = client.post("/v1/chat/completions", json={"messages": CHAT, "max_tokens": 4, **fields})
    assert reply.status_code == 400, reply.text
    assert param is None or reply.json()["error"]["param"] == param


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("grammar", "%llguidance {}\nstart: " + " | ".join(f'"a{i}" "b"' for i in range(5000))),
        ("json_schema", {"anyOf": [{"type": "object", "required": [f"k{i}"]} for i in range(5000)]}),
    ],
)
def test_grammars_past_the_engines_row_limit_are_refused_before_a_slot(client, field, value):
    """Lark rules and schema anyOfs the GBNF check does not see fail at the first token; they
    are found when the grammar is compiled, a 400 rather than a failure mid-answer."""
    reply = client.post("/completion", json={"prompt": "x", "n_predict": 4, field: value})
    assert reply.status_code == 400 and "limits are exceeded" in reply.json()["error"]["message"]
    assert reply.json()["error"]["param"] == field


# --------------------------------------------------------------------------- CORS and keys


def test_cors_reflects_the_origin_with_credentials_and_x_api_key_is_a_key():
    origin = "https://app.example"
    with serve(api_key="k", cors_origins=("*",)) as test_client:
        preflight = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "x-api-key, content-type",
        }
        answered = test_client.options("/v1/completions", headers=preflight)
        assert answered.status_code == 200
        assert answered.headers["access-control-allow-origin"] == origin  # never "*" with credentials
        assert answered.headers["access-control-allow-credentials"] == "true"
        assert "x-api-key" in answered.headers["access-control-allow-headers"].lower()
        for key in ({"x-api-key": "k"}, {"Authorization": "Bearer k"}):
            reply = test_client.get("/v1/models", headers={"Origin": origin, **key})
            assert reply.status_code == 200, key
            assert reply.headers["access-control-allow-origin"] == origin
            assert reply.headers["access-control-allow-credentials"] == "true"
        for wrong in ({"x-api-key": "K"}, {"x-api-key": ""}, {"Authorization": "Bearer x", "x-api-key": "k"}):
            assert test_client.get("/v1/models", headers=wrong).status_code == 401, wrong
