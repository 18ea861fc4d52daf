"""The Python API: load a target (and a draft) once, generate many times.

from specdecode import Pipeline, SamplingParams, GenerationConfig
pipe = Pipeline.load("path/to/target", draft="path/to/draft")  # or eagle3="path/to/head"
result = pipe.generate("def fib(n):", SamplingParams(temperature=0), GenerationConfig(n_predict=64))
print(result.text, result.stats.tokens_per_pass)
for chunk in (run := pipe.stream("def fib(n):")):
    print(chunk.text, end="")
print(run.stats.format())
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from specdecode.backends import Backend
from specdecode.backends.gather import DraftPasses, GatheredBackend, GatheredHead
from specdecode.backends.hf import LoadOptions
from specdecode.backends.load import load_backend
from specdecode.chain import Chain
from specdecode.constraints import Constraint, ConstraintSpec
from specdecode.errors import SpecdecodeError
from specdecode.generate import Generation, GenerationConfig, check_room
from specdecode.policy import AdaptivePolicy, PolicyModels, check_policy
from specdecode.sampling import Sampler, SamplingParams
from specdecode.scheduler import BatchEngine, Entry, LoadRule
from specdecode.stats import GenerationStats
from specdecode.strategies import DraftModelConfig, NgramSettings, SharedState, SpecSetup, build_strategies
from specdecode.strategies.eagle3_checkpoint import load_head
from specdecode.strategies.eagle3_head import Eagle3Head
from specdecode.vocab import VocabTranslator, vocab_difference


@dataclass
class Result:
    text: str
    tokens: list[int]
    stats: GenerationStats


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
        spec_policy: str = "classic",
        policy_models: PolicyModels | None = None,
    ) -> None:
        """spec_types: enabled strategy names (None: "draft" when a draft is given and "eagle3"
        when a head is, else none).
        ngram: settings of the model-free strategies; their shared state (the ngram-mod pool,
        the ngram-cache files) lives as long as the pipeline.
        replacements: (target text, draft text) pairs; given (even empty), a draft whose
        vocabulary differs is used through text translation instead of being refused.
        shared: state to share with other pipelines (see `fork`); None makes the pipeline's own.
        eagle3: a head loaded for this target (`specdecode.strategies.eagle3_checkpoint.load_head`).
        spec_policy: "classic" (llama.cpp's fixed chain and p_min) or "adaptive" (each step
        drafts what maximises expected tokens per second, see `specdecode.policy`).
        policy_models: what the adaptive policy has learned, to share (None: new models whose
        pass costs are timed on the target now)."""
        self.target = target
        self.draft = draft
        self.eagle3 = eagle3
        if spec_types is None:
            spec_types = (["draft"] if draft else []) + (["eagle3"] if eagle3 is not None else [])
        self.spec_types = list(spec_types)
        self.draft_config = draft_config
        self.ngram = ngram
        self.replacements = replacements
        self.translator = self._translator(replacements)
        if "draft" in self.spec_types and draft is None:
            raise SpecdecodeError("--spec-type draft needs a draft model (-md DIR)")
        if "eagle3" in self.spec_types and eagle3 is None:
            raise SpecdecodeError("--spec-type eagle3 needs an EAGLE-3 head (-me DIR)")
        self.shared = shared if shared is not None else SharedState(ngram, self.spec_types, target.vocab.size)
        self.spec_policy = check_policy(spec_policy)
        self.policy_models = None
        self._load_rule: LoadRule | None = None
        self._batch: tuple[DraftPasses | None, list[Pipeline]] | None = None  # see _seats
        if spec_policy == "adaptive" and self.spec_types:
            self.policy_models = (
                policy_models if policy_models is not None else PolicyModels.for_target(target)
            )

    @classmethod
    def load(
        cls,
        model: str | Path,
        draft: str | Path | None = None,
        *,
        eagle3: str | Path | None = None,
        eagle3_layer_offset: int | None = None,
        target_options: LoadOptions = LoadOptions(),
        draft_options: LoadOptions = LoadOptions(),
        **kwargs,
    ) -> Pipeline:
        target = load_backend(model, target_options)
        draft_backend = load_backend(draft, draft_options) if draft is not None else None
        head = load_head(eagle3, target, eagle3_layer_offset) if eagle3 is not None else None
        return cls(target, draft_backend, eagle3=head, **kwargs)

    def fork(self, draft_passes: DraftPasses | None = None) -> Pipeline:
        """A pipeline over the same weights with its own KV caches and per-generation state,
        sharing this one's SharedState: one fork per generation run in parallel (the server's
        slots, generate_batch's sequences). Needs backends that fork (HFBackend does).

        draft_passes: the rounds of a `BatchEngine` that batch the draft model's passes
        across its sequences (see `specdecode.backends.gather`)."""
        draft = self.draft.fork() if self.draft is not None else None
        eagle3 = self.eagle3
        if draft_passes is not None:
            draft = GatheredBackend(draft, draft_passes) if draft is not None else None
            eagle3 = GatheredHead(eagle3, draft_passes) if eagle3 is not None else None
        return Pipeline(
            self.target.fork(),
            draft,
            spec_types=self.spec_types,
            draft_config=self.draft_config,
            ngram=self.ngram,
            replacements=self.replacements,
            shared=self.shared,
            eagle3=eagle3,
            spec_policy=self.spec_policy,
            policy_models=self.policy_models,
        )

    def encode(self, prompt: str | Sequence[int]) -> list[int]:
        return self.target.tokenize(prompt) if isinstance(prompt, str) else list(prompt)

    def stream(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams = SamplingParams(),
        config: GenerationConfig = GenerationConfig(),
        draft_config: DraftModelConfig | None = None,
        constraint: ConstraintSpec | None = None,
    ) -> Generation:
        """A generation to iterate for chunks; its tokens, text and stats are complete after.

        draft_config: drafting settings for this generation only (None: the pipeline's own).
        constraint: a grammar, JSON schema or regex the output must match (see
        `specdecode.constraints`); a SpecdecodeError if it is not a valid one."""
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
        return Generation(self.target, chain, sampler, config, self.encode(prompt), constraint=matcher)

    def generate(
        self,
        prompt: str | Sequence[int],
        sampling: SamplingParams = SamplingParams(),
        config: GenerationConfig = GenerationConfig(),
        constraint: ConstraintSpec | None = None,
    ) -> Result:
        run = self.stream(prompt, sampling, config, constraint=constraint)
        for _ in run:
            pass
        return Result(run.text, run.tokens, run.stats)

    def generate_batch(
        self,
        prompts: Sequence[str | Sequence[int]],
        sampling: SamplingParams | Sequence[SamplingParams] = SamplingParams(),
        config: GenerationConfig = GenerationConfig(),
        *,
        max_sequences: int = 8,
        load_rule: bool = True,
        constraint: ConstraintSpec | None = None,
    ) -> list[Result]:
        """Generate for every prompt, up to `max_sequences` at a time sharing each target pass
        (see `specdecode.scheduler`); a finished sequence's place goes to the next prompt at
        once. Results come in prompt order, and each is what `generate` gives that prompt
        alone (greedy, or seeded `match`, on a row-invariant backend).

        sampling: one setting for all, or one per prompt (give seeds for reproducible draws).
        load_rule: shorten a classic chain's drafts as the batch grows (`LoadRule`), and let
        the batch draft only while drafting steps measure faster (`SpeculationGate`); False
        drafts as alone. The adaptive policy prices a batch's rows by itself either way.
        constraint: what every answer must match (each sequence walks its own matcher)."""
        if max_sequences < 1:
            raise SpecdecodeError(f"max_sequences must be >= 1, not {max_sequences}")
        if isinstance(sampling, SamplingParams):
            samplings = [sampling] * len(prompts)
        else:
            samplings = list(sampling)
            if len(samplings) != len(prompts):
                raise SpecdecodeError(f"{len(prompts)} prompts but {len(samplings)} sampling settings")
        encoded = [self.encode(prompt) for prompt in prompts]
        for ids in encoded:  # every request checked before any work
            check_room(ids, config.n_predict, self.target.n_ctx)
        passes, seats = self._seats(min(max_sequences, len(prompts)))
        engine = BatchEngine(
            self.load_rule() if load_rule else None,
            draft_passes=passes,
            gate=load_rule and bool(self.spec_types),
        )
        results: list[Result | None] = [None] * len(prompts)

        def start(seat: Pipeline, index: int) -> Generation:
            return seat.stream(encoded[index], samplings[index], config, constraint=constraint)

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
            models = self.draft is not None or self.eagle3 is not None
            self._batch = (DraftPasses() if models else None, [])
        passes, seats = self._batch
        seats.extend(self.fork(passes) for _ in range(count - len(seats)))
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
                "with --spec-replace TARGET DRAFT."
            )
        return VocabTranslator(self.target, self.draft, replacements)
