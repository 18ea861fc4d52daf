"""How to load one model, for every backend: a module of its own so that the llama.cpp path
reads it without importing transformers (which the PyTorch backends need)."""

from __future__ import annotations

from dataclasses import dataclass

from specdecode.config import PASSES
from specdecode.errors import SpecdecodeError


@dataclass(frozen=True)
class LoadOptions:
    """How to load one model. n_ctx 0 means the model's own maximum context."""

    device: str = "cpu"
    dtype: str = "auto"  # "auto": the stored dtype on a GPU, float32 on the CPU
    threads: int | None = None
    n_ctx: int = 0
    n_batch: int = 512
    backend: str = "auto"  # "auto": llama.cpp, native or "hf", as load_backend chooses
    gpu_layers: int | None = None  # llama.cpp: layers offloaded to the GPU (None: all on a GPU device)
    repack: bool = True  # llama.cpp: repacked (interleaved) CPU weight layouts, its --no-repack
    # native: "invariant" (row-invariant passes), "fixed" or "bucketed" (graph passes, see
    # specdecode.backends.graph); "auto": fixed on a GPU, invariant on the CPU
    passes: str = "auto"

    def __post_init__(self) -> None:
        if self.n_ctx < 0:
            raise SpecdecodeError(f"the context size must be >= 0 (0: the model's own), not {self.n_ctx}")
        if self.n_batch < 1:
            raise SpecdecodeError(f"the batch size must be >= 1, not {self.n_batch}")
        if self.threads is not None and self.threads < 1:
            raise SpecdecodeError(f"the thread count must be >= 1, not {self.threads}")
        if self.gpu_layers is not None and self.gpu_layers < 0:
            raise SpecdecodeError(f"the GPU layer count must be >= 0, not {self.gpu_layers}")
        if self.passes not in PASSES:
            raise SpecdecodeError(f"unknown kind of passes {self.passes!r} (choose from {', '.join(PASSES)})")
