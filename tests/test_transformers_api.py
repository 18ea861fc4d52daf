"""Our calls into transformers use its current API: a deprecated keyword or output attribute
fails here, while transformers still only warns, instead of breaking generation in the release
that removes it.

transformers deprecates in two ways: `warnings.warn(..., FutureWarning)` (keywords, e.g.
`past_key_values`, renamed `cache` in 5.24), and a logged notice printed once per process
(`logger.warning_once`, e.g. reading `output.past_key_values`). Both are turned into failures.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch
from transformers.utils import logging as hf_logging

from specdecode.api import Pipeline
from specdecode.backends.hf import LoadOptions
from specdecode.backends.load import load_backend
from specdecode.generate import GenerationConfig
from specdecode.sampling import SamplingParams
from specdecode.strategies import DraftModelConfig
from specdecode.testing import make_llama, make_tokenizer, perturbed_copy, save_model
from specdecode.train.eagle3 import greedy_continuations


class _Notices(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@contextmanager
def deprecations_fail() -> Iterator[None]:
    """Within the block, FutureWarning and DeprecationWarning raise, and a deprecation notice
    that transformers logs fails the test at its end."""
    notices = _Notices()
    root = hf_logging.get_logger("transformers")
    level = root.level
    hf_logging.warning_once.cache_clear()  # notices already printed in this process print again
    root.addHandler(notices)
    root.setLevel(logging.WARNING)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", FutureWarning)
            warnings.simplefilter("error", DeprecationWarning)
            yield
    finally:
        root.removeHandler(notices)
        root.setLevel(level)
    deprecated = [message for message in notices.messages if "deprecat" in message.lower()]
    assert not deprecated, deprecated


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("transformers-api")
    tokenizer = make_tokenizer(320)
    target = make_llama(len(tokenizer), init_std=0.5, seed=3)
    draft = perturbed_copy(target, 0.02)
    return save_model(root / "target", target, tokenizer), save_model(root / "draft", draft, tokenizer)


def test_the_guard_catches_a_deprecated_keyword_and_a_deprecated_attribute():
    model = make_llama(64, hidden=16, layers=1)
    ids = torch.tensor([[1, 2]])
    with pytest.raises(FutureWarning, match="past_key_values"), deprecations_fail():
        model(input_ids=ids, past_key_values=None, use_cache=True)
    with pytest.raises(AssertionError, match="deprecated"), deprecations_fail():
        assert model(input_ids=ids, use_cache=True).past_key_values is not None


@pytest.mark.parametrize("backend", ["hf", "native"])
def test_loading_and_speculative_generation_call_no_deprecated_api(pair, backend):
    target_dir, draft_dir = pair
    with deprecations_fail():
        target = load_backend(target_dir, LoadOptions(backend=backend))
        draft = load_backend(draft_dir, LoadOptions(backend=backend))
        prompt = target.tokenize("def f(x):\n    return")
        for config in (DraftModelConfig(), DraftModelConfig(n_parallel=3)):  # a chain, then trees
            pipeline = Pipeline(target, draft, spec_types=["draft"], draft_config=config)
            result = pipeline.generate(prompt, SamplingParams(temperature=0), GenerationConfig(n_predict=12))
            assert len(result.tokens) == 12 and result.stats.totals.n_drafted > 0


def test_training_continuations_call_no_deprecated_api():
    target = make_llama(64, hidden=16, layers=1)
    with deprecations_fail():
        sequences = greedy_continuations(target, torch.tensor([[1, 5, 7], [2, 3, 4]]), new_tokens=4)
    assert sequences.shape == (2, 7)
