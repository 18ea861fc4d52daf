"""The adaptive policy: its cost model, acceptance model and decisions, and the chain under it.

Exactness under the policy is in test_exactness.py; here, what it chooses given hand-set
costs and acceptances.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from conftest import TargetSpec

from specdecode import GenerationConfig, Pipeline, SamplingParams
from specdecode.acceptance import PRIOR_WEIGHT, AcceptanceModel, depth_cell, expected_tokens
from specdecode.chain import Chain
from specdecode.cli import build_parser
from specdecode.costs import (
    CALIBRATION_ROWS,
    PRIOR_DRAFT_STEP,
    CostModel,
    DraftCalls,
    PassLoad,
    PassShare,
    time_draft,
)
from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError
from specdecode.policy import MAX_PROBE_EVERY, PROBE_NODES, AdaptivePolicy, PolicyModels, Record, Stopper
from specdecode.strategies.draft_model import DraftModelConfig, DraftModelStrategy

GREEDY = SamplingParams(temperature=0)

# Each test sets the costs it stands for; the seconds its chains spend drafting, measured, would
# add a busy machine's stalls to them (see conftest.steady_clock).
pytestmark = pytest.mark.usefixtures("steady_clock")


def cpu_costs(one_row: float = 0.012, draft_step: float = 0.001) -> CostModel:
    """Pass costs shaped as the bundled target's on a CPU (17 rows: 2.5x one row)."""
    costs = CostModel()
    for rows, ratio in ((1, 1.0), (2, 1.1), (3, 1.2), (5, 1.35), (9, 1.8), (17, 2.5)):
        costs.calibrated[rows] = one_row * ratio
    costs.draft_calls["draft"] = DraftCalls(draft_step)
    return costs


def plain_rate(models: PolicyModels) -> float:
    """Plain generation's tokens per second under the models' costs."""
    return 1 / models.costs.pass_time(1)


def best_length(models: PolicyModels, strategy: str, n_tokens: int) -> tuple[int, float]:
    """The best length of a greedy generation's draft of n_tokens, at plain generation's rate."""
    policy = AdaptivePolicy(models)
    return policy.best_length(policy.expected(strategy, n_tokens), 0.0, plain_rate(models))


def teach(models: PolicyModels, strategy: str, n_accepted: int, length: int, times: int) -> None:
    for _ in range(times):
        models.acceptance.observe(strategy, [None] * length, n_accepted)


class Fixed:
    """A model-free strategy proposing the same tokens at every step."""

    n_min = 0

    def __init__(self, name: str, tokens: list[int]) -> None:
        self.name = name
        self.tokens = tokens
        self.asked = 0

    def begin(self, prompt: Sequence[int]) -> None: ...

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        self.asked += 1
        return Draft(self.tokens[:n_max])

    def accept(self, n_accepted: int) -> None: ...

    def end(self) -> None: ...


class Model(Fixed):
    """A drafting model: proposes its tokens while the policy's rule says so."""

    def __init__(self, name: str, tokens: list[int], confidence: float) -> None:
        super().__init__(name, tokens)
        self.confidence = confidence
        self.keep_drafting = None

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        self.asked += 1
        tokens: list[int] = []
        while len(tokens) < min(n_max, len(self.tokens)) and self.keep_drafting(
            len(tokens) + 1, self.confidence
        ):
            tokens.append(self.tokens[len(tokens)])
        return Draft(tokens)


# --------------------------------------------------------------------------- cost model


def test_before_any_timing_pass_costs_follow_the_prior():
    costs = CostModel()
    assert costs.pass_time(17) / costs.pass_time(1) == pytest.approx(2.6)


def test_pass_costs_are_a_line_through_the_timings_that_follows_the_passes_run():
    costs = CostModel()
    costs.calibrated.update({1: 0.010, 5: 0.014, 9: 0.018})
    assert costs.pass_time(3) == pytest.approx(0.012)
    assert costs.pass_time(17) == pytest.approx(0.026)
    for _ in range(100):  # passes run twice as slow as timed (a longer context, a busy machine)
        costs.observe_pass(1, 0.020)
        costs.observe_pass(5, 0.028)
    assert costs.pass_time(3) == pytest.approx(0.024, rel=0.1)  # the timings still count a little


def test_long_passes_get_a_second_slope_once_they_are_run():
    costs = CostModel()
    costs.calibrated.update({1: 0.010, 9: 0.014, 17: 0.018})  # 0.5 ms a row
    assert costs.pass_time(49) == pytest.approx(0.034)  # nothing beyond 17 rows seen: the line goes on
    for _ in range(30):
        costs.observe_pass(33, 0.030)  # 0.75 ms a row past 17
        costs.observe_pass(49, 0.042)
        costs.observe_pass(5, 0.012)
    assert costs.pass_time(5) == pytest.approx(0.012, rel=0.02)
    assert costs.pass_time(41) == pytest.approx(0.036, rel=0.02)
    assert costs.pass_time(65) == pytest.approx(0.054, rel=0.02)


def test_pass_costs_never_fall_with_more_rows():
    costs = CostModel()
    costs.calibrated.update({1: 0.010, 17: 0.018})
    for _ in range(30):
        costs.observe_pass(33, 0.012)  # long passes timed cheaper (noise): no falling slope
    assert costs.pass_time(49) >= costs.pass_time(33) >= costs.pass_time(17) >= costs.pass_time(1)


def test_a_noisy_timing_does_not_make_one_more_row_free_or_dear():
    """The 3-row timing is noise: it moves the line of the passes of several rows, whose every
    row then costs the same, and the one-row pass keeps its own timing (the step from one row
    to several, fitted from the timings, takes up the difference)."""
    costs = CostModel()
    costs.calibrated.update({1: 0.012, 2: 0.0135, 3: 0.0213, 5: 0.0218, 9: 0.0264, 17: 0.0336})
    steps = [costs.pass_time(n + 1) - costs.pass_time(n) for n in range(2, 17)]
    assert max(steps) == pytest.approx(min(steps))
    assert 0.0005 < steps[0] < 0.0015
    assert costs.pass_time(1) == pytest.approx(0.012)


def test_the_one_row_pass_keeps_its_timing_where_every_row_costs_nearly_a_pass():
    """Qwen2.5-Coder 1.5B (Q4_K_M) on llama.cpp, one thread of a 2-core CPU: a line through
    every size put the one-row pass at 66 ms against its 41, so that plain generation looked
    0.6x as fast as it is and drafts that lose looked as if they paid."""
    costs = CostModel()
    costs.calibrated.update({1: 0.0406, 2: 0.0871, 3: 0.1383, 5: 0.1837, 9: 0.4461, 17: 0.5779})
    assert costs.pass_time(1) == pytest.approx(0.0406)
    assert costs.pass_time(2) > 2 * costs.pass_time(1)


def test_a_busier_machine_scales_the_timings_instead_of_flattening_them():
    """Plain steps on a machine three times as busy as at load: only one-row passes run, and
    the timings of the other sizes, unscaled, made each row past the first cost a third of a
    one-row pass. The timings now give the shape at the runs' speed, and so do a drafting
    model's timing and its calls, fitted at the timings' speed (each divided by the load it ran
    at) and priced at the load now."""
    costs = CostModel()
    costs.calibrated.update({rows: 0.04 * rows for rows in CALIBRATION_ROWS})
    costs.draft_calls["draft"] = DraftCalls(0.02)
    for _ in range(100):
        costs.observe_pass(1, 0.12)
    assert costs.drift() == pytest.approx(3.0)
    assert costs.pass_time(1) == pytest.approx(0.12)
    assert costs.pass_time(17) == pytest.approx(3 * 0.68)
    assert costs.step_time("draft") == pytest.approx(0.06)
    for _ in range(30):  # calls run at this load: their own costs from now on
        costs.observe_draft("draft", 1, 0.03, 1)
        costs.observe_draft("draft", 2, 0.06, 1)
    assert costs.step_time("draft") == pytest.approx(0.03, rel=0.05)


def test_passes_that_cost_a_one_row_pass_a_row_are_not_taken_for_flat():
    """A line through 0: each row costs what a one-row pass does, and nothing more (once taken
    for a failed fit, whose fallback, the mean, made every row free)."""
    costs = CostModel()
    costs.calibrated.update({rows: 0.04 * rows for rows in CALIBRATION_ROWS})
    assert [costs.pass_time(rows) for rows in (1, 2, 17)] == pytest.approx([0.04, 0.08, 0.68])


def test_the_step_from_one_row_to_several_is_fitted_from_the_passes_run():
    """On a CPU after a long context, a second row costs twice what each next one does. A line
    through every size made it look cheap, and a one-token draft kept 4% of the time was
    verified every other step, at a loss."""
    costs = CostModel()
    costs.calibrated.update({1: 0.0062, 2: 0.0063, 3: 0.0066, 5: 0.0070, 9: 0.0080, 17: 0.0100})
    for _ in range(20):
        for rows, seconds in ((1, 0.0065), (2, 0.0071), (3, 0.0073), (5, 0.0077)):
            costs.observe_pass(rows, seconds)
    # (the timings, which show no step, still count a little)
    assert costs.pass_time(2) - costs.pass_time(1) == pytest.approx(0.0006, abs=0.0002)
    assert costs.pass_time(3) - costs.pass_time(2) == pytest.approx(0.0002, abs=0.0001)
    assert costs.pass_time(17) > costs.pass_time(9) > costs.pass_time(5)


def test_passes_run_feed_the_fit_report():
    costs = CostModel()
    costs.calibrated.update({1: 0.010, 2: 0.011})
    for _ in range(50):
        costs.observe_pass(2, 0.022)
    assert costs.pass_time(2) == pytest.approx(0.022, rel=0.1)
    assert costs.fit() == [
        {
            "rows": 2,
            "sequences": 1,
            "passes": 50,
            "measured_ms": pytest.approx(22.0),
            "predicted_ms": pytest.approx(20.0, abs=2.0),  # the first passes were predicted at 11
            "model_ms": pytest.approx(22.0, rel=0.1),
            "timed_ms": 11.0,
        }
    ]


def test_the_fit_report_gives_what_the_model_predicted_for_each_pass_before_learning_from_it():
    """A run of several tasks ends with a model of the last one's passes: the predictions made
    as each pass ran are the fit the policy acted on."""
    costs = CostModel()
    costs.calibrated.update({1: 0.010, 2: 0.011})
    costs.observe_pass(2, 0.022)
    [row] = costs.fit()
    assert row["predicted_ms"] == pytest.approx(11.0, rel=0.01)
    assert row["measured_ms"] == pytest.approx(22.0)
    for _ in range(39):
        costs.observe_pass(2, 0.022)
    [row] = costs.fit()
    assert row["model_ms"] == pytest.approx(22.0, rel=0.1)
    assert 11.0 < row["predicted_ms"] < row["model_ms"]


def test_calibration_times_every_row_count_and_leaves_the_cache_empty(zoo):
    target = zoo.backend(zoo.target(TargetSpec()))
    costs = CostModel()
    costs.calibrate(target)
    assert sorted(costs.calibrated) == [1, 2, 3, 5, 9, 17]
    assert all(seconds > 0 for seconds in costs.calibrated.values())
    assert target.tokens == []


def test_a_drafting_model_is_timed_when_first_needed_and_leaves_its_cache_empty(zoo):
    """Not at load (nothing stored here): a model the policy never runs is never timed."""
    target, draft = zoo.pair(TargetSpec(), 0.9)
    models = PolicyModels.for_target(target, drafts={"draft": draft})
    assert models.costs.untimed == {"draft"}
    time_draft(models.costs, "draft", draft)
    assert not models.costs.untimed
    step = models.costs.step_time("draft")
    assert step > 0
    assert step != pytest.approx(PRIOR_DRAFT_STEP * models.costs.pass_time(1))
    assert draft.tokens == [] and target.tokens == []
    assert models.costs.step_time("eagle3") == pytest.approx(PRIOR_DRAFT_STEP * models.costs.pass_time(1))


def test_draft_calls_are_a_line_in_their_steps_and_the_tokens_they_missed():
    costs = CostModel()
    costs.calibrated[1] = 0.01
    assert costs.draft_time("draft", 2, 1) == pytest.approx(0.002)  # prior: a tenth of a pass a step
    assert costs.step_time("draft") == pytest.approx(0.001)
    for _ in range(60):  # a call costs 2 ms, each step 0.5 ms, each token read first 0.1 ms
        costs.observe_draft("draft", 1, 0.0027, 2)
        costs.observe_draft("draft", 5, 0.0047, 2)
        costs.observe_draft("draft", 2, 0.0094, 62)  # after a gap: 62 tokens to read
    assert costs.step_time("draft") == pytest.approx(0.0005, rel=0.02)
    assert costs.draft_time("draft", 3, 2) == pytest.approx(0.0037, rel=0.02)
    assert costs.draft_time("draft", 3, 32) == pytest.approx(0.0067, rel=0.02)


def test_draft_calls_never_get_cheaper_with_more_steps():
    calls = DraftCalls(0.001)
    for _ in range(60):
        calls.observe(1, 0.004, 2)
        calls.observe(4, 0.003, 2)  # noise: longer calls timed faster
    a, b, g = calls.line()
    assert b == 0.0  # what the calls took, all of it per call
    assert a + 2 * g == pytest.approx(0.0035, rel=0.05)


class TreeModel(Fixed):
    """A drafting model that grows a tree depth by depth under the policy's rule, keeping one
    child per depth: its tree comes out as a chain."""

    def __init__(self, name: str, tokens: list[int]) -> None:
        super().__init__(name, tokens)
        self.keep_drafting = None

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        self.asked += 1
        reach = 1.0
        tokens: list[int] = []
        for depth in range(1, min(n_max, len(self.tokens)) + 1):
            if (reach := self.keep_drafting.node(reach, depth, 0.99, len(tokens))) is None:
                break
            tokens.append(self.tokens[depth - 1])
        return Draft(tokens, parents=list(range(-1, len(tokens) - 1))).simplified()


def test_a_tree_that_comes_out_as_a_chain_is_timed_by_the_steps_its_model_ran():
    """A model's call is charged for a step per depth it was asked about, whatever shape its
    draft took: a 4-deep tree that came out as a chain once counted as a single step, so long
    calls looked like one-step ones, the fit gave steps no cost and every call a pass's worth."""
    models = PolicyModels(costs=cpu_costs())
    calls: list[int] = []
    observe = models.costs.observe_draft
    models.costs.observe_draft = lambda strategy, steps, *rest: (
        calls.append(steps),
        observe(strategy, steps, *rest),
    )
    chain = Chain([TreeModel("draft", [5, 6, 7, 8])], AdaptivePolicy(models))
    draft = chain.draft([1, 2], 3, 4)
    assert draft.tokens == [5, 6, 7, 8] and draft.is_chain
    chain.accept(draft, 4, 0.02)
    assert calls == [4]  # depths 1..4: the context's step and one per node but the last


def test_passes_of_several_sequences_add_a_cost_per_sequence():
    """A batch's pass of T rows costs more than one sequence's T rows (each sequence attends to
    its own cache): once such passes run, the fit learns that cost, and one sequence's
    passes stay as they were."""
    costs = CostModel()
    costs.calibrated.update({1: 0.010, 9: 0.014, 17: 0.018})  # 0.5 ms a row
    assert costs.pass_time(8, 8) == costs.pass_time(8)  # nothing seen yet: no cost per sequence
    for _ in range(40):
        for rows, sequences in ((4, 4), (8, 4), (8, 8), (16, 8), (3, 1)):
            costs.observe_pass(rows, 0.0095 + 0.0005 * rows + 0.0004 * (sequences - 1), sequences)
    assert costs.pass_time(8, 8) == pytest.approx(0.0163, rel=0.02)
    assert costs.pass_time(12, 4) == pytest.approx(0.0167, rel=0.02)
    assert costs.pass_time(5) == pytest.approx(0.012, rel=0.02)


def test_a_pass_reported_in_shares_counts_once():
    """Each sequence of a batch reports its rows' share of the pass: the fit and the report
    see one pass, as if it had been reported whole."""
    whole, shares = CostModel(), CostModel()
    for seconds in (0.020, 0.030, 0.025) * 10:
        whole.observe_pass(12, seconds, 4)
        for weight in (0.25, 0.25, 0.5):
            shares.observe_pass(12, seconds, 4, weight)
    assert shares.measured[(12, 4)] == pytest.approx(whole.measured[(12, 4)])
    for ours, expected in zip(shares._sums.arrays(), whole._sums.arrays(), strict=True):
        assert ours == pytest.approx(expected, rel=0.01)


# --------------------------------------------------------------------------- acceptance model


def test_model_draft_acceptance_starts_at_its_confidence_and_learns():
    acceptance = AcceptanceModel()
    assert acceptance.chain("draft", [0.9, 0.35]) == pytest.approx([0.9, 0.35])
    for _ in range(40):
        acceptance.observe("draft", [0.95, 0.95], 0)  # confident but always wrong
    assert acceptance.estimate("draft", 1, 0.95, 0.95) < 0.2
    assert acceptance.estimate("draft", 1, 0.5, 0.5) == 0.5  # another bucket: untouched


def test_model_free_acceptance_inherits_the_depth_above():
    acceptance = AcceptanceModel()
    for _ in range(20):
        acceptance.observe("ngram-simple", [None] * 3, 1)  # depth 1 kept, depth 2 rejected
    first, second, third = acceptance.chain("ngram-simple", [None] * 3)
    assert first > 0.8
    assert second < 0.3
    assert third == pytest.approx(second)  # never seen: its prior, the estimate above


def test_deep_depths_share_cells():
    assert [depth_cell(d) for d in (1, 8, 9, 12, 13, 16, 17, 24, 25, 40, 48, 49, 64, 65)] == [
        1,
        8,
        9,
        9,
        13,
        13,
        17,
        17,
        25,
        33,
        33,
        49,
        49,
        65,
    ]
    acceptance = AcceptanceModel()
    for _ in range(10):
        acceptance.observe("ngram-mod", [None] * 40, 40)  # kept to depth 40, the end of the draft
    assert acceptance.estimate("ngram-mod", 47, None, 0.5) > 0.9  # depth 40's cell speaks for 47
    assert acceptance.estimate("ngram-mod", 49, None, 0.5) == 0.5  # never reached: its prior


def test_only_the_depths_verification_reached_are_counted():
    acceptance = AcceptanceModel()
    acceptance.observe("ngram-simple", [None] * 5, 2)
    cells = {depth: counts for (_, depth, _), counts in acceptance.cells.items()}
    assert cells == {1: [1.0, 0.0], 2: [1.0, 0.0], 3: [0.0, 1.0]}
    assert PRIOR_WEIGHT > 0


def test_expected_tokens():
    assert expected_tokens([]) == [1.0]
    assert expected_tokens([1.0, 1.0]) == [1.0, 2.0, 3.0]
    assert expected_tokens([0.5, 0.5]) == pytest.approx([1.0, 1.5, 1.75])


# --------------------------------------------------------------------------- decisions


def test_a_draft_never_accepted_is_not_verified():
    models = PolicyModels(costs=cpu_costs())
    teach(models, "ngram-simple", 0, 8, 50)
    length, gain = best_length(models, "ngram-simple", 8)
    assert length == 0
    assert gain == pytest.approx(0.0)  # a plain step, at plain generation's rate


def test_a_draft_always_accepted_is_verified_whole():
    models = PolicyModels(costs=cpu_costs())
    teach(models, "ngram-simple", 16, 16, 50)
    assert best_length(models, "ngram-simple", 16)[0] == 16


def test_the_length_stops_where_acceptance_falls():
    models = PolicyModels(costs=cpu_costs())
    teach(models, "ngram-simple", 3, 8, 50)  # always 3 of 8
    # the 4th token, rarely kept, may still be worth its nearly free verify row; never the 8
    assert best_length(models, "ngram-simple", 8)[0] in (3, 4)


def test_the_stopper_drafts_confident_tokens_and_stops_at_doubtful_ones():
    models = PolicyModels(costs=cpu_costs())
    for _ in range(30):
        models.acceptance.observe("draft", [0.95, 0.9, 0.02], 2)  # the doubtful third: rejected
    stopper = Stopper(models, "draft", 1 / 0.012)
    assert stopper(1, 0.95) and stopper(2, 0.9)
    assert not stopper(3, 0.02)
    assert stopper.confidences == [0.95, 0.9]


def test_the_stopper_tries_doubtful_tokens_it_knows_nothing_of_and_learns_they_are_kept():
    """An underconfident draft: its tokens of confidence 0.15 are kept 90% of the time. Untried,
    the doubt of the first one is not taken at its word; once tried, its record speaks."""
    models = PolicyModels(costs=cpu_costs())
    rate = 1 / 0.008
    assert Stopper(models, "draft", rate)(1, 0.15)  # optimism about a cell without outcomes
    for kept in [True] * 9 + [False]:
        models.acceptance.observe("draft", [0.15], 1 if kept else 0)
    assert models.acceptance.model_prior("draft", 0.15) > 0.6  # the bucket over all depths learnt
    stopper = Stopper(models, "draft", rate)
    assert stopper(1, 0.15) and stopper(2, 0.15)  # depth 2, never seen, starts from the bucket


def test_the_stopper_stops_when_draft_steps_cost_more_than_they_bring():
    models = PolicyModels(costs=cpu_costs(draft_step=0.012))  # a draft as slow as the target
    stopper = Stopper(models, "draft", 1 / 0.012)
    assert stopper(1, 0.6)  # the step that showed it has run: it pays for its row
    assert not stopper.further(1)  # but not for another step


def test_a_token_worth_its_row_is_drafted_though_the_step_after_it_would_not_pay():
    """The step that showed a token's confidence has run: the token costs its verify row only.
    Whether the next step runs is a decision of its own; a rule that charged each token its
    row and the step after it stopped a token early and paid for the step it stopped at."""
    models = PolicyModels(costs=cpu_costs(draft_step=0.006))  # a step: half a pass
    for _ in range(40):
        models.acceptance.observe("draft", [0.45], 0)
        models.acceptance.observe("draft", [0.45], 1)  # kept half the time
    rate = plain_rate(models)
    row = models.costs.pass_time(2) - models.costs.pass_time(1)
    step = models.costs.step_time("draft")
    a = models.acceptance.model_estimate("draft", 1, 0.45)
    assert rate * row < a < rate * (row + step)  # worth its row, not its row and a step
    stopper = Stopper(models, "draft", rate)
    assert stopper(1, 0.45)
    assert not stopper.further(1)


def test_the_stopper_looks_further_where_the_next_token_is_expected_to_pay():
    """Before the step that shows the next token runs, its confidence is unknown: it is
    expected to be like those that followed this one's (at first, the same)."""
    models = PolicyModels(costs=cpu_costs())
    for _ in range(30):
        models.acceptance.observe("draft", [0.95, 0.95], 2)  # confident tokens: kept
        models.acceptance.observe("draft", [0.05], 0)  # doubtful ones: not
    stopper = Stopper(models, "draft", plain_rate(models))
    assert stopper(1, 0.95) and stopper.further(1)
    for _ in range(100):  # this model's confident token is followed by a doubtful one, rejected
        models.acceptance.observe_next("draft", 0.95, 0.05)
        models.acceptance.observe("draft", [0.95, 0.05], 1)
    shares = {confidence: share for share, confidence in models.acceptance.next_confidences("draft", 0.95)}
    assert shares[0.05] > 0.8
    assert not stopper.further(1)


def test_the_stopper_learns_what_follows_each_confidence_from_the_steps_run():
    models = PolicyModels(costs=cpu_costs())
    stopper = Stopper(models, "draft", plain_rate(models))
    assert stopper(1, 0.95) and stopper(2, 0.35)
    assert not stopper(3, 0.01)  # shown by a step, though not drafted
    assert models.acceptance.followers == {
        ("draft", 9): [0.0, 0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
        ("draft", 3): [1.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    }


def test_a_probe_runs_no_step_past_its_last_token():
    models = PolicyModels(costs=cpu_costs())
    stopper = Stopper(models, "draft", plain_rate(models), max_nodes=PROBE_NODES)
    for depth in range(1, PROBE_NODES + 1):
        assert stopper(depth, 0.99)
    assert not stopper.further(PROBE_NODES)


def test_chain_prefers_the_strategy_with_the_better_record():
    models = PolicyModels(costs=cpu_costs())
    teach(models, "a", 0, 4, 50)
    teach(models, "b", 4, 4, 50)
    a, b = Fixed("a", [5, 6, 7, 8]), Fixed("b", [9, 10, 11, 12])
    chain = Chain([a, b], AdaptivePolicy(models))
    draft = chain.draft([1, 2], 3, 16)
    assert (draft.strategy, draft.tokens) == ("b", [9, 10, 11, 12])
    assert a.asked == b.asked == 1  # model-free strategies are all asked
    chain.accept(draft, 4, 0.015)
    assert models.choices[("b", 4)] == 1
    assert models.costs.measured[(5, 1)][:2] == [1, 0.015]


def cells_of(models: PolicyModels, strategy: str) -> dict[int, list[float]]:
    return {depth: counts for (name, depth, _), counts in models.acceptance.cells.items() if name == strategy}


def test_drafts_not_chosen_are_scored_against_the_emitted_tokens():
    models = PolicyModels(costs=cpu_costs())
    teach(models, "b", 4, 4, 50)
    a, b = Fixed("a", [5, 6, 7, 8]), Fixed("b", [5, 6, 9, 9])
    chain = Chain([a, b], AdaptivePolicy(models, counterfactual=True))
    draft = chain.draft([1, 2], 3, 16)
    assert draft.strategy == "b"
    before = {depth: list(counts) for depth, counts in cells_of(models, "b").items()}
    chain.accept(draft, 2, 0.015, [5, 6, 7])  # b's first two kept, then the target said 7
    assert cells_of(models, "a") == {}  # a's 4th token is not known yet: a waits
    assert cells_of(models, "b")[3][1] == pytest.approx(before[3][1] * 0.98 + 1)  # b's 3rd was rejected
    a.tokens = b.tokens = []  # nothing drafted in the next step, which emits 8 and 4
    chain.draft([1, 2, 3, 5, 6], 7, 16)
    chain.accept(Draft(), 0, 0.012, [8])
    assert cells_of(models, "a") == {1: [1.0, 0.0], 2: [1.0, 0.0], 3: [1.0, 0.0], 4: [1.0, 0.0]}


def test_a_draft_cut_short_and_kept_shows_whether_its_rest_was_right():
    """Counted only as verified, a draft cut to k tokens and kept whole would never show its
    (k+1)-th token right, and its lengths could only shrink: its rest is scored too."""
    models = PolicyModels(costs=cpu_costs())
    teach(models, "a", 2, 3, 50)  # so far: 2 kept of every 3
    a = Fixed("a", [5, 6, 7, 8, 9, 10])
    policy = AdaptivePolicy(models, counterfactual=True)
    chain = Chain([a], policy)
    draft = chain.draft([1, 2], 3, 16)
    assert len(draft.tokens) in (2, 3)
    chain.accept(draft, len(draft.tokens), 0.015, [5, 6, 7][: len(draft.tokens) + 1])
    for _ in range(40):  # the copy goes on, and a keeps being cut but right
        a.tokens = []
        chain.draft([1], 2, 16)
        chain.accept(Draft(), 0, 0.012, [8, 9, 10])
        a.tokens = [5, 6, 7, 8, 9, 10]
        draft = chain.draft([1, 2], 3, 16)
        chain.accept(draft, len(draft.tokens), 0.015, [5, 6, 7, 8, 9, 10][: len(draft.tokens) + 1])
    assert chain.draft([1, 2], 3, 16).tokens == [5, 6, 7, 8, 9, 10]


def test_counterfactual_scores_are_kept_for_counterfactual_verification_only():
    models = PolicyModels(costs=cpu_costs())
    policy = AdaptivePolicy(models, counterfactual=False)
    policy.watch({"a": [5, 6]}, [5, 7])
    assert models.acceptance.cells == {}


def test_chain_takes_a_plain_step_and_skips_a_model_that_does_not_pay():
    models = PolicyModels(costs=cpu_costs())
    models.records["draft"] = Record(tokens=1.0, rows=1.0, steps=1.0, n=50)  # plain's tokens, and a step
    model = Model("draft", [5, 6], 0.99)
    chain = Chain([model], AdaptivePolicy(models))
    assert chain.draft([1, 2], 3, 16) == Draft()
    assert model.asked == 0
    chain.accept(Draft(), 0, 0.012)
    assert models.choices[("none", 0)] == 1


def test_a_rate_no_candidate_reaches_does_not_make_the_cheapest_win():
    """After long copies (300 tokens/s), a stretch only the draft model predicts: its 9 tokens in
    48 ms beat a plain step's 1 in 12 ms, even though neither reaches the copies' rate."""
    models = PolicyModels(costs=cpu_costs())
    models.records["draft"] = Record(tokens=9.0, rows=17.0, steps=17.0, n=50)
    models.step_tokens, models.step_seconds = 30.0, 0.1
    policy = AdaptivePolicy(models)
    rate = policy.step_rate({}, ["draft"], 0.0)
    assert rate == pytest.approx(9.0 / (17 * 0.001 + models.costs.pass_time(17)))
    assert policy.model_gain("draft", 0.0, rate, 16) > policy.plain_gain(0.0, rate)
    model = Model("draft", list(range(5, 21)), 0.99)
    assert len(Chain([model], policy).draft([1, 2], 3, 16).tokens) > 1
    assert policy.step_rate({}, [], 0.0) == pytest.approx(plain_rate(models))  # plain alone: its rate


def model_draft_length(policy: AdaptivePolicy, position: int, confidence: float, n_max: int = 16) -> int:
    """Tokens of `confidence` a drafting model run at `position` drafts under the policy's rule."""
    policy.at(position)
    rate = policy.step_rate({}, ["draft"], 0.0)
    stopper = policy.stopper("draft", rate, policy.plain_gain(0.0, rate), 0.0)
    depth = 0
    while depth < n_max and stopper(depth + 1, confidence):
        depth += 1
        if not stopper.further(depth):
            break
    return depth


def first_step_reads_the_prompt(policy: AdaptivePolicy, prompt: int, step: float, one_row: float) -> int:
    """A first step whose drafting model reads the prompt (4 ms a token) and drafts a token of
    confidence 0.8, which is rejected; its length."""
    drafted = model_draft_length(policy, prompt + 1, 0.8)
    t_model = 0.004 * prompt + drafted * step
    policy.observe("draft", [0.8] * drafted, [], t_model, one_row, "draft", drafted, t_model)
    return drafted


def test_a_draft_model_nearly_as_slow_as_the_target_drafts_nothing_where_rows_cost_a_pass_each():
    """Qwen2.5-Coder 1.5B (Q4_K_M) drafted by its 0.5B sibling on llama.cpp, one thread each, as
    timed at load: a pass of T rows costs about T one-row passes, a draft step half of one. No
    draft pays even were all of it kept, and the rule drafts not even a token it is sure of."""
    costs = CostModel()
    costs.calibrated.update({1: 0.0406, 2: 0.0871, 3: 0.1383, 5: 0.1837, 9: 0.4461, 17: 0.5779})
    costs.draft_calls["draft"] = DraftCalls(0.0207)
    policy = AdaptivePolicy(PolicyModels(costs=costs))
    rate = policy.step_rate({}, ["draft"], 0.0)
    assert policy.best_case_gain("draft", 0.0, rate, 16) < policy.plain_gain(0.0, rate)
    assert model_draft_length(policy, 66, 0.99) == 0


def test_a_fast_draft_model_drafts_long_where_rows_are_cheap():
    """The same steps where a pass of 17 rows costs 2.5 one-row passes and a draft step a
    tenth of one (a larger target on a CPU): confident tokens are drafted far. The first call's
    read of the prompt is not charged to its step."""
    policy = AdaptivePolicy(PolicyModels(costs=cpu_costs(draft_step=0.0012)))
    drafted = first_step_reads_the_prompt(policy, 64, 0.0012, 0.0132)
    assert drafted >= 1
    seconds = policy.models.step_seconds * policy.models.costs.drift()  # kept at the timings' speed
    assert seconds == pytest.approx(drafted * 0.0012 + 0.0132)
    assert model_draft_length(policy, 66, 0.99) >= 8


def run_chain(chain: Chain, steps: int, pass_seconds: Callable[[int], float]) -> list[Draft]:
    """`steps` steps of `chain` whose drafts are always kept whole, each verified in a pass of
    pass_seconds(rows); the drafts."""
    history, drafts = [1, 2], []
    for _ in range(steps):
        draft = chain.draft(history, 3, 16)
        chain.accept(draft, len(draft.tokens), pass_seconds(len(draft.tokens) + 1))
        history += [3, *draft.tokens]
        drafts.append(draft)
    return drafts


def machine(pass_seconds: Callable[[int], float], draft_step: float) -> PolicyModels:
    """Models timed at load on a machine whose passes of T rows cost pass_seconds(T) and whose
    drafting model's step costs draft_step."""
    costs = CostModel()
    costs.calibrated.update({rows: pass_seconds(rows) for rows in CALIBRATION_ROWS})
    costs.draft_calls["draft"] = DraftCalls(draft_step)
    return PolicyModels(costs=costs)


def test_where_rows_cost_a_pass_each_and_draft_steps_a_third_the_model_never_runs():
    """Two CPU cores and a Q4_K target: each verify row costs a one-row pass, each draft step a
    third of one. Not even a draft all kept could pay: the model is neither tried nor probed,
    though it would have been right every time, and every step is plain."""
    models = machine(lambda rows: 0.04 * rows, 0.04 / 3)
    model = Model("draft", list(range(5, 21)), 0.99)
    run_chain(Chain([model], AdaptivePolicy(models)), 100, lambda rows: 0.04 * rows)
    assert model.asked == 0
    assert models.choices == {("none", 0): 100}
    # Nor does a record from an earlier text bring probes back.
    models.records["draft"] = Record(tokens=2.0, rows=2.0, steps=1.0, n=50)
    models.idle["draft"] = MAX_PROBE_EVERY
    run_chain(Chain([model], AdaptivePolicy(models)), 100, lambda rows: 0.04 * rows)
    assert model.asked == 0


def test_where_passes_are_flat_the_same_model_drafts_long():
    """A GPU: a pass of 17 rows costs what one row does. The same model, at the same step cost,
    is tried at once and drafts long."""
    models = machine(lambda rows: 0.04, 0.04 / 3)
    model = Model("draft", list(range(5, 21)), 0.99)
    drafts = run_chain(Chain([model], AdaptivePolicy(models)), 20, lambda rows: 0.04)
    assert model.asked == 20
    assert all(len(draft.tokens) >= 8 for draft in drafts)


def test_a_second_is_worth_at_least_what_a_plain_step_makes():
    """After drafts that lost (1 token a second), every row would look nearly free."""
    models = PolicyModels(costs=cpu_costs())
    models.step_tokens, models.step_seconds = 1.0, 1.0
    assert AdaptivePolicy(models).step_rate({}, ["draft"], 0.0) == pytest.approx(plain_rate(models))


def test_chain_probes_an_unused_model_again():
    models = PolicyModels(costs=cpu_costs())
    models.records["draft"] = Record(tokens=1.0, rows=1.0, steps=1.0, n=50)
    model = Model("draft", [5, 6], 0.99)
    chain = Chain([model], AdaptivePolicy(models))
    for _ in range(9):
        draft = chain.draft([1, 2], 3, 16)
        chain.accept(draft, len(draft.tokens), 0.012)
    assert model.asked == 1
    assert draft.tokens == [5, 6]
    assert models.acceptance.cells[("draft", 1, 9)] == [1.0, 0.0]  # learnt with its confidence
    assert models.records["draft"].tokens > 1.0  # the probe's 3 tokens raised its record


def test_probes_that_keep_losing_come_ever_more_rarely():
    models = PolicyModels(costs=cpu_costs())
    models.records["draft"] = Record(tokens=1.0, rows=1.0, steps=1.0, n=50)
    model = Model("draft", [5, 6], 0.99)
    chain = Chain([model], AdaptivePolicy(models))
    asked = []
    for step in range(1, 61):
        before = model.asked
        draft = chain.draft([1, 2], 3, 16)
        chain.accept(draft, 0, 0.012)  # the probe's drafts are never kept
        if model.asked > before:
            asked.append(step)
    assert asked == [9, 26, 59]  # after 8 idle steps, then 16, then 32
    # The next generation goes on counting: 64 idle steps since the last probe, one of them
    # the previous generation's last step.
    chain = Chain([model], AdaptivePolicy(models))
    asked = model.asked
    for _ in range(63):
        chain.accept(chain.draft([1, 2], 3, 16), 0, 0.012)
    assert model.asked == asked
    chain.draft([1, 2], 3, 16)
    assert model.asked == asked + 1
    assert models.probe_every["draft"] == MAX_PROBE_EVERY == 64  # and no longer


def test_a_probe_that_wins_stands_for_the_record_and_runs_on_merit_halve_the_wait():
    """A probe that beats the step's other candidates found the text changed: its outcome
    replaces the record (a moving average over another text would take many probes to move),
    so the model runs again at once; each run on merit halves the wait before the next probe,
    so one lucky probe does not bring probes back every 8 steps."""
    models = PolicyModels(costs=cpu_costs())
    models.records["draft"] = Record(tokens=1.0, rows=3.0, steps=3.0, n=50)
    models.probe_every["draft"] = 64
    models.idle["draft"] = 64
    model = Model("draft", [5, 6], 0.99)
    chain = Chain([model], AdaptivePolicy(models))
    draft = chain.draft([1, 2], 3, 16)
    chain.accept(draft, 2, 0.0135)  # the probe: both tokens kept
    assert models.records["draft"].tokens == 3.0
    assert models.probe_every["draft"] == MAX_PROBE_EVERY  # the probe doubled it, up to the cap
    for _ in range(3):  # 64 -> 32 -> 16 -> 8
        draft = chain.draft([1, 2], 3, 16)
        assert draft.tokens == [5, 6]  # on merit
        chain.accept(draft, 2, 0.0135)
    assert models.probe_every["draft"] == 8
    # A probe that loses is only averaged in.
    models.records["draft"] = Record(tokens=1.0, rows=3.0, steps=3.0, n=50)
    models.idle["draft"] = 8
    chain.accept(chain.draft([1, 2], 3, 16), 0, 0.0135)
    assert models.records["draft"].tokens == 1.0


def test_a_model_pays_for_the_tokens_it_missed_but_not_for_the_prompt():
    """A drafting model idle for a while (a copy, plain steps) reads what it missed before it
    drafts: a cost of running it now. Its first call's prompt is not charged to the step (any
    use of the model pays it once a generation)."""
    models = PolicyModels(costs=cpu_costs())
    calls = models.costs.draft_calls["draft"] = DraftCalls(0.001)
    for _ in range(60):  # 1 ms a call, 1 ms a step, 1 ms a token read first
        for steps, missed in ((1, 1), (2, 1), (1, 21)):
            calls.observe(steps, 0.001 + 0.001 * steps + 0.001 * missed, missed)
    models.records["draft"] = Record(tokens=2.0, rows=2.0, steps=2.0, n=50)
    model = Model("draft", [5], 0.99)
    chain = Chain([model], AdaptivePolicy(models))
    prompt = list(range(200))
    draft = chain.draft(prompt, 7, 16)  # a long prompt, not yet read: runs all the same
    assert draft.tokens == [5]
    chain.accept(draft, 1, 0.0135)
    history = [*prompt, 7, 5]
    assert chain.draft(history, 8, 16).tokens == [5]  # 2 tokens missed
    chain.accept(Draft([5]), 0, 0.0135)
    history += [8, *range(20)]  # 20 tokens later (a copy): reading them costs more than it gains
    assert chain.draft(history, 9, 16) == Draft()
    assert model.asked == 2


def test_a_probe_drafts_only_a_few_tokens():
    """A probe asks whether the model pays again: a few tokens tell (at temperature 1 a probe
    once drafted 16 tokens on the optimism about untried cells, and none was kept)."""
    models = PolicyModels(costs=cpu_costs())
    models.records["draft"] = Record(tokens=1.0, rows=1.0, steps=1.0, n=50)
    model = Model("draft", list(range(5, 21)), 0.99)
    chain = Chain([model], AdaptivePolicy(models))
    for _ in range(9):
        draft = chain.draft([1, 2], 3, 16)
        chain.accept(draft, len(draft.tokens), 0.012)
    assert model.asked == 1
    assert draft.tokens == [5, 6, 7, 8][:PROBE_NODES]
    # Won back, it drafts as far as its rule says.
    draft = chain.draft([1, 2], 3, 16)
    assert model.asked == 2
    assert len(draft.tokens) > PROBE_NODES


def test_each_sampling_regime_learns_its_own_acceptance():
    models = PolicyModels(costs=cpu_costs())
    sampled = AdaptivePolicy(models, counterfactual=True, regime="match, temperature 1")
    for _ in range(30):
        sampled.watch({"ngram-mod": [5, 6]}, [7])  # never kept at temperature 1
    greedy = AdaptivePolicy(models, counterfactual=True)
    assert sampled.best_length(sampled.expected("ngram-mod", 2), 0.0, plain_rate(models))[0] == 0
    assert models.acceptance.chain(sampled.source("ngram-mod"), [None])[0] < 0.2
    assert models.acceptance.chain(greedy.source("ngram-mod"), [None]) == [0.5]  # greedy: untouched


def test_the_keep_drafting_hook_is_cleared_after_the_draft():
    model = Model("draft", [5], 0.99)
    chain = Chain([model], AdaptivePolicy(PolicyModels(costs=cpu_costs())))
    assert chain.draft([1], 2, 4).tokens == [5]
    assert model.keep_drafting is None


def test_in_a_batch_a_draft_must_beat_the_batch_rate():
    """A draft kept 40% of the time pays beside one sequence (its row costs a tenth of a
    token), not beside fifteen others: the same row then costs what the batch makes in that
    time, about half a token."""
    models = PolicyModels(costs=cpu_costs())
    for i in range(50):
        teach(models, "a", 1 if i % 5 in (0, 2) else 0, 1, 1)  # 40% kept at depth 1
    chain = Chain([Fixed("a", [5])], AdaptivePolicy(models))
    assert chain.draft([1, 2], 3, 16).tokens == [5]  # alone
    chain.accept(Draft(), 0, 0.012, [9])
    # A batch of 16 has been emitting a token per sequence per pass.
    models.step_tokens, models.step_seconds = 1.0, models.costs.pass_time(16, 16) / 16
    batch = PassLoad(other_rows=15, sequences=16)
    assert not chain.draft([1, 2, 3], 9, 16, load=batch).tokens
    chain.accept(Draft(), 0, 0.036, [9], share=PassShare(16, 16))
    for _ in range(50):
        teach(models, "a", 1, 1, 1)  # nearly always kept: worth its row even so
    assert chain.draft([1, 2, 3, 9], 9, 16, load=batch).tokens == [5]


def test_a_batch_probes_a_drafting_model_as_often_as_one_sequence():
    """Passes count towards the next probe of an unused drafting model, whichever sequence
    steps: a probe stalls every sequence of the pass."""
    models = PolicyModels(costs=cpu_costs())
    models.records["m"] = Record(tokens=1.0, rows=4.0, steps=4.0)  # losing: only probes run it
    sequences = [AdaptivePolicy(models) for _ in range(4)]
    probes = []
    for step in range(1, 61):  # 60 passes of four sequences
        for policy in sequences:
            policy.load = PassLoad(other_rows=3, sequences=4)
            rate = plain_rate(models)
            if policy.model_gain("m", 0.0, rate, 16) > policy.plain_gain(0.0, rate):
                policy.stopper("m", rate, policy.plain_gain(0.0, rate), 0.0)
                probes.append(step)
            else:
                policy.skipped(["m"])
    # As one sequence: after 8 idle passes, then 16, then 32 (a pass earlier each time: the
    # probing pass counts three quarters idle, for the three sequences that did not probe).
    assert probes == [9, 25, 57]


def test_a_batch_credits_each_sequence_with_its_share_of_pass_and_drafting():
    """The rate the policy achieves is the batch's: each step is credited with its rows' share
    of the pass and its own part of the drafting round."""
    models = PolicyModels(costs=cpu_costs())
    policy = AdaptivePolicy(models)
    share = PassShare(8, 4, 0.25)
    for _ in range(30):  # four sequences in passes of 8 rows, 40 ms, each drafting 10 ms of waiting
        for rows in (1, 3, 2, 2):
            policy.observe(None, [None] * (rows - 1), [], 0.010, 0.040, None, 0, 0.0, share=share)
    assert models.rate == pytest.approx(4 / (0.040 + 0.010), rel=0.05)


# --------------------------------------------------------------------------- pipeline and CLI


def test_adaptive_generation_learns_and_reports(zoo):
    target, draft = zoo.pair(TargetSpec(seed=1), 0.02)
    models = PolicyModels()
    pipe = Pipeline(
        target, draft, spec_types=["ngram-simple", "draft"], spec_policy="adaptive", policy_models=models
    )
    result = pipe.generate(list(range(3, 30)), GREEDY, GenerationConfig(n_predict=24, ignore_eos=True))
    assert len(result.tokens) == 24
    # every step is reported, but a last one with room for one token only, which drafts nothing
    assert sum(models.choices.values()) in (result.stats.n_passes - 1, result.stats.n_passes)
    assert models.costs.measured and models.acceptance.cells


def test_a_draft_model_gets_the_cheap_model_free_strategies_beside_it_under_the_adaptive_policy(zoo):
    """Named by no one, the strategies a draft model enables are llama.cpp's (the model alone)
    under the classic policy; the adaptive policy also asks ngram-mod and ngram-map-k4v, whose
    drafts cost next to nothing and are verified only where they pay."""
    target, draft = zoo.pair(TargetSpec(seed=1), 0.02)
    adaptive = Pipeline(target, draft, spec_policy="adaptive", policy_models=PolicyModels(costs=cpu_costs()))
    assert sorted(adaptive.spec_types) == ["draft", "ngram-map-k4v", "ngram-mod"]
    assert Pipeline(target, draft).spec_types == ["draft"]
    named = Pipeline(
        target, draft, spec_types=["draft"], spec_policy="adaptive", policy_models=PolicyModels()
    )
    assert named.spec_types == ["draft"]


class StopAfter:
    """A policy's rule for chains that drafts every token and runs no step past the token at
    `depth`."""

    def __init__(self, depth: int) -> None:
        self.depth = depth

    def __call__(self, depth: int, confidence: float) -> bool:
        return True

    def further(self, depth: int) -> bool:
        return depth < self.depth

    def node(self, parent_reach: float, depth: int, confidence: float, nodes: int) -> float | None:
        raise AssertionError("a chain asks no node")


def test_a_draft_model_runs_no_step_past_the_token_its_rule_ends_on(zoo):
    """The draft's last token is never evaluated by the model; its next call reads it, if it
    was kept, with the rest of what was verified."""
    _, draft = zoo.pair(TargetSpec(seed=1), 0.02)
    strategy = DraftModelStrategy(draft, DraftModelConfig(), target_vocab_size=draft.vocab.size)
    strategy.keep_drafting = StopAfter(3)
    prompt = list(range(3, 20))
    strategy.begin(prompt)
    tokens = strategy.draft(prompt, 20, 16).tokens
    assert len(tokens) == 3
    assert draft.tokens == [*prompt, 20, *tokens[:2]]
    history = [*prompt, 20, *tokens]
    assert len(strategy.draft(history, 21, 16).tokens) == 3
    assert draft.tokens[: len(history) + 1] == [*history, 21]


def test_tree_nodes_are_worth_their_row_while_likely_enough():
    models = PolicyModels(costs=cpu_costs())
    rule = Stopper(models, "draft", plain_rate(models))
    first = rule.node(1.0, 1, 0.9, 0)
    assert first == pytest.approx(0.9)  # before any outcome: its confidence
    assert rule.node(first, 2, 0.9, 1) == pytest.approx(0.81)
    for _ in range(30):
        models.acceptance.observe("draft", [0.01], 0)  # such doubtful candidates are rejected
    assert rule.node(1.0, 1, 0.01, 0) is None
    assert rule.node(0.02, 2, 0.9, 5) is None  # a likely child of an unlikely parent
    assert rule.confidences == []  # tree nodes are not a chain's tokens


def test_a_verified_tree_counts_the_children_of_kept_nodes():
    acceptance = AcceptanceModel()
    # the root's children 0 (0.9) and 1 (0.05); node 0's children 2 (0.8) and 3 (0.15); node 1's 4
    acceptance.observe_tree("draft", [0.9, 0.05, 0.8, 0.15, 0.9], [-1, -1, 0, 0, 1], [0, 3])
    cells = {(depth, bucket): counts for (_, depth, bucket), counts in acceptance.cells.items() if depth}
    assert cells == {(1, 9): [1, 0], (1, 0): [0, 1], (2, 8): [0, 1], (2, 1): [1, 0]}  # node 4 unseen


def test_unknown_policy_is_refused(zoo):
    with pytest.raises(SpecdecodeError, match="spec-policy"):
        Pipeline(zoo.backend(zoo.target(TargetSpec())), spec_policy="clever")


def test_cli_flag():
    """The command line and the server default to the adaptive policy (the benchmark's choice);
    the library's Pipeline keeps llama.cpp's classic chain unless asked."""
    parser = build_parser()
    assert parser.parse_args(["generate", "-p", "x"]).spec_policy == "adaptive"
    assert parser.parse_args(["serve", "--port", "1"]).spec_policy == "adaptive"
    assert parser.parse_args(["generate", "-p", "x", "--spec-policy", "classic"]).spec_policy == "classic"
    with pytest.raises(SystemExit):
        parser.parse_args(["generate", "-p", "x", "--spec-policy", "clever"])
