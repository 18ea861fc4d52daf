"""The adaptive policy's pass timings, stored across runs: reused for the same model and
machine while a one-row pass timed now agrees with them, timed again where it does not, for
another key, a damaged file or a foreign one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specdecode import costs
from specdecode.api import Pipeline
from specdecode.backends import Backend, pass_cache
from specdecode.backends.load import load_backend
from specdecode.costs import CALIBRATION_ROWS
from specdecode.policy import PolicyModels

TIMING = "timing the target's passes for the adaptive policy"
REUSING = "reusing the target's pass timings from an earlier run"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    """The pass cache, turned on in a temporary directory: its folder of timings."""
    monkeypatch.delenv("SPECDECODE_NO_PASS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "specdecode" / "pass-costs"


class Timer:
    """The policy's pass timer on a machine whose speed the test sets: a pass of T rows takes
    `one_row` * (1 + 0.1 (T - 1)) seconds, the same every time (a tiny model's real passes vary
    too much on a busy machine for a test of a 1.5x threshold); records the rows of each call."""

    def __init__(self) -> None:
        self.one_row = 0.01
        self.calls: list[tuple[int, ...]] = []

    def __call__(self, backend: Backend, rows: tuple[int, ...], context_length: int = 32) -> dict[int, float]:
        self.calls.append(tuple(rows))
        return {n: self.one_row * (1 + 0.1 * (n - 1)) for n in rows}

    @property
    def calibrations(self) -> int:
        """The times every row count was timed (a one-row check is not one)."""
        return self.calls.count(CALIBRATION_ROWS)


@pytest.fixture
def timings(monkeypatch) -> Timer:
    timer = Timer()
    monkeypatch.setattr(costs, "time_passes", timer)
    return timer


def load_policy(model_dir: Path, drafts: bool = False) -> tuple[PolicyModels, list[str]]:
    lines: list[str] = []
    draft = {"draft": load_backend(model_dir)} if drafts else None
    return PolicyModels.for_target(load_backend(model_dir), lines.append, draft), lines


def test_a_second_load_reuses_the_timings_written_by_the_first(saved_model_dir, cache, timings):
    first, said = load_policy(saved_model_dir)
    assert said == [TIMING] and timings.calibrations == 1
    assert len(list(cache.glob("*.json"))) == 1
    second, said = load_policy(saved_model_dir)
    assert said == [REUSING] and timings.calibrations == 1
    assert second.costs.calibrated == first.costs.calibrated
    assert set(first.costs.calibrated) == set(CALIBRATION_ROWS)
    assert second.costs.pass_time(5) == first.costs.pass_time(5)


@pytest.mark.parametrize("now", [0.001, 0.03])  # a busy machine's timings on a quiet one, and back
def test_timings_the_machine_no_longer_gives_are_timed_again_and_replaced(
    saved_model_dir, cache, timings, now
):
    load_policy(saved_model_dir)
    timings.one_row = now
    models, said = load_policy(saved_model_dir)
    assert said == [f"stored pass timings are {0.01 / now:.2g}x the target's one-row pass now: timing again"]
    assert timings.calibrations == 2 and models.costs.calibrated[1] == pytest.approx(now)
    again, said = load_policy(saved_model_dir)
    assert said == [REUSING] and timings.calibrations == 2
    assert again.costs.calibrated == models.costs.calibrated


@pytest.mark.parametrize("now", [0.007, 0.014])
def test_timings_within_the_stale_factor_are_kept(saved_model_dir, cache, timings, now):
    first, _ = load_policy(saved_model_dir)
    timings.one_row = now
    second, said = load_policy(saved_model_dir)
    assert said == [REUSING] and timings.calibrations == 1
    assert timings.calls[-1] == (1,)  # the check: one row count, not the whole timing
    assert second.costs.calibrated == first.costs.calibrated


def test_a_drafting_model_is_timed_once_when_first_needed_and_its_stored_steps_follow_the_machine(
    saved_model_dir, cache, timings
):
    """Never at load: where nothing is stored the model waits untimed (the chain times it where
    it could first win a step); a stored step is read without timing it, and scaled as the
    target's stale timings are where the machine changed."""
    models, _ = load_policy(saved_model_dir, drafts=True)
    assert models.costs.untimed == {"draft"} and timings.calls == [CALIBRATION_ROWS]
    costs.time_draft(models.costs, "draft", load_backend(saved_model_dir))
    assert models.costs.step_time("draft") == pytest.approx(0.01, rel=0.01)
    timings.one_row = 0.012  # within the factor: the stored step stays, untimed
    calls = len(timings.calls)
    models, _ = load_policy(saved_model_dir, drafts=True)
    assert timings.calls[calls:] == [(1,)]  # the target's check alone
    assert not models.costs.untimed and models.costs.step_time("draft") == pytest.approx(0.01, rel=0.01)
    timings.one_row = 0.001  # ten times as fast: the target is timed again, the step scaled and stored
    for _ in range(2):
        models, _ = load_policy(saved_model_dir, drafts=True)
        assert models.costs.step_time("draft") == pytest.approx(0.001, rel=0.01)
    assert timings.calls.count((1,)) == 1 + 3  # the draft's one timing, the target's three checks


def test_changed_weights_are_timed_again(saved_model_dir, cache, timings):
    load_policy(saved_model_dir)
    weights = next(saved_model_dir.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _, said = load_policy(saved_model_dir)
    assert said == [TIMING] and timings.calibrations == 2
    assert len(list(cache.glob("*.json"))) == 2


@pytest.mark.parametrize("damage", ["garbage", "truncated", "foreign key", "negative cost", "unknown rows"])
def test_a_damaged_or_foreign_file_is_timed_again_and_rewritten(saved_model_dir, cache, timings, damage):
    load_policy(saved_model_dir)
    (path,) = cache.glob("*.json")
    text = path.read_text()
    stored = json.loads(text)
    if damage == "garbage":
        path.write_bytes(b"\x00\xffnot json")
    elif damage == "truncated":
        path.write_text(text[: len(text) // 2])
    else:
        if damage == "foreign key":
            stored["key"]["cpu"] = "another machine"
        elif damage == "negative cost":
            stored["costs"]["1"] = -1.0
        else:
            stored["costs"]["4096"] = 1.0
        path.write_text(json.dumps(stored))
    _, said = load_policy(saved_model_dir)
    assert said == [TIMING] and timings.calibrations == 2
    _, said = load_policy(saved_model_dir)  # rewritten whole
    assert said == [REUSING] and timings.calibrations == 2


def test_the_cache_is_off_when_asked_and_for_models_without_files(
    saved_model_dir, cache, timings, monkeypatch
):
    backend = load_backend(saved_model_dir)
    backend.model.name_or_path = ""  # a model made in memory
    monkeypatch.chdir(saved_model_dir)  # where "" would find a model, were it read as a folder
    assert pass_cache.cache_key(backend, CALIBRATION_ROWS) is None
    PolicyModels.for_target(backend)
    monkeypatch.setenv("SPECDECODE_NO_PASS_CACHE", "1")
    load_policy(saved_model_dir)
    load_policy(saved_model_dir)
    assert timings.calibrations == 3 and not cache.exists()


def test_an_unwritable_cache_only_costs_the_timing(saved_model_dir, tmp_path, monkeypatch, timings):
    monkeypatch.delenv("SPECDECODE_NO_PASS_CACHE", raising=False)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # a file where the folder goes
    for _ in range(2):
        _, said = load_policy(saved_model_dir)
        assert said == [TIMING]
    assert timings.calibrations == 2


def test_the_pipeline_says_which_happened(saved_model_dir, cache, timings):
    phases = []
    for _ in range(2):
        lines: list[str] = []
        settings = {"spec_types": ["ngram-simple"], "spec_policy": "adaptive"}
        Pipeline.load(saved_model_dir, progress=lines.append, **settings)
        phases.append(lines[1:])
    assert phases == [[TIMING], [REUSING]] and timings.calibrations == 1


def test_the_check_times_one_row_passes_after_a_short_context(saved_model_dir):
    backend = load_backend(saved_model_dir)
    timings = costs.time_passes(backend, (1,), costs.CHECK_CONTEXT)
    assert list(timings) == [1] and timings[1] > 0 and backend.tokens == []


def test_the_suite_keeps_no_timings_and_touches_no_users_cache():
    """A test that runs the adaptive policy times passes now: timings stored by an earlier
    test, or by the user's runs on a quiet machine, would price them by another load."""
    assert not pass_cache.enabled()
    assert not pass_cache.cache_dir().is_relative_to(Path.home() / ".cache")
