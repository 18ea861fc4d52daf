"""The element-wise parts of a decoder layer, each one fused kernel, for the graph passes.

Why: between its matrix products a layer runs RMSNorm (about seven float32 element-wise ops),
the rotary embedding of q and k (about five each), SiLU times up and two residual adds, each a
kernel of its own in eager PyTorch. At one or a few rows every one of them costs microseconds
even replayed from a CUDA graph, and together they outweigh the layer's reading of its weights.
`LayerOps` runs each part as one kernel, compiled by Inductor (one Triton kernel on a GPU, one
C++ loop on a CPU), or eagerly with `native`'s very functions.

Compiled kernels and CUDA graphs: the kernels are compiled with `fullgraph=True` and without
`mode="reduce-overhead"`: they make no host synchronisation and no graph of their own, so a
caller captures them inside its own `torch.cuda.graph`. A part is compiled on its first call
(seconds) for that call's row count, and once more on the first call with another row count,
then with the row count as a variable (Dynamo's automatic dynamic shapes): two kernels a part
serve every row count, where one per count would cost seconds for each new bucket of rows. Run
each shape once before capturing it (graph passes warm up before they capture). Every
`LayerOps` compiles functions of its own, so no number of models reaches Dynamo's recompile
limit (8 entries a function), past which a `fullgraph` function raises.

Exactness. With the shapes of a pass fixed (graph passes in fixed mode: every pass the same
rows), every pass runs the same compiled kernel, and a row gets the same bits in every pass
whatever the other rows hold (each kernel works row by row), and their blocking is chosen by
rule, not by timing, so it does not change from run to run either (see `COMPILE_OPTIONS`). A
compiled reduction (the norm's sum of squares) may still add up in another order than eager's,
and a GPU's fast math differs in the last bits: compiled and eager results agree to rounding,
not bit for bit. That is harmless to exactness: plain and speculative decoding run the same
kernels (a row count other than the fixed one may get other kernels, hence other last bits).
"""

from __future__ import annotations

import types
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from specdecode.backends.native import _rms_norm, _rotate

# Inductor options. emulate_precision_casts: round low-precision intermediates (bfloat16,
# float16) where eager rounds them, so a compiled kernel departs from eager only where it must
# (the order of a sum). deterministic: choose a reduction's blocking by rule, never by timing it
# on the device, so that the order of a row's sum (its bits) does not vary from run to run.
COMPILE_OPTIONS = {"emulate_precision_casts": True, "deterministic": True}


def _add_norm(
    x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    x = x + delta
    return x, _rms_norm(x, weight, eps)


def _rotary(
    qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, kv_heads: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """q and k of a fused qkv product [n, (H + 2 KV) * D] rotated as one tensor, laid out
    [H + KV, n, D] so that q [H, n, D] and k [KV, n, D] are contiguous slices of it."""
    rows, dim = cos.shape
    qk = qkv[:, : (heads + kv_heads) * dim].view(rows, heads + kv_heads, dim).transpose(0, 1)
    rotated = _rotate(qk, cos, sin).contiguous()
    return rotated[:heads], rotated[heads:]


def _silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


class LayerOps:
    """A model's layer parts: `rms_norm`, `add_norm`, `rotary`, `silu_mul` (see the module
    docstring). compiled: None for compiled kernels on CUDA and eager ones elsewhere (on a CPU,
    at decoding's row counts, Dynamo's cost per call outweighs the kernels it saves). If compiling
    fails (no C++ compiler, no Triton), it warns once and runs every part eagerly from then on
    (where kernels of other shapes had run compiled, their rows change in the last bits)."""

    def __init__(
        self, heads: int, kv_heads: int, eps: float, device: torch.device, compiled: bool | None = None
    ) -> None:
        self.heads = heads
        self.kv_heads = kv_heads
        self.eps = eps
        self.compiled = torch.device(device).type == "cuda" if compiled is None else compiled
        self._kernels: dict[types.FunctionType, Callable[..., Any]] = {}

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """RMSNorm of x [n, hidden] (in float32, as `native` does), in x's dtype."""
        return self._call(_rms_norm, x, weight, self.eps)

    def add_norm(
        self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The residual add and the norm that follows it: (x + delta, rms_norm(x + delta))."""
        return self._call(_add_norm, x, delta, weight, self.eps)

    def rotary(
        self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """A fused qkv product [n, (H + 2 KV) * D] and the angles of its rows [n, D] -> q
        [H, n, D] and k [KV, n, D] rotated (contiguous, one kernel) and v [KV, n, D] (a view)."""
        rows, dim = cos.shape
        q, k = self._call(_rotary, qkv, cos, sin, self.heads, self.kv_heads)
        v = qkv[:, (self.heads + self.kv_heads) * dim :].view(rows, self.kv_heads, dim).transpose(0, 1)
        return q, k, v

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SiLU(gate) * up of a fused gate/up product [n, 2 * intermediate]."""
        return self._call(_silu_mul, gate_up)

    def _call(self, fn: types.FunctionType, *args: Any) -> Any:
        if not self.compiled:
            return fn(*args)
        try:
            kernel = self._kernels.get(fn)
            if kernel is None:
                kernel = torch.compile(_own_copy(fn), fullgraph=True, options=COMPILE_OPTIONS)
                self._kernels[fn] = kernel
        except Exception as error:  # torch.compile refused outright (platform, Python version)
            return self._fall_back(error, fn, args)
        try:
            return kernel(*args)
        except _compile_errors() as error:  # Dynamo or Inductor failed: the kernel was not built
            return self._fall_back(error, fn, args)

    def _fall_back(self, error: Exception, fn: types.FunctionType, args: tuple[Any, ...]) -> Any:
        self.compiled = False
        self._kernels.clear()
        # One line of the first two: Dynamo's messages say who raised, then what, then advice.
        lines = [line.strip() for line in str(error).splitlines()]
        reason = " ".join([line for line in lines if line and not line.startswith("Set TORCHDYNAMO")][:2])
        warnings.warn(
            f"torch.compile failed ({type(error).__name__}: {reason[:200]}); "
            "the layers' element-wise parts run eagerly (slower, same results within rounding)",
            RuntimeWarning,
            stacklevel=4,
        )
        return fn(*args)


def _own_copy(fn: types.FunctionType) -> types.FunctionType:
    """fn with a code object of its own: Dynamo keeps compiled entries, and counts them against
    its recompile limit, per code object (a new function object over the same code shares them)."""
    return types.FunctionType(
        fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__
    )


def _compile_errors() -> tuple[type[BaseException], ...]:
    """What a compiled call raises when its kernel could not be built (imported only once a
    compiled call has failed: Dynamo is slow to import)."""
    from torch._dynamo.exc import FailOnRecompileLimitHit, TorchDynamoException

    return TorchDynamoException, FailOnRecompileLimitHit
