"""Our loop on llama.cpp's kernels next to llama.cpp's own programs, on the same GGUF files.

    make llama-tools      # llama.cpp's programs, from the source of the installed llama-cpp-python
    python -m specdecode.compare.llama_tools build/gguf build/gguf-q8_0 [-n 128] [--rounds 3]

Each folder is one `specdecode export --engines llama.cpp` output (llama.cpp/target.gguf and
llama.cpp/draft.gguf). For every file pair, prompt and round, alternated, each system runs once
on each side, greedy, one thread, from a cold start:

- ours: a fresh `Pipeline` over the llama.cpp backend (loaded once per file), generation
  tokens/s from its stats (the prompt's pass excluded);
- llama.cpp's: `llama-speculative-simple` (plain: the same program with ngram-mod drafting
  nothing, so that both columns share its loop and its timer; draft: `--spec-type
  draft-simple`; `ngram-mod`, `ngram-simple`) and `llama-lookup` (its n-gram cache, against our
  `ngram-cache`), tokens/s from their `decoded N tokens in T seconds` line. llama.cpp's plain
  CLI, `llama-completion`, gives a second plain figure: its decode passes and sampling alone
  (`eval time` + `sampling time`), nothing else of its loop.

Both sides get the same settings (llama.cpp's classic defaults, which are ours: draft n_max 16,
p_min 0.75; ngram-mod 24/48/64; ngram-simple 12/48; the n-gram cache drafts 8) and stop at EOS.
llama.cpp's examples go past -n: by one token, and by a whole accepted draft where the last
one is not cut to the budget (ngram-mod's drafts of up to 64 tokens: -n 128 can give 193). Our
run of a system is therefore given as many tokens as llama.cpp's run of it produced, so that
both rates cover the same tokens (our speculative output is compared with our plain output
over their common length).
The table gives tokens/s summed over the prompts (tokens / seconds) with the median over rounds,
each side's speculative speed-up over its own plain loop, whether our speculative tokens equal
our plain tokens, and whether llama.cpp's text equals ours (information: its kernels run the
same passes, so they usually agree, but a verify pass's rows may round differently).

Real chat models, one target and draft GGUF file each (e.g. Qwen2.5-Coder 1.5B and 0.5B):

    python -m specdecode.compare.llama_tools --target T.gguf --draft D.gguf [-n 64] [--rounds 2]

runs the chat tasks (`bench.tasks`), each prompt rendered through the target's chat template,
llama.cpp's programs given the same rendered text (`--no-escape`, and without the BOS text when
the model adds BOS itself, so that both sides read the same tokens: llama-completion's
`--verbose-prompt` list is checked against ours), each stopping at end of generation:
llama-completion (plain), llama-speculative-simple drafting with the draft at n_max/p_min
3/0 (its defaults), 8/0.5 and 16/0.75, and llama-lookup; ours plain, the command line's
default with a draft (the adaptive policy over ngram-mod, ngram-map-k4v and the draft) and the
n-gram chain ngram-mod,ngram-map-k4v alone (classic). --raw gives the tasks' prompts as they
are, for models without a chat template (the bundled pair's exports).
Every system runs once per prompt and round,
in an order rotated each round. For llama.cpp's programs the CPU time is the child process's
(getrusage), its model loading included, and wall-clock time the whole process's; their
generation-only rate is from their printed timings. Ours run in this process with the models
loaded once: CPU and wall-clock time of the generation call (prompt included), and the
generation-only rate from its stats. Each run is preceded by the same run asked for one
token: the marginal tokens per CPU-second, (N - 1) tokens over the difference of the two runs'
CPU seconds, leave loading and the prompt out on both sides alike, and are the figure to
compare. The table sums the tasks; a second one gives each system's marginal tokens per
CPU-second and tokens per second task by task, and --json FILE writes both.
--also-no-repack adds our plain and default systems on the weights in the file's layout (`-nr`):
llama.cpp's repacked Q4_K rows are bit-identical only up to a few rows a pass, which caps the
drafts an exact verify may take.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from specdecode import GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.hf import LoadOptions
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.bench.machine import Machine, machine_line
from specdecode.bench.names import CHAT_TASKS
from specdecode.bench.tasks import build_tasks
from specdecode.chat import ChatPrompt
from specdecode.compare.llama_chat import (
    NO_REPACK,
    chat_rows,
    measure_chat,
    print_chat_table,
    print_task_table,
)
from specdecode.compare.llama_programs import (
    ACCEPTED,
    COMPLETION,
    DECODED,
    DEFAULT_TOOLS,
    DRAFT,
    DRAFTED,
    EVAL,
    SAMPLING,
    SYSTEMS,
    System,
    Tally,
    generated_text,
    run_tool,
    same_text,
)
from specdecode.errors import read_text_file, write_atomically


@dataclass
class Results:
    """Per system and side, one Tally per round; output agreement per system."""

    rounds: dict[tuple[str, str], list[Tally]] = field(default_factory=dict)
    same_as_plain: dict[str, list[bool]] = field(default_factory=dict)  # ours: speculative == plain
    same_text: dict[str, list[bool]] = field(default_factory=dict)  # llama.cpp's text == ours

    def tally(self, system: str, side: str, round_: int) -> Tally:
        tallies = self.rounds.setdefault((system, side), [])
        while len(tallies) <= round_:
            tallies.append(Tally())
        return tallies[round_]

    def rate(self, system: str, side: str) -> float:
        return statistics.median(t.rate for t in self.rounds[(system, side)])


def measure_pair(
    folder: Path,
    prompts: list[str],
    n_predict: int,
    rounds: int,
    tools: Path,
    systems: tuple[System, ...],
) -> tuple[Results, bool]:
    """Every system on both sides over one file pair; and the target's probed row-invariance."""
    target_path, draft_path = folder / "llama.cpp" / "target.gguf", folder / "llama.cpp" / "draft.gguf"
    options = LoadOptions(backend="llama.cpp", threads=1)
    target = LlamaCppBackend.load(target_path, options)
    draft = LlamaCppBackend.load(draft_path, options)
    results = Results()
    with tempfile.TemporaryDirectory() as scratch:
        for round_ in range(rounds):
            for index, prompt in enumerate(prompts):
                prompt_file = Path(scratch) / f"prompt-{index}.txt"
                prompt_file.write_text(prompt + "\n")  # the programs drop a last newline
                common = ["-m", str(target_path), "-f", str(prompt_file), "-n", str(n_predict), "-t", "1"]
                common += ["--temp", "0", "--seed", "1"]
                plain_tokens = None
                for system in systems:
                    arguments = [a.replace("{draft}", str(draft_path)) for a in system.arguments]
                    output, decoded = run_tool(tools, system.program, common + arguments, DECODED)
                    drafted, accepted = DRAFTED.search(output), ACCEPTED.search(output)
                    results.tally(system.name, "llama.cpp", round_).add(
                        int(decoded[1]),
                        float(decoded[2]),
                        int(drafted[1]) if drafted else 0,
                        int(accepted[1]) if accepted else 0,
                    )
                    # As many tokens as llama.cpp's run gave (see the module's docstring).
                    length = max(n_predict, int(decoded[1]))
                    for backend in (target, draft):
                        backend.truncate(0)
                    pipeline = Pipeline(
                        target,
                        draft if "draft" in system.spec_types else None,
                        spec_types=list(system.spec_types),
                        draft_config=DRAFT,
                    )
                    run = pipeline.generate(prompt, SamplingParams(temperature=0), GenerationConfig(length))
                    stats = run.stats
                    results.tally(system.name, "ours", round_).add(
                        stats.n_generated, stats.t_generation, stats.totals.n_drafted, stats.totals.n_accepted
                    )
                    plain_tokens = plain_tokens if plain_tokens is not None else run.tokens
                    same = run.tokens[: len(plain_tokens)] == plain_tokens[: len(run.tokens)]
                    results.same_as_plain.setdefault(system.name, []).append(same)
                    results.same_text.setdefault(system.name, []).append(
                        same_text(run.text, generated_text(output, prompt))
                    )
                if (tools / COMPLETION).exists():
                    output, evaluated = run_tool(tools, COMPLETION, [*common, "-no-cnv", "--no-warmup"], EVAL)
                    sampling = SAMPLING.search(output)
                    sampling_ms = float(sampling[1]) if sampling is not None else 0.0
                    results.tally("plain", "llama-completion", round_).add(
                        int(evaluated[2]), (float(evaluated[1]) + sampling_ms) / 1e3
                    )
    return results, target.invariant


def print_table(label: str, results: Results, invariant: bool, systems: tuple[System, ...]) -> None:
    plain_ours, plain_theirs = results.rate("plain", "ours"), results.rate("plain", "llama.cpp")
    print(f"\n{label}: target rows invariant (probe): {invariant}")
    if ("plain", "llama-completion") in results.rounds:
        completion = results.rate("plain", "llama-completion")
        print(
            f"  llama-completion, decode passes and sampling: {completion:.1f} tok/s; "
            f"our plain {plain_ours / completion:.2f}x"
        )
    print(
        "  | system | ours tok/s | × our plain | llama.cpp tok/s | × its plain | ours / llama.cpp "
        "| accepted ours / llama.cpp | ours = our plain | llama.cpp text = ours |"
    )
    print("  |---|---|---|---|---|---|---|---|---|")
    for system in systems:
        ours, theirs = results.rate(system.name, "ours"), results.rate(system.name, "llama.cpp")
        accepted = []
        for side in ("ours", "llama.cpp"):
            tally = results.rounds[(system.name, side)][0]
            accepted.append(f"{tally.accepted}/{tally.drafted}" if tally.drafted else "-")
        same = results.same_as_plain[system.name]
        text = results.same_text[system.name]
        print(
            f"  | {system.name} | {ours:.1f} | {ours / plain_ours:.2f}x | {theirs:.1f} | "
            f"{theirs / plain_theirs:.2f}x | {ours / theirs:.2f}x | {' / '.join(accepted)} | "
            f"{sum(same)}/{len(same)} | {sum(text)}/{len(text)} |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "folders", type=Path, nargs="*", help="`specdecode export --engines llama.cpp` outputs"
    )
    parser.add_argument(
        "--target", type=Path, help="a chat model's GGUF file (with --draft, in place of folders)"
    )
    parser.add_argument("--draft", type=Path, help="its draft model's GGUF file")
    parser.add_argument(
        "--chat-template-file", type=Path, help="--target: a Jinja chat template in place of the model's"
    )
    parser.add_argument(
        "--raw",
        action="store_true",
        help="--target: the tasks' prompts as they are, not through a chat template (a model "
        "without one, such as the bundled pair's exports; tasks: completion,editing,extraction,free)",
    )
    parser.add_argument("-n", "--n-predict", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="alternated rounds (medians)")
    parser.add_argument(
        "--tasks",
        help="bench tasks (folders: completion,editing,extraction; --target: every chat task)",
    )
    parser.add_argument("--prompts-per-task", type=int, default=1, help="prompts of each task")
    parser.add_argument("--systems", help="comma-separated subset of: " + ", ".join(s.name for s in SYSTEMS))
    parser.add_argument("--tools", type=Path, default=DEFAULT_TOOLS, help="folder of llama.cpp's programs")
    parser.add_argument(
        "--also-no-repack",
        action="store_true",
        help="--target: also run our plain and default systems on the weights in the file's "
        f"layout (-nr/--no-repack; named with {NO_REPACK.strip()!r})",
    )
    parser.add_argument(
        "--json", type=Path, help="--target: also write the figures, in total and per task, here"
    )
    args = parser.parse_args()
    if (args.target is None) != (args.draft is None) or (args.target is None) == (not args.folders):
        parser.error("give export folders, or --target and --draft GGUF files")
    if args.json is not None and not args.json.parent.is_dir():  # found out before the run, not after
        parser.error(f"--json: no folder {args.json.parent}")
    if args.target is not None:
        default_tasks = "completion,editing,extraction,free" if args.raw else ",".join(CHAT_TASKS)
        tasks = build_tasks((args.tasks or default_tasks).split(","), args.prompts_per_task)
        prompts = [(task.name, prompt) for task in tasks for prompt in task.prompts]
        print(
            f"{len(prompts)} {'' if args.raw else 'chat '}prompts ({', '.join(t.name for t in tasks)}), "
            f"-n {args.n_predict}, greedy, "
            f"1 thread, stop at end of generation, median of {args.rounds} round(s)"
        )
        template = (
            read_text_file(args.chat_template_file, "chat template file") if args.chat_template_file else None
        )
        chat = None if args.raw else ChatPrompt(template=template)
        machine = Machine()
        results = measure_chat(
            args.target,
            args.draft,
            prompts,
            args.n_predict,
            args.rounds,
            args.tools,
            chat,
            args.also_no_repack,
        )
        described = machine.describe({"target": "gguf", "draft": "gguf"}, "cpu")
        print(machine_line(described))
        total = chat_rows(*results.total())
        by_task = {task: chat_rows(results.tallies[task], results.agree[task]) for task in results.tallies}
        print_chat_table(total)
        print_task_table(by_task, total)
        if args.json is not None:
            figures = {"machine": described, "n_predict": args.n_predict, "rounds": args.rounds}
            text = json.dumps({**figures, "total": total, "tasks": by_task}, indent=1)
            write_atomically(args.json, "figures file", lambda file: file.write(text.encode()))
        return
    args.tasks = args.tasks or "completion,editing,extraction"
    systems = SYSTEMS
    if args.systems:
        names = args.systems.split(",")
        systems = tuple(s for s in SYSTEMS if s.name == "plain" or s.name in names)
    prompts = [
        prompt
        for task in build_tasks(args.tasks.split(","), args.prompts_per_task)
        for prompt in task.prompts
    ]
    print(
        f"{len(prompts)} prompts ({args.tasks}), -n {args.n_predict}, greedy, 1 thread, "
        f"median of {args.rounds} round(s)"
    )
    for folder in args.folders:
        results, invariant = measure_pair(folder, prompts, args.n_predict, args.rounds, args.tools, systems)
        print_table(str(folder), results, invariant, systems)


if __name__ == "__main__":
    main()
