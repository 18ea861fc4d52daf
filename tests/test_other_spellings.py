"""Other libraries' habits: SamplingParams and generate's keywords take vLLM's and Hugging Face's
spellings of the settings this package has, refuse the rest naming what to give instead, report a
keyword mistake from the method called, and the library's errors name the library's arguments;
`specdecode generate` and `serve` take vLLM's --speculative-config."""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path

import pytest
from conftest import TargetSpec, cached_tokenizer, draft_model, target_model

from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams, SpecdecodeError
from specdecode.cli import build_parser, main
from specdecode.cli.settings import pipeline_from_args
from specdecode.keywords import settings_from
from specdecode.testing import make_llama, make_tokenizer, save_model

SPEC = TargetSpec(seed=5)
PROMPT = list(range(40, 60))


@pytest.fixture(scope="module")
def models():
    return target_model(SPEC), draft_model(SPEC, 0.02), cached_tokenizer()


@pytest.fixture(scope="module")
def spec(models) -> Pipeline:
    target, draft, tokenizer = models
    return Pipeline.load(target, tokenizer=tokenizer, draft=draft, draft_config=DraftModelConfig(p_min=0.0))


@pytest.fixture(scope="module")
def plain(models) -> Pipeline:
    target, _, tokenizer = models
    return Pipeline.load(target, tokenizer=tokenizer)


# --------------------------------------------------------------------------- SamplingParams


def test_sampling_params_reads_vllms_and_hugging_faces_names():
    # repetition_penalty penalises as Hugging Face and vLLM do: over the whole context
    assert SamplingParams(repetition_penalty=1.2) == SamplingParams(repeat_penalty=1.2, repeat_last_n=-1)
    assert SamplingParams(repetition_penalty=1.2, repeat_last_n=32).repeat_last_n == 32
    assert SamplingParams(repeat_penalty=1.2).repeat_last_n == 64  # llama.cpp's window
    assert SamplingParams(top_k=-1).top_k == 0  # vLLM's "every token"
    assert SamplingParams(logit_bias={7: -math.inf, 3: 1.5}).logit_bias == ((7, -math.inf), (3, 1.5))
    assert SamplingParams(do_sample=True).temperature == 1.0
    assert SamplingParams(do_sample=True, temperature=0.6).temperature == 0.6
    assert SamplingParams(do_sample=False, temperature=0.6).greedy
    assert SamplingParams().greedy and SamplingParams(temperature=None).greedy
    for length in ("max_tokens", "max_new_tokens", "n_predict"):
        assert SamplingParams(**{length: 9}).max_tokens == 9
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(0.5, 10).top_k == 10  # the fields still go by position
    bias = SamplingParams(repetition_penalty=1.2, max_tokens=4)
    with pytest.raises(SpecdecodeError, match="a GenerationConfig goes as config="):
        settings_from(GenerationConfig(7), None, {}, "generate")
    assert replace(bias, seed=3) == SamplingParams(repeat_penalty=1.2, repeat_last_n=-1, max_tokens=4, seed=3)


@pytest.mark.parametrize(
    ("keywords", "error", "message"),
    [
        (
            {"best_of": 2},
            TypeError,
            r"SamplingParams\(\) got an unexpected keyword argument 'best_of': several",
        ),
        ({"n": 3}, TypeError, "give the prompt several times in a list"),
        ({"logprobs": 5}, TypeError, "the server's logprobs"),
        ({"num_beams": 4}, TypeError, "beam search is not offered"),
        ({"max_length": 20}, TypeError, "max_new_tokens .* counts the new tokens"),
        ({"tempreature": 0.5}, TypeError, "did you mean 'temperature'"),
        ({"repetiton_penalty": 1.1}, TypeError, "did you mean 'repetition_penalty'"),
        ({"repeat_penalty": 1.1, "repetition_penalty": 1.2}, SpecdecodeError, "give the penalty once"),
        (
            {"max_tokens": 5, "max_new_tokens": 6},
            SpecdecodeError,
            "max_tokens=5 and max_new_tokens=6 disagree",
        ),
        ({"do_sample": True, "temperature": 0}, SpecdecodeError, "needs a temperature > 0"),
        ({"max_tokens": 0}, SpecdecodeError, "max_tokens must be >= 1"),
        ({"top_k": -2}, SpecdecodeError, "top_k must be >= 0"),
    ],
)
def test_sampling_params_refuses_what_it_has_not_saying_what_to_give(keywords, error, message):
    with pytest.raises(error, match=message):
        SamplingParams(**keywords)


def test_sampling_params_max_tokens_stop_and_ignore_eos_are_honoured(spec, plain):
    by_sampling = spec.generate(PROMPT, SamplingParams(max_tokens=7, ignore_eos=True))
    assert len(by_sampling.tokens) == 7
    assert by_sampling.tokens == plain.generate(PROMPT, config=GenerationConfig(7, ignore_eos=True)).tokens
    run = spec.stream(PROMPT, SamplingParams(n_predict=5, ignore_eos=True))
    assert sum(len(chunk.tokens) for chunk in run) == len(run.tokens) == 5
    text = plain.generate(PROMPT, max_new_tokens=12, ignore_eos=True).text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    stopped = spec.generate(PROMPT, SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop]))
    assert stop not in stopped.text and text.startswith(stopped.text) and stopped.text != text
    # one per prompt in a batch, each as alone
    batch = spec.generate(
        [PROMPT, [5, 6, 7]],
        [SamplingParams(max_tokens=3, ignore_eos=True), SamplingParams(max_tokens=6, ignore_eos=True)],
    )
    assert [len(result.tokens) for result in batch] == [3, 6]
    assert batch[1].tokens == plain.generate([5, 6, 7], max_tokens=6, ignore_eos=True).tokens
    with pytest.raises(
        SpecdecodeError, match=r"SamplingParams\(max_tokens=7\) and the generation's n_predict=5 disagree"
    ):
        spec.generate(PROMPT, SamplingParams(max_tokens=7), GenerationConfig(5))
    with pytest.raises(SpecdecodeError, match="n_predict=5 disagree"):
        spec.generate(PROMPT, SamplingParams(max_tokens=7), max_new_tokens=5)
    # the config's own value given again, or another of its settings, is no disagreement
    agreed = settings_from(SamplingParams(max_tokens=5), GenerationConfig(5), {}, "generate")
    assert agreed[1].n_predict == 5
    _, config = settings_from(SamplingParams(max_tokens=4), None, {"stop": "x"}, "generate")
    assert config == GenerationConfig(4, stop=("x",))


# --------------------------------------------------------------------------- generate's keywords


def test_generate_takes_every_setting_by_its_other_names(spec, plain):
    repetitive = [11, 12, 13, 11, 12, 13, 11, 12, 13, 11, 12, 13]
    by_keyword = spec.generate(repetitive, repetition_penalty=3.0, max_new_tokens=10, ignore_eos=True)
    by_object = plain.generate(
        repetitive,
        SamplingParams(repeat_penalty=3.0, repeat_last_n=-1),
        GenerationConfig(10, ignore_eos=True),
    )
    unpenalised = plain.generate(repetitive, max_new_tokens=10, ignore_eos=True)
    assert by_keyword.tokens == by_object.tokens != unpenalised.tokens
    sampling, config = settings_from(
        None,
        None,
        {"top_k": -1, "logit_bias": {3: -math.inf}, "presence_penalty": 0.5, "verify": "rejection"},
        "generate",
    )
    assert sampling == SamplingParams(top_k=0, logit_bias=((3, -math.inf),), presence_penalty=0.5)
    assert config.verify == "rejection"


@pytest.mark.parametrize("method", ["generate", "stream", "generate_batch", "generate a list"])
def test_a_keyword_mistake_is_reported_from_the_method_called(spec, method):
    call = {
        "generate": lambda **kw: spec.generate(PROMPT, **kw),
        "stream": lambda **kw: spec.stream(PROMPT, **kw),
        "generate_batch": lambda **kw: spec.generate_batch([PROMPT], **kw),
        "generate a list": lambda **kw: spec.generate([PROMPT, PROMPT], **kw),
    }[method]
    name = method.split()[0]
    with pytest.raises(
        TypeError,
        match=rf"^{name}\(\) got an unexpected keyword argument 'repetiton_penalty' "
        r"\(did you mean 'repetition_penalty'\?\)$",
    ):
        call(repetiton_penalty=1.1)
    with pytest.raises(
        TypeError, match=rf"^{name}\(\) got an unexpected keyword argument 'best_of': several"
    ):
        call(best_of=2)


# --------------------------------------------------------------------------- the library's errors


def test_the_librarys_errors_name_its_arguments(models, tmp_path):
    target, _, tokenizer = models
    with pytest.raises(SpecdecodeError, match=r"needs a draft model: draft= \(-md DIR\)"):
        Pipeline.load(target, tokenizer=tokenizer, spec_types=["draft"])
    with pytest.raises(SpecdecodeError, match=r"needs an EAGLE-3 head: eagle3= \(-me DIR\)"):
        Pipeline.load(target, tokenizer=tokenizer, spec_types=["draft-eagle3"])
    with pytest.raises(SpecdecodeError, match=r"unknown spec_policy 'adaptve' \(--spec-policy"):
        Pipeline.load(target, tokenizer=tokenizer, spec_policy="adaptve")
    with pytest.raises(
        SpecdecodeError, match=r"draft n_max \(--spec-draft-n-max, --draft-max\) must be >= 1"
    ):
        DraftModelConfig(n_max=0)
    other_tokenizer = make_tokenizer(300, text="completely different text " * 50 + "with other merges")
    other = make_llama(len(other_tokenizer), seed=4)
    with pytest.raises(SpecdecodeError, match=r"replacements=\[\(TARGET, DRAFT\), \.\.\.\] \(--spec-replace"):
        Pipeline.load(target, tokenizer=tokenizer, draft=other, draft_tokenizer=other_tokenizer)
    translated = Pipeline.load(
        target, tokenizer=tokenizer, draft=other, draft_tokenizer=other_tokenizer, replacements=[]
    )
    assert translated.translator is not None


# --------------------------------------------------------------------------- --speculative-config


@pytest.fixture(scope="module")
def saved(tmp_path_factory, models) -> tuple[Path, Path]:
    target, draft, tokenizer = models
    root = tmp_path_factory.mktemp("spellings")
    return save_model(root / "target", target, tokenizer), save_model(root / "draft", draft, tokenizer)


def generate_json(capsys, *args: str) -> dict:
    assert main(["generate", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_generate_takes_vllms_speculative_config(saved, capsys):
    target, draft = saved
    common = [
        "-m",
        str(target),
        "-p",
        "def f(x):",
        "-n",
        "16",
        "--temp",
        "0",
        "--ignore-eos",
        "--draft-p-min",
        "0",
    ]
    plain = generate_json(capsys, *common, "--spec-type", "none")
    config = {"method": "draft_model", "model": str(draft), "num_speculative_tokens": 3}
    spec = generate_json(
        capsys, *common, "--speculative-config", json.dumps(config), "--spec-policy", "classic"
    )
    assert spec["tokens"] == plain["tokens"]
    assert [s["name"] for s in spec["stats"]["strategies"]] == ["draft"]
    assert spec["stats"]["totals"]["n_drafted"] > 0
    lookup = generate_json(
        capsys, *common, "--speculative-config", '{"method": "ngram", "prompt_lookup_max": 2}'
    )
    assert lookup["tokens"] == plain["tokens"]
    assert [s["name"] for s in lookup["stats"]["strategies"]] == ["ngram-simple"]


def test_serve_builds_its_pipeline_from_a_speculative_config(saved):
    target, draft = saved
    config = json.dumps({"method": "draft_model", "model": str(draft), "num_speculative_tokens": 4})
    args = build_parser().parse_args(["serve", "-m", str(target), "--speculative-config", config, "-t", "1"])
    pipeline = pipeline_from_args(args)
    assert pipeline.spec_types == ["draft"] and pipeline.draft is not None
    assert pipeline.draft_config.n_max == 4 and args.model == target


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (
            ["-md", "{draft}"],
            "--speculative-config chooses the strategy and its model: give it without -md/--model-draft",
        ),
        (["--spec-type", "ngram-mod"], "give it without --spec-type"),
        (["-me", "{draft}"], "give it without -me/--model-eagle3"),
        (
            ["--draft-max", "8"],
            "--spec-draft-n-max 8 and --speculative-config's num_speculative_tokens 3 disagree: "
            "give the draft length once",
        ),
    ],
)
def test_speculative_config_beside_the_flags_that_choose_otherwise_is_refused(saved, capsys, extra, message):
    target, draft = saved
    config = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2})
    argv = ["generate", "-m", str(target), "-p", "x", "--speculative-config", config]
    assert main([*argv, *(arg.format(draft=draft) for arg in extra)]) == 2
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert error.startswith("error: ") and error.endswith(message)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ("{method: ngram}", "--speculative-config is not valid JSON"),
        ('["ngram"]', "--speculative-config takes a JSON object"),
        ('{"method": "medusa"}', "unknown speculative_config method 'medusa'"),
    ],
)
def test_a_bad_speculative_config_is_one_clear_line(saved, capsys, config, message):
    target, _ = saved
    assert main(["serve", "-m", str(target), "--port", "0", "--speculative-config", config]) == 2
    assert message in capsys.readouterr().err.strip().splitlines()[-1]
