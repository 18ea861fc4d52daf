"""Pass timings kept across runs: what the adaptive policy timed on a model, reused next time.

Timing the target's passes at load costs seconds to tens of seconds on a large model on a CPU,
every run, for numbers that change only with the model's shape, the backend, the dtype, the
threads, the device and the machine. So they are stored, one small JSON file per such key, in
`$XDG_CACHE_HOME/specdecode/pass-costs/` (~/.cache by default). The policy still learns from the
passes it runs, so a stored timing only has to be a good start; the policy checks it against
a one-row pass timed at load and times everything again where the machine's load has changed
it by more than STALE_FACTOR (`specdecode.costs`). llama.cpp's row-invariance probe keeps its
verdict the same way (`read_value`, `write_value`), under a key of its own.

A model is known by its files (a directory by its config.json and its weight files' names,
sizes and modification times; a GGUF file by its path, size and modification time); a model
in memory, or one whose files cannot be read, is timed every run. A file that is unreadable,
malformed or written for another key is timed again and replaced, never an error; where the
cache cannot be written, the timings are simply not kept. SPECDECODE_NO_PASS_CACHE=1 turns the
cache off.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

from specdecode import local
from specdecode.backends import Backend
from specdecode.errors import SpecdecodeError, write_atomically

WEIGHT_SUFFIXES = (".safetensors", ".bin", ".packed")
FORMAT = 1  # of the stored files: a file of another format is foreign


def cache_dir() -> Path:
    return local.cache_dir("pass-costs")


def enabled() -> bool:
    return os.environ.get("SPECDECODE_NO_PASS_CACHE", "") in ("", "0")


def cache_key(backend: Backend, rows: tuple[int, ...]) -> dict[str, Any] | None:
    """What the timings of `rows`-row passes on `backend` depend on, or None where the model
    cannot be named by its files (then it is timed every run)."""
    model = _model_identity(backend)
    if model is None:
        return None
    weights = getattr(backend, "model", None)
    parameters = getattr(weights, "parameters", None)  # a torch module's (llama.cpp's has none)
    dtype = str(next(parameters()).dtype) if callable(parameters) else None
    return {
        "format": FORMAT,
        "model": model,
        "backend": type(backend).__name__,
        "repack": getattr(weights, "repack", None),  # llama.cpp's weight layouts have kernels of their own
        "kernels": getattr(weights, "kernels", None),  # llama.cpp's libraries and kernel switches
        "dtype": dtype,
        "threads": getattr(backend, "threads", None) or _torch_threads(),
        "device": _device_name(str(getattr(backend, "device", "cpu"))),
        "cpu": local.cpu_model(),
        "version": local.package_version() or "unknown",
        "n_ctx": backend.n_ctx,
        "rows": list(rows),
    }


def read(key: dict[str, Any]) -> dict[int, float] | None:
    """The timings stored under `key` (rows -> seconds), or None where there are none usable."""
    stored = read_value(key, "costs")
    if not isinstance(stored, dict):
        return None
    try:
        costs = {int(rows): float(seconds) for rows, seconds in stored.items()}
    except (TypeError, ValueError):
        return None
    if not costs or any(not math.isfinite(s) or s <= 0 or n not in key["rows"] for n, s in costs.items()):
        return None
    return costs


def write(key: dict[str, Any], costs: dict[int, float]) -> None:
    """Store `costs` under `key` (see `write_value`)."""
    write_value(key, "costs", {str(n): s for n, s in sorted(costs.items())})


def read_value(key: dict[str, Any], field: str) -> Any:
    """What `write_value` stored as `field` under `key`, or None where nothing readable is
    stored for it: the one lookup for whatever is measured once per model and machine
    (llama.cpp's row-invariance probe keeps its verdict here too, under a key of its own)."""
    try:
        stored = json.loads(_path(key).read_text())
    except (OSError, RuntimeError, ValueError):  # RuntimeError: no home directory to find the cache in
        return None
    if not isinstance(stored, dict) or stored.get("key") != key:
        return None
    return stored.get(field)


def write_value(key: dict[str, Any], field: str, value: Any) -> None:
    """Store `value` (JSON) as `field` under `key`, whole or not at all (written beside it,
    then renamed into place, so that a reader never sees half a file); a cache that cannot be
    written is skipped."""
    text = json.dumps({"key": key, field: value}, indent=1)
    try:
        path = _path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomically(path, "pass timings", lambda file: file.write(text.encode()))
    except (OSError, RuntimeError, SpecdecodeError):
        return


def _path(key: dict[str, Any]) -> Path:
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()
    return cache_dir() / f"{digest[:32]}.json"


def _model_identity(backend: Backend) -> dict[str, Any] | None:
    """The files `backend`'s model was read from: their folder and each one's [name, size,
    mtime], a directory's config.json also by its content (it names the shape); None for a
    model not read from files, or files that cannot be read."""
    model = getattr(backend, "model", None)
    gguf = getattr(model, "path", None)  # llama.cpp's model, read from one file
    source = getattr(model, "name_or_path", "") or ""  # the directory transformers read
    if gguf is not None:
        directory, files, config = Path(gguf).parent, [Path(gguf)], None
    elif source and (Path(source) / "config.json").is_file():
        directory, config = Path(source), Path(source) / "config.json"
        files = sorted(p for p in directory.iterdir() if p.suffix in WEIGHT_SUFFIXES and p.is_file())
    else:
        return None
    try:
        return {
            "path": str(directory.resolve()),
            "files": [[path.name, path.stat().st_size, path.stat().st_mtime_ns] for path in files],
            "config": hashlib.sha256(config.read_bytes()).hexdigest() if config is not None else None,
        }
    except OSError:
        return None


def _torch_threads() -> int:
    import torch

    return torch.get_num_threads()


def _device_name(device: str) -> str:
    """The device, a GPU by its model too (a pass's time is the card's)."""
    if not device.startswith("cuda"):
        return device
    import torch

    return f"{device} {torch.cuda.get_device_name(torch.device(device))}"
