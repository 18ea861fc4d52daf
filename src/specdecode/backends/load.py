"""Choosing the backend for a model: a Hugging Face directory runs on the native forward where
it can, else transformers'; a GGUF file runs on llama.cpp's kernels where llama-cpp-python is
installed, else it is dequantized into the same PyTorch forwards. llama.cpp's module is
imported only for a GGUF file, so loading a directory never looks for llama-cpp-python."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from specdecode.backends.gguf_files import is_gguf, load_gguf_model
from specdecode.backends.graph import GraphBackend
from specdecode.backends.hf import (
    HFBackend,
    LoadOptions,
    _check_device,
    _resolve_dtype,
    check_loaded_model,
    check_model_directory,
    load_model_config,
)
from specdecode.backends.native import NativeBackend, native_unsupported
from specdecode.errors import SpecdecodeError

if TYPE_CHECKING:
    from specdecode.backends.llama_cpp import LlamaCppBackend

BACKENDS = ("auto", "native", "hf", "llama.cpp")


def load_backend(path: str | Path, options: LoadOptions = LoadOptions()) -> HFBackend | LlamaCppBackend:
    """Load a local model with the backend `options.backend` names: "hf" runs transformers'
    forward, "native" the lean Llama-family forward (an error for other models), "llama.cpp"
    llama.cpp's kernels (GGUF files only), "auto" llama.cpp for a GGUF file where it is
    installed, else the native forward where it runs."""
    if options.backend not in BACKENDS:
        raise SpecdecodeError(f"unknown backend {options.backend!r} (choose from {', '.join(BACKENDS)})")
    path = Path(path)
    if is_gguf(path):
        return _load_gguf(path, options)
    if options.backend == "llama.cpp":
        raise SpecdecodeError(f"{path}: the llama.cpp backend runs GGUF files (see `specdecode export`)")
    if options.backend == "hf":
        return HFBackend.load(path, options)
    directory = check_model_directory(path)
    reason = native_unsupported(load_model_config(directory))
    if reason is None:
        return native_kind(options.passes, _check_device(options.device)).load(directory, options)
    if options.backend == "native":
        raise SpecdecodeError(f"{directory}: the native backend cannot run this model: {reason}")
    return HFBackend.load(directory, options)


def _load_gguf(path: Path, options: LoadOptions) -> HFBackend | LlamaCppBackend:
    from specdecode.backends import llama_cpp as llama_cpp_backend

    use_llama_cpp = options.backend == "llama.cpp" or (
        options.backend == "auto" and llama_cpp_backend.available()
    )
    if use_llama_cpp:
        return llama_cpp_backend.LlamaCppBackend.load(path, options)
    # Without llama.cpp's runtime: transformers dequantizes the file into a PyTorch model.
    device = _check_device(options.device)
    if options.threads:
        torch.set_num_threads(options.threads)
    dtype = _resolve_dtype(options.dtype, None, device, False)
    model, tokenizer = load_gguf_model(path, dtype)
    model = model.to(device)
    check_loaded_model(model, tokenizer, path)
    reason = native_unsupported(model.config)
    if options.backend == "native" and reason is not None:
        raise SpecdecodeError(f"{path}: the native backend cannot run this model: {reason}")
    kind = native_kind(options.passes, device) if reason is None and options.backend != "hf" else HFBackend
    return kind(
        model,
        tokenizer,
        n_ctx=options.n_ctx,
        n_batch=options.n_batch,
        threads=options.threads,
        name=path.stem,
        **kind.pass_options(options),
    )


def native_kind(passes: str, device: torch.device) -> type[NativeBackend]:
    """The native forward's class for a kind of passes ("auto": graph passes on a GPU)."""
    if passes == "invariant" or (passes == "auto" and device.type != "cuda"):
        return NativeBackend
    return GraphBackend


def native_backend(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, passes: str = "auto", **options
) -> NativeBackend:
    """The native forward over a model already in memory (see `LoadOptions.passes`)."""
    kind = native_kind(passes, next(model.parameters()).device)
    return kind(model, tokenizer, **options, **kind.pass_options(LoadOptions(passes=passes)))
