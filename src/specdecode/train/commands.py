"""`specdecode train tokenizer|target|draft|eagle3`: the command line over the training modules.

The default corpus is the Python standard library's train split (see `corpus`); `--data`
trains on your own text or code instead (a file, or a directory of files). Token streams
are encoded once and kept beside the output (`tokens-train.npy`), so a resumed run does not
encode again; they are written there only once the arguments, the models and the corpus have
been checked, so a refused run leaves `--out` as it was. `train eagle3 --calibrate-only` fits
the confidence scale of the head already in `--out` without training it.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable
from dataclasses import fields
from pathlib import Path

import numpy as np
from transformers import PreTrainedTokenizerBase

from specdecode.backends.hf import load_tokenizer
from specdecode.errors import SpecdecodeError
from specdecode.train import distributed
from specdecode.train.corpus import corpus_files, encode_files, split_files, stdlib_root
from specdecode.train.eagle3 import (
    EAGLE3_SHAPE,
    NEW_TOKENS,
    PREFIX_TOKENS,
    HeadShape,
    calibrate_saved_head,
    train_eagle3,
)
from specdecode.train.lm import DRAFT_SHAPE, TARGET_SHAPE, TrainConfig, train_draft, train_target
from specdecode.train.tokenizer import train_tokenizer

TOKENS_FILE = "tokens-train.npy"


def data_files(data: Path | None) -> list[Path]:
    """--data (a file or a directory of files), or the standard library's train split."""
    if data is None:
        root = stdlib_root()
        return split_files(corpus_files(root), root)[0]
    if data.is_file():
        return [data]
    if data.is_dir():
        files = sorted(p for p in data.rglob("*") if p.is_file())
        if files:
            return files
    raise SpecdecodeError(f"no training data at {data} (give a text file or a directory of files)")


def training_tokens(tokenizer: PreTrainedTokenizerBase, args: argparse.Namespace) -> np.ndarray:
    """The encoded corpus: the output directory's copy when an earlier run kept one there."""
    cache = args.out / TOKENS_FILE
    if cache.exists():
        return np.load(cache)
    tokens = encode_files(tokenizer, data_files(args.data))
    print(f"corpus: {len(tokens):,} tokens", file=sys.stderr)
    return tokens


def keep_tokens(tokens: np.ndarray, args: argparse.Namespace) -> Callable[[], None]:
    """What the training loop calls once the run is checked: keep the encoded corpus in --out."""

    def keep() -> None:
        cache = args.out / TOKENS_FILE
        if not cache.exists():
            args.out.mkdir(parents=True, exist_ok=True)
            partial = cache.with_suffix(".partial.npy")
            np.save(partial, tokens)
            os.replace(partial, cache)  # other processes of the run may be reading it

    return keep


def config_from_args(args: argparse.Namespace) -> TrainConfig:
    given = {f.name: getattr(args, f.name) for f in fields(TrainConfig) if getattr(args, f.name) is not None}
    return TrainConfig(**given)


def run_tokenizer(args: argparse.Namespace) -> None:
    out = train_tokenizer(args.out, args.vocab_size, data_files(args.data) if args.data else None)
    print(f"tokenizer -> {out}", file=sys.stderr)


def run_target(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    tokenizer = load_tokenizer(args.tokenizer)
    tokens = training_tokens(tokenizer, args)
    on_start = keep_tokens(tokens, args)
    out = train_target(tokens, tokenizer, args.out, TARGET_SHAPE, config, on_start=on_start)
    print(f"target -> {out}", file=sys.stderr)


def run_draft(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    tokenizer = load_tokenizer(args.target)
    tokens = training_tokens(tokenizer, args)
    out = train_draft(tokens, args.target, args.out, DRAFT_SHAPE, config, on_start=keep_tokens(tokens, args))
    print(f"draft -> {out}", file=sys.stderr)


def run_eagle3(args: argparse.Namespace) -> None:
    if args.calibrate_only:
        run_eagle3_calibration(args)
        return
    config = config_from_args(args)
    shape = HeadShape(
        heads=args.heads,
        kv_heads=args.kv_heads,
        intermediate=args.intermediate,
        draft_vocab=args.draft_vocab,
        unroll=args.unroll,
        layer_ids=_layer_ids(args.layer_ids),
    )
    tokens = training_tokens(load_tokenizer(args.target), args)
    out = train_eagle3(
        tokens,
        args.target,
        args.out,
        shape,
        config,
        generated_tokens=args.generated_tokens,
        on_start=keep_tokens(tokens, args),
    )
    print(f"EAGLE-3 head -> {out}", file=sys.stderr)


def run_eagle3_calibration(args: argparse.Namespace) -> None:
    """Calibrate the head in --out in place. The corpus is not cached there: --out may be a
    shipped head's directory, which holds the head's files alone."""
    record = calibrate_saved_head(
        args.target,
        args.out,
        lambda tokenizer: training_tokens(tokenizer, args),
        args.unroll,
        config_from_args(args),
    )
    print(json.dumps(record, indent=1))
    print(
        f"EAGLE-3 head calibrated -> {args.out} (scale {record['scale']:.3f}; agreement "
        f"{record['agreement']:.3f}, mean confidence {record['mean_confidence_before']:.3f} -> "
        f"{record['mean_confidence_after']:.3f})",
        file=sys.stderr,
    )


def _layer_ids(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise SpecdecodeError(f"--layer-ids takes comma-separated integers, not {text!r}") from None


def distributed_entry(handler: Callable[[argparse.Namespace], None]) -> Callable[[argparse.Namespace], None]:
    """`handler` in --nproc processes under torchrun (see `distributed`), or in this one."""

    def run(args: argparse.Namespace) -> None:
        if args.nproc < 1:
            raise SpecdecodeError(f"--nproc must be >= 1, not {args.nproc}")
        if args.nproc == 1 or distributed.launched():
            try:
                handler(args)
            finally:
                distributed.finish()
            return
        if getattr(args, "calibrate_only", False):
            raise SpecdecodeError("--calibrate-only runs in one process (no --nproc)")
        config = config_from_args(args)  # refused here, before any process starts
        if config.batch_size % args.nproc:
            raise SpecdecodeError(f"batch_size {config.batch_size} is not a multiple of --nproc {args.nproc}")
        status = distributed.launch(args.nproc, args.argv)
        if status:
            raise SpecdecodeError(f"training in {args.nproc} processes failed (exit status {status})")

    return run


def add_training_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("training (defaults: TrainConfig)")
    group.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="data-parallel processes under torchrun (gloo on CPUs, NCCL with one GPU each); "
        "--batch-size is the global batch (default 1)",
    )
    group.add_argument("--data", type=Path, help="a text file or a directory of files (default: the stdlib)")
    for field in fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = int if field.default is None else type(field.default)  # None: optional int (threads)
        group.add_argument(flag, type=kind, help=f"default {field.default}")


def add_train_parser(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train", help="train a tokenizer, a target, or a draft or EAGLE-3 head for any target"
    )
    commands = train.add_subparsers(dest="train_command", required=True)

    tok = commands.add_parser("tokenizer", help="byte-level BPE on the corpus")
    tok.add_argument("--out", type=Path, required=True, help="output directory (Hugging Face format)")
    tok.add_argument("--vocab-size", type=int, default=8192)
    tok.add_argument("--data", type=Path, help="a text file or a directory of files (default: the stdlib)")
    tok.set_defaults(handler=run_tokenizer)

    target = commands.add_parser("target", help="a Llama target from scratch (resumes from --out)")
    target.add_argument("--tokenizer", type=Path, required=True, help="tokenizer directory")
    target.add_argument("--out", type=Path, required=True, help="output model directory")
    add_training_args(target)
    target.set_defaults(handler=distributed_entry(run_target))

    draft = commands.add_parser("draft", help="distill a small draft from any local target (resumes)")
    draft.add_argument("--target", type=Path, required=True, help="target model directory")
    draft.add_argument("--out", type=Path, required=True, help="output model directory")
    add_training_args(draft)
    draft.set_defaults(handler=distributed_entry(run_draft))

    eagle3 = commands.add_parser(
        "eagle3", help="an EAGLE-3 head for any local target, with the training-time test (resumes)"
    )
    eagle3.add_argument("--target", type=Path, required=True, help="target model directory")
    eagle3.add_argument("--out", type=Path, required=True, help="output head directory")
    eagle3.add_argument(
        "--calibrate-only",
        action="store_true",
        help="no training: fit the confidence scale of the head in --out for the target and save it "
        "there (on --calibration-windows windows of --seq-len tokens, --unroll steps)",
    )
    head = eagle3.add_argument_group("head")
    d = EAGLE3_SHAPE
    head.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    head.add_argument(
        "--kv-heads", type=int, default=d.kv_heads, help=f"key/value heads (default {d.kv_heads})"
    )
    head.add_argument(
        "--intermediate", type=int, default=d.intermediate, help=f"MLP width (default {d.intermediate})"
    )
    head.add_argument(
        "--draft-vocab",
        type=int,
        default=d.draft_vocab,
        help=f"draft vocabulary: the most frequent target ids of the data (default {d.draft_vocab})",
    )
    head.add_argument(
        "--unroll", type=int, default=d.unroll, help=f"training-time-test steps (default {d.unroll})"
    )
    head.add_argument("--layer-ids", help="target layers read, comma-separated (default 2,L/2,L-3)")
    eagle3.add_argument(
        "--generated-tokens",
        type=int,
        default=0,
        metavar="N",
        help="self-distillation: train on N tokens the target writes greedily after "
        f"{PREFIX_TOKENS}-token corpus prefixes ({NEW_TOKENS} per prefix; kept in --out), "
        "not on the corpus (default 0: the corpus)",
    )
    add_training_args(eagle3)
    eagle3.set_defaults(handler=distributed_entry(run_eagle3))
