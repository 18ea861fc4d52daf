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

from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams
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
    # At least whole chunks of a cached prompt are kept: only its last, partial one is scored
    # again. Where the probe finds two classes of passes (Q8_0 on llama.cpp's CPU flash
    # attention, one thread: below and from 64 rows), more: all but the 64 rows that score the
    # rest of a prompt of wide passes again in one wide pass, everything of narrow ones.
    whole = [130, 130, 155] if n_batch == 512 else [130, 2, 27]
    assert all(ours <= chunks for ours, chunks in zip(evaluated, whole, strict=True))
    if fmt == "q8_0":
        assert evaluated == ([130, 64, 64] if n_batch == 512 else [130, 1, 25])


def test_llama_cpp_keeps_cached_positions_only_from_passes_of_a_fresh_runs_class(gguf_files, monkeypatch):
    """A prompt that runs on past a cached prompt into its generated tokens: a fresh run scores
    all of it in one wide pass, and the generated tokens were scored in one-row passes, so only
    the cached prompt's positions are kept, and the logits are a fresh run's."""
    options = LoadOptions(backend="llama.cpp", threads=1, n_ctx=256)
    load = lambda: load_backend(gguf_files["target-q8_0.gguf"], options)  # noqa: E731
    target = load()
    first = FirstLogits(target, monkeypatch)
    pipeline = Pipeline(target, spec_types=[])
    generated = pipeline.generate(PROMPT, GREEDY, SHORT).tokens
    longer = [*PROMPT, *generated, *(3 * i % 50 + 60 for i in range(60))]  # past 64 rows after PROMPT
    first.start()
    tokens = pipeline.generate(longer, GREEDY, SHORT).tokens
    assert first.evaluated == len(longer) - len(PROMPT)
    expected_tokens, expected_logits = fresh(load, longer)
    assert tokens == expected_tokens and torch.equal(first.rows[-1], expected_logits)


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


def test_transformers_keeps_only_chunks_a_fresh_run_scores_after_rollbacks(gguf_files, monkeypatch):
    """Verify passes of `n_batch` rows that start after a rollback are not a fresh run's chunks:
    a longer prompt keeps only cached positions last scored in a chunk a fresh run scores (one
    of n_batch rows from a multiple of n_batch), and gets a fresh run's logits bit for bit."""
    options = LoadOptions(backend="hf", threads=1, n_ctx=256, n_batch=4, dtype="float32")
    target = load_backend(gguf_files["target"], options)
    draft = load_backend(gguf_files["draft"], options)
    scored_in: dict[int, tuple[int, int]] = {}  # position -> (start, rows) of the pass that last scored it
    forward = target._forward

    def recording(ids, keep):
        start = len(target.tokens)
        scored_in.update({start + i: (start, len(ids)) for i in range(len(ids))})
        return forward(ids, keep)

    monkeypatch.setattr(target, "_forward", recording)
    first = FirstLogits(target, monkeypatch)
    chains = DraftModelConfig(n_max=3, p_min=0.0)  # verify passes of n_batch rows, from anywhere
    pipeline = Pipeline(target, draft, spec_types=["draft"], draft_config=chains)
    config = GenerationConfig(n_predict=48, ignore_eos=True)
    prompt = PROMPT[:20]
    generated = pipeline.generate(prompt, GREEDY, config).tokens
    assert pipeline.generate(prompt, GREEDY, config).tokens == generated
    longer = [*prompt, *generated[:-1], *LONGER[-5:]]
    first.start()
    tokens = pipeline.generate(longer, GREEDY, SHORT).tokens
    kept = len(longer) - first.evaluated
    assert kept >= len(prompt)
    assert [scored_in[p] for p in range(kept)] == [(p // 4 * 4, 4) for p in range(kept)]
    expected_tokens, expected_logits = fresh(lambda: load_backend(gguf_files["target"], options), longer)
    assert tokens == expected_tokens and torch.equal(first.rows[-1], expected_logits)
