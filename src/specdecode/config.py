"""What a user sets, free of heavy imports: the settings' dataclasses and the names the command
line offers (weights' dtypes, backends, passes, policies, verification modes, strategies).

The command's parsers read their defaults and choices here, so that `specdecode --help` and a
mistyped flag answer without loading torch. The modules that use each setting import it from
here, and it stays importable from them (`specdecode.sampling.SamplingParams`,
`specdecode.strategies.DraftModelConfig`, ...).
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.errors import SpecdecodeError

DTYPE_NAMES = ("float32", "float16", "bfloat16", "float64")  # weights' dtypes (and "auto")
PASSES = ("auto", "invariant", "fixed", "bucketed")  # the native forward's kinds of passes
BACKENDS = ("auto", "native", "hf", "llama.cpp")
SPEC_POLICIES = ("classic", "adaptive")
VERIFY_MODES = ("match", "rejection")
# GGUF file types the writer makes itself, by their gguf.LlamaFileType names (each tensor's type
# is the gguf.GGMLQuantizationType of the format's upper-case name); q4_k needs llama.cpp's
# quantizer (the llama-cpp extra).
GGUF_FORMATS = {  # written by the gguf package's own quantizer
    "f32": "ALL_F32",
    "f16": "MOSTLY_F16",
    "bf16": "MOSTLY_BF16",
    "q8_0": "MOSTLY_Q8_0",
    "q4_0": "MOSTLY_Q4_0",
    "q4_1": "MOSTLY_Q4_1",
}
LLAMA_CPP_FORMATS = ("q4_k", "q6_k")  # k-quants: llama.cpp's quantizer (q4_k: its Q4_K_M mix)

# The strategies in llama.cpp's fixed order, cheapest first; the chain instantiates the enabled
# ones in this order whatever order they were named in. `forced` (constrained generation only)
# comes last: a drafting model's masked draft already holds the forced tokens and goes on past
# them; an n-gram draft cut to nothing falls to it.
PRIORITY = (
    "ngram-simple",
    "ngram-map-k",
    "ngram-map-k4v",
    "ngram-mod",
    "ngram-cache",
    "suffix",
    "draft",
    "eagle3",
    "dflash",
    "mtp",
    "forced",
)
# llama.cpp's current --spec-type names of the model drafters -> the names used inside (and
# by older llama.cpp), which --spec-type accepts too.
SPEC_TYPE_ALIASES = {
    "draft-simple": "draft",
    "draft-eagle3": "eagle3",
    "draft-dflash": "dflash",
    "draft-mtp": "mtp",
}
SPEC_TYPE_NAMES = {inside: outside for outside, inside in SPEC_TYPE_ALIASES.items()}
# What a pipeline that asks for a model drafter without its model is told, in the library's
# terms and the command's.
NEEDS_DRAFT = (
    'the draft strategy (spec_types "draft", --spec-type draft-simple) needs a draft model: draft= (-md DIR)'
)
NEEDS_HEAD = (
    'the eagle3 strategy (spec_types "eagle3", --spec-type draft-eagle3) needs an EAGLE-3 head: '
    "eagle3= (-me DIR)"
)
NEEDS_DFLASH = (
    'the dflash strategy (spec_types "dflash", --spec-type draft-dflash) needs a DFlash drafter: '
    "dflash= (-mdf DIR)"
)
NEEDS_MTP = (
    'the mtp strategy (spec_types "mtp", --spec-type draft-mtp) needs the target\'s own MTP layers: '
    "mtp= (from the target's directory, -m DIR)"
)


def spec_type_name(name: str) -> str:
    """The --spec-type name users see for a strategy: llama.cpp's current one."""
    return SPEC_TYPE_NAMES.get(name, name)


def parse_spec_types(text: str) -> list[str]:
    """A comma-separated list of strategy names -> the enabled names in priority order, aliases
    read as the names used inside ("draft-simple" is "draft").

    "none" anywhere disables speculation, as in llama.cpp.
    """
    names = [part.strip() for part in text.split(",") if part.strip()]
    names = [SPEC_TYPE_ALIASES.get(name, name) for name in names]
    for name in names:
        if name != "none" and name not in PRIORITY:
            choices = ", ".join(spec_type_name(known) for known in ("none", *PRIORITY))
            raise SpecdecodeError(f"unknown --spec-type {name!r} (choose from: {choices})")
    if "none" in names:
        return []
    return [name for name in PRIORITY if name in names]


# The keywords other libraries' habits bring that this package has no setting for, and what to
# do instead: Hugging Face's generate and GenerationConfig, vLLM's SamplingParams.
NOT_OFFERED = {
    **dict.fromkeys(
        ("n", "best_of", "num_return_sequences"),
        "several answers to one prompt: give the prompt several times in a list, each with its own seed",
    ),
    **dict.fromkeys(
        ("num_beams", "use_beam_search", "length_penalty", "early_stopping"),
        "beam search is not offered: generation samples (or decodes greedily) token by token",
    ),
    **dict.fromkeys(
        ("logprobs", "prompt_logprobs", "output_scores", "output_logits", "return_dict_in_generate"),
        "token probabilities are not returned by the library (the server's logprobs and n_probs give them)",
    ),
    **dict.fromkeys(
        ("min_tokens", "min_new_tokens", "min_length"),
        "a least length is not offered: ignore_eos=True goes on past end-of-generation tokens",
    ),
    "max_length": "it counts the prompt too: max_new_tokens (or max_tokens, n_predict) counts the new tokens",
    **dict.fromkeys(
        ("stop_token_ids", "eos_token_id", "stop_strings"),
        "stop= takes the strings that end the text",
    ),
    **dict.fromkeys(
        ("bad_words", "bad_words_ids", "allowed_token_ids"),
        "logit_bias={token_id: -math.inf} keeps a token out; constraint= restricts the output",
    ),
    **dict.fromkeys(
        ("guided_decoding", "structured_outputs", "guided_json", "guided_regex", "guided_grammar"),
        'constraint=ConstraintSpec("json_schema" | "regex" | "grammar", text) restricts the output',
    ),
}


def unexpected_keyword(caller: str, name: str, known: Iterable[str]) -> TypeError:
    """Python's error for a keyword `caller` does not take, saying what to do instead where
    another library's habit brought it, else naming the closest keyword it takes."""
    message = f"{caller}() got an unexpected keyword argument {name!r}"
    if name in NOT_OFFERED:
        return TypeError(f"{message}: {NOT_OFFERED[name]}")
    close = difflib.get_close_matches(name, list(known), n=1)
    return TypeError(message + (f" (did you mean {close[0]!r}?)" if close else ""))


def one_length(lengths: Mapping[str, int | None]) -> int | None:
    """The most tokens to generate from its spellings (max_new_tokens, max_tokens, n_predict),
    those given as None left out: None if none is given, an error if two disagree."""
    given = {name: value for name, value in lengths.items() if value is not None}
    if len(set(given.values())) > 1:
        spelled = " and ".join(f"{name}={value}" for name, value in given.items())
        raise SpecdecodeError(f"{spelled} disagree: give the most tokens to generate once")
    return next(iter(given.values()), None)


@dataclass(frozen=True, init=False)
class SamplingParams:
    """Sampling settings. temperature <= 0 means greedy, and is the default: a library call
    that names no temperature decodes greedily, as Hugging Face's `generate` does, so that the
    same call gives the same text (and speculation pays most). The other defaults are
    llama.cpp's, as is the command line's temperature 0.8.

    It takes vLLM's and Hugging Face's spellings too (see `__init__`), and, as vLLM's does, the
    generation's max_tokens, stop and ignore_eos, which `Pipeline.generate` honours as it
    honours `GenerationConfig`'s (None: not set here)."""

    temperature: float
    top_k: int
    top_p: float
    min_p: float
    repeat_penalty: float
    repeat_last_n: int
    presence_penalty: float
    frequency_penalty: float
    seed: int | None
    # (token id, bias) pairs added to the logits before anything else (OpenAI's logit_bias);
    # -inf keeps a token out
    logit_bias: tuple[tuple[int, float], ...]
    max_tokens: int | None
    stop: tuple[str, ...] | None
    ignore_eos: bool | None

    def __init__(
        self,
        temperature: float | None = None,
        top_k: int = 40,
        top_p: float = 0.95,
        min_p: float = 0.05,
        repeat_penalty: float | None = None,
        repeat_last_n: int | None = None,
        presence_penalty: float = 0.0,
        frequency_penalty: float = 0.0,
        seed: int | None = None,
        logit_bias: Iterable[tuple[int, float]] | Mapping[int, float] = (),
        max_tokens: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool | None = None,
        *,
        repetition_penalty: float | None = None,
        do_sample: bool | None = None,
        max_new_tokens: int | None = None,
        n_predict: int | None = None,
        **other: object,
    ) -> None:
        """temperature: None is greedy (0), or 1 with do_sample=True.
        top_k: 0 (or vLLM's -1) disables it.
        repeat_penalty, repeat_last_n: llama.cpp's penalty over the last 64 tokens by default;
        repetition_penalty (Hugging Face's and vLLM's name) penalises as they do, over the whole
        context (repeat_last_n -1 unless given).
        logit_bias: (token id, bias) pairs, or vLLM's and OpenAI's {token id: bias}.
        do_sample: Hugging Face's switch: False decodes greedily whatever the temperature, True
        samples (at temperature 1 unless one is given).
        max_tokens (also max_new_tokens, n_predict), stop, ignore_eos: the generation's, as in
        vLLM's SamplingParams; None leaves them to `GenerationConfig`."""
        if other:
            raise unexpected_keyword("SamplingParams", next(iter(other)), self.keywords())
        if repetition_penalty is not None:
            if repeat_penalty is not None and repeat_penalty != repetition_penalty:
                raise SpecdecodeError(
                    f"repeat_penalty={repeat_penalty} and repetition_penalty={repetition_penalty} "
                    "disagree: give the penalty once"
                )
            repeat_penalty = repetition_penalty
            repeat_last_n = -1 if repeat_last_n is None else repeat_last_n
        if do_sample is False:
            temperature = 0.0
        elif do_sample is True:
            temperature = 1.0 if temperature is None else temperature
            if temperature <= 0:
                raise SpecdecodeError(
                    f"do_sample=True samples: it needs a temperature > 0, not {temperature}"
                )
        pairs = logit_bias.items() if isinstance(logit_bias, Mapping) else logit_bias
        values = {
            "temperature": 0.0 if temperature is None else temperature,
            "top_k": 0 if top_k == -1 else top_k,
            "top_p": top_p,
            "min_p": min_p,
            "repeat_penalty": 1.0 if repeat_penalty is None else repeat_penalty,
            "repeat_last_n": 64 if repeat_last_n is None else repeat_last_n,
            "presence_penalty": presence_penalty,
            "frequency_penalty": frequency_penalty,
            "seed": seed,
            "logit_bias": tuple((token, bias) for token, bias in pairs),
            "max_tokens": one_length(
                {"max_tokens": max_tokens, "max_new_tokens": max_new_tokens, "n_predict": n_predict}
            ),
            "stop": (stop,) if isinstance(stop, str) else None if stop is None else tuple(stop),
            "ignore_eos": ignore_eos,
        }
        for name, value in values.items():
            object.__setattr__(self, name, value)
        self._check()

    def _check(self) -> None:
        checks = [
            (math.isfinite(self.temperature), "temperature must be a finite number"),
            (self.top_k >= 0, "top_k must be >= 0 (0 or -1 disables it)"),
            (0.0 < self.top_p <= 1.0, "top_p must be in (0, 1]"),
            (0.0 <= self.min_p <= 1.0, "min_p must be in [0, 1]"),
            (self.repeat_penalty > 0.0, "repeat_penalty must be > 0 (1 disables it)"),
            (self.repeat_last_n >= -1, "repeat_last_n must be >= -1 (-1 = whole context)"),
            (math.isfinite(self.presence_penalty), "presence_penalty must be a finite number"),
            (math.isfinite(self.frequency_penalty), "frequency_penalty must be a finite number"),
            (self.seed is None or 0 <= self.seed < 2**64, "seed must be in [0, 2^64)"),
            (
                all(id >= 0 and (math.isfinite(bias) or bias == -math.inf) for id, bias in self.logit_bias),
                "logit_bias takes token ids >= 0 and biases that are numbers or -inf",
            ),
            (
                self.max_tokens is None or self.max_tokens == -1 or self.max_tokens >= 1,
                "max_tokens must be >= 1, or -1 for no limit",
            ),
            (
                self.stop is None or all(isinstance(text, str) for text in self.stop),
                f"stop strings must be strings, not {self.stop!r}",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise SpecdecodeError(message)

    @staticmethod
    def keywords() -> tuple[str, ...]:
        """The names the constructor takes: the fields and the other libraries' spellings."""
        code = SamplingParams.__init__.__code__
        return code.co_varnames[1 : code.co_argcount + code.co_kwonlyargcount]

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0

    @property
    def has_penalties(self) -> bool:
        return (
            self.repeat_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
        ) and self.repeat_last_n != 0


@dataclass(frozen=True)
class DraftModelConfig:
    """Classic llama.cpp defaults: n_max 16, n_min 0, p_min 0.75, p_split 0.1.

    Trees: `n_parallel` > 1 lets the draft model branch (llama.cpp's p_split scheme: a
    candidate other than the top one whose probability exceeds p_split opens a branch, up to
    n_parallel branches); `tree_tokens` > 0 makes an EAGLE-3 head draft an EAGLE-2 dynamic tree
    of that many nodes, expanding the `tree_topk` best nodes per depth by path probability.
    """

    n_max: int = 16
    n_min: int = 0
    p_min: float = 0.75
    p_split: float = 0.1
    n_parallel: int = 1
    tree_tokens: int = 0
    tree_topk: int = 4

    def __post_init__(self) -> None:
        if self.n_max < 1:
            raise SpecdecodeError("draft n_max (--spec-draft-n-max, --draft-max) must be >= 1")
        if self.n_min < 0:
            raise SpecdecodeError("draft n_min (--spec-draft-n-min, --draft-min) must be >= 0")
        if not 0.0 <= self.p_min <= 1.0:
            raise SpecdecodeError("draft p_min (--spec-draft-p-min, --draft-p-min) must be in [0, 1]")
        if not 0.0 <= self.p_split <= 1.0:
            raise SpecdecodeError("draft p_split (--spec-draft-p-split, --draft-p-split) must be in [0, 1]")
        if self.n_parallel < 1:
            raise SpecdecodeError("draft n_parallel (--draft-n-parallel) must be >= 1")
        if self.tree_tokens < 0:
            raise SpecdecodeError("draft tree_tokens (--draft-tree-tokens) must be >= 0 (0: a chain)")
        if self.tree_topk < 1:
            raise SpecdecodeError("draft tree_topk (--draft-tree-topk) must be >= 1")


@dataclass(frozen=True)
class NgramMapConfig:
    """llama.cpp's `common_params_speculative_ngram_map`: key n-gram size, value m-gram size,
    and (ngram-map-k4v only) how many lookups must hit a key before it drafts."""

    size_n: int = 12
    size_m: int = 48
    min_hits: int = 1

    def __post_init__(self) -> None:
        if not 1 <= self.size_n <= 1024 or not 1 <= self.size_m <= 1024:
            raise SpecdecodeError("n-gram size-n and size-m must be in 1..1024")
        if self.min_hits < 1:
            raise SpecdecodeError("n-gram min-hits must be >= 1")


@dataclass(frozen=True)
class NgramModConfig:
    n_match: int = 24
    n_min: int = 48
    n_max: int = 64

    def __post_init__(self) -> None:
        if not 1 <= self.n_match <= 1024 or not 0 <= self.n_min <= 1024 or not 0 <= self.n_max <= 1024:
            raise SpecdecodeError("ngram-mod n-match must be in 1..1024, n-min and n-max in 0..1024")


@dataclass(frozen=True)
class SuffixConfig:
    """The suffix strategy (SuffixDecoding's defaults where it has them): drafts at most
    max_depth tokens deep (the longest suffix matched is as long), at most factor x the
    matched length nodes (and never more than max_nodes), each node's token having followed
    its path with a frequency of at least min_prob; the process-wide index of earlier requests
    is kept under cache_mb megabytes, the oldest requests evicted first."""

    max_depth: int = 24
    factor: float = 1.0
    min_prob: float = 0.1
    max_nodes: int = 32
    cache_mb: float = 256.0

    def __post_init__(self) -> None:
        checks = [
            (1 <= self.max_depth <= 256, "suffix max_depth (--spec-suffix-max-depth) must be in 1..256"),
            (
                math.isfinite(self.factor) and self.factor > 0.0,
                "suffix factor (--spec-suffix-factor) must be > 0",
            ),
            (0.0 <= self.min_prob <= 1.0, "suffix min_prob (--spec-suffix-min-prob) must be in [0, 1]"),
            (1 <= self.max_nodes <= 1024, "suffix max_nodes (--spec-suffix-max-nodes) must be in 1..1024"),
            (
                math.isfinite(self.cache_mb) and self.cache_mb >= 0.0,
                "suffix cache_mb (--spec-suffix-cache-mb) must be >= 0",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise SpecdecodeError(message)


@dataclass(frozen=True)
class NgramSettings:
    """Settings of the model-free strategies (llama.cpp's defaults; suffix: SuffixDecoding's)."""

    simple: NgramMapConfig = field(default_factory=NgramMapConfig)
    map_k: NgramMapConfig = field(default_factory=NgramMapConfig)
    map_k4v: NgramMapConfig = field(default_factory=NgramMapConfig)
    mod: NgramModConfig = field(default_factory=NgramModConfig)
    cache_static: Path | None = None  # -lcs: read once
    cache_dynamic: Path | None = None  # -lcd: read once, updated and saved after each generation
    suffix: SuffixConfig = field(default_factory=SuffixConfig)
    suffix_file: Path | None = None  # --spec-suffix-file: read once, saved after each generation
