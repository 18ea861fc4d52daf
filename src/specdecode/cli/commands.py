"""The handlers of `specdecode generate`, `serve` and `bench`: each reads its flags into settings
(`specdecode.cli.settings`) and runs the engine, importing the heavy modules when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import TYPE_CHECKING

from specdecode.chat import chat_from_args, encode_rendered
from specdecode.cli.settings import (
    draft_config,
    load_options,
    ngram_from_args,
    pipeline_from_args,
    sampling_from_args,
    say,
)
from specdecode.config import parse_spec_types
from specdecode.errors import SpecdecodeError, read_text_file
from specdecode.server.settings import settings_from_args

if TYPE_CHECKING:
    from specdecode.constraints import ConstraintSpec


def read_prompt(args: argparse.Namespace) -> str:
    if args.file is not None:
        prompt = read_text_file(args.file, "prompt file")
        if not prompt:
            raise SpecdecodeError(f"the prompt file {args.file} is empty")
        return prompt
    if args.prompt is None:
        raise SpecdecodeError("no prompt: pass -p TEXT or -f FILE")
    if not args.prompt:
        raise SpecdecodeError('the prompt is empty (-p "")')
    return args.prompt


def constraint_from_args(args: argparse.Namespace) -> ConstraintSpec | None:
    """--grammar, --json-schema or --regex (inline), --grammar-file or --json-schema-file; checked
    for syntax before any model loads (fully, against the tokenizer, when the generation starts)."""
    from specdecode.constraints import ConstraintSpec

    if args.grammar_file is not None:
        spec = ConstraintSpec("grammar", read_text_file(args.grammar_file, "grammar file"))
    elif args.json_schema_file is not None:
        spec = ConstraintSpec("json_schema", read_text_file(args.json_schema_file, "JSON schema file"))
    elif args.grammar is not None:
        spec = ConstraintSpec("grammar", args.grammar)
    elif args.json_schema is not None:
        spec = ConstraintSpec("json_schema", args.json_schema)
    elif args.regex is not None:
        spec = ConstraintSpec("regex", args.regex)
    else:
        if args.spec_type is not None and "forced" in parse_spec_types(args.spec_type):
            raise SpecdecodeError(
                "--spec-type forced drafts what a grammar forces: give --grammar, --json-schema or --regex"
            )
        return None
    try:
        spec.grammar()
    except SpecdecodeError as exc:
        raise inline_file_error(args, exc) from None
    return spec


def inline_file_error(args: argparse.Namespace, error: SpecdecodeError) -> SpecdecodeError:
    """An inline grammar or schema that does not parse but names a file was meant as the file
    (llama.cpp's --grammar and --json-schema were files once): say which flag reads files."""
    for flag, value in (("--grammar", args.grammar), ("--json-schema", args.json_schema)):
        if value is not None and os.path.isfile(value):  # False, not an error, for a long text
            return SpecdecodeError(
                f"{flag} takes the text itself, and {value!r} is not valid as text but is a file: "
                f"give {flag}-file {value}"
            )
    return error


def run_generate(args: argparse.Namespace) -> None:
    from specdecode.generate import GenerationConfig

    started = time.perf_counter()
    prompt = read_prompt(args)  # the flags' mistakes first, before the models load
    chat = chat_from_args(args)
    constraint = constraint_from_args(args)
    sampling = sampling_from_args(args)
    config = GenerationConfig(args.n_predict, tuple(args.stop or ()), args.verify, args.ignore_eos)
    pipeline = pipeline_from_args(args)
    say(f"ready in {time.perf_counter() - started:.1f} s")
    if chat is not None:  # tokenized as the server tokenizes a chat, by the model's tokenizer
        tokenizer = pipeline.target.tokenizer
        prompt = chat.text(tokenizer, prompt, pipeline.target.name)
        pipeline.check_text(prompt, config)  # a template may write megabytes: before tokenizing
        prompt = encode_rendered(tokenizer, prompt)
    run = pipeline.stream(prompt, sampling, config, constraint=constraint)
    for chunk in run:
        if args.stream and not args.json:
            print(chunk.text, end="", flush=True)
    if args.json:
        print(json.dumps({"text": run.text, "tokens": run.tokens, "stats": run.stats.to_dict()}))
        return
    if not args.stream:
        print(run.text, end="")
    print(flush=True)
    if run.stats.stop_reason == "context":
        print(f"note: stopped because the context is full (-c {pipeline.target.n_ctx})", file=sys.stderr)
    print(f"\nseed {run.stats.seed}\n{run.stats.format()}", file=sys.stderr)


def run_serve(args: argparse.Namespace) -> None:
    from specdecode.server import serve  # the HTTP stack: before the socket and the models

    started = time.perf_counter()
    sampling = sampling_from_args(args)
    with serve.listen(args.host, args.port) as sock:
        pipeline = pipeline_from_args(args)
        settings = settings_from_args(args, pipeline, sampling)
        say(f"ready in {time.perf_counter() - started:.1f} s, serving on {serve.address(sock)}")
        serve.run(pipeline, settings, sock)


def run_bench(args: argparse.Namespace) -> None:
    from specdecode.bench import command

    command.run_bench(args, draft_config(args), ngram_from_args(args), *load_options(args))
