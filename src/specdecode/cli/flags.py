"""The flag groups of `specdecode generate`, `serve` and `bench` (models, speculation, the
model-free strategies, sampling, constrained output), and the parsers of generate and serve.

Flags only, apart from what they run: each command's handler is named as "module:function"
(`specdecode.cli.commands`), so building the parser imports nothing heavy.
"""

from __future__ import annotations

import argparse
import textwrap
from pathlib import Path

from specdecode.chat import add_chat_args
from specdecode.cli.settings import DEFAULT_N_PREDICT, DRAFTING
from specdecode.config import (
    BACKENDS,
    DTYPE_NAMES,
    PASSES,
    PRIORITY,
    SPEC_POLICIES,
    VERIFY_MODES,
    NgramSettings,
    SamplingParams,
    SuffixConfig,
    spec_type_name,
)
from specdecode.server.settings import add_server_args

# llama.cpp's sampling default: the command samples unless given --temp 0 (the library's
# SamplingParams is greedy unless asked to sample).
DEFAULT_TEMPERATURE = 0.8

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
    "draft-dflash": "a DFlash drafter (-mdf) over the target's own hidden states proposes a whole block "
    "in one pass, up to --spec-draft-n-max tokens (also: dflash)",
    "draft-mtp": "the target's own multi-token-prediction layer (from -m's directory; `specdecode train mtp` "
    "adds one) proposes up to --spec-draft-n-max tokens, chained (also: mtp)",
    "forced": "under --grammar/--json-schema/--regex: the tokens the grammar allows alone (added to any "
    "speculation)",
}


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
    group.add_argument(
        "-mdf",
        "--model-draft-dflash",
        type=Path,
        metavar="DIR",
        help="DFlash drafter directory, z-lab's layout (enables --spec-type draft-dflash)",
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
        "--speculative-config",
        metavar="JSON",
        help="the strategy and its model in vLLM's keys instead of -md, -me and --spec-type, e.g. "
        '\'{"method": "draft_model", "model": "DRAFT", "num_speculative_tokens": 5}\' (methods: ngram, '
        "draft_model, eagle3, suffix, and the --spec-type names)",
    )
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
    gen.add_argument(
        "-n",
        "--n-predict",
        type=int,
        help=f"tokens to generate, -1 until EOS (default: {DEFAULT_N_PREDICT}; in a conversation, -1)",
    )
    gen.add_argument("--stop", action="append", help="stop when this text appears (repeatable)")
    gen.add_argument(
        "--ignore-eos", action="store_true", help="keep generating past end-of-generation tokens"
    )
    gen.add_argument(
        "--stream",
        action="store_true",
        help="print text as tokens are accepted (always where stdout is a terminal, but for --json)",
    )
    gen.add_argument("--json", action="store_true", help='print one JSON object {"text", "tokens", "stats"}')
    add_chat_args(gen.add_argument_group("chat models"), conversation=True)
    add_constraint_args(gen)
    add_model_args(gen)
    add_spec_args(gen)
    add_sampling_args(gen)
    gen.set_defaults(handler="specdecode.cli.commands:run_generate")


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
    srv.set_defaults(handler="specdecode.cli.commands:run_serve")
