"""The EAGLE-3 head as a GGUF file for llama.cpp, written and read with the `gguf` package.

The target and the draft are written by `specdecode.backends.gguf_files.export_gguf` (the
files the llama.cpp backend runs); this module adds what llama.cpp's speculative EAGLE-3
needs beside them:

* `write_head_gguf`: an EAGLE-3 head as arch `eagle3`: `eagle3.target_layers` (inputs of target
  layers, llama.cpp's reading), `eagle3.target_hidden_size`, the decoder layer as block 0
  (`attn_norm` on the token embedding, `attn_norm_2` the hidden norm on g), `d2t` as absolute
  int64 target ids, and the target's tokenizer. llama.cpp applies rotary embeddings to
  interleaved pairs where Hugging Face rotates halves, so Q and K rows are reordered per head
  (`interleave_rows`), as its converter does.
* `check_model_gguf`: whether a model directory can be written (checked before anything is).

`read_head_gguf` inverts the head's file, so an export is checked by reading it back with
gguf's reader and drafting from what it holds.
"""

from __future__ import annotations

import json
from pathlib import Path

import gguf
import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from transformers import PreTrainedTokenizerBase

from specdecode.backends import Backend, hidden_state_source
from specdecode.backends.hf import check_model_directory, load_model_config, load_tokenizer
from specdecode.errors import SpecdecodeError
from specdecode.strategies.eagle3_head import Eagle3Config, Eagle3Head

TYPES = {"f32": GGMLQuantizationType.F32, "f16": GGMLQuantizationType.F16, "bf16": GGMLQuantizationType.BF16}
FILE_TYPES = {"f32": gguf.LlamaFileType.ALL_F32, "f16": gguf.LlamaFileType.MOSTLY_F16,
              "bf16": gguf.LlamaFileType.MOSTLY_BF16}  # fmt: skip
HEAD_TENSORS = {  # original-layout name -> GGUF name
    "fc.weight": "fc.weight",
    "midlayer.input_layernorm.weight": "blk.0.attn_norm.weight",
    "midlayer.hidden_norm.weight": "blk.0.attn_norm_2.weight",
    "midlayer.self_attn.q_proj.weight": "blk.0.attn_q.weight",
    "midlayer.self_attn.k_proj.weight": "blk.0.attn_k.weight",
    "midlayer.self_attn.v_proj.weight": "blk.0.attn_v.weight",
    "midlayer.self_attn.o_proj.weight": "blk.0.attn_output.weight",
    "midlayer.post_attention_layernorm.weight": "blk.0.ffn_norm.weight",
    "midlayer.mlp.gate_proj.weight": "blk.0.ffn_gate.weight",
    "midlayer.mlp.up_proj.weight": "blk.0.ffn_up.weight",
    "midlayer.mlp.down_proj.weight": "blk.0.ffn_down.weight",
    "norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
    "embed_tokens.weight": "token_embd.weight",
}


def interleave_rows(weight: torch.Tensor, heads: int, inverse: bool = False) -> torch.Tensor:
    """Per head, rows [x_0..x_{d/2-1}, y_0..y_{d/2-1}] -> [x_0, y_0, x_1, y_1, ...] (or back)."""
    rows, rest = weight.shape[0], weight.shape[1:]
    half = rows // heads // 2
    if inverse:
        return weight.reshape(heads, half, 2, *rest).transpose(1, 2).reshape(rows, *rest)
    return weight.reshape(heads, 2, half, *rest).transpose(1, 2).reshape(rows, *rest)


def _add_tensor(writer: GGUFWriter, name: str, tensor: torch.Tensor, kind: str) -> None:
    data = tensor.detach().to(device="cpu", dtype=torch.float32).numpy()
    # norms stay in float32, as llama.cpp's converter keeps 1-D tensors
    qtype = TYPES[kind] if data.ndim > 1 else GGMLQuantizationType.F32
    if qtype == GGMLQuantizationType.F32:
        writer.add_tensor(name, data)
    elif qtype == GGMLQuantizationType.F16:
        writer.add_tensor(name, data.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(data, qtype), raw_dtype=qtype)


def _write(writer: GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _bpe_model(tokenizer: PreTrainedTokenizerBase, where: str) -> dict:
    """The tokenizer.json model of a byte-level BPE tokenizer with GPT-2's pre-tokenizer, or an error."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    spec = json.loads(backend.to_str()) if backend is not None else {}
    model, pre = spec.get("model") or {}, spec.get("pre_tokenizer") or {}
    if model.get("type") != "BPE" or pre.get("type") != "ByteLevel" or not pre.get("use_regex", True):
        raise SpecdecodeError(f"{where}: only byte-level BPE tokenizers (GPT-2 style) are written to GGUF")
    return model


def check_model_gguf(model_dir: Path) -> None:
    """Refuse, before anything is written, a model that `write_model_gguf` cannot write."""
    where = f"GGUF export of {model_dir}"
    config = load_model_config(check_model_directory(model_dir))
    if config.model_type != "llama":
        raise SpecdecodeError(f"{where}: model_type {config.model_type!r}; only llama is written to GGUF")
    _bpe_model(load_tokenizer(model_dir), where)


def _add_tokenizer(writer: GGUFWriter, tokenizer: PreTrainedTokenizerBase, where: str) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" model with the GPT-2 pre-tokenizer."""
    model = _bpe_model(tokenizer, where)
    vocab = tokenizer.get_vocab()
    tokens = [""] * len(vocab)
    for text, index in vocab.items():
        tokens[index] = text
    special = set(tokenizer.all_special_ids)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if i in special else gguf.TokenType.NORMAL
                            for i in range(len(tokens))])  # fmt: skip
    writer.add_token_merges(merges)
    for key, value in (("bos", tokenizer.bos_token_id), ("eos", tokenizer.eos_token_id),
                       ("pad", tokenizer.pad_token_id)):  # fmt: skip
        if value is not None:
            getattr(writer, f"add_{key}_token_id")(int(value))
    adds_bos = tokenizer.bos_token_id is not None and tokenizer("a")["input_ids"][:1] == [
        tokenizer.bos_token_id
    ]
    writer.add_add_bos_token(adds_bos)


def write_head_gguf(head: Eagle3Head, target_dir: Path, out: Path, kind: str = "f32") -> Path:
    """An EAGLE-3 head as a GGUF of arch eagle3, with the target's tokenizer."""
    c = head.config
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(out, "eagle3")
    writer.add_name(f"{target_dir.name}-eagle3")
    writer.add_vocab_size(c.vocab_size)
    writer.add_context_length(c.max_position_embeddings)
    writer.add_embedding_length(c.hidden_size)
    writer.add_block_count(1)
    writer.add_feed_forward_length(c.intermediate_size)
    writer.add_head_count(c.num_attention_heads)
    writer.add_head_count_kv(c.num_key_value_heads)
    writer.add_key_length(c.dim)
    writer.add_value_length(c.dim)
    writer.add_rope_dimension_count(c.dim)
    writer.add_rope_freq_base(c.rope_theta)
    writer.add_layer_norm_rms_eps(c.rms_norm_eps)
    writer.add_file_type(FILE_TYPES[kind])
    writer.add_array("eagle3.target_layers", list(c.target_layer_ids))
    writer.add_uint32("eagle3.target_hidden_size", c.target_hidden_size)
    writer.add_bool("eagle3.norm_before_residual", False)
    _add_tokenizer(writer, load_tokenizer(target_dir), f"GGUF export of the head for {target_dir}")
    for name, tensor in head.state_dict().items():
        if name == "d2t":
            writer.add_tensor("d2t", tensor.cpu().to(torch.int64).numpy(), raw_dtype=GGMLQuantizationType.I64)
            continue
        if name == "midlayer.self_attn.q_proj.weight":
            tensor = interleave_rows(tensor, c.num_attention_heads)
        elif name == "midlayer.self_attn.k_proj.weight":
            tensor = interleave_rows(tensor, c.num_key_value_heads)
        _add_tensor(writer, HEAD_TENSORS[name], tensor, kind)
    _write(writer)
    return out


# --------------------------------------------------------------------------- reading back


def _fields(reader: GGUFReader) -> dict:
    return {name: field.contents() for name, field in reader.fields.items()}


def _tensors(reader: GGUFReader) -> dict[str, torch.Tensor]:
    out = {}
    for t in reader.tensors:
        if t.tensor_type == GGMLQuantizationType.I64:
            out[t.name] = torch.from_numpy(np.array(t.data, dtype=np.int64))
            continue
        data = gguf.quants.dequantize(t.data, t.tensor_type)
        shape = tuple(int(n) for n in reversed(t.shape))
        out[t.name] = torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))
    return out


def read_head_gguf(path: Path, target: Backend) -> Eagle3Head:
    """An eagle3 GGUF written by `write_head_gguf`, as a head for `target` (in its dtype)."""
    reader = GGUFReader(path)
    kv, tensors = _fields(reader), _tensors(reader)
    config = Eagle3Config(
        hidden_size=kv["eagle3.embedding_length"],
        num_attention_heads=kv["eagle3.attention.head_count"],
        num_key_value_heads=kv["eagle3.attention.head_count_kv"],
        intermediate_size=kv["eagle3.feed_forward_length"],
        target_hidden_size=kv["eagle3.target_hidden_size"],
        target_layer_ids=tuple(int(x) for x in kv["eagle3.target_layers"]),
        vocab_size=kv["eagle3.vocab_size"],
        draft_vocab_size=int(tensors["output.weight"].shape[0]),
        head_dim=kv["eagle3.attention.key_length"],
        rms_norm_eps=kv["eagle3.attention.layer_norm_rms_epsilon"],
        rope_theta=kv["eagle3.rope.freq_base"],
        max_position_embeddings=kv["eagle3.context_length"],
    )
    embeddings = hidden_state_source(target, "an EAGLE-3 head").input_embeddings()
    own = "token_embd.weight" in tensors
    head = Eagle3Head(config, None if own else embeddings)
    state = {}
    for name in head.state_dict():
        if name == "d2t":
            state[name] = tensors["d2t"]
            continue
        tensor = tensors[HEAD_TENSORS[name]]
        if name == "midlayer.self_attn.q_proj.weight":
            tensor = interleave_rows(tensor, config.num_attention_heads, inverse=True)
        elif name == "midlayer.self_attn.k_proj.weight":
            tensor = interleave_rows(tensor, config.num_key_value_heads, inverse=True)
        state[name] = tensor
    head.load_state_dict(state, strict=True)
    return head.to(device=embeddings.device, dtype=embeddings.dtype).eval().requires_grad_(False)
