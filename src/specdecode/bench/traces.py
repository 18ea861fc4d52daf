"""Acceptance traces: what each step of a real generation drafted and kept, to replay elsewhere.

Acceptance needs real weights, and the machines where speed matters (a GPU) may be unable to
hold them; the models' shapes are enough there. So a generation is recorded where the real
models run (`specdecode bench --record-traces FILE`) and replayed through models of other
shapes (`specdecode.compare.gpu_replay`): every pass the real run made runs again, and only the
accept decision and the emitted ids come from the trace.

A trace file is JSON Lines. A generation starts with a header line (its "trace" key names it)
and is followed by one line per step of the loop, the prompt's pass first:

    {"trace": "bundled/draft/completion/0/t0.8", "pair": "bundled", "spec": "draft", ...,
     "prompt": [ids], "eog": [ids], "vocab": 8192, "n_predict": 128}
    {"e": [first token]}                                  the prompt's pass
    {"s": "draft", "d": [5, 9, 2], "a": 2, "e": [5, 9, 7]}  a chain: 2 of 3 kept, 7 added
    {"s": "draft", "d": [...], "p": [-1, 0, 0, 1], "a": 2, "k": [0, 3], "e": [...]}  a tree
    {"e": [4]}                                            a step that drafted nothing

s: the strategy that drafted; d: the draft's tokens; p: a tree's parents (-1: the root; absent
for a chain); a: how many were kept; k: a tree's accepted path (node indices); e: the tokens
the step emitted (a + 1, fewer where end of generation stopped it).

A header recorded by the bench (`TraceRecorder`) also holds "system" (the bench's name of it),
"spec" (its strategies, comma-separated; "none" for plain), "tree", "policy", the drafting
settings of a model that drafts ("draft_n_max", "draft_n_min", "draft_p_min"; a draft tree's
"draft_n_parallel" and "draft_p_split", an EAGLE-3 tree's "draft_tree_tokens" and
"draft_tree_topk"), "task", "prompt_index", "turn",
"temperature" (0: greedy), "seed" and the other sampling settings when sampled, "n_predict"
and "verify".
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TextIO

from specdecode.drafts import Draft
from specdecode.errors import SpecdecodeError
from specdecode.generate import Generation
from specdecode.sampling import SamplingParams
from specdecode.verify import Verdict


@dataclass
class TraceStep:
    """One step: what was drafted (nothing: a plain step, or the prompt's pass) and kept."""

    emitted: list[int]
    strategy: str | None = None
    draft: list[int] = field(default_factory=list)
    parents: list[int] | None = None  # a tree's; None for a chain
    accepted: int = 0
    path: list[int] | None = None  # a tree's accepted nodes, root first

    @property
    def drafted(self) -> bool:
        return bool(self.draft)

    def to_draft(self) -> Draft:
        """The Draft this step verified (its tokens in the recorded vocabulary)."""
        return Draft(list(self.draft), parents=None if self.parents is None else list(self.parents))

    def line(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        if self.draft:
            out.update(s=self.strategy, d=self.draft)
            if self.parents is not None:
                out.update(p=self.parents, k=self.path or [])
            out["a"] = self.accepted
        out["e"] = self.emitted
        return out

    @classmethod
    def from_line(cls, line: dict[str, Any]) -> TraceStep:
        """A step line, checked: ids are integers, at least one token emitted, no more kept
        than drafted, a tree's parents one per node and its path inside it."""
        parents = line.get("p")
        step = cls(
            emitted=_ids(line["e"], "e"),
            strategy=line.get("s"),
            draft=_ids(line.get("d", []), "d"),
            parents=None if parents is None else _ids(parents, "p"),
            accepted=_ids([line.get("a", 0)], "a")[0],
            path=None if parents is None else _ids(line.get("k", []), "k"),
        )
        if not step.emitted or not 0 <= step.accepted <= len(step.draft):
            raise SpecdecodeError("a step emits at least one token and keeps at most what it drafted")
        if step.draft and not isinstance(step.strategy, str):
            raise SpecdecodeError("a drafted step names its strategy (s)")
        if step.parents is not None:
            n = len(step.draft)
            if len(step.parents) != n or len(step.path or []) != step.accepted:
                raise SpecdecodeError("a tree has one parent per node and an accepted path of a nodes")
            if not all(-1 <= parent < n for parent in step.parents) or not all(
                0 <= k < n for k in step.path or []
            ):
                raise SpecdecodeError("a tree's parents and path name its nodes")
        return step


@dataclass
class Trace:
    """One recorded generation: its header (which models, strategy, task, sampling) and steps."""

    name: str
    prompt: list[int]
    vocab: int  # the recorded target's vocabulary size
    eog: list[int] = field(default_factory=list)  # its end-of-generation ids
    steps: list[TraceStep] = field(default_factory=list)
    meta: dict[str, Any] = field(default_factory=dict)  # pair, spec, task, temperature, seed, ...

    @property
    def tokens(self) -> list[int]:
        """Every emitted token, in order."""
        return [token for step in self.steps for token in step.emitted]

    @property
    def n_passes(self) -> int:
        """Target passes after the prompt's: one per step."""
        return max(0, len(self.steps) - 1)

    @property
    def tokens_per_pass(self) -> float:
        """Tokens per target pass after the prompt's, as `GenerationStats.tokens_per_pass`."""
        after = sum(len(step.emitted) for step in self.steps[1:])
        return after / self.n_passes if self.n_passes else 0.0

    def header(self) -> dict[str, Any]:
        return {"trace": self.name, **self.meta, "vocab": self.vocab, "eog": self.eog, "prompt": self.prompt}


def record_steps(generation: Generation) -> list[TraceStep]:
    """Start recording `generation`'s steps (before it runs): the list fills as it runs."""
    steps: list[TraceStep] = []

    def on_step(draft: Draft, verdict: Verdict) -> None:
        tree = not draft.is_chain
        steps.append(
            TraceStep(
                emitted=list(verdict.emitted),
                strategy=draft.strategy if draft.tokens else None,
                draft=list(draft.tokens),
                parents=draft.parent_list() if tree else None,
                accepted=len(verdict.path),
                path=list(verdict.path) if tree else None,
            )
        )

    generation.on_step = on_step
    return steps


def write_traces(out: TextIO, traces: Iterable[Trace]) -> None:
    for trace in traces:
        out.write(json.dumps(trace.header(), separators=(",", ":")) + "\n")
        for step in trace.steps:
            out.write(json.dumps(step.line(), separators=(",", ":")) + "\n")
    out.flush()


def read_traces(path: Path) -> list[Trace]:
    """Every trace in a file (gzip-compressed where its name ends in .gz), with a clear error
    for a line that is not one."""
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    return list(parse_traces(text.splitlines(), str(path)))


def parse_traces(lines: Iterable[str], where: str = "traces") -> Iterator[Trace]:
    trace: Trace | None = None
    for number, text in enumerate(lines, 1):
        if not text.strip():
            continue
        try:
            line = json.loads(text)
            if not isinstance(line, dict):
                raise SpecdecodeError("a line is a JSON object")
            if "trace" in line:
                if trace is not None:
                    yield trace
                meta = {k: v for k, v in line.items() if k not in ("trace", "prompt", "vocab", "eog")}
                vocab = _ids([line["vocab"]], "vocab")[0]
                if not isinstance(line["trace"], str) or vocab < 1:
                    raise SpecdecodeError("a header names its trace and a vocabulary of at least one id")
                trace = Trace(
                    line["trace"], _ids(line["prompt"], "prompt"), vocab, _ids(line["eog"], "eog"), meta=meta
                )
            elif trace is None:
                raise SpecdecodeError("a step before any trace header")
            else:
                trace.steps.append(TraceStep.from_line(line))
        except (ValueError, KeyError, TypeError, SpecdecodeError) as exc:
            raise SpecdecodeError(f"{where}:{number}: not a trace line ({exc})") from exc
    if trace is not None:
        yield trace


def _ids(value: Any, key: str) -> list[int]:
    """A list of token ids (integers), or an error naming the key."""
    if not isinstance(value, list) or not all(isinstance(i, int) and not isinstance(i, bool) for i in value):
        raise SpecdecodeError(f"{key}: not a list of integers")
    return list(value)


def mapped_ids(ids: Sequence[int], trace: Trace, vocab: int, eog_id: int) -> list[int]:
    """The trace's ids in a model of `vocab` ids whose end of generation is `eog_id`: the
    recorded end-of-generation ids become it, every other id a stable id other than it (equal
    ids stay equal, so the n-gram strategies find the recorded repeats)."""
    eog = set(trace.eog)
    usable = vocab - 1
    return [eog_id if token in eog else (token % usable) + (token % usable >= eog_id) for token in ids]


def check_trace_file(path: Path) -> None:
    """A clear error for a trace file that cannot be written where it is named."""
    if not path.parent.is_dir():
        raise SpecdecodeError(f"--record-traces {path}: the directory {path.parent} does not exist")
    if path.is_dir():
        raise SpecdecodeError(f"--record-traces {path}: a directory, not a file")


def open_traces(path: Path) -> TextIO:
    """A trace file opened to append to (`bench --record-traces`), or a clear error."""
    check_trace_file(path)
    try:
        return path.open("a", encoding="utf-8")
    except OSError as exc:
        raise SpecdecodeError(f"cannot write the traces into {path}: {exc}") from None


class MeasuredRun(Protocol):
    """What a trace is made of: a measured run of the bench (`specdecode.bench.suite.Measurement`)."""

    task: str
    prompt: int  # the prompt's index in its task
    system: str
    turn: int
    tokens: list[int]
    prompt_ids: list[int]
    sampling: SamplingParams | None
    steps: list[TraceStep] | None


class TraceRecorder:
    """`specdecode bench --record-traces FILE`: a trace of every measured run of ours that kept
    its steps, appended to FILE and flushed as the run ends (an interrupted bench keeps what it
    recorded). One trace per name: a system's later measured runs of a prompt (greedy, or
    sampled with the prompt's seed) repeat its first.

    pair: the models' short name; vocab, eog: the target's vocabulary size and end-of-generation
    ids; systems: per system name, what its header says beyond the run's own facts (its
    strategies as "spec", "tree", its drafting settings); sessions: the tasks whose prompts have
    several turns (their traces' names end in the turn)."""

    def __init__(
        self,
        out: TextIO,
        pair: str,
        vocab: int,
        eog: Iterable[int],
        systems: dict[str, dict[str, Any]],
        sessions: Iterable[str] = (),
    ) -> None:
        self.out = out
        self.pair = pair
        self.vocab = vocab
        self.eog = sorted(eog)
        self.systems = systems
        self.sessions = set(sessions)
        self.written: set[str] = set()

    def trace(self, m: MeasuredRun) -> Trace:
        """The trace of one measured run, named {pair}/{system}/{task}/{prompt}/t{temperature}
        (and /turn{n} for a session's turns)."""
        sampling = m.sampling
        temperature = 0.0 if sampling is None or sampling.greedy else float(sampling.temperature)
        name = f"{self.pair}/{m.system}/{m.task}/{m.prompt}/t{temperature:g}"
        if m.task in self.sessions:
            name += f"/turn{m.turn}"
        meta: dict[str, Any] = {"pair": self.pair, "system": m.system, **self.systems.get(m.system, {})}
        meta |= {"task": m.task, "prompt_index": m.prompt, "turn": m.turn, "temperature": temperature}
        meta["seed"] = None if not temperature or sampling is None else sampling.seed
        if temperature and sampling is not None:
            meta |= {"top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p}
        meta |= {"n_predict": len(m.tokens), "verify": "match"}
        return Trace(name, list(m.prompt_ids), self.vocab, self.eog, list(m.steps or []), meta)

    def add(self, m: MeasuredRun) -> None:
        """Write one measured run's trace (runs of other families, or without steps: none)."""
        if m.steps is None:
            return
        trace = self.trace(m)
        if trace.name in self.written:
            return
        if trace.tokens != list(m.tokens):
            raise SpecdecodeError(f"the recorded steps of {trace.name} do not give its tokens")
        try:
            write_traces(self.out, [trace])
        except OSError as exc:
            raise SpecdecodeError(f"cannot write the trace {trace.name}: {exc}") from None
        self.written.add(trace.name)

    def wrap(self, record: Callable[[MeasuredRun], None]) -> Callable[[MeasuredRun], None]:
        """`record`, then this trace's line: what `run_suite` calls after each measured run."""

        def both(m: MeasuredRun) -> None:
            record(m)
            self.add(m)

        return both
