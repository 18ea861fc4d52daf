"""The model pair the package carries: present, small, compatible, and deterministic."""

from __future__ import annotations

import json

import pytest
from safetensors import safe_open

from specdecode import GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.cli import main
from specdecode.defaults import BUNDLED, bundled_pair
from specdecode.vocab import vocab_difference

MAX_BUNDLE_BYTES = 80 * 1024 * 1024


@pytest.fixture(scope="module")
def backends() -> tuple[HFBackend, HFBackend]:
    target_dir, draft_dir = bundled_pair()
    return HFBackend.load(target_dir), HFBackend.load(draft_dir)


def test_the_bundle_is_small_and_stored_in_half_precision():
    files = [path for path in BUNDLED.rglob("*") if path.is_file()]
    assert sum(path.stat().st_size for path in files) <= MAX_BUNDLE_BYTES
    for role, directory in zip(("target", "draft"), bundled_pair(), strict=True):
        with safe_open(directory / "model.safetensors", "pt") as weights:
            dtypes = {str(weights.get_slice(name).get_dtype()) for name in weights.keys()}  # noqa: SIM118
        assert dtypes == {"BF16"}, (role, dtypes)


def test_sizes_and_shared_vocabulary(backends):
    target, draft = backends
    n_target = sum(p.numel() for p in target.model.parameters())
    n_draft = sum(p.numel() for p in draft.model.parameters())
    assert 20e6 <= n_target <= 40e6
    assert 10 <= n_target / n_draft <= 20
    assert vocab_difference(target, draft) is None
    assert target.vocab.size == draft.vocab.size
    assert target.model.config.architectures == ["LlamaForCausalLM"]


def test_generation_is_deterministic_and_equals_plain_generation(backends):
    target, draft = backends
    prompt = "def read_config(path):\n"
    sampling, config = SamplingParams(temperature=0), GenerationConfig(n_predict=48, ignore_eos=True)
    spec = Pipeline(target, draft)
    first, second = spec.generate(prompt, sampling, config), spec.generate(prompt, sampling, config)
    plain = Pipeline(target).generate(prompt, sampling, config)
    assert first.tokens == second.tokens == plain.tokens
    assert first.stats.totals.n_accepted > 0  # the draft is a useful draft, not noise
    seeded = SamplingParams(temperature=0.8, seed=5)
    assert (
        spec.generate(prompt, seeded, config).tokens
        == Pipeline(target).generate(prompt, seeded, config).tokens
    )


def test_the_command_needs_nothing_but_a_prompt(capsys):
    assert main(["generate", "--json", "-p", "import os\n", "-n", "16", "--temp", "0"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["text"] and len(result["tokens"]) <= 16
    # the adaptive default runs the cheap n-gram strategies beside the draft model
    assert [s["name"] for s in result["stats"]["strategies"]] == ["ngram-map-k4v", "ngram-mod", "draft"]
