"""`specdecode bench-serve` as the command line registers it: bench's flags (`bench.flags`), with
the handler that runs bench's in-process benchmark or, with --http, our server beside
llama-server (`compare.against_llama.run_bench_serve`). The handler is named here, above both
packages, because `bench` imports no comparison. Building it imports nothing heavy."""

from __future__ import annotations

import argparse

from specdecode.bench import flags


def add_bench_serve_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = flags.add_bench_serve_parser(subparsers)
    parser.set_defaults(handler="specdecode.compare.against_llama:run_bench_serve")
    return parser
