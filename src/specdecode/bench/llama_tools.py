"""Our loop on llama.cpp's kernels next to llama.cpp's own programs, on the same GGUF files.

    make llama-tools      # llama.cpp's programs, from the source of the installed llama-cpp-python
    python -m specdecode.bench.llama_tools build/gguf build/gguf-q8_0 [-n 128] [--rounds 3]

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
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.hf import LoadOptions
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.bench.tasks import build_tasks
from specdecode.errors import SpecdecodeError

DEFAULT_TOOLS = Path("build/llama-tools/cmake/bin")
DRAFT = DraftModelConfig()  # n_max 16, p_min 0.75: passed to llama.cpp too
LOOKUP_DRAFT = 8  # our ngram-cache's fixed draft length (llama-server's), given to llama-lookup
DECODED = re.compile(r"decoded\s+(\d+) tokens in\s+([\d.]+) seconds")
EVAL = re.compile(r"\beval time =\s+([\d.]+) ms /\s+(\d+) runs")
SAMPLING = re.compile(r"sampling time =\s+([\d.]+) ms")
ACCEPTED = re.compile(r"n_accept\s*=\s*(\d+)")
DRAFTED = re.compile(r"n_drafted\s*=\s*(\d+)")


@dataclass(frozen=True)
class System:
    """One of ours and llama.cpp's counterpart: its program and arguments ({draft}: the draft file)."""

    name: str
    spec_types: tuple[str, ...]
    program: str
    arguments: tuple[str, ...]


SPEC_SIMPLE = "llama-speculative-simple"
SYSTEMS = (
    System(
        "plain",
        (),
        SPEC_SIMPLE,
        ("--spec-type", "ngram-mod", "--spec-ngram-mod-n-min", "0", "--spec-ngram-mod-n-max", "0"),
    ),
    System(
        "draft",
        ("draft",),
        SPEC_SIMPLE,
        (
            "--spec-type",
            "draft-simple",
            "-md",
            "{draft}",
            "-td",
            "1",
            "--spec-draft-n-max",
            str(DRAFT.n_max),
            "--spec-draft-p-min",
            str(DRAFT.p_min),
        ),
    ),
    System("ngram-mod", ("ngram-mod",), SPEC_SIMPLE, ("--spec-type", "ngram-mod")),
    System("ngram-simple", ("ngram-simple",), SPEC_SIMPLE, ("--spec-type", "ngram-simple")),
    System("ngram-cache", ("ngram-cache",), "llama-lookup", ("--spec-draft-n-max", str(LOOKUP_DRAFT))),
)
COMPLETION = "llama-completion"


@dataclass
class Tally:
    """Tokens and seconds summed over the prompts of one round; drafted and accepted tokens."""

    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0

    def add(self, tokens: int, seconds: float, drafted: int = 0, accepted: int = 0) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.drafted += drafted
        self.accepted += accepted

    @property
    def rate(self) -> float:
        return self.tokens / self.seconds if self.seconds else 0.0


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


def run_tool(tools: Path, program: str, arguments: list[str], wanted: re.Pattern) -> tuple[str, re.Match]:
    """Run one of llama.cpp's programs: its stdout and stderr together, and the first match of
    `wanted` in them. llama.cpp logs from a thread of its own and can exit before its last
    lines are written (its log.cpp says so), so a run without them is repeated, twice at most."""
    path = tools / program
    if not path.exists():
        raise SpecdecodeError(f"{path} is missing: build llama.cpp's programs with `make llama-tools`")
    for _ in range(3):
        done = subprocess.run([str(path), *arguments], capture_output=True, text=True, errors="replace")
        if done.returncode != 0:
            raise SpecdecodeError(f"{program} failed ({done.returncode}): {done.stderr[-800:]}")
        output = done.stdout + "\n" + done.stderr
        found = wanted.search(output)
        if found is not None:
            return output, found
    raise SpecdecodeError(f"{program} printed no line matching {wanted.pattern!r}: {output[-800:]}")


def generated_text(stdout: str, prompt: str) -> str:
    """What the program printed after echoing the prompt."""
    _, found, rest = stdout.partition(prompt)
    return rest if found else ""


def same_text(ours: str, theirs: str) -> bool:
    """The same continuation, up to the one extra token llama.cpp's examples generate."""
    ours, theirs = ours.rstrip(), theirs.rstrip()
    return theirs.startswith(ours) or ours.startswith(theirs)


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
        "folders", type=Path, nargs="+", help="`specdecode export --engines llama.cpp` outputs"
    )
    parser.add_argument("-n", "--n-predict", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=1, help="alternated rounds (medians)")
    parser.add_argument(
        "--tasks", default="completion,editing,extraction", help="bench tasks, one prompt each"
    )
    parser.add_argument("--systems", help="comma-separated subset of: " + ", ".join(s.name for s in SYSTEMS))
    parser.add_argument("--tools", type=Path, default=DEFAULT_TOOLS, help="folder of llama.cpp's programs")
    args = parser.parse_args()
    systems = SYSTEMS
    if args.systems:
        names = args.systems.split(",")
        systems = tuple(s for s in SYSTEMS if s.name == "plain" or s.name in names)
    prompts = [prompt for task in build_tasks(args.tasks.split(","), 1) for prompt in task.prompts]
    print(
        f"{len(prompts)} prompts ({args.tasks}), -n {args.n_predict}, greedy, 1 thread, "
        f"median of {args.rounds} round(s)"
    )
    for folder in args.folders:
        results, invariant = measure_pair(folder, prompts, args.n_predict, args.rounds, args.tools, systems)
        print_table(str(folder), results, invariant, systems)


if __name__ == "__main__":
    main()
