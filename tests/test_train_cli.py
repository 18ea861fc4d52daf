"""`specdecode train tokenizer|target|draft` and `specdecode eval` end to end, on a small corpus.

The shapes are the real presets (a 34M target, a 2.5M draft) run for a handful of steps: this
checks that the commands chain (tokenizer -> target -> draft -> eval), not model quality.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from specdecode.cli import main
from specdecode.testing import sample_text
from specdecode.vocab import vocab_difference

FEW_STEPS = ["--steps", "3", "--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1", "--threads", "2"]


@pytest.mark.slow
def test_train_chain_and_eval(tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    for i in range(40):  # names chosen freely: eval's held-out rule needs some files held out
        (corpus / f"module_{i}.py").write_text(sample_text()[i * 400 : i * 400 + 3000])
    tok, target, draft = tmp_path / "tok", tmp_path / "target", tmp_path / "draft"
    assert main(["train", "tokenizer", "--out", str(tok), "--vocab-size", "600", "--data", str(corpus)]) == 0
    assert (
        main(
            [
                "train",
                "target",
                "--tokenizer",
                str(tok),
                "--out",
                str(target),
                "--data",
                str(corpus),
                *FEW_STEPS,
            ]
        )
        == 0
    )
    assert (
        main(
            [
                "train",
                "draft",
                "--target",
                str(target),
                "--out",
                str(draft),
                "--data",
                str(corpus),
                *FEW_STEPS,
            ]
        )
        == 0
    )
    from specdecode.backends.hf import HFBackend

    assert vocab_difference(HFBackend.load(target), HFBackend.load(draft)) is None
    log = json.loads((target / "train_log.json").read_text())
    assert len(log["losses"]) == 3
    # resuming with more steps continues from the checkpoint, on the cached token stream
    assert (target / "tokens-train.npy").exists()
    more = [*FEW_STEPS]
    more[1] = "5"
    assert main(["train", "target", "--tokenizer", str(tok), "--out", str(target), *more]) == 0
    log = json.loads((target / "train_log.json").read_text())
    assert log["resumed_from"] == 3 and len(log["losses"]) == 5
    report = tmp_path / "eval.json"
    argv = [
        "eval",
        "-m",
        str(target),
        "-md",
        str(draft),
        "--corpus",
        str(corpus),
        "--prompts",
        "2",
        "-n",
        "8",
        "--window",
        "32",
        "--json",
        str(report),
    ]
    assert main(argv) == 0
    numbers = json.loads(report.read_text())
    assert numbers["perplexity_target"] > 1 and numbers["perplexity_draft"] > 1
    assert 0.0 <= numbers["acceptance"]["acceptance_rate"] <= 1.0
    capsys.readouterr()


def test_train_bad_inputs_exit_2(tmp_path: Path, capsys) -> None:
    missing = tmp_path / "nowhere"
    cases = [
        (["train", "tokenizer", "--out", str(tmp_path / "t"), "--data", str(missing)], "no training data"),
        (
            ["train", "draft", "--target", str(missing), "--out", str(tmp_path / "d")],
            "model directory not found",
        ),
        (
            ["train", "target", "--tokenizer", str(missing), "--out", str(tmp_path / "x")],
            "model directory not found",
        ),
        (["train", "tokenizer", "--out", str(tmp_path / "t"), "--vocab-size", "10"], "vocab_size"),
    ]
    for argv, message in cases:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert message in err and "Traceback" not in err
    assert not (tmp_path / "d").exists()  # a refused draft run leaves nothing behind
