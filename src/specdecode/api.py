"""The Python API: load a target (and what drafts for it) once, generate many times.

    from specdecode import Pipeline
    pipe = Pipeline.load()  # the bundled pair; or Pipeline.load("path/to/target", draft="path/to/draft")
    result = pipe.generate("def fib(n):", max_new_tokens=64)  # greedy unless temperature > 0
    print(result.text, result.stats.tokens_per_pass)
    for result in pipe.generate(["def fib(n):", "class Stack:"], max_new_tokens=32):  # one batch
        print(result.text)
    for chunk in (run := pipe.stream("def fib(n):", temperature=0.7, seed=3)):
        print(chunk.text, end="")
    print(run.stats.format())

A model may also be a transformers model already in memory (`Pipeline.load(model,
tokenizer=tokenizer, draft=draft_model)`), the drafting an EAGLE-3 head (`eagle3="path/to/head"`),
a DFlash drafter (`dflash="path/to/drafter"`) or a strategy chosen in vLLM's terms
(`speculative_config={"method": "ngram", ...}`). Settings go as keywords in Hugging Face's,
vLLM's or llama.cpp's spellings, or as `SamplingParams` and `GenerationConfig` objects.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Unpack, overload

from specdecode.backends import Backend
from specdecode.backends.gather import DraftPasses, GatheredBackend, GatheredHead
from specdecode.backends.hf_gguf import Use
from specdecode.backends.load import backend_from_model, check_model_path, check_not_hub_id, load_backend
from specdecode.backends.options import LoadOptions
from specdecode.chain import Chain
from specdecode.config import (
    NEEDS_DFLASH,
    NEEDS_DRAFT,
    NEEDS_HEAD,
    NEEDS_MTP,
    PRIORITY,
    SPEC_TYPE_ALIASES,
    DraftModelConfig,
    NgramSettings,
)
from specdecode.constraints import Constraint, ConstraintSpec
from specdecode.defaults import bundled_dflash, bundled_eagle3, bundled_pair
from specdecode.errors import SpecdecodeError
from specdecode.generate import Generation, GenerationConfig, chars_per_token, check_room, check_text_room
from specdecode.keywords import GenerateKeywords, Prompt, check_keywords, is_batch, settings_from
from specdecode.policy import AdaptivePolicy, PolicyModels, check_policy
from specdecode.sampling import Sampler, SamplingParams
from specdecode.scheduler import BatchEngine, Entry, LoadRule
from specdecode.speculative_config import SpeculativeChoice
from specdecode.stats import GenerationStats
from specdecode.strategies import SharedState, SpecSetup, build_strategies, dflash_checkpoint
from specdecode.strategies.dflash_head import DFlashHead
from specdecode.strategies.eagle3_checkpoint import load_head
from specdecode.strategies.eagle3_head import Eagle3Head
from specdecode.strategies.mtp_checkpoint import load_mtp
from specdecode.strategies.mtp_head import MtpLayer
from specdecode.vocab import VocabTranslator, vocab_difference

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

Progress = Callable[[str], None]


# Model-free strategies the adaptive policy asks beside a draft model when no strategies are
# named: their drafts cost microseconds and are verified only where they pay, and where the
# model cannot pay (a CPU whose every verify row costs nearly a plain step) a copy still can.
BESIDE_A_DRAFT = ["ngram-mod", "ngram-map-k4v"]


@dataclass
class Result:
    """One finished generation: its text, its token ids and how it went (`stats.format()`)."""

    text: str
    tokens: list[int]
    stats: GenerationStats


def checks_rows_first(target: Backend) -> bool:
    """Whether the target's multi-row passes must be checked against one-row passes before a
    draft is verified (llama.cpp's row probe, `specdecode.backends.llama_probe`): tens of
    seconds at a small model's first start, minutes at a large one's, once per model and
    machine. Where nothing asked for drafting, a plain run does not pay that for n-gram drafts
    that may never come. Asked of the class: the instance's property runs the probe."""
    return hasattr(type(target), "vouched_rows")


class Pipeline:
    """A target model, an optional draft model and EAGLE-3 head, and the strategies to use."""

    def __init__(
        self,
        target: Backend,
        draft: Backend | None = None,
        *,
        spec_types: Sequence[str] | None = None,
        draft_config: DraftModelConfig = DraftModelConfig(),
        ngram: NgramSettings = NgramSettings(),
        replacements: Sequence[tuple[str, str]] | None = None,
        shared: SharedState | None = None,
        eagle3: Eagle3Head | None = None,
        dflash: DFlashHead | None = None,
        mtp: MtpLayer | None = None,
        spec_policy: str = "classic",
        policy_models: PolicyModels | None = None,
        progress: Progress | None = None,
    ) -> None:
        """spec_types: enabled strategy names (None: "draft" when a draft is given, with
        BESIDE_A_DRAFT under the adaptive policy, "eagle3" when a head is and "dflash" when a
        DFlash drafter is; with none of these, BESIDE_A_DRAFT alone under the adaptive policy
        (model-free, and the policy drafts only where it pays) where the target's rows need no
        check first (`checks_rows_first`), nothing under the classic one, as llama.cpp drafts
        nothing without a draft model; []: plain);
        llama.cpp's "draft-simple", "draft-eagle3" and "draft-dflash" name the last three.
        ngram: settings of the model-free strategies; their shared state (the ngram-mod pool,
        the ngram-cache files) lives as long as the pipeline.
        replacements: (target text, draft text) pairs; given (even empty), a draft whose
        vocabulary differs is used through text translation instead of being refused.
        shared: state to share with other pipelines (see `fork`); None makes the pipeline's own.
        eagle3: a head loaded for this target (`specdecode.strategies.eagle3_checkpoint.load_head`).
        dflash: a DFlash drafter loaded for this target (`specdecode.strategies.dflash_checkpoint.load_head`).
        mtp: the target's own MTP layer (`specdecode.strategies.mtp_checkpoint.load_mtp`); "mtp"
        (llama.cpp's "draft-mtp") names its strategy.
        spec_policy: "classic" (llama.cpp's fixed chain and p_min) or "adaptive" (each step
        drafts what maximises expected tokens per second, see `specdecode.policy`).
        policy_models: what the adaptive policy has learned, to share (None: new models whose
        pass costs are timed on the target now, or reused from an earlier run's timing, by
        `specdecode.costs.calibrate`, once the arguments are checked).
        progress: told when the target's passes are being timed (a start-up phase that takes a
        while) or their timings from an earlier run reused; forks are silent."""
        self.target = target
        self.draft = draft
        self.eagle3 = eagle3
        self.dflash = dflash
        self.mtp = mtp
        if spec_types is None:
            spec_types = (["draft"] if draft else []) + (["eagle3"] if eagle3 is not None else [])
            spec_types += ["dflash"] if dflash is not None else []
            spec_types += ["mtp"] if mtp is not None else []
            if spec_policy == "adaptive" and (draft or not (spec_types or checks_rows_first(target))):
                spec_types += BESIDE_A_DRAFT
        self.spec_types = strategy_names(spec_types)
        self.draft_config = draft_config
        self.ngram = ngram
        self.replacements = replacements
        self.translator = self._translator(replacements)
        if "draft" in self.spec_types and draft is None:
            raise SpecdecodeError(NEEDS_DRAFT)
        if "eagle3" in self.spec_types and eagle3 is None:
            raise SpecdecodeError(NEEDS_HEAD)
        if "dflash" in self.spec_types and dflash is None:
            raise SpecdecodeError(NEEDS_DFLASH)
        if "mtp" in self.spec_types and mtp is None:
            raise SpecdecodeError(NEEDS_MTP)
        self.shared = shared if shared is not None else SharedState(ngram, self.spec_types, target.vocab.size)
        self.spec_policy = check_policy(spec_policy)
        self.policy_models = None
        self._load_rule: LoadRule | None = None
        self._batch: tuple[DraftPasses | None, list[Pipeline]] | None = None  # see _seats
        self._chars_per_token: int | None = None  # see check_text
        if spec_policy == "adaptive" and self.spec_types:
            drafts = {"draft": draft} if draft is not None and "draft" in self.spec_types else None
            self.policy_models = (
                policy_models
                if policy_models is not None
                else PolicyModels.for_target(target, progress, drafts)
            )

    @classmethod
    def load(
        cls,
        model: str | os.PathLike | PreTrainedModel | None = None,
        draft: str | os.PathLike | PreTrainedModel | None = None,
        *,
        tokenizer: PreTrainedTokenizerBase | None = None,
        draft_tokenizer: PreTrainedTokenizerBase | None = None,
        eagle3: str | os.PathLike | None = None,
        eagle3_layer_offset: int | None = None,
        dflash: str | os.PathLike | None = None,
        speculative_config: Mapping[str, Any] | None = None,
        target_options: LoadOptions = LoadOptions(),
        draft_options: LoadOptions = LoadOptions(),
        progress: Progress | None = None,
        **settings: Any,
    ) -> Pipeline:
        """Load a target and what drafts for it. Without a draft, a head, spec_types or a
        speculative_config the pipeline drafts with the n-gram chain BESIDE_A_DRAFT under
        spec_policy="adaptive" on a target that needs no row check first (not llama.cpp's:
        `checks_rows_first`), and generates plainly otherwise and under "classic" (the
        default here).

        model: a local Hugging Face directory, a GGUF file, or a transformers model already in
        memory with its `tokenizer` (used where it is, see `backend_from_model`). None: the
        bundled target, with the bundled draft unless the strategies asked for need none.
        draft: a draft model of the same kinds; one in memory uses `draft_tokenizer`, by default
        the target's tokenizer.
        eagle3: the directory of an EAGLE-3 head trained for this target.
        dflash: the directory of a DFlash drafter trained for this target (z-lab's layout).
        An "mtp" in spec_types (or speculative_config's method "mtp") reads the target's own MTP
        layer from `model`, which must then be a directory.
        speculative_config: the strategy in vLLM's terms instead of draft/eagle3/dflash/spec_types
        (see `SpeculativeChoice`).
        progress: called with a line as each start-up phase begins (loading each model, timing
        the target for the adaptive policy; for a GGUF file on llama.cpp, its row probe and,
        when first asked for, its tokenizer), for a command to show.
        settings: the pipeline's own (spec_types, draft_config, ngram, spec_policy, ...)."""
        say = progress or _silent
        choice = None
        if speculative_config is not None:
            models = (draft, eagle3, dflash, settings.get("spec_types"))
            if any(given is not None for given in models):
                raise SpecdecodeError(
                    "speculative_config chooses the strategy and its model: give it without draft=, "
                    "eagle3=, dflash= or spec_types="
                )
            choice = SpeculativeChoice.read(
                speculative_config,
                settings.get("draft_config", DraftModelConfig()),
                settings.get("ngram", NgramSettings()),
            )
            settings.update(spec_types=[choice.spec_type], draft_config=choice.draft, ngram=choice.ngram)
            draft = choice.model if choice.spec_type == "draft" else None
            eagle3 = choice.model if choice.spec_type == "eagle3" else None
            dflash = choice.model if choice.spec_type == "dflash" else None
        if model is None:
            names = settings.get("spec_types")  # a DFlash drafter alone needs no bundled draft
            names = ["dflash"] if names is None and dflash is not None and eagle3 is None else names
            model, draft, eagle3, dflash = _with_bundled(draft, eagle3, dflash, names)
        if choice is not None:
            choice.check_model({"draft": draft, "eagle3": eagle3, "dflash": dflash}.get(choice.spec_type))
        for source in (model, draft):  # a missing draft is said before the target loads
            if _is_path(source):
                check_model_path(source)
        if eagle3 is not None:
            check_not_hub_id(eagle3)  # heads are published on the Hub too
            if not Path(eagle3).is_dir():  # said before the target loads, as a missing draft is
                raise SpecdecodeError(f"EAGLE-3 head directory not found: {eagle3}")
        if dflash is not None:
            check_not_hub_id(dflash)
            if not Path(dflash).is_dir():
                raise SpecdecodeError(f"DFlash drafter directory not found: {dflash}")
        # a head's target may not go where auto runs other targets (see specdecode.backends.hf_gguf)
        asks_mtp = "mtp" in strategy_names(settings.get("spec_types") or [])
        if asks_mtp and not _is_path(model):
            raise SpecdecodeError(
                "the mtp strategy reads the MTP layers from the target's directory: give its path"
            )
        use: Use = "hidden" if eagle3 is not None or dflash is not None or asks_mtp else "target"
        target = _load_model(model, tokenizer, target_options, "target", say, use)
        draft_backend = None
        if draft is not None:
            if draft_tokenizer is None and not _is_path(draft):
                draft_tokenizer = getattr(target, "tokenizer", None)
            draft_backend = _load_model(draft, draft_tokenizer, draft_options, "draft", say, "draft")
        head = None
        if eagle3 is not None:
            say(f"loading the EAGLE-3 head from {eagle3}")
            head = load_head(eagle3, target, eagle3_layer_offset)
        drafter = None
        if dflash is not None:
            say(f"loading the DFlash drafter from {dflash}")
            drafter = dflash_checkpoint.load_head(dflash, target)
        mtp = None
        if asks_mtp:
            say(f"loading the MTP layer from {model}")
            mtp = load_mtp(model, target)
        return cls(target, draft_backend, eagle3=head, dflash=drafter, mtp=mtp, progress=progress, **settings)

    def fork(self, draft_passes: DraftPasses | None = None) -> Pipeline:
        """A pipeline over the same weights with its own KV caches and per-generation state,
        sharing this one's SharedState: one fork per generation run in parallel (the server's
        slots, generate_batch's sequences). Needs backends that fork (HFBackend does).

        draft_passes: the rounds of a `BatchEngine` that batch the draft model's passes
        across its sequences (see `specdecode.backends.gather`)."""
        return self._over(
            self.target.fork(), self.draft.fork() if self.draft is not None else None, draft_passes
        )

    def forks(self, count: int, draft_passes: DraftPasses | None = None) -> list[Pipeline]:
        """`count` forks (see `fork`) for generations that one `BatchEngine` steps together
        (one thread): where a backend can, its forks share one context and score all of their
        rows in one pass (`LlamaCppBackend.forks`), the target's unless an EAGLE-3 head or a
        DFlash drafter reads its hidden states, the draft model's unless it drafts trees. Each
        fork's DFlash strategy keeps its own context over the one shared drafter."""
        reads_hidden = self.eagle3 is not None or self.dflash is not None or self.mtp is not None
        targets = _forked(self.target, count, shared=not reads_hidden)
        if self.draft is None:
            return [self._over(target, None, draft_passes) for target in targets]
        drafts = _forked(self.draft, count, shared=self.draft_config.n_parallel <= 1)
        return [self._over(t, d, draft_passes) for t, d in zip(targets, drafts, strict=True)]

    def _over(self, target: Backend, draft: Backend | None, draft_passes: DraftPasses | None) -> Pipeline:
        """A pipeline like this one over these backends (forks of this one's)."""
        eagle3, mtp = self.eagle3, self.mtp
        if draft_passes is not None:
            draft = GatheredBackend(draft, draft_passes) if draft is not None else None
            eagle3 = GatheredHead(eagle3, draft_passes) if eagle3 is not None else None
            mtp = GatheredHead(mtp, draft_passes) if mtp is not None else None
        return Pipeline(
            target,
            draft,
            spec_types=self.spec_types,
            draft_config=self.draft_config,
            ngram=self.ngram,
            replacements=self.replacements,
            shared=self.shared,
            eagle3=eagle3,
            dflash=self.dflash,
            mtp=mtp,
            spec_policy=self.spec_policy,
            policy_models=self.policy_models,
        )

    def encode(self, prompt: str | Sequence[int], config: GenerationConfig | None = None) -> list[int]:
        """The prompt's ids; a text is first checked to fit the context, with room for the tokens
        `config` asks for (`check_text`)."""
        if not isinstance(prompt, str):
            return list(prompt)
        self.check_text(prompt, config)
        return self.target.tokenize(prompt)

    def check_text(self, text: str, config: GenerationConfig | None = None) -> None:
        """Refuse, before it is tokenized, a prompt text too long for the context whatever its
        tokens (with room for the tokens `config` asks for): tokenizing megabytes takes
        gigabytes of memory. The error is the one a prompt of too many tokens gets."""
        if self._chars_per_token is None:  # once per pipeline: one pass over the vocabulary
            entries = (self.target.token_text(i) for i in range(self.target.vocab.size))
            self._chars_per_token = chars_per_token(entries)
        n_predict = -1 if config is None or config.context_shift else config.n_predict
        check_text_room(len(text), self._chars_per_token, n_predict, self.target.n_ctx)

    def stream(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        config: GenerationConfig | None = None,
        draft_config: DraftModelConfig | None = None,
        constraint: ConstraintSpec | None = None,
        **keywords: Unpack[GenerateKeywords],
    ) -> Generation:
        """A generation to iterate for chunks; its tokens, text and stats are complete after.

        sampling, config: as objects, or as keywords (`GenerateKeywords`), not both; neither:
        greedy, 128 tokens at most.
        draft_config: drafting settings for this generation only (None: the pipeline's own).
        constraint: a grammar, JSON schema or regex the output must match (see
        `specdecode.constraints`); a SpecdecodeError if it is not a valid one."""
        if is_batch(prompt):
            raise SpecdecodeError("stream takes one prompt (generate takes a list of them)")
        sampling, config = settings_from(sampling, config, keywords, "stream")
        if not isinstance(sampling, SamplingParams):
            raise SpecdecodeError("one prompt takes one SamplingParams (a list goes with a list of prompts)")
        matcher = Constraint.for_backend(constraint, self.target) if constraint is not None else None
        sampler = Sampler(sampling)
        setup = SpecSetup(
            target=self.target,
            sampling=sampling,
            verify=config.verify,
            seed=sampler.seed,
            draft_backend=self.draft,
            draft=draft_config or self.draft_config,
            translator=self.translator,
            eagle3_head=self.eagle3,
            dflash_head=self.dflash,
            mtp_head=self.mtp,
            ngram=self.ngram,
            shared=self.shared,
            constraint=matcher,
        )
        policy = None
        if self.policy_models is not None:
            policy = AdaptivePolicy(
                self.policy_models,
                counterfactual=config.verify == "match" or sampling.greedy,
                regime=None if sampling.greedy else f"{config.verify}, temperature {sampling.temperature:g}",
            )
        chain = Chain(build_strategies(self.spec_types, setup), policy, matcher)
        ids = self.encode(prompt, config)
        return Generation(self.target, chain, sampler, config, ids, constraint=matcher)

    @overload
    def generate(
        self,
        prompt: Prompt,
        sampling: SamplingParams | None = None,
        config: GenerationConfig | None = None,
        constraint: ConstraintSpec | None = None,
        **keywords: Unpack[GenerateKeywords],
    ) -> Result: ...

    @overload
    def generate(
        self,
        prompt: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        config: GenerationConfig | None = None,
        constraint: ConstraintSpec | None = None,
        **keywords: Unpack[GenerateKeywords],
    ) -> list[Result]: ...

    def generate(
        self,
        prompt: Prompt | Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        config: GenerationConfig | None = None,
        constraint: ConstraintSpec | None = None,
        **keywords: Unpack[GenerateKeywords],
    ) -> Result | list[Result]:
        """The whole generation for a prompt (text or token ids); for a list of prompts, a list
        of Results generated as one batch (`generate_batch` with its defaults).

        sampling, config: as objects, or as keywords (`GenerateKeywords`), not both; neither:
        greedy, 128 tokens at most."""
        check_keywords(keywords, "generate")  # a mistake is reported from the method called
        if is_batch(prompt):
            return self.generate_batch(prompt, sampling, config, constraint=constraint, **keywords)
        sampling, config = settings_from(sampling, config, keywords, "generate")
        run = self.stream(prompt, sampling, config, constraint=constraint)
        for _ in run:
            pass
        return Result(run.text, run.tokens, run.stats)

    def generate_batch(
        self,
        prompts: Sequence[Prompt],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
        config: GenerationConfig | None = None,
        *,
        max_sequences: int = 8,
        load_rule: bool = True,
        constraint: ConstraintSpec | None = None,
        **keywords: Unpack[GenerateKeywords],
    ) -> list[Result]:
        """Generate for every prompt, up to `max_sequences` at a time sharing each target pass
        (see `specdecode.scheduler`); a finished sequence's place goes to the next prompt at
        once. Results come in prompt order, and each is what `generate` gives that prompt
        alone (greedy, or seeded `match`, on a row-invariant backend).

        sampling: one setting for all, or one per prompt (give seeds for reproducible draws);
        or keywords (`GenerateKeywords`), as is config.
        load_rule: shorten a classic chain's drafts as the batch grows (`LoadRule`), and let
        the batch draft only while drafting steps measure faster (`SpeculationGate`); False
        drafts as alone. The adaptive policy prices a batch's rows by itself either way.
        constraint: what every answer must match (each sequence walks its own matcher)."""
        sampling, config = settings_from(sampling, config, keywords, "generate_batch")
        if max_sequences < 1:
            raise SpecdecodeError(f"max_sequences must be >= 1, not {max_sequences}")
        if isinstance(sampling, SamplingParams):
            samplings, configs = [sampling] * len(prompts), [config] * len(prompts)
        else:  # one config per SamplingParams: each may set its own max_tokens, stop, ignore_eos
            samplings, configs = sampling, config
            if len(samplings) != len(prompts):
                raise SpecdecodeError(f"{len(prompts)} prompts but {len(samplings)} sampling settings")
        for prompt, each in zip(prompts, configs, strict=True):  # every text measured before any is
            if isinstance(prompt, str):  # tokenized
                self.check_text(prompt, each)
        encoded = [self.encode(prompt) for prompt in prompts]
        for ids, each in zip(encoded, configs, strict=True):  # every request checked before any work
            check_room(ids, -1 if each.context_shift else each.n_predict, self.target.n_ctx)
        passes, seats = self._seats(min(max_sequences, len(prompts)))
        engine = BatchEngine(
            self.load_rule() if load_rule else None,
            draft_passes=passes,
            gate=load_rule and bool(self.spec_types),
            costs=self.policy_models.costs if self.policy_models is not None else None,
        )
        results: list[Result | None] = [None] * len(prompts)

        def start(seat: Pipeline, index: int) -> Generation:
            return seat.stream(encoded[index], samplings[index], configs[index], constraint=constraint)

        def done(index: int, entry: Entry) -> None:
            if entry.error is not None:
                raise entry.error
            run = entry.generation
            results[index] = Result(run.text, run.tokens, run.stats)

        engine.run(seats, len(prompts), start, done)
        return results  # type: ignore[return-value]

    def _seats(self, count: int) -> tuple[DraftPasses | None, list[Pipeline]]:
        """generate_batch's forks, made once and kept (with their caches) for the next call."""
        if self._batch is None:
            models = self.draft is not None or self.eagle3 is not None or self.mtp is not None
            self._batch = (DraftPasses() if models else None, [])
        passes, seats = self._batch
        if count > len(seats):
            seats.extend(self.forks(count - len(seats), passes))
        return passes, seats[:count]

    def load_rule(self) -> LoadRule | None:
        """The rule that shortens a classic chain's drafts under load, its pass costs timed
        once per pipeline (on a fork, so that this pipeline's cache stays as it is); None
        under the adaptive policy, which prices a batch's rows itself."""
        if self.policy_models is not None:
            return None
        if self._load_rule is None:
            self._load_rule = LoadRule.timed(self.target.fork())
        return self._load_rule

    def _translator(self, replacements: Sequence[tuple[str, str]] | None) -> VocabTranslator | None:
        if self.draft is None:
            return None
        difference = vocab_difference(self.target, self.draft)
        if difference is None:
            return None
        if replacements is None:
            raise SpecdecodeError(
                f"the draft model's vocabulary does not match the target's: {difference}. "
                "Use a draft trained with the target's tokenizer, or ask for translation through text "
                "with replacements=[(TARGET, DRAFT), ...] (--spec-replace TARGET DRAFT; [] for none)."
            )
        return VocabTranslator(self.target, self.draft, replacements)


def _forked(backend: Backend, count: int, shared: bool) -> list[Backend]:
    """`count` forks of a backend, sharing one context where it can and `shared` allows."""
    make = getattr(backend, "forks", None) if shared else None
    return make(count) if make is not None else [backend.fork() for _ in range(count)]


def _silent(line: str) -> None:
    """A progress callback that shows nothing."""


def _with_bundled(
    draft: str | os.PathLike | PreTrainedModel | None,
    eagle3: str | os.PathLike | None,
    dflash: str | os.PathLike | None,
    spec_types: Sequence[str] | None,
) -> tuple[
    Path, str | os.PathLike | PreTrainedModel | None, str | os.PathLike | None, str | os.PathLike | None
]:
    """(target, draft, head, DFlash drafter) around the bundled target: the bundled draft, as the
    command without -m, unless the strategies asked for need none (spec_types without "draft", a
    head alone); the bundled head and drafter where "eagle3" or "dflash" is asked for without one."""
    target, bundled_draft = bundled_pair()
    names = strategy_names(spec_types) if spec_types is not None else None
    if draft is None and ("draft" in names if names is not None else eagle3 is None):
        draft = bundled_draft
    if eagle3 is None and names is not None and "eagle3" in names:
        eagle3 = bundled_eagle3()
    if dflash is None and names is not None and "dflash" in names:
        dflash = bundled_dflash()
    return target, draft, eagle3, dflash


def _is_path(source: object) -> bool:
    return isinstance(source, str | os.PathLike)


def _load_model(
    source: str | os.PathLike | PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase | None,
    options: LoadOptions,
    role: str,
    say: Progress,
    use: Use,
) -> Backend:
    """The backend for a model on disk (a directory or GGUF file) or one already in memory."""
    if not _is_path(source):
        return backend_from_model(source, tokenizer, options)
    if tokenizer is not None:
        argument = "tokenizer" if role == "target" else "draft_tokenizer"
        raise SpecdecodeError(
            f"{argument}= goes with a model in memory: the {role} model {source} is read with its own"
        )
    say(f"loading the {role} model from {source}")
    return load_backend(source, options, use, progress=say)


def strategy_names(names: Sequence[str]) -> list[str]:
    """Strategy names as the chain knows them, llama.cpp's current spellings accepted."""
    if isinstance(names, str):
        raise SpecdecodeError(f"spec_types is a list of strategy names, e.g. [{names!r}]")
    known = [*PRIORITY, *SPEC_TYPE_ALIASES]
    for name in names:
        if name not in known:
            raise SpecdecodeError(f"unknown strategy {name!r} (choose from {', '.join(known)})")
    return [SPEC_TYPE_ALIASES.get(name, name) for name in names]
