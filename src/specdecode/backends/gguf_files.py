"""GGUF files: writing a Llama-family Hugging Face model as one, and reading one without llama.cpp.

GGUF is the single-file format llama.cpp users hold: the weights (f32, f16, bf16 or block-
quantized such as Q8_0), the hyperparameters and the tokenizer, under llama.cpp's own names.
`export_gguf` writes the layout llama.cpp's converter writes for the "llama" architecture, with
the `gguf` package (llama.cpp's own Python writer and quantizer); the k-quant types are the
f32 file requantized by llama.cpp's library (`quantize`). Two details carry meaning:

- llama.cpp rotates query/key pairs that are adjacent (dimensions 2i, 2i+1), Hugging Face pairs
  that are half a head apart (i, i + d/2); the converter therefore permutes the rows of the
  query and key projections, and every reader undoes it.
- A byte-level BPE tokenizer travels as its vocabulary strings, merges and token types, with the
  pre-tokenizer named ("gpt-2": the GPT-2 split regex, which our tokenizers use).

`load_gguf_model` is the route without llama.cpp's runtime: transformers' GGUF loader
dequantizes the weights (with the `gguf` package) into an ordinary model, which the native or
transformers' forward then runs in PyTorch; slower than llama.cpp's kernels on a CPU, but the
same file works without the compiled extra. The tokenizer transformers builds from the file's
vocabulary (minutes for a large one) is built once and cached (`load_gguf_tokenizer`).

The `gguf` package is imported only when a GGUF file is read or written (the `gguf` extra), so
the names of the formats cost nothing where it is not installed.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np
import torch
import transformers
from tokenizers import Tokenizer
from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig, PreTrainedTokenizerFast

from specdecode.backends.hf import check_model_directory, load_model_config, load_tokenizer
from specdecode.backends.native_weights import native_unsupported
from specdecode.config import GGUF_FORMATS as FORMATS
from specdecode.config import LLAMA_CPP_FORMATS
from specdecode.errors import SpecdecodeError, require
from specdecode.gguf_header import Field, read_metadata
from specdecode.local import cache_dir

if TYPE_CHECKING:
    import gguf

TOKENIZER_CACHE_FORMAT = 1  # of the cached tokenizers: a new format builds them again


def _gguf() -> ModuleType:
    """gguf, imported where a file is read or written: loading a directory never needs it."""
    return require("gguf", "reading or writing GGUF files")


def export_gguf(directory: str | Path, out: str | Path, fmt: str = "f32") -> Path:
    """Write the Llama-family model in `directory` as a GGUF file `out` of type `fmt`."""
    if fmt not in FORMATS and fmt not in LLAMA_CPP_FORMATS:
        raise SpecdecodeError(
            f"unknown GGUF type {fmt!r} (choose from {', '.join([*FORMATS, *LLAMA_CPP_FORMATS])})"
        )
    directory = check_model_directory(Path(directory))
    config = load_model_config(directory)
    # Mistral without sliding windows is a Llama decoder, which llama.cpp's converter writes as "llama" too
    if config.model_type not in ("llama", "mistral") or native_unsupported(config) is not None:
        reason = native_unsupported(config) or f"model_type {config.model_type!r}"
        raise SpecdecodeError(f"{directory}: GGUF export writes plain Llama and Mistral models ({reason})")
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if fmt in LLAMA_CPP_FORMATS:
        full = out.with_name(out.stem + ".f32.tmp.gguf")
        export_gguf(directory, full, "f32")
        try:
            quantize(full, out, fmt)
        finally:
            full.unlink(missing_ok=True)
        return out
    gguf = _gguf()
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, local_files_only=True)
    tokenizer = load_tokenizer(directory)
    writer = gguf.GGUFWriter(out, "llama")
    _write_hyperparameters(writer, config, directory.name, gguf.LlamaFileType[FORMATS[fmt]])
    _write_tokenizer(writer, tokenizer, config)
    for name, tensor in _gguf_tensors(model, config):
        _add_tensor(writer, name, tensor, fmt)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out


def quantize(source: Path, out: Path, fmt: str) -> None:
    """Requantize a GGUF file with llama.cpp's own quantizer (k-quants need it)."""
    from specdecode.backends.llama_lib import INSTALL_HINT, llama_cpp, silence_logs  # loads the library

    if llama_cpp is None:
        raise SpecdecodeError(f"GGUF type {fmt} needs llama.cpp's quantizer: {INSTALL_HINT}")
    silence_logs()
    params = llama_cpp.llama_model_quantize_default_params()
    ftypes = {"q4_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_K_M, "q6_k": llama_cpp.LLAMA_FTYPE_MOSTLY_Q6_K}
    params.ftype = ftypes[fmt]
    if llama_cpp.llama_model_quantize(str(source).encode(), str(out).encode(), params) != 0:
        raise SpecdecodeError(f"llama.cpp could not quantize {source} to {fmt}")


def _write_hyperparameters(writer: gguf.GGUFWriter, config, name: str, file_type) -> None:
    heads = int(config.num_attention_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // heads)
    rope = getattr(config, "rope_parameters", None) or {}
    writer.add_name(name)
    writer.add_file_type(file_type)
    writer.add_context_length(int(config.max_position_embeddings))
    writer.add_embedding_length(int(config.hidden_size))
    writer.add_block_count(int(config.num_hidden_layers))
    writer.add_feed_forward_length(int(config.intermediate_size))
    writer.add_head_count(heads)
    writer.add_head_count_kv(int(config.num_key_value_heads))
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope.get("rope_theta", getattr(config, "rope_theta", 10000.0))))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(int(config.vocab_size))


def _write_tokenizer(writer: gguf.GGUFWriter, tokenizer, config) -> None:
    """A byte-level BPE tokenizer as llama.cpp's "gpt2" model; other kinds are refused."""
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or model.get("byte_fallback"):
        raise SpecdecodeError("GGUF export handles byte-level BPE tokenizers only")
    kinds = _gguf().TokenType
    size = int(config.vocab_size)
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [kinds.UNUSED] * size
    for text, token_id in tokenizer.get_vocab().items():
        if token_id < size:
            tokens[token_id], types[token_id] = text, kinds.NORMAL
    for added in spec.get("added_tokens", []):
        if added["id"] < size:
            types[added["id"]] = kinds.CONTROL if added.get("special") else kinds.USER_DEFINED
    merges = [" ".join(pair) if isinstance(pair, list) else pair for pair in model.get("merges", [])]
    with_special = tokenizer("a", add_special_tokens=True)["input_ids"]
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("gpt-2")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for setter, token_id in (
        (writer.add_bos_token_id, tokenizer.bos_token_id),
        (writer.add_eos_token_id, tokenizer.eos_token_id),
        (writer.add_pad_token_id, tokenizer.pad_token_id),
    ):
        if token_id is not None:
            setter(int(token_id))
    bos, eos = tokenizer.bos_token_id, tokenizer.eos_token_id
    writer.add_add_bos_token(bos is not None and with_special[:1] == [bos] and plain[:1] != [bos])
    writer.add_add_eos_token(eos is not None and with_special[-1:] == [eos] and plain[-1:] != [eos])
    if isinstance(tokenizer.chat_template, str):  # as llama.cpp's converter: chat runs from the file
        writer.add_chat_template(tokenizer.chat_template)


def _gguf_tensors(model, config):
    """(llama.cpp name, float32 array) for every weight, queries and keys permuted."""
    heads, kv_heads = int(config.num_attention_heads), int(config.num_key_value_heads)
    state = {name: tensor.detach().float().numpy() for name, tensor in model.state_dict().items()}
    yield "token_embd.weight", state["model.embed_tokens.weight"]
    yield "output_norm.weight", state["model.norm.weight"]
    if not config.tie_word_embeddings:
        yield "output.weight", state["lm_head.weight"]
    names = {
        "attn_norm": "input_layernorm",
        "attn_q": "self_attn.q_proj",
        "attn_k": "self_attn.k_proj",
        "attn_v": "self_attn.v_proj",
        "attn_output": "self_attn.o_proj",
        "ffn_norm": "post_attention_layernorm",
        "ffn_gate": "mlp.gate_proj",
        "ffn_up": "mlp.up_proj",
        "ffn_down": "mlp.down_proj",
    }
    for layer in range(int(config.num_hidden_layers)):
        for ours, theirs in names.items():
            weight = state[f"model.layers.{layer}.{theirs}.weight"]
            if ours in ("attn_q", "attn_k"):
                weight = _pair_adjacent(weight, heads if ours == "attn_q" else kv_heads)
            yield f"blk.{layer}.{ours}.weight", weight


def _pair_adjacent(weight: np.ndarray, heads: int) -> np.ndarray:
    """Reorder each head's rows from half-apart rotary pairs to adjacent ones (llama.cpp's)."""
    return (
        weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def _add_tensor(writer: gguf.GGUFWriter, name: str, tensor: np.ndarray, fmt: str) -> None:
    """Vectors (norms) stay f32, as llama.cpp keeps them; matrices take the file's type where
    their rows fit its blocks."""
    gguf = _gguf()
    qtype = gguf.GGMLQuantizationType[fmt.upper()]
    block = gguf.GGML_QUANT_SIZES[qtype][0]
    if tensor.ndim < 2 or qtype == gguf.GGMLQuantizationType.F32 or tensor.shape[-1] % block:
        writer.add_tensor(name, np.ascontiguousarray(tensor, dtype=np.float32))
    elif qtype == gguf.GGMLQuantizationType.F16:
        writer.add_tensor(name, tensor.astype(np.float16))
    else:
        writer.add_tensor(name, gguf.quants.quantize(tensor, qtype), raw_dtype=qtype)


def dequantized_tensor(path: Path, name: str) -> torch.Tensor:
    """One tensor of a GGUF file as float32, in PyTorch's shape (rows first)."""
    gguf = _gguf()
    tensor = next((t for t in gguf.GGUFReader(path).tensors if t.name == name), None)
    if tensor is None:
        raise SpecdecodeError(f"{path} holds no tensor {name}")
    data = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
    shape = tuple(int(n) for n in reversed(tensor.shape))
    return torch.from_numpy(np.array(data, dtype=np.float32).reshape(shape))


def load_gguf_model(
    path: Path, dtype: torch.dtype, dense: bool = False, progress: Callable[[str], None] | None = None
):
    """(model, tokenizer) from a GGUF file through transformers' loader (dequantized).

    dense: unpack every weight into a plain tensor even where transformers could keep it in
    GGUF blocks for its matmul kernels, as a directory written from the model needs.
    progress: told before the tokenizer is built (`load_gguf_tokenizer`)."""
    _gguf()  # transformers' loader reads the file with it
    packing = {"quantization_config": GgufConfig(dequantize=True)} if dense else {}
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=dtype, local_files_only=True, **packing
        )
    except Exception as exc:  # transformers raises many types for files it cannot map
        raise SpecdecodeError(
            f"cannot load {path} through transformers' GGUF loader: {_last_line(exc)}"
        ) from None
    return model, load_gguf_tokenizer(path, progress)


def tokenizer_cache_dir() -> Path:
    return cache_dir("gguf-tokenizers")


def load_gguf_tokenizer(path: Path, progress: Callable[[str], None] | None = None):
    """The tokenizer a GGUF file describes, as transformers builds it (all `lookup` needs).

    transformers builds it from the vocabulary in Python, which takes minutes for a vocabulary of
    tens of thousands of tokens; so it is built once and kept under `tokenizer_cache_dir()`, keyed
    by the file's tokenizer metadata (a copy of the file, or another quantization of the same
    model, finds it). An entry that cannot be read is built again and replaced, never an error.
    progress: told before a build, the long step (a start-up line)."""
    fields = read_metadata(path)
    tokens = fields.get("tokenizer.ggml.tokens")
    if tokens is None:
        raise SpecdecodeError(f"cannot read the tokenizer of {path}: it has no tokenizer.ggml.tokens")
    entry = tokenizer_cache_dir() / _tokenizer_key(fields)
    cached = _read_cached_tokenizer(entry)
    if cached is not None:
        return cached
    _gguf()  # transformers' converter reads the file with it
    if progress is not None:
        progress(
            f"building {path.name}'s tokenizer from its {tokens.count} tokens with transformers "
            "(once: it is kept for the next runs)"
        )
    tokenizer = build_gguf_tokenizer(path, tokens.count)
    _write_cached_tokenizer(tokenizer, entry)
    return tokenizer


def build_gguf_tokenizer(path: Path, rows: int):
    """The tokenizer transformers converts from the file's vocabulary (the slow step), without
    tokens past the model's `rows`."""
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
    except Exception as exc:  # as above
        raise SpecdecodeError(f"cannot read the tokenizer of {path}: {_last_line(exc)}") from None
    return _without_foreign_tokens(tokenizer, rows)


def _tokenizer_key(fields: dict[str, Field]) -> str:
    """SHA-256 of everything the built tokenizer depends on: the file's tokenizer fields (their
    bytes as stored, name included), its architecture, and the converter (transformers' version)."""
    digest = hashlib.sha256(f"{TOKENIZER_CACHE_FORMAT} {transformers.__version__}".encode())
    for name in sorted(fields):
        if name.startswith("tokenizer.") or name == "general.architecture":
            digest.update(fields[name].raw)
    return digest.hexdigest()


def _read_cached_tokenizer(entry: Path):
    """The tokenizer stored in `entry`, or None where there is none usable."""
    if not (entry / "tokenizer.json").is_file():
        return None
    try:
        return PreTrainedTokenizerFast.from_pretrained(entry, local_files_only=True)
    except Exception:  # a damaged entry fails in many ways; it is built again
        return None


def _write_cached_tokenizer(tokenizer, entry: Path) -> None:
    """Store `tokenizer` in `entry` whole or not at all: written to a temporary directory beside
    it, then renamed. Where the cache cannot be written, the tokenizer is simply not kept."""
    with contextlib.suppress(OSError, RuntimeError):  # RuntimeError: no home directory
        entry.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
        try:
            tokenizer.save_pretrained(staging)
            shutil.rmtree(entry, ignore_errors=True)  # a damaged entry, replaced
            staging.rename(entry)
        finally:
            shutil.rmtree(staging, ignore_errors=True)  # left only where the rename failed


def _last_line(exc: Exception) -> str:
    return str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__


def _without_foreign_tokens(tokenizer, rows: int):
    """transformers builds a byte-level GGUF vocabulary as a GPT2Tokenizer, which adds GPT-2's
    `<|endoftext|>` when the file has no such token: an id past the model's rows. Drop any such
    added token, keeping everything else (special tokens, pre-tokenizer, decoder) as built."""
    foreign = {text for text, token_id in tokenizer.get_added_vocab().items() if token_id >= rows}
    if not foreign:
        return tokenizer
    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["added_tokens"] = [added for added in spec["added_tokens"] if added["content"] not in foreign]
    special = {
        name: getattr(tokenizer, name)
        for name in ("bos_token", "eos_token", "pad_token", "unk_token")
        if getattr(tokenizer, name) is not None and getattr(tokenizer, name) not in foreign
    }
    cleaned = PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(json.dumps(spec)), **special)
    cleaned.add_bos_token = getattr(tokenizer, "add_bos_token", False)
    cleaned.add_eos_token = getattr(tokenizer, "add_eos_token", False)
    cleaned.chat_template = tokenizer.chat_template
    return cleaned
