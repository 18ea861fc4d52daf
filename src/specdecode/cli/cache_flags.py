"""The flags of `specdecode cache list|clear`: what the package keeps in the user's cache
(`specdecode.cache`). Each subcommand's handler is named as "module:function"."""

from __future__ import annotations

import argparse

from specdecode.cache import KINDS, LIMIT_VARIABLE


def add_cache_parser(commands: argparse._SubParsersAction) -> None:
    """`cache list|clear`: the GGUF copies, decoded models, tokenizers and timings kept."""
    cache = commands.add_parser(
        "cache",
        help="list or clear what specdecode keeps in its cache (model copies, timings)",
        description=(
            "What specdecode keeps in $XDG_CACHE_HOME/specdecode (~/.cache by default). Large "
            f"copies are written only while the whole cache stays under {LIMIT_VARIABLE} (default 8G)."
        ),
        epilog="examples:\n  specdecode cache list\n  specdecode cache clear --kind gguf-models",
    )
    tools = cache.add_subparsers(dest="cache_command", required=True)
    listing = tools.add_parser(
        "list",
        help="each kind of thing kept: where, how big, what it is, when last used",
        epilog="example:\n  specdecode cache list",
    )
    listing.set_defaults(handler="specdecode.cli.cache_command:run_list")
    clear = tools.add_parser(
        "clear",
        help="remove what is kept (all of it, or one kind); each run writes again what it needs",
        epilog="examples:\n  specdecode cache clear --kind gguf-models\n  specdecode cache clear --dry-run",
    )
    clear.add_argument(
        "--kind",
        choices=list(KINDS),
        action="append",
        help="remove only this kind (repeat for several; default: every kind)",
    )
    clear.add_argument("--dry-run", action="store_true", help="say what would be removed, remove nothing")
    clear.set_defaults(handler="specdecode.cli.cache_command:run_clear")
