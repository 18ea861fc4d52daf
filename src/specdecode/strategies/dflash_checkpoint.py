"""DFlash drafters on disk, in z-lab's published layout (the one vLLM and SGLang load too).

`config.json` is a Qwen3 config with `"architectures": ["DFlashDraftModel"]` (the drafter's
num_hidden_layers; hidden_size, the target's) and `dflash_config: {block_size, mask_token_id,
target_layer_ids}` (older files keep those three at the top level). `model.safetensors` holds
`fc.weight`, `hidden_norm.weight`, `norm.weight` and per layer `layers.{i}.self_attn.{q,k,v,o}_proj`
(biases when attention_bias), `self_attn.{q,k}_norm`, `mlp.{gate,up,down}_proj`,
`input_layernorm`, `post_attention_layernorm`. There are no embeddings and no output head: the
target's are used.

z-lab's layer id l names the output of target layer l (their hidden_states[l + 1]), the input of
layer l + 1 in this package's count: reading adds 1, writing subtracts it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from specdecode.backends import Backend, hidden_state_source
from specdecode.errors import SpecdecodeError
from specdecode.strategies.dflash_head import STATIC_ROPE_TYPES, DFlashConfig, DFlashHead

ARCHITECTURE = "DFlashDraftModel"
WEIGHTS = "model.safetensors"
LAYER_OFFSET = 1  # z-lab's id l is the input of layer l + 1
# What z-lab's other drafters add, which the head here does not compute.
UNSUPPORTED_ARCHITECTURES = {
    "DFlash2DraftModel": "its candidate selector and grouped causal convolutions",
}
UNSUPPORTED_KEYS = ("final_logit_softcapping", "output_multiplier", "input_embedding_scale")


def load_head(directory: str | Path, target: Backend) -> DFlashHead:
    """Read a DFlash drafter and check it against `target`; it runs in the target's dtype and
    device, with the target's embeddings and output head. Nothing is kept on an error."""
    directory = Path(directory)
    source = hidden_state_source(target, "a DFlash drafter")
    where = f"DFlash drafter {directory}"
    config_path, weights_path = directory / "config.json", directory / WEIGHTS
    if not config_path.is_file() or not weights_path.is_file():
        raise SpecdecodeError(f"{where}: expected a directory with config.json and {WEIGHTS}")
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecdecodeError(f"{where}: cannot read config.json: {exc}") from None
    if not isinstance(raw, dict):
        raise SpecdecodeError(f"{where}: config.json is not a JSON object")
    config = config_from_json(raw, where, target.vocab.size)
    check_fits(config, source.n_layers, source.hidden_size, target.vocab.size, where)
    try:
        tensors = load_file(weights_path)
    except (OSError, ValueError, SafetensorError) as exc:
        raise SpecdecodeError(f"{where}: cannot read {WEIGHTS}: {exc}") from None
    tensors = {name.removeprefix("model."): t for name, t in tensors.items()}
    shapes = expected_shapes(config)
    missing = sorted(set(shapes) - set(tensors))
    if missing:
        raise SpecdecodeError(f"{where}: tensors missing from {WEIGHTS}: {', '.join(missing)}")
    for name, shape in shapes.items():
        if tuple(tensors[name].shape) != shape:
            raise SpecdecodeError(
                f"{where}: {name} has shape {tuple(tensors[name].shape)}, expected {shape} "
                "(from config.json and the target)"
            )
    extra = sorted(set(tensors) - set(shapes))
    if extra:
        raise SpecdecodeError(
            f"{where}: {WEIGHTS} holds tensors a DFlash drafter does not have: {', '.join(extra[:5])}"
        )
    embeddings, output = source.input_embeddings(), output_matrix(source, where)
    for name, matrix in (("embeddings", embeddings), ("output head", output)):
        if tuple(matrix.shape) != (config.vocab_size, config.hidden_size):
            raise SpecdecodeError(
                f"{where}: the target's {name} have shape {tuple(matrix.shape)}, expected "
                f"{(config.vocab_size, config.hidden_size)}"
            )
    dtype = embeddings.dtype if embeddings.is_floating_point() else torch.float32
    head = DFlashHead(config, embeddings, output).to(device=embeddings.device, dtype=dtype)
    head.load_state_dict({name: tensors[name] for name in shapes}, strict=True)  # cast into `dtype`
    head.layer_note = (
        f"DFlash drafter layer ids {[layer - LAYER_OFFSET for layer in config.target_layer_ids]} read as "
        f"z-lab's outputs of layer l: target layer inputs {list(config.target_layer_ids)}"
    )
    return head.eval().requires_grad_(False)


def output_matrix(source, where: str) -> torch.Tensor:
    """The target's output head [V, H]; a clear error for a backend that cannot give it."""
    if not hasattr(source, "output_embeddings"):
        raise SpecdecodeError(f"{where}: {type(source).__name__} cannot expose the target's output head")
    return source.output_embeddings()


def config_from_json(raw: dict, where: str, vocab_size: int) -> DFlashConfig:
    """The drafter's config from z-lab's config.json (see the module docstring); vocab_size:
    the target's (the drafter uses its embeddings and output head)."""
    architectures = raw.get("architectures") or []
    for name, what in UNSUPPORTED_ARCHITECTURES.items():
        if name in architectures:
            raise SpecdecodeError(f"{where}: {name} is not supported: this drafter cannot compute {what}")
    if "speculators_model_type" in raw:
        raise SpecdecodeError(
            f"{where}: the speculators layout (its own reduced vocabulary and output head) is not "
            f"supported; this drafter reads z-lab's (architectures [{ARCHITECTURE!r}] with dflash_config)"
        )
    dflash = raw.get("dflash_config") if isinstance(raw.get("dflash_config"), dict) else {}

    def value(key: str):
        return dflash.get(key, raw.get(key))

    scaled = [key for key in UNSUPPORTED_KEYS if value(key) not in (None, 1, 1.0, 0, 0.0)]
    if scaled:
        raise SpecdecodeError(f"{where}: this drafter uses {', '.join(scaled)}, which is not implemented")
    try:
        hidden = int(raw["hidden_size"])
        layers = int(raw["num_hidden_layers"])
        heads = int(raw["num_attention_heads"])
        intermediate = int(raw["intermediate_size"])
        stored = [int(layer) for layer in value("target_layer_ids")]
        mask = int(value("mask_token_id"))
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecdecodeError(f"{where}: config.json lacks a usable {exc} (not a DFlash drafter?)") from None
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    scaling = rope.get("rope_type") or rope.get("type") or "default"
    if scaling not in STATIC_ROPE_TYPES:
        raise SpecdecodeError(
            f"{where}: rope_type {scaling!r} is not implemented (only {', '.join(STATIC_ROPE_TYPES)})"
        )
    kinds = layer_types(raw, layers)
    causal = raw.get("is_causal")
    if causal or (causal is None and "sliding_attention" in kinds):
        raise SpecdecodeError(
            f"{where}: its layers attend causally within the block (is_causal, or sliding layers "
            "without is_causal: false), which this drafter does not implement"
        )
    window = raw.get("sliding_window") if "sliding_attention" in kinds else None
    return DFlashConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
        intermediate_size=intermediate,
        target_layer_ids=tuple(layer + LAYER_OFFSET for layer in stored),
        block_size=int(value("block_size") or 16),
        mask_token_id=mask,
        vocab_size=vocab_size,
        head_dim=raw.get("head_dim"),
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
        max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
        attention_bias=bool(raw.get("attention_bias", False)),
        sliding_window=int(window) if window else None,
        sliding_layers=tuple(i for i, kind in enumerate(kinds) if kind == "sliding_attention")
        if window
        else (),
        rope_scaling={key: value for key, value in rope.items() if key != "rope_theta"}
        if scaling != "default"
        else {},
    )


def layer_types(raw: dict, layers: int) -> list[str]:
    """Each layer's attention kind, as Qwen3's config derives it when layer_types is absent."""
    kinds = raw.get("layer_types")
    if kinds:
        return [str(kind) for kind in kinds]
    if raw.get("use_sliding_window") and raw.get("sliding_window"):
        first = int(raw.get("max_window_layers", layers))
        return ["sliding_attention" if i >= first else "full_attention" for i in range(layers)]
    return ["full_attention"] * layers


def config_to_json(config: DFlashConfig) -> dict:
    """z-lab's config.json for `config` (layer ids in their count)."""
    sliding = [
        "sliding_attention" if i in config.sliding_layers else "full_attention"
        for i in range(config.num_hidden_layers)
    ]
    return {
        "architectures": [ARCHITECTURE],
        "model_type": "qwen3",
        "hidden_act": "silu",
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "head_dim": config.dim,
        "num_hidden_layers": config.num_hidden_layers,
        "rms_norm_eps": config.rms_norm_eps,
        "rope_theta": config.rope_theta,
        "rope_parameters": {"rope_type": "default", **config.rope_scaling, "rope_theta": config.rope_theta},
        "max_position_embeddings": config.max_position_embeddings,
        "attention_bias": config.attention_bias,
        "layer_types": sliding,
        "sliding_window": config.sliding_window,
        "use_sliding_window": config.sliding_window is not None,
        "is_causal": False,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "dflash_config": {
            "block_size": config.block_size,
            "mask_token_id": config.mask_token_id,
            "target_layer_ids": [layer - LAYER_OFFSET for layer in config.target_layer_ids],
        },
    }


def check_fits(config: DFlashConfig, n_layers: int, hidden: int, vocab: int, where: str) -> None:
    """One clear error for a drafter made for another target."""
    ids = list(config.target_layer_ids)
    bad = [layer for layer in ids if not 0 <= layer <= n_layers]
    if bad or not ids:
        raise SpecdecodeError(
            f"{where}: the drafter reads the outputs of target layers {[i - LAYER_OFFSET for i in ids]}, "
            f"but the target has layers 0..{n_layers - 1}"
        )
    if config.hidden_size != hidden:
        raise SpecdecodeError(
            f"{where}: the drafter was made for a target of hidden size {config.hidden_size}, "
            f"the target's is {hidden}"
        )
    if not 0 <= config.mask_token_id < vocab:
        raise SpecdecodeError(
            f"{where}: mask_token_id {config.mask_token_id} is not in the target's vocabulary "
            f"(0..{vocab - 1})"
        )
    if config.block_size < 2:
        raise SpecdecodeError(f"{where}: block_size {config.block_size} drafts nothing (at least 2)")
    if config.num_attention_heads % config.num_key_value_heads:
        raise SpecdecodeError(f"{where}: kv heads must divide attention heads")


def expected_shapes(config: DFlashConfig) -> dict[str, tuple[int, ...]]:
    h, d, i = config.hidden_size, config.dim, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    shapes: dict[str, tuple[int, ...]] = {
        "fc.weight": (h, len(config.target_layer_ids) * h),
        "hidden_norm.weight": (h,),
        "norm.weight": (h,),
    }
    for layer in range(config.num_hidden_layers):
        p = f"layers.{layer}."
        projections = {
            "q_proj": (heads * d, h),
            "k_proj": (kv * d, h),
            "v_proj": (kv * d, h),
            "o_proj": (h, heads * d),
        }
        for name, shape in projections.items():
            shapes[f"{p}self_attn.{name}.weight"] = shape
            if config.attention_bias:
                shapes[f"{p}self_attn.{name}.bias"] = (shape[0],)
        shapes[f"{p}self_attn.q_norm.weight"] = (d,)
        shapes[f"{p}self_attn.k_norm.weight"] = (d,)
        shapes[f"{p}mlp.gate_proj.weight"] = (i, h)
        shapes[f"{p}mlp.up_proj.weight"] = (i, h)
        shapes[f"{p}mlp.down_proj.weight"] = (h, i)
        shapes[f"{p}input_layernorm.weight"] = (h,)
        shapes[f"{p}post_attention_layernorm.weight"] = (h,)
    return shapes


def save_head(head: DFlashHead, directory: str | Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """Write z-lab's config.json and model.safetensors (tensors in `dtype`, without the target's
    embeddings and output head)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: value.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, value in head.state_dict().items()
    }
    save_file(tensors, directory / WEIGHTS, metadata={"format": "pt"})
    (directory / "config.json").write_text(json.dumps(config_to_json(head.config), indent=2) + "\n")
    return directory
