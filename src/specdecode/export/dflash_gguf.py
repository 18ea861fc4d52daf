"""A DFlash drafter as a GGUF file for llama.cpp (`--spec-type draft-dflash`), written and read
with the `gguf` package.

llama.cpp's converter (`convert_hf_to_gguf.py DRAFTER_DIR --target-model-dir TARGET_DIR`) turns
z-lab's directory into arch `dflash`; this writes the same file directly, as `export.gguf` does
for an EAGLE-3 head:

* `dflash.target_layers`: inputs of target layers, the layers llama.cpp taps
  (`llama_set_embeddings_layer_inp`), so z-lab's "output of layer l" ids plus one, which is this
  package's count unchanged; `dflash.target_hidden_size`, `dflash.block_size`;
* the target's tokenizer (the drafter has none), with the mask token as
  `tokenizer.ggml.mask_token_id` (llama.cpp's DFlash takes the drafter vocabulary's mask token)
  and as `dflash.mask_token_id` (which earlier converters wrote);
* `fc.weight`, `enc.output_norm.weight` (the hidden norm after fc), `output_norm.weight`, and per
  layer Qwen3's `blk.N.*` tensors. No embeddings and no output head: llama.cpp borrows the
  target's. The layers rotate halves of each head (NEOX), as Hugging Face does, so Q and K rows
  are written as they are.

`read_dflash_gguf` inverts the file, so an export is checked by reading it back with gguf's
reader and drafting from what it holds.
"""

from __future__ import annotations

from pathlib import Path

from gguf import GGUFReader, GGUFWriter

from specdecode.backends import Backend, hidden_state_source
from specdecode.backends.hf import load_tokenizer
from specdecode.errors import SpecdecodeError
from specdecode.export.gguf import FILE_TYPES, _add_tensor, _add_tokenizer, _fields, _tensors, _write
from specdecode.strategies.dflash_checkpoint import output_matrix
from specdecode.strategies.dflash_head import DFlashConfig, DFlashHead

ARCH = "dflash"
TOP_TENSORS = {"fc.weight": "fc.weight", "hidden_norm.weight": "enc.output_norm.weight",
               "norm.weight": "output_norm.weight"}  # fmt: skip
LAYER_TENSORS = {  # within layers.{i}. -> within blk.{i}.
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "self_attn.q_norm.weight": "attn_q_norm.weight",
    "self_attn.k_norm.weight": "attn_k_norm.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}


def gguf_name(name: str) -> str:
    """A drafter tensor's name (z-lab's) -> its GGUF name."""
    if name in TOP_TENSORS:
        return TOP_TENSORS[name]
    _, layer, rest = name.split(".", 2)
    return f"blk.{layer}.{LAYER_TENSORS[rest]}"


def check_dflash_gguf(head: DFlashHead) -> None:
    """Refuse, before anything is written, a drafter llama.cpp's DFlash graph cannot run."""
    if head.config.attention_bias:
        raise SpecdecodeError(
            "GGUF export of the DFlash drafter: its attention projections have biases, which "
            "llama.cpp's DFlash layers do not load; export it for vllm and sglang only (--engines)"
        )
    if head.config.rope_scaling:
        raise SpecdecodeError(
            "GGUF export of the DFlash drafter: its rotary scaling "
            f"({head.config.rope_scaling.get('rope_type', 'scaled')}) is not written to GGUF files here; "
            "export it for vllm and sglang only (--engines)"
        )


def write_dflash_gguf(head: DFlashHead, target_dir: Path, out: Path, kind: str = "f32") -> Path:
    """A DFlash drafter as a GGUF of arch dflash, with the target's tokenizer."""
    check_dflash_gguf(head)
    c = head.config
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(out, ARCH)
    writer.add_name(f"{target_dir.name}-dflash")
    writer.add_vocab_size(c.vocab_size)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(c.num_hidden_layers)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.dim)
    writer.add_value_length(c.dim)
    writer.add_rope_dimension_count(c.dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_causal_attention(False)
    writer.add_file_type(FILE_TYPES[kind])
    if c.sliding_window is not None:
        writer.add_sliding_window(c.sliding_window)
        writer.add_sliding_window_pattern([i in c.sliding_layers for i in range(c.num_hidden_layers)])
    writer.add_array(f"{ARCH}.target_layers", list(c.target_layer_ids))
    writer.add_uint32(f"{ARCH}.target_hidden_size", c.hidden_size)
    writer.add_uint32(f"{ARCH}.block_size", c.block_size)
    writer.add_uint32(f"{ARCH}.mask_token_id", c.mask_token_id)
    _add_tokenizer(writer, load_tokenizer(target_dir), f"GGUF export of the DFlash drafter for {target_dir}")
    writer.add_mask_token_id(c.mask_token_id)
    for name, tensor in head.state_dict().items():
        _add_tensor(writer, gguf_name(name), tensor, kind)
    _write(writer)
    return out


def read_dflash_gguf(path: Path, target: Backend) -> DFlashHead:
    """A dflash GGUF written by `write_dflash_gguf`, as a drafter for `target` (in its dtype,
    with its embeddings and output head)."""
    reader = GGUFReader(path)
    kv, tensors = _fields(reader), _tensors(reader)
    if kv.get("general.architecture") != ARCH:
        raise SpecdecodeError(f"{path}: architecture {kv.get('general.architecture')!r}, not {ARCH!r}")
    window = kv.get(f"{ARCH}.attention.sliding_window")
    pattern = kv.get(f"{ARCH}.attention.sliding_window_pattern") or []
    config = DFlashConfig(
        hidden_size=kv[f"{ARCH}.embedding_length"],
        num_hidden_layers=kv[f"{ARCH}.block_count"],
        num_attention_heads=kv[f"{ARCH}.attention.head_count"],
        num_key_value_heads=kv[f"{ARCH}.attention.head_count_kv"],
        intermediate_size=kv[f"{ARCH}.feed_forward_length"],
        target_layer_ids=tuple(int(x) for x in kv[f"{ARCH}.target_layers"]),
        block_size=kv[f"{ARCH}.block_size"],
        mask_token_id=kv["tokenizer.ggml.mask_token_id"],
        vocab_size=kv[f"{ARCH}.vocab_size"],
        head_dim=kv[f"{ARCH}.attention.key_length"],
        rms_norm_eps=kv[f"{ARCH}.attention.layer_norm_rms_epsilon"],
        rope_theta=kv[f"{ARCH}.rope.freq_base"],
        max_position_embeddings=kv[f"{ARCH}.context_length"],
        sliding_window=window,
        sliding_layers=tuple(i for i, sliding in enumerate(pattern) if sliding),
    )
    source = hidden_state_source(target, "a DFlash drafter")
    embeddings, output = source.input_embeddings(), output_matrix(source, str(path))
    head = DFlashHead(config, embeddings, output)
    head.load_state_dict({name: tensors[gguf_name(name)] for name in head.state_dict()}, strict=True)
    return head.to(device=embeddings.device, dtype=embeddings.dtype).eval().requires_grad_(False)
