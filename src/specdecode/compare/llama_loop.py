"""What our loop costs on llama.cpp's kernels, and whether llama.cpp's rows are batch-invariant.

    python -m specdecode.compare.llama_loop -m target.gguf [-n 128] [-t 1]

1. Plain generation, greedy, three ways over the same GGUF file and prompt, in alternated
   rounds (medians): llama.cpp's own loop through the C API (decode one token, argmax over
   its logits view, nothing else), our LlamaCppBackend.evaluate in a bare loop, and our whole
   generation loop (`Pipeline` with no strategy: sampler, stop checks, stats). The ratios are
   the overhead of each layer per token.
2. Row agreement: the logits of k-row passes (a verify pass's shape) against the same rows
   scored one at a time, over the generated text, for each k in -k: exact-equality and
   argmax-agreement rates; and what the backend's own probe found.
3. Pass costs: a pass of T rows (T in --pass-rows) after the prompt and the generated text,
   median of 15, as a multiple of the one-row pass.

It measures the library the backend chooses (`specdecode kernels` shows which: the row-invariant
build of `specdecode kernels --build` where there is one); SPECDECODE_LLAMA_KERNELS=wheel in front
measures llama-cpp-python's own.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import numpy as np
import torch

from specdecode import GenerationConfig, Pipeline, SamplingParams
from specdecode.backends.hf import LoadOptions
from specdecode.backends.llama_cpp import LlamaCppBackend
from specdecode.backends.llama_lib import llama_cpp
from specdecode.backends.llama_probe import RowAgreement

PROMPT = "import os\n\n\ndef read_lines(path):"


def raw_llama_cpp(backend: LlamaCppBackend, prompt: list[int], n: int) -> tuple[list[int], float]:
    """Greedy tokens and seconds from llama.cpp's C API alone (the batch reused, no copies)."""
    backend.truncate(0)
    logits = backend.evaluate(prompt, logits_rows=1)[-1]
    token, out = int(logits.argmax()), []
    batch, context, size = backend._batch, backend._context, backend.vocab.size
    start = time.perf_counter()
    for position in range(len(prompt), len(prompt) + n):
        out.append(token)
        batch.n_tokens = 1
        batch.token[0], batch.pos[0], batch.n_seq_id[0], batch.logits[0] = token, position, 1, 1
        batch.seq_id[0][0] = 0
        llama_cpp.llama_decode(context, batch)
        token = int(np.ctypeslib.as_array(llama_cpp.llama_get_logits(context), shape=(size,)).argmax())
    elapsed = time.perf_counter() - start
    llama_cpp.llama_memory_seq_rm(backend._memory, 0, -1, -1)
    backend._tokens.clear()
    return out, elapsed


def backend_loop(backend: LlamaCppBackend, prompt: list[int], n: int) -> tuple[list[int], float]:
    backend.truncate(0)
    token, out = int(backend.evaluate(prompt, logits_rows=1)[-1].argmax()), []
    start = time.perf_counter()
    for _ in range(n):
        out.append(token)
        token = int(backend.evaluate([token])[-1].argmax())
    return out, time.perf_counter() - start


def row_agreement(backend: LlamaCppBackend, ids: list[int], k: int) -> RowAgreement:
    """k-row passes over the text against the same rows scored one at a time."""
    agreement = RowAgreement(0, 0, 0)
    for start in range(1, len(ids) - k, k):
        backend.truncate(0)
        backend.evaluate(ids[:start])
        together = backend.evaluate(ids[start : start + k])
        backend.truncate(start)
        alone = torch.cat([backend.evaluate([token]) for token in ids[start : start + k]])
        agreement += RowAgreement.of(together, alone)
    return agreement


def pass_cost(backend: LlamaCppBackend, ids: list[int], rows: int, repeats: int = 15) -> float:
    """Median seconds of a pass of `rows` rows after `ids`."""
    backend.truncate(0)
    backend.evaluate(ids)
    timings = []
    for _ in range(repeats):
        start = time.perf_counter()
        backend.evaluate(ids[1 : 1 + rows])
        timings.append(time.perf_counter() - start)
        backend.truncate(len(ids))
    return float(np.median(timings))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("-m", "--model", type=Path, required=True, help="GGUF file")
    parser.add_argument("-n", "--n-predict", type=int, default=128)
    parser.add_argument("-t", "--threads", type=int, default=1)
    parser.add_argument("-k", default="8", help="rows per pass in the agreement check (comma-separated)")
    parser.add_argument("--pass-rows", default="1,2,5,9,17", help="pass sizes to time (comma-separated)")
    parser.add_argument("--rounds", type=int, default=5, help="alternated runs of each loop (median)")
    args = parser.parse_args()
    options = LoadOptions(backend="llama.cpp", threads=args.threads, n_ctx=1024)
    backend = LlamaCppBackend.load(args.model, options)
    prompt = backend.tokenize(PROMPT)
    raw_llama_cpp(backend, prompt, 8)  # warm-up
    pipeline = Pipeline(backend, spec_types=[])
    config = GenerationConfig(n_predict=args.n_predict, ignore_eos=True)
    times: dict[str, list[float]] = {"raw": [], "ours": [], "loop": []}
    for _ in range(args.rounds):  # alternated, so that a busy moment hits all three alike
        raw, seconds = raw_llama_cpp(backend, prompt, args.n_predict)
        times["raw"].append(seconds)
        ours, seconds = backend_loop(backend, prompt, args.n_predict)
        times["ours"].append(seconds)
        start = time.perf_counter()
        result = pipeline.generate(prompt, SamplingParams(temperature=0), config)
        times["loop"].append(time.perf_counter() - start)
    raw_s, ours_s, loop_s = (float(np.median(times[key])) for key in ("raw", "ours", "loop"))
    n = args.n_predict
    print(f"{args.model.name}: {n} tokens, {args.threads} thread(s), median of {args.rounds} alternated runs")
    for name, seconds in (
        ("llama.cpp C API loop", raw_s),
        ("backend.evaluate loop", ours_s),
        ("specdecode generate", loop_s),
    ):
        print(
            f"  {name:<22} {n / seconds:8.1f} tok/s {1e3 * seconds / n:7.2f} ms/token "
            f"({raw_s / seconds:.2f}x)"
        )
    print(f"  same greedy tokens: {raw == ours == result.tokens[:n]}")
    for k in (int(k) for k in args.k.split(",")):
        agreement = row_agreement(backend, prompt + raw, k)
        print(
            f"  {k}-row vs 1-row passes: {100 * agreement.identical / agreement.rows:.1f}% rows "
            f"bit-identical, {100 * agreement.same_argmax / agreement.rows:.1f}% same argmax"
        )
    invariant, probe = backend.invariant, backend.model.probe
    print(
        f"  the backend's probe: invariant {invariant} ({probe.identical}/{probe.rows} rows "
        f"bit-identical; every pass of up to {backend.model.invariant_rows} rows)"
    )
    costs = {rows: pass_cost(backend, prompt + raw, rows) for rows in map(int, args.pass_rows.split(","))}
    one = costs.get(1) or pass_cost(backend, prompt + raw, 1)
    print(
        "  pass of T rows: "
        + ", ".join(
            f"T={rows} {1e3 * seconds:.2f} ms ({seconds / one:.1f}x)" for rows, seconds in costs.items()
        )
    )


if __name__ == "__main__":
    main()
