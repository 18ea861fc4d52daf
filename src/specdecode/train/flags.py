"""The flags of `specdecode train tokenizer|target|draft|eagle3|dflash|mtp` and `specdecode eval`.

Kept apart from the training modules, which import torch: building the command line (and
answering --help or a mistyped flag) imports nothing heavy. Each handler is named as
"module:function" (in `train.commands` and `train.evaluate`), imported when its command runs.
"""

from __future__ import annotations

import argparse
from dataclasses import fields
from pathlib import Path

from specdecode.config import DraftModelConfig
from specdecode.train.config import (
    DEVICES,
    DFLASH_SHAPE,
    EAGLE3_SHAPE,
    NEW_TOKENS,
    PRECISIONS,
    PREFIX_TOKENS,
    SAVE_DTYPE_NAMES,
    MtpShape,
    TrainConfig,
)

# What each TrainConfig field does, as its flag's help (its default is added to it).
TRAINING_HELP = {
    "steps": "optimizer steps",
    "batch_size": "sequences per optimizer step (the global batch with --nproc)",
    "seq_len": "tokens per training sequence",
    "lr": "peak learning rate, reached after the warm-up, then decayed on a cosine to --min-lr",
    "min_lr": "learning rate at the last step",
    "warmup_steps": "steps of linear learning-rate warm-up",
    "weight_decay": "AdamW weight decay of the weight matrices (none on norms and biases)",
    "grad_clip": "gradients are clipped to this norm",
    "seed": "seed of the initial weights and of the batches drawn",
    "device": "where to train: cpu, cuda, or auto (cuda when available)",
    "checkpoint_every": "steps between checkpoints in --out (a run resumes from the last one)",
    "save_dtype": "dtype of the saved weights",
    "precision": "bf16: matmuls under bfloat16 autocast (about twice as fast on GPUs and CPUs with bf16 "
    "arithmetic); fp32 for CPUs without it, where bf16 is emulated; auto: bf16 on a GPU or a CPU with "
    "bf16 units, else fp32",
    "distill_temperature": "softmax temperature of the target's distributions a draft or head learns",
    "threads": "CPU threads for torch (default: torch's own choice)",
    "calibration_windows": "training windows that fit a draft's or head's confidence scale (0: none)",
}
CHOICES = {"device": DEVICES, "save_dtype": SAVE_DTYPE_NAMES, "precision": PRECISIONS}


def add_train_parser(subparsers: argparse._SubParsersAction) -> None:
    train = subparsers.add_parser(
        "train",
        help="train a tokenizer, a target, or a draft, EAGLE-3 head or DFlash drafter for any target",
        epilog="example:\n  specdecode train draft --target TARGET_DIR --out DRAFT_DIR --steps 2000",
    )
    commands = train.add_subparsers(dest="train_command", required=True)

    tok = commands.add_parser(
        "tokenizer",
        help="byte-level BPE on the corpus",
        epilog="example:\n  specdecode train tokenizer --out TOKENIZER_DIR --vocab-size 8192",
    )
    tok.add_argument("--out", type=Path, required=True, help="output directory (Hugging Face format)")
    tok.add_argument("--vocab-size", type=int, default=8192, help="tokens in the vocabulary")
    tok.add_argument("--data", type=Path, help="a text file or a directory of files (default: the stdlib)")
    tok.set_defaults(handler="specdecode.train.commands:run_tokenizer")

    target = commands.add_parser(
        "target",
        help="a Llama target from scratch (resumes from --out)",
        usage="%(prog)s --tokenizer DIR --out DIR [options]",
        epilog="example:\n  specdecode train target --tokenizer TOKENIZER_DIR --out TARGET_DIR --steps 2000",
    )
    target.add_argument("--tokenizer", type=Path, required=True, help="tokenizer directory")
    target.add_argument("--out", type=Path, required=True, help="output model directory")
    add_training_args(target)
    target.set_defaults(handler="specdecode.train.commands:run_target")

    draft = commands.add_parser(
        "draft",
        help="distill a small draft from any local target (resumes)",
        usage="%(prog)s --target DIR --out DIR [options]",
        epilog="example:\n  specdecode train draft --target TARGET_DIR --out DRAFT_DIR --steps 2000",
    )
    draft.add_argument("--target", type=Path, required=True, help="target model directory")
    draft.add_argument("--out", type=Path, required=True, help="output model directory")
    add_training_args(draft)
    draft.set_defaults(handler="specdecode.train.commands:run_draft")

    eagle3 = commands.add_parser(
        "eagle3",
        help="an EAGLE-3 head for any local target, with the training-time test (resumes)",
        usage="%(prog)s --target DIR --out DIR [options]",
        epilog="example:\n  specdecode train eagle3 --target TARGET_DIR --out HEAD_DIR --steps 2000",
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
    head.add_argument("--heads", type=int, default=d.heads, help="attention heads")
    head.add_argument("--kv-heads", type=int, default=d.kv_heads, help="key/value heads")
    head.add_argument("--intermediate", type=int, default=d.intermediate, help="MLP width")
    head.add_argument(
        "--draft-vocab",
        type=int,
        default=d.draft_vocab,
        help="draft vocabulary: the most frequent target ids of the data",
    )
    head.add_argument("--unroll", type=int, default=d.unroll, help="training-time-test steps")
    head.add_argument("--layer-ids", help="target layers read, comma-separated (default: 2,L/2,L-3)")
    eagle3.add_argument(
        "--generated-tokens",
        type=int,
        default=0,
        metavar="N",
        help="self-distillation: train on N tokens the target writes greedily after "
        f"{PREFIX_TOKENS}-token corpus prefixes ({NEW_TOKENS} per prefix; kept in --out), "
        "not on the corpus (default: 0, the corpus)",
    )
    add_training_args(eagle3)
    eagle3.set_defaults(handler="specdecode.train.commands:run_eagle3")

    mtp = commands.add_parser(
        "mtp",
        help="add one trained MTP layer to any local target, for --spec-type draft-mtp (resumes)",
        usage="%(prog)s --target DIR --out DIR [options]",
        epilog="example:\n  specdecode train mtp --target TARGET_DIR --out TARGET_WITH_MTP_DIR --steps 2000",
    )
    mtp.add_argument("--target", type=Path, required=True, help="target model directory")
    mtp.add_argument(
        "--out", type=Path, required=True, help="output directory: the target's files with the layer added"
    )
    mtp.add_argument(
        "--unroll", type=int, default=MtpShape.unroll, help="training-time-test steps (chained drafts)"
    )
    mtp.add_argument(
        "--generated-tokens",
        type=int,
        default=0,
        metavar="N",
        help="self-distillation, as for train eagle3 (default: 0, the corpus)",
    )
    add_training_args(mtp)
    mtp.set_defaults(handler="specdecode.train.commands:run_mtp")

    dflash = commands.add_parser(
        "dflash",
        help="a DFlash block drafter for any local target, for --spec-type draft-dflash (resumes)",
        usage="%(prog)s --target DIR --out DIR [options]",
        epilog="example:\n  specdecode train dflash --target TARGET_DIR --out DRAFTER_DIR --steps 2000",
    )
    dflash.add_argument("--target", type=Path, required=True, help="target model directory")
    dflash.add_argument("--out", type=Path, required=True, help="output drafter directory (z-lab's layout)")
    dflash.add_argument(
        "--calibrate-only",
        action="store_true",
        help="no training: fit the confidence scale of the drafter in --out for the target and save it "
        "there (on --calibration-windows windows of --seq-len tokens)",
    )
    drafter = dflash.add_argument_group("drafter")
    f = DFLASH_SHAPE
    drafter.add_argument("--layers", type=int, default=f.layers, help="drafter layers")
    drafter.add_argument("--heads", type=int, default=f.heads, help="attention heads")
    drafter.add_argument("--kv-heads", type=int, default=f.kv_heads, help="key/value heads")
    drafter.add_argument("--head-dim", type=int, default=f.head_dim, help="width of each head")
    drafter.add_argument("--intermediate", type=int, default=f.intermediate, help="MLP width")
    drafter.add_argument(
        "--block-size",
        type=int,
        default=f.block_size,
        help="block rows: the last token and block-size - 1 drafts",
    )
    drafter.add_argument(
        "--layer-ids",
        help="target layer inputs read, comma-separated (default: z-lab's two, spread from 2 to L-2)",
    )
    drafter.add_argument(
        "--mask-token-id", type=int, help="id of the block's undrafted rows (default: the target's pad token)"
    )
    drafter.add_argument(
        "--anchors", type=int, default=f.anchors, help="blocks trained per sequence, sharing one target pass"
    )
    dflash.add_argument(
        "--generated-tokens",
        type=int,
        default=0,
        metavar="N",
        help="self-distillation, as for train eagle3 (default: 0, the corpus)",
    )
    add_training_args(dflash)
    dflash.set_defaults(handler="specdecode.train.commands:run_dflash")


def add_training_args(parser: argparse.ArgumentParser) -> None:
    """A flag per TrainConfig field; a flag not given leaves the field's default."""
    group = parser.add_argument_group("training")
    group.add_argument(
        "--nproc",
        type=int,
        default=1,
        help="data-parallel processes under torchrun (gloo on CPUs, NCCL with one GPU each); "
        "--batch-size is the global batch",
    )
    group.add_argument("--data", type=Path, help="a text file or a directory of files (default: the stdlib)")
    for field in fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        kind = int if field.default is None else type(field.default)  # None: optional int (threads)
        shown = "" if field.default is None else f" (default: {field.default})"
        group.add_argument(
            flag, type=kind, choices=CHOICES.get(field.name), help=TRAINING_HELP[field.name] + shown
        )


def add_eval_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `eval`; its `handler` is called by cli.main."""
    parser = subparsers.add_parser(
        "eval",
        help="perplexity and draft acceptance on the held-out split of the corpus",
        epilog="example:\n  specdecode eval --prompts 4 -n 32",
    )
    parser.add_argument("-m", "--model", type=Path, help="target model directory (default: the bundled pair)")
    parser.add_argument("-md", "--model-draft", type=Path, help="draft model directory (adds acceptance)")
    parser.add_argument(
        "--spec-draft-n-max", "--draft-max", dest="draft_max", type=int, default=8, help="max draft tokens"
    )
    parser.add_argument(
        "--spec-draft-p-min",
        "--draft-p-min",
        dest="draft_p_min",
        type=float,
        default=DraftModelConfig.p_min,
        help="draft confidence to keep drafting",
    )
    parser.add_argument("--prompts", type=int, default=16, help="held-out prompts for acceptance")
    parser.add_argument("-n", "--n-predict", type=int, default=64, help="tokens generated per prompt")
    parser.add_argument("--window", type=int, default=512, help="tokens per perplexity window")
    parser.add_argument("--max-tokens", type=int, default=65536, help="held-out tokens scored")
    parser.add_argument("--corpus", type=Path, help="corpus root (default: this Python's stdlib)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the numbers to FILE")
    parser.set_defaults(handler="specdecode.train.evaluate:run_eval")
    return parser
