"""Generation slots: N forks of one pipeline, lent to one request at a time.

Each slot is a `Pipeline.fork()`: the same weights, its own KV caches and per-generation
state, the shared ngram-mod pool and caches. A request waits on an asyncio queue for a free
slot (first come, first served), and its generation runs in a worker thread so the event
loop keeps answering (/health, other streams). Chunks cross back to the loop through an
asyncio queue. When the consumer stops reading (its client left), the worker stops after the
current step, closes the generation (strategies' end() runs) and only then returns the slot:
a slot is never handed out while a thread still uses its caches.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from specdecode.api import Pipeline
from specdecode.generate import Chunk, Generation, GenerationConfig
from specdecode.sampling import SamplingParams
from specdecode.server.metrics import Metrics


@dataclass(frozen=True)
class Job:
    """One validated request: prompt ids and how to generate."""

    prompt: list[int]
    sampling: SamplingParams
    config: GenerationConfig


class _Finished:
    """Marks the end of a worker's events."""


FINISHED = _Finished()


class SlotPool:
    def __init__(self, pipelines: list[Pipeline], metrics: Metrics) -> None:
        self.size = len(pipelines)
        self._free: asyncio.Queue[Pipeline] = asyncio.Queue()  # binds to the loop that first waits on it
        for pipeline in pipelines:
            self._free.put_nowait(pipeline)
        self._executor = ThreadPoolExecutor(self.size, thread_name_prefix="slot")
        self._metrics = metrics
        self.waiting = 0

    @property
    def busy(self) -> int:
        return self.size - self._free.qsize()

    async def generate(self, job: Job) -> AsyncIterator[Chunk | Generation]:
        """The job's chunks as they come, then its finished Generation (text, tokens, stats).

        Waits for a free slot first. Closing the iterator early (or cancelling the task that
        reads it) stops the generation at its next step and frees the slot."""
        free = self._free
        self.waiting += 1
        try:
            pipeline = await free.get()
        finally:
            self.waiting -= 1
        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        stop = threading.Event()

        def emit(event: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is exiting
                loop.call_soon_threadsafe(events.put_nowait, event)

        def release() -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(free.put_nowait, pipeline)

        loop.run_in_executor(self._executor, self._work, pipeline, job, stop, emit, release)
        try:
            while (event := await events.get()) is not FINISHED:
                if isinstance(event, BaseException):
                    raise event
                yield event
        finally:
            stop.set()

    def _work(
        self,
        pipeline: Pipeline,
        job: Job,
        stop: threading.Event,
        emit: Callable[[object], None],
        release: Callable[[], None],
    ) -> None:
        """Runs in a worker thread: generate, hand each chunk over, stop when asked."""
        try:
            run = pipeline.stream(job.prompt, job.sampling, job.config)
            steps = iter(run)
            try:
                for chunk in steps:
                    if stop.is_set():
                        break
                    emit(chunk)
            finally:
                steps.close()  # runs the generation's finally: strategies end, stop reason set
            self._metrics.record(run.stats)
            emit(run)
        except Exception as exc:  # reaches the request as a 500; the slot stays usable
            self._metrics.record_failure()
            emit(exc)
        finally:
            emit(FINISHED)
            release()

    def shutdown(self) -> None:
        """At exit: drop generations not started yet; running ones end with their requests."""
        self._executor.shutdown(wait=False, cancel_futures=True)
