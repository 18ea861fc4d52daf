"""Why drafting was little, nothing, or held short: the verdicts a generation reports
(`specdecode.verdicts`), and each place that shows them: the command line's notes, --json, the
server's /props and /metrics, bench's tables.

Costs are held fixed (conftest's `CpuCosts`): measured on the tiny models here, a draft step
costs what a target step does and the policy would rightly draft nothing in every test.
"""

from __future__ import annotations

import json
from collections.abc import Sequence

import pytest
from conftest import (
    CpuCosts,
    CpuPolicyModels,
    TargetSpec,
    cached_tokenizer,
    draft_model,
    gpu_policy,
    save_model,
    target_model,
)
from fastapi.testclient import TestClient

from specdecode import DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.bench.report import markdown, verdict_notes
from specdecode.chain import Chain
from specdecode.cli import main
from specdecode.drafts import Draft
from specdecode.policy import AdaptivePolicy, PolicyModels
from specdecode.server.app import ServerSettings, create_app
from specdecode.stats import GenerationStats, SpeculationVerdict
from specdecode.verdicts import NOTE_WIDTH, generation_verdicts, merged, note_lines, start_verdicts

GREEDY = SamplingParams(temperature=0)
PROMPT = list(range(3, 30))
CONFIG = GenerationConfig(n_predict=16, ignore_eos=True)
UNPLAIN = ("one-row bits", "near-tie", " R rows", "R = ")  # words the docs explain, not a note

pytestmark = pytest.mark.usefixtures("steady_clock")


def slow_policy() -> PolicyModels:
    """A CPU where each verify row costs a one-row pass (17 rows: 17x) and a draft step 0.6 of
    one: no draft of the model can pay, even kept whole (at best 2 tokens in 2.6 steps' time)."""
    return CpuPolicyModels(costs=CpuCosts(seventeen_rows=0.17, draft_step=0.006))


@pytest.fixture
def slow_costs(monkeypatch) -> None:
    """Every adaptive pipeline the command line or the server makes gets `slow_policy`."""

    def for_target(cls, target, progress=None, drafts=None) -> PolicyModels:
        return slow_policy()

    monkeypatch.setattr(PolicyModels, "for_target", classmethod(for_target))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[str, str]:
    """The test pair as Hugging Face directories: (target, draft)."""
    root, tokenizer = tmp_path_factory.mktemp("pair"), cached_tokenizer()
    target = save_model(root / "target", target_model(TargetSpec(seed=1)), tokenizer)
    draft = save_model(root / "draft", draft_model(TargetSpec(seed=1), 0.02), tokenizer)
    return str(target), str(draft)


def capped(backend: HFBackend, cap: int) -> HFBackend:
    """The backend, with drafts held to `cap` tokens a step as llama.cpp's exactness holds them."""
    backend.draft_room = lambda: cap
    return backend


def note_block(err: str) -> list[str]:
    """The note lines of a command's stderr, each note's wrapped lines joined."""
    notes: list[str] = []
    for line in err.splitlines():
        if line.startswith("note: "):
            notes.append(line.removeprefix("note: "))
        elif line.startswith("      ") and notes:
            notes[-1] += " " + line.strip()
    return notes


def assert_plain_lines(err: str) -> None:
    """Every note and warning line fits NOTE_WIDTH, in plain words."""
    for line in err.splitlines():
        if line.startswith(("note: ", "warning: ", "      ")):
            assert len(line) <= NOTE_WIDTH, line
            assert not any(word in line for word in UNPLAIN), line


# --------------------------------------------------------------------------- the verdicts


def test_a_draft_model_that_cannot_pay_is_said_so_with_the_numbers_behind_it(zoo):
    target, draft = zoo.pair(TargetSpec(seed=1), 0.02)
    pipe = Pipeline(target, draft, spec_types=["draft"], spec_policy="adaptive", policy_models=slow_policy())
    stats = pipe.generate(PROMPT, GREEDY, CONFIG).stats
    assert stats.totals.n_drafted == 0
    (verdict,) = stats.verdicts
    assert verdict.code == "draft_model_too_slow" and verdict.numbers["runs"] == 0
    # best at 1 token: 2 tokens for a draft step (0.6) and a 2-row pass (2 one-row passes)
    assert verdict.numbers["draft_tokens"] == 1
    assert verdict.numbers["speedup"] == pytest.approx(2 / 2.6, rel=0.01)
    assert verdict.numbers["step_cost"] == pytest.approx(0.6, rel=0.01)
    assert verdict.numbers["check_cost"] == pytest.approx(2.0, rel=0.01)
    assert verdict.message == (
        "the draft model was not run: a draft step costs 0.60x a plain step and checking 1 token 2.0x, "
        "so even fully kept drafts would run at 0.77x plain speed"
    )
    assert verdict.remedy == "--spec-policy classic drafts anyway" and verdict.remedy in verdict.text


def test_nothing_is_said_where_drafting_runs_freely(zoo):
    """Rows nearly free, draft steps cheap, a draft close to its target: it drafts every step."""
    target, draft = zoo.pair(TargetSpec(seed=1), 0.02)
    pipe = Pipeline(target, draft, spec_types=["draft"], spec_policy="adaptive", policy_models=gpu_policy())
    stats = pipe.generate(PROMPT, GREEDY, CONFIG).stats
    assert stats.totals.n_drafts >= stats.n_passes // 2 and stats.totals.n_accepted > 0
    assert stats.verdicts == [] and stats.n_capped == 0 and stats.draft_cap is None


def test_a_cap_that_binds_is_said_with_how_often():
    """Drafts held to 2 tokens where the draft model would draft 16 (classic, p_min 0)."""
    tokenizer = cached_tokenizer()
    target = capped(HFBackend(target_model(TargetSpec(seed=1)), tokenizer), 2)
    draft = HFBackend(draft_model(TargetSpec(seed=1), 0.02), tokenizer)
    pipe = Pipeline(target, draft, draft_config=DraftModelConfig(p_min=0.0))
    stats = pipe.generate(PROMPT, GREEDY, CONFIG).stats
    assert stats.draft_cap == 2 and 0 < stats.n_capped <= stats.n_passes
    assert len(stats.totals.drafted_per_pos) == 2  # no draft reached a third token
    (verdict,) = stats.verdicts
    assert verdict.code == "drafts_capped"
    assert verdict.numbers == {"draft_cap": 2, "capped_steps": stats.n_capped, "steps": stats.n_passes}
    held = f"drafts were held to 2 tokens on {stats.n_capped} of {stats.n_passes} steps"
    assert verdict.message == f"{held} so that output stays exact"
    assert "--passes bucketed lifts the cap" in verdict.remedy


def test_a_cap_of_nothing_says_nothing_was_drafted_and_nothing_else():
    tokenizer = cached_tokenizer()
    target = capped(HFBackend(target_model(TargetSpec(seed=1)), tokenizer), 0)
    draft = HFBackend(draft_model(TargetSpec(seed=1), 0.02), tokenizer)
    stats = Pipeline(target, draft).generate(PROMPT, GREEDY, CONFIG).stats
    assert stats.totals.n_drafted == 0 and stats.n_capped == stats.n_passes - 1  # the last: room for none
    (verdict,) = stats.verdicts
    assert verdict.code == "drafts_capped" and verdict.message.startswith("nothing was drafted")
    assert "--passes bucketed drafts anyway" in verdict.remedy


def test_a_cap_the_drafts_never_reach_is_not_said(zoo):
    target, draft = zoo.pair(TargetSpec(seed=1), 0.02)
    capped(target, 64)
    stats = (
        Pipeline(target, draft, draft_config=DraftModelConfig(n_max=4, p_min=0.0))
        .generate(PROMPT, GREEDY, CONFIG)
        .stats
    )
    assert stats.draft_cap == 64 and stats.n_capped == 0 and stats.verdicts == []


class Copier:
    """A model-free strategy with a fixed draft (empty: nothing to copy)."""

    n_min = 0

    def __init__(self, name: str, tokens: Sequence[int]) -> None:
        self.name, self.tokens = name, list(tokens)

    def begin(self, prompt: Sequence[int]) -> None: ...

    def draft(self, history: Sequence[int], last: int, n_max: int) -> Draft:
        return Draft(self.tokens[:n_max])

    def accept(self, n_accepted: int) -> None: ...

    def end(self) -> None: ...


def run_steps(chain: Chain, steps: int) -> GenerationStats:
    """`steps` steps of `chain` whose drafts are never kept, each verified in a plain pass's time."""
    stats, history = GenerationStats(), [1, 2]
    chain.begin(history)
    for _ in range(steps):
        draft = chain.draft(history, 3, 16)
        chain.accept(draft, 0, 0.01 * (len(draft.tokens) + 1))
        history.append(3)
        stats.n_passes += 1
        if draft.tokens:
            stats.totals.record(len(draft.tokens), len(draft.tokens), 0)
    return stats


def test_copying_strategies_that_found_nothing_are_named():
    chain = Chain([Copier("ngram-mod", []), Copier("suffix", [])], AdaptivePolicy(slow_policy()))
    (verdict,) = generation_verdicts(run_steps(chain, 12), chain)
    assert verdict.code == "nothing_to_copy"
    assert verdict.message == "ngram-mod and suffix found no repeated text to copy a draft from"


def test_copies_that_are_rarely_kept_are_said_to_cost_more_than_they_gain():
    """Copies kept one time in two (the prior, nothing learnt yet) where checking one costs two
    plain steps: each offered, none used."""
    chain = Chain([Copier("ngram-mod", [7, 8, 9])], AdaptivePolicy(slow_policy()))
    (verdict,) = generation_verdicts(run_steps(chain, 40), chain)
    assert verdict.code == "copies_rarely_pay" and verdict.numbers["offered"] == 40
    assert verdict.numbers["used"] == 0 and verdict.numbers["first_kept"] == 0.5
    assert verdict.message == (
        "ngram-mod had drafts on 40 of 40 steps, used on 0: about 50% of first tokens are kept, "
        "and checking one costs 2.00x a plain step"
    )


def test_a_classic_draft_model_rarely_sure_enough_is_told_of_p_min(zoo):
    target, draft = zoo.pair(TargetSpec(seed=1), 0.02)
    stats = (
        Pipeline(target, draft, draft_config=DraftModelConfig(p_min=1.0))
        .generate(PROMPT, GREEDY, CONFIG)
        .stats
    )
    (verdict,) = stats.verdicts
    assert verdict.code == "draft_model_unsure" and verdict.numbers["p_min"] == 1.0
    assert "--spec-draft-p-min" in verdict.remedy


def call_overhead_policy() -> PolicyModels:
    """Flat passes (a GPU's) and a drafting model whose every call costs two passes before its
    first step: short drafts lose, long ones kept whole would pay."""
    models = gpu_policy()
    calls = models.costs.draft_calls["draft"]
    for steps in (1, 2, 4, 8) * 8:
        calls.observe(steps, 0.02 + 0.001 * steps, 0)
    return models


def held_verdict(cap: int) -> SpeculationVerdict:
    """The verdict on a drafting model never run, its drafts held to `cap` tokens."""
    chain = Chain([_Model("draft")], AdaptivePolicy(call_overhead_policy()))
    chain.n_max, chain.stats[0].n_call_draft = cap, 0
    (verdict,) = generation_verdicts(GenerationStats(n_passes=1000, draft_cap=cap), chain)
    return verdict


def test_a_draft_model_that_only_long_drafts_would_pay_is_told_the_cap_is_why():
    verdict = held_verdict(2)
    assert verdict.code == "draft_model_too_slow" and verdict.numbers["speedup"] < 1
    assert "drafts of up to 2 tokens, the most kept exact here" in verdict.message
    assert verdict.remedy.startswith("--passes bucketed lifts the cap")


def test_what_was_said_at_start_comes_after_the_latest_unless_restated():
    cap = SpeculationVerdict("drafts_capped", "held", {"draft_cap": 2})
    slow = SpeculationVerdict("draft_model_too_slow", "slow")
    again = SpeculationVerdict("drafts_capped", "held on 3 of 9 steps")
    assert merged([cap], [slow]) == [slow, cap]
    assert merged([cap], [again, slow]) == [again, slow]


# --------------------------------------------------------------------------- where they show


def test_generate_says_why_once_and_json_carries_it(saved, capsys, slow_costs):
    target, draft = saved
    args = ["generate", "-m", target, "-md", draft, "-p", "def f(x):", "-n", "12", "--temp", "0"]
    assert main([*args, "--spec-type", "draft-simple"]) == 0
    err = capsys.readouterr().err
    notes = [note for note in note_block(err) if note.startswith("the draft model")]
    assert len(notes) == 1 and "--spec-policy classic drafts anyway" in notes[0]
    assert_plain_lines(err)
    assert main([*args, "--spec-type", "draft-simple", "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)["stats"]
    (verdict,) = stats["verdicts"]
    assert verdict["code"] == "draft_model_too_slow" and verdict["numbers"]["speedup"] < 1
    assert verdict["text"] == f"{verdict['message']} ({verdict['remedy']})"


def test_a_cap_said_at_start_is_not_said_again_at_the_end(saved, capsys, monkeypatch):
    """llama.cpp's cap is said before generating; its count stays in the statistics."""
    from specdecode.backends.hf import HFBackend as Loaded

    monkeypatch.setattr(Loaded, "draft_room", lambda self: 2, raising=False)
    monkeypatch.setattr(Loaded, "row_cap", 3, raising=False)
    monkeypatch.setattr(
        Loaded,
        "row_cap_note",
        lambda self: "drafts held to 2 tokens for exact output",
        raising=False,
    )
    target, draft = saved
    args = ["generate", "-m", target, "-md", draft, "-p", "def f(x):", "-n", "12", "--temp", "0"]
    assert main([*args, "--spec-policy", "classic", "--spec-draft-p-min", "0", "--backend", "native"]) == 0
    err = capsys.readouterr().err
    capped = [note for note in note_block(err) if "held to 2 tokens" in note]
    assert capped == [
        "drafts held to 2 tokens for exact output (--passes bucketed lifts the cap; see docs/gguf.md)"
    ]
    assert err.index(capped[0][:30]) < err.index("seed ")
    assert_plain_lines(err)


def test_props_and_metrics_carry_the_reason(slow_costs):
    tokenizer = cached_tokenizer()
    target = HFBackend(target_model(TargetSpec(seed=1)), tokenizer)
    draft = HFBackend(draft_model(TargetSpec(seed=1), 0.02), tokenizer)
    pipeline = Pipeline(target, draft, spec_types=["draft"], spec_policy="adaptive")
    settings = ServerSettings(model_id="tiny", max_tokens=64, sampling=GREEDY)
    with TestClient(create_app(pipeline, settings)) as client:
        assert client.get("/props").json()["speculation"]["verdicts"] == []  # nothing known yet
        body = {"prompt": "def f(x):", "n_predict": 12}
        assert client.post("/completion", json=body).status_code == 200
        props = client.get("/props").json()["speculation"]
        metrics = client.get("/metrics").text
    assert props["policy"] == "adaptive" and props["strategies"] == ["draft"]
    (verdict,) = props["verdicts"]
    assert verdict["code"] == "draft_model_too_slow" and verdict["numbers"]["speedup"] < 1
    assert 'specdecode_speculation_verdicts_total{code="draft_model_too_slow"} 1' in metrics
    info = [line for line in metrics.splitlines() if line.startswith("specdecode_speculation_info{")]
    assert info == [
        f'specdecode_speculation_info{{code="draft_model_too_slow",reason="{verdict["text"]}"}} 1'
    ]
    speedup = 'specdecode_speculation_number{code="draft_model_too_slow",name="speedup"} '
    assert float(next(line for line in metrics.splitlines() if line.startswith(speedup)).split()[-1]) < 1


def test_a_cap_known_at_start_is_in_props_before_any_request():
    tokenizer = cached_tokenizer()
    target = HFBackend(target_model(TargetSpec(seed=1)), tokenizer)
    target.row_cap, target.row_cap_note = 3, lambda: "drafts held to 2 tokens for exact output"
    draft = HFBackend(draft_model(TargetSpec(seed=1), 0.02), tokenizer)
    pipeline = Pipeline(target, draft)
    assert [v.code for v in start_verdicts(target, pipeline.spec_types)] == ["drafts_capped"]
    assert start_verdicts(target, []) == []  # plain generation: nothing is drafted anyway
    settings = ServerSettings(model_id="tiny", max_tokens=64, sampling=GREEDY)
    with TestClient(create_app(pipeline, settings)) as client:
        (verdict,) = client.get("/props").json()["speculation"]["verdicts"]
        metrics = client.get("/metrics").text
    assert verdict["code"] == "drafts_capped" and verdict["numbers"] == {"draft_cap": 2}
    assert 'specdecode_speculation_number{code="drafts_capped",name="draft_cap"} 2' in metrics


def test_bench_tables_footnote_the_reasons():
    rows = [
        {"task": "edit", "system": "plain", "verdicts": []},
        {
            "task": "edit",
            "system": "draft@adaptive",
            "verdicts": [{"code": "c", "text": "the draft model was not run"}],
        },
    ]
    assert verdict_notes(rows) == ["draft@adaptive: the draft model was not run"]
    table = markdown([_row(row) for row in rows], "## results")
    assert "- draft@adaptive: the draft model was not run" in table


def _row(row: dict) -> dict:
    """A bench row with the figures the table needs."""
    figures = {
        "tokens_per_second": 10.0,
        "tokens_per_second_min": 9.0,
        "tokens_per_second_max": 11.0,
        "tokens_per_cpu_second": 10.0,
        "speedup_vs_plain": 1.0,
        "speedup_vs_hf_plain": None,
        "exact_match_rate": 1.0,
    }
    return {**figures, **row}


# --------------------------------------------------------------------------- the notes' words


def test_every_note_fits_a_line_in_plain_words():
    """The texts the code produces, at their longest numbers: each line of a printed note
    within NOTE_WIDTH, at most two lines, and none of the words only the docs explain."""
    from specdecode.backends.llama_probe import RowProbe

    class Probe(RowProbe):
        exact, name = True, "qwen2.5-coder-1.5b-instruct"

        def __init__(self, cap: int) -> None:
            self._cap = cap

        def _probed_rows(self) -> int:
            return self._cap

    texts = [Probe(cap).row_cap_note() for cap in (1, 2, 3, 9)]
    texts += [verdict.text for cap in (1, 3, 17) for verdict in start_verdicts(_Capped(cap), ["draft"])]
    for verdict in _longest_verdicts():
        texts.append(verdict.text)
    for text in texts:
        assert text is not None
        lines = note_lines(text)
        assert len(lines) <= 2 and all(len(line) <= NOTE_WIDTH for line in lines), lines
        assert not any(word in text for word in UNPLAIN), text


def test_the_start_up_notes_on_llama_cpp_fit_too(gguf_files, capsys):
    """A GGUF pair, exact (a cap where the probe found one) and bucketed (a warning where rows
    vary), and the directories on auto (which backend, the copy, or why PyTorch)."""
    pytest.importorskip("llama_cpp")
    from specdecode.backends.hf_gguf import ROWS_DIFFER

    pairs = [
        [str(gguf_files["target.gguf"]), "-md", str(gguf_files["draft.gguf"])],
        [str(gguf_files["target"]), "-md", str(gguf_files["draft"])],
    ]
    for pair, passes in ((pairs[0], "auto"), (pairs[0], "bucketed"), (pairs[1], "auto")):
        args = ["generate", "-m", *pair, "-p", "def f(x):", "-n", "8", "--temp", "0", "-t", "1"]
        assert main([*args, *(["--passes", passes] if passes != "auto" else [])]) == 0
        err = capsys.readouterr().err
        assert_plain_lines(err)
    lines = note_lines(f"target-6f9e3eb0e7b979631d38fc14: runs on PyTorch, not llama.cpp: {ROWS_DIFFER}")
    assert len(lines) == 2 and all(len(line) <= NOTE_WIDTH for line in lines)


class _Capped:
    """A target whose drafts are held to cap - 1 tokens."""

    def __init__(self, cap: int) -> None:
        self.row_cap = cap

    def row_cap_note(self) -> str:
        return "drafts held to 2 tokens for exact output"


def _longest_verdicts() -> list[SpeculationVerdict]:
    """Each verdict the module makes, with wide numbers: 1000-step generations."""
    stats = GenerationStats(n_passes=1000, draft_cap=15, n_capped=999)
    slow = Chain(
        [_Model("draft"), Copier("ngram-map-k4v", []), Copier("ngram-mod", [])], AdaptivePolicy(slow_policy())
    )
    slow.stats[0].n_call_draft, slow.stats[0].n_gen_drafts = 99, 1
    for counts in slow.stats[1:]:
        counts.n_call_draft = 1000
    slow.n_max = 16
    verdicts = generation_verdicts(stats, slow)
    rarely = Chain([_Model("draft")], AdaptivePolicy(gpu_policy()))
    rarely.policy.models.records["draft"] = type("R", (), {"tokens": 1.33, "rows": 2.0, "steps": 1.0})()
    rarely.stats[0].n_call_draft, rarely.n_max = 99, 16
    verdicts += generation_verdicts(GenerationStats(n_passes=1000), rarely)
    copies = Chain([Copier("ngram-map-k4v", [5])], AdaptivePolicy(slow_policy()))
    copies.stats[0].n_call_draft = copies.stats[0].n_offered = 999
    copies.n_max = 16
    verdicts += generation_verdicts(GenerationStats(n_passes=1000), copies)
    classic = Chain([_Model("draft")])
    classic.stats[0].n_call_draft, classic.n_max = 1000, 16
    verdicts += generation_verdicts(GenerationStats(n_passes=1000), classic)
    verdicts += generation_verdicts(GenerationStats(n_passes=1000, draft_cap=0, n_capped=1000), classic)
    verdicts += [held_verdict(2), held_verdict(15)]  # cut by the cap; long enough to pay
    codes = {verdict.code for verdict in verdicts}
    assert codes == {
        "drafts_capped",
        "draft_model_too_slow",
        "draft_model_not_chosen",
        "draft_model_rarely_pays",
        "draft_model_unsure",
        "nothing_to_copy",
        "copies_rarely_pay",
    }
    return verdicts


class _Model(Copier):
    """A drafting model the policy steers (it never runs here)."""

    keep_drafting = None
    config = DraftModelConfig(p_min=0.75)

    def __init__(self, name: str) -> None:
        super().__init__(name, [])
