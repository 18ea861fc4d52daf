"""llama-cpp-python's library: whether it is installed, its log lines, what decides its kernels,
and the symbols it does not bind.

Apart from the backend (`specdecode.backends.llama_cpp`) because the GGUF quantizer
(`specdecode.backends.gguf_files`) calls into the library too, and the backend reads GGUF files
through that module: both import this one, and it imports neither.
"""

from __future__ import annotations

import ctypes
import os
from pathlib import Path

from specdecode.backends import llama_kernels
from specdecode.errors import SpecdecodeError

_setup_error: str | None = None  # why the chosen library cannot run (told when the backend is asked for)
try:
    LIBRARY = llama_kernels.choose_library()
except SpecdecodeError as exc:  # SPECDECODE_LLAMA_KERNELS names no variant that runs here
    LIBRARY, _setup_error = llama_kernels.Library(None, str(exc)), str(exc)
try:
    with llama_kernels.library_path(LIBRARY.directory):
        import llama_cpp
except ImportError:  # the optional extra
    llama_cpp = None
except (OSError, RuntimeError) as exc:  # llama-cpp-python's loader: a library there does not load
    llama_cpp = None
    _setup_error = (
        f"llama-cpp-python could not load llama.cpp's library from {LIBRARY.directory or 'its package'} "
        f"({LIBRARY.reason}): {exc}; rebuild it (specdecode kernels --build) or run llama-cpp-python's "
        f"own ({llama_kernels.CHOICE_VARIABLE}={llama_kernels.WHEEL})"
    )
VARIANT: str | None = None  # the CPU variant loaded into the chosen build; None: kernels linked in

INSTALL_HINT = "pip install 'specdecode[llama-cpp]'"
# ggml's switch for its tiled K-quant (Q2_K..Q6_K, IQ*) matrix product, which it takes for
# passes of 8 rows and more of weights kept in the file's layout: its sums round a row
# otherwise than the one-row dot product. ggml reads it once per process, at the first product.
TILED_SWITCH = "GGML_CPU_TILED_MM"
_quiet_log = None  # the logging callback, kept alive while llama.cpp may call it


def available() -> bool:
    return llama_cpp is not None


def require_library() -> None:
    if _setup_error is not None:
        raise SpecdecodeError(_setup_error)
    if llama_cpp is None:
        raise SpecdecodeError(f"the llama.cpp backend needs llama-cpp-python: {INSTALL_HINT}")


def library_dir() -> Path:
    """The directory of the libllama llama-cpp-python bound."""
    return Path(llama_cpp.llama_cpp._lib._name).resolve().parent


def kernels() -> dict[str, object]:
    """What decides which kernels llama.cpp runs besides the model and its options: the
    libraries loaded (their names, sizes and modification times: the build of
    `specdecode.backends.llama_kernels`, or LLAMA_CPP_LIB_PATH's), the CPU variant loaded
    into them (None for the wheel's, whose kernels are linked in) and ggml's tiled-product
    switch. Part of the keys of what is measured once and kept (the probe's verdict, pass
    timings)."""
    library = library_dir()
    files = sorted(library.glob("lib*.so*")) + sorted(library.glob("*.dylib")) + sorted(library.glob("*.dll"))
    return {
        "library": str(library),
        "files": [[f.name, f.stat().st_size, f.stat().st_mtime_ns] for f in files],
        "variant": VARIANT,
        "tiled": os.environ.get(TILED_SWITCH),
    }


# llama.cpp's staging API (src/llama-ext.h) for the inputs of a model's layers, which its own
# EAGLE-3 drafting reads: declared without C linkage, so exported under C++ (Itanium) names,
# and not bound by llama-cpp-python. Resolved on first use; a build without them refuses heads.
LAYER_INPUT_SYMBOLS = {
    "set": "_Z30llama_set_embeddings_layer_inpP13llama_contextjb",
    "get": "_Z30llama_get_embeddings_layer_inpP13llama_contextj",
}
_layer_inputs: dict[str, ctypes._CFuncPtr] = {}


def layer_input_api() -> dict[str, ctypes._CFuncPtr]:
    """(set, get) of llama.cpp's layer-input capture, or a clear error where the build lacks them."""
    if not _layer_inputs:
        library = llama_cpp.llama_cpp._lib
        try:
            setter, getter = (library[LAYER_INPUT_SYMBOLS[name]] for name in ("set", "get"))
        except AttributeError:
            raise SpecdecodeError(
                "this llama.cpp build does not export llama_set/get_embeddings_layer_inp, which an "
                "EAGLE-3 head needs to read the target's hidden states (the native backend runs it: "
                'backend="native", --backend native)'
            ) from None
        setter.argtypes, setter.restype = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_bool], None
        getter.argtypes, getter.restype = [ctypes.c_void_p, ctypes.c_uint32], ctypes.POINTER(ctypes.c_float)
        _layer_inputs.update(set=setter, get=getter)
    return _layer_inputs


def silence_logs() -> None:
    """Route llama.cpp's log lines nowhere (load messages on every model otherwise)."""
    global _quiet_log
    if _quiet_log is None:
        _quiet_log = llama_cpp.llama_log_callback(lambda level, text, data: None)
        llama_cpp.llama_log_set(_quiet_log, ctypes.c_void_p(0))


if llama_cpp is not None and _setup_error is None:
    # A build with its CPU kernels in libraries of their own has none registered yet:
    # llama_backend_init would look for them beside the program and in the working directory.
    silence_logs()
    try:
        VARIANT = llama_kernels.load_cpu_backend(library_dir())
    except SpecdecodeError as exc:
        _setup_error = str(exc)
