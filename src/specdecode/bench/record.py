"""What `specdecode bench` keeps as it goes: every measured run written the moment it finishes,
so that an interrupted bench (Ctrl-C), a failed one or a killed one leaves what it measured.

In --out, `runs.jsonl` gets one line per measured run, appended and flushed as the run ends
(the raw record: tokens, times and counters), and `results.json` / `results.md` are rewritten
after each run with the table of the runs so far (each file replaced whole, never left half
written), marked partial until the bench ends.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import TextIO

from specdecode.bench.metrics import summarize
from specdecode.bench.report import write_outputs
from specdecode.bench.suite import Measurement
from specdecode.errors import SpecdecodeError

RUNS_FILE = "runs.jsonl"


def run_record(part: str, measurement: Measurement) -> dict:
    """One line of runs.jsonl: which run (part: "suite" or "sweep"), its times and its tokens."""
    m = measurement
    return {
        "part": part,
        "task": m.task,
        "prompt": m.prompt,
        "turn": m.turn,
        "system": m.system,
        "family": m.family,
        "seconds": m.seconds,
        "cpu_seconds": m.cpu_seconds,
        "tokens_per_second": m.tokens_per_second,
        "tokens_per_cpu_second": m.tokens_per_cpu_second,
        "sampled": m.sampled,
        "tokens": m.tokens,
        "stats": m.stats.to_dict() if m.stats is not None else None,
    }


class RunLog:
    """The runs measured so far, kept in memory and on disk as each one finishes.

    `results` is the report's skeleton (settings, machine, systems, tasks), filled with the rows
    of the suite's runs so far each time; `planned`: the suite's measured runs in all."""

    def __init__(self, out_dir: Path, results: dict, header: str, planned: int) -> None:
        self.out_dir = out_dir
        self.results = results
        self.header = header
        self.planned = planned
        self.suite: list[Measurement] = []
        self.sweep: list[Measurement] = []
        self.runs_path = out_dir / RUNS_FILE
        self._file: TextIO | None = None

    def __enter__(self) -> RunLog:
        """Start a fresh runs.jsonl, and replace an earlier bench's results with an empty table:
        --out never mixes two benches."""
        try:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._file = self.runs_path.open("w", encoding="utf-8")
        except OSError as exc:
            raise SpecdecodeError(f"cannot write the results into {self.out_dir}: {exc}") from None
        self.publish()
        return self

    def __exit__(self, *exc_info: object) -> None:
        if self._file is not None:
            self._file.close()

    def recorder(self, part: str) -> Callable[[Measurement], None]:
        """What `run_suite` calls after each measured run of this part ("suite" or "sweep")."""
        return lambda measurement: self.add(part, measurement)

    def add(self, part: str, measurement: Measurement) -> None:
        """Keep one finished run: its line in runs.jsonl now, and the suite's table so far."""
        (self.suite if part == "suite" else self.sweep).append(measurement)
        if self._file is None:
            raise SpecdecodeError("RunLog.add outside its `with` block")
        try:
            self._file.write(json.dumps(run_record(part, measurement)) + "\n")
            self._file.flush()
        except OSError as exc:
            raise SpecdecodeError(f"cannot write {self.runs_path}: {exc}") from None
        if part == "suite":
            self.publish()

    def progress(self) -> dict:
        """How far the suite got: measured runs done and planned."""
        done = len(self.suite)
        return {"complete": done == self.planned, "runs_measured": done, "runs_planned": self.planned}

    def publish(self) -> list[Path]:
        """results.json and results.md of the suite's runs so far (the sweep is reported at the end)."""
        self.results |= {"rows": summarize(self.suite), **self.progress()}
        return write_outputs(self.out_dir, self.results, self.results["rows"], self.partial_header())

    def partial_header(self) -> str:
        """The Markdown header, with a line saying how far a partial table got."""
        progress = self.progress()
        if progress["complete"]:
            return self.header
        return (
            f"{self.header}\n\npartial: {progress['runs_measured']} of {progress['runs_planned']} "
            "measured runs (the bench was stopped or is still running)"
        )
