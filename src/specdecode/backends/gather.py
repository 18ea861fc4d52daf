"""Drafting models (and EAGLE-3 heads) batched across sequences, strategies left as they are.

A drafting strategy is sequential code: it asks its draft model for logits, looks at them,
asks again. In a batch, every sequence's strategy does that at once, and each of those passes
is one or a few rows: run one after another they cost the batch a pass per sequence per draft
token. `DraftPasses` turns them into one pass per round without rewriting any strategy: the
sequences draft in threads, one at a time (a baton passed around, so no two ever run strategy
code together and shared state needs no new locks), and a thread that asks its model for
logits (`GatheredBackend.evaluate`, or an EAGLE-3 head's step) hands the baton on and waits.
When every sequence still drafting is waiting, the waiting requests run as one shared pass per
kind (`evaluate_groups` for draft models, `Eagle3Head.step_many` for a head) and each thread
resumes with its own result. A strategy cannot tell the difference: it gets the logits of its
own rows, bit for bit where the backend is row-invariant.

Outside a round (a generation alone), a GatheredBackend is its backend: every call goes
straight through.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

import torch

from specdecode.backends import Backend
from specdecode.backends.batch import RowGroup, evaluate_each

T = TypeVar("T")


# run(items) -> one result per item, or the exception that item's part raised.
BatchCall = Callable[[list], list]


@dataclass
class _Request:
    key: object  # requests with equal keys run in one call
    item: object
    run: BatchCall
    result: object = None
    error: BaseException | None = None
    done: bool = False


class DraftPasses:
    """Rounds of drafting in which the draft models' passes are shared (module docstring)."""

    def __init__(self) -> None:
        self._baton = threading.Condition()  # held by the one thread running strategy code
        self._local = threading.local()  # .member: the thread drafts in the current round
        self._remaining = 0  # members of the current round that have not finished drafting
        self._waiting: list[_Request] = []
        self._pool: ThreadPoolExecutor | None = None
        self._threads = 0
        self.passes = 0  # shared passes run

    def round(self, work: Sequence[Callable[[], T]]) -> list[T | BaseException]:
        """Run every callable (one sequence's drafting each) in a thread of its own, their
        model passes shared; each result, or the exception it raised, in order."""
        if len(work) < 2:
            return [outcome(job) for job in work]
        if self._pool is None or self._threads < len(work):  # every member needs its thread
            if self._pool is not None:
                self._pool.shutdown(wait=False)
            self._pool = ThreadPoolExecutor(len(work), thread_name_prefix="draft")
            self._threads = len(work)
        with self._baton:
            self._remaining = len(work)
        futures = [self._pool.submit(self._member, job) for job in work]
        return [future.result() for future in futures]

    def _member(self, job: Callable[[], T]) -> T | BaseException:
        with self._baton:
            self._local.member = True
            try:
                return outcome(job)
            finally:
                self._local.member = False
                self._remaining -= 1
                self._run_if_all_wait()

    def gather(self, key: object, item: object, run: BatchCall):
        """item's result from one call of `run` over every item waiting with the same key,
        when the caller drafts in a round; else from run([item])."""
        if not getattr(self._local, "member", False):
            (result,) = run([item])
        else:
            with self._baton:
                request = _Request(key, item, run)
                self._waiting.append(request)
                self._run_if_all_wait()
                self._baton.wait_for(lambda: request.done)
            result = request.error if request.error is not None else request.result
        if isinstance(result, BaseException):
            raise result
        return result

    def _run_if_all_wait(self) -> None:
        """With the baton held: when every member still drafting waits, run the waiting
        requests, one call per key, and wake their threads."""
        if not self._waiting or len(self._waiting) < self._remaining:
            return
        requests, self._waiting = self._waiting, []
        by_key: dict[object, list[_Request]] = {}
        for request in requests:
            by_key.setdefault(request.key, []).append(request)
        for group in by_key.values():
            try:
                # Inference mode is per thread, and the thread that runs the call may have left
                # its own drafting (and its inference mode) already.
                with torch.inference_mode():
                    results = group[0].run([r.item for r in group])
                self.passes += 1
            except Exception as exc:
                results = [exc] * len(group)
            for request, result in zip(group, results, strict=True):
                request.result = result
                request.done = True
        self._baton.notify_all()


class GatheredBackend:
    """A draft backend whose passes join the round's shared pass (see `DraftPasses`); every
    other attribute is the wrapped backend's."""

    # A batch's sequences draft in shared passes, a row each a round, not each on its device.
    drafts_on_device = False

    def __init__(self, backend: Backend, passes: DraftPasses) -> None:
        self.inner = backend
        self.passes = passes

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def evaluate(self, ids: Sequence[int], logits_rows: int | None = None) -> torch.Tensor:
        return self.passes.gather(
            GatheredBackend, RowGroup(self.inner, list(ids), logits_rows=logits_rows), evaluate_each
        )

    def evaluate_tree(self, ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        return self.passes.gather(
            GatheredBackend, RowGroup(self.inner, list(ids), list(parents)), evaluate_each
        )


class GatheredHead:
    """An EAGLE-3 head whose steps join the round's shared step (`Eagle3Head.step_many`);
    every other attribute is the head's."""

    def __init__(self, head, passes: DraftPasses) -> None:
        self.inner = head
        self.passes = passes

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def step(self, tokens: list[int], g: torch.Tensor, start: int, cache) -> torch.Tensor:
        return self.passes.gather(self.inner, (tokens, g, start, cache), self.inner.step_many)


def outcome(job: Callable[[], T]) -> T | BaseException:
    """job(), or the exception it raised: one sequence's failure is its own."""
    try:
        return job()
    except Exception as exc:
        return exc
