"""What this installation and machine are, read the same way wherever it matters: the cache
directory everything kept between runs lives under, the package's version, and the CPU.

Standard library only: the command line's parsers, the backends and the benchmarks all read it.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import platform
from pathlib import Path


def cache_dir(name: str) -> Path:
    """$XDG_CACHE_HOME/specdecode/`name` (~/.cache by default): decoded bundled models, GGUF
    tokenizers and pass timings, each under a name of its own."""
    base = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(base) / "specdecode" / name


def package_version() -> str | None:
    """The installed package's version; None when it runs from a source tree never installed."""
    try:
        return importlib.metadata.version("specdecode")
    except importlib.metadata.PackageNotFoundError:
        return None


def cpu_info() -> dict[str, str]:
    """The first processor's fields of /proc/cpuinfo; empty where there is none."""
    fields: dict[str, str] = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if not line.strip() and fields:
                break
            key, _, value = line.partition(":")
            fields.setdefault(key.strip(), value.strip())
    return fields


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), else what `platform` knows."""
    return cpu_info().get("model name") or platform.processor() or platform.machine()
