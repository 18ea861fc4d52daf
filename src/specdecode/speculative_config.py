"""vLLM's `speculative_config` in this package's terms: which strategy, its model and settings.

Apart from the pipeline (`specdecode.api`), which loads what the choice names: reading the
config loads nothing.
"""

from __future__ import annotations

import numbers
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any

from specdecode.config import (
    PRIORITY,
    SPEC_TYPE_ALIASES,
    DraftModelConfig,
    NgramMapConfig,
    NgramSettings,
    SuffixConfig,
)
from specdecode.errors import SpecdecodeError

# vLLM's speculative_config keys that are read here
MODEL_KEYS = ("model", "num_speculative_tokens")
LOOKUP_KEYS = ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")
SUFFIX_KEYS = (
    "num_speculative_tokens",
    "suffix_decoding_max_tree_depth",
    "suffix_decoding_max_spec_factor",
    "suffix_decoding_min_token_prob",
)
MTP_KEYS = ("num_speculative_tokens",)  # the MTP layers are the target's own: no "model"
SPECULATIVE_KEYS = ("method", "model", *LOOKUP_KEYS, *SUFFIX_KEYS[1:])
# method -> (strategy, the keys it reads besides "method"): vLLM's methods, then this package's
# strategy names, whose settings are the pipeline's `ngram` (NgramSettings)
SPECULATIVE_METHODS: dict[str, tuple[str, tuple[str, ...]]] = {
    "ngram": ("ngram-simple", LOOKUP_KEYS),
    "draft_model": ("draft", MODEL_KEYS),
    "eagle3": ("eagle3", MODEL_KEYS),
    "eagle": ("eagle3", MODEL_KEYS),
    "dflash": ("dflash", MODEL_KEYS),
    "draft": ("draft", MODEL_KEYS),
    **{alias: (name, MODEL_KEYS) for alias, name in SPEC_TYPE_ALIASES.items()},  # draft-simple, draft-eagle3
    **{name: (name, ()) for name in PRIORITY if name.startswith("ngram-")},
    "suffix": ("suffix", SUFFIX_KEYS),
    # vLLM's "mtp", and the per-family names it also accepts for the layouts read here
    **{name: ("mtp", MTP_KEYS) for name in ("mtp", "draft-mtp", "deepseek_mtp", "mimo_mtp")},
}
# the strategies that draft with a model read from "model" -> what that model is
MODEL_KINDS = {"draft": "draft model", "eagle3": "EAGLE-3 head", "dflash": "DFlash drafter"}
VLLM_PROMPT_LOOKUP = 5  # vLLM's n-gram size when neither prompt_lookup_min nor _max is given


@dataclass(frozen=True)
class SpeculativeChoice:
    """What a vLLM-style speculative_config asks for, in this package's terms.

    - "ngram": prompt lookup, our ngram-simple (llama.cpp's): it matches the last
      prompt_lookup_max tokens (vLLM's default: prompt_lookup_min, else 5) and copies up to
      num_speculative_tokens of what followed. vLLM also tries shorter keys down to
      prompt_lookup_min; ngram-simple matches one size, so prompt_lookup_min only fills in a
      missing prompt_lookup_max and is checked to be no larger.
    - "draft_model" (also "draft", "draft-simple"): a draft model read from `model`, drafting
      up to num_speculative_tokens (`DraftModelConfig.n_max`, which stops earlier below p_min).
    - "eagle3" (also "eagle", "draft-eagle3"): an EAGLE-3 head read from `model`, likewise.
    - "dflash" (also "draft-dflash"): a DFlash drafter read from `model`, likewise (at most its
      block size less one).
    - "mtp" (also "draft-mtp", "deepseek_mtp", "mimo_mtp"): the target's own MTP layers,
      chained up to num_speculative_tokens; no `model`.
    - "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache": those
      strategies with the pipeline's `ngram` settings; no other key.
    - "suffix": SuffixDecoding, with the pipeline's `ngram.suffix` settings less those that
      vLLM's suffix_decoding_max_tree_depth, _max_spec_factor and _min_token_prob set, and
      num_speculative_tokens as the most draft nodes.
    `model` may be left out with the bundled target: the bundled draft or head is used."""

    spec_type: str
    method: str
    model: str | os.PathLike | None
    draft: DraftModelConfig
    ngram: NgramSettings

    @classmethod
    def read(
        cls, config: Mapping[str, Any], draft: DraftModelConfig, ngram: NgramSettings
    ) -> SpeculativeChoice:
        """draft, ngram: the pipeline's settings, which num_speculative_tokens and the lookup
        sizes change."""
        if not isinstance(config, Mapping):
            raise SpecdecodeError(f"speculative_config is a dict, not a {type(config).__name__}")
        unknown = [key for key in config if key not in SPECULATIVE_KEYS]
        if unknown:
            raise SpecdecodeError(
                f"unknown speculative_config key {unknown[0]!r} (known: {', '.join(SPECULATIVE_KEYS)})"
            )
        method = config.get("method")
        if method not in SPECULATIVE_METHODS:
            supported = ", ".join(SPECULATIVE_METHODS)
            raise SpecdecodeError(f"unknown speculative_config method {method!r} (supported: {supported})")
        spec_type, keys = SPECULATIVE_METHODS[method]
        extra = [key for key in config if key != "method" and key not in keys]
        if extra:
            reads = f"it reads {', '.join(keys)}" if keys else "its settings are the pipeline's ngram="
            raise SpecdecodeError(f"speculative_config method {method!r} takes no {extra[0]!r}: {reads}")
        tokens = _count(config, "num_speculative_tokens", 1)
        if (spec_type in MODEL_KINDS or spec_type == "mtp") and tokens is not None:
            draft = replace(draft, n_max=tokens)
        if method == "ngram":
            ngram = replace(ngram, simple=_prompt_lookup(config, tokens, ngram.simple))
        if method == "suffix":
            ngram = replace(ngram, suffix=_suffix(config, tokens, ngram.suffix))
        return cls(spec_type, method, config.get("model"), draft, ngram)

    def check_model(self, model: object) -> None:
        """A model-based method needs its model: given in the config, or the bundled one."""
        if self.spec_type in MODEL_KINDS and model is None:
            kind = MODEL_KINDS[self.spec_type]
            raise SpecdecodeError(
                f"speculative_config method {self.method!r} needs 'model': the {kind}'s directory"
                + (" or GGUF file" if self.spec_type == "draft" else "")
            )


def _count(config: Mapping[str, Any], key: str, least: int) -> int | None:
    value = config.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < least:
        raise SpecdecodeError(f"speculative_config {key!r} must be an integer >= {least}, not {value!r}")
    return value


def _suffix(config: Mapping[str, Any], tokens: int | None, suffix: SuffixConfig) -> SuffixConfig:
    """The suffix strategy's settings for vLLM's suffix_decoding keys (see `SpeculativeChoice`)."""
    changes: dict[str, Any] = {}
    depth = _count(config, "suffix_decoding_max_tree_depth", 1)
    if depth is not None:
        changes["max_depth"] = depth
    if tokens is not None:
        changes["max_nodes"] = tokens
    for key, field in (
        ("suffix_decoding_max_spec_factor", "factor"),
        ("suffix_decoding_min_token_prob", "min_prob"),
    ):
        value = config.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise SpecdecodeError(f"speculative_config {key!r} must be a number, not {value!r}")
        changes[field] = float(value)
    try:
        return replace(suffix, **changes)
    except SpecdecodeError as exc:  # the message names the flag: name the key too
        raise SpecdecodeError(f"speculative_config: {exc}") from None


def _prompt_lookup(config: Mapping[str, Any], tokens: int | None, simple: NgramMapConfig) -> NgramMapConfig:
    """ngram-simple's settings for vLLM's prompt lookup keys (see `SpeculativeChoice`)."""
    low, high = _count(config, "prompt_lookup_min", 1), _count(config, "prompt_lookup_max", 1)
    size_n = high if high is not None else low if low is not None else VLLM_PROMPT_LOOKUP
    if low is not None and low > size_n:
        raise SpecdecodeError(
            f"speculative_config prompt_lookup_min ({low}) exceeds prompt_lookup_max ({size_n})"
        )
    size_m = tokens if tokens is not None else simple.size_m
    if size_m < size_n:
        raise SpecdecodeError(
            f"speculative_config num_speculative_tokens ({size_m}) is below the n-gram size ({size_n}): "
            "ngram-simple (llama.cpp's) copies at least as many tokens as it matches, so it would never "
            "draft; raise num_speculative_tokens or lower prompt_lookup_max"
        )
    return replace(simple, size_n=size_n, size_m=size_m)
