"""The command line before any command runs: --help, --version and argument errors answer without
importing torch, transformers or numpy; every parser refuses abbreviations and suggests the flag
or command meant; each default shows once in the help; llama.cpp's current names and the older
ones parse alike.

What a fresh interpreter imports is read from its sys.modules (run in a subprocess, since this
one has long imported torch), never from wall-clock time.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import re
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest

import specdecode
from specdecode.cli import build_parser, main
from specdecode.config import parse_spec_types

HEAVY = ("torch", "transformers", "numpy")


def fresh_interpreter(code: str) -> dict:
    """Run `code` in a new interpreter; it leaves its result in `result`, printed as JSON with
    the heavy packages it imported."""
    script = textwrap.dedent(code) + textwrap.dedent(
        f"""
        import json, sys
        result["heavy"] = sorted(name for name in {HEAVY!r} if name in sys.modules)
        print(json.dumps(result))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def parsers(parser: argparse.ArgumentParser | None = None, path: tuple[str, ...] = ()) -> Iterator:
    """(command words, parser) for the top-level parser and every (sub)command's."""
    parser = parser or build_parser()
    yield path, parser
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                yield from parsers(sub, (*path, name))


COMMANDS = [" ".join(path) for path, _ in parsers()]


def test_building_the_parser_imports_nothing_heavy():
    result = fresh_interpreter(
        """
        from specdecode.cli import build_parser

        build_parser()
        result = {}
        """
    )
    assert result["heavy"] == []


def test_help_and_argument_errors_import_nothing_heavy():
    """Every command's --help, a mistyped flag and a mistyped command, in one interpreter."""
    commands = [command.split() for command in COMMANDS]
    argvs = [[*words, "--help"] for words in commands] + [["generate", "--bogus"], ["genrate"], ["--version"]]
    result = fresh_interpreter(
        f"""
        import contextlib, io
        from specdecode.cli import main

        result = {{"status": []}}
        for argv in {argvs!r}:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                try:
                    main(argv)
                except SystemExit as exc:
                    result["status"].append(exc.code)
        """
    )
    assert result["heavy"] == []
    assert result["status"] == [0] * len(commands) + [2, 2, 0]


def test_version(capsys):
    with pytest.raises(SystemExit) as exit:
        main(["--version"])
    assert exit.value.code == 0
    assert capsys.readouterr().out == f"specdecode {importlib.metadata.version('specdecode')}\n"


@pytest.mark.parametrize(
    ("argv", "usage", "error"),
    [
        (
            ["generate", "-p", "x", "--spec-tpye", "ngram-mod"],
            "usage: specdecode generate ",
            "error: unrecognized arguments: --spec-tpye ngram-mod (did you mean --spec-type?)",
        ),
        (
            ["lookup", "stats", "-f", "text.py", "--draft-mx=4"],
            "usage: specdecode lookup stats ",
            "error: unrecognized arguments: --draft-mx=4 (did you mean --draft-max?)",
        ),
        (["genrate"], "usage: specdecode ", "error: unknown command 'genrate' (did you mean 'generate'?)"),
        (
            ["lookup", "creat"],
            "usage: specdecode lookup ",
            "error: unknown command 'creat' (did you mean 'create'?)",
        ),
        (
            ["generate", "--backend", "nativ"],
            "usage: specdecode generate ",
            "error: argument --backend: invalid choice: 'nativ' (did you mean 'native'?)",
        ),
        # no abbreviations: --draft-m could be --draft-min or --draft-max tomorrow
        (
            ["generate", "--draft-m", "3"],
            "usage: specdecode generate ",
            "error: unrecognized arguments: --draft-m 3 (did you mean --draft-min?)",
        ),
    ],
)
def test_a_mistake_shows_its_command_usage_and_one_error_line(capsys, argv, usage, error):
    with pytest.raises(SystemExit) as exit:
        main(argv)
    assert exit.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert lines[0].startswith(usage)
    assert lines[-1] == error
    assert sum("error:" in line for line in lines) == 1


@pytest.mark.parametrize("command", COMMANDS)
def test_every_parser_refuses_abbreviations_and_shows_each_default_once(command):
    parser = dict((" ".join(path), parser) for path, parser in parsers())[command]
    assert parser.allow_abbrev is False
    text = parser.format_help()
    for help_text in re.split(r"\n  (?=-)", text):  # one option's entry at a time
        assert help_text.count("(default") + help_text.count("; default") <= 1, help_text
    assert "(default: None)" not in text and "(default: False)" not in text
    assert re.search(r"^examples?:$", text, re.MULTILINE)


def test_the_training_flags_each_say_what_they_do():
    parser = dict((" ".join(path), parser) for path, parser in parsers())["train draft"]
    training = next(group for group in parser._action_groups if group.title == "training")
    for action in training._group_actions:
        words = re.sub(r"\(default: [^)]*\)", "", action.help)
        assert len(words.split()) >= 2, action.option_strings


def test_llama_cpp_names_and_the_older_ones_parse_alike():
    assert parse_spec_types("draft-simple") == parse_spec_types("draft") == ["draft"]
    assert parse_spec_types("draft-eagle3, ngram-mod") == parse_spec_types("eagle3,ngram-mod")
    assert parse_spec_types("ngram-mod,draft-eagle3") == ["ngram-mod", "eagle3"]
    assert parse_spec_types("draft-dflash") == parse_spec_types("dflash") == ["dflash"]
    with pytest.raises(specdecode.SpecdecodeError, match="draft-simple, draft-eagle3, draft-dflash"):
        parse_spec_types("draft-bogus")
    parser = build_parser()
    pairs = [
        ("--spec-draft-n-max", "--draft-max", "7", "draft_max", 7),
        ("--spec-draft-n-min", "--draft-min", "2", "draft_min", 2),
        ("--spec-draft-p-min", "--draft-p-min", "0.5", "draft_p_min", 0.5),
        ("--spec-draft-p-split", "--draft-p-split", "0.2", "draft_p_split", 0.2),
    ]
    for command in (["generate"], ["serve"], ["bench"]):
        for new, old, value, dest, expected in pairs:
            assert getattr(parser.parse_args([*command, new, value]), dest) == expected
            assert getattr(parser.parse_args([*command, old, value]), dest) == expected
    for command in (["eval"], ["bench-serve"], ["bench-constrained"], ["lookup", "stats", "-f", "x"]):
        for flag in ("--spec-draft-n-max", "--draft-max"):
            assert parser.parse_args([*command, flag, "5"]).draft_max == 5


def test_the_commands_llama_server_gets_from_export_are_ours_too():
    """`specdecode export` prints llama-server lines; the same flags run our own generate."""
    from specdecode.export.engines import llama_server_command

    for drafter, internal in (("draft", "draft"), ("eagle3", "eagle3")):
        served = llama_server_command(Path("target.gguf"), drafter, Path("drafter.gguf"), 3)
        args = build_parser().parse_args(["generate", *served.command[1:]])
        assert parse_spec_types(args.spec_type) == [internal]
        assert args.draft_max == 3


def test_the_command_samples_by_default_and_the_library_does_not():
    parser = build_parser()
    assert parser.parse_args(["generate"]).temp == parser.parse_args(["serve"]).temp == 0.8
    assert specdecode.SamplingParams().greedy


def test_the_package_names_resolve_where_they_live():
    """`specdecode`'s public names are imported on first use (which keeps the command light):
    each one listed resolves to the object of its home module."""
    assert sorted(specdecode.__all__) == sorted(specdecode._HOMES)
    for name, home in specdecode._HOMES.items():
        assert getattr(specdecode, name) is getattr(importlib.import_module(home), name)
