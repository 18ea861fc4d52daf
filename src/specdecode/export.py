"""`specdecode export --format gguf`: the target and draft as GGUF files, for llama.cpp's kernels.

With no -m, the bundled pair is written (target.gguf and draft.gguf), so that every command runs
on the llama.cpp backend with `-m OUT/target.gguf -md OUT/draft.gguf`. The EAGLE-3 head stays a
Hugging Face directory: llama.cpp's GGUF has no layout for a head over another model's states.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from specdecode.backends.gguf_files import FORMATS, LLAMA_CPP_FORMATS, export_gguf
from specdecode.defaults import resolve_models


def _run_export(args: argparse.Namespace) -> None:
    target, draft = resolve_models(args.model, args.model_draft)
    suffix = "" if args.type == "f32" else f"-{args.type}"
    for role, directory in (("target", target), ("draft", draft)):
        if directory is None:
            continue
        out = export_gguf(directory, args.out / f"{role}{suffix}.gguf", args.type)
        print(f"{role}: {directory} -> {out} ({out.stat().st_size / 2**20:.1f} MiB)", file=sys.stderr)


def add_export_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `export`; it sets `handler` (called by cli.main)."""
    parser = subparsers.add_parser(
        "export",
        help="write the target (and draft) as GGUF files for the llama.cpp backend",
    )
    parser.add_argument("--format", choices=["gguf"], default="gguf", help="file format (gguf)")
    parser.add_argument(
        "--type",
        choices=[*FORMATS, *LLAMA_CPP_FORMATS],
        default="f32",
        help="weight type, f32 by default (q4_k: llama.cpp's quantizer, from the llama-cpp extra)",
    )
    parser.add_argument("-m", "--model", type=Path, help="target directory (default: the bundled pair)")
    parser.add_argument("-md", "--model-draft", type=Path, help="draft directory")
    parser.add_argument(
        "-o", "--out", type=Path, default=Path("build/gguf"), help="output directory (build/gguf)"
    )
    parser.set_defaults(handler=_run_export)
    return parser
