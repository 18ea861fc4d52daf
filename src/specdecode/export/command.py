"""`specdecode export`: the target with its draft, EAGLE-3 head and DFlash drafter, ready for
vLLM, SGLang and llama.cpp, with the command line that serves each pair in each engine.

    OUT/vllm/eagle3/                          speculators directory (`vllm serve OUT/vllm/eagle3`)
    OUT/vllm/speculative-config-{eagle3,dflash,draft}.json
    OUT/{vllm,sglang}/dflash/                 z-lab's DFlash layout
    OUT/sglang/eagle3/                        the original EAGLE-3 layout
    OUT/llama.cpp/{target,draft,eagle3,dflash}.gguf
    OUT/commands.txt                          the lines printed

Every input is read and checked (the head and the drafter against the target) before anything
is written.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdecode.backends import Backend
from specdecode.backends.gguf_files import export_gguf
from specdecode.backends.hf import LoadOptions, load_model_config
from specdecode.backends.load import load_backend
from specdecode.defaults import resolve_eagle3, resolve_models
from specdecode.errors import SpecdecodeError
from specdecode.export.choices import ENGINES
from specdecode.export.engines import (
    Served,
    llama_server_command,
    sglang_command,
    vllm_commands,
    write_sglang,
    write_speculators,
)
from specdecode.strategies import dflash_checkpoint
from specdecode.strategies.dflash_head import DFlashHead
from specdecode.strategies.eagle3_checkpoint import load_head

DRAFT_MAX = 3  # tokens a step for a draft and a head when --spec-draft-n-max is not given


def parse_engines(text: str) -> list[str]:
    engines = [name.strip() for name in text.split(",") if name.strip()]
    unknown = [name for name in engines if name not in ENGINES]
    if unknown or not engines:
        raise SpecdecodeError(
            f"--engines takes a comma-separated subset of {', '.join(ENGINES)}, not {text!r}"
        )
    return engines


def run(args: argparse.Namespace) -> None:
    engines = parse_engines(args.engines)
    if "llama.cpp" in engines:  # the gguf package (the gguf extra): only to write GGUF files
        from specdecode.export.dflash_gguf import check_dflash_gguf, write_dflash_gguf
        from specdecode.export.gguf import TYPES, check_model_gguf, write_head_gguf
    if args.draft_max is not None and args.draft_max < 1:
        raise SpecdecodeError(f"--spec-draft-n-max (--draft-max) must be >= 1, not {args.draft_max}")
    if args.model_draft_dflash is not None and not args.model_draft_dflash.is_dir():
        raise SpecdecodeError(f"DFlash drafter directory not found: {args.model_draft_dflash}")
    head_dir = resolve_eagle3(args.model, args.model_eagle3)
    target_dir, draft_dir = resolve_models(args.model, args.model_draft)
    target_dir, draft_dir = target_dir.resolve(), draft_dir.resolve() if draft_dir else None
    target = load_backend(target_dir, LoadOptions(dtype="float32", backend="hf"))
    head = load_head(head_dir, target, args.eagle3_layer_offset) if head_dir is not None else None
    dflash_dir = args.model_draft_dflash
    dflash = load_dflash(dflash_dir, target, engines) if dflash_dir is not None else None
    dk = dflash_tokens(dflash, args.draft_max) if dflash is not None else 0
    if dflash is not None and "llama.cpp" in engines:
        check_dflash_gguf(dflash)
    if draft_dir is not None:
        load_backend(draft_dir, LoadOptions(dtype="float32", backend="hf"))  # refused here if unusable
    if "llama.cpp" in engines:
        for directory in (target_dir, draft_dir):
            if directory is not None:
                check_model_gguf(directory)
    if "sglang" in engines and head is not None and head.config.target_layer_ids[0] == 1:
        raise SpecdecodeError(
            "the head reads the input of target layer 1, which SGLang reads as SpecForge's 'output of "
            "layer 0' and shifts by one; export it for vllm and llama.cpp only (--engines)"
        )
    for drafter in (head, dflash):
        if drafter is not None:
            print(f"note: {drafter.layer_note}", file=sys.stderr)
    architectures = list(getattr(load_model_config(target_dir), "architectures", None) or [])
    out: Path = args.out.resolve()
    k = args.draft_max or DRAFT_MAX
    served: list[Served] = []
    if "vllm" in engines:
        (out / "vllm").mkdir(parents=True, exist_ok=True)
        if head is not None:
            speculators = write_speculators(head, out / "vllm" / "eagle3", str(target_dir), architectures, k)
            served += vllm_commands(target_dir, "eagle3", speculators, k, out / "vllm")
        if dflash is not None:
            zlab = dflash_checkpoint.save_head(dflash, out / "vllm" / "dflash")
            served += vllm_commands(target_dir, "dflash", zlab, dk, out / "vllm")
        if draft_dir is not None:
            served += vllm_commands(target_dir, "draft", draft_dir, k, out / "vllm")
    if "sglang" in engines:
        if head is not None:
            served.append(
                sglang_command(target_dir, "eagle3", write_sglang(head, out / "sglang" / "eagle3"), k)
            )
        if dflash is not None:
            zlab = dflash_checkpoint.save_head(dflash, out / "sglang" / "dflash")
            served.append(sglang_command(target_dir, "dflash", zlab, dk))
        if draft_dir is not None:
            served.append(sglang_command(target_dir, "draft", draft_dir, k))
    if "llama.cpp" in engines:
        gguf_dir = out / "llama.cpp"
        target_gguf = export_gguf(target_dir, gguf_dir / "target.gguf", args.gguf_type)
        head_type = args.gguf_type if args.gguf_type in TYPES else "f32"  # a head is not quantized
        if head is not None:
            head_gguf = write_head_gguf(head, target_dir, gguf_dir / "eagle3.gguf", head_type)
            served.append(llama_server_command(target_gguf, "eagle3", head_gguf, k))
        if dflash is not None:
            dflash_gguf = write_dflash_gguf(dflash, target_dir, gguf_dir / "dflash.gguf", head_type)
            served.append(llama_server_command(target_gguf, "dflash", dflash_gguf, dk))
        if draft_dir is not None:
            draft_gguf = export_gguf(draft_dir, gguf_dir / "draft.gguf", args.gguf_type)
            served.append(llama_server_command(target_gguf, "draft", draft_gguf, k))
    lines = [f"# {s.engine}, {s.drafter}\n{s.line()}" for s in served]
    out.mkdir(parents=True, exist_ok=True)
    (out / "commands.txt").write_text("\n".join(lines) + "\n")
    if args.json:
        print(json.dumps([{"engine": s.engine, "drafter": s.drafter, "command": s.command} for s in served]))
    else:
        print("\n".join(lines))
    print(f"exported to {out}", file=sys.stderr)


def load_dflash(directory: Path, target: Backend, engines: list[str]) -> DFlashHead:
    """The DFlash drafter, checked against the target and against what the engines can name."""
    drafter = dflash_checkpoint.load_head(directory, target)
    if 0 in drafter.config.target_layer_ids and {"vllm", "sglang"} & set(engines):
        raise SpecdecodeError(
            f"DFlash drafter {directory} reads the input of target layer 0 (the embeddings), which "
            "z-lab's layout for vLLM and SGLang cannot name; export it for llama.cpp only (--engines)"
        )
    return drafter


def dflash_tokens(drafter: DFlashHead, asked: int | None) -> int:
    """Tokens a step for a DFlash drafter: its whole block (block_size - 1) unless fewer are asked."""
    most = drafter.config.drafted
    if asked is not None and asked > most:
        raise SpecdecodeError(
            f"--spec-draft-n-max {asked}: the DFlash drafter drafts at most {most} tokens a step "
            f"(block_size {drafter.config.block_size} - 1)"
        )
    return asked or most
