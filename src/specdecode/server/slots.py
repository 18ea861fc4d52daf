"""Generation slots: N forks of one pipeline, lent to one request at a time, all stepped
together by one batch engine.

Each slot is a `Pipeline.fork()`: the same weights, its own KV caches and per-generation
state, the shared ngram-mod pool and caches. A request waits for a free slot (first come,
first served); of several free slots it gets the one whose cache its prompt reuses most (as
llama-server's --slot-prompt-similarity chooses), else the least recently used. Its
generation then joins the `BatchEngine`, which runs in one thread of its
own so the event loop keeps answering (/health, other streams): every step, one target pass
scores the rows of every running generation (continuous batching, `specdecode.scheduler`),
and generations join and leave between steps. Chunks cross back to the loop through an
asyncio queue. When the consumer stops reading (its client left), its generation leaves the
batch at the next step, is closed (strategies' end() runs) and only then returns the slot: a
slot is never handed out while the engine still uses its caches.

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
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass

from specdecode.api import Pipeline
from specdecode.backends.gather import DraftPasses
from specdecode.constraints import ConstraintSpec
from specdecode.generate import Chunk, Generation, GenerationConfig, reusable_prompt_prefix
from specdecode.sampling import SamplingParams
from specdecode.scheduler import BatchEngine, Entry, LoadRule, PassRecord
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
    n_probs: int | None = None  # alternatives listed with each token's probability (None: none)
    progress: bool = False  # events report the prompt's evaluation (`Progress`)


@dataclass
class Slot:
    id: int
    pipeline: Pipeline
    run: Run | None = None  # the job it runs, if any


@dataclass(frozen=True)
class Progress:
    """How far the prompt's evaluation is (llama-server's prompt_progress): `total` prompt
    tokens, `cache` of them held by the slot's cache, `processed` in the cache now."""

    total: int
    cache: int
    processed: int
    time_ms: float

    def body(self) -> dict[str, int | float]:
        return {
            "total": self.total,
            "cache": self.cache,
            "processed": self.processed,
            "time_ms": self.time_ms,
        }


class _Finished:
    """Marks the end of a worker's events."""


FINISHED = _Finished()


class Outbox:
    """Hands the engine thread's events to one asyncio loop in batches: a step's chunks for
    every run cost one `call_soon_threadsafe` (a wake-up of the loop) rather than one each,
    while the order of each run's events is kept."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._pending: list[tuple[asyncio.Queue, object]] = []

    def post(self, queue: asyncio.Queue, event: object) -> None:
        with self._lock:
            self._pending.append((queue, event))
            if len(self._pending) > 1:  # a delivery is already scheduled and will take it
                return
        with contextlib.suppress(RuntimeError):  # the loop is closed: the server is exiting
            self._loop.call_soon_threadsafe(self._deliver)

    def _deliver(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, []
        for queue, event in pending:
            queue.put_nowait(event)


class Run:
    """A job running in a slot, stepped by the batch engine. Iterate `events()` once; leaving
    the loop early stops the generation at its next step."""

    def __init__(self, slot: Slot, job: Job, task: int) -> None:
        self.slot = slot
        self.job = job
        self.task = task
        self.n_cached = 0  # prompt tokens the slot's cache already held (set by the worker)
        self.n_decoded = 0
        self.generation: Generation | None = None  # once admitted; its stats grow as it runs
        self.admitted = 0.0  # time.perf_counter() at admission
        self.n_reported = -1  # prompt tokens the last Progress event reported
        self.cut = False
        self.stop = threading.Event()
        self._events: asyncio.Queue = asyncio.Queue()

    def report_progress(self, emit: Callable[[object], None]) -> None:
        """A Progress event, if the job asked for them and the prompt advanced since the last."""
        generation = self.generation
        if not self.job.progress or generation is None:
            return
        processed = max(generation.prefilled, self.n_cached)
        if processed > self.n_reported:
            self.n_reported = processed
            ms = 1e3 * (time.perf_counter() - self.admitted)
            emit(Progress(len(self.job.prompt), self.n_cached, processed, ms))

    async def events(self) -> AsyncIterator[Chunk | Generation | Progress]:
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
    def __init__(
        self,
        pipelines: list[Pipeline],
        metrics: Metrics,
        rule: LoadRule | None = None,
        draft_passes: DraftPasses | None = None,
        gate: bool | None = None,
        similarity: float = 0.1,
    ) -> None:
        """rule: how drafts shorten as more generations share a pass (None: they do not).
        draft_passes: what the pipelines were forked with to batch their draft models.
        gate: whether the batch drafts only in steps where drafting is expected to pay (None:
        with the rule; see `BatchEngine`), by the adaptive policy's pass costs where the
        pipelines have them. similarity: the part of a prompt a free slot's cache must hold for
        the prompt to go to that slot rather than to the least recently used (0: always LRU)."""
        self.slots = [Slot(index, pipeline) for index, pipeline in enumerate(pipelines)]
        self.size = len(self.slots)
        self.similarity = similarity
        self.closing = False
        self._free: deque[Slot] = deque(self.slots)
        self._waiters: deque[asyncio.Future[Slot]] = deque()
        self._runs: set[Run] = set()
        self._tasks = itertools.count()
        self._metrics = metrics
        models = pipelines[0].policy_models if pipelines else None
        self._engine = BatchEngine(
            rule,
            on_pass=self._record_pass,
            draft_passes=draft_passes,
            gate=gate,
            costs=models.costs if models is not None else None,
        )
        self._joining: deque[tuple[Run, Callable[[object], None], Callable[[], None]]] = deque()
        self._running: dict[int, tuple[Run, Callable[[object], None], Callable[[], None]]] = {}
        self._wake = threading.Condition()
        self._outboxes: dict[asyncio.AbstractEventLoop, Outbox] = {}
        self._stopped = False
        self._thread = threading.Thread(target=self._serve, name="batch-engine", daemon=True)
        self._thread.start()

    @property
    def busy(self) -> int:
        return self.size - len(self._free)

    @property
    def waiting(self) -> int:
        return len(self._waiters)

    async def acquire(self, prompt: Sequence[int] = ()) -> Slot:
        """A free slot, after those who asked before; `Closing` once the server shuts down.
        Start a job on it (`start`) or give it back (`release`). prompt: the ids the job will
        evaluate, when it may reuse a slot's cache (see `_choose`)."""
        if self.closing:
            raise Closing("no new generation starts")
        if self._free and not self._waiters:
            slot = self._choose(prompt)
            self._free.remove(slot)
            return slot
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

    def _choose(self, prompt: Sequence[int]) -> Slot:
        """llama-server's choice of a free slot: the one whose cache `prompt` reuses most, if
        that is more than `similarity` of the prompt, else the least recently used. Reuse is
        counted as the slot's target would keep it (`reusable_prompt_prefix`), so a slot is
        chosen for the positions it actually saves. Free slots' caches are idle: reading them
        here does not race the engine."""
        best, most = self._free[0], 0
        if prompt and self.similarity > 0:
            for slot in self._free:
                reused = reusable_prompt_prefix(slot.pipeline.target, prompt)
                if reused > most and reused > self.similarity * len(prompt):
                    best, most = slot, reused
        return best

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
        """Run `job` on an acquired slot: it joins the batch at the engine's next step; the
        slot is released when its generation has left the batch."""
        loop = asyncio.get_running_loop()
        run = slot.run = Run(slot, job, next(self._tasks))
        self._runs.add(run)
        outbox = self._outboxes.get(loop) or self._outboxes.setdefault(loop, Outbox(loop))

        def emit(event: object) -> None:
            outbox.post(run._events, event)

        def done() -> None:
            self._runs.discard(run)
            self.release(slot)

        def finish() -> None:
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(done)

        with self._wake:
            self._joining.append((run, emit, finish))
            self._wake.notify()
        return run

    def _serve(self) -> None:
        """The engine's thread: admit new jobs, step the batch, hand events over, repeat;
        sleep while there is nothing to do."""
        while True:
            with self._wake:
                while not self._stopped and not self._joining and not len(self._engine):
                    self._wake.wait()
                if self._stopped:
                    return
                joining = list(self._joining)
                self._joining.clear()
            for run, emit, finish in joining:
                self._admit(run, emit, finish)
            for entry in self._engine.entries:
                run = self._running[id(entry)][0]
                entry.cancelled = entry.cancelled or run.stop.is_set()
            try:
                left = self._engine.step()
                for entry in self._engine.entries:  # still evaluating their prompts
                    run, emit, _ = self._running[id(entry)]
                    run.report_progress(emit)
            except Exception as exc:  # a bug outside any one sequence: fail the batch, keep serving
                for entry in self._engine.entries:
                    entry.error = exc
                    entry.generation.close()
                left, self._engine.entries = self._engine.entries, []
            for entry in left:
                self._leave(entry)

    def _admit(self, run: Run, emit: Callable[[object], None], finish: Callable[[], None]) -> None:
        """A job's generation joins the batch; one that cannot start gets its error at once."""
        pipeline, job = run.slot.pipeline, run.job
        try:
            if not job.cache_prompt:
                pipeline.target.truncate(0)
            run.n_cached = reusable_prompt_prefix(pipeline.target, job.prompt)
            generation = pipeline.stream(
                job.prompt, job.sampling, job.config, draft_config=job.draft, constraint=job.constraint
            )
            generation.keep_logits = job.n_probs is not None  # probabilities are read from them
        except Exception as exc:  # reaches the request as a 500; the slot stays usable
            self._metrics.record_failure()
            emit(exc)
            emit(FINISHED)
            finish()
            return

        def chunk(event: Chunk) -> None:
            run.report_progress(emit)  # the prompt's last batch, before its first token
            run.n_decoded += len(event.tokens)
            emit(event)

        run.generation, run.admitted = generation, time.perf_counter()
        run.report_progress(emit)  # nothing evaluated yet: the cached tokens
        entry = self._engine.add(generation, chunk)
        self._running[id(entry)] = (run, emit, finish)

    def _leave(self, entry: Entry) -> None:
        """A generation left the batch (finished, cut or failed): its reader gets the end."""
        _, emit, finish = self._running.pop(id(entry))
        if entry.error is not None:  # reaches the request as a 500; the slot stays usable
            self._metrics.record_failure()
            emit(entry.error)
        else:
            self._metrics.record(entry.generation.stats)
            emit(entry.generation)
        emit(FINISHED)
        finish()

    def _record_pass(self, record: PassRecord) -> None:
        self._metrics.record_pass(record.sequences, record.rows, record.seconds)

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
        """At exit: the engine stops after its current step."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
