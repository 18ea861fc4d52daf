"""The GPU check's report: the JSON document and its Markdown, rewritten after every part of
the run (a run cut short leaves what it measured), and the machine block. Apart from the
measurements, which only add rows to it."""

from __future__ import annotations

import json
import platform
import subprocess
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from importlib import metadata
from pathlib import Path
from typing import Any

import torch
import transformers

from specdecode.compare.gpu_setup import TOLERANCE, release


class Report:
    """The JSON document and its Markdown, rewritten after every part of the run."""

    def __init__(self, out: Path, machine: dict, settings: dict) -> None:
        self.out = out
        self.start = time.perf_counter()
        self.data: dict[str, Any] = {"machine": machine, "settings": settings, "notes": [], "sections": {}}
        self.budgets: dict[str, float] = {}
        self.entered: dict[str, float] = {}  # when each section's current entry began
        out.mkdir(parents=True, exist_ok=True)

    def log(self, message: str) -> None:
        print(f"[gpu-check {time.perf_counter() - self.start:6.1f}s] {message}", flush=True)

    def note(self, text: str) -> None:
        if text not in self.data["notes"]:
            self.data["notes"].append(text)
            self.log(f"note: {text}")

    def add(self, section: str, row: dict, table: str = "rows") -> None:
        self.data["sections"][section].setdefault(table, []).append(row)
        self.log(f"{section}: " + ", ".join(f"{key} {cell(value)}" for key, value in row.items()))
        self.write()

    @contextmanager
    def section(self, name: str, budget: float | None = None) -> Iterator[None]:
        """Time a section (its seconds add up over several entries); an error ends the entry,
        not the run."""
        section = self.data["sections"].setdefault(name, {"seconds": 0.0, "errors": [], "skipped": []})
        self.budgets.setdefault(name, float("inf") if budget is None else budget)
        start = self.entered[name] = time.perf_counter()
        try:
            yield
        except Exception as exc:
            self._error(name, name, exc)
        finally:
            section["seconds"] = round(section["seconds"] + time.perf_counter() - start, 2)
            self.write()

    def attempt(
        self, section: str, label: str, work: Callable[..., Any], *args: Any, within: float | None = None
    ) -> Any:
        """work(*args), or None once its error is recorded; skipped (None) when the section's
        budget is spent, or the section has spent `within` seconds (a shape's share of it: less
        important parts give way to the next shape's important ones)."""
        spent = self.data["sections"][section]["seconds"] + time.perf_counter() - self.entered[section]
        limit = min(self.budgets[section], float("inf") if within is None else within)
        if spent > limit:
            self.data["sections"][section]["skipped"].append(label)
            self.log(f"{section}: skipped {label} ({limit:.0f} s of the section are spent)")
            return None
        self.log(f"{section}: {label}")
        try:
            return work(*args)
        except Exception as exc:
            self._error(section, label, exc)
            return None
        finally:
            self.write()

    def _error(self, section: str, label: str, exc: BaseException) -> None:
        text = f"{label}: {type(exc).__name__}: {exc}"
        frames = traceback.format_exception(type(exc), exc, exc.__traceback__)
        self.data["sections"][section]["errors"].append(
            {"where": label, "error": text, "traceback": "".join(frames[-4:])}
        )
        self.log(f"{section}: ERROR {text}")
        release()

    def errors(self) -> int:
        return sum(len(section.get("errors", [])) for section in self.data["sections"].values())

    def write(self) -> None:
        (self.out / "gpu_check.json").write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        (self.out / "gpu_check.md").write_text(markdown(self.data))


def cell(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, list):
        return "; ".join(cell(item) for item in value) or "-"
    if isinstance(value, dict):
        return " ".join(f"{key}={cell(item)}" for key, item in value.items())
    return "-" if value is None else str(value).replace("|", "\\|").replace("\n", " ")


def markdown_table(rows: list[dict]) -> list[str]:
    columns: list[str] = []
    for row in rows:
        columns.extend(key for key in row if key not in columns)
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(cell(row.get(column)) for column in columns) + " |" for row in rows]
    return lines


SPEED_CAPTION = (
    "greedy, end of generation ignored, batch 1 unless said: decode tokens/s = tokens after the first "
    "over the seconds after it (median of the repeats; range min–max), TTFT apart; GB/token read at the "
    "mean context, roofline tokens/s = bandwidth / GB/token, MBU = decode tokens/s / roofline tokens/s "
    "(bandwidth: the table above); x strongest baseline: against the faster of the compiled loop and "
    "static-cache generate; the oracle row is a ceiling (every draft kept), not a speed-up; batch rows: "
    "several sequences sharing each pass, tokens/s of them all, prompts included"
)
# What each table of the Markdown shows, by (section, table).
CAPTIONS = {
    ("exactness", "rows"): "outputs identical to plain generation's; differences: prompt, first differing "
    f"position, plain's top-2 logit margin there (greedy: allowed up to {TOLERANCE:g}x the rounding)",
    ("exactness", "rounding"): "rounding: the largest |logit difference| between rows of a chain, a tree "
    "and a batched pass and the one-row passes of plain generation at the same positions",
    ("models", "rows"): "random-weight models (bfloat16, built on the device)",
    ("passes", "rows"): "median ms of a pass after the cached prefix (first call: where graphs are captured)",
    ("speed", "rows"): SPEED_CAPTION,
    ("speed", "bandwidth"): "memory bandwidth: the datasheet's (what MBU is put against, where the device is "
    "known) and a measured device-to-device copy (bytes read and written over its seconds)",
    ("replay", "calibration"): "calibration: the bundled pair generating for real on the device beside the "
    "replay of its own trace through the same models (decode tokens/s; the gap should be within 5%)",
    ("replay", "rows"): "recorded acceptance replayed at the shapes: every pass a real run makes, the "
    "accept decisions and emitted ids from the trace (replayed tokens/pass must equal the recorded); "
    "x ours plain and x strongest baseline against batch-1 decode tokens/s; predicted: the cost model's",
    ("replay", "batches"): "replayed traces sharing each pass, tokens/s of them all",
    ("exactness", "reduction"): "rows reduced on the device (argmax or top-k) against the whole rows on the "
    "host: rows whose candidates and probabilities are identical, bit for bit (random bfloat16 rows)",
    ("prefill", "rows"): "time to the first token of one long prompt of random ids (prompt tokens: its "
    "length), on an empty cache each run: median of the runs after a warm-up (which grows the cache and "
    "captures the passes), range min–max; ours in a backend whose context holds the prompt",
    ("goals", "rows"): "the plan's targets",
}


def markdown(data: dict) -> str:
    lines = ["# GPU check", "", "| machine | |", "|---|---|"]
    lines += [f"| {key} | {cell(value)} |" for key, value in data["machine"].items()]
    lines += ["", "settings: " + cell(data["settings"]), ""]
    lines += [f"- note: {note}" for note in data["notes"]]
    for name, section in data["sections"].items():
        lines += ["", f"## {name} ({section['seconds']:.1f} s)"]
        for key, value in section.items():
            if key not in ("errors", "skipped") and isinstance(value, list) and value:
                lines += ["", CAPTIONS.get((name, key), key) + ":", "", *markdown_table(value)]
        if section["skipped"]:
            lines += ["", "skipped (time budget): " + ", ".join(section["skipped"])]
        lines += [""] + [f"- ERROR {error['error']}" for error in section["errors"]]
    return "\n".join(lines) + "\n"


def machine(device: torch.device) -> dict:
    info: dict[str, Any] = {"date": datetime.now(timezone.utc).isoformat(timespec="seconds")}
    if device.type == "cuda":
        properties = torch.cuda.get_device_properties(device)
        info["gpu"] = properties.name
        info["gpu memory GiB"] = round(properties.total_memory / 2**30, 1)
    else:
        info["gpu"] = f"none ({device.type}: {platform.processor() or platform.machine()})"
    info["torch"] = torch.__version__
    info["cuda"] = torch.version.cuda
    info["tf32 matmul"] = torch.backends.cuda.matmul.allow_tf32
    info["transformers"] = transformers.__version__
    info["triton"] = package_version("triton")
    info["python"] = platform.python_version()
    info["commit"] = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no")
    info["uncommitted changes"] = None if status is None else bool(status)
    return info


def package_version(name: str) -> str | None:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return None


def git(*args: str) -> str | None:
    """A git command's output in this source tree; None where there is no git or no repository."""
    try:
        done = subprocess.run(
            ["git", *args], cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None
