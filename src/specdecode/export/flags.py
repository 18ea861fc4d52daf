"""The flags of `specdecode export` and `convert`, kept apart from the exporters, which import
torch: building the command line (and answering --help or a mistyped flag) imports nothing heavy.
Each handler is named as "module:function" (`run` in `export.command` and `export.convert`)."""

from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.config import GGUF_FORMATS, LLAMA_CPP_FORMATS
from specdecode.export.choices import CONVERT_DTYPES, ENGINES


def add_export_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export",
        help="the target with its draft, EAGLE-3 head and DFlash drafter for vLLM, SGLang and llama.cpp, "
        "and the commands that serve them",
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
    parser.add_argument(
        "-mdf",
        "--model-draft-dflash",
        type=Path,
        metavar="DIR",
        help="DFlash drafter directory (z-lab's layout)",
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
        help="tokens drafted per step in the commands written (default: 3, current llama.cpp's; for a "
        "DFlash drafter its block size - 1)",
    )
    parser.add_argument(
        "--gguf-type",
        choices=[*GGUF_FORMATS, *LLAMA_CPP_FORMATS],
        default="f32",
        help="GGUF weight type of the target and draft (default: f32; q4_k: llama.cpp's quantizer, "
        "from the llama-cpp extra); the head and DFlash drafter are written in f32 when quantized types "
        "are asked",
    )
    parser.add_argument(
        "--eagle3-layer-offset",
        type=int,
        metavar="N",
        help="as for generate: how the head's layer ids are read",
    )
    parser.add_argument("--json", action="store_true", help="print the commands as JSON")
    parser.set_defaults(handler="specdecode.export.command:run")


def add_convert_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "convert",
        help="a GGUF file as a Hugging Face model directory (dequantized weights, tokenizer, chat template)",
        epilog="example:\n  specdecode convert model.gguf model-hf",
    )
    parser.add_argument("gguf", type=Path, metavar="MODEL.gguf", help="the GGUF file")
    parser.add_argument("out", type=Path, metavar="DIR", help="the directory to write")
    parser.add_argument(
        "--dtype",
        choices=CONVERT_DTYPES,
        default=CONVERT_DTYPES[0],
        help="weight dtype (default: float32, the one that holds every dequantized weight exactly, so "
        "the directory gives the file's logits; bfloat16 halves the size at a rounding)",
    )
    parser.add_argument("--force", action="store_true", help="write into DIR even if it is not empty")
    parser.set_defaults(handler="specdecode.export.convert:run")
