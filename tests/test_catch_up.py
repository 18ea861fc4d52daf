"""A drafting model under the adaptive policy: it costs nothing while the policy never runs it
(not even a timing), and when the policy does run it after a long prompt or gap, reading what
it missed (its catch-up) is priced spread over the steps left and read a chunk a step.

Costs are set by each test and held fixed: what the policy chooses is the subject, not this
machine's timings."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from conftest import VOCAB_SIZE, CpuPolicyModels, TargetSpec

from specdecode import GenerationConfig, Pipeline, SamplingParams
from specdecode.chain import Chain
from specdecode.costs import CALIBRATION_ROWS, CostModel, DraftCalls
from specdecode.drafts import Draft
from specdecode.policy import CATCH_UP_STEPS, AdaptivePolicy, PolicyModels

GREEDY = SamplingParams(temperature=0)
pytestmark = pytest.mark.usefixtures("steady_clock")


class HeldCosts(CostModel):
    """Passes of T rows cost pass_seconds(T), a drafting model's call 4 ms a step and 1 ms a
    token it reads first; held fixed whatever is run."""

    def __init__(self, per_row: float, untimed: bool = False) -> None:
        super().__init__()
        self.calibrated.update({rows: 0.04 + per_row * (rows - 1) for rows in CALIBRATION_ROWS})
        if untimed:
            self.untimed.add("draft")
        else:
            calls = self.draft_calls["draft"] = DraftCalls(0.004)
            for _ in range(60):
                for steps, missed in ((1, 1), (2, 1), (1, 21)):
                    calls.observe(steps, 0.004 * steps + 0.001 * missed, missed)

    def observe_pass(self, rows: int, seconds: float, sequences: int = 1, weight: float = 1.0) -> None:
        """Held fixed."""

    def observe_draft(self, strategy: str, steps: int, seconds: float, missed: int) -> None:
        """Held fixed."""


class Reader:
    """A drafting model that is always right and sure: drafts its tokens while the policy's rule
    says so, and records the chunks of its backlog it is asked to read."""

    name = "draft"
    n_min = 0

    def __init__(self, tokens: list[int]) -> None:
        self.tokens = tokens
        self.keep_drafting = None
        self.asked = 0
        self.chunks: list[int] = []

    def begin(self, prompt: Sequence[int]) -> None: ...

    def catch_up(self, history: Sequence[int], last: int, n_tokens: int) -> None:
        self.chunks.append(n_tokens)

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        self.asked += 1
        tokens: list[int] = []
        while len(tokens) < min(n_max, len(self.tokens)) and self.keep_drafting(len(tokens) + 1, 0.99):
            tokens.append(self.tokens[len(tokens)])
        return Draft(tokens)

    def accept(self, n_accepted: int) -> None: ...

    def end(self) -> None: ...


class Counting:
    """A backend whose evaluations are recorded as (rows, logits rows); the rest is the wrapped one's."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.evaluations: list[tuple[int, int | None]] = []

    def evaluate(self, ids: Sequence[int], logits_rows: int | None = None):
        self.evaluations.append((len(ids), logits_rows))
        return self.inner.evaluate(ids, logits_rows)

    def evaluate_tree(self, ids: Sequence[int], parents: Sequence[int]):
        self.evaluations.append((len(ids), None))
        return self.inner.evaluate_tree(ids, parents)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


def long_prompt(length: int) -> list[int]:
    return [3 + (7 * i) % (VOCAB_SIZE - 3) for i in range(length)]


def plain_tokens(zoo, spec: TargetSpec, prompt: list[int], sampling, config) -> list[int]:
    return Pipeline(zoo.backend(zoo.target(spec))).generate(prompt, sampling, config).tokens


def test_a_draft_model_the_policy_never_runs_is_never_evaluated_nor_timed(zoo):
    """Where each verify row costs a plain step, no draft pays even if free and always kept:
    the model is not timed at load (nothing stored) nor at any step, and not one pass of it
    runs, while the output stays plain's."""
    spec = TargetSpec(seed=1)
    target, inner = zoo.pair(spec, 0.02)
    draft = Counting(inner)
    loaded = PolicyModels.for_target(target, drafts={"draft": draft})
    assert loaded.costs.untimed == {"draft"} and draft.evaluations == []
    models = CpuPolicyModels(costs=HeldCosts(per_row=0.04, untimed=True))
    pipe = Pipeline(target, draft, spec_types=["draft"], spec_policy="adaptive", policy_models=models)
    prompt, config = long_prompt(120), GenerationConfig(n_predict=24, ignore_eos=True)
    result = pipe.generate(prompt, GREEDY, config)
    assert draft.evaluations == [] and draft.tokens == []
    assert models.costs.untimed == {"draft"}
    assert result.stats.strategies[0].n_call_draft == 0
    (verdict,) = [v for v in result.stats.verdicts if v.code == "draft_model_too_slow"]
    assert verdict.numbers["step_cost"] == 0.0 and verdict.numbers["speedup"] <= 1.0
    assert result.tokens == plain_tokens(zoo, spec, prompt, GREEDY, config)


def test_a_model_not_timed_yet_is_timed_where_it_could_first_win(zoo):
    """Where rows are nearly free a draft could pay: the model is timed then, once."""
    target, inner = zoo.pair(TargetSpec(seed=1), 0.02)
    draft = Counting(inner)
    models = CpuPolicyModels(costs=HeldCosts(per_row=0.0005, untimed=True))
    pipe = Pipeline(target, draft, spec_types=["draft"], spec_policy="adaptive", policy_models=models)
    pipe.generate(long_prompt(20), GREEDY, GenerationConfig(n_predict=8, ignore_eos=True))
    assert not models.costs.untimed and models.costs.step_time("draft") > 0
    assert draft.evaluations


def chain_steps(chain: Chain, prompt: int, remaining: int, steps: int) -> list[Draft]:
    """`steps` steps after a prompt of `prompt` tokens with `remaining` tokens left, every
    draft kept whole and verified in 40 ms."""
    history, drafts = long_prompt(prompt), []
    for _ in range(steps):
        draft = chain.draft(history, 3, min(16, remaining - 1), remaining=remaining)
        chain.accept(draft, len(draft.tokens), 0.04)
        history += [3, *draft.tokens]
        remaining -= 1 + len(draft.tokens)
        drafts.append(draft)
    return drafts


def test_a_long_prompt_is_not_caught_up_for_a_short_answer():
    """Rows nearly free and a model always right: without its prompt to read, it would pay at
    once. Reading 2000 tokens (2 s) for 8 tokens of answer does not pay: nothing is read."""
    reader = Reader(list(range(5, 21)))
    chain = Chain([reader], AdaptivePolicy(CpuPolicyModels(costs=HeldCosts(per_row=0.0005))))
    assert chain_steps(chain, 2000, 8, 4) == [Draft()] * 4
    assert reader.chunks == [] and reader.asked == 0


def test_a_long_answer_catches_up_in_chunks_then_drafts():
    """The same prompt before 2000 tokens of answer: the read pays spread over them. It is read
    a quarter a step while plain steps go on, and the call after the third quarter reads the
    rest and drafts long."""
    reader = Reader(list(range(5, 21)))
    chain = Chain([reader], AdaptivePolicy(CpuPolicyModels(costs=HeldCosts(per_row=0.0005))))
    drafts = chain_steps(chain, 2000, 2000, CATCH_UP_STEPS + 1)
    assert reader.chunks == [500] * (CATCH_UP_STEPS - 1)
    assert drafts[: CATCH_UP_STEPS - 1] == [Draft()] * (CATCH_UP_STEPS - 1)
    assert reader.asked == 2 and all(len(draft.tokens) >= 8 for draft in drafts[CATCH_UP_STEPS - 1 :])


def test_a_backlog_read_in_a_few_plain_steps_is_read_by_the_first_drafting_call():
    """100 tokens (0.1 s, under CATCH_UP_STALL plain steps of 40 ms): no step is spent on
    chunks, the model drafts at once."""
    reader = Reader(list(range(5, 21)))
    chain = Chain([reader], AdaptivePolicy(CpuPolicyModels(costs=HeldCosts(per_row=0.0005))))
    drafts = chain_steps(chain, 100, 2000, 2)
    assert reader.chunks == [] and reader.asked == 2
    assert all(len(draft.tokens) >= 8 for draft in drafts)


def test_the_catch_up_is_priced_in_the_best_case_spread_over_the_steps_left():
    """The first step after a prompt of 1000 tokens: the model reads the step's token as any
    step's call does, and the prompt as its backlog."""
    models = PolicyModels(costs=HeldCosts(per_row=0.0005))
    rate = 25.0

    def best_case(remaining: int | None) -> float:
        policy = AdaptivePolicy(models)
        policy.at(1001, remaining)
        assert policy.backlog("draft") == 1000 and policy.missed("draft") == 1
        return policy.best_case_gain("draft", 0.0, rate, 1)

    free = best_case(None)  # no budget said: nothing charged
    reading = models.costs.read_time("draft", 1000)
    assert reading == pytest.approx(1.0)
    for remaining in (4, 100, 10_000):  # a draft of 1 token, kept: 2 tokens a step
        assert best_case(remaining) == pytest.approx(free - rate * reading * min(1.0, 2 / remaining))


@pytest.mark.parametrize(
    ("temperature", "verify"), [(0.0, "match"), (0.0, "rejection"), (0.8, "match"), (0.8, "rejection")]
)
def test_output_after_a_catch_up_is_plain_generations(zoo, temperature, verify):
    """A long prompt read in chunks, then drafts: the tokens plain generation gives, greedy and
    seeded (rejection sampling is exact in distribution; with the same seed its draws differ,
    so there only greedy is compared)."""
    spec = TargetSpec(seed=2)
    target, inner = zoo.pair(spec, 0.05)
    draft = Counting(inner)
    models = CpuPolicyModels(costs=HeldCosts(per_row=0.0005))  # 400 tokens read: 10 plain steps
    pipe = Pipeline(target, draft, spec_types=["draft"], spec_policy="adaptive", policy_models=models)
    prompt = long_prompt(400)
    sampling = SamplingParams(temperature=temperature, seed=11)
    config = GenerationConfig(n_predict=40, ignore_eos=True, verify=verify)
    result = pipe.generate(prompt, sampling, config)
    chunks = [rows for rows, logits in draft.evaluations if logits == 0]
    # each what CATCH_UP_STALL plain steps read (160 tokens, to rounding), then the call reads the rest
    assert len(chunks) == 2 and all(159 <= rows <= 160 for rows in chunks)
    assert result.stats.totals.n_drafted > 0
    if temperature == 0.0 or verify == "match":
        plain_config = GenerationConfig(n_predict=40, ignore_eos=True)
        assert result.tokens == plain_tokens(zoo, spec, prompt, sampling, plain_config)
