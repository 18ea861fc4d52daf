"""Forks of a llama.cpp backend that share one context (`LlamaCppBackend.forks`): every
sequence's rows in one `llama_decode`, each sequence a KV stream of its own.

- Shared passes give each sequence the logits its own context gives it, bit for bit: on Q8_0
  (rows invariant) in passes of several sequences, on f32 within its row cap (1 in the default
  build: alone), across the 256-cell steps of llama.cpp's attention window and after other
  sequences roll back.
- Rolling one sequence back leaves the others' caches as they were; a group that fails its
  shared pass fails alone (`evaluate_each`).
- A `BatchEngine` over shared forks answers each prompt, greedy and seeded, exactly as the
  prompt alone; token trees become their preferred path. `generate_batch` shares a context.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.batch import RowGroup, evaluate_each, evaluate_groups
from specdecode.backends.gather import DraftPasses
from specdecode.backends.hf import LoadOptions
from specdecode.backends.llama_cpp import LlamaCppBackend, SharedLlamaCppBackend
from specdecode.backends.llama_probe import WIDE_PASSES
from specdecode.backends.load import load_backend
from specdecode.errors import SpecdecodeError
from specdecode.generate import exact_chunk_rows
from specdecode.scheduler import BatchEngine
from specdecode.strategies import NgramModConfig, NgramSettings

pytest.importorskip("llama_cpp")

PROMPTS = [list(range(5, 17)) * 3, list(range(40, 49)), [7, 9, 11, 13] * 5, list(range(60, 90))]
LLAMA = LoadOptions(backend="llama.cpp", threads=1, n_ctx=512)


def loaded(gguf_files, fmt: str = "-q8_0", role: str = "target") -> LlamaCppBackend:
    return load_backend(gguf_files[f"{role}{fmt}.gguf"], LLAMA)


def test_forks_share_one_context_and_each_has_a_solo_forks_room(gguf_files):
    base = loaded(gguf_files)
    forks = base.forks(3)
    assert all(isinstance(fork, SharedLlamaCppBackend) for fork in forks)
    assert len({id(fork.pass_key) for fork in forks}) == 1
    assert [fork.n_ctx for fork in forks] == [base.n_ctx] * 3
    assert not forks[0].takes_trees and getattr(base, "takes_trees", True)
    assert type(base.forks(1)[0]) is LlamaCppBackend
    assert type(forks[0].fork()) is LlamaCppBackend  # a plain fork: a context of its own
    fast = load_backend(
        gguf_files["target.gguf"], LoadOptions(backend="llama.cpp", threads=1, passes="bucketed")
    )
    assert fast.forks(2)[0].max_pass_rows == fast._batch_rows  # exactness given up: one pass for all


def test_with_two_threads_forks_keep_contexts_of_their_own_and_plain_bits(gguf_files):
    """Two threads split the attention of a lone row over 512 cells or more between them: a
    shared context cannot give such a row its second row, so forks are plain forks, and their
    one-row passes there give the bits of a context of its own. Without exactness they share."""
    two = replace(LLAMA, threads=2, n_ctx=1024)
    base = load_backend(gguf_files["target-q8_0.gguf"], two)
    forks, solo = base.forks(2), base.fork()
    assert all(type(fork) is LlamaCppBackend for fork in forks)
    prompt = [5 + (i * 7) % 300 for i in range(600)]
    assert torch.equal(forks[0].evaluate(prompt, logits_rows=1), solo.evaluate(prompt, logits_rows=1))
    for token in range(10, 20):
        assert torch.equal(forks[0].evaluate([token]), solo.evaluate([token]))
    fast = load_backend(gguf_files["target-q8_0.gguf"], replace(two, passes="bucketed"))
    assert all(isinstance(fork, SharedLlamaCppBackend) for fork in fast.forks(2))


@pytest.mark.parametrize("fmt", ["-q8_0", ""])
def test_shared_passes_equal_each_sequences_own_passes(gguf_files, fmt):
    """Chains of 1..5 rows after prompts of different lengths, one past 256 cached positions
    (where llama.cpp widens the attention window of the whole pass), in shared passes; then
    again after the others rolled back: every row as in a context of its own."""
    base = loaded(gguf_files, fmt)
    prompts = [*PROMPTS[:3], list(range(5, 300))]
    forks, alone = base.forks(len(prompts)), [base.fork() for _ in prompts]
    limit = forks[0].max_pass_rows
    assert limit == (max(WIDE_PASSES) if base.row_cap is None else base.row_cap)
    if fmt == "-q8_0":
        assert limit > 1  # Q8_0 rows are invariant in every build: sharing pays
    for fork, solo, prompt in zip(forks, alone, prompts, strict=True):
        assert torch.equal(fork.evaluate(prompt, logits_rows=1), solo.evaluate(prompt, logits_rows=1))
    for round_ in range(3):
        sizes = [min(limit, 1 + (index + round_) % 5) for index in range(len(prompts))]
        ids = [[30 + index + row for row in range(size)] for index, size in enumerate(sizes)]
        shared = evaluate_groups([RowGroup(fork, chain) for fork, chain in zip(forks, ids, strict=True)])
        for fork, solo, chain, logits in zip(forks, alone, ids, shared, strict=True):
            assert torch.equal(logits, solo.evaluate(chain)), (round_, fork._sequence)
            assert fork.tokens == solo.tokens
        # the first and third sequences keep one row, the others all of it
        for index in (0, 2):
            forks[index].truncate(len(forks[index].tokens) - sizes[index] + 1)
            alone[index].truncate(len(alone[index].tokens) - sizes[index] + 1)


def test_rolling_one_sequence_back_leaves_the_others_alone(gguf_files):
    base = loaded(gguf_files)
    forks = base.forks(3)
    for fork, prompt in zip(forks, PROMPTS, strict=False):
        fork.evaluate(prompt)
    forks[1].truncate(0)
    forks[1].evaluate(PROMPTS[3])  # the emptied stream refills while the others keep theirs
    for fork, prompt in zip(forks, [PROMPTS[0], PROMPTS[3], PROMPTS[2]], strict=True):
        solo = base.fork()
        expected = solo.evaluate([*prompt, 3, 4])[-2:]
        assert torch.equal(fork.evaluate([3, 4]), expected)


def test_a_group_that_fails_fails_alone(gguf_files):
    base = loaded(gguf_files)
    forks = base.forks(3)
    for fork, prompt in zip(forks, PROMPTS, strict=False):
        fork.evaluate(prompt)
    full = forks[1]
    full.evaluate([5 + i % 50 for i in range(full.n_ctx - len(full.tokens))])
    before = [list(fork.tokens) for fork in forks]
    groups = [RowGroup(fork, [3, 4]) for fork in forks]
    with pytest.raises(SpecdecodeError, match="context full"):
        forks[0].evaluate_groups(groups)
    assert [fork.tokens for fork in forks] == before  # refused before any cache changed
    results = evaluate_each(groups)
    assert isinstance(results[1], SpecdecodeError)
    for index in (0, 2):
        solo = base.fork()
        expected = solo.evaluate([*PROMPTS[index], 3, 4])[-2:]
        assert torch.equal(results[index], expected)


def test_prompts_longer_than_the_probed_passes_keep_a_solo_runs_chunks(gguf_files):
    """A prompt's chunks shrink (to share passes with running streams) only within the passes
    the probe vouches for: rows of a Q8_0 pass far past the probed sizes once differed from
    the same rows in smaller passes, so a longer prompt is scored in a solo run's chunks."""
    base = loaded(gguf_files)
    assert base.vouched_rows == (max(WIDE_PASSES) if base.row_cap is None else base.row_cap) >= 17
    assert exact_chunk_rows(base, 12) == base.vouched_rows
    assert exact_chunk_rows(base, base.n_batch) == 0
    assert exact_chunk_rows(base.forks(2)[0], base.n_batch) == 0
    fast = load_backend(gguf_files["target-q8_0.gguf"], replace(LLAMA, passes="bucketed"))
    assert fast.vouched_rows is None and exact_chunk_rows(fast, fast.n_batch) == fast.n_batch


def test_shared_forks_refuse_trees_and_hidden_states(gguf_files):
    fork = loaded(gguf_files).forks(2)[0]
    fork.evaluate(PROMPTS[0])
    with pytest.raises(SpecdecodeError, match="chains only"):
        fork.evaluate_tree([3, 4], [-1, -1])
    with pytest.raises(SpecdecodeError, match="hidden states"):
        fork.capture_hidden([1])
    assert fork.tokens == PROMPTS[0]


STRATEGIES = {
    "draft": (["draft"], DraftModelConfig()),
    "draft-tree": (["draft"], DraftModelConfig(n_max=6, p_min=0.0, p_split=0.05, n_parallel=3)),
    "ngram-mod": (["ngram-mod"], DraftModelConfig()),
}
NGRAM = NgramSettings(mod=NgramModConfig(1, 1, 8))


@pytest.mark.parametrize("name", STRATEGIES)
@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("verify", ["match", "rejection"])
def test_a_batch_on_shared_forks_answers_each_prompt_as_alone(
    gguf_files, exactness_log, monkeypatch, name, temperature, verify
):
    if name == "ngram-mod" and verify == "rejection" and temperature > 0:
        pytest.skip(
            "the n-gram pool learns from every sequence of the batch: its drafts, hence the draws, differ"
        )
    spec_types, draft_config = STRATEGIES[name]
    config = GenerationConfig(n_predict=24, ignore_eos=True, verify=verify)
    samplings = [SamplingParams(temperature=temperature, seed=11 + index) for index in range(len(PROMPTS))]
    pipeline = Pipeline(
        loaded(gguf_files),
        loaded(gguf_files, role="draft"),
        spec_types=spec_types,
        draft_config=draft_config,
        ngram=NGRAM,
    )
    passes = DraftPasses()
    seats = pipeline.forks(len(PROMPTS), passes)
    assert all(isinstance(seat.target, SharedLlamaCppBackend) for seat in seats)
    assert isinstance(seats[0].draft.inner, SharedLlamaCppBackend) == (name != "draft-tree")
    engine = BatchEngine(draft_passes=passes)
    shared_passes = []
    scored = SharedLlamaCppBackend.evaluate_groups

    def counted(self, groups):
        shared_passes.append(len(groups))
        return scored(self, groups)

    monkeypatch.setattr(SharedLlamaCppBackend, "evaluate_groups", counted)
    results: dict[int, object] = {}

    def start(seat: Pipeline, index: int):
        return seat.stream(PROMPTS[index], samplings[index], config)

    def done(index: int, entry) -> None:
        assert entry.error is None, entry.error
        results[index] = entry.generation

    engine.run(seats, len(PROMPTS), start, done)
    monkeypatch.undo()
    assert max(shared_passes) == len(PROMPTS)  # every sequence's rows in one llama_decode
    mode = ("greedy" if temperature == 0 else "seeded") + f"-{verify}"
    for index, prompt in enumerate(PROMPTS):
        # the same request alone, on a seat of the same kind
        solo = Pipeline(
            loaded(gguf_files),
            loaded(gguf_files, role="draft"),
            spec_types=spec_types,
            draft_config=draft_config,
            ngram=NGRAM,
        ).forks(2)[0]
        expected = solo.generate(prompt, samplings[index], config)
        got = results[index]
        assert got.tokens == expected.tokens, index
        exactness_log.record(
            f"gguf-llama.cpp-shared/{name}-{mode}", name, got.stats, got.stats.stop_reason, "q8_0"
        )
    if verify == "match":  # a tree's preferred path, verified as a chain, keeps plain output
        plain = Pipeline(loaded(gguf_files), spec_types=[])
        for index, prompt in enumerate(PROMPTS):
            assert results[index].tokens == plain.generate(prompt, samplings[index], config).tokens


def test_generate_batch_on_a_gguf_file_shares_the_context_and_equals_generate(gguf_files, exactness_log):
    pipeline = Pipeline(loaded(gguf_files), spec_types=["ngram-mod"], ngram=NGRAM)
    sampling = SamplingParams(temperature=0)
    config = GenerationConfig(n_predict=16, ignore_eos=True)
    results = pipeline.generate_batch(PROMPTS, sampling, config)
    seats = pipeline._batch[1]
    assert len({id(seat.target.pass_key) for seat in seats}) == 1
    for prompt, result in zip(PROMPTS, results, strict=True):
        alone = Pipeline(loaded(gguf_files), spec_types=["ngram-mod"], ngram=NGRAM)
        assert result.tokens == alone.generate(prompt, sampling, config).tokens
        test = "gguf-llama.cpp-shared/generate_batch-greedy"
        exactness_log.record(test, "ngram-mod", result.stats, result.stats.stop_reason, "q8_0")
