"""Chat prompts: `generate --chat` and `bench --chat` render the model's chat template (or a
file's) as the server does, and speculation over a chat prompt stays plain generation's.

A template is code: one that raises anything, or renders nothing, is one clear error (a 400 on
the server). A prompt too long for the context, typed or written by a template, is refused
before it is tokenized, in the library, on the command line and on the server."""

from __future__ import annotations

import copy
import json
import time
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from specdecode.api import Pipeline
from specdecode.chat import ChatPrompt, encode_rendered, own_template
from specdecode.cli import main
from specdecode.errors import SpecdecodeError
from specdecode.stats import DraftCounts, GenerationStats
from specdecode.testing import make_llama, make_tokenizer, perturbed_copy, save_model

# ChatML-like, with BOS written by the template (as Llama 3's and SmolLM2's are)
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
OTHER_TEMPLATE = "{% for message in messages %}[{{ message['content'] }}]{% endfor %}=>"
SYSTEM, USER = "Answer in code.", "def fib(n):"


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    """The same float64 target saved with a chat template ("chat") and without ("base"), and a
    close draft."""
    root = tmp_path_factory.mktemp("chat-models")
    base_tokenizer = make_tokenizer(320)
    chat_tokenizer = copy.deepcopy(base_tokenizer)
    chat_tokenizer.chat_template = TEMPLATE
    target = make_llama(len(base_tokenizer), init_std=0.5, seed=3)
    return {
        "chat": save_model(root / "chat", target, chat_tokenizer),
        "base": save_model(root / "base", target, base_tokenizer),
        "draft": save_model(root / "draft", perturbed_copy(target, 0.02), chat_tokenizer),
        "root": root,
    }


def run_json(capsys, *args: str) -> dict:
    assert main(["generate", "--json", "--temp", "0", "--ignore-eos", *args]) == 0
    return json.loads(capsys.readouterr().out)


def template_ids(model: Path, template: str | None = None) -> list[int]:
    """transformers' own rendering and tokenization of the test conversation."""
    tokenizer = Pipeline.load(model).target.tokenizer
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": USER}]
    encoded = tokenizer.apply_chat_template(messages, chat_template=template, add_generation_prompt=True)
    return list(encoded["input_ids"])


def test_greedy_chat_output_is_plain_generation_of_the_rendered_prompt(
    models, capsys, exactness_log, fixed_costs
):
    """Under the default (adaptive) policy at fixed costs, whether it drafts does not depend on
    how busy the machine is."""
    expected_ids = template_ids(models["chat"])
    assert expected_ids[:2] != [0, 0] and expected_ids[0] == 0  # one BOS, the template's
    chat = ["-m", str(models["chat"]), "--chat", "-sys", SYSTEM, "-p", USER, "-n", "24"]
    spec = run_json(capsys, *chat, "-md", str(models["draft"]), "--draft-p-min", "0", "--draft-max", "6")
    plain = Pipeline.load(models["chat"]).generate(expected_ids, max_new_tokens=24, ignore_eos=True)
    assert spec["stats"]["n_prompt"] == len(expected_ids)
    assert spec["tokens"] == plain.tokens and spec["text"] == plain.text
    totals = spec["stats"]["totals"]
    assert totals["n_drafted"] > 0
    counts = DraftCounts(n_drafted=totals["n_drafted"], n_accepted=totals["n_accepted"])
    stats = GenerationStats(totals=counts)
    exactness_log.record("chat/generate", "draft 0.02", stats, spec["stats"]["stop_reason"])


def test_a_template_file_overrides_the_models_and_serves_a_model_without_one(models, capsys):
    template_file = models["root"] / "other.jinja"
    template_file.write_text(OTHER_TEMPLATE)
    expected = [0, *template_ids(models["chat"], OTHER_TEMPLATE)]  # BOS added: the template writes none
    for model in ("chat", "base"):
        args = ["-m", str(models[model]), "--chat", "-sys", SYSTEM, "-p", USER, "-n", "4"]
        result = run_json(capsys, *args, "--chat-template-file", str(template_file), "--spec-type", "none")
        assert result["stats"]["n_prompt"] == len(expected)


def test_the_rendered_prompt_gets_one_bos_whether_or_not_the_template_writes_it(models):
    tokenizer = Pipeline.load(models["chat"]).target.tokenizer
    for template in (TEMPLATE, OTHER_TEMPLATE):
        ids = encode_rendered(tokenizer, ChatPrompt(SYSTEM, template).text(tokenizer, USER, "test"))
        assert ids[0] == tokenizer.bos_token_id and ids[1] != tokenizer.bos_token_id
    assert ChatPrompt().text(tokenizer, USER, "test") == f"<|bos|><|user|>{USER}\n<|assistant|>"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["-m", "{base}", "--chat", "-p", "x"], "has no chat template: give one with --chat-template-file"),
        (["-m", "{chat}", "--chat"], "no prompt"),
        (["-m", "{chat}", "-sys", "terse", "-p", "x"], "-sys/--system-prompt applies to a chat: add --chat"),
        (["-m", "{chat}", "--chat", "--chat-template-file", "{missing}", "-p", "x"], "cannot read the chat"),
        (["-m", "{chat}", "--chat", "--chat-template-file", "{broken}", "-p", "x"], "chat template failed"),
    ],
)
def test_chat_mistakes_exit_2_with_one_clear_line(models, tmp_path, capsys, args, message):
    broken = tmp_path / "broken.jinja"
    broken.write_text("{% for message in messages %}")  # an unclosed block
    paths = {**models, "missing": tmp_path / "nowhere.jinja", "broken": broken}
    assert main(["generate", *(arg.format(**paths) for arg in args)]) == 2
    *phases, error = capsys.readouterr().err.splitlines()
    assert error.startswith("error: ") and message in error
    assert all(line.startswith("specdecode: ") for line in phases)


def test_a_gguf_file_carries_the_template_and_generate_renders_it(models, capsys):
    pytest.importorskip("gguf")
    from specdecode.backends.gguf_files import export_gguf, load_gguf_tokenizer

    path = export_gguf(models["chat"], models["root"] / "chat.gguf", "f32")
    assert own_template(load_gguf_tokenizer(path)) == TEMPLATE
    result = run_json(capsys, "-m", str(path), "--chat", "-sys", SYSTEM, "-p", USER, "-n", "4")
    assert result["stats"]["n_prompt"] == len(template_ids(models["chat"]))
    without = load_gguf_tokenizer(export_gguf(models["base"], models["root"] / "base.gguf", "f32"))
    with pytest.raises(SpecdecodeError, match="has no chat template"):
        ChatPrompt().text(without, USER, "base.gguf")


def test_bench_chat_renders_every_prompt_and_runs_an_ngram_only_chain(models, tmp_path):
    argv = ["bench", "-m", str(models["chat"]), "--chat", "-sys", SYSTEM, "-p", USER, "-p", "import os"]
    argv += ["--systems", "plain,ngram-simple+ngram-mod", "-n", "8", "--runs", "1", "--warmup", "0"]
    assert main([*argv, "--sweep", "0", "--no-plots", "--out", str(tmp_path)]) == 0
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["tasks"]["custom"][0] == f"<|bos|><|system|>{SYSTEM}\n<|user|>{USER}\n<|assistant|>"
    assert results["systems"] == ["plain", "ngram-simple,ngram-mod"]
    assert all(row["exact_match_rate"] == 1.0 for row in results["rows"])


def test_bench_chat_refuses_a_model_without_a_template(models, tmp_path, capsys):
    argv = ["bench", "-m", str(models["base"]), "--chat", "-p", USER, "--no-plots", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert capsys.readouterr().err.splitlines()[-1].startswith("error: ")


# --------------------------------------------------------------------------- hostile templates and prompts

HUGE = 1_000_000  # characters: 50 times what the tiny models' 512 positions could hold
TOO_LONG = r"characters, so at least \d+ tokens, but the context holds only"


def counted(monkeypatch, owner: object, name: str) -> list[int]:
    """The lengths of the texts owner.name (a real tokenizing function) is called with."""
    real = getattr(owner, name)
    calls: list[int] = []

    def counting(*args, **kwargs):
        calls.append(max((len(arg) for arg in args if isinstance(arg, str)), default=0))
        return real(*args, **kwargs)

    monkeypatch.setattr(owner, name, counting)
    return calls


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ 1/0 }}", "ZeroDivisionError: division by zero"),
        ("{% for i in range(1000000) %}{% endfor %}x", "OverflowError: Range too big"),
        ("{{ messages[5]['content'] }}", "UndefinedError"),
        ("{% if false %}x{% endif %}", "rendered the messages as an empty prompt"),
    ],
)
def test_a_template_that_raises_anything_or_renders_nothing_is_one_clear_error(
    models, tmp_path, capsys, template, message
):
    with pytest.raises(SpecdecodeError, match=message):
        ChatPrompt(template=template).text(Pipeline.load(models["chat"]).target.tokenizer, USER, "test")
    path = tmp_path / "hostile.jinja"
    path.write_text(template)
    argv = ["generate", "-m", str(models["chat"]), "--chat", "--chat-template-file", str(path), "-p", USER]
    assert main(argv) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith("error: the chat template") and message in error


def test_a_prompt_too_long_for_the_context_is_refused_before_it_is_tokenized(models, monkeypatch):
    pipeline = Pipeline.load(models["chat"])
    calls = counted(monkeypatch, type(pipeline.target), "tokenize")
    huge = "x" * HUGE
    started = time.perf_counter()
    for run in (
        lambda: pipeline.generate(huge, max_new_tokens=4),
        lambda: pipeline.stream(huge),
        lambda: pipeline.generate([USER, huge], max_new_tokens=4),
    ):
        with pytest.raises(SpecdecodeError, match=TOO_LONG):
            run()
    assert calls == [] and time.perf_counter() - started < 10  # tokenizing it takes longer
    # with room for the tokens asked for: a text that alone would fit, but not with them
    n_ctx = pipeline.target.n_ctx
    half = "x" * (pipeline._chars_per_token * (n_ctx // 2))
    with pytest.raises(SpecdecodeError, match=r"\+ n_predict \(400\) exceeds the context size"):
        pipeline.generate(half, max_new_tokens=400)
    assert calls == []
    # a bound, never a refusal of what fits: a prompt of nearly the whole context still runs
    text = (USER + "\n    return fib(n - 1) + fib(n - 2)\n") * 200
    ids = pipeline.target.tokenize(text)[: n_ctx - 2]
    fitting = pipeline.target.detokenize(ids, skip_special=True)
    assert pipeline.generate(fitting, max_new_tokens=1).stats.n_prompt > n_ctx // 2


def test_a_chat_template_writing_megabytes_is_refused_before_tokenizing_on_the_command_line(
    models, tmp_path, capsys, monkeypatch
):
    from specdecode import chat

    calls = counted(monkeypatch, chat, "encode")
    path = tmp_path / "huge.jinja"
    path.write_text(f"{{{{ 'x' * {HUGE} }}}}")
    argv = ["generate", "-m", str(models["chat"]), "--chat", "--chat-template-file", str(path), "-p", USER]
    started = time.perf_counter()
    assert main(argv) == 2
    error = capsys.readouterr().err.splitlines()[-1]
    assert error.startswith(f"error: the prompt is {HUGE} characters, so at least")
    assert calls == [] and time.perf_counter() - started < 30  # the model's load included


def chat_server(models, template: str) -> TestClient:
    """A server of the test target whose tokenizer has `template` as its own."""
    from specdecode.server import ServerSettings, create_app

    pipeline = Pipeline.load(models["chat"], spec_types=[])
    pipeline.target.tokenizer.chat_template = template
    return TestClient(create_app(pipeline, ServerSettings(model_id="tiny", parallel=1)))


@pytest.mark.parametrize(
    ("template", "message"),
    [
        ("{{ 1/0 }}", "ZeroDivisionError"),
        ("{% for i in range(1000000) %}{% endfor %}x", "OverflowError"),
        ("{% if false %}x{% endif %}", "empty prompt"),
    ],
)
def test_the_server_answers_a_failing_template_with_a_400(models, template, message):
    chat = {"messages": [{"role": "user", "content": USER}], "max_tokens": 2}
    with chat_server(models, template) as client:
        for path in ("/v1/chat/completions", "/apply-template"):
            reply = client.post(path, json=chat)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["param"] == "messages" and message in error["message"]
        assert client.get("/health").json()["status"] == "ok"


def test_the_server_refuses_a_rendering_too_long_before_tokenizing_it(models, monkeypatch):
    from specdecode import chat

    calls = counted(monkeypatch, chat, "encode")
    body = {"messages": [{"role": "user", "content": USER}], "max_tokens": 2}
    with chat_server(models, f"{{{{ 'x' * {HUGE} }}}}") as client:
        started = time.perf_counter()
        for path in ("/v1/chat/completions", "/apply-template"):
            reply = client.post(path, json=body)
            assert reply.status_code == 400, reply.text
            error = reply.json()["error"]
            assert error["code"] == "context_length_exceeded" and "rendered chat prompt" in error["message"]
        assert calls == [] and time.perf_counter() - started < 10
