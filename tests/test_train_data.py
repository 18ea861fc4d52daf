"""The corpus selection, the held-out split and the tokenizer: reproducible wherever Python is."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from specdecode.errors import SpecdecodeError
from specdecode.testing import make_tokenizer, sample_text
from specdecode.train.corpus import corpus_files, encode_files, split_files, stdlib_root
from specdecode.train.tokenizer import build_tokenizer, train_tokenizer

SAMPLES = ["def f(x):\n    return x + 1\n", "class A:\n    pass\n", "print('héllo')  # ünïcode\n"]


def _write(path: Path, content: str | bytes) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    (path.write_bytes if isinstance(content, bytes) else path.write_text)(content)


@pytest.fixture
def tree(tmp_path: Path) -> Path:
    root = tmp_path / "lib"
    for relative in ("b.py", "a.py", "pkg/z.py", "pkg/sub/m.py", "Pkg/c.py"):
        _write(root / relative, f"# {relative}\nx = 1\n")
    for excluded in ("tests/t.py", "pkg/test/t.py", "idlelib/idle_test/t.py", "site-packages/s.py"):
        _write(root / excluded, "x = 1\n")
    _write(root / "__pycache__/p.py", "x = 1\n")
    _write(root / "latin1.py", b"# caf\xe9\n")
    _write(root / "big.py", "x = 1\n" * 200_000)  # 1.2 MB
    _write(root / "notes.txt", "not python\n")
    return root


def test_corpus_files_selects_and_sorts(tree: Path) -> None:
    files = corpus_files(tree)
    assert [f.relative_to(tree).as_posix() for f in files] == [
        "Pkg/c.py",
        "a.py",
        "b.py",
        "pkg/sub/m.py",
        "pkg/z.py",
    ]


@pytest.mark.parametrize("make", [lambda p: p / "missing", lambda p: p])
def test_corpus_files_empty_root(tmp_path: Path, make) -> None:
    with pytest.raises(SpecdecodeError, match="no Python files under"):
        corpus_files(make(tmp_path))


def test_split_follows_the_sha1_rule(tmp_path: Path) -> None:
    names = [f"mod{i}/file{i}.py" for i in range(200)]
    files = [tmp_path / name for name in names]
    expected = {n for n in names if int(hashlib.sha1(n.encode()).hexdigest(), 16) % 20 == 0}
    train, heldout = split_files(files, tmp_path)
    assert {f.relative_to(tmp_path).as_posix() for f in heldout} == expected
    assert 0 < len(expected) < 40
    assert sorted(train + heldout) == sorted(files)
    assert split_files(files, tmp_path) == (train, heldout)


def test_real_stdlib_corpus() -> None:
    root = stdlib_root()
    files = corpus_files(root)
    heldout = split_files(files, root)[1]
    assert len(files) > 500
    assert 0.02 < len(heldout) / len(files) < 0.10
    parts = {part for f in files for part in f.relative_to(root).parts}
    assert not parts & {"site-packages", "test", "tests", "idle_test", "__pycache__"}
    assert corpus_files(root) == files


def test_build_tokenizer_special_tokens_and_bos() -> None:
    ours = build_tokenizer([sample_text()], 320)
    assert len(ours) == 320
    for text in SAMPLES:
        assert ours.decode(ours(text)["input_ids"], skip_special_tokens=True) == text
    assert ours(SAMPLES[0])["input_ids"][0] == 0
    assert build_tokenizer([sample_text()], 320, add_bos=False)(SAMPLES[0])["input_ids"][0] != 0
    assert [ours.bos_token_id, ours.eos_token_id, ours.pad_token_id] == [0, 1, 2]


def test_train_tokenizer_saves_a_loadable_tokenizer(tree: Path, tmp_path: Path) -> None:
    out = train_tokenizer(tmp_path / "tok", vocab_size=512, files=corpus_files(tree))
    loaded = AutoTokenizer.from_pretrained(out, local_files_only=True)
    assert (out / "tokenizer.json").is_file()
    for text in [*SAMPLES, sample_text()[:2000]]:
        ids = loaded(text)["input_ids"]
        assert ids[0] == loaded.bos_token_id == 0
        assert loaded.decode(ids, skip_special_tokens=True) == text


@pytest.mark.parametrize("size", [511, 65537])
def test_train_tokenizer_vocab_size_range(tmp_path: Path, size: int) -> None:
    with pytest.raises(SpecdecodeError, match="vocab_size"):
        train_tokenizer(tmp_path, vocab_size=size, files=[])


def test_encode_files_separates_files(tree: Path) -> None:
    tokenizer = make_tokenizer(320)
    files = corpus_files(tree)[:3]
    stream = encode_files(tokenizer, files)
    expected: list[int] = []
    for path in files:
        expected += [*tokenizer(path.read_text())["input_ids"], 1]
    assert stream.dtype.name == "int32"
    assert stream.tolist() == expected
    assert stream[0] == 0 and (stream == 1).sum() == 3 and (stream == 0).sum() == 3
