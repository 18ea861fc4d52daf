"""The default models the package carries: what runs when no -m is given.

The pair lives in `specdecode/models/target` and `specdecode/models/draft` (Hugging Face
directories, shipped as package data), with an EAGLE-3 head for the target in
`specdecode/models/eagle3`. An installation without them still works with -m/-md;
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


def resolve_models(model: Path | None, draft: Path | None) -> tuple[Path, Path | None]:
    """The models to load: as given, or the bundled pair when no target is given (the bundled
    draft fits only the bundled target, so it is never paired with another one)."""
    if model is not None:
        return model, draft
    bundled_target, bundled_draft = bundled_pair()
    return bundled_target, draft or bundled_draft


def bundled_eagle3() -> Path | None:
    head = BUNDLED / "eagle3"
    return head if (head / "config.json").is_file() else None


def resolve_eagle3(model: Path | None, head: Path | None) -> Path | None:
    """The EAGLE-3 head to load when eagle3 is asked for: as given, or the bundled one when the
    bundled target is used (a head fits only the target it was trained for)."""
    if head is not None or model is not None:
        return head
    return bundled_eagle3()
