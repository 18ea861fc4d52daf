"""The one exception type users see: a clear message, never a traceback."""

from pathlib import Path


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
