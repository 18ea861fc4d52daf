"""Vocabulary compatibility (llama.cpp's rules) and translation through text (--spec-replace)."""

from __future__ import annotations

import pytest
from conftest import OTHER_VOCAB_SIZE, VOCAB_SIZE, TargetSpec, cached_tokenizer, eagle3_head, eagle3_target
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from specdecode import (
    DraftModelConfig,
    GenerationConfig,
    HFBackend,
    Pipeline,
    SamplingParams,
    SpecdecodeError,
)
from specdecode.strategies.draft_model import DraftModelStrategy
from specdecode.testing import make_llama, make_tokenizer
from specdecode.vocab import FIRST_CHECKED_ID, MAX_SIZE_DIFFERENCE, VocabTranslator, vocab_difference

GREEDY = SamplingParams(temperature=0)
SPEC = TargetSpec(seed=0, hidden=32, layers=2)
TAB = [("    ", "\t")]


def first_differing_id(a, b) -> int:
    ta = a.convert_ids_to_tokens(list(range(len(a))))
    tb = b.convert_ids_to_tokens(list(range(len(b))))
    return next(i for i in range(FIRST_CHECKED_ID, min(len(ta), len(tb))) if ta[i] != tb[i])


@pytest.fixture(scope="module")
def target_model(zoo):
    return zoo.target(SPEC)


@pytest.fixture(scope="module")
def other_model(other_tokenizer):
    """A draft for `other_tokenizer` (different text, 384 ids)."""
    return make_llama(len(other_tokenizer), hidden=16, layers=1, init_std=0.5, seed=21)


@pytest.fixture(scope="module")
def same_size_other_model(other_text_tokenizer):
    return make_llama(len(other_text_tokenizer), hidden=16, layers=1, init_std=0.5, seed=22)


# --------------------------------------------------------------------------- vocab_difference


def test_identical_vocabularies(zoo, target_model, tokenizer):
    draft = zoo.backend(zoo.draft(SPEC, 0.1), tokenizer)
    assert vocab_difference(zoo.backend(target_model), draft) is None
    # a separately trained tokenizer on the same text is the same vocabulary
    assert vocab_difference(zoo.backend(target_model), zoo.backend(target_model, make_tokenizer())) is None


def test_same_size_different_text_names_the_first_differing_token(
    zoo, target_model, tokenizer, other_text_tokenizer, same_size_other_model
):
    target = zoo.backend(target_model)
    draft = HFBackend(same_size_other_model, other_text_tokenizer)
    difference = vocab_difference(target, draft)
    first = first_differing_id(tokenizer, other_text_tokenizer)
    assert difference is not None
    assert difference.startswith(f"token {first} differs")
    assert repr(target.token_text(first)) in difference and repr(draft.token_text(first)) in difference


def test_size_difference_over_the_limit(zoo, target_model, tokenizer):
    size = VOCAB_SIZE + MAX_SIZE_DIFFERENCE + 1
    big = HFBackend(make_llama(size, hidden=16, layers=1, seed=3), make_tokenizer(vocab_size=size))
    difference = vocab_difference(zoo.backend(target_model), big)
    assert difference is not None
    assert "sizes differ by 129" in difference and str(VOCAB_SIZE) in difference and str(size) in difference
    # either way round
    assert "sizes differ by 129" in vocab_difference(big, zoo.backend(target_model))


def test_padded_vocabulary_within_the_limit_is_compatible(zoo, target_model, tokenizer):
    """Same tokenizer, model vocabulary padded by exactly the allowed 128 rows."""
    padded = HFBackend(make_llama(VOCAB_SIZE + MAX_SIZE_DIFFERENCE, hidden=16, layers=1, seed=3), tokenizer)
    assert padded.vocab.size == VOCAB_SIZE + MAX_SIZE_DIFFERENCE
    assert vocab_difference(zoo.backend(target_model), padded) is None


def test_bos_flag_difference(zoo, target_model, no_bos_tokenizer):
    difference = vocab_difference(zoo.backend(target_model), zoo.backend(target_model, no_bos_tokenizer))
    assert difference is not None and difference.startswith("BOS differs")
    assert "add=True" in difference and "add=False" in difference


def test_eos_flag_difference(zoo, target_model):
    adds_eos = make_tokenizer()
    adds_eos.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="<|bos|> $A <|eos|>", special_tokens=[("<|bos|>", 0), ("<|eos|>", 1)]
    )
    draft = zoo.backend(target_model, adds_eos)
    assert draft.vocab.add_eos
    difference = vocab_difference(zoo.backend(target_model), draft)
    assert difference is not None and difference.startswith("EOS differs")


def test_vocabulary_type_difference(zoo, target_model):
    vocab = {"<|bos|>": 0, "<|eos|>": 1, "<|pad|>": 2, "[UNK]": 3} | {f"w{i}": i + 4 for i in range(316)}
    word_level = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    word_level.pre_tokenizer = pre_tokenizers.Whitespace()
    word_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=word_level, bos_token="<|bos|>", eos_token="<|eos|>", pad_token="<|pad|>"
    )
    draft = zoo.backend(target_model, word_tokenizer)
    assert draft.vocab.kind == "word"
    difference = vocab_difference(zoo.backend(target_model), draft)
    assert difference == "vocabulary types differ: target bpe, draft word"


# --------------------------------------------------------------------------- Pipeline refuses or translates


def test_incompatible_draft_is_refused_with_a_hint(zoo, target_model, other_tokenizer, other_model):
    with pytest.raises(SpecdecodeError, match="--spec-replace") as info:
        Pipeline(zoo.backend(target_model), HFBackend(other_model, other_tokenizer))
    assert "token " in str(info.value) and "differs" in str(info.value)


def test_compatible_draft_needs_no_translator(zoo, target_model):
    pipe = Pipeline(zoo.backend(target_model), zoo.backend(zoo.draft(SPEC, 0.1)), replacements=TAB)
    assert pipe.translator is None


def _draft_backend(
    kind: str,
    zoo,
    no_bos_tokenizer,
    other_tokenizer,
    other_model,
    other_text_tokenizer,
    same_size_other_model,
) -> HFBackend:
    if kind == "no-bos-identical":
        return HFBackend(zoo.draft(SPEC, 0.0), no_bos_tokenizer)
    if kind == "no-bos-perturbed":
        return HFBackend(zoo.draft(SPEC, 0.02), no_bos_tokenizer)
    if kind == "other-text-384":
        return HFBackend(other_model, other_tokenizer)
    return HFBackend(same_size_other_model, other_text_tokenizer)


TRANSLATED_KINDS = ("no-bos-identical", "no-bos-perturbed", "other-text-384", "other-text-320")


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    kind=st.sampled_from(TRANSLATED_KINDS),
    prompt=st.one_of(
        st.lists(st.integers(3, VOCAB_SIZE - 1), min_size=1, max_size=30),
        st.text(alphabet="abcdef _():=\n0123é", min_size=1, max_size=40).map(lambda s: "    " + s),
    ),
    n_max=st.integers(1, 12),
    p_min=st.sampled_from([0.0, 0.75]),
    replacements=st.sampled_from([[], TAB, [("    ", "\t"), ("e", "é")]]),
    temperature=st.sampled_from([0.0, 0.0, 0.8]),
    n_predict=st.integers(1, 24),
)
def test_translated_draft_output_equals_plain(
    zoo,
    exactness_log,
    target_model,
    no_bos_tokenizer,
    other_tokenizer,
    other_model,
    other_text_tokenizer,
    same_size_other_model,
    kind,
    prompt,
    n_max,
    p_min,
    replacements,
    temperature,
    n_predict,
):
    draft = _draft_backend(
        kind, zoo, no_bos_tokenizer, other_tokenizer, other_model, other_text_tokenizer, same_size_other_model
    )
    sampling = SamplingParams(temperature=temperature, seed=99)
    config = GenerationConfig(n_predict=n_predict, ignore_eos=True)
    expected = Pipeline(zoo.backend(target_model)).generate(prompt, sampling, config)
    pipe = Pipeline(
        zoo.backend(target_model),
        draft,
        draft_config=DraftModelConfig(n_max=n_max, p_min=p_min),
        replacements=replacements,
    )
    assert pipe.translator is not None
    result = pipe.generate(prompt, sampling, config)
    assert result.tokens == expected.tokens
    assert result.text == expected.text
    assert result.stats.stop_reason == expected.stats.stop_reason
    exactness_log.record("translated", kind, result.stats)


def test_translation_with_an_identical_model_gets_drafts_accepted(zoo, no_bos_tokenizer):
    """Not vacuous: through text, a draft that is the target's twin gets some drafts accepted.

    Few, with random weights: the target emits byte pieces and non-canonical splits that
    text does not carry over (the draft then sees other ids), so the test sums over runs.
    """
    config = GenerationConfig(n_predict=40, ignore_eos=True)
    accepted = 0
    for seed in range(3):
        spec = TargetSpec(seed=seed, hidden=32, layers=2)
        draft = HFBackend(zoo.draft(spec, 0.0), no_bos_tokenizer)
        pipe = Pipeline(
            zoo.backend(zoo.target(spec)),
            draft,
            draft_config=DraftModelConfig(n_max=4, p_min=0.0),
            replacements=[],
        )
        for prompt in ("def indent(text, prefix):\n    return", "hello world", list(range(40, 60))):
            expected = Pipeline(zoo.backend(zoo.target(spec))).generate(prompt, GREEDY, config)
            result = pipe.generate(prompt, GREEDY, config)
            assert result.tokens == expected.tokens
            accepted += result.stats.totals.n_accepted
    assert accepted > 0


def test_translation_with_a_draft_of_smaller_context(zoo, target_model, other_tokenizer, other_model):
    draft = HFBackend(other_model, other_tokenizer, n_ctx=12)
    pipe = Pipeline(
        zoo.backend(target_model), draft, draft_config=DraftModelConfig(n_max=8, p_min=0.0), replacements=TAB
    )
    prompt = "def dedent(text):\n    lines = text.split('\\n')\n    return lines"
    config = GenerationConfig(n_predict=30, ignore_eos=True)
    expected = Pipeline(zoo.backend(target_model)).generate(prompt, GREEDY, config)
    assert pipe.generate(prompt, GREEDY, config).tokens == expected.tokens
    assert len(draft.tokens) <= 12


TRANSLATED_CHAINS = (
    ["draft"],
    ["ngram-map-k", "draft"],
    ["draft", "eagle3"],
    ["ngram-map-k", "draft", "eagle3"],
)


# Pinned: translated ids can shrink as the text grows (tokens merge); with a draft context of a
# few tokens the window then started at the end of the ids, and the draft model was asked to
# evaluate nothing (AssertionError: need at least one token).
@example(
    types=["ngram-map-k", "draft", "eagle3"],
    bos=True,
    prompt="ff_:a2\nb__)",
    draft_n_ctx=3,
    n_max=1,
    p_min=0.75,
    temperature=0.0,
    n_predict=26,
    ignore_eos=False,
)
@settings(max_examples=24, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    types=st.sampled_from(TRANSLATED_CHAINS),
    bos=st.booleans(),
    prompt=st.one_of(
        st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=20),
        st.text(alphabet="abcdef _():=\n0123é", min_size=1, max_size=40),
    ),
    draft_n_ctx=st.sampled_from([2, 3, 4, 8, 8, 16]),
    n_max=st.integers(1, 16),
    p_min=st.sampled_from([0.0, 0.75]),
    temperature=st.sampled_from([0.0, 0.0, 1.7]),
    n_predict=st.integers(4, 30),
    ignore_eos=st.booleans(),
)
def test_translated_draft_with_a_small_context_in_chains_equals_plain(
    exactness_log,
    other_model,
    types,
    bos,
    prompt,
    draft_n_ctx,
    n_max,
    p_min,
    temperature,
    n_predict,
    ignore_eos,
):
    """A draft of another vocabulary with a context of a few tokens (-cd), alone and in chains
    with n-grams and EAGLE-3, top-k 3 and a stop string: it never fails, output is plain output."""
    draft_tokenizer = cached_tokenizer(OTHER_VOCAB_SIZE, "difflib", add_bos=bos)
    sampling = SamplingParams(temperature=temperature, top_k=3, seed=5)
    config = GenerationConfig(n_predict=n_predict, stop=("e",), ignore_eos=ignore_eos)
    target, tokenizer = eagle3_target(), cached_tokenizer()
    expected = Pipeline(HFBackend(target, tokenizer)).generate(prompt, sampling, config)
    draft = HFBackend(other_model, draft_tokenizer, n_ctx=draft_n_ctx)
    pipe = Pipeline(
        HFBackend(target, tokenizer),
        draft,
        eagle3=eagle3_head(),
        spec_types=types,
        draft_config=DraftModelConfig(n_max=n_max, p_min=p_min),
        replacements=TAB,
    )
    assert pipe.translator is not None
    result = pipe.generate(prompt, sampling, config)
    assert result.tokens == expected.tokens
    assert result.text == expected.text
    assert result.stats.stop_reason == expected.stats.stop_reason
    assert all(s.n_failed == 0 for s in result.stats.strategies)
    assert len(draft.tokens) <= draft_n_ctx
    exactness_log.record("translated/small-context", ",".join(types), result.stats, result.stats.stop_reason)


def test_a_context_that_translates_to_nothing_gets_no_draft(zoo, target_model, other_model):
    """Special tokens alone are no text: a draft without BOS has nothing to continue."""
    draft = HFBackend(other_model, cached_tokenizer(OTHER_VOCAB_SIZE, "difflib", add_bos=False))
    translator = VocabTranslator(zoo.backend(target_model), draft, TAB)
    strategy = DraftModelStrategy(
        draft, DraftModelConfig(p_min=0.0), target_vocab_size=VOCAB_SIZE, translator=translator
    )
    assert translator.to_draft([0, 1, 2]) == []
    assert strategy.draft([0, 1], 2, 8).tokens == []
    assert draft.tokens == []


# --------------------------------------------------------------------------- VocabTranslator


texts = st.text(alphabet=st.characters(exclude_characters="\t<§", exclude_categories=("Cs",)), max_size=60)
indented = st.lists(
    st.sampled_from(["    ", "        ", "def f(x):", "\n", " ", "return x", "é", "🙂"]), max_size=12
)


@settings(max_examples=60, deadline=None)
@given(
    text=st.one_of(texts, indented.map("".join)),
    bos_draft=st.booleans(),
    replacements=st.sampled_from([[], TAB, [("    ", "\t"), ("self", "§")]]),
)
def test_translator_round_trip(
    zoo, target_model, other_tokenizer, other_model, text, bos_draft, replacements
):
    target = zoo.backend(target_model)
    draft_tokenizer = (
        other_tokenizer if bos_draft else cached_tokenizer(OTHER_VOCAB_SIZE, "difflib", add_bos=False)
    )
    draft = HFBackend(other_model, draft_tokenizer)
    translator = VocabTranslator(target, draft, replacements)

    draft_text = text
    for old, new in replacements:
        draft_text = draft_text.replace(old, new)

    to_draft = translator.to_draft(target.tokenize(text))
    if bos_draft:
        assert to_draft[0] == draft.vocab.bos_id
        to_draft = to_draft[1:]
    assert to_draft == draft.tokenize(draft_text, add_special=False)
    assert draft.detokenize(to_draft) == draft_text

    back = translator.to_target(to_draft)
    assert back == target.tokenize(text, add_special=False)
    assert target.detokenize(back) == text


def test_translator_specifics(zoo, target_model, other_tokenizer, other_model):
    target = zoo.backend(target_model)
    draft = HFBackend(other_model, other_tokenizer)
    translator = VocabTranslator(target, draft, TAB)
    assert translator.to_target([]) == []
    # special tokens are dropped on the way to the draft; the draft's own BOS is put first
    assert translator.to_draft([0, 1, 2]) == [0]
    ids = translator.to_draft(target.tokenize("if x:\n    y"))
    assert draft.detokenize(ids) == "if x:\n\ty"
    assert target.detokenize(translator.to_target(draft.tokenize("\tz", add_special=False))) == "    z"
