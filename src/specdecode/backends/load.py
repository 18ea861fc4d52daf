"""Choosing the backend for a model directory: the native forward where it runs, else transformers'."""

from __future__ import annotations

from pathlib import Path

from specdecode.backends.hf import HFBackend, LoadOptions, check_model_directory, load_model_config
from specdecode.backends.native import NativeBackend, native_unsupported
from specdecode.errors import SpecdecodeError

BACKENDS = ("auto", "native", "hf")


def load_backend(path: str | Path, options: LoadOptions = LoadOptions()) -> HFBackend:
    """Load a local Hugging Face model with the backend `options.backend` names: "hf" runs
    transformers' forward, "native" the lean Llama-family forward (an error for other models),
    "auto" the native one where it runs."""
    if options.backend not in BACKENDS:
        raise SpecdecodeError(f"unknown backend {options.backend!r} (choose from {', '.join(BACKENDS)})")
    if options.backend == "hf":
        return HFBackend.load(path, options)
    directory = check_model_directory(Path(path))
    reason = native_unsupported(load_model_config(directory))
    if reason is None:
        return NativeBackend.load(directory, options)
    if options.backend == "native":
        raise SpecdecodeError(f"{directory}: the native backend cannot run this model: {reason}")
    return HFBackend.load(directory, options)
