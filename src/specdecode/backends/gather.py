"""Drafting models batched across sequences, with the strategies left as they are.

A drafting strategy is sequential code: it asks its draft model for logits, looks at them,
asks again. In a batch, every sequence's strategy does that at once, and each of those passes
is one or a few rows: run one after another they cost the batch a pass per sequence per draft
token. `DraftPasses` turns them into one pass per round without rewriting any strategy: the
sequences draft in threads, one at a time (a baton passed around, so no two ever run strategy
code together and shared state needs no new locks), and a thread that asks its model for
logits (`GatheredBackend.evaluate`) hands the baton on and waits. When every sequence still
drafting is waiting, the waiting requests run as one shared pass (`evaluate_groups`) and each
thread resumes with its own logits. A strategy cannot tell the difference: it gets the logits
of its own rows, bit for bit where the backend is row-invariant.

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
from specdecode.backends.batch import RowGroup, evaluate_groups, score_alone

T = TypeVar("T")


@dataclass
class _Request:
    group: RowGroup
    logits: torch.Tensor | None = None
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
            return [_outcome(job) for job in work]
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
                return _outcome(job)
            finally:
                self._local.member = False
                self._remaining -= 1
                self._run_if_all_wait()

    def evaluate(self, group: RowGroup) -> torch.Tensor:
        """The group's logits: from the round's next shared pass when the caller drafts in a
        round, else from a pass of its own."""
        if not getattr(self._local, "member", False):
            return score_alone(group)
        with self._baton:
            request = _Request(group)
            self._waiting.append(request)
            self._run_if_all_wait()
            self._baton.wait_for(lambda: request.done)
        if request.error is not None:
            raise request.error
        assert request.logits is not None
        return request.logits

    def _run_if_all_wait(self) -> None:
        """With the baton held: when every member still drafting waits for logits, run their
        requests as one pass (each alone if the shared pass fails) and wake them."""
        if not self._waiting or len(self._waiting) < self._remaining:
            return
        requests, self._waiting = self._waiting, []
        try:
            results = evaluate_groups([r.group for r in requests])
            self.passes += 1
            for request, logits in zip(requests, results, strict=True):
                request.logits = logits
        except Exception:
            for request in requests:
                request.group.backend.truncate(len(request.group.backend.tokens))
                try:
                    request.logits = score_alone(request.group)
                except Exception as exc:
                    request.error = exc
        for request in requests:
            request.done = True
        self._baton.notify_all()


class GatheredBackend:
    """A draft backend whose passes join the round's shared pass (see `DraftPasses`); every
    other attribute is the wrapped backend's."""

    def __init__(self, backend: Backend, passes: DraftPasses) -> None:
        self.inner = backend
        self.passes = passes

    def __getattr__(self, name: str):
        return getattr(self.inner, name)

    def evaluate(self, ids: Sequence[int], logits_rows: int | None = None) -> torch.Tensor:
        return self.passes.evaluate(RowGroup(self.inner, list(ids), logits_rows=logits_rows))

    def evaluate_tree(self, ids: Sequence[int], parents: Sequence[int]) -> torch.Tensor:
        return self.passes.evaluate(RowGroup(self.inner, list(ids), list(parents)))


def _outcome(job: Callable[[], T]) -> T | BaseException:
    try:
        return job()
    except Exception as exc:
        return exc
