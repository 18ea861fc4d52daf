"""`specdecode loadtest`: N clients for a fixed time against a running `specdecode serve`.

Each client sends non-streaming /v1/completions requests back to back until the time is up
(requests in flight then finish and count). It prints throughput, latency percentiles, the
error count, speculation counters and the server's resident memory before and after, all
read from the server itself (/metrics). Only the standard library: it runs wherever the
package does. Any error makes the command fail (exit status 2) after the report.
"""

from __future__ import annotations

import argparse
import json
import math
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
