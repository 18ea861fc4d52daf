"""The two published EAGLE-3 layouts, and the two ways their layer ids are counted.

* The original one (EAGLE, SpecForge; what SGLang, TensorRT-LLM and llama.cpp's converter read):
  a Llama config with `"architectures": ["LlamaForCausalLMEagle3"]`, `draft_vocab_size` and
  `eagle_config.eagle_aux_hidden_state_layer_ids`; tensors `fc`, `midlayer.*`, `norm`,
  `lm_head`, `d2t`, `t2d`, optionally `embed_tokens`.
* `speculators` (vLLM's second auto-detected format, the one carrying verifier metadata):
  `speculators_model_type: "eagle3"`, the decoder layer's Llama config nested in
  `transformer_layer_config` (its `vocab_size` is the target's), `speculators_config` with the
  algorithm, `proposal_methods` and the `verifier`; tensors named as above but with
  `layers.0.*` for `midlayer.*`.

Layer ids. vLLM, llama.cpp and SGLang's fallback read id l as the residual-stream input of
target layer l (0: the embedding output, L: the final pre-norm state); that is what the head
here reads. SpecForge's trainer counts "the output of layer X" instead (its default for L
layers is [1, L//2 - 1, L - 4]) and its serving side adds 1; SGLang adds it only when the
first id is 1. `layer_reading` follows the same evidence: the `speculators` layout is read as
vLLM reads it, the original layout as input ids unless its first id is 1, and
`--eagle3-layer-offset` overrides both. A wrong reading does not fail, it only drafts badly,
so the reading is always reported.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specdecode.errors import SpecdecodeError

ORIGINAL = "LlamaForCausalLMEagle3"
SPECULATORS = "speculators"
LAYER_KEYS = ("eagle_aux_hidden_state_layer_ids", "target_layer_ids", "aux_hidden_state_layer_ids")
# Options of either layout that change the head's arithmetic; the head here implements none.
UNSUPPORTED_FLAGS = ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")


def default_layer_ids(n_layers: int) -> tuple[int, int, int]:
    """vLLM's and llama.cpp's choice: a low, a middle and a high layer."""
    return (2, n_layers // 2, n_layers - 3)


@dataclass(frozen=True)
class LayerReading:
    """How a checkpoint's stored layer ids became the layer inputs the head reads."""

    stored: tuple[int, ...] | None
    offset: int
    convention: str  # "input of layer l" or "output of layer l"
    evidence: str

    def ids(self, n_layers: int) -> tuple[int, ...]:
        if self.stored is None:
            return default_layer_ids(n_layers)
        return tuple(layer + self.offset for layer in self.stored)

    def describe(self, n_layers: int) -> str:
        ids = list(self.ids(n_layers))
        if self.stored is None:
            return f"EAGLE-3 head reads target layer inputs {ids} ({self.evidence})"
        return (
            f"EAGLE-3 head layer ids {list(self.stored)} read as {self.convention} (offset "
            f"{self.offset:+d}, {self.evidence}): target layer inputs {ids}"
        )


def layout_of(raw: dict) -> str:
    return SPECULATORS if "speculators_model_type" in raw else ORIGINAL


def layer_reading(raw: dict, override: int | None = None) -> LayerReading:
    """The convention of a config.json's layer ids (see the module docstring)."""
    sources = (raw,) if layout_of(raw) == SPECULATORS else (raw.get("eagle_config") or {}, raw)
    stored = next((src[k] for src in sources for k in LAYER_KEYS if src.get(k) is not None), None)
    stored = tuple(int(x) for x in stored) if stored is not None else None
    if override is not None:
        return LayerReading(stored, override, "given", "--eagle3-layer-offset")
    if stored is None:
        return LayerReading(None, 0, "input of layer l", "none stored: vLLM's and llama.cpp's default")
    if layout_of(raw) == SPECULATORS:
        return LayerReading(stored, 0, "input of layer l", "speculators layout, as vLLM reads it")
    if stored[0] == 1:
        return LayerReading(
            stored, 1, "output of layer l", "first id 1: SpecForge's count, as SGLang reads it"
        )
    return LayerReading(stored, 0, "input of layer l", "as vLLM and llama.cpp read it")


def check_supported(raw: dict, where: str) -> None:
    nested = raw.get("eagle_config") or {}
    used = [flag for flag in UNSUPPORTED_FLAGS if raw.get(flag) or nested.get(flag)]
    if used:
        raise SpecdecodeError(f"{where}: this head uses {', '.join(used)}, which -me does not implement")


def flat_config(raw: dict, where: str) -> dict:
    """A speculators config.json as the original layout's flat Llama config (layer ids apart)."""
    if layout_of(raw) == ORIGINAL:
        return raw
    if raw.get("speculators_model_type") != "eagle3":
        raise SpecdecodeError(
            f"{where}: a speculators model of type {raw.get('speculators_model_type')!r}, not eagle3"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise SpecdecodeError(f"{where}: speculators config.json lacks transformer_layer_config")
    return {
        **layer,
        "draft_vocab_size": raw.get("draft_vocab_size"),
        "target_hidden_size": raw.get("target_hidden_size"),
    }


def original_tensors(tensors: dict[str, torch.Tensor], layout: str) -> dict[str, torch.Tensor]:
    """Tensor names of the original layout, whichever layout stored them."""
    tensors = {name.removeprefix("model."): t for name, t in tensors.items()}
    if layout == SPECULATORS:
        tensors = {_renamed(name, "layers.0.", "midlayer."): t for name, t in tensors.items()}
    return tensors


def speculators_tensors(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {_renamed(name, "midlayer.", "layers.0."): t for name, t in tensors.items()}


def _renamed(name: str, old: str, new: str) -> str:
    return new + name.removeprefix(old) if name.startswith(old) else name
