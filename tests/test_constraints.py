"""Constrained generation: speculative == plain under a grammar, and every output matches it.

Tiny float64 models; grammars that force long stretches (JSON schemas: keys, quotes, braces)
and grammars that forbid most of what the drafts propose (regexes over a few characters), so
drafts are both taken whole and cut. Every case is compared token for token with constrained
plain generation of the same target and recorded in the exactness log.
"""

from __future__ import annotations

import json
import math
import re
import time

import jsonschema
import pytest
import torch
from conftest import (
    INDEPENDENT,
    TargetSpec,
    cached_tokenizer,
    draft_model,
    eagle3_head,
    eagle3_target,
    target_model,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from specdecode import ConstraintSpec, DraftModelConfig, GenerationConfig, HFBackend, Pipeline, SamplingParams
from specdecode.constraints import Constraint
from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError
from specdecode.strategies import NgramMapConfig, NgramModConfig, NgramSettings

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 10},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}
CALL = {
    "type": "object",
    "properties": {
        "function": {"enum": ["get_weather", "search", "open_file"]},
        "arguments": {
            "type": "object",
            "properties": {"query": {"type": "string", "maxLength": 12}, "limit": {"type": "integer"}},
            "required": ["query", "limit"],
            "additionalProperties": False,
        },
    },
    "required": ["function", "arguments"],
    "additionalProperties": False,
}
# (kind, text, checks a finished output): forcing grammars and forbidding ones.
CONSTRAINTS = {
    "person": ConstraintSpec("json_schema", json.dumps(PERSON)),
    "call": ConstraintSpec("json_schema", json.dumps(CALL)),
    "regex-words": ConstraintSpec("regex", r"[a-e ]{1,30}\."),
    "regex-digits": ConstraintSpec("regex", r"(x = [0-9]{1,3}\n){2,4}"),
    "gbnf-list": ConstraintSpec(
        "grammar", 'root ::= "[" item ("," item)* "]"\nitem ::= "def" | "self" | [a-z] [a-z]?\n'
    ),
}
FULL_MATCH = {
    "regex-words": r"[a-e ]{1,30}\.",
    "regex-digits": r"(x = [0-9]{1,3}\n){2,4}",
    "gbnf-list": r"\[(def|self|[a-z][a-z]?)(,(def|self|[a-z][a-z]?))*\]",
}
GREEDY = SamplingParams(temperature=0)


def alternatives(n: int) -> str:
    """A GBNF grammar whose root rule has n alternatives."""
    return "root ::= " + " | ".join(f'"w{i}"' for i in range(n)) + "\n"


SETTINGS = {"deadline": None, "suppress_health_check": [HealthCheck.too_slow], "max_examples": 25}


def backend(model) -> HFBackend:
    return HFBackend(model, cached_tokenizer())


def check_output(name: str, text: str, stop_reason: str) -> None:
    """A finished output matches its constraint (a cut one, by n_predict, need not)."""
    if stop_reason not in ("grammar", "eos"):
        return
    spec = CONSTRAINTS[name]
    if spec.kind == "json_schema":
        jsonschema.validate(json.loads(text), json.loads(spec.text))
    else:
        assert re.fullmatch(FULL_MATCH[name], text), text


def run_pair(spec_types, sampling, name, prompt, *, verify="match", draft_config=None, kind=0.02):
    target_spec = TargetSpec()
    config = GenerationConfig(n_predict=48, verify=verify)
    constraint = CONSTRAINTS[name]
    plain = Pipeline(backend(target_model(target_spec))).generate(prompt, sampling, config, constraint)
    pipe = Pipeline(
        backend(target_model(target_spec)),
        backend(draft_model(target_spec, kind)),
        spec_types=spec_types,
        draft_config=draft_config or DraftModelConfig(),
        ngram=SHORT_NGRAMS,
    )
    spec = pipe.generate(prompt, sampling, config, constraint)
    return spec, plain


def check_same(spec, plain) -> None:
    assert spec.tokens == plain.tokens
    assert spec.text == plain.text
    assert spec.stats.stop_reason == plain.stats.stop_reason


STRATEGIES = (
    ["draft"],
    ["ngram-simple", "ngram-mod"],
    ["ngram-map-k", "ngram-map-k4v", "ngram-cache"],
    ["forced"],
    ["ngram-mod", "draft"],
)
# Keyed on one or two tokens, so that n-gram drafts come often (and are often cut).
SHORT_NGRAMS = NgramSettings(
    simple=NgramMapConfig(size_n=2, size_m=12),
    map_k=NgramMapConfig(size_n=1, size_m=8),
    map_k4v=NgramMapConfig(size_n=1, size_m=8),
    mod=NgramModConfig(n_match=1, n_min=1, n_max=24),
)


@settings(**{**SETTINGS, "max_examples": 60})
@given(
    name=st.sampled_from(sorted(CONSTRAINTS)),
    types=st.sampled_from(STRATEGIES),
    temperature=st.sampled_from([0.0, 0.0, 0.8, 1.5]),
    seed=st.integers(0, 2**32 - 1),
    kind=st.sampled_from([0.0, 0.02, 0.5, INDEPENDENT]),
    n_max=st.integers(1, 12),
    p_min=st.sampled_from([0.0, 0.75]),
    prompt=st.sampled_from(["def f(x):", "import os\n", "Answer in JSON: "]),
)
def test_constrained_speculative_equals_plain(
    exactness_log, name, types, temperature, seed, kind, n_max, p_min, prompt
) -> None:
    """Greedy and seeded `match`: every strategy, forcing and forbidding grammars."""
    sampling = SamplingParams(temperature=temperature, seed=seed)
    draft_config = DraftModelConfig(n_max=n_max, p_min=p_min)
    spec, plain = run_pair(types, sampling, name, prompt, draft_config=draft_config, kind=kind)
    check_same(spec, plain)
    check_output(name, plain.text, plain.stats.stop_reason)
    mode = "greedy" if temperature == 0 else "match"
    exactness_log.record(
        f"constrained/{mode}", f"{','.join(types)} {kind}", spec.stats, spec.stats.stop_reason
    )


@settings(**SETTINGS)
@given(
    name=st.sampled_from(sorted(CONSTRAINTS)),
    temperature=st.sampled_from([0.0, 0.8]),
    seed=st.integers(0, 2**32 - 1),
    n_parallel=st.integers(2, 4),
    p_split=st.sampled_from([0.0, 0.1]),
)
def test_constrained_trees_equal_plain(exactness_log, name, temperature, seed, n_parallel, p_split) -> None:
    """Draft-model trees: every node's row masked with the state after its path."""
    sampling = SamplingParams(temperature=temperature, seed=seed)
    draft_config = DraftModelConfig(n_max=10, p_min=0.0, n_parallel=n_parallel, p_split=p_split)
    spec, plain = run_pair(["draft"], sampling, name, "def f(x):", draft_config=draft_config, kind=0.5)
    check_same(spec, plain)
    exactness_log.record("constrained/tree", f"draft 0.5 x{n_parallel}", spec.stats, spec.stats.stop_reason)


@pytest.mark.parametrize("tree_tokens", [0, 8])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
@pytest.mark.parametrize("name", ["person", "regex-digits"])
def test_constrained_eagle3_equals_plain(exactness_log, name, temperature, tree_tokens) -> None:
    """EAGLE-3 chains (masked as drafted) and dynamic trees (pruned, masked per node)."""
    head = eagle3_head()
    sampling = SamplingParams(temperature=temperature, seed=5)
    config = GenerationConfig(n_predict=40)
    constraint = CONSTRAINTS[name]
    plain = Pipeline(backend(eagle3_target())).generate("def f(x):", sampling, config, constraint)
    draft_config = DraftModelConfig(p_min=0.0, n_max=6, tree_tokens=tree_tokens)
    pipe = Pipeline(backend(eagle3_target()), eagle3=head, draft_config=draft_config)
    spec = pipe.generate("def f(x):", sampling, config, constraint)
    check_same(spec, plain)
    assert spec.stats.totals.n_drafted > 0
    shape = "tree" if tree_tokens else "chain"
    exactness_log.record("constrained/eagle3", f"head {shape} {name}", spec.stats, spec.stats.stop_reason)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
@pytest.mark.parametrize("name", ["person", "regex-words", "gbnf-list"])
def test_constrained_adaptive_policy_equals_plain(exactness_log, name, temperature) -> None:
    """The adaptive policy chooses among the pruned drafts; the output stays plain's."""
    target_spec = TargetSpec()
    sampling = SamplingParams(temperature=temperature, seed=11)
    config = GenerationConfig(n_predict=48)
    constraint = CONSTRAINTS[name]
    plain = Pipeline(backend(target_model(target_spec))).generate("def f(x):", sampling, config, constraint)
    pipe = Pipeline(
        backend(target_model(target_spec)),
        backend(draft_model(target_spec, 0.1)),
        spec_types=["ngram-simple", "draft"],
        spec_policy="adaptive",
    )
    spec = pipe.generate("def f(x):", sampling, config, constraint)
    check_same(spec, plain)
    exactness_log.record(
        "constrained/adaptive", f"ngram-simple,draft {name}", spec.stats, spec.stats.stop_reason
    )


def test_rejection_verification_keeps_outputs_valid() -> None:
    """Rejection sampling under a grammar: the draft samples from its masked distribution, so
    every emitted token is allowed and finished outputs validate."""
    for seed in range(6):
        sampling = SamplingParams(temperature=1.0, seed=seed)
        for result in run_pair(["draft"], sampling, "call", "{", verify="rejection"):
            check_output("call", result.text, result.stats.stop_reason)
            assert result.stats.stop_reason in ("grammar", "n_predict")


def test_forced_tokens_cost_one_pass() -> None:
    """A schema whose output is fixed but for one choice: forced drafting emits each forced
    stretch in one pass, every drafted token accepted."""
    schema = {
        "type": "object",
        "properties": {"k": {"enum": ["yes", "no"]}},
        "required": ["k"],
        "additionalProperties": False,
    }
    constraint = ConstraintSpec("json_schema", json.dumps(schema))
    config = GenerationConfig(n_predict=32)
    plain = Pipeline(backend(target_model(TargetSpec()))).generate("x", GREEDY, config, constraint)
    pipe = Pipeline(backend(target_model(TargetSpec())), spec_types=["forced"])
    spec = pipe.generate("x", GREEDY, config, constraint)
    check_same(spec, plain)
    assert json.loads(spec.text)["k"] in ("yes", "no")
    assert spec.stats.totals.n_accepted == spec.stats.totals.n_drafted > 0
    assert spec.stats.n_passes < plain.stats.n_passes
    assert spec.stats.stop_reason == "grammar"


def constraint_for(spec: ConstraintSpec) -> Constraint:
    return Constraint.for_backend(spec, backend(target_model(TargetSpec())))


def test_mask_rows_walk_a_tree_and_roll_back() -> None:
    """Each row's mask is the state after its node's path; the committed state is unchanged."""
    tok = cached_tokenizer()
    constraint = constraint_for(ConstraintSpec("regex", "(ab|ac|b)c"))
    ids = {text: tok.convert_tokens_to_ids(text) for text in ("a", "b", "c")}
    a, b, c = ids["a"], ids["b"], ids["c"]
    draft = Draft([a, b, b, c, c], parents=[-1, 0, -1, 0, 1])  # a->b, b, a->c, a->b->c
    logits = torch.zeros(len(draft.tokens) + 1, 320, dtype=torch.float64)
    rows = constraint.mask_rows(draft, logits)
    allowed = [set(torch.nonzero(torch.isfinite(row)).flatten().tolist()) for row in rows]
    assert {a, b} <= allowed[0] and c not in allowed[0]
    assert {b, c} <= allowed[1] and a not in allowed[1]  # after "a"
    assert c in allowed[2] and b not in allowed[2]  # after "ab"
    assert c in allowed[3]  # after "b"
    assert constraint.prune(draft).tokens == [a, b, b, c, c]
    assert constraint.prune(Draft([a, a, c])).tokens == [a]
    pruned = constraint.prune(Draft([b, a, c, b], parents=[-1, -1, 1, 0]))
    assert pruned.tokens == [b, a, c] and pruned.parents == [-1, -1, 1]
    assert len(constraint.allowed()) == 320 and bool(constraint.allowed()[a])  # back at the start


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("regex", "[a-", "invalid regex"),
        ("grammar", "root ::= foo", "invalid grammar"),
        ("grammar", "root ::= [a-", "invalid grammar"),
        ("grammar", "this is not a grammar", "invalid grammar"),
        ("json_schema", "{not json", "invalid json schema"),
        ("json_schema", "[1, 2]", "must be a JSON object"),
        ("json_schema", json.dumps({"type": "nonsense"}), "invalid json schema"),
        ("grammar", alternatives(2001), "rule 'root' has 2001 alternatives"),
        ("grammar", 'root ::= "q" (' + alternatives(2001)[9:-1] + ")", "has 2001 alternatives"),
        ("grammar", 'root ::= root "a"', "invalid grammar: no text matches it"),
        ("grammar", '%llguidance {}\nstart: start "a"', "invalid grammar: no text matches it"),
        ("regex", r"[^\x00-\x{10FFFF}]", "invalid regex: no text matches it"),
        ("grammar", 'root ::= "x" root', "invalid grammar: no text matches it"),
        ("grammar", 'root ::= "a" x | "b"\nx ::= x "c"', "invalid grammar: no text matches rule 'x'"),
        ("grammar", 'root ::= "a" fooBar*\nfooBar ::= "b" fooBar', "no text matches rule 'fooBar'"),
    ],
)
def test_bad_constraints_are_refused(kind, text, message) -> None:
    with pytest.raises(SpecdecodeError, match=message):
        constraint_for(ConstraintSpec(kind, text))


def test_most_alternatives_a_rule_may_have_generate() -> None:
    """2,000 alternatives in one rule: accepted, and the engine's rows hold them at every token."""
    spec = ConstraintSpec("grammar", alternatives(2000))
    pipe = Pipeline(backend(target_model(TargetSpec())))
    out = pipe.generate("x", GREEDY, GenerationConfig(n_predict=8), spec)
    assert re.fullmatch(r"w[0-9]+", out.text) and out.stats.stop_reason in ("grammar", "eos")


@pytest.mark.parametrize(("kind", "text"), [("grammar", 'root ::= ""'), ("regex", ""), ("regex", "a?")])
def test_grammars_matching_the_empty_text_give_it(kind, text) -> None:
    """A grammar whose only or first match is the empty text is not refused: it ends at once."""
    pipe = Pipeline(backend(target_model(TargetSpec())))
    out = pipe.generate("x", GREEDY, GenerationConfig(n_predict=8), ConstraintSpec(kind, text))
    assert out.text in ("", "a") and out.stats.stop_reason in ("grammar", "eos")


def test_a_stop_string_ending_a_finished_answer_is_the_stop_reason() -> None:
    """The token that completes the grammar also completes a stop string: the stop string cut
    the text, so it is the reason given."""
    pipe = Pipeline(backend(target_model(TargetSpec())))
    spec = ConstraintSpec("regex", "abc")
    whole = pipe.generate("x", GREEDY, GenerationConfig(n_predict=8), spec)
    assert whole.text == "abc" and whole.stats.stop_reason in ("grammar", "eos")
    cut = pipe.generate("x", GREEDY, GenerationConfig(n_predict=8, stop=("c",)), spec)
    assert cut.text == "ab" and cut.stats.stop_reason == "stop string"


@pytest.mark.parametrize(
    "text", ['root ::= "(" root ")" | "x"', 'root ::= x\nx ::= "a" x?', 'root ::= x*\nx ::= "b" x | "c"']
)
def test_recursive_grammars_with_a_way_out_are_kept(text) -> None:
    constraint_for(ConstraintSpec("grammar", text))


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(SpecdecodeError, match="unknown constraint kind"):
        ConstraintSpec("xml", "<a/>")


def test_cli_constrained_generation(tmp_path, saved_model_dir, capsys) -> None:
    """--json-schema and --grammar inline or from files (-jf, --grammar-file), and --regex,
    through the command line; bad ones exit 2 before any model loads."""
    from specdecode.cli import main

    schema = tmp_path / "schema.json"
    schema.write_text(json.dumps(CALL))
    grammar = tmp_path / "list.gbnf"
    grammar.write_text(CONSTRAINTS["gbnf-list"].text)
    base = ["generate", "-m", str(saved_model_dir), "-p", "x", "-n", "60", "--temp", "0", "--json"]
    for flags, name in (
        (["-jf", str(schema)], "call"),
        (["--json-schema", json.dumps(CALL)], "call"),
        (["--grammar-file", str(grammar)], "gbnf-list"),
        (["--grammar", CONSTRAINTS["gbnf-list"].text], "gbnf-list"),
        (["--regex", FULL_MATCH["regex-words"]], "regex-words"),
    ):
        assert main([*base, *flags, "--spec-type", "forced"]) == 0
        out = json.loads(capsys.readouterr().out)
        check_output(name, out["text"], out["stats"]["stop_reason"])
    bad = tmp_path / "bad.gbnf"
    bad.write_text("root ::= foo\n")
    for flags, message in (
        (["--grammar-file", str(bad)], "foo"),
        (["--grammar", "root ::= foo"], "foo"),
        (["--regex", "[a-"], "invalid regex"),
        (["-jf", str(tmp_path / "none.json")], "cannot read the JSON schema file"),
        (["-j", "{not json"], "invalid json schema"),
        # a file given to the inline flags, as llama.cpp's --grammar and --json-schema once took
        (["--grammar", str(grammar)], f"--grammar-file {grammar}"),
        (["--json-schema", str(schema)], f"--json-schema-file {schema}"),
    ):
        assert main([*base, *flags]) == 2
        *phases, error = capsys.readouterr().err.splitlines()
        assert error.startswith("error: ") and message in error, error
        assert all(line.startswith("specdecode: ") for line in phases)  # a regex is checked in full later
    assert main([*base, "--spec-type", "forced"]) == 2
    assert "drafts what a grammar forces" in capsys.readouterr().err


def test_bench_constrained_cases() -> None:
    """The benchmark's tasks: held-out functions, the schema in the prompt, and a grammar the
    engine compiles for each."""
    from specdecode.bench.constrained import build_cases

    cases = build_cases(2)
    assert [case.task for case in cases] == ["json-extraction"] * 2 + ["function-call"] * 2
    for case in cases:
        assert json.dumps(case.schema) in case.prompt
        constraint_for(ConstraintSpec("json_schema", json.dumps(case.schema)))


# --------------------------------------------------------------------------- what a constraint may cost


def chain(n: int) -> str:
    """A GBNF grammar of n + 2 rules, each naming the next: at a few thousand, the engine's
    recursion over it overflows the stack (a segmentation fault)."""
    return "root ::= r0\n" + "".join(f'r{i} ::= "a" r{i + 1} | "b"\n' for i in range(n)) + f'r{n} ::= "b"\n'


def ref_chain(n: int) -> str:
    """A JSON schema of n $refs, each definition naming the next."""
    defs = {
        f"d{i}": {"type": "array", "items": {"$ref": f"#/$defs/d{i + 1}"}, "maxItems": 1}
        for i in range(n - 1)
    }
    return json.dumps({"$ref": "#/$defs/d0", "$defs": {**defs, f"d{n - 1}": {"type": "integer"}}})


def nested(n: int, inner: str = '"b"') -> str:
    return "(a" * n + inner + ")" * n


@pytest.mark.parametrize(
    ("kind", "text", "message"),
    [
        ("grammar", chain(5000), "it has 5002 rules (at most 500)"),
        ("grammar", "%llguidance {}\nstart: r0\n" + "".join(f'r{i}: "a"\n' for i in range(500)), "501 rul"),
        ("grammar", "root ::= " + nested(101).replace("(a", '("a" '), "parentheses nest 101 deep"),
        ("regex", nested(101, "b"), "parentheses nest 101 deep"),
        ("json_schema", ref_chain(201), "it has 201 $refs (at most 200)"),
        ("json_schema", '{"enum": ' + "[" * 100 + "]" * 100 + "}", "it nests 101 deep"),
        ("regex", "a" * 1_000_001, "1000001 characters long"),
    ],
)
def test_constraints_past_the_limits_are_refused(kind, text, message) -> None:
    with pytest.raises(SpecdecodeError, match=re.escape(message)):
        ConstraintSpec(kind, text).grammar()


@pytest.mark.parametrize(
    ("kind", "text"),
    [
        ("grammar", chain(498)),
        ("grammar", "root ::= " + nested(100).replace("(a", '("a" ')),
        ("grammar", 'root ::= "(((" [(] "#" x\nx ::= "y" # ((((\n'),
        ("regex", nested(100, "b")),
        ("json_schema", ref_chain(200)),
    ],
)
def test_constraints_at_the_limits_compile(kind, text) -> None:
    constraint_for(ConstraintSpec(kind, text))


def test_the_gbnf_check_takes_time_linear_in_the_rules() -> None:
    """20,000 chained rules (past the limit, checked alone): the check walks each rule once,
    where a fixpoint over every rule per round took minutes."""
    from specdecode.grammars import _check_gbnf

    start = time.process_time()
    _check_gbnf(chain(20_000))
    assert time.process_time() - start < 15.0
    with pytest.raises(SpecdecodeError, match="no text matches rule 'r5000'"):
        _check_gbnf(chain(5000).replace('r5000 ::= "b"', 'r5000 ::= "b" r5000'))


# --------------------------------------------------------------------------- a bias against the grammar


def forced_step(spec: ConstraintSpec, tokens: list[int]) -> tuple[int, int]:
    """The last position in tokens (a constrained output) where the grammar allows one token
    alone, one not met before it, and that token."""
    constraint = constraint_for(spec)
    found = None
    for index, token in enumerate(tokens):
        allowed = constraint.allowed()
        if allowed is not None and int(allowed.sum()) == 1 and token not in tokens[:index]:
            found = index, token
        constraint.advance(token)
    assert found is not None, "no forced token"
    return found


@pytest.mark.parametrize("verify", ["match", "rejection"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_bias_against_the_only_token_a_grammar_allows_ends_the_generation(
    exactness_log, temperature, verify
) -> None:
    """A bias of -inf on the one token a JSON schema allows next: the generation ends there
    ("no allowed token"), in plain and speculative generation alike, before that token."""
    spec = CONSTRAINTS["person"]
    sampling = SamplingParams(temperature=temperature, seed=3)
    config = GenerationConfig(n_predict=48, verify=verify)
    free = Pipeline(backend(target_model(TargetSpec()))).generate("x", sampling, config, spec)
    index, token = forced_step(spec, free.tokens)
    biased = SamplingParams(temperature=temperature, seed=3, logit_bias=((token, -math.inf),))
    plain = Pipeline(backend(target_model(TargetSpec()))).generate("x", biased, config, spec)
    assert plain.stats.stop_reason == "no allowed token" and token not in plain.tokens
    assert plain.tokens == free.tokens[:index] and index > 8
    for types in (["draft"], ["forced"], ["ngram-simple", "draft"]):
        pipe = Pipeline(
            backend(target_model(TargetSpec())),
            backend(draft_model(TargetSpec(), 0.02)),
            spec_types=types,
            ngram=SHORT_NGRAMS,
        )
        result = pipe.generate("x", biased, config, spec)
        if verify == "match" or temperature == 0:
            check_same(result, plain)
        assert result.stats.stop_reason == "no allowed token" and token not in result.tokens
        stats = result.stats
        exactness_log.record("constrained/bias", f"{','.join(types)} {verify}", stats, stats.stop_reason)


def test_a_bias_banning_every_token_ends_the_generation_at_once() -> None:
    target = backend(target_model(TargetSpec()))
    ban = tuple((token, -math.inf) for token in range(target.vocab.size))
    pipe = Pipeline(target, backend(draft_model(TargetSpec(), 0.02)))
    for temperature in (0.0, 1.0):
        sampling = SamplingParams(temperature=temperature, logit_bias=ban)
        result = pipe.generate("x", sampling, GenerationConfig(n_predict=8))
        assert result.tokens == [] and result.text == "" and result.stats.stop_reason == "no allowed token"
