"""The default model pair the package carries: what runs when no -m is given.

The pair lives in `specdecode/models/target` and `specdecode/models/draft` (Hugging Face
directories, shipped as package data). An installation without them still works with -m/-md;
asked for the defaults, it says how to make a pair with `specdecode train`.
"""

from __future__ import annotations

from pathlib import Path

from specdecode.errors import SpecdecodeError

BUNDLED = Path(__file__).parent / "models"


def bundled_pair() -> tuple[Path, Path]:
    """(target, draft) directories of the bundled pair, or a clear error if it is absent."""
    target, draft = BUNDLED / "target", BUNDLED / "draft"
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        raise SpecdecodeError(
            "no target model given (-m DIR), and this installation carries no default model pair; "
            "pass -m (and -md), or make a pair with `specdecode train tokenizer|target|draft`"
        )
    return target, draft
