"""MkDocs hook: fill docs/cli.md with the --help text of every subcommand, read from the parsers.

The reference is generated at build time so that it can never drift from the command line: a
flag added, renamed or documented in the code shows on the site at the next build.
"""

from __future__ import annotations

import argparse
import os

MARKER = "<!-- cli-reference -->"
PAGE = "cli.md"
HELP_WIDTH = "100"  # argparse wraps to $COLUMNS; fixed so the page is the same on every terminal


def subcommands(parser: argparse.ArgumentParser) -> list[tuple[str, argparse.ArgumentParser]]:
    """The parser's subcommands as (name, parser), in the order they were added, aliases once."""
    found: list[tuple[str, argparse.ArgumentParser]] = []
    seen: set[int] = set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, child in action.choices.items():
                if id(child) not in seen:
                    seen.add(id(child))
                    found.append((name, child))
    return found


def reference(parser: argparse.ArgumentParser, depth: int = 3) -> list[str]:
    """A heading and a fenced help text per subcommand, nested subcommands one level deeper."""
    sections: list[str] = []
    for _name, child in subcommands(parser):
        sections.append(f"{'#' * depth} {child.prog}\n\n```text\n{child.format_help().rstrip()}\n```\n")
        sections.extend(reference(child, depth + 1))
    return sections


def cli_reference() -> str:
    os.environ["COLUMNS"] = HELP_WIDTH
    from specdecode.cli import build_parser  # imported here: mkdocs loads hooks before any page

    parser = build_parser()
    top = f"```text\n{parser.format_help().rstrip()}\n```\n"
    return "\n".join([top, *reference(parser)])


def on_page_markdown(markdown: str, page, config, files) -> str:
    if page.file.src_uri != PAGE:
        return markdown
    if MARKER not in markdown:
        raise ValueError(f"{PAGE} has lost its marker {MARKER}: the CLI reference has nowhere to go")
    return markdown.replace(MARKER, cli_reference())
