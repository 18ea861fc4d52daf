"""MTP layers in a target's own directory: which layout holds them, reading them, writing one.

Layouts read (tensor names as published checkpoints and vLLM's loaders have them; L is the
target's `num_hidden_layers`, config.json says how many MTP layers follow in
`num_nextn_predict_layers`):

* DeepSeek-V3 (also GLM-4.5's): `model.layers.{L}.enorm`, `hnorm`, `eh_proj` [H, 2H] over
  [embedding ; hidden], `shared_head.norm`, optionally `shared_head.head` and `embed_tokens`
  (else the target's), and the decoder layer's own weights under the same prefix.
* MiMo: `model.mtp_layers.{i}.token_layernorm`, `hidden_layernorm`, `input_proj` [H, 2H] over
  [hidden ; embedding], `final_layernorm`, and the decoder layer's weights under the same prefix;
  the target's embeddings and output head.

Only the first MTP layer is read; it is chained for longer drafts, as llama.cpp and vLLM chain
a checkpoint's one layer. Its decoder layer must be a dense Llama/Qwen2 one (q/k/v biases and an
o_proj bias are read where present): a layer with any other tensor is refused, naming it, so
DeepSeek-V3's and GLM-4.5's mixture-of-experts blocks (and DeepSeek's MLA attention) are, and so
is Qwen3-Next's `mtp.*` layer (gated attention, MoE, offset norms). `write_target` writes the
DeepSeek-V3 layout beside a copy of the target's files.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from specdecode.backends import Backend, hidden_state_source
from specdecode.errors import SpecdecodeError
from specdecode.strategies.mtp_head import DEEPSEEK, MIMO, MtpConfig, MtpLayer

INDEX = "model.safetensors.index.json"
MTP_FILE = "mtp.safetensors"  # where `write_target` puts the layer
LAYER_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers")
# The layer's own tensors, by our name -> each layout's name under its prefix.
OWN = {
    DEEPSEEK: {"enorm": "enorm", "hnorm": "hnorm", "eh_proj": "eh_proj", "norm": "shared_head.norm"},
    MIMO: {
        "enorm": "token_layernorm",
        "hnorm": "hidden_layernorm",
        "eh_proj": "input_proj",
        "norm": "final_layernorm",
    },
}
# Names that mark a block this package does not implement (MoE routers and experts, MLA).
MOE_OR_MLA = ("mlp.experts.", "mlp.gate.weight", "mlp.shared_experts.", "q_a_proj", "kv_a_proj_with_mqa")
# Tensors a layer may carry that change nothing here: DeepSeek's copies of the target's output head
# and embeddings (read when present), rotary frequencies.
OPTIONAL = ("shared_head.head.weight", "embed_tokens.weight", "rotary_emb.inv_freq")


def tensor_files(directory: Path) -> dict[str, Path]:
    """Every tensor name of the directory's safetensors -> its file (the index's map when there
    is one, plus any file it does not list)."""
    names: dict[str, Path] = {}
    index = directory / INDEX
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise SpecdecodeError(f"{index}: cannot read its weight_map: {exc}") from None
        names.update({name: directory / file for name, file in weight_map.items()})
    listed = set(names.values())
    for path in sorted(directory.glob("*.safetensors")):
        if path in listed:
            continue
        try:
            with safe_open(path, framework="pt") as handle:
                names.update(dict.fromkeys(handle.keys(), path))
        except (OSError, SafetensorError) as exc:
            raise SpecdecodeError(f"{path}: cannot read it: {exc}") from None
    return names


def read_tensors(files: dict[str, Path], wanted: list[str]) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    for path, names in by_file.items():
        try:
            with safe_open(path, framework="pt") as handle:
                out.update({name: handle.get_tensor(name) for name in names})
        except (OSError, SafetensorError) as exc:
            raise SpecdecodeError(f"{path}: cannot read it: {exc}") from None
    return out


def find_layout(raw: dict, names: set[str], where: str) -> tuple[str, str]:
    """(layout, tensor prefix) of the first MTP layer, or a clear error when there is none."""
    layers = int(raw.get("num_hidden_layers") or 0)
    deepseek, mimo = f"model.layers.{layers}.", "model.mtp_layers.0."
    if f"{deepseek}eh_proj.weight" in names:
        return DEEPSEEK, deepseek
    if f"{mimo}input_proj.weight" in names:
        return MIMO, mimo
    if any(name.startswith("mtp.") for name in names):
        raise SpecdecodeError(
            f"{where}: its MTP layer (mtp.*, Qwen3-Next's layout) is a gated-attention mixture-of-experts "
            "block, which the MTP strategy does not implement (it runs dense Llama/Qwen2 blocks)"
        )
    count = next((raw[key] for key in LAYER_KEYS if raw.get(key)), 0)
    said = f"config.json says {count} MTP layers but " if count else ""
    raise SpecdecodeError(
        f"{where}: the target has no MTP layers ({said}its weights hold neither {deepseek}eh_proj.weight "
        f"(DeepSeek-V3 layout) nor {mimo}input_proj.weight (MiMo layout)); `specdecode train mtp` adds one"
    )


def config_from_target(
    raw: dict, layout: str, names: set[str], prefix: str, vocab: int, where: str
) -> MtpConfig:
    """The block's shape from the target's config.json (the MTP layer shares it); `vocab`: the
    loaded target's vocabulary size."""
    rope = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    try:
        hidden = int(raw["hidden_size"])
        heads = int(raw["num_attention_heads"])
        config = MtpConfig(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=int(raw.get("num_key_value_heads") or heads),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=vocab,
            n_layers=int(raw["num_hidden_layers"]),
            layout=layout,
            head_dim=raw.get("head_dim"),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(raw.get("rope_theta") or rope.get("rope_theta") or 10000.0),
            attention_bias=f"{prefix}self_attn.q_proj.bias" in names,
            output_bias=f"{prefix}self_attn.o_proj.bias" in names,
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise SpecdecodeError(f"{where}: config.json lacks a usable {exc}") from None
    if config.hidden_size % config.num_attention_heads or heads % config.num_key_value_heads:
        raise SpecdecodeError(f"{where}: heads must divide hidden_size and kv heads must divide heads")
    return config


def expected_shapes(config: MtpConfig) -> dict[str, tuple[int, ...]]:
    """Our names (MtpLayer's state_dict) -> shapes."""
    h, d, i = config.hidden_size, config.dim, config.intermediate_size
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    shapes = {
        "enorm.weight": (h,),
        "hnorm.weight": (h,),
        "eh_proj.weight": (h, 2 * h),
        "norm.weight": (h,),
        "block.input_layernorm.weight": (h,),
        "block.self_attn.q_proj.weight": (heads * d, h),
        "block.self_attn.k_proj.weight": (kv * d, h),
        "block.self_attn.v_proj.weight": (kv * d, h),
        "block.self_attn.o_proj.weight": (h, heads * d),
        "block.post_attention_layernorm.weight": (h,),
        "block.mlp.gate_proj.weight": (i, h),
        "block.mlp.up_proj.weight": (i, h),
        "block.mlp.down_proj.weight": (h, i),
    }
    if config.attention_bias:
        shapes |= {
            "block.self_attn.q_proj.bias": (heads * d,),
            "block.self_attn.k_proj.bias": (kv * d,),
            "block.self_attn.v_proj.bias": (kv * d,),
        }
    if config.output_bias:
        shapes["block.self_attn.o_proj.bias"] = (h,)
    return shapes


def check_block(names: set[str], prefix: str, expected: set[str], where: str) -> None:
    """Refuse an MTP layer with tensors the dense block here would leave unused: its
    arithmetic would not be the checkpoint's."""
    unknown = sorted(
        name
        for name in names
        if name.startswith(prefix) and name not in expected and not name.endswith(OPTIONAL)
    )
    if not unknown:
        return
    kind = (
        "mixture-of-experts or MLA; " if any(part in name for name in unknown for part in MOE_OR_MLA) else ""
    )
    shown = ", ".join(name.removeprefix(prefix) for name in unknown[:3]) + (
        ", ..." if len(unknown) > 3 else ""
    )
    raise SpecdecodeError(
        f"{where}: the MTP layer's block architecture is not supported (it has {shown}: {kind}"
        "the MTP strategy runs dense Llama/Qwen2 blocks)"
    )


def stored_name(ours: str, layout: str) -> str:
    """Our name -> the layout's name under its prefix."""
    if ours.startswith("block."):
        return ours.removeprefix("block.")
    part, _, rest = ours.partition(".")
    return f"{OWN[layout][part]}.{rest}"


def has_mtp(directory: str | Path) -> bool:
    """Whether a target directory holds an MTP layer of a layout and block kind this package runs
    (read from the names alone: shapes are checked by `load_mtp`)."""
    directory = Path(directory)
    try:
        raw = json.loads((directory / "config.json").read_text())
        names = set(tensor_files(directory))
        layout, prefix = find_layout(raw, names, str(directory))
        config = config_from_target(raw, layout, names, prefix, 0, str(directory))
        expected = {prefix + stored_name(ours, layout) for ours in expected_shapes(config)}
        check_block(names, prefix, expected, str(directory))
    except (OSError, ValueError, AttributeError, SpecdecodeError):
        return False
    return True


def load_mtp(directory: str | Path, target: Backend) -> MtpLayer:
    """The first MTP layer of the target in `directory` (loaded as `target`), checked against it;
    it runs in the target's dtype and device."""
    directory = Path(directory)
    source = hidden_state_source(target, "the MTP strategy")
    model = getattr(target, "model", None)
    where = f"MTP layers of {directory}"
    if model is None:
        raise SpecdecodeError(f"{where}: the MTP strategy needs the target's weights in memory")
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise SpecdecodeError(
            f"{where}: no config.json (the MTP layers are read from the target's directory)"
        )
    try:
        raw = json.loads(config_path.read_text())
    except (OSError, ValueError) as exc:
        raise SpecdecodeError(f"{where}: cannot read config.json: {exc}") from None
    if not isinstance(raw, dict):
        raise SpecdecodeError(f"{where}: config.json is not a JSON object")
    files = tensor_files(directory)
    names = set(files)
    layout, prefix = find_layout(raw, names, where)
    vocab = target.vocab.size
    config = config_from_target(raw, layout, names, prefix, vocab, where)
    if (config.n_layers, config.hidden_size) != (source.n_layers, source.hidden_size):
        raise SpecdecodeError(
            f"{where}: config.json describes {config.n_layers} layers of size {config.hidden_size}, "
            f"the loaded target has {source.n_layers} of size {source.hidden_size}"
        )
    shapes = expected_shapes(config)
    stored = {ours: prefix + stored_name(ours, layout) for ours in shapes}
    check_block(names, prefix, set(stored.values()), where)
    missing = sorted(name for name in stored.values() if name not in names)
    if missing:
        raise SpecdecodeError(f"{where}: tensors missing: {', '.join(missing)}")
    own_head = f"{prefix}shared_head.head.weight" if layout == DEEPSEEK else None
    own_embeddings = f"{prefix}embed_tokens.weight" if layout == DEEPSEEK else None
    extra = [name for name in (own_head, own_embeddings) if name is not None and name in names]
    tensors = read_tensors(files, [*stored.values(), *extra])
    for ours, name in stored.items():
        if tuple(tensors[name].shape) != shapes[ours]:
            raise SpecdecodeError(
                f"{where}: {name} has shape {tuple(tensors[name].shape)}, expected {shapes[ours]} "
                "(the target's layer shape, from config.json)"
            )
    embeddings = source.input_embeddings()
    head = tensors.get(own_head) if own_head else None
    head = head if head is not None else model.get_output_embeddings().weight
    own = tensors.get(own_embeddings) if own_embeddings else None
    embeddings = own if own is not None else embeddings
    for name, tensor in (("output head", head), ("embeddings", embeddings)):
        if tuple(tensor.shape) != (vocab, config.hidden_size):
            raise SpecdecodeError(
                f"{where}: the {name} have shape {tuple(tensor.shape)}, "
                f"expected ({vocab}, {config.hidden_size})"
            )
    dtype, device = source.input_embeddings().dtype, source.input_embeddings().device
    layer = MtpLayer(
        config,
        embeddings.to(device=device, dtype=dtype),
        head.to(device=device, dtype=dtype),
        model.get_decoder().norm.weight.to(device=device, dtype=dtype),
    )
    layer.load_state_dict({ours: tensors[name] for ours, name in stored.items()}, strict=True)
    layer.layer_note = f"MTP layer {prefix}* ({layout} layout), chained for drafts past one token"
    return layer.to(device=device, dtype=dtype).eval().requires_grad_(False)


def layer_tensors(layer: MtpLayer, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The layer's tensors in the DeepSeek-V3 layout (model.layers.{L}.*), on the CPU in `dtype`."""
    prefix = f"model.layers.{layer.config.n_layers}."
    return {
        prefix + stored_name(name, DEEPSEEK): value.detach().to(device="cpu", dtype=dtype).contiguous()
        for name, value in layer.state_dict().items()
    }


def write_target(
    layer: MtpLayer, target_dir: Path, out_dir: Path, dtype: torch.dtype = torch.bfloat16
) -> Path:
    """out_dir: the target's files with `layer` added in the DeepSeek-V3 layout (MTP_FILE, listed
    in the index where the target has one) and `num_nextn_predict_layers: 1` in config.json."""
    if layer.config.layout != DEEPSEEK:
        raise SpecdecodeError("only DeepSeek-V3-layout MTP layers are written")
    out_dir.mkdir(parents=True, exist_ok=True)
    for path in sorted(target_dir.iterdir()):
        if path.is_file() and path.name != MTP_FILE:
            shutil.copy2(path, out_dir / path.name)
    tensors = layer_tensors(layer, dtype)
    save_file(tensors, out_dir / MTP_FILE, metadata={"format": "pt"})
    raw = json.loads((out_dir / "config.json").read_text())
    raw["num_nextn_predict_layers"] = 1
    (out_dir / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
    index = out_dir / INDEX
    if index.is_file():
        content = json.loads(index.read_text())
        content["weight_map"].update(dict.fromkeys(tensors, MTP_FILE))
        index.write_text(json.dumps(content, indent=2) + "\n")
    return out_dir
