"""`specdecode generate` before "ready": every check that needs only the flags, the files or a
GGUF file's metadata answers before any model loads (and before torch is imported), each long
phase after it has its line on stderr as it begins, and after "ready" only generation runs.

The metadata comes from `specdecode.gguf_header`, a reader of GGUF headers that takes a fraction
of a second where the `gguf` package's reader takes tens of seconds on a large vocabulary; it
must read exactly what that reader reads (the tokenizer cache is keyed by those bytes).
"""

from __future__ import annotations

import copy
import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from specdecode import chat, gguf_header
from specdecode.chat import ChatPrompt, stored_template
from specdecode.cli import main
from specdecode.errors import SpecdecodeError

TEMPLATE = "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"


def run_fresh(argv: list[str]) -> dict:
    """`specdecode` with `argv` in a new interpreter, stdin not a terminal: its exit status, its
    stderr's lines and whether it imported torch (this interpreter has long imported it)."""
    script = textwrap.dedent(
        f"""
        import contextlib, io, json, sys
        from specdecode.cli import main

        err = io.StringIO()
        with contextlib.redirect_stderr(err):
            status = main({argv!r})
        lines = err.getvalue().splitlines()
        print(json.dumps({{"status": status, "err": lines, "torch": "torch" in sys.modules}}))
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, timeout=120, stdin=subprocess.DEVNULL
    )
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, Path]:
    """The test target as a directory and a GGUF file, each with and without a chat template."""
    pytest.importorskip("gguf")
    from conftest import TargetSpec, cached_tokenizer, target_model

    from specdecode.backends.gguf_files import export_gguf
    from specdecode.testing import save_model

    root = tmp_path_factory.mktemp("startup")
    model = target_model(TargetSpec())
    base = cached_tokenizer()
    with_template = copy.deepcopy(base)
    with_template.chat_template = TEMPLATE
    paths = {
        "base": save_model(root / "base", model, base),
        "chat": save_model(root / "chat", model, with_template),
    }
    for name in ("base", "chat"):
        paths[f"{name}.gguf"] = export_gguf(paths[name], root / f"{name}.gguf", "f32")
    return paths


# --------------------------------------------------------------------------- checks before loading


def test_a_chat_on_a_model_without_a_template_is_refused_before_torch_loads(files):
    """What took minutes on Gemma 3 (its weights, then its tokenizer built, then the finding)."""
    for name in ("base.gguf", "base"):
        result = run_fresh(["generate", "-m", str(files[name]), "--chat", "-p", "hi"])
        assert result["status"] == 2 and not result["torch"], result
        assert result["err"] == [
            f"error: {files[name].stem} has no chat template: give one with --chat-template-file FILE "
            "(a Jinja template)"
        ]


def test_a_chat_without_a_prompt_and_no_terminal_is_refused_before_torch_loads(files):
    result = run_fresh(["generate", "-m", str(files["chat.gguf"]), "-cnv"])
    assert result["status"] == 2 and not result["torch"]
    assert result["err"] == ["error: no prompt: pass -p TEXT or -f FILE"]


def test_a_run_says_each_phase_from_its_first_second(files):
    """In a new interpreter, as a user starts it: PyTorch's import (seconds) is the first phase
    said, after the checks that need no torch; then the models, the tokenizer, "ready"."""
    pytest.importorskip("llama_cpp")
    argv = ["generate", "-m", str(files["chat.gguf"]), "--chat", "-p", "hi", "-n", "2", "--spec-type", "none"]
    result = run_fresh(argv)
    assert result["status"] == 0, result
    phases = [line for line in result["err"] if line.startswith("specdecode: ")]
    assert phases[0] == "specdecode: importing PyTorch"
    assert phases[1] == f"specdecode: loading the target model from {files['chat.gguf']}"
    assert phases[2] == "specdecode: reading chat.gguf's tokenizer with transformers"
    assert phases[-1].startswith("specdecode: ready in ")


def test_no_model_loads_before_the_template_is_refused(files, monkeypatch, capsys):
    """In this interpreter too: the loader, had it been reached, would fail the test."""
    import specdecode.api

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(specdecode.api, "load_backend", no_loading)
    for name in ("base.gguf", "base"):
        assert main(["generate", "-m", str(files[name]), "--chat", "-p", "hi"]) == 2
        assert "has no chat template" in capsys.readouterr().err
    # a template given by file, or carried by the model: the check lets the load go ahead
    template = files["base"].parent / "given.jinja"
    template.write_text(TEMPLATE)
    for argv in (
        ["-m", str(files["chat.gguf"])],
        ["-m", str(files["base"]), "--chat-template-file", str(template)],
    ):
        with pytest.raises(AssertionError, match="a model was loaded"):
            main(["generate", *argv, "--chat", "-p", "hi"])


def test_a_missing_draft_is_said_before_the_target_loads(files, monkeypatch, capsys):
    import specdecode.api

    def no_loading(*args, **kwargs):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(specdecode.api, "load_backend", no_loading)
    missing = files["base"].parent / "draft.gguf"
    assert main(["generate", "-m", str(files["chat.gguf"]), "-md", str(missing), "-p", "hi"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: GGUF file not found: {missing}"
    head = files["base"].parent / "no-head"
    assert main(["generate", "-m", str(files["chat"]), "-me", str(head), "-p", "hi"]) == 2
    assert capsys.readouterr().err.splitlines()[-1] == f"error: EAGLE-3 head directory not found: {head}"


def test_the_template_is_read_from_each_kind_of_file(files, tmp_path):
    assert stored_template(files["chat.gguf"]) is True and stored_template(files["base.gguf"]) is False
    assert stored_template(files["chat"]) is True and stored_template(files["base"]) is False
    directory = tmp_path / "named"
    directory.mkdir()
    config = {"chat_template": [{"name": "tool_use", "template": TEMPLATE}]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert stored_template(directory) is False  # named templates without a "default"
    config["chat_template"].append({"name": "default", "template": TEMPLATE})
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert stored_template(directory) is True
    (directory / "tokenizer_config.json").write_text("{}")
    (directory / "chat_template.jinja").write_text(TEMPLATE)  # transformers' own file
    assert stored_template(directory) is True
    # what the files cannot tell is left to the tokenizer, never refused
    (directory / "chat_template.jinja").unlink()
    (directory / "tokenizer_config.json").write_text("not json")
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"safetensors, renamed")
    assert stored_template(directory) is None and stored_template(not_gguf) is None
    assert stored_template(tmp_path / "missing") is None and stored_template(tmp_path / "empty") is None
    ChatPrompt(template=TEMPLATE).check_files(files["base.gguf"], "base")  # a file's template: no question


# --------------------------------------------------------------------------- the metadata reader


def write_gguf(path: Path, big_endian: bool = False) -> Path:
    """A GGUF file of every value type llama.cpp's files hold, a vocabulary-like list among them."""
    gguf = pytest.importorskip("gguf")
    import numpy as np

    endian = gguf.GGUFEndian.BIG if big_endian else gguf.GGUFEndian.LITTLE
    writer = gguf.GGUFWriter(path, "llama", endianess=endian)
    writer.add_uint32("test.u32", 7)
    writer.add_int64("test.i64", -3)
    writer.add_float32("test.f32", 0.5)
    writer.add_float64("test.f64", 1.25)
    writer.add_bool("test.bool", True)
    writer.add_string("test.text", "Ünïcödé")
    writer.add_array("test.ints", [1, 2, 3])
    writer.add_token_list([f"token {i}" for i in range(1000)] + ["", "日本語"])
    writer.add_chat_template(TEMPLATE)
    writer.add_tensor("weight", np.ones((2, 3), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("big_endian", [False, True])
def test_the_header_reader_reads_what_the_gguf_package_reads(tmp_path, big_endian):
    import gguf

    path = write_gguf(tmp_path / "all.gguf", big_endian)
    fields = gguf_header.read_metadata(path)
    theirs = {
        name: field for name, field in gguf.GGUFReader(path).fields.items() if not name.startswith("GGUF.")
    }
    assert list(fields) == list(theirs)
    for name, field in theirs.items():
        size = sum(part.nbytes for part in field.parts)
        reader_bytes = gguf.GGUFReader(path).data[field.offset : field.offset + size].tobytes()
        assert fields[name].raw == reader_bytes, name
    assert fields["test.u32"].value == 7 and fields["test.i64"].value == -3
    assert fields["test.f32"].value == 0.5 and fields["test.f64"].value == 1.25
    assert fields["test.bool"].value is True and fields["test.text"].value == "Ünïcödé"
    assert fields["tokenizer.ggml.tokens"].count == 1002 and fields["tokenizer.ggml.tokens"].value is None
    assert fields["test.ints"].count == 3
    assert gguf_header.chat_template(path) == TEMPLATE


def test_a_file_that_is_not_gguf_or_is_cut_short_is_one_clear_error(tmp_path):
    path = write_gguf(tmp_path / "whole.gguf")
    cut = tmp_path / "cut.gguf"
    data = path.read_bytes()
    cut.write_bytes(data[: data.index(b"token 500")])
    other = tmp_path / "other.gguf"
    other.write_bytes(b"PK\x03\x04" + bytes(100))
    for bad in (cut, other, tmp_path / "missing.gguf"):
        with pytest.raises(SpecdecodeError, match=f"cannot read the GGUF metadata of {bad}"):
            gguf_header.read_metadata(bad)


def test_cached_tokenizers_keep_their_keys(files):
    """The key is the one the `gguf` package's reader gave, so that tokenizers already built
    (minutes each, for a large vocabulary) are found again."""
    import gguf
    import transformers

    from specdecode.backends import gguf_files

    reader = gguf.GGUFReader(files["chat.gguf"])
    digest = hashlib.sha256(f"{gguf_files.TOKENIZER_CACHE_FORMAT} {transformers.__version__}".encode())
    for name in sorted(reader.fields):
        if name.startswith("tokenizer.") or name == "general.architecture":
            field = reader.fields[name]
            size = sum(part.nbytes for part in field.parts)
            digest.update(reader.data[field.offset : field.offset + size].tobytes())
    assert gguf_files._tokenizer_key(gguf_header.read_metadata(files["chat.gguf"])) == digest.hexdigest()


# --------------------------------------------------------------------------- the phases' lines


def test_each_long_phase_has_its_line_before_ready_and_only_generation_follows(
    files, monkeypatch, capsys, tmp_path
):
    """On llama.cpp: the models, the row probe (no stored verdict in the tests), the tokenizer
    read and built (an empty tokenizer cache), then the chat rendered and tokenized; all said
    or done before "ready", nothing of it after."""
    pytest.importorskip("llama_cpp")
    from specdecode.backends import gguf_files

    monkeypatch.setattr(gguf_files, "tokenizer_cache_dir", lambda: tmp_path / "tokenizers")
    events: list[str] = []

    def marked(function, name):
        def spy(*args, **kwargs):
            events.append(name)
            return function(*args, **kwargs)

        return spy

    monkeypatch.setattr(gguf_files, "build_gguf_tokenizer", marked(gguf_files.build_gguf_tokenizer, "BUILT"))
    monkeypatch.setattr(chat, "render", marked(chat.render, "RENDERED"))
    monkeypatch.setattr(chat, "encode", marked(chat.encode, "ENCODED"))
    import specdecode.cli.settings as settings

    def say(message: str) -> None:
        events.append(message)

    monkeypatch.setattr(settings, "say", say)
    import specdecode.cli.commands as commands

    monkeypatch.setattr(commands, "say", say)
    gguf = str(files["chat.gguf"])
    argv = ["generate", "-m", gguf, "-md", gguf, "--chat", "-p", "hi", "-n", "4", "--spec-policy", "classic"]
    assert main([*argv, "--backend", "llama.cpp"]) == 0
    capsys.readouterr()
    ready = next(i for i, event in enumerate(events) if event.startswith("ready in"))
    assert ready == len(events) - 1, events[ready:]  # nothing of the start-up after it
    phases = [
        "loading the target model",
        "loading the draft model",
        "checking that llama.cpp's multi-row passes give chat the rows of one-row passes",
        "reading chat.gguf's tokenizer with transformers",
        "building chat.gguf's tokenizer from its",
        "BUILT",
        "RENDERED",
        "ENCODED",
    ]
    found = [next(i for i, event in enumerate(events) if event.startswith(phase)) for phase in phases]
    assert found == sorted(found), events
    # the next run finds the tokenizer built: read, not built again; a grammar is compiled
    # against the vocabulary (seconds, for a large one) before "ready" too
    from specdecode.constraints import Constraint

    events.clear()
    compile_for = Constraint.for_backend.__func__
    monkeypatch.setattr(Constraint, "for_backend", classmethod(marked(compile_for, "COMPILED")))
    assert main([*argv, "--backend", "llama.cpp", "--regex", "[a-z ]+"]) == 0
    assert "BUILT" not in events
    phases = [
        "reading chat.gguf's",
        "compiling the grammar for the target's vocabulary",
        "COMPILED",
        "ready in",
    ]
    found = [next(i for i, event in enumerate(events) if event.startswith(phase)) for phase in phases]
    assert found == sorted(found), events


def test_serve_reads_the_tokenizer_before_ready(files, monkeypatch, tmp_path):
    """The server's routes need the target's tokenizer: built before "ready", not by the first
    request (a GGUF file's takes minutes for a large vocabulary)."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("fastapi")
    from specdecode.backends import gguf_files
    from specdecode.server import serve

    monkeypatch.setattr(gguf_files, "tokenizer_cache_dir", lambda: tmp_path / "tokenizers")
    events: list[str] = []
    import specdecode.cli.commands as commands
    import specdecode.cli.settings as settings

    monkeypatch.setattr(settings, "say", events.append)
    monkeypatch.setattr(commands, "say", events.append)
    monkeypatch.setattr(serve, "run", lambda pipeline, settings, sock: events.append("SERVING"))
    argv = ["serve", "-m", str(files["chat.gguf"]), "--backend", "llama.cpp", "--port", "0"]
    assert main([*argv, "--spec-type", "none"]) == 0
    built = next(i for i, event in enumerate(events) if event.startswith("building chat.gguf's tokenizer"))
    ready = next(i for i, event in enumerate(events) if event.startswith("ready in"))
    assert built < ready and events[ready + 1 :] == ["SERVING"], events


def test_the_api_hears_the_same_phases(files, tmp_path, monkeypatch):
    pytest.importorskip("llama_cpp")
    from specdecode.api import Pipeline
    from specdecode.backends import gguf_files
    from specdecode.backends.options import LoadOptions

    monkeypatch.setattr(gguf_files, "tokenizer_cache_dir", lambda: tmp_path / "tokenizers")
    lines: list[str] = []
    pipeline = Pipeline.load(
        files["chat.gguf"], target_options=LoadOptions(backend="llama.cpp"), progress=lines.append
    )
    assert pipeline.target.invariant is not None and pipeline.target.tokenizer is not None
    assert [line.split(" ")[0] for line in lines] == ["loading", "checking", "reading", "building"]
