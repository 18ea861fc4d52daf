"""The training corpus: the Python standard library of the running interpreter.

Why this corpus: it is present wherever Python is, so the shipped models can be retrained
and evaluated anywhere without downloading anything, and it is real, varied Python code.

Selection (`corpus_files`): every ``*.py`` file under the stdlib directory, sorted by its
relative POSIX path, leaving out installed third-party code (``site-packages``), test suites
(any directory named ``test``, ``tests`` or ``idle_test``), ``__pycache__``, files over
1 MB (generated tables, not code anyone writes) and files that are not valid UTF-8.

Held-out split (`split_files`): a file is held out iff
``int(sha1(relative POSIX path).hexdigest(), 16) % 20 == 0`` (about 5%). The decision
depends on the file's path alone, so it is the same on every machine and for every patch
version of Python: a file added by a newer patch release never moves another file across
the split, and a held-out file is never trained on, whichever interpreter trained the model.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from specdecode.errors import SpecdecodeError, read_text_file

EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})
MAX_FILE_BYTES = 1_000_000
HELDOUT_MODULUS = 20  # 1 in 20 files held out
ENCODE_BATCH = 256  # files per batched tokenizer call


def stdlib_root() -> Path:
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    """The corpus's files under `root` (default: the stdlib), sorted by relative POSIX path."""
    root = Path(root) if root is not None else stdlib_root()
    found: list[Path] = []
    for directory, subdirs, names in os.walk(root):
        subdirs[:] = [d for d in subdirs if d not in EXCLUDED_DIRS]  # prune: site-packages is large
        found.extend(
            Path(directory, n) for n in names if n.endswith(".py") and _is_source(Path(directory, n))
        )
    if not found:
        raise SpecdecodeError(f"no Python files under {root}")
    return sorted(found, key=lambda path: path.relative_to(root).as_posix())


def _is_source(path: Path) -> bool:
    try:
        if not path.is_file() or path.stat().st_size > MAX_FILE_BYTES:
            return False
        path.read_bytes().decode("utf-8")
    except (OSError, UnicodeDecodeError):
        return False
    return True


def is_heldout(relative: str) -> bool:
    """The split rule on a relative POSIX path (see the module docstring)."""
    return int(hashlib.sha1(relative.encode("utf-8")).hexdigest(), 16) % HELDOUT_MODULUS == 0


def split_files(files: Sequence[Path], root: Path) -> tuple[list[Path], list[Path]]:
    """(train, heldout), each in the order of `files`."""
    train: list[Path] = []
    heldout: list[Path] = []
    for path in files:
        (heldout if is_heldout(Path(path).relative_to(root).as_posix()) else train).append(path)
    return train, heldout


def encode_files(tokenizer: PreTrainedTokenizerBase, files: Sequence[Path]) -> np.ndarray:
    """One int32 token stream: each file's ids (with the tokenizer's BOS, if it adds one), then EOS."""
    eos = tokenizer.eos_token_id
    if eos is None:
        raise SpecdecodeError("the tokenizer has no EOS token to separate files with")
    pieces: list[np.ndarray] = []
    for start in range(0, len(files), ENCODE_BATCH):
        texts = [read_text_file(path) for path in files[start : start + ENCODE_BATCH]]
        for ids in tokenizer(texts, add_special_tokens=True)["input_ids"]:
            pieces.append(np.asarray([*ids, eos], dtype=np.int32))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int32)
