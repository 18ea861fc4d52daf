"""GGUF files as first-class inputs: their tokenizer built once and cached, and `specdecode
convert` writing one as a Hugging Face directory.

- The cache: a second load (or a copy of the file) reads the stored tokenizer instead of
  building it again; a damaged entry is rebuilt, never an error.
- The round trip: the directory holds the file's dequantized weights (bit for bit the logits of
  the file through the same forward), its tokenizer, chat template and special ids; speculation
  on the directory gives the greedy output of plain generation on the file with `--backend hf`.
- Refusals: a non-empty directory (unless --force), a destination that cannot be written
  (checked before the file is read), a file that is not GGUF, a missing file.
"""

from __future__ import annotations

import copy
import json
import os
import shutil
from pathlib import Path

import pytest
import torch
from conftest import VOCAB_SIZE, TargetSpec, cached_tokenizer, target_model
from safetensors import safe_open
from transformers import LlamaForCausalLM

from specdecode import GenerationConfig, Pipeline, SamplingParams
from specdecode.backends import gguf_files
from specdecode.backends.gguf_files import export_gguf, load_gguf_tokenizer, tokenizer_cache_dir
from specdecode.backends.hf import LoadOptions
from specdecode.backends.load import load_backend
from specdecode.cli import main
from specdecode.testing import make_llama, save_model

PROMPT_TEXT = "def wrap(text, width=70):\n    return"
CHAT_TEMPLATE = "{% for message in messages %}<|{{ message.role }}|>{{ message.content }}{% endfor %}"


@pytest.fixture
def builds(monkeypatch, tmp_path) -> list[Path]:
    """The GGUF files whose tokenizer was built (not read from the cache), in a fresh cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    built: list[Path] = []
    build = gguf_files.build_gguf_tokenizer

    def spy(path: Path, rows: int):
        built.append(path)
        return build(path, rows)

    monkeypatch.setattr(gguf_files, "build_gguf_tokenizer", spy)
    return built


def same_tokenizer(one, other) -> bool:
    ids = one(PROMPT_TEXT)["input_ids"]
    return (
        ids == other(PROMPT_TEXT)["input_ids"]
        and one.decode(ids) == other.decode(ids)
        and one.get_vocab() == other.get_vocab()
        and (one.bos_token_id, one.eos_token_id, one.pad_token_id)
        == (other.bos_token_id, other.eos_token_id, other.pad_token_id)
    )


def test_the_tokenizer_is_built_once_and_a_copy_finds_it(gguf_files, builds, tmp_path):
    path = gguf_files["target.gguf"]
    first = load_gguf_tokenizer(path)
    assert builds == [path] and len(list(tokenizer_cache_dir().iterdir())) == 1
    second = load_gguf_tokenizer(path)
    copied = shutil.copy(path, tmp_path / "renamed.gguf")
    third = load_gguf_tokenizer(Path(copied))
    assert builds == [path]  # keyed by the tokenizer's content, not the file's name
    assert same_tokenizer(second, first) and same_tokenizer(third, first)
    load_gguf_tokenizer(gguf_files["target-q8_0.gguf"])  # another quantization, the same vocabulary
    assert builds == [path]


def test_a_damaged_entry_is_rebuilt(gguf_files, builds):
    path = gguf_files["target.gguf"]
    first = load_gguf_tokenizer(path)
    (entry,) = tokenizer_cache_dir().iterdir()
    (entry / "tokenizer.json").write_text("{ not json")
    assert same_tokenizer(load_gguf_tokenizer(path), first)
    assert builds == [path, path]
    assert same_tokenizer(load_gguf_tokenizer(path), first) and len(builds) == 2  # replaced whole


def test_convert_gives_the_files_weights_and_greedy_output(gguf_files, tmp_path, capsys, exactness_log):
    path = gguf_files["target-q8_0.gguf"]  # quantized: the directory holds its dequantized weights
    out = tmp_path / "converted"
    assert main(["convert", str(path), str(out)]) == 0
    assert {"config.json", "model.safetensors", "tokenizer.json", "generation_config.json"} <= {
        file.name for file in out.iterdir()
    }
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    f32 = LoadOptions(dtype="float32", backend="hf")
    directory, from_file = load_backend(out, f32), load_backend(path, f32)
    ids = from_file.tokenize(PROMPT_TEXT)
    assert directory.tokenize(PROMPT_TEXT) == ids
    assert torch.equal(directory.evaluate(ids), from_file.evaluate(ids))

    config = GenerationConfig(n_predict=32, ignore_eos=True)
    greedy = SamplingParams(temperature=0.0)
    expected = Pipeline(from_file.fork(), spec_types=[]).generate(ids, greedy, config)
    native = load_backend(out, LoadOptions(dtype="float32", backend="native"))
    draft = load_backend(gguf_files["draft.gguf"], LoadOptions(dtype="float32", backend="native"))
    result = Pipeline(native, draft, spec_types=["draft"]).generate(ids, greedy, config)
    assert result.tokens == expected.tokens
    stats = result.stats
    exactness_log.record("gguf-convert/draft-greedy", "draft", stats, stats.stop_reason, "float32")

    capsys.readouterr()
    runs = []
    for model in (["-m", str(out), "--backend", "native"], ["-m", str(path), "--backend", "hf"]):
        args = ["generate", *model, "--spec-type", "none", "--temp", "0", "-n", "16", "--ignore-eos"]
        assert main([*args, "-p", PROMPT_TEXT, "--json"]) == 0
        runs.append(json.loads(capsys.readouterr().out)["tokens"])
    assert runs[0] == runs[1]


def test_convert_keeps_the_chat_template_and_special_ids(tmp_path):
    tokenizer = copy.deepcopy(cached_tokenizer())
    tokenizer.chat_template = CHAT_TEMPLATE
    directory = save_model(tmp_path / "chat", target_model(TargetSpec()), tokenizer)
    path = export_gguf(directory, tmp_path / "chat.gguf", "f32")
    out = tmp_path / "converted"
    assert main(["convert", str(path), str(out), "--dtype", "bfloat16"]) == 0
    assert json.loads((out / "tokenizer_config.json").read_text())["chat_template"] == CHAT_TEMPLATE
    generation = json.loads((out / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
    )
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"


def test_convert_writes_tied_embeddings_once(tmp_path):
    config = make_llama(VOCAB_SIZE).config
    config.tie_word_embeddings = True
    directory = save_model(tmp_path / "tied", LlamaForCausalLM(config).double(), cached_tokenizer())
    path = export_gguf(directory, tmp_path / "tied.gguf", "f32")
    out = tmp_path / "converted"
    assert main(["convert", str(path), str(out)]) == 0
    with safe_open(out / "model.safetensors", "pt") as weights:
        names = set(weights.keys())
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    f32 = LoadOptions(dtype="float32", backend="native")
    directory_backend, file_backend = load_backend(out, f32), load_backend(path, f32)
    ids = file_backend.tokenize(PROMPT_TEXT)
    assert torch.equal(directory_backend.evaluate(ids), file_backend.evaluate(ids))


@pytest.mark.parametrize(
    "source, message",
    [
        ("target", "is not a GGUF file (a directory)"),
        ("text", "is not a GGUF file (a file without the GGUF magic bytes)"),
        ("missing", "GGUF file not found"),
    ],
)
def test_convert_refuses_what_is_not_a_gguf_file(gguf_files, tmp_path, capsys, source, message):
    text = tmp_path / "notes.gguf"
    text.write_text("not a model")
    paths = {"target": gguf_files["target"], "text": text, "missing": tmp_path / "missing.gguf"}
    assert main(["convert", str(paths[source]), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1
    assert not (tmp_path / "out").exists()


def test_convert_refuses_a_non_empty_directory_unless_forced(gguf_files, tmp_path, capsys):
    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    argv = ["convert", str(gguf_files["target.gguf"]), str(out)]
    assert main(argv) == 2
    assert "exists and is not empty (--force writes into it)" in capsys.readouterr().err
    assert [file.name for file in out.iterdir()] == ["notes.txt"]
    assert main([*argv, "--force"]) == 0
    assert (out / "model.safetensors").is_file() and (out / "notes.txt").read_text() == "mine"


def test_convert_checks_its_destination_before_reading_the_model(gguf_files, tmp_path, capsys, monkeypatch):
    from specdecode.export import convert

    loads: list[Path] = []
    monkeypatch.setattr(convert, "load_gguf_model", lambda path, *args, **kwargs: loads.append(path))
    a_file = tmp_path / "notes.txt"
    a_file.write_text("mine")
    destinations = {"under a file": (a_file / "out", "is not a directory")}
    if os.geteuid() != 0:  # root writes through permission bits
        locked = tmp_path / "locked"
        locked.mkdir(mode=0o500)
        destinations["in a read-only directory"] = (locked / "out", "is not writable")
        destinations["a read-only directory"] = (locked, "permission denied")
    for out, message in destinations.values():
        assert main(["convert", str(gguf_files["target.gguf"]), str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("error: cannot ") and message in err and err.count("\n") == 1
    assert loads == [] and a_file.read_text() == "mine"
    assert sorted(path.name for path in tmp_path.rglob("*")) == sorted(
        ["notes.txt", *(["locked"] if os.geteuid() != 0 else [])]
    )
