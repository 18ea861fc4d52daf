"""GGUF files without llama.cpp: the export writes llama.cpp's layout, transformers' GGUF loader
reads it back into the native forward, and speculation over the loaded file is still exact.

- Round trip: an f32 file gives bit for bit the logits of the directory it came from, with the
  same tokenizer and vocabulary facts; Q8_0 is smaller and close.
- Exactness: each kind of strategy (a draft model's chain and tree, an n-gram pool) over GGUF target and
  draft equals plain generation over the same file, greedy and seeded `match`.
- The commands: `export`, then generate and lookup on the files; bad input exits with 2.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import cached_tokenizer

from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.gguf_files import export_gguf
from specdecode.backends.hf import LoadOptions, load_tokenizer
from specdecode.backends.load import is_gguf, load_backend
from specdecode.backends.native import NativeBackend
from specdecode.cli import main
from specdecode.errors import SpecdecodeError
from specdecode.lookup import model_tokenizer
from specdecode.strategies import NgramModConfig, NgramSettings

PROMPT_TEXT = "def wrap(text, width=70):\n    return"
NATIVE32 = LoadOptions(dtype="float32", backend="native")
NATIVE64 = LoadOptions(dtype="float64", backend="native")
# Short n-grams: a tiny random model rarely repeats a 24-gram (the default).
SHORT_NGRAMS = NgramSettings(mod=NgramModConfig(1, 1, 8))


def test_f32_file_gives_the_directorys_logits_bit_for_bit(gguf_files):
    from_dir = load_backend(gguf_files["target"], NATIVE32)
    from_file = load_backend(gguf_files["target.gguf"], NATIVE32)
    assert is_gguf(gguf_files["target.gguf"]) and not is_gguf(gguf_files["target"])
    assert isinstance(from_file, NativeBackend)
    ids = from_dir.tokenize(PROMPT_TEXT)
    assert from_file.tokenize(PROMPT_TEXT) == ids
    assert from_file.detokenize(ids) == from_dir.detokenize(ids)
    assert from_file.vocab == from_dir.vocab
    assert torch.equal(from_file.evaluate(ids), from_dir.evaluate(ids))


def test_q8_0_file_is_smaller_and_close(gguf_files):
    assert gguf_files["target-q8_0.gguf"].stat().st_size < 0.5 * gguf_files["target.gguf"].stat().st_size
    ids = cached_tokenizer()(PROMPT_TEXT)["input_ids"]
    exact = load_backend(gguf_files["target.gguf"], NATIVE32).evaluate(ids)
    quantized = load_backend(gguf_files["target-q8_0.gguf"], NATIVE32).evaluate(ids)
    assert not torch.equal(exact, quantized)
    assert (quantized - exact).norm() < 0.1 * exact.norm()  # 8-bit weights: a few percent


STRATEGIES = {
    "draft": (["draft"], DraftModelConfig()),
    "draft-tree": (["draft"], DraftModelConfig(n_max=6, p_min=0.0, p_split=0.05, n_parallel=3)),
    "ngram-mod": (["ngram-mod"], DraftModelConfig()),
    "ngram-mod+draft": (["ngram-mod", "draft"], DraftModelConfig()),
}


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_over_gguf_files_equals_plain(gguf_files, exactness_log, name, temperature):
    spec_types, draft_config = STRATEGIES[name]
    target = load_backend(gguf_files["target.gguf"], NATIVE64)
    draft = load_backend(gguf_files["draft.gguf"], NATIVE64)
    prompt = list(range(5, 17)) * 3  # repeats, for the n-gram strategies
    sampling = SamplingParams(temperature=temperature, seed=11)
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    expected = Pipeline(target.fork(), spec_types=[]).generate(prompt, sampling, config)
    pipeline = Pipeline(target, draft, spec_types=spec_types, draft_config=draft_config, ngram=SHORT_NGRAMS)
    result = pipeline.generate(prompt, sampling, config)
    assert result.tokens == expected.tokens
    mode = "greedy" if temperature == 0 else "match"
    exactness_log.record(f"gguf-transformers/{name}-{mode}", name, result.stats, result.stats.stop_reason)


def test_export_then_generate_and_lookup_on_the_files(gguf_files, tmp_path, capsys):
    argv = [
        "export",
        "-m",
        str(gguf_files["target"]),
        "-md",
        str(gguf_files["draft"]),
        "--engines",
        "llama.cpp",
    ]
    assert main([*argv, "--out", str(tmp_path)]) == 0
    out = tmp_path / "llama.cpp"
    assert sorted(path.name for path in out.iterdir()) == ["draft.gguf", "target.gguf"]
    capsys.readouterr()
    runs = {}
    for spec in ("none", "draft"):
        args = ["generate", "-m", str(out / "target.gguf"), "-md", str(out / "draft.gguf")]
        args += [
            "--backend",
            "native",
            "--spec-type",
            spec,
            "--spec-policy",
            "classic",
            "--temp",
            "0",
            "-n",
            "24",
        ]
        args += ["--ignore-eos"]
        assert main([*args, "-p", PROMPT_TEXT, "--json"]) == 0
        runs[spec] = json.loads(capsys.readouterr().out)
    assert runs["draft"]["tokens"] == runs["none"]["tokens"]
    assert runs["draft"]["stats"]["totals"]["n_drafted"] > 0
    text = "def fill(text):\n    return wrap(text)\n"
    assert (
        model_tokenizer(out / "target.gguf")(text)["input_ids"]
        == load_tokenizer(gguf_files["target"])(text)["input_ids"]
    )
    corpus = tmp_path / "corpus.txt"
    corpus.write_text(text * 20)
    cache = tmp_path / "static.bin"
    assert (
        main(["lookup", "create", "-m", str(out / "target.gguf"), "-f", str(corpus), "-lcs", str(cache)]) == 0
    )
    assert cache.stat().st_size > 0


def test_lookup_defaults_to_the_bundled_targets_tokenizer(tmp_path, capsys):
    bundled = Path(__file__).parents[1] / "src" / "specdecode" / "models" / "target"
    if not (bundled / "config.json").is_file():
        pytest.skip("this checkout carries no bundled pair")
    corpus = tmp_path / "corpus.txt"
    corpus.write_text("def fill(text):\n    return wrap(text)\n" * 20)
    assert main(["lookup", "create", "-f", str(corpus), "-lcs", str(tmp_path / "c.bin")]) == 0
    assert main(["lookup", "stats", "-f", str(corpus), "-c", "64", "-lcs", str(tmp_path / "c.bin")]) == 0
    assert "n_accept" in capsys.readouterr().out


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--backend", "llama.cpp", "-m", "{target}"],
            "cannot run this directory: weights stored in float64",
        ),
        (["-ngl", "-1", "-m", "{gguf}"], "GPU layer count must be >= 0"),
        (["-m", "{bad}"], "cannot load"),
    ],
)
def test_bad_gguf_input_exits_2(gguf_files, tmp_path, capsys, args, message):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    values = {"target": gguf_files["target"], "gguf": gguf_files["target.gguf"], "bad": bad}
    args = [arg.format(**values) for arg in args]
    backend = [] if "--backend" in args else ["--backend", "native"]
    assert main(["generate", *backend, *args, "-p", "x", "-n", "2", "--spec-type", "none"]) == 2
    assert message in capsys.readouterr().err


def test_export_refuses_what_it_cannot_write(gguf_files, tmp_path):
    with pytest.raises(SpecdecodeError, match="unknown GGUF type"):
        export_gguf(gguf_files["target"], tmp_path / "x.gguf", "q3_k")
    with pytest.raises(SpecdecodeError, match="model directory not found"):
        export_gguf(tmp_path / "missing", tmp_path / "x.gguf")
