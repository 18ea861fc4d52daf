"""The adaptive policy's pass timings, stored across runs: reused for the same model and
machine, timed again for another key, a damaged file or a foreign one."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from specdecode import pass_cache
from specdecode.api import Pipeline
from specdecode.backends.load import load_backend
from specdecode.policy import CALIBRATION_ROWS, CostModel, PolicyModels

TIMING = "timing the target's passes for the adaptive policy"
REUSING = "reusing the target's pass timings from an earlier run"


@pytest.fixture
def cache(tmp_path: Path, monkeypatch) -> Path:
    """The pass cache, turned on in a temporary directory: its folder of timings."""
    monkeypatch.delenv("SPECDECODE_NO_PASS_CACHE", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    return tmp_path / "cache" / "specdecode" / "pass-costs"


@pytest.fixture
def timings(monkeypatch) -> list[int]:
    """A record of the real calibration's calls (one entry per call)."""
    calls: list[int] = []
    calibrate = CostModel.calibrate

    def counted(self, backend, rows=CALIBRATION_ROWS):
        calls.append(1)
        return calibrate(self, backend, rows)

    monkeypatch.setattr(CostModel, "calibrate", counted)
    return calls


def load_policy(model_dir: Path) -> tuple[PolicyModels, list[str]]:
    lines: list[str] = []
    return PolicyModels.for_target(load_backend(model_dir), lines.append), lines


def test_a_second_load_reuses_the_timings_written_by_the_first(saved_model_dir, cache, timings):
    first, said = load_policy(saved_model_dir)
    assert said == [TIMING] and len(timings) == 1
    assert len(list(cache.glob("*.json"))) == 1
    second, said = load_policy(saved_model_dir)
    assert said == [REUSING] and len(timings) == 1
    assert second.costs.calibrated == first.costs.calibrated
    assert set(first.costs.calibrated) == set(CALIBRATION_ROWS)
    assert second.costs.pass_time(5) == first.costs.pass_time(5)


def test_changed_weights_are_timed_again(saved_model_dir, cache, timings):
    load_policy(saved_model_dir)
    weights = next(saved_model_dir.glob("*.safetensors"))
    stat = weights.stat()
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _, said = load_policy(saved_model_dir)
    assert said == [TIMING] and len(timings) == 2
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
    assert said == [TIMING] and len(timings) == 2
    _, said = load_policy(saved_model_dir)  # rewritten whole
    assert said == [REUSING] and len(timings) == 2


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
    assert len(timings) == 3 and not cache.exists()


def test_an_unwritable_cache_only_costs_the_timing(saved_model_dir, tmp_path, monkeypatch, timings):
    monkeypatch.delenv("SPECDECODE_NO_PASS_CACHE", raising=False)
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "file"))  # a file where the folder goes
    for _ in range(2):
        _, said = load_policy(saved_model_dir)
        assert said == [TIMING]
    assert len(timings) == 2


def test_the_pipeline_says_which_happened(saved_model_dir, cache, timings):
    phases = []
    for _ in range(2):
        lines: list[str] = []
        settings = {"spec_types": ["ngram-simple"], "spec_policy": "adaptive"}
        Pipeline.load(saved_model_dir, progress=lines.append, **settings)
        phases.append(lines[1:])
    assert phases == [[TIMING], [REUSING]] and len(timings) == 1
