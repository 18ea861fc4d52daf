"""Acceptance traces (`specdecode.bench.traces`): a recorded generation is what it ran, the file
round-trips, and `specdecode bench --record-traces` writes one trace per measured run of ours."""

from __future__ import annotations

import gzip
import io
import json

import pytest

from specdecode.api import Pipeline
from specdecode.backends.hf import HFBackend
from specdecode.bench.traces import (
    Trace,
    TraceStep,
    mapped_ids,
    parse_traces,
    read_traces,
    record_steps,
    write_traces,
)
from specdecode.cli import main
from specdecode.config import NgramModConfig
from specdecode.defaults import bundled_pair
from specdecode.errors import SpecdecodeError
from specdecode.generate import GenerationConfig
from specdecode.sampling import SamplingParams
from specdecode.strategies import DraftModelConfig, NgramSettings
from specdecode.testing import make_llama, make_tokenizer, perturbed_copy, save_model

PROMPT = "def read_lines(path):\n    with open(path) as handle:\n        return"


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("trace-models")
    tokenizer = make_tokenizer(320)
    target = make_llama(len(tokenizer), init_std=0.5, seed=3, max_positions=1024)
    draft = perturbed_copy(target, 0.02)
    return save_model(root / "target", target, tokenizer), save_model(root / "draft", draft, tokenizer)


@pytest.fixture(scope="module")
def backends(pair):
    return HFBackend.load(pair[0]), HFBackend.load(pair[1])


def recorded(pipeline: Pipeline, sampling: SamplingParams, n: int = 40) -> tuple[Trace, object]:
    """A generation run with its steps recorded, as a Trace, and the generation."""
    ids = pipeline.encode(PROMPT)
    generation = pipeline.stream(ids, sampling, GenerationConfig(n_predict=n, ignore_eos=True))
    steps = record_steps(generation)
    for _ in generation:
        pass
    vocab = pipeline.target.vocab
    trace = Trace(
        "test", ids, vocab.size, sorted(vocab.eog_ids), steps, {"spec": ",".join(pipeline.spec_types)}
    )
    return trace, generation


CHAIN = DraftModelConfig(n_max=6, p_min=0.0)
TREE = DraftModelConfig(n_max=6, p_min=0.0, n_parallel=4, p_split=0.02)
GREEDY = SamplingParams(temperature=0)


@pytest.mark.parametrize(
    ("name", "spec_types", "config", "sampling"),
    [
        ("plain", [], CHAIN, GREEDY),
        ("chain", ["draft"], CHAIN, GREEDY),
        ("chain-t0.8", ["draft"], CHAIN, SamplingParams(temperature=0.8, seed=3)),
        ("tree", ["draft"], TREE, GREEDY),
        ("tree-t0.8", ["draft"], TREE, SamplingParams(temperature=0.8, seed=3)),
    ],
)
def test_a_recorded_trace_is_the_generation_it_recorded(backends, name, spec_types, config, sampling):
    target, draft = backends
    pipeline = Pipeline(target, draft if spec_types else None, spec_types=spec_types, draft_config=config)
    trace, generation = recorded(pipeline, sampling)
    assert trace.tokens == generation.tokens and len(trace.tokens) == 40
    assert trace.tokens_per_pass == pytest.approx(generation.stats.tokens_per_pass)
    assert trace.n_passes == generation.stats.n_passes
    assert not trace.steps[0].drafted and len(trace.steps[0].emitted) == 1  # the prompt's pass
    drafted = [step for step in trace.steps if step.drafted]
    if not spec_types:
        assert not drafted
        return
    assert drafted and all(step.strategy == "draft" for step in drafted)
    assert sum(step.accepted for step in drafted) == generation.stats.totals.n_accepted
    assert sum(len(step.draft) for step in drafted) == generation.stats.totals.n_drafted
    for step in drafted:
        assert len(step.emitted) <= step.accepted + 1
        if step.parents is None:  # a chain: the kept tokens are the draft's first ones
            assert step.emitted[: step.accepted] == step.draft[: step.accepted]
        else:  # a tree: the kept path, root first, each node the child of the one before
            assert len(step.path) == step.accepted
            assert [step.draft[node] for node in step.path] == step.emitted[: step.accepted]
            assert all(step.parents[b] == a for a, b in zip([-1, *step.path], step.path, strict=False))
    if name.startswith("tree"):
        assert any(step.parents is not None for step in drafted)
        assert any(step.to_draft().parents is not None for step in drafted)
    else:
        assert all(step.parents is None for step in drafted)


def test_a_trace_file_round_trips(backends, tmp_path):
    target, draft = backends
    chain = recorded(Pipeline(target, draft, spec_types=["draft"]), SamplingParams(temperature=0))[0]
    config = DraftModelConfig(p_min=0.0, n_parallel=4, p_split=0.02)
    tree = recorded(Pipeline(target, draft, spec_types=["draft"], draft_config=config), SamplingParams())[0]
    tree.name, tree.meta = "tree", {"tree": True, "temperature": 0.0}
    path = tmp_path / "traces.jsonl"
    with path.open("w") as out:
        write_traces(out, [chain, tree])
    assert read_traces(path) == [chain, tree]
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert lines[0]["trace"] == "test" and lines[0]["prompt"] == chain.prompt
    assert len(lines) == 2 + len(chain.steps) + len(tree.steps)
    packed = tmp_path / "traces.jsonl.gz"  # how the shipped set is stored
    packed.write_bytes(gzip.compress(path.read_bytes()))
    assert read_traces(packed) == [chain, tree]


def test_a_malformed_file_is_refused_with_its_line_number(tmp_path):
    good = io.StringIO()
    steps = [TraceStep([3]), TraceStep([4, 5], "draft", [4, 6], None, 1)]
    write_traces(good, [Trace("t", [1, 2], 16, [0], steps)])
    lines = good.getvalue().splitlines()
    assert [t.tokens for t in parse_traces(lines)] == [[3, 4, 5]]
    cases = [
        ([*lines[:2], "{oops", *lines[2:]], 3),  # not JSON
        ([*lines, '{"s": "draft", "d": [1]}'], 4),  # a step without its emitted tokens
        ([lines[1], *lines], 1),  # a step before any header
        ([lines[0].replace('"prompt"', '"promptless"'), *lines[1:]], 1),  # a header without its prompt
        ([*lines, "", '{"e": "x"}'], 5),  # not ids (blank lines still count)
        ([*lines, '{"s": "draft", "d": [1], "a": 2, "e": [1, 2, 3]}'], 4),  # kept more than drafted
        ([*lines, '{"s": "draft", "d": [1, 2], "p": [-1, 0], "k": [0, 5], "a": 2, "e": [1, 2, 3]}'], 4),
        (["[1, 2]", *lines], 1),  # not an object
    ]
    path = tmp_path / "bad.jsonl"
    for text, number in cases:
        path.write_text("\n".join(text) + "\n")
        with pytest.raises(SpecdecodeError, match=rf"bad\.jsonl:{number}: not a trace line"):
            read_traces(path)


def test_mapped_ids_keep_equal_ids_equal_and_map_the_end_of_generation():
    trace = Trace("t", [], 151936, eog=[151643, 151645])
    ids = [5, 151643, 70000, 5, 151645, 150000]
    mapped = mapped_ids(ids, trace, 1000, 7)
    assert mapped[1] == mapped[4] == 7 and mapped[0] == mapped[3]
    assert all(0 <= i < 1000 for i in mapped) and 7 not in (mapped[0], mapped[2], mapped[5])


def test_bench_records_a_trace_of_every_measured_run_of_ours(pair, tmp_path):
    target, draft = pair
    traces = tmp_path / "traces.jsonl"
    argv = ["bench", "-m", str(target), "-md", str(draft), "--systems", "plain,draft,draft-tree,ngram-mod"]
    argv += ["--tasks", "completion,agent-edit", "--prompts-per-task", "1", "-n", "10", "--runs", "2"]
    argv += ["--warmup", "0", "--sweep", "0", "--no-plots", "--out", str(tmp_path / "out")]
    argv += ["--temp", "0.8", "--seed", "5", "--record-traces", str(traces), "--spec-draft-p-min", "0"]
    assert main(argv) == 0
    recorded_traces = read_traces(traces)
    systems = ["plain", "draft", "draft-tree", "ngram-mod"]
    expected = [f"target+draft/{s}/completion/0/t0.8" for s in systems]
    expected += [f"target+draft/{s}/agent-edit/0/t0.8/turn{turn}" for s in systems for turn in range(3)]
    assert sorted(t.name for t in recorded_traces) == sorted(expected)  # the first of two runs each
    runs = [json.loads(line) for line in (tmp_path / "out" / "runs.jsonl").read_text().splitlines()]
    by_run = {(r["system"], r["task"], r["turn"]): r for r in runs}
    for trace in recorded_traces:
        meta = trace.meta
        run = by_run[meta["system"], meta["task"], meta["turn"]]
        assert trace.tokens == run["tokens"] and len(trace.tokens) == meta["n_predict"] == 10
        assert trace.tokens_per_pass == pytest.approx(run["stats"]["tokens_per_pass"])
        assert meta["pair"] == "target+draft" and meta["verify"] == "match"
        assert meta["temperature"] == 0.8 and meta["seed"] == 5 and meta["prompt_index"] == 0
        assert meta["spec"] == {"plain": "none", "draft-tree": "draft"}.get(meta["system"], meta["system"])
        assert meta["tree"] == (meta["system"] == "draft-tree")
        assert trace.vocab == 320 and trace.eog and str(tmp_path) not in json.dumps(trace.header())
        if meta["system"] in ("draft", "draft-tree"):
            assert meta["draft_n_max"] == 16 and meta["draft_p_min"] == 0.0 and meta["policy"] == "classic"
    turns = [t for t in recorded_traces if t.meta["system"] == "plain" and t.meta["task"] == "agent-edit"]
    assert len(turns[2].prompt) > len(turns[1].prompt) > len(turns[0].prompt)  # the conversation so far
    assert main(argv) == 0  # appended to
    assert len(read_traces(traces)) == 2 * len(expected)


def test_bench_refuses_a_trace_file_in_a_missing_directory(pair, tmp_path, capsys):
    argv = ["bench", "-m", str(pair[0]), "--systems", "plain", "-p", "x", "-n", "4", "--no-plots"]
    argv += ["--out", str(tmp_path / "out"), "--record-traces", str(tmp_path / "nowhere" / "t.jsonl")]
    assert main(argv) == 2
    assert "nowhere does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_bench_records_the_bundled_pair_and_its_head(tmp_path):
    """The bundled pair with its EAGLE-3 head, greedy, a tiny budget: named "bundled", never a path."""
    try:
        bundled_pair()
    except SpecdecodeError:
        pytest.skip("this installation carries no bundled pair")
    traces = tmp_path / "traces.jsonl"
    argv = ["bench", "--systems", "draft,eagle3,eagle3-tree", "--tasks", "completion", "-n", "8"]
    argv += ["--prompts-per-task", "1", "--runs", "1", "--warmup", "0", "--sweep", "0", "--no-plots"]
    argv += ["-t", "1", "--out", str(tmp_path / "out"), "--record-traces", str(traces)]
    assert main(argv) == 0
    recorded_traces = read_traces(traces)
    names = ["plain", "draft", "eagle3", "eagle3-tree"]
    assert [t.name for t in recorded_traces] == [f"bundled/{s}/completion/0/t0" for s in names]
    plain, chain, head, tree = recorded_traces
    assert plain.tokens == chain.tokens == head.tokens == tree.tokens and len(plain.tokens) == 8
    kinds = [(t.meta["spec"], t.meta["tree"]) for t in recorded_traces]
    assert kinds == [("none", False), ("draft", False), ("eagle3", False), ("eagle3", True)]
    assert tree.meta["draft_tree_tokens"] == 8 and head.meta["draft_n_max"] == 16
    assert head.meta["seed"] is None and head.meta["temperature"] == 0.0
    assert {step.strategy for step in head.steps if step.drafted} <= {"eagle3"}
    assert all(step.parents is None for step in chain.steps + head.steps)
    assert "/" not in plain.meta["pair"] and str(tmp_path) not in traces.read_text()


def test_n_gram_strategies_are_recorded_with_their_own_names(backends):
    target, _ = backends
    ngram = NgramSettings(mod=NgramModConfig(n_match=4, n_min=1, n_max=16))
    pipeline = Pipeline(target, spec_types=["ngram-mod"], ngram=ngram)
    ids = pipeline.encode(PROMPT * 3)
    generation = pipeline.stream(
        ids, SamplingParams(temperature=0), GenerationConfig(n_predict=40, ignore_eos=True)
    )
    steps = record_steps(generation)
    for _ in generation:
        pass
    assert {step.strategy for step in steps if step.drafted} <= {"ngram-mod"}
    assert [token for step in steps for token in step.emitted] == generation.tokens
