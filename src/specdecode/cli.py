"""The `specdecode` command: thin argparse front ends that build configs and call the API.

Flags follow llama.cpp's names. Every user mistake ends with one `error:` line and exit
status 2, never a traceback; so does a command whose optional packages are not installed
(each is imported only by the command that uses it, see `specdecode.errors.EXTRAS`).

Building the parser imports nothing heavy: the flags' defaults and choices come from light
modules (`specdecode.config`, each tool's `flags`), and each command's handler imports what it
runs. So --help, --version and a mistyped flag answer at once, before torch would have loaded.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import json
import os
import sys
import textwrap
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from specdecode.bench.flags import (
    add_bench_constrained_parser,
    add_bench_draft_parser,
    add_bench_parser,
    add_bench_passes_parser,
    add_bench_serve_parser,
)
from specdecode.chat import add_chat_args, chat_from_args, encode_rendered
from specdecode.config import (
    BACKENDS,
    DTYPE_NAMES,
    PASSES,
    PRIORITY,
    SPEC_POLICIES,
    VERIFY_MODES,
    DraftModelConfig,
    NgramMapConfig,
    NgramModConfig,
    NgramSettings,
    SamplingParams,
    SuffixConfig,
    parse_spec_types,
    spec_type_name,
)
from specdecode.errors import SpecdecodeError, missing_package, read_text_file
from specdecode.export.flags import add_convert_parser, add_export_parser
from specdecode.loadtest import add_loadtest_parser
from specdecode.local import package_version
from specdecode.server.settings import add_server_args, settings_from_args
from specdecode.train.flags import add_eval_parser, add_train_parser

if TYPE_CHECKING:
    from specdecode.api import Pipeline
    from specdecode.backends.options import LoadOptions
    from specdecode.constraints import ConstraintSpec

# llama.cpp's sampling default: the command samples unless given --temp 0 (the library's
# SamplingParams is greedy unless asked to sample).
DEFAULT_TEMPERATURE = 0.8
DRAFTING = DraftModelConfig()  # llama.cpp's classic drafting defaults

STRATEGY_HELP = {
    "none": "no speculation: plain generation, one target pass per token",
    "ngram-simple": "prompt lookup: copy what followed the latest earlier occurrence of the last n tokens",
    "ngram-map-k": "ngram-simple through a hashed n-gram index; a key's drafts shrink to what was accepted",
    "ngram-map-k4v": "ngram-map-k counting up to 4 continuations per n-gram; drafts only a dominant one",
    "ngram-mod": "a hashed pool of n-gram -> next token shared by all generations; long drafts (48-64)",
    "ngram-cache": "1- to 4-gram statistics of the context, a dynamic (-lcd) and a static (-lcs) cache file",
    "suffix": "SuffixDecoding: trees of what followed the longest earlier match of the context's end, "
    "in this request and in earlier ones (--spec-suffix-file keeps them)",
    "draft-simple": "a small draft model (-md) of the same vocabulary proposes up to --spec-draft-n-max "
    "tokens (also: draft)",
    "draft-eagle3": "an EAGLE-3 head (-me) over the target's own hidden states proposes up to "
    "--spec-draft-n-max tokens (also: eagle3)",
    "forced": "under --grammar/--json-schema/--regex: the tokens the grammar allows alone (added to any "
    "speculation)",
}


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


def say(message: str) -> None:
    """A start-up phase, on stderr: loading models takes a while, and this shows which step runs."""
    print(f"specdecode: {message}", file=sys.stderr, flush=True)


def add_constraint_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("constrained output (one of)").add_mutually_exclusive_group()
    group.add_argument(
        "--grammar", metavar="TEXT", help="a GBNF grammar, inline (or Lark with a %%llguidance header)"
    )
    group.add_argument("--grammar-file", type=Path, metavar="FILE", help="a file holding the grammar")
    group.add_argument(
        "-j",
        "--json-schema",
        metavar="TEXT",
        help="a JSON schema, inline: the output is one JSON value of it",
    )
    group.add_argument(
        "-jf", "--json-schema-file", type=Path, metavar="FILE", help="a file holding the JSON schema"
    )
    group.add_argument("--regex", metavar="TEXT", help="a regular expression the whole output matches")


def add_model_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("models")
    group.add_argument(
        "-m",
        "--model",
        type=Path,
        help="target model: a local Hugging Face directory or a GGUF file (default: the bundled pair)",
    )
    group.add_argument(
        "-md",
        "--model-draft",
        type=Path,
        help="draft model directory or GGUF file (enables --spec-type draft-simple, and under the "
        "adaptive policy ngram-mod and ngram-map-k4v beside it)",
    )
    group.add_argument(
        "-me",
        "--model-eagle3",
        type=Path,
        help="EAGLE-3 head directory (enables --spec-type draft-eagle3; default with the bundled target: "
        "the bundled head)",
    )
    group.add_argument(
        "--eagle3-layer-offset",
        type=int,
        metavar="N",
        help="read the head's layer ids as the inputs of target layers id + N (default: the offset "
        "the checkpoint's convention implies, printed at load: 0 for vLLM's and llama.cpp's, "
        "1 for SpecForge's 'output of layer' ids)",
    )
    group.add_argument("-c", "--ctx-size", type=int, default=0, help="target context size (0: the model's)")
    group.add_argument(
        "-cd", "--ctx-size-draft", type=int, default=0, help="draft context size (0: the model's)"
    )
    group.add_argument("-b", "--batch-size", type=int, default=512, help="prompt tokens per forward pass")
    group.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    group.add_argument("--device-draft", help="device of the draft (default: --device)")
    group.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES], help="target weights dtype")
    group.add_argument(
        "--dtype-draft", default="auto", choices=["auto", *DTYPE_NAMES], help="draft weights dtype"
    )
    group.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="model forward: native (lean, Llama-family models), hf (transformers'), llama.cpp "
        "(GGUF files, and Llama directories through a GGUF written once; the llama-cpp extra), "
        "auto (llama.cpp for GGUF files where installed, and on a CPU for Llama directories where "
        "the output stays exact, see docs/gguf.md; else native where it runs)",
    )
    group.add_argument(
        "--passes",
        default="auto",
        choices=PASSES,
        help="native forward's passes: invariant (row-invariant, the CPU's), fixed (CUDA graphs of "
        "one row count: chains bit-identical to plain), bucketed (CUDA graphs of power-of-two row "
        "counts: fastest, output may differ at near-ties), auto (fixed on a GPU, else invariant); "
        "llama.cpp: auto/invariant keep drafts to the pass sizes whose rows it probed bit-identical, "
        "bucketed lets passes take any size",
    )
    group.add_argument(
        "-ngl",
        "--gpu-layers",
        type=int,
        help="llama.cpp: layers on the GPU (default: all with --device cuda)",
    )
    group.add_argument("-ngld", "--gpu-layers-draft", type=int, help="llama.cpp: draft layers on the GPU")
    group.add_argument(
        "-nr",
        "--no-repack",
        action="store_true",
        help="llama.cpp: keep the weights in the file's layout, not repacked for its batched CPU kernels",
    )
    group.add_argument("-t", "--threads", type=int, help="CPU threads for the target")
    group.add_argument("-td", "--threads-draft", type=int, help="CPU threads for the draft (default: -t)")


def add_spec_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("speculation")
    group.add_argument("--spec-type", help="comma-separated strategies, tried cheapest first (listed below)")
    group.add_argument(
        "--spec-policy",
        choices=SPEC_POLICIES,
        default="adaptive",
        help="classic: llama.cpp's fixed chain, --spec-draft-p-min and --spec-draft-n-max; adaptive: "
        "each step drafts the strategy and length with the most expected tokens per second, from "
        "pass costs timed at load and acceptance measured as it runs (--spec-draft-n-max caps the "
        "length; with tree settings it sizes each tree)",
    )
    group.add_argument(
        "--spec-draft-n-max",
        "--draft-max",
        dest="draft_max",
        metavar="N",
        type=int,
        default=DRAFTING.n_max,
        help="most tokens a draft holds (default: %(default)s, llama.cpp's classic default, a cap for "
        "the adaptive policy; current llama.cpp's is 3)",
    )
    group.add_argument(
        "--spec-draft-n-min",
        "--draft-min",
        dest="draft_min",
        metavar="N",
        type=int,
        default=DRAFTING.n_min,
        help="drop drafts shorter than this",
    )
    group.add_argument(
        "--spec-draft-p-min",
        "--draft-p-min",
        dest="draft_p_min",
        metavar="P",
        type=float,
        default=DRAFTING.p_min,
        help="stop drafting when the draft's top-1 probability is below this (default: %(default)s, "
        "llama.cpp's classic default; current llama.cpp's is 0)",
    )
    group.add_argument(
        "--draft-n-parallel",
        type=int,
        default=DRAFTING.n_parallel,
        help="draft-model trees: most branches (1: a chain); a tree holds at most --spec-draft-n-max nodes",
    )
    group.add_argument(
        "--spec-draft-p-split",
        "--draft-p-split",
        dest="draft_p_split",
        metavar="P",
        type=float,
        default=DRAFTING.p_split,
        help="draft-model trees: a candidate above this probability opens a branch",
    )
    group.add_argument(
        "--draft-tree-tokens",
        type=int,
        default=DRAFTING.tree_tokens,
        help="EAGLE-3 dynamic tree: nodes per draft (0: a chain); --spec-draft-n-max is then its depth, "
        "and --spec-draft-p-min does not apply",
    )
    group.add_argument(
        "--draft-tree-topk",
        type=int,
        default=argparse.SUPPRESS,  # absent when not given: giving it without a head is refused
        help=f"EAGLE-3 dynamic tree: nodes expanded per depth, and children of each "
        f"(default: {DRAFTING.tree_topk})",
    )
    group.add_argument(
        "--verify",
        choices=VERIFY_MODES,
        default="match",
        help="match: sample the target and keep equal draft tokens (same output as plain "
        "generation for a seed); rejection: speculative sampling, accepts more at temp > 0",
    )
    group.add_argument(
        "--spec-replace",
        nargs=2,
        action="append",
        metavar=("TARGET", "DRAFT"),
        help="use a draft with another vocabulary through text, replacing TARGET by DRAFT",
    )
    add_ngram_args(parser)


def add_ngram_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("model-free strategies (llama.cpp names and defaults)")
    defaults = NgramSettings()
    for name, config in (
        ("simple", defaults.simple),
        ("map-k", defaults.map_k),
        ("map-k4v", defaults.map_k4v),
    ):
        flag = f"--spec-ngram-{name}"
        group.add_argument(f"{flag}-size-n", type=int, default=config.size_n, help="tokens matched")
        group.add_argument(f"{flag}-size-m", type=int, default=config.size_m, help="tokens drafted at most")
        group.add_argument(
            f"{flag}-min-hits", type=int, default=config.min_hits, help="hits before drafting (k4v)"
        )
    mod = defaults.mod
    group.add_argument(
        "--spec-ngram-mod-n-match", type=int, default=mod.n_match, help="ngram-mod: tokens hashed"
    )
    group.add_argument(
        "--spec-ngram-mod-n-min", type=int, default=mod.n_min, help="ngram-mod: shortest draft"
    )
    group.add_argument("--spec-ngram-mod-n-max", type=int, default=mod.n_max, help="ngram-mod: longest draft")
    group.add_argument(
        "-lcs", "--lookup-cache-static", type=Path, help="ngram-cache: static cache file (read)"
    )
    group.add_argument(
        "-lcd",
        "--lookup-cache-dynamic",
        type=Path,
        help="ngram-cache: dynamic cache file (read, updated, saved after each generation)",
    )
    add_suffix_args(parser)


def add_suffix_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("suffix strategy (SuffixDecoding's defaults)")
    suffix = SuffixConfig()
    group.add_argument(
        "--spec-suffix-max-depth",
        type=int,
        default=suffix.max_depth,
        help="suffix: deepest draft, and longest suffix matched",
    )
    group.add_argument(
        "--spec-suffix-factor",
        type=float,
        default=suffix.factor,
        help="suffix: draft nodes per matched token (a longer match drafts more)",
    )
    group.add_argument(
        "--spec-suffix-min-prob",
        type=float,
        default=suffix.min_prob,
        help="suffix: least frequency of a node among its parent's continuations",
    )
    group.add_argument(
        "--spec-suffix-max-nodes", type=int, default=suffix.max_nodes, help="suffix: most draft nodes"
    )
    group.add_argument(
        "--spec-suffix-cache-mb",
        type=float,
        default=suffix.cache_mb,
        help="suffix: memory for earlier requests (oldest evicted first; 0: this request only)",
    )
    group.add_argument(
        "--spec-suffix-file",
        type=Path,
        help="suffix: earlier requests' file (read, updated, saved after each generation)",
    )


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    d = SamplingParams()
    group = parser.add_argument_group("sampling (llama.cpp's defaults)")
    group.add_argument(
        "--temp", type=float, default=DEFAULT_TEMPERATURE, help="temperature, <= 0 greedy (--temp 0)"
    )
    group.add_argument("--top-k", type=int, default=d.top_k, help="top-k, 0 off")
    group.add_argument("--top-p", type=float, default=d.top_p, help="top-p, 1 off")
    group.add_argument("--min-p", type=float, default=d.min_p, help="min-p, 0 off")
    group.add_argument("--repeat-penalty", type=float, default=d.repeat_penalty, help="1 off")
    group.add_argument("--repeat-last-n", type=int, default=d.repeat_last_n, help="penalty window, -1 all")
    group.add_argument("--presence-penalty", type=float, default=d.presence_penalty, help="0 off")
    group.add_argument("--frequency-penalty", type=float, default=d.frequency_penalty, help="0 off")
    group.add_argument("-s", "--seed", type=int, help="random seed (default: random, printed in the stats)")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        temperature=args.temp,
        top_k=args.top_k,
        top_p=args.top_p,
        min_p=args.min_p,
        repeat_penalty=args.repeat_penalty,
        repeat_last_n=args.repeat_last_n,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        seed=args.seed,
    )


# The files the model-free strategies keep, by flag; -lcd and --spec-suffix-file are rewritten
# after every generation, so no other file may share their path.
CACHE_FILE_FLAGS = {
    "lookup_cache_static": "-lcs/--lookup-cache-static",
    "lookup_cache_dynamic": "-lcd/--lookup-cache-dynamic",
    "spec_suffix_file": "--spec-suffix-file",
}
INPUT_FILE_FLAGS = {
    "file": "-f/--file",
    "chat_template_file": "--chat-template-file",
    "grammar_file": "--grammar-file",
    "json_schema_file": "-jf/--json-schema-file",
    "model": "-m/--model",
    "model_draft": "-md/--model-draft",
}


def check_distinct_files(args: argparse.Namespace) -> None:
    """Refuse one path given for two files, where one of them is a cache file: the cache
    written after a generation would overwrite the other, and the next run would fail on it."""
    given = []
    for dest, flag in {**CACHE_FILE_FLAGS, **INPUT_FILE_FLAGS}.items():
        value = getattr(args, dest, None)
        values = value if isinstance(value, list) else [value] if value is not None else []  # bench's -f
        given += [(flag, Path(path)) for path in values]
    caches = set(CACHE_FILE_FLAGS.values())
    for i, (flag, path) in enumerate(given):
        for other, other_path in given[i + 1 :]:
            if (flag in caches or other in caches) and _same_file(path, other_path):
                raise SpecdecodeError(
                    f"{flag} and {other} name the same file ({path}): give each its own path"
                )


def _same_file(one: Path, other: Path) -> bool:
    """Whether two paths name one file: the same path once resolved, or one file by two names."""
    if one.resolve() == other.resolve():
        return True
    try:
        return os.path.samefile(one, other)
    except OSError:  # either is absent (a cache file made at the end) or unreadable
        return False


def check_cache_files_used(args: argparse.Namespace, spec_types: Sequence[str] | None) -> None:
    """Refuse a cache file flag whose strategy is not in the chain (spec_types: the parsed
    --spec-type, None when not given): its file would be neither read nor written, silently,
    as a template file without --chat would be."""
    names = spec_types or []
    for dest, strategy in (
        ("lookup_cache_static", "ngram-cache"),
        ("lookup_cache_dynamic", "ngram-cache"),
        ("spec_suffix_file", "suffix"),
    ):
        if getattr(args, dest) is not None and strategy not in names:
            raise SpecdecodeError(
                f"{CACHE_FILE_FLAGS[dest]} is a file of the {strategy} strategy, which is not in the "
                f"chain: add it to --spec-type (e.g. --spec-type {strategy})"
            )


def ngram_from_args(args: argparse.Namespace) -> NgramSettings:
    check_distinct_files(args)

    def map_config(name: str) -> NgramMapConfig:
        prefix = f"spec_ngram_{name}_"
        return NgramMapConfig(*(getattr(args, prefix + field) for field in ("size_n", "size_m", "min_hits")))

    return NgramSettings(
        simple=map_config("simple"),
        map_k=map_config("map_k"),
        map_k4v=map_config("map_k4v"),
        mod=NgramModConfig(args.spec_ngram_mod_n_match, args.spec_ngram_mod_n_min, args.spec_ngram_mod_n_max),
        cache_static=args.lookup_cache_static,
        cache_dynamic=args.lookup_cache_dynamic,
        suffix=SuffixConfig(
            args.spec_suffix_max_depth,
            args.spec_suffix_factor,
            args.spec_suffix_min_prob,
            args.spec_suffix_max_nodes,
            args.spec_suffix_cache_mb,
        ),
        suffix_file=args.spec_suffix_file,
    )


def draft_config(args: argparse.Namespace) -> DraftModelConfig:
    """The draft model's and EAGLE-3 head's drafting settings from the flags."""
    return DraftModelConfig(
        args.draft_max,
        args.draft_min,
        args.draft_p_min,
        p_split=args.draft_p_split,
        n_parallel=args.draft_n_parallel,
        tree_tokens=args.draft_tree_tokens,
        tree_topk=getattr(args, "draft_tree_topk", DRAFTING.tree_topk),
    )


def check_tree_flags(args: argparse.Namespace, uses_draft: bool, uses_eagle3: bool) -> None:
    """Refuse tree flags that would change nothing, as --spec-type forced is refused without a
    grammar: only a draft model branches (--draft-n-parallel), only an EAGLE-3 head drafts
    dynamic trees (--draft-tree-tokens, --draft-tree-topk when given)."""
    if args.draft_n_parallel > 1 and not uses_draft:
        raise SpecdecodeError(
            f"--draft-n-parallel {args.draft_n_parallel} branches a draft model's drafts: "
            "give a draft model (-md DIR) drafting with --spec-type draft-simple"
        )
    for flag, value, given in (
        ("--draft-tree-tokens", args.draft_tree_tokens, args.draft_tree_tokens > 0),
        ("--draft-tree-topk", getattr(args, "draft_tree_topk", None), hasattr(args, "draft_tree_topk")),
    ):
        if given and not uses_eagle3:
            raise SpecdecodeError(
                f"{flag} {value} shapes an EAGLE-3 head's trees: give a head (-me DIR) drafting "
                "with --spec-type draft-eagle3"
            )


def load_options(args: argparse.Namespace) -> tuple[LoadOptions, LoadOptions]:
    """The target's and the draft's loading options (the draft's default to the target's)."""
    from specdecode.backends.options import LoadOptions

    for flag, value, least in (
        ("-c/--ctx-size", args.ctx_size, 0),
        ("-cd/--ctx-size-draft", args.ctx_size_draft, 0),
        ("-b/--batch-size", args.batch_size, 1),
        ("-t/--threads", args.threads, 1),
        ("-td/--threads-draft", args.threads_draft, 1),
    ):
        if value is not None and value < least:
            raise SpecdecodeError(f"{flag} must be >= {least}, not {value}")
    target = LoadOptions(
        args.device,
        args.dtype,
        args.threads,
        args.ctx_size,
        args.batch_size,
        backend=args.backend,
        gpu_layers=args.gpu_layers,
        repack=not args.no_repack,
        passes=args.passes,
    )
    draft = LoadOptions(
        args.device_draft or args.device,
        args.dtype_draft,
        args.threads_draft or args.threads,
        args.ctx_size_draft,
        args.batch_size,
        backend=args.backend,
        gpu_layers=args.gpu_layers_draft if args.gpu_layers_draft is not None else args.gpu_layers,
        repack=not args.no_repack,
        passes=args.passes,
    )
    return target, draft


def pipeline_from_args(args: argparse.Namespace) -> Pipeline:
    """The pipeline the flags describe, each start-up phase said on stderr as it begins."""
    from specdecode.api import Pipeline
    from specdecode.defaults import resolve_eagle3, resolve_models

    spec_types = parse_spec_types(args.spec_type) if args.spec_type is not None else None
    if spec_types is None and args.model_eagle3 is not None:
        # -me enables eagle3 as -md enables draft: both given, both run (draft first)
        spec_types = (["draft"] if args.model_draft is not None else []) + ["eagle3"]
    check_cache_files_used(args, spec_types)
    head = resolve_eagle3(args.model, args.model_eagle3) if spec_types and "eagle3" in spec_types else None
    args.model, args.model_draft = resolve_models(args.model, args.model_draft)
    target_options, draft_options = load_options(args)
    needs_draft = spec_types is None or "draft" in spec_types
    check_tree_flags(args, needs_draft and args.model_draft is not None, head is not None)
    pipeline = Pipeline.load(
        args.model,
        args.model_draft if needs_draft else None,
        eagle3=head,
        eagle3_layer_offset=args.eagle3_layer_offset,
        target_options=target_options,
        draft_options=draft_options,
        progress=say,
        spec_types=spec_types,
        draft_config=draft_config(args),
        ngram=ngram_from_args(args),
        replacements=[tuple(pair) for pair in args.spec_replace] if args.spec_replace else None,
        spec_policy=args.spec_policy,
    )
    if pipeline.eagle3 is not None:
        print(f"note: {pipeline.eagle3.layer_note}", file=sys.stderr)
    for backend in (pipeline.target, pipeline.draft):
        if getattr(backend, "dtype_note", None):  # the dtype "auto" chose, where the CPU decided it
            print(f"note: {backend.dtype_note}", file=sys.stderr)
        if getattr(backend, "backend_note", None):  # the backend "auto" chose (llama.cpp or not)
            print(f"note: {backend.backend_note}", file=sys.stderr)
    # Backends whose rows may vary with the pass (llama.cpp's, the graph passes) say so up front
    # (asked by name: llama.cpp's module is imported only for GGUF files)
    row_variance_warning = getattr(pipeline.target, "row_variance_warning", None)
    if pipeline.spec_types and row_variance_warning is not None:
        config = pipeline.draft_config
        warning = row_variance_warning(trees=config.n_parallel > 1 or config.tree_tokens > 0)
        if warning is not None:
            print(f"warning: {warning}", file=sys.stderr)
    row_cap_note = getattr(pipeline.target, "row_cap_note", None)  # llama.cpp's drafts kept exact
    if pipeline.spec_types and row_cap_note is not None and (note := row_cap_note()) is not None:
        print(f"note: {note}", file=sys.stderr)
    return pipeline


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


def strategies_epilog() -> str:
    """One entry per strategy, by the name --spec-type takes (llama.cpp's current one)."""
    names = [spec_type_name(name) for name in ("none", *PRIORITY)]
    entries = [
        textwrap.fill(
            STRATEGY_HELP[name],
            100,
            initial_indent=f"  {name:<14} ",
            subsequent_indent=" " * 17,
            break_on_hyphens=False,  # flags stay whole
        )
        for name in names
    ]
    return "strategies (--spec-type, any comma-separated combination):\n" + "\n".join(entries)


def add_generate_parser(commands: argparse._SubParsersAction) -> None:
    gen = commands.add_parser(
        "generate",
        help="generate a continuation of a prompt",
        usage="%(prog)s [-p PROMPT | -f FILE] [options]",
        description="Generate a continuation of a prompt, speculatively: the same text as plain generation,\n"
        "in fewer target passes. Speculation pays most at temperature 0 (--temp 0).",
        epilog=strategies_epilog() + '\n\nexample:\n  specdecode generate --temp 0 -n 64 -p "def fib(n):"',
    )
    gen.add_argument("-p", "--prompt", help="prompt text")
    gen.add_argument("-f", "--file", help="read the prompt from a file")
    gen.add_argument("-n", "--n-predict", type=int, default=128, help="tokens to generate, -1 until EOS")
    gen.add_argument("--stop", action="append", help="stop when this text appears (repeatable)")
    gen.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens"
    )
    gen.add_argument("--stream", action="store_true", help="print text as tokens are accepted")
    gen.add_argument("--json", action="store_true", help='print one JSON object {"text", "tokens", "stats"}')
    add_chat_args(gen.add_argument_group("chat models"))
    add_constraint_args(gen)
    add_model_args(gen)
    add_spec_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(handler=run_generate)


def add_serve_parser(commands: argparse._SubParsersAction) -> None:
    srv = commands.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server (completions, chat) with speculative decoding",
        usage="%(prog)s [--host HOST] [--port PORT] [options]",
        epilog=strategies_epilog() + "\n\nexample:\n  specdecode serve --port 8080 --temp 0",
    )
    add_server_args(srv)
    add_model_args(srv)
    add_spec_args(srv)
    add_sampling_args(srv)
    srv.set_defaults(handler=run_serve)


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
    create.set_defaults(handler=run_lookup)

    merge = tools.add_parser(
        "merge",
        help="add the counts of cache files: IN [IN ...] OUT",
        epilog="example:\n  specdecode lookup merge a.lcs b.lcs merged.lcs",
    )
    merge.add_argument("files", nargs="+", type=Path, metavar="FILE", help="input caches, then the output")
    merge.set_defaults(handler=run_lookup)

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
    stats.set_defaults(handler=run_lookup)


def run_lookup(args: argparse.Namespace) -> None:
    from specdecode import lookup

    handlers = {"create": lookup.run_create, "merge": lookup.run_merge, "stats": lookup.run_stats}
    handlers[args.lookup_command](args)


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
    bench.set_defaults(handler=run_bench)
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


if __name__ == "__main__":
    sys.exit(main())
