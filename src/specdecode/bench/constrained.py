"""`specdecode bench-constrained`: structured output, constrained plain against constrained
speculative generation.

Two task sets built from held-out functions, the schema in the prompt and the answer held
to it by the grammar engine:

* json-extraction: a function, then a request for facts about it as JSON (its name, its
  arguments, whether it has a docstring, what it returns);
* function-call: the signatures of a module's functions as tools, a request taken from one
  function's docstring, and a call of one tool as JSON (the tool's name is an enum).

Every system runs every prompt greedily, interleaved (one round = every system once, the
order rotated each round) after an uncounted warm-up round; each speculative output is
compared with constrained plain generation's. Besides speed it reports the grammar's share
of the generation time and its cost per token (masks, walks and commits of the matcher).
"""

from __future__ import annotations

import argparse
import json
import statistics
from dataclasses import dataclass, field

from specdecode.api import Pipeline
from specdecode.backends.hf import LoadOptions
from specdecode.backends.load import load_backend
from specdecode.bench.tasks import Function, functions_of, heldout_files
from specdecode.constraints import ConstraintSpec
from specdecode.defaults import resolve_models
from specdecode.errors import SpecdecodeError
from specdecode.generate import GenerationConfig
from specdecode.sampling import SamplingParams
from specdecode.strategies import DraftModelConfig, parse_spec_types

FACTS = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "arguments": {"type": "array", "items": {"type": "string", "maxLength": 20}, "maxItems": 6},
        "has_docstring": {"type": "boolean"},
        "returns": {"enum": ["a value", "nothing", "a generator"]},
    },
    "required": ["name", "arguments", "has_docstring", "returns"],
    "additionalProperties": False,
}


def call_schema(tools: list[str]) -> dict:
    argument = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 16},
            "value": {"type": "string", "maxLength": 24},
        },
        "required": ["name", "value"],
        "additionalProperties": False,
    }
    return {
        "type": "object",
        "properties": {
            "tool": {"enum": tools},
            "arguments": {"type": "array", "items": argument, "maxItems": 3},
        },
        "required": ["tool", "arguments"],
        "additionalProperties": False,
    }


@dataclass(frozen=True)
class Case:
    task: str
    prompt: str
    schema: dict


def extraction_case(function: Function) -> Case:
    prompt = (
        f"{function.source}\n# Facts about {function.name} as one JSON object of this schema:\n"
        f"# {json.dumps(FACTS)}\nfacts = "
    )
    return Case("json-extraction", prompt, FACTS)


def call_case(functions: list[Function]) -> Case | None:
    """Tools: the module's first functions' signatures; the request: one docstring's first line."""
    asked = next((f for f in functions if f.docstring), None)
    if asked is None or len(functions) < 2:
        return None
    tools = sorted({f.name for f in functions[:4]} | {asked.name})
    signatures = "\n".join(f.source.split("\n")[0] for f in functions[:4] if f.name in tools)
    schema = call_schema(tools)
    request = asked.docstring.split("\n")[0]
    prompt = (
        f"# Tools:\n{signatures}\n# Request: {request}\n# Call one tool, as JSON of this schema:\n"
        f"# {json.dumps(schema)}\ncall = "
    )
    return Case("function-call", prompt, schema)


def build_cases(per_task: int) -> list[Case]:
    """per_task cases of each task, from the held-out files in path order, one per file."""
    extraction: list[Case] = []
    calls: list[Case] = []
    for path in sorted(heldout_files(), key=str):
        functions = list(functions_of(path))
        if functions and len(extraction) < per_task:
            extraction.append(extraction_case(functions[0]))
        case = call_case(functions) if len(calls) < per_task else None
        if case is not None:
            calls.append(case)
        if len(extraction) == len(calls) == per_task:
            break
    return extraction + calls


@dataclass
class Totals:
    tokens: int = 0
    seconds: float = 0.0
    passes: int = 0
    drafted: int = 0
    accepted: int = 0
    grammar: float = 0.0
    masks: int = 0
    rates: list[float] = field(default_factory=list)  # tokens/s of each generation


def run(args: argparse.Namespace) -> None:
    if args.prompts_per_task < 1 or args.runs < 1 or args.n_predict < 1:
        raise SpecdecodeError("--prompts-per-task, --runs and -n must be >= 1")
    target_dir, draft_dir = resolve_models(args.model, args.model_draft)
    options = LoadOptions(threads=args.threads)
    target = load_backend(target_dir, options)
    draft = load_backend(draft_dir, options) if draft_dir is not None else None
    names = [name.strip() for name in args.systems.split(";") if name.strip()]
    draft_config = DraftModelConfig(n_max=args.draft_max, p_min=args.draft_p_min)
    pipelines = {
        name: Pipeline(
            target,
            draft if "draft" in name else None,
            spec_types=[] if name == "plain" else parse_spec_types(name),
            draft_config=draft_config,
        )
        for name in names
    }
    cases = build_cases(args.prompts_per_task)
    config = GenerationConfig(n_predict=args.n_predict)
    totals = {(case.task, name): Totals() for case in cases for name in names}
    outputs: dict[tuple[int, str], list[list[int]]] = {}  # every run's tokens
    for round_index in range(args.runs + 1):
        for index, case in enumerate(cases):
            order = names[round_index % len(names) :] + names[: round_index % len(names)]
            for name in order:
                spec = ConstraintSpec("json_schema", json.dumps(case.schema))
                result = pipelines[name].generate(case.prompt, SamplingParams(temperature=0), config, spec)
                outputs.setdefault((index, name), []).append(result.tokens)
                if round_index == 0:
                    continue  # warm-up
                stats = result.stats
                entry = totals[(case.task, name)]
                entry.tokens += stats.n_generated
                entry.seconds += stats.t_generation
                entry.passes += stats.n_passes + 1
                entry.drafted += stats.totals.n_drafted
                entry.accepted += stats.totals.n_accepted
                entry.grammar += stats.t_grammar
                entry.masks += stats.n_masks
                entry.rates.append(stats.tokens_per_second)
    print(
        f"specdecode bench-constrained: {target_dir.name} / {draft_dir.name if draft_dir else 'no draft'}, "
        f"{args.prompts_per_task} prompts per task, {args.runs} runs, greedy, -n {args.n_predict}"
    )
    header = f"{'system':<30} {'task':<16} {'tok/s':>7} {'x plain':>8} {'tok/pass':>8} {'accept':>7} "
    print(header + f"{'grammar %':>9} {'us/token':>8}")
    for task in dict.fromkeys(case.task for case in cases):
        base = totals[(task, "plain")] if "plain" in names else None
        for name in names:
            t = totals[(task, name)]
            rate = t.tokens / t.seconds if t.seconds else 0.0
            ratio = rate / (base.tokens / base.seconds) if base is not None and base.seconds else float("nan")
            accept = t.accepted / t.drafted if t.drafted else float("nan")
            print(
                f"{name:<30} {task:<16} {rate:7.1f} {ratio:7.2f}x {t.tokens / t.passes:8.2f} "
                f"{100 * accept:6.1f}% {100 * t.grammar / t.seconds:8.1f}% {1e6 * t.grammar / t.tokens:8.0f}"
            )
    reference = names[0]  # "plain" when it runs
    differ = sum(tokens != outputs[(i, reference)][0] for (i, _), runs in outputs.items() for tokens in runs)
    answers = [len(outputs[(i, reference)][0]) for i in range(len(cases))]
    print(
        f"answers: {statistics.mean(answers):.1f} tokens on average; speculative outputs differing from "
        f"{reference}'s: {differ}"
    )
