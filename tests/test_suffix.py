"""The suffix strategy: its lookup (longest match, frequencies, limits), its process-wide store
(learning, eviction, files), and generation with it equal to plain generation, alone, in a batch
and in parallel threads; under rejection verification its tree drafts keep the target's
distribution."""

from __future__ import annotations

import threading
from collections import Counter

import numpy as np
import pytest
from conftest import TargetSpec, chi_square_pvalue, cpu_policy

from specdecode import GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.cli import build_parser
from specdecode.cli.settings import ngram_from_args
from specdecode.config import SuffixConfig, parse_spec_types
from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError
from specdecode.server.metrics import Metrics
from specdecode.strategies import NgramSettings, SharedState
from specdecode.strategies.ngram_cache import save as save_ngram_cache
from specdecode.strategies.suffix import (
    BYTES_PER_TOKEN,
    KEY,
    LocalIndex,
    SuffixStore,
    SuffixStrategy,
    key_hash,
    window_hashes,
    write_requests,
)
from specdecode.testing import make_llama, make_tokenizer

GREEDY = SamplingParams(temperature=0)
SEEDED = SamplingParams(temperature=0.8, seed=5)
WIDE = SuffixConfig(factor=8.0)  # drafts the whole tree the examples below hold


def drafted(strategy: SuffixStrategy, context: list[int], n_max: int = 16) -> Draft:
    strategy.begin(context[:-1])
    return strategy.draft(context[:-1], context[-1], n_max)


# --------------------------------------------------------------------------- lookup


def test_hashes_agree_between_python_and_numpy():
    tokens = np.array([0, 7, 151935, 3, 2**31 - 1, 5], dtype=np.int32)
    assert window_hashes(tokens).tolist() == [key_hash(tokens[i : i + KEY].tolist()) for i in range(4)]


def test_continuations_are_ranked_by_frequency():
    """(5, 6, 7) went on with 8 twice and 9 once: 8 first, then 9, each with what followed."""
    context = [5, 6, 7, 8, 1, 5, 6, 7, 9, 2, 5, 6, 7, 8, 1, 4, 5, 6, 7]
    draft = drafted(SuffixStrategy(WIDE), context)
    roots = [token for token, parent in zip(draft.tokens, draft.parent_list(), strict=True) if parent < 0]
    assert roots == [8, 9]
    assert draft.tokens[:3] == [8, 1, 9]  # best first: 8 then 1 (2/3 of the paths) before 9 (1/3)
    assert draft.first_branch().tokens[:3] == [8, 1, 5]
    # a 1/3 continuation is dropped at min_prob 0.5, an even split (after 8, 1: 5 or 4) is not
    strict = drafted(SuffixStrategy(SuffixConfig(factor=8.0, min_prob=0.5)), context)
    assert strict.tokens[:4] == [8, 1, 5, 4] and strict.parents[:4] == [-1, 0, 1, 1]
    assert 9 not in strict.tokens[:8]


def test_the_longest_matching_suffix_decides():
    """(2, 5, 6, 7) matches four tokens back at one occurrence, three at the others: only the
    longest match's continuation is drafted."""
    context = [1, 5, 6, 7, 8, 8, 3, 2, 5, 6, 7, 9, 9, 3, 1, 5, 6, 7, 8, 8, 3, 2, 5, 6, 7]
    draft = drafted(SuffixStrategy(WIDE), context)
    assert draft.is_chain and draft.tokens[:3] == [9, 9, 3]


def test_draft_size_follows_match_length_depth_and_node_limits():
    pattern = list(range(10, 40))
    context = [*pattern, 1, *pattern[:12]]  # matches 12 tokens back
    assert len(drafted(SuffixStrategy(SuffixConfig()), context).tokens) == 12  # factor 1 x 12
    assert len(drafted(SuffixStrategy(SuffixConfig(factor=0.5)), context).tokens) == 6
    assert len(drafted(SuffixStrategy(SuffixConfig(max_depth=4, factor=8.0)), context).tokens) == 4
    assert len(drafted(SuffixStrategy(SuffixConfig(max_nodes=5, factor=8.0)), context).tokens) == 5
    assert len(drafted(SuffixStrategy(SuffixConfig(factor=8.0)), context, n_max=3).tokens) == 3
    assert drafted(SuffixStrategy(SuffixConfig()), [*pattern, 1, 10, 11]).tokens == []  # under KEY


def test_local_index_follows_a_growing_history_and_a_new_one():
    index = LocalIndex()
    index.reset([1, 2, 3, 4])
    index.sync([1, 2, 3, 4, 5], 1)
    assert index.tokens == [1, 2, 3, 4, 5, 1]
    index.sync([1, 2, 3, 4, 5], 1)  # the same step asked again
    assert index.tokens == [1, 2, 3, 4, 5, 1]
    index.sync([1, 2, 3, 4, 5, 1], 2)
    assert index.ends[key_hash([5, 1, 2])] == [7] and index.ends[key_hash([1, 2, 3])] == [3]
    assert sum(map(len, index.ends.values())) == len(index.tokens) - KEY + 1  # each window once
    index.sync([9, 2, 3], 4)  # another history: rebuilt
    assert index.tokens == [9, 2, 3, 4]
    assert index.ends == {key_hash([9, 2, 3]): [3], key_hash([2, 3, 4]): [4]}


def test_first_branch_follows_first_children():
    tree = Draft([8, 9, 1, 2, 3], parents=[-1, -1, 0, 1, 2])
    assert tree.first_branch() == Draft([8, 1, 3])
    assert Draft([4, 5]).first_branch() == Draft([4, 5])


# --------------------------------------------------------------------------- the process-wide store


def test_the_store_learns_a_finished_output_and_drafts_it_for_the_next_request():
    store = SuffixStore(SuffixConfig())
    first = SuffixStrategy(SuffixConfig(), store)
    first.begin([1, 2, 3])
    first.draft([1, 2, 3], 40, 8)
    first.draft([1, 2, 3, 40, 41, 42], 43, 8)
    assert store.n_requests == 0  # learnt at the end only
    first.end()
    assert store.n_requests == 1 and store.n_tokens == 7
    second = SuffixStrategy(SuffixConfig(), store)
    assert drafted(second, [9, 2, 3, 40]).tokens == [41, 42, 43]  # lead-in (2, 3) from the prompt


def test_the_store_evicts_its_oldest_requests_past_its_cap():
    config = SuffixConfig(cache_mb=100 * BYTES_PER_TOKEN / 2**20)  # 100 tokens
    store = SuffixStore(config)
    requests = [list(range(100 + 30 * i, 130 + 30 * i)) for i in range(5)]
    for request in requests[:3]:
        store.learn(request)
    assert store.n_requests == 3 and store.n_tokens == 90
    store.learn(requests[3])  # 120 > 100: down to 90% of the cap, newest kept
    assert store.n_requests == 3 and store.n_tokens == 90
    assert drafted(SuffixStrategy(config, store), requests[0][:4]).tokens == []  # evicted
    assert drafted(SuffixStrategy(config, store), requests[3][:4]).tokens == requests[3][4:8]
    store.learn(list(range(500, 700)))  # larger than the cap: nothing of it kept
    assert store.n_tokens <= 100
    assert store.nbytes < 10_000
    disabled = SuffixStore(SuffixConfig(cache_mb=0))
    disabled.learn([1, 2, 3, 4])
    assert disabled.n_requests == 0


def test_the_store_merges_its_tail_into_the_main_index_and_keeps_finding_everything(monkeypatch):
    monkeypatch.setattr("specdecode.strategies.suffix.TAIL_MIN", 50)
    store = SuffixStore(SuffixConfig())
    requests = [[7, 8, 9, 1000 + i, 2000 + i] for i in range(60)]
    for request in requests:
        store.learn(request)
    main, tail = store.snapshot.main, store.snapshot.tail
    assert len(main.ends) > 0 and len(tail.ends) < len(main.ends)
    config = SuffixConfig(factor=40.0, min_prob=0.0, max_nodes=100)
    draft = drafted(SuffixStrategy(config, store), [7, 8, 9])
    roots = {token for token, parent in zip(draft.tokens, draft.parent_list(), strict=True) if parent < 0}
    assert roots == {1000 + i for i in range(60)}


def test_the_store_file_round_trips(tmp_path):
    path = tmp_path / "suffix.bin"
    store = SuffixStore(SuffixConfig(), path, vocab_size=320)
    store.learn([5, 6, 7, 8, 9])
    store.learn([10, 11, 12])
    again = SuffixStore(SuffixConfig(), path, vocab_size=320)
    assert again.lengths == [5, 3] and again.n_tokens == 8
    assert drafted(SuffixStrategy(SuffixConfig(), again), [1, 5, 6, 7]).tokens == [8, 9]
    # loaded past a smaller cap: the oldest go
    small = SuffixStore(SuffixConfig(cache_mb=4 * BYTES_PER_TOKEN / 2**20), path, vocab_size=320)
    assert small.lengths == [3]


def test_foreign_corrupt_and_other_vocabulary_files_are_refused_unchanged(tmp_path):
    path = tmp_path / "suffix.bin"
    SuffixStore(SuffixConfig(), path, vocab_size=320).learn([5, 6, 7, 8, 9])
    good = path.read_bytes()
    cases = {
        "not a specdecode suffix file": b"hello",
        "header is cut short": good[:24],
        "bytes after the magic": good[:-2],
        "version": good[:18] + b"\x07" + good[19:],
        "do not add up": good[:42] + np.array([4], dtype="<i8").tobytes() + good[50:],
    }
    for message, data in cases.items():
        path.write_bytes(data)
        with pytest.raises(SpecdecodeError, match=message):
            SuffixStore(SuffixConfig(), path, vocab_size=320)
        assert path.read_bytes() == data
    path.write_bytes(good)
    with pytest.raises(SpecdecodeError, match="vocabulary of 320 ids, the target has 151936"):
        SuffixStore(SuffixConfig(), path, vocab_size=151936)
    path.write_bytes(good[:-4] + np.array([400], dtype="<i4").tobytes())
    with pytest.raises(SpecdecodeError, match="outside the target's vocabulary"):
        SuffixStore(SuffixConfig(), path, vocab_size=320)
    ngram_cache = tmp_path / "lookup.bin"
    save_ngram_cache({(1, 2): {3: 1}}, ngram_cache)
    with pytest.raises(SpecdecodeError, match="not a specdecode suffix file"):
        SharedState(NgramSettings(suffix_file=ngram_cache), ["suffix"], 320)
    with pytest.raises(SpecdecodeError, match="cannot read suffix file"):
        SuffixStore(SuffixConfig(), tmp_path)


def test_request_lengths_that_add_up_only_past_64_bits_are_refused_unchanged(tmp_path):
    path = tmp_path / "suffix.bin"
    write_requests(path, [np.array([5]), np.array([6]), np.array([7]), np.array([8, 9])], 320)
    good = path.read_bytes()
    assert good[42:74] == np.array([1, 1, 1, 2], dtype="<i8").tobytes()
    wrapped = np.array([2**62, 2**62, 2**62, 2**62 + 5], dtype="<i8")  # their int64 sum is 5
    assert int(wrapped.sum()) == 5
    data = good[:42] + wrapped.tobytes() + good[74:]
    path.write_bytes(data)
    with pytest.raises(SpecdecodeError, match="request lengths do not add up"):
        SuffixStore(SuffixConfig(), path, vocab_size=320)
    assert path.read_bytes() == data


def test_negative_ids_in_a_file_are_refused(tmp_path):
    path = tmp_path / "suffix.bin"
    SuffixStore(SuffixConfig(), path, vocab_size=320).learn([5, 6, 7, 8, 9])
    path.write_bytes(path.read_bytes()[:-4] + np.array([-3], dtype="<i4").tobytes())
    with pytest.raises(SpecdecodeError, match="outside the target's vocabulary"):
        SuffixStore(SuffixConfig(), path, vocab_size=320)


def test_metrics_report_the_store():
    store = SuffixStore(SuffixConfig())
    store.learn([1, 2, 3, 4])
    text = Metrics(["suffix"]).render(1, 0, 0, suffix=store)
    assert "specdecode_suffix_cache_tokens 4" in text
    assert "specdecode_suffix_cache_requests 1" in text
    assert f"specdecode_suffix_cache_bytes {store.nbytes}" in text


# --------------------------------------------------------------------------- settings


def test_flags_parse_into_the_settings(tmp_path):
    argv = ["generate", "-m", "x", "--spec-type", "suffix,ngram-mod", "--spec-suffix-max-depth", "8"]
    argv += ["--spec-suffix-factor", "2", "--spec-suffix-min-prob", "0.2", "--spec-suffix-max-nodes", "9"]
    argv += ["--spec-suffix-cache-mb", "16", "--spec-suffix-file", str(tmp_path / "s.bin")]
    args = build_parser().parse_args(argv)
    settings = ngram_from_args(args)
    assert settings.suffix == SuffixConfig(max_depth=8, factor=2.0, min_prob=0.2, max_nodes=9, cache_mb=16.0)
    assert settings.suffix_file == tmp_path / "s.bin"
    assert parse_spec_types("suffix,ngram-mod,draft-simple") == ["ngram-mod", "suffix", "draft"]
    for bad in ({"max_depth": 0}, {"factor": 0.0}, {"min_prob": 1.5}, {"max_nodes": 0}, {"cache_mb": -1}):
        with pytest.raises(SpecdecodeError, match="--spec-suffix-"):
            SuffixConfig(**bad)


# --------------------------------------------------------------------------- generation

PROMPT = [5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6]


@pytest.mark.parametrize("policy", ["classic", "adaptive"])
@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_generation_with_suffix_equals_plain(zoo, exactness_log, sampling, policy, steady_clock):
    """Several requests through one pipeline (the store learns each), every answer the plain one;
    the suffix strategy drafts and gets tokens accepted."""
    spec = TargetSpec(seed=2, hidden=32, layers=2, eos_tie=False)
    target, _ = zoo.pair(spec, 0.02)
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    models = cpu_policy() if policy == "adaptive" else None
    pipeline = Pipeline(target, spec_types=["suffix"], spec_policy=policy, policy_models=models)
    drafted_tokens = accepted = 0
    for prompt in (PROMPT, PROMPT[2:], [3, *PROMPT], PROMPT):
        expected = Pipeline(target).generate(prompt, sampling, config)
        result = pipeline.generate(prompt, sampling, config)
        assert result.tokens == expected.tokens
        drafted_tokens += result.stats.totals.n_drafted
        accepted += result.stats.totals.n_accepted
        exactness_log.record(f"suffix/{policy}", "suffix", result.stats)
    assert pipeline.shared.suffix is not None and pipeline.shared.suffix.n_requests == 4
    assert drafted_tokens > 0 and accepted > 0


def test_suffix_chained_with_ngram_and_draft_is_exact(zoo, exactness_log):
    spec = TargetSpec(seed=2, hidden=32, layers=2, eos_tie=False)
    target, draft = zoo.pair(spec, 0.02)
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    expected = Pipeline(target).generate(PROMPT, GREEDY, config)
    pipeline = Pipeline(target, draft, spec_types=["draft", "suffix", "ngram-mod"])
    result = pipeline.generate(PROMPT, GREEDY, config)
    assert result.tokens == expected.tokens
    assert [s.name for s in result.stats.strategies] == ["ngram-mod", "suffix", "draft"]
    exactness_log.record("suffix/chain", "ngram-mod,suffix,draft", result.stats)


def test_parallel_threads_share_the_store_without_cross_talk(zoo, exactness_log):
    """Forks of one pipeline (the server's slots) generate at once; each answer is its solo one."""
    spec = TargetSpec(seed=2, hidden=32, layers=2, eos_tie=False)
    target, _ = zoo.pair(spec, 0.02)
    config = GenerationConfig(n_predict=32, ignore_eos=True)
    prompts = [PROMPT, PROMPT[1:], [9, 8, 7, *PROMPT], [4, 4, 5, 6, 7, 8]]
    solo = [Pipeline(target).generate(p, SEEDED, config).tokens for p in prompts]
    front = Pipeline(target, spec_types=["suffix"])
    results: dict[int, object] = {}

    def run(index: int) -> None:
        results[index] = front.fork().generate(prompts[index], SEEDED, config)

    for _ in range(2):  # the second round drafts from what the first taught the store
        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        for index, expected in enumerate(solo):
            assert results[index].tokens == expected
            exactness_log.record("suffix/threads", "suffix", results[index].stats)
    assert front.shared.suffix.n_requests == 2 * len(prompts)


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_batched_sequences_share_the_store_without_cross_talk(zoo, exactness_log, sampling):
    """generate_batch: the sequences draft from their own contexts and the shared store (which
    learns each one that finishes), and each answer is its solo one."""
    spec = TargetSpec(seed=2, hidden=32, layers=2, eos_tie=False)
    target, _ = zoo.pair(spec, 0.02)
    config = GenerationConfig(n_predict=32, ignore_eos=True)
    prompts = [PROMPT, PROMPT[1:], [9, 8, 7, *PROMPT], PROMPT[3:], [4, 4, 5, 6, 7, 8], PROMPT]
    solo = [Pipeline(target).generate(p, sampling, config).tokens for p in prompts]
    pipeline = Pipeline(target, spec_types=["suffix"])
    results = pipeline.generate_batch(prompts, sampling, config, max_sequences=3, load_rule=False)
    for result, expected in zip(results, solo, strict=True):
        assert result.tokens == expected
        exactness_log.record("suffix/batch", "suffix", result.stats)
    assert sum(result.stats.totals.n_accepted for result in results) > 0
    assert pipeline.shared.suffix.n_requests == len(prompts)


def test_rejection_with_suffix_trees_matches_target_distribution(exactness_log):
    """verify="rejection" at temperature 1: the store learns every earlier sample, so later
    requests draft trees of what earlier ones sampled; over 1500 seeds the first three tokens
    follow the target's exact joint distribution (chi-square, alpha 0.001)."""
    from test_distribution import ALPHA, e2e_params, exact_joint

    tokenizer = make_tokenizer(vocab_size=270)
    target = make_llama(len(tokenizer), hidden=16, layers=1, heads=2, kv_heads=1, init_std=0.3, seed=0)
    pipeline = Pipeline(HFBackend(target, tokenizer, n_ctx=64), spec_types=["suffix"])
    prompt = pipeline.encode("def f(x):")
    config = GenerationConfig(n_predict=4, verify="rejection")
    counts: Counter = Counter()
    trees = drafted_tokens = 0
    strategy = SuffixStrategy(SuffixConfig(), pipeline.shared.suffix)
    seeds = 1500
    for seed in range(seeds):
        result = pipeline.generate(prompt, e2e_params(seed), config)
        counts[tuple(result.tokens[:3])] += 1
        drafted_tokens += result.stats.totals.n_drafted
        if seed % 100 == 99:  # what the next request's second step would be offered
            trees += not drafted(strategy, [*prompt, *result.tokens[:1]]).is_chain
    joint = exact_joint(target, tokenizer, prompt, 3, e2e_params())
    assert chi_square_pvalue(counts, joint) > ALPHA
    assert drafted_tokens > seeds and trees > 0
    exactness_log.record_distribution("suffix trees, end to end", seeds)
