"""Structured output through the server, with speculation on: OpenAI's `response_format`
(`json_object`, `json_schema`) and llama-server's `grammar` and `json_schema` fields.

The main check sends 1,000+ requests with random JSON schemas (bounded, so that every answer
can finish within its token limit) to every generating endpoint, greedy and seeded, and
requires every answer to parse and validate against its schema (jsonschema); some are
compared with constrained plain generation of the library. Bad schemas and grammars are 400s.
"""

from __future__ import annotations

import json
import math
import random
from collections import Counter
from collections.abc import Iterator

import jsonschema
import pytest
from conftest import TargetSpec, cached_tokenizer, draft_model, target_model
from fastapi.testclient import TestClient

from specdecode import (
    ConstraintSpec,
    DraftModelConfig,
    GenerationConfig,
    HFBackend,
    Pipeline,
    SamplingParams,
    grammars,
)
from specdecode.constraints import Constraint
from specdecode.server.app import ServerSettings, create_app

SPEC = TargetSpec()
N_RANDOM = 1040
MAX_TOKENS = 200  # more than any random schema's longest answer


def pipeline(spec_types: list[str]) -> Pipeline:
    tokenizer = cached_tokenizer()
    return Pipeline(
        HFBackend(target_model(SPEC), tokenizer),
        HFBackend(draft_model(SPEC, 0.1), tokenizer),
        spec_types=spec_types,
        draft_config=DraftModelConfig(n_max=4, p_min=0.5),
    )


@pytest.fixture(scope="module")
def client() -> Iterator[TestClient]:
    app = create_app(
        pipeline(["ngram-simple", "draft"]),
        ServerSettings(model_id="target", max_tokens=512, parallel=2, sampling=SamplingParams(temperature=0)),
    )
    with TestClient(app) as test_client:
        yield test_client


def random_value_schema(rng: random.Random, depth: int) -> dict:
    """A schema whose every instance is short: bounded strings, integers, arrays and objects."""
    choices = ["integer", "boolean", "enum", "string", "null"]
    if depth < 2:
        choices += ["array", "object", "anyOf"]
    kind = rng.choice(choices)
    if kind == "integer":
        low = rng.randint(-50, 50)
        return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
    if kind == "boolean":
        return {"type": "boolean"}
    if kind == "enum":
        return {
            "enum": rng.sample(
                ["red", "green", "blue", "x", 1, 2, True, None, "snake_case"], rng.randint(1, 4)
            )
        }
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(0, 6)}
    if kind == "null":
        return {"type": "null"}
    if kind == "array":
        return {"type": "array", "items": random_value_schema(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    if kind == "anyOf":
        return {"anyOf": [random_value_schema(rng, depth + 1) for _ in range(2)]}
    return random_object_schema(rng, depth + 1)


def random_object_schema(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(
        ["id", "name", "city", "count", "tags", "ok", "args", "query", "unit", "when"], rng.randint(1, 4)
    )
    return {
        "type": "object",
        "properties": {name: random_value_schema(rng, depth) for name in names},
        "required": names,
        "additionalProperties": False,
    }


def request(rng: random.Random, schema: dict, index: int) -> tuple[str, dict, str]:
    """(path, body, where the answer's text is) for one of the endpoints, spread evenly."""
    sampling = (
        {"temperature": 0} if index % 2 == 0 else {"temperature": 0.9, "seed": rng.randint(0, 2**32 - 1)}
    )
    endpoint = index % 4
    if endpoint == 0:
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
        body = {"messages": [{"role": "user", "content": "Answer in JSON."}], "response_format": fmt}
        return "/v1/chat/completions", {**body, "max_tokens": MAX_TOKENS, **sampling}, "chat"
    if endpoint == 1:
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        body = {"prompt": f"JSON for request {index}: ", "response_format": fmt}
        return "/v1/completions", {**body, "max_tokens": MAX_TOKENS, **sampling}, "text"
    body = {"prompt": f"def handler_{index}(event):", "json_schema": schema, "n_predict": MAX_TOKENS}
    return "/completion", {**body, **sampling}, "content"


def answer_text(reply: dict, where: str) -> tuple[str, str]:
    """The answer's text and why it ended."""
    if where == "content":
        return reply["content"], reply["stop_type"]
    choice = reply["choices"][0]
    return (choice["message"]["content"] if where == "chat" else choice["text"]), choice["finish_reason"]


@pytest.mark.slow
def test_random_json_schemas_always_validate(client) -> None:
    rng = random.Random(20261123)
    violations: list[tuple[dict, str, str]] = []
    endings: Counter[str] = Counter()
    drafted = accepted = 0
    for index in range(N_RANDOM):
        schema = random_object_schema(rng)
        path, body, where = request(rng, schema, index)
        response = client.post(path, json=body)
        assert response.status_code == 200, response.text
        reply = response.json()
        text, ending = answer_text(reply, where)
        endings[ending] += 1
        drafted += reply["timings"]["draft_n"]
        accepted += reply["timings"]["draft_n_accepted"]
        try:
            jsonschema.validate(json.loads(text), schema)
        except (ValueError, jsonschema.ValidationError) as exc:
            violations.append((schema, text, str(exc)))
    assert not violations, violations[:3]
    assert set(endings) <= {"stop", "eos"}, endings
    assert accepted > 0.3 * N_RANDOM and drafted >= accepted


def test_server_answers_as_constrained_plain_generation(client) -> None:
    """Greedy and seeded: the served answer is the library's constrained plain generation."""
    rng = random.Random(7)
    plain = pipeline([])
    for index in range(8):
        schema = random_object_schema(rng)
        path, body, where = request(rng, schema, index)
        text, _ = answer_text(client.post(path, json=body).json(), where)
        if path == "/completion" or path == "/v1/completions":
            prompt = body["prompt"]
        else:
            prompt = "user: Answer in JSON.\nassistant:"
        sampling = SamplingParams(temperature=body["temperature"], seed=body.get("seed"))
        expected = plain.generate(
            prompt,
            sampling,
            GenerationConfig(n_predict=MAX_TOKENS),
            ConstraintSpec("json_schema", json.dumps(schema)),
        )
        assert text == expected.text


def test_json_object_and_grammar(client) -> None:
    reply = client.post(
        "/v1/completions",
        json={"prompt": "x", "max_tokens": 300, "temperature": 0, "response_format": {"type": "json_object"}},
    ).json()
    text, ending = answer_text(reply, "text")
    assert text.startswith("{")
    if ending == "stop":
        assert isinstance(json.loads(text), dict)
    grammar = 'root ::= "answer: " ("yes" | "no") "."'
    reply = client.post("/completion", json={"prompt": "x", "grammar": grammar, "temperature": 0}).json()
    assert reply["content"] in ("answer: yes.", "answer: no.") and reply["stop_type"] == "eos"
    body = {"prompt": "x", "grammar": grammar, "temperature": 0, "stop": ["."]}
    reply = client.post("/completion", json=body).json()
    assert reply["content"] in ("answer: yes", "answer: no")
    assert reply["stop_type"] == "word" and reply["stopping_word"] == "."


@pytest.mark.parametrize(
    ("path", "extra", "param"),
    [
        ("/v1/completions", {"response_format": {"type": "json_schema"}}, None),
        ("/v1/completions", {"response_format": {"type": "xml"}}, None),
        (
            "/v1/completions",
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "a", "schema": {"type": "nonsense"}},
                }
            },
            "response_format",
        ),
        ("/completion", {"grammar": "root ::= missing"}, "grammar"),
        ("/completion", {"grammar": "root ::= " + " | ".join(f'"w{i}"' for i in range(2001))}, "grammar"),
        ("/completion", {"grammar": 'root ::= root "a"'}, "grammar"),
        ("/completion", {"grammar": 'root ::= "a"', "json_schema": {}}, None),
        (
            "/completion",
            {"json_schema": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}},
            "json_schema",
        ),
    ],
)
def test_bad_constraints_are_400(client, path, extra, param) -> None:
    body = {"prompt": "x", "temperature": 0, **extra}
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    if param is not None:
        assert error["param"] == param
    assert client.get("/health").json()["status"] == "ok"


def test_streamed_answers_validate(client) -> None:
    """A streamed chat answer and a streamed /completion answer under a schema: their pieces
    join into JSON of the schema, the same text as the whole answer."""
    rng = random.Random(3)
    for index in (0, 2):
        schema = random_object_schema(rng)
        path, body, where = request(rng, schema, index)
        whole, _ = answer_text(client.post(path, json=body).json(), where)
        events = client.post(path, json={**body, "stream": True}).text.split("\n\n")
        pieces = [json.loads(event.removeprefix("data: ")) for event in events if event.startswith("data: {")]
        if where == "chat":
            text = "".join(
                piece["choices"][0]["delta"].get("content") or "" for piece in pieces if piece["choices"]
            )
        else:
            text = "".join(piece["content"] for piece in pieces if not piece["stop"])
        assert text == whole
        jsonschema.validate(json.loads(text), schema)


# --------------------------------------------------------------------------- costly constraints


def chain(n: int) -> str:
    """n + 2 GBNF rules, each naming the next (153 KB at 5,000): the grammar engine's recursion
    over a few thousand overflows its stack."""
    return "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(n)) + f'r{n} ::= "b"\n'


def test_a_grammar_of_5000_chained_rules_is_a_400_and_the_server_lives(client) -> None:
    response = client.post("/completion", json={"prompt": "x", "n_predict": 4, "grammar": chain(5000)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "grammar" and "5002 rules (at most 500)" in error["message"]
    assert client.get("/health").status_code == 200


def test_a_grammar_that_crashes_the_engine_takes_down_only_the_checking_process(client, monkeypatch) -> None:
    """Checked on a 256 KiB stack, 450 chained rules (within the limits) crash the grammar
    engine: the child process that checks it dies, the server refuses the grammar and goes on,
    and the next grammar is checked by a new child."""
    monkeypatch.setattr(grammars, "CHECK_STACK", 256 * 1024)
    for checker in grammars._CHECKER:
        checker.stop()
    try:
        response = client.post("/completion", json={"prompt": "x", "n_predict": 4, "grammar": chain(450)})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"] == "invalid grammar: the grammar engine crashed on it"
        assert client.get("/health").status_code == 200
        body = {"prompt": "x", "n_predict": 8, "temperature": 0, "grammar": 'root ::= "ok" [0-9]'}
        reply = client.post("/completion", json=body)
        assert reply.status_code == 200 and reply.json()["content"][:2] == "ok"
    finally:
        for checker in grammars._CHECKER:
            checker.stop()


# --------------------------------------------------------------------------- logit_bias


@pytest.mark.parametrize(
    "bias",
    [
        {"\ud800": 1},
        [["a\udc00", -1]],
        {"9" * 30: 1},
        [[5, 10**400]],
        [["", 10**400]],  # a text of no tokens: its bias is still checked
        {str(token): False for token in range(SPEC.vocab_size)},
        [[token, False] for token in range(SPEC.vocab_size)],
    ],
)
@pytest.mark.parametrize("extra", [{}, {"grammar": 'root ::= "a" [0-9]*'}])
def test_bad_logit_biases_are_400s(client, bias, extra) -> None:
    """A lone surrogate in a text, an id or a bias past any range, and a bias that keeps every
    token out (alone or with a grammar): 400s that name logit_bias."""
    body = {"prompt": "x", "n_predict": 4, "logit_bias": bias, **extra}
    response = client.post("/completion", content=json.dumps(body))
    assert response.status_code == 400, response.text
    assert "logit_bias" in json.dumps(response.json()["error"])


@pytest.mark.parametrize("key", ["--5", "²", "-", "0x5", " 5"])
def test_logit_bias_keys_that_are_not_ids_are_texts(client, key) -> None:
    """As llama-server reads them: a key of anything but ASCII digits is a text, each of its
    tokens biased; the answer is plain generation's with that bias."""
    tokenizer = cached_tokenizer()
    ids = tokenizer.encode(key, add_special_tokens=False)
    body = {"prompt": "def f(x):", "n_predict": 12, "temperature": 0, "logit_bias": {key: False}}
    response = client.post("/completion", json={**body, "return_tokens": True})
    assert response.status_code == 200, response.text
    sampling = SamplingParams(temperature=0, logit_bias=tuple((token, -math.inf) for token in ids))
    expected = pipeline([]).generate("def f(x):", sampling, GenerationConfig(n_predict=12))
    assert response.json()["tokens"] == expected.tokens


def test_a_bias_against_the_only_token_a_schema_allows_ends_the_answer(client) -> None:
    """The schema's answer must go on with one token, which the bias keeps out: the answer ends
    there, as plain generation does ("no allowed token"), and never holds that token."""
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    spec = ConstraintSpec("json_schema", json.dumps(schema))
    free = pipeline([]).generate("x", SamplingParams(temperature=0), GenerationConfig(n_predict=32), spec)
    constraint = Constraint.for_backend(spec, pipeline([]).target)
    forced = []
    for token in free.tokens:
        allowed = constraint.allowed()
        if allowed is not None and int(allowed.sum()) == 1:
            forced.append(token)
        constraint.advance(token)
    banned = forced[-1]
    sampling = SamplingParams(temperature=0, logit_bias=((banned, -math.inf),))
    expected = pipeline([]).generate("x", sampling, GenerationConfig(n_predict=32), spec)
    assert expected.stats.stop_reason == "no allowed token" and banned not in expected.tokens
    body = {"prompt": "x", "n_predict": 32, "temperature": 0, "json_schema": schema, "return_tokens": True}
    reply = client.post("/completion", json={**body, "logit_bias": [[banned, False]]}).json()
    assert reply["tokens"] == expected.tokens and reply["content"] == expected.text
    assert reply["stop_type"] == "eos"
