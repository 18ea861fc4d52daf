"""TextAssembler: streaming detokenization with byte-level BPE and stop strings."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdecode.backends.hf import HFBackend
from specdecode.testing import make_llama, make_tokenizer
from specdecode.text import TextAssembler

SAMPLES = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "héllo wörld, naïve café — ça va?",
    "emoji: 😀👍🏽 and a family 👨‍👩‍👧 done",
    "日本語のテキスト and 中文 mixed",
    "  leading spaces\tand\ttabs\n\n",
    "ελληνικά κείμενα",
    "€",
    "😀",
]


@pytest.fixture(scope="module")
def backend() -> HFBackend:
    tokenizer = make_tokenizer(vocab_size=300)
    model = make_llama(len(tokenizer), hidden=16, layers=1, heads=2, kv_heads=1)
    return HFBackend(model, tokenizer, n_ctx=64)


def stream(backend, ids, stop=()):
    """Push ids one by one as the generation loop does (it stops pushing once a stop string
    is found); return the assembler and the deltas, finish() last."""
    assembler = TextAssembler(backend, stop)
    deltas = []
    for token in ids:
        deltas.append(assembler.push(token))
        if assembler.stopped:
            break
    deltas.append(assembler.finish())
    return assembler, deltas


def single_char_ids(backend, text: str) -> list[int]:
    """One token per character (ASCII only): the byte-level alphabet has every byte."""
    ids = []
    for char in text:
        encoded = backend.tokenize(char, add_special=False)
        assert len(encoded) == 1, char
        ids.append(encoded[0])
    return ids


# --------------------------------------------------------------------------- detokenization


@pytest.mark.parametrize("text", SAMPLES)
def test_streaming_reproduces_detokenize(backend, text):
    ids = backend.tokenize(text)  # with <|bos|>, which decodes to nothing
    assembler, deltas = stream(backend, ids)
    assert "".join(deltas) == backend.detokenize(ids) == text
    assert assembler.text == text
    assert not assembler.stopped


@pytest.mark.parametrize("text", SAMPLES[1:4])
def test_multibyte_characters_split_across_tokens_are_never_shown_half_done(backend, text):
    ids = backend.tokenize(text, add_special=False)
    assert len(ids) > len(text.encode("utf-8")) // 4  # mostly byte tokens: characters are split
    assert any("\ufffd" in backend.detokenize([t]) for t in ids), "expected split characters"
    _, deltas = stream(backend, ids)
    shown = ""
    for delta in deltas:
        assert "\ufffd" not in delta
        shown += delta
        assert text.startswith(shown)
    assert shown == text


def test_each_delta_is_released_as_soon_as_the_character_is_complete(backend):
    text = "a😀b"
    ids = backend.tokenize(text, add_special=False)
    assert len(ids) == 6  # a, four bytes of the emoji, b
    _, deltas = stream(backend, ids)
    assert deltas == ["a", "", "", "", "😀", "b", ""]


def test_special_tokens_decode_to_nothing(backend):
    eos = backend.vocab.eos_id
    ids = [*backend.tokenize("ab", add_special=False), eos, *backend.tokenize("c", add_special=False)]
    _, deltas = stream(backend, ids)
    assert "".join(deltas) == backend.detokenize(ids) == "abc"


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(
        alphabet=st.characters(blacklist_categories=("Cs",), blacklist_characters="\ufffd"), max_size=30
    )
)
def test_streaming_reproduces_detokenize_property(backend, text):
    ids = backend.tokenize(text, add_special=False)
    _, deltas = stream(backend, ids)
    assert "".join(deltas) == backend.detokenize(ids)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(ids=st.lists(st.integers(3, 299), max_size=25))
def test_streaming_arbitrary_complete_token_sequences(backend, ids):
    """Random model output (any byte tokens, possibly invalid UTF-8): once the text ends in a
    complete character, the stream equals detokenize of all ids."""
    ids = [*ids, *backend.tokenize("x", add_special=False)]
    _, deltas = stream(backend, ids)
    assert "".join(deltas) == backend.detokenize(ids)


def test_literal_replacement_character_at_the_end_is_not_lost(backend):
    """U+FFFD that the text really contains (bytes EF BF BD) is a complete character: it must
    come out, not be held back forever as if it were a partial one."""
    text = "a\ufffd"
    ids = backend.tokenize(text, add_special=False)
    assert backend.detokenize(ids) == text
    assembler, deltas = stream(backend, ids)
    assert "".join(deltas) == text
    assert assembler.text == text


# --------------------------------------------------------------------------- stop strings


@pytest.mark.parametrize(
    ("text", "stop", "expected"),
    [
        ("hello STOP world", ["STOP"], "hello "),
        ("hello world", ["STOP"], "hello world"),
        ("STOP at once", ["STOP"], ""),
        ("ends with STOP", ["STOP"], "ends with "),
        ("two stops: b then a", ["a", "b"], "two stops: "),  # the earliest occurrence wins
        ("hello world", ["world", "lo w"], "hel"),
        ("ababc", ["abc"], "ab"),
        ("one\n\ntwo", ["\n\n"], "one"),
        ("café 😀 bar", ["😀"], "café "),
        ("naïve", ["ïv"], "na"),
        ("ignore empty", ["", "empty"], "ignore "),
    ],
)
def test_stop_strings_cut_the_text(backend, text, stop, expected):
    ids = backend.tokenize(text, add_special=False)
    assembler, deltas = stream(backend, ids, stop)
    assert assembler.text == expected
    assert "".join(deltas) == expected
    assert assembler.stopped == (expected != text)


def test_stopped_is_set_by_the_token_that_completes_the_stop(backend):
    ids = single_char_ids(backend, "xx STOP yy")
    assembler = TextAssembler(backend, ["STOP"])
    for i, token in enumerate(ids):
        assembler.push(token)
        assert assembler.stopped == (i >= 6), i
        if assembler.stopped:
            break
    assert i == 6
    assert assembler.text == "xx "


def test_partial_stop_prefix_is_held_back_until_resolved(backend):
    ids = single_char_ids(backend, "ab STx STOP")
    assembler = TextAssembler(backend, ["STOP"])
    deltas = [assembler.push(token) for token in ids[:8]]
    # "a" "b" " " shown at once; "S", "ST" held; "x" resolves: "STx" released; " " shown;
    # "S" held again; "T" held
    assert deltas == ["a", "b", " ", "", "", "STx", " ", ""]
    assert assembler.push(ids[8]) == ""  # "ST" held
    assert assembler.push(ids[9]) == ""  # "STO" held
    assert not assembler.stopped
    assert assembler.push(ids[10]) == ""  # "STOP": cut, nothing of it is shown
    assert assembler.stopped
    assert assembler.finish() == ""
    assert assembler.text == "ab STx "


def test_held_prefix_is_released_by_finish(backend):
    ids = single_char_ids(backend, "abc ST")
    assembler, deltas = stream(backend, ids, ["STOP"])
    assert deltas[:-1] == ["a", "b", "c", " ", "", ""]
    assert deltas[-1] == "ST"
    assert not assembler.stopped
    assert assembler.text == "abc ST"


def test_stop_string_across_multibyte_tokens_is_held_back(backend):
    # the stop begins with a character that arrives in byte pieces
    ids = backend.tokenize("x€y€Z", add_special=False)
    assembler, deltas = stream(backend, ids, ["€Z"])
    assert "".join(deltas) == "x€y"
    assert assembler.stopped
    assert all("\ufffd" not in d for d in deltas)


def test_overlapping_stop_prefixes_hold_back_the_longest(backend):
    ids = single_char_ids(backend, "xaab")
    assembler = TextAssembler(backend, ["aab", "ab"])
    assert assembler.push(ids[0]) == "x"
    assert assembler.push(ids[1]) == ""  # "a" could begin either stop
    assert assembler.push(ids[2]) == ""  # "aa" could begin "aab"
    assert assembler.push(ids[3]) == ""  # "aab" found at 1 (and "ab" at 2): cut at 1
    assert assembler.stopped
    assert assembler.text == "x"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    text=st.text(alphabet="abST ", max_size=20),
    stop=st.text(alphabet="abST", min_size=1, max_size=4),
)
def test_stop_string_streaming_property(backend, text, stop):
    """One token per character: after every push, the text shown is exactly the text so far
    minus its longest tail that could still become the stop string; in the end, the text is
    cut before the first occurrence of the stop."""
    ids = single_char_ids(backend, text)
    assembler = TextAssembler(backend, [stop])
    shown = ""
    for i, token in enumerate(ids):
        shown += assembler.push(token)
        so_far = text[: i + 1]
        found = so_far.find(stop)
        if found >= 0:
            assert assembler.stopped
            assert shown == so_far[:found]
            break
        assert not assembler.stopped
        held = max((n for n in range(1, len(stop)) if so_far.endswith(stop[:n])), default=0)
        assert shown == so_far[: len(so_far) - held]
    shown += assembler.finish()
    found = text.find(stop)
    assert shown == (text if found < 0 else text[:found])
    assert assembler.text == shown


@pytest.fixture(scope="module")
def split_backend() -> HFBackend:
    """A tokenizer with a token that is an ASCII letter plus the first byte of a two-byte
    character ("x" + 0xC3), as real byte-level vocabularies have."""
    tokenizer = make_tokenizer(vocab_size=264, text="xé xè xê " * 300, add_bos=False)
    model = make_llama(len(tokenizer), hidden=16, layers=1, heads=2, kv_heads=1)
    return HFBackend(model, tokenizer, n_ctx=64)


def test_token_mixing_complete_and_partial_characters(split_backend):
    ids = split_backend.tokenize("axéb", add_special=False)
    x_partial = ids[1]
    assert split_backend.detokenize([x_partial]) == "x\ufffd"
    _, deltas = stream(split_backend, ids)
    assert deltas == ["a", "", "xé", "b", ""]


def test_generation_ending_inside_a_character_keeps_the_complete_text(split_backend):
    """Generation can end (n_predict, EOS) right after a token that holds a complete "x" and
    half of "é". The "x" is complete text: finish() must not drop it; the stream should give
    what detokenize gives for the same ids."""
    ids = split_backend.tokenize("axé", add_special=False)[:2]  # "a", "x" + 0xC3
    assert split_backend.detokenize(ids) == "ax\ufffd"
    _, deltas = stream(split_backend, ids)
    assert "x" in "".join(deltas)
    assert "".join(deltas) == split_backend.detokenize(ids)
