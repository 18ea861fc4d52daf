"""`specdecode train tokenizer|target|draft|eagle3|dflash|mtp`: the command line over the training modules
(its flags are in `specdecode.train.flags`).

The default corpus is the Python standard library's train split (see `corpus`); `--data`
trains on your own text or code instead (a file, or a directory of files). Token streams
are encoded once and kept beside the output (`tokens-train.npy`), so a resumed run does not
encode again; they are written there only once the arguments, the models and the corpus have
been checked, so a refused run leaves `--out` as it was. `train eagle3 --calibrate-only` (and
`train dflash --calibrate-only`) fits the confidence scale of the head already in `--out`
without training it.
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
from specdecode.train.dflash import DFlashShape, train_dflash
from specdecode.train.dflash import calibrate_saved_head as calibrate_saved_dflash
from specdecode.train.eagle3 import HeadShape, calibrate_saved_head, train_eagle3
from specdecode.train.lm import DRAFT_SHAPE, TARGET_SHAPE, TrainConfig, train_draft, train_target
from specdecode.train.mtp import MtpShape, train_mtp
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


def run_tokenizer(args: argparse.Namespace) -> None:
    out = train_tokenizer(args.out, args.vocab_size, data_files(args.data) if args.data else None)
    print(f"tokenizer -> {out}", file=sys.stderr)


@distributed_entry
def run_target(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    tokenizer = load_tokenizer(args.tokenizer)
    tokens = training_tokens(tokenizer, args)
    on_start = keep_tokens(tokens, args)
    out = train_target(tokens, tokenizer, args.out, TARGET_SHAPE, config, on_start=on_start)
    print(f"target -> {out}", file=sys.stderr)


@distributed_entry
def run_draft(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    tokenizer = load_tokenizer(args.target)
    tokens = training_tokens(tokenizer, args)
    out = train_draft(tokens, args.target, args.out, DRAFT_SHAPE, config, on_start=keep_tokens(tokens, args))
    print(f"draft -> {out}", file=sys.stderr)


@distributed_entry
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


@distributed_entry
def run_mtp(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    tokens = training_tokens(load_tokenizer(args.target), args)
    out = train_mtp(
        tokens,
        args.target,
        args.out,
        MtpShape(unroll=args.unroll),
        config,
        generated_tokens=args.generated_tokens,
        on_start=keep_tokens(tokens, args),
    )
    print(f"target with an MTP layer -> {out}", file=sys.stderr)


@distributed_entry
def run_dflash(args: argparse.Namespace) -> None:
    config = config_from_args(args)
    if args.calibrate_only:
        record = calibrate_saved_dflash(
            args.target, args.out, lambda tokenizer: training_tokens(tokenizer, args), config
        )
        print(json.dumps(record, indent=1))
        print(
            f"DFlash drafter calibrated -> {args.out} (scale {record['scale']:.3f}; agreement "
            f"{record['agreement']:.3f})",
            file=sys.stderr,
        )
        return
    shape = DFlashShape(
        layers=args.layers,
        heads=args.heads,
        kv_heads=args.kv_heads,
        head_dim=args.head_dim,
        intermediate=args.intermediate,
        block_size=args.block_size,
        anchors=args.anchors,
        layer_ids=_layer_ids(args.layer_ids),
        mask_token_id=args.mask_token_id,
    )
    tokens = training_tokens(load_tokenizer(args.target), args)
    out = train_dflash(
        tokens,
        args.target,
        args.out,
        shape,
        config,
        generated_tokens=args.generated_tokens,
        on_start=keep_tokens(tokens, args),
    )
    print(f"DFlash drafter -> {out}", file=sys.stderr)


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
