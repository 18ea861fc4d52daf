"""The documentation's commands against the command line they document.

`mkdocs build --strict` (in `make test`) checks the site's links; these tests check what it
cannot: that every `specdecode ...` command shown in a shell block still parses (a renamed or
removed flag fails here), and that the generated CLI reference covers every subcommand.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

from specdecode.cli import build_parser
from specdecode.config import parse_spec_types

DOCS = Path(__file__).resolve().parents[1] / "docs"
SHELL_BLOCK = re.compile(r"^ *```(?:sh|bash)\n(.*?)^ *```", re.MULTILINE | re.DOTALL)
ENVIRONMENT = re.compile(r"^(?:[A-Z_]+=\S+ )+")  # LLAMA_CPP_LIB_PATH=... specdecode ...


def shown_commands() -> list[tuple[str, str]]:
    """(page, command line) for every `specdecode` line of the pages' shell blocks."""
    commands = []
    for page in sorted(DOCS.rglob("*.md")):
        for block in SHELL_BLOCK.findall(page.read_text()):
            for line in block.replace("\\\n", " ").splitlines():
                line = ENVIRONMENT.sub("", line.strip())
                if line.startswith("specdecode "):
                    commands.append((str(page.relative_to(DOCS)), line))
    return commands


def load_hook():
    spec = importlib.util.spec_from_file_location("cli_reference", DOCS / "hooks" / "cli_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_docs_show_commands():
    assert len(shown_commands()) > 50


@pytest.mark.parametrize(("page", "command"), shown_commands())
def test_a_shown_command_parses(page: str, command: str):
    words = shlex.split(command, comments=True)
    errors = io.StringIO()
    try:
        with contextlib.redirect_stderr(errors):
            args = build_parser().parse_args(words[1:])
    except SystemExit as stop:
        if stop.code:  # --version exits with 0
            pytest.fail(f"{page}: {command}\n{errors.getvalue()}")
        return
    if getattr(args, "spec_type", None) is not None:
        parse_spec_types(args.spec_type)  # raises SpecdecodeError on an unknown name


def test_the_cli_reference_has_every_subcommand():
    hook = load_hook()
    reference = hook.cli_reference()
    parser = build_parser()
    progs = []
    pending = [parser]
    while pending:
        children = [child for _name, child in hook.subcommands(pending.pop())]
        progs.extend(child.prog for child in children)
        pending.extend(children)
    assert "specdecode generate" in progs and "specdecode train eagle3" in progs
    for prog in progs:
        assert re.search(rf"^#+ {re.escape(prog)}$", reference, re.MULTILINE), prog
    assert "--spec-draft-n-max" in reference


def test_the_cli_page_keeps_its_marker():
    assert load_hook().MARKER in (DOCS / "cli.md").read_text()


def test_subcommands_lists_aliases_once():
    parser = argparse.ArgumentParser(prog="tool")
    commands = parser.add_subparsers()
    commands.add_parser("run", aliases=["r"])
    commands.add_parser("stop")
    assert [name for name, _child in load_hook().subcommands(parser)] == ["run", "stop"]
