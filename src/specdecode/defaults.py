"""The default models the package carries: what runs when no -m is given.

The pair lives in `specdecode/models/target` and `specdecode/models/draft` (Hugging Face
directories, shipped as package data), with an EAGLE-3 head for the target in
`specdecode/models/eagle3` and a DFlash drafter in `specdecode/models/dflash`. An installation
without them still works with -m/-md; asked for the defaults, it says how to make a pair with
`specdecode train`.

Their weights are stored packed (`model.safetensors.packed`, see
`specdecode.backends.packed_weights`) and the draft's tokenizer.json is the target's, stored
once, so the functions here hand out ordinary directories decoded into the user's cache.
"""

from __future__ import annotations

from pathlib import Path

from specdecode.backends.packed_weights import materialize
from specdecode.errors import SpecdecodeError

BUNDLED = Path(__file__).parent / "models"
SHARED = {"draft": ("tokenizer.json", "target")}  # a file stored once, in the target's directory


def _bundled(role: str) -> Path:
    """A bundled model's directory, decoded, with the file it shares with another model."""
    directory = BUNDLED / role
    extra = {}
    if role in SHARED:
        name, owner = SHARED[role]
        if not (directory / name).is_file() and (BUNDLED / owner / name).is_file():
            extra[name] = BUNDLED / owner / name
    return materialize(directory, extra)


def bundled_pair() -> tuple[Path, Path]:
    """(target, draft) directories of the bundled pair, or a clear error if it is absent."""
    target, draft = BUNDLED / "target", BUNDLED / "draft"
    if not (target / "config.json").is_file() or not (draft / "config.json").is_file():
        raise SpecdecodeError(
            "no target model given (-m DIR), and this installation carries no default model pair; "
            "pass -m (and -md), or make a pair with `specdecode train tokenizer|target|draft`"
        )
    return _bundled("target"), _bundled("draft")


def resolve_models(model: Path | None, draft: Path | None) -> tuple[Path, Path | None]:
    """The models to load: as given, or the bundled pair when no target is given (the bundled
    draft fits only the bundled target, so it is never paired with another one)."""
    if model is not None:
        return model, draft
    bundled_target, bundled_draft = bundled_pair()
    return bundled_target, draft or bundled_draft


def bundled_eagle3() -> Path | None:
    """The bundled EAGLE-3 head's directory, decoded, or None if this installation has none."""
    return _bundled("eagle3") if (BUNDLED / "eagle3" / "config.json").is_file() else None


def bundled_dflash() -> Path | None:
    """The bundled DFlash drafter's directory, decoded, or None if this installation has none."""
    return _bundled("dflash") if (BUNDLED / "dflash" / "config.json").is_file() else None


def resolve_dflash(model: Path | None, drafter: Path | None) -> Path | None:
    """The DFlash drafter to load when dflash is asked for: as given, or the bundled one when the
    bundled target is used (a drafter fits only the target it was trained for)."""
    if drafter is not None or model is not None:
        return drafter
    return bundled_dflash()


def resolve_eagle3(model: Path | None, head: Path | None) -> Path | None:
    """The EAGLE-3 head to load when eagle3 is asked for: as given, or the bundled one when the
    bundled target is used (a head fits only the target it was trained for)."""
    if head is not None or model is not None:
        return head
    return bundled_eagle3()
