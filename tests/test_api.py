"""The Python API's first contact: loading (the bundled pair, directories, models in memory, a
vLLM-style speculative_config), the settings as keywords, batches as lists, and its errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import TargetSpec, cached_tokenizer, cpu_policy, draft_model, target_model
from transformers import LlamaModel

import specdecode
from specdecode import (
    ConstraintSpec,
    DraftModelConfig,
    GenerationConfig,
    LoadOptions,
    NgramMapConfig,
    NgramModConfig,
    NgramSettings,
    Pipeline,
    Result,
    SamplingParams,
    SpecdecodeError,
)
from specdecode.api import BESIDE_A_DRAFT
from specdecode.backends.hf import HFBackend
from specdecode.backends.load import load_backend
from specdecode.backends.native import NativeBackend
from specdecode.config import SuffixConfig
from specdecode.defaults import bundled_eagle3, bundled_pair
from specdecode.keywords import settings_from
from specdecode.server.settings import ServerSettings
from specdecode.speculative_config import SpeculativeChoice
from specdecode.testing import save_model

SPEC = TargetSpec(seed=3)
PROMPT = list(range(40, 60))
IDS = dict(max_new_tokens=12, ignore_eos=True)


@pytest.fixture(scope="module")
def models():
    """(target, draft, tokenizer) in memory: a float64 target and a close perturbed copy."""
    return target_model(SPEC), draft_model(SPEC, 0.02), cached_tokenizer()


@pytest.fixture(scope="module")
def in_memory(models) -> Pipeline:
    target, draft, tokenizer = models
    return Pipeline.load(target, tokenizer=tokenizer, draft=draft, draft_config=DraftModelConfig(p_min=0.0))


@pytest.fixture(scope="module")
def plain(models) -> Pipeline:
    target, _, tokenizer = models
    return Pipeline.load(target, tokenizer=tokenizer)


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, models) -> Path:
    _, draft, tokenizer = models
    return save_model(tmp_path_factory.mktemp("draft") / "draft", draft, tokenizer)


# --------------------------------------------------------------------------- the bundled pair


def test_load_with_no_model_is_the_bundled_pair_and_says_what_it_loads():
    lines: list[str] = []
    pipe = Pipeline.load(progress=lines.append)
    target, draft = bundled_pair()
    loading = [line for line in lines if line.startswith("loading")]
    assert loading == [f"loading the target model from {target}", f"loading the draft model from {draft}"]
    # and where auto runs the target on llama.cpp, its long steps there: its copy written, its probe
    others = [line for line in lines if not line.startswith("loading")]
    assert all(line.startswith(("writing ", "checking that llama.cpp's")) for line in others), others
    assert pipe.spec_types == ["draft"] and pipe.draft is not None
    prompt = "def read_config(path):\n"
    result = pipe.generate(prompt, max_new_tokens=24, ignore_eos=True)
    assert isinstance(result, Result) and len(result.tokens) == 24
    assert result.tokens == Pipeline(pipe.target).generate(prompt, max_new_tokens=24, ignore_eos=True).tokens
    assert result.stats.totals.n_accepted > 0 and "tokens" in result.stats.format()


def test_the_bundled_target_loads_only_the_drafter_the_strategy_needs():
    pipe = Pipeline.load(speculative_config={"method": "ngram", "num_speculative_tokens": 5})
    assert pipe.draft is None and pipe.eagle3 is None and pipe.spec_types == ["ngram-simple"]
    if bundled_eagle3() is not None:
        head = Pipeline.load(speculative_config={"method": "eagle3", "num_speculative_tokens": 3})
        assert head.draft is None and head.eagle3 is not None and head.spec_types == ["eagle3"]
        assert head.draft_config.n_max == 3


# --------------------------------------------------------------------------- models in memory


def test_models_in_memory_run_natively_and_equal_plain_generation(models, in_memory, plain, exactness_log):
    target, _, tokenizer = models
    assert type(in_memory.target) is NativeBackend and type(in_memory.draft) is NativeBackend
    assert in_memory.draft.tokenizer is tokenizer  # the draft's tokenizer defaults to the target's
    assert in_memory.spec_types == ["draft"] and plain.spec_types == []
    for prompt in (PROMPT, "def wrap(text, width):"):
        result = in_memory.generate(prompt, max_new_tokens=20, ignore_eos=True)
        expected = plain.generate(prompt, max_new_tokens=20, ignore_eos=True)
        assert result.tokens == expected.tokens and result.text == expected.text
        assert result.stats.totals.n_accepted > 0
        exactness_log.record("api/models-in-memory", "native", result.stats, result.stats.stop_reason)
    hf = Pipeline.load(target, tokenizer=tokenizer, target_options=LoadOptions(backend="hf"))
    assert type(hf.target) is HFBackend


def test_a_draft_directory_goes_with_a_target_in_memory(models, draft_dir):
    target, _, tokenizer = models
    pipe = Pipeline.load(target, draft_dir, tokenizer=tokenizer)
    assert pipe.draft.name == "draft" and pipe.spec_types == ["draft"]


def test_models_in_memory_that_cannot_run_are_refused(models, draft_dir):
    target, _, tokenizer = models
    with pytest.raises(SpecdecodeError, match="needs its tokenizer"):
        Pipeline.load(target)
    with pytest.raises(SpecdecodeError, match="cannot run a Linear"):
        Pipeline.load(torch.nn.Linear(2, 2), tokenizer=tokenizer)
    with pytest.raises(SpecdecodeError, match="must be a transformers tokenizer"):
        Pipeline.load(target, tokenizer="gpt2")
    with pytest.raises(SpecdecodeError, match="not a causal language model"):
        Pipeline.load(LlamaModel(target.config), tokenizer=tokenizer)
    with pytest.raises(SpecdecodeError, match="draft_tokenizer= goes with a model in memory"):
        Pipeline.load(target, draft_dir, tokenizer=tokenizer, draft_tokenizer=tokenizer)
    with pytest.raises(SpecdecodeError, match=r"llama\.cpp backend runs GGUF files"):
        Pipeline.load(target, tokenizer=tokenizer, target_options=LoadOptions(backend="llama.cpp"))


# --------------------------------------------------------------------------- prompts and settings


def test_a_list_of_prompts_is_a_batch_with_each_answer_as_alone(in_memory, plain, exactness_log):
    prompts = [PROMPT, [5, 6, 7, 8], "def wrap(text, width):"]
    results = in_memory.generate(prompts, max_new_tokens=10, ignore_eos=True)
    assert isinstance(results, list) and len(results) == len(prompts)
    for prompt, result in zip(prompts, results, strict=True):
        assert result.tokens == plain.generate(prompt, max_new_tokens=10, ignore_eos=True).tokens
        exactness_log.record("api/list-of-prompts", "native", result.stats, result.stats.stop_reason)
    assert isinstance(in_memory.generate([5, 6, 7], max_new_tokens=2), Result)  # token ids: one prompt
    with pytest.raises(SpecdecodeError, match="mixes token ids"):
        in_memory.generate([5, "six"])


def test_the_three_spellings_of_the_length_and_greedy_by_default(in_memory):
    lengths = [
        len(in_memory.generate(PROMPT, ignore_eos=True, **{key: 7}).tokens)
        for key in ("max_new_tokens", "max_tokens", "n_predict")
    ]
    assert lengths == [7, 7, 7]
    assert len(in_memory.generate(PROMPT, max_new_tokens=5, max_tokens=5, ignore_eos=True).tokens) == 5
    with pytest.raises(SpecdecodeError, match="max_new_tokens=5 and n_predict=6 disagree"):
        in_memory.generate(PROMPT, max_new_tokens=5, n_predict=6)
    assert SamplingParams().greedy
    first, second = in_memory.generate(PROMPT, **IDS), in_memory.generate(PROMPT, **IDS)
    explicit = in_memory.generate(PROMPT, SamplingParams(temperature=0), **IDS)
    assert first.tokens == second.tokens == explicit.tokens


def test_keywords_build_the_settings_objects():
    sampling, config = settings_from(
        None, None, {"temperature": 0.7, "top_k": 0, "seed": 4, "stop": "\n\n", "max_tokens": 9}, "generate"
    )
    assert sampling == SamplingParams(temperature=0.7, top_k=0, seed=4)
    assert config == GenerationConfig(n_predict=9, stop=("\n\n",))
    assert settings_from(None, None, {"do_sample": True, "seed": 1}, "generate")[0].temperature == 1.0
    assert settings_from(None, None, {"do_sample": False, "temperature": 0.9}, "generate")[0].greedy
    assert settings_from(None, None, {"seed": None}, "generate") == (SamplingParams(), GenerationConfig())
    with pytest.raises(SpecdecodeError, match="needs a temperature > 0"):
        settings_from(None, None, {"do_sample": True, "temperature": 0}, "generate")


def test_seeded_sampling_by_keywords_equals_the_objects(in_memory, plain):
    by_keywords = in_memory.generate(PROMPT, do_sample=True, seed=11, **IDS)
    by_objects = in_memory.generate(
        PROMPT, SamplingParams(temperature=1.0, seed=11), GenerationConfig(12, ignore_eos=True)
    )
    by_plain = plain.generate(PROMPT, temperature=1.0, seed=11, **IDS)
    assert by_keywords.tokens == by_objects.tokens == by_plain.tokens
    run = in_memory.stream(PROMPT, temperature=0.8, seed=2, n_predict=6, ignore_eos=True)
    assert "".join(chunk.text for chunk in run) == run.text and len(run.tokens) == 6


def test_settings_given_twice_or_misspelled_are_refused(in_memory):
    with pytest.raises(SpecdecodeError, match=r"sampling settings given twice.*temperature="):
        in_memory.generate(PROMPT, SamplingParams(), temperature=0.5)
    with pytest.raises(SpecdecodeError, match=r"generation settings given twice.*max_new_tokens="):
        in_memory.generate(PROMPT, None, GenerationConfig(), max_new_tokens=3)
    with pytest.raises(TypeError, match=r"'max_new_token'.*did you mean 'max_new_tokens'"):
        in_memory.generate(PROMPT, max_new_token=3)
    with pytest.raises(SpecdecodeError, match="one prompt takes one SamplingParams"):
        in_memory.generate(PROMPT, [SamplingParams()])


def test_the_server_keeps_llama_servers_temperature_for_requests_that_name_none():
    assert ServerSettings(model_id="m").sampling.temperature == 0.8


# --------------------------------------------------------------------------- speculative_config


def test_speculative_config_in_vllms_keys(models, draft_dir, plain, exactness_log):
    target, _, tokenizer = models
    ngram = Pipeline.load(
        target,
        tokenizer=tokenizer,
        speculative_config={
            "method": "ngram",
            "num_speculative_tokens": 5,
            "prompt_lookup_max": 4,
            "prompt_lookup_min": 2,
        },
    )
    assert ngram.spec_types == ["ngram-simple"] and ngram.ngram.simple == NgramMapConfig(size_n=4, size_m=5)
    drafted = Pipeline.load(
        target,
        tokenizer=tokenizer,
        speculative_config={"method": "draft_model", "model": str(draft_dir), "num_speculative_tokens": 3},
    )
    assert drafted.spec_types == ["draft"] and drafted.draft is not None and drafted.draft_config.n_max == 3
    result = drafted.generate(PROMPT, **IDS)
    assert result.tokens == plain.generate(PROMPT, **IDS).tokens and result.stats.totals.n_drafted > 0
    exactness_log.record("api/speculative-config", "draft_model", result.stats)
    ours = Pipeline.load(
        target,
        tokenizer=tokenizer,
        speculative_config={"method": "ngram-mod"},
        ngram=NgramSettings(mod=NgramModConfig(n_match=8)),
    )
    assert ours.spec_types == ["ngram-mod"] and ours.ngram.mod.n_match == 8


def test_speculative_config_names_every_drafter():
    def read(config: dict) -> SpeculativeChoice:
        return SpeculativeChoice.read(config, DraftModelConfig(), NgramSettings())

    assert read({"method": "ngram"}).ngram.simple == NgramMapConfig(size_n=5)  # vLLM's default size
    assert read({"method": "ngram", "prompt_lookup_min": 3}).ngram.simple.size_n == 3
    for method in ("eagle3", "eagle", "draft-eagle3"):
        choice = read({"method": method, "model": "head", "num_speculative_tokens": 4})
        assert (choice.spec_type, choice.model, choice.draft.n_max) == ("eagle3", "head", 4)
    for method in ("draft_model", "draft", "draft-simple"):
        assert read({"method": method, "model": "d"}).spec_type == "draft"
    suffix = read(
        {
            "method": "suffix",
            "num_speculative_tokens": 12,
            "suffix_decoding_max_tree_depth": 16,
            "suffix_decoding_max_spec_factor": 2,
            "suffix_decoding_min_token_prob": 0.2,
        }
    )
    assert suffix.spec_type == "suffix"
    assert suffix.ngram.suffix == SuffixConfig(max_depth=16, factor=2.0, min_prob=0.2, max_nodes=12)
    assert read({"method": "suffix"}).ngram.suffix == SuffixConfig()


@pytest.mark.parametrize(
    "config, message",
    [
        ({"method": "ngram", "n": 3}, r"unknown speculative_config key 'n' \(known: method, model"),
        ({"method": "medusa"}, r"unknown speculative_config method 'medusa' \(supported: ngram, draft_model"),
        (
            {"method": "suffix", "suffix_decoding_min_token_prob": 2},
            r"min_prob \(--spec-suffix-min-prob\) must be in",
        ),
        (
            {"method": "suffix", "suffix_decoding_max_spec_factor": "1"},
            "'suffix_decoding_max_spec_factor' must be",
        ),
        ({"method": "ngram", "suffix_decoding_max_tree_depth": 8}, "'ngram' takes no 'suffix_decoding_max"),
        ({"model": "d"}, "unknown speculative_config method None"),
        ({"method": "ngram-mod", "num_speculative_tokens": 3}, "'ngram-mod' takes no 'num_speculative"),
        ({"method": "ngram", "model": "d"}, "'ngram' takes no 'model'"),
        ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4}, "would never draft"),
        ({"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"lookup_min \(4\) exceeds"),
        ({"method": "draft_model", "num_speculative_tokens": 0}, "must be an integer >= 1"),
        ({"method": "draft_model"}, "'draft_model' needs 'model'"),
    ],
)
def test_speculative_config_mistakes(models, config, message):
    target, _, tokenizer = models
    with pytest.raises(SpecdecodeError, match=message):
        Pipeline.load(target, tokenizer=tokenizer, speculative_config=config)


def test_speculative_config_chooses_alone(models):
    target, draft, tokenizer = models
    for extra in (
        {"draft": draft},
        {"eagle3": "head"},
        {"dflash": "drafter"},
        {"spec_types": ["ngram-simple"]},
    ):
        with pytest.raises(SpecdecodeError, match="give it without draft=, eagle3=, dflash= or spec_types="):
            Pipeline.load(target, tokenizer=tokenizer, speculative_config={"method": "ngram"}, **extra)


def test_spec_types_take_llama_cpps_current_names(models):
    target, draft, tokenizer = models
    pipe = Pipeline.load(target, draft, tokenizer=tokenizer, spec_types=["draft-simple", "ngram-simple"])
    assert pipe.spec_types == ["draft", "ngram-simple"]
    with pytest.raises(SpecdecodeError, match="unknown strategy 'ngram'"):
        Pipeline.load(target, tokenizer=tokenizer, spec_types=["ngram"])


def test_without_a_drafter_the_adaptive_default_is_the_n_gram_chain(models, plain, exactness_log):
    """Adaptive: the model-free chain BESIDE_A_DRAFT, output plain's; classic (llama.cpp's
    behaviour) and spec_types=[] generate plainly."""
    target, _, tokenizer = models
    adaptive = Pipeline.load(target, tokenizer=tokenizer, spec_policy="adaptive", policy_models=cpu_policy())
    assert adaptive.spec_types == BESIDE_A_DRAFT and plain.spec_types == []
    none = Pipeline.load(target, tokenizer=tokenizer, spec_types=[], spec_policy="adaptive")
    assert none.spec_types == [] and none.policy_models is None
    prompt = PROMPT * 3
    result = adaptive.generate(prompt, max_new_tokens=24, ignore_eos=True)
    assert result.tokens == plain.generate(prompt, max_new_tokens=24, ignore_eos=True).tokens
    assert {s.name for s in result.stats.strategies} == set(BESIDE_A_DRAFT)
    exactness_log.record("api/default-without-drafter", "native", result.stats, result.stats.stop_reason)


# --------------------------------------------------------------------------- paths and progress


def test_a_hub_id_says_how_to_download_it(tmp_path, monkeypatch, models):
    expected = (
        "Qwen/Qwen2.5-0.5B is not a local directory or GGUF file: specdecode reads models from disk only; "
        "download it first, e.g. `huggingface-cli download Qwen/Qwen2.5-0.5B --local-dir DIR`, and pass DIR"
    )
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SpecdecodeError) as caught:
        Pipeline.load("Qwen/Qwen2.5-0.5B")
    assert str(caught.value) == expected
    target, _, tokenizer = models
    with pytest.raises(SpecdecodeError, match="huggingface-cli download owner/head --local-dir DIR"):
        Pipeline.load(target, tokenizer=tokenizer, eagle3="owner/head")
    with pytest.raises(SpecdecodeError, match="model directory not found"):
        load_backend(tmp_path / "missing")
    save_model(tmp_path / "owner" / "name", target, tokenizer)  # a local owner/name is read as such
    assert load_backend("owner/name").name == "name"


def test_progress_tells_each_phase_and_nothing_for_models_in_memory(models, draft_dir):
    target, _, tokenizer = models
    lines: list[str] = []
    Pipeline.load(target, draft_dir, tokenizer=tokenizer, spec_policy="adaptive", progress=lines.append)
    assert lines == [
        f"loading the draft model from {draft_dir}",
        "timing the target's passes for the adaptive policy",
    ]


# --------------------------------------------------------------------------- exports


def test_everything_a_user_configures_comes_from_the_package():
    names = [
        *("Pipeline", "Result", "SamplingParams", "GenerationConfig", "LoadOptions", "DraftModelConfig"),
        *("NgramSettings", "NgramMapConfig", "NgramModConfig", "ConstraintSpec", "SpecdecodeError"),
    ]
    assert set(names) <= set(specdecode.__all__)
    assert list(specdecode.__all__) == sorted(specdecode.__all__)
    assert all(getattr(specdecode, name) is not None for name in specdecode.__all__)
    assert ConstraintSpec is specdecode.ConstraintSpec
