"""The benchmarks' flags: `specdecode bench`, `bench-draft`, `bench-passes`, `bench-serve` and
`bench-constrained`.

Kept apart from the benchmarks themselves, which import torch: building the command line (and
answering --help or a mistyped flag) imports nothing heavy. Each command's handler is named as
"module:function" (`specdecode.cli.handler` imports it when the command runs), and the names
both the flags and the benchmarks read live in `bench.names`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from specdecode.bench.names import ALL_TASKS, CONSTRAINED_SYSTEMS, TASK_NAMES
from specdecode.chat import add_chat_args
from specdecode.config import BACKENDS, DTYPE_NAMES, DraftModelConfig

DRAFTING = DraftModelConfig()  # llama.cpp's classic drafting defaults

BENCH_EXAMPLES = """\
examples:
  specdecode bench --quick              # a first look: 5 systems, 1 prompt per task, a few CPU-minutes
  specdecode bench --out bench-results  # the full suite: 3 prompts per task, 128 tokens, 3 runs
  specdecode bench -m TARGET -md DRAFT --systems plain,draft,hf-plain,hf-assisted
  specdecode bench --systems plain,draft,draft@adaptive --static-grid 0.3,0.5,0.75:4,8,16
  specdecode bench --systems plain,draft,draft-tree --temp 0.8 --record-traces traces.jsonl"""


def add_bench_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench` with its own flags; the caller adds the model and n-gram flags it shares
    with `generate`, and the handler."""
    parser = subparsers.add_parser(
        "bench",
        help="every strategy vs plain generation and vs Hugging Face generate, interleaved, in one run",
        usage="%(prog)s [--quick] [options]",
        description="Every strategy against plain generation and against Hugging Face's generate,\n"
        "interleaved, in one run: JSON, Markdown and plots in --out, each run written as it finishes\n"
        "(runs.jsonl; Ctrl-C keeps the tables of the runs done).",
        epilog=BENCH_EXAMPLES,
    )
    group = parser.add_argument_group("benchmark")
    group.add_argument(
        "--quick",
        action="store_true",
        help="a first look: 1 prompt per task, 32 tokens, 1 run, one warm-up round, no sweep; only "
        "plain, the draft, generate's default and Hugging Face's plain and assisted (no draft: "
        "ngram-mod, generate's default and prompt lookup) unless --systems says",
    )
    group.add_argument(
        "--tasks",
        default=",".join(TASK_NAMES),
        help=f"comma-separated tasks, of: {', '.join(ALL_TASKS)} (default: {', '.join(TASK_NAMES)})",
    )
    group.add_argument(
        "--systems",
        help="comma-separated systems, a chain's strategies joined by + (ngram-simple+draft), "
        "@adaptive after a chain for the adaptive policy (draft@adaptive); default: all that the "
        "models allow, with the classic policy (--quick: see there)",
    )
    group.add_argument("--no-hf", action="store_true", help="leave Hugging Face's generate out")
    group.add_argument("-p", "--prompt", action="append", help="your own prompt (repeatable): a custom task")
    group.add_argument("-f", "--file", action="append", help="a file whose text is one custom prompt")
    add_chat_args(group)  # every task's prompt becomes the user's message
    group.add_argument("--prompts-per-task", type=int, help="prompts per task (quick 1, full 3)")
    group.add_argument("-n", "--n-predict", type=int, help="tokens generated per run (quick 32, full 128)")
    group.add_argument("--runs", type=int, help="measured runs per prompt and system (quick 1, full 3)")
    group.add_argument(
        "--warmup",
        type=int,
        help="uncounted rounds before each prompt (default: 1; --quick: before the first)",
    )
    group.add_argument(
        "--temp",
        type=float,
        metavar="T",
        help="sample every task at temperature T, llama.cpp's other sampling defaults, `match` "
        "verification (0: greedy; default: each task's own, greedy but free-t1's 1.0)",
    )
    group.add_argument(
        "--seed", type=int, metavar="N", help="a sampled prompt's seed: N plus its index (default: 0 plus it)"
    )
    add_drafting_args(group, DRAFTING.n_max, DRAFTING.p_min)
    group.add_argument(
        "--spec-draft-n-min",
        "--draft-min",
        dest="draft_min",
        type=int,
        default=DRAFTING.n_min,
        help="drop drafts shorter than this",
    )
    group.add_argument("--draft-n-parallel", type=int, default=4, help="draft-tree systems: most branches")
    group.add_argument(
        "--spec-draft-p-split",
        "--draft-p-split",
        dest="draft_p_split",
        type=float,
        default=DRAFTING.p_split,
        help="draft-tree systems: probability that opens a branch",
    )
    group.add_argument(
        "--draft-tree-tokens",
        type=int,
        default=8,
        help="eagle3-tree and dflash-tree systems: nodes per dynamic tree",
    )
    group.add_argument(
        "--draft-tree-topk",
        type=int,
        default=DRAFTING.tree_topk,
        help="eagle3-tree and dflash-tree systems: nodes expanded per depth",
    )
    group.add_argument(
        "--sweep",
        help="comma-separated --spec-draft-n-max values for the sweep (full 1,2,4,8,16; quick and 0: none)",
    )
    group.add_argument(
        "--static-grid",
        metavar="P,...:N,...",
        help="also run every classic system that drafts with a model at each --spec-draft-p-min P x "
        "--spec-draft-n-max N (as NAME@P/N), and report each adaptive system against the best of them",
    )
    group.add_argument(
        "--out", type=Path, default=Path("bench-results"), help="directory for JSON, Markdown, PNG"
    )
    group.add_argument("--no-plots", action="store_true", help="write no PNG files")
    group.add_argument(
        "--record-traces",
        type=Path,
        metavar="FILE",
        help="append an acceptance trace of each measured run of ours to FILE (JSON Lines: what each "
        "step drafted and kept, to replay through other models; see docs/benchmarks.md)",
    )
    return parser


def add_drafting_args(
    parser: argparse.ArgumentParser | argparse._ArgumentGroup, n_max: int, p_min: float
) -> None:
    """--spec-draft-n-max and --spec-draft-p-min (llama.cpp's names; --draft-max and --draft-p-min,
    its older ones, as aliases), with the defaults of the benchmark that takes them."""
    parser.add_argument(
        "--spec-draft-n-max",
        "--draft-max",
        dest="draft_max",
        type=int,
        default=n_max,
        help="max draft tokens",
    )
    parser.add_argument(
        "--spec-draft-p-min",
        "--draft-p-min",
        dest="draft_p_min",
        type=float,
        default=p_min,
        help="draft confidence to keep drafting",
    )


def add_bench_draft_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench-draft",
        help="time the model-free strategies' drafting, no model",
        epilog="example:\n  specdecode bench-draft --history 8192 --calls 200",
    )
    parser.add_argument("--history", type=int, default=32768, help="tokens of history before timing")
    parser.add_argument("--calls", type=int, default=500, help="timed draft calls per strategy")
    parser.add_argument("--vocab", type=int, default=4096, help="token ids are drawn from [0, vocab)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the synthetic history")
    parser.add_argument(
        "--suffix-store",
        type=_token_counts,
        default=[100_000, 1_000_000],
        metavar="N,...",
        help="suffix: also time drafts against process-wide stores of these many tokens (0: none)",
    )
    parser.set_defaults(handler="specdecode.bench.drafting:run")


def _token_counts(text: str) -> list[int]:
    """A comma-separated list of token counts; 0 alone: none."""
    try:
        counts = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of token counts: {text!r}") from None
    if any(count < 0 for count in counts):
        raise argparse.ArgumentTypeError("token counts must be >= 0")
    return [count for count in counts if count > 0]


def add_bench_passes_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench-passes",
        help="time forward passes of 1..17 rows (chains and trees), per backend",
        epilog="example:\n  specdecode bench-passes --reps 10",
    )
    parser.add_argument("-m", "--model", type=Path, help="target directory (default: the bundled target)")
    parser.add_argument(
        "-md", "--model-draft", type=Path, help="draft directory (default: the bundled draft)"
    )
    parser.add_argument(
        "--backend", default="auto", choices=BACKENDS, help="the backend compared with hf float32"
    )
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES], help="its dtype")
    parser.add_argument("-t", "--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("--reps", type=int, default=30, help="timed passes per row count")
    parser.set_defaults(handler="specdecode.bench.passes:run")


def add_bench_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    """Register `bench-serve` with all its flags, --http's too, and its in-process benchmark's
    handler; `specdecode.compare.flags` names the handler that also runs --http."""
    parser = subparsers.add_parser(
        "bench-serve",
        help="throughput and p50/p99 latency at several concurrencies: per-request threads vs batching",
        epilog="systems: threads (a thread per request), batched (one target pass a step for every "
        "request),\n  batched:STRATEGIES (batched speculation with that chain, e.g. batched:draft), "
        "and\n  batched:STRATEGIES@adaptive (the same under the adaptive policy); separate and\n"
        "  separate:STRATEGIES: batched over forks with contexts of their own (llama.cpp: a pass per\n"
        "  sequence instead of one shared pass)\n\n"
        "--http: `specdecode serve` beside llama-server (`make llama-tools`), both started here on the\n"
        "  same GGUF files: ours plain and speculative, llama-server plain and with the draft\n\n"
        "examples:\n  specdecode bench-serve --concurrency 1,4,16 --systems threads,batched,batched:draft\n"
        "  specdecode bench-serve --http --target T.gguf --draft D.gguf --gap",
    )
    parser.add_argument("-m", "--model", type=Path, help="target directory (default: the bundled target)")
    parser.add_argument(
        "-md", "--model-draft", type=Path, help="draft directory (default: the bundled draft)"
    )
    parser.add_argument(
        "--systems", help="comma-separated systems (listed below; --http: ours,ours-spec,llama,llama-draft)"
    )
    parser.add_argument("--concurrency", help="client counts (default: 1,2,4,8,16,32; --http: 1,4,8,16)")
    parser.add_argument("--requests", type=int, default=2, help="requests per client at each concurrency")
    parser.add_argument("-n", "--n-predict", type=int, default=64, help="tokens per request")
    parser.add_argument(
        "--prompts", type=int, help="distinct prompts, completion task (default: 16; --http: 8)"
    )
    add_drafting_args(parser, DRAFTING.n_max, DRAFTING.p_min)
    parser.add_argument(
        "-t", "--threads", type=int, help="CPU threads (default: torch's; --http: 1 a server)"
    )
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPE_NAMES], help="weights dtype")
    parser.add_argument("--out", type=Path, default=Path("build/bench-serve"), help="results directory")
    http = parser.add_argument_group("--http: our server beside llama-server")
    http.add_argument("--http", action="store_true", help="run both servers and compare them over HTTP")
    http.add_argument("--target", type=Path, help="target GGUF file, loaded by both servers")
    http.add_argument("--draft", type=Path, help="draft GGUF file (adds the drafting systems)")
    http.add_argument(
        "--llama-server",
        type=Path,
        default=Path("build/llama-tools/cmake/bin/llama-server"),
        help="llama-server program",
    )
    http.add_argument("--rounds", type=int, default=2, help="rounds at each concurrency, systems interleaved")
    http.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        help="context per slot (default: the model's own; --http: 1024; --gap: --gap-tokens + 512)",
    )
    http.add_argument(
        "--gap", action="store_true", help="also: 4 streams' longest pause while a long prompt arrives"
    )
    http.add_argument("--gap-tokens", type=int, default=4000, help="the long prompt's tokens")
    parser.set_defaults(handler="specdecode.bench.serving:run")
    return parser


def add_bench_constrained_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench-constrained",
        help="structured output (JSON extraction, function calls): constrained plain vs speculative",
        epilog="example:\n  specdecode bench-constrained --prompts-per-task 1 --runs 1",
    )
    parser.add_argument("-m", "--model", type=Path, help="target directory (default: the bundled target)")
    parser.add_argument(
        "-md", "--model-draft", type=Path, help="draft directory (default: the bundled draft)"
    )
    parser.add_argument("-t", "--threads", type=int, default=1, help="CPU threads")
    parser.add_argument("-n", "--n-predict", type=int, default=160, help="token limit of an answer")
    parser.add_argument("--prompts-per-task", type=int, default=3, help="prompts per task")
    parser.add_argument("--runs", type=int, default=2, help="timed rounds (after one warm-up round)")
    add_drafting_args(parser, DRAFTING.n_max, DRAFTING.p_min)
    parser.add_argument(
        "--systems",
        default=";".join(CONSTRAINED_SYSTEMS),
        help="';'-separated --spec-type values ('plain': none)",
    )
    parser.set_defaults(handler="specdecode.bench.constrained:run")
