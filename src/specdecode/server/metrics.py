"""Server counters in the Prometheus text format (GET /metrics), from GenerationStats.

Generations run in the batch engine's thread, so recording takes a lock. Counters count since start;
gauges (slots busy, requests waiting, resident memory) are read when scraped. Why drafting was
little or held short (`specdecode.verdicts`) is counted by reason, and the reasons in force (the
latest generation's, and what was known at start) are an info metric with their numbers beside.
"""

from __future__ import annotations

import os
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.stats import GenerationStats, SpeculationVerdict
from specdecode.verdicts import merged

if TYPE_CHECKING:
    from specdecode.strategies.suffix import SuffixStore

PREFIX = "specdecode"
OUTCOMES = ("completed", "cancelled", "failed")
TOTALS = {
    "prompt_tokens": "prompt tokens evaluated",
    "generated_tokens": "tokens generated",
    "target_passes": "target forward passes after the prompt",
    "prompt_seconds": "time evaluating prompts",
    "generation_seconds": "time generating after the prompt",
    "draft_seconds": "time drafting",
    "verify_seconds": "time in target verify passes",
}


class Metrics:
    def __init__(self, strategies: Iterable[str], start: Iterable[SpeculationVerdict] = ()) -> None:
        """start: what was known about drafting before any generation (`start_verdicts`)."""
        self._lock = threading.Lock()
        self.start = list(start)
        self.latest: list[SpeculationVerdict] = []  # the last generation's verdicts
        self.verdicts: Counter[str] = Counter()  # generations whose drafting each reason limited
        self.requests: Counter[str] = Counter(dict.fromkeys(OUTCOMES, 0))
        self.totals: Counter[str] = Counter(dict.fromkeys(TOTALS, 0))
        self.drafted: Counter[str] = Counter({name: 0 for name in strategies})
        self.accepted: Counter[str] = Counter({name: 0 for name in strategies})
        self.passes_by_batch: Counter[int] = Counter()  # sequences sharing a pass -> passes
        self.pass_rows = 0
        self.pass_seconds = 0.0

    def record(self, stats: GenerationStats) -> None:
        """A generation that ran (to its end, or stopped because its client left)."""
        outcome = "cancelled" if stats.stop_reason == "abandoned" else "completed"
        with self._lock:
            self.requests[outcome] += 1
            self.totals.update(
                prompt_tokens=stats.n_prompt,
                generated_tokens=stats.n_generated,
                target_passes=stats.n_passes,
                prompt_seconds=stats.t_prompt,
                generation_seconds=stats.t_generation,
                draft_seconds=stats.t_draft,
                verify_seconds=stats.t_verify,
            )
            for strategy in stats.strategies:
                self.drafted[strategy.name] += strategy.counts.n_drafted
                self.accepted[strategy.name] += strategy.counts.n_accepted
            self.verdicts.update(verdict.code for verdict in stats.verdicts)
            if stats.n_passes:  # one that stopped before a step says nothing of drafting
                self.latest = list(stats.verdicts)

    def speculation(self) -> list[SpeculationVerdict]:
        """Why drafting is little or held short now: the latest generation's reasons, then those
        known at start that it did not restate (empty where drafting runs freely)."""
        with self._lock:
            return merged(self.start, self.latest)

    def record_pass(self, sequences: int, rows: int, seconds: float) -> None:
        """A batched decode pass: how many sequences shared it, with how many rows."""
        with self._lock:
            self.passes_by_batch[sequences] += 1
            self.pass_rows += rows
            self.pass_seconds += seconds

    def record_failure(self) -> None:
        """A generation that raised (a server bug: the request got a 500)."""
        with self._lock:
            self.requests["failed"] += 1

    def render(self, slots: int, busy: int, waiting: int, suffix: SuffixStore | None = None) -> str:
        """suffix: the suffix strategy's process-wide store, whose size is reported."""
        with self._lock:
            lines = [
                *_family(
                    "requests_total", "counter", "generations run, by outcome", "outcome", self.requests
                ),
                *_family(
                    "drafted_tokens_total",
                    "counter",
                    "draft tokens proposed, by strategy",
                    "strategy",
                    self.drafted,
                ),
                *_family(
                    "accepted_tokens_total",
                    "counter",
                    "draft tokens accepted, by strategy",
                    "strategy",
                    self.accepted,
                ),
            ]
            for name, help_text in TOTALS.items():
                lines += _family(f"{name}_total", "counter", help_text, "", {"": self.totals[name]})
            lines += _family(
                "batch_passes_total",
                "counter",
                "decode passes, by the number of sequences sharing them",
                "sequences",
                self.passes_by_batch,
            )
            lines += _family(
                "batch_rows_total", "counter", "rows scored in decode passes", "", {"": self.pass_rows}
            )
            passes = sum(self.passes_by_batch.values())
            mean = (
                sum(size * count for size, count in self.passes_by_batch.items()) / passes if passes else 0.0
            )
            lines += _family(
                "batch_size_mean", "gauge", "mean sequences per decode pass", "", {"": round(mean, 4)}
            )
            lines += _family(
                "speculation_verdicts_total",
                "counter",
                "generations whose drafting was little or held short, by reason",
                "code",
                self.verdicts,
            )
            lines += _speculation(merged(self.start, self.latest))
        lines += _family("slots", "gauge", "generation slots (--parallel)", "", {"": slots})
        lines += _family("requests_processing", "gauge", "slots generating now", "", {"": busy})
        lines += _family("requests_waiting", "gauge", "requests queued for a free slot", "", {"": waiting})
        if suffix is not None:
            for name, help_text, value in (
                ("bytes", "memory held by the suffix strategy's store of earlier requests", suffix.nbytes),
                ("tokens", "tokens in the suffix strategy's store", suffix.n_tokens),
                ("requests", "requests in the suffix strategy's store", suffix.n_requests),
            ):
                lines += _family(f"suffix_cache_{name}", "gauge", help_text, "", {"": value})
        memory = resident_memory_bytes()
        if memory is not None:
            lines += [
                "# HELP process_resident_memory_bytes Resident memory size in bytes.",
                "# TYPE process_resident_memory_bytes gauge",
                f"process_resident_memory_bytes {memory}",
            ]
        return "\n".join(lines) + "\n"


def _family(name: str, kind: str, help_text: str, label: str, values: dict) -> list[str]:
    full = f"{PREFIX}_{name}"
    lines = [f"# HELP {full} {help_text}", f"# TYPE {full} {kind}"]
    for key, value in sorted(values.items(), key=lambda item: str(item[0])):
        labels = f'{{{label}="{key}"}}' if label else ""
        lines.append(f"{full}{labels} {value}")
    return lines


def _speculation(verdicts: list[SpeculationVerdict]) -> list[str]:
    """The reasons in force as an info metric (the sentence in a label), and their numbers."""
    info, numbers = f"{PREFIX}_speculation_info", f"{PREFIX}_speculation_number"
    lines = [
        f"# HELP {info} why drafting is little or held short now (none: it runs freely)",
        f"# TYPE {info} gauge",
        *(f'{info}{{code="{v.code}",reason="{_label(v.text)}"}} 1' for v in verdicts),
        f"# HELP {numbers} the measurements behind each reason",
        f"# TYPE {numbers} gauge",
    ]
    for verdict in verdicts:
        lines += [
            f'{numbers}{{code="{verdict.code}",name="{name}"}} {round(value, 4)}'
            for name, value in verdict.numbers.items()
        ]
    return lines


def _label(text: str) -> str:
    """A label value in the text format: backslashes, quotes and line ends escaped."""
    return text.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def resident_memory_bytes() -> int | None:
    """Current resident set size (Linux /proc); None where the system does not expose it."""
    try:
        pages = int(Path("/proc/self/statm").read_text().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * os.sysconf("SC_PAGE_SIZE")
