"""The flags turned into settings and a Pipeline: sampling, the model-free strategies, the
drafting and loading options, and the checks of the files and flags given, shared by the
handlers of generate, serve and bench (`specdecode.cli.commands`).

Apart from the flags, which import this module only for its constants (`DRAFTING`): the heavy
modules are imported inside the functions that load models.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from specdecode.config import (
    DraftModelConfig,
    NgramMapConfig,
    NgramModConfig,
    NgramSettings,
    SamplingParams,
    SuffixConfig,
    parse_spec_types,
)
from specdecode.errors import SpecdecodeError
from specdecode.speculative_config import SpeculativeChoice

if TYPE_CHECKING:
    from specdecode.api import Pipeline
    from specdecode.backends.options import LoadOptions

DRAFTING = DraftModelConfig()  # llama.cpp's classic drafting defaults
# generate's -n; a conversation (-cnv on a terminal) answers until its turn ends, as llama-cli's
DEFAULT_N_PREDICT = 128


def say(message: str) -> None:
    """A start-up phase, on stderr: loading models takes a while, and this shows which step runs."""
    print(f"specdecode: {message}", file=sys.stderr, flush=True)


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
    grammar: only a draft model branches (--draft-n-parallel), only an EAGLE-3 head or a DFlash
    drafter (uses_eagle3) drafts dynamic trees (--draft-tree-tokens, --draft-tree-topk when given)."""
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
                f"{flag} {value} shapes an EAGLE-3 head's trees (or a DFlash drafter's): give a head "
                "(-me DIR) drafting with --spec-type draft-eagle3, or a drafter (-mdf DIR), or draft with "
                "the target's MTP layer (--spec-type draft-mtp)"
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


def speculative_config_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """--speculative-config's JSON object (vLLM's speculative_config, see
    `specdecode.speculative_config`), refused beside the flags that choose the strategy or its
    model otherwise; None when not given."""
    text = getattr(args, "speculative_config", None)
    if text is None:
        return None
    for flag, value in (
        ("-md/--model-draft", args.model_draft),
        ("-me/--model-eagle3", args.model_eagle3),
        ("-mdf/--model-draft-dflash", args.model_draft_dflash),
        ("--spec-type", args.spec_type),
    ):
        if value is not None:
            raise SpecdecodeError(
                f"--speculative-config chooses the strategy and its model: give it without {flag}"
            )
    try:
        config = json.loads(text)
    except json.JSONDecodeError as exc:
        raise SpecdecodeError(f"--speculative-config is not valid JSON: {exc}") from None
    if not isinstance(config, dict):
        example = '{"method": "ngram", "num_speculative_tokens": 5}'
        raise SpecdecodeError(f"--speculative-config takes a JSON object, e.g. '{example}'")
    tokens = config.get("num_speculative_tokens")
    if tokens is not None and args.draft_max != DRAFTING.n_max and tokens != args.draft_max:
        raise SpecdecodeError(
            f"--spec-draft-n-max {args.draft_max} and --speculative-config's num_speculative_tokens "
            f"{tokens} disagree: give the draft length once"
        )
    return config


def pipeline_from_args(args: argparse.Namespace) -> Pipeline:
    """The pipeline the flags describe, each start-up phase said on stderr as it begins."""
    from specdecode.api import Pipeline
    from specdecode.defaults import resolve_dflash, resolve_eagle3, resolve_models
    from specdecode.verdicts import start_verdicts

    speculative = speculative_config_from_args(args)
    if speculative is not None:  # read for the checks below; Pipeline.load reads it again
        choice = SpeculativeChoice.read(speculative, draft_config(args), ngram_from_args(args))
        check_cache_files_used(args, [choice.spec_type])
        check_tree_flags(args, choice.spec_type == "draft", choice.spec_type in ("eagle3", "dflash", "mtp"))
        # without -m, Pipeline.load takes the bundled target, and its draft or head where the
        # config names no model
        sources: dict[str, Any] = {"speculative_config": speculative}
        model = args.model
        args.model = resolve_models(args.model, None)[0]  # what the server reports
    else:
        spec_types = parse_spec_types(args.spec_type) if args.spec_type is not None else None
        if spec_types is None and (args.model_eagle3 is not None or args.model_draft_dflash is not None):
            # -me and -mdf enable their strategies as -md enables draft: all given, all run
            spec_types = [
                name
                for name, given in (
                    ("draft", args.model_draft),
                    ("eagle3", args.model_eagle3),
                    ("dflash", args.model_draft_dflash),
                )
                if given is not None
            ]
        check_cache_files_used(args, spec_types)
        asks_eagle3 = spec_types is not None and "eagle3" in spec_types
        head = resolve_eagle3(args.model, args.model_eagle3) if asks_eagle3 else None
        asks_dflash = spec_types is not None and "dflash" in spec_types
        dflash = resolve_dflash(args.model, args.model_draft_dflash) if asks_dflash else None
        args.model, args.model_draft = resolve_models(args.model, args.model_draft)
        model = args.model
        needs_draft = spec_types is None or "draft" in spec_types
        asks_mtp = spec_types is not None and "mtp" in spec_types  # the target's own layers: no flag
        trees = head is not None or dflash is not None or asks_mtp
        check_tree_flags(args, needs_draft and args.model_draft is not None, trees)
        sources = {
            "draft": args.model_draft if needs_draft else None,
            "eagle3": head,
            "dflash": dflash,
            "spec_types": spec_types,
        }
    target_options, draft_options = load_options(args)
    pipeline = Pipeline.load(
        model,
        **sources,
        eagle3_layer_offset=args.eagle3_layer_offset,
        target_options=target_options,
        draft_options=draft_options,
        progress=say,
        draft_config=draft_config(args),
        ngram=ngram_from_args(args),
        replacements=[tuple(pair) for pair in args.spec_replace] if args.spec_replace else None,
        spec_policy=args.spec_policy,
    )
    if pipeline.eagle3 is not None:
        print_note(pipeline.eagle3.layer_note)
    if pipeline.dflash is not None:
        print_note(pipeline.dflash.layer_note)
    if pipeline.mtp is not None:
        print_note(pipeline.mtp.layer_note)
    for backend in (pipeline.target, pipeline.draft):
        if getattr(backend, "dtype_note", None):  # the dtype "auto" chose, where the CPU decided it
            print_note(backend.dtype_note)
        if getattr(backend, "backend_note", None):  # the backend "auto" chose (llama.cpp or not)
            print_note(backend.backend_note)
    # Backends whose rows may vary with the pass (llama.cpp's, the graph passes) say so up front
    # (asked by name: llama.cpp's module is imported only for GGUF files)
    row_variance_warning = getattr(pipeline.target, "row_variance_warning", None)
    if pipeline.spec_types and row_variance_warning is not None:
        config = pipeline.draft_config
        warning = row_variance_warning(trees=config.n_parallel > 1 or config.tree_tokens > 0)
        if warning is not None:
            print_note(warning, "warning: ")
    for verdict in start_verdicts(pipeline.target, pipeline.spec_types):  # llama.cpp's drafts kept exact
        print_note(verdict.text)
    return pipeline


def print_note(text: str, prefix: str = "note: ") -> None:
    """A `note:` (or `warning:`) on stderr, in lines a terminal shows whole
    (`specdecode.verdicts.note_lines`)."""
    from specdecode.verdicts import note_lines

    print("\n".join(note_lines(text, prefix)), file=sys.stderr)
