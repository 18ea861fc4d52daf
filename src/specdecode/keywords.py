"""How `Pipeline.generate`, `stream` and `generate_batch` read their arguments: a prompt or a
list of them, and settings as objects or as keywords in Hugging Face's, vLLM's or llama.cpp's
spellings.

Apart from the pipeline (`specdecode.api`), which hands these on: reading arguments loads no
model and runs no pass.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import fields, replace
from typing import Any, TypedDict

from specdecode.config import one_length, unexpected_keyword
from specdecode.errors import SpecdecodeError
from specdecode.generate import GenerationConfig
from specdecode.sampling import SamplingParams

Prompt = str | Sequence[int]  # text, or token ids


class GenerateKeywords(TypedDict, total=False):
    """Settings `generate`, `stream` and `generate_batch` take as keywords instead of objects:
    every keyword `SamplingParams` and `GenerationConfig` take (Hugging Face's and vLLM's
    spellings among them).

    The most tokens to generate, in three spellings: max_new_tokens (Hugging Face's), max_tokens
    (vLLM's) or n_predict (llama.cpp's). do_sample (Hugging Face's): False decodes greedily
    whatever the temperature, True samples (at temperature 1 unless one is given).
    repetition_penalty (Hugging Face's and vLLM's): repeat_penalty over the whole context."""

    max_new_tokens: int
    max_tokens: int
    n_predict: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repetition_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    seed: int
    logit_bias: Sequence[tuple[int, float]] | Mapping[int, float]
    do_sample: bool
    stop: str | Sequence[str]
    ignore_eos: bool
    verify: str
    context_shift: bool
    n_keep: int
    n_discard: int


LENGTH_KEYWORDS = ("max_new_tokens", "max_tokens", "n_predict")
# What the generation's config takes; the sampling keywords are the rest of SamplingParams'.
CONFIG_KEYWORDS = (
    *LENGTH_KEYWORDS,
    *(field.name for field in fields(GenerationConfig) if field.name != "n_predict"),
)
SAMPLING_KEYWORDS = tuple(name for name in SamplingParams.keywords() if name not in CONFIG_KEYWORDS)
# SamplingParams' settings of the generation (vLLM's) -> GenerationConfig's names for them
SAMPLING_CONFIG = {"max_tokens": "n_predict", "stop": "stop", "ignore_eos": "ignore_eos"}


def is_batch(prompt: Prompt | Sequence[Prompt]) -> bool:
    """Whether `prompt` is a list of prompts rather than one prompt (text, or token ids)."""
    if isinstance(prompt, str) or len(prompt) == 0:
        return False
    ids = [isinstance(item, numbers.Integral) for item in prompt]
    if all(ids):
        return False
    if any(ids):
        raise SpecdecodeError(
            "a prompt is a string or a list of token ids, and a batch a list of prompts: "
            "this list mixes token ids with other things"
        )
    return True


def settings_from(
    sampling: SamplingParams | Sequence[SamplingParams] | None,
    config: GenerationConfig | None,
    keywords: Mapping[str, Any],
    caller: str,
) -> tuple[SamplingParams, GenerationConfig] | tuple[list[SamplingParams], list[GenerationConfig]]:
    """The sampling and generation settings from objects or keywords (`GenerateKeywords`):
    one of each, or for a list of SamplingParams a list of configs, one each, since each may
    set its own max_tokens, stop and ignore_eos. A keyword given as None counts as not given.

    caller: the method the user called, which a keyword it does not take is reported from."""
    check_keywords(keywords, caller)
    given = {key: value for key, value in keywords.items() if value is not None}
    sampling = _sampling_from(sampling, given)
    config, explicit = _config_from(config, given)
    if isinstance(sampling, SamplingParams):
        return sampling, _with_sampling(config, explicit, sampling)
    samplings = list(sampling)
    return samplings, [_with_sampling(config, explicit, one) for one in samplings]


def check_keywords(keywords: Iterable[str], caller: str) -> None:
    """Python's TypeError for a keyword no setting takes, reported from `caller`, the method the
    user called, with what to give instead."""
    for key in keywords:
        if key not in (*SAMPLING_KEYWORDS, *CONFIG_KEYWORDS):
            raise unexpected_keyword(caller, key, (*SAMPLING_KEYWORDS, *CONFIG_KEYWORDS))


def _given_twice(kind: str, names: Sequence[str]) -> SpecdecodeError:
    listed = ", ".join(f"{name}=" for name in names)
    return SpecdecodeError(f"{kind} given twice, as an object and as {listed}: give one or the other")


def _sampling_from(
    sampling: SamplingParams | Sequence[SamplingParams] | None, given: Mapping[str, Any]
) -> SamplingParams | Sequence[SamplingParams]:
    named = {key: value for key, value in given.items() if key in SAMPLING_KEYWORDS}
    if isinstance(sampling, GenerationConfig):
        raise SpecdecodeError("a GenerationConfig goes as config= (after the SamplingParams, or None)")
    if sampling is not None:
        if named:
            raise _given_twice("sampling settings", list(named))
        return sampling
    return SamplingParams(**named)


def _config_from(
    config: GenerationConfig | None, given: Mapping[str, Any]
) -> tuple[GenerationConfig, set[str]]:
    """The generation's config, and the names of its settings the caller gave (all of them for
    an object), which a SamplingParams may not set otherwise."""
    named = {key: value for key, value in given.items() if key in CONFIG_KEYWORDS}
    if config is not None:
        if named:
            raise _given_twice("generation settings", list(named))
        return config, {field.name for field in fields(GenerationConfig)}
    length = one_length({key: named.pop(key) for key in LENGTH_KEYWORDS if key in named})
    if length is not None:
        named["n_predict"] = length
    return GenerationConfig(**named), set(named)


def _with_sampling(
    config: GenerationConfig, explicit: set[str], sampling: SamplingParams
) -> GenerationConfig:
    """`config` with what `sampling` sets of the generation (max_tokens, stop, ignore_eos);
    an error where the caller gave the config another value."""
    changes = {}
    for theirs, ours in SAMPLING_CONFIG.items():
        value = getattr(sampling, theirs)
        if value is None:
            continue
        if ours in explicit and getattr(config, ours) != value:
            raise SpecdecodeError(
                f"SamplingParams({theirs}={value!r}) and the generation's {ours}={getattr(config, ours)!r} "
                "disagree: give it once"
            )
        changes[ours] = value
    return replace(config, **changes) if changes else config
