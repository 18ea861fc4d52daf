"""Replaying acceptance traces (`specdecode.bench.replay`): traces recorded with the bundled pair
on the CPU, replayed through a tiny random Llama of another vocabulary with tiny random
drafters, as the GPU check replays them through the real shapes (`specdecode.compare.gpu_replay`)."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from specdecode.api import Pipeline
from specdecode.backends.load import native_backend
from specdecode.backends.options import LoadOptions
from specdecode.bench.replay import (
    BatchSeats,
    DraftModels,
    ReplayError,
    check_replay,
    replay,
    replay_batch,
    replay_context,
)
from specdecode.bench.traces import Trace, mapped_ids, parse_traces, read_traces, record_steps, write_traces
from specdecode.compare.gpu_models import (
    Run,
    random_dflash,
    random_head,
    random_model,
    random_mtp,
    word_tokenizer,
)
from specdecode.compare.gpu_replay import SECTION, TINY_DRAFTER, TRACES, replay_section
from specdecode.compare.gpu_report import Report
from specdecode.compare.gpu_setup import PROMPTS, QUICK, SHAPES
from specdecode.config import NgramModConfig, NgramSettings
from specdecode.defaults import bundled_eagle3
from specdecode.generate import GenerationConfig
from specdecode.sampling import SamplingParams
from specdecode.strategies import DraftModelConfig
from specdecode.strategies.eagle3_checkpoint import load_head
from specdecode.train.dflash import DFlashShape
from specdecode.train.dflash import new_head as new_dflash
from specdecode.train.mtp import new_layer as new_mtp

N_PREDICT = 24
CPU = torch.device("cpu")
TINY = SHAPES["tiny"]
SHORT_NGRAMS = NgramSettings(mod=NgramModConfig(n_match=2, n_min=1, n_max=8))


def record(pipe: Pipeline, name: str, prompt: str, temperature: float, n_predict: int = N_PREDICT) -> Trace:
    """A trace of the pipeline's generation, headed as the recorder heads one."""
    sampling = SamplingParams(temperature=temperature, seed=7 if temperature else None)
    generation = pipe.stream(prompt, sampling, GenerationConfig(n_predict=n_predict))
    steps = record_steps(generation)
    for _ in generation:
        pass
    vocab = pipe.target.vocab
    meta = {
        "pair": "bundled",
        "spec": ",".join(pipe.spec_types),
        "task": "test",
        "temperature": temperature,
        "seed": sampling.seed,
        "n_predict": n_predict,
        "policy": "classic",
    }
    return Trace(name, list(generation.prompt), vocab.size, sorted(vocab.eog_ids), steps, meta)


@pytest.fixture(scope="module")
def bundled() -> Pipeline:
    """The bundled pair on the native backend (auto would first probe llama.cpp's rows)."""
    native = LoadOptions(backend="native")
    return Pipeline.load(spec_types=["draft"], target_options=native, draft_options=native)


@pytest.fixture(scope="module")
def traces(bundled: Pipeline) -> dict[str, Trace]:
    target, draft = bundled.target, bundled.draft
    tree = Pipeline(target, draft, spec_types=["draft"], draft_config=DraftModelConfig(n_parallel=4))
    eagle3 = Pipeline(target, eagle3=load_head(bundled_eagle3(), target), spec_types=["eagle3"])
    ngram = Pipeline(target, spec_types=["ngram-mod"], ngram=SHORT_NGRAMS)
    suffix = Pipeline(target, spec_types=["suffix"])
    # Untrained drafters (the MTP layer starts as the target's last layer), drafting at p_min 0:
    # they draft, which is all a replay's bookkeeping needs.
    unsure = DraftModelConfig(p_min=0.0, n_max=6)
    dflash_head = new_dflash(target.model, DFlashShape(mask_token_id=3), seed=0)
    dflash = Pipeline(target, dflash=dflash_head, spec_types=["dflash"], draft_config=unsure)
    mtp = Pipeline(target, mtp=new_mtp(target.model, seed=0), spec_types=["mtp"], draft_config=unsure)
    recorded = {
        "chain greedy": record(bundled, "chain greedy", PROMPTS[2], 0.0),
        "chain t0.8": record(bundled, "chain t0.8", PROMPTS[3], 0.8),
        "tree greedy": record(tree, "tree greedy", PROMPTS[3], 0.0),
        "tree t0.8": record(tree, "tree t0.8", PROMPTS[2], 0.8),
        "eagle3 greedy": record(eagle3, "eagle3 greedy", PROMPTS[2], 0.0),
        # ngram-mod indexes new tokens 32 at a time: it drafts from the output after those
        "ngram-mod greedy": record(ngram, "ngram-mod greedy", PROMPTS[0], 0.0, n_predict=48),
        "suffix greedy": record(suffix, "suffix greedy", PROMPTS[0], 0.0),
        "dflash greedy": record(dflash, "dflash greedy", PROMPTS[2], 0.0),
        "mtp t0.8": record(mtp, "mtp t0.8", PROMPTS[3], 0.8),
    }
    target.capture_hidden([])  # the other pipelines' target records nothing more
    return recorded


class Counted:
    """A backend that counts its passes."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.passes = 0

    def __getattr__(self, name: str):
        return getattr(self.backend, name)

    def evaluate(self, ids, logits_rows=None):
        self.passes += 1
        return self.backend.evaluate(ids, logits_rows)


@pytest.fixture(scope="module")
def tiny():
    """A tiny random Llama (512 ids: the recorded 8192 are mapped), its drafter and heads."""
    model = random_model(TINY, CPU)
    tokenizer = word_tokenizer(TINY.vocab)
    drafter = random_model(TINY_DRAFTER, CPU)
    heads = (random_head(TINY, model, CPU), random_dflash(TINY, model, CPU), random_mtp(TINY, model, CPU))
    return model, tokenizer, drafter, heads


def tiny_backends(tiny, n_ctx: int = 256):
    model, tokenizer, drafter, (head, dflash, mtp) = tiny
    target = native_backend(model, tokenizer, passes="invariant", n_ctx=n_ctx, name="tiny")
    draft = Counted(native_backend(drafter, tokenizer, passes="invariant", n_ctx=n_ctx, name="tiny drafter"))
    return target, DraftModels(draft=draft, head=head, dflash=dflash, mtp=mtp, ngram=SHORT_NGRAMS)


@pytest.mark.parametrize(
    "name",
    [
        "chain greedy",
        "chain t0.8",
        "tree greedy",
        "tree t0.8",
        "eagle3 greedy",
        "ngram-mod greedy",
        "suffix greedy",
        "dflash greedy",
        "mtp t0.8",
    ],
)
def test_a_replay_through_another_model_follows_its_trace(traces, tiny, name):
    trace = traces[name]
    assert any(step.drafted for step in trace.steps), "the recording drafted"
    target, drafters = tiny_backends(tiny)
    result = replay(trace, target, drafters)
    check_replay(result)
    assert result.stats.n_passes == trace.n_passes
    assert result.stats.tokens_per_pass == trace.tokens_per_pass
    assert result.tokens == mapped_ids(trace.tokens, trace, TINY.vocab, 1) != trace.tokens
    assert result.n_inner_calls >= sum(step.drafted for step in trace.steps)
    if "draft" in trace.meta["spec"]:
        assert drafters.draft.passes >= sum(step.drafted for step in trace.steps) > 0


def test_a_drafting_model_runs_as_deep_as_the_recorded_drafts(traces, tiny):
    """Classic recordings run the model a step past each kept draft and on empty steps; others
    only on drafting steps, as deep as their drafts."""
    trace = traces["chain greedy"]
    adaptive = dataclasses.replace(trace, meta={**trace.meta, "policy": "adaptive"})
    target, drafters = tiny_backends(tiny)
    check_replay(replay(adaptive, target, drafters))
    assert drafters.draft.passes == sum(len(step.draft) for step in trace.steps)
    target, drafters = tiny_backends(tiny)
    check_replay(replay(trace, target, drafters))
    expected, emitted = 0, len(trace.steps[0].emitted)
    for step in trace.steps[1:]:
        allowed = N_PREDICT - emitted - 1  # the step's depth budget: the tokens left, less its own
        expected += min(len(step.draft) + 1, 16, allowed) if allowed > 0 else 0
        emitted += len(step.emitted)
    assert drafters.draft.passes == expected


@pytest.mark.parametrize("name", ["chain greedy", "tree t0.8"])
def test_a_replay_through_the_recording_pair_decides_every_step_as_recorded(bundled, traces, name):
    trace = traces[name]
    bundled.target.truncate(0)
    result = replay(trace, bundled.target, DraftModels(draft=bundled.draft))
    check_replay(result)
    assert result.tokens == trace.tokens
    assert result.n_agreed == len(trace.steps)  # the target's own verification agreed every time


def test_traces_replay_as_a_batch(traces, tiny):
    chosen = [
        traces["chain greedy"],
        traces["tree t0.8"],
        traces["ngram-mod greedy"],
        traces["chain t0.8"],
        traces["dflash greedy"],
        traces["mtp t0.8"],
    ]
    target, drafters = tiny_backends(tiny)
    seats = BatchSeats.make(target, drafters, 3)
    assert len({id(each.shared) for _, each in seats.seats}) == 1  # one ngram-mod pool, as a pipeline's forks
    results = replay_batch(chosen, seats)
    for trace, result in zip(chosen, results, strict=True):
        check_replay(result)
        assert result.tokens == mapped_ids(trace.tokens, trace, TINY.vocab, 1)


def test_replays_refuse_what_they_cannot_follow(traces, tiny):
    trace = traces["chain greedy"]
    target, drafters = tiny_backends(tiny, n_ctx=replay_context(trace) - 1)
    with pytest.raises(ReplayError, match="needs a context"):
        replay(trace, target, drafters)
    target, drafters = tiny_backends(tiny)
    result = replay(trace, target, drafters)
    with pytest.raises(ReplayError, match="other tokens"):
        check_replay(dataclasses.replace(result, expected=[*result.expected[:-1], 0]))
    short = dataclasses.replace(result, trace=dataclasses.replace(trace, steps=trace.steps[:-1]))
    with pytest.raises(ReplayError, match="passes"):
        check_replay(short)


def test_the_check_section_replays_a_trace_file_on_tiny_shapes(traces, tiny, tmp_path):
    path = tmp_path / "traces.jsonl"
    with path.open("w") as out:
        names = ["chain greedy", "eagle3 greedy", "dflash greedy", "mtp t0.8", "ngram-mod greedy"]
        write_traces(out, [traces[name] for name in names])
    assert [t.name for t in parse_traces(path.read_text().splitlines())] == names
    sizes = dataclasses.replace(QUICK, speed_tokens=16, batches=(2,), reps=1)
    report = Report(tmp_path / "out", {"gpu": "none"}, {"quick": True})
    run = Run(report, CPU, sizes, [torch.float32], [], ["invariant"], [TINY])
    model, tokenizer, _, _ = tiny
    with report.section(SECTION):
        replay_section(run, TINY, model, tokenizer, path)
    section = report.data["sections"][SECTION]
    assert section["errors"] == [] and section["skipped"] == []
    rows = section["rows"]
    assert {row["strategy"] for row in rows} == {"draft", "eagle3", "dflash", "mtp", "ngram-mod"}
    for row in rows:
        assert row["replayed tokens/pass"] == row["recorded tokens/pass"]
        assert row["tokens/s"] > 0 and row["predicted x plain (cost model)"] > 0
    assert [row["sequences"] for row in section["batches"]] == [2, 2, 2, 2]  # the greedy groups
    calibration = section["calibration"]
    assert len(calibration) == 1 and all(row["real decode tokens/s"] > 0 for row in calibration)
    assert all(row["steps the target decided as recorded"].split("/")[0] != "0" for row in calibration)
    json.loads((tmp_path / "out" / "gpu_check.json").read_text())


def test_the_section_notes_a_missing_trace_set(tiny, tmp_path):
    report = Report(tmp_path, {"gpu": "none"}, {"quick": True})
    run = Run(report, CPU, QUICK, [torch.float32], [], ["invariant"], [TINY])
    report.data["sections"][SECTION] = {"seconds": 0.0, "errors": [], "skipped": [], "calibration": []}
    model, tokenizer, _, _ = tiny
    with report.section(SECTION):
        replay_section(run, TINY, model, tokenizer, tmp_path / "absent.jsonl")
    assert any("no trace set" in note for note in report.data["notes"])


def test_the_shipped_trace_set_covers_the_real_pairs_and_replays_as_recorded(tiny):
    """The set the GPU check replays: both real pairs, every strategy, the four tasks, greedy and
    0.8, small enough to travel with the check; one trace of each (pair, system) replays through
    a tiny random model with exactly the recorded tokens per pass."""
    assert TRACES.stat().st_size < 1_000_000
    shipped = read_traces(TRACES)
    cells = {
        (t.meta["pair"], t.meta["system"], t.meta["task"], float(t.meta["temperature"])) for t in shipped
    }
    pairs = {pair for pair, _, _, _ in cells}
    assert "bundled" in pairs and any("qwen2.5-coder-1.5b" in pair.lower() for pair in pairs)
    for pair in pairs:
        systems = {system for p, system, _, _ in cells if p == pair}
        assert {"draft", "draft-tree", "ngram-mod", "suffix"} <= systems
        for system in systems:
            tasks = {(task, temp) for p, s, task, temp in cells if (p, s) == (pair, system)}
            assert len({task for task, _ in tasks}) == 4 and {temp for _, temp in tasks} == {0.0, 0.8}
    assert {"eagle3", "eagle3-tree"} <= {system for p, system, _, _ in cells if p == "bundled"}
    first = {}
    for trace in shipped:
        first.setdefault((trace.meta["pair"], trace.meta["system"]), trace)
    for trace in first.values():
        target, drafters = tiny_backends(tiny, n_ctx=replay_context(trace))
        result = replay(trace, target, drafters)
        check_replay(result)
        assert result.stats.tokens_per_pass == trace.tokens_per_pass
