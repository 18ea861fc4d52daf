"""`specdecode eval`: perplexity computed right, prompts reproducible, acceptance summed."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from specdecode.api import Pipeline
from specdecode.backends.hf import HFBackend
from specdecode.cli import handler
from specdecode.errors import SpecdecodeError
from specdecode.strategies import DraftModelConfig
from specdecode.testing import make_llama, sample_text
from specdecode.train.corpus import encode_files, split_files
from specdecode.train.evaluate import acceptance, heldout_prompts, perplexity
from specdecode.train.flags import add_eval_parser

PROMPTS = ["def wrap(text, width=70):\n", "class TextWrapper:\n    def __init__(self):\n"]


@pytest.fixture
def stream(tokenizer) -> np.ndarray:
    ids = tokenizer(sample_text())["input_ids"][:150]
    return np.asarray(ids, dtype=np.int32)


def _reference_perplexity(backend: HFBackend, stream: np.ndarray, window: int) -> float:
    """The same number through the KV-cache API, one window at a time."""
    nll, count = 0.0, 0
    for start in range(0, len(stream) - 1, window):
        ids = stream[start : start + window].tolist()
        backend.truncate(0)
        logp = torch.log_softmax(backend.evaluate(ids)[:-1].double(), dim=-1)
        nll -= float(logp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])].sum())
        count += len(ids) - 1
    return math.exp(nll / count)


def test_perplexity_matches_an_independent_computation(tokenizer, stream) -> None:
    model = make_llama(len(tokenizer), dtype=torch.float32)
    backend = HFBackend(model, tokenizer)
    value = perplexity(backend, stream, window=64)  # windows of 64, 64 and 22 tokens
    assert value == pytest.approx(_reference_perplexity(backend, stream, 64), rel=1e-4)
    assert len(tokenizer) / 10 < value < len(tokenizer) * 10
    assert perplexity(backend, stream, window=64, max_tokens=64) != value


class _NextTokenModel(torch.nn.Module):
    """Predicts (token + 1) mod V with near certainty."""

    vocab = 16

    def forward(self, input_ids: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(
            logits=30.0 * torch.nn.functional.one_hot((input_ids + 1) % self.vocab).float()
        )


def test_perplexity_of_a_perfect_model_is_one() -> None:
    backend = SimpleNamespace(model=_NextTokenModel(), device=torch.device("cpu"), n_ctx=64)
    value = perplexity(backend, np.arange(100) % 16, window=10)
    assert value == pytest.approx(1.0, abs=1e-6)


@pytest.mark.parametrize("window", [1, 10_000])
def test_perplexity_refuses_bad_windows(tokenizer, stream, window: int) -> None:
    backend = HFBackend(make_llama(len(tokenizer)), tokenizer)
    with pytest.raises(SpecdecodeError, match="window"):
        perplexity(backend, stream, window=window)


def _source_tree(root: Path, numbers: range = range(6), lines: int = 30) -> list[Path]:
    """m{i}.py for i in numbers, `lines` lines of small functions each, and a 1-line short.py."""
    root.mkdir(parents=True, exist_ok=True)
    files = []
    for i in numbers:
        body = [f"def f{i}_{j}(x):\n    return x + {j}" for j in range(lines // 2)]
        (path := root / f"m{i}.py").write_text("\n".join(body) + "\n")
        files.append(path)
    (root / "short.py").write_text("x = 1\n")
    return [*files, root / "short.py"]


def test_heldout_prompts_are_deterministic(tmp_path: Path) -> None:
    files = _source_tree(tmp_path)
    prompts = heldout_prompts(files, n_prompts=4, prompt_lines=5, seed=3)
    assert prompts == heldout_prompts(list(reversed(files)), n_prompts=4, prompt_lines=5, seed=3)
    assert len(prompts) == 4
    for prompt in prompts:
        assert prompt.count("\n") == 4 and prompt.startswith("def ") and not prompt.endswith("\n")
    assert heldout_prompts(files, n_prompts=4, prompt_lines=5, seed=4) != prompts
    assert len(heldout_prompts(files, n_prompts=100, prompt_lines=5)) == 6  # the short file skipped
    with pytest.raises(SpecdecodeError, match="lines a prompt needs"):
        heldout_prompts(files[-1:], prompt_lines=5)


def test_acceptance_of_an_identical_draft_is_one(zoo, tokenizer) -> None:
    model = zoo.target()
    pipeline = Pipeline(
        HFBackend(model, tokenizer), HFBackend(model, tokenizer), draft_config=DraftModelConfig(4, p_min=0.0)
    )
    numbers = acceptance(pipeline, PROMPTS, n_predict=12)
    assert numbers["acceptance_rate"] == 1.0
    assert numbers["tokens_per_pass"] > 1.0
    assert numbers["prompts"] == 2 and 0 < numbers["generated"] <= 24
    with pytest.raises(SpecdecodeError, match="needs a draft model"):
        acceptance(Pipeline(HFBackend(model, tokenizer)), PROMPTS)


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_eval_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(argv)


def test_eval_command(saved_model_dir: Path, tmp_path: Path, capsys) -> None:
    corpus = tmp_path / "corpus"
    files = _source_tree(corpus, range(130, 136), lines=24)
    heldout = split_files(files, corpus)[1]
    assert [f.name for f in heldout] == ["m132.py", "m133.py", "m134.py", "short.py"]
    out = tmp_path / "eval.json"
    model = str(saved_model_dir)
    argv = ["eval", "-m", model, "-md", model, "--corpus", str(corpus), "--prompts", "2", "-n", "8"]
    args = _parse([*argv, "--window", "32", "--max-tokens", "200", "--json", str(out)])
    handler(args.handler)(args)
    printed = capsys.readouterr().out
    assert "perplexity target (model):" in printed and "perplexity draft (model):" in printed
    numbers = json.loads(out.read_text())
    assert numbers["perplexity_target"] == pytest.approx(numbers["perplexity_draft"])
    assert numbers["scored_tokens"] == 200 and numbers["acceptance"]["prompts"] == 2
    assert numbers["heldout_tokens"] == len(encode_files(HFBackend.load(model).tokenizer, heldout))
