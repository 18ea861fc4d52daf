"""The handlers of `specdecode generate`, `serve` and `bench`: each reads its flags into settings
(`specdecode.cli.settings`) and runs the engine, importing the heavy modules when it runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.chat import ChatPrompt, chat_from_args
from specdecode.cli.conversation import Conversation, Echo, chat_prompt_ids, interrupted, wants_conversation
from specdecode.cli.settings import (
    DEFAULT_N_PREDICT,
    draft_config,
    load_options,
    ngram_from_args,
    pipeline_from_args,
    print_note,
    sampling_from_args,
    say,
)
from specdecode.config import parse_spec_types
from specdecode.errors import SpecdecodeError, read_text_file
from specdecode.server.settings import settings_from_args

if TYPE_CHECKING:
    from specdecode.api import Pipeline
    from specdecode.constraints import ConstraintSpec
    from specdecode.generate import Generation, GenerationConfig
    from specdecode.stats import SpeculationVerdict


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
    """Every check of the flags, files and metadata first, then the models, the tokenizer and
    the prompt's tokens, each long phase said as it begins; after "ready", only generation."""
    started = time.perf_counter()
    conversing = wants_conversation(args)  # -cnv, no prompt, a terminal: llama-cli's conversation
    prompt = None if conversing else read_prompt(args)  # the flags' mistakes first, before the models load
    chat = chat_from_args(args)
    if chat is not None:
        check_stored_template(args, chat)
    import_torch()
    from specdecode.generate import GenerationConfig

    constraint = constraint_from_args(args)
    sampling = sampling_from_args(args)
    n_predict = args.n_predict if args.n_predict is not None else -1 if conversing else DEFAULT_N_PREDICT
    config = GenerationConfig(n_predict, tuple(args.stop or ()), args.verify, args.ignore_eos)
    pipeline = pipeline_from_args(args)
    prompt = prepare(pipeline, chat, constraint, prompt, config)
    say(f"ready in {time.perf_counter() - started:.1f} s")
    if conversing:
        Conversation(pipeline, chat, sampling, config, constraint).run()
        return
    run = pipeline.stream(prompt, sampling, config, constraint=constraint)
    echo = Echo(sys.stdout)
    try:
        if not args.json and (args.stream or sys.stdout.isatty()):  # a terminal sees text as it comes
            echo.show(run)
        else:
            for _ in run:
                pass
    except KeyboardInterrupt:  # Ctrl-C: the text so far and the statistics, then status 130
        interrupted(run)
        print_generation(args, pipeline, run, echo.written)
        raise
    print_generation(args, pipeline, run, echo.written)


def prepare(
    pipeline: Pipeline,
    chat: ChatPrompt | None,
    constraint: ConstraintSpec | None,
    prompt: str | None,
    config: GenerationConfig,
) -> list[int] | None:
    """What generate does between loading and "ready", so that only generation follows it: the
    target's tokenizer (a GGUF file's read or built, said by the backend), the chat template
    checked, the grammar compiled against the vocabulary, and the prompt's tokens (None for a
    conversation, whose messages come later)."""
    if chat is not None:
        chat.check(pipeline.target.tokenizer, pipeline.target.name)
    if constraint is not None:  # llguidance's view of the vocabulary: seconds, made once
        from specdecode.constraints import Constraint

        pipeline.target.tokenizer  # noqa: B018  (read first: its own line, where it is long)
        say("compiling the grammar for the target's vocabulary")
        Constraint.for_backend(constraint, pipeline.target)
    if prompt is None:
        pipeline.check_text("")  # its one pass over the vocabulary, before the first message
        return None
    # a template may write megabytes: measured before it is tokenized, as any prompt text
    return chat_prompt_ids(pipeline, chat, prompt, config) if chat else pipeline.encode(prompt, config)


def import_torch() -> None:
    """PyTorch's import, said as a start-up phase where it has not happened yet: the first thing
    a start-up waits for, a second or two on an idle machine and several on a busy one, after the
    checks that need no torch."""
    if "torch" not in sys.modules:
        say("importing PyTorch")
        import torch  # noqa: F401  (imported for the time it takes, said above)


def check_stored_template(args: argparse.Namespace, chat: ChatPrompt) -> None:
    """--chat on a model whose files carry no chat template (and no --chat-template-file): an
    error read from the files (a GGUF file's metadata), before any model loads."""
    if args.model is not None:
        path = Path(args.model)
        chat.check_files(path, path.stem if path.is_file() else path.name)
    else:  # the bundled target, whose tokenizer files lie unpacked in the package
        import_torch()  # which the bundled models' module imports
        from specdecode.defaults import BUNDLED

        chat.check_files(BUNDLED / "target", "the default model (no -m)")


def print_generation(args: argparse.Namespace, pipeline: Pipeline, run: Generation, written: str) -> None:
    """The text not `written` yet and the statistics; with --json, one JSON object of both."""
    if args.json:
        print(json.dumps({"text": run.text, "tokens": run.tokens, "stats": run.stats.to_dict()}))
        return
    print(run.text[len(written) :], flush=True)
    if run.stats.stop_reason == "context":
        print(f"note: stopped because the context is full (-c {pipeline.target.n_ctx})", file=sys.stderr)
    print(f"\nseed {run.stats.seed}\n{run.stats.format()}", file=sys.stderr)
    print_verdicts(pipeline, run.stats.verdicts)


def print_verdicts(pipeline: Pipeline, verdicts: Sequence[SpeculationVerdict]) -> None:
    """Why drafting was little or held short, once: a reason said at start is not said again."""
    from specdecode.verdicts import start_verdicts

    said = {verdict.code for verdict in start_verdicts(pipeline.target, pipeline.spec_types)}
    for verdict in verdicts:
        if verdict.code not in said:
            print_note(verdict.text)


def run_serve(args: argparse.Namespace) -> None:
    import_torch()
    from specdecode.server import serve  # the HTTP stack: before the socket and the models

    started = time.perf_counter()
    sampling = sampling_from_args(args)
    with serve.listen(args.host, args.port) as sock:
        pipeline = pipeline_from_args(args)
        settings = settings_from_args(args, pipeline, sampling)
        # the routes' tokenizer (a GGUF file's is built on first use: minutes for a large
        # vocabulary, said by the backend) before "ready", not in the first request
        pipeline.target.tokenizer  # noqa: B018
        say(f"ready in {time.perf_counter() - started:.1f} s, serving on {serve.address(sock)}")
        serve.run(pipeline, settings, sock)


def run_bench(args: argparse.Namespace) -> None:
    from specdecode.bench import command

    command.run_bench(args, draft_config(args), ngram_from_args(args), *load_options(args))
