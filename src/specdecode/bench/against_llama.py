"""`specdecode bench-serve --http`: `specdecode serve` beside llama-server, over HTTP, on the same
GGUF files.

    make llama-tools      # builds llama-server (with llama.cpp's other programs) into build/llama-tools
    specdecode bench-serve --http --target T.gguf [--draft D.gguf] [--gap]

Both servers are started here as child processes on free ports, one thread each (`--threads`),
as many slots as the highest concurrency, and stopped at the end (also on an error or Ctrl-C).
Systems, each its own server process, all up for the whole run:

- `ours`: `specdecode serve` without speculation;
- `ours-spec`: our default speculation (with a draft: the adaptive policy over the draft and the
  n-gram chain `BESIDE_A_DRAFT`; without one, that n-gram chain alone);
- `llama`: llama-server without speculation;
- `llama-draft`: llama-server with the draft (`-md --spec-type draft-simple`, its own defaults),
  only when a draft is given.

Every request is llama-server's `POST /completion` (both servers speak it): the held-out
code-completion prompts (`bench.tasks`) as text, greedy, `ignore_eos`, `cache_prompt` off (no
server reuses a cached prefix), the answer's token ids asked back. Before the runs, each prompt
is sent alone to each server: its solo answer (and the servers' warm-up). Then, for each
concurrency C, a closed loop of C clients (each sends its next request once its last is
answered) runs on each system in turn, the order rotated each round, so that the systems
compared at one C run minutes apart at most on a machine whose load drifts.

Clocks: wall-clock tokens/s of the loop, and tokens per CPU-second of the server process
itself: user + system time of it and of its waited-for children, read from /proc/PID/stat
(utime, stime, cutime, cstime) just before and after the loop. The clients run in this process
and are not counted. Exactness: each answer against the same server's solo answer to the same
prompt (must be equal: greedy output does not depend on what else runs), and against the other
server's solo answer (reported only: different kernels may round a near-tie differently).

`--gap`: 4 streams decode (streaming /completion) while a long prompt (`--gap-tokens` of
held-out code, sent as token ids) arrives on a fifth slot; per server, the largest pause between
two events of the running streams from the prompt's arrival until its answer, in seconds and in
decode passes (over the median pause of the streams before the prompt arrived).
"""

from __future__ import annotations

import argparse
import contextlib
import http.client
import itertools
import json
import math
import os
import queue
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from specdecode.api import BESIDE_A_DRAFT
from specdecode.bench.machine import Machine, machine_line
from specdecode.bench.tasks import build_tasks, heldout_files
from specdecode.errors import SpecdecodeError, require

if TYPE_CHECKING:
    from rich.table import Table

HTTP_LEVELS = "1,4,8,16"
HTTP_PROMPTS = 8
READY_SECONDS = 600.0  # a large file loads, repacks and warms up before /health answers 200
GAP_STREAMS = 4
EVENTS_BEFORE = 16  # stream events before the long prompt is sent: the median pause's sample
EVENTS_AFTER = 4  # stream events after its answer: the streams did go on
SAME_STEP = 0.002  # seconds: events nearer than this came from one step


@dataclass(frozen=True)
class System:
    """One server: its name, whose it is, and the command that starts it on a port."""

    name: str
    side: str  # "ours" or "llama"
    speculative: bool
    command: tuple[str, ...]  # "{port}" stands for the port

    def argv(self, port: int) -> list[str]:
        return [part.replace("{port}", str(port)) for part in self.command]


def build_systems(
    target: Path, draft: Path | None, llama_server: Path, threads: int, slots: int, ctx: int
) -> list[System]:
    """Ours plain and speculative, llama-server plain and (with a draft) drafting: the same
    files, threads, slots and context per slot."""
    ours = [
        sys.executable, "-m", "specdecode.cli", "serve", "-m", str(target), "--port", "{port}",
        "--threads", str(threads), "-np", str(slots), "-c", str(ctx),
    ]  # fmt: skip
    spec = ["-md", str(draft)] if draft is not None else ["--spec-type", ",".join(BESIDE_A_DRAFT)]
    llama = [
        str(llama_server), "-m", str(target), "--port", "{port}", "-t", str(threads),
        "-np", str(slots), "-c", str(ctx * slots), "-cb", "--no-webui",
    ]  # fmt: skip
    systems = [
        System("ours", "ours", False, tuple(ours)),
        System("ours-spec", "ours", True, (*ours, *spec)),
        System("llama", "llama", False, tuple(llama)),
    ]
    if draft is not None:
        drafting = ("-md", str(draft), "--spec-type", "draft-simple", "-td", str(threads))
        systems.append(System("llama-draft", "llama", True, (*llama, *drafting)))
    return systems


def chosen(systems: list[System], names: str | None) -> list[System]:
    """The systems named (all without a list: each runs a server, and memory may not hold all)."""
    if names is None:
        return systems
    wanted = [name.strip() for name in names.split(",") if name.strip()]
    known = [s.name for s in systems]
    for name in wanted:
        if name not in known:
            raise SpecdecodeError(f"unknown system {name!r} for --http (here: {', '.join(known)})")
    return [s for s in systems if s.name in wanted]


def counterpart(system: System, systems: list[System]) -> System | None:
    """The other server's system of the same kind: plain against plain, draft against draft."""
    for other in systems:
        if other.side != system.side and other.speculative == system.speculative:
            return other
    return None


def process_cpu_seconds(pid: int) -> float:
    """User + system seconds of a process and of its waited-for children, all threads, from
    /proc/PID/stat (fields 14-17, after the command name, which may hold spaces)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError as exc:
        raise SpecdecodeError(f"cannot read the CPU time of process {pid}: {exc}") from None
    fields = text[text.rindex(")") + 2 :].split()
    utime, stime, cutime, cstime = (int(value) for value in fields[11:15])
    return (utime + stime + cutime + cstime) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class Server:
    """A server child process on a free port, its output in a log file; stopped on exit."""

    def __init__(self, system: System, log: Path) -> None:
        self.system = system
        self.port = free_port()
        self.log = log
        with log.open("w") as out:
            self.process = subprocess.Popen(
                system.argv(self.port), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )

    def wait_ready(self, seconds: float = READY_SECONDS) -> None:
        """Until /health answers 200 (llama-server answers 503 while it loads)."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SpecdecodeError(
                    f"{self.system.name} exited with status {self.process.returncode} before it was ready:\n"
                    + self.tail()
                )
            with contextlib.suppress(OSError, http.client.HTTPException):
                status, _ = request(self.port, "GET", "/health", None, 5.0)
                if status == 200:
                    return
            time.sleep(0.2)
        raise SpecdecodeError(f"{self.system.name} was not ready after {seconds:.0f} s:\n" + self.tail())

    def tail(self, lines: int = 15) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-lines:])

    def cpu_seconds(self) -> float:
        return process_cpu_seconds(self.process.pid)

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(15)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


@contextlib.contextmanager
def running(systems: list[System], logs: Path) -> Iterator[list[Server]]:
    """Every system's server, started together and ready; all stopped however the block ends."""
    logs.mkdir(parents=True, exist_ok=True)
    servers: list[Server] = []
    try:
        for system in systems:
            servers.append(Server(system, logs / f"{system.name}.log"))
        for server in servers:
            server.wait_ready()
        yield servers
    finally:
        for server in servers:
            server.stop()


def request(port: int, method: str, path: str, body: dict | None, timeout: float) -> tuple[int, dict]:
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        payload = None if body is None else json.dumps(body)
        connection.request(method, path, payload, {"Content-Type": "application/json"})
        response = connection.getresponse()
        data = response.read()
        try:
            return response.status, json.loads(data)
        except ValueError:
            return response.status, {"error": data[:200].decode(errors="replace")}
    finally:
        connection.close()


def completion_body(prompt: str | list[int], n_predict: int, stream: bool = False) -> dict:
    """The same /completion request for both servers: greedy, fixed length, no prompt cache."""
    return {
        "prompt": prompt,
        "n_predict": n_predict,
        "temperature": 0,
        "ignore_eos": True,
        "cache_prompt": False,
        "return_tokens": True,
        "stream": stream,
    }


@dataclass
class Answer:
    prompt: int  # index into the prompts
    tokens: list[int]
    seconds: float
    error: str | None = None


def complete(port: int, prompt_index: int, prompt: str, n_predict: int, timeout: float) -> Answer:
    began = time.perf_counter()
    try:
        status, data = request(port, "POST", "/completion", completion_body(prompt, n_predict), timeout)
    except (OSError, http.client.HTTPException) as exc:
        return Answer(prompt_index, [], time.perf_counter() - began, f"{type(exc).__name__}: {exc}")
    seconds = time.perf_counter() - began
    if status != 200:
        return Answer(prompt_index, [], seconds, f"HTTP {status}: {str(data.get('error'))[:120]}")
    return Answer(prompt_index, list(data.get("tokens") or []), seconds)


def closed_loop(
    port: int, prompts: list[str], order: list[int], concurrency: int, n_predict: int
) -> list[Answer]:
    """C clients, each sending the next prompt of `order` as soon as its last is answered."""
    todo: queue.Queue[int] = queue.Queue()
    for index in order:
        todo.put(index)
    answers: list[Answer] = []
    lock = threading.Lock()
    timeout = 60.0 + 10.0 * n_predict * len(order)  # a stalled server is an error, not a hang

    def client() -> None:
        while True:
            try:
                index = todo.get_nowait()
            except queue.Empty:
                return
            answer = complete(port, index, prompts[index], n_predict, timeout)
            with lock:
                answers.append(answer)

    workers = [threading.Thread(target=client, daemon=True) for _ in range(concurrency)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    return answers


def level_row(
    system: str,
    concurrency: int,
    round_index: int,
    answers: list[Answer],
    seconds: float,
    cpu_seconds: float,
    solo: dict[int, list[int]],
    other_solo: dict[int, list[int]] | None,
) -> dict:
    """One system's loop at one concurrency: its clocks, latencies and exactness counts."""
    good = [a for a in answers if a.error is None]
    tokens = sum(len(a.tokens) for a in good)
    return {
        "system": system,
        "concurrency": concurrency,
        "round": round_index,
        "requests": len(answers),
        "errors": len(answers) - len(good),
        "error_sample": next((a.error for a in answers if a.error is not None), None),
        "tokens": tokens,
        "seconds": seconds,
        "cpu_seconds": cpu_seconds,
        "latencies": [a.seconds for a in good],
        "solo_equal": sum(a.tokens == solo.get(a.prompt) for a in good),
        "solo_differs": [
            [a.prompt, first_difference(a.tokens, solo[a.prompt])] for a in good if a.tokens != solo[a.prompt]
        ],
        "cross_equal": None
        if other_solo is None
        else sum(a.tokens == other_solo.get(a.prompt) for a in good),
    }


def first_difference(tokens: list[int], expected: list[int]) -> int:
    """The position of the first token that differs (the shorter length if one is a prefix)."""
    return next(
        (i for i, (a, b) in enumerate(zip(tokens, expected, strict=False)) if a != b),
        min(len(tokens), len(expected)),
    )


def percentile(values: list[float], fraction: float) -> float:
    """The nearest-rank percentile (the value below which `fraction` of them lie)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(fraction * len(ordered)) - 1))]


def summarize(rows: list[dict]) -> list[dict]:
    """Per system and concurrency, over the rounds: tokens over summed seconds (each clock), the
    latencies pooled, the counts summed; each round's tokens/s kept beside."""
    groups: dict[tuple[str, int], list[dict]] = {}
    for row in rows:
        groups.setdefault((row["system"], row["concurrency"]), []).append(row)
    summary = []
    for (system, concurrency), group in groups.items():
        tokens = sum(r["tokens"] for r in group)
        seconds = sum(r["seconds"] for r in group)
        cpu = sum(r["cpu_seconds"] for r in group)
        latencies = [value for r in group for value in r["latencies"]]
        crosses = [r["cross_equal"] for r in group]
        summary.append(
            {
                "system": system,
                "concurrency": concurrency,
                "rounds": len(group),
                "requests": sum(r["requests"] for r in group),
                "errors": sum(r["errors"] for r in group),
                "tokens": tokens,
                "tokens_per_second": tokens / seconds if seconds > 0 else 0.0,
                "tokens_per_cpu_second": tokens / cpu if cpu > 0 else 0.0,
                "round_tokens_per_second": [r["tokens"] / r["seconds"] for r in group if r["seconds"] > 0],
                "p50_s": percentile(latencies, 0.50),
                "p95_s": percentile(latencies, 0.95),
                "solo_equal": sum(r["solo_equal"] for r in group),
                "cross_equal": None if None in crosses else sum(crosses),
            }
        )
    return summary


def exact_cell(row: dict) -> str:
    """`solo n/N`, and `cross n/N` where the other server has a counterpart."""
    answered = row["requests"] - row["errors"]
    text = f"solo {row['solo_equal']}/{answered}"
    return text if row["cross_equal"] is None else f"{text}, cross {row['cross_equal']}/{answered}"


def table(summary: list[dict], systems: list[str], levels: list[int]) -> Table:
    from rich.table import Table

    grid = Table(
        title="tok/s, tok/server-CPU-s, p50/p95 latency s; errors; answers equal to solo / other server's"
    )
    grid.add_column("system")
    for c in levels:
        grid.add_column(f"C={c}", justify="right")
    index = {(r["system"], r["concurrency"]): r for r in summary}
    for name in systems:
        cells = []
        for c in levels:
            row = index[(name, c)]
            cells.append(
                f"{row['tokens_per_second']:.0f}, {row['tokens_per_cpu_second']:.0f}, "
                f"{row['p50_s']:.2f}/{row['p95_s']:.2f}\n"
                + (f"[red]{row['errors']} errors[/red] " if row["errors"] else "")
                + exact_cell(row)
            )
        grid.add_row(name, *cells)
    return grid


def markdown(summary: list[dict], systems: list[str], levels: list[int]) -> str:
    index = {(r["system"], r["concurrency"]): r for r in summary}
    lines = ["| system | " + " | ".join(f"C={c}" for c in levels) + " |", "|---|" + "---:|" * len(levels)]
    for name in systems:
        cells = []
        for c in levels:
            row = index[(name, c)]
            errors = f", {row['errors']} errors" if row["errors"] else ""
            cells.append(
                f"{row['tokens_per_second']:.0f} tok/s, {row['tokens_per_cpu_second']:.0f} tok/CPU-s, "
                f"p50 {row['p50_s']:.2f} s, p95 {row['p95_s']:.2f} s{errors}, {exact_cell(row)}"
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


@dataclass
class Stream:
    """One streaming /completion: the arrival time of each event that carried tokens."""

    times: list[float] = field(default_factory=list)
    finished: bool = False  # it ended by itself (its token limit), not stopped here
    error: str | None = None


def stream_events(port: int, prompt: str, n_predict: int, stream: Stream, stop: threading.Event) -> None:
    """Read a /completion stream, timing its events, until it ends or `stop` is set."""
    connection = http.client.HTTPConnection("127.0.0.1", port, timeout=600)
    try:
        connection.request("POST", "/completion", json.dumps(completion_body(prompt, n_predict, stream=True)))
        response = connection.getresponse()
        if response.status != 200:
            stream.error = f"HTTP {response.status}"
            return
        for line in response:
            if stop.is_set():
                return
            if not line.startswith(b"data: "):
                continue
            event = json.loads(line[6:])
            if event.get("stop"):
                stream.finished = True
                return
            if event.get("tokens") or event.get("content"):
                stream.times.append(time.perf_counter())
    except (OSError, http.client.HTTPException, ValueError) as exc:
        stream.error = f"{type(exc).__name__}: {exc}"
    finally:
        connection.close()


def pauses(times: list[float]) -> list[tuple[float, float]]:
    """(end time, length) of each pause between consecutive steps of a stream. Events closer
    than `SAME_STEP` are one step's: llama-server sends each accepted draft token as an event."""
    steps = times[:1] + [t for earlier, t in itertools.pairwise(times) if t - earlier >= SAME_STEP]
    return [(later, later - earlier) for earlier, later in itertools.pairwise(steps)]


def gap_figures(streams: list[Stream], sent: float, answered: float) -> dict:
    """The largest pause of any stream that ended after the long prompt was sent and began
    before its answer came, in seconds and over the median pause before it was sent."""
    before = [length for s in streams for end, length in pauses(s.times) if end <= sent]
    during = [
        length for s in streams for end, length in pauses(s.times) if end > sent and end - length < answered
    ]
    median = statistics.median(before) if before else float("nan")
    largest = max(during, default=float("nan"))
    return {
        "median_pause_s": median,
        "largest_gap_s": largest,
        "gap_passes": largest / median if before and during and median > 0 else float("nan"),
        "prefill_wait_s": answered - sent,
        "streams_ended_early": sum(s.finished for s in streams),
        "stream_errors": [s.error for s in streams if s.error is not None],
    }


def long_prompt(port: int, n_tokens: int) -> list[int]:
    """`n_tokens` token ids of held-out code, by the server's own /tokenize."""
    text, files = "", iter(heldout_files())
    while len(text) < 8 * n_tokens:  # code is about 3-4 characters a token: ample
        path = next(files, None)
        if path is None:
            break
        text += path.read_text(errors="replace")
    status, data = request(port, "POST", "/tokenize", {"content": text}, 120.0)
    ids = data.get("tokens") if status == 200 else None
    if not ids or len(ids) < n_tokens:
        raise SpecdecodeError(f"the held-out files gave {len(ids or [])} tokens, not the {n_tokens} asked")
    return ids[:n_tokens]


def gap_run(server: Server, prompts: list[str], ids: list[int], ctx: int) -> dict:
    """4 streams decoding, then the long prompt alone on a fifth slot; the streams' pauses."""
    stop = threading.Event()
    streams = [Stream() for _ in range(GAP_STREAMS)]
    n_predict = min(2048, ctx - 256)  # long enough to outlast the long prompt's prefill
    workers = [
        threading.Thread(
            target=stream_events, args=(server.port, prompts[i % len(prompts)], n_predict, s, stop)
        )
        for i, s in enumerate(streams)
    ]
    for worker in workers:
        worker.start()
    try:
        wait_for(lambda: all(len(s.times) >= EVENTS_BEFORE or s.error or s.finished for s in streams))
        sent = time.perf_counter()
        status, data = request(server.port, "POST", "/completion", completion_body(ids, 1), 1800.0)
        answered = time.perf_counter()
        counts = [len(s.times) for s in streams]
        wait_for(
            lambda: all(
                len(s.times) >= n + EVENTS_AFTER or s.error or s.finished
                for s, n in zip(streams, counts, strict=True)
            )
        )
    finally:
        stop.set()
        for worker in workers:
            worker.join()
    figures = gap_figures(streams, sent, answered)
    figures["prompt_tokens"] = len(ids)
    figures["prompt_error"] = None if status == 200 else f"HTTP {status}: {data.get('error')}"
    return {"system": server.system.name, **figures}


def wait_for(condition, seconds: float = 600.0) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() > deadline:
            raise SpecdecodeError(f"the streams did not get going within {seconds:.0f} s")
        time.sleep(0.01)


def run(args: argparse.Namespace) -> None:
    """The whole comparison: servers up, solo answers, the loops, the gap run, the report."""
    levels = [int(c) for c in (args.concurrency or HTTP_LEVELS).split(",")]
    check_args(args, levels)
    console = require("rich.console", "specdecode bench-serve").Console()
    slots = max(*levels, GAP_STREAMS + 1 if args.gap else 1)
    ctx = args.ctx_size or (args.gap_tokens + 512 if args.gap else 1024)
    systems = chosen(
        build_systems(args.target, args.draft, args.llama_server, args.threads, slots, ctx), args.systems
    )
    names = [s.name for s in systems]
    prompts = list(build_tasks(["completion"], args.prompts or HTTP_PROMPTS)[0].prompts)
    machine = Machine()
    console.print(
        f"target {args.target}  draft {args.draft}  {args.n_predict} tokens a request, {slots} slots"
    )
    rows: list[dict] = []
    gaps: list[dict] = []
    with running(systems, args.out / "logs") as servers:
        solo = {s.system.name: solo_answers(s, prompts, args.n_predict) for s in servers}
        for concurrency in levels:
            order = [i % len(prompts) for i in range(max(concurrency * args.requests, len(prompts)))]
            for round_index in range(args.rounds):
                turn = round_index % len(servers)
                for server in servers[turn:] + servers[:turn]:
                    other = counterpart(server.system, systems)
                    cpu_before, began = server.cpu_seconds(), time.perf_counter()
                    answers = closed_loop(server.port, prompts, order, concurrency, args.n_predict)
                    seconds, cpu = time.perf_counter() - began, server.cpu_seconds() - cpu_before
                    row = level_row(
                        server.system.name, concurrency, round_index, answers, seconds, cpu,
                        solo[server.system.name], None if other is None else solo[other.name],
                    )  # fmt: skip
                    rows.append(row)
                    print(progress_line(row), flush=True)  # plain: one line each, however long
        if args.gap:
            ids = long_prompt(servers[0].port, args.gap_tokens)
            for server in servers:
                gaps.append(gap_run(server, prompts, ids, ctx))
                print(gap_line(gaps[-1]), flush=True)
    summary = summarize(rows)
    speculation = speculation_exact(solo, systems)
    described = machine.describe(
        {}, "cpu", threads=args.threads, systems={s.name: list(s.command) for s in systems}
    )
    print(machine_line(described))
    console.print(table(summary, names, levels))
    for line in speculation:
        console.print(line)
    args.out.mkdir(parents=True, exist_ok=True)
    result = {
        "machine": described,
        "summary": summary,
        "rows": rows,
        "gap": gaps,
        "speculation_exact": speculation,
        "solo": solo,
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "handler"},
    }
    (args.out / "http.json").write_text(json.dumps(result, indent=2))
    text = machine_line(described) + "\n\n" + markdown(summary, names, levels)
    if gaps:
        text += "\n" + gap_markdown(gaps)
    (args.out / "http.md").write_text(text)
    console.print(f"wrote {args.out / 'http.json'}, {args.out / 'http.md'}")


def check_args(args: argparse.Namespace, levels: list[int]) -> None:
    """The flags' mistakes, before any server starts."""
    if args.model is not None or args.model_draft is not None:
        raise SpecdecodeError("--http takes the GGUF files as --target and --draft, not -m and -md")
    if args.target is None:
        raise SpecdecodeError("--http needs --target FILE.gguf (the GGUF file both servers load)")
    for label, path in (("--target", args.target), ("--draft", args.draft)):
        if path is not None and not path.is_file():
            raise SpecdecodeError(f"{label} {path} is not a file")
    if not args.llama_server.is_file():
        raise SpecdecodeError(
            f"{args.llama_server} is missing: build llama-server with `make llama-tools` "
            "(or give its path with --llama-server)"
        )
    if any(c < 1 for c in levels) or args.requests < 1 or args.rounds < 1 or args.threads < 1:
        raise SpecdecodeError("concurrencies, --requests, --rounds and --threads must be >= 1")
    if args.gap and args.gap_tokens < 16:
        raise SpecdecodeError("--gap-tokens must be >= 16")


def solo_answers(server: Server, prompts: list[str], n_predict: int) -> dict[int, list[int]]:
    """Each prompt sent alone: the answer every concurrent one must equal."""
    answers = {}
    for index, prompt in enumerate(prompts):
        answer = complete(server.port, index, prompt, n_predict, 600.0)
        if answer.error is not None:
            raise SpecdecodeError(
                f"{server.system.name} failed a solo request: {answer.error}\n{server.tail()}"
            )
        answers[index] = answer.tokens
    return answers


def speculation_exact(solo: dict[str, dict[int, list[int]]], systems: list[System]) -> list[str]:
    """Whether each speculative server's solo answers equal its own plain server's."""
    lines = []
    for system in systems:
        plain = next((s for s in systems if s.side == system.side and not s.speculative), None)
        if system.speculative and plain is not None:
            mine, theirs = solo[system.name], solo[plain.name]
            same = sum(mine[i] == theirs[i] for i in mine)
            lines.append(f"{system.name} solo answers equal to {plain.name}'s: {same}/{len(mine)}")
    return lines


def progress_line(row: dict) -> str:
    rate = row["tokens"] / row["seconds"] if row["seconds"] > 0 else 0.0
    per_cpu = row["tokens"] / row["cpu_seconds"] if row["cpu_seconds"] > 0 else 0.0
    cross = "" if row["cross_equal"] is None else f" cross {row['cross_equal']}"
    return (
        f"C={row['concurrency']:<3d} round {row['round']} {row['system']:<12s} {rate:8.1f} tok/s "
        f"{per_cpu:8.1f} tok/CPU-s  errors {row['errors']}  solo {row['solo_equal']}/{row['requests']}{cross}"
    )


def gap_line(gap: dict) -> str:
    return (
        f"gap {gap['system']:<12s} largest {gap['largest_gap_s']:.3f} s = {gap['gap_passes']:.1f} passes "
        f"(median pause {gap['median_pause_s'] * 1000:.1f} ms; prompt of {gap['prompt_tokens']} tokens "
        f"answered in {gap['prefill_wait_s']:.2f} s)"
    )


def gap_markdown(gaps: list[dict]) -> str:
    lines = [
        "| system | largest gap | in decode passes | median pause before | long prompt answered in |",
        "|---|---:|---:|---:|---:|",
    ]
    for gap in gaps:
        lines.append(
            f"| {gap['system']} | {gap['largest_gap_s']:.3f} s | {gap['gap_passes']:.1f} | "
            f"{gap['median_pause_s'] * 1000:.1f} ms | {gap['prefill_wait_s']:.2f} s |"
        )
    return "\n".join(lines) + "\n"
