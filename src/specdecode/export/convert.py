"""`specdecode convert MODEL.gguf DIR`: a GGUF file as a Hugging Face model directory.

`train` and every tool that reads a directory then take a model published only as GGUF, and the
directory starts without the GGUF tokenizer's conversion. The weights are transformers' own
dequantization of the file (the ones `--backend hf` and `native` run on the file), written with
safetensors directly: transformers' `save_pretrained` refuses a model loaded from GGUF, since its
loader may keep weights in GGUF blocks, which `convert` unpacks.

    DIR/config.json              the architecture, without the GGUF loading settings
    DIR/model.safetensors        every weight, in --dtype
    DIR/tokenizer.json, tokenizer_config.json   the file's vocabulary (and chat template, if any)
    DIR/generation_config.json   BOS, EOS and padding ids
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from transformers import GenerationConfig

from specdecode.backends.gguf_files import load_gguf_model
from specdecode.backends.load import is_gguf
from specdecode.errors import SpecdecodeError
from specdecode.export.choices import CONVERT_DTYPES

DTYPES = {name: getattr(torch, name) for name in CONVERT_DTYPES}


def run(args: argparse.Namespace) -> None:
    out = convert_gguf(args.gguf, args.out, args.dtype, force=args.force)
    print(f"converted {args.gguf} to {out}", file=sys.stderr)


def convert_gguf(path: Path, out: Path, dtype: str = CONVERT_DTYPES[0], force: bool = False) -> Path:
    """Write the GGUF file `path` as a Hugging Face directory `out` with weights in `dtype`."""
    path, out = Path(path), Path(out)
    if not path.exists():
        raise SpecdecodeError(f"GGUF file not found: {path}")
    if not is_gguf(path):
        kind = "a directory" if path.is_dir() else "a file without the GGUF magic bytes"
        raise SpecdecodeError(f"{path} is not a GGUF file ({kind}): convert reads GGUF files")
    if dtype not in DTYPES:
        raise SpecdecodeError(f"unknown dtype {dtype!r} (choose from {', '.join(DTYPES)})")
    if out.exists() and not out.is_dir():
        raise SpecdecodeError(f"{out} exists and is not a directory")
    check_writable(out)  # before minutes of dequantizing
    if out.is_dir() and any(out.iterdir()) and not force:
        raise SpecdecodeError(f"{out} exists and is not empty (--force writes into it)")
    model, tokenizer = load_gguf_model(path, DTYPES[dtype], dense=True)
    try:
        out.mkdir(parents=True, exist_ok=True)
        config = model.config
        config.architectures = [type(model).__name__]
        config.dtype = DTYPES[dtype]
        config.save_pretrained(out)
        save_file(_each_weight_once(model), out / "model.safetensors", metadata={"format": "pt"})
        tokenizer.save_pretrained(out, save_jinja_files=False)  # the chat template in tokenizer_config.json
        generation = GenerationConfig(
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )
        generation.save_pretrained(out)
    except OSError as exc:  # the disk filled, or the directory changed under us
        raise SpecdecodeError(f"cannot write {out}: {exc.strerror or exc}") from None
    return out


def check_writable(out: Path) -> None:
    """Refuse a destination that cannot be written: an existing directory without write
    permission, or one whose nearest existing parent is a file or not writable (so it cannot be
    created). Nothing is created here."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise SpecdecodeError(f"cannot create {out}: {existing} is not a directory")
    if existing == out and not os.access(out, os.R_OK | os.W_OK | os.X_OK):
        raise SpecdecodeError(f"cannot write into {out}: permission denied")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise SpecdecodeError(f"cannot create {out}: {existing} is not writable")


def _each_weight_once(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict with a tied weight (an LM head sharing the embeddings) under its first name
    only, as `save_pretrained` writes it: safetensors refuses shared tensors, and loading ties the
    head again from the config."""
    seen: set[int] = set()
    weights = {}
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            weights[name] = tensor.contiguous()
    return weights
