"""The flags of `specdecode lookup create|merge|stats`, apart from the tools (`specdecode.lookup`),
which import transformers: each subcommand's handler is named as "module:function".
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.cli.settings import DRAFTING


def add_lookup_parser(commands: argparse._SubParsersAction) -> None:
    """`lookup create|merge|stats`: the files --spec-type ngram-cache reads (-lcs, -lcd)."""
    lookup = commands.add_parser(
        "lookup",
        help="n-gram cache files for --spec-type ngram-cache",
        epilog="example:\n  specdecode lookup create -f corpus.txt -lcs static.lcs",
    )
    tools = lookup.add_subparsers(dest="lookup_command", required=True)
    model_help = "model directory or GGUF file, only its tokenizer is read (default: the bundled target)"

    create = tools.add_parser(
        "create",
        help="static cache of a text corpus (2-grams)",
        epilog="example:\n  specdecode lookup create -f corpus.txt -lcs static.lcs",
    )
    create.add_argument("-m", "--model", type=Path, help=model_help)
    create.add_argument("-f", "--file", type=Path, required=True, help="the text corpus")
    create.add_argument("-lcs", "--lookup-cache-static", type=Path, required=True, help="output cache file")
    create.set_defaults(handler="specdecode.lookup:run_create")

    merge = tools.add_parser(
        "merge",
        help="add the counts of cache files: IN [IN ...] OUT",
        epilog="example:\n  specdecode lookup merge a.lcs b.lcs merged.lcs",
    )
    merge.add_argument("files", nargs="+", type=Path, metavar="FILE", help="input caches, then the output")
    merge.set_defaults(handler="specdecode.lookup:run_merge")

    stats = tools.add_parser(
        "stats",
        help="simulated ngram-cache drafting on a text, no model run",
        epilog="example:\n  specdecode lookup stats -f text.py -lcs static.lcs",
    )
    stats.add_argument("-m", "--model", type=Path, help=model_help)
    stats.add_argument("-f", "--file", type=Path, required=True, help="the text to replay")
    stats.add_argument("-c", "--ctx-size", type=int, default=512, help="tokens per replayed chunk")
    stats.add_argument(
        "--spec-draft-n-max",
        "--draft-max",
        dest="draft_max",
        metavar="N",
        type=int,
        default=DRAFTING.n_max,
        help="draft length",
    )
    stats.add_argument("-lcs", "--lookup-cache-static", type=Path, help="static cache file")
    stats.add_argument(
        "-lcd", "--lookup-cache-dynamic", type=Path, help="dynamic cache file (absent: start empty)"
    )
    stats.set_defaults(handler="specdecode.lookup:run_stats")
