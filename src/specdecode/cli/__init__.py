"""The `specdecode` command: thin argparse front ends that build configs and call the API.

Flags follow llama.cpp's names. Every user mistake ends with one `error:` line and exit
status 2, never a traceback; so does a command whose optional packages are not installed
(each is imported only by the command that uses it, see `specdecode.errors.EXTRAS`).

Building the parser imports nothing heavy: the flags' defaults and choices come from light
modules (`specdecode.config`, each tool's `flags`), and each command's handler is named as
"module:function", imported only when the command runs (`handler`). So --help, --version and a
mistyped flag answer at once, before torch would have loaded.

This module builds the parser and runs the command chosen; `flags` holds the flag groups of
generate, serve and bench, `settings` turns them into settings and a Pipeline, `commands` holds
those three commands' handlers, and `lookup_flags` the flags of `lookup`.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import os
import sys
import textwrap
from collections.abc import Callable, Sequence
from typing import NoReturn

from specdecode.bench.flags import (
    add_bench_constrained_parser,
    add_bench_draft_parser,
    add_bench_parser,
    add_bench_passes_parser,
)
from specdecode.cli.cache_flags import add_cache_parser
from specdecode.cli.flags import add_generate_parser, add_model_args, add_ngram_args, add_serve_parser
from specdecode.cli.kernels_command import add_kernels_parser
from specdecode.cli.lookup_flags import add_lookup_parser
from specdecode.compare.flags import add_bench_serve_parser
from specdecode.errors import SpecdecodeError, missing_package
from specdecode.export.flags import add_convert_parser, add_export_parser
from specdecode.loadtest import add_loadtest_parser
from specdecode.local import package_version
from specdecode.train.flags import add_eval_parser, add_train_parser


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Each flag's default shown once, after its help, unless the help already says it or there
    is none to show (no value, a switch, a flag absent unless given); epilogs kept as written."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        shown = action.default not in (None, argparse.SUPPRESS) and action.default is not False  # 0 is shown
        if not shown or not action.option_strings or "default" in text:
            return text
        return f"{text} (default: %(default)s)"

    def _split_lines(self, text: str, width: int) -> list[str]:
        return textwrap.wrap(" ".join(text.split()), width, break_on_hyphens=False)  # flags stay whole


class Parser(argparse.ArgumentParser):
    """argparse's parser as every `specdecode` command has it (subcommands inherit the class):
    no abbreviated flags (an abbreviation that a new flag makes ambiguous would break scripts),
    the help formatted alike, and a mistake answered with the usage of the command it was made
    in, then one `error:` line suggesting the closest flag, command or choice."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_args(
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> argparse.Namespace:
        namespace, unknown = self.parse_known_args(args, namespace)
        if unknown:
            self.command_parser(namespace).refuse_unknown(unknown)
        return namespace

    def command_parser(self, namespace: argparse.Namespace) -> Parser:
        """The parser of the innermost (sub)command `namespace` names: all that follows a
        subcommand's name is its own, so an argument none of them took was meant for it."""
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                chosen = action.choices.get(getattr(namespace, action.dest, None))
                if chosen is not None:
                    return chosen.command_parser(namespace)
        return self

    def refuse_unknown(self, unknown: list[str]) -> NoReturn:
        """The arguments no parser took, with the closest flag this parser has to each mistyped one."""
        flags = [flag for action in self._actions for flag in action.option_strings]
        suggestions = {}  # mistyped flag -> the closest flag this parser has
        for word in unknown:
            flag = word.split("=")[0]
            close = difflib.get_close_matches(flag, flags, n=1) if flag.startswith("-") else []
            if close:
                suggestions[flag] = close[0]
        if len(suggestions) == 1:
            hint = f" (did you mean {next(iter(suggestions.values()))}?)"
        elif suggestions:
            pairs = ", ".join(f"{near} for {typed}" for typed, near in suggestions.items())
            hint = f" (did you mean {pairs}?)"
        else:
            hint = ""
        self.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")

    def _check_value(self, action: argparse.Action, value: object) -> None:
        # argparse's own check (a private method, of the same signature in every Python this
        # package supports), suggesting the closest choice rather than listing them all
        if action.choices is None or value in action.choices:
            return
        choices = [str(choice) for choice in action.choices]
        close = difflib.get_close_matches(str(value), choices, n=1)
        hint = f"did you mean {close[0]!r}?" if close else f"choose from {', '.join(choices)}"
        if isinstance(action, argparse._SubParsersAction):
            raise argparse.ArgumentError(None, f"unknown command {value!r} ({hint})")
        raise argparse.ArgumentError(action, f"invalid choice: {value!r} ({hint})")

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"error: {message}\n")


def version() -> str:
    return package_version() or "(version unknown: not installed)"  # a source tree never installed


def build_parser() -> Parser:
    parser = Parser(
        prog="specdecode",
        description="Speculative decoding: faster, identical output.",
        epilog='example:\n  specdecode generate --temp 0 -n 64 -p "def fib(n):"',
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {version()}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_generate_parser(commands)
    bench = add_bench_parser(commands)
    add_model_args(bench)
    add_ngram_args(bench)
    bench.set_defaults(handler="specdecode.cli.commands:run_bench")
    add_serve_parser(commands)
    add_loadtest_parser(commands)
    add_lookup_parser(commands)
    add_train_parser(commands)
    add_export_parser(commands)
    add_convert_parser(commands)
    add_eval_parser(commands)
    add_bench_draft_parser(commands)
    add_bench_passes_parser(commands)
    add_bench_serve_parser(commands)
    add_bench_constrained_parser(commands)
    add_cache_parser(commands)
    add_kernels_parser(commands)
    return parser


def handler(named: Callable[[argparse.Namespace], None] | str) -> Callable[[argparse.Namespace], None]:
    """A command's handler: the function itself, or "module:function" for a command whose module
    is imported only when it runs (so that a flags module imports no command)."""
    if callable(named):
        return named
    module, _, function = named.partition(":")
    return getattr(importlib.import_module(module), function)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.argv = list(argv) if argv is not None else sys.argv[1:]  # what `train --nproc` starts again
    # Loading bars would bury the one line that matters. transformers reads the variable when
    # imported, which a command does only where it needs it (not for a GGUF file on llama.cpp).
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    try:
        if "transformers" in sys.modules:
            from transformers.utils import logging as hf_logging

            hf_logging.disable_progress_bar()
        handler(args.handler)(args)
    except SpecdecodeError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as exc:
        error = missing_package(exc, f"specdecode {args.command}")
        if error is None:
            raise
        print(f"error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0
