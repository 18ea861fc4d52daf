"""Prompts entering a running batch: their chunks fill what the step's budget of rows leaves,
and every answer still equals the answer the request gets alone."""

from __future__ import annotations

import functools
import random

import pytest
import torch
from conftest import VOCAB_SIZE, cached_tokenizer
from transformers import LlamaForCausalLM

from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.hf import HFBackend
from specdecode.backends.native import NativeBackend
from specdecode.costs import CostModel
from specdecode.generate import exact_chunk_rows
from specdecode.loadtest import Gaps, gap_report
from specdecode.scheduler import PREFILL_FLOOR, BatchEngine, PassRecord
from specdecode.testing import make_llama, perturbed_copy

MODES = {"greedy": SamplingParams(temperature=0), "seeded": SamplingParams(temperature=0.9, top_k=20, seed=7)}
N_BATCH = 32  # a solo run's prompt chunks: row-invariant passes, so chunks may shrink


@functools.cache
def model(dtype: str) -> LlamaForCausalLM:
    base = make_llama(
        VOCAB_SIZE, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=256, init_std=0.5, seed=4
    )
    with torch.no_grad():
        base.lm_head.weight.mul_(4.0)
    return base.to(getattr(torch, dtype))


def pipeline(dtype: str, speculative: bool) -> Pipeline:
    target = NativeBackend(model(dtype), cached_tokenizer(), n_batch=N_BATCH, n_ctx=512)
    if not speculative:
        return Pipeline(target, None, spec_types=[])
    draft = NativeBackend(perturbed_copy(model(dtype), 0.1), cached_tokenizer(), n_ctx=512)
    return Pipeline(target, draft, spec_types=["draft"], draft_config=DraftModelConfig(p_min=0.0, n_max=4))


def row_costs() -> CostModel:
    """Pass costs proportional to rows: a decode pass of D rows leaves room for about D prompt
    rows a step (PREFILL_FLOOR at least)."""
    costs = CostModel()
    costs.calibrated = {1: 1.0, 2: 2.0, 4: 4.0, 8: 8.0, 16: 16.0, 32: 32.0, 64: 64.0}
    return costs


def requests(seed: int) -> list[tuple[int, list[int]]]:
    """(step it joins at, prompt): three short prompts at once, then longer ones one by one."""
    rng = random.Random(seed)
    short = [(0, [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(3, 12))]) for _ in range(3)]
    long = [
        (step, [rng.randrange(3, VOCAB_SIZE) for _ in range(length)])
        for step, length in ((2, 150), (3, 70), (9, 45))
    ]
    return short + long


@pytest.mark.parametrize("dtype", ("float64", "bfloat16"))
@pytest.mark.parametrize("speculative", (False, True), ids=("plain", "draft"))
@pytest.mark.parametrize("mode", MODES)
def test_prompts_entering_beside_decoding_sequences_answer_as_alone(dtype, speculative, mode, exactness_log):
    """Long prompts join while short ones decode: their chunks ride in the decode passes, cut to
    the budget (not the solo run's 32-row chunks), several prompts in a pass when rows are left;
    every answer equals its solo answer, token for token."""
    sampling, config = MODES[mode], GenerationConfig(n_predict=40, ignore_eos=True)
    front = pipeline(dtype, speculative)
    seats = [front, *(front.fork() for _ in range(5))]
    records: list[PassRecord] = []
    engine = BatchEngine(costs=row_costs(), on_pass=records.append)
    entries = {}
    waiting = requests(seed=len(mode))
    step = 0
    while waiting or len(engine):
        while waiting and waiting[0][0] <= step:
            _, prompt = waiting.pop(0)
            entries[len(entries)] = (
                engine.add(seats[len(entries)].stream(prompt, sampling, config), _drop),
                prompt,
            )
        engine.step()
        step += 1
    solo = pipeline(dtype, speculative)
    for index, (entry, prompt) in entries.items():
        assert entry.error is None
        expected = solo.generate(prompt, sampling, config)
        assert entry.generation.tokens == expected.tokens and entry.generation.text == expected.text
        # the prompt's cache holds the bits a solo run's does
        mixed, alone, n = seats[index].target._kv, solo.target._kv, len(prompt)
        assert torch.equal(mixed.keys[:, :, :n], alone.keys[:, :, :n])
        assert torch.equal(mixed.values[:, :, :n], alone.values[:, :, :n])
        exactness_log.record(f"prefill/mixed-{mode}", "native", entry.generation.stats, "", dtype)
    # prompt rows shared passes with decoding sequences, in chunks no solo run makes
    assert any(record.sequences > 3 for record in records)
    assert any(record.rows % N_BATCH not in (0, 3) for record in records)


def test_the_budget_bounds_the_prompt_rows_of_every_step():
    """A 300-token prompt arrives beside three decoding sequences: every step's chunk rides in
    the decode pass, within the budget the engine had at the step's start."""
    front = pipeline("float32", speculative=False)
    seats = [front, front.fork(), front.fork(), front.fork()]
    costs = CostModel()
    costs.calibrate(front.target, (1, 2, 4, 8, 16, 32, 64))
    records: list[PassRecord] = []
    engine = BatchEngine(costs=costs, on_pass=records.append)
    config = GenerationConfig(n_predict=80, ignore_eos=True)
    for seat, length in zip(seats[:3], (4, 5, 6), strict=True):
        engine.add(seat.stream(list(range(10, 10 + length)), MODES["greedy"], config), _drop)
    for _ in range(3):  # the short prompts, one solo chunk a step while nothing decodes
        engine.step()
    prompt = [(7 * i) % 300 + 3 for i in range(300)]
    long = engine.add(seats[3].stream(prompt, MODES["greedy"], config), _drop)
    while long.generation.prefilling:
        budget = engine._prefill_budget(3, 3, NativeBackend.max_pass_rows - 3)
        before = long.generation.prefilled
        engine.step()
        assert records[-1].sequences == 4  # the chunk rode in the decode pass
        assert long.generation.prefilled - before == records[-1].rows - 3 <= budget
    solo = pipeline("float32", speculative=False).generate(prompt, MODES["greedy"], config)
    assert long.generation.tokens == solo.tokens[:1]


def test_the_budget_is_what_a_decode_pass_costs():
    """Prompt rows may add what the decode pass costs (PREFILL_PASSES = 2), at the cost model's
    slope until prompt rows were measured, then at their measured cost; never under the floor
    nor over the pass's room."""
    engine = BatchEngine(costs=row_costs())  # a pass of T rows costs T seconds
    assert engine._prefill_budget(40, 40, 88) in (39, 40)
    assert engine._prefill_budget(3, 3, 125) == PREFILL_FLOOR
    assert engine._prefill_budget(100, 100, 28) == 28
    engine._observe_prompt_rows(10, 20.0)  # 2 s a prompt row: dearer than the line says
    assert engine._prefill_budget(40, 40, 88) in (19, 20)
    assert engine._prefill_budget(40, 40, None) in (19, 20)  # in a pass of its own alike


def test_backends_whose_rows_depend_on_the_pass_keep_whole_chunks():
    """Chunks shrink only where no bit changes: a native pass longer than max_pass_rows, or
    transformers' passes of any size, are reproduced only by the solo run's very chunks."""
    native = NativeBackend(model("float32"), cached_tokenizer(), n_batch=N_BATCH)
    assert exact_chunk_rows(native, N_BATCH) == NativeBackend.max_pass_rows
    assert exact_chunk_rows(native, 512) == 0
    assert exact_chunk_rows(HFBackend(model("float32"), cached_tokenizer(), n_batch=N_BATCH), N_BATCH) == 0
    long = NativeBackend(model("float32"), cached_tokenizer(), n_batch=256, n_ctx=512)
    generation = Pipeline(long, None, spec_types=[]).stream(list(range(3, 303)), MODES["greedy"])
    assert len(generation.prefill_rows(limit=16)) == 256


def _drop(chunk) -> None:
    """The answers are read from the generations."""


def test_loadtest_gaps_are_measured_while_the_long_prompt_is_in():
    """A stream's largest gap counts only gaps overlapping the long prompt's evaluation; a
    decode step is the mean gap before it (chunks sent together arrive together)."""
    before = [0.0, 0.01, 0.01, 0.03, 0.04]  # mean gap 0.01 s, one pair arrived together
    gaps = Gaps([[*before, 0.05, 0.25, 0.26, 0.31, 1.5]], sent=0.045, answered=0.3, prompt_tokens=100)
    assert gaps.decode_step() == pytest.approx(0.01)
    assert gaps.largest(gaps.arrivals[0]) == pytest.approx(0.2)  # not the 1.19 s after it
    assert "= 20.0 decode steps" in gap_report(gaps)
