"""Batched speculation: many sequences in one target pass, the batch engine, generate_batch.

The promise: whatever shares a pass, each sequence's rows get the bits of a pass of its own
(the native backend, every dtype), so each request's greedy or seeded `match` answer equals
its solo answer, under random arrivals, lengths, cancellations and stop strings.
"""

from __future__ import annotations

import functools
import random

import pytest
import torch
from conftest import VOCAB_SIZE, TargetSpec, cached_tokenizer, cpu_policy, eagle3_head, eagle3_target
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import LlamaForCausalLM

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.backends.batch import RowGroup, evaluate_groups
from specdecode.backends.gather import DraftPasses, GatheredBackend
from specdecode.backends.native import NativeBackend
from specdecode.constraints import ConstraintSpec
from specdecode.costs import ALONE, CostModel, PassLoad
from specdecode.errors import SpecdecodeError
from specdecode.policy import PolicyModels
from specdecode.scheduler import (
    EXPLORE_BUDGET,
    EXPLORE_MAX,
    EXPLORE_MIN,
    BatchEngine,
    LoadRule,
    PassRecord,
    SpeculationGate,
)
from specdecode.testing import make_llama, perturbed_copy

GREEDY = SamplingParams(temperature=0)
SETTINGS = {
    "deadline": None,
    "suppress_health_check": [HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
}
DTYPES = ("float64", "float32", "bfloat16")


@functools.cache
def model(dtype: str) -> LlamaForCausalLM:
    """A target whose 1536-wide MLP makes the down projection's plan non-trivial in bf16."""
    base = make_llama(
        VOCAB_SIZE, hidden=64, layers=2, heads=4, kv_heads=2, intermediate=1536, init_std=0.5, seed=2
    )
    with torch.no_grad():
        base.lm_head.weight.mul_(4.0)
    return base.to(getattr(torch, dtype))


@functools.cache
def draft(dtype: str) -> LlamaForCausalLM:
    return perturbed_copy(model(dtype), 0.1)


def native(dtype: str, **kwargs) -> NativeBackend:
    return NativeBackend(model(dtype), cached_tokenizer(), **kwargs)


def prompts(count: int, seed: int = 0) -> list[list[int]]:
    """Prompts of varied lengths, some repetitive (n-gram drafts find something)."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        motif = [rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(2, 6))]
        out.append((motif * 8)[: rng.randrange(4, 30)] + [rng.randrange(3, VOCAB_SIZE) for _ in range(3)])
    return out


# --------------------------------------------------------------------------- the shared pass

group_shapes = st.lists(
    st.tuples(
        st.integers(1, 20),  # prefix length
        st.integers(1, 9),  # rows
        st.booleans(),  # a tree (random parents) or a chain
        st.integers(0, 2**16),  # seed of its tokens and parents
    ),
    min_size=2,
    max_size=5,
)


def make_groups(backends, shapes) -> list[RowGroup]:
    groups = []
    for backend, (prefix, rows, tree, seed) in zip(backends, shapes, strict=True):
        rng = random.Random(seed)
        backend.truncate(0)
        backend.evaluate([rng.randrange(3, VOCAB_SIZE) for _ in range(prefix)])
        ids = [rng.randrange(3, VOCAB_SIZE) for _ in range(rows)]
        parents = [rng.randrange(-1, node) for node in range(rows)] if tree else None
        groups.append(RowGroup(backend, ids, parents))
    return groups


@pytest.mark.parametrize("dtype", DTYPES)
@settings(max_examples=10, **SETTINGS)
@given(shapes=group_shapes)
def test_rows_of_a_shared_pass_equal_their_own_pass(dtype, shapes):
    """Chains and trees of several sequences in one forward: each group's logits, cache and
    pending nodes are bit for bit what its own pass gives."""
    first = native(dtype)
    together = make_groups([first, *(first.fork() for _ in shapes[1:])], shapes)
    alone = make_groups([native(dtype) for _ in shapes], shapes)
    shared = evaluate_groups(together)
    for group, own, logits in zip(together, alone, shared, strict=True):
        expected = (
            own.backend.evaluate(own.ids)
            if own.parents is None
            else own.backend.evaluate_tree(own.ids, own.parents)
        )
        assert torch.equal(logits, expected)
        assert group.backend.tokens == own.backend.tokens
        # What the next pass sees is the same too: commit (trees) and score one more row.
        if own.parents is not None:
            group.backend.commit([0])
            own.backend.commit([0])
        assert torch.equal(group.backend.evaluate([7]), own.backend.evaluate([7]))


def test_groups_split_into_passes_of_at_most_max_pass_rows():
    first = native("float32")
    backends = [first, *(first.fork() for _ in range(3))]
    shapes = [(5, 6, False, 1), (3, 6, True, 2), (4, 6, False, 3), (2, 6, True, 4)]
    for backend in backends:
        backend.max_pass_rows = 13  # two groups a pass
    together = evaluate_groups(make_groups(backends, shapes))
    alone = [
        g.backend.evaluate(g.ids) if g.parents is None else g.backend.evaluate_tree(g.ids, g.parents)
        for g in make_groups([native("float32") for _ in shapes], shapes)
    ]
    assert all(torch.equal(a, b) for a, b in zip(together, alone, strict=True))


def test_backends_without_a_shared_forward_score_each_group_alone(zoo):
    """transformers' forward: one pass per sequence, the same logits."""
    first = HFBackend(zoo.target(TargetSpec()), cached_tokenizer())
    shapes = [(5, 4, False, 1), (3, 5, True, 2)]
    together = evaluate_groups(make_groups([first, first.fork()], shapes))
    alone = make_groups([HFBackend(zoo.target(TargetSpec()), cached_tokenizer()) for _ in shapes], shapes)
    for logits, own in zip(together, alone, strict=True):
        expected = (
            own.backend.evaluate(own.ids)
            if own.parents is None
            else own.backend.evaluate_tree(own.ids, own.parents)
        )
        assert torch.allclose(logits, expected, rtol=1e-9, atol=1e-9)


def test_a_refused_group_changes_no_sequence():
    first = native("float64", n_ctx=32)
    backends = [first, first.fork(), first.fork()]
    groups = make_groups(backends, [(5, 3, False, 1), (6, 4, True, 2), (20, 3, False, 3)])
    groups[2].ids = list(range(3, 20))  # 20 cached + 17 > 32
    before = [list(b.tokens) for b in backends]
    with pytest.raises(SpecdecodeError, match="context full"):
        evaluate_groups(groups)
    assert [b.tokens for b in backends] == before
    assert all(len(b._tree) == 0 for b in backends)


def test_draft_passes_share_one_pass_per_round():
    """Three sequences drafting at once, each asking its model three times: three shared
    passes, each sequence getting the logits its own passes give."""
    first = native("float32")
    passes = DraftPasses()
    backends = [GatheredBackend(b, passes) for b in (first, first.fork(), first.fork())]
    alone = [native("float32") for _ in backends]

    def drafting(backend, seed):
        rng = random.Random(seed)
        out = [backend.evaluate([rng.randrange(3, VOCAB_SIZE) for _ in range(rng.randrange(1, 9))], 1)]
        for _ in range(2):
            out.append(backend.evaluate([int(out[-1][-1].argmax())]))
        return out

    together = passes.round([functools.partial(drafting, b, seed) for seed, b in enumerate(backends)])
    assert passes.passes == 3
    for seed, (logits, backend) in enumerate(zip(together, alone, strict=True)):
        assert all(torch.equal(a, b) for a, b in zip(logits, drafting(backend, seed), strict=True))
    # Outside a round, a gathered backend is its backend.
    assert torch.equal(backends[0].evaluate([5]), alone[0].evaluate([5]))
    assert passes.passes == 3


# --------------------------------------------------------------------------- generate_batch

SYSTEMS = {
    "plain": {"spec_types": []},
    "draft": {"spec_types": ["draft"], "draft_config": DraftModelConfig(p_min=0.0, n_max=6)},
    "ngram+draft": {"spec_types": ["ngram-simple", "draft"], "draft_config": DraftModelConfig(p_min=0.3)},
    "draft-tree": {
        "spec_types": ["draft"],
        "draft_config": DraftModelConfig(p_min=0.0, n_max=8, n_parallel=3),
    },
    "ngram-mod": {"spec_types": ["ngram-mod"]},
    "suffix": {"spec_types": ["suffix"]},
    # The adaptive policy prices each draft at what its rows add to the batch's pass.
    "ngram+draft@adaptive": {"spec_types": ["ngram-simple", "draft"], "spec_policy": "adaptive"},
}
MODES = {"greedy": GREEDY, "seeded": SamplingParams(temperature=0.9, top_k=20, seed=11)}


def pipeline(dtype: str, system: str) -> Pipeline:
    kwargs = dict(SYSTEMS[system])
    backend_draft = (
        NativeBackend(draft(dtype), cached_tokenizer()) if "draft" in kwargs["spec_types"] else None
    )
    if kwargs.get("spec_policy") == "adaptive":  # a large target's costs: the tiny one's draft nothing
        kwargs["policy_models"] = cpu_policy()
    return Pipeline(native(dtype), backend_draft, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("system", SYSTEMS)
@pytest.mark.parametrize("mode", MODES)
def test_generate_batch_equals_each_prompt_alone(dtype, system, mode, exactness_log):
    """Six prompts, four at a time (a finished one's place goes to the next): each answer is
    the solo answer, token for token, with and without the load rule."""
    sampling = MODES[mode]
    config = GenerationConfig(n_predict=24)
    batch = prompts(6, seed=len(system))
    solo = [pipeline(dtype, system).generate(p, sampling, config) for p in batch]
    for load_rule in (True, False):
        results = pipeline(dtype, system).generate_batch(
            batch, sampling, config, max_sequences=4, load_rule=load_rule
        )
        for ours, expected in zip(results, solo, strict=True):
            assert ours.tokens == expected.tokens
            assert ours.text == expected.text
            assert ours.stats.stop_reason == expected.stats.stop_reason
            # ngram-mod's pool and the suffix store are shared by the batch; the adaptive policy
            # drafts by the batch.
            if not load_rule and system not in ("ngram-mod", "suffix", "ngram+draft@adaptive"):
                # The batched draft model drafted exactly what it drafts alone.
                assert ours.stats.totals.n_drafted == expected.stats.totals.n_drafted
            exactness_log.record(
                f"batch/{system}-{mode}", "native", ours.stats, ours.stats.stop_reason, dtype
            )


@pytest.mark.parametrize("mode", MODES)
def test_generate_batch_with_eagle3_equals_alone(zoo, mode, exactness_log):
    """EAGLE-3 reads each sequence's own hidden states, recorded through the shared pass."""
    sampling = MODES[mode]
    config = GenerationConfig(n_predict=20)
    batch = [list(range(3 + i, 18 + 2 * i)) for i in range(5)]

    def make() -> Pipeline:
        return Pipeline(
            NativeBackend(eagle3_target(), cached_tokenizer()),
            eagle3=eagle3_head(),
            draft_config=DraftModelConfig(p_min=0.0),
        )

    solo = [make().generate(p, sampling, config) for p in batch]
    batched = make()
    results = batched.generate_batch(batch, sampling, config, max_sequences=3, load_rule=False)
    passes, _ = batched._seats(3)
    assert passes is not None and passes.passes > 0  # the heads' steps were shared
    drafted = 0
    for ours, expected in zip(results, solo, strict=True):
        assert ours.tokens == expected.tokens
        assert not any(strategy.n_failed for strategy in ours.stats.strategies)
        drafted += ours.stats.totals.n_drafted
        exactness_log.record(f"batch/eagle3-{mode}", "native", ours.stats, ours.stats.stop_reason, "float64")
    assert drafted > 0


@pytest.mark.parametrize("mode", MODES)
def test_constrained_generate_batch_equals_constrained_alone(mode, exactness_log):
    """Each sequence walks its own grammar; masks, drafts cut at forbidden tokens and forced
    drafts compose with the shared pass."""
    spec = ConstraintSpec("regex", r"(x = [0-9]{1,3}\n){2,4}")
    config = GenerationConfig(n_predict=30)
    batch = prompts(5, seed=9)
    solo = [
        pipeline("float32", "ngram+draft").generate(p, MODES[mode], config, constraint=spec) for p in batch
    ]
    results = pipeline("float32", "ngram+draft").generate_batch(
        batch, MODES[mode], config, max_sequences=3, constraint=spec
    )
    for ours, expected in zip(results, solo, strict=True):
        assert ours.tokens == expected.tokens and ours.stats.stop_reason == expected.stats.stop_reason
        exactness_log.record(
            f"batch/constrained-{mode}", "native", ours.stats, ours.stats.stop_reason, "float32"
        )


def test_generate_batch_refuses_bad_requests_before_any_work():
    pipe = pipeline("float64", "draft")
    pipe.target.evaluate([5, 6, 7])
    with pytest.raises(SpecdecodeError, match="max_sequences"):
        pipe.generate_batch([[5, 6]], max_sequences=0)
    with pytest.raises(SpecdecodeError, match="2 prompts but 1 sampling"):
        pipe.generate_batch([[5, 6], [7, 8]], [GREEDY])
    with pytest.raises(SpecdecodeError, match="context"):
        pipe.generate_batch([[5, 6], list(range(3, 3 + pipe.target.n_ctx))], GREEDY)
    assert pipe.target.tokens == [5, 6, 7]


# --------------------------------------------------------------------------- the engine


@pytest.mark.parametrize("dtype", ("float64", "bfloat16"))
@pytest.mark.parametrize("seed", range(3))
def test_engine_under_random_arrivals_lengths_cancellations_and_stops(dtype, seed, exactness_log):
    """Requests join at random steps with random lengths, sampling and stop strings on a pool
    of four seats; some are cancelled mid-way. Every finished answer equals its solo answer;
    a cancelled one is a prefix of it."""
    rng = random.Random(seed)
    front = pipeline(dtype, "ngram+draft")
    seats = [front, *(front.fork() for _ in range(3))]
    requests = []
    for index, prompt in enumerate(prompts(10, seed=seed)):
        sampling = (
            GREEDY if rng.random() < 0.5 else SamplingParams(temperature=0.8, seed=rng.randrange(1 << 30))
        )
        stop = (front.target.detokenize(prompt[-2:]),) if rng.random() < 0.3 else ()
        config = GenerationConfig(n_predict=rng.randrange(1, 30), stop=stop)
        requests.append((index, prompt, sampling, config, rng.random() < 0.2))
    engine = BatchEngine(LoadRule(CostModel()))
    free = list(seats)
    waiting = list(requests)
    running = {}
    finished = {}
    steps = 0
    while waiting or len(engine):
        if waiting and free and rng.random() < 0.6:
            index, prompt, sampling, config, cancel = waiting.pop(0)
            seat = free.pop()
            chunks = []
            entry = engine.add(seat.stream(prompt, sampling, config), chunks.append)
            running[id(entry)] = (index, seat, chunks, steps + rng.randrange(1, 6) if cancel else None)
        for entry in engine.entries:
            cancel_at = running[id(entry)][3]
            if cancel_at is not None and steps >= cancel_at:
                entry.cancelled = True
        for entry in engine.step():
            index, seat, chunks, _ = running.pop(id(entry))
            assert entry.error is None
            finished[index] = (entry, chunks)
            free.append(seat)
        steps += 1
    for index, prompt, sampling, config, _ in requests:
        entry, chunks = finished[index]
        run = entry.generation
        solo = pipeline(dtype, "ngram+draft").generate(prompt, sampling, config)
        assert [t for c in chunks for t in c.tokens] == run.tokens
        if run.stats.stop_reason == "abandoned":
            assert run.tokens == solo.tokens[: len(run.tokens)]
            continue
        assert run.tokens == solo.tokens and run.text == solo.text
        assert "".join(c.text for c in chunks) == solo.text
        exactness_log.record("batch/engine-random", "native", run.stats, run.stats.stop_reason, dtype)


def test_a_failing_sequence_fails_alone():
    """One sequence's strategy raising is that sequence's error; the others finish exactly."""
    front = pipeline("float64", "plain")
    seats = [front, front.fork(), front.fork()]
    engine = BatchEngine()
    batch = prompts(3, seed=5)
    entries = [
        engine.add(seat.stream(p, GREEDY, GenerationConfig(n_predict=12)), lambda chunk: None)
        for seat, p in zip(seats, batch, strict=True)
    ]

    def broken(*args):
        raise RuntimeError("broken plan")

    entries[1].generation.plan = broken
    left = []
    while len(engine):
        left += engine.step()
    assert isinstance(entries[1].error, RuntimeError)
    for index in (0, 2):
        assert entries[index].error is None
        assert (
            entries[index].generation.tokens
            == pipeline("float64", "plain")
            .generate(batch[index], GREEDY, GenerationConfig(n_predict=12))
            .tokens
        )


# --------------------------------------------------------------------------- the load rule


def line(a: float, b: float) -> LoadRule:
    costs = CostModel()
    costs.calibrated = {1: a + b, 64: a + 64 * b}
    return LoadRule(costs)


def test_the_load_rule_shortens_drafts_as_the_batch_grows():
    rule = line(0.010, 0.0005)
    caps = [rule.max_draft(batch, 0.7, 0.0) for batch in (1, 2, 4, 8, 16, 32, 64)]
    assert caps == sorted(caps, reverse=True) and caps[0] > caps[-1]
    assert rule.max_draft(1000, 0.7, 0.0) == 0  # rows are nearly all the cost: no drafts
    assert rule.max_draft(8, 0.0, 0.0) == 0  # never kept: never drafted
    assert rule.max_draft(8, 1.0, 0.0) is None  # always kept and affordable: no cap
    # A dear drafting model shortens drafts further.
    assert rule.max_draft(4, 0.7, 0.002) < rule.max_draft(4, 0.7, 0.0)
    # Free rows: drafts are free too.
    assert line(0.01, 0.0).max_draft(64, 0.5, 0.0) is None


class FixedCosts(CostModel):
    """Passes costing `base` + `row` seconds a row, whatever the passes run take: the machine a
    test stands for (the tiny models' real passes cost a millisecond or so)."""

    def __init__(self, base: float, row: float) -> None:
        super().__init__()
        self.base, self.row = base, row

    def pass_time(self, rows: float, sequences: int = 1) -> float:
        return self.base + self.row * rows

    def observe_pass(self, rows: int, seconds: float, sequences: int = 1, weight: float = 1.0) -> None:
        """Held fixed."""


ROWS_COST_A_TOKEN = (0.01, 1.0)  # a CPU whose cores a batch keeps busy: a verify row ~ a token
ROWS_NEARLY_FREE = (1.0, 0.001)  # a memory-bound pass (a GPU, a large model)
DRAFTING = DraftModelConfig(p_min=0.0, n_max=4)


def measured_gate(costs: tuple[float, float]) -> SpeculationGate:
    """A gate that has measured one step each way: 1 ms a sequence besides the pass, 2 ms when
    it drafted two tokens a sequence."""
    gate = SpeculationGate(FixedCosts(*costs))
    assert gate.choose([(0.9, None)] * 8) is True  # drafting is tried first
    gate.observe(8, True, drafted=16, seconds=0.016)
    assert gate.choose([(0.9, 2.0)] * 8) is False  # then plain
    gate.observe(8, False, drafted=0, seconds=0.008)
    return gate


def test_the_gate_steps_plainly_where_a_verify_row_costs_nearly_a_token():
    gate = measured_gate(ROWS_COST_A_TOKEN)
    plain, draft = gate.rates([(0.9, 2.0)] * 8)
    assert draft < plain  # 2.71 tokens for 3 rows a sequence
    choices = [gate.choose([(0.9, 2.0)] * 8) for _ in range(EXPLORE_MAX)]
    # Drafting is still tried, the more rarely the more a try loses: the tokens its longer
    # step falls short by, at most EXPLORE_BUDGET of the tokens (a try more at the end).
    tries = choices.count(True)
    assert 1 <= tries <= EXPLORE_MAX // EXPLORE_MIN
    (plain_tokens, _), (_, draft_seconds) = gate.steps_ahead([(0.9, 2.0)] * 8)
    lost = (plain - draft) * draft_seconds / plain_tokens  # a step's tokens
    assert tries * lost <= EXPLORE_BUDGET * EXPLORE_MAX + lost
    # Only drafts kept every time pay there.
    assert gate.rates([(1.0, 2.0)] * 8)[1] > plain


def test_the_gate_drafts_where_rows_are_nearly_free_and_drafts_are_kept():
    gate = measured_gate(ROWS_NEARLY_FREE)
    plain, draft = gate.rates([(0.9, 2.0)] * 8)
    assert draft > 2 * plain
    choices = [gate.choose([(0.9, 2.0)] * 8) for _ in range(EXPLORE_MAX)]
    assert 1 <= choices.count(False) <= EXPLORE_MAX // EXPLORE_MIN  # plain tried now and then
    # Drafts never kept do not pay even there: each drafted token costs 0.5 ms and a row.
    assert gate.rates([(0.0, 2.0)] * 8)[1] < plain


@pytest.mark.parametrize("costs", ["rows cost a token", "rows nearly free"])
def test_the_engine_drafts_only_where_it_pays_and_answers_stay_plain(costs, exactness_log):
    """Under load, a close draft (mostly kept) is run only where the pass costs make it pay:
    where rows are nearly free, not where a verify row costs nearly a token. Either way each
    answer is the solo answer."""
    line = ROWS_COST_A_TOKEN if costs == "rows cost a token" else ROWS_NEARLY_FREE
    drafter = NativeBackend(perturbed_copy(model("float64"), 0.01), cached_tokenizer())
    config = GenerationConfig(n_predict=40)

    def make() -> Pipeline:
        return Pipeline(native("float64"), drafter.fork(), spec_types=["draft"], draft_config=DRAFTING)

    front = make()
    batch = prompts(8, seed=3)
    solo = [make().generate(p, GREEDY, config) for p in batch]
    engine = BatchEngine(LoadRule(FixedCosts(*line)))
    choices: list[bool] = []
    choose = engine.gate.choose
    engine.gate.choose = lambda sequences: choices.append(choose(sequences)) or choices[-1]
    results = {}

    def done(index, entry):
        assert entry.error is None
        results[index] = entry.generation

    engine.run(
        [front.fork() for _ in range(4)],
        len(batch),
        lambda seat, i: seat.stream(batch[i], GREEDY, config),
        done,
    )
    for index, expected in enumerate(solo):
        assert results[index].tokens == expected.tokens
        exactness_log.record(f"batch/gate-{costs}", "native", results[index].stats)
    tries = 1 + len(choices) // EXPLORE_MIN  # the first step each way, then a try now and then
    assert len(choices) > EXPLORE_MIN
    assert choices.count(costs == "rows nearly free") >= len(choices) - tries


def test_the_adaptive_policy_learns_each_shared_pass_once_at_its_shape():
    """Under the adaptive policy, each sequence reports its rows' share of the shared pass:
    the cost model counts every pass once, under its rows and sequences, and the engine caps
    no draft (the policy prices a batch's rows itself)."""
    draft_backend = NativeBackend(draft("float64"), cached_tokenizer())
    front = Pipeline(
        native("float64"),
        draft_backend,
        spec_types=["ngram-simple", "draft"],
        spec_policy="adaptive",
        policy_models=PolicyModels(),
    )
    assert front.load_rule() is None
    records: list[PassRecord] = []
    engine = BatchEngine(front.load_rule(), on_pass=records.append, costs=front.policy_models.costs)
    batch = prompts(5)
    engine.run(
        [front.fork() for _ in range(3)],
        len(batch),
        lambda seat, i: seat.stream(batch[i], GREEDY, GenerationConfig(n_predict=12)),
        lambda i, entry: None,
    )
    shapes: dict[tuple[int, int], int] = {}
    for record in records:
        shapes[(record.rows, record.sequences)] = shapes.get((record.rows, record.sequences), 0) + 1
    measured = front.policy_models.costs.measured
    assert set(measured) == set(shapes)
    for shape, count in shapes.items():
        assert measured[shape][0] == pytest.approx(count)
    assert any(sequences > 1 for _, sequences in shapes)


def test_each_sequence_plans_knowing_the_rest_of_the_pass(steady_clock):
    """Every sequence is told what else its pass will hold: the other sequences' rows as in the
    previous pass (one for a sequence that has not been in one) and the sequences in all."""
    draft_backend = NativeBackend(draft("float64"), cached_tokenizer())
    front = Pipeline(
        native("float64"),
        draft_backend,
        spec_types=["draft"],
        spec_policy="adaptive",
        policy_models=cpu_policy(),
    )
    engine = BatchEngine()
    loads: list[list[PassLoad]] = []
    entries = []
    for prompt in prompts(3):
        generation = front.fork().stream(prompt, GREEDY, GenerationConfig(n_predict=10))
        plan = generation.plan

        def recording(cap=None, load=ALONE, plan=plan):
            loads[-1].append(load)
            return plan(cap, load)

        generation.plan = recording
        entries.append(engine.add(generation, lambda chunk: None))
    rows = [1, 1, 1]
    while len(engine):
        loads.append([])
        planned = len(engine.entries)
        engine.step()
        if len(loads[-1]) == planned == 3:
            assert loads[-1] == [PassLoad(sum(rows) - own, 3) for own in rows]
        rows = [entry.rows for entry in entries]
    assert any(load.other_rows > 2 for step in loads for load in step)  # someone drafted
    assert BatchEngine().gate is None and BatchEngine(gate=True).gate is not None
    assert BatchEngine(LoadRule(CostModel())).gate is not None  # with the rule, as before
