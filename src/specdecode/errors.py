"""The one exception type users see: a clear message, never a traceback."""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import BinaryIO

# The optional packages, by the extra that installs them: the core (generation with any
# strategy on Hugging Face directories) needs none of them, so each is imported only by the
# feature that uses it.
EXTRAS = {
    "grammar": ("llguidance",),
    "gguf": ("gguf", "accelerate"),
    "server": ("fastapi", "starlette", "uvicorn", "pydantic", "jinja2"),
    "bench": ("rich", "matplotlib"),
}


class SpecdecodeError(Exception):
    """Bad input or an impossible request (wrong path, mismatched vocabularies, prompt too long).

    Raised before anything is changed, so the caller's state stays as it was.
    The CLI prints the message and exits with status 2.
    """


def read_text_file(path: str | Path, what: str = "file") -> str:
    """A user's UTF-8 text file, or a SpecdecodeError naming `what` it was meant to be."""
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise SpecdecodeError(f"cannot read the {what} {path}: {exc}") from None


def write_atomically(path: Path, what: str, write: Callable[[BinaryIO], None]) -> None:
    """`write` the file's bytes into a temporary file beside `path`, which replaces `path` only
    once complete (with its permissions kept): on any failure, interruption included, an existing
    file is left as it was and no temporary file remains. what: the file's kind, for errors."""
    try:
        mode = path.stat().st_mode & 0o777 if path.exists() else 0o644
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    except OSError as exc:
        raise SpecdecodeError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as file:
            write(file)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except BaseException as exc:  # interrupted too: never leave the temporary file behind
        Path(tmp).unlink(missing_ok=True)
        if isinstance(exc, OSError):
            raise SpecdecodeError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
        raise


def missing_package(exc: ImportError, feature: str) -> SpecdecodeError | None:
    """What to install for `feature` when `exc` is an optional package not found; None for any
    other import failure (a broken installation keeps its own traceback)."""
    name = (exc.name or "").split(".")[0] if isinstance(exc, ModuleNotFoundError) else ""
    for extra, packages in EXTRAS.items():
        if name in packages:
            return SpecdecodeError(f"{feature} needs the {name} package: pip install 'specdecode[{extra}]'")
    return None


def require(module: str, feature: str) -> ModuleType:
    """`module` imported where `feature` first needs it; without an optional package it needs, a
    SpecdecodeError saying what to install."""
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        error = missing_package(exc, feature)
        if error is None:
            raise
        raise error from None
