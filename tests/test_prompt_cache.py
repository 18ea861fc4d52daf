"""A prompt found in the target's cache gives the bits a fresh context gives it.

A pipeline reuses the cached prefix of its next prompt. On every backend the output of the
same prompt again, and of a longer prompt sharing the cached one's prefix, must equal a fresh
pipeline's, and so must the logits of the first generated token, bit for bit. llama.cpp rounds
a row by the shape of its pass (Q8_0 included, in this prompt's pass of 130 rows), so its last
token re-scored alone on a cache hit came out different, and so did transformers' in float32
(by about 1e-5); the native backend's rows are invariant by construction, and the check holds
it to that.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from specdecode import GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.hf import LoadOptions
from specdecode.backends.load import load_backend

PROMPT = [(7 * i + 3) % 200 + 5 for i in range(130)]  # past llama.cpp's switch of kernels
LONGER = [*PROMPT, *(3 * i % 50 + 60 for i in range(25))]
GREEDY, SHORT = SamplingParams(temperature=0), GenerationConfig(n_predict=8, ignore_eos=True)


class FirstLogits:
    """Records the logits each generation's first token was chosen from: the first rows a
    target's `evaluate` returns after `start()` (the prompt's last pass)."""

    def __init__(self, target, monkeypatch: pytest.MonkeyPatch) -> None:
        self.rows: list[torch.Tensor] = []
        self.evaluated = 0  # prompt tokens evaluated since start()
        self._waiting = False
        evaluate = target.evaluate

        def recording(ids, logits_rows=None):
            logits = evaluate(ids, logits_rows)
            if self._waiting:
                self.evaluated += len(ids)
                if len(logits):
                    self.rows.append(logits[-1].clone())
                    self._waiting = False
            return logits

        monkeypatch.setattr(target, "evaluate", recording)

    def start(self) -> None:
        self._waiting, self.evaluated = True, 0


def fresh(load, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """The tokens and first logits of `prompt` in a pipeline of its own."""
    target = load()
    with pytest.MonkeyPatch.context() as patch:
        first = FirstLogits(target, patch)
        first.start()
        tokens = Pipeline(target, spec_types=[]).generate(prompt, GREEDY, SHORT).tokens
    return tokens, first.rows[0]


def check_cached_prompts(load, monkeypatch, exactness_log, name: str, dtype: str) -> list[int]:
    """PROMPT twice, then LONGER, in one pipeline, against fresh pipelines; returns the prompt
    tokens each cached run evaluated."""
    target = load()
    first = FirstLogits(target, monkeypatch)
    pipeline = Pipeline(target, spec_types=[])
    evaluated = []
    for prompt in (PROMPT, PROMPT, LONGER):
        first.start()
        result = pipeline.generate(prompt, GREEDY, SHORT)
        tokens, logits = fresh(load, prompt)
        assert result.tokens == tokens
        assert torch.equal(first.rows[-1], logits)
        evaluated.append(first.evaluated)
        exactness_log.record(f"prompt-cache/{name}", "none", result.stats, result.stats.stop_reason, dtype)
    return evaluated


@pytest.fixture(scope="module")
def llama_targets(gguf_files, tmp_path_factory) -> dict[str, Path]:
    """The target as GGUF files for llama.cpp, by type (Q4_K written by llama.cpp's quantizer)."""
    pytest.importorskip("llama_cpp")
    from specdecode.backends.gguf_files import export_gguf

    q4_k = tmp_path_factory.mktemp("gguf-q4_k") / "target-q4_k.gguf"
    return {
        "f32": gguf_files["target.gguf"],
        "q8_0": gguf_files["target-q8_0.gguf"],
        "q4_k": export_gguf(gguf_files["target"], q4_k, "q4_k"),
    }


@pytest.mark.parametrize("fmt", ["f32", "q8_0", "q4_k"])
@pytest.mark.parametrize("n_batch", [512, 32])
def test_llama_cpp_gives_a_cached_prompt_a_fresh_runs_bits(
    llama_targets, monkeypatch, exactness_log, fmt, n_batch
):
    path = llama_targets[fmt]
    options = LoadOptions(backend="llama.cpp", threads=1, n_ctx=256, n_batch=n_batch)
    evaluated = check_cached_prompts(
        lambda: load_backend(path, options), monkeypatch, exactness_log, f"llama.cpp-{n_batch}", fmt
    )
    # Whole chunks of a cached prompt are kept: only its last, partial one is scored again.
    assert evaluated == ([130, 130, 155] if n_batch == 512 else [130, 2, 27])


@pytest.mark.parametrize("n_batch", [512, 32])
def test_transformers_gives_a_cached_prompt_a_fresh_runs_bits(
    gguf_files, monkeypatch, exactness_log, n_batch
):
    options = LoadOptions(backend="hf", threads=1, n_ctx=256, n_batch=n_batch, dtype="float32")
    evaluated = check_cached_prompts(
        lambda: load_backend(gguf_files["target"], options),
        monkeypatch,
        exactness_log,
        f"hf-{n_batch}",
        "float32",
    )
    assert evaluated == ([130, 130, 155] if n_batch == 512 else [130, 2, 27])


def test_the_native_backend_gives_a_cached_prompt_a_fresh_runs_bits(gguf_files, monkeypatch, exactness_log):
    options = LoadOptions(backend="native", threads=1, n_ctx=256)
    evaluated = check_cached_prompts(
        lambda: load_backend(gguf_files["target"], options), monkeypatch, exactness_log, "native", "float32"
    )
    assert evaluated == [130, 1, 25]  # every cached prompt token is kept
