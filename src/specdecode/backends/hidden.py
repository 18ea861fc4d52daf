"""Recording a transformers decoder's residual stream with forward pre-hooks.

The hook on decoder layer l sees that layer's input, the residual stream after layers
0..l-1; the hook on the final norm sees the last layer's output before normalisation (the
"layer" n_layers). Hooks are installed on a model once per layer, on first request, and do
nothing unless the running thread opened a `recording`: a model shared by several backends
(forks serving parallel requests) records only for the backend whose forward pass is running,
and a model nobody asked to record runs without any hook at all.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import nn

# layer id -> recorded [B, T, H] input, for the forward pass running in this thread
_SINK: ContextVar[dict[int, torch.Tensor | None] | None] = ContextVar("hidden_sink", default=None)
_HOOKED: weakref.WeakKeyDictionary[nn.Module, set[int]] = weakref.WeakKeyDictionary()


def _decoder(model: nn.Module) -> nn.Module:
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else getattr(model, "model", model)
    if not hasattr(decoder, "layers") or not hasattr(decoder, "norm"):
        raise TypeError(f"{type(model).__name__} has no decoder layers and final norm to record")
    return decoder


def _record(layer: int):
    def hook(module: nn.Module, args: tuple, kwargs: dict) -> None:
        sink = _SINK.get()
        if sink is not None and layer in sink:
            sink[layer] = args[0] if args else kwargs["hidden_states"]

    return hook


def install_hooks(model: nn.Module, layer_ids: Sequence[int]) -> None:
    """Make sure a hook records each of `layer_ids` (0..n_layers) of `model`."""
    decoder = _decoder(model)
    done = _HOOKED.setdefault(model, set())
    n_layers = len(decoder.layers)
    for layer in layer_ids:
        if layer in done:
            continue
        module = decoder.layers[layer] if layer < n_layers else decoder.norm
        module.register_forward_pre_hook(_record(layer), with_kwargs=True)
        done.add(layer)


@contextmanager
def capture(model: nn.Module, layer_ids: Sequence[int]) -> Iterator[dict[int, torch.Tensor | None]]:
    """Within the block, forward passes of `model` in this thread record `layer_ids`; the
    yielded dict maps each id to its last recorded input [B, T, H]."""
    install_hooks(model, layer_ids)
    sink: dict[int, torch.Tensor | None] = dict.fromkeys(layer_ids)
    token = _SINK.set(sink)
    try:
        yield sink
    finally:
        _SINK.reset(token)


def features(sink: dict[int, torch.Tensor | None], layer_ids: Sequence[int]) -> torch.Tensor:
    """The recorded inputs concatenated in `layer_ids` order: [B, T, len(layer_ids) * H]."""
    missing = [layer for layer in layer_ids if sink[layer] is None]
    assert not missing, f"layers {missing} were not recorded (did the forward pass run?)"
    return torch.cat([sink[layer] for layer in layer_ids], dim=-1)


class HiddenRows:
    """Feature rows of one backend's cached positions: [n, len(layer_ids) * H], grown by each
    forward pass, trimmed with the KV cache."""

    def __init__(self, layer_ids: Sequence[int], hidden_size: int) -> None:
        self.layer_ids = list(layer_ids)
        self.width = len(self.layer_ids) * hidden_size
        self._rows: torch.Tensor | None = None  # [capacity, width], allocated on first use
        self._n = 0

    def __len__(self) -> int:
        return self._n

    def extend(self, rows: torch.Tensor) -> None:
        """rows: [T, width] for the next T positions."""
        need = self._n + rows.shape[0]
        if self._rows is None or need > self._rows.shape[0]:
            capacity = max(need, 2 * (self._rows.shape[0] if self._rows is not None else 64))
            grown = torch.empty(capacity, self.width, dtype=rows.dtype, device=rows.device)
            if self._rows is not None:
                grown[: self._n] = self._rows[: self._n]
            self._rows = grown
        self._rows[self._n : need] = rows
        self._n = need

    def truncate(self, n: int) -> None:
        self._n = min(self._n, max(0, n))

    def rows(self, start: int, end: int) -> torch.Tensor:
        """A view of positions start..end-1 (valid until the next extend)."""
        assert 0 <= start <= end <= self._n, (start, end, self._n)
        if self._rows is None:
            return torch.empty(0, self.width)
        return self._rows[start:end]


class HiddenRecorder(HiddenRows):
    """HiddenRows filled by hooks on a transformers model (see `recording`)."""

    def __init__(self, model: nn.Module, layer_ids: Sequence[int], hidden_size: int) -> None:
        super().__init__(layer_ids, hidden_size)
        self.model = model
        install_hooks(model, self.layer_ids)


@contextmanager
def recording(recorder: HiddenRecorder | None) -> Iterator[None]:
    """Around one batch-1 forward pass: its feature rows are appended to `recorder` (no-op for None)."""
    if recorder is None:
        yield
        return
    with capture(recorder.model, recorder.layer_ids) as sink:
        yield
    recorder.extend(features(sink, recorder.layer_ids)[0])
