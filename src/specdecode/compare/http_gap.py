"""`specdecode bench-serve --http --gap`: 4 streams decoding while a long prompt arrives on a
fifth slot, and the largest pause of the streams from its arrival until its answer, in seconds
and in decode passes. Apart from the closed-loop measurement (`compare.against_llama`)."""

from __future__ import annotations

import http.client
import itertools
import json
import statistics
import threading
import time
from dataclasses import dataclass, field

from specdecode.bench.tasks import heldout_files
from specdecode.compare.http_servers import Server, completion_body, request
from specdecode.errors import SpecdecodeError

GAP_STREAMS = 4
EVENTS_BEFORE = 16  # stream events before the long prompt is sent: the median pause's sample
EVENTS_AFTER = 4  # stream events after its answer: the streams did go on
SAME_STEP = 0.002  # seconds: events nearer than this came from one step


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
