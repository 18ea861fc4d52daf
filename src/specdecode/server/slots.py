"""Generation slots: N forks of one pipeline, lent to one request at a time.

Each slot is a `Pipeline.fork()`: the same weights, its own KV caches and per-generation
state, the shared ngram-mod pool and caches. A request waits for a free slot (first come,
first served), and its generation runs in a worker thread so the event loop keeps answering
(/health, other streams). Chunks cross back to the loop through an asyncio queue. When the
consumer stops reading (its client left), the worker stops after the current step, closes
the generation (strategies' end() runs) and only then returns the slot: a slot is never
handed out while a thread still uses its caches.

Shutdown (`drain`): requests still waiting for a slot, and any that come later, are refused
at once with `Closing`; running generations get a grace period, then are cut (stopped after
their current step), and their readers see `Closing` after the text generated so far.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from specdecode.api import Pipeline
from specdecode.backends import common_prefix
from specdecode.constraints import ConstraintSpec
from specdecode.generate import Chunk, Generation, GenerationConfig
from specdecode.sampling import SamplingParams
from specdecode.server.metrics import Metrics
from specdecode.strategies import DraftModelConfig


class Closing(Exception):
    """The server is shutting down: no generation starts, a running one was cut."""


@dataclass(frozen=True)
class Job:
    """One validated request: prompt ids and how to generate."""

    prompt: list[int]
    sampling: SamplingParams
    config: GenerationConfig
    draft: DraftModelConfig | None = None  # this request's drafting settings (None: the server's)
    cache_prompt: bool = True  # False: drop the slot's cached prefix, evaluate the whole prompt
    constraint: ConstraintSpec | None = None  # a grammar or schema the output must match (checked)


@dataclass
class Slot:
    id: int
    pipeline: Pipeline
    run: Run | None = None  # the job it runs, if any


class _Finished:
    """Marks the end of a worker's events."""


FINISHED = _Finished()


class Run:
    """A job running in a slot's worker thread. Iterate `events()` once; leaving the loop
    early stops the generation at its next step."""

    def __init__(self, slot: Slot, job: Job, task: int) -> None:
        self.slot = slot
        self.job = job
        self.task = task
        self.n_cached = 0  # prompt tokens the slot's cache already held (set by the worker)
        self.n_decoded = 0
        self.cut = False
        self.stop = threading.Event()
        self._events: asyncio.Queue = asyncio.Queue()

    async def events(self) -> AsyncIterator[Chunk | Generation]:
        """The job's chunks as they come, then its finished Generation; `Closing` instead of
        the Generation when the shutdown cut it."""
        try:
            while (event := await self._events.get()) is not FINISHED:
                if isinstance(event, BaseException):
                    raise event
                if isinstance(event, Generation) and self.cut and event.stats.stop_reason == "abandoned":
                    raise Closing("generation stopped")
                yield event
        finally:
            self.stop.set()


class SlotPool:
    def __init__(self, pipelines: list[Pipeline], metrics: Metrics) -> None:
        self.slots = [Slot(index, pipeline) for index, pipeline in enumerate(pipelines)]
        self.size = len(self.slots)
        self.closing = False
        self._free: deque[Slot] = deque(self.slots)
        self._waiters: deque[asyncio.Future[Slot]] = deque()
        self._runs: set[Run] = set()
        self._tasks = itertools.count()
        self._executor = ThreadPoolExecutor(self.size, thread_name_prefix="slot")
        self._metrics = metrics

    @property
    def busy(self) -> int:
        return self.size - len(self._free)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self) -> Slot:
        """A free slot, after those who asked before; `Closing` once the server shuts down.
        Start a job on it (`start`) or give it back (`release`)."""
        if self.closing:
            raise Closing("no new generation starts")
        if self._free and not self._waiters:
            return self._free.popleft()
        waiter: asyncio.Future[Slot] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled() and waiter.exception() is None:
                self.release(waiter.result())  # handed a slot just as the request was cancelled
            raise
        finally:
            with contextlib.suppress(ValueError):
                self._waiters.remove(waiter)

    def release(self, slot: Slot) -> None:
        """Give a slot back: to the first request still waiting, else to the free ones."""
        slot.run = None
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(slot)
                return
        self._free.append(slot)

    def start(self, slot: Slot, job: Job) -> Run:
        """Run `job` on an acquired slot; the slot is released when the worker is done."""
        loop = asyncio.get_running_loop()
        run = slot.run = Run(slot, job, next(self._tasks))
        self._runs.add(run)

        def emit(event: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the server is exiting
                loop.call_soon_threadsafe(run._events.put_nowait, event)

        def done() -> None:
            self._runs.discard(run)
            self.release(slot)

        def finish() -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(done)

        loop.run_in_executor(self._executor, self._work, run, emit, finish)
        return run

    def _work(self, run: Run, emit: Callable[[object], None], finish: Callable[[], None]) -> None:
        """Runs in a worker thread: generate, hand each chunk over, stop when asked."""
        pipeline, job = run.slot.pipeline, run.job
        try:
            if not job.cache_prompt:
                pipeline.target.truncate(0)
            run.n_cached = min(common_prefix(pipeline.target.tokens, job.prompt), len(job.prompt) - 1)
            generation = pipeline.stream(
                job.prompt, job.sampling, job.config, draft_config=job.draft, constraint=job.constraint
            )
            steps = iter(generation)
            try:
                for chunk in steps:
                    if run.stop.is_set():
                        break
                    run.n_decoded += len(chunk.tokens)
                    emit(chunk)
            finally:
                steps.close()  # runs the generation's finally: strategies end, stop reason set
            self._metrics.record(generation.stats)
            emit(generation)
        except Exception as exc:  # reaches the request as a 500; the slot stays usable
            self._metrics.record_failure()
            emit(exc)
        finally:
            emit(FINISHED)
            finish()

    def close(self) -> None:
        """Refuse every request waiting for a slot, and every later one."""
        self.closing = True
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_exception(Closing("no new generation starts"))

    async def drain(self, grace: float) -> None:
        """Shutdown: `close`, let running generations finish for up to `grace` seconds, then
        cut the rest."""
        self.close()
        deadline = time.monotonic() + grace
        while self._runs and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        for run in self._runs:
            run.cut = True
            run.stop.set()

    def shutdown(self) -> None:
        """At exit: drop generations not started yet; running ones end with their requests."""
        self._executor.shutdown(wait=False, cancel_futures=True)
