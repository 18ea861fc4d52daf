"""The one exception type users see: a clear message, never a traceback."""

from __future__ import annotations

import importlib
from pathlib import Path
from types import ModuleType

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
