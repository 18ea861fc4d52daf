"""The systems a benchmark compares: ours with each strategy and chain, and Hugging Face's `generate`.

A system turns prompt ids into a fixed number of greedy tokens and says how long that took,
end to end (prompt evaluation included), timed the same way for every system. All systems
share the same loaded target (and draft) weights, so they differ only in how they decode.
End-of-generation tokens do not stop any system: every run does the same amount of work.

A system of ours named with the suffix "@adaptive" (draft@adaptive, ngram-simple,draft@adaptive)
runs the adaptive policy instead of the classic chain; its `PolicyModels` are timed once when
the system is built and then learn across all of its runs, as a server's would across requests.
The suffix "@P/N" runs the classic chain with --spec-draft-p-min P and --spec-draft-n-max N instead of the
run's (draft@0.3/6): the static settings an adaptive system is compared with.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Protocol

import torch
from transformers import GenerationConfig as HFGenerationConfig
from transformers.utils import logging as hf_logging

from specdecode.api import BESIDE_A_DRAFT, Pipeline
from specdecode.backends.hf import HFBackend
from specdecode.bench.machine import Stopwatch
from specdecode.bench.traces import TraceStep, record_steps
from specdecode.errors import SpecdecodeError
from specdecode.generate import GenerationConfig
from specdecode.policy import PolicyModels
from specdecode.sampling import SamplingParams
from specdecode.stats import GenerationStats
from specdecode.strategies import PRIORITY, DraftModelConfig, NgramSettings
from specdecode.strategies.dflash_head import DFlashHead
from specdecode.strategies.eagle3_head import Eagle3Head
from specdecode.strategies.mtp_head import MtpLayer

GREEDY = SamplingParams(temperature=0)
MODEL_FREE = ("ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-mod", "ngram-cache", "suffix")
CHAINS = (("ngram-simple", "draft"), ("ngram-mod", "ngram-map-k4v", "draft"))
EAGLE3_SYSTEMS = ("eagle3", "ngram-simple,eagle3")  # when an EAGLE-3 head is loaded
MTP_SYSTEMS = ("mtp", "ngram-simple,mtp")  # when the target has MTP layers
DFLASH_SYSTEMS = ("dflash", "dflash-tree")  # when a DFlash drafter is loaded
# Trees: "draft-tree" is the draft strategy with --draft-n-parallel branches, "eagle3-tree" the
# head with a --draft-tree-tokens dynamic tree; every other system drafts chains.
DRAFT_TREE_SYSTEMS = ("draft-tree", "ngram-simple,draft-tree")
EAGLE3_TREE_SYSTEMS = ("eagle3-tree", "ngram-simple,eagle3-tree")
TREES = {"draft-tree": "draft", "eagle3-tree": "eagle3", "dflash-tree": "dflash"}
# Hugging Face's documented example value; its n-gram size stays at the default (2).
HF_PROMPT_LOOKUP_TOKENS = 10
ADAPTIVE = "@adaptive"


@dataclass
class Run:
    tokens: list[int]
    seconds: float
    cpu_seconds: float  # this process's CPU time over the run (see `bench.machine.Stopwatch`)
    stats: GenerationStats | None  # ours only: Hugging Face reports no counters
    steps: list[TraceStep] | None = None  # ours, when recording acceptance traces


class System(Protocol):
    name: str
    family: str  # "ours" or "hf"

    def run(self, prompt: list[int], n_predict: int, sampling: SamplingParams = GREEDY) -> Run: ...

    def session(self) -> Callable[[list[int], int, SamplingParams], Run]:
        """What runs a session's turns in order: as `run`, but what a system keeps between
        requests (a pipeline's n-gram pools and caches, its KV cache) is kept between turns."""
        ...


class OursSystem:
    """Our pipeline, started cold on every run: a fresh pipeline (so the ngram-mod pool and the
    n-gram caches have not seen the previous run of the same prompt, which they would replay)
    over backends whose KV caches are emptied (so no run skips its prompt's evaluation, as
    Hugging Face's `generate` never does)."""

    family = "ours"

    def __init__(
        self,
        name: str,
        make_pipeline: Callable[[], Pipeline],
        policy_models: PolicyModels | None = None,
        spec_types: Sequence[str] = (),
        tree: bool = False,
        drafting: DraftModelConfig | None = None,
    ) -> None:
        self.name = name
        self.make_pipeline = make_pipeline
        self.policy_models = policy_models  # the adaptive policy's, shared by every run
        self.spec_types = list(spec_types)  # its strategies' names (none: plain)
        self.tree = tree  # drafts token trees
        self.drafting = drafting  # its drafting settings
        self.keep_steps = False  # keep each run's steps in its Run (acceptance traces)

    def run(self, prompt: list[int], n_predict: int, sampling: SamplingParams = GREEDY) -> Run:
        return self.session()(prompt, n_predict, sampling)

    def session(self) -> Callable[[list[int], int, SamplingParams], Run]:
        """A fresh pipeline over emptied KV caches, kept for every turn: a turn's prompt reuses
        the cached prefix of the conversation, and the n-gram pools learn from every answer."""
        pipeline = self.make_pipeline()
        for backend in (pipeline.target, pipeline.draft):
            if backend is not None:
                backend.truncate(0)

        def turn(prompt: list[int], n_predict: int, sampling: SamplingParams = GREEDY) -> Run:
            config = GenerationConfig(n_predict=n_predict, ignore_eos=True)
            began = Stopwatch()
            if not self.keep_steps:
                result = pipeline.generate(prompt, sampling, config)
                return Run(result.tokens, *began.elapsed(), result.stats)
            generation = pipeline.stream(prompt, sampling, config)  # as generate runs it, steps kept
            steps = record_steps(generation)
            for _ in generation:
                pass
            return Run(generation.tokens, *began.elapsed(), generation.stats, steps)

        return turn


class HFSystem:
    """`model.generate(...)` as a transformers user would call it, greedy, EOS not stopping."""

    family = "hf"

    def __init__(self, name: str, target: HFBackend, assistant: HFBackend | None = None, **options) -> None:
        elsewhere = [
            model.name
            for model in (target, assistant)
            if model is not None and not isinstance(model, HFBackend)
        ]
        if elsewhere:
            raise SpecdecodeError(
                f"{name} runs transformers' generate: it needs models in PyTorch, and {elsewhere[0]} runs "
                "on llama.cpp (--backend native, or hf, keeps every model on PyTorch; a GGUF file "
                "runs there too, dequantized)"
            )
        self.name = name
        self.model = target.model
        self.assistant = assistant.model if assistant is not None else None
        self.options = options
        self.pad_id = target.tokenizer.pad_token_id if target.tokenizer.pad_token_id is not None else 0

    def run(self, prompt: list[int], n_predict: int, sampling: SamplingParams = GREEDY) -> Run:
        """Greedy, or sampled with our sampler's settings (its seed seeds torch's generator)."""
        sampled = {}
        if not sampling.greedy:
            sampled = {"temperature": sampling.temperature, "top_k": sampling.top_k or None}
            sampled |= {"top_p": sampling.top_p, "min_p": sampling.min_p or None}
            torch.manual_seed(sampling.seed or 0)
        config = HFGenerationConfig(
            max_new_tokens=n_predict,
            do_sample=not sampling.greedy,
            eos_token_id=[],  # no end of generation (None would take the model's own)
            pad_token_id=self.pad_id,
            **sampled,
            **self.options,
        )
        began = Stopwatch()
        ids = torch.tensor([prompt], device=self.model.device)
        with torch.inference_mode():
            out = self.model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=config,
                assistant_model=self.assistant,
            )
        tokens = out[0, len(prompt) :].tolist()
        return Run(tokens, *began.elapsed(), None)

    def session(self) -> Callable[[list[int], int, SamplingParams], Run]:
        """`generate` keeps nothing between calls: each turn reads its whole prompt."""
        return self.run


def system_names(
    has_draft: bool,
    include_hf: bool,
    has_eagle3: bool = False,
    has_mtp: bool = False,
    has_dflash: bool = False,
) -> list[str]:
    """Every system the suite knows for these models, in table order."""
    ours = ["plain", *MODEL_FREE]
    if has_draft:
        ours += ["draft", *(",".join(chain) for chain in CHAINS), *DRAFT_TREE_SYSTEMS]
    if has_eagle3:
        ours += [*EAGLE3_SYSTEMS, *EAGLE3_TREE_SYSTEMS]
    if has_mtp:
        ours += list(MTP_SYSTEMS)
    if has_dflash:
        ours += list(DFLASH_SYSTEMS)
    hf = ["hf-plain", "hf-prompt-lookup"] + (["hf-assisted"] if has_draft else [])
    return ours + (hf if include_hf else [])


def quick_system_names(
    has_draft: bool,
    include_hf: bool,
    has_eagle3: bool = False,
    has_mtp: bool = False,
    has_dflash: bool = False,
) -> list[str]:
    """`bench --quick`'s systems: a first look in a few CPU-minutes, not every strategy. Ours
    plain; with a draft, llama.cpp's classic draft-model drafting and what `generate` runs by
    default (the adaptive chain of `api.BESIDE_A_DRAFT` and the draft); without one, ngram-mod
    (our fastest model-free strategy measured) and the default (that n-gram chain, adaptive);
    eagle3 when a head is given (-me), mtp when the target has MTP layers, dflash when a DFlash
    drafter is given (-mdf); then
    Hugging Face's plain `generate` (the ×HF baseline) and its speculation for these models
    (assisted by the same draft, or else prompt lookup)."""
    ours = ["plain"]
    if has_draft:
        ours += ["draft", ",".join([*BESIDE_A_DRAFT, "draft"]) + ADAPTIVE]
    else:
        ours += ["ngram-mod", ",".join(BESIDE_A_DRAFT) + ADAPTIVE]
    if has_eagle3:
        ours.append("eagle3")
    if has_mtp:
        ours.append("mtp")
    if has_dflash:
        ours.append("dflash")
    hf = ["hf-plain", "hf-assisted" if has_draft else "hf-prompt-lookup"]
    return ours + (hf if include_hf else [])


def build_systems(
    names: Sequence[str],
    target: HFBackend,
    draft: HFBackend | None,
    draft_config: DraftModelConfig,
    ngram: NgramSettings,
    eagle3: Eagle3Head | None = None,
    mtp: MtpLayer | None = None,
    dflash: DFlashHead | None = None,
) -> list[System]:
    """The named systems over the loaded models; "plain" always comes first (the baseline), then
    ours (adaptive ones included), then Hugging Face's."""
    known = system_names(draft is not None, True, eagle3 is not None, mtp is not None, dflash is not None)
    ours = [name for name in known if not name.startswith("hf-") and name != "plain"]
    known += [name + ADAPTIVE for name in ours]
    strategies = chain_parts(draft is not None, eagle3 is not None, mtp is not None, dflash is not None)
    unknown = [name for name in names if static_base(name) not in known and not is_chain(name, strategies)]
    if unknown:
        raise SpecdecodeError(
            f"unknown or unavailable system {unknown[0]!r} (with these models: {', '.join(known)}; "
            f"a chain joins distinct ones of {', '.join(strategies)}; "
            "a classic one may end in @P/N for --spec-draft-p-min P and --spec-draft-n-max N)"
        )
    chosen = [name for name in known if name in names and name != "plain"]
    ordered = ["plain", *sorted(chosen, key=lambda name: name.startswith("hf-"))]  # ours, then HF's
    ordered += [name for name in names if name not in known and name not in ordered]  # @P/N, as asked
    hf_logging.set_verbosity_error()  # its deprecation notices would drown the progress bar
    return [_system(name, target, draft, draft_config, ngram, eagle3, mtp, dflash) for name in ordered]


def _system(
    name: str,
    target: HFBackend,
    draft: HFBackend | None,
    draft_config: DraftModelConfig,
    ngram: NgramSettings,
    eagle3: Eagle3Head | None,
    mtp: MtpLayer | None = None,
    dflash: DFlashHead | None = None,
) -> System:
    if name == "hf-plain":
        return HFSystem(name, target)
    if name == "hf-prompt-lookup":
        return HFSystem(name, target, prompt_lookup_num_tokens=HF_PROMPT_LOOKUP_TOKENS)
    if name == "hf-assisted":
        return HFSystem(name, target, assistant=draft)
    adaptive = name.endswith(ADAPTIVE)
    base = static_base(name)
    if base != name:
        draft_config = replace(draft_config, **static_setting(name))
    parts = [] if name == "plain" else base.removesuffix(ADAPTIVE).split(",")
    spec_types = sorted((TREES.get(part, part) for part in parts), key=PRIORITY.index)
    config = replace(
        draft_config,
        n_parallel=draft_config.n_parallel if "draft-tree" in parts else 1,
        tree_tokens=draft_config.tree_tokens if {"eagle3-tree", "dflash-tree"} & set(parts) else 0,
    )
    drafts = {"draft": draft} if draft is not None and "draft" in spec_types else None
    models = PolicyModels.for_target(target, drafts=drafts) if adaptive else None
    return OursSystem(
        name,
        lambda: Pipeline(
            target,
            draft if "draft" in spec_types else None,
            eagle3=eagle3 if "eagle3" in spec_types else None,
            mtp=mtp if "mtp" in spec_types else None,
            dflash=dflash if "dflash" in spec_types else None,
            spec_types=spec_types,
            draft_config=config,
            ngram=ngram,
            spec_policy="adaptive" if adaptive else "classic",
            policy_models=models,
        ),
        models,
        spec_types,
        tree=bool(set(TREES) & set(parts)),
        drafting=config,
    )


def chain_parts(
    has_draft: bool, has_eagle3: bool, has_mtp: bool = False, has_dflash: bool = False
) -> list[str]:
    """The strategies a chain of these models may join."""
    parts = [*MODEL_FREE]
    if has_draft:
        parts += ["draft", "draft-tree"]
    if has_eagle3:
        parts += ["eagle3", "eagle3-tree"]
    if has_mtp:
        parts.append("mtp")
    if has_dflash:
        parts += ["dflash", "dflash-tree"]
    return parts


def is_chain(name: str, strategies: Sequence[str]) -> bool:
    """Whether a system name (less any @adaptive or @P/N) joins distinct `strategies` with commas:
    any chain is a system, not only the ones the suite runs by default (ngram-simple,ngram-mod)."""
    parts = static_base(name).removesuffix(ADAPTIVE).split(",")
    runs = [TREES.get(part, part) for part in parts]  # draft-tree drafts as draft does
    return set(parts) <= set(strategies) and len(set(runs)) == len(runs)


def static_base(name: str) -> str:
    """The system a static-setting name runs (draft@0.3/6 -> draft); other names unchanged."""
    base, at, setting = name.rpartition("@")
    return base if at and "/" in setting else name


def static_setting(name: str) -> dict:
    """The DraftModelConfig fields a name's "@P/N" sets (p_min P, n_max N)."""
    p_min, _, n_max = name.rpartition("@")[2].partition("/")
    try:
        setting = {"p_min": float(p_min), "n_max": int(n_max)}
    except ValueError:
        raise SpecdecodeError(f"system {name!r}: the setting after @ is P/N, e.g. draft@0.3/6") from None
    if not 0.0 <= setting["p_min"] <= 1.0 or setting["n_max"] < 1:
        raise SpecdecodeError(f"system {name!r}: P must be in [0, 1] and N >= 1")
    return setting


def static_grid(
    names: Sequence[str], p_mins: Sequence[float], draft_maxes: Sequence[int], given: DraftModelConfig
) -> list[str]:
    """Every classic system of `names` that drafts with a model, at each p_min x draft-max but
    the run's own (`given`: that one is the system itself)."""
    grid = []
    for name in names:
        parts = name.split(",")
        if (
            name.endswith(ADAPTIVE)
            or static_base(name) != name
            or not {"draft", "eagle3", "dflash", "mtp"} & set(parts)
        ):
            continue
        grid += [
            f"{name}@{p_min:g}/{n_max}"
            for p_min in p_mins
            for n_max in draft_maxes
            if (p_min, n_max) != (given.p_min, given.n_max)
        ]
    return grid


def draft_max_systems(
    values: Sequence[int], target: HFBackend, draft: HFBackend, draft_config: DraftModelConfig
) -> list[System]:
    """The draft strategy at several --draft-max values (for the speed-up vs draft-max sweep)."""

    def pipeline_at(n_max: int) -> Callable[[], Pipeline]:
        config = replace(draft_config, n_max=n_max, n_min=min(draft_config.n_min, n_max), n_parallel=1)
        return lambda: Pipeline(target, draft, spec_types=["draft"], draft_config=config)

    return [OursSystem(f"draft-max {n_max}", pipeline_at(n_max), spec_types=["draft"]) for n_max in values]


def trace_facts(system: System) -> dict | None:
    """What an acceptance trace's header says of a system of ours (`bench --record-traces`):
    its strategies ("spec", llama.cpp's "none" for plain), whether it drafts trees, and the
    drafting settings of a model that drafts; None for Hugging Face's."""
    if not isinstance(system, OursSystem):
        return None
    facts: dict = {"spec": ",".join(system.spec_types) or "none", "tree": system.tree}
    config = system.drafting
    if config is not None and {"draft", "eagle3", "dflash", "mtp"} & set(system.spec_types):
        facts |= {"draft_n_max": config.n_max, "draft_n_min": config.n_min, "draft_p_min": config.p_min}
        if config.n_parallel > 1:
            facts |= {"draft_n_parallel": config.n_parallel, "draft_p_split": config.p_split}
        if config.tree_tokens:
            facts |= {"draft_tree_tokens": config.tree_tokens, "draft_tree_topk": config.tree_topk}
    if system.spec_types:
        facts["policy"] = "classic" if system.policy_models is None else "adaptive"
    return facts
