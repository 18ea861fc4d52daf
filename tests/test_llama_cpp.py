"""The llama.cpp backend: a GGUF file on llama.cpp's kernels through llama-cpp-python's C API.

- The GGUF's own vocabulary gives the Hugging Face tokenizer's ids, text and facts.
- Passes: logits close to the native float32 forward; rollback; tree rows equal to passes over
  their paths, committed paths equal to a linear evaluation of them.
- Exactness on the same backend: speculative output equals plain output (greedy and seeded
  `match`) for a draft model's chain and tree and for an n-gram pool.
- The commands pick it for GGUF files (`auto`) or when asked; bad input exits with 2.
"""

from __future__ import annotations

import json

import pytest
import torch

from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.hf import LoadOptions
from specdecode.backends.llama_cpp import MAX_SEQUENCES, LlamaCppBackend
from specdecode.backends.load import load_backend
from specdecode.cli import main
from specdecode.errors import SpecdecodeError
from specdecode.strategies import NgramModConfig, NgramSettings
from specdecode.strategies.base import path_to

llama_cpp = pytest.importorskip("llama_cpp")

TEXT = "def wrap(text, width=70):\n    <|eos|> return [line for line in text]"
PROMPT = list(range(5, 17)) * 3
LLAMA = LoadOptions(backend="llama.cpp", threads=1, n_ctx=256)


def backend(gguf_files, role: str = "target", fmt: str = "") -> LlamaCppBackend:
    return load_backend(gguf_files[f"{role}{fmt}.gguf"], LLAMA)


def test_the_ggufs_vocabulary_is_the_tokenizers(gguf_files):
    ours, theirs = backend(gguf_files), load_backend(gguf_files["target"], LoadOptions(dtype="float32"))
    assert isinstance(ours, LlamaCppBackend)
    assert ours.vocab == theirs.vocab
    for add_special in (True, False):
        assert ours.tokenize(TEXT, add_special) == theirs.tokenize(TEXT, add_special)
    ids = theirs.tokenize(TEXT)
    for skip in (True, False):
        assert ours.detokenize(ids, skip) == theirs.detokenize(ids, skip)
    assert [ours.token_text(i) for i in range(0, 320, 7)] == [theirs.token_text(i) for i in range(0, 320, 7)]


def test_logits_are_close_to_the_native_forward_and_roll_back(gguf_files):
    ours, theirs = backend(gguf_files), load_backend(gguf_files["target"], LoadOptions(dtype="float32"))
    expected = theirs.evaluate(PROMPT)
    got = ours.evaluate(PROMPT)
    assert got.shape == expected.shape
    # llama.cpp keeps its KV cache in float16 by default, and these tiny sharp models amplify
    # it: the same choices, logits within 2% of their range.
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert torch.allclose(got, expected, atol=2e-2 * expected.abs().max().item(), rtol=0)
    ours.truncate(len(PROMPT) - 3)
    assert ours.tokens == PROMPT[:-3]
    again = ours.evaluate(PROMPT[-3:])
    assert torch.equal(again, got[-3:])


@pytest.mark.parametrize(
    "parents, tokens, first",
    [
        ([-1, 0, 1, 2], [40, 41, 42, 43], 4),  # a chain
        ([-1, -1, 0, 0, 1, 2, 5], [40, 50, 41, 51, 60, 42, 43], 3),  # branches, two passes
        ([-1, 0, 0, 1, 1, 2, 2], [40, 41, 42, 43, 44, 45, 46], 1),
    ],
)
def test_tree_rows_equal_passes_over_their_paths(gguf_files, parents, tokens, first):
    ours = backend(gguf_files)
    ours.evaluate(PROMPT)
    rows = torch.cat(
        [ours.evaluate_tree(tokens[:first], parents[:first])]
        + ([ours.evaluate_tree(tokens[first:], parents[first:])] if first < len(tokens) else [])
    )
    assert ours.tokens == PROMPT
    linear = backend(gguf_files)
    for node in range(len(tokens)):
        linear.truncate(0)
        linear.evaluate(PROMPT)
        path = path_to(parents, node)
        row = linear.evaluate([tokens[step] for step in path])[-1]
        assert torch.allclose(rows[node], row, atol=1e-4 * row.abs().max().item(), rtol=0), node
    path = path_to(parents, len(tokens) - 1)
    ours.commit(path)
    assert ours.tokens == PROMPT + [tokens[n] for n in path]
    linear.truncate(len(PROMPT))
    linear.evaluate([tokens[n] for n in path])
    got, expected = ours.evaluate([7, 8]), linear.evaluate([7, 8])
    # The path's keys and values came from passes of other shapes (float16 cache): to rounding.
    assert torch.allclose(got, expected, atol=1e-3 * expected.abs().max().item(), rtol=0)


def test_trees_past_the_sequences_are_refused(gguf_files):
    ours = backend(gguf_files)
    ours.evaluate(PROMPT)
    with pytest.raises(SpecdecodeError, match="does not fit"):
        ours.evaluate_tree(list(range(3, 3 + MAX_SEQUENCES)), [-1] * MAX_SEQUENCES)


def test_q8_0_rows_are_batch_invariant_and_a_committed_tree_is_plain_history(gguf_files):
    """Q8_0 quantizes each activation row alone, so llama.cpp gives a row the same bits in any
    pass; a committed tree path is then exactly what plain generation would have cached."""
    ours, linear = backend(gguf_files, fmt="-q8_0"), backend(gguf_files, fmt="-q8_0")
    together = ours.evaluate(PROMPT)
    alone = torch.cat([linear.evaluate([token]) for token in PROMPT])
    assert torch.equal(together, alone)
    ours.evaluate_tree([40, 50, 41, 42], [-1, -1, 0, 2])
    ours.evaluate_tree([43, 51], [3, 1])
    ours.commit([0, 2, 3, 4])
    assert ours.tokens == [*PROMPT, 40, 41, 42, 43]
    for token in (40, 41, 42, 43):
        linear.evaluate([token])
    assert torch.equal(ours.evaluate([7, 8]), torch.cat([linear.evaluate([7]), linear.evaluate([8])]))


STRATEGIES = {
    "draft": (["draft"], DraftModelConfig()),
    "draft-tree": (["draft"], DraftModelConfig(n_max=6, p_min=0.0, p_split=0.05, n_parallel=3)),
    "ngram-mod": (["ngram-mod"], DraftModelConfig()),
}


@pytest.mark.parametrize("fmt", ["", "-q8_0"])
@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculation_on_llama_cpp_equals_plain(gguf_files, exactness_log, name, temperature, fmt):
    spec_types, draft_config = STRATEGIES[name]
    sampling = SamplingParams(temperature=temperature, seed=5)
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    expected = Pipeline(backend(gguf_files, fmt=fmt), spec_types=[]).generate(PROMPT, sampling, config)
    pipeline = Pipeline(
        backend(gguf_files, fmt=fmt),
        backend(gguf_files, "draft", fmt),
        spec_types=spec_types,
        draft_config=draft_config,
        ngram=NgramSettings(mod=NgramModConfig(1, 1, 8)),
    )
    result = pipeline.generate(PROMPT, sampling, config)
    assert result.tokens == expected.tokens
    assert result.stats.totals.n_drafted > 0 or temperature > 0
    mode = "greedy" if temperature == 0 else "match"
    exactness_log.record(
        f"gguf-llama.cpp/{name}-{mode}", name, result.stats, result.stats.stop_reason, fmt[1:] or "f32"
    )


def test_a_fork_shares_the_weights_and_not_the_cache(gguf_files):
    ours = backend(gguf_files)
    expected = ours.evaluate(PROMPT)
    fork = ours.fork()
    assert fork.model is ours.model and fork.tokens == []
    assert torch.equal(fork.evaluate(PROMPT), expected)
    assert ours.tokens == PROMPT


def test_generate_picks_llama_cpp_for_gguf_files(gguf_files, capsys):
    runs = {}
    for spec in ("none", "draft"):
        args = [
            "generate",
            "-m",
            str(gguf_files["target.gguf"]),
            "-md",
            str(gguf_files["draft.gguf"]),
            "-t",
            "1",
        ]
        args += ["--spec-type", spec, "--temp", "0", "-n", "24", "--ignore-eos", "-p", "def wrap(", "--json"]
        assert main(args) == 0
        runs[spec] = json.loads(capsys.readouterr().out)
    assert runs["draft"]["tokens"] == runs["none"]["tokens"]
    assert runs["draft"]["stats"]["totals"]["n_drafted"] > 0


def test_llama_cpp_refuses_what_it_cannot_run(gguf_files, tmp_path, capsys):
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    assert main(["generate", "--backend", "llama.cpp", "-m", str(bad), "-p", "x", "-n", "2"]) == 2
    assert "llama.cpp cannot load" in capsys.readouterr().err
    if not llama_cpp.llama_supports_gpu_offload():  # a CPU build
        assert (
            main(["generate", "-m", str(gguf_files["target.gguf"]), "-ngl", "4", "-p", "x", "-n", "2"]) == 2
        )
        assert "no GPU" in capsys.readouterr().err
    assert (
        main(["generate", "-m", str(gguf_files["target.gguf"]), "--dtype", "float64", "-p", "x", "-n", "2"])
        == 2
    )
    assert "file's own weight types" in capsys.readouterr().err


def test_serve_answers_from_gguf_files(gguf_files):
    """The server's slots fork the backend; its text routes use the file's own vocabulary."""
    from fastapi.testclient import TestClient

    from specdecode.server import ServerSettings, create_app

    pipeline = Pipeline(backend(gguf_files), backend(gguf_files, "draft"), spec_types=["draft"])
    plain = Pipeline(backend(gguf_files), spec_types=[]).generate(
        "def wrap(", SamplingParams(temperature=0), GenerationConfig(n_predict=12)
    )
    with TestClient(create_app(pipeline, ServerSettings(model_id="gguf", parallel=2))) as client:
        body = {"prompt": "def wrap(", "max_tokens": 12, "temperature": 0}
        answer = client.post("/v1/completions", json=body)
        assert answer.status_code == 200, answer.text[:300]
        assert answer.json()["choices"][0]["text"] == plain.text
        tokens = client.post("/tokenize", json={"content": TEXT}).json()["tokens"]
        assert tokens == backend(gguf_files).tokenize(TEXT, add_special=False)


def test_bench_runs_every_system_on_gguf_files(gguf_files, tmp_path, capsys):
    out = tmp_path / "results"
    argv = ["bench", "--quick", "-m", str(gguf_files["target.gguf"]), "-md", str(gguf_files["draft.gguf"])]
    assert main([*argv, "-n", "12", "-t", "1", "--no-plots", "--tasks", "completion", "--out", str(out)]) == 0
    results = json.loads((out / "results.json").read_text())
    assert not any(name.startswith("hf-") for name in results["systems"])  # transformers' generate: no
    assert {"plain", "draft", "ngram-mod", "draft-tree"} <= set(results["systems"])
    assert all(row["exact_match_rate"] == 1.0 for row in results["rows"])
    assert main([*argv, "--systems", "plain,hf-plain", "--out", str(out)]) == 2
    assert "needs models in PyTorch" in capsys.readouterr().err
