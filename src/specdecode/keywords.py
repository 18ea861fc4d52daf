"""How `Pipeline.generate`, `stream` and `generate_batch` read their arguments: a prompt or a
list of them, and settings as objects or as keywords in Hugging Face's, vLLM's or llama.cpp's
spellings.

Apart from the pipeline (`specdecode.api`), which hands these on: reading arguments loads no
model and runs no pass.
"""

from __future__ import annotations

import difflib
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, TypedDict

from specdecode.errors import SpecdecodeError
from specdecode.generate import GenerationConfig
from specdecode.sampling import SamplingParams

Prompt = str | Sequence[int]  # text, or token ids


class GenerateKeywords(TypedDict, total=False):
    """Settings `generate`, `stream` and `generate_batch` take as keywords instead of objects.

    The most tokens to generate, in three spellings: max_new_tokens (Hugging Face's), max_tokens
    (vLLM's) or n_predict (llama.cpp's). do_sample (Hugging Face's): False decodes greedily
    whatever the temperature, True samples (at temperature 1 unless one is given). The others
    are `SamplingParams`' and `GenerationConfig`'s fields of the same names."""

    max_new_tokens: int
    max_tokens: int
    n_predict: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    do_sample: bool
    stop: str | Sequence[str]
    ignore_eos: bool


SAMPLING_KEYWORDS = ("temperature", "top_k", "top_p", "min_p", "seed", "do_sample")
LENGTH_KEYWORDS = ("max_new_tokens", "max_tokens", "n_predict")
CONFIG_KEYWORDS = (*LENGTH_KEYWORDS, "stop", "ignore_eos")


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
) -> tuple[SamplingParams | Sequence[SamplingParams], GenerationConfig]:
    """The sampling and generation settings from objects or keywords (`GenerateKeywords`).
    A keyword given as None counts as not given."""
    unknown = [key for key in keywords if key not in (*SAMPLING_KEYWORDS, *CONFIG_KEYWORDS)]
    if unknown:
        close = difflib.get_close_matches(unknown[0], (*SAMPLING_KEYWORDS, *CONFIG_KEYWORDS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise TypeError(f"{caller}() got an unexpected keyword argument {unknown[0]!r}{hint}")
    given = {key: value for key, value in keywords.items() if value is not None}
    return _sampling_from(sampling, given), _config_from(config, given)


def _given_twice(kind: str, names: Sequence[str]) -> SpecdecodeError:
    listed = ", ".join(f"{name}=" for name in names)
    return SpecdecodeError(f"{kind} given twice, as an object and as {listed}: give one or the other")


def _sampling_from(
    sampling: SamplingParams | Sequence[SamplingParams] | None, given: Mapping[str, Any]
) -> SamplingParams | Sequence[SamplingParams]:
    named = {key: value for key, value in given.items() if key in SAMPLING_KEYWORDS}
    if sampling is not None:
        if named:
            raise _given_twice("sampling settings", list(named))
        return sampling
    do_sample = named.pop("do_sample", None)
    if do_sample is False:  # Hugging Face's switch: greedy whatever the temperature
        named["temperature"] = 0.0
    elif do_sample is True:
        temperature = named.setdefault("temperature", 1.0)  # Hugging Face's default temperature
        if temperature <= 0:
            raise SpecdecodeError(f"do_sample=True samples: it needs a temperature > 0, not {temperature}")
    return SamplingParams(**named)


def _config_from(config: GenerationConfig | None, given: Mapping[str, Any]) -> GenerationConfig:
    named = {key: value for key, value in given.items() if key in CONFIG_KEYWORDS}
    if config is not None:
        if named:
            raise _given_twice("generation settings", list(named))
        return config
    lengths = {key: named.pop(key) for key in LENGTH_KEYWORDS if key in named}
    if len(set(lengths.values())) > 1:
        spelled = " and ".join(f"{key}={value}" for key, value in lengths.items())
        raise SpecdecodeError(f"{spelled} disagree: give the most tokens to generate once")
    if lengths:
        named["n_predict"] = next(iter(lengths.values()))
    return GenerationConfig(**named)
