"""`specdecode loadtest`: N clients for a fixed time against a running `specdecode serve`.

Each client sends non-streaming /v1/completions requests back to back until the time is up
(requests in flight then finish and count). It prints throughput, latency percentiles, the
error count, speculation counters and the server's resident memory before and after, all
read from the server itself (/metrics). Only the standard library: it runs wherever the
package does. Any error makes the command fail (exit status 2) after the report.

With --long-prompt N it measures fairness instead: the clients stream one long answer each
(llama-server's /completion), and once every stream is running, one request with a prompt of N
tokens arrives. A server that evaluates that prompt in passes of its own stalls the streams
meanwhile; the report gives each stream's largest gap between chunks while the prompt was in,
in seconds and in decode steps (the streams' median gap before it arrived).
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

from specdecode.errors import SpecdecodeError

DEFAULT_PROMPTS = (
    "def fibonacci(n):\n",
    "class Stack:\n    def __init__(self):\n",
    "import os\n\ndef list_files(path):\n",
    "def quicksort(xs):\n    if len(xs) <= 1:\n",
)
MIB = 1024 * 1024


@dataclass
class Tally:
    """What the clients saw; appended to from their threads under one lock."""

    latencies: list[float] = field(default_factory=list)
    generated: int = 0
    prompt: int = 0
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def success(self, seconds: float, usage: dict) -> None:
        with self.lock:
            self.latencies.append(seconds)
            self.generated += usage["completion_tokens"]
            self.prompt += usage["prompt_tokens"]

    def failure(self, reason: str) -> None:
        with self.lock:
            self.errors.append(reason)


def add_loadtest_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        "loadtest",
        help="concurrent clients against a running `specdecode serve`: throughput, latency, memory",
        epilog="example:\n  specdecode loadtest --url http://127.0.0.1:8080 --clients 4 --duration 10",
    )
    parser.add_argument("--url", default="http://127.0.0.1:8080", help="the server's base URL")
    parser.add_argument("--clients", type=int, default=8, help="concurrent clients")
    parser.add_argument("--duration", type=float, default=30.0, help="seconds to keep sending requests")
    parser.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each request")
    parser.add_argument("--temperature", type=float, default=0.0, help="temperature of each request")
    parser.add_argument("--prompt", action="append", help="a prompt (repeatable; default: 4 code prompts)")
    parser.add_argument(
        "--long-prompt",
        type=int,
        metavar="TOKENS",
        help="stream --max-tokens tokens per client and, once all stream, send one prompt of TOKENS "
        "tokens: print the streams' largest gaps while it is evaluated",
    )
    parser.add_argument("--api-key", help="sent as 'Authorization: Bearer KEY'")
    parser.add_argument(
        "--timeout", type=float, default=300.0, help="seconds before a request counts as failed"
    )
    parser.set_defaults(handler=run)
    return parser


def run(args: argparse.Namespace) -> None:
    if args.clients < 1 or args.duration <= 0 or args.max_tokens < 1:
        raise SpecdecodeError("--clients and --max-tokens must be >= 1, --duration > 0")
    url = args.url.rstrip("/")
    headers = {"Content-Type": "application/json"}
    if args.api_key:
        headers["Authorization"] = f"Bearer {args.api_key}"
    if args.long_prompt is not None:
        if args.long_prompt < 1:
            raise SpecdecodeError("--long-prompt must be >= 1")
        print(gap_report(measure_gaps(url, headers, args)))
        return
    before = read_metrics(url, headers)
    prompts = args.prompt or list(DEFAULT_PROMPTS)
    tally = Tally()
    start = time.perf_counter()
    deadline = start + args.duration
    with ThreadPoolExecutor(args.clients) as pool:
        for client in range(args.clients):
            pool.submit(_client, client, url, headers, prompts, args, deadline, tally)
    elapsed = time.perf_counter() - start
    after = read_metrics(url, headers)
    print(report(args, url, tally, elapsed, before, after))
    if tally.errors:
        raise SpecdecodeError(f"{len(tally.errors)} requests failed; the first: {tally.errors[0]}")


def _client(
    index: int,
    url: str,
    headers: dict[str, str],
    prompts: list[str],
    args: argparse.Namespace,
    deadline: float,
    tally: Tally,
) -> None:
    n = index
    while time.perf_counter() < deadline:
        body = {
            "prompt": prompts[n % len(prompts)],
            "max_tokens": args.max_tokens,
            "temperature": args.temperature,
        }
        n += args.clients
        sent = time.perf_counter()
        try:
            reply = _post(f"{url}/v1/completions", body, headers, args.timeout)
        except (OSError, ValueError, KeyError) as exc:  # HTTP errors, refused connections, bad JSON
            tally.failure(_describe(exc))
            continue
        tally.success(time.perf_counter() - sent, reply["usage"])


def _post(url: str, body: dict, headers: dict[str, str], timeout: float) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), headers, method="POST")
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.loads(response.read())


def _describe(exc: Exception) -> str:
    if isinstance(exc, urllib.error.HTTPError):
        return f"HTTP {exc.code}: {exc.read().decode(errors='replace')[:200]}"
    return f"{type(exc).__name__}: {exc}"


def read_metrics(url: str, headers: dict[str, str]) -> dict[str, float]:
    """/metrics as {sample name with labels: value}."""
    request = urllib.request.Request(f"{url}/metrics", headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=30) as response:
            text = response.read().decode()
    except (OSError, ValueError) as exc:
        raise SpecdecodeError(f"cannot read {url}/metrics: {_describe(exc)}") from None
    samples = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            samples[name] = float(value)
    return samples


def percentile(values: list[float], p: float) -> float:
    """Nearest-rank percentile (p in 0..100) of a non-empty list."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(p / 100 * len(ordered)) - 1)]


def _difference(before: dict[str, float], after: dict[str, float], prefix: str) -> float:
    return sum(v - before.get(k, 0.0) for k, v in after.items() if k.startswith(prefix))


def report(
    args: argparse.Namespace,
    url: str,
    tally: Tally,
    elapsed: float,
    before: dict[str, float],
    after: dict[str, float],
) -> str:
    done = len(tally.latencies)
    lines = [
        f"loadtest: {args.clients} clients for {args.duration:g} s against {url} "
        f"(max_tokens {args.max_tokens}, temperature {args.temperature:g})",
        f"requests  {done} ok, {len(tally.errors)} errors in {elapsed:.1f} s: "
        f"{done / elapsed:.2f} requests/s",
        f"tokens    {tally.generated} generated: {tally.generated / elapsed:.1f} tokens/s "
        f"({tally.prompt} prompt tokens)",
    ]
    if done:
        p50, p99 = percentile(tally.latencies, 50), percentile(tally.latencies, 99)
        lines.append(f"latency   p50 {p50:.2f} s, p99 {p99:.2f} s, max {max(tally.latencies):.2f} s")
    drafted = _difference(before, after, "specdecode_drafted_tokens_total")
    accepted = _difference(before, after, "specdecode_accepted_tokens_total")
    share = f" ({100 * accepted / drafted:.1f}%)" if drafted else ""
    lines.append(f"drafts    {drafted:.0f} tokens drafted, {accepted:.0f} accepted{share}")
    memory = "process_resident_memory_bytes"
    if memory in before and memory in after:
        change = (after[memory] - before[memory]) / MIB
        lines.append(
            f"server    resident memory {before[memory] / MIB:.1f} MiB before, "
            f"{after[memory] / MIB:.1f} MiB after ({change:+.1f} MiB)"
        )
    return "\n".join(lines)


WARM_CHUNKS = 32  # chunks every stream receives before the long prompt is sent
LONG_PROMPT_TEXT = "def add(x, y):\n    return x + y\n\n"


@dataclass
class Gaps:
    """Arrival times of every stream's chunks, and when the long prompt was sent and answered."""

    arrivals: list[list[float]]
    sent: float
    answered: float
    prompt_tokens: int

    def decode_step(self) -> float:
        """One decode step: the streams' median of their mean gap between chunks before the
        long prompt was sent (a mean, since chunks that a busy server sends together arrive
        together: their gaps of 0 and the longer one after them average out)."""
        means = []
        for times in self.arrivals:
            before = [t for t in times if t <= self.sent]
            if len(before) > 1:
                means.append((before[-1] - before[0]) / (len(before) - 1))
        return statistics.median(means) if means else math.nan

    def largest(self, times: list[float]) -> float:
        """A stream's largest gap between chunks that overlaps the long prompt's evaluation."""
        gaps = [
            later - earlier
            for earlier, later in itertools.pairwise(times)
            if later > self.sent and earlier < self.answered
        ]
        return max(gaps, default=0.0)


def measure_gaps(url: str, headers: dict[str, str], args: argparse.Namespace) -> Gaps:
    """Streams from every client, then one prompt of args.long_prompt tokens (see the module
    docstring)."""
    text = args.prompt[0] if args.prompt else LONG_PROMPT_TEXT
    unit = _post(f"{url}/tokenize", {"content": text}, headers, args.timeout)["tokens"]
    if not unit:
        raise SpecdecodeError(f"the prompt {text!r} has no tokens")
    long_ids = (unit * (args.long_prompt // len(unit) + 1))[: args.long_prompt]
    arrivals: list[list[float]] = [[] for _ in range(args.clients)]
    errors: list[str] = []

    def stream(index: int) -> None:
        body = {
            "prompt": DEFAULT_PROMPTS[index % len(DEFAULT_PROMPTS)],
            "n_predict": args.max_tokens,
            "temperature": args.temperature,
            "ignore_eos": True,
            "stream": True,
        }
        data = json.dumps(body).encode()
        request = urllib.request.Request(f"{url}/completion", data, headers, method="POST")
        try:
            with urllib.request.urlopen(request, timeout=args.timeout) as response:
                for line in response:
                    if line.startswith(b"data: ") and json.loads(line[6:]).get("tokens"):
                        arrivals[index].append(time.perf_counter())
        except (OSError, ValueError) as exc:
            errors.append(_describe(exc))

    with ThreadPoolExecutor(args.clients) as pool:
        futures = [pool.submit(stream, index) for index in range(args.clients)]
        while min(len(times) for times in arrivals) < WARM_CHUNKS and not all(f.done() for f in futures):
            time.sleep(0.01)
        sent = time.perf_counter()
        body = {"prompt": long_ids, "n_predict": 1, "temperature": 0, "cache_prompt": False}
        reply = _post(f"{url}/completion", body, headers, args.timeout)
        answered = time.perf_counter()
    if errors:
        raise SpecdecodeError(f"{len(errors)} streams failed; the first: {errors[0]}")
    if any(not times or times[-1] < answered for times in arrivals):
        raise SpecdecodeError(
            "a stream ended before the long prompt was answered: raise --max-tokens, and leave the "
            "prompt a free slot (--clients below the server's --parallel)"
        )
    return Gaps(arrivals, sent, answered, int(reply.get("tokens_evaluated", len(long_ids))))


def gap_report(gaps: Gaps) -> str:
    step = gaps.decode_step()
    lines = [
        f"long prompt  {gaps.prompt_tokens} tokens answered in {gaps.answered - gaps.sent:.2f} s "
        f"beside {len(gaps.arrivals)} streams; decode step (median gap before it) {1000 * step:.1f} ms"
    ]
    for index, times in enumerate(gaps.arrivals):
        largest = gaps.largest(times)
        lines.append(f"stream {index}     largest gap {largest:.3f} s = {largest / step:.1f} decode steps")
    worst = max(gaps.largest(times) for times in gaps.arrivals)
    lines.append(f"worst        {worst:.3f} s = {worst / step:.1f} decode steps")
    return "\n".join(lines)
