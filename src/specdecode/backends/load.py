"""Choosing the backend for a model: a Hugging Face directory runs on the native forward where
it can, else transformers'; a GGUF file runs on llama.cpp's kernels where llama-cpp-python is
installed, else it is dequantized into the same PyTorch forwards; a model already in memory
runs as the directory it might have come from would; on a CPU, a Llama-family directory may run
on llama.cpp through a GGUF file written from it once (`specdecode.backends.hf_gguf`).
llama.cpp's module is imported only for a GGUF file or such a directory, and the PyTorch backends
(transformers with them) only for what runs on them, so a GGUF file on llama.cpp starts without
transformers' seconds of imports."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from specdecode.backends.options import LoadOptions
from specdecode.config import BACKENDS
from specdecode.errors import SpecdecodeError

if TYPE_CHECKING:
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    from specdecode.backends.hf import HFBackend
    from specdecode.backends.hf_gguf import Use
    from specdecode.backends.llama_cpp import LlamaCppBackend
    from specdecode.backends.native import NativeBackend

# A Hugging Face Hub id: owner/name, each a letter or digit, then letters, digits, ".", "_" or "-"
HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*")


def load_backend(
    path: str | Path,
    options: LoadOptions = LoadOptions(),
    use: Use = "target",
    progress: Callable[[str], None] | None = None,
) -> HFBackend | LlamaCppBackend:
    """Load a local model with the backend `options.backend` names: "hf" runs transformers'
    forward, "native" the lean Llama-family forward (an error for other models), "llama.cpp"
    llama.cpp's kernels (a GGUF file, or a directory through the GGUF written from it), "auto"
    llama.cpp for a GGUF file where it is installed, for a directory on the CPU where
    `specdecode.backends.hf_gguf` allows it (`use`: what the model is for, which decides whether
    its rows must be invariant), else the native forward where it runs. progress: told before
    a long step that is not loading (a GGUF copy of a directory written: where, how big; a
    tokenizer built; llama.cpp's row probe)."""
    check_backend_name(options.backend)
    path = check_model_path(path)
    if is_gguf(path):
        return _load_gguf(path, options, progress)
    if options.backend in ("auto", "llama.cpp"):
        from specdecode.backends.hf_gguf import load_directory

        return load_directory(path, options, use, load_pytorch, progress)
    return load_pytorch(path, options)


def load_pytorch(path: Path, options: LoadOptions) -> HFBackend:
    """A directory on the native forward where it runs (unless "hf" is asked for), else
    transformers': auto's choice where llama.cpp is not wanted."""
    from specdecode.backends.hf import HFBackend, _check_device, check_model_directory, load_model_config
    from specdecode.backends.native_weights import native_unsupported

    if options.backend == "hf":
        return HFBackend.load(path, options)
    directory = check_model_directory(path)
    reason = native_unsupported(load_model_config(directory))
    if reason is None:
        return native_kind(options.passes, _check_device(options.device)).load(directory, options)
    if options.backend == "native":
        raise SpecdecodeError(f"{directory}: the native backend cannot run this model: {reason}")
    return HFBackend.load(directory, options)


def backend_from_model(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase | None, options: LoadOptions = LoadOptions()
) -> HFBackend:
    """A backend over a transformers model already in memory, chosen as `load_backend` chooses
    one for a directory (native where it runs, else transformers'), without reading any file.
    The model runs where it is and in its own dtype: `options.device` and `options.dtype` are
    for models read from disk."""
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

    if not isinstance(model, PreTrainedModel):
        raise SpecdecodeError(
            f"cannot run a {type(model).__name__}: give a transformers PreTrainedModel "
            "(e.g. from AutoModelForCausalLM.from_pretrained), a local model directory or a GGUF file"
        )
    if tokenizer is None:
        raise SpecdecodeError(f"the loaded {type(model).__name__} needs its tokenizer (tokenizer=...)")
    if not isinstance(tokenizer, PreTrainedTokenizerBase):
        raise SpecdecodeError(
            f"the tokenizer must be a transformers tokenizer (e.g. from AutoTokenizer.from_pretrained), "
            f"not a {type(tokenizer).__name__}"
        )
    if model.get_output_embeddings() is None:
        raise SpecdecodeError(
            f"the {type(model).__name__} is not a causal language model (it has no LM head): "
            "load it with AutoModelForCausalLM"
        )
    check_backend_name(options.backend)
    if options.backend == "llama.cpp":
        raise SpecdecodeError("the llama.cpp backend runs GGUF files, not a model in memory")
    if options.threads:
        torch.set_num_threads(options.threads)
    name = Path(model.name_or_path).name or type(model).__name__
    return _in_memory(model, tokenizer, options, name, Path(name))


def is_gguf(path: str | Path) -> bool:
    """Whether `path` names a GGUF file (by its magic bytes, so any file name works)."""
    path = Path(path)
    if not path.is_file():
        return False
    with path.open("rb") as handle:
        return handle.read(4) == b"GGUF"


def check_backend_name(backend: str) -> None:
    if backend not in BACKENDS:
        raise SpecdecodeError(f"unknown backend {backend!r} (choose from {', '.join(BACKENDS)})")


def check_model_path(path: str | Path) -> Path:
    """The path of a model on disk, or an error saying what is missing (a Hub id: how to get
    it); `specdecode.api.Pipeline.load` asks it of every model before the first one loads."""
    check_not_hub_id(path)
    path = Path(path)
    if not path.exists():
        kind = "GGUF file" if path.suffix.lower() == ".gguf" else "model directory"
        raise SpecdecodeError(f"{kind} not found: {path}")
    return path


def check_not_hub_id(path: str | Path) -> None:
    """Refuse a Hugging Face Hub id (`owner/name`, not on disk) with how to get the model: nothing
    here downloads, and "model directory not found" would not say why."""
    text = str(path)
    if HUB_ID.fullmatch(text) and not Path(text).exists() and not text.endswith(".gguf"):
        raise SpecdecodeError(
            f"{text} is not a local directory or GGUF file: specdecode reads models from disk only; "
            f"download it first, e.g. `huggingface-cli download {text} --local-dir DIR`, and pass DIR"
        )


def _load_gguf(
    path: Path, options: LoadOptions, progress: Callable[[str], None] | None = None
) -> HFBackend | LlamaCppBackend:
    from specdecode.backends import llama_lib
    from specdecode.backends.llama_cpp import LlamaCppBackend

    use_llama_cpp = options.backend == "llama.cpp" or (options.backend == "auto" and llama_lib.available())
    if use_llama_cpp:
        backend = LlamaCppBackend.load(path, options, progress)
        if options.threads:
            # The sampler's PyTorch work between passes keeps to the threads asked for too: split
            # over more, its vocabulary-long vectors cost milliseconds of waiting per token.
            torch.set_num_threads(options.threads)
        return backend
    # Without llama.cpp's runtime: transformers dequantizes the file into a PyTorch model.
    from specdecode.backends.gguf_files import load_gguf_model
    from specdecode.backends.hf import _check_device, _resolve_dtype

    device = _check_device(options.device)
    if options.threads:
        torch.set_num_threads(options.threads)
    dtype = _resolve_dtype(options.dtype, None, device, False)
    model, tokenizer = load_gguf_model(path, dtype, progress=progress)
    return _in_memory(model.to(device), tokenizer, options, path.stem, path)


def _in_memory(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerBase,
    options: LoadOptions,
    name: str,
    where: Path,
) -> HFBackend:
    """The native forward over a model in memory where it runs and `options` allow it, else
    transformers'. where: what the model came from, for messages."""
    from specdecode.backends.hf import HFBackend, check_loaded_model
    from specdecode.backends.native_weights import native_unsupported

    check_loaded_model(model, tokenizer, where)
    reason = native_unsupported(model.config)
    if options.backend == "native" and reason is not None:
        raise SpecdecodeError(f"{where}: the native backend cannot run this model: {reason}")
    device = next(model.parameters()).device
    kind = native_kind(options.passes, device) if reason is None and options.backend != "hf" else HFBackend
    return kind(
        model,
        tokenizer,
        n_ctx=options.n_ctx,
        n_batch=options.n_batch,
        threads=options.threads,
        name=name,
        **kind.pass_options(options),
    )


def native_kind(passes: str, device: torch.device) -> type[NativeBackend]:
    """The native forward's class for a kind of passes ("auto": graph passes on a GPU)."""
    from specdecode.backends.graph import GraphBackend
    from specdecode.backends.native import NativeBackend

    if passes == "invariant" or (passes == "auto" and device.type != "cuda"):
        return NativeBackend
    return GraphBackend


def native_backend(
    model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, *, passes: str = "auto", **options
) -> NativeBackend:
    """The native forward over a model already in memory (see `LoadOptions.passes`)."""
    kind = native_kind(passes, next(model.parameters()).device)
    return kind(model, tokenizer, **options, **kind.pass_options(LoadOptions(passes=passes)))
