"""The chat comparison of `python -m specdecode.compare.llama_tools --target T.gguf --draft
D.gguf`: ours and llama.cpp's programs on chat prompts, once per prompt and round, and its
tables (in total and task by task). Apart from the export-folder comparison."""

from __future__ import annotations

import functools
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from specdecode import GenerationConfig, Result, SamplingParams
from specdecode.api import BESIDE_A_DRAFT
from specdecode.backends.hf import LoadOptions
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.bench.systems import System, build_systems
from specdecode.chat import ChatPrompt, encode_rendered
from specdecode.compare.llama_programs import (
    CHAT_CONTEXT,
    COLOUR,
    COMPLETION,
    DECODED,
    DRAFT,
    EVAL,
    Tally,
    chat_tool_systems,
    prompt_tokens,
    timed_tool,
    tool_arguments,
    tool_figures,
    tool_prompt,
)
from specdecode.errors import SpecdecodeError
from specdecode.strategies import NgramSettings

# ours: plain, the command line's default with a draft (the adaptive policy over the draft and the
# n-gram strategies asked beside it), and that n-gram chain alone under the classic policy
DEFAULT_WITH_DRAFT = ",".join([*BESIDE_A_DRAFT, "draft"]) + "@adaptive"
OURS_CHAT = ("plain", DEFAULT_WITH_DRAFT, ",".join(BESIDE_A_DRAFT))
PLAIN_CHAT = ("plain", COMPLETION)  # each side's baseline


NO_REPACK = " -nr"  # the name's suffix of our systems run on weights not repacked


@dataclass
class ChatResults:
    """Per task and system, one Tally per round (sums over the task's prompts) and, per prompt
    and round, whether the system's text agrees with our plain answer."""

    tallies: dict[str, dict[str, list[Tally]]]
    agree: dict[str, dict[str, list[bool]]]

    def total(self) -> tuple[dict[str, list[Tally]], dict[str, list[bool]]]:
        """The same over all tasks: per system, per round the sum over every prompt."""
        tasks = list(self.tallies.values())
        tallies = {
            name: [summed(task[name][round_] for task in tasks) for round_ in range(len(rounds_))]
            for name, rounds_ in tasks[0].items()
        }
        agree = {name: [same for task in self.agree.values() for same in task[name]] for name in tallies}
        return tallies, agree


def summed(tallies: Iterable[Tally]) -> Tally:
    total = Tally()
    for t in tallies:
        total.add(
            t.tokens,
            t.seconds,
            t.drafted,
            t.accepted,
            cpu_seconds=t.cpu_seconds,
            generation_seconds=t.generation_seconds,
        )
        total.add_baseline(t.baseline_tokens, t.baseline_cpu_seconds)
    return total


def measure_chat(
    target_path: Path,
    draft_path: Path,
    prompts: list[tuple[str, str]],
    n_predict: int,
    rounds: int,
    tools: Path,
    chat: ChatPrompt | None = None,
    no_repack: bool = False,
) -> ChatResults:
    """Every system, ours and llama.cpp's, once per prompt (task, text) and round (rotated).
    chat: the template (and system message) to render with; None: the prompts as they are (a
    model without a chat template). no_repack: our systems also run on copies of the models
    loaded with their weights in the file's layout (`-nr`), named with NO_REPACK."""
    options = LoadOptions(backend="llama.cpp", threads=1, n_ctx=CHAT_CONTEXT)
    target = LlamaCppBackend.load(target_path, options)
    draft = LlamaCppBackend.load(draft_path, options)
    tokenizer = target.tokenizer
    texts = [text if chat is None else chat.text(tokenizer, text, target.name) for _, text in prompts]
    ours = {
        s.name: (s, (target, draft)) for s in build_systems(OURS_CHAT, target, draft, DRAFT, NgramSettings())
    }
    if no_repack:
        options = LoadOptions(backend="llama.cpp", threads=1, n_ctx=CHAT_CONTEXT, repack=False)
        models = (LlamaCppBackend.load(target_path, options), LlamaCppBackend.load(draft_path, options))
        chosen = OURS_CHAT[:2]  # plain and the default
        for system in build_systems(chosen, *models, DRAFT, NgramSettings()):
            ours[system.name + NO_REPACK] = (system, models)
    tools_by_name = {s.name: s for s in chat_tool_systems()}
    names = [*ours, *tools_by_name]
    task_names = list(dict.fromkeys(task for task, _ in prompts))
    tallies = {task: {name: [Tally() for _ in range(rounds)] for name in names} for task in task_names}
    agree: dict[str, dict[str, list[bool]]] = {task: {name: [] for name in names} for task in task_names}
    for system, _ in ours.values():  # uncounted: the first call of a process pays one-time costs
        system.make_pipeline().generate(
            encode_rendered(tokenizer, texts[0]), SamplingParams(temperature=0), GenerationConfig(n_predict)
        )
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(rounds):
            for index, text in enumerate(texts):
                task = prompts[index][0]
                ids = encode_rendered(tokenizer, text)
                prompt_file = Path(scratch) / f"prompt-{index}.txt"
                tool_text = tool_prompt(text, tokenizer.bos_token, target.vocab.add_bos)
                prompt_file.write_text(tool_text + "\n")  # the programs drop a last newline
                shift = (round_ * len(texts) + index) % len(names)
                answers: dict[str, str] = {}
                for name in names[shift:] + names[:shift]:
                    print(
                        f"round {round_ + 1}/{rounds}, prompt {index + 1}/{len(texts)}: {name}",
                        file=sys.stderr,
                    )
                    tally = tallies[task][name][round_]
                    if name in ours:
                        system, backends = ours[name]
                        first, _, first_cpu = _our_run(system, backends, ids, 1)
                        tally.add_baseline(first.stats.n_generated, first_cpu)
                        run, seconds, cpu_seconds = _our_run(system, backends, ids, n_predict)
                        stats = run.stats
                        tally.add(
                            stats.n_generated,
                            seconds,
                            stats.totals.n_drafted,
                            stats.totals.n_accepted,
                            cpu_seconds=cpu_seconds,
                            generation_seconds=stats.t_generation,
                        )
                        answers[name] = target.detokenize(run.tokens)
                        continue
                    system = tools_by_name[name]
                    wanted = EVAL if system.program == COMPLETION else DECODED
                    arguments = tool_arguments(system, target_path, draft_path, prompt_file, n_predict)
                    first, _ = timed_tool(
                        tools,
                        system.program,
                        tool_arguments(system, target_path, draft_path, prompt_file, 1),
                        wanted,
                    )
                    tally.add_baseline(tool_figures(system, first.output)[0], first.cpu_seconds)
                    run, _ = timed_tool(tools, system.program, arguments, wanted)
                    if system.program == COMPLETION and prompt_tokens(run.output) != ids:
                        raise SpecdecodeError(
                            f"llama-completion read other prompt tokens than ours on prompt {index + 1}: "
                            f"{prompt_tokens(run.output)[:16]}... against {ids[:16]}..."
                        )
                    tokens, generation, drafted, accepted = tool_figures(system, run.output)
                    tally.add(
                        tokens,
                        run.seconds,
                        drafted,
                        accepted,
                        cpu_seconds=run.cpu_seconds,
                        generation_seconds=generation,
                    )
                    answers[name] = COLOUR.sub("", run.output)  # drafted tokens are printed coloured
                for name in names:
                    # the weights not repacked round otherwise: their plain answer is their reference
                    plain = "plain" + NO_REPACK if name.endswith(NO_REPACK) else "plain"
                    reference = answers[plain].strip()[:ANSWER_CHARS]
                    same = (
                        reference in answers[name]
                        if name not in ours
                        else answers[name].strip().startswith(reference)
                    )
                    agree[task][name].append(same)
    return ChatResults(tallies, agree)


def _our_run(
    system: System, backends: tuple[LlamaCppBackend, ...], ids: list[int], n_predict: int
) -> tuple[Result, float, float]:
    """One greedy generation of ours from an empty cache: the result, its wall-clock and CPU seconds."""
    pipeline = system.make_pipeline()
    for backend in backends:
        backend.truncate(0)
    wall, cpu = time.perf_counter(), time.process_time()
    run = pipeline.generate(ids, SamplingParams(temperature=0), GenerationConfig(n_predict))
    return run, time.perf_counter() - wall, time.process_time() - cpu


ANSWER_CHARS = 120  # the start of our plain answer another system's text must contain


def chat_rows(tallies: dict[str, list[Tally]], agree: dict[str, list[bool]]) -> list[dict]:
    """Per system: medians over rounds of its rates, its totals over all rounds, and its
    generation-only speed-up over its own side's plain system (ours, llama-completion)."""
    rows = []
    tool_names = {system.name for system in chat_tool_systems()}
    for name, rounds_ in tallies.items():
        median = functools.partial(_median_rate, rounds_)
        rows.append(
            {
                "system": name,
                "side": "llama.cpp" if name in tool_names else "ours",
                "tokens": sum(t.tokens for t in rounds_),
                "tokens_per_second": median(lambda t: t.tokens / t.seconds if t.seconds else 0.0),
                "tokens_per_cpu_second": median(lambda t: t.tokens / t.cpu_seconds if t.cpu_seconds else 0.0),
                "marginal_tokens_per_cpu_second": median(lambda t: t.marginal_cpu_rate),
                "generation_tokens_per_second": median(
                    lambda t: t.tokens / t.generation_seconds if t.generation_seconds else 0.0
                ),
                "accepted": sum(t.accepted for t in rounds_),
                "drafted": sum(t.drafted for t in rounds_),
                "same_as_plain": sum(agree[name]),
                "prompts": len(agree[name]),
            }
        )
    plain = {row["side"]: row["generation_tokens_per_second"] for row in rows if row["system"] in PLAIN_CHAT}
    for row in rows:
        baseline = plain.get(row["side"])
        row["generation_speedup"] = row["generation_tokens_per_second"] / baseline if baseline else None
    return rows


def _median_rate(tallies: list[Tally], rate: Callable[[Tally], float]) -> float:
    return statistics.median(rate(t) for t in tallies)


def print_chat_table(rows: list[dict]) -> None:
    print(
        "| system | side | tok/s (wall, end to end) | tok/CPU-s | tok/CPU-s (marginal) "
        "| tok/s (generation only) | × its plain (generation) | accepted/drafted | starts as our plain |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        accepted = f"{row['accepted']}/{row['drafted']}" if row["drafted"] else "-"
        speedup = f"{row['generation_speedup']:.2f}x" if row["generation_speedup"] else "-"
        print(
            f"| {row['system']} | {row['side']} | {row['tokens_per_second']:.1f} | "
            f"{row['tokens_per_cpu_second']:.1f} | {row['marginal_tokens_per_cpu_second']:.1f} | "
            f"{row['generation_tokens_per_second']:.1f} | {speedup} | "
            f"{accepted} | {row['same_as_plain']}/{row['prompts']} |"
        )


def print_task_table(rows_by_task: dict[str, list[dict]], total: list[dict]) -> None:
    """Each system's tokens per CPU-second and per wall-clock second (end to end), task by task
    and over all tasks: a total can hide a task where a system loses."""
    columns = [*rows_by_task, "total"]
    print(
        "\n| system | side | " + " | ".join(f"{c} tok/CPU-s (marginal) | {c} tok/s" for c in columns) + " |"
    )
    print("|---|---|" + "---|---|" * len(columns))
    by_column = [{row["system"]: row for row in rows} for rows in (*rows_by_task.values(), total)]
    for row in total:
        figures = [rows[row["system"]] for rows in by_column]
        cells = [f"{f['marginal_tokens_per_cpu_second']:.1f} | {f['tokens_per_second']:.1f}" for f in figures]
        print(f"| {row['system']} | {row['side']} | " + " | ".join(cells) + " |")
