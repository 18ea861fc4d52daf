"""Hostile command lines: each ends with exit status 2 and exactly one `error:` line, no
traceback, and leaves every file as it was (nothing written before a refusal).

One table, run in-process through `specdecode.cli.main`. The models are tiny and saved once;
each case names its files with {placeholders} (see `hostile_files`). Training cases get small
sizes for every setting they do not test, so that a case that is wrongly accepted fails fast.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import BertConfig, BertLMHeadModel

from specdecode.backends.gguf_files import export_gguf
from specdecode.cli import main
from specdecode.strategies.ngram_cache import save
from specdecode.strategies.suffix import write_requests
from specdecode.testing import make_llama, make_tokenizer, perturbed_copy, save_model

CORPUS = "def f(x):\n    return x + 1\n\n\nclass A:\n    pass\n" * 40
SMALL_RUN = ["--steps", "1", "--batch-size", "1", "--seq-len", "8", "--calibration-windows", "0"]
EAGLE3_RUN = [*SMALL_RUN, "--layer-ids", "0,1,2", "--draft-vocab", "64"]


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory) -> dict[str, Path]:
    """Saved models and files, each broken in the one way its cases need."""
    root = tmp_path_factory.mktemp("hostile")
    tokenizer = make_tokenizer(320)
    target = make_llama(len(tokenizer), hidden=16, layers=3, heads=2, kv_heads=1, init_std=0.5, seed=3)
    files = {
        "target": save_model(root / "target", target, tokenizer),
        "draft": save_model(root / "draft", perturbed_copy(target, 0.02), tokenizer),
        # 200 embedding rows for a tokenizer of 320 ids: within llama.cpp's size tolerance (128)
        "narrow": save_model(root / "narrow", make_llama(200, hidden=16, layers=1, seed=4), tokenizer),
        "zero_layers": save_model(root / "zero_layers", make_llama(len(tokenizer), layers=0), tokenizer),
        "victim": save_model(root / "victim", perturbed_copy(target, 0.1), tokenizer),  # an --out
    }
    bert = BertLMHeadModel(
        BertConfig(
            vocab_size=len(tokenizer),
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            max_position_embeddings=64,
        )
    )
    files["bert"] = save_model(root / "bert", bert.eval(), tokenizer)
    files["bad_heads"] = shutil.copytree(files["target"], root / "bad_heads")
    config = json.loads((files["bad_heads"] / "config.json").read_text())
    (files["bad_heads"] / "config.json").write_text(json.dumps({**config, "num_attention_heads": 3}))
    files["corpus"] = root / "corpus.txt"
    files["corpus"].write_text(CORPUS)
    files["empty"] = root / "empty.txt"
    files["empty"].write_text("")
    files["huge"] = root / "huge.txt"
    files["huge"].write_text("x" * 1_000_000)  # 50 times what 512 positions hold: refused untokenized
    files["many_alternatives"] = root / "many.gbnf"
    files["many_alternatives"].write_text("root ::= " + " | ".join(f'"w{i}"' for i in range(2001)) + "\n")
    files["no_text"] = root / "no-text.gbnf"
    files["no_text"].write_text('root ::= root "a"\n')
    files["far_ids"] = root / "far-ids.lcs"
    save({(5, 6): {7: 3, 100_000: 2}}, files["far_ids"])
    files["suffix_overflow"] = root / "overflow.suffix"
    requests = [np.array([5]), np.array([6]), np.array([7]), np.array([8, 9])]
    write_requests(files["suffix_overflow"], requests, 320)
    data = bytearray(files["suffix_overflow"].read_bytes())  # lengths that add up to 5 modulo 2^64
    data[42:74] = np.array([2**62, 2**62, 2**62, 2**62 + 5], dtype="<i8").tobytes()
    files["suffix_overflow"].write_bytes(bytes(data))
    for name, template in (
        ("divides_by_zero", "{{ 1/0 }}"),
        ("range_too_big", "{% for i in range(1000000) %}{% endfor %}x"),
        ("renders_nothing", "{% if false %}x{% endif %}"),
    ):
        files[name] = root / f"{name}.jinja"
        files[name].write_text(template)
    files["gguf"] = export_gguf(files["target"], root / "target.gguf", "f32")
    files["root"] = root
    return files


GENERATE = ["generate", "-m", "{target}", "-p", "x"]
GENERATE_FILE = ["generate", "-m", "{target}", "-f", "{corpus}"]
ONE_PATH = ["-lcd", "{root}/c", "--spec-suffix-file", "{root}/c"]
CHAT = [*GENERATE, "--chat", "--chat-template-file"]
WITH_DRAFT = [*GENERATE, "-md", "{draft}"]
LOOKUP_CREATE = ["lookup", "create", "-m", "{target}"]
TRAIN_TOKENIZER = ["train", "tokenizer", "--out"]
TRAIN = {
    "target": (["train", "target", "--tokenizer", "{target}"], SMALL_RUN),
    "draft": (["train", "draft", "--target", "{target}"], SMALL_RUN),
    "eagle3": (["train", "eagle3", "--target", "{target}"], EAGLE3_RUN),
}
BAD_TRAINING_FLAGS = [
    ("steps-negative", ["--steps", "-1"], "steps"),
    ("lr-negative", ["--lr", "-1"], "lr"),
    ("lr-nan", ["--lr", "nan"], "lr"),
    ("batch-size-zero", ["--batch-size", "0"], "batch_size"),
    ("seq-len-zero", ["--seq-len", "0"], "seq_len"),
    ("precision-bogus", ["--precision", "fp8"], "precision"),
]


def train(kind: str, *flags: str, data: str = "{corpus}", out: str = "{victim}") -> list[str]:
    """A training command line: small sizes, then `flags` (the last of a flag wins)."""
    command, sizes = TRAIN[kind]
    return [*command, "--data", data, "--out", out, *sizes, *flags]


# (id, argv with {placeholders}, a fragment of the one error line)
CASES = [
    # tracebacks before
    ("hidden-not-multiple-of-heads", ["generate", "-m", "{bad_heads}", "-p", "x"], "heads"),
    ("draft-embedding-narrower-than-tokenizer", [*GENERATE, "-md", "{narrow}"], "embedding"),
    ("target-embedding-narrower-than-tokenizer", ["generate", "-m", "{narrow}", "-p", "x"], "embedding"),
    ("threads-negative", [*GENERATE, "-t", "-1"], "-t/--threads"),
    ("draft-threads-negative", [*WITH_DRAFT, "-td", "-1"], "-td/--threads-draft"),
    ("encoder-as-target", ["generate", "-m", "{bert}", "-p", "x"], "cache"),
    ("encoder-as-draft", [*GENERATE, "-md", "{bert}"], "cache"),
    (
        "static-cache-ids-past-the-vocabulary",
        [*GENERATE, "--spec-type", "ngram-cache", "-lcs", "{far_ids}"],
        "100000",
    ),
    ("tokenizer-out-is-a-file", [*TRAIN_TOKENIZER, "{corpus}", "--data", "{corpus}"], "not a directory"),
    # accepted silently before
    ("empty-prompt", ["generate", "-m", "{target}", "-p", ""], "empty"),
    ("empty-prompt-file", ["generate", "-m", "{target}", "-f", "{empty}"], "empty"),
    ("ctx-size-negative", [*GENERATE, "-c", "-5"], "-c/--ctx-size"),
    ("draft-ctx-size-negative", [*WITH_DRAFT, "-cd", "-1"], "-cd/--ctx-size-draft"),
    ("batch-size-zero", [*GENERATE, "-b", "0"], "-b/--batch-size"),
    ("presence-penalty-nan", [*GENERATE, "--presence-penalty", "nan"], "presence_penalty"),
    ("frequency-penalty-inf", [*GENERATE, "--frequency-penalty", "inf"], "frequency_penalty"),
    ("seed-2-to-the-64", [*GENERATE, "--seed", str(2**64)], "seed"),
    ("zero-layers", ["generate", "-m", "{zero_layers}", "-p", "x"], "layers"),
    ("encoder-as-draft-with-spec-type", [*GENERATE, "-md", "{bert}", "--spec-type", "draft"], "cache"),
    ("lookup-create-over-its-corpus", [*LOOKUP_CREATE, "-f", "{corpus}", "-lcs", "{corpus}"], "same file"),
    ("tokenizer-on-an-empty-file", [*TRAIN_TOKENIZER, "{root}/tok", "--data", "{empty}"], "no text"),
    ("grammar-rule-past-the-row-limit", [*GENERATE, "--grammar-file", "{many_alternatives}"], "alternatives"),
    ("grammar-matching-no-text", [*GENERATE, "--grammar-file", "{no_text}"], "no text matches"),
    ("grammar-file-given-inline", [*GENERATE, "--grammar", "{no_text}"], "--grammar-file"),
    ("regex-matching-no-text", [*GENERATE, "--regex", r"[^\x00-\x{{10FFFF}}]"], "no text matches"),
    ("prompt-file-past-the-context", ["generate", "-m", "{target}", "-f", "{huge}"], "so at least"),
    ("chat-template-dividing-by-zero", [*CHAT, "{divides_by_zero}"], "ZeroDivisionError"),
    ("chat-template-range-past-the-sandbox", [*CHAT, "{range_too_big}"], "OverflowError"),
    ("chat-template-rendering-nothing", [*CHAT, "{renders_nothing}"], "empty prompt"),
    (
        "suffix-file-whose-lengths-overflow",
        [*GENERATE, "--spec-type", "suffix", "--spec-suffix-file", "{suffix_overflow}"],
        "do not add up",
    ),
    ("convert-under-a-file", ["convert", "{gguf}", "{corpus}/out"], "is not a directory"),
    # one path for two files: the cache written after the run would overwrite the other
    (
        "dynamic-cache-and-suffix-file-one-path",
        [*GENERATE, "--spec-type", "ngram-cache,suffix", *ONE_PATH],
        "name the same file",
    ),
    (
        "static-and-dynamic-cache-one-path",
        [*GENERATE, "--spec-type", "ngram-cache", "-lcs", "{far_ids}", "-lcd", "{root}/./far-ids.lcs"],
        "name the same file",
    ),
    (
        "bench-suffix-file-over-a-prompt-file",
        ["bench", "-m", "{target}", "-f", "{empty}", "-f", "{corpus}", "--spec-suffix-file", "{corpus}"],
        "same file",
    ),
    (
        "suffix-file-over-the-prompt-file",
        [*GENERATE_FILE, "--spec-type", "suffix", "--spec-suffix-file", "{corpus}"],
        "same file",
    ),
    # flags that would change nothing
    (
        "n-parallel-with-n-grams-only",
        [*GENERATE, "--spec-type", "ngram-simple", "--draft-n-parallel", "2"],
        "--draft-n-parallel",
    ),
    ("n-parallel-without-strategies", [*GENERATE, "--draft-n-parallel", "3"], "--draft-n-parallel"),
    ("tree-tokens-without-eagle3", [*WITH_DRAFT, "--draft-tree-tokens", "8"], "--draft-tree-tokens"),
    ("tree-topk-without-eagle3", [*WITH_DRAFT, "--draft-tree-topk", "4"], "--draft-tree-topk"),
    (
        "suffix-file-without-suffix",
        [*GENERATE, "--spec-suffix-file", "{suffix_overflow}"],
        "not in the chain",
    ),
    (
        "dynamic-cache-without-ngram-cache",
        [*GENERATE, "--spec-type", "suffix", "-lcd", "{root}/d.bin"],
        "not in the chain",
    ),
    # training: refused before anything is written, into a new directory or an existing model's
    *[
        (f"train-{kind}-{name}-into-{into}", train(kind, *flags, out=out), message)
        for kind in TRAIN
        for into, out in (("new", "{root}/new"), ("model", "{victim}"))
        for name, flags, message in BAD_TRAINING_FLAGS
    ],
    ("train-target-empty-corpus", train("target", data="{empty}"), "token"),
    ("train-draft-empty-corpus", train("draft", data="{empty}", out="{root}/new"), "token"),
    ("train-draft-encoder-target", [*train("draft"), "--target", "{bert}"], "cache"),
    ("train-eagle3-encoder-target", [*train("eagle3", out="{root}/new"), "--target", "{bert}"], "cache"),
    ("train-eagle3-layer-ids-out-of-range", train("eagle3", "--layer-ids", "0,1,9"), "layers"),
    ("train-eagle3-layer-ids-not-numbers", train("eagle3", "--layer-ids", "a,b"), "--layer-ids"),
    ("train-eagle3-heads-not-dividing-hidden", train("eagle3", "--heads", "3"), "heads"),
]


def snapshot(root: Path) -> dict[str, str]:
    """Every file and directory under root, with a digest of each file's bytes."""
    return {
        str(path.relative_to(root)): (hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "")
        for path in sorted(root.rglob("*"))
    }


@pytest.mark.parametrize(("argv", "message"), [case[1:] for case in CASES], ids=[case[0] for case in CASES])
def test_hostile_command_line_is_one_error_line_and_changes_nothing(hostile_files, capsys, argv, message):
    names = {name: str(path) for name, path in hostile_files.items()}
    before = snapshot(hostile_files["root"])
    threads = torch.get_num_threads()
    try:
        code = main([arg.format(**names) for arg in argv])
    except SystemExit as exc:  # argparse's own refusals
        code = exc.code
    finally:
        torch.set_num_threads(threads)  # a training case may set its --threads
    err = capsys.readouterr().err
    assert code == 2, err
    error_lines = [line for line in err.splitlines() if "error:" in line]
    assert len(error_lines) == 1 and error_lines[0].startswith("error: "), err
    assert message in error_lines[0]
    assert "Traceback" not in err
    assert snapshot(hostile_files["root"]) == before
