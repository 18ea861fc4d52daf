"""The flags of `specdecode export`, kept apart from the exporters, which import torch: building
the command line (and answering --help or a mistyped flag) imports nothing heavy."""

from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.config import GGUF_FORMATS, LLAMA_CPP_FORMATS

ENGINES = ("vllm", "sglang", "llama.cpp")


def add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="the target with its draft and EAGLE-3 head for vLLM, SGLang and llama.cpp, and the commands "
        "that serve them",
        epilog="example:\n  specdecode export --out exported --engines vllm,llama.cpp",
    )
    parser.add_argument("-m", "--model", type=Path, help="target directory (default: the bundled pair)")
    parser.add_argument("-md", "--model-draft", type=Path, help="draft model directory")
    parser.add_argument(
        "-me",
        "--model-eagle3",
        type=Path,
        help="EAGLE-3 head directory (default with the bundled target: its head)",
    )
    parser.add_argument("--out", type=Path, required=True, help="output directory")
    parser.add_argument(
        "--engines",
        default=",".join(ENGINES),
        help=f"comma-separated, from {', '.join(ENGINES)} (default: all)",
    )
    parser.add_argument(
        "--spec-draft-n-max",
        "--draft-max",
        dest="draft_max",
        type=int,
        default=3,
        help="tokens drafted per step in the commands written (default: 3, current llama.cpp's)",
    )
    parser.add_argument(
        "--gguf-type",
        choices=[*GGUF_FORMATS, *LLAMA_CPP_FORMATS],
        default="f32",
        help="GGUF weight type of the target and draft (default: f32; q4_k: llama.cpp's quantizer, "
        "from the llama-cpp extra); the head is written in f32 when quantized types are asked",
    )
    parser.add_argument(
        "--eagle3-layer-offset",
        type=int,
        metavar="N",
        help="as for generate: how the head's layer ids are read",
    )
    parser.add_argument("--json", action="store_true", help="print the commands as JSON")
    parser.set_defaults(handler=run_export)


def run_export(args: argparse.Namespace) -> None:
    from specdecode.export import command

    command.run_export(args)
