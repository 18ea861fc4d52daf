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

Real chat models, one target and draft GGUF file each (e.g. Qwen2.5-Coder 1.5B and 0.5B):

    python -m specdecode.bench.llama_tools --target T.gguf --draft D.gguf [-n 64] [--rounds 2]

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
generation-only rate from its stats. The table sums the tasks; a second one gives each
system's tokens per CPU-second and per second task by task, and --json FILE writes both.
--also-no-repack adds our plain and default systems on the weights in the file's layout (`-nr`):
llama.cpp's repacked Q4_K rows are bit-identical only up to a few rows a pass, which caps the
drafts an exact verify may take.
"""

from __future__ import annotations

import argparse
import functools
import json
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

from specdecode import DraftModelConfig, GenerationConfig, Pipeline, SamplingParams
from specdecode.api import BESIDE_A_DRAFT
from specdecode.backends.hf import LoadOptions
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.bench.flags import CHAT_TASKS
from specdecode.bench.machine import Machine, machine_line
from specdecode.bench.systems import build_systems
from specdecode.bench.tasks import build_tasks
from specdecode.chat import ChatPrompt, encode_rendered
from specdecode.errors import SpecdecodeError, read_text_file, write_atomically
from specdecode.strategies import NgramSettings

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
TOOL_TRIES = 10


@dataclass
class Tally:
    """Tokens and wall-clock seconds summed over the prompts of one round; drafted and accepted
    tokens; where measured (the chat runs), CPU and generation-only seconds."""

    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    cpu_seconds: float = 0.0
    generation_seconds: float = 0.0

    def add(
        self,
        tokens: int,
        seconds: float,
        drafted: int = 0,
        accepted: int = 0,
        *,
        cpu_seconds: float = 0.0,
        generation_seconds: float = 0.0,
    ) -> None:
        self.tokens += tokens
        self.seconds += seconds
        self.drafted += drafted
        self.accepted += accepted
        self.cpu_seconds += cpu_seconds
        self.generation_seconds += generation_seconds

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


@dataclass
class ToolRun:
    """One run of one of llama.cpp's programs: its output, and the wall-clock and CPU seconds of
    the whole process (loading included)."""

    output: str
    seconds: float
    cpu_seconds: float


def run_tool(tools: Path, program: str, arguments: list[str], wanted: re.Pattern) -> tuple[str, re.Match]:
    """Run one of llama.cpp's programs: its stdout and stderr together, and the first match of
    `wanted` in them."""
    run, found = timed_tool(tools, program, arguments, wanted)
    return run.output, found


def timed_tool(
    tools: Path, program: str, arguments: list[str], wanted: re.Pattern
) -> tuple[ToolRun, re.Match]:
    """As `run_tool`, with the process's times. llama.cpp logs from a thread of its own and can
    exit before its last lines are written (its log.cpp says so; on a busy machine a short run
    of a tiny model lost them 4 times in 10), so a run without them is repeated, TOOL_TRIES
    times at most."""
    path = tools / program
    if not path.exists():
        raise SpecdecodeError(f"{path} is missing: build llama.cpp's programs with `make llama-tools`")
    for _ in range(TOOL_TRIES):
        before, start = _children_cpu(), time.perf_counter()
        done = subprocess.run([str(path), *arguments], capture_output=True, text=True, errors="replace")
        seconds, cpu_seconds = time.perf_counter() - start, _children_cpu() - before
        if done.returncode != 0:
            raise SpecdecodeError(f"{program} failed ({done.returncode}): {done.stderr[-800:]}")
        output = done.stdout + "\n" + done.stderr
        found = wanted.search(output)
        if found is not None:
            return ToolRun(output, seconds, cpu_seconds), found
    raise SpecdecodeError(f"{program} printed no line matching {wanted.pattern!r}: {output[-800:]}")


def _children_cpu() -> float:
    """User and system CPU seconds of this process's finished children."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


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


CHAT_DRAFTING = ((3, 0.0), (8, 0.5), (16, 0.75))  # llama-speculative-simple's n_max / p_min
# ours: plain, the command line's default with a draft (the adaptive policy over the draft and the
# n-gram strategies asked beside it), and that n-gram chain alone under the classic policy
DEFAULT_WITH_DRAFT = ",".join([*BESIDE_A_DRAFT, "draft"]) + "@adaptive"
OURS_CHAT = ("plain", DEFAULT_WITH_DRAFT, ",".join(BESIDE_A_DRAFT))
PLAIN_CHAT = ("plain", COMPLETION)  # each side's baseline
CHAT_CONTEXT = 4096  # both sides' context: the prompts and -n fit, and no program sizes a 32k cache
PROMPT_LENGTH = re.compile(r"number of tokens in prompt = (\d+)")
COLOUR = re.compile(r"\x1b\[\d+m")
PROMPT_TOKEN = re.compile(r"(\d+) -> '")


def chat_tool_systems() -> tuple[System, ...]:
    """llama.cpp's programs on chat prompts: plain, the draft at each CHAT_DRAFTING setting, lookup."""
    drafting = tuple(
        System(
            f"llama-speculative-simple {n_max}/{p_min:g}",
            ("draft",),
            SPEC_SIMPLE,
            ("--spec-type", "draft-simple", "-md", "{draft}", "-td", "1", *draft_flags(n_max, p_min)),
        )
        for n_max, p_min in CHAT_DRAFTING
    )
    completion = System(COMPLETION, (), COMPLETION, ("-no-cnv", "--no-warmup", "--verbose-prompt"))
    lookup = System(
        "llama-lookup", ("ngram-cache",), "llama-lookup", ("--spec-draft-n-max", str(LOOKUP_DRAFT))
    )
    return (completion, *drafting, lookup)


def draft_flags(n_max: int, p_min: float) -> tuple[str, ...]:
    return ("--spec-draft-n-max", str(n_max), "--spec-draft-p-min", str(p_min))


def tool_arguments(system: System, target: Path, draft: Path, prompt_file: Path, n_predict: int) -> list[str]:
    """The command line of one of llama.cpp's programs: greedy, one thread, the prompt's text as
    written (no escape processing), then the system's own flags."""
    common = [
        "-m",
        str(target),
        "-f",
        str(prompt_file),
        "-n",
        str(n_predict),
        "-t",
        "1",
        "-c",
        str(CHAT_CONTEXT),
    ]
    common += ["--temp", "0", "--seed", "1", "--no-escape"]
    return common + [a.replace("{draft}", str(draft)) for a in system.arguments]


def tool_prompt(text: str, bos: str | None, adds_bos: bool) -> str:
    """The rendered prompt as llama.cpp's programs must get it: they tokenize it with the
    model's special tokens and add BOS where the model asks for one, so a template's own BOS
    text is left out there (else the prompt would start with two)."""
    return text[len(bos) :] if adds_bos and bos and text.startswith(bos) else text


def prompt_tokens(output: str) -> list[int]:
    """The prompt's ids from llama-completion's --verbose-prompt list."""
    length = PROMPT_LENGTH.search(output)
    if length is None:
        raise SpecdecodeError("llama-completion printed no prompt token list (--verbose-prompt)")
    return [int(m[1]) for m in PROMPT_TOKEN.finditer(output, length.end())][: int(length[1])]


def tool_figures(system: System, output: str) -> tuple[int, float, int, int]:
    """Generated tokens, generation-only seconds (llama.cpp's own timings), drafted, accepted."""
    if system.program == COMPLETION:
        evaluated, sampling = EVAL.search(output), SAMPLING.search(output)
        if evaluated is None:
            raise SpecdecodeError(f"{COMPLETION} printed no eval timing")
        seconds = (float(evaluated[1]) + (float(sampling[1]) if sampling else 0.0)) / 1e3
        return int(evaluated[2]), seconds, 0, 0
    decoded, drafted, accepted = DECODED.search(output), DRAFTED.search(output), ACCEPTED.search(output)
    if decoded is None:
        raise SpecdecodeError(f"{system.program} printed no `decoded N tokens` line")
    return (
        int(decoded[1]),
        float(decoded[2]),
        int(drafted[1]) if drafted else 0,
        int(accepted[1]) if accepted else 0,
    )


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
                        pipeline = system.make_pipeline()
                        for backend in backends:
                            backend.truncate(0)
                        wall, cpu = time.perf_counter(), time.process_time()
                        run = pipeline.generate(
                            ids, SamplingParams(temperature=0), GenerationConfig(n_predict)
                        )
                        seconds, cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
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
        "| system | side | tok/s (wall, end to end) | tok/CPU-s | tok/s (generation only) "
        "| × its plain (generation) | accepted/drafted | starts as our plain |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        accepted = f"{row['accepted']}/{row['drafted']}" if row["drafted"] else "-"
        speedup = f"{row['generation_speedup']:.2f}x" if row["generation_speedup"] else "-"
        print(
            f"| {row['system']} | {row['side']} | {row['tokens_per_second']:.1f} | "
            f"{row['tokens_per_cpu_second']:.1f} | {row['generation_tokens_per_second']:.1f} | {speedup} | "
            f"{accepted} | {row['same_as_plain']}/{row['prompts']} |"
        )


def print_task_table(rows_by_task: dict[str, list[dict]], total: list[dict]) -> None:
    """Each system's tokens per CPU-second and per wall-clock second (end to end), task by task
    and over all tasks: a total can hide a task where a system loses."""
    columns = [*rows_by_task, "total"]
    print("\n| system | side | " + " | ".join(f"{c} tok/CPU-s | {c} tok/s" for c in columns) + " |")
    print("|---|---|" + "---|---|" * len(columns))
    by_column = [{row["system"]: row for row in rows} for rows in (*rows_by_task.values(), total)]
    for row in total:
        figures = [rows[row["system"]] for rows in by_column]
        cells = [f"{f['tokens_per_cpu_second']:.1f} | {f['tokens_per_second']:.1f}" for f in figures]
        print(f"| {row['system']} | {row['side']} | " + " | ".join(cells) + " |")


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
