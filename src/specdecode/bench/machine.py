"""The machine a benchmark ran on, recorded in every result file and summed up above every table,
and the two clocks every benchmark reads.

A figure compares only with figures of the same machine under a like load: the CPU and the
instruction sets that decide which kernels run (AVX-512 BF16 and AMX make bfloat16 passes
cheap), the dtype each model ran in once `--dtype auto` resolved, the threads, the load average
before and after the runs, the date and the commit measured.

On a shared, busy machine wall-clock time also counts the time other processes held the cores;
this process's CPU time (user + system, all its threads) counts only the work done. Tokens per
CPU-second therefore move less with the neighbours' load than tokens per second, though a busy
machine still slows the work itself (shared caches, memory bandwidth, clock speed).
"""

from __future__ import annotations

import datetime
import os
import platform
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from specdecode.local import cpu_info, cpu_model

# The instruction sets that decide which kernels run (oneDNN's bfloat16 needs AVX-512 BF16 or AMX).
CPU_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16", "amx_tile")


@dataclass
class Stopwatch:
    """Wall-clock and CPU seconds from its start: `time.process_time` is this process's user +
    system time over all its threads (torch's included), what getrusage(RUSAGE_SELF) reports."""

    wall: float = field(default_factory=time.perf_counter)
    cpu: float = field(default_factory=time.process_time)

    def elapsed(self) -> tuple[float, float]:
        """(wall seconds, CPU seconds) since the start."""
        return time.perf_counter() - self.wall, time.process_time() - self.cpu


class Machine:
    """Made before a benchmark's first run (the load average then), described after its last."""

    def __init__(self) -> None:
        self.load_start = _load_average()
        self.date = datetime.date.today().isoformat()

    def describe(self, dtypes: dict[str, str], device: str = "cpu", **extra: object) -> dict:
        """The machine block of a result file: `dtypes` names the dtype each model ran in (see
        `dtype_of`); `extra` adds what one benchmark alone knows."""
        import torch

        return {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "processor": platform.processor() or platform.machine(),
            "cpu": cpu_model(),
            "cpu_flags": cpu_flags(),
            "bf16": _torch_bf16(),
            "threads": torch.get_num_threads(),
            "device": device,
            "gpu": torch.cuda.get_device_name(device) if device.startswith("cuda") else None,
            "dtypes": dtypes,
            "load_start": self.load_start,
            "load_end": _load_average(),
            "date": self.date,
            "commit": git_commit(),
            **extra,
        }


def dtype_of(model: object) -> str:
    """The dtype a backend's (or a torch module's) weights are in, after `--dtype auto`;
    llama.cpp's are the GGUF file's own types, one per tensor."""
    parameters = getattr(getattr(model, "model", model), "parameters", None)
    if parameters is None:
        return "gguf"
    return str(next(parameters()).dtype).removeprefix("torch.")


def machine_line(machine: dict) -> str:
    """One line of the machine block, to print above a table."""
    flags = machine["cpu_flags"]
    present = " ".join(name for name in CPU_FLAGS if flags.get(name)) or "none of " + "/".join(CPU_FLAGS)
    bf16 = {True: "yes", False: "no", None: "unknown"}[machine["bf16"]]
    where = machine["gpu"] or machine["cpu"]
    dtypes = ", ".join(f"{name} {dtype}" for name, dtype in machine["dtypes"].items()) or "no model"
    load = " → ".join(
        "?" if value is None else f"{value[0]:.2f}" for value in (machine["load_start"], machine["load_end"])
    )
    commit = (machine["commit"] or "no checkout")[:12]
    return (
        f"machine: {where} ({present}; torch bf16: {bf16}), {machine['threads']} thread(s); {dtypes}; "
        f"load {load}; {machine['date']}; commit {commit}"
    )


def cpu_flags() -> dict[str, bool | None]:
    """Whether the CPU has each of `CPU_FLAGS` (None where /proc/cpuinfo is not there to say)."""
    flags = cpu_info().get("flags")
    present = set(flags.split()) if flags is not None else None
    return {name: None if present is None else name in present for name in CPU_FLAGS}


def git_commit() -> str | None:
    """HEAD of the checkout the package runs from; None when it runs from an installed copy
    (its files tracked by no repository, even one that happens to hold the environment)."""
    package = Path(__file__).resolve().parents[1]
    try:
        listed = ["git", "ls-files", "--error-unmatch", "__init__.py"]
        tracked = subprocess.run(listed, cwd=package, capture_output=True, timeout=10)
        if tracked.returncode != 0:
            return None
        head = subprocess.run(
            ["git", "rev-parse", "HEAD"], cwd=package, capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):  # no git, or a stuck one
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() or None


def _torch_bf16() -> bool | None:
    """Whether torch's CPU kernels (oneDNN) do native bfloat16 arithmetic here: the probe
    `--dtype auto` decides by, None where this torch build lacks it."""
    from specdecode.backends.hf import cpu_has_bf16

    try:
        return cpu_has_bf16()
    except (AttributeError, RuntimeError):  # a private call underneath: a torch build may lack it
        return None


def _load_average() -> list[float] | None:
    """The 1, 5 and 15-minute load averages; None where the system keeps none."""
    try:
        return [round(value, 2) for value in os.getloadavg()]
    except OSError:
        return None
