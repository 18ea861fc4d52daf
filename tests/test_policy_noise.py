"""The adaptive policy on a busy machine: every second it measures is the true one times a load
that swings 2-4x, now and then a single call stalls 10-100x, and it must still never fall
below 0.97x plain generation's true speed, and keep most of a winning draft's gain.

A deterministic simulation: the real chain and policy, strategies whose drafts are kept as
often as a scenario says, and a clock that the simulated machine advances (no real timing).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

import pytest

import specdecode.chain
from specdecode.chain import Chain
from specdecode.costs import CALIBRATION_ROWS, CostModel, DraftCalls
from specdecode.drafts import Draft
from specdecode.policy import AdaptivePolicy, PolicyModels

SEEDS = (1, 2, 3)
STEPS = 300
ONE_ROW = 0.012  # seconds of a one-row target pass, unloaded


@dataclass(frozen=True)
class Scenario:
    """True costs and acceptance: a pass of T rows costs ONE_ROW * (1 + slope * (T - 1)); a
    drafting model's call costs `call` + `step` a step (a `one_pass` model's: one step, however
    many tokens); its tokens (of confidence `confidence`) are kept with chance `kept` each,
    given their parent was; a model-free draft of `free` tokens is kept token by token with
    chance `free_kept`."""

    slope: float
    step: float = 0.0
    call: float = 0.0
    kept: float = 0.0
    confidence: float = 0.9
    one_pass: bool = False
    free: int = 0
    free_kept: float = 0.0

    def pass_seconds(self, rows: int) -> float:
        return ONE_ROW * (1 + self.slope * (rows - 1))


class Machine:
    """The true seconds spent, and what a clock shows for them: each interval times the load
    (a random walk between 1x and 4x, `noisy` only), now and then (2%) 10-100x more."""

    def __init__(self, seed: int, noisy: bool) -> None:
        self.rng = random.Random(seed)
        self.noisy = noisy
        self.log_load = math.log(2.0) if noisy else 0.0
        self.now = 0.0  # the clock
        self.true = 0.0

    def tick(self) -> None:
        if self.noisy:  # reflected at 1x and 4x
            self.log_load = abs(self.log_load + self.rng.gauss(0.0, 0.15))
            self.log_load = min(self.log_load, 2 * math.log(4.0) - self.log_load)

    def spend(self, seconds: float) -> float:
        """Spend `seconds` of true work; what the clock measured."""
        self.true += seconds
        measured = seconds * math.exp(self.log_load)
        if self.noisy and self.rng.random() < 0.02:
            measured *= self.rng.uniform(10.0, 100.0)
        self.now += measured
        return measured

    def timed(self, seconds: float) -> float:
        """A timing at load: the median of three (`specdecode.costs.time_passes`)."""
        return sorted(self.spend(seconds) for _ in range(3))[1]

    def perf_counter(self) -> float:
        return self.now


class Lookup:
    """A model-free strategy: a draft of `n` tokens, nearly free to ask for."""

    n_min = 0
    name = "lookup"

    def __init__(self, machine: Machine, n: int) -> None:
        self.machine, self.n = machine, n

    def begin(self, prompt: Sequence[int]) -> None: ...

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        self.machine.spend(0.00005)
        return Draft(list(range(5, 5 + min(self.n, n_max))))

    def accept(self, n_accepted: int) -> None: ...

    def end(self) -> None: ...


class DraftModel(Lookup):
    """A drafting model run under the policy's rule, each step costing what the scenario says;
    its first call stalls `stall` seconds more by the clock (a real one took 339 ms, 4 after)."""

    name = "draft"

    def __init__(self, machine: Machine, scenario: Scenario, stall: float = 0.0) -> None:
        super().__init__(machine, 0)
        self.scenario = scenario
        self.one_pass = scenario.one_pass
        self.keep_drafting = None
        self.stall = stall

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        s, rule = self.scenario, self.keep_drafting
        self.machine.now += self.stall
        self.stall = 0.0
        self.machine.spend(s.call + s.step)
        tokens: list[int] = []
        while len(tokens) < n_max and rule(len(tokens) + 1, s.confidence):
            tokens.append(5 + len(tokens))
            if len(tokens) == n_max or not rule.further(len(tokens)):
                break
            if not s.one_pass:
                self.machine.spend(s.step)
        return Draft(tokens, confidences=[s.confidence] * len(tokens))


def speed(scenario: Scenario, seed: int, noisy: bool, monkeypatch, stall: float = 0.0) -> float:
    """True tokens per second of a generation of STEPS steps under the adaptive policy, as a
    multiple of plain generation's; its costs timed at load on the same machine (`stall`: the
    drafting model's first call's, see `DraftModel`)."""
    machine = Machine(seed, noisy)
    monkeypatch.setattr(specdecode.chain, "time", SimpleNamespace(perf_counter=machine.perf_counter))
    costs = CostModel()
    costs.calibrated.update({rows: machine.timed(scenario.pass_seconds(rows)) for rows in CALIBRATION_ROWS})
    strategies: list = []
    if scenario.step or scenario.call:
        costs.draft_calls["draft"] = DraftCalls(machine.timed(scenario.call + scenario.step))
        strategies.append(DraftModel(machine, scenario, stall))
    if scenario.free:
        strategies.append(Lookup(machine, scenario.free))
    machine.true = 0.0
    chain = Chain(strategies, AdaptivePolicy(PolicyModels(costs=costs)))
    chain.begin([1, 2])
    kept = random.Random(seed + 1000)
    history, tokens = list(range(64)), 0
    for _ in range(STEPS):
        machine.tick()
        draft = chain.draft(history, 3, 16)
        chance = scenario.kept if draft.strategy == "draft" else scenario.free_kept
        n = 0
        while n < len(draft.tokens) and kept.random() < chance:
            n += 1
        t_pass = machine.spend(scenario.pass_seconds(len(draft.tokens) + 1))
        chain.accept(draft, n, t_pass)
        history += [3, *draft.tokens[:n]]
        tokens += n + 1
    return tokens / machine.true * scenario.pass_seconds(1)


LOSING = {
    "low acceptance": Scenario(slope=0.15, step=0.25 * ONE_ROW, kept=0.35),
    "expensive": Scenario(slope=0.3, step=0.6 * ONE_ROW, kept=0.8),
    "model-free": Scenario(slope=0.15, free=8, free_kept=0.1),
}
WINNING = {
    "cheap model": Scenario(slope=0.1, step=0.05 * ONE_ROW, kept=0.85),
    "one-pass model": Scenario(slope=0.05, call=0.3 * ONE_ROW, kept=0.85, one_pass=True),
    "model-free": Scenario(slope=0.1, free=8, free_kept=0.8),
}


@pytest.mark.parametrize("name", LOSING)
def test_a_draft_that_loses_never_costs_more_than_3_percent_under_a_swinging_load(name, monkeypatch):
    for seed in SEEDS:
        assert speed(LOSING[name], seed, True, monkeypatch) >= 0.97, seed


@pytest.mark.parametrize("name", WINNING)
def test_a_draft_that_wins_keeps_most_of_its_gain_under_a_swinging_load(name, monkeypatch):
    for seed in SEEDS:
        quiet = speed(WINNING[name], seed, False, monkeypatch)
        busy = speed(WINNING[name], seed, True, monkeypatch)
        assert quiet > 1.3
        assert busy - 1 >= 0.8 * (quiet - 1), seed


def test_a_drafter_whose_first_call_stalls_is_not_abandoned(monkeypatch):
    """A drafter's call of 4 ms whose first took 339 ms once made the policy drop it for the
    rest of a short generation."""
    scenario = WINNING["one-pass model"]
    quiet = speed(scenario, 1, False, monkeypatch)
    stalled = speed(scenario, 1, False, monkeypatch, stall=0.339)
    assert stalled - 1 >= 0.9 * (quiet - 1)
