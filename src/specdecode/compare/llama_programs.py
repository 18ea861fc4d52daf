"""llama.cpp's own programs as the comparisons run them: which program and flags stand for
each of our systems, running one (timed, retried when its last log lines are lost), and what
its output says (tokens, seconds, drafted and accepted). Apart from the measurements
(`compare.llama_tools`, `compare.llama_chat`), which both use it."""

from __future__ import annotations

import re
import resource
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from specdecode import DraftModelConfig
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
TOOL_TRIES = 10


@dataclass
class Tally:
    """Tokens and wall-clock seconds summed over the prompts of one round; drafted and accepted
    tokens; where measured (the chat runs), CPU and generation-only seconds, and the tokens and
    CPU seconds of the same runs asked for one token (`baseline`): loading, the prompt and the
    first token, which the marginal rate leaves out."""

    tokens: int = 0
    seconds: float = 0.0
    drafted: int = 0
    accepted: int = 0
    cpu_seconds: float = 0.0
    generation_seconds: float = 0.0
    baseline_tokens: int = 0
    baseline_cpu_seconds: float = 0.0

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

    def add_baseline(self, tokens: int, cpu_seconds: float) -> None:
        self.baseline_tokens += tokens
        self.baseline_cpu_seconds += cpu_seconds

    @property
    def marginal_cpu_rate(self) -> float:
        """Tokens per CPU-second of the tokens past the first: what N more tokens cost, as the
        difference between the runs asked for N and for one token, whatever loading costs."""
        cpu = self.cpu_seconds - self.baseline_cpu_seconds
        return (self.tokens - self.baseline_tokens) / cpu if cpu > 0 else 0.0


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


CHAT_DRAFTING = ((3, 0.0), (8, 0.5), (16, 0.75))  # llama-speculative-simple's n_max / p_min
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
