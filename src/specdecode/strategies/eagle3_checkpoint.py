"""EAGLE-3 heads on disk, in either published layout (see `eagle3_layouts`).

`save_head` writes the original layout: `config.json` (a Llama config with "architectures":
["LlamaForCausalLMEagle3"], `draft_vocab_size`, and the target layers in
`eagle_config.eagle_aux_hidden_state_layer_ids`; `target_hidden_size` when it differs from
`hidden_size`) and `model.safetensors` with `fc.weight`, `midlayer.*` (self_attn q/k/v/o_proj,
mlp gate/up/down_proj, input_layernorm, hidden_norm, post_attention_layernorm), `norm.weight`,
`lm_head.weight`, and `d2t` / `t2d` when the draft vocabulary is reduced. `d2t[i]` is an
offset: draft index i stands for target id i + d2t[i]; `t2d` marks the target ids kept.
`embed_tokens.weight` is optional: without it the head embeds tokens with the target's
embeddings (which requires equal hidden sizes). `load_head` reads that layout and the
`speculators` one.

Layer ids written here name the residual-stream input to target layer l (the last layer's
output before the final norm for l == n_layers), llama.cpp's and vLLM's reading; heads that
name none get [2, L // 2, L - 3]. Read ids go through `eagle3_layouts.layer_reading`.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdecode.backends import Backend, hidden_state_source
from specdecode.errors import SpecdecodeError
from specdecode.strategies.eagle3_head import Eagle3Config, Eagle3Head
from specdecode.strategies.eagle3_layouts import (
    ORIGINAL,
    check_supported,
    flat_config,
    layer_reading,
    layout_of,
    original_tensors,
)

ARCHITECTURE = ORIGINAL
WEIGHTS = "model.safetensors"


def config_from_json(raw: dict, layer_ids: tuple[int, ...], target_hidden: int, where: str) -> Eagle3Config:
    """The head's config from a flat (original-layout) config.json; the target's hidden size fills
    what the file leaves out. layer_ids: the target layer inputs read (`eagle3_layouts.layer_reading`)."""
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        vocab = int(raw["vocab_size"])
        intermediate = int(raw["intermediate_size"])
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecdecodeError(f"{where}: config.json lacks a usable {exc} (not an EAGLE-3 head?)") from None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    return Eagle3Config(
        hidden_size=hidden,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        intermediate_size=intermediate,
        target_hidden_size=int(raw.get("target_hidden_size") or target_hidden),
        target_layer_ids=layer_ids,
        vocab_size=vocab,
        draft_vocab_size=int(raw.get("draft_vocab_size") or vocab),
        head_dim=raw.get("head_dim"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
    )


def config_to_json(config: Eagle3Config) -> dict:
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.dim,
        "num_hidden_layers": 1,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "max_position_embeddings": config.max_position_embeddings,
        "vocab_size": config.vocab_size,
        "draft_vocab_size": config.draft_vocab_size,
        "target_hidden_size": config.target_hidden_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "eagle_config": {
            "eagle_aux_hidden_state_layer_ids": list(config.target_layer_ids),
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": True,
        },
    }


def check_fits(config: Eagle3Config, n_layers: int, hidden: int, vocab: int, where: str) -> None:
    """One clear error for a head made for another target."""
    bad = [layer for layer in config.target_layer_ids if not 0 <= layer <= n_layers]
    if bad or not config.target_layer_ids:
        raise SpecdecodeError(
            f"{where}: the head reads target layers {list(config.target_layer_ids)}, but the target has "
            f"layers 0..{n_layers} ({n_layers} = the last layer's output)"
        )
    if config.target_hidden_size != hidden:
        raise SpecdecodeError(
            f"{where}: the head was made for a target of hidden size {config.target_hidden_size}, "
            f"the target's is {hidden}"
        )
    if config.vocab_size != vocab:
        raise SpecdecodeError(
            f"{where}: the head's vocabulary has {config.vocab_size} ids, the target's {vocab}"
        )
    if not 0 < config.draft_vocab_size <= vocab:
        raise SpecdecodeError(f"{where}: draft_vocab_size {config.draft_vocab_size} is not in 1..{vocab}")
    if (
        config.hidden_size % config.num_attention_heads
        or config.num_attention_heads % config.num_key_value_heads
    ):
        raise SpecdecodeError(f"{where}: heads must divide hidden_size and kv heads must divide heads")


def expected_shapes(config: Eagle3Config) -> dict[str, tuple[int, ...]]:
    h, d, i = config.hidden_size, config.dim, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    shapes = {
        "fc.weight": (h, len(config.target_layer_ids) * config.target_hidden_size),
        "midlayer.self_attn.q_proj.weight": (heads * d, 2 * h),
        "midlayer.self_attn.k_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (kv * d, 2 * h),
        "midlayer.self_attn.o_proj.weight": (h, heads * d),
        "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h),
        "midlayer.mlp.down_proj.weight": (h, i),
        "midlayer.input_layernorm.weight": (h,),
        "midlayer.hidden_norm.weight": (h,),
        "midlayer.post_attention_layernorm.weight": (h,),
        "norm.weight": (h,),
        "lm_head.weight": (config.draft_vocab_size, h),
    }
    if config.draft_vocab_size != config.vocab_size:
        shapes["d2t"] = (config.draft_vocab_size,)
    return shapes


def load_head(directory: str | Path, target: Backend, layer_offset: int | None = None) -> Eagle3Head:
    """Read an EAGLE-3 head in either layout and check it against `target`; it runs in the
    target's dtype and device. layer_offset: added to the stored layer ids instead of the offset
    their convention implies. `head.layer_note` says how the ids were read."""
    directory = Path(directory)
    source = hidden_state_source(target, "an EAGLE-3 head")
    where = f"EAGLE-3 head {directory}"
    config_path, weights_path = directory / "config.json", directory / WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise SpecdecodeError(f"{where}: expected a directory with config.json and {WEIGHTS}")
    try:
        raw = json.loads(config_path.read_text())
        tensors = load_file(weights_path)
    except (OSError, ValueError, SafetensorError) as exc:
        raise SpecdecodeError(f"{where}: cannot read it: {exc}") from None
    if not isinstance(raw, dict):
        raise SpecdecodeError(f"{where}: config.json is not a JSON object")
    check_supported(raw, where)
    reading = layer_reading(raw, layer_offset)
    layer_ids = reading.ids(source.n_layers)
    config = config_from_json(flat_config(raw, where), layer_ids, source.hidden_size, where)
    check_fits(config, source.n_layers, source.hidden_size, target.vocab.size, where)
    tensors = original_tensors(tensors, layout_of(raw))
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise SpecdecodeError(f"{where}: tensors missing from {WEIGHTS}: {', '.join(missing)}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            got = tuple(tensors[name].shape)
            raise SpecdecodeError(
                f"{where}: {name} has shape {got}, expected {shape} (from config.json and the target)"
            )
    embeddings = source.input_embeddings()
    own = tensors.get("embed_tokens.weight")
    if own is None and config.hidden_size != embeddings.shape[1]:
        raise SpecdecodeError(
            f"{where}: the head has no embeddings of its own and its hidden size {config.hidden_size} "
            f"differs from the target's embeddings ({embeddings.shape[1]})"
        )
    if own is not None and tuple(own.shape) != (config.vocab_size, config.hidden_size):
        raise SpecdecodeError(f"{where}: embed_tokens.weight has shape {tuple(own.shape)}")
    head = Eagle3Head(config, embeddings if own is None else None)
    state = {name: tensors[name] for name in shapes if name != "d2t"}
    if own is not None:
        state["embed_tokens.weight"] = own
    state["d2t"] = _absolute_ids(tensors.get("d2t"), config, where)
    head.load_state_dict(state, strict=True)
    head.layer_note = reading.describe(source.n_layers)
    return head.to(device=embeddings.device, dtype=embeddings.dtype).eval().requires_grad_(False)


def _absolute_ids(offsets: torch.Tensor | None, config: Eagle3Config, where: str) -> torch.Tensor:
    index = torch.arange(config.draft_vocab_size)
    if offsets is None:
        return index
    ids = index + offsets.to(torch.long)
    if ids.min() < 0 or ids.max() >= config.vocab_size or len(set(ids.tolist())) != len(ids):
        raise SpecdecodeError(f"{where}: d2t maps draft ids outside the target's vocabulary or twice")
    return ids


def save_head(head: Eagle3Head, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write config.json and model.safetensors (floating tensors in `dtype`)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(head_tensors(head, dtype), directory / WEIGHTS, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config_to_json(head.config), indent=2) + "\n")
    return directory


def head_tensors(head: Eagle3Head, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The original layout's tensors, on the CPU: floating ones in `dtype`, d2t as offsets."""
    config = head.config
    tensors: dict[str, torch.Tensor] = {}
    for name, value in head.state_dict().items():
        if name == "d2t":
            continue
        tensors[name] = value.detach().to(device="cpu", dtype=dtype).contiguous()
    ids = head.d2t.detach().cpu().to(torch.long)
    tensors["d2t"] = ids - torch.arange(len(ids))
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    return tensors
