"""Running systems over prompts, interleaved, so a noisy machine's drift hits all systems alike.

For each prompt: `warmup` uncounted rounds of every system, then `runs` measured rounds. Each
round runs every system once, in an order rotated by one per round, so no system is always
first after a prompt change (or always last, when the machine is warmest). A quick suite warms
up once, before its first prompt only: one run per system already warms its code paths, and
the warm-up would otherwise double a suite of one measured run per prompt.

A session (a task with follow-up turns) runs whole in each system's place: its turns in order on
one pipeline of that system (`System.session`), each turn's prompt the conversation so far with
the system's own answers in it (each cut at its first end-of-generation token). Exact systems
answer alike, so their prompts stay the same turn after turn; a system that is not exact is
given its own answers, and its later turns' exactness says so.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from specdecode.bench.systems import Run, System
from specdecode.bench.tasks import Task
from specdecode.bench.traces import TraceStep
from specdecode.errors import SpecdecodeError
from specdecode.sampling import SamplingParams
from specdecode.stats import GenerationStats


@dataclass
class Measurement:
    """One measured run of one system on one prompt."""

    task: str
    prompt: int
    system: str
    family: str
    seconds: float
    cpu_seconds: float  # this process's CPU time over the run, all threads
    tokens: list[int]
    stats: GenerationStats | None
    sampled: bool = False  # the task samples (seeded) rather than decoding greedily
    turn: int = 0  # a session's turn
    prompt_ids: list[int] = field(default_factory=list)  # the prompt the run read
    sampling: SamplingParams | None = None
    steps: list[TraceStep] | None = None  # each step's draft and verdict, where recorded

    @property
    def tokens_per_second(self) -> float:
        return len(self.tokens) / self.seconds

    @property
    def tokens_per_cpu_second(self) -> float:
        return len(self.tokens) / self.cpu_seconds


def rounds(systems: Sequence[System], runs: int, warmup: int) -> list[tuple[bool, list[System]]]:
    """(measured?, systems in order) for each round on one prompt."""
    if runs < 1 or warmup < 0:
        raise SpecdecodeError(f"need runs >= 1 and warmup >= 0 (got {runs}, {warmup})")
    plan = [(False, list(systems)) for _ in range(warmup)]
    for r in range(runs):
        shift = r % len(systems)
        plan.append((True, [*systems[shift:], *systems[:shift]]))
    return plan


def warmups(tasks: Sequence[Task], warmup: int, warm_once: bool) -> list[int]:
    """Warm-up rounds before each prompt, in suite order (`warm_once`: before the first only)."""
    counts = [warmup] * sum(len(task.prompts) for task in tasks)
    return counts[:1] + [0 if warm_once else warmup for _ in counts[1:]]


def plan_size(
    tasks: Sequence[Task], n_systems: int, runs: int, warmup: int, warm_once: bool = False
) -> tuple[int, int]:
    """(generations, measured ones) that `run_suite` will run: a session counts each turn."""
    turns = [len(task.turns(i)) for task in tasks for i in range(len(task.prompts))]
    warm = warmups(tasks, warmup, warm_once)
    total = sum(n * n_systems * (w + runs) for n, w in zip(turns, warm, strict=True))
    return total, sum(turns) * n_systems * runs


def run_suite(
    tasks: Sequence[Task],
    systems: Sequence[System],
    encode: Callable[[str], list[int]],
    n_predict: int,
    runs: int,
    warmup: int,
    advance: Callable[[str, Run], None] = lambda label, run: None,
    decode: Callable[[list[int]], str] | None = None,
    record: Callable[[Measurement], None] = lambda measurement: None,
    warm_once: bool = False,
) -> list[Measurement]:
    """Every system on every prompt (or session) of every task; `advance(label, run)` after each
    run (progress), `record(measurement)` after each measured one, as it finishes (so that an
    interrupted suite keeps it); `decode`: an answer's text, for the next turn of a session;
    `warm_once`: warm up before the first prompt only."""
    measurements = []
    warm = iter(warmups(tasks, warmup, warm_once))
    for task in tasks:
        if task.follow_ups and decode is None:
            raise SpecdecodeError(f"the {task.name} task runs sessions: it needs the answers' text")
        for index in range(len(task.prompts)):
            turns, sampling = task.turns(index), task.sampling(index)
            for measured, order in rounds(systems, runs, next(warm)):
                for system in order:
                    step = system.session()
                    conversation: list[str] = []
                    for turn, message in enumerate(turns):
                        conversation.append(message)
                        ids = encode(task.conversation(conversation))
                        run = step(ids, n_predict, sampling)
                        if decode is not None and turn + 1 < len(turns):
                            conversation.append(decode(run.tokens))
                        _check_length(run, n_predict, system.name, task.name, index)
                        label = f"task {task.name} {index + 1}/{len(task.prompts)}, system {system.name}"
                        if len(turns) > 1:
                            label += f", turn {turn + 1}/{len(turns)}"
                        advance(label if measured else f"{label} (warm-up)", run)
                        if measured:
                            measurement = Measurement(
                                task.name,
                                index,
                                system.name,
                                system.family,
                                run.seconds,
                                run.cpu_seconds,
                                run.tokens,
                                run.stats,
                                not sampling.greedy,
                                turn,
                                ids,
                                sampling,
                                run.steps,
                            )
                            measurements.append(measurement)
                            record(measurement)
    return measurements


def _check_length(run: Run, n_predict: int, system: str, task: str, index: int) -> None:
    if len(run.tokens) != n_predict:
        raise SpecdecodeError(
            f"{system} generated {len(run.tokens)} tokens instead of {n_predict} on {task} prompt "
            f"{index + 1} (the context is too small for the prompt and -n)"
        )
